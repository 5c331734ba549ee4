"""One training step's device bytes on one rank, tensor by tensor: the calculator's step peak.

``step_memory(setup, rank)`` replays one forward and backward of a transformers Llama / Qwen2
model (RMSNorm, RoPE, attention through ``hf.apply`` with an SDPA-like kernel that saves its
output and float32 log-sum-exp, a gated MLP, transformers' causal-LM loss) as the tensors
it allocates and frees, in order, with their sizes for this rank, and returns the highest
sum (the step's peak) and where it happened. It covers activation checkpointing (on or off;
non-reentrant, backward inside one ``torch.utils.checkpoint.GraphExecGroup`` so that each
layer is recomputed once), and the long-context pieces of ``ulysses_kernels.longctx``:
the tiled loss, tiled MLP, tiled norms and activation offload (host bytes kept apart).

What is counted is what ``traffic.LiveBytes`` counts in ``tests/test_longctx_memory.py``:
every tensor the step allocates, from allocation to free; not the parameters, the caller's
inputs, or parameter gradients once accumulated (an engine reduces and frees them; each
parameter's gradient is counted while it is computed). The replay follows the order in
which transformers 5.23's Llama code and torch's autograd (2.14) allocate and free; the
test measures it on 2 and 4 gloo ranks. Sizes below, per rank: ``n`` tokens (batch x local
sequence), ``X = n h e`` (a hidden-size activation), ``W = n h 4`` (its float32 copy),
``Q``/``K`` (q / one of k, v projections), ``F = n f e`` (an MLP intermediate), ``r = 4 n``.

Two facts that shape the peak at long sequences: transformers' RMSNorm keeps a float32
copy of its input and makes three float32 ``[n, hidden]`` temporaries in its backward
(``tiled_norms`` keeps them to one tile), and a checkpointed layer whose backward runs
nested backward passes (our attention) is recomputed twice unless the backward runs inside
one ``GraphExecGroup`` (docs/longctx.md): the replay assumes one recompute.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .gqa import shares_one_kv, uniform_group
from .layout import Q_ONLY, QKV
from .longctx.loss import loss_tile_rows
from .longctx.tiling import default_tile_rows
from .traffic import h2s_recv_elems, s2h_send_elems

__all__ = ["StepMemory", "step_memory", "rank_key"]


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


class _Timeline:
    """Tensors alive by name; the running sum and its peak."""

    def __init__(self):
        self.live: dict[str, int] = {}
        self.current = 0
        self.peak = 0
        self.moment = ""
        self.host = 0
        self.host_peak = 0
        self._n = 0
        self.record = False  # keep what is alive at the peak (debugging the replay)
        self.at_peak: dict[str, int] = {}
        self.moments: dict[str, int] = {}

    def new(self, name: str, nbytes: int, where: str = "") -> str:
        if name in self.live:
            raise AssertionError(f"memory_step: {name} allocated twice")
        self.live[name] = nbytes
        self.current += nbytes
        if self.record:
            key = where or re.sub(r"^L\d+\.|bt?\d+\.|\d+$", "", name)
            self.moments[key] = max(self.moments.get(key, 0), self.current)
        if self.current > self.peak:
            self.peak, self.moment = self.current, where or name
            if self.record:
                self.at_peak = dict(self.live)
        return name

    def free(self, *names: str | None) -> None:
        for name in names:
            if name is not None:
                self.current -= self.live.pop(name)

    def blip(self, nbytes: int, where: str) -> None:
        """A temporary allocated and freed at once."""
        self._n += 1
        name = self.new(f"_blip{self._n}", nbytes, where)
        self.free(name)

    def host_new(self, nbytes: int) -> None:
        self.host += nbytes
        self.host_peak = max(self.host_peak, self.host)

    def host_free(self, nbytes: int) -> None:
        self.host -= nbytes


@dataclass(frozen=True)
class _Rows:
    """Sizes of tensors over ``rows`` tokens."""

    rows: int
    e: int  # element size
    h: int
    f: int
    dq: int  # q width (heads x head_dim)
    dkv: int  # k / v width

    @property
    def X(self) -> int:
        return self.rows * self.h * self.e

    @property
    def W(self) -> int:
        return self.rows * self.h * 4

    @property
    def C(self) -> int:  # the norm's float32 copy (none in float32)
        return 0 if self.e == 4 else self.W

    @property
    def r(self) -> int:
        return self.rows * 4

    @property
    def Q(self) -> int:
        return self.rows * self.dq * self.e

    @property
    def K(self) -> int:
        return self.rows * self.dkv * self.e

    @property
    def F(self) -> int:
        return self.rows * self.f * self.e


class _Step:
    """The replay of one step for one rank."""

    def __init__(self, setup, rank: int):
        self.s = setup
        self.t = _Timeline()
        lay = setup.layout(rank)
        self.lay, self.rank = lay, rank
        self.world = lay.world_size
        e = setup.element_size
        self.e = e
        self.wide = max(e, 4)
        n = setup.batch * lay.seq_local
        self.n = n
        d = setup.dim
        self.rows = _Rows(n, e, setup.hidden, setup.ffn, setup.heads * d, setup.kv_count * d)
        self.qrows = _Rows(n * setup.heads, e, d, 0, 0, 0)  # per-head norms: one row per head and token
        self.krows = _Rows(n * setup.kv_count, e, d, 0, 0, 0)
        self.params = {
            "q": setup.hidden * setup.heads * d, "k": setup.hidden * setup.kv_count * d, "v": setup.hidden * setup.kv_count * d,
            "o": setup.hidden * setup.heads * d, "mlp": setup.hidden * setup.ffn, "norm": setup.hidden,
            "head": setup.vocab * setup.hidden,
        }  # fmt: skip
        self._attention_sizes()

    # ---- sizes of the exchange (docs/design.md "Buffers and who owns them") --------------
    def _attention_sizes(self) -> None:
        lay, e, r = self.lay, self.e, self.rank
        B, S, D = lay.batch, lay.seq_total, lay.head_dim
        hq, hkv = lay.head_count("q", r), lay.head_count("kv", r)
        kv_map = lay.plan.local_kv_map(r)
        self.shared = shares_one_kv(kv_map)
        self.gathered = not self.shared and not uniform_group(len(kv_map), hkv, kv_map)
        head = B * S * D * e
        self.head, self.hq, self.hkv = head, hq, hkv
        one = self.world == 1  # the exchange moves nothing: the op's buffers are its kernel's
        self.send_qkv = 0 if one else s2h_send_elems(lay, QKV) * e
        self.recv_qkv = sum(lay.s2h_recv_splits(QKV)) * e
        self.send_dout = 0 if one else s2h_send_elems(lay, Q_ONLY) * e
        self.recv_dout = hq * head
        self.out_l = hq * head
        self.lse = B * hq * S * 4
        self.out_recv = 0 if one else h2s_recv_elems(lay, Q_ONLY) * e
        self.dqkv_recv = 0 if one else h2s_recv_elems(lay, QKV) * e
        self.kv2 = 2 * hq * head if self.gathered else 0
        self.dkv_kernel = 2 * (hq if self.shared or self.gathered else hkv) * head
        # longctx.HeadChunkedAttention runs where the rank's query heads share one KV head or
        # are MHA (elsewhere, and at world 1 here, the default backend)
        mha = tuple(kv_map) == tuple(range(len(kv_map)))
        self.head_chunked = bool(self.s.attention_head_chunk) and hq > 0 and (self.shared or mha)

    # ---- blocks ----------------------------------------------------------------------------
    def norm_forward(self, p: str, rows: _Rows, keep: bool) -> str:
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

    def norm_backward(self, p: str, rows: _Rows, grad: str, x: str | None, acc: str | None, where: str) -> str:
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
            acc = self._accumulate(acc, p + "gx1", rows.X, where)
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
            return self._accumulate(acc, p + "gx", rows.X, where) if acc is not None else p + "gx"
        first = acc if acc is not None else p + "gx1"
        return self._accumulate(first, p + "m2", rows.X, where)

    def _accumulate(self, a: str, b: str, nbytes: int, where: str) -> str:
        self._n_acc = getattr(self, "_n_acc", 0) + 1
        name = self.t.new(f"acc{self._n_acc}", nbytes, where)
        self.t.free(a, b)
        return name

    def tiled_forward(self, p: str, run_tile, rows: _Rows, tile_rows: int, width_out: int) -> str:
        """``SequenceTiled`` forward: tiles under no_grad, outputs copied into one buffer."""
        t = self.t
        count = self._tiles(rows.rows, tile_rows)
        out = None
        for i, tr in enumerate(self._tile_sizes(rows.rows, count)):
            y = run_tile(f"{p}t{i}", self._sub(rows, tr))
            if count == 1:
                t.live[p + "out"] = t.live.pop(y)
                return p + "out"
            if out is None:
                out = t.new(p + "out", rows.rows * width_out * self.e, f"{p} tiled forward")
            t.free(y)
        return out

    def _tiles(self, rows: int, tile_rows: int) -> int:
        """The tile count every rank uses: from the group's longest shard (``LongContext.rows_max``)."""
        per_token = max(1, rows // self.n)  # rows per token: 1, or the heads of a per-head norm
        rows_max = self.s.batch * max(self.lay.seq_lens) * per_token
        return max(1, math.ceil(rows_max / tile_rows))

    @staticmethod
    def _tile_sizes(rows: int, count: int) -> list[int]:
        """The sizes of the first two tiles (``tiling.tile_bounds``; empty ones dropped): every
        later tile repeats the second's allocations with at most as many rows, on the same
        tensors alive (the first allocates the output or the gradient sums), so the replay's
        peak and end state are those of all the tiles."""
        base, extra = divmod(rows, count)
        return [base + (i < extra) for i in range(min(count, 2)) if base + (i < extra) > 0]

    def _sub(self, rows: _Rows, n: int) -> _Rows:
        return _Rows(n, rows.e, rows.h, rows.f, rows.dq, rows.dkv)

    # ---- the MLP ---------------------------------------------------------------------------
    def mlp_forward(self, p: str, rows: _Rows, keep: bool) -> str:
        """Up to the down projection's input (``prod``; GPT's plain MLP: ``act``)."""
        t = self.t
        if self.s.mlp == "plain":  # fc -> activation -> fc
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

    def mlp_down(self, p: str, rows: _Rows, keep: bool) -> str:
        t = self.t
        out = t.new(p + "down", rows.X)
        if not keep:
            t.free(p + "prod")
        return out

    def mlp_backward(self, p: str, rows: _Rows, grad: str | None, x: str, where: str, params: bool = True) -> str:
        """Backward of a kept gated MLP (from ``prod``): consumes ``grad`` (of the down
        projection's output; None: the caller keeps it) and the saved tensors; returns the gradient of its input ``x``
        (freed here: gate and up saved it). ``params``: parameter gradients are counted
        (accumulated and forgotten), else the caller keeps them (a tile's)."""
        t = self.t
        w = self.params["mlp"] * self.s.element_size
        dws = []

        def weight_grad_done(name: str) -> None:
            if params:
                t.free(name)
            else:
                dws.append(name)

        t.new(p + "dWd", w, where)
        t.new(p + "dprod", rows.F, where)
        t.free(p + "prod")
        weight_grad_done(p + "dWd")
        if grad:
            t.free(grad)
        if self.s.mlp == "plain":  # the activation's backward, then fc_in's
            t.new(p + "dgate", rows.F, where)
            t.free(p + "dprod", p + "gate")
            t.new(p + "dWg", w, where)
            out = t.new(p + "dxg", rows.X, where)
            t.free(p + "dgate", x)
            weight_grad_done(p + "dWg")
            self._tile_dws = dws
            return out
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
        out = self._accumulate(p + "dxu", p + "dxg", rows.X, where)
        weight_grad_done(p + "dWg")
        self._tile_dws = dws
        return out

    def tiled_mlp_backward(self, p: str, rows: _Rows, tile_rows: int, where: str) -> str:
        """``SequenceTiled`` backward of the MLP: one ``[n, hidden]`` input gradient, the tile's
        recompute and gradients, the parameter-gradient sums (float32 for half types)."""
        t = self.t
        dx = t.new(p + "dx", rows.X, where)
        ep = self.s.element_size
        acc_e = 4 if ep < 4 else ep
        count = self._tiles(rows.rows, tile_rows)
        accs = None
        for i, tr in enumerate(self._tile_sizes(rows.rows, count)):
            q = f"{p}bt{i}."
            sub = self._sub(rows, tr)
            self.mlp_forward(q, sub, keep=True)
            t.new(q + "down", sub.X)
            dxt = self.mlp_backward(q, sub, None, None, where, params=False)
            t.free(q + "down")  # the tile's output, dropped after its gradients
            t.free(dxt)  # copied into dx
            dws = self._tile_dws
            if accs is None:
                if acc_e == ep:
                    accs = dws
                else:
                    accs = [t.new(f"{p}acc{j}", self.params["mlp"] * acc_e, where) for j in range(len(dws))]
                    t.free(*dws)
            else:
                t.free(*dws)
        if acc_e != ep:  # cast back to the parameters' dtype: returned, accumulated, forgotten
            for _ in accs:
                t.blip(self.params["mlp"] * ep, where)
        t.free(*accs)
        return dx

    def tiled_norm_backward(self, p: str, rows: _Rows, tile_rows: int, grad: str, x: str | None, acc: str | None, where: str) -> str:
        """``SequenceTiled`` backward of a norm: ``dx`` filled tile by tile; frees ``grad``
        and ``x`` (saved by it) at the end; adds ``dx`` to ``acc`` when given."""
        t = self.t
        dx = t.new(p + "dx", rows.X, where)
        count = self._tiles(rows.rows, tile_rows)
        for i, tr in enumerate(self._tile_sizes(rows.rows, count)):
            q = f"{p}bt{i}."
            sub = self._sub(rows, tr)
            out_t = self.norm_forward(q, sub, keep=True)
            g = self.t.new(q + "g", 0)  # the tile's gradient is a view of ``grad``
            dxt = self.norm_backward(q, sub, g, None, None, where)
            t.free(out_t)
            t.free(dxt)  # copied into dx
        t.free(grad)
        if x is not None:
            t.free(x)
        return self._accumulate(acc, dx, rows.X, where) if acc is not None else dx

    # ---- attention: q/k/v projections, RoPE, the exchange, o_proj ---------------------------
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

    def attention_forward(self, p: str, keep: bool) -> str:
        """q/k/v projections, RoPE, ``ulysses_attention``, o_proj; returns o_proj's output.
        The q/k/v inputs of the op stay until the attention module returns."""
        t, R = self.t, self.rows
        if self.s.qk_norm:  # Qwen3: an RMSNorm over head_dim on q and k before RoPE
            pre = []
            for role, size, hr in (("q", R.Q, self.qrows), ("k", R.K, self.krows)):
                t.new(p + role, size)
                pre.append(self._head_norm(p + role + "n.", hr, keep))
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
        if self.send_qkv:
            t.new(p + "send", self.send_qkv)
        t.new(p + "recv", self.recv_qkv, "q/k/v exchange")
        if self.send_qkv:
            t.free(p + "send")
        if self.gathered:  # a copy of q and k, v gathered to one KV head per query head (docs/design.md)
            t.new(p + "qc", self.hq * self.head)
            t.new(p + "kvg", self.kv2)
        t.new(p + "outl", self.out_l, "attention")
        t.new(p + "lse", self.lse, "attention")
        if self.gathered:
            t.free(p + "recv")
            if not keep:
                t.free(p + "qc", p + "kvg")
        elif not keep:
            t.free(p + "recv")
        if not keep:
            t.free(p + "lse")
        if self.world > 1:
            t.new(p + "orecv", self.out_recv)
            t.new(p + "out", R.Q, "output exchange")
            t.free(p + "orecv")
            if not keep:
                t.free(p + "outl")
        o = t.new(p + "o", R.X)
        t.free(p + "qe", p + "ke", p + "v")
        if not keep:
            t.free(p + ("out" if self.world > 1 else "outl"))
        return o

    def attention_backward(self, p: str, grad: str) -> tuple[str, str, str]:
        """From o_proj's input gradient ``grad`` to the gradients of the rotated q, k and v."""
        t, R, w = self.t, self.rows, "attention backward"
        if self.send_dout:
            t.new(p + "dsend", self.send_dout, "dout exchange")
        t.new(p + "drecv", self.recv_dout, "dout exchange")
        if self.send_dout:
            t.free(p + "dsend")
        t.free(grad)
        if self.head_chunked:
            self._chunked_kernel_backward(p, w)
        else:
            self._kernel_backward(p, w)
        if self.world == 1:  # the kernel's gradients are the results
            for a, b in (("dql", "dq"), ("dkl", "dk"), ("dvl", "dv")):
                t.live[p + b] = t.live.pop(p + a)
            return p + "dq", p + "dk", p + "dv"
        t.new(p + "dqkvrecv", self.dqkv_recv, "dq/dk/dv exchange")
        t.new(p + "dq", R.Q, "dq/dk/dv exchange")
        t.new(p + "dk", R.K, "dq/dk/dv exchange")
        t.new(p + "dv", R.K, "dq/dk/dv exchange")
        t.free(p + "dqkvrecv", p + "dkl", p + "dvl", p + "dql")
        return p + "dq", p + "dk", p + "dv"

    def _chunked_kernel_backward(self, p: str, w: str) -> None:
        """``longctx.HeadChunkedAttention``'s backward: ``dq`` (and for MHA ``dk``, ``dv``) whole,
        the kernel per chunk of query heads, a shared KV head's gradient summed as it goes; the
        saved tensors go when it returns."""
        t, head, e = self.t, self.head, self.e
        w += " (head chunks)"
        t.new(p + "dql", self.hq * head, w)
        if not self.shared:
            t.new(p + "dkl", self.hkv * head, w)
            t.new(p + "dvl", self.hkv * head, w)
        c0 = min(self.s.attention_head_chunk, self.hq)
        sizes = [c0] + ([min(c0, self.hq - c0)] if self.hq > c0 else [])
        for i, c in enumerate(sizes):
            q = f"{p}hc{i}."
            for name in ("gq", "gk", "gv"):
                t.new(q + name, c * head, w)
            if self.s.flash_workspace:
                t.blip(c * head // e * 4 + self.lse * c // self.hq, w + ", flash-attn workspace")
            if self.shared and i == 0:  # KVGradSum: accumulators copied from the first head
                t.new(p + "acck", head // e * self.wide, w)
                t.new(p + "accv", head // e * self.wide, w)
            t.free(q + "gq", q + "gk", q + "gv")
        if self.shared:
            if self.wide != e:
                t.new(p + "dkl", head, w)
                t.new(p + "dvl", head, w)
                t.free(p + "acck", p + "accv")
            else:
                t.live[p + "dkl"] = t.live.pop(p + "acck")
                t.live[p + "dvl"] = t.live.pop(p + "accv")
        t.free(p + "outl", p + "lse", p + "recv", p + "drecv")

    def _kernel_backward(self, p: str, w: str) -> None:
        t = self.t
        t.new(p + "dql", self.hq * self.head, w)
        t.new(p + "dkl", self.dkv_kernel // 2, w)
        t.new(p + "dvl", self.dkv_kernel // 2, w)
        if self.s.flash_workspace:  # flash-attn's mha_bwd: float32 dq_accum [B, S, hq, D], softmax_d [B, hq, S]
            t.blip(self.hq * self.head // self.e * 4 + self.lse, w + " (flash-attn workspace)")
        t.free(p + "outl", p + "lse")
        t.free(*((p + "qc", p + "kvg") if self.gathered else (p + "recv",)))
        if self.shared:  # KVGradSum: float32 accumulators of the one KV head, then the casts
            wide = self.wide
            t.new(p + "acck", self.head // self.e * wide, "KV gradient sum")
            t.new(p + "accv", self.head // self.e * wide, "KV gradient sum")
            if wide != self.e:
                t.new(p + "ck", self.head, "KV gradient sum")
                t.new(p + "cv", self.head, "KV gradient sum")
                t.free(p + "acck", p + "accv")
                t.live[p + "acck"] = t.live.pop(p + "ck")
                t.live[p + "accv"] = t.live.pop(p + "cv")
            t.free(p + "dkl", p + "dvl", p + "drecv")
            t.live[p + "dkl"] = t.live.pop(p + "acck")
            t.live[p + "dvl"] = t.live.pop(p + "accv")
        else:
            t.free(p + "drecv")

    def projections_backward(self, p: str, dq: str, dk: str, dv: str, x: str) -> str:
        """RoPE backward, then v, k, q projections' backward; frees their input ``x`` (the
        norm's output); returns its gradient."""
        t, R, w = self.t, self.rows, "q/k/v backward"
        e = self.s.element_size
        self.rope_backward(dk, R.K, p + "dkp")
        self.rope_backward(dq, R.Q, p + "dqp")
        t.new(p + "dWv", self.params["v"] * e, w)
        t.new(p + "dxv", R.X, w)
        t.free(dv, p + "dWv")
        dkp, dqp, copies = p + "dkp", p + "dqp", (True, True)
        if self.s.qk_norm:  # each per-head norm's backward, then (untiled) the view's copy
            dkp, ck = self._head_norm_backward(p + "kn.", self.krows, dkp, p + "k")
            dqp, cq = self._head_norm_backward(p + "qn.", self.qrows, dqp, p + "q")
            copies = (ck, cq)
        self._view_grad(dkp, p + "dkc", R.K, copies[0], w)
        t.new(p + "dWk", self.params["k"] * e, w)
        t.new(p + "dxk", R.X, w)
        t.free(p + "dkc")
        acc = self._accumulate(p + "dxv", p + "dxk", R.X, w)
        t.free(p + "dWk")
        self._view_grad(dqp, p + "dqc", R.Q, copies[1], w)
        t.new(p + "dWq", self.params["q"] * e, w)
        t.new(p + "dxq", R.X, w)
        t.free(p + "dqc", x)
        acc = self._accumulate(acc, p + "dxq", R.X, w)
        t.free(p + "dWq")
        return acc

    def _head_norm(self, p: str, rows: _Rows, keep: bool) -> str:
        if self.s.tiled_norms:
            return self.tiled_forward(p, lambda q, sub: self.norm_forward(q, sub, keep=False), rows, self.norm_rows, rows.h)
        return self.norm_forward(p, rows, keep)

    def _head_norm_backward(self, p: str, rows: _Rows, grad: str, x: str) -> tuple[str, bool]:
        """A per-head norm's backward: ``(input gradient, whether the view before it copies it)``:
        the untiled norm's gradient keeps RoPE's transposed strides, the tiled one is contiguous."""
        w = "q/k norm backward"
        if self.s.tiled_norms:
            return self.tiled_norm_backward(p, rows, self.norm_rows, grad, x, None, w + " (tiled)"), False
        return self.norm_backward(p, rows, grad, x if rows.C == 0 else None, None, w), True

    def _view_grad(self, grad: str, out: str, nbytes: int, copy: bool, where: str) -> None:
        """The projection output's view: a copy of a strided gradient, else the gradient itself."""
        if copy:
            self.t.new(out, nbytes, where)
            self.t.free(grad)
        else:
            self.t.live[out] = self.t.live.pop(grad)

    # ---- a decoder layer ---------------------------------------------------------------------
    def _norm(self, p: str, keep: bool) -> str:
        R = self.rows
        if self.s.tiled_norms:
            return self.tiled_forward(p, lambda q, sub: self.norm_forward(q, sub, keep=False), R, self.norm_rows, R.h)
        return self.norm_forward(p, R, keep)

    def _mlp(self, p: str, keep: bool) -> str:
        R = self.rows
        if self.s.tiled_mlp:

            def tile(q, sub):
                self.mlp_forward(q, sub, keep=False)
                return self.mlp_down(q, sub, keep=False)

            return self.tiled_forward(p, tile, R, self.mlp_rows, R.h)
        self.mlp_forward(p, R, keep)
        return None if keep else self.mlp_down(p, R, keep=False)

    def layer_forward(self, i: int, keep: bool) -> str:
        """Layer ``i``'s forward on its input ``in{i}``; returns its output. ``keep=False``:
        under checkpointing (nothing kept); ``keep=True`` without checkpointing."""
        t, R, p = self.t, self.rows, f"L{i}."
        n1 = self._norm(p + "n1.", keep)
        o = self.attention_forward(p + "a.", keep)
        if not keep:
            t.free(n1)
        t.new(p + "res1", R.X)
        t.free(o)
        n2 = self._norm(p + "n2.", keep)
        m = self._mlp(p + "m.", keep)
        if m is None:  # kept: the down projection's output
            m = self.mlp_down(p + "m.", R, keep=True)
        if not keep:
            t.free(n2)
        out = t.new(f"in{i + 1}", R.X, "layer output")
        t.free(m)
        if not self._keeps_res1(keep):
            t.free(p + "res1")
        return out

    def _keeps_res1(self, keep: bool) -> bool:
        """res1 (attention's residual sum) is saved by norm2: tiled (its input), float32 (pow's)."""
        return keep and (self.s.tiled_norms or self.rows.C == 0)

    def layer_recompute(self, i: int) -> None:
        """The checkpointed layer's forward again, in the backward, up to its last saved tensor."""
        t, R, p = self.t, self.rows, f"L{i}."
        self._norm(p + "n1.", keep=True)
        o = self.attention_forward(p + "a.", keep=True)
        t.new(p + "res1", R.X)
        t.free(o)
        self._norm(p + "n2.", keep=True)
        if self.s.tiled_mlp:  # the tiles run, then the input is saved: the early stop; the output goes
            t.free(self._mlp(p + "m.", keep=True))
        else:
            self.mlp_forward(p + "m.", R, keep=True)
        if not self._keeps_res1(True):
            t.free(p + "res1")

    def layer_backward(self, i: int, grad: str, x: str | None) -> str:
        """Layer ``i``'s backward from the gradient of its output; frees its input ``x`` (when its
        last saved reference goes); returns the input's gradient."""
        t, R, p = self.t, self.rows, f"L{i}."
        s = self.s
        n1 = p + "n1.out"
        n2 = p + "n2.out"
        if s.tiled_mlp:
            dx2 = self.tiled_mlp_backward(p + "m.", R, self.mlp_rows, "mlp backward (tiled)")
            t.free(n2)
        else:
            dx2 = self.mlp_backward(p + "m.", R, None, n2, "mlp backward")
        res1 = p + "res1" if self._keeps_res1(True) else None
        if s.tiled_norms:
            dres1 = self.tiled_norm_backward(p + "n2.", R, self.norm_rows, dx2, res1, grad, "norm backward (tiled)")
        else:
            dres1 = self.norm_backward(p + "n2.", R, dx2, res1, grad, "norm backward")
        t.new(p + "dWo", self.params["o"] * s.element_size, "o_proj backward")
        dattn = t.new(p + "dattn", R.Q, "o_proj backward")
        if self.world > 1:  # o_proj's input (at world 1 it is the attention output, freed below)
            t.free(p + "a.out")
        t.free(p + "dWo")
        dq, dk, dv = self.attention_backward(p + "a.", dattn)
        dxn1 = self.projections_backward(p + "a.", dq, dk, dv, n1)
        if s.tiled_norms:
            return self.tiled_norm_backward(p + "n1.", R, self.norm_rows, dxn1, x, dres1, "norm backward (tiled)")
        return self.norm_backward(p + "n1.", R, dxn1, x, dres1, "norm backward")

    # ---- the step ------------------------------------------------------------------------------
    def run(self) -> StepMemory:
        s, t, R = self.s, self.t, self.rows
        e, n, L = self.e, self.n, s.layers
        ckpt, offload = s.checkpointing, s.offload_activations
        t.new("in0", R.X, "embedding")
        t.new("cos", n * s.dim * e)
        t.new("sin", n * s.dim * e)
        # A layer's input stays when checkpointing keeps it (not offloaded), or when its first
        # norm saves it (tiled, or float32: otherwise the norm saves its float32 copy).
        norm_keeps_x = s.tiled_norms or R.C == 0
        dropped = offload or (not ckpt and not norm_keeps_x)
        for i in range(L):
            if offload:
                t.host_new(R.X)
            self.layer_forward(i, keep=not ckpt)
            if dropped and i > 0:
                t.free(f"in{i}")  # goes once the layer returns (offloaded: the host copy stays)
        last = f"in{L}"
        self._norm("fn.", keep=True)
        if not norm_keeps_x:
            t.free(last)
        if dropped:
            t.free("in0")  # the embedding output, held until the base model returns
        self.loss_forward()
        forward_peak, forward_end = t.peak, t.current
        # ---- backward
        dh = self.loss_backward()
        fn_x = last if (s.tiled_norms or R.C == 0) else None
        if s.tiled_norms:
            grad = self.tiled_norm_backward("fn.", R, self.norm_rows, dh, fn_x, None, "final norm backward (tiled)")
        else:
            grad = self.norm_backward("fn.", R, dh, fn_x, None, "final norm backward")
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
        t.blip(self.params["head"] * s.element_size, "embedding backward")
        t.free(grad)
        return StepMemory(t.peak, t.moment, forward_peak, forward_end, t.host_peak)

    def loss_forward(self) -> None:
        s, t = self.s, self.t
        e, n, V, wide = self.e, self.n, s.vocab, self.wide
        if s.tiled_loss:
            t.new("lse", n * wide)
            for i, tr in enumerate(self._tile_sizes(n, self.loss_tiles)):
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

    def loss_backward(self) -> str:
        s, t, R = self.s, self.t, self.rows
        e, n, V, wide = self.e, self.n, s.vocab, self.wide
        ep = s.element_size
        w = "loss backward"
        if s.tiled_loss:
            w += " (tiled)"
            dh = t.new("dh", R.X, w)
            acc_e = 4 if ep < 4 else ep
            t.new("dw", self.params["head"] * acc_e, w)
            for i, tr in enumerate(self._tile_sizes(n, self.loss_tiles)):
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
                t.blip(self.params["head"] * ep, w)
            t.free("dw")
            return dh
        t.new("gnll", n * V * wide, w)
        t.new("glog", n * V * wide, w)
        t.free("gnll", "logsm")
        if e != wide:
            t.new("gl", n * V * e, w)
            t.free("glog")
        t.new("dWlm", self.params["head"] * ep, w)
        dh = t.new("dh", R.X, w)
        t.free("gl" if e != wide else "glog", "fn.out", "dWlm")
        return dh


def _tile_rows(setup) -> tuple[int, int, int]:
    """(loss, mlp, norm) rows per tile, as ``ulysses_kernels.longctx`` picks them."""
    e = setup.element_size
    loss = setup.loss_tile_rows or loss_tile_rows(setup.vocab)
    mlp = setup.mlp_tile_rows or default_tile_rows(setup.ffn, e)
    norm = setup.norm_tile_rows or default_tile_rows(setup.hidden, max(e, 4))
    return loss, mlp, norm


def rank_key(setup, rank: int) -> tuple:
    """What the replay of ``rank`` depends on: ranks with equal keys have equal steps."""
    st = _Step(setup, rank)
    return (st.n, st.hq, st.hkv, st.shared, st.gathered, st.send_qkv, st.recv_qkv, st.send_dout, st.out_recv, st.dqkv_recv)


def step_memory(setup, rank: int = 0) -> StepMemory:
    """The replay of one training step of ``setup`` on sequence rank ``rank``."""
    st = _Step(setup, rank)
    loss_rows, st.mlp_rows, st.norm_rows = _tile_rows(setup)
    st.loss_tiles = max(1, math.ceil(st.n / loss_rows))
    return st.run()
