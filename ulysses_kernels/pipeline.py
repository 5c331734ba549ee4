"""Chunked Ulysses attention: the all-to-alls of one head chunk overlap attention on another.

Each rank's heads are split into ``n`` chunks; chunk ``c`` is a ``HeadPlan`` whose per-rank
ranges are sub-ranges of the full plan's (``chunk_plans``), so the layout math of
``ulysses_kernels.layout`` and every kernel set apply to a chunk unchanged (global head
indices; a rank may hold no head of a chunk). Schedule of the forward (every rank issues
the collectives in the same order)::

    s2h(0)
    for c in 0..n-1:   wait s2h(c); start s2h(c+1); attention(c); start h2s(c); finish h2s(c-1)
    finish h2s(n-1)

The backward does the same with dout (s2h) and dq/dk/dv (h2s, one collective per tensor;
the dk/dv ones are skipped for a chunk in which no rank sends a KV gradient).
"Start" runs the collective asynchronously: on CUDA on a side stream ordered by events
(the buffers are ``record_stream``-ed on it, so the caching allocator cannot hand them out
while the collective may still touch them; no host sync); elsewhere with
``async_op=True`` work handles, whose buffers are referenced until ``wait()``.
NOTE: an exception between two starts (an OOM in attention, a failed input check) leaves
this rank's later collectives unposted while its peers post theirs: the peers hang until
the process group's timeout. The op does not try to recover; let the job fail.

Bit-identity with ``chunks=1``. A rank with several local KV groups is chunked on group
boundaries: every local KV head (and its gradient) belongs to one chunk and the backend
sees whole groups. A rank whose query heads all share its one KV head (Llama-3-8B and
Qwen2.5-14B at sp 8, Llama-3-8B at sp 16, MQA) is chunked by query heads instead: its KV
head travels with its first chunk forward and with its last chunk backward, and both this
op and the unchunked one run ``backends.SharedKV`` on it, which sums the KV gradient over
query heads one head at a time in head order (``KVGradSum``), so the chunks add the same
numbers in the same order. Only backends built on ``AttentionBackend`` can be wrapped so;
with other backend objects such ranks keep one chunk. A KV head that several ranks hold
gets its gradient summed in rank order once all chunks have arrived, exactly as the
unchunked unpack does. Bit-identity also needs the backend to compute each head
independently of the others present: true of flash-attn, and of SDPA on the CPU with one
intra-op thread (``torch.set_num_threads(1)``, as the tests run ranks; with several
threads CPU SDPA's result for a head can change by an ulp with the heads computed beside
it); not of the ``"math"`` backend, whose einsum picks shape-dependent BLAS kernels.

``chunks="auto"`` uses ``choose_chunks``: a cost model from globally agreed numbers only
(layout sizes, dtype, env vars), so every rank picks the same count.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .backends import AttentionBackend, KVGradSum, shares_one_kv, uniform_group
from .comm import AsyncChannel
from .exchange import head_to_seq_blocks, post_head_to_seq, post_seq_to_head
from .layout import Q_ONLY, QKV, Layout
from .plan import HeadPlan

__all__ = ["chunk_plans", "choose_chunks", "chunked_attention", "ChunkedAttentionFunction", "CostModel"]

_MAX_CHUNKS = 8


# ---- chunking the plan --------------------------------------------------------------------
def _rank_groups(plan: HeadPlan, rank: int) -> list[tuple[int, int, int]]:
    """Local KV groups of ``rank``: ``(kv_head, q_start, q_end)`` with global indices."""
    g = plan.group_size
    q0, q1 = plan.q_ranges[rank]
    out = []
    for kv in range(*plan.kv_ranges[rank]):
        a, b = max(q0, kv * g), min(q1, (kv + 1) * g)
        out.append((kv, a, b))
    return out


def _split_groups(groups, k: int) -> list[list]:
    """``k`` contiguous runs of ``groups``, balanced by query heads."""
    cum = [0]
    for _, a, b in groups:
        cum.append(cum[-1] + b - a)
    edges, prev = [0], 0
    for c in range(1, k):
        target = cum[-1] * c / k
        lo, hi = prev + 1, len(groups) - (k - c)
        best = min(range(lo, hi + 1), key=lambda e: (abs(cum[e] - target), e))
        edges.append(best)
        prev = best
    edges.append(len(groups))
    return [groups[edges[i] : edges[i + 1]] for i in range(k)]


def splits_shared_kv(plan: HeadPlan, rank: int) -> bool:
    """True when ``rank``'s query heads all use its one KV head (``backends.shares_one_kv``,
    the test ``for_rank`` applies): its chunks split that group's query heads."""
    return shares_one_kv(plan.local_kv_map(rank))


def _rank_parts(plan: HeadPlan, rank: int, chunks: int, split_groups: bool, kv_last: bool):
    """``rank``'s chunks as ``(q_range, kv_range)`` pairs, global indices."""
    if split_groups and splits_shared_kv(plan, rank):
        (kv, a, b), k = _rank_groups(plan, rank)[0], min(chunks, plan.q_count(rank))
        edges = [a + (b - a) * i // k for i in range(k + 1)]
        # The KV head travels once: with the first chunk's queries (forward), with the
        # last chunk's query gradients (backward: its gradient is complete only then).
        owner = k - 1 if kv_last else 0
        return [((edges[i], edges[i + 1]), (kv, kv + 1) if i == owner else (kv, kv)) for i in range(k)]
    groups = _rank_groups(plan, rank)
    parts = _split_groups(groups, min(chunks, len(groups)))
    return [((p[0][1], p[-1][2]), (p[0][0], p[-1][0] + 1)) for p in parts]


@functools.lru_cache(maxsize=128)
def chunk_plans(plan: HeadPlan, chunks: int, *, split_groups: bool = True, kv_last: bool = False) -> tuple[HeadPlan, ...]:
    """Split every rank's heads into at most ``chunks`` chunks.

    A rank with several local KV groups is split on group boundaries into
    ``min(chunks, kv_count(r))`` chunks (each chunk holds its groups' KV heads). A rank
    whose query heads share its one KV head (``splits_shared_kv``; Llama-3-8B or
    Qwen2.5-14B at sp 8, MQA) is split into ``min(chunks, q_count(r))`` chunks of query
    heads when ``split_groups`` (the backend is an ``AttentionBackend``, so ``SharedKV``
    can sum the KV gradient across chunks); its KV head is in the first chunk's ranges, or
    in the last one's with ``kv_last`` (the backward's dk/dv), and empty elsewhere.
    A rank uses its first chunks; later ones give it empty ranges. Returns one ``HeadPlan``
    per chunk (``q_heads``/``kv_heads`` stay the global counts, ranges are sub-ranges); a
    single plan equal in ranges to ``plan`` when no rank can be split.
    """
    if chunks < 1:
        raise ValueError(f"chunk_plans: chunks must be >= 1, got {chunks}")
    per_rank = [_rank_parts(plan, r, chunks, split_groups, kv_last) for r in range(plan.world_size)]
    n = max(len(parts) for parts in per_rank)
    out = []
    for c in range(n):
        q_ranges, kv_ranges = [], []
        for r, parts in enumerate(per_rank):
            if c < len(parts):
                q_ranges.append(parts[c][0])
                kv_ranges.append(parts[c][1])
            else:
                # Empty, placed at the range start: harmless to the unpack's replica walk.
                q_ranges.append((plan.q_ranges[r][0],) * 2)
                kv_ranges.append((plan.kv_ranges[r][0],) * 2)
        out.append(HeadPlan(plan.q_heads, plan.kv_heads, plan.world_size, tuple(q_ranges), tuple(kv_ranges)))
    return tuple(out)


# ---- the cost model ---------------------------------------------------------------------
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
        lay = Layout(plan, r, layout.seq_lens, layout.batch, layout.head_dim)
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


def estimate_seconds(layout: Layout, n: int, itemsize: int, causal: bool, model: CostModel, split_groups: bool = True) -> float:
    """Modelled forward + backward time of the layer with ``n`` chunks (per chunk: the
    bytes its exchanges move and every rank's attention)."""
    plan, S = layout.plan, layout.seq_total
    fwd_plans = chunk_plans(plan, n, split_groups=split_groups)
    bwd_plans = chunk_plans(plan, n, split_groups=split_groups, kv_last=True)
    lat = model.latency_us * 1e-6
    per_head = 4.0 * layout.batch * S * S * layout.head_dim * (0.5 if causal else 1.0) / (model.attn_tflops * 1e12)
    compute = [[per_head * cp.q_count(r) for r in range(plan.world_size)] for cp in fwd_plans]
    qkv_in = [lat + _a2a_seconds(layout, cp, QKV, itemsize, model) for cp in fwd_plans]
    q_only = [lat + _a2a_seconds(layout, cp, Q_ONLY, itemsize, model) for cp in fwd_plans]
    grads_out = [
        (3 if any(gp.kv_count(r) for r in range(plan.world_size)) else 1) * lat + _a2a_seconds(layout, gp, QKV, itemsize, model)
        for gp in bwd_plans
    ]
    fwd = _pipeline_seconds(qkv_in, compute, q_only, model)
    bwd = _pipeline_seconds(q_only, [[2.5 * x for x in row] for row in compute], grads_out, model)
    return fwd + bwd


def choose_chunks(
    layout: Layout, itemsize: int, causal: bool, device_type: str, model: CostModel | None = None, split_groups: bool = True
) -> int:
    """The chunk count ``chunks="auto"`` uses: the modelled best among 1..8 (capped by
    what the plan can split), or 1 when chunking gains less than ``min_gain``."""
    return _choose_chunks(layout, itemsize, causal, model or CostModel.from_env(device_type), split_groups)


@functools.lru_cache(maxsize=256)
def _choose_chunks(layout: Layout, itemsize: int, causal: bool, model: CostModel, split_groups: bool) -> int:
    if layout.world_size == 1:
        return 1
    most = len(chunk_plans(layout.plan, _MAX_CHUNKS, split_groups=split_groups))
    base = estimate_seconds(layout, 1, itemsize, causal, model, split_groups)
    best_n, best_t = 1, base
    for n in range(2, most + 1):
        t = estimate_seconds(layout, n, itemsize, causal, model, split_groups)
        if t < best_t:
            best_n, best_t = n, t
    return best_n if best_t < base * (1.0 - model.min_gain) else 1


# ---- the chunk schedule (per layout and count; pure data) -----------------------------------
@dataclass(frozen=True)
class _Chunk:
    layout: Layout  # the chunk's plan, this rank: q/k/v in, output out, dout in
    grad: Layout  # the chunk's backward plan: dq/dk/dv out (a shared KV head's with its last chunk)
    kv_map: tuple[int, ...]  # local query head -> local KV head, within the chunk
    expand: tuple[int, ...] | None  # index_select of KV heads done here (see _attend)
    shared: bool  # this rank runs SharedKV on the chunk, with the KV head of its first chunk
    grad_kv: bool  # some rank sends dk/dv in this chunk (else those exchanges are skipped)
    unpack: Layout  # for dq/dk/dv: replicated KV heads trimmed from every rank's range
    trim: tuple[tuple[int, int], ...]  # per source: KV heads [lo, hi) of its block unpacked here


@dataclass(frozen=True)
class _Schedule:
    chunks: tuple[_Chunk, ...]
    replicas: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]  # (kv head, ((rank, chunk, index in block), ...))
    replica_blocks: frozenset[tuple[int, int]]  # (chunk, source) of the dk/dv blocks the replica sums read


@functools.lru_cache(maxsize=64)
def _schedule(layout: Layout, n: int, split_groups: bool) -> _Schedule:
    plan, rank = layout.plan, layout.rank
    plans = chunk_plans(plan, n, split_groups=split_groups)
    grad_plans = chunk_plans(plan, n, split_groups=split_groups, kv_last=True)
    replicated = {h for h in range(plan.kv_heads) if len(plan.kv_holders(h)) > 1}
    full_map = plan.local_kv_map(rank)
    full_uniform = uniform_group(len(full_map), plan.kv_count(rank), full_map)
    shared = split_groups and splits_shared_kv(plan, rank)

    def lay(p: HeadPlan) -> Layout:
        return Layout(p, rank, layout.seq_lens, layout.batch, layout.head_dim)

    chunks, where = [], {}
    for c, (cp, gp) in enumerate(zip(plans, grad_plans)):
        # A shared KV head's chunks without it map their query heads to index 0 all the same:
        # their empty KV range starts at that head.
        kv_map = cp.local_kv_map(rank)
        # The unchunked backend gathers KV heads per query head when the rank's map is not
        # uniform; a chunk's map may be uniform, so gather here to run the same kernels.
        expand = None if full_uniform or not kv_map else kv_map
        trim, trimmed = [], []
        for p in range(plan.world_size):
            a, b = gp.kv_ranges[p]
            lo, hi = a, b
            while lo < hi and lo in replicated:
                lo += 1
            while hi > lo and (hi - 1) in replicated:
                hi -= 1
            trim.append((lo - a, hi - a))
            trimmed.append((lo, hi))
            for h in range(a, b):
                if h in replicated:
                    where[(h, p)] = (c, h - a)
        unpack_plan = HeadPlan(plan.q_heads, plan.kv_heads, plan.world_size, gp.q_ranges, tuple(trimmed))
        grad_kv = any(gp.kv_count(p) for p in range(plan.world_size))
        chunks.append(_Chunk(lay(cp), lay(gp), kv_map, expand, shared, grad_kv, lay(unpack_plan), tuple(trim)))
    replicas = tuple(
        (h, tuple((p, *where[(h, p)]) for p in plan.kv_holders(h))) for h in sorted(replicated)
    )
    blocks = frozenset((c, p) for _, holders in replicas for p, c, _ in holders)
    return _Schedule(tuple(chunks), replicas, blocks)


# ---- the pieces of one chunk --------------------------------------------------------------
def _start_s2h(chan: AsyncChannel, lay: Layout, tensors, roles, kernels):
    """Pack and start one seq->head exchange. Returns (pending, receive buffer)."""
    return post_seq_to_head(lay, tensors, roles, chan.comm, kernels, chan.start)


def _start_h2s(chan: AsyncChannel, lay: Layout, local: torch.Tensor, role: str, kernels):
    """Start one head->seq exchange of a local ``[B, S, h, D]`` tensor (``role``'s heads).
    Returns (pending, receive buffer, wire tensor)."""
    pending, recv, wire = post_head_to_seq(lay, [local], (role,), chan.comm, kernels, chan.start)
    return pending, recv, wire[0]


def _h2s_blocks(lay: Layout, recv, local, role: str):
    """Per source: the received ``[B, s_r, h, D]`` block (our own read from ``local``)."""
    return [per[0] for per in head_to_seq_blocks(lay, recv, [local], (role,))]


def _attend(backend, chunk: _Chunk, q, k, v, causal, scale, needs_grad):
    if chunk.shared:  # backend is SharedKV; its state goes to backward_per_head as is
        return backend.forward(q, k, v, causal=causal, scale=scale, kv_map=chunk.kv_map, needs_grad=needs_grad)
    # Only backends built on AttentionBackend gather KV heads the known way (expand_kv).
    if chunk.expand is None or not isinstance(backend, AttentionBackend):
        out, state = backend.forward(q, k, v, causal=causal, scale=scale, kv_map=chunk.kv_map, needs_grad=needs_grad)
        return out, (state, None)
    # From pageable memory with non_blocking: no stream sync (torch.tensor(..., device=cuda)
    # would block the host until the queued attention ran, losing the overlap).
    index = torch.tensor(chunk.expand).to(k.device, non_blocking=True)
    k2, v2 = k.index_select(2, index), v.index_select(2, index)
    ident = tuple(range(q.shape[2]))
    out, state = backend.forward(q, k2, v2, causal=causal, scale=scale, kv_map=ident, needs_grad=needs_grad)
    return out, (state, (index, k.shape[2]))


def _attend_backward(backend, saved, dout):
    state, expanded = saved
    dq, dk, dv = backend.backward(state, dout)
    if expanded is not None:
        # As autograd's index_select backward: zeros, then index_add_ in query-head order.
        index, hkv = expanded
        shape = (dk.shape[0], dk.shape[1], hkv, dk.shape[3])
        dk = dk.new_zeros(shape).index_add_(2, index, dk)
        dv = dv.new_zeros(shape).index_add_(2, index, dv)
    return dq, dk, dv


# ---- the autograd function -----------------------------------------------------------------
class ChunkedAttentionFunction(torch.autograd.Function):
    """``UlyssesAttentionFunction`` with the all-to-alls of head chunks overlapping attention."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        needs_grad = any(ctx.needs_input_grad[:3])
        layout, comm, kernels, backend = call.layout, call.comm, call.kernels, call.backend
        causal, scale = call.causal, call.scale
        # backends.for_rank made this rank's backend SharedKV exactly when its chunks split
        # a shared KV head's query heads (the schedule's `shared`).
        sched = _schedule(layout, call.chunks, call.split_groups)
        chan = AsyncChannel(comm, q.device)
        B, D = layout.batch, layout.head_dim
        out = q.new_empty(B, layout.seq_local, layout.plan.q_heads, D)
        states = []
        shared_kv = None  # a shared KV head: (k, v) views of the first chunk's receive buffer
        pending_in = _start_s2h(chan, sched.chunks[0].layout, (q, k, v), QKV, kernels)
        pending_out = None
        for c, chunk in enumerate(sched.chunks):
            work, recv = pending_in
            work.wait()
            if c + 1 < len(sched.chunks):
                pending_in = _start_s2h(chan, sched.chunks[c + 1].layout, (q, k, v), QKV, kernels)
            q_c, k_c, v_c = chunk.layout.s2h_recv_views(recv, QKV)
            del recv
            if chunk.shared:
                if k_c.shape[2]:
                    shared_kv = (k_c, v_c)
                k_c, v_c = shared_kv
            if q_c.shape[2]:
                out_c, saved = _attend(backend, chunk, q_c, k_c, v_c, causal, scale, needs_grad)
            else:
                out_c, saved = q_c, None  # no head of this chunk here: an empty [B, S, 0, D]
            del q_c, k_c, v_c
            states.append(saved)
            started = (_start_h2s(chan, chunk.layout, out_c, "q", kernels), chunk)
            del out_c
            if pending_out is not None:
                _finish_out(pending_out, out, kernels)
            pending_out = started
        _finish_out(pending_out, out, kernels)
        ctx.call = call
        ctx.states = states
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        call = ctx.call
        layout, comm, kernels, backend = call.layout, call.comm, call.kernels, call.backend
        sched = _schedule(layout, call.chunks, call.split_groups)
        chan = AsyncChannel(comm, dout.device)
        B, D, plan, rank = layout.batch, layout.head_dim, layout.plan, layout.rank
        dq = dout.new_empty(B, layout.seq_local, plan.q_heads, D)
        dk = dout.new_empty(B, layout.seq_local, plan.kv_heads, D)
        dv = dout.new_empty(B, layout.seq_local, plan.kv_heads, D)
        kv_blocks = {}  # (chunk, source) -> (dk block, dv block) for the replica sums
        kv_sum = KVGradSum()  # a shared KV head's gradient, summed over the chunks' query heads
        pending_in = _start_s2h(chan, sched.chunks[0].layout, (dout,), Q_ONLY, kernels)
        pending_out = None
        for c, chunk in enumerate(sched.chunks):
            work, recv = pending_in
            work.wait()
            if c + 1 < len(sched.chunks):
                pending_in = _start_s2h(chan, sched.chunks[c + 1].layout, (dout,), Q_ONLY, kernels)
            (dout_c,) = chunk.layout.s2h_recv_views(recv, Q_ONLY)
            del recv
            saved = ctx.states[c]
            ctx.states[c] = None
            hkv = chunk.grad.head_count("kv", rank)
            if saved is None:
                empty = dout_c.new_empty(B, layout.seq_total, hkv, D)
                grads = (dout_c, empty, empty)
            elif chunk.shared:
                dq_c, dk_c, dv_c = backend.backward_per_head(saved, dout_c)
                kv_sum.add(dk_c, dv_c)
                del dk_c, dv_c
                if hkv:  # the rank's last chunk: the sum is complete
                    grads = (dq_c, *kv_sum.result())
                else:
                    empty = dq_c.new_empty(B, layout.seq_total, 0, D)
                    grads = (dq_c, empty, empty)
            else:
                grads = _attend_backward(backend, saved, dout_c)
            del dout_c, saved
            roles = QKV if chunk.grad_kv else Q_ONLY
            started = ([_start_h2s(chan, chunk.grad, g, st, kernels) for g, st in zip(grads, roles)], c)
            del grads
            if pending_out is not None:
                _finish_grads(pending_out, sched, (dq, dk, dv), kv_blocks, kernels)
            pending_out = started
        _finish_grads(pending_out, sched, (dq, dk, dv), kv_blocks, kernels)
        _sum_replicas(layout, sched, (dk, dv), kv_blocks, kernels)
        ctx.states = None
        return dq, dk, dv, None


def _finish_out(pending, out, kernels) -> None:
    (work, recv, local), chunk = pending
    work.wait()
    blocks = [[x] for x in _h2s_blocks(chunk.layout, recv, local, "q")]
    kernels.unpack_h2s(chunk.layout, blocks, Q_ONLY, [out])


def _finish_grads(pending, sched: _Schedule, outs, kv_blocks, kernels) -> None:
    started, c = pending
    chunk = sched.chunks[c]
    per_role = []
    for (work, recv, local), st in zip(started, QKV):
        work.wait()
        per_role.append(_h2s_blocks(chunk.grad, recv, local, st))
    if not chunk.grad_kv:  # query-head gradients only
        kernels.unpack_h2s(chunk.unpack, [[b] for b in per_role[0]], Q_ONLY, [outs[0]])
        return
    world = chunk.grad.world_size
    blocks = []
    for p in range(world):
        lo, hi = chunk.trim[p]
        dq_b, dk_b, dv_b = (per_role[i][p] for i in range(3))
        blocks.append([dq_b, dk_b[:, :, lo:hi], dv_b[:, :, lo:hi]])
        if (c, p) in sched.replica_blocks:  # held for _sum_replicas; other blocks go now
            kv_blocks[(c, p)] = (dk_b, dv_b)
    kernels.unpack_h2s(chunk.unpack, blocks, QKV, list(outs))


def _sum_replicas(layout: Layout, sched: _Schedule, outs, kv_blocks, kernels) -> None:
    """KV heads several ranks hold: first holder copied, the others added, in rank order
    (the unchunked unpack's order), one unpack per such head."""
    plan = layout.plan
    for h, holders in sched.replicas:
        ranges = [(h, h)] * plan.world_size
        like = kv_blocks[(holders[0][1], holders[0][0])][0]
        empty = like[:, :, :0]
        blocks = [[empty, empty] for _ in range(plan.world_size)]
        for p, c, idx in holders:
            ranges[p] = (h, h + 1)
            dk_b, dv_b = kv_blocks[(c, p)]
            blocks[p] = [dk_b[:, :, idx : idx + 1], dv_b[:, :, idx : idx + 1]]
        rep = HeadPlan(plan.q_heads, plan.kv_heads, plan.world_size, plan.q_ranges, tuple(ranges))
        lay = Layout(rep, layout.rank, layout.seq_lens, layout.batch, layout.head_dim)
        kernels.unpack_h2s(lay, blocks, ("kv", "kv"), list(outs))


def chunked_attention(q, k, v, call):
    """Ulysses attention with head chunks overlapping the all-to-alls (see module docstring).

    ``q`` ``[B, s_r, Hq, D]``, ``k``/``v`` ``[B, s_r, Hkv, D]`` as for ``ulysses_attention``;
    ``call``: its ``CallSetup``, with ``call.chunks`` (> 1) resolved. Returns ``[B, s_r, Hq, D]``.
    """
    return ChunkedAttentionFunction.apply(q, k, v, call)
