"""The two all-to-alls and the autograd functions built on them.

Data movement per call (the budget of one copy per byte on the wire):

* ``a2a_seq_to_head``: one pack into one send buffer (all roles together), one collective,
  no receive-side copy (the results are strided views of the receive buffer).
* ``a2a_head_to_seq``: the local tensors are sent in place when their rows are contiguous
  (see ``layout.rows_contiguous``), then one unpack writes the receive buffer into the
  ``[B, s_r, H, D]`` outputs, summing replicated KV heads.

Buffers: each call allocates one send buffer (``a2a_seq_to_head`` only) and one receive buffer
from the caching allocator; the receive buffer of ``a2a_seq_to_head`` lives as long as the
views of it (for attention, until the backward has used them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import layout as L
from .kernels import TorchKernels
from .layout import Q_ONLY, QKV, Layout

__all__ = ["a2a_seq_to_head", "a2a_head_to_seq", "SeqToHead", "HeadToSeq", "UlyssesAttentionFunction"]


def _flat(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(n, dtype=like.dtype, device=like.device)


def _run_now(tensors, call):
    """``start`` for a blocking exchange: run the collective, no handle."""
    call(False)
    return None


def post_seq_to_head(layout: Layout, tensors, roles, comm, kernels=TorchKernels, start=_run_now):
    """Pack ``tensors`` (``[B, s_r, H, D]``) and post the sequence-to-head exchange.

    ``start(buffers, call)`` runs ``call(async_op)`` (blocking by default; the chunked
    pipeline passes one that overlaps it with compute) and returns a handle.
    Returns ``(handle, recv)``; ``layout.s2h_recv_views(recv, roles)`` are the results
    once the handle is waited.
    """
    like, rank = tensors[0], layout.rank
    send_splits, recv_splits = layout.s2h_send_splits(roles), layout.s2h_recv_splits(roles)
    recv = _flat(sum(recv_splits), like)
    send = _flat(sum(send_splits), like)
    if layout.batch == 1 and layout.world_size > 1:
        kernels.pack_s2h(layout, tensors, roles, send)
        call = lambda a: comm.all_to_all(recv, send, recv_splits, send_splits, async_op=a)  # noqa: E731
    else:
        # One piece per (peer, batch element); our own rows are packed in place.
        kernels.pack_s2h(layout, tensors, roles, send, recv=recv)
        send_p, recv_p = layout.s2h_send_pieces(send, roles), layout.s2h_recv_pieces(recv, roles)
        peers = [p for p in range(layout.world_size) if p != rank]
        sends = [(p, x) for p in peers for x in send_p[p]]
        recvs = [(p, x) for p in peers for x in recv_p[p]]
        call = lambda a: comm.send_recv(sends, recvs, async_op=a)  # noqa: E731
    return start((recv, send), call), recv


def _one_collective(layout: Layout, n_tensors: int) -> bool:
    """Head-to-seq of one tensor at batch 1 is one all_to_all (own rows included)."""
    return n_tensors == 1 and layout.batch == 1 and layout.world_size > 1


def post_head_to_seq(layout: Layout, local, roles, comm, kernels=TorchKernels, start=_run_now):
    """Post the head-to-sequence exchange of local ``[B, S, h, D]`` tensors (one per role).

    Rows that are contiguous per batch element go on the wire in place; others are packed
    first. Returns ``(handle, recv, wire)``; pass ``recv`` and ``wire`` to
    ``head_to_seq_blocks`` once the handle is waited.
    """
    wire = []
    for x in local:
        if not L.rows_contiguous(x):
            # NOTE: a backend that returns rows that are not contiguous costs this copy.
            packed = _flat(x.numel(), x)
            kernels.pack_h2s(layout, x, packed)
            x = packed.view(x.shape)
        wire.append(x)
    send_splits, recv_splits = layout.h2s_splits(roles)
    recv = _flat(sum(recv_splits), wire[0])
    if _one_collective(layout, len(wire)):
        flat = wire[0].reshape(-1)
        call = lambda a: comm.all_to_all(recv, flat, recv_splits, send_splits, async_op=a)  # noqa: E731
    else:
        blocks = layout.h2s_recv_views(recv, roles)
        sends, recvs = [], []
        for p in range(layout.world_size):
            if p == layout.rank:
                continue
            for x, dst in zip(wire, blocks[p]):
                src = layout.h2s_send_blocks(x, p)
                sends += [(p, src[b].reshape(-1)) for b in range(layout.batch)]
                recvs += [(p, dst[b].reshape(-1)) for b in range(layout.batch)]
        call = lambda a: comm.send_recv(sends, recvs, async_op=a)  # noqa: E731
    return start((recv, *wire), call), recv, wire


def head_to_seq_blocks(layout: Layout, recv, wire, roles) -> list[list[torch.Tensor]]:
    """Per source, per role: the ``[B, s_r, h, D]`` block to unpack."""
    blocks = layout.h2s_recv_views(recv, roles)
    if not _one_collective(layout, len(wire)):
        # Our own rows never touch the wire: unpack reads them from the local tensors.
        blocks[layout.rank] = [layout.h2s_send_blocks(x, layout.rank) for x in wire]
    return blocks


def a2a_seq_to_head(layout: Layout, tensors: Sequence[torch.Tensor], roles: Sequence[str], comm, kernels=TorchKernels) -> list[torch.Tensor]:
    """Sequence-sharded ``[B, s_r, H, D]`` tensors -> head-sharded ``[B, S, h, D]`` views."""
    _, recv = post_seq_to_head(layout, tensors, roles, comm, kernels)
    return layout.s2h_recv_views(recv, roles)


def a2a_head_to_seq(layout: Layout, local: Sequence[torch.Tensor], roles: Sequence[str], comm, kernels=TorchKernels) -> list[torch.Tensor]:
    """Head-sharded ``[B, S, h, D]`` tensors -> sequence-sharded ``[B, s_r, H, D]``."""
    if layout.world_size == 1:
        return list(local)
    _, recv, wire = post_head_to_seq(layout, local, roles, comm, kernels)
    like = wire[0]
    outs = [
        torch.empty(layout.batch, layout.seq_local, layout.total_heads(s), layout.head_dim, dtype=like.dtype, device=like.device)
        for s in roles
    ]
    kernels.unpack_h2s(layout, head_to_seq_blocks(layout, recv, wire, roles), roles, outs)
    return outs


def exchange_functions(s2h, h2s, suffix: str = ""):
    """The two differentiable exchanges, over a pair of data movers with the signatures of
    ``a2a_seq_to_head`` and ``a2a_head_to_seq`` (eager: those two; inside torch.compile:
    ``traceable.seq_to_head``/``head_to_seq``). Each is the other's backward. Both take the
    call's ``CallSetup`` (layout, communicator, kernel set) first."""

    class SeqToHead(torch.autograd.Function):
        """``(q[, k, v])`` sequence-sharded -> head-sharded; backward sums KV replicas."""

        @staticmethod
        def forward(ctx, call, *tensors):
            ctx.call = call
            ctx.roles = QKV if len(tensors) == 3 else Q_ONLY
            return tuple(s2h(call.layout, tensors, ctx.roles, call.comm, call.kernels))

        @staticmethod
        def backward(ctx, *grads):
            call = ctx.call
            lay = call.layout
            like = next(g for g in grads if g is not None)
            grads = [
                g if g is not None else like.new_zeros(lay.batch, lay.seq_total, lay.head_count(r, lay.rank), lay.head_dim)
                for g, r in zip(grads, ctx.roles)
            ]
            return (None, *h2s(lay, grads, ctx.roles, call.comm, call.kernels))

    class HeadToSeq(torch.autograd.Function):
        """Head-sharded ``[B, S, hq, D]`` -> sequence-sharded ``[B, s_r, Hq, D]``."""

        @staticmethod
        def forward(ctx, call, local):
            ctx.call = call
            return h2s(call.layout, [local], Q_ONLY, call.comm, call.kernels)[0]

        @staticmethod
        def backward(ctx, grad):
            call = ctx.call
            return None, s2h(call.layout, [grad], Q_ONLY, call.comm, call.kernels)[0]

    for cls in (SeqToHead, HeadToSeq):
        cls.__name__ = cls.__qualname__ = cls.__name__ + suffix
    return SeqToHead, HeadToSeq


SeqToHead, HeadToSeq = exchange_functions(a2a_seq_to_head, a2a_head_to_seq)


class UlyssesAttentionFunction(torch.autograd.Function):
    """All-to-all, local attention, all-to-all; the backward mirrors it. ``call``: the
    ``CallSetup`` (its ``backend`` is ``backends.for_rank``'s pick for this rank)."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        needs_grad = any(ctx.needs_input_grad[:3])
        layout, comm, kernels = call.layout, call.comm, call.kernels
        q_l, k_l, v_l = a2a_seq_to_head(layout, (q, k, v), QKV, comm, kernels)
        out_l, state = call.backend.forward(q_l, k_l, v_l, causal=call.causal, scale=call.scale, kv_map=call.kv_map, needs_grad=needs_grad)
        del q_l, k_l, v_l
        ctx.call, ctx.state = call, state
        return a2a_head_to_seq(layout, [out_l], Q_ONLY, comm, kernels)[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        call = ctx.call
        layout, comm, kernels = call.layout, call.comm, call.kernels
        (dout_l,) = a2a_seq_to_head(layout, [dout], Q_ONLY, comm, kernels)
        grads = call.backend.backward(ctx.state, dout_l)
        ctx.state = None
        dq, dk, dv = a2a_head_to_seq(layout, list(grads), QKV, comm, kernels)
        return dq, dk, dv, None
