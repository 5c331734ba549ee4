"""Bidirectional attention through ``ulysses_attention(causal=False)``: a diffusion-transformer
block (xDiT's main use of Ulysses), which transformers does not have.

The block is DiT's (Peebles & Xie, adaLN-Zero with the gates initialised away from zero so
that every branch gets a gradient): LayerNorm modulated by the conditioning, multi-head
self-attention with no KV grouping and RMS-normalised q and k (as SD3 and Flux do), a
gated residual, a modulated MLP. Two blocks, float64, trained one step over 4 gloo ranks
and over two 2-rank groups side by side (one spawn): the output, the input's gradient and
every parameter gradient (summed over the group) equal one process running SDPA over the
whole sequence; 6 heads over 4 ranks (2, 2, 1, 1), token counts that divide neither 2 nor
4, unchunked and chunked (``chunks=2``), and a longer sequence of 1031 tokens.
Encoders through ``hf.apply`` (BERT, ModernBERT, a ViT tower) are tests/test_hf_models.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ulysses_kernels import ulysses_attention
from ulysses_kernels.layout import split_lengths
from ulysses_kernels.testing import run_ranks

DIM, HEADS, COND = 48, 6, 16  # head_dim 8


class DiTBlock(nn.Module):
    """One DiT block over ``x`` ``[B, S, DIM]`` (S tokens: this rank's under sequence
    parallelism) conditioned on ``c`` ``[B, COND]`` (the timestep/class embedding, the same
    on every rank); ``attend(q, k, v)`` takes and returns ``[B, S, HEADS, DIM // HEADS]``."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.q_norm, self.k_norm = nn.RMSNorm(DIM // HEADS), nn.RMSNorm(DIM // HEADS)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(approximate="tanh"), nn.Linear(2 * DIM, DIM))
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(COND, 6 * DIM))

    def forward(self, x, c, attend):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(c).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(h).unflatten(-1, (3, HEADS, DIM // HEADS)).unbind(2)
        x = x + gate1 * self.proj(attend(self.q_norm(q), self.k_norm(k), v).flatten(2))
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


def build():
    torch.manual_seed(0)
    blocks = nn.ModuleList([DiTBlock(), DiTBlock()]).double()
    with torch.no_grad():
        for p in blocks.parameters():
            if p.dim() == 1:  # biases (and RMSNorm weights): away from their init, so each matters
                p.add_(0.1 * torch.randn_like(p))
    return blocks


def run(blocks, x, c, attend):
    for block in blocks:
        x = block(x, c, attend)
    return x


def full_attention(q, k, v):
    """One process: SDPA over the whole sequence, no mask. ``[B, S, H, D]`` in and out."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def inputs(seq):
    g = torch.Generator().manual_seed(seq)
    x = torch.randn(2, seq, DIM, generator=g, dtype=torch.float64)
    c = torch.randn(2, COND, generator=g, dtype=torch.float64)
    w = torch.randn(2, seq, DIM, generator=g, dtype=torch.float64)  # the loss reads every token
    return x, c, w


def close(a, b, rtol, what):
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


def check_dit(group, seq, chunks):
    """Forward and backward of two blocks against one process, float64 (rtol 1e-12 output
    and input gradient, 1e-9 parameter gradients: sums over tokens in other orders)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    what = f"DiT seq {seq} chunks {chunks} world {world}"
    x, c, w = inputs(seq)
    ref_blocks = build()
    xr = x.clone().requires_grad_()
    ref = run(ref_blocks, xr, c, full_attention)
    ((ref * w).sum() / seq).backward()

    lens = split_lengths(seq, world)
    start = sum(lens[:rank])
    rows = slice(start, start + lens[rank])
    blocks = build()
    xs = x[:, rows].clone().requires_grad_()
    calls = []

    def attend(q, k, v):
        calls.append(tuple(q.shape))
        return ulysses_attention(q, k, v, group, causal=False, seq_lens=lens, chunks=chunks)

    out = run(blocks, xs, c, attend)
    ((out * w[:, rows]).sum() / seq).backward()
    assert calls == [(2, lens[rank], HEADS, DIM // HEADS)] * 2, calls
    # gloo gathers equal sizes: each shard padded to the longest, cut after.
    padded = torch.zeros(2, lens[0], DIM, dtype=out.dtype)
    padded[:, : lens[rank]] = out.detach()
    gathered = [torch.empty_like(padded) for _ in lens]
    dist.all_gather(gathered, padded, group=group)
    close(torch.cat([t[:, :n] for t, n in zip(gathered, lens)], dim=1), ref.detach(), 1e-12, f"{what}: output")
    close(xs.grad, xr.grad[:, rows], 1e-12, f"{what}: input gradient")
    for (name, p), ref_p in zip(blocks.named_parameters(), ref_blocks.parameters()):
        dist.all_reduce(p.grad, group=group)
        close(p.grad, ref_p.grad, 1e-9, f"{what}: grad of {name}")


def job(rank, world):
    import torch.distributed as dist

    pair = [dist.new_group([r, r + 1]) for r in range(0, world, 2)][rank // 2]
    for group in (None, pair):
        for chunks in (1, 2):
            check_dit(group, 37, chunks)
    check_dit(None, 1031, 1)


def test_dit_block_on_gloo():
    run_ranks(job, 4)


def test_bidirectional_differs_from_causal():
    """The blocks' output with causal attention differs far beyond the tolerances: a path that
    applied a causal mask would fail the checks above."""
    x, c, _ = inputs(37)

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)

    with torch.no_grad():
        blocks = build()
        full, masked = run(blocks, x, c, full_attention), run(blocks, x, c, causal)
    assert ((full - masked).abs().max() / full.abs().max()).item() > 1e-3
