#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite on the CPU (gloo ranks,
# Triton under the interpreter). GPU tests skip cleanly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU
# Not -q: a line of progress per ~80 tests from the first minute.
# The five slowest tests are listed at the end (.ci/run asks for 20); then how long it took.
# Two pytest workers (pytest-xdist, installed by the set-up; --dist worksteal: a worker that runs
# out of tests takes some from the other). Each has its own pool of gloo worlds.
# ULYSSES_KERNELS_TEST_WORKERS=0 runs every test in one process, in order.
workers=${ULYSSES_KERNELS_TEST_WORKERS:-2}
parallel=()
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist worksteal)
start=$SECONDS
rc=0
.venv/bin/python -m pytest -ra --durations=5 "${parallel[@]}" tests "$@" || rc=$?
took=$((SECONDS - start))
echo "[test] pytest took $((took / 60)) min $((took % 60)) s (exit status $rc)"
exit $rc
