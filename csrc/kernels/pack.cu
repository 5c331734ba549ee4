// CUDA kernels of the fused pack and unpack; the index math is layout_math.h, shared with
// the CPU twin. One variant (layout_math.h kVariantNew): both walk warp chunks (LaneWalk):
// a warp decodes 32 rows, one per lane, then each lane loads kInFlight 16-byte units before
// storing them, consecutive lanes on consecutive units of the destination; grid = SMs x
// resident blocks (grid-stride beyond); the unpack does every role (q, k, v) in one launch.
// (Issue 49: a "wide" variant, equal row shares per warp and 8 units in flight per lane,
// was removed. On an H200, bench/results/2026-11-30_h200_world, it gained 0.6-6.3 points
// of a device copy on the even layouts, but its uneven unpack, 40/8 heads over 5 ranks, ran
// at 25.1% against new's 57.6%.)
#include <cuda_runtime.h>

#include <atomic>

#include "pack.cuh"

namespace ulysses_kernels {

namespace {

// The native vector type of a unit: a 16-byte unit is one uint4, moved by one 128-bit global
// load and store (LDG.E.128.CONSTANT / STG.E.128; docs/performance.md shows the SASS).
template <int UNIT> struct VecOf;
template <> struct VecOf<16> { using T = uint4; };
template <> struct VecOf<8> { using T = uint2; };
template <> struct VecOf<4> { using T = unsigned int; };
template <> struct VecOf<2> { using T = unsigned short; };
template <> struct VecOf<1> { using T = unsigned char; };

constexpr int kWarpsPerBlock = kThreads / kWarp;

// Global loads and stores, said so: the row pointers come from shared memory, where the
// compiler loses their address space and emits generic 128-bit accesses (LD.E.128 /
// ST.E.128) with plain dereferences. Sources are read-only for the kernel's lifetime (they
// never alias the destination), so the loads may take the non-coherent path.
template <class V>
__device__ __forceinline__ V load_global(const char* p) {
  return __ldg(reinterpret_cast<const V*>(p));
}

// Plain (weak) global stores in PTX: __stwb's st.global.wb came out as STG.E.128.STRONG.SM.
template <class V>
__device__ __forceinline__ void store_global(char* p, const V& v);
template <>
__device__ __forceinline__ void store_global<uint4>(char* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}
template <>
__device__ __forceinline__ void store_global<uint2>(char* p, const uint2& v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y));
}
template <>
__device__ __forceinline__ void store_global<unsigned int>(char* p, const unsigned int& v) {
  asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(v));
}
template <>
__device__ __forceinline__ void store_global<unsigned short>(char* p, const unsigned short& v) {
  asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(v));
}
template <>
__device__ __forceinline__ void store_global<unsigned char>(char* p, const unsigned char& v) {
  asm volatile("st.global.u8 [%0], %1;" ::"l"(p), "r"((unsigned int)v));
}

// Rows are decoded into the warp's kWarp slots of `rows` (lane l: row row0 + l), then the
// warp walks the chunk's units (LaneWalk), kInFlight loads before the stores.
template <int UNIT, class I>
__global__ void __launch_bounds__(kThreads) pack_kernel_new(const __grid_constant__ PackParams p) {
  using V = typename VecOf<UNIT>::T;
  __shared__ RowCopy rows[kThreads];
  const int lane = threadIdx.x % kWarp;
  RowCopy* mine = rows + (threadIdx.x - lane);
  const I n_rows = (I)p.peer_row0[p.n_peers];
  const I n_chunks = (I)warp_chunks(p.peer_row0[p.n_peers]);
  const I upr = (I)p.units_per_row, drow = (I)kWarp / upr, du = (I)kWarp % upr;
  const LaneWalk<I> start = lane_walk_start<I>(lane, upr);
  const I warps = (I)gridDim.x * kWarpsPerBlock;
  for (I c = (I)blockIdx.x * kWarpsPerBlock + (I)(threadIdx.x / kWarp); c < n_chunks; c += warps) {
    const I row0 = c * kWarp;
    const I nr = n_rows - row0 < (I)kWarp ? n_rows - row0 : (I)kWarp;
    if ((I)lane < nr) mine[lane] = pack_row<I>(p, row0 + (I)lane);
    __syncwarp();
    LaneWalk<I> w = start;
    while (w.row < nr) {
      V v[kInFlight];
      char* dst[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        dst[j] = nullptr;
        if (w.row < nr) {
          const RowCopy& r = mine[w.row];
          v[j] = load_global<V>(r.src + (int64_t)w.u * r.src_unit_stride);
          dst[j] = r.dst + (int64_t)w.u * UNIT;
        }
        lane_walk_step(w, upr, drow, du);
      }
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        if (dst[j] != nullptr) store_global<V>(dst[j], v[j]);
      }
    }
    __syncwarp();  // mine[] is rewritten for the next chunk
  }
}

// Every role of the unpack in one launch: chunk c belongs to role unpack_role_of_chunk(m, c).
// Rows held once are copied kInFlight units at a time; rows held by several sources (KV
// replicas) are summed unit by unit in rank order (unpack_unit).
template <class Op, int UNIT, class I>
__global__ void __launch_bounds__(kThreads) unpack_kernel_new(const __grid_constant__ UnpackMulti m) {
  using V = typename VecOf<UNIT>::T;
  __shared__ UnpackRowCopy rows[kThreads];
  const int lane = threadIdx.x % kWarp;
  UnpackRowCopy* mine = rows + (threadIdx.x - lane);
  const I n_chunks = (I)m.chunk0[m.n_roles];
  const I warps = (I)gridDim.x * kWarpsPerBlock;
  for (I c = (I)blockIdx.x * kWarpsPerBlock + (I)(threadIdx.x / kWarp); c < n_chunks; c += warps) {
    const int i = unpack_role_of_chunk(m, (int64_t)c);
    const UnpackParams& p = m.role[i];
    const HeadSpan& span = m.span[i];
    const I role_rows = (I)(p.batch * p.seq * span.heads);
    const I row0 = (c - (I)m.chunk0[i]) * kWarp;
    const I nr = role_rows - row0 < (I)kWarp ? role_rows - row0 : (I)kWarp;
    const I upr = (I)p.units_per_row, drow = (I)kWarp / upr, du = (I)kWarp % upr;
    bool sums = false;
    if ((I)lane < nr) {
      mine[lane] = unpack_row_copy(p, unpack_out_row<I>(p, span, row0 + (I)lane));
      sums = mine[lane].kind == 2;
    }
    sums = __any_sync(0xffffffffu, sums);
    __syncwarp();
    LaneWalk<I> w = lane_walk_start<I>(lane, upr);
    while (w.row < nr) {
      V v[kInFlight];
      char* dst[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        dst[j] = nullptr;
        if (w.row < nr && mine[w.row].kind == 1) {
          const UnpackRowCopy& r = mine[w.row];
          v[j] = load_global<V>(r.src + (int64_t)w.u * r.src_unit_stride);
          dst[j] = r.dst + (int64_t)w.u * r.dst_unit_stride;
        }
        lane_walk_step(w, upr, drow, du);
      }
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        if (dst[j] != nullptr) store_global<V>(dst[j], v[j]);
      }
    }
    // Rows held by several sources (KV replicas), unit by unit; a second walk so that the
    // copy loop above keeps its registers (the sums inlined into it spilled on sm_80).
    if (sums) {
      w = lane_walk_start<I>(lane, upr);
#pragma unroll 1
      for (; w.row < nr; lane_walk_step(w, upr, drow, du)) {
        if (mine[w.row].kind == 2) unpack_unit<Op, UNIT>(p, unpack_out_row<I>(p, span, row0 + w.row), (int64_t)w.u);
      }
    }
    __syncwarp();
  }
}

// Blocks of a grid-stride launch of `kernel` over `chunks` warp chunks: no more than the
// work needs, no more than fit on the device at once (SMs x resident blocks per SM).
// The device properties are read once per device and kernel (cached; no host sync).
int resident_blocks(const void* kernel, std::atomic<int>* cache) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 1 << 16;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v > 0) return v;
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess || sms < 1 || per_sm < 1) {
    (void)cudaGetLastError();  // clear it: the launch below reports its own errors
    return 1 << 16;
  }
  v = sms * per_sm;
  cache[dev].store(v, std::memory_order_relaxed);
  return v;
}

// One cache per kernel instantiation (their occupancies may differ).
template <auto Kernel>
unsigned new_grid(int64_t chunks) {
  static std::atomic<int> cache[64];
  const int64_t fit = resident_blocks(reinterpret_cast<const void*>(Kernel), cache);
  const int64_t need = (chunks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return (unsigned)(need < fit ? need : fit);
}

template <int UNIT>
void launch_pack_new_t(const PackParams& p, int64_t n, cudaStream_t stream) {
  const int64_t chunks = warp_chunks(p.peer_row0[p.n_peers]);
  // The 32-bit path's largest index: a chunk's units (< kWarp * upr) beyond the rows.
  if (narrow_index(n + kWarp * p.units_per_row)) {
    pack_kernel_new<UNIT, uint32_t><<<new_grid<pack_kernel_new<UNIT, uint32_t>>(chunks), kThreads, 0, stream>>>(p);
  } else {
    pack_kernel_new<UNIT, int64_t><<<new_grid<pack_kernel_new<UNIT, int64_t>>(chunks), kThreads, 0, stream>>>(p);
  }
}

template <class Op, int UNIT>
cudaError_t launch_unpack_new_t(const UnpackMulti& m, cudaStream_t stream) {
  const int64_t chunks = m.chunk0[m.n_roles];
  if (chunks == 0) return cudaSuccess;
  int64_t upr = 1;
  for (int i = 0; i < m.n_roles; ++i) upr = m.role[i].units_per_row > upr ? m.role[i].units_per_row : upr;
  if (narrow_index((chunks + 1) * kWarp * upr)) {
    unpack_kernel_new<Op, UNIT, uint32_t><<<new_grid<unpack_kernel_new<Op, UNIT, uint32_t>>(chunks), kThreads, 0, stream>>>(m);
  } else {
    unpack_kernel_new<Op, UNIT, int64_t><<<new_grid<unpack_kernel_new<Op, UNIT, int64_t>>(chunks), kThreads, 0, stream>>>(m);
  }
  return cudaGetLastError();
}

template <class Op>
cudaError_t launch_unpack_new_op(const UnpackMulti& m, cudaStream_t stream) {
  switch (m.role[0].unit) {
    case 16: return launch_unpack_new_t<Op, 16>(m, stream);
    case 8: return launch_unpack_new_t<Op, 8>(m, stream);
    case 4: return launch_unpack_new_t<Op, 4>(m, stream);
    case 2: return launch_unpack_new_t<Op, 2>(m, stream);
    default: return launch_unpack_new_t<Op, 1>(m, stream);
  }
}

}  // namespace

cudaError_t launch_pack(const PackParams& p, cudaStream_t stream) {
  const int64_t n = p.peer_row0[p.n_peers] * p.units_per_row;
  if (n == 0) return cudaSuccess;
  switch (p.unit) {
    case 16: launch_pack_new_t<16>(p, n, stream); break;
    case 8: launch_pack_new_t<8>(p, n, stream); break;
    case 4: launch_pack_new_t<4>(p, n, stream); break;
    case 2: launch_pack_new_t<2>(p, n, stream); break;
    default: launch_pack_new_t<1>(p, n, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_unpack_multi(const UnpackMulti& m, AddType add, cudaStream_t stream) {
  switch (add) {
    case AddType::kF32: return launch_unpack_new_op<AddF32>(m, stream);
    case AddType::kF64: return launch_unpack_new_op<AddF64>(m, stream);
    case AddType::kF16: return launch_unpack_new_op<AddF16>(m, stream);
    case AddType::kBF16: return launch_unpack_new_op<AddBF16>(m, stream);
    default: return launch_unpack_new_op<CopyOnly>(m, stream);
  }
}

}  // namespace ulysses_kernels
