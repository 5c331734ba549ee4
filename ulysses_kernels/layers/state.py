"""What ulysses_kernels keeps on a model it switched: one object, under one attribute.

``hf.apply``, verl's switch, DeepSpeed ALST's entry point and the long-context toolkit each
record something on the model the user calls: the hooks they registered (each once, by
name), the keywords of the call in flight (the step's shard and group, which a mixer whose
layer drops them is handed), the long-context pieces, verl's record of its switch. All of it
is one ``SwitchState`` in the model instance's ``__dict__`` (a plain attribute, not a
parameter or buffer: it belongs to this model, never to the process or a group), read with
``switch_state(model)``. What belongs to one module (an attention module's settings, a
mixer's plan) stays on that module (``layers.attention.ATTENTION_SETTINGS_ATTR``,
``layers.mixers.exchange.MIXER_SETTINGS_ATTR``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["STATE_ATTR", "SwitchState", "recorded", "switch_state"]

STATE_ATTR = "ulysses_kernels_state"


@dataclass(eq=False)
class SwitchState:
    """Everything ulysses_kernels put on one model.

    ``hooks``: name -> what registering it returned (a handle, or a tuple of them), each
    registered once (``hook_once``); ``step``: the keywords of the model's call in flight
    that its pre-hook keeps (``layers.step.STEP_KWARGS``); ``long_context``: the
    ``longctx.LongContext`` installed (None: none); ``verl``: verl's switch's record of this
    model (``integrations.verl``); ``mixers_switched``: DeepSpeed ALST switched this
    decoder's mixers (at its first call); ``undo``: what puts back each change ``hf.apply``
    made (``hf.unapply`` runs them, last first).

    On a module inside: a mixer whose layer drops the step's keywords has its ``layer`` (whose
    pre-hook, ``hooks["hand"]``, hands the ``handed`` mixers the step: each its ``step``)."""

    hooks: dict[str, object] = field(default_factory=dict)
    step: dict = field(default_factory=dict)
    long_context: object = None
    verl: object = None
    mixers_switched: bool = False
    undo: list[Callable[[], None]] = field(default_factory=list)
    layer: object = None
    handed: list = field(default_factory=list)

    def hook_once(self, name: str, register: Callable[[], object]) -> bool:
        """Register the hook ``name`` (``register()`` returns its handle) unless it is; True if
        it registered it now."""
        if name in self.hooks:
            return False
        self.hooks[name] = register()
        return True

    def remove_hook(self, name: str) -> None:
        """Remove the hook ``name`` (its handle or handles), if registered."""
        handles = self.hooks.pop(name, None)
        for h in handles if isinstance(handles, tuple) else (handles,) if handles is not None else ():
            h.remove()


def switch_state(model: torch.nn.Module, create: bool = True) -> SwitchState | None:
    """The ``SwitchState`` of ``model`` (made on first use; ``create=False``: None if none)."""
    state = model.__dict__.get(STATE_ATTR)
    if state is None and create:
        state = SwitchState()
        object.__setattr__(model, STATE_ATTR, state)
    return state


def recorded(model: torch.nn.Module, name: str):
    """The field ``name`` of ``model``'s ``SwitchState``; None when it has none (nothing is made:
    reading leaves a model that was never switched as it is)."""
    state = model.__dict__.get(STATE_ATTR)
    return None if state is None else getattr(state, name)
