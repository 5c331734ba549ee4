"""One verl actor step with sequence parallelism through verl's own FSDP engine, on CPU gloo ranks.

verl 0.9.1's ``FSDPEngineWithLMHead`` (``verl/workers/engine/fsdp/transformer_impl.py``) is
built the way verl's ``TrainingWorker`` builds it: an ``HFModelConfig`` whose ``external_lib``
is the switch (its ``__post_init__`` imports ``ulysses_kernels.integrations.verl`` in this
rank), an ``FSDPEngineConfig`` with ``ulysses_sequence_parallel_size=2``, an optimizer
config. Then a PPO actor step as verl's trainer drives it: ``infer_batch`` in the engine's
eval mode (the old log-probs) and ``train_batch`` in its train mode with verl's
``ppo_loss`` (one AdamW update, gradient clipping, gradient checkpointing on). The model
is a tiny Qwen2 with 3 query heads and 1 KV head, which verl's own Ulysses refuses at sp 2
(3 % 2 != 0).

The same step is run by the same engine with ``ulysses_sequence_parallel_size=1`` (verl's
own code only: two data-parallel ranks fed the same batch, which is one process's step,
since verl normalizes the loss by the tokens of both and FSDP averages the gradients) and
the log-probs, the gradient norm and every parameter after the update are compared. The
log-probs are also compared with the model run by transformers in this process.

What does not run on the CPU, and is not tested here: verl's ``strategy="fsdp"`` (FSDP1):
``FSDP(..., sync_module_states=True, device_id=get_device_id())`` in
``FSDPEngine._build_fsdp_module`` makes torch raise ``ValueError: The module has CPU
parameters or buffers when sync_module_states=True, which requires them to be on GPU``
(``torch/distributed/fsdp/_init_utils.py``, ``_check_module_states_for_sync_module_states``).
``strategy="fsdp2"`` (``fully_shard``) runs. verl's engine registry lists the FSDP engines for
"cuda" and "npu" only, so the engine class is built directly, as ``EngineRegistry.new``
would. float32: verl's ``PrecisionType`` has no float64.
"""

from __future__ import annotations

import functools
import importlib.util
import time

import pytest
import torch

from ulysses_kernels.testing import run_ranks

HAS_VERL = importlib.util.find_spec("verl") is not None
pytestmark = pytest.mark.skipif(not HAS_VERL, reason="verl is not installed (scripts/setup.sh installs it)")

SWITCH = "ulysses_kernels.integrations.verl"
BATCH, SEQ, PROMPT = 4, 24, 8
VALID = (24, 17, 13, 20)  # tokens per sample (right padding after them)
# NOTE: float32 throughout (verl's PrecisionType has no float64). Measured between sp 2 and
# sp 1: log-probs 2.4e-7, parameters after the update 1.5e-7 (AdamW at lr 1e-2 moves them
# by about 1e-2), grad norm equal to the printed digits.
TOL = {"rtol": 1e-5, "atol": 2e-6}


def _engine(path: str, sp: int):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model_config = HFModelConfig(
        path=path, external_lib=SWITCH, load_tokenizer=False, use_remove_padding=True,
        override_config={"attn_implementation": "sdpa"},  # verl's default is flash_attention_2 (no flash-attn here)
    )  # fmt: skip
    engine_config = FSDPEngineConfig(
        strategy="fsdp2", ulysses_sequence_parallel_size=sp, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
        infer_micro_batch_size_per_gpu=2, use_torch_compile=False,
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
    )  # fmt: skip
    optimizer_config = FSDPOptimizerConfig(lr=1e-2, total_training_steps=1, clip_grad=1.0)
    engine = FSDPEngineWithLMHead(model_config, engine_config, optimizer_config, CheckpointConfig())
    engine.initialize()
    return engine


def _batch():
    """verl's no-padding batch (nested input_ids/position_ids/loss_mask) from a right-padded one."""
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding

    torch.manual_seed(1)
    input_ids = torch.randint(0, 48, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    for i, n in enumerate(VALID):
        mask[i, n:] = 0
    position_ids = torch.clip(torch.cumsum(mask, -1) - 1, min=0)
    data = DataProto.from_single_dict(
        {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            "prompts": input_ids[:, :PROMPT],
            "responses": input_ids[:, PROMPT:],
            "response_mask": mask[:, PROMPT:],
        }  # fmt: skip
    )
    return left_right_2_no_padding(data.to_tensordict())


def _actor_step(engine):
    """``(log-probs [nnz], metrics, parameters after the update)`` of one PPO actor step."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    # What TrainingWorker.infer_batch / train_batch put on the batch before calling the engine.
    keys = {"use_remove_padding": True, "use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2, "use_fused_kernels": False, "temperature": 1.0}
    data = _batch()
    tu.assign_non_tensor(data, **keys)
    with engine.eval_mode():
        log_probs = engine.infer_batch(data)["model_output"]["log_probs"]
    data = _batch()
    data["old_log_probs"] = no_padding_2_padding(log_probs, data)
    torch.manual_seed(7)
    data["advantages"] = torch.randn(data["old_log_probs"].shape) * data["response_mask"]
    tu.assign_non_tensor(data, global_batch_size=BATCH, **keys)
    config = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=BATCH, ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=False, rollout_n=1)
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=functools.partial(ppo_loss, config=config))
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in engine.module.named_parameters()}
    return log_probs.values().detach(), out["metrics"], params


def _one_process_log_probs(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The model as transformers runs it in this process, each sample alone: ``(log p(next
    token) [nnz], which of them to compare)``. A sample's last token is left out: verl's
    target for it is the first token of the next sample of its micro-batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    data = _batch()
    ids, offsets = data["input_ids"].values(), data["input_ids"].offsets().tolist()
    rolled = torch.roll(ids, -1)
    out, keep = [], torch.ones(len(ids), dtype=torch.bool)
    with torch.no_grad():
        for a, b in zip(offsets[:-1], offsets[1:]):
            logits = model(ids[a:b].unsqueeze(0), use_cache=False).logits[0]
            out.append(torch.log_softmax(logits, -1).gather(-1, rolled[a:b].unsqueeze(-1)).squeeze(-1))
            keep[b - 1] = False
    return torch.cat(out), keep


def _body(rank, world, path):
    import verl_cpu

    verl_cpu.use_cpu_platform()
    ours = _engine(path, sp=2)
    from ulysses_kernels.integrations import verl as uv

    assert uv.is_applied()  # HFModelConfig(external_lib=...) imported the switch
    assert ours.module.config._attn_implementation == uv.ATTN_IMPLEMENTATION
    initial = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in ours.module.named_parameters()}
    lp, metrics, params = _actor_step(ours)
    lp_ref, metrics_ref, params_ref = _actor_step(_engine(path, sp=1))
    torch.testing.assert_close(lp, lp_ref, **TOL)
    one_process, keep = _one_process_log_probs(path)
    torch.testing.assert_close(lp[keep], one_process[keep], **TOL)
    if rank == 0:  # verl reports the grad norm on the first rank of each sp group
        torch.testing.assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(metrics_ref["grad_norm"]), **TOL)
    assert params.keys() == params_ref.keys()
    moved = max((params[n] - initial[n]).abs().max().item() for n in params)
    assert moved > 1e-3, f"the update moved no parameter by more than {moved}"
    for name in params:
        torch.testing.assert_close(params[name], params_ref[name], **TOL, msg=lambda m, name=name: f"{name} after the update: {m}")


def test_ppo_actor_step_through_verls_fsdp2_engine(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=12, head_dim=4, num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=2,
                         intermediate_size=24, vocab_size=48, max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    start = time.monotonic()
    run_ranks(_body, 2, str(tmp_path))
    print(f"2 ranks: {time.monotonic() - start:.0f} s")
