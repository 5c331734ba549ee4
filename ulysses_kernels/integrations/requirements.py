"""The libraries the integrations switch on: the versions the suite passes with, what is
installed here, and why one cannot be used, in the words of its error: not installed (the
``pip install`` line), or installed and failing inside its own import (its version, torch's
version and the library's own error: a library written for another torch, a requirement of
its own missing), where a ``pip install`` line would send the user in a circle.

``python -m ulysses_kernels.info`` prints ``report()`` (``--imports``: each one imported too)."""

from __future__ import annotations

import importlib
import importlib.metadata

import torch

# The versions the suite passes with: scripts/setup.sh installs them (tests/test_integration_requirements.py
# keeps the two equal).
TESTED = {"torch": "2.14.1", "transformers": "5.23.0", "accelerate": "1.15.0", "deepspeed": "0.19.8", "verl": "0.9.1", "torchtitan": "0.3.0"}

# (distribution, the module its integration imports, what uses it)
INTEGRATIONS = (
    ("transformers", "transformers", "hf.apply"),
    ("deepspeed", "deepspeed", "integrations.deepspeed, ALST"),
    ("accelerate", "accelerate", "the HF Trainer's ALST path"),
    ("verl", "verl.models.transformers.monkey_patch", "integrations.verl"),
    ("torchtitan", "torchtitan.trainer", "integrations.torchtitan"),
)


def absent(module: str, error: ImportError) -> bool:
    """Whether ``error`` (of ``import <module>`` or a name from it) says ``module`` is not installed,
    rather than that it failed inside its own import."""
    return isinstance(error, ModuleNotFoundError) and error.name == module


def unusable(module: str, error: ImportError, install: str) -> str:
    """The reason ``import <module>`` (or a name from it) raised ``error``; ``install`` is the
    command that installs it (``"pip install torchtitan==0.3.0"``)."""
    if absent(module, error):
        return f"{module} is not installed ({install})"
    version = installed(module) or "(version unknown)"
    return f"{module} {version} is installed but does not import with torch {torch.__version__}: {type(error).__name__}: {error}"


def installed(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (its metadata: nothing is imported), or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def report(import_them: bool = False) -> list[dict]:
    """One row per integration's library: ``name``, ``installed`` (None: not installed),
    ``tested``, ``used_by``; with ``import_them``, ``import_error`` too (None when the module its
    integration imports imports; slow: torchtitan alone takes seconds)."""
    rows = []
    for dist, module, used_by in INTEGRATIONS:
        row = {"name": dist, "installed": installed(dist), "tested": TESTED[dist], "used_by": used_by}
        if import_them and row["installed"] is not None:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - any failure of a library's own import is what the row reports
                row["import_error"] = f"{type(e).__name__}: {e}"
            else:
                row["import_error"] = None
        rows.append(row)
    return rows


def row_text(row: dict) -> str:
    """One row of ``report`` as ``info`` prints it."""
    if row["installed"] is None:
        return f"not installed ({row['used_by']}; the suite passes with {row['tested']})"
    text = row["installed"]
    if row["installed"].split("+")[0] != row["tested"]:
        text += f" (the suite passes with {row['tested']})"
    if row.get("import_error"):
        text += f"; does not import here: {row['import_error']}"
    elif "import_error" in row:
        text += "; imports"
    return text
