"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Llava, Mistral3, ...): the vision
tower runs before the sequence is sharded, the text model runs sequence-parallel.

One step, global sequence of ``S`` tokens (image placeholders included) over ``P`` ranks::

    multimodal_inputs(model, input_ids, pixel_values=..., image_grid_thw=..., ...)
        the model's own code up to its text model, on the whole global batch, on every
        rank (replicated): the token embeddings, the vision tower over every image, the
        image features scattered into the placeholders, the mRoPE positions
        -> inputs_embeds [B, S, hidden], position_ids [3, B, S] (or [B, S]), Qwen3-VL's
           deepstack inputs (visual_pos_masks [B, S], per layer [visual tokens, hidden])
    shard_batch(input_ids, labels, group=group, **that)
        rank r keeps columns [start_r, start_r + seq_lens[r]) of each: an image's tokens may
        lie on two ranks (each keeps its own rows; the vision tower saw the whole image)
    model(**batch.model_inputs())
        inputs_embeds go straight to the text model (no vision tower: the features are in),
        whose attention runs sequence-parallel; the backward of rank r's loss share reaches
        the vision tower through its slice, and sync_gradients sums the shares.

What ``apply`` adds for such a model (``prepare``): only the text model's attention is
switched (the vision tower's bidirectional attention keeps its implementation and runs on
whole images), a pre-hook on the text model hands it the rank's deepstack rows
(``SequenceShard.text_inputs``; Qwen3-VL's model passes them itself, so they cannot travel as
keywords of the top-level forward), and a pre-hook on the top-level model refuses pixel
inputs on a sharded call (the vision tower must run before sharding, on the whole images)
and a sharded call without global positions.
"""

from __future__ import annotations

import inspect

import torch

from .batch import _SHARD_KWARG, HFIntegrationError, SequenceShard

__all__ = ["multimodal_inputs"]

# What a VLM's base model hands its text model that ``shard_batch`` shards (the others must be
# unset: a prepared mask or a KV cache cannot be cut along the sequence).
_SHARDED = ("inputs_embeds", "position_ids", "visual_pos_masks", "deepstack_visual_embeds")
_UNSET = ("input_ids", "attention_mask", "past_key_values")
_HOOKS_ATTR = "_ulysses_multimodal_hooks"  # on the text model: the handles of apply's hooks


class _Captured(Exception):
    """Stops the model at its text model's entry once its inputs are recorded."""


def text_model(model):
    """The submodule that is the text model of a vision-language ``model`` (the
    ``PreTrainedModel`` built from ``model.config.get_text_config()``), or ``None`` for a
    text-only model (whose config is its text config)."""
    from transformers import PreTrainedModel

    text = model.config.get_text_config()
    if text is model.config:
        return None
    for m in model.modules():
        if m is not model and isinstance(m, PreTrainedModel) and m.config is text:
            return m
    raise HFIntegrationError(
        f"{type(model).__name__}: found no submodule built from its text config ({type(text).__name__}), so the text model to run sequence-parallel is unknown"
    )


def text_config_key(model) -> str:
    """The name of the text config among ``model.config``'s sub-configs (``"text_config"``)."""
    text = model.config.get_text_config()
    for key in getattr(model.config, "sub_configs", {}):
        if getattr(model.config, key, None) is text:
            return key
    raise HFIntegrationError(f"{type(model.config).__name__}: its text config is not one of its sub_configs {list(model.config.sub_configs)}")


def multimodal_inputs(model, input_ids: torch.Tensor, **inputs) -> dict:
    """What a vision-language model's text model receives for one global batch, for ``shard_batch``.

    Runs ``model`` (applied or not) on the *global* batch up to its text model, on every
    rank alike, and returns the inputs the model hands it: ``inputs_embeds``
    ``[batch, seq, hidden]`` (the token embeddings with the image/video features scattered
    into their placeholder tokens), ``position_ids`` when the model computes them (mRoPE:
    ``[3, batch, seq]`` for Qwen2-VL/Qwen2.5-VL/Qwen3-VL; Llava and Mistral3 make none, so
    ``shard_batch`` numbers the tokens ``0 .. seq-1``) and Qwen3-VL's deepstack inputs
    (``visual_pos_masks``, ``deepstack_visual_embeds``). The tensors keep their autograd
    graph, so the backward of each rank's loss share reaches the vision tower.

    The vision tower is replicated: every rank of the group encodes every image of the
    batch (its compute and activation memory, and the global ``[batch, seq, hidden]``
    embeddings until the backward, are those of one process, on every rank); each rank then
    keeps its slice. Images are not split, so the tower's attention over an image is the
    model's own.

    Args:
        model: a transformers vision-language model (``...ForConditionalGeneration``).
        input_ids: ``[batch, seq]`` global token ids with the image placeholders.
        inputs: what the processor returned for the batch besides ``input_ids`` and
            ``attention_mask`` (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``,
            ``pixel_values_videos``, ``video_grid_thw``, ``image_sizes``, ...).

    Returns:
        a dict for ``shard_batch(input_ids, labels, group=group, **it)``.
    """
    texts = text_model(model)
    if texts is None:
        raise HFIntegrationError(f"multimodal_inputs: {type(model).__name__} has no separate text model (a text-only model: use shard_batch(input_ids))")
    if _SHARD_KWARG in inputs:
        raise HFIntegrationError("multimodal_inputs: takes the global batch, not shard_batch's model inputs")
    if inputs.get("attention_mask") is not None and not bool(inputs["attention_mask"].all()):
        raise HFIntegrationError("multimodal_inputs: a padding attention_mask with masked tokens is not supported; set padded labels to -100")
    captured: dict = {}
    params = inspect.signature(texts.forward)

    def capture(module, args, kwargs):
        captured.update(params.bind_partial(*args, **kwargs).arguments)
        raise _Captured

    handle = texts.register_forward_pre_hook(capture, with_kwargs=True, prepend=True)
    try:
        model(input_ids=input_ids, use_cache=False, **inputs)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "inputs_embeds" not in captured:
        raise HFIntegrationError(f"multimodal_inputs: {type(model).__name__} did not call its text model {type(texts).__name__}")
    captured.update(captured.pop("kwargs", {}))
    mask = captured.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all()):
        captured["attention_mask"] = None  # all ones: what a processor returns without padding
    unexpected = sorted(n for n in _UNSET if captured.get(n) is not None)
    unexpected += sorted(n for n, v in captured.items() if n not in _SHARDED + _UNSET and isinstance(v, (torch.Tensor, list, tuple, dict)))
    if unexpected:
        raise HFIntegrationError(
            f"multimodal_inputs: {type(model).__name__} hands its text model {unexpected}, which shard_batch cannot shard (it shards {list(_SHARDED)})"
        )
    return {n: captured[n] for n in _SHARDED if captured.get(n) is not None}


def prepare(model) -> None:
    """``apply``'s part for a vision-language model (idempotent): the two pre-hooks above."""
    texts = text_model(model)
    if texts is None or getattr(texts, _HOOKS_ATTR, None) is not None:
        return
    params = inspect.signature(texts.forward).parameters
    name = type(texts).__name__

    def hand_over(module, args, kwargs):
        shard = kwargs.get(_SHARD_KWARG)
        if not isinstance(shard, SequenceShard) or not shard.text_inputs:
            return None
        for key in shard.text_inputs:
            if key not in params:
                raise HFIntegrationError(f"{name} takes no {key!r}: the batch was sharded with inputs of another model")
            if kwargs.get(key) is not None:
                raise HFIntegrationError(f"{name}: {key!r} given both to the model and to shard_batch")
        return args, {**kwargs, **shard.text_inputs}

    def refuse_pixels(module, args, kwargs):
        shard = kwargs.get(_SHARD_KWARG)
        if not isinstance(shard, SequenceShard):
            return None  # the attention call explains a missing shard
        if shard.world_size > 1 and kwargs.get("position_ids") is None:
            # Qwen2-VL & co. would number this rank's tokens from 0 (plus the mRoPE offset
            # kept from the last full batch, model.rope_deltas): wrong positions, silently.
            raise HFIntegrationError(
                f"{type(module).__name__}: a sharded call without position_ids, so the model would number this rank's "
                "tokens from 0; pass the global positions (shard_batch(...).model_inputs() does)"
            )
        given = sorted(k for k, v in kwargs.items() if v is not None and (k.startswith("pixel_values") or k == "mm_encoder_outputs"))
        if given:
            raise HFIntegrationError(
                f"{type(module).__name__}: {given} given with a sharded batch; the vision tower runs before sharding, on whole "
                "images: shard_batch(input_ids, labels, group=group, **hf.multimodal_inputs(model, input_ids, pixel_values=..., ...))"
            )
        return None

    handles = (texts.register_forward_pre_hook(hand_over, with_kwargs=True), model.register_forward_pre_hook(refuse_pixels, with_kwargs=True))
    object.__setattr__(texts, _HOOKS_ATTR, handles)
