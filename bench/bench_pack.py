"""Pack/unpack benchmark: the fused kernels against a plain copy of the same bytes.

For each configuration (heads, ranks, batch, tokens per rank, head_dim) and rank 0's layout:

* ``fused pack``: q, k, v (views of one fused QKV projection output) -> the one send buffer
  of ``layout.pack_s2h`` (kernel set ``--kernels``: "cuda" when the extension is built);
* ``torch pack``: the pure-PyTorch reference pack (one copy per stream and peer);
* ``chain``: the permute+contiguous chain other Ulysses implementations run per tensor,
  ``x.reshape(b, s, P, h/P, d).permute(2, 1, 0, 3, 4).contiguous()`` (only where heads divide);
* ``copy``: a device-to-device copy of the same number of bytes, measured in the same run:
  the floor any pack can reach;
* ``fused unpack`` / ``torch unpack``: the received blocks -> ``[B, s_r, H, D]`` outputs.

Times are medians over ``--iters`` runs after ``--warmup`` runs: CUDA events on a GPU, wall
clock on the CPU (labelled "cpu": a smoke run of the code path, not a performance claim).
``ratio`` is time / copy time. A table is printed; CSV and JSON go to ``bench/results/``
with the torch, CUDA and NCCL versions, the device and the git sha.

    python bench/bench_pack.py                  # GPU defaults, or tiny CPU sizes without a GPU
    python bench/bench_pack.py --device cpu --iters 5
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_kernels import layout as L  # noqa: E402
from ulysses_kernels.kernels import get_kernels  # noqa: E402
from ulysses_kernels.layout import Layout, QKV  # noqa: E402
from ulysses_kernels.plan import HeadPlan  # noqa: E402

# (q_heads, kv_heads, world_size, batch, tokens per rank, head_dim)
GPU_CONFIGS = [(32, 8, 8, 1, 8192, 128), (32, 32, 8, 1, 4096, 128), (40, 8, 8, 2, 4096, 128), (64, 8, 8, 1, 16384, 128), (40, 8, 5, 1, 8192, 128)]
CPU_CONFIGS = [(8, 4, 4, 1, 64, 32), (10, 2, 4, 2, 32, 16)]


def _timer(device: torch.device):
    if device.type == "cuda":

        def run(fn, warmup, iters):
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            return statistics.median(times)

    else:

        def run(fn, warmup, iters):
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)

    return run


def _chain(tensors, world):
    """The permute+contiguous chain per tensor, or None where heads do not divide."""
    if any(x.shape[2] % world for x in tensors):
        return None

    def run():
        for x in tensors:
            b, s, h, d = x.shape
            x.reshape(b, s, world, h // world, d).permute(2, 1, 0, 3, 4).contiguous()

    return run


def bench_config(cfg, device, dtype, kernels, warmup, iters):
    hq, hkv, world, batch, seq, d = cfg
    plan = HeadPlan.build(hq, hkv, world)
    lay = Layout(plan, 0, (seq,) * world, batch, d)
    fused = torch.randn(batch, seq, (hq + 2 * hkv) * d, device=device).to(dtype)
    q, k, v = (t.unflatten(-1, (-1, d)) for t in fused.split([hq * d, hkv * d, hkv * d], dim=-1))
    send = torch.empty(sum(lay.s2h_send_splits(QKV)), device=device, dtype=dtype)
    src = torch.empty_like(send)
    kern = get_kernels(kernels, device)
    run = _timer(device)
    rows = []

    def add(op, method, us, nbytes):
        rows.append({"op": op, "method": method, "time_us": us, "bytes": nbytes})

    nbytes = send.numel() * send.element_size()
    copy_us = run(lambda: send.copy_(src), warmup, iters)
    add("pack", "copy", copy_us, nbytes)
    add("pack", f"fused ({kern.name})", run(lambda: kern.pack_s2h(lay, (q, k, v), QKV, send), warmup, iters), nbytes)
    add("pack", "torch", run(lambda: L.pack_s2h(lay, (q, k, v), QKV, send), warmup, iters), nbytes)
    chain = _chain((q, k, v), world)
    if chain is not None:
        add("pack", "chain", run(chain, warmup, iters), nbytes)
    # Unpack of the head-to-sequence all-to-all: attention outputs and dk/dv come back.
    _, recv_splits = lay.h2s_splits(QKV)
    recv = torch.randn(sum(recv_splits), device=device).to(dtype)
    blocks = lay.h2s_recv_views(recv, QKV)
    outs = [torch.empty(batch, seq, lay.total_heads(s), d, device=device, dtype=dtype) for s in QKV]
    out_bytes = sum(o.numel() for o in outs) * recv.element_size()
    dst = torch.empty(sum(recv_splits), device=device, dtype=dtype)
    ucopy = run(lambda: dst.copy_(recv), warmup, iters)
    add("unpack", "copy", ucopy, recv.numel() * recv.element_size())
    add("unpack", f"fused ({kern.name})", run(lambda: kern.unpack_h2s(lay, blocks, QKV, outs), warmup, iters), out_bytes)
    add("unpack", "torch", run(lambda: L.unpack_h2s(lay, blocks, QKV, outs), warmup, iters), out_bytes)
    for r in rows:
        base = copy_us if r["op"] == "pack" else ucopy
        r.update(config=f"{hq}/{hkv} P{world} B{batch} s{seq} D{d}", ratio=r["time_us"] / base,
                 gbps=2 * r["bytes"] / r["time_us"] / 1e3)  # read + write
    return rows


def _meta(device):
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = "unknown"
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except (RuntimeError, AttributeError):
        nccl = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (wall clock; not GPU numbers)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "git_sha": sha,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--kernels", default="auto", help="kernel set of the fused rows (auto, cuda, triton, torch)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    configs = GPU_CONFIGS if gpu else CPU_CONFIGS
    warmup = args.warmup if args.warmup is not None else (10 if gpu else 1)
    iters = args.iters if args.iters is not None else (100 if gpu else 5)
    kernels = None if args.kernels == "auto" else args.kernels
    if not gpu and kernels is None:
        kernels = "cuda" if "cuda" in __import__("ulysses_kernels.kernels", fromlist=["x"]).available_kernels() else "torch"
    meta = _meta(device)
    print(f"# bench_pack on {meta['device']} | torch {meta['torch']} | NCCL {meta['nccl']} | git {meta['git_sha']} | {args.dtype} | median of {iters}")
    rows = []
    for cfg in configs:
        rows += bench_config(cfg, device, getattr(torch, args.dtype), kernels, warmup, iters)
    print(f"{'config':<28} {'op':<7} {'method':<14} {'time_us':>10} {'GB/s':>8} {'x copy':>7}")
    for r in rows:
        print(f"{r['config']:<28} {r['op']:<7} {r['method']:<14} {r['time_us']:10.1f} {r['gbps']:8.1f} {r['ratio']:7.2f}")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bench_pack_{'gpu' if gpu else 'cpu'}_{time.strftime('%Y%m%d_%H%M%S')}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": dict(meta, dtype=args.dtype, warmup=warmup, iters=iters), "rows": rows}, f, indent=1)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["config", "op", "method", "time_us", "gbps", "ratio", "bytes"])
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in w.fieldnames})
    print(f"# wrote {stem}.json and .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
