"""Switching a transformers model to sequence-parallel attention: ``register`` (the
``"ulysses"`` functions in transformers' ``AttentionInterface`` and
``AttentionMaskInterface``) and ``apply`` (check the model, resolve each attention module's
own implementation, copy its configs, switch it, and put the group settings on each
attention module)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import replace

import torch

from ...comm import get_communicator
from ...layers.attention import ATTENTION_SETTINGS_ATTR, ATTN_IMPLEMENTATION, attention_settings, ulysses_attention_forward
from ...layers.audit import check_token_mixers
from ...layers.masks import ulysses_mask
from ...layers.mixers import HANDLED_MIXERS, check_mixer_parallel, mixer_modules, plan_mixers, switch_mixers
from ...layers.state import STATE_ATTR, switch_state
from ...layers.step import SHARD_KWARG, HFIntegrationError
from ...longctx.patches import enable as enable_long_context
from ...plan import more_ranks_than_heads, more_ranks_than_heads_flat
from ...ring import SPGroups
from ...wire import wire_spec
from ..requirements import unusable
from .multimodal import prepare as prepare_multimodal
from .multimodal import text_config_key, text_model

__all__ = ["apply", "register", "unapply"]


def attention_modules(model) -> list[torch.nn.Module]:
    """The attention modules of ``model`` (what ``apply``, verl's switch and the ALST entry point switch).

    transformers' attention modules carry a config, ``is_causal`` and the head size (``head_dim``;
    BERT's ``attention_head_size``; MLA's ``qk_head_dim``: DeepSeek-V2, MiniCPM3); the softmax
    scale reaches the attention call as ``scaling``."""

    def is_attention(m) -> bool:
        sizes = ("head_dim", "attention_head_size", "qk_head_dim")
        return hasattr(m, "is_causal") and hasattr(m, "config") and any(hasattr(m, a) for a in sizes)

    return [m for m in model.modules() if is_attention(m)]


def _check_config(config) -> None:
    """Self-attention only: an encoder-decoder model or a decoder with cross-attention
    attends from one sequence to another, which sequence sharding does not split; and no
    MoE auxiliary loss (it is computed over the tokens the model sees)."""
    if getattr(config, "output_router_logits", False):
        # transformers adds router_aux_loss_coef * the load-balancing loss to out.loss, computed over the tokens it
        # sees: under sequence parallelism each rank's shard, so the summed gradient is not one process's (each
        # rank adds a whole balancing loss: world_size times the coefficient, over other statistics).
        raise HFIntegrationError(
            f"apply: {type(config).__name__}.output_router_logits = True: the MoE load-balancing loss would be computed "
            "over each rank's shard of the sequence and added on every rank; set output_router_logits=False and add "
            "router_aux_loss_coef * hf.router_loss(out.router_logits, batch.shard, group, num_experts=..., top_k=...) "
            "to the loss of a forward with output_router_logits=True and model_inputs(loss=False) (docs/hf.md, MoE)"
        )
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise HFIntegrationError(
            f"apply: {type(config).__name__} has cross-attention (is_encoder_decoder or add_cross_attention): only "
            "self-attention models are supported (decoders, and encoders such as BERT, ModernBERT, ViT, SigLIP)"
        )


def _configured_implementation(module) -> str:
    """The attention implementation ``module`` runs before ``apply`` switches it (on a
    second ``apply``: the one the first recorded)."""
    impl = getattr(module.config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        return impl or "eager"  # None: transformers falls back to the model's eager attention
    previous = getattr(module, ATTENTION_SETTINGS_ATTR, None)
    if previous is None:
        raise HFIntegrationError(
            f"apply: {type(module).__name__} is already set to {ATTN_IMPLEMENTATION!r} without apply, so the "
            "implementation to run on each rank's heads is unknown; build the model with it "
            "(attn_implementation='sdpa', 'eager', 'flash_attention_2', ...) and call apply"
        )
    return previous.inner_impl


def attention_function(module, impl: str) -> Callable:
    """The function transformers would call for ``impl`` in ``module``: the registered one,
    or for ``"eager"`` the model's own ``eager_attention_forward`` (Gemma 2's softcaps,
    GPT-OSS's adds the sinks), found in the module of ``module``'s class or a base's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl != "eager":
        if impl not in ALL_ATTENTION_FUNCTIONS:
            raise HFIntegrationError(f"apply: {type(module).__name__} uses attention implementation {impl!r}, which is not registered")
        return ALL_ATTENTION_FUNCTIONS[impl]
    for cls in type(module).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if callable(fn):
            return fn
    raise HFIntegrationError(
        f"apply: {type(module).__name__} is configured for 'eager' attention but its module has no eager_attention_forward; "
        "build the model with attn_implementation='sdpa' (or another registered implementation)"
    )


def _own_configs(model) -> None:
    """Give ``model`` its own copy of its config objects before ``apply`` switches them.

    transformers models keep the config object they were built from (``model.config``, and
    the same object on each attention module, rotary embedding, ...): another model built
    from that object would otherwise see ``_attn_implementation == "ulysses"`` too and fail
    in a module ``apply`` never prepared. One deep copy, and every module attribute that
    held an old config (or sub-config: ``text_config``, ``vision_config``) takes its copy,
    so the relations between them stay as they were."""
    from transformers import PretrainedConfig

    memo: dict = {}
    copy.deepcopy(model.config, memo)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PretrainedConfig) and id(value) in memo:
                object.__setattr__(module, name, memo[id(value)])


def register() -> None:
    """Register the ``"ulysses"`` attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ulysses_mask)


def apply(
    model, group=None, *, attn_fn=None, kernels=None, chunks: int | str = 1, check: str = "step", comm=None, wire_dtype=None,
    mixer_parallel: str = "auto", tiled_loss: bool | int = False, tiled_mlp: bool | int = False, tiled_norms: bool | int = False, offload_activations=False,
):  # fmt: skip
    """Make a transformers model sequence-parallel over ``group``.

    Each attention call exchanges q/k/v so that every rank holds the whole sequence for
    its heads. Plain causal attention then runs the fused ``ulysses_attention``; a
    sliding window shorter than the sequence, logit softcapping, attention sinks,
    attention dropout or a user-registered implementation run the model's own attention
    implementation (the one it was built with: ``eager``, ``sdpa``, ``flash_attention_2/3``
    or a registered one) on the rank's heads with every keyword the model passes, and the
    mask of each layer type rebuilt over the global sequence.

    Args:
        model: a ``transformers.PreTrainedModel`` whose self-attention uses ``AttentionInterface``:
            causal (Llama, Qwen2, Qwen3, Mistral, Gemma 2/3, GPT-OSS, Qwen3-MoE, ... families) or
            bidirectional (BERT, ModernBERT, ViT: each layer's ``is_causal``); hybrids whose other
            token mixers ``mixers.HANDLED_MIXERS`` names, and models with those mixers alone
            (Mamba, Falcon-Mamba, Mamba2); no cross-attention, no ``output_router_logits``
            (``router_loss`` is the global load-balancing loss).
        group: the sequence-parallel process group (default: the world), or an ``SPGroups``
            (``make_sp_groups``: Ulysses x ring; plain causal attention only, equal
            shards, contiguous or zigzag, packed or not: ``shard_batch(..., pad=True)``). Pass the same to
            ``shard_batch``, ``sync_gradients``, ``reduce_loss`` and ``gather_sequence``.
        attn_fn, kernels, chunks: passed to ``ulysses_attention`` (``kernels`` also to the
            exchanges around the model's own attention; ``attn_fn`` and ``chunks`` apply to
            the fused path only).
        wire_dtype: ``None`` (the attention dtype on the wire), ``"fp8"`` or a
            ``ulysses_kernels.wire.WireSpec``: FP8 on every exchange of every attention call
            (the fused op's and those around the model's own attention), as
            ``ulysses_attention(wire_dtype=...)`` (docs/fp8_wire.md; not exact). A bad value
            raises ``HFIntegrationError`` here, before the model changes.
        mixer_parallel: how the token mixers that are not attention (``HANDLED_MIXERS``) run:
            ``"heads"`` (the head exchange: the whole sequence for a slice of the heads),
            ``"state"`` (the sequence stays sharded, each layer's conv halo and recurrent state
            pass between the ranks: every family of ``HANDLED_MIXERS``; no limit from the head
            count; ``ulysses_kernels.state_passing``), or ``"auto"`` (default):
            per layer, the head exchange where its heads split over the ranks, else state
            passing. Exact either way. docs/hf.md, "Hybrid models".
        check: ``"step"`` (default): validate the inputs across ranks at the first attention
            call of each step (one tiny all-gather per step and path); ``"always"``: every
            layer; ``"never"``: no exchange.
        comm: a communicator (default: torch.distributed's; with
            ``ULYSSES_KERNELS_NATIVE_NCCL=1``, opt-in until native NCCL has run on a GPU, a
            native ``NCCLCommunicator`` on NCCL groups, made here and owned by the model).
        tiled_loss, tiled_mlp, tiled_norms, offload_activations: the long-context pieces
            (``ulysses_kernels.longctx``, docs/longctx.md), each off by default: the LM head and
            loss over sequence tiles (``out.loss`` as before, no logits), the MLP and the norms over
            sequence tiles recomputed in the backward (``True`` or tokens per tile), the inputs that
            activation checkpointing keeps in host memory (``True`` or an ``ActivationOffload``).

    Returns the model (changed in place: ``model.config`` becomes a copy of the config it was
    built from, with ``_attn_implementation == "ulysses"``; the object the caller passed to
    the model stays as it was, so other models built from it are untouched). Its
    forward then expects ``shard_batch(...).model_inputs()``. The model's GQA layout,
    ``module.scaling`` and RoPE (from the global ``position_ids``) are kept.
    """
    try:
        from transformers import PreTrainedModel
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise HFIntegrationError(f"apply: {unusable('transformers', e, 'pip install transformers')}") from e
    if not isinstance(model, PreTrainedModel):
        raise HFIntegrationError(
            f"apply: expected a transformers PreTrainedModel, got {type(model).__name__}; other modules can call ulysses_kernels.ulysses_attention directly"
        )
    if check not in ("step", "always", "never"):
        raise HFIntegrationError(f"apply: check expected 'step', 'always' or 'never', got {check!r}")
    wire = wire_spec(wire_dtype, "apply", HFIntegrationError)
    check_mixer_parallel(mixer_parallel, "apply")
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise HFIntegrationError(
            f"apply: {type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so its attention cannot be routed to ulysses_attention"
        )
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}
    for config in configs.values():
        _check_config(config)
    texts = text_model(model)  # a vision-language model's text model (None: a text-only model)
    # Only the text model runs sequence-parallel; a vision tower's attention (bidirectional,
    # over whole images before the sequence is sharded) keeps its implementation.
    modules = [m for m in attention_modules(model) if texts is None or m.config is texts.config]
    # Every other module that mixes tokens along the sequence must be one apply makes exact.
    check_token_mixers(model, HANDLED_MIXERS, attention=modules, scope=texts, chunked=True)
    # Resolved before the model is switched, so that a refusal leaves it as it was.
    inner = []
    for m in modules:
        impl = _configured_implementation(m)
        inner.append((m, impl, attention_function(m, impl)))
    _check_sparse_attention(modules)
    # Hybrid models' token mixers that are not attention (Gated DeltaNet, Mamba2, short convs:
    # mixers.HANDLED_MIXERS), planned here so that a layer whose heads cannot be split is refused
    # before anything changes.
    mixers = _plan_mixers(model if texts is None else texts, group, comm, attention=modules, mixer_parallel=mixer_parallel)
    if not modules and not mixers:
        raise HFIntegrationError(f"apply: found no attention modules (nor any other token mixer it runs) in {type(model).__name__}")
    # The long-context pieces (they refuse before changing anything, as the checks above).
    enable_long_context(model, tiled_loss=tiled_loss, tiled_mlp=tiled_mlp, tiled_norms=tiled_norms,
                        offload_activations=offload_activations, shard_kwarg=SHARD_KWARG)  # fmt: skip
    undo = switch_state(model).undo  # each change below puts what undoes it here (unapply runs them)
    undo.append(lambda: enable_long_context(model, shard_kwarg=SHARD_KWARG))  # every piece off: removed
    register()
    _own_configs(model)  # the caller's config object stays as it was (another model may share it)
    if texts is not None:
        key = text_config_key(model)
        built = _built_with(model.config.get_text_config()._attn_implementation, inner)
        model.set_attn_implementation({key: ATTN_IMPLEMENTATION})
        undo.append(lambda: model.set_attn_implementation({key: built}))
    elif hasattr(model, "set_attn_implementation"):
        built = _built_with(model.config._attn_implementation, inner)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        undo.append(lambda: model.set_attn_implementation(built))
    else:
        built = _built_with(model.config._attn_implementation, inner)
        model.config._attn_implementation = ATTN_IMPLEMENTATION
        undo.append(lambda: setattr(model.config, "_attn_implementation", built))
    wrong = sorted({type(m).__name__ for m in modules if getattr(m.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION})
    if wrong:
        raise HFIntegrationError(f"apply: could not switch the attention implementation of {', '.join(wrong)} to {ATTN_IMPLEMENTATION!r}")
    shared = attention_settings(group, attn_fn=attn_fn, kernels=kernels, chunks=chunks, check=check, comm=comm, wire_dtype=wire)
    for m, impl, fn in inner:
        # A plain attribute on the module instance (not a parameter or buffer): the group
        # settings belong to this model, not to the process.
        object.__setattr__(m, ATTENTION_SETTINGS_ATTR, replace(shared, inner_impl=impl, inner_fn=fn))
    undo.append(lambda: [m.__dict__.pop(ATTENTION_SETTINGS_ATTR, None) for m in modules])
    if isinstance(group, SPGroups):  # the mixers pass their state over the whole group (_plan_mixers)
        switch_mixers(mixers, group.group, get_communicator(group.group), root=model)
    else:
        switch_mixers(mixers, group, shared.comm, root=model)
    if texts is not None:
        prepare_multimodal(model)  # the text model's and the top-level model's pre-hooks
    _refuse_generate(model)
    undo.append(lambda: model.__dict__.pop("generate", None))
    return model


def unapply(model):
    """Undo ``apply``: ``model`` runs as it was built again (its attention implementation, its
    mixers' forwards, no hook, no long-context piece, ``generate`` its own), e.g. to generate
    after sequence-parallel training, and ``apply`` may switch it again. It keeps its own copy
    of its configs (``apply``'s) and its weights as they are now. Returns the model.
    ``HFIntegrationError`` for a model ``apply`` did not switch."""
    state = switch_state(model, create=False)
    if state is None or not state.undo:
        raise HFIntegrationError(f"unapply: {type(model).__name__} was not switched by apply")
    while state.undo:
        state.undo.pop()()
    for name in list(state.hooks):
        state.remove_hook(name)
    model.__dict__.pop(STATE_ATTR, None)
    return model


def _built_with(before, inner) -> str:
    """The implementation ``unapply`` puts back: the one the model had before ``apply`` (on a
    second ``apply``, the one the first recorded: what the modules run on their heads, ``inner``)."""
    if before != ATTN_IMPLEMENTATION:
        return before
    impls = {impl for _, impl, _ in inner}
    return impls.pop() if len(impls) == 1 else "eager"


def _refuse_generate(model) -> None:
    """``model.generate`` refused by name, on the instance: it would call the model on the
    whole prompt without a shard (the attention call would say only that) and then feed back a
    KV cache holding this rank's shard of the sequence."""
    object.__setattr__(model, "generate", _GenerateRefused(type(model).__name__))


class _GenerateRefused:
    """What ``apply`` puts in place of ``model.generate`` (a plain class: the model still pickles)."""

    def __init__(self, model_name: str):
        self.model_name = model_name

    def __call__(self, *args, **kwargs):
        raise HFIntegrationError(
            f"{self.model_name}.generate: generation is not supported sequence-parallel: it keeps a KV cache (past_key_values, "
            "use_cache=True), which would hold this rank's shard of the sequence only; hf.unapply(model) puts it back as built "
            "(then generate; hf.apply switches it again), or generate with a model apply did not change (load this one's "
            "weights into it: fresh.load_state_dict(model.state_dict()), or a copy.deepcopy made before apply)"
        )


def _plan_mixers(model, group, comm, attention=(), mixer_parallel: str = "auto") -> list:
    """The plans of ``model``'s mixers that are not attention (``mixers.plan_mixers``). On a
    2-D group (``SPGroups``: Ulysses x ring for attention) they run with state passing over the
    whole group (its member ranks hold contiguous shards in order), ``"heads"`` and a zigzag
    layout refused: the ring level moves attention's K/V blocks, not a recurrent state, and a
    zigzag rank's two chunks are not one span. On a flat group a model's ``attention`` layers
    with fewer query heads than ranks are refused here, with the fix (the attention call's own
    error would suggest ``make_sp_groups``, which the mixers then need with state passing)."""
    modules = mixer_modules(model)
    if not modules:
        return []
    names = ", ".join(sorted({type(m).__name__ for m in modules}))
    if isinstance(group, SPGroups):
        if mixer_parallel == "heads" or group.seq_layout != "contiguous":
            why = "mixer_parallel='heads'" if mixer_parallel == "heads" else f"seq_layout {group.seq_layout!r}"
            raise HFIntegrationError(
                f"apply: {type(model).__name__} has token mixers that are not attention ({names}): on a 2-D SPGroups they run with "
                f"state passing over the whole group, on contiguous shards (make_sp_groups(..., seq_layout='contiguous'), "
                f"mixer_parallel 'state' or 'auto'), not with {why} (the ring level moves attention's K/V blocks, not a recurrent state)"
            )
        return plan_mixers(modules, group.world_size, "state")
    world = get_communicator(group, comm).world_size
    for m in attention:
        heads = getattr(m.config, "num_attention_heads", None)
        if isinstance(heads, int) and 0 < heads < world:
            if mixer_parallel == "heads":
                why = f"the model's other token mixers ({names}) need a flat group with mixer_parallel='heads'"
                fix = more_ranks_than_heads_flat(heads, world, why)
            else:  # the mixers pass their state over a 2-D group's whole group
                fix = more_ranks_than_heads(world, heads)
            raise HFIntegrationError(f"apply: {type(m).__name__} ({heads} query heads) cannot be split over {world} ranks: {fix}")
    return plan_mixers(modules, world, mixer_parallel)


def _check_sparse_attention(modules) -> None:
    """DeepSeek-V3.2's sparse attention (DSA) is refused: its indexer picks each query's top-k
    keys from scores over the keys the module sees, and reads the layer's mask as a tensor;
    under sequence sharding it would see this rank's keys only (and gets no mask tensor)."""
    sparse = sorted({type(m).__name__ for m in modules if getattr(m, "indexer", None) is not None})
    if sparse:
        raise HFIntegrationError(
            f"apply: {', '.join(sparse)} runs sparse attention (an indexer choosing each query's top-k keys, DeepSeek-V3.2's "
            "DSA): the selection spans the whole sequence, which sequence sharding splits; not supported (DeepSeek-V3's "
            "dense MLA is)"
        )
