"""One hybrid mixer layer of a rank's step in the replay (``MixerReplay``): the tensors it keeps
for the backward, its two exchanges and its backward, per ``Mixer.kind``, as ``hf.apply`` runs it
(``layers/mixers/__init__.py``): through the head exchange, or under state passing
(``Mixer.parallel``: the same tensors over the rank's tokens and every head, no exchange, the
conv's halo, the widened kernel, the fold); the bytes each kind keeps are listed in
``memory_step.mixer``'s docstring."""

from __future__ import annotations

from .ledger import Ledger
from .mamba1 import mamba1_stages, mamba1_state_stages

__all__ = ["MixerReplay"]

# Per token and value head, what ``torch_chunk_gated_delta_rule`` keeps for its backward, in
# float32 elements (read from its code; q and k are repeated to the value heads first):
#  Dk: q, its l2norm and scaled copy, k, its l2norm, k*beta, k_beta*decay, k_cumdecay,
#      query*decay, key*decay (9); Dv: v, v*beta, new_values, v_new, the output (5);
#  C (chunk): pairwise decay, k_beta@k^T, the UT system, q@k^T, the intra-chunk attention (5);
#  2 per token for the l2norms' rsqrt; and per chunk two Dk x Dv states.
KERNEL_DK, KERNEL_DV, KERNEL_C, KERNEL_ONE, KERNEL_STATES = 9, 5, 5, 2, 2
GATED_NORM_WIDE, GATED_NORM_ONE = 5, 2
# Per padded token and head, what ``mamba2_chunk_scan`` keeps, in float32 elements (read from
# its code, each checked against the saved tensors of a tiny Bamba): Ns: B and C for G's
# einsum, B chunked and B_decay's einsum copy, C's copy for C_times_states (5); P: x padded
# (D's residual), x*dt chunked, its einsum copy, C_times_states (4); C (chunk): L, G, M (3);
# 2 per token: decay_states, state_decay_out; per chunk, 2 P x Ns states (the inter-chunk
# einsum's input, with the zero initial state, and the chunks' start states).
SCAN_NS, SCAN_P, SCAN_C, SCAN_ONE, SCAN_STATES = 5, 4, 3, 2, 2
# Kimi Delta Attention's ``chunk_kimi_delta_attention`` (float32), per padded token and head,
# read from its code and checked against a tiny Kimi-Linear's saved tensors: C x Dk: the decay
# mask, k_beta x key, each chunk's q x k (3); Dk: key and value padded, k_beta, g's exp, the
# scaled query, each chunk's two decays (g's exp, the last minus g's exp) and two matmul
# operands (q * g's exp, v_new), the transposed decayed key, k_cumdecay, k_beta * g's exp,
# v_beta (13: 10 on the key side, 3 on the value side: value, v_new, v_beta, which state
# passing widens); C: the UT system, each chunk's intra attention (2); per chunk and head: the
# UT loop's clones (row i of the system and its i x i block for i < C), the state, the last decay.
KDA_CD, KDA_DK, KDA_DV, KDA_C = 3, 10, 3, 2


class MixerReplay:
    """The mixer layer of one rank's step (``sizes``: the step's; ``setup.mixer``): ``local``
    kept before the exchange, ``remote`` after it (the last, ``kernel``, frees the received
    heads), ``out`` (kept) and ``y`` (not) the kernel's output sent back, ``post`` kept after
    the exchange back (``o_in`` last: out_proj's input). Bytes as the module docstring lists."""

    def __init__(self, ledger: Ledger, setup, sizes, rank: int):
        m, e = setup.mixer, setup.element_size
        self.t, self.m, self.e = ledger, m, e
        h, g = m.heads_on(setup, rank)
        n = sizes.n
        self.state = m.strategy(setup.sp) == "state"
        one = setup.sp == 1 or self.state  # no exchange of the tokens
        # The kernel's tokens: the whole sequence (head exchange) or the rank's shard (state
        # passing, every head: ``heads_on``); ``seq`` one sequence's, padded to the chunk; ``W``
        # the conv's input, the shard after its halo (``halo_on``).
        N = n if self.state else setup.batch * setup.seq
        self.seq = n // setup.batch if self.state else setup.seq
        self.W = N + setup.batch * m.halo_on(setup, rank)
        self.fold = self._fold(setup, rank) if self.state else 0
        self.X = n * setup.hidden * e
        self.weights = m.parameters(setup.hidden) * e
        self.stages = None  # Mamba1's forward, its own order (three exchanges)
        if m.kind == "mamba1":
            self._mamba1(n, N, h, one, setup)
        elif m.kind == "mamba2":
            self._mamba2(n, N, h, g, one, setup)
        elif m.kind == "short-conv":
            self._short_conv(n, N, h, one, setup)
        elif m.kind == "kimi-delta":
            self._kimi_delta(n, N, h, one, setup)
        else:
            self._gated_deltanet(n, N, h, g, one, setup)
        self.kept = self.local + self.remote + [("out", self.out)] + self.post

    def _fold(self, setup, rank: int) -> int:
        """State passing's fold (``state_passing.carried_in``), kept for the backward: rank 0 its
        zero initial state; rank ``r > 0`` the all-gathered ``(A, c)`` of every rank (float32,
        read by the compositions) and the ``r + 1`` states of the fold (from zero, after each
        rank before), the last the initial state the output's correction reads."""
        m, w, B = self.m, 4, setup.batch
        if m.kind == "short-conv":
            return 0
        if m.kind == "mamba1":  # per channel a state [Ns] with a decay per entry
            a = c = B * m.heads * m.key_dim
        elif m.kind == "mamba2":  # per head [P, Ns], a scalar decay
            a, c = B * m.heads, B * m.heads * m.head_dim * m.key_dim
        else:  # delta: per value head [Dk, Dv], A [Dk, Dk]
            a, c = B * m.heads * m.key_dim * m.key_dim, B * m.heads * m.key_dim * m.head_dim
        if rank == 0:
            return c * w
        return setup.sp * (a + c) * w + (rank + 1) * c * w

    def _gated_deltanet(self, n, N, h, g, one, setup):
        m, e = self.m, self.e
        hv_local = n * m.heads * m.head_dim
        padded = -(-self.seq // m.chunk) * m.chunk * setup.batch
        dv = m.head_dim + (m.key_dim if self.state else 0)  # state passing: the value side widened by Dk columns
        kernel = h * (padded * (KERNEL_DK * m.key_dim + KERNEL_DV * dv + KERNEL_C * m.chunk + KERNEL_ONE)
                      + padded // m.chunk * KERNEL_STATES * m.key_dim * dv)  # fmt: skip
        ch = 2 * g * m.key_dim + h * m.head_dim
        # (name, bytes) kept for the backward, in the order the forward makes them
        self.local = [("z", hv_local * e)]
        conv_out = (self.W + setup.batch * (m.conv - 1)) if self.state else N
        self.remote = [("conv_in", self.W * ch * e), ("conv_out", conv_out * ch * e), ("beta", N * h * e), ("sp_in", N * h * 4),
                       ("sp_out", N * h * 4), ("kernel", kernel * 4)]  # fmt: skip
        if self.state:  # the initial state [0 | I] (the kernel's first chunk reads it), the fold
            self.remote[-1:-1] = [("init", setup.batch * h * m.key_dim * dv * 4), ("fold", self.fold)]
        self.out, self.y = N * h * m.head_dim * e, 0
        self.post = [("norm", GATED_NORM_WIDE * hv_local * max(e, 4) + GATED_NORM_ONE * n * m.heads * 4), ("o_in", hv_local * e)]
        self.send = 0 if one else n * (m.heads * (m.head_dim + 2) + 2 * m.groups * m.key_dim) * e
        self.recv = N * (h * (m.head_dim + 2) + 2 * g * m.key_dim) * e
        self.back = 0 if one else hv_local * e  # the output's exchange back
        self.proj = n * m.conv_channels * e  # in_proj_qkv's output, split into the exchange

    def _mamba2(self, n, N, h, g, one, setup):
        m, e = self.m, self.e
        P, Ns, C, B = m.head_dim, m.key_dim, m.chunk, setup.batch
        wide = P + (Ns if self.state else 0)  # state passing: each head's x widened by Ns rows
        inner = m.heads * P
        ch = h * P + 2 * g * Ns
        padded = -(-self.seq // C) * C * B
        chunks = padded // (C * B)
        # float32 model: x.float() is the conv's output (all its channels), else a float32 copy of x
        x32 = N * ch * 4 if e == 4 else N * h * P * 4
        scan = h * padded * (SCAN_NS * Ns + SCAN_P * wide + SCAN_C * C + SCAN_ONE) + SCAN_STATES * B * (chunks + 1) * h * wide * Ns
        masks = 2 * C * C + 2 * (chunks + 1) ** 2 + 4 * B * h * (chunks + 1) ** 2  # segment_sum's masks, the chunks' decay
        self.local = [("proj", n * (inner + m.conv_channels + m.heads) * e)]  # in_proj's output (the gate keeps it)
        self.remote = [("conv_w", ch * (m.conv * e + 8)), ("conv_in", self.W * ch * e), ("conv_out", (self.W + B * (m.conv - 1)) * ch * e),
                       ("dt", 2 * N * h * e + N * h * 4 + 2 * h * 4), ("x32", x32), ("kernel", 4 * scan + masks)]  # fmt: skip
        self.out, self.y = 0, N * h * P * e
        if self.state:  # x widened (the scan reads it, not the conv's output) and its float32 copy, the fold;
            # the scan's whole float32 output kept (J is a view of it)
            self.remote[-2:-1] = [("x32", N * h * wide * (e + (0 if e == 4 else 4))), ("fold", self.fold)]
            self.out, self.y = N * h * wide * 4, 0
        # gated norm in float32: the gate's silu (and in another dtype its float32 copy), the
        # output's float32 copy, their product, rsqrt, the normalized output in the dtype
        silu = n * inner * 4 * (1 if e == 4 else 2)
        self.post = [("norm", silu + 2 * n * inner * 4 + n * m.norm_groups * 4 + n * inner * e), ("o_in", n * inner * e)]
        if not m.gated_norm:  # Falcon-H1 without its norm: out * silu(gate) keeps out and silu(gate)
            self.post = [("gate", 2 * n * inner * e), ("o_in", n * inner * e)]
        self.send = 0 if one else n * (m.heads * (P + 1) + 2 * m.groups * Ns) * e
        self.recv = N * (h * (P + 1) + 2 * g * Ns) * e
        self.back = n * inner * 4 if self.state else 0 if one else n * inner * e  # state passing: the corrected float32 output
        # Falcon-H1's muP: in_proj's output times mup_vector (kept, ``proj``); the product goes
        self.proj = n * (inner + m.conv_channels + m.heads) * e if m.form == "parallel" else 0

    def _kimi_delta(self, n, N, h, one, setup):
        m, e = self.m, self.e
        d, C, B, H = m.head_dim, m.chunk, setup.batch, m.heads
        dv = d + (d if self.state else 0)  # state passing: the value side widened by Dk columns
        ch = 3 * h * d
        padded = -(-self.seq // C) * C * B
        chunks = padded // C  # over the batch
        ut = (C - 1) * C // 2 + (C - 1) * C * (2 * C - 1) // 6  # the UT loop's clones per chunk and head
        kernel = (h * padded * (KDA_CD * C * d + KDA_DK * d + KDA_DV * dv + KDA_C * C) + h * chunks * (ut + d * dv + d)) * 4 + 3 * C * C
        kernel += 2 * N * h * d * 4 + 3 * N * h * 4  # q and k (float32) and their l2 norms, beta
        self.local = [("gates_a", 2 * n * d * e)]  # f_a_proj's and g_a_proj's outputs
        self.remote = [("conv_w", ch * (m.conv * e + 8)), ("conv_in", self.W * ch * e), ("conv_out", (self.W + B * (m.conv - 1)) * ch * e),
                       ("forget", 3 * N * h * d * 4 + N * h * d + 2 * h * 4), ("beta", N * h * e), ("kernel", kernel)]  # fmt: skip
        self.out, self.y = 0, N * h * d * e
        if self.state:  # the initial state [0 | I], the fold; the kernel's whole output kept (J, the correction's, is a view of it)
            self.remote[-1:-1] = [("init", B * h * d * dv * 4), ("fold", self.fold)]
            self.out, self.y = N * h * dv * e, 0
        # o_norm (gated, float32): the output, its product with the gate's sigmoid, the normalized, rsqrt
        self.post = [("norm", n * H * d * e + 3 * n * H * d * 4 + n * H * 4), ("o_in", n * H * d * e)]
        self.send = 0 if one else n * H * (4 * d + 1) * e
        self.recv = N * h * (4 * d + 1) * e
        self.back = n * H * d * e if self.state or not one else 0  # state passing: the corrected output
        self.proj = n * H * (4 * d + 1) * e  # q, k, v, the forget gate's pre-activation, b: joined into the send

    def _mamba1(self, n, N, c, one, setup):
        m, e = self.m, self.e
        if self.state:
            self.stages = mamba1_state_stages(m, n, setup.batch, e, self.W, self.fold)
        else:
            self.stages = mamba1_stages(m, n, N, c, setup.batch, e, one)
        self.local, self.remote = [], [(name, nbytes) for action, name, nbytes in self.stages if action == "new"]
        self.out, self.y = 0, 0 if self.state else 2 * N * c * e  # the output and its contiguous copy, sent back
        self.post = [("o_in", n * m.heads * e)]
        self.send = 0 if one else n * (3 * m.heads + 2 * m.key_dim) * e  # the largest exchange, for the backward
        self.recv = N * (3 * c + 2 * m.key_dim) * e
        self.back = 0 if one else n * m.heads * e
        self.proj = 0
        # The recurrent scan's backward: each token's slice of exp(A dt) and of dt B x gets a
        # full-size zero-filled gradient, summed into a full-size accumulator: two [N, c, Ns]
        # float32 each, beside the kept tensors (not traced; see tests/test_memory_hybrid.py)
        self.scan_grads = 4 * N * c * m.key_dim * 4

    def _short_conv(self, n, N, c, one, setup):
        e = self.e
        hidden = self.m.heads
        self.local = [("proj", 3 * n * hidden * e)]  # in_proj's output: B, C, x are views of it
        self.remote = [("conv_w", c * (self.m.conv * e + 8)), ("kernel", self.W * c * e)]  # the conv's input (state passing: after its halo)
        self.out, self.y = 0, N * c * e
        self.post = [("back_kept", n * hidden * e), ("o_in", n * hidden * e)]  # C * back keeps back
        self.send = 0 if one else n * hidden * e
        self.recv = N * c * e
        self.back = 0
        self.proj = n * hidden * e  # B * x, packed into the send

    def forward(self, p: str, keep: bool) -> str:
        """The layer on the norm's output; returns out_proj's output ``[n, hidden]``."""
        t = self.t
        if self.stages is not None:
            for action, name, nbytes in self.stages:
                if action == "free":
                    t.free(p + name)
                else:
                    t.new(p + name, nbytes, "mixer forward")
        else:
            t.new(p + "qkv", self.proj)
            for name, nbytes in self.local:
                t.new(p + name, nbytes)
            t.new(p + "send", self.send)
            t.free(p + "qkv")
            t.new(p + "recv", self.recv, "mixer exchange")
            t.free(p + "send")
            for name, nbytes in self.remote:
                t.new(p + name, nbytes, "mixer forward")
            t.free(p + "recv")
        t.new(p + "out", self.out, "mixer forward")
        t.new(p + "y", self.y, "mixer forward")
        t.new(p + "back", self.back, "mixer exchange back")
        t.free(p + "y")
        for name, nbytes in self.post[:-1]:
            t.new(p + name, nbytes, "mixer forward")
        t.free(p + "back")
        t.new(p + "o_in", self.post[-1][1])
        o = t.new(p + "o", self.X, "mixer out_proj")
        if not keep:
            t.free(*(p + name for name, _ in self.kept))
        return o

    def recompute(self, p: str) -> None:
        self.t.free(self.forward(p, keep=True))

    def backward(self, p: str, grad: str, x: str) -> str:
        """From the output's gradient ``grad`` (the caller's, kept) to the gradient of the
        layer's input ``x`` (the norm's output, freed here): each kept tensor's gradient made
        as the tensor goes, the exchanges' gradients, the weights' gradients one at a time."""
        t, w = self.t, "mixer backward"
        t.blip(self.weights, w)
        if self.stages is not None:
            t.blip(self.scan_grads, "mixer backward (Mamba1 scan)")
        prev = None
        for name, nbytes in reversed(self.kept):
            d = t.new(p + "d" + name, nbytes, w)
            t.free(prev, p + name)
            prev = d
            if name == "out":
                t.new(p + "drecv", self.recv, w)
                t.free(prev)
                prev = p + "drecv"
        t.new(p + "dsend", self.send, w)
        t.free(prev)
        dx = t.new(p + "dx", self.X, w)
        t.free(p + "dsend", x)
        return dx
