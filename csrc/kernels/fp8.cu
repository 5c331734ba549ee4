// CUDA kernels of the FP8 wire: the row functions of fp8_math.h, one thread per row (a
// (peer, batch, token, head) of the pack, an output (batch, token, head) of the unpack),
// grid-stride. NOTE: correctness first (the CPU twin runs the same code); unmeasured on a
// GPU. A thread reads its row's D elements twice (amax, then quantize), strided across the
// warp's threads by a row: the warp-per-row layout of pack.cu's copies is the next step.
#include <cuda_runtime.h>

#include "fp8.cuh"

namespace ulysses_kernels {

namespace {

constexpr int kFp8Threads = 256;

__global__ void quant_pack_kernel(const PackParams p, const Fp8Args a) {
  const Fp8Format f = fp8_format(a.fmt);
  const int64_t rows = p.peer_row0[p.n_peers];
  for (int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; row < rows; row += (int64_t)gridDim.x * blockDim.x) {
    const RowCopy r = pack_row<int64_t>(p, row);
    quantize_row(r.src, r.src_unit_stride, a.dtype, a.d, r.dst, f);
  }
}

__global__ void dequant_unpack_kernel(const UnpackParams p, const HeadSpan span, const Fp8Args a) {
  const Fp8Format f = fp8_format(a.fmt);
  const int64_t rows = p.batch * p.seq * span.heads;
  for (int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; row < rows; row += (int64_t)gridDim.x * blockDim.x) {
    dequantize_out_row(p, unpack_out_row<int64_t>(p, span, row), a.dtype, f);
  }
}

unsigned grid_for(int64_t rows) {
  const int64_t blocks = (rows + kFp8Threads - 1) / kFp8Threads;
  return (unsigned)(blocks < 65535 ? blocks : 65535);
}

}  // namespace

cudaError_t launch_quant_pack(const PackParams& p, const Fp8Args& a, cudaStream_t stream) {
  const int64_t rows = p.peer_row0[p.n_peers];
  if (rows == 0 || a.d == 0) return cudaSuccess;
  quant_pack_kernel<<<grid_for(rows), kFp8Threads, 0, stream>>>(p, a);
  return cudaGetLastError();
}

cudaError_t launch_dequant_unpack(const UnpackParams& p, const Fp8Args& a, cudaStream_t stream) {
  const HeadSpan span = unpack_head_span(p);
  const int64_t rows = p.batch * p.seq * span.heads;
  if (rows == 0 || a.d == 0) return cudaSuccess;
  dequant_unpack_kernel<<<grid_for(rows), kFp8Threads, 0, stream>>>(p, span, a);
  return cudaGetLastError();
}

}  // namespace ulysses_kernels
