"""The watchdog of the native NCCL communicator (ulysses_kernels.comm.watchdog), on the CPU.

Everything it touches is a fake: the clock, the work's completion (``done``), NCCL's
asynchronous error and the abort. ``poll()`` is driven by hand with a fake clock; the thread
is exercised on real time with timeouts of a fraction of a second.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ulysses_kernels.comm import Work
from ulysses_kernels.comm.watchdog import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, Watchdog, timeout_from_env


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Fakes:
    """The communicator behind a watchdog: an async-error source and an abort that records."""

    def __init__(self):
        self.error = None
        self.error_polls = 0
        self.aborts = []

    def async_error(self):
        self.error_polls += 1
        return self.error

    def abort(self, why):
        self.aborts.append(why)
        return "The communicator was aborted; make a new one"


def _watchdog(timeout_s=600.0, **kw):
    clock, fakes = _Clock(), _Fakes()
    kw.setdefault("threaded", False)
    wd = Watchdog("comm (rank 2 of 4, cuda:1)", timeout_s, async_error=fakes.async_error, abort=fakes.abort, clock=clock, **kw)
    return wd, clock, fakes


def _post(wd, what, done):
    with wd.posting(what) as item:
        item.done = done
    return item


def test_completed_work_never_fires():
    wd, clock, fakes = _watchdog()
    for i in range(3):
        _post(wd, f"all_to_all {i}", lambda: True)
    assert wd.outstanding == 3  # nothing is dropped before a poll
    clock.now = 10 * DEFAULT_TIMEOUT_S
    assert wd.poll() is None
    assert wd.outstanding == 0 and fakes.aborts == [] and wd.failure is None
    wd.check()  # does not raise
    clock.now += 10 * DEFAULT_TIMEOUT_S
    assert wd.poll() is None and fakes.error_polls == 0  # nothing outstanding: NCCL is not asked


def test_timeout_fires_once_with_a_clear_message():
    wd, clock, fakes = _watchdog(timeout_s=600)
    _post(wd, "all_to_all (96 x torch.float32 in, 96 out)", lambda: False)
    clock.now = 599.0
    assert wd.poll() is None and fakes.aborts == []
    clock.now = 600.5
    failure = wd.poll()
    assert failure is not None and len(fakes.aborts) == 1
    for _ in range(3):
        clock.now += 1000
        assert wd.poll() == failure
    assert len(fakes.aborts) == 1  # aborted once
    with pytest.raises(RuntimeError) as err:
        wd.check()
    msg = str(err.value)
    assert msg.startswith("comm (rank 2 of 4, cuda:1): all_to_all (96 x torch.float32 in, 96 out), posted 600.5 s ago")
    assert f"timeout 600 s, {TIMEOUT_ENV}" in msg and "a peer may have died or hung" in msg
    assert msg.endswith("The communicator was aborted; make a new one")


def test_the_timeout_counts_from_the_last_progress():
    # Two items posted together; the first completes at 500 s: the second is late only 600 s
    # after that (work queued behind long but moving work is not late).
    wd, clock, fakes = _watchdog(timeout_s=600)
    first = {"done": False}
    _post(wd, "first", lambda: first["done"])
    _post(wd, "second", lambda: False)
    clock.now = 500.0
    first["done"] = True
    assert wd.poll() is None and wd.outstanding == 1
    clock.now = 1099.0
    assert wd.poll() is None
    clock.now = 1100.0
    assert wd.poll() is not None and len(fakes.aborts) == 1
    assert "second, posted 1100.0 s ago, has not completed: no progress on this communicator for 600.0 s" in wd.failure


def test_new_work_after_an_idle_spell_starts_its_own_clock():
    wd, clock, fakes = _watchdog(timeout_s=10)
    _post(wd, "early", lambda: True)
    clock.now = 1.0
    assert wd.poll() is None
    clock.now = 1000.0  # idle for long: no work outstanding
    _post(wd, "late", lambda: False)
    clock.now = 1009.0
    assert wd.poll() is None and fakes.aborts == []
    clock.now = 1010.0
    assert wd.poll() is not None


def test_async_error_fires_at_once():
    wd, clock, fakes = _watchdog()
    _post(wd, "send_recv (1 sends, 1 recvs)", lambda: False)
    clock.now = 1.0
    assert wd.poll() is None
    fakes.error = "remote process exited or there was a network error (ncclResult_t 6)"
    clock.now = 2.0
    assert wd.poll() is not None and len(fakes.aborts) == 1
    with pytest.raises(RuntimeError, match=r"NCCL reported an asynchronous error while send_recv \(1 sends, 1 recvs\) was outstanding: remote process exited"):
        wd.check()


def test_a_failing_query_is_a_failure():
    wd, clock, fakes = _watchdog()

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _post(wd, "all_to_all", broken)
    assert wd.poll() is not None and len(fakes.aborts) == 1
    assert "querying whether all_to_all is done failed: CUDA error: an illegal memory access" in wd.failure


def test_a_failing_abort_is_reported_and_the_failure_stands():
    def abort(why):
        raise RuntimeError("ncclCommAbort returned 3")

    clock = _Clock()
    wd = Watchdog("comm", 1.0, async_error=lambda: None, abort=abort, clock=clock, threaded=False)
    with wd.posting("all_to_all") as item:
        item.done = lambda: False
    clock.now = 5.0
    assert wd.poll() is not None
    with pytest.raises(RuntimeError, match=r"comm: all_to_all.*the abort failed too \(RuntimeError: ncclCommAbort returned 3\); restart the job"):
        wd.check()


def test_the_failure_is_published_with_the_abort_it_did():
    # The first GPU run read `failure` while ncclCommAbort was still running and saw the
    # reason without the abort (bench/results/2026-11-27_h200/tests/test_nccl_comm.txt). While
    # the abort runs, `failure` is still None and check() already refuses; once it has
    # returned, `failure` names what it did.
    seen = {}
    clock = _Clock()

    def abort(why):
        seen["failure"] = wd.failure
        with pytest.raises(RuntimeError, match=r"^comm: all_to_all, posted 5.0 s ago, has not completed.*The communicator is being aborted$"):
            wd.check()
        seen["checked"] = True
        return "The communicator was aborted (ncclCommAbort); make a new one"

    wd = Watchdog("comm", 1.0, async_error=lambda: None, abort=abort, clock=clock, threaded=False)
    with wd.posting("all_to_all") as item:
        item.done = lambda: False
    clock.now = 5.0
    failure = wd.poll()
    assert seen == {"failure": None, "checked": True}
    assert failure == wd.failure and "has not completed" in failure and failure.endswith("The communicator was aborted (ncclCommAbort); make a new one")


def test_posting_after_a_failure_raises_and_tracks_nothing():
    wd, clock, fakes = _watchdog(timeout_s=1)
    _post(wd, "all_to_all", lambda: False)
    clock.now = 2.0
    wd.poll()
    launched = []
    with pytest.raises(RuntimeError, match=r"comm \(rank 2 of 4, cuda:1\): all_to_all, posted 2.0 s ago"), wd.posting("next"):
        launched.append(True)
    assert launched == [] and wd.outstanding == 1


def test_a_call_that_raises_is_not_tracked_and_graph_capture_is_not_tracked():
    wd, clock, fakes = _watchdog(timeout_s=1)
    with pytest.raises(ValueError, match="bad splits"), wd.posting("all_to_all"):
        raise ValueError("bad splits")
    with wd.posting("captured", track=False) as item:
        assert item is None
    assert wd.outstanding == 0
    clock.now = 100.0
    assert wd.poll() is None and fakes.aborts == []


def test_work_wait_raises_once_the_communicator_failed():
    wd, clock, fakes = _watchdog(timeout_s=1)
    work = Work(on_wait=wd.check)
    work.wait()  # healthy
    _post(wd, "all_to_all", lambda: False)
    clock.now = 5.0
    wd.poll()
    with pytest.raises(RuntimeError, match=r"has not completed"):
        Work(on_wait=wd.check).wait()
    with pytest.raises(RuntimeError, match=r"has not completed"):
        work.wait()  # every wait checks


def test_close_stops_polling_and_aborting():
    wd, clock, fakes = _watchdog(timeout_s=1)
    _post(wd, "all_to_all", lambda: False)
    wd.close()
    wd.close()  # idempotent
    clock.now = 100.0
    assert wd.poll() is None and fakes.aborts == [] and fakes.error_polls == 0


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"timeout_s expected > 0 seconds, got 0"):
        Watchdog("comm", 0, async_error=lambda: None, abort=lambda why: "")


def test_timeout_from_the_environment():
    assert timeout_from_env({}) == DEFAULT_TIMEOUT_S == 600.0
    assert timeout_from_env({TIMEOUT_ENV: ""}) == DEFAULT_TIMEOUT_S
    assert timeout_from_env({TIMEOUT_ENV: "30"}) == 30.0
    assert timeout_from_env({TIMEOUT_ENV: "0.25"}) == 0.25
    for bad in ("0", "-5", "ten", "inf", "nan"):
        with pytest.raises(ValueError, match=rf"{TIMEOUT_ENV} expected a positive number of seconds, got '{bad}'"):
            timeout_from_env({TIMEOUT_ENV: bad})


# ---- the thread, on real time -----------------------------------------------------------------
def _wait_for(cond, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_thread_aborts_late_work_by_itself_and_then_stops():
    fakes, inits = _Fakes(), []
    wd = Watchdog("comm", 0.2, async_error=fakes.async_error, abort=fakes.abort, thread_init=lambda: inits.append(threading.current_thread()))
    assert wd.poll_s == pytest.approx(0.02)
    assert wd._thread is None  # started by the first posting, not before
    with wd.posting("all_to_all") as item:
        item.done = lambda: False
    assert _wait_for(lambda: wd.failure is not None), "the watchdog did not fire"
    assert len(fakes.aborts) == 1 and inits == [wd._thread] and inits[0] is not threading.current_thread()
    assert _wait_for(lambda: not wd._thread.is_alive())  # nothing left to watch
    wd.close()


def test_the_thread_leaves_completed_work_alone_and_stops_on_close():
    fakes = _Fakes()
    wd = Watchdog("comm", 0.1, async_error=fakes.async_error, abort=fakes.abort)
    for _ in range(5):
        with wd.posting("all_to_all") as item:
            item.done = lambda: True
    assert _wait_for(lambda: wd.outstanding == 0)
    time.sleep(0.5)  # five timeouts with nothing outstanding
    assert wd.failure is None and fakes.aborts == []
    thread = wd._thread
    assert thread.is_alive()  # parked, waiting for work
    wd.close()
    assert not thread.is_alive()


def test_the_abort_waits_for_a_call_being_posted():
    # The abort must not free the communicator under a call that is being posted: it takes
    # the posting lock (waiting up to grace_s), and the call's own check then sees the failure.
    fakes = _Fakes()
    wd = Watchdog("comm", 0.1, async_error=fakes.async_error, abort=fakes.abort, grace_s=30.0)
    with wd.posting("first") as item:
        item.done = lambda: False
    with wd.posting("second") as item:
        time.sleep(0.6)  # the first item times out meanwhile
        assert fakes.aborts == [] and wd.failure is None
        item.done = lambda: False
    assert _wait_for(lambda: len(fakes.aborts) == 1)
    with pytest.raises(RuntimeError, match=r"comm: first, posted"):
        wd.check()
    wd.close()


def test_a_thread_that_cannot_start_fails_the_communicator():
    fakes = _Fakes()

    def init():
        raise RuntimeError("CUDA driver version is insufficient")

    wd = Watchdog("comm", 60, async_error=fakes.async_error, abort=fakes.abort, thread_init=init)
    with wd.posting("all_to_all") as item:
        item.done = lambda: True
    assert _wait_for(lambda: wd.failure is not None)
    with pytest.raises(RuntimeError, match=r"the watchdog could not start \(RuntimeError: CUDA driver version is insufficient\)"):
        wd.check()
    wd.close()


def test_work_with_an_event_checks_before_waiting():
    # The check runs before the event is touched, so it also guards CUDA work (no GPU needed).
    wd, clock, fakes = _watchdog(timeout_s=1)
    _post(wd, "all_to_all", lambda: False)
    clock.now = 2.0
    wd.poll()
    work = Work(event=object(), device=torch.device("cuda", 0), on_wait=wd.check)  # the event is never reached
    with pytest.raises(RuntimeError, match="has not completed"):
        work.wait()
