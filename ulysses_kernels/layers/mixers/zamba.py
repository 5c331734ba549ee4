"""Zamba's multi-head Mamba1.

Its transformers 5.23 forward under Ulysses, written out step by step around the exchange
(``exchange``; ``layers.mixers``' docstring), and its ``registry`` rows (the end of the file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...state_passing import run_sharded, selective
from .exchange import depthwise_conv, document_spans, head_ranges, mixer_context, model_kernel, per_document, to_heads, to_sequence
from .registry import Family, register


def _zamba_mamba_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Zamba's Mamba mixer under Ulysses: Mamba1 split into ``n_mamba_heads`` heads, each with its
    own ``x_proj`` / ``dt_proj`` over its channels, so (unlike Mamba1's one ``x_proj`` over all
    channels) per head it is a function of the whole sequence: x | the gate per head (``in_proj``
    interleaves them: channel ``c``'s x is row ``2c``, its gate ``2c + 1``), one all-to-all; the
    conv on the rank's channels, the head's ``x_proj``, ``dt_proj`` and ``mamba_selective_scan``
    per document; back; ``out_proj`` locally."""
    settings, shard = mixer_context(self, kwargs, cache_params, attention_mask)
    dtype = hidden_states.dtype
    bsz, seq, _ = hidden_states.shape
    heads, dim = self.n_mamba_heads, self.mamba_head_dim
    (local,) = to_heads(settings, shard, self.in_proj(hidden_states).reshape(bsz, seq, heads, 2 * dim))
    (h0, h1), _, _ = head_ranges(settings)
    total, h = local.shape[1], local.shape[2]
    x, gate = local.reshape(bsz, total, h, dim, 2).unbind(-1)  # [B, S, h, P] each
    x = depthwise_conv(settings, self, self.conv1d, torch.arange(h0 * dim, h1 * dim, device=x.device), shard, x.reshape(bsz, total, h * dim), self.activation)
    x = x.reshape(bsz, total, h, dim)
    n, rank = self.ssm_state_size, self.time_step_rank
    a_neg = -torch.exp(self.A_log[h0:h1].float())
    bias = self.dt_proj_bias[h0:h1].float() if self.dt_proj_bias is not None else None
    scan = model_kernel(self, "mamba_selective_scan")

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
            y = run_sharded(settings.comm, shard.seq_lens, document_spans(shard), run_from, algebra, (t(xi), t(dt), t(bm), t(cm)))
            outs.append(y * F.silu(gate[:, :, i]))
        out = torch.stack(outs, dim=2)  # [B, s, H, P]
    else:
        out = to_sequence(settings, shard, per_document(shard, run, x, gate).contiguous())  # [B, s, H, P]
    return self.out_proj(out.reshape(bsz, seq, -1).to(dtype))


FAMILY = Family(
    "zamba-mamba", "Zamba's multi-head Mamba1: conv1d, each head's x_proj/dt_proj and the selective scan per head, over the whole sequence after one all-to-all"
)
register(("ZambaMambaMixer",), FAMILY, _zamba_mamba_forward, lambda m: (m.n_mamba_heads, m.n_mamba_heads))
