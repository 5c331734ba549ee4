"""2-D sequence parallelism (Ulysses x ring): the merge, the layout and the groups in one
process; the op on real gloo ranks, float64, forward and backward to 1e-10 against
single-process attention, for every (ulysses, ring) split of 4, 6 and 8 ranks, causal and
not, contiguous and zigzag, with KV heads fewer than the Ulysses size and query heads that
do not divide it. One launch per world size: every configuration runs inside the ranks."""

import datetime
import itertools
import random
import time

import pytest
import torch
import torch.distributed as dist
from dynamo_support import traced_error

import ulysses_kernels as uk
from ulysses_kernels.backends import FlashBackend, MathBackend, flash_available
from ulysses_kernels.math_attention import math_attention_lse
from ulysses_kernels.ring import RingBackend, block_pieces, merge_lse, shard_rows, sp_rank_lists, tile_rows
from ulysses_kernels.ring.groups import SPGroups
from ulysses_kernels.testing import ThreadGroup, run_ranks
from ulysses_kernels.testing.reference import attention_reference

TOL = {"rtol": 1e-10, "atol": 1e-10}
SPLITS = [(1, 0), (0, 1), (2, 2), (2, 3), (3, 2), (2, 4), (4, 2)]  # 0: the other factor is P
# Ulysses size -> (q_heads, kv_heads): fewer KV heads than Ulysses ranks and query heads that
# do not divide over them (U = 1 and U = 3's second case: a rank whose heads straddle KV groups).
HEADS = {1: [(2, 1)], 2: [(3, 1)], 3: [(4, 2), (8, 4)], 4: [(6, 2)], 6: [(8, 2)], 8: [(10, 2)]}
S_LOCAL, D = 6, 8


def _splits(world):
    out = []
    for u, r in SPLITS:
        u, r = u or world // r, r or world // u
        if u * r == world and (u, r) not in out:
            out.append((u, r))
    return out


# ---- one process: the merge ---------------------------------------------------------------
def _masked_attention(q, k, v, mask, scale):
    """out, lse of [B, S, H, D] attention restricted to ``mask`` [S, T] (True: visible)."""
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.einsum("bhst,bthd->bshd", torch.exp(scores - safe.unsqueeze(-1)), v), lse


@pytest.mark.parametrize("seed", range(6))
def test_merge_of_any_key_partition_is_full_attention(seed):
    gen = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    S, T, H = 7, 11, 3
    q, k, v = (torch.randn(2, n, H, D, generator=g, dtype=torch.float64) for n in (S, T, T))
    mask = torch.rand(S, T, generator=g) < 0.7
    mask[2] = False  # a row that sees no key at all
    mask[4, :] = False
    mask[4, 9] = True  # a row that sees one key, in one part only
    parts = [gen.randrange(gen.randint(1, 4)) for _ in range(T)]
    out = torch.zeros(2, S, H, D, dtype=torch.float64)
    lse = torch.full((2, H, S), float("-inf"), dtype=torch.float64)
    for p in gen.sample(sorted(set(parts)), len(set(parts))):  # any order
        cols = torch.tensor([c for c in range(T) if parts[c] == p])
        o_p, l_p = _masked_attention(q, k[:, cols], v[:, cols], mask[:, cols], 0.3)
        out, lse = merge_lse(out, lse, o_p, l_p)
    ref_out, ref_lse = _masked_attention(q, k, v, mask, 0.3)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    assert torch.isneginf(lse[:, :, 2]).all() and (out[:, 2] == 0).all()


def test_merge_does_not_overflow_in_float32():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 5, 2, D, generator=g) for _ in range(3))
    scale = 40.0  # scores in the hundreds: exp() of them overflows float32
    full = torch.ones(5, 5, dtype=torch.bool)
    o1, l1 = _masked_attention(q, k[:, :2], v[:, :2], full[:, :2], scale)
    o2, l2 = _masked_attention(q, k[:, 2:], v[:, 2:], full[:, 2:], scale)
    assert l1.abs().max() > 100
    out, lse = merge_lse(o1, l1, o2, l2)
    ref_out, ref_lse = _masked_attention(*(x.double() for x in (q, k, v)), full, scale)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-4)


def test_math_attention_lse_matches_logsumexp():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 4, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 6, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = math_attention_lse(q, k, v, True, 0.5)
    torch.testing.assert_close(out, attention_reference(q, k, v, causal=True, softmax_scale=0.5), **TOL)
    scores = torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(2, dim=2)) * 0.5
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **TOL)


# ---- one process: layout and groups --------------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("u,r", [(1, 4), (2, 3), (3, 2), (4, 1)])
def test_block_pieces_are_the_global_causal_mask(layout, u, r):
    S = 12 * u * r
    L = S // r
    blocks = [torch.cat([shard_rows(S, u, r, j * u + x, layout) for x in range(u)]) for j in range(r)]
    assert sorted(torch.cat(blocks).tolist()) == list(range(S))  # the shards cut the sequence
    for j, i in itertools.product(range(r), repeat=2):
        want = blocks[i][None, :] <= blocks[j][:, None]  # key position <= query position
        got = torch.zeros(L, L, dtype=torch.bool)
        segments = lambda n: [int(c) for c in blocks[n].view(-1, L // (2 if layout == "zigzag" else 1))[:, 0] // (L // (2 if layout == "zigzag" else 1))]  # noqa: E731
        for tile in (L, 5):  # whole pieces, and row tiles of 5 (tile_rows)
            got.zero_()
            for rows, cols, diag in tile_rows(block_pieces(segments(j), segments(i), L, True), tile):
                assert not got[rows, cols].any(), "pieces overlap"
                piece = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.bool)
                got[rows, cols] = piece.tril(cols.stop - cols.start - piece.shape[0]) if diag else piece  # bottom-right aligned
            assert torch.equal(got, want), (j, i, tile)
        assert len(block_pieces(segments(j), segments(i), L, True)) <= 1  # one call per ring step
    assert block_pieces([0], [1], 4, False) == [(slice(0, 4), slice(0, 4), False)]


def test_sp_rank_lists_and_misuse():
    ulysses, ring = sp_rank_lists(6, 2, 3)
    assert ulysses == ((0, 1), (2, 3), (4, 5)) and ring == ((0, 2, 4), (1, 3, 5))
    with pytest.raises(ValueError, match=r"ulysses_size \* ring_size \(2 \* 2 = 4\) must equal the group's size \(6\)"):
        sp_rank_lists(6, 2, 2)
    with pytest.raises(ValueError, match=r"ring_size expected a positive int, got 0"):
        sp_rank_lists(6, 6, 0)
    with pytest.raises(ValueError, match=r"ulysses_size expected a positive int, got True"):
        sp_rank_lists(1, True, 1)
    with pytest.raises(ValueError, match=r"placement expected one of \['head_first'\], got 'ring_first'"):
        sp_rank_lists(4, 2, 2, "ring_first")
    with pytest.raises(ValueError, match="seq_layout expected one of"):
        uk.make_sp_groups(2, 2, seq_layout="striped")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            uk.make_sp_groups(1, 1)
    outsider = SPGroups(2, 1, "head_first", "contiguous", (0, 1), ((0, 1),), ((0,), (1,)), None)
    with pytest.raises(ValueError, match="this process is in no group of this SPGroups"):
        outsider.member_rank()


def test_describe_prints_both_levels():
    sp = SPGroups(2, 2, "head_first", "zigzag", (0, 1, 2, 3), ((0, 1), (2, 3)), ((0, 2), (1, 3)), 0)
    text = sp.describe(3, 1, seq_len=16, batch=1, head_dim=8, itemsize=2)
    assert "4 ranks = 2 (Ulysses, contiguous ranks) x 2 (ring, strided)" in text
    assert "Ulysses groups [[0, 1], [2, 3]]; ring groups [[0, 2], [1, 3]]" in text
    rows = text.splitlines()[-4:]
    # rank 3: Ulysses rank 1 of ring rank 1, segments [1, 2] of 4, heads [2, 3), KV head [0, 1).
    assert rows[3].split()[:5] == ["3", "1", "1", "[1,", "2]"] and "[  2,  3)" in rows[3]
    # bytes: 4 tokens/rank, 16 bytes a head-row; Ulysses rank 1 sends q/k/v for rank 0's
    # 2 q + 1 kv heads (4 heads) and its 1 output head: 4*4*16 + 4*1*16 = 320; the ring: one
    # step of its 8-token block, k and v of 1 head: 8*2*16 = 256.
    assert rows[3].split()[-2:] == ["320", "256"]
    assert str(sp).startswith("SPGroups: 4 ranks")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_and_unshard_round_trip(layout):
    sp = SPGroups(3, 2, "head_first", layout, tuple(range(6)), ((0, 1, 2), (3, 4, 5)), ((0, 3), (1, 4), (2, 5)), 0)
    x = torch.arange(2 * 24 * 3, dtype=torch.float64).view(2, 24, 3)
    shards = [uk.shard_sequence(x, sp, rank=r) for r in range(6)]
    assert torch.equal(uk.unshard_sequence(shards, sp), x)
    assert torch.equal(torch.cat(shards, 1).sort(1).values, x)  # every row exactly once
    with pytest.raises(ValueError, match=r"seq_len \(20\) must split into"):
        uk.shard_sequence(x[:, :20], sp, rank=0)


def test_compiled_path_refuses_a_2d_group():
    sp = SPGroups(1, 1, "head_first", "contiguous", (0,), ((0,),), ((0,),), 0)
    q = torch.randn(1, 4, 2, D)
    fn = torch.compile(lambda q: uk.ulysses_attention(q, q, q, group=sp), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=traced_error("a 2-D group .* does not run inside torch.compile yet")):
        fn(q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not flash_available(), reason="needs a CUDA GPU and flash-attn")
def test_flash_attend_lse_matches_math():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    out, lse = FlashBackend().attend_lse(q, k, v, True, 0.125)
    ref_out, ref_lse = math_attention_lse(q.double(), k.double(), v.double(), True, 0.125)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-3, atol=1e-3)


# ---- thread ranks: the ring alone, with a communicator that poisons early reads -------------
def _ring_rank(comm, layout, causal, hq, hkv, tile_bytes):
    """``RingBackend`` over ``comm``'s ranks (Ulysses size 1): rank j holds ring block j."""
    torch.set_num_threads(1)
    R, L = comm.world_size, 8
    q, k, v, do = _inputs(hq, hkv, 2, R * L, seed=5)
    rows = shard_rows(R * L, 1, R, comm.rank, layout)
    mine = [x.index_select(1, rows) for x in (q, k, v, do)]
    ring = RingBackend(MathBackend(), comm, comm, comm.rank, R, layout, tile_bytes)  # one channel: the fake orders them
    kv_map = tuple(h * hkv // hq for h in range(hq))
    out, state = ring.forward(*mine[:3], causal=causal, scale=0.3, kv_map=kv_map, needs_grad=True)
    return rows, out, ring.backward(state, mine[3])


@pytest.mark.parametrize("layout,causal,R", [("contiguous", True, 3), ("zigzag", True, 4), ("zigzag", False, 2)])
@pytest.mark.parametrize("tile_bytes", [1 << 28, 3 * 2 * 4 * 8 * 8])  # whole pieces; 3 rows a call (batch 2 x 4 heads x 8 keys x 8 B a row)
def test_ring_backend_on_thread_ranks(layout, causal, R, tile_bytes):
    """Every receive buffer is NaN until its wait(): a block read before its transfer lands
    (or a send buffer reused early) would show here. Row tiles give the same result."""
    hq, hkv = 4, 2
    results = ThreadGroup(R, timeout=60).run(_ring_rank, layout, causal, hq, hkv, tile_bytes)
    q, k, v, do = _inputs(hq, hkv, 2, R * 8, seed=5)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*full, causal=causal, softmax_scale=0.3)
    ref.backward(do)
    for rows, out, (dq, dk, dv) in results:
        torch.testing.assert_close(out, ref.index_select(1, rows), **TOL)
        for got, f in zip((dq, dk, dv), full):
            torch.testing.assert_close(got, f.grad.index_select(1, rows), **TOL)


# ---- gloo ranks --------------------------------------------------------------------------
def _inputs(hq, hkv, B, S, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, S, hq, D), (B, S, hkv, D), (B, S, hkv, D), (B, S, hq, D))
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _exact(sp, hq, hkv, causal, *, batch=2, chunks=1, module=False):
    """One configuration: forward and backward on this rank against the full attention."""
    S = S_LOCAL * sp.world_size
    q, k, v, do = _inputs(hq, hkv, batch, S, seed=hq * 31 + hkv + S)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*full, causal=causal)
    ref.backward(do)
    mine = [uk.shard_sequence(x, sp).clone().requires_grad_() for x in (q, k, v)]
    if module:
        out = uk.UlyssesAttention(hq, hkv, sp, causal=causal, chunks=chunks)(*mine)
    else:
        out = uk.ulysses_attention(*mine, group=sp, causal=causal, chunks=chunks, attn_fn="math")
    out.backward(uk.shard_sequence(do, sp))
    what = f"U={sp.ulysses_size} R={sp.ring_size} heads=({hq},{hkv}) causal={causal} {sp.seq_layout} chunks={chunks}"
    torch.testing.assert_close(out, uk.shard_sequence(ref, sp), **TOL, msg=lambda m: f"out {what}: {m}")
    for name, m, f in zip("qkv", mine, full):
        torch.testing.assert_close(m.grad, uk.shard_sequence(f.grad, sp), **TOL, msg=lambda e, n=name: f"d{n} {what}: {e}")


def _rank_all_splits(rank, world):
    """Every split of 4, 6 and 8 ranks; 4 and 6 on subgroups of the 8 (one launch in all:
    spawning ranks is what costs here, not the configurations)."""
    for size in (4, 6, 8):
        sub = dist.new_group(list(range(size))) if size < world else None
        for u, r in _splits(size):
            sp = uk.make_sp_groups(u, r, group=sub)  # collective over the world
            if sp.rank is None:
                continue
            for layout, causal in itertools.product(("contiguous", "zigzag"), (True, False)):
                for hq, hkv in HEADS[u]:
                    _exact(sp.with_layout(layout), hq, hkv, causal)
    sp = uk.make_sp_groups(2, 4, seq_layout="zigzag")
    _exact(sp, 6, 2, True, chunks=2)  # each head chunk runs its own ring
    _exact(sp, 4, 1, True, chunks=2, module=True)  # SharedKV chunks: per-head dK/dV
    _misuse(rank, sp)


def _expect(exc, pattern, fn):
    with pytest.raises(exc, match=pattern):
        fn()


def _misuse(rank, sp):
    x = torch.randn(1, S_LOCAL, 4, D, dtype=torch.float64)
    # Bad input on one rank: the same error everywhere, no hang.
    bad = x[..., :4] if rank == 3 else x
    _expect(uk.UlyssesInputError, "head_dim|rejected their inputs", lambda: uk.ulysses_attention(bad, x, x, group=sp))
    # Two Ulysses groups given different sequence lengths: the ring level would mismatch.
    uneven = x[:, :4] if rank >= 2 else x
    _expect(uk.UlyssesInputError, r"disagree on seq_local \(q.shape\[1\]\)", lambda: uk.ulysses_attention(uneven, uneven, uneven, group=sp))
    _expect(uk.UlyssesInputError, "needs equal shards", lambda: uk.ulysses_attention(x, x, x, group=sp, seq_lens=[6] * 7 + [5]))
    _expect(ValueError, "returns the log-sum-exp", lambda: uk.ulysses_attention(x, x, x, group=sp, attn_fn=lambda q, k, v, **kw: q))
    odd = torch.randn(1, 3, 4, D, dtype=torch.float64)  # ring blocks of 1 * 3 tokens cannot halve
    zig = uk.make_sp_groups(1, 8, seq_layout="zigzag")
    _expect(uk.UlyssesInputError, "expected an even count", lambda: uk.ulysses_attention(odd, odd, odd, group=zig))
    # A Ulysses level larger than the heads names a split of the whole group that works.
    _expect(uk.UlyssesInputError, r"the 2-D group's ulysses_size \(2\) > q_heads \(1\).*make_sp_groups\(ulysses_size=1, ring_size=8\)",
            lambda: uk.ulysses_attention(x[:, :, :1], x[:, :, :1], x[:, :, :1], group=sp))  # fmt: skip
    # A flat group larger than the heads names a split that works.
    two = torch.randn(1, S_LOCAL, 2, D, dtype=torch.float64)
    _expect(uk.UlyssesInputError, r"make_sp_groups\(ulysses_size=2, ring_size=4\)", lambda: uk.ulysses_attention(two, two, two))
    _expect(TypeError, "pass its ulysses_group", lambda: uk.seq_to_head(x, group=sp))
    # A process outside the SPGroups' group: a clear error, not a hang.
    sub = uk.make_sp_groups(2, 1, group=dist.new_group([0, 1]))
    assert (sub.rank is None) == (rank >= 2)
    if rank >= 2:
        _expect(ValueError, "this process is in no group", lambda: uk.ulysses_attention(x, x, x, group=sub))
    else:
        _exact(sub, 3, 1, True)


def test_ring_exact_on_gloo_ranks():
    run_ranks(_rank_all_splits, 8, timeout_s=300)


def _rank_group_timeout(rank, world):
    sp = uk.make_sp_groups(2, 1, timeout=datetime.timedelta(seconds=2))
    if rank == 0:  # its peer never joins: the groups' own timeout ends the wait, not the world's
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)timed out"):
            dist.all_reduce(torch.ones(1), group=sp.ulysses_group)
        assert time.monotonic() - start < 20
    dist.barrier()


def test_make_sp_groups_timeout_reaches_the_groups():
    run_ranks(_rank_group_timeout, 2, timeout_s=60)
