// CUDA kernels of the fused pack and unpack; the index math is layout_math.h, shared with
// the CPU twin. The unpack moves one unit (up to 16 bytes) per thread and grid-stride step;
// the pack decodes each send-buffer row once and copies its units with a row of lanes.
#include "pack.cuh"

namespace ulysses_kernels {

namespace {

// I: the index type (uint32_t when narrow_index(units), see layout_math.h).
//
// blockDim = pack_block(units_per_row): blockDim.y rows per step, blockDim.x lanes along
// each. The block's first blockDim.y threads (one warp or a few) decode one row each
// (pack_row: a search over peers and four divisions) into shared memory; then every thread
// copies units threadIdx.x, threadIdx.x + blockDim.x, ... of row threadIdx.y. Consecutive
// threads hold consecutive units of a row, and consecutive rows of a block are consecutive
// in the send buffer, so the stores of a block are one contiguous span.
// NOTE: the decode (about 140 instructions) ran once per 16-byte unit before, now once per
// row: 1/16 as often at D = 128 bf16. Expected to let the pack run at copy bandwidth on an
// H100; unmeasured (no GPU yet): compare with the copy roofline when there is one.
template <int UNIT, class I>
__global__ void __launch_bounds__(kThreads) pack_kernel(const __grid_constant__ PackParams p) {
  __shared__ RowCopy rows[kThreads];
  const I n_rows = (I)p.peer_row0[p.n_peers];
  const I upr = (I)p.units_per_row;
  const I tid = (I)(threadIdx.y * blockDim.x + threadIdx.x);
  const I step = (I)gridDim.x * blockDim.y;
  for (I row0 = (I)blockIdx.x * blockDim.y; row0 < n_rows; row0 += step) {
    if (tid < (I)blockDim.y && row0 + tid < n_rows) rows[tid] = pack_row<I>(p, row0 + tid);
    __syncthreads();
    if (row0 + threadIdx.y < n_rows) {
      const RowCopy r = rows[threadIdx.y];
      for (I u = threadIdx.x; u < upr; u += blockDim.x) {
        copy_unit<UNIT>(r.dst + (int64_t)u * UNIT, r.src + (int64_t)u * r.src_unit_stride);
      }
    }
    __syncthreads();  // rows[] is rewritten by the next step
  }
}

template <class Op, int UNIT, class I>
__global__ void __launch_bounds__(kThreads) unpack_kernel(const __grid_constant__ UnpackParams p,
                                                          const HeadSpan span) {
  const I n = (I)unpack_units(p, span);
  const I upr = (I)p.units_per_row;
  const I step = (I)gridDim.x * blockDim.x;
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const I row = i / upr;
    unpack_unit<Op, UNIT>(p, unpack_out_row<I>(p, span, row), (int64_t)(i - row * upr));
  }
}

template <class Op, int UNIT>
cudaError_t launch_unpack_t(const UnpackParams& p, cudaStream_t stream) {
  const HeadSpan span = unpack_head_span(p);
  const int64_t n = unpack_units(p, span);
  if (n == 0) return cudaSuccess;
  const unsigned blocks = (unsigned)grid_blocks(n);
  if (narrow_index(n)) {
    unpack_kernel<Op, UNIT, uint32_t><<<blocks, kThreads, 0, stream>>>(p, span);
  } else {
    unpack_kernel<Op, UNIT, int64_t><<<blocks, kThreads, 0, stream>>>(p, span);
  }
  return cudaGetLastError();
}

template <int UNIT>
void launch_pack_t(const PackParams& p, int64_t n, cudaStream_t stream) {
  const PackBlock b = pack_block(p.units_per_row);
  const dim3 block((unsigned)b.lanes, (unsigned)b.rows);
  const unsigned blocks = (unsigned)pack_grid(p.peer_row0[p.n_peers], b);
  if (narrow_index(n)) {
    pack_kernel<UNIT, uint32_t><<<blocks, block, 0, stream>>>(p);
  } else {
    pack_kernel<UNIT, int64_t><<<blocks, block, 0, stream>>>(p);
  }
}

template <class Op>
cudaError_t launch_unpack_op(const UnpackParams& p, cudaStream_t stream) {
  switch (p.unit) {
    case 16: return launch_unpack_t<Op, 16>(p, stream);
    case 8: return launch_unpack_t<Op, 8>(p, stream);
    case 4: return launch_unpack_t<Op, 4>(p, stream);
    case 2: return launch_unpack_t<Op, 2>(p, stream);
    default: return launch_unpack_t<Op, 1>(p, stream);
  }
}

}  // namespace

cudaError_t launch_pack(const PackParams& p, cudaStream_t stream) {
  const int64_t n = p.peer_row0[p.n_peers] * p.units_per_row;
  if (n == 0) return cudaSuccess;
  switch (p.unit) {
    case 16: launch_pack_t<16>(p, n, stream); break;
    case 8: launch_pack_t<8>(p, n, stream); break;
    case 4: launch_pack_t<4>(p, n, stream); break;
    case 2: launch_pack_t<2>(p, n, stream); break;
    default: launch_pack_t<1>(p, n, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_unpack(const UnpackParams& p, AddType add, cudaStream_t stream) {
  switch (add) {
    case AddType::kF32: return launch_unpack_op<AddF32>(p, stream);
    case AddType::kF64: return launch_unpack_op<AddF64>(p, stream);
    case AddType::kF16: return launch_unpack_op<AddF16>(p, stream);
    case AddType::kBF16: return launch_unpack_op<AddBF16>(p, stream);
    default: return launch_unpack_op<CopyOnly>(p, stream);
  }
}

}  // namespace ulysses_kernels
