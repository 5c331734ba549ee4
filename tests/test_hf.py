"""The transformers integration: sequence-parallel models vs one process, errors, example.

Families: Llama, Qwen2, Qwen3 (plain causal: the fused op), Mistral and Qwen2 with sliding
windows, Gemma 2 (window + logit softcapping, eager), Gemma 3 (mixed layer types), GPT-OSS
(attention sinks + alternating windows, eager): the model's own attention on each rank's
heads. The window (5) is shorter than the sequence (13) and crosses the shard boundaries.

One spawn of 4 ranks holds the multi-rank checks (importing torch and transformers costs
~8 s of CPU per rank): sequence parallelism over all 4 ranks, over 2-rank groups (two
pairs side by side), attention dropout's kept fraction, a user-registered attention
implementation, the errors, and the example as 2 replicas x 2-rank groups.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ulysses_kernels import HeadPlan  # noqa: E402
from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.layers.masks import _GlobalMask, ulysses_mask  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402
from ulysses_kernels.testing.reference import one_process_step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 13  # divides neither 2 nor 4
VOCAB = 61
WINDOW = 5  # shorter than SEQ; shards are 7/6 tokens (2 ranks) and 4/3/3/3 (4 ranks)

# family: (config class, model class, config defaults for a tiny model of that family)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"query_pre_attn_scalar": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"query_pre_attn_scalar": 16}),
    # grouped_mm has no float64 kernel: the eager experts; plain RoPE instead of YaRN.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "num_local_experts": 2, "num_experts_per_tok": 1, "experts_implementation": "eager",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
}  # fmt: skip

# (model family, heads, kv heads, config overrides). Heads: 6 / 2 KV heads do not divide 4
# ranks; 4 / 1 is GQA with fewer KV heads than ranks; 6 / 3 (2 ranks) and 10 / 5 (2 and 4
# ranks) give ranks whose query heads do not group uniformly over their KV heads (rank 0 of
# 10 / 5 over 4: heads 0-2, two of KV head 0 and one of KV head 1: KV heads expanded
# locally), and uneven slices of GPT-OSS's sinks (3, 3, 2, 2 heads).
CASES = [
    ("qwen2", 6, 2, {}),
    ("llama", 4, 1, {}),
    ("qwen3", 4, 2, {}),
    ("mistral", 6, 2, {"sliding_window": WINDOW}),
    ("qwen2", 4, 1, {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    ("gemma2", 6, 3, {"sliding_window": WINDOW, "attn_logit_softcapping": 0.1, "attn_implementation": "eager", "hidden_size": 96}),
    ("gemma3", 4, 1, {"sliding_window": WINDOW, "sliding_window_pattern": 2}),
    ("gpt_oss", 10, 5, {"sliding_window": WINDOW, "attn_implementation": "eager"}),
]


# Families that compute in float32 whatever the model dtype: Gemma's RMSNorm multiplies by
# its weight in float32 (the weight's gradient is a float32 sum over the tokens, per shard
# under sequence parallelism) and Gemma 2's eager attention takes its softmax in float32.
# Sharded and one-process float64 runs then agree to float32 rounding, not float64's.
# NOTE: measured at 4 ranks: Gemma 3 (sdpa) 2e-16 logits, 1.7e-7 grads (the same with a
# window longer than the sequence, i.e. on the fused path); Gemma 2 (eager) up to 1.3e-7
# logits, 2.2e-7 grads.
FLOAT32_INSIDE = {"gemma2", "gemma3"}


def tolerances(family: str) -> tuple[float, float]:
    """``(loss and logits, grads)`` relative tolerances of a sharded float64 run."""
    return (2e-6, 2e-6) if family in FLOAT32_INSIDE else (1e-12, 1e-9)


def build(family: str, heads: int, kv_heads: int, sinks: float | None = None, **overrides):
    """A tiny float64 model; GPT-OSS sinks drawn from N(0, 1) (or all ``sinks``) so that they matter."""
    config_name, model_name, defaults = FAMILIES[family]
    cfg = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": 16, "max_position_embeddings": 64, "attn_implementation": "sdpa",
    }  # fmt: skip
    cfg.update(defaults)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**cfg)).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(getattr(m, "sinks", None), torch.Tensor):
                m.sinks.normal_() if sinks is None else m.sinks.fill_(sinks)
    return model


def global_batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt, so the token count is not batch * (seq - 1)
    labels[1, 5] = -100
    return ids, labels


def reference(model, ids, labels, **inputs):
    """One process, whole sequence, float64: loss, parameter grads and logits
    (``testing.reference.one_process_step``), and transformers' own loss (``out.loss``)."""
    loss, grads, logits = one_process_step(model, ids, labels, **inputs)
    with torch.no_grad():
        hf_loss = model(input_ids=ids, labels=labels, **inputs).loss
    return loss, grads, logits, hf_loss


def close(a, b, rtol, what):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"
    return err


def check_step(model, batch, group, refs, rtol, grad_rtol, what, ref_hf_loss):
    """One sharded training step against the one-process ``refs`` (loss, parameter gradients,
    logits): the reduced loss, every synced gradient, the gathered logits, then transformers'
    own loss path (``out.loss``) against ``ref_hf_loss``. That path upcasts logits to float32,
    so the sharded sum matches the one-process float32 sum to float32 rounding (measured
    1.2e-7 relative at 4 ranks; float64 paths: 2e-16 loss, 7e-16 grads)."""
    ref_loss, ref_grads, ref_logits = refs
    out = model(**batch.model_inputs(loss=False))
    loss = batch.loss(out.logits)
    loss.backward()
    hf.sync_gradients(model, group)
    close(hf.reduce_loss(loss, group), ref_loss, rtol, f"{what}: loss")
    for name, p in model.named_parameters():
        close(p.grad, ref_grads[name], grad_rtol, f"{what}: grad of {name}")
    model.zero_grad(set_to_none=True)
    close(hf.gather_sequence(out.logits, batch.shard, group), ref_logits, rtol, f"{what}: logits")
    with torch.no_grad():
        hf_loss = hf.reduce_loss(model(**batch.model_inputs()).loss, group)
    close(hf_loss.double(), ref_hf_loss.double(), 1e-6, f"{what}: transformers loss")


def check_equivalence(group):
    """Loss, every parameter gradient and the gathered logits equal the one-process run."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ids, labels = global_batch()
    for family, heads, kv, extra in CASES:
        ref_loss, ref_grads, ref_logits, ref_hf_loss = reference(build(family, heads, kv, **extra), ids, labels)
        model = hf.apply(build(family, heads, kv, **extra), group)
        assert model.config._attn_implementation == "ulysses"
        rtol, grad_rtol = tolerances(family)
        for pad in (False, True):
            what = f"{family} {heads}/{kv} heads {extra}, world {world}, {'padded' if pad else 'uneven'}"
            batch = hf.shard_batch(ids, labels, group=group, pad=pad)
            expect_lens = [SEQ // world + (r < SEQ % world) for r in range(world)] if not pad else [-(-SEQ // world)] * world
            assert list(batch.seq_lens) == expect_lens, what
            assert batch.num_tokens == int((labels[:, 1:] != -100).sum())
            # Global positions: rank r's first position is the sum of the lengths before it.
            assert batch.position_ids[0, 0].item() == sum(expect_lens[:rank])
            check_step(model, batch, group, (ref_loss, ref_grads, ref_logits), rtol, grad_rtol, what, ref_hf_loss)


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
    # Packed sequences (restarting positions) at batch > 1 are each row's documents now (no longer
    # refused): tests/test_packed_batch.py and tests/test_hf_packed_batch.py run them against one process.

    # Ranks that disagree on the batch: every rank raises after the one exchange.
    bad = ids[:, : SEQ - 1] if rank == 0 else ids
    _raises(r"different batches .*: rank 0 has batch=2 seq=12 .*; ranks 1-3 have batch=2 seq=13 ", hf.shard_batch, bad)  # grouped
    # The same shape and target count, other tokens (a sampler that shards by global rank):
    # caught by the content fingerprint; so are targets alone and document boundaries alone.
    _raises("different batches", hf.shard_batch, ids.roll(rank, dims=1), ids.roll(rank, dims=1))
    other_labels = ids.clone()
    other_labels[:, 1 + rank] = -100
    _raises("different batches", hf.shard_batch, ids, other_labels)
    _raises("different batches", hf.shard_batch, ids[:1], cu_seqlens=[0, 3 + rank, SEQ])
    # The same batch on every rank, the fingerprint the same: no error (checked above too).
    assert hf.shard_batch(ids, ids.clone()).num_tokens == hf.shard_batch(ids).num_tokens

    # A group that does not match: the model runs over the world, the batch was sharded
    # over a pair of ranks.
    pair_batch = hf.shard_batch(ids, labels, group=pair)
    _raises("pass the same group", model, **pair_batch.model_inputs())


DROPOUT_SEQ = 48  # longer than SEQ: more attention weights to count


def check_dropout(group):
    """Attention dropout in training: each rank drops from its own heads' attention weights
    (not the mask one process would draw); the fraction kept is 1 - p within 5 standard
    deviations for the heads of every rank.

    q = k = 0 makes the weights of row t uniform over its t + 1 visible keys, and v = 1 makes
    each output the sum of the kept weights over 1 - p, so output * (t + 1) * (1 - p) counts
    the kept weights of the row (an integer, up to the float32 rounding of Llama's eager
    softmax).
    """
    import torch.distributed as dist

    world, p, heads, kv = dist.get_world_size(group), 0.5, 4, 2
    model = hf.apply(
        build("llama", heads, kv, attention_dropout=p, attention_bias=True, attn_implementation="eager", num_hidden_layers=1),
        group,
    )
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight.zero_()
            proj.bias.zero_()
        attn.v_proj.bias.fill_(1.0)
    seen = []
    attn.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    ids = torch.randint(0, VOCAB, (2, DROPOUT_SEQ), generator=torch.Generator().manual_seed(3))
    batch = hf.shard_batch(ids, group=group)
    model.train()
    model(**batch.model_inputs(loss=False))
    out = hf.gather_sequence(seen[0], batch.shard, group).view(2, DROPOUT_SEQ, heads, 16)
    assert torch.equal(out, out[..., :1].expand_as(out))
    visible = torch.arange(1, DROPOUT_SEQ + 1, dtype=out.dtype).view(1, -1, 1)
    kept = out[..., 0] * visible * (1 - p)  # [batch, seq, heads]
    assert (kept - kept.round()).abs().max() < 1e-4, "kept counts are not integers"
    assert (kept >= 0).all() and (kept.round() <= visible).all()
    for r, (h0, h1) in enumerate(HeadPlan.build(heads, kv, world).q_ranges):
        n = float(visible.sum()) * 2 * (h1 - h0)
        frac = float(kept[..., h0:h1].round().sum()) / n
        bound = 5 * (p * (1 - p) / n) ** 0.5
        assert abs(frac - (1 - p)) < bound, f"world {world}, rank {r}'s heads [{h0}, {h1}): kept {frac:.4f}, expected {1 - p} +- {bound:.4f}"


def check_registered_implementation(group):
    """A model built with a user-registered attention implementation runs it on this rank's
    heads over the whole sequence (no mask: it registered no mask function; no local
    position_ids), and matches one process."""
    import torch.distributed as dist
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def my_attention(module, query, key, value, attention_mask, **kwargs):
        calls.append((tuple(query.shape), attention_mask, "position_ids" in kwargs, module.num_key_value_groups))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("ulysses_test_attention", my_attention)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ids, labels = global_batch()
    ref_loss, ref_grads, _, _ = reference(build("qwen2", 6, 2), ids, labels)
    model = hf.apply(build("qwen2", 6, 2, attn_implementation="ulysses_test_attention"), group)
    batch = hf.shard_batch(ids, labels, group=group)
    loss = batch.loss(model(**batch.model_inputs(loss=False)).logits)
    loss.backward()
    hf.sync_gradients(model, group)
    close(hf.reduce_loss(loss, group), ref_loss, 1e-12, f"registered attention, world {world}: loss")
    for name, p in model.named_parameters():
        close(p.grad, ref_grads[name], 1e-9, f"registered attention, world {world}: grad of {name}")
    plan = HeadPlan.build(6, 2, world)
    local = plan.q_count(rank)
    assert len(calls) == 2 and all(c == ((2, local, SEQ, 16), None, False, local // plan.kv_count(rank)) for c in calls), calls


def job(rank, world, example_argv):
    import torch.distributed as dist

    assert world == 4
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    pair = pairs[rank // 2]
    check_equivalence(None)  # 4 ranks
    check_equivalence(pair)  # 2 ranks (ranks 0-1 and 2-3 at the same time)
    for group in (None, pair):
        check_dropout(group)
        check_registered_implementation(group)
    check_errors(rank, world, pair)
    example = load_example()
    for argv in (example_argv, EXAMPLE_WINDOW_ARGV):
        losses = example.train(rank, world, example.parse_args(argv))
        assert losses[-1] < losses[0]


def load_example():
    spec = importlib.util.spec_from_file_location("train_hf", os.path.join(ROOT, "examples", "train_hf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE_ARGV = ["--steps", "3", "--seq", "11", "--model", "llama", "--heads", "4", "--kv-heads", "1", "--quiet"]
# GPT-OSS (sinks, alternating windows of 4 tokens, eager) as 2 replicas x 2-rank groups.
EXAMPLE_WINDOW_ARGV = ["--steps", "3", "--seq", "11", "--model", "gpt_oss", "--window", "4", "--heads", "4", "--kv-heads", "2", "--sp-size", "2", "--quiet"]


def test_ranks():
    run_ranks(job, 4, EXAMPLE_ARGV + ["--sp-size", "2"])


def test_example_arguments():
    args = load_example().parse_args(["--spawn", "2", "--pad", *EXAMPLE_ARGV])
    assert (args.spawn, args.pad, args.steps, args.seq, args.model, args.kv_heads) == (2, True, 3, 11, "llama", 1)


ONE_PROCESS_CASES = [("llama", 4, 2, {}), ("qwen3", 4, 2, {}), ("mistral", 4, 2, {"sliding_window": None})] + CASES[3:]


@pytest.mark.parametrize("family,heads,kv,extra", ONE_PROCESS_CASES)
def test_one_process_matches_sdpa(family, heads, kv, extra):
    """Without torch.distributed (a group of one) the routed model is the model as built
    (sdpa, or the case's implementation)."""
    ids, labels = global_batch()
    ref_loss, ref_grads, _, ref_hf_loss = reference(build(family, heads, kv, **extra), ids, labels)
    model = hf.apply(build(family, heads, kv, **extra))
    batch = hf.shard_batch(ids, labels)
    out = model(**batch.model_inputs(loss=False))
    loss = batch.loss(out.logits)
    loss.backward()
    close(loss, ref_loss, 1e-12, "loss")
    for name, p in model.named_parameters():
        close(p.grad, ref_grads[name], 1e-12, f"grad of {name}")
    with torch.no_grad():
        close(model(**batch.model_inputs()).loss, ref_hf_loss, 1e-6, "transformers loss")


@pytest.mark.parametrize(
    "family,heads,kv,extra,without",
    [
        ("mistral", 6, 2, CASES[3][3], {"sliding_window": None}),
        ("qwen2", 4, 1, CASES[4][3], {"use_sliding_window": False}),
        ("gemma2", 6, 3, CASES[5][3], {"attn_logit_softcapping": None}),
        ("gemma2", 6, 3, CASES[5][3], {"sliding_window": 64}),
        ("gemma3", 4, 1, CASES[6][3], {"sliding_window": 64}),
        ("gpt_oss", 10, 5, CASES[7][3], {"sinks": -1e4}),
        ("gpt_oss", 10, 5, CASES[7][3], {"sliding_window": 64}),
    ],
)
def test_features_change_the_model(family, heads, kv, extra, without):
    """Each feature the multi-rank cases rely on (a window of 5 over 13 tokens, softcapping,
    sinks) changes the one-process logits far beyond the tests' tolerances, so a path that
    ignored it would fail them."""
    ids, _ = global_batch()
    with torch.no_grad():
        with_it = build(family, heads, kv, **extra)(input_ids=ids).logits
        without_it = build(family, heads, kv, **{**extra, **without})(input_ids=ids).logits
    assert ((with_it - without_it).abs().max() / without_it.abs().max()).item() > 1e-6


def test_mask_function():
    """The "ulysses" mask function records each layer type's mask; the attention call builds
    it over the global sequence with the configured implementation's mask function, once
    per step; what cannot be rebuilt raises."""
    from transformers import masking_utils as mu

    sizes = {"batch_size": 2, "q_length": 4, "kv_length": 4}
    # Plain causal: no record (the attention call builds causal masks when it gets none).
    assert ulysses_mask(**sizes, mask_function=mu.causal_mask_function, allow_is_causal_skip=True) is None
    causal = _GlobalMask(None, {})
    sliding = ulysses_mask(**sizes, mask_function=mu.sliding_window_causal_mask_function(3), local_size=3)
    assert sliding.window == 3
    shard = hf.SequenceShard((4, 4), rank=1, world_size=2, valid_len=8, batch_size=2)
    cpu, f64 = torch.device("cpu"), torch.float64
    q, kv = torch.arange(8).view(8, 1), torch.arange(8).view(1, 8)
    expected = (kv <= q) & (kv > q - 3)  # global positions of both shards
    built = sliding.build("sdpa", shard, f64, cpu)
    assert built.shape == (1, 1, 8, 8) and torch.equal(built[0, 0], expected)
    assert sliding.build("sdpa", shard, f64, cpu) is built  # once per step
    assert causal.build("sdpa", shard, f64, cpu) is None  # sdpa's is_causal flag
    eager = causal.build("eager", shard, f64, cpu)
    assert torch.equal(eager[0, 0] == 0, kv <= q) and (eager[0, 0][kv > q] == torch.finfo(f64).min).all()
    assert sliding.build("flash_attention_2", shard, f64, cpu) is None  # the window travels as a parameter
    _raises("cannot rebuild", ulysses_mask, **sizes, mask_function=mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: q >= 0))
    # Llama 4's chunked mask: the chunk is recorded and built over global positions (chunks of 3 over 8 tokens)
    chunked = ulysses_mask(**sizes, mask_function=mu.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long)))
    assert chunked.chunk == 3 and not chunked.covers(8) and chunked.covers(3)
    assert torch.equal(chunked.build("sdpa", shard, f64, cpu)[0, 0], (kv <= q) & (kv // 3 == q // 3))
    _raises("chunked mask over left padding", ulysses_mask, **sizes, mask_function=mu.chunked_causal_mask_function(3, torch.tensor([0, 1])))
    _raises("KV cache", ulysses_mask, batch_size=2, q_length=1, kv_length=5, q_offset=4)
    _raises("padding attention_mask", ulysses_mask, **sizes, attention_mask=torch.tensor([[True] * 4, [False] + [True] * 3]))


def test_apply_errors():
    _raises("expected a transformers PreTrainedModel", hf.apply, torch.nn.Linear(4, 4))
    # Bidirectional models are supported since issue #26 (tests/test_hf_models.py); cross-attention is not.
    _raises("has cross-attention", hf.apply, build("llama", 4, 2, add_cross_attention=True))
    _raises("check expected", hf.apply, build("llama", 4, 2), check="sometimes")


def test_apply_leaves_a_shared_config_alone():
    """Two models built from one config object: apply on one leaves the other (and the
    config) as they were; the applied model holds copies, related as before."""
    ids, labels = global_batch()
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    applied, other = transformers.Qwen2ForCausalLM(config).double(), transformers.Qwen2ForCausalLM(config).double()
    assert applied.config is config and other.config is config  # transformers shares the object
    hf.apply(applied)
    assert config._attn_implementation == "sdpa" and other.config is config
    assert applied.config is not config and applied.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    assert all(m.config is applied.config for m in applied.modules() if hasattr(m, "config") and hasattr(m, "q_proj"))
    other.load_state_dict(applied.state_dict())
    with torch.no_grad():
        ref = other(input_ids=ids).logits  # before: "not prepared by ... apply"
        close(applied(**hf.shard_batch(ids, labels).model_inputs(loss=False)).logits, ref, 1e-12, "logits")


def test_call_errors_one_process():
    ids, labels = global_batch()
    # A model switched to "ulysses" by hand, without apply: its modules have no group settings.
    hf.register()
    bare = build("llama", 4, 2)
    bare.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    _raises("not prepared by", bare, **hf.shard_batch(ids, labels).model_inputs())
    # apply cannot tell which implementation such a model should run on each rank's heads.
    _raises("already set to 'ulysses' without apply", hf.apply, bare)
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
