"""The attention module in the replay: q/k/v projections (and Qwen3's per-head q/k norms), RoPE,
``ulysses_attention`` (the q/k/v exchange, an SDPA-like kernel that saves its output and float32
log-sum-exp, the output exchange) and their backward, down to o_proj's input."""

from __future__ import annotations

from .ledger import Ledger
from .norm import NormReplay
from .sizes import ExchangeBytes, Rows, StepSizes

__all__ = ["AttentionReplay"]


class AttentionReplay:
    """The attention of one rank's step: ``sizes`` the step's, ``x`` the op's buffers."""

    def __init__(self, ledger: Ledger, setup, sizes: StepSizes, x: ExchangeBytes, norms: NormReplay):
        self.t, self.s, self.sizes, self.x, self.norms = ledger, setup, sizes, x, norms

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
        t, R, x = self.t, self.sizes.rows, self.x
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
        else:
            t.new(p + "q", R.Q)
            t.new(p + "k", R.K)
            t.new(p + "v", R.K)
            self.rope(p + "q", R.Q, p + "qe")
            self.rope(p + "k", R.K, p + "ke")
            t.free(p + "q", p + "k")
        if x.send_qkv:
            t.new(p + "send", x.send_qkv)
        t.new(p + "recv", x.recv_qkv, "q/k/v exchange")
        if x.send_qkv:
            t.free(p + "send")
        if x.gathered:  # a copy of q and k, v gathered to one KV head per query head (docs/design.md)
            t.new(p + "qc", x.hq * x.head)
            t.new(p + "kvg", x.kv2)
        t.new(p + "outl", x.out_l, "attention")
        t.new(p + "lse", x.lse, "attention")
        if x.gathered:
            t.free(p + "recv")
            if not keep:
                t.free(p + "qc", p + "kvg")
        elif not keep:
            t.free(p + "recv")
        if not keep:
            t.free(p + "lse")
        if x.world > 1:
            t.new(p + "orecv", x.out_recv)
            t.new(p + "out", R.Q, "output exchange")
            t.free(p + "orecv")
            if not keep:
                t.free(p + "outl")
        o = t.new(p + "o", R.X)
        t.free(p + "qe", p + "ke", p + "v")
        if not keep:
            t.free(p + ("out" if x.world > 1 else "outl"))
        return o

    # ---- backward --------------------------------------------------------------------------
    def backward(self, p: str, grad: str) -> tuple[str, str, str]:
        """From o_proj's input gradient ``grad`` to the gradients of the rotated q, k and v."""
        t, R, x, w = self.t, self.sizes.rows, self.x, "attention backward"
        if x.send_dout:
            t.new(p + "dsend", x.send_dout, "dout exchange")
        t.new(p + "drecv", x.recv_dout, "dout exchange")
        if x.send_dout:
            t.free(p + "dsend")
        t.free(grad)
        if x.head_chunked:
            self._chunked_kernel_backward(p, w)
        else:
            self._kernel_backward(p, w)
        if x.world == 1:  # the kernel's gradients are the results
            for a, b in (("dql", "dq"), ("dkl", "dk"), ("dvl", "dv")):
                t.rename(p + a, p + b)
            return p + "dq", p + "dk", p + "dv"
        t.new(p + "dqkvrecv", x.dqkv_recv, "dq/dk/dv exchange")
        t.new(p + "dq", R.Q, "dq/dk/dv exchange")
        t.new(p + "dk", R.K, "dq/dk/dv exchange")
        t.new(p + "dv", R.K, "dq/dk/dv exchange")
        t.free(p + "dqkvrecv", p + "dkl", p + "dvl", p + "dql")
        return p + "dq", p + "dk", p + "dv"

    def _kernel_backward(self, p: str, w: str) -> None:
        t, x, e = self.t, self.x, self.sizes.e
        t.new(p + "dql", x.hq * x.head, w)
        t.new(p + "dkl", x.dkv_kernel // 2, w)
        t.new(p + "dvl", x.dkv_kernel // 2, w)
        if self.s.flash_workspace:  # flash-attn's mha_bwd: float32 dq_accum [B, S, hq, D], softmax_d [B, hq, S]
            t.blip(x.hq * x.head // e * 4 + x.lse, w + " (flash-attn workspace)")
        t.free(p + "outl", p + "lse")
        t.free(*((p + "qc", p + "kvg") if x.gathered else (p + "recv",)))
        if x.shared:  # KVGradSum: float32 accumulators of the one KV head, then the casts
            wide = self.sizes.wide
            t.new(p + "acck", x.head // e * wide, "KV gradient sum")
            t.new(p + "accv", x.head // e * wide, "KV gradient sum")
            if wide != e:
                t.new(p + "ck", x.head, "KV gradient sum")
                t.new(p + "cv", x.head, "KV gradient sum")
                t.free(p + "acck", p + "accv")
                t.rename(p + "ck", p + "acck")
                t.rename(p + "cv", p + "accv")
            t.free(p + "dkl", p + "dvl", p + "drecv")
            t.rename(p + "acck", p + "dkl")
            t.rename(p + "accv", p + "dvl")
        else:
            t.free(p + "drecv")

    def _chunked_kernel_backward(self, p: str, w: str) -> None:
        """``longctx.HeadChunkedAttention``'s backward: ``dq`` (and for MHA ``dk``, ``dv``) whole,
        the kernel per chunk of query heads, a shared KV head's gradient summed as it goes; the
        saved tensors go when it returns."""
        t, x, e, wide = self.t, self.x, self.sizes.e, self.sizes.wide
        head = x.head
        w += " (head chunks)"
        t.new(p + "dql", x.hq * head, w)
        if not x.shared:
            t.new(p + "dkl", x.hkv * head, w)
            t.new(p + "dvl", x.hkv * head, w)
        c0 = min(self.s.attention_head_chunk, x.hq)
        sizes = [c0] + ([min(c0, x.hq - c0)] if x.hq > c0 else [])
        for i, c in enumerate(sizes):
            q = f"{p}hc{i}."
            for name in ("gq", "gk", "gv"):
                t.new(q + name, c * head, w)
            if self.s.flash_workspace:
                t.blip(c * head // e * 4 + x.lse * c // x.hq, w + ", flash-attn workspace")
            if x.shared and i == 0:  # KVGradSum: accumulators copied from the first head
                t.new(p + "acck", head // e * wide, w)
                t.new(p + "accv", head // e * wide, w)
            t.free(q + "gq", q + "gk", q + "gv")
        if x.shared:
            if wide != e:
                t.new(p + "dkl", head, w)
                t.new(p + "dvl", head, w)
                t.free(p + "acck", p + "accv")
            else:
                t.rename(p + "acck", p + "dkl")
                t.rename(p + "accv", p + "dvl")
        t.free(p + "outl", p + "lse", p + "recv", p + "drecv")

    def projections_backward(self, p: str, dq: str, dk: str, dv: str, x: str) -> str:
        """RoPE backward, then v, k, q projections' backward; frees their input ``x`` (the
        norm's output); returns its gradient."""
        t, R, w = self.t, self.sizes.rows, "q/k/v backward"
        e, params = self.s.element_size, self.sizes.params
        self.rope_backward(dk, R.K, p + "dkp")
        self.rope_backward(dq, R.Q, p + "dqp")
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
