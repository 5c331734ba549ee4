"""Count the bytes that layout copies write, and the bytes the all-to-alls carry.

``CopyCounter`` is a ``TorchDispatchMode`` that adds up the bytes written by copy-like aten
ops (and by in-place adds, which is how replicated KV gradients are summed) while it is
active and not paused. Wrap the attention backend in ``counter.paused()`` to count only
the data movement around it. ``ulysses_payload_bytes`` is what the all-to-alls of one
forward+backward carry for one rank (replicated KV heads counted as sent), so
``counter.bytes / payload`` is the number of copies per byte on the wire.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .layout import Q_ONLY, QKV, Layout

__all__ = ["CopyCounter", "ulysses_payload_bytes", "ulysses_buffer_bytes"]

aten = torch.ops.aten

# Ops whose every output byte is a moved byte.
_OUT_OF_PLACE = {
    aten.clone, aten.cat, aten.stack, aten.index_select, aten.repeat_interleave, aten._to_copy,
    aten.slice_scatter, aten.select_scatter, aten.as_strided_scatter, aten.expand_copy,
    aten.permute_copy, aten.transpose_copy, aten.view_copy, aten.repeat, aten.gather,
}  # fmt: skip
# Fresh allocations (their bytes are counted in ``.allocated``, not as copies).
_ALLOC = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.zeros, aten.zeros_like, aten.new_zeros}
# In-place writers: (op, index of the argument whose bytes are written).
_IN_PLACE = {aten.copy_: 0, aten.add_: 0, aten.index_add_: 3, aten.index_copy_: 3, aten.index_put_: 2, aten.scatter_: 3, aten.scatter_add_: 3}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CopyCounter(TorchDispatchMode):
    """Bytes written by copy-like ops: ``.bytes`` in total, ``.by_op`` per op name; bytes of
    fresh tensors allocated: ``.allocated``."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.allocated = 0
        self.by_op: Counter[str] = Counter()
        self._paused = 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._paused:
            packet = func.overloadpacket
            if packet in _ALLOC:
                self.allocated += _nbytes(out)
            written = 0
            if packet in _OUT_OF_PLACE:
                written = _nbytes(out)
            elif packet in _IN_PLACE:
                i = _IN_PLACE[packet]
                src = args[i] if len(args) > i else None
                written = _nbytes(src) if packet not in (aten.copy_, aten.add_) else _nbytes(args[0])
            if written:
                self.bytes += written
                self.by_op[str(packet.__name__)] += written
        return out


def ulysses_payload_bytes(layout: Layout, element_size: int, backward: bool = True) -> int:
    """Bytes one rank sends in the all-to-alls of ``ulysses_attention`` (self block included):
    q/k/v and the output forward; dout and dq/dk/dv backward."""
    elems = sum(layout.s2h_send_splits(QKV)) + sum(layout.h2s_splits(Q_ONLY)[0])
    if backward:
        elems += sum(layout.s2h_send_splits(Q_ONLY)) + sum(layout.h2s_splits(QKV)[0])
    return elems * element_size


def ulysses_buffer_bytes(layout: Layout, element_size: int) -> int:
    """Bytes one rank allocates in one forward+backward of ``ulysses_attention`` outside the
    attention backend, when the backend returns rows contiguous per batch element: one send
    and one receive buffer for q/k/v and for dout, one receive buffer for the output and for
    dq/dk/dv (they are sent in place), and the results ``out``, ``dq``, ``dk``, ``dv``."""
    hq, hkv = layout.plan.q_heads, layout.plan.kv_heads
    rows = layout.batch * layout.seq_local * layout.head_dim
    elems = sum(layout.s2h_send_splits(QKV)) + sum(layout.s2h_recv_splits(QKV))
    elems += sum(layout.s2h_send_splits(Q_ONLY)) + sum(layout.s2h_recv_splits(Q_ONLY))
    elems += sum(layout.h2s_splits(Q_ONLY)[1]) + sum(layout.h2s_splits(QKV)[1])
    elems += rows * (2 * hq + 2 * hkv)
    return elems * element_size
