"""Packed-documents attention kernels: every document of a packed sequence in one call.

After the exchange a rank holds, for its heads, the whole packed sequence: ``q``
``[1, Tq, hq, D]``, ``k`` ``[1, Tk, hkv, D]``, ``v`` ``[1, Tk, hkv, Dv]`` (uniform grouped heads,
``hq % hkv == 0``: ``backends`` gathers a non-uniform map first). Query document ``i`` is rows
``[cu_q[i], cu_q[i+1])``, key document ``i`` rows ``[cu_k[i], cu_k[i+1])`` (``Documents``; equal
for a packed sequence, different for the rectangles of a ring step). Query row ``r`` of a
document sees the keys of the same document only; with ``causal`` those at document position
``<= r + (Lk - Lq)`` (flash-attn's bottom-right alignment; ``Lq == Lk`` on a packed sequence);
with a sliding ``window`` ``w`` (``DocMask``, causal only) the last ``w`` of those (itself and
the ``w - 1`` before it, transformers' ``sliding_window``); with ``softcap`` ``c`` the scaled
scores pass through ``c * tanh(s / c)`` first (Gemma 2).

Kernels (``KERNELS``; ``backends.packed_kernel`` chooses one):

    flash   flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16; windows, softcap, LSE)
    varlen  torch's ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA sm_80+,
            fp16/bf16; windows where its signature has ``window_size``; grouped heads natively
            where it has ``enable_gqa``, else KV expanded on this rank's head shard; LSE)
    cudnn   cuDNN's ragged attention, ``aten._cudnn_attention_forward``/``_backward`` with
            ``cum_seq_q``/``cum_seq_k`` (what torch's nested-tensor SDPA runs), called directly
            from one ``autograd.Function``: CUDA sm_80+, fp16/bf16, causal or bidirectional
            documents (no window, no softcap; causal only where query and key documents are
            equal: a packed sequence, not a ring step's rectangles), head dims multiples of 8
            up to 128, KV expanded on this rank's head shard; LSE. Its backward is cuDNN's from
            torch 2.13, FA2's varlen backward before (``CUDNN_RAGGED_BACKWARD_SINCE``). Forced
            only (``packed=`` or ``ULYSSES_KERNELS_PACKED=cudnn``) until a GPU record shows it
            exact and fastest
    fa2     torch's FlashAttention-2 varlen ops (``aten._flash_attention_forward``/``_backward``)
            called directly: ``varlen``'s kernel without its custom-op wrapper (no window, no
            softcap); forced only, as cudnn
    flex    torch's FlexAttention with a block mask built once per (boundaries, device,
            causal, window) (``doc_block_mask``; compiled on CUDA; on the CPU eager and
            forward only, so never picked there automatically; windows, softcap, LSE)
    loop    one dense call per document (SDPA; explicit math for softcap or the LSE): any
            device and dtype, the last resort (NOTE on the H200, 2026-11-27: 5.6-50 TFLOP/s for
            llama3-8b rank 0 of 8 against 550-640 dense, 7 to 295 documents)

``attend`` returns ``[1, Tq, hq, Dv]`` in q's dtype and, with ``lse=True``, the log-sum-exp
``[1, hq, Tq]`` (natural log; the ring merges partial results with it) in the accumulation
dtype: float64 for float64 inputs, else float32.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math

import torch
import torch.nn.functional as F

from .block_masks import doc_block_mask, doc_intervals
from .documents import DocMask, Documents
from .math_attention import math_attention_lse
from .tracing import in_trace

__all__ = ["DocMask", "PackedKernel", "KERNELS", "doc_intervals", "doc_block_mask", "CUDNN_HEAD_DIMS", "cudnn_backward"]

HALF = (torch.float16, torch.bfloat16)


class PackedKernel:
    """One way to run packed-document attention. ``why_not`` returns ``None`` where it runs,
    else why not (a sentence the chooser puts in its errors and ``info`` prints)."""

    name = "base"

    @property
    def label(self) -> str:
        """The name in reports (the benchmark's backend column): what runs, where that is more
        than the name."""
        return self.name

    def why_not(self, device: torch.device, dtype: torch.dtype, mask: DocMask, grad: bool) -> str | None:
        raise NotImplementedError

    def attend(self, q, k, v, docs_q: Documents, docs_k: Documents, mask: DocMask, scale: float, lse: bool = False):
        raise NotImplementedError


def _flash_inputs(q, k, v):
    """``[T, h, D]`` q, k, v as flash kernels take them: one head dim (MLA's narrower v padded:
    zeros add nothing to the scores; the caller cuts the output back to v's head dim), and no
    stride-0 head dim (``backends.SharedKV``'s view of one KV head: materialized on this
    rank's shard, as flash-attn's own GQA backward allocates per-head dK/dV anyway)."""
    w = max(q.shape[-1], v.shape[-1])
    out = []
    for x in (q, k, v):
        x = x if x.stride(1) != 0 or x.shape[1] == 1 else x.contiguous()
        out.append(x if x.shape[-1] == w else F.pad(x, (0, w - x.shape[-1])))
    return out


def _expand_heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[T, h, D]`` -> ``[T, h * g, D]``, head ``j`` repeated ``g`` times in place (what
    ``repeat_interleave(g, dim=1)`` gives): one copy forward and one sum backward, where
    ``repeat_interleave`` builds an index on the device and scatters its gradient back
    with atomics (several launches per call)."""
    t, h, d = x.shape
    return x.unsqueeze(2).expand(t, h, g, d).reshape(t, h * g, d)


def _acc(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The log-sum-exp in the accumulation dtype of inputs of ``dtype`` (``ring.merge.acc_dtype``)."""
    return lse.to(torch.float64 if dtype == torch.float64 else torch.float32)


def _lse_rows(lse: torch.Tensor, docs_q: Documents, hq: int) -> torch.Tensor:
    """A varlen kernel's log-sum-exp as ``[1, hq, Tq]``: ``[hq, Tq]`` (flash-attn >= 2.4,
    torch's varlen_attn) or ``[docs, hq, max_q]`` (older flash-attn, one padded row per document)."""
    if lse.dim() == 2:
        return lse.unsqueeze(0)
    parts = [lse[i, :, : b - a] for i, (a, b) in enumerate(docs_q.spans())]
    return torch.cat(parts, dim=1).unsqueeze(0)


class FlashVarlen(PackedKernel):
    """flash-attn's ``flash_attn_varlen_func`` (``[total, h, D]``, int32 ``cu_seqlens`` on the
    device, cached per boundaries and device: ``Documents.on``)."""

    name = "flash"

    def why_not(self, device, dtype, mask, grad):
        if importlib.util.find_spec("flash_attn") is None:
            return "flash_attn is not installed"
        if device.type != "cuda" or dtype not in HALF:
            return f"needs CUDA fp16/bf16, got {device.type} {dtype}"
        return None

    def attend(self, q, k, v, docs_q, docs_k, mask, scale, lse=False):
        from flash_attn import flash_attn_varlen_func

        dv = v.shape[-1]
        q, k, v = _flash_inputs(q[0], k[0], v[0])
        kw = {} if mask.window is None else {"window_size": (mask.window - 1, 0)}
        if mask.softcap is not None:
            kw["softcap"] = mask.softcap  # flash-attn >= 2.6; older ones raise a TypeError naming it
        out = flash_attn_varlen_func(
            q, k, v, docs_q.on(q.device), docs_k.on(q.device), docs_q.max_seqlen, docs_k.max_seqlen,
            softmax_scale=scale, causal=mask.causal, return_attn_probs=lse, **kw,
        )  # fmt: skip
        if not lse:
            return out[..., :dv].unsqueeze(0)
        out, m, *_ = out
        return out[..., :dv].unsqueeze(0), _acc(_lse_rows(m, docs_q, q.shape[1]), q.dtype)


@functools.lru_cache(maxsize=1)
def _varlen_api():
    """``(varlen_attn, AuxRequest, parameter names)`` of this torch, or ``None`` (torch < 2.10).
    Its signature moved between versions (2.10: ``is_causal``, no ``scale``; 2.11:
    ``scale``, ``window_size``; 2.12: ``enable_gqa``), so calls are built from its parameters."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    fn = getattr(varlen, "varlen_attn", None)
    if fn is None:
        return None
    return fn, getattr(varlen, "AuxRequest", None), frozenset(inspect.signature(fn).parameters)


class TorchVarlen(PackedKernel):
    """torch's ``varlen_attn`` (FlashAttention-2 inside PyTorch, forward and backward)."""

    name = "varlen"

    def why_not(self, device, dtype, mask, grad):
        api = _varlen_api()
        if api is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
        if device.type != "cuda" or dtype not in HALF:
            return f"needs CUDA fp16/bf16, got {device.type} {dtype}"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return f"needs sm_80 or newer, got sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
        if mask.softcap is not None:
            return "takes no softcap"
        if mask.window is not None and "window_size" not in api[2]:
            return f"takes no sliding window in torch {torch.__version__} (no window_size parameter)"
        return None

    def attend(self, q, k, v, docs_q, docs_k, mask, scale, lse=False):
        fn, aux, params = _varlen_api()
        dv = v.shape[-1]
        q, k, v = _flash_inputs(q[0], k[0], v[0])
        kw = {}
        if "scale" in params:
            kw["scale"] = scale
        else:  # torch 2.10: the default 1/sqrt(D) only; fold the requested scale into q
            q = q * (scale * math.sqrt(q.shape[-1]))
        if "window_size" in params:
            left = -1 if mask.window is None else mask.window - 1
            kw["window_size"] = (left, 0) if mask.causal else (-1, -1)
        else:
            kw["is_causal"] = mask.causal
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            else:  # expand this rank's KV heads (its shard only, never the wire's)
                g = q.shape[1] // k.shape[1]
                k, v = _expand_heads(k, g), _expand_heads(v, g)
        if lse:
            kw["return_aux"] = aux(lse=True)
        dev = q.device
        out = fn(q, k, v, docs_q.on(dev), docs_k.on(dev), docs_q.max_seqlen, docs_k.max_seqlen, **kw)
        if not lse:
            return out[..., :dv].unsqueeze(0)
        out, m = out
        return out[..., :dv].unsqueeze(0), _acc(_lse_rows(m, docs_q, q.shape[1]), q.dtype)


# ---- cuDNN's ragged attention ---------------------------------------------------------------------
# The argument names the calls below pass by keyword (torch 2.14's schemas; a torch whose op
# lacks one is refused by ``why_not`` rather than called with the wrong positions: the
# ops' positional order has moved between versions).
_CUDNN_FWD_ARGS = frozenset({"query", "key", "value", "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "compute_log_sumexp",
                             "dropout_p", "is_causal", "return_debug_mask", "scale"})  # fmt: skip
_CUDNN_BWD_ARGS = frozenset({"grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
                             "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale"})  # fmt: skip
CUDNN_HEAD_DIMS = range(8, 129, 8)  # the (padded) head dims the cudnn kernel takes
# cuDNN's ragged backward before pytorch/pytorch#186142 (merged 2026-06) sizes its dQ
# accumulator from ``query.size(2)`` (the head dim on this path) instead of ``max_q``:
# documents longer than the head dim run past it (cudaErrorIllegalAddress, a sticky error that
# ends the process). Torch releases before 2.13 are taken to have it, and there the backward
# runs on torch's FlashAttention-2 varlen backward (``aten._flash_attention_backward``) from
# cuDNN's output and statistics instead.
CUDNN_RAGGED_BACKWARD_SINCE = (2, 13)


def cudnn_backward() -> str:
    """The backward of the cudnn kernel on this torch: ``"cudnn"`` or ``"flash"`` (FA2's varlen
    backward from cuDNN's forward: see ``CUDNN_RAGGED_BACKWARD_SINCE``)."""
    return "cudnn" if torch.torch_version.TorchVersion(torch.__version__) >= CUDNN_RAGGED_BACKWARD_SINCE else "flash"


@functools.lru_cache(maxsize=1)
def _cudnn_ops():
    """``(forward, backward)``: torch's ``aten._cudnn_attention_forward``/``_backward``
    overloads, or a sentence why not (absent, or a schema without an argument passed here)."""
    try:
        fwd = torch.ops.aten._cudnn_attention_forward.default
        bwd = torch.ops.aten._cudnn_attention_backward.default
    except (AttributeError, RuntimeError):
        return f"torch {torch.__version__} has no aten._cudnn_attention_forward/_cudnn_attention_backward"
    for op, want in ((fwd, _CUDNN_FWD_ARGS), (bwd, _CUDNN_BWD_ARGS)):
        missing = sorted(want - {a.name for a in op._schema.arguments})
        if missing:
            return f"torch {torch.__version__}'s {op._schema.name} takes no {', '.join(missing)}"
    if cudnn_backward() == "flash":
        try:
            fa = torch.ops.aten._flash_attention_backward.default
        except (AttributeError, RuntimeError):
            return f"torch {torch.__version__} has no aten._flash_attention_backward (the cudnn kernel's backward before torch 2.13)"
        why = _flash_backward_schema(fa)  # called positionally: the seed's and offset's names moved between versions
        if why:
            return why
        bwd = _flash_backward(fa)
    return fwd, bwd


def _flash_backward(fa):
    """A stand-in for cuDNN's ragged backward (its keyword arguments) that runs FA2's varlen
    backward ``fa`` from cuDNN's output and statistics (``[Tq, h, 1]`` -> FA2's ``[h, Tq]``;
    both the natural-log log-sum-exp of the scaled scores). No dropout: the seed and offset
    FA2 takes are not read (torch's own varlen_attn passes zeros and an empty tensor)."""

    def bwd(*, grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
            dropout_p, is_causal, scale):  # fmt: skip
        lse = _cudnn_lse(logsumexp, query.shape[0], query.shape[1]).contiguous()
        rng = torch.zeros(2, dtype=torch.uint64, device=query.device)
        unused = torch.empty(0, device=query.device)
        return fa(grad_out, query, key, value, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, rng, unused, scale=scale)

    return bwd


def _cudnn_lse(lse: torch.Tensor, tq: int, h: int) -> torch.Tensor:
    """A ragged op's softmax statistics as ``[h, Tq]``: cuDNN's ``[Tq, h, 1]``, or FA2's ``[h, Tq]`` as they are."""
    if tuple(lse.shape) == (tq, h, 1):
        return lse[..., 0].t()
    if tuple(lse.shape) == (h, tq):
        return lse
    raise RuntimeError(f"packed documents: the ragged op returned a log-sum-exp of shape {list(lse.shape)}; expected [{tq}, {h}, 1] or [{h}, {tq}]")


@functools.lru_cache(maxsize=1)
def _fa2_ops():
    """``(forward, backward)``: torch's FlashAttention-2 varlen ops (``aten._flash_attention_forward``/
    ``_backward``, what ``varlen_attn`` runs on a torch without cuDNN's varlen path) behind
    cuDNN's keyword interface (``_cudnn_ops``), or a sentence why not. Called positionally (the
    names of their later arguments moved between versions), after checking those positions."""
    try:
        fwd = torch.ops.aten._flash_attention_forward.default
        bwd = torch.ops.aten._flash_attention_backward.default
    except (AttributeError, RuntimeError):
        return f"torch {torch.__version__} has no aten._flash_attention_forward/_flash_attention_backward"
    names = [a.name for a in fwd._schema.arguments]
    if names[:10] != ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "return_debug_mask"] or (
        "scale" not in names
    ):
        return f"torch {torch.__version__}'s aten::_flash_attention_forward has an unexpected schema: {fwd._schema}"
    why = _flash_backward_schema(bwd)
    if why:
        return why

    def forward(*, query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, compute_log_sumexp, dropout_p, is_causal,
                return_debug_mask, scale):  # fmt: skip
        out, lse, rng, unused, _ = fwd(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, False, scale=scale)
        return out, lse, None, None, max_q, max_k, rng, unused, None

    return forward, _flash_backward(bwd)


def _flash_backward_schema(fa) -> str | None:
    names = [a.name for a in fa._schema.arguments]
    if names[:12] != ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                      "is_causal"] or "scale" not in names:  # fmt: skip
        return f"torch {torch.__version__}'s aten::_flash_attention_backward has an unexpected schema: {fa._schema}"
    return None


class _Ragged(torch.autograd.Function):
    """``(out [Tq, h, D], lse)`` of one ragged attention op pair (``ops()``: ``_cudnn_ops`` or
    ``_fa2_ops``, cuDNN's keywords) over contiguous ``[T, h, D]`` q, k, v (as many KV heads as
    query heads) and int32 device boundaries; the backward gets what the forward returned (the
    statistics, the dropout seed and offset). One op call per direction and nothing on the
    host (no custom-op wrapper, no sync): the per-call cost is the launches."""

    @staticmethod
    def forward(ctx, ops, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, stats: bool):
        fwd, _ = ops()
        res = fwd(query=q, key=k, value=v, attn_bias=None, cum_seq_q=cu_q, cum_seq_k=cu_k, max_q=max_q, max_k=max_k, compute_log_sumexp=stats,
                  dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale)  # fmt: skip
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu_q, cu_k)
        ctx.ops, ctx.args = ops, (max_q, max_k, causal, scale)
        ctx.mark_non_differentiable(lse)  # as torch's varlen_attn: the LSE is an output to read, not to differentiate
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        _, bwd = ctx.ops()
        q, k, v, out, lse, seed, offset, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, causal, scale = ctx.args
        dq, dk, dv = bwd(grad_out=dout.contiguous(), query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed, philox_offset=offset,
                         attn_bias=None, cum_seq_q=cu_q, cum_seq_k=cu_k, max_q=max_q, max_k=max_k, dropout_p=0.0, is_causal=causal,
                         scale=scale)  # fmt: skip
        return None, dq, dk, dv, None, None, None, None, None, None, None


class CudnnRagged(PackedKernel):
    """cuDNN's ragged attention (``aten._cudnn_attention_forward``/``_backward`` with
    ``cum_seq_q``/``cum_seq_k``), the kernel behind dense SDPA's fastest rows on Hopper,
    without torch's custom-op wrapper (``_Ragged``)."""

    name = "cudnn"
    head_dims = CUDNN_HEAD_DIMS
    needs_cudnn = True

    @staticmethod
    def ops():
        return _cudnn_ops()

    @property
    def label(self) -> str:
        return "cudnn" if cudnn_backward() == "cudnn" else "cudnn-fwd+fa2-bwd"

    def why_not(self, device, dtype, mask, grad):
        ops = self.ops()
        if isinstance(ops, str):
            return ops
        if device.type != "cuda" or dtype not in HALF:
            return f"needs CUDA fp16/bf16, got {device.type} {dtype}"
        if self.needs_cudnn and not torch.backends.cudnn.is_available():
            return "cuDNN is not available in this torch"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return f"needs sm_80 or newer, got sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}"
        if mask.softcap is not None:
            return "takes no softcap"
        if mask.window is not None:
            return "takes no sliding window"
        return None

    def check_documents(self, docs_q: Documents, docs_k: Documents, mask: DocMask):
        if mask.causal and docs_q.cu_seqlens != docs_k.cu_seqlens:
            raise ValueError(
                "packed documents: kernel 'cudnn' runs causal documents whose query and key boundaries are equal (a packed "
                "sequence), not a ring step's rectangles (flash-attn's bottom-right causal alignment is not cuDNN's)"
            )

    def attend(self, q, k, v, docs_q, docs_k, mask, scale, lse=False):
        self.check_documents(docs_q, docs_k, mask)
        dv = v.shape[-1]
        q, k, v = _flash_inputs(q[0], k[0], v[0])
        if q.shape[-1] not in self.head_dims:
            raise ValueError(f"packed documents: kernel {self.name!r} takes head dims that are multiples of 8 up to {self.head_dims[-1]}, got {q.shape[-1]}")
        if q.shape[1] != k.shape[1]:  # this rank's KV heads expanded on its shard (autograd sums their gradients back)
            g = q.shape[1] // k.shape[1]
            k, v = _expand_heads(k, g), _expand_heads(v, g)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dev = q.device
        cu_q, cu_k = docs_q.on(dev), docs_k.on(dev)
        # The statistics always ([Tq, h] floats): a forward without them returns an undefined
        # tensor where the Function saves and marks one, and no-grad calls are not where time goes.
        out, m = _Ragged.apply(type(self).ops, q, k, v, cu_q, cu_k, docs_q.max_seqlen, docs_k.max_seqlen, mask.causal, float(scale), True)
        if not lse:
            return out[..., :dv].unsqueeze(0)
        return out[..., :dv].unsqueeze(0), _acc(_cudnn_lse(m, q.shape[0], q.shape[1]), q.dtype).unsqueeze(0)


class Fa2Ragged(CudnnRagged):
    """torch's FlashAttention-2 varlen ops called directly (``_fa2_ops``): the kernel of the
    ``varlen`` row on torch 2.11 without ``varlen_attn``'s custom-op wrapper, so that the two
    rows side by side measure that wrapper's per-call cost. Bottom-right causal (ring
    rectangles too); no window (the ``varlen`` kernel has them), no softcap."""

    name = "fa2"
    head_dims = range(8, 257, 8)
    needs_cudnn = False

    @staticmethod
    def ops():
        return _fa2_ops()

    @property
    def label(self) -> str:
        return "fa2"

    def check_documents(self, docs_q, docs_k, mask):
        return None


# ---- FlexAttention (its documents' block masks: block_masks.py) ---------------------------------
@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Default dynamism: a second sequence length recompiles once with dynamic sizes, later
    # ones reuse it (a training run's fixed length compiles once).
    return torch.compile(flex_attention)


class Flex(PackedKernel):
    """FlexAttention (``torch.nn.attention.flex_attention``) with the documents' block mask;
    compiled on CUDA (the first call per shape compiles: tens of seconds), eager on the CPU
    (where torch computes the forward only, over the dense mask)."""

    name = "flex"

    def why_not(self, device, dtype, mask, grad):
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            return f"torch {torch.__version__} has no FlexAttention"
        if in_trace():
            return "not inside torch.compile's trace (its block mask is built and cached eagerly)"
        if device.type == "cuda":
            return None if importlib.util.find_spec("triton") is not None else "needs triton on CUDA"
        if grad:
            return f"torch runs FlexAttention's backward on CUDA only, not on {device.type}"
        return None

    def attend(self, q, k, v, docs_q, docs_k, mask, scale, lse=False):
        from torch.nn.attention import flex_attention as fa

        block_mask = doc_block_mask(docs_q, docs_k, q.device, mask)
        score_mod = None
        if mask.softcap is not None:
            cap = float(mask.softcap)

            def score_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)

        fn = _compiled_flex() if q.device.type == "cuda" else fa.flex_attention
        kw = {"score_mod": score_mod, "block_mask": block_mask, "scale": scale, "enable_gqa": q.shape[2] != k.shape[2]}
        if lse:
            if "return_aux" in inspect.signature(fa.flex_attention).parameters:
                kw["return_aux"] = fa.AuxRequest(lse=True)
            else:
                kw["return_lse"] = True
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
        if not lse:
            return out.transpose(1, 2)
        out, aux = out
        m = aux if isinstance(aux, torch.Tensor) else aux.lse
        return out.transpose(1, 2), _acc(m, q.dtype)


# ---- the per-document loop ----------------------------------------------------------------------
def _dense(q, k, v, causal: bool, window: int | None, scale: float):
    """SDPA over one document pair (``[1, L, h, D]``), bottom-right causal, with a window as a
    boolean mask of that document only."""
    lq, lk = q.shape[1], k.shape[1]
    attn_mask, is_causal = None, causal
    if causal and (window is not None or lq != lk):
        i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        j = torch.arange(lk, device=q.device)[None, :]
        attn_mask = (j <= i) & (j > i - window) if window is not None else j <= i
        is_causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # fmt: skip
    return out.transpose(1, 2)


def _math_lse(q, k, v, mask: DocMask, scale: float):
    """Explicit attention of one document pair with the log-sum-exp (windows and softcap)."""
    if mask.window is None and mask.softcap is None:
        return math_attention_lse(q, k, v, mask.causal, scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = q.shape[2] // k.shape[2]
    kx, vx = (x.to(acc).repeat_interleave(g, dim=2) for x in (k, v))
    s = torch.einsum("bshd,bthd->bhst", q.to(acc), kx) * scale
    if mask.softcap is not None:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    lq, lk = q.shape[1], k.shape[1]
    if mask.causal:
        i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        j = torch.arange(lk, device=q.device)[None, :]
        keep = (j <= i) if mask.window is None else (j <= i) & (j > i - mask.window)
        s = s.masked_fill(~keep, float("-inf"))
    m = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(m), torch.zeros_like(m), m).unsqueeze(-1))
    return torch.einsum("bhst,bthd->bshd", p, vx), m


class Loop(PackedKernel):
    """One dense call per document: SDPA (a window as its mask), explicit math for softcap or
    the log-sum-exp. Runs everywhere; its Python loop is what the other kernels replace."""

    name = "loop"

    def why_not(self, device, dtype, mask, grad):
        return None

    def attend(self, q, k, v, docs_q, docs_k, mask, scale, lse=False):
        outs, lses = [], []
        for (a, b), (c, d) in zip(docs_q.spans(), docs_k.spans()):
            qd, kd, vd = q[:, a:b], k[:, c:d], v[:, c:d]
            if lse or mask.softcap is not None:
                o, m = _math_lse(qd, kd, vd, mask, scale)
                outs.append(o.to(q.dtype))
                lses.append(_acc(m, q.dtype))
            else:
                outs.append(_dense(qd, kd, vd, mask.causal, mask.window, scale))
        out = torch.cat(outs, dim=1)
        return (out, torch.cat(lses, dim=2)) if lse else out


# In the chooser's report order (``backends.packed_report``); what is picked by default is
# ``backends.PACKED_DEFAULT``.
KERNELS: dict[str, PackedKernel] = {k.name: k for k in (FlashVarlen(), TorchVarlen(), CudnnRagged(), Fa2Ragged(), Flex(), Loop())}
