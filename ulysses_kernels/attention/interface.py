"""The public Ulysses attention op, the schedule each call takes, the eager schedule, the
module, and the lower-level all-to-all ops.

The path of one call reads top-down here: ``ulysses_attention`` resolves the call
(``attention.call``) and hands it to ``run_schedule``, the one place that picks the schedule
(``traced`` inside ``torch.compile``, ``chunked`` for ``call.chunks > 1``, else the eager
schedule, the default, right below it). A 2-D group (``SPGroups``) is no schedule of its
own: its ring level is the call's attention backend (``ring.RingBackend``), which the eager
and the chunked schedule run like any backend.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from ..backends import doc_kwargs
from ..checkpointing import chunks_recompute_apart, one_recompute
from ..comm import get_communicator, native_nccl_enabled
from ..documents import documents
from ..plan import HeadPlan
from ..ring import SPGroups
from ..tracing import in_trace
from ..wire import wire_spec
from . import chunked
from .call import CallSetup, members_of, setup_attention, setup_exchange, setup_head_to_seq
from .exchange import HeadToSeq, HeadToSeqTraced, SeqToHead, SeqToHeadTraced, h2s_along, s2h_along, wire_of
from .traced import traced_attention

__all__ = ["ulysses_attention", "UlyssesAttention", "seq_to_head", "head_to_seq"]


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    causal: bool = True,
    softmax_scale: float | None = None,
    seq_lens: Sequence[int] | None = None,
    attn_fn=None,
    *,
    plan: HeadPlan | None = None,
    comm=None,
    kernels=None,
    chunks: int | str = 1,
    check: bool = True,
    cu_seqlens: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor | None = None,
    max_seqlen: int | None = None,
    wire_dtype=None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across ``group``.

    Args:
        q: ``[batch, seq_local, q_heads, head_dim]``; rank r holds the r-th contiguous slice
            of the global sequence, for all heads.
        k: ``[batch, seq_local, kv_heads, head_dim]``, ``q_heads % kv_heads == 0``.
        v: ``[batch, seq_local, kv_heads, v_head_dim]``: ``v_head_dim`` may differ from
            ``head_dim`` (MLA: DeepSeek-V2/V3, Kimi-K2, MiniCPM3; v travels at its own width,
            never padded on the wire). q, k and v share dtype (any float) and device.
        group: the sequence-parallel process group (default: the world; without
            ``torch.distributed`` initialized, a group of one), or an ``SPGroups``
            (``make_sp_groups(ulysses_size, ring_size)``): the Ulysses exchange inside each
            Ulysses group, ring attention over the ring groups, the exchange back; rank r of
            the whole group holds the r-th contiguous shard, or the shard of
            ``shard_sequence`` for ``SPGroups.seq_layout="zigzag"`` (the op reads the layout
            from the ``SPGroups``; it never guesses). Not inside ``torch.compile``.
        causal: causal mask over the *global* sequence.
        softmax_scale: default ``head_dim ** -0.5`` (q's head dim).
        seq_lens: tokens per rank when the shards are uneven (the same list on every rank).
            Default: every rank holds ``q.shape[1]`` tokens (checked when ``check``).
        attn_fn: ``None`` (flash-attn on CUDA when importable, else SDPA), ``"flash"``,
            ``"sdpa"``, ``"math"``, a callable ``fn(q, k, v, causal=, softmax_scale=)`` over
            ``[B, S, H, D]`` grouped heads, or a backend object (see ``backends``). With
            documents a callable also gets ``cu_seqlens=`` (the global boundaries, a tuple)
            and ``max_seqlen=``, and must attend within each document of its ``[1, S, hq, D]``.
        plan: a prebuilt ``HeadPlan`` (default: ``HeadPlan.build(q_heads, kv_heads, world)``).
        comm: a communicator. Default: torch.distributed on ``group``. Our native NCCL
            all-to-all is opt-in until it has run on a GPU: ``comm=NCCLCommunicator(group)``
            (a communicator of its own, made once and passed to every call), or
            ``ULYSSES_KERNELS_NATIVE_NCCL=1`` (the same on every rank), which makes the
            default for CUDA tensors on an NCCL group our native calls on torch's own
            communicator of ``group`` (``NCCLCommunicator.borrow``: nothing is created).
        kernels: the pack/unpack kernels: ``None``/``"auto"``, ``"torch"``, ``"triton"``,
            ``"cuda"`` (see ``ulysses_kernels.kernels``).
        chunks: split each rank's heads into this many chunks whose all-to-alls overlap
            with attention (``"auto"`` picks from a cost model); ``1`` is no overlap.
            Chunked results equal ``chunks=1`` bit for bit with backends that compute each
            head independently and deterministically (checked on the CPU with SDPA and one
            intra-op thread per rank; not the ``"math"`` einsum; GPU backward kernels that
            use atomics are not bitwise deterministic even unchunked).
        check: exchange a small signature of every rank's inputs first (one tiny
            all-gather and a host sync) so that bad or mismatched inputs raise the same
            error on every rank. ``False`` skips the exchange: then all ranks must pass
            matching shapes and options, or the collectives may fail or hang.
        cu_seqlens: packed documents (``q`` ``[1, s_local, Hq, D]``): the *global* boundaries
            ``(0, end_0, ..., S)``, a list of ints or a 1-D integer tensor (a CUDA one costs a
            host sync), the same on every rank. Attention is block-diagonal per document,
            causal inside one when ``causal``; documents may cross shards and be shorter
            than the group; padding is a trailing document (``documents.pad_documents``).
            ``check`` validates them (from 0, increasing, to S, equal on every rank) in the
            same all-gather; without it only rank-locally (equality is the caller's contract).
            A batch of packed rows (``q`` ``[B, s_local, Hq, D]``, each row its own documents):
            one such list per row, ``[[0, ..., S], [0, ..., S], ...]``; the backend attends the
            rows end to end as one packed row of ``B * S`` tokens (a callable or a backend
            object gets the joined boundaries and ``[1, B * S, h, D]``, or for a backend object
            ``[B, S, h, D]`` and ``docs.rows = B``). Not on a 2-D group (``SPGroups``).
        max_seqlen: the longest document; default derived from ``cu_seqlens`` (no collective).
        wire_dtype: ``None`` (the attention dtype on the wire), ``"fp8"`` (each exchange
            quantized in the pack with one float32 scale per (token, head), in the same
            collective: e4m3 for q/k/v and the output, e5m2 for d_out and dq/dk/dv; bytes
            on the wire ``(D + 4) / (D * itemsize)`` of today's), or a ``wire.WireSpec``
            naming the format of each exchange (docs/fp8_wire.md). Not exact: each exchange
            adds the format's rounding. Eager and chunked schedules, the ``torch`` kernel set.

    Returns:
        ``[batch, seq_local, q_heads, v_head_dim]``: full attention over the global sequence,
        this rank's rows. Differentiable in q, k and v.

    Inside ``torch.compile`` the op is built from traceable pieces (``attention.traced``): forward
    and backward trace into the graph, the checks are rank-local (no cross-rank exchange),
    and ``chunks`` is ignored.
    """
    call = setup_attention(
        q, k, v, group=group, comm=comm, plan=plan, seq_lens=seq_lens, causal=causal, softmax_scale=softmax_scale,
        attn_fn=attn_fn, kernels=kernels, chunks=chunks, check=check, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        wire_dtype=wire_dtype,
    )  # fmt: skip
    return run_schedule(q, k, v, call)


def run_schedule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: CallSetup) -> torch.Tensor:
    """Run ``call`` on ``q``, ``k``, ``v`` (shapes as for ``ulysses_attention``) with the
    schedule it takes, chosen here and nowhere else:

    * the default, one chunk outside ``torch.compile``: ``eager_attention`` (below), three
      autograd nodes;
    * ``call.traced`` (set up inside ``torch.compile``): ``traced.traced_attention``, traceable
      pieces (``chunks`` is ignored there);
    * else (``call.chunks > 1``): ``chunked.chunked_attention``, head chunks whose exchanges
      overlap attention (looked up in its package per call: a replaced function is the one
      that runs).

    A 2-D group takes the same three: its ring level is ``call.backend``."""
    if call.chunks == 1 and not call.traced:
        return eager_attention(q, k, v, call)
    if call.traced:
        return traced_attention(q, k, v, call)
    return chunked.chunked_attention(q, k, v, call)


# ---- the eager schedule (the default) ---------------------------------------------------------
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


def _forward_only(q, k, v, call):
    """``SeqToHead``, ``LocalAttention`` and ``HeadToSeq``'s forwards, as plain calls."""
    routes, comm, kernels = call.routes, call.comm, call.kernels
    q_l, k_l, v_l = s2h_along(routes.qkv, (q, k, v), comm, kernels, wire_of(call, "qkv"))
    out_l, _ = call.backend.forward(
        q_l, k_l, v_l, causal=call.causal, scale=call.scale, kv_map=call.kv_map, needs_grad=False, **doc_kwargs(call.docs)
    )  # fmt: skip
    del q_l, k_l, v_l
    return h2s_along(routes.out, [out_l], comm, kernels, wire_of(call, "out"))[0]


# The resolved calls a module keeps (one per input signature: a few KB each). Packed batches
# bring new boundaries every step: the oldest signatures then make room.
_MODULE_CALLS = 64


class UlyssesAttention(nn.Module):
    """``ulysses_attention`` as a module that holds its plan and group.

    ``comm``: as in ``ulysses_attention`` (default: torch.distributed on ``group``; native
    NCCL is opt-in). A communicator of its own that does not queue behind the group's other
    collectives (FSDP's, say) is one ``NCCLCommunicator(group)``, made once and passed to
    every layer.

    ``check="once"`` (default) validates each new input signature (shapes, dtype, options)
    across ranks once per module and skips the exchange afterwards; ``"always"`` checks every
    call; ``"never"`` does not exchange (see ``ulysses_attention(check=False)``). The
    signature includes ``cu_seqlens`` and ``max_seqlen`` of a packed sequence: new boundaries
    are checked once too.

    The module resolves each input signature once (``attention.call``: plan, layout,
    communicator, kernel set, backend, chunk count) and keeps the ``CallSetup`` (the last
    64 signatures); later calls with that signature go straight to the schedule. The
    exception is the native NCCL default (``ULYSSES_KERNELS_NATIVE_NCCL=1``, CUDA tensors, no
    ``comm``), whose communicator is looked up per call, as the functional op does.

    ``wire_dtype``: as in ``ulysses_attention`` (``None``, ``"fp8"`` or a ``wire.WireSpec``).
    """

    def __init__(
        self,
        q_heads: int,
        kv_heads: int,
        group=None,
        *,
        causal: bool = True,
        softmax_scale: float | None = None,
        attn_fn=None,
        comm=None,
        kernels=None,
        chunks: int | str = 1,
        check: str = "once",
        wire_dtype=None,
    ):
        super().__init__()
        if check not in ("once", "always", "never"):
            raise ValueError(f"UlyssesAttention: check expected 'once', 'always' or 'never', got {check!r}")
        # No communicator is made here (construction is not collective, and a model with
        # one module per layer must not hold one NCCL communicator per layer): without
        # ``comm`` each call picks the functional op's default.
        self.group, self.comm = group, comm
        # A 2-D group (SPGroups): heads are planned over its Ulysses group.
        size = group.ulysses_size if isinstance(group, SPGroups) else (comm if comm is not None else get_communicator(group)).world_size
        self.plan = HeadPlan.build(q_heads, kv_heads, size)
        self.causal, self.softmax_scale, self.attn_fn, self.check = causal, softmax_scale, attn_fn, check
        self.kernels, self.chunks = kernels, chunks
        self.wire_dtype = wire_spec(wire_dtype)  # checked here: a bad value fails at construction
        self._checked: set[tuple] = set()
        self._calls: OrderedDict[tuple, CallSetup] = OrderedDict()
        self._members = None  # the group's members (rank, world size), looked up at the first call

    def forward(self, q, k, v, seq_lens: Sequence[int] | None = None, cu_seqlens=None, max_seqlen: int | None = None) -> torch.Tensor:
        """``ulysses_attention`` with the module's settings; ``seq_lens``, ``cu_seqlens`` and
        ``max_seqlen`` as documented there."""
        docs, key, check = self._signature(q, k, v, seq_lens, cu_seqlens, max_seqlen)
        if in_trace():  # resolved at trace time; the graph keeps it (no cross-rank check)
            return self._call(q, k, v, seq_lens, docs, check)
        call = self._resolved(q, k, v, seq_lens, docs, key, check)
        out = run_schedule(q, k, v, call)
        if check:
            self._checked.add(key)
        return out

    def _signature(self, q, k, v, seq_lens, cu_seqlens, max_seqlen) -> tuple:
        """``(docs, key, check)``: the documents, the input signature, and whether this call
        checks it across ranks (``check``'s policy)."""
        docs = documents(cu_seqlens, max_seqlen)
        key = (
            tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype, q.device,
            None if seq_lens is None else tuple(seq_lens), docs,
        )  # fmt: skip
        return docs, key, self.check == "always" or (self.check == "once" and key not in self._checked)

    def _resolve(self, q, k, v, seq_lens=None, cu_seqlens=None, max_seqlen=None) -> CallSetup:
        """The ``CallSetup`` ``forward`` runs for these inputs (the set-up part of a call alone:
        what ``bench.host`` times)."""
        docs, key, check = self._signature(q, k, v, seq_lens, cu_seqlens, max_seqlen)
        return self._resolved(q, k, v, seq_lens, docs, key, check)

    def _resolved(self, q, k, v, seq_lens, docs, key, check: bool) -> CallSetup:
        # The chunk count depends on saved-tensor hooks being active (checkpointing before
        # torch 2.9): part of the key when chunks are asked for.
        stored = (key, k.device, v.device, self.chunks != 1 and chunks_recompute_apart())
        call = None if check else self._calls.get(stored)
        if call is None:
            call = self._setup(q, k, v, seq_lens, docs, check)
            if self.comm is not None or q.device.type != "cuda" or not native_nccl_enabled():
                self._calls[stored] = call
                if len(self._calls) > _MODULE_CALLS:
                    self._calls.popitem(last=False)
        return call

    def _setup(self, q, k, v, seq_lens, docs, check: bool) -> CallSetup:
        if self._members is None and not isinstance(self.group, SPGroups):
            self._members = members_of(self.group, self.comm)
        return setup_attention(
            q, k, v, group=self.group, comm=self.comm, plan=self.plan, seq_lens=seq_lens, causal=self.causal,
            softmax_scale=self.softmax_scale, attn_fn=self.attn_fn, kernels=self.kernels, chunks=self.chunks, check=check,
            cu_seqlens=docs,
            members=self._members, wire_dtype=self.wire_dtype,
        )  # fmt: skip

    def _call(self, q, k, v, seq_lens, docs, check: bool) -> torch.Tensor:
        return ulysses_attention(
            q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, seq_lens=seq_lens,
            group=self.group, attn_fn=self.attn_fn, plan=self.plan, comm=self.comm, kernels=self.kernels, chunks=self.chunks,
            check=check, cu_seqlens=docs, wire_dtype=self.wire_dtype,
        )  # fmt: skip

    def extra_repr(self) -> str:
        p = self.plan
        return f"q_heads={p.q_heads}, kv_heads={p.kv_heads}, world_size={p.world_size}, causal={self.causal}"


def seq_to_head(q, k=None, v=None, *, group=None, seq_lens=None, plan=None, comm=None, kernels=None, check=True, wire_dtype=None):
    """Sequence-sharded -> head-sharded, differentiable (one collective for q, k, v).

    ``q`` ``[B, s_r, Hq, D]`` (and ``k`` ``[B, s_r, Hkv, D]``, ``v`` ``[B, s_r, Hkv, Dv]``) -> this
    rank's heads over the whole sequence: ``q`` ``[B, S, hq, D]`` (``k`` ``[B, S, hkv, D]``, ``v``
    ``[B, S, hkv, Dv]``), strided views of one receive buffer; ``plan.q_ranges[rank]``/``kv_ranges[rank]`` say which heads.
    Gradients of KV heads that several ranks hold are summed once per replica.
    Pass ``k=v=None`` to move q alone; then the heads follow ``plan`` (default: a plan
    with ``kv_heads = q_heads``), so pass the plan of your attention layer.
    Inside ``torch.compile`` this and ``head_to_seq`` trace (forward and backward) as
    ``ulysses_attention`` does: rank-local checks, one functional all-to-all per exchange.

    Packed documents: the results hold the whole sequence in global order, so the boundaries
    your own attention needs between the two exchanges are the global ``cu_seqlens``
    (``documents.documents(cu_seqlens)``; flash-attn's ``flash_attn_varlen_func(q[0], k[0],
    v[0], cu, cu, max_seqlen, max_seqlen, ...)`` with ``cu`` int32 on the device), the same
    on every rank and in every layer: nothing to exchange.

    ``wire_dtype``: as in ``ulysses_attention`` (``None``, ``"fp8"`` or a ``wire.WireSpec``):
    the tensors move in its ``qkv`` format, their gradients back in its ``grads`` format.
    """
    call = setup_exchange(q, k, v, group=group, comm=comm, plan=plan, seq_lens=seq_lens, kernels=kernels, check=check, wire_dtype=wire_dtype)
    fn = SeqToHeadTraced if call.traced else SeqToHead
    outs = fn.apply(call, *((q, k, v) if k is not None else (q,)))
    return outs if k is not None else outs[0]


def head_to_seq(x, plan: HeadPlan, *, group=None, seq_lens=None, comm=None, kernels=None, wire_dtype=None):
    """Head-sharded ``[B, S, hq, D]`` (this rank's ``plan.q_ranges``) -> ``[B, s_r, Hq, D]``.

    The inverse of ``seq_to_head`` for query-head tensors (the attention output).
    ``seq_lens`` as given to ``seq_to_head``; the default assumes equal shards. The checks
    are rank-local (no collective): ``x`` against ``plan`` and ``seq_lens``. ``wire_dtype``: as
    in ``seq_to_head``; ``x`` moves in its ``out`` format, its gradient in ``dout``.
    """
    call = setup_head_to_seq(x, plan, group=group, comm=comm, seq_lens=seq_lens, kernels=kernels, wire_dtype=wire_dtype)
    return (HeadToSeqTraced if call.traced else HeadToSeq).apply(call, x)
