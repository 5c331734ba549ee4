"""Communicators over ``torch.distributed``, and the one for a world of one without it.

* ``TorchCommunicator(group)``: torch's collectives on the group, whatever its transport
  (gloo, NCCL or any other torch has);
* ``LocalCommunicator()``: world size 1 when ``torch.distributed`` is not initialized.

Both implement ``ulysses_kernels.comm.Communicator``; with ``async_op=True`` they return
``Work``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Work, transport

__all__ = ["LocalCommunicator", "TorchCommunicator"]


class TorchCommunicator:
    """``torch.distributed`` collectives on ``group`` (transport gloo, NCCL or any other torch has).

    Holds the group only; two instances over one group are interchangeable.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ulysses_kernels: torch.distributed is not initialized; call torch.distributed.init_process_group first (or launch with torchrun)"
            )
        self.group = group
        pg = dist.group.WORLD if group is None else group
        if isinstance(pg, dist.ProcessGroup):
            # The group's own rank and size: what dist.get_rank/get_world_size(group) return,
            # without their look-ups (this runs once per call of the functional ops).
            self.rank, self.world_size = pg.rank(), pg.size()
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def all_to_all(self, output, input, output_splits, input_splits, async_op=False):
        work = dist.all_to_all_single(
            output,
            input,
            output_split_sizes=list(output_splits),
            input_split_sizes=list(input_splits),
            group=self.group,
            async_op=async_op,
        )
        return Work(works=(work,)) if async_op else None

    def send_recv(self, sends, recvs, async_op=False):
        ops = [dist.P2POp(dist.isend, t, self._global(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group) for p, t in recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        if async_op:
            return Work(works=works)
        for work in works:
            work.wait()
        return None

    def all_gather_ints(self, values, device):
        # gloo gathers CPU tensors; NCCL needs them on the rank's GPU.
        if transport(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        sizes = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(sizes, mine, group=self.group)
        return [t.tolist() for t in sizes]


class LocalCommunicator:
    """World size 1 without ``torch.distributed``: every transfer is a local copy."""

    rank = 0
    world_size = 1

    def all_to_all(self, output, input, output_splits, input_splits, async_op=False):
        output.copy_(input)
        return Work() if async_op else None

    def send_recv(self, sends, recvs, async_op=False):
        if sends or recvs:
            raise RuntimeError("LocalCommunicator: no peers to send to or receive from")
        return Work() if async_op else None

    def all_gather_ints(self, values, device):
        return [list(values)]
