"""The token-mixer layers of a hybrid model in the replay: ``Mixer`` describes them (which
kind, which layers, heads, dims, conv width, chunk, the layer's form), ``mixer_replay.MixerReplay``
replays one such layer as ``hf.apply`` runs it (``layers/mixers/__init__.py``). Kinds: Gated
DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), Kimi Delta Attention (Kimi-Linear), Mamba2 as Bamba,
Nemotron-H and Falcon-H1 write it, Jamba's Mamba1, LFM2's gated short convolution. Forms
(``FORMS``): a layer is norm -> mixer or attention -> norm -> MLP (``stacked``), or one block,
norm -> mixer, attention without RoPE or a relu2 MLP -> residual (``blocks``: Nemotron-H;
``replay.StepReplay.block_forward``), or norm -> Mamba2 beside attention -> norm -> MLP
(``parallel``: Falcon-H1, ``parallel_forward``).

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

Falcon-H1's Mamba2 as Bamba's, with in_proj's output times ``mup_vector`` kept (in_proj's own output
goes) and, without ``mamba_rms_norm``, ``out * silu(gate)`` keeping out and silu(gate) [n, I] each.

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
causal-conv1d or mamba_ssm here) and the adapters of ``layers/mixers/__init__.py``;
tests/test_memory_hybrid.py measures a tiny model's per-layer forward end within 2% for each
kind and the checkpointed layer (its input only) exactly. Not measured: the order of the
mixer's backward (modelled as each kept tensor's gradient made while the tensor goes, two at
a time), so the step peak of a step whose peak falls in a mixer's backward is an estimate.
The chunked kernels of flash-linear-attention and mamba_ssm keep far less (their inputs and
per-chunk states, recomputing the rest): on a GPU with them installed this model over-counts
the kernel. Mamba2's float32 casts alias in a float32 model (``x.float()`` is ``x``): the
counts follow the model's dtype (measured in float32 only).

Jamba's Mamba1 (``kind="mamba1"``: ``heads`` its channels, ``key_dim`` the state, ``dt_rank``):
``memory_step/mamba1.py`` (three exchanges and one back).

State passing (``Mixer.parallel="state"``, ``hf.apply(..., mixer_parallel="state")``,
docs/state_passing.md): no exchange; each rank runs its ``n`` tokens for every head, so the
tensors above over ``N`` tokens and the rank's ``h``/``g`` heads are over ``n`` tokens and all
``H``/``G`` heads (the kernel's chunks padded over the shard's tokens), and:

    conv:   its input after the halo: [n + B w, ch] (w = min(K - 1, tokens before the shard):
            0 on rank 0), its output [n + B w + B (K - 1), ch]
    GDN:    the kernel on the value side widened, Dv -> Dv + Dk (its Dv terms, its per-chunk
            states [Dk, Dv + Dk]), the initial state [0 | I] [B, H, Dk, Dv + Dk] float32
    KDA:    as GDN (3 of its 13 D terms are the value side's); the kernel's whole output
            [n, H, 2 D] kept (J, the correction's, is a view of it), the corrected [n, H D]
    Mamba2: x widened, P -> P + Ns per head (the scan's P terms and states), kept (and its
            float32 copy) in place of the conv's output; the scan's whole float32 output
            [n, H, P + Ns] kept (J), the corrected float32 [n, I]
    Mamba1: ``mamba1.mamba1_state_stages``: the scan with no gate, then the closed form's
            dt + bias, running sum [n, I], exp(A sum) and J [n, I, Ns] (float32); the
            corrected output and silu(gate) kept
    short conv: the halo only
    fold:   (``MixerReplay._fold``, float32) rank 0 its zero initial state; rank r > 0 the
            all-gathered (A, c) of the sp ranks and r + 1 states of the fold

measured per layer by tests/test_memory_hybrid.py as the head exchange is (within 2%; the
Gated DeltaNet whose shard pads its last chunk: an upper bound within 7%).

Not modelled, refused by name (``Mixer.from_config``): MoE layers (Nemotron-H's MoE blocks,
Jamba's experts), Falcon-H1's gate before its gated norm, projection biases, the attention-free
Mamba, Falcon-Mamba and Mamba2 models (blocks without an MLP).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import UlyssesInputError
from ..layout import Layout, split_lengths
from ..plan import HeadPlan, PlanError
from .mamba1 import mamba1_parameters

__all__ = ["Mixer", "PRESETS"]

KINDS = ("gated-deltanet", "mamba2", "short-conv", "kimi-delta", "mamba1")
# How a layer is built around its mixer: "stacked" norm -> mixer or attention -> norm -> MLP (the
# default; Qwen3.5, Bamba, LFM2, Kimi-Linear); "blocks": norm -> one of mixer, attention (no
# RoPE) or an MLP (Nemotron-H); "parallel": norm -> Mamba2 and attention side by side, summed ->
# norm -> MLP (Falcon-H1, its muP multipliers between them).
FORMS = ("stacked", "blocks", "parallel")
# How hf.apply runs the mixer layers (its ``mixer_parallel``, docs/state_passing.md): "heads" the
# head exchange (the default here: the calculator's figures before state passing), "state" the
# sequence kept sharded with the conv's halo and the recurrent state passed between ranks,
# "auto" as hf.apply's: the head exchange where the heads split over the ranks, else state.
PARALLEL = ("heads", "state", "auto")


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
    per layer; with ``form="blocks"`` also ``"mlp"``) say. ``form``: ``FORMS`` (``"parallel"``: every
    layer has the mixer and attention). ``gated_norm``: Mamba2's gated RMSNorm (Falcon-H1 without
    ``mamba_rms_norm``: the output times silu(gate) alone). ``rope``: the attention layers rotate
    q and k (not Nemotron-H's, Jamba's). Mamba1: ``heads`` = its channels, ``groups`` 1, ``dt_rank``.
    ``parallel``: ``PARALLEL``, as ``hf.apply(..., mixer_parallel=)`` runs the layers."""

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
    form: str = "stacked"
    gated_norm: bool = True
    rope: bool = True
    dt_rank: int = 0
    parallel: str = "heads"

    def __post_init__(self):
        if self.parallel not in PARALLEL:
            raise UlyssesInputError(f"memory: mixer parallel expected one of {list(PARALLEL)} (hf.apply's mixer_parallel), got {self.parallel!r}")
        if self.kind not in KINDS:
            raise UlyssesInputError(f"memory: mixer kind expected one of {list(KINDS)}, got {self.kind!r}")
        if self.form not in FORMS:
            raise UlyssesInputError(f"memory: mixer form expected one of {list(FORMS)}, got {self.form!r}")
        for name in ("heads", "groups", "head_dim", "key_dim", "conv", "chunk", "attention_every", "norm_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UlyssesInputError(f"memory: mixer {name} expected a positive int, got {value!r}")
        if self.kind == "mamba1" and (not isinstance(self.dt_rank, int) or self.dt_rank < 1):
            raise UlyssesInputError(f"memory: mixer dt_rank expected a positive int for kind 'mamba1', got {self.dt_rank!r}")
        if self.heads % self.groups:
            raise UlyssesInputError(f"memory: mixer heads ({self.heads}) expected a multiple of groups ({self.groups})")
        if self.layer_types is not None:
            allowed = ("linear_attention", "full_attention") + (("mlp",) if self.form == "blocks" else ())
            bad = sorted(set(self.layer_types) - set(allowed))
            if bad:
                raise UlyssesInputError(f"memory: mixer layer_types expected one of {list(allowed)} (form {self.form!r}), got {bad}")

    @classmethod
    def from_config(cls, cfg) -> Mixer:
        """From a transformers Qwen3.5 / Qwen3-Next, Kimi-Linear, Bamba, LFM2, Nemotron-H, Falcon-H1 or Jamba text config (or its dict);
        any other model type is refused by name (the module docstring says why)."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        model = get("model_type") or type(cfg).__name__
        if model in _NOT_MODELLED:
            raise UlyssesInputError(f"memory: config {model!r}: {_NOT_MODELLED[model]}; the calculator models {_MODELLED}")
        builder = {
            "bamba": cls._bamba, "nemotron_h": cls._nemotron_h, "falcon_h1": cls._falcon_h1,
            "jamba": cls._jamba, "kimi_linear": cls._kimi, "lfm2": cls._lfm2,
        }.get(model)  # fmt: skip
        if builder is not None:
            return builder(get)
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
    def _nemotron_h(cls, get) -> Mixer:
        types = get("layers_block_type") or get("layer_types")
        names = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp"}
        names.update({v: v for v in names.values()})
        bad = sorted({t for t in types or ["(none)"] if t not in names})
        if bad:
            raise UlyssesInputError(f"memory: config 'nemotron_h' layers_block_type {bad}: the calculator models mamba, attention and mlp blocks")
        for flag in ("mamba_proj_bias", "use_bias", "mlp_bias", "attention_bias"):
            if get(flag):
                raise UlyssesInputError(f"memory: config 'nemotron_h' with {flag}: the calculator counts its projections without a bias")
        if get("mlp_hidden_act", "relu2") != "relu2":
            raise UlyssesInputError(f"memory: config 'nemotron_h' mlp_hidden_act expected 'relu2', got {get('mlp_hidden_act')!r}")
        groups = get("n_groups", 8)
        return cls(heads=get("mamba_num_heads", 128), groups=groups, head_dim=get("mamba_head_dim", 64), key_dim=get("ssm_state_size", 128),
                   conv=get("conv_kernel", 4), chunk=get("chunk_size", 128), layer_types=tuple(names[t] for t in types), kind="mamba2",
                   norm_groups=groups, conv_bias=bool(get("use_conv_bias", True)), form="blocks", rope=False)  # fmt: skip

    @classmethod
    def _falcon_h1(cls, get) -> Mixer:
        for flag in ("mamba_proj_bias", "projectors_bias", "mlp_bias", "attention_bias"):
            if get(flag):
                raise UlyssesInputError(f"memory: config 'falcon_h1' with {flag}: the calculator counts its projections without a bias")
        rms = bool(get("mamba_rms_norm", False))
        if rms and not get("mamba_norm_before_gate", True):
            raise UlyssesInputError("memory: config 'falcon_h1' with mamba_rms_norm and not mamba_norm_before_gate: not modelled (measured: before the gate)")
        heads, dim = get("mamba_n_heads", 128), get("mamba_d_head")
        inner = get("mamba_d_ssm") or int(get("mamba_expand", 2) * get("hidden_size"))
        if not isinstance(dim, int) or heads * dim != inner:
            raise UlyssesInputError(f"memory: config 'falcon_h1' mamba_n_heads x mamba_d_head expected mamba_d_ssm ({inner}), got {heads} x {dim!r}")
        groups = get("mamba_n_groups", 1)
        return cls(heads=heads, groups=groups, head_dim=dim, key_dim=get("mamba_d_state", 256), conv=get("mamba_d_conv", 4),
                   chunk=get("mamba_chunk_size", 256), layer_types=("linear_attention",) * get("num_hidden_layers"), kind="mamba2",
                   norm_groups=groups, conv_bias=bool(get("mamba_conv_bias", True)), form="parallel", gated_norm=rms)  # fmt: skip

    @classmethod
    def _jamba(cls, get) -> Mixer:
        layers = get("num_hidden_layers")
        experts = get("num_experts", 16)
        period, offset = get("expert_layer_period", 2), get("expert_layer_offset", 1)
        if experts > 1 and any(i % period == offset for i in range(layers)):
            raise UlyssesInputError(f"memory: config 'jamba' with {experts} experts: its MoE layers are not modelled (num_experts=1: every layer an MLP)")
        if get("mamba_proj_bias"):
            raise UlyssesInputError("memory: config 'jamba' with mamba_proj_bias: the calculator counts in_proj without a bias")
        attn_period, attn_offset = get("attn_layer_period", 8), get("attn_layer_offset", 4)
        types = tuple("full_attention" if i % attn_period == attn_offset else "linear_attention" for i in range(layers))
        hidden, rank = get("hidden_size"), get("mamba_dt_rank", "auto")
        if not isinstance(hidden, int):
            raise UlyssesInputError(f"memory: config 'jamba' expected hidden_size, got {hidden!r}")
        rank = -(-hidden // 16) if rank == "auto" else rank
        inner = int(get("mamba_expand", 2) * hidden)
        return cls(heads=inner, groups=1, head_dim=1, key_dim=get("mamba_d_state", 16), conv=get("mamba_d_conv", 4), layer_types=types,
                   kind="mamba1", conv_bias=bool(get("mamba_conv_bias", True)), rope=False, dt_rank=rank)  # fmt: skip

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

    def block(self, i: int) -> str:
        """What layer ``i`` mixes with: ``"mixer"``, ``"attention"`` or (form blocks) ``"mlp"``."""
        if self.is_mixer(i):
            return "mixer"
        return "mlp" if self.layer_types is not None and self.layer_types[i] == "mlp" else "attention"

    def check_setup(self, setup) -> None:
        """The calculator's ``Setup`` around this mixer: its layer count, and its MLP for a form
        whose MLP is fixed (Nemotron-H's blocks: up -> relu2 -> down, ``mlp="plain"``)."""
        if self.layer_types is not None and len(self.layer_types) != setup.layers:
            raise UlyssesInputError(f"memory: mixer layer_types expected {setup.layers} entries (layers), got {len(self.layer_types)}")
        if self.form == "blocks" and setup.mlp != "plain":
            raise UlyssesInputError(f"memory: mlp expected 'plain' for a mixer of form 'blocks' (Nemotron-H's up -> relu2 -> down), got {setup.mlp!r}")
        if self.form == "parallel" and setup.mlp != "gated":
            raise UlyssesInputError(f"memory: mlp expected 'gated' for a mixer of form 'parallel' (Falcon-H1's), got {setup.mlp!r}")

    def layer_parameters(self, i: int, hidden: int, attention: int, mlp: int) -> int:
        """Layer ``i``'s parameters, given an attention's and an MLP's: stacked, its mixer or
        attention, the MLP and two norms; a block, what it mixes with and one norm; parallel, both."""
        mixes = self.parameters(hidden) if self.is_mixer(i) else attention
        if self.form == "parallel":
            mixes += attention
        if self.form == "blocks":
            return (mlp if self.block(i) == "mlp" else mixes) + hidden
        return mixes + mlp + 2 * hidden

    @property
    def conv_channels(self) -> int:
        if self.kind in ("short-conv", "mamba1"):
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
        if self.kind == "mamba1":
            return mamba1_parameters(self, hidden)
        if self.kind == "mamba2":
            return hidden * (hv + ch + self.heads) + conv + 3 * self.heads + (hv if self.gated_norm else 0) + hv * hidden
        if self.kind == "short-conv":
            return 3 * hidden * ch + conv + ch * hidden
        if self.kind == "kimi-delta":  # q/k/v, f_a/f_b, b, conv, A_log, dt_bias, g_a/g_b, o_norm, o_proj
            d = self.head_dim
            return 3 * hidden * hv + 2 * (hidden * d + d * hv) + hidden * self.heads + conv + self.heads + hv + d + hv * hidden
        return hidden * (ch + hv + 2 * self.heads) + conv + 2 * self.heads + self.head_dim + hv * hidden

    def strategy(self, sp: int) -> str:
        """How ``hf.apply`` runs the layers over ``sp`` ranks: ``"heads"`` or ``"state"``
        (``"auto"``: the head exchange where the heads split over the ranks, as ``plan_mixers``)."""
        if self.parallel != "auto":
            return self.parallel
        try:
            HeadPlan.build(self.heads, self.groups, sp)
        except PlanError:
            return "state"
        return "heads"

    def heads_on(self, setup, rank: int) -> tuple[int, int]:
        """``(h, g)``: the value and key heads of ``rank`` (the head plan of ``hf.apply``'s
        mixers; state passing: every head)."""
        if self.strategy(setup.sp) == "state":
            return self.heads, self.groups
        lay = Layout(HeadPlan.build(self.heads, self.groups, setup.sp), rank, tuple(split_lengths(setup.seq, setup.sp)), setup.batch, self.head_dim)
        return lay.head_count("q", rank), lay.head_count("kv", rank)

    def halo_on(self, setup, rank: int) -> int:
        """The tokens (of each sequence) before ``rank``'s shard that its conv takes under state
        passing (``state_passing.preceding``: ``conv - 1``, fewer where the shards before are
        shorter); 0 under the head exchange."""
        if self.strategy(setup.sp) != "state":
            return 0
        return min(self.conv - 1, sum(split_lengths(setup.seq, setup.sp)[:rank]))


_MODELLED = (
    "Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), Kimi Delta Attention (Kimi-Linear), Bamba's, Nemotron-H's and Falcon-H1's "
    "Mamba2, Jamba's Mamba1, LFM2's short convolution"
)
# hf.apply runs these exact (docs/hf.md); their layers are norm -> mixer -> residual, no MLP and
# no attention: a layer form the replay does not build yet.
_ATTENTION_FREE = "attention-free (norm -> mixer blocks without an MLP), a layer form the calculator does not model yet"
_NOT_MODELLED: dict[str, str] = {"mamba": _ATTENTION_FREE, "falcon_mamba": _ATTENTION_FREE, "mamba2": _ATTENTION_FREE}

# Shapes of released models' Gated DeltaNet layers (their config.json); sizes of the rest
# (hidden, heads, layers) come from the command line. The others: give their config.json.
PRESETS = {
    "qwen3.5": Mixer(heads=32, groups=16, head_dim=128, key_dim=128, conv=4, attention_every=4),  # Qwen3-Next-80B-A3B, Qwen3.5
}
