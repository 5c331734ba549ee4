"""The transformers integration on packed documents (batch 1, documents end to end).

A tiny Qwen2 and a tiny Llama (float64) trained on one packed sequence over 4 gloo ranks
and over 2-rank groups (two pairs side by side, one spawn): the loss, every parameter
gradient and the gathered logits equal one process running each document on its own.
Documents are found from position ids that restart at 0 (``DataCollatorWithFlattening``'s
format) or given as ``cu_seqlens``; lengths 1, shorter than the group, crossing shards; the
sequence is sharded unevenly or padded (the padding a trailing document). Also: the step's
collectives (one check per step, then the exchanges only), and the packed errors.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import check_step, close  # noqa: E402

from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

VOCAB = 61
LENGTHS = [5, 1, 2, 9, 3, 7]  # 27 tokens: divides neither 2 nor 4; documents of 1 and 2 tokens
# (config, model, heads, kv heads, overrides). GQA 4/1: fewer KV heads than ranks. Plain causal
# layers run the fused op; Mistral's window (4, shorter than three of the documents) and
# Gemma 2's window + logit softcapping (eager) run the model's attention with the documents
# overlaid on its global mask.
CASES = [
    ("Qwen2Config", "Qwen2ForCausalLM", 6, 2, {}),
    ("LlamaConfig", "LlamaForCausalLM", 4, 1, {}),
    ("MistralConfig", "MistralForCausalLM", 6, 2, {"sliding_window": 4}),
    ("Gemma2Config", "Gemma2ForCausalLM", 6, 3, {
        "sliding_window": 4, "attn_logit_softcapping": 0.1, "attn_implementation": "eager", "hidden_size": 96, "query_pre_attn_scalar": 16,
    }),
]  # fmt: skip
PLAIN = 2  # CASES[:PLAIN] are plain causal (run padded and unpadded; the others unpadded only)


def tolerances(case) -> tuple[float, float]:
    """``(loss and logits, grads)``: Gemma computes in float32 inside (see tests/test_hf.py)."""
    return (2e-6, 2e-6) if case[0].startswith("Gemma") else (1e-12, 1e-9)


def build(config_name, model_name, heads, kv_heads, overrides=None):
    cfg = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": 16, "max_position_embeddings": 64, "attn_implementation": "sdpa",
    } | (overrides or {})  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**cfg)).double()


def packed_batch():
    """``(input_ids [1, S], labels [1, S], position_ids [1, S], cu_seqlens)`` as
    ``DataCollatorWithFlattening`` makes them (positions restart at 0 per document)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)), generator=g)
    labels = ids.clone()
    labels[0, 0] = -100  # a masked prompt token
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    return ids, labels, positions, cu


def reference(model, ids, labels, cu):
    """One process, each document on its own: the mean loss over every document's targets,
    the parameter gradients and the logits (joined)."""
    count = sum(int((labels[0, a + 1 : b] != -100).sum()) for a, b in zip(cu[:-1], cu[1:]))
    total, logits = 0.0, []
    for a, b in zip(cu[:-1], cu[1:]):
        out = model(input_ids=ids[:, a:b]).logits
        loss = torch.nn.functional.cross_entropy(out[0, :-1], labels[0, a + 1 : b], ignore_index=-100, reduction="sum") / count
        loss.backward()
        total += loss.detach()
        logits.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return total, grads, torch.cat(logits, dim=1)


def check_equivalence(group):
    import torch.distributed as dist

    world = dist.get_world_size(group)
    ids, labels, positions, cu = packed_batch()
    for i, case in enumerate(CASES):
        ref_loss, ref_grads, ref_logits = reference(build(*case), ids, labels, cu)
        model = hf.apply(build(*case), group)
        rtol, grad_rtol = tolerances(case)
        for pad, by in ((False, "positions"), (True, "cu_seqlens"))[: 2 if i < PLAIN else 1]:
            what = f"{case[1]} world {world} pad={pad} documents from {by}"
            kw = {"position_ids": positions} if by == "positions" else {"cu_seqlens": cu}
            batch = hf.shard_batch(ids, labels, group=group, pad=pad, **kw)
            expected_cu = cu + ([batch.shard.total] if batch.shard.total > cu[-1] else [])
            assert list(batch.shard.documents.cu_seqlens) == expected_cu, what
            # Each document's last token has no target.
            assert batch.num_tokens == sum(int((labels[0, a + 1 : b] != -100).sum()) for a, b in zip(cu[:-1], cu[1:])), what
            # transformers' own loss (float32 logits inside) against the same per-document reference.
            check_step(model, batch, group, (ref_loss, ref_grads, ref_logits), rtol, grad_rtol, what, ref_loss)


def check_collectives(group):
    """One training step of the packed model: one check (a tiny all_gather) for the step,
    then per layer the exchanges only; no per-layer exchange of positions or boundaries."""
    import torch.distributed as dist

    names = ("all_to_all_single", "batch_isend_irecv", "all_gather", "all_reduce", "broadcast", "all_gather_object")
    originals = {n: getattr(dist, n) for n in names}
    counts = dict.fromkeys(names, 0)

    def counting(n):
        def call(*args, **kwargs):
            counts[n] += 1
            return originals[n](*args, **kwargs)

        return call

    ids, labels, positions, _ = packed_batch()
    model = hf.apply(build(*CASES[0]), group)
    batch = hf.shard_batch(ids, labels, group=group, position_ids=positions)
    try:
        for n in names:
            setattr(dist, n, counting(n))
        model(**batch.model_inputs()).loss.backward()
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    layers = model.config.num_hidden_layers
    assert {n: c for n, c in counts.items() if c} == {"all_to_all_single": 3 * layers, "batch_isend_irecv": layers, "all_gather": 1}, counts


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(hf.HFIntegrationError, match=match):
        fn(*args, **kwargs)


def check_errors():
    ids, labels, positions, cu = packed_batch()
    _raises(r"packed position_ids must start at 0", hf.shard_batch, ids, labels, position_ids=positions + 1)
    _raises(r"cu_seqlens expected strictly increasing boundaries from 0 to the sequence length 27", hf.shard_batch, ids, cu_seqlens=[0, 5, 5, 27])
    _raises(r"cu_seqlens expected .* got \[0, 5, 26\]", hf.shard_batch, ids, cu_seqlens=[0, 5, 26])
    _raises(r"count 0, 1, ... within each document", hf.shard_batch, ids, cu_seqlens=[0, 5, 27], position_ids=positions)
    # A registered implementation gets no document mask: refused, not wrong.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("packed_test_sdpa", sdpa_attention_forward)
    model = hf.apply(build("MistralConfig", "MistralForCausalLM", 4, 2, {"sliding_window": 4, "attn_implementation": "packed_test_sdpa"}))
    batch = hf.shard_batch(ids, labels, position_ids=positions)
    _raises(r"run on the 'eager' or 'sdpa' implementation .* this model runs 'packed_test_sdpa'", model, **batch.model_inputs())


def job(rank, world):
    import torch.distributed as dist

    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    check_equivalence(None)  # 4 ranks
    check_equivalence(pairs[rank // 2])  # 2 ranks (two pairs at the same time)
    check_collectives(None)
    check_errors()


def test_packed_models_on_gloo():
    run_ranks(job, 4)


def test_packed_one_process():
    """World size 1 (no torch.distributed): the same equivalence, and the errors."""
    ids, labels, positions, cu = packed_batch()
    ref_loss, ref_grads, ref_logits = reference(build(*CASES[1]), ids, labels, cu)
    model = hf.apply(build(*CASES[1]))
    batch = hf.shard_batch(ids, labels, position_ids=positions)
    out = model(**batch.model_inputs(loss=False))
    loss = batch.loss(out.logits)
    loss.backward()
    close(loss.detach(), ref_loss, 1e-12, "loss")
    close(out.logits.detach(), ref_logits, 1e-12, "logits")
    for name, p in model.named_parameters():
        close(p.grad, ref_grads[name], 1e-9, f"grad of {name}")
    check_errors()
