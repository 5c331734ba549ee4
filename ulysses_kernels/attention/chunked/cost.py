"""The cost model behind ``chunks="auto"``: per chunk count, the modelled forward +
backward time of the layer from globally agreed numbers only (layout sizes, dtype,
environment variables), so every rank picks the same count."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from ...layout import OUT, QKV, Layout
from ...plan import HeadPlan
from .chunking import chunk_plans

__all__ = ["MAX_CHUNKS", "CostModel", "estimate_seconds", "choose_chunks"]

MAX_CHUNKS = 8


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not a number") from exc


@dataclass(frozen=True)
class CostModel:
    """Numbers behind ``chunks="auto"`` (the same on every rank: env vars, not timings).

    link_gbps: all-to-all bandwidth per rank, GB/s (``ULYSSES_KERNELS_LINK_GBPS``; default
        150 on CUDA, an NVLink-class node; 1 elsewhere, gloo over loopback).
    attn_tflops: attention throughput, TFLOP/s (``ULYSSES_KERNELS_ATTN_TFLOPS``; default 300
        on CUDA, flash-attn bf16 on an H100; 0.05 elsewhere).
    latency_us: fixed cost per collective (``ULYSSES_KERNELS_LINK_LATENCY_US``; 25 / 300).
    overlap_slowdown: fraction by which attention slows while a collective runs beside it
        (``ULYSSES_KERNELS_OVERLAP_SLOWDOWN``; 0.15 on CUDA where NCCL kernels take SMs and
        memory bandwidth; 0.5 on the CPU where they share cores).
    min_gain: relative gain below which one chunk is kept (``ULYSSES_KERNELS_MIN_GAIN``; 0.03).
    """

    link_gbps: float
    attn_tflops: float
    latency_us: float
    overlap_slowdown: float
    min_gain: float

    @classmethod
    def from_env(cls, device_type: str) -> CostModel:
        cuda = device_type == "cuda"
        return cls(
            link_gbps=_env_float("ULYSSES_KERNELS_LINK_GBPS", 150.0 if cuda else 1.0),
            attn_tflops=_env_float("ULYSSES_KERNELS_ATTN_TFLOPS", 300.0 if cuda else 0.05),
            latency_us=_env_float("ULYSSES_KERNELS_LINK_LATENCY_US", 25.0 if cuda else 300.0),
            overlap_slowdown=_env_float("ULYSSES_KERNELS_OVERLAP_SLOWDOWN", 0.15 if cuda else 0.5),
            min_gain=_env_float("ULYSSES_KERNELS_MIN_GAIN", 0.03),
        )


def _a2a_seconds(layout: Layout, plan: HeadPlan, roles, itemsize: int, model: CostModel) -> float:
    """Time of one seq->head all-to-all of ``roles`` under ``plan`` (head->seq moves the
    same bytes back): the busiest rank's off-rank bytes over the link bandwidth."""
    worst = 0
    for r in range(plan.world_size):
        lay = Layout(plan, r, layout.seq_lens, layout.batch, layout.head_dim, layout.v_head_dim)
        send = lay.s2h_send_splits(roles)
        recv = lay.s2h_recv_splits(roles)
        off = max(sum(send) - send[r], sum(recv) - recv[r])
        worst = max(worst, off * itemsize)
    return worst / (model.link_gbps * 1e9)


def _pipeline_seconds(c_in, compute, c_out, model: CostModel) -> float:
    """One pass, simulated as every rank runs it: rank r at chunk i waits for exchange
    in(i), posts in(i+1), computes ``compute[i][r]``, posts out(i), waits for out(i-1).
    The exchanges run one at a time on the communication role, in posting order, each
    once every rank has posted it (``c_in[i]``, ``c_out[i]``: durations, latency included).
    Ranks that finish a chunk early wait at the exchanges, so imbalance between the ranks'
    chunks costs time here as it does on the machine. Attention slows by
    ``overlap_slowdown`` only for as long as an exchange runs beside it (at most the
    exchanges in(i+1) and out(i-1))."""
    n, world = len(compute), len(compute[0])
    t = [0.0] * world
    done_in = [0.0] * n
    done_out = [0.0] * n
    done_in[0] = link = c_in[0]
    for i in range(n):
        t = [max(x, done_in[i]) for x in t]
        if i + 1 < n:
            done_in[i + 1] = link = max(link, max(t)) + c_in[i + 1]
        beside = (c_in[i + 1] if i + 1 < n else 0.0) + (c_out[i - 1] if i > 0 else 0.0)
        t = [x + c + model.overlap_slowdown * min(c, beside) for x, c in zip(t, compute[i])]
        done_out[i] = link = max(link, max(t)) + c_out[i]
        if i > 0:
            t = [max(x, done_out[i - 1]) for x in t]
    return max(max(t), done_out[n - 1])


def estimate_seconds(layout: Layout, n: int, itemsize: int, causal: bool, model: CostModel, split_kv_groups: bool = True) -> float:
    """Modelled forward + backward time of the layer with ``n`` chunks (per chunk: the
    bytes its exchanges move and every rank's attention)."""
    plan, S = layout.plan, layout.seq_total
    fwd_plans = chunk_plans(plan, n, split_kv_groups=split_kv_groups)
    bwd_plans = chunk_plans(plan, n, split_kv_groups=split_kv_groups, kv_last=True)
    lat = model.latency_us * 1e-6
    # 2 S^2 D flops for the scores, 2 S^2 Dv for the values (4 S^2 D without MLA).
    per_head = 2.0 * layout.batch * S * S * (layout.head_dim + layout.v_head_dim) * (0.5 if causal else 1.0) / (model.attn_tflops * 1e12)
    compute = [[per_head * cp.q_count(r) for r in range(plan.world_size)] for cp in fwd_plans]
    qkv_in = [lat + _a2a_seconds(layout, cp, QKV, itemsize, model) for cp in fwd_plans]
    q_only = [lat + _a2a_seconds(layout, cp, OUT, itemsize, model) for cp in fwd_plans]  # the output, dout
    grads_out = [(3 if any(gp.kv_count(r) for r in range(plan.world_size)) else 1) * lat + _a2a_seconds(layout, gp, QKV, itemsize, model) for gp in bwd_plans]
    fwd = _pipeline_seconds(qkv_in, compute, q_only, model)
    bwd = _pipeline_seconds(q_only, [[2.5 * x for x in row] for row in compute], grads_out, model)
    return fwd + bwd


def choose_chunks(layout: Layout, itemsize: int, causal: bool, device_type: str, model: CostModel | None = None, split_kv_groups: bool = True) -> int:
    """The chunk count ``chunks="auto"`` uses: the modelled best among 1..8 (capped by
    what the plan can split), or 1 when chunking gains less than ``min_gain``."""
    return _choose_chunks(layout, itemsize, causal, model or CostModel.from_env(device_type), split_kv_groups)


@functools.lru_cache(maxsize=256)
def _choose_chunks(layout: Layout, itemsize: int, causal: bool, model: CostModel, split_kv_groups: bool) -> int:
    if layout.world_size == 1:
        return 1
    most = len(chunk_plans(layout.plan, MAX_CHUNKS, split_kv_groups=split_kv_groups))
    base = estimate_seconds(layout, 1, itemsize, causal, model, split_kv_groups)
    best_n, best_t = 1, base
    for n in range(2, most + 1):
        t = estimate_seconds(layout, n, itemsize, causal, model, split_kv_groups)
        if t < best_t:
            best_n, best_t = n, t
    return best_n if best_t < base * (1.0 - model.min_gain) else 1
