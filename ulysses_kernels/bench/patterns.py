"""Deterministic data with a known answer: the benchmarks check data movement bit for bit.

``pattern`` gives every element of a global tensor a value from its global index, so a rank
can fill its shard (``fill_pattern_4d``) and count what arrived in the wrong place
(``count_wrong_4d``) without the global tensor; ``count_unequal_bits`` compares outputs with
expected tensors bit for bit (NaN payloads and the sign of zero included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["pattern", "fill_pattern_4d", "count_wrong_4d", "count_unequal_bits"]


def pattern(index: torch.Tensor, salt: int) -> torch.Tensor:
    """Small pseudo-random integers in [-125, 125] from int64 global element indices.

    Exactly representable in every float dtype (bf16 holds integers up to 256), and not
    periodic at block scale, so a block delivered to the wrong place or from the wrong
    peer does not match by accident. ``salt`` tells tensors apart (q, k, v, out, ...).
    """
    x = index * 1103515245 + (12345 + salt * 2654435761)
    return ((x >> 16) % 251 - 125).to(torch.int64)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` as same-width integers: NaN payloads and the sign of zero compare too."""
    return x.view(_INT_OF_SIZE[x.element_size()]) if x.is_floating_point() else x


def count_unequal_bits(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> int:
    """Elements of ``actual`` whose bits differ from ``expected`` (pairwise): the rule for
    data movement. A tensor of the wrong shape or dtype counts all of its expected
    elements, a missing one likewise."""
    wrong = sum(e.numel() for e in expected[len(actual) :])
    for a, e in zip(actual, expected):
        if a.shape != e.shape or a.dtype != e.dtype:
            wrong += e.numel()
        else:
            wrong += int((_bits(a) != _bits(e)).sum().item())
    return wrong


def fill_pattern_4d(out: torch.Tensor, salt: int, seq_total: int, heads_total: int, t0: int, heads, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """Fill ``out`` ``[B, s, h, D]`` with the pattern of the global tensor ``[B, seq_total,
    heads_total, D]`` at rows ``t0 .. t0+s`` and heads ``heads`` (a list of global head
    indices, one per local head; repeats allowed). Works in chunks of rows."""
    for part, ref in _pattern_chunks(out, salt, seq_total, heads_total, t0, heads, chunk_elems):
        part.copy_(ref)
    return out


def count_wrong_4d(actual: torch.Tensor, salt: int, seq_total: int, heads_total: int, t0: int, heads, chunk_elems: int = 1 << 24) -> int:
    """Elements of ``actual`` ``[B, s, h, D]`` that differ from the pattern (see ``fill_pattern_4d``)."""
    wrong = 0
    for part, ref in _pattern_chunks(actual, salt, seq_total, heads_total, t0, heads, chunk_elems):
        wrong += int((part != ref.to(part.dtype)).sum().item())
    return wrong


def _pattern_chunks(x, salt, seq_total, heads_total, t0, heads, chunk_elems):
    """``(rows of x, their pattern)`` in pieces of about ``chunk_elems`` elements."""
    b, s, h, d = x.shape
    dev = x.device
    head_idx = torch.as_tensor(list(heads), dtype=torch.int64, device=dev).view(1, 1, h, 1)
    dd = torch.arange(d, dtype=torch.int64, device=dev).view(1, 1, 1, d)
    bb = torch.arange(b, dtype=torch.int64, device=dev).view(b, 1, 1, 1)
    rows = max(1, chunk_elems // max(1, b * h * d))
    for start in range(0, s, rows):
        stop = min(s, start + rows)
        tt = torch.arange(t0 + start, t0 + stop, dtype=torch.int64, device=dev).view(1, -1, 1, 1)
        index = ((bb * seq_total + tt) * heads_total + head_idx) * d + dd
        yield x[:, start:stop], pattern(index, salt).to(x.dtype)
