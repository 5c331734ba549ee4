"""Peak memory of one rank: ours at or below the permute chain's (the peers' way), and
equal to the formula of docs/design.md ("Buffers and who owns them").

Each rank runs ``ulysses_attention`` (SDPA, float32) and the permute chain
(``baselines.permute_chain_attention``, what DeepSpeed and yunchang do; DeepSpeed's own
``DistributedAttention`` in a test of its own where installed) under ``traffic.LiveBytes``,
which counts the bytes of every tensor the op allocates from allocation to free. The
caller's q, k, v and dout are not counted; ``out`` is, and the caller keeps it through the
backward. Passes: inference (q, k, v without grad), forward+backward, and forward+backward
with the op's dout made by autograd (as in a model: the gradient of a layer after it, which
the autograd engine frees when the op no longer needs it; not in the formula).

Shapes on 2 gloo ranks: MHA; GQA whose ranks share one KV head (``SharedKV``); GQA with
fewer KV heads than ranks (the chain repeats KV heads); KV groups that straddle ranks
unevenly (a gathered KV map); query heads that do not divide (the chain cannot run those);
batch 1 and 2; chunks 1, 2 and ``"auto"``.
"""

from __future__ import annotations

import importlib.util
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import ulysses_kernels as uk
from ulysses_kernels.attention.call import setup_attention
from ulysses_kernels.attention.chunked.schedule import build_schedule
from ulysses_kernels.backends import SDPABackend
from ulysses_kernels.baselines import permute_chain_attention
from ulysses_kernels.gqa import shares_one_kv, uniform_kv_groups
from ulysses_kernels.layout import QKV, Layout
from ulysses_kernels.testing import run_ranks
from ulysses_kernels.traffic import LiveBytes, ulysses_peak_moments

WORLD = 2
D = 16
SEQ = 48  # tokens per rank
# (batch, q heads, kv heads)
SHAPES = [
    (1, 8, 8),  # MHA
    (2, 8, 8),
    (1, 8, 2),  # GQA, one KV head per rank shared by 4 query heads (SharedKV)
    (2, 8, 2),
    (1, 8, 1),  # GQA with fewer KV heads than ranks (the chain repeats them)
    (1, 6, 3),  # KV groups straddle the ranks unevenly (a gathered KV map)
    (2, 6, 3),
    (1, 5, 5),  # query heads do not divide over the ranks (no chain)
]
CHUNKS = (2, "auto")


# ---- gloo's worker thread, settled --------------------------------------------------------------
def _settle(tensors, counts, what: str) -> None:
    """Wait until gloo has let go of ``tensors`` (their use counts back to ``counts``).

    NOTE: gloo's worker thread drops its references to a finished collective's tensors a
    few ms after ``wait()`` returns (measured: 1 call in 10, up to 30 ms on 2 busy cores).
    Until then a buffer the op has already dropped is still alive, and the tracker would see
    it at a moment that depends on thread timing; waiting here makes the measured lifetimes
    the op's own."""
    deadline = time.monotonic() + 30
    for t, n in zip(tensors, counts):
        while t._use_count() > n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: gloo still holds a tensor 30 s after the collective finished")
            time.sleep(0.0002)


class _SettledWork:
    def __init__(self, work, tensors, what):
        self.work, self.tensors, self.what = work, tensors, what
        self.counts = [t._use_count() for t in tensors]

    def wait(self):
        self.work.wait()
        self.work = None
        _settle(self.tensors, self.counts, self.what)
        return True


def _settled_collectives():
    """``dist.all_to_all_single``, ``dist.batch_isend_irecv`` and ``dist.all_gather`` (what
    ``TorchCommunicator``, the permute chain and DeepSpeed call) that return once gloo has
    let go of the tensors. Returns the function that restores torch's."""
    a2a, p2p, gather = dist.all_to_all_single, dist.batch_isend_irecv, dist.all_gather

    def all_to_all_single(output, input, *args, async_op=False, **kwargs):
        tensors = [output, input]
        counts = [t._use_count() for t in tensors]
        work = a2a(output, input, *args, async_op=async_op, **kwargs)
        if async_op:
            return _SettledWork(work, tensors, "all_to_all_single")
        _settle(tensors, counts, "all_to_all_single")
        return None

    def batch_isend_irecv(ops):
        works = p2p(ops)
        if len(works) == len(ops):  # one work per op (gloo)
            return [_SettledWork(w, [op.tensor], "batch_isend_irecv") for w, op in zip(works, ops)]
        return works

    def all_gather(tensor_list, tensor, *args, async_op=False, **kwargs):
        tensors = [*tensor_list, tensor]
        counts = [t._use_count() for t in tensors]
        work = gather(tensor_list, tensor, *args, async_op=async_op, **kwargs)
        if async_op:
            return _SettledWork(work, tensors, "all_gather")
        _settle(tensors, counts, "all_gather")
        return None

    dist.all_to_all_single, dist.batch_isend_irecv, dist.all_gather = all_to_all_single, batch_isend_irecv, all_gather

    def restore():
        dist.all_to_all_single, dist.batch_isend_irecv, dist.all_gather = a2a, p2p, gather

    return restore


# ---- one measurement ----------------------------------------------------------------------------
def _buffer(label: str, peak_phase: str) -> str:
    """A tracker label (``phase/module.function:name``) as the buffer it is."""
    phase, _, site = label.partition("/")
    names = {
        "exchange._post_s2h:send": "seq->head send",
        "exchange._post_s2h:recv": "seq->head receive",
        "exchange._h2s_recv:recv": "head->seq receive",
        "exchange.a2a_head_to_seq:outs": "results",
        "function._new_results:": "results",
        "function._attend_chunk:q": "attention inputs",
        "backends.forward:q": "attention inputs",
        "backends.forward:k,v": "attention inputs",
        "backends.attend:out": "attention output and internals",
        "backends.backward:dq,dk,dv": "attention gradients",
    }
    name = names.get(site, site)
    if phase == "fwd" and peak_phase == "bwd":
        name = f"saved for backward: {name}"
    return f"{phase} {name}"


def _breakdown(tracker: LiveBytes) -> str:
    peak_phase = "bwd" if any(label.startswith("bwd/") for label in tracker.at_peak) else "fwd"
    parts: dict[str, int] = {}
    for label, n in tracker.at_peak.items():
        key = _buffer(label, peak_phase)
        parts[key] = parts.get(key, 0) + n
    return ", ".join(f"{k}: {n} B" for k, n in sorted(parts.items(), key=lambda x: -x[1]))


PASSES = ("inference", "fwd+bwd", "fwd+bwd, dout from autograd")


def _measure(fn, B, hq, hkv, pass_: str, rank: int):
    """Peak live bytes of ``fn(q, k, v)`` (and its backward) on this rank, and the tracker."""
    backward = pass_ != "inference"
    gen = torch.Generator().manual_seed(1000 + rank)
    q, k, v = (torch.randn(B, SEQ, h, D, generator=gen).requires_grad_(backward) for h in (hq, hkv, hkv))
    dout = torch.randn(B, SEQ, hq, D, generator=gen)
    tracker = LiveBytes()
    with tracker:
        with tracker.phase("fwd"):
            out = fn(q, k, v)
            if pass_ == "fwd+bwd, dout from autograd":
                out = out * 2.0  # its backward makes the op's dout (2 * dout), saving nothing
        if backward:
            with tracker.phase("bwd"):
                out.backward(dout)
    del out
    return tracker.peak, tracker


def _ours(chunks):
    return lambda q, k, v: uk.ulysses_attention(q, k, v, attn_fn="sdpa", chunks=chunks)


def _chunk_bytes(B, hq, hkv, chunks) -> tuple[int, int]:
    """(resolved chunk count, bytes of the largest chunk's q/k/v send and receive buffers)."""
    q, k, v = (torch.empty(B, SEQ, h, D) for h in (hq, hkv, hkv))
    call = setup_attention(
        q, k, v, group=None, comm=None, plan=None, seq_lens=None, causal=True, softmax_scale=None,
        attn_fn="sdpa", kernels=None, chunks=chunks, check=False,
    )  # fmt: skip
    if call.chunks == 1:
        return 1, 0
    sched = build_schedule(call.layout, call.chunks, call.split_kv_groups)
    return call.chunks, max(sum(c.layout.s2h_send_splits(QKV)) + sum(c.layout.s2h_recv_splits(QKV)) for c in sched.chunks) * 4


def _shared_kv_extra(B, hq, hkv, rank, backward: bool) -> int:
    """What ``SharedKV`` holds over a grouped-query backward that sums the KV gradient inside
    the kernel (CPU SDPA; the chain and DeepSpeed run that): the kernel's per-query-head dk,
    dv ``[B, S, hq, D]`` where such a kernel returns ``[B, S, 1, D]``. flash-attn's own GQA
    backward allocates the same per-query-head buffers (``dk_expanded``), so on the GPU with
    flash-attn it is not extra."""
    plan = uk.HeadPlan.build(hq, hkv, WORLD)
    kv_map = plan.local_kv_map(rank)
    if not backward or not shares_one_kv(kv_map):
        return 0
    return 2 * B * SEQ * WORLD * D * (len(kv_map) - 1) * 4


def _chain_copies(B, hq, hkv, backward: bool, rank: int) -> bool:
    """True where the permute chain's peak holds a copy ours does not make: inference at
    batch > 1 (its permutes copy) or with repeated KV heads; forward+backward only when the
    repeated KV heads are what it saves (ours saves the KV heads as received). Elsewhere the
    forward+backward peak of both is the attention backward, where both hold the same
    tensors (the attention's inputs, output, dout and gradients)."""
    repeated = hkv % WORLD != 0
    if not backward:
        return B > 1 or repeated
    plan = uk.HeadPlan.build(hq, hkv, WORLD)
    kv_map = plan.local_kv_map(rank)
    gathered = not shares_one_kv(kv_map) and not uniform_kv_groups(len(kv_map), plan.kv_count(rank), kv_map)
    return repeated and not gathered


def _body(rank, world, peers):
    restore = _settled_collectives()
    try:
        failures = []
        for B, hq, hkv in SHAPES:
            layout = Layout(uk.HeadPlan.build(hq, hkv, world), rank, (SEQ,) * world, B, D)
            for pass_ in PASSES:
                backward = pass_ != "inference"
                case = f"rank {rank}, batch {B}, {hq}/{hkv} heads, {pass_}"
                ours, tracker = _measure(_ours(1), B, hq, hkv, pass_, rank)
                moments = ulysses_peak_moments(layout, 4, backward=backward)
                if pass_ != PASSES[2] and ours != max(moments.values()):
                    failures.append(f"{case}: peak {ours} B, formula {max(moments.values())} B {moments}; at the peak: {_breakdown(tracker)}")
                for chunks in CHUNKS:
                    n, chunk = _chunk_bytes(B, hq, hkv, chunks)
                    peak, t = _measure(_ours(chunks), B, hq, hkv, pass_, rank)
                    if peak > ours + chunk:
                        failures.append(
                            f"{case}, chunks={chunks} ({n}): peak {peak} B > unchunked {ours} B + one chunk's buffers {chunk} B; at the peak: {_breakdown(t)}"
                        )
                for name in peers:
                    if name == "chain" and hq % world:
                        continue  # the chain needs query heads divisible by the ranks
                    if name == "deepspeed" and (hkv < world or hq % world or hkv % world):
                        continue  # DistributedAttention asserts on these (BUILD_NOTES)
                    fn = permute_chain_attention if name == "chain" else _deepspeed(hq, hkv, world)
                    theirs, t_theirs = _measure(fn, B, hq, hkv, pass_, rank)
                    extra = _shared_kv_extra(B, hq, hkv, rank, backward)
                    detail = f"ours at the peak: {_breakdown(tracker)}; {name} at the peak: {_breakdown(t_theirs)}"
                    if ours > theirs + extra:
                        failures.append(f"{case}: ours {ours} B > {name} {theirs} B (+ SharedKV's {extra} B); {detail}")
                    if _chain_copies(B, hq, hkv, backward, rank) and not ours < theirs:
                        failures.append(f"{case}: ours {ours} B not below {name} {theirs} B where it copies; {detail}")
        assert not failures, "\n".join(failures)
    finally:
        restore()


def _deepspeed(hq, hkv, world):
    from ulysses_kernels.bench.attention import peer_method

    return peer_method("deepspeed", SDPABackend(), D**-0.5, world, hq, hkv).fn


def test_peak_at_or_below_the_permute_chain_and_equal_to_the_formula():
    run_ranks(_body, WORLD, ("chain",))


def test_peak_at_or_below_deepspeed():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (an optional baseline; scripts/setup.sh installs it)")
    run_ranks(_body, WORLD, ("deepspeed",))


# ---- LiveBytes' own bookkeeping -----------------------------------------------------------------
def _host_copy(t: torch.Tensor) -> torch.Tensor:
    copy = t.clone()
    return copy


def test_live_bytes_breakdown_is_the_moment_of_the_peak():
    """``at_peak`` is what was alive when the peak was reached: not changed by frees, host copies
    or smaller allocations after it (the breakdown is copied lazily, once the peak is over), and
    replaced by the next, higher peak; ``live()`` is what is alive now."""
    f64 = torch.float64
    with LiveBytes(host_sites=("test_memory._host_copy",)) as tracker:
        a = torch.ones(1000, dtype=f64)
        b = torch.ones(500, dtype=f64)
        first = {k.rsplit(":", 1)[1]: n for k, n in tracker.live().items()}
        h = _host_copy(a)  # host bytes: the device peak and its breakdown stay
        del b
        c = torch.ones(100, dtype=f64)
        assert first == {"a": 8000, "b": 4000}
        assert {k.rsplit(":", 1)[1]: n for k, n in tracker.at_peak.items()} == first
        assert (tracker.peak, tracker.current, tracker.host_peak) == (12000, 8800, 8000)
        d = torch.ones(2000, dtype=f64)  # a new peak, with the host copy alive at it
        assert tracker.peak == 8000 + 800 + 16000
        tracker.forget(d)
        at = {k.rsplit(":", 1)[1]: n for k, n in tracker.at_peak.items()}
        assert at == {"a": 8000, "copy": 8000, "c": 800, "d": 16000}, at
        assert any(k.startswith("host:") for k in tracker.at_peak) and sum(tracker.live().values()) == 8000 + 8000 + 800
    del a, c, h


def test_live_bytes_a_free_while_the_peak_is_copied_keeps_the_peak():
    """A storage freed while the peak's breakdown is being copied (on a garbage collection that
    the copy's allocations run) leaves the breakdown as it was at the peak."""
    f64 = torch.float64
    with LiveBytes() as tracker:
        a = torch.ones(1000, dtype=f64)
        b = torch.ones(500, dtype=f64)
    held = [b]
    del b

    class FreesWhenCopied(Counter):  # stands in for the collection: b's last reference goes mid-copy
        def __iter__(self):
            held.clear()
            return super().__iter__()

        def keys(self):
            held.clear()
            return super().keys()

    tracker._by_label = FreesWhenCopied(tracker._by_label)
    at = {k.rsplit(":", 1)[1]: n for k, n in tracker.at_peak.items()}
    assert not held and tracker.current == 8000
    assert at == {"a": 8000, "b": 4000}, at
    del a
