// NCCL error checking for the host code: a failed call throws std::runtime_error (a
// Python RuntimeError) that names the call, NCCL's error string, NCCL's last error
// message and the file:line of the call. Torch-free.
#pragma once

#include <nccl.h>

#include <stdexcept>
#include <string>

namespace ulysses_kernels {

inline std::string nccl_error_message(const char* call, ncclResult_t result, ncclComm_t comm, const char* file,
                                      int line) {
  std::string msg = std::string("ulysses_kernels: NCCL error at ") + file + ":" + std::to_string(line) + ": " + call +
                    " returned " + std::to_string(static_cast<int>(result)) + " (" + ncclGetErrorString(result) + ")";
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') msg += ": " + std::string(last);
  return msg;
}

}  // namespace ulysses_kernels

#define UK_NCCL_CHECK(call, comm)                                                                           \
  do {                                                                                                      \
    const ncclResult_t uk_result_ = (call);                                                                 \
    if (uk_result_ != ncclSuccess && uk_result_ != ncclInProgress) {                                        \
      throw std::runtime_error(::ulysses_kernels::nccl_error_message(#call, uk_result_, (comm), __FILE__, __LINE__)); \
    }                                                                                                       \
  } while (0)

// NCCL >= 2.28 has ncclAlltoAll (used when all split sizes are equal).
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define UK_NCCL_HAS_ALLTOALL 1
#else
#define UK_NCCL_HAS_ALLTOALL 0
#endif
