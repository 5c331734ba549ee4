"""``hf.unapply``: a switched model runs as it was built again (one process, world 1).

What ``apply`` changed (the attention implementation, each attention module's settings, the
mixers' forwards and their layers' hand-over hooks and checkpoint wrappers, the long-context
pieces, the step-keeping pre-hook, ``generate``) is undone: every module's instance attributes
are the ones it had before ``apply``, its hooks are gone, and the model's logits and
``generate`` equal those of a copy made before ``apply``; ``apply`` then switches it again and
its step is the first one's."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.testing import build_tiny, run_ranks  # noqa: E402


def _attributes(model) -> dict:
    """Each module's instance attributes and hooks (names and counts: what apply could add)."""
    out = {}
    for name, m in model.named_modules():
        hooks = (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
        names = sorted(vars(m))
        out[name] = (names, hooks, vars(m).get("_gradient_checkpointing_func"))  # the layer's own checkpoint function, unwrapped
    return out


def _step(model, ids, labels) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**hf.shard_batch(ids, labels).model_inputs())
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# (model type, apply's long-context options): dense; Gated DeltaNet (Qwen3.5); Mamba1 (Jamba: its
# layer drops the step's keywords, handed over by a hook on the layer and a wrapper of its checkpoint
# function). The mixers are switched on 2 ranks only (one rank runs them as built).
CASES = [("llama", {"tiled_loss": 4, "tiled_mlp": 4}), ("qwen3_5_text", {}), ("jamba", {"tiled_loss": 4})]


def _unapply_round_trip(model_type: str, options: dict, ids: torch.Tensor) -> None:
    labels = ids.clone()
    model = build_tiny(model_type)
    model.gradient_checkpointing_enable()
    model.train()
    before, attributes, impl = copy.deepcopy(model), _attributes(model), model.config._attn_implementation
    with pytest.raises(hf.HFIntegrationError, match=r"unapply: .* was not switched by apply"):
        hf.unapply(model)
    hf.apply(model, **options)
    first = _step(model, ids, labels)
    assert model.config._attn_implementation == "ulysses"
    assert hf.unapply(model) is model
    assert model.config._attn_implementation == impl, model_type
    assert _attributes(model) == attributes, model_type
    model.eval()
    before.eval()
    with torch.no_grad():  # the whole sequence on this rank, as built
        assert torch.equal(model(ids).logits, before(ids).logits), model_type
    if model_type == "llama":  # generate is the model's own again
        kw = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(model.generate(ids[:, :6], **kw), before.generate(ids[:, :6], **kw))
    model.train()
    hf.apply(model, **options)  # switched again: the same step
    again = _step(model, ids, labels)
    assert torch.equal(again[0], first[0]) and again[1].keys() == first[1].keys(), model_type
    assert all(torch.equal(again[1][n], g) for n, g in first[1].items()), model_type


def _ids() -> torch.Tensor:
    return torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(0))


def test_unapply_at_one_rank():
    for model_type, options in CASES:
        _unapply_round_trip(model_type, options, _ids())


def _job(rank, world):
    for model_type, options in CASES:
        _unapply_round_trip(model_type, options, _ids())
    # The mixers were switched here (state passing or the head exchange): unapply put them back.
    model = build_tiny("jamba")
    hf.apply(model)
    assert hf.mixer_strategies(model)
    hf.unapply(model)
    assert hf.mixer_strategies(model) == {}


def test_unapply_at_two_ranks():
    run_ranks(_job, 2)
