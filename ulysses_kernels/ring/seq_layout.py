"""Where the sequence lives in a 2-D (Ulysses x ring) group, in one place.

Notation: ``U`` ranks per Ulysses group, ``R`` ring steps, ``P = U * R`` ranks in all, global
sequence ``S`` tokens, ``s = S / P`` per rank. Rank ``r`` of the whole group is Ulysses rank
``u = r % U`` of ring rank ``j = r // U`` (``groups.SPGroups``: Ulysses groups on contiguous
ranks). After the Ulysses exchange the ``U`` ranks of ring rank ``j`` hold, for their heads,
the *block* of ring rank ``j``: ``L = U * s`` tokens made of equal *segments* of the sequence
(a block is what the ring passes on; a *chunk* is a head chunk of the overlap, never a
segment).

``"contiguous"`` (the default; rank r holds the r-th contiguous shard)::

    sequence  | block 0 | block 1 | ... | block R-1 |      R segments of L tokens
    block j = segment j; rank (j, u) holds rows [u*s, (u+1)*s) of it

``"zigzag"`` (the causal load balance: every ring rank gets one early and one late segment)::

    sequence  | s0 | s1 | ... | s(2R-1) |                2R segments of L/2 tokens
    block j = s(j) ++ s(2R-1-j); rank (j, u) holds rows [u*s, (u+1)*s) of it

Causal attention of a query segment against a key segment (segments are equal and aligned):
a key segment before the query segment is attended in full, the same segment causally (the
diagonal), a later one not at all. ``block_pieces`` turns that rule into the few rectangles one ring step
computes.

Packed documents (global ``cu_seqlens``): a block's global positions ascend (both layouts),
so each document's tokens in a block are one run of block rows (``document_rows``: a
document that crosses the zigzag fold, from segment ``j`` into segment ``2R-1-j``, too).
``document_pieces`` cuts a step's rectangles by document: the part of a full rectangle
inside one document is full, the part of the diagonal inside one document is that
document's own causal square (its rows ascend), and everything across two documents is
dropped. Of two different (disjoint) segments, at most one document holds tokens of both,
so an off-diagonal step keeps at most a rectangle or two however many documents there
are; only the diagonal step (a block against itself) keeps one square per document.
"""

from __future__ import annotations

import bisect
import math

import torch

__all__ = [
    "SEQ_LAYOUTS", "check_seq_layout", "block_segments", "block_runs", "shard_rows", "block_pieces", "document_rows",
    "document_pieces", "tile_rows",
]  # fmt: skip

SEQ_LAYOUTS = ("contiguous", "zigzag")


def check_seq_layout(seq_layout: str, who: str) -> str:
    """``seq_layout`` itself, or ``ValueError`` naming ``who``'s argument."""
    if seq_layout not in SEQ_LAYOUTS:
        raise ValueError(f"{who}: seq_layout expected one of {list(SEQ_LAYOUTS)}, got {seq_layout!r}")
    return seq_layout


def block_segments(ring_rank: int, ring_size: int, seq_layout: str) -> tuple[tuple[int, ...], int]:
    """``(segments, n_segments)``: the segment indices (in order) of ring rank ``ring_rank``'s
    block, out of ``n_segments`` equal segments of the sequence."""
    if seq_layout == "zigzag":
        return (ring_rank, 2 * ring_size - 1 - ring_rank), 2 * ring_size
    return (ring_rank,), ring_size


def block_runs(ring_rank: int, ring_size: int, seq_layout: str, block_len: int) -> tuple[tuple[int, int], ...]:
    """The global ``[start, end)`` of each segment of ring rank ``ring_rank``'s block of
    ``block_len`` rows, in block-row order (ascending: the block's positions ascend)."""
    segments, _ = block_segments(ring_rank, ring_size, seq_layout)
    c = block_len // len(segments)
    return tuple((i * c, (i + 1) * c) for i in segments)


def shard_rows(seq_len: int, ulysses_size: int, ring_size: int, rank: int, seq_layout: str) -> torch.Tensor:
    """The global positions (int64, ascending within each segment) that rank ``rank`` of the
    whole group holds. ``ValueError`` when ``seq_len`` does not split evenly."""
    segments, n = block_segments(rank // ulysses_size, ring_size, seq_layout)
    world = ulysses_size * ring_size
    if seq_len % n or (seq_len // n * len(segments)) % ulysses_size:
        raise ValueError(
            f"shard_sequence: seq_len ({seq_len}) must split into {n} equal segments whose blocks of "
            f"{len(segments)} segment(s) split over {ulysses_size} Ulysses ranks (a multiple of "
            f"{math.lcm(n, world)} always does) for seq_layout={seq_layout!r}"
        )
    c = seq_len // n
    block = torch.cat([torch.arange(i * c, (i + 1) * c) for i in segments])
    s = block.numel() // ulysses_size
    u = rank % ulysses_size
    return block[u * s : (u + 1) * s]


def block_pieces(q_segments, kv_segments, block_len: int, causal: bool) -> list[tuple[slice, slice, bool]]:
    """The rectangles one ring step computes: ``(q rows, kv rows, causal)`` in block-local rows,
    for a query block made of segments ``q_segments`` and a KV block made of ``kv_segments``
    (segment indices, equal segments of ``block_len / len(segments)`` tokens). Adjacent full
    rectangles are merged, so a zigzag step is one call, and a block against itself is one
    causal call (its segments ascend, so the block's own causal mask is the global one)."""
    whole = slice(0, block_len)
    if not causal:
        return [(whole, whole, False)]
    if tuple(q_segments) == tuple(kv_segments):
        return [(whole, whole, True)]
    c = block_len // len(q_segments)
    rows = []  # per query segment: the kv row range it sees in full
    for qc in q_segments:
        seen = [i for i, kc in enumerate(kv_segments) if kc < qc]
        if any(kc == qc for kc in kv_segments):
            raise ValueError("block_pieces: a diagonal segment in a block that is not the query block")
        # Segments before the query segment; contiguous in the block for both layouts.
        rows.append((seen[0] * c, (seen[-1] + 1) * c) if seen else None)
    pieces: list[tuple[slice, slice, bool]] = []
    for i, kv in enumerate(rows):
        if kv is None:
            continue
        q_rows = slice(i * c, (i + 1) * c)
        last = pieces[-1] if pieces else None
        if last is not None and last[1] == slice(*kv) and last[0].stop == q_rows.start:
            pieces[-1] = (slice(last[0].start, q_rows.stop), last[1], False)
        else:
            pieces.append((q_rows, slice(*kv), False))
    return pieces


def document_rows(runs, cu_seqlens) -> dict[int, tuple[int, int]]:
    """``{document: (first row, end row)}``: the block rows of each document with tokens in
    a block whose segments are ``runs`` (``block_runs``), for global boundaries ``cu_seqlens``.
    A block row counts the block's positions below a global position, so a document's rows
    are one run even when it covers the end of one segment and the start of the next."""

    def row(x: int) -> int:  # block rows whose global position is below x
        return sum(min(max(x - a, 0), b - a) for a, b in runs)

    out = {}
    for a, b in runs:
        # Documents that overlap [a, b): from the one holding a to the one holding b - 1.
        for d in range(bisect.bisect_right(cu_seqlens, a) - 1, bisect.bisect_left(cu_seqlens, b)):
            if d not in out:
                out[d] = (row(cu_seqlens[d]), row(cu_seqlens[d + 1]))
    return out


def document_pieces(pieces, q_docs: dict, kv_docs: dict) -> list[tuple[slice, slice, bool]]:
    """``pieces`` (``block_pieces`` of one step) cut by document: per piece and per document
    with rows in both blocks (``document_rows`` of the query block and of the KV block), the
    piece's rows and columns inside that document, in document order. A full piece stays
    full inside a document; the diagonal piece (query block = KV block) becomes each
    document's causal square (same rows and columns, ascending positions)."""
    out = []
    for rows, cols, diag in pieces:
        for d in sorted(q_docs.keys() & kv_docs.keys()):
            (qa, qb), (ka, kb) = q_docs[d], kv_docs[d]
            r = slice(max(rows.start, qa), min(rows.stop, qb))
            c = slice(max(cols.start, ka), min(cols.stop, kb))
            if r.start < r.stop and c.start < c.stop:
                out.append((r, c, diag))
    return out


def tile_rows(pieces, max_rows: int) -> list[tuple[slice, slice, bool]]:
    """``pieces`` with no more than ``max_rows`` query rows each (bounds the ``[rows, keys]``
    scores an explicit attention holds). A causal (diagonal) piece's row tile ``[a+r0, a+r1)``
    keeps keys ``[a, a+r1)``: with the mask aligned to the bottom right, row ``a+r0+i`` sees
    keys up to itself, as in the whole piece."""
    out = []
    for rows, cols, diag in pieces:
        for r0 in range(rows.start, rows.stop, max_rows):
            r1 = min(r0 + max_rows, rows.stop)
            out.append((slice(r0, r1), slice(cols.start, cols.start + r1 - rows.start) if diag else cols, diag))
    return out
