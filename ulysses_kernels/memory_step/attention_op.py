"""``ulysses_attention`` in the replay: the q/k/v exchange, an SDPA-like kernel that saves its
output and float32 log-sum-exp, the output exchange, and their backward (the dout exchange, the
kernel's or ``longctx.HeadChunkedAttention``'s backward, the dq/dk/dv exchange); the sizes are
``sizes.ExchangeBytes``."""

from __future__ import annotations

from .ledger import Ledger
from .sizes import ExchangeBytes, StepSizes

__all__ = ["AttentionOpReplay"]


class AttentionOpReplay:
    """The attention op of one rank's step: ``x`` its buffers."""

    def __init__(self, ledger: Ledger, setup, sizes: StepSizes, x: ExchangeBytes):
        self.t, self.s, self.sizes, self.x = ledger, setup, sizes, x

    def forward(self, p: str, keep: bool) -> str:
        """From the rotated q, k and v (the caller's, kept until the module returns) to the
        op's output; returns its name. ``keep``: the kernel's saved tensors stay."""
        t, R, x = self.t, self.sizes.rows, self.x
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
        return p + ("out" if x.world > 1 else "outl")

    def backward(self, p: str, grad: str) -> tuple[str, str, str]:
        """From o_proj's input gradient ``grad`` (freed once sent) to the gradients of the rotated
        q, k and v: the dout exchange, the kernel's backward, the dq/dk/dv exchange."""
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
