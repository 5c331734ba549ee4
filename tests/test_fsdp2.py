"""dp x sp with FSDP2 (and the groups helper): 4 gloo ranks as 2 replicas x 2-rank sequence
groups, a tiny float64 Qwen2 through ``hf.apply``, ``fully_shard`` on the flattened dp x sp
mesh, 3 SGD steps against one process on the whole global batch (the token mean over both
replicas, whose valid-token counts differ), ``clip_grad_norm_`` against the one-process
norm, and the parameters identical on every rank; the groups helper's layout and errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from ulysses_kernels.integrations import hf, mesh  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

VOCAB, SEQ, STEPS, LR = 61, 13, 3, 0.5


def build_model():
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).double()


def replica_batch(step: int, replica: int):
    """``[2, SEQ]`` ids and labels of one replica; replica 1 masks more targets (unequal counts)."""
    g = torch.Generator().manual_seed(100 * step + replica)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, : 2 + 5 * replica] = -100
    return ids, labels


def reference_run(dp: int):
    """One process: per step the loss, the grad norm and the parameters after SGD on the global batch."""
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, params = [], [], []
    for step in range(STEPS):
        batches = [replica_batch(step, r) for r in range(dp)]
        ids = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])
        logits = model(input_ids=ids).logits[:, :-1]  # float64 (transformers' own loss upcasts to float32)
        target = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
        loss = loss / (target != -100).sum()  # the mean over every valid target of the global batch
        loss.backward()
        losses.append(loss.detach())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, norms, params


def _fsdp2(rank, world):
    from torch.distributed.fsdp import fully_shard

    groups = mesh.parallel_groups(sp_size=2)
    assert (groups.dp_size, groups.sp_size) == (2, 2)
    assert (groups.dp_rank, groups.sp_rank) == (rank // 2, rank % 2)  # sequence partners are adjacent ranks
    assert dist.get_process_group_ranks(groups.sp_group) == [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert dist.get_process_group_ranks(groups.dp_group) == [rank % 2, rank % 2 + 2]
    assert dist.get_process_group_ranks(groups.dp_sp_group) == [0, 1, 2, 3]
    assert mesh.grad_divisor("fsdp2", groups) == 4 and mesh.grad_divisor("sum", groups) == 1

    ref_losses, ref_norms, ref_params = reference_run(groups.dp_size)
    model = hf.apply(build_model(), groups.sp_group)
    for layer in model.model.layers:
        fully_shard(layer, mesh=groups.dp_sp_mesh)
    fully_shard(model, mesh=groups.dp_sp_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    divisor = mesh.grad_divisor("fsdp2", groups)
    for step in range(STEPS):
        ids, labels = replica_batch(step, groups.dp_rank)
        batch = hf.shard_batch(ids, labels, group=groups.sp_group)
        share = batch.loss(model(**batch.model_inputs(loss=False)).logits)  # float64 share of the replica's mean
        loss = mesh.scale_loss(share, batch.num_tokens, groups, divisor)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        torch.testing.assert_close(norm, ref_norms[step], rtol=1e-10, atol=0, msg=lambda m: f"grad norm, step {step}: {m}")  # noqa: B023
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            full = p.detach().full_tensor()
            torch.testing.assert_close(full, ref_params[step][name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}, step {step}: {m}")  # noqa: B023
        # the global token-mean loss (logging) equals the one-process loss of this step
        logged = mesh.global_loss(share, batch.num_tokens, groups)
        torch.testing.assert_close(logged, ref_losses[step], rtol=1e-12, atol=0)
    # errors
    with pytest.raises(mesh.MeshError, match=r"sp_size expected a positive divisor of the world size \(4\), got 3"):
        mesh.parallel_groups(sp_size=3)
    with pytest.raises(mesh.MeshError, match=r"dp_size x sp_size expected 4"):
        mesh.parallel_groups(sp_size=2, dp_size=1)
    with pytest.raises(mesh.MeshError, match="engine expected 'fsdp2'"):
        mesh.grad_divisor("ddp", groups)
    with pytest.raises(mesh.MeshError, match="'sequence_parallel_size'"):
        mesh.grad_divisor({"sequence_parallel_size": 2, "zero_optimization": {"stage": 1}}, groups)
    with pytest.raises(mesh.MeshError, match="gradient_predivide_factor"):
        mesh.grad_divisor({"gradient_predivide_factor": 2.0}, groups)
    assert mesh.grad_divisor({"zero_optimization": {"stage": 3}}, groups) == 4
    assert mesh.grad_divisor({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, groups) == 2
    assert mesh.grad_divisor({"zero_optimization": {"stage": 1, "reduce_scatter": False}}, groups) == 2
    assert mesh.grad_divisor({"zero_optimization": {"stage": 2}}, groups) == 2


def test_fsdp2_dp2_sp2_equals_one_process():
    run_ranks(_fsdp2, 4)
