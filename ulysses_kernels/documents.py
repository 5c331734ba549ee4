"""Document boundaries of a packed sequence: many documents in one sharded sequence.

A packed batch is ``[1, S, H, D]``: documents laid end to end, the global sequence split
into contiguous shards as usual (rank r holds the r-th shard; a document may cross shard
boundaries). ``cu_seqlens`` are the *global* cumulative boundaries, flash-attn's
convention: ``(0, end_0, end_1, ..., S)``, document i is tokens ``[cu[i], cu[i+1])``.
Attention is block-diagonal over the documents (causal inside a document when causal).

A batch of packed rows (``[B, S, H, D]``, each row its own documents) is given as one list
of boundaries per row, each ``(0, ..., S)``; ``Documents`` holds them end to end over the
flattened ``[B * S]`` tokens (flash-attn's varlen convention over a batch: every row end is
a boundary, so no document crosses rows), with ``rows = B``. A backend attends the rows as
one packed row of ``B * S`` tokens (``backends.attend_rows``).

After the sequence-to-head exchange every rank holds the whole sequence in global order,
so the boundaries its attention needs are these same global ones: ``Documents`` is built
once per call from the arguments (no collective), and every layer of a step that passes
the same boundaries computes the same value. Padding is a trailing document of its own
(``pad_documents``): pad tokens attend only to padding.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tracing import in_trace

__all__ = [
    "Documents",
    "DocMask",
    "documents",
    "documents_of_positions",
    "pad_documents",
    "document_ids",
    "longest_document",
    "first_unordered",
    "boundaries_digest",
]


@dataclass(frozen=True)
class Documents:
    """The boundaries of one packed sequence, as plain ints (hashable, the same on every rank).

    ``cu_seqlens``: ``(0, ..., total)``, strictly increasing (checked in ``checks``).
    ``max_seqlen``: the longest document (given, or derived from ``cu_seqlens``).
    ``rows``: the batch rows the boundaries span end to end (``total = rows * S``; 1: one
    packed row). ``bad_row``: 1 + the first row given per row whose boundaries do not run
    from 0 to the first row's length (0: none); ``checks`` reports it on every rank.
    """

    cu_seqlens: tuple[int, ...]
    max_seqlen: int
    rows: int = 1
    bad_row: int = 0

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def count(self) -> int:
        return len(self.cu_seqlens) - 1

    def spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each document."""
        return list(zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))

    def on(self, device: torch.device) -> torch.Tensor:
        """``cu_seqlens`` as an int32 tensor on ``device`` (flash-attn's varlen argument).

        Kept per ``(boundaries, device)`` in a small bounded cache keyed by values: every layer
        and every call of a step reuses one copy (no per-call host-to-device copy, no host work
        beyond hashing the boundaries). Callers read it, never write it."""
        if in_trace():
            return torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device)
        return _device_cu_seqlens(self.cu_seqlens, torch.device(device))


@functools.lru_cache(maxsize=64)
def _device_cu_seqlens(cu_seqlens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(cu_seqlens, dtype=torch.int32, device=device)


def documents(cu_seqlens, max_seqlen: int | None = None) -> Documents | None:
    """``cu_seqlens`` as ``Documents``; ``None`` when ``cu_seqlens`` is None. One packed row:
    a sequence of ints, or a 1-D integer tensor (a CUDA tensor costs one host sync). A batch
    of packed rows: a list with one such sequence per row, each ``(0, ..., S)``, joined end
    to end (module docstring). Only the types are checked here; the values are checked by
    ``checks`` (the same error on every rank). ``Documents`` (what the module and the
    integrations hold) are taken as they are, with ``max_seqlen`` None."""
    if isinstance(cu_seqlens, Documents) and max_seqlen is None:
        return cu_seqlens
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError("ulysses_attention: max_seqlen was given without cu_seqlens")
        return None
    if isinstance(cu_seqlens, Sequence) and cu_seqlens and all(_is_row(x) for x in cu_seqlens):
        rows = [_boundaries(x) for x in cu_seqlens]
        cu, bad_row = _join_rows(rows)
        return Documents(cu, longest_document(cu) if max_seqlen is None else int(max_seqlen), len(rows), bad_row)
    cu = _boundaries(cu_seqlens)
    return Documents(cu, longest_document(cu) if max_seqlen is None else int(max_seqlen))


def documents_of_positions(positions: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """The documents of ``[rows, seq]`` position ids, one boundary tuple ``(0, ..., seq)`` per
    row: a document starts at token 0 and wherever the position is 0 (transformers' rule before
    flash-attn's varlen kernel, so every path sees the same boundaries). The one finder of the
    integrations: ``hf.shard_batch`` (and the ALST entry point through it) after checking that
    positions count 0, 1, ... in each document, verl's switch on its packed positions as they
    are. One host sync per call."""
    seq = positions.shape[1]
    starts = positions == 0
    starts[:, 0] = True
    found = torch.nonzero(starts).tolist()  # [row, index] pairs, in row order
    rows = [[] for _ in range(positions.shape[0])]
    for row, index in found:
        rows[row].append(index)
    return tuple(tuple(r) + (seq,) for r in rows)


def _is_row(x) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, Sequence) and not isinstance(x, str))


def _boundaries(cu_seqlens) -> tuple[int, ...]:
    """One row's boundaries as a tuple of ints (types checked, values not)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if in_trace():
            # A tensor's values are unknown while tracing; the boundaries shape the graph.
            raise TypeError("ulysses_attention: inside torch.compile pass cu_seqlens as a list of ints, not a tensor")
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise TypeError(
                f"ulysses_attention: cu_seqlens expected a 1-D integer tensor or a list of ints, "
                f"got a tensor of shape {list(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
            )
        return tuple(int(x) for x in cu_seqlens.tolist())
    if isinstance(cu_seqlens, Sequence) and all(isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
        return tuple(int(x) for x in cu_seqlens)
    raise TypeError(f"ulysses_attention: cu_seqlens expected a list of ints, a 1-D integer tensor, or one of those per batch row, got {cu_seqlens!r}")


def _join_rows(rows: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], int]:
    """Per-row boundaries ``(0, ..., S)`` end to end over ``[B * S]``, and 1 + the first row
    that does not run from 0 to row 0's length (0: none). A bad row is joined as given (its
    entries offset), so the value checks see the joined boundaries as they are."""
    length = rows[0][-1] if rows[0] else 0
    cu, offset, bad_row = [0], 0, 0
    for i, row in enumerate(rows):
        if not bad_row and (len(row) < 2 or row[0] != 0 or row[-1] != length):
            bad_row = i + 1
        cu += [offset + x for x in row[1:]]
        offset += length
    return tuple(cu), bad_row


def longest_document(cu: Sequence[int]) -> int:
    """The longest document of boundaries ``cu`` (0 for fewer than two). A list, not a
    generator with ``default=``: torch.compile before torch 2.14 cannot trace ``max()`` over
    a generator (torch 2.11, ``fullgraph=True``: measured), and this runs inside its trace."""
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    return max(lengths) if lengths else 0


def first_unordered(cu: Sequence[int]) -> int:
    """The first index ``i`` with ``cu[i] <= cu[i - 1]`` (-1: strictly increasing). A loop,
    not ``next(genexpr)``: torch 2.8's dynamo cannot trace that, and this runs in its trace."""
    for i in range(1, len(cu)):
        if cu[i] <= cu[i - 1]:
            return i
    return -1


_DIGEST_MOD = (1 << 61) - 1


def boundaries_digest(cu: Sequence[int]) -> int:
    """A polynomial digest of the boundaries in plain ints (it runs inside torch.compile's
    trace too), below 2**61: ranks compare it to find boundaries that differ."""
    digest = 0
    for x in cu:
        digest = (digest * 1_000_003 + x + 1) % _DIGEST_MOD
    return digest


def pad_documents(cu_seqlens: Sequence[int], total: int) -> tuple[int, ...]:
    """``cu_seqlens`` of a sequence padded to ``total`` tokens: the padding is one trailing
    document (pad tokens attend only to padding, so real tokens never see them)."""
    cu = tuple(int(x) for x in cu_seqlens)
    return cu if cu[-1] == total else cu + (int(total),)


def document_ids(cu_seqlens: Sequence[int], device=None) -> torch.Tensor:
    """``[S]`` int64: the document index of each token."""
    cu = torch.tensor(list(cu_seqlens), dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), cu.diff())


@dataclass(frozen=True)
class DocMask:
    """What attention inside a document hides: ``causal``, a sliding ``window`` (tokens, causal
    only), a ``softcap`` on the scaled scores. Checked on construction."""

    causal: bool
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self):
        if self.window is not None and (not self.causal or int(self.window) < 1):
            raise ValueError(
                f"packed documents: window={self.window!r} with causal={self.causal}; a sliding window is supported on "
                "causal attention only, as a positive token count"
            )
        if self.softcap is not None and not float(self.softcap) > 0:
            raise ValueError(f"packed documents: softcap={self.softcap!r}; expected a positive float or None")

    def describe(self) -> str:
        parts = ["causal" if self.causal else "bidirectional"]
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        return ", ".join(parts)
