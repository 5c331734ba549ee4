"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Llava, Mistral3, ...): the vision
tower runs before the sequence is sharded, the text model runs sequence-parallel.

One step, global sequence of ``S`` tokens (image placeholders included) over ``P`` ranks::

    multimodal_inputs(model, input_ids, pixel_values=..., image_grid_thw=..., ...)
        the model's own code up to its text model, on the whole global batch, on every
        rank: the token embeddings, the vision tower over every image (replicated; or with
        vision="split" each rank encodes some images and one all-gather shares the
        features), the image features scattered into the placeholders, the mRoPE positions
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
import torch.distributed as dist

from ...layers.state import switch_state
from ...layers.step import SHARD_KWARG, HFIntegrationError, SequenceShard, process_group, rank_world

__all__ = ["multimodal_inputs"]

# What a VLM's base model hands its text model that ``shard_batch`` shards (the others must be
# unset: a prepared mask or a KV cache cannot be cut along the sequence).
_SHARDED = ("inputs_embeds", "position_ids", "visual_pos_masks", "deepstack_visual_embeds")
_UNSET = ("input_ids", "attention_mask", "past_key_values")


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


def multimodal_inputs(model, input_ids: torch.Tensor, *, vision: str = "replicated", group=None, **inputs) -> dict:
    """What a vision-language model's text model receives for one global batch, for ``shard_batch``.

    Runs ``model`` (applied or not) on the *global* batch up to its text model, on every
    rank alike, and returns the inputs the model hands it: ``inputs_embeds``
    ``[batch, seq, hidden]`` (the token embeddings with the image/video features scattered
    into their placeholder tokens), ``position_ids`` when the model computes them (mRoPE:
    ``[3, batch, seq]`` for Qwen2-VL/Qwen2.5-VL/Qwen3-VL; Llava and Mistral3 make none, so
    ``shard_batch`` numbers the tokens ``0 .. seq-1``) and Qwen3-VL's deepstack inputs
    (``visual_pos_masks``, ``deepstack_visual_embeds``). The tensors keep their autograd
    graph, so the backward of each rank's loss share reaches the vision tower.

    ``vision="replicated"`` (default): every rank of the group encodes every image of the
    batch (its compute and activation memory, and the global ``[batch, seq, hidden]``
    embeddings until the backward, are those of one process, on every rank); each rank then
    keeps its slice. ``vision="split"`` (the Qwen-VL families: a tower that takes
    ``image_grid_thw``): the images are dealt out over the ranks of ``group`` (whole images,
    the most patches first to the least loaded rank), each rank encodes its own, and one
    differentiable all-gather of the features (and Qwen3-VL's deepstack features) gives
    every rank all of them, which the model then merges as it merges precomputed features
    (``mm_encoder_outputs``); the backward sums the features' gradients over the group and
    each rank's tower gets its images' share (videos, ``pixel_values_videos``, are still
    encoded on every rank). Collective: call it on every rank. Either way
    an image is encoded whole, so the tower's attention over it is the model's own.

    Args:
        model: a transformers vision-language model (``...ForConditionalGeneration``).
        input_ids: ``[batch, seq]`` global token ids with the image placeholders.
        vision: ``"replicated"`` or ``"split"`` (above).
        group: the sequence-parallel group, for ``vision="split"`` (the one given to ``apply``).
        inputs: what the processor returned for the batch besides ``input_ids`` and
            ``attention_mask`` (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``,
            ``pixel_values_videos``, ``video_grid_thw``, ``image_sizes``, ...).

    Returns:
        a dict for ``shard_batch(input_ids, labels, group=group, **it)``.
    """
    texts = text_model(model)
    if texts is None:
        raise HFIntegrationError(f"multimodal_inputs: {type(model).__name__} has no separate text model (a text-only model: use shard_batch(input_ids))")
    if SHARD_KWARG in inputs:
        raise HFIntegrationError("multimodal_inputs: takes the global batch, not shard_batch's model inputs")
    if inputs.get("attention_mask") is not None and not bool(inputs["attention_mask"].all()):
        raise HFIntegrationError("multimodal_inputs: a padding attention_mask with masked tokens is not supported; set padded labels to -100")
    if vision not in ("replicated", "split"):
        raise HFIntegrationError(f"multimodal_inputs: vision expected 'replicated' or 'split', got {vision!r}")
    if vision == "split" and inputs.get("pixel_values") is not None:
        pixels = inputs.pop("pixel_values")
        inputs["mm_encoder_outputs"] = {"image": _split_images(model, group, pixels, inputs.get("image_grid_thw"))}
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
    if texts is None or "multimodal" in switch_state(model).hooks:
        return
    params = inspect.signature(texts.forward).parameters
    name = type(texts).__name__

    def hand_over(module, args, kwargs):
        shard = kwargs.get(SHARD_KWARG)
        if not isinstance(shard, SequenceShard) or not shard.text_inputs:
            return None
        for key in shard.text_inputs:
            if key not in params:
                raise HFIntegrationError(f"{name} takes no {key!r}: the batch was sharded with inputs of another model")
            if kwargs.get(key) is not None:
                raise HFIntegrationError(f"{name}: {key!r} given both to the model and to shard_batch")
        return args, {**kwargs, **shard.text_inputs}

    def check_sharded_call(module, args, kwargs):
        shard = kwargs.get(SHARD_KWARG)
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

    switch_state(model).hook_once(
        "multimodal",
        lambda: (texts.register_forward_pre_hook(hand_over, with_kwargs=True), model.register_forward_pre_hook(check_sharded_call, with_kwargs=True)),
    )


class _ImageFeatures:
    """Precomputed image features as the Qwen-VL models read ``mm_encoder_outputs["image"]``:
    ``pooler_output`` (one ``[tokens, hidden]`` tensor per image, in image order) and, for
    Qwen3-VL, ``deepstack_features`` (per deepstack layer, the same per image)."""

    def __init__(self, pooler_output: tuple, deepstack_features: list | None):
        self.pooler_output = pooler_output
        self.deepstack_features = deepstack_features


class _GatherRows(torch.autograd.Function):
    """Every rank's ``[rows_r, width]`` joined in rank order (``rows`` the counts of all
    ranks); backward: the gradient summed over the group, each rank keeping its rows."""

    @staticmethod
    def forward(ctx, local, rows: list, rank: int, group):
        ctx.rows, ctx.rank, ctx.group = rows, rank, group
        padded = local.new_zeros(max(rows), local.shape[1])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, rows)])

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # each rank's loss share used every image's features
        start = sum(ctx.rows[: ctx.rank])
        return grad[start : start + ctx.rows[ctx.rank]], None, None, None


def _deal(sizes: list[int], world: int) -> list[int]:
    """The rank that encodes each image: the largest first, each to the least loaded rank
    (by patches; ties to the lower rank), the same on every rank."""
    load, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + sizes[i]
    return owner


def _split_images(model, group, pixel_values: torch.Tensor, grid_thw) -> _ImageFeatures:
    """``vision="split"``: this rank's images through the tower, every image's features back."""
    base = getattr(model, "model", model)  # ...ForConditionalGeneration -> its base model
    encode = getattr(base, "get_image_features", None)
    merge = getattr(getattr(base, "visual", None), "spatial_merge_size", None)
    if grid_thw is None or encode is None or merge is None:
        raise HFIntegrationError(
            f"multimodal_inputs(vision='split'): {type(model).__name__} is not a Qwen-VL model (a vision tower that takes "
            "image_grid_thw); use vision='replicated'"
        )
    rank, world = rank_world(group)
    patches = grid_thw.prod(-1).tolist()
    tokens = [n // merge**2 for n in patches]
    owner = _deal(patches, world)
    starts = [sum(patches[:i]) for i in range(len(patches))]
    mine = [i for i in range(len(patches)) if owner[i] == rank]
    width = model.config.get_text_config().hidden_size
    layers = len(getattr(model.config.vision_config, "deepstack_visual_indexes", ()) or ())
    if mine:
        rows = torch.cat([pixel_values[starts[i] : starts[i] + patches[i]] for i in mine])
        out = encode(rows, grid_thw[mine], return_dict=True)
        deep = getattr(out, "deepstack_features", None) or []
        if len(deep) != layers:
            raise HFIntegrationError(f"multimodal_inputs(vision='split'): {len(deep)} deepstack feature sets, expected {layers}")
        local = torch.cat([torch.cat([out.pooler_output[j]] + [d[j] for d in deep], dim=-1) for j in range(len(mine))])
    else:
        local = next(model.parameters()).new_zeros(0, width * (1 + layers))
    # The gather's backward is a collective: it must be in every rank's graph or in none.
    # Decided by what is the same on every rank (grad mode, the tower's trainable parameters),
    # not by this rank's images (a rank with none holds an empty tensor).
    trains = torch.is_grad_enabled() and any(p.requires_grad for p in base.visual.parameters())
    local = local.requires_grad_() if trains and not local.requires_grad else local if trains else local.detach()
    counts = [sum(tokens[i] for i in range(len(tokens)) if owner[i] == r) for r in range(world)]
    gathered = _GatherRows.apply(local, counts, rank, process_group(group)) if world > 1 and dist.is_initialized() else local
    # Rows in rank order (each rank's images in image order) -> per image, in image order.
    offsets, at = {}, 0
    for r in range(world):
        for i in (i for i in range(len(tokens)) if owner[i] == r):
            offsets[i], at = at, at + tokens[i]
    per_image = [gathered[offsets[i] : offsets[i] + tokens[i]] for i in range(len(tokens))]
    pooler = tuple(x[:, :width] for x in per_image)
    deepstack = [tuple(x[:, width * (1 + k) : width * (2 + k)] for x in per_image) for k in range(layers)] if layers else None
    return _ImageFeatures(pooler, deepstack)
