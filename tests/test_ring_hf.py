"""``hf.apply(model, make_sp_groups(2, 2))``: a tiny float64 model on 4 gloo ranks (2 Ulysses
ranks x 2 ring ranks) against one process: loss, every parameter gradient and the gathered
logits. Packed batches too (``tests/test_hf_packed.py``'s documents: 1 and 2 tokens, longer
than a ring block, padded to the group), contiguous and zigzag, one training step against
one process running each document on its own. One launch; transformers is imported once
per rank."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

VOCAB = 61


def _model(heads, kv_heads, **extra):
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=64, attn_implementation="sdpa", **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).double()


def _reference(model, ids, labels):
    logits = model(input_ids=ids).logits
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    loss = loss / (target != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, logits.detach()


def _close(a, b, rtol, what):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


def _job(rank, world):
    sp = uk.make_sp_groups(2, 2)
    g = torch.Generator().manual_seed(7)
    # 3 query heads per Ulysses rank over 1 KV head: fewer KV heads than Ulysses ranks.
    for heads, kv, seq, pad in ((6, 1, 16, False), (4, 2, 13, True)):
        ids = torch.randint(0, VOCAB, (2, seq), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        ref_loss, ref_grads, ref_logits = _reference(_model(heads, kv), ids, labels)
        model = hf.apply(_model(heads, kv), sp)
        batch = hf.shard_batch(ids, labels, group=sp, pad=pad)
        out = model(**batch.model_inputs(loss=False))
        loss = batch.loss(out.logits)
        loss.backward()
        hf.sync_gradients(model, sp)
        what = f"{heads}/{kv} heads, seq {seq}"
        _close(hf.reduce_loss(loss, sp), ref_loss, 1e-12, f"{what}: loss")
        for name, p in model.named_parameters():
            _close(p.grad, ref_grads[name], 1e-9, f"{what}: grad of {name}")
        _close(hf.gather_sequence(out.logits, batch.shard, sp), ref_logits, 1e-12, f"{what}: logits")
    with pytest.raises(hf.HFIntegrationError, match=r"needs a sequence length that is a multiple of 4, got 13 tokens; use pad=True"):
        hf.shard_batch(torch.zeros(1, 13, dtype=torch.int64), group=sp)
    _packed(sp)
    windowed = hf.apply(_model(4, 2, use_sliding_window=True, sliding_window=3, max_window_layers=1), sp)
    with pytest.raises(hf.HFIntegrationError, match="only plain causal attention runs"):
        windowed(**hf.shard_batch(torch.zeros(1, 16, dtype=torch.int64), group=sp).model_inputs())


def _packed(sp):
    """One packed training step per layout (the documents found from restarting positions, or
    given as cu_seqlens), equal to one process running each document on its own."""
    from test_hf import check_step
    from test_hf_packed import CASES, build, packed_batch, reference, tolerances

    ids, labels, positions, cu = packed_batch()  # 27 tokens: padded to 28, blocks of 14, segments of 7
    for case in CASES[:2]:  # Qwen2 6/2 (3 query heads per Ulysses rank), Llama 4/1
        ref_loss, ref_grads, ref_logits = reference(build(*case), ids, labels, cu)
        rtol, grad_rtol = tolerances(case)
        for layout, kw in (("contiguous", {"position_ids": positions}), ("zigzag", {"cu_seqlens": cu})):
            group = sp.with_layout(layout)
            model = hf.apply(build(*case), group)
            batch = hf.shard_batch(ids, labels, group=group, pad=True, **kw)
            assert batch.shard.documents.cu_seqlens == (*cu, 28)
            check_step(model, batch, group, (ref_loss, ref_grads, ref_logits), rtol, grad_rtol, f"{case[1]} packed {layout}", ref_loss)
    with pytest.raises(hf.HFIntegrationError, match=r"multiple of 4, got 27 tokens; use pad=True"):
        hf.shard_batch(ids, group=sp.with_layout("zigzag"), cu_seqlens=cu)
    mismatched = hf.apply(build(*CASES[0]), sp)  # contiguous
    batch = hf.shard_batch(ids, labels, group=sp.with_layout("zigzag"), pad=True, position_ids=positions)
    with pytest.raises(hf.HFIntegrationError, match=r"sharded zigzag but apply\(\) was given a group with seq_layout 'contiguous'"):
        mismatched(**batch.model_inputs())


def test_hf_apply_with_sp_groups():
    run_ranks(_job, 4, timeout_s=300)
