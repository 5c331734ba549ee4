#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a venv in .venv with torch, the test tools and
# ulysses_kernels itself (editable). Re-running it is cheap when everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${ULYSSES_KERNELS_TORCH:-torch==2.14.1}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, numpy, pytest, ninja, transformers" 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC numpy pytest ninja transformers==5.23.0 into .venv"
  .venv/bin/pip install -q --disable-pip-version-check "$TORCH_SPEC" numpy pytest ninja transformers==5.23.0 2>&1 | grep -v "^WARNING: Location" || true
fi
if ! .venv/bin/python -c "import ulysses_kernels" 2>/dev/null; then
  echo "[setup] installing ulysses_kernels (editable)"
  .venv/bin/pip install -q --disable-pip-version-check --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -c "import torch, ulysses_kernels; print('[setup] torch', torch.__version__, '| ulysses_kernels', ulysses_kernels.__version__)"
