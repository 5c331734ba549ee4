"""hf.apply beyond dense decoders: mixture-of-experts decoders, bidirectional encoders and a
vision tower, each a tiny random model from its transformers config trained one step over 4
gloo ranks and over two 2-rank groups side by side (one spawn), the loss and every parameter
gradient compared with one process.

* MoE (attention under Ulysses, the experts untouched: they see this rank's tokens only):
  Qwen3-MoE (4 experts, top 2) in float64 with transformers' eager experts (its default
  ``grouped_mm`` experts refuse float64 on the CPU), and again in float32 with ``grouped_mm``;
  GPT-OSS (4 experts, top 2, sinks + alternating 5-token windows, eager attention) in float64.
* Encoders (``is_causal=False``): BERT (MLM, fused bidirectional path; also packed documents
  instead of a padding mask), ModernBERT (global layers fused, local layers with a 3-token
  bidirectional window on the model's own sdpa over the rebuilt global mask), a ViT vision
  tower (patch embeddings on every rank, the layers sequence-parallel). SigLIP's attention
  drops the keywords that carry the step's shard: refused with an error that says so.
* The refusals: a padding mask, a padded batch, cross-attention.

The diffusion-transformer block (no transformers model) is tests/test_bidirectional.py.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import check_step, close, global_batch, reference  # noqa: E402

from ulysses_kernels import make_sp_groups  # noqa: E402
from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.layers.attention import ulysses_attention_forward  # noqa: E402
from ulysses_kernels.layers.masks import _GlobalMask, ulysses_mask  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

VOCAB = 61
SEQ = 13  # divides neither 2 nor 4 (shards 7/6 and 4/3/3/3)
MASK_ID = 3  # the [MASK] token of the MLM batches

# MoE decoders: (name, config class, model class, heads, kv heads, dtype, config). 6 query
# heads / 2 KV heads do not divide 4 ranks (2, 2, 1, 1 heads: uneven slices of GPT-OSS's sinks).
MOE = [
    ("qwen3_moe eager experts", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", 6, 2, torch.float64, {"experts_implementation": "eager"}),
    ("qwen3_moe grouped_mm", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", 6, 2, torch.float32, {}),
    ("gpt_oss", "GptOssConfig", "GptOssForCausalLM", 6, 2, torch.float64, {
        "experts_implementation": "eager", "sliding_window": 5, "attn_implementation": "eager",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
]  # fmt: skip


def moe_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(loss and logits, grads)``. float64: the experts and attention compute in float64; the
    routers' softmax and the RMSNorms round through float32 per token, which both runs do alike.
    float32: sharded and one-process runs sum in other orders.
    NOTE: measured at 4 ranks (rtol): float64 Qwen3-MoE and GPT-OSS 0 loss/logits, <= 6.2e-16 grads;
    float32 grouped_mm 1.2e-7 loss, 2.3e-7 logits, 6.7e-7 grads."""
    return (1e-12, 1e-9) if dtype == torch.float64 else (1e-6, 5e-6)


def build_moe(case, **overrides):
    _, config_name, model_name, heads, kv, dtype, extra = case
    cfg = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 16, "max_position_embeddings": 64,
        "attn_implementation": "sdpa", "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
    } | extra | overrides  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**cfg)).to(dtype)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(getattr(m, "sinks", None), torch.Tensor):
                m.sinks.normal_()
            # Routers start at zero in Qwen3-MoE (every expert tied): random, so that routing matters.
            if type(m).__name__.endswith("TopKRouter"):
                m.weight.normal_(std=0.5)
    return model


def check_moe(group):
    import torch.distributed as dist

    world = dist.get_world_size(group)
    ids, labels = global_batch()
    for case in MOE:
        ref_loss, ref_grads, ref_logits, ref_hf_loss = reference(build_moe(case), ids, labels)
        model = hf.apply(build_moe(case), group)
        experts = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
        assert experts, case[0]
        batch = hf.shard_batch(ids, labels, group=group)
        rtol, grad_rtol = moe_tolerances(case[5])
        check_step(model, batch, group, (ref_loss, ref_grads, ref_logits), rtol, grad_rtol, f"{case[0]}, world {world}", ref_hf_loss)
        # The experts are the model's own modules, unchanged by apply (only attention is switched).
        assert all(torch.equal(p, experts[n]) for n, p in model.named_parameters() if n in experts)


def check_router_loss(group):
    """``hf.router_loss``: the shares of the load-balancing loss sum to transformers' one-process
    ``aux_loss`` and their gradients (summed) to its gradient, uneven and padded (the padding
    rows left out). transformers sums the router probabilities in float32, ``router_loss`` in
    the logits' dtype (float64): they agree to float32 rounding.
    NOTE: measured at 4 ranks: 8.2e-9 loss, 3.7e-7 grads (rtol)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    ids, _ = global_batch()
    ref_model = build_moe(MOE[0])
    ref = ref_model(input_ids=ids, output_router_logits=True).aux_loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}
    model = hf.apply(build_moe(MOE[0]), group)
    for pad in (False, True):
        what = f"router_loss, world {world}, pad={pad}"
        batch = hf.shard_batch(ids, group=group, pad=pad)
        out = model(**batch.model_inputs(loss=False), output_router_logits=True)
        share = hf.router_loss(out.router_logits, batch.shard, group, num_experts=4, top_k=2)
        # transformers' own aux_loss is over this rank's tokens: summed, not one process's.
        per_shard = hf.reduce_loss(out.aux_loss, group)
        assert abs(per_shard / ref - 1) > 0.5, f"{what}: per-shard aux losses sum to {per_shard:.4f}, one process {ref:.4f}"
        share.backward()
        hf.sync_gradients(model, group)
        close(hf.reduce_loss(share, group), ref.double(), 1e-6, f"{what}: loss")
        assert {n for n, p in model.named_parameters() if p.grad is not None} == set(ref_grads), what
        for name, p in model.named_parameters():
            if name in ref_grads:
                close(p.grad, ref_grads[name], 2e-6, f"{what}: grad of {name}")
        model.zero_grad(set_to_none=True)


# Encoders: (name, config class, model class, config). BERT 4 heads of 16; ModernBERT 6 heads
# of 16 (2, 2, 1, 1 per rank at 4), a global layer every 2nd layer, the others local with
# distance <= 3 (local_attention 6): shorter than the sequence, crossing the shard boundaries.
ENCODERS = [
    ("bert", "BertConfig", "BertForMaskedLM", {
        "hidden_size": 64, "num_attention_heads": 4, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
    }),
    ("modernbert", "ModernBertConfig", "ModernBertForMaskedLM", {
        "hidden_size": 96, "num_attention_heads": 6, "num_hidden_layers": 3, "local_attention": 6, "global_attn_every_n_layers": 2,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2,
    }),
]  # fmt: skip


def build_encoder(case, **overrides):
    _, config_name, model_name, extra = case
    cfg = {
        "vocab_size": VOCAB, "intermediate_size": 96, "num_hidden_layers": 2, "max_position_embeddings": 64,
        "attn_implementation": "sdpa",
    } | extra | overrides  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**cfg)).double()


def mlm_batch(batch_size=2, seq=SEQ):
    """``(input_ids, labels)``: a masked-LM batch, a quarter of the tokens replaced by
    ``MASK_ID`` and predicted (labels ``-100`` elsewhere; not shifted)."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(4, VOCAB, (batch_size, seq), generator=g)
    masked = torch.rand(batch_size, seq, generator=g) < 0.25
    masked[:, 0] = True  # at least one target per row, one on rank 0's shard
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, MASK_ID), ids), labels


def mlm_loss(logits, labels, count):
    """Sum of the cross entropies of ``labels``' targets over ``count`` (the global count)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / count


def encoder_reference(model, ids, labels, cu=None):
    """One process: the loss over every target, the gradients, the logits; with ``cu``
    (batch 1) each document on its own (positions restarting, as a padded batch of them)."""
    count = int((labels != -100).sum())
    spans = [(0, ids.shape[1])] if cu is None else list(zip(cu[:-1], cu[1:]))
    total, logits = 0.0, []
    for a, b in spans:
        out = model(input_ids=ids[:, a:b]).logits
        loss = mlm_loss(out, labels[:, a:b], count)
        loss.backward()
        total += loss.detach()
        logits.append(out.detach())
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return total, grads, torch.cat(logits, dim=1)


def check_grads(model, ref_grads, what):
    """Every parameter gradient (after ``sync_gradients``) against one process's, rtol 1e-9.
    The key bias's gradient is zero in exact arithmetic (softmax ignores a shift that is the
    same for every key): one process leaves rounding noise there, compared in absolute terms."""
    floor = 1e-12 * max(g.abs().max().item() for g in ref_grads.values() if g is not None)
    for name, p in model.named_parameters():
        if ref_grads[name] is None:  # unused by the loss (BERT's pooler)
            assert p.grad is None or not p.grad.any(), f"{what}: {name} has a gradient, one process none"
        elif ref_grads[name].abs().max() < floor:
            assert p.grad.abs().max() < floor, f"{what}: grad of {name} is not ~0 as in one process"
        else:
            close(p.grad, ref_grads[name], 1e-9, f"{what}: grad of {name}")


def check_encoder_step(model, batch, labels, group, refs, what):
    """One step of the documented encoder path: ``shard_batch(input_ids)`` (no labels: MLM
    targets are not shifted), this rank's labels with ``batch.shard.shard``, the loss over
    the global target count, ``sync_gradients``."""
    ref_loss, ref_grads, ref_logits = refs
    local_labels = batch.shard.shard(labels, pad_value=-100)
    out = model(**batch.model_inputs(loss=False))
    loss = mlm_loss(out.logits, local_labels, int((labels != -100).sum()))
    loss.backward()
    hf.sync_gradients(model, group)
    close(hf.reduce_loss(loss, group), ref_loss, 1e-12, f"{what}: loss")
    check_grads(model, ref_grads, what)
    model.zero_grad(set_to_none=True)
    close(hf.gather_sequence(out.logits.detach(), batch.shard, group), ref_logits, 1e-12, f"{what}: logits")


PACKED = [4, 1, 6, 2]  # 13 tokens in 4 documents, crossing the shards


def check_encoders(group):
    import torch.distributed as dist

    world = dist.get_world_size(group)
    ids, labels = mlm_batch()
    for case in ENCODERS:
        refs = encoder_reference(build_encoder(case), ids, labels)
        model = hf.apply(build_encoder(case), group)
        check_encoder_step(model, hf.shard_batch(ids, group=group), labels, group, refs, f"{case[0]}, world {world}")
    # Packed documents (batch 1): what a padded encoder batch becomes under sequence
    # parallelism. Each document attends only to itself, positions restart per document.
    cu = [0]
    for n in PACKED:
        cu.append(cu[-1] + n)
    for case in ENCODERS:
        refs = encoder_reference(build_encoder(case), ids[:1], labels[:1], cu)
        model = hf.apply(build_encoder(case), group)
        for pad in (False, True):
            batch = hf.shard_batch(ids[:1], group=group, cu_seqlens=cu, pad=pad)
            check_encoder_step(model, batch, labels[:1], group, refs, f"{case[0]} packed pad={pad}, world {world}")


VIT = {
    "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 6, "image_size": 12,
    "patch_size": 2, "num_channels": 3, "attn_implementation": "sdpa",
}  # fmt: skip  # 36 patches + [CLS] = 37 tokens: divide neither 2 nor 4


def build_vit():
    torch.manual_seed(0)
    return transformers.ViTModel(transformers.ViTConfig(**VIT), add_pooling_layer=False).double()


def vision_tower(model, pixels, shard=None):
    """ViT's tower as ``ViTModel.forward`` runs it, its layers over this rank's tokens: the
    embeddings (patches, [CLS], positions) on every rank over the whole image, then
    ``shard.shard`` (``None``: one process), the layers with the step's ``ulysses_shard``
    keyword, the final layernorm. ``[B, tokens or seq_lens[rank], C]``."""
    hidden = model.embeddings(pixels)
    kwargs = {}
    if shard is not None:
        hidden, kwargs = shard.shard(hidden), {"ulysses_shard": shard}
    for layer in model.layers:
        hidden = layer(hidden, None, **kwargs)
    return model.layernorm(hidden)


def vision_loss(hidden, weight):
    """A loss that reads every token of the tower's output: ``sum(hidden * weight) / 37`` (the
    global token count)."""
    return (hidden * weight).sum() / 37


def check_vision_tower(group):
    """A ViT vision tower (the image encoder of many VLMs) sequence-parallel: gradients of
    every parameter (embeddings included) and the output equal to one process."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(5)
    pixels = torch.randn(2, 3, 12, 12, generator=g, dtype=torch.float64)
    weight = torch.randn(2, 37, VIT["hidden_size"], generator=g, dtype=torch.float64)
    ref_model = build_vit()
    ref_hidden = ref_model(pixel_values=pixels).last_hidden_state
    close(vision_tower(ref_model, pixels), ref_hidden, 1e-15, "vision_tower() is ViTModel.forward")
    vision_loss(ref_hidden, weight).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}

    model = hf.apply(build_vit(), group)
    shard = hf.SequenceShard(tuple(hf.split_lengths(37, world)), rank, world, 37, 2)
    hidden = vision_tower(model, pixels, shard)
    vision_loss(hidden, shard.shard(weight)).backward()
    hf.sync_gradients(model, group)
    what = f"vit vision tower, world {world}"
    close(hf.gather_sequence(hidden.detach(), shard, group), ref_hidden.detach(), 1e-12, f"{what}: output")
    check_grads(model, ref_grads, what)


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(hf.HFIntegrationError, match=match):
        fn(*args, **kwargs)


def check_encoder_errors(group):
    """What bidirectional attention cannot honour raises the same error on every rank
    (before any collective of the attention call)."""
    ids, labels = mlm_batch()
    model = hf.apply(build_encoder(ENCODERS[0]), group)
    batch = hf.shard_batch(ids, group=group)
    mask = torch.ones_like(batch.input_ids)
    mask[:, -1] = 0
    _raises(r"padding attention_mask .* for a bidirectional one \(an encoder\) pack the sequences", model,
            **batch.model_inputs(loss=False), attention_mask=mask)  # fmt: skip
    padded = hf.shard_batch(ids, group=group, pad=True)
    _raises(r"bidirectional attention over a padded batch \(3 pad tokens after 13\)", model, **padded.model_inputs(loss=False))
    # A 2-D group (Ulysses x ring): causal models only.
    sp = make_sp_groups(2, 2)
    on_sp = hf.apply(build_encoder(ENCODERS[0]), sp)
    _raises("bidirectional attention runs on a flat sequence-parallel group", on_sp,
            **hf.shard_batch(ids, group=sp, pad=True).model_inputs(loss=False))  # fmt: skip


def job(rank, world):
    import torch.distributed as dist

    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    for group in (None, pairs[rank // 2]):  # 4 ranks, then two 2-rank groups side by side
        check_moe(group)
        check_router_loss(group)
        check_encoders(group)
        check_vision_tower(group)
    check_encoder_errors(None)


def test_models_on_gloo():
    run_ranks(job, 4)


def test_one_process_encoders():
    """Without torch.distributed: every encoder as built, packed documents, the errors."""
    ids, labels = mlm_batch()
    for case in ENCODERS:
        refs = encoder_reference(build_encoder(case), ids, labels)
        check_encoder_step(hf.apply(build_encoder(case)), hf.shard_batch(ids), labels, None, refs, case[0])


def test_siglip_drops_the_shard():
    """SigLIP's attention module (transformers 5.23) does not pass its keywords on to the
    attention function, so the step's shard never reaches it: the call raises and says so."""
    vision = transformers.SiglipVisionConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
                                             image_size=12, patch_size=2, attn_implementation="sdpa")  # fmt: skip
    # With its attention-pooling head (nn.MultiheadAttention over every token, on the shard alone
    # under sequence parallelism) hf.apply's audit refuses the tower by the head's name.
    _raises(r"SiglipMultiheadAttentionPoolingHead at head \(attention that apply cannot switch", hf.apply,
            transformers.SiglipVisionModel(vision))  # fmt: skip
    vision.vision_use_head = False
    model = hf.apply(transformers.SiglipVisionModel(vision).double())
    hidden = model.embeddings(torch.randn(2, 3, 12, 12, dtype=torch.float64))
    shard = hf.SequenceShard((36,), 0, 1, 36, 2)
    _raises("drops the keywords", model.encoder, inputs_embeds=hidden, ulysses_shard=shard)


def test_bidirectional_masks():
    """The mask function records bidirectional masks (full, and ModernBERT's sliding window
    of a distance) and the attention call builds them over the global sequence; a mask
    whose causality differs from the call's, and cross-attention, raise."""
    from transformers import masking_utils as mu

    sizes = {"batch_size": 2, "q_length": 4, "kv_length": 4}
    full = ulysses_mask(**sizes, mask_function=mu.bidirectional_mask_function, allow_is_bidirectional_skip=True)
    assert (full.window, full.causal) == (None, False) and full.covers(5)
    local = ulysses_mask(**sizes, mask_function=mu.sliding_window_bidirectional_mask_function(2), local_size=2)
    assert (local.window, local.causal) == (2, False) and local.covers(3) and not local.covers(4)
    shard = hf.SequenceShard((4, 4), rank=1, world_size=2, valid_len=8, batch_size=2)
    q, kv = torch.arange(8).view(8, 1), torch.arange(8).view(1, 8)
    built = local.build("sdpa", shard, torch.float64, torch.device("cpu"))
    assert torch.equal(built[0, 0], (q - kv).abs() <= 2)  # both ways, over global positions
    assert full.build("sdpa", shard, torch.float64, torch.device("cpu")) is None  # sdpa's is_causal=False
    assert full.build("eager", shard, torch.float64, torch.device("cpu")) is None  # eager adds no bias
    eager = local.build("eager", shard, torch.float64, torch.device("cpu"))
    assert torch.equal(eager[0, 0] == 0, (q - kv).abs() <= 2)

    model = hf.apply(build_encoder(ENCODERS[0]))
    attn = model.bert.encoder.layer[0].attention.self
    ids, _ = mlm_batch()
    shard = hf.shard_batch(ids).shard
    x = torch.zeros(2, 4, SEQ, 16, dtype=torch.float64)
    _raises("the attention call is bidirectional .* but the model built a causal mask", ulysses_attention_forward,
            attn, x, x, x, _GlobalMask(5, {}), ulysses_shard=shard)  # fmt: skip
    _raises("7 keys for 13 queries: cross-attention", ulysses_attention_forward, attn, x, x[:, :, :7], x[:, :, :7], full, ulysses_shard=shard)


def test_apply_refuses_the_router_loss():
    """MoE's load-balancing loss would be computed per shard: refused at apply."""
    _raises(r"output_router_logits = True: the MoE load-balancing loss", hf.apply, build_moe(MOE[0], output_router_logits=True))
    batch = hf.shard_batch(global_batch()[0])
    _raises(r"router_logits\[0\] expected shape \[26, 4\]", hf.router_loss, (torch.zeros(13, 4),), batch.shard, num_experts=4, top_k=2)


def test_apply_refuses_cross_attention():
    config = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    _raises("has cross-attention", hf.apply, transformers.BertModel(transformers.BertConfig(**config, is_decoder=True, add_cross_attention=True)))
    bart = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                   decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)  # fmt: skip
    _raises("has cross-attention", hf.apply, transformers.BartForConditionalGeneration(bart))


def test_features_change_the_encoders():
    """ModernBERT's local window (distance 3 of 13 tokens) and the packed documents change the
    logits far beyond the tolerances, so a path that ignored either would fail the checks."""
    ids, _ = mlm_batch()
    with torch.no_grad():
        local = build_encoder(ENCODERS[1])(input_ids=ids).logits
        wide = build_encoder(ENCODERS[1], local_attention=64)(input_ids=ids).logits
        whole = build_encoder(ENCODERS[0])(input_ids=ids[:1]).logits
        alone = build_encoder(ENCODERS[0])(input_ids=ids[:1, :4]).logits
    assert ((local - wide).abs().max() / wide.abs().max()).item() > 1e-3
    assert ((whole[:, :4] - alone).abs().max() / alone.abs().max()).item() > 1e-3


def test_torch_compile_of_a_switched_model_is_refused_by_name():
    """torch.compile of a model hf.apply switched is refused with its own message (it used to
    fail with the packed-documents one: transformers marks every mask packed while tracing)."""
    pytest.importorskip("torch._dynamo")
    from ulysses_kernels.testing import build_tiny

    model = hf.apply(build_tiny("llama"), None)
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    batch = hf.shard_batch(ids, ids)
    with pytest.raises(hf.HFIntegrationError, match=r"LlamaAttention: torch.compile of a model that hf.apply switched is not supported yet"):
        torch.compile(model)(**batch.model_inputs())
    torch._dynamo.reset()
    assert torch.isfinite(model(**batch.model_inputs()).loss)  # eagerly, the same model runs
