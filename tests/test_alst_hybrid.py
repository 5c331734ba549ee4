"""Hybrid models (Gated DeltaNet, Mamba2) through DeepSpeed's ALST entry point after
``enable_alst()``: ``UlyssesSPAttentionHF.register_with_transformers(model, ...)`` on 2 gloo CPU
ranks against one process, float64.

The loaded model's mixers are switched (``hf.mixers``) and fed by a pre-hook on the decoder
stack with the step's shard (built from the call's position ids before layer 0, which is a
Gated DeltaNet in Qwen3.5; the first attention call reuses it). The models, the float64
stand-ins for the mixers' float32 kernels and the tolerances are tests/test_hf_hybrid.py's;
the steps are tests/test_alst.py's (``sp_step``: each rank its contiguous ``split_lengths``
shard (the packed batch's 37 tokens: 19 + 18); ``reference_step``: one process, a packed batch each document alone).
Packed documents are compared at ``FLOAT32_RTOL`` (test_hf_hybrid.py's PACKED note).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")

from test_alst import alst_classes, reference_step, shifted, sp_step  # noqa: E402
from test_hf_hybrid import FLOAT32_RTOL, MODELS, build, close, float64_kernels, grad_tolerances, loss_rtol  # noqa: E402

from ulysses_kernels.testing import run_ranks  # noqa: E402

CASES = [c for c in MODELS if c[0] in ("qwen3.5", "bamba")]  # a GDN hybrid (layer 0 a GDN) and a Mamba2 one
DOCS = (15, 12, 10)  # 37 tokens: 19 + 18 on 2 ranks, document boundaries inside a shard and across
# NOTE: the one sequence is 36 tokens (18 + 18). At 37 (19 + 18) Bamba's gradients are within
# 3.8e-8 of one process (loss 2e-16), and so they are through hf.apply itself (measured with
# hf.shard_batch, 2 ranks; 36 tokens: 5e-16): a discrepancy of the Mamba2 mixer path at that
# length, not of this entry point, reported to #38 and not loosened here.
ONE = 36


def _job(rank, world):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    alst, _ = alst_classes("ours")
    vocab = CASES[0][4]["vocab_size"]
    torch.manual_seed(7)
    ids = torch.randint(0, vocab, (1, sum(DOCS)))
    labels = ids.clone()
    cu = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
    for a in cu[:-1]:
        labels[0, a] = -100  # no target crosses a document (DataCollatorWithFlattening)
    batches = {
        "one sequence": (ids[:, :ONE], shifted(ids[:, :ONE]), torch.arange(ONE).unsqueeze(0), None),
        "packed": (ids, shifted(labels), torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0), cu),
    }
    with float64_kernels():
        for case in CASES:
            model, reference = build(case), build(case)
            for m in (model, reference):  # the steps call the models without use_cache=False; a cache is refused
                m.config.use_cache = False
            refs = {what: reference_step(reference, x, t, pos, c) for what, (x, t, pos, c) in batches.items()}
            alst.register_with_transformers(model, None, world, 1)  # after the references: it intercepts sdpa process-wide
            uattn = ALL_ATTENTION_FUNCTIONS["sdpa"]
            try:
                assert sum(type(m).__name__ == case[3] for m in model.modules()) >= 1
                tols = grad_tolerances(model)
                for what, (x, t, pos, c) in batches.items():
                    loss, grads = sp_step(model, x, t, pos)
                    ref_loss, ref_grads = refs[what]
                    label = f"{case[0]} through ALST's entry point, 2 ranks, {what}"
                    close(loss, ref_loss, FLOAT32_RTOL if c else loss_rtol(case), f"{label}: loss")
                    for n, g in grads.items():
                        close(g, ref_grads[n], FLOAT32_RTOL if c else tols[n], f"{label}: grad of {n}")
            finally:
                uattn.unregister()


def test_hybrids_through_alst():
    run_ranks(_job, 2)
