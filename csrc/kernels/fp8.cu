// CUDA kernels of the FP8 wire: a warp per row (a (peer, batch, token, head) of the pack, an
// output (batch, token, head) of the unpack; both take kFp8RowsInFlight rows at once),
// grid-stride over rows. The lane functions
// are fp8_math.h's, which the CPU twin runs lane by lane: a lane loads 4 elements at once
// where the row allows (fp8_row_vector), the warp's loads of one row are consecutive, and
// the row's amax is a shuffle reduction. The first version (one thread per row, each reading
// its row's D elements alone) ran at 3% of a device copy on an H200 (2026-11-30 record).
#include <cuda_runtime.h>

#include "fp8.cuh"

namespace ulysses_kernels {

namespace {

constexpr int kFp8Threads = 256;  // 8 warps, 8 rows at a time per block

__device__ __forceinline__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// A warp takes kFp8RowsInFlight consecutive rows at a time: when all are register rows
// (fp8_row_in_registers: the common case, D <= 128 contiguous), their loads are all issued
// before the first reduction and nothing is read twice; otherwise row by row, two passes.
__global__ void quant_pack_kernel(const PackParams p, const Fp8Args a) {
  constexpr int R = kFp8RowsInFlight;
  const Fp8Format f = fp8_format(a.fmt);
  const int64_t rows = p.peer_row0[p.n_peers];
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / kWarp);
  for (int64_t row0 = (blockIdx.x * (int64_t)(blockDim.x / kWarp) + threadIdx.x / kWarp) * R; row0 < rows; row0 += warps * R) {
    const int n = rows - row0 < R ? (int)(rows - row0) : R;
    // Loops over the constant R with `i < n` inside, unrolled: constant indices keep r, x and
    // amax in registers (a loop to n put them in a 176-byte stack frame).
    RowCopy r[R];
    bool regs = true;  // the same on every lane of the warp (row data only)
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (i < n) {
        r[i] = pack_row<int64_t>(p, row0 + i);
        regs = regs && fp8_row_in_registers(r[i], a.dtype, a.d);
      }
    }
    if (regs) {
      float x[R][4], amax[R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (i < n) amax[i] = quantize_regs_load(r[i], a.dtype, a.d, lane, x[i]);
      }
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (i < n) quantize_regs_store(r[i], a.d, lane, x[i], warp_max(amax[i]), f);  // n: the same on the whole warp
      }
      continue;
    }
    for (int i = 0; i < n; ++i) {
      const RowCopy q = pack_row<int64_t>(p, row0 + i);  // again, not r[i]: a runtime index would put r on the stack
      const bool vec = fp8_row_vector(q.src, q.src_unit_stride, a.dtype, a.d, q.dst);
      const float amax = warp_max(quantize_row_lane_amax(q.src, q.src_unit_stride, a.dtype, a.d, vec, lane));
      quantize_row_lane_store(q.src, q.src_unit_stride, a.dtype, a.d, q.dst, amax, f, vec, lane);
    }
  }
}

// As the pack: kFp8RowsInFlight output rows a warp, their first holders' bytes loaded before any store where all
// are register rows (dequant_row_in_registers), else row by row.
__global__ void dequant_unpack_kernel(const UnpackParams p, const HeadSpan span, const Fp8Args a) {
  constexpr int R = kFp8RowsInFlight;
  const Fp8Format f = fp8_format(a.fmt);
  const int64_t rows = p.batch * p.seq * span.heads;
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / kWarp);
  for (int64_t row0 = (blockIdx.x * (int64_t)(blockDim.x / kWarp) + threadIdx.x / kWarp) * R; row0 < rows; row0 += warps * R) {
    const int n = rows - row0 < R ? (int)(rows - row0) : R;
    OutRow r[R];
    int s0[R];
    bool regs = true;  // the same on every lane of the warp
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (i < n) {
        r[i] = unpack_out_row<int64_t>(p, span, row0 + i);
        s0[i] = first_holder(p, r[i].head);
        regs = regs && dequant_row_in_registers(p, r[i], a.dtype, s0[i]);
      }
    }
    if (regs) {
      U8x4 q[R];
      float sc[R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (i < n) dequant_regs_load(p, r[i], s0[i], lane, q[i], sc[i]);
      }
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (i < n) dequant_regs_store(p, r[i], s0[i], a.dtype, f, lane, q[i], sc[i]);
      }
      continue;
    }
    for (int i = 0; i < n; ++i) dequantize_out_row_lane(p, unpack_out_row<int64_t>(p, span, row0 + i), a.dtype, f, lane);
  }
}

unsigned grid_for(int64_t rows, int rows_per_warp) {  // a warp per rows_per_warp rows
  const int64_t per_block = kFp8Threads / kWarp * rows_per_warp, blocks = (rows + per_block - 1) / per_block;
  return (unsigned)(blocks < 65535 ? blocks : 65535);
}

}  // namespace

cudaError_t launch_quant_pack(const PackParams& p, const Fp8Args& a, cudaStream_t stream) {
  const int64_t rows = p.peer_row0[p.n_peers];
  if (rows == 0 || a.d == 0) return cudaSuccess;
  quant_pack_kernel<<<grid_for(rows, kFp8RowsInFlight), kFp8Threads, 0, stream>>>(p, a);
  return cudaGetLastError();
}

cudaError_t launch_dequant_unpack(const UnpackParams& p, const Fp8Args& a, cudaStream_t stream) {
  const HeadSpan span = unpack_head_span(p);
  const int64_t rows = p.batch * p.seq * span.heads;
  if (rows == 0 || a.d == 0) return cudaSuccess;
  dequant_unpack_kernel<<<grid_for(rows, kFp8RowsInFlight), kFp8Threads, 0, stream>>>(p, span, a);
  return cudaGetLastError();
}

}  // namespace ulysses_kernels
