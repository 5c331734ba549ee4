"""How much all-to-all time the chunked pipeline hides (forward of one attention layer).

For each sequence length: the all-to-alls alone (q/k/v seq->head + output head->seq), the
local attention alone, and the layer with ``chunks=1``, ``chunks="auto"`` and fixed counts.
``exposed comm = layer - attention``; the target is exposed comm well below the all-to-all
time at long sequences. GPU: NCCL ranks, CUDA events, median of ``--iters`` after
``--warmup``. CPU (no GPU): gloo ranks at tiny sizes, wall clock, labelled as CPU numbers;
this is a smoke run, not a performance claim.

    python bench/bench_overlap.py                      # CPU smoke: 2 ranks, tiny
    python bench/bench_overlap.py --world 8 --seqs 8192,32768,131072 --heads 32 --kv-heads 8

Writes bench/results/overlap_<device>_<time>.json (torch version, git sha, env, rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timer(cuda: bool):
    if cuda:
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def run(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return run


def _median(fn, warmup: int, iters: int, cuda: bool) -> float:
    timer = _timer(cuda)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        times.append(timer(fn))
    # Every rank reports its median; the layer is as slow as its slowest rank.
    t = torch.tensor([statistics.median(times)], device="cuda" if cuda else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank_main(rank: int, world: int, args, out_path: str) -> None:
    from ulysses_kernels import ulysses_attention
    from ulysses_kernels.backends import default_scale, for_rank, resolve_backend
    from ulysses_kernels.comm import TorchCommunicator
    from ulysses_kernels.kernels import get_kernels
    from ulysses_kernels.layout import Layout, Q_ONLY, QKV
    from ulysses_kernels.ops import a2a_head_to_seq, a2a_seq_to_head
    from ulysses_kernels.pipeline import choose_chunks, chunk_plans
    from ulysses_kernels.plan import HeadPlan

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    comm = TorchCommunicator()
    plan = HeadPlan.build(args.heads, args.kv_heads, world)
    rows = []
    for seq in args.seqs:
        s = seq // world
        lay = Layout(plan, rank, (s,) * world, args.batch, args.head_dim)
        q = torch.randn(args.batch, s, args.heads, args.head_dim, device=device, dtype=dtype)
        k = torch.randn(args.batch, s, args.kv_heads, args.head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        kern = get_kernels(args.kernels, device)
        # The kernel the layer runs on this rank (SharedKV where all heads share one KV head).
        backend = for_rank(resolve_backend(None, q), plan.local_kv_map(rank))
        scale = default_scale(args.head_dim, None)
        ql, kl, vl = a2a_seq_to_head(lay, (q, k, v), QKV, comm, kern)
        ol, _ = backend.forward(ql, kl, vl, causal=True, scale=scale, kv_map=plan.local_kv_map(rank), needs_grad=False)

        def a2a():
            a2a_seq_to_head(lay, (q, k, v), QKV, comm, kern)
            a2a_head_to_seq(lay, [ol], Q_ONLY, comm, kern)

        def attn():
            backend.forward(ql, kl, vl, causal=True, scale=scale, kv_map=plan.local_kv_map(rank), needs_grad=False)

        def layer(n):
            with torch.no_grad():
                ulysses_attention(q, k, v, causal=True, comm=comm, kernels=args.kernels, chunks=n, check=False)

        t_a2a = _median(a2a, args.warmup, args.iters, cuda)
        t_attn = _median(attn, args.warmup, args.iters, cuda)
        auto = choose_chunks(lay, q.element_size(), True, device.type)
        counts = sorted({1, auto, *[c for c in args.chunks if len(chunk_plans(plan, c)) == c]})
        for n in counts:
            t = _median(lambda: layer(n), args.warmup, args.iters, cuda)
            rows.append({
                "seq": seq, "chunks": n, "auto": n == auto, "layer_s": t, "attn_s": t_attn, "a2a_s": t_a2a,
                "exposed_comm_s": max(0.0, t - t_attn), "hidden_frac": 1.0 - max(0.0, t - t_attn) / t_a2a if t_a2a else 0.0,
            })  # fmt: skip
    if rank == 0:
        _report(rows, args, world, cuda, out_path)


def _git_sha() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _report(rows, args, world, cuda, out_path) -> None:
    unit = "GPU, CUDA events" if cuda else "CPU gloo, wall clock (smoke numbers, not GPU claims)"
    print(f"# bench_overlap: {world} ranks, {args.heads}/{args.kv_heads} heads, D={args.head_dim}, B={args.batch} [{unit}]")
    print(f"{'seq':>8} {'chunks':>7} {'layer ms':>10} {'attn ms':>9} {'a2a ms':>8} {'exposed ms':>11} {'hidden':>7}")
    for r in rows:
        tag = f"{r['chunks']}{'*' if r['auto'] else ''}"
        print(
            f"{r['seq']:8d} {tag:>7} {r['layer_s'] * 1e3:10.3f} {r['attn_s'] * 1e3:9.3f} {r['a2a_s'] * 1e3:8.3f}"
            f" {r['exposed_comm_s'] * 1e3:11.3f} {r['hidden_frac']:7.1%}"
        )
    print("(* = the count chunks='auto' picks)")
    meta = {
        "bench": "overlap",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "timing": unit,
        "torch": torch.__version__,
        "git_sha": _git_sha(),
        "world_size": world,
        "args": {k: v for k, v in vars(args).items()},
        "env": {k: v for k, v in os.environ.items() if k.startswith("ULYSSES_KERNELS_")},
        "rows": rows,
    }
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(meta, indent=2))
    print(f"wrote {out_path}")


def main(argv=None) -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=torch.cuda.device_count() if cuda else 2)
    p.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 65536] if cuda else [64, 256])
    p.add_argument("--heads", type=int, default=32 if cuda else 8)
    p.add_argument("--kv-heads", type=int, default=8 if cuda else 4)
    p.add_argument("--head-dim", type=int, default=128 if cuda else 16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--kernels", default="auto")
    p.add_argument("--warmup", type=int, default=5 if cuda else 1)
    p.add_argument("--iters", type=int, default=20 if cuda else 3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from ulysses_kernels.testing import run_ranks

    out = args.out or str(ROOT / "bench" / "results" / f"overlap_{'cuda' if cuda else 'cpu'}_{time.strftime('%Y%m%d-%H%M%S')}.json")
    run_ranks(_rank_main, args.world, args, out, backend="nccl" if cuda else "gloo")


if __name__ == "__main__":
    main()
