"""Never silently wrong: find every module of a model that mixes tokens along the sequence, and
refuse the model before anything changes when one of them would run on a rank's shard alone.

Under sequence parallelism each rank holds ``seq_lens[r]`` consecutive tokens. A position-wise
module (an MLP, a norm, an embedding, a rotary table, an MoE router) computes on them exactly
what it computes on the whole sequence. A module that mixes tokens does not: attention, which
``apply`` switches to the exchange (``model.attention_modules``), and everything else, which
``apply`` does not switch unless a mixer table says how:

* convolutions over the sequence (``nn.Conv1d`` with a kernel longer than 1: Mamba's and
  Gated DeltaNet's causal conv1d, LFM2's short convolutions, Hyena's long convolutions);
* recurrences, state-space models and linear attention (Mamba/Mamba2, Gated DeltaNet, Kimi's
  delta attention, RWKV's time and channel mixing with its token shift, RetNet, Hyena, xLSTM,
  RecurrentGemma's RG-LRU, MiniMax's lightning attention, ``nn.RNN/LSTM/GRU``), which are often
  plain torch code with no telling layer inside;
* attention that ``apply`` cannot switch (a module named attention that does not dispatch
  through transformers' ``AttentionInterface``: it computes its scores itself, or local,
  block-sparse or LSH forms written inline), and chunked attention (Llama 4's
  ``attention_chunk_size`` layers).

Each is found two ways, so that neither a new model's class name nor a recurrence written in
plain torch slips through: by structure (a convolution child with a kernel longer than 1, an
``nn.RNNBase`` child, a padding module (RWKV's token shift), state-space or decay parameters of
its own: ``A_log``, ``dt_bias``, ``time_decay``, ...) and by class name (``_MIXER_NAME``). A
module is reported at the level of the decoder layer's child that holds it (the mixer:
``model.layers.0.linear_attn``), with its class, qualified name and why it was taken for a mixer.

Accepted: the attention modules ``apply`` switches (``attention=``), classes in the ``handled``
table (class name -> how it runs exactly: the hybrid mixers ``apply`` makes sequence-parallel),
and any module that carries ``ulysses_kernels_exact`` (a short reason; a user's own declaration
that the module is position-wise, or already sequence-parallel): each with everything inside it.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .step import HFIntegrationError

__all__ = ["EXACT_ATTR", "TokenMixer", "check_token_mixers", "position_problems", "token_mixers"]

# The declaration a user puts on a module class or instance: a non-empty string saying why the
# module is exact under sequence sharding ("position-wise: a 1x1 conv", "runs its own exchange").
EXACT_ATTR = "ulysses_kernels_exact"

# Class names of sequence mixers that are not softmax attention (case-insensitive search).
_MIXER_NAME = re.compile(
    r"mamba|ssm|selectivescan|gated_?delta|delta_?net|deltarule|kimidelta|delta_?attention|rwkv|time_?mix|channel_?mix|"
    r"token_?shift|retnet|retention|linear_?attention|linear_?attn|lightning|hyena|xlstm|mlstm|slstm|lstm|rnn|recurren|"
    r"rglru|short_?conv|conv|hgrn|mixer|fnet|fourier|liquid",
    re.IGNORECASE,
)
# Short names, matched as CamelCase words only (GLA, GRU, LRU, S4/S4D, EMA, Based, Scan): "Gemma"
# holds "ema", which is no exponential moving average.
_MIXER_WORD = re.compile(r"(?:^|(?<=[a-z0-9_]))(GLA|GRU|LRU|S4D?|S5|EMA|Based|Scan)(?=$|[A-Z0-9_])")
# Attention by name (checked against the modules apply switches).
_ATTENTION_NAME = re.compile(r"attention|attn", re.IGNORECASE)
# Position-wise by name even when another pattern matches (MambaRMSNormGated, ConvNeXt-style
# norms, an SSM block's MLP): a norm, rotary table, embedding, MLP, expert or router never mixes
# tokens. transformers' GPT-2 ``Conv1D`` is a linear layer (excluded by type below).
_POSITION_WISE_WORD = re.compile(r"(rms|layer|group)?norm|rotary|embeddings?|mlp|moe|experts?|router|dropout|activation|output", re.IGNORECASE)
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+")
# A module whose name says it numbers positions (``embed_positions``, ``rotary_emb``, ``wpe``).
_POSITION_MODULE = re.compile(r"position|rotary|pos_?emb|^wpe$", re.IGNORECASE)


def _position_wise_name(name: str) -> bool:
    """A class whose name ends in a position-wise word (its last two CamelCase words):
    ``MambaRMSNormGated``, ``Qwen3NextSparseMoeBlock``, ``Lfm2MLP``; not ``GraniteMoeHybridMambaLayer``."""
    return any(_POSITION_WISE_WORD.fullmatch(w) for w in _WORDS.findall(name)[-2:])


# Parameters a state-space model or a decaying recurrence owns (Mamba/Mamba2/Bamba/Falcon-H1:
# A_log, dt_bias; RWKV: time_decay, time_first, time_mix_*/time_maa_*; RG-LRU: recurrent_param).
_RECURRENCE_PARAMS = re.compile(r"^(A_log|A|dt_bias|dt_proj_bias|time_decay|time_first|time_mix\w*|time_maa\w*|recurrent_param|log_decay|decay)$")


@dataclass(frozen=True)
class TokenMixer:
    """One module that mixes tokens along the sequence and runs on a rank's shard alone."""

    name: str  # qualified name in the model ("model.layers.0.linear_attn")
    cls: str  # class name ("Qwen3_5GatedDeltaNet")
    why: str  # what made it one ("class name ('GatedDelta'); a Conv1d of kernel 4 (conv1d)")

    def describe(self) -> str:
        return f"{self.cls} at {self.name or '<the model>'} ({self.why})"


def _conv_kernel(module: torch.nn.Module) -> int:
    kernel = getattr(module, "kernel_size", 1)
    return max(kernel) if isinstance(kernel, tuple) else int(kernel)


def _mixing_conv(module: torch.nn.Module) -> bool:
    """A convolution whose output token reads several input tokens: a kernel longer than 1, unless
    the kernel tiles its input (stride == kernel, no padding: a ViT/SigLIP patch embedding is a
    linear map of each patch, run on the pixels before sharding)."""
    if not isinstance(module, torch.nn.modules.conv._ConvNd) or _conv_kernel(module) <= 1:
        return False
    unpadded = module.padding == "valid" or (isinstance(module.padding, tuple) and not any(module.padding))
    return not (unpadded and tuple(module.stride) == tuple(module.kernel_size))


def _structure(module: torch.nn.Module) -> list[str]:
    """What ``module`` itself (its own parameters and direct children) has that mixes tokens."""
    found = []
    for child_name, child in module.named_children():
        if _mixing_conv(child):
            found.append(f"a {type(child).__name__} of kernel {_conv_kernel(child)} ({child_name})")
        elif isinstance(child, torch.nn.RNNBase):
            found.append(f"a recurrent {type(child).__name__} ({child_name})")
        elif isinstance(child, (torch.nn.modules.padding._ConstantPadNd, torch.nn.modules.padding._ReflectionPadNd,
                                torch.nn.modules.padding._ReplicationPadNd)):  # fmt: skip
            found.append(f"a {type(child).__name__}: a token shift ({child_name})")
    own = [n for n, _ in module.named_parameters(recurse=False) if _RECURRENCE_PARAMS.match(n)]
    if own:
        found.append(f"state-space / decay parameters {own}")
    return found


def _name_signal(module: torch.nn.Module) -> str | None:
    name = type(module).__name__
    if _position_wise_name(name) or type(module).__module__.startswith("torch."):
        return None  # torch's own layers (nn.Conv1d of kernel 1, nn.LSTM) are judged by structure
    match = _MIXER_NAME.search(name) or _MIXER_WORD.search(name)
    return f"class name ({match.group(0)!r})" if match else None


def _dispatches(module: torch.nn.Module) -> bool:
    """Whether the attention module's ``forward`` calls transformers' attention interface (what
    ``apply`` switches); one that computes its scores itself keeps running on the shard."""
    for cls in type(module).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        try:
            source = inspect.getsource(forward)
        except (OSError, TypeError):
            return True  # no source to read (compiled, built at run time): take the predicate's word
        return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source
    return True


def _chunked(module: torch.nn.Module) -> bool:
    """Llama 4's chunked attention: its layers attend within fixed chunks of the global sequence,
    a mask the ``"ulysses"`` mask function cannot rebuild."""
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None) or ()
    if getattr(config, "attention_chunk_size", None) is None or not isinstance(idx, int) or idx >= len(types):
        return False
    return types[idx] == "chunked_attention"


def _layer_child(path: list[tuple[str, torch.nn.Module]]) -> tuple[str, torch.nn.Module]:
    """The mixer to name for the module at the end of ``path`` (root first): the child of its
    nearest decoder layer (``GradientCheckpointingLayer``, or a ``ModuleList`` entry) that holds it."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers without it
        GradientCheckpointingLayer = ()  # noqa: N806
    for i in range(len(path) - 2, -1, -1):
        parent = path[i][1]
        if isinstance(parent, (GradientCheckpointingLayer, torch.nn.ModuleList)):
            return path[i + 1]
    return path[-1]


def token_mixers(
    model: torch.nn.Module,
    *,
    attention: Iterable[torch.nn.Module] = (),
    handled: Mapping[str, str] | None = None,
    scope: torch.nn.Module | None = None,
    chunked: bool = False,
) -> list[TokenMixer]:
    """Every module of ``model`` (within ``scope``: a vision-language model's text model) that
    mixes tokens along the sequence and is neither one of the ``attention`` modules (those
    ``apply`` switches) nor in ``handled`` (class name -> description) nor marked with
    ``ulysses_kernels_exact``. One entry per mixer, in module order. ``chunked``: the caller
    runs chunked attention layers (Llama 4's: ``apply``'s mask rebuilds them), so they are not
    reported."""
    handled = handled or {}
    switched = {id(m) for m in attention}
    scope = model if scope is None else scope
    prefix = next((n for n, m in model.named_modules() if m is scope), "")
    holds_switched: set[int] = set()  # modules with a switched attention module inside
    for name, m in scope.named_modules():
        if id(m) in switched:
            parts = name.split(".") if name else []
            node = scope
            holds_switched.add(id(node))
            for part in parts:
                node = getattr(node, part) if not part.isdigit() else node[int(part)]
                holds_switched.add(id(node))

    found: dict[str, TokenMixer] = {}

    def visit(path: list[tuple[str, torch.nn.Module]]) -> None:
        name, m = path[-1]
        if getattr(m, EXACT_ATTR, None) or type(m).__name__ in handled or _is_transformers_linear(m):
            return
        why = []
        if id(m) in switched:
            if not _dispatches(m):
                why.append("attention that computes its scores itself instead of calling transformers' AttentionInterface")
            if _chunked(m) and not chunked:
                why.append(f"chunked attention (attention_chunk_size={m.config.attention_chunk_size})")
        else:
            signal = _name_signal(m)
            if signal is not None and not isinstance(m, _containers()):
                why.append(signal)
            elif (
                id(m) not in holds_switched
                and not isinstance(m, _containers())
                and _ATTENTION_NAME.search(type(m).__name__)
                and not _position_wise_name(type(m).__name__)
            ):
                why.append("attention that apply cannot switch (it does not go through transformers' AttentionInterface)")
            why += _structure(m)
        if why:
            at_name, at = _layer_child(path) if id(m) not in switched else (name, m)
            if id(at) in switched or type(at).__name__ in handled or getattr(at, EXACT_ATTR, None):
                at_name, at = name, m  # the mixer sits inside an accepted module: name it alone
            full = ".".join(p for p in (prefix, at_name) if p)
            if full not in found:
                detail = "; ".join(why) if at is m else f"{type(m).__name__} at {'.'.join(p for p in (prefix, name) if p)}: {'; '.join(why)}"
                found[full] = TokenMixer(full, type(at).__name__, detail)
            return  # what is inside a mixer is the mixer's
        for child_name, child in m.named_children():
            visit([*path, (f"{name}.{child_name}" if name else child_name, child)])

    visit([("", scope)])
    return list(found.values())


def position_problems(model: torch.nn.Module, scope: torch.nn.Module | None = None, reads_positions: bool = True) -> list[TokenMixer]:
    """Where ``model`` would number its positions from each rank's shard rather than take the
    global ``position_ids`` that ``shard_batch`` gives (found by the coverage walk: both ran with
    no error and wrong gradients):

    * a text model whose ``forward`` takes ``input_ids`` but no ``position_ids`` (BART-style
      decoders: their learned positions count from 0 on every shard), unless nothing in it reads
      a position (``reads_positions`` false: no attention, no module named for positions; Mamba's
      and Mamba2's models, whose recurrences order the tokens themselves);
    * a learned position table with a ``padding_idx`` (RoBERTa's convention: positions start at
      ``padding_idx + 1`` and are made from ``input_ids``; ``shard_batch``'s start at 0)."""
    scope = model if scope is None else scope
    found = []
    try:
        params = inspect.signature(scope.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        params = {}
    positional = reads_positions or any(_POSITION_MODULE.search(n.rsplit(".", 1)[-1]) for n, _ in scope.named_modules() if n)
    if "input_ids" in params and "position_ids" not in params and positional:
        found.append(TokenMixer("", type(scope).__name__, "its forward takes no position_ids, so each rank would number its shard's positions from 0"))
    prefix = next((n for n, m in model.named_modules() if m is scope), "")
    for name, m in scope.named_modules():
        if isinstance(m, torch.nn.Embedding) and "position" in name.rsplit(".", 1)[-1] and m.padding_idx is not None:
            full = ".".join(p for p in (prefix, name) if p)
            found.append(TokenMixer(full, type(m).__name__, f"positions offset by padding_idx + 1 = {m.padding_idx + 1} and made from input_ids "
                                    "(RoBERTa's convention), where shard_batch numbers global positions from 0"))  # fmt: skip
            break
    return found


def _containers() -> tuple[type, ...]:
    """Modules that hold layers (a match on their name is a match on a layer inside them)."""
    kinds: list[type] = [torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential]
    try:
        from transformers import PreTrainedModel
        from transformers.modeling_layers import GradientCheckpointingLayer

        kinds += [PreTrainedModel, GradientCheckpointingLayer]
    except ImportError:  # pragma: no cover
        pass
    return tuple(kinds)


def _is_transformers_linear(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and not isinstance(module, torch.nn.modules.conv._ConvNd)


def check_token_mixers(
    model: torch.nn.Module,
    handled: Mapping[str, str],
    *,
    attention: Iterable[torch.nn.Module],
    scope: torch.nn.Module | None = None,
    caller: str = "apply",
    chunked: bool = False,
) -> None:
    """Refuse ``model`` (``HFIntegrationError``, nothing changed) when a module mixes tokens along
    the sequence and is neither switched attention, nor in ``handled``, nor marked exact; see
    ``token_mixers``. ``caller`` starts the message (``"apply"``, ``"apply_monkey_patch"``, ...)."""
    attention = list(attention)
    mixers = token_mixers(model, attention=attention, handled=handled, scope=scope, chunked=chunked)
    if not mixers:
        positions = position_problems(model, scope, reads_positions=bool(attention))
        if positions:
            p = positions[0]
            raise HFIntegrationError(
                f"{caller}: {type(model).__name__} cannot take the global positions of a sharded sequence: {p.describe()}. "
                "Under sequence parallelism its positions would differ from one process's: wrong outputs and gradients. "
                "Not supported (docs/hf.md, 'Never silently wrong')"
            )
        return
    first, more = mixers[0], mixers[1:]
    others = ""
    if more:
        shown = "; ".join(f"{m.cls} at {m.name}" for m in more[:4])
        others = f" It has {len(more)} more: {shown}{'; ...' if len(more) > 4 else ''}."
    known = f" and the mixers {', '.join(sorted(handled))}" if handled else " (no other mixer yet)"
    raise HFIntegrationError(
        f"{caller}: {type(model).__name__} has a module that mixes tokens along the sequence and that ulysses_kernels "
        f"does not run sequence-parallel: {first.describe()}.{others} Under sequence parallelism each rank would run it on "
        "its own shard as if the sequence started there: wrong outputs and gradients. Sequence-parallel here: attention "
        f"through transformers' AttentionInterface{known}. Train this model without sequence "
        f"parallelism, or, if {first.cls} is position-wise after all or runs its own exchange, set "
        f"{first.cls}.{EXACT_ATTR} = '<why>' (docs/hf.md, 'Never silently wrong')"
    )
