"""The LM head and cross-entropy over sequence tiles: the loss without the logits.

    loss = lm_head_loss(model.lm_head, hidden, targets, divisor=batch.num_tokens)

``hidden`` is this rank's ``[batch, seq_local, hidden]`` (the final norm's output), ``targets``
the already shifted ``[batch, seq_local]`` int64 labels (``-100`` ignored: ``ShardedBatch.labels``).
The result is ``sum(cross-entropy of the valid targets) / divisor``, what ``ShardedBatch.loss``
computes from ``[batch, seq_local, vocab]`` logits, without ever holding them: the forward
runs ``head`` on one tile of rows at a time (``[tile, vocab]`` logits, upcast to float32 for
half types as ``ShardedBatch.loss`` and transformers' loss do) and keeps each row's
log-sum-exp (float32, ``[rows]``); the backward recomputes each tile's logits,
turns them into ``softmax - onehot`` in place and takes the tile's ``d hidden`` and its share
of ``d weight`` at once. With ``divisor`` the global count of valid targets (``shard_batch``'s
``num_tokens``) the ranks' losses add up to the global mean, their gradients to its gradient.

Cost: the head's matrix product runs once more (in the backward) than without tiling: 4
``[tile, hidden] x [hidden, vocab]`` products per tile instead of 3.

Engines. ``lm_head_loss`` calls ``head`` (its ``__call__``, the forward redirected to the
tiled loss), so the engine's hooks on the head run around it: FSDP2 unshards and DeepSpeed
ZeRO-3 gathers the weight before the tiles run and frees it after; in the backward their
pre-backward hooks (on the loss, the module's output) gather it again before the tiles are
recomputed. The function keeps a reference to the weight *parameter* (the object the
engine fills and empties), never a tensor of its data: the gathered weight exists once,
while the engine holds it. Tied embeddings: the head's weight is the embedding's parameter;
its gradient from the loss arrives through this function's one ``AccumulateGrad`` call.

Numerics: each row's loss and ``d hidden`` row are what the untiled loss computes; ``d weight``
is a sum over tiles (float rounding only), accumulated in float32 for half-precision weights
(on CUDA without per-tile rounding: ``mm(..., out_dtype=float32)``), cast once at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .tiling import TilingError, tile_bounds

__all__ = ["LOSS_TILE_BYTES", "loss_tile_rows", "lm_head_loss", "TiledLinearCrossEntropy", "tiled_cross_entropy"]

# NOTE: one tile's float32 logits: 512 MiB, 1046 tokens at Llama-3's 128256-token vocabulary
# (a [1046, 4096] x [4096, 128256] product per tile, large enough to run at the GPU's matmul
# rate); the loss's working set is about 2.5 x this (logits, softmax gradient, its bf16 copy).
LOSS_TILE_BYTES = 1 << 29


def loss_tile_rows(vocab: int, budget: int = LOSS_TILE_BYTES) -> int:
    """Rows per tile so that one tile's float32 logits ``[rows, vocab]`` fit ``budget``."""
    return max(1, budget // (4 * vocab))


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass(frozen=True, eq=False)
class _LossCall:
    count: int
    divisor: float
    ignore_index: int
    accum_dtype: torch.dtype | None


def _tile_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One tile's logits, upcast to the loss dtype (a new tensor either way)."""
    logits = F.linear(h, weight, bias)
    wide = _wide(logits.dtype)
    return logits.to(wide) if logits.dtype != wide else logits


def _mm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``, the product taken in ``acc``'s dtype without rounding to ``a``'s first."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:
        acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
    else:  # CPU has no mixed-dtype mm: the half values upcast exactly
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


class TiledLinearCrossEntropy(torch.autograd.Function):
    """``sum_i CE(hidden_i W^T + b, target_i) / divisor`` over valid targets, in row tiles.

    ``hidden [rows, h]``, ``weight [vocab, h]``, ``bias [vocab] | None``, ``targets [rows]``
    int64. Saves ``hidden``, ``targets`` and the float32 (float64) log-sum-exp ``[rows]``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, call: _LossCall):
        rows = hidden.shape[0]
        wide = _wide(hidden.dtype)
        lse = torch.empty(rows, dtype=wide, device=hidden.device)
        total = torch.zeros((), dtype=wide, device=hidden.device)
        for start, stop in tile_bounds(rows, call.count):
            if stop == start:
                continue
            logits = _tile_logits(hidden[start:stop], weight, bias)
            tgt = targets[start:stop]
            valid = tgt != call.ignore_index
            lse_t = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, tgt.clamp_min(0).unsqueeze(1)).squeeze(1)
            del logits
            total += torch.where(valid, lse_t - picked, 0).sum()
            lse[start:stop] = lse_t
        ctx.call = call
        # The parameters themselves, not their data: an engine empties and refills them.
        ctx.weight, ctx.bias = weight, bias
        ctx.save_for_backward(hidden, targets, lse)
        return total / call.divisor

    @staticmethod
    def backward(ctx, grad_loss):
        call: _LossCall = ctx.call
        hidden, targets, lse = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        rows = hidden.shape[0]
        dh = torch.empty_like(hidden) if need_h else None
        acc_dtype = call.accum_dtype or _wide(weight.dtype)
        dw = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b and bias is not None else None
        coef = grad_loss.to(lse.dtype) / call.divisor
        for start, stop in tile_bounds(rows, call.count):
            if stop == start:
                continue
            h = hidden[start:stop]
            tgt = targets[start:stop]
            valid = tgt != call.ignore_index
            # softmax - onehot, scaled, in place on the recomputed logits
            p = _tile_logits(h, weight, bias)
            p.sub_(lse[start:stop].unsqueeze(1)).exp_()
            idx = valid.nonzero().squeeze(1)
            p[idx, tgt[idx]] -= 1
            p.mul_(torch.where(valid, coef, 0).unsqueeze(1))
            dlogits = p.to(hidden.dtype) if p.dtype != hidden.dtype else p
            del p
            if need_h:
                torch.mm(dlogits, weight, out=dh[start:stop])
            if need_w:
                _mm_into(dw, dlogits.t(), h)
            if db is not None:
                db += dlogits.sum(0, dtype=acc_dtype)
            del dlogits
        if dw is not None and dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
        if db is not None and db.dtype != bias.dtype:
            db = db.to(bias.dtype)
        return dh, dw, db, None, None


def _check(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, where: str) -> None:
    if hidden.dim() < 2:
        raise TilingError(f"{where}: hidden expected [..., hidden], got shape {list(hidden.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise TilingError(f"{where}: targets.shape expected {list(hidden.shape[:-1])} (hidden's leading dims), got {list(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TilingError(f"{where}: targets expected an integer tensor, got {targets.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise TilingError(f"{where}: head weight expected [vocab, {hidden.shape[-1]}], got {list(weight.shape)}")


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    divisor: float | int | torch.Tensor,
    tiles: int | None = None,
    tile_rows: int | None = None,
    ignore_index: int = -100,
    accum_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``sum(CE(hidden @ weight.T + bias, targets) over targets != ignore_index) / divisor``
    over row tiles; the weight as it is now (call inside the head's ``__call__`` under an
    engine). ``hidden [..., h]``, ``targets [...]``; ``tiles`` (the count) or ``tile_rows``
    (default ``loss_tile_rows(vocab)``). Returns a 0-dim tensor, float32 for half inputs."""
    _check(hidden, targets, weight, "tiled_cross_entropy")
    rows = targets.numel()
    if tiles is None:
        tiles = max(1, math.ceil(rows / (tile_rows or loss_tile_rows(weight.shape[0]))))
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.item()
    if not divisor or divisor < 0:
        raise TilingError(f"tiled_cross_entropy: divisor expected a positive number (the count of valid targets), got {divisor!r}")
    call = _LossCall(int(tiles), float(divisor), int(ignore_index), accum_dtype)
    flat_targets = targets.reshape(rows).to(device=hidden.device, dtype=torch.int64)
    return TiledLinearCrossEntropy.apply(hidden.reshape(rows, hidden.shape[-1]), weight, bias, flat_targets, call)


def lm_head_loss(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    divisor: float | int | torch.Tensor,
    tiles: int | None = None,
    tile_rows: int | None = None,
    ignore_index: int = -100,
    accum_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """This rank's share of the loss through ``head`` (an ``nn.Linear``-like module with
    ``weight [vocab, hidden]`` and optional ``bias``), never holding the logits.

    Args:
        head: the LM head (``model.lm_head``; with tied embeddings its weight is the
            embedding's). It is *called* (``head(hidden)``, the forward redirected to the
            tiled loss for this call), so FSDP2's and DeepSpeed ZeRO-3's hooks gather its
            weight around the computation and again for the backward.
        hidden: ``[batch, seq_local, hidden]``, the final norm's output on this rank.
        targets: ``[batch, seq_local]`` int64, already shifted (``ShardedBatch.labels``).
        divisor: what the sum is divided by: the global count of valid targets
            (``ShardedBatch.num_tokens``) for the global mean over the group.
        tiles, tile_rows: the tile count, or rows per tile (default: 512 MiB of float32
            logits per tile, ``loss_tile_rows``).
        ignore_index: targets equal to it add nothing (``-100``, shard_batch's padding).
        accum_dtype: dtype of the weight-gradient sum (default float32 for half weights).

    Returns a 0-dim tensor (float32 for half-precision inputs), differentiable with respect
    to ``hidden``, the head's weight and bias.
    """

    def forward(h):
        return tiled_cross_entropy(h, head.weight, getattr(head, "bias", None), targets, divisor=divisor, tiles=tiles,
                                   tile_rows=tile_rows, ignore_index=ignore_index, accum_dtype=accum_dtype)  # fmt: skip

    had = "forward" in head.__dict__
    previous = head.__dict__.get("forward")
    head.forward = forward  # this call only: the engine's hooks run around the tiled loss
    try:
        return head(hidden)
    finally:
        if had:
            head.forward = previous
        else:
            del head.forward
