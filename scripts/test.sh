#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite on the CPU (gloo ranks,
# Triton under the interpreter). GPU tests skip cleanly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
.venv/bin/python -m pytest -q -ra tests "$@"
