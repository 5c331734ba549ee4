"""The token-mixer layers of a hybrid model in the replay: ``Mixer`` describes them (which
kind, which layers, heads, dims, conv width, chunk), ``MixerReplay`` replays one such layer as
``hf.apply`` runs it (``integrations/hf/mixers.py``). Kinds: Gated DeltaNet (Qwen3.5,
Qwen3.5-MoE, Qwen3-Next), Kimi Delta Attention (Kimi-Linear), Mamba2 as Bamba writes its
layers, LFM2's gated short convolution.

Gated DeltaNet, one layer on a rank with ``n`` local tokens and ``N`` tokens of the whole
sequence (batch x sequence), ``Hv``/``Hk`` value/key heads of which the rank holds ``h``/``g``
(the head plan's query/KV ranges), ``Dv``/``Dk`` their dims, ``C`` the kernel's chunk::

    local:  in_proj_qkv, in_proj_z, in_proj_b/a  -> z [n, Hv Dv] kept (the gated norm's gate)
    send    [n, Hv (Dv + 2) + 2 Hk Dk]            -> recv [N, h (Dv + 2) + 2 g Dk]   (one all-to-all)
    conv:   its input and its output (silu's input) [N, 2 g Dk + h Dv], kept
    gates:  beta, softplus's input and output  [N, h] (3 tensors)
    kernel: transformers' ``torch_chunk_gated_delta_rule`` in float32 (``KERNEL_*`` below)
    out     [N, h, Dv] -> one all-to-all back -> [n, Hv Dv]
    gated norm (float32): 5 [n, Hv Dv] + 2 [n, Hv]; out_proj -> [n, hidden]

Mamba2 (Bamba), ``H``/``G`` heads/groups of which the rank holds ``h``/``g``, ``P`` the head
dim, ``Ns`` the state, ``I = H P``, ``S'`` the tokens padded to the chunk ``C``::

    local:  in_proj -> [n, 2 I + 2 G Ns + H] kept (the gate is a view of it)
    send    [n, H (P + 1) + 2 G Ns]              -> recv [N, h (P + 1) + 2 g Ns]   (one all-to-all)
    conv:   its input [N, ch] and output [N + B (K - 1), ch], ch = h P + 2 g Ns, kept
    dt:     dt + dt_bias, softplus, the float32 copy [N, h] (3)
    scan:   ``mamba2_chunk_scan`` in float32 (``SCAN_*`` below)
    out     [N, h, P] -> one all-to-all back -> [n, I]
    gated norm (float32): 4 [n, I] + [n, G]; out_proj's input [n, I]

Kimi Delta Attention, ``H`` heads of dim ``D`` (``h`` on the rank), chunk ``C``::

    local:  q/k/v, the forget gate's f_a -> f_b, b; g_a's and f_a's outputs [n, D] kept
    send    [n, H (4 D + 1)]                     -> recv [N, h (4 D + 1)]   (one all-to-all)
    conv:   its input [N, 3 h D] and output [N + B (K - 1), 3 h D], kept
    gates:  the forget gate's softplus pieces (3 [N, h, D] float32, a mask), beta [N, h]
    kernel: ``chunk_kimi_delta_attention`` in float32 (``KDA_*`` below; its UT loop keeps
            ~C^3/3 per chunk and head: the largest term at C = 64 and small D)
    out     [N, h, D] -> one all-to-all back -> [n, H D]
    gated norm (float32): the output, 3 [n, H D] + [n, H]; out_proj's input [n, H D]

LFM2's short conv, ``c`` of the ``hidden`` channels on the rank (one channel a head)::

    local:  in_proj -> [n, 3 hidden] kept (B, C, x are views of it)
    send    B*x [n, hidden]                      -> recv [N, c]   (one all-to-all)
    conv:   its input [N, c] kept (no activation: its output is not)
    back    [n, hidden] kept (C * back), out_proj's input [n, hidden]

What is modelled: the bytes each of these keeps for the backward (the forward's end without
checkpointing), counted from transformers 5.23's torch fallbacks (no flash-linear-attention,
causal-conv1d or mamba_ssm here) and the adapters of ``integrations/hf/mixers.py``;
tests/test_memory_hybrid.py measures a tiny model's per-layer forward end within 2% for each
kind and the checkpointed layer (its input only) exactly. Not measured: the order of the
mixer's backward (modelled as each kept tensor's gradient made while the tensor goes, two at
a time), so the step peak of a step whose peak falls in a mixer's backward is an estimate.
The chunked kernels of flash-linear-attention and mamba_ssm keep far less (their inputs and
per-chunk states, recomputing the rest): on a GPU with them installed this model over-counts
the kernel. Mamba2's float32 casts alias in a float32 model (``x.float()`` is ``x``): the
counts follow the model's dtype (measured in float32 only).

Not modelled, refused by name (``Mixer.from_config``): Nemotron-H (a layer is one block: a
mixer, attention or an MLP alone)
and Falcon-H1 (attention and Mamba2 side by side in one layer): the replay's layer is
norm -> mixer or attention -> norm -> MLP; Jamba (Mamba1: three exchanges, not replayed yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import UlyssesInputError
from ..layout import Layout, split_lengths
from ..plan import HeadPlan
from .ledger import Ledger

__all__ = ["Mixer", "MixerReplay", "PRESETS"]

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
# v_beta (13); C: the UT system, each chunk's intra attention (2); per chunk and head: the UT
# loop's clones (row i of the system and its i x i block for i < C), the state, the last decay.
KDA_CD, KDA_D, KDA_C = 3, 13, 2
KINDS = ("gated-deltanet", "mamba2", "short-conv", "kimi-delta")


@dataclass(frozen=True)
class Mixer:
    """The token-mixer layers of a hybrid, of ``kind`` (``KINDS``). Gated DeltaNet:
    ``heads``/``groups`` value/key heads, ``head_dim``/``key_dim`` their dims. Mamba2: heads and
    B/C groups, ``head_dim`` P, ``key_dim`` the SSM state Ns, ``norm_groups`` the gated norm's
    groups. Kimi Delta Attention: ``heads`` = ``groups``, ``head_dim`` = ``key_dim``. Short
    conv: ``heads`` = ``groups`` = the channels (hidden), dims 1. ``conv`` the
    causal conv's width (with a bias: ``conv_bias``), ``chunk`` the kernel's chunk; layer ``i``
    is attention when ``(i + 1) % attention_every == 0`` (Qwen3.5's ``full_attention_interval``),
    or as ``layer_types`` (``"linear_attention"`` for a mixer of any kind / ``"full_attention"``
    per layer) say."""

    heads: int
    groups: int
    head_dim: int
    key_dim: int
    conv: int = 4
    chunk: int = 64
    attention_every: int = 4
    layer_types: tuple[str, ...] | None = None
    kind: str = "gated-deltanet"
    norm_groups: int = 1
    conv_bias: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UlyssesInputError(f"memory: mixer kind expected one of {list(KINDS)}, got {self.kind!r}")
        for name in ("heads", "groups", "head_dim", "key_dim", "conv", "chunk", "attention_every", "norm_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UlyssesInputError(f"memory: mixer {name} expected a positive int, got {value!r}")
        if self.heads % self.groups:
            raise UlyssesInputError(f"memory: mixer heads ({self.heads}) expected a multiple of groups ({self.groups})")
        if self.layer_types is not None:
            bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
            if bad:
                raise UlyssesInputError(f"memory: mixer layer_types expected 'linear_attention' or 'full_attention', got {bad}")

    @classmethod
    def from_config(cls, cfg) -> Mixer:
        """From a transformers Qwen3.5 / Qwen3-Next, Kimi-Linear, Bamba or LFM2 text config (or its dict);
        any other model type is refused by name (the module docstring says why)."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        model = get("model_type") or type(cfg).__name__
        if model in _NOT_MODELLED:
            raise UlyssesInputError(f"memory: config {model!r}: {_NOT_MODELLED[model]}; the calculator models {_MODELLED}")
        if model == "bamba":
            return cls._bamba(get)
        if model == "kimi_linear":
            return cls._kimi(get)
        if model == "lfm2":
            return cls._lfm2(get)
        if get("linear_num_value_heads") is None:
            raise UlyssesInputError(f"memory: config {model!r} has no token mixer the calculator models ({_MODELLED})")
        types = get("layer_types")
        return cls(heads=get("linear_num_value_heads"), groups=get("linear_num_key_heads"), head_dim=get("linear_value_head_dim"),
                   key_dim=get("linear_key_head_dim"), conv=get("linear_conv_kernel_dim", 4),
                   attention_every=get("full_attention_interval", 4) or 4, layer_types=tuple(types) if types else None)  # fmt: skip

    @classmethod
    def _bamba(cls, get) -> Mixer:
        layers, attn = get("num_hidden_layers"), get("attn_layer_indices") or []
        if get("mamba_proj_bias"):
            raise UlyssesInputError("memory: config 'bamba' with mamba_proj_bias: the calculator counts in_proj without a bias")
        types = tuple("full_attention" if i in attn else "linear_attention" for i in range(layers))
        heads, groups = get("mamba_n_heads", 128), get("mamba_n_groups", 1)
        return cls(heads=heads, groups=groups, head_dim=get("mamba_d_head"), key_dim=get("mamba_d_state", 256), conv=get("mamba_d_conv", 4),
                   chunk=get("mamba_chunk_size", 256), layer_types=types, kind="mamba2", norm_groups=groups,
                   conv_bias=bool(get("mamba_conv_bias", True)))  # fmt: skip

    @classmethod
    def _kimi(cls, get) -> Mixer:
        la = get("linear_attn_config") or {}
        heads, dim = la.get("num_heads"), la.get("head_dim")
        if heads is None or dim is None:
            raise UlyssesInputError("memory: config 'kimi_linear' expected linear_attn_config with num_heads and head_dim")
        types = get("layer_types")
        return cls(heads=heads, groups=heads, head_dim=dim, key_dim=dim, conv=la.get("short_conv_kernel_size", 4), kind="kimi-delta",
                   layer_types=tuple(types) if types else None)  # fmt: skip

    @classmethod
    def _lfm2(cls, get) -> Mixer:
        layers, types = get("num_hidden_layers"), get("layer_types")
        if types is None:
            full = get("full_attn_idxs") or []
            types = ["full_attention" if i in full else "conv" for i in range(layers)]
        hidden = get("hidden_size")
        return cls(heads=hidden, groups=hidden, head_dim=1, key_dim=1, conv=get("conv_L_cache", 3), kind="short-conv",
                   layer_types=tuple("full_attention" if t == "full_attention" else "linear_attention" for t in types),
                   conv_bias=bool(get("conv_bias", False)))  # fmt: skip

    def is_mixer(self, i: int) -> bool:
        if self.layer_types is not None:
            return self.layer_types[i] == "linear_attention"
        return (i + 1) % self.attention_every != 0

    def check_layers(self, layers: int) -> None:
        if self.layer_types is not None and len(self.layer_types) != layers:
            raise UlyssesInputError(f"memory: mixer layer_types expected {layers} entries (layers), got {len(self.layer_types)}")

    @property
    def conv_channels(self) -> int:
        if self.kind == "short-conv":
            return self.heads
        if self.kind == "kimi-delta":
            return 3 * self.heads * self.head_dim
        return 2 * self.groups * self.key_dim + self.heads * self.head_dim

    def parameters(self, hidden: int) -> int:
        """One mixer's parameters. Gated DeltaNet: in_proj_qkv, in_proj_z, in_proj_b/a, conv,
        A_log, dt_bias, norm, out_proj; Mamba2: in_proj, conv, dt_bias, A_log, D, norm,
        out_proj; short conv: in_proj, conv, out_proj."""
        hv, ch = self.heads * self.head_dim, self.conv_channels
        conv = ch * (self.conv + (1 if self.conv_bias else 0))
        if self.kind == "mamba2":
            return hidden * (hv + ch + self.heads) + conv + 3 * self.heads + hv + hv * hidden
        if self.kind == "short-conv":
            return 3 * hidden * ch + conv + ch * hidden
        if self.kind == "kimi-delta":  # q/k/v, f_a/f_b, b, conv, A_log, dt_bias, g_a/g_b, o_norm, o_proj
            d = self.head_dim
            return 3 * hidden * hv + 2 * (hidden * d + d * hv) + hidden * self.heads + conv + self.heads + hv + d + hv * hidden
        return hidden * (ch + hv + 2 * self.heads) + conv + 2 * self.heads + self.head_dim + hv * hidden

    def heads_on(self, setup, rank: int) -> tuple[int, int]:
        """``(h, g)``: the value and key heads of ``rank`` (the head plan of ``hf.apply``'s mixers)."""
        lay = Layout(HeadPlan.build(self.heads, self.groups, setup.sp), rank, tuple(split_lengths(setup.seq, setup.sp)), setup.batch, self.head_dim)
        return lay.head_count("q", rank), lay.head_count("kv", rank)


_MODELLED = "Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), Kimi Delta Attention (Kimi-Linear), Bamba's Mamba2, LFM2's short convolution"
_NOT_MODELLED = {
    "nemotron_h": "Nemotron-H's layers are one block each (Mamba2, attention or an MLP alone), not the replay's norm -> mixer -> norm -> MLP layer",
    "falcon_h1": "Falcon-H1 runs attention and Mamba2 side by side in each layer, not the replay's one mixer per layer",
    "jamba": "Jamba's Mamba1 mixer is not modelled (hf.apply runs it with three exchanges; the replay has no such layer yet)",
}

# Shapes of released models' Gated DeltaNet layers (their config.json); sizes of the rest
# (hidden, heads, layers) come from the command line. Bamba and LFM2: give their config.json.
PRESETS = {
    "qwen3.5": Mixer(heads=32, groups=16, head_dim=128, key_dim=128, conv=4, attention_every=4),  # Qwen3-Next-80B-A3B, Qwen3.5
}


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
        N = setup.batch * setup.seq
        one = setup.sp == 1
        self.X = n * setup.hidden * e
        self.weights = m.parameters(setup.hidden) * e
        if m.kind == "mamba2":
            self._mamba2(n, N, h, g, one, setup)
        elif m.kind == "short-conv":
            self._short_conv(n, N, h, one, setup)
        elif m.kind == "kimi-delta":
            self._kimi_delta(n, N, h, one, setup)
        else:
            self._gated_deltanet(n, N, h, g, one, setup)
        self.kept = self.local + self.remote + [("out", self.out)] + self.post

    def _gated_deltanet(self, n, N, h, g, one, setup):
        m, e = self.m, self.e
        hv_local = n * m.heads * m.head_dim
        padded = -(-setup.seq // m.chunk) * m.chunk * setup.batch
        kernel = h * (padded * (KERNEL_DK * m.key_dim + KERNEL_DV * m.head_dim + KERNEL_C * m.chunk + KERNEL_ONE)
                      + padded // m.chunk * KERNEL_STATES * m.key_dim * m.head_dim)  # fmt: skip
        ch = 2 * g * m.key_dim + h * m.head_dim
        # (name, bytes) kept for the backward, in the order the forward makes them
        self.local = [("z", hv_local * e)]
        self.remote = [("conv_in", N * ch * e), ("conv_out", N * ch * e), ("beta", N * h * e), ("sp_in", N * h * 4),
                       ("sp_out", N * h * 4), ("kernel", kernel * 4)]  # fmt: skip
        self.out, self.y = N * h * m.head_dim * e, 0
        self.post = [("norm", GATED_NORM_WIDE * hv_local * max(e, 4) + GATED_NORM_ONE * n * m.heads * 4), ("o_in", hv_local * e)]
        self.send = 0 if one else n * (m.heads * (m.head_dim + 2) + 2 * m.groups * m.key_dim) * e
        self.recv = N * (h * (m.head_dim + 2) + 2 * g * m.key_dim) * e
        self.back = 0 if one else hv_local * e  # the output's exchange back
        self.proj = n * m.conv_channels * e  # in_proj_qkv's output, split into the exchange

    def _mamba2(self, n, N, h, g, one, setup):
        m, e = self.m, self.e
        P, Ns, C, B = m.head_dim, m.key_dim, m.chunk, setup.batch
        inner = m.heads * P
        ch = h * P + 2 * g * Ns
        padded = -(-setup.seq // C) * C * B
        chunks = padded // (C * B)
        # float32 model: x.float() is the conv's output (all its channels), else a float32 copy of x
        x32 = N * ch * 4 if e == 4 else N * h * P * 4
        scan = h * padded * (SCAN_NS * Ns + SCAN_P * P + SCAN_C * C + SCAN_ONE) + SCAN_STATES * B * (chunks + 1) * h * P * Ns
        masks = 2 * C * C + 2 * (chunks + 1) ** 2 + 4 * B * h * (chunks + 1) ** 2  # segment_sum's masks, the chunks' decay
        self.local = [("proj", n * (inner + m.conv_channels + m.heads) * e)]  # in_proj's output (the gate keeps it)
        self.remote = [("conv_w", ch * (m.conv * e + 8)), ("conv_in", N * ch * e), ("conv_out", (N + B * (m.conv - 1)) * ch * e),
                       ("dt", 2 * N * h * e + N * h * 4 + 2 * h * 4), ("x32", x32), ("kernel", 4 * scan + masks)]  # fmt: skip
        self.out, self.y = 0, N * h * P * e
        # gated norm in float32: the gate's silu (and in another dtype its float32 copy), the
        # output's float32 copy, their product, rsqrt, the normalized output in the dtype
        silu = n * inner * 4 * (1 if e == 4 else 2)
        self.post = [("norm", silu + 2 * n * inner * 4 + n * m.norm_groups * 4 + n * inner * e), ("o_in", n * inner * e)]
        self.send = 0 if one else n * (m.heads * (P + 1) + 2 * m.groups * Ns) * e
        self.recv = N * (h * (P + 1) + 2 * g * Ns) * e
        self.back = 0 if one else n * inner * e
        self.proj = 0

    def _kimi_delta(self, n, N, h, one, setup):
        m, e = self.m, self.e
        d, C, B, H = m.head_dim, m.chunk, setup.batch, m.heads
        ch = 3 * h * d
        padded = -(-setup.seq // C) * C * B
        chunks = padded // C  # over the batch
        ut = (C - 1) * C // 2 + (C - 1) * C * (2 * C - 1) // 6  # the UT loop's clones per chunk and head
        kernel = (h * padded * (KDA_CD * C * d + KDA_D * d + KDA_C * C) + h * chunks * (ut + d * d + d)) * 4 + 3 * C * C
        kernel += 2 * N * h * d * 4 + 3 * N * h * 4  # q and k (float32) and their l2 norms, beta
        self.local = [("gates_a", 2 * n * d * e)]  # f_a_proj's and g_a_proj's outputs
        self.remote = [("conv_w", ch * (m.conv * e + 8)), ("conv_in", N * ch * e), ("conv_out", (N + B * (m.conv - 1)) * ch * e),
                       ("forget", 3 * N * h * d * 4 + N * h * d + 2 * h * 4), ("beta", N * h * e), ("kernel", kernel)]  # fmt: skip
        self.out, self.y = 0, N * h * d * e
        # o_norm (gated, float32): the output, its product with the gate's sigmoid, the normalized, rsqrt
        self.post = [("norm", n * H * d * e + 3 * n * H * d * 4 + n * H * 4), ("o_in", n * H * d * e)]
        self.send = 0 if one else n * H * (4 * d + 1) * e
        self.recv = N * h * (4 * d + 1) * e
        self.back = 0 if one else n * H * d * e
        self.proj = n * H * (4 * d + 1) * e  # q, k, v, the forget gate's pre-activation, b: joined into the send

    def _short_conv(self, n, N, c, one, setup):
        e = self.e
        hidden = self.m.heads
        self.local = [("proj", 3 * n * hidden * e)]  # in_proj's output: B, C, x are views of it
        self.remote = [("conv_w", c * (self.m.conv * e + 8)), ("kernel", N * c * e)]  # the conv's input
        self.out, self.y = 0, N * c * e
        self.post = [("back_kept", n * hidden * e), ("o_in", n * hidden * e)]  # C * back keeps back
        self.send = 0 if one else n * hidden * e
        self.recv = N * c * e
        self.back = 0
        self.proj = n * hidden * e  # B * x, packed into the send

    def forward(self, p: str, keep: bool) -> str:
        """The layer on the norm's output; returns out_proj's output ``[n, hidden]``."""
        t = self.t
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
