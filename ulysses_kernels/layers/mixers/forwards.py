"""Each hybrid family's token mixer under Ulysses (``mixers``' module docstring): its
transformers 5.23 forward written out step by step around the exchange (``mixer_exchange``),
with the module's own submodules, parameters (sliced to the rank's heads) and kernel functions.
``mixers`` registers each one for the classes it runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...gqa import expand_kv
from ...state_passing import DELTA, DIAGONAL, SSD, run_sharded, selective
from ..step import HFIntegrationError
from .exchange import (
    _arange,
    _context,
    _conv,
    _kernel,
    _per_document,
    _ranges,
    _recurrence,
    _spans,
    _to_heads,
    _to_sequence,
    _windowed,
)


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
        mixed = _conv(settings, self, self.conv1d, channels, shard, mixed, self.activation)
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(bsz, total, hk, dk), k.reshape(bsz, total, hk, dk), v.reshape(bsz, total, hv, dv)
        q, k = expand_kv(q, k, kv_map)  # value head i reads key head kv_map[i] (uniform groups stay grouped)
        beta = b.squeeze(-1).sigmoid()
        if getattr(self, "allow_neg_eigval", False):  # OLMo Hybrid: beta in [0, 2]
            beta = beta * 2.0
        g = -self.A_log[h0:h1].float().exp() * F.softplus(a.squeeze(-1).float() + self.dt_bias[h0:h1])
        rule = _kernel(self, "torch_chunk_gated_delta_rule")

        def run(q, k, v, g, beta, initial_state):
            return rule(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True)

        out = _recurrence(settings, shard, run, DELTA, q, k, v, g, beta)
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
    mixed = _conv(settings, self, self.conv1d, channels, shard, torch.cat([t.reshape(bsz, total, -1) for t in (q, k, v)], -1), self.activation)
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

    def run(q, k, v, g, beta, initial_state):
        return rule(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    out = _to_sequence(settings, shard, _recurrence(settings, shard, run, DELTA, q, k, v, g, beta).contiguous())
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
    mixed = _conv(settings, self, self.conv1d, channels, shard, mixed, self.activation)
    x, bm, cm = torch.split(mixed, [h * p, g * n, g * n], dim=-1)
    x, bm, cm = x.reshape(bsz, total, h, p), bm.reshape(bsz, total, g, n), cm.reshape(bsz, total, g, n)
    bm, cm = expand_kv(bm, cm, kv_map)  # head i reads group kv_map[i]
    a_neg = -torch.exp(self.A_log[h0:h1].float())
    scan = _kernel(self, "mamba2_chunk_scan")

    def run(x, dt, bm, cm, initial_states):
        return scan(x, dt, a_neg, bm, cm, chunk_size=self.chunk_size, D=self.D[h0:h1], z=None, dt_bias=self.dt_bias[h0:h1],
                    dt_softplus=True, initial_states=initial_states, dt_limit=self.time_step_limit, return_final_states=True)  # fmt: skip

    out = _recurrence(settings, shard, run, SSD, x, dt.squeeze(-1), bm, cm)
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
    conv = _conv(settings, self, self.conv1d, channels, shard, local.squeeze(-1), self.activation)  # [B, S, c]
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

    t = lambda v: v.transpose(1, 2)  # noqa: E731 - the kernel's [B, channels, S] layout

    def scan_on(x, dt, bm, cm, z, last):  # the model's scan on [B, L, c] inputs (z: the gate, or None)
        return scan(t(x), t(dt), a_neg, t(bm), t(cm), D=self.D[h0:h1].float(), z=z if z is None else t(z), delta_bias=bias, delta_softplus=True,
                    return_last_state=last, use_mambapy=self.use_mambapy, use_associative_scan=self.use_associative_scan)  # fmt: skip

    def run(x, dt, gate, bm, cm):
        return t(scan_on(x, dt, bm, cm, gate, False))

    def run_from(x, dt, bm, cm, initial_state):  # state passing: no gate (after the correction); the kernel starts from zero
        y, last = scan_on(x, dt, bm, cm, None, True)
        return t(y), last

    if settings.state:  # [B, s, I] each: the scan's state passed between ranks, then the gate
        out = run_sharded(settings.comm, shard.seq_lens, _spans(shard), run_from, selective(a_neg, bias), (x, dt, bm, cm))
        out = out * F.silu(gate)
    else:
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

    def run(q, k, v, initial_state):  # one document [B, L, h, D] each: MiniMaxLightningAttention.forward's blocked loop
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, h, L, D]
        length = q.shape[2]
        state = q.new_zeros(q.shape[0], q.shape[1], d, v.shape[-1]) if initial_state is None else initial_state
        outs = []
        for start in range(0, length, block):
            n = min(block, length - start)
            qb, kb, vb = q[:, :, start : start + n], k[:, :, start : start + n], v[:, :, start : start + n]
            intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diag[:, :, :n, :n], vb)
            outs.append(torch.matmul(qb * q_decay[:, :n], state) + intra)
            state = state * torch.exp(-slope * n) + torch.matmul((kb * k_decay[:, -n:]).transpose(-1, -2), vb)
        return torch.cat(outs, dim=-2).transpose(1, 2), state  # [B, L, h, D], [B, h, D, D]

    q, k, v = local.split(d, dim=-1)
    out = _to_sequence(settings, shard, _recurrence(settings, shard, run, DELTA, q, k, v).contiguous()).reshape(bsz, seq, -1)
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
    x = _conv(settings, self, self.conv1d, torch.arange(h0 * dim, h1 * dim, device=x.device), shard, x.reshape(bsz, total, h * dim), self.activation)
    x = x.reshape(bsz, total, h, dim)
    n, rank = self.ssm_state_size, self.time_step_rank
    a_neg = -torch.exp(self.A_log[h0:h1].float())
    bias = self.dt_proj_bias[h0:h1].float() if self.dt_proj_bias is not None else None
    scan = _kernel(self, "mamba_selective_scan")

    def projected(xi, i):  # head i's x_proj and dt_proj per token: [B, P, L] -> dt [B, P, L], B, C [B, N, L]
        time_step, bm, cm = torch.split((self.x_proj_weight[h0 + i] @ xi).transpose(1, 2), [rank, n, n], dim=-1)
        return self.dt_proj_weight[h0 + i] @ time_step.transpose(1, 2), bm.transpose(1, 2), cm.transpose(1, 2)

    def head_scan(i, xi, dt, bm, cm, z, last):
        return scan(xi, dt, a_neg[i], bm, cm, D=self.D[h0 + i].float(), z=z, delta_bias=None if bias is None else bias[i], delta_softplus=True,
                    return_last_state=last, use_mambapy=False, use_associative_scan=self.use_associative_scan)  # fmt: skip

    def run(x, gate):  # one document, [B, L, h, P]: ZambaMambaMixer's per-head step
        outs = []
        for i in range(h):
            xi = x[:, :, i].transpose(1, 2)  # [B, P, L]
            outs.append(head_scan(i, xi, *projected(xi, i), gate[:, :, i].transpose(1, 2), False))
        return torch.stack(outs, dim=2).transpose(1, 3)  # [B, L, h, P]

    if settings.state:  # per head, Mamba1's state passing (state_passing.selective), then the gate
        t = lambda v: v.transpose(1, 2)  # noqa: E731
        outs = []
        for i in range(h):
            xi = x[:, :, i].transpose(1, 2)
            dt, bm, cm = projected(xi, i)

            def run_from(x, dt, bm, cm, initial_state, i=i):  # [B, L, P] / [B, L, N]; the kernel starts from zero
                y, last = head_scan(i, t(x), t(dt), t(bm), t(cm), None, True)
                return t(y), last

            algebra = selective(a_neg[i], None if bias is None else bias[i])
            y = run_sharded(settings.comm, shard.seq_lens, _spans(shard), run_from, algebra, (t(xi), t(dt), t(bm), t(cm)))
            outs.append(y * F.silu(gate[:, :, i]))
        out = torch.stack(outs, dim=2)  # [B, s, H, P]
    else:
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

    def causal_conv(x):  # RecurrentGemmaRecurrentBlock's conv on the rank's channels
        return F.conv1d(x.transpose(1, 2), weight, bias, padding=conv.padding[0], groups=h * width)[..., : x.shape[1]].transpose(1, 2)

    def gates(x, reset):  # RecurrentGemmaRglru.forward up to its scan: the input and the recurrence gate per token
        log_a = -8.0 * gate(x, lru.recurrent_gate_weight, lru.recurrent_gate_bias) * decay
        normalized = x * gate(x, lru.input_gate_weight, lru.input_gate_bias)
        return normalized * (reset + ~reset * sqrt_bound(1 - torch.exp(2 * log_a))).type(x.dtype), torch.exp(log_a)

    def run(x, reset):  # one document: the conv, then RecurrentGemmaRglru.forward (from a zero state)
        reset = reset[:, :, None]
        normalized, a = gates(causal_conv(x), reset)
        return lru._rnn_scan(hidden_states=normalized, recurrent_gate=a, reset=reset, recurrent_states=None)[0]

    def scan(normalized, a, reset, initial_state):
        return lru._rnn_scan(hidden_states=normalized, recurrent_gate=a, reset=reset, recurrent_states=initial_state)

    if settings.state:  # the conv's halo and the recurrence's state from the ranks before
        reset = reset[:, :, None]
        normalized, a = gates(_windowed(settings, shard, x, causal_conv, weight.shape[-1] - 1), reset)
        out = run_sharded(settings.comm, shard.seq_lens, _spans(shard), scan, DIAGONAL, (normalized, a, reset))
    else:
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
    out = _conv(settings, self, self.conv, channels, shard, local.squeeze(-1), None)
    y = cmat * _to_sequence(settings, shard, out.unsqueeze(-1).contiguous()).squeeze(-1)
    return self.out_proj(y.contiguous())
