"""The peers' Ulysses, as a baseline for benchmarks and the copy-count test.

``permute_chain_attention``: Ulysses the way DeepSpeed and yunchang prepare it: for each of
q, k and v a permute + contiguous, an ``all_to_all_single``, a permute + contiguous back,
and the same for the output: three collectives in, one out, two copies around each. It
needs ``heads % world_size == 0`` (KV heads are repeated up to the query heads when they
do not divide, as the peers do). ``chain_seq_to_head``/``chain_head_to_seq`` are its two
data movements, what the all-to-all benchmark times against ours.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .math_attention import default_scale

__all__ = ["permute_chain_attention", "chain_seq_to_head", "chain_head_to_seq"]


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def chain_seq_to_head(x, world, group, all_to_all=_all_to_all):
    # [B, s, H, D] -> [P, s, B, H/P, D] (copy) -> all-to-all -> [B, P*s, H/P, D] (copy)
    # ``all_to_all(send, group)``: the collective (bench.host counts the host work with none).
    b, s, h, d = x.shape
    send = x.reshape(b, s, world, h // world, d).permute(2, 1, 0, 3, 4).contiguous()
    recv = all_to_all(send, group)
    return recv.permute(2, 0, 1, 3, 4).reshape(b, world * s, h // world, d).contiguous()


def chain_head_to_seq(x, world, group, all_to_all=_all_to_all):
    # [B, S, h, D] -> [P, s, B, h, D] (copy) -> all-to-all -> [B, s, P*h, D] (copy)
    b, S, h, d = x.shape
    send = x.reshape(b, world, S // world, h, d).permute(1, 2, 0, 3, 4).contiguous()
    recv = all_to_all(send, group)
    return recv.permute(2, 1, 0, 3, 4).reshape(b, S // world, world * h, d).contiguous()


class _ChainAllToAll(torch.autograd.Function):
    """The peers' autograd all-to-all: the backward runs the opposite chain."""

    @staticmethod
    def forward(ctx, x, to_heads, world, group):
        ctx.to_heads, ctx.world, ctx.group = to_heads, world, group
        return (chain_seq_to_head if to_heads else chain_head_to_seq)(x, world, group)

    @staticmethod
    def backward(ctx, grad):
        return (chain_head_to_seq if ctx.to_heads else chain_seq_to_head)(grad, ctx.world, ctx.group), None, None, None


def permute_chain_attention(q, k, v, group=None, causal=True, softmax_scale=None, attn_fn=None):
    """The peers' Ulysses over equal shards: see the module docstring."""
    world = dist.get_world_size(group)
    hq, hkv = q.shape[2], k.shape[2]
    if hq % world:
        raise ValueError(f"permute_chain_attention: q_heads ({hq}) must be divisible by world_size ({world})")
    if hkv % world:
        k, v = (x.repeat_interleave(hq // hkv, dim=2) for x in (k, v))
    q_l, k_l, v_l = (_ChainAllToAll.apply(x, True, world, group) for x in (q, k, v))
    scale = default_scale(q.shape[3], softmax_scale)
    if attn_fn is None:
        out_l = torch.nn.functional.scaled_dot_product_attention(
            q_l.transpose(1, 2), k_l.transpose(1, 2), v_l.transpose(1, 2),
            is_causal=causal, scale=scale, enable_gqa=q_l.shape[2] != k_l.shape[2],
        ).transpose(1, 2)  # fmt: skip
    else:
        out_l = attn_fn(q_l, k_l, v_l, causal=causal, softmax_scale=scale)
    return _ChainAllToAll.apply(out_l, False, world, group)
