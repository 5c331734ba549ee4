"""The ``"torch"`` kernel set: pack and unpack in pure PyTorch (views and ``copy_``/``add_``
of stock PyTorch ops, whose CUDA kernels are PyTorch's own), the definition that every other
kernel set (Triton, C++/CUDA) matches bit for bit. One copy per byte: each byte of a tensor
is written once into the send buffer (or, for this rank's own rows, straight into the
receive buffer), and once from the received blocks into the outputs. The buffer layouts
are drawn in ``ulysses_kernels.layout``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout import Layout
from ..tracing import in_trace
from ..wire import AMAX_FLOOR, SCALE_BYTES, Fp8Format, wire_layout

__all__ = [
    "TorchKernels",
    "pack_s2h",
    "pack_h2s",
    "unpack_h2s",
    "quantize_rows",
    "dequantize_rows",
    "quant_pack_s2h",
    "quant_pack_h2s",
    "dequant_s2h",
    "dequant_unpack_h2s",
]


def pack_s2h(
    layout: Layout,
    tensors: Sequence[torch.Tensor],
    roles: Sequence[str],
    send: torch.Tensor,
    recv: torch.Tensor | None = None,
) -> None:
    """Write ``tensors`` (``[B, s_r, H, D]`` each, any strides) into the flat send buffer;
    with ``recv``, this rank's own heads go straight into its rows of the receive buffer."""
    for views, ranges in zip(layout.s2h_send_views(send, roles, recv), layout.peer_ranges(roles)):
        for x, (a, b), dst in zip(tensors, ranges, views):
            dst.copy_(x if b - a == x.shape[2] else x.narrow(2, a, b - a))  # x[:, :, a:b]


def pack_h2s(layout: Layout, local: torch.Tensor, send: torch.Tensor) -> None:
    """Write a local ``[B, S, h, D]`` tensor (any strides) into a flat wire-format buffer."""
    send.view(local.shape).copy_(local)


def unpack_h2s(
    layout: Layout,
    blocks: Sequence[Sequence[torch.Tensor]],
    roles: Sequence[str],
    outs: Sequence[torch.Tensor],
) -> None:
    """Write received blocks (per source, per role, ``[B, s_r, h, D]``) into ``outs``
    (``[B, s_r, H, D]`` each). KV heads held by several sources are summed in rank order:
    the lowest holder is copied, the others added, so every byte is written once per
    replica received."""
    for i, (s, out) in enumerate(zip(roles, outs)):
        filled = 0  # heads [0, filled) of `out` already hold a value
        for p in range(layout.world_size):
            a, b = layout.head_range(s, p)
            block = blocks[p][i]
            overlap = max(0, min(b, filled) - a)
            if overlap:
                out[:, :, a : a + overlap].add_(block[:, :, :overlap])
            if a + overlap < b:
                out[:, :, a + overlap : b].copy_(block[:, :, overlap:])
            filled = max(filled, b)


# ---- FP8 on the wire (ulysses_kernels.wire: the formats, the row of D + 4 bytes, the definition) ----
def quantize_rows(x: torch.Tensor, dst: torch.Tensor, fmt: Fp8Format) -> None:
    """Quantize ``x`` (``[..., D]``, any float dtype and strides) into ``dst`` (``[..., D + 4]``
    bytes): per row of ``D`` elements the FP8 values, then the float32 scale (``wire``'s
    definition, which every kernel set matches bit for bit)."""
    D = x.shape[-1]
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR)
    # Divisions tensor by tensor: divided by a Python or 0-dim scalar, PyTorch multiplies by
    # the scalar's reciprocal instead (not the correctly rounded quotient the kernels compute).
    mx = torch.full_like(amax, fmt.max)
    q = (xf * (mx / amax)).clamp_(-fmt.max, fmt.max).to(fmt.dtype)
    dst[..., :D].copy_(q.view(torch.uint8))
    dst[..., D:].copy_((amax / mx).view(torch.uint8))


def wire_rows(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """``x`` (``[..., D]``) quantized into new wire rows ``[..., D + 4]`` (bytes, on ``x``'s
    device) by ``quantize_rows``: the blocks a peer's quantizing pack would have sent."""
    dst = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    quantize_rows(x, dst, fmt)
    return dst


def _scales(src: torch.Tensor, D: int) -> torch.Tensor:
    """The float32 scales ``[..., 1]`` of wire rows ``src`` (``[..., D + 4]`` bytes); a view
    when the rows keep them 4-byte aligned, else a copy of the 4 bytes per row."""
    sc = src[..., D:]
    # Inside torch.compile the view's offset is not known to the trace: the copy (same values).
    aligned = not in_trace() and sc.storage_offset() % SCALE_BYTES == 0 and all(st % SCALE_BYTES == 0 for st in sc.stride()[:-1])
    # a fresh copy (offset 0), not .contiguous(): a one-row block is "contiguous" at any offset and would come back as is
    return (sc if aligned else sc.clone(memory_format=torch.contiguous_format)).view(torch.float32)


def dequantize_rows(src: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype) -> torch.Tensor:
    """Wire rows ``src`` (``[..., D + 4]`` bytes) -> ``[..., D]`` values in ``dtype``:
    ``dtype(float32(q) * scale)``."""
    D = src.shape[-1] - SCALE_BYTES
    return (src[..., :D].view(fmt.dtype).float() * _scales(src, D)).to(dtype)


def quant_pack_s2h(layout: Layout, tensors, roles, send: torch.Tensor, fmt: Fp8Format, recv: torch.Tensor | None = None) -> None:
    """``pack_s2h`` quantizing: ``send`` (and ``recv``) are byte buffers in the wire format of
    ``wire_layout(layout, fmt)``; ``layout`` is the tensors' (``[B, s_r, H, D]`` each)."""
    wl = wire_layout(layout, fmt)
    for views, ranges in zip(wl.s2h_send_views(send, roles, recv), layout.peer_ranges(roles)):
        for x, (a, b), dst in zip(tensors, ranges, views):
            quantize_rows(x.narrow(2, a, b - a), dst, fmt)


def quant_pack_h2s(layout: Layout, local: torch.Tensor, send: torch.Tensor, fmt: Fp8Format) -> None:
    """``pack_h2s`` quantizing: a local ``[B, S, h, D]`` tensor into ``send``, bytes ``[B, S, h, D + 4]``."""
    B, S, h, D = local.shape
    quantize_rows(local, send.view(B, S, h, D + SCALE_BYTES), fmt)


def dequant_s2h(layout: Layout, recv: torch.Tensor, roles, outs, fmt: Fp8Format) -> None:
    """The sequence-to-head receive buffer (bytes, ``wire_layout(layout, fmt)``) -> ``outs``
    (``[B, S, h, D]`` per role, this rank's heads, the attention dtype)."""
    for src, out in zip(wire_layout(layout, fmt).s2h_recv_views(recv, roles), outs):
        out.copy_(dequantize_rows(src, fmt, out.dtype))


def dequant_unpack_h2s(layout: Layout, blocks, roles, outs, fmt: Fp8Format) -> None:
    """``unpack_h2s`` dequantizing: ``blocks`` (per source, per role) are wire blocks, bytes
    ``[B, s_r, h, D + 4]`` (or their flat 1-D pieces); replicated KV heads are dequantized
    and summed in rank order, in the outputs' dtype, as ``unpack_h2s`` sums."""
    for i, (s, out) in enumerate(zip(roles, outs)):
        filled = 0
        for p in range(layout.world_size):
            a, b = layout.head_range(s, p)
            block = blocks[p][i].view(out.shape[0], out.shape[1], b - a, out.shape[3] + SCALE_BYTES)
            overlap = max(0, min(b, filled) - a)
            if overlap:
                out[:, :, a : a + overlap].add_(dequantize_rows(block[:, :, :overlap], fmt, out.dtype))
            if a + overlap < b:
                out[:, :, a + overlap : b].copy_(dequantize_rows(block[:, :, overlap:], fmt, out.dtype))
            filled = max(filled, b)


class TorchKernels:
    """The pure-PyTorch kernel set (``ulysses_kernels.kernels.KernelSet``): the functions above."""

    name = "torch"
    pack_s2h = staticmethod(pack_s2h)
    pack_h2s = staticmethod(pack_h2s)
    unpack_h2s = staticmethod(unpack_h2s)
    quant_pack_s2h = staticmethod(quant_pack_s2h)
    quant_pack_h2s = staticmethod(quant_pack_h2s)
    dequant_s2h = staticmethod(dequant_s2h)
    dequant_unpack_h2s = staticmethod(dequant_unpack_h2s)
