"""A timeout of our own for NCCL work that nobody else watches.

torch's watchdog watches the collectives torch posts; it does not see the work our native
``NCCLCommunicator`` posts (on a communicator of its own, or on torch's borrowed one: torch
documents that work on ``ProcessGroupNCCL._comm_ptr()`` is not watched). Without a watchdog
a dead or desynchronized peer leaves that work pending on the GPU forever, and the first host
sync behind it (``.item()``, a checkpoint, the next torch collective) hangs the job.

``Watchdog`` tracks the work posted on one communicator. While some is outstanding, a daemon
thread polls every ``poll_s`` seconds:

* ``async_error()``: the communicator's asynchronous error (``ncclCommGetAsyncError``);
  a message, or None while it is healthy;
* each work item's ``done()`` (``torch.cuda.Event.query`` of an event recorded after the
  NCCL calls), oldest first: NCCL runs one communicator's work in order, so only the oldest
  outstanding item can be late.

It fails when NCCL reports an error, or when the oldest outstanding item has made no
progress for ``timeout_s`` seconds (measured from when it was posted, or from when the item
before it was seen done, whichever is later: work queued behind long but moving work is not
late). Failing records why and calls ``abort(why)`` once (``ncclCommAbort`` for a
communicator of our own, which makes NCCL's kernels return so the GPU stream frees; torch's
abort of the group for a borrowed one); what ``abort`` returns (what it did and what the user
should do) is part of the message: ``failure`` is set once, to the reason and that outcome,
when the abort has returned (a reader never sees a failure whose abort is still running, as
the first GPU run's test did: bench/results/2026-11-27_h200/tests/test_nccl_comm.txt). From
the moment it fails, ``check()`` (called before every use of the communicator and by
``Work.wait()``) raises a ``RuntimeError`` naming the communicator, the work and the reason
(while the abort runs: that it is being aborted), instead of posting more work that could
never complete.

Everything the watchdog touches comes in as callables (the clock, ``done``, ``async_error``,
``abort``), so its logic runs on the CPU with fakes (tests/test_watchdog.py); ``poll()`` is
one step of the thread and can be driven by hand.

Threads: ``posting()`` (the caller's thread, around the host-side NCCL calls) and the abort
(the watchdog's thread) exclude each other through one lock, so the abort never frees the
communicator under a call that is being posted; the abort waits at most ``grace_s`` for it,
since a host call that is itself stuck (a peer that never connects) is the hang to break.

The thread starts at a communicator's first posting and ends when the communicator is
closed or collected (a borrowed communicator of the functional ops: when its call's
backward has run). NOTE: starting one cost about 0.3 ms on the 2-core build machine (start
and join of a Python thread); it is parked, at no cost, while nothing is outstanding.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "Watchdog", "timeout_from_env"]

TIMEOUT_ENV = "ULYSSES_KERNELS_NCCL_TIMEOUT_S"
# NOTE: 600 s is torch's default timeout for NCCL process groups (10 minutes): a peer that
# is legitimately behind (a checkpoint write, a first step that compiles or autotunes, an
# uneven data loader) must not be taken for dead, and a real hang then costs no more than
# it would on torch's own collectives.
DEFAULT_TIMEOUT_S = 600.0


def timeout_from_env(environ=None) -> float:
    """``ULYSSES_KERNELS_NCCL_TIMEOUT_S`` in seconds (default 600); ValueError if it is not a
    positive number."""
    raw = (os.environ if environ is None else environ).get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} expected a positive number of seconds, got {raw!r}")
    return value


class _Item:
    """One posted piece of work: ``done`` is set once its completion can be queried."""

    __slots__ = ("what", "posted", "done")

    def __init__(self, what: str, posted: float):
        self.what, self.posted = what, posted
        self.done: Callable[[], bool] | None = None


class Watchdog:
    """Times out, and aborts, the work posted on one communicator.

    Args:
        name: the communicator as the error message names it (rank, device, ...).
        timeout_s: seconds without progress after which outstanding work has failed.
        async_error: returns the communicator's asynchronous error as a message, or None.
        abort: called once, with the reason, when the work has failed; returns what it did
            and what the user should do (a sentence for the error message).
        poll_s: seconds between polls (default ``min(0.5, timeout_s / 10)``).
        grace_s: how long the abort waits for a call that is being posted.
        clock: monotonic seconds (a fake clock in tests).
        thread_init: run first on the watchdog's thread (select the CUDA device, the
            thread's capture mode).
        threaded: False to drive ``poll()`` by hand (tests); no thread is started.
    """

    def __init__(
        self,
        name: str,
        timeout_s: float,
        *,
        async_error: Callable[[], str | None],
        abort: Callable[[str], str],
        poll_s: float | None = None,
        grace_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        thread_init: Callable[[], None] | None = None,
        threaded: bool = True,
    ):
        if not timeout_s > 0:
            raise ValueError(f"Watchdog: timeout_s expected > 0 seconds, got {timeout_s!r}")
        self.name, self.timeout_s = name, float(timeout_s)
        self.poll_s = min(0.5, self.timeout_s / 10) if poll_s is None else float(poll_s)
        self.grace_s = grace_s
        self._async_error, self._abort, self._clock = async_error, abort, clock
        self._thread_init, self._threaded = thread_init, threaded
        self._pending: collections.deque[_Item] = collections.deque()
        self._progress = clock()  # when the oldest outstanding item may have started
        self._cond = threading.Condition()  # guards _pending and the thread's start
        self._issue = threading.Lock()  # posting vs the abort
        self._wake = threading.Event()  # close() wakes a sleeping poll loop
        self._thread: threading.Thread | None = None
        self.closed = False
        self.failure: str | None = None  # why, and what the abort did; set once the abort has returned
        self._why: str | None = None  # why, from the moment of failing (check() raises from then on)

    # ---- the communicator's side --------------------------------------------------------
    @contextlib.contextmanager
    def posting(self, what: str, track: bool = True) -> Iterator[_Item | None]:
        """Around the host-side calls that post ``what``: raises first if the work has
        failed; yields the tracked item (set its ``done`` once the work can be queried) or
        None with ``track=False`` (work captured into a CUDA graph runs at replay, later:
        there is nothing to wait for now). A call that raises is not tracked."""
        with self._issue:
            self.check()
            if not track:
                yield None
                return
            item = _Item(what, self._clock())
            with self._cond:
                if not self._pending:
                    self._progress = item.posted
                self._pending.append(item)
                self._start_thread()
                self._cond.notify()
            try:
                yield item
            except BaseException:
                with self._cond, contextlib.suppress(ValueError):
                    self._pending.remove(item)
                raise

    def check(self) -> None:
        """RuntimeError if the work on this communicator has failed."""
        if self.failure is not None:
            raise RuntimeError(f"{self.name}: {self.failure}")
        if self._why is not None:
            raise RuntimeError(f"{self.name}: {self._why}. The communicator is being aborted")

    @property
    def outstanding(self) -> int:
        """How many posted items have not been seen done (as of the last poll)."""
        with self._cond:
            return len(self._pending)

    def close(self) -> None:
        """Stop watching (idempotent): no poll and no abort after this returns, so the
        communicator may be destroyed. Waits for a poll or an abort in progress."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # ---- the watchdog's side ------------------------------------------------------------
    def poll(self) -> str | None:
        """One step: drop the items that are done, then fail on an async error or on an
        item without progress for ``timeout_s``. Returns the failure, if any."""
        if self._why is not None or self.closed:
            return self.failure
        now = self._clock()
        with self._cond:
            oldest = self._pending[0] if self._pending else None
        while oldest is not None:
            try:
                done = oldest.done is not None and bool(oldest.done())
            except Exception as e:  # a failed event query (a CUDA error) is reported, not raised in the thread
                self._fail(f"querying whether {oldest.what} is done failed: {e}")
                return self.failure
            if not done:
                break
            with self._cond:
                self._pending.popleft()
                self._progress = now
                oldest = self._pending[0] if self._pending else None
        if oldest is None or self.closed:
            return None
        try:
            error = self._async_error()
        except Exception as e:  # the query's own failure is a failure too
            error = f"the asynchronous-error query failed: {e}"
        if error is not None:
            self._fail(f"NCCL reported an asynchronous error while {oldest.what} was outstanding: {error}")
        else:
            stalled = now - max(oldest.posted, self._progress)
            if stalled >= self.timeout_s:
                self._fail(
                    f"{oldest.what}, posted {now - oldest.posted:.1f} s ago, has not completed: no progress on "
                    f"this communicator for {stalled:.1f} s (timeout {self.timeout_s:g} s, {TIMEOUT_ENV}); a peer "
                    "may have died or hung, or the ranks posted different collectives"
                )
        return self.failure

    def _fail(self, why: str) -> None:
        got = self._issue.acquire(timeout=self.grace_s)
        try:
            if self._why is not None or self.closed:
                return
            self._why = why  # first, so that a call posted from here on raises
            try:
                outcome = self._abort(why)
            except Exception as e:  # the failure stands; say that the abort failed too
                outcome = f"the abort failed too ({type(e).__name__}: {e}); restart the job"
            self.failure = f"{why}. {outcome}"  # once, complete: what failed and what the abort did
        finally:
            if got:
                self._issue.release()

    def _start_thread(self) -> None:  # with self._cond held
        if self._threaded and self._thread is None and not self.closed:
            self._thread = threading.Thread(target=self._run, name=f"ulysses_kernels watchdog: {self.name}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        if self._thread_init is not None:
            try:
                self._thread_init()
            except Exception as e:  # without its set-up the watchdog cannot poll safely
                self._fail(f"the watchdog could not start ({type(e).__name__}: {e})")
                return
        while True:
            with self._cond:
                while not self.closed and not self._pending:
                    self._cond.wait()
                if self.closed:
                    return
            if self.poll() is not None:
                return
            self._wake.wait(self.poll_s)
