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
import functools
import linecache
import os
import re
import sys
import weakref
from collections import Counter

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .layout import Q_ONLY, QKV, Layout

__all__ = ["CopyCounter", "LiveBytes", "ulysses_payload_bytes", "ulysses_buffer_bytes"]

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


def h2s_recv_elems(layout: Layout, roles) -> int:
    """Elements of the head-to-sequence receive buffer of ``roles``: every source's block
    when the exchange is one ``all_to_all`` (one tensor at batch 1: the rank's own block
    travels through the collective), else the peers' blocks only (the rank's own rows are
    unpacked from its local tensors)."""
    splits = layout.h2s_splits(roles)[1]
    if len(roles) == 1 and layout.batch == 1 and layout.world_size > 1:
        return sum(splits)
    return sum(n for p, n in enumerate(splits) if p != layout.rank)


def ulysses_buffer_bytes(layout: Layout, element_size: int) -> int:
    """Bytes one rank allocates in one forward+backward of ``ulysses_attention`` outside the
    attention backend, when the backend returns rows contiguous per batch element: one send
    and one receive buffer for q/k/v and for dout, one receive buffer for the output and for
    dq/dk/dv (they are sent in place; ``h2s_recv_elems``), and the results ``out``, ``dq``,
    ``dk``, ``dv``."""
    hq, hkv = layout.plan.q_heads, layout.plan.kv_heads
    rows = layout.batch * layout.seq_local * layout.head_dim
    elems = sum(layout.s2h_send_splits(QKV)) + sum(layout.s2h_recv_splits(QKV))
    elems += sum(layout.s2h_send_splits(Q_ONLY)) + sum(layout.s2h_recv_splits(Q_ONLY))
    elems += h2s_recv_elems(layout, Q_ONLY) + h2s_recv_elems(layout, QKV)
    elems += rows * (2 * hq + 2 * hkv)
    return elems * element_size


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, from allocation to free, and what is alive at the peak.

    Every storage a tensor op creates while the mode is active is counted until it is
    freed (a weak reference's callback, as ``torch.distributed._tools.mem_tracker`` does);
    ``track`` adds tensors made before (the caller's inputs). ``.peak`` is the highest
    ``.current`` seen; ``.at_peak`` the bytes alive at that moment per label. A storage's
    label is ``phase/site``: the phase set by ``phase()`` when it was allocated and the
    first frame outside torch that allocated it, as ``module.function:name`` (``name``: the
    variable the source line assigns, e.g. ``exchange.post_seq_to_head:send``).
    Kernel-internal scratch that never reaches the dispatcher is not seen.
    """

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self.at_peak: Counter[str] = Counter()
        self._live: dict[int, tuple[int, str, weakref.ref]] = {}
        self._phase = ""

    @contextlib.contextmanager
    def phase(self, name: str):
        saved, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = saved

    def track(self, *tensors: torch.Tensor, label: str) -> None:
        for t in tensors:
            self._add(t, label)
        self._update_peak()

    def live(self) -> Counter[str]:
        """The bytes alive now, per label."""
        out: Counter[str] = Counter()
        for n, label, _ in self._live.values():
            out[label] += n
        return out

    def _add(self, t: torch.Tensor, label: str | None) -> None:
        st = t.untyped_storage()
        n = st.nbytes()
        key = id(st)
        if n == 0 or key in self._live:
            return
        if label is None:
            label = f"{self._phase}/{_site()}" if self._phase else _site()
        self._live[key] = (n, label, weakref.ref(st, functools.partial(self._freed, key)))
        self.current += n

    def _freed(self, key: int, ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[2] is ref:
            del self._live[key]
            self.current -= entry[0]

    def _update_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
            self.at_peak = self.live()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t, None)
        self._update_peak()
        return out


_ASSIGN = re.compile(r"\s*([A-Za-z_][\w, ]*?)\s*(?::[^=]*)?=(?!=)")


def _site() -> str:
    """``module.function:name`` of the first frame outside torch and this module."""
    frame = sys._getframe(2)
    torch_dir = os.path.dirname(torch.__file__)
    while frame is not None and (frame.f_code.co_filename.startswith(torch_dir) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    module = os.path.splitext(os.path.basename(code.co_filename))[0]
    m = _ASSIGN.match(linecache.getline(code.co_filename, frame.f_lineno))
    name = m.group(1).replace(" ", "") if m else ""
    return f"{module}.{code.co_name}:{name}"
