#!/usr/bin/env bash
# Issue #38's GPU check, in about a minute: one bf16 training step of Qwen3.5 (Gated DeltaNet
# through flash-linear-attention's chunk_gated_delta_rule, when its wheel is carried) and Bamba
# (Mamba2 on transformers' torch path: mamba_ssm and causal-conv1d need compiling, not carried),
# hf.apply on 2 gloo ranks sharing the GPU against the same model in one process, both against
# a float64 one-process reference (python -m ulysses_kernels.bench.hybrid_step; its docstring).
# Run from the checkout, the wheels in build/wheels (the device tool's carry=["build/wheels"]):
#     python3 -m pip download --no-deps transformers==5.23.0 fla-core==0.6.0 einops==0.8.2 huggingface_hub==1.33.0 -d build/wheels
#     ULYSSES_KERNELS_GIT_SHA=$(git rev-parse --short HEAD) bash scripts/gpu_hybrid_step.sh [OUT_DIR]
# PYTHON=... picks the interpreter (default python3). The wheels are installed (--no-deps,
# offline) into private directories put first on PYTHONPATH: transformers 5.23 (what hf.apply's
# mixers are written against), fla-core (pure Python + Triton; imports einops), and
# huggingface_hub only when the machine's is older than transformers 5.23 needs (>= 1.31).
# If the run with fla stops before its checks (an import or Triton compile error), it runs once
# more on transformers' torch kernels (~30 s more; HYBRID_STEP_FALLBACK=0: not), its log beside.
# Without a GPU no wheel is installed and the CPU proxy runs (tiny sizes, transformers' torch
# kernels). Writes bench_hybrid_step_<date>_<gpu>_w2.{json,csv} and hybrid_step.txt (the table
# and the kernels that ran) into OUT_DIR (default bench/results/<UTC date>_<gpu>); exit status
# 1 when a check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # configs only: nothing to download
start=$(date +%s)
# The GPU's first word ("h100", "h200"; "cpu" without one), from nvidia-smi: no interpreter start.
slug=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' ' ' |
  awk '{for (i = 1; i <= NF; i++) if ($i != "nvidia" && $i != "tesla") {print $i; exit}}')
slug=${slug:-cpu}
OUT=${1:-bench/results/$(date -u +%F)_$slug}
mkdir -p "$OUT"
install() {  # install DIR WHEEL...: the wheels that exist, offline, no dependencies; prints DIR on success
  local dir=$1 have=() w
  shift
  for w in "$@"; do
    [ -f "$w" ] && have+=("$w") || echo "### [gpu_hybrid_step] no $w: that package comes from the machine (or is absent)" >&2
  done
  [ ${#have[@]} -gt 0 ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$dir" "${have[@]}" >&2 && echo "$dir"
}
fla_dir=
if [ "$slug" != cpu ]; then
  # transformers (and huggingface_hub when the machine's is older than transformers 5.23 needs),
  # and flash-linear-attention apart, so that a run without it is one PYTHONPATH away.
  tf=(build/wheels/transformers-5.23.0-*.whl)
  "$PY" -c 'import sys, huggingface_hub; from packaging.version import Version; sys.exit(Version(huggingface_hub.__version__) < Version("1.31"))' \
    2>/dev/null || tf+=(build/wheels/huggingface_hub-*.whl)
  tf_dir=$(install "$(mktemp -d /tmp/ulysses_hybrid_tf.XXXXXX)" "${tf[@]}") && export PYTHONPATH=$tf_dir:$PYTHONPATH
  fla_dir=$(install "$(mktemp -d /tmp/ulysses_hybrid_fla.XXXXXX)" build/wheels/fla_core-*.whl build/wheels/einops-*.whl)
fi
step() {  # step SECONDS PYTHONPATH LOG: the bench, its table on stdout and in LOG; its exit status
  PYTHONPATH=$2 timeout -k 10 "$1" "$PY" -m ulysses_kernels.bench.hybrid_step --timeout 100 --out-dir "$OUT" ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 |
    grep -v "is falling back to its reference PyTorch" | tee "$3"
  return "${PIPESTATUS[0]}"
}
EXTRA=("${@:2}")
step 150 "${fla_dir:+$fla_dir:}$PYTHONPATH" "$OUT/hybrid_step.txt"
rc=$?
# A run that stopped before its checks (no "checks within" line) with flash-linear-attention on the
# path: once more on transformers' torch kernels (HYBRID_STEP_FALLBACK=0: not), so that the bf16
# step is recorded either way; the first log keeps the error.
if [ "$rc" != 0 ] && [ -n "$fla_dir" ] && [ "${HYBRID_STEP_FALLBACK:-1}" = 1 ] && ! grep -q "checks within" "$OUT/hybrid_step.txt"; then
  echo "### [gpu_hybrid_step] the run with flash-linear-attention stopped (rc=$rc, log $OUT/hybrid_step.txt); again without it"
  step 90 "$PYTHONPATH" "$OUT/hybrid_step_torch_kernels.txt"
  echo "### [gpu_hybrid_step] without flash-linear-attention: rc=$? (the run with it failed: rc=$rc)"
fi
echo "### [gpu_hybrid_step] done in $(( $(date +%s) - start )) s, rc=$rc (records in $OUT)"
exit "$rc"
