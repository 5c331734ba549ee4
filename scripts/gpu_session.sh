#!/usr/bin/env bash
# shellcheck disable=SC2054  # comma lists below are flag values (--seqs 8K,32K), not array syntax
# Staged runbook for a lent GPU (one H100/H200, offline, torch/triton preinstalled): each `run`
# call runs one or more stages, in order.
#
# NEXT (issue 49, after the 2026-11-30 record bench/results/2026-11-30_h200_world): ONE call, `world`: 12 steps, budgets
# summing to 525 s under one 540 s deadline (the budgets measured that day). Here, first:
#   /work/main/.venv/bin/python scripts/nccl_carry.py   # build/nccl_carry/: NCCL 2.30.7, sm_90 only, 29.4 MiB, checked
#   GPU_SESSION_DRY_RUN=1 bash scripts/gpu_session.sh world   # the plan: every step, its budget, the sum
# The device tool's call (the working tree ~5 MB + build/nccl_carry 29.4 MiB):
#   run(command="GPU_SESSION_GIT_SHA=<git rev-parse --short HEAD> bash scripts/gpu_session.sh world",
#       carry=["build/nccl_carry"], timeout_s=600)
# It unpacks the carried NCCL ahead of torch's (LD_PRELOAD, and first on PYTHONPATH so that torch's own preload maps the
# same file), probes it (ncclGetVersion of the mapped file; 2 ranks on GPU 0 all-reduce), builds _C against it, and
# records into bench/results/<date>_<gpu>_world/: the self-test at 8 NCCL ranks on the one GPU (all 330 paths), the
# quantizing pack (#50, the warp-per-row kernels), where a packed call's time goes (#37), the two-rank tests (-v -s), bench.alltoall and bench.overlap at 8
# ranks on one GPU, the self-test at 4 ranks, bench.pack (new and the Triton variants), the cudnn packed rows (#37).
# Back in $OUT: summary_world.txt and gpu_session_world.tgz (`tar xzf` in the repo root puts the record in place).
# GPU_SESSION_SKIP="step ..." leaves out steps an earlier call of the session recorded. docs/gpu_validation.md: the table.
#
# Before (the 2026-11-28 wave ran; its fixes and candidates wait for a GPU): ONE call, ~5 min,
#   python3 -m pip download --no-deps transformers==5.23.0 fla-core==0.6.0 einops==0.8.2 huggingface_hub==1.33.0 -d build/wheels  # here
#   GPU_SESSION_GIT_SHA=<sha of HEAD> GPU_SESSION_XDIST=8 GPU_SESSION_BUDGET_S=340 bash scripts/gpu_session.sh recheck
#   # (device tool: timeout_s=360, carry=["build/wheels"]). It records into bench/results/<date>_<gpu>_recheck/:
#   # the cuda pack variants (#36: decided on 2026-11-30, `new` kept, `wide` deleted),
#   # the layout rows at 15 iterations (the 8K outlier), the packed fa2 and cudnn rows (#37: backends.PACKED_DEFAULT),
#   # the hybrid bf16 step (#38), and the GPU tests of the fixes (SASS per built arch, bf16 bounds, transformers 5.17).
#
#   GPU_SESSION_GIT_SHA=<sha of HEAD> GPU_SESSION_XDIST=8 GPU_SESSION_BUDGET_S=565 bash scripts/gpu_session.sh wave
#   # ONE call (device tool: timeout_s=600, carry=["build/wheels"]), ~9 min. Before it, here:
#   #   python3 -m pip download --no-deps transformers==5.23.0 -d build/wheels
#   # (the GPU machine's transformers 5.17 lacks what bench.longctx needs; wave_extra installs the wheel).
#
# `wave` runs every GPU-bound check of the current wave in one call (timeout_s=600 for the
# device tool; the default budget GPU_SESSION_BUDGET_S=540 s leaves the rest for start and
# copy-back) and writes its record where it is committed: bench/results/<date>_<gpu>/ (e.g.
# 2026-11-28_h100/; summary.txt, info, selftest JSON, test logs and junit, bench JSON/CSV and
# their tables). Its steps, in priority order, each SKIPPED once the budget would not hold it
# (estimates from the first run, H200, bench/results/2026-11-27_h200/: _C built in 11 s, the
# self-test's 210 paths in 15 s, the GPU test files 15-53 s each, bench.attention 4K..256K ~75 s):
#   setup ~1 min | info (+ the _C error-path probe) ~15 s | selftest ~40 s |
#   gpu_tests: the GPU test files under pytest-xdist (-n 4: a test that crashes its process costs
#   that test, not the rest of its file) ~1.5-2 min | bench_pack_auto (kernels=auto: the default)
#   ~40 s | compile_tests (xdist) ~1 min | bench_pack_sets (cuda, triton, torch) ~45 s |
#   bench_attention llama3-8b 4K..256K ~1.5 min | perf_model ~10 s | wave_extra (EDIT: the steps
#   of the merged work, e.g. bench.longctx, packed attention rows; see wave_extra below).
# Then, with 8+ min left in another call: `user`, or GPU_SESSION_ATTN_MODELS=qwen2.5-14b attn.
# The older split (build tests nccl2 / bench attn) still works:
#   bash scripts/gpu_session.sh build tests nccl2   # ~8-9 min
#   bash scripts/gpu_session.sh bench attn          # ~7 min
#   (each with GPU_SESSION_GIT_SHA=<sha of HEAD> in front: see CARRY below)
#
# Stages (each one sets up what it needs first, so any stage runs on a fresh machine):
#   build  venv seeing the system torch (scripts/setup.sh, ULYSSES_KERNELS_SYSTEM_TORCH=1), _C for
#          this GPU's arch only; nvidia-smi, nvcc, `python -m ulysses_kernels.info`, torch's NCCL
#   wave   everything above marked for this wave, into bench/results/<date>_<gpu>/ (see the top)
#   tests  the self-test (python -m ulysses_kernels.selftest: every path on the one GPU), then
#          the GPU test files, one pytest each (with pytest-xdist: -n 4, a crashing test costs one
#          test; without it --maxfail 3, not -x: one failure must not hide the file's GPU tests
#          behind it; per-test timeout), the two-rank tests excluded
#   bench  bench_pack (kernels=auto, then each set), bench_attention (rank 0 of 8, llama3-8b, 4K..256K), perf_model, and as
#          checks only (not committed) bench_alltoall and bench_overlap on a world of one
#   nccl2  2 NCCL ranks on the one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1; skipped if NCCL < 2.30):
#          the self-test at 2 ranks, the two-rank tests and bench_overlap --world 2 (correctness; timings not a claim)
#   recheck  a short call after a wave: its fixes re-measured (see stage_recheck)
#   world  issue 49 in one call: several NCCL ranks on the one GPU over the carried NCCL >= 2.30, then the
#          recheck's decisive rows (see stage_world); needs build/nccl_carry (scripts/nccl_carry.py)
#   attn   bench_attention 4K..1M for $GPU_SESSION_ATTN_MODELS (default llama3-8b), perf_model
#   user   tests/test_user_commands.py in this venv: the documented commands as a user types them
#
# What comes back in $OUT (at most 4 files): summary_<stages>.txt; gpu_session_<stages>.tgz with
# build/gpu_session/<stages>/ (logs, junit, env) and the new bench/results/ files, paths relative
# to the repo root (`tar xzf ... -C <repo>` puts results where they are committed); after a build,
# gpu_carry/_C.cpython-312-*.so and gpu_carry/stamp.
# CARRY to later calls (a fresh machine skips the ~1 min build): copy $OUT's gpu_carry/* here to
# build/gpu_carry/ and pass carry=["build/gpu_carry"] (call 1: no carry). The .so (~8 MB) is used
# only when its stamp matches csrc/, setup.py, python, torch and arch. The device tool refuses to
# carry .git (measured 2026-11-25), so name the sha: GPU_SESSION_GIT_SHA=$(git rev-parse --short
# HEAD) in front of the command (results say "unknown" otherwise).
# Not .venv: it is a few links to the machine's own python, recreated in seconds.
#
# Every step runs under `timeout`, inside a budget for the whole call (GPU_SESSION_BUDGET_S,
# default 540 s); a step that would not fit is SKIPPED. Exit status: non-zero if any step failed.
# NCCL: with build/nccl_carry/ present (the device tool's carry), the call first unpacks it into
# build/nccl/ and, if torch then runs it, every later step runs on it (LD_PRELOAD, PYTHONPATH,
# NCCL_HOME for _C, NCCL_MULTI_RANK_GPU_ENABLE=1); otherwise it says so and runs on the machine's
# NCCL, and the steps that need several ranks on one GPU are SKIPPED by name. The summary's header,
# `info`, every self-test and bench record name the NCCL that ran. GPU_SESSION_NCCL_CARRY=0: ignore the carry; GPU_SESSION_NCCL_CARRY_DIR: another folder.
# GPU_SESSION_DRY_RUN=1 prints the commands and, at the end, every step's budget and their sum; GPU_SESSION_TINY=1 runs them at tiny sizes without a
# GPU (CPU check that every command line parses; results stay in build/gpu_session/).
# Other knobs: GPU_SESSION_SKIP="step step ..." (steps an earlier call of the same session recorded),
# GPU_SESSION_TESTS (test files), GPU_SESSION_TEST_TIMEOUT (per test, s),
# GPU_SESSION_MAXFAIL, GPU_SESSION_XDIST (workers, default 4; 0: no xdist), GPU_SESSION_ATTN_MODELS,
# GPU_SESSION_ATTN_MAX_SEQ, GPU_SESSION_ARCH, GPU_SESSION_REBUILD=1, GPU_SESSION_STEP_SCALE (every step budget times N:
# a TINY check on a slow CPU). TINY builds _C for one arch:
# run it in a copy of the tree, not in a checkout whose _C others are using.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n '3,/^set -euo/p' "$0" | sed '$d'; exit 2; }
for s in "$@"; do case $s in wave|recheck|world|build|tests|bench|nccl2|attn|user) ;; *) echo "unknown stage: $s" >&2; exit 2;; esac; done

DRY=${GPU_SESSION_DRY_RUN:-0} TINY=${GPU_SESSION_TINY:-0}
BASE_PY=${GPU_SESSION_PYTHON:-python3} PY=.venv/bin/python
TAG=$(IFS=-; echo "$*") T0=$(date +%s)
DEADLINE=$((T0 + ${GPU_SESSION_BUDGET_S:-540}))
LOG=build/gpu_session/$TAG SUMMARY=build/gpu_session/$TAG/summary.txt
RESULTS=bench/results; [ "$TINY" = 1 ] && RESULTS=$LOG/results
rm -rf "$LOG"; mkdir -p "$LOG" "$RESULTS" bench/results
LC_ALL=C ls bench/results > "$LOG/.results_before"
# run_ranks' default timeout: its deadline (this + 30 s) before the per-test timeout (240 s),
# so that a hung spawn is killed and reported by run_ranks; a test that pytest-timeout stops
# leaves its ranks behind, and pytest waits for them at exit (until the step is killed).
export PYTHONUNBUFFERED=1 ULYSSES_KERNELS_TEST_TIMEOUT=${ULYSSES_KERNELS_TEST_TIMEOUT:-180}
FAILED=0 PLAN=() NCCL_RUNS="?"

say() { echo "[gpu_session] $*" | tee -a "$SUMMARY"; }

publish() {  # the summary and a tarball of logs + new results into $OUT (again after every step)
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT"; cp "$SUMMARY" "$OUT/summary_$TAG.txt"
  { LC_ALL=C comm -13 "$LOG/.results_before" <(LC_ALL=C ls bench/results) | sed 's|^|bench/results/|'
    # the wave's folder even when it existed before (a second wave on the same day)
    case ${WAVE_DIR:-$LOG} in "$LOG"*) ;; *) [ -d "$WAVE_DIR" ] && echo "$WAVE_DIR" ;; esac
  } | LC_ALL=C sort -u > "$LOG/.results_new"
  tar czf "$OUT/gpu_session_$TAG.tgz" "$LOG" -T "$LOG/.results_new"
}

step() {  # step NAME LIMIT_S CMD...: run under timeout, log to $LOG/NAME.log, record the outcome
  local name=$1 limit=$2 left rc t res
  shift 2
  case " ${GPU_SESSION_SKIP:-} " in *" $name "*) say "SKIPPED  $name (GPU_SESSION_SKIP: recorded by an earlier call)"; return 0 ;; esac
  left=$((DEADLINE - $(date +%s) - 20))
  if [ "$left" -lt 30 ]; then say "SKIPPED  $name (call budget spent)"; FAILED=1; return 1; fi
  limit=$((limit * ${GPU_SESSION_STEP_SCALE:-1}))  # a CPU check (TINY) on slow cores: every budget times this
  [ "$limit" -gt "$left" ] && limit=$left
  PLAN+=("$name $limit")
  echo "[gpu_session] >>> $name (timeout ${limit}s): $*"
  [ "$DRY" = 1 ] && return 0
  t=$(date +%s)
  set +e
  timeout -k 15 "$limit" "$@" </dev/null 2>&1 | tee "$LOG/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  t=$(($(date +%s) - t))
  # pytest's last line ("3 passed, 1 skipped in 9.1s"), else nothing
  res=$(grep -E '(passed|failed|skipped|error|deselected).* in [0-9.]+s' "$LOG/$name.log" | tail -1 | tr -d '=' || true)
  case $rc in
    0) say "OK       $name ${t}s $res" ;;
    124|137) say "TIMEOUT  $name after ${t}s $res" ;;
    *) say "FAILED   $name rc=$rc ${t}s $res" ;;
  esac
  if [ "$rc" != 0 ]; then
    FAILED=1
    echo "!!!!! $name FAILED; last lines of $LOG/$name.log:" >&2
    tail -25 "$LOG/$name.log" >&2
  fi
  publish
  return "$rc"
}

die() { say "ABORT    $*"; publish; exit 1; }

# ---- set-up: venv seeing the preinstalled torch, and the _C extension for this GPU -------------
make_venv() {  # scripts/setup.sh makes a venv that sees $BASE_PY's packages (even if it is a venv)
  [ -x "$PY" ] && return 0
  ULYSSES_KERNELS_SYSTEM_TORCH=1 ULYSSES_KERNELS_SKIP_EXTENSION=1 PYTHON="$BASE_PY" bash scripts/setup.sh >"$LOG/venv.log" 2>&1 ||
    { cat "$LOG/venv.log"; die "could not make the venv (scripts/setup.sh)"; }
  "$PY" -c 'import torch, pytest' || die "the venv does not see torch and pytest of $BASE_PY"
}

find_plugin() {  # find_plugin MODULE: let $PY import a pytest plugin that only $BASE_PY has
  # (pytest-xdist, pytest-timeout: on the GPU machine they sit beside its torch, per the first
  # run's xdist logs). The venv sees $BASE_PY's site-packages already; a plugin installed in a
  # user or other directory is put on PYTHONPATH (after everything else). 0: importable now.
  "$PY" -c "import $1" 2>/dev/null && return 0
  local dir
  dir=$("$BASE_PY" -c "import os, $1; print(os.path.dirname(os.path.dirname(os.path.abspath($1.__file__))))" 2>/dev/null) || return 1
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$dir"
  "$PY" -c "import $1" 2>/dev/null
}

pytest_args() {  # PYTEST_ARGS: crash isolation (xdist) and a per-test timeout, where the plugins exist
  PYTEST_ARGS=()
  if [ "$DRY" = 1 ] || find_plugin pytest_timeout; then PYTEST_ARGS+=(--timeout "${GPU_SESSION_TEST_TIMEOUT:-240}")
  else say "note: pytest-timeout missing: no per-test timeout (each step still has one)"; fi
  if [ "${GPU_SESSION_XDIST:-4}" != 0 ] && { [ "$DRY" = 1 ] || find_plugin xdist; }; then
    PYTEST_ARGS+=(-n "${GPU_SESSION_XDIST:-4}")
  else
    PYTEST_ARGS+=(--maxfail "${GPU_SESSION_MAXFAIL:-3}")
    [ "${GPU_SESSION_XDIST:-4}" = 0 ] || say "note: pytest-xdist missing: a test that crashes its process ends its pytest run"
  fi
}

stamp() {  # what the build depends on: sources, python, torch, arch, the NCCL header
  { find csrc setup.py -type f | LC_ALL=C sort | xargs cat
    "$PY" -c 'import sys, torch; print(sys.version, torch.__version__)'; echo "$ARCH"
    cat "${NCCL_HOME:-/nonexistent}/include/nccl.h" 2>/dev/null || true; } | sha256sum | cut -c1-16
}

nccl_version() {  # the NCCL that runs in this environment ("2.30.7": ncclGetVersion of the libnccl mapped, not torch's header), "?"
  "${1:-$PY}" -c 'from ulysses_kernels.extension import loaded_nccl_version as v; print(".".join(map(str, v())))' 2>/dev/null || echo "?"
}

use_nccl_carry() {  # the carried NCCL >= 2.30 (build/nccl_carry: scripts/nccl_carry.py) ahead of torch's, if torch runs it
  # The library goes to build/nccl/nvidia/nccl/lib: LD_PRELOAD names it, and build/nccl first on PYTHONPATH
  # makes torch's own preload (nvidia/nccl/lib/libnccl.so.* of the first sys.path entry) map the same file.
  # The probe: torch runs it, one copy mapped, 2 ranks on GPU 0 all-reduce through its kernels.
  local dir=$PWD/build/nccl lib=$PWD/build/nccl/nvidia/nccl/lib/libnccl.so.2 carry=${GPU_SESSION_NCCL_CARRY_DIR:-build/nccl_carry}
  if [ "${GPU_SESSION_NCCL_CARRY:-1}" != 1 ] || [ ! -f "$carry/manifest.json" ]; then
    say "NCCL: none carried ($carry; GPU_SESSION_NCCL_CARRY=${GPU_SESSION_NCCL_CARRY:-1}): the machine's $([ "$DRY" = 1 ] || nccl_version "$BASE_PY")"
    return 0
  fi
  [ "$DRY" = 1 ] || rm -rf "$dir"
  if step nccl_carry 30 bash -c "\"\$0\" scripts/nccl_carry.py --out '$carry' --unpack '$dir' &&
      LD_PRELOAD='$lib' PYTHONPATH='$dir' \"\$0\" scripts/nccl_carry.py --probe '$dir'" "$BASE_PY"; then
    [ "$DRY" = 1 ] && { say "NCCL: (dry run) the carried one would run ahead of the machine's, from $lib"; return 0; }
    export LD_PRELOAD=$lib${LD_PRELOAD:+:$LD_PRELOAD} PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} NCCL_HOME=$dir/nvidia/nccl NCCL_MULTI_RANK_GPU_ENABLE=1
    say "NCCL: the carried $(sed -n 's/.*"nccl": "\(.*\)".*/\1/p' "$carry/manifest.json") runs ahead of the machine's ($lib)"
  else
    say "NCCL: the carried NCCL did not run (nccl_carry.log): this call runs on the machine's $(nccl_version "$BASE_PY")"
  fi
}

multi_rank_ok() {  # multi_rank_ok STEP: 0 when several ranks may share the GPU (NCCL >= 2.30), else SKIPPED by name
  [ "$DRY" = 1 ] && return 0
  local major minor
  IFS=. read -r major minor _ <<< "$NCCL_RUNS"
  if [ "${major:-0}" -gt 2 ] 2>/dev/null || { [ "${major:-0}" = 2 ] && [ "${minor:-0}" -ge 30 ] 2>/dev/null; }; then return 0; fi
  say "SKIPPED  $1: NCCL $NCCL_RUNS runs here, and NCCL < 2.30 refuses several ranks on one GPU"; FAILED=1; return 1
}

ext_ok() {  # the _C in the tree loads, has CUDA code for $ARCH, and was built from these sources
  [ "$(cat build/gpu_carry/stamp 2>/dev/null)" = "$(stamp)" ] &&
    "$PY" -c "from ulysses_kernels import extension as L; i = L.build_info()
assert i.get('built') and i.get('cuda') and '$ARCH' in i.get('archs', '').split(';'), i" 2>/dev/null
}

setup() {
  if [ "$DRY" = 1 ]; then say "dry run: commands printed, nothing run"; fi
  use_nccl_carry
  if [ "$DRY" = 1 ]; then ARCH=${GPU_SESSION_ARCH:-9.0}
  else
    make_venv
    if [ "$TINY" != 1 ]; then
      "$PY" -c 'import torch; assert torch.cuda.is_available()' || die "no CUDA GPU visible to torch (GPU_SESSION_TINY=1 for a CPU check)"
    fi
    ARCH=${GPU_SESSION_ARCH:-$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else "9.0")')}
    # A carried build: use it if it matches these sources (else it is rebuilt below).
    if [ -f build/gpu_carry/stamp ] && [ "$(cat build/gpu_carry/stamp)" = "$(stamp)" ]; then cp build/gpu_carry/_C*.so ulysses_kernels/; fi
  fi
  local skip=0
  [ "$DRY" != 1 ] && [ "${GPU_SESSION_REBUILD:-0}" != 1 ] && ext_ok && skip=1
  [ "$skip" = 1 ] && say "using the carried _C build (stamp $(stamp))"
  step setup "$SETUP_S" env ULYSSES_KERNELS_SYSTEM_TORCH=1 ULYSSES_KERNELS_SKIP_EXTENSION=$skip PYTHON="$BASE_PY" \
    ULYSSES_KERNELS_CUDA_ARCHS="$ARCH" MAX_JOBS="$(nproc)" bash scripts/setup.sh ||
    { cp build/setup_build_ext.log "$LOG/" 2>/dev/null; die "set-up failed (see $LOG/setup.log)"; }
  cp build/setup_build_ext.log "$LOG/" 2>/dev/null || true
  [ "$DRY" = 1 ] && return 0
  if [ "$skip" = 0 ]; then
    mkdir -p build/gpu_carry; rm -f build/gpu_carry/*
    cp ulysses_kernels/_C*.so build/gpu_carry/ && stamp > build/gpu_carry/stamp
  fi
  ext_ok || die "ulysses_kernels._C is not usable with CUDA code for arch $ARCH (see $LOG/setup.log)"
  if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/gpu_carry"; cp build/gpu_carry/* "$OUT/gpu_carry/"; fi
  [ -n "${GPU_SESSION_GIT_SHA:-}" ] && export ULYSSES_KERNELS_GIT_SHA=$GPU_SESSION_GIT_SHA  # bench JSON, without .git
  NCCL_RUNS=$(nccl_version)  # what torch runs in this call, for multi_rank_ok
  local sha
  # the sha named by the caller first: the GPU machine may hold a stale .git of an earlier call (2026-11-30: aa337a4)
  if [ -n "${GPU_SESSION_GIT_SHA:-}" ]; then sha=$GPU_SESSION_GIT_SHA
  elif sha=$(git rev-parse --short HEAD 2>/dev/null); then git diff --quiet HEAD || sha="$sha +local edits"
  else sha="unknown (set GPU_SESSION_GIT_SHA)"; fi
  say "$TAG | git $sha | $(date -u +%FT%TZ) | $("$PY" -c '
import torch, triton
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (CPU check)"
from ulysses_kernels.extension import loaded_nccl_version
nccl = ".".join(map(str, loaded_nccl_version() or ("?",)))
print(f"{gpu} | torch {torch.__version__} CUDA {torch.version.cuda} | NCCL {nccl} | triton {triton.__version__}")')"
}

# ---- stages ------------------------------------------------------------------------------------
stage_build() {
  if [ "$TINY" != 1 ] || command -v nvidia-smi >/dev/null; then step nvidia_smi 30 nvidia-smi || true; fi
  step nvcc 30 bash -c 'which nvcc; nvcc --version; nproc; free -g; df -h .' || true
  step info 60 "$PY" -m ulysses_kernels.info || true
  # The record's JSON copy: under set -e a failure here would end the call before the tests,
  # so it is reported (and counted) instead.
  if [ "$DRY" != 1 ] && ! timeout -k 5 60 "$PY" -m ulysses_kernels.info --json > "$LOG/info.json" 2> "$LOG/info_json.err"; then
    say "FAILED   info --json (see $LOG/info_json.err; the later stages still run)"; FAILED=1
  fi
  step device 60 "$PY" -c 'import torch; print(torch.cuda.get_device_properties(0) if torch.cuda.is_available() else "no GPU"); from ulysses_kernels.extension import loaded_nccl_version; print("NCCL that runs", loaded_nccl_version(), "torch built with", torch.cuda.nccl.version())' || true
}

stage_tests() {
  local f
  pytest_args
  # The self-test first: every path (kernel sets x communicators x chunks x cases, ring and
  # packed and checkpointed ones included) forward and backward against float64, one rank
  # per GPU (here 1, NCCL); its JSON is what docs/gpu_validation.md's rows cite.
  # (--timeout 90: its hang watchdog, 2 * 90 + 60 s, ends a stuck run inside the step limit.)
  step selftest 240 "$PY" -m ulysses_kernels.selftest --timeout 90 --json "$LOG/selftest_gpu.json" || true
  # test_large_index last: its CUDA/Triton far views (64-bit offsets, ~30 GiB of GPU memory
  # at peak) and >2^31-unit moves run nowhere else on a GPU; ~1 min with its CPU cases.
  for f in ${GPU_SESSION_TESTS:-tests/test_cuda_kernels.py tests/test_cuda_kernels_gpu.py tests/test_triton_kernels.py tests/test_nccl_comm.py tests/test_pipeline.py tests/test_stream_safety.py tests/test_compile.py tests/test_large_index.py}; do
    f=$(basename "$f" .py)
    step "$f" 300 "$PY" -m pytest -q -ra -k "not two_ranks" "${PYTEST_ARGS[@]}" --junitxml "$LOG/junit_$f.xml" "tests/$f.py" || true
  done
}

pack_summary() {  # the pack targets: fused pack >= 90% of copy bandwidth, and >= 3x the chain
  [ "$DRY" = 1 ] && return 0
  "$PY" - "$RESULTS" <<'EOF' | tee -a "$SUMMARY" || true
import glob, json, os, sys
path = max(glob.glob(os.path.join(sys.argv[1], "bench_pack_*.json")), key=os.path.getmtime)
print(f"pack summary ({os.path.basename(path)}): fused GB/s over copy GB/s (target >= 90%), chain time / fused (target >= 3x)")
for r in json.load(open(path))["rows"]:
    if r["method"].startswith("fused"):
        chain = f"{r['x_chain']:6.2f}x" if r.get("x_chain") else "     -"
        print(f"  {r['config']:<28} {r['op']:<6} {r['bytes'] / 2**20:9.1f} MiB {r['pct_copy']:6.1f}% {chain}")
EOF
}

bench_pack_steps() {  # kernels=auto (what a user gets by default), then every set side by side
  step bench_pack_auto 120 "$PY" -m ulysses_kernels.bench.pack --kernels auto --warmup 10 --iters 100 --out-dir "$RESULTS" && pack_summary || true
  step bench_pack_sets 150 "$PY" -m ulysses_kernels.bench.pack --kernels cuda,triton,torch --warmup 10 --iters 50 --out-dir "$RESULTS" && pack_summary || true
}

stage_bench() {
  local a=(--models llama3-8b --min-seq 4K --max-seq 256K) o=(--layouts 32/8 --seqs 8K,32K,64K) x=(-b 1M -e 256M -f 4)
  [ "$TINY" = 1 ] && a=(--heads-sets 8/2 --seqs 64,128 --head-dim 16) o=(--layouts 8/2 --seqs 64,256 --head-dim 16) x=(-b 1K -e 64K -f 4)
  bench_pack_steps
  step bench_attention 300 "$PY" -m ulysses_kernels.bench.attention --sp 8 "${a[@]}" -w 2 -n 5 --out-dir "$RESULTS" &&
    step perf_model 60 "$PY" -m ulysses_kernels.bench.perf_model --attention-json "$RESULTS/bench_attention_latest.json" || true
  # Checks on a world of one (the collective is a self-copy): correctness of the GPU paths, and
  # the chunked pipeline's overhead; kept out of bench/results (no bandwidth or overlap claim).
  step alltoall_w1 120 "$PY" -m ulysses_kernels.bench.alltoall "${x[@]}" -w 5 -n 20 --out-dir "$LOG/w1" || true
  step overlap_w1 150 "$PY" -m ulysses_kernels.bench.overlap --spawn 0 "${o[@]}" -w 2 -n 5 --out-dir "$LOG/w1" || true
}

stage_nccl2() {
  local v
  v=$("$PY" -c 'from ulysses_kernels.extension import loaded_nccl_version; v = loaded_nccl_version(); print(".".join(map(str, v)), int(tuple(v) >= (2, 30)))' 2>/dev/null || echo "? 1")
  if [ "${v#* }" != 1 ] && [ "$DRY" != 1 ]; then say "SKIPPED  nccl2: NCCL ${v% *} < 2.30 has no multi-rank-per-GPU"; return 0; fi
  step selftest_w2 240 env NCCL_MULTI_RANK_GPU_ENABLE=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m ulysses_kernels.selftest --timeout 90 --json "$LOG/selftest_w2.json" || true
  step two_ranks 300 env NCCL_MULTI_RANK_GPU_ENABLE=1 "$PY" -m pytest -q -ra -k two_ranks --junitxml "$LOG/junit_two_ranks.xml" tests/test_nccl_comm.py tests/test_pipeline.py || true
  local o=(--layouts 32/8 --seqs 8K,32K)
  [ "$TINY" = 1 ] && o=(--layouts 8/2 --seqs 64,256 --head-dim 16)
  step overlap_w2 180 env NCCL_MULTI_RANK_GPU_ENABLE=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m ulysses_kernels.bench.overlap "${o[@]}" --out-dir "$LOG/w2" || true
}

stage_user() {  # what a user types, in this machine's system-torch venv: the torchrun demo, the
  # documented example commands, the build's messages and a CUDA wheel (tests/test_user_commands.py;
  # ~11 min on 2 idle CPU cores, the new-venv pip test skips: no package index offline).
  step user_commands 420 "$PY" -m pytest -q -ra --junitxml "$LOG/junit_user_commands.xml" tests/test_user_commands.py || true
}

stage_attn() {  # one process per model, so that a timeout loses one model, not the sweep.
  # llama3-8b at 1M: ~28 s per fwd+bwd+fwdbwd iteration at 350/260 TFLOP/s (perf_model), so
  # 4 iterations ~2 min, ~3 min for 4K..1M; qwen2.5-14b x1.25, llama3-70b x2 (one per call).
  local m a
  for m in ${GPU_SESSION_ATTN_MODELS:-llama3-8b}; do
    a=(--models "$m" --min-seq 4K --max-seq "${GPU_SESSION_ATTN_MAX_SEQ:-1M}")
    [ "$TINY" = 1 ] && a=(--heads-sets 8/2 --seqs 64,128,256 --head-dim 16)
    step "attention_$m" 420 "$PY" -m ulysses_kernels.bench.attention --sp 8 "${a[@]}" -w 1 -n 3 --out-dir "$RESULTS" &&
      step "perf_model_$m" 60 "$PY" -m ulysses_kernels.bench.perf_model --attention-json "$RESULTS/bench_attention_latest.json" || true
  done
}

# ---- the wave: every GPU-bound check of this round of work, in one call ------------------------
wave_extra() {  # the steps of this wave's merged work, run while the budget lasts
  # bench.longctx as rank 0 of an 8-way Llama-3-8B job and a 16-way Qwen2.5-14B one (#39): the
  # GPU machine's transformers (5.17) lacks activation_checkpointing_enable, so transformers
  # 5.23.0 travels as a wheel in build/wheels (the device tool's carry) and goes first on the path.
  local tf=() lc
  if [ "$DRY" != 1 ] && compgen -G "build/wheels/transformers-*.whl" >/dev/null; then
    "$BASE_PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/ulysses_tf build/wheels/transformers-*.whl &&
      tf=(env "PYTHONPATH=/tmp/ulysses_tf${PYTHONPATH:+:$PYTHONPATH}")
  fi
  lc=(--emulate-rank0-of 8 --model llama3-8b,qwen2.5-14b@16 --layers 2,4 --seqs 256K,1M,2M,4M --max-seq --gpu-gb 80
      --max-probes 3 --ablation --time-budget "${GPU_SESSION_LONGCTX_BUDGET:-100}" -d bf16)
  [ "$TINY" = 1 ] && lc=(--emulate-rank0-of 4 --model tiny --time-budget 60)
  step bench_longctx 150 "${tf[@]}" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    "$PY" -m ulysses_kernels.bench.longctx "${lc[@]}" --out-dir "$WAVE_DIR" || true
}

gpu_slug() {  # "h100", "h200", ... from the GPU's name; "cpu" without one
  "$PY" -c '
import re, torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "tesla")]
print(words[0] if words else "gpu")' 2>/dev/null || echo gpu
}

open_record() {  # open_record LABEL SUFFIX: WAVE_DIR (= RESULTS) is <date>_<gpu>SUFFIX under bench/results
  # (TINY: under the run's own results folder), where the stage's records are committed from
  local slug base=bench/results
  if [ "$DRY" = 1 ]; then slug=gpu; else slug=$(gpu_slug); fi
  [ "$TINY" = 1 ] && base=$RESULTS
  WAVE_DIR=$base/$(date -u +%F)_$slug$2
  RESULTS=$WAVE_DIR
  [ "$DRY" = 1 ] || mkdir -p "$WAVE_DIR"
  say "$1: records into $WAVE_DIR"
}

record_info() {  # the record's copy of `info --json` (a failure is reported and counted, the stage goes on)
  if [ "$DRY" != 1 ] && ! timeout -k 5 60 "$PY" -m ulysses_kernels.info --json > "$WAVE_DIR/info.json" 2> "$LOG/info_json.err"; then
    say "FAILED   info --json (see $LOG/info_json.err)"; FAILED=1
  fi
}

stage_wave() {
  local tests compile a quick=()
  open_record wave ""
  step info 60 "$PY" -m ulysses_kernels.info || true
  record_info
  # The self-test: every path on this GPU against float64 (--timeout 45: its hang timer, 2 * 45
  # + 60 s, ends a stuck run inside the step). 210 paths took 15 s on the H200.
  [ "$TINY" = 1 ] && quick=(--quick --kernels torch,cuda)
  step selftest 170 "$PY" -m ulysses_kernels.selftest --timeout 45 "${quick[@]}" --json "$WAVE_DIR/selftest_w1.json" || true
  pytest_args
  # All GPU test files in one pytest under xdist: a crash costs one test. Serially they took
  # 15-39 s each on the H200 (test_large_index's far views ~30 GiB at peak: fine beside 3 others).
  tests=${GPU_SESSION_TESTS:-tests/test_cuda_kernels.py tests/test_cuda_kernels_gpu.py tests/test_large_index.py tests/test_triton_kernels.py tests/test_nccl_comm.py tests/test_pipeline.py tests/test_stream_safety.py tests/test_varlen_backends.py tests/test_packed_ring.py}
  compile=tests/test_compile.py
  if [ "$TINY" = 1 ]; then tests="tests/test_kernel_registry.py tests/test_watchdog.py"; compile=tests/test_imports.py; fi
  # shellcheck disable=SC2086  # $tests is a list of paths
  step gpu_tests 240 "$PY" -m pytest -q -ra -k "not two_ranks" "${PYTEST_ARGS[@]}" --junitxml "$WAVE_DIR/junit_gpu_tests.xml" $tests || true
  step bench_pack_auto 120 "$PY" -m ulysses_kernels.bench.pack --kernels auto --warmup 10 --iters 50 --out-dir "$WAVE_DIR" && pack_summary || true
  # Every set, and the kernel variants of triton (old, new) (#36; cuda has one since 2026-11-30) in one process:
  # the "# variants" lines say which is faster (extension.DEFAULT_PACK_VARIANT follows them).
  step bench_pack_sets 150 "$PY" -m ulysses_kernels.bench.pack --kernels cuda,triton,torch --variants old,new --warmup 10 --iters 40 --out-dir "$WAVE_DIR" && pack_summary || true
  a=(--models llama3-8b --min-seq 4K --max-seq 256K)
  [ "$TINY" = 1 ] && a=(--heads-sets 8/2 --seqs 64,128 --head-dim 16)
  step bench_attention 180 "$PY" -m ulysses_kernels.bench.attention --sp 8 "${a[@]}" -w 2 -n 5 --out-dir "$WAVE_DIR" &&
    step perf_model 60 "$PY" -m ulysses_kernels.bench.perf_model --attention-json "$WAVE_DIR/bench_attention_latest.json" || true
  wave_extra
  # test_compile: 15 tests, 53 s serially on the H200; last, since the benchmarks above are this
  # wave's new measurements and the compile tests passed on the first run.
  step compile_tests 150 "$PY" -m pytest -q -ra "${PYTEST_ARGS[@]}" --junitxml "$WAVE_DIR/junit_compile.xml" "$compile" || true
  wave_record
}

stage_recheck() {  # a short second call after a wave: what the wave found wrong or slow, re-measured
  # with its fixes, into bench/results/<date>_<gpu>_recheck/ (GPU_SESSION_RECORD_TAG): the self-test,
  # the GPU test files named in GPU_SESSION_TESTS (default: the ones the wave's fixes touched), the
  # pack variants side by side (GPU_SESSION_PACK_VARIANTS), bench.attention's rows named in
  # GPU_SESSION_ATTN_METHODS with more iterations, and GPU_SESSION_EXTRA (one more command, e.g. a
  # check of merged work). ~4-5 min on the H200 with a build.
  local tests a m
  open_record recheck "_${GPU_SESSION_RECORD_TAG:-recheck}"
  record_info
  local quick=()
  [ "$TINY" = 1 ] && quick=(--quick --kernels torch,cuda)
  step selftest 120 "$PY" -m ulysses_kernels.selftest --timeout 45 "${quick[@]}" --json "$WAVE_DIR/selftest_w1.json" || true
  pytest_args
  tests=${GPU_SESSION_TESTS:-tests/test_cuda_kernels.py tests/test_cuda_kernels_gpu.py tests/test_packed_ring.py tests/test_varlen_backends.py tests/test_comm.py}
  [ "$TINY" = 1 ] && tests="tests/test_kernel_registry.py"
  # shellcheck disable=SC2086  # $tests is a list of paths
  step gpu_tests 150 "$PY" -m pytest -q -ra -k "not two_ranks" "${PYTEST_ARGS[@]}" --junitxml "$WAVE_DIR/junit_gpu_tests.xml" $tests || true
  step bench_pack_auto 60 "$PY" -m ulysses_kernels.bench.pack --kernels auto --warmup 10 --iters 100 --out-dir "$WAVE_DIR" && pack_summary || true
  step bench_pack_sets 90 "$PY" -m ulysses_kernels.bench.pack --kernels cuda,triton --variants "${GPU_SESSION_PACK_VARIANTS:-old,new}" \
    --warmup 10 --iters 100 --out-dir "$WAVE_DIR" && pack_summary || true
  a=(--models llama3-8b --min-seq 4K --max-seq 256K)
  [ "$TINY" = 1 ] && a=(--heads-sets 8/2 --seqs 64,128 --head-dim 16)
  m=${GPU_SESSION_ATTN_METHODS:-local,local+graph,local-packed,local-packed+graph,local-packed-fa2,layout-cuda,chain-layout,layout-cuda+graph}
  step bench_attention 150 "$PY" -m ulysses_kernels.bench.attention --sp 8 "${a[@]}" --methods "$m" -w 3 -n 15 --out-dir "$WAVE_DIR" || true
  # #37: the cudnn packed kernel in a process of its own (a kernel fault must not cost the rows
  # above), beside the dense rows it is a fraction of.
  step bench_attention_cudnn 90 "$PY" -m ulysses_kernels.bench.attention --sp 8 "${a[@]}" --methods local,local+graph,local-packed-cudnn,local-packed-cudnn+graph -w 2 -n 8 --out-dir "$WAVE_DIR" || true
  # #38: one bf16 step of two hybrids, hf.apply on 2 gloo ranks sharing the GPU against one process
  # (flash-linear-attention from build/wheels; scripts/gpu_hybrid_step.sh)
  [ "$TINY" = 1 ] || step hybrid_step 200 env PYTHON="$PY" bash scripts/gpu_hybrid_step.sh "$WAVE_DIR" || true
  if [ -n "${GPU_SESSION_EXTRA:-}" ]; then step extra 90 bash -c "$GPU_SESSION_EXTRA" || true; fi
  wave_record
}

stage_world() {  # issue 49: several NCCL ranks on the one GPU (the carried NCCL >= 2.30), then the rows still undecided.
  # Budgets measured on 2026-11-30 (bench/results/2026-11-30_h200_world, H200): setup 39-42 s, info 6 s, the self-test at
  # 8 ranks 232 of its 330 paths in 95 s after ~10 s of start-up (so ~150 s for all), at 2 ranks --quick 93 paths in ~25 s
  # plus the exit, at 4 ranks --quick 82 paths in 22 s; bench.overlap at 8 ranks 3 of 4 rows in 19 s; bench.pack 8 s.
  # Recorded that day and not repeated: bench.attention's packed and layout rows, the hybrid bf16 steps over 2 NCCL ranks
  # (both strategies; fla's kernels refuse this machine's Triton 3.6 on Hopper). Ranks on one GPU share its HBM and SMs:
  # the world rows check the multi-rank code paths over real NCCL and time how much of the exchange stays exposed; no
  # row is a bandwidth claim (world_note.txt in the record says so beside the numbers).
  local run=("$PY" -m torch.distributed.run --standalone) w8 o x
  open_record world "_${GPU_SESSION_RECORD_TAG:-world}"
  step info 20 "$PY" -m ulysses_kernels.info --json-to "$WAVE_DIR/info.json" || true
  [ "$DRY" = 1 ] || world_note > "$WAVE_DIR/world_note.txt"
  w8=8 o=(--heads-sets 32/8 --seqs 8K,32K --chunks 1,2,auto -w 2 -n 5) x=(-b 1M -e 64M -f 4 -w 3 -n 10)
  [ "$TINY" = 1 ] && w8=3 o=(--heads-sets 8/2 --seqs 64,256 --head-dim 16 --chunks 1,2) x=(-b 1K -e 16K -f 4 -w 1 -n 2)
  if multi_rank_ok selftest_w8; then
    step selftest_w8 160 "${run[@]}" --nproc-per-node "$w8" -m ulysses_kernels.selftest --timeout 30 --json "$WAVE_DIR/selftest_w8.json" || true
  fi
  # #50: the quantizing pack (bf16 in, e4m3 + scales out) against a device copy; each row checked bit for bit first
  # shellcheck disable=SC2016  # $0/$1 are bash -c's own arguments
  step bench_pack_fp8 15 bash -c 'set -o pipefail; "$0" -m ulysses_kernels.bench.pack_fp8 | tee "$1"' "$PY" "$WAVE_DIR/pack_fp8.txt" || true
  # #37: where a packed call's time goes (host, host waits, kernels) at 4K and 32K (2026-11-30: 1.57 ms vs 0.38 as a graph)
  # shellcheck disable=SC2016
  local pp=()
  [ "$TINY" = 1 ] && pp=(--seqs 256 --head-dim 16 -n 2)
  step packed_probe 20 bash -c 'set -o pipefail; "$0" -m ulysses_kernels.bench.packed_probe "${@:2}" | tee "$1"' "$PY" "$WAVE_DIR/packed_probe.txt" "${pp[@]}" || true
  if multi_rank_ok two_ranks; then  # -v -s: each test's name and its ranks' lines as they come (2026-11-30: nothing in 60 s)
    step two_ranks 85 "$PY" -m pytest -v -s -ra -k two_ranks --junitxml "$WAVE_DIR/junit_two_ranks.xml" tests/test_nccl_comm.py tests/test_pipeline.py || true
  fi
  if multi_rank_ok alltoall_w8; then
    step alltoall_w8 25 "${run[@]}" --nproc-per-node "$w8" -m ulysses_kernels.bench.alltoall "${x[@]}" --out-dir "$WAVE_DIR/one_gpu_w$w8" || true
  fi
  if multi_rank_ok overlap_w8; then
    step overlap_w8 40 "${run[@]}" --nproc-per-node "$w8" -m ulysses_kernels.bench.overlap "${o[@]}" --out-dir "$WAVE_DIR/one_gpu_w$w8" || true
  fi
  if multi_rank_ok selftest_w4; then
    step selftest_w4 40 "${run[@]}" --nproc-per-node 4 -m ulysses_kernels.selftest --quick --timeout 30 --json "$WAVE_DIR/selftest_w4.json" || true
  fi
  step bench_pack 15 "$PY" -m ulysses_kernels.bench.pack --kernels cuda,triton --warmup 10 --iters 50 --out-dir "$WAVE_DIR" && pack_summary || true
  # #37: the cudnn packed kernel, last (2026-11-30: cut at 256K by a 30 s budget); with what the deadline leaves
  if [ "$TINY" != 1 ]; then
    step bench_attention_cudnn "$(at_least 30)" "$PY" -m ulysses_kernels.bench.attention --sp 8 --models llama3-8b --min-seq 4K \
      --max-seq 256K -w 2 -n 8 --out-dir "$WAVE_DIR" --methods local,local-packed-cudnn,local-packed-cudnn+graph || true
  fi
  wave_record
}

world_note() {  # what N ranks on one GPU can and cannot show, written beside the world rows
  cat <<EOF
N ranks on one GPU (NCCL $NCCL_RUNS, NCCL_MULTI_RANK_GPU_ENABLE=1): every rank is a process on cuda:0, so
the ranks share the GPU's HBM bandwidth and SMs, and an all-to-all between them is a copy within one HBM.
What this shows: the multi-rank code paths (the native NCCL communicator, borrowed and torch.distributed
exchanges, the chunked pipeline, hf.apply) run and agree with float64 / one process over real NCCL at
world N; the exposed-communication fraction of the layer (bench.overlap's exposed/a2a) with the exchange
and attention contending for the same SMs. What it cannot show: link bandwidth (NVLink, network), the
busbw of a real N-GPU all-to-all, or the overlap that N separate GPUs give; those rows are not claims.
EOF
}

at_least() {  # at_least N: N, or more when the call has more left before its deadline (a dry run: N)
  local left=$((DEADLINE - $(date +%s) - 20))
  if [ "$DRY" = 1 ] || [ "$left" -lt "$1" ]; then echo "$1"; else echo "$left"; fi
}

plan_table() {  # every step this call ran (dry: would run) with its budget (its timeout), and their sum against the deadline
  local line sum=0
  say "plan: step budgets in order (seconds), one deadline of ${GPU_SESSION_BUDGET_S:-540} s"
  for line in "${PLAN[@]}"; do sum=$((sum + ${line#* })); say "  $(printf '%-24s %4s  %4s' "${line% *}" "${line#* }" "$sum")"; done
  say "plan: ${#PLAN[@]} steps, budgets sum ${sum} s of the ${GPU_SESSION_BUDGET_S:-540} s deadline"
}

wave_record() {  # the step logs (the tables a person reads) and the summary beside the JSON
  [ -n "${WAVE_DIR:-}" ] && [ "$DRY" != 1 ] || return 0
  mkdir -p "$WAVE_DIR/logs"
  cp "$LOG"/*.log "$WAVE_DIR/logs/" 2>/dev/null || true
  cp "$SUMMARY" "$WAVE_DIR/summary.txt"
  # Local copies of the last run (bench/results/*_latest.json) are not records: their dated twins are.
  rm -f "$WAVE_DIR"/*_latest.json
}

SETUP_S=${GPU_SESSION_SETUP_S:-480}
case " $* " in *" world "*) SETUP_S=${GPU_SESSION_SETUP_S:-45} ;; esac
trap 'echo; echo "======== gpu_session $TAG summary ($(( $(date +%s) - T0 ))s; logs in $LOG${OUT:+, copied to \$OUT})"; cat "$SUMMARY"' EXIT
setup
for s in "$@"; do "stage_$s"; done
plan_table
publish
[ "$FAILED" = 0 ] || { say "FAILED: see the lines above"; wave_record; publish; exit 1; }
say "all steps OK"; wave_record; publish
