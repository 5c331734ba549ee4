"""The replay of one training step on one rank (``StepReplay``): the decoder layers' forward,
checkpointed recompute and backward, the embedding, final norm and loss, and the activation
offload's host bytes, on one ``Ledger``."""

from __future__ import annotations

from dataclasses import dataclass

from .attention import AttentionReplay
from .ledger import Ledger
from .loss import LossReplay
from .mixer_replay import MixerReplay
from .mlp import MlpReplay
from .norm import NormReplay
from .sizes import ExchangeBytes, StepSizes
from .tiles import Tiles, tile_rows

__all__ = ["StepMemory", "StepReplay", "rank_key", "step_memory"]


@dataclass(frozen=True)
class StepMemory:
    """``peak``: the most bytes alive at once in the step; ``moment``: where (the tensor whose
    allocation reached it); ``forward_peak``/``forward_end``: the forward's peak and what it
    leaves for the backward; ``host_peak``: host bytes of the activation offload."""

    peak: int
    moment: str
    forward_peak: int
    forward_end: int
    host_peak: int


class StepReplay:
    """The replay of one step of ``setup`` on sequence rank ``rank``: ``run()`` once."""

    def __init__(self, setup, rank: int):
        self.s = setup
        self.t = Ledger()
        self.sizes = StepSizes.of(setup, rank)
        self.exchange = ExchangeBytes.of(setup, rank)
        loss_rows, mlp_rows, norm_rows = tile_rows(setup)
        tiles = Tiles(self.t, self.sizes)
        self.norms = NormReplay(self.t, tiles, setup.tiled_norms, norm_rows)
        self.mlp = MlpReplay(self.t, tiles, setup.mlp == "plain", self.sizes.params["mlp"], setup.element_size, setup.tiled_mlp, mlp_rows)
        self.attention = AttentionReplay(self.t, setup, self.sizes, self.exchange, self.norms)
        self.loss = LossReplay(self.t, setup, self.sizes, loss_rows)
        self.mixer = MixerReplay(self.t, setup, self.sizes, rank) if setup.mixer is not None else None

    def _mixes(self, i: int) -> bool:
        """Layer ``i`` is a hybrid's Gated DeltaNet layer (else attention)."""
        return self.mixer is not None and self.s.mixer.is_mixer(i)

    def _blocks(self) -> bool:
        """Each layer is one block (Nemotron-H: mixer form ``"blocks"``)."""
        return self.mixer is not None and self.s.mixer.form == "blocks"

    def _parallel(self) -> bool:
        """Each layer runs Mamba2 and attention side by side (Falcon-H1: mixer form ``"parallel"``)."""
        return self.mixer is not None and self.s.mixer.form == "parallel"

    # ---- a decoder layer ---------------------------------------------------------------------
    def layer_forward(self, i: int, keep: bool) -> str:
        """Layer ``i``'s forward on its input ``in{i}``; returns its output. ``keep=False``:
        under checkpointing (nothing kept); ``keep=True`` without checkpointing."""
        if self._blocks():
            return self.block_forward(i, keep)
        if self._parallel():
            return self.parallel_forward(i, keep)
        t, R, p = self.t, self.sizes.rows, f"L{i}."
        n1 = self.norms.forward(p + "n1.", R, keep)
        o = self.mixer.forward(p + "a.", keep) if self._mixes(i) else self.attention.forward(p + "a.", keep)
        if not keep:
            t.free(n1)
        t.new(p + "res1", R.X)
        t.free(o)
        n2 = self.norms.forward(p + "n2.", R, keep)
        return self._mlp_half(i, n2, keep)

    def _mlp_half(self, i: int, n2: str, keep: bool) -> str:
        """The MLP on norm2's output ``n2`` and the layer's output ``in{i+1}``; res1 goes
        unless norm2 saved it (a sequential layer and a parallel one end alike)."""
        t, R, p = self.t, self.sizes.rows, f"L{i}."
        m = self.mlp.layer_forward(p + "m.", R, keep)
        if not keep:
            t.free(n2)
        out = t.new(f"in{i + 1}", R.X, "layer output")
        t.free(m)
        if not self._keeps_res1(keep):
            t.free(p + "res1")
        return out

    def _keeps_res1(self, keep: bool) -> bool:
        """res1 (attention's residual sum) is saved by norm2: tiled (its input), float32 (pow's)."""
        return keep and (self.s.tiled_norms or self.sizes.rows.C == 0)

    def layer_recompute(self, i: int) -> None:
        """The checkpointed layer's forward again, in the backward, up to its last saved tensor."""
        if self._blocks():
            return self.block_recompute(i)
        if self._parallel():
            return self.parallel_forward(i, keep=True, recompute=True)
        t, R, p = self.t, self.sizes.rows, f"L{i}."
        self.norms.forward(p + "n1.", R, keep=True)
        o = self.mixer.forward(p + "a.", keep=True) if self._mixes(i) else self.attention.forward(p + "a.", keep=True)
        t.new(p + "res1", R.X)
        t.free(o)
        self.norms.forward(p + "n2.", R, keep=True)
        self.mlp.recompute(p + "m.", R)
        if not self._keeps_res1(True):
            t.free(p + "res1")

    def layer_backward(self, i: int, grad: str, x: str | None) -> str:
        """Layer ``i``'s backward from the gradient of its output; frees its input ``x`` (when its
        last saved reference goes); returns the input's gradient."""
        if self._blocks():
            return self.block_backward(i, grad, x)
        if self._parallel():
            return self.parallel_backward(i, grad, x)
        R, p = self.sizes.rows, f"L{i}."
        dx2 = self.mlp.layer_backward(p + "m.", R, p + "n2.out")
        res1 = p + "res1" if self._keeps_res1(True) else None
        dres1 = self.norms.backward(p + "n2.", R, dx2, res1, grad, "norm backward")
        dxn1 = self.mixer.backward(p + "a.", dres1, p + "n1.out") if self._mixes(i) else self.attention_backward(p, dres1)
        return self.norms.backward(p + "n1.", R, dxn1, x, dres1, "norm backward")

    def attention_backward(self, p: str, grad: str, x: str | None = None) -> str:
        """From the attention output's gradient ``grad`` (the caller's, kept) through o_proj and
        the attention to the gradient of its input ``x`` (default the norm's output ``n1.out``; freed)."""
        t, R = self.t, self.sizes.rows
        t.new(p + "dWo", self.sizes.params["o"] * self.s.element_size, "o_proj backward")
        dattn = t.new(p + "dattn", R.Q, "o_proj backward")
        if self.exchange.world > 1:  # o_proj's input (at world 1 it is the attention output, freed below)
            t.free(p + "a.out")
        t.free(p + "dWo")
        return self.attention.backward(p + "a.", dattn, x or p + "n1.out")

    # ---- a parallel layer (Falcon-H1: norm -> Mamba2 beside attention -> sum -> norm -> MLP) -------
    def parallel_forward(self, i: int, keep: bool, recompute: bool = False) -> str | None:
        """The norm's output times the SSM's and the attention's input multipliers (kept: the
        in_proj and q/k/v inputs; the norm's output goes), Mamba2 (``s.``), attention (``a.``),
        their outputs times their multipliers and summed, the residual, norm, gated MLP."""
        t, R, p = self.t, self.sizes.rows, f"L{i}."
        n1 = self.norms.forward(p + "n1.", R, keep)
        t.new(p + "s_in", R.X)
        o = self.mixer.forward(p + "s.", keep)
        t.new(p + "s_out", R.X)
        t.free(o)
        t.new(p + "a_in", R.X)
        t.free(n1)
        if not keep:
            t.free(p + "s_in")
        o = self.attention.forward(p + "a.", keep)
        t.new(p + "a_out", R.X)
        t.free(o)
        if not keep:
            t.free(p + "a_in")
        t.new(p + "sum", R.X)
        t.free(p + "s_out", p + "a_out")
        t.new(p + "res1", R.X)
        t.free(p + "sum")
        n2 = self.norms.forward(p + "n2.", R, keep)
        if recompute:
            self.mlp.recompute(p + "m.", R)
            if not self._keeps_res1(True):
                t.free(p + "res1")
            return None
        return self._mlp_half(i, n2, keep)

    def parallel_backward(self, i: int, grad: str, x: str | None) -> str:
        t, R, p, w = self.t, self.sizes.rows, f"L{i}.", "multiplier backward"
        dx2 = self.mlp.layer_backward(p + "m.", R, p + "n2.out")
        res1 = p + "res1" if self._keeps_res1(True) else None
        dres1 = self.norms.backward(p + "n2.", R, dx2, res1, grad, "norm backward")
        da = t.new(p + "da", R.X, w)  # the sum's gradient times the attention's output multiplier
        dan = self.attention_backward(p, da, p + "a_in")
        t.free(da)
        t.new(p + "dn1a", R.X, w)  # times the attention's input multiplier
        t.free(dan)
        ds = t.new(p + "ds", R.X, w)
        dsn = self.mixer.backward(p + "s.", ds, p + "s_in")
        t.free(ds)
        t.new(p + "dn1s", R.X, w)
        t.free(dsn)
        dn1 = t.accumulate(p + "dn1a", p + "dn1s", R.X, w)
        return self.norms.backward(p + "n1.", R, dn1, x, dres1, "norm backward")

    # ---- a block (Nemotron-H: norm -> mixer, attention or MLP -> residual) ------------------------
    def _block_mix(self, i: int, p: str, keep: bool) -> str:
        kind, R = self.s.mixer.block(i), self.sizes.rows
        if kind == "mlp":
            return self.mlp.layer_forward(p + "m.", R, keep)
        return (self.mixer if kind == "mixer" else self.attention).forward(p + "a.", keep)

    def block_forward(self, i: int, keep: bool) -> str:
        t, R, p = self.t, self.sizes.rows, f"L{i}."
        n1 = self.norms.forward(p + "n1.", R, keep)
        o = self._block_mix(i, p, keep)
        if not keep:
            t.free(n1)
        out = t.new(f"in{i + 1}", R.X, "layer output")
        t.free(o)
        return out

    def block_recompute(self, i: int) -> None:
        t, R, p = self.t, self.sizes.rows, f"L{i}."
        self.norms.forward(p + "n1.", R, keep=True)
        if self.s.mixer.block(i) == "mlp":
            self.mlp.recompute(p + "m.", R)
        else:
            t.free(self._block_mix(i, p, keep=True))

    def block_backward(self, i: int, grad: str, x: str | None) -> str:
        R, p, kind = self.sizes.rows, f"L{i}.", self.s.mixer.block(i)
        if kind == "mlp":
            dxn1 = self.mlp.layer_backward(p + "m.", R, p + "n1.out")
        elif kind == "mixer":
            dxn1 = self.mixer.backward(p + "a.", grad, p + "n1.out")
        else:
            dxn1 = self.attention_backward(p, grad)
        return self.norms.backward(p + "n1.", R, dxn1, x, grad, "norm backward")

    # ---- the step ------------------------------------------------------------------------------
    def run(self) -> StepMemory:
        t = self.t
        dropped = self._forward()
        forward_peak, forward_end = t.peak, t.current
        self._backward(dropped)
        return StepMemory(t.peak, t.moment, forward_peak, forward_end, t.host_peak)

    def _norm_keeps_x(self) -> bool:
        """A layer's first norm (and the final norm) saves its input: tiled, or float32
        (otherwise the norm saves its float32 copy)."""
        return self.s.tiled_norms or self.sizes.rows.C == 0

    def _forward(self) -> bool:
        """Embedding, layers, final norm, loss; returns whether the layer inputs are dropped in
        the forward (offloaded, or saved by nothing)."""
        s, t, R = self.s, self.t, self.sizes.rows
        n, e = self.sizes.n, self.sizes.e
        ckpt, offload = s.checkpointing, s.offload_activations
        t.new("in0", R.X, "embedding")
        if self.attention.rotary:
            t.new("cos", n * s.dim * e)
            t.new("sin", n * s.dim * e)
        # A layer's input stays when checkpointing keeps it (not offloaded), or when its first
        # norm saves it.
        norm_keeps_x = self._norm_keeps_x()
        dropped = offload or (not ckpt and not norm_keeps_x)
        for i in range(s.layers):
            if offload:
                t.host_new(R.X)
            self.layer_forward(i, keep=not ckpt)
            if dropped and i > 0:
                t.free(f"in{i}")  # goes once the layer returns (offloaded: the host copy stays)
        self.norms.forward("fn.", R, keep=True)
        if not norm_keeps_x:
            t.free(f"in{s.layers}")
        if dropped:
            t.free("in0")  # the embedding output, held until the base model returns
        self.loss.forward()
        return dropped

    def _backward(self, dropped: bool) -> None:
        """Loss, final norm, layers (recomputed under checkpointing, inputs brought back from
        the host under offload), embedding."""
        s, t, R = self.s, self.t, self.sizes.rows
        ckpt, offload, L = s.checkpointing, s.offload_activations, s.layers
        dh = self.loss.backward()
        fn_x = f"in{L}" if self._norm_keeps_x() else None
        grad = self.norms.backward("fn.", R, dh, fn_x, None, "final norm backward")
        for i in reversed(range(L)):
            x = None if (dropped and not ckpt) else f"in{i}"
            if ckpt:
                if offload:
                    if x not in t.live:
                        t.new(x, R.X, "offload: brought back")
                        t.host_free(R.X)
                    if i > 0 and f"in{i - 1}" not in t.live:
                        t.new(f"in{i - 1}", R.X, "offload: prefetched")
                        t.host_free(R.X)
                self.layer_recompute(i)
                if offload and not s.tiled_norms and R.C:
                    t.free(x)  # the brought-back input is saved by nothing (the norm saves its copy)
                    x = None
            grad = self.layer_backward(i, grad, x)
        t.blip(self.sizes.params["head"] * s.element_size, "embedding backward")
        t.free(grad)


def rank_key(setup, rank: int) -> tuple:
    """What the replay of ``rank`` depends on: ranks with equal keys have equal steps."""
    x = ExchangeBytes.of(setup, rank)
    n = setup.batch * setup.layout(rank).seq_local
    key = (n, x.hq, x.hkv, x.shared, x.gathered, x.send_qkv, x.recv_qkv, x.send_dout, x.out_recv, x.dqkv_recv)
    if setup.mixer is None:
        return key
    m = setup.mixer  # state passing: the fold of the (A, c) of the ranks before differs per rank
    return (*key, m.heads_on(setup, rank), rank if m.strategy(setup.sp) == "state" else None)


def step_memory(setup, rank: int = 0) -> StepMemory:
    """The replay of one training step of ``setup`` on sequence rank ``rank``."""
    return StepReplay(setup, rank).run()
