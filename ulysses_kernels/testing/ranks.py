"""Run a function on real ``torch.distributed`` ranks (gloo on the CPU) from a test or a
script: ``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, initializes
a process group in each, calls ``fn(rank, world_size, *args)`` and re-raises the first
failure in the parent with the rank's traceback.

A rank that hangs must not hang the caller: collectives time out after ``timeout_s``
(the process group's own timeout) and the parent kills the ranks and raises
``TimeoutError`` when they have not all finished by then.

With a default pool set (``set_default_pool(RankPool())``, as the test suite's conftest
does), gloo calls run on the pool's live worlds instead of new processes
(``ulysses_kernels.testing.rank_pool``); ``fresh=True`` spawns new ranks all the same.
"""

from __future__ import annotations

import datetime
import multiprocessing as std_mp
import os
import pickle
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "RanksFailed", "rank_context", "set_default_pool"]


class RanksFailed(RuntimeError):
    """One or more ranks raised; the message holds the traceback of every rank that did
    (the first rank to fail is not always the first one the parent notices)."""


DEFAULT_TIMEOUT_S = float(os.environ.get("ULYSSES_KERNELS_TEST_TIMEOUT", "600"))
# What a new rank's process costs is mostly its imports: torch, and transformers, DeepSpeed or
# verl when the caller uses them (4 s, 3 s, 3.6 s, 9 s of CPU each here). Ranks start from
# multiprocessing's fork server, which imports those of them the caller has imported once and
# forks each rank from there: `examples/train_hf.py --spawn 4` 25 s -> 17 s on this 2-core CPU.
_PRELOAD = ("torch", "ulysses_kernels", "transformers", "deepspeed", "accelerate", "verl", "torchtitan")


def rank_context(preload=()):
    """The multiprocessing context ranks start in: the fork server (preloading what of
    ``_PRELOAD`` this process has imported, when the server is started by this call), or
    ``spawn`` where there is none, where CUDA is available (a peer's import may initialize
    CUDA in the server, and a process forked after that cannot use it), or where
    ``ULYSSES_KERNELS_RANK_START=spawn`` asks for it.

    A rank started so sees what a spawned one sees: the caller's ``sys.path``, working
    directory and main module (multiprocessing sends them), and the caller's environment
    (``run_ranks`` and the pool send it with each call: the server's is that of its start).
    The fork server is one per process: its preload list is set here, before it starts;
    ``preload`` adds modules the caller has not imported but its ranks will (the test suite's
    pool: the installed peers, which its tests import inside their ranks)."""
    how = os.environ.get("ULYSSES_KERNELS_RANK_START", "forkserver")
    if how not in ("forkserver", "spawn"):
        raise ValueError(f"ULYSSES_KERNELS_RANK_START must be 'forkserver' or 'spawn', got {how!r}")
    if how == "forkserver" and "forkserver" in std_mp.get_all_start_methods() and not torch.cuda.is_available():
        std_mp.set_forkserver_preload(list(dict.fromkeys([m for m in _PRELOAD if m in sys.modules] + list(preload))))
        return std_mp.get_context("forkserver")
    return std_mp.get_context("spawn")


_default_pool = None  # a RankPool that run_ranks' gloo calls use; set by the caller that owns it


def set_default_pool(pool):
    """Let ``run_ranks`` run gloo calls on ``pool`` (a ``RankPool``; ``None``: spawn each
    time). Returns the pool that was set before. The caller owns the pool and closes it."""
    global _default_pool
    previous, _default_pool = _default_pool, pool
    return previous


def _worker(rank, fn, world_size, init_file, transport, timeout_s, args, env):
    os.environ.clear()  # the caller's, as a spawned rank inherits it (a fork server's is that of its start)
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        transport, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    try:
        if transport == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn, world_size: int, *args, transport: str = "gloo", timeout_s: float | None = None, backend: str | None = None, fresh: bool = False,
) -> None:  # fmt: skip
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks joined by ``transport``
    (``"gloo"``, ``"nccl"``: what torch calls the group's backend; ``backend=`` is the old
    spelling of it, still taken, with a ``DeprecationWarning``). ``fresh``: new processes even
    where a default pool is set (a call that needs a process of its own)."""
    if backend is not None:
        warnings.warn("run_ranks(backend=...) is now run_ranks(transport=...)", DeprecationWarning, stacklevel=2)
        transport = backend
    if _default_pool is not None and transport == "gloo" and not fresh:
        _default_pool.run(fn, world_size, *args, timeout_s=timeout_s)
        return
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        context = mp.start_processes(
            _worker, args=(fn, world_size, init_file, transport, timeout_s, args, dict(os.environ)),
            nprocs=world_size, join=False, start_method=rank_context().get_start_method(),
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s + 30  # the group's own timeout fires first
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    for p in context.processes:
                        if p.is_alive():
                            p.kill()
                    raise TimeoutError(f"run_ranks: {getattr(fn, '__name__', fn)} on {world_size} ranks did not finish in {timeout_s:.0f} s (a hang?)")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            traces = []
            for rank, path in enumerate(context.error_files):
                if path and os.access(path, os.R_OK) and os.path.getsize(path):
                    with open(path, "rb") as fh:
                        traces.append(f"-- rank {rank} raised:\n{pickle.load(fh)}")
            raise RanksFailed("\n".join(traces) or str(e)) from e
