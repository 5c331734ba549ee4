"""Merging partial attention results by their log-sum-exp.

Attention of a query row over a set of keys is ``out = sum_t p_t v_t`` with
``p_t = exp(x_t - lse)``, ``lse = log sum_t exp(x_t)`` (``x`` the scaled scores). Over two
disjoint key sets with results ``(o1, l1)`` and ``(o2, l2)`` the result over their union is::

    l = m + log(exp(l1 - m) + exp(l2 - m)),   m = max(l1, l2)
    o = (exp(l1 - m) * o1 + exp(l2 - m) * o2) / (exp(l1 - m) + exp(l2 - m))

Subtracting the larger ``m`` keeps every ``exp`` in ``(0, 1]``: nothing overflows, however
large the scores (the form without ``m`` overflows float32 at scores near 88). A row that
saw no key at all (every key masked) has ``lse = -inf`` and ``out = 0``: ``m`` is then taken
as 0 so that ``-inf - m`` stays ``-inf`` (``-inf - -inf`` would be NaN), its weight is 0, and
a row whose two weights are both 0 keeps ``out = 0``, ``lse = -inf``.

The sums run in float32 for half types and in the inputs' dtype for float32/float64 (the
ring tests compare float64 to 1e-10).
"""

from __future__ import annotations

import torch

__all__ = ["acc_dtype", "merge_lse", "PartialAttention"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged in: float64 stays, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_lse(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor):
    """The result over the union of two disjoint key sets (module docstring).

    ``o1``, ``o2``: ``[B, S, H, D]``; ``l1``, ``l2``: ``[B, H, S]`` (``-inf``: no key seen).
    Returns ``(o, l)`` in ``acc_dtype`` of the inputs."""
    dt = acc_dtype(o1.dtype)
    l1, l2 = l1.to(dt), l2.to(dt)
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    total = w1 + w2
    lse = m + torch.log(total)  # log(0) = -inf: a row with no key stays -inf
    safe = torch.where(total > 0, total, torch.ones_like(total))
    # [B, H, S] weights -> [B, S, H, 1] to scale the rows of o.
    a, b = ((w / safe).transpose(1, 2).unsqueeze(-1) for w in (w1, w2))
    return a * o1.to(dt) + b * o2.to(dt), lse


class PartialAttention:
    """The running result of one query block over the key blocks seen so far.

    ``add(rows, out, lse)`` merges the result of query rows ``rows`` (a slice of the block)
    over one more disjoint set of keys. ``out``: ``[B, S, H, Dv]`` in ``acc_dtype``, zeros
    (``Dv``: ``v_head_dim``, default q's head dim; MLA's v is narrower or wider);
    ``lse``: ``[B, H, S]``, ``-inf`` (no key seen yet)."""

    def __init__(self, q: torch.Tensor, v_head_dim: int | None = None):
        dt = acc_dtype(q.dtype)
        shape = q.shape if v_head_dim is None else (*q.shape[:3], v_head_dim)
        self.out = torch.zeros(shape, dtype=dt, device=q.device)
        self.lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=dt, device=q.device)

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        merged, merged_lse = merge_lse(self.out[:, rows], self.lse[:, :, rows], out, lse)
        self.out[:, rows] = merged
        self.lse[:, :, rows] = merged_lse
