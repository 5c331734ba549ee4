"""The attention module in the replay: q/k/v projections (and Qwen3's per-head q/k norms), RoPE,
``ulysses_attention`` (``attention_op.AttentionOpReplay``), o_proj's output, and their backward
from o_proj's input gradient."""

from __future__ import annotations

from .attention_op import AttentionOpReplay
from .ledger import Ledger
from .norm import NormReplay
from .sizes import ExchangeBytes, Rows, StepSizes

__all__ = ["AttentionReplay"]


class AttentionReplay:
    """The attention of one rank's step: ``sizes`` the step's, ``x`` the op's buffers."""

    def __init__(self, ledger: Ledger, setup, sizes: StepSizes, x: ExchangeBytes, norms: NormReplay):
        self.t, self.s, self.sizes, self.norms = ledger, setup, sizes, norms
        self.op = AttentionOpReplay(ledger, setup, sizes, x)
        # Nemotron-H's and Jamba's attention has no RoPE (``Mixer.rope``): the projections go to the op
        self.rotary = setup.mixer is None or setup.mixer.rope

    # ---- RoPE ------------------------------------------------------------------------------
    def rope(self, src: str, nbytes: int, out: str) -> None:
        t = self.t
        t.new(out + ".c", nbytes)
        t.new(out + ".n", nbytes // 2)
        t.new(out + ".cat", nbytes, "rope")
        t.free(out + ".n")
        t.new(out + ".s", nbytes)
        t.free(out + ".cat")
        t.new(out, nbytes, "rope")
        t.free(out + ".c", out + ".s")

    def rope_backward(self, grad: str, nbytes: int, out: str) -> None:
        t, w = self.t, "rope backward"
        t.new(out + ".a", nbytes, w)
        t.new(out + ".b", nbytes // 2, w)
        t.new(out + ".c", nbytes, w)
        t.free(out + ".b")
        t.new(out + ".d", nbytes, w)
        t.free(out + ".c")
        t.new(out + ".e", nbytes, w)
        t.free(out + ".d", out + ".a")
        t.new(out + ".f", nbytes, w)
        t.free(grad)
        t.new(out, nbytes, w)
        t.free(out + ".f", out + ".e")

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, p: str, keep: bool) -> str:
        """q/k/v projections, RoPE, ``ulysses_attention``, o_proj; returns o_proj's output.
        The q/k/v inputs of the op stay until the attention module returns."""
        t, R = self.t, self.sizes.rows
        if self.s.qk_norm:  # Qwen3: an RMSNorm over head_dim on q and k before RoPE
            pre = []
            for role, size, hr in (("q", R.Q, self.sizes.qrows), ("k", R.K, self.sizes.krows)):
                t.new(p + role, size)
                pre.append(self.norms.forward(p + role + "n.", hr, keep))
                if not (keep and (self.s.tiled_norms or hr.C == 0)):
                    t.free(p + role)  # saved only by a float32 norm (pow) or a tiled one
            t.new(p + "v", R.K)
            self.rope(pre[0], R.Q, p + "qe")
            self.rope(pre[1], R.K, p + "ke")
            t.free(*pre)
        elif not self.rotary:
            t.new(p + "qe", R.Q)
            t.new(p + "ke", R.K)
            t.new(p + "v", R.K)
        else:
            t.new(p + "q", R.Q)
            t.new(p + "k", R.K)
            t.new(p + "v", R.K)
            self.rope(p + "q", R.Q, p + "qe")
            self.rope(p + "k", R.K, p + "ke")
            t.free(p + "q", p + "k")
        out = self.op.forward(p, keep)
        o = t.new(p + "o", R.X)
        t.free(p + "qe", p + "ke", p + "v")
        if not keep:
            t.free(out)
        return o

    # ---- backward ----------------------------------------------------------------------------
    def backward(self, p: str, grad: str, x: str) -> str:
        """From o_proj's input gradient ``grad`` through the op, RoPE and the q/k/v projections
        to the gradient of their input ``x`` (the norm's output, freed here)."""
        dq, dk, dv = self.op.backward(p, grad)
        return self.projections_backward(p, dq, dk, dv, x)

    def projections_backward(self, p: str, dq: str, dk: str, dv: str, x: str) -> str:
        """RoPE backward, then v, k, q projections' backward; frees their input ``x`` (the
        norm's output); returns its gradient."""
        t, R, w = self.t, self.sizes.rows, "q/k/v backward"
        e, params = self.s.element_size, self.sizes.params
        if self.rotary:
            self.rope_backward(dk, R.K, p + "dkp")
            self.rope_backward(dq, R.Q, p + "dqp")
        else:
            t.rename(dk, p + "dkp")
            t.rename(dq, p + "dqp")
        t.new(p + "dWv", params["v"] * e, w)
        t.new(p + "dxv", R.X, w)
        t.free(dv, p + "dWv")
        dkp, dqp, copies = p + "dkp", p + "dqp", (True, True)
        if self.s.qk_norm:  # each per-head norm's backward, then (untiled) the view's copy
            dkp, ck = self._head_norm_backward(p + "kn.", self.sizes.krows, dkp, p + "k")
            dqp, cq = self._head_norm_backward(p + "qn.", self.sizes.qrows, dqp, p + "q")
            copies = (ck, cq)
        self._view_grad(dkp, p + "dkc", R.K, copies[0], w)
        t.new(p + "dWk", params["k"] * e, w)
        t.new(p + "dxk", R.X, w)
        t.free(p + "dkc")
        acc = t.accumulate(p + "dxv", p + "dxk", R.X, w)
        t.free(p + "dWk")
        self._view_grad(dqp, p + "dqc", R.Q, copies[1], w)
        t.new(p + "dWq", params["q"] * e, w)
        t.new(p + "dxq", R.X, w)
        t.free(p + "dqc", x)
        acc = t.accumulate(acc, p + "dxq", R.X, w)
        t.free(p + "dWq")
        return acc

    def _head_norm_backward(self, p: str, rows: Rows, grad: str, x: str) -> tuple[str, bool]:
        """A per-head norm's backward: ``(input gradient, whether the view before it copies it)``:
        the untiled norm's gradient keeps RoPE's transposed strides, the tiled one is contiguous.
        Its input ``x`` (the projection's output) is saved by a tiled or a float32 norm only."""
        tiled = self.norms.tiled
        saved = x if tiled or rows.C == 0 else None
        return self.norms.backward(p, rows, grad, saved, None, "q/k norm backward"), not tiled

    def _view_grad(self, grad: str, out: str, nbytes: int, copy: bool, where: str) -> None:
        """The projection output's view: a copy of a strided gradient, else the gradient itself."""
        if copy:
            self.t.new(out, nbytes, where)
            self.t.free(grad)
        else:
            self.t.rename(grad, out)
