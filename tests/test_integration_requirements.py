"""The integrations where their library cannot be used (``integrations.requirements``): the
module still imports and the switch says why, telling "not installed" from "installed, but it
does not import with this torch" (torchtitan 0.3.0 on torch 2.11 stops at ``from
torch.distributed.fsdp import DataParallelMeshDims``; telling that user to ``pip install
torchtitan`` would send them in a circle). Each case in a fresh interpreter, the library
hidden or made to fail before the import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

# Before anything imports `LIB`: the library is found (verl's switch looks for it first) and
# its import raises what an absent library raises, or (BROKEN) what torchtitan 0.3.0 raises
# on torch 2.11 from inside its own import.
PRELUDE = """
import importlib.machinery, sys
class Failing:
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        if BROKEN:
            raise ImportError("cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'", name="torch.distributed.fsdp")
        raise ModuleNotFoundError(f"No module named {LIB!r}", name=LIB)
class Finder:
    def find_spec(self, fullname, path=None, target=None):
        if fullname == LIB or fullname.startswith(LIB + "."):
            return importlib.machinery.ModuleSpec(fullname, Failing())
sys.meta_path.insert(0, Finder())
"""

CALLS = {
    "torchtitan": "from ulysses_kernels.integrations import torchtitan as titan\ntitan.enable(object())",
    "hf": "import torch\nfrom ulysses_kernels.integrations import hf\nhf.apply(torch.nn.Linear(1, 1), None)",
    "verl": "import ulysses_kernels.integrations.verl as uv\nuv.apply()",
}


def _error(lib: str, broken: bool, call: str) -> str:
    body = textwrap.indent(CALLS[call], "    ")
    code = f"LIB, BROKEN = {lib!r}, {broken}\n{textwrap.dedent(PRELUDE)}try:\n{body}\nexcept Exception as e:\n    print('ERROR:', e)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("ERROR: ")]
    assert lines, r.stdout + r.stderr
    return lines[0]


def test_enable_without_torchtitan_says_to_install_it():
    msg = _error("torchtitan", False, "torchtitan")
    assert "ulysses_kernels.integrations.torchtitan: torchtitan is not installed (pip install torchtitan==0.3.0)" in msg, msg


def test_enable_with_a_torchtitan_that_does_not_import_names_torch_and_the_error():
    msg = _error("torchtitan", True, "torchtitan")
    assert "is installed but does not import with torch " + torch.__version__ in msg, msg
    assert "ImportError: cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'" in msg, msg
    assert "tested with torchtitan 0.3.0 on torch 2.14.1" in msg, msg
    assert "pip install torchtitan" not in msg, msg


@pytest.mark.parametrize("lib,call,where", [("transformers", "hf", "apply: "), ("verl", "verl", "ulysses_kernels.integrations.verl: ")])
def test_hf_and_verl_tell_an_absent_library_from_one_that_does_not_import(lib, call, where):
    msg = _error(lib, False, call)
    assert f"{where}{lib} is not installed (pip install {lib})" in msg, msg
    msg = _error(lib, True, call)
    assert f"{where}{lib} " in msg and f"is installed but does not import with torch {torch.__version__}: ImportError: cannot import name" in msg, msg


def test_the_versions_named_are_the_ones_the_set_up_installs():
    import pathlib
    import re

    from ulysses_kernels.integrations import requirements

    setup = (pathlib.Path(__file__).resolve().parents[1] / "scripts" / "setup.sh").read_text()
    pins = dict(re.findall(r"\b([a-z]+)==([\d.]+)\b", setup))
    assert re.search(r"TORCH_SPEC=\$\{ULYSSES_KERNELS_TORCH:-torch==([\d.]+)\}", setup).group(1) == requirements.TESTED["torch"]
    for name, version in requirements.TESTED.items():
        assert pins.get(name) == version, (name, version, pins.get(name))
    assert {dist for dist, _, _ in requirements.INTEGRATIONS} == set(requirements.TESTED) - {"torch"}


def test_report_rows_say_what_is_installed_and_what_the_suite_passes_with():
    from ulysses_kernels.integrations.requirements import row_text

    assert row_text({"name": "verl", "installed": None, "tested": "0.9.1", "used_by": "integrations.verl"}) == (
        "not installed (integrations.verl; the suite passes with 0.9.1)"
    )
    row = {"name": "torchtitan", "installed": "0.3.0", "tested": "0.3.0", "used_by": ""}
    assert row_text(row) == "0.3.0"
    assert row_text({**row, "import_error": None}) == "0.3.0; imports"
    broken = row_text({**row, "installed": "0.2.1", "import_error": "ImportError: x"})
    assert broken == "0.2.1 (the suite passes with 0.3.0); does not import here: ImportError: x"
    assert row_text({**row, "installed": "0.3.0+cu130"}) == "0.3.0+cu130"  # a local version of the tested one


def test_info_imports_says_which_library_does_not_import():
    """``info --imports`` with transformers failing inside its own import: its row says so, with the error."""
    code = (
        "LIB, BROKEN = 'transformers', True\n"
        + textwrap.dedent(PRELUDE)
        + "from ulysses_kernels.integrations import requirements\n"
        + "print('ROW:', [requirements.row_text(r) for r in requirements.report(True) if r['name'] == 'transformers'][0])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("ROW: "))
    assert "; does not import here: ImportError: cannot import name 'DataParallelMeshDims'" in row, row
