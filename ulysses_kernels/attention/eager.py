"""The eager schedule: all-to-all, the rank's attention backend, all-to-all, as three
autograd nodes (``SeqToHead``, ``LocalAttention``, ``HeadToSeq``)."""

from __future__ import annotations

import torch

from ..backends import doc_kwargs
from ..checkpointing import one_recompute
from ..layout import OUT, QKV
from .exchange import HeadToSeq, SeqToHead, a2a_head_to_seq, a2a_seq_to_head

__all__ = ["LocalAttention", "eager_attention"]


class LocalAttention(torch.autograd.Function):
    """The rank's attention backend (``call.backend``) on its head-sharded ``q``, ``k``,
    ``v`` (``[B, S, h, D]`` views of the sequence-to-head receive buffer), as an autograd
    node of its own between the two exchanges. The backend's state (for built-in backends,
    gradient edges of the attention graph: no tensor, so that checkpointing and saved-tensor
    hooks see the saved attention inputs and output; docs/design.md) is the only thing kept
    for the backward. Its backward gives up that state before it returns, and the autograd engine
    frees ``dout`` (``[B, s_r, Hq, D]``) once the exchange that consumed it has run and the
    head-sharded ``dout`` once this node has run."""

    @staticmethod
    def forward(ctx, call, q, k, v):
        needs_grad = any(ctx.needs_input_grad[1:4])
        out, state = call.backend.forward(
            q, k, v, causal=call.causal, scale=call.scale, kv_map=call.kv_map, needs_grad=needs_grad, **doc_kwargs(call.docs)
        )  # fmt: skip
        ctx.call, ctx.state = call, state
        # Read first in backward: a pending checkpoint recompute runs then, once, for the
        # nested passes of the backend's backward too (``checkpointing.one_recompute``).
        ctx.save_for_backward(q.new_empty(0))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        with one_recompute():
            (_marker,) = ctx.saved_tensors
            backend, state = ctx.call.backend, ctx.state
            ctx.state = None
            return (None, *backend.backward(state, dout))


def eager_attention(q, k, v, call):
    """Ulysses attention, eager: all-to-all, local attention, all-to-all, as three autograd
    nodes (``SeqToHead``, ``LocalAttention``, ``HeadToSeq``, the composition the compiled
    path traces too); the backward runs them in reverse: dout to heads, the attention
    backward, dq/dk/dv back to the sequence. Three nodes rather than one so that each buffer
    goes at its last use: ``dout`` after its exchange, the head-sharded ``dout`` and the
    saved attention state after the attention backward (one node would hold all of them
    until dq/dk/dv arrive). ``call``: the ``CallSetup`` (its ``backend`` is
    ``backends.for_rank``'s pick).

    When nothing needs a gradient (inference, evaluation: grad mode off, or no input that
    requires grad) the forwards of the three nodes run without the nodes: the same movers
    and the same backend call, with no autograd context to build."""
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return _forward_only(q, k, v, call)
    q_l, k_l, v_l = SeqToHead.apply(call, q, k, v)
    out_l = LocalAttention.apply(call, q_l, k_l, v_l)
    del q_l, k_l, v_l  # the attention graph's saved tensors hold what its backward needs
    return HeadToSeq.apply(call, out_l)


def _forward_only(q, k, v, call):
    """``SeqToHead``, ``LocalAttention`` and ``HeadToSeq``'s forwards, as plain calls."""
    layout, comm, kernels = call.layout, call.comm, call.kernels
    q_l, k_l, v_l = a2a_seq_to_head(layout, (q, k, v), QKV, comm, kernels)
    out_l, _ = call.backend.forward(
        q_l, k_l, v_l, causal=call.causal, scale=call.scale, kv_map=call.kv_map, needs_grad=False, **doc_kwargs(call.docs)
    )  # fmt: skip
    del q_l, k_l, v_l
    return a2a_head_to_seq(layout, [out_l], OUT, comm, kernels)[0]
