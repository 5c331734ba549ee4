"""The transformers integration: sequence-parallel Qwen2/Llama vs one process, errors, example.

One spawn of 4 ranks holds the multi-rank checks (importing torch and transformers costs
~8 s of CPU per rank): sequence parallelism over all 4 ranks, over 2-rank groups (two
pairs side by side), the errors, and the example as 2 replicas x 2-rank groups.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 13  # divides neither 2 nor 4
VOCAB = 61

# (model family, heads, kv heads): 6 heads / 2 KV heads do not divide 4 ranks; 4 heads / 1 KV
# head is GQA with fewer KV heads than ranks.
CASES = [("qwen2", 6, 2), ("llama", 4, 1)]


def build(family: str, heads: int, kv_heads: int, **overrides):
    cfg = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": 16, "max_position_embeddings": 64, "attn_implementation": "sdpa",
    }  # fmt: skip
    cfg.update(overrides)
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    torch.manual_seed(0)
    return model_cls(config_cls(**cfg)).double()


def global_batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt, so the token count is not batch * (seq - 1)
    labels[1, 5] = -100
    return ids, labels


def reference(model, ids, labels):
    """One process, whole sequence, float64: loss, parameter grads and logits."""
    logits = model(input_ids=ids).logits
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    loss = loss / (target != -100).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        hf_loss = model(input_ids=ids, labels=labels).loss
    return loss.detach(), grads, logits.detach(), hf_loss


def close(a, b, rtol, what):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"
    return err


def check_equivalence(group):
    """Loss, every parameter gradient and the gathered logits equal the one-process run."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ids, labels = global_batch()
    for family, heads, kv in CASES:
        ref_loss, ref_grads, ref_logits, ref_hf_loss = reference(build(family, heads, kv), ids, labels)
        model = hf.apply(build(family, heads, kv), group)
        assert model.config._attn_implementation == "ulysses"
        for pad in (False, True):
            what = f"{family} {heads}/{kv} heads, world {world}, {'padded' if pad else 'uneven'}"
            batch = hf.shard_batch(ids, labels, group=group, pad=pad)
            expect_lens = [SEQ // world + (r < SEQ % world) for r in range(world)] if not pad else [-(-SEQ // world)] * world
            assert list(batch.seq_lens) == expect_lens, what
            assert batch.num_tokens == int((labels[:, 1:] != -100).sum())
            # Global positions: rank r's first position is the sum of the lengths before it.
            assert batch.position_ids[0, 0].item() == sum(expect_lens[:rank])

            out = model(**batch.model_inputs(loss=False))
            loss = batch.loss(out.logits)
            loss.backward()
            hf.sync_gradients(model, group)
            close(hf.reduce_loss(loss, group), ref_loss, 1e-12, f"{what}: loss")
            for name, p in model.named_parameters():
                close(p.grad, ref_grads[name], 1e-9, f"{what}: grad of {name}")
            model.zero_grad(set_to_none=True)
            close(hf.gather_sequence(out.logits, batch.shard, group), ref_logits, 1e-12, f"{what}: logits")

            # transformers' own loss path (out.loss): it upcasts logits to float32, so the
            # sharded sum matches the one-process float32 sum to float32 rounding.
            # NOTE: measured 1.2e-7 relative at 4 ranks (float64 paths: 2e-16 loss, 7e-16 grads).
            with torch.no_grad():
                hf_loss = hf.reduce_loss(model(**batch.model_inputs()).loss, group)
            close(hf_loss.double(), ref_hf_loss.double(), 1e-6, f"{what}: transformers loss")


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(hf.HFIntegrationError, match=match):
        fn(*args, **kwargs)


def check_errors(rank, world, pair):
    """Bad use raises the same clear error on every rank (each raises before any collective)."""

    ids, labels = global_batch()
    model = hf.apply(build("qwen2", 6, 2))
    batch = hf.shard_batch(ids, labels)
    inputs = batch.model_inputs()

    # Data fed without sharding: no shard context at all, or the global ids with one.
    _raises("without a sequence shard", model, input_ids=ids, labels=labels)
    _raises("received the full sequence", model, **{**inputs, "input_ids": ids, "position_ids": None, "labels": None, "shift_labels": None})
    # A batch that is not what shard_batch produced for this rank.
    cut = {**inputs, "input_ids": batch.input_ids[:, :-1], "position_ids": batch.position_ids[:, :-1], "labels": None, "shift_labels": None}
    _raises("do not match the sharded batch", model, **cut)
    # A padding mask cannot be honored across shards.
    mask = torch.ones_like(batch.input_ids)
    mask[:, 0] = 0
    _raises("padding attention_mask", model, **inputs, attention_mask=mask)
    # An all-ones mask (what a tokenizer returns without padding) is fine.
    model(**inputs, attention_mask=torch.ones_like(batch.input_ids))
    # Packed sequences (restarting positions) are refused by the shard helper.
    packed = torch.cat([torch.arange(6), torch.arange(SEQ - 6)]).unsqueeze(0)
    _raises("count up by one", hf.shard_batch, ids, labels, position_ids=packed)

    # Ranks that disagree on the batch: every rank raises after the one exchange.
    bad = ids[:, : SEQ - 1] if rank == 0 else ids
    _raises("different batches", hf.shard_batch, bad)

    # A group that does not match: the model runs over the world, the batch was sharded
    # over a pair of ranks.
    pair_batch = hf.shard_batch(ids, labels, group=pair)
    _raises("pass the same group", model, **pair_batch.model_inputs())


def job(rank, world, example_argv):
    import torch.distributed as dist

    assert world == 4
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    pair = pairs[rank // 2]
    check_equivalence(None)  # 4 ranks
    check_equivalence(pair)  # 2 ranks (ranks 0-1 and 2-3 at the same time)
    check_errors(rank, world, pair)
    example = load_example()
    losses = example.train(rank, world, example.parse_args(example_argv))
    assert losses[-1] < losses[0]


def load_example():
    spec = importlib.util.spec_from_file_location("train_hf", os.path.join(ROOT, "examples", "train_hf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE_ARGV = ["--steps", "3", "--seq", "11", "--model", "llama", "--heads", "4", "--kv-heads", "1", "--quiet"]


def test_ranks():
    run_ranks(job, 4, EXAMPLE_ARGV + ["--sp-size", "2"])


def test_example_arguments():
    args = load_example().parse_args(["--spawn", "2", "--pad", *EXAMPLE_ARGV])
    assert (args.spawn, args.pad, args.steps, args.seq, args.model, args.kv_heads) == (2, True, 3, 11, "llama", 1)


@pytest.mark.parametrize("family,extra", [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": None})])
def test_one_process_matches_sdpa(family, extra):
    """Without torch.distributed (a group of one) the routed model is the sdpa model."""
    ids, labels = global_batch()
    ref_loss, ref_grads, _, ref_hf_loss = reference(build(family, 4, 2, **extra), ids, labels)
    model = hf.apply(build(family, 4, 2, **extra))
    batch = hf.shard_batch(ids, labels)
    out = model(**batch.model_inputs(loss=False))
    loss = batch.loss(out.logits)
    loss.backward()
    close(loss, ref_loss, 1e-12, "loss")
    for name, p in model.named_parameters():
        close(p.grad, ref_grads[name], 1e-12, f"grad of {name}")
    with torch.no_grad():
        close(model(**batch.model_inputs()).loss, ref_hf_loss, 1e-6, "transformers loss")


def test_apply_errors():
    _raises("expected a transformers PreTrainedModel", hf.apply, torch.nn.Linear(4, 4))
    _raises("sliding-window", hf.apply, build("mistral", 4, 2, sliding_window=8))
    _raises("sliding-window", hf.apply, build("qwen2", 4, 2, use_sliding_window=True, sliding_window=8))
    _raises("attention dropout", hf.apply, build("llama", 4, 2, attention_dropout=0.1))
    softcapped = build("llama", 4, 2)
    softcapped.config.attn_logit_softcapping = 30.0
    _raises("softcapping", hf.apply, softcapped)
    _raises("check expected", hf.apply, build("llama", 4, 2), check="sometimes")


def test_call_errors_one_process():
    ids, labels = global_batch()
    # A model switched to "ulysses" by hand, without apply: its modules have no group settings.
    hf.register()
    bare = build("llama", 4, 2)
    bare.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    _raises("not prepared by", bare, **hf.shard_batch(ids, labels).model_inputs())
    # A group without torch.distributed is explained.
    with pytest.raises(hf.HFIntegrationError, match="a group was given"):
        hf.shard_batch(ids, group=object())


def test_shard_layout_one_process():
    """shard_batch with a group of one: global shift, padding bookkeeping, shard()."""
    ids, labels = global_batch()
    batch = hf.shard_batch(ids, labels)
    assert torch.equal(batch.labels[:, :-1], labels[:, 1:]) and (batch.labels[:, -1] == -100).all()
    assert torch.equal(batch.input_ids, ids) and torch.equal(batch.position_ids[0], torch.arange(SEQ))
    shard = hf.SequenceShard((4, 4, 4, 4), rank=3, world_size=4, valid_len=SEQ, batch_size=2)
    x = torch.arange(2 * SEQ).view(2, SEQ)
    assert torch.equal(shard.shard(x, pad_value=-1), torch.tensor([[12, -1, -1, -1], [25, -1, -1, -1]]))
    with pytest.raises(hf.HFIntegrationError, match="global length"):
        shard.shard(x[:, :5])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
