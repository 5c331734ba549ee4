"""Error paths that survive any toolchain (ulysses_kernels.toolchain, csrc/message.h).

The first GPU run's g++ linked libstdc++ statically into ``_C``; every error message that
formatted an integer through that private copy's iostream crashed the process there
(SIGSEGV) and lost its numbers here ("send.numel() expected " and nothing more). Here:

* a copy of the extension built with ``-static-libstdc++`` (CPU part only, in a temporary
  directory) raises its errors with their numbers intact, the build says loudly that it
  carries a private libstdc++, and the ELF check agrees;
* the probe that ``info`` and the self-test run tells ok, crashed (with the signal) and
  mangled apart.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ulysses_kernels import extension, toolchain

ROOT = Path(__file__).resolve().parents[1]

# Bad calls of the ops and the messages they must raise, numbers included (the same
# checks as test_cuda_kernels.py::test_errors_name_the_tensor, through the static copy).
_ERRORS = r"""
import json, torch
from ulysses_kernels import extension
extension.load()
P = torch.ops.ulysses_kernels
x, y = torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 2, 8)
cases = {
    "numel": lambda: P.pack_s2h([x, y], [0, 4, 0, 2], torch.empty(10)),
    "shape": lambda: P.pack_s2h([x, torch.zeros(2, 4, 2, 8)], [0, 4, 0, 2], torch.empty(288)),
    "dtype": lambda: P.pack_s2h([x, y.half()], [0, 4, 0, 2], torch.empty(288)),
    "range": lambda: P.pack_s2h([x, y], [0, 4, 0, 3], torch.empty(288)),
    "peers": lambda: P.pack_s2h([x], [0, 1] * 65, torch.empty(288)),
    "strides": lambda: P.pack_s2h([x], [0, 4], torch.empty(2, 288)[:, 0]),
    "sum": lambda: P.unpack_h2s([torch.zeros(1, 1, 1, 4, dtype=torch.int32)] * 2, [0, 1, 0, 1], [torch.zeros(1, 1, 1, 4, dtype=torch.int32)]),
}
out = {}
for name, call in cases.items():
    try:
        call()
        out[name] = None
    except RuntimeError as e:
        out[name] = str(e).splitlines()[0]
print(json.dumps(out))
"""
EXPECTED = {
    "numel": "ulysses_kernels.pack_s2h: send.numel() expected 288, got 10",
    "shape": "ulysses_kernels.pack_s2h: tensors[1].shape expected [2, 3, *, 8] (batch, seq_local, head_dim of tensors[0]), got [2, 4, 2, 8]",
    "dtype": "ulysses_kernels.pack_s2h: tensors[1].dtype expected Float (the dtype of send), got Half",
    "range": "ulysses_kernels.pack_s2h: head range of peer 0, tensors[1] expected within [0, 2], got [0, 3)",
    "peers": "ulysses_kernels.pack_s2h: world_size expected at most 64, got 65",
    "strides": "ulysses_kernels.pack_s2h: send expected a contiguous 1-D tensor, got shape [2] strides [288]",
    "sum": "ulysses_kernels.unpack_h2s: outs[0].dtype expected float32, float64, float16 or bfloat16 to sum replicated heads, got Int",
}


def _static_libstdcxx_available() -> str:
    """Why a -static-libstdc++ build cannot be made here ("" when it can)."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return "no C++ compiler (g++) on PATH"
    lib = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(lib):
        return f"{cxx} has no static libstdc++ (libstdc++.a) to link"
    if shutil.which("readelf") is None:
        return "no readelf to inspect the build"
    return ""


def _run_in(root: Path, code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_static_libstdcxx_build_keeps_the_numbers_in_its_messages(tmp_path):
    why = _static_libstdcxx_available()
    if why:
        pytest.skip(why)
    copy = tmp_path / "tree"
    copy.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "csrc", copy / "csrc")
    shutil.copytree(ROOT / "build_backend", copy / "build_backend")  # setup.py reads its messages from there
    shutil.copytree(ROOT / "ulysses_kernels", copy / "ulysses_kernels", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = dict(os.environ, LDFLAGS="-static-libstdc++", ULYSSES_KERNELS_SKIP_CUDA_BUILD="1", MAX_JOBS="2")
    build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=copy, env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    # The build says so, loudly, with the fix.
    assert "WARNING: _C" in build.stderr and "PRIVATE libstdc++" in build.stderr, build.stderr[-3000:]
    assert "CXX=/usr/bin/g++" in build.stderr, build.stderr[-3000:]
    (so,) = (copy / "ulysses_kernels").glob("_C*.so")
    report = toolchain.libstdcxx_report(str(so))
    assert report["private"] is True and "libstdc++.so.6" not in report["needed"], report
    assert report["iostream_definitions"] > 100, report  # the copy's iostream and locale are in there
    # Every message keeps its numbers (before csrc/message.h: "send.numel() expected " and nothing more).
    got = _run_in(copy, _ERRORS)
    assert got == EXPECTED
    probe = toolchain.probe_error_path(str(copy))
    assert probe["status"] == "ok" and probe["message"] == toolchain.PROBE_EXPECTED, probe


def test_the_tree_extension_raises_the_same_messages():
    if not extension.available():
        pytest.skip(f"needs the C++ extension: {extension.build_info().get('error')}")
    assert _run_in(ROOT, _ERRORS) == EXPECTED


def test_torch_own_libraries_use_the_shared_libstdcxx():
    if shutil.which("readelf") is None:
        pytest.skip("no readelf")
    libc10 = Path(torch.__file__).parent / "lib" / "libc10.so"
    report = toolchain.libstdcxx_report(str(libc10))
    assert report["private"] is False and any(n.startswith("libstdc++.so") for n in report["needed"]), report
    assert "the shared libstdc++.so.6" in report["detail"]


def _fake_package(root: Path, ops_body: str) -> Path:
    pkg = root / "ulysses_kernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "extension.py").write_text(textwrap.dedent(ops_body))
    return root


def test_the_probe_tells_a_crash_and_a_mangled_message_apart(tmp_path):
    # A process that dies of SIGSEGV inside the call (the first GPU run's failure).
    crash = _fake_package(
        tmp_path / "crash",
        """
        import os, signal
        def load():
            os.kill(os.getpid(), signal.SIGSEGV)
    """,
    )
    probe = toolchain.probe_error_path(str(crash))
    assert probe["status"] == "crashed" and probe["signal"] == signal.SIGSEGV, probe
    line = toolchain.probe_line(probe)
    assert line.startswith("CRASHED with signal 11") and "CXX=/usr/bin/g++" in line, line
    # An op that raises with its numbers gone (this machine's form of the same failure).
    mangled = _fake_package(
        tmp_path / "mangled",
        """
        import torch
        _lib = torch.library.Library("ulysses_kernels", "DEF")
        _lib.define("pack_s2h(Tensor[] tensors, int[] head_ranges, Tensor(a!) send) -> ()")
        def _impl(tensors, head_ranges, send):
            raise RuntimeError("ulysses_kernels.pack_s2h: send.numel() expected ")
        _lib.impl("pack_s2h", _impl, "CPU")
        def load():
            return None
    """,
    )
    probe = toolchain.probe_error_path(str(mangled))
    assert probe["status"] == "mangled" and probe["message"] == "ulysses_kernels.pack_s2h: send.numel() expected ", probe
    assert toolchain.probe_line(probe).startswith("MESSAGE MANGLED")
    # Without the extension there is nothing to probe.
    missing = _fake_package(
        tmp_path / "missing",
        """
        def load():
            raise ImportError("ulysses_kernels._C is not built")
    """,
    )
    assert toolchain.probe_error_path(str(missing))["status"] == "not built"
