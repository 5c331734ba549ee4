"""Grouped-query attention on one rank: which local KV head each local query head uses, and
the one piece that moves between them (``KVGather``).

After the sequence-to-head exchange a rank holds ``q`` ``[B, S, hq, D]`` and ``k``/``v``
``[B, S, hkv, D]``; ``kv_map[i]`` is the local KV head of local query head ``i``
(``HeadPlan.local_kv_map``). Three cases, the ``KVGather`` modes:

* ``"grouped"``: the map is uniform (query head ``i`` uses KV head ``i // (hq // hkv)``:
  plain GQA): a grouped-query kernel takes ``k``, ``v`` as they are (``uniform_kv_groups``);
* ``"gathered"``: the rank's query heads straddle a KV group boundary unevenly (3 query
  heads, 2 from one group and 1 from the next): the KV heads are gathered to one per query
  head, locally, after the wire, and their gradients summed back (``index_add`` in
  query-head order, what autograd's ``index_select`` backward does);
* ``"shared"``: every query head uses the rank's one KV head (``shares_one_kv``: MQA, or
  40/8 heads at world 8): stride-0 views of that head (no copy), the gradient summed per
  query head in head order (``KVGradSum``), which keeps a chunked backward bit-identical
  to the unchunked one.

Who uses it: ``backends.AttentionBackend`` (gathered maps) and ``backends.SharedKV``
(shared), the chunked schedule (a chunk of a gathered rank), the traced schedule, the ring
level (per K/V block) and the integrations that run a model's own attention
(``expand_kv``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tracing import in_trace

__all__ = ["KVGather", "KVGradSum", "expand_kv", "kv_index", "shares_one_kv", "uniform_kv_groups"]


def uniform_kv_groups(hq: int, hkv: int, kv_map: Sequence[int]) -> bool:
    """True when query head ``i`` uses KV head ``i // (hq // hkv)`` (plain GQA)."""
    if hq % hkv:
        return False
    g = hq // hkv
    return all(j == i // g for i, j in enumerate(kv_map))


def shares_one_kv(kv_map: Sequence[int]) -> bool:
    """True when several local query heads use the rank's only local KV head."""
    return len(kv_map) > 1 and not any(kv_map)


def kv_index(kv_map: Sequence[int], device: torch.device) -> torch.Tensor:
    """``kv_map`` as an int64 index tensor on ``device``, read-only.

    On a GPU the tensor is kept on the device per ``(kv_map, device)`` (a bounded cache of a
    few bytes each, keyed by values, not by a group): the first call for a map copies it
    once, and every later call reuses it with no copy, no host sync and nothing a CUDA graph
    capture would refuse (a per-call copy from pageable host memory cannot be captured, and
    a blocking one would make the host wait for the queued GPU work). As with the Triton
    tables, run a layout once before capturing it. Elsewhere, and inside ``torch.compile``,
    a fresh tensor."""
    if device.type != "cuda" or in_trace():
        return torch.tensor(list(kv_map), dtype=torch.int64, device=device)
    return _device_index(tuple(int(i) for i in kv_map), device)


@functools.lru_cache(maxsize=256)
def _device_index(kv_map: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # A blocking copy, once per (map, device): the tensor is complete before any stream
    # reads it, whichever stream that is.
    return torch.tensor(kv_map, dtype=torch.int64, device=device)


class KVGradSum:
    """Running sum over query heads of per-query-head KV gradients, in head order.

    ``add(dk, dv)`` takes ``[B, S, h, D]`` gradients of ``h`` query heads that all use one
    KV head and adds them one head at a time into ``[B, S, 1, D]`` accumulators (float32
    for half types, rounded once in ``result``). Feeding the heads in two calls or in one
    adds the same numbers in the same order, which is what makes a chunked backward
    bit-identical to the unchunked one.
    """

    def __init__(self):
        self.acc: list[torch.Tensor] | None = None
        self.dtype: torch.dtype | None = None

    def add(self, *grads: torch.Tensor) -> None:
        h = grads[0].shape[2]
        if h == 0:
            return
        start = 0
        if self.acc is None:
            self.dtype = grads[0].dtype
            wide = self.dtype if self.dtype in (torch.float32, torch.float64) else torch.float32
            self.acc = [g[:, :, :1].to(wide, copy=True) for g in grads]
            start = 1
        for i in range(start, h):
            for a, g in zip(self.acc, grads):
                a.add_(g[:, :, i : i + 1])

    def result(self) -> list[torch.Tensor]:
        """The sums ``[B, S, 1, D]`` in the gradients' dtype."""
        if self.acc is None:
            raise RuntimeError("KVGradSum.result: no gradient was added")
        return [a.to(self.dtype) for a in self.acc]


@dataclass(frozen=True)
class KVGather:
    """How one rank's local query heads meet its local KV heads (the module docstring's
    three modes), and the three steps every schedule takes with them: ``gather`` (k, v as
    the kernel's grouped heads), ``own_q`` (q off the receive buffer when gathered k, v are
    what attention saves) and ``scatter`` (the per-query-head gradients back to the KV
    heads). A plain value (the map and two ints): a backward's state may hold it.

    ``kv_map``: per local query head, its local KV head; ``kv_heads``: the local KV heads
    (``k.shape[2]``); ``mode``: ``"grouped"``, ``"gathered"`` or ``"shared"``.
    """

    kv_map: tuple[int, ...]
    kv_heads: int
    mode: str

    @classmethod
    def of(cls, kv_map: Sequence[int], kv_heads: int, *, gather: bool = False, shared: bool = False) -> KVGather:
        """The mode of ``kv_map``: ``"shared"`` when ``shared`` is asked for and every query
        head uses the one KV head; ``"gathered"`` when the map is not uniform, or always with
        ``gather`` (a chunk of a rank whose whole map is not uniform must run the same kernels
        as the unchunked op, even where the chunk's own map is uniform); else ``"grouped"``."""
        build = _kv_gather.__wrapped__ if in_trace() else _kv_gather  # dynamo traces no cache
        return build(tuple(kv_map), kv_heads, gather, shared)

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` ``[B, S, hkv, D]`` as the kernel's heads: as they are (grouped), one
        KV head per query head ``[B, S, hq, D]`` (gathered: a copy, differentiable by
        autograd), or stride-0 views of the one KV head ``[B, S, hq, D]`` (shared: no copy)."""
        if self.mode == "grouped":
            return k, v
        if self.mode == "shared":
            shape = (-1, -1, len(self.kv_map), -1)
            return k.expand(shape), v.expand(shape)
        index = kv_index(self.kv_map, k.device)
        return k.index_select(2, index), v.index_select(2, index)

    def own_q(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``q``, copied when gathered k, v are what attention saves for its backward and
        ``q`` shares its storage with ``k`` (both views of the receive buffer): the buffer,
        whose k, v heads nothing reads any more, is then not kept alive by ``q`` alone."""
        if self.mode == "gathered" and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
            return q.clone(memory_format=torch.contiguous_format)
        return q

    def scatter(self, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-query-head ``dk``, ``dv`` ``[B, S, hq, D]`` summed back to ``[B, S, hkv, D]``:
        as they are (grouped); zeros, then ``index_add_`` in query-head order (gathered, as
        autograd's ``index_select`` backward does); ``KVGradSum`` in head order (shared)."""
        if self.mode == "grouped":
            return dk, dv
        if self.mode == "shared":
            acc = KVGradSum()
            acc.add(dk, dv)
            dk, dv = acc.result()
            return dk, dv
        index = kv_index(self.kv_map, dk.device)
        shape = (dk.shape[0], dk.shape[1], self.kv_heads)
        return dk.new_zeros(*shape, dk.shape[3]).index_add_(2, index, dk), dv.new_zeros(*shape, dv.shape[3]).index_add_(2, index, dv)


def expand_kv(k: torch.Tensor, v: torch.Tensor, kv_map: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``, ``v`` as plain grouped heads for ``kv_map`` (``KVGather.gather``; under autograd
    the gather's backward is the scatter): for a model's own attention between the exchanges."""
    return KVGather.of(kv_map, k.shape[2]).gather(k, v)


@functools.lru_cache(maxsize=1024)
def _kv_gather(kv_map: tuple[int, ...], kv_heads: int, gather: bool, shared: bool) -> KVGather:
    # A value per (map, heads, flags): every call of a layout gets the same one.
    if shared and shares_one_kv(kv_map):
        return KVGather(kv_map, kv_heads, "shared")
    if gather or not uniform_kv_groups(len(kv_map), kv_heads, kv_map):
        return KVGather(kv_map, kv_heads, "gathered")
    return KVGather(kv_map, kv_heads, "grouped")
