"""What every benchmark of ``ulysses_kernels.bench`` runs on: flags, ranks, progress, ending.

Conventions (every module follows them):

* Launch: ``torchrun --nproc-per-node N -m ulysses_kernels.bench.<name> ...`` (NCCL on
  GPUs), or ``python -m ulysses_kernels.bench.<name> --spawn N ...`` which spawns ``N``
  gloo ranks on the CPU. ``bench/bench_<name>.py`` in a checkout runs the same ``main``
  with ``default_out_dir`` set to ``bench/results``. A module's ``main`` is
  ``launch(body, parse_args(argv, default_out_dir))``: ``body(args, rank, world_size,
  device, transport)`` runs on every rank, ``transport`` being the torch.distributed
  backend (``"nccl"``, ``"gloo"``).
* Flags: ``parser(__doc__)`` and the adders below give the flags the modules share the
  same spelling, default and help (``--spawn``, ``--out-dir``/``--out``, ``--no-write``,
  ``--progress``, ``--heads-sets``).
* Ending: ``finish`` writes the result files on rank 0 (``record.write_results``) and
  exits non-zero on every rank when a row counted wrong elements; ``print_skipped`` and
  ``print_wrong_total`` are the two last lines of a report.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from ..testing import run_ranks
from .record import DEFAULT_OUT_DIR, write_results

__all__ = [
    "Skip",
    "parser",
    "add_spawn",
    "add_output",
    "add_progress",
    "add_heads_sets",
    "init_from_env",
    "launch",
    "finish",
    "print_skipped",
    "print_wrong_total",
    "Progress",
]


class Skip(Exception):
    """This row (op, method, case) cannot run here; the message says why (printed once,
    recorded in the JSON's ``meta.skipped``)."""


# ---- flags -------------------------------------------------------------------------------
def parser(doc: str | None) -> argparse.ArgumentParser:
    """The parser of a benchmark: its module docstring as the help text, kept as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_spawn(p: argparse.ArgumentParser, default: int | None = 0, help: str | None = None) -> None:
    """``--spawn N``: ``N`` gloo ranks on the CPU instead of torchrun (``launch``)."""
    p.add_argument("--spawn", type=int, default=default, metavar="N", help=help or "spawn N gloo ranks on the CPU instead of torchrun")


def add_output(p: argparse.ArgumentParser, default_out_dir=None) -> None:
    """``--out-dir`` (alias ``--out``; ``default_out_dir`` or ``record.DEFAULT_OUT_DIR``) and
    ``--no-write``: where ``finish`` writes, or that it writes nothing."""
    out = default_out_dir or DEFAULT_OUT_DIR
    p.add_argument("--out-dir", "--out", dest="out_dir", default=str(out), help=f"where the CSV/JSON/PNG go (default {out})")
    p.add_argument("--no-write", action="store_true", help="print the table only")


def add_progress(p: argparse.ArgumentParser, what: str) -> None:
    """``--progress``/``--no-progress``: ``what`` (one line per step, on stderr, rank 0), on by default."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help=f"{what} (default on; --no-progress: off)")


def add_heads_sets(p: argparse.ArgumentParser, help: str) -> None:
    """``--heads-sets Hq/Hkv,...`` (``args.heads_sets``; read by ``sizes.parse_heads_sets``),
    with ``--layouts``, its name before #40, as an alias: "layout" is the exchange's."""
    p.add_argument("--heads-sets", "--layouts", dest="heads_sets", default=None, metavar="HQ/HKV,...", help=help)


# ---- ranks -------------------------------------------------------------------------------
def init_from_env() -> tuple[int, int, torch.device, str]:
    """Initialise torch.distributed for a torchrun launch (or a single process without one).

    Returns ``(rank, world_size, device, transport)``: NCCL and ``cuda:(LOCAL_RANK % GPUs)``
    when CUDA is available (several ranks may share a GPU: NCCL >= 2.30 with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1``, correctness only), else gloo on the CPU. Without
    ``RANK`` in the environment a group of one is created on a private file store, so every
    script runs unchanged as one process.
    """
    use_cuda = torch.cuda.is_available() and os.environ.get("ULYSSES_KERNELS_BENCH_CPU", "0") != "1"
    transport = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(transport)
        else:
            store = os.path.join(tempfile.mkdtemp(prefix="ulysses_bench_"), "init")
            dist.init_process_group(transport, init_method=f"file://{store}", rank=0, world_size=1)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device, transport


def _spawned(rank: int, world: int, body, args) -> None:
    body(args, rank, world, torch.device("cpu"), "gloo")


def launch(body: Callable, args) -> int:
    """Run ``body(args, rank, world_size, device, transport)`` on every rank: on
    ``args.spawn`` gloo ranks spawned here (CPU) when set, else in this torchrun (or single)
    process."""
    if getattr(args, "spawn", 0):
        run_ranks(_spawned, args.spawn, body, args)
        return 0
    rank, world, device, transport = init_from_env()
    try:
        body(args, rank, world, device, transport)
    finally:
        dist.destroy_process_group()
    return 0


# ---- ending ------------------------------------------------------------------------------
def finish(args, rank: int, name: str, env_fn: Callable[[], dict], rows, meta, plot_fn, plot_rows) -> None:
    """Rank 0 writes CSV/JSON (and a PNG when ``plot_fn`` can draw one) unless
    ``--no-write``; every rank exits non-zero when a row counted wrong elements.
    ``env_fn``: the environment record (``record.env_record``), built on rank 0 only."""
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


def print_skipped(notes: dict) -> None:
    """``# skipped <what>: <why>``, one line per row that did not run."""
    for what, why in notes.items():
        print(f"# skipped {what}: {why}", flush=True)


def print_wrong_total(rows: Iterable[dict], label: str = "wrong elements") -> int:
    """``# <label>: <n> OK`` (or ``FAILED``): the wrong elements of all rows; returns ``n``."""
    bad = sum(r["wrong"] or 0 for r in rows)
    print(f"# {label}: {bad} {'OK' if bad == 0 else 'FAILED'}", flush=True)
    return bad


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
