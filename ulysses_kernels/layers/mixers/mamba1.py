"""Mamba1: Jamba, Mamba, Falcon-Mamba.

Its transformers 5.23 forward under Ulysses, written out step by step around the exchange
(``exchange``; ``layers.mixers``' docstring), and its ``registry`` rows (the end of the file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...state_passing import run_sharded, selective
from .exchange import depthwise_conv, document_spans, head_ranges, mixer_context, model_kernel, per_document, to_heads, to_sequence
from .registry import Family, register


def _mamba1_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """A Mamba1 mixer under Ulysses (Jamba's, Mamba's, Falcon-Mamba's). Its ``x_proj`` mixes all
    ``I`` channels of a token between the conv and the scan, so one exchange does not cover it:
    the channels (one element a head, as LFM2's) go to the rank's shard for the conv, back to
    sequence shards for ``x_proj`` and the dt/B/C norms (per token, local; Jamba and
    Falcon-Mamba have them, Mamba not), then x | dt | the gate per channel and B | C (one group:
    every rank gets it) to the rank's channels for the scan, and back: three all-to-alls and the
    one back. The model's ``mamba_selective_scan`` per document."""
    settings, shard = mixer_context(self, kwargs, cache_params, attention_mask)
    dtype = hidden_states.dtype
    x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # [B, s, I] each
    (h0, h1), _, _ = head_ranges(settings)
    (local,) = to_heads(settings, shard, x.unsqueeze(-1))  # [B, S, c, 1]
    channels = torch.arange(h0, h1, device=local.device)
    conv = depthwise_conv(settings, self, self.conv1d, channels, shard, local.squeeze(-1), self.activation)  # [B, S, c]
    x = to_sequence(settings, shard, conv.unsqueeze(-1).contiguous()).squeeze(-1)  # [B, s, I]
    n = self.ssm_state_size
    time_step, bm, cm = torch.split(self.x_proj(x), [self.time_step_rank, n, n], dim=-1)
    if hasattr(self, "dt_layernorm"):  # Jamba, Falcon-Mamba
        time_step, bm, cm = self.dt_layernorm(time_step), self.b_layernorm(bm), self.c_layernorm(cm)
    dt = (self.dt_proj.weight @ time_step.transpose(1, 2)).transpose(1, 2)  # [B, s, I]; the scan adds the bias
    heads, groups = to_heads(settings, shard, torch.stack([x, dt, gate], dim=-1), torch.cat([bm, cm], dim=-1).unsqueeze(2))
    x, dt, gate = heads.unbind(-1)  # [B, S, c]
    bm, cm = groups.squeeze(2).split([n, n], dim=-1)  # [B, S, N]
    a_neg = -torch.exp(self.A_log[h0:h1].float())
    bias = self.dt_proj.bias[h0:h1].float() if self.dt_proj.bias is not None else None
    scan = model_kernel(self, "mamba_selective_scan")

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
        out = run_sharded(settings.comm, shard.seq_lens, document_spans(shard), run_from, selective(a_neg, bias), (x, dt, bm, cm))
        out = out * F.silu(gate)
    else:
        out = per_document(shard, run, x, dt, gate, bm, cm)  # [B, S, c]
    out = to_sequence(settings, shard, out.unsqueeze(-1).contiguous()).squeeze(-1)
    return self.out_proj(out.to(dtype))


FAMILY = Family(
    "mamba1",
    "Mamba1: conv1d over the rank's channels, x_proj per token on sequence shards, the selective scan per channel "
    "(B/C one group) over the whole sequence: three all-to-alls",
)
# Falcon-Mamba's mixer is Jamba's (dt/B/C norms, without weights); Mamba's has no norms. Jamba's
# decoder layer calls its mixer without the step's keywords, Mamba's and Falcon-Mamba's blocks too
# (their model calls the blocks without them): handed over by a pre-hook on the layer.
register(("JambaMambaMixer", "MambaMixer", "FalconMambaMixer"), FAMILY, _mamba1_forward, lambda m: (m.intermediate_size, 1), handed=True)
