"""Packed-documents kernels (``ulysses_kernels.packed``) and their chooser (``backends.packed_kernel``).

On the CPU: the row intervals and the block sparsity FlexAttention's mask is built from
against the dense mask; FlexAttention itself (torch runs it eagerly there, forward only, so
its backward is a GPU test) and the per-document loop (forward and backward) in float64
against an explicit per-document reference, causal and not, grouped heads, windows, softcap,
odd lengths, many documents, a document of one token; the ring steps on FlexAttention; the
chooser's picks and refusals; the GPU-only varlen kernel's calls, with torch's
``varlen_attn`` replaced by a fake that records its arguments (per torch version's signature)
and computes the reference, through the op on thread ranks; the GPU-only cudnn kernel's
calls with cuDNN's ops faked the same way, and no host work per call on its path. On a GPU: every kernel that
runs there in bf16 within 2x PyTorch's own error against float64, forward and backward.
"""

from __future__ import annotations

import itertools
import math
import random
import types

import pytest
import torch

import ulysses_kernels as uk
from ulysses_kernels import backends, block_masks, packed
from ulysses_kernels.backends import SDPABackend, packed_kernel
from ulysses_kernels.documents import Documents, documents
from ulysses_kernels.packed import KERNELS, DocMask, doc_intervals
from ulysses_kernels.ring import RingBackend, shard_rows
from ulysses_kernels.ring.schedule import ring_schedule
from ulysses_kernels.ring.varlen import attend_lse_pieces
from ulysses_kernels.testing import ThreadGroup
from ulysses_kernels.testing.reference import packed_attention_reference

MASKS = [DocMask(True), DocMask(False), DocMask(True, 5), DocMask(True, None, 3.0), DocMask(True, 40, 1.5)]
MASK_IDS = ["causal", "bidirectional", "window5", "softcap3", "window40-softcap1.5"]


def lengths_cu(lengths) -> tuple[int, ...]:
    return (0, *itertools.accumulate(lengths))


def mixed_cu(total: int, seed: int) -> tuple[int, ...]:
    """Odd lengths, a one-token document first, a long one, many short ones."""
    rng = random.Random(seed)
    lens = [1, 129]
    while sum(lens) < total:
        lens.append(min(rng.choice([1, 2, 3, rng.randint(4, 60), rng.randint(60, 200)]), total - sum(lens)))
    return lengths_cu(lens)


def explicit_mask(lq: int, lk: int, mask: DocMask) -> torch.Tensor:
    """One document pair's visible keys, written out: bottom-right causal, a window of ``w``
    (itself and the ``w - 1`` keys before)."""
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if mask.causal:
        keep &= j <= i
    if mask.window is not None:
        keep &= j > i - mask.window
    return keep


def reference(q, k, v, cu_q, cu_k, mask: DocMask, scale: float):
    """float64 per-document attention with the log-sum-exp: ``(out [1, Tq, hq, Dv], lse [1, hq, Tq])``;
    a row that sees no key (more queries than keys, causal) gets 0 and ``-inf``."""
    outs, lses = [], []
    g = q.shape[2] // k.shape[2]
    for (a, b), (c, d) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k)):
        qd = q[0, a:b].double()
        kd, vd = (x[0, c:d].double().repeat_interleave(g, dim=1) for x in (k, v))
        s = torch.einsum("shd,thd->hst", qd, kd) * scale
        if mask.softcap is not None:
            s = mask.softcap * torch.tanh(s / mask.softcap)
        s = s.masked_fill(~explicit_mask(b - a, d - c, mask), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        outs.append(torch.einsum("hst,thd->shd", p, vd))
        lses.append(lse)
    return torch.cat(outs)[None], torch.cat(lses, dim=1)[None]


def dense_mask(cu_q, cu_k, mask: DocMask) -> torch.Tensor:
    m = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for (a, b), (c, d) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k)):
        m[a:b, c:d] = explicit_mask(b - a, d - c, mask)
    return m


def inputs(T, hq, hkv, d=16, dv=None, seed=0, dtype=torch.float64, tk=None):
    g = torch.Generator().manual_seed(seed)
    tk = T if tk is None else tk
    return [torch.randn(1, n, h, w, generator=g, dtype=dtype) for n, h, w in ((T, hq, d), (tk, hkv, d), (tk, hkv, dv or d))]


# ---- the mask FlexAttention is built from ------------------------------------------------------
RECTANGLES = [  # (query lengths, key lengths): a packed sequence, and a ring step's rectangles
    ((1, 129, 3, 200, 7), None),
    ((5, 9, 1), (9, 5, 1)),
    ((64, 3), (200, 3)),
]


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("lq,lk", RECTANGLES)
def test_intervals_are_the_document_mask(mask, lq, lk):
    cu_q, cu_k = lengths_cu(lq), lengths_cu(lk or lq)
    lo, hi = doc_intervals(Documents(cu_q, max(lq)), Documents(cu_k, max(lk or lq)), mask)
    c = torch.arange(cu_k[-1])[None, :]
    assert torch.equal((c >= lo[:, None].long()) & (c <= hi[:, None].long()), dense_mask(cu_q, cu_k, mask))


@pytest.mark.parametrize("mask", MASKS[:3], ids=MASK_IDS[:3])
@pytest.mark.parametrize("block", [128, 16, 7, 1])
def test_block_sparsity_is_the_dense_mask_reduced(mask, block):
    """Partial and full blocks from the intervals equal the dense mask's blocks with some and
    with every (row, key) visible (CPU FlexAttention ignores the block structure, so this is
    the check of what the GPU kernel skips). A padded last query block is never full."""
    for lq, lk in RECTANGLES + [((300, 1, 299), None)]:
        cu_q, cu_k = lengths_cu(lq), lengths_cu(lk or lq)
        tq, tk = cu_q[-1], cu_k[-1]
        lo, hi = doc_intervals(Documents(cu_q, 0), Documents(cu_k, 0), mask)
        partial, full = block_masks._block_sparsity(lo, hi, tk, block)
        nq, nk = -(-tq // block), -(-tk // block)
        m = torch.zeros(nq * block, nk * block, dtype=torch.bool)
        m[:tq, :tk] = dense_mask(cu_q, cu_k, mask)
        inside = torch.zeros_like(m)
        inside[:tq, :tk] = True
        some = m.view(nq, block, nk, block).any(3).any(1)
        every = (m | ~inside).view(nq, block, nk, block).all(3).all(1) & some
        if tq % block:
            every[-1] = False
        assert torch.equal(full, every) and torch.equal(partial, some & ~every), (lq, lk)


def test_block_mask_is_cached_per_boundaries_and_mask():
    docs = documents([0, 3, 130, 131])
    a = block_masks.doc_block_mask(docs, docs, torch.device("cpu"), DocMask(True))
    assert block_masks.doc_block_mask(docs, docs, torch.device("cpu"), DocMask(True, None, 2.0)) is a  # softcap: a score_mod
    assert block_masks.doc_block_mask(docs, docs, torch.device("cpu"), DocMask(True, 4)) is not a
    assert block_masks.doc_block_mask(docs, docs, torch.device("cpu"), DocMask(False)) is not a


# ---- FlexAttention and the loop, float64 on the CPU -------------------------------------------------
@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("hq,hkv,dv", [(6, 2, 16), (4, 4, 16), (3, 1, 8)])
def test_flex_forward_exact_on_cpu(mask, hq, hkv, dv):
    cu = mixed_cu(700, seed=hq)
    q, k, v = inputs(cu[-1], hq, hkv, dv=dv, seed=hq * 7 + hkv)
    docs = documents(cu)
    out, lse = KERNELS["flex"].attend(q, k, v, docs, docs, mask, 0.3, lse=True)
    want, want_lse = reference(q, k, v, cu, cu, mask, 0.3)
    assert out.shape == want.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(KERNELS["flex"].attend(q, k, v, docs, docs, mask, 0.3), want, rtol=1e-10, atol=1e-10)


def test_flex_many_documents_and_ring_rectangles():
    """97 documents of 1 to 9 tokens; then rectangles with fewer keys than queries and more."""
    cu = lengths_cu([1 + (i * 7) % 9 for i in range(97)])
    q, k, v = inputs(cu[-1], 4, 2)
    out = KERNELS["flex"].attend(q, k, v, documents(cu), documents(cu), DocMask(True), 0.25)
    torch.testing.assert_close(out, reference(q, k, v, cu, cu, DocMask(True), 0.25)[0], rtol=1e-10, atol=1e-10)
    cq, ck = lengths_cu((5, 9, 1)), lengths_cu((9, 5, 1))
    q, k, v = inputs(15, 4, 2, tk=15)
    for mask in (DocMask(True), DocMask(False)):
        got, lse = KERNELS["flex"].attend(q, k, v, Documents(cq, 9), Documents(ck, 9), mask, 0.25, lse=True)
        want, want_lse = reference(q, k, v, cq, ck, mask, 0.25)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_loop_forward_backward_exact(mask):
    cu = mixed_cu(400, seed=3)
    q, k, v = (x.requires_grad_() for x in inputs(cu[-1], 6, 2, dv=8, seed=1))
    dout = torch.randn(1, cu[-1], 6, 8, dtype=torch.float64)
    docs = documents(cu)
    out = KERNELS["loop"].attend(q, k, v, docs, docs, mask, 0.3)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want_out = reference(q, k, v, cu, cu, mask, 0.3)[0]
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_window_and_softcap_are_checked():
    with pytest.raises(ValueError, match=r"window=4 with causal=False; a sliding window is supported on causal attention only"):
        DocMask(False, 4)
    with pytest.raises(ValueError, match=r"softcap=0; expected a positive float"):
        DocMask(True, None, 0)


# ---- the chooser ----------------------------------------------------------------------------------
@pytest.fixture
def fresh_chooser():
    backends._packed_kernel.cache_clear()
    yield
    backends._packed_kernel.cache_clear()


def test_chooser_on_the_cpu(monkeypatch, fresh_chooser):
    cpu = torch.device("cpu")
    monkeypatch.delenv(backends.PACKED_ENV, raising=False)
    assert packed_kernel(cpu, torch.float32).name == "loop"  # FlexAttention is not picked on the CPU unasked
    assert packed_kernel(cpu, torch.float32, DocMask(True, 8, 2.0), candidates=tuple(KERNELS)).name == "loop"
    assert packed_kernel(cpu, torch.float32, grad=False, prefer="flex").name == "flex"
    with pytest.raises(ValueError, match=r"kernel 'flex' cannot run torch.float32 on cpu \(causal\): torch runs FlexAttention's backward on CUDA only"):
        packed_kernel(cpu, torch.float32, prefer="flex")
    with pytest.raises(ValueError, match=r"kernel 'varlen' cannot run torch.bfloat16 on cpu \(causal, window 4\): .*needs CUDA fp16/bf16"):
        packed_kernel(cpu, torch.bfloat16, DocMask(True, 4), prefer="varlen")
    with pytest.raises(
        ValueError, match=r"kernel 'fast' \(ULYSSES_KERNELS_PACKED or packed=\); expected one of \['cudnn', 'fa2', 'flash', 'flex', 'loop', 'varlen'\]"
    ):
        packed_kernel(cpu, torch.float32, prefer="fast")
    monkeypatch.setenv(backends.PACKED_ENV, "flex")
    assert packed_kernel(cpu, torch.float32, grad=False).name == "flex"
    monkeypatch.setenv(backends.PACKED_ENV, "auto")
    assert packed_kernel(cpu, torch.float32, grad=False).name == "loop"
    assert backends.MathBackend.packed_candidates == ("loop",)  # the exact reference stays explicit math


def test_chooser_order_on_a_gpu_faked(monkeypatch, fresh_chooser):
    """With every kernel said to run: flash-attn first for the flash backend, torch's varlen
    first for SDPA, FlexAttention where varlen cannot (a softcap), and the loop last."""
    cuda = torch.device("cuda")
    for name in ("flash", "varlen", "flex"):
        monkeypatch.setattr(type(KERNELS[name]), "why_not", lambda self, device, dtype, mask, grad, n=name: (
            "takes no softcap" if n == "varlen" and mask.softcap is not None else None))  # fmt: skip
    bf16 = torch.bfloat16
    assert packed_kernel(cuda, bf16, candidates=backends.FlashBackend.packed_candidates).name == "flash"
    assert packed_kernel(cuda, bf16, candidates=SDPABackend.packed_candidates).name == "varlen"
    assert packed_kernel(cuda, bf16, DocMask(True, None, 30.0), candidates=SDPABackend.packed_candidates).name == "flex"
    monkeypatch.setattr(type(KERNELS["flex"]), "why_not", lambda *a: "no triton")
    backends._packed_kernel.cache_clear()
    assert packed_kernel(cuda, bf16, DocMask(True, None, 30.0), candidates=SDPABackend.packed_candidates).name == "loop"


# ---- torch's varlen_attn, faked: what the kernel passes, per torch version ---------------------------------
class FakeAux:
    def __init__(self, lse=False):
        self.lse = lse


def fake_varlen(version: str, calls: list):
    """A stand-in for ``varlen_attn`` with ``version``'s parameters (2.10: ``is_causal``, no
    ``scale``; 2.11: ``scale`` and ``window_size``; 2.12+: also ``enable_gqa``) that records
    what it got and computes the reference (differentiably, as the real one is)."""

    def body(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw):
        calls.append({"q": query.shape, "k": key.shape, "cu_q": cu_seq_q, "cu_k": cu_seq_k, "max_q": max_q, "max_k": max_k, **kw})
        if query.shape[1] != key.shape[1] and not kw.get("enable_gqa"):
            raise ValueError("Expect query and key/value to have the same number of heads")
        window = kw.get("window_size", (-1, 0) if kw.get("is_causal") else (-1, -1))
        mask = DocMask(window[1] == 0, None if window[0] < 0 else window[0] + 1)
        scale = kw.get("scale") or 1 / math.sqrt(query.shape[-1])
        cq, ck = tuple(cu_seq_q.tolist()), tuple(cu_seq_k.tolist())
        out, lse = packed._math_lse(query[None], key[None], value[None], mask, scale) if len(cq) == 2 else _per_doc(query, key, value, cq, ck, mask, scale)
        out = out[0].to(query.dtype)
        return (out, lse[0]) if kw.get("return_aux") is not None and kw["return_aux"].lse else out

    def _per_doc(q, k, v, cq, ck, mask, scale):
        parts = [
            packed._math_lse(q[None, a:b], k[None, c:d], v[None, c:d], mask, scale) for (a, b), (c, d) in zip(itertools.pairwise(cq), itertools.pairwise(ck))
        ]
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=2)

    if version == "2.10":

        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return body(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=is_causal, return_aux=return_aux)
    elif version == "2.11":

        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
            return body(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux, scale=scale, window_size=window_size)
    else:

        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False):
            return body(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux, scale=scale, window_size=window_size,
                        enable_gqa=enable_gqa)  # fmt: skip

    import inspect

    return fn, FakeAux, frozenset(inspect.signature(fn).parameters)


@pytest.mark.parametrize("version", ["2.10", "2.11", "2.14"])
@pytest.mark.parametrize("mask", [DocMask(True), DocMask(False), DocMask(True, 6)], ids=["causal", "bidirectional", "window6"])
def test_varlen_calls_per_torch_version(monkeypatch, version, mask):
    if version == "2.10" and mask.window is not None:
        pytest.skip("2.10 takes no window (why_not refuses it: test_varlen_refuses_what_its_torch_cannot)")
    calls = []
    monkeypatch.setattr(packed, "_varlen_api", lambda: fake_varlen(version, calls))
    cu = mixed_cu(300, seed=5)
    q, k, v = (x.requires_grad_() for x in inputs(cu[-1], 6, 2, dv=8, seed=2))
    docs = documents(cu)
    out, lse = KERNELS["varlen"].attend(q, k, v, docs, docs, mask, 0.2, lse=True)
    (call,) = calls
    assert call["cu_q"].dtype == torch.int32 and tuple(call["cu_q"].tolist()) == cu and call["max_q"] == call["max_k"] == docs.max_seqlen
    assert call["q"][1] == 6 and call["k"][1] == (2 if version == "2.14" else 6)  # grouped natively, else expanded here
    assert call["q"][2] == call["k"][2] == 16  # MLA's narrower v padded to one head dim
    if version == "2.10":
        assert call["is_causal"] == mask.causal and "scale" not in call  # the scale folded into q
    else:
        assert call["scale"] == 0.2 and call["window_size"] == ((-1 if mask.window is None else mask.window - 1, 0) if mask.causal else (-1, -1))
    assert call.get("enable_gqa", False) == (version == "2.14")
    want, want_lse = reference(q, k, v, cu, cu, mask, 0.2)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", [DocMask(True), DocMask(False), DocMask(True, 6, 4.0)], ids=["causal", "bidirectional", "window6-softcap4"])
def test_flash_varlen_calls(monkeypatch, mask):
    """flash-attn's ``flash_attn_varlen_func``, faked: int32 boundaries, the longest document,
    the call's scale and causality, the window as ``(w - 1, 0)``, the softcap, grouped heads
    passed as they are (flash-attn groups them itself), and its LSE ``[hq, total]`` taken."""
    import sys
    import types

    calls = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               return_attn_probs=False):  # fmt: skip
        calls.append({"q": q.shape, "k": k.shape, "cu_q": cu_q, "max_q": max_q, "max_k": max_k, "scale": softmax_scale, "causal": causal,
                      "window_size": window_size, "softcap": softcap})  # fmt: skip
        m = DocMask(causal, None if window_size[0] < 0 else window_size[0] + 1, softcap or None)
        cq = tuple(cu_q.tolist())
        parts = [packed._math_lse(q[None, a:b], k[None, a:b], v[None, a:b], m, softmax_scale) for a, b in itertools.pairwise(cq)]
        out, lse = torch.cat([p[0] for p in parts], dim=1)[0], torch.cat([p[1] for p in parts], dim=2)[0]
        return (out, lse, None) if return_attn_probs else out

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    cu = mixed_cu(300, seed=6)
    q, k, v = (x.requires_grad_() for x in inputs(cu[-1], 6, 2, seed=3))
    docs = documents(cu)
    out, lse = KERNELS["flash"].attend(q, k, v, docs, docs, mask, 0.2, lse=True)
    (call,) = calls
    assert call["cu_q"].dtype == torch.int32 and tuple(call["cu_q"].tolist()) == cu and call["max_q"] == call["max_k"] == docs.max_seqlen
    assert call["q"][1] == 6 and call["k"][1] == 2 and call["scale"] == 0.2 and call["causal"] == mask.causal
    assert call["window_size"] == ((-1, -1) if mask.window is None else (mask.window - 1, 0)) and call["softcap"] == (mask.softcap or 0.0)
    want, want_lse = reference(q, k, v, cu, cu, mask, 0.2)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)


def test_varlen_refuses_what_its_torch_cannot(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(packed, "_varlen_api", lambda: fake_varlen("2.10", []))
    assert KERNELS["varlen"].why_not(cuda, bf16, DocMask(True), True) is None
    assert "takes no sliding window in torch" in KERNELS["varlen"].why_not(cuda, bf16, DocMask(True, 4), True)
    assert KERNELS["varlen"].why_not(cuda, bf16, DocMask(True, None, 5.0), True) == "takes no softcap"
    monkeypatch.setattr(packed, "_varlen_api", lambda: fake_varlen("2.11", []))
    assert KERNELS["varlen"].why_not(cuda, bf16, DocMask(True, 4), True) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert KERNELS["varlen"].why_not(cuda, bf16, DocMask(True), True) == "needs sm_80 or newer, got sm_75"
    monkeypatch.setattr(packed, "_varlen_api", lambda: None)
    assert "has no torch.nn.attention.varlen.varlen_attn" in KERNELS["varlen"].why_not(cuda, bf16, DocMask(True), True)


def _op_rank(comm, cu, hq, hkv, L):
    torch.set_num_threads(1)
    q, k, v, dout = _global(cu[-1], hq, hkv)
    rows = slice(comm.rank * L, (comm.rank + 1) * L)
    leaves = [x[:, rows].detach().clone().requires_grad_() for x in (q, k, v)]
    with torch.autograd.set_multithreading_enabled(False):
        out = uk.ulysses_attention(*leaves, causal=True, attn_fn="sdpa", comm=comm, kernels="torch", softmax_scale=0.3, cu_seqlens=cu)
        out.backward(dout[:, rows])
    return out.detach(), [x.grad for x in leaves]


def _global(T, hq, hkv):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(1, T, h, 8, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


@pytest.mark.parametrize("hkv", [4, 2])
def test_op_runs_packed_documents_on_the_chosen_kernel(monkeypatch, fresh_chooser, hkv):
    """The op on 2 thread ranks with torch's varlen said to run here (a 2.11 signature: no
    ``enable_gqa``): each rank's call carries its own heads only (4 of 8 query heads; its 2 KV
    heads expanded to 4 on the rank, or its one KV head's ``SharedKV`` view materialized),
    int32 boundaries and the call's scale, and the result is the float64 reference, forward
    and backward."""
    calls = []
    monkeypatch.setattr(packed, "_varlen_api", lambda: fake_varlen("2.11", calls))
    monkeypatch.setattr(packed.TorchVarlen, "why_not", lambda *a: None)
    hq, L = 8, 23
    cu = [0, 1, 10, 30, 31, 46]
    results = ThreadGroup(2, timeout=60).run(_op_rank, cu, hq, hkv, L)
    assert len(calls) == 2 and all(c["q"][1] == 4 and c["k"][1] == 4 and c["q"][0] == 2 * L for c in calls), calls
    assert all(c["cu_q"].dtype == torch.int32 and c["scale"] == 0.3 and c["window_size"] == (-1, 0) for c in calls)
    full = [x.clone().requires_grad_() for x in _global(2 * L, hq, hkv)[:3]]
    ref = packed_attention_reference(*full, cu, causal=True, softmax_scale=0.3)
    ref.backward(_global(2 * L, hq, hkv)[3])
    for r, (out, grads) in enumerate(results):
        rows = slice(r * L, (r + 1) * L)
        torch.testing.assert_close(out, ref[:, rows], rtol=1e-10, atol=1e-10)
        for got, f in zip(grads, full):
            torch.testing.assert_close(got, f.grad[:, rows], rtol=1e-10, atol=1e-10)


# ---- cuDNN's ragged attention, its aten ops faked: what the kernel passes, and no host work per call ------------
def docs_math(q, k, v, cu_q, cu_k, causal, scale):
    """``(out [Tq, h, D], lse [h, Tq])`` per document of ``[T, h, D]`` tensors, explicit math."""
    cq, ck = tuple(cu_q.tolist()), tuple(cu_k.tolist())
    parts = [packed._math_lse(q[None, a:b], k[None, c:d], v[None, c:d], DocMask(causal), scale)
             for (a, b), (c, d) in zip(itertools.pairwise(cq), itertools.pairwise(ck))]  # fmt: skip
    return torch.cat([p[0] for p in parts], dim=1)[0], torch.cat([p[1] for p in parts], dim=2)[0]


def fake_cudnn(calls: list):
    """Stand-ins for ``aten._cudnn_attention_forward``/``_backward`` (keyword calls, torch
    2.14's argument names) that record what they got and compute the float64 reference per
    document, returning the statistics as cuDNN does (``[Tq, h, 1]``)."""

    def fwd(*, query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, compute_log_sumexp, dropout_p, is_causal, return_debug_mask,
            scale):  # fmt: skip
        calls.append({"op": "fwd", "q": query, "k": key, "v": value, "cu_q": cum_seq_q, "cu_k": cum_seq_k, "max_q": max_q, "max_k": max_k,
                      "stats": compute_log_sumexp, "causal": is_causal, "scale": scale, "bias": attn_bias, "dropout": dropout_p})  # fmt: skip
        assert query.shape[1] == key.shape[1] == value.shape[1], "cuDNN's ragged path gets as many KV heads as query heads"
        assert all(x.is_contiguous() for x in (query, key, value))
        out, lse = docs_math(query, key, value, cum_seq_q, cum_seq_k, is_causal, scale)
        seed, offset = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        stats = lse.t()[..., None].to(torch.float64 if query.dtype == torch.float64 else torch.float32)  # float32 on a GPU
        return out.to(query.dtype), stats, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset, torch.empty(0)

    def bwd(*, grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
            is_causal, scale):  # fmt: skip
        calls.append({"op": "bwd", "cu_q": cum_seq_q, "cu_k": cum_seq_k, "dout": grad_out, "lse": logsumexp, "seed": philox_seed})
        leaves = [x.detach().requires_grad_() for x in (query, key, value)]
        with torch.enable_grad():
            o, _ = docs_math(*leaves, cum_seq_q, cum_seq_k, is_causal, scale)
            return torch.autograd.grad(o, leaves, grad_out)

    return fwd, bwd


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("hq,hkv,dv", [(6, 2, 16), (4, 1, 8), (4, 4, 16)], ids=["gqa", "one-kv-mla", "mha"])
def test_cudnn_calls_and_exact(monkeypatch, causal, hq, hkv, dv):
    """The cudnn kernel with cuDNN's ops faked: int32 device boundaries, the longest document,
    the call's scale and causality, no bias and no dropout, KV expanded to the query heads
    (gradients summed back), MLA's narrower v padded, the statistics taken from cuDNN's
    ``[Tq, h, 1]``, and the backward given the forward's own output, statistics and seed;
    the result the float64 reference, forward, LSE and backward."""
    calls = []
    monkeypatch.setattr(packed, "_cudnn_ops", lambda: fake_cudnn(calls))
    cu = mixed_cu(300, seed=7)
    q, k, v = (x.requires_grad_() for x in inputs(cu[-1], hq, hkv, dv=dv, seed=5))
    docs = documents(cu)
    mask = DocMask(causal)
    out, lse = KERNELS["cudnn"].attend(q, k, v, docs, docs, mask, 0.2, lse=True)
    (f,) = calls
    assert f["cu_q"].dtype == torch.int32 and tuple(f["cu_q"].tolist()) == cu and f["cu_k"] is f["cu_q"]
    assert f["max_q"] == f["max_k"] == docs.max_seqlen and f["causal"] == causal and f["scale"] == 0.2
    assert f["bias"] is None and f["dropout"] == 0.0 and f["stats"] is True
    assert f["k"].shape[1] == hq and f["q"].shape[2] == f["v"].shape[2] == 16
    want, want_lse = reference(q, k, v, cu, cu, mask, 0.2)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    b = calls[-1]
    assert b["op"] == "bwd" and b["cu_q"] is f["cu_q"] and b["seed"] is not None and b["dout"].is_contiguous()
    for a, w in zip(got, torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernel", ["cudnn", "varlen"])
def test_packed_path_does_no_host_work_per_call(monkeypatch, fresh_chooser, kernel):
    """Through the backend as a layer runs it (forward, then backward), twice after a warm-up
    call, on the cudnn kernel (cuDNN's ops faked) and on the varlen kernel (torch 2.11's
    ``varlen_attn`` faked): no device-to-host read (``item``, ``tolist``, ``cpu``, a tensor's
    ``int``/``float``/``bool``) and no host-to-device copy of the boundaries (``torch.tensor``)
    outside the kernel itself, and every call hands the kernel the one cached boundaries tensor
    (``Documents.on``)."""
    calls = []
    inside = [0]

    def quiet(op):
        def run(*a, **kw):
            inside[0] += 1
            try:
                return op(*a, **kw)
            finally:
                inside[0] -= 1

        return run

    if kernel == "cudnn":
        fwd, bwd = fake_cudnn(calls)
        monkeypatch.setattr(packed, "_cudnn_ops", lambda: (quiet(fwd), quiet(bwd)))
        monkeypatch.setattr(packed.CudnnRagged, "why_not", lambda *a: None)
    else:
        fn, aux, params = fake_varlen("2.11", calls)
        monkeypatch.setattr(packed, "_varlen_api", lambda: (quiet(fn), aux, params))
        monkeypatch.setattr(packed.TorchVarlen, "why_not", lambda *a: None)
    host = []

    def counted(owner, name):
        real = getattr(owner, name)

        def wrapper(*a, **kw):
            if not inside[0]:
                host.append(name)
            return real(*a, **kw)

        monkeypatch.setattr(owner, name, wrapper)

    cu = mixed_cu(400, seed=8)
    docs = documents(cu)
    backend = SDPABackend(packed=kernel)
    q, k, v = inputs(cu[-1], 6, 2, seed=6)
    dout = torch.randn(1, cu[-1], 6, 16, dtype=torch.float64)

    def layer():
        out, state = backend.forward(q, k, v, causal=True, scale=0.25, kv_map=[0, 0, 0, 1, 1, 1], needs_grad=True, docs=docs)
        return out, backend.backward(state, dout)

    first = layer()  # the warm-up: builds the cached device boundaries once
    for name in ("item", "tolist", "cpu", "__int__", "__float__", "__bool__"):
        counted(torch.Tensor, name)
    counted(torch, "tensor")
    calls.clear()
    runs = [layer() for _ in range(2)]
    assert host == [], f"host work per call on the {kernel} path: {host}"
    for out, grads in runs:
        torch.testing.assert_close(out, first[0], rtol=0, atol=0)
        for a, b in zip(grads, first[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [c.get("op", "fwd") for c in calls] == (["fwd", "bwd", "fwd", "bwd"] if kernel == "cudnn" else ["fwd", "fwd"])
    assert all(c["cu_q"] is docs.on(q.device) and c["cu_k"] is docs.on(q.device) for c in calls)


def test_cudnn_refuses_what_it_cannot(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(packed, "_cudnn_ops", lambda: fake_cudnn([]))
    cuda, bf16, kern = torch.device("cuda"), torch.bfloat16, KERNELS["cudnn"]
    assert kern.why_not(cuda, bf16, DocMask(True), True) is None and kern.why_not(cuda, bf16, DocMask(False), True) is None
    assert kern.why_not(cuda, bf16, DocMask(True, 4), True) == "takes no sliding window"
    assert kern.why_not(cuda, bf16, DocMask(True, None, 5.0), True) == "takes no softcap"
    assert kern.why_not(cuda, torch.float32, DocMask(True), True) == "needs CUDA fp16/bf16, got cuda torch.float32"
    assert "needs CUDA fp16/bf16, got cpu" in kern.why_not(torch.device("cpu"), bf16, DocMask(True), True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert kern.why_not(cuda, bf16, DocMask(True), True) == "needs sm_80 or newer, got sm_75"
    monkeypatch.setattr(packed, "_cudnn_ops", lambda: "torch 2.9 has no aten._cudnn_attention_forward/_cudnn_attention_backward")
    assert kern.why_not(cuda, bf16, DocMask(True), True) == "torch 2.9 has no aten._cudnn_attention_forward/_cudnn_attention_backward"
    # A ring step's rectangles (query and key documents differ) are refused under a causal mask.
    q, k, v = inputs(14, 2, 2, seed=1)
    with pytest.raises(ValueError, match=r"kernel 'cudnn' runs causal documents whose query and key boundaries are equal"):
        kern.attend(q, k, v, documents([0, 5, 9, 14]), documents([0, 9, 12, 14]), DocMask(True), 0.3)
    with pytest.raises(ValueError, match=r"kernel 'cudnn' takes head dims that are multiples of 8 up to 128, got 12"):
        kern.attend(*inputs(14, 2, 2, d=12, seed=1), documents([0, 5, 14]), documents([0, 5, 14]), DocMask(False), 0.3)


@pytest.mark.parametrize("version,want", [("2.11.0+cu130", "flash"), ("2.12.1", "flash"), ("2.13.0", "cudnn"), ("2.14.1+cu130", "cudnn")])
def test_cudnn_backward_per_torch_version(monkeypatch, version, want):
    monkeypatch.setattr(torch, "__version__", version)
    assert packed.cudnn_backward() == want


def test_cudnn_forward_with_flash_backward(monkeypatch):
    """Before torch 2.13 the backward is FA2's varlen backward, given cuDNN's output and its
    statistics as FA2's ``[h, Tq]`` (contiguous), the boundaries, the longest documents, the
    causality and the scale, positionally as torch's own varlen_attn calls it; the gradients
    are the float64 reference's (FA2 faked)."""
    calls = []
    fwd, _ = fake_cudnn(calls)

    def fake_fa(grad_out, query, key, value, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused, *, scale):
        calls.append({"op": "fa", "lse": lse, "cu_q": cu_q, "max_q": max_q, "max_k": max_k, "dropout": dropout_p, "causal": is_causal,
                      "rng": rng, "unused": unused, "scale": scale, "out": out})  # fmt: skip
        leaves = [x.detach().requires_grad_() for x in (query, key, value)]
        with torch.enable_grad():
            o, _ = docs_math(*leaves, cu_q, cu_k, is_causal, scale)
            return torch.autograd.grad(o, leaves, grad_out)

    monkeypatch.setattr(packed, "_cudnn_ops", lambda: (fwd, packed._flash_backward(fake_fa)))
    cu = mixed_cu(200, seed=9)
    docs = documents(cu)
    q, k, v = (x.requires_grad_() for x in inputs(cu[-1], 4, 1, seed=8))
    out = KERNELS["cudnn"].attend(q, k, v, docs, docs, DocMask(True), 0.3)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    f, b = calls
    want_lse = docs_math(q[0].detach(), k[0].detach().repeat_interleave(4, 1), v[0].detach().repeat_interleave(4, 1), f["cu_q"], f["cu_k"], True, 0.3)[1]
    assert b["op"] == "fa" and b["lse"].shape == (4, cu[-1]) and b["lse"].is_contiguous()
    torch.testing.assert_close(b["lse"], want_lse, rtol=1e-10, atol=1e-10)
    assert b["cu_q"] is f["cu_q"] and b["max_q"] == b["max_k"] == docs.max_seqlen and b["causal"] is True and b["scale"] == 0.3
    assert b["dropout"] == 0.0 and b["rng"].dtype == torch.uint64 and b["out"].shape == (cu[-1], 4, 16)
    want = reference(q, k, v, cu, cu, DocMask(True), 0.3)[0]
    for a, w in zip(got, torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)


def test_cudnn_ops_on_flash_backward_schema(monkeypatch):
    """Before torch 2.13 ``_cudnn_ops`` hands out FA2's backward behind cuDNN's keywords, once
    this torch's ``_flash_attention_backward`` has the positions it is called with."""
    monkeypatch.setattr(packed, "cudnn_backward", lambda: "flash")
    packed._cudnn_ops.cache_clear()
    try:
        ops = packed._cudnn_ops()
        if isinstance(ops, str) and "has no aten._cudnn_attention_forward" in ops:
            pytest.skip(ops)
        assert not isinstance(ops, str), ops
        assert ops[1] is not torch.ops.aten._cudnn_attention_backward.default and callable(ops[1])
    finally:
        packed._cudnn_ops.cache_clear()


class FakeOp:
    """A stand-in for an aten overload: ``fn`` with the real overload's ``_schema``."""

    def __init__(self, fn, schema):
        self.fn, self._schema = fn, schema

    def __call__(self, *a, **kw):
        return self.fn(*a, **kw)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_fa2_calls_and_exact(monkeypatch, causal):
    """The fa2 kernel with torch's FlashAttention-2 varlen ops faked (their real schemas): the
    forward positionally as torch's varlen_attn calls it (boundaries, longest documents, no
    dropout, causality, no debug mask, the scale), its LSE ``[h, Tq]`` taken as it is, the
    backward given the forward's output and LSE; exact against float64, on a ring step's
    rectangles too (FA2 aligns causal masks bottom-right, as the reference)."""
    calls = []

    def fa_fwd(query, key, value, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale):
        calls.append({"op": "fwd", "cu_q": cu_q, "cu_k": cu_k, "max_q": max_q, "max_k": max_k, "dropout": dropout_p, "causal": is_causal,
                      "debug": return_debug_mask, "scale": scale, "k": key.shape})  # fmt: skip
        out, lse = docs_math(query, key, value, cu_q, cu_k, is_causal, scale)
        return out.to(query.dtype), lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)

    def fa_bwd(grad_out, query, key, value, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused, *, scale):
        calls.append({"op": "bwd", "lse": lse, "cu_q": cu_q, "max_q": max_q, "causal": is_causal, "scale": scale})
        leaves = [x.detach().requires_grad_() for x in (query, key, value)]
        with torch.enable_grad():
            o, _ = docs_math(*leaves, cu_q, cu_k, is_causal, scale)
            return torch.autograd.grad(o, leaves, grad_out)

    aten = torch.ops.aten
    monkeypatch.setattr(aten, "_flash_attention_forward", types.SimpleNamespace(default=FakeOp(fa_fwd, aten._flash_attention_forward.default._schema)))
    monkeypatch.setattr(aten, "_flash_attention_backward", types.SimpleNamespace(default=FakeOp(fa_bwd, aten._flash_attention_backward.default._schema)))
    packed._fa2_ops.cache_clear()
    try:
        cu_q, cu_k = lengths_cu((5, 9, 1, 30)), lengths_cu((9, 5, 1, 33))
        dq_, dk_ = documents(cu_q), documents(cu_k)
        q, k, v = (x.requires_grad_() for x in inputs(cu_q[-1], 6, 2, dv=8, seed=12, tk=cu_k[-1]))
        mask = DocMask(causal)
        out, lse = KERNELS["fa2"].attend(q, k, v, dq_, dk_, mask, 0.2, lse=True)
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        packed._fa2_ops.cache_clear()
    f, b = calls
    assert tuple(f["cu_q"].tolist()) == cu_q and tuple(f["cu_k"].tolist()) == cu_k and f["cu_q"].dtype == torch.int32
    assert (f["max_q"], f["max_k"]) == (30, 33) and f["dropout"] == 0.0 and f["causal"] == causal and f["debug"] is False and f["scale"] == 0.2
    assert f["k"][1] == 6 and b["lse"].shape == (6, cu_q[-1]) and b["cu_q"] is f["cu_q"] and b["scale"] == 0.2 and b["causal"] == causal
    want, want_lse = reference(q, k, v, cu_q, cu_k, mask, 0.2)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    for a, w in zip(got, torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)


def test_fa2_refuses_what_it_cannot(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda, bf16, kern = torch.device("cuda"), torch.bfloat16, KERNELS["fa2"]
    if isinstance(packed._fa2_ops(), str):
        pytest.skip(packed._fa2_ops())
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)  # FA2 does not need cuDNN
    assert kern.why_not(cuda, bf16, DocMask(True), True) is None
    assert kern.why_not(cuda, bf16, DocMask(True, 4), True) == "takes no sliding window"
    assert kern.why_not(cuda, bf16, DocMask(True, None, 5.0), True) == "takes no softcap"
    assert "needs CUDA fp16/bf16, got cpu" in kern.why_not(torch.device("cpu"), bf16, DocMask(True), True)
    assert KERNELS["cudnn"].why_not(cuda, bf16, DocMask(True), True) in ("cuDNN is not available in this torch", packed._cudnn_ops())


@pytest.mark.parametrize("name", ["cudnn", "fa2"])
def test_ragged_ops_take_the_calls_arguments(name):
    """This torch's real ops take the calls ``_Ragged`` makes, argument by argument: FA2's run
    on meta tensors (their shapes: out as q, LSE ``[h, Tq]``, gradients as q, k, v); cuDNN's
    have no meta kernel, so their CPU call must fail at dispatch (no CPU kernel), not at binding."""
    ops = packed._cudnn_ops() if name == "cudnn" else packed._fa2_ops()
    if isinstance(ops, str):
        pytest.skip(ops)
    fwd, bwd = ops
    dev = "meta" if name == "fa2" else "cpu"
    q = torch.empty(300, 4, 128, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device=dev)
    kw = {"cum_seq_q": cu, "cum_seq_k": cu, "max_q": 200, "max_k": 200, "dropout_p": 0.0, "is_causal": True, "scale": 0.1}
    if name == "cudnn":
        with pytest.raises(NotImplementedError, match="Could not run 'aten::_cudnn_attention_forward' with arguments from the 'CPU' backend"):
            fwd(query=q, key=q, value=q, attn_bias=None, compute_log_sumexp=True, return_debug_mask=False, **kw)
        op = "_cudnn_attention_backward" if packed.cudnn_backward() == "cudnn" else "_flash_attention_backward"  # before torch 2.13: FA2's
        with pytest.raises(NotImplementedError, match=f"Could not run 'aten::{op}' with arguments from the 'CPU' backend"):
            bwd(grad_out=q, query=q, key=q, value=q, out=q, logsumexp=torch.empty(300, 4, 1), philox_seed=cu, philox_offset=cu, attn_bias=None, **kw)
        return
    res = fwd(query=q, key=q, value=q, attn_bias=None, compute_log_sumexp=True, return_debug_mask=False, **kw)
    assert res[0].shape == q.shape and res[1].shape == (4, 300)
    grads = bwd(grad_out=q, query=q, key=q, value=q, out=res[0], logsumexp=res[1], philox_seed=res[6], philox_offset=res[7], attn_bias=None, **kw)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape)] * 3


def test_expand_heads_is_repeat_interleave():
    """The KV expansion the varlen, cudnn and fa2 kernels run on a rank's shard: each KV head
    repeated in place, and its gradient each copy's sum."""
    x = torch.randn(7, 3, 5, dtype=torch.float64, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    g = torch.randn(7, 12, 5, dtype=torch.float64)
    a, b = packed._expand_heads(x, 4), y.repeat_interleave(4, dim=1)
    assert torch.equal(a, b)
    a.backward(g)
    b.backward(g)
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)


def test_cudnn_ops_schema_of_this_torch():
    """This torch's ops have every argument the kernel passes by name (else ``why_not`` says
    which is missing: checked by removing one)."""
    ops = packed._cudnn_ops()
    if isinstance(ops, str):
        pytest.skip(ops)
    fwd, bwd = torch.ops.aten._cudnn_attention_forward.default, torch.ops.aten._cudnn_attention_backward.default
    assert ops[0] is fwd and (ops[1] is bwd) == (packed.cudnn_backward() == "cudnn")
    assert {a.name for a in fwd._schema.arguments} >= packed._CUDNN_FWD_ARGS
    assert {a.name for a in bwd._schema.arguments} >= packed._CUDNN_BWD_ARGS
    packed._cudnn_ops.cache_clear()
    try:
        real = packed._CUDNN_BWD_ARGS
        packed._CUDNN_BWD_ARGS = real | {"softmax_stats"}
        assert packed._cudnn_ops() == f"torch {torch.__version__}'s aten::_cudnn_attention_backward takes no softmax_stats"
    finally:
        packed._CUDNN_BWD_ARGS = real
        packed._cudnn_ops.cache_clear()


# ---- the ring's steps on one kernel call --------------------------------------------------------------
@pytest.mark.parametrize("layout,R", [("contiguous", 2), ("zigzag", 3)])
def test_ring_step_pieces_on_flex(layout, R):
    """Every step's rectangles in one FlexAttention call (eager, CPU) equal the per-rectangle
    explicit math, out and log-sum-exp, in float64."""
    L = 40
    cu = (0, 1, 17, 18, 70, 71, 95, R * L)
    q, k, v = inputs(R * L, 4, 2, seed=9)
    sched = ring_schedule(R, layout, L, True, cu)
    blocks = [shard_rows(R * L, 1, R, j, layout) for j in range(R)]
    seen = 0
    for j, i in itertools.product(range(R), repeat=2):
        pieces = sched.pieces[j][i]
        if not pieces:
            continue
        qj, ki, vi = q.index_select(1, blocks[j]), k.index_select(1, blocks[i]), v.index_select(1, blocks[i])
        got = attend_lse_pieces(qj, ki, vi, pieces, 0.3, KERNELS["flex"])
        assert sorted((r.start, r.stop) for r, *_ in got) == sorted((p[0].start, p[0].stop) for p in pieces)
        for rows, out, lse in got:
            ((_, cols, diag),) = [p for p in pieces if p[0] == rows]
            want, want_lse = reference(qj[:, rows], ki[:, cols], vi[:, cols], (0, rows.stop - rows.start), (0, cols.stop - cols.start), DocMask(diag), 0.3)
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lse.double(), want_lse, rtol=1e-10, atol=1e-10)
            seen += 1
    assert seen > R


def _ring_rank(comm, layout, L, cu):
    torch.set_num_threads(1)
    R, hq, hkv = comm.world_size, 4, 2
    q, k, v, do = _global(R * L, hq, hkv)
    rows = shard_rows(R * L, 1, R, comm.rank, layout)
    mine = [x.index_select(1, rows) for x in (q, k, v, do)]
    ring = RingBackend(SDPABackend(packed="flex"), comm, comm, comm.rank, R, layout)
    kv_map = tuple(h * hkv // hq for h in range(hq))
    out, state = ring.forward(*mine[:3], causal=True, scale=0.3, kv_map=kv_map, needs_grad=True, docs=documents(cu))
    return rows, out, ring.backward(state, mine[3])


@pytest.mark.parametrize("layout,R", [("contiguous", 2), ("zigzag", 3)])
def test_ring_forward_on_flex_steps(layout, R, fresh_chooser):
    """A ring forced to FlexAttention (its steps run forward only; the block backward is the
    ring's explicit one) on thread ranks: the float64 reference, forward and backward."""
    L = 24
    cu = [0, 1, 13, 14, 40, R * L]
    results = ThreadGroup(R, timeout=60).run(_ring_rank, layout, L, cu)
    full = [x.clone().requires_grad_() for x in _global(R * L, 4, 2)[:3]]
    ref = packed_attention_reference(*full, cu, causal=True, softmax_scale=0.3)
    ref.backward(_global(R * L, 4, 2)[3])
    for rows, out, grads in results:
        torch.testing.assert_close(out, ref.index_select(1, rows), rtol=1e-10, atol=1e-10)
        for got, f in zip(grads, full):
            torch.testing.assert_close(got, f.grad.index_select(1, rows), rtol=1e-10, atol=1e-10)


# ---- GPU: every kernel that runs there, bf16 within 2x PyTorch's own error ----------------------------------
GPU_CASES = [  # (mask, hq, hkv, dv): few, as each FlexAttention mask/score variant compiles once (tens of seconds)
    (DocMask(True), 8, 2, 128),
    (DocMask(False), 8, 2, 128),
    (DocMask(True, 64), 8, 2, 128),
    (DocMask(True, None, 20.0), 8, 2, 128),
    (DocMask(True), 4, 4, 64),  # no grouping; MLA's narrower v
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["flash", "varlen", "cudnn", "fa2", "flex"])
@pytest.mark.parametrize("mask,hq,hkv,dv", GPU_CASES, ids=["causal", "bidirectional", "window64", "softcap20", "mha-dv64"])
def test_gpu_kernels_bf16(kernel, mask, hq, hkv, dv):
    """Forward and backward against float64; the bound per tensor is 2x the error of the
    per-document loop in bf16 (PyTorch's own SDPA/math in the same dtype) plus a small floor."""
    dev = torch.device("cuda")
    why = KERNELS[kernel].why_not(dev, torch.bfloat16, mask, True)
    if why:
        pytest.skip(f"{kernel}: {why}")
    cu = mixed_cu(3000, seed=1)
    docs = documents(cu)
    base = [x.to(dev) for x in inputs(cu[-1], hq, hkv, d=128, dv=dv, seed=4, dtype=torch.float32)]
    dout = torch.randn(1, cu[-1], hq, dv, device=dev)

    def run(name, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in base]
        out = KERNELS[name].attend(*leaves, docs, docs, mask, 0.1)
        return [out, *torch.autograd.grad(out, leaves, dout.to(dtype))]

    truth = run("loop", torch.float64)
    low = run("loop", torch.bfloat16)
    got = run(kernel, torch.bfloat16)
    for name, g, lo, t in zip(("out", "dq", "dk", "dv"), got, low, truth):
        err, own = (g.double() - t).abs().max().item(), (lo.double() - t).abs().max().item()
        assert err <= 2 * own + 1e-4, f"{kernel} {name}: {err:.3e} > 2 x {own:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["cudnn", "fa2"])
@pytest.mark.parametrize("lengths,causal", [("mixed", True), ("short", True), ("short", False), ("long", True)],
                         ids=["mixed-causal", "short-causal", "short-bidirectional", "long-causal"])  # fmt: skip
def test_gpu_ragged_bf16_lse_and_grouped(kernel, lengths, causal):
    """The direct ragged kernels (cuDNN's; FA2's without varlen_attn's wrapper) as the
    benchmark runs them (4 query heads on one KV head, head dim 128, bf16): out, LSE, dq, dk,
    dv against float64, each within 2x the per-document loop's own bf16 error plus a small
    floor; on documents of every length up to 128 (torch 2.14's varlen_attn keeps cuDNN off
    those: checked here rather than assumed), a realistic mix, and a few long ones (longer
    than the head dim: what cuDNN's ragged backward before torch 2.13 mis-sizes, see
    ``packed.CUDNN_RAGGED_BACKWARD_SINCE``)."""
    dev = torch.device("cuda")
    why = KERNELS[kernel].why_not(dev, torch.bfloat16, DocMask(causal), True)
    if why:
        pytest.skip(f"{kernel}: {why}")
    rng = random.Random(3)
    if lengths == "short":
        cu = lengths_cu([rng.randint(1, 128) for _ in range(40)])
    elif lengths == "long":
        cu = lengths_cu([1500, 3000, 7, 2500])
    else:
        cu = mixed_cu(3000, seed=1)
    docs, mask = documents(cu), DocMask(causal)
    base = [x.to(dev) for x in inputs(cu[-1], 4, 1, d=128, seed=9, dtype=torch.float32)]
    dout = torch.randn(1, cu[-1], 4, 128, device=dev)

    def run(name, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in base]
        out, lse = KERNELS[name].attend(*leaves, docs, docs, mask, 0.088, lse=True)
        return [out, lse, *torch.autograd.grad(out, leaves, dout.to(dtype))]

    truth = run("loop", torch.float64)
    low = run("loop", torch.bfloat16)
    got = run(kernel, torch.bfloat16)
    assert got[1].dtype == torch.float32 and got[1].shape == (1, 4, cu[-1])
    with torch.no_grad():  # an inference call (no LSE asked) gives the training call's output
        plain = KERNELS[kernel].attend(*[x.to(torch.bfloat16) for x in base], docs, docs, mask, 0.088)
    assert torch.equal(plain, got[0])
    for name, g, lo, t in zip(("out", "lse", "dq", "dk", "dv"), got, low, truth):
        err, own = (g.double() - t).abs().max().item(), (lo.double() - t).abs().max().item()
        assert err <= 2 * own + 1e-4, f"{KERNELS[kernel].label} {name}: {err:.3e} > 2 x {own:.3e} (cuDNN {torch.backends.cudnn.version()})"


# ---- transformers: windows and softcap of packed documents on the kernel ------------------------------
@pytest.mark.parametrize("case", [2, 3], ids=["mistral-window", "gemma2-window-softcap"])
def test_hf_packed_window_and_softcap_run_on_the_kernel(monkeypatch, case, fresh_chooser):
    """A packed batch of a model with a sliding window (Mistral, sdpa) or a window and logit
    softcapping (Gemma 2, eager) runs its windowed layers on the chosen packed kernel with
    that window and softcap (here the loop: the CPU), and equals each document run on its own."""
    pytest.importorskip("transformers")
    import test_hf_packed as T

    from ulysses_kernels.integrations import hf

    seen = []
    real = packed.Loop.attend
    monkeypatch.setattr(
        packed.Loop, "attend", lambda self, q, k, v, dq, dk, mask, scale, lse=False: (seen.append(mask), real(self, q, k, v, dq, dk, mask, scale, lse))[1]
    )
    ids, labels, positions, cu = T.packed_batch()
    ref_loss, ref_grads, ref_logits = T.reference(T.build(*T.CASES[case]), ids, labels, cu)
    model = hf.apply(T.build(*T.CASES[case]))
    batch = hf.shard_batch(ids, labels, position_ids=positions)
    out = model(**batch.model_inputs(loss=False))
    loss = batch.loss(out.logits)
    loss.backward()
    cfg = model.config
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    assert DocMask(True, cfg.sliding_window, softcap) in seen, seen
    rtol, grad_rtol = T.tolerances(T.CASES[case])
    T.close(loss.detach(), ref_loss, rtol, "loss")
    T.close(out.logits.detach(), ref_logits, rtol, "logits")
    for name, p in model.named_parameters():
        T.close(p.grad, ref_grads[name], grad_rtol, f"grad of {name}")


@pytest.mark.parametrize("form", ["5.23", "5.17"])
def test_hf_packed_mask_wrapper_of_each_transformers_form_is_taken_off(form):
    """transformers wraps a layer's mask function for a packed batch in one of two forms: 5.23
    ``and_masks(overlay, remap_positions_for_packed_sequence(fn))``, 5.17 (no remapping, which
    the H200 machine of 2026-11-28 has) ``and_masks(fn, overlay)``; both give back ``fn``."""
    mu = pytest.importorskip("transformers.masking_utils")
    from ulysses_kernels.layers.masks import _unpacked

    fn = mu.sliding_window_causal_mask_function(16)
    overlay = mu.packed_sequence_mask_function(torch.zeros(1, 8, dtype=torch.long))
    if form == "5.23":
        if not hasattr(mu, "remap_positions_for_packed_sequence"):
            pytest.skip("this transformers has the older form only")
        wrapped = mu.and_masks(overlay, mu.remap_positions_for_packed_sequence(fn, torch.arange(8)[None]))
    else:
        wrapped = mu.and_masks(fn, overlay)
    assert _unpacked(wrapped) == (fn, True)
    assert _unpacked(fn) == (fn, False)
    assert _unpacked(mu.and_masks(fn, mu.causal_mask_function))[1] is False  # not a packed wrapper
