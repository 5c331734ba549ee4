"""Keeping the ranks in step after a failure: the hang timer that ends a rank whose path no
timeout caught (rank 0 writing what it has first), and the recovery after a path in which
some rank raised inside the collectives (a new data group and communicators, once every
rank's device has drained its queued work)."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

from ..comm import NCCLCommunicator, TorchCommunicator
from .judge import short_error
from .report import report

__all__ = ["HangTimer", "hang_seconds", "hung", "drain", "recover"]


def hang_seconds(timeout: float) -> float:
    """How long a path (or a collective set-up) may run before its rank is ended as hung:
    past a data-group timeout, the recovery's drain and a margin."""
    return 2 * timeout + 60


class HangTimer:
    """Ends this process when a path runs past ``seconds`` (a hang that no timeout caught);
    ``on_fire(seconds)`` writes what there is first."""

    def __init__(self, seconds: float, on_fire):
        self.seconds, self.on_fire, self.timer = seconds, on_fire, None

    def __enter__(self):
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()

    def _fire(self):
        try:
            self.on_fire(self.seconds)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


def hung(rank, seconds: float, what: str, result: dict | None = None) -> None:
    """The hang timer's last words on ``rank`` (a ``ranks.Rank``): rank 0 writes what there
    is (``result``: the path that hung)."""
    print(f"selftest: rank {rank.rank}: {what} did not finish in {seconds:.0f} s (a hang); ending this rank", file=sys.stderr, flush=True)
    if rank.rank == 0:
        results = list(rank.results)
        if result is not None:
            result["message"] = f"did not finish in {seconds:.0f} s on rank 0 (a hang); the run was ended here"
            results.append(result)
        else:
            rank.not_tested[what] = f"did not finish in {seconds:.0f} s on rank 0 (a hang); the run was ended here"
        report(results, rank.env, rank.settings, rank.not_tested, rank.args, complete=False)
    else:
        time.sleep(10)  # the ranks' hang timers fire together: let rank 0 write before a launcher ends it


def drain(device: torch.device, timeout: float) -> bool:
    """True when ``device`` finishes its queued work within ``timeout`` + 30 s (the native
    communicators' own watchdog aborts their work stuck for ``timeout``, which frees the
    stream)."""
    if device.type != "cuda":
        return True
    done = threading.Event()

    def sync():
        try:
            torch.cuda.synchronize(device)
        except RuntimeError:
            return  # a device error: not drained
        done.set()

    threading.Thread(target=sync, daemon=True).start()
    return done.wait(timeout + 30)


def recover(rank, after: str) -> None:
    """After a path in which some rank raised inside the collective part: once every
    rank's device has drained its queued work, a new data group and its communicators
    (our own NCCL communicator is made again if its watchdog aborted it on any rank).
    Else the queued work waits on a collective that never comes, and the run stops.
    Collective over ``rank`` (a ``ranks.Rank``, whose groups and communicators it replaces)."""
    rank.out_of_step = False
    if not all(rank.gather(drain(rank.device, rank.timeout))):
        rank.stopped = f"after {after}, some rank's device did not finish its queued work (collectives out of step)"
        return
    rank.data = rank.data_group()
    rank.make_sp_groups(list(rank.sp))  # the old ones may be out of step too
    comms = rank.comms
    if "torch-dist" in comms:
        comms["torch-dist"] = TorchCommunicator(rank.data)
    if "nccl" in comms and any(rank.gather(rank.own_nccl.failure)):
        rank.own_nccl.close()
        del comms["nccl"]
        made, mine = None, ""
        try:
            made = NCCLCommunicator(rank.data, timeout_s=rank.timeout)
        except RuntimeError as e:
            mine = short_error(e)
        why = rank.why_not_everywhere(mine)
        if why or made is None:
            if made is not None:
                made.close()
            rank.own_nccl = None
            rank.not_tested["comm nccl"] = f"could not be made again after {after}: {why}"
        else:
            comms["nccl"] = rank.own_nccl = made
    if "nccl-borrowed" in comms:
        borrowed, mine = rank.borrow()
        why = rank.why_not_everywhere(mine)
        if why:
            del comms["nccl-borrowed"]
            rank.not_tested["comm nccl-borrowed"] = f"lost after {after}: {why}"
        else:
            comms["nccl-borrowed"] = borrowed
