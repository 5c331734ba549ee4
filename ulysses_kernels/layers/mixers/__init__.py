"""Ulysses for the token mixers of hybrid models that are not attention: Gated DeltaNet
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo Hybrid), Kimi Delta Attention (Kimi-Linear, Bailing
Hybrid), Mamba2 (Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid, Zamba2; attention-free Mamba2),
Mamba1 (Jamba; attention-free Mamba and Falcon-Mamba: three exchanges, ``_mamba1_forward``),
Zamba's multi-head Mamba1 (one exchange), MiniMax's lightning attention, RecurrentGemma's RG-LRU
block and LFM2's short convolution (LFM2, LFM2-MoE, LFM3), switched by
``apply`` in the same call as attention. ``HANDLED_MIXERS`` names every class made exact (what ``apply``'s refusal audit
reads); each runs exact against one process in tests/test_hf_hybrid.py.

Per head, each of these layers is a function of the whole sequence (a causal depthwise
conv1d over the head's channels, then a recurrence or scan over its tokens), so it runs as
attention does under Ulysses. One layer on rank ``r`` of ``P`` (``s_r`` local tokens, ``S``
in all; ``H`` heads, ``G`` groups: GDN's value/key heads, Mamba2's heads/groups)::

    hidden [B, s_r, hidden]
      -> the input projections, all heads (local)
      -> per head  [B, s_r, H, W]: GDN v | b | a (W = Dv + 2); Mamba2 x | dt (W = P + 1)
         per group [B, s_r, G, U]: GDN q | k (U = 2 Dk);     Mamba2 B | C (U = 2 N)
      -> ONE all-to-all (``_ToHeads``: roles ("q", "v") of the library's layout: heads on
         the plan's query ranges, groups on its KV ranges, a group whose heads are split
         over ranks sent to each of them, its gradient summed back)
      -> [B, S, h, W], [B, S, g, U]: the rank's heads over the whole sequence
      -> the causal conv1d on the rank's channels (the layer's weight rows), per document
      -> the per-head gates (GDN g, beta; Kimi's per-channel forget gate; Mamba2's dt bias,
         A, D), the parameters sliced to the rank's heads
      -> the model's own kernel (transformers' ``torch_chunk_gated_delta_rule`` /
         ``mamba2_chunk_scan`` as its module resolved them: flash-linear-attention or
         mamba_ssm when installed, the torch fallback otherwise), per document
      -> [B, S, h, Dv] -> ONE all-to-all back (``head_to_seq``) -> [B, s_r, H, Dv]
      -> gated norm, out_proj (local)

The layer's forward is replaced on the instance (``switch_mixers``) by one built from its own
submodules and its module's kernel functions: transformers' forwards call module-level
kernels on whatever sequence they see, so no wrapper around those calls could move data
between the projections and the conv. Each family's adapter writes out the transformers
5.23 forward's arithmetic step by step (the tests compare it with one process); a layer
the adapters do not know keeps its forward.

LFM2's short convolution has no heads: its ``hidden`` channels are planned as ``hidden``
heads of one element (the conv is depthwise), the gate ``B * x`` moves, ``C`` stays.

Packed documents: after the exchange each rank holds the whole sequence of its heads, so
the conv and the kernel run once per document (the state starts from zero at each
boundary, what the kernels' varlen forms do). transformers' torch fallbacks themselves
ignore document boundaries in these layers; the reference is each document run alone.

The other strategy, ``mixer_parallel="state"`` (``plan_mixers``; the default ``"auto"`` picks it
where a layer's heads do not split over the ranks): no exchange, the sequence stays sharded
and each layer's conv halo and recurrent state pass between the ranks
(``ulysses_kernels.state_passing``, docs/state_passing.md); the same forwards run it, their
pieces (``to_heads``, ``depthwise_conv``, ``run_recurrence``) switching on the strategy.

Not handled (refused by ``apply``): a KV/conv cache (generation), a padding mask, a 2-D
group (``SPGroups``), more ranks than a layer's heads under ``mixer_parallel="heads"``.

The modules: ``exchange`` (the exchange, the call's context, the conv and the per-document
runs), one per family (``gated_deltanet``, ``kimi_delta``, ``mamba2``, ``mamba1``, ``zamba``,
``lightning``, ``rg_lru``, ``short_conv``: its forward and its ``registry`` rows), ``registry``
(which classes run which forward) and this one (the audit's table, planning, switching and
handing the step's keywords over).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch

from ...plan import HeadPlan, PlanError, more_ranks_than_heads_flat
from ..state import STATE_ATTR, recorded, switch_state
from ..step import SHARD_KWARG, STEP_KWARGS, HFIntegrationError
from .exchange import GROUP_KWARG, MIXER_SETTINGS_ATTR, _MixerSettings

__all__ = [
    "GROUP_KWARG",
    "HANDLED_MIXERS",
    "MIXER_PARALLEL",
    "STATE_FAMILIES",
    "check_mixer_parallel",
    "mixer_modules",
    "mixer_strategies",
    "plan_mixers",
    "switch_mixers",
]

# Each family module registers its classes when imported (``registry.register``), in this order.
from . import gated_deltanet, kimi_delta, mamba2, short_conv, lightning, zamba, rg_lru, mamba1  # noqa: E402, F401, I001
from .registry import ADAPTERS as _ADAPTERS  # noqa: E402
from .registry import CLASSES as HANDLED_MIXERS  # noqa: E402  (class -> its family's line; a family registered later is in it)
from .registry import HANDED as _HANDED  # noqa: E402

_WRAPPED_ATTR = "_ulysses_hands_on_recompute"  # on a layer's checkpoint function: wrapped (its __wrapped__: the original)


def mixer_modules(model) -> list[torch.nn.Module]:
    """The model's modules whose class ``HANDLED_MIXERS`` names (each of a family whose layer
    drops the step's keywords learns its parent layer, for ``switch_mixers``)."""
    found = []
    for parent in model.modules():
        for child in parent.children():
            if type(child).__name__ in _ADAPTERS:
                found.append(child)
                if type(child).__name__ in _HANDED:
                    switch_state(child).layer = parent
    return found


# The families whose layer also runs with the sequence kept sharded, the state passed between
# ranks (``mixer_parallel="state"``: ``ulysses_kernels.state_passing``).
STATE_FAMILIES = ("gated-deltanet", "kimi-delta", "mamba2", "short-conv", "lightning", "mamba1", "zamba-mamba", "rg-lru")
MIXER_PARALLEL = ("heads", "state", "auto")


def check_mixer_parallel(mixer_parallel, who: str, error=HFIntegrationError) -> str:
    """``mixer_parallel`` checked (before anything changes): one of ``MIXER_PARALLEL``."""
    if mixer_parallel not in MIXER_PARALLEL:
        raise error(f"{who}: mixer_parallel expected 'heads', 'state' or 'auto', got {mixer_parallel!r}")
    return mixer_parallel


def plan_mixers(modules, world_size: int, mixer_parallel: str = "auto") -> list[tuple[torch.nn.Module, HeadPlan, str]]:
    """Each mixer's strategy and plan over ``world_size`` ranks: ``(module, plan, strategy)``.

    ``mixer_parallel``: ``"heads"``: every layer through the head exchange (its heads split
    over the ranks); ``"state"``: every layer with the sequence kept sharded and its state
    passed between ranks (the families of ``STATE_FAMILIES``; its plan is one rank's, all
    heads); ``"auto"`` (default): per layer, ``"heads"`` where its heads split over the ranks,
    else ``"state"`` where its family has it. (The head exchange stays the default where both
    run: which is faster at which length is for a GPU measurement to decide, issue 49; the
    state path computes the kernel on ``V + K`` value columns.) A layer that no strategy runs
    is refused by name, before ``apply`` changes anything."""
    check_mixer_parallel(mixer_parallel, "apply")
    plans = []
    for m in modules:
        name = type(m).__name__
        family = _ADAPTERS[name][0]
        heads, groups = _ADAPTERS[name][2](m)
        can_state = family in STATE_FAMILIES
        if mixer_parallel == "state" and not can_state:
            raise HFIntegrationError(
                f"apply: {name} ({family}) does not run with mixer_parallel='state' (state passing covers {', '.join(STATE_FAMILIES)}); "
                "use mixer_parallel='heads' or 'auto'"
            )
        if mixer_parallel == "state":
            plans.append((m, HeadPlan.build(heads, groups, 1), "state"))
            continue
        try:
            plans.append((m, HeadPlan.build(heads, groups, world_size), "heads"))
        except PlanError as e:
            if mixer_parallel == "auto" and can_state:
                plans.append((m, HeadPlan.build(heads, groups, 1), "state"))
                continue
            why = "a 2-D group (make_sp_groups) is refused for mixers that are not attention: its ring level does not carry their state"
            why = more_ranks_than_heads_flat(heads, world_size, why)
            fix = " (mixer_parallel='state' runs it: the sequence stays sharded)" if can_state else ""
            raise HFIntegrationError(
                f"apply: {name} ({heads} heads, {groups} groups) cannot be split over {world_size} ranks: {why if world_size > heads else e}{fix}"
            ) from e
    return plans


def mixer_strategies(model: torch.nn.Module) -> dict[str, str]:
    """How each token mixer that is not attention runs in a model ``apply`` (or verl's / ALST's
    switch) prepared: ``{module path: "heads" | "state"}`` (the head exchange, or state passing:
    docs/state_passing.md), in module order; ``{}`` for a model without such mixers."""
    return {name: settings.strategy for name, m in model.named_modules() if isinstance(settings := getattr(m, MIXER_SETTINGS_ATTR, None), _MixerSettings)}


def _per_step(forward: Callable) -> Callable:
    """``forward`` for a mixer switched without a group: the step's ``GROUP_KWARG`` gives it;
    a step of one rank (no sequence parallelism in this forward) runs the class's forward."""

    def run(self, *args, **kwargs):
        pair = kwargs.get(GROUP_KWARG)
        if pair is None:
            raise HFIntegrationError(
                f"{type(self).__name__}: switched for sequence parallelism, but this call carries no {GROUP_KWARG!r} "
                "(call the model as a whole: the integration's pre-forward hook supplies it)"
            )
        if pair[1].world_size == 1:
            rest = {k: v for k, v in kwargs.items() if k not in STEP_KWARGS}
            return type(self).forward(self, *args, **rest)
        return forward(self, *args, **kwargs)

    return run


def switch_mixers(plans, group, comm, root: torch.nn.Module | None = None) -> None:
    """Give each planned mixer its settings and its sequence-parallel forward (on the
    instance). ``comm`` ``None``: the group and communicator come with each step
    (``GROUP_KWARG``, beside the ``SequenceShard``), as verl's switch passes them. ``root``: the
    model the user calls (``apply``'s), whose call's keywords a mixer that does not receive them
    is handed (``_HANDED``)."""
    for m, plan, strategy in plans:
        family, forward, _ = _ADAPTERS[type(m).__name__]
        fn = forward if comm is not None else _per_step(forward)
        if type(m).__name__ in _HANDED:
            fn = _hand_over(m, fn, root)
        object.__setattr__(m, MIXER_SETTINGS_ATTR, _MixerSettings(group, comm, plan, family, strategy))
        object.__setattr__(m, "forward", types.MethodType(fn, m))
        if root is not None:
            switch_state(root).undo.append(functools.partial(_unswitch, m))


def _unswitch(mixer: torch.nn.Module) -> None:
    """Put ``mixer`` back as it was built (``hf.unapply``): its class's forward, no settings; its
    layer's hand-over hook removed and its checkpoint function unwrapped."""
    for name in ("forward", MIXER_SETTINGS_ATTR):
        mixer.__dict__.pop(name, None)
    kept = mixer.__dict__.pop(STATE_ATTR, None)
    layer = None if kept is None else kept.layer
    if layer is not None and (layer_state := layer.__dict__.pop(STATE_ATTR, None)) is not None:
        layer_state.remove_hook("hand")
        checkpoint = layer.__dict__.get("_gradient_checkpointing_func")
        if getattr(checkpoint, _WRAPPED_ATTR, False):
            object.__setattr__(layer, "_gradient_checkpointing_func", checkpoint.__wrapped__)


def _keep_step(root: torch.nn.Module) -> None:
    """A pre-hook on ``root`` (registered once) keeping the shard and group of each call in its
    ``SwitchState.step`` (none: an unsharded call, which the mixers then refuse)."""
    state = switch_state(root)

    def keep(model, args, kwargs):
        state.step = {k: kwargs[k] for k in STEP_KWARGS if k in kwargs}

    state.hook_once("step", lambda: root.register_forward_pre_hook(keep, with_kwargs=True, prepend=True))


def _hand_over(mixer, forward: Callable, root) -> Callable:
    """``forward`` given the step's shard and group by a pre-hook on the mixer's layer (registered
    once per layer): the layer call's own keywords, else ``root``'s call's (``_keep_step``).

    transformers checkpoints a layer's ``forward`` with its hooks outside the checkpoint, so the
    recompute in the backward runs without the pre-hook: were the mixer to read what the last
    pre-hook handed it, a recompute after another forward (two micro-batches, then one backward)
    would run on the other batch's shard. The layer's ``_gradient_checkpointing_func`` is wrapped
    (at each call, as the model may turn checkpointing on later) so that the function it
    checkpoints, first run and recompute alike, hands the mixers this call's keywords."""
    parent = recorded(mixer, "layer")
    if parent is None:
        raise HFIntegrationError(f"apply: {type(mixer).__name__} was not found inside a layer (its layer passes the step's shard)")
    if root is not None:
        _keep_step(root)
    layer_state = switch_state(parent)
    mixers = layer_state.handed

    def hand(layer, args, kwargs):
        picked = {k: kwargs[k] for k in STEP_KWARGS if k in kwargs}
        if SHARD_KWARG not in picked and root is not None:
            picked = switch_state(root).step
        for m in mixers:
            switch_state(m).step = picked
        _hand_on_recompute(layer, mixers)

    layer_state.hook_once("hand", lambda: parent.register_forward_pre_hook(hand, with_kwargs=True))
    if all(m is not mixer for m in mixers):
        mixers.append(mixer)

    def run(self, *args, **kwargs):
        return forward(self, *args, **{**switch_state(self).step, **kwargs})

    return run


def _hand_on_recompute(layer: torch.nn.Module, mixers: list) -> None:
    """Wrap ``layer``'s checkpoint function (when it has one) so that the function it checkpoints
    hands ``mixers`` the keywords they hold now, at the first run and at the recompute."""
    checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
    if checkpoint is None or getattr(checkpoint, _WRAPPED_ATTR, False):
        return

    def checkpointed(function, *args, **kwargs):
        handed = [(m, switch_state(m).step) for m in mixers]

        def with_handed(*a, **k):
            for m, kw in handed:
                switch_state(m).step = kw
            return function(*a, **k)

        return checkpoint(with_handed, *args, **kwargs)

    setattr(checkpointed, _WRAPPED_ATTR, True)
    checkpointed.__wrapped__ = checkpoint  # what unswitch puts back
    object.__setattr__(layer, "_gradient_checkpointing_func", checkpointed)
