"""A per-token module over sequence tiles, recomputed in the backward (the tiled MLP).

    y = tiled_apply(mlp, x, tiles=8)        # x [batch, seq_local, hidden] -> y, same as mlp(x)

A module whose output rows depend only on the same input rows (an MLP, a norm; every token
alone) gives the same result when it runs on slices of the sequence. ``SequenceTiled``
runs it tile by tile under ``no_grad`` in the forward and keeps only its input ``x``; the
backward runs each tile again with autograd and takes that tile's gradients at once, so
the module's intermediate tensors (a gated MLP's ``[rows, intermediate]`` gate, up, act,
product) exist for one tile at a time, forward and backward.

Parameter gradients are summed over the tiles inside the backward (``torch.autograd.grad``
per tile, which accumulates into no ``.grad`` and runs no gradient hook) and returned once,
as the gradient of the parameters the function took as inputs: every parameter's
``AccumulateGrad`` (and the hooks engines hang there: DeepSpeed ZeRO's reduce, FSDP2's
post-accumulate hooks) runs once per step, as without tiling. The parameters are taken from
the module when it is called (the engine's gathered/unsharded parameters: this runs inside
the module's ``__call__``, after the engine's pre-forward hooks) and must be the same objects
in the backward, after the engine's pre-backward hooks (checked; FSDP2 and ZeRO-3 keep them).

Tiles: the rows (``batch x seq_local`` tokens, flattened) are cut into ``count`` slices of
nearly equal size (``tile_bounds``). Engines that gather parameters per sub-module call
(DeepSpeed ZeRO-3) run a collective per tile, so every rank must run the same number of
tiles: ``count`` is fixed by the caller, from the group's longest shard
(``integrations.hf.apply`` does this from the step's ``SequenceShard``).

Numerics: every output row and input-gradient row is what the untiled module computes; a
parameter gradient is a sum over tiles instead of one sum over all rows (float rounding
only; accumulated in ``accum_dtype``, default float32 for half-precision parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["TilingError", "tile_bounds", "tile_count", "tiled_apply", "SequenceTiled", "MLP_TILE_BYTES", "default_tile_rows"]

# NOTE: DeepSpeed's ALST recipes cut the MLP into ceil(seq / hidden) shards, about `hidden`
# tokens each (4096 for Llama-3-8B: a [4096, 14336] bf16 intermediate is 117 MB). We size the
# tile by bytes instead, 128 MiB for one [rows, intermediate] tensor (4681 tokens for Llama-3-8B
# in bf16), so that the tile's working set does not grow with the model's width.
MLP_TILE_BYTES = 1 << 27


class TilingError(ValueError):
    """A tiled module or tile setting that cannot run."""


def tile_count(rows: int, tile_rows: int) -> int:
    """How many tiles of at most ``tile_rows`` rows cover ``rows`` (at least 1)."""
    if not isinstance(tile_rows, int) or isinstance(tile_rows, bool) or tile_rows < 1:
        raise TilingError(f"tile rows expected a positive int, got {tile_rows!r}")
    return max(1, math.ceil(rows / tile_rows))


def default_tile_rows(width: int, element_size: int, budget: int = MLP_TILE_BYTES) -> int:
    """Rows of a tile whose widest tensor ``[rows, width]`` (``element_size`` bytes) fits ``budget``."""
    return max(1, budget // max(1, width * element_size))


def tile_bounds(rows: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous ``(start, stop)`` slices of ``range(rows)``, sizes differing by at
    most one (the first ``rows % count`` one longer); empty slices when ``count > rows``."""
    if count < 1:
        raise TilingError(f"tile count expected a positive int, got {count!r}")
    base, extra = divmod(rows, count)
    bounds, start = [], 0
    for i in range(count):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True, eq=False)
class _TileCall:
    """What one call of ``SequenceTiled`` needs besides its tensors."""

    fn: Callable[[torch.Tensor], torch.Tensor]  # the module's own forward, [1, rows, h] -> [1, rows, h_out]
    count: int
    params: tuple[torch.Tensor, ...]  # the parameters given as inputs (they receive the gradients)
    current: Callable[[], tuple[torch.Tensor, ...]]  # the module's trainable parameters now
    accum_dtype: torch.dtype | None
    name: str
    # DeepSpeed ZeRO-3 parameters: a sub-module's (an MLP's gate_proj, ...) are empty until the
    # sub-module runs inside a tile, so no autograd edge can be made to them here (it would
    # record their empty shape), and empty again when this function's backward returns (the
    # engine frees a sub-module's parameters after its backward), too late for one
    # accumulation. Their gradients are accumulated per tile, while gathered, under DeepSpeed's
    # protocol for tiled compute: ``ds_grad_is_ready`` False until the last tile, so that its
    # reduce runs once per step (what its TiledMLP does; tests/test_longctx_engines.py).
    zero3: tuple[torch.Tensor, ...] = ()


def _run(fn, x_tile: torch.Tensor) -> torch.Tensor:
    out = fn(x_tile.unsqueeze(0))
    if not isinstance(out, torch.Tensor):
        raise TilingError(f"tiled module: forward returned {type(out).__name__}; only modules returning one tensor can be tiled")
    return out.squeeze(0)


class SequenceTiled(torch.autograd.Function):
    """``x [..., h] -> fn(x) [..., h_out]`` in ``call.count`` row tiles; saves ``x`` only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, call: _TileCall, *params: torch.Tensor) -> torch.Tensor:
        ctx.call = call
        ctx.save_for_backward(x)
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        out = None
        with torch.no_grad():
            for start, stop in tile_bounds(rows, call.count):
                if stop == start:
                    continue
                y = _run(call.fn, flat[start:stop])
                if out is None:
                    if stop - start == rows:  # one tile: its output is the result, no copy
                        return y.reshape(*x.shape[:-1], y.shape[-1])
                    out = y.new_empty(rows, y.shape[-1])
                out[start:stop] = y
                del y  # the tile's output goes before the next tile runs
        if out is None:  # no rows at all
            out = _run(call.fn, flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        call: _TileCall = ctx.call
        (x,) = ctx.saved_tensors
        now, then = call.current(), call.params + call.zero3
        if len(now) != len(then) or any(a is not b for a, b in zip(now, then)):
            raise TilingError(
                f"{call.name}: the module's parameters in the backward are not the objects the forward used "
                "(an engine swapped them between forward and backward); the tiled gradient cannot reach them"
            )
        needs_x = ctx.needs_input_grad[0]
        wanted = [i for i, p in enumerate(call.params) if ctx.needs_input_grad[2 + i]]
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1]).detach()
        grad_flat = grad_out.reshape(rows, grad_out.shape[-1])
        dx = torch.empty_like(flat) if needs_x else None
        acc: list[torch.Tensor | None] = [None] * len(wanted)
        bounds = [(a, b) for a, b in tile_bounds(rows, call.count) if b > a]
        for k, (start, stop) in enumerate(bounds):
            xt = flat[start:stop].requires_grad_(needs_x)
            with torch.enable_grad():
                y = _run(call.fn, xt)
            if call.zero3:
                for p in call.zero3:
                    p.ds_grad_is_ready = k + 1 == len(bounds)
                torch.autograd.backward(y, grad_flat[start:stop], inputs=([xt] if needs_x else []) + list(call.zero3))
                del y
                if needs_x:
                    dx[start:stop] = xt.grad
                    xt.grad = None
                continue
            inputs = ([xt] if needs_x else []) + [call.params[i] for i in wanted]
            grads = torch.autograd.grad(y, inputs, grad_flat[start:stop], allow_unused=True)
            del y
            if needs_x:
                dx[start:stop] = grads[0]
                grads = grads[1:]
            for j in range(len(grads)):
                if grads[j] is not None:
                    wide = call.accum_dtype or _accum_dtype(grads[j].dtype)
                    acc[j] = grads[j].to(wide) if acc[j] is None else acc[j].add_(grads[j])
            del grads  # (no loop variable may keep the last tile's gradient into the next tile)
        param_grads: list[torch.Tensor | None] = [None] * len(call.params)
        for j, i in enumerate(wanted):
            if acc[j] is not None:
                param_grads[i] = acc[j].to(call.params[i].dtype)
        return (dx.view_as(x) if needs_x else None), None, *param_grads


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision gradients are summed over the tiles in float32, others in their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def trainable(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """``module``'s parameters that require grad, in ``parameters()`` order."""
    return tuple(p for p in module.parameters() if p.requires_grad)


def tiled_apply(
    module: torch.nn.Module,
    x: torch.Tensor,
    *,
    tiles: int,
    fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    accum_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``module(x)`` over ``tiles`` row tiles, recomputed per tile in the backward.

    Args:
        module: a per-token module (every output row depends on its input row only: an MLP,
            a norm), whose forward takes and returns one tensor.
        x: ``[..., hidden]`` (``[batch, seq_local, hidden]``); its rows are tiled in order.
        tiles: the number of tiles, the same on every rank where an engine runs collectives
            per sub-module call (``tile_count`` of the group's longest shard).
        fn: the forward to tile (default ``module.forward``: call this from inside the
            module's ``__call__``, e.g. a ``forward`` that delegates here, so that engine
            hooks have gathered the parameters).
        accum_dtype: dtype of the parameter-gradient sums (default float32 for half types).

    Returns ``fn(x)``; its backward gives ``x`` and every trainable parameter of ``module``
    one gradient (summed over the tiles).
    """
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
        raise TilingError(f"tiled_apply: tiles expected a positive int, got {tiles!r}")
    params = trainable(module)
    zero3 = ()
    if any(getattr(p, "ds_id", None) is not None for p in params):  # DeepSpeed ZeRO-3: its own protocol (_TileCall.zero3)
        zero3, params = params, ()
    call = _TileCall(fn or module.forward, tiles, params, lambda: trainable(module), accum_dtype, type(module).__name__, zero3)
    return SequenceTiled.apply(x, call, *params)
