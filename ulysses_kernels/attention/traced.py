"""The path ``ulysses_attention`` takes inside ``torch.compile``: one graph, forward and backward.

The eager schedule (``interface.eager_attention``) runs the attention backend under its own
autograd and calls ``torch.autograd.grad`` in its backward, posts grouped send/recv for
batch > 1 and for dq/dk/dv, and checks inputs with an all-gather whose result the host
decodes. Dynamo (torch 2.14) traces none of these by default: ``autograd.grad`` needs
``torch._dynamo.config.trace_autograd_ops``, ``P2POp`` is refused unless the experimental
``enable_p2p_compilation`` is set, and the decoded gather is data-dependent. Inside a compiled
region the op is composed instead of traceable pieces:

    q, k, v  --SeqToHeadTraced-->  q_l, k_l, v_l  --backend.attend (plain autograd)-->  out_l
             --HeadToSeqTraced-->  out

* The two autograd functions (``exchange.exchange_functions`` over the traced movers of
  ``attention.exchange``) move
  data with the same kernel set (``pack_s2h``, ``unpack_h2s``; the C++ ops have fake
  kernels) and one ``comm.all_to_all`` per exchange, forward and backward. ``torch.distributed.all_to_all_single`` (what ``TorchCommunicator``
  calls) is remapped by dynamo to a functional collective
  (``torch.distributed._functional_collectives.traceable_collective_remaps``), so the
  collectives are nodes of the graph and AOT autograd sees the backward.
* Attention is the backend ``backends.for_rank`` picks, as in eager. An ``AttentionBackend``
  (SDPA, the math einsum, flash-attn, a callable) runs its ``attend`` under ordinary
  autograd, so AOT autograd derives its backward; backends with their own
  ``forward``/``backward`` run inside an autograd function and must be traceable themselves.
* On a rank whose query heads all share its one KV head (``gqa.shares_one_kv``: MQA,
  or for example 40/8 at world size 8) that pick is ``SharedKV``, as in eager: the
  attention is plain multi-head attention against stride-0 views of the KV head
  (``_SharedKVExpand``), whose backward sums the per-query-head KV gradients with
  ``KVGradSum`` (head order, float32 accumulator for half types) instead of leaving the sum
  to the backend's grouped-query backward. Compiled and eager therefore run the same ops in
  the same order: bit-identical forward and backward on the CPU with ``aot_eager`` and one
  intra-op thread per rank (tested in float64 and bfloat16 at world size 1 and on 2 gloo
  ranks). Inductor generates its own kernels and promises no bits.
* Input checks are the rank-local ones, run at trace time (shapes are static in the graph):
  the cross-rank exchange of ``check=True`` is skipped inside compiled graphs, so a
  mismatch between ranks (for example unequal shards without ``seq_lens``) is not caught
  there. Run the op (or the module) once eagerly on a new input signature to check it
  across ranks.
* Packed documents (``call.docs``: plain ints, constants of the graph) reach the backend as
  in eager; the per-document SDPA loop traces into the graph (tested with ``aot_eager``,
  fullgraph, at world size 1). Pass ``cu_seqlens`` as a list there: a tensor's values are
  unknown while tracing (a clear ``TypeError`` in a full graph). flash-attn's varlen kernel
  under compile is untested (GPU).
* ``chunks`` is ignored: the chunked pipeline overlaps collectives with async work handles
  and side streams, which a graph does not express; the compiled graph runs unchunked
  and leaves scheduling to the compiler.
* Without ``comm`` the exchanges are torch's functional all-to-alls (the eager default's
  borrowed native communicator is not used in graphs). With a native ``NCCLCommunicator``
  passed as ``comm`` (what ``integrations.hf.apply`` owns on NCCL groups) they are its
  ``ulysses_kernels::nccl_all_to_all`` custom op in the graph; that path is untested under
  compile (it needs GPUs).

* ``wire_dtype`` (FP8 on the wire, ``ulysses_kernels.wire``) runs here too: the traced movers
  quantize in the pack and move the bytes in the same one ``all_to_all`` per exchange, then
  dequantize in the unpack, as the eager movers do (bit-identical to eager with ``aot_eager``
  on 2 gloo ranks; tests/test_compile.py).

Data movement differs from eager in two places, each one extra copy of the bytes on the
wire, because every exchange here is one ``all_to_all`` (eager's grouped send/recv moves
pieces in place): with batch > 1 the sequence-to-head receive buffer
arrives source-major (``[P][B][s_p][h][D]``) and is concatenated into ``[B, S, h, D]``;
head-to-sequence of dq/dk/dv, or of the output at batch > 1, first gathers each peer's rows
into one send buffer. Batch 1 forward moves the same bytes as eager.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backends import AttentionBackend, SharedKV, attend_heads, doc_kwargs
from .exchange import HeadToSeqTraced, SeqToHeadTraced

__all__ = ["traced_attention"]


class _BackendAttention(torch.autograd.Function):
    """A backend object with its own ``forward``/``backward`` (not an ``AttentionBackend``
    that attends under autograd, or ``SharedKV`` around one that has its own): traces only
    when those two trace (``SharedKV.backward``'s ``KVGradSum`` does)."""

    @staticmethod
    def forward(ctx, q, k, v, backend, causal, scale, kv_map, docs):
        out, state = backend.forward(q, k, v, causal=causal, scale=scale, kv_map=kv_map, needs_grad=True, **doc_kwargs(docs))
        ctx.backend, ctx.state = backend, state
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ctx.backend.backward(ctx.state, dout)
        return dq, dk, dv, None, None, None, None, None


class _SharedKVExpand(torch.autograd.Function):
    """``SharedKV`` under autograd: the rank's one KV head ``[B, S, 1, D]`` as stride-0 views
    ``[B, S, hq, D]`` (one per query head, no copy); backward sums the per-query-head
    gradients with ``KVGradSum`` (in head order, float32 accumulator for half types): the
    ``"shared"`` ``KVGather`` eager's ``SharedKV`` runs. A bare ``expand`` would
    differentiate to one ``sum`` over the heads, whose order and accumulator are the kernel's."""

    @staticmethod
    def forward(ctx, k, v, hq):
        return SharedKV.heads(hq).gather(k, v)

    @staticmethod
    def backward(ctx, dk, dv):
        return (*SharedKV.heads(dk.shape[2]).scatter(dk, dv), None)


def _under_autograd(backend) -> bool:
    """True for an ``AttentionBackend`` that keeps the base ``forward``/``backward`` (it
    attends under autograd, which AOT autograd differentiates)."""
    kind = type(backend)
    return isinstance(backend, AttentionBackend) and kind.forward is AttentionBackend.forward and kind.backward is AttentionBackend.backward


def _attend(backend, q, k, v, causal: bool, scale: float, kv_map: Sequence[int], docs=None) -> torch.Tensor:
    """Local attention ``[B, S, hq, D]`` over this rank's heads, differentiable by autograd;
    ``backend`` is ``backends.for_rank``'s pick, as in eager. ``docs``: the packed
    sequence's boundaries (plain ints: the per-document SDPA loop traces into the graph)."""
    inner = backend.inner if isinstance(backend, SharedKV) else backend
    if not _under_autograd(inner):
        return _BackendAttention.apply(q, k, v, backend, causal, scale, tuple(kv_map), docs)
    if inner is not backend:
        k, v = _SharedKVExpand.apply(k, v, q.shape[2])
        kv_map = range(q.shape[2])
    return attend_heads(inner.attend, q, k, v, kv_map, causal, scale, docs)


def traced_attention(q, k, v, call) -> torch.Tensor:
    """``ulysses_attention`` as traceable pieces, for ``call`` (a ``CallSetup`` built inside
    the trace: rank-local checks, a traceable kernel set); see the module docstring for
    what differs from the eager op (checks, chunks, two copies)."""
    q_l, k_l, v_l = SeqToHeadTraced.apply(call, q, k, v)
    out_l = _attend(call.backend, q_l, k_l, v_l, call.causal, call.scale, call.kv_map, call.docs)
    return HeadToSeqTraced.apply(call, out_l)
