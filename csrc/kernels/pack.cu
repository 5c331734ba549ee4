// CUDA kernels of the fused pack and unpack; the index math is layout_math.h, shared with
// the CPU twin. Two variants, chosen per launch (layout_math.h kVariantNew / kVariantWide):
//   new:  both walk warp chunks (layout_math.h LaneWalk): a warp decodes 32 rows, one per
//         lane, then each lane loads kInFlight 16-byte units before storing them, consecutive
//         lanes on consecutive units of the destination; grid = SMs x resident blocks
//         (grid-stride beyond); the unpack does every role (q, k, v) in one launch.
//   wide: the same decode and lane walk over equal shares of the rows per warp (warp_rows:
//         no tail of whole chunks), kWideInFlight (8) units in flight per lane, and the
//         replica sums with every holder's loads of kWideSumInFlight units issued at once.
#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "pack.cuh"

namespace ulysses_kernels {

namespace {

// ---- the "new" variant ---------------------------------------------------------------
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

// Coherent global loads (ld.global, LDG.E.128 without .CONSTANT) for the wide kernels: ptxas
// may not move such a load below a later store of the same thread (it might alias), so the
// kWideInFlight loads of a batch all issue before its first store. With __ldg (.nc, assumed
// read-only) ptxas sank 6 of 8 loads below the first 2 stores to save registers (SASS of
// pack_kernel_wide<16>, sm_90): 2 then 6 loads in flight instead of 8.
template <class V>
__device__ __forceinline__ V load_ordered(const char* p);
template <>
__device__ __forceinline__ uint4 load_ordered<uint4>(const char* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ uint2 load_ordered<uint2>(const char* p) {
  uint2 v;
  asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ unsigned int load_ordered<unsigned int>(const char* p) {
  unsigned int v;
  asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ unsigned short load_ordered<unsigned short>(const char* p) {
  unsigned short v;
  asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ unsigned char load_ordered<unsigned char>(const char* p) {
  unsigned int v;
  asm volatile("ld.global.u8 %0, [%1];" : "=r"(v) : "l"(p));
  return (unsigned char)v;
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

// ---- the "wide" variant ----------------------------------------------------------------
// At least kWideMinBlocks blocks of kThreads per SM (registers capped at 85 a thread): 24
// warps x 32 lanes x kWideInFlight x 16 bytes = 96 KiB of loads in flight per SM. Left to
// itself ptxas gave the unpack 96-128 registers, 2 blocks per SM: less in flight than the
// new kernels. (4 blocks, 64 registers, spilled.) The unpacks that sum replicas keep 2
// blocks (128 registers): their sums spill below that.
constexpr int kWideMinBlocks = 3;
template <class Op>
constexpr int wide_unpack_min_blocks() {
  return std::is_same<Op, CopyOnly>::value ? kWideMinBlocks : 2;
}

// Warp w copies rows [warp_rows(n, w, warps)) in groups of up to kWarp rows: lane l decodes
// row l of the group, then the warp walks the group's units (LaneWalk) with kWideInFlight
// loads before the stores.
template <int UNIT, class I>
__global__ void __launch_bounds__(kThreads, kWideMinBlocks) pack_kernel_wide(const __grid_constant__ PackParams p) {
  using V = typename VecOf<UNIT>::T;
  __shared__ RowCopy rows[kThreads];
  const int lane = threadIdx.x % kWarp;
  RowCopy* mine = rows + (threadIdx.x - lane);
  const RowRange share = warp_rows(p.peer_row0[p.n_peers], (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp,
                                   (int64_t)gridDim.x * kWarpsPerBlock);
  const I upr = (I)p.units_per_row, drow = (I)kWarp / upr, du = (I)kWarp % upr;
  const LaneWalk<I> start = lane_walk_start<I>(lane, upr);
  for (int64_t r = share.begin; r < share.end;) {
    const int64_t e = group_end(r, share.end, share.end);
    const I nr = (I)(e - r);
    if ((I)lane < nr) mine[lane] = pack_row<I>(p, (I)r + (I)lane);
    __syncwarp();
    LaneWalk<I> w = start;
    while (w.row < nr) {
      V v[kWideInFlight];
      char* dst[kWideInFlight];
#pragma unroll
      for (int j = 0; j < kWideInFlight; ++j) {
        dst[j] = nullptr;
        if (w.row < nr) {
          const RowCopy& c = mine[w.row];
          v[j] = load_ordered<V>(c.src + (int64_t)w.u * c.src_unit_stride);
          dst[j] = c.dst + (int64_t)w.u * UNIT;
        }
        lane_walk_step(w, upr, drow, du);
      }
#pragma unroll
      for (int j = 0; j < kWideInFlight; ++j) {
        if (dst[j] != nullptr) store_global<V>(dst[j], v[j]);
      }
    }
    __syncwarp();  // mine[] is rewritten for the next group
    r = e;
  }
}

// The units of a group's rows held by several sources (kind 2), kWideSumInFlight per lane at
// a time: for each source in rank order, the loads of all those units, then their adds; the
// first holder's unit is taken as it is (the order and roundings of unpack_unit, so the
// result is bit-identical to the CPU twin's).
template <class Op, int UNIT, class I>
__device__ __forceinline__ void unpack_sums_wide(const UnpackParams& p, const HeadSpan& span, const UnpackRowCopy* mine,
                                                 I row0, I nr, int lane, I upr, I drow, I du) {
  using V = typename VecOf<UNIT>::T;
  using T = typename Op::T;
  constexpr int N = UNIT / (int)sizeof(T);
  union Buf {
    T v[N];
    V raw;
  };
  LaneWalk<I> w = lane_walk_start<I>(lane, upr);
#pragma unroll 1
  while (w.row < nr) {
    OutRow at[kWideSumInFlight];
    I u[kWideSumInFlight];
    bool on[kWideSumInFlight], got[kWideSumInFlight];
#pragma unroll
    for (int j = 0; j < kWideSumInFlight; ++j) {
      on[j] = w.row < nr && mine[w.row].kind == 2;
      got[j] = false;
      u[j] = w.u;
      if (on[j]) at[j] = unpack_out_row<I>(p, span, row0 + w.row);
      lane_walk_step(w, upr, drow, du);
    }
    Buf acc[kWideSumInFlight];
#pragma unroll 1
    for (int s = 0; s < p.n_src; ++s) {
      Buf in[kWideSumInFlight];
#pragma unroll
      for (int j = 0; j < kWideSumInFlight; ++j) {
        if (on[j] && holds(p, s, at[j].head)) in[j].raw = load_ordered<V>(unpack_src(p, at[j], s, (int64_t)u[j], UNIT));
      }
#pragma unroll
      for (int j = 0; j < kWideSumInFlight; ++j) {
        if (!on[j] || !holds(p, s, at[j].head)) continue;
        if (got[j]) {
#pragma unroll
          for (int e = 0; e < N; ++e) acc[j].v[e] = Op::add(acc[j].v[e], in[j].v[e]);
        } else {
          acc[j] = in[j];
        }
        got[j] = true;
      }
    }
#pragma unroll
    for (int j = 0; j < kWideSumInFlight; ++j) {
      if (on[j]) store_global<V>(unpack_dst(p, at[j], (int64_t)u[j], UNIT), acc[j].raw);
    }
  }
}

// Every role of the unpack in one launch, over the rows of all roles end to end (row0): a
// warp's share may span roles; its groups never do (roles differ in row length).
template <class Op, int UNIT, class I>
__global__ void __launch_bounds__(kThreads, wide_unpack_min_blocks<Op>()) unpack_kernel_wide(const __grid_constant__ UnpackMulti m) {
  using V = typename VecOf<UNIT>::T;
  __shared__ UnpackRowCopy rows[kThreads];
  const int lane = threadIdx.x % kWarp;
  UnpackRowCopy* mine = rows + (threadIdx.x - lane);
  const RowRange share = warp_rows(m.row0[m.n_roles], (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp,
                                   (int64_t)gridDim.x * kWarpsPerBlock);
  for (int64_t r = share.begin; r < share.end;) {
    const int i = unpack_role_of_row(m, r);
    const UnpackParams& p = m.role[i];
    const HeadSpan& span = m.span[i];
    const int64_t e = group_end(r, share.end, m.row0[i + 1]);
    const I row0 = (I)(r - m.row0[i]), nr = (I)(e - r);
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
      V v[kWideInFlight];
      char* dst[kWideInFlight];
#pragma unroll
      for (int j = 0; j < kWideInFlight; ++j) {
        dst[j] = nullptr;
        if (w.row < nr && mine[w.row].kind == 1) {
          const UnpackRowCopy& c = mine[w.row];
          v[j] = load_ordered<V>(c.src + (int64_t)w.u * c.src_unit_stride);
          dst[j] = c.dst + (int64_t)w.u * c.dst_unit_stride;
        }
        lane_walk_step(w, upr, drow, du);
      }
#pragma unroll
      for (int j = 0; j < kWideInFlight; ++j) {
        if (dst[j] != nullptr) store_global<V>(dst[j], v[j]);
      }
    }
    if constexpr (!std::is_same<Op, CopyOnly>::value) {  // no replicas: no sums (csrc/ops.cpp)
      if (sums) unpack_sums_wide<Op, UNIT, I>(p, span, mine, row0, nr, lane, upr, drow, du);
    }
    __syncwarp();  // mine[] is rewritten for the next group
    r = e;
  }
}

template <int UNIT>
void launch_pack_wide_t(const PackParams& p, int64_t n, cudaStream_t stream) {
  const int64_t chunks = warp_chunks(p.peer_row0[p.n_peers]);
  // As the new pack: a group's walk passes its rows by less than kWarp * upr units.
  if (narrow_index(n + kWarp * p.units_per_row)) {
    pack_kernel_wide<UNIT, uint32_t><<<new_grid<pack_kernel_wide<UNIT, uint32_t>>(chunks), kThreads, 0, stream>>>(p);
  } else {
    pack_kernel_wide<UNIT, int64_t><<<new_grid<pack_kernel_wide<UNIT, int64_t>>(chunks), kThreads, 0, stream>>>(p);
  }
}

template <class Op, int UNIT>
cudaError_t launch_unpack_wide_t(const UnpackMulti& m, cudaStream_t stream) {
  const int64_t chunks = m.chunk0[m.n_roles];
  if (chunks == 0) return cudaSuccess;
  int64_t upr = 1;
  for (int i = 0; i < m.n_roles; ++i) upr = m.role[i].units_per_row > upr ? m.role[i].units_per_row : upr;
  if (narrow_index((chunks + 1) * kWarp * upr)) {
    unpack_kernel_wide<Op, UNIT, uint32_t><<<new_grid<unpack_kernel_wide<Op, UNIT, uint32_t>>(chunks), kThreads, 0, stream>>>(m);
  } else {
    unpack_kernel_wide<Op, UNIT, int64_t><<<new_grid<unpack_kernel_wide<Op, UNIT, int64_t>>(chunks), kThreads, 0, stream>>>(m);
  }
  return cudaGetLastError();
}

template <class Op>
cudaError_t launch_unpack_wide_op(const UnpackMulti& m, cudaStream_t stream) {
  switch (m.role[0].unit) {
    case 16: return launch_unpack_wide_t<Op, 16>(m, stream);
    case 8: return launch_unpack_wide_t<Op, 8>(m, stream);
    case 4: return launch_unpack_wide_t<Op, 4>(m, stream);
    case 2: return launch_unpack_wide_t<Op, 2>(m, stream);
    default: return launch_unpack_wide_t<Op, 1>(m, stream);
  }
}

}  // namespace

cudaError_t launch_pack(const PackParams& p, int variant, cudaStream_t stream) {
  const int64_t n = p.peer_row0[p.n_peers] * p.units_per_row;
  if (n == 0) return cudaSuccess;
  const bool wide = variant == kVariantWide;
  switch (p.unit) {
    case 16: wide ? launch_pack_wide_t<16>(p, n, stream) : launch_pack_new_t<16>(p, n, stream); break;
    case 8: wide ? launch_pack_wide_t<8>(p, n, stream) : launch_pack_new_t<8>(p, n, stream); break;
    case 4: wide ? launch_pack_wide_t<4>(p, n, stream) : launch_pack_new_t<4>(p, n, stream); break;
    case 2: wide ? launch_pack_wide_t<2>(p, n, stream) : launch_pack_new_t<2>(p, n, stream); break;
    default: wide ? launch_pack_wide_t<1>(p, n, stream) : launch_pack_new_t<1>(p, n, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_unpack_multi(const UnpackMulti& m, AddType add, int variant, cudaStream_t stream) {
  const bool wide = variant == kVariantWide;
  switch (add) {
    case AddType::kF32: return wide ? launch_unpack_wide_op<AddF32>(m, stream) : launch_unpack_new_op<AddF32>(m, stream);
    case AddType::kF64: return wide ? launch_unpack_wide_op<AddF64>(m, stream) : launch_unpack_new_op<AddF64>(m, stream);
    case AddType::kF16: return wide ? launch_unpack_wide_op<AddF16>(m, stream) : launch_unpack_new_op<AddF16>(m, stream);
    case AddType::kBF16: return wide ? launch_unpack_wide_op<AddBF16>(m, stream) : launch_unpack_new_op<AddBF16>(m, stream);
    default: return wide ? launch_unpack_wide_op<CopyOnly>(m, stream) : launch_unpack_new_op<CopyOnly>(m, stream);
  }
}

}  // namespace ulysses_kernels
