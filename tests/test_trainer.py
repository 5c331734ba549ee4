"""transformers' Trainer with ``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend=
"deepspeed", sp_size=2, ...), deepspeed=<ZeRO-3 config>)`` through ``enable_alst()``, on gloo ranks.

The script is what a Trainer user runs today; the one added line is ``enable_alst()`` before
the Trainer is built. Its path, read in transformers 5.23.0 and accelerate 1.15.0:
``Trainer.train`` -> ``Accelerator.prepare`` -> ``_prepare_deepspeed``, which imports
``UlyssesSPAttentionHF`` and ``UlyssesSPDataLoaderAdapter`` from DeepSpeed's ``ulysses_sp``
module (ours after the switch, DeepSpeed's adapter), calls ``register_with_transformers(model,
...)`` and passes the mpu to ``deepspeed.initialize``; the Trainer then wraps its dataloader in
the adapter (``deepspeed_ulysses_dl_adapter``) and computes the loss with
``deepspeed_sp_compute_loss`` (the adapter's ``shift_labels``, each rank's loss weighted by its
valid tokens through a differentiable all-gather over DeepSpeed's sequence-parallel group,
which is our mpu's).

A tiny Qwen2 with 3 query heads and 1 KV head: 2 ranks do not divide the query heads
(DeepSpeed's own class refuses it: checked here through the same Trainer). Three optimizer
steps at sp 2 give the losses, gradient norms and parameters of the same Trainer at sp 1 in
one process (the adapter gives each step one sample split over the sequence ranks; a sequential
sampler makes the sp 1 run see the samples in the same order), with gradient checkpointing:
each step gathers the positions once, for the forward and the recompute of every layer.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ulysses_kernels.testing import run_ranks

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (scripts/setup.sh installs it)"),
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed (scripts/setup.sh installs it)"),
]

VOCAB, SEQ, SAMPLES, STEPS = 61, 12, 6, 3
# NOTE: float32 (DeepSpeed 0.19.8's ZeRO-3 refuses float64). Measured at sp 2 against sp 1:
# losses within 1.2e-7 relative, gradient norms within 2e-8, parameters within 1.0e-7
# absolute after 3 SGD steps (lr 0.5; the largest parameter moved by 0.2); the tolerances are
# about 10x the worst of those. SGD, so that a parameter's difference is lr times its
# gradient's (with AdamW at lr 1e-2 instead, measured: parameters within 1.4e-6).
LOSS_RTOL, PARAM_ATOL = 1e-6, 1e-6

ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": False},
}  # fmt: skip


def build_model():
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
        head_dim=8, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def dataset():
    """Samples with ``position_ids`` (the adapter requires them) and a masked prompt in each
    (so the ranks' valid-token counts differ)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    out = []
    for i in range(SAMPLES):
        labels = ids[i].clone()
        labels[: 1 + i % 4] = -100
        out.append({"input_ids": ids[i], "labels": labels, "position_ids": torch.arange(SEQ)})
    return out


def collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def trainer(outdir: str, sp: int):
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    class SequentialTrainer(transformers.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    pc = None
    if sp > 1:
        pc = ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
    args = transformers.TrainingArguments(
        output_dir=outdir, per_device_train_batch_size=1, max_steps=STEPS, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        deepspeed=dict(ZERO3), parallelism_config=pc, disable_tqdm=True, gradient_checkpointing=True,
    )  # fmt: skip
    return SequentialTrainer(model=build_model(), args=args, train_dataset=dataset(), data_collator=collate)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_parameters(tr) -> dict:
    import deepspeed

    model = tr.model
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank, world, sp, outdir, result_file):
    # What a launcher sets (accelerate reads them; the process group exists already, so the
    # address is not dialled).
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if sp > 1:
        from ulysses_kernels.integrations.deepspeed import enable_alst

        enable_alst()  # the one added line
    calls = {"forward": 0, "_new_shard": 0}
    if sp > 1:
        from ulysses_kernels.integrations.deepspeed_alst import UlyssesSPAttentionHF

        for name in calls:  # count the attention calls and the per-step gathers of positions
            original = getattr(UlyssesSPAttentionHF, name)

            def counted(self, *args, _name=name, _original=original, **kwargs):
                calls[_name] += 1
                return _original(self, *args, **kwargs)

            setattr(UlyssesSPAttentionHF, name, counted)
    tr = trainer(outdir, sp)
    tr.train()
    if sp > 1:
        # Each step gathers the positions once, though every layer's attention runs again in
        # the backward under gradient checkpointing. NOTE: measured 3 calls per layer and step
        # (the forward and two recomputes: docs/design.md, a backward not wrapped in
        # GraphExecGroup); 1 without checkpointing.
        layers = tr.model.config.num_hidden_layers
        assert calls["_new_shard"] == STEPS and calls["forward"] >= 2 * STEPS * layers, calls
    logs = [h for h in tr.state.log_history if "loss" in h]
    result = {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs], "params": full_parameters(tr)}
    if sp > 1:
        from deepspeed.utils import groups
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from ulysses_kernels.integrations import deepspeed_alst, mesh

        assert isinstance(ALL_ATTENTION_FUNCTIONS["sdpa"], deepspeed_alst.UlyssesSPAttentionHF)  # the Trainer's path ran ours
        assert isinstance(groups.mpu, mesh.DeepSpeedMPU) and groups.mpu.get_sequence_parallel_world_size() == sp
        ALL_ATTENTION_FUNCTIONS["sdpa"].unregister()
        # The same Trainer with DeepSpeed's class refuses the heads.
        from ulysses_kernels.integrations.deepspeed import disable_alst

        disable_alst()
        with pytest.raises(ValueError, match="Attention head count 3 is not divisible by SP size 2"):
            trainer(outdir, sp).train()
    if rank == 0:
        torch.save(result, result_file)


def test_trainer_sp2_equals_sp1(tmp_path):
    run_ranks(_train, 1, 1, str(tmp_path / "sp1"), str(tmp_path / "sp1.pt"))
    run_ranks(_train, 2, 2, str(tmp_path / "sp2"), str(tmp_path / "sp2.pt"))
    want, got = torch.load(tmp_path / "sp1.pt"), torch.load(tmp_path / "sp2.pt")
    assert len(got["loss"]) == len(want["loss"]) == STEPS
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(want["grad_norm"]), rtol=LOSS_RTOL, atol=0)
    assert got["params"].keys() == want["params"].keys()
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")  # noqa: B023
    moved = max(float((p - build_model().state_dict()[n]).abs().max()) for n, p in want["params"].items())
    assert moved > 1e3 * PARAM_ATOL, moved  # the steps moved the parameters far beyond the tolerance
