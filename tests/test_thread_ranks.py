"""The thread-rank fake communicator itself (``ulysses_kernels.testing.thread_ranks``): it
moves the right bytes for all_to_all and send_recv (uneven, empty and self pieces), owns its
receive pieces until ``wait()``, detects mismatched collectives on every rank, aborts the
peers of a failed rank, times out skipped collectives, and orders every reader before the
sender continues on the stream path."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch

from ulysses_kernels.testing import FakeCommError, PeerFailed, ThreadGroup, ThreadRanksFailed


def _piece_values(src, dst, i, n):
    """Values that name their piece: sender, receiver, piece index, position."""
    return src * 1000 + dst * 100 + i * 10 + torch.arange(n, dtype=torch.float32) / 64


# splits[s][d]: elements rank s sends to rank d (uneven, some empty).
A2A_SPLITS = {
    2: [[3, 5], [0, 7]],
    3: [[2, 0, 4], [1, 3, 5], [6, 2, 0]],
}


def _a2a_rank(comm, splits, async_op):
    r, world = comm.rank, comm.world_size
    send = torch.cat([_piece_values(r, d, 0, splits[r][d]) for d in range(world)])
    recv_splits = [splits[s][r] for s in range(world)]
    recv = torch.zeros(sum(recv_splits))
    work = comm.all_to_all(recv, send, recv_splits, splits[r], async_op=async_op)
    if async_op:
        # The collective owns its receive buffer until wait(): a consumer that reads early sees NaN.
        assert recv.isnan().all()
        work.wait()
    return recv


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_fake_all_to_all(world, async_op):
    splits = A2A_SPLITS[world]
    got = ThreadGroup(world, timeout=10).run(_a2a_rank, splits, async_op)
    for r in range(world):
        expected = torch.cat([_piece_values(s, r, 0, splits[s][r]) for s in range(world)])
        assert torch.equal(got[r], expected), f"rank {r}"


def _sr_sizes(s, d):
    """Piece sizes rank s sends to rank d, in order (self-sends included, as NCCL allows)."""
    return [(s + 2 * d + i) % 4 + i for i in range(1 + (s + d) % 3)]


def _send_recv_rank(comm, async_op, self_sends):
    r, world = comm.rank, comm.world_size
    peers = [p for p in range(world) if self_sends or p != r]
    # Interleave the peers' pieces in the lists: matching is per (sender, receiver) pair, in order.
    sends, recvs, mine = [], [], {}
    for i in range(3):
        for p in peers:
            sizes = _sr_sizes(r, p)
            if i < len(sizes):
                sends.append((p, _piece_values(r, p, i, sizes[i])))
            sizes = _sr_sizes(p, r)
            if i < len(sizes):
                mine[(p, i)] = torch.zeros(sizes[i])
                recvs.append((p, mine[(p, i)]))
    work = comm.send_recv(sends, recvs, async_op=async_op)
    if async_op:
        work.wait()
    return mine


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("world,self_sends", [(2, False), (3, False), (3, True)])
def test_fake_send_recv(world, self_sends, async_op):
    got = ThreadGroup(world, timeout=10).run(_send_recv_rank, async_op, self_sends)
    for r in range(world):
        for (s, i), t in got[r].items():
            assert torch.equal(t, _piece_values(s, r, i, t.numel())), f"rank {r}: piece {i} from rank {s}"


def _async_semantics_rank(comm):
    """Rank 0 sends, rank 1 receives; the order of the two wait() calls is forced by events."""
    if comm.rank == 0:
        send = torch.arange(6, dtype=torch.float32)
        work = comm.send_recv([(1, send)], [], async_op=True)
        work.wait()
        send.fill_(-1)  # reused after wait(): the receiver must still get the original values
        comm.all_gather_ints([0], None)  # tell rank 1 it may wait now
        return None
    recv = torch.zeros(6)
    work = comm.send_recv([], [(0, recv)], async_op=True)
    comm.all_gather_ints([1], None)
    assert recv.isnan().all(), "a receive piece must not be written before its receiver's wait()"
    work.wait()
    return recv


def test_fake_async_semantics():
    got = ThreadGroup(2, timeout=10).run(_async_semantics_rank)
    assert torch.equal(got[1], torch.arange(6, dtype=torch.float32))


def _mismatched_splits(comm):
    splits = [[2, 2], [3, 1]] if comm.rank == 0 else [[2, 3], [1, 1]]  # rank 1 expects 3 from rank 0
    send = torch.zeros(sum(splits[comm.rank]))
    recv_splits = [splits[s][comm.rank] for s in range(2)]
    comm.all_to_all(torch.zeros(sum(recv_splits)), send, recv_splits, splits[comm.rank])


def _mismatched_kinds(comm):
    if comm.rank == 0:
        comm.all_to_all(torch.zeros(2), torch.zeros(2), [1, 1], [1, 1])
    else:
        comm.send_recv([(0, torch.zeros(1))], [(0, torch.zeros(1))])


@pytest.mark.parametrize("fn,match", [(_mismatched_splits, "piece 0 from rank 0 to rank 1"), (_mismatched_kinds, "different collectives")])
def test_fake_detects_mismatched_collectives(fn, match):
    with pytest.raises(ThreadRanksFailed, match=match) as info:
        ThreadGroup(2, timeout=10).run(fn)
    # Every rank sees the mismatch itself (the same error everywhere, no hang).
    assert sorted(info.value.errors) == [0, 1]
    assert all(isinstance(e, FakeCommError) for e in info.value.errors.values())


def _rank_0_fails(comm):
    if comm.rank == 0:
        raise ValueError("rank 0 says no")
    comm.all_to_all(torch.zeros(2), torch.zeros(2), [1, 1], [1, 1])


def _rank_0_skips(comm):
    if comm.rank == 1:
        comm.all_to_all(torch.zeros(2), torch.zeros(2), [1, 1], [1, 1])


def test_fake_failure_aborts_peers_and_skipped_collectives_time_out():
    start = time.monotonic()
    with pytest.raises(ThreadRanksFailed, match="(?s)rank 0 raised.*rank 0 says no") as info:
        ThreadGroup(2, timeout=30).run(_rank_0_fails)
    assert isinstance(info.value.errors[1], PeerFailed)
    assert time.monotonic() - start < 10  # aborted, not timed out
    with pytest.raises(ThreadRanksFailed, match="timed out after 0.3 s") as info:
        ThreadGroup(2, timeout=0.3).run(_rank_0_skips)
    assert list(info.value.errors) == [1] and isinstance(info.value.errors[1], TimeoutError)


class _LoggedStreams:
    """A stand-in for the CUDA stream operations on CPU tensors: each rank's "stream" is a
    log of the operations enqueued on it; copies run at once (on the CPU)."""

    def __init__(self):
        self.logs = collections.defaultdict(list)  # thread name -> [(op, event id)]
        self._ids = iter(range(10**9))

    def current(self, device):
        return threading.current_thread().name

    def event(self):
        return {"id": next(self._ids), "recorded_on": None}

    def record(self, event, stream):
        event["recorded_on"] = stream
        self.logs[stream].append(("record", event["id"]))

    def wait(self, stream, event):
        assert event["recorded_on"] is not None, "waiting on an event not yet recorded is a no-op on CUDA"
        self.logs[stream].append(("wait", event["id"], event["recorded_on"]))

    def sleep(self, stream, cycles):
        self.logs[stream].append(("sleep", cycles))


def test_fake_stream_path_orders_every_reader_before_the_sender_continues():
    """The stream path's host logic on CPU tensors: same results as the CPU path, and on each
    rank's stream: wait for the senders' post events -> sleep -> copies -> done, then a wait on
    the done event of every rank that read this rank's sends."""
    ops = _LoggedStreams()
    group = ThreadGroup(3, timeout=10, stream_ops=ops, sleep_cycles=(1, 5))
    got = group.run(_send_recv_rank, False, False)
    for r in range(3):
        for (s, i), t in got[r].items():
            assert torch.equal(t, _piece_values(s, r, i, t.numel()))
    done_of = {}  # (stream, k-th collective) -> done event id
    for stream, log in ops.logs.items():
        records = [e for e in log if e[0] == "record"]
        # Per collective: the post event, the done event, the end event.
        assert len(records) == 3
        done_of[stream] = records[1][1]
    for stream, log in ops.logs.items():
        kinds = [e[0] for e in log]
        assert kinds == ["record", "wait", "wait", "sleep", "record", "wait", "wait", "record"], (stream, log)
        # The two last waits: the other two ranks' done events (every rank reads from every other here).
        waited = {e[1] for e in log[5:7]}
        assert waited == {done_of[s] for s in ops.logs if s != stream}
