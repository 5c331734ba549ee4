"""The long-context pieces on a transformers causal LM: what ``hf.apply(model, group,
tiled_loss=..., tiled_mlp=..., offload_activations=...)`` installs.

    hf.apply(model, group, tiled_loss=True, tiled_mlp=True, offload_activations=True)
    out = model(**batch.model_inputs())        # unchanged: out.loss, no logits (out.logits is None)
    out.loss.backward()

Everything is set on the model's own module instances (no class is patched) and undone by
``apply`` with the pieces off:

* tiled loss: a forward pre-hook on the model takes the step's targets (transformers'
  ``shift_labels``, else ``labels`` shifted as its causal-LM loss does) and
  ``num_items_in_batch`` (else the count of valid targets: transformers' mean); the LM head's
  ``forward`` then returns the tiled loss (``loss.tiled_cross_entropy``) instead of logits,
  inside the head's ``__call__`` so that engine hooks gather its weight around it, and the
  model's ``loss_function`` passes that value through. The model's output carries the loss
  and no logits. Without labels (generation, evaluation of logits) nothing changes.
* tiled MLP: each decoder layer's ``mlp.forward`` runs ``tiling.tiled_apply`` over its
  original forward, with a tile count the same on every rank (from the step's
  ``SequenceShard``: ``batch x`` the longest shard's tokens).
* tiled norms: the same for each decoder layer's norms (``*norm`` children: transformers'
  ``input_layernorm``, ``post_attention_layernorm``) and the final norm. transformers'
  RMSNorm keeps a float32 copy of its input for the backward and makes three float32
  ``[rows, hidden]`` temporaries there (in bf16: 4 and 6 bytes per element over the
  2 of the output); tiled, it keeps its input and output only.
* activation offload: each decoder layer's ``forward`` runs inside ``ActivationOffload.hooks()``
  when it is checkpointed (transformers' ``activation_checkpointing_enable``), so the input
  the checkpoint keeps goes to host memory.

State: one ``LongContext`` object per model (``state(model)``): the settings, the offload
object (``.offload.stats()``: host bytes) and the last ``SequenceShard`` seen (the tile count
of a layer recomputed in the backward is the one of its step's forward). Nothing is kept at
module level.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..checks import UlyssesInputError
from ..layers.state import recorded, switch_state
from .loss import loss_tile_rows, tiled_cross_entropy
from .offload import ActivationOffload
from .tiling import default_tile_rows, tile_count, tiled_apply

__all__ = ["LongContextError", "LongContext", "enable", "state"]


class LongContextError(UlyssesInputError):
    """A long-context setting or model the pieces cannot run."""


@dataclass(eq=False)
class LongContext:
    """The long-context pieces installed on one model (``state(model)``).

    ``loss_tile_rows``/``mlp_tile_rows``: rows (tokens of batch x seq) per tile, ``None``
    for the default (``loss.loss_tile_rows``, ``tiling.default_tile_rows``); the piece is
    off when its flag is False. ``offload``: the ``ActivationOffload`` in use, or None.
    """

    tiled_loss: bool = False
    loss_tile_rows: int | None = None
    tiled_mlp: bool = False
    mlp_tile_rows: int | None = None
    tiled_norms: bool = False
    norm_tile_rows: int | None = None
    offload: ActivationOffload | None = None
    accum_dtype: torch.dtype | None = None
    shard_kwarg: str = "ulysses_shard"
    # Per step (the same on every rank: every rank runs the same forwards).
    shard: object = None
    _pending: tuple | None = field(default=None, repr=False)
    _took_loss: bool = field(default=False, repr=False)
    _undo: list = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        return self.tiled_loss or self.tiled_mlp or self.tiled_norms or self.offload is not None

    def rows_max(self, local_rows: int, x: torch.Tensor | None = None) -> int:
        """Rows of the group's longest shard this step (ranks agree on it): ``batch x`` its
        tokens, times the rows per token of ``x`` (``[batch, seq_local, ..., width]``: heads)."""
        shard = self.shard
        if shard is None or shard.local_len == 0:
            return local_rows
        per_token = local_rows // (shard.batch_size * shard.local_len)
        return shard.batch_size * max(shard.seq_lens) * max(per_token, 1)


def state(model: torch.nn.Module) -> LongContext | None:
    """The ``LongContext`` installed on ``model`` (None if none; its ``layers.state.SwitchState``)."""
    return recorded(model, "long_context")


def _tile_setting(name: str, value) -> tuple[bool, int | None]:
    if value is False or value is None:
        return False, None
    if value is True:
        return True, None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return True, value
    raise LongContextError(f"apply: {name} expected False, True or a positive int (tokens per tile), got {value!r}")


def _set_forward(module: torch.nn.Module, new, undo: list) -> None:
    """Shadow ``module.forward`` by an instance attribute (hooks still run around it)."""
    had = "forward" in module.__dict__
    undo.append((module, had, module.__dict__.get("forward")))
    module.forward = new


def _original(module: torch.nn.Module, previous):
    """The forward to delegate to, looked up at call time: an engine may change the module's
    class after ``apply`` (FSDP2's ``fully_shard``), and the class's forward is then the one
    to run (transformers checkpoints only the outermost wrapper)."""
    if previous is not None:
        return previous
    return type(module).forward.__get__(module)


def _undo_all(lc: LongContext) -> None:
    for item in reversed(lc._undo):
        if isinstance(item, tuple) and item[0] == "loss_function":
            _, model, had, previous = item
            if had:
                model._loss_function = previous
            else:
                model.__dict__.pop("_loss_function", None)
        elif isinstance(item, tuple):
            module, had, previous = item
            if had:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)
        else:  # a hook handle
            item.remove()
    lc._undo.clear()


def _decoder_layers(model) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable(
    model,
    *,
    tiled_loss: bool | int = False,
    tiled_mlp: bool | int = False,
    offload_activations: bool | ActivationOffload = False,
    tiled_norms: bool | int = False,
    accum_dtype: torch.dtype | None = None,
    shard_kwarg: str = "ulysses_shard",
) -> LongContext | None:
    """Install (or, with every piece off, remove) the long-context pieces on ``model``.

    Args:
        model: a transformers causal LM (``get_output_embeddings()`` is its LM head; decoder
            layers are ``GradientCheckpointingLayer``s with an ``mlp``).
        tiled_loss: ``True`` (default tiles) or tokens per tile: the LM head and the loss
            over sequence tiles, no logits (``out.logits`` is None).
        tiled_mlp: ``True`` or tokens per tile: each decoder layer's MLP over sequence tiles,
            recomputed in the backward.
        tiled_norms: ``True`` or tokens per tile: the decoder layers' norms and the final norm
            over sequence tiles, recomputed in the backward.
        offload_activations: ``True`` (a new ``ActivationOffload``) or one to use: the
            inputs that activation checkpointing keeps, in host memory. Needs checkpointing
            (``model.activation_checkpointing_enable()``) when training.
        accum_dtype: dtype of the tiled parameter-gradient sums (default float32 for half types).
        shard_kwarg: the keyword the step's ``SequenceShard`` travels in.

    Returns the ``LongContext`` (None when every piece is off).
    """
    loss_on, loss_rows = _tile_setting("tiled_loss", tiled_loss)
    mlp_on, mlp_rows = _tile_setting("tiled_mlp", tiled_mlp)
    norms_on, norm_rows = _tile_setting("tiled_norms", tiled_norms)
    if offload_activations is True:
        offload = ActivationOffload()
    elif offload_activations is False or offload_activations is None:
        offload = None
    elif isinstance(offload_activations, ActivationOffload):
        offload = offload_activations
    else:
        raise LongContextError(f"apply: offload_activations expected False, True or an ActivationOffload, got {type(offload_activations).__name__}")
    lc = LongContext(loss_on, loss_rows, mlp_on, mlp_rows, norms_on, norm_rows, offload, accum_dtype, shard_kwarg)
    # Refusals first, so that a refused model is left as it was.
    head = _head_for_loss(model) if loss_on else None
    layers = _decoder_layers(model) if (mlp_on or norms_on or offload is not None) else []
    if (mlp_on or norms_on or offload is not None) and not layers:
        raise LongContextError(f"apply: found no decoder layers (GradientCheckpointingLayer) in {type(model).__name__}")
    mlps = [_mlp_of(layer) for layer in layers] if mlp_on else []
    norms = _norms_of(model, layers) if norms_on else []

    previous = state(model)
    if previous is not None:
        _undo_all(previous)
        switch_state(model).long_context = None
    if not lc.active:
        return None
    switch_state(model).long_context = lc
    lc._undo.append(model.register_forward_pre_hook(_before_hook(lc, model), with_kwargs=True))
    lc._undo.append(model.register_forward_hook(_after_hook(lc), with_kwargs=True, always_call=True))
    if loss_on:
        _install_loss(lc, model, head)
    for mlp in mlps:
        _install_tiled(lc, mlp, _widest(mlp), lambda: lc.mlp_tile_rows)
    for norm in norms:
        _install_tiled(lc, norm, norm.weight.shape[-1], lambda: lc.norm_tile_rows)
    if offload is not None:
        for layer in layers:
            _install_offload(lc, layer)
    return lc


# ---- the step's context ------------------------------------------------------------------
def _labels_of(model, args, kwargs):
    """The ``labels`` argument of the model's forward, given by keyword or position."""
    if "labels" in kwargs:
        return kwargs["labels"]
    if not args:
        return None
    try:
        bound = inspect.signature(type(model).forward).bind_partial(model, *args)
    except TypeError:
        return None
    return bound.arguments.get("labels")


def _before_hook(lc: LongContext, model):
    def before(module, args, kwargs):
        shard = kwargs.get(lc.shard_kwarg)
        if shard is not None:
            lc.shard = shard
        lc._pending, lc._took_loss = None, False
        if not lc.tiled_loss:
            return None
        labels = _labels_of(model, args, kwargs)
        if labels is None:
            return None
        targets = kwargs.get("shift_labels")
        ignore = kwargs.get("ignore_index", -100)
        if targets is None:  # transformers' ForCausalLMLoss: shift inside this sequence
            targets = F.pad(labels, (0, 1), value=ignore)[..., 1:]
        divisor = kwargs.get("num_items_in_batch")
        if divisor is None:  # its mean over the valid targets
            divisor = int((targets != ignore).sum())
        lc._pending = (targets, divisor, ignore)
        return None

    return before


def _after_hook(lc: LongContext):
    def after(module, args, kwargs, output):
        took = lc._took_loss
        lc._pending, lc._took_loss = None, False
        if took and isinstance(output, dict) and "logits" in output:
            # The head returned the loss, not logits: the output carries no logits.
            return type(output)(**{k: v for k, v in output.items() if k != "logits"})
        return None

    return after


# ---- the pieces --------------------------------------------------------------------------
def _head_for_loss(model) -> torch.nn.Module:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
        raise LongContextError(f"apply: tiled_loss needs the model's LM head (get_output_embeddings()); {type(model).__name__} has none")
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        raise LongContextError(
            f"apply: tiled_loss with {type(model).__name__}'s final_logit_softcapping ({cap}): the model caps what its LM head "
            "returns, which under the tiled loss is the loss itself; use tiled_loss=False for this model"
        )
    return head


def _install_loss(lc: LongContext, model, head) -> None:
    previous = head.__dict__.get("forward")

    def head_forward(hidden, *args, **kwargs):
        pending = lc._pending
        if pending is None:
            return _original(head, previous)(hidden, *args, **kwargs)
        targets, divisor, ignore = pending
        lc._pending = None
        if tuple(hidden.shape[:-1]) != tuple(targets.shape):
            raise LongContextError(
                f"{type(model).__name__}: tiled_loss got hidden states {list(hidden.shape)} for targets {list(targets.shape)}; "
                "the loss needs every position (logits_to_keep must be 0)"
            )
        lc._took_loss = True
        rows = targets.numel()
        tile_rows = lc.loss_tile_rows or loss_tile_rows(head.weight.shape[0])
        return tiled_cross_entropy(
            hidden, head.weight, getattr(head, "bias", None), targets, divisor=divisor, tiles=tile_count(rows, tile_rows),
            ignore_index=ignore, accum_dtype=lc.accum_dtype,
        )  # fmt: skip

    _set_forward(head, head_forward, lc._undo)
    had = "_loss_function" in model.__dict__
    lc._undo.append(("loss_function", model, had, model.__dict__.get("_loss_function")))
    inner = model.loss_function

    def loss_function(logits, labels, vocab_size, **kwargs):
        if lc._took_loss:  # what the head returned is the loss (through the engine's hooks)
            return logits
        return inner(logits, labels, vocab_size, **kwargs)

    model.loss_function = loss_function


def _mlp_of(layer: torch.nn.Module) -> torch.nn.Module:
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, torch.nn.Module) or not any(p.requires_grad for p in mlp.parameters()):
        raise LongContextError(f"apply: tiled_mlp found no MLP with trainable parameters in {type(layer).__name__} (expected layer.mlp)")
    return mlp


def _widest(mlp: torch.nn.Module) -> int:
    widths = [m.out_features for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    return max(widths) if widths else 1


def _norms_of(model, layers) -> list[torch.nn.Module]:
    """The norms of each decoder layer: its direct children named ``*norm`` (``input_layernorm``,
    ``post_attention_layernorm``, Gemma's feed-forward norms) and those of its attention
    (Qwen3's per-head ``q_norm``/``k_norm``), and the base model's final ``norm``."""
    found = []
    for layer in layers:
        found += [m for name, m in layer.named_children() if name.endswith("norm")]
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, torch.nn.Module):
            found += [m for name, m in attn.named_children() if name.endswith("norm")]
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    final = getattr(base, "norm", None)
    if isinstance(final, torch.nn.Module):
        found.append(final)
    norms = [m for m in found if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1]
    if not norms:
        raise LongContextError(f"apply: tiled_norms found no norms in {type(model).__name__}'s decoder layers")
    return norms


def _install_tiled(lc: LongContext, module: torch.nn.Module, width: int, tile_rows) -> None:
    """``module.forward`` over sequence tiles; the tile count is the same on every rank."""
    previous = module.__dict__.get("forward")

    def tiled_forward(x):
        rows = x.numel() // x.shape[-1]
        per_tile = tile_rows() or default_tile_rows(width, max(x.element_size(), 4))
        return tiled_apply(module, x, tiles=tile_count(lc.rows_max(rows, x), per_tile), fn=_original(module, previous),
                           accum_dtype=lc.accum_dtype)  # fmt: skip

    _set_forward(module, tiled_forward, lc._undo)


def _install_offload(lc: LongContext, layer: torch.nn.Module) -> None:
    previous = layer.__dict__.get("forward")
    offload = lc.offload

    def layer_forward(*args, **kwargs):
        run = _original(layer, previous)
        if not (layer.training and torch.is_grad_enabled()):
            return run(*args, **kwargs)
        if not getattr(layer, "gradient_checkpointing", False):
            raise LongContextError(
                f"{type(layer).__name__}: offload_activations moves the inputs that activation checkpointing keeps, but this "
                "layer is not checkpointed; call model.activation_checkpointing_enable() (non-reentrant) before training"
            )
        with offload.hooks():
            return run(*args, **kwargs)

    _set_forward(layer, layer_forward, lc._undo)
