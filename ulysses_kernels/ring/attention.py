"""Ring attention over the ring group, as the attention backend of a rank of a 2-D group.

After the Ulysses exchange inside its Ulysses group, a rank holds for its heads the block of
its ring rank ``j`` (``ring.seq_layout``): ``q`` ``[B, L, hq, D]``, ``k`` ``[B, L, hkv, D]``, ``v``
``[B, L, hkv, Dv]`` (``Dv`` may differ from ``D``: MLA).
``RingBackend`` computes full attention of that ``q`` over the whole sequence:

Forward, ring step ``t = 0 .. R-1`` (``R`` ring ranks; ``src = (j - t) % R`` owns the K/V block
held at step t)::

    post: send the held K/V block to ring rank j+1, receive the next one from j-1  (async)
    compute: the rectangles of (j, src) (``schedule.RingSchedule.pieces``) with the inner
             backend's ``attend_lse``, merged into the running result (``merge.PartialAttention``)
    wait for the transfer

so each block's transfer overlaps that block's attention. The schedule (``ring.schedule``, a
pure function of the call's values, the same on every rank) says which steps compute and how
far each block travels: a step whose blocks share no document (or that causality hides)
computes nothing, and a block stops at the last ring rank that needs it. Backward (the
standard ring backward): K/V go around the ring again on the same channel, every block's
gradients are recomputed against the *final* output and log-sum-exp
(``attend_lse_backward``), dQ is summed locally, and the dK/dV of block ``src`` are added
into an accumulator that travels with it on a channel of its own
(``SPGroups.ring_grad_group``) and, from the last rank of its path, goes home to its owner.

Packed documents (``docs=``, the global ``cu_seqlens``): the same ring, with each step's
rectangles cut by document (``seq_layout.document_pieces``): per-document math with the
log-sum-exp (``attend_lse``; SDPA and math backends, any device; flash-attn's
``flash_attn_func`` per rectangle for the flash backend), or one packed-documents kernel call
per step where the chooser picks one (``ring.varlen``: flash-attn's or torch's varlen,
FlexAttention); the block backward per rectangle as without documents.

Point to point: each step is one ``Communicator.send_recv`` per channel, sends posted
before receives. On gloo torch posts them one by one (``isend``, then ``irecv``; no
coalescing) and nothing blocks before ``wait()``, so no rank waits on a peer that waits on
it; the two channels are separate process groups, so their messages never match each other.

KV heads: ``kv_map`` as in ``backends``. K/V travel with the rank's ``hkv`` heads (never
expanded on the wire); a non-uniform map is gathered per block after the wire, and its
gradients summed back before they travel. A rank whose query heads all share its one KV head
(``gqa.shares_one_kv``, ``gqa.KVGather``'s ``"shared"`` mode) accumulates per-query-head
dK/dV and sums them in head order at the end (``backward_per_head`` is what the chunked pipeline's ``SharedKV`` path calls).
"""

from __future__ import annotations

import torch

from ..checkpointing import save_tensors
from ..checks import DOC_FIELDS, UlyssesInputError, by_value, document_problems, document_summary, document_text, dtype_code, rank_list
from ..comm import Communicator, get_communicator
from ..documents import Documents
from ..gqa import KVGather
from ..plan import more_ranks_than_heads
from .groups import SPGroups
from .merge import PartialAttention, acc_dtype
from .schedule import RingSchedule, ring_schedule
from .seq_layout import tile_rows
from .varlen import attend_lse_pieces, step_kernel

__all__ = ["RingBackend", "ring_backend", "check_ring_inputs"]


# NOTE: the explicit block attention (math forward, every block backward) holds
# [B, h, rows, keys] scores and as many probabilities in the accumulation dtype; 256 MiB of
# scores per call keeps a 128K-key block at 64 rows per call for 8 heads in float32 (not
# measured on a GPU: a bound on memory, not a tuned size).
TILE_BYTES = 256 << 20


class RingBackend:
    """The attention backend of a rank of a 2-D group (module docstring).

    ``inner``: a built-in backend (``supports_lse``); ``kv_comm``/``grad_comm``: the ring
    group's two channels; ``ring_rank``/``ring_size``/``seq_layout``: which blocks this rank
    and its peers hold. A packed sequence's steps run on the inner backend's packed kernel
    where the chooser picks one (``ring.varlen``)."""

    def __init__(self, inner, kv_comm: Communicator, grad_comm: Communicator, ring_rank: int, ring_size: int, seq_layout: str,
                 tile_bytes: int = TILE_BYTES):  # fmt: skip
        self.inner, self.kv_comm, self.grad_comm, self.tile_bytes = inner, kv_comm, grad_comm, tile_bytes
        self.ring_rank, self.ring_size, self.seq_layout = ring_rank, ring_size, seq_layout
        self.name = f"ring({inner.name})"
        self.next, self.prev = (ring_rank + 1) % ring_size, (ring_rank - 1) % ring_size

    def schedule(self, block_len: int, causal: bool, docs=None) -> RingSchedule:
        """This call's ``RingSchedule`` (the same value on every rank of the ring)."""
        return ring_schedule(self.ring_size, self.seq_layout, block_len, bool(causal), None if docs is None else docs.cu_seqlens)

    def _tiles(self, pieces, q, explicit: bool):
        """``pieces`` (one step's rectangles); with ``explicit`` (scores held in memory) in
        row tiles of at most ``tile_bytes`` of scores."""
        if not explicit:
            return pieces
        row_bytes = q.shape[0] * q.shape[2] * q.shape[1] * acc_dtype(q.dtype).itemsize  # one query row's scores
        return tile_rows(pieces, max(1, self.tile_bytes // row_bytes))

    def _ring(self, comm: Communicator, tensors, sched: RingSchedule):
        """Yield ``(step, src, tensors)`` per ring step: the block of ring rank ``src`` this
        rank holds at that step (``tensors``: this rank's own at step 0), or ``None`` where
        the schedule does not bring it here. The next transfer (the schedule's hops only) is
        in flight while the caller computes."""
        j, held = self.ring_rank, tensors
        for step in range(self.ring_size):
            sends = [(self.next, t) for t in held] if held is not None and sched.sends(j, step) else []
            nxt = [torch.empty_like(t) for t in tensors] if sched.receives(j, step) else None
            recvs = [] if nxt is None else [(self.prev, t) for t in nxt]
            # Posted every step, empty or not (an empty one costs nothing on torch.distributed;
            # a communicator that matches calls by their order, as the thread fake does, sees
            # the same calls on every rank).
            work = comm.send_recv(sends, recvs, async_op=True)
            yield step, (j - step) % self.ring_size, held
            work.wait()
            held = nxt

    def forward(self, q, k, v, *, causal, scale, kv_map, needs_grad, docs=None):
        # How a K/V block meets the queries: "shared" (one KV head for every query head: its
        # gradient kept per query head until the end), "grouped" or "gathered" (per block).
        heads = KVGather.of(kv_map, k.shape[2], shared=True)
        sched = self.schedule(q.shape[1], causal, docs)
        kernel = None if docs is None else step_kernel(self.inner, q)
        k, v = k.contiguous(), v.contiguous()  # the send buffers of the first step
        acc = PartialAttention(q, v.shape[3])
        for _, src, block in self._ring(self.kv_comm, (k, v), sched):
            pieces = sched.pieces[self.ring_rank][src] if block is not None else ()
            if not pieces:
                continue  # no document here sees that block (or it did not come here): no compute
            kb, vb = block
            if kernel is not None:
                for rows, o, lse in attend_lse_pieces(q, *heads.gather(kb, vb), pieces, scale, kernel):
                    acc.add(rows, o, lse)
                continue
            for rows, cols, diag in self._tiles(pieces, q, self.inner.lse_scores_in_memory):
                o, lse = self.inner.attend_lse(q[:, rows], *heads.gather(kb[:, cols], vb[:, cols]), diag, scale)
                acc.add(rows, o, lse)
        out = acc.out.to(q.dtype)
        if not needs_grad:
            return out, None
        # A list that ``backward`` empties, as ``AttentionBackend``'s state; its tensors in
        # autograd's saved tensors, where checkpointing and offloading hooks see them.
        return out, [save_tensors(q, k, v, out, acc.lse), causal, scale, heads, sched]

    def backward_per_head(self, state, dout):
        """``dq``, ``dk``, ``dv``; for a shared KV head ``dk``/``dv`` per query head
        (``[B, L, hq, D]``, not yet summed). Empties ``state``.

        The dK/dV accumulator of block ``src`` starts at its owner, travels with the block
        (``grad_comm``) as far as the block goes (``sched.reach[src]`` hops; each rank on the
        way adds its part), and from the last rank goes home to ``src`` in one transfer (on
        the full ring that last rank is ``src - 1``, so it is the ordinary next hop). Every
        transfer is posted at the same step on both sides, at most one per rank and step."""
        saved, causal, scale, heads, sched = state
        state.clear()
        q, k, v, out, lse = saved.saved_tensors
        del saved
        j, R, dt = self.ring_rank, self.ring_size, acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        shared = heads.mode == "shared"
        # dK and dV accumulators: k's head dim and v's (MLA: they differ).
        travel = [(k.shape[0], k.shape[1], len(heads.kv_map) if shared else k.shape[2], x.shape[3]) for x in (k, v)]
        blank = lambda: tuple(torch.empty(t, dtype=dt, device=k.device) for t in travel)  # noqa: E731
        pending = None  # the grad channel's transfers of the previous step, overlapping this step's compute
        arriving = home = mine = None  # buffers: the accumulator of next step's block; this rank's own, coming home
        for step, src, block in self._ring(self.kv_comm, (k, v), sched):
            grads = []
            pieces = sched.pieces[j][src] if block is not None else ()
            for rows, cols, diag in self._tiles(pieces, q, True):  # the block backward is explicit
                kx, vx = heads.gather(block[0][:, cols], block[1][:, cols])
                dq_p, dk_p, dv_p = self.inner.attend_lse_backward(dout[:, rows], q[:, rows], kx, vx, out[:, rows], lse[:, :, rows], diag, scale)
                dq[:, rows] += dq_p
                grads.append((cols, *((dk_p, dv_p) if shared else heads.scatter(dk_p, dv_p))))
            if pending is not None:
                pending.wait()  # what arrived (and what was sent) at the previous step
            sends, recvs = [], []
            if block is not None:
                held = tuple(torch.zeros(t, dtype=dt, device=k.device) for t in travel) if step == 0 else arriving
                for cols, dk_p, dv_p in grads:
                    held[0][:, cols] += dk_p
                    held[1][:, cols] += dv_p
                if sched.sends(j, step):
                    sends = [(self.next, t) for t in held]
                elif step > 0:
                    sends = [(src, t) for t in held]  # the last rank of the block's path: home
                else:
                    mine = held  # the block went nowhere (a ring of one)
            arriving = blank() if sched.receives(j, step) else None
            recvs = [] if arriving is None else [(self.prev, t) for t in arriving]
            if step > 0 and step == sched.reach[j]:
                home = blank()
                recvs += [((j + step) % R, t) for t in home]
            pending = self.grad_comm.send_recv(sends, recvs, async_op=True)  # every step, as in ``_ring``
        pending.wait()
        if home is not None:
            mine = home
        dk, dv = mine
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def backward(self, state, dout):
        heads = state[3]
        dq, dk, dv = self.backward_per_head(state, dout)
        return (dq, *heads.scatter(dk, dv)) if heads.mode == "shared" else (dq, dk, dv)


def ring_backend(sp: SPGroups, base) -> RingBackend:
    """The ``RingBackend`` of this process in ``sp`` around ``base`` (``resolve_backend``'s
    pick). ``ValueError`` for a backend that cannot return the log-sum-exp."""
    if not getattr(base, "supports_lse", False) or not hasattr(base, "attend_lse"):
        raise ValueError(
            f"ulysses_attention: the ring level of a 2-D group needs a built-in attention backend that returns the "
            f"log-sum-exp (attn_fn=None, 'sdpa', 'math' or 'flash'), got attn_fn {getattr(base, 'name', base)!r}"
        )
    kv_comm, grad_comm = get_communicator(sp.ring_group), get_communicator(sp.ring_grad_group)
    return RingBackend(base, kv_comm, grad_comm, sp.ring_rank, sp.ring_size, sp.seq_layout)


def _ring_problems(sp: SPGroups, q, seq_lens) -> list[str]:
    """What the ring level cannot run, visible from this rank's own arguments."""
    out = []
    if seq_lens is not None and len({int(s) for s in seq_lens}) > 1:
        # The positions of ``ring.seq_layout`` assume equal shards (a packed sequence: pad it,
        # the padding a trailing document of its own: ``documents.pad_documents``).
        out.append(
            f"seq_lens {list(seq_lens)}: the ring level of a 2-D group needs equal shards on every rank "
            "(for packed documents pad the sequence: documents.pad_documents)"
        )
    if q.dim() == 4 and sp.ulysses_size > q.shape[2] >= 1:
        out.append(more_ranks_than_heads(sp.world_size, q.shape[2], f"the 2-D group's ulysses_size ({sp.ulysses_size})"))
    if q.dim() == 4 and sp.seq_layout == "zigzag" and (sp.ulysses_size * q.shape[1]) % 2:
        out.append(
            f"seq_layout 'zigzag' splits each ring block of ulysses_size * q.shape[1] = "
            f"{sp.ulysses_size} * {q.shape[1]} tokens in two halves: expected an even count"
        )
    return out


def _doc_problems(summary, batch: int, total: int) -> list[str]:
    how = "q.shape[1] x the 2-D group's size (equal shards)"
    if summary and (batch > 1 or summary[9] > 1):  # rows
        return [f"packed documents at batch {max(batch, summary[9])} on a 2-D group (SPGroups): the ring level takes one packed row (batch 1)"]
    return document_problems(summary, batch, total, how) if summary else []


def check_ring_inputs(sp: SPGroups, q, k, *, causal, scale_bits: int, seq_lens, failed: Exception | None, check: bool,
                      docs: Documents | None = None, v=None) -> None:  # fmt: skip
    """Agree across the whole 2-D group before any ring transfer: the Ulysses level's checks
    ran inside each Ulysses group (``failed``: this rank's error, or None); here every rank
    learns whether any rank failed and whether the Ulysses groups were given the same shapes,
    dtype and options, and raises the same ``UlyssesInputError`` (a rank whose own check
    failed raises its own error). Without ``check`` only this rank's problems are raised.

    ``docs`` (a packed sequence's global boundaries) are checked here, for the whole group:
    each rank's ``checks.document_summary`` travels in the same all-gather, and every rank
    raises the same error naming the ranks whose boundaries are bad (not from 0, not
    increasing, not ending at the global length ``q.shape[1] x`` the group's size) or that
    disagree with the others."""
    problems = _ring_problems(sp, q, seq_lens)
    summary = document_summary(docs)
    if not check or sp.world_size == 1:
        if problems:
            raise UlyssesInputError("ulysses_attention: " + "; ".join(problems))
        if failed is not None:
            raise failed
        local = _doc_problems(summary, q.shape[0], q.shape[1] * sp.world_size) if q.dim() == 4 else []
        if local:
            raise UlyssesInputError("ulysses_attention: " + "; ".join(local))
        return
    shape = [*q.shape, k.shape[2]] if q.dim() == 4 and k.dim() == 4 else [-1] * 5
    mine = [int(failed is not None or bool(problems)), *shape, dtype_code(q.dtype), int(bool(causal)), scale_bits]
    mine += [len(summary), *summary, *[0] * (DOC_FIELDS - len(summary))]
    mine.append(v.shape[3] if v is not None and v.dim() == 4 else -1)  # v_head_dim (MLA), last: row[-1]
    everyone = get_communicator(sp.group).all_gather_ints(mine, q.device)
    if problems:
        raise UlyssesInputError("ulysses_attention: " + "; ".join(problems))
    if failed is not None:
        raise failed
    bad = [r for r, row in enumerate(everyone) if row[0]]
    if bad:
        raise UlyssesInputError(f"ulysses_attention: {rank_list(bad)} of the 2-D group rejected their inputs (see the error on those ranks)")
    names = ("batch (q.shape[0])", "seq_local (q.shape[1])", "q_heads (q.shape[2])", "head_dim (q.shape[3])", "kv_heads (k.shape[2])",
             "dtype", "causal", "softmax_scale")  # fmt: skip
    for i, name in enumerate(names, start=1):
        values = [row[i] for row in everyone]
        if any(x != values[0] for x in values):
            raise UlyssesInputError(f"ulysses_attention: ranks of the 2-D group disagree on {name}: {by_value(values)} (codes for dtype/softmax_scale)")
    values = [row[-1] for row in everyone]
    if any(x != values[0] for x in values):
        raise UlyssesInputError(f"ulysses_attention: ranks of the 2-D group disagree on v_head_dim (v.shape[3]): {by_value(values)}")
    summaries = [tuple(row[10 : 10 + row[9]]) for row in everyone]
    where: dict[str, list[int]] = {}  # each distinct problem once, with the ranks that have it
    for r, (row, theirs) in enumerate(zip(everyone, summaries)):
        for p in _doc_problems(theirs, row[1], row[2] * sp.world_size):
            where.setdefault(p, []).append(r)
    if where:
        raise UlyssesInputError("ulysses_attention: " + "; ".join(f"{rank_list(rs)}: {p}" for p, rs in where.items()))
    differ = []
    for what, values in (("max_seqlen", [x[6] if x else None for x in summaries]), ("cu_seqlens", [document_text(x) for x in summaries])):
        if any(x != values[0] for x in values):
            differ.append(f"ranks of the 2-D group disagree on {what}: {by_value(values)}")
    if differ:
        raise UlyssesInputError("ulysses_attention: " + "; ".join(differ))
