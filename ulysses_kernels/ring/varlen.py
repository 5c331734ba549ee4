"""One flash-attn varlen call per ring step of a packed sequence (CUDA; opt-in, never run).

Cut by documents (``seq_layout.document_pieces``), one ring step computes several rectangles:
on the diagonal step one causal square per document, elsewhere a rectangle or two. The
default path computes them one by one with the inner backend's ``attend_lse`` (flash-attn's
``flash_attn_func`` per rectangle on CUDA, explicit math elsewhere). This module computes
all of a step's rectangles in one ``flash_attn_varlen_func`` call: the rectangles' query
rows and key rows are each packed end to end (a view when they are adjacent, as the
documents of the diagonal step are; else one copy) and their boundaries passed as
``cu_seqlens_q``/``cu_seqlens_k`` (a step's rectangles all share one mask kind, causal
squares or full rectangles, so one ``causal`` flag serves the call).

NOTE: this has never run: the build machine has no GPU, and the GPU machine this project
borrows has no flash-attn (docs/gpu_validation.md). So it is off by default; set
``ULYSSES_KERNELS_RING_VARLEN=1`` (the same on every rank) to use it with
``attn_fn="flash"`` (or the default backend when flash-attn is picked). Its test,
``tests/test_packed_ring.py::test_gpu_flash_varlen_steps``, skips without a GPU and flash-attn.
The block backward stays the explicit one of ``RingBackend`` (flash-attn's backward against
a given log-sum-exp is not wired).
"""

from __future__ import annotations

import os

import torch

__all__ = ["varlen_enabled", "attend_lse_pieces"]


def varlen_enabled() -> bool:
    """``ULYSSES_KERNELS_RING_VARLEN=1``: one flash-attn varlen call per ring step."""
    return os.environ.get("ULYSSES_KERNELS_RING_VARLEN", "0") == "1"


def _packed(x: torch.Tensor, spans) -> torch.Tensor:
    """Rows ``spans`` of ``x[0]`` (``[T, h, D]``) end to end: a view when they are adjacent."""
    if all(a.stop == b.start for a, b in zip(spans[:-1], spans[1:])):
        return x[0, spans[0].start : spans[-1].stop]
    return torch.cat([x[0, s] for s in spans])


def _boundaries(spans, device) -> tuple[torch.Tensor, int]:
    cu, longest = [0], 0
    for s in spans:
        cu.append(cu[-1] + s.stop - s.start)
        longest = max(longest, s.stop - s.start)
    return torch.tensor(cu, dtype=torch.int32, device=device), longest


def attend_lse_pieces(q, k, v, pieces, scale: float):
    """All rectangles ``pieces`` (``(rows, cols, diag)``, one ``diag`` for all) of one ring
    step in one ``flash_attn_varlen_func`` call. ``q`` ``[1, L, hq, D]``, ``k``/``v``
    ``[1, L, hkv, D]`` (grouped heads, fp16/bf16 on CUDA). Returns ``[(rows, out [1, n, hq, D],
    lse [1, hq, n] float32)]`` per rectangle."""
    from flash_attn import flash_attn_varlen_func

    rows, cols, diag = [p[0] for p in pieces], [p[1] for p in pieces], pieces[0][2]
    cu_q, max_q = _boundaries(rows, q.device)
    cu_k, max_k = _boundaries(cols, q.device)
    out, lse, *_ = flash_attn_varlen_func(
        _packed(q, rows), _packed(k, cols), _packed(v, cols), cu_q, cu_k, max_q, max_k,
        softmax_scale=scale, causal=diag, return_attn_probs=True,
    )  # fmt: skip
    results, start = [], 0
    for i, r in enumerate(rows):
        n = r.stop - r.start
        if lse.dim() == 2:  # flash-attn >= 2.4: [hq, total_q], rows end to end
            part = lse[:, start : start + n]
        else:  # older: [batch, hq, max_seqlen_q], one padded row per sequence
            part = lse[i, :, :n]
        results.append((r, out[start : start + n].unsqueeze(0), part.unsqueeze(0)))
        start += n
    return results
