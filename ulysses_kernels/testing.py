"""Run a function on real ``torch.distributed`` ranks (gloo on the CPU) from a test or a
script: ``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, initializes
a process group in each, calls ``fn(rank, world_size, *args)`` and re-raises the first
failure in the parent with the rank's traceback."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks"]


def _worker(rank, fn, world_size, init_file, backend, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, backend: str = "gloo") -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(fn, world_size, init_file, backend, args), nprocs=world_size, join=True)
