"""One packed-documents kernel call per ring step of a packed sequence.

Cut by documents (``seq_layout.document_pieces``), one ring step computes several rectangles:
on the diagonal step one causal square per document, elsewhere a rectangle or two. Where the
chooser (``backends.packed_kernel``, forward only: the ring's block backward is its own
explicit one) picks a packed kernel other than the per-document loop (flash-attn's varlen,
torch's ``varlen_attn``, FlexAttention on CUDA), all of a step's rectangles run in one call
of it with the log-sum-exp the ring merges with: the rectangles' query rows and key rows are
each packed end to end (a view when they are adjacent, as the documents of the diagonal step
are; else one copy) and their boundaries passed as the query and key documents (one call per
mask kind: causal squares, full rectangles). Where it picks the loop, the ring computes the
rectangles one by one with the backend's ``attend_lse`` (row-tiled explicit math), as before.
``ULYSSES_KERNELS_PACKED=loop`` (the same on every rank) keeps that path.
"""

from __future__ import annotations

import torch

from ..documents import Documents
from ..packed import DocMask

__all__ = ["step_kernel", "attend_lse_pieces"]


def step_kernel(inner, q: torch.Tensor):
    """The packed kernel the ring steps of a packed sequence run for ``q`` (forward with the
    log-sum-exp), or ``None``: rectangle by rectangle with ``inner.attend_lse`` (the loop was
    picked, or ``inner`` is not a built-in backend with a chooser)."""
    choose = getattr(inner, "packed_kernel", None)
    if choose is None:
        return None
    kern = choose(q, True, grad=False)
    return None if kern.name == "loop" else kern


def _packed(x: torch.Tensor, spans) -> torch.Tensor:
    """Rows ``spans`` of ``x`` (``[1, T, h, D]``) end to end, ``[1, n, h, D]``: a view when they are adjacent."""
    if all(a.stop == b.start for a, b in zip(spans[:-1], spans[1:])):
        return x[:, spans[0].start : spans[-1].stop]
    return torch.cat([x[:, s] for s in spans], dim=1)


def _documents(spans) -> Documents:
    cu, longest = [0], 0
    for s in spans:
        cu.append(cu[-1] + s.stop - s.start)
        longest = max(longest, s.stop - s.start)
    return Documents(tuple(cu), longest)


def attend_lse_pieces(q, k, v, pieces, scale: float, kernel):
    """The rectangles ``pieces`` (``(rows, cols, diag)``) of one ring step with ``kernel``
    (``packed.PackedKernel``), one call per mask kind. ``q`` ``[1, L, hq, D]``, ``k``/``v``
    ``[1, L, hkv, D]`` / ``Dv`` (uniform grouped heads). Returns ``[(rows, out [1, n, hq, Dv],
    lse [1, hq, n] float32)]`` per rectangle."""
    results = []
    for diag in (True, False):
        group = [p for p in pieces if p[2] == diag]
        if not group:
            continue
        rows, cols = [p[0] for p in group], [p[1] for p in group]
        out, lse = kernel.attend(
            _packed(q, rows), _packed(k, cols), _packed(v, cols), _documents(rows), _documents(cols), DocMask(diag), scale, lse=True,
        )  # fmt: skip
        start = 0
        for r in rows:
            n = r.stop - r.start
            results.append((r, out[:, start : start + n], lse[:, :, start : start + n]))
            start += n
    return results
