"""docs/extending.md's worked mixer family, run as the page writes it: its code block saved as a
module of its own and imported (what a user adding a family from their own code does), a tiny
Llama whose MLPs are that toy mixer (each channel's running mean over the tokens so far), and
``hf.apply`` at 2 gloo ranks against one process, float64: the mixer is found by its class,
runs through the head exchange and its loss and gradients equal one process's. Without its
registry row the same model runs each rank's running mean over its own shard only (shown).

Fresh ranks: a registered family stays in its process's registry."""

from __future__ import annotations

import copy
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from ulysses_kernels.testing import run_ranks

pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _example(tmp_path) -> str:
    m = re.search(r"<!-- mixer-family-example -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert m, "docs/extending.md has no worked mixer family"
    path = tmp_path / "mixer_family_example.py"
    path.write_text(m.group(1))
    return str(path)


def _load(path: str):
    spec = importlib.util.spec_from_file_location("mixer_family_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _model(causal_mean):
    from ulysses_kernels.testing import build_tiny

    model = build_tiny("llama", {"num_hidden_layers": 2})
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.mlp = causal_mean(model.config.hidden_size).double()
    return model


def _reference(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _body(rank, world, path, registered):
    from ulysses_kernels.integrations import hf
    from ulysses_kernels.testing.hybrids import sharded_step

    if registered:
        causal_mean = _load(path).CausalMean
    else:  # the same class, its registry row left out
        source = Path(path).read_text().split("\n\nFAMILY = ")[0]
        namespace = {}
        exec(compile(source, path, "exec"), namespace)  # noqa: S102 - the page's own code
        causal_mean = namespace["CausalMean"]
    model = _model(causal_mean)
    ids = torch.randint(3, model.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(0))
    want_loss, want_grads = _reference(copy.deepcopy(model), ids)
    hf.apply(model, None)
    loss, grads, _ = sharded_step(model, hf.shard_batch(ids, ids), None)
    if not registered:
        assert hf.mixer_strategies(model) == {}
        assert abs(float(loss - want_loss)) > 1e-6, (float(loss), float(want_loss))  # each rank's own running mean
        return
    assert hf.mixer_strategies(model) == {"model.layers.0.mlp": "heads", "model.layers.1.mlp": "heads"}
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_the_worked_mixer_family_runs_exact_at_two_ranks(tmp_path):
    path = _example(tmp_path)
    run_ranks(_body, 2, path, True, fresh=True)


def test_without_its_registry_row_the_toy_mixer_stays_on_its_shard(tmp_path):
    run_ranks(_body, 2, _example(tmp_path), False)


def test_the_calculator_and_the_registry_name_families_alike():
    """The memory calculator's mixer kinds are the registry's family names (one vocabulary)."""
    from ulysses_kernels.layers.mixers.registry import FAMILIES
    from ulysses_kernels.memory_step.mixer import KINDS

    assert set(KINDS) <= set(FAMILIES), sorted(set(KINDS) - set(FAMILIES))
