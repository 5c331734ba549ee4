// C++ unit tests of the shared index math (csrc/kernels/layout_math.h) at sizes where byte
// offsets exceed 32 bits: the pack's and the unpack's addresses only (never dereferenced), so
// no memory is needed. Run by CTest (scripts/ctest.sh).
#include <cstdint>
#include <cstdio>
#include <initializer_list>

#include "expect.h"
#include "kernels/pack.h"

using namespace ulysses_kernels;

// Address math at sizes where byte offsets exceed 32 bits while the unit index still fits
// (the 32-bit index path of the CUDA launch) and where it does not (64-bit path). Only
// addresses are computed (pack_row never dereferences), so no memory is needed: one rank
// holding 2^20 tokens (B = 1, 8 ranks, 64 q / 8 KV heads, D = 128 bf16) sends rows up to
// byte 2.1e10 of the send buffer, and reads q heads up to byte 1.7e10 of a head-major q.
static void test_pack_addresses_beyond_4gb(int64_t batch) {
  const int64_t s = int64_t(1) << 20, D = 128, row = D * 2, peers = 8, rank = 5;
  const int64_t H[3] = {64, 8, 8};
  const uintptr_t base[3] = {uintptr_t(1) << 40, uintptr_t(2) << 40, uintptr_t(3) << 40};
  const uintptr_t send = uintptr_t(4) << 40, recv = uintptr_t(5) << 40;
  // q head-major [B][H][s][D] (head offsets past 4 GiB); k, v views of one fused QKV
  // projection output [B][s][64 + 8 + 8][D] (token offsets past 4 GiB: t * 20480 bytes).
  const int64_t qkv = (H[0] + H[1] + H[2]) * row;
  const Strided4 src[3] = {{(const char*)base[0], H[0] * s * row, row, s * row, 2},
                           {(const char*)base[1], s * qkv, qkv, row, 2},
                           {(const char*)base[2], s * qkv, qkv, row, 2}};
  PackParams p{};
  p.n_roles = 3;
  p.n_peers = (int32_t)peers;
  p.batch = batch;
  p.seq = s;
  p.row_bytes = row;
  p.unit = 16;
  p.units_per_row = row / 16;
  for (int i = 0; i < 3; ++i) {
    p.src[i] = src[i];
    p.src_unit_stride[i] = 16;
  }
  const int64_t h = 10;  // 8 q heads + 1 k + 1 v per peer
  for (int64_t r = 0; r <= peers; ++r) p.peer_row0[r] = r * batch * s * h;
  for (int r = 0; r < peers; ++r) {
    p.peer_heads[r] = (int32_t)h;
    const int32_t h0[3] = {8 * r, r, r}, hn[3] = {8, 1, 1};
    for (int i = 0; i < 3; ++i) {
      p.head0[r][i] = h0[i];
      p.heads[r][i] = hn[i];
    }
  }
  p.dst = (char*)send;
  p.redirect_peer = (int32_t)rank;
  p.redirect_ss = h * row;
  p.redirect_sb = peers * s * p.redirect_ss;
  p.redirect_ptr = (char*)(recv + (uint64_t)(rank * s) * p.redirect_ss);
  const int64_t rows = p.peer_row0[peers];
  const bool narrow = narrow_index(rows * p.units_per_row);
  EXPECT(narrow == (batch == 1));
  int checked = 0;
  for (int64_t g = 0; g < rows; g += (g + 8 < rows ? 7919 : 1)) {
    const int64_t peer = g / (batch * s * h), local = g % (batch * s * h);
    const int64_t j0 = local % h, t = (local / h) % s, b = local / h / s;
    const int i = j0 < 8 ? 0 : (int)(j0 - 7);
    const int64_t head = i == 0 ? 8 * peer + j0 : peer;
    const uint64_t want_src = base[i] + (uint64_t)(b * src[i].sb + t * src[i].ss + head * src[i].sh);
    const uint64_t want_dst = peer == rank ? recv + (uint64_t)(b * p.redirect_sb + (rank * s + t) * p.redirect_ss + j0 * row)
                                           : send + (uint64_t)(g * row);
    const RowCopy wide = pack_row<int64_t>(p, g);
    EXPECT((uint64_t)(uintptr_t)wide.src == want_src && (uint64_t)(uintptr_t)wide.dst == want_dst);
    if (narrow) {
      const RowCopy r32 = pack_row<uint32_t>(p, (uint32_t)g);
      EXPECT((uint64_t)(uintptr_t)r32.src == want_src && (uint64_t)(uintptr_t)r32.dst == want_dst);
    }
    if (ulysses_kernels_tests::failures) return;
    ++checked;
  }
  EXPECT(checked > 10000);
  // The largest byte offset really is past 4 GiB (what the test is about).
  EXPECT(rows * row > (int64_t(1) << 34));
}

// The same for the unpack: one rank's [B][s][H][D] output (here head-major in memory,
// [B][H][s][D], so head offsets pass 4 GiB) gathered from 8 sources of 8 heads each, all
// views of one token-major [B][s][H][D] receive buffer (token offsets pass 4 GiB), at
// s = 2^20 local tokens, 64 heads, D = 128 bf16: output bytes reach 2^34 * B. Only
// addresses are computed (unpack_src / unpack_dst never dereference).
static void test_unpack_addresses_beyond_4gb(int64_t batch) {
  const int64_t s = int64_t(1) << 20, H = 64, D = 128, row = D * 2, peers = 8, hp = H / peers;
  const uintptr_t out = uintptr_t(9) << 40, blk = uintptr_t(1) << 40;
  UnpackParams p{};
  p.out = (char*)out;
  p.ob = H * s * row;
  p.os = row;
  p.oh = s * row;
  p.od = 2;
  p.batch = batch;
  p.seq = s;
  p.d = D;
  p.elem = 2;
  p.unit = 16;
  p.units_per_row = row / 16;
  p.n_src = (int32_t)peers;
  for (int q = 0; q < peers; ++q) {
    p.blk[q] = Strided4{(const char*)(blk + q * hp * row), s * H * row, H * row, row, 2};
    p.head0[q] = (int32_t)(q * hp);
    p.head1[q] = (int32_t)((q + 1) * hp);
  }
  const HeadSpan span = unpack_head_span(p);
  EXPECT(span.head0 == 0 && span.heads == H);
  const int64_t rows = batch * s * H;
  EXPECT(unpack_units(p, span) == rows * p.units_per_row);
  const bool narrow = narrow_index(rows * p.units_per_row);
  EXPECT(narrow == (batch == 1));
  const int before = ulysses_kernels_tests::failures;
  int checked = 0;
  for (int64_t g = 0; g < rows; g += (g + 8 < rows ? 7919 : 1)) {
    const int64_t head = g % H, t = (g / H) % s, b = g / H / s, q = head / hp;
    const OutRow wide = unpack_out_row<int64_t>(p, span, g);
    EXPECT(wide.b == b && wide.t == t && wide.head == head);
    if (narrow) {
      const OutRow r32 = unpack_out_row<uint32_t>(p, span, (uint32_t)g);
      EXPECT(r32.b == b && r32.t == t && r32.head == head);
    }
    for (int64_t u : {int64_t(0), p.units_per_row - 1}) {
      const uint64_t want_src = blk + (uint64_t)(b * s * H * row + t * H * row + head * row + u * 16);
      const uint64_t want_dst = out + (uint64_t)(b * H * s * row + head * s * row + t * row + u * 16);
      EXPECT((uint64_t)(uintptr_t)unpack_src(p, wide, (int)q, u, 16) == want_src);
      EXPECT((uint64_t)(uintptr_t)unpack_dst(p, wide, u, 16) == want_dst);
    }
    if (ulysses_kernels_tests::failures > before) return;
    ++checked;
  }
  EXPECT(checked > 8000);
  EXPECT(rows * row > (int64_t(1) << 33));
}

int main() {
  test_pack_addresses_beyond_4gb(1);  // 1.3e9 units: 32-bit index, 64-bit byte offsets
  test_pack_addresses_beyond_4gb(2);  // 2.7e9 units: 64-bit index
  test_unpack_addresses_beyond_4gb(1);  // 1.1e9 units: 32-bit index, 64-bit byte offsets
  test_unpack_addresses_beyond_4gb(2);  // 2.1e9 units: 64-bit index
  if (ulysses_kernels_tests::failures) {
    std::fprintf(stderr, "%d check(s) failed\n", ulysses_kernels_tests::failures);
    return 1;
  }
  std::printf("test_large_offsets: all checks passed\n");
  return 0;
}
