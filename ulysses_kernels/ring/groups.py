"""The two levels of 2-D sequence parallelism as one value: ``make_sp_groups``.

A group of ``P = U * R`` ranks is cut two ways (``placement="head_first"``, the one placement
implemented): *Ulysses groups* of ``U`` contiguous ranks (inside a node, where NVLink carries
the all-to-all) and *ring groups* of ``R`` ranks strided by ``U`` (one rank per Ulysses group,
across nodes, where each step moves one KV block point to point)::

    rank r of the group = Ulysses rank (r % U) of ring rank (r // U)
    Ulysses group j = ranks [j*U, (j+1)*U)        ring group u = ranks {u, u+U, u+2U, ...}

The rank lists are a pure function of ``(P, U, R)`` (``sp_rank_lists``); ``make_sp_groups``
adds the ``new_group`` calls. The result holds the handles of this process's groups and
nothing global: two calls give two independent values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..comm import TorchCommunicator
from ..plan import HeadPlan
from .seq_layout import block_segments, check_seq_layout

__all__ = ["SPGroups", "make_sp_groups", "sp_rank_lists", "PLACEMENTS"]

PLACEMENTS = ("head_first",)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"make_sp_groups: {name} expected a positive int, got {value!r}")
    return value


def sp_rank_lists(world_size: int, ulysses_size: int, ring_size: int, placement: str = "head_first"):
    """``(ulysses, ring)``: the Ulysses groups and the ring groups as tuples of group ranks
    (module docstring). ``ValueError`` when the sizes do not multiply to ``world_size`` or the
    placement is unknown; the lists are checked to cut the group exactly (every rank in one
    Ulysses group and one ring group)."""
    _positive_int("ulysses_size", ulysses_size)
    _positive_int("ring_size", ring_size)
    if placement not in PLACEMENTS:
        raise ValueError(f"make_sp_groups: placement expected one of {list(PLACEMENTS)}, got {placement!r}")
    if ulysses_size * ring_size != world_size:
        raise ValueError(
            f"make_sp_groups: ulysses_size * ring_size ({ulysses_size} * {ring_size} = {ulysses_size * ring_size}) must equal the group's size ({world_size})"
        )
    u_size = ulysses_size
    ulysses = tuple(tuple(j * u_size + u for u in range(u_size)) for j in range(ring_size))
    ring = tuple(tuple(j * u_size + u for j in range(ring_size)) for u in range(u_size))
    for what, lists in (("Ulysses", ulysses), ("ring", ring)):
        flat = sorted(r for g in lists for r in g)
        if flat != list(range(world_size)):
            missing = sorted(set(range(world_size)) - set(flat))
            raise ValueError(f"make_sp_groups: ranks {missing} are in no {what} group (lists {lists})")
    return ulysses, ring


@dataclass(frozen=True)
class SPGroups:
    """Both levels of a 2-D sequence-parallel group, as seen from this process.

    ``ulysses_ranks[j]``/``ring_ranks[u]``: group ranks of Ulysses group ``j`` and ring group
    ``u``; ``ranks``: the global rank of each group rank. ``rank``: this process's rank in
    the whole group (``None`` when it is not a member; the op then raises).
    ``seq_layout``: how the sequence is sharded (``"contiguous"``: rank r holds the r-th
    contiguous shard; ``"zigzag"``: see ``ring.seq_layout``), the one place the op reads it from.
    The process-group handles (``ulysses_group``, ``ring_group``, and ``ring_grad_group``, the
    channel of its own on which dK/dV travel back around the ring) are this process's.
    """

    ulysses_size: int
    ring_size: int
    placement: str
    seq_layout: str
    ranks: tuple[int, ...]
    ulysses_ranks: tuple[tuple[int, ...], ...]
    ring_ranks: tuple[tuple[int, ...], ...]
    rank: int | None
    group: object = field(default=None, compare=False, repr=False)
    ulysses_group: object = field(default=None, compare=False, repr=False)
    ring_group: object = field(default=None, compare=False, repr=False)
    ring_grad_group: object = field(default=None, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def ulysses_rank(self) -> int:
        return self.member_rank() % self.ulysses_size

    @property
    def ring_rank(self) -> int:
        return self.member_rank() // self.ulysses_size

    def member_rank(self) -> int:
        """This process's rank in the whole group; ``ValueError`` when it is in no group."""
        if self.rank is None:
            raise ValueError(
                "SPGroups: this process is in no group of this SPGroups (it was made for the ranks "
                f"{list(self.ranks)}); pass the SPGroups of a group this process belongs to"
            )
        return self.rank

    def with_layout(self, seq_layout: str) -> SPGroups:
        """The same groups with another ``seq_layout`` (no process group is made)."""
        return replace(self, seq_layout=check_seq_layout(seq_layout, "SPGroups.with_layout"))

    def describe(self, q_heads: int | None = None, kv_heads: int | None = None, seq_len: int | None = None, *,
                 batch: int = 1, head_dim: int = 128, itemsize: int = 2) -> str:  # fmt: skip
        """The 2-D plan as text: per rank its Ulysses and ring rank, its heads (with
        ``q_heads``/``kv_heads``: the ``HeadPlan`` of its Ulysses group) and the sequence
        segments its ring block holds; with ``seq_len`` too, the bytes each rank sends per
        level in one forward (Ulysses: q/k/v to its peers and the output back; ring: its
        K/V block to the next ring rank, ``ring_size - 1`` times: the full ring; a causal call
        on contiguous shards, or a packed one, sends fewer, ``ring.schedule``)."""
        plan = HeadPlan.build(q_heads, kv_heads, self.ulysses_size) if q_heads is not None else None
        n_segments = block_segments(0, self.ring_size, self.seq_layout)[1]
        lines = [
            f"SPGroups: {self.world_size} ranks = {self.ulysses_size} (Ulysses, contiguous ranks) x "
            f"{self.ring_size} (ring, strided), placement {self.placement}, seq_layout {self.seq_layout} "
            f"({n_segments} sequence segments)",
            f"  Ulysses groups {[list(g) for g in self.ulysses_ranks]}; ring groups {[list(g) for g in self.ring_ranks]}",
        ]
        if plan is not None:
            lines.append("  " + plan.table().splitlines()[0].replace("HeadPlan", "heads per Ulysses group"))
        head = "  rank  ulysses  ring  segments"
        head += "  q heads    kv heads" if plan is not None else ""
        head += "  ulysses bytes  ring bytes" if plan is not None and seq_len is not None else ""
        lines.append(head)
        for r in range(self.world_size):
            u, j = r % self.ulysses_size, r // self.ulysses_size
            row = f"  {r:4d}  {u:7d}  {j:4d}  {str(list(ring_segments(self, j))):>8s}"
            if plan is not None:
                (q0, q1), (k0, k1) = plan.q_ranges[u], plan.kv_ranges[u]
                row += f"  [{q0:3d},{q1:3d})  [{k0:3d},{k1:3d})"
                if seq_len is not None:
                    a2a, p2p = _bytes_sent(plan, u, self, seq_len, batch * head_dim * itemsize)
                    row += f"  {a2a:13d}  {p2p:10d}"
            lines.append(row)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _check_world() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("make_sp_groups: torch.distributed is not initialized; call torch.distributed.init_process_group first (or launch with torchrun)")


def _group_ranks(group) -> tuple[int, ...]:
    """The global ranks of ``group`` in group order, known to every process of the world
    (a process outside ``group`` cannot ask its handle: one small all-gather over the world)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    mine = dist.get_rank(group)  # -1 outside the group
    everyone = TorchCommunicator(None).all_gather_ints([mine], torch.device("cpu"))
    return tuple(g for _, g in sorted((r[0], g) for g, r in enumerate(everyone) if r[0] >= 0))


def make_sp_groups(ulysses_size: int, ring_size: int, group=None, placement: str = "head_first", *,
                   seq_layout: str = "contiguous", timeout=None) -> SPGroups:  # fmt: skip
    """Cut ``group`` (default: the world) into Ulysses groups and ring groups.

    Collective over the *world*, like ``torch.distributed.new_group``: every process calls it
    with the same arguments, members of ``group`` or not (a non-member gets a value whose
    ``rank`` is ``None``; the op raises if given it). Pass the result as ``group=`` to
    ``ulysses_attention``/``UlyssesAttention``/``hf.apply``.

    Args:
        ulysses_size: ranks per Ulysses group (contiguous ranks: put them inside a node).
        ring_size: ranks per ring group; ``ulysses_size * ring_size`` must be the group's size.
        placement: ``"head_first"`` (Ulysses on contiguous ranks, the ring strided).
        seq_layout: ``"contiguous"`` (rank r holds the r-th contiguous shard) or ``"zigzag"``
            (causal load balance; shard with ``shard_sequence``). Change later with
            ``SPGroups.with_layout``.
        timeout: a ``datetime.timedelta`` for the new groups' collectives (passed to
            ``new_group``). ``None``: torch's default for the backend (``new_group`` does not
            inherit the timeout given to ``init_process_group``: pass it again here).
    """
    ulysses_size, ring_size = _positive_int("ulysses_size", ulysses_size), _positive_int("ring_size", ring_size)
    check_seq_layout(seq_layout, "make_sp_groups")
    _check_world()
    ranks = _group_ranks(group)
    ulysses, ring = sp_rank_lists(len(ranks), ulysses_size, ring_size, placement)
    me = dist.get_rank()
    rank = ranks.index(me) if me in ranks else None
    handles = {}
    # Every process makes every group, in the same order (torch's new_group contract).
    for name, lists in (("ulysses_group", ulysses), ("ring_group", ring), ("ring_grad_group", ring)):
        for members in lists:
            made = dist.new_group([ranks[r] for r in members], timeout=timeout)
            if rank is not None and rank in members:
                handles[name] = made
    return SPGroups(ulysses_size, ring_size, placement, seq_layout, ranks, ulysses, ring, rank, group, **handles)


def ring_segments(sp: SPGroups, ring_rank: int) -> tuple[int, ...]:
    """The sequence segments of ring rank ``ring_rank``'s block (``ring.seq_layout.block_segments``)."""
    return block_segments(ring_rank, sp.ring_size, sp.seq_layout)[0]


def _bytes_sent(plan: HeadPlan, u: int, sp: SPGroups, seq_len: int, row_bytes: int) -> tuple[int, int]:
    """Bytes Ulysses rank ``u`` sends in one forward: over its Ulysses group (q/k/v rows of
    its shard for each peer's heads, then its heads' output rows for each peer's shard) and
    over its ring group (its K/V block, ``ring_size - 1`` times). ``row_bytes``: one head of
    one token of the whole batch."""
    s = seq_len // sp.world_size
    peers = [p for p in range(sp.ulysses_size) if p != u]
    a2a = sum(s * plan.local_heads(p) for p in peers) + len(peers) * s * plan.q_count(u)
    p2p = (sp.ring_size - 1) * sp.ulysses_size * s * 2 * plan.kv_count(u)
    return a2a * row_bytes, p2p * row_bytes
