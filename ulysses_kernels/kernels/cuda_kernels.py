"""The ``"cuda"`` kernel set: the fused pack/unpack ops of the C++/CUDA extension.

Each method is the op's typed face: it takes what every kernel set takes (a ``Layout``,
the tensors, the roles) and calls the ``torch.ops.ulysses_kernels`` op (schemas in
``csrc/ops.cpp``) with the layout's head ranges (``Layout.head_ranges``) and offsets: one
hop from the exchange to the C++ host layer. The loading of ``_C`` (done when the set is
made), the fake kernels and the limits live in ``ulysses_kernels.ops``. CUDA
tensors run the CUDA kernels; CPU tensors run their CPU twin (the same index math,
``csrc/kernels/layout_math.h``). The autograd functions of ``ulysses_kernels.attention``
call these inside their forward/backward, so the ops need no autograd of their own.
"""

from __future__ import annotations

import torch

from .. import ops
from ..layout import Layout

__all__ = ["CudaKernels"]


class CudaKernels:
    """Kernel set backed by ``torch.ops.ulysses_kernels`` (see ``ulysses_kernels.kernels``)."""

    name = "cuda"

    def __init__(self):
        ops.load()  # the ops below exist once _C is loaded (ImportError saying why otherwise)

    @staticmethod
    def available() -> bool:
        return ops.available()

    @staticmethod
    def unavailable_reason() -> str:
        """Why ``available()`` is False: the extension's import error (not built, or built
        against another NCCL than torch's)."""
        try:
            ops.load()
        except ImportError as e:
            return str(e)
        return ""

    @staticmethod
    def supports(layout: Layout) -> bool:
        """At most ``ops.limits()["max_peers"]`` ranks (the kernels' parameter structs hold every peer)."""
        return layout.world_size <= ops.limits()["max_peers"]

    @staticmethod
    def pack_s2h(layout: Layout, tensors, roles, send, recv=None) -> None:
        torch.ops.ulysses_kernels.pack_s2h(list(tensors), layout.head_ranges(roles), send, recv, layout.rank, layout.seq_offset(layout.rank))

    @staticmethod
    def pack_h2s(layout: Layout, local, send) -> None:
        expected = layout.seq_total * layout.batch * local.shape[2] * layout.head_dim
        if local.dim() != 4 or tuple(local.shape) != (layout.batch, layout.seq_total, local.shape[2], layout.head_dim) or send.numel() != expected:
            raise ValueError(
                f"CudaKernels.pack_h2s: local.shape expected [{layout.batch}, {layout.seq_total}, h, {layout.head_dim}] "
                f"and send.numel() {expected}, got {list(local.shape)} and {send.numel()}"
            )
        torch.ops.ulysses_kernels.pack_h2s(local, send)

    @staticmethod
    def unpack_h2s(layout: Layout, blocks, roles, outs) -> None:
        flat = [b for per_source in blocks for b in per_source]
        torch.ops.ulysses_kernels.unpack_h2s(flat, layout.head_ranges(roles), list(outs))
