"""What one ring call computes and sends: ``RingSchedule``, the same value on every rank.

The ring level runs ``R`` steps; at step ``t`` ring rank ``j`` may hold the K/V block of ring
rank ``(j - t) % R`` (``ring.attention``). Which (query block, K/V block) pairs have any
visible (query, key) pair is a pure function of the call's values: the ring size, the
sequence layout, the block length, ``causal`` and, for a packed sequence, the global
``cu_seqlens``. Every rank computes the whole table from them, so no rank has to ask
another what it will send::

    pieces[j][i]  the rectangles (block rows of j, block rows of i, diagonal) that ring rank j
                  computes against block i (``seq_layout.block_pieces`` cut by
                  ``seq_layout.document_pieces``); empty: the pair shares no document, or
                  causality hides all of i from j: that step's compute is skipped
    reach[i]      how many hops block i travels along the ring (j = i+1, i+2, ...): the
                  farthest ring rank that needs it, at least 1 (below); the hops past it are
                  skipped, forward and backward (the K/V block, and in the backward its dK/dV
                  accumulator, which then goes home in one direct transfer)

What is skipped in practice (``describe`` prints it; ``bench.ring_balance`` tabulates it):

* contiguous shards, causal: block ``i`` is needed by ranks ``i .. i+T`` at most (the
  documents that start in block i reach no further), never by the ranks before it, so the
  hops around the end of the ring are skipped even without documents (``reach[i] =
  R-1-i``); with short documents most blocks travel one hop.
* zigzag, causal: every block has an early and a late segment, so block ``i`` is needed by
  ``i+1`` (its early segment) and by ``i-1`` (its late segment) whenever a document crosses
  the segment boundaries there; ``i-1`` is the last rank of the path, so the block travels the
  whole ring and only the compute of the pairs in between is skipped.
* not causal: a pair is computed when a document holds tokens of both blocks.

The first hop of every block always runs (``reach >= 1``): on NCCL, torch creates a group's
communicator at its first batched point-to-point call, which every rank of the group must
join (``torch.distributed.batch_isend_irecv``'s note), and a schedule that let some ranks sit
out the first step could hang there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .seq_layout import block_pieces, block_runs, block_segments, document_pieces, document_rows

__all__ = ["RingSchedule", "ring_schedule"]

Piece = tuple[slice, slice, bool]


@dataclass(frozen=True, eq=False)
class RingSchedule:
    """The rectangles and the transfers of one ring call (module docstring).

    ``pieces[j][i]``: ring rank ``j``'s rectangles against block ``i`` (block-local rows);
    ``reach[i]``: hops block ``i`` travels (``0`` only for a ring of one)."""

    ring_size: int
    block_len: int
    pieces: tuple[tuple[tuple[Piece, ...], ...], ...]
    reach: tuple[int, ...]

    def needs(self, j: int, i: int) -> bool:
        """Ring rank ``j`` computes something against block ``i``."""
        return bool(self.pieces[j][i])

    def holds(self, j: int, step: int) -> bool:
        """Ring rank ``j`` holds block ``(j - step) % R`` at ``step`` (it reached j)."""
        return step <= self.reach[(j - step) % self.ring_size]

    def sends(self, j: int, step: int) -> bool:
        """At ``step`` ring rank ``j`` passes the block it holds on to ``j + 1``."""
        return step < self.reach[(j - step) % self.ring_size]

    def receives(self, j: int, step: int) -> bool:
        """At ``step`` ring rank ``j`` receives, for the next step, the block ``j - 1`` holds."""
        return self.sends((j - 1) % self.ring_size, step)

    def pairs(self, j: int) -> int:
        """Visible (query, key) pairs ring rank ``j`` computes over all steps (the attention
        work of its block: a causal square of n rows counts ``n (n + 1) / 2``)."""
        total = 0
        for pieces in self.pieces[j]:
            for rows, cols, diag in pieces:
                n, m = rows.stop - rows.start, cols.stop - cols.start
                total += n * (n + 1) // 2 if diag else n * m
        return total

    def hops(self) -> int:
        """K/V block transfers per forward over the whole ring (``R (R - 1)`` without skips)."""
        return sum(self.reach)

    def computed_steps(self) -> int:
        """(ring rank, step) pairs with any compute, out of ``R * R``."""
        return sum(self.needs(j, i) for j in range(self.ring_size) for i in range(self.ring_size))


@functools.lru_cache(maxsize=64)
def ring_schedule(ring_size: int, seq_layout: str, block_len: int, causal: bool, cu_seqlens: tuple[int, ...] | None) -> RingSchedule:
    """The ``RingSchedule`` of a call: ``block_len`` rows per ring block (``ulysses_size x``
    the local shard), global document boundaries ``cu_seqlens`` (``None``: one sequence).

    A pure function of values, kept in a small cache keyed by them: every layer of a step that
    passes the same boundaries reuses one schedule (the document cut is a loop over the
    documents of each block)."""
    R = ring_size
    runs = [block_runs(j, R, seq_layout, block_len) for j in range(R)]
    docs = None if cu_seqlens is None else [document_rows(r, cu_seqlens) for r in runs]
    table = []
    for j in range(R):
        q_segments = block_segments(j, R, seq_layout)[0]
        row = []
        for i in range(R):
            pieces = block_pieces(q_segments, block_segments(i, R, seq_layout)[0], block_len, causal)
            if docs is not None:
                pieces = document_pieces(pieces, docs[j], docs[i])
            row.append(tuple(pieces))
        table.append(tuple(row))
    reach = []
    for i in range(R):
        far = max((j - i) % R for j in range(R) if table[j][i] or j == i)
        reach.append(max(far, 1) if R > 1 else 0)
    return RingSchedule(R, block_len, tuple(table), tuple(reach))
