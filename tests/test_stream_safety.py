"""Stream safety of the chunked pipeline with real data movement: ranks as threads.

``ThreadGroup(world)`` runs ``world`` "ranks" as Python threads of this process, each with a
``ThreadCommunicator`` that implements the ``ulysses_kernels.comm`` interface by copying
between the threads' tensors. On one GPU this is the only way here to make the pipeline's
side-stream collectives move bytes (two NCCL ranks on one GPU need NCCL >= 2.30; world size 1
moves nothing). The fake is built to be at least as strict as a real collective:

* a collective owns its receive pieces from post to completion: the fake fills them with NaN
  when it starts, so a consumer that reads too early sees NaN, not stale or correct data;
* CUDA (the pipeline calls with ``async_op=False`` on its side stream): each rank records an
  event on its *current* stream at post time; once every rank has posted (host wait), each
  rank enqueues on its current stream: wait for the events of the ranks it reads from, NaN
  into its receive pieces, ``torch.cuda._sleep`` (a random GPU-side delay that widens race
  windows), copies from the peers' send buffers, a "done" event. Once every reader has
  recorded its done event (second host wait), the sender's current stream waits on them:
  the collective completes on each stream only when its sends were read and its receives
  written, as NCCL's does, so the fake adds no race the real collective would not have;
* CPU (``async_op=True`` handles): a receive piece is written only in its receiver's own
  ``wait()``; a send piece is read at the earlier of its sender's and its receiver's
  ``wait()`` (snapshotted at the sender's: after that the sender may reuse it). A pipeline
  that consumed before waiting, or reused a send buffer before waiting, gets NaN or wrong data;
* every collective is matched across ranks by its sequence number and checked (same kind,
  piece counts, sizes and dtypes per sender/receiver pair, contiguous pieces, splits that add
  up): a mismatch raises ``FakeCommError`` on every rank instead of hanging or corrupting.

A rank that raises aborts the group (the others raise ``PeerFailed`` at their next wait);
host waits time out (``TimeoutError``) instead of hanging; ``ThreadGroup.run`` re-raises with
every rank's traceback.

Autograd: CUDA backward nodes normally run on the engine's one worker thread per device,
where two ranks' backward passes would serialize and deadlock on the first collective; the
ranks run backward under ``torch.autograd.set_multithreading_enabled(False)``, which keeps
it on the calling thread (and on the stream of the forward, as the engine always does).
"""

from __future__ import annotations

import collections
import random
import threading
import time
import traceback

import pytest
import torch

from ulysses_kernels.pipeline import chunk_plans
from ulysses_kernels.plan import HeadPlan


# ---- the fake communicator --------------------------------------------------------------------
class FakeCommError(RuntimeError):
    """The ranks posted collectives that do not match (a real collective would hang or corrupt)."""


class PeerFailed(RuntimeError):
    """Another rank failed or a wait timed out: this rank's collective was abandoned."""


class ThreadRanksFailed(RuntimeError):
    """One or more rank threads raised; ``errors`` maps rank -> exception."""

    def __init__(self, message, errors):
        super().__init__(message)
        self.errors = errors


class _CudaStreams:
    """The stream operations of the fake's stream path, on CUDA."""

    @staticmethod
    def current(device):
        return torch.cuda.current_stream(device)

    @staticmethod
    def event():
        return torch.cuda.Event()

    @staticmethod
    def record(event, stream):
        event.record(stream)

    @staticmethod
    def wait(stream, event):
        stream.wait_event(event)

    @staticmethod
    def sleep(stream, cycles):
        torch.cuda._sleep(cycles)  # on the current stream, which is `stream`


class _Post:
    __slots__ = ("kind", "sends", "recvs", "values", "event", "stream")

    def __init__(self, kind, sends=(), recvs=(), values=None, event=None, stream=None):
        self.kind, self.sends, self.recvs, self.values = kind, list(sends), list(recvs), values
        self.event, self.stream = event, stream


class _Call:
    """One collective, matched across ranks by sequence number."""

    def __init__(self, world):
        self.posts = [None] * world
        self.done = [None] * world  # stream path: each reader's event after its receives
        self.snap = {}  # CPU path: (src, dst, i) -> snapshot of the send piece (None once delivered)
        self.finished = set()
        self.problem = None  # validation result, computed once all posted


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))


def _pairs(posts, src: int, dst: int):
    """``[(i, send piece, recv piece)]`` from ``src`` to ``dst``, matched in posting order."""
    out = [t for p, t in posts[src].sends if p == dst]
    inn = [t for p, t in posts[dst].recvs if p == src]
    return list(zip(range(len(out)), out, inn))


def _mismatch(posts) -> str | None:
    kinds = [p.kind for p in posts]
    if len(set(kinds)) > 1:
        return "ranks posted different collectives at the same step: " + ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
    if kinds[0] == "all_gather_ints":
        lens = [len(p.values) for p in posts]
        return None if len(set(lens)) == 1 else f"all_gather_ints: value counts differ across ranks: {lens}"
    world, problems = len(posts), []
    for s in range(world):
        for d in range(world):
            out = [t for p, t in posts[s].sends if p == d]
            inn = [t for p, t in posts[d].recvs if p == s]
            if len(out) != len(inn):
                problems.append(f"rank {s} sends {len(out)} pieces to rank {d}, which receives {len(inn)} from it")
                continue
            for i, (a, b) in enumerate(zip(out, inn)):
                if a.numel() != b.numel() or a.dtype != b.dtype or a.device != b.device:
                    problems.append(
                        f"piece {i} from rank {s} to rank {d}: sent {a.numel()} x {a.dtype} on {a.device}, "
                        f"received into {b.numel()} x {b.dtype} on {b.device}"
                    )
    return f"{kinds[0]}: " + "; ".join(problems) if problems else None


class ThreadGroup:
    """The hub of ``world_size`` thread ranks (see the module docstring).

    timeout: seconds any host wait may take before the group is aborted with ``TimeoutError``.
    sleep_cycles: ``(lo, hi)``; each stream-path collective sleeps a random number of GPU
        cycles in that range (per-rank generator seeded by ``seed``) before its copies.
    stream_ops: the stream path's operations (default: CUDA's, used for CUDA tensors); a test
        can pass a stand-in to run the stream path's host logic on CPU tensors.
    """

    def __init__(self, world_size, *, timeout=60.0, sleep_cycles=(0, 2_000_000), seed=0, stream_ops=None):
        self.world_size = world_size
        self.timeout = timeout
        self.sleep_cycles = sleep_cycles
        self.seed = seed
        self.stream_ops = stream_ops
        self._cond = threading.Condition()
        self._calls: dict[int, _Call] = {}
        self._error = None

    # ---- host synchronization ----
    def abort(self, why: str) -> None:
        with self._cond:
            if self._error is None:
                self._error = why
            self._cond.notify_all()

    def _await(self, pred, what: str, rank: int) -> None:
        """Wait (holding ``_cond``) until ``pred()``; raise if the group fails or time runs out."""
        deadline = time.monotonic() + self.timeout
        while True:
            if pred():  # first: a rank that aborts after posting lets the others see its post
                return
            if self._error is not None:
                raise PeerFailed(f"rank {rank}: {what}: group aborted ({self._error})")
            left = deadline - time.monotonic()
            if left <= 0:
                self._error = f"rank {rank} timed out after {self.timeout:g} s waiting for {what}"
                self._cond.notify_all()
                raise TimeoutError(f"{self._error} (a rank never posted it: a deadlock or a skipped collective)")
            self._cond.wait(left)

    def _post(self, seq: int, rank: int, post: _Post) -> _Call:
        with self._cond:
            if self._error is not None:
                raise PeerFailed(f"rank {rank}: posting collective {seq}: group aborted ({self._error})")
            call = self._calls.get(seq)
            if call is None:
                call = self._calls[seq] = _Call(self.world_size)
            call.posts[rank] = post
            self._cond.notify_all()
            return call

    def _all_posted(self, seq: int, call: _Call, rank: int) -> None:
        """Wait (holding ``_cond``) for every rank's post, then validate (same answer everywhere)."""
        self._await(lambda: all(p is not None for p in call.posts), f"collective {seq} ({call.posts[rank].kind}) to be posted by every rank", rank)
        if call.problem is None:
            call.problem = _mismatch(call.posts) or ""
        if call.problem:
            raise FakeCommError(f"collective {seq}: {call.problem}")

    def _retire(self, seq: int, call: _Call, rank: int) -> None:
        with self._cond:
            call.finished.add(rank)
            if len(call.finished) == self.world_size:
                self._calls.pop(seq, None)

    # ---- the three kinds of completion ----
    def _finish_host(self, seq, call, rank):
        """all_gather_ints."""
        with self._cond:
            self._all_posted(seq, call, rank)
            values = [list(p.values) for p in call.posts]
        self._retire(seq, call, rank)
        return values

    def _finish_cpu(self, seq, call, rank):
        """A CPU collective's ``wait()``: snapshot what this rank sends, deliver what it receives."""
        with self._cond:
            self._all_posted(seq, call, rank)
            posts = call.posts
            for d in range(self.world_size):
                for i, src, _ in _pairs(posts, rank, d):
                    if (rank, d, i) not in call.snap:
                        call.snap[(rank, d, i)] = src.clone()
            for s in range(self.world_size):
                for i, src, dst in _pairs(posts, s, rank):
                    snap = call.snap.get((s, rank, i))
                    dst.view(-1).copy_((snap if snap is not None else src).view(-1))
                    call.snap[(s, rank, i)] = None  # delivered
        self._retire(seq, call, rank)

    def _finish_streams(self, seq, call, rank, ops, rng):
        """A stream-path collective, enqueued on the rank's current stream (see the module docstring)."""
        mine = call.posts[rank]
        stream = mine.stream
        with self._cond:
            self._all_posted(seq, call, rank)
        posts = call.posts
        incoming = [(s, i, src, dst) for s in range(self.world_size) for i, src, dst in _pairs(posts, s, rank)]
        for s in sorted({s for s, *_ in incoming if s != rank}):
            ops.wait(stream, posts[s].event)  # the sender's pack (and anything before its post) has run
        for _, t in mine.recvs:
            _poison(t)
        lo, hi = self.sleep_cycles
        cycles = rng.randint(lo, hi) if hi > 0 else 0
        if cycles:
            ops.sleep(stream, cycles)
        for _, _, src, dst in incoming:
            if dst.numel():
                dst.view(-1).copy_(src.view(-1))
        done = ops.event()
        ops.record(done, stream)
        readers = sorted({d for d in range(self.world_size) if d != rank and _pairs(posts, rank, d)})
        with self._cond:
            call.done[rank] = done
            self._cond.notify_all()
            self._await(lambda: all(call.done[d] is not None for d in readers), f"collective {seq}: the readers of rank {rank}'s sends", rank)
            theirs = [call.done[d] for d in readers]
        for ev in theirs:
            ops.wait(stream, ev)  # the send pieces may be reused only once every reader has copied them
        end = ops.event()
        ops.record(end, stream)
        self._retire(seq, call, rank)
        return end

    # ---- running ranks ----
    def run(self, fn, *args, join_timeout: float | None = None):
        """``fn(comm, *args)`` on every rank, each in its own thread; returns the results by
        rank, or raises ``ThreadRanksFailed`` with every failed rank's traceback (the first
        failure first) or ``TimeoutError`` when a thread does not finish in ``join_timeout``."""
        world = self.world_size
        results, errors, order = [None] * world, {}, []
        tracebacks = {}

        def body(rank):
            comm = ThreadCommunicator(self, rank)
            try:
                results[rank] = fn(comm, *args)
            except BaseException as exc:  # noqa: BLE001 - reported by the caller
                errors[rank] = exc
                tracebacks[rank] = traceback.format_exc()
                order.append(rank)
                self.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=body, args=(r,), name=f"fake-rank-{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + (join_timeout if join_timeout is not None else 4 * self.timeout)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [r for r, t in enumerate(threads) if t.is_alive()]
        if alive:
            self.abort(f"ranks {alive} did not finish in time")
            for t in threads:
                t.join(5)
            raise TimeoutError(f"ThreadGroup.run: ranks {alive} of {world} did not finish (a hang?)")
        if errors:
            primary = [r for r in order if not isinstance(errors[r], PeerFailed)] or order
            ranks = primary + [r for r in order if r not in primary]
            text = "\n".join(f"-- rank {r} raised:\n{tracebacks[r]}" for r in ranks)
            raise ThreadRanksFailed(f"{len(errors)} of {world} ranks failed\n{text}", errors)
        return results


class _CpuWork:
    def __init__(self, group, seq, call, rank):
        self._args = (seq, call, rank)
        self._group = group

    def wait(self) -> None:
        if self._args is not None:
            args, self._args = self._args, None
            self._group._finish_cpu(*args)


class _StreamWork:
    def __init__(self, ops, event, device):
        self._ops, self._event, self._device = ops, event, device

    def wait(self) -> None:
        self._ops.wait(self._ops.current(self._device), self._event)


class ThreadCommunicator:
    """One rank of a ``ThreadGroup``: ``all_to_all``, ``send_recv``, ``all_gather_ints``.

    ``before_call``: an optional ``fn(comm)`` run before every data collective is posted (the
    GPU test churns the allocator there). ``stats``: bytes received from peers, split by
    whether the current stream was ``home_stream`` (the rank's main stream, when set).
    """

    def __init__(self, group: ThreadGroup, rank: int, before_call=None):
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.before_call = before_call
        self.home_stream = None
        self.stats = collections.Counter()
        self._seq = 0
        self._rng = random.Random(group.seed * 1000 + rank)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _check_pieces(self, what, pieces):
        for p, t in pieces:
            if not 0 <= p < self.world_size:
                raise ValueError(f"rank {self.rank}: {what}: peer {p} out of range for world size {self.world_size}")
            if not t.is_contiguous():
                raise ValueError(f"rank {self.rank}: {what}: a piece for peer {p} is not contiguous (shape {list(t.shape)}, strides {t.stride()})")

    def all_to_all(self, output, input, output_splits, input_splits, async_op=False):
        world = self.world_size
        out_sp, in_sp = [int(x) for x in output_splits], [int(x) for x in input_splits]
        for name, t, sp in (("output", output, out_sp), ("input", input, in_sp)):
            if len(sp) != world or min(sp, default=0) < 0:
                raise ValueError(f"rank {self.rank}: all_to_all: {name}_splits {sp} for world size {world}")
            if t.dim() < 1 or sum(sp) != t.shape[0] or not t.is_contiguous():
                raise ValueError(f"rank {self.rank}: all_to_all: {name} of shape {list(t.shape)} (contiguous={t.is_contiguous()}) does not match splits {sp}")

        def pieces(t, sp):
            offs = [sum(sp[:p]) for p in range(world)]
            return [(p, t.narrow(0, offs[p], sp[p])) for p in range(world)]

        return self._collective("all_to_all", pieces(input, in_sp), pieces(output, out_sp), async_op)

    def send_recv(self, sends, recvs, async_op=False):
        sends, recvs = list(sends), list(recvs)
        self._check_pieces("send_recv sends", sends)
        self._check_pieces("send_recv recvs", recvs)
        return self._collective("send_recv", sends, recvs, async_op)

    def all_gather_ints(self, values, device):
        seq = self._next()
        call = self.group._post(seq, self.rank, _Post("all_gather_ints", values=[int(v) for v in values]))
        return self.group._finish_host(seq, call, self.rank)

    def _collective(self, kind, sends, recvs, async_op):
        if self.before_call is not None:
            self.before_call(self)
        tensors = [t for _, t in sends] + [t for _, t in recvs]
        ops = self.group.stream_ops
        if ops is None and any(t.is_cuda for t in tensors):
            ops = _CudaStreams
        self.stats["calls"] += 1
        self.stats["async_calls"] += bool(async_op)
        off_rank = sum(t.numel() * t.element_size() for p, t in recvs if p != self.rank)
        seq = self._next()
        if ops is None:
            for _, t in recvs:
                _poison(t)  # the collective owns its receive pieces until wait()
            self.stats["bytes_in"] += off_rank
            call = self.group._post(seq, self.rank, _Post(kind, sends, recvs))
            work = _CpuWork(self.group, seq, call, self.rank)
            if async_op:
                return work
            work.wait()
            return None
        device = tensors[0].device if tensors else None
        stream = ops.current(device)
        home = self.home_stream is not None and stream == self.home_stream
        self.stats["bytes_in_home_stream" if home else "bytes_in_other_stream"] += off_rank
        event = ops.event()
        ops.record(event, stream)
        call = self.group._post(seq, self.rank, _Post(kind, sends, recvs, event=event, stream=stream))
        end = self.group._finish_streams(seq, call, self.rank, ops, self._rng)
        return _StreamWork(ops, end, device) if async_op else None


# ---- CPU: the fake itself ---------------------------------------------------------------------
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


# ---- CPU: the op through the fake (chunked == unchunked, bit for bit) -------------------------
def _attention(q, k, v, dout, chunks, comm, lens, causal=True, kernels="torch"):
    """Forward + backward of ``ulysses_attention`` on fresh leaves: ``[out, dq, dk, dv]``."""
    from ulysses_kernels import ulysses_attention

    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    with torch.autograd.set_multithreading_enabled(False):
        out = ulysses_attention(*leaves, causal=causal, seq_lens=lens, attn_fn="sdpa", comm=comm, kernels=kernels, chunks=chunks)
        out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


def _global_inputs(hq, hkv, lens, batch, D, dtype, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(batch, sum(lens), h, D, generator=g, device=device, dtype=dtype) for h in (hq, hkv, hkv, hq)]


def _cpu_attention_rank(comm, case):
    # One intra-op thread per rank, as on gloo ranks (testing.run_ranks): with more, the CPU
    # SDPA kernel's result for a head depends on the heads computed beside it (1 ulp), which
    # breaks chunked == unchunked bit for bit whatever the communicator.
    torch.set_num_threads(1)
    hq, hkv, lens, batch, causal, dtype, chunks = case
    full = _global_inputs(hq, hkv, lens, batch, 8, dtype, seed=hq * 31 + batch)
    off = sum(lens[: comm.rank])
    q, k, v, dout = (x[:, off : off + lens[comm.rank]] for x in full)
    ref = _attention(q, k, v, dout, 1, comm, lens, causal)
    before = comm.stats["async_calls"]
    got = _attention(q, k, v, dout, chunks, comm, lens, causal)
    return ref, got, comm.stats["async_calls"] - before, comm.stats["bytes_in"]


F32, BF16 = torch.float32, torch.bfloat16
CPU_CASES = [
    # (hq, hkv, seq_lens, batch, causal, dtype, chunks)
    (16, 2, (5, 7), 1, True, F32, 3),  # one KV head per rank: SharedKV, KV with the first/last chunk; batch 1: all_to_all
    (12, 4, (6, 4), 2, True, F32, 2),  # two KV groups per rank, batch 2: grouped send/recv
    (8, 1, (4, 5), 2, False, BF16, 4),  # MQA: the KV head on both ranks (replica sums), SharedKV
    (40, 8, (3, 2, 4), 2, True, F32, 3),  # 3 ranks, uneven groups, replicated KV heads
    (6, 2, (3, 2, 4), 1, True, F32, 2),  # 3 ranks: 0 and 2 split one KV head, rank 1 gathers two
    (10, 2, (3, 4, 5, 2), 2, False, F32, 3),  # 4 ranks: shared KV heads, each on two ranks
    (8, 1, (2, 3, 2, 3), 1, True, F32, 2),  # 4 ranks, MQA, batch 1
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{c[0]}-{c[1]}-w{len(c[2])}-b{c[3]}-c{c[6]}")
def test_chunked_equals_unchunked_through_thread_ranks(case):
    from ulysses_kernels.reference import attention_reference

    hq, hkv, lens, batch, causal, dtype, chunks = case
    world = len(lens)
    n = len(chunk_plans(HeadPlan.build(hq, hkv, world), chunks))
    assert n > 1, "the case must actually be chunked"
    threads = torch.get_num_threads()
    try:
        results = ThreadGroup(world, timeout=30).run(_cpu_attention_rank, case)
    finally:
        torch.set_num_threads(threads)
    # The unchunked op through the fake is real attention (so the fake routes correctly) ...
    full = [x.double().requires_grad_(True) for x in _global_inputs(hq, hkv, lens, batch, 8, dtype, seed=hq * 31 + batch)]
    out = attention_reference(*full[:3], causal=causal)
    out.backward(full[3])
    expected = [out.detach()] + [x.grad for x in full[:3]]
    tol = 1e-5 if dtype == F32 else 3e-2
    for r, (ref, got, async_calls, bytes_in) in enumerate(results):
        off = sum(lens[:r])
        for name, a, e in zip(("out", "dq", "dk", "dv"), ref, expected):
            e = e[:, off : off + lens[r]]
            err = (a.double() - e).abs().max().item()
            assert err <= tol * max(1.0, e.abs().max().item()), f"rank {r} {name}: unchunked through the fake is off by {err:.3g}"
        # ... and the chunked op, whose collectives all went through async handles, equals it bit for bit.
        same = [torch.equal(a, b) for a, b in zip(ref, got)]
        assert all(same), f"rank {r}: {case} chunks={chunks}->{n}: out, dq, dk, dv equal = {same}"
        assert async_calls >= 2 * n and bytes_in > 0


# ---- GPU: two (or three) thread ranks on one GPU ------------------------------------------------
# (hq, hkv, seq_lens, batch, head_dim, dtype, chunks)
GPU_CASES = {
    2: [
        (16, 2, (1000, 1048), 1, 128, BF16, 4),  # one KV head per rank: SharedKV
        (12, 4, (700, 1348), 2, 64, BF16, 2),  # two KV groups per rank
        (8, 1, (1536, 512), 2, 64, BF16, 3),  # MQA: the KV head on both ranks, replica sums
        (16, 16, (1536, 2560), 1, 128, BF16, 4),
        (24, 8, (999, 1001), 2, 128, BF16, 4),
        (16, 2, (513, 1535), 2, 64, BF16, 3),
        (12, 4, (2048, 2048), 1, 128, BF16, 2),
        (8, 1, (1000, 1000), 1, 128, BF16, 4),
        (6, 2, (1023, 1025), 2, 64, F32, 3),  # 3 query heads of one KV head per rank
        (24, 8, (1500, 1700), 1, 64, BF16, 3),
    ],
    3: [
        (10, 2, (700, 900, 800), 2, 64, BF16, 3),  # rank 1 straddles two KV groups (gathered)
        (40, 8, (1000, 1100, 1200), 1, 128, BF16, 3),
        (6, 2, (1024, 1024, 1024), 2, 128, BF16, 2),
    ],
}
GPU_ROUNDS = {2: 2, 3: 1}


def _churn(numels, dtype, device):
    """Take blocks from the caching allocator and fill them with NaN: a buffer handed out
    while a collective still used it, or read before its data arrived, would show NaN."""
    junk = [torch.empty(n, dtype=dtype, device=device).fill_(float("nan")) for n in numels if n > 0]
    del junk


def _gpu_rank(comm, cases, rounds, kernel_sets, seed, check_gpu):
    import torch.nn.functional as F

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    # High priority: never one of the (default-priority) pooled side streams of the pipeline.
    main = torch.cuda.Stream(device, priority=-1)
    comm.home_stream = main
    churn = {}

    def before_call(c):  # on the main stream, wherever the collective is posted from
        if churn:
            with torch.cuda.stream(main):
                _churn(churn["numels"], churn["dtype"], device)

    comm.before_call = before_call
    exact = {True: 0, False: 0}
    rank, checked = comm.rank, set()
    with torch.cuda.stream(main):
        for it in range(rounds * len(cases)):
            hq, hkv, lens, B, D, dtype, chunks = case = cases[it % len(cases)]
            kernels = kernel_sets[it % len(kernel_sets)]
            what = f"rank {rank} iteration {it} kernels={kernels} {case}"
            full = _global_inputs(hq, hkv, lens, B, D, dtype, seed=seed + it % len(cases), device=device)
            off = sum(lens[:rank])
            q, k, v, dout = (x[:, off : off + lens[rank]] for x in full)
            S, h = sum(lens), hq + 2 * hkv
            churn.update(numels=[B * S * h * D // c for c in (2, 3, 4, 6, 8, 12)] + [B * lens[rank] * hq * D // c for c in (1, 2, 3)], dtype=dtype)
            ref = _attention(q, k, v, dout, 1, comm, lens, kernels=kernels)
            ref2 = _attention(q, k, v, dout, 1, comm, lens, kernels=kernels)
            _churn(churn["numels"], dtype, device)
            got = _attention(q, k, v, dout, chunks, comm, lens, kernels=kernels)
            for name, xs in (("unchunked", ref), ("unchunked again", ref2), ("chunked", got)):
                for t_name, x in zip(("out", "dq", "dk", "dv"), xs):
                    assert not x.isnan().any(), f"{what}: NaN in the {name} {t_name} (a stream race: data read before it arrived, or a reused buffer)"
            check_gpu(ref, ref2, got, exact, what)
            if case not in checked:  # the fake routes real attention: the unchunked forward vs SDPA on the whole sequence
                checked.add(case)
                qf, kf, vf = (x.float().repeat_interleave(hq // x.shape[2], dim=2).transpose(1, 2) for x in full[:3])
                exp = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True).transpose(1, 2)[:, off : off + lens[rank]]
                err = (ref[0].float() - exp).abs().max().item()
                assert err <= 2e-2 * exp.abs().max().item(), f"{what}: unchunked output off by {err:.3g} from SDPA over the whole sequence"
    main.synchronize()
    comm.before_call = None
    return exact, dict(comm.stats)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_thread_ranks_stream_safety():
    """Two thread ranks on one GPU (then three), each on its own stream: the chunked pipeline's
    side-stream collectives move real bytes between them through the fake, with GPU sleeps
    widening every race window, NaN in every receive piece until its copy lands, and the
    allocator churned with NaN before every collective. Chunked vs unchunked (tolerance of
    ``test_pipeline._check_gpu``), no NaN anywhere, unchunked vs SDPA over the whole sequence."""
    from test_pipeline import _check_gpu  # the tolerance logic of the NCCL stress test
    from ulysses_kernels.kernels import available_kernels

    kernel_sets = [k for k in ("torch", "triton", "cuda") if k in available_kernels()]
    start = time.monotonic()
    lines = []
    for world, cases in GPU_CASES.items():
        # Up to 4M cycles (~2 ms) of GPU sleep before each collective's copies: longer than
        # the attention of a chunk here, so a consumer that does not wait reads NaN.
        group = ThreadGroup(world, timeout=90, sleep_cycles=(0, 4_000_000), seed=world)
        results = group.run(_gpu_rank, cases, GPU_ROUNDS[world], kernel_sets, 1234 + world, _check_gpu, join_timeout=180)
        for rank, (exact, stats) in enumerate(results):
            # The point of the test: the pipeline's side streams moved bytes between the ranks.
            assert stats.get("bytes_in_other_stream", 0) > 0, f"world {world} rank {rank}: no bytes moved off the main stream: {stats}"
            lines.append(
                f"world {world} rank {rank}: {stats['calls']} collectives, {stats.get('bytes_in_other_stream', 0) / 2**20:.1f} MiB "
                f"received on side streams, {stats.get('bytes_in_home_stream', 0) / 2**20:.1f} MiB on the main stream; "
                f"chunked == unchunked bit for bit in {exact[True]} of {exact[True] + exact[False]} tensors"
            )
    print("\n".join(lines) + f"\nkernel sets {kernel_sets}; {time.monotonic() - start:.1f} s")


def _no_sync_rank(comm, cases, kernel_sets, seed):
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    main = torch.cuda.Stream(device, priority=-1)
    outs = []
    with torch.cuda.stream(main):
        for i, (hq, hkv, lens, B, D, dtype, chunks) in enumerate(cases):
            for kernels in kernel_sets:
                full = _global_inputs(hq, hkv, lens, B, D, dtype, seed=seed + i, device=device)
                off = sum(lens[: comm.rank])
                q, k, v, dout = (x[:, off : off + lens[comm.rank]] for x in full)
                outs.append(_attention(q, k, v, dout, chunks, comm, lens, kernels=kernels))
    return outs, main


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_chunked_pipeline_makes_no_host_sync():
    """The chunked forward + backward, warmed up once (kernel tables are built on first use),
    runs with ``torch.cuda.set_sync_debug_mode("error")``: any host sync inside raises."""
    from ulysses_kernels.kernels import available_kernels

    kernel_sets = [k for k in ("torch", "triton", "cuda") if k in available_kernels()]
    cases = [c for c in GPU_CASES[2] if c[5] == BF16][:3]
    ThreadGroup(2, timeout=90, sleep_cycles=(0, 0)).run(_no_sync_rank, cases, kernel_sets, 7, join_timeout=150)
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = ThreadGroup(2, timeout=90, sleep_cycles=(0, 200_000)).run(_no_sync_rank, cases, kernel_sets, 7, join_timeout=150)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for rank, (outs, stream) in enumerate(results):
        stream.synchronize()
        for xs in outs:
            assert not any(x.isnan().any() for x in xs), f"rank {rank}: NaN"
