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
// parameters (PackParams 2544 bytes, UnpackParams 3176), and int64_t heads would take
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
  // t * redirect_ss + head * row_bytes instead of the send buffer.
  int32_t redirect_peer;
  char* redirect_ptr;
  int64_t redirect_sb, redirect_ss;
};

struct UnpackParams {
  char* out;
  int64_t ob, os, oh, od;  // byte strides of the [B][s][H][D] output
  int64_t batch, seq, out_heads, d;
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

// ---- launch geometry (pack.cu launches; here so the host tests can check it) -----------
// A 1-D grid-stride launch: blockDim.x = kThreads, gridDim.x = grid_blocks(work) <= kMaxBlocks.
// Nothing goes to gridDim.y/z (at most 65535 each, which B * S alone passes at 64K tokens);
// gridDim.x may be up to 2^31 - 1, far above kMaxBlocks. Beyond kMaxBlocks * kThreads units
// each thread loops (1M tokens, 64 heads, D = 128 bf16: 1.1e9 units, 16 per thread).
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 18;

UK_HD int64_t grid_blocks(int64_t work) {
  const int64_t b = (work + kThreads - 1) / kThreads;
  return b < kMaxBlocks ? b : kMaxBlocks;
}

// Index arithmetic runs in `I`: uint32_t when all the work of a launch has fewer than
// kNarrowLimit units, else int64_t. 32-bit integer division is several times cheaper than
// 64-bit on the GPU and each unit needs a few. Only unit/row/token indices are ever `I`:
// byte offsets are always int64_t (a rank's send buffer passes 4 GiB at 1M tokens).
constexpr int64_t kNarrowLimit = int64_t(1) << 31;

// A uint32_t grid-stride index stays below work + gridDim.x * blockDim.x; it must not wrap
// before the loop test sees it past the end.
static_assert(kNarrowLimit - 1 + kMaxBlocks * kThreads < (int64_t(1) << 32),
              "a 32-bit grid-stride index could wrap: lower kNarrowLimit or kMaxBlocks");

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
              : p.dst + (int64_t)row * p.row_bytes;
  r.src_unit_stride = p.src_unit_stride[i];
  return r;
}

// Output row (b, t, head) of an unpack, from a flat row index over [B][s][H].
struct OutRow {
  int64_t b, t, head;
};

template <class I>
UK_HD OutRow unpack_out_row(const UnpackParams& p, I row) {
  const I h = (I)p.out_heads;
  const I bt = row / h;
  OutRow r;
  r.head = (int64_t)(row - bt * h);
  r.t = (int64_t)(bt % (I)p.seq);
  r.b = (int64_t)(bt / (I)p.seq);
  return r;
}

// ---- element types of the unpack sum ---------------------------------------------------
// Reduced floats are added in float and rounded to nearest even, as torch's add_ does
// (opmath float, one rounding per addition). The conversions are bit manipulations so the
// host twin and the device kernel run the very same code.
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
  if (x >= 0x7f800000u) return (uint16_t)(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // >= 65520 rounds to inf
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
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
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

// One unit of an unpack output row: the first holder copied, later holders added.
// Returns false when no source holds `head` (the output is left as it was).
template <class Op, int UNIT>
UK_HD bool unpack_unit(const UnpackParams& p, const OutRow& r, int64_t u) {
  using T = typename Op::T;
  constexpr int N = UNIT / (int)sizeof(T);
  union {
    T v[N];
    Unit<UNIT> raw;
  } acc, in;
  bool any = false;
  for (int s = 0; s < p.n_src; ++s) {
    if (r.head < p.head0[s] || r.head >= p.head1[s]) continue;
    copy_unit<UNIT>(any ? &in.raw : &acc.raw, unpack_src(p, r, s, u, UNIT));
    if (any) {
      for (int e = 0; e < N; ++e) acc.v[e] = Op::add(acc.v[e], in.v[e]);
    }
    any = true;
  }
  if (!any) return false;
  copy_unit<UNIT>(unpack_dst(p, r, u, UNIT), &acc.raw);
  return true;
}

}  // namespace ulysses_kernels
