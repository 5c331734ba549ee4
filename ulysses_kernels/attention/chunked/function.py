"""The chunked autograd function: per chunk, start its exchanges, attend, finish the
previous chunk's exchanges (the schedule of the package docstring)."""

from __future__ import annotations

import torch

from ...backends import AttentionBackend, doc_kwargs
from ...checkpointing import one_recompute
from ...comm import AsyncChannel
from ...gqa import KVGather, KVGradSum
from ...layout import OUT, Q_ONLY, QKV, Layout
from ...plan import HeadPlan
from ..exchange import h2s_unpack, post_head_to_seq, post_seq_to_head, s2h_results, wire_of
from .schedule import Chunk, Schedule, build_schedule

__all__ = ["ChunkedAttentionFunction", "chunked_attention"]


def _start_s2h(chan: AsyncChannel, lay: Layout, tensors, roles, kernels, wire=None):
    """Pack and start one seq->head exchange (``wire``: its FP8 format, or None). Returns
    (pending, receive buffer)."""
    return post_seq_to_head(lay, tensors, roles, chan.comm, kernels, chan.start, wire=wire)


def _start_h2s(chan: AsyncChannel, lay: Layout, local: torch.Tensor, role: str, kernels, wire=None):
    """Start one head->seq exchange of a local ``[B, S, h, D]`` tensor (``role``'s heads).
    Returns (pending, blocks): per source, the ``[B, s_r, h, D]`` block to unpack once
    ``pending`` is waited (our own read from ``local``; with ``wire``, blocks of bytes
    ``[B, s_r, h, D + 4]``, ``ulysses_kernels.wire``)."""
    pending, blocks = post_head_to_seq(lay, [local], (role,), chan.comm, kernels, chan.start, wire=wire)
    return pending, [per[0] for per in blocks]


def _attend_chunk(backend, chunk: Chunk, q, k, v, causal, scale, needs_grad, docs):
    """One chunk's attention: ``(out, saved)`` for ``_attend_chunk_backward``. Chunks split
    heads, never the sequence: a packed sequence's ``docs`` go to every chunk unchanged."""
    kw = doc_kwargs(docs)
    if chunk.shared:  # backend is SharedKV; its state goes to backward_per_head as is
        return backend.forward(q, k, v, causal=causal, scale=scale, kv_map=chunk.kv_map, needs_grad=needs_grad, **kw)
    # Only backends built on AttentionBackend gather KV heads the known way (KVGather).
    if chunk.expand is None or not isinstance(backend, AttentionBackend):
        out, state = backend.forward(q, k, v, causal=causal, scale=scale, kv_map=chunk.kv_map, needs_grad=needs_grad, **kw)
        return out, (state, None)
    # The unchunked backend gathers this rank's map; a chunk's own map may be uniform, so the
    # chunk gathers here (always), and the backend sees plain heads.
    heads = KVGather.of(chunk.expand, k.shape[2], gather=True)
    if needs_grad:
        q = heads.own_q(q, k)
    k2, v2 = heads.gather(k, v)
    ident = tuple(range(q.shape[2]))
    out, state = backend.forward(q, k2, v2, causal=causal, scale=scale, kv_map=ident, needs_grad=needs_grad, **kw)
    return out, (state, heads)


def _attend_chunk_backward(backend, saved, dout):
    state, heads = saved
    dq, dk, dv = backend.backward(state, dout)
    if heads is not None:
        dk, dv = heads.scatter(dk, dv)
    return dq, dk, dv


# ---- the autograd function -----------------------------------------------------------------
class ChunkedAttentionFunction(torch.autograd.Function):
    """``interface.eager_attention`` with the all-to-alls of head chunks overlapping attention."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        needs_grad = any(ctx.needs_input_grad[:3])
        layout, comm, kernels, backend = call.layout, call.comm, call.kernels, call.backend
        causal, scale = call.causal, call.scale
        w_in, w_out = wire_of(call, "qkv"), wire_of(call, "out")
        # backends.for_rank made this rank's backend SharedKV exactly when its chunks split
        # a shared KV head's query heads (the schedule's `shared`).
        sched = build_schedule(layout, call.chunks, call.split_kv_groups)
        chan = AsyncChannel(comm, q.device)
        # The result is allocated at the first unpack, after the first chunk's attention
        # (not before it, where it would add to that peak).
        out = None
        states = []
        shared_kv = None  # a shared KV head: (k, v) views of the first chunk's receive buffer
        pending_in = _start_s2h(chan, sched.chunks[0].layout, (q, k, v), QKV, kernels, w_in)
        pending_out = None
        for c, chunk in enumerate(sched.chunks):
            work, recv = pending_in
            work.wait()
            if c + 1 < len(sched.chunks):
                pending_in = _start_s2h(chan, sched.chunks[c + 1].layout, (q, k, v), QKV, kernels, w_in)
            q_c, k_c, v_c = s2h_results(chunk.layout, recv, QKV, kernels, w_in, q)
            del recv
            if chunk.shared:
                if k_c.shape[2]:
                    shared_kv = (k_c, v_c)
                k_c, v_c = shared_kv
            if q_c.shape[2]:
                out_c, saved = _attend_chunk(backend, chunk, q_c, k_c, v_c, causal, scale, needs_grad, call.docs)
            else:
                # No head of this chunk here: an empty [B, S, 0, Dv] (the output's head dim).
                out_c, saved = q_c.new_empty(*q_c.shape[:3], layout.v_head_dim), None
            del q_c, k_c, v_c
            states.append(saved)
            started = (_start_h2s(chan, chunk.layout, out_c, "o", kernels, w_out), chunk)
            del out_c
            if pending_out is not None:
                out = _finish_out(pending_out, out, layout, kernels, w_out, q)
            pending_out = started
        out = _finish_out(pending_out, out, layout, kernels, w_out, q)
        ctx.call = call
        # The chunks' backend states: gradient edges and integers, no tensor (the receive
        # buffers and outputs live in the attention graphs' saved tensors, which
        # checkpointing and saved-tensor hooks see; docs/design.md).
        ctx.states = states
        # A 0-element marker, saved last: under activation checkpointing (non-reentrant) the
        # backward reads it before it posts any exchange, so the checkpoint's recompute (this
        # forward's collectives again) runs then, with nothing of ours in flight, on every
        # rank at the same point (otherwise the first chunk's attention backward would set it
        # off while the next chunk's dout exchange is posted: the ranks' collectives then
        # interleave, measured to hang on gloo at batch 2). Saved after the last exchange has
        # finished, it also keeps the checkpoint's early stop from cutting this forward short
        # with exchanges in flight.
        ctx.save_for_backward(q.new_empty(0))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        with one_recompute():
            (_marker,) = ctx.saved_tensors  # a pending checkpoint recompute runs here (see forward)
            return ChunkedAttentionFunction._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        call = ctx.call
        layout, comm, kernels, backend = call.layout, call.comm, call.kernels, call.backend
        sched = build_schedule(layout, call.chunks, call.split_kv_groups)
        chan = AsyncChannel(comm, dout.device)
        B, D, Dv, rank = layout.batch, layout.head_dim, layout.v_head_dim, layout.rank
        w_in, w_out = wire_of(call, "dout"), wire_of(call, "grads")
        # dq, dk, dv are allocated at the first unpack: by then the first chunk's attention
        # backward has run and freed its state.
        outs = None
        kv_blocks = {}  # (chunk, source) -> (dk block, dv block) for the replica sums
        kv_sum = KVGradSum()  # a shared KV head's gradient, summed over the chunks' query heads
        pending_in = _start_s2h(chan, sched.chunks[0].layout, (dout,), OUT, kernels, w_in)
        pending_out = None
        for c, chunk in enumerate(sched.chunks):
            work, recv = pending_in
            work.wait()
            if c + 1 < len(sched.chunks):
                pending_in = _start_s2h(chan, sched.chunks[c + 1].layout, (dout,), OUT, kernels, w_in)
            (dout_c,) = s2h_results(chunk.layout, recv, OUT, kernels, w_in, dout)
            del recv
            saved = ctx.states[c]
            ctx.states[c] = None
            hkv = chunk.grad.head_count("kv", rank)
            if saved is None:
                # No query head of this chunk here: dq is empty [B, S, 0, D] (dout_c has Dv).
                grads = (dout_c.new_empty(B, layout.seq_total, 0, D), dout_c.new_empty(B, layout.seq_total, hkv, D),
                         dout_c.new_empty(B, layout.seq_total, hkv, Dv))  # fmt: skip
            elif chunk.shared:
                dq_c, dk_c, dv_c = backend.backward_per_head(saved, dout_c)
                kv_sum.add(dk_c, dv_c)
                del dk_c, dv_c
                if hkv:  # the rank's last chunk: the sum is complete
                    grads = (dq_c, *kv_sum.result())
                else:
                    grads = (dq_c, dq_c.new_empty(B, layout.seq_total, 0, D), dq_c.new_empty(B, layout.seq_total, 0, Dv))
            else:
                grads = _attend_chunk_backward(backend, saved, dout_c)
            del dout_c, saved
            roles = QKV if chunk.grad_kv else Q_ONLY
            started = ([_start_h2s(chan, chunk.grad, g, st, kernels, w_out) for g, st in zip(grads, roles)], c)
            del grads
            if pending_out is not None:
                outs = _finish_grads(pending_out, sched, outs, kv_blocks, kernels, w_out, dout)
            pending_out = started
        dq, dk, dv = _finish_grads(pending_out, sched, outs, kv_blocks, kernels, w_out, dout)
        _sum_replicas(layout, sched, (dk, dv), kv_blocks, kernels, w_out)
        ctx.states = None
        return dq, dk, dv, None


def _new_results(layout: Layout, roles, like: torch.Tensor) -> list[torch.Tensor]:
    """The op's sequence-sharded results ``[B, s_r, H, D]`` (``D``: the role's head dim), one per role."""
    return [like.new_empty(layout.batch, layout.seq_local, layout.total_heads(s), layout.dim(s)) for s in roles]


def _finish_out(pending, out, layout: Layout, kernels, wire, like: torch.Tensor) -> torch.Tensor:
    """Wait for one chunk's output exchange and unpack it into ``out`` (allocated here the
    first time; ``wire``: the exchange's FP8 format, or None, and then in ``like``'s dtype). Returns ``out``."""
    (work, blocks), chunk = pending
    work.wait()
    if out is None:
        (out,) = _new_results(layout, OUT, blocks[0] if wire is None else like)
    h2s_unpack(chunk.layout, [[x] for x in blocks], OUT, [out], kernels, wire)
    return out


def _finish_grads(pending, sched: Schedule, outs, kv_blocks, kernels, wire, like: torch.Tensor) -> list[torch.Tensor]:
    """Wait for one chunk's gradient exchanges and unpack them into ``outs`` (dq, dk, dv;
    allocated here the first time, in ``like``'s dtype; ``wire`` as for ``_finish_out``).
    Returns ``outs``."""
    started, c = pending
    chunk = sched.chunks[c]
    per_role = []
    for work, blocks in started:
        work.wait()
        per_role.append(blocks)
    if outs is None:
        outs = _new_results(chunk.grad, QKV, per_role[0][0] if wire is None else like)
    if not chunk.grad_kv:  # query-head gradients only
        h2s_unpack(chunk.unpack, [[b] for b in per_role[0]], Q_ONLY, [outs[0]], kernels, wire)
        return outs
    world = chunk.grad.world_size
    blocks = []
    for p in range(world):
        lo, hi = chunk.trim[p]
        dq_b, dk_b, dv_b = (per_role[i][p] for i in range(3))
        blocks.append([dq_b, dk_b[:, :, lo:hi], dv_b[:, :, lo:hi]])
        if (c, p) in sched.replica_blocks:  # held for _sum_replicas; other blocks go now
            kv_blocks[(c, p)] = (dk_b, dv_b)
    h2s_unpack(chunk.unpack, blocks, QKV, list(outs), kernels, wire)
    return outs


def _sum_replicas(layout: Layout, sched: Schedule, outs, kv_blocks, kernels, wire=None) -> None:
    """KV heads several ranks hold: first holder copied, the others added, in rank order
    (the unchunked unpack's order), one unpack per such head."""
    plan = layout.plan
    for h, holders in sched.replicas:
        ranges = [(h, h)] * plan.world_size
        dk0, dv0 = kv_blocks[(holders[0][1], holders[0][0])]
        empty = [dk0[:, :, :0], dv0[:, :, :0]]  # k's head dim and v's (MLA: they differ)
        blocks = [list(empty) for _ in range(plan.world_size)]
        for p, c, idx in holders:
            ranges[p] = (h, h + 1)
            dk_b, dv_b = kv_blocks[(c, p)]
            blocks[p] = [dk_b[:, :, idx : idx + 1], dv_b[:, :, idx : idx + 1]]
        rep = HeadPlan(plan.q_heads, plan.kv_heads, plan.world_size, plan.q_ranges, tuple(ranges))
        h2s_unpack(layout.with_plan(rep), blocks, ("kv", "v"), list(outs), kernels, wire)


def chunked_attention(q, k, v, call):
    """Ulysses attention with head chunks overlapping the all-to-alls (see module docstring).

    ``q`` ``[B, s_r, Hq, D]``, ``k`` ``[B, s_r, Hkv, D]``, ``v`` ``[B, s_r, Hkv, Dv]`` as for
    ``ulysses_attention``; ``call``: its ``CallSetup``, with ``call.chunks`` (> 1) resolved.
    Returns ``[B, s_r, Hq, Dv]``.
    """
    return ChunkedAttentionFunction.apply(q, k, v, call)
