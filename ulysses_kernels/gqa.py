"""Grouped-query attention on one rank: which local KV head each local query head uses, and
moving between the two (gathering KV heads to query heads, summing their gradients back).

After the sequence-to-head exchange a rank holds ``q`` ``[B, S, hq, D]`` and ``k``/``v``
``[B, S, hkv, D]``; ``kv_map[i]`` is the local KV head of local query head ``i``
(``HeadPlan.local_kv_map``). Three cases:

* the map is uniform (query head ``i`` uses KV head ``i // (hq // hkv)``: plain GQA): a
  grouped-query kernel takes ``k``, ``v`` as they are (``uniform_group``);
* the rank's query heads straddle a KV group boundary unevenly (3 query heads, 2 from one
  group and 1 from the next): the KV heads are gathered to one per query head, locally,
  after the wire, and their gradients summed back (``index_add`` in query-head order);
* every query head uses the rank's one KV head (``shares_one_kv``: MQA, or 40/8 heads at
  world 8): stride-0 views of that head, the gradient summed per query head in head order
  (``KVGradSum``), which keeps a chunked backward bit-identical to the unchunked one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

__all__ = ["uniform_group", "shares_one_kv", "kv_index", "expand_kv", "gather_kv", "scatter_kv_grads", "KVGradSum"]


def uniform_group(hq: int, hkv: int, kv_map: Sequence[int]) -> bool:
    """True when query head ``i`` uses KV head ``i // (hq // hkv)`` (plain GQA)."""
    if hq % hkv:
        return False
    g = hq // hkv
    return all(j == i // g for i, j in enumerate(kv_map))


def kv_index(kv_map: Sequence[int], device: torch.device) -> torch.Tensor:
    """``kv_map`` as an int64 index tensor on ``device``, read-only.

    On a GPU the tensor is kept on the device per ``(kv_map, device)`` (a bounded cache of a
    few bytes each, keyed by values, not by a group): the first call for a map copies it
    once, and every later call reuses it with no copy, no host sync and nothing a CUDA graph
    capture would refuse (a per-call copy from pageable host memory cannot be captured, and
    a blocking one would make the host wait for the queued GPU work). As with the Triton
    tables, run a layout once before capturing it. Elsewhere, and inside ``torch.compile``,
    a fresh tensor."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return torch.tensor(list(kv_map), dtype=torch.int64, device=device)
    return _device_index(tuple(int(i) for i in kv_map), device)


@functools.lru_cache(maxsize=256)
def _device_index(kv_map: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # A blocking copy, once per (map, device): the tensor is complete before any stream
    # reads it, whichever stream that is.
    return torch.tensor(kv_map, dtype=torch.int64, device=device)


def expand_kv(k: torch.Tensor, v: torch.Tensor, kv_map: Sequence[int], *, always: bool = False):
    """k, v as plain grouped heads for ``kv_map``.

    A rank whose query heads straddle a KV group boundary unevenly (for example 3 query
    heads, 2 from one group and 1 from the next) cannot use a uniform GQA kernel; its KV
    heads are gathered to one per query head here, locally, after the wire. ``always``
    gathers even a uniform map (the chunked pipeline, whose chunk of a non-uniform rank
    may be uniform, must run the same kernels as the unchunked op).
    """
    if not always and uniform_group(len(kv_map), k.shape[2], kv_map):
        return k, v
    return gather_kv(k, v, kv_index(kv_map, k.device))


def gather_kv(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor):
    """KV heads ``index`` (one per local query head) of ``k``, ``v`` ``[B, S, hkv, D]``."""
    return k.index_select(2, index), v.index_select(2, index)


def scatter_kv_grads(dk: torch.Tensor, dv: torch.Tensor, kv_map: Sequence[int], hkv: int):
    """The backward of ``gather_kv`` with ``kv_index(kv_map)``: per-query-head ``dk``, ``dv``
    ``[B, S, hq, D]`` summed into ``[B, S, hkv, D]``, as autograd's ``index_select``
    backward does (zeros, then ``index_add_`` in query-head order)."""
    index = kv_index(kv_map, dk.device)
    shape = (dk.shape[0], dk.shape[1], hkv, dk.shape[3])
    return dk.new_zeros(shape).index_add_(2, index, dk), dv.new_zeros(shape).index_add_(2, index, dv)


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



def shares_one_kv(kv_map: Sequence[int]) -> bool:
    """True when several local query heads use the rank's only local KV head."""
    return len(kv_map) > 1 and not any(kv_map)

