"""Ring attention over the ring group, as the attention backend of a rank of a 2-D group.

After the Ulysses exchange inside its Ulysses group, a rank holds for its heads the block of
its ring rank ``j`` (``ring.seq_layout``): ``q`` ``[B, L, hq, D]``, ``k``/``v`` ``[B, L, hkv, D]``.
``RingBackend`` computes full attention of that ``q`` over the whole sequence:

Forward, ring step ``t = 0 .. R-1`` (``R`` ring ranks; ``src = (j - t) % R`` owns the K/V block
held at step t)::

    post: send the held K/V block to ring rank j+1, receive the next one from j-1  (async)
    compute: the rectangles of (j, src) (``layout.block_pieces``) with the inner backend's
             ``attend_lse``, merged into the running result (``merge.PartialAttention``)
    wait for the transfer

so each block's transfer overlaps that block's attention. Backward (the standard ring
backward): K/V go around the ring again on the same channel, every block's gradients are
recomputed against the *final* output and log-sum-exp (``attend_lse_backward``), dQ is
summed locally, and the dK/dV of block ``src`` are added into an accumulator that travels
with it on a channel of its own (``SPGroups.ring_grad_group``): after the last step each
accumulator arrives at its owner.

Point to point: each step is one ``Communicator.send_recv`` per channel, sends posted
before receives. On gloo torch posts them one by one (``isend``, then ``irecv``; no
coalescing) and nothing blocks before ``wait()``, so no rank waits on a peer that waits on
it; the two channels are separate process groups, so their messages never match each other.

KV heads: ``kv_map`` as in ``backends``. K/V travel with the rank's ``hkv`` heads (never
expanded on the wire); a non-uniform map is gathered per block after the wire, and its
gradients summed back before they travel. A rank whose query heads all share its one KV head
(``gqa.shares_one_kv``, ``gqa.KVGather``'s ``"shared"`` mode) accumulates per-query-head dK/dV and sums them in head order
at the end (``backward_per_head`` is what the chunked pipeline's ``SharedKV`` path calls).
"""

from __future__ import annotations

import torch

from ..checkpointing import save_tensors
from ..checks import UlyssesInputError, by_value, dtype_code, rank_list
from ..comm import Communicator, get_communicator
from ..gqa import KVGather
from ..plan import more_ranks_than_heads
from .groups import SPGroups
from .merge import PartialAttention, acc_dtype
from .seq_layout import block_chunks, block_pieces, tile_rows

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
    and its peers hold."""

    def __init__(self, inner, kv_comm: Communicator, grad_comm: Communicator, ring_rank: int, ring_size: int, seq_layout: str,
                 tile_bytes: int = TILE_BYTES):  # fmt: skip
        self.inner, self.kv_comm, self.grad_comm, self.tile_bytes = inner, kv_comm, grad_comm, tile_bytes
        self.ring_rank, self.ring_size, self.seq_layout = ring_rank, ring_size, seq_layout
        self.name = f"ring({inner.name})"
        self.next, self.prev = (ring_rank + 1) % ring_size, (ring_rank - 1) % ring_size

    def _pieces(self, src: int, q, causal: bool, explicit: bool):
        """The rectangles of the step that holds ring rank ``src``'s block; with ``explicit``
        (scores held in memory) in row tiles of at most ``tile_bytes`` of scores."""
        q_chunks = block_chunks(self.ring_rank, self.ring_size, self.seq_layout)[0]
        kv_chunks = block_chunks(src, self.ring_size, self.seq_layout)[0]
        pieces = block_pieces(q_chunks, kv_chunks, q.shape[1], causal)
        if not explicit:
            return pieces
        row_bytes = q.shape[0] * q.shape[2] * q.shape[1] * acc_dtype(q.dtype).itemsize  # one query row's scores
        return tile_rows(pieces, max(1, self.tile_bytes // row_bytes))

    def _ring(self, comm: Communicator, tensors):
        """Yield ``(src, tensors)`` per ring step: this rank's blocks, then each block from
        the previous ring rank; the next transfer is in flight while the caller computes."""
        held = tensors
        for step in range(self.ring_size):
            work = nxt = None
            if step + 1 < self.ring_size:
                nxt = [torch.empty_like(t) for t in held]
                work = comm.send_recv([(self.next, t) for t in held], [(self.prev, t) for t in nxt], async_op=True)
            yield (self.ring_rank - step) % self.ring_size, held
            if work is not None:
                work.wait()
                held = nxt

    def forward(self, q, k, v, *, causal, scale, kv_map, needs_grad):
        # How a K/V block meets the queries: "shared" (one KV head for every query head: its
        # gradient kept per query head until the end), "grouped" or "gathered" (per block).
        heads = KVGather.of(kv_map, k.shape[2], shared=True)
        k, v = k.contiguous(), v.contiguous()  # the send buffers of the first step
        acc = PartialAttention(q)
        for src, (kb, vb) in self._ring(self.kv_comm, (k, v)):
            for rows, cols, diag in self._pieces(src, q, causal, self.inner.lse_scores_in_memory):
                o, lse = self.inner.attend_lse(q[:, rows], *heads.gather(kb[:, cols], vb[:, cols]), diag, scale)
                acc.add(rows, o, lse)
        out = acc.out.to(q.dtype)
        if not needs_grad:
            return out, None
        # A list that ``backward`` empties, as ``AttentionBackend``'s state; its tensors in
        # autograd's saved tensors, where checkpointing and offloading hooks see them.
        return out, [save_tensors(q, k, v, out, acc.lse), causal, scale, heads]

    def backward_per_head(self, state, dout):
        """``dq``, ``dk``, ``dv``; for a shared KV head ``dk``/``dv`` per query head
        (``[B, L, hq, D]``, not yet summed). Empties ``state``."""
        saved, causal, scale, heads = state
        state.clear()
        q, k, v, out, lse = saved.saved_tensors
        del saved
        dt = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        shared = heads.mode == "shared"
        travel = (k.shape[0], k.shape[1], len(heads.kv_map) if shared else k.shape[2], k.shape[3])
        pending = None  # (work, (dk, dv)) of the accumulator arriving from the previous ring rank
        for src, (kb, vb) in self._ring(self.kv_comm, (k, v)):
            grads = []
            for rows, cols, diag in self._pieces(src, q, causal, True):  # the block backward is explicit
                kx, vx = heads.gather(kb[:, cols], vb[:, cols])
                dq_p, dk_p, dv_p = self.inner.attend_lse_backward(dout[:, rows], q[:, rows], kx, vx, out[:, rows], lse[:, :, rows], diag, scale)
                dq[:, rows] += dq_p
                grads.append((cols, *((dk_p, dv_p) if shared else heads.scatter(dk_p, dv_p))))
            if pending is None:
                held = (torch.zeros(travel, dtype=dt, device=k.device), torch.zeros(travel, dtype=dt, device=k.device))
            else:
                pending[0].wait()
                held = pending[1]
            for cols, dk_p, dv_p in grads:
                held[0][:, cols] += dk_p
                held[1][:, cols] += dv_p
            pending = self._pass_on(held) if self.ring_size > 1 else (None, held)
        if pending[0] is not None:
            pending[0].wait()  # the accumulator of this rank's own block, back home
        dk, dv = pending[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def _pass_on(self, held):
        """Send block gradients to the next ring rank, receive the previous rank's."""
        recv = tuple(torch.empty_like(t) for t in held)
        work = self.grad_comm.send_recv([(self.next, t) for t in held], [(self.prev, t) for t in recv], async_op=True)
        return work, recv

    def backward(self, state, dout):
        heads = state[-1]
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
        # Packed or uneven sequences with the ring level: not supported yet (the positions
        # of ``ring.seq_layout`` assume equal shards).
        out.append(f"seq_lens {list(seq_lens)}: the ring level of a 2-D group needs equal shards on every rank")
    if q.dim() == 4 and sp.ulysses_size > q.shape[2] >= 1:
        out.append(more_ranks_than_heads(sp.world_size, q.shape[2], f"the 2-D group's ulysses_size ({sp.ulysses_size})"))
    if q.dim() == 4 and sp.seq_layout == "zigzag" and (sp.ulysses_size * q.shape[1]) % 2:
        out.append(
            f"seq_layout 'zigzag' splits each ring block of ulysses_size * q.shape[1] = "
            f"{sp.ulysses_size} * {q.shape[1]} tokens in two halves: expected an even count"
        )
    return out


def check_ring_inputs(sp: SPGroups, q, k, *, causal, scale_bits: int, seq_lens, failed: Exception | None, check: bool) -> None:
    """Agree across the whole 2-D group before any ring transfer: the Ulysses level's checks
    ran inside each Ulysses group (``failed``: this rank's error, or None); here every rank
    learns whether any rank failed and whether the Ulysses groups were given the same shapes,
    dtype and options, and raises the same ``UlyssesInputError`` (a rank whose own check
    failed raises its own error). Without ``check`` only this rank's problems are raised."""
    problems = _ring_problems(sp, q, seq_lens)
    if not check or sp.world_size == 1:
        if problems:
            raise UlyssesInputError("ulysses_attention: " + "; ".join(problems))
        if failed is not None:
            raise failed
        return
    shape = [*q.shape, k.shape[2]] if q.dim() == 4 and k.dim() == 4 else [-1] * 5
    mine = [int(failed is not None or bool(problems)), *shape, dtype_code(q.dtype), int(bool(causal)), scale_bits]
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
