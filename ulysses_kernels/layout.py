"""The layout math of the two all-to-alls, in one place: ``Layout``, the sizes of one call
as seen from one rank, and from it every split, offset, head range and view the exchanges
and the kernel sets use. The kernel sets (``ulysses_kernels.kernels``: the pure-PyTorch one,
the definition, then Triton and C++/CUDA) move the bytes; nothing here copies data.

Notation: ``P`` ranks, rank ``r`` holds ``s_r`` tokens (``seq_lens[r]``), ``S = sum(s_r)``,
``B`` batch, ``D`` head_dim. A *role* is one tensor family moved together: ``"q"`` moves
the query-head ranges of the plan, ``"kv"`` the KV-head ranges. The q/k/v all-to-all moves
the roles ``("q", "kv", "kv")``; the output and dout move ``("q",)``. Everything is
batch-major, the layout attention kernels read and write (``[B, S, h, D]``, rows of ``D``
contiguous), so neither side of an all-to-all needs a second copy.

Sequence-sharded to head-sharded (q/k/v forward, dout backward), seen from rank ``r``::

    send buffer (1-D)                       block for peer p, batch-major:
    +---------+---------+-----+              [B][s_r][h_q(p) | h_k(p) | h_v(p)][D]
    | peer 0  | peer 1  | ... |              heads of the roles side by side
    +---------+---------+-----+

    receive buffer = [B][S][h_q(r) | h_k(r) | h_v(r)][D]
    q, k, v are ``[B, S, h, D]`` views of it (no receive-side copy). Source p's rows for
    batch element b, ``[b, off_p : off_p + s_p]``, are one contiguous piece, as is the
    send block's ``[b]`` slice: with batch 1 one ``all_to_all`` moves everything; with a
    larger batch one grouped send/recv per (peer, batch element) does, and the rank's own
    block is packed straight into its rows of the receive buffer (``pack_s2h(recv=...)``):
    the send buffer then holds the peers' blocks only (``s2h_send_splits(own=False)``).

Head-sharded to sequence-sharded (output forward, dq/dk/dv backward). Wire format of the
block rank ``p`` sends to rank ``r`` for one role: ``[B][s_r][h(p)][D]``. A local tensor
``[B, S, h, D]`` whose rows are contiguous per batch element (``x[b]`` contiguous, what
attention kernels return) is sent in place, one piece per (peer, batch element);
otherwise it is first made contiguous. The receiver writes each block into
``[B, s_r, H, D]`` and sums KV heads that several ranks hold, in rank order
(deterministic, once per replica); its own block is read from the local tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .plan import HeadPlan

__all__ = ["Layout", "QKV", "Q_ONLY", "split_lengths"]

QKV = ("q", "kv", "kv")
Q_ONLY = ("q",)


def split_lengths(total: int, world: int) -> list[int]:
    """The project's rule for uneven shards: contiguous, as even as possible, the first
    ``total % world`` ranks one token longer."""
    base, extra = divmod(total, world)
    return [base + (r < extra) for r in range(world)]


@dataclass(frozen=True)
class Layout:
    """Sizes of one all-to-all call as seen from ``rank``."""

    plan: HeadPlan
    rank: int
    seq_lens: tuple[int, ...]
    batch: int
    head_dim: int

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def seq_total(self) -> int:
        return sum(self.seq_lens)

    @property
    def seq_local(self) -> int:
        return self.seq_lens[self.rank]

    def seq_offset(self, rank: int) -> int:
        return sum(self.seq_lens[:rank])

    def head_range(self, role: str, rank: int) -> tuple[int, int]:
        return self.plan.q_ranges[rank] if role == "q" else self.plan.kv_ranges[rank]

    def head_count(self, role: str, rank: int) -> int:
        a, b = self.head_range(role, rank)
        return b - a

    def heads(self, roles: Sequence[str], rank: int) -> int:
        return sum(self.head_count(s, rank) for s in roles)

    def total_heads(self, role: str) -> int:
        return self.plan.q_heads if role == "q" else self.plan.kv_heads

    def head_ranges(self, roles: Sequence[str]) -> list[int]:
        """``[peer][role][start, end]`` flattened: every peer's head range per role, the
        ``head_ranges`` argument of the C++ pack and unpack ops."""
        return [x for p in range(self.world_size) for s in roles for x in self.head_range(s, p)]

    # ---- sequence-sharded -> head-sharded -------------------------------------------
    def s2h_send_splits(self, roles: Sequence[str], own: bool = True) -> list[int]:
        """Elements of each peer's block of the send buffer. ``own=False``: this rank's own
        block is 0, the buffer of ``pack_s2h(recv=...)`` (its own rows go to the receive
        buffer instead)."""
        per_token = self.batch * self.head_dim
        return [0 if p == self.rank and not own else self.seq_local * per_token * self.heads(roles, p) for p in range(self.world_size)]

    def s2h_recv_splits(self, roles: Sequence[str]) -> list[int]:
        """Elements this rank receives from each source."""
        per_token = self.batch * self.head_dim * self.heads(roles, self.rank)
        return [s * per_token for s in self.seq_lens]

    def s2h_send_views(self, send: torch.Tensor, roles: Sequence[str], recv: torch.Tensor | None = None):
        """Per peer, per role: the ``[B, s_r, h, D]`` destination of that peer's heads.

        Blocks of the flat send buffer; with ``recv`` given, this rank's own block is its
        rows of the receive buffer instead, and ``send`` holds the peers' blocks only
        (``s2h_send_splits(roles, own=False)`` elements)."""
        views, start = [], 0
        for p, n in enumerate(self.s2h_send_splits(roles, own=recv is None)):
            counts = [self.head_count(s, p) for s in roles]
            if p == self.rank and recv is not None:
                off = self.seq_offset(p)
                block = self._recv4(recv, roles)[:, off : off + self.seq_local]
            else:
                block = send[start : start + n].view(self.batch, self.seq_local, sum(counts), self.head_dim)
            views.append(_split_heads(block, counts))
            start += n
        return views

    def _recv4(self, recv: torch.Tensor, roles: Sequence[str]) -> torch.Tensor:
        return recv.view(self.batch, self.seq_total, self.heads(roles, self.rank), self.head_dim)

    def s2h_send_pieces(self, send: torch.Tensor, roles: Sequence[str], own: bool = True) -> list[list[torch.Tensor]]:
        """Per peer, per batch element: the contiguous piece of the send buffer (``own``:
        as ``s2h_send_splits``; without its own block, this rank's entry is empty)."""
        pieces, start = [], 0
        for n in self.s2h_send_splits(roles, own=own):
            pieces.append(list(send[start : start + n].view(self.batch, -1).unbind(0)))
            start += n
        return pieces

    def s2h_recv_pieces(self, recv: torch.Tensor, roles: Sequence[str]) -> list[list[torch.Tensor]]:
        """Per source, per batch element: the contiguous piece of the receive buffer."""
        full = self._recv4(recv, roles)
        return [
            [full[b, self.seq_offset(p) : self.seq_offset(p) + self.seq_lens[p]].reshape(-1) for b in range(self.batch)]
            for p in range(self.world_size)
        ]

    def s2h_recv_views(self, recv: torch.Tensor, roles: Sequence[str]) -> list[torch.Tensor]:
        """The received tensors as ``[B, S, h, D]`` views of the flat receive buffer."""
        return _split_heads(self._recv4(recv, roles), [self.head_count(s, self.rank) for s in roles])

    # ---- head-sharded -> sequence-sharded -------------------------------------------
    def h2s_splits(self, roles: Sequence[str]) -> tuple[list[int], list[int]]:
        """(send, receive) elements per peer for the head-to-sequence all-to-all."""
        per = self.batch * self.head_dim
        send = [self.seq_lens[p] * per * self.heads(roles, self.rank) for p in range(self.world_size)]
        recv = [self.seq_local * per * self.heads(roles, p) for p in range(self.world_size)]
        return send, recv

    def h2s_send_blocks(self, local: torch.Tensor, peer: int) -> torch.Tensor:
        """Rows of a local ``[B, S, h, D]`` tensor bound for ``peer``: ``[B, s_p, h, D]``."""
        start = self.seq_offset(peer)
        return local[:, start : start + self.seq_lens[peer]]

    def h2s_recv_slices(self, recv: torch.Tensor, roles: Sequence[str]) -> list[list[torch.Tensor]]:
        """Per source, per role: the flat slice of the receive buffer it lands in
        (source-major, then role-major)."""
        slices, start = [], 0
        for p in range(self.world_size):
            per_role = []
            for s in roles:
                n = self.seq_local * self.batch * self.head_count(s, p) * self.head_dim
                per_role.append(recv[start : start + n])
                start += n
            slices.append(per_role)
        return slices

    def h2s_recv_views(self, recv: torch.Tensor, roles: Sequence[str]) -> list[list[torch.Tensor]]:
        """Per source, per role: the received wire-format block as ``[B, s_r, h, D]``."""
        return [
            [x.view(self.batch, self.seq_local, self.head_count(s, p), self.head_dim) for x, s in zip(per_role, roles)]
            for p, per_role in enumerate(self.h2s_recv_slices(recv, roles))
        ]

def _split_heads(x: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    out, start = [], 0
    for c in counts:
        out.append(x[:, :, start : start + c])
        start += c
    return out


def rows_contiguous(x: torch.Tensor) -> bool:
    """True when ``x`` (``[B, S, h, D]``) can be sent in wire format without a copy."""
    return x.shape[0] == 0 or x[0].is_contiguous()
