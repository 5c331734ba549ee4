"""LFM2's short convolution (LFM2, LFM2-MoE, LFM3).

Its transformers 5.23 forward under Ulysses, written out step by step around the exchange
(``exchange``; ``layers.mixers``' docstring), and its ``registry`` rows (the end of the file).
"""

from __future__ import annotations

import torch

from .exchange import depthwise_conv, head_ranges, mixer_context, to_heads, to_sequence
from .registry import Family, register


def _short_conv_forward(self, hidden_states, past_key_values=None, attention_mask=None, **kwargs):
    """LFM2's gated short convolution under Ulysses: ``B * x`` to the rank's channels (one
    element per head), the conv per document, back, ``C *`` locally."""
    settings, shard = mixer_context(self, kwargs, past_key_values, attention_mask)
    bmat, cmat, x = self.in_proj(hidden_states).chunk(3, dim=-1)
    (h0, h1), _, _ = head_ranges(settings)
    (local,) = to_heads(settings, shard, (bmat * x).unsqueeze(-1))  # [B, S, c_r, 1]
    channels = torch.arange(h0, h1, device=local.device)
    out = depthwise_conv(settings, self, self.conv, channels, shard, local.squeeze(-1), None)
    y = cmat * to_sequence(settings, shard, out.unsqueeze(-1).contiguous()).squeeze(-1)
    return self.out_proj(y.contiguous())


FAMILY = Family("short-conv", "LFM2 gated short convolution: the depthwise conv over the rank's channels, over the whole sequence after one all-to-all")
# Lfm2MoeShortConv and Lfm3ShortConv are Lfm2ShortConv's code (LFM3's conv is 7 wide, torch only).
register(("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"), FAMILY, _short_conv_forward, lambda m: (m.conv.in_channels, m.conv.in_channels))
