"""Cases and helpers shared by the "cuda" kernel set's tests (test_cuda_kernels.py on the CPU
twin, test_cuda_kernels_gpu.py on a GPU): plans of every world size 1..8, inputs of three
memory layouts, and both sides of each comparison against the reference."""

import pytest
import torch

from ulysses_kernels.kernels import torch_kernels as L
from ulysses_kernels.layout import QKV, Layout
from ulysses_kernels.plan import HeadPlan

FILL = 1234.5  # initial value of every output, so bytes a kernel forgets are caught

# (q_heads, kv_heads, world_size, batch, head_dim, dtype): every world size 1..8.
PLANS = [
    (8, 2, 1, 2, 16, torch.float32),
    (4, 1, 2, 3, 8, torch.bfloat16),  # MQA
    (40, 8, 3, 2, 16, torch.float16),  # uneven heads
    (10, 2, 4, 2, 8, torch.float32),
    (40, 8, 5, 1, 8, torch.bfloat16),
    (12, 3, 6, 2, 6, torch.float16),  # head_dim 6: 4-byte units in fp16
    (14, 14, 7, 1, 4, torch.float32),  # MHA
    (40, 8, 8, 2, 8, torch.float16),
    (8, 1, 8, 2, 8, torch.float32),  # MQA, one KV head on 8 ranks
    (6, 6, 4, 2, 5, torch.float64),  # MHA, uneven heads, odd head_dim
]


def seq_lens(world):
    return tuple(1 + (3 * r + 1) % 4 for r in range(world))  # uneven, e.g. (2, 1, 4, 3, ...)


def _cases():
    for hq, hkv, world, batch, d, dtype in PLANS:
        plan = HeadPlan.build(hq, hkv, world)
        for rank in range(world):
            yield pytest.param(plan, rank, batch, d, dtype, id=f"{hq}/{hkv}-P{world}-r{rank}-B{batch}-D{d}-{str(dtype)[6:]}")


CASES = list(_cases())


def layout_of(plan, rank, batch, d):
    return Layout(plan, rank, seq_lens(plan.world_size), batch, d)


def qkv(lay, dtype, device, kind):
    """q, k, v ``[B, s_r, H, D]``: contiguous, fused-QKV views, or other strided views."""
    B, s, D = lay.batch, lay.seq_local, lay.head_dim
    hq, hkv = lay.plan.q_heads, lay.plan.kv_heads
    g = torch.Generator().manual_seed(hq * 1000 + lay.rank * 10 + B)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
    if kind == "fused":
        x = rnd(B, s, (hq + 2 * hkv) * D)
        q, k, v = x.split([hq * D, hkv * D, hkv * D], dim=-1)
        return q.unflatten(-1, (hq, D)), k.unflatten(-1, (hkv, D)), v.unflatten(-1, (hkv, D))
    if kind == "strided":
        q = rnd(s, B, hq, D).transpose(0, 1)  # seq-major memory
        k = rnd(B, s, hkv, 2 * D)[..., ::2]  # head_dim stride 2
        v = rnd(B, hkv, s, D).transpose(1, 2)  # head-major memory
        return q, k, v
    return rnd(B, s, hq, D), rnd(B, s, hkv, D), rnd(B, s, hkv, D)


def pack_both(lay, tensors, roles, kernels, with_recv):
    dtype, device = tensors[0].dtype, tensors[0].device
    n = sum(lay.s2h_send_splits(roles, own=not with_recv))  # with recv: the peers' blocks only
    sends = [torch.full((n,), FILL, dtype=dtype, device=device) for _ in range(2)]
    recvs = [torch.full((sum(lay.s2h_recv_splits(roles)),), FILL, dtype=dtype, device=device) for _ in range(2)]
    L.pack_s2h(lay, tensors, roles, sends[0], **({"recv": recvs[0]} if with_recv else {}))
    kernels.pack_s2h(lay, tensors, roles, sends[1], **({"recv": recvs[1]} if with_recv else {}))
    return sends, recvs


def blocks_of(lay, roles, dtype, device, seed):
    """What unpack reads: the received blocks (strided views of a receive buffer) and, for
    this rank, its own rows of local ``[B, S, h, D]`` tensors (batch-strided views)."""
    g = torch.Generator().manual_seed(seed)
    recv = torch.randn(sum(lay.h2s_splits(roles)[1]), generator=g).to(dtype).to(device)
    blocks = lay.h2s_recv_views(recv, roles)
    local = [torch.randn(lay.batch, lay.seq_total, lay.head_count(s, lay.rank), lay.head_dim, generator=g).to(dtype).to(device) for s in roles]
    blocks[lay.rank] = [lay.h2s_send_blocks(x, lay.rank) for x in local]
    return blocks


def outs_of(lay, roles, dtype, device):
    return [torch.full((lay.batch, lay.seq_local, lay.total_heads(s), lay.head_dim), FILL, dtype=dtype, device=device) for s in roles]


def check_chunks(kernels, device):
    """Head chunks (the pipelined path's plans): the unpack visits only the heads its sources
    hold, so the others keep their value; every chunk and rank against the reference."""
    from ulysses_kernels.attention.chunked import chunk_plans

    for hq, hkv, world, chunks, dtype in ((40, 8, 3, 3, torch.float16), (12, 2, 4, 4, torch.bfloat16), (8, 1, 3, 2, torch.float32)):
        plans = chunk_plans(HeadPlan.build(hq, hkv, world), chunks)
        assert len(plans) >= 2
        for c, cp in enumerate(plans):
            for rank in range(world):
                lay = Layout(cp, rank, seq_lens(world), 2, 8)
                blocks = blocks_of(lay, QKV, dtype, device, seed=100 * c + rank)
                want, got = outs_of(lay, QKV, dtype, device), outs_of(lay, QKV, dtype, device)
                L.unpack_h2s(lay, blocks, QKV, want)
                kernels.unpack_h2s(lay, blocks, QKV, got)
                for i, (a, b) in enumerate(zip(want, got)):
                    assert torch.equal(a, b), f"{hq}/{hkv} P{world} chunk {c} rank {rank} role {i}"
