import importlib.util
import os
import random
import re
from pathlib import Path

import pytest

# Triton kernels run under the interpreter on machines without a GPU; this must be set
# before any module with @triton.jit is imported.
try:
    import torch

    _has_gpu = torch.cuda.is_available()
except Exception:  # noqa: BLE001 - torch missing is reported by the tests themselves
    torch, _has_gpu = None, False
if not _has_gpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"  # for the ranks and subprocesses the tests spawn
    # torch, imported above, has read the variable already (its OpenMP runtime at load):
    # set this process's intra-op threads too. The bit-for-bit CPU tests assume one thread
    # (see test_stream_safety._cpu_attention_rank), as scripts/test.sh gives them; the GPU
    # runbook (scripts/gpu_session.sh) runs pytest on a 16-core machine without the variable.
    if torch is not None:
        torch.set_num_threads(1)

from ulysses_kernels.testing import RankPool, set_default_pool  # noqa: E402 - after TRITON_INTERPRET is set

# ---- the integrations that did not run ------------------------------------------------------
# scripts/setup.sh installs these unless ULYSSES_KERNELS_PEERS=0; without network it goes on
# without them and notes why in this file. A green run whose integration tests all skipped
# must say so at its end, not only in the long list of -ra.
INTEGRATIONS = ("deepspeed", "accelerate", "verl", "torchtitan", "transformers")
SKIPPED_NOTE = Path(__file__).resolve().parents[1] / "build" / "setup_skipped_integrations.txt"


def skipped_integrations(skip_reasons, note: Path = SKIPPED_NOTE) -> list[str]:
    """One line per integration whose tests skipped because it is not installed: how many
    tests, and why it is not (the set-up's note, when it left it out). ``skip_reasons``:
    the reason of every skipped test ("<name> is not installed (...)" for these)."""
    why = {}
    if note.is_file():
        for line in note.read_text().splitlines():
            name, _, reason = line.partition("\t")
            why[name] = reason
    counts = {}
    for reason in skip_reasons:
        m = re.match(r"(?:Skipped: )?([\w.-]+) is not installed", reason)
        if m and m.group(1) in INTEGRATIONS:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return [f"{name}: {n} test{'s' if n > 1 else ''} skipped, not installed: {why.get(name, 'not in this environment')}" for name, n in counts.items()]


def pytest_terminal_summary(terminalreporter):
    reasons = []
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reasons.append(longrepr[2] if isinstance(longrepr, tuple) else str(longrepr))
    lines = skipped_integrations(reasons)
    if lines:
        terminalreporter.write_sep("=", "integrations not tested (bash scripts/setup.sh installs them; ULYSSES_KERNELS_PEERS=0 leaves them out)", yellow=True)
        for line in lines:
            terminalreporter.write_line(line)


# ---- one pool of live gloo worlds for the whole run ------------------------------------------
# run_ranks reuses worlds instead of spawning (and importing torch) per test: most of the suite's
# time was process start-up. ULYSSES_KERNELS_RANK_POOL=0 spawns per call as before.
_POOL = None


def pytest_configure(config):
    global _POOL
    # The peers the tests import inside their ranks (DeepSpeed 1.1 s, verl 3.3 s of CPU per rank
    # after torch and transformers): imported once by the ranks' fork server (testing.rank_context).
    # (Not an environment variable: the suite's command lines would inherit it.)
    peers = [m for m in ("deepspeed", "accelerate", "verl", "torchtitan") if importlib.util.find_spec(m) is not None]
    if os.environ.get("ULYSSES_KERNELS_RANK_POOL", "1") != "0":
        _POOL = RankPool(preload=peers)
        set_default_pool(_POOL)


def pytest_unconfigure(config):
    if _POOL is not None:
        set_default_pool(None)
        _POOL.close()


# ---- a seeded shuffle: the suite must pass in any order ---------------------------------------
# ULYSSES_KERNELS_TEST_SHUFFLE=<seed> shuffles the test files, and the tests inside each file,
# with that seed (CI runs one such order; the header line names the seed to replay it).
def _shuffle_seed() -> str | None:
    seed = os.environ.get("ULYSSES_KERNELS_TEST_SHUFFLE", "")
    return None if seed in ("", "0") else seed  # 0: file order (.ci/run shuffles by default)


def pytest_report_header(config):
    seed = _shuffle_seed()
    return [f"test order: shuffled with seed {seed} (ULYSSES_KERNELS_TEST_SHUFFLE={seed} replays it)"] if seed else []


def pytest_collection_modifyitems(config, items):
    seed = _shuffle_seed()
    if seed is None:
        return
    rng = random.Random(seed)
    by_file = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    files = list(by_file)
    rng.shuffle(files)
    items[:] = []
    for name in files:
        tests = by_file[name]
        rng.shuffle(tests)
        items.extend(tests)


# ---- state a test must not leave behind ----------------------------------------------------------
# torch.compiler.is_compiling() reads one process-wide flag; a test that leaves it set makes every
# later eager call in this process (thread ranks included) take the traced path.
@pytest.fixture(autouse=True)
def _no_leaked_compile_flag():
    yield
    if torch is not None and getattr(torch.compiler, "_is_compiling_flag", False):
        torch.compiler._is_compiling_flag = False
        pytest.fail("this test left torch.compiler.is_compiling() True for the rest of the process")
