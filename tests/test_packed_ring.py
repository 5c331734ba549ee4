"""Packed documents on the 2-D group (Ulysses x ring): ``ulysses_attention(...,
group=make_sp_groups(U, R), cu_seqlens=...)``.

One process: the rectangles each ring step computes (``RingSchedule``) against the global
document-causal mask, piece by piece, for random document mixes; what the schedule skips.
Thread ranks: ``RingBackend`` with documents on a fake communicator that poisons every
receive buffer until its wait (a block read before its transfer lands, or a dK/dV
accumulator sent home too early, shows as NaN). Gloo ranks (one launch of 8): 2x2 and 1x4
(two 4-rank groups side by side), 4x2 and 2x4; contiguous and zigzag; causal and not; chunks
1 and 2; random document mixes (lengths from 1 token to several ring blocks: documents
shorter than a block, spanning several blocks and ranks, crossing the zigzag fold); forward
and every gradient against a per-document float64 reference to 1e-10. Also: the transfers
the schedule skips are not made (counted), and bad boundaries raise the same error on every
rank of the 2-D group before any data moves.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
import torch.distributed as dist

import ulysses_kernels as uk
from ulysses_kernels.backends import MathBackend
from ulysses_kernels.documents import documents
from ulysses_kernels.ring import RingBackend, shard_rows, tile_rows
from ulysses_kernels.ring.schedule import ring_schedule
from ulysses_kernels.ring.seq_layout import block_runs
from ulysses_kernels.testing import ThreadGroup, run_ranks
from ulysses_kernels.testing.reference import packed_attention_reference

TOL = {"rtol": 1e-10, "atol": 1e-10}
D = 8


def random_cu(total: int, block: int, seed: int) -> list[int]:
    """Boundaries over ``total`` tokens: documents of 1 token, shorter than a ring block
    (``block`` tokens), and up to 2.5 blocks long (spanning blocks and ranks)."""
    rng = random.Random(seed)
    lens = [1]
    while sum(lens) < total:
        n = rng.choice([1, 2, rng.randint(1, block), rng.randint(block, 5 * block // 2)])
        lens.append(min(n, total - sum(lens)))
    rng.shuffle(lens)
    return [0, *itertools.accumulate(lens)]


def _global_mask(S: int, cu, causal: bool) -> torch.Tensor:
    doc = torch.bucketize(torch.arange(S), torch.tensor(cu[1:-1]), right=True)
    mask = doc[:, None] == doc[None, :]
    return mask & torch.ones(S, S, dtype=torch.bool).tril() if causal else mask


# ---- one process: the schedule --------------------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("R,L", [(2, 6), (3, 8), (4, 4)])
def test_schedule_pieces_are_the_document_mask(layout, causal, R, L):
    """Every step's rectangles (whole, and in row tiles of 3) cover exactly the visible
    pairs of that (query block, KV block), without overlap; a pair with none computes
    nothing, and a block travels at least as far as the farthest rank that needs it."""
    S = R * L
    blocks = [torch.cat([torch.arange(a, b) for a, b in block_runs(j, R, layout, L)]) for j in range(R)]
    fold = [0, S // 2 - 1, S // 2 + 1, S]  # (zigzag) a document across the fold: the middle of block R-1
    for cu in [random_cu(S, L, seed) for seed in range(6)] + [[0, S], list(range(S + 1)), fold]:
        mask = _global_mask(S, cu, causal)
        sched = ring_schedule(R, layout, L, causal, tuple(cu))
        for j, i in itertools.product(range(R), repeat=2):
            want = mask[blocks[j]][:, blocks[i]]
            for tile in (L, 3):
                got = torch.zeros(L, L, dtype=torch.bool)
                for rows, cols, diag in tile_rows(sched.pieces[j][i], tile):
                    assert not got[rows, cols].any(), f"pieces overlap at {(j, i)} {cu}"
                    piece = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.bool)
                    got[rows, cols] = piece.tril(piece.shape[1] - piece.shape[0]) if diag else piece
                assert torch.equal(got, want), (j, i, tile, cu)
            assert sched.needs(j, i) == bool(want.any())
            if sched.needs(j, i):
                assert (j - i) % R <= sched.reach[i], (j, i, sched.reach, cu)
        assert all(1 <= r <= R - 1 for r in sched.reach)


def test_schedule_skips():
    """Contiguous causal: block i is never needed by the ranks before it (no hops past
    R-1 without documents), and with documents shorter than a block it travels one hop;
    zigzag without documents needs every block everywhere."""
    plain = ring_schedule(4, "contiguous", 16, True, None)
    assert plain.reach == (3, 2, 1, 1) and plain.hops() == 7 and plain.computed_steps() == 10  # 12 hops, 16 steps unskipped
    short = ring_schedule(4, "contiguous", 16, True, (0, 10, 20, 30, 40, 50, 64))
    assert short.reach == (1, 1, 1, 1) and short.computed_steps() == 4 + 3  # the diagonal and the 3 crossings
    zig = ring_schedule(4, "zigzag", 16, True, None)
    assert zig.reach == (3, 3, 3, 3) and zig.computed_steps() == 16
    assert len({zig.pairs(j) for j in range(4)}) == 1  # zigzag's balance without documents
    one = ring_schedule(1, "contiguous", 8, True, (0, 3, 8))
    assert one.reach == (0,) and one.pieces[0][0] == ((slice(0, 3), slice(0, 3), True), (slice(3, 8), slice(3, 8), True))


# ---- thread ranks: RingBackend with documents, early reads poisoned -------------------------
def _ring_rank(comm, layout, causal, L, cu, tile_bytes):
    torch.set_num_threads(1)
    R, hq, hkv = comm.world_size, 4, 2
    q, k, v, do = _inputs(hq, hkv, R * L, seed=5)
    rows = shard_rows(R * L, 1, R, comm.rank, layout)
    mine = [x.index_select(1, rows) for x in (q, k, v, do)]
    ring = RingBackend(MathBackend(), comm, comm, comm.rank, R, layout, tile_bytes)  # one channel: the fake orders them
    kv_map = tuple(h * hkv // hq for h in range(hq))
    out, state = ring.forward(*mine[:3], causal=causal, scale=0.3, kv_map=kv_map, needs_grad=True, docs=documents(cu))
    return rows, out, ring.backward(state, mine[3])


@pytest.mark.parametrize("layout,causal,R", [("contiguous", True, 4), ("zigzag", True, 4), ("zigzag", False, 3), ("contiguous", False, 2)])
def test_ring_backend_with_documents_on_thread_ranks(layout, causal, R):
    L = 8
    for seed, tile_bytes in ((0, 1 << 28), (1, 3 * 4 * 8 * 8)):  # whole pieces; 3 rows a call
        cu = random_cu(R * L, L, seed)
        results = ThreadGroup(R, timeout=60).run(_ring_rank, layout, causal, L, cu, tile_bytes)
        q, k, v, do = _inputs(4, 2, R * L, seed=5)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = packed_attention_reference(*full, cu, causal=causal, softmax_scale=0.3)
        ref.backward(do)
        for rows, out, grads in results:
            torch.testing.assert_close(out, ref.index_select(1, rows), **TOL, msg=lambda m, cu=cu: f"out {cu}: {m}")
            for got, f in zip(grads, full):
                torch.testing.assert_close(got, f.grad.index_select(1, rows), **TOL, msg=lambda m, cu=cu: f"grad {cu}: {m}")


# ---- gloo ranks ----------------------------------------------------------------------------
# Ulysses size -> (q_heads, kv_heads): fewer KV heads than Ulysses ranks, query heads that do
# not divide them (U = 2: 3 heads; U = 4: 6 heads, a rank straddling KV groups).
HEADS = {1: (2, 1), 2: (3, 1), 4: (6, 2)}
S_LOCAL = 4


def _inputs(hq, hkv, S, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, S, h, D, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _exact(sp, cu, causal, chunks, *, module=False):
    """One configuration on this rank: forward and every gradient against the per-document
    float64 reference (each document run on its own)."""
    hq, hkv = HEADS[sp.ulysses_size]
    S = S_LOCAL * sp.world_size
    q, k, v, do = _inputs(hq, hkv, S, seed=len(cu) * 7 + S)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = packed_attention_reference(*full, cu, causal=causal)
    ref.backward(do)
    mine = [uk.shard_sequence(x, sp).clone().requires_grad_() for x in (q, k, v)]
    if module:
        out = uk.UlyssesAttention(hq, hkv, sp, causal=causal, chunks=chunks)(*mine, cu_seqlens=cu)
    else:
        out = uk.ulysses_attention(*mine, group=sp, causal=causal, chunks=chunks, attn_fn="sdpa", cu_seqlens=cu)
    out.backward(uk.shard_sequence(do, sp))
    what = f"U={sp.ulysses_size} R={sp.ring_size} {sp.seq_layout} causal={causal} chunks={chunks} cu={cu}"
    torch.testing.assert_close(out, uk.shard_sequence(ref, sp), **TOL, msg=lambda m: f"out {what}: {m}")
    for name, m, f in zip("qkv", mine, full):
        torch.testing.assert_close(m.grad, uk.shard_sequence(f.grad, sp), **TOL, msg=lambda e, n=name: f"d{n} {what}: {e}")


def _run_split(sp, seed):
    block = S_LOCAL * sp.ulysses_size
    for n, (layout, causal) in enumerate(itertools.product(("contiguous", "zigzag"), (True, False))):
        cu = random_cu(S_LOCAL * sp.world_size, block, seed + n)
        for chunks in (1, 2):
            _exact(sp.with_layout(layout), cu, causal, chunks)


def _rank_body(rank, world):
    halves = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
    # 2x2 and 1x4 on two 4-rank groups at the same time (make_sp_groups is world-collective).
    for u, r in ((2, 2), (1, 4)):
        mine = [uk.make_sp_groups(u, r, group=h) for h in halves]
        sp = mine[rank // 4]
        _run_split(sp, seed=10 * u + rank // 4)
    for u, r in ((4, 2), (2, 4)):
        _run_split(uk.make_sp_groups(u, r), seed=100 + u)
    sp = uk.make_sp_groups(2, 4, seq_layout="zigzag")
    # A document across the zigzag fold (the middle of ring rank 3's block), one covering the
    # whole sequence, and the module (which checks each new boundary set once).
    S = S_LOCAL * 8
    _exact(sp, [0, 3, S // 2 - 3, S // 2 + 5, S], True, 2, module=True)
    _exact(sp, [0, S], True, 1)
    _check_skipped_transfers(rank)
    _check_errors(rank, sp)


def _check_skipped_transfers(rank):
    """Contiguous, causal, documents that end inside the next block: every block travels one
    hop (forward: K/V; backward: K/V and dK/dV, which then comes home), so each rank posts 4
    sends on the ring groups where the full ring would post 3 * 3 (R = 4, 3 hops each way)."""
    sp = uk.make_sp_groups(2, 4)
    S, block = S_LOCAL * 8, S_LOCAL * 2
    cu = [0] + [b + 2 for b in range(0, S - block, block)] + [S]  # each document ends 2 tokens into the next block
    sched = ring_schedule(4, "contiguous", block, True, tuple(cu))
    assert sched.reach == (1, 1, 1, 1)
    sends = []
    original = dist.batch_isend_irecv

    def counting(ops):
        sends.extend(op for op in ops if op.op is dist.isend)
        return original(ops)

    dist.batch_isend_irecv = counting
    try:
        _exact(sp, cu, True, 1)
    finally:
        dist.batch_isend_irecv = original
    ring_sends = [op for op in sends if op.group in (sp.ring_group, sp.ring_grad_group)]
    # forward K/V 1 hop, backward K/V 1 hop, dK/dV 1 hop and home: 2 tensors each.
    assert len(ring_sends) == 2 * 4, [op.group for op in sends]


def _raises(pattern, fn):
    with pytest.raises(uk.UlyssesInputError, match=pattern):
        fn()


def _check_errors(rank, sp):
    """Bad boundaries on one rank: the same error on all 8 ranks, naming that rank, before any
    data moves (the group works afterwards)."""
    S = S_LOCAL * 8
    q = torch.randn(1, S_LOCAL, 4, D, dtype=torch.float64)
    call = lambda cu, **kw: uk.ulysses_attention(q, q, q, group=sp, cu_seqlens=cu, **kw)  # noqa: E731
    good = [0, 5, S]
    _raises(r"^ulysses_attention: rank 5: cu_seqlens\[0\] expected 0, got 2$", lambda: call(good if rank != 5 else [2, 5, S]))
    _raises(rf"rank 6: cu_seqlens\[-1\] expected {S} \(the global sequence length: q.shape\[1\] x the 2-D group's size .*\), got {S - 1}",
            lambda: call(good if rank != 6 else [0, 5, S - 1]))  # fmt: skip
    _raises(r"ranks 0-7: cu_seqlens must be strictly increasing .* cu_seqlens\[2\] = 5 <= cu_seqlens\[1\] = 5", lambda: call([0, 5, 5, S]))
    _raises(r"ranks of the 2-D group disagree on cu_seqlens: ranks 0-2, 4-7 have 3 entries .*; rank 3 has 3 entries",
            lambda: call(good if rank != 3 else [0, 6, S]))  # fmt: skip
    _raises(r"disagree on cu_seqlens: ranks 0-6 have 3 entries .*; rank 7 has None", lambda: call(good if rank != 7 else None))
    two_rows = r"ranks 0-7: packed documents at batch 2 on a 2-D group \(SPGroups\): the ring level takes one packed row \(batch 1\)"
    _raises(two_rows, lambda: uk.ulysses_attention(*(torch.cat([q, q]),) * 3, group=sp, cu_seqlens=good))
    _raises(r"needs equal shards on every rank \(for packed documents pad the sequence", lambda: call(good, seq_lens=[4] * 7 + [5]))
    out = call(good)  # nothing was left half-posted
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_packed_ring_exact_on_gloo_ranks():
    run_ranks(_rank_body, 8, timeout_s=400)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["flash", "varlen", "flex"])
def test_gpu_varlen_steps(kernel):
    """``ring.varlen`` (one packed-kernel call per ring step, forward with the log-sum-exp)
    against the per-rectangle math path, on one GPU (ring of one: its diagonal step is the
    per-document call) in bf16: error at most 2x the math path's own against float64, plus a
    small floor; a kernel that cannot run here skips with its reason. The math path's output is
    rounded to bf16 as the kernel's is (left in float32 its error was 8e-7, below one bf16
    rounding: the H200 run of 2026-11-28 failed both kernels at 0.0081 against that bound)."""
    from ulysses_kernels.packed import KERNELS, DocMask
    from ulysses_kernels.ring.varlen import attend_lse_pieces

    why = KERNELS[kernel].why_not(torch.device("cuda"), torch.bfloat16, DocMask(True), False)
    if why:
        pytest.skip(f"{kernel}: {why}")
    torch.manual_seed(0)
    L, cu = 512, random_cu(512, 128, 3)
    q, k, v = (torch.randn(1, L, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    sched = ring_schedule(1, "contiguous", L, True, tuple(cu))
    got = attend_lse_pieces(q, k, v, sched.pieces[0][0], 0.125, KERNELS[kernel])
    for (rows, out, lse), (r2, cols, diag) in zip(got, sched.pieces[0][0]):
        assert rows == r2
        want_o, want_l = MathBackend().attend_lse(q[:, rows].double(), k[:, cols].double(), v[:, cols].double(), diag, 0.125)
        low_o, _ = MathBackend().attend_lse(q[:, rows], k[:, cols], v[:, cols], diag, 0.125)
        low_o = low_o.to(out.dtype)
        assert (out.double() - want_o).abs().max() <= 2 * (low_o.double() - want_o).abs().max() + 1e-3
        torch.testing.assert_close(lse.double(), want_l, rtol=1e-3, atol=1e-3)


def test_ring_balance_table(tmp_path, capsys):
    """``bench.ring_balance``: unpacked, contiguous is ``(2R-1)/R`` and zigzag 1; the ring
    ranks' work adds up to every document's causal pairs; the CLI prints and writes rows."""
    from ulysses_kernels.bench import ring_balance as rb

    for R in (2, 4):
        assert rb.balance(1024, R, "none", "contiguous", 1)["imbalance"] == pytest.approx((2 * R - 1) / R, rel=1e-2)
        assert rb.balance(1024, R, "none", "zigzag", 1)["imbalance"] == 1.0
    cu = rb.document_mix(1 << 15, "longtail", seed=3)
    assert cu[0] == 0 and cu[-1] == 1 << 15 and all(b > a for a, b in itertools.pairwise(cu))
    for layout in ("contiguous", "zigzag"):
        sched = ring_schedule(4, layout, (1 << 15) // 4, True, cu)
        assert sum(sched.pairs(j) for j in range(4)) == sum((b - a) * (b - a + 1) // 2 for a, b in itertools.pairwise(cu))
    assert rb.main(["--seqs", "4K", "--rings", "2", "--batches", "2", "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "max/mean" in out and len([line for line in out.splitlines() if line.strip().startswith("4096")]) == 6
    assert len(json.loads((tmp_path / "b.json").read_text())["rows"]) == 6


def test_balance_documents():
    """``rank_work`` is the schedule's work; ``balance_documents`` returns a permutation that
    is never worse than the given order, deterministic, and evens a long-tailed batch."""
    from ulysses_kernels.bench.ring_balance import document_mix
    from ulysses_kernels.ring import balance_documents, rank_work

    cu = document_mix(1 << 15, "longtail", seed=3)
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    imbalance = lambda w: max(w) / (sum(w) / len(w))  # noqa: E731
    for R, layout in ((4, "contiguous"), (4, "zigzag"), (2, "zigzag")):
        sched = ring_schedule(R, layout, (1 << 15) // R, True, cu)
        assert rank_work(lengths, R, layout) == [sched.pairs(j) for j in range(R)]
        order = balance_documents(lengths, R, layout)
        assert sorted(order) == list(range(len(lengths))) and order == balance_documents(lengths, R, layout)
        before, after = imbalance(rank_work(lengths, R, layout)), imbalance(rank_work([lengths[i] for i in order], R, layout))
        assert after <= before, (R, layout, before, after)
    # contiguous, R = 4: this batch (8 documents) goes from 2.05 to 1.25 (measured).
    order = balance_documents(lengths, 4, "contiguous")
    assert imbalance(rank_work(lengths, 4, "contiguous")) > 1.9 > 1.5 > imbalance(rank_work([lengths[i] for i in order], 4, "contiguous"))
    with pytest.raises(ValueError, match=r"must split into 8 equal segments for seq_layout='zigzag'"):
        balance_documents([3, 4], 4, "zigzag")
    # Padded as shard_batch(pad=True) pads: the padding stays the last document.
    docs = [5, 1, 2, 9, 3, 7]  # 27 tokens -> 28 on 2x2 zigzag
    order = balance_documents(docs, 2, "zigzag", padded_to=28)
    assert sorted(order) == list(range(6))
    assert max(rank_work([docs[i] for i in order] + [1], 2, "zigzag")) <= max(rank_work(docs + [1], 2, "zigzag"))
