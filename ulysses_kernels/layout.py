"""The layout math of the two all-to-alls, in one place: ``Layout``, the sizes of one call
as seen from one rank, and from it every split, offset, head range and view the exchanges
and the kernel sets use. The kernel sets (``ulysses_kernels.kernels``: the pure-PyTorch one,
the definition, then Triton and C++/CUDA) move the bytes; nothing here copies data.

Notation: ``P`` ranks, rank ``r`` holds ``s_r`` tokens (``seq_lens[r]``), ``S = sum(s_r)``,
``B`` batch, ``D`` head_dim. A *role* is one tensor family moved together, with its head
ranges and its head dim: ``"q"`` moves the query-head ranges of the plan at ``head_dim``
(q), ``"kv"`` the KV-head ranges at ``head_dim`` (k), ``"v"`` the KV-head ranges at
``v_head_dim`` (v), ``"o"`` the query-head ranges at ``v_head_dim`` (the attention output
and its gradient). The q/k/v all-to-all moves the roles ``("q", "kv", "v")`` (dq/dk/dv the
same); the output and dout move ``("o",)``. With MLA (DeepSeek-V2/V3, MiniCPM3) ``v_head_dim``
differs from ``head_dim``; each role travels at its own width (v is never padded on the
wire), so a token's row of a block is ``h_q * D + h_k * D + h_v * Dv`` elements, not a
multiple of one head dim. Everything is batch-major, the layout attention kernels read
and write (``[B, S, h, D]``, rows of ``D`` contiguous), so neither side of an all-to-all
needs a second copy.

Sequence-sharded to head-sharded (q/k/v forward, dout backward), seen from rank ``r``::

    send buffer (1-D)                       block for peer p, batch-major:
    +---------+---------+-----+              [B][s_r][h_q(p)*D | h_k(p)*D | h_v(p)*Dv]
    | peer 0  | peer 1  | ... |              heads of the roles side by side
    +---------+---------+-----+

    receive buffer = [B][S][h_q(r)*D | h_k(r)*D | h_v(r)*Dv]
    q, k, v are ``[B, S, h, D]`` (v: ``Dv``) views of it (no receive-side copy). Source p's rows for
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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .plan import HeadPlan
from .tracing import in_trace

__all__ = ["Layout", "S2HRoute", "H2SRoute", "Routes", "QKV", "Q_ONLY", "OUT", "split_lengths"]

QKV = ("q", "kv", "v")
Q_ONLY = ("q",)
OUT = ("o",)  # the attention output and dout: query heads at v_head_dim
_Q_RANGES = frozenset(("q", "o"))  # roles that move the plan's query-head ranges
_V_DIM = frozenset(("v", "o"))  # roles that move v_head_dim elements per head


def split_lengths(total: int, world: int) -> list[int]:
    """The project's rule for uneven shards: contiguous, as even as possible, the first
    ``total % world`` ranks one token longer."""
    base, extra = divmod(total, world)
    return [base + (r < extra) for r in range(world)]


@dataclass(frozen=True)
class Layout:
    """Sizes of one all-to-all call as seen from ``rank``.

    A value: the splits, head ranges and KV map below are computed once per layout and kept
    on it (``_memo``; a resolved call reuses its layout, so its exchanges compute none of
    them again), as is its hash (layouts key caches). Inside ``torch.compile`` they are
    computed while tracing (kept nowhere) and become constants of the graph.

    ``head_dim``: q's and k's (roles ``"q"``, ``"kv"``); ``v_head_dim``: v's and the
    output's (roles ``"v"``, ``"o"``), ``None`` for ``head_dim`` (stored as that value, so
    two layouts of the same sizes are equal however they were written)."""

    plan: HeadPlan
    rank: int
    seq_lens: tuple[int, ...]
    batch: int
    head_dim: int
    v_head_dim: int | None = None

    def __post_init__(self):
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    def __hash__(self) -> int:
        # Layouts key the caches of a call's pieces: hash the fields once per layout.
        h = self.__dict__.get("_hash_")
        if h is None:
            h = hash((self.plan, self.rank, self.seq_lens, self.batch, self.head_dim, self.v_head_dim))
            if not in_trace():
                self.__dict__["_hash_"] = h
        return h

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

    def _memo(self, key, build):
        """``build()``, computed once per ``key`` for this layout (its sizes never change)."""
        if in_trace():
            return build()
        memo = self.__dict__.get("_memo_")
        if memo is None:
            memo = self.__dict__["_memo_"] = {}
        value = memo.get(key)
        if value is None:
            value = memo[key] = build()
        return value

    def padded_rows(self, extra: int) -> Layout:
        """This layout with every head ``extra`` elements longer (head dims ``D + extra`` and
        ``Dv + extra``): an FP8 wire's buffers in bytes, ``D`` values and a 4-byte scale per
        row (``wire.wire_layout``). Kept on this layout."""
        if extra == 0:
            return self
        return self._memo(("padded", extra), lambda: Layout(self.plan, self.rank, self.seq_lens, self.batch, self.head_dim + extra, self.v_head_dim + extra))

    def s2h_route(self, roles: Sequence[str], extra: int = 0) -> S2HRoute:
        """Every size the sequence-to-head exchange of ``roles`` cuts its buffers by, from this
        rank (``S2HRoute``); ``extra``: the buffers' rows are that much longer (an FP8 wire:
        ``padded_rows``). Computed once per layout, roles and ``extra``."""
        roles = tuple(roles)

        def build():
            lay, B, P, r = self.padded_rows(extra), self.batch, self.world_size, self.rank
            peer_splits = lay.s2h_send_splits(roles, own=False)
            _, counts, heads, widths = lay._roles(roles)
            w = widths[r]
            return S2HRoute(
                layout=self,
                roles=roles,
                send_splits=tuple(lay.s2h_send_splits(roles)),
                recv_splits=tuple(lay.s2h_recv_splits(roles)),
                peer_send=sum(peer_splits),
                send_pieces=tuple(n // B for n in peer_splits for _ in range(B)),
                recv_pieces=tuple(n * w for _ in range(B) for n in self.seq_lens),
                width=w,
                recv_shape=(B, self.seq_total, heads[r], lay.head_dim) if lay.uniform else (B, self.seq_total, w),
                role_sizes=counts[r] if lay.uniform else tuple(c * lay.dim(s) for c, s in zip(counts[r], roles)),
                view_shapes=tuple((B, self.seq_total, c, lay.dim(s)) for c, s in zip(counts[r], roles)),
                out_shapes=tuple((B, self.seq_total, self.head_count(s, r), self.dim(s)) for s in roles),
                peers=tuple(p for p in range(P) if p != r),
            )

        return self._memo(("s2h_route", roles, extra), build)

    def h2s_route(self, roles: Sequence[str], extra: int = 0) -> H2SRoute:
        """Every size the head-to-sequence exchange of ``roles`` cuts its buffers by, from this
        rank (``H2SRoute``; ``extra`` as for ``s2h_route``). Computed once per layout, roles
        and ``extra``."""
        roles = tuple(roles)

        def build():
            lay, B = self.padded_rows(extra), self.batch
            send, recv = lay.h2s_splits(roles)
            shapes = lay.h2s_block_shapes(roles)
            peers = tuple(p for p in range(self.world_size) if p != self.rank)
            peer_sizes = tuple(math.prod(x) for p in peers for x in shapes[p])
            return H2SRoute(
                layout=self,
                wire=lay,
                roles=roles,
                send_splits=tuple(send),
                recv_splits=tuple(recv),
                block_shapes=shapes,
                block_sizes=tuple(math.prod(x) for per in shapes for x in per),
                peer_block_sizes=peer_sizes,
                peer_pieces=tuple(x // B for x in peer_sizes for _ in range(B)),
                row_starts=tuple(self.seq_offset(p) for p in range(self.world_size)),
                out_shapes=tuple((B, self.seq_local, self.total_heads(s), self.dim(s)) for s in roles),
                peers=peers,
            )

        return self._memo(("h2s_route", roles, extra), build)

    def routes(self, roles: Sequence[str], out: bool, extras: tuple[int, int, int, int] = (0, 0, 0, 0)) -> Routes:
        """The routes of one call's exchanges (``Routes``): ``roles`` to heads and their
        gradients back (none for an empty ``roles``), with ``out`` the output back and its
        gradient to heads; ``extras``: per exchange (qkv, out, dout, grads) the ``extra`` of
        ``s2h_route``/``h2s_route`` (an FP8 wire's scale bytes, or 0). Kept on this layout."""
        roles = tuple(roles)

        def build():
            x_qkv, x_out, x_dout, x_grads = extras
            return Routes(
                qkv=self.s2h_route(roles, x_qkv) if roles else None,
                out=self.h2s_route(OUT, x_out) if out else None,
                dout=self.s2h_route(OUT, x_dout) if out else None,
                grads=self.h2s_route(roles, x_grads) if roles else None,
            )

        return self._memo(("routes", roles, out, extras), build)

    def with_plan(self, plan: HeadPlan) -> Layout:
        """This layout with another plan (a chunk's, a replica sum's): same rank, lengths,
        batch and head dims."""
        return Layout(plan, self.rank, self.seq_lens, self.batch, self.head_dim, self.v_head_dim)

    @property
    def uniform(self) -> bool:
        """Every role has the same head dim (no MLA)."""
        return self.v_head_dim == self.head_dim

    def dim(self, role: str) -> int:
        """The head dim ``role`` moves: ``v_head_dim`` for ``"v"`` and ``"o"``, else ``head_dim``."""
        return self.v_head_dim if role in _V_DIM else self.head_dim

    def row_dim(self, roles: Sequence[str]) -> int:
        """The largest number of elements that divides every head of ``roles``: the head dim,
        or with MLA's mixed head dims their greatest common divisor. The Triton and C++
        kernel sets move rows of one length: each head of ``d`` elements goes as ``d /
        row_dim`` rows (the same bytes in the same places)."""
        g = 0
        for s in roles:
            a, b = g, self.dim(s)
            while b:  # Euclid (math.gcd does not trace under torch.compile)
                a, b = b, a % b
            g = a
        return g

    def head_range(self, role: str, rank: int) -> tuple[int, int]:
        return self.plan.q_ranges[rank] if role in _Q_RANGES else self.plan.kv_ranges[rank]

    def head_count(self, role: str, rank: int) -> int:
        a, b = self.head_range(role, rank)
        return b - a

    def heads(self, roles: Sequence[str], rank: int) -> int:
        return self._roles(roles)[2][rank]

    def peer_ranges(self, roles: Sequence[str]) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per peer, per role: the ``(start, end)`` head range (``head_range``)."""
        return self._roles(roles)[0]

    def width(self, roles: Sequence[str], rank: int) -> int:
        """Elements of one token of ``rank``'s block: ``sum(heads * dim)`` over ``roles``."""
        return self._roles(roles)[3][rank]

    def _roles(self, roles: Sequence[str]):
        """``(ranges, counts, heads, widths)`` of ``roles``: per peer, per role the head range
        and head count; per peer the heads of all roles together, and the elements of one
        token of its block (``sum(count * dim)``: roles may differ in head dim)."""
        roles = tuple(roles)

        def build():
            ranges = tuple(tuple(self.head_range(s, p) for s in roles) for p in range(self.world_size))
            counts = tuple(tuple(b - a for a, b in per) for per in ranges)
            dims = tuple(self.dim(s) for s in roles)
            widths = tuple(sum(c * d for c, d in zip(per, dims)) for per in counts)
            return ranges, counts, tuple(sum(c) for c in counts), widths

        return self._memo(("roles", roles), build)

    def total_heads(self, role: str) -> int:
        return self.plan.q_heads if role in _Q_RANGES else self.plan.kv_heads

    @property
    def kv_map(self) -> tuple[int, ...]:
        """For each of this rank's query heads, its local KV head (``HeadPlan.local_kv_map``)."""
        return self._memo("kv_map", lambda: self.plan.local_kv_map(self.rank))

    def head_ranges(self, roles: Sequence[str]) -> list[int]:
        """``[peer][role][start, end]`` flattened: every peer's head range per role, the
        ``head_ranges`` argument of the C++ pack and unpack ops."""
        roles = tuple(roles)
        return list(self._memo(("ranges", roles), lambda: tuple(x for per in self.peer_ranges(roles) for pair in per for x in pair)))

    # ---- sequence-sharded -> head-sharded -------------------------------------------
    def s2h_send_splits(self, roles: Sequence[str], own: bool = True) -> list[int]:
        """Elements of each peer's block of the send buffer. ``own=False``: this rank's own
        block is 0, the buffer of ``pack_s2h(recv=...)`` (its own rows go to the receive
        buffer instead)."""
        roles = tuple(roles)

        def build():
            return tuple(0 if p == self.rank and not own else self.seq_local * self.batch * self.width(roles, p) for p in range(self.world_size))

        return list(self._memo(("s2h_send", roles, own), build))

    def s2h_recv_splits(self, roles: Sequence[str]) -> list[int]:
        """Elements this rank receives from each source."""
        roles = tuple(roles)
        per_token = self.batch * self.width(roles, self.rank)
        return list(self._memo(("s2h_recv", roles), lambda: tuple(s * per_token for s in self.seq_lens)))

    def s2h_send_views(self, send: torch.Tensor, roles: Sequence[str], recv: torch.Tensor | None = None):
        """Per peer, per role: the ``[B, s_r, h, D]`` destination of that peer's heads.

        Blocks of the flat send buffer; with ``recv`` given, this rank's own block is its
        rows of the receive buffer instead, and ``send`` holds the peers' blocks only
        (``s2h_send_splits(roles, own=False)`` elements)."""
        views, start = [], 0
        _, counts, heads, widths = self._roles(roles)
        for p, n in enumerate(self.s2h_send_splits(roles, own=recv is None)):
            if p == self.rank and recv is not None:
                block = self._recv4(recv, roles)
                if self.world_size > 1:  # else its rows are all of them
                    block = block.narrow(1, self.seq_offset(p), self.seq_local)
            elif self.uniform:
                block = send.narrow(0, start, n).view(self.batch, self.seq_local, heads[p], self.head_dim)
            else:
                block = send.narrow(0, start, n).view(self.batch, self.seq_local, widths[p])
            views.append(self._split_roles(block, roles, counts[p]))
            start += n
        return views

    def _split_roles(self, x: torch.Tensor, roles: Sequence[str], counts: Sequence[int]) -> list[torch.Tensor]:
        """One ``[B, s, h, D]`` view per role of a block: ``x`` is ``[B, s, heads, D]`` when
        the roles share one head dim, else ``[B, s, width]`` (rows of one token)."""
        if self.uniform:
            return _split_heads(x, counts)
        dims = [self.dim(s) for s in roles]
        parts = x.split_with_sizes([c * d for c, d in zip(counts, dims)], dim=2)
        return [part.view(x.shape[0], x.shape[1], c, d) for part, c, d in zip(parts, counts, dims)]

    def _recv4(self, recv: torch.Tensor, roles: Sequence[str]) -> torch.Tensor:
        """The receive buffer as ``[B, S, h, D]`` (one head dim) or ``[B, S, width]``."""
        roles = tuple(roles)
        if self.uniform:
            return recv.view(self._memo(("recv4", roles), lambda: (self.batch, self.seq_total, self.heads(roles, self.rank), self.head_dim)))
        return recv.view(self.batch, self.seq_total, self.width(roles, self.rank))

    def s2h_send_pieces(self, send: torch.Tensor, roles: Sequence[str], own: bool = True) -> list[list[torch.Tensor]]:
        """Per peer, per batch element: the contiguous piece of the send buffer (``own``:
        as ``s2h_send_splits``; without its own block, this rank's pieces are empty). One
        ``split_with_sizes`` cuts them all (each peer's block is ``[B][s_r][width]``)."""
        B, splits = self.batch, self.s2h_send_splits(roles, own=own)
        cut = send.split_with_sizes([n // B for n in splits for _ in range(B)])
        return [list(cut[p * B : (p + 1) * B]) for p in range(len(splits))]

    def s2h_recv_pieces(self, recv: torch.Tensor, roles: Sequence[str]) -> list[list[torch.Tensor]]:
        """Per source, per batch element: the contiguous piece of the receive buffer
        ``[B][S][width]`` (source p's rows of batch element b). One ``split_with_sizes``."""
        w, P = self.width(roles, self.rank), self.world_size
        cut = recv.split_with_sizes([n * w for _ in range(self.batch) for n in self.seq_lens])
        return [[cut[b * P + p] for b in range(self.batch)] for p in range(P)]

    def s2h_recv_views(self, recv: torch.Tensor, roles: Sequence[str]) -> list[torch.Tensor]:
        """The received tensors as ``[B, S, h, D]`` views of the flat receive buffer."""
        return self._split_roles(self._recv4(recv, roles), roles, self._roles(roles)[1][self.rank])

    # ---- head-sharded -> sequence-sharded -------------------------------------------
    def h2s_splits(self, roles: Sequence[str]) -> tuple[list[int], list[int]]:
        """(send, receive) elements per peer for the head-to-sequence all-to-all."""
        roles, per = tuple(roles), self.batch

        def build():
            send = tuple(self.seq_lens[p] * per * self.width(roles, self.rank) for p in range(self.world_size))
            return send, tuple(self.seq_local * per * self.width(roles, p) for p in range(self.world_size))

        send, recv = self._memo(("h2s", roles), build)
        return list(send), list(recv)

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
                n = self.seq_local * self.batch * self.head_count(s, p) * self.dim(s)
                per_role.append(recv[start : start + n])
                start += n
            slices.append(per_role)
        return slices

    def h2s_block_shapes(self, roles: Sequence[str]) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
        """Per source, per role: the shape ``[B, s_r, h, D]`` of its wire-format block."""
        roles = tuple(roles)

        def build():
            return tuple(tuple((self.batch, self.seq_local, self.head_count(s, p), self.dim(s)) for s in roles) for p in range(self.world_size))

        return self._memo(("h2s_shapes", roles), build)

    def h2s_recv_views(self, recv: torch.Tensor, roles: Sequence[str], flat: bool = False) -> list[list[torch.Tensor]]:
        """Per source, per role: the received wire-format block as ``[B, s_r, h, D]`` (one
        ``split_with_sizes`` and a view per block); ``flat=True``: the 1-D pieces of ``recv``
        themselves (no view per block), for a kernel set that takes flat blocks
        (``flat_blocks``: the ``cuda`` set)."""
        route = self.h2s_route(roles)
        shapes, pieces = route.block_shapes, recv.split_with_sizes(route.block_sizes)
        n = len(roles)
        if flat:
            return [list(pieces[p * n : (p + 1) * n]) for p in range(self.world_size)]
        return [[pieces[p * n + i].view(shapes[p][i]) for i in range(n)] for p in range(self.world_size)]


@dataclass(frozen=True)
class S2HRoute:
    """The sequence-to-head exchange of one role set, from one rank: every size its buffers
    are cut by (``Layout.s2h_route``), in buffer elements (bytes on an FP8 wire). The movers
    (``attention.exchange``) read these numbers and call nothing back here.

    ``roles``: the roles it moves; ``send_splits``: per peer, this rank's own block included
    (batch 1: one ``all_to_all``); ``recv_splits``: per source; ``peer_send``: the send
    buffer's elements without this rank's own block (``pack_s2h(recv=...)`` packs it into the
    receive buffer) and ``send_pieces`` that buffer cut per (peer, batch element);
    ``recv_pieces``: the receive buffer ``[B][S][width]`` cut per (batch element, source),
    ``width`` the elements of one of its tokens; ``recv_shape``: the receive buffer as
    ``[B, S, h, D]`` (``uniform``: the roles share one head dim) or ``[B, S, width]``, cut along
    dim 2 by ``role_sizes`` into one piece per role, each viewed as its ``view_shapes`` entry
    (the views of ``Layout.s2h_recv_views``); ``out_shapes``: per role the result ``[B, S, h,
    D]`` (in values: the dequantized tensor with an FP8 wire, whose ``view_shapes`` are in
    bytes); ``peers``: the ranks other than this one."""

    layout: Layout
    roles: tuple[str, ...]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    peer_send: int
    send_pieces: tuple[int, ...]
    recv_pieces: tuple[int, ...]
    width: int
    recv_shape: tuple[int, ...]
    role_sizes: tuple[int, ...]
    view_shapes: tuple[tuple[int, int, int, int], ...]
    out_shapes: tuple[tuple[int, int, int, int], ...]
    peers: tuple[int, ...]

    @property
    def uniform(self) -> bool:
        return len(self.recv_shape) == 4


@dataclass(frozen=True)
class H2SRoute:
    """The head-to-sequence exchange of one role set, from one rank (``Layout.h2s_route``),
    in buffer elements (bytes on an FP8 wire).

    ``wire``: the buffers' layout (``layout``, or with an FP8 wire its ``padded_rows``);
    ``roles``: the roles it moves; ``send_splits``/``recv_splits``: per peer (one
    ``all_to_all``); ``block_shapes``: per source, per role the ``[B, s_r, h, D]`` wire-format
    block and ``block_sizes`` their elements, source-major (an all-source receive buffer's
    blocks: ``wire.h2s_recv_views``); ``peer_block_sizes``: the same without this rank's
    blocks (a grouped send/recv's receive buffer) and ``peer_pieces`` each cut per batch
    element; ``row_starts``: per rank the first of its rows in a local ``[B, S, h, D]``
    tensor (``seq_lens[p]`` of them: ``Layout.h2s_send_blocks``); ``out_shapes``: per role the
    result ``[B, s_r, H, D]``; ``peers``: the ranks other than this one."""

    layout: Layout
    wire: Layout
    roles: tuple[str, ...]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    block_shapes: tuple[tuple[tuple[int, int, int, int], ...], ...]
    block_sizes: tuple[int, ...]
    peer_block_sizes: tuple[int, ...]
    peer_pieces: tuple[int, ...]
    row_starts: tuple[int, ...]
    out_shapes: tuple[tuple[int, int, int, int], ...]
    peers: tuple[int, ...]


class Routes(NamedTuple):
    """The routes of one call's four exchanges from one rank (``Layout.routes``), resolved
    with the call (``attention.call.CallSetup.routes``): ``qkv`` q/k/v to heads and ``grads``
    dq/dk/dv back (the public ``seq_to_head``: its roles), ``out`` the attention output back
    and ``dout`` its gradient to heads (``head_to_seq``: ``"o"``); ``None`` for an exchange the
    call does not make."""

    qkv: S2HRoute | None
    out: H2SRoute | None
    dout: S2HRoute | None
    grads: H2SRoute | None


def _split_heads(x: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """``x[:, :, start : start + c]`` for each head count ``c`` in turn: one op for all the views."""
    return list(x.split_with_sizes(list(counts), dim=2))


def rows_contiguous(x: torch.Tensor) -> bool:
    """True when ``x`` (``[B, S, h, D]``) can be sent in wire format without a copy: each
    ``x[b]`` is contiguous (``x[0].is_contiguous()``, read from the strides: no op dispatched)."""
    if x.numel() == 0:
        return True
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
