"""Shared pieces of the benchmarks: environment record, sizes, timing, output.

Conventions (every module of ``ulysses_kernels.bench`` follows them):

* Launch: ``torchrun --nproc-per-node N -m ulysses_kernels.bench.<name> ...`` (NCCL on
  GPUs), or ``python -m ulysses_kernels.bench.<name> --spawn N ...`` which spawns ``N``
  gloo ranks on the CPU. ``bench/bench_<name>.py`` in a checkout runs the same ``main``.
* Timing: on CUDA, events around each iteration after a barrier, median over iterations,
  then the maximum of the per-rank medians (the slowest rank sets the pace of a
  collective). On the CPU, ``time.perf_counter`` the same way; those numbers are labelled
  ``CPU_LABEL`` everywhere they are printed or written.
* Output: a table on stdout from rank 0, and ``<name>_<date>_<device>.csv``/``.json`` under
  ``--out-dir`` (default ``DEFAULT_OUT_DIR``, ``./bench_results`` under the working
  directory; the checkout's ``bench/`` scripts default to ``bench/results/``) with the
  environment record of ``env_record``.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from .. import __version__
from ..testing import run_ranks

__all__ = [
    "CPU_LABEL",
    "DEFAULT_OUT_DIR",
    "kernel_label",
    "parse_size",
    "format_size",
    "size_sweep",
    "parse_dtype",
    "dtype_name",
    "env_record",
    "git_sha",
    "init_from_env",
    "time_iters",
    "median",
    "spread",
    "speedup_text",
    "floor_flag",
    "reduce_max",
    "reduce_min",
    "reduce_sum",
    "pattern",
    "fill_pattern_4d",
    "count_wrong_4d",
    "all_ok",
    "print_table",
    "write_results",
    "load_pyplot",
    "device_label",
    "save_figure",
    "Progress",
]

CPU_LABEL = "CPU (not a GPU claim)"
# Relative: resolved against the working directory when the files are written, so an
# installed package never writes into its own source tree.
DEFAULT_OUT_DIR = Path("bench_results")
# The directory of this package's sources: its git sha is recorded when it is a checkout.
_PACKAGE_DIR = Path(__file__).resolve().parents[1]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


# ---- sizes and dtypes -------------------------------------------------------------------
def parse_size(text: str | int) -> int:
    """``"1K"`` -> 1024, ``"4M"`` -> 4194304, ``"512"`` -> 512 (binary units, as nccl-tests;
    an optional trailing ``B`` is ignored, ``"1.5K"`` is allowed when it is a whole number)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"parse_size: expected a size like 512, 1K, 4M or 1G, got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value != int(value) or value < 1:
        raise ValueError(f"parse_size: {text!r} is not a positive whole number of units")
    return int(value)


def format_size(n: int) -> str:
    """The shortest exact binary-unit spelling: 1024 -> ``"1K"``, 1536 -> ``"1536"``."""
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def size_sweep(begin: int, end: int, factor: float) -> list[int]:
    """``begin, begin*factor, ...`` up to and including ``end`` (nccl-tests ``-b -e -f``)."""
    if begin < 1 or end < begin:
        raise ValueError(f"size_sweep: need 1 <= begin <= end, got {begin}..{end}")
    if factor <= 1 and begin != end:
        raise ValueError(f"size_sweep: factor must be > 1 for a sweep, got {factor}")
    sizes, s = [], begin
    while s <= end:
        sizes.append(int(s))
        if begin == end:
            break
        s = int(math.floor(s * factor)) if s * factor > s + 0.5 else s + 1
    return sizes


_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "half": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float": torch.float32, "float32": torch.float32,
    "fp64": torch.float64, "double": torch.float64, "float64": torch.float64,
}  # fmt: skip


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"parse_dtype: expected one of {sorted(set(_DTYPES))}, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


# ---- head layouts ------------------------------------------------------------------------
# The models the benchmarks sweep: (query heads, KV heads).
MODELS = {"llama3-8b": (32, 8), "qwen2.5-14b": (40, 8), "llama3-70b": (64, 8)}


def parse_layouts(script: str, layouts: str | None, models: str | None, heads: int | None = None, kv_heads: int | None = None) -> list[tuple[str, int, int]]:
    """``(label, q_heads, kv_heads)`` from ``--layouts 32/8,40/8`` (labelled ``32/8``), else
    ``--heads/--kv-heads``, else ``--models`` (names of ``MODELS`` or ``all``; labelled by
    name). ``script`` names the caller in the error for an unknown model."""
    if layouts:
        out = []
        for spec in layouts.split(","):
            hq, hkv = (int(x) for x in spec.split("/"))
            out.append((f"{hq}/{hkv}", hq, hkv))
        return out
    if heads:
        hkv = kv_heads or heads
        return [(f"{heads}/{hkv}", heads, hkv)]
    names = list(MODELS) if models == "all" else [m.strip() for m in (models or "").split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if bad or not names:
        raise SystemExit(f"{script}: unknown --models {bad or models!r}; choose from {', '.join(MODELS)} or all")
    return [(m, *MODELS[m]) for m in names]


# ---- environment --------------------------------------------------------------------
def _git(args: Sequence[str], cwd: Path | str) -> str | None:
    """The output of ``git <args>`` run in ``cwd``, or None (no git, not a checkout, an error)."""
    try:
        out = subprocess.run(["git", *args], cwd=str(cwd), capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def _tracked(package_dir: Path | str) -> bool:
    """True when ``package_dir/__init__.py`` is tracked by the git checkout around it: the
    code that runs is that checkout's (an editable install, or the source tree itself). A
    copy installed into a virtual environment that lies inside some checkout is not."""
    return _git(["ls-files", "--error-unmatch", "__init__.py"], package_dir) is not None


def git_sha(package_dir: Path | str = _PACKAGE_DIR) -> str:
    """``git rev-parse HEAD`` of the checkout the package was imported from; otherwise (an
    installed copy, or a copy of the tree without ``.git`` on a lent GPU machine)
    ``$ULYSSES_KERNELS_GIT_SHA`` if set, else ``"unknown"`` (``env_record`` also records the
    installed version)."""
    fallback = os.environ.get("ULYSSES_KERNELS_GIT_SHA") or "unknown"
    sha = _git(["rev-parse", "HEAD"], package_dir) if _tracked(package_dir) else None
    return (sha or "").strip() or fallback


def _git_dirty(package_dir: Path | str = _PACKAGE_DIR) -> bool | None:
    """Whether that checkout has uncommitted edits to tracked files; None outside one."""
    if not _tracked(package_dir):
        return None
    out = _git(["status", "--porcelain", "--untracked-files=no"], package_dir)
    return None if out is None else bool(out.strip())


def _versions() -> dict:
    nccl = None
    if hasattr(torch.cuda, "nccl"):
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "triton": triton_version}


def env_record(device: torch.device, world_size: int, backend: str | None, **extra) -> dict:
    """What a result needs to be compared later: hardware, versions, git sha, date."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rec = {
        "gpu": gpu,
        "device": device.type,
        "timer": "cuda-events" if device.type == "cuda" else f"perf_counter, {CPU_LABEL}",
        **_versions(),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "ulysses_kernels": __version__,
        "git_sha": git_sha(),
        "git_dirty": _git_dirty(),
        "world_size": world_size,
        "backend": backend,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
    }
    rec.update(extra)
    return rec


def init_from_env() -> tuple[int, int, torch.device, str]:
    """Initialise torch.distributed for a torchrun launch (or a single process without one).

    Returns ``(rank, world_size, device, backend)``: NCCL and ``cuda:(LOCAL_RANK % GPUs)``
    when CUDA is available (several ranks may share a GPU: NCCL >= 2.30 with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1``, correctness only), else gloo on the CPU. Without ``RANK`` in the environment a group of one
    is created on a private file store, so every script runs unchanged as one process.
    """
    use_cuda = torch.cuda.is_available() and os.environ.get("ULYSSES_KERNELS_BENCH_CPU", "0") != "1"
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            store = os.path.join(tempfile.mkdtemp(prefix="ulysses_bench_"), "init")
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device, backend


def _spawned(rank: int, world: int, body, args) -> None:
    body(args, rank, world, torch.device("cpu"), "gloo")


def launch(body, args) -> int:
    """Run ``body(args, rank, world_size, device, backend)`` on every rank: on ``args.spawn``
    gloo ranks spawned here (CPU) when set, else in this torchrun (or single) process."""
    if getattr(args, "spawn", 0):
        run_ranks(_spawned, args.spawn, body, args)
        return 0
    rank, world, device, backend = init_from_env()
    try:
        body(args, rank, world, device, backend)
    finally:
        dist.destroy_process_group()
    return 0


def finish(args, rank: int, name: str, env_fn, rows, meta, plot_fn, plot_rows) -> None:
    """Rank 0 writes CSV/JSON (and a PNG when ``plot_fn`` can draw one) unless
    ``--no-write``; every rank exits non-zero when a row counted wrong elements."""
    if rank == 0 and not args.no_write:
        env = env_fn()
        paths = write_results(args.out_dir, name, env, rows, meta)
        png = paths["json"][: -len(".json")] + ".png"
        if plot_fn(plot_rows, png, env):
            paths["png"] = png
        print(f"# wrote {', '.join(paths.values())}", flush=True)
    bad = sum(r["wrong"] or 0 for r in rows)
    if bad:
        raise SystemExit(f"{name}: {bad} wrong elements")


# ---- timing -------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_iters(
    fn: Callable,
    *,
    device: torch.device,
    warmup: int,
    iters: int,
    setup: Callable | None = None,
    barrier: bool = True,
) -> list[float]:
    """Seconds per iteration of ``fn`` on this rank (one value per timed iteration).

    Each iteration: ``state = setup()`` if given (untimed), a barrier over the world
    (so that no rank starts early and times its peers' lateness), then ``fn(state)``
    (or ``fn()``) between two CUDA events (GPU) or two ``perf_counter`` reads (CPU).
    """
    use_events = device.type == "cuda"
    times = []
    for i in range(warmup + iters):
        state = setup() if setup is not None else None
        _sync(device)
        if barrier and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
            _sync(device)
        if use_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(state) if setup is not None else fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn(state) if setup is not None else fn()
            elapsed = time.perf_counter() - t0
        del state
        if i >= warmup:
            times.append(elapsed)
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def spread(times: Sequence[float], scale: float, unit: str) -> dict:
    """The spread of one rank's iteration times (seconds) as row fields in ``unit`` (``"us"``,
    ``"ms"``; ``scale`` converts): ``time_q1_<unit>``/``time_q3_<unit>`` (quartiles) and
    ``time_min_<unit>``/``time_max_<unit>``, each the largest over the ranks, as the row's
    median is (the slowest rank sets the pace). Collective: one all-reduce.

    NOTE: on the shared 2-core CPU the demo's summary said "13.5x faster than the chain" in one
    run and "2.7x" in the next (issue #41): a ratio of two medians of 9 iterations means little
    without their spread."""
    if not times:
        return {f"time_{k}_{unit}": None for k in ("q1", "q3", "min", "max")}
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (times[0],) * 3
    vals = [q1, q3, min(times), max(times)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor(vals, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        vals = t.tolist()
    return {f"time_{k}_{unit}": v * scale for k, v in zip(("q1", "q3", "min", "max"), vals)}


def _quartiles(row: dict, key: str) -> tuple[float, float, float]:
    """(q1, median, q3) of a row's time ``key`` (``time_us``/``time_ms``); the median thrice
    for rows written without a spread."""
    unit = key.rsplit("_", 1)[1]
    mid = row[key]
    return row.get(f"time_q1_{unit}") or mid, mid, row.get(f"time_q3_{unit}") or mid


def floor_flag(row: dict, floor: dict | None, key: str, floor_name: str) -> str | None:
    """The flag for a row faster than its own floor (the same work minus ours: the bare
    all-to-all of the same bytes, attention with no communication), or None. Such a median
    is noise of the run (the machine, too few iterations), not a win, and is reported as that."""
    if floor is None or row[key] >= floor[key]:
        return None
    return f"FLAGGED: faster than its floor ({floor_name}: {floor[key]:.3g} {key.rsplit('_', 1)[1]}): timing noise, not a win"


def speedup_text(base: dict, ours: dict, key: str, base_name: str, *, cpu: bool, floor: dict | None = None, floor_name: str = "") -> str:
    """``ours`` against ``base`` (two result rows, time ``key``) for a person: the ratio of
    medians with its spread (the ratio between the quartiles: base's q1 over ours' q3 up to
    base's q3 over ours' q1), what the timing is (a CPU code-path check), and in place of a
    speed-up the flag when ``ours`` beat its own ``floor`` (or ``base`` did: then the ratio
    would measure noise too)."""
    label = f"; {CPU_LABEL}: a code-path check" if cpu else ""
    flag = floor_flag(ours, floor, key, floor_name)
    if flag:
        return flag + label
    if floor_flag(base, floor, key, floor_name):
        return f"no ratio: {base_name} ran faster than the floor ({floor_name}), so this run's times are noise" + label
    b1, b, b3 = _quartiles(base, key)
    o1, o, o3 = _quartiles(ours, key)
    ratio, lo, hi = b / o, b1 / o3, b3 / o1
    if ratio >= 1:
        text = f"{ratio:.1f}x faster than {base_name} (quartiles {lo:.1f}-{hi:.1f}x)"
    else:
        text = f"{1 / ratio:.1f}x slower than {base_name} (quartiles {1 / hi:.1f}-{1 / lo:.1f}x)"
    return text + label


def _reduce(value: float, op) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(value)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float(value)], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=op)
    return float(t.item())


def reduce_max(value: float) -> float:
    """The maximum of ``value`` over all ranks (every rank gets it)."""
    return _reduce(value, dist.ReduceOp.MAX)


def reduce_min(value: float) -> float:
    return _reduce(value, dist.ReduceOp.MIN)


def all_ok(ok: bool) -> bool:
    """True when ``ok`` holds on every rank (so that all ranks take the same branch)."""
    return reduce_min(1.0 if ok else 0.0) > 0.5


# ---- output -------------------------------------------------------------------------
def _fmt(value, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if isinstance(value, str):
        return value
    return format(value, spec) if spec else str(value)


def print_table(columns: Sequence[tuple[str, str, str]], rows: Iterable[dict], file=None, title: str | None = None) -> str:
    """Right-aligned columns as nccl-tests prints them.

    ``columns``: ``(key, header, format spec)``; missing or NaN values print ``n/a``.
    Returns the text (and prints it to ``file``, default stdout).
    """
    rows = list(rows)
    cells = [[h for _, h, _ in columns]] + [[_fmt(r.get(k), spec) for k, _, spec in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = [] if title is None else [title]
    for j, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text, file=file or sys.stdout, flush=True)
    return text


def write_results(out_dir: Path | str, name: str, env: dict, rows: Sequence[dict], meta: dict | None = None) -> dict:
    """Write ``rows`` as CSV and ``{"env", "meta", "rows"}`` as JSON; returns the paths.

    File names: ``<name>_<UTC date-time>_<gpu or cpu>.{csv,json}``; the same content is
    also written to ``<name>_latest.json`` so that later tools find the newest run.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dev = re.sub(r"[^A-Za-z0-9]+", "-", str(env.get("gpu", "cpu"))).strip("-").lower() or "cpu"
    stem = f"{name}_{stamp}_{dev}_w{env.get('world_size', 1)}"
    keys: list[str] = []
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    csv_path, json_path = out / f"{stem}.csv", out / f"{stem}.json"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in keys})
    doc = {"name": name, "env": env, "meta": meta or {}, "rows": list(rows)}
    text = json.dumps(doc, indent=1, default=str)
    json_path.write_text(text)
    (out / f"{name}_latest.json").write_text(text)
    return {"csv": str(csv_path), "json": str(json_path)}


def load_pyplot():
    """matplotlib's pyplot with a file-only backend, or None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def kernel_label(name: str, device: torch.device) -> str:
    """What kernel set ``name`` runs on ``device``, for a table: on a CPU the ``cuda`` set
    is the C++ extension's CPU twin of the CUDA kernels, and says so."""
    return "cuda: C++ CPU twin" if name == "cuda" and device.type != "cuda" else name


def device_label(env: dict) -> str:
    """What a plot title says ran it: the GPU's name, or ``CPU_LABEL``."""
    return env["gpu"] if env["device"] == "cuda" else CPU_LABEL


def save_figure(plt, fig, path) -> bool:
    """Lay out, write (PNG, 120 dpi) and close ``fig``; returns True for the plot function."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


class Progress:
    """One line per step of a long sweep, on rank 0, to stderr, with elapsed time."""

    def __init__(self, total: int, enabled: bool, label: str = ""):
        self.total, self.enabled, self.label = total, enabled, label
        self.done, self.t0 = 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            el = time.perf_counter() - self.t0
            print(f"[{self.label} {self.done}/{self.total} {el:7.1f}s] {what}", file=sys.stderr, flush=True)


def reduce_sum(value: float) -> float:
    """The sum of ``value`` over all ranks."""
    return _reduce(value, dist.ReduceOp.SUM)


# ---- deterministic data with a known answer -------------------------------------------
def pattern(index: torch.Tensor, salt: int) -> torch.Tensor:
    """Small pseudo-random integers in [-125, 125] from int64 global element indices.

    Exactly representable in every float dtype (bf16 holds integers up to 256), and not
    periodic at block scale, so a block delivered to the wrong place or from the wrong
    peer does not match by accident. ``salt`` tells tensors apart (q, k, v, out, ...).
    """
    x = index * 1103515245 + (12345 + salt * 2654435761)
    return ((x >> 16) % 251 - 125).to(torch.int64)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` as same-width integers: NaN payloads and the sign of zero compare too."""
    return x.view(_INT_OF_SIZE[x.element_size()]) if x.is_floating_point() else x


def count_unequal_bits(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> int:
    """Elements of ``actual`` whose bits differ from ``expected`` (pairwise): the rule for
    data movement. A tensor of the wrong shape or dtype counts all of its expected
    elements, a missing one likewise."""
    wrong = sum(e.numel() for e in expected[len(actual):])
    for a, e in zip(actual, expected):
        if a.shape != e.shape or a.dtype != e.dtype:
            wrong += e.numel()
        else:
            wrong += int((_bits(a) != _bits(e)).sum().item())
    return wrong


def fill_pattern_4d(out: torch.Tensor, salt: int, seq_total: int, heads_total: int, t0: int, heads, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """Fill ``out`` ``[B, s, h, D]`` with the pattern of the global tensor ``[B, seq_total,
    heads_total, D]`` at rows ``t0 .. t0+s`` and heads ``heads`` (a list of global head
    indices, one per local head; repeats allowed). Works in chunks of rows."""
    for part, ref in _pattern_chunks(out, salt, seq_total, heads_total, t0, heads, chunk_elems):
        part.copy_(ref)
    return out


def count_wrong_4d(actual: torch.Tensor, salt: int, seq_total: int, heads_total: int, t0: int, heads, chunk_elems: int = 1 << 24) -> int:
    """Elements of ``actual`` ``[B, s, h, D]`` that differ from the pattern (see ``fill_pattern_4d``)."""
    wrong = 0
    for part, ref in _pattern_chunks(actual, salt, seq_total, heads_total, t0, heads, chunk_elems):
        wrong += int((part != ref.to(part.dtype)).sum().item())
    return wrong


def _pattern_chunks(x, salt, seq_total, heads_total, t0, heads, chunk_elems):
    b, s, h, d = x.shape
    dev = x.device
    head_idx = torch.as_tensor(list(heads), dtype=torch.int64, device=dev).view(1, 1, h, 1)
    dd = torch.arange(d, dtype=torch.int64, device=dev).view(1, 1, 1, d)
    bb = torch.arange(b, dtype=torch.int64, device=dev).view(b, 1, 1, 1)
    rows = max(1, chunk_elems // max(1, b * h * d))
    for start in range(0, s, rows):
        stop = min(s, start + rows)
        tt = torch.arange(t0 + start, t0 + stop, dtype=torch.int64, device=dev).view(1, -1, 1, 1)
        index = ((bb * seq_total + tt) * heads_total + head_idx) * d + dd
        yield x[:, start:stop], pattern(index, salt).to(x.dtype)
