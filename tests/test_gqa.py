"""The one piece that gathers KV heads to query heads and sums their gradients back
(``gqa.KVGather``), against autograd's own gather and the head-order sum, bit for bit."""

import pytest
import torch

from ulysses_kernels.gqa import KVGather, KVGradSum, expand_kv
from ulysses_kernels.plan import HeadPlan

B, S, D = 2, 5, 4


def test_modes_follow_the_plan():
    # 40 query heads, 8 KV heads on 16 ranks: 3 or 2 query heads per rank, one KV head each.
    plan = HeadPlan.build(40, 8, 16)
    assert KVGather.of(plan.local_kv_map(0), plan.kv_count(0)).mode == "grouped"  # one KV head: uniform
    assert KVGather.of(plan.local_kv_map(0), plan.kv_count(0), shared=True).mode == "shared"
    # 10 query heads, 2 KV heads on 3 ranks: rank 1 holds query heads 4..6 of KV heads 0 and 1.
    plan = HeadPlan.build(10, 2, 3)
    assert plan.local_kv_map(1) == (0, 1, 1) and KVGather.of(plan.local_kv_map(1), 2).mode == "gathered"
    assert KVGather.of((0, 0, 1, 1), 2).mode == "grouped"
    assert KVGather.of((0, 0, 1, 1), 2, gather=True).mode == "gathered"  # a chunk of a gathered rank
    assert KVGather.of((0,), 1, shared=True).mode == "grouped"  # one query head shares nothing


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gather_and_scatter_equal_autograds_index_select(dtype):
    heads = KVGather.of((0, 1, 1), 2)
    k = torch.randn(B, S, 2, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, S, 2, D, dtype=dtype, requires_grad=True)
    kg, vg = heads.gather(k, v)
    assert kg.shape == (B, S, 3, D) and torch.equal(kg[:, :, 2], k[:, :, 1].detach())
    dk, dv = torch.randn_like(kg), torch.randn_like(vg)
    torch.autograd.backward([kg, vg], [dk, dv])
    mine = heads.scatter(dk, dv)
    assert torch.equal(mine[0], k.grad) and torch.equal(mine[1], v.grad)
    assert expand_kv(k, v, (0, 1, 1))[0].shape == (B, S, 3, D) and expand_kv(k, v, (0, 0, 1, 1))[0] is k


def test_shared_is_a_view_and_sums_in_head_order():
    heads = KVGather.of((0, 0, 0, 0), 1, shared=True)
    k, v = torch.randn(B, S, 1, D), torch.randn(B, S, 1, D)
    kg, vg = heads.gather(k, v)
    assert kg.shape == (B, S, 4, D) and kg.stride(2) == 0 and kg.data_ptr() == k.data_ptr()
    dk, dv = torch.randn(B, S, 4, D, dtype=torch.bfloat16), torch.randn(B, S, 4, D, dtype=torch.bfloat16)
    acc = KVGradSum()
    acc.add(dk[:, :, :1], dv[:, :, :1])  # in two pieces, as a chunked backward feeds it
    acc.add(dk[:, :, 1:], dv[:, :, 1:])
    for got, want in zip(heads.scatter(dk, dv), acc.result()):
        assert got.shape == (B, S, 1, D) and torch.equal(got, want)


def test_own_q_copies_only_a_gathered_view_of_the_buffer():
    recv = torch.randn(B, S, 5, D)
    q, k = recv[:, :, :3], recv[:, :, 3:]
    gathered, grouped = KVGather.of((0, 1, 1), 2), KVGather.of((0, 0, 0), 1)
    mine = gathered.own_q(q, k)
    assert mine.data_ptr() != recv.data_ptr() and mine.is_contiguous() and torch.equal(mine, q)
    assert grouped.own_q(q, k) is q
    alone = q.clone()
    assert gathered.own_q(alone, k) is alone  # its own storage already
