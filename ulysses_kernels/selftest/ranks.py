"""One rank of the self-test and its set-up: the sizes the run uses here, the gloo group the
ranks exchange their outcomes on, the data group the paths run on, the communicators and
the 2-D groups every rank can use (each made collectively, in the same order on every rank)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..bench.sizes import parse_dtype
from ..comm import NCCLCommunicator, TorchCommunicator, nccl_available
from ..ring import SPGroups, make_sp_groups
from .judge import short_error
from .recovery import HangTimer, hang_seconds, hung

__all__ = ["Rank"]


class Rank:
    """One rank's self-test state. ``results`` is the same list on every rank: each entry is
    decided from values that all ranks exchanged over ``control``. ``paths.run_path`` runs
    one path on it, ``recovery.recover`` brings it back in step, ``run.run`` runs them all."""

    def __init__(self, rank: int, world: int, device: torch.device, transport: str, args):
        self.rank, self.world, self.device, self.transport, self.args = rank, world, device, transport, args
        self.dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float64)
        self.head_dim = args.head_dim or (64 if device.type == "cuda" else 16)
        self.seq_per_rank = args.seq_per_rank or (128 if device.type == "cuda" else 8)
        self.timeout = float(args.timeout)
        self.results: list[dict] = []
        self.not_tested: dict[str, str] = {}
        self.settings: dict = {}
        self.env: dict = {}
        self.stopped = ""  # why the remaining paths cannot run (a device that did not drain)
        self.out_of_step = False  # a rank raised inside a path's collectives: recover() before the next
        self.own_nccl: NCCLCommunicator | None = None
        # Outcomes travel on a gloo group of their own: a path that leaves the data group's
        # collectives out of step can neither delay nor mismatch them. Its timeout outlasts
        # a data-group timeout plus a drain.
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3 * self.timeout + 120))
        self.data = self.data_group()
        self.comms: dict = {}
        self.sp: dict[tuple[int, int], SPGroups | str] = {}  # per ring split: its groups, or why none

    # -- exchanges
    def gather(self, value) -> list:
        """Every rank's ``value``, by rank (over ``control``)."""
        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.control)
        return out

    def why_not_everywhere(self, why: str) -> str:
        """The ranks' reasons joined ("" when no rank gave one)."""
        return "; ".join(f"rank {r}: {w}" for r, w in enumerate(self.gather(why)) if w)

    # -- groups and communicators
    def data_group(self):
        """A new group for the paths' collectives (``--timeout``), its communicator made."""
        group = dist.new_group(backend=self.transport, timeout=datetime.timedelta(seconds=self.timeout))
        # torch creates a group's NCCL communicator at its first collective (borrow needs it).
        dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        return group

    def borrow(self) -> tuple[NCCLCommunicator | None, str]:
        """``NCCLCommunicator.borrow`` on the data group, or why not on this rank."""
        try:
            return NCCLCommunicator.borrow(self.data, timeout_s=self.timeout), ""
        except RuntimeError as e:
            return None, short_error(e)

    def make_communicators(self, wanted: list[str]) -> None:
        """``self.comms``: the wanted communicators that every rank can use (collective:
        every rank calls it at the same point); why not the others in ``not_tested``."""
        comms: dict = {"torch-dist": TorchCommunicator(self.data)}
        native = ""
        if self.device.type != "cuda":
            native = "needs CUDA tensors (this run is on the CPU)"
        else:
            native = self.why_not_everywhere("" if nccl_available() else "the C++ extension has no NCCL (python -m ulysses_kernels.info)")
        if "nccl" in wanted:
            why = native
            if not why:
                made, mine = None, ""
                # Collective: a rank that fails before ncclCommInitRank leaves the others in it.
                with HangTimer(hang_seconds(self.timeout), lambda seconds: hung(self, seconds, "comm nccl")):
                    try:
                        made = NCCLCommunicator(self.data, timeout_s=self.timeout)
                    except RuntimeError as e:
                        mine = short_error(e)
                why = self.why_not_everywhere(mine)
                if made is not None and why:
                    made.close()
                elif made is not None:
                    comms["nccl"] = self.own_nccl = made
            if why:
                self.not_tested["comm nccl"] = why
        if "nccl-borrowed" in wanted:
            why = native
            if not why:
                borrowed, mine = self.borrow()
                why = self.why_not_everywhere(mine)
                if not why:
                    comms["nccl-borrowed"] = borrowed
            if why:
                self.not_tested["comm nccl-borrowed"] = why
        self.comms = {n: c for n, c in comms.items() if n in wanted}

    def make_sp_groups(self, splits) -> None:
        """``self.sp``: the 2-D groups of each ``(ulysses_size, ring_size)`` split over the
        data group, or why not (collective: every rank makes every group, in this order)."""
        self.sp = {}
        for split in splits:
            made, mine = None, ""
            try:
                made = make_sp_groups(*split, group=self.data, timeout=datetime.timedelta(seconds=self.timeout))
            except (RuntimeError, ValueError) as e:
                mine = short_error(e)
            why = self.why_not_everywhere(mine)
            self.sp[split] = f"the 2-D group {split[0]}x{split[1]} could not be made: {why}" if why else made

    def close(self) -> None:
        if self.own_nccl is not None:
            self.own_nccl.close()
