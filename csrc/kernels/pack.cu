// CUDA kernels of the fused pack and unpack. One thread moves one unit (up to 16 bytes)
// per grid-stride step; the index math is layout_math.h, shared with the CPU twin.
#include "pack.cuh"

namespace ulysses_kernels {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 18;

int blocks_for(int64_t work) {
  const int64_t b = (work + kThreads - 1) / kThreads;
  return (int)(b < kMaxBlocks ? b : kMaxBlocks);
}

template <int UNIT>
__global__ void __launch_bounds__(kThreads) pack_kernel(const __grid_constant__ PackParams p) {
  const int64_t n = p.peer_row0[p.n_peers] * p.units_per_row;
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t row = i / p.units_per_row;
    const int64_t u = i - row * p.units_per_row;
    const RowCopy r = pack_row(p, row);
    copy_unit<UNIT>(r.dst + u * UNIT, r.src + u * r.src_unit_stride);
  }
}

template <class Op, int UNIT>
__global__ void __launch_bounds__(kThreads) unpack_kernel(const __grid_constant__ UnpackParams p) {
  const int64_t n = p.batch * p.seq * p.out_heads * p.units_per_row;
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t row = i / p.units_per_row;
    unpack_unit<Op, UNIT>(p, unpack_out_row(p, row), i - row * p.units_per_row);
  }
}

template <class Op, int UNIT>
cudaError_t launch_unpack_t(const UnpackParams& p, cudaStream_t stream) {
  const int64_t n = p.batch * p.seq * p.out_heads * p.units_per_row;
  if (n == 0) return cudaSuccess;
  unpack_kernel<Op, UNIT><<<blocks_for(n), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
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
  const int blocks = blocks_for(n);
  switch (p.unit) {
    case 16: pack_kernel<16><<<blocks, kThreads, 0, stream>>>(p); break;
    case 8: pack_kernel<8><<<blocks, kThreads, 0, stream>>>(p); break;
    case 4: pack_kernel<4><<<blocks, kThreads, 0, stream>>>(p); break;
    case 2: pack_kernel<2><<<blocks, kThreads, 0, stream>>>(p); break;
    default: pack_kernel<1><<<blocks, kThreads, 0, stream>>>(p); break;
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
