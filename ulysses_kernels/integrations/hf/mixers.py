"""Ulysses for the token mixers of hybrid models that are not attention: Gated DeltaNet
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo Hybrid), Kimi Delta Attention (Kimi-Linear, Bailing
Hybrid), Mamba2 (Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid, Zamba2; attention-free Mamba2),
Mamba1 (Jamba; attention-free Mamba and Falcon-Mamba: three exchanges, ``_mamba1_forward``),
Zamba's multi-head Mamba1 (one exchange), MiniMax's lightning attention, RecurrentGemma's RG-LRU
block and LFM2's short convolution (LFM2, LFM2-MoE, LFM3), switched by
``apply`` in the same call as attention. ``HANDLED_MIXERS`` names every class made exact (what ``apply``'s refusal audit
reads); each runs exact against one process in tests/test_hf_hybrid.py.

Per head, each of these layers is a function of the whole sequence (a causal depthwise
conv1d over the head's channels, then a recurrence or scan over its tokens), so it runs as
attention does under Ulysses. One layer on rank ``r`` of ``P`` (``s_r`` local tokens, ``S``
in all; ``H`` heads, ``G`` groups: GDN's value/key heads, Mamba2's heads/groups)::

    hidden [B, s_r, hidden]
      -> the input projections, all heads (local)
      -> per head  [B, s_r, H, W]: GDN v | b | a (W = Dv + 2); Mamba2 x | dt (W = P + 1)
         per group [B, s_r, G, U]: GDN q | k (U = 2 Dk);     Mamba2 B | C (U = 2 N)
      -> ONE all-to-all (``_ToHeads``: roles ("q", "v") of the library's layout: heads on
         the plan's query ranges, groups on its KV ranges, a group whose heads are split
         over ranks sent to each of them, its gradient summed back)
      -> [B, S, h, W], [B, S, g, U]: the rank's heads over the whole sequence
      -> the causal conv1d on the rank's channels (the layer's weight rows), per document
      -> the per-head gates (GDN g, beta; Kimi's per-channel forget gate; Mamba2's dt bias,
         A, D), the parameters sliced to the rank's heads
      -> the model's own kernel (transformers' ``torch_chunk_gated_delta_rule`` /
         ``mamba2_chunk_scan`` as its module resolved them: flash-linear-attention or
         mamba_ssm when installed, the torch fallback otherwise), per document
      -> [B, S, h, Dv] -> ONE all-to-all back (``head_to_seq``) -> [B, s_r, H, Dv]
      -> gated norm, out_proj (local)

The layer's forward is replaced on the instance (``switch_mixers``) by one built from its own
submodules and its module's kernel functions: transformers' forwards call module-level
kernels on whatever sequence they see, so no wrapper around those calls could move data
between the projections and the conv. Each family's adapter writes out the transformers
5.23 forward's arithmetic step by step (the tests compare it with one process); a layer
the adapters do not know keeps its forward.

LFM2's short convolution has no heads: its ``hidden`` channels are planned as ``hidden``
heads of one element (the conv is depthwise), the gate ``B * x`` moves, ``C`` stays.

Packed documents: after the exchange each rank holds the whole sequence of its heads, so
the conv and the kernel run once per document (the state starts from zero at each
boundary, what the kernels' varlen forms do). transformers' torch fallbacks themselves
ignore document boundaries in these layers; the reference is each document run alone.

Not handled (refused by ``apply``): a KV/conv cache (generation), a padding mask, a 2-D
group (``SPGroups``), more ranks than a layer's heads.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...attention import head_to_seq
from ...attention.exchange import a2a_head_to_seq, a2a_seq_to_head
from ...gqa import expand_kv
from ...kernels import TorchKernels
from ...layout import Layout
from ...plan import HeadPlan, PlanError
from .batch import _SHARD_KWARG, HFIntegrationError, SequenceShard

__all__ = ["HANDLED_MIXERS"]

_ROLES = ("q", "v")  # per-head tensors on the plan's query ranges, per-group ones on its KV ranges
_HEADS_ONLY = ("q",)
_SETTINGS_ATTR = "_ulysses_mixer"  # set on each switched mixer by ``switch_mixers``
# ``(group, communicator)`` of this step, in the model's kwargs, for mixers switched without a
# group (verl's switch: its group is known per forward, not when the model is prepared).
GROUP_KWARG = "ulysses_mixer_group"


class _ToHeads(torch.autograd.Function):
    """Sequence-sharded ``heads`` ``[B, s_r, H, W]`` (and ``groups`` ``[B, s_r, G, U]``) ->
    this rank's heads over the whole sequence ``[B, S, h, W]`` (``[B, S, g, U]``), one
    all-to-all; the backward is the reverse exchange, summing the gradient of a group that
    several ranks received (the library's movers, as for q/k/v).

    The pure-PyTorch kernel set packs and unpacks: the Triton and CUDA sets are tested on
    attention's roles and widths, not on these; on a GPU this is a strided copy per role and
    peer (not measured yet)."""

    @staticmethod
    def forward(ctx, layout: Layout, comm, heads, groups=None):
        ctx.layout, ctx.comm = layout, comm
        ctx.roles = _ROLES if groups is not None else _HEADS_ONLY
        tensors = (heads, groups) if groups is not None else (heads,)
        return tuple(a2a_seq_to_head(layout, tensors, ctx.roles, comm, TorchKernels))

    @staticmethod
    def backward(ctx, *grads):
        lay = ctx.layout
        like = next(g for g in grads if g is not None)
        grads = [g if g is not None else like.new_zeros(lay.batch, lay.seq_total, lay.head_count(r, lay.rank), lay.dim(r)) for g, r in zip(grads, ctx.roles)]
        back = a2a_head_to_seq(lay, grads, ctx.roles, ctx.comm, TorchKernels)
        return (None, None, *back) if len(back) == 2 else (None, None, back[0], None)


@dataclass(frozen=True, eq=False)
class _MixerSettings:
    """What ``apply`` set on one mixer: the group, its communicator, the head plan
    (``comm`` ``None``: both come with each step as ``GROUP_KWARG``)."""

    group: object
    comm: object
    plan: HeadPlan
    family: str


def _kernel(module, name: str) -> Callable:
    """The kernel function ``name`` of ``module``'s transformers module (what its forward calls)."""
    fn = getattr(sys.modules.get(type(module).__module__), name, None)
    if not callable(fn):
        raise HFIntegrationError(f"apply: {type(module).__name__}'s module has no {name} (transformers changed?)")
    return fn


def _context(module, kwargs, cache, attention_mask) -> tuple[_MixerSettings, SequenceShard]:
    settings = getattr(module, _SETTINGS_ATTR)
    shard = kwargs.get(_SHARD_KWARG)
    name = type(module).__name__
    if settings.comm is None:
        group, comm = kwargs[GROUP_KWARG]  # present: ``_per_step`` checked it
        settings = dataclasses.replace(settings, group=group, comm=comm)
    if not isinstance(shard, SequenceShard):
        raise HFIntegrationError(
            f"{name}: the model runs sequence-parallel but was called without a sequence shard; feed it "
            "model(**ulysses_kernels.integrations.hf.shard_batch(input_ids, group=group).model_inputs())"
        )
    if cache is not None:
        raise HFIntegrationError(f"{name}: a cache (past_key_values / use_cache=True) is not supported sequence-parallel; run with use_cache=False")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise HFIntegrationError(f"{name}: a padding attention_mask is not supported; drop it and set padded labels to -100")
    if (shard.rank, shard.world_size) != (settings.comm.rank, settings.comm.world_size):
        raise HFIntegrationError(
            f"{name}: the batch was sharded for rank {shard.rank} of {shard.world_size} but apply() was given a group in which "
            f"this process is rank {settings.comm.rank} of {settings.comm.world_size}; pass the same group to apply and shard_batch"
        )
    return settings, shard


def _to_heads(settings: _MixerSettings, shard: SequenceShard, heads, groups=None):
    """``_ToHeads`` over the layer's plan and the step's shards."""
    lay = Layout(settings.plan, settings.comm.rank, tuple(shard.seq_lens), heads.shape[0], heads.shape[3],
                 groups.shape[3] if groups is not None else None)  # fmt: skip
    return _ToHeads.apply(lay, settings.comm, heads.contiguous(), None if groups is None else groups.contiguous())


def _to_sequence(settings: _MixerSettings, shard: SequenceShard, out):
    """``[B, S, h, D]`` over the rank's heads -> ``[B, s_r, H, D]`` (the library's ``head_to_seq``)."""
    return head_to_seq(out, settings.plan, group=settings.group, seq_lens=list(shard.seq_lens), comm=settings.comm)


def _spans(shard: SequenceShard) -> list[tuple[int, int]]:
    """The documents ``(start, end)`` of the global sequence (one span when not packed)."""
    return shard.documents.spans() if shard.documents is not None else [(0, shard.total)]


def _per_document(shard: SequenceShard, fn, *tensors, dim: int = 1):
    """``fn`` on each document's slice of ``tensors`` (along ``dim``), joined back."""
    spans = _spans(shard)
    if len(spans) == 1:
        return fn(*tensors)
    return torch.cat([fn(*(t.narrow(dim, a, b - a) for t in tensors)) for a, b in spans], dim=dim)


def _conv(module, conv: torch.nn.Conv1d, channels: torch.Tensor, shard, x: torch.Tensor, activation) -> torch.Tensor:
    """The layer's causal depthwise conv1d on the rank's ``channels`` (indices into the conv's
    channels) of ``x`` ``[B, S, C_r]``, per document, with the module's ``causal_conv1d_fn``."""
    fn = _kernel(module, "causal_conv1d_fn")
    weight = conv.weight.squeeze(1).index_select(0, channels)
    bias = None if conv.bias is None else conv.bias.index_select(0, channels)

    def run(x):
        return fn(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)

    return _per_document(shard, run, x)


def _ranges(settings: _MixerSettings) -> tuple[tuple[int, int], tuple[int, int], tuple[int, ...]]:
    rank = settings.comm.rank
    plan = settings.plan
    return plan.q_ranges[rank], plan.kv_ranges[rank], plan.local_kv_map(rank)


def _arange(a: int, b: int, scale: int, offset: int, device) -> torch.Tensor:
    return torch.arange(offset + a * scale, offset + b * scale, device=device)


# ---- Gated DeltaNet: Qwen3.5 (dense and MoE), Qwen3-Next, OLMo Hybrid -----------------------------
def _gdn_project_qwen3_5(m, h):
    """Qwen3.5's projections: pre-conv q, k ``[B, s, Hk, Dk]``, v, z ``[B, s, Hv, Dv]``, b, a ``[B, s, Hv]``."""
    bsz, seq, _ = h.shape
    q, k, v = torch.split(m.in_proj_qkv(h), [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    z = m.in_proj_z(h).reshape(bsz, seq, -1, m.head_v_dim)
    return (q.reshape(bsz, seq, -1, m.head_k_dim), k.reshape(bsz, seq, -1, m.head_k_dim), v.reshape(bsz, seq, -1, m.head_v_dim),
            z, m.in_proj_b(h), m.in_proj_a(h))  # fmt: skip


def _gdn_project_qwen3_next(m, h):
    """Qwen3-Next's projections (its grouped qkvz/ba ordering), as ``_gdn_project_qwen3_5``."""
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
    return q, k, v, z, b, a


def _gdn_project_olmo_hybrid(m, h):
    """OLMo Hybrid's separate q/k/v/a/b projections and its output gate ``g_proj`` (as ``z``)."""
    bsz, seq, _ = h.shape
    q, k = m.q_proj(h).reshape(bsz, seq, -1, m.head_k_dim), m.k_proj(h).reshape(bsz, seq, -1, m.head_k_dim)
    v, z = m.v_proj(h).reshape(bsz, seq, -1, m.head_v_dim), m.g_proj(h).reshape(bsz, seq, -1, m.head_v_dim)
    return q, k, v, z, m.b_proj(h), m.a_proj(h)


def _gdn_forward(project, norm_attr: str = "norm", out_attr: str = "out_proj"):
    """The Gated DeltaNet forward over ``project``'s projections; ``norm_attr`` and ``out_attr``
    name the layer's gated norm and output projection."""

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        """Gated DeltaNet under Ulysses (the module docstring); transformers 5.23's forward, step by step."""
        settings, shard = _context(self, kwargs, cache_params, attention_mask)
        q, k, v, z, b, a = project(self, hidden_states)
        heads, groups = _to_heads(settings, shard, torch.cat([v, b.unsqueeze(-1), a.unsqueeze(-1)], -1), torch.cat([q, k], -1))
        (h0, h1), (g0, g1), kv_map = _ranges(settings)
        dk, dv = self.head_k_dim, self.head_v_dim
        v, b, a = heads.split([dv, 1, 1], dim=-1)
        q, k = groups.split([dk, dk], dim=-1)
        bsz, total, hv, hk = v.shape[0], v.shape[1], v.shape[2], q.shape[2]
        dev = v.device
        # The conv's channels: [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]; the rank's rows of each.
        channels = torch.cat([_arange(g0, g1, dk, 0, dev), _arange(g0, g1, dk, self.key_dim, dev), _arange(h0, h1, dv, 2 * self.key_dim, dev)])
        mixed = torch.cat([q.reshape(bsz, total, -1), k.reshape(bsz, total, -1), v.reshape(bsz, total, -1)], dim=-1)
        mixed = _conv(self, self.conv1d, channels, shard, mixed, self.activation)
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(bsz, total, hk, dk), k.reshape(bsz, total, hk, dk), v.reshape(bsz, total, hv, dv)
        q, k = expand_kv(q, k, kv_map)  # value head i reads key head kv_map[i] (uniform groups stay grouped)
        beta = b.squeeze(-1).sigmoid()
        if getattr(self, "allow_neg_eigval", False):  # OLMo Hybrid: beta in [0, 2]
            beta = beta * 2.0
        g = -self.A_log[h0:h1].float().exp() * F.softplus(a.squeeze(-1).float() + self.dt_bias[h0:h1])
        rule = _kernel(self, "torch_chunk_gated_delta_rule")

        def run(q, k, v, g, beta):
            return rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)[0]

        out = _per_document(shard, run, q, k, v, g, beta)
        out = _to_sequence(settings, shard, out)  # [B, s, Hv, Dv]
        z_shape = z.shape
        out = getattr(self, norm_attr)(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(z_shape)
        return getattr(self, out_attr)(out.reshape(out.shape[0], out.shape[1], -1))

    return forward


# ---- Kimi Delta Attention (Kimi-Linear, Bailing Hybrid): GDN with a per-channel forget gate -----------
def _kda_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Kimi-Linear's delta attention under Ulysses: per head q | k | v | the forget gate's
    pre-activation (``f_b_proj(f_a_proj(h))``, ``D`` each) | b, one all-to-all; the conv, the
    gate's ``dt_bias``/``A_log`` (the rank's slices) and ``chunk_kimi_delta_attention`` per
    document; back; the output gate and norm locally."""
    settings, shard = _context(self, kwargs, cache_params, attention_mask)
    bsz, seq, _ = hidden_states.shape
    d, fg = self.head_dim, self.forget_gate
    bailing = hasattr(fg, "f_proj")  # Bailing Hybrid: one gate projection, its A_log per head, a bounded gate
    per_head = [p(hidden_states).reshape(bsz, seq, -1, d) for p in (self.q_proj, self.k_proj, self.v_proj)]
    pre = fg.f_proj(hidden_states) if bailing else fg.f_b_proj(fg.f_a_proj(hidden_states))
    per_head.append(pre.reshape(bsz, seq, -1, d))
    per_head.append(self.b_proj(hidden_states).unsqueeze(-1))
    (heads,) = _to_heads(settings, shard, torch.cat(per_head, -1))
    (h0, h1), _, _ = _ranges(settings)
    q, k, v, f, b = heads.split([d, d, d, d, 1], dim=-1)
    total, h, dev = q.shape[1], q.shape[2], q.device
    channels = torch.cat([_arange(h0, h1, d, i * self.qkv_dim, dev) for i in range(3)])
    mixed = _conv(self, self.conv1d, channels, shard, torch.cat([t.reshape(bsz, total, -1) for t in (q, k, v)], -1), self.activation)
    q, k, v = (t.reshape(bsz, total, h, d) for t in mixed.split([h * d] * 3, dim=-1))
    if bailing:  # BailingHybridForgetGate.forward after its projection, on the rank's channels
        g = f.float() + fg.dt_bias[h0 * d : h1 * d].view(1, 1, h, d)
        decay = fg.A_log[h0:h1].exp().view(1, 1, h, 1)
        g = (fg.lower_bound * torch.sigmoid(decay * g) if fg.safe_gate else -decay * F.softplus(g)).to(hidden_states.dtype)
    else:  # KimiLinearForgetGate.forward after its projections, on the rank's channels.
        g = f.float() + fg.dt_bias[h0 * d : h1 * d].float().view(1, 1, h, d)
        g = -torch.exp(fg.A_log[:, :, h0:h1].float()) * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    beta = b.squeeze(-1).sigmoid()
    rule = _kernel(self, "chunk_kimi_delta_attention")

    def run(q, k, v, g, beta):
        return rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)[0]

    out = _to_sequence(settings, shard, _per_document(shard, run, q, k, v, g, beta).contiguous())
    gate = (self.g_proj(hidden_states) if bailing else self.g_b_proj(self.g_a_proj(hidden_states))).reshape(bsz, seq, -1, d)
    return self.o_proj(self.o_norm(out, gate).reshape(bsz, seq, -1))


# ---- Mamba2: Mamba2, Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid, Zamba2 -------------------------
def _mamba2_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """A Mamba2 mixer under Ulysses (the module docstring); transformers 5.23's chunked torch
    path step by step (the fused ``mamba2_split_conv1d_scan_combined`` of mamba_ssm is the
    same computation with the projections inside; its pieces run here instead)."""
    settings, shard = _context(self, kwargs, cache_params, attention_mask)
    dtype = hidden_states.dtype
    falcon = hasattr(self, "mup_vector")
    if falcon:  # Falcon-H1's muP multipliers
        hidden_states = hidden_states * self.ssm_in_multiplier
    projected = self.in_proj(hidden_states)
    if falcon:
        projected = projected * self.mup_vector
    bsz, seq, _ = hidden_states.shape
    gn = self.n_groups * self.ssm_state_size
    gate, x, bm, cm, dt = projected.split([self.intermediate_size, self.intermediate_size, gn, gn, self.num_heads], dim=-1)
    heads = torch.cat([x.reshape(bsz, seq, self.num_heads, self.head_dim), dt.unsqueeze(-1)], -1)
    groups = torch.cat([bm.reshape(bsz, seq, self.n_groups, -1), cm.reshape(bsz, seq, self.n_groups, -1)], -1)
    heads, groups = _to_heads(settings, shard, heads, groups)
    (h0, h1), (g0, g1), kv_map = _ranges(settings)
    p, n = self.head_dim, self.ssm_state_size
    x, dt = heads.split([p, 1], dim=-1)
    bm, cm = groups.split([n, n], dim=-1)
    total, h, g = x.shape[1], x.shape[2], bm.shape[2]
    dev = x.device
    # The conv's channels: [x (H*P) | B (G*N) | C (G*N)]; the rank's rows of each.
    channels = torch.cat([_arange(h0, h1, p, 0, dev), _arange(g0, g1, n, self.intermediate_size, dev), _arange(g0, g1, n, self.intermediate_size + gn, dev)])
    mixed = torch.cat([x.reshape(bsz, total, -1), bm.reshape(bsz, total, -1), cm.reshape(bsz, total, -1)], dim=-1)
    mixed = _conv(self, self.conv1d, channels, shard, mixed, self.activation)
    x, bm, cm = torch.split(mixed, [h * p, g * n, g * n], dim=-1)
    x, bm, cm = x.reshape(bsz, total, h, p), bm.reshape(bsz, total, g, n), cm.reshape(bsz, total, g, n)
    bm, cm = expand_kv(bm, cm, kv_map)  # head i reads group kv_map[i]
    a_neg = -torch.exp(self.A_log[h0:h1].float())
    scan = _kernel(self, "mamba2_chunk_scan")

    def run(x, dt, bm, cm):
        return scan(x, dt, a_neg, bm, cm, chunk_size=self.chunk_size, D=self.D[h0:h1], z=None, dt_bias=self.dt_bias[h0:h1],
                    dt_softplus=True, initial_states=None, dt_limit=self.time_step_limit)  # fmt: skip

    out = _per_document(shard, run, x, dt.squeeze(-1), bm, cm)
    out = _to_sequence(settings, shard, out.contiguous()).reshape(bsz, seq, -1)
    if not falcon or self.mamba_rms_norm:
        out = self.norm(out, gate)
    else:
        out = out * F.silu(gate)
    return self.out_proj(out.to(dtype))


# ---- Mamba1: Jamba, Mamba, Falcon-Mamba ---------------------------------------------------------------
def _mamba1_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """A Mamba1 mixer under Ulysses (Jamba's, Mamba's, Falcon-Mamba's). Its ``x_proj`` mixes all
    ``I`` channels of a token between the conv and the scan, so one exchange does not cover it:
    the channels (one element a head, as LFM2's) go to the rank's shard for the conv, back to
    sequence shards for ``x_proj`` and the dt/B/C norms (per token, local; Jamba and
    Falcon-Mamba have them, Mamba not), then x | dt | the gate per channel and B | C (one group:
    every rank gets it) to the rank's channels for the scan, and back: three all-to-alls and the
    one back. The model's ``mamba_selective_scan`` per document."""
    settings, shard = _context(self, kwargs, cache_params, attention_mask)
    dtype = hidden_states.dtype
    x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # [B, s, I] each
    (h0, h1), _, _ = _ranges(settings)
    (local,) = _to_heads(settings, shard, x.unsqueeze(-1))  # [B, S, c, 1]
    channels = torch.arange(h0, h1, device=local.device)
    conv = _conv(self, self.conv1d, channels, shard, local.squeeze(-1), self.activation)  # [B, S, c]
    x = _to_sequence(settings, shard, conv.unsqueeze(-1).contiguous()).squeeze(-1)  # [B, s, I]
    n = self.ssm_state_size
    time_step, bm, cm = torch.split(self.x_proj(x), [self.time_step_rank, n, n], dim=-1)
    if hasattr(self, "dt_layernorm"):  # Jamba, Falcon-Mamba
        time_step, bm, cm = self.dt_layernorm(time_step), self.b_layernorm(bm), self.c_layernorm(cm)
    dt = (self.dt_proj.weight @ time_step.transpose(1, 2)).transpose(1, 2)  # [B, s, I]; the scan adds the bias
    heads, groups = _to_heads(settings, shard, torch.stack([x, dt, gate], dim=-1), torch.cat([bm, cm], dim=-1).unsqueeze(2))
    x, dt, gate = heads.unbind(-1)  # [B, S, c]
    bm, cm = groups.squeeze(2).split([n, n], dim=-1)  # [B, S, N]
    a_neg = -torch.exp(self.A_log[h0:h1].float())
    bias = self.dt_proj.bias[h0:h1].float() if self.dt_proj.bias is not None else None
    scan = _kernel(self, "mamba_selective_scan")

    def run(x, dt, gate, bm, cm):
        t = lambda v: v.transpose(1, 2)  # noqa: E731 - the kernel's [B, channels, S] layout
        return t(scan(t(x), t(dt), a_neg, t(bm), t(cm), D=self.D[h0:h1].float(), z=t(gate), delta_bias=bias, delta_softplus=True,
                      return_last_state=False, use_mambapy=self.use_mambapy, use_associative_scan=self.use_associative_scan))  # fmt: skip

    out = _per_document(shard, run, x, dt, gate, bm, cm)  # [B, S, c]
    out = _to_sequence(settings, shard, out.unsqueeze(-1).contiguous()).squeeze(-1)
    return self.out_proj(out.to(dtype))


# ---- MiniMax's lightning attention ------------------------------------------------------------------
def _lightning_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
    """MiniMax's lightning attention (causal linear attention with a per-head decay, computed in
    blocks of ``block_size``) under Ulysses: q | k | v per head (after the projection's
    activation), one all-to-all; the model's blocked recurrence with the rank's heads' decay
    buffers, per document; back; the norm over all heads, the output gate and ``out_proj``
    locally. The blocked form is the same sum at any blocking, so the rank's whole-sequence run
    is one process's."""
    settings, shard = _context(self, kwargs, past_key_values, attention_mask)
    bsz, seq, _ = hidden_states.shape
    d = self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(bsz, seq, self.num_attention_heads, 3 * d)
    (local,) = _to_heads(settings, shard, qkv)  # [B, S, h, 3 D]
    (h0, h1), _, _ = _ranges(settings)
    slope, q_decay, k_decay = self.slope_rate[h0:h1], self.query_decay[h0:h1], self.key_decay[h0:h1]
    diag = self.diagonal_decay[:, h0:h1]  # [1, h, block, block]
    block = self.block_size

    def run(qkv):  # one document [B, L, h, 3 D]: MiniMaxLightningAttention.forward's blocked loop, no cache
        q, k, v = qkv.transpose(1, 2).split(d, dim=-1)  # [B, h, L, D]
        length = q.shape[2]
        state = q.new_zeros(q.shape[0], q.shape[1], d, d)
        outs = []
        for start in range(0, length, block):
            n = min(block, length - start)
            qb, kb, vb = q[:, :, start : start + n], k[:, :, start : start + n], v[:, :, start : start + n]
            intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diag[:, :, :n, :n], vb)
            outs.append(torch.matmul(qb * q_decay[:, :n], state) + intra)
            state = state * torch.exp(-slope * n) + torch.matmul((kb * k_decay[:, -n:]).transpose(-1, -2), vb)
        return torch.cat(outs, dim=-2).transpose(1, 2)  # [B, L, h, D]

    out = _to_sequence(settings, shard, _per_document(shard, run, local).contiguous()).reshape(bsz, seq, -1)
    out = torch.sigmoid(self.output_gate(hidden_states)) * self.norm(out)
    return self.out_proj(out), None


# ---- Zamba's multi-head Mamba1 -----------------------------------------------------------------------
def _zamba_mamba_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Zamba's Mamba mixer under Ulysses: Mamba1 split into ``n_mamba_heads`` heads, each with its
    own ``x_proj`` / ``dt_proj`` over its channels, so (unlike Mamba1's one ``x_proj`` over all
    channels) per head it is a function of the whole sequence: x | the gate per head (``in_proj``
    interleaves them: channel ``c``'s x is row ``2c``, its gate ``2c + 1``), one all-to-all; the
    conv on the rank's channels, the head's ``x_proj``, ``dt_proj`` and ``mamba_selective_scan``
    per document; back; ``out_proj`` locally."""
    settings, shard = _context(self, kwargs, cache_params, attention_mask)
    dtype = hidden_states.dtype
    bsz, seq, _ = hidden_states.shape
    heads, dim = self.n_mamba_heads, self.mamba_head_dim
    (local,) = _to_heads(settings, shard, self.in_proj(hidden_states).reshape(bsz, seq, heads, 2 * dim))
    (h0, h1), _, _ = _ranges(settings)
    total, h = local.shape[1], local.shape[2]
    x, gate = local.reshape(bsz, total, h, dim, 2).unbind(-1)  # [B, S, h, P] each
    x = _conv(self, self.conv1d, torch.arange(h0 * dim, h1 * dim, device=x.device), shard, x.reshape(bsz, total, h * dim), self.activation)
    x = x.reshape(bsz, total, h, dim)
    n, rank = self.ssm_state_size, self.time_step_rank
    a_neg = -torch.exp(self.A_log[h0:h1].float())
    bias = self.dt_proj_bias[h0:h1].float() if self.dt_proj_bias is not None else None
    scan = _kernel(self, "mamba_selective_scan")

    def run(x, gate):  # one document, [B, L, h, P]: ZambaMambaMixer's per-head step
        outs = []
        for i in range(h):
            xi = x[:, :, i].transpose(1, 2)  # [B, P, L]
            time_step, bm, cm = torch.split((self.x_proj_weight[h0 + i] @ xi).transpose(1, 2), [rank, n, n], dim=-1)
            dt = self.dt_proj_weight[h0 + i] @ time_step.transpose(1, 2)
            outs.append(scan(xi, dt, a_neg[i], bm.transpose(1, 2), cm.transpose(1, 2), D=self.D[h0 + i].float(), z=gate[:, :, i].transpose(1, 2),
                             delta_bias=None if bias is None else bias[i], delta_softplus=True, return_last_state=False, use_mambapy=False,
                             use_associative_scan=self.use_associative_scan))  # fmt: skip
        return torch.stack(outs, dim=2).transpose(1, 3)  # [B, L, h, P]

    out = _to_sequence(settings, shard, _per_document(shard, run, x, gate).contiguous())  # [B, s, H, P]
    return self.out_proj(out.reshape(bsz, seq, -1).to(dtype))


# ---- RecurrentGemma's RG-LRU block (Griffin) -------------------------------------------------------
def _rg_lru_forward(self, input_states, position_ids=None, attention_mask=None, use_cache=True, **kwargs):
    """RecurrentGemma's recurrent block (Griffin's conv1d + RG-LRU) under Ulysses. The RG-LRU's
    gates are block-diagonal, one ``lru_width / heads`` block a head, so per head the block is a
    function of the whole sequence: ``linear_x``'s output per head, with each token's reset flag
    (its global position is 0: the model restarts the recurrence there) as one more column, to
    the rank's heads (one all-to-all); the depthwise conv on the rank's channels and the RG-LRU
    with the rank's gate blocks and ``recurrent_param`` slice, per document (from a zero state,
    resets where the model's positions are 0: a packed document's first token); back; times the
    ``linear_y`` branch and ``linear_out`` locally."""
    settings, shard = _context(self, kwargs, True if use_cache else None, None)
    bsz, seq, _ = input_states.shape
    lru = self.rg_lru
    width = lru.block_width
    y = self.act_fn(self.linear_y(input_states))
    if position_ids is None:
        raise HFIntegrationError(f"{type(self).__name__}: called without position_ids (the global positions of the shard's tokens)")
    flag = (position_ids == 0).to(input_states.dtype).expand(bsz, seq)
    x = self.linear_x(input_states).reshape(bsz, seq, lru.num_attention_heads, width)
    (x,) = _to_heads(settings, shard, torch.cat([x, flag[:, :, None, None].expand(bsz, seq, x.shape[2], 1)], -1))
    (h0, h1), _, _ = _ranges(settings)
    total, h = x.shape[1], x.shape[2]
    reset = x[:, :, 0, width] > 0.5  # [B, S]
    x = x[..., :width].reshape(bsz, total, h * width)
    rows = slice(h0 * width, h1 * width)
    conv = self.conv_1d
    weight, bias = conv.weight[rows], None if conv.bias is None else conv.bias[rows]
    sqrt_bound = _kernel(self, "SqrtBoundDerivative").apply
    decay = F.softplus(lru.recurrent_param[rows])

    def gate(act, weight, bias):  # the block-diagonal gate of the rank's heads, per token
        blocks = act.reshape(-1, h, width).permute(1, 0, 2)
        return torch.sigmoid(torch.baddbmm(bias[h0:h1, None, :], blocks, weight[h0:h1]).transpose(0, 1).reshape(act.shape))

    def run(x, reset):  # RecurrentGemmaRecurrentBlock's conv, then RecurrentGemmaRglru.forward (from a zero state)
        length = x.shape[1]
        x = F.conv1d(x.transpose(1, 2), weight, bias, padding=conv.padding[0], groups=h * width)[..., :length].transpose(1, 2)
        reset = reset[:, :, None]
        log_a = -8.0 * gate(x, lru.recurrent_gate_weight, lru.recurrent_gate_bias) * decay
        normalized = x * gate(x, lru.input_gate_weight, lru.input_gate_bias)
        normalized = normalized * (reset + ~reset * sqrt_bound(1 - torch.exp(2 * log_a))).type(x.dtype)
        return lru._rnn_scan(hidden_states=normalized, recurrent_gate=torch.exp(log_a), reset=reset, recurrent_states=None)[0]

    out = _per_document(shard, run, x, reset)
    out = _to_sequence(settings, shard, out.reshape(bsz, total, h, width).contiguous()).reshape(bsz, seq, -1)
    return self.linear_out(out * y), None


# ---- LFM2's short convolution (LFM2, LFM2-MoE, LFM3) ----------------------------------------------
def _short_conv_forward(self, hidden_states, past_key_values=None, attention_mask=None, **kwargs):
    """LFM2's gated short convolution under Ulysses: ``B * x`` to the rank's channels (one
    element per head), the conv per document, back, ``C *`` locally."""
    settings, shard = _context(self, kwargs, past_key_values, attention_mask)
    bmat, cmat, x = self.in_proj(hidden_states).chunk(3, dim=-1)
    (h0, h1), _, _ = _ranges(settings)
    (local,) = _to_heads(settings, shard, (bmat * x).unsqueeze(-1))  # [B, S, c_r, 1]
    channels = torch.arange(h0, h1, device=local.device)
    out = _conv(self, self.conv, channels, shard, local.squeeze(-1), None)
    y = cmat * _to_sequence(settings, shard, out.unsqueeze(-1).contiguous()).squeeze(-1)
    return self.out_proj(y.contiguous())


# class name -> (family, forward, (heads, groups) of a module), for every mixer made exact.
_ADAPTERS: dict[str, tuple[str, Callable, Callable]] = {}


def _register(names, family: str, forward: Callable, sizes: Callable) -> None:
    for name in names:
        _ADAPTERS[name] = (family, forward, sizes)


_gdn_sizes = lambda m: (m.num_v_heads, m.num_k_heads)  # noqa: E731
_register(("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"), "gated-deltanet", _gdn_forward(_gdn_project_qwen3_5), _gdn_sizes)
_register(("Qwen3NextGatedDeltaNet",), "gated-deltanet", _gdn_forward(_gdn_project_qwen3_next), _gdn_sizes)
_register(("OlmoHybridGatedDeltaNet",), "gated-deltanet", _gdn_forward(_gdn_project_olmo_hybrid, "o_norm", "o_proj"), _gdn_sizes)
_register(("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"), "kimi-delta", _kda_forward, lambda m: (m.num_heads, m.num_heads))
# GraniteMoeHybridMambaLayer is BambaMixer's code (transformers' modular file derives it, the
# generated module copies the kernels it calls); Zamba2MambaMixer's torch path is the same
# arithmetic (dt clamped below at time_step_min: its time_step_limit). Their decoder layers pass
# the step's keywords on.
_register(
    ("Mamba2Mixer", "BambaMixer", "NemotronHMamba2Mixer", "FalconH1Mixer", "GraniteMoeHybridMambaLayer", "Zamba2MambaMixer"),
    "mamba2",
    _mamba2_forward,
    lambda m: (m.num_heads, m.n_groups),
)
# Lfm2MoeShortConv and Lfm3ShortConv are Lfm2ShortConv's code (LFM3's conv is 7 wide, torch only).
_register(("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"), "short-conv", _short_conv_forward, lambda m: (m.conv.in_channels, m.conv.in_channels))
_register(("MiniMaxLightningAttention",), "lightning", _lightning_forward, lambda m: (m.num_attention_heads, m.num_attention_heads))
_register(("ZambaMambaMixer",), "zamba-mamba", _zamba_mamba_forward, lambda m: (m.n_mamba_heads, m.n_mamba_heads))
_register(("RecurrentGemmaRecurrentBlock",), "rg-lru", _rg_lru_forward, lambda m: (m.rg_lru.num_attention_heads, m.rg_lru.num_attention_heads))
# Falcon-Mamba's mixer is Jamba's (dt/B/C norms, without weights); Mamba's has no norms.
_register(("JambaMambaMixer", "MambaMixer", "FalconMambaMixer"), "mamba1", _mamba1_forward, lambda m: (m.intermediate_size, 1))
# Mixers that the step's keyword arguments do not reach: Jamba's decoder layer calls its mixer
# without them (``self.mamba(hidden_states=, cache_params=, attention_mask=)``); Mamba's and
# Falcon-Mamba's blocks too, and their model calls the blocks without them; Mamba2's
# ``Mamba2ForCausalLM`` calls its backbone without them. A pre-hook on the mixer's layer hands it
# the shard and group of this call: from the layer's own keywords, else from those of the call to
# the model ``apply`` switched (kept by a pre-hook on it). ``_hand_over``.
_HANDED = {"JambaMambaMixer", "MambaMixer", "FalconMambaMixer", "Mamba2Mixer"}
_LAYER_KWARGS = "_ulysses_layer_kwargs"  # on a mixer: the shard and group handed to it
_PARENT_ATTR = "_ulysses_parent"  # on a mixer: its layer
_HANDS_ATTR = "_ulysses_hands_to"  # on a layer: the mixers its pre-hook hands the keywords to
_STEP_ATTR = "_ulysses_step_kwargs"  # on the model: the shard and group of its current call
_WRAPPED_ATTR = "_ulysses_hands_on_recompute"  # on a layer's checkpoint function: wrapped

_DESCRIBE = {
    "gated-deltanet": "Gated DeltaNet: conv1d + delta-rule recurrence per value head (key heads as GQA groups), over the whole sequence after one all-to-all",
    "kimi-delta": "Kimi Delta Attention: conv1d + delta-rule recurrence with a per-channel forget gate per head, over the whole sequence after one all-to-all",
    "mamba2": "Mamba2: conv1d + SSM chunk scan per head (B/C groups as GQA groups), over the whole sequence after one all-to-all",
    "mamba1": "Mamba1: conv1d over the rank's channels, x_proj per token on sequence shards, the selective scan per channel "
    "(B/C one group) over the whole sequence: three all-to-alls",
    "short-conv": "LFM2 gated short convolution: the depthwise conv over the rank's channels, over the whole sequence after one all-to-all",
    "lightning": "MiniMax's lightning attention: the blocked causal linear attention with a per-head decay, over the whole sequence after one all-to-all",
    "zamba-mamba": "Zamba's multi-head Mamba1: conv1d, each head's x_proj/dt_proj and the selective scan per head, over the whole "
    "sequence after one all-to-all",
    "rg-lru": "RecurrentGemma's recurrent block: the depthwise conv and the RG-LRU per head block (its gates block-diagonal), over the "
    "whole sequence after one all-to-all",
}
HANDLED_MIXERS: dict[str, str] = {name: _DESCRIBE[family] for name, (family, _, _) in _ADAPTERS.items()}


def mixer_modules(model) -> list[torch.nn.Module]:
    """The model's modules whose class ``HANDLED_MIXERS`` names (each of a family whose layer
    drops the step's keywords learns its parent layer, for ``switch_mixers``)."""
    found = []
    for parent in model.modules():
        for child in parent.children():
            if type(child).__name__ in _ADAPTERS:
                found.append(child)
                if type(child).__name__ in _HANDED:
                    object.__setattr__(child, _PARENT_ATTR, parent)
    return found


def plan_mixers(modules, world_size: int) -> list[tuple[torch.nn.Module, HeadPlan]]:
    """Each mixer's head plan over ``world_size`` ranks; a layer whose heads cannot be split
    is refused by name (before ``apply`` changes anything)."""
    plans = []
    for m in modules:
        heads, groups = _ADAPTERS[type(m).__name__][2](m)
        try:
            plans.append((m, HeadPlan.build(heads, groups, world_size)))
        except PlanError as e:
            raise HFIntegrationError(f"apply: {type(m).__name__} ({heads} heads, {groups} groups) cannot be split over {world_size} ranks: {e}") from e
    return plans


def _per_step(forward: Callable) -> Callable:
    """``forward`` for a mixer switched without a group: the step's ``GROUP_KWARG`` gives it;
    a step of one rank (no sequence parallelism in this forward) runs the class's forward."""

    def run(self, *args, **kwargs):
        pair = kwargs.get(GROUP_KWARG)
        if pair is None:
            raise HFIntegrationError(
                f"{type(self).__name__}: switched for sequence parallelism, but this call carries no {GROUP_KWARG!r} "
                "(call the model as a whole: the integration's pre-forward hook supplies it)"
            )
        if pair[1].world_size == 1:
            rest = {k: v for k, v in kwargs.items() if k not in (GROUP_KWARG, _SHARD_KWARG)}
            return type(self).forward(self, *args, **rest)
        return forward(self, *args, **kwargs)

    return run


def switch_mixers(plans, group, comm, root: torch.nn.Module | None = None) -> None:
    """Give each planned mixer its settings and its sequence-parallel forward (on the
    instance). ``comm`` ``None``: the group and communicator come with each step
    (``GROUP_KWARG``, beside the ``SequenceShard``), as verl's switch passes them. ``root``: the
    model the user calls (``apply``'s), whose call's keywords a mixer that does not receive them
    is handed (``_HANDED``)."""
    for m, plan in plans:
        family, forward, _ = _ADAPTERS[type(m).__name__]
        fn = forward if comm is not None else _per_step(forward)
        if type(m).__name__ in _HANDED:
            fn = _hand_over(m, fn, root)
        object.__setattr__(m, _SETTINGS_ATTR, _MixerSettings(group, comm, plan, family))
        object.__setattr__(m, "forward", types.MethodType(fn, m))


_STEP_KEYS = (_SHARD_KWARG, GROUP_KWARG)


def _keep_step(root: torch.nn.Module) -> None:
    """A pre-hook on ``root`` (registered once) keeping the shard and group of each call
    (none: an unsharded call, which the mixers then refuse)."""
    if getattr(root, "_ulysses_keeps_step", False):
        return

    def keep(model, args, kwargs):
        object.__setattr__(model, _STEP_ATTR, {k: kwargs[k] for k in _STEP_KEYS if k in kwargs})

    root.register_forward_pre_hook(keep, with_kwargs=True, prepend=True)
    object.__setattr__(root, "_ulysses_keeps_step", True)


def _hand_over(mixer, forward: Callable, root) -> Callable:
    """``forward`` given the step's shard and group by a pre-hook on the mixer's layer (registered
    once per layer): the layer call's own keywords, else ``root``'s call's (``_keep_step``).

    transformers checkpoints a layer's ``forward`` with its hooks outside the checkpoint, so the
    recompute in the backward runs without the pre-hook: were the mixer to read what the last
    pre-hook handed it, a recompute after another forward (two micro-batches, then one backward)
    would run on the other batch's shard. The layer's ``_gradient_checkpointing_func`` is wrapped
    (at each call, as the model may turn checkpointing on later) so that the function it
    checkpoints, first run and recompute alike, hands the mixers this call's keywords."""
    parent = getattr(mixer, _PARENT_ATTR, None)
    if parent is None:
        raise HFIntegrationError(f"apply: {type(mixer).__name__} was not found inside a layer (its layer passes the step's shard)")
    if root is not None:
        _keep_step(root)
    mixers = getattr(parent, _HANDS_ATTR, None)
    if mixers is None:
        mixers = []

        def hand(layer, args, kwargs):
            picked = {k: kwargs[k] for k in _STEP_KEYS if k in kwargs}
            if _SHARD_KWARG not in picked and root is not None:
                picked = getattr(root, _STEP_ATTR, {})
            for m in mixers:
                object.__setattr__(m, _LAYER_KWARGS, picked)
            _hand_on_recompute(layer, mixers)

        parent.register_forward_pre_hook(hand, with_kwargs=True)
        object.__setattr__(parent, _HANDS_ATTR, mixers)
    if all(m is not mixer for m in mixers):
        mixers.append(mixer)

    def run(self, *args, **kwargs):
        return forward(self, *args, **{**getattr(self, _LAYER_KWARGS, {}), **kwargs})

    return run


def _hand_on_recompute(layer: torch.nn.Module, mixers: list) -> None:
    """Wrap ``layer``'s checkpoint function (when it has one) so that the function it checkpoints
    hands ``mixers`` the keywords they hold now, at the first run and at the recompute."""
    checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
    if checkpoint is None or getattr(checkpoint, _WRAPPED_ATTR, False):
        return

    def checkpointed(function, *args, **kwargs):
        handed = [(m, getattr(m, _LAYER_KWARGS, {})) for m in mixers]

        def with_handed(*a, **k):
            for m, kw in handed:
                object.__setattr__(m, _LAYER_KWARGS, kw)
            return function(*a, **k)

        return checkpoint(with_handed, *args, **kwargs)

    setattr(checkpointed, _WRAPPED_ATTR, True)
    object.__setattr__(layer, "_gradient_checkpointing_func", checkpointed)
