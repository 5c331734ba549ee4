"""layers.state: one SwitchState per model, hooks registered once by name and removable."""

from __future__ import annotations

import torch

from ulysses_kernels.layers.state import STATE_ATTR, SwitchState, recorded, switch_state


def test_one_state_per_model_and_hooks_once_by_name():
    model = torch.nn.Linear(2, 2)
    assert switch_state(model, create=False) is None and STATE_ATTR not in model.__dict__
    assert recorded(model, "long_context") is None and STATE_ATTR not in model.__dict__  # reading makes nothing
    state = switch_state(model)
    state.verl = "record"
    assert recorded(model, "verl") == "record"
    assert isinstance(state, SwitchState) and switch_state(model) is state and switch_state(torch.nn.Linear(2, 2)) is not state
    calls = []

    def register():
        return model.register_forward_pre_hook(lambda m, args: calls.append(len(args)))

    assert state.hook_once("count", register) and not state.hook_once("count", register)
    model(torch.ones(1, 2))
    assert calls == [1]  # registered once: one call counted
    state.remove_hook("count")
    model(torch.ones(1, 2))
    assert calls == [1] and "count" not in state.hooks
    pair = (model.register_forward_pre_hook(lambda m, a: calls.append("a")), model.register_forward_hook(lambda m, a, o: calls.append("b")))
    assert state.hook_once("pair", lambda: pair)
    model(torch.ones(1, 2))
    state.remove_hook("pair")  # a tuple of handles: each removed
    model(torch.ones(1, 2))
    assert calls == [1, "a", "b"]
    state.remove_hook("never registered")  # nothing to remove: no error
