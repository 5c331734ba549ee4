"""MiniMax's lightning attention.

Its transformers 5.23 forward under Ulysses, written out step by step around the exchange
(``exchange``; ``layers.mixers``' docstring), and its ``registry`` rows (the end of the file).
"""

from __future__ import annotations

import torch

from ...state_passing import DELTA
from .exchange import head_ranges, mixer_context, run_recurrence, to_heads, to_sequence
from .registry import Family, register


def _lightning_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
    """MiniMax's lightning attention (causal linear attention with a per-head decay, computed in
    blocks of ``block_size``) under Ulysses: q | k | v per head (after the projection's
    activation), one all-to-all; the model's blocked recurrence with the rank's heads' decay
    buffers, per document; back; the norm over all heads, the output gate and ``out_proj``
    locally. The blocked form is the same sum at any blocking, so the rank's whole-sequence run
    is one process's."""
    settings, shard = mixer_context(self, kwargs, past_key_values, attention_mask)
    bsz, seq, _ = hidden_states.shape
    d = self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(bsz, seq, self.num_attention_heads, 3 * d)
    (local,) = to_heads(settings, shard, qkv)  # [B, S, h, 3 D]
    (h0, h1), _, _ = head_ranges(settings)
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
    out = to_sequence(settings, shard, run_recurrence(settings, shard, run, DELTA, q, k, v).contiguous()).reshape(bsz, seq, -1)
    out = torch.sigmoid(self.output_gate(hidden_states)) * self.norm(out)
    return self.out_proj(out), None


FAMILY = Family(
    "lightning", "MiniMax's lightning attention: the blocked causal linear attention with a per-head decay, over the whole sequence after one all-to-all"
)
register(("MiniMaxLightningAttention",), FAMILY, _lightning_forward, lambda m: (m.num_attention_heads, m.num_attention_heads))
