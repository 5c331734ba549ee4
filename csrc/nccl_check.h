// NCCL error checking for the host code: a failed call throws std::runtime_error (a
// Python RuntimeError) that names the call, NCCL's error string, NCCL's last error
// message and the file:line of the call. Torch-free.
//
// Nonblocking communicators (ncclConfig_t.blocking = 0, which torch's ProcessGroupNCCL
// uses under TORCH_NCCL_USE_COMM_NONBLOCKING=1) may answer ncclInProgress: the call is
// still being set up on the host, and NCCL requires polling ncclCommGetAsyncError until
// it settles before the next call on that communicator. That poll waits on NCCL's host
// side only, never on GPU work. Our own communicators are blocking and never see it.
#pragma once

#include <nccl.h>

#include <stdexcept>
#include <string>
#include <thread>

#include "message.h"

namespace ulysses_kernels {

inline std::string nccl_error_message(const char* call, ncclResult_t result, ncclComm_t comm, const char* file,
                                      int line) {
  std::string msg = message("ulysses_kernels: NCCL error at ", file, ":", line, ": ", call, " returned ",
                            static_cast<int>(result), " (", ncclGetErrorString(result), ")");
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') msg += message(": ", last);
  return msg;
}

// The settled state of a communicator: ncclCommGetAsyncError polled while it says
// ncclInProgress. ncclSuccess, or the error that ended the pending work.
inline ncclResult_t nccl_settle(ncclComm_t comm) {
  ncclResult_t state = ncclInProgress;
  while (true) {
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
    if (rc != ncclSuccess) return rc;
    if (state != ncclInProgress) return state;
    std::this_thread::yield();
  }
}

}  // namespace ulysses_kernels

#define UK_NCCL_CHECK(call, comm)                                                                           \
  do {                                                                                                      \
    ncclResult_t uk_result_ = (call);                                                                       \
    if (uk_result_ == ncclInProgress && (comm) != nullptr) uk_result_ = ::ulysses_kernels::nccl_settle(comm); \
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
