"""The MLP in the replay: gated (Llama, Qwen2: ``down(act(gate(x)) * up(x))``) or plain (GPT:
``fc -> activation -> fc``), whole or over sequence tiles (``longctx`` tiled MLP)."""

from __future__ import annotations

from .ledger import Ledger
from .sizes import Rows
from .tiles import Tiles

__all__ = ["MlpReplay"]


class MlpReplay:
    """The MLPs of one rank's step. ``weight_elems``: one projection's parameters;
    ``element_size``: theirs; ``tiled`` (``tiled_mlp``): over tiles of ``tile_rows``."""

    def __init__(self, ledger: Ledger, tiles: Tiles, plain: bool, weight_elems: int, element_size: int, tiled: bool, tile_rows: int):
        self.t, self.tiles = ledger, tiles
        self.plain, self.weight_elems, self.ep = plain, weight_elems, element_size
        self.weight = weight_elems * element_size  # one projection's bytes (and its gradient's)
        self.tiled, self.tile_rows = tiled, tile_rows

    # ---- the MLP of a decoder layer --------------------------------------------------------
    def layer_forward(self, p: str, rows: Rows, keep: bool) -> str:
        """The layer's MLP on its input (the norm's output, the caller's); returns its output."""
        if self.tiled:

            def tile(q: str, sub: Rows) -> str:
                self.forward(q, sub, keep=False)
                return self.down(q, sub, keep=False)

            return self.tiles.forward(p, tile, rows, self.tile_rows, rows.h)
        self.forward(p, rows, keep)
        return self.down(p, rows, keep)

    def recompute(self, p: str, rows: Rows) -> None:
        """The checkpointed layer's MLP again, up to its last saved tensor."""
        if self.tiled:  # the tiles run, then the input is saved: the early stop; the output goes
            self.t.free(self.layer_forward(p, rows, keep=True))
        else:
            self.forward(p, rows, keep=True)

    def layer_backward(self, p: str, rows: Rows, x: str) -> str:
        """The layer's MLP backward (its output's gradient is the caller's); frees its input
        ``x``; returns the input's gradient."""
        if self.tiled:
            dx = self.tiled_backward(p, rows, "mlp backward (tiled)")
            self.t.free(x)
            return dx
        return self.backward(p, rows, None, x, "mlp backward")

    # ---- one MLP call ----------------------------------------------------------------------
    def forward(self, p: str, rows: Rows, keep: bool) -> str:
        """Up to the down projection's input (``prod``; GPT's plain MLP: ``act``)."""
        t = self.t
        if self.plain:  # fc -> activation -> fc
            t.new(p + "gate", rows.F)
            t.new(p + "prod", rows.F, "mlp forward")
            if not keep:
                t.free(p + "gate")
            return p + "prod"
        t.new(p + "gate", rows.F)
        t.new(p + "act", rows.F)
        if not keep:
            t.free(p + "gate")
        t.new(p + "up", rows.F)
        t.new(p + "prod", rows.F, "mlp forward")
        if not keep:
            t.free(p + "act", p + "up")
        return p + "prod"

    def down(self, p: str, rows: Rows, keep: bool) -> str:
        t = self.t
        out = t.new(p + "down", rows.X)
        if not keep:
            t.free(p + "prod")
        return out

    def backward(self, p: str, rows: Rows, grad: str | None, x: str | None, where: str) -> str:
        """Backward of a kept MLP (from ``prod``): consumes ``grad`` (of the down projection's
        output; None: the caller keeps it) and the saved tensors; returns the gradient of its
        input ``x`` (freed here: gate and up saved it). The parameter gradients are counted
        while computed (accumulated and forgotten)."""
        dx, _ = self._backward(p, rows, grad, x, where, keep_weight_grads=False)
        return dx

    def _backward(self, p: str, rows: Rows, grad: str | None, x: str | None, where: str, keep_weight_grads: bool) -> tuple[str, list[str]]:
        """``backward``; ``keep_weight_grads``: the parameter gradients stay, returned for the
        caller to sum (a tile's): ``(input gradient, parameter gradients kept)``."""
        t, w = self.t, self.weight
        dws = []

        def weight_grad_done(name: str) -> None:
            if keep_weight_grads:
                dws.append(name)
            else:
                t.free(name)

        t.new(p + "dWd", w, where)
        t.new(p + "dprod", rows.F, where)
        t.free(p + "prod")
        weight_grad_done(p + "dWd")
        if grad:
            t.free(grad)
        if self.plain:  # the activation's backward, then fc_in's
            t.new(p + "dgate", rows.F, where)
            t.free(p + "dprod", p + "gate")
            t.new(p + "dWg", w, where)
            out = t.new(p + "dxg", rows.X, where)
            t.free(p + "dgate", x)
            weight_grad_done(p + "dWg")
            return out, dws
        t.new(p + "dact", rows.F, where)
        t.new(p + "dup", rows.F, where)
        t.free(p + "dprod", p + "act", p + "up")
        t.new(p + "dWu", w, where)
        t.new(p + "dxu", rows.X, where)
        t.free(p + "dup")
        weight_grad_done(p + "dWu")
        t.new(p + "dgate", rows.F, where)
        t.free(p + "dact", p + "gate")
        t.new(p + "dWg", w, where)
        t.new(p + "dxg", rows.X, where)
        t.free(p + "dgate", x)
        out = t.accumulate(p + "dxu", p + "dxg", rows.X, where)
        weight_grad_done(p + "dWg")
        return out, dws

    def tiled_backward(self, p: str, rows: Rows, where: str) -> str:
        """``SequenceTiled`` backward of the MLP: one ``[n, hidden]`` input gradient, the tile's
        recompute and gradients, the parameter-gradient sums (float32 for half types)."""
        t, ep = self.t, self.ep
        dx = t.new(p + "dx", rows.X, where)
        acc_e = 4 if ep < 4 else ep
        accs = None
        for i, tr in enumerate(self.tiles.replayed(rows.rows, self.tile_rows)):
            q = f"{p}bt{i}."
            sub = rows.over(tr)
            self.forward(q, sub, keep=True)
            t.new(q + "down", sub.X)
            dxt, dws = self._backward(q, sub, None, None, where, keep_weight_grads=True)
            t.free(q + "down")  # the tile's output, dropped after its gradients
            t.free(dxt)  # copied into dx
            if accs is None:
                if acc_e == ep:
                    accs = dws
                else:
                    accs = [t.new(f"{p}acc{j}", self.weight_elems * acc_e, where) for j in range(len(dws))]
                    t.free(*dws)
            else:
                t.free(*dws)
        if acc_e != ep:  # cast back to the parameters' dtype: returned, accumulated, forgotten
            for _ in accs:
                t.blip(self.weight, where)
        t.free(*accs)
        return dx
