#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: Ulysses attention across ranks
# (the local GPUs when there are at least two, else gloo ranks on the CPU), checked
# against single-process attention, with the head plan printed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
.venv/bin/python -m ulysses_kernels.demo "$@"
