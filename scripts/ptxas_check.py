#!/usr/bin/env python3
"""Every CUDA kernel compiles with no stack frame and no register spills.

Compiles csrc/kernels/pack.cu and fp8.cu (torch-free: they need only the CUDA toolkit) for each
architecture with ``nvcc -Xptxas -v``, reads ptxas's "N bytes stack frame, N bytes spill
stores, N bytes spill loads" line of every kernel, prints a summary and fails when any
number is not zero (a stack frame means local memory: a copy kernel that goes through
it moves every byte twice more). No GPU needed.

    python3 scripts/ptxas_check.py [--arch 80 --arch 90] [--nvcc PATH]

nvcc is taken from --nvcc, $CUDA_HOME/bin, /usr/local/cuda/bin or PATH; without one the
check is skipped with a message (exit 0), since no CUDA code can be built there either.
Run by scripts/ctest.sh.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "csrc" / "kernels" / name for name in ("pack.cu", "fp8.cu")]
# The kernel flags of setup.py's nvcc build (the torch-specific ones do not apply to these files).
FLAGS = ["-O3", "--expt-relaxed-constexpr", "-std=c++17"]

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def find_nvcc(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    candidates = [os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")] if os.environ.get("CUDA_HOME") else []
    candidates.append("/usr/local/cuda/bin/nvcc")
    candidates += [p for p in [shutil.which("nvcc")] if p]
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def parse(log: str) -> list[tuple[str, str, int, int, int]]:
    """``(kernel, arch, stack frame, spill stores, spill loads)`` per compiled kernel."""
    out, entry = [], None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            entry = (m.group(1), m.group(2))
            continue
        m = _FRAME.search(line)
        if m and entry is not None:
            out.append((*entry, *(int(x) for x in m.groups())))
            entry = None
    return out


def demangle(names: list[str], nvcc: str) -> dict[str, str]:
    """Readable kernel names through the toolkit's cu++filt or binutils' c++filt, if either is there."""
    filt = os.path.join(os.path.dirname(nvcc), "cu++filt")
    filt = filt if os.path.isfile(filt) else shutil.which("c++filt")
    if not names or filt is None:
        return {n: n for n in names}
    res = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True)
    lines = res.stdout.splitlines()
    return dict(zip(names, lines)) if res.returncode == 0 and len(lines) == len(names) else {n: n for n in names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", action="append", type=int, help="compute capability x10 (default: 80 and 90)")
    ap.add_argument("--nvcc", help="the nvcc to use")
    args = ap.parse_args(argv)
    archs = args.arch or [80, 90]
    nvcc = find_nvcc(args.nvcc)
    if nvcc is None:
        print("[ptxas] skipped: no nvcc found (set CUDA_HOME); no CUDA kernel can be built here either")
        return 0
    start = time.monotonic()
    kernels = []
    with tempfile.TemporaryDirectory() as tmp:
        for source in SOURCES:
            cmd = [nvcc, *FLAGS, f"-I{ROOT / 'csrc'}", "-Xptxas", "-v", "-c", str(source), "-o", os.path.join(tmp, source.stem + ".o")]
            for a in archs:
                cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                print(f"[ptxas] FAILED: nvcc exited with {res.returncode} on {source.name}:\n{res.stdout}{res.stderr}", file=sys.stderr)
                return 1
            kernels += parse(res.stdout + res.stderr)
    names = demangle(sorted({k[0] for k in kernels}), nvcc)
    bad = False
    for a in archs:
        mine = [k for k in kernels if k[1] == f"sm_{a}"]
        framed = [k for k in mine if k[2]]
        spilled = [k for k in mine if k[3] or k[4]]
        print(f"[ptxas] sm_{a}: {len(mine)} kernels, {len(framed)} with a stack frame, {len(spilled)} with spills")
        if not mine:
            print(f"[ptxas] no kernel compiled for sm_{a}: is ptxas output parsed right?", file=sys.stderr)
            bad = True
        for name, _, frame, stores, loads in sorted(set(framed + spilled)):
            print(f"  {names[name]}: {frame} bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads")
            bad = True
    verdict = "FAILED (every kernel must have 0 bytes stack frame and no spills)" if bad else "ok"
    print(f"[ptxas] {verdict}, {time.monotonic() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
