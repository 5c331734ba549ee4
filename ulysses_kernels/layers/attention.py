"""What transformers calls in every layer once ``apply`` has switched a model: the
``"ulysses"`` attention function (``ulysses_attention_forward``; its mask function,
``ulysses_mask``, and the global mask it records live in ``masks``).

One attention call, q/k/v ``[B, H, seq_lens[r], D]``:

    plain causal or plain bidirectional (no window shorter than S, no softcap, no sinks, no
    dropout) and a built-in implementation: the fused ``ulysses_attention`` (SDPA/flash,
    chunked overlap; ``causal=False`` for an encoder)
    packed documents with a sliding window and/or logit softcapping (causal, a built-in
    implementation, no sinks, no dropout): seq_to_head -> this rank's heads over all S
    tokens -> the packed-documents kernel ``backends.packed_kernel`` picks for that mask
    (FlexAttention or flash-attn's varlen on a GPU, the per-document loop elsewhere) ->
    head_to_seq
    otherwise: seq_to_head -> this rank's heads over all S tokens -> the model's own
    attention implementation (eager, sdpa, flash_attention_2/3, a registered one) with
    the model's keywords, per-head sinks sliced to the rank's heads, the layer type's
    mask rebuilt over global positions -> head_to_seq
    Llama 4's chunked layers: one row, the packed-documents kernel over the chunks as
    documents; more rows, the model's eager/sdpa attention with the chunked mask

The settings ``apply`` chose live on each attention module (``_Settings``, made by
``attention_settings``, under ``ATTENTION_SETTINGS_ATTR``); the step's ``SequenceShard`` arrives as the
``ulysses_shard`` keyword. ``sequence_parallel_attention`` is the same call for a model that
``apply`` did not switch (``integrations.deepspeed_alst``), its settings and shard given explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..attention import head_to_seq, seq_to_head, ulysses_attention
from ..backends import resolve_backend
from ..comm import get_communicator
from ..documents import Documents
from ..gqa import expand_kv
from ..math_attention import default_scale
from ..packed import DocMask
from ..plan import HeadPlan, PlanError, more_ranks_than_heads_flat
from ..ring import SPGroups
from ..wire import WireSpec, wire_spec
from .masks import _GlobalMask, _layer_mask
from .step import SHARD_KWARG, STEP_KWARGS, HFIntegrationError, SequenceShard

__all__ = ["ATTN_IMPLEMENTATION", "attention_settings", "sequence_parallel_attention"]

ATTN_IMPLEMENTATION = "ulysses"
ATTENTION_SETTINGS_ATTR = "_ulysses_settings"  # set on each attention module by ``apply``

# Implementations whose plain causal attention (softmax(q k^T * scale) v, no window, no
# softcap, no sinks, no dropout) is exactly what the fused ``ulysses_attention`` computes.
# A call that needs nothing more runs the fused op (its SDPA/flash backends, chunked
# overlap); anything else, or a user's own implementation, runs the model's attention.
_FUSED_IMPLEMENTATIONS = frozenset({"eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention"})


# Implementations whose attention takes the mask ``_GlobalMask.build`` makes as it is: packed
# documents reach them as an overlay of that mask (others, e.g. flash attention, get none).
_MASKED_IMPLEMENTATIONS = frozenset({"eager", "sdpa"})


@dataclass(frozen=True, eq=False)
class _Settings:
    """What ``apply`` chose for one attention module (the group settings are shared by the
    model's modules; ``inner_impl``/``inner_fn`` are the module's own)."""

    group: object
    comm: object
    attn_fn: object
    kernels: object
    chunks: int | str
    check: str
    inner_impl: str = ""  # the implementation the model was configured with ("sdpa", "eager", ...)
    inner_fn: Callable | None = None  # its attention function (for "eager": the model's own)
    wire: WireSpec | None = None  # FP8 on the wire (``wire.wire_spec``): every exchange of every path


class _ConfigView:
    """A model config read through, with ``_attn_implementation`` set to the configured one."""

    def __init__(self, config, impl: str):
        self.__dict__.update(_config=config, _attn_implementation=impl)

    def __getattr__(self, name):
        return getattr(self._config, name)


class _LocalHeads:
    """The model's attention module as its attention function sees it on this rank.

    Every attribute is the module's except ``num_key_value_groups`` (the grouping of this
    rank's heads, which need not be the model's), ``sinks`` (this rank's query heads'
    slice, a view: the gradient reaches the parameter) and ``config`` (a ``_ConfigView``:
    flash attention reads ``config._attn_implementation`` to pick its kernel).
    """

    def __init__(self, module, impl: str, groups: int, heads: slice, q_heads: int):
        self.__dict__.update(_module=module, num_key_value_groups=groups, config=_ConfigView(module.config, impl))
        sinks = getattr(module, "sinks", None)
        if sinks is not None:
            self.__dict__["sinks"] = _head_slice(sinks, q_heads, heads, f"{type(module).__name__}.sinks")

    def __getattr__(self, name):
        return getattr(self._module, name)


def _head_slice(t: torch.Tensor, q_heads: int, heads: slice, what: str) -> torch.Tensor:
    """Rows ``heads`` of a per-query-head tensor ``[q_heads, ...]`` (sinks): this rank's."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != q_heads:
        shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise HFIntegrationError(f"{what}: expected one value per query head (shape [{q_heads}, ...]), got {shape}")
    return t[heads]


def _fail_module(module) -> HFIntegrationError:
    return HFIntegrationError(
        f"{type(module).__name__}: the model's attention implementation is {ATTN_IMPLEMENTATION!r} but this "
        "module was not prepared by ulysses_kernels.integrations.hf.apply (call apply(model, group) on the "
        "model that owns it; a config object switched to it by hand, or shared with a model from before apply "
        "copied configs, also lands here: build each model from its own config)"
    )


def ulysses_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers attention function: ``[B, H, s_local, D]`` q/k/v in, ``[B, s_local, Hq, D]`` out.

    k/v arrive un-repeated (GQA). ``attention_mask`` is the ``_GlobalMask`` our mask
    function returned for this layer's type. The keywords are the model's (``scaling``,
    ``dropout``, ``sliding_window``, ``softcap``, ``s_aux``, ...). Plain causal calls of a
    built-in implementation run the fused ``ulysses_attention``; the others run the
    model's own attention function on this rank's heads over the global sequence
    (``_model_attention``).
    """
    settings, shard = _call_context(module, kwargs)
    return _attend(module, settings, shard, _layer_mask(module, attention_mask), query, key, value, kwargs)


def sequence_parallel_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                settings: _Settings, shard: SequenceShard, **kwargs):  # fmt: skip
    """One attention call of a model that ``apply`` did not switch: what the ``"ulysses"``
    attention function does, with the settings and the step's shard given explicitly.

    For callers that intercept a model's own attention implementation (DeepSpeed ALST's
    entry point, ``integrations.deepspeed_alst``), so the model's mask function is not ours: the mask
    of the layer is taken from the model's ``sliding_window`` keyword (``None`` or absent:
    causal) and rebuilt over the global sequence as ``apply``'s mask function would record it.

    Args:
        module: the model's attention module (``scaling``, ``is_causal``, ``head_dim``, ...).
        query, key, value: ``[B, H, seq_lens[rank], D]`` (k/v with the model's KV heads; v's
            head dim may differ from q's and k's: MLA).
        settings: ``attention_settings(...)``, made once (it may own a communicator).
        shard: the step's ``SequenceShard`` (the same on every rank; it caches the step's
            checks and masks, so use one object per step).
        kwargs: the model's keywords (``scaling``, ``dropout``, ``sliding_window``,
            ``softcap``, ``s_aux``, ``position_ids`` (dropped), ...).

    Returns ``(out, None)``, ``out`` ``[B, seq_lens[rank], Hq, Dv]`` (``Dv``: v's head dim).
    """
    window = kwargs.get("sliding_window")
    if window is None:
        mask = _GlobalMask(None, {})
    else:
        from transformers.masking_utils import sliding_window_causal_mask_function

        # local_size: sdpa's mask function skips the mask (plain causal) unless it knows the window.
        mask = _GlobalMask(int(window), {"mask_function": sliding_window_causal_mask_function(int(window)), "local_size": int(window)})
    return _attend(module, settings, shard, mask, query, key, value, kwargs)


def _attend(module, settings: _Settings, shard: SequenceShard, mask: _GlobalMask, query, key, value, kwargs):
    """The attention call of ``ulysses_attention_forward`` once its settings, shard and mask
    are known: the fused op for plain causal or plain bidirectional attention, else the
    model's own attention."""
    name = type(module).__name__
    if mask.traced:
        raise HFIntegrationError(
            f"{name}: torch.compile of a model that hf.apply switched is not supported yet (not validated: transformers "
            "builds its masks differently while tracing); run the model eagerly (ulysses_attention itself compiles: "
            "docs/usage.md)"
        )
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    mask = _causality(name, causal, mask)
    if key.shape[2] != query.shape[2]:
        raise HFIntegrationError(
            f"{name}: {key.shape[2]} keys for {query.shape[2]} queries: cross-attention (encoder-decoder models, "
            "BERT with add_cross_attention) is not supported under sequence parallelism, only self-attention"
        )
    _check_sharded_input(name, shard, settings, query)
    if not causal:
        _check_bidirectional(name, settings, shard)
    docs = _packed(module, settings, shard, mask, kwargs)
    query = _global_temperature(module, shard, query)
    if not _plain(settings, shard, mask, module, kwargs):
        if isinstance(settings.group, SPGroups):
            raise HFIntegrationError(
                f"{name}: with a 2-D group (SPGroups) only plain causal attention runs (the fused op with ring attention); "
                "a sliding window shorter than the sequence, chunks, softcapping, sinks or dropout need a flat group"
            )
        if mask.chunk is not None and not mask.covers(shard.total):
            # Chunked attention (Llama 4): one row, the packed-documents kernel over the chunks as documents (O(S)
            # memory); more rows, the model's eager/sdpa attention with the chunked mask ([1, 1, S, S]).
            doc_mask = _doc_mask(settings, shard, mask, module, kwargs) if query.shape[0] == 1 else None
            if doc_mask is None and settings.inner_impl not in _MASKED_IMPLEMENTATIONS:
                raise HFIntegrationError(
                    f"{name}: chunked attention (chunks of {mask.chunk} tokens over {shard.total}) of a batch of {query.shape[0]} "
                    f"rows runs sequence-parallel on the 'eager' or 'sdpa' implementation (their mask carries the chunks; one "
                    f"row runs the packed-documents kernel); this model runs {settings.inner_impl!r}"
                )
            return _model_attention(module, settings, shard, mask, query, key, value, kwargs, mask.documents(shard), doc_mask), None
        doc_mask = None if docs is None else _doc_mask(settings, shard, mask, module, kwargs)
        return _model_attention(module, settings, shard, mask, query, key, value, kwargs, docs, doc_mask), None

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # -> [B, s_local, H, D]
    scaling = kwargs.get("scaling")
    sig = ("fused", tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, scaling, causal, docs)  # v: MLA's own head dim
    check = _check_now(settings, shard, sig)
    out = ulysses_attention(
        q, k, v, settings.group, causal=causal, softmax_scale=scaling, seq_lens=shard.seq_lens,
        attn_fn=settings.attn_fn, comm=settings.comm, kernels=settings.kernels, chunks=settings.chunks, check=check,
        cu_seqlens=docs, wire_dtype=settings.wire,
    )  # fmt: skip
    if check:
        shard._checked.add(sig)
    return out, None


def _global_temperature(module, shard: SequenceShard, query: torch.Tensor) -> torch.Tensor:
    """Llama 4's NoPE layers scale each query by a factor of its position (attention temperature
    tuning: ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, in float32), with ``p`` the
    index the module counts in the hidden states it sees: on a shard, the shard's own from 0.
    Rescaled here to the global index (in a packed document: its index in the document, as the
    document alone has it). ``query`` ``[B, H, s_local, D]``."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    if shard.ring_layout is not None:
        raise HFIntegrationError(f"{type(module).__name__}: attention temperature tuning (NoPE layers) under a zigzag 2-D layout is not supported")
    local = torch.arange(query.shape[2], device=query.device)
    index = local + shard.start
    if shard.documents is not None and shard.documents.rows > 1:
        raise HFIntegrationError(f"{type(module).__name__}: attention temperature tuning (NoPE layers) with packed documents needs batch 1")
    if shard.documents is not None:
        starts = torch.tensor(shard.documents.cu_seqlens[:-1], device=query.device)
        index = index - starts[torch.searchsorted(starts, index, right=True) - 1]

    def scale(p):  # Llama4TextAttention's, in float32 as the model computes it
        return torch.log1p(torch.floor((p.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    ratio = scale(index).double() / scale(local).double()
    return (query * ratio.to(torch.promote_types(query.dtype, torch.float32)).view(1, 1, -1, 1)).to(query.dtype)


def _causality(name: str, causal: bool, mask: _GlobalMask) -> _GlobalMask:
    """The layer's mask, agreeing with the attention call's causality (``is_causal``, or the
    module's). A bidirectional layer that got no mask (a vision tower builds none) attends
    over everything; a mask and a call that disagree (a causal mask in a bidirectional
    layer, or the reverse) would be honoured by neither path, so they raise."""
    if mask.causal == causal:
        return mask
    if not causal and mask.window is None and not mask.mask_kwargs:
        return replace(mask, causal=False)
    raise HFIntegrationError(
        f"{name}: the attention call is {'causal' if causal else 'bidirectional (is_causal=False)'} but the model built "
        f"a {'causal' if mask.causal else 'bidirectional'} mask for it; sequence-parallel attention needs the two to agree"
    )


def _check_bidirectional(name: str, settings: _Settings, shard: SequenceShard) -> None:
    """What bidirectional attention cannot honour: padding that every token would attend to
    (causal attention never looks ahead at it), and the ring level (not tested non-causal)."""
    if isinstance(settings.group, SPGroups):
        raise HFIntegrationError(
            f"{name}: bidirectional attention runs on a flat sequence-parallel group; a 2-D group (SPGroups, Ulysses x ring) supports causal models only"
        )
    if shard.total > shard.valid_len and shard.documents is None:
        raise HFIntegrationError(
            f"{name}: bidirectional attention over a padded batch ({shard.total - shard.valid_len} pad tokens after "
            f"{shard.valid_len}) would let every token attend to the padding; use shard_batch(..., pad=False) (uneven "
            "shards), or pack the batch (position_ids/cu_seqlens: the padding is then a document of its own)"
        )


def _packed(module, settings: _Settings, shard: SequenceShard, mask: _GlobalMask, kwargs) -> Documents | None:
    """The step's documents (``None``: not packed), after checking that this call can honor
    them: plain causal attention (the fused op). The model's mask function saw only this
    rank's positions; the boundaries come from ``shard_batch``, global."""
    if shard.documents is None:
        # A zigzag shard's positions jump at its second segment (transformers sees a packed
        # sequence there); shard_batch made them from the global ones, so they are not.
        if mask.packed and shard.ring_layout is None:
            raise HFIntegrationError(
                f"{type(module).__name__}: position_ids restart inside the sequence (packed documents) but the batch was "
                "not sharded as packed; pass the global position_ids (or cu_seqlens) to shard_batch"
            )
        return None
    plain = _plain(settings, shard, mask, module, kwargs)
    if shard.documents.rows > 1 and not plain:
        raise HFIntegrationError(
            f"{type(module).__name__}: packed documents in a batch of {shard.documents.rows} rows run on plain causal or "
            "bidirectional attention (the fused op); a sliding window, chunked attention, logit softcapping, attention "
            "sinks or dropout with packed documents need batch 1"
        )
    if not plain and settings.inner_impl not in _MASKED_IMPLEMENTATIONS and _doc_mask(settings, shard, mask, module, kwargs) is None:
        raise HFIntegrationError(
            f"{type(module).__name__}: packed documents with a sliding window, logit softcapping, attention sinks, dropout "
            f"or a registered implementation run on the 'eager' or 'sdpa' implementation (their mask carries the "
            f"documents); this model runs {settings.inner_impl!r}"
        )
    return shard.documents


def _plain(settings: _Settings, shard: SequenceShard, mask: _GlobalMask, module, kwargs) -> bool:
    """The call is plain causal (or plain bidirectional) attention over the global sequence
    of a built-in implementation: no window shorter than the sequence, no softcap, no
    sinks, no dropout."""
    window = kwargs.get("sliding_window")
    return (
        settings.inner_impl in _FUSED_IMPLEMENTATIONS
        and mask.covers(shard.total)
        and (window is None or window >= shard.total)
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and getattr(module, "sinks", None) is None
        and not kwargs.get("dropout")
    )


def _doc_mask(settings: _Settings, shard: SequenceShard, mask: _GlobalMask, module, kwargs) -> DocMask | None:
    """The ``DocMask`` of a packed call that a packed-documents kernel runs exactly: causal, a
    built-in implementation and backend, a sliding window (the model's keyword or its mask's,
    the same) and/or a softcap, no sinks, no dropout; ``None`` otherwise (the model's own
    attention then runs, with the documents overlaid on its mask). The mask's function is one
    of transformers' position-only ones (``_window_of``), so causality and the window are all
    of it."""
    window = kwargs.get("sliding_window")
    if mask.window is not None and window is not None and int(window) != mask.window:
        return None
    window = mask.window if window is None else int(window)
    if (
        not mask.causal
        or settings.inner_impl not in _FUSED_IMPLEMENTATIONS
        or not (settings.attn_fn is None or isinstance(settings.attn_fn, str))
        or kwargs.get("s_aux") is not None
        or getattr(module, "sinks", None) is not None
        or kwargs.get("dropout")
    ):
        return None
    softcap = kwargs.get("softcap")
    return DocMask(True, None if window is None or window >= shard.total else window, None if softcap is None else float(softcap))


def _model_attention(module, settings: _Settings, shard: SequenceShard, mask: _GlobalMask, query, key, value, kwargs, docs=None,
                     doc_mask: DocMask | None = None):  # fmt: skip
    """The model's own attention on this rank's heads over the global sequence (with
    ``doc_mask``: the packed-documents kernel for that mask, in its place).

    ``[B, H, s_local, D]`` q/k/v -> ``seq_to_head`` -> ``[B, hq, S, D]`` (``plan.q_ranges[rank]``)
    and the KV heads those use (gathered to one per query head where the rank's heads do
    not group uniformly) -> the configured implementation with every keyword the model
    passed (``s_aux`` and ``module.sinks`` sliced to the rank's heads; ``position_ids``,
    local ones, left out) and the global mask -> ``[B, S, hq, D]`` -> ``head_to_seq`` ->
    ``[B, s_local, Hq, D]``.
    """
    comm, name, q_heads = settings.comm, type(module).__name__, query.shape[1]
    try:
        plan = HeadPlan.build(q_heads, key.shape[1], comm.world_size)
    except PlanError as e:
        if comm.world_size <= q_heads:
            raise
        # The op's own text would suggest make_sp_groups: refused above for this call.
        why = (
            f"this call runs the model's own {settings.inner_impl!r} attention (a window, chunks, softcapping, sinks, dropout "
            "or an implementation other than the fused op), which a 2-D group (make_sp_groups) refuses"
        )
        fix = more_ranks_than_heads_flat(q_heads, comm.world_size, why)
        raise HFIntegrationError(f"{name}: {q_heads} query heads cannot be split over {comm.world_size} ranks: {fix}") from e
    sig = ("model", tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype, query.device)
    check = _check_now(settings, shard, sig)
    q, k, v = seq_to_head(
        *(t.transpose(1, 2) for t in (query, key, value)), group=settings.group, seq_lens=shard.seq_lens, plan=plan,
        comm=comm, kernels=settings.kernels, check=check, wire_dtype=settings.wire,
    )  # fmt: skip
    if check:
        shard._checked.add(sig)
    k, v = expand_kv(k, v, plan.local_kv_map(comm.rank))  # [B, S, hkv, D], uniform groups
    if doc_mask is not None:
        scale = default_scale(q.shape[3], kwargs.get("scaling"))
        kernel = resolve_backend(settings.attn_fn, q).packed_kernel(q, doc_mask)
        out = kernel.attend(q, k, v, docs, docs, doc_mask, scale)
        return head_to_seq(out, plan, group=settings.group, seq_lens=shard.seq_lens, comm=comm, kernels=settings.kernels, wire_dtype=settings.wire)
    heads = slice(*plan.q_ranges[comm.rank])
    local = _LocalHeads(module, settings.inner_impl, q.shape[2] // k.shape[2], heads, q_heads)
    inner = {n: a for n, a in kwargs.items() if n != "position_ids" and n not in STEP_KWARGS}
    if kwargs.get("s_aux") is not None:
        inner["s_aux"] = _head_slice(kwargs["s_aux"], q_heads, heads, f"{name}: s_aux")
    global_mask = mask.build(settings.inner_impl, shard, q.dtype, q.device)
    out = settings.inner_fn(local, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), global_mask, **inner)[0]
    expected = [q.shape[0], shard.total, q.shape[2], v.shape[3]]
    if list(out.shape) != expected:
        raise HFIntegrationError(
            f"{name}: the {settings.inner_impl!r} attention returned shape {list(out.shape)}, expected {expected} "
            "([batch, seq, heads, head_dim] over this rank's heads)"
        )
    return head_to_seq(out, plan, group=settings.group, seq_lens=shard.seq_lens, comm=comm, kernels=settings.kernels, wire_dtype=settings.wire)


def _check_now(settings: _Settings, shard: SequenceShard, sig: tuple) -> bool:
    """Whether this call validates its inputs across ranks (``apply``'s ``check``)."""
    return settings.check == "always" or (settings.check == "step" and sig not in shard._checked)


def _call_context(module, kwargs) -> tuple[_Settings, SequenceShard]:
    """What ``apply`` set on ``module`` and the step's ``SequenceShard`` from the model's kwargs."""
    settings = getattr(module, ATTENTION_SETTINGS_ATTR, None)
    if settings is None:
        raise _fail_module(module)
    shard = kwargs.get(SHARD_KWARG)
    if not isinstance(shard, SequenceShard):
        raise HFIntegrationError(
            f"{type(module).__name__}: the model runs sequence-parallel attention but was called without a sequence shard; "
            "feed it model(**ulysses_kernels.integrations.hf.shard_batch(input_ids, group=group).model_inputs()) "
            "(each rank then holds its slice of the sequence and the global positions); if it was, this attention module "
            "drops the keywords it is given instead of passing them to the attention function (SigLIP's does in "
            "transformers 5.23), so the shard cannot reach it: such a model cannot run sequence-parallel"
        )
    return settings, shard


def _check_sharded_input(name: str, shard: SequenceShard, settings: _Settings, query: torch.Tensor) -> None:
    """The batch was sharded for this rank of ``apply``'s group (for an ``SPGroups``: the
    whole 2-D group), and ``query`` (``[B, H, s_local, D]``) is this rank's shard of it."""
    sp, comm = settings.group, settings.comm
    rank, world = (sp.rank, sp.world_size) if isinstance(sp, SPGroups) else (comm.rank, comm.world_size)
    if (shard.rank, shard.world_size) != (rank, world):
        raise HFIntegrationError(
            f"{name}: the batch was sharded for rank {shard.rank} of {shard.world_size} but apply() was given a group "
            f"in which this process is rank {rank} of {world}; pass the same group to apply and shard_batch"
        )
    layout = sp.seq_layout if isinstance(sp, SPGroups) else "contiguous"
    if (shard.ring_layout or (0, 0, "contiguous"))[2] != layout:
        raise HFIntegrationError(
            f"{name}: the batch was sharded {(shard.ring_layout or (0, 0, 'contiguous'))[2]} but apply() was given a group with "
            f"seq_layout {layout!r}; pass the same SPGroups to apply and shard_batch"
        )
    local = query.shape[2]
    if local != shard.local_len or query.shape[0] != shard.batch_size:
        if local == shard.valid_len and shard.world_size > 1:
            raise HFIntegrationError(
                f"{name}: this rank received the full sequence ({local} tokens) but holds {shard.local_len} of them "
                f"under sequence parallelism (seq_lens {list(shard.seq_lens)}); feed the sharded batch "
                "(ShardedBatch.model_inputs()), not the global one"
            )
        raise HFIntegrationError(
            f"{name}: hidden states [batch {query.shape[0]}, seq {local}] do not match the sharded batch "
            f"[batch {shard.batch_size}, seq {shard.local_len}] (rank {shard.rank}, seq_lens {list(shard.seq_lens)}); "
            "feed exactly the tensors shard_batch returned"
        )


def attention_settings(group=None, *, impl: str = "", fn: Callable | None = None, attn_fn=None, kernels=None,
                       chunks: int | str = 1, check: str = "step", comm=None, wire_dtype=None) -> _Settings:  # fmt: skip
    """The frozen settings of sequence-parallel attention calls (``apply`` makes one per
    model; ``sequence_parallel_attention`` takes one).

    ``group``, ``attn_fn``, ``kernels``, ``chunks``, ``check``, ``comm``, ``wire_dtype``: as
    for ``apply`` (a bad ``wire_dtype`` raises ``HFIntegrationError`` here, before any call).
    ``impl``/``fn``: the model's configured attention implementation and its function (what
    runs on each rank's heads when the call is not plain causal). Resolves the communicator
    once (with ``ULYSSES_KERNELS_NATIVE_NCCL=1`` on an NCCL group making a native one, which
    is collective): make it once, on every rank.
    """
    if check not in ("step", "always", "never"):
        raise HFIntegrationError(f"attention_settings: check expected 'step', 'always' or 'never', got {check!r}")
    wire = wire_spec(wire_dtype, "attention_settings", HFIntegrationError)  # fails where the option is set
    # An SPGroups: the communicator is its Ulysses group's (the ring level makes its own).
    exchange_group = group.ulysses_group if isinstance(group, SPGroups) else group
    return _Settings(group, get_communicator(exchange_group, comm, native=True), attn_fn, kernels, chunks, check, impl, fn, wire)
