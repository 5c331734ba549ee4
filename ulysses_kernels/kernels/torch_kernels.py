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

__all__ = ["TorchKernels", "pack_s2h", "pack_h2s", "unpack_h2s"]


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


class TorchKernels:
    """The pure-PyTorch kernel set (``ulysses_kernels.kernels.KernelSet``): the functions above."""

    name = "torch"
    pack_s2h = staticmethod(pack_s2h)
    pack_h2s = staticmethod(pack_h2s)
    unpack_h2s = staticmethod(unpack_h2s)
