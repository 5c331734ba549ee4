"""What the attention benchmark prints and draws: the header, the table with its ratios
(``x_chain``, ``x_floor``, ``x_equal``, ``x_dense``, ``extra_gib``), the breakdown of each
ulysses row into compute, layout and exposed communication, and its bar chart."""

from __future__ import annotations

import torch

from ulysses_kernels import extension
from ulysses_kernels.bench import record, sizes, timing
from ulysses_kernels.kernels import get_kernels


def print_header(args, world: int, P: int, backend_name: str, device: torch.device, dtype, names) -> None:
    lab = "" if device.type == "cuda" else f"  [{record.CPU_LABEL}]"
    emu = f" (one process: rank 0 of an emulated {P}-way group)" if world == 1 and P > 1 else ""
    print(f"# bench_attention: {world} ranks{emu}, {backend_name}, {device.type}, {sizes.dtype_name(dtype)}, "
          f"batch {args.batch}, head_dim {args.head_dim}, causal, warmup {args.warmup_iters}, iters {args.iters}{lab}", flush=True)  # fmt: skip
    print(f"# methods: {', '.join(names)}", flush=True)
    default = get_kernels(None, device).name
    print(f"# default here (kernels='auto'): {default}, kernel variant {extension.pack_variant()} (ULYSSES_KERNELS_PACK_VARIANT)", flush=True)


def report(rows, breakdown, notes: dict, device: torch.device) -> None:
    """The table, the breakdown, the skipped methods with their reasons, the wrong total."""
    cuda = device.type == "cuda"
    spread = "# time: median over the iterations, q1/q3 its quartiles"
    record.print_table(COLUMNS, rows, title=spread if cuda else f"{spread}; {record.CPU_LABEL}: a code-path check; peak memory n/a on the CPU")
    for r in rows:  # a layer faster than its attention alone: noise, not a win
        flag = timing.floor_flag(r, {"time_ms": r["time_ms"] / r["x_floor"]}, "time_ms", "attention alone") if r.get("x_floor") else None
        if flag and not r["method"].startswith("local"):
            print(f"# {r['model']} seq {r['seq']} {r['method']} {r['pass']}: {flag}", flush=True)
    if breakdown:
        record.print_table(BREAKDOWN_COLUMNS, breakdown, title="# layer time = compute (local) + layout + exposed communication")
    if not cuda and any(r["method"].endswith("-cuda") for r in rows):
        print("# ulysses-cuda, layout-cuda on a CPU: the C++ extension's CPU twin of the CUDA kernels", flush=True)
    for k, why in notes.items():
        print(f"# skipped {k}: {why}", flush=True)
    bad = sum(r["wrong"] or 0 for r in rows)
    print(f"# wrong elements: {bad} {'OK' if bad == 0 else 'FAILED'}", flush=True)


def _ratios(rows):
    """x_chain: the chain's time over this row's (layout rows: chain-layout's over this);
    x_floor: this row's time over the local floor's (attention rows only; packed rows:
    over local-packed's); x_equal: a packed row's time over its equal-length row's;
    extra_gib: this row's peak memory over the local floor's (the buffers and copies of the
    all-to-alls; GPU only)."""
    by = {(r["method"], r["pass"]): r for r in rows}
    for r in rows:
        equal = by.get(("equal-" + r["method"][len("packed-") :], r["pass"])) if r["method"].startswith("packed-") else None
        r["x_equal"] = r["time_ms"] / equal["time_ms"] if equal else None
        is_layout = r["method"].startswith("layout-") or r["method"] == "chain-layout"
        chain = by.get(("chain-layout" if is_layout else "chain", r["pass"]))
        name = r["method"]
        floor = "local-packed" if name.startswith(("packed-", "local-packed")) else None if name.startswith("equal-") else "local"
        local = by.get((floor, r["pass"]))
        # a graphed row against the graphed dense row (both without host time) where it ran
        dense = (name.endswith("+graph") and by.get(("local+graph", r["pass"]))) or by.get(("local", r["pass"]))
        packed = name.startswith(("packed-", "local-packed"))
        r["x_dense"] = r["tflops"] / dense["tflops"] if packed and dense and r["tflops"] and dense["tflops"] else None
        r["x_chain"] = chain["time_ms"] / r["time_ms"] if chain else None
        r["x_floor"] = r["time_ms"] / local["time_ms"] if local and not is_layout else None
        has_mem = local and r["mem_gib"] is not None and local["mem_gib"] is not None and not is_layout
        r["extra_gib"] = r["mem_gib"] - local["mem_gib"] if has_mem else None


def _breakdown(rows):
    out = []
    by = {(r["model"], r["seq"], r["method"], r["pass"]): r for r in rows}
    for r in rows:
        if not r["method"].startswith("ulysses-"):
            continue
        kern = r["method"][len("ulysses-") :]
        # The attention the layer runs: SharedKV where this rank's heads share one KV head.
        local = by.get((r["model"], r["seq"], "local-sharedkv", r["pass"])) or by.get((r["model"], r["seq"], "local", r["pass"]))
        lay = by.get((r["model"], r["seq"], f"layout-{kern}", r["pass"]))
        if not local or not lay:
            continue
        out.append({
            "model": r["model"], "seq": r["seq"], "pass": r["pass"], "kernels": kern, "total_ms": r["time_ms"],
            "compute_ms": local["time_ms"], "layout_ms": lay["time_ms"],
            "exposed_comm_ms": r["time_ms"] - local["time_ms"] - lay["time_ms"],
        })  # fmt: skip
    return out


COLUMNS = [
    ("model", "model", ""), ("seq", "seq", "d"), ("world", "P", "d"), ("method", "method", ""), ("pass", "pass", ""),
    ("backend", "backend", ""), ("time_ms", "time(ms)", ".3f"), ("time_q1_ms", "q1", ".3f"), ("time_q3_ms", "q3", ".3f"),
    ("tflops", "TFLOP/s", ".1f"), ("x_chain", "x_chain", ".2f"),
    ("x_floor", "x_floor", ".2f"), ("mem_gib", "mem(GiB)", ".2f"), ("extra_gib", "extra(GiB)", ".2f"),
    ("docs", "docs", "d"), ("x_equal", "x_equal", ".2f"), ("x_dense", "x_dense", ".2f"), ("ring_steps", "steps", ""), ("ring_hops", "hops", ""),
    ("wrong", "#wrong", "d"),
]  # fmt: skip


BREAKDOWN_COLUMNS = [
    ("model", "model", ""), ("seq", "seq", "d"), ("pass", "pass", ""), ("kernels", "kernels", ""),
    ("total_ms", "total(ms)", ".3f"), ("compute_ms", "compute", ".3f"), ("layout_ms", "layout", ".3f"),
    ("exposed_comm_ms", "exposed comm", ".3f"),
]  # fmt: skip


def plot(breakdown, path, env) -> bool:
    plt = record.load_pyplot()
    if plt is None or not breakdown:
        return False
    sel = [b for b in breakdown if b["pass"] == "fwdbwd"] or breakdown
    labels = [f"{b['model']}\n{b['seq']}\n{b['kernels']}" for b in sel]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(sel)), 4.5))
    x = list(range(len(sel)))
    c = [b["compute_ms"] for b in sel]
    lay = [b["layout_ms"] for b in sel]
    com = [max(0.0, b["exposed_comm_ms"]) for b in sel]
    ax.bar(x, c, label="compute (local floor)")
    ax.bar(x, lay, bottom=c, label="layout (pack/unpack)")
    ax.bar(x, com, bottom=[a + b for a, b in zip(c, lay)], label="exposed communication")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_ylabel("ms per layer (" + sel[0]["pass"] + ")")
    ax.set_title(f"Ulysses attention, {env['world_size']} ranks, {record.device_label(env)}")
    ax.legend()
    return record.save_figure(plt, fig, path)
