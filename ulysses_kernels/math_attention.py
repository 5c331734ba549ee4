"""The explicit softmax attention: the ``"math"`` backend and the ring level's block kernel.

* ``math_attention``: explicit softmax over ``[B, S, H, D]`` (exact in float64), the
  ``"math"`` backend;
* ``math_attention_lse``/``math_attention_lse_backward``: one block of keys with its
  log-sum-exp, and its gradients against the final output (the ring level's default);
* ``default_scale``: the softmax scale when none is given.

The float64 ground truth built from it (what tests, the self-test and the demo compare
against) is ``ulysses_kernels.testing.reference``.
"""

from __future__ import annotations

import math

import torch

from .checks import softmax_scale_value

__all__ = ["math_attention", "math_attention_lse", "math_attention_lse_backward", "default_scale", "checked_scale"]


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    """``softmax_scale`` as a float (checked: ``checks.softmax_scale_value``), or ``1/sqrt(head_dim)``."""
    return checked_scale(head_dim, softmax_scale_value(softmax_scale))


def checked_scale(head_dim: int, scale: float | None) -> float:
    """A scale already checked (``checks.softmax_scale_value``'s float, as a ``CallKey`` holds
    it), or ``1/sqrt(head_dim)`` for ``None``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def math_attention(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """Explicit softmax attention over ``[B, S, H, D]``; the accumulation dtype is the
    input's for float32/float64 and float32 for half types."""
    acc = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    probs = torch.softmax(_math_scores(q, k, causal, scale, acc), dim=-1)
    v = v.to(acc).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bhst,bthd->bshd", probs, v).to(q.dtype)


def _math_scores(q, k, causal: bool, scale: float, acc: torch.dtype) -> torch.Tensor:
    """Scaled scores ``[B, H, S, T]`` (``-inf`` where masked) of grouped-head ``q``, ``k``."""
    k = k.to(acc).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q.to(acc), k) * scale
    if causal:
        s, t = scores.shape[-2:]
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).triu(t - s + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)``; a row with no key (``lse = -inf``) gets zeros, not NaN."""
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - lse.unsqueeze(-1))


def math_attention_lse(q, k, v, causal: bool, scale: float):
    """``math_attention`` that also returns the log-sum-exp of each row's scores.

    Returns ``(out, lse)``: ``out`` ``[B, S, H, D]`` and ``lse`` ``[B, H, S]`` in the
    accumulation dtype (``merge.acc_dtype``: float64 stays, else float32); a row with no
    visible key has ``out = 0`` and ``lse = -inf``."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = _math_scores(q, k, causal, scale, acc)
    lse = torch.logsumexp(scores, dim=-1)
    v = v.to(acc).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bhst,bthd->bshd", _probs(scores, lse), v), lse


def math_attention_lse_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of one block of keys recomputed against the *final* ``out`` and ``lse`` of
    the rows (over all blocks): ``p = exp(scores - lse)``, ``dv = p^T dout``,
    ``ds = p * (dout v^T - rowsum(dout * out))``, ``dq = ds k * scale``, ``dk = ds^T q * scale``.
    ``dk``, ``dv`` are summed over each KV head's query heads (``[B, T, hkv, D]``); all three
    in the accumulation dtype."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = q.shape[2] // k.shape[2]
    probs = _probs(_math_scores(q, k, causal, scale, acc), lse.to(acc))
    dout, q = dout.to(acc), q.to(acc)
    ke, ve = (x.to(acc).repeat_interleave(g, dim=2) for x in (k, v))
    dv = torch.einsum("bhst,bshd->bthd", probs, dout)
    rows = (dout * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, S]
    ds = probs * (torch.einsum("bshd,bthd->bhst", dout, ve) - rows.unsqueeze(-1))
    dq = torch.einsum("bhst,bthd->bshd", ds, ke) * scale
    dk = torch.einsum("bhst,bshd->bthd", ds, q) * scale
    if g > 1:
        b, t, _, d = dk.shape
        dk, dv = (x.view(b, t, k.shape[2], g, d).sum(3) for x in (dk, dv))
    return dq, dk, dv
