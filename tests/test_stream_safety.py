"""Stream safety of the chunked pipeline with real data movement: ranks as threads.

The ranks are threads of this process talking through the fake communicator of
``ulysses_kernels.testing.thread_ranks`` (``ThreadGroup``), which moves real bytes, fills
every receive piece with NaN until its data lands and, on CUDA, orders the collectives on
each rank's current stream as NCCL does (with random GPU sleeps widening race windows). On
one GPU this is the only way here to make the pipeline's side-stream collectives move bytes
(two NCCL ranks on one GPU need NCCL >= 2.30; world size 1 moves nothing). The fake's own
tests are in test_thread_ranks.py.

* CPU: the chunked op through the fake equals the unchunked one bit for bit, and the
  unchunked one is real attention (against the float64 reference);
* GPU: two or three thread ranks on one GPU, each on its own stream: no NaN anywhere,
  chunked vs unchunked, unchunked vs SDPA over the whole sequence; and the chunked forward
  and backward make no host sync.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from ulysses_kernels import ulysses_attention
from ulysses_kernels.attention.chunked import chunk_plans
from ulysses_kernels.kernels import available_kernels
from ulysses_kernels.plan import HeadPlan
from ulysses_kernels.testing import ThreadGroup
from ulysses_kernels.testing.reference import attention_reference


# ---- CPU: the op through the fake (chunked == unchunked, bit for bit) -------------------------
def _attention(q, k, v, dout, chunks, comm, lens, causal=True, kernels="torch"):
    """Forward + backward of ``ulysses_attention`` on fresh leaves: ``[out, dq, dk, dv]``."""
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
