"""Gated DeltaNet: Qwen3.5 (dense and MoE), Qwen3-Next, OLMo Hybrid.

Its transformers 5.23 forward under Ulysses, written out step by step around the exchange
(``exchange``; ``layers.mixers``' docstring), and its ``registry`` rows (the end of the file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...gqa import expand_kv
from ...state_passing import DELTA
from .exchange import channel_range, depthwise_conv, head_ranges, mixer_context, model_kernel, run_recurrence, to_heads, to_sequence
from .registry import Family, register


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
        settings, shard = mixer_context(self, kwargs, cache_params, attention_mask)
        q, k, v, z, b, a = project(self, hidden_states)
        heads, groups = to_heads(settings, shard, torch.cat([v, b.unsqueeze(-1), a.unsqueeze(-1)], -1), torch.cat([q, k], -1))
        (h0, h1), (g0, g1), kv_map = head_ranges(settings)
        dk, dv = self.head_k_dim, self.head_v_dim
        v, b, a = heads.split([dv, 1, 1], dim=-1)
        q, k = groups.split([dk, dk], dim=-1)
        bsz, total, hv, hk = v.shape[0], v.shape[1], v.shape[2], q.shape[2]
        dev = v.device
        # The conv's channels: [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]; the rank's rows of each.
        channels = torch.cat(
            [channel_range(g0, g1, dk, 0, dev), channel_range(g0, g1, dk, self.key_dim, dev), channel_range(h0, h1, dv, 2 * self.key_dim, dev)]
        )
        mixed = torch.cat([q.reshape(bsz, total, -1), k.reshape(bsz, total, -1), v.reshape(bsz, total, -1)], dim=-1)
        mixed = depthwise_conv(settings, self, self.conv1d, channels, shard, mixed, self.activation)
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(bsz, total, hk, dk), k.reshape(bsz, total, hk, dk), v.reshape(bsz, total, hv, dv)
        q, k = expand_kv(q, k, kv_map)  # value head i reads key head kv_map[i] (uniform groups stay grouped)
        beta = b.squeeze(-1).sigmoid()
        if getattr(self, "allow_neg_eigval", False):  # OLMo Hybrid: beta in [0, 2]
            beta = beta * 2.0
        g = -self.A_log[h0:h1].float().exp() * F.softplus(a.squeeze(-1).float() + self.dt_bias[h0:h1])
        rule = model_kernel(self, "torch_chunk_gated_delta_rule")

        def run(q, k, v, g, beta, initial_state):
            return rule(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True)

        out = run_recurrence(settings, shard, run, DELTA, q, k, v, g, beta)
        out = to_sequence(settings, shard, out)  # [B, s, Hv, Dv]
        z_shape = z.shape
        out = getattr(self, norm_attr)(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(z_shape)
        return getattr(self, out_attr)(out.reshape(out.shape[0], out.shape[1], -1))

    return forward


FAMILY = Family(
    "gated-deltanet", "Gated DeltaNet: conv1d + delta-rule recurrence per value head (key heads as GQA groups), over the whole sequence after one all-to-all"
)
_gdn_sizes = lambda m: (m.num_v_heads, m.num_k_heads)  # noqa: E731
register(("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"), FAMILY, _gdn_forward(_gdn_project_qwen3_5), _gdn_sizes)
register(("Qwen3NextGatedDeltaNet",), FAMILY, _gdn_forward(_gdn_project_qwen3_next), _gdn_sizes)
register(("OlmoHybridGatedDeltaNet",), FAMILY, _gdn_forward(_gdn_project_olmo_hybrid, "o_norm", "o_proj"), _gdn_sizes)
