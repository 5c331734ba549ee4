"""The transformers integration on packed documents at batch > 1 (each row its own
documents), plain and under selective activation checkpointing.

A tiny Qwen2 (GQA 6/2) and a tiny Llama (4/1) in float64, a batch of two packed rows with
different documents (lengths 1, shorter than the group, crossing shards), sharded over 2
and 4 gloo ranks (uneven, and padded: the padding a trailing document of each row): the
loss, every parameter gradient and the gathered logits equal one process running each
document of each row on its own. Documents come from per-row ``position_ids`` that restart
at 0 or from per-row ``cu_seqlens``. The same step with transformers' gradient
checkpointing under SAC (``gradient_checkpointing_kwargs``' ``context_fn``, a policy that
saves matmuls, and one that saves attention) gives the same numbers; the layers that cannot
run several packed rows (a sliding window) are refused by name.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import check_step  # noqa: E402
from test_hf_packed import VOCAB, build, tolerances  # noqa: E402
from test_selective_checkpoint import POLICIES  # noqa: E402
from torch.utils.checkpoint import create_selective_checkpoint_contexts  # noqa: E402

from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

ROWS = [[5, 1, 2, 9, 3, 7], [2, 11, 1, 13]]  # 27 tokens per row: divides neither 2 nor 4
CASES = [("Qwen2Config", "Qwen2ForCausalLM", 6, 2, {}), ("LlamaConfig", "LlamaForCausalLM", 4, 1, {})]


def packed_rows():
    """``(input_ids [2, S], labels, position_ids [2, S], per-row cu_seqlens)``."""
    g = torch.Generator().manual_seed(5)
    S = sum(ROWS[0])
    ids = torch.randint(0, VOCAB, (len(ROWS), S), generator=g)
    labels = ids.clone()
    labels[1, 3] = -100  # a masked token
    positions = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in ROWS])
    cus = []
    for lens in ROWS:
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        cus.append(cu)
    return ids, labels, positions, cus


def reference(model, ids, labels, cus):
    """One process, each document of each row on its own: the mean loss over every
    document's targets, the parameter gradients, the logits ``[2, S, vocab]``."""
    spans = [(b, a, e) for b, cu in enumerate(cus) for a, e in zip(cu[:-1], cu[1:])]
    count = sum(int((labels[b, a + 1 : e] != -100).sum()) for b, a, e in spans)
    total, logits = 0.0, [[] for _ in cus]
    for b, a, e in spans:
        out = model(input_ids=ids[b : b + 1, a:e]).logits
        loss = torch.nn.functional.cross_entropy(out[0, :-1], labels[b, a + 1 : e], ignore_index=-100, reduction="sum") / count
        loss.backward()
        total += loss.detach()
        logits[b].append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return total, grads, torch.cat([torch.cat(x, dim=1) for x in logits])


def _checkpointed(model, policy):
    model.train()
    ctx = functools.partial(create_selective_checkpoint_contexts, POLICIES[policy]())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": ctx})
    return model


def check_equivalence(group):
    import torch.distributed as dist

    world = dist.get_world_size(group)
    ids, labels, positions, cus = packed_rows()
    for case in CASES:
        refs = reference(build(*case), ids, labels, cus)
        rtol, grad_rtol = tolerances(case)
        for sac in (None, "save-matmuls", "save-attention"):
            model = hf.apply(build(*case), group)
            if sac is not None:
                model = _checkpointed(model, sac)
            for pad, by in ((False, "positions"), (True, "cu_seqlens")):
                what = f"{case[1]} world {world} pad={pad} documents from {by} sac={sac}"
                kw = {"position_ids": positions} if by == "positions" else {"cu_seqlens": cus}
                batch = hf.shard_batch(ids, labels, group=group, pad=pad, **kw)
                docs = batch.shard.documents
                total = batch.shard.total
                want = [cu + ([total] if total > cu[-1] else []) for cu in cus]
                assert docs.rows == 2 and docs.cu_seqlens == tuple(want[0] + [total + x for x in want[1][1:]]), what
                assert batch.num_tokens == sum(int((labels[b, a + 1 : e] != -100).sum()) for b, cu in enumerate(cus) for a, e in zip(cu[:-1], cu[1:]))
                check_step(model, batch, group, refs, rtol, grad_rtol, what, refs[0])


def check_errors():
    ids, labels, positions, cus = packed_rows()
    model = hf.apply(build("MistralConfig", "MistralForCausalLM", 6, 2, {"sliding_window": 4}))
    batch = hf.shard_batch(ids, labels, position_ids=positions)
    with pytest.raises(hf.HFIntegrationError, match=r"packed documents in a batch of 2 rows run on plain causal"):
        model(**batch.model_inputs())
    with pytest.raises(hf.HFIntegrationError, match=r"cu_seqlens expected one list of boundaries per row \(2\), got 1"):
        hf.shard_batch(ids, labels, cu_seqlens=cus[0])
    with pytest.raises(hf.HFIntegrationError, match=r"row 0: documents \[0, 5, 6, 8, 17, 20, 27\]\), got \[0, 1, 0, 1"):
        hf.shard_batch(ids, labels, cu_seqlens=cus, position_ids=positions.flip(0))


def job(rank, world):
    import torch.distributed as dist

    check_equivalence(None)
    if world == 4:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        check_equivalence(pairs[rank // 2])
    check_errors()


def test_packed_rows_models_on_gloo():
    run_ranks(job, 4)


def test_packed_rows_one_process():
    ids, labels, positions, cus = packed_rows()
    refs = reference(build(*CASES[1]), ids, labels, cus)
    model = hf.apply(build(*CASES[1]))
    batch = hf.shard_batch(ids, labels, position_ids=positions)
    out = model(**batch.model_inputs(loss=False))
    loss = batch.loss(out.logits)
    loss.backward()
    torch.testing.assert_close(loss.detach(), refs[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.logits.detach(), refs[2], rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, refs[1][name], rtol=1e-9, atol=1e-9, msg=lambda s, n=name: f"grad of {n}: {s}")
    check_errors()
