"""The ``"cuda"`` kernel set: the fused pack/unpack ops of the C++/CUDA extension.

Each method is the op's typed face: it takes what every kernel set takes (a ``Layout``,
the tensors, the roles) and calls the ``torch.ops.ulysses_kernels`` op (schemas in
``csrc/extension.cpp``) with the layout's head ranges (``Layout.head_ranges``) and offsets: one
hop from the exchange to the C++ host layer. The loading of ``_C`` (done when the set is
made), the fake kernels and the limits live in ``ulysses_kernels.extension``. CUDA
tensors run the CUDA kernels; CPU tensors run their CPU twin (the same index math,
``csrc/kernels/layout_math.h``). The autograd functions of ``ulysses_kernels.attention``
call these inside their forward/backward, so the ops need no autograd of their own.
"""

from __future__ import annotations

import torch

from .. import extension
from ..layout import Layout
from ..wire import wire_layout
from .torch_kernels import pack_s2h as pack_s2h_torch
from .torch_kernels import quant_pack_s2h as quant_pack_s2h_torch

_FMT = {"e4m3": 0, "e5m2": 1}  # the ops' fmt argument (csrc/kernels/fp8_math.h fp8_format)

__all__ = ["CudaKernels"]


def _rows_of(x: torch.Tensor, g: int) -> torch.Tensor | None:
    """``x`` ``[B, s, H, D]`` as ``[B, s, H * D / g, g]`` (the same storage: each head as
    ``D / g`` heads of ``g`` elements), or None when its heads are not ``D`` elements apart."""
    B, s, H, D = x.shape
    sb, ss, sh, sd = x.stride()
    if g == D:
        return x
    if H > 1 and sh != D * sd:
        return None
    return x.view(B, s, H * (D // g), g)  # a view (traceable), never a copy: strides checked above


class CudaKernels:
    """Kernel set backed by ``torch.ops.ulysses_kernels`` (see ``ulysses_kernels.kernels``)."""

    name = "cuda"
    # unpack_h2s takes a block as the 1-D contiguous piece of B * s_r * h * D elements it is in
    # wire format, as well as a [B, s_r, h, D] view: the exchange then makes no view per block
    # (one dispatched op each, host time that was most of a layer's fixed cost; issue #36).
    flat_blocks = True

    def __init__(self):
        extension.load()  # the ops below exist once _C is loaded (ImportError saying why otherwise)

    @staticmethod
    def available() -> bool:
        return extension.available()

    @staticmethod
    def unavailable_reason() -> str:
        """Why ``available()`` is False: the extension's import error (not built, or built
        against another NCCL than torch's)."""
        try:
            extension.load()
        except ImportError as e:
            return str(e)
        return ""

    @staticmethod
    def supports(layout: Layout) -> bool:
        """At most ``extension.limits()["max_peers"]`` ranks (the kernels' parameter structs hold every peer)."""
        return layout.world_size <= extension.limits()["max_peers"]

    @staticmethod
    def pack_s2h(layout: Layout, tensors, roles, send, recv=None) -> None:
        dims = [layout.dim(s) for s in roles]
        if len(set(dims)) > 1:
            # MLA: v (Dv) beside q and k (D). The op moves rows of one length, so every head
            # goes as d / g rows of g = gcd(D, Dv) elements: the same bytes in the same
            # places (a token's block is h_q * D + h_k * D + h_v * Dv elements either way).
            g = layout.row_dim(roles)
            rows = [_rows_of(x, g) for x in tensors]
            if any(x is None for x in rows):
                # A tensor whose heads are not D apart (a slice of a wider projection) has no
                # such view: the torch set packs it, the same bytes (bit for bit).
                return pack_s2h_torch(layout, tensors, roles, send, recv)
            ranges = [x * (d // g) for per in layout.peer_ranges(roles) for (a, b), d in zip(per, dims) for x in (a, b)]
            torch.ops.ulysses_kernels.pack_s2h(rows, ranges, send, recv, layout.rank, layout.seq_offset(layout.rank))
            return
        torch.ops.ulysses_kernels.pack_s2h(list(tensors), layout.head_ranges(roles), send, recv, layout.rank, layout.seq_offset(layout.rank))

    @staticmethod
    def pack_h2s(layout: Layout, local, send) -> None:
        d = local.shape[3] if local.dim() == 4 else -1
        dims = {layout.head_dim, layout.v_head_dim}
        expected = layout.seq_total * layout.batch * local.shape[2] * d if local.dim() == 4 else -1
        if local.dim() != 4 or tuple(local.shape[:2]) != (layout.batch, layout.seq_total) or d not in dims or send.numel() != expected:
            want = " or ".join(str(x) for x in sorted(dims))
            raise ValueError(
                f"CudaKernels.pack_h2s: local.shape expected [{layout.batch}, {layout.seq_total}, h, {want}] "
                f"and send.numel() B * S * h * D, got {list(local.shape)} and {send.numel()}"
            )
        torch.ops.ulysses_kernels.pack_h2s(local, send)

    @staticmethod
    def unpack_h2s(layout: Layout, blocks, roles, outs) -> None:
        flat = [b for per_source in blocks for b in per_source]
        torch.ops.ulysses_kernels.unpack_h2s(flat, layout.head_ranges(roles), list(outs))

    # ---- FP8 on the wire (ulysses_kernels.wire; csrc/fp8_ops.cpp, kernels/fp8_math.h) ----------
    @staticmethod
    def quant_pack_s2h(layout: Layout, tensors, roles, send, fmt, recv=None) -> None:
        if not layout.uniform:
            # MLA: the op quantizes rows of one head dim (a scale per whole head: no rows of
            # gcd(D, Dv) elements here); the torch set packs them, the same bytes.
            return quant_pack_s2h_torch(layout, tensors, roles, send, fmt, recv)
        torch.ops.ulysses_kernels.quant_pack_s2h(
            list(tensors), layout.head_ranges(roles), send, recv, layout.rank, layout.seq_offset(layout.rank), _FMT[fmt.name]
        )

    @staticmethod
    def quant_pack_h2s(layout: Layout, local, send, fmt) -> None:
        torch.ops.ulysses_kernels.quant_pack_s2h([local], [0, local.shape[2]], send, None, -1, 0, _FMT[fmt.name])

    @staticmethod
    def dequant_s2h(layout: Layout, recv, roles, outs, fmt) -> None:
        # One source (the receive buffer) per role, every role in one call.
        views = wire_layout(layout, fmt).s2h_recv_views(recv, roles)
        ranges = [x for out in outs for x in (0, out.shape[2])]
        torch.ops.ulysses_kernels.dequant_unpack_h2s(list(views), ranges, list(outs), _FMT[fmt.name])

    @staticmethod
    def dequant_unpack_h2s(layout: Layout, blocks, roles, outs, fmt) -> None:
        flat = [b for per_source in blocks for b in per_source]
        torch.ops.ulysses_kernels.dequant_unpack_h2s(flat, layout.head_ranges(roles), list(outs), _FMT[fmt.name])
