"""``integrations.torchtitan`` where torchtitan cannot be used: the module still imports and
``enable`` says why, telling "not installed" from "installed, but it does not import with
this torch" (torchtitan 0.3.0 on torch 2.11 stops at ``from torch.distributed.fsdp import
DataParallelMeshDims``; telling that user to ``pip install torchtitan`` would send them in a
circle). Each case in a fresh interpreter, torchtitan hidden or replaced before the import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

HIDE = """
import sys
class Hide:
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchtitan" or fullname.startswith("torchtitan."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
sys.meta_path.insert(0, Hide())
"""

# A torchtitan that is there but fails inside its own import, as 0.3.0 does on torch 2.11.
BROKEN = """
import sys, types
class Broken:
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchtitan" or fullname.startswith("torchtitan."):
            raise ImportError("cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'", name="torch.distributed.fsdp")
sys.meta_path.insert(0, Broken())
"""

CALL = """
from ulysses_kernels.integrations import torchtitan as titan
try:
    titan.enable(object())
except ImportError as e:
    print("ERROR:", e)
"""


def _enable_error(prelude: str) -> str:
    code = textwrap.dedent(prelude) + textwrap.dedent(CALL)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("ERROR: ")]
    assert lines, r.stdout + r.stderr
    return lines[0]


def test_enable_without_torchtitan_says_to_install_it():
    msg = _enable_error(HIDE)
    assert "ulysses_kernels.integrations.torchtitan needs torchtitan (pip install torchtitan==0.3.0)" in msg, msg


def test_enable_with_a_torchtitan_that_does_not_import_names_torch_and_the_error():
    msg = _enable_error(BROKEN)
    assert "is installed but does not import with torch " + torch.__version__ in msg, msg
    assert "ImportError: cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'" in msg, msg
    assert "tested with torchtitan 0.3.0 on torch 2.14.1" in msg, msg
    assert "pip install torchtitan" not in msg, msg


def test_the_versions_named_are_the_ones_the_set_up_installs():
    import pathlib
    import re

    from ulysses_kernels.integrations import torchtitan as titan

    setup = (pathlib.Path(__file__).resolve().parents[1] / "scripts" / "setup.sh").read_text()
    assert re.search(r"TORCH_SPEC=\$\{ULYSSES_KERNELS_TORCH:-torch==([\d.]+)\}", setup).group(1) == titan.TESTED_TORCH
    assert re.search(r"TITAN_PKGS=\(torchtitan==([\d.]+) ", setup).group(1) == titan.TESTED_TORCHTITAN
