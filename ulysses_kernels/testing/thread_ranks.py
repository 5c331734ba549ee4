"""Ranks as threads: a fake communicator that moves real bytes between threads of one process.

``ThreadGroup(world_size)`` runs ``world_size`` "ranks" as Python threads, each with a
``ThreadCommunicator`` that implements the ``ulysses_kernels.comm.Communicator`` interface
(``all_to_all``, ``send_recv``, ``all_gather_ints``) by copying between the threads' tensors.
It lets a test run the attention op's collectives with real data movement where real ranks
cannot: on one GPU (two NCCL ranks on one GPU need NCCL >= 2.30; world size 1 moves
nothing), or on the CPU without spawning processes.

How a test uses it::

    from ulysses_kernels.testing import ThreadGroup

    def rank_fn(comm, case):  # comm: this rank's ThreadCommunicator (comm.rank, comm.world_size)
        torch.set_num_threads(1)  # as on gloo ranks, if results must be bit-exact
        with torch.autograd.set_multithreading_enabled(False):  # see "Autograd" below
            out = ulysses_attention(q, k, v, comm=comm, ...)
            out.backward(dout)
        return out.detach()

    outs = ThreadGroup(2, timeout=30).run(rank_fn, case)  # one result per rank, in rank order

What it checks. The fake is built to be at least as strict as a real collective:

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
  ``wait()`` (snapshotted at the sender's: after that the sender may reuse it). A caller
  that consumed before waiting, or reused a send buffer before waiting, gets NaN or wrong data;
* every collective is matched across ranks by its sequence number and checked (same kind,
  piece counts, sizes and dtypes per sender/receiver pair, contiguous pieces, splits that add
  up): a mismatch raises ``FakeCommError`` on every rank instead of hanging or corrupting.

A rank that raises aborts the group (the others raise ``PeerFailed`` at their next wait);
host waits time out (``TimeoutError``) instead of hanging; ``ThreadGroup.run`` re-raises with
every rank's traceback (``ThreadRanksFailed``, whose ``errors`` maps rank -> exception).

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

import torch

__all__ = ["FakeCommError", "PeerFailed", "ThreadCommunicator", "ThreadGroup", "ThreadRanksFailed"]


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
                        f"piece {i} from rank {s} to rank {d}: sent {a.numel()} x {a.dtype} on {a.device}, received into {b.numel()} x {b.dtype} on {b.device}"
                    )
    return f"{kinds[0]}: " + "; ".join(problems) if problems else None


class ThreadGroup:
    """The hub of ``world_size`` thread ranks (see the module docstring).

    timeout: seconds any host wait may take before the group is aborted with ``TimeoutError``.
    sleep_cycles: ``(lo, hi)``; each stream-path collective sleeps a random number of GPU
        cycles in that range (per-rank generator seeded by ``seed``) before its copies.
    stream_ops: the stream path's operations, an object with ``current(device)`` (the current
        stream), ``event()``, ``record(event, stream)``, ``wait(stream, event)`` and
        ``sleep(stream, cycles)``; default: CUDA's, used for CUDA tensors. A test can pass a
        stand-in to run the stream path's host logic on CPU tensors.
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

    ``before_call``: an optional ``fn(comm)`` run before every data collective is posted (a
    test may churn the caching allocator there, so that a buffer handed out too early shows).
    ``stats``: a ``Counter`` of ``calls``, ``async_calls`` and the bytes received from peers:
    ``bytes_in`` on the CPU path; on the stream path split by whether the current stream was
    ``home_stream`` (the rank's main stream, when set): ``bytes_in_home_stream`` and
    ``bytes_in_other_stream``.
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
