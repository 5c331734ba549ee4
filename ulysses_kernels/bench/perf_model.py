"""The performance model of docs/performance.md, as a table you can re-run.

    python -m ulysses_kernels.bench.perf_model                                  # 8 GPUs, NVLink, defaults
    python -m ulysses_kernels.bench.perf_model --worlds 8,16,32 --seqs 32K,1M   # 2 and 4 nodes over InfiniBand
    python -m ulysses_kernels.bench.perf_model --attention-json bench_results/bench_attention_latest.json

Per rank and per attention layer (batch B, global sequence S over P ranks, s = S/P tokens
per rank, head_dim D, e bytes per element, the plan of ``HeadPlan.build(Hq, Hkv, P)``):

  compute   fwd: 4*B*S^2*h*D/2 FLOPs (causal) / fwd TFLOP/s, h = most query heads on a rank;
            bwd: 2.5x the FLOPs / bwd TFLOP/s
  wire      ours fwd: q/k/v s2h, rank r sends e*B*s*D*sum_{p!=r}(hq(p)+2*hkv(p)) (KV heads
            replicated per the plan) and receives e*B*s*D*(P-1)*(hq(r)+2*hkv(r)); output h2s
            sends e*B*s*D*(P-1)*hq(r). chain fwd: e*B*s*D*(Hq + 2*Hkv')*(P-1)/P for q/k/v
            (Hkv' = Hq when Hkv % P != 0: the chain repeats KV heads) plus the output.
            bwd mirrors fwd. time = max over ranks of max(sent, received) bytes over the link:
            NVLink busbw for peers in the node, one NIC's bandwidth for peers off the node
            (the two run concurrently: the larger wins).
  layout    bytes read + written by copies / HBM copy bandwidth. ours fwd: one pack of q/k/v
            (send bytes) + one unpack of the output; chain fwd: two copies per tensor
            (permute+contiguous before and after the collective) for q, k, v and the output,
            plus the KV repeat. bwd mirrors fwd.
  total     compute + wire + layout (chunks=1: nothing overlaps, all communication exposed)
  fp8       the same with wire_dtype="fp8": D + 4 bytes per head per token on the wire instead
            of e*D (FP8 values, a float32 scale per (token, head)), the layout (e*D + D + 4)
            per head moved; x_fp8 = ours / fp8 (columns "fp8 wire", "fp8(ms)", "x_fp8")

Hybrid (``--hybrid``): Ulysses over ``U`` contiguous ranks x ring attention over ``R``
(``make_sp_groups(U, R)``, zigzag layout: every rank the same causal work), per rank:

  compute   the flat formula with h = most query heads on a rank of ``HeadPlan.build(Hq, Hkv, U)``,
            divided by R (each rank's queries are 1/R of the sequence), in R equal steps
  ulysses   the all-to-alls above over the U ranks of a Ulysses group, s = S/P tokens each
  ring      per step, K/V of the rank's block (e*B*(S/R)*D*2*hkv bytes; bwd: also dK/dV in
            float32) to the next ring rank, over InfiniBand when the ring leaves the node,
            else NVLink; each transfer overlaps that step's attention, so the ring costs
            c + (R-1)*max(c, w) (c, w: one step's compute and transfer); ring exposed = the
            part above R*c
  total     ulysses + layout + ring

Constants default to published figures (see docs/performance.md for the sources) and are
all options; ``--attention-json`` replaces compute and layout times by those measured by
``ulysses_kernels.bench.attention`` (its ``bench_attention_latest.json``; rows ``local``, ``layout-<k>``, ``chain-layout`` with the same
model, sequence, pass and group size). Nothing here is a measurement unless it says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ulysses_kernels.bench import harness
from ulysses_kernels.bench.record import print_table
from ulysses_kernels.bench.sizes import MODELS, parse_size
from ulysses_kernels.plan import HeadPlan, PlanError


def wire_seconds(send_to: list[float], recv_from: list[float], rank: int, gpus_per_node: int, nvl: float, ib: float) -> float:
    """One rank's all-to-all time: per-peer bytes split into in-node (NVLink) and off-node
    (InfiniBand) traffic, sent and received concurrently; bandwidths in bytes/s."""
    node = rank // gpus_per_node
    t = 0.0
    for per_peer in (send_to, recv_from):
        intra = sum(b for p, b in enumerate(per_peer) if p != rank and p // gpus_per_node == node)
        inter = sum(b for p, b in enumerate(per_peer) if p // gpus_per_node != node)
        t = max(t, intra / nvl, inter / ib if inter else 0.0)
    return t


def exchange_seconds(heads_s2h: list[int], heads_h2s: list[int], head_bytes: float, gpus_per_node: int, nvl: float, ib: float) -> float:
    """The slowest rank's sequence-to-head exchange of ``heads_s2h[p]`` heads per rank ``p``
    followed by the head-to-sequence one of ``heads_h2s[p]`` (``head_bytes``: one head of one
    rank's tokens); the group is ranks ``0 .. len(heads_s2h) - 1``."""
    n, t = len(heads_s2h), 0.0
    for r in range(n):
        s2h = wire_seconds([head_bytes * heads_s2h[p] for p in range(n)], [head_bytes * heads_s2h[r]] * n, r, gpus_per_node, nvl, ib)
        h2s = wire_seconds([head_bytes * heads_h2s[r]] * n, [head_bytes * heads_h2s[p] for p in range(n)], r, gpus_per_node, nvl, ib)
        t = max(t, s2h + h2s)
    return t


def model_layer(Hq, Hkv, P, S, args) -> dict | None:
    """Seconds per layer for one pass direction set; None when the plan is impossible."""
    try:
        plan = HeadPlan.build(Hq, Hkv, P)
    except PlanError:
        return None
    B, D, e, G = args.batch, args.head_dim, args.bytes, args.gpus_per_node
    s = S / P
    tok = e * B * D  # bytes of one head of one token
    nvl, ib, hbm = args.nvlink_busbw * 1e9, args.ib_busbw * 1e9, args.hbm_bw * 1e12
    hq = [plan.q_count(r) for r in range(P)]
    hkv = [plan.kv_count(r) for r in range(P)]
    qkv = [hq[r] + 2 * hkv[r] for r in range(P)]

    # ours: s2h of q/k/v (fwd) and of dout (bwd); h2s of the output (fwd) and dq/dk/dv (bwd)
    wire = {"fwd": exchange_seconds(qkv, hq, s * tok, G, nvl, ib), "bwd": exchange_seconds(hq, qkv, s * tok, G, nvl, ib)}
    send_qkv = s * tok * (Hq + 2 * plan.kv_sent)  # the pack writes every byte sent, once
    lay = {"fwd": 2 * (send_qkv + s * tok * Hq) / hbm, "bwd": 2 * (s * tok * Hq + send_qkv) / hbm}
    # wire_dtype="fp8" (ulysses_kernels.wire): D + 4 bytes per head per token on the wire (FP8
    # values and a float32 scale); the quantizing pack reads e*D and writes D + 4 bytes, the
    # dequantizing unpack the reverse: the layout moves (e*D + D + 4) per head instead of 2*e*D.
    tok8 = B * (D + 4)
    wire8 = {"fwd": exchange_seconds(qkv, hq, s * tok8, G, nvl, ib), "bwd": exchange_seconds(hq, qkv, s * tok8, G, nvl, ib)}
    heads_qkv = Hq + 2 * plan.kv_sent
    lay8 = dict.fromkeys(("fwd", "bwd"), s * (tok + tok8) * (heads_qkv + Hq) / hbm)

    chain = None
    if Hq % P == 0:
        kv_c = Hkv if Hkv % P == 0 else Hq
        per = [s * tok * (Hq + 2 * kv_c) / P] * P
        out = [s * tok * Hq / P] * P
        t_in = max(wire_seconds(per, per, r, G, nvl, ib) for r in range(P))
        t_out = max(wire_seconds(out, out, r, G, nvl, ib) for r in range(P))
        rep = 2 * s * tok * (Hkv + Hq) if kv_c != Hkv else 0.0  # read Hkv, write Hq, for k and v
        copies = 2 * 2 * s * tok * (Hq + 2 * kv_c + Hq)  # two copies (read+write) per tensor
        chain = {"wire": {"fwd": t_in + t_out, "bwd": t_in + t_out}, "layout": {"fwd": (copies + rep) / hbm, "bwd": (copies + rep) / hbm}}

    flops_fwd = 4 * B * S * S * max(hq) * D / 2
    compute = {"fwd": flops_fwd / (args.fwd_tflops * 1e12), "bwd": 2.5 * flops_fwd / (args.bwd_tflops * 1e12)}
    return {"plan": plan, "compute": compute, "wire": wire, "layout": lay, "chain": chain, "wire_fp8": wire8, "layout_fp8": lay8}


def ring_crosses_nodes(U: int, R: int, gpus_per_node: int) -> bool:
    """Some hop of a ring group (ranks u, u+U, ...) joins two nodes."""
    return any((j * U + u) // gpus_per_node != ((j + 1) % R * U + u) // gpus_per_node for u in range(U) for j in range(R) if R > 1)


def model_hybrid(Hq, Hkv, U, R, S, args) -> dict | None:
    """Seconds per layer of the Ulysses x ring hybrid (module docstring); None when the
    Ulysses plan is impossible (U > Hq)."""
    try:
        plan = HeadPlan.build(Hq, Hkv, U)
    except PlanError:
        return None
    B, D, e, G = args.batch, args.head_dim, args.bytes, args.gpus_per_node
    s, tok = S / (U * R), e * B * D
    nvl, ib, hbm = args.nvlink_busbw * 1e9, args.ib_busbw * 1e9, args.hbm_bw * 1e12
    hq, hkv = [plan.q_count(r) for r in range(U)], [plan.kv_count(r) for r in range(U)]
    qkv = [hq[r] + 2 * hkv[r] for r in range(U)]

    flops_fwd = 4 * B * S * S * max(hq) * D / 2 / R
    step_c = {"fwd": flops_fwd / R / (args.fwd_tflops * 1e12), "bwd": 2.5 * flops_fwd / R / (args.bwd_tflops * 1e12)}
    link = ib if ring_crosses_nodes(U, R, G) else nvl
    kv_bytes = (S / R) * B * D * 2 * max(hkv)
    step_w = {"fwd": kv_bytes * e / link, "bwd": kv_bytes * (e + 4) / link}  # bwd: K/V and float32 dK/dV
    ring = {p: step_c[p] + (R - 1) * max(step_c[p], step_w[p]) for p in ("fwd", "bwd")}
    send_qkv = s * tok * (Hq + 2 * plan.kv_sent)
    return {
        "plan": plan,
        "compute": {p: R * step_c[p] for p in ring},
        "ulysses": {"fwd": exchange_seconds(qkv, hq, s * tok, G, nvl, ib), "bwd": exchange_seconds(hq, qkv, s * tok, G, nvl, ib)},
        "ring_wire": {p: (R - 1) * step_w[p] for p in ring},
        "ring": ring,
        "layout": {"fwd": 2 * (send_qkv + s * tok * Hq) / hbm, "bwd": 2 * (s * tok * Hq + send_qkv) / hbm},
        "crosses": link == ib,
    }


def hybrid_table(args) -> list[dict]:
    """One row per (model, P, split U x R with U | P, sequence, pass); R = 1 is Ulysses alone."""
    rows = []
    names = list(MODELS) if args.models == "all" else args.models.split(",")
    for model in names:
        Hq, Hkv = MODELS[model]
        for P in (int(x) for x in args.worlds.split(",")):
            for U in (u for u in range(1, P + 1) if P % u == 0):
                for S in (parse_size(x) for x in args.seqs.split(",")):
                    m = model_hybrid(Hq, Hkv, U, P // U, S, args)
                    if m is None:
                        continue
                    rows += [_hybrid_row(model, P, U, S, p, m) for p in args.passes.split(",")]
    return rows


def _hybrid_row(model: str, P: int, U: int, S: int, p: str, m: dict) -> dict:
    parts = ("fwd", "bwd") if p == "fwdbwd" else (p,)
    get = {key: sum(m[key][x] for x in parts) for key in ("compute", "ulysses", "ring_wire", "ring", "layout")}
    total = get["ulysses"] + get["layout"] + get["ring"]
    return {
        "model": model, "P": P, "U": U, "R": P // U, "seq": S, "pass": p, "compute_ms": get["compute"] * 1e3,
        "ulysses_ms": get["ulysses"] * 1e3, "ring_wire_ms": get["ring_wire"] * 1e3,
        "ring_exposed_ms": (get["ring"] - get["compute"]) * 1e3, "layout_ms": get["layout"] * 1e3,
        "total_ms": total * 1e3, "exposed": 1 - get["compute"] / total, "ring_link": "IB" if m["crosses"] else "NVLink",
    }  # fmt: skip


HYBRID_COLUMNS = [
    ("model", "model", ""), ("P", "P", "d"), ("U", "U", "d"), ("R", "R", "d"), ("seq", "seq", "d"), ("pass", "pass", ""),
    ("compute_ms", "compute(ms)", ".2f"), ("ulysses_ms", "a2a(ms)", ".2f"), ("ring_wire_ms", "ring wire", ".2f"),
    ("ring_exposed_ms", "ring exposed", ".2f"), ("layout_ms", "layout(ms)", ".3f"), ("total_ms", "total(ms)", ".2f"),
    ("exposed", "exposed", ".1%"), ("ring_link", "ring link", ""),
]  # fmt: skip


MAKE_ATTENTION_JSON = (
    "it is written by the attention benchmark, e.g. `python -m ulysses_kernels.bench.attention --sp 8` "
    "(bench_attention_latest.json in its --out-dir, default ./bench_results; in a checkout "
    "`python bench/bench_attention.py --sp 8` writes bench/results/); without --attention-json "
    "the table is the model alone"
)


def measured(path: str | None) -> dict:
    """(model, seq, P, pass, method) -> seconds from a bench_attention JSON; a missing or
    unreadable file exits with a message saying what is missing and what writes it."""
    if not path:
        return {}
    if not Path(path).is_file():
        raise SystemExit(f"perf_model: --attention-json {path}: no such file; {MAKE_ATTENTION_JSON}")
    try:
        rows = json.loads(Path(path).read_text())["rows"]
        return {(r["model"], int(r["seq"]), int(r["world"]), r["pass"], r["method"]): r["time_ms"] / 1e3 for r in rows}
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(
            f"perf_model: --attention-json {path}: expected a bench_attention result (a JSON object whose "
            f"'rows' have model, seq, world, pass, method, time_ms), got {type(e).__name__}: {e}"
        ) from None


def check_attention_json(args, rows: list[dict]) -> None:
    """``--attention-json`` that matches no row of the table is refused (before, the table was
    the model alone and said nothing); one that matches some rows says how many, and the
    ``source`` column which. A row matches on (model, seq, P, pass)."""
    if not args.attention_json:
        return
    used = sum(r["source"] != "model" for r in rows)
    if used == len(rows):
        return
    have = sorted({k[:4] for k in measured(args.attention_json)})
    shown = ", ".join(f"{m} seq {s} P {w} {p}" for m, s, w, p in have[:6]) + (f" and {len(have) - 6} more" if len(have) > 6 else "")
    if not used:
        raise SystemExit(
            f"perf_model: --attention-json {args.attention_json}: none of its rows matches a row of this table "
            f"(model, seq, P, pass must all match; it has {shown or 'no rows'}; the table asks for models {args.models}, "
            f"P {args.worlds}, seqs {args.seqs}, passes {args.passes}): pass --models/--worlds/--seqs/--passes that it "
            f"measured, or measure these; {MAKE_ATTENTION_JSON}"
        )
    print(
        f"# --attention-json {args.attention_json}: measured times in {used} of {len(rows)} rows (column source); "
        f"the other rows are the model alone (the JSON has {shown})",
        flush=True,
    )


def table(args) -> list[dict]:
    meas = measured(args.attention_json)
    rows = []
    names = list(MODELS) if args.models == "all" else args.models.split(",")
    for model in names:
        Hq, Hkv = MODELS[model]
        for P in (int(x) for x in args.worlds.split(",")):
            for S in (parse_size(x) for x in args.seqs.split(",")):
                m = model_layer(Hq, Hkv, P, S, args)
                if m is None:
                    continue
                for p in args.passes.split(","):
                    parts = ("fwd", "bwd") if p == "fwdbwd" else (p,)
                    comp = sum(m["compute"][x] for x in parts)
                    lay = sum(m["layout"][x] for x in parts)
                    measured_parts = []
                    # The attention the layer runs: SharedKV on ranks whose query heads
                    # share one KV head (bench_attention's local-sharedkv row), else local.
                    for name in ("local-sharedkv", "local"):
                        if (model, S, P, p, name) in meas:
                            comp = meas[(model, S, P, p, name)]
                            measured_parts.append("compute")
                            break
                    # The fastest kernel set measured (layout-cuda / -triton / -torch): the one
                    # "auto" runs; the torch reference set is only a fallback.
                    layouts = [meas[k] for k in meas if k[:4] == (model, S, P, p) and k[4].startswith("layout-")]
                    if layouts:
                        lay = min(layouts)
                        measured_parts.append("layout")
                    wire = sum(m["wire"][x] for x in parts)
                    ours = comp + wire + lay
                    # "measured": compute and layout from the JSON; "measured-compute"/"-layout": one of them.
                    src = {0: "model", 2: "measured"}.get(len(measured_parts)) or f"measured-{measured_parts[0]}"
                    # With the FP8 wire (always the model's layout: no measured row for it yet).
                    fp8 = comp + sum(m["wire_fp8"][x] + m["layout_fp8"][x] for x in parts)
                    row = {"model": model, "P": P, "seq": S, "pass": p, "compute_ms": comp * 1e3, "source": src,
                           "wire_ms": wire * 1e3, "layout_ms": lay * 1e3, "ours_ms": ours * 1e3,
                           "exposed": (wire + lay) / ours, "kv_repl": m["plan"].kv_replication,
                           "fp8_wire_ms": sum(m["wire_fp8"][x] for x in parts) * 1e3, "fp8_ms": fp8 * 1e3, "x_fp8": ours / fp8}  # fmt: skip
                    if m["chain"] is not None:
                        cl = sum(m["chain"]["layout"][x] for x in parts)
                        if (model, S, P, p, "chain-layout") in meas:
                            cl = meas[(model, S, P, p, "chain-layout")]
                        cw = sum(m["chain"]["wire"][x] for x in parts)
                        chain = comp + cw + cl
                        row.update(chain_wire_ms=cw * 1e3, chain_layout_ms=cl * 1e3, chain_ms=chain * 1e3, speedup=chain / ours)
                    else:
                        row.update(chain_wire_ms=None, chain_layout_ms=None, chain_ms=None, speedup=None)
                    rows.append(row)
    return rows


COLUMNS = [
    ("model", "model", ""), ("P", "P", "d"), ("seq", "seq", "d"), ("pass", "pass", ""),
    ("compute_ms", "compute(ms)", ".2f"), ("wire_ms", "wire(ms)", ".2f"), ("layout_ms", "layout(ms)", ".3f"),
    ("ours_ms", "ours(ms)", ".2f"), ("exposed", "exposed", ".1%"), ("chain_wire_ms", "chain wire", ".2f"),
    ("chain_layout_ms", "chain layout", ".3f"), ("chain_ms", "chain(ms)", ".2f"), ("speedup", "x_chain", ".3f"),
    ("kv_repl", "kv_repl", ".2f"), ("fp8_wire_ms", "fp8 wire", ".2f"), ("fp8_ms", "fp8(ms)", ".2f"), ("x_fp8", "x_fp8", ".3f"),
    ("source", "source", ""),
]  # fmt: skip


def parse_args(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--models", default="all", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--worlds", default="8", help="sequence-parallel group sizes (default 8)")
    p.add_argument("--seqs", default="32K,64K,128K,256K,512K,1M", help="global sequence lengths")
    p.add_argument("--passes", default="fwd,bwd,fwdbwd")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bytes", type=int, default=2, help="bytes per element (2: bf16)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-busbw", type=float, default=370.0, help="all-to-all busbw inside a node, GB/s (default 370)")
    p.add_argument("--ib-busbw", type=float, default=48.0, help="per-GPU NIC bandwidth off the node, GB/s (default 48)")
    p.add_argument("--hbm-bw", type=float, default=3.0, help="HBM copy bandwidth, TB/s (default 3.0; H100 SXM nominal 3.35)")
    p.add_argument("--fwd-tflops", type=float, default=350.0, help="attention forward TFLOP/s (default 350: FA2-class on H100)")
    p.add_argument("--bwd-tflops", type=float, default=260.0, help="attention backward TFLOP/s (default 260: an assumption, 0.75x fwd)")
    p.add_argument("--attention-json", default=None, help="bench_attention JSON whose local/layout rows replace the model")
    p.add_argument("--hybrid", action="store_true", help="the Ulysses x ring table (every split U x R of each world) instead")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hybrid:
        print(f"# perf model, Ulysses x ring (formulas, not measurements): NVLink busbw {args.nvlink_busbw} GB/s, "
              f"IB {args.ib_busbw} GB/s/GPU, attention fwd {args.fwd_tflops} / bwd {args.bwd_tflops} TFLOP/s, "
              f"{args.gpus_per_node} GPUs per node, zigzag layout")  # fmt: skip
        print_table(HYBRID_COLUMNS, hybrid_table(args))
        return 0
    rows = table(args)
    check_attention_json(args, rows)
    print(
        f"# perf model (formulas, not measurements): NVLink busbw {args.nvlink_busbw} GB/s, IB {args.ib_busbw} GB/s/GPU, "
        f"HBM copy {args.hbm_bw} TB/s, attention fwd {args.fwd_tflops} / bwd {args.bwd_tflops} TFLOP/s, "
        f"{args.gpus_per_node} GPUs per node, batch {args.batch}, head_dim {args.head_dim}, {args.bytes} B/element"
    )
    print_table(COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
