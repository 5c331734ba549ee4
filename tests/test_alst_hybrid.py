"""Hybrid models (Gated DeltaNet, Mamba2, Jamba's Mamba1) through DeepSpeed's ALST entry point after
``enable_alst()``: ``UlyssesSPAttentionHF.register_with_transformers(model, ...)`` on 2 gloo CPU
ranks against one process, float64.

The loaded model's mixers are switched (``layers.mixers``) and fed by a pre-hook on the decoder
stack with the step's shard (built from the call's position ids before layer 0, which is a
Gated DeltaNet in Qwen3.5; the first attention call reuses it). The models, the float64
stand-ins for the mixers' float32 kernels and the tolerances are tests/test_hf_hybrid.py's;
the steps are tests/test_alst.py's (``sp_step``: each rank its contiguous ``split_lengths``
shard (the packed batch's 37 tokens: 19 + 18); ``reference_step``: one process, a packed batch each document alone).
Packed documents are compared at ``FLOAT32_RTOL`` (test_hf_hybrid.py's PACKED note).

Given by path (``register_with_transformers(path, ...)`` before the model exists, DeepSpeed's
documented order): the config is audited on the meta device and the decoder class wrapped; the
model built afterwards from that path has its mixers switched at its first call, the same step
exact as the loaded model's; ``unregister`` gives the class its forward back.
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

# A GDN hybrid (layer 0 a GDN), a Mamba2 one, Mamba1 (its layer drops the kwargs), and
# GraniteMoeHybrid: its model does not pass position_ids to its decoder layers (transformers
# 5.23; Granite, GraniteMoe and Bamba do), so its attention runs on the shard the decoder
# pre-hook made from the model's position ids (it was refused at the first step before);
# RecurrentGemma (RG-LRU blocks beside local attention).
CASES = [c for c in MODELS if c[0] in ("qwen3.5", "bamba", "jamba", "granitemoehybrid", "recurrent-gemma")]
DOCS = (15, 12, 10)  # 37 tokens: 19 + 18 on 2 ranks, document boundaries inside a shard and across
# NOTE: the one sequence is 36 tokens (18 + 18). At 37 (19 + 18) and 38 (19 + 19) Bamba's
# gradients are within 3.8e-8 / 2.8e-8 of one process (the layer-0 Mamba2's in_proj, conv, D,
# the embedding; 38: logits 1.3e-8), through hf.apply as well (hf.shard_batch, 2 ranks); 36:
# 5.4e-16. Traced: BambaRMSNormGated normalizes in float32 over a grouped view
# ([B, s, groups, group_size]), and its float32 results for a token depend on how many tokens
# the call has: the norm alone on 19 + 18 tokens against the same 37 in one call differs by
# 6.0e-9 forward, 1.1e-8 in the input's gradient (1-2 tokens; 18 + 18 and 18 + 19: 0; Bamba's
# plain RMSNorm: 0 in every split). With that norm computed in float64 in both runs the
# 37- and 38-token steps are within 5.6e-16 (loss 2.2e-16, logits 0). So it is the model's
# float32 norm against itself, not the exchange; the test keeps 36 tokens and 1e-9.
ONE = 36


def _job(rank, world, paths=None, mixer_parallel=None):
    from ulysses_kernels.integrations.deepspeed import enable_alst

    if mixer_parallel is None:
        return _check(rank, world, CASES, paths, None)
    # enable_alst's keyword: the GDN and Mamba2 hybrids with state passing; the rank's switch back
    # to its defaults afterwards (the ranks of the pool run later tests).
    alst_classes("ours")
    enable_alst(mixer_parallel=mixer_parallel)
    try:
        _check(rank, world, [c for c in CASES if c[0] in ("qwen3.5", "bamba")], paths, mixer_parallel)
    finally:
        enable_alst()


def _check(rank, world, cases, paths, mixer_parallel):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ulysses_kernels.layers.mixers.exchange import MIXER_SETTINGS_ATTR

    alst = alst_classes("ours")[0] if mixer_parallel is None else _ours()
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
        for case in cases:
            model, reference = build(case), build(case)
            for m in (model, reference):  # the steps call the models without use_cache=False; a cache is refused
                m.config.use_cache = False
            refs = {what: reference_step(reference, x, t, pos, c) for what, (x, t, pos, c) in batches.items()}
            decoder_forward = type(model.model).__dict__.get("forward")
            if paths is None:
                alst.register_with_transformers(model, None, world, 1)  # after the references: it intercepts sdpa process-wide
            else:  # by path, then the model built from it (its weights: the reference's)
                from transformers import AutoConfig, AutoModelForCausalLM

                alst.register_with_transformers(paths[case[0]], "sdpa", world, 1)
                # experts_implementation is a run-time choice, not saved: float64 needs the eager experts
                extra = {k: v for k, v in case[4].items() if k == "experts_implementation"}
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(paths[case[0]], **extra)).double().train()
                model.load_state_dict(build(case).state_dict())
                model.config.use_cache = False
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
                # the mixers ran switched (their sequence-parallel forward on the instance), with the strategy asked for
                assert all("forward" in vars(m) for m in model.modules() if type(m).__name__ == case[3])
                strategies = {getattr(m, MIXER_SETTINGS_ATTR).strategy for m in model.modules() if type(m).__name__ == case[3]}
                assert strategies == {"state" if mixer_parallel == "state" else "heads"}, (case[0], strategies)
            finally:
                uattn.unregister()
            assert type(model.model).__dict__.get("forward") is decoder_forward  # the class as it was


def _ours():
    """Our ``UlyssesSPAttentionHF`` as DeepSpeed's module names it after ``enable_alst`` (no second call)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF


def test_hybrids_through_alst():
    run_ranks(_job, 2)


def test_state_passing_through_alst():
    """``enable_alst(mixer_parallel="state")``: Qwen3.5's Gated DeltaNet and Bamba's Mamba2 with
    the sequence kept sharded (tests/test_state_passing.py), at this file's tolerances."""
    run_ranks(_job, 2, None, "state")


def test_hybrids_through_alst_by_path(tmp_path):
    """The same steps with the model given to ``register_with_transformers`` by path (a tiny
    config saved to a directory), built after the registration."""
    paths = {}
    for case in CASES:
        paths[case[0]] = str(tmp_path / case[0])
        build(case).config.save_pretrained(paths[case[0]])
    run_ranks(_job, 2, paths)
