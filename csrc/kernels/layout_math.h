// The index math of the fused pack and unpack, shared by the CUDA kernels (pack.cu) and
// their CPU twin (pack_cpu.cpp). Torch-free: raw byte pointers and byte strides.
//
// The layouts are those of ulysses_kernels/layout.py (read its docstring first):
//
//   pack (sequence-sharded -> head-sharded send buffer), seen from rank r:
//     sources: n_roles tensors [B][s][H_i][D], any strides (q, k, v or views of one
//              fused QKV projection output)
//     send:    peer-major blocks; the block for peer p is batch-major
//              [B][s][h_0(p) | h_1(p) | ...][D], where h_i(p) = heads[p][i] heads of
//              role i starting at head0[p][i].
//     One "row" is the D elements of one (peer, batch, token, head); the send buffer is
//     rows laid end to end, so row g starts at byte g * row_bytes. Optionally the block
//     of one peer (the rank itself) is redirected into its rows of the receive buffer
//     [B][S][h(r)][D], at tokens [seq_offset, seq_offset + s).
//
//   unpack (received blocks -> [B][s][H][D] output of one role):
//     sources p = 0..P-1 each hold global heads [head0[p], head1[p]) as a [B][s][h_p][D]
//     strided view. For every output element, the first source in rank order that holds
//     its head is copied, each later holder is added (exactly the order of
//     layout.unpack_h2s, so the float result is bit-identical).
//
// A "unit" is the chunk of bytes one thread moves at once (16 bytes where pointers,
// strides and the row length allow; down to one element otherwise).
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define UK_HD __host__ __device__ __forceinline__
#else
#define UK_HD inline
#endif

namespace ulysses_kernels {

constexpr int kMaxPeers = 64;
constexpr int kMaxRoles = 3;
// Head indices and per-peer head counts are int32_t below: the structs are kernel
// parameters (PackParams 2552 bytes, UnpackParams 3168), and int64_t heads would take
// PackParams past CUDA's classic 4 KB limit. The host layer (csrc/ops.cpp) rejects more.
constexpr int64_t kMaxHeads = INT32_MAX;

// A [B][s][h][D] tensor: base pointer and byte strides.
struct Strided4 {
  const char* ptr;
  int64_t sb, ss, sh, sd;
};

struct PackParams {
  Strided4 src[kMaxRoles];
  int64_t src_unit_stride[kMaxRoles];  // bytes between consecutive units of one row
  int32_t n_roles, n_peers;
  int64_t batch, seq;
  int64_t row_bytes;                     // D * element size
  int64_t unit;                          // bytes per unit (divides row_bytes)
  int64_t units_per_row;
  int64_t peer_row0[kMaxPeers + 1];      // first row of each peer's block; [n_peers] = total
  int32_t peer_heads[kMaxPeers];         // heads per token in each peer's block
  int32_t head0[kMaxPeers][kMaxRoles]; // first global head of role i sent to peer p
  int32_t heads[kMaxPeers][kMaxRoles]; // heads of role i sent to peer p
  char* dst;
  // Rows of peer `redirect_peer` (-1: none) go to redirect_ptr + b * redirect_sb +
  // t * redirect_ss + head * row_bytes instead of the send buffer, which then holds the
  // other peers' blocks only: the rows of later peers sit redirect_rows (the redirected
  // block's rows; 0 without a redirect) lower in it.
  int32_t redirect_peer;
  char* redirect_ptr;
  int64_t redirect_sb, redirect_ss;
  int64_t redirect_rows;
};

struct UnpackParams {
  char* out;
  int64_t ob, os, oh, od;  // byte strides of the [B][s][H][D] output
  int64_t batch, seq, d;
  int64_t unit;            // bytes per unit
  int64_t units_per_row;   // d * elem / unit
  int64_t elem;            // element size in bytes
  int32_t n_src;
  Strided4 blk[kMaxPeers];
  int32_t head0[kMaxPeers], head1[kMaxPeers];
};

// Largest p with peer_row0[p] <= row (empty blocks are skipped because their start equals
// the next one's).
UK_HD int find_peer(const int64_t* row0, int n, int64_t row) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (row0[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// A unit of bytes. On the device the copy is one aligned (vector) load and store, which
// the caller guarantees by choosing `unit` from the pointer and stride alignment.
template <int UNIT>
struct alignas(UNIT) Unit {
  unsigned char b[UNIT];
};

template <int UNIT>
UK_HD void copy_unit(void* dst, const void* src) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Unit<UNIT>*>(dst) = *reinterpret_cast<const Unit<UNIT>*>(src);
#else
  memcpy(dst, src, UNIT);
#endif
}

struct RowCopy {
  const char* src;  // row start in the source tensor
  char* dst;        // row start in the send (or receive) buffer
  int64_t src_unit_stride;
};

// ---- launch geometry (pack.cu) -----------------------------------------------------------
// Blocks of kThreads threads (kThreads / kWarp warps) on gridDim.x only, as many as the work
// needs and at most SMs x resident blocks (pack.cu new_grid; at most 2^16 when the device
// cannot be asked); nothing goes to gridDim.y/z (at most 65535 each).
constexpr int kThreads = 256;

// Index arithmetic runs in `I`: uint32_t when all the work of a launch has fewer than
// kNarrowLimit units, else int64_t. 32-bit integer division is several times cheaper than
// 64-bit on the GPU and each unit needs a few. Only unit/row/token indices are ever `I`:
// byte offsets are always int64_t (a rank's send buffer passes 4 GiB at 1M tokens).
constexpr int64_t kNarrowLimit = int64_t(1) << 31;

// The kernels' 32-bit chunk index stays below the chunks plus the grid's warps (at most
// 2^16 x 8), far below 2^32.
UK_HD bool narrow_index(int64_t work) { return work < kNarrowLimit; }

// Where send-buffer row `row` comes from and goes to.
template <class I>
UK_HD RowCopy pack_row(const PackParams& p, I row) {
  const int peer = find_peer(p.peer_row0, p.n_peers, (int64_t)row);
  const I local = row - (I)p.peer_row0[peer];
  const I h = (I)p.peer_heads[peer];
  const I j0 = local % h;
  const I bt = local / h;
  const I t = bt % (I)p.seq;
  const I b = bt / (I)p.seq;
  I j = j0;
  int i = 0;
  while (j >= (I)p.heads[peer][i]) {
    j -= (I)p.heads[peer][i];
    ++i;
  }
  const Strided4& s = p.src[i];
  RowCopy r;
  r.src = s.ptr + (int64_t)b * s.sb + (int64_t)t * s.ss + ((int64_t)p.head0[peer][i] + (int64_t)j) * s.sh;
  r.dst = peer == p.redirect_peer
              ? p.redirect_ptr + (int64_t)b * p.redirect_sb + (int64_t)t * p.redirect_ss + (int64_t)j0 * p.row_bytes
              : p.dst + ((int64_t)row - (peer > p.redirect_peer ? p.redirect_rows : 0)) * p.row_bytes;
  r.src_unit_stride = p.src_unit_stride[i];
  return r;
}

// ---- the warp-chunk walk of the "new" kernels (pack.cu; variant kVariantNew) ----------
// A warp takes kWarp consecutive rows (a "chunk"): lane l decodes row row0 + l once (into
// the warp's slice of shared memory), then the warp copies the chunk's n_rows * upr units,
// lane l taking units k = l, l + kWarp, l + 2 kWarp, ... of the chunk (unit k is unit
// k % upr of row k / upr). Consecutive lanes thus hold consecutive units: consecutive
// 16-byte chunks of the send buffer (pack) or of an output row run (unpack), so a warp's
// stores are one contiguous span wherever the destination rows are. Each lane loads
// kInFlight units before it stores any (64 bytes in flight per lane at 16-byte units).
// The walk is incremental (no division per unit): from k to k + kWarp the unit advances by
// kWarp % upr and the row by kWarp / upr, plus one row on wrapping.
constexpr int kWarp = 32;
constexpr int kInFlight = 4;

template <class I>
struct LaneWalk {
  I row, u;  // row of the chunk, unit of that row
};

template <class I>
UK_HD LaneWalk<I> lane_walk_start(int lane, I upr) {
  return LaneWalk<I>{(I)lane / upr, (I)lane % upr};
}

template <class I>
UK_HD void lane_walk_step(LaneWalk<I>& w, I upr, I drow, I du) {
  w.u += du;
  w.row += drow;
  if (w.u >= upr) {
    w.u -= upr;
    ++w.row;
  }
}

// Chunks of kWarp rows over `rows` rows.
UK_HD int64_t warp_chunks(int64_t rows) { return (rows + kWarp - 1) / kWarp; }

// The variant of the CUDA pack/unpack kernels: the warp-chunk walk above for both, the
// unpack of all roles in one launch. The only one: "old" lost to it on an H200 (2026-11-28),
// "wide" on the uneven unpack (2026-11-30: 25.1% of a device copy against 57.6% at 40/8
// heads over 5 ranks, bench/results/2026-11-30_h200_world; issue 49); both were removed.
// Python: ulysses_kernels.extension.set_pack_variant ("new" for the cuda set).
constexpr int kVariantNew = 1;

// Output row (b, t, head) of an unpack.
struct OutRow {
  int64_t b, t, head;
};

// The output heads an unpack launch visits: [head0, head0 + heads), the smallest span that
// holds every source's heads (heads = 0: no source holds any). A head chunk of the
// pipelined path holds a few of the output's heads; a launch over all of them would start
// n_chunks times the threads it needs, each scanning every source to find nothing.
// NOTE: expected to make a chunked unpack cost what one unchunked unpack costs in total
// (unmeasured: no GPU yet).
struct HeadSpan {
  int64_t head0, heads;
};

UK_HD HeadSpan unpack_head_span(const UnpackParams& p) {
  bool any = false;
  int64_t lo = 0, hi = 0;
  for (int s = 0; s < p.n_src; ++s) {
    if (p.head0[s] >= p.head1[s]) continue;
    lo = any && lo < p.head0[s] ? lo : p.head0[s];
    hi = any && hi > p.head1[s] ? hi : p.head1[s];
    any = true;
  }
  return HeadSpan{lo, hi - lo};
}

// Units of an unpack launch over `span`: rows [B][s][span.heads], units_per_row each.
UK_HD int64_t unpack_units(const UnpackParams& p, const HeadSpan& span) {
  return p.batch * p.seq * span.heads * p.units_per_row;
}

// Output row `row` of a launch over [B][s][span.heads].
template <class I>
UK_HD OutRow unpack_out_row(const UnpackParams& p, const HeadSpan& span, I row) {
  const I h = (I)span.heads;
  const I bt = row / h;
  OutRow r;
  r.head = span.head0 + (int64_t)(row - bt * h);
  r.t = (int64_t)(bt % (I)p.seq);
  r.b = (int64_t)(bt / (I)p.seq);
  return r;
}

// One output row of an unpack, decoded once (the "new" kernel): `kind` 0 = no source holds
// its head (left as it was), 1 = one source (copied: src, dst and the units' strides), 2 =
// several (summed unit by unit through unpack_unit). Same addresses as unpack_src/unpack_dst.
struct UnpackRowCopy {
  const char* src;
  char* dst;
  int64_t src_unit_stride, dst_unit_stride;
  int32_t kind;
};

UK_HD UnpackRowCopy unpack_row_copy(const UnpackParams& p, const OutRow& r) {
  UnpackRowCopy c;
  c.kind = 0;
  c.src = nullptr;
  c.dst = nullptr;
  c.src_unit_stride = c.dst_unit_stride = 0;
  int s = 0;
  while (s < p.n_src && !(r.head >= p.head0[s] && r.head < p.head1[s])) ++s;
  if (s == p.n_src) return c;
  c.kind = 1;
  for (int t = s + 1; t < p.n_src; ++t) {
    if (r.head >= p.head0[t] && r.head < p.head1[t]) c.kind = 2;
  }
  const Strided4& k = p.blk[s];
  c.src = k.ptr + r.b * k.sb + r.t * k.ss + (r.head - (int64_t)p.head0[s]) * k.sh;
  c.dst = p.out + r.b * p.ob + r.t * p.os + r.head * p.oh;
  c.src_unit_stride = k.sd == p.elem ? p.unit : k.sd;
  c.dst_unit_stride = p.od == p.elem ? p.unit : p.od;
  return c;
}

// The unpack of up to kMaxRoles outputs (q, k, v) in one launch of the "new" kernel:
// role i owns the warp chunks [chunk0[i], chunk0[i + 1]), over the rows [B][s][span[i].heads]
// of its output (a chunk never holds two roles' rows: roles may differ in row length).
// Every role moves units of one size (the smallest role's unit: each is a power of two that
// divides its rows and alignments, so the smallest divides every role's); the host layer
// sets each role's `unit` and `units_per_row` to it. Kernel parameter of 9.6 KB: CUDA 12.1+
// takes up to 32 KB on sm_70 and later.
struct UnpackMulti {
  UnpackParams role[kMaxRoles];
  HeadSpan span[kMaxRoles];
  int64_t chunk0[kMaxRoles + 1];
  int32_t n_roles;
};

// The role of warp chunk `c` (chunk0 ascending; empty roles skipped).
UK_HD int unpack_role_of_chunk(const UnpackMulti& m, int64_t c) {
  int i = 0;
  while (i + 1 < m.n_roles && m.chunk0[i + 1] <= c) ++i;
  return i;
}

// ---- element types of the unpack sum ---------------------------------------------------
// Reduced floats are added in float and rounded to nearest even, as torch's add_ does
// (opmath float, one rounding per addition). The conversions are bit manipulations so the
// host twin and the device kernel run the very same code, except for the bits of a NaN
// sum, which follow torch's add_ on the same device:
//  - CUDA: c10::BFloat16(float) and c10::Half(float) (torch/headeronly/util/BFloat16.h,
//    Half.h) are __float2bfloat16 / __float2half from sm_80 on, i.e. cvt.rn.bf16.f32 and
//    cvt.rn.f16.f32, which write every NaN as the canonical 0x7FFF (the host emulations
//    of both in cuda_bf16.hpp / cuda_fp16.hpp return 0x7FFF as well).
//  - CPU, bf16: add_ rounds with at::vec's cvtfp32_bf16 (ATen/cpu/vec/vec256/
//    vec256_16bit_float.h, vec512/vec512_bfloat16.h), which writes every NaN as 0xFFFF.
//    Its scalar tail (c10::detail::round_to_nearest_even: 0x7FC0) only runs on the last
//    elements of a contiguous run that is not a multiple of the vector step (32 on AVX2,
//    64 on AVX-512), so runs of 64 or 128 elements (a head of D = 64 or 128) never reach it.
//  - CPU, fp16: c10::Half(float) and at::vec both convert with F16C (_cvtss_sh,
//    _mm256_cvtps_ph): the sign and the top 10 payload bits are kept, the quiet bit set.
// Which of two NaN operands an add returns is the hardware's choice (torch's CPU scalar
// and vector paths differ there; a GPU returns the canonical NaN), so it is not pinned down.
// kDeviceNaN: this pass of the compiler builds device code (NaN sums take torch's CUDA bits).
#if defined(__CUDA_ARCH__)
constexpr bool kDeviceNaN = true;
#else
constexpr bool kDeviceNaN = false;
#endif

UK_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

UK_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

UK_HD float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {
    const float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return bits_float(float_bits(v) | sign);
  }
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

UK_HD uint16_t float_to_half(float f) {
  uint32_t x = float_bits(f);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) {  // NaN, see above
    return kDeviceNaN ? (uint16_t)0x7fffu : (uint16_t)(sign | 0x7e00u | ((x & 0x7fffffu) >> 13));
  }
  if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // inf, and >= 65520 rounds to inf
  if (x < 0x38800000u) {                                     // half subnormal or zero
    if (x <= 0x33000000u) return sign;                       // <= 2^-25: ties to 0
    const uint32_t e = x >> 23;
    const uint32_t m = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return (uint16_t)(sign | r);
  }
  uint32_t h = (x - 0x38000000u) >> 13;
  const uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return (uint16_t)(sign | h);
}

UK_HD float bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

UK_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return kDeviceNaN ? 0x7fffu : 0xffffu;  // NaN, see above
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct AddF32 {
  using T = float;
  static UK_HD T add(T a, T b) { return a + b; }
};
struct AddF64 {
  using T = double;
  static UK_HD T add(T a, T b) { return a + b; }
};
struct AddF16 {
  using T = uint16_t;
  static UK_HD T add(T a, T b) { return float_to_half(half_to_float(a) + half_to_float(b)); }
};
struct AddBF16 {
  using T = uint16_t;
  static UK_HD T add(T a, T b) { return float_to_bf16(bf16_to_float(a) + bf16_to_float(b)); }
};
// Any dtype when no head is held twice (nothing is ever added).
struct CopyOnly {
  using T = unsigned char;
  static UK_HD T add(T a, T) { return a; }
};

// Addresses of unit `u` (of `unit` bytes) of output row `r` in source `s` (which must hold
// r.head) and in the output. All byte offsets in int64_t. With a D stride other than one
// element, the unit is one element.
UK_HD const char* unpack_src(const UnpackParams& p, const OutRow& r, int s, int64_t u, int64_t unit) {
  const Strided4& k = p.blk[s];
  return k.ptr + r.b * k.sb + r.t * k.ss + (r.head - (int64_t)p.head0[s]) * k.sh + (k.sd == p.elem ? u * unit : u * k.sd);
}

UK_HD char* unpack_dst(const UnpackParams& p, const OutRow& r, int64_t u, int64_t unit) {
  return p.out + r.b * p.ob + r.t * p.os + r.head * p.oh + (p.od == p.elem ? u * unit : u * p.od);
}

UK_HD bool holds(const UnpackParams& p, int s, int64_t head) { return head >= p.head0[s] && head < p.head1[s]; }

// One unit of an unpack output row: the first holder copied, later holders added.
// Returns false when no source holds `head` (the output is left as it was).
// The first holder is loaded straight into the accumulator and each later one into its own
// temporary: choosing the destination of a load at run time (one buffer or the other)
// put both in local memory (NOTE: ptxas reported an 8-32 byte stack frame for 38 of the 60
// kernels, and the bf16 16-byte kernel's PTX had 17 local loads and 9 local stores per
// unit; now no kernel has any, checked by scripts/ptxas_check.py).
template <class Op, int UNIT>
UK_HD bool unpack_unit(const UnpackParams& p, const OutRow& r, int64_t u) {
  using T = typename Op::T;
  constexpr int N = UNIT / (int)sizeof(T);
  int s = 0;
  while (s < p.n_src && !holds(p, s, r.head)) ++s;
  if (s == p.n_src) return false;
  union {
    T v[N];
    Unit<UNIT> raw;
  } acc;
  copy_unit<UNIT>(&acc.raw, unpack_src(p, r, s, u, UNIT));
  for (++s; s < p.n_src; ++s) {
    if (!holds(p, s, r.head)) continue;
    union {
      T v[N];
      Unit<UNIT> raw;
    } in;
    copy_unit<UNIT>(&in.raw, unpack_src(p, r, s, u, UNIT));
    for (int e = 0; e < N; ++e) acc.v[e] = Op::add(acc.v[e], in.v[e]);
  }
  copy_unit<UNIT>(unpack_dst(p, r, u, UNIT), &acc.raw);
  return true;
}

}  // namespace ulysses_kernels
