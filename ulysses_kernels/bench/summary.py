"""A short, labelled benchmark summary for a first run (what ``scripts/demo.sh`` prints).

    python -m ulysses_kernels.bench.summary                 # 2 gloo ranks on this CPU, about a minute
    python -m ulysses_kernels.bench.summary --out-dir DIR   # keep the CSV/JSON files

Runs two benchmarks at one small size each, on gloo ranks on the CPU, every row checked,
and prints a few lines: our all-to-all of q/k/v against the permute chain (the
DeepSpeed/yunchang way) and the bare collective, then the attention layer (forward and
backward) against the chain and against attention alone. These are CPU timings: they show
that the code paths run and what they cost here, not what a GPU does. The full tables:
``python -m ulysses_kernels.bench.<name>`` (see bench/README.md), or
``ULYSSES_KERNELS_DEMO_BENCH=full bash scripts/demo.sh`` for every benchmark at tiny sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ulysses_kernels.bench import harness, record, timing
from ulysses_kernels.kernels import available_kernels

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16  # Llama-3-8B's 4:1 grouping, scaled down
LABEL = "CPU timings, not a GPU claim"
WIDTH = 44  # of the row labels


def our_kernel_sets() -> list[str]:
    """``torch`` (what ``kernels="auto"`` runs on CPU tensors), and ``cuda`` when the C++
    extension is built: on the CPU that is its CPU twin of the CUDA kernels."""
    return ["torch"] + (["cuda"] if "cuda" in available_kernels() else [])


def ours_label(kernels: str) -> str:
    cpu = torch.device("cpu")
    what = "torch kernels" if kernels == "torch" else f"{record.kernel_label(kernels, cpu).split(': ')[-1]} kernels"
    return f"ours ({what})"


def run_module(name: str, argv: list[str], out_dir: Path) -> dict:
    """Run ``python -m ulysses_kernels.bench.<name> argv`` with its output captured (shown
    only when it fails) and return the result document it wrote."""
    cmd = [sys.executable, "-m", f"ulysses_kernels.bench.{name}", *argv, "--out-dir", str(out_dir)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread per rank: ranks share the cores
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"summary: `{' '.join(cmd[1:])}` failed (exit {proc.returncode}); its output is above")
    return json.loads((out_dir / f"bench_{name}_latest.json").read_text())


def row_line(label: str, ms: float, note: str = "") -> str:
    return f"    {label:<{WIDTH}} {ms:8.3f} ms  {note}".rstrip()


def _in_ms(row: dict) -> dict:
    """An all-to-all row's times (us) in ms, as the summary prints them."""
    return {f"time{k}_ms": row[f"time{k}_us"] / 1e3 for k in ("", "_q1", "_q3") if row.get(f"time{k}_us") is not None}


def alltoall_lines(doc: dict, sets: list[str]) -> list[str]:
    rows = {r["op"]: r for r in doc["rows"]}
    skipped = doc["meta"].get("skipped", {})
    chain, floor, floor_name = _in_ms(rows["chain"]), _in_ms(rows["a2a"]), "the bare all-to-all"
    lines = [f"  all-to-all of q, k, v ({HEADS} query / {KV_HEADS} KV heads), {rows['chain']['size'] / 1024:.0f} KiB per rank:",
             row_line("permute chain (DeepSpeed/yunchang style)", chain["time_ms"], timing.floor_flag(chain, floor, "time_ms", floor_name) or "")]  # fmt: skip
    for k in sets:
        r = rows.get(f"fused-{k}")
        if r is None:
            lines.append(f"    {ours_label(k):<{WIDTH}} skipped: {skipped.get(f'fused-{k}', 'no row')}")
        else:
            ours = _in_ms(r)
            note = timing.speedup_text(chain, ours, "time_ms", "the chain", cpu=True, floor=floor, floor_name=floor_name)
            lines.append(row_line(ours_label(k), ours["time_ms"], note))
    lines.append(row_line("bare all_to_all_single (the floor)", rows["a2a"]["time_us"] / 1e3))
    return lines


def attention_lines(doc: dict, sets: list[str], seq: int) -> list[str]:
    rows = {r["method"]: r for r in doc["rows"] if r["pass"] == "fwdbwd"}
    skipped = doc["meta"].get("skipped", {})
    chain, floor, floor_name = rows["chain"], rows["local"], "attention alone"
    lines = [f"  attention layer, forward + backward ({HEADS} query / {KV_HEADS} KV heads), {seq} tokens:",
             row_line("permute chain", chain["time_ms"], timing.floor_flag(chain, floor, "time_ms", floor_name) or "")]  # fmt: skip
    for k in sets:
        r = rows.get(f"ulysses-{k}")
        if r is None:
            why = next((v for key, v in skipped.items() if key.endswith(f" ulysses-{k}")), "no row")
            lines.append(f"    {ours_label(k):<{WIDTH}} skipped: {why}")
        else:
            note = timing.speedup_text(chain, r, "time_ms", "the chain", cpu=True, floor=floor, floor_name=floor_name)
            lines.append(row_line(ours_label(k), r["time_ms"], note))
    lines.append(row_line("attention alone (no communication)", rows["local"]["time_ms"]))
    return lines


def summarize(args, out_dir: Path) -> list[str]:
    """Run both benchmarks into ``out_dir``; the summary's lines."""
    sets = our_kernel_sets()
    n = str(args.spawn)
    a2a = run_module("alltoall", ["--spawn", n, "-b", args.size, "-e", args.size, "-w", "2", "-n", str(args.iters),
                                  "--op", ",".join(["a2a", "chain"] + [f"fused-{k}" for k in sets]), "--heads", str(HEADS),
                                  "--kv-heads", str(KV_HEADS), "--head-dim", str(HEAD_DIM), "--no-progress"], out_dir)  # fmt: skip
    methods = ["local", "chain"] + [f"ulysses-{k}" for k in sets]
    attn = run_module("attention", ["--spawn", n, "--layouts", f"{HEADS}/{KV_HEADS}", "--seqs", str(args.seq),
                                    "--head-dim", str(HEAD_DIM), "-w", "1", "-n", str(max(1, args.iters // 3)),
                                    "--methods", ",".join(methods), "--passes", "fwdbwd"], out_dir)  # fmt: skip
    seq = attn["rows"][0]["seq"] if attn["rows"] else args.seq
    wrong = sum(r["wrong"] or 0 for doc in (a2a, attn) for r in doc["rows"])
    lines = [
        f"Benchmarks at one small size, {args.spawn} gloo ranks on this CPU ({LABEL}; median times; a speed-up's quartiles: "
        "the ratio between the two rows' quartile times over the iterations):"
    ]
    lines += alltoall_lines(a2a, sets) + attention_lines(attn, sets, seq)
    lines.append(f"  every row checked against its reference: {wrong} wrong elements")
    lines.append("  full tables: ULYSSES_KERNELS_DEMO_BENCH=full bash scripts/demo.sh; on GPUs: bench/README.md")
    return lines


def parse_args(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--spawn", type=int, default=2, metavar="N", help="gloo ranks on the CPU (default 2)")
    p.add_argument("--size", default="64K", help="bytes of q, k, v per rank for the all-to-all (default 64K)")
    p.add_argument("--seq", type=int, default=256, help="global tokens for the attention layer (default 256)")
    p.add_argument("-n", "--iters", type=int, default=9, help="timed all-to-all iterations (attention: a third; default 9)")
    p.add_argument("--out-dir", default=None, help="keep the benchmarks' CSV/JSON/PNG here (default: a temporary directory, removed)")
    args = p.parse_args(argv)
    if args.spawn < 2 or HEADS % args.spawn:
        p.error(f"--spawn: expected 2, 4 or 8 ranks (the chain needs the {HEADS} query heads to divide over them), got {args.spawn}")
    if args.iters < 1:
        p.error(f"-n/--iters must be >= 1, got {args.iters}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out_dir is not None:
        lines = summarize(args, Path(args.out_dir))
        lines.append(f"  files: {args.out_dir}")
    else:
        with tempfile.TemporaryDirectory(prefix="ulysses_bench_summary_") as tmp:
            lines = summarize(args, Path(tmp))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
