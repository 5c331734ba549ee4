"""Communicators: how the attention op moves tensors between the ranks of a group.

* ``base``: the ``Communicator`` protocol, ``Work`` (what every asynchronous exchange
  returns) and ``transport(group)`` (gloo, NCCL: what torch calls the group's backend);
* ``torch_dist``: ``TorchCommunicator`` (torch.distributed on the group, whatever its
  transport) and ``LocalCommunicator`` (world size 1, no torch.distributed);
* ``nccl``: ``NCCLCommunicator``, NCCL called directly by the C++ extension, on a
  communicator of its own or on torch's own communicator of the group (borrowed), and
  ``native_nccl_enabled()``, the one reader of ``ULYSSES_KERNELS_NATIVE_NCCL``;
* ``channel``: ``AsyncChannel``, collectives started to overlap the caller's compute;
* ``watchdog``: ``Watchdog``, the timeout of ``NCCLCommunicator``'s work (which torch's
  watchdog does not see): on a timeout or an NCCL error it aborts the communicator, and the
  next use raises;
* ``emulated``: ``EmulatedPeers``, one rank of an N-way group in one process (the peers'
  blocks stand-ins, or replayed from a ``RecordingCommunicator`` of a real rank).

``get_communicator`` picks one for a call.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .base import Communicator, Work, transport
from .channel import AsyncChannel
from .emulated import EmulatedPeers, EmulationError, PeerRecording, RecordingCommunicator
from .nccl import (
    NCCLCommunicator,
    borrowed_torch_comm,
    default_cuda_comm,
    native_nccl_enabled,
    nccl_available,
    torch_comm_handle,
)
from .torch_dist import LocalCommunicator, TorchCommunicator

__all__ = [
    "AsyncChannel",
    "Communicator",
    "EmulatedPeers",
    "EmulationError",
    "LocalCommunicator",
    "NCCLCommunicator",
    "NoProcessGroupError",
    "PeerRecording",
    "RecordingCommunicator",
    "TorchCommunicator",
    "Work",
    "borrowed_torch_comm",
    "default_cuda_comm",
    "get_communicator",
    "native_nccl_enabled",
    "nccl_available",
    "torch_comm_handle",
    "transport",
]


class NoProcessGroupError(RuntimeError):
    """A launcher started several processes but this one has no process group: without
    this error each rank would silently attend over its own shard only."""


def _launched_world_size() -> int:
    """``WORLD_SIZE`` as a launcher (torchrun, the deepspeed launcher, accelerate) sets it; 1 when unset."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def get_communicator(group=None, comm: Communicator | None = None, native: bool = False, device: torch.device | None = None) -> Communicator:
    """The communicator for ``group``: ``comm`` if given; a world of one when there is no
    process group (``NoProcessGroupError`` when a launcher's ``WORLD_SIZE`` says there are
    several processes); with ``native``, a new native NCCL
    communicator where the group is NCCL and the extension has NCCL (the caller owns it:
    making one is collective); with a CUDA ``device`` (the functional ops pass their
    tensors'), torch's own NCCL communicator of the group driven by our native calls where
    it applies (``borrowed_torch_comm``: nothing is created); else torch.distributed's."""
    if comm is not None:
        return comm
    if group is None and not (dist.is_available() and dist.is_initialized()):
        launched = _launched_world_size()
        if launched > 1:
            raise NoProcessGroupError(
                f"ulysses_kernels: WORLD_SIZE={launched} in the environment (a launcher started {launched} processes) but "
                "torch.distributed is not initialized and no group was given, so this rank would attend over its own shard "
                "only. Call torch.distributed.init_process_group() before the first call (or pass group=); for a deliberate "
                "world of one per process, pass comm=ulysses_kernels.comm.LocalCommunicator()"
            )
        return LocalCommunicator()
    if native:
        made = default_cuda_comm(group)
        if made is not None:
            return made
    if device is not None and device.type == "cuda":
        borrowed = borrowed_torch_comm(group, device)
        if borrowed is not None:
            return borrowed
    return TorchCommunicator(group)
