#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: Ulysses attention across ranks
# (the local GPUs when there are at least two, else gloo ranks on the CPU), checked
# against single-process attention, with the head plan printed; then a short benchmark
# summary on the CPU (python -m ulysses_kernels.bench.summary, about a minute).
# ULYSSES_KERNELS_DEMO_BENCH=0 skips the benchmarks; =full runs scripts/bench_smoke.sh
# instead (every benchmark at tiny sizes, full tables).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Triton runs under its interpreter on machines without a GPU.
.venv/bin/python -c "import torch, sys; sys.exit(torch.cuda.is_available())" && export TRITON_INTERPRET=1
.venv/bin/python -m ulysses_kernels.demo "$@"
case "${ULYSSES_KERNELS_DEMO_BENCH:-summary}" in
  0) ;;
  full)
    echo; echo "[demo] every benchmark at tiny sizes on 2 gloo ranks, full tables (CPU timings, not a GPU claim)"
    bash scripts/bench_smoke.sh ;;
  *)
    echo; .venv/bin/python -m ulysses_kernels.bench.summary ;;
esac
