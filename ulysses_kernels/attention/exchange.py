"""The two all-to-alls (the movers) and the differentiable exchanges built on them.

A mover takes a route (``layout.S2HRoute``/``H2SRoute``: every size its buffers are cut by,
and the views of them) and reads its numbers; it calls nothing back in the layout. A call
resolves the routes of its exchanges once (``CallSetup.routes``). Two pairs of movers with
one signature, ``(route, tensors, comm, kernels, wire)``:

* eager (``s2h_along``, ``h2s_along``, over ``post_seq_to_head`` and ``post_head_to_seq``,
  which the chunked schedule starts asynchronously): batch 1 is one ``all_to_all``, a larger
  batch and the gradients one grouped send/recv, pieces in place;
* traced (``s2h_along_traced``, ``h2s_along_traced``): one ``all_to_all`` per exchange,
  what ``torch.compile`` traces (``attention.traced`` says what differs).

``a2a_seq_to_head`` and ``a2a_head_to_seq`` are the eager movers by layout and roles (the
route looked up on the layout), for callers without a ``CallSetup``: the mixers' exchange,
the benches. ``exchange_functions`` turns a pair into two autograd functions, each the
other's backward: ``SeqToHead``/``HeadToSeq`` (eager) and ``SeqToHeadTraced``/``HeadToSeqTraced``.

Data movement per call of the eager movers (the budget of one copy per byte on the wire):

* ``a2a_seq_to_head``: one pack into one send buffer (all roles together), one collective,
  no receive-side copy (the results are strided views of the receive buffer).
* ``a2a_head_to_seq``: the local tensors are sent in place when their rows are contiguous
  (see ``layout.rows_contiguous``), then one unpack writes the receive buffer into the
  ``[B, s_r, H, D]`` outputs, summing replicated KV heads.

Buffers: each call allocates one send buffer (``a2a_seq_to_head`` only) and one receive buffer
from the caching allocator, and holds nothing once it returns: the send buffer goes when the
exchange has consumed it; the receive buffer of ``a2a_seq_to_head`` lives as long as the
views of it (for attention, until the attention backward has run); the receive buffer of
``a2a_head_to_seq`` holds the peers' blocks only when the exchange is grouped send/recv
(the rank's own rows are unpacked from the local tensors) and goes after the unpack.
docs/design.md ("Buffers and who owns them") gives the peak of one call as a formula.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..kernels import TorchKernels
from ..layout import H2SRoute, Layout, S2HRoute, rows_contiguous
from ..wire import SCALE_BYTES, Fp8Format, row_extra

__all__ = [
    "post_seq_to_head",
    "post_head_to_seq",
    "s2h_along",
    "h2s_along",
    "s2h_along_traced",
    "h2s_along_traced",
    "a2a_seq_to_head",
    "a2a_head_to_seq",
    "exchange_functions",
    "s2h_results",
    "h2s_unpack",
    "wire_of",
    "SeqToHead",
    "HeadToSeq",
    "SeqToHeadTraced",
    "HeadToSeqTraced",
]


def _flat(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(n, dtype=like.dtype, device=like.device)


def _run_now(tensors, collective):
    """``start`` for a blocking exchange: run the collective, no handle."""
    collective(False)
    return None


def _s2h_views(route: S2HRoute, recv: torch.Tensor) -> list[torch.Tensor]:
    """The results in a sequence-to-head receive buffer ``[B][S][width]``: per role a
    ``[B, S, h, D]`` view (``Layout.s2h_recv_views``, cut by the route's numbers)."""
    parts = recv.view(route.recv_shape).split_with_sizes(route.role_sizes, dim=2)
    return list(parts) if route.uniform else [x.view(shape) for x, shape in zip(parts, route.view_shapes)]


def _h2s_blocks(route: H2SRoute, recv: torch.Tensor, flat: bool) -> list[list[torch.Tensor]]:
    """Per source, per role: the wire-format block of an all-source head-to-sequence receive
    buffer (``Layout.h2s_recv_views`` of ``route.wire``): a ``[B, s_r, h, D]`` view, or with
    ``flat`` the 1-D piece itself."""
    pieces, n = recv.split_with_sizes(route.block_sizes), len(route.roles)
    if flat:
        return [list(pieces[p * n : (p + 1) * n]) for p in range(len(route.block_shapes))]
    return [[pieces[p * n + i].view(shape) for i, shape in enumerate(per)] for p, per in enumerate(route.block_shapes)]


def _rows(route: H2SRoute, x: torch.Tensor, peer: int) -> torch.Tensor:
    """The rows of a local ``[B, S, h, D]`` tensor bound for ``peer``: ``[B, s_p, h, D]``
    (``Layout.h2s_send_blocks``)."""
    start = route.row_starts[peer]
    return x[:, start : start + route.layout.seq_lens[peer]]


def post_seq_to_head(layout: Layout, tensors, roles, comm, kernels=TorchKernels, start=_run_now, wire: Fp8Format | None = None):
    """Pack ``tensors`` (``[B, s_r, H, D]``) and post the sequence-to-head exchange.

    ``start(buffers, collective)`` runs ``collective(async_op)`` (blocking by default; the chunked
    pipeline passes one that overlaps it with compute) and returns a handle.
    Returns ``(handle, recv)``; ``s2h_results(layout, recv, roles, kernels, wire, like)``
    (``layout.s2h_recv_views(recv, roles)`` without ``wire``) are the results once the handle
    is waited. ``wire``: an FP8 format (``ulysses_kernels.wire``): the pack quantizes into
    byte buffers laid out as ``wire_layout(layout, wire)``.
    """
    return _post_s2h(layout.s2h_route(roles, row_extra(wire)), tensors, comm, kernels, start, wire)


def _s2h_pack(kernels, wire: Fp8Format | None, like: torch.Tensor):
    """``(pack, buffer_like)`` of a sequence-to-head exchange: the kernel set's ``pack_s2h`` into
    buffers of ``like``'s dtype, or with ``wire`` its quantizing twin into bytes."""
    if wire is None:
        return kernels.pack_s2h, like
    return functools.partial(kernels.quant_pack_s2h, fmt=wire), like.new_empty(0, dtype=torch.uint8)


def _post_s2h(route: S2HRoute, tensors, comm, kernels, start, wire: Fp8Format | None):
    """``post_seq_to_head`` along ``route`` (the sizes of its buffers)."""
    layout, roles = route.layout, route.roles
    pack, like = _s2h_pack(kernels, wire, tensors[0])
    recv = _flat(sum(route.recv_splits), like)
    if layout.batch == 1 and layout.world_size > 1:
        send = _flat(sum(route.send_splits), like)
        pack(layout, tensors, roles, send)
        collective = lambda a: comm.all_to_all(recv, send, route.recv_splits, route.send_splits, async_op=a)  # noqa: E731
    else:
        # One piece per (peer, batch element); our own rows are packed in place, so the
        # send buffer holds the peers' blocks only.
        send = _flat(route.peer_send, like)
        pack(layout, tensors, roles, send, recv=recv)
        sends, recvs = [], []
        if layout.world_size > 1:
            B, P = layout.batch, layout.world_size
            send_p, recv_p = send.split_with_sizes(route.send_pieces), recv.split_with_sizes(route.recv_pieces)
            sends = [(p, send_p[p * B + b]) for p in route.peers for b in range(B)]
            recvs = [(p, recv_p[b * P + p]) for p in route.peers for b in range(B)]
        collective = lambda a: comm.send_recv(sends, recvs, async_op=a)  # noqa: E731
    return start((recv, send), collective), recv


def s2h_results(layout: Layout, recv: torch.Tensor, roles, kernels, wire: Fp8Format | None, like: torch.Tensor) -> list[torch.Tensor]:
    """The sequence-to-head results of a waited receive buffer: ``[B, S, h, D]`` views of it,
    or with ``wire`` new tensors in ``like``'s dtype, dequantized by the kernel set."""
    return _s2h_results(layout.s2h_route(roles, row_extra(wire)), recv, kernels, wire, like)


def _s2h_results(route: S2HRoute, recv: torch.Tensor, kernels, wire: Fp8Format | None, like: torch.Tensor) -> list[torch.Tensor]:
    if wire is None:
        return _s2h_views(route, recv)
    outs = [like.new_empty(shape) for shape in route.out_shapes]
    kernels.dequant_s2h(route.layout, recv, route.roles, outs, wire)
    return outs


def h2s_unpack(layout: Layout, blocks, roles, outs, kernels, wire: Fp8Format | None) -> None:
    """``kernels.unpack_h2s``, or with ``wire`` its dequantizing twin (``dequant_unpack_h2s``)."""
    if wire is None:
        kernels.unpack_h2s(layout, blocks, roles, outs)
    else:
        kernels.dequant_unpack_h2s(layout, blocks, roles, outs, wire)


def _h2s_recv(route: H2SRoute, like: torch.Tensor, own: bool, flat: bool = False):
    """The receive side of a head-to-sequence exchange: ``(buffer, blocks, pieces)``.
    ``blocks``: per source, per role the wire-format block (``_h2s_blocks``: ``[B, s_r, h, D]``
    views, or with ``flat`` the 1-D pieces of the buffer, for a kernel set that takes them:
    ``flat_blocks``).
    ``own=False`` (grouped send/recv) leaves this rank's blocks out of the buffer (``None``):
    its rows never touch the wire, so the buffer holds the peers' blocks only; ``pieces``
    then lists, per peer other than this rank, per role, per batch element, the 1-D piece it
    sends (``None`` with ``own``). One ``split_with_sizes`` cuts all of them (two with a
    batch above 1 and views)."""
    if own:
        recv = _flat(sum(route.recv_splits), like)
        return recv, _h2s_blocks(route, recv, flat), None
    P, shapes, n = route.layout.world_size, route.block_shapes, len(route.roles)
    B, peers = route.layout.batch, route.peers
    recv = _flat(sum(route.peer_block_sizes), like)
    # Per (peer, role, batch element): the pieces on the wire.
    pieces = recv.split_with_sizes(route.peer_pieces)
    if B == 1 and flat:
        whole = pieces
    else:
        whole = recv.split_with_sizes(route.peer_block_sizes)
        if not flat:
            whole = [x.view(shapes[p][i]) for (p, i), x in zip(((p, i) for p in peers for i in range(n)), whole)]
    blocks: list = [None] * P
    for j, p in enumerate(peers):
        blocks[p] = list(whole[j * n : (j + 1) * n])
    by_peer = {p: [list(pieces[(j * n + i) * B : (j * n + i + 1) * B]) for i in range(n)] for j, p in enumerate(peers)}
    return recv, blocks, by_peer


def _one_collective(layout: Layout, n_tensors: int) -> bool:
    """Head-to-seq of one tensor at batch 1 is one all_to_all (own rows included)."""
    return n_tensors == 1 and layout.batch == 1 and layout.world_size > 1


def _send_pieces(route: H2SRoute, x: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per peer, per batch element: the 1-D piece of a local ``[B, S, h, D]`` tensor whose
    rows are contiguous (``layout.rows_contiguous``) bound for that peer. A contiguous
    tensor is cut with one ``split_with_sizes``."""
    layout = route.layout
    B, P = layout.batch, layout.world_size
    w = x.shape[2] * x.shape[3]
    if x.is_contiguous():
        cut = x.view(-1).split_with_sizes([n * w for _ in range(B) for n in layout.seq_lens])
        return [[cut[b * P + p] for b in range(B)] for p in range(P)]
    return [[_rows(route, x, p)[b].reshape(-1) for b in range(B)] for p in range(P)]


def post_head_to_seq(layout: Layout, local, roles, comm, kernels=TorchKernels, start=_run_now, flat: bool = False, wire: Fp8Format | None = None):
    """Post the head-to-sequence exchange of local ``[B, S, h, D]`` tensors (one per role).

    Rows that are contiguous per batch element go on the wire in place; others are packed
    first. Returns ``(handle, blocks)``: per source, per role, the ``[B, s_r, h, D]`` block
    to unpack once the handle is waited (this rank's own rows are read from the local
    tensors; the blocks keep the receive buffer and the local tensors alive until then).
    ``flat=True`` (for a caller that passes the blocks straight to a kernel set that takes
    flat blocks: ``flat_blocks``, the ``cuda`` set): the blocks of the receive buffer are
    its 1-D pieces (no view per block), and with batch 1 so are this rank's own.
    ``wire`` (an FP8 format): every tensor is packed, quantized, into bytes ``[B, S, h, D + 4]``
    (``ulysses_kernels.wire``), and the blocks are blocks of bytes (``h2s_unpack`` takes them).
    """
    return _post_h2s(layout.h2s_route(roles, row_extra(wire)), local, comm, kernels, start, flat, wire)


def _quantized(layout: Layout, x: torch.Tensor, kernels, fmt: Fp8Format) -> torch.Tensor:
    """A local ``[B, S, h, D]`` tensor quantized into wire rows: bytes ``[B, S, h, D + 4]``."""
    B, S, h, D = x.shape
    packed = x.new_empty(B, S, h, D + SCALE_BYTES, dtype=torch.uint8)
    kernels.quant_pack_h2s(layout, x, packed.view(-1), fmt)
    return packed


def _post_h2s(route: H2SRoute, local, comm, kernels, start, flat: bool, wire: Fp8Format | None):
    """``post_head_to_seq`` along ``route`` (the sizes of its buffers)."""
    layout, fmt, wire = route.layout, wire, []
    for x in local:
        if fmt is not None:
            x = _quantized(layout, x, kernels, fmt)
        elif not rows_contiguous(x):
            # NOTE: a backend that returns rows that are not contiguous costs this copy.
            packed = _flat(x.numel(), x)
            kernels.pack_h2s(layout, x, packed)
            x = packed.view(x.shape)
        wire.append(x)
    one = _one_collective(layout, len(wire))
    recv, blocks, recv_pieces = _h2s_recv(route, wire[0], own=one, flat=flat)
    if one:
        flat_send = wire[0].reshape(-1)
        collective = lambda a: comm.all_to_all(recv, flat_send, route.recv_splits, route.send_splits, async_op=a)  # noqa: E731
    else:
        sends, recvs = [], []
        cut = [_send_pieces(route, x) for x in wire] if layout.world_size > 1 else []
        for p in route.peers:
            for i in range(len(wire)):
                sends += [(p, t) for t in cut[i][p]]
                recvs += [(p, t) for t in recv_pieces[p][i]]
        collective = lambda a: comm.send_recv(sends, recvs, async_op=a)  # noqa: E731
        # Our own rows never touch the wire: unpack reads them from the local tensors (with
        # batch 1 and flat blocks, the piece cut for the wire is that block).
        if flat and layout.batch == 1 and cut:
            blocks[layout.rank] = [cut[i][layout.rank][0] for i in range(len(wire))]
        else:
            blocks[layout.rank] = [_rows(route, x, layout.rank) for x in wire]
    return start((recv, *wire), collective), blocks


def s2h_along(route: S2HRoute, tensors: Sequence[torch.Tensor], comm, kernels=TorchKernels, wire=None) -> list[torch.Tensor]:
    """Sequence-sharded ``[B, s_r, H, D]`` tensors (one per ``route.roles``) -> head-sharded
    ``[B, S, h, D]`` views (with ``wire``, an FP8 format: new tensors, dequantized from the
    receive buffer). ``route``: ``layout.s2h_route(roles, extra)``, ``extra`` the format's
    scale bytes (``wire.call_routes``)."""
    _, recv = _post_s2h(route, tensors, comm, kernels, _run_now, wire)
    return _s2h_results(route, recv, kernels, wire, tensors[0])


def h2s_along(route: H2SRoute, local: Sequence[torch.Tensor], comm, kernels=TorchKernels, wire=None) -> list[torch.Tensor]:
    """Head-sharded ``[B, S, h, D]`` tensors (one per ``route.roles``) -> sequence-sharded
    ``[B, s_r, H, D]`` (``wire``: an FP8 format on the wire, dequantized into ``local``'s dtype;
    ``route`` as for ``s2h_along``)."""
    if route.layout.world_size == 1:
        return list(local)
    like = local[0]
    _, blocks = _post_h2s(route, local, comm, kernels, _run_now, getattr(kernels, "flat_blocks", False), wire)
    outs = [torch.empty(shape, dtype=like.dtype, device=like.device) for shape in route.out_shapes]
    h2s_unpack(route.layout, blocks, route.roles, outs, kernels, wire)
    return outs


def a2a_seq_to_head(layout: Layout, tensors: Sequence[torch.Tensor], roles: Sequence[str], comm, kernels=TorchKernels, wire=None) -> list[torch.Tensor]:
    """``s2h_along`` by layout and roles: the route is ``layout``'s for ``roles`` and ``wire``."""
    return s2h_along(layout.s2h_route(roles, row_extra(wire)), tensors, comm, kernels, wire)


def a2a_head_to_seq(layout: Layout, local: Sequence[torch.Tensor], roles: Sequence[str], comm, kernels=TorchKernels, wire=None) -> list[torch.Tensor]:
    """``h2s_along`` by layout and roles: the route is ``layout``'s for ``roles`` and ``wire``."""
    return h2s_along(layout.h2s_route(roles, row_extra(wire)), local, comm, kernels, wire)


# ---- the traced movers: one all_to_all per exchange (see attention.traced) ----
def s2h_along_traced(route: S2HRoute, tensors: Sequence[torch.Tensor], comm, kernels, wire=None) -> list[torch.Tensor]:
    """``[B, s_r, H, D]`` tensors -> this rank's heads ``[B, S, h, D]`` (views), one all_to_all.
    With ``wire`` (an FP8 format; ``route`` then counts bytes, ``wire_layout``): the pack
    quantizes into a byte buffer, the bytes cross, and the results are new tensors in the
    inputs' dtype, dequantized by the kernel set, as in eager."""
    layout = route.layout
    pack, like = _s2h_pack(kernels, wire, tensors[0])
    send = _flat(sum(route.send_splits), like)
    pack(layout, tensors, route.roles, send)
    got = send  # one peer, S = s_r: the send buffer [B][s_r][h][D] is already the receive layout
    if layout.world_size > 1:
        got = _flat(sum(route.recv_splits), send)
        comm.all_to_all(got, send, list(route.recv_splits), list(route.send_splits))
    if layout.world_size > 1 and layout.batch > 1:
        # Source-major [P][B][s_p][width] -> batch-major [B][S][width] (eager avoids this copy
        # with one send/recv per (peer, batch element), which does not trace: attention.traced).
        pieces, start = [], 0
        for p, n in enumerate(route.recv_splits):
            pieces.append(got[start : start + n].view(layout.batch, layout.seq_lens[p], route.width))
            start += n
        got = torch.cat(pieces, dim=1).view(-1)
    return _s2h_results(route, got, kernels, wire, tensors[0])


def h2s_along_traced(route: H2SRoute, local: Sequence[torch.Tensor], comm, kernels, wire=None) -> list[torch.Tensor]:
    """Local ``[B, S, h, D]`` tensors (one per role) -> ``[B, s_r, H, D]``, one all_to_all;
    replicated KV heads are summed in rank order by the kernel set's unpack, as in eager.
    With ``wire`` (an FP8 format): each tensor is first quantized into bytes ``[B, S, h, D + 4]``
    and the unpack dequantizes into the tensors' dtype."""
    layout = route.layout
    if layout.world_size == 1:
        return list(local)
    like = local[0]
    if wire is not None:
        local = [_quantized(layout, x, kernels, wire) for x in local]
    if len(local) == 1 and layout.batch == 1:
        # Peer p's rows are consecutive: the tensor is the send buffer (a view when its
        # rows are contiguous, as in eager).
        send = local[0].reshape(-1)
    else:
        # Wire format: per peer p, per role, the rows of p as [B][s_p][h][D].
        send = torch.cat([_rows(route, x, p).reshape(-1) for p in range(layout.world_size) for x in local])
    recv = _flat(sum(route.recv_splits), send)
    comm.all_to_all(recv, send, list(route.recv_splits), list(route.send_splits))
    outs = [torch.empty(shape, dtype=like.dtype, device=like.device) for shape in route.out_shapes]
    h2s_unpack(layout, _h2s_blocks(route, recv, False), route.roles, outs, kernels, wire)
    return outs


def wire_of(call, exchange: str) -> Fp8Format | None:
    """The FP8 format of ``exchange`` (``"qkv"``, ``"out"``, ``"dout"``, ``"grads"``) in the
    call's ``WireSpec``, ``None`` without one (a call set up without ``wire`` has none)."""
    spec = getattr(call, "wire", None)
    return None if spec is None else getattr(spec, exchange)


def exchange_functions(s2h, h2s, suffix: str = ""):
    """The two differentiable exchanges, over a pair of data movers with the signatures of
    ``s2h_along`` and ``h2s_along`` (eager: those two; inside torch.compile:
    ``s2h_along_traced``/``h2s_along_traced``). Each is the other's backward. Both take the
    call's ``CallSetup`` first and move along its routes (``CallSetup.routes``) with its
    communicator and kernel set."""

    class SeqToHead(torch.autograd.Function):
        """``(q[, k, v])`` sequence-sharded -> head-sharded (``call.routes.qkv``: ``Q_ONLY``
        for the public ``seq_to_head(q)``); backward sums KV replicas (``routes.grads``)."""

        @staticmethod
        def forward(ctx, call, *tensors):
            ctx.call = call
            return tuple(s2h(call.routes.qkv, tensors, call.comm, call.kernels, wire_of(call, "qkv")))

        @staticmethod
        def backward(ctx, *grads):
            call = ctx.call
            like = next(g for g in grads if g is not None)
            grads = [g if g is not None else like.new_zeros(shape) for g, shape in zip(grads, call.routes.qkv.out_shapes)]
            return (None, *h2s(call.routes.grads, grads, call.comm, call.kernels, wire_of(call, "grads")))

    class HeadToSeq(torch.autograd.Function):
        """Head-sharded ``[B, S, hq, Dv]`` -> sequence-sharded ``[B, s_r, Hq, Dv]`` (the
        attention output, role ``"o"``: query heads at ``layout.v_head_dim``; ``routes.out``,
        its gradient back along ``routes.dout``)."""

        @staticmethod
        def forward(ctx, call, local):
            ctx.call = call
            return h2s(call.routes.out, [local], call.comm, call.kernels, wire_of(call, "out"))[0]

        @staticmethod
        def backward(ctx, grad):
            call = ctx.call
            return None, s2h(call.routes.dout, [grad], call.comm, call.kernels, wire_of(call, "dout"))[0]

    for cls in (SeqToHead, HeadToSeq):
        cls.__name__ = cls.__qualname__ = cls.__name__ + suffix
    return SeqToHead, HeadToSeq


SeqToHead, HeadToSeq = exchange_functions(s2h_along, h2s_along)
SeqToHeadTraced, HeadToSeqTraced = exchange_functions(s2h_along_traced, h2s_along_traced, "Traced")
