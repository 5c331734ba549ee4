"""The pieces every sequence-parallel token mixer of ``mixers`` is built from: the one
all-to-all to the rank's heads (``_ToHeads``, ``to_heads``) and back (``to_sequence``), the
call's context (the settings ``switch_mixers`` put on the module, the step's ``SequenceShard``,
the refusals of a cache and a padding mask), the module's kernel functions as transformers
resolved them, the causal conv on the rank's channels and the per-document runs of packed
batches. Under state passing (``_MixerSettings.strategy == "state"``) the same pieces keep the
sequence sharded: ``to_heads``/``to_sequence`` pass the tensors through, ``depthwise_conv`` takes its
halo from the ranks before (``windowed``), ``run_recurrence`` passes the state
(``ulysses_kernels.state_passing``)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...attention import head_to_seq
from ...attention.exchange import a2a_head_to_seq, a2a_seq_to_head
from ...kernels import TorchKernels
from ...layout import Layout
from ...plan import HeadPlan
from ...state_passing import Algebra, local_pieces, preceding, run_sharded
from ..step import GROUP_KWARG, SHARD_KWARG, HFIntegrationError, SequenceShard

# What a family's forward is written with (one module per family, docs/extending.md).
__all__ = [
    "GROUP_KWARG",
    "MIXER_SETTINGS_ATTR",
    "channel_range",
    "depthwise_conv",
    "document_spans",
    "head_ranges",
    "mixer_context",
    "model_kernel",
    "per_document",
    "run_recurrence",
    "to_heads",
    "to_sequence",
    "windowed",
]

_ROLES = ("q", "v")  # per-head tensors on the plan's query ranges, per-group ones on its KV ranges
_HEADS_ONLY = ("q",)
MIXER_SETTINGS_ATTR = "_ulysses_mixer"  # set on each switched mixer by ``switch_mixers``


class _ToHeads(torch.autograd.Function):
    """Sequence-sharded ``heads`` ``[B, s_r, H, W]`` (and ``groups`` ``[B, s_r, G, U]``) ->
    this rank's heads over the whole sequence ``[B, S, h, W]`` (``[B, S, g, U]``), one
    all-to-all; the backward is the reverse exchange, summing the gradient of a group that
    several ranks received (the library's movers, as for q/k/v).

    The pure-PyTorch kernel set packs and unpacks: the Triton and CUDA sets are tested on
    attention's roles and widths, not on these; on a GPU this is a strided copy per role and
    peer (not measured yet)."""

    @staticmethod
    def forward(ctx, layout: Layout, comm, heads, groups=None):
        ctx.layout, ctx.comm = layout, comm
        ctx.roles = _ROLES if groups is not None else _HEADS_ONLY
        tensors = (heads, groups) if groups is not None else (heads,)
        return tuple(a2a_seq_to_head(layout, tensors, ctx.roles, comm, TorchKernels))

    @staticmethod
    def backward(ctx, *grads):
        lay = ctx.layout
        like = next(g for g in grads if g is not None)
        grads = [g if g is not None else like.new_zeros(lay.batch, lay.seq_total, lay.head_count(r, lay.rank), lay.dim(r)) for g, r in zip(grads, ctx.roles)]
        back = a2a_head_to_seq(lay, grads, ctx.roles, ctx.comm, TorchKernels)
        return (None, None, *back) if len(back) == 2 else (None, None, back[0], None)


@dataclass(frozen=True, eq=False)
class _MixerSettings:
    """What ``apply`` set on one mixer: the group, its communicator, the head plan
    (``comm`` ``None``: both come with each step as ``GROUP_KWARG``) and the strategy:
    ``"heads"`` (the exchange to head shards) or ``"state"`` (the sequence stays sharded, the
    state passes between ranks: ``ulysses_kernels.state_passing``; ``plan`` is then one rank's,
    holding every head)."""

    group: object
    comm: object
    plan: HeadPlan
    family: str
    strategy: str = "heads"

    @property
    def state(self) -> bool:
        return self.strategy == "state"


def model_kernel(module, name: str) -> Callable:
    """The kernel function ``name`` of ``module``'s transformers module (what its forward calls)."""
    fn = getattr(sys.modules.get(type(module).__module__), name, None)
    if not callable(fn):
        raise HFIntegrationError(f"apply: {type(module).__name__}'s module has no {name} (transformers changed?)")
    return fn


def mixer_context(module, kwargs, cache, attention_mask) -> tuple[_MixerSettings, SequenceShard]:
    """A family forward's first call: ``(the settings switch_mixers put on module, the step's
    SequenceShard)`` from the forward's keywords, after refusing what no mixer runs (a cache, a
    padding mask, state passing over a zigzag layout, a shard made for another group)."""
    settings = getattr(module, MIXER_SETTINGS_ATTR)
    shard = kwargs.get(SHARD_KWARG)
    name = type(module).__name__
    if settings.comm is None:
        group, comm = kwargs[GROUP_KWARG]  # present: ``_per_step`` checked it
        settings = dataclasses.replace(settings, group=group, comm=comm)
    if not isinstance(shard, SequenceShard):
        raise HFIntegrationError(
            f"{name}: the model runs sequence-parallel but was called without a sequence shard; feed it "
            "model(**ulysses_kernels.integrations.hf.shard_batch(input_ids, group=group).model_inputs())"
        )
    if cache is not None:
        raise HFIntegrationError(f"{name}: a cache (past_key_values / use_cache=True) is not supported sequence-parallel; run with use_cache=False")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise HFIntegrationError(f"{name}: a padding attention_mask is not supported; drop it and set padded labels to -100")
    if settings.state and shard.ring_layout is not None:
        raise HFIntegrationError(f"{name}: state passing needs contiguous shards, got a {shard.ring_layout[2]} layout; shard with seq_layout='contiguous'")
    if (shard.rank, shard.world_size) != (settings.comm.rank, settings.comm.world_size):
        raise HFIntegrationError(
            f"{name}: the batch was sharded for rank {shard.rank} of {shard.world_size} but apply() was given a group in which "
            f"this process is rank {settings.comm.rank} of {settings.comm.world_size}; pass the same group to apply and shard_batch"
        )
    return settings, shard


def to_heads(settings: _MixerSettings, shard: SequenceShard, heads, groups=None):
    """``_ToHeads`` over the layer's plan and the step's shards (state passing: the tensors as they are)."""
    if settings.state:
        return (heads,) if groups is None else (heads, groups)
    lay = Layout(settings.plan, settings.comm.rank, tuple(shard.seq_lens), heads.shape[0], heads.shape[3],
                 groups.shape[3] if groups is not None else None)  # fmt: skip
    return _ToHeads.apply(lay, settings.comm, heads.contiguous(), None if groups is None else groups.contiguous())


def to_sequence(settings: _MixerSettings, shard: SequenceShard, out):
    """``[B, S, h, D]`` over the rank's heads -> ``[B, s_r, H, D]`` (the library's ``head_to_seq``;
    state passing: already so)."""
    if settings.state:
        return out
    return head_to_seq(out, settings.plan, group=settings.group, seq_lens=list(shard.seq_lens), comm=settings.comm)


def document_spans(shard: SequenceShard) -> list[tuple[int, int]]:
    """The documents ``(start, end)`` of the global sequence (one span when not packed)."""
    if shard.documents is not None and shard.documents.rows > 1:
        raise HFIntegrationError(f"mixers other than attention (linear attention, SSMs) take packed documents at batch 1, got {shard.documents.rows} rows")
    return shard.documents.spans() if shard.documents is not None else [(0, shard.total)]


def run_recurrence(settings: _MixerSettings, shard: SequenceShard, run, algebra: Algebra, *tensors):
    """The layer's recurrence ``run(*tensors, initial_state) -> (out, final_state)`` per
    document: over the whole sequence of the rank's heads (``"heads"``), or over the rank's
    shard with the state passed between ranks (``"state"``: ``state_passing.run_sharded``)."""
    if settings.state:
        return run_sharded(settings.comm, shard.seq_lens, document_spans(shard), run, algebra, tensors)
    return per_document(shard, lambda *t: run(*t, None)[0], *tensors)


def per_document(shard: SequenceShard, fn, *tensors, dim: int = 1):
    """``fn`` on each document's slice of ``tensors`` (along ``dim``), joined back."""
    spans = document_spans(shard)
    if len(spans) == 1:
        return fn(*tensors)
    return torch.cat([fn(*(t.narrow(dim, a, b - a) for t in tensors)) for a, b in spans], dim=dim)


def depthwise_conv(settings: _MixerSettings, module, conv: torch.nn.Conv1d, channels: torch.Tensor, shard, x: torch.Tensor, activation) -> torch.Tensor:
    """The layer's causal depthwise conv1d on the rank's ``channels`` (indices into the conv's
    channels) of ``x`` ``[B, S, C_r]``, per document, with the module's ``causal_conv1d_fn``."""
    fn = model_kernel(module, "causal_conv1d_fn")
    weight = conv.weight.squeeze(1).index_select(0, channels)
    bias = None if conv.bias is None else conv.bias.index_select(0, channels)

    def run(x):
        return fn(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)

    if not settings.state:
        return per_document(shard, run, x)
    return windowed(settings, shard, x, run, conv.kernel_size[0] - 1)


def windowed(settings: _MixerSettings, shard: SequenceShard, x: torch.Tensor, run, halo: int) -> torch.Tensor:
    """State passing's causal conv: ``run`` (a causal conv of ``halo + 1`` taps on ``[B, L, C]``)
    on the shard's tokens after the ``halo`` before it (``state_passing.preceding``), per
    document piece of that window; the halo's own outputs are dropped."""
    comm = settings.comm
    before = preceding(comm, shard.seq_lens, x, halo)
    lead = before.shape[1]
    window = torch.cat([before, x], dim=1)
    pieces, _ = local_pieces(shard.seq_lens, comm.rank, document_spans(shard), lead)
    out = torch.cat([run(window[:, a:b]) for a, b in pieces], dim=1) if len(pieces) > 1 else run(window)
    return out[:, lead:]


def head_ranges(settings: _MixerSettings) -> tuple[tuple[int, int], tuple[int, int], tuple[int, ...]]:
    """This rank's ``(heads [h0, h1), groups [g0, g1), the group of each of its heads)`` (state
    passing: every head and group, the plan being one rank's)."""
    rank = 0 if settings.state else settings.comm.rank
    plan = settings.plan
    return plan.q_ranges[rank], plan.kv_ranges[rank], plan.local_kv_map(rank)


def channel_range(a: int, b: int, scale: int, offset: int, device) -> torch.Tensor:
    """The channel indices of heads ``[a, b)`` of ``scale`` channels each, after ``offset``
    (a conv weight's rows for the rank's heads)."""
    return torch.arange(offset + a * scale, offset + b * scale, device=device)
