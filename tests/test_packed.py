"""Packed sequences: documents end to end in one sharded sequence (``cu_seqlens``).

Against a per-document float64 reference (each document run on its own), forward and
backward: random document lengths (length 1, shorter than the group, crossing shard
boundaries), uneven shards and padding to a multiple of the group, GQA with fewer KV heads
than ranks and head counts that do not divide the group, chunks 1, 2 and "auto", the torch
kernel set everywhere and Triton (under the interpreter) in one small case; world sizes 1
to 5 (one spawn per world size, the cases looped inside the ranks). Also: the boundaries
are checked the same way on every rank, and a multi-layer step runs no collective besides
the exchanges (after the first call's check).
"""

from __future__ import annotations

import os
import random
import re

import pytest
import torch
import torch.distributed as dist
from dynamo_support import traced_error

import ulysses_kernels as uk
from ulysses_kernels.backends import per_document
from ulysses_kernels.checks import UlyssesInputError
from ulysses_kernels.documents import Documents, documents, pad_documents
from ulysses_kernels.kernels import available_kernels
from ulysses_kernels.testing import run_ranks
from ulysses_kernels.testing.reference import attention_reference, contiguous_shard, packed_attention_reference


def random_cu(total: int, world: int, seed: int) -> list[int]:
    """Boundaries over ``total`` tokens: a document of length 1, one shorter than the group,
    then random lengths (some longer than a shard, so they cross shard boundaries)."""
    rng = random.Random(seed)
    lens = [1, max(1, world - 1)]
    while sum(lens) < total:
        lens.append(min(rng.randint(1, max(2, total // 2)), total - sum(lens)))
    rng.shuffle(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    assert cu[-1] == total
    return cu


def _inputs(hq, hkv, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, S, h, D, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _check_case(rank, world, hq, hkv, seq_lens, cu, causal, chunks, kernels, attn_fn="sdpa", valid=None):
    """One configuration on this rank against the reference. ``valid``: the real tokens
    (the rest is padding, a trailing document with no loss: its gradients must be zero)."""
    D = 8
    S = sum(seq_lens) if seq_lens is not None else cu[-1]
    lens = seq_lens if seq_lens is not None else [S // world] * world
    q, k, v, do = _inputs(hq, hkv, S, D, seed=hq * 1000 + S + len(cu))
    if valid is not None:
        do[:, valid:] = 0  # padding counts in no loss
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = packed_attention_reference(*full, cu, causal=causal)
    ref.backward(do)
    mine = [contiguous_shard(x, lens, rank).clone().requires_grad_() for x in (q, k, v)]
    out = uk.ulysses_attention(*mine, causal=causal, seq_lens=seq_lens, attn_fn=attn_fn, kernels=kernels, chunks=chunks, cu_seqlens=cu)
    out.backward(contiguous_shard(do, lens, rank))
    what = f"rank {rank}/{world} {hq}/{hkv} lens={lens} cu={cu} causal={causal} chunks={chunks} {kernels}"
    torch.testing.assert_close(out, contiguous_shard(ref, lens, rank), rtol=1e-10, atol=1e-10, msg=lambda s: f"out {what}: {s}")
    for name, m, f in zip("qkv", mine, full):
        torch.testing.assert_close(m.grad, contiguous_shard(f.grad, lens, rank), rtol=1e-10, atol=1e-10, msg=lambda s, n=name: f"d{n} {what}: {s}")
    if valid is not None:
        start = sum(lens[:rank])
        pad_rows = slice(max(valid - start, 0), lens[rank])
        assert all(not m.grad[:, pad_rows].any() for m in mine), f"{what}: padding got a gradient"
        assert full[0].grad[:, :valid].abs().sum() > 0  # the real tokens did get one


# world -> [(q_heads, kv_heads, seq_lens or None (equal shards of the total), total, causal, chunks)]
CASES = {
    1: [(4, 2, None, 13, True, 1), (6, 3, None, 9, False, 2)],
    2: [(4, 1, [7, 6], 13, True, 1), (6, 2, None, 16, False, 2), (8, 2, [3, 9], 12, True, "auto")],
    3: [(6, 2, [4, 3, 5], 12, True, 2), (5, 1, None, 9, True, 1), (40, 8, [2, 5, 3], 10, False, 3)],
    4: [(10, 2, [5, 3, 4, 6], 18, True, 2), (8, 1, None, 8, True, 1), (6, 2, None, 12, False, "auto")],
    5: [(5, 5, [2, 3, 1, 2, 2], 10, True, 1), (7, 1, [3, 3, 3, 3, 4], 16, True, 2)],
}


def _dist_job(rank, world):
    for i, (hq, hkv, seq_lens, total, causal, chunks) in enumerate(CASES[world]):
        cu = random_cu(total, world, seed=world * 10 + i)
        _check_case(rank, world, hq, hkv, seq_lens, cu, causal, chunks, "torch")
    if world == 2:
        if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in available_kernels():  # CPU tensors: the interpreter
            _check_case(rank, world, 4, 2, [4, 3], [0, 1, 5, 7], True, 1, "triton")
        if "cuda" in available_kernels():  # on a CPU: the C++ extension's CPU twin
            _check_case(rank, world, 6, 2, [5, 4], [0, 2, 7, 9], True, 2, "cuda")
        _check_case(rank, world, 4, 2, None, [0, 3, 6, 8], True, 1, "torch", attn_fn="math")
        _check_errors(rank, world)
    if world == 4:
        # 13 tokens padded to 16: the padding is a trailing document of its own.
        cu = pad_documents(random_cu(13, world, seed=5), 16)
        _check_case(rank, world, 8, 2, None, list(cu), True, 2, "torch", valid=13)
    if world == 3:
        _check_collective_count(rank, world)
        _check_own_attention(rank, world)
        _check_chunked_bit_identical(rank, world)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_packed_on_gloo(world):
    run_ranks(_dist_job, world)


def test_packed_world_one():
    for i, (hq, hkv, seq_lens, total, causal, chunks) in enumerate(CASES[1]):
        _check_case(0, 1, hq, hkv, seq_lens, random_cu(total, 1, seed=i), causal, chunks, "torch")
        _check_case(0, 1, hq, hkv, seq_lens, random_cu(total, 1, seed=i), causal, chunks, "torch", attn_fn="math")


def _check_own_attention(rank, world):
    """seq_to_head / head_to_seq users: their attention between the exchanges takes the
    global boundaries as they are (the rank holds the whole sequence in global order)."""
    hq, hkv, lens = 5, 1, [3, 4, 2]
    cu = random_cu(sum(lens), world, seed=11)
    q, k, v, do = _inputs(hq, hkv, sum(lens), 8, seed=12)
    plan = uk.HeadPlan.build(hq, hkv, world)
    mine = [contiguous_shard(x, lens, rank).clone().requires_grad_() for x in (q, k, v)]
    q_l, k_l, v_l = uk.seq_to_head(*mine, plan=plan, seq_lens=lens)
    docs = documents(cu)
    k_l, v_l = (x.expand(-1, -1, q_l.shape[2], -1) for x in (k_l, v_l))  # 5/1: one KV head per rank
    out_l = per_document(lambda *x: attention_reference(*x, True), q_l, k_l, v_l, docs)
    out = uk.head_to_seq(out_l, plan, seq_lens=lens)
    out.backward(contiguous_shard(do, lens, rank))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = packed_attention_reference(*full, cu)
    ref.backward(do)
    torch.testing.assert_close(out, contiguous_shard(ref, lens, rank), rtol=1e-10, atol=1e-10)
    for m, f in zip(mine, full):
        torch.testing.assert_close(m.grad, contiguous_shard(f.grad, lens, rank), rtol=1e-10, atol=1e-10)


def _check_chunked_bit_identical(rank, world):
    """With documents, as without: chunks=n equals chunks=1 bit for bit (SDPA, one thread),
    also on ranks whose query heads share one KV head (SharedKV split by query heads)."""
    for hq, hkv in ((12, 3), (7, 1)):
        q, k, v, do = (contiguous_shard(x, [4, 4, 4], rank) for x in _inputs(hq, hkv, 12, 8, seed=13))
        cu = random_cu(12, world, seed=14)
        results = []
        for chunks in (1, 2, 3):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = uk.ulysses_attention(*leaves, attn_fn="sdpa", chunks=chunks, cu_seqlens=cu)
            out.backward(do)
            results.append([out.detach()] + [x.grad for x in leaves])
        for other in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0], other)), f"rank {rank} {hq}/{hkv}"


# ---- the same error on every rank ---------------------------------------------------------
def _raises(pattern, fn):
    with pytest.raises(UlyssesInputError, match=pattern):
        fn()


def _check_errors(rank, world):
    q, k, v, _ = (contiguous_shard(x, [4, 4], rank) for x in _inputs(4, 2, 8, 8, seed=1))
    call = lambda cu, **kw: uk.ulysses_attention(q, k, v, cu_seqlens=cu, **kw)  # noqa: E731
    # Bad on one rank only: every rank raises, naming that rank.
    _raises(r"rank 1: cu_seqlens\[0\] expected 0, got 2", lambda: call([0, 3, 8] if rank == 0 else [2, 3, 8]))
    _raises(r"rank 1: cu_seqlens\[-1\] expected 8 \(the global sequence length: q.shape\[1\] x.*\), got 7", lambda: call([0, 3, 8] if rank == 0 else [0, 3, 7]))
    _raises(r"rank 1: cu_seqlens must be strictly increasing .* cu_seqlens\[2\] = 3 <= cu_seqlens\[1\]", lambda: call([0, 3, 8] if rank == 0 else [0, 3, 3, 8]))
    # Valid on each rank but different: the same disagreement everywhere.
    _raises(r"ranks disagree on cu_seqlens: rank 0 has 3 entries from 0 to 8 .*; rank 1 has 3 entries", lambda: call([0, 3, 8] if rank == 0 else [0, 5, 8]))
    _raises(r"ranks disagree on cu_seqlens: rank 0 has 3 entries .*; rank 1 has None", lambda: call([0, 3, 8] if rank == 0 else None))
    _raises(r"ranks disagree on max_seqlen: rank 0 has 5; rank 1 has 6$", lambda: call([0, 3, 8], max_seqlen=5 + rank))
    # Batch 2 takes one list of boundaries per row (test_packed_batch); the group still works afterwards.
    q2, k2, v2 = (torch.cat([x, x]) for x in (q, k, v))
    batch_2 = r"ranks 0-1: cu_seqlens: packed documents at batch 2 \(q.shape\[0\]\) take one list of boundaries"
    _raises(batch_2, lambda: uk.ulysses_attention(q2, k2, v2, cu_seqlens=[0, 8]))
    assert uk.ulysses_attention(q, k, v, cu_seqlens=[0, 3, 8]).shape == q.shape


def test_errors_world_one():
    q, k, v, _ = _inputs(4, 2, 9, 8, seed=0)
    call = lambda cu, **kw: uk.ulysses_attention(q, k, v, cu_seqlens=cu, **kw)  # noqa: E731
    _raises(r"cu_seqlens\[0\] expected 0, got 1", lambda: call([1, 4, 9]))
    _raises(r"cu_seqlens\[-1\] expected 9 \(the global sequence length: q.shape\[1\] x world size.*\), got 8", lambda: call([0, 4, 8]))
    _raises(r"strictly increasing .* cu_seqlens\[2\] = 2 <= cu_seqlens\[1\] = 4", lambda: call([0, 4, 2, 9]))
    _raises(r"cu_seqlens expected at least 2 entries \(0 and the global length 9\), got 1", lambda: call([0]))
    _raises(r"max_seqlen expected >= 5 \(the longest document\), got 4", lambda: call([0, 4, 9], max_seqlen=4))
    with pytest.raises(TypeError, match=re.escape("cu_seqlens expected a 1-D integer tensor")):
        call(torch.tensor([0.0, 9.0]))
    with pytest.raises(ValueError, match="max_seqlen was given without cu_seqlens"):
        uk.ulysses_attention(q, k, v, max_seqlen=3)
    # A tensor is read as the same boundaries as the list (and check=False skips nothing local).
    a = call(torch.tensor([0, 4, 9], dtype=torch.int32))
    assert torch.equal(a, call([0, 4, 9], check=False))
    assert documents(torch.tensor([0, 2, 7])) == Documents((0, 2, 7), 5)


# ---- what backends receive ------------------------------------------------------------------
def test_callable_receives_the_global_boundaries():
    seen = []

    def my_attention(q, k, v, *, causal, softmax_scale, cu_seqlens, max_seqlen):
        seen.append((q.shape, cu_seqlens, max_seqlen))
        parts = [attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal, softmax_scale) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        return torch.cat(parts, dim=1)

    q, k, v, _ = _inputs(4, 4, 10, 8, seed=3)
    out = uk.ulysses_attention(q, k, v, attn_fn=my_attention, cu_seqlens=[0, 6, 10])
    torch.testing.assert_close(out, packed_attention_reference(q, k, v, [0, 6, 10]), rtol=0, atol=0)
    assert seen == [(torch.Size([1, 10, 4, 8]), (0, 6, 10), 6)]
    # Without documents the callable gets no such keywords (older callables keep working).
    uk.ulysses_attention(q, k, v, attn_fn=lambda q, k, v, causal, softmax_scale: q)


def test_module_checks_new_boundaries():
    mod = uk.UlyssesAttention(4, 2, attn_fn="sdpa")
    q, k, v, _ = _inputs(4, 2, 9, 8, seed=4)
    for cu in ([0, 4, 9], [0, 1, 9]):
        torch.testing.assert_close(mod(q, k, v, cu_seqlens=cu), packed_attention_reference(q, k, v, cu), rtol=1e-12, atol=1e-12)
    assert len(mod._checked) == 2  # the boundaries are part of the checked signature
    with pytest.raises(UlyssesInputError, match=r"cu_seqlens\[-1\] expected 9"):
        mod(q, k, v, cu_seqlens=[0, 4, 8])


# ---- once per step: no collective per layer besides the exchanges ---------------------------
_COLLECTIVES = ("all_to_all_single", "batch_isend_irecv", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "all_gather_object", "barrier")


def _check_collective_count(rank, world):
    """Three layers of packed attention, two steps (forward + backward), every collective of
    torch.distributed counted: the first layer's check (one all_gather), then the exchanges
    only (batch 1: s2h of q/k/v, h2s of out and s2h of dout are one all_to_all each; h2s of
    dq/dk/dv is one grouped send/recv)."""
    counts = dict.fromkeys(_COLLECTIVES, 0)
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    layers = [uk.UlyssesAttention(6, 2, attn_fn="sdpa") for _ in range(3)]
    cu, lens = random_cu(12, world, seed=9), [4, 4, 4]
    x = contiguous_shard(_inputs(6, 2, 12, 8, seed=2)[0], lens, rank).requires_grad_()
    try:
        for name in _COLLECTIVES:
            setattr(dist, name, counting(name))
        per_step = []
        for _ in range(2):
            before = dict(counts)
            h = x
            for layer in layers:
                h = layer(h, h[:, :, :2], h[:, :, 2:4], cu_seqlens=cu) + h
            h.sum().backward()
            per_step.append({n: counts[n] - before[n] for n in _COLLECTIVES if counts[n] != before[n]})
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    exchanges = {"all_to_all_single": 3 * len(layers), "batch_isend_irecv": len(layers)}
    assert per_step[0] == {**exchanges, "all_gather": len(layers)}, per_step  # each module checks once
    assert per_step[1] == exchanges, per_step


# ---- compiled path and flash-attn's varlen kernel -------------------------------------------
def test_compiled_packed_world_one():
    """Inside torch.compile (fullgraph, aot_eager) the per-document SDPA loop traces into the
    graph: forward and backward equal the per-document reference."""
    q, k, v, do = _inputs(4, 2, 11, 8, seed=6)
    cu = [0, 1, 4, 10, 11]
    fn = torch.compile(lambda q, k, v: uk.ulysses_attention(q, k, v, attn_fn="sdpa", cu_seqlens=cu), fullgraph=True, backend="aot_eager")
    mine, full = ([x.clone().requires_grad_() for x in (q, k, v)] for _ in range(2))
    out = fn(*mine)
    out.backward(do)
    ref = packed_attention_reference(*full, cu)
    ref.backward(do)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for m, f in zip(mine, full):
        torch.testing.assert_close(m.grad, f.grad, rtol=1e-12, atol=1e-12)
    # Boundaries as a tensor have no values while tracing: a clear error in a full graph.
    traced = torch.compile(lambda q, cu: uk.ulysses_attention(q, q, q, cu_seqlens=cu), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=traced_error("inside torch.compile pass cu_seqlens as a list of ints")):
        traced(q, torch.tensor(cu))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_flash_varlen_world_one():
    """flash-attn's varlen kernel on a packed bfloat16 sequence vs the float64 per-document
    reference: error at most 2x SDPA's own bfloat16 error per document (+ a small floor)."""
    pytest.importorskip("flash_attn")
    cu = random_cu(1000, 1, seed=3)
    q, k, v, do = (x.cuda() for x in _inputs(8, 2, 1000, 64, seed=7))
    ref = packed_attention_reference(q, k, v, cu)
    low = [x.bfloat16() for x in (q, k, v)]
    flash = uk.ulysses_attention(*low, attn_fn="flash", cu_seqlens=cu)
    sdpa = uk.ulysses_attention(*low, attn_fn="sdpa", cu_seqlens=cu)
    assert (flash.double() - ref).abs().max() <= 2 * (sdpa.double() - ref).abs().max() + 1e-3
    # The device copy of the boundaries is made once and reused.
    docs = documents(cu)
    assert docs.on(q.device) is docs.on(q.device) and docs.on(q.device).dtype == torch.int32
