// Host layer of the pack/unpack ops: the op schemas (TORCH_LIBRARY), input checks, and
// the CPU and CUDA implementations, which fill the parameter structs of
// kernels/layout_math.h and call the torch-free kernels. Fake kernels and typed wrappers
// live in ulysses_kernels/ops.py.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/pack.h"
#include "message.h"
#include "op_params.h"

#ifdef ULYSSES_KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/pack.cuh"
#endif

namespace ulysses_kernels {

namespace {

// Largest unit (16, 8, 4, 2 or 1 bytes, at least one element) that divides every value
// in `bits` (pointers, strides, row length ORed together); one element when a row is not
// contiguous.
int64_t pick_unit(uint64_t bits, int64_t elem, bool rows_contiguous) {
  if (!rows_contiguous) return elem;
  for (int64_t unit = 16; unit > elem; unit >>= 1) {
    if (bits % static_cast<uint64_t>(unit) == 0) return unit;
  }
  return elem;
}

uint64_t strided_bits(const Strided4& s) {
  return reinterpret_cast<uintptr_t>(s.ptr) | static_cast<uint64_t>(s.sb) | static_cast<uint64_t>(s.ss) |
         static_cast<uint64_t>(s.sh);
}

std::string shape_str(const at::Tensor& t) { return list_text(t.sizes()); }

void check_same(const at::Tensor& t, const at::Tensor& like, const char* op, const std::string& name,
                const char* like_name) {
  UK_CHECK(t.scalar_type() == like.scalar_type(), "ulysses_kernels.", op, ": ", name, ".dtype expected ",
           c10::toString(like.scalar_type()), " (the dtype of ", like_name, "), got ", c10::toString(t.scalar_type()));
  UK_CHECK(t.device() == like.device(), "ulysses_kernels.", op, ": ", name, ".device expected ", like.device().str(),
           " (the device of ", like_name, "), got ", t.device().str());
}

void check_send(const at::Tensor& send, int64_t expected, const char* op) {
  UK_CHECK(send.dim() == 1 && send.is_contiguous(), "ulysses_kernels.", op,
           ": send expected a contiguous 1-D tensor, got shape ", shape_str(send), " strides ",
           list_text(send.strides()));
  UK_CHECK(send.numel() == expected, "ulysses_kernels.", op, ": send.numel() expected ", expected, ", got ",
           send.numel());
}

// pack_s2h: tensors [B, s, H_i, D] -> send, peer-major [B][s][heads of peer p][D] blocks;
// with `recv`, the block of peer `rank` goes to recv viewed as [B][S][h(rank)][D] at
// tokens [seq_offset, seq_offset + s) instead, and send holds the other peers' blocks only.
PackParams make_pack_s2h(at::TensorList tensors, at::IntArrayRef head_ranges, const at::Tensor& send,
                         const std::optional<at::Tensor>& recv = std::nullopt, int64_t rank = -1,
                         int64_t seq_offset = 0) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  const int64_t peers = checked_world_size("pack_s2h", "tensors", "peer", n, head_ranges);
  const at::Tensor& x0 = tensors[0];
  UK_CHECK(x0.dim() == 4, "ulysses_kernels.pack_s2h: tensors[0] expected 4 dims [B, s, H, D], got shape ",
           shape_str(x0));
  const int64_t B = x0.size(0), S = x0.size(1), D = x0.size(3), elem = x0.element_size();
  PackParams p{};
  p.n_roles = static_cast<int32_t>(n);
  p.n_peers = static_cast<int32_t>(peers);
  p.batch = B;
  p.seq = S;
  p.row_bytes = D * elem;
  bool rows_contiguous = true;
  uint64_t bits = reinterpret_cast<uintptr_t>(send.const_data_ptr()) | static_cast<uint64_t>(p.row_bytes);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& x = tensors[i];
    const std::string name = message("tensors[", i, "]");
    UK_CHECK(x.dim() == 4 && x.size(0) == B && x.size(1) == S && x.size(3) == D, "ulysses_kernels.pack_s2h: ",
             name, ".shape expected [", B, ", ", S, ", *, ", D, "] (batch, seq_local, head_dim of tensors[0]), got ",
             shape_str(x));
    check_same(x, send, "pack_s2h", name, "send");
    p.src[i] = strided4(x);
    rows_contiguous = rows_contiguous && p.src[i].sd == elem;
    bits |= strided_bits(p.src[i]);
  }
  const int64_t rows = fill_pack_peers(p, "pack_s2h", tensors, head_ranges);
  if (recv.has_value()) {
    check_same(*recv, send, "pack_s2h", "recv", "send");
    redirect_own_rows(p, "pack_s2h", *recv, rank, seq_offset, D, "D");
    bits |= reinterpret_cast<uintptr_t>(p.redirect_ptr);
  }
  // With recv, send holds the other peers' blocks only.
  check_send(send, (rows - p.redirect_rows) * D, "pack_s2h");
  p.unit = pick_unit(bits, elem, rows_contiguous);
  p.units_per_row = p.row_bytes / p.unit;
  for (int64_t i = 0; i < n; ++i) p.src_unit_stride[i] = p.unit / elem * p.src[i].sd;
  p.dst = static_cast<char*>(send.mutable_data_ptr());
  return p;
}

// pack_h2s: a local [B, S, h, D] tensor (any strides) -> contiguous send [B][S][h][D]: a pack with one peer.
PackParams make_pack_h2s(const at::Tensor& local, const at::Tensor& send) {
  UK_CHECK(local.dim() == 4, "ulysses_kernels.pack_h2s: local expected 4 dims [B, S, h, D], got shape ",
           shape_str(local));
  check_same(send, local, "pack_h2s", "send", "local");
  const int64_t h = local.size(2);
  return make_pack_s2h({local}, {0, h}, send);
}

struct UnpackLaunch {
  std::vector<UnpackParams> params;  // one per role (q, k, v)
  std::vector<AddType> adds;
};

AddType add_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return AddType::kF32;
    case at::kDouble: return AddType::kF64;
    case at::kHalf: return AddType::kF16;
    case at::kBFloat16: return AddType::kBF16;
    default: return AddType::kCopyOnly;
  }
}

// unpack_h2s: blocks (source-major, then role) [B, s, h_p, D] -> outs [B, s, H, D].
UnpackLaunch make_unpack(at::TensorList blocks, at::IntArrayRef head_ranges, at::TensorList outs) {
  const int64_t n = static_cast<int64_t>(outs.size());
  const int64_t peers = checked_world_size("unpack_h2s", "outs", "source", n, head_ranges);
  UK_CHECK(static_cast<int64_t>(blocks.size()) == peers * n, "ulysses_kernels.unpack_h2s: blocks expected ",
           peers * n, " tensors (world_size ", peers, " x ", n, " roles), got ", blocks.size());
  UnpackLaunch plan;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& out = outs[i];
    const std::string oname = message("outs[", i, "]");
    UK_CHECK(out.dim() == 4, "ulysses_kernels.unpack_h2s: ", oname, " expected 4 dims [B, s, H, D], got shape ",
             shape_str(out));
    check_same(out, outs[0], "unpack_h2s", oname, "outs[0]");
    const int64_t B = out.size(0), S = out.size(1), H = out.size(2), D = out.size(3), elem = out.element_size();
    UnpackParams p = unpack_output(out, peers);
    bool rows_contiguous = p.od == elem;
    uint64_t bits = reinterpret_cast<uintptr_t>(p.out) | static_cast<uint64_t>(p.ob) | static_cast<uint64_t>(p.os) |
                    static_cast<uint64_t>(p.oh) | static_cast<uint64_t>(D * elem);
    bool replicas = false;
    int64_t filled = 0;
    for (int64_t src = 0; src < peers; ++src) {
      const at::Tensor& blk = blocks[src * n + i];
      const std::string bname = message("blocks[", src * n + i, "] (source ", src, ", role ", i, ")");
      const int64_t a = head_ranges[(src * n + i) * 2], b = head_ranges[(src * n + i) * 2 + 1];
      check_head_range("unpack_h2s", bname, a, b, H);
      // A flat block (1-D, contiguous, B * S * h * D elements) is the wire format [B][S][h][D]
      // itself: the exchange passes the pieces of its receive buffer so, with no view per block.
      const bool flat = blk.dim() == 1 && blk.is_contiguous() && blk.numel() == B * S * (b - a) * D;
      UK_CHECK(flat || (blk.dim() == 4 && blk.size(0) == B && blk.size(1) == S && blk.size(2) == b - a && blk.size(3) == D),
               "ulysses_kernels.unpack_h2s: ", bname, ".shape expected [", B, ", ", S, ", ", b - a, ", ", D,
               "], got ", shape_str(blk));
      check_same(blk, out, "unpack_h2s", bname, oname.c_str());
      p.blk[src] = flat ? flat_strided4(blk, B, S, b - a, D * elem, elem) : strided4(blk);
      p.head0[src] = static_cast<int32_t>(a);
      p.head1[src] = static_cast<int32_t>(b);
      rows_contiguous = rows_contiguous && p.blk[src].sd == elem;
      bits |= strided_bits(p.blk[src]);
      if (a < b) {
        replicas = replicas || a < filled;
        filled = std::max(filled, b);
      }
    }
    AddType add = AddType::kCopyOnly;
    if (replicas) {
      add = add_type(out.scalar_type());
      UK_CHECK(add != AddType::kCopyOnly, "ulysses_kernels.unpack_h2s: ", oname,
               ".dtype expected float32, float64, float16 or bfloat16 to sum replicated heads, got ",
               c10::toString(out.scalar_type()));
    }
    p.unit = pick_unit(bits, elem, rows_contiguous);
    p.units_per_row = D * elem / p.unit;
    plan.params.push_back(p);
    plan.adds.push_back(add);
  }
  return plan;
}

// Every role of `plan` as one launch of the new unpack kernel: one unit size (the smallest
// role's), each role's warp chunks after the previous role's.
UnpackMulti unpack_multi(const UnpackLaunch& plan) {
  UnpackMulti m{};
  m.n_roles = static_cast<int32_t>(plan.params.size());
  int64_t unit = 16;
  for (const UnpackParams& p : plan.params) unit = std::min(unit, p.unit);
  m.chunk0[0] = 0;
  for (int i = 0; i < m.n_roles; ++i) {
    UnpackParams p = plan.params[static_cast<size_t>(i)];
    p.units_per_row = p.units_per_row * p.unit / unit;
    p.unit = unit;
    m.role[i] = p;
    m.span[i] = unpack_head_span(p);
    m.chunk0[i + 1] = m.chunk0[i] + warp_chunks(p.batch * p.seq * m.span[i].heads);
  }
  return m;
}

// The element type of the sums of one launch over every role: the outputs share one dtype,
// so every role that sums (KV replicas) sums in that type.
AddType multi_add(const UnpackLaunch& plan) {
  for (AddType a : plan.adds) {
    if (a != AddType::kCopyOnly) return a;
  }
  return AddType::kCopyOnly;
}

void pack_s2h_cpu(at::TensorList tensors, at::IntArrayRef head_ranges, const at::Tensor& send,
                  const std::optional<at::Tensor>& recv, int64_t rank, int64_t seq_offset) {
  pack_cpu(make_pack_s2h(tensors, head_ranges, send, recv, rank, seq_offset));
}

void pack_h2s_cpu(const at::Tensor& local, const at::Tensor& send) { pack_cpu(make_pack_h2s(local, send)); }

void unpack_h2s_cpu(at::TensorList blocks, at::IntArrayRef head_ranges, at::TensorList outs) {
  const UnpackLaunch plan = make_unpack(blocks, head_ranges, outs);
  for (size_t i = 0; i < plan.params.size(); ++i) unpack_cpu(plan.params[i], plan.adds[i]);
}

#ifdef ULYSSES_KERNELS_WITH_CUDA
void check_cuda(cudaError_t err, const char* op) {
  UK_CHECK(err == cudaSuccess, "ulysses_kernels.", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

void pack_s2h_cuda(at::TensorList tensors, at::IntArrayRef head_ranges, const at::Tensor& send,
                   const std::optional<at::Tensor>& recv, int64_t rank, int64_t seq_offset) {
  const PackParams p = make_pack_s2h(tensors, head_ranges, send, recv, rank, seq_offset);
  const c10::cuda::CUDAGuard guard(send.device());
  check_cuda(launch_pack(p, c10::cuda::getCurrentCUDAStream(send.device().index()).stream()), "pack_s2h");
}

void pack_h2s_cuda(const at::Tensor& local, const at::Tensor& send) {
  const PackParams p = make_pack_h2s(local, send);
  const c10::cuda::CUDAGuard guard(send.device());
  check_cuda(launch_pack(p, c10::cuda::getCurrentCUDAStream(send.device().index()).stream()), "pack_h2s");
}

void unpack_h2s_cuda(at::TensorList blocks, at::IntArrayRef head_ranges, at::TensorList outs) {
  const UnpackLaunch plan = make_unpack(blocks, head_ranges, outs);
  const c10::cuda::CUDAGuard guard(outs[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(outs[0].device().index()).stream();
  check_cuda(launch_unpack_multi(unpack_multi(plan), multi_add(plan), stream), "unpack_h2s");
}
#endif

}  // namespace

TORCH_LIBRARY(ulysses_kernels, m) {
  m.def(
      "pack_s2h(Tensor[] tensors, int[] head_ranges, Tensor(a!) send, Tensor(b!)? recv=None, int rank=-1, "
      "int seq_offset=0) -> ()");
  m.def("pack_h2s(Tensor local, Tensor(a!) send) -> ()");
  m.def("unpack_h2s(Tensor[] blocks, int[] head_ranges, Tensor(a!)[] outs) -> ()");
}

TORCH_LIBRARY_IMPL(ulysses_kernels, CPU, m) {
  m.impl("pack_s2h", &pack_s2h_cpu);
  m.impl("pack_h2s", &pack_h2s_cpu);
  m.impl("unpack_h2s", &unpack_h2s_cpu);
}

#ifdef ULYSSES_KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(ulysses_kernels, CUDA, m) {
  m.impl("pack_s2h", &pack_s2h_cuda);
  m.impl("pack_h2s", &pack_h2s_cuda);
  m.impl("unpack_h2s", &unpack_h2s_cuda);
}
#endif

}  // namespace ulysses_kernels
