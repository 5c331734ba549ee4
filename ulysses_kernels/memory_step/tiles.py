"""``SequenceTiled`` in the replay: how many tiles, the tiles replayed, and the tile rows that
``ulysses_kernels.longctx`` picks."""

from __future__ import annotations

import math
from collections.abc import Callable

from ..longctx.loss import loss_tile_rows
from ..longctx.tiling import default_tile_rows
from .ledger import Ledger
from .sizes import Rows, StepSizes

__all__ = ["Tiles", "tile_rows"]


def tile_rows(setup) -> tuple[int, int, int]:
    """(loss, mlp, norm) rows per tile, as ``ulysses_kernels.longctx`` picks them."""
    e = setup.element_size
    loss = setup.loss_tile_rows or loss_tile_rows(setup.vocab)
    mlp = setup.mlp_tile_rows or default_tile_rows(setup.ffn, e)
    norm = setup.norm_tile_rows or default_tile_rows(setup.hidden, max(e, 4))
    return loss, mlp, norm


class Tiles:
    """Tile counts and sizes of one rank, and the tiled forward."""

    def __init__(self, ledger: Ledger, sizes: StepSizes):
        self.t, self.sizes = ledger, sizes

    def count(self, rows: int, tile_rows: int) -> int:
        """The tile count every rank uses: from the group's longest shard (``LongContext.rows_max``)."""
        per_token = max(1, rows // self.sizes.n)  # rows per token: 1, or the heads of a per-head norm
        rows_max = self.sizes.tokens_max * per_token
        return max(1, math.ceil(rows_max / tile_rows))

    @staticmethod
    def sizes_of(rows: int, count: int) -> list[int]:
        """The sizes of the first two tiles (``tiling.tile_bounds``; empty ones dropped): every
        later tile repeats the second's allocations with at most as many rows, on the same
        tensors alive (the first allocates the output or the gradient sums), so the replay's
        peak and end state are those of all the tiles."""
        base, extra = divmod(rows, count)
        return [base + (i < extra) for i in range(min(count, 2)) if base + (i < extra) > 0]

    def replayed(self, rows: int, tile_rows: int) -> list[int]:
        """The tiles the replay runs of ``rows`` rows cut ``tile_rows`` at a time."""
        return self.sizes_of(rows, self.count(rows, tile_rows))

    def forward(self, p: str, run_tile: Callable[[str, Rows], str], rows: Rows, tile_rows: int, width_out: int) -> str:
        """``SequenceTiled`` forward: tiles under no_grad, outputs copied into one buffer."""
        t = self.t
        count = self.count(rows.rows, tile_rows)
        out = None
        for i, tr in enumerate(self.sizes_of(rows.rows, count)):
            y = run_tile(f"{p}t{i}", rows.over(tr))
            if count == 1:
                return t.rename(y, p + "out")
            if out is None:
                out = t.new(p + "out", rows.rows * width_out * self.sizes.e, f"{p} tiled forward")
            t.free(y)
        return out
