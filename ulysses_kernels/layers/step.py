"""The step of a switched model, for every framework: how one step's global sequence is split
over the sequence-parallel group (``SequenceShard``), the keyword it travels under to every
attention call and token mixer (``SHARD_KWARG``), and the error of the model side.

``hf.shard_batch`` makes the step from a global batch; verl's switch from verl's packed
slices; the ALST entry point from the gathered position ids (through ``shard_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..checks import UlyssesInputError
from ..documents import Documents
from ..ring import SPGroups, shard_rows

__all__ = ["GROUP_KWARG", "HFIntegrationError", "SHARD_KWARG", "STEP_KWARGS", "SequenceShard", "process_group", "rank_world"]

SHARD_KWARG = "ulysses_shard"  # the per-step ``SequenceShard`` in the model's kwargs
# ``(group, communicator)`` of this step, in the model's kwargs, for mixers switched without a
# group (verl's switch: its group is known per forward, not when the model is prepared).
GROUP_KWARG = "ulysses_mixer_group"
# The step's keywords in a model's kwargs: read by this package, never passed to the model's own functions.
STEP_KWARGS = (SHARD_KWARG, GROUP_KWARG)


class HFIntegrationError(UlyssesInputError):
    """A model, batch or group that the transformers integration cannot run."""


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
    # This rank's share of the per-step inputs a vision-language model's text model takes
    # besides ``inputs_embeds`` and ``position_ids`` (Qwen3-VL's deepstack:
    # ``visual_pos_masks`` ``[batch, seq_lens[rank]]`` and ``deepstack_visual_embeds``, the
    # rows of this rank's visual tokens); ``apply`` hands them to the text model. ``None``: none.
    text_inputs: dict | None = field(default=None, repr=False)
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
            raise HFIntegrationError(f"SequenceShard.shard: x.shape[{dim}] expected {self.valid_len} (the global length), got {x.shape[dim]}")
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


def process_group(group):
    """The process group of the whole sequence-parallel group (an ``SPGroups``' ``group``)."""
    return group.group if isinstance(group, SPGroups) else group


def rank_world(group) -> tuple[int, int]:
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
