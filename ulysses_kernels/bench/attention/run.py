"""The sweep of the attention benchmark: every method at every (head counts, sequence length),
timed per pass, checked, turned into rows (the slowest rank's time, the busiest rank's
TFLOP/s); a method that fails is not tried again at longer sequences."""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass

import torch

from ulysses_kernels import make_sp_groups
from ulysses_kernels.backends import resolve_backend
from ulysses_kernels.bench import harness, sizes, timing
from ulysses_kernels.bench.harness import Skip
from ulysses_kernels.layout import Layout
from ulysses_kernels.math_attention import default_scale
from ulysses_kernels.plan import HeadPlan

from .check import count_method_wrong
from .inputs import Inputs, make_inputs, seq_lengths
from .methods import COMM_METHODS, Method, build_method, method_names, packed_variants
from .report import _breakdown, _ratios, print_header, report

warnings.filterwarnings("ignore", message=r".*all_to_all_single is deprecated", category=FutureWarning)

FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


@dataclass
class Group:
    """One (head counts, sequence length) of the sweep on this rank: what every method of
    it shares. ``rank`` is the rank within the (possibly emulated) ``P``-way group."""

    model: str
    plan: HeadPlan
    inp: Inputs
    rank: int
    world: int
    P: int
    backend: object
    scale: float
    layout: Layout
    kv_full: tuple | None = None  # all rows of k and v, built once for the checks

    @property
    def emulated(self) -> bool:
        return self.world == 1 and self.P > 1

    def key(self, name: str) -> str:
        return f"{self.model} S={self.inp.S} {name}"


def make_group(args, model, H, Hkv, S, plan, rank, world, P, dtype, device) -> Group:
    inp = Inputs(args.batch, S, H, Hkv, args.head_dim, P if world == 1 else world, dtype, device)
    probe = torch.empty(1, 1, 1, args.head_dim, dtype=dtype, device=device)
    backend = resolve_backend(args.attn_fn, probe)
    layout = Layout(plan, rank, (inp.s,) * P, args.batch, args.head_dim)
    return Group(model, plan, inp, rank, world, P, backend, default_scale(args.head_dim, None), layout)


def run_bench(args, rank: int, world: int, device: torch.device, backend_name: str):
    """Every method at every (head counts, sequence) on every rank: the rows, the breakdown of
    each ulysses row and ``{what: why}`` for what did not run. Rank 0 prints the tables."""
    dtype = sizes.parse_dtype(args.datatype or ("bf16" if device.type == "cuda" else "fp32"))
    P = world if world > 1 else args.sp  # rank 0 of an emulated group has the most heads
    heads_sets = sizes.parse_heads_sets("bench_attention", args.heads_sets, args.models)
    seqs = seq_lengths(args, P)
    probe = torch.empty(1, 1, 1, args.head_dim, dtype=dtype, device=device)
    names = method_names(args, world, P, packed_variants(resolve_backend(args.attn_fn, probe), device, dtype))
    args.sp_groups = hybrid_groups(names, world)
    if rank == 0:
        print_header(args, world, P, backend_name, device, dtype, names)
    rows, notes, dead = [], {}, set()
    progress = harness.Progress(len(heads_sets) * len(seqs) * len(names), rank == 0, "attention")
    for model, H, Hkv in heads_sets:
        try:
            plan = HeadPlan.build(H, Hkv, P)
        except ValueError as e:
            notes[model] = str(e)
            continue
        for S in seqs:
            g = make_group(args, model, H, Hkv, S, plan, rank, world, P, dtype, device)
            rows += run_group(args, g, names, device, dtype, notes, dead, progress)
    breakdown = _breakdown(rows)
    if rank == 0:
        report(rows, breakdown, notes, device)
    return rows, breakdown, notes


def hybrid_groups(names, world: int) -> dict:
    """``{name: SPGroups}`` for the ``hybrid-UxR`` and ``packed-hybrid-UxR[-zigzag]`` methods
    that fit ``world`` real ranks, made once per split per run (collective: every rank makes
    them in the same order)."""
    groups, made = {}, {}
    for name in names:
        match = re.fullmatch(r"(?:packed-)?hybrid-(\d+)x(\d+)(-zigzag)?", name)
        if match is None or world == 1 or (match[3] and not name.startswith("packed-")):
            continue  # build_method says why
        u, r = int(match[1]), int(match[2])
        if u * r == world:
            if (u, r) not in made:
                made[u, r] = make_sp_groups(u, r)
            groups[name] = made[u, r].with_layout("zigzag" if match[3] else "contiguous")
    return groups


def run_group(args, g: Group, names: list[str], device, dtype, notes: dict, dead: set, progress) -> list[dict]:
    """Every method of one (head counts, sequence): rows with ratios. A method that fails (not a
    skip for size or for want of ranks) is added to ``dead`` and not tried at longer sequences."""
    rows = []
    for name in names:
        progress.step(g.key(name))
        if (g.model, name) in dead:
            continue
        m, why = prepare_method(name, args, g, device)
        if not timing.all_ok(m is not None):
            notes[g.key(name)] = why or "skipped on another rank"
            if why and "estimated" not in why and "needs real ranks" not in why:
                dead.add((g.model, name))
            continue
        res, outs, why = run_method(m, args, g, device)
        if not timing.all_ok(res is not None):
            notes[g.key(name)] = why or "failed on another rank"
            dead.add((g.model, name))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if m.first_s is not None and g.rank == 0:
            print(f"# {g.key(name)}: first fwd+bwd {m.first_s:.1f} s (compiles FlexAttention), kept out of the timing", flush=True)
        wrong = count_method_wrong(m, outs, args, g)
        del outs
        rows += method_rows(m, res, wrong, args, g, dtype)
        del m
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _ratios(rows)
    return rows


def prepare_method(name: str, args, g: Group, device: torch.device):
    """``(method, None)``, or ``(None, why)`` when it cannot run here (its own skip, a
    missing kernel set, or a size whose estimated memory does not fit)."""
    try:
        if g.emulated and (name in COMM_METHODS or name.startswith(("ulysses-", "hybrid-"))):
            raise Skip("needs real ranks (one process emulates only local/layout rows)")
        m = build_method(name, args, g.inp, g.plan, g.rank, g.world, g.P, g.backend, g.scale, g.layout)
        if device.type == "cuda":
            need, free = estimate_bytes(name, g.inp, g.plan, g.rank), torch.cuda.mem_get_info(device)[0]
            if need > args.mem_fraction * free:
                raise Skip(f"estimated {need / 2**30:.1f} GiB > {args.mem_fraction:.0%} of free {free / 2**30:.1f} GiB")
    except Skip as e:
        return None, str(e)
    except (ValueError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"
    return m, None


def estimate_bytes(name: str, inp: Inputs, plan: HeadPlan, rank: int) -> int:
    """A rough per-rank peak for one fwd+bwd (a pre-check so that big sizes skip, not OOM)."""
    e, B, D, S, s = torch.empty((), dtype=inp.dtype).element_size(), inp.B, inp.D, inp.S, inp.s
    heads_local = plan.q_count(rank) + 2 * plan.kv_count(rank)
    if name.startswith("chain") or name in COMM_METHODS:
        heads_local = 3 * -(-inp.H // inp.P)
    seq_side = B * s * (inp.H + 2 * inp.Hkv) * D * e  # q/k/v or their grads, one copy
    head_side = B * S * heads_local * D * e  # received q/k/v, or their grads
    return int(4 * head_side + 6 * seq_side)


def run_method(m: Method, args, g: Group, device: torch.device):
    """``(results, outs, None)`` from ``time_method``, or ``(None, None, why)`` when the
    method ran out of memory or failed."""
    try:
        res, outs = time_method(m, args, g.inp, g.plan, g.rank, device)
    except torch.cuda.OutOfMemoryError as e:
        return None, None, f"OOM: {str(e).splitlines()[0]}"
    except (RuntimeError, NotImplementedError, AssertionError, TypeError) as e:
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return res, outs, None


def time_method(m: Method, args, inp, plan, rank, device):
    """{pass: (seconds, peak bytes or None, each iteration's seconds)} and the (out, dq) of the last fwd+bwd."""
    res, keep = {}, {}
    cuda = device.type == "cuda"
    if m.layout_only:
        fns = {"fwd": m.fwd_only, "bwd": m.bwd_only, "fwdbwd": lambda: (m.fwd_only(), m.bwd_only())}
        for p in args.passes:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t = timing.time_iters(fns[p], device=device, warmup=args.warmup_iters, iters=args.iters)
            res[p] = (timing.median(t), torch.cuda.max_memory_allocated(device) if cuda else None, t)
        return res, None
    (q, k, v), dout = make_inputs(m, inp, plan, rank)

    def clear():
        for x in (q, k, v):
            x.grad = None

    def fwd():
        m.fn(q, k, v)  # the graph is built (training forward) and dropped

    def bwd(out):
        out.backward(dout)

    def fwdbwd():
        clear()
        out = m.fn(q, k, v)
        out.backward(dout)
        keep["out"], keep["dq"] = out.detach(), q.grad

    def setup_bwd():
        clear()
        return m.fn(q, k, v)

    if m.name.endswith("-flex") and cuda:  # its first call compiles FlexAttention: kept out of the timing
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fwdbwd()
        torch.cuda.synchronize(device)
        m.first_s = time.perf_counter() - t0
    # The check needs one fwd+bwd: run that pass (untimed in the table) when not selected.
    extra = ("fwdbwd",) if args.check and "fwdbwd" not in args.passes else ()
    for p in args.passes + extra:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if p == "fwd":
            t = timing.time_iters(fwd, device=device, warmup=args.warmup_iters, iters=args.iters)
        elif p == "bwd":
            t = timing.time_iters(bwd, device=device, warmup=args.warmup_iters, iters=args.iters, setup=setup_bwd)
        else:
            t = timing.time_iters(fwdbwd, device=device, warmup=args.warmup_iters, iters=args.iters)
        res[p] = (timing.median(t), torch.cuda.max_memory_allocated(device) if cuda else None, t)
    return {p: res[p] for p in args.passes}, ((keep["out"], keep["dq"]) if keep else None)


def method_rows(m: Method, res: dict, wrong, args, g: Group, dtype) -> list[dict]:
    """One row per pass: the slowest rank's time and peak memory, TFLOP/s of the busiest rank."""
    inp = g.inp
    hq_max = max(g.plan.q_count(r) for r in range(g.P))  # the slowest rank sets the pace
    pairs = inp.S * inp.S if m.docs is None else sum((b - a) ** 2 for a, b in m.docs.spans())
    flops_fwd = 4 * args.batch * pairs * hq_max * args.head_dim / 2
    rows = []
    for p in args.passes:
        t = timing.reduce_max(res[p][0])
        mem = timing.reduce_max(res[p][1]) if res[p][1] is not None else None
        rows.append({
            "model": g.model, "heads": f"{inp.H}/{inp.Hkv}", "seq": inp.S, "world": g.P, "method": m.name, "pass": p,
            "time_ms": t * 1e3, "tflops": None if m.layout_only else flops_fwd * FLOP_FACTOR[p] / t / 1e12,
            "mem_gib": None if mem is None else mem / 2**30, "wrong": wrong, "dtype": sizes.dtype_name(dtype),
            "backend": m.backend or g.backend.name, "docs": 1 if m.docs is None else m.docs.count, "first_s": m.first_s,
            "ring_steps": None if m.ring is None else f"{m.ring.computed_steps()}/{m.ring.ring_size ** 2}",
            "ring_hops": None if m.ring is None else f"{m.ring.hops()}/{m.ring.ring_size * (m.ring.ring_size - 1)}",
            **timing.spread(res[p][2], 1e3, "ms"),
        })  # fmt: skip
    return rows
