"""Where the sequence lives in a 2-D (Ulysses x ring) group, in one place.

Notation: ``U`` ranks per Ulysses group, ``R`` ring steps, ``P = U * R`` ranks in all, global
sequence ``S`` tokens, ``s = S / P`` per rank. Rank ``r`` of the whole group is Ulysses rank
``u = r % U`` of ring rank ``j = r // U`` (``groups.SPGroups``: Ulysses groups on contiguous
ranks). After the Ulysses exchange the ``U`` ranks of ring rank ``j`` hold, for their heads,
the *block* of ring rank ``j``: ``L = U * s`` tokens made of equal *chunks* of the sequence.

``"contiguous"`` (the default; rank r holds the r-th contiguous shard)::

    sequence  | block 0 | block 1 | ... | block R-1 |      R chunks of L tokens
    block j = chunk j; rank (j, u) holds rows [u*s, (u+1)*s) of it

``"zigzag"`` (the causal load balance: every ring rank gets one early and one late chunk)::

    sequence  | c0 | c1 | ... | c(2R-1) |                2R chunks of L/2 tokens
    block j = c(j) ++ c(2R-1-j); rank (j, u) holds rows [u*s, (u+1)*s) of it

Causal attention of a query chunk against a key chunk (chunks are equal and aligned): a key
chunk before the query chunk is attended in full, the same chunk causally (the diagonal), a
later one not at all. ``block_pieces`` turns that rule into the few rectangles one ring step
computes.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SEQ_LAYOUTS", "check_seq_layout", "block_chunks", "shard_rows", "block_pieces", "tile_rows"]

SEQ_LAYOUTS = ("contiguous", "zigzag")


def check_seq_layout(seq_layout: str, who: str) -> str:
    """``seq_layout`` itself, or ``ValueError`` naming ``who``'s argument."""
    if seq_layout not in SEQ_LAYOUTS:
        raise ValueError(f"{who}: seq_layout expected one of {list(SEQ_LAYOUTS)}, got {seq_layout!r}")
    return seq_layout


def block_chunks(ring_rank: int, ring_size: int, seq_layout: str) -> tuple[tuple[int, ...], int]:
    """``(chunks, n_chunks)``: the chunk indices (in order) of ring rank ``ring_rank``'s block,
    out of ``n_chunks`` equal chunks of the sequence."""
    if seq_layout == "zigzag":
        return (ring_rank, 2 * ring_size - 1 - ring_rank), 2 * ring_size
    return (ring_rank,), ring_size


def shard_rows(seq_len: int, ulysses_size: int, ring_size: int, rank: int, seq_layout: str) -> torch.Tensor:
    """The global positions (int64, ascending within each chunk) that rank ``rank`` of the
    whole group holds. ``ValueError`` when ``seq_len`` does not split evenly."""
    chunks, n = block_chunks(rank // ulysses_size, ring_size, seq_layout)
    world = ulysses_size * ring_size
    if seq_len % n or (seq_len // n * len(chunks)) % ulysses_size:
        raise ValueError(
            f"shard_sequence: seq_len ({seq_len}) must split into {n} equal chunks whose blocks of "
            f"{len(chunks)} chunk(s) split over {ulysses_size} Ulysses ranks (a multiple of "
            f"{math.lcm(n, world)} always does) for seq_layout={seq_layout!r}"
        )
    c = seq_len // n
    block = torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks])
    s = block.numel() // ulysses_size
    u = rank % ulysses_size
    return block[u * s : (u + 1) * s]


def block_pieces(q_chunks, kv_chunks, block_len: int, causal: bool) -> list[tuple[slice, slice, bool]]:
    """The rectangles one ring step computes: ``(q rows, kv rows, causal)`` in block-local rows,
    for a query block made of chunks ``q_chunks`` and a KV block made of ``kv_chunks`` (chunk
    indices, equal chunks of ``block_len / len(chunks)`` tokens). Adjacent full rectangles are
    merged, so a zigzag step is one call, and a block against itself is one causal call (its
    chunks ascend, so the block's own causal mask is the global one)."""
    whole = slice(0, block_len)
    if not causal:
        return [(whole, whole, False)]
    if tuple(q_chunks) == tuple(kv_chunks):
        return [(whole, whole, True)]
    c = block_len // len(q_chunks)
    rows = []  # per query chunk: the kv row range it sees in full
    for qc in q_chunks:
        seen = [i for i, kc in enumerate(kv_chunks) if kc < qc]
        if any(kc == qc for kc in kv_chunks):
            raise ValueError("block_pieces: a diagonal chunk in a block that is not the query block")
        # Chunks before the query chunk; contiguous in the block for both layouts.
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
