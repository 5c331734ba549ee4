"""Chunking the plan: each rank's heads split into head chunks, each chunk a ``HeadPlan``
whose per-rank ranges are sub-ranges of the full plan's (see the package docstring for the
rules that keep chunked results bit-identical to one chunk)."""

from __future__ import annotations

import functools

from ...gqa import shares_one_kv
from ...plan import HeadPlan

__all__ = ["chunk_plans", "splits_shared_kv"]


def _rank_kv_groups(plan: HeadPlan, rank: int) -> list[tuple[int, int, int]]:
    """Local KV groups of ``rank``: ``(kv_head, q_start, q_end)`` with global indices."""
    g = plan.kv_group_size
    q0, q1 = plan.q_ranges[rank]
    out = []
    for kv in range(*plan.kv_ranges[rank]):
        a, b = max(q0, kv * g), min(q1, (kv + 1) * g)
        out.append((kv, a, b))
    return out


def _split_kv_groups(kv_groups, k: int) -> list[list]:
    """``k`` contiguous runs of ``kv_groups``, balanced by query heads."""
    cum = [0]
    for _, a, b in kv_groups:
        cum.append(cum[-1] + b - a)
    edges, prev = [0], 0
    for c in range(1, k):
        target = cum[-1] * c / k
        lo, hi = prev + 1, len(kv_groups) - (k - c)
        best = min(range(lo, hi + 1), key=lambda e: (abs(cum[e] - target), e))
        edges.append(best)
        prev = best
    edges.append(len(kv_groups))
    return [kv_groups[edges[i] : edges[i + 1]] for i in range(k)]


def splits_shared_kv(plan: HeadPlan, rank: int) -> bool:
    """True when ``rank``'s query heads all use its one KV head (``gqa.shares_one_kv``,
    the test ``for_rank`` applies): its chunks split that KV group's query heads."""
    return shares_one_kv(plan.local_kv_map(rank))


def _rank_parts(plan: HeadPlan, rank: int, chunks: int, split_kv_groups: bool, kv_last: bool):
    """``rank``'s chunks as ``(q_range, kv_range)`` pairs, global indices."""
    if split_kv_groups and splits_shared_kv(plan, rank):
        (kv, a, b), k = _rank_kv_groups(plan, rank)[0], min(chunks, plan.q_count(rank))
        edges = [a + (b - a) * i // k for i in range(k + 1)]
        # The KV head travels once: with the first chunk's queries (forward), with the
        # last chunk's query gradients (backward: its gradient is complete only then).
        owner = k - 1 if kv_last else 0
        return [((edges[i], edges[i + 1]), (kv, kv + 1) if i == owner else (kv, kv)) for i in range(k)]
    kv_groups = _rank_kv_groups(plan, rank)
    parts = _split_kv_groups(kv_groups, min(chunks, len(kv_groups)))
    return [((p[0][1], p[-1][2]), (p[0][0], p[-1][0] + 1)) for p in parts]


@functools.lru_cache(maxsize=128)
def chunk_plans(plan: HeadPlan, chunks: int, *, split_kv_groups: bool = True, kv_last: bool = False) -> tuple[HeadPlan, ...]:
    """Split every rank's heads into at most ``chunks`` chunks.

    A rank with several local KV groups is split on KV-group boundaries into
    ``min(chunks, kv_count(r))`` chunks (each chunk holds its KV groups' KV heads). A rank
    whose query heads share its one KV head (``splits_shared_kv``; Llama-3-8B or
    Qwen2.5-14B at sp 8, MQA) is split into ``min(chunks, q_count(r))`` chunks of query
    heads when ``split_kv_groups`` (the backend is an ``AttentionBackend``, so ``SharedKV``
    can sum the KV gradient across chunks); its KV head is in the first chunk's ranges, or
    in the last one's with ``kv_last`` (the backward's dk/dv), and empty elsewhere.
    A rank uses its first chunks; later ones give it empty ranges. Returns one ``HeadPlan``
    per chunk (``q_heads``/``kv_heads`` stay the global counts, ranges are sub-ranges); a
    single plan equal in ranges to ``plan`` when no rank can be split.
    """
    if chunks < 1:
        raise ValueError(f"chunk_plans: chunks must be >= 1, got {chunks}")
    per_rank = [_rank_parts(plan, r, chunks, split_kv_groups, kv_last) for r in range(plan.world_size)]
    n = max(len(parts) for parts in per_rank)
    out = []
    for c in range(n):
        q_ranges, kv_ranges = [], []
        for r, parts in enumerate(per_rank):
            if c < len(parts):
                q_ranges.append(parts[c][0])
                kv_ranges.append(parts[c][1])
            else:
                # Empty, placed at the range start: harmless to the unpack's replica walk.
                q_ranges.append((plan.q_ranges[r][0],) * 2)
                kv_ranges.append((plan.kv_ranges[r][0],) * 2)
        out.append(HeadPlan(plan.q_heads, plan.kv_heads, plan.world_size, tuple(q_ranges), tuple(kv_ranges)))
    return tuple(out)
