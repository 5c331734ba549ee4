"""What a benchmark leaves behind: the environment record, the table, the result files, the plot.

* ``env_record``: hardware, versions, git sha, world size, transport (the torch.distributed
  backend of the group: ``nccl`` or ``gloo``; the word "backend" is the attention backend's)
  and date, written as the JSON's ``env``. Records written before that rename call the
  transport ``backend``: a reader takes ``transport_of(env)``, which reads either.
* Output: a table on stdout (``print_table``, right-aligned as nccl-tests prints it) and
  ``<name>_<date>_<device>.csv``/``.json`` under ``--out-dir`` (``write_results``; default
  ``DEFAULT_OUT_DIR``, ``./bench_results`` under the working directory; the checkout's
  ``bench/`` scripts default to ``bench/results/``), and a PNG when matplotlib is importable.
* Labels: CPU timings say ``CPU_LABEL`` wherever they are printed or written.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from .. import __version__, extension

__all__ = [
    "CPU_LABEL",
    "DEFAULT_OUT_DIR",
    "env_record",
    "transport_of",
    "git_sha",
    "print_table",
    "write_results",
    "load_pyplot",
    "kernel_label",
    "device_label",
    "save_figure",
]

CPU_LABEL = "CPU (not a GPU claim)"
# Relative: resolved against the working directory when the files are written, so an
# installed package never writes into its own source tree.
DEFAULT_OUT_DIR = Path("bench_results")
# The directory of this package's sources: its git sha is recorded when it is a checkout.
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


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
    loaded = extension.loaded_nccl_version()  # the NCCL that runs (ncclGetVersion of the mapped library), not torch's header
    if loaded:
        nccl = ".".join(map(str, loaded))
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "triton": triton_version}


def env_record(device: torch.device, world_size: int, transport: str | None, **extra) -> dict:
    """What a result needs to be compared later: hardware, versions, git sha, date.

    ``transport``: the torch.distributed backend the ranks talked over (``"nccl"``,
    ``"gloo"``), None for a single process that runs no collective. ``nccl`` is the NCCL
    that ran (``ncclGetVersion`` of the library loaded): ``None`` unless the transport is
    NCCL, with torch's build's version as ``nccl_in_torch_build`` then."""
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
        "transport": transport,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
    }
    if device.type == "cuda":  # several ranks sharing a GPU (NCCL >= 2.30) is not N GPUs: the record says so
        gpus, local = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        rec.update(gpus_visible=gpus, local_ranks=local)
        if local > gpus:
            rec["shared_gpu"] = (f"{local} ranks on {gpus} GPU{'s' if gpus > 1 else ''}: they share its HBM and SMs; "
                                 "the rows check code paths and the exposed-communication share, not link bandwidth")  # fmt: skip
    if transport != "nccl":  # "nccl" is the NCCL that ran: none did; torch's build is kept beside, named so
        rec["nccl_in_torch_build"], rec["nccl"] = rec["nccl"], None
    rec.update(extra)
    return rec


def transport_of(env: dict) -> str | None:
    """The transport of a result's ``env`` record: its ``transport``, or, in a record written
    before that key was named (``bench/results/2026-11-27_h200``), its ``backend``."""
    return env["transport"] if "transport" in env else env.get("backend")


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


# ---- labels and plots -----------------------------------------------------------------
def kernel_label(name: str, device: torch.device) -> str:
    """What kernel set ``name`` runs on ``device``, for a table: on a CPU the ``cuda`` set
    is the C++ extension's CPU twin of the CUDA kernels, and says so."""
    return "cuda: C++ CPU twin" if name == "cuda" and device.type != "cuda" else name


def device_label(env: dict) -> str:
    """What a plot title says ran it: the GPU's name (and "N ranks on one GPU" when they shared it), or ``CPU_LABEL``."""
    if env["device"] != "cuda":
        return CPU_LABEL
    shared = env.get("local_ranks", 1) > env.get("gpus_visible", 1)
    return f"{env['gpu']} ({env['local_ranks']} ranks on {env['gpus_visible']} GPU)" if shared else env["gpu"]


def load_pyplot():
    """matplotlib's pyplot with a file-only backend, or None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path) -> bool:
    """Lay out, write (PNG, 120 dpi) and close ``fig``; returns True for the plot function."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
