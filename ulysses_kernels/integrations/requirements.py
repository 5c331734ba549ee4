"""Why an integration's library cannot be used, in the words of its error: not installed (the
``pip install`` line), or installed and failing inside its own import (its version, torch's
version and the library's own error: a library written for another torch, a requirement of
its own missing), where a ``pip install`` line would send the user in a circle."""

from __future__ import annotations

import importlib.metadata

import torch


def unusable(module: str, error: ImportError, install: str) -> str:
    """The reason ``import <module>`` (or a name from it) raised ``error``; ``install`` is the
    command that installs it (``"pip install torchtitan==0.3.0"``)."""
    if isinstance(error, ModuleNotFoundError) and error.name == module:
        return f"{module} is not installed ({install})"
    try:
        version = importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    return f"{module} {version} is installed but does not import with torch {torch.__version__}: {type(error).__name__}: {error}"
