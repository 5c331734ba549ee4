"""Triton kernels compiled for sm_90 without a GPU (Triton's own LLVM and ptxas), for the tests
that check the PTX a kernel set's hints produce."""

import os
import subprocess
import sys

import pytest


def sm90_output(script: str) -> str:
    """Standard output of ``script`` run in a new interpreter without ``TRITON_INTERPRET`` (the
    script compiles with ``triton.compile(..., target=GPUTarget("cuda", 90, 32))``). Skips where
    this Triton cannot compile for sm_90; a kernel that does not compile fails."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode and ("ptxas" in res.stderr or "ASTSource" in res.stderr) and "CompilationError" not in res.stderr:
        pytest.skip(f"cannot compile for sm_90 here: {res.stderr[-500:]}")
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout
