"""The ``"ulysses"`` mask function and the global mask it stands for.

transformers calls a model's mask function once per forward per layer type, with the local
sizes; under Ulysses each rank attends over the global sequence after the exchange. So the mask
function (``ulysses_mask``, registered in ``AttentionMaskInterface``) records the layer type's
pattern (causal, sliding-window, chunked, bidirectional) as a ``_GlobalMask``, and the attention
call builds that mask over global positions once per step (docs/hf.md, "Masks: built once per
step from global positions"); what cannot be rebuilt raises."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..documents import Documents, document_ids
from ..tracing import in_trace
from .step import HFIntegrationError, SequenceShard


@dataclass(frozen=True, eq=False)
class _GlobalMask:
    """The mask one layer type asked for, as the ``"ulysses"`` mask function records it.

    transformers calls the mask function once per forward per layer type, with the
    *local* sizes; after the exchange each rank attends over the global sequence, whose
    length only the attention call knows (from the step's ``SequenceShard``). So the mask
    function returns this record (no tensor) for a sliding window, ``None`` for plain
    causal (the attention call then uses ``_GlobalMask(None, {})``), and ``build`` makes
    the global mask in the attention call, with transformers' mask function for the
    configured implementation, over global indices ``0 .. total-1``: once per step per
    layer type (cached on the shard), never gathered.

    ``window``: ``None`` for plain causal, else the sliding window (a token sees itself and
    the ``window - 1`` before it). ``mask_kwargs``: what the mask function was called with,
    minus the sizes, the dtype and the device.
    """

    window: int | None
    mask_kwargs: dict
    packed: bool = False  # transformers saw restarting positions on this rank (packed documents)
    causal: bool = True  # False: bidirectional (an encoder's mask; its window is a distance, both ways)
    chunk: int | None = None  # chunked causal attention (Llama 4): tokens attend within chunks of this many
    traced: bool = False  # made while torch.compile traced the model (the attention call refuses it)

    def covers(self, total: int) -> bool:
        """The mask hides nothing over ``total`` tokens but the causal order (no window, or
        one that long: a causal window of ``w`` tokens, a bidirectional one of distance ``w``;
        no chunk shorter than the sequence)."""
        if self.chunk is not None and self.chunk < total:
            return False
        return self.window is None or self.window >= (total if self.causal else total - 1)

    def documents(self, shard: SequenceShard) -> Documents | None:
        """The documents the mask overlays: the step's, each cut into chunks of ``chunk`` tokens
        counted from the document's start (a chunked layer attends within one: over an unpacked
        sequence transformers' chunks of indices, in a packed one each document's chunks as the
        document alone has them)."""
        if self.chunk is None or self.chunk >= shard.total:
            return shard.documents
        spans = shard.documents.spans() if shard.documents is not None else [(0, shard.total)]
        cuts = sorted({c for a, b in spans for c in range(a, b, self.chunk)} | {shard.total})
        return Documents(tuple(cuts), max(b - a for a, b in zip(cuts[:-1], cuts[1:])))

    def build(self, impl: str, shard: SequenceShard, dtype: torch.dtype, device: torch.device):
        """The mask ``impl``'s attention expects over the global sequence: what one process
        would build for ``shard.total`` tokens (``None`` where it needs none: sdpa's causal
        flag, flash attention's window parameter, an implementation without a mask function)."""
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        if impl not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # as transformers does
            return None
        key = (impl, self.window, self.causal, self.chunk, self.mask_kwargs.get("allow_is_causal_skip", True), dtype, device)
        if key not in shard._masks:
            # Batch 1: every row of the batch has the same mask (no padding), broadcast by the attention.
            shard._masks[key] = ALL_MASK_ATTENTION_FUNCTIONS[impl](
                batch_size=1, q_length=shard.total, kv_length=shard.total, q_offset=0, kv_offset=0,
                attention_mask=None, dtype=dtype, device=device, **self._with_documents(shard, device),
            )  # fmt: skip
        return shard._masks[key]

    def _with_documents(self, shard: SequenceShard, device: torch.device) -> dict:
        """The mask keywords (the mask function: the recorded one, else causal or
        bidirectional by ``causal``), for a packed batch with the step's global documents overlaid
        (transformers' packed-sequence mask over global document ids: a token sees only its
        own document; the window counts global indices, which within a document are its
        positions)."""
        from transformers import masking_utils as mu

        base = mu.causal_mask_function if self.causal else mu.bidirectional_mask_function
        kwargs = {"mask_function": base, **self.mask_kwargs}
        if not self.causal:
            kwargs.setdefault("allow_is_bidirectional_skip", True)  # None when nothing is hidden: sdpa's is_causal=False
        documents = self.documents(shard)
        if documents is None:
            return kwargs
        ids = document_ids(documents.cu_seqlens, device).unsqueeze(0)
        overlay = mu.and_masks(mu.packed_sequence_mask_function(ids), kwargs["mask_function"])
        return {**kwargs, "mask_function": overlay, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}


def _layer_mask(module, attention_mask) -> _GlobalMask:
    """The layer's ``_GlobalMask`` (plain causal when the mask function returned none); a
    tensor mask (a prepared 4-D mask given to the model) cannot be honored across shards."""
    if isinstance(attention_mask, _GlobalMask):
        return attention_mask
    if attention_mask is None:
        return _GlobalMask(None, {})
    shape = list(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
    raise HFIntegrationError(
        f"{type(module).__name__}: an explicit attention mask reached sequence-parallel attention ({shape}); "
        "the mask is rebuilt over the global sequence from the model's causal or sliding-window pattern: "
        "drop attention_mask (use labels=-100 for padding)"
    )


def ulysses_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """Mask function for ``AttentionMaskInterface``: record the layer type's mask, build nothing.

    Called once per forward per layer type (``layer_types``: ``full_attention``,
    ``sliding_attention``, ``chunked_attention``) with the local sizes. Returns ``None`` for
    plain causal (what the attention call assumes when it gets no mask, and what any model code
    passes on safely) and a ``_GlobalMask`` for a sliding window, a chunk (Llama 4) or
    bidirectional attention; the attention call turns either into the global mask
    (``_GlobalMask.build``). What cannot be rebuilt over the global sequence raises: a KV
    cache, a padding mask, and other masks (custom overlays).
    transformers' wrapper for packed sequences (restarting positions on this rank) is taken
    off (``_unpacked``): the attention call takes the documents from the step's shard.
    """
    if int(q_offset) or int(kv_offset) or q_length != kv_length:
        raise HFIntegrationError(
            f"sequence-parallel attention got a KV cache (query offset {int(q_offset)}, {kv_length} keys for "
            f"{q_length} queries): generation with past_key_values / use_cache=True is not supported; "
            "run the model with use_cache=False (ShardedBatch.model_inputs() does)"
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise HFIntegrationError(
            "sequence-parallel attention got a padding attention_mask with masked tokens; padding is not "
            "supported as a mask: for a causal model drop attention_mask and set the padded labels to -100 "
            "(shard_batch does this); for a bidirectional one (an encoder) pack the sequences instead "
            "(shard_batch(..., cu_seqlens=...): each attends only within itself)"
        )
    if in_trace():
        # transformers marks every mask packed while tracing (find_packed_sequence_indices cannot read the
        # positions then): the attention call refuses a traced model by name (refuse_compiled).
        return _GlobalMask(None, {}, traced=True)
    mask_function, packed = _unpacked(mask_function)
    chunk = _chunk_of(mask_function)
    if chunk is not None:
        return _GlobalMask(None, {}, packed, chunk=chunk)
    window, causal = _window_of(mask_function)
    if window is None and causal:
        return _GlobalMask(None, {}, packed=True) if packed else None
    if window is None:
        return _GlobalMask(None, {}, packed, causal=False)
    kept = {n: a for n, a in kwargs.items() if n not in ("dtype", "device")}
    return _GlobalMask(window, {**kept, "mask_function": mask_function}, packed, causal)


def _unpacked(mask_function) -> tuple[Callable, bool]:
    """``(mask function, packed)``: transformers wraps the layer's mask function for packed
    sequences when this rank's position ids restart (``packed_sequence_compatibility_function``:
    a document overlay and positions remapped); the attention call takes the documents from
    the step's shard instead (global, not this rank's view), so the wrapper is taken off."""
    from transformers import masking_utils as mu

    parts = _closure(mask_function, mu.and_masks(mu.causal_mask_function)).get("mask_functions")
    if isinstance(parts, tuple) and len(parts) == 2:
        overlay = mu.packed_sequence_mask_function(None)
        remap = getattr(mu, "remap_positions_for_packed_sequence", None)
        if remap is not None:  # transformers 5.23: and_masks(overlay, remap(mask function))
            wrapped = _closure(parts[1], remap(mu.causal_mask_function, None))
            if "packed_sequence_mask" in _closure(parts[0], overlay) and "mask_function" in wrapped:
                return wrapped["mask_function"], True
        # older (5.17: no remapping): and_masks(mask function, overlay)
        if "packed_sequence_mask" in _closure(parts[1], overlay):
            return parts[0], True
    return mask_function, False


def _chunk_of(mask_function) -> int | None:
    """The chunk size of transformers' chunked causal mask function (Llama 4's chunked layers:
    ``and_masks(chunked_overlay(size, left_padding), causal)``, no left padding), else ``None``."""
    from transformers import masking_utils as mu

    overlay = getattr(mu, "chunked_overlay", None)
    parts = _closure(mask_function, mu.and_masks(mu.causal_mask_function)).get("mask_functions")
    if overlay is None or not (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is mu.causal_mask_function):
        return None
    found = _closure(parts[0], overlay(1, None))
    size, padding = found.get("chunk_size"), found.get("left_padding")
    if not isinstance(size, int) or size <= 0:
        return None
    if isinstance(padding, torch.Tensor) and bool(padding.any()):
        raise HFIntegrationError("sequence-parallel attention got a chunked mask over left padding; drop the padding attention_mask")
    return size


def _window_of(mask_function) -> tuple[int | None, bool]:
    """``(window, causal)`` of one of transformers' four position-only mask functions
    (recognised by their code, not their names): causal ``(None, True)``, sliding-window
    causal ``(w, True)`` (a token sees itself and the ``w - 1`` before it), bidirectional
    ``(None, False)`` and sliding-window bidirectional ``(w, False)`` (tokens at distance
    ``<= w``, ModernBERT's local layers). Anything else raises: only these are known to
    depend on positions alone."""
    from transformers import masking_utils as mu

    if mask_function is None or mask_function is mu.causal_mask_function:
        return None, True
    if mask_function is mu.bidirectional_mask_function:
        return None, False
    parts = _closure(mask_function, mu.and_masks(mu.causal_mask_function)).get("mask_functions")
    if isinstance(parts, tuple) and len(parts) == 2 and parts[1] in (mu.causal_mask_function, mu.bidirectional_mask_function):
        causal = parts[1] is mu.causal_mask_function
        overlay = mu.sliding_window_overlay(1) if causal else mu.sliding_window_bidirectional_overlay(1)
        window = _closure(parts[0], overlay).get("sliding_window")
        if isinstance(window, int) and window > 0:
            return window, causal
    raise HFIntegrationError(
        "sequence-parallel attention rebuilds causal, bidirectional, sliding-window and chunked masks over the global "
        f"sequence; the model asked for another mask ({getattr(mask_function, '__qualname__', mask_function)!r}: "
        "a custom overlay such as or_mask_function/and_mask_function), which it cannot rebuild"
    )


def _closure(fn, like) -> dict:
    """The closure variables of ``fn`` if it was made by the same code as ``like``, else ``{}``."""
    code = getattr(fn, "__code__", None)
    if code is None or code is not like.__code__ or not fn.__closure__:
        return {}
    return {n: cell.cell_contents for n, cell in zip(code.co_freevars, fn.__closure__)}
