"""The ground truth that tests, the self-test and the demo compare against.

* ``attention_reference``: single-process attention over the whole sequence (float64 by
  default), what ``ulysses_attention`` must equal;
* ``packed_attention_reference``: the same for a packed sequence, one document at a time
  (each document run on its own, as one process would without packing);
* ``contiguous_shard``: the rows of a global tensor that one rank holds under ``seq_lens``
  (contiguous shards; ``ulysses_kernels.shard_sequence`` shards for a 2-D group).

Built from the explicit softmax of ``ulysses_kernels.math_attention``.
"""

from __future__ import annotations

import torch

from ..math_attention import default_scale, math_attention

__all__ = ["attention_reference", "packed_attention_reference", "contiguous_shard"]


def attention_reference(q, k, v, causal=True, softmax_scale=None, dtype=torch.float64):
    """``[B, S, Hq, D]`` attention over the full sequence, computed in ``dtype``."""
    scale = default_scale(q.shape[3], softmax_scale)
    return math_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal, scale)


def packed_attention_reference(q, k, v, cu_seqlens, causal=True, softmax_scale=None, dtype=torch.float64):
    """``[1, S, Hq, D]`` attention of a packed sequence: ``attention_reference`` over each
    document ``[cu_seqlens[i], cu_seqlens[i + 1])`` on its own, joined along the sequence."""
    cu = [int(x) for x in cu_seqlens]
    parts = [attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal, softmax_scale, dtype) for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(parts, dim=1)


def contiguous_shard(x: torch.Tensor, seq_lens, rank: int) -> torch.Tensor:
    """Rows of ``x`` (``[B, S, ...]``) that rank ``rank`` holds under ``seq_lens``."""
    start = sum(seq_lens[:rank])
    return x[:, start : start + seq_lens[rank]]
