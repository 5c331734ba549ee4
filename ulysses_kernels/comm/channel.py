"""``AsyncChannel``: collectives started so that they overlap the caller's compute.

On CUDA a collective runs on a side stream of the channel, ordered by events: the side
stream first waits for the caller's current stream (which filled the send buffer), and the
returned ``Work`` makes the consumer's current stream wait for the side stream; no host
sync. The buffers are ``record_stream``-ed on the side stream, so the caching allocator
cannot hand them out while the collective may still touch them. Elsewhere (gloo on the
CPU) the communicator's own ``async_op=True`` handle is waited, and the buffers are
referenced until ``wait()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .base import Communicator, Work

__all__ = ["AsyncChannel"]


class AsyncChannel:
    """Starts collectives of ``comm`` on ``device`` that overlap with the caller's compute.

    One channel per op call (its side stream is the order its collectives run in).
    """

    def __init__(self, comm: Communicator, device: torch.device):
        self.comm = comm
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def start(self, tensors: Sequence[torch.Tensor], collective: Callable[[bool], object]) -> Work:
        """Run ``collective(async_op)`` (one collective over ``tensors``) asynchronously."""
        if not self.cuda:
            return Work(works=(collective(True),), keep=tensors)
        main = torch.cuda.current_stream(tensors[0].device)
        self.stream.wait_stream(main)  # the pack that filled the send buffer ran on `main`
        with torch.cuda.stream(self.stream):
            collective(False)
            work = Work.after(self.stream, keep=tensors)
        # Memory allocated on `main` and used on the side stream: the allocator must not
        # hand it out again until the side stream's work queued so far has run.
        for t in tensors:
            t.record_stream(self.stream)
        return work
