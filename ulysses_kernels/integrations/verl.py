"""verl's Ulysses sequence parallelism on ``ulysses_attention``: importing this module is the switch.

Load it in every verl worker through one of verl's own hooks, and verl's setting
``ulysses_sequence_parallel_size`` then runs our Ulysses instead of verl's::

    actor_rollout_ref.model.external_lib=ulysses_kernels.integrations.verl      # actor, ref (and rollout)
    VERL_USE_EXTERNAL_MODULES=ulysses_kernels.integrations.verl                 # every process that imports verl

(verl 0.9.1: ``HFModelConfig.__post_init__`` imports ``external_lib`` where the config is
built, which for the actor and reference models is inside each worker; a critic's
``TrainingWorker`` receives its config already built, so only the environment variable
reaches it; see docs/verl.md.) ``apply()`` does the same explicitly and is idempotent;
``revert()`` gives verl back its own functions. Nothing happens because both packages are
installed: there is no ``verl.plugins`` entry point.

What the switch changes. verl builds each model in its FSDP engine and calls
``verl.models.transformers.monkey_patch.apply_monkey_patch(model, ulysses_sp_size, ...)``
(a name the engine imports into ``verl.workers.engine.fsdp.transformer_impl``: both
bindings are replaced). With ``ulysses_sp_size > 1`` our version, for a text decoder model:

* checks the head layout with ``HeadPlan`` instead of verl's asserts (``heads % sp == 0``,
  ``kv % sp == 0 or sp % kv == 0``): any layout with at least one query head per rank runs
  (Qwen2.5-14B, 40/8 heads, at sp 16), and one that does not raises
  ``VerlIntegrationError`` on every rank, before any collective;
* runs verl's own ``apply_monkey_patch`` with ``ulysses_sp_size=1`` for everything that is
  not sequence parallelism (fused kernels, tiled MLP, the TRL value-head patch, ...);
* switches the model to the attention implementation ``"ulysses_verl"`` (registered in
  transformers' ``AttentionInterface``, with no mask function: transformers builds no mask)
  and puts a forward pre-hook on the decoder stack (``model.base_model``).

Once per forward of the decoder stack (a micro-batch; layers recomputed under activation
checkpointing do not repeat it) the pre-hook reads verl's current sequence-parallel group
(``verl.utils.ulysses.get_ulysses_sequence_parallel_group()``, set by the engine's train
and eval modes), checks the ranks agree (one all-gather of 6 integers) and gathers the
sharded ``position_ids`` once (one all-gather of ``seq_local`` integers), finds the packed
documents (a document starts where the position is 0, transformers' rule for flash-attn's
varlen) and passes them, with the group, down to every attention call as the keyword
``ulysses_verl_step``. A plain causal attention call is then one ``ulysses_attention``: q, k and v
in one exchange, KV heads sent only to the ranks that use them (never repeated), the
rank's heads attended over the whole sequence within each document, the output exchanged
back. verl's data path (packing, padding to a multiple of sp, slicing, gathering the
outputs, the sharding manager, the device mesh) is untouched.

Layouts: ``q`` ``[1, total/sp, Hq, D]`` per rank in verl's packed format (batch 1,
``position_ids`` ``[1, total/sp]`` restarting at 0 per sample; the padding verl appends is a
document of its own). Attention backend on the rank's heads: the implementation the model
was built with decides: ``flash_attention_2/3`` -> flash-attn's varlen kernel where it is
importable on CUDA (else SDPA), ``sdpa`` -> SDPA per document, ``eager`` -> the explicit
math per document. All are exact for plain causal attention.

Each attention call runs ``hf.sequence_parallel_attention`` (the one attention function of
``hf.apply`` and the ALST entry point) with the forward's ``SequenceShard``: sliding windows,
logit softcapping, attention sinks and dropout run as under ``hf.apply``.

Refused with ``VerlIntegrationError`` (never silently wrong): vision-language models (named;
use verl's own path for them until the model-coverage work lands), token mixers ``hf.apply``
does not run, non-causal attention, padding masks, KV caches, a group whose size is not the
configured ``ulysses_sp_size``, ranks that disagree on the batch.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..checks import UlyssesInputError
from ..comm import LocalCommunicator, get_communicator
from ..documents import Documents, documents, documents_of_positions
from ..layers.attention import attention_settings, sequence_parallel_attention
from ..layers.audit import check_token_mixers
from ..layers.mixers import GROUP_KWARG, HANDLED_MIXERS, check_mixer_parallel, mixer_modules, plan_mixers, switch_mixers
from ..layers.state import recorded, switch_state
from ..layers.step import SHARD_KWARG, HFIntegrationError, SequenceShard
from ..plan import HeadPlan, PlanError
from ..wire import WireSpec, wire_spec
from .hf.model import attention_function, attention_modules
from .requirements import unusable

__all__ = [
    "ATTN_IMPLEMENTATION",
    "STEP_KWARG",
    "VerlIntegrationError",
    "VerlStep",
    "apply",
    "apply_monkey_patch",
    "is_applied",
    "revert",
]

ATTN_IMPLEMENTATION = "ulysses_verl"
STEP_KWARG = "ulysses_verl_step"  # the per-forward ``VerlStep`` in the decoder's kwargs
_ORIGINAL_ATTR = "__ulysses_verl_original__"  # on our apply_monkey_patch: verl's function

# Implementation the model was built with -> our backend on the rank's heads (attn_fn of
# ulysses_attention). Everything else (flash_attention_2/3, flex, a kernel) gets the default:
# flash-attn's varlen kernel on CUDA where importable, else SDPA.
_BACKENDS = {"sdpa": "sdpa", "eager": "math"}

# Layer types whose attention goes through AttentionInterface as plain softmax attention.
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


class VerlIntegrationError(UlyssesInputError):
    """A model, batch or setting that our Ulysses under verl cannot run (raised on every rank)."""


@dataclass(frozen=True)
class _Options:
    """What ``apply`` was given (the same for every model the patch prepares)."""

    kernels: object = None
    chunks: int | str = 1
    check: str = "step"
    wire_dtype: WireSpec | None = None  # checked by ``apply`` (``wire.wire_spec``)
    mixer_parallel: str = "auto"  # checked by ``apply`` (``layers.mixers.check_mixer_parallel``)


@dataclass(eq=False)
class _ModelState:
    """What our ``apply_monkey_patch`` recorded on one model (its ``layers.state.SwitchState.verl``)."""

    sp_size: int
    q_heads: int
    kv_heads: int
    inner_impl: str  # the implementation the model was built with ("flash_attention_2", "sdpa", ...)
    options: _Options
    hook: object = None  # the pre-hook's handle on the decoder stack
    # Hybrid models' token mixers that are not attention, with their head plans at sp_size
    # (``layers.mixers.plan_mixers``); switched by ``_prepare``, fed by the pre-hook.
    mixers: list = field(default_factory=list)
    # The model's attention function per attention module class (``hf.model.attention_function``
    # for ``inner_impl``): what runs on the rank's heads when a call is not plain causal.
    inner_fns: dict = field(default_factory=dict)

    @property
    def attn_fn(self):
        return _BACKENDS.get(self.inner_impl)

    def inner_fn(self, module):
        kind = type(module)
        fn = self.inner_fns.get(kind)
        if fn is None:
            fn = self.inner_fns[kind] = attention_function(module, self.inner_impl)
        return fn


@dataclass(eq=False)
class VerlStep:
    """One forward of the decoder stack, as every attention call of it sees it.

    ``group``: verl's sequence-parallel group (``None``: no sequence parallelism in this
    forward, ``comm`` is then a ``LocalCommunicator``). ``seq_lens``: tokens per rank (equal:
    verl pads the packed sequence to a multiple of sp). ``docs``: the global document
    boundaries over ``total`` tokens, ``None`` for one document or an unpacked batch.
    """

    state: _ModelState
    group: object
    comm: object
    seq_lens: tuple[int, ...]
    docs: Documents | None
    batch: int = 1
    # hf's step (the same object the hybrids' mixers read; made from the fields above when not
    # given) and the settings of the one attention function (``hf.sequence_parallel_attention``),
    # per attention module class. Every field is an ``__init__`` argument: FSDP's input casting
    # rebuilds the dataclasses it finds in a module's keywords with ``dataclasses.replace``.
    shard: SequenceShard | None = field(default=None, repr=False)
    _settings: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.shard is None:
            total = sum(self.seq_lens)
            self.shard = SequenceShard(self.seq_lens, self.comm.rank, self.comm.world_size, total, self.batch, self.docs)

    @property
    def total(self) -> int:
        return sum(self.seq_lens)

    def settings(self, module):
        """``hf.attention_settings`` for ``module``'s class in this forward's group."""
        kind = type(module)
        made = self._settings.get(kind)
        if made is None:
            state, options = self.state, self.state.options
            made = self._settings[kind] = attention_settings(
                self.group, impl=state.inner_impl, fn=state.inner_fn(module), attn_fn=state.attn_fn, kernels=options.kernels,
                chunks=options.chunks, check=options.check, comm=self.comm, wire_dtype=options.wire_dtype,
            )  # fmt: skip
        return made


# --------------------------------------------------------------------------------------
# The switch: replacing verl's apply_monkey_patch
# --------------------------------------------------------------------------------------


def _verl_monkey_patch_module():
    try:
        import verl.models.transformers.monkey_patch as mp
    except ImportError as e:
        raise VerlIntegrationError(f"ulysses_kernels.integrations.verl: {unusable('verl', e, 'pip install verl')}") from e
    return mp


def is_applied() -> bool:
    """Whether verl's ``apply_monkey_patch`` is ours now (``False`` when verl is not installed)."""
    mp = sys.modules.get("verl.models.transformers.monkey_patch")
    return mp is not None and hasattr(mp.apply_monkey_patch, _ORIGINAL_ATTR)


def apply(*, kernels=None, chunks: int | str = 1, check: str = "step", wire_dtype=None, mixer_parallel: str = "auto"):
    """Make verl's Ulysses run ours in this process (what importing this module does).

    Replaces ``apply_monkey_patch`` in ``verl.models.transformers.monkey_patch`` and in every
    loaded verl module that imported it by name (``verl.workers.engine.fsdp.transformer_impl``,
    ``verl.models.transformers``); modules imported later take the replaced name. Models
    verl builds afterwards with ``ulysses_sequence_parallel_size > 1`` run
    ``ulysses_attention``. Idempotent: a second call rebinds with the given options (never
    wraps twice). ``kernels``, ``chunks``: as for ``ulysses_attention``; ``check``:
    ``"step"`` (validate q/k/v across the ranks at the first attention call of each forward),
    ``"always"`` (every layer) or ``"never"``; ``wire_dtype``: ``None``, ``"fp8"`` or a
    ``wire.WireSpec``, FP8 on every exchange of every attention call (docs/fp8_wire.md; a bad
    value raises ``VerlIntegrationError`` here); ``mixer_parallel``: ``"heads"``, ``"state"``
    or ``"auto"``, how a hybrid's linear-attention/SSM layers run (``hf.apply``'s keyword:
    the head exchange or state passing). The options hold for models prepared after
    the call: importing the module applies the defaults, so call ``apply(wire_dtype="fp8")``
    in the worker (e.g. from a module of your own named by ``external_lib``) before verl
    builds the model.

    Returns our ``apply_monkey_patch``.
    """
    if check not in ("step", "always", "never"):
        raise VerlIntegrationError(f"apply: check expected 'step', 'always' or 'never', got {check!r}")
    wire = wire_spec(wire_dtype, "apply", VerlIntegrationError)
    check_mixer_parallel(mixer_parallel, "apply", VerlIntegrationError)
    mp = _verl_monkey_patch_module()
    current = mp.apply_monkey_patch
    original = getattr(current, _ORIGINAL_ATTR, current)
    ours = _make_apply_monkey_patch(original, _Options(kernels, chunks, check, wire, mixer_parallel))
    _rebind(original, ours)
    _register()
    return ours


def revert() -> None:
    """Give verl back its own ``apply_monkey_patch`` in every loaded module (models already
    prepared keep running ours)."""
    mp = sys.modules.get("verl.models.transformers.monkey_patch")
    if mp is None or not hasattr(mp.apply_monkey_patch, _ORIGINAL_ATTR):
        return
    original = getattr(mp.apply_monkey_patch, _ORIGINAL_ATTR)
    _rebind(original, original)


def _rebind(original, new) -> None:
    """Point every loaded verl module's ``apply_monkey_patch`` that is verl's function (or an
    earlier one of ours) at ``new``."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "verl" or name.startswith("verl.")):
            continue
        bound = getattr(module, "apply_monkey_patch", None)
        if bound is original or getattr(bound, _ORIGINAL_ATTR, None) is original:
            module.apply_monkey_patch = new


def _make_apply_monkey_patch(original, options: _Options):
    @functools.wraps(original)
    def apply_monkey_patch(model, ulysses_sp_size: int = 1, use_remove_padding: bool = True, *args, **kwargs):
        """verl's ``apply_monkey_patch`` with our Ulysses for ``ulysses_sp_size > 1`` (see
        ``ulysses_kernels.integrations.verl``); with 1, verl's own, unchanged."""
        if ulysses_sp_size is None or int(ulysses_sp_size) <= 1:
            return original(model, ulysses_sp_size, use_remove_padding, *args, **kwargs)
        # Everything is checked before verl's patches change the model or its classes.
        state = _checked_state(model, int(ulysses_sp_size), options)
        # verl's patches that are not sequence parallelism (fused kernels, tiled MLP, the TRL
        # value head): its Ulysses parts are the head asserts and the flash-attention hook,
        # which models switched to ours do not call.
        result = original(model, 1, use_remove_padding, *args, **kwargs)
        _prepare(model, state)
        return result

    setattr(apply_monkey_patch, _ORIGINAL_ATTR, original)
    return apply_monkey_patch


def apply_monkey_patch(model, ulysses_sp_size: int = 1, use_remove_padding: bool = True, *args, **kwargs):
    """verl's ``apply_monkey_patch`` as the switch makes it (``apply()`` first if needed):
    for callers that import it from here rather than from verl."""
    mp = _verl_monkey_patch_module()
    if not hasattr(mp.apply_monkey_patch, _ORIGINAL_ATTR):
        apply()
    return mp.apply_monkey_patch(model, ulysses_sp_size, use_remove_padding, *args, **kwargs)


# --------------------------------------------------------------------------------------
# Preparing one model
# --------------------------------------------------------------------------------------


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _checked_state(model, sp_size: int, options: _Options) -> _ModelState:
    """What ``_prepare`` will record, after every check that needs only the model (the same
    on every rank, so a refusal is raised everywhere before any collective)."""
    try:
        from transformers import PreTrainedModel
    except ImportError as e:  # pragma: no cover - verl requires transformers
        raise VerlIntegrationError(f"ulysses_kernels.integrations.verl: {unusable('transformers', e, 'pip install transformers')}") from e
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise VerlIntegrationError(f"apply_monkey_patch: expected a transformers PreTrainedModel, got {name}")
    config = model.config
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "vision_config", None) is not None:
        raise VerlIntegrationError(
            f"apply_monkey_patch: {name} (model_type {model_type!r}) is a vision-language model; ulysses_kernels' "
            f"Ulysses under verl covers text decoder models for now. For ulysses_sequence_parallel_size={sp_size} with "
            "this model use verl's own Ulysses (drop external_lib / VERL_USE_EXTERNAL_MODULES="
            "ulysses_kernels.integrations.verl), which needs num_attention_heads % sp == 0"
        )
    # Every module that mixes tokens along the sequence must be attention that this switch runs
    # or a mixer hf.apply runs (layers.mixers.HANDLED_MIXERS: Gated DeltaNet, Mamba2, short
    # convolutions, planned here at sp_size); anything else is refused by class and place.
    try:
        check_token_mixers(model, HANDLED_MIXERS, attention=attention_modules(model), caller="apply_monkey_patch")
        mixers = plan_mixers(mixer_modules(model), sp_size, options.mixer_parallel)
    except HFIntegrationError as e:
        raise VerlIntegrationError(str(e)) from e
    text = _text_config(config)
    layer_types = set(getattr(text, "layer_types", None) or ())
    other = sorted(layer_types - _ATTENTION_LAYER_TYPES)
    if other and not mixers:  # a hybrid's other layer types are its mixers, audited above
        raise VerlIntegrationError(
            f"apply_monkey_patch: {name} (model_type {model_type!r}) has layers of type {other}; ulysses_kernels' Ulysses "
            "under verl runs softmax attention layers only (full or sliding-window)"
        )
    if not getattr(text, "is_causal", True) or not getattr(config, "is_causal", True):
        raise VerlIntegrationError(f"apply_monkey_patch: {name}: is_causal = False; only causal decoder attention is supported")
    q_heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or q_heads
    if not isinstance(q_heads, int) or not isinstance(kv_heads, int):
        raise VerlIntegrationError(
            f"apply_monkey_patch: {name} (model_type {model_type!r}): its config has no num_attention_heads / num_key_value_heads to plan the heads with"
        )
    try:
        HeadPlan.build(q_heads, kv_heads, sp_size)
    except PlanError as e:
        raise VerlIntegrationError(
            f"apply_monkey_patch: ulysses_sequence_parallel_size={sp_size} cannot run {name} ({q_heads} query heads, "
            f"{kv_heads} KV heads): {e}. Every rank needs at least one query head: use "
            f"ulysses_sequence_parallel_size <= {q_heads}"
        ) from e
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise VerlIntegrationError(
            f"apply_monkey_patch: {name} does not dispatch attention through transformers' AttentionInterface, "
            "so its attention cannot be routed to ulysses_attention"
        )
    previous = recorded(model, "verl")
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl == ATTN_IMPLEMENTATION:
        if previous is None:
            raise VerlIntegrationError(
                f"apply_monkey_patch: {name} is set to {ATTN_IMPLEMENTATION!r} without apply_monkey_patch; build it with "
                "attn_implementation='flash_attention_2', 'sdpa' or 'eager'"
            )
        impl = previous.inner_impl
    if _decoder(model) is None:
        raise VerlIntegrationError(f"apply_monkey_patch: found no decoder stack (model.base_model) in {name}")
    return _ModelState(sp_size, q_heads, kv_heads, impl, options, mixers=mixers)


def _decoder(model):
    """The module every forward of ``model`` calls once with the step's ``position_ids``:
    the decoder stack (``Qwen2Model`` inside ``Qwen2ForCausalLM``), also when a wrapper (PEFT)
    calls the outer model's ``forward`` directly, skipping its hooks."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, torch.nn.Module) else None


def _prepare(model, state: _ModelState) -> None:
    _register()
    previous = recorded(model, "verl")
    if previous is not None and previous.hook is not None:
        previous.hook.remove()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:  # pragma: no cover - transformers < 4.48
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    # The mixers take the group and the sequence shard from each forward's kwargs (the
    # pre-hook below runs before layer 0, which is a mixer in Qwen3.5).
    switch_mixers(state.mixers, None, None)
    decoder = _decoder(model)
    state.hook = decoder.register_forward_pre_hook(functools.partial(_pre_forward, state), with_kwargs=True)
    switch_state(model).verl = state  # this model instance's: nothing process-global


def _register() -> None:
    """Register ``"ulysses_verl"`` with transformers (idempotent). No mask function is
    registered, so transformers builds no mask for it: documents come from the step."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)


# --------------------------------------------------------------------------------------
# Once per forward: the group and the documents
# --------------------------------------------------------------------------------------

_HEADER = ("seq_local", "batch", "position_ids", "padding mask", "KV cache", "group size")


def _verl_group():
    from verl.utils.ulysses import get_ulysses_sequence_parallel_group

    return get_ulysses_sequence_parallel_group()


@functools.lru_cache(maxsize=32)
def _signature(forward_type: type) -> inspect.Signature | None:
    try:
        return inspect.signature(forward_type.forward)
    except (TypeError, ValueError):
        return None


def _call_arguments(module, args, kwargs) -> dict:
    """The decoder's arguments by name (transformers' models pass them as keywords; a
    caller may pass ``input_ids`` positionally)."""
    if not args:
        return kwargs
    sig = _signature(type(module))
    if sig is None:
        return kwargs
    bound = sig.bind_partial(module, *args, **kwargs)
    return {k: v for k, v in bound.arguments.items() if k != "self"}


def _pre_forward(state: _ModelState, module, args, kwargs):
    """Forward pre-hook of the decoder stack: build this forward's ``VerlStep``."""
    named = _call_arguments(module, args, kwargs)
    hidden = named.get("input_ids")
    if hidden is None:
        hidden = named.get("inputs_embeds")
    if hidden is None:
        raise VerlIntegrationError(f"{type(module).__name__}: called with neither input_ids nor inputs_embeds")
    batch, seq_local = int(hidden.shape[0]), int(hidden.shape[1])
    positions = named.get("position_ids")
    mask = named.get("attention_mask")
    padding = isinstance(mask, torch.Tensor) and not (mask.dim() == 2 and bool(mask.all()))
    cache = bool(named.get("use_cache")) or named.get("past_key_values") is not None
    pos_ok = positions is None or (positions.dim() == 2 and positions.shape[-1] == seq_local and positions.shape[0] in (1, batch))

    group = _verl_group()
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        header = [seq_local, batch, int(pos_ok), int(padding), int(cache), world]
        _check_header(module, state, [header], world)
        docs = None if positions is None else _documents(positions.expand(batch, seq_local))
        step = VerlStep(state, None, LocalCommunicator(), (seq_local,), docs, batch)
    else:
        comm = get_communicator(group)
        header = [seq_local, batch, int(pos_ok and positions is not None), int(padding), int(cache), world]
        _check_header(module, state, comm.all_gather_ints(header, hidden.device), world)
        # One gather of the position ids per forward (verl shards them with the tokens):
        # every layer then reads the global document boundaries from the step.
        local = positions.expand(batch, seq_local).contiguous()
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=group)
        step = VerlStep(state, group, comm, (seq_local,) * world, _documents(torch.cat(parts, dim=1)), batch)
    extra = {STEP_KWARG: step}
    if state.mixers:  # layers.mixers' forwards read the step as hf.apply's shard and group
        extra.update({SHARD_KWARG: step.shard, GROUP_KWARG: (step.group, step.comm)})
    return args, {**kwargs, **extra}


def _check_header(module, state: _ModelState, everyone: list[list[int]], world: int) -> None:
    """The same verdict on every rank from every rank's ``(seq_local, batch, position ids
    given, padding mask, KV cache, group size)``."""
    name = type(module).__name__
    if any(v != everyone[0] for v in everyone):
        rows = "; ".join(f"rank {r}: " + ", ".join(f"{k}={x}" for k, x in zip(_HEADER, v)) for r, v in enumerate(everyone))
        raise VerlIntegrationError(
            f"{name}: the ranks of the sequence-parallel group disagree on this forward's input (each must hold its "
            f"equal slice of the same packed batch, as verl's ulysses_pad_and_slice_inputs makes it): {rows}"
        )
    seq_local, batch, pos_ok, padding, cache, _ = everyone[0]
    if world > 1 and world != state.sp_size:
        raise VerlIntegrationError(
            f"{name}: verl's sequence-parallel group has {world} ranks but the model was prepared for ulysses_sequence_parallel_size={state.sp_size}"
        )
    if not pos_ok:
        raise VerlIntegrationError(
            f"{name}: sequence-parallel attention needs position_ids [1 or batch, seq_local] sharded like the tokens "
            f"(verl's packed position ids); got none or a different shape (seq_local {seq_local}, batch {batch})"
        )
    if padding:
        raise VerlIntegrationError(
            f"{name}: an attention_mask with padding reached sequence-parallel attention; verl's remove-padding path "
            "(use_remove_padding=True, required with ulysses_sequence_parallel_size > 1) packs the batch instead"
        )
    if cache:
        raise VerlIntegrationError(
            f"{name}: a KV cache (use_cache=True or past_key_values) under sequence parallelism is not supported; "
            "call the model with use_cache=False, as verl's engine does"
        )


def _documents(positions: torch.Tensor) -> Documents | None:
    """The documents of global ``[batch, total]`` position ids (``documents_of_positions``: a
    document starts at token 0 and wherever the position is 0), each row its own; ``None``
    when there is one document per row."""
    rows = documents_of_positions(positions)
    if all(len(row) == 2 for row in rows):
        return None
    return documents(rows[0] if len(rows) == 1 else list(rows))


# --------------------------------------------------------------------------------------
# Every attention call
# --------------------------------------------------------------------------------------


def _attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers attention function ``"ulysses_verl"``: ``[B, H, s_local, D]`` q/k/v (RoPE
    applied with verl's packed positions; k/v un-repeated) -> ``[B, s_local, Hq, D]``.

    The one attention function of every integration (``hf.sequence_parallel_attention``, what
    ``hf.apply``'s ``"ulysses"`` runs) with this forward's ``VerlStep`` as its step: plain causal
    attention on the fused op; a sliding window, logit softcapping, sinks or dropout on the
    packed-documents kernel or the model's own implementation over the rank's heads."""
    step = kwargs.pop(STEP_KWARG, None)
    if not isinstance(step, VerlStep):
        raise VerlIntegrationError(
            f"{type(module).__name__}: the model runs {ATTN_IMPLEMENTATION!r} attention but this call carries no "
            "VerlStep: prepare the model with verl's apply_monkey_patch after importing ulysses_kernels.integrations.verl, "
            "and call it as a whole (the decoder stack's pre-hook builds the step)"
        )
    if attention_mask is not None:
        shape = list(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise VerlIntegrationError(
            f"{type(module).__name__}: a prepared attention mask ({shape}) reached sequence-parallel attention; the documents "
            "come from the packed position_ids (verl's remove-padding path passes attention_mask=None)"
        )
    try:
        return sequence_parallel_attention(module, query, key, value, settings=step.settings(module), shard=step.shard, **kwargs)
    except HFIntegrationError as e:
        raise VerlIntegrationError(str(e)) from e


# --------------------------------------------------------------------------------------
# Importing this module is the switch (where verl is installed).
# --------------------------------------------------------------------------------------

if importlib.util.find_spec("verl") is not None:
    apply()
