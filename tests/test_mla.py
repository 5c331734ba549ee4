"""MLA and any v head dim: q and k with ``head_dim`` D, v (and the output) with ``Dv != D``
(DeepSeek-V2/V3, Kimi-K2, MiniCPM3), through the layout math, every kernel set, the op, its
module and the bare exchanges, the chunked pipeline, packed documents, the ring level and
the traced path.

In one process: the layout math of mixed head dims (splits, views, the send buffer of the
torch set, the definition, against an independent construction), and the Triton (under the
interpreter) and C++ (its CPU twin) sets bit for bit against it for Dv < D and Dv > D, with
GQA replicas, ``recv=`` and strided or sliced inputs; the checks (a wrong v names the
tensor, the expected and the actual value; at world 1 and on every rank); the traced path
at world 1. On gloo ranks (one spawn per world size, every case inside): float64 forward
and backward against single-process attention to 1e-10, for each kernel set, chunks 1, 2
and "auto", MHA/GQA/uneven heads, uneven shards, batch 2, packed documents; the bare
exchanges round-trip bit for bit; the ring level (Ulysses x ring, 4 ranks); the traced path
at 2 ranks; and a wrong v shape on one rank raises the same error on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ulysses_kernels as uk
from ulysses_kernels.checks import UlyssesInputError
from ulysses_kernels.kernels import available_kernels, get_kernels
from ulysses_kernels.kernels import torch_kernels as L
from ulysses_kernels.layout import OUT, QKV, Layout
from ulysses_kernels.testing import run_ranks
from ulysses_kernels.testing.reference import attention_reference, contiguous_shard, packed_attention_reference

TOL = {"rtol": 1e-10, "atol": 1e-10}
# (D, Dv): v narrower (DeepSeek's 192/128 in small), v wider, and a pair whose gcd is 1.
DIMS = [(12, 8), (8, 12), (5, 3)]
KERNELS = [k for k in ("torch", "triton", "cuda") if k in available_kernels()]


def _inputs(hq, hkv, B, S, D, Dv, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, hq, D, generator=g, dtype=dtype)
    k = torch.randn(B, S, hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, S, hkv, Dv, generator=g, dtype=dtype)
    do = torch.randn(B, S, hq, Dv, generator=g, dtype=dtype)
    return q, k, v, do


# ---- one process: the layout math and the kernel sets ------------------------------------
def _expected_send(lay: Layout, tensors, roles) -> torch.Tensor:
    """The send buffer built independently of the layout's views: per peer, per batch
    element and token, the heads of each role (each at its own head dim) end to end."""
    out = []
    for p in range(lay.world_size):
        for b in range(lay.batch):
            for t in range(lay.seq_local):
                for x, s in zip(tensors, roles):
                    a, e = lay.head_range(s, p)
                    out.append(x[b, t, a:e].reshape(-1))
    return torch.cat(out) if out else tensors[0].new_empty(0)  # no token here: an empty buffer


@pytest.mark.parametrize("D,Dv", DIMS)
def test_layout_splits_and_views_of_mixed_head_dims(D, Dv):
    plan = uk.HeadPlan.build(10, 2, 3)  # 4/3/3 query heads: both KV heads replicated
    lay = Layout(plan, 1, (5, 6, 7), 2, D, Dv)
    assert lay.dim("q") == lay.dim("kv") == D and lay.dim("v") == lay.dim("o") == Dv and not lay.uniform
    assert Layout(plan, 1, (5, 6, 7), 2, D) == Layout(plan, 1, (5, 6, 7), 2, D, D)
    for p in range(3):
        hq, hkv = plan.q_count(p), plan.kv_count(p)
        assert lay.width(QKV, p) == hq * D + hkv * D + hkv * Dv
        assert lay.width(OUT, p) == hq * Dv
    assert lay.s2h_send_splits(QKV) == [6 * 2 * lay.width(QKV, p) for p in range(3)]
    assert lay.s2h_recv_splits(QKV) == [s * 2 * lay.width(QKV, 1) for s in (5, 6, 7)]
    assert lay.h2s_splits(OUT) == ([s * 2 * plan.q_count(1) * Dv for s in (5, 6, 7)], [6 * 2 * plan.q_count(p) * Dv for p in range(3)])
    recv = torch.arange(sum(lay.s2h_recv_splits(QKV)), dtype=torch.float64)
    ql, kl, vl = lay.s2h_recv_views(recv, QKV)
    assert plan.q_count(1) == 3 and plan.kv_count(1) == 2  # query heads 4-6 use both KV heads
    assert ql.shape == (2, 18, 3, D) and kl.shape == (2, 18, 2, D) and vl.shape == (2, 18, 2, Dv)
    # The views tile the buffer: a token's row is q | k | v, each at its own width.
    w = lay.width(QKV, 1)
    assert ql[1, 4, 2, 0].item() == (1 * 18 + 4) * w + 2 * D
    assert kl[1, 4, 1, 0].item() == (1 * 18 + 4) * w + 3 * D + D
    assert vl[0, 3, 1, Dv - 1].item() == 3 * w + 3 * D + 2 * D + Dv + Dv - 1
    # The torch set's send buffer is the independent construction, bit for bit.
    q, k, v, _ = _inputs(10, 2, 2, 6, D, Dv, seed=1)
    send = torch.empty(sum(lay.s2h_send_splits(QKV)), dtype=torch.float64)
    L.pack_s2h(lay, (q, k, v), QKV, send)
    assert torch.equal(send, _expected_send(lay, (q, k, v), QKV))


def _mixed_inputs(hq, hkv, B, s, D, Dv, how, gen, dtype):
    """q, k, v ``[B, s, H, D]`` (v: Dv): contiguous, views of one fused projection
    ``[B, s, hq*D + hkv*D + hkv*Dv]``, or k and v slices of one ``[B, s, hkv, D + Dv]``
    (DeepSeek's kv_b_proj output: v's heads are D + Dv apart)."""

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    if how == "contiguous":
        return rand(B, s, hq, D), rand(B, s, hkv, D), rand(B, s, hkv, Dv)
    if how == "fused":
        flat = rand(B, s, hq * D + hkv * D + hkv * Dv)
        q, k, v = flat.split([hq * D, hkv * D, hkv * Dv], dim=2)
        return q.view(B, s, hq, D), k.view(B, s, hkv, D), v.view(B, s, hkv, Dv)
    kv = rand(B, s, hkv, D + Dv)
    return rand(B, s, hq, D), kv[..., :D], kv[..., D:]


@pytest.mark.parametrize("kernels", [k for k in KERNELS if k != "torch"])
@pytest.mark.parametrize("D,Dv", DIMS)
def test_kernel_sets_match_the_definition_bit_for_bit(kernels, D, Dv):
    kern = get_kernels(kernels, torch.device("cpu"))
    gen = torch.Generator().manual_seed(D * 10 + Dv)
    for world, hq, hkv, seq_lens, B in ((3, 10, 2, (3, 2, 4), 2), (2, 4, 4, (3, 3), 1), (4, 8, 1, (2, 3, 2, 2), 1)):
        plan = uk.HeadPlan.build(hq, hkv, world)
        for rank in range(world):
            lay = Layout(plan, rank, seq_lens, B, D, Dv)
            for dtype in (torch.float32, torch.bfloat16):
                for how in ("contiguous", "fused", "sliced"):
                    q, k, v = _mixed_inputs(hq, hkv, B, seq_lens[rank], D, Dv, how, gen, dtype)
                    for with_recv in (False, True):
                        n = sum(lay.s2h_send_splits(QKV, own=not with_recv))
                        nr = sum(lay.s2h_recv_splits(QKV))
                        ref, got = torch.zeros(n, dtype=dtype), torch.full((n,), -1.0, dtype=dtype)
                        ref_r, got_r = (torch.zeros(nr, dtype=dtype), torch.full((nr,), -1.0, dtype=dtype)) if with_recv else (None, None)
                        L.pack_s2h(lay, (q, k, v), QKV, ref, recv=ref_r)
                        kern.pack_s2h(lay, (q, k, v), QKV, got, recv=got_r)
                        assert torch.equal(ref, got), (kernels, world, rank, how, with_recv)
                        if with_recv:  # this rank's own rows of the receive buffer
                            a, n = lay.seq_offset(rank), seq_lens[rank]
                            assert torch.equal(ref_r.view(B, sum(seq_lens), -1)[:, a : a + n], got_r.view(B, sum(seq_lens), -1)[:, a : a + n])
                # Head to sequence: dq/dk/dv (replicated KV heads summed in rank order) and the output.
                for roles in (QKV, OUT):
                    nr = sum(lay.h2s_splits(roles)[1])
                    recv = torch.randn(nr, generator=gen).to(dtype)
                    blocks = lay.h2s_recv_views(recv, roles)
                    shapes = [(B, seq_lens[rank], lay.total_heads(s), lay.dim(s)) for s in roles]
                    want = [torch.zeros(x, dtype=dtype) for x in shapes]
                    got = [torch.full(x, -1.0, dtype=dtype) for x in shapes]
                    L.unpack_h2s(lay, blocks, roles, want)
                    kern.unpack_h2s(lay, blocks, roles, got)
                    for a, b in zip(want, got):
                        assert torch.equal(a, b), (kernels, world, rank, roles)
                # The output as a strided local tensor (not rows-contiguous): pack_h2s at Dv.
                local = torch.randn(B, sum(seq_lens), lay.head_count("o", rank) + 1, Dv, generator=gen).to(dtype)[:, :, 1:]
                ref, got = torch.empty(local.numel(), dtype=dtype), torch.empty(local.numel(), dtype=dtype)
                L.pack_h2s(lay, local, ref)
                kern.pack_h2s(lay, local, got)
                assert torch.equal(ref, got)


def test_wrong_v_is_a_clear_error_at_world_1():
    q, k, v, _ = _inputs(4, 2, 1, 5, 12, 8, seed=0)
    cases = [
        (v[:, :, :1], "v.shape[2] (kv_heads) expected 2 (k.shape[2]), got 1"),
        (v[:, :4], "v.shape[1] (seq_local) expected 5 (q.shape[1]), got 4"),
        (torch.cat([v, v]), "v.shape[0] (batch) expected 1 (q.shape[0]), got 2"),
        (v[..., :0], "head dims must be positive, got head_dim=12 (q.shape[3]), v_head_dim=0 (v.shape[3])"),
        (v[0], "v must be 4-D [batch, seq_local, heads, head_dim], got shape [5, 2, 8]"),
    ]
    for bad, text in cases:
        with pytest.raises(UlyssesInputError) as err:
            uk.ulysses_attention(q, k, bad)
        assert text in str(err.value)
    # k keeps q's head dim: MLA relaxes v only.
    with pytest.raises(UlyssesInputError, match=r"k.shape\[3\] \(head_dim\) expected 12 \(q.shape\[3\]\), got 8"):
        uk.ulysses_attention(q, k[..., :8], v)


@pytest.mark.parametrize("D,Dv", DIMS)
def test_world_1_op_module_and_traced(D, Dv):
    q, k, v, do = _inputs(6, 2, 2, 7, D, Dv, seed=5)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*full, causal=True)
    ref.backward(do)
    runs = {
        "op": lambda *x: uk.ulysses_attention(*x, attn_fn="math"),
        "module": uk.UlyssesAttention(6, 2, attn_fn="math"),
        "traced": torch.compile(lambda *x: uk.ulysses_attention(*x, attn_fn="math", kernels="torch"), fullgraph=True, backend="aot_eager"),
    }
    for name, fn in runs.items():
        mine = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*mine)
        assert out.shape == (2, 7, 6, Dv), name
        out.backward(do)
        torch.testing.assert_close(out, ref, **TOL)
        for m, f in zip(mine, full):
            torch.testing.assert_close(m.grad, f.grad, **TOL)


# ---- gloo ranks ----------------------------------------------------------------------------
# world -> [(q_heads, kv_heads, batch, seq_lens, causal, D, Dv)]: MHA, GQA with replicated KV
# heads, KV heads fewer than ranks, query heads that do not divide the group, MQA.
CASES = {
    2: [(4, 4, 2, [5, 3], True, 12, 8), (3, 1, 1, [2, 3], False, 8, 12), (8, 2, 1, [4, 4], True, 5, 3), (3, 3, 2, [4, 4], True, 12, 9)],
    3: [(10, 2, 2, [3, 2, 4], True, 12, 8), (6, 6, 1, [2, 2, 2], True, 8, 12), (8, 1, 1, [3, 3, 3], False, 6, 4)],
}


def _check_op(rank, world, hq, hkv, B, seq_lens, causal, D, Dv, *, kernels, chunks, attn_fn="sdpa"):
    S = sum(seq_lens)
    q, k, v, do = _inputs(hq, hkv, B, S, D, Dv, seed=hq * 100 + S + D)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*full, causal=causal)
    ref.backward(do)
    mine = [contiguous_shard(x, seq_lens, rank).clone().requires_grad_() for x in (q, k, v)]
    out = uk.ulysses_attention(*mine, causal=causal, seq_lens=seq_lens, attn_fn=attn_fn, kernels=kernels, chunks=chunks)
    out.backward(contiguous_shard(do, seq_lens, rank))
    what = f"{hq}/{hkv} heads, D {D}, Dv {Dv}, {kernels}, chunks {chunks}"
    torch.testing.assert_close(out, contiguous_shard(ref, seq_lens, rank), **TOL, msg=lambda s: f"out ({what}): {s}")
    for name, m, f in zip("qkv", mine, full):
        torch.testing.assert_close(m.grad, contiguous_shard(f.grad, seq_lens, rank), **TOL, msg=lambda s, n=name: f"d{n} ({what}): {s}")


def _check_exchanges(rank, world, hq, hkv, B, seq_lens, D, Dv):
    """seq_to_head's views are the plan's heads of the global tensors (v at Dv), head_to_seq
    of the output (Dv) inverts it, and gradients pass through both, bit for bit."""
    S = sum(seq_lens)
    q, k, v, _ = _inputs(hq, hkv, B, S, D, Dv, seed=11)
    plan = uk.HeadPlan.build(hq, hkv, world)
    mine = [contiguous_shard(x, seq_lens, rank).clone().requires_grad_() for x in (q, k, v)]
    ql, kl, vl = uk.seq_to_head(*mine, seq_lens=seq_lens)
    assert torch.equal(ql, q[:, :, slice(*plan.q_ranges[rank])])
    assert torch.equal(kl, k[:, :, slice(*plan.kv_ranges[rank])])
    assert torch.equal(vl, v[:, :, slice(*plan.kv_ranges[rank])])
    # An output-shaped tensor [B, S, hq, Dv] back to the sequence.
    o = torch.randn(B, S, hq, Dv, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    back = uk.head_to_seq(o[:, :, slice(*plan.q_ranges[rank])], plan, seq_lens=seq_lens)
    assert torch.equal(back, contiguous_shard(o, seq_lens, rank))
    # Gradients: d(sum(x_l * w_l)) through the exchange lands each head's w on its rows;
    # a KV head several ranks hold gets the sum of their parts.
    (ql.double().sum() * 2 + kl.sum() * 3 + vl.sum() * 5).backward()
    for x, c in zip(mine, (2.0, 3.0, 5.0)):
        reps = torch.tensor([len(plan.kv_holders(h)) for h in range(hkv)], dtype=torch.float64)
        want = torch.full_like(x, c) if x is mine[0] else c * reps.view(1, 1, -1, 1).expand_as(x)
        assert torch.equal(x.grad, want)


def _check_packed(rank, world, D, Dv, kernels, chunks):
    hq, hkv, seq_lens = 6, 2, [5, 4, 6][:world]
    S = sum(seq_lens)
    cu = [0, 1, 4, S - 2, S]  # a document of one token, documents across shard boundaries
    q, k, v, do = _inputs(hq, hkv, 1, S, D, Dv, seed=21)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = packed_attention_reference(*full, cu, causal=True)
    ref.backward(do)
    mine = [contiguous_shard(x, seq_lens, rank).clone().requires_grad_() for x in (q, k, v)]
    out = uk.ulysses_attention(*mine, seq_lens=seq_lens, attn_fn="sdpa", kernels=kernels, chunks=chunks, cu_seqlens=cu)
    out.backward(contiguous_shard(do, seq_lens, rank))
    torch.testing.assert_close(out, contiguous_shard(ref, seq_lens, rank), **TOL)
    for m, f in zip(mine, full):
        torch.testing.assert_close(m.grad, contiguous_shard(f.grad, seq_lens, rank), **TOL)


def _check_wrong_v_on_one_rank(rank, world):
    q, k, v, _ = _inputs(4, 2, 1, 3, 12, 8, seed=rank)
    if rank == world - 1:
        v = v[:, :, :1]
    with pytest.raises(UlyssesInputError) as err:
        uk.ulysses_attention(q, k, v)
    assert f"rank {world - 1}: v.shape[2] (kv_heads) expected 2 (k.shape[2]), got 1" in str(err.value)
    # Ranks that agree on everything but v's head dim.
    v = torch.randn(1, 3, 2, 8 + (rank == 0), dtype=torch.float64)
    with pytest.raises(UlyssesInputError, match=r"ranks disagree on v_head_dim \(v.shape\[3\]\): rank 0 has 9; "):
        uk.ulysses_attention(q, k, v)
    dist.barrier()


def _check_traced(rank, world, D, Dv):
    hq, hkv, B, seq_lens = 4, 2, 2, [3, 3]
    q, k, v, do = _inputs(hq, hkv, B, 6, D, Dv, seed=31)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*full, causal=True)
    ref.backward(do)
    # One compile per head-dim pair (each costs seconds): the C++ ops' fakes for one, torch for the other.
    for kernels in ("cuda" if "cuda" in KERNELS and Dv > D else "torch",):
        f = torch.compile(lambda *x, kernels=kernels: uk.ulysses_attention(*x, attn_fn="math", kernels=kernels), fullgraph=True, backend="aot_eager")
        mine = [contiguous_shard(x, seq_lens, rank).clone().requires_grad_() for x in (q, k, v)]
        out = f(*mine)
        out.backward(contiguous_shard(do, seq_lens, rank))
        torch.testing.assert_close(out, contiguous_shard(ref, seq_lens, rank), **TOL)
        for m, x in zip(mine, full):
            torch.testing.assert_close(m.grad, contiguous_shard(x.grad, seq_lens, rank), **TOL)


def _body(rank, world):
    for hq, hkv, B, seq_lens, causal, D, Dv in CASES[world]:
        for kernels in KERNELS:
            _check_op(rank, world, hq, hkv, B, seq_lens, causal, D, Dv, kernels=kernels, chunks=1)
        _check_op(rank, world, hq, hkv, B, seq_lens, causal, D, Dv, kernels="torch", chunks=1, attn_fn="math")
        # Chunks: with P + 1 heads some chunk holds no head of some rank (an empty output of
        # Dv columns; the C++ unpack checks its shape: found by the self-test's "mla" case).
        for kernels, chunks in (("torch", 2), (KERNELS[-1], 2), (KERNELS[-1], "auto")):
            _check_op(rank, world, hq, hkv, B, seq_lens, causal, D, Dv, kernels=kernels, chunks=chunks)
        _check_exchanges(rank, world, hq, hkv, B, seq_lens, D, Dv)
    for D, Dv in ((12, 8), (8, 12)):
        _check_packed(rank, world, D, Dv, "torch", 1)
        _check_packed(rank, world, D, Dv, KERNELS[-1], 2)
    # The module: one plan, the signature checked once.
    layer = uk.UlyssesAttention(6, 2, attn_fn="math")
    q, k, v, _ = _inputs(6, 2, 1, 2 * world, 12, 8, seed=41)
    ref = attention_reference(q, k, v, causal=True)
    lens = [2] * world
    for _ in range(2):
        out = layer(*(contiguous_shard(x, lens, rank) for x in (q, k, v)))
        torch.testing.assert_close(out, contiguous_shard(ref, lens, rank), **TOL)
    assert len(layer._checked) == 1
    _check_wrong_v_on_one_rank(rank, world)
    if world == 2:
        _check_traced(rank, world, 12, 8)
        _check_traced(rank, world, 8, 12)


@pytest.mark.parametrize("world", sorted(CASES))
def test_exact_against_single_process(world):
    run_ranks(_body, world)


def _ring_body(rank, world):
    from ulysses_kernels.ring import shard_sequence

    for seq_layout in ("contiguous", "zigzag"):
        sp = uk.make_sp_groups(ulysses_size=2, ring_size=2, seq_layout=seq_layout)
        for hq, hkv, D, Dv, causal in ((4, 2, 12, 8, True), (3, 1, 8, 12, False)):
            S = 4 * world
            q, k, v, do = _inputs(hq, hkv, 1, S, D, Dv, seed=51 + hq)
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            ref = attention_reference(*full, causal=causal)
            ref.backward(do)
            mine = [shard_sequence(x, sp).clone().requires_grad_() for x in (q, k, v)]
            for chunks in (1, 2):
                for x in mine:
                    x.grad = None
                out = uk.ulysses_attention(*mine, group=sp, causal=causal, attn_fn="sdpa", chunks=chunks)
                out.backward(shard_sequence(do, sp))
                torch.testing.assert_close(out, shard_sequence(ref, sp), **TOL)
                for m, f in zip(mine, full):
                    torch.testing.assert_close(m.grad, shard_sequence(f.grad, sp), **TOL)
        # Packed documents across the ring.
        q, k, v, do = _inputs(4, 2, 1, 16, 12, 8, seed=61)
        cu = [0, 3, 10, 11, 16]
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = packed_attention_reference(*full, cu, causal=True)
        ref.backward(do)
        mine = [shard_sequence(x, sp).clone().requires_grad_() for x in (q, k, v)]
        out = uk.ulysses_attention(*mine, group=sp, attn_fn="sdpa", cu_seqlens=cu)
        out.backward(shard_sequence(do, sp))
        torch.testing.assert_close(out, shard_sequence(ref, sp), **TOL)
        for m, f in zip(mine, full):
            torch.testing.assert_close(m.grad, shard_sequence(f.grad, sp), **TOL)


def test_ring_level_with_mla():
    run_ranks(_ring_body, 4)


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_random_mla_layouts(seed):
    """Random MLA layouts (world 1-6, GQA/MHA/MQA, uneven heads and shards, batch 1-3, D and Dv
    each narrower or wider): the receive views tile the buffer exactly once, the torch set's
    send buffer is the independent construction, and the C++ set (its CPU twin) equals it bit
    for bit, packing and unpacking (Triton: the fixed cases above, its interpreter is slow)."""
    import random

    rng = random.Random(seed)
    kern = get_kernels("cuda", torch.device("cpu")) if "cuda" in KERNELS else None
    for _ in range(12):
        world = rng.randint(1, 6)
        hkv = rng.randint(1, 4)
        hq = hkv * max(rng.randint(1, 4), -(-world // hkv))  # a multiple of hkv, at least one query head per rank
        D, Dv = rng.randint(1, 20), rng.randint(1, 20)
        B = rng.randint(1, 3)
        seq_lens = tuple(rng.randint(0, 5) for _ in range(world))
        if not sum(seq_lens):
            seq_lens = (1,) + seq_lens[1:]
        plan = uk.HeadPlan.build(hq, hkv, world)
        rank = rng.randrange(world)
        lay = Layout(plan, rank, seq_lens, B, D, Dv)
        what = (world, hq, hkv, D, Dv, B, seq_lens, rank)
        # The receive views cover every element of the buffer once.
        for roles in (QKV, OUT):
            recv = torch.zeros(sum(lay.s2h_recv_splits(roles)))
            for x, s in zip(lay.s2h_recv_views(recv, roles), roles):
                assert x.shape == (B, sum(seq_lens), lay.head_count(s, rank), lay.dim(s)), what
                x += 1
            assert torch.equal(recv, torch.ones_like(recv)), what
        q, k, v, _ = _inputs(hq, hkv, B, seq_lens[rank], D, Dv, seed=seed, dtype=torch.float32)
        send = torch.empty(sum(lay.s2h_send_splits(QKV)))
        L.pack_s2h(lay, (q, k, v), QKV, send)
        assert torch.equal(send, _expected_send(lay, (q, k, v), QKV)), what
        if kern is None:
            continue
        got = torch.full_like(send, float("nan"))
        kern.pack_s2h(lay, (q, k, v), QKV, got)
        assert torch.equal(send, got), what
        recv = torch.randn(sum(lay.h2s_splits(QKV)[1]), generator=torch.Generator().manual_seed(seed))
        shapes = [(B, seq_lens[rank], lay.total_heads(s), lay.dim(s)) for s in QKV]
        want, out = [torch.zeros(x) for x in shapes], [torch.full(x, float("nan")) for x in shapes]
        L.unpack_h2s(lay, lay.h2s_recv_views(recv, QKV), QKV, want)
        kern.unpack_h2s(lay, lay.h2s_recv_views(recv, QKV), QKV, out)
        assert all(torch.equal(a, b) for a, b in zip(want, out)), what
