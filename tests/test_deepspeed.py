"""The DeepSpeed drop-in ``integrations.deepspeed.DistributedAttention``.

* exact (no DeepSpeed needed): at 4 gloo ranks, float64, both layouts, against the float64
  attention of one process over the whole sequence, forward and q/k/v gradients, including
  head layouts DeepSpeed cannot run (6/2 heads over 4 ranks hung, 4/1 and 8/2 assert: fewer
  KV heads than ranks; 10/5 gives ranks whose query heads straddle KV groups), a local
  attention that flattens its heads (Megatron's core attention), sub-groups of 2 ranks, and
  the argument errors;
* equal to DeepSpeed's own module where DeepSpeed works (skips without DeepSpeed).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ulysses_kernels.integrations.deepspeed import DeepSpeedIntegrationError, DistributedAttention
from ulysses_kernels.reference import attention_reference
from ulysses_kernels.testing import run_ranks

B, S, D = 2, 12, 8  # S divides 2 and 4 ranks (DeepSpeed needs equal shards)
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def sdpa_local(seq_dim: int, flat: bool = False):
    """A user's local attention in the caller's layout (``seq_dim`` 0: [S, b, h, d])."""

    def local(q, k, v, scale=None):
        q, k, v = (t.transpose(0, 1) if seq_dim == 0 else t for t in (q, k, v))  # [b, S, h, d]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
        ).transpose(1, 2)
        out = out.transpose(0, 1) if seq_dim == 0 else out
        return out.flatten(2) if flat else out

    return local


def global_qkv(hq: int, hkv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv)]


def local_shard(x: torch.Tensor, rank: int, world: int, seq_dim: int) -> torch.Tensor:
    n = S // world
    shard = x[:, rank * n : (rank + 1) * n]
    shard = shard.transpose(0, 1) if seq_dim == 0 else shard
    return shard.contiguous().requires_grad_()


def run_case(layer, hq, hkv, seq_dim, rank, world, seed, ds_kwargs, flat=False):
    """``(out, dq, dk, dv)`` of this rank, and the same rows of the one-process reference."""
    q, k, v = global_qkv(hq, hkv, seed)
    gout = torch.randn(B, S, hq, D, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    g = hq // hkv
    ref = attention_reference(ref_in[0], ref_in[1].repeat_interleave(g, 2), ref_in[2].repeat_interleave(g, 2))
    ref.backward(gout)
    shards = [local_shard(t, rank, world, seq_dim) for t in (q, k, v)]
    out = layer(*shards, **ds_kwargs)
    gshard = local_shard(gout, rank, world, seq_dim).detach()
    (out.unflatten(2, (hq, D)) if flat else out).backward(gshard)
    want = [local_shard(t, rank, world, seq_dim).detach() for t in (ref, ref_in[0].grad, ref_in[1].grad, ref_in[2].grad)]
    got = [out.detach().unflatten(2, (hq, D)) if flat else out.detach()] + [t.grad for t in shards]
    return got, want


# (q heads, kv heads): DeepSpeed runs the first two at 4 ranks; the others it cannot.
DS_HEADS = [(8, 4), (8, 8)]
EXACT_HEADS = [(8, 4), (6, 2), (4, 1), (8, 2), (10, 5)]
LAYOUTS = [  # (constructor gather_idx, forward batch_dim_idx, sequence dimension)
    (0, 1, 0),  # Megatron-DeepSpeed [s, b, h, d]
    (0, None, 0),  # DeepSpeed's default constructor, no batch_dim_idx: [s, b, h, d]
    (1, 0, 1),  # [b, s, h, d]
    (0, 0, 1),  # batch_dim_idx decides, as in DeepSpeed
]


def _exact(rank, world):
    sub = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    seed = 0
    for group, sp in ((None, world), (sub, 2)):
        sp_rank = dist.get_rank(group)
        for hq, hkv in EXACT_HEADS:
            for gather_idx, batch_dim_idx, seq_dim in LAYOUTS:
                for flat in (False, True):
                    seed += 1
                    layer = DistributedAttention(sdpa_local(seq_dim, flat), group, gather_idx=gather_idx)
                    kw = {} if batch_dim_idx is None else {"batch_dim_idx": batch_dim_idx}
                    got, want = run_case(layer, hq, hkv, seq_dim, sp_rank, sp, seed, kw, flat)
                    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name} {hq}/{hkv} sp={sp} layout={seq_dim} flat={flat}: {m}")  # noqa: B023
    # extra arguments reach the local attention (here the softmax scale, positionally)
    layer = DistributedAttention(sdpa_local(1), None)
    q, k, v = (local_shard(t, rank, world, 1) for t in global_qkv(8, 4, 99))
    a = layer(q, k, v, 0, None, 0.5)
    b = layer(q, k, v, 0, None, scale=0.5)
    c = layer(q, k, v, 0)
    assert torch.equal(a, b) and not torch.allclose(a, c)
    # errors
    for ctor, needle in (({"scatter_idx": 1}, "scatter_idx expected 2"), ({"gather_idx": 2}, "gather_idx expected 0"),
                         ({"check": "sometimes"}, "check expected")):  # fmt: skip
        with pytest.raises(DeepSpeedIntegrationError, match=needle):
            DistributedAttention(sdpa_local(1), None, **ctor)
    with pytest.raises(DeepSpeedIntegrationError, match="batch_dim_idx expected"):
        layer(q, k, v, 2)
    with pytest.raises(DeepSpeedIntegrationError, match=r"num_kv_heads \(2\) expected to equal key's head count \(4\)"):
        DistributedAttention(sdpa_local(1), None, num_kv_heads=2)(q, k, v, 0)
    with pytest.raises(DeepSpeedIntegrationError, match="the local attention returned shape"):
        DistributedAttention(lambda q, k, v: q[:, :3], None)(q, k, v, 0)


def test_exact_any_heads_both_layouts():
    run_ranks(_exact, 4)


def _vs_deepspeed(rank, world):
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention as DeepSpeedAttention

    deepspeed.init_distributed(dist_backend="gloo")
    seed = 1000
    for hq, hkv in DS_HEADS:
        for gather_idx, batch_dim_idx, seq_dim in LAYOUTS:
            seed += 1
            bdi = 1 - gather_idx if batch_dim_idx is None else batch_dim_idx  # DeepSpeed requires it
            ours = DistributedAttention(sdpa_local(seq_dim), None, gather_idx=gather_idx)
            theirs = DeepSpeedAttention(sdpa_local(seq_dim), dist.group.WORLD, gather_idx=gather_idx)
            kw = {} if batch_dim_idx is None else {"batch_dim_idx": batch_dim_idx}
            got, _ = run_case(ours, hq, hkv, seq_dim, rank, world, seed, kw)
            want, _ = run_case(theirs, hq, hkv, seq_dim, rank, world, seed, {"batch_dim_idx": bdi})
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, msg=lambda m: f"{name} {hq}/{hkv} layout={seq_dim}: {m}")  # noqa: B023
    # rotary_pos_emb as DeepSpeed applies it: (cos, sin) [b or 1, S, 1, rot] permuted to [S, b, 1, rot]
    g = torch.Generator().manual_seed(7)
    angles = torch.randn(1, S, 1, D // 2, generator=g, dtype=torch.float64)
    rope = (torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    ours = DistributedAttention(sdpa_local(0), None)
    theirs = DeepSpeedAttention(sdpa_local(0), dist.group.WORLD)
    got, _ = run_case(ours, 8, 4, 0, rank, world, 5, {"batch_dim_idx": 1, "rotary_pos_emb": rope})
    want, _ = run_case(theirs, 8, 4, 0, rank, world, 5, {"batch_dim_idx": 1, "rotary_pos_emb": rope})
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (CI installs it: ULYSSES_KERNELS_PEERS=1)")
def test_equals_deepspeed_where_it_runs():
    run_ranks(_vs_deepspeed, 4)
