"""The whole run on one rank: the settings, the communicators and 2-D groups, then every
path in the same order on every rank (the case's float64 truth once, its paths after it),
the ranks brought back in step after a path that left them out of it; rank 0 reports."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import info
from ..backends import resolve_backend
from ..bench.harness import Progress
from ..bench.record import env_record
from ..bench.sizes import dtype_name
from .cases import CASE_NAMES, CHUNKS, COMMS, QUICK_CASES, QUICK_CHUNKS, Case, PathSpec, chunk_value, kernel_choice, make_cases, make_paths
from .judge import FLOAT64_BOUND, truth
from .paths import blank, run_path
from .recovery import recover
from .report import progress_line, report

__all__ = ["run"]


def _packed_kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    """The packed-documents kernel the packed paths run here (``backends.packed_kernel`` for
    the default backend, with a backward)."""
    probe = torch.empty(1, 1, 1, 8, device=device, dtype=dtype)
    return resolve_backend(None, probe).packed_kernel(probe, True, grad=True).name


def _note_ring_left_out(rank, cases: list[Case], paths: list[PathSpec], names) -> None:
    """``rank.not_tested``: why a ring case asked for has no path."""
    for name in (n for n in names if n.startswith("ring")):
        zigzag, packed = "zigzag" in name, name.endswith("packed")
        if not any(c.split and c.seq_layout == ("zigzag" if zigzag else "contiguous") and (c.docs is not None) == packed for c in cases):
            rank.not_tested[f"case {name}"] = f"needs at least 2 ranks (ring_size >= 2), this run has {rank.world}"
        elif not any(p.case.split for p in paths):
            rank.not_tested[f"case {name}"] = "runs with comm torch-dist only (not in --comms)"


def run(rank) -> bool:
    """Every path, in the same order on every rank (``rank``: this one, a ``ranks.Rank``);
    rank 0 reports. True: no FAIL."""
    args = rank.args
    kernels, why = kernel_choice(args.kernels)
    rank.not_tested.update({f"kernels {n}": w for n, w in why.items()})
    every_rank = rank.gather(kernels)
    names = args.cases or (QUICK_CASES if args.quick else CASE_NAMES)
    cases = make_cases(rank.world, rank.seq_per_rank, names)
    chunks = [chunk_value(c) for c in (args.chunks or (QUICK_CHUNKS if args.quick else CHUNKS))]
    rank.settings = {
        "world_size": rank.world, "transport": rank.transport, "device": rank.device.type,
        "gpus": torch.cuda.device_count() if rank.device.type == "cuda" else 0,
        "dtype": dtype_name(rank.dtype), "head_dim": rank.head_dim, "seq_per_rank": rank.seq_per_rank,
        "kernels": kernels, "comms": None, "chunks": chunks, "cases": [c.name for c in cases], "layouts": [c.name for c in cases],  # layouts: the old key
        "timeout_s": rank.timeout, "argv": args.argv, "packed_kernel": _packed_kernel_name(rank.device, rank.dtype),
        "bound_rule": f"{FLOAT64_BOUND:g} in float64; else 2x PyTorch's own SDPA error in the same dtype on the same device, per tensor",
    }  # fmt: skip
    if rank.rank == 0:
        rank.env = env_record(rank.device, rank.world, rank.transport, install=info.collect())
    wanted = args.comms or list(COMMS)
    rank.make_communicators(wanted)
    # Communicators that are not here: left out by default, a FAIL when asked for.
    comms = rank.settings["comms"] = [c for c in wanted if c in rank.comms or args.comms]
    paths = make_paths(cases, kernels, comms, chunks)
    _note_ring_left_out(rank, cases, paths, names)
    rank.make_sp_groups(list(dict.fromkeys(p.case.split for p in paths if p.case.split)))
    progress = Progress(len(paths), rank.rank == 0, "selftest")
    differ = (
        "" if all(k == kernels for k in every_rank) else "ranks list different kernel sets: " + "; ".join(f"rank {r}: {k}" for r, k in enumerate(every_rank))
    )
    for index, case in enumerate(cases):
        # Once stopped, nothing more goes to the device: its queue is stuck.
        known = None if rank.stopped or differ else truth(rank, case, index)
        for path in (p for p in paths if p.case is case):
            if rank.stopped or differ:
                result = blank(rank, path, message=f"not run: {rank.stopped or differ}")
            elif isinstance(known, str):
                result = blank(rank, path, message=f"not run: {known}")
            elif path.comm not in rank.comms:
                result = blank(rank, path, message=f"not run: {rank.not_tested.get('comm ' + path.comm, 'not available')}")
            elif isinstance(rank.sp.get(path.case.split), str):
                result = blank(rank, path, message=f"not run: {rank.sp[path.case.split]}")
            else:
                result = run_path(rank, path, known)
            rank.results.append(result)
            progress.step(progress_line(result))
            if rank.out_of_step:
                recover(rank, path.label)
    if rank.rank == 0:
        report(rank.results, rank.env, rank.settings, rank.not_tested, args)
    dist.barrier(group=rank.control)  # rank 0 has written everything before any rank exits
    return not any(r["status"] == "FAIL" for r in rank.results)
