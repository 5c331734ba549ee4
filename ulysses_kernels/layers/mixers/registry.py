"""The mixer families and the classes each runs: one ``Family`` per family module of
``layers.mixers``, its ``register`` rows at the end of that module (adding a family: one module
and its rows, docs/extending.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ADAPTERS", "CLASSES", "FAMILIES", "HANDED", "Family", "register"]


@dataclass(frozen=True)
class Family:
    """``name``: the family's public name (what ``apply``'s errors, ``mixer_parallel`` and the
    memory calculator's ``Mixer.kind`` say); ``describe``: the audit's line for its classes."""

    name: str
    describe: str


FAMILIES: dict[str, Family] = {}
# class name -> (family name, forward, module -> (heads, groups)), for every mixer made exact.
ADAPTERS: dict[str, tuple[str, Callable, Callable]] = {}
# class name -> its family's line in the audit (``layers.mixers.HANDLED_MIXERS``: the classes ``apply`` runs).
CLASSES: dict[str, str] = {}
# Classes whose layer calls them without the step's keywords: a pre-hook on the layer hands them over.
HANDED: set[str] = set()


def register(classes, family: Family, forward: Callable, sizes: Callable, *, handed: bool = False) -> None:
    """``classes`` (transformers class names) run ``forward`` (``(module, hidden_states, ...)``, as
    the module's own); ``sizes(module)`` gives its ``(heads, groups)`` for the head plan;
    ``handed``: its layer drops the step's keywords (``switch_mixers`` hands them over)."""
    FAMILIES.setdefault(family.name, family)
    for name in classes:
        ADAPTERS[name] = (family.name, forward, sizes)
        CLASSES[name] = family.describe
        if handed:
            HANDED.add(name)
