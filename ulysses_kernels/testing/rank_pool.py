"""A pool of live gloo worlds that runs one function after another on the same ranks.

Spawning ranks costs seconds each time on a small machine (every rank imports torch, often
transformers, and joins a process group); a test suite that spawns a world per test spends
most of its time there. ``RankPool`` keeps one world per world size alive and hands each
call's function to its ranks::

    pool = RankPool()
    pool.run(fn, 4, *args)   # fn(rank, 4, *args) on the pool's 4 ranks, as run_ranks would
    pool.close()

What a call sees is what a freshly spawned rank sees, as far as a process can be reset: the
caller's ``os.environ``, ``sys.path`` and working directory, the default dtype, grad mode,
one intra-op thread, torch's default seed, fresh warning filters, an empty torch.compile
cache, and none of the peers' process-wide settings (transformers' DeepSpeed ZeRO-3 flag,
accelerate's state). What a call leaves behind in modules it imported stays (that is what makes the pool
fast); a test that needs a process of its own passes ``fresh=True`` to ``run_ranks``. A call
that leaves process groups besides the world's (subgroups, device meshes, a peer's groups) ends
its world, and the next call gets a new one (~0.2 s for 4 ranks): each gloo group keeps a
thread polling its connections, and the peers keep groups in module globals that a new process
would not have. NOTE: measured on 4 idle ranks, 40 groups left over burned 0.19 of a core
(the world's group alone 0.015), for the rest of a test run.

Failures and hangs. A rank that raises sends its traceback back; the pool waits a short
grace for the others (a bad input raises on every rank), re-raises them all as
``RanksFailed``, and then starts the world's process group anew (destroy + init on every
rank), so that collectives left half-matched by the failure cannot pair with the next
call's. A rank that dies, a call past its deadline, or a group that does not come back
ends the whole world (its processes are killed); the next call spawns a new one.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing import reduction
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from .ranks import RanksFailed, rank_context

__all__ = ["RankPool"]

GRACE_S = 5.0  # how long the other ranks may take to report once one rank has failed
START_S = 900.0  # a world's start (every rank imports torch: slow on a loaded machine)
REINIT_S = 60.0  # a process group's restart after a failure
MAX_PROCESSES = int(os.environ.get("ULYSSES_KERNELS_RANK_POOL_MAX", "20"))  # live ranks over all worlds


def _init_group(rank, world_size, init_file, timeout_s):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip


def _fresh_state(env, path, cwd, filters):
    """Make this rank look like a new process to the next call (see the module's docstring)."""
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    os.chdir(cwd)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    warnings.resetwarnings()
    warnings.filters.extend(filters)  # the filters a new process starts with
    for module in list(sys.modules.values()):  # "warn once" registries: each call sees its warnings
        registry = getattr(module, "__warningregistry__", None)
        if isinstance(registry, dict):
            registry.clear()
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    _forget_peers_settings()


def _groups_left() -> int:
    """Process groups besides the world's that exist in this rank (a fresh process has none).
    torch keeps them in a private map (``distributed_c10d._world.pg_map``); without it, 0: the world is kept as before
    (only the idle polling is at stake, not a result)."""
    pg_map = getattr(getattr(distributed_c10d, "_world", None), "pg_map", None)
    return max(0, len(pg_map) - 1) if isinstance(pg_map, dict) else 0


def _forget_peers_settings():
    """What the peers keep process-wide between two calls, as a new process has it: transformers'
    "DeepSpeed ZeRO-3 is on" (a Trainer or an ``HfDeepSpeedConfig`` sets it; ``from_pretrained``
    then builds the next call's model under ``zero.Init``, which wants ``LOCAL_RANK``: a verl test
    after a Trainer test failed so) and accelerate's singleton state (its ``Accelerator`` keeps
    the first one's settings). Only modules a call already imported."""
    hf_deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    if hf_deepspeed is not None:
        hf_deepspeed.unset_hf_deepspeed_config()
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate_state.GradientState._reset_state()


@contextlib.contextmanager
def _writing_to(fds):
    """File descriptors 1 and 2 (and sys.stdout/stderr, which write to them) point at ``fds``
    for the block; the pool's own ones after it."""
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), saved):
            os.dup2(fd, target)
            os.close(fd)


def _worker(rank, world_size, init_file, timeout_s, conn):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    initial_seed, filters = torch.initial_seed(), list(warnings.filters)
    _init_group(rank, world_size, init_file, timeout_s)
    conn.send(("ready", None))
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:  # the parent is gone
            break
        if kind == "close":
            break
        if kind == "reinit":
            try:
                dist.destroy_process_group()
                _init_group(rank, world_size, payload, timeout_s)
                conn.send(("ready", None))
            except Exception:  # noqa: BLE001 - the parent ends the world
                conn.send(("error", traceback.format_exc()))
            continue
        # A call: the caller's standard output and error as they are now (a test's captured
        # fds), as a rank spawned by this call would inherit them, then the call itself.
        outputs = [reduction.recv_handle(conn) for _ in range(2)]
        try:
            with _writing_to(outputs):
                fn, args, env, path, cwd = conn.recv()  # may fail here: a function this rank cannot import
                _fresh_state(env, path, cwd, filters)
                torch.manual_seed(initial_seed)
                fn(rank, world_size, *args)
                if not dist.is_initialized():
                    raise RuntimeError("the call destroyed the pool's process group: run it with run_ranks(..., fresh=True)")
                dist.barrier()
            conn.send(("ok", _groups_left()))
        except BaseException:  # noqa: BLE001 - reported to the parent, which decides
            conn.send(("error", traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


class _World:
    """``world_size`` live ranks joined by one gloo group."""

    def __init__(self, world_size: int, timeout_s: float, preload=()):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._tmp = tempfile.TemporaryDirectory()
        self._inits = 0
        ctx = rank_context(preload)
        pipes = [ctx.Pipe() for _ in range(world_size)]
        self.conns = [parent for parent, _ in pipes]
        init = self._init_file()
        self.processes = []
        for rank, (_, child) in enumerate(pipes):
            p = ctx.Process(target=_worker, args=(rank, world_size, init, timeout_s, child), daemon=False)  # a call may start processes of its own
            p.start()
            child.close()
            self.processes.append(p)
        self._expect_ready(START_S, "start")

    def _init_file(self):
        self._inits += 1
        return os.path.join(self._tmp.name, f"init{self._inits}")

    def _expect_ready(self, timeout_s, what):
        replies = self._collect(timeout_s)
        bad = {r: v for r, v in replies.items() if v[0] != "ready"}
        if len(replies) < self.world_size or bad:
            self.kill()
            raise RuntimeError(f"RankPool: {self.world_size} ranks did not {what}: " + "; ".join(f"rank {r}: {v[1]}" for r, v in bad.items()))

    def _collect(self, timeout_s, grace_s=None):
        """Each rank's reply, until all replied, the deadline passed, or (with ``grace_s``)
        that long after the first failure."""
        replies, deadline, grace_end = {}, time.monotonic() + timeout_s, None
        while len(replies) < self.world_size:
            now = time.monotonic()
            end = deadline if grace_end is None else min(deadline, grace_end)
            if now >= end:
                break
            waiting = {self.conns[r]: r for r in range(self.world_size) if r not in replies}
            sentinels = {self.processes[r].sentinel: r for r in waiting.values()}
            for ready in wait(list(waiting) + list(sentinels), timeout=end - now):
                rank = waiting.get(ready, sentinels.get(ready))
                if rank in replies:
                    continue
                try:
                    replies[rank] = self.conns[rank].recv() if ready in waiting else ("died", None)
                except (EOFError, OSError):
                    replies[rank] = ("died", None)
                if replies[rank][0] == "died":
                    self.processes[rank].join(timeout=5)
                    code = self.processes[rank].exitcode
                    replies[rank] = ("died", f"process exited with code {code}" if code is not None else "process died")
                if replies[rank][0] != "ok" and replies[rank][0] != "ready" and grace_s is not None and grace_end is None:
                    grace_end = time.monotonic() + grace_s
        return replies

    def run(self, fn, args, timeout_s) -> int:
        """The call on every rank; returns the most process groups it left on a rank."""
        payload = (fn, args, dict(os.environ), list(sys.path), os.getcwd())
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            for conn, p in zip(self.conns, self.processes):
                conn.send(("call", None))
                for fd in (1, 2):
                    reduction.send_handle(conn, fd, p.pid)
                conn.send(payload)
        except (BrokenPipeError, OSError) as e:
            self.kill()
            raise RanksFailed(f"RankPool: a rank of the world of {self.world_size} is gone: {e}") from e
        # A hung collective raises at the group's own timeout (this world's, naming the collective):
        # waited for past the call's deadline only where it can come first (the call's deadline no
        # shorter than the group's); a shorter deadline is the call's own.
        slack = 30 if timeout_s >= self.timeout_s else 0
        replies = self._collect(timeout_s + slack, grace_s=GRACE_S)
        failed = {r: v for r, v in sorted(replies.items()) if v[0] != "ok"}
        if len(replies) == self.world_size and not failed:
            return max(v[1] for v in replies.values())
        if not failed:
            self.kill()
            raise TimeoutError(f"run_ranks: {getattr(fn, '__name__', fn)} on {self.world_size} ranks did not finish in {timeout_s:.0f} s (a hang?)")
        traces = "\n".join(f"-- rank {r} raised:\n{v[1]}" if v[0] == "error" else f"-- rank {r} died: {v[1]}" for r, v in failed.items())
        if len(replies) < self.world_size or any(v[0] == "died" for v in failed.values()):
            self.kill()
        else:
            self.restart_group()
        raise RanksFailed(traces)

    def restart_group(self):
        """A new process group on every rank (the old one may hold half-matched collectives)."""
        init = self._init_file()
        try:
            for conn in self.conns:
                conn.send(("reinit", init))
            self._expect_ready(REINIT_S, "restart their process group")
        except Exception:  # noqa: BLE001 - the world is ended; the next call spawns a new one
            self.kill()

    @property
    def alive(self):
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    def close(self):
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("close", None))
        deadline = time.monotonic() + 10
        for p in self.processes:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self):
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []
        self._tmp.cleanup()


_OPEN_POOLS: list[RankPool] = []  # closed at exit, before multiprocessing joins its children


@atexit.register
def _close_open_pools():
    while _OPEN_POOLS:
        _OPEN_POOLS.pop().close()


class RankPool:
    """Live gloo worlds, one per world size, reused call after call (see the module's
    docstring). ``timeout_s``: each world's process-group timeout and each call's default
    deadline; ``max_processes``: live ranks over all worlds (the least recently used worlds
    are closed to make room); ``preload``: modules the ranks' fork server imports before the
    first world starts (``rank_context``), beyond those this process has imported."""

    def __init__(self, timeout_s: float = 600.0, max_processes: int = MAX_PROCESSES, preload=()):
        self.timeout_s = timeout_s
        self.preload = tuple(preload)
        self.max_processes = max_processes
        self._worlds: dict[int, _World] = {}  # in order of last use
        _OPEN_POOLS.append(self)

    def run(self, fn, world_size: int, *args, timeout_s: float | None = None) -> None:
        """Call ``fn(rank, world_size, *args)`` on this pool's ``world_size`` ranks."""
        world = self._worlds.pop(world_size, None)
        if world is None or not world.alive:
            if world is not None:
                world.kill()
            self._make_room(world_size)
            world = _World(world_size, self.timeout_s, self.preload)
        self._worlds[world_size] = world
        if world.run(fn, args, self.timeout_s if timeout_s is None else timeout_s):  # groups left: see the module's docstring
            self._worlds.pop(world_size).close()

    def _make_room(self, world_size):
        while self._worlds and sum(w.world_size for w in self._worlds.values()) + world_size > self.max_processes:
            oldest = next(iter(self._worlds))
            self._worlds.pop(oldest).close()

    @property
    def world_sizes(self):
        return [n for n, w in self._worlds.items() if w.alive]

    def close(self):
        while self._worlds:
            self._worlds.popitem()[1].close()
        if self in _OPEN_POOLS:
            _OPEN_POOLS.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
