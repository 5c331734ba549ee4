"""One rank of a sequence-parallel group, emulated in one process: what that rank holds, no peers.

    comm = EmulatedPeers(world_size=8)                     # rank 0 of 8; the peers' blocks: stand-ins
    hf.apply(model, None, comm=comm, check="never")
    batch = hf.shard_batch(ids, comm=comm, check=False)    # rank 0's share of the sequence
    model(**batch.model_inputs()).loss.backward()          # one GPU holds what rank 0 of 8 holds

Every exchange is rank ``rank``'s half of the real one, on the buffers the attention op
allocated for a ``world_size``-way group (the same shapes and bytes): the rank's own block
goes from its send buffer to its receive buffer, as the collective moves it, and each peer's
block of the receive buffer is filled in place (no allocation):

* ``peers=None`` (stand-ins): with a copy of the rank's own block, repeated or cut to the
  peer block's size (``all_to_all``), or of what this rank sends that peer (``send_recv``):
  finite values of the right dtype and magnitude; results are not those of a real group;
* ``peers=PeerRecording`` (replay): the blocks a real rank received, recorded call by call by
  ``RecordingCommunicator`` around that rank's communicator; the emulated rank then computes
  what the real one did, bit for bit (tests/test_longctx_emulated.py: rank 0 of 4 gloo ranks).

What it is not: no byte crosses a link, so a step's time has no communication in it, and no
NCCL buffer exists (NCCL allocates outside torch's caching allocator: not in
``max_memory_allocated`` on a real group either, but in the GPU's memory).
``all_gather_ints`` (the cross-rank input checks) has no peers to ask and raises: pass
``check="never"`` to ``hf.apply`` and ``check=False`` to ``hf.shard_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Work

__all__ = ["EmulatedPeers", "EmulationError", "PeerRecording", "RecordingCommunicator"]


class EmulationError(RuntimeError):
    """An emulated exchange that cannot stand for the real one (a replay out of step, a check
    that needs peers)."""


@dataclass
class PeerRecording:
    """The peers' blocks one real rank received, one entry per exchange in call order:
    ``("all_to_all", [block of peer p, or None for the rank itself])`` or
    ``("send_recv", [(peer, tensor) per receive])``; CPU clones."""

    rank: int
    world_size: int
    calls: list = field(default_factory=list)


class RecordingCommunicator:
    """``inner`` (a real rank's communicator), recording what each exchange brought from the
    peers into ``recording``. Exchanges run synchronously (``async_op`` returns a finished
    ``Work``): a recording run is a reference, not a timing."""

    def __init__(self, inner):
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.recording = PeerRecording(inner.rank, inner.world_size)

    def all_to_all(self, output, input, output_splits, input_splits, async_op=False):
        self.inner.all_to_all(output, input, output_splits, input_splits, async_op=False)
        blocks = output.split(list(output_splits))
        self.recording.calls.append(("all_to_all", [None if p == self.rank else b.detach().cpu().clone() for p, b in enumerate(blocks)]))
        return Work() if async_op else None

    def send_recv(self, sends, recvs, async_op=False):
        self.inner.send_recv(sends, recvs, async_op=False)
        self.recording.calls.append(("send_recv", [(p, t.detach().cpu().clone()) for p, t in recvs]))
        return Work() if async_op else None

    def all_gather_ints(self, values, device):
        return self.inner.all_gather_ints(values, device)


def _fill_cyclic(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` (flat) filled with ``src`` (flat) repeated and cut to length, in place; zeros
    when ``src`` is empty."""
    n, m = dst.numel(), src.numel()
    if m == 0:
        dst.zero_()
        return
    for start in range(0, n, m):
        k = min(m, n - start)
        dst[start : start + k].copy_(src[:k])


class EmulatedPeers:
    """Rank ``rank`` of a ``world_size``-way group in one process (``ulysses_kernels.comm.
    Communicator``); the peers' blocks are stand-ins, or replayed from ``peers`` (a
    ``PeerRecording`` of the same rank and group size)."""

    def __init__(self, world_size: int, rank: int = 0, peers: PeerRecording | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"EmulatedPeers: world_size expected a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"EmulatedPeers: rank expected an int in [0, {world_size}), got {rank!r}")
        if peers is not None and (peers.rank, peers.world_size) != (rank, world_size):
            raise ValueError(f"EmulatedPeers: the recording is of rank {peers.rank} of {peers.world_size}, expected rank {rank} of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.peers = peers
        self.calls = 0  # exchanges so far (the replay's position)

    def _recorded(self, kind: str):
        if self.peers is None:
            return None
        if self.calls >= len(self.peers.calls):
            raise EmulationError(f"EmulatedPeers: exchange {self.calls} ({kind}) but the recording holds {len(self.peers.calls)}")
        got_kind, blocks = self.peers.calls[self.calls]
        if got_kind != kind:
            raise EmulationError(f"EmulatedPeers: exchange {self.calls} is {kind} here, {got_kind} in the recording")
        return blocks

    def all_to_all(self, output, input, output_splits, input_splits, async_op=False):
        if len(output_splits) != self.world_size or len(input_splits) != self.world_size:
            raise EmulationError(f"EmulatedPeers: all_to_all split lists expected {self.world_size} entries, got {len(output_splits)} and {len(input_splits)}")
        r = self.rank
        if output_splits[r] != input_splits[r]:
            raise EmulationError(f"EmulatedPeers: rank {r}'s own block is {input_splits[r]} elements sent, {output_splits[r]} received")
        outs, ins = output.split(list(output_splits)), input.split(list(input_splits))
        recorded = self._recorded("all_to_all")
        outs[r].copy_(ins[r])  # the rank's own block, as the collective moves it
        for p, block in enumerate(outs):
            if p == r:
                continue
            if recorded is None:
                _fill_cyclic(block, outs[r])
            else:
                self._replay(block, recorded[p], f"all_to_all block of peer {p}")
        self.calls += 1
        return Work() if async_op else None

    def send_recv(self, sends, recvs, async_op=False):
        recorded = self._recorded("send_recv")
        if recorded is not None and len(recorded) != len(recvs):
            raise EmulationError(f"EmulatedPeers: exchange {self.calls} receives {len(recvs)} tensors, the recording {len(recorded)}")
        to_peer: dict[int, torch.Tensor] = {}
        for p, t in sends:
            to_peer.setdefault(p, t)
        for i, (p, t) in enumerate(recvs):
            if recorded is None:
                src = to_peer.get(p)
                _fill_cyclic(t.view(-1), src.reshape(-1) if src is not None else t.new_empty(0))
            else:
                if recorded[i][0] != p:
                    raise EmulationError(f"EmulatedPeers: exchange {self.calls} receive {i} is from peer {p}, recorded from {recorded[i][0]}")
                self._replay(t, recorded[i][1], f"send_recv receive {i} from peer {p}")
        self.calls += 1
        return Work() if async_op else None

    def _replay(self, dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise EmulationError(
                f"EmulatedPeers: exchange {self.calls}, {what}: the buffer is {dst.dtype} {list(dst.shape)}, the recording {src.dtype} {list(src.shape)}"
            )
        dst.copy_(src)

    def all_gather_ints(self, values, device):
        raise EmulationError(
            "EmulatedPeers: a cross-rank check (all_gather_ints) has no peers to ask in an emulated group; "
            "pass check='never' to hf.apply / ulysses_attention and check=False to hf.shard_batch"
        )
