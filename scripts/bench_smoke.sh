#!/usr/bin/env bash
# A short CPU run of the benchmarks (2 gloo ranks, tiny sizes): every row is checked
# (#wrong must be 0) and the CSV/JSON land in $ULYSSES_KERNELS_BENCH_OUT (default: a new temporary directory).
# CPU timings only (not a GPU claim). Run scripts/setup.sh first (scripts/test.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${ULYSSES_KERNELS_BENCH_OUT:-$(mktemp -d -t ulysses_bench_smoke.XXXXXX)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
say() { echo; echo "### $*"; }
say "all-to-all: bare, the permute chain and ours with the torch kernel set (the Triton interpreter is slow)"
"$PY" -m ulysses_kernels.bench.alltoall --spawn 2 -b 1K -e 64K -f 4 -w 1 -n 3 --op a2a,chain,fused-torch --out-dir "$OUT"
"$PY" -m ulysses_kernels.bench.alltoall --spawn 2 -b 1K -e 64K -f 4 -w 1 -n 3 --op a2a,chain,fused-torch --dir h2s --out-dir "$OUT"
say "attention layer: a Llama-3-8B-shaped layout scaled down (8 query / 2 KV heads)"
"$PY" -m ulysses_kernels.bench.attention --spawn 2 --heads-sets 8/2 --seqs 64,128 --head-dim 16 -w 1 -n 2 \
  --methods local,chain,ulysses-torch,deepspeed,yunchang,layout-torch,chain-layout --out-dir "$OUT"
# The cost-model env makes chunks="auto" pick more than one chunk at these sizes.
say "chunked overlap, a code-path check: the env forces chunks='auto' to chunk at tiny sizes, where chunking is slower on a CPU; every row checked against chunks=1 bit for bit"
ULYSSES_KERNELS_LINK_GBPS=0.1 ULYSSES_KERNELS_ATTN_TFLOPS=0.001 ULYSSES_KERNELS_LINK_LATENCY_US=0 \
  ULYSSES_KERNELS_OVERLAP_SLOWDOWN=0 "$PY" -m ulysses_kernels.bench.overlap --spawn 2 --layouts 8/2,6/3 --seqs 32,64 \
  --head-dim 8 -w 1 -n 2 --chunks 1,2,4,auto --out-dir "$OUT"
say "pack/unpack against a copy of the same bytes and the permute chain"
"$PY" -m ulysses_kernels.bench.pack --device cpu --iters 3 --out "$OUT"
say "host time per call at tiny shapes: the op (check off and on), the module and the permute chain"
"$PY" -m ulysses_kernels.bench.host --spawn 2 -w 2 -r 20 -n 2 --out-dir "$OUT"
say "the performance model's table (formulas and published constants; no measurement)"
"$PY" -m ulysses_kernels.bench.perf_model --seqs 32K,1M
