"""Communicators over ``torch.distributed``, and the one for a world of one without it.

* ``TorchCommunicator(group)``: torch's collectives on the group, whatever its transport
  (gloo, NCCL or any other torch has); on gloo, CUDA tensors too (several processes sharing
  one GPU, say): torch's gloo stages them through host memory for ``all_to_all_single``,
  ``all_reduce`` and ``all_gather``, and this class does so for ``send_recv`` (gloo's
  send/recv read and write the tensor's memory as host memory);
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
        # gloo alone (a "cpu:gloo,cuda:nccl" group sends its CUDA tensors over NCCL); the
        # transport is looked up only when a tensor is off the host.
        if any(t.device.type != "cpu" for _, t in (*sends, *recvs)) and transport(self.group) == "gloo":
            return self._send_recv_through_host(sends, recvs, async_op)
        ops = [dist.P2POp(dist.isend, t, self._global(p), self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group) for p, t in recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        if async_op:
            return Work(works=works)
        for work in works:
            work.wait()
        return None

    def _send_recv_through_host(self, sends, recvs, async_op):
        """``send_recv`` of device tensors over gloo, through host copies: the sends copied to
        the host now (after the current stream's work on them), the receives into host
        buffers, copied into ``recvs`` by the first ``wait()`` (at once without
        ``async_op``). torch's own gloo collectives stage CUDA tensors the same way
        (pinned copies on a side stream); its send/recv do not, and would hand gloo a device
        pointer to read as host memory."""
        host_sends = [(p, t.to("cpu")) for p, t in sends]
        host_recvs = [(p, torch.empty(t.shape, dtype=t.dtype)) for p, t in recvs]
        work = _CopyBack(self.send_recv(host_sends, host_recvs, async_op=True), [t for _, t in recvs], [t for _, t in host_recvs])
        if async_op:
            return Work(works=(work,))
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


class _CopyBack:
    """A host-side exchange's handle: ``wait()`` waits it, then copies each host buffer into
    its device tensor (once)."""

    def __init__(self, work, targets, sources):
        self.work, self.pairs = work, list(zip(targets, sources))

    def wait(self):
        self.work.wait()
        pairs, self.pairs = self.pairs, []
        for target, source in pairs:
            target.copy_(source)


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
