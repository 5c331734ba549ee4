// NCCL collectives as torch ops, stream-ordered on the current CUDA stream: no host
// synchronization, so they can be captured in a CUDA graph. The communicator is the
// integer handle made by _C.nccl_comm_init_rank (csrc/module.cpp). Fake kernels and typed
// wrappers live in ulysses_kernels/ops.py.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "message.h"
#include "nccl_check.h"

namespace ulysses_kernels {
namespace {

ncclComm_t as_comm(int64_t handle) {
  UK_CHECK(handle != 0, "ulysses_kernels: NCCL communicator handle is 0 (destroyed or never created)");
  return reinterpret_cast<ncclComm_t>(static_cast<uintptr_t>(handle));
}

int comm_size(ncclComm_t comm) {
  int n = 0;
  UK_NCCL_CHECK(ncclCommCount(comm, &n), comm);
  return n;
}

void check_buffer(const at::Tensor& t, const char* name, const char* op) {
  UK_CHECK(t.is_cuda(), "ulysses_kernels.", op, ": ", name, " expected a CUDA tensor, got device ", t.device().str());
  UK_CHECK(t.is_contiguous(), "ulysses_kernels.", op, ": ", name, " expected a contiguous tensor, got strides ",
           list_text(t.strides()));
}

void check_splits(at::IntArrayRef splits, int64_t numel, int world, const char* name) {
  UK_CHECK(static_cast<int>(splits.size()) == world, "ulysses_kernels.nccl_all_to_all: ", name, " expected ",
           world, " split sizes (one per rank), got ", splits.size());
  int64_t total = 0;
  for (const int64_t s : splits) {
    UK_CHECK(s >= 0, "ulysses_kernels.nccl_all_to_all: ", name, " expected sizes >= 0, got ", list_text(splits));
    total += s;
  }
  UK_CHECK(total == numel, "ulysses_kernels.nccl_all_to_all: sum(", name, ") expected ", numel,
           " (the buffer's numel), got ", total);
}

// ncclGroupStart ... ncclGroupEnd with the End guaranteed: a send or recv that fails
// (throws) inside the group must still close it, else every later NCCL call of this
// thread is silently queued into a group that never launches (a hang, not an error).
class Group {
 public:
  explicit Group(ncclComm_t comm) : comm_(comm) { UK_NCCL_CHECK(ncclGroupStart(), comm_); }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  void end() {
    open_ = false;
    UK_NCCL_CHECK(ncclGroupEnd(), comm_);
  }
  ~Group() {
    if (open_) (void)ncclGroupEnd();  // already unwinding from an error: keep that one
  }

 private:
  ncclComm_t comm_;
  bool open_ = true;
};

// The collectives run on the current stream of the tensors' device, which must be the
// communicator's device (NCCL would fail later with a less helpful error, or not at all).
void check_comm_device(ncclComm_t comm, const at::Device& device, const char* op) {
  int comm_device = -1;
  UK_NCCL_CHECK(ncclCommCuDevice(comm, &comm_device), comm);
  UK_CHECK(device.index() == comm_device, "ulysses_kernels.", op, ": tensors expected on cuda:", comm_device,
           " (the communicator's device), got ", device.str());
}

bool all_equal(at::IntArrayRef a, at::IntArrayRef b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != a[0] || b[i] != a[0]) return false;
  }
  return true;
}

// Bytes move as ncclUint8: the all-to-all copies and never reduces, so any dtype works.
void nccl_all_to_all(int64_t handle, const at::Tensor& output, const at::Tensor& input, at::IntArrayRef output_splits,
                     at::IntArrayRef input_splits) {
  const ncclComm_t comm = as_comm(handle);
  check_buffer(output, "output", "nccl_all_to_all");
  check_buffer(input, "input", "nccl_all_to_all");
  UK_CHECK(output.scalar_type() == input.scalar_type(), "ulysses_kernels.nccl_all_to_all: output.dtype expected ",
           c10::toString(input.scalar_type()), " (the dtype of input), got ", c10::toString(output.scalar_type()));
  UK_CHECK(output.device() == input.device(), "ulysses_kernels.nccl_all_to_all: output.device expected ",
           input.device().str(), " (the device of input), got ", output.device().str());
  const int world = comm_size(comm);
  check_splits(output_splits, output.numel(), world, "output_splits");
  check_splits(input_splits, input.numel(), world, "input_splits");
  check_comm_device(comm, input.device(), "nccl_all_to_all");
  // Nothing to send or receive: no peer posts anything for this rank either (its splits
  // towards us are our output splits, all zero), so no NCCL call at all. This also keeps a
  // rank whose splits are all 0 (no tokens and no heads) out of the ncclAlltoAll branch
  // below while its peers take the send/recv branch.
  if (input.numel() == 0 && output.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(input.device().index()).stream();
  const size_t elem = input.element_size();
  const char* src = static_cast<const char*>(input.const_data_ptr());
  char* dst = static_cast<char*>(output.mutable_data_ptr());
#if UK_NCCL_HAS_ALLTOALL
  // ncclAlltoAll is a collective: every rank must take this branch together. The splits
  // of a rank are all equal (and non-zero) only when every rank's are (sizes here are
  // s_r * h_p products, see layout.py), so the ranks agree without talking.
  if (all_equal(output_splits, input_splits)) {
    UK_NCCL_CHECK(ncclAlltoAll(src, dst, static_cast<size_t>(input_splits[0]) * elem, ncclUint8, comm, stream), comm);
    return;
  }
#endif
  Group group(comm);
  size_t in_off = 0, out_off = 0;
  for (int peer = 0; peer < world; ++peer) {
    const size_t n_in = static_cast<size_t>(input_splits[peer]) * elem;
    const size_t n_out = static_cast<size_t>(output_splits[peer]) * elem;
    if (n_in) UK_NCCL_CHECK(ncclSend(src + in_off, n_in, ncclUint8, peer, comm, stream), comm);
    if (n_out) UK_NCCL_CHECK(ncclRecv(dst + out_off, n_out, ncclUint8, peer, comm, stream), comm);
    in_off += n_in;
    out_off += n_out;
  }
  group.end();
}

// Point-to-point transfers posted as one NCCL group.
void nccl_send_recv(int64_t handle, at::TensorList sends, at::IntArrayRef send_peers, at::TensorList recvs,
                    at::IntArrayRef recv_peers) {
  const ncclComm_t comm = as_comm(handle);
  UK_CHECK(sends.size() == send_peers.size(), "ulysses_kernels.nccl_send_recv: send_peers expected ", sends.size(),
           " ranks (one per send tensor), got ", send_peers.size());
  UK_CHECK(recvs.size() == recv_peers.size(), "ulysses_kernels.nccl_send_recv: recv_peers expected ", recvs.size(),
           " ranks (one per recv tensor), got ", recv_peers.size());
  if (sends.empty() && recvs.empty()) return;
  const int world = comm_size(comm);
  const at::Device device = sends.empty() ? recvs[0].device() : sends[0].device();
  for (size_t i = 0; i < sends.size() + recvs.size(); ++i) {
    const bool is_send = i < sends.size();
    const at::Tensor& t = is_send ? sends[i] : recvs[i - sends.size()];
    const int64_t peer = is_send ? send_peers[i] : recv_peers[i - sends.size()];
    check_buffer(t, is_send ? "sends[i]" : "recvs[i]", "nccl_send_recv");
    UK_CHECK(t.device() == device, "ulysses_kernels.nccl_send_recv: all tensors expected on ", device.str(), ", got ",
             t.device().str());
    UK_CHECK(peer >= 0 && peer < world, "ulysses_kernels.nccl_send_recv: peer expected in [0, ", world, "), got ",
             peer);
  }
  check_comm_device(comm, device, "nccl_send_recv");
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  // Empty tensors are skipped (their data pointer may be null): a matched send and recv
  // have the same size, so both sides skip the pair, as torch's all-to-all does.
  Group group(comm);
  for (size_t i = 0; i < sends.size(); ++i) {
    const at::Tensor& t = sends[i];
    if (t.numel() == 0) continue;
    UK_NCCL_CHECK(ncclSend(t.const_data_ptr(), t.numel() * t.element_size(), ncclUint8, static_cast<int>(send_peers[i]),
                           comm, stream),
                  comm);
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    const at::Tensor& t = recvs[i];
    if (t.numel() == 0) continue;
    UK_NCCL_CHECK(ncclRecv(t.mutable_data_ptr(), t.numel() * t.element_size(), ncclUint8, static_cast<int>(recv_peers[i]),
                           comm, stream),
                  comm);
  }
  group.end();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ulysses_kernels, m) {
  m.def("nccl_all_to_all(int comm, Tensor(a!) output, Tensor input, int[] output_splits, int[] input_splits) -> ()");
  m.def("nccl_send_recv(int comm, Tensor[] sends, int[] send_peers, Tensor(a!)[] recvs, int[] recv_peers) -> ()");
}

TORCH_LIBRARY_IMPL(ulysses_kernels, CUDA, m) {
  m.impl("nccl_all_to_all", &nccl_all_to_all);
  m.impl("nccl_send_recv", &nccl_send_recv);
}

}  // namespace ulysses_kernels
