#!/usr/bin/env bash
# The pack/unpack kernel variants (issue #36) on one GPU, in about 90 s (at most ~105 s: step 3
# runs only when under 80 s were used): which is faster, and
# are they exact there. Run from the checkout, with _C built for this GPU:
#     bash scripts/gpu_pack_ab.sh            # PYTHON=... to pick the interpreter
# 1. bench.pack, kernels cuda, triton, torch, variants old and new (triton's two; cuda has only
#    new since "wide" lost on the uneven unpack, issue 49), the five default GPU
#    configurations (96-320 MiB buffers, bf16), every row checked bit for bit: JSON/CSV in
#    bench/results/ (meta.variants: % of copy per config and variant, each set's time ratio)
#    and the "# variants" lines that say which is faster.
# 2. GPU tests of the cuda kernels: one unpack launch for q/k/v, CUDA-graph capture, the
#    16-byte path and its SASS (bit-exactness: every bench.pack row above).
# 3. if time is left: bench.attention's layout rows (one layer's packs/unpacks, eager and
#    replayed from a CUDA graph, against the chain's copies) for Llama-3-8B heads, 4K-128K.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=bench/results
mkdir -p "$OUT"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
rc=0
echo "### [gpu_pack_ab] bench.pack, variants old,new"
timeout 75 "$PY" -m ulysses_kernels.bench.pack --kernels cuda,triton,torch --variants old,new --warmup 5 --iters 40 --out "$OUT" \
  2>&1 | tee "$OUT/bench_pack_variants.txt" || rc=1
echo "### [gpu_pack_ab] GPU tests of the cuda kernels ($(elapsed) s so far)"
timeout 30 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda_kernels.py tests/test_cuda_kernels_gpu.py \
  -k "one_launch or capture or vector_path or sass" 2>&1 | tail -5 || rc=1
if [ "$(elapsed)" -lt 80 ]; then
  echo "### [gpu_pack_ab] bench.attention layout rows ($(elapsed) s so far)"
  timeout 30 "$PY" -m ulysses_kernels.bench.attention --sp 8 --models llama3-8b --min-seq 4096 --max-seq 131072 \
    --methods layout-cuda,layout-cuda+graph,layout-triton,chain-layout --out-dir "$OUT" 2>&1 | grep -v "^\[attention" || rc=1
else
  echo "### [gpu_pack_ab] skipped bench.attention: $(elapsed) s used"
fi
echo "### [gpu_pack_ab] done in $(elapsed) s, rc=$rc"
exit $rc
