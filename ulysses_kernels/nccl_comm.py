"""Native NCCL communicator of the C++ extension (``ulysses_kernels._C``).

It implements the ``ulysses_kernels.comm.Communicator`` interface with NCCL called directly:

* ``all_to_all``: per-peer split sizes, one ``ncclGroupStart``/``ncclSend``/``ncclRecv``/
  ``ncclGroupEnd`` group on the *current* CUDA stream (``ncclAlltoAll`` when the linked
  NCCL has it, >= 2.28, and all splits are equal);
* ``send_recv``: all transfers in one NCCL group;
* no host synchronization and no allocation, so both can be captured in a CUDA graph.

The communicator is made from the user's process group: rank 0 creates an ``ncclUniqueId``
(128 bytes), ``torch.distributed.broadcast_object_list`` sends it over the group, then every
rank calls ``ncclCommInitRank`` on its current CUDA device. The ``ncclComm_t`` crosses into
Python as an integer handle owned by the ``NCCLCommunicator`` (``close()`` destroys it).
NCCL errors are raised as ``RuntimeError`` with NCCL's error string and the C++ file:line.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist

from . import _C_loader

__all__ = ["NCCLCommunicator", "default_cuda_comm", "nccl_available"]


def _extension():
    """``_C`` with NCCL, or RuntimeError saying why not."""
    try:
        module = _C_loader.load()
    except ImportError as e:
        raise RuntimeError(f"NCCLCommunicator: the C++ extension is not available ({e})") from e
    if not module.build_info().get("nccl"):
        raise RuntimeError("NCCLCommunicator: ulysses_kernels._C was built without NCCL (no CUDA toolkit or nccl.h at build time)")
    from .kernels import cuda_kernels  # noqa: F401  (registers the fake kernels of the NCCL ops)

    return module


def nccl_available() -> bool:
    """True when the extension has NCCL and a CUDA device is visible."""
    try:
        _extension()
    except RuntimeError:
        return False
    return torch.cuda.is_available()


class _StreamWork:
    """``wait()`` makes the caller's current stream wait for the NCCL work (no host sync)."""

    def __init__(self, device: torch.device):
        self._device = device
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)


class NCCLCommunicator:
    """NCCL collectives over ``group`` on the current CUDA stream.

    Args:
        group: the process group (any backend: it only carries the unique id and the
            ``all_gather_ints`` of the input checks). Default: the world.
        device: the CUDA device of this rank (default: ``torch.cuda.current_device()``).

    Creating it is collective: every rank of ``group`` must create one at the same point.
    Call ``close()`` (or use it as a context manager) to destroy the NCCL communicator.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | int | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("NCCLCommunicator: torch.distributed is not initialized; call init_process_group first")
        if not torch.cuda.is_available():
            raise RuntimeError("NCCLCommunicator: needs a CUDA device, but torch.cuda.is_available() is False")
        ext = _extension()
        self._ext = ext
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        uid = [ext.nccl_unique_id() if self.rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(uid, src=src, group=group, device=self._object_device())
        with torch.cuda.device(self.device):
            self.handle = ext.nccl_comm_init_rank(uid[0], self.world_size, self.rank)

    def _object_device(self):
        return self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def _live(self) -> int:
        if not self.handle:
            raise RuntimeError("NCCLCommunicator: used after close()")
        return self.handle

    def all_to_all(self, output, input, output_splits: Sequence[int], input_splits: Sequence[int], async_op: bool = False):
        torch.ops.ulysses_kernels.nccl_all_to_all(
            self._live(), output, input, [int(s) for s in output_splits], [int(s) for s in input_splits]
        )
        return _StreamWork(output.device) if async_op else None

    def send_recv(self, sends, recvs, async_op: bool = False):
        if sends or recvs:
            torch.ops.ulysses_kernels.nccl_send_recv(
                self._live(), [t for _, t in sends], [int(p) for p, _ in sends], [t for _, t in recvs], [int(p) for p, _ in recvs]
            )
        return _StreamWork(self.device) if async_op else None

    def all_gather_ints(self, values, device):
        from .comm import TorchCommunicator

        return TorchCommunicator(self.group).all_gather_ints(values, device)

    def close(self) -> None:
        """Destroy the NCCL communicator (idempotent)."""
        if self.handle:
            handle, self.handle = self.handle, 0
            self._ext.nccl_comm_destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"NCCLCommunicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, open={bool(self.handle)})"


def default_cuda_comm(group=None) -> NCCLCommunicator | None:
    """A new native NCCL communicator for ``group``, or None where it does not apply.

    Applies when ``group``'s backend is NCCL (so the tensors are on CUDA), the extension has
    NCCL, and ``ULYSSES_KERNELS_NATIVE_NCCL`` is not ``0``. Creating one is collective and
    costs milliseconds, so it is made once by an owner that lives as long as it is used
    (``UlyssesAttention``, ``integrations.hf.apply``), never cached per group in a module
    global. Every rank of the group must call it at the same point.
    """
    if os.environ.get("ULYSSES_KERNELS_NATIVE_NCCL", "1") == "0":
        return None
    if not (dist.is_available() and dist.is_initialized()) or not torch.cuda.is_available():
        return None
    if dist.get_backend(group) != "nccl" or not nccl_available():
        return None
    return NCCLCommunicator(group)
