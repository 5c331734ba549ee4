"""Packed documents with a 2-D (Ulysses x ring) group are not supported yet: the op and
``hf.shard_batch`` refuse the combination with a clear error on every rank, before any
collective (the refusal depends on the arguments only, which every rank passes alike)."""

import pytest
import torch

from ulysses_kernels import make_sp_groups, ulysses_attention
from ulysses_kernels.integrations.hf import HFIntegrationError, shard_batch
from ulysses_kernels.testing import run_ranks


def _body(rank, world):
    sp = make_sp_groups(1, world)
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"packed documents \(cu_seqlens\) with a 2-D group"):
        ulysses_attention(q, q, q, group=sp, cu_seqlens=[0, 3, 4 * world])
    ids = torch.arange(4 * world).unsqueeze(0)
    positions = torch.cat([torch.arange(3), torch.arange(4 * world - 3)]).unsqueeze(0)  # two documents
    with pytest.raises(HFIntegrationError, match="packed documents .* with a 2-D group"):
        shard_batch(ids, group=sp, position_ids=positions)
    # The group still works afterwards: nothing was left half-posted.
    out = ulysses_attention(q, q, q, group=sp)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_packed_with_2d_group_is_refused_on_every_rank():
    run_ranks(_body, 2)
