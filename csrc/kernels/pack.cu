// CUDA kernels of the fused pack and unpack. One thread moves one unit (up to 16 bytes)
// per grid-stride step; the index math is layout_math.h, shared with the CPU twin.
#include "pack.cuh"

namespace ulysses_kernels {

namespace {

// gridDim.x (<= kMaxBlocks, see grid_blocks in layout_math.h).
unsigned blocks_for(int64_t work) { return (unsigned)grid_blocks(work); }

// I: the index type (uint32_t when narrow_index(n), see layout_math.h).
template <int UNIT, class I>
__global__ void __launch_bounds__(kThreads) pack_kernel(const __grid_constant__ PackParams p) {
  const I n = (I)(p.peer_row0[p.n_peers] * p.units_per_row);
  const I upr = (I)p.units_per_row;
  const I step = (I)gridDim.x * blockDim.x;
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const I row = i / upr;
    const I u = i - row * upr;
    const RowCopy r = pack_row<I>(p, row);
    copy_unit<UNIT>(r.dst + (int64_t)u * UNIT, r.src + (int64_t)u * r.src_unit_stride);
  }
}

template <class Op, int UNIT, class I>
__global__ void __launch_bounds__(kThreads) unpack_kernel(const __grid_constant__ UnpackParams p) {
  const I n = (I)(p.batch * p.seq * p.out_heads * p.units_per_row);
  const I upr = (I)p.units_per_row;
  const I step = (I)gridDim.x * blockDim.x;
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const I row = i / upr;
    unpack_unit<Op, UNIT>(p, unpack_out_row<I>(p, row), (int64_t)(i - row * upr));
  }
}

template <class Op, int UNIT>
cudaError_t launch_unpack_t(const UnpackParams& p, cudaStream_t stream) {
  const int64_t n = p.batch * p.seq * p.out_heads * p.units_per_row;
  if (n == 0) return cudaSuccess;
  if (narrow_index(n)) {
    unpack_kernel<Op, UNIT, uint32_t><<<blocks_for(n), kThreads, 0, stream>>>(p);
  } else {
    unpack_kernel<Op, UNIT, int64_t><<<blocks_for(n), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <int UNIT>
void launch_pack_t(const PackParams& p, int64_t n, cudaStream_t stream) {
  if (narrow_index(n)) {
    pack_kernel<UNIT, uint32_t><<<blocks_for(n), kThreads, 0, stream>>>(p);
  } else {
    pack_kernel<UNIT, int64_t><<<blocks_for(n), kThreads, 0, stream>>>(p);
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
