#!/usr/bin/env bash
# C++ unit tests of the CPU kernels (no torch, no CUDA): configure, build and run with CTest.
# Uses the cmake on PATH (>= 3.18); without one, installs cmake==3.31.10 into build/cmake-venv.
# Then the ptxas check of the CUDA kernels (scripts/ptxas_check.py: no stack frame, no
# spills, sm_80 and sm_90; needs nvcc, no GPU; about 20-30 s on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build/ctest
CMAKE=cmake
if ! command -v cmake >/dev/null 2>&1; then
  python3 -m venv build/cmake-venv
  build/cmake-venv/bin/pip install -q --disable-pip-version-check cmake==3.31.10
  CMAKE=build/cmake-venv/bin/cmake
fi
start=$(date +%s)
"$CMAKE" -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DULYSSES_KERNELS_BUILD_TESTS=ON >/dev/null
"$CMAKE" --build "$BUILD" -j "${MAX_JOBS:-2}"
CTEST="$(dirname "$(command -v "$CMAKE")")/ctest"
(cd "$BUILD" && "$CTEST" --output-on-failure)
echo "[ctest] C++ unit tests built and run in $(( $(date +%s) - start )) s"
python3 scripts/ptxas_check.py
