"""The communicator interface the attention op talks to, and its torch.distributed default.

The op needs three things from a communicator:

* ``all_to_all(output, input, output_splits, input_splits)``: one collective over flat
  1-D buffers, split sizes in elements, peer-major (rank 0's block first);
* ``send_recv(sends, recvs)``: a group of point-to-point transfers posted together
  (one NCCL group; ``batch_isend_irecv`` on gloo and NCCL through torch);
* ``all_gather_ints(values)``: a small host-side exchange used only by the input checks.

``all_to_all`` and ``send_recv`` take ``async_op``; with ``async_op=True`` they return
an object with ``wait()``, so a caller can overlap communication with compute.
Another backend (the native NCCL communicator of the C++ extension) implements the
same methods and plugs in through ``ulysses_attention(..., comm=...)``; for CUDA tensors
on an NCCL group it is the default, driving torch's own communicator of the group
(``get_communicator(..., device=)``).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.distributed as dist

__all__ = ["Communicator", "LocalCommunicator", "TorchCommunicator"]


class Work(Protocol):
    def wait(self) -> None: ...


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        async_op: bool = False,
    ) -> Work | None: ...

    def send_recv(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        async_op: bool = False,
    ) -> Work | None: ...

    def all_gather_ints(self, values: Sequence[int], device: torch.device) -> list[list[int]]: ...


class _Done:
    def wait(self) -> None:
        return None


class _WorkList:
    def __init__(self, works):
        self._works = list(works)

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


class TorchCommunicator:
    """``torch.distributed`` collectives on ``group`` (gloo, NCCL or any backend torch has).

    Holds the group only; two instances over one group are interchangeable.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ulysses_kernels: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first (or launch with torchrun)"
            )
        self.group = group
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
        return work if async_op else None

    def send_recv(self, sends, recvs, async_op=False):
        ops = [dist.P2POp(dist.isend, t, self._global(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group) for p, t in recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        if async_op:
            return _WorkList(works)
        for work in works:
            work.wait()
        return None

    def all_gather_ints(self, values, device):
        # gloo gathers CPU tensors; NCCL needs them on the rank's GPU.
        if dist.get_backend(self.group) == "nccl":
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
        return _Done() if async_op else None

    def send_recv(self, sends, recvs, async_op=False):
        if sends or recvs:
            raise RuntimeError("LocalCommunicator: no peers to send to or receive from")
        return _Done() if async_op else None

    def all_gather_ints(self, values, device):
        return [list(values)]
