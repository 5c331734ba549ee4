"""Chunked overlap (ulysses_kernels.attention.chunked): bit-identical to chunks=1, forward and backward.

Distributed checks run on gloo ranks with asynchronous collectives; each spawn runs many
cases (spawning costs ~10-20 s on 2 cores), among them every plan of the core tests
(``test_attention_dist.CASES``). The backend is SDPA, which computes each head
independently of the others present (see the pipeline docstring for why "math" is not).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_attention_dist import CASES as CORE_CASES  # tests/ is on sys.path (no __init__.py)

from ulysses_kernels.attention.chunked import CostModel, choose_chunks, chunk_plans, splits_shared_kv
from ulysses_kernels.comm import LocalCommunicator
from ulysses_kernels.layout import Layout
from ulysses_kernels.plan import HeadPlan
from ulysses_kernels.testing import run_ranks


# ---- the chunk plans ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "hq,hkv,world",
    [(8, 8, 2), (10, 2, 4), (40, 8, 3), (40, 8, 5), (40, 8, 8), (8, 1, 4), (7, 7, 3), (32, 8, 2), (12, 4, 1), (6, 2, 3), (32, 8, 16)],
)
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("split_kv_groups", [False, True])
def test_chunk_plans_partition_heads(hq, hkv, world, chunks, split_kv_groups):
    plan = HeadPlan.build(hq, hkv, world)
    fwd = chunk_plans(plan, chunks, split_kv_groups=split_kv_groups)
    bwd = chunk_plans(plan, chunks, split_kv_groups=split_kv_groups, kv_last=True)
    assert 1 <= len(fwd) == len(bwd) <= chunks
    g = plan.kv_group_size
    for r in range(world):
        shared = split_kv_groups and splits_shared_kv(plan, r)
        assert [cp.q_ranges[r] for cp in fwd] == [cp.q_ranges[r] for cp in bwd]
        q_seen, kv_fwd, kv_bwd, used = [], [], [], []
        for c, (cp, gp) in enumerate(zip(fwd, bwd)):
            a, b = cp.q_ranges[r]
            q_seen += range(a, b)
            kv_fwd.append(cp.kv_ranges[r])
            kv_bwd.append(gp.kv_ranges[r])
            if a < b:
                used.append(c)
                if not shared:
                    # Whole local groups: the KV heads are exactly those its query heads use,
                    # and no other chunk of this rank uses them.
                    assert cp.kv_ranges[r] == gp.kv_ranges[r] == (a // g, (b - 1) // g + 1)
        assert q_seen == list(range(*plan.q_ranges[r]))
        assert used == list(range(len(used)))  # a rank uses its first chunks
        for kv in (kv_fwd, kv_bwd):
            assert [h for k0, k1 in kv for h in range(k0, k1)] == list(range(*plan.kv_ranges[r]))
        if shared:
            # Query heads of one KV head, split evenly; the KV head goes with the first
            # chunk forward and with the last one backward.
            assert len(used) == min(chunks, plan.q_count(r))
            sizes = [fwd[c].q_count(r) for c in used]
            assert max(sizes) - min(sizes) <= 1
            assert fwd[0].kv_count(r) == 1 and bwd[used[-1]].kv_count(r) == 1
        else:
            # Group boundaries: min(chunks, its KV-group count) chunks.
            assert len(used) == min(chunks, plan.kv_count(r))


def test_single_kv_head_ranks_split_query_heads():
    # MQA (2 query heads per rank), 40/8 on 8 ranks (5 query heads of one KV head each).
    assert len(chunk_plans(HeadPlan.build(8, 1, 4), 4)) == 2
    assert len(chunk_plans(HeadPlan.build(40, 8, 8), 4)) == 4
    assert len(chunk_plans(HeadPlan.build(40, 8, 8), 8)) == 5
    # ... unless the backend cannot sum a split KV gradient (not an AttentionBackend).
    assert len(chunk_plans(HeadPlan.build(8, 1, 4), 4, split_kv_groups=False)) == 1
    assert len(chunk_plans(HeadPlan.build(40, 8, 8), 4, split_kv_groups=False)) == 1
    # 40/8 on 5 ranks: 8 query heads over 2-3 groups per rank, split on group boundaries.
    assert len(chunk_plans(HeadPlan.build(40, 8, 5), 4)) == 3
    # One query head per rank: nothing to split.
    assert len(chunk_plans(HeadPlan.build(8, 1, 8), 4)) == 1


# ---- the cost model ------------------------------------------------------------------------
def _layout(hq, hkv, world, seq, batch=1, head_dim=128):
    return Layout(HeadPlan.build(hq, hkv, world), 0, (seq // world,) * world, batch, head_dim)


def test_auto_short_sequences_and_fast_links_keep_one_chunk(monkeypatch):
    for var in ("ULYSSES_KERNELS_LINK_GBPS", "ULYSSES_KERNELS_ATTN_TFLOPS", "ULYSSES_KERNELS_LINK_LATENCY_US"):
        monkeypatch.delenv(var, raising=False)
    # Short sequence: latency dominates.
    assert choose_chunks(_layout(32, 8, 8, 2048), 2, True, "cuda") == 1
    # Long sequence on NVLink-class bandwidth: comm is a few % of attention, overlap slows
    # attention more than it hides.
    assert choose_chunks(_layout(32, 8, 8, 131072), 2, True, "cuda") == 1
    # The same on a slow link (PCIe / inter-node class): chunking pays.
    slow = CostModel(link_gbps=20, attn_tflops=300, latency_us=25, overlap_slowdown=0.15, min_gain=0.03)
    n = choose_chunks(_layout(64, 16, 4, 32768), 2, True, "cuda", slow)
    assert 2 <= n <= 4  # 4 KV groups per rank: at most 4 chunks
    # Every rank holds one KV head (32/8 on 8 ranks): its 4 query heads are split ...
    n = choose_chunks(_layout(32, 8, 8, 16384), 2, True, "cuda", slow)
    assert 2 <= n <= 4
    # ... unless the backend cannot sum a split KV gradient.
    assert choose_chunks(_layout(32, 8, 8, 16384), 2, True, "cuda", slow, split_kv_groups=False) == 1
    # World size 1: nothing to overlap.
    assert choose_chunks(_layout(32, 8, 1, 131072), 2, True, "cuda", slow) == 1


def test_auto_respects_env_and_plan_limits(monkeypatch):
    lay = _layout(64, 8, 4, 16384)
    monkeypatch.setenv("ULYSSES_KERNELS_LINK_GBPS", "10")
    monkeypatch.setenv("ULYSSES_KERNELS_ATTN_TFLOPS", "400")
    n_slow = choose_chunks(lay, 2, False, "cuda")
    assert 2 <= n_slow <= len(chunk_plans(lay.plan, 8))
    monkeypatch.setenv("ULYSSES_KERNELS_LINK_GBPS", "100000")
    assert choose_chunks(lay, 2, False, "cuda") == 1
    monkeypatch.setenv("ULYSSES_KERNELS_LINK_GBPS", "fast")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_LINK_GBPS"):
        choose_chunks(lay, 2, False, "cuda")


def test_auto_is_the_same_on_every_rank():
    plan = HeadPlan.build(40, 8, 5)
    lens = (9000, 8000, 7000, 9500, 8100)
    model = CostModel(link_gbps=5, attn_tflops=100, latency_us=25, overlap_slowdown=0.1, min_gain=0.03)
    picks = {choose_chunks(Layout(plan, r, lens, 2, 128), 2, True, "cuda", model) for r in range(5)}
    assert len(picks) == 1 and picks.pop() > 1


# ---- bit-identity, one process (world size 1, both kernel sets) ----------------------------
def _triton_on_cpu() -> bool:
    """The Triton kernels run on CPU tensors only under the interpreter (conftest.py sets
    it when there is no GPU; on a GPU machine these CPU cases are skipped, the GPU tests
    below and tests/test_triton_kernels.py cover Triton there)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from ulysses_kernels.kernels import available_kernels

    return "triton" in available_kernels()


def _run(q, k, v, dout, chunks, kernels, comm, seq_lens=None, causal=True):
    from ulysses_kernels import ulysses_attention

    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = ulysses_attention(*leaves, causal=causal, seq_lens=seq_lens, attn_fn="sdpa", comm=comm, kernels=kernels, chunks=chunks)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_world_one_chunked_equals_unchunked(kernels):
    if kernels == "triton" and not _triton_on_cpu():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set by conftest.py when there is no GPU)")
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(2, 9, 6, 8, generator=g), torch.randn(2, 9, 6, 8, generator=g)
    k, v = torch.randn(2, 9, 3, 8, generator=g), torch.randn(2, 9, 3, 8, generator=g)
    ref = _run(q, k, v, dout, 1, kernels, LocalCommunicator())
    got = _run(q, k, v, dout, 3, kernels, LocalCommunicator())
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_run_schedule_names_the_path_of_each_call(monkeypatch):
    """``interface.run_schedule`` is the one place that picks a schedule, from the call's
    ``traced`` and ``chunks``: eager for one chunk, chunked for more (the function found in
    the chunked package at call time), traced for a call set up inside ``torch.compile``;
    the module runs the same choice on its kept ``CallSetup``."""
    from ulysses_kernels import UlyssesAttention, ulysses_attention
    from ulysses_kernels.attention import chunked, interface

    taken = []
    for module, name in ((interface, "eager_attention"), (chunked, "chunked_attention"), (interface, "traced_attention")):
        monkeypatch.setattr(module, name, lambda q, k, v, call, name=name: taken.append((name, call.chunks)) or name)
    q, kv = torch.randn(1, 4, 4, 8), torch.randn(1, 4, 2, 8)
    comm = LocalCommunicator()
    assert ulysses_attention(q, kv, kv, comm=comm, chunks=1) == "eager_attention"
    assert ulysses_attention(q, kv, kv, comm=comm, chunks=2) == "chunked_attention"
    module = UlyssesAttention(4, 2, comm=comm, chunks=2)
    assert module(q, kv, kv) == module(q, kv, kv) == "chunked_attention"  # the second call: the kept CallSetup
    assert UlyssesAttention(4, 2, comm=comm)(q, kv, kv) == "eager_attention"
    call = module._resolve(q, kv, kv)
    assert interface.run_schedule(q, kv, kv, call._replace(traced=True)) == "traced_attention"
    assert taken == [("eager_attention", 1), ("chunked_attention", 2), ("chunked_attention", 2), ("chunked_attention", 2),
                     ("eager_attention", 1), ("traced_attention", 2)]  # fmt: skip


def test_bad_chunks_value():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="chunks"):
        _run(q, q, q, q, 0, "torch", LocalCommunicator())


# ---- bit-identity on gloo ranks ---------------------------------------------------------------
def _dist_cases(rank, world, cases):
    from ulysses_kernels.attention.chunked import chunk_plans as _cp
    from ulysses_kernels.comm import TorchCommunicator

    comm = TorchCommunicator()
    for hq, hkv, lens, batch, causal, dtype, chunks, kernels in cases:
        g = torch.Generator().manual_seed(hq * 7 + batch)
        D = 8
        full = [torch.randn(batch, sum(lens), h, D, generator=g).to(dtype) for h in (hq, hkv, hkv, hq)]
        off = sum(lens[:rank])
        q, k, v, dout = (x[:, off : off + lens[rank]] for x in full)
        ref = _run(q, k, v, dout, 1, kernels, comm, lens, causal)
        assert all(t.count_nonzero() for t in ref), f"rank {rank}: {hq}/{hkv} lens={lens}: a zero reference tensor"
        got = _run(q, k, v, dout, chunks, kernels, comm, lens, causal)
        same = [torch.equal(a, b) for a, b in zip(ref, got)]
        n = len(_cp(HeadPlan.build(hq, hkv, world), chunks)) if chunks != "auto" else chunks
        assert all(same), f"rank {rank}: {hq}/{hkv} lens={lens} B={batch} causal={causal} {dtype} chunks={chunks}->{n} {kernels}: out,dq,dk,dv equal={same}"


F32, BF16 = torch.float32, torch.bfloat16
DIST = {
    2: [
        (8, 8, (5, 3), 2, True, F32, 2, "torch"),
        (8, 8, (4, 4), 1, False, BF16, 4, "torch"),
        (6, 2, (3, 6), 2, True, F32, 2, "torch"),
    ],
    3: [
        (40, 8, (3, 2, 4), 2, True, F32, 3, "torch"),
        (40, 8, (3, 2, 4), 1, False, BF16, 2, "torch"),
        (6, 6, (2, 3, 2), 2, True, F32, 2, "triton"),
        (6, 2, (3, 2, 4), 2, True, F32, 2, "torch"),  # ranks 0, 2 split one KV head; rank 1 two
    ],
    4: [
        (10, 2, (3, 4, 5, 2), 2, False, F32, 2, "torch"),  # KV groups split: replica sums
        (10, 2, (3, 4, 5, 2), 1, True, BF16, 3, "torch"),
        (8, 1, (2, 3, 2, 3), 2, True, F32, 4, "torch"),  # MQA: query heads of one KV head split
        (10, 2, (3, 4, 5, 2), 2, True, BF16, 3, "torch"),  # shared KV heads, each on two ranks
    ],
    5: [
        (40, 8, (2, 3, 2, 1, 3), 2, True, F32, 3, "torch"),
        (40, 8, (2, 3, 2, 1, 3), 1, False, BF16, 2, "torch"),
    ],
    8: [
        (40, 8, (2, 1, 2, 1, 2, 1, 2, 1), 2, True, F32, 2, "torch"),  # one KV head per rank: split
        (40, 8, (2, 2, 2, 2, 2, 2, 2, 2), 1, False, BF16, 5, "torch"),  # Qwen2.5-14B at sp 8
        (16, 16, (1, 2, 1, 2, 1, 2, 1, 2), 2, False, F32, 2, "torch"),
    ],
}


def _core_cases(world):
    """Every plan of the core tests (``test_attention_dist.CASES[world]``, with its batch,
    seq_lens and causal), float32, at 2 chunks and at the most chunks the plan allows: one
    per local KV group, or one per query head on a rank whose query heads share one KV head.
    A plan with one query head on every rank cannot be split: its schedule must be one
    chunk, and ``chunks=2`` then runs chunked_attention's fallback, still compared."""
    out = []
    for hq, hkv, batch, lens, causal in CORE_CASES[world]:
        plan = HeadPlan.build(hq, hkv, world)
        most = len(chunk_plans(plan, hq))
        one_head = all(plan.q_count(r) == 1 for r in range(world))
        assert (most == 1) == one_head, f"{hq}/{hkv} on {world} ranks: at most {most} chunks"
        out += [(hq, hkv, tuple(lens), batch, causal, F32, n, "torch") for n in sorted({2, max(2, most)})]
    return out


@pytest.mark.parametrize("world", sorted(set(DIST) | set(CORE_CASES)))
def test_chunked_bit_identical_on_gloo(world):
    """DIST's cases (bf16, Triton, extra layouts) and every core plan, one spawn per world."""
    cases = DIST.get(world, []) + _core_cases(world)
    if not _triton_on_cpu():
        cases = [c for c in cases if c[-1] != "triton"]
    run_ranks(_dist_cases, world, cases)


# ---- GPU stress: stream safety -------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_world_one_chunked_smoke():
    """World size 1 on a GPU: the chunk schedule, the side stream and its events run, but
    NO byte moves on the side stream (every exchange at world size 1 is local: no sends, no
    receives), so this cannot catch a stream race. The two-rank test below does."""
    device = torch.device("cuda")
    comm = LocalCommunicator()
    g = torch.Generator(device=device).manual_seed(0)
    # The last shape is MQA: SharedKV, query heads of one KV head split into chunks.
    shapes = [(1, 256, 8, 4, 64), (2, 128, 12, 4, 64), (1, 512, 16, 8, 128), (3, 64, 6, 2, 32), (1, 384, 8, 1, 64)]
    exact = {True: 0, False: 0}
    for it in range(12):
        B, S, hq, hkv, D = shapes[it % len(shapes)]
        x = [torch.randn(B, S, h, D, device=device, generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq)]
        ref, ref2 = _run(*x, 1, "auto", comm), _run(*x, 1, "auto", comm)
        got = _run(*x, 2 + it % 3, "auto", comm)
        _check_gpu(ref, ref2, got, exact, f"iteration {it} shape {(B, S, hq, hkv, D)}")
    torch.cuda.synchronize()


_ULPS = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}  # x max|ref|


def _check_gpu(ref, ref2, got, exact, what):
    """Chunked (``got``) vs unchunked (``ref``, ``ref2``: two runs) out, dq, dk, dv on a GPU.

    Bit-identity is the CPU contract; on a GPU, SDPA's flash/efficient backward accumulates
    with atomics (and the flash forward may pick split-KV by head count), so allow the
    unchunked op's own run-to-run noise plus a few ulps. A stream race shows as NaN (the
    tests fill churned memory with NaN) or as O(1) errors. ``exact`` counts bit-equal ones."""
    for name, a, a2, b in zip(("out", "dq", "dk", "dv"), ref, ref2, got):
        err = (a.float() - b.float()).abs().max().item()
        noise = (a.float() - a2.float()).abs().max().item()
        tol = 8 * noise + _ULPS[a.dtype] * a.float().abs().max().item()
        exact[torch.equal(a, b)] += 1
        assert not b.isnan().any() and err <= tol, f"{what} {name}: max err {err:.3g} > tol {tol:.3g} (unchunked run-to-run noise {noise:.3g})"


_SKIP_RC = 77  # a rank exits with this when NCCL refuses two ranks on one GPU


def _nccl_stress_rank(rank: int, world: int) -> None:
    """One rank of the two-ranks-on-one-GPU stress run (a subprocess; see the test below)."""
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    from ulysses_kernels.comm import NCCLCommunicator, TorchCommunicator, nccl_available
    from ulysses_kernels.kernels import available_kernels

    torch.cuda.set_device(0)
    try:
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        probe = torch.ones(1, device="cuda")
        dist.all_reduce(probe)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - NCCL without multi-rank-per-GPU support
        print(f"rank {rank}: NCCL cannot put {world} ranks on one GPU: {exc}", flush=True)
        sys.exit(_SKIP_RC)
    comms = [("torch", TorchCommunicator())]
    if nccl_available():
        comms.append(("native", NCCLCommunicator()))
    kernel_sets = [k for k in ("torch", "triton", "cuda") if k in available_kernels()]
    g = torch.Generator(device="cuda").manual_seed(1234)
    # (hq, hkv, seq_lens, batch, D, dtype, chunks): batch 1 moves everything with
    # all_to_all, batch 2 with grouped send/recv; uneven shards; GQA with 2-4 chunks.
    cases = [
        (16, 16, (1536, 2560), 1, 128, torch.bfloat16, 4),
        (12, 4, (700, 1348), 2, 64, torch.bfloat16, 2),
        (8, 8, (1024, 1024), 1, 64, torch.float32, 3),
        (24, 8, (999, 1001), 2, 128, torch.float16, 4),
        (16, 2, (1000, 1048), 1, 128, torch.bfloat16, 4),  # one KV head per rank: SharedKV
    ]
    exact = {True: 0, False: 0}
    for it in range(3):
        for comm_name, comm in comms:
            for kernels in kernel_sets:
                for hq, hkv, lens, B, D, dtype, chunks in cases:
                    full = [torch.randn(B, sum(lens), h, D, device="cuda", generator=g, dtype=dtype) for h in (hq, hkv, hkv, hq)]
                    off = sum(lens[:rank])
                    q, k, v, dout = (x[:, off : off + lens[rank]] for x in full)
                    ref = _run(q, k, v, dout, 1, kernels, comm, lens)
                    ref2 = _run(q, k, v, dout, 1, kernels, comm, lens)
                    # Allocator churn: blocks handed out early would hold NaN, not stale data.
                    junk = [torch.empty(1 << (14 + i + it), device="cuda").fill_(float("nan")) for i in range(4)]
                    got = _run(q, k, v, dout, chunks, kernels, comm, lens)
                    del junk
                    _check_gpu(ref, ref2, got, exact, f"rank {rank} it {it} {comm_name}/{kernels} {(hq, hkv, lens, B, D, dtype, chunks)}")
    torch.cuda.synchronize()
    print(f"rank {rank}: chunked == unchunked bit for bit in {exact[True]} of {exact[True] + exact[False]} tensors", flush=True)
    for _, comm in comms:
        getattr(comm, "close", lambda: None)()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_stress_two_ranks_one_gpu_nccl():
    """Two NCCL ranks on one GPU: real transfers on the side stream, chunked vs unchunked
    bit for bit, torch and native communicators, every available kernel set, allocator churn.

    Needs NCCL >= 2.30 with several ranks per GPU (``NCCL_MULTI_RANK_GPU_ENABLE=1``, set
    here); skips when NCCL refuses. Runs in subprocesses under a timeout: a hang fails."""
    import os
    import socket
    import subprocess
    import sys
    import tempfile
    import time

    if torch.cuda.nccl.version() < (2, 30):
        pytest.skip(f"NCCL {torch.cuda.nccl.version()} < 2.30: no multi-rank-per-GPU support")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NCCL_MULTI_RANK_GPU_ENABLE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH")]))
    # The ranks write to files, not pipes: a rank that filled its pipe (NCCL_DEBUG=INFO,
    # a long traceback) while the parent waited on the other would block, and with it the
    # collective both are in. One deadline for both ranks, under the 300 s of
    # scripts/gpu_session.sh's two-rank step: a hang is reported here, with the ranks'
    # output, instead of the whole step being killed with nothing to show.
    limit_s = 240
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(2)]  # noqa: SIM115 - closed below, after both ranks end
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r)], env={**env, "RANK": str(r)},
                         stdout=logs[r], stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    deadline, timed_out = time.monotonic() + limit_s, False
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                q.kill()
            for q in procs:
                q.wait()
            break
    outs = []
    for f in logs:
        f.seek(0)
        outs.append(f.read())
        f.close()
    log = "\n".join(f"--- rank {r} ---\n{o[-4000:]}" for r, o in enumerate(outs))
    assert not timed_out, f"two-rank NCCL stress run hung (killed after {limit_s} s)\n{log}"
    codes = [p.returncode for p in procs]
    if all(c == _SKIP_RC for c in codes):
        pytest.skip(f"NCCL refused two ranks on one GPU\n{log}")
    assert codes == [0, 0], f"return codes {codes}\n{log}"
    print(log)


if __name__ == "__main__":
    import os

    _nccl_stress_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kv_index_stays_on_the_device():
    """A chunk's KV gather index is copied to the GPU once per map and reused (no copy per
    chunk, so a captured graph reads no host memory); on the CPU it is a fresh tensor."""
    from ulysses_kernels.gqa import kv_index

    dev = torch.device("cuda", torch.cuda.current_device())
    first = kv_index((0, 0, 1), dev)
    assert first.device == dev and first.tolist() == [0, 0, 1]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        again = kv_index([0, 0, 1], dev)
        torch.cuda.synchronize()
    assert again is first
    assert not [e for e in prof.events() if "Memcpy" in e.name], "the second call copied from the host"
    assert kv_index((0, 0, 1), torch.device("cpu")).device.type == "cpu"
