#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a venv in .venv with torch, the test tools and
# ulysses_kernels itself (editable), then one build of its C++/CUDA extension. A re-run with
# nothing changed imports nothing heavy and builds nothing (about a second): packages are
# probed through their installed metadata, the extension through a stamp of its inputs.
# ULYSSES_KERNELS_SYSTEM_TORCH=1: make the venv see the interpreter's own packages and use
# its torch (an offline GPU machine with torch preinstalled); nothing is downloaded then,
# and tests of what is missing (e.g. transformers) skip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${ULYSSES_KERNELS_TORCH:-torch==2.14.1}
SYSTEM_TORCH=${ULYSSES_KERNELS_SYSTEM_TORCH:-0}
if [ ! -x .venv/bin/python ]; then
  if [ "$SYSTEM_TORCH" = "1" ]; then
    # --without-pip: a venv's own bundled pip and setuptools (65.5 under Python 3.11) would
    # shadow $PY's, which the build needs (setuptools >= 77).
    "$PY" -m venv --system-site-packages --without-pip .venv
    # $PY may itself be a venv (the GPU machines' python3 is /opt/torch/.venv): a venv made
    # from a venv does not see its packages through --system-site-packages, so a .pth adds
    # $PY's own site-packages (pip included).
    .venv/bin/python - "$("$PY" -c 'import json, site; print(json.dumps(site.getsitepackages()))')" <<'EOF_PTH'
import json, pathlib, sys, sysconfig
dirs = json.loads(sys.argv[1])
line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n"
pathlib.Path(sysconfig.get_paths()["purelib"], "_ulysses_kernels_system.pth").write_text(line)
EOF_PTH
  else
    "$PY" -m venv .venv
  fi
fi
if [ "$SYSTEM_TORCH" = "1" ] && [ ! -e .venv/bin/torchrun ]; then
  # A venv that borrows torch has none of its console scripts: torchrun as pip would write
  # it, on this venv's python (the base one's would not see ulysses_kernels), so that the
  # documented `torchrun ... -m ulysses_kernels.selftest` runs here too.
  printf '#!%s\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n' "$PWD/.venv/bin/python" > .venv/bin/torchrun
  chmod +x .venv/bin/torchrun
fi
# DeepSpeed JIT-compiles its shared-memory op (deepspeed_shm_comm) at its first init on a CPU
# into torch's extension cache: by default one directory per user
# (~/.cache/torch_extensions/py311_cu130/deepspeed_shm_comm) whose build.ninja names the
# DeepSpeed sources of the venv that built it last, so two checkouts on one machine (a fresh
# clone beside another) rebuilt it in turn, a test rank paying the minutes (NOTE: 8 min at load
# 20 here). This venv keeps its own: a .pth sets TORCH_EXTENSIONS_DIR for its python, unless
# the environment sets it.
.venv/bin/python - "$PWD/.venv/torch_extensions" <<'EOF_EXT'
import pathlib, sys, sysconfig
line = f"import os; os.environ.setdefault('TORCH_EXTENSIONS_DIR', {sys.argv[1]!r})\n"
pathlib.Path(sysconfig.get_paths()["purelib"], "_ulysses_kernels_torch_extensions.pth").write_text(line)
EOF_EXT
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
# Every install takes the versions CI passed with, transitive requirements included.
PINNED=(-c scripts/constraints.txt)
# -I: neither the working directory nor PYTHONPATH is on sys.path, so the source tree in the
# repository root cannot pass for an installed package.
VPY=(.venv/bin/python -I)
# Everything the set-up installs is pinned to the versions the suite passed with (a fresh
# machine must get what CI got): the base, then the integrations the suite tests (the peers;
# ULYSSES_KERNELS_PEERS=0 leaves them out, and their tests skip, saying so).
# matplotlib: the benchmarks' PNGs (about 20 s here; without it they skip the plot).
# pytest-xdist (and its execnet): scripts/test.sh runs the suite on two pytest workers.
BASE_PKGS=("$TORCH_SPEC" numpy==2.4.6 pytest==9.2.0 pytest-xdist==3.8.0 execnet==2.1.2 ninja==1.13.2 transformers==5.23.0 matplotlib==3.11.2)
# DeepSpeed: the engine tests, the ALST comparison, examples/deepspeed_zero3 and
# bench_attention's deepspeed row. An sdist, not a pure-Python wheel (27 s to build here with
# DS_BUILD_OPS=0; its first call JIT-compiles a C++ shared-memory op). yunchang is not
# installed: its UlyssesAttention needs flash-attn. accelerate: the path of transformers'
# Trainer with ParallelismConfig(sp_backend="deepspeed") into DeepSpeed's ALST entry point
# (tests/test_trainer.py; pip's resolver puts accelerate 1.15.0 with torch 2.14.1,
# transformers 5.23.0 and deepspeed 0.19.8).
PEER_PKGS=(deepspeed==0.19.8 accelerate==1.15.0)
# verl 0.9.1 (tests/test_verl*.py): --no-deps, it declares transformers<5.11 (it works with
# 5.23.0: its tests pass); its other requirements as tested, 51 s/0.75 GB uncached.
VERL_PKGS=(verl==0.9.1 accelerate==1.15.0 codetiming==1.4.0 datasets==5.2.0 dill==0.4.1 hydra-core==1.3.8 pandas==3.1.1 peft==0.21.2
  pyarrow==26.0.1 pybind11==3.1.0 pylatexenc==2.11 "ray[default]==2.60.0" torchdata==0.11.0 tensordict==0.10.0 wandb==0.31.0 tensorboard==2.21.0)
# torchtitan 0.3.0 (tests/test_torchtitan.py, integrations/torchtitan.py): --no-deps, every
# package of it that its import needs is pinned here (its declared datasets, tensorboard,
# wandb, torchdata come with verl's set; tokenizers and safetensors with transformers).
TITAN_PKGS=(torchtitan==0.3.0 torch_checkpointing==0.1.1 tyro==1.0.17 spmd_types==0.2.3 docstring_parser==0.18.0 typeguard==4.6.1)
PEERS=${ULYSSES_KERNELS_PEERS:-1}
# The integrations the set-up did not install, and why: tests/conftest.py puts them in pytest's summary.
SKIPPED_NOTE=build/setup_skipped_integrations.txt
mkdir -p build
rm -f "$SKIPPED_NOTE"
has_dists() {  # installed distributions ("name" or "name==version"), by their metadata (importing torch takes seconds)
  "${VPY[@]}" -c 'import importlib.metadata as m, sys
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    have = m.version(name)
    if want and have != want and not have.startswith(want + "+"):
        sys.exit(f"{name} {have} installed, {want} pinned")' "$@" 2>/dev/null
}
# Free space before a download: pip fills a disk without saying so until it fails midway (a CI
# run stopped at "[Errno 28] No space left on device" halfway through verl's requirements).
need_space() {  # need_space <GB> <what is installed>
  local free_kb
  free_kb=$(df -Pk .venv | awk 'NR==2 {print $4}')
  if [ "$free_kb" -lt $(( $1 * 1024 * 1024 )) ]; then
    echo "[setup] $PWD/.venv has $(( free_kb / 1024 / 1024 )) GB free; installing $2 needs about $1 GB. Free some space (or ULYSSES_KERNELS_PEERS=0 leaves the integrations out)" >&2
    exit 1
  fi
}
# An integration's pip install. It fails without a reachable package index (no network, or an
# index without the pinned version): then the set-up says so, notes it for pytest's summary
# and goes on without it (its tests skip). Any other failure stops the set-up.
install_integration() {  # install_integration "<integrations, e.g. deepspeed accelerate>" <pip arguments>...
  local names=$1
  local log="build/setup_pip_${names// /_}.log"
  shift
  # Not -q: the log keeps what pip looked for (the check below reads it); the terminal gets its warnings.
  if "${PIP[@]}" install --no-warn-conflicts "${PINNED[@]}" "$@" >"$log" 2>&1; then
    grep "^WARNING" "$log" | grep -v "^WARNING: Location" || true
    return 0
  fi
  # Unreachable: a connection error, or no candidate at all (without constraints pip says
  # "from versions: none"; with them, a "conflict" of the request with its own constraint
  # alone, where a real conflict names a package that "depends on" another).
  if grep -qE "NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|Network is unreachable|ProxyError|ConnectTimeout|Read timed out|from versions: none|No matching distribution" "$log" ||
     { grep -q "The user requested (constraint)" "$log" && ! grep -q " depends on " "$log"; }; then
    local why="scripts/setup.sh could not download it (no network, or the package index lacks the pinned version; pip's output: $log)"
    echo "[setup] skipping ${names// /, }: pip could not download the pinned versions (no network?); the set-up goes on without them and their tests skip (pip's output: $log). Run bash scripts/setup.sh again with network to add them."
    for name in $names; do printf '%s\t%s\n' "$name" "$why" >> "$SKIPPED_NOTE"; done
    return 1
  fi
  tail -20 "$log" >&2
  if grep -q "No space left on device" "$log"; then
    echo "[setup] installing ${names// /, } failed: the disk of $PWD/.venv is full ($(df -Ph .venv | awk 'NR==2 {print $4}') free now; pip's output: $log)" >&2
    exit 1
  fi
  echo "[setup] installing ${names// /, } failed (full pip output: $log); ULYSSES_KERNELS_PEERS=0 leaves the integrations out" >&2
  exit 1
}
if [ "$SYSTEM_TORCH" = "1" ]; then
  has_dists torch pytest || { echo "[setup] ULYSSES_KERNELS_SYSTEM_TORCH=1 needs torch and pytest in $PY" >&2; exit 1; }
elif ! has_dists "${BASE_PKGS[@]}"; then
  # torch with its CUDA libraries is 5.3 GB installed, triton 0.9 GB; pip unpacks beside them.
  need_space 8 "${BASE_PKGS[*]}"
  echo "[setup] installing ${BASE_PKGS[*]} into .venv"
  if ! "${PIP[@]}" install -q "${PINNED[@]}" "${BASE_PKGS[@]}" 2>&1 | { grep -v "^WARNING: Location" || true; }; then
    echo "[setup] installing the base packages failed (pip's output above); nothing runs without them. Without network," \
      "a python that has torch and pytest can lend them: ULYSSES_KERNELS_SYSTEM_TORCH=1 PYTHON=<that python> bash scripts/setup.sh" >&2
    exit 1
  fi
fi
if [ "$SYSTEM_TORCH" = "1" ] || [ "$PEERS" = "0" ]; then
  why=$([ "$SYSTEM_TORCH" = "1" ] && echo "ULYSSES_KERNELS_SYSTEM_TORCH=1: the set-up downloads nothing" || echo "ULYSSES_KERNELS_PEERS=0: the set-up left the integrations out")
  for name in deepspeed accelerate verl torchtitan; do
    has_dists "$name" || printf '%s\t%s\n' "$name" "$why" >> "$SKIPPED_NOTE"
  done
  [ ! -s "$SKIPPED_NOTE" ] || echo "[setup] not installing $(cut -f1 "$SKIPPED_NOTE" | paste -sd, - | sed 's/,/, /g') ($why); their tests skip"
else
  torch_pin="torch==$("${VPY[@]}" -c 'import importlib.metadata as m; print(m.version("torch"))')"
  # DeepSpeed, verl's requirements (ray 0.24 GB, pyarrow, pandas, wandb) and torchtitan: 1.1 GB installed.
  has_dists "${PEER_PKGS[@]}" "${VERL_PKGS[@]/\[default\]/}" "${TITAN_PKGS[@]}" || need_space 3 "the integrations (deepspeed, accelerate, verl, torchtitan)"
  if ! has_dists "${PEER_PKGS[@]}"; then
    echo "[setup] installing ${PEER_PKGS[*]} (DS_BUILD_OPS=0, keeping $torch_pin); ULYSSES_KERNELS_PEERS=0 skips the integrations"
    DS_BUILD_OPS=0 install_integration "deepspeed accelerate" "${PEER_PKGS[@]}" "$torch_pin" &&
      { has_dists "${PEER_PKGS[@]}" || { echo "[setup] the peers are not at their pinned versions after installing them" >&2; exit 1; }; }
  fi
  if ! has_dists "${VERL_PKGS[@]/\[default\]/}"; then
    echo "[setup] installing verl==0.9.1 and its requirements (keeping $torch_pin, transformers==5.23.0)"
    # pip would report verl's declared transformers<5.11 as a conflict: it is known and tested.
    echo "[setup] note: verl 0.9.1 declares transformers<5.11; it runs with transformers 5.23.0 (tests/test_verl*.py pass), so pip's conflict check is off here"
    install_integration verl --no-deps "${VERL_PKGS[0]}" &&
      install_integration verl "${VERL_PKGS[@]:1}" "$torch_pin" transformers==5.23.0 &&
      { has_dists "${VERL_PKGS[@]/\[default\]/}" || { echo "[setup] verl or its requirements are not at their pinned versions after installing them" >&2; exit 1; }; }
  fi
  if ! has_dists "${TITAN_PKGS[@]}"; then
    echo "[setup] installing ${TITAN_PKGS[*]} (--no-deps: torch and the rest stay as pinned)"
    install_integration torchtitan --no-deps "${TITAN_PKGS[@]}" &&
      { has_dists "${TITAN_PKGS[@]}" || { echo "[setup] torchtitan or its requirements are not at their pinned versions after installing them" >&2; exit 1; }; }
  fi
fi
# pyproject.toml's SPDX license string needs setuptools >= 77 (torch >= 2.14 requires it anyway;
# an older system torch may come with an older one).
"${VPY[@]}" -c 'import importlib.metadata as m, sys; sys.exit(int(m.version("setuptools").split(".")[0]) < 77)' 2>/dev/null || {
  echo "[setup] setuptools >= 77 is needed to build ulysses_kernels (found: $("${VPY[@]}" -c 'import importlib.metadata as m; print(m.version("setuptools"))' 2>/dev/null || echo none)): pip install 'setuptools>=77'" >&2
  exit 1
}
# Is `import ulysses_kernels` this checkout, wherever it runs from? (find_spec does not
# execute the package.)
installed_here() {
  "${VPY[@]}" -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("ulysses_kernels")
sys.exit(0 if spec and spec.origin and os.path.realpath(spec.origin) == os.path.realpath(sys.argv[1]) else 1)' "$PWD/ulysses_kernels/__init__.py" 2>/dev/null
}
if [ "$SYSTEM_TORCH" = "1" ]; then
  # Offline: no pip build. The package directory linked into the venv's site-packages is
  # what an editable install amounts to: `import ulysses_kernels` finds this checkout from
  # anywhere, and the checkout's root (tests/, examples/) stays off sys.path, as it is for
  # a pip-installed package (tests/test_user_commands.py checks both).
  # (An older set-up put the whole root on sys.path with a .pth: it goes.)
  rm -f .venv/lib/python*/site-packages/_ulysses_kernels_repo.pth
  installed_here || "${VPY[@]}" - "$PWD/ulysses_kernels" <<'EOF_LINK'
import pathlib, sys, sysconfig
link = pathlib.Path(sysconfig.get_paths()["purelib"], "ulysses_kernels")
if link.is_symlink():
    link.unlink()
link.symlink_to(sys.argv[1], target_is_directory=True)
EOF_LINK
elif ! installed_here; then
  echo "[setup] installing ulysses_kernels (editable)"
  # The extension is built below, once and incrementally, not by pip (which rebuilds from scratch).
  ULYSSES_KERNELS_SKIP_EXTENSION=1 "${PIP[@]}" install -q --no-build-isolation -e . 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
installed_here || { echo "[setup] ulysses_kernels is not importable from outside $PWD after installing it" >&2; exit 1; }
# ---- the C++/CUDA extension ulysses_kernels._C (no GPU needed; see docs/build.md) ----------
if [ "${ULYSSES_KERNELS_SKIP_EXTENSION:-0}" != "1" ]; then
  if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
  export ULYSSES_KERNELS_CUDA_ARCHS="${ULYSSES_KERNELS_CUDA_ARCHS:-8.0;9.0}"
  export TORCH_CUDA_ARCH_LIST="$ULYSSES_KERNELS_CUDA_ARCHS" MAX_JOBS="${MAX_JOBS:-2}"
  log=build/setup_build_ext.log
  stamp_file=build/setup_ext.stamp
  mkdir -p build
  # Everything the build reads: sources, setup.py, the torch, python and NCCL it builds
  # against, the toolkit and the switches. Unchanged, and the _C it built still there: skip.
  stamp=$({ find csrc setup.py -type f | LC_ALL=C sort | xargs cat
            "${VPY[@]}" -c 'import importlib.metadata as m, sys
print(sys.version)
for d in ("torch", "nvidia-nccl-cu13", "nvidia-nccl-cu12"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        pass'
            env | grep -E "^(CUDA_HOME|CUDA_PATH|NCCL_HOME|TORCH_CUDA_ARCH_LIST|ULYSSES_KERNELS_SKIP_CUDA_BUILD)=" | LC_ALL=C sort
          } | sha256sum | cut -c1-32)
  if [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ] && compgen -G "ulysses_kernels/_C*.so" >/dev/null; then
    echo "[setup] ulysses_kernels._C is up to date (sources, torch and switches unchanged); python -m ulysses_kernels.info says what is active"
  else
    echo "[setup] building ulysses_kernels._C (incremental, MAX_JOBS=$MAX_JOBS, archs $ULYSSES_KERNELS_CUDA_ARCHS)"
    rm -f "$stamp_file"
    if ! .venv/bin/python setup.py build_ext --inplace >"$log" 2>&1; then
      tail -40 "$log"
      echo "[setup] building ulysses_kernels._C failed (full log: $log); ULYSSES_KERNELS_SKIP_EXTENSION=1 skips it" >&2
      exit 1
    fi
    grep "^\[ulysses_kernels build\]" "$log" | sed 's/^\[ulysses_kernels build\]/[setup]/' || true
    # From outside the checkout, as a user runs it.
    (py="$PWD/.venv/bin/python"; cd / && "$py" -I -m ulysses_kernels.info) | sed 's/^/[setup] /'
    echo "$stamp" > "$stamp_file"
  fi
fi
# DeepSpeed's shared-memory op, built here once (into the venv's TORCH_EXTENSIONS_DIR, above)
# rather than by the first test rank or example that starts a DeepSpeed engine: about a minute
# of both cores that, in the suite, another worker's ranks also waited for, on the build's lock.
# What DeepSpeed's own first init does (deepspeed.comm.torch.build_shm_op: nothing where its
# accelerator has no such op); a failure here is DeepSpeed's to report at that init, so the
# set-up says so and goes on.
if has_dists deepspeed && ! compgen -G "${TORCH_EXTENSIONS_DIR:-.venv/torch_extensions}/deepspeed_shm_comm/deepspeed_shm_comm*.so" >/dev/null; then
  echo "[setup] building DeepSpeed's shared-memory op (once, about a minute on 2 cores)"
  if ! .venv/bin/python -c 'from deepspeed.comm.torch import build_shm_op; build_shm_op()' >build/setup_deepspeed_shm.log 2>&1; then
    echo "[setup] note: DeepSpeed's shared-memory op did not build here (log: build/setup_deepspeed_shm.log); DeepSpeed will try again at its first init"
  fi
fi
"${VPY[@]}" -c 'import importlib.metadata as m, importlib.util as u
import os; print("[setup] torch", m.version("torch"), "| ulysses_kernels at", os.path.realpath(u.find_spec("ulysses_kernels").submodule_search_locations[0]))'
