"""hf.apply on Llama 4 (text): chunked attention layers and the NoPE layers' attention
temperature tuning, exact on 2 and 4 gloo ranks against one process.

* Chunked layers attend within chunks of ``attention_chunk_size`` tokens. The ``"ulysses"`` mask
  function recognises transformers' chunked causal mask and records the chunk; the attention call
  builds the mask over the global sequence with the chunks as documents (over an unpacked sequence
  transformers' chunks of indices; in a packed one each document's chunks counted from its
  start, as the document alone has them) and runs the model's own implementation ('eager' or
  'sdpa': their mask carries the chunks) on the rank's heads.
* Every fourth layer has no RoPE and scales its queries by a factor of the token's index
  (``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``), counted by the module in the hidden
  states it sees: on a shard, from 0. The attention call rescales them to the global index.
  Without that rescaling the gradients are 7e-2 from one process (measured, 2 ranks).
* A tiny model: chunks of 5 over 13 tokens, ``floor_scale`` 4 (the factor changes every 4
  tokens), 4 heads over 2 KV heads, top-1 of 4 eager experts, float64.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import close, global_batch  # noqa: E402
from test_hf import reference as reference_unpacked  # noqa: E402
from test_hf_packed import packed_batch  # noqa: E402
from test_hf_packed import reference as reference_packed  # noqa: E402

from ulysses_kernels import make_sp_groups  # noqa: E402
from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402
from ulysses_kernels.testing.hybrids import sharded_step  # noqa: E402

CONFIG = {"vocab_size": 61, "hidden_size": 48, "intermediate_size": 32, "intermediate_size_mlp": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "attention_chunk_size": 5, "floor_scale": 4,
          "attn_scale": 0.1, "num_local_experts": 4, "num_experts_per_tok": 1, "attn_implementation": "sdpa",
          "experts_implementation": "eager", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
RTOL, GRAD_RTOL = 1e-12, 1e-9
# Packed documents against each document run alone: the model applies RoPE in float32
# (``view_as_complex(xq.float())``), normalises in float32 and takes its router's sigmoid in
# float32, so a float64 rounding difference upstream (matmuls over other lengths) can move a value
# by a float32 step.
# NOTE: measured: loss 1.7e-11 / 5.0e-11, gradients 1.1e-7 / 1.0e-7 (2 / 4 ranks).
PACKED_RTOL = 1e-6


def build(**overrides):
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**(CONFIG | overrides))).double().train()
    with torch.no_grad():  # routers start tied: random, so that routing matters
        for m in model.modules():
            if type(m).__name__.endswith("Router"):
                m.weight.normal_(std=0.5)
    return model


def check(got, ref, rtol, grad_rtol, what):
    close(got[0], ref[0], rtol, f"{what}: loss")
    close(got[2], ref[2], rtol, f"{what}: logits")
    for n, g in got[1].items():
        close(g, ref[1][n], grad_rtol, f"{what}: grad of {n}")


def job(rank, world):
    ids, labels = global_batch()
    ref = reference_unpacked(build(), ids, labels)
    model = hf.apply(build())
    assert any(getattr(m, "attention_chunk_size", None) or m.config.layer_types[m.layer_idx] == "chunked_attention"
               for m in model.modules() if type(m).__name__ == "Llama4TextAttention")  # fmt: skip
    for pad in (False, True):  # 2 rows: the chunked layers on sdpa with the chunked mask
        check(sharded_step(model, hf.shard_batch(ids, labels, pad=pad), None), ref, RTOL, GRAD_RTOL, f"llama4 world {world} pad={pad}")
    ref = reference_unpacked(build(), ids[1:], labels[1:])  # 1 row: the packed-documents kernel over the chunks
    check(sharded_step(model, hf.shard_batch(ids[1:], labels[1:]), None), ref, RTOL, GRAD_RTOL, f"llama4 world {world} one row")
    pids, plabels, positions, cu = packed_batch()
    ref = reference_packed(build(), pids, plabels, cu)
    got = sharded_step(model, hf.shard_batch(pids, plabels, position_ids=positions), None)
    check(got, ref[:3], PACKED_RTOL, PACKED_RTOL, f"llama4 world {world} packed")
    if world == 4:  # a 2-D group (Ulysses x ring) runs plain causal attention only: chunks refused on every rank
        sp = make_sp_groups(2, 2)
        with pytest.raises(hf.HFIntegrationError, match=r"with a 2-D group \(SPGroups\) only plain causal attention runs.* chunks"):
            hf.apply(build(), sp)(**hf.shard_batch(ids, labels, group=sp, pad=True).model_inputs(loss=False))


@pytest.mark.parametrize("world", [2, 4])
def test_llama4_chunked_and_temperature_exact(world):
    run_ranks(job, world)


def test_chunked_attention_needs_a_masked_implementation():
    """A chunk shorter than the sequence over several rows on an implementation that takes no
    mask (flash attention's would run plain causal) is refused by name (one row runs the
    packed-documents kernel); ALST's entry point, which rebuilds
    causal and sliding-window masks only, still refuses chunked layers (the audit)."""
    ids, labels = global_batch()
    model = hf.apply(build(attn_implementation="eager"))
    batch = hf.shard_batch(ids, labels)
    model(**batch.model_inputs(loss=False))  # eager: runs
    for m in model.modules():  # the configured implementation as apply recorded it, switched to one without a mask
        settings = getattr(m, "_ulysses_settings", None)
        if settings is not None:
            object.__setattr__(m, "_ulysses_settings", type(settings)(**{**settings.__dict__, "inner_impl": "flash_attention_2"}))
    refused = r"chunked attention \(chunks of 5 tokens over 13\) of a batch of 2 rows runs sequence-parallel on the 'eager' or 'sdpa'"
    with pytest.raises(hf.HFIntegrationError, match=refused):
        model(**batch.model_inputs(loss=False))
    one = hf.shard_batch(ids[:1], labels[:1])
    model(**one.model_inputs(loss=False))  # one row: the packed-documents kernel, whatever the implementation
    from ulysses_kernels.integrations.hf.model import attention_modules
    from ulysses_kernels.layers.audit import check_token_mixers

    model = build()
    with pytest.raises(hf.HFIntegrationError, match=r"Llama4TextAttention at model\.layers\.0\.self_attn \(.*chunked attention"):
        check_token_mixers(model, {}, attention=attention_modules(model), caller="register_with_transformers")
