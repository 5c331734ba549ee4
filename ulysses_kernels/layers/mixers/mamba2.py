"""Mamba2: Mamba2, Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid, Zamba2.

Its transformers 5.23 forward under Ulysses, written out step by step around the exchange
(``exchange``; ``layers.mixers``' docstring), and its ``registry`` rows (the end of the file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...gqa import expand_kv
from ...state_passing import SSD
from .exchange import channel_range, depthwise_conv, head_ranges, mixer_context, model_kernel, run_recurrence, to_heads, to_sequence
from .registry import Family, register


def _mamba2_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """A Mamba2 mixer under Ulysses (the module docstring); transformers 5.23's chunked torch
    path step by step (the fused ``mamba2_split_conv1d_scan_combined`` of mamba_ssm is the
    same computation with the projections inside; its pieces run here instead)."""
    settings, shard = mixer_context(self, kwargs, cache_params, attention_mask)
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
    heads, groups = to_heads(settings, shard, heads, groups)
    (h0, h1), (g0, g1), kv_map = head_ranges(settings)
    p, n = self.head_dim, self.ssm_state_size
    x, dt = heads.split([p, 1], dim=-1)
    bm, cm = groups.split([n, n], dim=-1)
    total, h, g = x.shape[1], x.shape[2], bm.shape[2]
    dev = x.device
    # The conv's channels: [x (H*P) | B (G*N) | C (G*N)]; the rank's rows of each.
    inner = self.intermediate_size
    channels = torch.cat([channel_range(h0, h1, p, 0, dev), channel_range(g0, g1, n, inner, dev), channel_range(g0, g1, n, inner + gn, dev)])
    mixed = torch.cat([x.reshape(bsz, total, -1), bm.reshape(bsz, total, -1), cm.reshape(bsz, total, -1)], dim=-1)
    mixed = depthwise_conv(settings, self, self.conv1d, channels, shard, mixed, self.activation)
    x, bm, cm = torch.split(mixed, [h * p, g * n, g * n], dim=-1)
    x, bm, cm = x.reshape(bsz, total, h, p), bm.reshape(bsz, total, g, n), cm.reshape(bsz, total, g, n)
    bm, cm = expand_kv(bm, cm, kv_map)  # head i reads group kv_map[i]
    a_neg = -torch.exp(self.A_log[h0:h1].float())
    scan = model_kernel(self, "mamba2_chunk_scan")

    def run(x, dt, bm, cm, initial_states):
        return scan(x, dt, a_neg, bm, cm, chunk_size=self.chunk_size, D=self.D[h0:h1], z=None, dt_bias=self.dt_bias[h0:h1],
                    dt_softplus=True, initial_states=initial_states, dt_limit=self.time_step_limit, return_final_states=True)  # fmt: skip

    out = run_recurrence(settings, shard, run, SSD, x, dt.squeeze(-1), bm, cm)
    out = to_sequence(settings, shard, out.contiguous()).reshape(bsz, seq, -1)
    if not falcon or self.mamba_rms_norm:
        out = self.norm(out, gate)
    else:
        out = out * F.silu(gate)
    return self.out_proj(out.to(dtype))


FAMILY = Family("mamba2", "Mamba2: conv1d + SSM chunk scan per head (B/C groups as GQA groups), over the whole sequence after one all-to-all")
# GraniteMoeHybridMambaLayer is BambaMixer's code (transformers' modular file derives it, the
# generated module copies the kernels it calls); Zamba2MambaMixer's torch path is the same
# arithmetic (dt clamped below at time_step_min: its time_step_limit). Their decoder layers pass
# the step's keywords on; Mamba2's ``Mamba2ForCausalLM`` calls its backbone without them (handed).
register(("BambaMixer", "NemotronHMamba2Mixer", "FalconH1Mixer", "GraniteMoeHybridMambaLayer", "Zamba2MambaMixer"), FAMILY, _mamba2_forward,
         lambda m: (m.num_heads, m.n_groups))  # fmt: skip
register(("Mamba2Mixer",), FAMILY, _mamba2_forward, lambda m: (m.num_heads, m.n_groups), handed=True)
