"""The ``"cuda"`` kernel set: fused pack/unpack ops of the C++/CUDA extension.

The ops (schemas in ``csrc/ops.cpp``, called through ``torch.ops.ulysses_kernels``):

* ``pack_s2h(Tensor[] tensors, int[] head_ranges, Tensor(a!) send, Tensor(b!)? recv, int rank,
  int seq_offset)``: q, k, v (``[B, s_r, H, D]`` each, any strides: separate tensors or views
  of one fused QKV projection output) into the peer-major send buffer of ``layout.pack_s2h``
  (with ``recv``, rank ``rank``'s own block into its rows of the receive buffer), in one
  kernel pass with 16-byte accesses where pointers and strides allow. ``head_ranges`` is
  ``[peer][role][start, end]`` flattened.
* ``pack_h2s(Tensor local, Tensor(a!) send)``: ``[B, S, h, D]`` (any strides) -> contiguous
  wire format ``[B][S][h][D]``.
* ``unpack_h2s(Tensor[] blocks, int[] head_ranges, Tensor(a!)[] outs)``: received
  ``[B, s_r, h, D]`` blocks (source-major, then role) into ``[B, s_r, H, D]`` outputs;
  replicated KV heads summed in rank order, bit-identical to ``layout.unpack_h2s``.
* ``nccl_all_to_all`` / ``nccl_send_recv`` (CUDA only): see ``ulysses_kernels.nccl_comm``.

CUDA tensors run the CUDA kernels; CPU tensors run their CPU twin (the same index math,
``csrc/kernels/layout_math.h``). The fake kernels below let ``torch.library.opcheck`` and
``torch.compile`` see the ops; they need no autograd (the autograd functions in
``ulysses_kernels.exchange`` call them inside their forward/backward).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import _C_loader
from ..layout import Layout

__all__ = ["CudaKernels", "s2h_head_ranges"]


def s2h_head_ranges(layout: Layout, roles: Sequence[str]) -> list[int]:
    """``[peer][role][start, end]`` flattened: the head ranges every pack/unpack op takes."""
    return [x for p in range(layout.world_size) for s in roles for x in layout.head_range(s, p)]


# kMaxPeers in csrc/kernels/layout_math.h (the kernels' parameter struct holds every peer's
# head ranges); tests/test_cuda_kernels.py checks that the two agree.
MAX_WORLD_SIZE = 64


class CudaKernels:
    """Kernel set backed by ``torch.ops.ulysses_kernels`` (see ``ulysses_kernels.kernels``)."""

    name = "cuda"

    @staticmethod
    def available() -> bool:
        return _C_loader.available()

    @staticmethod
    def unavailable_reason() -> str:
        """Why ``available()`` is False: the extension's import error (not built, or built
        against another NCCL than torch's)."""
        try:
            _C_loader.load()
        except ImportError as e:
            return str(e)
        return ""

    @staticmethod
    def supports(layout: Layout) -> bool:
        return layout.world_size <= MAX_WORLD_SIZE

    @staticmethod
    def pack_s2h(layout: Layout, tensors, roles, send, recv=None) -> None:
        torch.ops.ulysses_kernels.pack_s2h(
            list(tensors), s2h_head_ranges(layout, roles), send, recv, layout.rank, layout.seq_offset(layout.rank)
        )

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
        torch.ops.ulysses_kernels.unpack_h2s(flat, s2h_head_ranges(layout, roles), list(outs))


# ---- fake kernels: shape checks only (the ops mutate their outputs and return nothing) ----
def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"ulysses_kernels.{msg}")


def _fake_pack_s2h(tensors, head_ranges, send, recv=None, rank=-1, seq_offset=0):
    n = len(tensors)
    _check(1 <= n <= 3, f"pack_s2h: tensors expected 1 to 3 tensors, got {n}")
    _check(len(head_ranges) % (2 * n) == 0 and len(head_ranges) > 0, f"pack_s2h: head_ranges expected 2 * {n} * world_size values, got {len(head_ranges)}")
    B, S, _, D = tensors[0].shape
    heads = sum(b - a for a, b in zip(head_ranges[0::2], head_ranges[1::2]))
    _check(send.dim() == 1 and send.numel() == S * B * D * heads, f"pack_s2h: send.numel() expected {S * B * D * heads}, got {send.numel()}")
    for i, x in enumerate(tensors):
        _check(x.dtype == send.dtype, f"pack_s2h: tensors[{i}].dtype expected {send.dtype} (the dtype of send), got {x.dtype}")


def _fake_pack_h2s(local, send):
    _check(local.dim() == 4, f"pack_h2s: local expected 4 dims [B, S, h, D], got shape {list(local.shape)}")
    _check(send.dim() == 1 and send.numel() == local.numel(), f"pack_h2s: send.numel() expected {local.numel()}, got {send.numel()}")


def _fake_unpack_h2s(blocks, head_ranges, outs):
    n = len(outs)
    _check(1 <= n <= 3, f"unpack_h2s: outs expected 1 to 3 tensors, got {n}")
    _check(len(head_ranges) == 2 * len(blocks) and len(blocks) % n == 0, f"unpack_h2s: blocks expected world_size x {n} tensors and 2 head range values each, got {len(blocks)} blocks, {len(head_ranges)} values")


def _fake_nccl_all_to_all(comm, output, input, output_splits, input_splits):
    _check(sum(output_splits) == output.numel(), f"nccl_all_to_all: sum(output_splits) expected {output.numel()}, got {sum(output_splits)}")
    _check(sum(input_splits) == input.numel(), f"nccl_all_to_all: sum(input_splits) expected {input.numel()}, got {sum(input_splits)}")


def _fake_nccl_send_recv(comm, sends, send_peers, recvs, recv_peers):
    _check(len(sends) == len(send_peers) and len(recvs) == len(recv_peers), "nccl_send_recv: one peer per tensor expected")


def _register_fakes(module) -> None:
    fakes = {"pack_s2h": _fake_pack_s2h, "pack_h2s": _fake_pack_h2s, "unpack_h2s": _fake_unpack_h2s}
    if module.build_info().get("nccl"):
        fakes.update(nccl_all_to_all=_fake_nccl_all_to_all, nccl_send_recv=_fake_nccl_send_recv)
    for name, fn in fakes.items():
        torch.library.register_fake(f"ulysses_kernels::{name}", fn)


if _C_loader.available():
    _register_fakes(_C_loader.load())
