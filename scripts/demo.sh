#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: Ulysses attention across ranks
# (the local GPUs when there are at least two, else gloo ranks on the CPU), checked
# against single-process attention, with the head plan printed; then a short, checked
# run of the benchmarks (ULYSSES_KERNELS_DEMO_BENCH=0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Triton runs under its interpreter on machines without a GPU.
.venv/bin/python -c "import torch, sys; sys.exit(torch.cuda.is_available())" && export TRITON_INTERPRET=1
.venv/bin/python -m ulysses_kernels.demo "$@"
if [ "${ULYSSES_KERNELS_DEMO_BENCH:-1}" != "0" ]; then
  echo; echo "[demo] short benchmark run (CPU numbers are not GPU claims; see bench/README.md)"
  bash scripts/bench_smoke.sh
fi
