"""ulysses_attention under torch.compile(fullgraph=True) on the CPU: forward and backward
trace into one graph each (``ulysses_kernels.attention.traced``), at world size 1 in process and
at world size 2 on real gloo ranks, and match the eager op bit for bit, forward and
backward (``aot_eager``, one intra-op thread per rank), in float64 and bfloat16, including
ranks whose query heads share one KV head (both paths run ``backends.SharedKV`` there),
and a single-process float64 reference.

The graphs are recorded by wrapping ``aot_eager`` (the same backend, with compilers that
keep the forward and backward graphs), so a test fails if the backward silently ran
eagerly instead of as a compiled graph, or if a collective is missing from a graph.
"""

import pytest
import torch
from dynamo_support import traced_error

import ulysses_kernels as uk
from ulysses_kernels.backends import AttentionBackend
from ulysses_kernels.kernels import available_kernels
from ulysses_kernels.testing import run_ranks
from ulysses_kernels.testing.reference import attention_reference, contiguous_shard

KERNELS = ["torch", pytest.param("cuda", marks=pytest.mark.skipif("cuda" not in available_kernels(), reason="ulysses_kernels._C is not built"))]


def _recording_aot_eager(graphs):
    """``aot_eager`` whose forward and backward compilers append the graph code to
    ``graphs["fw"]`` / ``graphs["bw"]``."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def record(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm.code)
            return boxed_nop(gm, example_inputs)

        return compiler

    def backend(gm, example_inputs):
        return aot_eager(gm, example_inputs, fw_compiler=record("fw"), bw_compiler=record("bw"))

    return backend


def _inputs(hq, hkv, B, S, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv, hq)]


# Compiled and eager outputs/gradients against the float64 reference, per input dtype
# (rtol = atol). NOTE: bf16 MQA 4/1, S=11: max error 0.022 on dv values up to 5 (about one
# bf16 ulp at that magnitude), 0.009 on dk values up to 2.
REF_TOL = {torch.float64: 1e-10, torch.bfloat16: 3e-2}


@pytest.fixture
def one_thread():
    """One intra-op thread (what run_ranks gives each rank): CPU kernels then reduce in one
    fixed order, which the bit-for-bit comparisons rely on."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _assert_equal(got, want, what):
    assert torch.equal(got, want), f"{what}: compiled != eager, max diff {(got.double() - want.double()).abs().max().item()}"


def _run(fn, tensors, dout):
    """``fn(q, k, v)`` then backward with ``dout``: (out, [dq, dk, dv])."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [x.grad for x in leaves]


# ---- world size 1, in process ---------------------------------------------------------------
@pytest.mark.parametrize("kernels", KERNELS)
def test_world_size_1_forward_and_backward_trace(kernels):
    # GQA 6/2, batch 2, kernels named by string (the registry must not import while tracing).
    q, k, v, do = _inputs(6, 2, 2, 12, 8, seed=0)

    def f(q, k, v):
        return uk.ulysses_attention(q, k, v, attn_fn="sdpa", kernels=kernels)

    graphs = {"fw": [], "bw": []}
    torch._dynamo.reset()
    out, grads = _run(torch.compile(f, fullgraph=True, backend=_recording_aot_eager(graphs)), (q, k, v), do)
    assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1, {k: len(x) for k, x in graphs.items()}
    assert "_backward" in graphs["bw"][0]  # the attention backward is in the compiled graph
    # The same ops as eager in the same order (one rank: no exchange, one pack, SDPA with
    # grouped heads): bit for bit.
    want_out, want_grads = _run(f, (q, k, v), do)
    assert torch.equal(out, want_out)
    for name, got, want in zip("qkv", grads, want_grads):
        assert torch.equal(got, want), f"d{name}: max diff {(got - want).abs().max().item()}"
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*full, causal=True)
    ref.backward(do)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, x in zip(grads, full):
        torch.testing.assert_close(got, x.grad, rtol=1e-10, atol=1e-10)


def test_world_size_1_module_math_backend_and_a_second_sequence_length():
    # The module (check="once" bookkeeping runs inside the trace), the einsum backend, MQA,
    # and a second call with another sequence length (dynamo recompiles with a dynamic
    # length; the layout math then runs on symbolic sizes).
    layer = uk.UlyssesAttention(4, 1, causal=False, attn_fn="math")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    for S in (10, 7):
        q, k, v, do = _inputs(4, 1, 1, S, 8, seed=S)
        out, grads = _run(compiled, (q, k, v), do)
        want_out, want_grads = _run(layer, (q, k, v), do)
        _assert_equal(out, want_out, f"S={S} out")
        for name, got, want in zip("qkv", grads, want_grads):
            _assert_equal(got, want, f"S={S} d{name}")


# MQA at world size 1: the rank's query heads share its one KV head, so eager runs
# backends.SharedKV (MHA over a stride-0 view, the KV gradient summed per query head by
# KVGradSum, float32 accumulator for bf16); the graph must do the same, not let the
# backend's grouped-query backward sum it (that was up to 2e-15 apart in float64 with SDPA,
# 1-2 bf16 ulps in bfloat16; the math backend happened to agree in float64).
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
@pytest.mark.parametrize("attn_fn", ["sdpa", "math"])
@pytest.mark.usefixtures("one_thread")
def test_world_size_1_shared_kv_equals_eager(attn_fn, dtype):
    q, k, v, do = _inputs(4, 1, 2, 11, 8, seed=7, dtype=dtype)

    def f(q, k, v):
        return uk.ulysses_attention(q, k, v, attn_fn=attn_fn)

    graphs = {"fw": [], "bw": []}
    torch._dynamo.reset()
    out, grads = _run(torch.compile(f, fullgraph=True, backend=_recording_aot_eager(graphs)), (q, k, v), do)
    assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1, {k: len(x) for k, x in graphs.items()}
    want_out, want_grads = _run(f, (q, k, v), do)
    _assert_equal(out, want_out, "out")
    for name, got, want in zip("qkv", grads, want_grads):
        _assert_equal(got, want, f"d{name}")
    full = [x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*full, causal=True)
    ref.backward(do.double())
    tol = REF_TOL[dtype]
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
    for got, x in zip(grads, full):
        torch.testing.assert_close(got.double(), x.grad, rtol=tol, atol=tol)


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "trace_autograd_ops"), reason="this torch has no dynamo trace_autograd_ops")
def test_world_size_1_backward_inside_the_compiled_function():
    # out.backward() inside the compiled function: dynamo traces Tensor.backward only with
    # trace_autograd_ops (off by default in torch 2.14); the op itself needs nothing else.
    q, k, v, do = _inputs(4, 2, 1, 9, 8, seed=5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def step(q, k, v, do):
        out = uk.ulysses_attention(q, k, v, attn_fn="sdpa")
        (out * do).sum().backward()
        return out.detach()

    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        out = torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves, do)
    want_out, want_grads = _run(lambda *t: uk.ulysses_attention(*t, attn_fn="sdpa"), (q, k, v), do)
    assert torch.equal(out, want_out)
    for x, want in zip(leaves, want_grads):
        assert torch.equal(x.grad, want)


class _ExplicitBackend:
    """A backend object with its own forward/backward (no autograd inside): non-causal
    softmax attention over ``[B, S, h, D]`` and its gradients written out by hand."""

    def forward(self, q, k, v, *, causal, scale, kv_map, needs_grad):
        index = torch.tensor(kv_map, device=q.device)
        k2, v2 = k.index_select(2, index), v.index_select(2, index)
        p = torch.softmax(torch.einsum("bshd,bthd->bhst", q, k2) * scale, dim=-1)
        return torch.einsum("bhst,bthd->bshd", p, v2), (q, k2, v2, p, index, k.shape[2], scale)

    def backward(self, state, dout):
        q, k2, v2, p, index, hkv, scale = state
        dv2 = torch.einsum("bhst,bshd->bthd", p, dout)
        dp = torch.einsum("bshd,bthd->bhst", dout, v2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq = torch.einsum("bhst,bthd->bshd", ds, k2)
        dk2 = torch.einsum("bhst,bshd->bthd", ds, q)
        fold = lambda g: g.new_zeros(*g.shape[:2], hkv, g.shape[3]).index_add_(2, index, g)  # noqa: E731
        return dq, fold(dk2), fold(dv2)


def test_world_size_1_backend_object_with_its_own_backward():
    # Backends that are not AttentionBackend subclasses run inside an autograd function
    # whose forward and backward dynamo traces (they must be traceable themselves).
    q, k, v, do = _inputs(4, 2, 2, 6, 8, seed=3)
    f = lambda q, k, v: uk.ulysses_attention(q, k, v, causal=False, attn_fn=_ExplicitBackend())  # noqa: E731
    graphs = {"fw": [], "bw": []}
    torch._dynamo.reset()
    out, grads = _run(torch.compile(f, fullgraph=True, backend=_recording_aot_eager(graphs)), (q, k, v), do)
    assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1
    assert "index_add" in graphs["bw"][0]  # the backend's own backward, traced
    want_out, want_grads = _run(f, (q, k, v), do)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    attention_reference(*full, causal=False).backward(do)
    for got, want, x in zip(grads, want_grads, full):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got, x.grad, rtol=1e-10, atol=1e-10)


class _ExplicitAttentionBackend(_ExplicitBackend, AttentionBackend):
    """``_ExplicitBackend`` as an ``AttentionBackend`` subclass: ``for_rank`` wraps it in
    ``SharedKV`` on shared-KV ranks, whose backward (``KVGradSum``) must then trace."""


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
@pytest.mark.usefixtures("one_thread")
def test_world_size_1_shared_kv_around_a_backend_with_its_own_backward(dtype):
    q, k, v, do = _inputs(4, 1, 2, 6, 8, seed=4, dtype=dtype)
    f = lambda q, k, v: uk.ulysses_attention(q, k, v, causal=False, attn_fn=_ExplicitAttentionBackend())  # noqa: E731
    graphs = {"fw": [], "bw": []}
    torch._dynamo.reset()
    out, grads = _run(torch.compile(f, fullgraph=True, backend=_recording_aot_eager(graphs)), (q, k, v), do)
    assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1
    want_out, want_grads = _run(f, (q, k, v), do)
    _assert_equal(out, want_out, "out")
    for name, got, want in zip("qkv", grads, want_grads):
        _assert_equal(got, want, f"d{name}")


def test_errors_raise_while_tracing():
    # Rank-local checks run at trace time; the Triton kernel set, which cannot trace, says so.
    q, k, v, _ = _inputs(6, 4, 1, 8, 8, seed=1)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: uk.ulysses_attention(q, k, v), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=traced_error("must be a multiple of kv_heads")):
        f(q, k, v)
    q, k, v, _ = _inputs(4, 2, 1, 8, 8, seed=1)
    g = torch.compile(lambda q, k, v: uk.ulysses_attention(q, k, v, kernels="triton"), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=traced_error("kernels='triton' does not trace")):
        g(q, k, v)


# ---- world size 2, gloo ranks ---------------------------------------------------------------
# (q_heads, kv_heads, batch, seq_lens, causal, kernels, mode, dtype):
#   batch 1, equal shards, the module: one all_to_all per exchange, received in place;
#   3 query heads / 1 KV head: the KV head lives on both ranks (its gradient is summed
#   over the replicas), batch 2 (the receive buffer is reordered), uneven shards; rank 0's
#   two query heads share that head (SharedKV), rank 1 has one query head.
#   "lower": the public seq_to_head / head_to_seq around the caller's own SDPA.
#   4/1 (MQA, both ranks hold the KV head) and 4/2 (one KV head per rank): every rank runs
#   SharedKV, in float64 and bfloat16.
F64, BF16 = torch.float64, torch.bfloat16
WORLD_2_CASES = [
    (4, 4, 1, [4, 4], True, "torch", "module", F64),
    (3, 1, 2, [2, 3], True, "cuda", "function", F64),
    (4, 4, 1, [3, 5], True, "torch", "lower", F64),
    (4, 1, 1, [5, 4], True, "torch", "function", F64),
    (4, 1, 2, [3, 3], False, "torch", "module", BF16),
    (4, 2, 1, [4, 3], True, "torch", "function", BF16),
]


def _lower_level(plan, seq_lens, causal):
    """Attention built by the caller from the public exchanges (MHA plans: no KV mapping)."""

    def f(q, k, v):
        ql, kl, vl = uk.seq_to_head(q, k, v, seq_lens=seq_lens, plan=plan)
        out = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (ql, kl, vl)), is_causal=causal)
        return uk.head_to_seq(out.transpose(1, 2), plan, seq_lens=seq_lens)

    return f


def _compiled_equals_eager(f, mine, my_do, case: str):
    """``f`` compiled (fullgraph, recorded aot_eager) and run forward and backward on this rank's
    shards: one forward and one backward graph, each with its two all_to_alls (q/k/v to heads
    and out back; dout to heads and dq/dk/dv back), and out and the gradients equal to eager
    bit for bit. Returns ``(out, grads, graphs)``."""
    graphs = {"fw": [], "bw": []}
    torch._dynamo.reset()
    out, grads = _run(torch.compile(f, fullgraph=True, backend=_recording_aot_eager(graphs)), mine, my_do)
    assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1, case
    for kind in ("fw", "bw"):
        n = graphs[kind][0].count("_c10d_functional.all_to_all_single")
        assert n == 2, f"{case}: {n} all_to_all_single in the {kind} graph, expected 2"
    want_out, want_grads = _run(f, mine, my_do)
    _assert_equal(out, want_out, f"{case} out")
    for name, got, want in zip("qkv", grads, want_grads):
        _assert_equal(got, want, f"{case} d{name}")
    return out, grads, graphs


def _world_2(rank, world, cases):
    torch.set_num_threads(1)  # run_ranks does; bit-identity on the CPU needs it
    for hq, hkv, B, seq_lens, causal, kernels, mode, dtype in cases:
        if kernels not in uk.kernels.available_kernels():
            kernels = "torch"
        q, k, v, do = _inputs(hq, hkv, B, sum(seq_lens), 8, seed=hq * 10 + hkv + B, dtype=dtype)
        full = [x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v)]
        ref = attention_reference(*full, causal=causal)
        ref.backward(do.double())
        mine = [contiguous_shard(x, seq_lens, rank) for x in (q, k, v)]
        my_do = contiguous_shard(do, seq_lens, rank)
        if mode == "module":
            f = uk.UlyssesAttention(hq, hkv, causal=causal, attn_fn="sdpa", kernels=kernels)
        elif mode == "lower":
            f = _lower_level(uk.HeadPlan.build(hq, hkv, world), seq_lens, causal)
        else:

            def f(q, k, v, causal=causal, seq_lens=seq_lens, kernels=kernels):
                return uk.ulysses_attention(q, k, v, causal=causal, seq_lens=seq_lens, attn_fn="sdpa", kernels=kernels)

        case = f"rank {rank}, case {(hq, hkv, B, seq_lens, dtype)}"
        out, grads, _ = _compiled_equals_eager(f, mine, my_do, case)
        tol = REF_TOL[dtype]
        for name, got, x in zip("qkv", grads, full):
            what = f"{case} d{name} vs reference"
            torch.testing.assert_close(got.double(), contiguous_shard(x.grad, seq_lens, rank), rtol=tol, atol=tol, msg=lambda s, what=what: f"{what}: {s}")
        torch.testing.assert_close(out.double(), contiguous_shard(ref, seq_lens, rank).detach(), rtol=tol, atol=tol)


def test_world_size_2_forward_and_backward_trace():
    # ~25 s on two CPU cores. The deadline (timeout_s + 30 s) stays under the GPU runbook's
    # per-test timeout (240 s), so a hang is reported by run_ranks (see test_nccl_comm).
    run_ranks(_world_2, 2, WORLD_2_CASES, timeout_s=180)


# FP8 on the wire inside the graph (wire_dtype="fp8": e4m3 forward, e5m2 backward): the traced
# movers quantize in the pack, move bytes in the same one all_to_all per exchange and dequantize
# in the unpack, as eager does. (q_heads, kv_heads, batch, seq_lens, kernels, dtype): batch 1;
# a KV head on both ranks (its gradient summed over the replicas, dequantized) at batch 2.
WORLD_2_FP8_CASES = [
    (4, 2, 1, [4, 3], "torch", BF16),
    (3, 1, 2, [2, 3], "cuda", torch.float32),
]


def _world_2_fp8(rank, world, cases):
    torch.set_num_threads(1)
    for hq, hkv, B, seq_lens, kernels, dtype in cases:
        if kernels not in uk.kernels.available_kernels():
            kernels = "torch"
        q, k, v, do = _inputs(hq, hkv, B, sum(seq_lens), 8, seed=hq * 10 + hkv + B, dtype=dtype)
        mine = [contiguous_shard(x, seq_lens, rank) for x in (q, k, v)]
        my_do = contiguous_shard(do, seq_lens, rank)

        def f(q, k, v, seq_lens=seq_lens, kernels=kernels, wire_dtype="fp8"):
            return uk.ulysses_attention(q, k, v, causal=True, seq_lens=seq_lens, attn_fn="sdpa", kernels=kernels, wire_dtype=wire_dtype)

        case = f"rank {rank}, FP8 case {(hq, hkv, B, seq_lens, kernels, dtype)}"
        out, _, graphs = _compiled_equals_eager(f, mine, my_do, case)
        for kind in ("fw", "bw"):
            assert "torch.uint8" in graphs[kind][0], f"{case}: no byte buffer in the {kind} graph"
        # ... and it is FP8 that crossed: the op without the wire differs.
        plain_out, _ = _run(lambda q, k, v: f(q, k, v, wire_dtype=None), mine, my_do)
        assert not torch.equal(out, plain_out), case
        torch.testing.assert_close(out, plain_out, rtol=0.25, atol=0.25)


def test_world_size_2_fp8_wire_traces_and_equals_eager():
    run_ranks(_world_2_fp8, 2, WORLD_2_FP8_CASES, timeout_s=180)


# ---- on a GPU: the inductor backend, bf16 ----------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernels", KERNELS)
def test_gpu_world_size_1_inductor(kernels):
    """World size 1 on CUDA, compiled by inductor (not just aot_eager), bf16 GQA 8/2: the
    compiled op's error against float64 attention is at most 2x the eager op's (+1 ulp)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 256, h, 64, device="cuda", generator=g, dtype=torch.bfloat16) for h in (8, 2, 2, 8))

    def f(q, k, v):
        return uk.ulysses_attention(q, k, v, attn_fn="sdpa", kernels=kernels)

    torch._dynamo.reset()
    got_out, got_grads = _run(torch.compile(f, fullgraph=True, backend="inductor"), (q, k, v), do)
    eager_out, eager_grads = _run(f, (q, k, v), do)
    full = [x.double().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*full, causal=True)
    ref.backward(do.double())
    for name, got, eager, want in zip(("out", "dq", "dk", "dv"), [got_out, *got_grads], [eager_out, *eager_grads], [ref, *(x.grad for x in full)]):
        err = (got.double() - want).abs().max().item()
        eager_err = (eager.double() - want).abs().max().item()
        ulp = 2.0**-7 * want.abs().max().item()
        assert err <= 2 * eager_err + ulp, f"{name}: compiled error {err:.3g} > 2x eager error {eager_err:.3g} + 1 ulp"


def test_constant_in_traces_marks_what_torchs_decorator_marks():
    """kernels._constant_in_traces stands for torch.compiler.assume_constant_result without
    importing dynamo: it must set exactly what torch's decorator sets on a function."""
    from ulysses_kernels import kernels

    def plain():
        return 0

    def ours():
        return 0

    torch.compiler.assume_constant_result(plain)
    kernels._constant_in_traces(ours)
    assert vars(plain) == vars(ours) == {"_dynamo_marked_constant": True}
    assert vars(kernels._load) == vars(kernels._device_reason) == {"_dynamo_marked_constant": True}
