"""The build backend pip calls (pyproject.toml: ``build-backend``, in-tree through
``backend-path``): setuptools' own, after one check that must come before pip fetches anything.

Why a backend of our own: under pip's build isolation the installed torch is hidden, so the
C++/CUDA extension cannot be built against it, and setup.py refuses, saying to run
``INSTALL_COMMANDS``. But pip runs setup.py only after it has installed the build
requirements into the isolated environment: with ``requires = ["setuptools>=77", "wheel"]``
a plain ``pip install .`` first fetched them from the index (and failed there without one),
and only then printed the message. Now ``requires`` is empty, pip asks this module for the
build requirements first (``get_requires_for_build_*``), and that is where a build that cannot
see torch stops, before anything is fetched. Everything else is ``setuptools.build_meta``,
imported only once pip has installed setuptools.

Nothing here imports setuptools or torch at import time (neither is installed yet when pip
first loads this module). setup.py takes its messages from here: one home for them.
"""

from __future__ import annotations

import importlib.util
import os

# What to run where pip's build isolation hid torch (printed by the refusal, tested as printed).
INSTALL_COMMANDS = "pip install 'setuptools>=77' && pip install --no-build-isolation ."
# pyproject.toml's SPDX license string (PEP 639) needs setuptools >= 77.
BUILD_REQUIRES = ["setuptools>=77", "wheel"]
TORCH_MISSING = (
    "torch is not importable at build time, so ulysses_kernels._C (the C++/CUDA extension) cannot be built. "
    "pip's build isolation hides the installed torch. Into an environment that has the torch you will run "
    "with (pip install torch first, if it has none), install with\n"
    f"    {INSTALL_COMMANDS}\n"
    "or ask for the pure-Python package with\n"
    "    ULYSSES_KERNELS_SKIP_EXTENSION=1 pip install ."
)


def skip_extension(env=None) -> bool:
    """``ULYSSES_KERNELS_SKIP_EXTENSION`` is set: a pure-Python build, which needs no torch."""
    return (os.environ if env is None else env).get("ULYSSES_KERNELS_SKIP_EXTENSION", "0").strip().lower() in ("1", "true", "yes", "on")


def _refuse_without_torch() -> None:
    """Exit with ``TORCH_MISSING`` when this build environment has no torch (find_spec: torch
    is not imported, which takes seconds). pip prints a failing hook's output."""
    if not skip_extension() and importlib.util.find_spec("torch") is None:
        raise SystemExit(f"\n[ulysses_kernels build] ERROR: {TORCH_MISSING}\n")


def _setuptools():
    import setuptools.build_meta

    return setuptools.build_meta


# ---- PEP 517 / 660 hooks ----------------------------------------------------------------------
def get_requires_for_build_wheel(config_settings=None):
    _refuse_without_torch()
    return list(BUILD_REQUIRES)


def get_requires_for_build_editable(config_settings=None):
    _refuse_without_torch()
    return list(BUILD_REQUIRES)


def get_requires_for_build_sdist(config_settings=None):
    return list(BUILD_REQUIRES[:1])  # an sdist holds sources: no torch needed


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _setuptools().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _setuptools().prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _setuptools().build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _setuptools().build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _setuptools().build_sdist(sdist_directory, config_settings)
