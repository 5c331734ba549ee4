"""The layout math and the reference pack/unpack, all ranks simulated in one process:
the collective is replaced by concatenating the blocks each rank sends, so every byte's
destination is checked bit-exact for many plans without spawning ranks."""

import pytest
import torch

from ulysses_kernels.attention.chunked import chunk_plans
from ulysses_kernels.attention.exchange import _h2s_blocks, _rows, _s2h_views
from ulysses_kernels.kernels.torch_kernels import pack_s2h, unpack_h2s
from ulysses_kernels.layout import Q_ONLY, QKV, Layout
from ulysses_kernels.plan import HeadPlan

PLANS = [
    # (q_heads, kv_heads, world, seq_lens, batch)
    (4, 4, 1, [5], 2),
    (4, 4, 2, [3, 4], 2),
    (8, 2, 2, [4, 4], 1),
    (10, 2, 4, [3, 1, 4, 2], 2),
    (40, 8, 3, [2, 3, 2], 1),
    (40, 8, 5, [1, 2, 1, 2, 1], 2),
    (40, 8, 8, [1] * 7 + [2], 1),
    (8, 1, 8, [2] * 8, 2),
    (6, 2, 4, [2, 0, 3, 1], 3),
]


def _shard(x, seq_lens, r):
    start = sum(seq_lens[:r])
    return x[:, start : start + seq_lens[r]]


def simulate_seq_to_head(plan, seq_lens, full, roles, pack=pack_s2h, own_rows_in_place=False):
    """Every rank packs, pieces are exchanged, every rank's received views are returned.

    ``own_rows_in_place``: each rank packs its own block straight into its receive buffer
    (the batch > 1 path), the rest through the send buffer."""
    B, D, P = full[0].shape[0], full[0].shape[3], plan.world_size
    layouts = [Layout(plan, r, tuple(seq_lens), B, D) for r in range(P)]
    nan = float("nan")
    recvs = [torch.full((sum(lay.s2h_recv_splits(roles)),), nan, dtype=full[0].dtype) for lay in layouts]
    sends = []
    own = not own_rows_in_place  # the send buffer holds this rank's own block
    for r, lay in enumerate(layouts):
        send = torch.full((sum(lay.s2h_send_splits(roles, own=own)),), nan, dtype=full[0].dtype)
        pack(lay, [_shard(x, seq_lens, r) for x in full], roles, send, **({} if own else {"recv": recvs[r]}))
        sends.append(lay.s2h_send_pieces(send, roles, own=own))
    for p, lay in enumerate(layouts):
        pieces = lay.s2h_recv_pieces(recvs[p], roles)
        for r in range(P):
            if own_rows_in_place and r == p:
                continue
            for b in range(B):
                pieces[r][b].copy_(sends[r][p][b])
    return [lay.s2h_recv_views(recv, roles) for lay, recv in zip(layouts, recvs)]


def simulate_head_to_seq(plan, seq_lens, locals_per_rank, roles, unpack=unpack_h2s):
    """``locals_per_rank[p]``: rank p's ``[B, S, h_p, D]`` tensors, one per role."""
    x0 = locals_per_rank[0][0]
    B, D, P = x0.shape[0], x0.shape[3], plan.world_size
    outs = []
    for r in range(P):
        lay = Layout(plan, r, tuple(seq_lens), B, D)
        pieces = []
        for p in range(P):
            src = Layout(plan, p, tuple(seq_lens), B, D)
            pieces += [src.h2s_send_blocks(x, r).reshape(-1) for x in locals_per_rank[p]]
        recv = torch.cat(pieces)
        assert recv.numel() == sum(lay.h2s_splits(roles)[1])
        blocks = lay.h2s_recv_views(recv, roles)
        result = [torch.full((B, seq_lens[r], lay.total_heads(s), D), float("nan"), dtype=x0.dtype) for s in roles]
        unpack(lay, blocks, roles, result)
        outs.append(result)
    return outs


@pytest.mark.parametrize("hq,hkv,P,seq_lens,B", PLANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_seq_to_head_moves_every_head_to_its_owner(hq, hkv, P, seq_lens, B, dtype, in_place):
    plan = HeadPlan.build(hq, hkv, P)
    S, D = sum(seq_lens), 4
    q, k, v = (torch.randn(B, S, h, D).to(dtype) for h in (hq, hkv, hkv))
    for p, (ql, kl, vl) in enumerate(simulate_seq_to_head(plan, seq_lens, [q, k, v], QKV, own_rows_in_place=in_place)):
        assert torch.equal(ql, q[:, :, slice(*plan.q_ranges[p])])
        assert torch.equal(kl, k[:, :, slice(*plan.kv_ranges[p])])
        assert torch.equal(vl, v[:, :, slice(*plan.kv_ranges[p])])
        assert ql.stride(-1) == 1 and kl.stride(-1) == 1


@pytest.mark.parametrize("hq,hkv,P,seq_lens,B", PLANS)
def test_seq_to_head_accepts_views_of_a_fused_projection(hq, hkv, P, seq_lens, B):
    plan = HeadPlan.build(hq, hkv, P)
    S, D = sum(seq_lens), 4
    fused = torch.randn(B, S, (hq + 2 * hkv) * D)
    q, k, v = fused.view(B, S, hq + 2 * hkv, D).split([hq, hkv, hkv], dim=2)
    assert not q.is_contiguous()
    for p, (ql, kl, vl) in enumerate(simulate_seq_to_head(plan, seq_lens, [q, k, v], QKV)):
        assert torch.equal(ql, q[:, :, slice(*plan.q_ranges[p])])
        assert torch.equal(kl, k[:, :, slice(*plan.kv_ranges[p])])
        assert torch.equal(vl, v[:, :, slice(*plan.kv_ranges[p])])


@pytest.mark.parametrize("hq,hkv,P,seq_lens,B", PLANS)
def test_head_to_seq_sums_kv_replicas_once_in_rank_order(hq, hkv, P, seq_lens, B):
    plan = HeadPlan.build(hq, hkv, P)
    S, D = sum(seq_lens), 4
    dq = torch.randn(B, S, hq, D)
    # Each holder of a KV head has its own partial gradient.
    dk_parts = [torch.randn(B, S, plan.kv_count(p), D) for p in range(P)]
    dv_parts = [torch.randn(B, S, plan.kv_count(p), D) for p in range(P)]
    locals_ = [[dq[:, :, slice(*plan.q_ranges[p])], dk_parts[p], dv_parts[p]] for p in range(P)]
    # Batch-major local tensors exercise the strided read of the wire blocks.
    outs = simulate_head_to_seq(plan, seq_lens, locals_, QKV)
    for parts, got_index in ((dk_parts, 1), (dv_parts, 2)):
        expected = torch.empty(B, S, hkv, D)
        for j in range(hkv):
            holders = plan.kv_holders(j)
            acc = parts[holders[0]][:, :, j - plan.kv_ranges[holders[0]][0]].clone()
            for p in holders[1:]:
                acc += parts[p][:, :, j - plan.kv_ranges[p][0]]
            expected[:, :, j] = acc
        for r in range(P):
            assert torch.equal(outs[r][got_index], _shard(expected, seq_lens, r))
    for r in range(P):
        assert torch.equal(outs[r][0], _shard(dq, seq_lens, r))


@pytest.mark.parametrize("hq,hkv,P,seq_lens,B", PLANS)
def test_round_trip_is_bit_exact(hq, hkv, P, seq_lens, B):
    plan = HeadPlan.build(hq, hkv, P)
    S, D = sum(seq_lens), 8
    x = torch.randn(B, S, hq, D, dtype=torch.float16)
    there = simulate_seq_to_head(plan, seq_lens, [x], Q_ONLY)
    back = simulate_head_to_seq(plan, seq_lens, [[views[0]] for views in there], Q_ONLY)
    for r in range(P):
        assert torch.equal(back[r][0], _shard(x, seq_lens, r))


def test_split_sizes_match_buffer_sizes():
    plan = HeadPlan.build(40, 8, 3)
    lay = Layout(plan, 1, (5, 6, 7), 2, 16)
    assert lay.s2h_send_splits(QKV) == [6 * 2 * 16 * (plan.q_count(p) + 2 * plan.kv_count(p)) for p in range(3)]
    # pack_s2h(recv=...) puts this rank's own block in the receive buffer: no room for it in send.
    assert lay.s2h_send_splits(QKV, own=False) == [n if p != 1 else 0 for p, n in enumerate(lay.s2h_send_splits(QKV))]
    send = torch.empty(sum(lay.s2h_send_splits(QKV, own=False)))
    pieces = lay.s2h_send_pieces(send, QKV, own=False)
    assert [sum(x.numel() for x in per) for per in pieces] == lay.s2h_send_splits(QKV, own=False)
    views = lay.s2h_send_views(send, QKV, torch.empty(sum(lay.s2h_recv_splits(QKV))))
    assert sum(v.numel() for p in (0, 2) for v in views[p]) == send.numel()  # the peers' views tile send
    assert lay.s2h_recv_splits(QKV) == [s * 2 * 16 * (13 + 2 * 4) for s in (5, 6, 7)]
    send, recv = lay.h2s_splits(Q_ONLY)
    assert send == [s * 2 * 16 * 13 for s in (5, 6, 7)]
    assert recv == [6 * 2 * 16 * plan.q_count(p) for p in range(3)]


def _same_views(xs, ys) -> bool:
    """The same shapes, strides and offsets: views of one buffer cut the same way."""
    return [(x.shape, x.stride(), x.storage_offset()) for x in xs] == [(y.shape, y.stride(), y.storage_offset()) for y in ys]


def _movers_cut_as_the_layout_views(lay: Layout, roles, extra: int) -> None:
    """The movers cut their buffers by a route's numbers alone, into the layout's own views
    (of the padded layout for an FP8 wire)."""
    s2h, h2s = lay.s2h_route(roles, extra), lay.h2s_route(roles, extra)
    wire = lay.padded_rows(extra)
    recv = torch.empty(sum(s2h.recv_splits))
    assert _same_views(_s2h_views(s2h, recv), wire.s2h_recv_views(recv, roles))
    blocks = torch.empty(sum(h2s.recv_splits))
    for flat in (False, True):
        got, want = _h2s_blocks(h2s, blocks, flat), wire.h2s_recv_views(blocks, roles, flat=flat)
        assert all(_same_views(g, w) for g, w in zip(got, want, strict=True))
    local = torch.empty(lay.batch, lay.seq_total, 3, 8)
    assert all(_same_views([_rows(h2s, local, p)], [lay.h2s_send_blocks(local, p)]) for p in range(lay.world_size))


@pytest.mark.parametrize("hq,hkv,P,seq_lens,B", PLANS)
@pytest.mark.parametrize("v_dim", [8, 12])
def test_routes_cut_the_chunks_heads_as_the_layout_views(hq, hkv, P, seq_lens, B, v_dim):
    """Head chunks give a rank no heads of a role (``chunk_plans``): a route's views of it are
    empty ``[B, S, 0, D]`` views, as the layout's."""
    plan = HeadPlan.build(hq, hkv, P)
    for chunks, kv_last in ((2, False), (3, True)):
        for chunk in chunk_plans(plan, chunks, kv_last=kv_last):
            for r in range(P):
                lay = Layout(chunk, r, tuple(seq_lens), B, 8, v_dim)
                for roles, extra in ((QKV, 0), (QKV, 4), (("o",), 0), (("kv", "v"), 0)):
                    _movers_cut_as_the_layout_views(lay, roles, extra)


@pytest.mark.parametrize("hq,hkv,P,seq_lens,B", PLANS)
@pytest.mark.parametrize("v_dim", [8, 12])  # 12: MLA's own v head dim
@pytest.mark.parametrize("extra", [0, 4])  # 4: an FP8 wire's scale bytes per row
def test_routes_cut_buffers_as_the_layout_methods_do(hq, hkv, P, seq_lens, B, v_dim, extra):
    """``s2h_route``/``h2s_route`` (what the movers read) hold the numbers of the layout's
    own split, piece and view methods, of the padded layout for the buffers, for every rank."""
    plan = HeadPlan.build(hq, hkv, P)
    for r in range(P):
        lay = Layout(plan, r, tuple(seq_lens), B, 8, v_dim)
        wire = lay.padded_rows(extra)
        assert (wire.head_dim, wire.v_head_dim) == (8 + extra, v_dim + extra)
        for roles in (QKV, Q_ONLY, ("o",)):
            s2h = lay.s2h_route(roles, extra)
            assert s2h is lay.s2h_route(roles, extra)  # kept on the layout
            assert list(s2h.send_splits) == wire.s2h_send_splits(roles)
            assert list(s2h.recv_splits) == wire.s2h_recv_splits(roles)
            assert s2h.peer_send == sum(wire.s2h_send_splits(roles, own=False))
            send = torch.arange(float(s2h.peer_send))
            expected = [x for per in wire.s2h_send_pieces(send, roles, own=False) for x in per]
            assert [x.numel() for x in expected] == list(s2h.send_pieces)
            recv = torch.arange(float(sum(s2h.recv_splits)))
            by_source = wire.s2h_recv_pieces(recv, roles)
            cut = recv.split_with_sizes(s2h.recv_pieces)
            assert all(torch.equal(cut[b * P + p], by_source[p][b]) for p in range(P) for b in range(B))
            # The results' shapes, as the layout's views of an unpadded receive buffer.
            flat = torch.arange(float(sum(lay.s2h_recv_splits(roles))))
            assert s2h.out_shapes == tuple(tuple(x.shape) for x in lay.s2h_recv_views(flat, roles))
            h2s = lay.h2s_route(roles, extra)
            assert (list(h2s.send_splits), list(h2s.recv_splits)) == wire.h2s_splits(roles)
            assert h2s.wire == wire and h2s.block_shapes == wire.h2s_block_shapes(roles)
            sizes = [x.numel() for per in wire.h2s_recv_views(torch.empty(sum(h2s.recv_splits)), roles) for x in per]
            assert h2s.peer_block_sizes == tuple(sizes[p * len(roles) + i] for p in range(P) if p != r for i in range(len(roles)))
            assert h2s.out_shapes == tuple((B, seq_lens[r], lay.total_heads(s), lay.dim(s)) for s in roles)
            _movers_cut_as_the_layout_views(lay, roles, extra)
    routes = lay.routes(QKV, out=True, extras=(extra, 0, extra, 0))
    assert routes == (lay.s2h_route(QKV, extra), lay.h2s_route(("o",)), lay.s2h_route(("o",), extra), lay.h2s_route(QKV))
    assert routes is lay.routes(QKV, out=True, extras=(extra, 0, extra, 0))  # kept on the layout
    assert lay.routes((), out=True) == (None, lay.h2s_route(("o",)), lay.s2h_route(("o",)), None)
    assert lay.routes(Q_ONLY, out=False) == (lay.s2h_route(Q_ONLY), None, None, lay.h2s_route(Q_ONLY))
