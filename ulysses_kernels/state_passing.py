"""State passing: a linear-attention or state-space layer with the sequence kept sharded.

The head exchange (``layers.mixers``) sends every token's q/k/v/gates to head shards
and back: bytes that grow with the sequence, and at most one rank per head. Here each rank
instead runs the layer's own kernel on its own tokens, for all heads, and the ranks exchange
only what crosses a shard boundary:

* the conv's halo: the ``width - 1`` input tokens before the shard (``preceding``);
* the recurrent state: the layer's recurrence is affine in its initial state, so over one
  shard ``S_end = A S_0 + c`` (``A``: the shard's transition, ``c``: its state from zero).
  Each rank computes its ``(A, c)`` in the same kernel call as its output, one all-gather
  (over the communicator's all-to-all) gives every rank everyone's, and rank ``r`` folds
  those of ranks ``< r`` into its true initial state ``S_0`` (``carried_in``). Its output is
  then corrected by the initial state's contribution, ``J S_0``, which the same kernel call
  produced: the kernel runs on the value side widened by an identity (``Algebra``), i.e.
  ``v`` with ``K`` zero columns appended and an initial state ``[0 | I]``: the extra columns
  of the final state are ``A``, those of the output are ``J``. No second pass, no serial
  chain over the ranks.

Bytes per layer and rank: ``world * (|A| + |c|)`` for the fold (Mamba2: ``|A|`` one number a head) (forward; the same back), the
halo ``world * (width - 1) * channels``: independent of the sequence length. Extra compute: the
kernel on ``V + K`` value columns instead of ``V`` (Gated DeltaNet, Kimi Delta: ``K = Dk``;
Mamba2: ``P + N`` head channels), and the fold's ``world - 1`` small matrix products.

Packed documents: a document boundary resets the state and the conv. A rank runs the kernel
once per document piece of its shard; only the first piece can continue a document from the
ranks before, only the last one's state leaves. A shard that a document starts in (or at)
sends ``A = 0``, so the fold restarts there. Exact by construction: every step is the
recurrence's own algebra; the backward is autograd's through the kernel, the fold and the
gather (whose backward is the reverse all-to-all, summed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["DELTA", "DIAGONAL", "SSD", "Algebra", "carried_in", "gather", "local_pieces", "preceding", "run_sharded", "selective"]


class _Gather(torch.autograd.Function):
    """Each rank's ``x`` -> ``[world, *x.shape]`` on every rank, one all-to-all (the same
    bytes to every peer). Backward: chunk ``j`` of the gradient goes back to rank ``j``, which
    sums what it receives."""

    @staticmethod
    def forward(ctx, comm, x):
        ctx.comm, ctx.shape = comm, x.shape
        world, n = comm.world_size, x.numel()
        out = x.new_empty(world * n)
        comm.all_to_all(out, x.reshape(-1).repeat(world), [n] * world, [n] * world)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        world, n = ctx.comm.world_size, grad[0].numel()
        out = grad.new_empty(world * n)
        ctx.comm.all_to_all(out, grad.contiguous().reshape(-1), [n] * world, [n] * world)
        return None, out.view(world, n).sum(0).view(ctx.shape)


def gather(comm, x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` (the same shape on each), stacked in rank order: ``[world, *x.shape]``; differentiable."""
    return _Gather.apply(comm, x.contiguous())


def preceding(comm, seq_lens: Sequence[int], x: torch.Tensor, width: int) -> torch.Tensor:
    """The ``min(width, start)`` tokens of the global sequence just before this rank's shard
    ``x`` ``[B, s_r, C]`` (``start``: the shard's first global token): ``[B, n, C]``. Each rank
    sends its last ``min(width, s_r)`` tokens to all (a shard shorter than ``width`` sends all it
    has, so the tokens before it come from several ranks)."""
    rank = comm.rank
    if width == 0:
        return x[:, :0]
    bsz, s_r, ch = x.shape
    tail = x[:, max(0, s_r - width) :]
    if tail.shape[1] < width:
        tail = torch.cat([tail.new_zeros(bsz, width - tail.shape[1], ch), tail], dim=1)
    tails = gather(comm, tail)  # [world, B, width, C], each right-aligned
    kept = [tails[j][:, width - min(width, seq_lens[j]) :] for j in range(rank)]
    before = torch.cat([tails[0][:, :0], *kept], dim=1)  # rank 0: empty, still on the graph
    return before[:, max(0, before.shape[1] - width) :]


def local_pieces(seq_lens: Sequence[int], rank: int, spans: Sequence[tuple[int, int]], lead: int = 0) -> tuple[list[tuple[int, int]], bool]:
    """The documents of ``spans`` (global ``(start, end)``) cut to this rank's window
    ``[start - lead, end)``, as ``(a, b)`` offsets into the window; and whether the first piece
    continues a document begun before the window."""
    start = sum(seq_lens[:rank]) - lead
    end = sum(seq_lens[: rank + 1])
    pieces, continues = [], False
    for a, b in spans:
        if b <= start or a >= end:
            continue
        if not pieces:
            continues = a < start
        pieces.append((max(a, start) - start, min(b, end) - start))
    return pieces, continues


@dataclass(frozen=True)
class Algebra:
    """How a recurrence's state answers its initial state. ``affine(run, tensors)`` -> ``(out0,
    J, c, A)``: one document piece from a zero state (``out0``, its final state ``c``), the
    shard's transition ``A`` in the form that travels and ``J``, the output's response to the
    initial state; ``compose(A, S)``: ``A`` applied to a state; ``correct(out0, J, S0)``: the
    output from ``S0``."""

    name: str
    affine: Callable
    compose: Callable
    correct: Callable


def _eye(like: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, H, n, n]`` identities for ``like`` ``[B, L, H, ...]``."""
    return torch.eye(n, dtype=like.dtype, device=like.device).expand(like.shape[0], like.shape[2], n, n)


def _widened(value: int, width: Callable, init: Callable, split_state: Callable) -> Callable:
    """``affine`` by the identity trick (module docstring): the kernel's ``value``-th input
    ``[B, L, H, V]`` widened by ``width(tensors)`` zero columns, the initial state ``init(v, K)``;
    ``split_state(final, V)`` -> ``(c, A)``."""

    def affine(run, tensors):
        tensors = list(tensors)
        v = tensors[value]
        dv, k = v.shape[-1], width(tensors)
        tensors[value] = torch.cat([v, v.new_zeros(*v.shape[:-1], k)], -1)
        out, final = run(*tensors, init(v, k))
        return (out[..., :dv], out[..., dv:], *split_state(final, dv))

    return affine


# Gated DeltaNet, Kimi Delta, lightning attention: S [B, H, K, V], each step S <- M_t S + k_t u_t^T
# (M_t acts on the key side: a decay, per head or per key channel, and I - beta k k^T); the
# output reads q^T S. The value columns are independent: V + K columns, the last K from I.
DELTA = Algebra(
    name="delta",
    affine=_widened(
        2,
        lambda tensors: tensors[1].shape[-1],
        lambda v, k: torch.cat([v.new_zeros(v.shape[0], v.shape[2], k, v.shape[3]), _eye(v, k)], -1),
        lambda final, dv: (final[..., :dv], final[..., dv:]),
    ),
    compose=lambda a, s: a @ s,
    correct=lambda out0, j, s0: out0 + torch.einsum("blhk,bhkv->blhv", j, s0),
)

# Mamba2's SSD: S [B, H, P, N], each step S <- a_t S + dt_t x_t B_t^T (a scalar decay per head),
# y = S C + D x. The head's P rows are independent: P + N rows, the last N from I (x there is
# zero, so the skip D x adds nothing to them); then S_end = a S_0 + c with the identity block's
# final value a I: each of its rows runs the same arithmetic (off the diagonal 0 stays 0), so
# its [0, 0] entry is a, exactly, and only that [B, H] travels.
SSD = Algebra(
    name="ssd",
    affine=_widened(
        0,
        lambda tensors: tensors[2].shape[-1],
        lambda x, n: torch.cat([x.new_zeros(x.shape[0], x.shape[2], x.shape[3], n), _eye(x, n)], -2),
        lambda final, p: (final[..., :p, :], final[..., p, 0]),
    ),
    compose=lambda a, s: s * a[..., None, None],
    correct=lambda out0, j, s0: out0 + torch.einsum("bhpn,blhn->blhp", s0, j),
)


def _diagonal_affine(run, tensors):
    x, gate, reset = tensors
    acc = torch.promote_types(x.dtype, torch.float32)
    init = torch.cat([x.new_zeros(x.shape[0], x.shape[-1], dtype=acc), x.new_ones(x.shape[0], x.shape[-1], dtype=acc)], -1)
    out, final = run(torch.cat([x, torch.zeros_like(x)], -1), torch.cat([gate, gate], -1), reset, init)
    n = x.shape[-1]
    return out[..., :n], out[..., n:], final[..., :n], final[..., n:]


# A diagonal linear RNN (RecurrentGemma's RG-LRU): per channel, h <- a_t h + x_t (a_t zeroed where
# ``reset``). Channels are independent: the kernel runs on 2C channels, the last C with x = 0 and
# h_0 = 1, whose outputs are J (the running product of a) and final state A. Inputs ``x, a [B,
# L, C], reset [B, L, 1]``; state ``[B, C]``.
DIAGONAL = Algebra(
    name="diagonal",
    affine=_diagonal_affine,
    compose=lambda a, s: a * s,
    correct=lambda out0, j, s0: out0 + (j * s0[:, None].to(j.dtype)).to(out0.dtype),
)


def selective(a_neg: torch.Tensor, delta_bias: torch.Tensor | None) -> Algebra:
    """Mamba1's selective scan (Jamba, Mamba, Falcon-Mamba, one head of Zamba's): per channel
    ``c`` and state entry ``n``, ``S <- exp(A[c, n] dt'_t[c]) S + dt'_t x_t B_t[n]``, ``y = S C_t
    + D x`` with ``dt' = softplus(dt + delta_bias)``: a diagonal decay, so ``A`` and ``J`` are
    closed forms of the running sum of ``dt'`` (the kernel, transformers' and mamba_ssm's, takes
    no initial state). The kernel's inputs ``x, dt [B, L, c], B, C [B, L, N]``; its output
    before the gate ``z`` (applied after the correction); state ``[B, c, N]``."""

    def affine(run, tensors):
        out0, c = run(*tensors, None)
        _, dt, _, cm = tensors
        dt = dt + delta_bias.to(dt.dtype) if delta_bias is not None else dt
        total = torch.nn.functional.softplus(dt).cumsum(1)  # [B, L, c]
        decay = torch.exp(a_neg[None, None] * total[..., None])  # [B, L, c, N]
        return out0, decay * cm[:, :, None, :], c, decay[:, -1]

    return Algebra(
        name="selective",
        affine=affine,
        compose=lambda a, s: a * s,
        correct=lambda out0, j, s0: out0 + torch.einsum("blcn,bcn->blc", j, s0.to(j.dtype)).to(out0.dtype),
    )


def carried_in(comm, algebra: Algebra, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """This rank's initial state from every rank's ``(A, c)`` (one all-gather of both, flattened):
    ``S_0(r) = fold over j < r of S <- compose(A_j, S) + c_j``, from zero."""
    both = gather(comm, torch.cat([a.reshape(-1).to(c.dtype), c.reshape(-1)]))
    maps = both[:, : a.numel()].view(-1, *a.shape)
    states = both[:, a.numel() :].view(-1, *c.shape)
    state = states[0] * 0  # zero, on the graph on every rank (each rank's backward joins the gather's)
    for j in range(comm.rank):
        state = algebra.compose(maps[j], state) + states[j]
    return state


def run_sharded(
    comm, seq_lens: Sequence[int], spans: Sequence[tuple[int, int]], run: Callable, algebra: Algebra, tensors: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The recurrence over this rank's shard (``tensors`` ``[B, s_r, ...]``, the kernel's inputs
    in its order), exact for the global sequence: ``run(*tensors, initial_state)`` ->
    ``(out [B, L, ...], final_state)`` is the layer's kernel on one document piece (from a zero
    state when ``initial_state`` is ``None``). Returns ``[B, s_r, ...]``."""
    if 0 in seq_lens:  # the same on every rank: every rank raises
        raise ValueError(f"state passing: every rank needs at least one token, got seq_lens {tuple(seq_lens)}")
    pieces, continues = local_pieces(seq_lens, comm.rank, spans)
    a0, b0 = pieces[0]
    out0, j, c, a = algebra.affine(run, [t.narrow(1, a0, b0 - a0) for t in tensors])
    outs = [out0]
    for a1, b1 in pieces[1:]:
        o, c = run(*(t.narrow(1, a1, b1 - a1) for t in tensors), None)
        outs.append(o)
    if len(pieces) > 1 or not continues:
        a = a * 0  # a document starts in this shard: the state leaving it does not depend on the one entering
    s0 = carried_in(comm, algebra, a, c)
    if not continues:
        s0 = s0 * 0  # the shard starts a document
    outs[0] = algebra.correct(out0, j, s0.to(out0.dtype))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
