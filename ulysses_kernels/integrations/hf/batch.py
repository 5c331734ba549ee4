"""The data side of the transformers integration: one global causal-LM batch sharded along
the sequence for this rank (``shard_batch``), and the per-step context that travels with it
to every attention call (``SequenceShard``, as the ``ulysses_shard`` keyword).

Layout of one step, global sequence of ``S`` tokens over ``P`` ranks::

    input_ids  [B, S]           every rank holds the same global batch
    labels     [B, S]           shifted once, globally: target[t] = labels[t + 1], last = -100
    positions  [B, S]           0 .. S-1 (global, so RoPE is right on every shard)
      | shard_batch: rank r keeps columns [start_r, start_r + seq_lens[r])
    rank r     [B, seq_lens[r]] input_ids, shifted labels, global positions

Packed batches (documents end to end in each row; each row its own documents): the
documents come from position ids that restart at 0 (or ``cu_seqlens``, one list per row);
positions restart per document, the last token of each document has no target, and the
global boundaries go on the step's ``SequenceShard`` (``documents.Documents``: several rows
joined end to end, ``rows`` = batch).
A 2-D group with zigzag shards: rank r holds ``ring.shard_rows`` of the sequence (two
segments), recorded on the shard as ``ring_layout``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...checks import by_value
from ...comm import get_communicator
from ...documents import Documents, boundaries_digest, document_ids, documents, documents_of_positions, first_unordered, pad_documents
from ...layers.step import SHARD_KWARG, HFIntegrationError, SequenceShard, process_group, rank_world
from ...layout import split_lengths  # the project's one rule for uneven shards (re-exported by the package)
from ...ring import SPGroups

__all__ = ["HFIntegrationError", "SequenceShard", "ShardedBatch", "shard_batch", "split_lengths"]


@dataclass
class ShardedBatch:
    """One rank's share of a causal-LM batch, made by ``shard_batch``.

    ``input_ids`` and ``labels`` (already shifted: the target of each position, ``-100``
    where there is none) are ``[batch, seq_lens[rank]]``; ``position_ids`` too, or
    ``[3 or 4, batch, seq_lens[rank]]`` for a vision-language model's mRoPE positions
    (global, as given). ``inputs_embeds`` (``[batch, seq_lens[rank], hidden]``, a slice of
    the global embeddings that keeps their autograd graph) replaces ``input_ids`` in the
    model's inputs when it was given; ``input_ids`` is then ``None`` unless given too.
    ``num_tokens`` counts the targets that are not ``-100`` over the *global* batch (the
    loss denominator; the same on every rank).
    """

    input_ids: torch.Tensor | None
    labels: torch.Tensor
    position_ids: torch.Tensor
    num_tokens: int
    shard: SequenceShard
    inputs_embeds: torch.Tensor | None = None

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self.shard.seq_lens

    def model_inputs(self, loss: bool = True) -> dict:
        """Keyword arguments for ``model(**...)``.

        ``inputs_embeds`` when ``shard_batch`` was given them (a vision-language model, whose
        image features are already merged in: the model skips its vision tower), else
        ``input_ids``. With ``loss=True`` the model computes ``sum(token losses on this rank) /
        num_tokens`` through transformers' own causal-LM loss (``shift_labels`` = our globally
        shifted labels, ``num_items_in_batch`` = the global count), so the losses of the ranks
        add up to the global mean and their gradients add up to its gradient.
        """
        tokens = {"input_ids": self.input_ids} if self.inputs_embeds is None else {"inputs_embeds": self.inputs_embeds}
        kw = {**tokens, "position_ids": self.position_ids, "use_cache": False, SHARD_KWARG: self.shard}
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
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.labels.flatten().to(logits.device), ignore_index=-100, reduction="sum")
        return ce / max(self.num_tokens, 1)


def shard_batch(
    input_ids: torch.Tensor | None,
    labels: torch.Tensor | None = None,
    *,
    group=None,
    position_ids: torch.Tensor | None = None,
    pad: bool = False,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    check: bool = True,
    cu_seqlens=None,
    inputs_embeds: torch.Tensor | None = None,
    visual_pos_masks: torch.Tensor | None = None,
    deepstack_visual_embeds: list[torch.Tensor] | None = None,
    comm=None,
) -> ShardedBatch:
    """Shard one global causal-LM batch along the sequence for this rank.

    Args:
        input_ids: ``[batch, seq]`` int64, the *global* batch, the same on every rank of
            ``group``. May be ``None`` when ``inputs_embeds`` and ``labels`` are given.
        labels: ``[batch, seq]`` unshifted targets in transformers' convention (usually
            ``input_ids`` with ``-100`` on ignored tokens); default ``input_ids``. They are
            shifted here, once, over the global sequence, so the target of rank r's last
            token is rank r+1's first token.
        group: the sequence-parallel group (the one given to ``apply``).
        position_ids: ``[batch or 1, seq]`` global positions; default ``0 .. seq-1``. They
            count up by one, or (a packed batch, ``DataCollatorWithFlattening``'s format, in
            each row) restart at 0 at the start of each document. Or a vision-language model's
            mRoPE positions ``[3, batch or 1, seq]`` (temporal, height, width: Qwen2-VL,
            Qwen2.5-VL, Qwen3-VL's ``get_rope_index``) or ``[4, batch or 1, seq]`` (row 0 the
            text positions, as transformers' text models take them for packed inputs): kept as
            given and sharded along the sequence. Their t/h/w rows jump back inside an image,
            which is never read as a document restart; documents come from ``cu_seqlens``,
            or from row 0 of the 4-row form restarting at 0.
        pad: ``False`` (default): uneven shards, ``seq_lens = split_lengths(seq, world)``.
            ``True``: pad the sequence with ``pad_token_id`` up to a multiple of the world
            size (targets ``-100``, positions continuing); the padding comes last, so
            causal attention never lets a real token see it. Both are exact.
        check: exchange ``(batch, seq, target count, a fingerprint of the tokens, targets,
            mRoPE positions and document boundaries)`` across the group once (one all-gather
            of 6 integers), so that ranks fed different batches raise the same error on every
            rank, including batches of the same shape (a sampler that shards by global rank
            instead of by data-parallel rank).
        cu_seqlens: a packed batch's document boundaries ``(0, ..., seq)`` (a list or an
            integer tensor; with batch > 1 one of those per row), instead of restarting
            ``position_ids``. Packed: attention stays
            inside each document, positions restart per document, the last token of each
            document has no target; with ``pad`` the padding is a trailing document.
        inputs_embeds: ``[batch, seq, hidden]`` global input embeddings (a vision-language
            model's, with the image features merged in: ``multimodal_inputs``); each rank
            keeps its slice (autograd flows back through it to whatever made them, e.g. the
            vision tower) and the model gets ``inputs_embeds`` instead of ``input_ids``.
        visual_pos_masks, deepstack_visual_embeds: Qwen3-VL's deepstack inputs, as its text
            model takes them (``[batch, seq]`` bool, and per layer ``[visual tokens, hidden]``
            rows in the mask's order); each rank keeps its visual tokens' rows, which ``apply``
            hands to the text model. ``multimodal_inputs`` returns them.
        comm: the communicator given to ``apply`` (its ``rank`` and ``world_size`` then say
            whose share this is, and ``check`` runs over it): e.g. ``comm.EmulatedPeers``, one
            rank of a group emulated in one process (with ``check=False``: it has no peers).

    Returns:
        ``ShardedBatch`` with this rank's ``input_ids`` (or ``inputs_embeds``), shifted
        ``labels``, global ``position_ids``, the global ``num_tokens`` and the ``shard`` layout.
    """
    if comm is not None and isinstance(group, SPGroups):
        raise HFIntegrationError("shard_batch: comm= stands for a flat group; a 2-D group (SPGroups) is given as group= alone")
    rank, world = rank_world(group) if comm is None else (comm.rank, comm.world_size)
    labels = _checked_labels(input_ids, labels, inputs_embeds)
    mrope = position_ids is not None and position_ids.dim() == 3
    text_positions = _mrope_text_positions(labels, position_ids) if mrope else position_ids
    cu = _packed_boundaries(labels, text_positions, cu_seqlens)
    if cu is None and not mrope:
        position_ids = _global_positions(labels, position_ids)
    elif cu is None and text_positions is not None:
        _global_positions(labels, text_positions)  # the text row of 4-row mRoPE positions counts up by one
    bsz, seq = labels.shape
    total, seq_lens = _shard_lengths(seq, world, pad)
    ring_layout = None
    if isinstance(group, SPGroups):
        total, seq_lens = _check_2d_shards(group, seq, total, seq_lens, pad)
        ring_layout = None if group.seq_layout == "contiguous" else (group.ulysses_size, group.ring_size, group.seq_layout)
    shifted, num_tokens = _shift_labels(labels, ignore_index, cu)
    tokens = input_ids if input_ids is not None else labels
    if check and world > 1:
        _check_same_batch(
            get_communicator(process_group(group), comm),
            labels.device,
            bsz,
            seq,
            total,
            num_tokens,
            0 if cu is None else sum(len(row) for row in cu),
            _fingerprint(tokens, shifted, cu, position_ids if mrope else None),
        )

    docs = None if cu is None else _step_documents(cu, total)
    if mrope:
        # As given (each row continuing into the padding, so that row 0 never restarts there).
        positions = _continued(position_ids.expand(-1, bsz, -1), total)
    elif docs is None:
        # Positions count up by one (checked by _global_positions), so the padded ones simply continue.
        positions = position_ids[:, :1] + torch.arange(total, device=labels.device)
    else:
        # Per document 0, 1, ... (the padding is a document of its own), row by row.
        ids = document_ids(docs.cu_seqlens, labels.device)
        flat = torch.arange(total * docs.rows, device=labels.device) - ids.new_tensor(docs.cu_seqlens[:-1])[ids]
        positions = flat.view(docs.rows, total)
    shard = SequenceShard(tuple(seq_lens), rank, world, seq, bsz, docs, ring_layout)
    shard.text_inputs = _deepstack_shard(shard, visual_pos_masks, deepstack_visual_embeds, bsz, seq)
    return ShardedBatch(
        input_ids=None if input_ids is None else shard.shard(input_ids, pad_value=pad_token_id),
        labels=shard.shard(shifted, pad_value=-100),
        position_ids=shard.shard(positions, dim=positions.dim() - 1),
        num_tokens=num_tokens,
        shard=shard,
        inputs_embeds=None if inputs_embeds is None else shard.shard(inputs_embeds),
    )


def _mrope_text_positions(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | None:
    """Check mRoPE ``position_ids`` (``[3 or 4, batch or 1, seq]``) and return the rows that
    say where documents restart: row 0 of the 4-row form (the text positions), ``None`` for
    the 3-row form (temporal/height/width rows jump back inside an image: never restarts)."""
    bsz, seq = labels.shape
    if position_ids.shape[0] not in (3, 4) or position_ids.shape[1] not in (1, bsz) or position_ids.shape[2] != seq:
        raise HFIntegrationError(
            f"shard_batch: 3-D (mRoPE) position_ids expected [3 or 4, {bsz} or 1, {seq}] (temporal, height, width rows, "
            f"optionally after a text row), got shape {list(position_ids.shape)}"
        )
    return position_ids[0] if position_ids.shape[0] == 4 else None


def _continued(positions: torch.Tensor, total: int) -> torch.Tensor:
    """``positions`` (``[..., seq]``) extended to ``total`` along the last dim by counting on
    from each row's last value."""
    extra = total - positions.shape[-1]
    if extra == 0:
        return positions
    step = torch.arange(1, extra + 1, device=positions.device, dtype=positions.dtype)
    return torch.cat([positions, positions[..., -1:] + step], dim=-1)


def _deepstack_shard(shard: SequenceShard, mask, embeds, bsz: int, seq: int) -> dict | None:
    """This rank's share of Qwen3-VL's deepstack inputs: ``visual_pos_masks`` sliced like the
    tokens, and per layer the rows of ``deepstack_visual_embeds`` of this rank's visual
    tokens (the rows follow the mask's row-major order, so a visual token's row is the count
    of visual tokens before it). ``None`` when neither is given."""
    if mask is None and embeds is None:
        return None
    if mask is None or embeds is None:
        raise HFIntegrationError("shard_batch: visual_pos_masks and deepstack_visual_embeds go together (Qwen3-VL's deepstack inputs)")
    if mask.shape != (bsz, seq) or mask.dtype != torch.bool:
        raise HFIntegrationError(f"shard_batch: visual_pos_masks expected a bool [{bsz}, {seq}] tensor, got {mask.dtype} {list(mask.shape)}")
    count = int(mask.sum())
    for i, e in enumerate(embeds):
        if e.dim() != 2 or e.shape[0] != count:
            raise HFIntegrationError(
                f"shard_batch: deepstack_visual_embeds[{i}] expected [{count} (visual tokens in visual_pos_masks), hidden], got {list(e.shape)}"
            )
    row = (mask.reshape(-1).long().cumsum(0) - 1).view(bsz, seq)  # row of each visual token
    local_mask = shard.shard(mask, pad_value=False)
    rows = shard.shard(row)[local_mask]
    return {"visual_pos_masks": local_mask, "deepstack_visual_embeds": [e.index_select(0, rows.to(e.device)) for e in embeds]}


def _check_2d_shards(sp: SPGroups, seq: int, total: int, seq_lens, pad: bool) -> tuple[int, list[int]]:
    """``(total, seq_lens)`` for a 2-D group: its ring level needs equal shards, and zigzag
    cuts the sequence into ``2 x ring_size`` equal segments whose blocks split over the
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


def _packed_boundaries(input_ids: torch.Tensor, position_ids, cu_seqlens) -> tuple[tuple[int, ...], ...] | None:
    """A packed batch's document boundaries over the unpadded sequence, one tuple
    ``(0, ..., seq)`` per row: ``cu_seqlens`` if given (one list, batch 1, or one list per
    row), else where each row of ``position_ids`` (``[batch or 1, seq]`` text positions)
    restarts at 0 (``None``: not packed). Positions, when given, count 0, 1, ... within each
    document. ``input_ids``: any ``[batch, seq]`` tensor of the batch (its shape and device
    are read)."""
    bsz, seq = input_ids.shape
    restarts = position_ids is not None and position_ids.dim() == 2 and seq > 1 and not bool((position_ids.diff(dim=1) == 1).all())
    if cu_seqlens is None and not restarts:
        return None
    if cu_seqlens is None:
        pos = position_ids.expand(bsz, -1) if position_ids.shape[0] == 1 else position_ids
        if pos.shape[0] != bsz or bool((pos[:, 0] != 0).any()):
            raise HFIntegrationError(
                f"shard_batch: packed position_ids must start at 0 in every row (each document counts 0, 1, ...) and be "
                f"[1 or batch ({bsz}), seq], got shape {list(position_ids.shape)} starting with {pos[:, 0].tolist()}"
            )
        rows = documents_of_positions(pos)
    else:
        docs = documents(cu_seqlens)
        joined, n = docs.cu_seqlens, docs.rows
        if n != bsz:
            raise HFIntegrationError(
                f"shard_batch: cu_seqlens expected {'one list of boundaries' if bsz == 1 else f'one list of boundaries per row ({bsz})'}, got {n}"
            )
        if docs.bad_row or len(joined) < 2 or joined[0] != 0 or joined[-1] != seq * n or first_unordered(joined) > 0:
            raise HFIntegrationError(
                f"shard_batch: cu_seqlens expected strictly increasing boundaries from 0 to the sequence length {seq} in every row, got {cu_seqlens!r}"
            )
        rows = _split_rows(joined, n, seq)
    if position_ids is not None:
        for b, cu in enumerate(rows):
            ids = document_ids(cu, input_ids.device)
            expected = torch.arange(seq, device=input_ids.device) - ids.new_tensor(cu[:-1])[ids]
            got = position_ids[b if position_ids.shape[0] > 1 else 0] if position_ids.shape[0] in (1, bsz) else None
            if got is None or not torch.equal(got.to(expected.dtype), expected):
                raise HFIntegrationError(
                    f"shard_batch: in a packed batch position_ids must be [1 or batch, seq] and count 0, 1, ... within each document "
                    f"(row {b}: documents {list(cu)}), got {position_ids[min(b, position_ids.shape[0] - 1)][:32].tolist()}{' ...' if seq > 32 else ''}"
                )
    return rows


def _step_documents(cu: tuple[tuple[int, ...], ...], total: int) -> Documents:
    """The step's ``Documents``: each row's boundaries padded to ``total`` (the padding a
    trailing document), one packed row as is, several joined end to end (``documents``)."""
    padded = [pad_documents(row, total) for row in cu]
    return documents(padded[0] if len(padded) == 1 else padded)


def _split_rows(joined: tuple[int, ...], rows: int, seq: int) -> tuple[tuple[int, ...], ...]:
    """Boundaries joined end to end over ``rows`` rows of ``seq`` tokens -> one tuple per row."""
    out = []
    for b in range(rows):
        lo, hi = b * seq, (b + 1) * seq
        out.append(tuple(x - lo for x in joined if lo <= x <= hi))
    return tuple(out)


def _checked_labels(input_ids: torch.Tensor | None, labels: torch.Tensor | None, inputs_embeds=None) -> torch.Tensor:
    """``labels`` (default ``input_ids``) after checking that both are ``[batch, seq]`` and
    ``inputs_embeds``, if given, ``[batch, seq, hidden]``."""
    if input_ids is None:
        if inputs_embeds is None or labels is None:
            raise HFIntegrationError("shard_batch: input_ids may be None only with inputs_embeds and labels given")
    elif input_ids.dim() != 2:
        raise HFIntegrationError(f"shard_batch: input_ids expected [batch, seq], got shape {list(input_ids.shape)}")
    if labels is None:
        labels = input_ids
    if labels.dim() != 2 or (input_ids is not None and labels.shape != input_ids.shape):
        expected = list(input_ids.shape) if input_ids is not None else "[batch, seq]"
        raise HFIntegrationError(f"shard_batch: labels.shape expected {expected}, got {list(labels.shape)}")
    if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[:2] != labels.shape):
        raise HFIntegrationError(
            f"shard_batch: inputs_embeds expected [{labels.shape[0]}, {labels.shape[1]}, hidden] (batch and seq of the labels), "
            f"got shape {list(inputs_embeds.shape)}"
        )
    return labels


def _global_positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """``[batch, seq]`` global positions: ``0 .. seq-1`` by default, else ``position_ids``
    (``[batch or 1, seq]``) expanded, after checking that they count up by one."""
    bsz, seq = input_ids.shape
    if position_ids is None:
        return torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(bsz, seq)
    if position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, bsz):
        raise HFIntegrationError(f"shard_batch: position_ids expected [{bsz} or 1, {seq}], got shape {list(position_ids.shape)}")
    position_ids = position_ids.expand(bsz, seq)
    if seq > 1 and not bool((position_ids.diff(dim=1) == 1).all()):
        raise HFIntegrationError("shard_batch: position_ids must count up by one along the sequence, or (packed documents) restart at 0 at each document")
    return position_ids


def _shard_lengths(seq: int, world: int, pad: bool) -> tuple[int, list[int]]:
    """``(total, seq_lens)``: with ``pad``, ``seq`` padded up to a multiple of ``world`` and
    split evenly; without, ``seq`` split by ``split_lengths`` (uneven shards)."""
    if pad:
        total = math.ceil(seq / world) * world
        return total, [total // world] * world
    if seq < world:
        raise HFIntegrationError(f"shard_batch: the sequence ({seq} tokens) is shorter than the group ({world} ranks); use pad=True")
    return seq, split_lengths(seq, world)


def _shift_labels(labels: torch.Tensor, ignore_index: int, cu=None) -> tuple[torch.Tensor, int]:
    """The global label shift, done once before sharding: ``(shifted, num_tokens)`` where the
    target of position t is ``labels[t + 1]`` (the last position, and in a packed batch the
    last position of each document of each row's boundaries ``cu``, has none), ignored targets are ``-100`` whatever
    ``ignore_index`` was, and ``num_tokens`` counts the others."""
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    for b, row in enumerate(cu or ()):  # per row: the last token of each document has no target
        shifted[b, [end - 1 for end in row[1:]]] = ignore_index
    if ignore_index != -100:
        shifted = torch.where(shifted == ignore_index, torch.full_like(shifted, -100), shifted)
    return shifted, int((shifted != -100).sum())


def _fingerprint(input_ids: torch.Tensor, shifted: torch.Tensor, cu, positions: torch.Tensor | None = None) -> int:
    """A 63-bit fingerprint of the batch's tokens, shifted targets, mRoPE ``positions`` (if
    given) and document boundaries:
    position-weighted sums in wrapping int64 arithmetic (exact, so the same batch gives the
    same value on any device and in any summation order; one host sync)."""
    mask = (1 << 63) - 1

    def weighted(t: torch.Tensor) -> torch.Tensor:
        idx = torch.arange(t.numel(), device=t.device, dtype=torch.int64)
        weights = idx * -7046029254386353131 + 1442695040888963407  # odd multiplier: a bijection of the index
        return ((t.reshape(-1).to(torch.int64) + 0x9E3779B9) * (weights | 1)).sum()

    fp = weighted(input_ids) * 31 + weighted(shifted)
    if positions is not None:
        fp = fp * 31 + weighted(positions)
    fp = int(fp.item())
    return (fp * 1_000_003 + (-1 if cu is None else boundaries_digest([x for row in cu for x in row]))) & mask


def _check_same_batch(comm, device: torch.device, bsz: int, seq: int, total: int, num_tokens: int, bounds: int, fingerprint: int) -> None:
    """One all-gather over ``comm`` of ``(batch, seq, padded length, target count, document
    boundaries, content fingerprint)``: ranks fed different batches raise the same error on
    every rank. Collective."""
    everyone = comm.all_gather_ints([bsz, seq, total, num_tokens, bounds, fingerprint], device)
    if any(v != everyone[0] for v in everyone):
        shown = lambda v: f"batch={v[0]} seq={v[1]} padded={v[2]} targets={v[3]} cu_seqlens entries={v[4]} fingerprint={v[5]:016x}"
        rows = by_value([tuple(v) for v in everyone], shown)  # one entry per distinct batch, not per rank
        raise HFIntegrationError(
            f"shard_batch: the ranks of the sequence-parallel group were given different batches (every rank must pass the same global batch): {rows}"
        )
