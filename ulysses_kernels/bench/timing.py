"""How the benchmarks time, reduce over ranks and compare two rows.

On CUDA: events around each iteration after a barrier, median over iterations, then the
maximum of the per-rank medians (the slowest rank sets the pace of a collective). On the
CPU: ``time.perf_counter`` the same way; those numbers are labelled ``record.CPU_LABEL``
everywhere they are printed or written.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .record import CPU_LABEL

__all__ = [
    "time_iters",
    "median",
    "spread",
    "floor_flag",
    "speedup_text",
    "reduce_max",
    "reduce_min",
    "reduce_sum",
    "all_ok",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_iters(
    fn: Callable,
    *,
    device: torch.device,
    warmup: int,
    iters: int,
    setup: Callable | None = None,
    barrier: bool = True,
) -> list[float]:
    """Seconds per iteration of ``fn`` on this rank (one value per timed iteration).

    Each iteration: ``state = setup()`` if given (untimed), a barrier over the world
    (so that no rank starts early and times its peers' lateness), then ``fn(state)``
    (or ``fn()``) between two CUDA events (GPU) or two ``perf_counter`` reads (CPU).
    """
    use_events = device.type == "cuda"
    times = []
    for i in range(warmup + iters):
        state = setup() if setup is not None else None
        _sync(device)
        if barrier and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
            _sync(device)
        if use_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(state) if setup is not None else fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn(state) if setup is not None else fn()
            elapsed = time.perf_counter() - t0
        del state
        if i >= warmup:
            times.append(elapsed)
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def spread(times: Sequence[float], scale: float, unit: str) -> dict:
    """The spread of one rank's iteration times (seconds) as row fields in ``unit`` (``"us"``,
    ``"ms"``; ``scale`` converts): ``time_q1_<unit>``/``time_q3_<unit>`` (quartiles) and
    ``time_min_<unit>``/``time_max_<unit>``, each the largest over the ranks, as the row's
    median is (the slowest rank sets the pace). Collective: one all-reduce.

    NOTE: on the shared 2-core CPU the demo's summary said "13.5x faster than the chain" in one
    run and "2.7x" in the next (issue #41): a ratio of two medians of 9 iterations means little
    without their spread."""
    if not times:
        return {f"time_{k}_{unit}": None for k in ("q1", "q3", "min", "max")}
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
    vals = [q1, q3, min(times), max(times)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor(vals, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        vals = t.tolist()
    return {f"time_{k}_{unit}": v * scale for k, v in zip(("q1", "q3", "min", "max"), vals)}


def _quartiles(row: dict, key: str) -> tuple[float, float, float]:
    """(q1, median, q3) of a row's time ``key`` (``time_us``/``time_ms``); the median thrice
    for rows written without a spread."""
    unit = key.rsplit("_", 1)[1]
    mid = row[key]
    return row.get(f"time_q1_{unit}") or mid, mid, row.get(f"time_q3_{unit}") or mid


def floor_flag(row: dict, floor: dict | None, key: str, floor_name: str) -> str | None:
    """The flag for a row faster than its own floor (the same work minus ours: the bare
    all-to-all of the same bytes, attention with no communication), or None. Such a median
    is noise of the run (the machine, too few iterations), not a win, and is reported as that."""
    if floor is None or row[key] >= floor[key]:
        return None
    return f"FLAGGED: faster than its floor ({floor_name}: {floor[key]:.3g} {key.rsplit('_', 1)[1]}): timing noise, not a win"


def speedup_text(base: dict, ours: dict, key: str, base_name: str, *, cpu: bool, floor: dict | None = None, floor_name: str = "") -> str:
    """``ours`` against ``base`` (two result rows, time ``key``) for a person: the ratio of
    medians with its spread (the ratio between the quartiles: base's q1 over ours' q3 up to
    base's q3 over ours' q1), what the timing is (a CPU code-path check), and in place of a
    speed-up the flag when ``ours`` beat its own ``floor`` (or ``base`` did: then the ratio
    would measure noise too)."""
    label = f"; {CPU_LABEL}: a code-path check" if cpu else ""
    flag = floor_flag(ours, floor, key, floor_name)
    if flag:
        return flag + label
    if floor_flag(base, floor, key, floor_name):
        return f"no ratio: {base_name} ran faster than the floor ({floor_name}), so this run's times are noise" + label
    b1, b, b3 = _quartiles(base, key)
    o1, o, o3 = _quartiles(ours, key)
    ratio, lo, hi = b / o, b1 / o3, b3 / o1
    if ratio >= 1:
        text = f"{ratio:.1f}x faster than {base_name} (quartiles {lo:.1f}-{hi:.1f}x)"
    else:
        text = f"{1 / ratio:.1f}x slower than {base_name} (quartiles {1 / hi:.1f}-{1 / lo:.1f}x)"
    return text + label


# ---- reductions over the ranks --------------------------------------------------------
def _reduce(value: float, op) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(value)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float(value)], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=op)
    return float(t.item())


def reduce_max(value: float) -> float:
    """The maximum of ``value`` over all ranks (every rank gets it)."""
    return _reduce(value, dist.ReduceOp.MAX)


def reduce_min(value: float) -> float:
    return _reduce(value, dist.ReduceOp.MIN)


def reduce_sum(value: float) -> float:
    """The sum of ``value`` over all ranks."""
    return _reduce(value, dist.ReduceOp.SUM)


def all_ok(ok: bool) -> bool:
    """True when ``ok`` holds on every rank (so that all ranks take the same branch)."""
    return reduce_min(1.0 if ok else 0.0) > 0.5
