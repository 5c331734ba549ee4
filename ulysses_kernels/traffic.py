"""Count the bytes that layout copies write, the bytes the all-to-alls carry, and the bytes
alive at the peak.

``CopyCounter`` is a ``TorchDispatchMode`` that adds up the bytes written by copy-like aten
ops (and by in-place adds, which is how replicated KV gradients are summed) while it is
active and not paused. Wrap the attention backend in ``counter.paused()`` to count only
the data movement around it. ``ulysses_payload_bytes`` is what the all-to-alls of one
forward+backward carry for one rank (replicated KV heads counted as sent), so
``counter.bytes / payload`` is the number of copies per byte on the wire.

``LiveBytes`` is a ``TorchDispatchMode`` that follows every tensor storage allocated while
it is active until it is freed, and records the peak and what was alive then, by
allocation site; ``ulysses_peak_moments`` is what that peak should be for one rank's call
(the formula of docs/design.md).
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
from torch.utils._python_dispatch import TorchDispatchMode

from .gqa import shares_one_kv, uniform_kv_groups
from .layout import OUT, QKV, Layout

__all__ = [
    "CopyCounter",
    "LiveBytes",
    "WireCounter",
    "ulysses_payload_bytes",
    "ulysses_buffer_bytes",
    "s2h_send_elems",
    "h2s_recv_elems",
    "ulysses_peak_moments",
]

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


class WireCounter:
    """A communicator (``inner``) that counts the bytes each collective puts on the wire from
    this rank: ``sent``, one entry per call (a rank's own block of an all-to-all never leaves
    it: not counted). Every other attribute is ``inner``'s."""

    def __init__(self, inner):
        self.inner, self.sent = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_to_all(self, output, input, output_splits, input_splits, async_op=False):
        own = input_splits[self.inner.rank] if input_splits is not None else input.numel() // self.inner.world_size
        self.sent.append((input.numel() - own) * input.element_size())
        return self.inner.all_to_all(output, input, output_splits, input_splits, async_op=async_op)

    def send_recv(self, sends, recvs, async_op=False):
        self.sent.append(sum(t.numel() * t.element_size() for _, t in sends))
        return self.inner.send_recv(sends, recvs, async_op=async_op)


def ulysses_payload_bytes(layout: Layout, element_size: int, backward: bool = True) -> int:
    """Bytes one rank sends in the all-to-alls of ``ulysses_attention`` (self block included):
    q/k/v and the output forward; dout and dq/dk/dv backward."""
    elems = sum(layout.s2h_send_splits(QKV)) + sum(layout.h2s_splits(OUT)[0])
    if backward:
        elems += sum(layout.s2h_send_splits(OUT)) + sum(layout.h2s_splits(QKV)[0])
    return elems * element_size


def s2h_send_elems(layout: Layout, roles) -> int:
    """Elements of the sequence-to-head send buffer of ``roles``: every peer's block when
    the exchange is one ``all_to_all`` (batch 1: the rank's own block travels through the
    collective), else the peers' blocks only (the rank's own rows are packed straight into
    its receive buffer)."""
    return sum(layout.s2h_send_splits(roles, own=layout.batch == 1 and layout.world_size > 1))


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
    (``s2h_send_elems``) and one receive buffer for q/k/v and for dout, one receive buffer for the output and for
    dq/dk/dv (they are sent in place; ``h2s_recv_elems``), and the results ``out``, ``dq``,
    ``dk``, ``dv``."""
    hq, hkv = layout.plan.q_heads, layout.plan.kv_heads
    rows = layout.batch * layout.seq_local
    elems = s2h_send_elems(layout, QKV) + sum(layout.s2h_recv_splits(QKV))
    elems += s2h_send_elems(layout, OUT) + sum(layout.s2h_recv_splits(OUT))
    elems += h2s_recv_elems(layout, OUT) + h2s_recv_elems(layout, QKV)
    # out and dv at v_head_dim, dq and dk at head_dim
    elems += rows * (hq + hkv) * (layout.head_dim + layout.v_head_dim)
    return elems * element_size


def ulysses_peak_moments(layout: Layout, element_size: int, *, backward: bool) -> dict[str, int]:
    """Bytes one rank's ``ulysses_attention`` (unchunked, a built-in backend: SDPA or
    flash-attn, which save a float32 logsumexp ``[B, hq, S]``) holds at each of its
    moments, counting what the op allocates (not the caller's q, k, v, dout) while the
    caller keeps ``out`` alive for the backward. The op's peak is the largest; the terms
    are the buffers of docs/design.md ("Buffers and who owns them").

    ``backward=False``: inference (q, k, v do not require grad), nothing is saved.
    """
    e, lay = element_size, layout
    B, S, D, r = lay.batch, lay.seq_total, lay.head_dim, lay.rank
    hq, hkv = lay.head_count("q", r), lay.head_count("kv", r)
    kv_map = lay.plan.local_kv_map(r)
    shared = shares_one_kv(kv_map)
    gathered = not shared and not uniform_kv_groups(len(kv_map), hkv, kv_map)
    head = B * S * D * e  # one head over the whole sequence, [B, S, 1, D]
    send_qkv, recv_qkv = s2h_send_elems(lay, QKV) * e, sum(lay.s2h_recv_splits(QKV)) * e
    send_dout, recv_dout = s2h_send_elems(lay, OUT) * e, sum(lay.s2h_recv_splits(OUT)) * e
    out_l, lse = hq * head, B * hq * S * 4
    kv2 = 2 * hq * head if gathered else 0  # k, v gathered to one KV head per query head
    out = lay.batch * lay.seq_local * lay.plan.q_heads * D * e
    moments = {"q/k/v exchange": send_qkv + recv_qkv}
    if not backward:
        moments["attention"] = recv_qkv + kv2 + out_l + lse
        moments["output exchange"] = out_l + h2s_recv_elems(lay, OUT) * e + out
        return moments
    # Saved for the backward: the receive buffer (q, k, v are views of it), or with a
    # gathered map a copy of q and the gathered k, v; the output and lse.
    saved = (hq * head + kv2 if gathered else recv_qkv) + out_l + lse
    # With a gathered map the receive buffer, the q copy, k, v and the int64 index meet here.
    moments["attention"] = recv_qkv + (hq * head + kv2 + 8 * hq if gathered else 0) + out_l + lse
    moments["output exchange"] = saved + h2s_recv_elems(lay, OUT) * e + out
    moments["dout exchange"] = saved + out + send_dout + recv_dout
    # The kernel's dk, dv: per query head for SharedKV (summed after) and gathered maps
    # (index_add-ed after), per KV head otherwise.
    dq_l = hq * head
    dkv_kernel = 2 * (hq if shared or gathered else hkv) * head
    moments["attention backward"] = saved + out + recv_dout + dq_l + dkv_kernel
    if shared:  # KVGradSum, after the state is freed: a wide accumulator, then the result
        wide = max(e, 4)
        moments["KV gradient sum"] = out + recv_dout + dq_l + dkv_kernel + 2 * head // e * wide + (2 * head if wide != e else 0)
    grads_l = dq_l + 2 * hkv * head  # sent in place
    results = lay.batch * lay.seq_local * D * (lay.plan.q_heads + 2 * lay.plan.kv_heads) * e
    moments["dq/dk/dv exchange"] = out + grads_l + h2s_recv_elems(lay, QKV) * e + results
    return moments


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, from allocation to free, and what is alive at the peak.

    Every storage a tensor op creates while the mode is active is counted until it is
    freed (a weak reference's callback, as ``torch.distributed._tools.mem_tracker`` does);
    views of tensors made before are not, and ``track`` adds such tensors (the caller's
    inputs) when they should count. ``.peak`` is the highest ``.current`` seen; ``.at_peak`` the bytes alive at that moment per label. A storage's
    label is ``phase/site``: the phase set by ``phase()`` when it was allocated and the
    first frame outside torch that allocated it, as ``module.function:name`` (``name``: the
    variable the source line assigns, e.g. ``exchange._post_s2h:send``).
    Kernel-internal scratch that never reaches the dispatcher is not seen.

    Host memory: storages allocated at a site that starts with one of ``host_sites``
    (``module.function``, e.g. ``"offload._host_copy"``) count in ``.host_current`` and
    ``.host_peak`` instead: on the CPU an activation offload's "host" copies are CPU tensors
    like the rest, and this keeps them apart from the "device" bytes. ``forget(t)`` stops
    counting ``t``'s storage now, as if freed (a test stands in for an engine that reduces a
    gradient and frees it).

    Cost per op: the bytes alive per label are a running sum, and the breakdown at the peak is
    copied from it once the peak is over (at the next free, host allocation or read of
    ``.at_peak``), not at each new peak: a forward pass that only allocates reaches a new peak
    at nearly every op, and recounting every live storage there made a step's tracking grow
    with the square of its tensors. A site's name is read from its source line once.
    """

    def __init__(self, host_sites: tuple[str, ...] = ()):
        super().__init__()
        self.current = 0
        self.peak = 0
        self.host_current = 0
        self.host_peak = 0
        self.host_sites = tuple(host_sites)
        self._live: dict[int, tuple[int, str, weakref.ref]] = {}
        self._by_label: Counter[str] = Counter()  # the bytes of self._live per label, kept as it changes
        self._at_peak: Counter[str] = Counter()
        self._peak_pending = False  # the peak is now: its breakdown is self._by_label, not yet copied
        self._phase = ""

    @property
    def at_peak(self) -> Counter[str]:
        """The bytes alive at the peak, per label."""
        self._settle_peak()
        return self._at_peak

    def _settle_peak(self) -> None:
        """Copy the breakdown of the peak before what is alive changes other than by raising it."""
        if self._peak_pending:
            snapshot = Counter(dict(self._by_label))
            # A free seen while copying (a garbage collection run by the copy's allocations calls
            # _freed) has settled the peak itself, before it changed the counts: keep that copy.
            if self._peak_pending:
                self._at_peak, self._peak_pending = snapshot, False

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

    def forget(self, *tensors: torch.Tensor) -> None:
        """Stop counting these tensors' storages (as if they were freed now)."""
        for t in tensors:
            entry = self._live.pop(id(t.untyped_storage()), None)
            if entry is not None:
                self._uncount(entry)

    def live(self) -> Counter[str]:
        """The bytes alive now, per label."""
        return Counter(self._by_label)

    def _add(self, t: torch.Tensor, label: str | None) -> None:
        st = t.untyped_storage()
        n = st.nbytes()
        key = id(st)
        if n == 0 or key in self._live:
            return
        host = False
        if label is None:
            site = _site()
            label = f"{self._phase}/{site}" if self._phase else site
            host = bool(self.host_sites) and site.startswith(self.host_sites)
            if host:
                label = "host:" + label
        if host:
            self._settle_peak()  # the breakdown changes, the device peak does not
            self.host_current += n
            self.host_peak = max(self.host_peak, self.host_current)
        else:
            self.current += n
        self._live[key] = (n, label, weakref.ref(st, functools.partial(self._freed, key)))
        self._by_label[label] += n

    def _uncount(self, entry) -> None:
        self._settle_peak()
        n, label = entry[0], entry[1]
        left = self._by_label[label] - n
        if left:
            self._by_label[label] = left
        else:
            del self._by_label[label]
        if label.startswith("host:"):
            self.host_current -= n
        else:
            self.current -= n

    def _freed(self, key: int, ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[2] is ref:
            del self._live[key]
            self._uncount(entry)

    def _update_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
            self._peak_pending = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Views (and in-place results) share an input's storage: not an allocation, and
        # the input may be a tensor made before the mode (the caller's q, k, v).
        # ``lift_fresh`` is how ``torch.tensor(data)`` hands its new tensor to the dispatcher.
        fresh = func.overloadpacket is aten.lift_fresh
        inputs = set() if fresh else {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if id(t.untyped_storage()) not in inputs:
                self._add(t, None)
        self._update_peak()
        return out


def _tensors(tree):
    """The tensors of an op's arguments or results (nested tuples, lists and dicts): what
    ``pytree.tree_leaves`` finds there, at a fraction of its cost per op."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


_ASSIGN = re.compile(r"\s*([A-Za-z_][\w, ]*?)\s*(?::[^=]*)?=(?!=)")


def _site() -> str:
    """``module.function:name`` of the frame outside torch that allocated: the first of up to
    three frames (a helper such as ``exchange._flat`` returns its allocation to a caller that
    names it) whose source line assigns a name; else the first frame, with no name."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    first = frame
    for _ in range(3):
        site = _assigning_site(frame.f_code, frame.f_lineno)
        if site is not None:
            return site
        frame = frame.f_back
        if frame is None:
            break
    return f"{_module(first.f_code)}.{first.f_code.co_name}:"


_TORCH_DIR = os.path.dirname(torch.__file__)


@functools.lru_cache(maxsize=4096)
def _assigning_site(code, lineno: int) -> str | None:
    """``module.function:name`` where the source line assigns ``name``, else None (read once per line)."""
    m = _ASSIGN.match(linecache.getline(code.co_filename, lineno))
    return f"{_module(code)}.{code.co_name}:{m.group(1).replace(' ', '')}" if m else None


def _module(code) -> str:
    return os.path.splitext(os.path.basename(code.co_filename))[0]
