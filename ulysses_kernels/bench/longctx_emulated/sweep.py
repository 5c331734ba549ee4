"""``run(args)``: the whole emulated run (``python -m ulysses_kernels.bench.longctx
--emulate-rank0-of N``): plan, rows, the models built on them, the table, the result files."""

from __future__ import annotations

import concurrent.futures
import json
import os

import torch

from .. import record, sizes
from .calculator import GB
from .extrapolate import layer_models, proxy_check, time_model
from .runner import Runner, plan
from .step import parse_models

COLUMNS = [
    ("model", "model", "s"), ("layers", "L", "d"), ("seq", "seq", "d"), ("pieces", "pieces", "s"), ("attention", "attn", "s"),
    ("status", "status", "s"), ("step_s", "step s", ".2f"), ("params_gb", "params GB", ".2f"), ("act_peak_gb", "act peak GB", ".2f"),
    ("calc_act_peak_gb", "calc GB", ".2f"), ("act_peak_diff", "diff", "+.3f"), ("reserved_gb", "reserved GB", ".2f"),
    ("host_gb", "host GB", ".2f"), ("model_total_gb", "model full GB", ".2f"), ("calc_total_gb", "calc full GB", ".2f"),
]  # fmt: skip


def run(args) -> int:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = sizes.parse_dtype(args.dtype)
    configs = parse_models(args.model, args.emulate_rank0_of)
    layers = [int(x) for x in str(args.layers).split(",")]
    seqs = [sizes.parse_size(s) for s in args.seqs.split(",")]
    s_t = sizes.parse_size(args.time_seq) if args.time_seq else seqs[0]
    runner = Runner(args, device, dtype)
    runner.env = record.env_record(
        device, 1, None, dtype=sizes.dtype_name(dtype), process="rank 0 of an emulated group, one process (comm.EmulatedPeers)",
        gpu_memory_bytes=torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    )  # fmt: skip
    if args.dry_run:  # the plan and each row's estimate at --assume-tflops, nothing run
        total = 0.0
        for job in plan(args, configs, layers, seqs, s_t):
            est = 0.0 if job.probe else runner.estimate(job)
            runner._key = (job.cfg.name, job.cfg.sp, job.layers)  # as if built
            total += est
            print(f"# P{job.priority} {job.cfg.key:16s} L{job.layers} {job.what:14s} {job.attention:6s} {job.pieces:7s} "
                  f"seq {'(probe)' if job.probe else job.seq:>9} ~{est:5.1f} s (sum {total:6.1f} s, probes not counted)")  # fmt: skip
        return 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        if args.max_seq:
            for cfg in configs:
                runner.start_search(cfg, layers[0], args.gpu_gb * GB, pool)
        runner.run_jobs(plan(args, configs, layers, seqs, s_t))
        for s in runner.searches.values():  # a search the budget never reached: its calculator answer still
            if "_calc" in s:
                s["calc_max_seq"] = s.pop("_calc").result()
                other = s.pop("_calc_no_workspace")
                s["calc_max_seq_no_workspace"] = other.result() if other is not None else s["calc_max_seq"]
    times, checks = [], []
    for cfg in configs:
        layer_models(runner, cfg, dtype)
        check = proxy_check(runner, cfg)
        if check is not None:
            checks.append(check)
        s = runner.searches.get(cfg.key)
        t = time_model(runner, cfg, seqs + ([s["longest_fit"], s["calc_max_seq"]] if s and s["longest_fit"] else []))
        if t is not None:
            times.append(t)
    unit = "GB" if device.type == "cuda" else "MB"
    scale = 1.0 if device.type == "cuda" else 1e3
    shown = [{k: v * scale if isinstance(v, float) and k.endswith("_gb") else v for k, v in r.items()} for r in runner.rows]
    for r in shown:
        r["status"] = r["status"].split(":")[0]  # the JSON has the whole reason
    cols = [(k, h.replace("GB", unit), f) for k, h, f in COLUMNS]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU: a code-path check, not a claim"
    record.print_table(cols, shown, title=f"# bench_longctx: rank 0 of an emulated group in one process, {sizes.dtype_name(dtype)}, {where}")
    for t in times:
        print(f"# time, {t['model']} at sp {t['sp']}: measured {json.dumps(t['measured'])}\n#   {t['how']}")
        for x in t["at"]:
            print(f"#   {json.dumps(x)}")
    for c in checks:
        print(f"# proxy attention against causal, {c['model']} at sp {c['sp']}, {c['seq']} tokens: {json.dumps(c)}")
    for s in runner.searches.values():
        print(f"# longest sequence, {s['model']} at sp {s['sp']} on {s['gpu_gb']:g} GB: calculator {s['calc_max_seq']:,}; measured: "
              f"fit {s['longest_fit']}, did not fit {s['shortest_oom']} ({s['stopped'] or 'probes used up'}); {s['probes']}")  # fmt: skip
    if not args.no_write:
        meta = {"args": vars(args), "max_seq": list(runner.searches.values()), "time": times, "proxy_check": checks}
        paths = record.write_results(args.out_dir, "bench_longctx_emulated", runner.env, runner.rows, meta)
        if runner.partial is not None and runner.partial.exists():
            runner.partial.unlink()
        print(f"# wrote {', '.join(paths.values())}", flush=True)
    return 0
