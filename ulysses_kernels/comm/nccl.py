"""Native NCCL communicator of the C++ extension (``ulysses_kernels._C``).

It implements the ``ulysses_kernels.comm.Communicator`` interface with NCCL called directly:

* ``all_to_all``: per-peer split sizes, one ``ncclGroupStart``/``ncclSend``/``ncclRecv``/
  ``ncclGroupEnd`` group on the *current* CUDA stream (``ncclAlltoAll`` when the linked
  NCCL has it, >= 2.28, and all splits are equal);
* ``send_recv``: all transfers in one NCCL group;
* no host synchronization and no allocation, so both can be captured in a CUDA graph; with
  ``async_op=True`` they return a ``Work`` whose ``wait()`` makes the caller's current
  stream wait for the NCCL work on the GPU.

There are two ways to get one:

* ``NCCLCommunicator(group)`` makes a communicator of its own from the user's process
  group (of any transport): rank 0 creates an ``ncclUniqueId`` (128 bytes),
  ``torch.distributed.broadcast_object_list`` sends it over the group, then every rank
  calls ``ncclCommInitRank`` on its current CUDA device. The ``ncclComm_t`` crosses into
  Python as an integer handle owned by the ``NCCLCommunicator`` (``close()`` destroys it).
  Owners that live as long as they are used make this kind: ``integrations.hf.apply``
  (one for the model), or a user who passes one to every ``UlyssesAttention`` layer (the
  module makes none). A communicator of its own does not queue behind the group's
  other collectives (FSDP's all-gathers, say): NCCL runs the work of one communicator in
  order, whatever the streams.
* ``NCCLCommunicator.borrow(group)`` drives torch's own communicator of an NCCL process
  group (``ProcessGroupNCCL._comm_ptr()``) with our calls. Nothing is created, so it costs
  no collective, no memory and no setup; torch keeps ownership (``close()`` only forgets
  the handle). The functional ``ulysses_attention``, ``seq_to_head`` and ``head_to_seq``
  use this one by default for CUDA tensors (``borrowed_torch_comm``): they have no
  lifetime to own a communicator with, and no global cache per group is kept.

NCCL errors are raised as ``RuntimeError`` with NCCL's error string and the C++ file:line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import ops
from .base import Work, transport
from .torch_dist import TorchCommunicator

__all__ = [
    "NCCLCommunicator",
    "borrowed_torch_comm",
    "default_cuda_comm",
    "native_nccl_enabled",
    "nccl_available",
    "torch_comm_handle",
]


def _extension():
    """``_C`` with NCCL, or RuntimeError saying why not."""
    try:
        module = ops.load()  # also registers the fake kernels of the NCCL ops
    except ImportError as e:
        raise RuntimeError(f"NCCLCommunicator: the C++ extension is not available ({e})") from e
    if not module.build_info().get("nccl"):
        raise RuntimeError("NCCLCommunicator: ulysses_kernels._C was built without NCCL (no CUDA toolkit or nccl.h at build time)")
    return module


def native_nccl_enabled() -> bool:
    """True when ``ULYSSES_KERNELS_NATIVE_NCCL=1``: the defaults (the functional ops' borrowed
    communicator, ``integrations.hf.apply``'s own) use our native NCCL calls. Off by default:
    the native path has not yet run on a GPU (docs/gpu_validation.md), and a path that has
    never run on a GPU is never a default on CUDA; torch.distributed's collectives (watched
    by torch's watchdog and timeout) are. Passing ``comm=NCCLCommunicator(group)`` opts in
    per call. Set it alike on every rank."""
    return os.environ.get("ULYSSES_KERNELS_NATIVE_NCCL", "0") == "1"


def nccl_available() -> bool:
    """True when the extension has NCCL and a CUDA device is visible."""
    try:
        _extension()
    except RuntimeError:
        return False
    return torch.cuda.is_available()


class NCCLCommunicator:
    """NCCL collectives over ``group`` on the current CUDA stream.

    Args:
        group: the process group (any transport: it only carries the unique id and the
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
        self.device = _cuda_device(device)
        uid = [ext.nccl_unique_id() if self.rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(uid, src=src, group=group, device=self._object_device())
        with torch.cuda.device(self.device):
            self.handle = ext.nccl_comm_init_rank(uid[0], self.world_size, self.rank)
        self.owned = True

    @classmethod
    def borrow(cls, group: dist.ProcessGroup | None = None, device: torch.device | int | None = None) -> NCCLCommunicator:
        """Our collectives on torch's own NCCL communicator of ``group`` (default: the world).

        Not collective and cheap (a pointer lookup and three NCCL queries), so it can be
        called per op. torch must have created the communicator already: it does at the
        group's first collective, or at ``init_process_group(device_id=...)``.
        ``RuntimeError`` says why when the group has none to lend.
        """
        ext, device = _extension(), _cuda_device(device)
        return cls._wrap(ext, torch_comm_handle(group, device), group, device)

    @classmethod
    def _wrap(cls, ext, handle: int, group, device: torch.device) -> NCCLCommunicator:
        """A communicator over torch's ``handle`` (not owned), checked to be this rank's."""
        self = cls.__new__(cls)
        self._ext, self.group, self.device = ext, group, device
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.handle, self.owned = handle, False
        # A wrong pointer would crash inside NCCL: check that it is this rank's
        # communicator of this group on this device (this also waits out a nonblocking
        # communicator's initialization).
        actual = tuple(ext.nccl_comm_info(handle))
        expected = (self.world_size, self.rank, device.index)
        if actual != expected:
            raise RuntimeError(
                f"NCCLCommunicator.borrow: torch's communicator (nranks, rank, device) expected {expected} "
                f"(the group's size, this rank, the current CUDA device), got {actual}"
            )
        return self

    def _object_device(self):
        return self.device if transport(self.group) == "nccl" else torch.device("cpu")

    def _live(self) -> int:
        if not self.handle:
            raise RuntimeError("NCCLCommunicator: used after close()")
        return self.handle

    def all_to_all(self, output, input, output_splits: Sequence[int], input_splits: Sequence[int], async_op: bool = False):
        torch.ops.ulysses_kernels.nccl_all_to_all(
            self._live(), output, input, [int(s) for s in output_splits], [int(s) for s in input_splits]
        )
        return Work.after(torch.cuda.current_stream(output.device)) if async_op else None

    def send_recv(self, sends, recvs, async_op: bool = False):
        if sends or recvs:
            torch.ops.ulysses_kernels.nccl_send_recv(
                self._live(), [t for _, t in sends], [int(p) for p, _ in sends], [t for _, t in recvs], [int(p) for p, _ in recvs]
            )
        return Work.after(torch.cuda.current_stream(self.device)) if async_op else None

    def all_gather_ints(self, values, device):
        return TorchCommunicator(self.group).all_gather_ints(values, device)

    def close(self) -> None:
        """Destroy the NCCL communicator (idempotent); a borrowed one is only forgotten."""
        if self.handle:
            handle, self.handle = self.handle, 0
            if self.owned:
                self._ext.nccl_comm_destroy(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (
            f"NCCLCommunicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
            f"open={bool(self.handle)}, owned={self.owned})"
        )


def default_cuda_comm(group=None) -> NCCLCommunicator | None:
    """A new native NCCL communicator for ``group``, or None where it does not apply.

    Applies when ``group``'s transport is NCCL (so the tensors are on CUDA), the extension has
    NCCL, and ``ULYSSES_KERNELS_NATIVE_NCCL`` is not ``0``. Creating one is collective and
    costs milliseconds, so it is made once by an owner that lives as long as it is used
    (``integrations.hf.apply``), never cached per group in a module global. Every rank of
    the group must call it at the same point.
    """
    if not native_nccl_enabled():
        return None
    if not (dist.is_available() and dist.is_initialized()) or not torch.cuda.is_available():
        return None
    if transport(group) != "nccl" or not nccl_available():
        return None
    return NCCLCommunicator(group)


def _cuda_device(device) -> torch.device:
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def _lookup_handle(group, device: torch.device) -> tuple[int, str]:
    """``(handle, "")``: the ``ncclComm_t`` of torch's ``ProcessGroupNCCL`` for ``group`` on
    ``device``; ``(0, why)`` where the group has none to lend."""
    pg = group if group is not None else dist.group.WORLD
    try:
        cuda_pg = pg._get_backend(torch.device("cuda"))  # torch's name for the transport's group
    except RuntimeError as e:
        return 0, f"the group has no CUDA transport ({e})"
    if not isinstance(cuda_pg, getattr(dist, "ProcessGroupNCCL", ())) or not hasattr(cuda_pg, "_comm_ptr"):
        return 0, (
            f"the group's CUDA transport expected ProcessGroupNCCL with _comm_ptr() (torch >= 2.9), "
            f"got {type(cuda_pg).__name__} (torch {torch.__version__})"
        )
    with torch.cuda.device(device):
        handle = int(cuda_pg._comm_ptr())
    if handle == 0:
        return 0, (
            f"torch has not created the group's NCCL communicator on {device} yet "
            "(it does at the group's first collective, or at init_process_group(device_id=...))"
        )
    return handle, ""


def torch_comm_handle(group=None, device: torch.device | int | None = None) -> int:
    """The ``ncclComm_t`` of torch's ``ProcessGroupNCCL`` for ``group`` on ``device``, as an
    integer; ``RuntimeError`` naming the reason where there is none to lend."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("NCCLCommunicator.borrow: torch.distributed is not initialized; call init_process_group first")
    if not torch.cuda.is_available():
        raise RuntimeError("NCCLCommunicator.borrow: needs a CUDA device, but torch.cuda.is_available() is False")
    handle, why = _lookup_handle(group, _cuda_device(device))
    if not handle:
        raise RuntimeError(f"NCCLCommunicator.borrow: {why}")
    return handle


def borrowed_torch_comm(group=None, device: torch.device | None = None) -> NCCLCommunicator | None:
    """torch's own communicator of ``group`` driven natively, or None where that does not
    apply: ``ULYSSES_KERNELS_NATIVE_NCCL=0``, no NCCL in the extension, ``device`` not CUDA,
    the group's CUDA transport not NCCL (gloo, a fake or a wrapped group), or torch not having
    created the communicator yet (before the group's first collective).

    The functional ops call it per call. All ranks of a group answer alike: the conditions
    are the same installation and environment everywhere by contract, and torch creates a
    group's communicator at the same collective on every rank. A rank that used torch's
    all-to-all while its peers used ours would post mismatched NCCL work, so set
    ``ULYSSES_KERNELS_NATIVE_NCCL`` the same on every rank.
    """
    if not native_nccl_enabled():
        return None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        ext = _extension()
    except RuntimeError:  # no extension, or one without NCCL
        return None
    device = _cuda_device(device)
    handle, _ = _lookup_handle(group, device)
    return NCCLCommunicator._wrap(ext, handle, group, device) if handle else None
