"""Cut a global sequence into the shards of a 2-D group, and put it back together.

``shard_sequence(x, sp)`` is what rank ``sp.rank`` feeds the op; ``unshard_sequence`` the
inverse, from every rank's shard. The positions come from ``layout.shard_rows`` (the one
place the layout math lives), with ``sp.seq_layout`` unless ``layout`` is given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .groups import SPGroups
from .layout import check_seq_layout, shard_rows

__all__ = ["shard_sequence", "unshard_sequence"]


def _layout(sp: SPGroups, layout: str | None, who: str) -> str:
    if not isinstance(sp, SPGroups):
        raise TypeError(f"{who}: sp_groups expected an SPGroups (make_sp_groups), got {type(sp).__name__}")
    return sp.seq_layout if layout is None else check_seq_layout(layout, who)


def shard_sequence(x: torch.Tensor, sp_groups: SPGroups, *, layout: str | None = None, dim: int = 1,
                   rank: int | None = None) -> torch.Tensor:  # fmt: skip
    """Rank ``rank``'s shard (default: this process's rank in ``sp_groups``) of the global
    sequence ``x`` (``[batch, seq, ...]`` with the sequence on ``dim``).

    ``layout``: ``"contiguous"`` or ``"zigzag"`` (default ``sp_groups.seq_layout``; the op
    reads ``sp_groups.seq_layout``, so shard with the layout you give the op). The sequence
    must split into equal shards (``ValueError`` says the multiple)."""
    layout = _layout(sp_groups, layout, "shard_sequence")
    rank = sp_groups.member_rank() if rank is None else rank
    rows = shard_rows(x.shape[dim], sp_groups.ulysses_size, sp_groups.ring_size, rank, layout)
    if layout == "contiguous":
        return x.narrow(dim, int(rows[0]), rows.numel())
    return x.index_select(dim, rows.to(x.device))


def unshard_sequence(shards: torch.Tensor | Sequence[torch.Tensor], sp_groups: SPGroups, *,
                     layout: str | None = None, dim: int = 1) -> torch.Tensor:  # fmt: skip
    """The global sequence from every rank's shard: a list in group-rank order, or this
    rank's shard alone (then gathered over ``sp_groups.group`` with ``all_gather``, which is
    collective over the whole group and not differentiable)."""
    layout = _layout(sp_groups, layout, "unshard_sequence")
    if isinstance(shards, torch.Tensor):
        parts = [torch.empty_like(shards) for _ in range(sp_groups.world_size)]
        dist.all_gather(parts, shards.contiguous(), group=sp_groups.group)
        shards = parts
    if len(shards) != sp_groups.world_size:
        raise ValueError(f"unshard_sequence: expected {sp_groups.world_size} shards (one per rank), got {len(shards)}")
    total = sum(x.shape[dim] for x in shards)
    rows = torch.cat([shard_rows(total, sp_groups.ulysses_size, sp_groups.ring_size, r, layout) for r in range(len(shards))])
    order = torch.empty_like(rows)
    order[rows] = torch.arange(rows.numel())
    return torch.cat(list(shards), dim=dim).index_select(dim, order.to(shards[0].device))
