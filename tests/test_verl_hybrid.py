"""Hybrid models (Gated DeltaNet, Mamba2) under verl's switch: ``ulysses_sequence_parallel_size``
2 on 2 gloo CPU ranks against one process, float64.

Each rank drives verl's own data path (``ulysses_pad_and_slice_inputs``, the sequence-parallel
group its ``FSDPUlyssesShardingManager`` sets, ``gather_outputs_and_unpad``) on a model
prepared by verl's ``apply_monkey_patch`` with the switch imported (tests/test_verl.py's
set-up; verl's device helpers on the CPU, ``tests/verl_cpu.py``). The models, the float64
stand-ins for the mixers' float32 kernels and the tolerances are tests/test_hf_hybrid.py's
(read there why the float32-cast parameters and packed documents are compared at
``FLOAT32_RTOL``). Two batches per model:

* one sequence of 36 tokens (18 per rank): loss and logits at ``loss_rtol``, every gradient at
  ``grad_tolerances``;
* two packed documents (20 + 17 tokens, position ids restarting at 0; verl pads 1 token, a
  document of its own), against each document run alone in one process: ``FLOAT32_RTOL``.

The loss is verl's test's (the mean of the gathered logits); the gradient compared is each
rank's averaged over the sp group (what FSDP reduces).
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed (scripts/setup.sh installs it)")

from test_hf_hybrid import FLOAT32_RTOL, MODELS, build, close, float64_kernels, grad_tolerances, loss_rtol  # noqa: E402
from test_verl import _mesh, _verl_on_cpu  # noqa: E402

from ulysses_kernels.testing import run_ranks  # noqa: E402

# A GDN hybrid (layer 0 a GDN), Mamba2 ones (GraniteMoeHybrid: MoE), Mamba1 (its layer drops the kwargs),
# RecurrentGemma (its RG-LRU restarts where a position is 0: each rank's flags from verl's sliced positions).
CASES = [c for c in MODELS if c[0] in ("qwen3.5", "bamba", "granitemoehybrid", "jamba", "recurrent-gemma")]
DOCS = (20, 17)


def _sp_forward(model, ids, pos):
    """verl's path: pad to a multiple of sp and slice, run, gather and unpad -> ``[1, nnz, vocab]``."""
    from verl.utils.ulysses import gather_outputs_and_unpad, get_ulysses_sequence_parallel_world_size, ulysses_pad_and_slice_inputs

    ids_sliced, pos_sliced, pad = ulysses_pad_and_slice_inputs(ids, pos, sp_size=get_ulysses_sequence_parallel_world_size())
    logits = model(ids_sliced, position_ids=pos_sliced, use_cache=False).logits
    return gather_outputs_and_unpad(logits, gather_dim=1, unpad_dim=1, padding_size=pad)


def _grads(model, sp_group=None, sp=1) -> dict:
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        if sp_group is not None:
            dist.all_reduce(g, group=sp_group)
            g /= sp
        grads[n] = g
    model.zero_grad(set_to_none=True)
    return grads


def _job(rank, world, mixer_parallel=None):
    from ulysses_kernels.integrations import verl as switch

    _verl_on_cpu()
    if mixer_parallel is None:
        return _check(rank, world, CASES, None)
    # The switch's keyword: the GDN and Mamba2 hybrids with state passing; the rank's switch back
    # to its defaults afterwards (the ranks of the pool run later tests).
    switch.apply(mixer_parallel=mixer_parallel)
    try:
        _check(rank, world, [c for c in CASES if c[0] in ("qwen3.5", "bamba")], mixer_parallel)
    finally:
        switch.apply()


def _check(rank, world, cases, mixer_parallel):
    import verl.models.transformers.monkey_patch as mp
    from verl.utils.ulysses import FSDPUlyssesShardingManager

    from ulysses_kernels.layers.mixers.exchange import MIXER_SETTINGS_ATTR

    mesh = _mesh(world, world)
    group = mesh["sp"].get_group()
    vocab = CASES[0][4]["vocab_size"]
    torch.manual_seed(7)  # the same batch on every rank (verl's sp ranks hold the same packed batch)
    ids = torch.randint(0, vocab, (1, sum(DOCS)))
    batches = {
        "one sequence": (ids[:, :36], torch.arange(36).unsqueeze(0), [36]),
        "packed": (ids, torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0), list(DOCS)),
    }
    with float64_kernels():
        for case in cases:
            model = build(case)
            reference = copy.deepcopy(model)
            mp.apply_monkey_patch(model, world)
            assert sum(type(m).__name__ == case[3] for m in model.modules()) >= 1
            strategies = {getattr(m, MIXER_SETTINGS_ATTR).strategy for m in model.modules() if type(m).__name__ == case[3]}
            assert strategies == {"state" if mixer_parallel == "state" else "heads"}, (case[0], strategies)
            tols = grad_tolerances(model)
            for what, (x, pos, docs) in batches.items():
                with FSDPUlyssesShardingManager(mesh):
                    logits = _sp_forward(model, x, pos)
                    logits.mean().backward()
                got = _grads(model, group, world)
                parts = [reference(d, use_cache=False).logits for d in x.split(docs, dim=1)]
                want = torch.cat(parts, dim=1)
                want.mean().backward()
                ref = _grads(reference)
                packed = len(docs) > 1
                rtol = FLOAT32_RTOL if packed else loss_rtol(case)
                label = f"{case[0]} under verl's switch, sp {world}, {what}"
                close(logits.detach(), want.detach(), rtol, f"{label}: logits")
                close(logits.detach().mean(), want.detach().mean(), rtol, f"{label}: loss")
                for n, g in got.items():
                    close(g, ref[n], FLOAT32_RTOL if packed else tols[n], f"{label}: grad of {n}")


def test_hybrids_under_verls_switch():
    run_ranks(_job, 2)


def test_state_passing_under_verls_switch():
    """``apply(mixer_parallel="state")``: Qwen3.5's Gated DeltaNet and Bamba's Mamba2 with the
    sequence kept sharded (tests/test_state_passing.py), at this file's tolerances.
    NOTE: measured: within them (the same bounds hold through hf.apply at 2 and 4 ranks)."""
    run_ranks(_job, 2, "state")
