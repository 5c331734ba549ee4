"""Document order for the ring level's load balance: ``balance_documents``.

A packed sequence's attention is block-diagonal over its documents, so the order of the
documents in the sequence does not change any result (each document attends within itself;
positions restart per document; the loss sums over every token). It does change which ring
rank does which work: ring rank ``j`` computes the document-causal pairs of its block's
query rows (``RingSchedule.pairs``), about ``sum(L^2) / 2`` over the documents in its block,
and the slowest ring rank sets the pace of the layer. ``bench.ring_balance`` shows that
neither layout balances that on its own (docs/scaling.md). ``balance_documents`` picks an
order that does, for the layout the group uses::

    order = uk.ring.balance_documents([len(d) for d in docs], sp.ring_size, sp.seq_layout, padded_to=padded)
    packed = [docs[i] for i in order]        # then pack (DataCollatorWithFlattening, ...) as usual

``rank_work`` is the exact per-ring-rank work of an order (equal to the schedule's
``pairs``, tested): for a document ``[s, e)`` and a segment ``[a, b)`` of a ring rank's
block, the query rows inside the segment at offsets ``lo .. hi-1`` in the document see
``o + 1`` keys each: ``(hi (hi + 1) - lo (lo + 1)) / 2`` pairs.

The search: a few starting orders (the given one; the documents dealt longest first to the
least-loaded ring rank with room), then swaps of a document starting on the most loaded
ring rank with one on the least loaded, kept when the largest load drops (or stays and the
loads spread less). Seeded, so every rank that calls it with the same lengths gets the same
order. Cost: about a millisecond per hundred swaps for a thousand documents on a CPU.
"""

from __future__ import annotations

import random

import torch

from .seq_layout import block_segments

__all__ = ["rank_work", "balance_documents"]


def _segments(total: int, ring_size: int, seq_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bounds [n+1], owner [n])``: the sequence's segments in position order and the ring rank
    whose block holds each (contiguous: ``R`` segments; zigzag: ``2R``)."""
    n = block_segments(0, ring_size, seq_layout)[1]
    if total % n:
        raise ValueError(f"balance_documents: the documents' total ({total} tokens) must split into {n} equal segments for seq_layout={seq_layout!r}")
    owner = [0] * n
    for j in range(ring_size):
        for c in block_segments(j, ring_size, seq_layout)[0]:
            owner[c] = j
    return torch.arange(n + 1, dtype=torch.int64) * (total // n), torch.tensor(owner)


def _work(lengths: torch.Tensor, bounds: torch.Tensor, owner: torch.Tensor, ring_size: int) -> torch.Tensor:
    ends = lengths.cumsum(0)
    starts = ends - lengths
    lo = (bounds[:-1].unsqueeze(0) - starts.unsqueeze(1)).clamp(min=0).minimum(lengths.unsqueeze(1))  # [docs, segments]
    hi = (bounds[1:].unsqueeze(0) - starts.unsqueeze(1)).clamp(min=0).minimum(lengths.unsqueeze(1))
    per_segment = ((hi * (hi + 1) - lo * (lo + 1)) // 2).sum(0)
    return torch.zeros(ring_size, dtype=torch.int64).index_add_(0, owner, per_segment)


def rank_work(lengths, ring_size: int, seq_layout: str = "contiguous") -> list[int]:
    """Causal document pairs each ring rank computes when documents of ``lengths`` are
    packed in this order (their total must split into the layout's equal segments)."""
    lengths = torch.as_tensor(list(lengths), dtype=torch.int64)
    bounds, owner = _segments(int(lengths.sum()), ring_size, seq_layout)
    return _work(lengths, bounds, owner, ring_size).tolist()


def _dealt(lengths: list[int], ring_size: int, capacity: int) -> list[int]:
    """Longest first, each to the ring rank with the least ``L^2`` so far among those with
    room (or the emptiest), ranks then laid out in order."""
    bins: list[list[int]] = [[] for _ in range(ring_size)]
    load, room = [0] * ring_size, [capacity] * ring_size
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [j for j in range(ring_size) if room[j] >= lengths[i]]
        j = min(fits, key=lambda j: load[j]) if fits else max(range(ring_size), key=lambda j: room[j])
        bins[j].append(i)
        load[j] += lengths[i] ** 2
        room[j] -= lengths[i]
    return [i for b in bins for i in b]


def balance_documents(lengths, ring_size: int, seq_layout: str = "contiguous", *, padded_to: int | None = None, rounds: int = 300,
                      tries: int = 8, seed: int = 0) -> list[int]:  # fmt: skip
    """An order of the documents (indices into ``lengths``) whose most loaded ring rank does
    as little attention work as the search finds, never more than the given order's.

    ``lengths``: the documents' token counts, in the order given. ``padded_to``: the length
    the packed sequence is padded to (``hf.shard_batch(pad=True)``, ``pad_documents``: the
    padding is one document at the end, which stays there); ``None``: ``sum(lengths)``, which
    must then split into the layout's equal segments.
    ``ring_size``, ``seq_layout``: the 2-D group's (``SPGroups.ring_size``, ``seq_layout``).
    ``rounds`` x ``tries``: swaps tried (each round keeps the best of ``tries``). The order
    depends only on the arguments (seeded), so ranks that call it alike agree."""
    lengths = [int(x) for x in lengths]
    if any(x < 1 for x in lengths):
        raise ValueError(f"balance_documents: lengths expected positive token counts, got {lengths}")
    n, total = len(lengths), sum(lengths)
    if padded_to is not None and padded_to < total:
        raise ValueError(f"balance_documents: padded_to ({padded_to}) is shorter than the documents ({total} tokens)")
    pad = 0 if padded_to is None else padded_to - total
    t = torch.tensor(lengths + [pad], dtype=torch.int64)  # the padding last (0 tokens: none)
    bounds, owner = _segments(total + pad, ring_size, seq_layout)
    tail = torch.tensor([n])

    def score(order: torch.Tensor) -> tuple[int, int]:
        work = _work(t[torch.cat([order, tail])], bounds, owner, ring_size)
        return int(work.max()), int((work * work).sum() // max(1, int(work.sum())))

    starts = [torch.arange(n)]
    if seq_layout == "contiguous":
        starts.append(torch.tensor(_dealt(lengths, ring_size, (total + pad) // ring_size)))
    best = min(starts, key=score)
    best_score = score(best)
    if n < 2 or ring_size < 2:
        return best.tolist()
    rng = random.Random(seed)
    segment = bounds[1] - bounds[0]
    for _ in range(rounds):
        ordered = t[torch.cat([best, tail])]
        work = _work(ordered, bounds, owner, ring_size)
        heavy, light = int(work.argmax()), int(work.argmin())
        # Documents with tokens in each ring rank's block: [docs, segments] overlap, by owner.
        ends = ordered.cumsum(0)
        first, last = (ends - ordered) // segment, (ends - 1) // segment
        span = torch.arange(len(bounds) - 1)
        touches = (span >= first.unsqueeze(1)) & (span <= last.unsqueeze(1))
        touches = touches[:n] & (ordered[:n] > 0).unsqueeze(1)  # documents only, not the padding
        a = torch.nonzero(touches[:, owner == heavy].any(1)).flatten().tolist()
        b = torch.nonzero(touches[:, owner == light].any(1)).flatten().tolist()
        if not a or not b:
            break
        round_best = None
        for _ in range(tries):
            x, y = rng.choice(a), rng.choice(b)
            if x == y:
                continue
            trial = best.clone()
            trial[x], trial[y] = best[y], best[x]
            s = score(trial)
            if round_best is None or s < round_best[0]:
                round_best = (s, trial)
        if round_best is not None and round_best[0] < best_score:
            best_score, best = round_best
    return best.tolist()
