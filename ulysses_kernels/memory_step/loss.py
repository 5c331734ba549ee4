"""The LM head and transformers' causal-LM loss in the replay: logits kept by the model output,
or (``longctx`` tiled loss) the head and the loss over sequence tiles with no logits kept."""

from __future__ import annotations

import math

from .ledger import Ledger
from .sizes import StepSizes
from .tiles import Tiles

__all__ = ["LossReplay"]


class LossReplay:
    """The loss of one rank's step: ``tiled`` (``tiled_loss``) over tiles of ``tile_rows`` tokens."""

    def __init__(self, ledger: Ledger, setup, sizes: StepSizes, tile_rows: int):
        self.t, self.s, self.sizes = ledger, setup, sizes
        self.tiled = setup.tiled_loss
        self.tile_count = max(1, math.ceil(sizes.n / tile_rows))  # this rank's tokens (longctx.loss)

    def forward(self) -> None:
        """From the final norm's output ``fn.out`` to the loss."""
        t = self.t
        e, n, V, wide = self.sizes.e, self.sizes.n, self.s.vocab, self.sizes.wide
        if self.tiled:
            t.new("lse", n * wide)
            for i, tr in enumerate(Tiles.sizes_of(n, self.tile_count)):
                t.new(f"lg{i}", tr * V * e, "loss forward (tiled)")
                if e != wide:
                    t.new(f"lgw{i}", tr * V * wide, "loss forward (tiled)")
                    t.free(f"lg{i}")
                    t.free(f"lgw{i}")
                else:
                    t.free(f"lg{i}")
            return
        t.new("logits", n * V * e, "logits")  # the model output holds them through the step
        if e != wide:
            t.new("logits32", n * V * wide, "loss forward")
        t.new("logsm", n * V * wide, "loss forward")
        if e != wide:
            t.free("logits32")

    def backward(self) -> str:
        """Back to the final norm's output (``fn.out`` freed); returns its gradient ``dh``."""
        s, t, R = self.s, self.t, self.sizes.rows
        e, n, V, wide = self.sizes.e, self.sizes.n, s.vocab, self.sizes.wide
        ep, head = s.element_size, self.sizes.params["head"]
        w = "loss backward"
        if self.tiled:
            w += " (tiled)"
            dh = t.new("dh", R.X, w)
            acc_e = 4 if ep < 4 else ep
            t.new("dw", head * acc_e, w)
            for i, tr in enumerate(Tiles.sizes_of(n, self.tile_count)):
                q = f"lb{i}."
                t.new(q + "p", tr * V * e, w)
                if e != wide:
                    t.new(q + "pw", tr * V * wide, w)
                    t.free(q + "p")
                    t.new(q + "dl", tr * V * e, w)
                    t.free(q + "pw")
                    # CPU: no mixed-dtype matmul, the half operands are upcast for the float32 sum
                    t.new(q + "up", tr * V * 4 + tr * s.hidden * 4, w)
                    t.free(q + "up", q + "dl")
                else:
                    t.free(q + "p")
            t.free("fn.out", "lse")
            if acc_e != ep:
                t.blip(head * ep, w)
            t.free("dw")
            return dh
        t.new("gnll", n * V * wide, w)
        t.new("glog", n * V * wide, w)
        t.free("gnll", "logsm")
        if e != wide:
            t.new("gl", n * V * e, w)
            t.free("glog")
        t.new("dWlm", head * ep, w)
        dh = t.new("dh", R.X, w)
        t.free("gl" if e != wide else "glog", "fn.out", "dWlm")
        return dh
