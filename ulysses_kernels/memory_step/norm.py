"""transformers' RMSNorm in the replay: one call's forward and backward, and the tiled norm
(``longctx`` tiled norms) over sequence tiles."""

from __future__ import annotations

from .ledger import Ledger
from .sizes import Rows
from .tiles import Tiles

__all__ = ["NormReplay"]


class NormReplay:
    """The RMSNorms of one rank's step: ``tiled`` (``tiled_norms``) runs each over tiles of
    ``tile_rows`` rows."""

    def __init__(self, ledger: Ledger, tiles: Tiles, tiled: bool, tile_rows: int):
        self.t, self.tiles = ledger, tiles
        self.tiled, self.tile_rows = tiled, tile_rows

    def forward(self, p: str, rows: Rows, keep: bool) -> str:
        """A norm of the model on ``rows`` (tiled or not); returns its output's name."""
        if self.tiled:
            return self.tiles.forward(p, lambda q, sub: self.rmsnorm_forward(q, sub, keep=False), rows, self.tile_rows, rows.h)
        return self.rmsnorm_forward(p, rows, keep)

    def backward(self, p: str, rows: Rows, grad: str, x: str | None, acc: str | None, where: str) -> str:
        """A norm of the model's backward (tiled or not): see ``rmsnorm_backward``."""
        if self.tiled:
            return self.tiled_backward(p, rows, grad, x, acc, where + " (tiled)")
        return self.rmsnorm_backward(p, rows, grad, x, acc, where)

    def rmsnorm_forward(self, p: str, rows: Rows, keep: bool) -> str:
        """transformers' RMSNorm on ``rows`` (its input is the caller's); returns the output's
        name. ``keep``: the saved tensors stay (a forward that keeps activations, a recompute)."""
        t = self.t
        if rows.C:
            t.new(p + "copy", rows.C)
        t.new(p + "pow", rows.W)
        t.new(p + "var", rows.r)
        t.free(p + "pow")
        t.new(p + "vare", rows.r)
        t.new(p + "rs", rows.r)
        t.free(p + "vare")
        t.new(p + "nrm32", rows.W)
        if rows.C and not keep:
            t.free(p + "copy")
        if rows.C:
            t.new(p + "nrm", rows.X)
        out = t.new(p + "out", rows.X, "rmsnorm forward")
        t.free(p + "var")
        if rows.C:
            t.free(p + "nrm32")
        if not keep:
            t.free(p + "rs", p + ("nrm" if rows.C else "nrm32"))
        return out

    def rmsnorm_backward(self, p: str, rows: Rows, grad: str, x: str | None, acc: str | None, where: str) -> str:
        """Backward of a kept RMSNorm: consumes ``grad`` (of its output) and its saved tensors,
        frees its input ``x`` when given (saved by the norm only), and adds the input's
        gradient to ``acc`` (a gradient of the input already there) or returns a new one."""
        t = self.t
        nrm = p + ("nrm" if rows.C else "nrm32")
        t.new(p + "gn", rows.X, where)
        t.blip(rows.X, where)
        t.free(grad, nrm)
        if rows.C:
            t.new(p + "gn32", rows.W, where)
            t.free(p + "gn")
        gn = p + ("gn32" if rows.C else "gn")
        t.new(p + "gx1", rows.W, where)
        t.blip(rows.W, where)
        t.free(gn)
        if not rows.C and acc is not None:  # x's gradient buffer: acc + gx1
            acc = t.accumulate(acc, p + "gx1", rows.X, where)
        t.free(p + "rs")
        t.new(p + "gm", rows.W, where)
        t.new(p + "p1", rows.W, where)
        t.new(p + "m1", rows.W, where)
        t.new(p + "m2", rows.W, where)
        t.free(p + "gm", p + "p1", p + "m1")
        if rows.C:
            t.free(p + "copy")
        elif x is not None:
            t.free(x)
        if rows.C:  # the float32 gradient of the copy, cast back, then added to x's
            t.new(p + "gx32", rows.W, where)
            t.free(p + "gx1", p + "m2")
            t.new(p + "gx", rows.X, where)
            t.free(p + "gx32")
            if x is not None:
                t.free(x)
            return t.accumulate(acc, p + "gx", rows.X, where) if acc is not None else p + "gx"
        first = acc if acc is not None else p + "gx1"
        return t.accumulate(first, p + "m2", rows.X, where)

    def tiled_backward(self, p: str, rows: Rows, grad: str, x: str | None, acc: str | None, where: str) -> str:
        """``SequenceTiled`` backward of a norm: ``dx`` filled tile by tile; frees ``grad``
        and ``x`` (saved by it) at the end; adds ``dx`` to ``acc`` when given."""
        t = self.t
        dx = t.new(p + "dx", rows.X, where)
        for i, tr in enumerate(self.tiles.replayed(rows.rows, self.tile_rows)):
            q = f"{p}bt{i}."
            sub = rows.over(tr)
            out_t = self.rmsnorm_forward(q, sub, keep=True)
            g = t.new(q + "g", 0)  # the tile's gradient is a view of ``grad``
            dxt = self.rmsnorm_backward(q, sub, g, None, None, where)
            t.free(out_t)
            t.free(dxt)  # copied into dx
        t.free(grad)
        if x is not None:
            t.free(x)
        return t.accumulate(acc, dx, rows.X, where) if acc is not None else dx
