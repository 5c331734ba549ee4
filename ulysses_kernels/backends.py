"""Local attention backends behind one small interface.

After the sequence-to-head all-to-all each rank holds, for its heads, the whole sequence:
``q`` ``[B, S, hq, D]``, ``k``/``v`` ``[B, S, hkv, D]`` (strided views, last dim contiguous),
and ``kv_map[i]``, the local KV head of local query head ``i``. A backend computes full
(optionally causal) softmax attention and, later, its gradients:

    out, state = backend.forward(q, k, v, causal=..., scale=..., kv_map=..., needs_grad=...)
    dq, dk, dv = backend.backward(state, dout)

For a packed sequence (``B == 1``, documents end to end) ``forward`` and ``attend`` also get
``docs=`` (``documents.Documents``: the global ``cu_seqlens`` and ``max_seqlen``) and
attention is block-diagonal over the documents, causal inside each when causal. The
keyword is passed only when there are documents, so backends written before it keep
working on ordinary batches.

Backends: ``"flash"`` (flash-attn, CUDA, fp16/bf16), ``"sdpa"`` (torch
``scaled_dot_product_attention``, any device), ``"math"`` (explicit softmax, exact in
float64), any callable ``fn(q, k, v, causal=, softmax_scale=) -> out`` over ``[B, S, H, D]``
with uniform grouped heads (for a packed sequence also ``cu_seqlens=`` (a tuple of ints)
and ``max_seqlen=``), or any object with ``forward``/``backward`` as above.

``for_rank`` picks what a rank runs: on a rank whose query heads all share its one KV head,
built-in backends run inside ``SharedKV``, which sums that head's gradient itself (in query
head order) so that the chunked pipeline can split the query heads and stay bit-identical.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

__all__ = [
    "AttentionBackend",
    "SharedKV",
    "KVGradSum",
    "for_rank",
    "resolve_backend",
    "expand_kv",
    "gather_kv",
    "kv_index",
    "scatter_kv_grads",
    "uniform_group",
    "shares_one_kv",
    "BACKENDS",
    "math_attention_lse",
    "math_attention_lse_backward",
    "save_tensors",
    "one_recompute",
    "chunks_recompute_apart",
    "graph_exec_group",
    "doc_kwargs",
    "per_document",
]


def doc_kwargs(docs) -> dict:
    """``{"docs": docs}`` for a packed sequence, ``{}`` otherwise: what a backend's
    ``forward``/``attend`` is called with (backends that predate documents need not take
    the keyword)."""
    return {} if docs is None else {"docs": docs}


def per_document(fn, q, k, v, docs) -> torch.Tensor:
    """``fn(q_d, k_d, v_d)`` on each document's rows of ``[1, S, H, D]`` tensors, joined
    along the sequence: block-diagonal attention from any dense attention ``fn``.

    NOTE: on the CPU, one thread, 4096 tokens in 7 documents (32 to 1500 tokens), 4 heads,
    head_dim 64, float32, SDPA forward + backward: 0.31 s as this loop, 1.49 s as one call
    with a boolean block-diagonal [S, S] mask (the mask computes and stores all S^2 scores)."""
    return torch.cat([fn(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in docs.spans()], dim=1)


def uniform_group(hq: int, hkv: int, kv_map: Sequence[int]) -> bool:
    """True when query head ``i`` uses KV head ``i // (hq // hkv)`` (plain GQA)."""
    if hq % hkv:
        return False
    g = hq // hkv
    return all(j == i // g for i, j in enumerate(kv_map))


def kv_index(kv_map: Sequence[int], device: torch.device) -> torch.Tensor:
    """``kv_map`` as an int64 index tensor on ``device``, read-only.

    On a GPU the tensor is kept on the device per ``(kv_map, device)`` (a bounded cache of a
    few bytes each, keyed by values, not by a group): the first call for a map copies it
    once, and every later call reuses it with no copy, no host sync and nothing a CUDA graph
    capture would refuse (a per-call copy from pageable host memory cannot be captured, and
    a blocking one would make the host wait for the queued GPU work). As with the Triton
    tables, run a layout once before capturing it. Elsewhere, and inside ``torch.compile``,
    a fresh tensor."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return torch.tensor(list(kv_map), dtype=torch.int64, device=device)
    return _device_index(tuple(int(i) for i in kv_map), device)


@functools.lru_cache(maxsize=256)
def _device_index(kv_map: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # A blocking copy, once per (map, device): the tensor is complete before any stream
    # reads it, whichever stream that is.
    return torch.tensor(kv_map, dtype=torch.int64, device=device)


def expand_kv(k: torch.Tensor, v: torch.Tensor, kv_map: Sequence[int], *, always: bool = False):
    """k, v as plain grouped heads for ``kv_map``.

    A rank whose query heads straddle a KV group boundary unevenly (for example 3 query
    heads, 2 from one group and 1 from the next) cannot use a uniform GQA kernel; its KV
    heads are gathered to one per query head here, locally, after the wire. ``always``
    gathers even a uniform map (the chunked pipeline, whose chunk of a non-uniform rank
    may be uniform, must run the same kernels as the unchunked op).
    """
    if not always and uniform_group(len(kv_map), k.shape[2], kv_map):
        return k, v
    return gather_kv(k, v, kv_index(kv_map, k.device))


def gather_kv(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor):
    """KV heads ``index`` (one per local query head) of ``k``, ``v`` ``[B, S, hkv, D]``."""
    return k.index_select(2, index), v.index_select(2, index)


def scatter_kv_grads(dk: torch.Tensor, dv: torch.Tensor, kv_map: Sequence[int], hkv: int):
    """The backward of ``gather_kv`` with ``kv_index(kv_map)``: per-query-head ``dk``, ``dv``
    ``[B, S, hq, D]`` summed into ``[B, S, hkv, D]``, as autograd's ``index_select``
    backward does (zeros, then ``index_add_`` in query-head order)."""
    index = kv_index(kv_map, dk.device)
    shape = (dk.shape[0], dk.shape[1], hkv, dk.shape[3])
    return dk.new_zeros(shape).index_add_(2, index, dk), dv.new_zeros(shape).index_add_(2, index, dv)


class _AttentionInputs(torch.autograd.Function):
    """Identity on ``q``, ``k``, ``v`` whose only grad-requiring input is a 0-element dummy:
    the attention graph then starts at this node (no ``AccumulateGrad`` holding q/k/v), and
    the gradient edges of its outputs are where ``AttentionBackend.backward`` stops."""

    @staticmethod
    def forward(ctx, dummy, q, k, v):
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return None, None, None, None


class _SavedTensors(torch.autograd.Function):
    """Holds tensors in its saved tensors; never differentiated (``save_tensors``)."""

    @staticmethod
    def forward(ctx, dummy, *tensors):
        ctx.save_for_backward(*tensors)
        ctx.count = len(tensors)
        return dummy.view_as(dummy)

    @staticmethod
    def backward(ctx, grad):
        return (None,) * (1 + ctx.count)


class SavedHandle:
    """What ``save_tensors`` returns: the node's 0-element output, so the node stays alive.
    Holding the node alone (``grad_fn``) is not enough on torch 2.11 (it is on 2.14): there,
    when a custom Function's outputs are all freed, its saved tensors are released, and
    reading them raises "Trying to backward through the graph a second time" (measured)."""

    __slots__ = ("_marker",)

    def __init__(self, marker: torch.Tensor):
        self._marker = marker

    @property
    def saved_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._marker.grad_fn.saved_tensors


def save_tensors(*tensors: torch.Tensor) -> SavedHandle:
    """``tensors`` kept in autograd's saved tensors, for a backend with its own backward
    (its state holds the returned handle, not the tensors): saved-tensor hooks (activation
    checkpointing, ``save_on_cpu``) see them as they see any saved tensor, and the tensors
    go when the handle does. ``handle.saved_tensors`` gives them back (once, in the backward)."""
    dummy = torch.empty(0, device=tensors[0].device, requires_grad=True)
    with torch.enable_grad():
        return SavedHandle(_SavedTensors.apply(dummy, *tensors))


def graph_exec_group():
    """``torch.utils.checkpoint.GraphExecGroup`` (torch >= 2.9), else None."""
    return getattr(torch.utils.checkpoint, "GraphExecGroup", None)


def one_recompute():
    """A context for a backward that runs nested backward passes (``torch.autograd.grad`` over
    attention graphs, as ``AttentionBackend.backward`` does): under non-reentrant activation
    checkpointing each nested pass is a graph task of its own, and the checkpoint would run
    its recompute (the region's forward: our collectives again) once per nested pass, at
    points that differ between ranks whose chunks hold no heads (a hang). Inside one
    ``torch.utils.checkpoint.GraphExecGroup`` the region is recomputed once, at the first
    unpack. An enclosing group (the caller's) is used as it is; torch without the class
    (older than 2.9): a no-op."""
    group = graph_exec_group()
    if group is None or torch._C._get_graph_exec_group() is not None:
        return contextlib.nullcontext()
    return group()


def chunks_recompute_apart() -> bool:
    """Whether a chunked backward would recompute a checkpointed region once per nested pass:
    saved-tensor hooks are active (non-reentrant ``torch.utils.checkpoint``, ``save_on_cpu``)
    and torch has no ``GraphExecGroup`` (before 2.9). A rank whose chunk holds no head runs
    fewer nested passes, so fewer recomputes (our collectives again) than its peers: a hang,
    measured on torch 2.8 (the self-test's uneven-heads checkpoint path at chunks=2 timed
    out). The call then runs unchunked (``call._resolve_chunks``), which the forward and the
    recompute decide alike: both run under the checkpoint's hooks."""
    if graph_exec_group() is not None:
        return False
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class AttentionBackend:
    """Base class: forward through ``attend`` under autograd, backward with autograd.grad.

    The state holds no tensor: only the gradient edges of the attention inputs and output
    (``torch.autograd.graph.get_gradient_edge``), so every tensor the backward needs lives
    in the attention graph's saved tensors, which saved-tensor hooks (activation
    checkpointing, ``save_on_cpu``) see and may drop or move (docs/design.md)."""

    name = "base"
    # Whether ``attend_lse`` computes what ``attend`` does (the ring level needs it), and
    # whether it holds the [B, H, S, T] scores in memory (the ring then tiles the rows).
    supports_lse = True
    lse_scores_in_memory = True

    def attend(self, q, k, v, causal: bool, scale: float, docs=None) -> torch.Tensor:
        """``[B, S, hq, D]`` attention with ``hq % hkv == 0`` grouped heads; with ``docs``
        (``B == 1``) block-diagonal over the documents."""
        raise NotImplementedError

    def attend_lse(self, q, k, v, causal: bool, scale: float):
        """``attend`` with the log-sum-exp: ``(out, lse [B, hq, S])`` (one ring block).
        Default: ``math_attention_lse`` (exact in float64)."""
        return math_attention_lse(q, k, v, causal, scale)

    def attend_lse_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        """One ring block's gradients against the final ``out``/``lse``
        (``math_attention_lse_backward``)."""
        return math_attention_lse_backward(dout, q, k, v, out, lse, causal, scale)

    def forward(self, q, k, v, *, causal, scale, kv_map, needs_grad, docs=None):
        kw = doc_kwargs(docs)
        if not needs_grad:
            with torch.no_grad():
                k2, v2 = expand_kv(k, v, kv_map)
                return self.attend(q, k2, v2, causal, scale, **kw), None
        gathered = None
        if not uniform_group(len(kv_map), k.shape[2], kv_map):
            # The kernel saves the gathered k, v, the attention inputs (dk, dv are summed
            # back to the KV heads in ``backward``, as autograd's index_select backward
            # would). A q that shares its storage with k, v (the receive buffer) is copied
            # too, so that the buffer, whose k, v heads nothing reads any more, is not
            # kept alive for the backward by q alone.
            gathered = (tuple(kv_map), k.shape[2])  # the index is rebuilt for the backward
            if q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
                q = q.clone(memory_format=torch.contiguous_format)
            k, v = gather_kv(k, v, kv_index(kv_map, k.device))
        dummy = torch.empty(0, dtype=q.dtype, device=q.device, requires_grad=True)
        with torch.enable_grad():
            inputs = _AttentionInputs.apply(dummy, q.detach(), k.detach(), v.detach())
            out = self.attend(*inputs, causal, scale, **kw)
        edges = [torch.autograd.graph.get_gradient_edge(x) for x in (out, *inputs)]
        # The state is a list that ``backward`` empties: the graph (and what it saved) goes with it.
        return out.detach(), [edges, gathered]

    def backward(self, state, dout):
        """The gradients for ``q``, ``k``, ``v``. Empties ``state``: the attention inputs
        the graph saved are freed before the gradients are returned, not when the caller
        lets go."""
        (out, *inputs), gathered = state
        state.clear()
        dq, dk, dv = torch.autograd.grad([out], inputs, [dout])
        del out, inputs
        if gathered is not None:
            dk, dv = scatter_kv_grads(dk, dv, *gathered)
        return dq, dk, dv


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def attend(self, q, k, v, causal, scale, docs=None):
        if docs is not None:
            return per_document(lambda *x: self.attend(*x, causal, scale), q, k, v, docs)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)


def math_attention(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """Explicit softmax attention over ``[B, S, H, D]``; the accumulation dtype is the
    input's for float32/float64 and float32 for half types."""
    acc = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    g = q.shape[2] // k.shape[2]
    k = k.to(acc).repeat_interleave(g, dim=2)
    v = v.to(acc).repeat_interleave(g, dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q.to(acc), k) * scale
    if causal:
        s, t = scores.shape[-2:]
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).triu(t - s + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhst,bthd->bshd", probs, v).to(q.dtype)


def _math_scores(q, k, causal: bool, scale: float, acc: torch.dtype) -> torch.Tensor:
    """Scaled scores ``[B, H, S, T]`` (``-inf`` where masked) of grouped-head ``q``, ``k``."""
    k = k.to(acc).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q.to(acc), k) * scale
    if causal:
        s, t = scores.shape[-2:]
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).triu(t - s + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)``; a row with no key (``lse = -inf``) gets zeros, not NaN."""
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - lse.unsqueeze(-1))


def math_attention_lse(q, k, v, causal: bool, scale: float):
    """``math_attention`` that also returns the log-sum-exp of each row's scores.

    Returns ``(out, lse)``: ``out`` ``[B, S, H, D]`` and ``lse`` ``[B, H, S]`` in the
    accumulation dtype (``merge.acc_dtype``: float64 stays, else float32); a row with no
    visible key has ``out = 0`` and ``lse = -inf``."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = _math_scores(q, k, causal, scale, acc)
    lse = torch.logsumexp(scores, dim=-1)
    v = v.to(acc).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bhst,bthd->bshd", _probs(scores, lse), v), lse


def math_attention_lse_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of one block of keys recomputed against the *final* ``out`` and ``lse`` of
    the rows (over all blocks): ``p = exp(scores - lse)``, ``dv = p^T dout``,
    ``ds = p * (dout v^T - rowsum(dout * out))``, ``dq = ds k * scale``, ``dk = ds^T q * scale``.
    ``dk``, ``dv`` are summed over each KV head's query heads (``[B, T, hkv, D]``); all three
    in the accumulation dtype."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = q.shape[2] // k.shape[2]
    probs = _probs(_math_scores(q, k, causal, scale, acc), lse.to(acc))
    dout, q = dout.to(acc), q.to(acc)
    ke, ve = (x.to(acc).repeat_interleave(g, dim=2) for x in (k, v))
    dv = torch.einsum("bhst,bshd->bthd", probs, dout)
    rows = (dout * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, S]
    ds = probs * (torch.einsum("bshd,bthd->bhst", dout, ve) - rows.unsqueeze(-1))
    dq = torch.einsum("bhst,bthd->bshd", ds, ke) * scale
    dk = torch.einsum("bhst,bshd->bthd", ds, q) * scale
    if g > 1:
        b, t, _, d = dk.shape
        dk, dv = (x.view(b, t, k.shape[2], g, d).sum(3) for x in (dk, dv))
    return dq, dk, dv


class MathBackend(AttentionBackend):
    name = "math"

    def attend(self, q, k, v, causal, scale, docs=None):
        if docs is not None:
            return per_document(lambda *x: math_attention(*x, causal, scale), q, k, v, docs)
        return math_attention(q, k, v, causal, scale)


class FlashBackend(AttentionBackend):
    """flash-attn 2/3 ``flash_attn_func`` (CUDA, fp16/bf16, grouped heads natively); packed
    documents through ``flash_attn_varlen_func`` (``[total, h, D]``, int32 ``cu_seqlens`` on
    the device, one copy per boundaries and device: ``Documents.on``)."""

    name = "flash"

    def attend(self, q, k, v, causal, scale, docs=None):
        if docs is not None:
            from flash_attn import flash_attn_varlen_func

            cu, n = docs.on(q.device), docs.max_seqlen
            out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, n, n, softmax_scale=scale, causal=causal)
            return out.unsqueeze(0)
        from flash_attn import flash_attn_func

        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)

    lse_scores_in_memory = False

    def attend_lse(self, q, k, v, causal, scale):
        """flash-attn's forward with its log-sum-exp (``return_attn_probs=True``: ``(out,
        softmax_lse [B, H, S] float32, ...)``). The block backward is the inherited explicit
        one (float32; flash-attn's backward against a given LSE is not wired yet)."""
        from flash_attn import flash_attn_func

        out, lse, *_ = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
        return out, lse


class CallableBackend(AttentionBackend):
    supports_lse = False  # a user's function returns no log-sum-exp

    def __init__(self, fn: Callable):
        self.fn = fn
        self.name = getattr(fn, "__name__", "callable")

    def attend(self, q, k, v, causal, scale, docs=None):
        if docs is not None:
            return self.fn(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens=docs.cu_seqlens, max_seqlen=docs.max_seqlen)
        return self.fn(q, k, v, causal=causal, softmax_scale=scale)


class KVGradSum:
    """Running sum over query heads of per-query-head KV gradients, in head order.

    ``add(dk, dv)`` takes ``[B, S, h, D]`` gradients of ``h`` query heads that all use one
    KV head and adds them one head at a time into ``[B, S, 1, D]`` accumulators (float32
    for half types, rounded once in ``result``). Feeding the heads in two calls or in one
    adds the same numbers in the same order, which is what makes a chunked backward
    bit-identical to the unchunked one.
    """

    def __init__(self):
        self.acc: list[torch.Tensor] | None = None
        self.dtype: torch.dtype | None = None

    def add(self, *grads: torch.Tensor) -> None:
        h = grads[0].shape[2]
        if h == 0:
            return
        start = 0
        if self.acc is None:
            self.dtype = grads[0].dtype
            wide = self.dtype if self.dtype in (torch.float32, torch.float64) else torch.float32
            self.acc = [g[:, :, :1].to(wide, copy=True) for g in grads]
            start = 1
        for i in range(start, h):
            for a, g in zip(self.acc, grads):
                a.add_(g[:, :, i : i + 1])

    def result(self) -> list[torch.Tensor]:
        """The sums ``[B, S, 1, D]`` in the gradients' dtype."""
        if self.acc is None:
            raise RuntimeError("KVGradSum.result: no gradient was added")
        return [a.to(self.dtype) for a in self.acc]


class SharedKV:
    """A rank whose query heads all use its one KV head: attention runs as plain
    multi-head attention against a stride-0 view of that head (no copy), and the KV
    gradient is summed over the query heads by ``KVGradSum`` rather than inside the kernel.

    Why: the chunked pipeline splits such a rank's query heads into chunks, so the KV
    gradient arrives in pieces; summing per query head in head order, in both the chunked
    and the unchunked op, keeps the two bit-identical. The cost is the kernel's per-head
    dk/dv (``[B, S, hq, D]``, which flash-attn's own GQA backward allocates too) and
    ``hq`` small adds.
    """

    def __init__(self, inner: AttentionBackend):
        self.inner = inner
        self.name = inner.name

    @staticmethod
    def expand(k, v, hq: int):
        """The one KV head ``[B, S, 1, D]`` as stride-0 ``[B, S, hq, D]`` views (no copy)."""
        shape = (-1, -1, hq, -1)
        return k.expand(shape), v.expand(shape)

    @staticmethod
    def sum_grads(dk, dv) -> list[torch.Tensor]:
        """The per-query-head ``dk``, ``dv`` summed to ``[B, S, 1, D]`` (``KVGradSum``)."""
        acc = KVGradSum()
        acc.add(dk, dv)
        return acc.result()

    def forward(self, q, k, v, *, causal, scale, kv_map, needs_grad, docs=None):
        ident = tuple(range(q.shape[2]))
        k, v = self.expand(k, v, q.shape[2])
        return self.inner.forward(q, k, v, causal=causal, scale=scale, kv_map=ident, needs_grad=needs_grad, **doc_kwargs(docs))

    def backward_per_head(self, state, dout):
        """``dq`` and the per-query-head ``dk``, ``dv`` (``[B, S, hq, D]``), not yet summed."""
        return self.inner.backward(state, dout)

    def backward(self, state, dout):
        dq, dk, dv = self.backward_per_head(state, dout)
        return (dq, *self.sum_grads(dk, dv))


def shares_one_kv(kv_map: Sequence[int]) -> bool:
    """True when several local query heads use the rank's only local KV head."""
    return len(kv_map) > 1 and not any(kv_map)


def for_rank(backend, kv_map: Sequence[int]):
    """The backend a rank runs: ``SharedKV`` around built-in (``AttentionBackend``)
    backends when ``shares_one_kv(kv_map)``; the backend itself otherwise."""
    if isinstance(backend, AttentionBackend) and shares_one_kv(kv_map):
        return SharedKV(backend)
    return backend


BACKENDS = {"sdpa": SDPABackend, "math": MathBackend, "flash": FlashBackend}


def flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(attn_fn, q: torch.Tensor):
    """The backend object for ``attn_fn`` (None, a name, a callable or a backend)."""
    if attn_fn is None:
        use_flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_available()
        return FlashBackend() if use_flash else SDPABackend()
    if isinstance(attn_fn, str):
        if attn_fn not in BACKENDS:
            raise ValueError(f"ulysses_attention: attn_fn={attn_fn!r}; expected one of {sorted(BACKENDS)}, a callable or a backend")
        if attn_fn == "flash" and not flash_available():
            raise ValueError("ulysses_attention: attn_fn='flash' but flash_attn is not importable")
        return BACKENDS[attn_fn]()
    if hasattr(attn_fn, "forward") and hasattr(attn_fn, "backward"):
        return attn_fn
    if callable(attn_fn):
        return CallableBackend(attn_fn)
    raise TypeError(f"ulysses_attention: attn_fn must be None, a name, a callable or a backend, got {type(attn_fn).__name__}")


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
