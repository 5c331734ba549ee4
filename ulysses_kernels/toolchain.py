"""What the toolchain that built ``_C`` did to it: a private libstdc++, and whether its error paths survive.

The first GPU run (bench/results/2026-11-27_h200/README.md) built ``_C`` with a g++ that
links libstdc++ statically into every shared library. That private copy's iostream and
locale are never set up, so an error message formatted through a stream killed the process
(SIGSEGV) or lost its numbers. The extension now builds its messages without a stream
(csrc/message.h), but a user should still find out in seconds what their build carries:

* ``libstdcxx_report(path)``: from the ELF file alone (``readelf``, ``nm``): does ``_C``
  load the shared ``libstdc++.so.6``, or carry its own copy; used by setup.py right after
  the build (loudly, with the fix) and by ``python -m ulysses_kernels.info``;
* ``probe_error_path(root)``: in a subprocess (a crash must not take the caller with it),
  call one op of ``_C`` with a wrong buffer size and check the error: ``ok``, ``crashed``
  (with the signal), ``mangled`` (raised, but the numbers are gone), ``hung``, or
  ``not built``. ``info`` and the self-test report it.

This module imports only the standard library at module level: setup.py loads it by its
file path before the package (or torch's extension) can be imported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

__all__ = ["libstdcxx_report", "fix_command", "probe_error_path", "probe_line", "PROBE_EXPECTED"]

# The probe's bad call: one [1, 2, 3, 4] tensor (24 elements, one peer with heads [0, 3))
# packed into a send buffer of 5 elements. The op must raise RuntimeError with this text.
PROBE_EXPECTED = "ulysses_kernels.pack_s2h: send.numel() expected 24, got 5"

_PROBE_CODE = r"""
import json, sys
import torch
from ulysses_kernels import extension
try:
    extension.load()
except ImportError as e:
    print(json.dumps({"status": "not built", "detail": str(e)}))
    sys.exit(0)
x = torch.zeros(1, 2, 3, 4)
send = torch.empty(5)
try:
    torch.ops.ulysses_kernels.pack_s2h([x], [0, 3], send)
except RuntimeError as e:
    print(json.dumps({"message": str(e).splitlines()[0] if str(e) else ""}))
else:
    print(json.dumps({"status": "no error", "detail": "pack_s2h accepted a 5-element send buffer for 24 elements"}))
"""

# Definitions that only a linked-in libstdc++ brings: its iostream and locale machinery
# (an extension built against the shared library defines at most a few inline pieces).
_IOSTREAM_SYMBOL = re.compile(r"std::(locale|ios_base|basic_ios|basic_ostream|basic_istream|codecvt|ctype<|num_put|num_get)")


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def libstdcxx_report(path: str) -> dict:
    """How the shared library at ``path`` gets its C++ runtime.

    Returns ``{"private": bool | None, "needed": [...], "std_definitions": int | None,
    "iostream_definitions": int | None, "detail": str}``. ``private`` is True when the
    library does not load ``libstdc++.so.6`` (it has a copy of its own: the toolchain linked
    it statically), None when it cannot be told here (no ``readelf``).
    """
    if not shutil.which("readelf"):
        return {"private": None, "needed": [], "std_definitions": None, "iostream_definitions": None, "detail": "readelf not found: not checked"}
    dynamic = _run(["readelf", "-d", path])
    if dynamic is None:
        return {"private": None, "needed": [], "std_definitions": None, "iostream_definitions": None, "detail": f"readelf -d {path} failed: not checked"}
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    std_defs = io_defs = None
    symbols = _run(["nm", "-C", "--defined-only", path]) if shutil.which("nm") else None
    if symbols is not None:
        names = [line.split(" ", 2)[-1] for line in symbols.splitlines() if " std::" in line]
        std_defs = len(names)
        io_defs = sum(1 for n in names if _IOSTREAM_SYMBOL.match(n))
    private = not any(n.startswith("libstdc++.so") for n in needed)
    counts = f"{std_defs} std:: definitions, {io_defs} of iostream/locale" if std_defs is not None else "nm not found"
    if private:
        detail = f"a PRIVATE libstdc++ linked in (no libstdc++.so.6 among its libraries; {counts})"
    else:
        detail = f"the shared libstdc++.so.6 ({counts})"
    return {"private": private, "needed": needed, "std_definitions": std_defs, "iostream_definitions": io_defs, "detail": detail}


def _torch_gcc() -> str | None:
    """The GCC version torch was built with (``"13.3"``), from ``torch.__config__.show()``; None if unknown."""
    try:
        import torch

        m = re.search(r"GCC (\d+(?:\.\d+)*)", torch.__config__.show())
    except (ImportError, AttributeError, RuntimeError):
        return None
    return m.group(1) if m else None


COMPILER_ENV = "CC=/usr/bin/gcc CXX=/usr/bin/g++"


def fix_command(rebuild=None) -> str:
    """What to do about a private libstdc++ in ``_C``: rebuild with a g++ that links the shared one.

    ``rebuild(env) -> str``: the build command with ``env`` before it (``extension.rebuild_command``
    for an installed package); default: the in-place build of a checkout.
    """
    gcc = _torch_gcc()
    torch_gcc = f" (torch was built with GCC {gcc})" if gcc else ""
    command = rebuild(COMPILER_ENV) if rebuild is not None else f"{COMPILER_ENV} python setup.py build_ext --inplace"
    return (
        "rebuild _C with a g++ that links the shared libstdc++.so.6, as torch's own libraries do"
        f"{torch_gcc}, and without -static-libstdc++ in LDFLAGS/CXXFLAGS: e.g. the system's compiler, {command}"
    )


def probe_error_path(root: str | None = None, python: str | None = None, timeout_s: float = 180.0) -> dict:
    """Call one op of ``_C`` with a bad input in a subprocess; how its error came back.

    ``root``: the directory that holds the ``ulysses_kernels`` package to probe (default:
    this one's). Returns ``{"status", "signal", "message", "detail"}`` with ``status`` one
    of ``"ok"`` (RuntimeError with ``PROBE_EXPECTED``), ``"crashed"`` (killed by
    ``signal``), ``"mangled"`` (raised, but not the expected text), ``"not built"``,
    ``"no error"``, ``"hung"`` (no answer in ``timeout_s``) or ``"failed"`` (the probe
    itself failed: its stderr's last line in ``detail``).
    """
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else root
    env.setdefault("OMP_NUM_THREADS", "1")
    out = {"status": "failed", "signal": None, "message": None, "detail": ""}
    try:
        proc = subprocess.run([python or sys.executable, "-c", _PROBE_CODE], cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(out, status="hung", detail=f"no answer in {timeout_s:.0f} s")
    if proc.returncode < 0:
        sig = -proc.returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return dict(out, status="crashed", signal=sig, detail=f"the process died of {name} ({sig}) inside _C's error path")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return dict(out, detail=tail)
    answer = json.loads(lines[-1])
    if "status" in answer:
        return dict(out, **answer)
    message = answer["message"]
    if PROBE_EXPECTED in message:
        return dict(out, status="ok", message=message, detail="a bad input raised RuntimeError with its numbers")
    return dict(out, status="mangled", message=message, detail=f"expected {PROBE_EXPECTED!r}")


def probe_line(probe: dict, rebuild=None) -> str:
    """One line for a report: the probe's status, loud (with ``fix_command(rebuild)``) when it is not ``ok``."""
    status = probe["status"]
    if status == "ok":
        return f"ok ({probe['detail']}: {probe['message']!r})"
    if status == "not built":
        return "not probed (_C not built)"
    if status == "crashed":
        return f"CRASHED with signal {probe['signal']}: {probe['detail']}; {fix_command(rebuild)}"
    if status == "mangled":
        return f"MESSAGE MANGLED: got {probe['message']!r}, {probe['detail']}; {fix_command(rebuild)}"
    return f"{status.upper()}: {probe['detail']}"
