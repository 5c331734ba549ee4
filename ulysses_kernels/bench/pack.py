"""Pack/unpack bandwidth: the fused kernels against a device-to-device copy of the same bytes.

    python -m ulysses_kernels.bench.pack                 # GPU: 96-320 MiB buffers; no GPU: tiny CPU sizes
    python -m ulysses_kernels.bench.pack --device cpu --iters 3 --out /tmp/results
    python -m ulysses_kernels.bench.pack --kernels cuda,triton --configs 32/8/8/1/8192/128
    python -m ulysses_kernels.bench.pack --kernels cuda,triton,torch --variants old,new   # A/B of the kernel variants

A configuration ``Hq/Hkv/P/B/s/D`` (query heads, KV heads, ranks, batch, tokens per rank,
head_dim) is rank 0's layout of a ``P``-way group (``HeadPlan.build(Hq, Hkv, P)``). Rows:

  op      method        what runs
  pack    copy          ``dst.copy_(src)`` of the send buffer's bytes: the floor any pack can reach
  pack    fused (<k>)   ``pack_s2h`` of kernel set <k> (``--kernels``; "auto": the C++ extension
                        when built; on a CPU it runs its CPU twin, labelled "cuda: C++ CPU
                        twin"): q, k, v (views of one fused QKV projection output) -> the
                        one send buffer of the q/k/v all-to-all
  pack    torch         the pure-PyTorch reference, ``kernels.torch_kernels.pack_s2h`` (one copy per peer and tensor)
  pack    chain         what other Ulysses implementations run per tensor before the all-to-all,
                        ``x.reshape(B, s, P, H/P, D).permute(2, 1, 0, 3, 4).contiguous()``; only the
                        send side: the chain copies once more after the collective, the fused path
                        does not (the receive buffer is the attention input), so x_chain is a
                        lower bound of the difference
  unpack  copy          a copy of the receive buffer's bytes
  unpack  fused (<k>)   ``unpack_h2s``: the received blocks of the q/k/v roles (dq/dk/dv of the
                        backward) -> ``[B, s, H, D]``, KV heads held by several ranks summed
  unpack  torch         ``kernels.torch_kernels.unpack_h2s``
  unpack  chain         the chain's receive side: ``[P, s, B, H/P, D]`` -> permute -> ``[B, s, H, D]``

The chain rows need query and KV heads that divide over the ranks (the plan's head ranges
are then the chain's). Columns: ``size(B)`` = bytes of the send (pack) or receive (unpack)
buffer; ``time(us)`` = median over ``--iters`` after ``--warmup``; ``GB/s`` = (bytes read +
bytes written) / time; ``% copy`` = this row's GB/s over the copy row's (target: fused
pack and unpack >= 90% of the copy bandwidth on an H100 for buffers >= 64 MiB; a bandwidth
ratio, not a time ratio, because an unpack that sums replicated KV heads writes fewer bytes
than it receives); ``x_chain`` = chain time / this time (target for
the fused rows: >= 3x); ``#wrong`` = elements that differ bit for bit from ``kernels/torch_kernels.py``'s
reference on the same inputs (the copy rows: from the copy's source), counted on one more
run after the timing, with the outputs filled with NaN first so that an element a kernel
leaves unwritten counts. Any ``#wrong`` > 0 makes the script exit non-zero (after writing
its files).

Variants (``--variants old,new``): the ``cuda`` and ``triton`` rows are run once per
listed variant the set has (``extension.SET_VARIANTS``: cuda new, triton old and new;
``extension.set_pack_variant``, in this one process), labelled ``fused (<k> <variant>)``;
the JSON's ``meta.variants`` holds, per set and op, each variant's % of copy per
configuration, the worst, and, when both of a set's variants ran, ``x_<a>_over_<b>``
(geometric mean of time(a) / time(b) in the set's order: > 1 means <b> is faster) and
``faster``, printed as ``# variants`` lines.

Timing: CUDA events around each call after a device sync (``timing.time_iters``); on the
CPU ``perf_counter``, labelled "CPU (not a GPU claim)" in the table, the JSON (``env.timer``)
and the plot. Output: the table, then ``bench_pack_<UTC time>_<gpu>_w1.{csv,json}`` (rows +
``env`` record + ``meta``), ``bench_pack_latest.json`` and a PNG when matplotlib is
importable, under ``--out-dir`` (alias ``--out``; default ``./bench_results``).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ulysses_kernels import extension
from ulysses_kernels.bench import harness, patterns, record, sizes, timing
from ulysses_kernels.kernels import available_kernels, get_kernels
from ulysses_kernels.kernels import torch_kernels as L
from ulysses_kernels.layout import QKV, Layout
from ulysses_kernels.plan import HeadPlan

# (q_heads, kv_heads, world_size, batch, tokens per rank, head_dim); every GPU buffer is
# >= 64 MiB in bf16 (the size the bandwidth target is stated for).
GPU_CONFIGS = [(32, 8, 8, 1, 8192, 128), (32, 32, 8, 1, 4096, 128), (40, 8, 8, 2, 4096, 128), (64, 8, 8, 1, 16384, 128), (40, 8, 5, 1, 8192, 128)]
CPU_CONFIGS = [(8, 4, 4, 1, 64, 32), (10, 2, 4, 2, 32, 16)]
TARGET_BYTES = 64 << 20
TARGET_PCT_COPY, TARGET_X_CHAIN = 90.0, 3.0

COLUMNS = [
    ("config", "config", ""),
    ("op", "op", ""),
    ("method", "method", ""),
    ("bytes", "size(B)", "d"),
    ("time_us", "time(us)", ".1f"),
    ("gbps", "GB/s", ".1f"),
    ("pct_copy", "% copy", ".1f"),
    ("x_chain", "x_chain", ".2f"),
    ("wrong", "#wrong", "d"),
]


# ---- the check ---------------------------------------------------------------------------
@dataclass
class Case:
    """One row: ``run()`` is what is timed and returns the outputs; ``check`` compares
    ``view(outputs)`` with ``expected`` after filling ``poison`` with NaN."""

    op: str
    method: str
    run: Callable[[], Sequence[torch.Tensor]]
    expected: Sequence[torch.Tensor]
    size: int  # bytes of the wire buffer (send for pack, receive for unpack)
    moved: int  # bytes read + bytes written by one call
    poison: Sequence[torch.Tensor] = ()
    view: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]] = field(default=lambda outs: outs)
    variant: str | None = None  # the kernel variant this row runs under (``extension.set_pack_variant``); None: any


# Kernel sets whose kernels come in variants (``extension.SET_VARIANTS``).
VARIANT_SETS = tuple(extension.SET_VARIANTS)


def fused_label(kern, device: torch.device, variant: str | None) -> str:
    """``fused (<k>)``, or ``fused (<k> <variant>)`` for a row of a variant sweep."""
    name = record.kernel_label(kern.name, device)
    return f"fused ({name} {variant})" if variant else f"fused ({name})"


def _variants_of(kern, variants: Sequence[str] | None) -> list[str | None]:
    """The listed variants set ``kern`` has (one row each), or [None]: one unlabelled row."""
    own = [v for v in variants or () if v in extension.SET_VARIANTS.get(kern.name, ())]
    return own or [None]


def check(case: Case) -> int:
    """Poison the outputs, run once more, count the elements that differ from the expected."""
    for t in case.poison:
        t.fill_(float("nan"))
    with variant_of(case):
        return patterns.count_unequal_bits(case.view(case.run()), case.expected)


@contextlib.contextmanager
def variant_of(case: Case):
    """Run ``case`` under its kernel variant (the process's setting is restored after)."""
    if case.variant is None:
        yield
        return
    previous = extension.set_pack_variant(case.variant)
    try:
        yield
    finally:
        extension.set_pack_variant(previous)


# ---- the cases of one configuration ------------------------------------------------------
def config_label(cfg) -> str:
    hq, hkv, world, batch, seq, d = cfg
    return f"{hq}/{hkv} P{world} B{batch} s{seq} D{d}"


def chain_divides(lay: Layout) -> bool:
    """True when the chain's per-rank head slices (``H/P`` consecutive heads) are the plan's."""
    plan, world = lay.plan, lay.world_size
    if plan.q_heads % world or plan.kv_heads % world:
        return False
    hq, hkv = plan.q_heads // world, plan.kv_heads // world
    return all(lay.head_range("q", p) == (p * hq, (p + 1) * hq) and lay.head_range("kv", p) == (p * hkv, (p + 1) * hkv) for p in range(world))


class _Config:
    """The tensors of one configuration that every row reads: rank 0's layout, q/k/v as
    views of one fused projection output, the receive buffer of the q/k/v roles' backward
    all-to-all, and the reference results of ``kernels/torch_kernels.py`` on them."""

    def __init__(self, cfg, device: torch.device, dtype: torch.dtype, seed: int):
        hq, hkv, world, batch, seq, d = cfg
        self.world, self.batch, self.seq, self.d = world, batch, seq, d
        self.device, self.dtype = device, dtype
        self.lay = Layout(HeadPlan.build(hq, hkv, world), 0, (seq,) * world, batch, d)
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.gen = torch.Generator(device=device).manual_seed(seed)
        # q, k, v: views of one fused projection output [B, s, (Hq + 2 Hkv) * D], as in a model.
        fused = self.randn(batch, seq, (hq + 2 * hkv) * d)
        self.qkv = tuple(t.unflatten(-1, (-1, d)) for t in fused.split([hq * d, hkv * d, hkv * d], dim=-1))
        self.n_send = sum(self.lay.s2h_send_splits(QKV))
        self.ref_send = self.empty(self.n_send)
        L.pack_s2h(self.lay, self.qkv, QKV, self.ref_send)
        self.copy_src = self.randn(self.n_send)  # what the pack's copy row copies
        # Unpack of the head-to-sequence all-to-all of the q/k/v roles (dq, dk, dv).
        self.n_recv = sum(self.lay.h2s_splits(QKV)[1])
        self.recv = self.randn(self.n_recv)
        self.blocks = self.lay.h2s_recv_views(self.recv, QKV)
        self.out_shapes = [(batch, seq, self.lay.total_heads(s), d) for s in QKV]
        self.ref_outs = [self.empty(*sh) for sh in self.out_shapes]
        L.unpack_h2s(self.lay, self.blocks, QKV, self.ref_outs)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype)

    def empty(self, *shape):
        return torch.empty(*shape, device=self.device, dtype=self.dtype)


def resolve_kernel_sets(kernel_sets: Sequence, device: torch.device, lay: Layout):
    """The distinct kernel-set objects of ``kernel_sets`` (names for ``get_kernels``, None =
    auto, or objects), and ``{method: why}`` for those that cannot run here."""
    kernels, skipped = [], {}
    for name in kernel_sets:
        try:
            kern = get_kernels(name, device, lay)
        except ValueError as e:
            skipped[f"fused ({name})"] = str(e)
            continue
        if all(k.name != kern.name for k in kernels):
            kernels.append(kern)
    return kernels, skipped


def pack_cases(c: _Config, kernels, variants: Sequence[str] | None = None) -> list[Case]:
    """copy, fused per kernel set (and variant, for a variant sweep), torch, and the chain's
    send side when the heads divide."""
    size = c.n_send * c.elem
    src, dst = c.copy_src, c.empty(c.n_send)
    cases = [Case("pack", "copy", lambda: [dst.copy_(src)], [src], size, 2 * size, poison=[dst])]

    def pack_case(method, fn, variant=None):
        send = c.empty(c.n_send)

        def run():
            fn(c.lay, c.qkv, QKV, send)
            return [send]

        return Case("pack", method, run, [c.ref_send], size, 2 * size, poison=[send], variant=variant)

    cases += [pack_case(fused_label(k, c.device, v), k.pack_s2h, v) for k in kernels for v in _variants_of(k, variants)]
    cases.append(pack_case("torch", L.pack_s2h))
    if chain_divides(c.lay):
        ref_views = c.lay.s2h_send_views(c.ref_send, QKV)
        world = c.world

        def chain_pack():
            return [x.reshape(c.batch, c.seq, world, x.shape[2] // world, c.d).permute(2, 1, 0, 3, 4).contiguous() for x in c.qkv]

        def chain_pack_view(outs):  # [P, s, B, h, D] per tensor -> per (tensor, peer) [B, s, h, D]
            return [o[p].transpose(0, 1) for o in outs for p in range(world)]

        expected = [ref_views[p][i] for i in range(len(QKV)) for p in range(world)]
        cases.append(Case("pack", "chain", chain_pack, expected, size, 2 * size, view=chain_pack_view))
    return cases


def unpack_cases(c: _Config, kernels, variants: Sequence[str] | None = None) -> list[Case]:
    """copy, fused per kernel set (and variant), torch, and the chain's receive side when the heads divide."""
    rsize = c.n_recv * c.elem
    written = sum(math.prod(sh) for sh in c.out_shapes) * c.elem  # < rsize where KV replicas are summed
    udst = c.empty(c.n_recv)
    cases = [Case("unpack", "copy", lambda: [udst.copy_(c.recv)], [c.recv], rsize, 2 * rsize, poison=[udst])]

    def unpack_case(method, fn, variant=None):
        outs = [c.empty(*sh) for sh in c.out_shapes]

        def run():
            fn(c.lay, c.blocks, QKV, outs)
            return outs

        return Case("unpack", method, run, c.ref_outs, rsize, rsize + written, poison=outs, variant=variant)

    cases += [unpack_case(fused_label(k, c.device, v), k.unpack_h2s, v) for k in kernels for v in _variants_of(k, variants)]
    cases.append(unpack_case("torch", L.unpack_h2s))
    if chain_divides(c.lay):
        # The chain's receive buffer per tensor: [P, s, B, H/P, D], peer p's block first.
        chain_recv = [torch.stack([c.blocks[p][i].transpose(0, 1) for p in range(c.world)]) for i in range(len(QKV))]

        def chain_unpack():
            return [x.permute(2, 1, 0, 3, 4).reshape(c.batch, c.seq, c.world * x.shape[3], c.d).contiguous() for x in chain_recv]

        cases.append(Case("unpack", "chain", chain_unpack, c.ref_outs, rsize, 2 * rsize))
    return cases


def build_cases(cfg, device: torch.device, dtype: torch.dtype, kernel_sets: Sequence, seed: int = 0, variants: Sequence[str] | None = None):
    """The rows of one configuration, and ``{method: why}`` for kernel sets that cannot run.

    ``kernel_sets``: names for ``get_kernels`` (None = auto) or kernel-set objects.
    ``variants``: kernel variants (``extension.PACK_VARIANTS``) to run the ``cuda`` and ``triton``
    sets under, one row each; None: the process's current variant, unlabelled."""
    c = _Config(cfg, device, dtype, seed)
    kernels, skipped = resolve_kernel_sets(kernel_sets, device, c.lay)
    return pack_cases(c, kernels, variants) + unpack_cases(c, kernels, variants), skipped


# ---- the sweep -----------------------------------------------------------------------------
def parse_configs(text: str | None, gpu: bool) -> list[tuple[int, ...]]:
    if not text:
        return GPU_CONFIGS if gpu else CPU_CONFIGS
    out = []
    for item in text.split(","):
        parts = item.strip().split("/")
        if len(parts) != 6 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"bench_pack: --configs wants Hq/Hkv/P/B/s/D (positive integers), got {item!r}")
        out.append(tuple(int(p) for p in parts))
    return out


def kernel_names(spec: str, device: torch.device) -> list:
    """``--kernels`` as names for ``get_kernels``; "auto" on the CPU is the C++ extension's
    CPU twin when built (``get_kernels`` would pick the reference there), else torch."""
    names = []
    for s in (x.strip() for x in spec.split(",") if x.strip()):
        if s == "auto" and device.type != "cuda":
            s = "cuda" if "cuda" in available_kernels() else "torch"
        names.append(None if s == "auto" else s)
    return names


def run_bench(args, device: torch.device) -> tuple[list[dict], dict]:
    gpu = device.type == "cuda"
    dtype = sizes.parse_dtype(args.dtype)
    configs = parse_configs(args.configs, gpu)
    warmup = args.warmup if args.warmup is not None else (10 if gpu else 1)
    iters = args.iters if args.iters is not None else (100 if gpu else 5)
    if iters < 1 or warmup < 0:
        raise SystemExit("bench_pack: need --iters >= 1 and --warmup >= 0")
    names = kernel_names(args.kernels, device)
    variants = parse_variants(args.variants)
    cpu = "" if gpu else f"  [{record.CPU_LABEL}]"
    default = default_kernels(device)
    print(f"# bench_pack: {device.type}, dtype {sizes.dtype_name(dtype)}, kernels {args.kernels}, variants {args.variants or extension.pack_variant()}, "
          f"warmup {warmup}, iters {iters}, rank 0 of each config's group{cpu}", flush=True)  # fmt: skip
    print(f"# default here (kernels='auto'): {default}, variant {extension.pack_variant()} (ULYSSES_KERNELS_PACK_VARIANT)", flush=True)
    rows, notes = [], {}
    for cfg in configs:
        cases, skipped = build_cases(cfg, device, dtype, names, seed=args.seed, variants=variants)
        notes.update({f"{config_label(cfg)} {m}": why for m, why in skipped.items()})
        cfg_rows = []
        for case in cases:
            with variant_of(case):
                t = timing.median(timing.time_iters(case.run, device=device, warmup=warmup, iters=iters, barrier=False))
            wrong = check(case) if args.check else None
            cfg_rows.append({
                "config": config_label(cfg), "op": case.op, "method": case.method, "bytes": case.size,
                "time_us": t * 1e6, "gbps": case.moved / t / 1e9, "bytes_moved": case.moved, "wrong": wrong,
                "q_heads": cfg[0], "kv_heads": cfg[1], "world": cfg[2], "batch": cfg[3], "seq_per_rank": cfg[4],
                "head_dim": cfg[5], "dtype": sizes.dtype_name(dtype), "variant": case.variant,
            })  # fmt: skip
        del cases
        for op in ("pack", "unpack"):
            by = {r["method"]: r for r in cfg_rows if r["op"] == op}
            for r in by.values():
                r["pct_copy"] = 100.0 * r["gbps"] / by["copy"]["gbps"]
                r["x_chain"] = by["chain"]["time_us"] / r["time_us"] if "chain" in by else None
        rows += cfg_rows
    meta = {"skipped": notes, "warmup": warmup, "iters": iters, "configs": [config_label(c) for c in configs],
            "default_kernels": default, "default_variant": extension.pack_variant(), "variants": variant_summary(rows)}  # fmt: skip
    return rows, meta


def parse_variants(text: str | None) -> list[str] | None:
    """``--variants`` (comma list of ``extension.PACK_VARIANTS``) or None."""
    if not text:
        return None
    out = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in out if v not in extension.PACK_VARIANTS]
    if bad or not out:
        raise SystemExit(f"bench_pack: --variants wants a comma list of {list(extension.PACK_VARIANTS)}, got {text!r}")
    return out


def default_kernels(device: torch.device) -> str:
    """The kernel set ``kernels='auto'`` picks on ``device`` (a GPU: by the registry's ``gpu_validated``)."""
    return get_kernels(None, device).name


def _variant_pair(kern: str) -> tuple[str | None, str | None]:
    """A set's two variants (``extension.SET_VARIANTS`` order), or (None, None): a set with one has no ratio."""
    names = extension.SET_VARIANTS.get(kern, ())
    return (names[0], names[1]) if len(names) == 2 else (None, None)


def variant_summary(rows: list[dict]) -> dict:
    """Per kernel set and op, per variant: % of copy of every configuration, the worst, and
    for a set's two variants a, b (``extension.SET_VARIANTS`` order) the geometric mean of
    time(a) / time(b) as ``x_<a>_over_<b>`` (> 1: b faster). Empty without a sweep."""
    out: dict = {}
    swept = [r for r in rows if r.get("variant")]
    for r in swept:
        kern = r["method"][len("fused (") :].split()[0].rstrip(":")
        ent = out.setdefault(kern, {}).setdefault(r["op"], {})
        ent.setdefault(r["variant"], {})[r["config"]] = {"pct_copy": r["pct_copy"], "time_us": r["time_us"]}
    for per_op in out.values():
        for ent in per_op.values():
            for v in list(ent):
                ent[v] = {"per_config": ent[v], "worst_pct_copy": min(x["pct_copy"] for x in ent[v].values())}
    for kern, per_op in out.items():
        a, b = _variant_pair(kern)
        for ent in per_op.values():
            if a in ent and b in ent:
                both = [c for c in ent[b]["per_config"] if c in ent[a]["per_config"]]
                ratios = [ent[a]["per_config"][c]["time_us"] / ent[b]["per_config"][c]["time_us"] for c in both]
                ent[f"x_{a}_over_{b}"] = math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else None
                ent["faster"] = None if not ratios else (b if ent[f"x_{a}_over_{b}"] > 1 else a)
    return out


def report(rows: list[dict], notes: dict, device: torch.device, summary: dict | None = None) -> None:
    record.print_table(COLUMNS, rows, title=None if device.type == "cuda" else f"# times: {record.CPU_LABEL}")
    harness.print_skipped(notes)
    big = [r for r in rows if r["method"].startswith("fused") and r["bytes"] >= TARGET_BYTES]
    label = "" if device.type == "cuda" else f" [{record.CPU_LABEL}]"
    if big:
        pct = min(r["pct_copy"] for r in big)
        chains = [r["x_chain"] for r in big if r["x_chain"] is not None]
        chain = f"{min(chains):.2f}x" if chains else "n/a"
        print(f"# fused rows >= 64 MiB: worst {pct:.1f}% of copy (target >= {TARGET_PCT_COPY:.0f}%), "
              f"worst {chain} the chain (target >= {TARGET_X_CHAIN:.0f}x){label}", flush=True)  # fmt: skip
    else:
        print(f"# no fused row >= 64 MiB: the bandwidth targets are not measured by this run{label}", flush=True)
    for kern, per_op in (summary or {}).items():
        for op, ent in per_op.items():
            worst = ", ".join(f"{v} worst {ent[v]['worst_pct_copy']:.1f}%" for v in extension.PACK_VARIANTS if v in ent)
            a, b = _variant_pair(kern)
            ratio = ent.get(f"x_{a}_over_{b}")
            verdict = f"; time {a}/{b} {ratio:.3f} (geomean): {ent['faster']} faster" if ratio else ""
            print(f"# variants {kern} {op}: {worst} of copy{verdict}{label}", flush=True)
    if rows and rows[0]["wrong"] is not None:
        harness.print_wrong_total(rows)
    else:
        print("# not checked (--check 0)", flush=True)


def plot(rows: list[dict], path: str, env: dict) -> bool:
    """% of copy per configuration, pack and unpack side by side, a line at the target."""
    plt = record.load_pyplot()
    if plt is None or not rows:
        return False
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(configs)), 4.5), sharey=True)
    for ax, op in zip(axes, ("pack", "unpack")):
        methods = [m for m in dict.fromkeys(r["method"] for r in rows if r["op"] == op) if m != "copy"]
        width = 0.8 / max(1, len(methods))
        for j, m in enumerate(methods):
            by = {r["config"]: r["pct_copy"] for r in rows if r["op"] == op and r["method"] == m}
            xs = [i for i, c in enumerate(configs) if c in by]
            ax.bar([x + (j - (len(methods) - 1) / 2) * width for x in xs], [by[configs[x]] for x in xs], width, label=m)
        ax.axhline(TARGET_PCT_COPY, color="k", linestyle="--", linewidth=1, label=f"target {TARGET_PCT_COPY:.0f}%")
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(configs, fontsize=6, rotation=30, ha="right")
        ax.set_title(op)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("% of copy bandwidth (row GB/s / copy GB/s)")
    fig.suptitle(f"pack/unpack vs a copy of the same bytes, {env.get('dtype', '')}, {record.device_label(env)}")
    return record.save_figure(plt, fig, path)


def parse_args(argv=None, default_out_dir=None):
    p = harness.parser(__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", "-d", default="bfloat16", help="bf16 (default), fp16, fp32, fp64")
    p.add_argument("--kernels", default="auto", help="comma list of kernel sets for the fused rows: auto (default), cuda, triton, torch")
    p.add_argument("--variants", default=None,
                   help=f"comma list of kernel variants {'/'.join(extension.PACK_VARIANTS)} for the cuda (new) and triton (old, new) rows, "
                        "one row per variant a set has (default: the current one, ULYSSES_KERNELS_PACK_VARIANT, unlabelled)")  # fmt: skip
    p.add_argument("--configs", default=None, help="comma list of Hq/Hkv/P/B/s/D (default: the GPU set, or tiny sizes on the CPU)")
    p.add_argument("-w", "--warmup", "--warmup-iters", dest="warmup", type=int, default=None, help="default 10 (GPU), 1 (CPU)")
    p.add_argument("-n", "--iters", type=int, default=None, help="timed calls per row, default 100 (GPU), 5 (CPU)")
    p.add_argument("--check", type=int, default=1, help="check every row bit for bit (1, default) or not (0)")
    p.add_argument("--seed", type=int, default=0)
    harness.add_output(p, default_out_dir)
    return p.parse_args(argv)


def main(argv=None, *, default_out_dir=None) -> int:
    """Run the benchmark; ``default_out_dir`` replaces ``--out-dir``'s default (the
    checkout's ``bench/bench_pack.py`` passes ``bench/results``)."""
    args = parse_args(argv, default_out_dir)
    device = torch.device(args.device)
    rows, meta = run_bench(args, device)
    report(rows, meta["skipped"], device, meta["variants"])
    meta = dict(vars(args), **meta)

    def env_fn():
        # One process, no collective (transport None); each row is rank 0 of its config's
        # P-way group (the "world" column).
        dtype = sizes.dtype_name(sizes.parse_dtype(args.dtype))
        return record.env_record(device, 1, None, dtype=dtype, process="rank 0 of each config's group, emulated in one process")

    harness.finish(args, 0, "bench_pack", env_fn, rows, meta, plot, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
