#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite on the CPU (gloo ranks,
# Triton under the interpreter). GPU tests skip cleanly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU
.venv/bin/python -m pytest -q -ra tests "$@"
