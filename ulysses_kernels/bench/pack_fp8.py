"""The quantizing pack of the FP8 wire (``wire_dtype="fp8"``) against a device copy.

    python -m ulysses_kernels.bench.pack_fp8                  # GPU: the GPU sizes, kernel sets cuda,triton
    python -m ulysses_kernels.bench.pack_fp8 --device cpu     # CPU dry run: tiny sizes, checks only

Per configuration ``Hq/Hkv/P/B/s/D`` (one rank's q/k/v, bf16) and kernel set, five rows:

* ``copy``: ``send.copy_(src)`` of the bytes the plain pack reads (the device's copy bandwidth);
* ``pack``: the plain pack (``pack_s2h``: bf16 in, bf16 out);
* ``pack-fp8``: the quantizing pack (``quant_pack_s2h``, e4m3: bf16 in, D + 4 bytes per head out);
* ``unpack``, ``unpack-fp8``: the head-to-sequence receive side (``unpack_h2s``, ``dequant_unpack_h2s``:
  every source's blocks of dq/dk/dv into ``[B, s, H, D]``, replicated KV heads summed), bf16 and e4m3 blocks.

``GB/s`` = (bytes read + bytes written) / time; ``%copy`` = GB/s / the copy row's GB/s (the goal:
the quantizing pack >= 80% of a device copy's bandwidth, issue 50). Every FP8 row is checked
bit for bit against the torch reference first (``#wrong``). CPU timings are labelled as such and mean
nothing for a GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..kernels import get_kernels
from ..kernels import torch_kernels as R
from ..layout import QKV, Layout
from ..plan import HeadPlan
from ..wire import E4M3, wire_layout
from .record import print_table
from .timing import median, time_iters

GPU_CONFIGS = "32/8/8/1/16384/128,64/8/8/1/8192/128,32/8/16/1/8192/128"
CPU_CONFIGS = "4/2/2/1/16/8,6/2/4/2/8/16"
COLUMNS = [
    ("config", "Hq/Hkv/P/B/s/D", ""), ("kernels", "kernels", ""), ("op", "op", ""), ("bytes", "bytes", "d"),
    ("time_us", "time(us)", ".1f"), ("gbps", "GB/s", ".1f"), ("pct_copy", "%copy", ".1%"), ("ok", "#wrong", ""),
]  # fmt: skip


def rows_for(cfg: tuple[int, ...], name: str, device: torch.device, warmup: int, iters: int) -> list[dict]:
    Hq, Hkv, P, B, s, D = cfg
    lay = Layout(HeadPlan.build(Hq, Hkv, P), 0, (s,) * P, B, D)
    kern = get_kernels(name, device, lay)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, s, h, D, generator=g, device=device, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    n = sum(lay.s2h_send_splits(QKV))
    n8 = sum(wire_layout(lay, E4M3).s2h_send_splits(QKV))
    send, send8 = torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n8, dtype=torch.uint8, device=device)
    src = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
    want = torch.empty_like(send8)
    R.quant_pack_s2h(lay, (q, k, v), QKV, want, E4M3)
    kern.quant_pack_s2h(lay, (q, k, v), QKV, send8, E4M3)
    wrong = int((send8 != want).sum())
    # The head-to-sequence receive side (dq/dk/dv of the backward): each source's blocks back into [B, s, H, D],
    # replicated KV heads summed; plain (bf16 blocks) and dequantizing (wire blocks of D + 4 bytes).
    blocks = [[torch.randn(B, s, lay.head_count(r, p), D, generator=g, device=device).to(torch.bfloat16) for r in QKV] for p in range(P)]
    blocks8 = [[R.wire_rows(b, E4M3) for b in per] for per in blocks]
    outs = [torch.empty(B, s, lay.total_heads(r), D, device=device, dtype=torch.bfloat16) for r in QKV]
    want_outs = [torch.empty_like(o) for o in outs]
    R.dequant_unpack_h2s(lay, blocks8, QKV, want_outs, E4M3)
    kern.dequant_unpack_h2s(lay, blocks8, QKV, outs, E4M3)
    wrong_unpack = sum(int((o != w).sum()) for o, w in zip(outs, want_outs))
    n_in = sum(b.numel() for per in blocks for b in per)
    n_out = sum(o.numel() for o in outs)
    label = f"{Hq}/{Hkv}/{P}/{B}/{s}/{D}"
    ops = {
        "copy": (lambda: send.copy_(src), 2 * n * 2, ""),
        "pack": (lambda: kern.pack_s2h(lay, (q, k, v), QKV, send), 2 * n * 2, ""),
        "pack-fp8": (lambda: kern.quant_pack_s2h(lay, (q, k, v), QKV, send8, E4M3), 2 * n + n8, wrong),
        "unpack": (lambda: kern.unpack_h2s(lay, blocks, QKV, outs), 2 * n_in + 2 * n_out, ""),
        "unpack-fp8": (lambda: kern.dequant_unpack_h2s(lay, blocks8, QKV, outs, E4M3), sum(b.numel() for per in blocks8 for b in per) + 2 * n_out,
                       wrong_unpack),
    }  # fmt: skip
    rows = []
    for op, (fn, nbytes, ok) in ops.items():
        t = median(time_iters(fn, device=device, warmup=warmup, iters=iters, barrier=False))
        rows.append({"config": label, "kernels": name, "op": op, "bytes": nbytes, "time_us": t * 1e6, "gbps": nbytes / t / 1e9, "ok": ok})
    for r in rows:
        r["pct_copy"] = r["gbps"] / rows[0]["gbps"]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernels", default=None, help="comma list (default: cuda,triton on a GPU; torch,cuda on the CPU)")
    ap.add_argument("--configs", default=None, help="comma list of Hq/Hkv/P/B/s/D")
    ap.add_argument("-n", "--iters", type=int, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    names = (args.kernels or ("cuda,triton" if gpu else "torch,cuda")).split(",")
    configs = [tuple(int(x) for x in c.split("/")) for c in (args.configs or (GPU_CONFIGS if gpu else CPU_CONFIGS)).split(",")]
    iters = args.iters or (100 if gpu else 3)
    rows = [r for cfg in configs for name in names for r in rows_for(cfg, name, device, 10 if gpu else 1, iters)]
    title = f"# quantizing pack (e4m3), bf16 in, {device}" + ("" if gpu else " (CPU: a dry run, the times mean nothing for a GPU)")
    print_table(COLUMNS, rows, title=title)
    wrong = sum(r["ok"] for r in rows if r["op"] in ("pack-fp8", "unpack-fp8"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
