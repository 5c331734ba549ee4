"""Kimi Delta Attention (Kimi-Linear, Bailing Hybrid): GDN with a per-channel forget gate.

Its transformers 5.23 forward under Ulysses, written out step by step around the exchange
(``exchange``; ``layers.mixers``' docstring), and its ``registry`` rows (the end of the file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...state_passing import DELTA
from .exchange import channel_range, depthwise_conv, head_ranges, mixer_context, model_kernel, run_recurrence, to_heads, to_sequence
from .registry import Family, register


def _kda_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Kimi-Linear's delta attention under Ulysses: per head q | k | v | the forget gate's
    pre-activation (``f_b_proj(f_a_proj(h))``, ``D`` each) | b, one all-to-all; the conv, the
    gate's ``dt_bias``/``A_log`` (the rank's slices) and ``chunk_kimi_delta_attention`` per
    document; back; the output gate and norm locally."""
    settings, shard = mixer_context(self, kwargs, cache_params, attention_mask)
    bsz, seq, _ = hidden_states.shape
    d, fg = self.head_dim, self.forget_gate
    bailing = hasattr(fg, "f_proj")  # Bailing Hybrid: one gate projection, its A_log per head, a bounded gate
    per_head = [p(hidden_states).reshape(bsz, seq, -1, d) for p in (self.q_proj, self.k_proj, self.v_proj)]
    pre = fg.f_proj(hidden_states) if bailing else fg.f_b_proj(fg.f_a_proj(hidden_states))
    per_head.append(pre.reshape(bsz, seq, -1, d))
    per_head.append(self.b_proj(hidden_states).unsqueeze(-1))
    (heads,) = to_heads(settings, shard, torch.cat(per_head, -1))
    (h0, h1), _, _ = head_ranges(settings)
    q, k, v, f, b = heads.split([d, d, d, d, 1], dim=-1)
    total, h, dev = q.shape[1], q.shape[2], q.device
    channels = torch.cat([channel_range(h0, h1, d, i * self.qkv_dim, dev) for i in range(3)])
    mixed = depthwise_conv(settings, self, self.conv1d, channels, shard, torch.cat([t.reshape(bsz, total, -1) for t in (q, k, v)], -1), self.activation)
    q, k, v = (t.reshape(bsz, total, h, d) for t in mixed.split([h * d] * 3, dim=-1))
    if bailing:  # BailingHybridForgetGate.forward after its projection, on the rank's channels
        g = f.float() + fg.dt_bias[h0 * d : h1 * d].view(1, 1, h, d)
        decay = fg.A_log[h0:h1].exp().view(1, 1, h, 1)
        g = (fg.lower_bound * torch.sigmoid(decay * g) if fg.safe_gate else -decay * F.softplus(g)).to(hidden_states.dtype)
    else:  # KimiLinearForgetGate.forward after its projections, on the rank's channels.
        g = f.float() + fg.dt_bias[h0 * d : h1 * d].float().view(1, 1, h, d)
        g = -torch.exp(fg.A_log[:, :, h0:h1].float()) * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    beta = b.squeeze(-1).sigmoid()
    rule = model_kernel(self, "chunk_kimi_delta_attention")

    def run(q, k, v, g, beta, initial_state):
        return rule(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    out = to_sequence(settings, shard, run_recurrence(settings, shard, run, DELTA, q, k, v, g, beta).contiguous())
    gate = (self.g_proj(hidden_states) if bailing else self.g_b_proj(self.g_a_proj(hidden_states))).reshape(bsz, seq, -1, d)
    return self.o_proj(self.o_norm(out, gate).reshape(bsz, seq, -1))


FAMILY = Family(
    "kimi-delta", "Kimi Delta Attention: conv1d + delta-rule recurrence with a per-channel forget gate per head, over the whole sequence after one all-to-all"
)
register(("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"), FAMILY, _kda_forward, lambda m: (m.num_heads, m.num_heads))
