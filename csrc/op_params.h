// What the host layers of the plain ops (ops.cpp) and the FP8 wire's ops (fp8_ops.cpp) both
// do to turn tensors and head_ranges into the kernels' parameter structs (kernels/layout_math.h):
// byte strides as a Strided4, the world size that head_ranges implies, each peer's heads in a
// pack, the own peer's block redirected into recv, and one source's head range in an unpack.
// The two differ only in the row: D elements of the tensors' dtype, or the wire's D + 4 bytes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "kernels/layout_math.h"
#include "message.h"

namespace ulysses_kernels {

// Byte stride of `dim`; a dimension of size 1 contributes nothing, so its (arbitrary)
// stride must not spoil the alignment choice.
inline int64_t byte_stride(const at::Tensor& t, int64_t dim) {
  return t.size(dim) == 1 ? 0 : t.stride(dim) * static_cast<int64_t>(t.element_size());
}

inline Strided4 strided4(const at::Tensor& t) {
  return Strided4{static_cast<const char*>(t.const_data_ptr()), byte_stride(t, 0), byte_stride(t, 1), byte_stride(t, 2),
                  t.size(3) == 1 ? static_cast<int64_t>(t.element_size()) : byte_stride(t, 3)};
}

// A flat contiguous block of B * S * h rows of `row_bytes` (elements of `elem` bytes) as the
// [B][S][h][row] tensor it holds (byte strides as strided4 gives them: none for a dimension of size 1).
inline Strided4 flat_strided4(const at::Tensor& t, int64_t B, int64_t S, int64_t h, int64_t row_bytes, int64_t elem) {
  return Strided4{static_cast<const char*>(t.const_data_ptr()), B == 1 ? 0 : S * h * row_bytes, S == 1 ? 0 : h * row_bytes,
                  h == 1 ? 0 : row_bytes, elem};
}

// The world size implied by head_ranges ([peer][role][start, end] for n roles), checked
// against the limits of the kernels' parameter structs. `what` names the tensor list, `per`
// the first index of head_ranges (peer for a pack, source for an unpack).
inline int64_t checked_world_size(const char* op, const char* what, const char* per, int64_t n, at::IntArrayRef head_ranges) {
  UK_CHECK(n >= 1 && n <= kMaxRoles, "ulysses_kernels.", op, ": ", what, " expected 1 to ", kMaxRoles, " tensors, got ", n);
  const int64_t len = static_cast<int64_t>(head_ranges.size());
  UK_CHECK(len > 0 && len % (2 * n) == 0, "ulysses_kernels.", op, ": head_ranges expected 2 * ", n,
           " * world_size values ([", per, "][role][start, end]), got ", len);
  const int64_t peers = len / (2 * n);
  UK_CHECK(peers <= kMaxPeers, "ulysses_kernels.", op, ": world_size expected at most ", kMaxPeers, ", got ", peers);
  return peers;
}

// The head range [a, b) of `what` checked against its tensor's `heads` and the kernels' 32-bit
// head indices.
inline void check_head_range(const char* op, const std::string& what, int64_t a, int64_t b, int64_t heads) {
  UK_CHECK(0 <= a && a <= b && b <= heads, "ulysses_kernels.", op, ": head range of ", what, " expected within [0, ", heads,
           "], got [", a, ", ", b, ")");
  UK_CHECK(b <= kMaxHeads, "ulysses_kernels.", op, ": head range of ", what, " expected to end at most at ", kMaxHeads,
           " (32-bit head indices), got [", a, ", ", b, ")");
}

// A pack's peers: each peer's heads of every role (head0, heads, peer_heads) and its first
// row in the peer-major send rows (peer_row0, B * S rows per head). Returns the rows in all.
inline int64_t fill_pack_peers(PackParams& p, const char* op, at::TensorList tensors, at::IntArrayRef head_ranges) {
  const int64_t n = p.n_roles, peers = p.n_peers;
  int64_t rows = 0;
  for (int64_t peer = 0; peer < peers; ++peer) {
    p.peer_row0[peer] = rows;
    int64_t h = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = head_ranges[(peer * n + i) * 2], b = head_ranges[(peer * n + i) * 2 + 1];
      check_head_range(op, message("peer ", peer, ", tensors[", i, "]"), a, b, tensors[i].size(2));
      p.head0[peer][i] = static_cast<int32_t>(a);
      p.heads[peer][i] = static_cast<int32_t>(b - a);
      h += b - a;
    }
    UK_CHECK(h <= kMaxHeads, "ulysses_kernels.", op, ": heads sent to peer ", peer, " expected at most ", kMaxHeads,
             " (32-bit head counts), got ", h);
    p.peer_heads[peer] = static_cast<int32_t>(h);
    rows += p.seq * p.batch * h;
  }
  p.peer_row0[peers] = rows;
  p.redirect_peer = -1;
  p.redirect_rows = 0;
  return rows;
}

// With recv: the rows of peer `rank` go to recv, viewed as [B][total][h(rank)][row], at tokens
// [seq_offset, seq_offset + S), instead of the send buffer (fill_pack_peers first). A row is
// `row_elems` elements of recv (`row_text` says what: "D", "(D + 4) bytes").
inline void redirect_own_rows(PackParams& p, const char* op, const at::Tensor& recv, int64_t rank, int64_t seq_offset,
                              int64_t row_elems, const char* row_text) {
  UK_CHECK(0 <= rank && rank < p.n_peers, "ulysses_kernels.", op, ": rank expected in [0, ", p.n_peers,
           ") when recv is given, got ", rank);
  const int64_t h = p.peer_heads[rank], per_token = p.batch * h * row_elems;
  UK_CHECK(recv.dim() == 1 && recv.is_contiguous() && (per_token == 0 ? recv.numel() == 0 : recv.numel() % per_token == 0),
           "ulysses_kernels.", op, ": recv expected a contiguous 1-D tensor of B * S * h * ", row_text, " = ", p.batch, " * S * ",
           h, " * ", row_elems, " elements, got shape ", list_text(recv.sizes()));
  // With no heads for this rank (a chunk may give it none) there is nothing to redirect.
  const int64_t total = per_token == 0 ? p.seq + seq_offset : recv.numel() / per_token;
  UK_CHECK(0 <= seq_offset && seq_offset + p.seq <= total, "ulysses_kernels.", op, ": seq_offset expected in [0, ",
           total - p.seq, "] (recv holds ", total, " tokens, tensors[0] ", p.seq, "), got ", seq_offset);
  p.redirect_peer = static_cast<int32_t>(rank);
  p.redirect_rows = p.peer_row0[rank + 1] - p.peer_row0[rank];
  p.redirect_ss = h * p.row_bytes;
  p.redirect_sb = total * p.redirect_ss;
  p.redirect_ptr = static_cast<char*>(recv.mutable_data_ptr()) + seq_offset * p.redirect_ss;
}

// An unpack's output: its pointer, byte strides and sizes; the unit is the caller's.
inline UnpackParams unpack_output(const at::Tensor& out, int64_t sources) {
  const int64_t elem = out.element_size(), D = out.size(3);
  UnpackParams p{};
  p.out = static_cast<char*>(out.mutable_data_ptr());
  p.ob = byte_stride(out, 0);
  p.os = byte_stride(out, 1);
  p.oh = byte_stride(out, 2);
  p.od = D == 1 ? elem : byte_stride(out, 3);
  p.batch = out.size(0);
  p.seq = out.size(1);
  p.d = D;
  p.elem = elem;
  p.n_src = static_cast<int32_t>(sources);
  return p;
}

}  // namespace ulysses_kernels
