"""The native NCCL communicator (ulysses_kernels.comm.nccl) and the extension's NCCL checks.

Without a GPU: the NCCL version and unique-id calls, the linked-vs-loaded version check,
and clean errors (no crash, no hang) when a communicator cannot be made; on fakes of torch's
NCCL group and of the extension, borrowing, the borrowed handle's check before every use,
the watchdog's abort (ours, or torch's for a borrowed communicator) and the finalizer. With
one GPU: the watchdog on real work at world 1. With one GPU and NCCL >= 2.30: two ranks
share it (NCCL_MULTI_RANK_GPU_ENABLE=1) and run the collectives, a CUDA-graph capture, and
the attention op end to end.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_watchdog import _wait_for  # the same bounded poll as the watchdog's own tests

from ulysses_kernels import extension

pytestmark = pytest.mark.skipif(not (extension.available() and extension.load().build_info().get("nccl")), reason="ulysses_kernels._C without NCCL")


def _torch_nccl():
    """The NCCL this process runs (a carried one ahead of torch's included), not torch's header version."""
    return extension.loaded_nccl_version()


def test_versions_match_torch():
    C = extension.load()
    info = extension.build_info()
    assert info["nccl_header_version"] == _torch_nccl()
    assert info["nccl_runtime_version"] == extension.decode_nccl_version(C.nccl_version()) == _torch_nccl()


def test_loaded_nccl_version_is_the_mapped_librarys():
    """torch.cuda.nccl.version() is torch's header; the version that counts is ncclGetVersion of the file mapped."""
    import ctypes

    libs = extension.nccl_libraries()
    if len(libs) != 1:
        pytest.skip(f"{len(libs)} libnccl files mapped")
    code = ctypes.c_int()
    assert ctypes.CDLL(libs[0]).ncclGetVersion(ctypes.byref(code)) == 0
    assert extension.loaded_nccl_version() == extension.decode_nccl_version(code.value)


def test_decode_nccl_version():
    assert extension.decode_nccl_version(23007) == (2, 30, 7)
    assert extension.decode_nccl_version(2708) == (2, 7, 8)


def test_version_mismatch_is_a_clear_import_error():
    extension.check_nccl_versions((2, 30, 7), (2, 30, 7, "+cuda13"))
    with pytest.raises(ImportError, match=r"built against NCCL 2\.28\.3 but torch .* loaded NCCL 2\.30\.7.*rebuild"):
        extension.check_nccl_versions((2, 28, 3), (2, 30, 7))


def test_unique_id_is_128_fresh_bytes():
    C = extension.load()
    a, b = C.nccl_unique_id(), C.nccl_unique_id()
    assert isinstance(a, bytes) and len(a) == 128 and a != b


def test_bad_arguments_raise_value_errors():
    C = extension.load()
    with pytest.raises(ValueError, match="unique_id expected 128 bytes, got 3"):
        C.nccl_comm_init_rank(b"abc", 1, 0)
    with pytest.raises(ValueError, match=r"rank expected in \[0, 2\), got 2"):
        C.nccl_comm_init_rank(bytes(128), 2, 2)
    with pytest.raises(ValueError, match="handle is 0"):
        C.nccl_comm_destroy(0)


_NO_GPU_SCRIPT = textwrap.dedent(
    """
    import os, re, tempfile
    import torch, torch.distributed as dist
    from ulysses_kernels import extension
    from ulysses_kernels.comm import NCCLCommunicator, default_cuda_comm
    C = extension.load()
    try:
        C.nccl_comm_init_rank(C.nccl_unique_id(), 1, 0)
        raise SystemExit("ncclCommInitRank succeeded without a GPU")
    except RuntimeError as e:
        msg = str(e)
        assert re.search(r"NCCL error at .*module\\.cpp:\\d+: ncclCommInitRank.* returned \\d+ \\(", msg), msg
        print("INIT_ERROR", msg)
    try:
        NCCLCommunicator()
        raise SystemExit("NCCLCommunicator without torch.distributed")
    except RuntimeError as e:
        assert "torch.distributed is not initialized" in str(e), e
    f = tempfile.mktemp()
    dist.init_process_group("gloo", init_method="file://" + f, rank=0, world_size=1)
    try:
        NCCLCommunicator()
        raise SystemExit("NCCLCommunicator without a GPU")
    except RuntimeError as e:
        assert "needs a CUDA device" in str(e), e
    assert default_cuda_comm() is None  # gloo group: the torch communicator stays the default
    dist.destroy_process_group()
    print("OK")
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without a GPU")
def test_without_gpu_communicator_creation_fails_cleanly():
    # In a subprocess with a timeout: a crash or a hang fails the test instead of the suite.
    env = dict(os.environ, NCCL_DEBUG="WARN")
    res = subprocess.run([sys.executable, "-c", _NO_GPU_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK" in res.stdout and "INIT_ERROR" in res.stdout


def test_default_cuda_comm_without_distributed_is_none():
    from ulysses_kernels.comm import default_cuda_comm

    assert default_cuda_comm() is None


# ---- borrowing torch's communicator: the Python side, with stand-ins for torch's NCCL group ----
class _FakeNCCLBackend:
    """Stands in for ProcessGroupNCCL: ``_comm_ptr()`` gives the handle it was made with;
    ``abort()`` (torch's, which the watchdog of a borrowed communicator calls) is counted."""

    def __init__(self, ptr):
        self.ptr, self.aborts = ptr, 0

    def _comm_ptr(self):
        return self.ptr

    def abort(self):
        self.aborts += 1


class _FakeNCCLBackendWithoutAbort(_FakeNCCLBackend):
    abort = None  # an older torch


class _FakeGroup:
    """A process group; ``destroyed = True`` is ``destroy_process_group(group)``."""

    def __init__(self, backend):
        self.backend, self.destroyed = backend, False

    def _get_backend(self, device):
        assert device.type == "cuda"
        return self.backend


class _FakeExt:
    """The extension's NCCL entry points: ``nccl_comm_info`` answers ``info``; init, destroy,
    abort and the watchdog thread's set-up are recorded; ``async_error`` is what
    ``nccl_comm_async_error`` answers."""

    def __init__(self, info):
        self.info, self.destroyed, self.aborted, self.capture_modes = info, [], [], 0
        self.async_error = (0, "no error")

    def nccl_comm_info(self, handle):
        return self.info

    def nccl_comm_init_rank(self, uid, nranks, rank):
        return 0x5EED

    def nccl_comm_destroy(self, handle):
        self.destroyed.append(handle)

    def nccl_comm_abort(self, handle):
        self.aborted.append(handle)

    def nccl_comm_async_error(self, handle):
        return self.async_error

    def cuda_thread_capture_mode_local(self):
        self.capture_modes += 1
        return 0


class _FakeEvent:
    """torch.cuda.Event: ``query()`` answers the class's ``done`` (work on the 'GPU' is done)."""

    done = True
    recorded = 0

    def record(self, stream=None):
        _FakeEvent.recorded += 1

    def query(self):
        return _FakeEvent.done


class _FakeStream:
    waits = 0

    def wait_event(self, event):
        _FakeStream.waits += 1


@pytest.fixture
def fake_cuda_group(monkeypatch):
    """A 'CUDA machine' with an initialized world of 4 where this is rank 2 on cuda:1; returns
    a function ``(ptr, info) -> (group, ext)`` wiring torch's communicator pointer and what
    NCCL says of it. The collectives (``extension.nccl_*``) are recorded in ``ext.posted``, CUDA
    events are ``_FakeEvent``s, and ``NCCLCommunicator(group)`` runs its real constructor
    on the fake extension (handle 0x5EED)."""
    import contextlib

    import torch.distributed as dist

    from ulysses_kernels.comm import nccl

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "done", True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objs, src=0, group=None, device=None: None)

    def get_backend(group=None):
        if getattr(group, "destroyed", False):
            raise ValueError(f"Process group {group} is not initialized in the world group map")
        return "nccl"

    monkeypatch.setattr(dist, "get_backend", get_backend)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCLBackend, raising=False)

    def make(ptr, info=(4, 2, 1), backend=_FakeNCCLBackend):
        ext = _FakeExt(info)
        ext.posted = []
        monkeypatch.setattr(nccl, "_extension", lambda: ext)
        monkeypatch.setattr(nccl, "nccl_available", lambda: True)
        monkeypatch.setattr(extension, "nccl_all_to_all", lambda handle, *args: ext.posted.append(("all_to_all", handle)))
        monkeypatch.setattr(extension, "nccl_send_recv", lambda handle, *args: ext.posted.append(("send_recv", handle)))
        return _FakeGroup(backend(ptr)), ext

    return make


def test_borrow_wraps_torchs_communicator_without_owning_it(fake_cuda_group):
    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)
    comm = NCCLCommunicator.borrow(group)
    assert (comm.handle, comm.rank, comm.world_size, comm.device, comm.owned) == (0xABC0, 2, 4, torch.device("cuda", 1), False)
    comm.close()
    assert comm.handle == 0 and ext.destroyed == []  # torch still owns it
    with pytest.raises(RuntimeError, match=r"used after close"):
        comm.all_to_all(None, None, [], [])


def test_borrow_refuses_a_communicator_that_is_not_this_ranks(fake_cuda_group):
    from ulysses_kernels.comm import NCCLCommunicator

    group, _ = fake_cuda_group(0xABC0, info=(4, 2, 0))
    with pytest.raises(RuntimeError, match=r"\(nranks, rank, device\) expected \(4, 2, 1\).*got \(4, 2, 0\)"):
        NCCLCommunicator.borrow(group)


def test_borrow_before_torch_made_its_communicator_says_so(fake_cuda_group):
    from ulysses_kernels.comm import NCCLCommunicator, borrowed_torch_comm

    group, _ = fake_cuda_group(0)
    with pytest.raises(RuntimeError, match=r"has not created the group's NCCL communicator on cuda:1 yet"):
        NCCLCommunicator.borrow(group)
    assert borrowed_torch_comm(group, torch.device("cuda", 1)) is None  # the functional ops fall back


def test_borrow_from_a_group_without_nccl_says_what_it_got(fake_cuda_group):
    from ulysses_kernels.comm import NCCLCommunicator, borrowed_torch_comm

    fake_cuda_group(0xABC0)
    group = _FakeGroup(object())
    with pytest.raises(RuntimeError, match=r"expected ProcessGroupNCCL with _comm_ptr\(\).*got object"):
        NCCLCommunicator.borrow(group)
    assert borrowed_torch_comm(group, torch.device("cuda", 1)) is None


def test_functional_default_is_torch_and_borrows_only_when_opted_in_for_cuda_tensors(fake_cuda_group, monkeypatch):
    from ulysses_kernels.comm import NCCLCommunicator, TorchCommunicator, get_communicator

    group, _ = fake_cuda_group(0xABC0)
    # Native NCCL has not run on a GPU yet: the default on CUDA is torch.distributed.
    monkeypatch.delenv("ULYSSES_KERNELS_NATIVE_NCCL", raising=False)
    assert isinstance(get_communicator(group, device=torch.device("cuda", 1)), TorchCommunicator)
    monkeypatch.setenv("ULYSSES_KERNELS_NATIVE_NCCL", "0")
    assert isinstance(get_communicator(group, device=torch.device("cuda", 1)), TorchCommunicator)
    monkeypatch.setenv("ULYSSES_KERNELS_NATIVE_NCCL", "1")
    comm = get_communicator(group, device=torch.device("cuda", 1))
    assert isinstance(comm, NCCLCommunicator) and comm.handle == 0xABC0 and not comm.owned
    assert isinstance(get_communicator(group, device=torch.device("cpu")), TorchCommunicator)
    assert isinstance(get_communicator(group), TorchCommunicator)
    mine = object()
    assert get_communicator(group, mine, device=torch.device("cuda", 1)) is mine


# ---- the watchdog and the lifetime of a communicator, on the fakes ------------------------------
class _Buffer:
    """A CUDA buffer as the communicator sees it (the fake collectives never read it)."""

    dtype, device = torch.float32, torch.device("cuda", 1)

    def numel(self):
        return 8


_X = _Buffer()


def test_own_communicator_times_out_aborts_once_and_then_raises(fake_cuda_group, monkeypatch):
    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)
    monkeypatch.setattr(_FakeEvent, "done", False)  # the peers never answer
    comm = NCCLCommunicator(group, timeout_s=0.2)
    assert (comm.handle, comm.owned) == (0x5EED, True)
    work = comm.all_to_all(_X, _X, [2] * 4, [2] * 4, async_op=True)
    assert ext.posted == [("all_to_all", 0x5EED)]
    assert _wait_for(lambda: comm.failure is not None), "the watchdog did not fire"
    assert ext.aborted == [0x5EED] and ext.capture_modes == 1
    expected = (
        r"NCCLCommunicator \(rank 2 of 4, cuda:1, its own NCCL communicator\): all_to_all \(8 x torch.float32 in, 8 out\), "
        r"posted \d+\.\d s ago, has not completed: no progress on this communicator for .* \(timeout 0.2 s, "
        r"ULYSSES_KERNELS_NCCL_TIMEOUT_S\); a peer may have died .* The communicator was aborted \(ncclCommAbort\).*"
        r"Make a new NCCLCommunicator on every rank"
    )
    with pytest.raises(RuntimeError, match=expected):
        comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
    with pytest.raises(RuntimeError, match=expected):
        comm.send_recv([(1, _X)], [(3, _X)])
    with pytest.raises(RuntimeError, match=expected):
        work.wait()
    assert ext.posted == [("all_to_all", 0x5EED)]  # nothing posted on the aborted communicator
    assert "failed=True" in repr(comm)
    comm.close()
    assert ext.destroyed == [] and ext.aborted == [0x5EED]  # the abort freed it: no destroy
    assert not comm._watch._thread.is_alive()


def test_own_communicator_async_error_aborts(fake_cuda_group, monkeypatch):
    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)
    monkeypatch.setattr(_FakeEvent, "done", False)
    with NCCLCommunicator(group, timeout_s=600) as comm:
        comm.send_recv([(1, _X)], [(3, _X)])
        ext.async_error = (6, "remote process exited or there was a network error: socket closed")
        assert _wait_for(lambda: comm.failure is not None)
        assert ext.aborted == [0x5EED]
        expected = r"asynchronous error while send_recv \(1 sends, 1 recvs\) was outstanding: remote process exited.*\(ncclResult_t 6\)"
        with pytest.raises(RuntimeError, match=expected):
            comm.send_recv([(1, _X)], [(3, _X)])
    assert ext.destroyed == []


def test_own_communicator_with_completed_work_is_never_aborted(fake_cuda_group):
    import time

    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)
    ext.async_error = (7, "operation in progress")  # a nonblocking communicator's pending call: not an error
    comm = NCCLCommunicator(group, timeout_s=0.1)
    recorded, waits = _FakeEvent.recorded, _FakeStream.waits
    for _ in range(3):
        comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
        comm.send_recv([(1, _X)], [(3, _X)], async_op=True).wait()
    assert _FakeEvent.recorded - recorded == 6  # one event per call, watched
    assert _FakeStream.waits - waits == 3  # the async work's wait() used the watched event
    assert _wait_for(lambda: comm._watch.outstanding == 0)
    time.sleep(0.5)
    assert comm.failure is None and ext.aborted == []
    thread = comm._watch._thread
    comm.close()
    comm.close()
    assert ext.destroyed == [0x5EED] and ext.aborted == [] and not thread.is_alive()
    with pytest.raises(RuntimeError, match="used after close"):
        comm.all_to_all(_X, _X, [2] * 4, [2] * 4)


def test_work_captured_in_a_cuda_graph_is_not_watched(fake_cuda_group, monkeypatch):
    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    comm = NCCLCommunicator(group, timeout_s=0.1)
    comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
    assert ext.posted == [("all_to_all", 0x5EED)]
    assert comm._watch.outstanding == 0 and comm._watch._thread is None  # it runs at replay
    comm.close()


def test_a_communicator_never_closed_is_aborted_by_its_finalizer(fake_cuda_group):
    import gc

    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)
    comm = NCCLCommunicator(group, timeout_s=60)
    comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
    watch = comm._watch
    assert _wait_for(lambda: watch.outstanding == 0)
    thread = watch._thread
    del comm
    gc.collect()
    # Abort, not destroy: a finalizer (at garbage collection or at exit) must not block.
    assert ext.aborted == [0x5EED] and ext.destroyed == []
    assert watch.closed and not thread.is_alive()


def test_the_finalizer_does_not_abort_twice(fake_cuda_group, monkeypatch):
    import gc

    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)
    monkeypatch.setattr(_FakeEvent, "done", False)
    comm = NCCLCommunicator(group, timeout_s=0.1)
    comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
    watch = comm._watch
    assert _wait_for(lambda: watch.failure is not None)
    del comm
    gc.collect()
    assert ext.aborted == [0x5EED] and ext.destroyed == []


def test_bad_timeout_is_refused_before_anything_collective(fake_cuda_group, monkeypatch):
    import torch.distributed as dist

    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)

    def no_broadcast(*args, **kwargs):
        raise AssertionError("broadcast before the timeout was checked")

    monkeypatch.setattr(dist, "broadcast_object_list", no_broadcast)
    with pytest.raises(ValueError, match=r"timeout_s expected a positive number of seconds, got -1"):
        NCCLCommunicator(group, timeout_s=-1)
    monkeypatch.setenv("ULYSSES_KERNELS_NCCL_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match=r"ULYSSES_KERNELS_NCCL_TIMEOUT_S expected a positive number of seconds, got 'soon'"):
        NCCLCommunicator(group)
    with pytest.raises(ValueError, match=r"ULYSSES_KERNELS_NCCL_TIMEOUT_S"):
        NCCLCommunicator.borrow(group)


def test_borrowed_communicator_checks_torchs_communicator_before_every_use(fake_cuda_group):
    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)
    comm = NCCLCommunicator.borrow(group)
    comm.all_to_all(_X, _X, [2] * 4, [2] * 4)  # the forward
    assert ext.posted == [("all_to_all", 0xABC0)]
    # torch replaced its communicator (a group re-made its NCCL communicator, say):
    group.backend.ptr = 0xDEF0
    expected = (
        r"torch's NCCL communicator of the group, borrowed\): torch's communicator of the group on cuda:1 is no longer "
        r"the one borrowed \(0xabc0 then, 0xdef0 now\).*borrow again"
    )
    with pytest.raises(RuntimeError, match=expected):
        comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
    group.backend.ptr = 0
    with pytest.raises(RuntimeError, match=r"\(0xabc0 then, none now: torch has not created"):
        comm.send_recv([(1, _X)], [(3, _X)])
    # The group destroyed between the forward and the backward: no dangling handle is used.
    group.backend.ptr = 0xABC0
    group.destroyed = True
    with pytest.raises(RuntimeError, match=r"the process group it was borrowed from has been destroyed.*keep a group alive until the backward"):
        comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
    assert ext.posted == [("all_to_all", 0xABC0)]
    comm.close()
    assert ext.destroyed == [] and ext.aborted == [] and group.backend.aborts == 0


def test_borrowed_communicator_times_out_through_torchs_abort(fake_cuda_group, monkeypatch):
    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)
    monkeypatch.setattr(_FakeEvent, "done", False)
    comm = NCCLCommunicator.borrow(group, timeout_s=0.2)
    comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
    assert _wait_for(lambda: comm.failure is not None)
    # torch owns the communicator: the abort is torch's (never ncclCommAbort on its handle).
    assert group.backend.aborts == 1 and ext.aborted == []
    with pytest.raises(RuntimeError, match=r"has not completed.*aborted through torch \(ProcessGroupNCCL.abort\(\)\).*restart the job"):
        comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
    comm.close()
    assert ext.destroyed == [] and group.backend.aborts == 1


def test_borrowed_communicator_on_a_torch_without_abort_says_so(fake_cuda_group, monkeypatch):
    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0, backend=_FakeNCCLBackendWithoutAbort)
    monkeypatch.setattr(_FakeEvent, "done", False)
    comm = NCCLCommunicator.borrow(group, timeout_s=0.2)
    comm.send_recv([(1, _X)], [(3, _X)])
    assert _wait_for(lambda: comm.failure is not None)
    with pytest.raises(RuntimeError, match=r"has no ProcessGroupNCCL.abort\(\), so nothing was aborted: torch's own timeout"):
        comm.send_recv([(1, _X)], [(3, _X)])
    assert ext.aborted == []
    comm.close()


def test_borrowed_communicator_whose_group_dies_with_work_outstanding(fake_cuda_group, monkeypatch):
    from ulysses_kernels.comm import NCCLCommunicator

    group, ext = fake_cuda_group(0xABC0)
    monkeypatch.setattr(_FakeEvent, "done", False)
    comm = NCCLCommunicator.borrow(group, timeout_s=600)
    comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
    group.destroyed = True  # the watchdog sees it at its next poll: nothing left to abort
    assert _wait_for(lambda: comm.failure is not None)
    assert group.backend.aborts == 0 and ext.aborted == []
    assert "has been destroyed" in comm.failure and "Nothing was aborted" in comm.failure
    comm.close()


def test_borrowed_communicators_finalizer_only_stops_its_watchdog(fake_cuda_group, monkeypatch):
    import gc

    from ulysses_kernels.comm import borrowed_torch_comm

    group, ext = fake_cuda_group(0xABC0)
    monkeypatch.setenv("ULYSSES_KERNELS_NATIVE_NCCL", "1")
    comm = borrowed_torch_comm(group, torch.device("cuda", 1))  # a functional call's communicator
    comm.all_to_all(_X, _X, [2] * 4, [2] * 4)
    watch = comm._watch
    thread = watch._thread
    del comm  # what happens to a call's communicator once its backward has run
    gc.collect()
    assert watch.closed and not thread.is_alive()
    assert ext.aborted == [] and ext.destroyed == [] and group.backend.aborts == 0


def _gloo_default_is_torch(rank, world):
    from ulysses_kernels.comm import TorchCommunicator, get_communicator

    assert isinstance(get_communicator(None, device=torch.device("cpu")), TorchCommunicator)
    # A CUDA device on a gloo group: nothing to borrow (no GPU here, and gloo is not NCCL).
    assert isinstance(get_communicator(None, device=torch.device("cuda", 0)), TorchCommunicator)


def test_gloo_groups_keep_torch_distributed():
    from ulysses_kernels.testing import run_ranks

    run_ranks(_gloo_default_is_torch, 2)


# ---- GPU: one rank, and two ranks on one GPU -------------------------------------------------
def _multi_rank_gpu_ok():
    return torch.cuda.is_available() and _torch_nccl() >= (2, 30, 0)


# A hang inside NCCL (ncclCommInitRank, a mismatched collective) blocks no Python timeout;
# run_ranks kills the ranks after this many seconds (its default, 600 s, is a whole
# GPU-session command). Its deadline (this + 30 s) must come before scripts/gpu_session.sh's
# per-test timeout (pytest-timeout, 240 s): a test stopped by pytest-timeout leaves its
# spawned ranks running, and pytest then waits for them at exit.
_GPU_TIMEOUT_S = 180


def _run_ranks_with_timeout(fn, world):
    import inspect

    from ulysses_kernels.testing import run_ranks

    kw = {"timeout_s": _GPU_TIMEOUT_S} if "timeout_s" in inspect.signature(run_ranks).parameters else {}
    run_ranks(fn, world, **kw)


def _ranks_body(rank, world):
    import torch.distributed as dist

    from ulysses_kernels import ulysses_attention
    from ulysses_kernels.comm import NCCLCommunicator
    from ulysses_kernels.testing.reference import attention_reference

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    with NCCLCommunicator(device=0) as comm:
        assert (comm.rank, comm.world_size) == (rank, world)
        # Uneven splits: rank r sends (r + 1) * (p + 1) elements to rank p.
        in_splits = [(rank + 1) * (p + 1) for p in range(world)]
        out_splits = [(p + 1) * (rank + 1) for p in range(world)]
        x = torch.arange(sum(in_splits), device=dev, dtype=torch.float32) + 1000 * rank
        y = torch.full((sum(out_splits),), -1.0, device=dev)
        comm.all_to_all(y, x, out_splits, in_splits)
        expected, off = [], 0
        for p in range(world):
            src_splits = [(p + 1) * (q + 1) for q in range(world)]
            start = sum(src_splits[:rank])
            expected.append(torch.arange(start, start + src_splits[rank], device=dev, dtype=torch.float32) + 1000 * p)
        assert torch.equal(y, torch.cat(expected))
        # Even splits (ncclAlltoAll where available), bf16, async with wait().
        x = torch.randn(world * 1000, device=dev).to(torch.bfloat16)
        y = torch.empty_like(x)
        comm.all_to_all(y, x, [1000] * world, [1000] * world, async_op=True).wait()
        xs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather_object(xs, x.cpu())
        assert torch.equal(y.cpu(), torch.cat([xs[p][rank * 1000 : (rank + 1) * 1000] for p in range(world)]))
        # Grouped send/recv (to the next rank, from the previous one; to itself with one
        # rank), with an empty pair that both sides skip.
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        s, r = torch.full((77,), float(rank), device=dev), torch.empty(77, device=dev)
        e_s, e_r = torch.empty(0, device=dev), torch.empty(0, device=dev)
        comm.send_recv([(nxt, s), (nxt, e_s)], [(prev, r), (prev, e_r)])
        assert torch.equal(r, torch.full_like(r, float(prev)))
        # Nothing to move on this rank: no NCCL call (an all-zero all-to-all).
        comm.all_to_all(e_r, e_s, [0] * world, [0] * world)
        # CUDA graph capture of an all-to-all, replayed on new data.
        x = torch.randn(world * 256, device=dev)
        y = torch.empty_like(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            comm.all_to_all(y, x, [256] * world, [256] * world)  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.all_to_all(y, x, [256] * world, [256] * world)
        x.copy_(torch.full_like(x, float(rank + 1)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.cat([torch.full((256,), float(p + 1), device=dev) for p in range(world)]))
        # The attention op end to end with native NCCL and the fused kernels.
        g = torch.Generator().manual_seed(0)
        seq_lens = (40, 24) if world == 2 else (64,)
        S = sum(seq_lens)
        q, k, v = (torch.randn(2, S, h, 32, generator=g) for h in (6, 2, 2))
        off = sum(seq_lens[:rank])
        shard = [t[:, off : off + seq_lens[rank]].to(dev, torch.float16).requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(*shard, seq_lens=seq_lens, comm=comm, kernels="cuda", attn_fn="sdpa")
        ref = attention_reference(q, k, v, causal=True)[:, off : off + seq_lens[rank]]
        assert (out.double().cpu() - ref).abs().max().item() < 2e-2
        out.float().sum().backward()
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in shard)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_rank_on_one_gpu():
    # Any NCCL version: the communicator, ncclAlltoAll / self send-recv, graph capture and
    # the attention op, on a world of one (where two ranks per GPU are not supported).
    _run_ranks_with_timeout(_ranks_body, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not _multi_rank_gpu_ok(), reason="needs a CUDA GPU and NCCL >= 2.30 (two ranks on one GPU)")
def test_two_ranks_on_one_gpu(monkeypatch):
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")  # read by NCCL in the spawned ranks
    _run_ranks_with_timeout(_ranks_body, 2)


def _borrow_body(rank, world):
    """On an NCCL process group: the functional op's default communicator is torch's own,
    driven by our native calls, and gives the same bits as torch.distributed's."""
    import torch.distributed as dist

    from ulysses_kernels import ulysses_attention
    from ulysses_kernels.comm import NCCLCommunicator, TorchCommunicator, get_communicator

    dev = torch.device("cuda", torch.cuda.current_device())
    calls = []
    originals = {name: getattr(NCCLCommunicator, name) for name in ("all_to_all", "send_recv")}

    def counting(name):
        def call(self, *args, **kwargs):
            calls.append((name, self.owned))
            return originals[name](self, *args, **kwargs)

        return call

    if world == 1:
        # At world 1 the op runs no collective of torch's (no signature exchange), so torch
        # would never create its (lazy) communicator and there would be nothing to borrow.
        dist.all_reduce(torch.zeros(1, device=dev))
    # Native calls per forward + backward: the two sequence-to-head exchanges (a send_recv
    # with no pieces at world 1) and the two head-to-sequence ones (local at world 1: no call).
    n_calls = 4 if world > 1 else 2
    for name in originals:
        setattr(NCCLCommunicator, name, counting(name))
    try:
        g = torch.Generator().manual_seed(1)
        seq_lens = (48, 16) if world == 2 else (64,)
        S, off = sum(seq_lens), sum(seq_lens[:rank])
        q, k, v = (torch.randn(1, S, h, 64, generator=g) for h in (10, 2, 2))
        results, native_calls = [], []
        for comm in (None, None, TorchCommunicator()):
            del calls[:]
            shard = [t[:, off : off + seq_lens[rank]].to(dev, torch.bfloat16).requires_grad_() for t in (q, k, v)]
            # "math": deterministic on a GPU (SDPA's fused backwards may accumulate dq
            # with atomics), so the three runs can be compared bit for bit.
            out = ulysses_attention(*shard, seq_lens=seq_lens, comm=comm, attn_fn="math")
            out.float().square().sum().backward()
            results.append([out.detach()] + [t.grad for t in shard])
            native_calls.append(list(calls))
        # The first call may find torch's communicator not made yet (torch makes it lazily,
        # at the checks' all-gather at the latest) and then uses torch.distributed for the
        # whole call; from then on the default is native on the borrowed communicator:
        # n_calls per call (above). TorchCommunicator never is.
        assert len(native_calls[0]) in (0, n_calls), native_calls
        assert len(native_calls[1]) == n_calls and all(owned is False for _, owned in native_calls[1]), native_calls
        assert native_calls[2] == []
        for a, b, c in zip(*results):
            assert torch.equal(a, c) and torch.equal(b, c)
        comm = get_communicator(None, device=dev)
        backend = dist.group.WORLD._get_backend(torch.device("cuda"))
        assert isinstance(comm, NCCLCommunicator) and comm.handle == backend._comm_ptr() and not comm.owned
        # Our all-to-all on torch's communicator (at world 1 the op above moved nothing).
        x = torch.arange(world * 96, device=dev, dtype=torch.float32) + 1000 * rank
        y = torch.empty_like(x)
        comm.all_to_all(y, x, [96] * world, [96] * world)
        expected = torch.cat([torch.arange(rank * 96, (rank + 1) * 96, device=dev, dtype=torch.float32) + 1000 * p for p in range(world)])
        assert torch.equal(y, expected)
        comm.close()  # forgets the handle; torch's group still works
        x = torch.ones(4, device=dev)
        dist.all_reduce(x)
        assert torch.equal(x, torch.full_like(x, float(world)))
    finally:
        for name, fn in originals.items():
            setattr(NCCLCommunicator, name, fn)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_default_borrows_torchs_communicator_one_rank(monkeypatch):
    from ulysses_kernels.testing import run_ranks

    monkeypatch.setenv("ULYSSES_KERNELS_NATIVE_NCCL", "1")  # opt-in until this test has passed on a GPU
    run_ranks(_borrow_body, 1, transport="nccl", timeout_s=_GPU_TIMEOUT_S)


@pytest.mark.gpu
@pytest.mark.skipif(not _multi_rank_gpu_ok(), reason="needs a CUDA GPU and NCCL >= 2.30 (two ranks on one GPU)")
def test_default_borrows_torchs_communicator_two_ranks_on_one_gpu(monkeypatch):
    from ulysses_kernels.testing import run_ranks

    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    monkeypatch.setenv("ULYSSES_KERNELS_NATIVE_NCCL", "1")  # opt-in until this test has passed on a GPU
    run_ranks(_borrow_body, 2, transport="nccl", timeout_s=_GPU_TIMEOUT_S)


# ---- GPU, world 1: the watchdog on real NCCL work, and the borrowed handle's check -------------
def _watchdog_body(rank, world):
    import time

    from ulysses_kernels import extension
    from ulysses_kernels.comm import NCCLCommunicator

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    C = extension.load()
    n = 1 << 16
    x = torch.randn(world * n, device=dev)
    y = torch.empty_like(x)
    # Real work that completes, under a tiny timeout: no false abort.
    with NCCLCommunicator(device=0, timeout_s=0.5) as comm:
        assert C.nccl_comm_async_error(comm.handle) == (0, "no error")
        for _ in range(20):
            comm.all_to_all(y, x, [n] * world, [n] * world)
            comm.all_to_all(y, x, [n] * world, [n] * world, async_op=True).wait()
        torch.cuda.synchronize()
        assert torch.equal(y, x)
        time.sleep(2.0)  # four timeouts with nothing outstanding
        assert comm.failure is None and comm._watch.outstanding == 0, comm.failure
        assert comm._watch._thread.is_alive()
    assert not comm._watch._thread.is_alive()
    # The watchdog's event queries while this thread captures a CUDA graph (global capture
    # mode, torch's default): its thread-local capture mode keeps the capture valid.
    with NCCLCommunicator(device=0, timeout_s=30) as comm:
        comm._watch.poll_s = 0.02
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            comm.all_to_all(y, x, [n] * world, [n] * world)  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        probe = torch.cuda.Event()
        probe.record()
        queries, until = [], time.monotonic() + 1.5

        def probe_done():  # a cudaEventQuery at every poll, until after the capture
            queries.append(probe.query())
            return time.monotonic() > until

        with comm._watch.posting("probe") as item:
            item.done = probe_done
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.all_to_all(y, x, [n] * world, [n] * world)
            seen = len(queries)
            time.sleep(0.5)  # the watchdog polls meanwhile
            assert len(queries) > seen, "the watchdog did not poll during the capture"
        x.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x) and comm.failure is None, comm.failure


def _watchdog_abort_body(rank, world):
    import time

    import pytest

    from ulysses_kernels.comm import NCCLCommunicator

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    x = torch.ones(4096, device=dev)
    y = torch.empty_like(x)
    comm = NCCLCommunicator(device=0, timeout_s=0.3)
    comm.all_to_all(y, x, [4096], [4096])
    torch.cuda.synchronize()
    # Queued behind a kernel of ~2 s, the all-to-all cannot finish within the timeout: the
    # watchdog aborts the communicator (as it would for a dead peer), and nothing hangs.
    torch.cuda._sleep(3_000_000_000)
    comm.all_to_all(y, x, [4096], [4096])
    deadline = time.monotonic() + 60
    while comm.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert comm.failure is not None and "has not completed" in comm.failure and "ncclCommAbort" in comm.failure, comm.failure
    with pytest.raises(RuntimeError, match=r"NCCLCommunicator \(rank 0 of 1, cuda:0, its own NCCL communicator\): all_to_all"):
        comm.all_to_all(y, x, [4096], [4096])
    torch.cuda.synchronize()  # the stream moved on
    comm.close()  # the abort freed it: no destroy


def _borrow_check_body(rank, world):
    import time

    import pytest
    import torch.distributed as dist

    from ulysses_kernels.comm import NCCLCommunicator

    dev = torch.device("cuda", torch.cuda.current_device())
    sub = dist.new_group([0], backend="nccl")
    dist.all_reduce(torch.zeros(1, device=dev), group=sub)  # torch makes the group's communicator
    comm = NCCLCommunicator.borrow(sub, timeout_s=0.5)
    x = torch.arange(96.0, device=dev)
    y = torch.empty_like(x)
    comm.all_to_all(y, x, [96], [96])
    torch.cuda.synchronize()
    assert torch.equal(y, x)
    time.sleep(1.5)  # three timeouts: completed work does not abort torch's group
    assert comm.failure is None, comm.failure
    z = torch.ones(4, device=dev)
    dist.all_reduce(z, group=sub)
    assert torch.equal(z, torch.ones_like(z))
    dist.destroy_process_group(sub)
    with pytest.raises(RuntimeError, match=r"the process group it was borrowed from has been destroyed"):
        comm.all_to_all(y, x, [96], [96])
    comm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_watchdog_on_one_gpu_no_false_abort_and_graph_capture():
    _run_ranks_with_timeout(_watchdog_body, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_watchdog_on_one_gpu_aborts_late_work():
    _run_ranks_with_timeout(_watchdog_abort_body, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_borrowed_communicator_of_a_destroyed_group_raises_on_one_gpu():
    from ulysses_kernels.testing import run_ranks

    run_ranks(_borrow_check_body, 1, transport="nccl", timeout_s=_GPU_TIMEOUT_S)
