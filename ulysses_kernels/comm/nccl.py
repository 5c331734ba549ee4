"""Native NCCL communicator of the C++ extension (``ulysses_kernels._C``).

It implements the ``ulysses_kernels.comm.Communicator`` interface with NCCL called directly:

* ``all_to_all``: per-peer split sizes, one ``ncclGroupStart``/``ncclSend``/``ncclRecv``/
  ``ncclGroupEnd`` group on the *current* CUDA stream (``ncclAlltoAll`` when the linked
  NCCL has it, >= 2.28, and all splits are equal);
* ``send_recv``: all transfers in one NCCL group;
* no host synchronization and no device allocation, so both can be captured in a CUDA graph; with
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
  the handle), and the handle is looked up again before every use, so a destroyed group
  raises instead of leaving it dangling. With ``ULYSSES_KERNELS_NATIVE_NCCL=1`` the
  functional ``ulysses_attention``, ``seq_to_head`` and ``head_to_seq`` use this one for
  CUDA tensors (``borrowed_torch_comm``): they have no lifetime to own a communicator
  with, and no global cache per group is kept.

NCCL errors are raised as ``RuntimeError`` with NCCL's error string and the C++ file:line.

Neither kind is watched by torch's watchdog, so each has a watchdog of its own
(``comm/watchdog.py``): work that makes no progress for ``timeout_s``
(``ULYSSES_KERNELS_NCCL_TIMEOUT_S``, default 600 s) or an asynchronous NCCL error aborts the
communicator (ours with ``ncclCommAbort``, torch's through torch), and the next use raises.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .. import extension
from ..tracing import in_trace
from .base import Work, transport
from .torch_dist import TorchCommunicator
from .watchdog import Watchdog, timeout_from_env

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
        module = extension.load()  # also registers the fake kernels of the NCCL ops
    except ImportError as e:
        raise RuntimeError(f"NCCLCommunicator: the C++ extension is not available ({e})") from e
    if not module.build_info().get("nccl"):
        raise RuntimeError("NCCLCommunicator: ulysses_kernels._C was built without NCCL (no CUDA toolkit or nccl.h at build time)")
    return module


def native_nccl_enabled() -> bool:
    """True when ``ULYSSES_KERNELS_NATIVE_NCCL=1``: the defaults (the functional ops' borrowed
    communicator, ``integrations.hf.apply``'s own) use our native NCCL calls. Off by default:
    the native path has run on one GPU at world 1 only (docs/gpu_validation.md: no byte
    crossed a link), and a path that has not run across GPUs is not a default for them;
    torch.distributed's collectives (watched
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
        timeout_s: seconds without progress after which its outstanding NCCL work has
            failed (default: ``ULYSSES_KERNELS_NCCL_TIMEOUT_S``, else 600, torch's default
            for NCCL groups). A watchdog thread then aborts the communicator
            (``ncclCommAbort``: NCCL's kernels return and the GPU stream moves on) and the
            next use, or ``Work.wait()``, raises a ``RuntimeError`` saying what timed out
            (``comm/watchdog.py``). An asynchronous NCCL error does the same at once.

    Creating it is collective: every rank of ``group`` must create one at the same point.
    Call ``close()`` (or use it as a context manager) to destroy the NCCL communicator once
    its work is done. One that is never closed is aborted (not destroyed) when it is garbage
    collected or at interpreter exit: ``ncclCommDestroy`` may wait for work and for peers
    that are gone, ``ncclCommAbort`` does not.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | int | None = None, *, timeout_s: float | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("NCCLCommunicator: torch.distributed is not initialized; call init_process_group first")
        if not torch.cuda.is_available():
            raise RuntimeError("NCCLCommunicator: needs a CUDA device, but torch.cuda.is_available() is False")
        timeout_s = _timeout(timeout_s)  # a bad value fails here, before anything collective
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
            handle = ext.nccl_comm_init_rank(uid[0], self.world_size, self.rank)
        self._own(handle, timeout_s)

    @classmethod
    def borrow(cls, group: dist.ProcessGroup | None = None, device: torch.device | int | None = None, *, timeout_s: float | None = None) -> NCCLCommunicator:
        """Our collectives on torch's own NCCL communicator of ``group`` (default: the world).

        Not collective and cheap (a pointer lookup and three NCCL queries), so it can be
        called per op. torch must have created the communicator already: it does at the
        group's first collective, or at ``init_process_group(device_id=...)``.
        ``RuntimeError`` says why when the group has none to lend.

        It keeps the group and looks torch's communicator up again before every use: a
        group destroyed since (or a communicator torch replaced) raises a ``RuntimeError``
        instead of using a dangling handle. torch's watchdog does not watch our work on its
        communicator, so ours does (``timeout_s`` as for ``NCCLCommunicator``); on a timeout
        or an NCCL error it aborts through torch (``ProcessGroupNCCL.abort()``, the owner's
        own abort: torch's communicators of the group end and the group cannot be used
        again), and the next use raises.
        """
        timeout_s = _timeout(timeout_s)
        ext, device = _extension(), _cuda_device(device)
        return cls._wrap(ext, torch_comm_handle(group, device), group, device, timeout_s)

    @classmethod
    def _wrap(cls, ext, handle: int, group, device: torch.device, timeout_s: float | None = None) -> NCCLCommunicator:
        """A communicator over torch's ``handle`` (not owned), checked to be this rank's."""
        self = cls.__new__(cls)
        self._ext, self.group, self.device = ext, group, device
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
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
        pg = group if group is not None else dist.group.WORLD  # the group object itself: a new world is another group
        torch_group, _ = _torch_nccl_group(pg)
        self.handle, self.owned, self._pg = handle, False, pg
        self._watch = Watchdog(
            self._describe(),
            _timeout(timeout_s),
            async_error=lambda: _borrow_lost(pg, device, handle) or _async_error(ext, handle),
            abort=lambda why: _abort_through_torch(pg, device, handle, torch_group),
            thread_init=_watch_thread_init(ext, device),
        )
        self._finalizer = weakref.finalize(self, _release, ext, 0, self._watch)
        return self

    def _own(self, handle: int, timeout_s: float) -> None:
        ext = self._ext
        self.handle, self.owned, self._pg = handle, True, None
        self._watch = Watchdog(
            self._describe(),
            timeout_s,
            async_error=lambda: _async_error(ext, handle),
            abort=lambda why: _abort_own(ext, handle),
            thread_init=_watch_thread_init(ext, self.device),
        )
        self._finalizer = weakref.finalize(self, _release, ext, handle, self._watch)

    def _describe(self) -> str:
        whose = "its own NCCL communicator" if self.owned else "torch's NCCL communicator of the group, borrowed"
        return f"NCCLCommunicator (rank {self.rank} of {self.world_size}, {self.device}, {whose})"

    def _object_device(self):
        return self.device if transport(self.group) == "nccl" else torch.device("cpu")

    def _live(self) -> int:
        """The handle to post on: raises if closed, if its work has failed (the watchdog),
        or, for a borrowed one, if torch's communicator is no longer the one borrowed."""
        if not self.handle:
            raise RuntimeError("NCCLCommunicator: used after close()")
        self._watch.check()
        if not self.owned:
            lost = _borrow_lost(self._pg, self.device, self.handle)
            if lost is not None:
                raise RuntimeError(
                    f"{self._watch.name}: {lost}. A borrowed communicator is only valid while torch's "
                    "communicator of the group is: borrow again (NCCLCommunicator.borrow) from a live group, "
                    "and keep a group alive until the backward of every call made on it has run"
                )
        return self.handle

    def _post(self, handle: int, what: str, device: torch.device, launch: Callable[[int], None]) -> torch.cuda.Event | None:
        """Run ``launch(handle)`` (host-side NCCL calls on the current stream of ``device``)
        under the watchdog; returns an event recorded after them, or None where nothing is
        watched: inside torch.compile's tracing or a CUDA graph capture the work runs later
        (when the graph does), like torch's own collectives, which its watchdog skips too.
        ``what`` names the work in a timeout's message."""
        if in_trace():
            launch(handle)
            return None
        capturing = torch.cuda.is_current_stream_capturing()
        with self._watch.posting(what, track=not capturing) as item:  # raises if the work has failed
            launch(handle)
            if item is None:
                return None
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            # Queried from the watchdog's thread, whose capture mode is thread-local.
            item.done = event.query
            return event

    def _work(self, event: torch.cuda.Event | None, device: torch.device) -> Work:
        if event is None:
            return Work.after(torch.cuda.current_stream(device), on_wait=self._watch.check)
        return Work(event=event, device=device, on_wait=self._watch.check)

    def all_to_all(self, output, input, output_splits: Sequence[int], input_splits: Sequence[int], async_op: bool = False):
        handle = self._live()
        outs, ins = [int(s) for s in output_splits], [int(s) for s in input_splits]
        event = self._post(
            handle,
            f"all_to_all ({input.numel()} x {input.dtype} in, {output.numel()} out)",
            output.device,
            lambda handle: extension.nccl_all_to_all(handle, output, input, outs, ins),
        )
        return self._work(event, output.device) if async_op else None

    def send_recv(self, sends, recvs, async_op: bool = False):
        event = None
        if sends or recvs:
            event = self._post(
                self._live(),
                f"send_recv ({len(sends)} sends, {len(recvs)} recvs)",
                self.device,
                lambda handle: extension.nccl_send_recv(
                    handle, [t for _, t in sends], [int(p) for p, _ in sends], [t for _, t in recvs], [int(p) for p, _ in recvs]
                ),
            )
        return self._work(event, self.device) if async_op else None

    def all_gather_ints(self, values, device):
        return TorchCommunicator(self.group).all_gather_ints(values, device)

    def close(self) -> None:
        """Destroy the NCCL communicator (idempotent); a borrowed one is only forgotten.

        The watchdog stops first. A communicator the watchdog aborted is not destroyed
        again (the abort freed it)."""
        if self._finalizer.detach() is None:
            self.handle = 0
            return
        handle, self.handle = self.handle, 0
        self._watch.close()
        if self.owned and self._watch.failure is None:
            self._ext.nccl_comm_destroy(handle)

    @property
    def failure(self) -> str | None:
        """Why its work failed (a timeout or an NCCL error the watchdog saw), or None."""
        return self._watch.failure

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (
            f"NCCLCommunicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
            f"open={bool(self.handle)}, owned={self.owned}, failed={self._watch.failure is not None})"
        )


def _timeout(timeout_s: float | None) -> float:
    if timeout_s is None:
        return timeout_from_env()
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise ValueError(f"NCCLCommunicator: timeout_s expected a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


_NCCL_SUCCESS, _NCCL_IN_PROGRESS = 0, 7  # ncclResult_t values that are not errors


def _async_error(ext, handle: int) -> str | None:
    code, message = ext.nccl_comm_async_error(handle)
    return None if code in (_NCCL_SUCCESS, _NCCL_IN_PROGRESS) else f"{message} (ncclResult_t {code})"


def _abort_own(ext, handle: int) -> str:
    ext.nccl_comm_abort(handle)
    return (
        "The communicator was aborted (ncclCommAbort), which ends its NCCL kernels so the GPU stream moves on; "
        "the results of its pending work are invalid. Make a new NCCLCommunicator on every rank of the group, "
        "or restart the job"
    )


def _abort_through_torch(pg, device: torch.device, handle: int, torch_group) -> str:
    """Abort torch's communicator the way its owner does: torch's ``abort()`` of the group's
    NCCL process group (torch then knows, and fails its own work on it, instead of holding a
    communicator we freed)."""
    lost = _borrow_lost(pg, device, handle)
    if lost is not None:
        return f"Nothing was aborted ({lost})"
    abort = getattr(torch_group, "abort", None)
    if abort is None:
        return (
            f"torch {torch.__version__} has no ProcessGroupNCCL.abort(), so nothing was aborted: torch's own "
            "timeout (init_process_group(timeout=...)) catches its collectives queued behind ours; restart the job"
        )
    abort()
    return (
        "torch's NCCL communicators of the group were aborted through torch (ProcessGroupNCCL.abort()), which ends "
        "their kernels so the GPU stream moves on; the results of pending work are invalid and the group cannot be "
        "used any more: restart the job (or destroy the group and make a new one on every rank)"
    )


def _watch_thread_init(ext, device: torch.device) -> Callable[[], None]:
    def init() -> None:
        torch.cuda.set_device(device)  # the watchdog's own thread: the queries' device
        ext.cuda_thread_capture_mode_local()  # its event queries must not break a graph capture elsewhere

    return init


def _release(ext, handle: int, watch: Watchdog) -> None:
    """The finalizer of an ``NCCLCommunicator`` that was never closed: stop its watchdog and,
    if it owns its communicator (``handle`` non-zero) and the watchdog has not already
    aborted it, abort it. Abort, not destroy: this runs at garbage collection or at
    interpreter exit, where ``ncclCommDestroy`` could block on unfinished work or on peers
    that have already exited, and a finalizer must not hang the process."""
    watch.close()
    if handle and watch.failure is None:
        # At exit CUDA may already be failing; there is nobody left to tell.
        with contextlib.suppress(RuntimeError):
            ext.nccl_comm_abort(handle)


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


def _torch_nccl_group(pg) -> tuple[object | None, str]:
    """``(group, "")``: torch's ``ProcessGroupNCCL`` of the process group ``pg``;
    ``(None, why)`` where it has none."""
    try:
        cuda_pg = pg._get_backend(torch.device("cuda"))  # torch's name for the transport's group
    except RuntimeError as e:
        return None, f"the group has no CUDA transport ({e})"
    if not isinstance(cuda_pg, getattr(dist, "ProcessGroupNCCL", ())) or not hasattr(cuda_pg, "_comm_ptr"):
        return None, (
            f"the group's CUDA transport expected ProcessGroupNCCL with _comm_ptr() (torch >= 2.9), got {type(cuda_pg).__name__} (torch {torch.__version__})"
        )
    return cuda_pg, ""


def _lookup_handle(group, device: torch.device) -> tuple[int, str]:
    """``(handle, "")``: the ``ncclComm_t`` of torch's ``ProcessGroupNCCL`` for ``group`` on
    ``device``; ``(0, why)`` where the group has none to lend."""
    torch_group, why = _torch_nccl_group(group if group is not None else dist.group.WORLD)
    if torch_group is None:
        return 0, why
    with torch.cuda.device(device):
        handle = int(torch_group._comm_ptr())
    if handle == 0:
        return 0, (
            f"torch has not created the group's NCCL communicator on {device} yet "
            "(it does at the group's first collective, or at init_process_group(device_id=...))"
        )
    return handle, ""


def _borrow_lost(pg, device: torch.device, handle: int) -> str | None:
    """Why torch's communicator ``handle``, borrowed from the process group ``pg``, can no
    longer be used (the group destroyed, or torch's communicator replaced), or None.

    A destroyed group's communicator is freed (or, for a new group, its address reused),
    so the handle is checked against a fresh lookup, never used on trust."""
    if not (dist.is_available() and dist.is_initialized()):
        return "torch.distributed is no longer initialized (destroy_process_group was called), so torch's communicator is gone"
    try:
        dist.get_backend(pg)
    except ValueError:
        return "the process group it was borrowed from has been destroyed, so torch's communicator is gone"
    now, why = _lookup_handle(pg, device)
    if now != handle:
        return (
            f"torch's communicator of the group on {device} is no longer the one borrowed "
            f"(0x{handle:x} then, {f'0x{now:x}' if now else 'none'} now{': ' + why if why else ''})"
        )
    return None


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
