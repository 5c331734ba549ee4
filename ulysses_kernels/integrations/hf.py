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

``apply`` registers an attention function in transformers' ``AttentionInterface`` (and a
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

One attention call (``_ulysses_attention_forward``), q/k/v ``[B, H, seq_lens[r], D]``:

    plain causal (no window shorter than S, no softcap, no sinks, no dropout) and a
    built-in implementation: the fused ``ulysses_attention`` (SDPA/flash, chunked overlap)
    otherwise: seq_to_head -> this rank's heads over all S tokens -> the model's own
    attention implementation (eager, sdpa, flash_attention_2/3, a registered one) with
    the model's keywords, per-head sinks sliced to the rank's heads, the layer type's
    mask rebuilt over global positions -> head_to_seq

Under Ulysses a window, a softcap or a sink is local to a head: after the exchange each
rank holds the whole sequence for its heads, so the model's attention computes exactly
what one process would (attention dropout draws its own random mask on each rank).

Packed sequences (batch 1, documents end to end, as ``DataCollatorWithFlattening`` makes
them): ``shard_batch`` finds the documents from position ids that restart at 0 (or takes
``cu_seqlens``), keeps the per-document positions (RoPE as if each document ran alone),
drops the target of each document's last token, and puts the global boundaries on the
step's ``SequenceShard``; every layer passes them to ``ulysses_attention(cu_seqlens=...)``
(block-diagonal attention; the boundaries are found once per step, never gathered per layer).
Layers that run the model's own attention (windows, softcapping, sinks) get the documents
overlaid on the global mask they build (the ``eager`` and ``sdpa`` implementations).

Supported: decoder-only causal LMs whose attention goes through ``AttentionInterface``
(Llama, Qwen2/Qwen3, Mistral, Gemma 2/3, GPT-OSS: sliding windows, mixed layer types,
logit softcapping, attention sinks, attention dropout), any head layout (GQA with fewer KV
heads than ranks, heads not divisible by the ranks), uneven shards or padding, packed
documents (plain causal layers on any built-in implementation; windows, softcapping, sinks
on ``eager``/``sdpa``).
Not supported (clear errors): padding/custom masks, packed documents on the model's own
attention with flash or a registered implementation, chunked or bidirectional attention,
KV caches (generation).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..attention import head_to_seq, seq_to_head, ulysses_attention
from ..backends import expand_kv
from ..checks import UlyssesInputError, by_value
from ..comm import get_communicator
from ..documents import Documents, boundaries_digest, document_ids, documents, first_unordered, pad_documents
from ..layout import split_lengths  # the project's one rule for uneven shards (re-exported here)
from ..longctx.install import enable as enable_long_context
from ..plan import HeadPlan
from ..ring import SPGroups, shard_rows

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HFIntegrationError",
    "SequenceShard",
    "ShardedBatch",
    "apply",
    "attention_settings",
    "sequence_parallel_attention",
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
    ``documents``: a packed batch's global document boundaries over ``total`` tokens (the
    padding, if any, is the last document), ``None`` for ordinary batches.
    ``ring_layout``: ``(ulysses_size, ring_size, "zigzag")`` for a 2-D group whose
    ``seq_layout`` is zigzag: rank r then holds ``ring.shard_rows`` of the sequence (two
    chunks), not a contiguous slice; ``None``: contiguous.
    Passed to the model as the ``ulysses_shard`` keyword; the attention function reads it.
    """

    seq_lens: tuple[int, ...]
    rank: int
    world_size: int
    valid_len: int
    batch_size: int
    documents: Documents | None = None
    ring_layout: tuple[int, int, str] | None = None
    # Input signatures already validated across ranks in this step (one check per step,
    # not per layer); the same on every rank because every rank runs the same layers.
    _checked: set = field(default_factory=set, repr=False)
    # Global attention masks built in this step, one per (implementation, window, dtype,
    # device): each layer type's mask is built once per step, at its first layer.
    _masks: dict = field(default_factory=dict, repr=False)

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
        if self.ring_layout is not None:
            return x.index_select(dim, self.rows(self.rank).to(x.device))
        return x.narrow(dim, self.start, self.local_len).contiguous()

    def rows(self, rank: int) -> torch.Tensor:
        """The global positions rank ``rank`` holds (int64, ascending)."""
        if self.ring_layout is not None:
            return shard_rows(self.total, *self.ring_layout[:2], rank, self.ring_layout[2])
        start = sum(self.seq_lens[:rank])
        return torch.arange(start, start + self.seq_lens[rank])


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


def _process_group(group):
    """The process group of the whole sequence-parallel group (an ``SPGroups``' ``group``)."""
    return group.group if isinstance(group, SPGroups) else group


def _rank_world(group) -> tuple[int, int]:
    if isinstance(group, SPGroups):
        if group.rank is None:
            raise HFIntegrationError(f"this process (global rank {dist.get_rank()}) is not a member of the given SPGroups")
        return group.rank, group.world_size
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
    cu_seqlens=None,
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
            count up by one, or (a packed batch: batch 1, ``DataCollatorWithFlattening``'s
            format) restart at 0 at the start of each document.
        pad: ``False`` (default): uneven shards, ``seq_lens = split_lengths(seq, world)``.
            ``True``: pad the sequence with ``pad_token_id`` up to a multiple of the world
            size (targets ``-100``, positions continuing); the padding comes last, so
            causal attention never lets a real token see it. Both are exact.
        check: exchange ``(batch, seq, target count, a fingerprint of the tokens, targets and
            document boundaries)`` across the group once (one all-gather of 6 integers), so
            that ranks fed different batches raise the same error on every rank, including
            batches of the same shape (a sampler that shards by global rank instead of by
            data-parallel rank).
        cu_seqlens: a packed batch's document boundaries ``(0, ..., seq)`` (a list or an
            integer tensor), instead of restarting ``position_ids``. Packed: attention stays
            inside each document, positions restart per document, the last token of each
            document has no target; with ``pad`` the padding is a trailing document.

    Returns:
        ``ShardedBatch`` with this rank's ``input_ids``, shifted ``labels``, global
        ``position_ids``, the global ``num_tokens`` and the ``shard`` layout.
    """
    rank, world = _rank_world(group)
    labels = _checked_labels(input_ids, labels)
    cu = _packed_boundaries(input_ids, position_ids, cu_seqlens)
    if cu is None:
        position_ids = _global_positions(input_ids, position_ids)
    bsz, seq = input_ids.shape
    total, seq_lens = _shard_lengths(seq, world, pad)
    ring_layout = None
    if isinstance(group, SPGroups):
        total, seq_lens = _check_2d_shards(group, seq, total, seq_lens, pad)
        ring_layout = None if group.seq_layout == "contiguous" else (group.ulysses_size, group.ring_size, group.seq_layout)
    shifted, num_tokens = _shift_labels(labels, ignore_index, cu)
    if check and world > 1:
        _check_same_batch(_process_group(group), input_ids.device, bsz, seq, total, num_tokens, 0 if cu is None else len(cu),
                          _fingerprint(input_ids, shifted, cu))

    docs = None if cu is None else documents(pad_documents(cu, total))
    if docs is None:
        # Positions count up by one (checked by _global_positions), so the padded ones simply continue.
        positions = position_ids[:, :1] + torch.arange(total, device=input_ids.device)
    else:
        # Per document 0, 1, ... (the padding is a document of its own).
        ids = document_ids(docs.cu_seqlens, input_ids.device)
        positions = (torch.arange(total, device=input_ids.device) - ids.new_tensor(docs.cu_seqlens[:-1])[ids]).unsqueeze(0)
    shard = SequenceShard(tuple(seq_lens), rank, world, seq, bsz, docs, ring_layout)
    return ShardedBatch(
        input_ids=shard.shard(input_ids, pad_value=pad_token_id),
        labels=shard.shard(shifted, pad_value=-100),
        position_ids=shard.shard(positions),
        num_tokens=num_tokens,
        shard=shard,
    )


def _check_2d_shards(sp: SPGroups, seq: int, total: int, seq_lens, pad: bool) -> tuple[int, list[int]]:
    """``(total, seq_lens)`` for a 2-D group: its ring level needs equal shards, and zigzag
    cuts the sequence into ``2 x ring_size`` equal chunks whose blocks split over the
    Ulysses ranks (``pad`` pads to a multiple of ``lcm(2 x ring_size, group size)``)."""
    multiple = sp.world_size if sp.seq_layout == "contiguous" else math.lcm(2 * sp.ring_size, sp.world_size)
    if pad and total % multiple:
        total = math.ceil(seq / multiple) * multiple
        seq_lens = [total // sp.world_size] * sp.world_size
    if len(set(seq_lens)) > 1 or total % multiple:
        raise HFIntegrationError(
            f"shard_batch: the ring level of a 2-D group (seq_layout {sp.seq_layout!r}) needs a sequence length that is a multiple of "
            f"{multiple}, got {seq} tokens; use pad=True"
        )
    return total, seq_lens
def _packed_boundaries(input_ids: torch.Tensor, position_ids, cu_seqlens) -> tuple[int, ...] | None:
    """A packed batch's document boundaries over the unpadded sequence: ``cu_seqlens`` if
    given, else where ``position_ids`` restart at 0 (``None``: not packed). Packed batches
    are batch 1 and their positions, when given, are 0, 1, ... within each document."""
    seq = input_ids.shape[1]
    restarts = position_ids is not None and position_ids.dim() == 2 and seq > 1 and not bool((position_ids.diff(dim=1) == 1).all())
    if cu_seqlens is None and not restarts:
        return None
    if input_ids.shape[0] != 1:
        raise HFIntegrationError(
            f"shard_batch: packed documents (cu_seqlens, or position_ids that restart) need batch 1 (documents end to end), "
            f"got input_ids of shape {list(input_ids.shape)}"
        )
    if cu_seqlens is None:
        pos = position_ids.reshape(-1)
        if int(pos[0]) != 0:
            raise HFIntegrationError(f"shard_batch: packed position_ids must start at 0 (each document counts 0, 1, ...), got {int(pos[0])}")
        starts = torch.nonzero(pos == 0).flatten().tolist()
        cu = tuple(starts) + (seq,)
    else:
        cu = documents(cu_seqlens).cu_seqlens
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq or first_unordered(cu) > 0:
            raise HFIntegrationError(f"shard_batch: cu_seqlens expected strictly increasing boundaries from 0 to the sequence length {seq}, got {list(cu)}")
    if position_ids is not None:
        ids = document_ids(cu, input_ids.device)
        expected = torch.arange(seq, device=input_ids.device) - ids.new_tensor(cu[:-1])[ids]
        if position_ids.shape != (1, seq) or not torch.equal(position_ids.reshape(-1).to(expected.dtype), expected):
            raise HFIntegrationError(
                "shard_batch: in a packed batch position_ids must be [1, seq] and count 0, 1, ... within each document "
                f"(documents {list(cu)}), got {position_ids.reshape(-1)[:32].tolist()}{' ...' if seq > 32 else ''}"
            )
    return cu


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
            "shard_batch: position_ids must count up by one along the sequence, or (packed documents, batch 1) "
            "restart at 0 at each document"
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


def _shift_labels(labels: torch.Tensor, ignore_index: int, cu=None) -> tuple[torch.Tensor, int]:
    """The global label shift, done once before sharding: ``(shifted, num_tokens)`` where the
    target of position t is ``labels[t + 1]`` (the last position, and in a packed batch the
    last position of each document ``cu``, has none), ignored targets are ``-100`` whatever
    ``ignore_index`` was, and ``num_tokens`` counts the others."""
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    if cu is not None:
        shifted[:, [end - 1 for end in cu[1:]]] = ignore_index
    if ignore_index != -100:
        shifted = torch.where(shifted == ignore_index, torch.full_like(shifted, -100), shifted)
    return shifted, int((shifted != -100).sum())


def _fingerprint(input_ids: torch.Tensor, shifted: torch.Tensor, cu) -> int:
    """A 63-bit fingerprint of the batch's tokens, shifted targets and document boundaries:
    position-weighted sums in wrapping int64 arithmetic (exact, so the same batch gives the
    same value on any device and in any summation order; one host sync)."""
    mask = (1 << 63) - 1

    def weighted(t: torch.Tensor) -> torch.Tensor:
        idx = torch.arange(t.numel(), device=t.device, dtype=torch.int64)
        weights = idx * -7046029254386353131 + 1442695040888963407  # odd multiplier: a bijection of the index
        return ((t.reshape(-1).to(torch.int64) + 0x9E3779B9) * (weights | 1)).sum()

    fp = int((weighted(input_ids) * 31 + weighted(shifted)).item())
    return (fp * 1_000_003 + (-1 if cu is None else boundaries_digest(cu))) & mask


def _check_same_batch(group, device: torch.device, bsz: int, seq: int, total: int, num_tokens: int, bounds: int, fingerprint: int) -> None:
    """One all-gather of ``(batch, seq, padded length, target count, document boundaries,
    content fingerprint)``: ranks fed different batches raise the same error on every rank.
    Collective."""
    everyone = get_communicator(group).all_gather_ints([bsz, seq, total, num_tokens, bounds, fingerprint], device)
    if any(v != everyone[0] for v in everyone):
        shown = lambda v: f"batch={v[0]} seq={v[1]} padded={v[2]} targets={v[3]} cu_seqlens entries={v[4]} fingerprint={v[5]:016x}"
        rows = by_value([tuple(v) for v in everyone], shown)  # one entry per distinct batch, not per rank
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
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=_process_group(group))
    return total


def sync_gradients(model: torch.nn.Module, group=None) -> None:
    """All-reduce SUM the parameter gradients over the sequence-parallel group.

    After ``out.loss.backward()`` each rank holds the gradient of its share of the loss;
    the sum is the gradient of the global mean loss (what one process would compute).
    One collective per (dtype, device). With data parallelism on top, reduce over the
    data-parallel group separately (as usual, averaging there).
    """
    group = _process_group(group)
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
    dist.all_gather(parts, padded.contiguous(), group=_process_group(group))
    full = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, shard.seq_lens)], dim=dim)
    if shard.ring_layout is not None:  # zigzag: rank order is not sequence order
        rows = torch.cat([shard.rows(r) for r in range(shard.world_size)])
        full = full.index_select(dim, torch.argsort(rows).to(full.device))
    return full.narrow(dim, 0, shard.valid_len)


# --------------------------------------------------------------------------------------
# The model side
# --------------------------------------------------------------------------------------

# Implementations whose plain causal attention (softmax(q k^T * scale) v, no window, no
# softcap, no sinks, no dropout) is exactly what the fused ``ulysses_attention`` computes.
# A call that needs nothing more runs the fused op (its SDPA/flash backends, chunked
# overlap); anything else, or a user's own implementation, runs the model's attention.
_FUSED_IMPLEMENTATIONS = frozenset(
    {"eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention"}
)


# Implementations whose attention takes the mask ``_GlobalMask.build`` makes as it is: packed
# documents reach them as an overlay of that mask (others, e.g. flash attention, get none).
_MASKED_IMPLEMENTATIONS = frozenset({"eager", "sdpa"})


@dataclass(frozen=True, eq=False)
class _Settings:
    """What ``apply`` chose for one attention module (the group settings are shared by the
    model's modules; ``inner_impl``/``inner_fn`` are the module's own)."""

    group: object
    comm: object
    attn_fn: object
    kernels: object
    chunks: int | str
    check: str
    inner_impl: str = ""  # the implementation the model was configured with ("sdpa", "eager", ...)
    inner_fn: Callable | None = None  # its attention function (for "eager": the model's own)


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

    def covers(self, total: int) -> bool:
        """The mask is plain causal over ``total`` tokens (no window, or one that long)."""
        return self.window is None or self.window >= total

    def build(self, impl: str, shard: SequenceShard, dtype: torch.dtype, device: torch.device):
        """The mask ``impl``'s attention expects over the global sequence: what one process
        would build for ``shard.total`` tokens (``None`` where it needs none: sdpa's causal
        flag, flash attention's window parameter, an implementation without a mask function)."""
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        if impl not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # as transformers does
            return None
        key = (impl, self.window, self.mask_kwargs.get("allow_is_causal_skip", True), dtype, device)
        if key not in shard._masks:
            # Batch 1: every row of the batch has the same mask (no padding), broadcast by the attention.
            shard._masks[key] = ALL_MASK_ATTENTION_FUNCTIONS[impl](
                batch_size=1, q_length=shard.total, kv_length=shard.total, q_offset=0, kv_offset=0,
                attention_mask=None, dtype=dtype, device=device, **self._with_documents(shard, device),
            )  # fmt: skip
        return shard._masks[key]

    def _with_documents(self, shard: SequenceShard, device: torch.device) -> dict:
        """The mask keywords, for a packed batch with the step's global documents overlaid
        (transformers' packed-sequence mask over global document ids: a token sees only its
        own document; the window counts global indices, which within a document are its
        positions)."""
        if shard.documents is None:
            return self.mask_kwargs
        from transformers import masking_utils as mu

        ids = document_ids(shard.documents.cu_seqlens, device).unsqueeze(0)
        inner = self.mask_kwargs.get("mask_function", mu.causal_mask_function)
        overlay = mu.and_masks(mu.packed_sequence_mask_function(ids), inner)
        return {**self.mask_kwargs, "mask_function": overlay, "allow_is_causal_skip": False}


class _ConfigView:
    """A model config read through, with ``_attn_implementation`` set to the configured one."""

    def __init__(self, config, impl: str):
        self.__dict__.update(_config=config, _attn_implementation=impl)

    def __getattr__(self, name):
        return getattr(self._config, name)


class _LocalHeads:
    """The model's attention module as its attention function sees it on this rank.

    Every attribute is the module's except ``num_key_value_groups`` (the grouping of this
    rank's heads, which need not be the model's), ``sinks`` (this rank's query heads'
    slice, a view: the gradient reaches the parameter) and ``config`` (a ``_ConfigView``:
    flash attention reads ``config._attn_implementation`` to pick its kernel).
    """

    def __init__(self, module, impl: str, groups: int, heads: slice, q_heads: int):
        self.__dict__.update(_module=module, num_key_value_groups=groups, config=_ConfigView(module.config, impl))
        sinks = getattr(module, "sinks", None)
        if sinks is not None:
            self.__dict__["sinks"] = _head_slice(sinks, q_heads, heads, f"{type(module).__name__}.sinks")

    def __getattr__(self, name):
        return getattr(self._module, name)


def _head_slice(t: torch.Tensor, q_heads: int, heads: slice, what: str) -> torch.Tensor:
    """Rows ``heads`` of a per-query-head tensor ``[q_heads, ...]`` (sinks): this rank's."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != q_heads:
        shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise HFIntegrationError(f"{what}: expected one value per query head (shape [{q_heads}, ...]), got {shape}")
    return t[heads]


def _fail_module(module) -> HFIntegrationError:
    return HFIntegrationError(
        f"{type(module).__name__}: the model's attention implementation is {ATTN_IMPLEMENTATION!r} but this "
        "module was not prepared by ulysses_kernels.integrations.hf.apply (call apply(model, group) on the "
        "model that owns it; a config object switched to it by hand, or shared with a model from before apply "
        "copied configs, also lands here: build each model from its own config)"
    )


def _ulysses_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers attention function: ``[B, H, s_local, D]`` q/k/v in, ``[B, s_local, Hq, D]`` out.

    k/v arrive un-repeated (GQA). ``attention_mask`` is the ``_GlobalMask`` our mask
    function returned for this layer's type. The keywords are the model's (``scaling``,
    ``dropout``, ``sliding_window``, ``softcap``, ``s_aux``, ...). Plain causal calls of a
    built-in implementation run the fused ``ulysses_attention``; the others run the
    model's own attention function on this rank's heads over the global sequence
    (``_model_attention``).
    """
    settings, shard = _call_context(module, kwargs)
    kwargs.pop(_SHARD_KWARG)
    return _attend(module, settings, shard, _layer_mask(module, attention_mask), query, key, value, kwargs)


def sequence_parallel_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                settings: _Settings, shard: SequenceShard, **kwargs):  # fmt: skip
    """One attention call of a model that ``apply`` did not switch: what the ``"ulysses"``
    attention function does, with the settings and the step's shard given explicitly.

    For callers that intercept a model's own attention implementation (DeepSpeed ALST's
    entry point, ``integrations.alst``), so the model's mask function is not ours: the mask
    of the layer is taken from the model's ``sliding_window`` keyword (``None`` or absent:
    causal) and rebuilt over the global sequence as ``apply``'s mask function would record it.

    Args:
        module: the model's attention module (``scaling``, ``is_causal``, ``head_dim``, ...).
        query, key, value: ``[B, H, seq_lens[rank], D]`` (k/v with the model's KV heads).
        settings: ``attention_settings(...)``, made once (it may own a communicator).
        shard: the step's ``SequenceShard`` (the same on every rank; it caches the step's
            checks and masks, so use one object per step).
        kwargs: the model's keywords (``scaling``, ``dropout``, ``sliding_window``,
            ``softcap``, ``s_aux``, ``position_ids`` (dropped), ...).

    Returns ``(out, None)``, ``out`` ``[B, seq_lens[rank], Hq, D]``.
    """
    window = kwargs.get("sliding_window")
    if window is None:
        mask = _GlobalMask(None, {})
    else:
        from transformers.masking_utils import sliding_window_causal_mask_function

        # local_size: sdpa's mask function skips the mask (plain causal) unless it knows the window.
        mask = _GlobalMask(int(window), {"mask_function": sliding_window_causal_mask_function(int(window)), "local_size": int(window)})
    return _attend(module, settings, shard, mask, query, key, value, kwargs)


def _attend(module, settings: _Settings, shard: SequenceShard, mask: _GlobalMask, query, key, value, kwargs):
    """The attention call of ``_ulysses_attention_forward`` once its settings, shard and mask
    are known: the fused op for plain causal attention, else the model's own attention."""
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise HFIntegrationError(
            f"{type(module).__name__}: non-causal attention is not supported (ulysses applies a global causal mask)"
        )
    _check_sharded_input(type(module).__name__, shard, settings, query)
    docs = _packed(module, settings, shard, mask, kwargs)
    if not _plain_causal(settings, shard, mask, module, kwargs):
        if isinstance(settings.group, SPGroups):
            raise HFIntegrationError(
                f"{type(module).__name__}: with a 2-D group (SPGroups) only plain causal attention runs (the fused op with "
                "ring attention); a sliding window shorter than the sequence, softcapping, sinks or dropout need a flat group"
            )
        return _model_attention(module, settings, shard, mask, query, key, value, kwargs), None

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # -> [B, s_local, H, D]
    scaling = kwargs.get("scaling")
    sig = ("fused", tuple(q.shape), tuple(k.shape), q.dtype, q.device, scaling, docs)
    check = _check_now(settings, shard, sig)
    out = ulysses_attention(
        q, k, v, settings.group, causal=True, softmax_scale=scaling, seq_lens=shard.seq_lens,
        attn_fn=settings.attn_fn, comm=settings.comm, kernels=settings.kernels, chunks=settings.chunks, check=check,
        cu_seqlens=None if docs is None else docs.cu_seqlens, max_seqlen=None if docs is None else docs.max_seqlen,
    )  # fmt: skip
    if check:
        shard._checked.add(sig)
    return out, None


def _packed(module, settings: _Settings, shard: SequenceShard, mask: _GlobalMask, kwargs) -> Documents | None:
    """The step's documents (``None``: not packed), after checking that this call can honor
    them: plain causal attention (the fused op). The model's mask function saw only this
    rank's positions; the boundaries come from ``shard_batch``, global."""
    if shard.documents is None:
        # A zigzag shard's positions jump at its second chunk (transformers sees a packed
        # sequence there); shard_batch made them from the global ones, so they are not.
        if mask.packed and shard.ring_layout is None:
            raise HFIntegrationError(
                f"{type(module).__name__}: position_ids restart inside the sequence (packed documents) but the batch was "
                "not sharded as packed; pass the global position_ids (or cu_seqlens) to shard_batch"
            )
        return None
    if not _plain_causal(settings, shard, mask, module, kwargs) and settings.inner_impl not in _MASKED_IMPLEMENTATIONS:
        raise HFIntegrationError(
            f"{type(module).__name__}: packed documents with a sliding window, logit softcapping, attention sinks, dropout "
            f"or a registered implementation run on the 'eager' or 'sdpa' implementation (their mask carries the "
            f"documents); this model runs {settings.inner_impl!r}"
        )
    return shard.documents


def _plain_causal(settings: _Settings, shard: SequenceShard, mask: _GlobalMask, module, kwargs) -> bool:
    """The call is plain causal attention over the global sequence of a built-in
    implementation: no window shorter than the sequence, no softcap, no sinks, no dropout."""
    window = kwargs.get("sliding_window")
    return (
        settings.inner_impl in _FUSED_IMPLEMENTATIONS
        and mask.covers(shard.total)
        and (window is None or window >= shard.total)
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and getattr(module, "sinks", None) is None
        and not kwargs.get("dropout")
    )


def _model_attention(module, settings: _Settings, shard: SequenceShard, mask: _GlobalMask, query, key, value, kwargs):
    """The model's own attention on this rank's heads over the global sequence.

    ``[B, H, s_local, D]`` q/k/v -> ``seq_to_head`` -> ``[B, hq, S, D]`` (``plan.q_ranges[rank]``)
    and the KV heads those use (gathered to one per query head where the rank's heads do
    not group uniformly) -> the configured implementation with every keyword the model
    passed (``s_aux`` and ``module.sinks`` sliced to the rank's heads; ``position_ids``,
    local ones, left out) and the global mask -> ``[B, S, hq, D]`` -> ``head_to_seq`` ->
    ``[B, s_local, Hq, D]``.
    """
    comm, name, q_heads = settings.comm, type(module).__name__, query.shape[1]
    plan = HeadPlan.build(q_heads, key.shape[1], comm.world_size)
    sig = ("model", tuple(query.shape), tuple(key.shape), query.dtype, query.device)
    check = _check_now(settings, shard, sig)
    q, k, v = seq_to_head(
        *(t.transpose(1, 2) for t in (query, key, value)), group=settings.group, seq_lens=shard.seq_lens, plan=plan,
        comm=comm, kernels=settings.kernels, check=check,
    )  # fmt: skip
    if check:
        shard._checked.add(sig)
    k, v = expand_kv(k, v, plan.local_kv_map(comm.rank))  # [B, S, hkv, D], uniform groups
    heads = slice(*plan.q_ranges[comm.rank])
    local = _LocalHeads(module, settings.inner_impl, q.shape[2] // k.shape[2], heads, q_heads)
    inner = {n: a for n, a in kwargs.items() if n != "position_ids"}
    if kwargs.get("s_aux") is not None:
        inner["s_aux"] = _head_slice(kwargs["s_aux"], q_heads, heads, f"{name}: s_aux")
    global_mask = mask.build(settings.inner_impl, shard, q.dtype, q.device)
    out = settings.inner_fn(local, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), global_mask, **inner)[0]
    expected = [q.shape[0], shard.total, q.shape[2], v.shape[3]]
    if list(out.shape) != expected:
        raise HFIntegrationError(
            f"{name}: the {settings.inner_impl!r} attention returned shape {list(out.shape)}, expected {expected} "
            "([batch, seq, heads, head_dim] over this rank's heads)"
        )
    return head_to_seq(out, plan, group=settings.group, seq_lens=shard.seq_lens, comm=comm, kernels=settings.kernels)


def _check_now(settings: _Settings, shard: SequenceShard, sig: tuple) -> bool:
    """Whether this call validates its inputs across ranks (``apply``'s ``check``)."""
    return settings.check == "always" or (settings.check == "step" and sig not in shard._checked)


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


def _check_sharded_input(name: str, shard: SequenceShard, settings: _Settings, query: torch.Tensor) -> None:
    """The batch was sharded for this rank of ``apply``'s group (for an ``SPGroups``: the
    whole 2-D group), and ``query`` (``[B, H, s_local, D]``) is this rank's shard of it."""
    sp, comm = settings.group, settings.comm
    rank, world = (sp.rank, sp.world_size) if isinstance(sp, SPGroups) else (comm.rank, comm.world_size)
    if (shard.rank, shard.world_size) != (rank, world):
        raise HFIntegrationError(
            f"{name}: the batch was sharded for rank {shard.rank} of {shard.world_size} but apply() was given a group "
            f"in which this process is rank {rank} of {world}; pass the same group to apply and shard_batch"
        )
    layout = sp.seq_layout if isinstance(sp, SPGroups) else "contiguous"
    if (shard.ring_layout or (0, 0, "contiguous"))[2] != layout:
        raise HFIntegrationError(
            f"{name}: the batch was sharded {(shard.ring_layout or (0, 0, 'contiguous'))[2]} but apply() was given a group with "
            f"seq_layout {layout!r}; pass the same SPGroups to apply and shard_batch"
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


def _ulysses_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """Mask function for ``AttentionMaskInterface``: record the layer type's mask, build nothing.

    Called once per forward per layer type (``layer_types``: ``full_attention``,
    ``sliding_attention``) with the local sizes. Returns ``None`` for plain causal (what
    the attention call assumes when it gets no mask, and what any model code passes on
    safely) and a ``_GlobalMask`` for a sliding window; the attention call turns either
    into the global mask (``_GlobalMask.build``). What cannot be rebuilt over the global
    sequence raises: a KV cache, a padding mask, and masks other than causal and
    sliding-window causal (chunked or bidirectional attention, custom overlays).
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
            "supported as a mask: drop attention_mask and set the padded labels to -100 (shard_batch does this)"
        )
    mask_function, packed = _unpacked(mask_function)
    window = _window_of(mask_function)
    if window is None:
        return _GlobalMask(None, {}, packed=True) if packed else None
    kept = {n: a for n, a in kwargs.items() if n not in ("dtype", "device")}
    return _GlobalMask(window, {**kept, "mask_function": mask_function}, packed)


def _unpacked(mask_function) -> tuple[Callable, bool]:
    """``(mask function, packed)``: transformers wraps the layer's mask function for packed
    sequences when this rank's position ids restart (``packed_sequence_compatibility_function``:
    a document overlay and positions remapped); the attention call takes the documents from
    the step's shard instead (global, not this rank's view), so the wrapper is taken off."""
    from transformers import masking_utils as mu

    parts = _closure(mask_function, mu.and_masks(mu.causal_mask_function)).get("mask_functions")
    if isinstance(parts, tuple) and len(parts) == 2:
        overlay = _closure(parts[0], mu.packed_sequence_mask_function(None))
        remap = _closure(parts[1], mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None))
        if "packed_sequence_mask" in overlay and "mask_function" in remap:
            return remap["mask_function"], True
    return mask_function, False


def _window_of(mask_function) -> int | None:
    """``None`` for transformers' causal mask function, ``w`` for its sliding-window causal
    mask function of window ``w`` (recognised by their code, not their names); anything
    else raises, since only these two are known to depend on positions alone."""
    from transformers import masking_utils as mu

    if mask_function is None or mask_function is mu.causal_mask_function:
        return None
    parts = _closure(mask_function, mu.and_masks(mu.causal_mask_function)).get("mask_functions")
    if isinstance(parts, tuple) and len(parts) == 2 and parts[1] is mu.causal_mask_function:
        window = _closure(parts[0], mu.sliding_window_overlay(1)).get("sliding_window")
        if isinstance(window, int) and window > 0:
            return window
    raise HFIntegrationError(
        "sequence-parallel attention rebuilds the causal and the sliding-window causal mask over the global "
        f"sequence; the model asked for another mask ({getattr(mask_function, '__qualname__', mask_function)!r}: "
        "chunked or bidirectional attention, or a custom overlay), which it cannot rebuild"
    )


def _closure(fn, like) -> dict:
    """The closure variables of ``fn`` if it was made by the same code as ``like``, else ``{}``."""
    code = getattr(fn, "__code__", None)
    if code is None or code is not like.__code__ or not fn.__closure__:
        return {}
    return {n: cell.cell_contents for n, cell in zip(code.co_freevars, fn.__closure__)}


def _attention_modules(model) -> list[torch.nn.Module]:
    # transformers' attention modules (Llama, Qwen2, Mistral, Gemma, GPT-OSS, ...) carry these.
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("scaling", "is_causal", "config")) and hasattr(m, "head_dim")]


def _check_config(config) -> None:
    if not getattr(config, "is_causal", True):
        raise HFIntegrationError(f"apply: {type(config).__name__}.is_causal = False: only causal (decoder) attention is supported")


def _configured_implementation(module) -> str:
    """The attention implementation ``module`` runs before ``apply`` switches it (on a
    second ``apply``: the one the first recorded)."""
    impl = getattr(module.config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        return impl or "eager"  # None: transformers falls back to the model's eager attention
    previous = getattr(module, _SETTINGS_ATTR, None)
    if previous is None:
        raise HFIntegrationError(
            f"apply: {type(module).__name__} is already set to {ATTN_IMPLEMENTATION!r} without apply, so the "
            "implementation to run on each rank's heads is unknown; build the model with it "
            "(attn_implementation='sdpa', 'eager', 'flash_attention_2', ...) and call apply"
        )
    return previous.inner_impl


def _attention_function(module, impl: str) -> Callable:
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

    AttentionInterface.register(ATTN_IMPLEMENTATION, _ulysses_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _ulysses_mask)


def apply(
    model, group=None, *, attn_fn=None, kernels=None, chunks: int | str = 1, check: str = "step", comm=None,
    tiled_loss: bool | int = False, tiled_mlp: bool | int = False, tiled_norms: bool | int = False, offload_activations=False,
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
        model: a ``transformers.PreTrainedModel`` whose attention uses ``AttentionInterface``
            (Llama, Qwen2, Qwen3, Mistral, Gemma 2/3, GPT-OSS, ... families), causal.
        group: the sequence-parallel process group (default: the world), or an ``SPGroups``
            (``make_sp_groups``: Ulysses x ring; plain causal attention only, equal
            shards, contiguous or zigzag, packed or not: ``shard_batch(..., pad=True)``). Pass the same to
            ``shard_batch``, ``sync_gradients``, ``reduce_loss`` and ``gather_sequence``.
        attn_fn, kernels, chunks: passed to ``ulysses_attention`` (``kernels`` also to the
            exchanges around the model's own attention; ``attn_fn`` and ``chunks`` apply to
            the fused path only).
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
    bidirectional = sorted({type(m).__name__ for m in modules if not m.is_causal})
    if bidirectional:
        raise HFIntegrationError(f"apply: {', '.join(bidirectional)}.is_causal = False: only causal (decoder) attention is supported")
    # Resolved before the model is switched, so that a refusal leaves it as it was.
    inner = []
    for m in modules:
        impl = _configured_implementation(m)
        inner.append((m, impl, _attention_function(m, impl)))
    # The long-context pieces (they refuse before changing anything, as the checks above).
    enable_long_context(model, tiled_loss=tiled_loss, tiled_mlp=tiled_mlp, tiled_norms=tiled_norms,
                        offload_activations=offload_activations, shard_kwarg=_SHARD_KWARG)  # fmt: skip
    register()
    _own_configs(model)  # the caller's config object stays as it was (another model may share it)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    wrong = sorted({type(m).__name__ for m in modules if getattr(m.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION})
    if wrong:
        raise HFIntegrationError(f"apply: could not switch the attention implementation of {', '.join(wrong)} to {ATTN_IMPLEMENTATION!r}")
    shared = attention_settings(group, attn_fn=attn_fn, kernels=kernels, chunks=chunks, check=check, comm=comm)
    for m, impl, fn in inner:
        # A plain attribute on the module instance (not a parameter or buffer): the group
        # settings belong to this model, not to the process.
        object.__setattr__(m, _SETTINGS_ATTR, replace(shared, inner_impl=impl, inner_fn=fn))
    return model


def attention_settings(group=None, *, impl: str = "", fn: Callable | None = None, attn_fn=None, kernels=None,
                       chunks: int | str = 1, check: str = "step", comm=None) -> _Settings:  # fmt: skip
    """The frozen settings of sequence-parallel attention calls (``apply`` makes one per
    model; ``sequence_parallel_attention`` takes one).

    ``group``, ``attn_fn``, ``kernels``, ``chunks``, ``check``, ``comm``: as for ``apply``.
    ``impl``/``fn``: the model's configured attention implementation and its function (what
    runs on each rank's heads when the call is not plain causal). Resolves the communicator
    once (with ``ULYSSES_KERNELS_NATIVE_NCCL=1`` on an NCCL group making a native one, which
    is collective): make it once, on every rank.
    """
    if check not in ("step", "always", "never"):
        raise HFIntegrationError(f"attention_settings: check expected 'step', 'always' or 'never', got {check!r}")
    # An SPGroups: the communicator is its Ulysses group's (the ring level makes its own).
    exchange_group = group.ulysses_group if isinstance(group, SPGroups) else group
    return _Settings(group, get_communicator(exchange_group, comm, native=True), attn_fn, kernels, chunks, check, impl, fn)
