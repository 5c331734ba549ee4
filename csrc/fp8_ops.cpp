// Host layer of the FP8 wire's ops (ulysses_kernels/wire.py): schemas, input checks, and the
// CPU and CUDA implementations, which fill the parameter structs of kernels/layout_math.h
// for the wire format (rows of D + 4 bytes, kernels/fp8_math.h) and call the torch-free
// kernels. Typed wrappers: ulysses_kernels/kernels/cuda_kernels.py; fakes: extension.py.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "kernels/fp8.h"
#include "message.h"
#include "op_params.h"

#ifdef ULYSSES_KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/fp8.cuh"
#endif

namespace ulysses_kernels {

namespace {

int dtype_code(const at::Tensor& t, const char* op, const std::string& name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kFp8F32;
    case at::kHalf: return kFp8F16;
    case at::kBFloat16: return kFp8BF16;
    default:
      UK_CHECK(false, "ulysses_kernels.", op, ": ", name, ".dtype expected float32, float16 or bfloat16, got ",
               c10::toString(t.scalar_type()));
  }
  return 0;
}

void check_bytes(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  UK_CHECK(t.scalar_type() == at::kByte, "ulysses_kernels.", op, ": ", name, ".dtype expected uint8 (wire bytes), got ",
           c10::toString(t.scalar_type()));
  UK_CHECK(t.device() == like.device(), "ulysses_kernels.", op, ": ", name, ".device expected ", like.device().str(),
           ", got ", t.device().str());
}

// quant_pack_s2h: tensors [B, s, H_i, D] (one D) -> send, peer-major wire blocks
// [B][s][heads of peer p][D + 4] bytes; with recv, peer `rank`'s block goes to recv viewed as
// [B][S][h(rank)][D + 4] at tokens [seq_offset, seq_offset + s) (as pack_s2h's redirect).
PackParams make_quant_pack(at::TensorList tensors, at::IntArrayRef head_ranges, const at::Tensor& send,
                           const std::optional<at::Tensor>& recv, int64_t rank, int64_t seq_offset, Fp8Args& args) {
  const char* op = "quant_pack_s2h";
  const int64_t n = static_cast<int64_t>(tensors.size());
  const int64_t peers = checked_world_size(op, "tensors", "peer", n, head_ranges);
  const at::Tensor& x0 = tensors[0];
  UK_CHECK(x0.dim() == 4, "ulysses_kernels.quant_pack_s2h: tensors[0] expected 4 dims [B, s, H, D], got shape ",
           list_text(x0.sizes()));
  const int64_t B = x0.size(0), S = x0.size(1), D = x0.size(3), W = D + 4;
  args.d = D;
  args.dtype = dtype_code(x0, op, "tensors[0]");
  check_bytes(send, x0, op, "send");
  PackParams p{};
  p.n_roles = static_cast<int32_t>(n);
  p.n_peers = static_cast<int32_t>(peers);
  p.batch = B;
  p.seq = S;
  p.row_bytes = W;
  p.unit = 1;
  p.units_per_row = W;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& x = tensors[i];
    const std::string name = message("tensors[", i, "]");
    UK_CHECK(x.dim() == 4 && x.size(0) == B && x.size(1) == S && x.size(3) == D && x.scalar_type() == x0.scalar_type() &&
                 x.device() == x0.device(),
             "ulysses_kernels.quant_pack_s2h: ", name, " expected [", B, ", ", S, ", *, ", D, "] ",
             c10::toString(x0.scalar_type()), " on ", x0.device().str(), " (as tensors[0]), got ", list_text(x.sizes()), " ",
             c10::toString(x.scalar_type()), " on ", x.device().str());
    p.src[i] = strided4(x);
    p.src_unit_stride[i] = p.src[i].sd;  // the row functions step the source by its D stride
  }
  const int64_t rows = fill_pack_peers(p, op, tensors, head_ranges);
  if (recv.has_value()) {
    check_bytes(*recv, x0, op, "recv");
    redirect_own_rows(p, op, *recv, rank, seq_offset, W, "(D + 4) bytes");
  }
  UK_CHECK(send.dim() == 1 && send.is_contiguous() && send.numel() == (rows - p.redirect_rows) * W,
           "ulysses_kernels.quant_pack_s2h: send expected contiguous 1-D bytes, ", (rows - p.redirect_rows) * W,
           " of them (rows x (D + 4)), got shape ", list_text(send.sizes()));
  p.dst = static_cast<char*>(send.mutable_data_ptr());
  return p;
}

// dequant_unpack_h2s: wire blocks (source-major, then role; [B, s, h_p, D + 4] bytes or the
// flat 1-D piece of them) -> outs [B, s, H, D], replicated heads summed in rank order.
std::vector<std::pair<UnpackParams, Fp8Args>> make_dequant(at::TensorList blocks, at::IntArrayRef head_ranges,
                                                           at::TensorList outs, int64_t fmt) {
  const char* op = "dequant_unpack_h2s";
  const int64_t n = static_cast<int64_t>(outs.size());
  const int64_t peers = checked_world_size(op, "outs", "source", n, head_ranges);
  UK_CHECK(static_cast<int64_t>(blocks.size()) == peers * n, "ulysses_kernels.dequant_unpack_h2s: blocks expected ", peers * n,
           " tensors (world_size ", peers, " x ", n, " roles), got ", blocks.size());
  std::vector<std::pair<UnpackParams, Fp8Args>> plan;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& out = outs[i];
    const std::string oname = message("outs[", i, "]");
    UK_CHECK(out.dim() == 4 && out.device() == outs[0].device(), "ulysses_kernels.dequant_unpack_h2s: ", oname,
             " expected 4 dims [B, s, H, D] on ", outs[0].device().str(), ", got shape ", list_text(out.sizes()));
    const int64_t B = out.size(0), S = out.size(1), H = out.size(2), D = out.size(3), W = D + 4;
    Fp8Args a{D, dtype_code(out, op, oname), static_cast<int>(fmt)};
    UnpackParams p = unpack_output(out, peers);
    p.unit = 1;
    p.units_per_row = D;
    for (int64_t src = 0; src < peers; ++src) {
      const at::Tensor& blk = blocks[src * n + i];
      const std::string bname = message("blocks[", src * n + i, "] (source ", src, ", role ", i, ")");
      const int64_t a0 = head_ranges[(src * n + i) * 2], a1 = head_ranges[(src * n + i) * 2 + 1], h = a1 - a0;
      check_head_range(op, bname, a0, a1, H);
      check_bytes(blk, out, op, bname.c_str());
      const bool flat = blk.dim() == 1 && blk.is_contiguous() && blk.numel() == B * S * h * W;
      UK_CHECK(flat || (blk.dim() == 4 && blk.size(0) == B && blk.size(1) == S && blk.size(2) == h && blk.size(3) == W &&
                        (W == 1 || blk.stride(3) == 1)),
               "ulysses_kernels.dequant_unpack_h2s: ", bname, " expected [", B, ", ", S, ", ", h, ", ", W,
               "] bytes with contiguous rows, or their flat piece, got shape ", list_text(blk.sizes()), " strides ",
               list_text(blk.strides()));
      p.blk[src] = flat ? flat_strided4(blk, B, S, h, W, 1) : strided4(blk);
      p.head0[src] = static_cast<int32_t>(a0);
      p.head1[src] = static_cast<int32_t>(a1);
    }
    plan.emplace_back(p, a);
  }
  return plan;
}

void check_fmt(int64_t fmt) {
  UK_CHECK(fmt == 0 || fmt == 1, "ulysses_kernels: fmt expected 0 (e4m3) or 1 (e5m2), got ", fmt);
}

void quant_pack_s2h_cpu(at::TensorList tensors, at::IntArrayRef head_ranges, const at::Tensor& send,
                        const std::optional<at::Tensor>& recv, int64_t rank, int64_t seq_offset, int64_t fmt) {
  check_fmt(fmt);
  Fp8Args a{0, 0, static_cast<int>(fmt)};
  const PackParams p = make_quant_pack(tensors, head_ranges, send, recv, rank, seq_offset, a);
  quant_pack_cpu(p, a);
}

void dequant_unpack_h2s_cpu(at::TensorList blocks, at::IntArrayRef head_ranges, at::TensorList outs, int64_t fmt) {
  check_fmt(fmt);
  for (const auto& [p, a] : make_dequant(blocks, head_ranges, outs, fmt)) dequant_unpack_cpu(p, a);
}

#ifdef ULYSSES_KERNELS_WITH_CUDA
void check_launch(cudaError_t err, const char* op) {
  UK_CHECK(err == cudaSuccess, "ulysses_kernels.", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

void quant_pack_s2h_cuda(at::TensorList tensors, at::IntArrayRef head_ranges, const at::Tensor& send,
                         const std::optional<at::Tensor>& recv, int64_t rank, int64_t seq_offset, int64_t fmt) {
  check_fmt(fmt);
  Fp8Args a{0, 0, static_cast<int>(fmt)};
  const PackParams p = make_quant_pack(tensors, head_ranges, send, recv, rank, seq_offset, a);
  const c10::cuda::CUDAGuard guard(send.device());
  check_launch(launch_quant_pack(p, a, c10::cuda::getCurrentCUDAStream(send.device().index()).stream()), "quant_pack_s2h");
}

void dequant_unpack_h2s_cuda(at::TensorList blocks, at::IntArrayRef head_ranges, at::TensorList outs, int64_t fmt) {
  check_fmt(fmt);
  const c10::cuda::CUDAGuard guard(outs[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(outs[0].device().index()).stream();
  for (const auto& [p, a] : make_dequant(blocks, head_ranges, outs, fmt)) {
    check_launch(launch_dequant_unpack(p, a, stream), "dequant_unpack_h2s");
  }
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(ulysses_kernels, m) {
  m.def(
      "quant_pack_s2h(Tensor[] tensors, int[] head_ranges, Tensor(a!) send, Tensor(b!)? recv=None, int rank=-1, "
      "int seq_offset=0, int fmt=0) -> ()");
  m.def("dequant_unpack_h2s(Tensor[] blocks, int[] head_ranges, Tensor(a!)[] outs, int fmt=0) -> ()");
}

TORCH_LIBRARY_IMPL(ulysses_kernels, CPU, m) {
  m.impl("quant_pack_s2h", &quant_pack_s2h_cpu);
  m.impl("dequant_unpack_h2s", &dequant_unpack_h2s_cpu);
}

#ifdef ULYSSES_KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(ulysses_kernels, CUDA, m) {
  m.impl("quant_pack_s2h", &quant_pack_s2h_cuda);
  m.impl("dequant_unpack_h2s", &dequant_unpack_h2s_cuda);
}
#endif

}  // namespace ulysses_kernels
