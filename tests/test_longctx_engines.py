"""The long-context pieces under the engines that shard the parameters: FSDP2 and DeepSpeed
ZeRO-3 (the LM head's and the MLP's weights gathered by the engine's hooks around the tiles),
2 gloo ranks as one 2-rank sequence group.

Every piece on (tiled loss, tiled MLP, tiled norms, activation offload with checkpointing):
3 SGD steps equal one float64 process on the whole batch (tests/test_fsdp2.py's reference;
float64 under FSDP2, float32 under ZeRO-3, which refuses float64), and each
parameter's gradient is reduced once per step as without the pieces: FSDP2's reduce-scatter
of each parameter group (``foreach_reduce``) is counted per parameter, DeepSpeed ZeRO-3's per-parameter
reduce (the gradient added to its reduce bucket, which its post-accumulate-grad hook does
unless its tiled-compute flag ``ds_grad_is_ready`` holds it back) is counted for every
parameter (once per step each). Under ZeRO-3 the tiled MLP and norms follow DeepSpeed's own
protocol (a sub-module's parameters are gathered only inside a tile, so their gradients are
accumulated per tile, the flag False until the last: ``longctx.tiling``); the LM head's weight
is gathered around the whole tiled loss and gets one gradient.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ulysses_kernels import longctx  # noqa: E402
from ulysses_kernels.integrations import hf, mesh  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

PIECES = {"tiled_loss": 3, "tiled_mlp": 3, "tiled_norms": 4}


def _model(pieces: bool, group, dtype=torch.float64):
    from test_fsdp2 import build_model

    model = build_model().to(dtype)
    if pieces:
        model.activation_checkpointing_enable({"use_reentrant": False})
        return hf.apply(model, group, **PIECES, offload_activations=longctx.ActivationOffload())
    return hf.apply(model, group)


def _share(model, batch, pieces: bool):
    if pieces:  # the tiled loss: out.loss, float64 (no logits)
        out = model(**batch.model_inputs())
        assert out.logits is None
        return out.loss
    return batch.loss(model(**batch.model_inputs(loss=False)).logits)


def _backward(loss, engine=None):
    with torch.utils.checkpoint.GraphExecGroup():
        if engine is None:
            loss.backward()
        else:
            engine.backward(loss)


def _fsdp2_run(groups, pieces: bool, reference):
    from test_fsdp2 import LR, STEPS, replica_batch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    model = _model(pieces, groups.sp_group)
    for layer in model.model.layers:
        fully_shard(layer, mesh=groups.dp_sp_mesh)
    fully_shard(model, mesh=groups.dp_sp_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    divisor = mesh.grad_divisor("fsdp2", groups)
    calls: list[Counter] = []
    original = _fsdp_param_group.foreach_reduce

    def counted(fsdp_params, unsharded_grads, *args, **kwargs):
        for fp, g in zip(fsdp_params, unsharded_grads):
            if g is not None:
                calls[-1][id(fp)] += 1
        return original(fsdp_params, unsharded_grads, *args, **kwargs)

    _fsdp_param_group.foreach_reduce = counted  # FSDP2's reduce-scatter of a parameter group's gradients
    try:
        for step in range(STEPS):
            calls.append(Counter())
            ids, labels = replica_batch(step, groups.dp_rank)
            batch = hf.shard_batch(ids, labels, group=groups.sp_group)
            _backward(mesh.scale_loss(_share(model, batch, pieces), batch.num_tokens, groups, divisor))
            opt.step()
            opt.zero_grad()
            if reference is not None:
                for name, p in model.named_parameters():
                    torch.testing.assert_close(p.detach().full_tensor(), reference[2][step][name], rtol=1e-10, atol=1e-12,
                                               msg=lambda m: f"FSDP2 with the pieces: {name}, step {step}: {m}")  # noqa: B023  # fmt: skip
    finally:
        _fsdp_param_group.foreach_reduce = original
    return [sorted(c.values()) for c in calls], sum(1 for p in model.parameters() if p.requires_grad)


def _fsdp2(rank, world):
    from test_fsdp2 import reference_run

    groups = mesh.parallel_groups(sp_size=2)
    reference = reference_run(groups.dp_size)
    with_pieces, n = _fsdp2_run(groups, True, reference)
    plain, _ = _fsdp2_run(groups, False, None)
    assert with_pieces == plain == [[1] * n] * len(plain), f"reduces per parameter and step with the pieces {with_pieces}, plain {plain}"


def test_fsdp2_pieces_equal_one_process_and_reduce_once():
    run_ranks(_fsdp2, 2)


def _zero3_run(groups, pieces: bool, reference):
    import deepspeed
    from test_deepspeed import ds_config
    from test_fsdp2 import LR, STEPS, replica_batch

    model = _model(pieces, groups.sp_group, torch.float32)  # ZeRO-3 refuses float64 (tests/test_deepspeed.py)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=ds_config(3, True),
                                      mpu=groups.mpu())  # fmt: skip
    names = {id(p): n for n, p in engine.module.named_parameters()}
    optimizer = engine.optimizer
    # ZeRO-3's reduce of one parameter's gradient: its post-accumulate-grad hook adds the
    # gradient to the reduce bucket here (unless the parameter's ds_grad_is_ready is False).
    attr = "_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket"
    reduce = getattr(optimizer, attr)
    counts: list[Counter] = []

    def counted(param, *args, **kwargs):
        counts[-1][names[id(param)]] += 1
        return reduce(param, *args, **kwargs)

    setattr(optimizer, attr, counted)
    divisor = mesh.grad_divisor(engine, groups)
    for step in range(STEPS):
        counts.append(Counter())
        ids, labels = replica_batch(step, groups.dp_rank)
        batch = hf.shard_batch(ids, labels, group=groups.sp_group)
        _backward(mesh.scale_loss(_share(engine, batch, pieces), batch.num_tokens, groups, divisor), engine)
        engine.step()
        if reference is not None:
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                for name, p in engine.module.named_parameters():
                    # NOTE: float32 against the float64 reference, as tests/test_deepspeed.py measured
                    torch.testing.assert_close(p.detach().double(), reference[2][step][name], rtol=1e-6, atol=5e-8,
                                               msg=lambda m: f"ZeRO-3 with the pieces: {name}, step {step}: {m}")  # noqa: B023  # fmt: skip
    engine.destroy()
    from deepspeed.utils import groups as ds_groups

    ds_groups.mpu = None
    ds_groups.mesh_device = None
    return counts, set(names.values())


def _zero3(rank, world):
    import deepspeed
    from test_fsdp2 import reference_run

    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    groups = mesh.parallel_groups(sp_size=2)
    reference = reference_run(groups.dp_size)
    with_pieces, names = _zero3_run(groups, True, reference)
    plain, _ = _zero3_run(groups, False, None)
    for step, (got, want) in enumerate(zip(with_pieces, plain)):
        assert got == want, f"step {step}: reduces per parameter with the pieces {dict(got)}, plain {dict(want)}"
        assert set(got) == names and set(got.values()) == {1}, f"step {step}: {dict(got)}"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (scripts/setup.sh installs it)")
def test_zero3_pieces_equal_one_process_and_reduce_once():
    run_ranks(_zero3, 2)
