"""The communicator interface the attention op talks to, and the one work type it returns.

The op needs three things from a communicator:

* ``all_to_all(output, input, output_splits, input_splits)``: one collective over flat
  1-D buffers, split sizes in elements, peer-major (rank 0's block first);
* ``send_recv(sends, recvs)``: a group of point-to-point transfers posted together
  (one NCCL group; ``batch_isend_irecv`` on gloo and NCCL through torch);
* ``all_gather_ints(values)``: a small host-side exchange used only by the input checks.

``all_to_all`` and ``send_recv`` take ``async_op``; with ``async_op=True`` they return a
``Work``, whose ``wait()`` orders the result before the caller's later work, so a caller
can overlap communication with compute. A communicator of the user's may return any object
with ``wait()``; ours return ``Work``.

The group's *transport* is what torch calls its backend (``"gloo"``, ``"nccl"``):
``transport(group)``. (In this package "backend" means an attention backend.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

__all__ = ["Communicator", "Work", "transport"]


class Work:
    """A started exchange; ``wait()`` orders its result before the caller's later work.

    One type covers every way an exchange can be pending:

    * ``Work()``: nothing to wait for (the exchange ran synchronously);
    * ``works``: handles with ``wait()`` (torch.distributed's ``Work``, or a communicator's
      own), waited in order on the host; ``None`` entries (an exchange that finished when it
      was posted) are skipped;
    * ``event`` with ``device``: a CUDA event recorded after the exchange's work; ``wait()``
      makes the *then* current stream of ``device`` wait for it on the GPU, with no host
      sync (``Work.after(stream)`` records one);
    * ``keep``: tensors referenced until ``wait()`` (buffers the exchange still reads or
      writes, so nothing frees them while it may touch them);
    * ``on_wait``: called first by every ``wait()``; it raises when the communicator's work has
      failed (``NCCLCommunicator``'s watchdog: a timeout or an NCCL error), so the caller
      learns that the result is invalid instead of using it.

    ``wait()`` waits for the event first, then the works. The works and the kept tensors are
    released by the first ``wait()``; the event is kept, so a ``wait()`` from another current
    stream orders that stream too.
    """

    __slots__ = ("_works", "_event", "_device", "_keep", "_on_wait")

    def __init__(
        self,
        works: Iterable = (),
        event: torch.cuda.Event | None = None,
        device: torch.device | None = None,
        keep: Sequence[torch.Tensor] = (),
        on_wait: Callable[[], None] | None = None,
    ):
        if (event is None) != (device is None):
            raise ValueError(
                f"Work: event and device expected together (the CUDA device whose current stream waits on the event), got event={event!r}, device={device!r}"
            )
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"Work: device expected a CUDA device for the event, got {device}")
        self._works = tuple(w for w in works if w is not None)
        self._event = event
        self._device = device
        self._keep = tuple(keep)
        self._on_wait = on_wait

    @classmethod
    def after(cls, stream: torch.cuda.Stream, keep: Sequence[torch.Tensor] = (), on_wait: Callable[[], None] | None = None) -> Work:
        """The work queued on ``stream`` so far: an event recorded on it now."""
        event = torch.cuda.Event()
        event.record(stream)
        return cls(event=event, device=stream.device, keep=keep, on_wait=on_wait)

    def wait(self) -> None:
        if self._on_wait is not None:
            self._on_wait()
        if self._event is not None:
            # The stream that consumes the result waits on the GPU; the host does not.
            torch.cuda.current_stream(self._device).wait_event(self._event)
        works, self._works = self._works, ()
        for work in works:
            work.wait()
        self._keep = ()  # the buffers may go now (on CUDA, record_stream guards them)

    def __repr__(self) -> str:
        return f"Work(works={len(self._works)}, event={self._event is not None}, keep={len(self._keep)})"


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


def transport(group: dist.ProcessGroup | None = None) -> str:
    """The transport of ``group`` (default: the world): ``"gloo"``, ``"nccl"``, ...

    torch's ``dist.get_backend``, under the name this package uses for it."""
    return dist.get_backend(group)
