"""Head plans: which rank computes which query and KV heads.

A ``HeadPlan`` is a plain immutable object built from ``(q_heads, kv_heads, world_size)``.
It holds no reference to a process group and there is no module-level cache: two
groups with the same sizes get equal plans, and a plan can be built, printed and
tested without ``torch.distributed``.

Rules (all ranks compute the same plan from the same three integers):

* Query heads are split into contiguous ranges, one per rank, of ``floor(Hq/P)`` or
  ``ceil(Hq/P)`` heads (the best load balance possible).
* With grouped-query attention (``g = Hq / Hkv`` query heads share one KV head), a rank
  receives exactly the KV heads its query heads use. A KV head whose group is split
  across ranks is sent to each of them (replicated on the wire, never ``repeat``-ed on
  the sender). Among all balanced layouts, the plan picks one with the fewest KV copies:
  the number of KV heads sent is ``P + Hkv - c`` where ``c`` is the number of connected
  rank/group components, so a small dynamic program over the rank boundaries maximises
  the boundaries that fall on a group boundary.
* ``world_size > q_heads`` cannot be served by head parallelism alone and is an error that
  names a ``make_sp_groups`` split (Ulysses x ring) that can.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

__all__ = ["HeadPlan", "PlanError", "more_ranks_than_heads", "more_ranks_than_heads_flat"]


class PlanError(ValueError):
    """A head layout that cannot be planned."""


def _balanced_counts(q_heads: int, kv_heads: int, world_size: int) -> tuple[int, ...]:
    """Per-rank query-head counts, balanced, with the most group-aligned boundaries."""
    group = q_heads // kv_heads
    lo, n_hi = divmod(q_heads, world_size)
    # score[r][u]: most aligned boundaries among ranks r.. when u ranks before r got lo+1.
    # Bottom-up so that large world sizes need no recursion.
    neg = -1
    score = [[neg] * (n_hi + 1) for _ in range(world_size + 1)]
    choice = [[0] * (n_hi + 1) for _ in range(world_size + 1)]
    score[world_size][n_hi] = 0
    for r in range(world_size - 1, -1, -1):
        for u in range(n_hi + 1):
            best = neg
            # Larger counts first: ties go to the layout that front-loads the extra heads.
            for extra in (1, 0):
                if u + extra > n_hi or score[r + 1][u + extra] == neg:
                    continue
                end = (r + 1) * lo + u + extra
                aligned = 1 if (r + 1 < world_size and end % group == 0) else 0
                if score[r + 1][u + extra] + aligned > best:
                    best, choice[r][u] = score[r + 1][u + extra] + aligned, extra
            score[r][u] = best
    counts, used = [], 0
    for r in range(world_size):
        counts.append(lo + choice[r][used])
        used += choice[r][used]
    return tuple(counts)


def more_ranks_than_heads(world_size: int, q_heads: int, what: str = "world_size") -> str:
    """The error text for a Ulysses level larger than the query heads (``what``: the flat
    group's ``world_size``, or a 2-D group's ``ulysses_size``), naming a 2-D split of the
    ``world_size`` ranks that fits: the largest Ulysses size that divides them and has a
    query head per rank."""
    ulysses = max(u for u in range(1, q_heads + 1) if world_size % u == 0)
    return (
        f"{what} > q_heads ({q_heads}): Ulysses needs at least one query head per rank; "
        f"split the {world_size} ranks in two levels, Ulysses inside and ring attention across: "
        f"group=ulysses_kernels.make_sp_groups(ulysses_size={ulysses}, ring_size={world_size // ulysses})"
    )


def more_ranks_than_heads_flat(heads: int, world_size: int, why_not_2d: str) -> str:
    """The error text for a layer of ``heads`` heads on ``world_size > heads`` ranks where a 2-D
    group does not help (``why_not_2d`` says why; ``more_ranks_than_heads`` would suggest
    ``make_sp_groups``): the fix that works is a smaller flat group."""
    fix = "run it without sequence parallelism" if heads == 1 else f"pass a flat sequence-parallel group of at most {heads} ranks"
    return f"Ulysses gives each rank at least one of its {heads} heads, and {why_not_2d}; {fix}"


@dataclass(frozen=True)
class HeadPlan:
    """Assignment of query and KV heads to the ranks of a sequence-parallel group.

    Attributes:
        q_heads, kv_heads, world_size: the inputs.
        q_ranges: per rank, the half-open global query-head range ``(start, end)``.
        kv_ranges: per rank, the half-open global KV-head range the rank receives.
    """

    q_heads: int
    kv_heads: int
    world_size: int
    q_ranges: tuple[tuple[int, int], ...]
    kv_ranges: tuple[tuple[int, int], ...]

    @classmethod
    def build(cls, q_heads: int, kv_heads: int, world_size: int) -> HeadPlan:
        for name, value in (("q_heads", q_heads), ("kv_heads", kv_heads), ("world_size", world_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"HeadPlan: {name} must be a positive int, got {value!r}")
        if q_heads % kv_heads != 0:
            raise PlanError(f"HeadPlan: q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
        if world_size > q_heads:
            raise PlanError(f"HeadPlan: {more_ranks_than_heads(world_size, q_heads, f'world_size ({world_size})')}")
        group = q_heads // kv_heads
        counts = _balanced_counts(q_heads, kv_heads, world_size)
        q_ranges, kv_ranges, start = [], [], 0
        for count in counts:
            end = start + count
            q_ranges.append((start, end))
            kv_ranges.append((start // group, (end - 1) // group + 1))
            start = end
        return cls(q_heads, kv_heads, world_size, tuple(q_ranges), tuple(kv_ranges))

    # ---- per-rank sizes -------------------------------------------------------------
    @property
    def kv_group_size(self) -> int:
        """Query heads per KV head, the size of a KV group (``1`` for MHA, ``q_heads`` for MQA)."""
        return self.q_heads // self.kv_heads

    @property
    def group_size(self) -> int:
        """Deprecated: ``kv_group_size`` (a "group" is a process group)."""
        warnings.warn("HeadPlan.group_size is deprecated: use HeadPlan.kv_group_size", DeprecationWarning, stacklevel=2)
        return self.kv_group_size

    def q_count(self, rank: int) -> int:
        start, end = self.q_ranges[rank]
        return end - start

    def kv_count(self, rank: int) -> int:
        start, end = self.kv_ranges[rank]
        return end - start

    def local_heads(self, rank: int) -> int:
        """Heads of one token that rank ``rank`` receives per source: q + k + v."""
        return self.q_count(rank) + 2 * self.kv_count(rank)

    def local_kv_map(self, rank: int) -> tuple[int, ...]:
        """For each local query head of ``rank``, the index of its local KV head."""
        q0, q1 = self.q_ranges[rank]
        kv0 = self.kv_ranges[rank][0]
        return tuple(h // self.kv_group_size - kv0 for h in range(q0, q1))

    def kv_holders(self, kv_head: int) -> tuple[int, ...]:
        """Ranks that receive global KV head ``kv_head`` (more than one: replicated)."""
        return tuple(r for r, (a, b) in enumerate(self.kv_ranges) if a <= kv_head < b)

    # ---- summary numbers --------------------------------------------------------------
    @property
    def kv_sent(self) -> int:
        """KV heads sent in total (per k or v), replicas included."""
        return sum(self.kv_count(r) for r in range(self.world_size))

    @property
    def kv_replication(self) -> float:
        """KV heads sent / KV heads: ``1.0`` means no KV head is sent twice."""
        return self.kv_sent / self.kv_heads

    @property
    def imbalance(self) -> float:
        """Largest per-rank query-head count over the mean (``1.0`` is perfect)."""
        return max(self.q_count(r) for r in range(self.world_size)) * self.world_size / self.q_heads

    @property
    def traffic_ratio(self) -> float:
        """Bytes each rank sends in the q/k/v all-to-all over the even ideal (no replicas)."""
        return (self.q_heads + 2 * self.kv_sent) / (self.q_heads + 2 * self.kv_heads)

    def table(self) -> str:
        """A printable per-rank table of the plan."""
        ideal = (self.q_heads + 2 * self.kv_heads) / self.world_size
        lines = [
            f"HeadPlan: {self.q_heads} query heads, {self.kv_heads} KV heads (KV group {self.kv_group_size}), {self.world_size} ranks",
            f"  KV replication {self.kv_replication:.3f}x ({self.kv_sent} KV heads sent for "
            f"{self.kv_heads}), load imbalance {self.imbalance:.3f}x, "
            f"q/k/v bytes sent {self.traffic_ratio:.3f}x the even ideal",
            "  rank  q heads    kv heads   q  kv  recv heads/token  vs even",
        ]
        for r in range(self.world_size):
            (q0, q1), (k0, k1) = self.q_ranges[r], self.kv_ranges[r]
            lines.append(
                f"  {r:4d}  [{q0:3d},{q1:3d})  [{k0:3d},{k1:3d})  {q1 - q0:2d}  {k1 - k0:2d}  {self.local_heads(r):16d}  {self.local_heads(r) / ideal:6.3f}x"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
