"""Cut a global sequence into the shards of a 2-D group, and put it back together.

``shard_sequence(x, sp)`` is what rank ``sp.rank`` feeds the op; ``unshard_sequence`` the
inverse, from every rank's shard. The positions come from ``seq_layout.shard_rows`` (the one
place where the sequence's layout is computed), with ``sp.seq_layout`` unless ``seq_layout``
is given (``layout=`` is its older name, still accepted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .groups import SPGroups
from .seq_layout import check_seq_layout, shard_rows

__all__ = ["shard_sequence", "unshard_sequence"]


def _seq_layout(sp: SPGroups, seq_layout: str | None, layout: str | None, who: str) -> str:
    if not isinstance(sp, SPGroups):
        raise TypeError(f"{who}: sp_groups expected an SPGroups (make_sp_groups), got {type(sp).__name__}")
    if layout is not None:  # the older name of seq_layout
        if seq_layout is not None and seq_layout != layout:
            raise ValueError(f"{who}: seq_layout={seq_layout!r} and layout={layout!r} (its older name) disagree; pass seq_layout only")
        seq_layout = layout
    return sp.seq_layout if seq_layout is None else check_seq_layout(seq_layout, who)


def shard_sequence(x: torch.Tensor, sp_groups: SPGroups, *, seq_layout: str | None = None, dim: int = 1,
                   rank: int | None = None, layout: str | None = None) -> torch.Tensor:  # fmt: skip
    """Rank ``rank``'s shard (default: this process's rank in ``sp_groups``) of the global
    sequence ``x`` (``[batch, seq, ...]`` with the sequence on ``dim``).

    ``seq_layout``: ``"contiguous"`` or ``"zigzag"`` (default ``sp_groups.seq_layout``; the op
    reads ``sp_groups.seq_layout``, so shard with the layout you give the op; ``layout`` is
    its older name). The sequence must split into equal shards (``ValueError`` says the multiple)."""
    seq_layout = _seq_layout(sp_groups, seq_layout, layout, "shard_sequence")
    rank = sp_groups.member_rank() if rank is None else rank
    rows = shard_rows(x.shape[dim], sp_groups.ulysses_size, sp_groups.ring_size, rank, seq_layout)
    if seq_layout == "contiguous":
        return x.narrow(dim, int(rows[0]), rows.numel())
    return x.index_select(dim, rows.to(x.device))


def unshard_sequence(shards: torch.Tensor | Sequence[torch.Tensor], sp_groups: SPGroups, *,
                     seq_layout: str | None = None, dim: int = 1, layout: str | None = None) -> torch.Tensor:  # fmt: skip
    """The global sequence from every rank's shard: a list in group-rank order, or this
    rank's shard alone (then gathered over ``sp_groups.group`` with ``all_gather``, which is
    collective over the whole group and not differentiable)."""
    seq_layout = _seq_layout(sp_groups, seq_layout, layout, "unshard_sequence")
    if isinstance(shards, torch.Tensor):
        parts = [torch.empty_like(shards) for _ in range(sp_groups.world_size)]
        dist.all_gather(parts, shards.contiguous(), group=sp_groups.group)
        shards = parts
    if len(shards) != sp_groups.world_size:
        raise ValueError(f"unshard_sequence: expected {sp_groups.world_size} shards (one per rank), got {len(shards)}")
    total = sum(x.shape[dim] for x in shards)
    rows = torch.cat([shard_rows(total, sp_groups.ulysses_size, sp_groups.ring_size, r, seq_layout) for r in range(len(shards))])
    order = torch.empty_like(rows)
    order[rows] = torch.arange(rows.numel())
    return torch.cat(list(shards), dim=dim).index_select(dim, order.to(shards[0].device))
