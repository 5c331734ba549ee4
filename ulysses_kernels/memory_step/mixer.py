"""The Gated DeltaNet layers of a hybrid model in the replay (Qwen3.5, Qwen3.5-MoE, Qwen3-Next):
``Mixer`` describes them (which layers, heads, dims, conv width, chunk), ``MixerReplay`` replays
one such layer as ``hf.apply`` runs it (``integrations/hf/mixers.py``).

One layer on a rank with ``n`` local tokens and ``N`` tokens of the whole sequence (batch x
sequence), ``Hv``/``Hk`` value/key heads of which the rank holds ``h``/``g`` (the head plan's
query/KV ranges), ``Dv``/``Dk`` their dims, ``C`` the kernel's chunk::

    local:  in_proj_qkv, in_proj_z, in_proj_b/a  -> z [n, Hv Dv] kept (the gated norm's gate)
    send    [n, Hv (Dv + 2) + 2 Hk Dk]            -> recv [N, h (Dv + 2) + 2 g Dk]   (one all-to-all)
    conv:   its input and its output (silu's input) [N, 2 g Dk + h Dv], kept
    gates:  beta, softplus's input and output  [N, h] (3 tensors)
    kernel: transformers' ``torch_chunk_gated_delta_rule`` in float32 (``KERNEL_*`` below)
    out     [N, h, Dv] -> one all-to-all back -> [n, Hv Dv]
    gated norm (float32): 5 [n, Hv Dv] + 2 [n, Hv]; out_proj -> [n, hidden]

What is modelled: the bytes each of these keeps for the backward (the forward's end without
checkpointing), counted from transformers 5.23's torch fallbacks (no flash-linear-attention or
causal-conv1d here); tests/test_memory_hybrid.py measures a tiny Qwen3.5's per-layer forward end
within 2% and the checkpointed layer (its input only) exactly. Not measured: the order of the
mixer's backward (modelled as each kept tensor's gradient made while the tensor goes, two at
a time), so the step peak of a step whose peak falls in a mixer's backward is an estimate.
The chunked kernels of flash-linear-attention keep far less (their inputs and per-chunk
states, recomputing the rest): on a GPU with fla installed this model over-counts the kernel.
Mamba2 (Bamba, Nemotron-H, Falcon-H1) and the other mixers are not modelled: refused by name.
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


@dataclass(frozen=True)
class Mixer:
    """The Gated DeltaNet layers of a hybrid: ``heads``/``groups`` value/key heads,
    ``head_dim``/``key_dim`` their dims, ``conv`` the causal conv's width, ``chunk`` the
    kernel's chunk; layer ``i`` is attention when ``(i + 1) % attention_every == 0`` (Qwen3.5's
    ``full_attention_interval``), or as ``layer_types`` (``"linear_attention"`` /
    ``"full_attention"`` per layer) say."""

    heads: int
    groups: int
    head_dim: int
    key_dim: int
    conv: int = 4
    chunk: int = 64
    attention_every: int = 4
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in ("heads", "groups", "head_dim", "key_dim", "conv", "chunk", "attention_every"):
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
        """From a transformers Qwen3.5 / Qwen3-Next text config (or its dict)."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        if get("linear_num_value_heads") is None:
            kind = get("model_type") or type(cfg).__name__
            raise UlyssesInputError(f"memory: config {kind!r} has no Gated DeltaNet layers (linear_num_value_heads): only those are modelled")
        types = get("layer_types")
        return cls(heads=get("linear_num_value_heads"), groups=get("linear_num_key_heads"), head_dim=get("linear_value_head_dim"),
                   key_dim=get("linear_key_head_dim"), conv=get("linear_conv_kernel_dim", 4),
                   attention_every=get("full_attention_interval", 4) or 4, layer_types=tuple(types) if types else None)  # fmt: skip

    def is_mixer(self, i: int) -> bool:
        if self.layer_types is not None:
            return self.layer_types[i] == "linear_attention"
        return (i + 1) % self.attention_every != 0

    def check_layers(self, layers: int) -> None:
        if self.layer_types is not None and len(self.layer_types) != layers:
            raise UlyssesInputError(f"memory: mixer layer_types expected {layers} entries (layers), got {len(self.layer_types)}")

    @property
    def conv_channels(self) -> int:
        return 2 * self.groups * self.key_dim + self.heads * self.head_dim

    def parameters(self, hidden: int) -> int:
        """One mixer's parameters: in_proj_qkv, in_proj_z, in_proj_b/a, conv, A_log, dt_bias, norm, out_proj."""
        hv = self.heads * self.head_dim
        return hidden * (self.conv_channels + hv + 2 * self.heads) + self.conv_channels * self.conv + 2 * self.heads + self.head_dim + hv * hidden

    def heads_on(self, setup, rank: int) -> tuple[int, int]:
        """``(h, g)``: the value and key heads of ``rank`` (the head plan of ``hf.apply``'s mixers)."""
        lay = Layout(HeadPlan.build(self.heads, self.groups, setup.sp), rank, tuple(split_lengths(setup.seq, setup.sp)), setup.batch, self.head_dim)
        return lay.head_count("q", rank), lay.head_count("kv", rank)


# Shapes of released models' Gated DeltaNet layers (their config.json); sizes of the rest
# (hidden, heads, layers) come from the command line.
PRESETS = {
    "qwen3.5": Mixer(heads=32, groups=16, head_dim=128, key_dim=128, conv=4, attention_every=4),  # Qwen3-Next-80B-A3B, Qwen3.5
}


class MixerReplay:
    """The Gated DeltaNet layer of one rank's step (``sizes``: the step's; ``setup.mixer``)."""

    def __init__(self, ledger: Ledger, setup, sizes, rank: int):
        m, e = setup.mixer, setup.element_size
        self.t, self.m, self.e = ledger, m, e
        h, g = m.heads_on(setup, rank)
        n = sizes.n
        N = setup.batch * setup.seq
        hv_local = n * m.heads * m.head_dim
        padded = -(-setup.seq // m.chunk) * m.chunk * setup.batch
        kernel = h * (padded * (KERNEL_DK * m.key_dim + KERNEL_DV * m.head_dim + KERNEL_C * m.chunk + KERNEL_ONE)
                      + padded // m.chunk * KERNEL_STATES * m.key_dim * m.head_dim)  # fmt: skip
        # (name, bytes) kept for the backward, in the order the forward makes them
        self.kept = [
            ("z", hv_local * e),
            ("conv_in", N * (2 * g * m.key_dim + h * m.head_dim) * e),
            ("conv_out", N * (2 * g * m.key_dim + h * m.head_dim) * e),
            ("beta", N * h * e),
            ("sp_in", N * h * 4),
            ("sp_out", N * h * 4),
            ("kernel", kernel * 4),
            ("out", N * h * m.head_dim * e),
            ("norm", GATED_NORM_WIDE * hv_local * max(e, 4) + GATED_NORM_ONE * n * m.heads * 4),
            ("o_in", hv_local * e),
        ]
        one = setup.sp == 1
        self.send = 0 if one else n * (m.heads * (m.head_dim + 2) + 2 * m.groups * m.key_dim) * e
        self.recv = N * (h * (m.head_dim + 2) + 2 * g * m.key_dim) * e
        self.back = 0 if one else hv_local * e  # the output's exchange back
        self.X = n * setup.hidden * e
        self.qkv = n * m.conv_channels * e  # in_proj_qkv's output, split into the exchange
        self.weights = m.parameters(setup.hidden) * e

    def forward(self, p: str, keep: bool) -> str:
        """The layer on the norm's output; returns out_proj's output ``[n, hidden]``."""
        t = self.t
        t.new(p + "qkv", self.qkv)
        t.new(p + "z", self.kept[0][1])
        t.new(p + "send", self.send)
        t.free(p + "qkv")
        t.new(p + "recv", self.recv, "mixer exchange")
        t.free(p + "send")
        for name, nbytes in self.kept[1:-1]:
            t.new(p + name, nbytes, "mixer forward")
            if name == "kernel":
                t.free(p + "recv")
            if name == "out":
                t.new(p + "back", self.back, "mixer exchange back")
        t.free(p + "back")
        t.new(p + "o_in", self.kept[-1][1])
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
