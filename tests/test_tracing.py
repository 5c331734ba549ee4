"""``tracing.in_trace``: True where Dynamo traces the code, False where it runs, and never
True in a thread that runs eagerly beside another thread's compile (which
``torch.compiler.is_compiling()`` reads as True: a process-wide flag in torch 2.14)."""

from __future__ import annotations

import threading

import torch

from ulysses_kernels.tracing import in_trace


def test_true_while_traced_false_when_run():
    x = torch.zeros(2)
    assert not in_trace()
    fn = torch.compile(lambda t: t + (1.0 if in_trace() else 0.0), backend="eager", fullgraph=True)
    assert torch.equal(fn(x), torch.ones(2))


def test_a_thread_beside_a_compile_is_not_in_a_trace():
    seen = {"compiling": 0, "in_trace": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen["compiling"] += torch.compiler.is_compiling()
            seen["in_trace"] += in_trace()

    t = threading.Thread(target=watch)
    t.start()
    try:
        for i in range(3):  # fresh functions: each compiles
            torch.compile(lambda v, i=i: v * 2 + i, backend="eager")(torch.ones(4))
    finally:
        stop.set()
        t.join()
    assert seen["compiling"] > 0, "torch's process-wide flag was never seen: this torch may not need in_trace"
    assert seen["in_trace"] == 0
