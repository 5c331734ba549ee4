"""Sequence parallelism for Hugging Face transformers models in one call.

    from ulysses_kernels.integrations import hf

    hf.apply(model, group)                       # once, after building the model
    for input_ids in loader:                     # the same global batch on every rank
        batch = hf.shard_batch(input_ids, group=group)
        out = model(**batch.model_inputs())      # loss = this rank's share of the mean
        out.loss.backward()
        hf.sync_gradients(model, group)          # all-reduce SUM over the group
        opt.step(); opt.zero_grad()
        print(hf.reduce_loss(out.loss, group))   # the global mean loss

``apply`` registers ``ulysses_attention`` in transformers' ``AttentionInterface`` (and a
mask function in ``AttentionMaskInterface``) under the name ``"ulysses"`` and switches the
model to it with ``set_attn_implementation``; no model class is patched. The process-group
settings live on the model's own attention modules; the per-step sequence layout
(``seq_lens``) travels with the batch as the ``ulysses_shard`` keyword that transformers
passes down to every attention call. Nothing is stored in module-level state.

Layout of one step, global sequence of ``S`` tokens over ``P`` ranks::

    input_ids  [B, S]           every rank holds the same global batch
    labels     [B, S]           shifted once, globally: target[t] = labels[t + 1], last = -100
    positions  [B, S]           0 .. S-1 (global, so RoPE is right on every shard)
      | shard_batch: rank r keeps columns [start_r, start_r + seq_lens[r])
    rank r     [B, seq_lens[r]] input_ids, shifted labels, global positions

Supported: decoder-only causal LMs whose attention goes through ``AttentionInterface``
(Llama, Qwen2/Qwen3, Mistral with ``sliding_window=None``), any head layout (GQA with
fewer KV heads than ranks, heads not divisible by the ranks), uneven shards or padding.
Not supported (clear errors): padding/packed-sequence/custom masks, sliding windows,
logit softcapping, attention dropout, KV caches (generation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..attention import ulysses_attention
from ..checks import UlyssesInputError
from ..comm import get_communicator
from ..layout import split_lengths  # the project's one rule for uneven shards (re-exported here)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HFIntegrationError",
    "SequenceShard",
    "ShardedBatch",
    "apply",
    "shard_batch",
    "split_lengths",
    "reduce_loss",
    "sync_gradients",
    "gather_sequence",
]

ATTN_IMPLEMENTATION = "ulysses"
_SETTINGS_ATTR = "_ulysses_settings"  # set on each attention module by ``apply``
_SHARD_KWARG = "ulysses_shard"  # the per-step ``SequenceShard`` in the model's kwargs


class HFIntegrationError(UlyssesInputError):
    """A model, batch or group that the transformers integration cannot run."""


# --------------------------------------------------------------------------------------
# The per-step context and the data side
# --------------------------------------------------------------------------------------


@dataclass(eq=False)
class SequenceShard:
    """How one step's global sequence is split over the group (the same on every rank).

    ``seq_lens[r]`` tokens live on rank ``r`` (contiguous, in rank order); ``total`` is
    ``sum(seq_lens)`` (the padded length), ``valid_len`` the length before padding.
    Passed to the model as the ``ulysses_shard`` keyword; the attention function reads it.
    """

    seq_lens: tuple[int, ...]
    rank: int
    world_size: int
    valid_len: int
    batch_size: int
    # Input signatures already validated across ranks in this step (one check per step,
    # not per layer); the same on every rank because every rank runs the same layers.
    _checked: set = field(default_factory=set, repr=False)

    @property
    def total(self) -> int:
        return sum(self.seq_lens)

    @property
    def start(self) -> int:
        return sum(self.seq_lens[: self.rank])

    @property
    def local_len(self) -> int:
        return self.seq_lens[self.rank]

    def shard(self, x: torch.Tensor, dim: int = 1, pad_value=0) -> torch.Tensor:
        """This rank's slice of a global per-token tensor (padded with ``pad_value`` first)."""
        if x.shape[dim] not in (self.valid_len, self.total):
            raise HFIntegrationError(
                f"SequenceShard.shard: x.shape[{dim}] expected {self.valid_len} (the global length), got {x.shape[dim]}"
            )
        if x.shape[dim] < self.total:
            pad_shape = list(x.shape)
            pad_shape[dim] = self.total - x.shape[dim]
            x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)
        return x.narrow(dim, self.start, self.local_len).contiguous()


@dataclass
class ShardedBatch:
    """One rank's share of a causal-LM batch, made by ``shard_batch``.

    ``input_ids``, ``labels`` (already shifted: the target of each position, ``-100`` where
    there is none) and ``position_ids`` (global) are ``[batch, seq_lens[rank]]``.
    ``num_tokens`` counts the targets that are not ``-100`` over the *global* batch (the
    loss denominator; the same on every rank).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    num_tokens: int
    shard: SequenceShard

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self.shard.seq_lens

    def model_inputs(self, loss: bool = True) -> dict:
        """Keyword arguments for ``model(**...)``.

        With ``loss=True`` the model computes ``sum(token losses on this rank) / num_tokens``
        through transformers' own causal-LM loss (``shift_labels`` = our globally shifted
        labels, ``num_items_in_batch`` = the global count), so the losses of the ranks add
        up to the global mean and their gradients add up to its gradient.
        """
        kw = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False, _SHARD_KWARG: self.shard}
        if loss:
            kw.update(labels=self.labels, shift_labels=self.labels, num_items_in_batch=max(self.num_tokens, 1))
        return kw

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global mean loss from ``[batch, seq_local, vocab]`` logits.

        Computed in the logits' dtype (half precision is upcast to float32), whereas
        transformers' own loss (``out.loss``) always computes in float32.
        """
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), self.labels.flatten().to(logits.device), ignore_index=-100, reduction="sum"
        )
        return ce / max(self.num_tokens, 1)


def _rank_world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise HFIntegrationError("a group was given but torch.distributed is not initialized")
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise HFIntegrationError(f"this process (global rank {dist.get_rank()}) is not a member of the given group")
    return rank, dist.get_world_size(group)


def shard_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    group=None,
    position_ids: torch.Tensor | None = None,
    pad: bool = False,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    check: bool = True,
) -> ShardedBatch:
    """Shard one global causal-LM batch along the sequence for this rank.

    Args:
        input_ids: ``[batch, seq]`` int64, the *global* batch, the same on every rank of
            ``group``.
        labels: ``[batch, seq]`` unshifted targets in transformers' convention (usually
            ``input_ids`` with ``-100`` on ignored tokens); default ``input_ids``. They are
            shifted here, once, over the global sequence, so the target of rank r's last
            token is rank r+1's first token.
        group: the sequence-parallel group (the one given to ``apply``).
        position_ids: ``[batch or 1, seq]`` global positions; default ``0 .. seq-1``. They
            must count up by one (packed sequences that restart positions need a
            block-diagonal mask, which is not supported).
        pad: ``False`` (default): uneven shards, ``seq_lens = split_lengths(seq, world)``.
            ``True``: pad the sequence with ``pad_token_id`` up to a multiple of the world
            size (targets ``-100``, positions continuing); the padding comes last, so
            causal attention never lets a real token see it. Both are exact.
        check: exchange ``(batch, seq, target count)`` across the group once, so that ranks
            fed different batches raise the same error on every rank.

    Returns:
        ``ShardedBatch`` with this rank's ``input_ids``, shifted ``labels``, global
        ``position_ids``, the global ``num_tokens`` and the ``shard`` layout.
    """
    rank, world = _rank_world(group)
    labels = _checked_labels(input_ids, labels)
    position_ids = _global_positions(input_ids, position_ids)
    bsz, seq = input_ids.shape
    total, seq_lens = _shard_lengths(seq, world, pad)
    shifted, num_tokens = _shift_labels(labels, ignore_index)
    if check and world > 1:
        _check_same_batch(group, input_ids.device, bsz, seq, total, num_tokens)

    shard = SequenceShard(tuple(seq_lens), rank, world, seq, bsz)
    return ShardedBatch(
        input_ids=shard.shard(input_ids, pad_value=pad_token_id),
        labels=shard.shard(shifted, pad_value=-100),
        # Positions count up by one (checked by _global_positions), so the padded ones simply continue.
        position_ids=shard.shard(position_ids[:, :1] + torch.arange(total, device=input_ids.device)),
        num_tokens=num_tokens,
        shard=shard,
    )


def _checked_labels(input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """``labels`` (default ``input_ids``) after checking that both are ``[batch, seq]``."""
    if input_ids.dim() != 2:
        raise HFIntegrationError(f"shard_batch: input_ids expected [batch, seq], got shape {list(input_ids.shape)}")
    if labels is None:
        labels = input_ids
    if labels.shape != input_ids.shape:
        raise HFIntegrationError(f"shard_batch: labels.shape expected {list(input_ids.shape)}, got {list(labels.shape)}")
    return labels


def _global_positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """``[batch, seq]`` global positions: ``0 .. seq-1`` by default, else ``position_ids``
    (``[batch or 1, seq]``) expanded, after checking that they count up by one."""
    bsz, seq = input_ids.shape
    if position_ids is None:
        return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(bsz, seq)
    if position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, bsz):
        raise HFIntegrationError(
            f"shard_batch: position_ids expected [{bsz} or 1, {seq}], got shape {list(position_ids.shape)}"
        )
    position_ids = position_ids.expand(bsz, seq)
    if seq > 1 and not bool((position_ids.diff(dim=1) == 1).all()):
        raise HFIntegrationError(
            "shard_batch: position_ids must count up by one along the sequence; restarting positions "
            "(packed sequences) need a block-diagonal mask, which the ulysses integration does not support"
        )
    return position_ids


def _shard_lengths(seq: int, world: int, pad: bool) -> tuple[int, list[int]]:
    """``(total, seq_lens)``: with ``pad``, ``seq`` padded up to a multiple of ``world`` and
    split evenly; without, ``seq`` split by ``split_lengths`` (uneven shards)."""
    if pad:
        total = math.ceil(seq / world) * world
        return total, [total // world] * world
    if seq < world:
        raise HFIntegrationError(
            f"shard_batch: the sequence ({seq} tokens) is shorter than the group ({world} ranks); use pad=True"
        )
    return seq, split_lengths(seq, world)


def _shift_labels(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, int]:
    """The global label shift, done once before sharding: ``(shifted, num_tokens)`` where the
    target of position t is ``labels[t + 1]`` (the last position has none), ignored targets
    are ``-100`` whatever ``ignore_index`` was, and ``num_tokens`` counts the others."""
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    if ignore_index != -100:
        shifted = torch.where(shifted == ignore_index, torch.full_like(shifted, -100), shifted)
    return shifted, int((shifted != -100).sum())


def _check_same_batch(group, device: torch.device, bsz: int, seq: int, total: int, num_tokens: int) -> None:
    """One all-gather of ``(batch, seq, padded length, target count)``: ranks fed different
    batches raise the same error on every rank. Collective."""
    everyone = get_communicator(group).all_gather_ints([bsz, seq, total, num_tokens], device)
    if any(v != everyone[0] for v in everyone):
        rows = ", ".join(f"rank {r}: batch={v[0]} seq={v[1]} padded={v[2]} targets={v[3]}" for r, v in enumerate(everyone))
        raise HFIntegrationError(
            "shard_batch: the ranks of the sequence-parallel group were given different batches "
            f"(every rank must pass the same global batch): {rows}"
        )


def reduce_loss(loss: torch.Tensor, group=None) -> torch.Tensor:
    """The global mean loss: the SUM over the group of each rank's ``out.loss`` (detached).

    Each rank's loss is ``sum(its token losses) / num_tokens(global)``, so the sum is the
    mean over all tokens of the global batch. Collective: call it on every rank.
    """
    total = loss.detach().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def sync_gradients(model: torch.nn.Module, group=None) -> None:
    """All-reduce SUM the parameter gradients over the sequence-parallel group.

    After ``out.loss.backward()`` each rank holds the gradient of its share of the loss;
    the sum is the gradient of the global mean loss (what one process would compute).
    One collective per (dtype, device). With data parallelism on top, reduce over the
    data-parallel group separately (as usual, averaging there).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def gather_sequence(x: torch.Tensor, shard: SequenceShard, group=None, dim: int = 1) -> torch.Tensor:
    """Every rank's ``x`` (``seq_lens[r]`` long along ``dim``) joined into the global sequence.

    Padding is dropped (the result is ``shard.valid_len`` long). Not differentiable: use it
    for evaluation and logging (e.g. full logits). Collective: call it on every rank.
    """
    if x.shape[dim] != shard.local_len:
        raise HFIntegrationError(f"gather_sequence: x.shape[{dim}] expected {shard.local_len} (this rank's shard), got {x.shape[dim]}")
    if shard.world_size == 1:
        return x.narrow(dim, 0, shard.valid_len)
    width = max(shard.seq_lens)
    padded = x.detach()
    if x.shape[dim] < width:
        pad_shape = list(x.shape)
        pad_shape[dim] = width - x.shape[dim]
        padded = torch.cat([padded, padded.new_zeros(pad_shape)], dim=dim)
    parts = [torch.empty_like(padded) for _ in range(shard.world_size)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    full = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, shard.seq_lens)], dim=dim)
    return full.narrow(dim, 0, shard.valid_len)


# --------------------------------------------------------------------------------------
# The model side
# --------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Settings:
    """What ``apply`` chose for one model; held by each of its attention modules."""

    group: object
    comm: object
    attn_fn: object
    kernels: object
    chunks: int | str
    check: str


def _fail_module(module) -> HFIntegrationError:
    return HFIntegrationError(
        f"{type(module).__name__}: the model's attention implementation is {ATTN_IMPLEMENTATION!r} but this "
        "module was not prepared by ulysses_kernels.integrations.hf.apply (call apply(model, group) on the "
        "model that owns it)"
    )


def _ulysses_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """transformers attention function: ``[B, H, s_local, D]`` q/k/v in, ``[B, s_local, Hq, D]`` out.

    k/v arrive un-repeated (GQA); ``ulysses_attention`` keeps them grouped. The causal
    mask is global (built by ``ulysses_attention``), so transformers' local mask must be
    ``None`` (our mask function makes sure of it).
    """
    settings, shard = _call_context(module, kwargs)
    _check_supported(module, shard, attention_mask, dropout, sliding_window, softcap, kwargs)
    comm = settings.comm
    _check_sharded_input(type(module).__name__, shard, comm, query)

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # -> [B, s_local, H, D]
    sig = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, scaling)
    check = settings.check == "always" or (settings.check == "step" and sig not in shard._checked)
    out = ulysses_attention(
        q, k, v, settings.group, causal=True, softmax_scale=scaling, seq_lens=shard.seq_lens,
        attn_fn=settings.attn_fn, comm=comm, kernels=settings.kernels, chunks=settings.chunks, check=check,
    )  # fmt: skip
    if check:
        shard._checked.add(sig)
    return out, None


def _call_context(module, kwargs) -> tuple[_Settings, SequenceShard]:
    """What ``apply`` set on ``module`` and the step's ``SequenceShard`` from the model's kwargs."""
    settings = getattr(module, _SETTINGS_ATTR, None)
    if settings is None:
        raise _fail_module(module)
    shard = kwargs.get(_SHARD_KWARG)
    if not isinstance(shard, SequenceShard):
        raise HFIntegrationError(
            f"{type(module).__name__}: the model runs sequence-parallel attention but was called without a sequence shard; "
            "feed it model(**ulysses_kernels.integrations.hf.shard_batch(input_ids, group=group).model_inputs()) "
            "(each rank then holds its slice of the sequence and the global positions)"
        )
    return settings, shard


def _check_supported(module, shard: SequenceShard, attention_mask, dropout, sliding_window, softcap, kwargs) -> None:
    """Raise on what plain causal attention over the global sequence cannot honor: a mask,
    dropout, softcapping, a window shorter than the sequence, attention sinks, non-causal."""
    name = type(module).__name__
    if attention_mask is not None:
        raise HFIntegrationError(
            f"{name}: an explicit attention mask reached sequence-parallel attention (shape "
            f"{list(attention_mask.shape)}); only plain causal attention over the global sequence is supported: "
            "drop attention_mask (use labels=-100 for padding)"
        )
    if dropout:
        raise HFIntegrationError(f"{name}: attention dropout ({dropout}) is not supported; set config.attention_dropout = 0.0")
    if softcap is not None:
        raise HFIntegrationError(f"{name}: attention logit softcapping ({softcap}) is not supported")
    if sliding_window is not None and shard.valid_len > sliding_window:
        raise HFIntegrationError(
            f"{name}: sliding-window attention (window {sliding_window}) over {shard.valid_len} tokens is not supported"
        )
    if kwargs.get("s_aux") is not None:
        raise HFIntegrationError(f"{name}: attention sinks (s_aux) are not supported")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise HFIntegrationError(f"{name}: non-causal attention is not supported (ulysses applies a global causal mask)")


def _check_sharded_input(name: str, shard: SequenceShard, comm, query: torch.Tensor) -> None:
    """The batch was sharded for this rank of ``comm``'s group, and ``query``
    (``[B, H, s_local, D]``) is this rank's shard of it."""
    if (shard.rank, shard.world_size) != (comm.rank, comm.world_size):
        raise HFIntegrationError(
            f"{name}: the batch was sharded for rank {shard.rank} of {shard.world_size} but apply() was given a group "
            f"in which this process is rank {comm.rank} of {comm.world_size}; pass the same group to apply and shard_batch"
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


def _ulysses_mask(*args, mask_function=None, attention_mask=None, **kwargs):
    """Mask function for ``AttentionMaskInterface``: verify that plain causal is wanted, build nothing.

    Called once per forward (not per layer). A padding mask or a packed-sequence,
    sliding-window or custom overlay would change the causal mask, which we cannot
    honor across shards, so it raises instead of being silently dropped.
    """
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        raise HFIntegrationError(
            "sequence-parallel attention supports the plain causal mask only; the model asked for another "
            "(sliding window, packed sequences detected from restarting position_ids, or a custom overlay)"
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise HFIntegrationError(
            "sequence-parallel attention got a padding attention_mask with masked tokens; padding is not "
            "supported as a mask: drop attention_mask and set the padded labels to -100 (shard_batch does this)"
        )
    return None


def _attention_modules(model) -> list[torch.nn.Module]:
    # transformers' attention modules (Llama, Qwen2, Mistral, ...) carry these three.
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("scaling", "is_causal", "config")) and hasattr(m, "head_dim")]


def _check_config(config) -> None:
    cls = type(config).__name__
    if getattr(config, "sliding_window", None) is not None or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise HFIntegrationError(
            f"apply: {cls} uses sliding-window attention (sliding_window={getattr(config, 'sliding_window', None)}), "
            "which sequence-parallel attention does not support; when every training sequence is at most the "
            "window long the window has no effect and you may set config.sliding_window = None before building the model"
        )
    for attr in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, attr, None) is not None:
            raise HFIntegrationError(f"apply: {cls}.{attr} = {getattr(config, attr)}: logit softcapping is not supported")
    if getattr(config, "attention_dropout", 0.0):
        raise HFIntegrationError(
            f"apply: {cls}.attention_dropout = {config.attention_dropout}: attention dropout is not supported; set it to 0.0"
        )
    if not getattr(config, "is_causal", True):
        raise HFIntegrationError(f"apply: {cls}.is_causal = False: only causal (decoder) attention is supported")


def register() -> None:
    """Register the ``"ulysses"`` attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _ulysses_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _ulysses_mask)


def apply(model, group=None, *, attn_fn=None, kernels=None, chunks: int | str = 1, check: str = "step", comm=None):
    """Route a transformers model's attention through ``ulysses_attention`` over ``group``.

    Args:
        model: a ``transformers.PreTrainedModel`` whose attention uses ``AttentionInterface``
            (Llama, Qwen2, Qwen3, Mistral, ... families), causal, without sliding window,
            softcapping or attention dropout.
        group: the sequence-parallel process group (default: the world).
        attn_fn, kernels, chunks: passed to ``ulysses_attention``.
        check: ``"step"`` (default): validate the inputs across ranks at the first attention
            call of each step (one tiny all-gather per step); ``"always"``: every layer;
            ``"never"``: no exchange.
        comm: a communicator (default: torch.distributed's; with
            ``ULYSSES_KERNELS_NATIVE_NCCL=1``, opt-in until native NCCL has run on a GPU, a
            native ``NCCLCommunicator`` on NCCL groups, made here and owned by the model).

    Returns the model (changed in place: ``config._attn_implementation == "ulysses"``). Its
    forward then expects ``shard_batch(...).model_inputs()``. The model's GQA layout,
    ``module.scaling`` and RoPE (from the global ``position_ids``) are kept.
    """
    try:
        from transformers import PreTrainedModel
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise HFIntegrationError("apply: transformers is not installed (pip install transformers)") from e
    if not isinstance(model, PreTrainedModel):
        raise HFIntegrationError(
            f"apply: expected a transformers PreTrainedModel, got {type(model).__name__}; other modules can call "
            "ulysses_kernels.ulysses_attention directly"
        )
    if check not in ("step", "always", "never"):
        raise HFIntegrationError(f"apply: check expected 'step', 'always' or 'never', got {check!r}")
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise HFIntegrationError(
            f"apply: {type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so its attention cannot be routed to ulysses_attention"
        )
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}
    for config in configs.values():
        _check_config(config)
    modules = _attention_modules(model)
    if not modules:
        raise HFIntegrationError(f"apply: found no attention modules in {type(model).__name__}")
    register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    wrong = sorted({type(m).__name__ for m in modules if getattr(m.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION})
    if wrong:
        raise HFIntegrationError(f"apply: could not switch the attention implementation of {', '.join(wrong)} to {ATTN_IMPLEMENTATION!r}")
    settings = _Settings(group, get_communicator(group, comm, native=True), attn_fn, kernels, chunks, check)
    for m in modules:
        # A plain attribute on the module instance (not a parameter or buffer): the group
        # settings belong to this model, not to the process.
        object.__setattr__(m, _SETTINGS_ATTR, settings)
    return model

