"""Where the packed rows' time goes: host work, host waits, kernels (issue 37's 0.5x target).

    python -m ulysses_kernels.bench.packed_probe                 # a GPU: llama3-8b's heads on rank 0 of 8, 4K and 32K
    python -m ulysses_kernels.bench.packed_probe --device cpu --seqs 256 --head-dim 16   # CPU dry run (numbers mean nothing)

On the H200 (bench/results/2026-11-30_h200_world) the packed floor (``local-packed``, the
rank's heads over all rows, the documents of ``bench.attention``'s mix) took 1.57 ms fwd+bwd at
4K against 0.38 ms as a CUDA graph, and 2.04 against 1.29 ms at 32K: most of a packed call at
these lengths is not kernel time. For ``local`` and ``local-packed`` this prints, per length:

* ``host``: the host's time per fwd+bwd with no synchronization (the Python and the launches);
* ``device``: CUDA events around the same calls, per call (what ``bench.attention`` reports);
* ``syncs``: host waits on the device in one fwd+bwd (``torch.cuda.set_sync_debug_mode``: each
  one is a warning naming the call site), and where they come from;
* ``kernels``: kernels launched per fwd+bwd and the top five by time (``torch.profiler``).

``host`` close to ``device`` means launch-bound (the host is the floor: a CUDA graph or fewer
launches help); ``syncs`` > 0 means the host waits (the design rule: no rank waits on the host).
CPU runs say so in their header: a dry run of the code paths, no GPU claim.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings

import torch

from ..backends import named_backend
from ..plan import HeadPlan
from .attention.inputs import packed_documents
from .attention.methods import local_method


def _call(method, q, k, v, dout):
    out = method.fn(q, k, v)
    out.backward(dout)


def _syncs(method, q, k, v, dout) -> list[str]:
    """The host waits of one fwd+bwd: the first line of each warning's call site."""
    if q.device.type != "cuda":
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _call(method, q, k, v, dout)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}: {str(w.message).splitlines()[0][:80]}" for w in caught if "synchroniz" in str(w.message)]


def _kernels(method, q, k, v, dout) -> tuple[int, list[tuple[str, float]]]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if q.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        _call(method, q, k, v, dout)
        if q.device.type == "cuda":
            torch.cuda.synchronize()
    events = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    by_name = collections.Counter()
    for e in events:
        by_name[e.name[:60]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return len(events), [(n, us / 1000) for n, us in by_name.most_common(5)]


def probe(seq: int, hq: int, hkv: int, world: int, head_dim: int, device: torch.device, dtype: torch.dtype, iters: int) -> list[dict]:
    plan = HeadPlan.build(hq, hkv, world)
    backend = named_backend(None, device, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    h, hk = plan.q_count(0), plan.kv_count(0)
    q, k, v, dout = (torch.randn(1, seq, n, head_dim, generator=g, device=device, dtype=dtype) for n in (h, hk, hk, h))
    for x in (q, k, v):
        x.requires_grad_()
    rows = []
    for name, docs in (("local", None), ("local-packed", packed_documents(seq))):
        m = local_method(plan, 0, backend, head_dim**-0.5, name, docs=docs)
        for _ in range(3):
            _call(m, q, k, v, dout)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            _call(m, q, k, v, dout)
        host = (time.perf_counter() - t0) / iters * 1e3
        device_ms = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                _call(m, q, k, v, dout)
            b.record()
            torch.cuda.synchronize()
            device_ms = a.elapsed_time(b) / iters
        syncs = _syncs(m, q, k, v, dout)
        try:
            n_kernels, top = _kernels(m, q, k, v, dout)
        except (RuntimeError, AttributeError) as e:  # a profiler API this torch lacks: the timings above still count
            n_kernels, top = -1, [(f"profiler failed: {type(e).__name__}: {e}"[:80], 0.0)]
        count = docs.count if docs else 1
        rows.append({"seq": seq, "method": name, "docs": count, "host_ms": host, "device_ms": device_ms, "syncs": syncs, "kernels": n_kernels, "top": top})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqs", default="4096,32768", help="comma list of global sequence lengths")
    ap.add_argument("--heads", default="32/8", help="global query/KV heads (llama3-8b: 32/8)")
    ap.add_argument("--world", type=int, default=8, help="the rank's heads are those of rank 0 of this many")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("-n", "--iters", type=int, default=20)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hkv = (int(x) for x in args.heads.split("/"))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU: a dry run of the code paths, no GPU claim"
    print(f"# packed probe: {gpu}, torch {torch.__version__}, {dtype}, heads {hq}/{hkv} (rank 0 of {args.world}), head_dim {args.head_dim}")
    for seq in (int(s) for s in args.seqs.split(",")):
        for r in probe(seq, hq, hkv, args.world, args.head_dim, device, dtype, args.iters):
            dev = f"{r['device_ms']:.3f}" if r["device_ms"] is not None else "n/a"
            print(f"S={r['seq']:>7} {r['method']:<13} docs {r['docs']:>4}  host {r['host_ms']:.3f} ms  device {dev} ms  "
                  f"syncs {len(r['syncs'])}  kernels {r['kernels']}")  # fmt: skip
            for s in sorted(set(r["syncs"])):
                print(f"    sync x{r['syncs'].count(s)}: {s}")
            for name, ms in r["top"]:
                print(f"    {ms:8.3f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
