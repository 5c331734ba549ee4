"""The communicator package's one work type (``comm.Work``), ``comm.AsyncChannel``, and what
the torch.distributed communicators return for ``async_op=True``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from ulysses_kernels.comm import AsyncChannel, LocalCommunicator, Work
from ulysses_kernels.testing import run_ranks


class _Handle:
    """A work handle that records, in ``log``, each time it is waited."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait(self):
        self.log.append(self.name)


def test_nothing_to_wait_for():
    work = Work()
    assert work.wait() is None
    work.wait()  # waiting again is fine


def test_works_are_waited_once_in_order_and_none_is_skipped():
    log = []
    work = Work(works=[_Handle("a", log), None, _Handle("b", log)])
    assert log == []  # nothing is waited before wait()
    work.wait()
    assert log == ["a", "b"]
    work.wait()
    assert log == ["a", "b"]  # released by the first wait


def test_kept_tensors_live_until_wait():
    buf = torch.arange(1000.0)
    ref = weakref.ref(buf)
    work = Work(keep=(buf,))
    del buf
    gc.collect()
    assert ref() is not None
    work.wait()
    gc.collect()
    assert ref() is None


def test_event_needs_a_cuda_device():
    with pytest.raises(ValueError, match=r"event and device expected together.*device=None"):
        Work(event=object())
    with pytest.raises(ValueError, match=r"event and device expected together.*event=None"):
        Work(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"device expected a CUDA device for the event, got cpu"):
        Work(event=object(), device=torch.device("cpu"))


def test_local_communicator_returns_work():
    comm = LocalCommunicator()
    x, y = torch.arange(6.0), torch.zeros(6)
    work = comm.all_to_all(y, x, [6], [6], async_op=True)
    assert isinstance(work, Work)
    work.wait()
    assert torch.equal(x, y)
    assert isinstance(comm.send_recv([], [], async_op=True), Work)
    assert comm.all_to_all(y, x, [6], [6]) is None


def test_channel_on_the_cpu_uses_the_communicators_handle_and_keeps_the_buffers():
    log, seen = [], []
    buf = torch.zeros(8)
    ref = weakref.ref(buf)

    def call(async_op):
        seen.append(async_op)
        return _Handle("a2a", log)

    work = AsyncChannel(LocalCommunicator(), torch.device("cpu")).start((buf,), call)
    assert isinstance(work, Work) and seen == [True] and log == []
    del buf
    gc.collect()
    assert ref() is not None
    work.wait()
    gc.collect()
    assert log == ["a2a"] and ref() is None


def _torch_comm_body(rank, world):
    from ulysses_kernels.comm import TorchCommunicator

    comm = TorchCommunicator()
    # Uneven splits: rank r sends p + r + 1 elements to rank p.
    in_splits = [p + rank + 1 for p in range(world)]
    out_splits = [rank + p + 1 for p in range(world)]
    x = torch.arange(sum(in_splits), dtype=torch.float32) + 100 * rank
    y = torch.full((sum(out_splits),), -1.0)
    work = comm.all_to_all(y, x, out_splits, in_splits, async_op=True)
    assert isinstance(work, Work), type(work)
    work.wait()
    expected = []
    for p in range(world):
        start = sum(q + p + 1 for q in range(rank))
        expected.append(torch.arange(start, start + rank + p + 1, dtype=torch.float32) + 100 * p)
    assert torch.equal(y, torch.cat(expected))
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    s, r = torch.full((5,), float(rank)), torch.empty(5)
    work = comm.send_recv([(nxt, s)], [(prev, r)], async_op=True)
    assert isinstance(work, Work), type(work)
    work.wait()
    assert torch.equal(r, torch.full((5,), float(prev)))
    assert comm.send_recv([(nxt, s)], [(prev, r)]) is None


def test_torch_communicator_returns_work_on_gloo():
    run_ranks(_torch_comm_body, 3)


def _through_host_body(rank, world, device_type):
    """``send_recv`` through host copies (what gloo gets for device tensors): a ring shift of
    pieces of one flat buffer (views, as the exchanges pass them), blocking and async; with
    ``async_op`` the receive buffers are written by ``wait()``, not before."""
    from ulysses_kernels.comm import TorchCommunicator

    if device_type == "cuda":
        torch.cuda.set_device(0)  # the ranks share the one GPU
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    comm = TorchCommunicator()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    sends = [(nxt, torch.arange(7, dtype=torch.bfloat16, device=device) + rank), (nxt, torch.full((3,), rank * 10.0, device=device))]
    flat = torch.full((7 + 3 + 2,), -1.0, device=device)
    recv_b, recv_f = torch.full((7,), -1.0, dtype=torch.bfloat16, device=device), flat[2:5]
    want_b, want_f = torch.arange(7, dtype=torch.bfloat16) + prev, torch.full((3,), prev * 10.0)
    # The CUDA case takes the staged path by itself; on the CPU it is called directly.
    run = comm.send_recv if device_type == "cuda" else comm._send_recv_through_host
    work = run(sends, [(prev, recv_b), (prev, recv_f)], async_op=True)
    assert isinstance(work, Work), type(work)
    if device_type == "cpu":
        torch.distributed.barrier()  # the peer's data has arrived in the host buffers by now
        assert bool((recv_b == -1).all()) and bool((flat == -1).all()), "written before wait()"
    work.wait()
    assert torch.equal(recv_b.cpu(), want_b) and torch.equal(recv_f.cpu(), want_f), (recv_b, recv_f)
    assert bool((flat[:2] == -1).all()) and bool((flat[5:] == -1).all()), "a receive wrote outside its view"
    recv_b.fill_(-1)
    assert run(sends, [(prev, recv_b)] + [(prev, torch.empty(3, device=device))], async_op=False) is None
    assert torch.equal(recv_b.cpu(), want_b)


def test_send_recv_through_host_on_gloo():
    """The host-staged ``send_recv`` (gloo's path for CUDA tensors), exercised with CPU tensors on 3 ranks."""
    run_ranks(_through_host_body, 3, "cpu")


@pytest.mark.gpu
def test_send_recv_of_cuda_tensors_on_gloo():
    """2 gloo ranks sharing the GPU: ``send_recv`` of CUDA tensors (bf16 and float32 views)
    arrives, through host copies (gloo would read a device pointer as host memory)."""
    _needs_cuda()
    run_ranks(_through_host_body, 2, "cuda")


# ---- CUDA: the event case ----------------------------------------------------------------------
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_event_work_orders_the_consumers_stream_without_a_host_sync():
    _needs_cuda()
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(dev)
    src = torch.full((1 << 20,), 7.0, device=dev)
    dst = torch.zeros_like(src)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the producer is slow: a consumer that does not wait reads zeros
        dst.copy_(src)
        work = Work.after(side, keep=(dst,))
    work.wait()
    assert not side.query()  # wait() did not block the host
    assert torch.equal(dst, src)  # the consumer's stream ran after the copy


def test_channel_on_cuda_runs_the_collective_on_its_side_stream():
    _needs_cuda()
    dev = torch.device("cuda", torch.cuda.current_device())
    chan = AsyncChannel(LocalCommunicator(), dev)
    main = torch.cuda.current_stream(dev)
    send = torch.full((1 << 20,), 3.0, device=dev)
    recv = torch.zeros_like(send)
    streams, seen = [], []

    def call(async_op):
        seen.append(async_op)
        streams.append(torch.cuda.current_stream(dev))
        torch.cuda._sleep(50_000_000)
        chan.comm.all_to_all(recv, send, [send.numel()], [send.numel()])

    work = chan.start((recv, send), call)
    assert seen == [False] and streams == [chan.stream] and streams[0] != main
    work.wait()
    assert torch.equal(recv, send)
