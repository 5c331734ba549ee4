"""ulysses_attention on real gloo ranks: exact against single-process float64 attention,
forward and backward, for awkward layouts; the all-to-all ops round-trip bit-exact; and
bad input raises the same clear error on every rank without hanging the group."""

import os

import pytest
import torch
import torch.distributed as dist

import ulysses_kernels as uk
from ulysses_kernels.checks import Signature, rank_list, signature, validate
from ulysses_kernels.comm import LocalCommunicator, NoProcessGroupError
from ulysses_kernels.testing import run_ranks
from ulysses_kernels.testing.reference import attention_reference, contiguous_shard

# world -> [(q_heads, kv_heads, batch, seq_lens, causal)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    2: [(4, 4, 2, [5, 3], True), (4, 4, 1, [4, 4], False), (8, 2, 2, [3, 4], True), (3, 1, 1, [2, 3], True)],
    3: [(40, 8, 1, [3, 2, 4], True), (6, 6, 2, [2, 2, 2], False), (10, 2, 2, [4, 4, 4], True)],
    4: [(10, 2, 2, [5, 3, 4, 6], True), (8, 1, 1, [2, 3, 2, 2], False), (8, 8, 2, [3, 3, 3, 3], True), (40, 8, 2, [2, 2, 2, 3], False)],
    5: [(40, 8, 2, [2, 3, 1, 2, 2], True), (5, 5, 1, [2, 2, 2, 2, 2], False)],
    8: [(40, 8, 1, [2, 1, 2, 1, 2, 1, 2, 2], True), (8, 1, 2, [1] * 8, False), (64, 8, 1, [2] * 8, True)],
}


def _inputs(hq, hkv, B, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, hkv, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, S, hq, D, generator=g, dtype=torch.float64)
    return q, k, v, do


def _check_against_reference(rank, hq, hkv, B, seq_lens, causal, attn_fn, equal_default):
    D, S = 8, sum(seq_lens)
    q, k, v, do = _inputs(hq, hkv, B, S, D, seed=hq * 100 + S)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*full, causal=causal)
    ref.backward(do)
    mine = [contiguous_shard(x, seq_lens, rank).clone().requires_grad_() for x in (q, k, v)]
    lens = None if equal_default else seq_lens
    out = uk.ulysses_attention(*mine, causal=causal, seq_lens=lens, attn_fn=attn_fn)
    out.backward(contiguous_shard(do, seq_lens, rank))
    torch.testing.assert_close(out, contiguous_shard(ref, seq_lens, rank), rtol=1e-10, atol=1e-10)
    for name, m, f in zip("qkv", mine, full):
        torch.testing.assert_close(m.grad, contiguous_shard(f.grad, seq_lens, rank), rtol=1e-10, atol=1e-10, msg=lambda s, name=name: f"d{name}: {s}")


def _check_round_trip(rank, world, hq, hkv, B, seq_lens):
    D, S = 4, sum(seq_lens)
    q, k, v, _ = _inputs(hq, hkv, B, S, D, seed=7)
    q, k, v = (contiguous_shard(x, seq_lens, rank).float() for x in (q, k, v))
    plan = uk.HeadPlan.build(hq, hkv, world)
    ql, kl, vl = uk.seq_to_head(q, k, v, seq_lens=seq_lens)
    # The received heads are the plan's heads of the global tensors.
    everything = [torch.empty(B, S, h, D) for h in (hq, hkv, hkv)]
    for full, local in zip(everything, (q, k, v)):
        parts = [torch.empty(B, n, full.shape[2], D) for n in seq_lens]
        dist.all_gather(parts, local.contiguous()) if len(set(seq_lens)) == 1 else _gather_uneven(parts, local)
        full.copy_(torch.cat(parts, dim=1))
    assert torch.equal(ql, everything[0][:, :, slice(*plan.q_ranges[rank])])
    assert torch.equal(kl, everything[1][:, :, slice(*plan.kv_ranges[rank])])
    assert torch.equal(vl, everything[2][:, :, slice(*plan.kv_ranges[rank])])
    back = uk.head_to_seq(ql, plan, seq_lens=seq_lens)
    assert torch.equal(back, q)
    # q alone, and gradients through both ops: d(head_to_seq(seq_to_head(x))) = identity.
    x = q.clone().requires_grad_()
    y = uk.head_to_seq(uk.seq_to_head(x, seq_lens=seq_lens, plan=plan), plan, seq_lens=seq_lens)
    assert torch.equal(y, q)
    y.backward(q * 2)
    assert torch.equal(x.grad, q * 2)


def _gather_uneven(parts, local):
    # gloo all_gather wants equal sizes: pad to the longest shard.
    longest = max(p.shape[1] for p in parts)
    padded = torch.zeros(local.shape[0], longest, *local.shape[2:])
    padded[:, : local.shape[1]] = local
    bufs = [torch.empty_like(padded) for _ in parts]
    dist.all_gather(bufs, padded)
    for p, b in zip(parts, bufs):
        p.copy_(b[:, : p.shape[1]])


def _body(rank, world):
    for hq, hkv, B, seq_lens, causal in CASES[world]:
        equal = len(set(seq_lens)) == 1
        _check_against_reference(rank, hq, hkv, B, seq_lens, causal, "math", equal_default=False)
        _check_against_reference(rank, hq, hkv, B, seq_lens, causal, "sdpa", equal_default=equal)
        _check_round_trip(rank, world, hq, hkv, B, seq_lens)
    # The module: plan held, signature checked once, then reused.
    hq, hkv, B, seq_lens, causal = CASES[world][0]
    layer = uk.UlyssesAttention(hq, hkv, causal=causal, attn_fn="math")
    assert layer.plan == uk.HeadPlan.build(hq, hkv, world)
    D, S = 8, sum(seq_lens)
    q, k, v, _ = _inputs(hq, hkv, B, S, D, seed=3)
    ref = attention_reference(q, k, v, causal=causal)
    for _ in range(2):
        out = layer(*(contiguous_shard(x, seq_lens, rank) for x in (q, k, v)), seq_lens=seq_lens)
        torch.testing.assert_close(out, contiguous_shard(ref, seq_lens, rank), rtol=1e-10, atol=1e-10)
    assert len(layer._checked) == 1
    assert layer.comm is None  # the module makes no communicator: each call takes the default
    if world == 2:
        _check_module_keeps_its_group(rank, world)


def _check_module_keeps_its_group(rank, world):
    """A module on a subgroup runs on that group (not the world): each rank alone here."""
    alone = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes each
    layer = uk.UlyssesAttention(4, 2, group=alone[rank], causal=True, attn_fn="math")
    assert layer.plan == uk.HeadPlan.build(4, 2, 1)
    q, k, v, _ = _inputs(4, 2, 1, 5, 8, seed=10 + rank)
    torch.testing.assert_close(layer(q, k, v), attention_reference(q, k, v, causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", sorted(CASES))
def test_exact_against_single_process(world):
    run_ranks(_body, world)


def test_world_size_one_without_torch_distributed():
    for hq, hkv, B, S, causal in [(4, 4, 2, 7, True), (10, 2, 1, 5, False), (8, 1, 2, 6, True)]:
        q, k, v, do = _inputs(hq, hkv, B, S, 8, seed=1)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = attention_reference(*full, causal=causal)
        ref.backward(do)
        mine = [x.clone().requires_grad_() for x in (q, k, v)]
        out = uk.ulysses_attention(*mine, causal=causal)
        out.backward(do)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        for m, f in zip(mine, full):
            torch.testing.assert_close(m.grad, f.grad, rtol=1e-10, atol=1e-10)


def test_user_callable_backend_gets_plain_grouped_heads():
    seen = []

    def my_attention(q, k, v, causal, softmax_scale):
        seen.append((q.shape[2], k.shape[2]))
        return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)

    q, k, v, _ = _inputs(10, 2, 1, 6, 8, seed=2)
    out = uk.ulysses_attention(q, k, v, attn_fn=my_attention)
    torch.testing.assert_close(out, attention_reference(q, k, v), rtol=1e-12, atol=1e-12)
    assert seen == [(10, 2)]


# ---- errors: the same message on every rank, and the group still works afterwards ------
def _expect_error(fn, match):
    with pytest.raises(uk.UlyssesInputError, match=match) as info:
        fn()
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, str(info.value))
    assert len(set(messages)) == 1, messages


def _errors_body(rank, world):
    B, s, D = 2, 3, 8
    hq, hkv = 8, 2
    q, k, v = (torch.randn(B, s, h, D) for h in (hq, hkv, hkv))

    def bad(**changes):
        qq, kk, vv = changes.get("q", q), changes.get("k", k), changes.get("v", v)
        return lambda: uk.ulysses_attention(qq, kk, vv, seq_lens=changes.get("seq_lens"))

    only_rank1 = lambda x, y: x if rank == 1 else y  # noqa: E731
    _expect_error(
        bad(k=only_rank1(torch.randn(B, s, hkv, 4), k), v=only_rank1(torch.randn(B, s, hkv, 4), v)),
        r"rank 1: k.shape\[3\] \(head_dim\) expected 8 \(q.shape\[3\]\), got 4",
    )
    _expect_error(bad(v=only_rank1(torch.randn(B, s, hkv + 1, D), v)), r"rank 1: v.shape\[2\] \(kv_heads\) expected 2 \(k.shape\[2\]\), got 3")
    _expect_error(bad(k=torch.randn(B + 1, s, hkv, D), v=torch.randn(B + 1, s, hkv, D)), r"k.shape\[0\] \(batch\) expected 2 \(q.shape\[0\]\), got 3")
    _expect_error(
        bad(q=torch.randn(B, s, 6, D), k=torch.randn(B, s, 4, D), v=torch.randn(B, s, 4, D)),
        r"q_heads \(6, q.shape\[2\]\) must be a multiple of kv_heads \(4, k.shape\[2\]\)",
    )
    _expect_error(bad(v=only_rank1(v.double(), v)), r"rank 1: v.dtype expected float32 \(q.dtype\), got float64")
    _expect_error(bad(k=only_rank1(k.to("meta"), k)), r"rank 1: k.device expected cpu \(q.device\), got meta")
    few = world + 1
    _expect_error(
        bad(q=torch.randn(B, s, world - 1, D), k=torch.randn(B, s, 1, D), v=torch.randn(B, s, 1, D)), rf"world_size \({world}\) > q_heads \({world - 1}\)"
    )
    # Uneven shards without seq_lens: never silently wrong.
    longer = [torch.randn(B, s + 1, h, D) for h in (hq, hkv, hkv)]
    q2, k2, v2 = (only_rank1(a, b) for a, b in zip(longer, (q, k, v)))
    _expect_error(bad(q=q2, k=k2, v=v2), r"ranks hold different sequence lengths \[3, 4(, 3)*\].*pass seq_lens=")
    _expect_error(bad(seq_lens=[s] * world if rank else [s] * (world - 1) + [s + 1]), r"ranks disagree on seq_lens")
    _expect_error(bad(seq_lens=[s + 1] + [s] * (world - 1)), r"rank 0: q.shape\[1\] \(seq_local\) expected seq_lens\[0\] = 4, got 3")
    # Rank 1's list changes its own entry: the disagreement is named, not a shape on rank 1.
    mine = [s] * world if rank != 1 else [s, s + 1] + [s] * (world - 2)
    others = rank_list([r for r in range(world) if r != 1])  # "rank 0" at 2 ranks, "ranks 0, 2-3" at 4
    _expect_error(
        bad(seq_lens=mine),
        rf"^ulysses_attention: ranks disagree on seq_lens: {others} ha(s|ve) \[{s}(, {s})*\]; rank 1 has \[{s}, {s + 1}(, {s})*\] "
        r"\(pass the same list on every rank\)$",
    )
    heads_differ = rf"ranks disagree on q_heads \(q.shape\[2\]\): {others} ha(s|ve) {hq}; rank 1 has {2 * hq}$"
    _expect_error(bad(q=only_rank1(torch.randn(B, s, hq * 2, D), q)), heads_differ)
    # Integer tensors are refused with the other checks (before: SDPA's own error, naming no tensor).
    ints = [torch.randint(0, 9, x.shape) for x in (q, k, v)]
    _expect_error(
        bad(q=ints[0], k=ints[1], v=ints[2]),
        rf"^ulysses_attention: ranks 0-{world - 1}: q.dtype expected a floating-point dtype \(float32, bfloat16, float16, float64\), got int64$",
    )
    # softmax_scale that is not a finite number: named (before: "could not convert string to float: 'x'").
    for scale, shown in (("x", r"'x' \(str\)"), (float("inf"), r"inf \(float\)"), (torch.ones(2), r"tensor\(\[1\., 1\.\]\) \(Tensor\)")):
        _expect_error(
            lambda scale=scale: uk.ulysses_attention(q, k, v, softmax_scale=scale),
            rf"^ulysses_attention: softmax_scale expected a finite number or None, got {shown}$",
        )
    # The same problem on every rank is said once, with the ranks it applies to.
    _expect_error(bad(q=q[0]), rf"^ulysses_attention: ranks 0-{world - 1}: q must be 4-D \[batch, seq_local, heads, head_dim\], got shape \[3, 8, 8\]$")
    # [B, H, S, D] passed by mistake (16 tokens per rank, 8 query heads): a hint on the layout.
    t = 16
    bhsd = [torch.randn(B, h, t, D) for h in (hq, hkv, hkv)]
    hint = (
        r"\(hint: q.shape is \[2, 8, 16, 8\]; q, k and v are \[batch, seq_local, heads, head_dim\]: "
        r"a \[batch, heads, seq, head_dim\] tensor needs .transpose\(1, 2\) first\)$"
    )
    _expect_error(bad(q=bhsd[0], k=bhsd[1], v=bhsd[2]), r"k.shape\[1\] \(seq_local\) expected 8 \(q.shape\[1\]\), got 2.*" + hint)
    mha = torch.randn(B, hq, t, D)
    _expect_error(bad(q=mha, k=mha, v=mha, seq_lens=[t] * world), r"q.shape\[1\] \(seq_local\) expected seq_lens\[\d\] = 16, got 8.*" + hint)
    with pytest.raises(uk.UlyssesInputError, match=rf"seq_lens has {few} entries, expected one per rank \({world}\)"):
        uk.ulysses_attention(q, k, v, seq_lens=[s] * few)
    # head_to_seq checks rank-locally (no collective), with the same error type as the rest.
    plan = uk.HeadPlan.build(hq, hkv, world)
    h = plan.q_count(rank)
    wrong_heads = rf"head_to_seq: x.shape expected \[B, S, {h}, D\] \(rank {rank}'s heads\), got \[2, {s * world}, {h + 1}, 8\]"
    with pytest.raises(uk.UlyssesInputError, match=wrong_heads):
        uk.head_to_seq(torch.randn(B, s * world, h + 1, D), plan)
    with pytest.raises(uk.UlyssesInputError, match=rf"head_to_seq: x.shape\[1\] \({s * world + 1}\) is not divisible by world_size \({world}\); pass seq_lens"):
        uk.head_to_seq(torch.randn(B, s * world + 1, h, D), plan)
    wrong_lens = rf"head_to_seq: seq_lens expected {world} entries summing to x.shape\[1\] = {s * world}, got \[{s}"
    with pytest.raises(uk.UlyssesInputError, match=wrong_lens):
        uk.head_to_seq(torch.randn(B, s * world, h, D), plan, seq_lens=[s] * world + [1])
    with pytest.raises(uk.UlyssesInputError, match=rf"head_to_seq: plan.world_size expected {world} \(the group\), got {world + 1}"):
        uk.head_to_seq(torch.randn(B, s * world, h, D), uk.HeadPlan.build(hq * 2, hkv, world + 1))
    # After all that, a valid call still runs and agrees with the reference.
    out = uk.ulysses_attention(q, k, v)
    parts = [torch.empty_like(x) for x in (q,) for _ in range(world)]
    dist.all_gather(parts, q)
    assert out.shape == q.shape and torch.isfinite(out).all()


def _readme_lower_level(rank, world):
    """docs/usage.md's "Lower level" lines, run as written around a user's attention over equal
    q and KV head counts: at 3 ranks rank 1's query heads 14-26 straddle KV heads 2-5, so the
    lines without ``plan.local_kv_map`` would be wrong (or fail on a shape)."""
    with open(os.path.join(ROOT, "docs", "usage.md")) as fh:
        readme = fh.read()
    start = readme.index("# Lower level")
    end = readme.index("out = uk.head_to_seq(out, plan)", start)
    code = readme[start : readme.index("\n", end)]
    D, S = 4, 6 * world
    q, k, v, _ = _inputs(40, 8, 1, S, D, seed=11)
    shards = {n: contiguous_shard(x, [S // world] * world, rank) for n, x in zip("qkv", (q, k, v))}
    scope = {"uk": uk, "world_size": world, "rank": rank, **shards,
             "my_attention": lambda qq, kk, vv: attention_reference(qq, kk, vv, causal=True)}  # fmt: skip
    exec(code, scope)
    torch.testing.assert_close(scope["out"], contiguous_shard(attention_reference(q, k, v), [S // world] * world, rank), rtol=1e-12, atol=1e-12)


def test_readme_lower_level_example_at_3_ranks():
    run_ranks(_readme_lower_level, 3)


def test_error_text_does_not_grow_with_the_world():
    """64 ranks with the same bad input, and 64 ranks of which three disagree: one line each."""
    world, q = 64, torch.empty(1, 4, 64, 8, dtype=torch.int32)
    sigs = [signature(q, q, q, rank=r, world_size=world, causal=True, scale=None, seq_lens=None, plan_heads=None) for r in range(world)]
    with pytest.raises(uk.UlyssesInputError) as info:
        validate([Signature.decode(g.encode()) for g in sigs], gathered=True)
    assert str(info.value) == ("ulysses_attention: ranks 0-63: q.dtype expected a floating-point dtype (float32, bfloat16, float16, float64), got int32")
    x, y = torch.empty(1, 4, 64, 8), torch.empty(1, 4, 64, 8, dtype=torch.float16)
    odd = {5, 6, 40}
    sigs = [signature(*(y if r in odd else x,) * 3, rank=r, world_size=world, causal=True, scale=None, seq_lens=None, plan_heads=None)
            for r in range(world)]  # fmt: skip
    with pytest.raises(uk.UlyssesInputError) as info:
        validate(sigs, gathered=True)
    assert str(info.value) == "ulysses_attention: ranks disagree on dtype: ranks 0-4, 7-39, 41-63 have float32; ranks 5-6, 40 have float16"
    assert rank_list([3]) == "rank 3" and rank_list([0, 1, 2, 4]) == "ranks 0-2, 4"


def test_launched_ranks_without_a_process_group_raise(monkeypatch):
    """torchrun started 4 processes but the script never called init_process_group: each
    rank would attend over its own shard only. Raise instead, naming the fix."""
    q, k, v, _ = _inputs(4, 2, 1, 6, 8, seed=3)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(NoProcessGroupError, match=r"WORLD_SIZE=4 .* torch.distributed is not initialized .*init_process_group"):
        uk.ulysses_attention(q, k, v)
    with pytest.raises(NoProcessGroupError, match="WORLD_SIZE=4"):
        uk.UlyssesAttention(4, 2)
    # A deliberate world of one per process says so.
    torch.testing.assert_close(uk.ulysses_attention(q, k, v, comm=LocalCommunicator()), attention_reference(q, k, v), rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert uk.ulysses_attention(q, k, v).shape == q.shape


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_raises_on_every_rank(world):
    run_ranks(_errors_body, world)
