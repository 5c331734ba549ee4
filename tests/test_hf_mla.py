"""MLA models through ``hf.apply``: DeepSeek-V3 (MLA + MoE), DeepSeek-V2 (MLA + MoE, no q
LoRA) and MiniCPM3 (MLA, dense), tiny random models from their transformers configs.

One training step on 4 gloo ranks and on two 2-rank pairs side by side: the loss, every
parameter gradient and the gathered logits equal one process in float64 (the machinery of
tests/test_hf.py: ``build``, ``reference``, ``check_step``). The experts run transformers'
eager implementation (its grouped-mm kernels refuse float64 on the CPU). q and k have the
head dim ``qk_nope_head_dim + qk_rope_head_dim`` (24), v ``v_head_dim`` (12 or 20): the fused
op receives v at its own width (recorded below), no padding.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import FAMILIES, build, check_step, close, global_batch, reference, tolerances  # noqa: E402

from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.layers import attention as adapter  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

# The MLA shapes of all three: q/k 16 + 8 = 24 (rope 8: the config's head_dim, which the
# rotary embedding reads), v narrower (12) or wider (20) than q/k.
_MLA = {"kv_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "head_dim": 8}
_MOE = {"moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "experts_implementation": "eager"}  # fmt: skip
MLA_FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_MLA, **_MOE, "q_lora_rank": 32, "v_head_dim": 12, "n_group": 1, "topk_group": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {**_MLA, **_MOE, "q_lora_rank": None, "v_head_dim": 12}),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", {**_MLA, "q_lora_rank": 32, "v_head_dim": 20}),
}  # fmt: skip
# (family, heads): 6 heads split 2/2/1/1 over 4 ranks (hidden size 96 where the config checks that
# the heads divide it); MLA's KV heads are its query heads.
CASES = [("deepseek_v3", 6), ("deepseek_v2", 4), ("minicpm3", 6)]
QK_DIM = 24
# DeepSeek-V2 and V3 compute their MoE router in float32 whatever the model dtype (and V2 its
# rotary embedding, through complex64): a routing weight is a float32 GEMM row, whose rounding
# may depend on how many rows (tokens) the rank holds, so sharded and one-process float64
# runs agree to float32 rounding, not float64's (as Gemma in tests/test_hf.py).
# NOTE: measured (MLA_ERRORS=1 pytest -s), max relative error at 4 / 2 ranks: DeepSeek-V3 loss and
# logits 0 / 2.1e-16, grads 8.0e-8 / 7.3e-8; DeepSeek-V2 1.3e-8 / 1.3e-8, grads 2.1e-7 / 1.8e-7;
# MiniCPM3 (float64 all through: float64 tolerances) 0 / 1.7e-16, grads 6.5e-16 / 4.6e-16.
FLOAT32_ROUTER = {"deepseek_v3", "deepseek_v2"}


def _tolerances(family: str) -> tuple[float, float]:
    return (2e-6, 2e-6) if family in FLOAT32_ROUTER else tolerances(family)


ERRORS: dict[str, list[float]] = {"loss": [0.0], "grad": [0.0]}  # this rank's measured errors (for the NOTE above)


def _recording_close(a, b, rtol, what):
    err = close(a, b, rtol, what)
    if "transformers loss" not in what:  # that path upcasts the logits to float32 (tests/test_hf.py)
        ERRORS["grad" if ": grad of " in what else "loss"].append(err)
    return err


def _build(family: str, heads: int):
    FAMILIES.setdefault(family, MLA_FAMILIES[family])
    return build(family, heads, heads, **({"hidden_size": 96} if 64 % heads else {}))


def _record_fused_calls(seen: list):
    """Wrap the adapter's fused op: record (q head dim, v head dim, output head dim) per call."""
    op = adapter.ulysses_attention

    def recording(q, k, v, *args, **kwargs):
        out = op(q, k, v, *args, **kwargs)
        seen.append((q.shape[3], v.shape[3], out.shape[3]))
        return out

    adapter.ulysses_attention = recording
    return op


def check_mla_models(group):
    import torch.distributed as dist

    world = dist.get_world_size(group)
    ids, labels = global_batch()
    for family, heads in CASES:
        ref_loss, ref_grads, ref_logits, ref_hf_loss = reference(_build(family, heads), ids, labels)
        model = hf.apply(_build(family, heads), group)
        assert model.config._attn_implementation == "ulysses"
        dv = MLA_FAMILIES[family][2]["v_head_dim"]
        rtol, grad_rtol = _tolerances(family)
        for pad in (False, True):
            seen: list = []
            op = _record_fused_calls(seen)
            try:
                batch = hf.shard_batch(ids, labels, group=group, pad=pad)
                check_step(model, batch, group, (ref_loss, ref_grads, ref_logits), rtol, grad_rtol,
                           f"{family} {heads} heads, world {world}, {'padded' if pad else 'uneven'}", ref_hf_loss)  # fmt: skip
            finally:
                adapter.ulysses_attention = op
            # Every layer ran the fused op with v at its own head dim (2 layers, two forwards).
            assert seen and all(s == (QK_DIM, dv, dv) for s in seen), seen
        if os.environ.get("MLA_ERRORS") and dist.get_rank() == 0:
            print(f"{family} world {world}: max relative error loss/logits {max(ERRORS['loss']):.2e}, grads {max(ERRORS['grad']):.2e}")
        ERRORS.update(loss=[0.0], grad=[0.0])


def job(rank, world):
    import test_hf
    import torch.distributed as dist

    test_hf.close = _recording_close  # check_step's comparisons, recorded (this rank's process only)
    pair = [dist.new_group([r, r + 1]) for r in range(0, world, 2)][rank // 2]
    check_mla_models(None)  # 4 ranks
    check_mla_models(pair)  # 2 ranks (ranks 0-1 and 2-3 at the same time)


def test_mla_models_train_one_step_on_4_and_2_ranks():
    run_ranks(job, 4)


@pytest.mark.parametrize("family,heads", CASES)
def test_one_process_matches_and_the_dims_differ(family, heads):
    """Without torch.distributed the routed model is the model as built; the configs are MLA
    (q/k and v head dims differ) and the tiny models are what the multi-rank test runs."""
    model = _build(family, heads)
    attn = next(m for m in model.modules() if hasattr(m, "v_head_dim"))
    assert attn.qk_head_dim == QK_DIM != attn.v_head_dim
    ids, labels = global_batch()
    ref_loss, ref_grads, _, _ = reference(model, ids, labels)
    applied = hf.apply(_build(family, heads))
    batch = hf.shard_batch(ids, labels)
    loss = batch.loss(applied(**batch.model_inputs(loss=False)).logits)
    loss.backward()
    close(loss, ref_loss, 1e-12, "loss")
    for name, p in applied.named_parameters():
        close(p.grad, ref_grads[name], 1e-12, f"grad of {name}")
    assert torch.isfinite(loss)


def test_deepseek_v32_sparse_attention_is_refused():
    """DeepSeek-V3.2 (MLA + DSA): the indexer's top-k over the keys would see one shard."""
    import transformers

    config = transformers.DeepseekV32Config(
        vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        index_topk=4, attn_implementation="sdpa", **{k: v for k, v in MLA_FAMILIES["deepseek_v3"][2].items() if k != "rope_parameters"},
    )  # fmt: skip
    model = transformers.DeepseekV32ForCausalLM(config)
    with pytest.raises(hf.HFIntegrationError, match=r"DeepseekV32Attention runs sparse attention .* DSA.*not supported"):
        hf.apply(model)
    assert model.config._attn_implementation == "sdpa"  # refused before anything changed
