"""RecurrentGemma's RG-LRU block (Griffin).

Its transformers 5.23 forward under Ulysses, written out step by step around the exchange
(``exchange``; ``layers.mixers``' docstring), and its ``registry`` rows (the end of the file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...state_passing import DIAGONAL, run_sharded
from ..step import HFIntegrationError
from .exchange import document_spans, head_ranges, mixer_context, model_kernel, per_document, to_heads, to_sequence, windowed
from .registry import Family, register


def _rg_lru_forward(self, input_states, position_ids=None, attention_mask=None, use_cache=True, **kwargs):
    """RecurrentGemma's recurrent block (Griffin's conv1d + RG-LRU) under Ulysses. The RG-LRU's
    gates are block-diagonal, one ``lru_width / heads`` block a head, so per head the block is a
    function of the whole sequence: ``linear_x``'s output per head, with each token's reset flag
    (its global position is 0: the model restarts the recurrence there) as one more column, to
    the rank's heads (one all-to-all); the depthwise conv on the rank's channels and the RG-LRU
    with the rank's gate blocks and ``recurrent_param`` slice, per document (from a zero state,
    resets where the model's positions are 0: a packed document's first token); back; times the
    ``linear_y`` branch and ``linear_out`` locally."""
    settings, shard = mixer_context(self, kwargs, True if use_cache else None, None)
    bsz, seq, _ = input_states.shape
    lru = self.rg_lru
    width = lru.block_width
    y = self.act_fn(self.linear_y(input_states))
    if position_ids is None:
        raise HFIntegrationError(f"{type(self).__name__}: called without position_ids (the global positions of the shard's tokens)")
    flag = (position_ids == 0).to(input_states.dtype).expand(bsz, seq)
    x = self.linear_x(input_states).reshape(bsz, seq, lru.num_attention_heads, width)
    (x,) = to_heads(settings, shard, torch.cat([x, flag[:, :, None, None].expand(bsz, seq, x.shape[2], 1)], -1))
    (h0, h1), _, _ = head_ranges(settings)
    total, h = x.shape[1], x.shape[2]
    reset = x[:, :, 0, width] > 0.5  # [B, S]
    x = x[..., :width].reshape(bsz, total, h * width)
    rows = slice(h0 * width, h1 * width)
    conv = self.conv_1d
    weight, bias = conv.weight[rows], None if conv.bias is None else conv.bias[rows]
    sqrt_bound = model_kernel(self, "SqrtBoundDerivative").apply
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
        normalized, a = gates(windowed(settings, shard, x, causal_conv, weight.shape[-1] - 1), reset)
        out = run_sharded(settings.comm, shard.seq_lens, document_spans(shard), scan, DIAGONAL, (normalized, a, reset))
    else:
        out = per_document(shard, run, x, reset)
    out = to_sequence(settings, shard, out.reshape(bsz, total, h, width).contiguous()).reshape(bsz, seq, -1)
    return self.linear_out(out * y), None


FAMILY = Family(
    "rg-lru",
    "RecurrentGemma's recurrent block: the depthwise conv and the RG-LRU per head block (its gates block-diagonal), over the "
    "whole sequence after one all-to-all",
)
register(("RecurrentGemmaRecurrentBlock",), FAMILY, _rg_lru_forward, lambda m: (m.rg_lru.num_attention_heads, m.rg_lru.num_attention_heads))
