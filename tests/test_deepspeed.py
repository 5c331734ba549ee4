"""The DeepSpeed drop-in ``integrations.deepspeed.DistributedAttention``.

* exact (no DeepSpeed needed): at 4 gloo ranks, float64, both layouts, against the float64
  attention of one process over the whole sequence, forward and q/k/v gradients, including
  head layouts DeepSpeed cannot run (6/2 heads over 4 ranks hung, 4/1 and 8/2 assert: fewer
  KV heads than ranks; 10/5 gives ranks whose query heads straddle KV groups), a local
  attention that flattens its heads (Megatron's core attention), sub-groups of 2 ranks, and
  the argument errors;
* equal to DeepSpeed's own module where DeepSpeed works (skips without DeepSpeed);
* DeepSpeed engines at dp 2 x sp 2, both ways of making the groups: ours through
  ``mesh.parallel_groups(...).mpu()`` (ZeRO-1, 2 and 3, ``reduce_scatter`` on and off) and
  DeepSpeed's own (its ``parallel_state_sp`` module as the mpu and ``mesh_param=(2, 2)``
  for the same six, the config's ``data_parallel_size``/``sequence_parallel_size`` for
  ZeRO-3 and ZeRO-2), a tiny Qwen2 (float64; float32 at ZeRO-3, which
  refuses float64) through ``hf.apply``, 3 SGD steps with the loss of ``mesh.scale_loss``:
  parameters, grad norm and logged loss equal one float64 process on the global batch (to
  1e-6: DeepSpeed's optimizer path is not all float64), parameters identical on every rank; with DeepSpeed's
  own groups ZeRO-1/2 are refused on every rank, naming the setting (they let sequence
  partners' parameters diverge), as are the other settings ``grad_divisor`` refuses.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ulysses_kernels.integrations import hf, mesh
from ulysses_kernels.integrations.deepspeed import DeepSpeedIntegrationError, DistributedAttention
from ulysses_kernels.testing import run_ranks
from ulysses_kernels.testing.reference import attention_reference

B, S, D = 2, 12, 8  # S divides 2 and 4 ranks (DeepSpeed needs equal shards)
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def sdpa_local(seq_dim: int, flat: bool = False):
    """A user's local attention in the caller's layout (``seq_dim`` 0: [S, b, h, d])."""

    def local(q, k, v, scale=None):
        q, k, v = (t.transpose(0, 1) if seq_dim == 0 else t for t in (q, k, v))  # [b, S, h, d]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, S, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)
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


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (scripts/setup.sh installs it)")
def test_equals_deepspeed_where_it_runs():
    run_ranks(_vs_deepspeed, 4)


# ---- DeepSpeed engines at dp 2 x sp 2 -------------------------------------------------------
ZERO_CASES = [(1, True), (1, False), (2, True), (2, False), (3, True), (3, False)]  # (stage, reduce_scatter)
# (how DeepSpeed makes its own groups, stage, reduce_scatter): every stage and reduce_scatter
# through mesh_param; the config's sizes (the same mesh) once per outcome.
DEEPSPEED_GROUPS_CASES = [("mesh_param", stage, rs) for stage, rs in ZERO_CASES] + [("config", 3, True), ("config", 2, False)]


def ds_config(stage: int, reduce_scatter: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_scatter": reduce_scatter},
        "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
    }  # fmt: skip


def _model_dtype(stage: int) -> torch.dtype:
    """float64 where DeepSpeed takes it; ZeRO-3 refuses float64 parameters (0.19.8:
    ``Invalid data type torch.float64`` from ``zero.Init``, which stage 3 runs on the model)."""
    return torch.float32 if stage == 3 else torch.float64


def _train_and_check(engine, groups, stage, what, reference) -> None:
    """3 SGD steps with ``mesh.scale_loss``: grad norm, parameters and logged loss against one
    process (float64), and the parameters equal on every rank."""
    import deepspeed
    from test_fsdp2 import STEPS, replica_batch

    ref_losses, ref_norms, ref_params = reference
    world = dist.get_world_size()
    # NOTE: rtol 1e-6 for both dtypes: DeepSpeed's optimizer path is float32 at ZeRO-1/2 too
    # (float64 models measured up to 1.2e-7 off in a parameter near 1, 3.6e-8 in the grad
    # norm), and the float32 ZeRO-3 cases measured the same (1.2e-7, 4.2e-8; loss 5.2e-8).
    # atol: a float32 parameter is rounded at each of the 3 updates (half an ulp of |p| <= ~0.2:
    # <= 7.5e-9 each), and an update that cancels it to a small value keeps that absolute
    # error (measured 1.1e-8 at a parameter of 1.5e-4, embed_tokens at step 1): 5e-8 in float32.
    rtol, atol = 1e-6, (5e-8 if _model_dtype(stage) == torch.float32 else 1e-8)
    divisor = mesh.grad_divisor(engine, groups)
    for step in range(STEPS):
        ids, labels = replica_batch(step, groups.dp_rank)
        batch = hf.shard_batch(ids, labels, group=groups.sp_group)
        share = batch.loss(engine(**batch.model_inputs(loss=False)).logits)
        engine.backward(mesh.scale_loss(share, batch.num_tokens, groups, divisor))
        engine.step()
        norm = torch.as_tensor(float(engine.get_global_grad_norm()), dtype=torch.float64)
        logged = mesh.global_loss(share, batch.num_tokens, groups).double()
        torch.testing.assert_close(norm, ref_norms[step], rtol=rtol, atol=0, msg=lambda m: f"{what} grad norm, step {step}: {m}")  # noqa: B023
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            for name, p in engine.module.named_parameters():
                full = p.detach().clone()
                torch.testing.assert_close(full.double(), ref_params[step][name], rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}, step {step}: {m}")  # noqa: B023
                everyone = [torch.empty_like(full) for _ in range(world)]
                dist.all_gather(everyone, full)
                assert all(torch.equal(x, full) for x in everyone), f"{what} {name}: parameters differ across ranks"
        torch.testing.assert_close(logged, ref_losses[step], rtol=rtol, atol=0)


def _deepspeed_groups_engine(route: str, stage: int, reduce_scatter: bool, dp: int, sp: int):
    """An engine whose dp x sp groups DeepSpeed makes itself (``route``: ``mesh_param`` or the
    config's ``data_parallel_size``/``sequence_parallel_size``), the groups taken from its
    mesh, and the model made sequence-parallel over them after ``initialize``."""
    import deepspeed
    from test_fsdp2 import LR, build_model

    config, kwargs = ds_config(stage, reduce_scatter), {}
    if route == "mesh_param":
        kwargs["mesh_param"] = (dp, sp)
    else:
        config.update(data_parallel_size=dp, sequence_parallel_size=sp)
    model = build_model().to(_model_dtype(stage))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config, **kwargs)
    groups = mesh.parallel_groups(mesh=engine.mesh_device)
    hf.apply(engine.module, groups.sp_group)
    return engine, groups


def _forget_engine_groups(engine) -> None:
    """Destroy ``engine`` and the groups DeepSpeed remembers from it.

    NOTE: DeepSpeed 0.19.8 keeps the last engine's mpu and mesh in ``deepspeed.utils.groups``
    (``engine.destroy()`` leaves them), and a later engine made without an mpu (or without a
    mesh) would take the earlier one's groups: each case here starts from none."""
    from deepspeed.utils import groups as ds_groups

    engine.destroy()
    ds_groups.mpu = None
    ds_groups.mesh_device = None


def _zero_stages(rank, world):
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as parallel_state_sp
    from test_fsdp2 import LR, build_model, reference_run

    os.environ.setdefault("LOCAL_RANK", str(rank))  # deepspeed.initialize asks for it (a launcher sets it)
    deepspeed.init_distributed(dist_backend="gloo")
    groups = mesh.parallel_groups(sp_size=2)
    parallel_state_sp.initialize_sequence_parallel(groups.sp_size)  # DeepSpeed's Ulysses-for-HF groups, the same ranks
    assert dist.get_process_group_ranks(parallel_state_sp.get_sequence_parallel_group()) == dist.get_process_group_ranks(groups.sp_group)
    reference = reference_run(groups.dp_size)
    # An mpu: ours, then DeepSpeed's parallel_state_sp module. Every stage trains right.
    for name, mpu in (("mpu", groups.mpu()), ("parallel_state_sp", parallel_state_sp)):
        for stage, reduce_scatter in ZERO_CASES:
            model = hf.apply(build_model().to(_model_dtype(stage)), groups.sp_group)
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                              config=ds_config(stage, reduce_scatter), mpu=mpu)  # fmt: skip
            _train_and_check(engine, groups, stage, f"{name} ZeRO-{stage} reduce_scatter={reduce_scatter}", reference)
            _forget_engine_groups(engine)
    # DeepSpeed's own groups: ZeRO-3 trains right with the same scale; ZeRO-1/2 reduce over
    # the dp group only (measured: sequence partners' parameters diverge) and are refused on
    # every rank, naming the setting.
    for route, stage, reduce_scatter in DEEPSPEED_GROUPS_CASES:
        what = f"{route} ZeRO-{stage} reduce_scatter={reduce_scatter}"
        engine, own = _deepspeed_groups_engine(route, stage, reduce_scatter, groups.dp_size, groups.sp_size)
        assert dist.get_process_group_ranks(own.sp_group) == dist.get_process_group_ranks(groups.sp_group), what
        if stage == 3:
            _train_and_check(engine, own, stage, what, reference)
        else:
            setting = "mesh_param" if route == "mesh_param" else "'data_parallel_size'/'sequence_parallel_size'"
            with pytest.raises(mesh.MeshError, match=f"own dp x sp groups \\({setting}\\) with ZeRO stage {stage}: .*diverge"):
                mesh.grad_divisor(engine, own)
        _forget_engine_groups(engine)
    dist.barrier()  # every rank came through the refusals (none hangs or trains on)
    # Settings that do not give the one-process gradient are refused, each named.
    for config, needle in (
        ({**ds_config(2, True), "sequence_parallel_size": 2}, "'sequence_parallel_size' without 'data_parallel_size'"),
        ({**ds_config(1, True), "sequence_parallel_size": 2, "data_parallel_size": 2}, "ZeRO stage 1: .*diverge"),
        ({**ds_config(3, True), "sequence_parallel_size": 4, "data_parallel_size": 1}, "mesh is 1 x 4, the groups' 2 x 2"),
        ({**ds_config(1, True), "prescale_gradients": True}, "prescale_gradients"),
    ):
        with pytest.raises(mesh.MeshError, match=needle):
            mesh.grad_divisor(config, groups)
    assert mesh.grad_divisor({**ds_config(3, False), "sequence_parallel_size": 2, "data_parallel_size": 2}, groups) == groups.dp_size
    # An engine whose groups are not these groups' (a stand-in: only what grad_divisor reads).
    sp4 = mesh.parallel_groups(sp_size=4)
    for mpu, own_mesh, needle in ((parallel_state_sp, None, r"mpu.get_sequence_parallel_world_size\(\) is 2, the groups' 4"),
                                  (parallel_state_sp, groups.mesh, "both an mpu and its own mesh")):  # fmt: skip
        engine = SimpleNamespace(config=ds_config(3, True), zero_optimization_stage=lambda: 3, mpu=mpu, mesh_device=own_mesh)
        with pytest.raises(mesh.MeshError, match=needle):
            mesh.grad_divisor(engine, sp4)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (scripts/setup.sh installs it)")
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_zero_stages_dp2_sp2_equal_one_process():
    run_ranks(_zero_stages, 4)
