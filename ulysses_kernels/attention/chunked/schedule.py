"""This rank's chunk schedule for one layout and chunk count: pure data, cached (the
layouts of each chunk's exchanges, the KV maps, which KV heads are summed across ranks)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ...gqa import uniform_kv_groups
from ...layout import Layout
from ...plan import HeadPlan
from .chunking import chunk_plans, splits_shared_kv

__all__ = ["Chunk", "Schedule", "build_schedule"]


@dataclass(frozen=True)
class Chunk:
    layout: Layout  # the chunk's plan, this rank: q/k/v in, output out, dout in
    grad: Layout  # the chunk's backward plan: dq/dk/dv out (a shared KV head's with its last chunk)
    kv_map: tuple[int, ...]  # local query head -> local KV head, within the chunk
    expand: tuple[int, ...] | None  # index_select of KV heads done here (see _attend)
    shared: bool  # this rank runs SharedKV on the chunk, with the KV head of its first chunk
    grad_kv: bool  # some rank sends dk/dv in this chunk (else those exchanges are skipped)
    unpack: Layout  # for dq/dk/dv: replicated KV heads trimmed from every rank's range
    trim: tuple[tuple[int, int], ...]  # per source: KV heads [lo, hi) of its block unpacked here


@dataclass(frozen=True)
class Schedule:
    chunks: tuple[Chunk, ...]
    replicas: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]  # (kv head, ((rank, chunk, index in block), ...))
    replica_blocks: frozenset[tuple[int, int]]  # (chunk, source) of the dk/dv blocks the replica sums read


@functools.lru_cache(maxsize=64)
def build_schedule(layout: Layout, n: int, split_kv_groups: bool) -> Schedule:
    plan, rank = layout.plan, layout.rank
    plans = chunk_plans(plan, n, split_kv_groups=split_kv_groups)
    grad_plans = chunk_plans(plan, n, split_kv_groups=split_kv_groups, kv_last=True)
    replicated = {h for h in range(plan.kv_heads) if len(plan.kv_holders(h)) > 1}
    full_map = plan.local_kv_map(rank)
    full_uniform = uniform_kv_groups(len(full_map), plan.kv_count(rank), full_map)
    shared = split_kv_groups and splits_shared_kv(plan, rank)

    def lay(p: HeadPlan) -> Layout:
        return layout.with_plan(p)

    chunks, where = [], {}
    for c, (cp, gp) in enumerate(zip(plans, grad_plans)):
        # A shared KV head's chunks without it map their query heads to index 0 all the same:
        # their empty KV range starts at that head.
        kv_map = cp.local_kv_map(rank)
        # The unchunked backend gathers KV heads per query head when the rank's map is not
        # uniform; a chunk's map may be uniform, so gather here to run the same kernels.
        expand = None if full_uniform or not kv_map else kv_map
        trim, trimmed = [], []
        for p in range(plan.world_size):
            a, b = gp.kv_ranges[p]
            lo, hi = a, b
            while lo < hi and lo in replicated:
                lo += 1
            while hi > lo and (hi - 1) in replicated:
                hi -= 1
            trim.append((lo - a, hi - a))
            trimmed.append((lo, hi))
            for h in range(a, b):
                if h in replicated:
                    where[(h, p)] = (c, h - a)
        unpack_plan = HeadPlan(plan.q_heads, plan.kv_heads, plan.world_size, gp.q_ranges, tuple(trimmed))
        grad_kv = any(gp.kv_count(p) for p in range(plan.world_size))
        chunks.append(Chunk(lay(cp), lay(gp), kv_map, expand, shared, grad_kv, lay(unpack_plan), tuple(trim)))
    replicas = tuple((h, tuple((p, *where[(h, p)]) for p in plan.kv_holders(h))) for h in sorted(replicated))
    blocks = frozenset((c, p) for _, holders in replicas for p, c, _ in holders)
    return Schedule(tuple(chunks), replicas, blocks)
