// C++ unit tests of the CPU twin (csrc/kernels/pack_cpu.cpp) and the shared index math
// (csrc/kernels/layout_math.h), without torch: reduced-float rounding, and pack/unpack
// against naive loops written from the layout definition. Run by CTest (scripts/ctest.sh).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "expect.h"
#include "kernels/pack.h"

using namespace ulysses_kernels;

static void test_half_rounding() {
  // Every finite half survives half -> float -> half; NaNs stay NaN.
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = half_to_float((uint16_t)h);
    if (std::isnan(f)) {
      EXPECT((float_to_half(f) & 0x7c00u) == 0x7c00u && (float_to_half(f) & 0x3ffu) != 0);
    } else if (float_to_half(f) != h) {
      EXPECT(float_to_half(f) == h);
      break;
    }
  }
  EXPECT(float_to_half(65504.0f) == 0x7bffu);
  EXPECT(float_to_half(65519.0f) == 0x7bffu);
  EXPECT(float_to_half(65520.0f) == 0x7c00u);  // halfway to 65536: ties to even -> inf
  EXPECT(float_to_half(-65520.0f) == 0xfc00u);
  EXPECT(float_to_half(std::ldexp(1.0f, -25)) == 0x0000u);           // tie -> even (0)
  EXPECT(float_to_half(std::ldexp(1.0f, -25) * 1.001f) == 0x0001u);  // just above the tie
  EXPECT(float_to_half(std::ldexp(3.0f, -25)) == 0x0002u);           // 1.5 units: tie -> 2
  EXPECT(float_to_half(std::ldexp(5.0f, -25)) == 0x0002u);           // 2.5 units: tie -> 2
  EXPECT(float_to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3c00u);    // tie -> even mantissa
  EXPECT(float_to_half(1.0f + std::ldexp(3.0f, -11)) == 0x3c02u);
  EXPECT(float_to_half(2048.0f + 1.0f) == 0x6800u);                   // 2049 -> 2048
  // NaN on the host as F16C converts it (torch's CPU add_): sign and top 10 payload bits
  // kept, quiet bit set. Infinities stay infinities.
  EXPECT(float_to_half(bits_float(0x7fc00000u)) == 0x7e00u);
  EXPECT(float_to_half(bits_float(0xffc00000u)) == 0xfe00u);
  EXPECT(float_to_half(bits_float(0x7fe22000u)) == 0x7f11u);
  EXPECT(float_to_half(bits_float(0xff822000u)) == 0xfe11u);  // signaling: made quiet
  EXPECT(float_to_half(bits_float(0x7f800001u)) == 0x7e00u);  // payload below the top 10 bits
  EXPECT(float_to_half(INFINITY) == 0x7c00u && float_to_half(-INFINITY) == 0xfc00u);
}

static void test_bf16_rounding() {
  EXPECT(float_to_bf16(1.0f) == 0x3f80u);
  EXPECT(float_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80u);  // tie -> even
  EXPECT(float_to_bf16(1.0f + std::ldexp(3.0f, -8)) == 0x3f82u);
  // NaN: 0xFFFF on the host, as torch's CPU add_ writes it (at::vec's cvtfp32_bf16; the
  // CUDA kernels write 0x7FFF, see layout_math.h), whatever the sign and payload.
  for (uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xffa5a5a5u, 0x7fffffffu}) {
    EXPECT(float_to_bf16(bits_float(bits)) == 0xffffu);
  }
  EXPECT(float_to_bf16(INFINITY) == 0x7f80u && float_to_bf16(-INFINITY) == 0xff80u);
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = bf16_to_float((uint16_t)h);
    if (!std::isnan(f) && float_to_bf16(f) != h) {
      EXPECT(float_to_bf16(f) == h);
      break;
    }
  }
}

// Plan 40 query / 8 KV heads on 3 ranks: q [0,14) [14,27) [27,40), group 5.
struct Plan {
  int q0[3], q1[3], k0[3], k1[3];
};

static Plan plan_40_8_3() {
  Plan p{};
  const int bounds[4] = {0, 14, 27, 40};
  for (int r = 0; r < 3; ++r) {
    p.q0[r] = bounds[r];
    p.q1[r] = bounds[r + 1];
    p.k0[r] = bounds[r] / 5;
    p.k1[r] = (bounds[r + 1] - 1) / 5 + 1;
  }
  return p;
}

// The plan above packed from sources [B][s][H][D + pad] (rows strided, D contiguous) into
// the send buffer, the block of rank 1 optionally redirected into its receive buffer.
struct PackCase {
  static constexpr int B = 2, s = 3, pad = 2, rank = 1, S = 7, off = 2;
  static constexpr int H[3] = {40, 8, 8};
  int D = 0;
  bool redirect = false;
  std::vector<std::vector<float>> src;
  std::vector<float> send, recv;
  PackParams p{};
};

static void make_pack_case(PackCase& c, int D, int unit, bool redirect) {
  const Plan pl = plan_40_8_3();
  const int B = c.B, s = c.s, pad = c.pad;
  c.D = D;
  c.redirect = redirect;
  c.src.assign(3, {});
  for (int i = 0; i < 3; ++i) {
    c.src[i].resize((size_t)B * s * c.H[i] * (D + pad));
    for (size_t e = 0; e < c.src[i].size(); ++e) c.src[i][e] = (float)(i * 100000 + e);
  }
  PackParams& p = c.p;
  p = PackParams{};
  p.n_roles = 3;
  p.n_peers = 3;
  p.batch = B;
  p.seq = s;
  p.row_bytes = D * 4;
  p.unit = unit;
  p.units_per_row = p.row_bytes / unit;
  for (int i = 0; i < 3; ++i) {
    const int64_t sh = (D + pad) * 4;
    p.src[i] = Strided4{(const char*)c.src[i].data(), s * c.H[i] * sh, c.H[i] * sh, sh, 4};
    p.src_unit_stride[i] = unit;
  }
  int64_t rows = 0;
  for (int r = 0; r < 3; ++r) {
    const int a[3] = {pl.q0[r], pl.k0[r], pl.k0[r]}, b[3] = {pl.q1[r], pl.k1[r], pl.k1[r]};
    p.peer_row0[r] = rows;
    int h = 0;
    for (int i = 0; i < 3; ++i) {
      p.head0[r][i] = a[i];
      p.heads[r][i] = b[i] - a[i];
      h += b[i] - a[i];
    }
    p.peer_heads[r] = h;
    rows += (int64_t)B * s * h;
  }
  p.peer_row0[3] = rows;
  // With the redirect, the send buffer holds the other peers' blocks only.
  p.redirect_rows = redirect ? p.peer_row0[c.rank + 1] - p.peer_row0[c.rank] : 0;
  c.send.assign((size_t)(rows - p.redirect_rows) * D, -1.0f);
  const int h_r = p.peer_heads[c.rank];
  c.recv.assign((size_t)B * c.S * h_r * D, -1.0f);
  p.dst = (char*)c.send.data();
  p.redirect_peer = redirect ? c.rank : -1;
  p.redirect_ss = (int64_t)h_r * D * 4;
  p.redirect_sb = c.S * p.redirect_ss;
  p.redirect_ptr = (char*)c.recv.data() + c.off * p.redirect_ss;
}

// Naive: the block of peer r is [B][s][q heads | k heads | v heads][D].
static void check_pack_case(const PackCase& c) {
  const PackParams& p = c.p;
  const int B = c.B, s = c.s, D = c.D, S = c.S, rank = c.rank, h_r = p.peer_heads[rank];
  const int before = ulysses_kernels_tests::failures;
  size_t g = 0;
  for (int r = 0; r < 3; ++r) {
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < s; ++t) {
        int j = 0;
        for (int i = 0; i < 3; ++i)
          for (int head = p.head0[r][i]; head < p.head0[r][i] + p.heads[r][i]; ++head, ++j)
            for (int d = 0; d < D; ++d) {
              const float want = c.src[i][(((size_t)b * s + t) * c.H[i] + head) * (D + c.pad) + d];
              if (c.redirect && r == rank) {
                EXPECT(c.recv[(((size_t)b * S + c.off + t) * h_r + j) * D + d] == want);
              } else {
                EXPECT(c.send[g++] == want);
              }
              if (ulysses_kernels_tests::failures > before) return;
            }
      }
  }
  EXPECT(g == c.send.size());
}

static void test_pack(int unit, bool redirect, bool wide) {
  PackCase c;
  make_pack_case(c, 6, unit, redirect);
  pack_cpu(c.p, wide);
  check_pack_case(c);
}

// The warp-chunk walk of pack.cu's new pack kernel, run lane by lane on the host: warp w of
// block b takes chunks w + 8 b, w + 8 b + 8 grid, ...; lane l decodes row 32 c + l, then
// walks units l, l + 32, ... of the chunk (LaneWalk) in batches of kInFlight. Every row
// must be decoded once, every unit copied once, and the result be the layout.
static void test_pack_warp_walk(int D, int unit, bool redirect, int64_t grid) {
  PackCase c;
  make_pack_case(c, D, unit, redirect);
  const PackParams& p = c.p;
  const int64_t rows = p.peer_row0[p.n_peers], upr = p.units_per_row, chunks = warp_chunks(rows);
  const int warps = kThreads / kWarp;
  std::vector<int> decoded((size_t)rows, 0), copied((size_t)(rows * upr), 0);
  RowCopy mine[kWarp];
  const uint32_t u32 = (uint32_t)upr, drow = kWarp / u32, du = kWarp % u32;
  for (int64_t b = 0; b < grid; ++b) {
    for (int w = 0; w < warps; ++w) {
      for (int64_t ch = b * warps + w; ch < chunks; ch += grid * warps) {
        const int64_t row0 = ch * kWarp, nr = rows - row0 < kWarp ? rows - row0 : kWarp;
        for (int lane = 0; lane < nr; ++lane) {
          mine[lane] = pack_row<uint32_t>(p, (uint32_t)(row0 + lane));
          ++decoded[(size_t)(row0 + lane)];
        }
        for (int lane = 0; lane < kWarp; ++lane) {
          LaneWalk<uint32_t> wk = lane_walk_start<uint32_t>(lane, u32);
          while (wk.row < (uint32_t)nr) {
            for (int j = 0; j < kInFlight; ++j) {
              if (wk.row < (uint32_t)nr) {
                const RowCopy& r = mine[wk.row];
                memcpy(r.dst + (int64_t)wk.u * unit, r.src + (int64_t)wk.u * r.src_unit_stride, (size_t)unit);
                ++copied[(size_t)((row0 + wk.row) * upr + wk.u)];
              }
              lane_walk_step(wk, u32, drow, du);
            }
          }
        }
      }
    }
  }
  bool once = true;
  for (int n : decoded) once = once && n == 1;
  for (int n : copied) once = once && n == 1;
  EXPECT(once);
  check_pack_case(c);
}

static void test_unpack_sums_in_rank_order(bool wide) {
  // Three sources hold heads [0,2) [1,3) [1,2): head 1 is held three times.
  const int B = 1, s = 2, D = 4, H = 4;
  const int a[3] = {0, 1, 1}, b[3] = {2, 3, 2};
  std::vector<std::vector<uint16_t>> blk(3);
  for (int p = 0; p < 3; ++p) {
    blk[p].resize((size_t)B * s * (b[p] - a[p]) * D);
    for (size_t e = 0; e < blk[p].size(); ++e) blk[p][e] = float_to_half(p == 0 ? 2048.0f : 1.0f + (float)e);
  }
  std::vector<uint16_t> out((size_t)B * s * H * D, 0x7777u);
  UnpackParams u{};
  u.out = (char*)out.data();
  u.ob = s * H * D * 2;
  u.os = H * D * 2;
  u.oh = D * 2;
  u.od = 2;
  u.batch = B;
  u.seq = s;
  u.d = D;
  u.elem = 2;
  u.unit = 8;
  u.units_per_row = D * 2 / 8;
  u.n_src = 3;
  for (int p = 0; p < 3; ++p) {
    const int h = b[p] - a[p];
    u.blk[p] = Strided4{(const char*)blk[p].data(), s * h * D * 2, h * D * 2, D * 2, 2};
    u.head0[p] = a[p];
    u.head1[p] = b[p];
  }
  unpack_cpu(u, AddType::kF16, wide);
  for (int t = 0; t < s; ++t)
    for (int head = 0; head < H; ++head)
      for (int d = 0; d < D; ++d) {
        uint16_t acc = 0;
        bool any = false;
        for (int p = 0; p < 3; ++p) {
          if (head < a[p] || head >= b[p]) continue;
          const uint16_t x = blk[p][((size_t)t * (b[p] - a[p]) + head - a[p]) * D + d];
          acc = any ? float_to_half(half_to_float(acc) + half_to_float(x)) : x;
          any = true;
        }
        const uint16_t got = out[((size_t)t * H + head) * D + d];
        EXPECT(got == (any ? acc : 0x7777u));
      }
}

// An unpack whose sources hold only heads [5, 9) of 12 (a head chunk of the pipelined path):
// the launch visits the rows of that span only, each once; heads outside it stay as they
// were, head 6 (held twice) is summed, and with no heads at all nothing is launched.
static UnpackParams unpack_case(std::vector<float>& out, std::vector<std::vector<float>>& blk, const int* a,
                                const int* b, int n_src, int B, int s, int H, int D, int unit) {
  UnpackParams u{};
  u.out = (char*)out.data();
  u.ob = (int64_t)s * H * D * 4;
  u.os = (int64_t)H * D * 4;
  u.oh = D * 4;
  u.od = 4;
  u.batch = B;
  u.seq = s;
  u.d = D;
  u.elem = 4;
  u.unit = unit;
  u.units_per_row = D * 4 / unit;
  u.n_src = n_src;
  for (int q = 0; q < n_src; ++q) {
    const int h = b[q] - a[q];
    u.blk[q] = Strided4{(const char*)blk[q].data(), (int64_t)s * h * D * 4, (int64_t)h * D * 4, D * 4, 4};
    u.head0[q] = a[q];
    u.head1[q] = b[q];
  }
  return u;
}

static void test_unpack_head_span(int unit, bool wide) {
  const int B = 2, s = 3, H = 12, D = 4, n_src = 4;
  const int a[n_src] = {5, 7, 6, 9}, b[n_src] = {7, 7, 9, 9};  // [7, 7) and [9, 9) hold nothing
  std::vector<std::vector<float>> blk(n_src);
  for (int q = 0; q < n_src; ++q) {
    blk[q].resize((size_t)B * s * (b[q] - a[q]) * D);
    for (size_t e = 0; e < blk[q].size(); ++e) blk[q][e] = (float)(1000 * (q + 1) + e);
  }
  std::vector<float> out((size_t)B * s * H * D, -7.0f);
  const UnpackParams u = unpack_case(out, blk, a, b, n_src, B, s, H, D, unit);
  const HeadSpan span = unpack_head_span(u);
  EXPECT(span.head0 == 5 && span.heads == 4);
  EXPECT(unpack_units(u, span) == (int64_t)B * s * 4 * u.units_per_row);
  // The launch's rows: every (b, t, head in the span) exactly once, in both index widths.
  std::vector<int> seen((size_t)B * s * H, 0);
  for (int64_t row = 0; row < B * s * span.heads; ++row) {
    const OutRow r = unpack_out_row<int64_t>(u, span, row);
    const OutRow r32 = unpack_out_row<uint32_t>(u, span, (uint32_t)row);
    EXPECT(r.b == r32.b && r.t == r32.t && r.head == r32.head);
    EXPECT(r.head >= 5 && r.head < 9 && r.t >= 0 && r.t < s && r.b >= 0 && r.b < B);
    ++seen[(size_t)((r.b * s + r.t) * H + r.head)];
  }
  for (int b_ = 0; b_ < B; ++b_)
    for (int t = 0; t < s; ++t)
      for (int head = 0; head < H; ++head) EXPECT(seen[(size_t)((b_ * s + t) * H + head)] == (head >= 5 && head < 9));
  unpack_cpu(u, AddType::kF32, wide);
  for (int b_ = 0; b_ < B; ++b_)
    for (int t = 0; t < s; ++t)
      for (int head = 0; head < H; ++head)
        for (int d = 0; d < D; ++d) {
          float want = -7.0f;
          bool any = false;
          for (int q = 0; q < n_src; ++q) {
            if (head < a[q] || head >= b[q]) continue;
            const float x = blk[q][(((size_t)b_ * s + t) * (b[q] - a[q]) + head - a[q]) * D + d];
            want = any ? want + x : x;
            any = true;
          }
          EXPECT(out[(((size_t)b_ * s + t) * H + head) * D + d] == want);
        }
  // No source holds a head: an empty span, nothing launched, the output untouched.
  const int e0[2] = {3, 0}, e1[2] = {3, 0};
  std::vector<std::vector<float>> none(2);
  std::vector<float> out2((size_t)B * s * H * D, -7.0f);
  const UnpackParams u2 = unpack_case(out2, none, e0, e1, 2, B, s, H, D, unit);
  EXPECT(unpack_head_span(u2).heads == 0 && unpack_units(u2, unpack_head_span(u2)) == 0);
  unpack_cpu(u2, AddType::kF32, wide);
  bool untouched = true;
  for (float x : out2) untouched = untouched && x == -7.0f;
  EXPECT(untouched);
}

// The new unpack kernel's launch over two roles (UnpackMulti), run lane by lane on the
// host: role 0 has gaps and heads held by up to three sources (sums), role 1 a longer row
// (D = 8) from two sources. The result must be what the CPU twin writes role by role.
template <int UNIT>
static void run_unpack_multi(const UnpackMulti& m, int64_t grid) {
  const int warps = kThreads / kWarp;
  const int64_t chunks = m.chunk0[m.n_roles];
  UnpackRowCopy mine[kWarp];
  for (int64_t b = 0; b < grid; ++b)
    for (int w = 0; w < warps; ++w)
      for (int64_t ch = b * warps + w; ch < chunks; ch += grid * warps) {
        const int i = unpack_role_of_chunk(m, ch);
        const UnpackParams& p = m.role[i];
        const HeadSpan& span = m.span[i];
        const int64_t role_rows = p.batch * p.seq * span.heads, row0 = (ch - m.chunk0[i]) * kWarp;
        const int64_t nr = role_rows - row0 < kWarp ? role_rows - row0 : kWarp;
        EXPECT(row0 < role_rows);
        const uint32_t upr = (uint32_t)p.units_per_row, drow = kWarp / upr, du = kWarp % upr;
        for (int lane = 0; lane < nr; ++lane) mine[lane] = unpack_row_copy(p, unpack_out_row<uint32_t>(p, span, (uint32_t)(row0 + lane)));
        for (int lane = 0; lane < kWarp; ++lane) {
          LaneWalk<uint32_t> wk = lane_walk_start<uint32_t>(lane, upr);
          while (wk.row < (uint32_t)nr) {
            const UnpackRowCopy& r = mine[wk.row];
            if (r.kind == 1) {
              memcpy(r.dst + (int64_t)wk.u * r.dst_unit_stride, r.src + (int64_t)wk.u * r.src_unit_stride, UNIT);
            } else if (r.kind == 2) {
              unpack_unit<AddF32, UNIT>(p, unpack_out_row<uint32_t>(p, span, (uint32_t)(row0 + wk.row)), wk.u);
            }
            lane_walk_step(wk, upr, drow, du);
          }
        }
      }
}

static void test_unpack_multi_walk(int unit, int64_t grid) {
  const int B = 2, s = 3, H = 12, D0 = 4, D1 = 8;
  const int a0[4] = {5, 7, 6, 9}, b0[4] = {7, 7, 9, 9}, a1[4] = {0, 2, 0, 0}, b1[4] = {2, 4, 0, 0};
  std::vector<std::vector<float>> blk0(4), blk1(4);
  for (int q = 0; q < 4; ++q) {
    blk0[q].resize((size_t)B * s * (b0[q] - a0[q]) * D0);
    for (size_t e = 0; e < blk0[q].size(); ++e) blk0[q][e] = (float)(1000 * (q + 1) + e);
    blk1[q].resize((size_t)B * s * (b1[q] - a1[q]) * D1);
    for (size_t e = 0; e < blk1[q].size(); ++e) blk1[q][e] = (float)(-50 * (q + 1) - (float)e);
  }
  std::vector<float> out0((size_t)B * s * H * D0, -7.0f), out1((size_t)B * s * 4 * D1, -7.0f);
  std::vector<float> ref0 = out0, ref1 = out1;
  const UnpackParams r0 = unpack_case(ref0, blk0, a0, b0, 4, B, s, H, D0, unit);
  const UnpackParams r1 = unpack_case(ref1, blk1, a1, b1, 4, B, s, 4, D1, unit);
  unpack_cpu(r0, AddType::kF32);
  unpack_cpu(r1, AddType::kF32);
  UnpackMulti m{};
  m.n_roles = 2;
  m.role[0] = unpack_case(out0, blk0, a0, b0, 4, B, s, H, D0, unit);
  m.role[1] = unpack_case(out1, blk1, a1, b1, 4, B, s, 4, D1, unit);
  m.chunk0[0] = 0;
  for (int i = 0; i < 2; ++i) {
    m.span[i] = unpack_head_span(m.role[i]);
    m.chunk0[i + 1] = m.chunk0[i] + warp_chunks(m.role[i].batch * m.role[i].seq * m.span[i].heads);
  }
  EXPECT(m.chunk0[1] == 1 && m.chunk0[2] == 2);  // 24 rows each: one chunk per role
  EXPECT(unpack_role_of_chunk(m, 0) == 0 && unpack_role_of_chunk(m, 1) == 1);
  if (unit == 16) {
    run_unpack_multi<16>(m, grid);
  } else {
    run_unpack_multi<4>(m, grid);
  }
  EXPECT(out0 == ref0);
  EXPECT(out1 == ref1);
}

// The lane walk visits units lane, lane + 32, ... of a chunk of `rows` rows for any row length.
static void test_lane_walk() {
  for (uint32_t upr = 1; upr <= 100; ++upr) {
    const uint32_t drow = kWarp / upr, du = kWarp % upr;
    for (int lane = 0; lane < kWarp; ++lane) {
      LaneWalk<uint32_t> w = lane_walk_start<uint32_t>(lane, upr);
      for (uint32_t k = (uint32_t)lane; k < 40 * upr; k += kWarp) {
        EXPECT(w.row == k / upr && w.u == k % upr);
        lane_walk_step(w, upr, drow, du);
      }
    }
  }
  EXPECT(warp_chunks(0) == 0 && warp_chunks(1) == 1 && warp_chunks(32) == 1 && warp_chunks(33) == 2);
}

// NaN sums of reduced floats through the CPU twin's unpack, with the host's rule (torch's CPU
// add_, see layout_math.h): bf16 any NaN -> 0xFFFF; fp16 keeps the NaN operand's sign and
// payload, quiet bit set. Two sources hold the one head; the second is added to the first.
static uint16_t unpack_sum_bits(AddType add, uint16_t first, uint16_t second) {
  const int n = 8;  // one row of D = 8 two-byte elements, all equal
  std::vector<uint16_t> b0(n, first), b1(n, second), out(n, 0x1234u);
  UnpackParams u{};
  u.out = (char*)out.data();
  u.ob = u.os = u.oh = n * 2;
  u.od = 2;
  u.batch = u.seq = 1;
  u.d = n;
  u.elem = 2;
  u.unit = 16;
  u.units_per_row = 1;
  u.n_src = 2;
  u.blk[0] = Strided4{(const char*)b0.data(), n * 2, n * 2, n * 2, 2};
  u.blk[1] = Strided4{(const char*)b1.data(), n * 2, n * 2, n * 2, 2};
  u.head0[0] = u.head0[1] = 0;
  u.head1[0] = u.head1[1] = 1;
  unpack_cpu(u, add);
  for (uint16_t x : out) EXPECT(x == out[0]);
  return out[0];
}

static void test_unpack_nan_sums() {
  const uint16_t bf_one = 0x3f80u, bf_inf = 0x7f80u, bf_ninf = 0xff80u;
  for (uint16_t nan : {0x7fc0u, 0xffc0u, 0x7f81u, 0xffa5u, 0x7fffu}) {
    EXPECT(unpack_sum_bits(AddType::kBF16, nan, bf_one) == 0xffffu);
    EXPECT(unpack_sum_bits(AddType::kBF16, bf_one, nan) == 0xffffu);
    EXPECT(unpack_sum_bits(AddType::kBF16, nan, nan) == 0xffffu);
  }
  EXPECT(unpack_sum_bits(AddType::kBF16, bf_inf, bf_ninf) == 0xffffu);  // inf - inf
  EXPECT(unpack_sum_bits(AddType::kBF16, bf_inf, bf_one) == bf_inf);
  const uint16_t h_one = 0x3c00u;
  EXPECT(unpack_sum_bits(AddType::kF16, 0x7d11u, h_one) == 0x7f11u);  // signaling: made quiet
  EXPECT(unpack_sum_bits(AddType::kF16, h_one, 0xfe22u) == 0xfe22u);
  EXPECT(unpack_sum_bits(AddType::kF16, 0x7e00u, h_one) == 0x7e00u);
  const uint16_t inf_sum = unpack_sum_bits(AddType::kF16, 0x7c00u, 0xfc00u);  // the CPU's default NaN
  EXPECT((inf_sum & 0x7e00u) == 0x7e00u);
}

int main() {
  test_half_rounding();
  test_bf16_rounding();
  for (bool wide : {false, true}) {  // 32-bit and 64-bit index math
    for (int unit : {4, 8}) {
      test_pack(unit, false, wide);
      test_pack(unit, true, wide);
    }
    test_unpack_sums_in_rank_order(wide);
    for (int unit : {4, 16}) test_unpack_head_span(unit, wide);
  }
  test_unpack_nan_sums();
  // The new kernels' warp-chunk walk (pack.cu kVariantNew).
  test_lane_walk();
  for (int64_t grid : {int64_t(1), int64_t(3), int64_t(1) << 20}) {
    for (int unit : {4, 8}) test_pack_warp_walk(6, unit, grid % 2 == 0, grid);
    test_pack_warp_walk(1, 4, true, grid);
    test_pack_warp_walk(300, 4, false, grid);
    test_pack_warp_walk(300, 16, true, grid);
    for (int unit : {4, 16}) test_unpack_multi_walk(unit, grid);
  }
  if (ulysses_kernels_tests::failures) {
    std::fprintf(stderr, "%d check(s) failed\n", ulysses_kernels_tests::failures);
    return 1;
  }
  std::printf("test_layout_math: all checks passed\n");
  return 0;
}
