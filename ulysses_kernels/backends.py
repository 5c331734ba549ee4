"""Local attention backends behind one small interface.

After the sequence-to-head all-to-all each rank holds, for its heads, the whole sequence:
``q`` ``[B, S, hq, D]``, ``k`` ``[B, S, hkv, D]``, ``v`` ``[B, S, hkv, Dv]`` (strided views,
last dim contiguous; ``Dv`` may differ from ``D``: MLA; the output is ``[B, S, hq, Dv]``),
and ``kv_map[i]``, the local KV head of local query head ``i``. A backend computes full
(optionally causal) softmax attention and, later, its gradients:

    out, state = backend.forward(q, k, v, causal=..., scale=..., kv_map=..., needs_grad=...)
    dq, dk, dv = backend.backward(state, dout)

For a packed sequence (``B == 1``, documents end to end) ``forward`` and ``attend`` also get
``docs=`` (``documents.Documents``: the global ``cu_seqlens`` and ``max_seqlen``) and
attention is block-diagonal over the documents, causal inside each when causal. The
keyword is passed only when there are documents, so backends written before it keep
working on ordinary batches.

A packed sequence runs on one packed-documents kernel (``packed``: flash-attn's varlen,
torch's ``varlen_attn``, FlexAttention, or a loop over the documents), picked by
``packed_kernel``, the one chooser, for the backend, the device, the dtype and the mask.

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

import functools
import importlib.util
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .checkpointing import save_tensors  # for backends with their own backward (docs/extending.md)
from .gqa import KVGather, shares_one_kv
from .math_attention import math_attention, math_attention_lse, math_attention_lse_backward
from .packed import KERNELS, DocMask
from .tracing import in_trace

__all__ = [
    "AttentionBackend",
    "SharedKV",
    "for_rank",
    "resolve_backend",
    "backend_of",
    "named_backend",
    "BACKENDS",
    "save_tensors",
    "doc_kwargs",
    "attend_rows",
    "attend_heads",
    "per_document",
    "packed_kernel",
    "packed_report",
    "PACKED_ENV",
]

# Forces one packed-documents kernel (``packed.KERNELS``: flash, varlen, cudnn, flex, loop) for
# every backend that uses the chooser; unset or "auto": the chooser's order.
PACKED_ENV = "ULYSSES_KERNELS_PACKED"

# The chooser's order for torch's own kernels (flash-attn's varlen goes first for the flash
# backend). A kernel enters it only once a GPU record shows it exact and fastest; cuDNN's
# ragged kernel ("cudnn") is forced only (``packed=``, ULYSSES_KERNELS_PACKED) until then.
PACKED_DEFAULT: tuple[str, ...] = ("varlen", "flex", "loop")


def packed_kernel(device: torch.device, dtype: torch.dtype, mask: DocMask | None = None, *, grad: bool = True,
                  candidates: Sequence[str] = PACKED_DEFAULT, prefer: str | None = None):  # fmt: skip
    """The packed-documents kernel (``packed.PackedKernel``) for tensors on ``device`` of
    ``dtype`` under ``mask``: ``prefer`` (else ``ULYSSES_KERNELS_PACKED``) when given, else the
    first of ``candidates`` that runs here (flash-attn's varlen, torch's ``varlen_attn``,
    FlexAttention on CUDA, the per-document loop). ``grad``: the backward will run through it.
    FlexAttention is not picked on the CPU unasked (torch runs it there eagerly over the
    dense mask, forward only). A forced kernel that cannot run raises ``ValueError`` naming
    it and why, never falls back silently (nor drops a window or a softcap)."""
    forced = prefer or os.environ.get(PACKED_ENV, "auto")
    if forced == "auto":
        forced = None
    mask = DocMask(True) if mask is None else mask
    return _packed_kernel(torch.device(device), dtype, mask, bool(grad), tuple(candidates), forced, in_trace())


@functools.lru_cache(maxsize=256)
def _packed_kernel(device, dtype, mask, grad, candidates, forced, compiling):
    if forced is not None:
        if forced not in KERNELS:
            raise ValueError(f"packed documents: kernel {forced!r} ({PACKED_ENV} or packed=); expected one of {sorted(KERNELS)} or 'auto'")
        why = KERNELS[forced].why_not(device, dtype, mask, grad)
        if why is not None:
            raise ValueError(f"packed documents: kernel {forced!r} cannot run {dtype} on {device} ({mask.describe()}): {why}")
        return KERNELS[forced]
    for name in candidates:
        if name == "flex" and device.type != "cuda":
            continue
        if KERNELS[name].why_not(device, dtype, mask, grad) is None:
            return KERNELS[name]
    return KERNELS["loop"]


def packed_report(device: torch.device, dtype: torch.dtype) -> list[tuple[str, str]]:
    """``[(kernel, "picked" | "runs here" | why not)]`` for causal packed documents with a
    backward on ``device`` in ``dtype``, in the chooser's order (``info`` prints it)."""
    pick = packed_kernel(device, dtype, candidates=("flash", *PACKED_DEFAULT))
    rows = []
    for name, kern in KERNELS.items():
        why = kern.why_not(torch.device(device), dtype, DocMask(True), True)
        rows.append((name, "picked" if kern is pick else (why or "runs here")))
    return rows


def doc_kwargs(docs) -> dict:
    """``{"docs": docs}`` for a packed sequence, ``{}`` otherwise: what a backend's
    ``forward``/``attend`` is called with (backends that predate documents need not take
    the keyword)."""
    return {} if docs is None else {"docs": docs}


def attend_rows(attend, q, k, v, causal: bool, scale: float, docs=None) -> torch.Tensor:
    """``attend(q, k, v, causal, scale[, docs=])`` (a backend's ``attend``) on ``[B, S, h, D]``;
    a batch of packed rows (``docs.rows = B > 1``: boundaries joined end to end over
    ``[B * S]``, ``documents``) runs as one packed row ``[1, B * S, h, D]`` (a view of the
    receive buffer's batch-major rows, no copy) and comes back as ``[B, S, h, Dv]``: every
    row end is a boundary, so attention never crosses rows."""
    if docs is None:
        return attend(q, k, v, causal, scale)
    B, S = q.shape[0], q.shape[1]
    if B == 1:
        return attend(q, k, v, causal, scale, docs=docs)
    out = attend(*(x.reshape(1, B * S, *x.shape[2:]) for x in (q, k, v)), causal, scale, docs=docs)
    return out.view(B, S, *out.shape[2:])


def attend_heads(attend, q, k, v, kv_map, causal: bool, scale: float, docs=None) -> torch.Tensor:
    """``attend_rows`` over ``k``, ``v`` gathered to ``q``'s heads by ``kv_map`` (``KVGather``:
    grouped views where the map is uniform): the step the eager backend's ``forward`` and the
    traced path (``attention.traced``) share."""
    return attend_rows(attend, q, *KVGather.of(kv_map, k.shape[2]).gather(k, v), causal, scale, docs)


def per_document(fn, q, k, v, docs) -> torch.Tensor:
    """``fn(q_d, k_d, v_d)`` on each document's rows of ``[1, S, H, D]`` tensors, joined
    along the sequence: block-diagonal attention from any dense attention ``fn``.

    NOTE: on the CPU, one thread, 4096 tokens in 7 documents (32 to 1500 tokens), 4 heads,
    head_dim 64, float32, SDPA forward + backward: 0.31 s as this loop, 1.49 s as one call
    with a boolean block-diagonal [S, S] mask (the mask computes and stores all S^2 scores)."""
    return torch.cat([fn(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in docs.spans()], dim=1)


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
    # The packed-documents kernels this backend may use, in the chooser's order, and the
    # one it is forced to (``None``: ``packed_kernel`` picks).
    packed_candidates: tuple[str, ...] = PACKED_DEFAULT
    packed: str | None = None

    def packed_kernel(self, q: torch.Tensor, mask: DocMask | bool, grad: bool | None = None):
        """The packed-documents kernel this backend runs for ``q`` under ``mask`` (a
        ``DocMask``, or ``causal``) (``packed_kernel``)."""
        grad = torch.is_grad_enabled() and q.requires_grad if grad is None else grad
        mask = mask if isinstance(mask, DocMask) else DocMask(bool(mask))
        return packed_kernel(q.device, q.dtype, mask, grad=grad, candidates=self.packed_candidates, prefer=self.packed)

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
        if not needs_grad:
            if not torch.is_grad_enabled():  # as the op calls it (inside its autograd nodes, or with nothing to differentiate)
                return attend_heads(self.attend, q, k, v, kv_map, causal, scale, docs), None
            with torch.no_grad():
                return attend_heads(self.attend, q, k, v, kv_map, causal, scale, docs), None
        heads = KVGather.of(kv_map, k.shape[2])  # gathered where the map is not uniform
        # A gathered map: the kernel saves the gathered k, v (dk, dv are summed back to the
        # KV heads in ``backward``), and q leaves the receive buffer (``KVGather.own_q``).
        q = heads.own_q(q, k)
        k, v = heads.gather(k, v)
        dummy = torch.empty(0, dtype=q.dtype, device=q.device, requires_grad=True)
        with torch.enable_grad():
            inputs = _AttentionInputs.apply(dummy, q.detach(), k.detach(), v.detach())
            out = attend_rows(self.attend, *inputs, causal, scale, docs)
        edges = [torch.autograd.graph.get_gradient_edge(x) for x in (out, *inputs)]
        # The state is a list that ``backward`` empties: the graph (and what it saved) goes with it.
        return out.detach(), [edges, heads]

    def backward(self, state, dout):
        """The gradients for ``q``, ``k``, ``v``. Empties ``state``: the attention inputs
        the graph saved are freed before the gradients are returned, not when the caller
        lets go."""
        (out, *inputs), heads = state
        state.clear()
        dq, dk, dv = torch.autograd.grad([out], inputs, [dout])
        del out, inputs
        return (dq, *heads.scatter(dk, dv))


class SDPABackend(AttentionBackend):
    """torch's SDPA; packed documents through torch's own packed kernels (``varlen_attn``,
    FlexAttention) or the per-document loop (``packed_kernel``). ``packed``: force one."""

    name = "sdpa"

    def __init__(self, packed: str | None = None):
        self.packed = packed

    def attend(self, q, k, v, causal, scale, docs=None):
        if docs is not None:
            return self.packed_kernel(q, causal).attend(q, k, v, docs, docs, DocMask(bool(causal)), scale)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)


class MathBackend(AttentionBackend):
    name = "math"
    packed_candidates = ("loop",)  # the exact reference: explicit math per document, everywhere

    def attend(self, q, k, v, causal, scale, docs=None):
        if docs is not None:
            return per_document(lambda *x: math_attention(*x, causal, scale), q, k, v, docs)
        return math_attention(q, k, v, causal, scale)


class FlashBackend(AttentionBackend):
    """flash-attn 2/3 ``flash_attn_func`` (CUDA, fp16/bf16, grouped heads natively); packed
    documents through ``flash_attn_varlen_func`` first (``packed.FlashVarlen``)."""

    name = "flash"
    packed_candidates = ("flash", *PACKED_DEFAULT)

    def __init__(self, packed: str | None = None):
        self.packed = packed

    def attend(self, q, k, v, causal, scale, docs=None):
        if v.shape[3] != q.shape[3]:
            # flash-attn 2 takes one head dim for q, k and v. MLA's narrower v is padded here,
            # on this rank's head shard after the exchange (never on the wire), and the
            # output cut back; autograd slices the padding's gradient off dv. A v wider
            # than q pads q and k instead (zeros add nothing to the scores).
            dv, d = v.shape[3], q.shape[3]
            if dv < d:
                return self.attend(q, k, F.pad(v, (0, d - dv)), causal, scale, docs)[..., :dv]
            return self.attend(F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d)), v, causal, scale, docs)
        if docs is not None:
            return self.packed_kernel(q, causal).attend(q, k, v, docs, docs, DocMask(bool(causal)), scale)
        from flash_attn import flash_attn_func

        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)

    lse_scores_in_memory = False

    def attend_lse(self, q, k, v, causal, scale):
        """flash-attn's forward with its log-sum-exp (``return_attn_probs=True``: ``(out,
        softmax_lse [B, H, S] float32, ...)``). The block backward is the inherited explicit
        one (float32; flash-attn's backward against a given LSE is not wired yet)."""
        from flash_attn import flash_attn_func

        dv, d = v.shape[3], q.shape[3]
        if dv != d:  # one head dim for flash-attn 2: pad on the head shard (see attend)
            w = max(d, dv)
            q, k, v = (F.pad(x, (0, w - x.shape[3])) for x in (q, k, v))
        out, lse, *_ = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
        return out[..., :dv], lse


class CallableBackend(AttentionBackend):
    supports_lse = False  # a user's function returns no log-sum-exp

    def __init__(self, fn: Callable):
        self.fn = fn
        self.name = getattr(fn, "__name__", "callable")

    def attend(self, q, k, v, causal, scale, docs=None):
        if docs is not None:
            return self.fn(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens=docs.cu_seqlens, max_seqlen=docs.max_seqlen)
        return self.fn(q, k, v, causal=causal, softmax_scale=scale)


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
    def heads(hq: int) -> KVGather:
        """The ``"shared"`` ``KVGather`` of ``hq`` query heads over the one KV head: stride-0
        views forward, ``KVGradSum`` in head order backward."""
        return KVGather((0,) * hq, 1, "shared")

    def forward(self, q, k, v, *, causal, scale, kv_map, needs_grad, docs=None):
        ident = tuple(range(q.shape[2]))
        k, v = self.heads(q.shape[2]).gather(k, v)
        return self.inner.forward(q, k, v, causal=causal, scale=scale, kv_map=ident, needs_grad=needs_grad, **doc_kwargs(docs))

    def backward_per_head(self, state, dout):
        """``dq`` and the per-query-head ``dk``, ``dv`` (``[B, S, hq, D]``), not yet summed."""
        return self.inner.backward(state, dout)

    def backward(self, state, dout):
        dq, dk, dv = self.backward_per_head(state, dout)
        return (dq, *self.heads(dk.shape[2]).scatter(dk, dv))


def for_rank(backend, kv_map: Sequence[int]):
    """The backend a rank runs: ``SharedKV`` around built-in (``AttentionBackend``)
    backends when ``shares_one_kv(kv_map)``; the backend itself otherwise."""
    if isinstance(backend, AttentionBackend) and shares_one_kv(kv_map):
        return SharedKV(backend)
    return backend


BACKENDS = {"sdpa": SDPABackend, "math": MathBackend, "flash": FlashBackend}


def flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def named_backend(attn_fn: str | None, device: torch.device, dtype: torch.dtype):
    """The built-in backend for ``attn_fn`` ``None`` (flash-attn on CUDA in half precision
    when importable, else SDPA) or a name of ``BACKENDS``, for tensors on ``device`` of ``dtype``."""
    if attn_fn is None:
        use_flash = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_available()
        return FlashBackend() if use_flash else SDPABackend()
    if attn_fn not in BACKENDS:
        raise ValueError(f"ulysses_attention: attn_fn={attn_fn!r}; expected one of {sorted(BACKENDS)}, a callable or a backend")
    if attn_fn == "flash" and not flash_available():
        raise ValueError("ulysses_attention: attn_fn='flash' but flash_attn is not importable")
    return BACKENDS[attn_fn]()


def backend_of(attn_fn, device: torch.device, dtype: torch.dtype):
    """The backend object for ``attn_fn`` (None, a name, a callable or a backend) for tensors on
    ``device`` of ``dtype`` (a name: ``named_backend``; an object is its own answer)."""
    if attn_fn is None or isinstance(attn_fn, str):
        return named_backend(attn_fn, device, dtype)
    if hasattr(attn_fn, "forward") and hasattr(attn_fn, "backward"):
        return attn_fn
    if callable(attn_fn):
        return CallableBackend(attn_fn)
    raise TypeError(f"ulysses_attention: attn_fn must be None, a name, a callable or a backend, got {type(attn_fn).__name__}")


def resolve_backend(attn_fn, q: torch.Tensor):
    """``backend_of`` for ``q``'s device and dtype."""
    return backend_of(attn_fn, q.device, q.dtype)
