"""All-to-all bandwidth, the way people already read it (nccl-tests' alltoall_perf table).

    torchrun --nproc-per-node 8 -m ulysses_kernels.bench.alltoall -b 1K -e 1G -f 2 -w 5 -n 20 -d bf16
    python -m ulysses_kernels.bench.alltoall --spawn 4 -b 1K -e 1M     # gloo ranks on the CPU

Every size is run by each selected ``--op`` and checked element by element:

  a2a          bare ``torch.distributed.all_to_all_single`` on one flat buffer (the ceiling)
  nccl         bare all-to-all through our native NCCL communicator (when importable, CUDA)
  symm         torch symmetric-memory all-to-all (when this torch and transport have one)
  chain        Ulysses as DeepSpeed/yunchang prepare it: per tensor permute+contiguous,
               all_to_all_single, permute+contiguous (KV heads repeated when they do not
               divide over the ranks)
  fused-<k>    ours: one pack (kernel set <k>: torch, triton, cuda) + one all-to-all for
               q, k and v + zero-copy receive views (``attention.exchange.a2a_seq_to_head``);
               on a CPU, ``fused-cuda`` is the C++ extension's CPU twin
  fused-nccl   ours over the native NCCL communicator

``--dir s2h`` (default) moves q, k and v from sequence- to head-sharded, ``--dir h2s`` moves
an attention output back. The size of a row is the bytes each rank holds before the move
(q+k+v, or the output), rounded to whole tokens; the bare rows move the same bytes
(rounded to a multiple of the world size). algbw = size / time; busbw = algbw * (n-1)/n.
#wrong: elements (summed over ranks) that differ from the expected result.
``x_chain`` = chain time / this row's time (speed-up over the chain in this run);
``x_a2a`` = this row's time / bare a2a time (overhead over the bare collective).
Rank 0 prints a progress line per size on stderr (``--no-progress``: none); the table
goes to stdout at the end.
"""

from __future__ import annotations

import socket
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ulysses_kernels.attention.exchange import a2a_head_to_seq, a2a_seq_to_head
from ulysses_kernels.baselines import chain_head_to_seq, chain_seq_to_head
from ulysses_kernels.bench import harness, patterns, record, sizes, timing
from ulysses_kernels.bench.harness import Skip
from ulysses_kernels.comm import NCCLCommunicator, TorchCommunicator, nccl_available
from ulysses_kernels.kernels import available_kernels, get_kernels
from ulysses_kernels.layout import Q_ONLY, QKV, Layout
from ulysses_kernels.plan import HeadPlan

# The chain baseline (baselines.py) uses torch.distributed.nn.functional, deprecated in new torch.
warnings.filterwarnings("ignore", message=r".*all_to_all_single is deprecated", category=FutureWarning)

SALT_Q, SALT_K, SALT_V, SALT_OUT, SALT_FLAT = 1, 2, 3, 4, 5
ALL_OPS = ("a2a", "nccl", "symm", "chain", "fused-torch", "fused-triton", "fused-cuda", "fused-nccl")


@dataclass
class Shape:
    """Per-rank tensors of one row: ``seq`` tokens per rank, ``head_dim`` maybe shrunk."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    direction: str
    world: int

    @property
    def count(self) -> int:
        """Elements each rank holds before the move."""
        per_token = self.heads + 2 * self.kv_heads if self.direction == "s2h" else self.heads
        return self.batch * self.seq * per_token * self.head_dim


def shape_for(size: int, elem: int, args, world: int) -> Shape:
    """Whole tokens that fill ``size`` bytes; below one token of ``--head-dim``, a smaller head_dim."""
    heads, kv, d = args.heads, args.kv_heads, args.head_dim
    per_token = (heads + 2 * kv) if args.dir == "s2h" else heads
    n = max(1, size // elem)
    if n < per_token * d:
        return Shape(1, 1, heads, kv, max(1, n // per_token), args.dir, world)
    return Shape(1, n // (per_token * d), heads, kv, d, args.dir, world)


@dataclass
class Case:
    op: str
    count: int  # elements per rank (the row's size / element size)
    run: Callable[[], Any]
    check: Callable[[Any], int]  # wrong elements on this rank
    note: str | None = None  # which implementation ran (symm)


# ---- communicators other than torch.distributed ------------------------------------------
def native_nccl_comm(device: torch.device):
    """Our native NCCL communicator over the world, or ``Skip`` with the reason."""
    if device.type != "cuda":
        raise Skip("native NCCL communicator needs CUDA")
    if not nccl_available():
        raise Skip("ulysses_kernels._C was built without NCCL, or no CUDA device")
    try:
        return NCCLCommunicator(None)
    except (RuntimeError, TypeError, ValueError) as e:
        raise Skip(f"NCCLCommunicator could not be created ({e})") from None


def ranks_sharing_a_gpu(device: torch.device) -> list[int]:
    """The ranks of the world whose GPU another rank also uses (collective; [] when every
    rank has its own): NCCL >= 2.30 runs several ranks on one GPU, symmetric memory does not."""
    props = torch.cuda.get_device_properties(device)
    mine = str(getattr(props, "uuid", "")) or f"{socket.gethostname()}/{getattr(props, 'pci_bus_id', device.index)}"
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    return [r for r, u in enumerate(seen) if seen.count(u) > 1]


def symmetric_all_to_all(flat_in: torch.Tensor, out: torch.Tensor, world: int):
    """A callable running torch's symmetric-memory all-to-all of ``flat_in`` into ``out``
    (equal splits), or ``Skip``. Probed at run time: ``all_to_all_nd`` (NCCL symmetric
    memory) first, then ``nvshmem_all_to_all`` when NVSHMEM is available."""
    if flat_in.device.type != "cuda":
        raise Skip("symmetric memory needs CUDA")
    try:
        import torch.distributed._symmetric_memory as symm
    except ImportError as e:
        raise Skip(f"torch.distributed._symmetric_memory not importable ({e})") from None
    group_name = dist.group.WORLD.group_name
    shared = ranks_sharing_a_gpu(flat_in.device)
    if shared:  # NVSHMEM aborts the process there ("not supported with limited MPG"), it raises nothing
        raise Skip(f"symmetric memory needs one rank per GPU; ranks {shared} share one (several ranks on one GPU)")
    n = flat_in.numel() // world
    errors = []
    if hasattr(symm, "all_to_all_nd"):
        try:
            if hasattr(symm, "set_backend"):
                symm.set_backend("NCCL")
            buf = symm.empty((1, world, n), dtype=flat_in.dtype, device=flat_in.device)
            symm.rendezvous(buf, group_name)
            buf.view(-1).copy_(flat_in)
            out3 = out.view(world, 1, n)
            return lambda: symm.all_to_all_nd(buf, out3, 1, 0, group=group_name), "all_to_all_nd (NCCL)"
        except (RuntimeError, NotImplementedError, TypeError, AttributeError) as e:
            errors.append(f"all_to_all_nd: {e}")
    if getattr(symm, "is_nvshmem_available", lambda: False)():
        try:
            symm.set_backend("NVSHMEM")
            src = symm.empty(flat_in.numel(), dtype=flat_in.dtype, device=flat_in.device)
            dst = symm.empty(flat_in.numel(), dtype=flat_in.dtype, device=flat_in.device)
            symm.rendezvous(src, group_name)
            symm.rendezvous(dst, group_name)
            src.copy_(flat_in)

            def run():
                torch.ops.symm_mem.nvshmem_all_to_all(src, dst, group_name)
                return dst

            return run, "nvshmem_all_to_all"
        except (RuntimeError, NotImplementedError, TypeError, AttributeError) as e:
            errors.append(f"nvshmem_all_to_all: {e}")
    raise Skip("no usable symmetric-memory all-to-all in this torch" + (f" ({'; '.join(errors)})" if errors else ""))


# ---- the rows ----------------------------------------------------------------------------
def bare_case(op: str, sh: Shape, dtype, device, rank: int, world: int, comm=None) -> Case:
    """A flat all-to-all of ``count`` elements (rounded down to a multiple of the world)."""
    count = max(world, sh.count // world * world)
    chunk = count // world
    idx = torch.arange(rank * count, (rank + 1) * count, dtype=torch.int64, device=device)
    send = patterns.pattern(idx, SALT_FLAT).to(dtype)
    del idx
    recv = torch.empty_like(send)
    splits = [chunk] * world
    note = None
    if op == "a2a":

        def run():
            dist.all_to_all_single(recv, send)
            return recv
    elif op == "nccl":

        def run():
            comm.all_to_all(recv, send, splits, splits)
            return recv
    else:  # symm
        run, note = symmetric_all_to_all(send, recv, world)

    def check(out):
        # out[j*chunk + k] = peer j's element rank*chunk + k, i.e. global j*count + rank*chunk + k.
        wrong = 0
        for j in range(world):
            idx = torch.arange(j * count + rank * chunk, j * count + (rank + 1) * chunk, dtype=torch.int64, device=device)
            wrong += int((out.view(-1)[j * chunk : (j + 1) * chunk] != patterns.pattern(idx, SALT_FLAT).to(out.dtype)).sum().item())
        return wrong

    return Case(op, count, run, check, note)


def _inputs_s2h(sh: Shape, dtype, device, rank: int):
    """This rank's rows of the global q, k, v ``[B, S, H, D]`` (pattern data)."""
    S, t0 = sh.seq * sh.world, rank * sh.seq
    q = torch.empty(sh.batch, sh.seq, sh.heads, sh.head_dim, dtype=dtype, device=device)
    k = torch.empty(sh.batch, sh.seq, sh.kv_heads, sh.head_dim, dtype=dtype, device=device)
    v = torch.empty_like(k)
    patterns.fill_pattern_4d(q, SALT_Q, S, sh.heads, t0, range(sh.heads))
    patterns.fill_pattern_4d(k, SALT_K, S, sh.kv_heads, t0, range(sh.kv_heads))
    patterns.fill_pattern_4d(v, SALT_V, S, sh.kv_heads, t0, range(sh.kv_heads))
    return q, k, v


def _input_h2s(sh: Shape, plan: HeadPlan, dtype, device, rank: int):
    """This rank's heads (``plan.q_ranges[rank]``) of the global output, all rows."""
    S = sh.seq * sh.world
    a, b = plan.q_ranges[rank]
    x = torch.empty(sh.batch, S, b - a, sh.head_dim, dtype=dtype, device=device)
    return patterns.fill_pattern_4d(x, SALT_OUT, S, sh.heads, 0, range(a, b))


def layout_case(op: str, sh: Shape, dtype, device, rank: int, world: int, kernels: str | None = None, comm=None) -> Case:
    """``chain`` or ``fused-*`` on q/k/v (s2h) or on an output (h2s)."""
    S = sh.seq * sh.world
    plan = HeadPlan.build(sh.heads, sh.kv_heads, world)
    if op == "chain":
        if sh.heads % world:
            raise Skip(f"chain needs heads ({sh.heads}) divisible by the world size ({world})")
        g = sh.heads // sh.kv_heads
        repeat = sh.kv_heads % world != 0
        per = sh.heads // world
        q_heads = list(range(rank * per, (rank + 1) * per))
        if sh.direction == "s2h":
            q, k, v = _inputs_s2h(sh, dtype, device, rank)
            kv_per = (sh.heads if repeat else sh.kv_heads) // world
            kv_heads = [h // g for h in q_heads] if repeat else list(range(rank * kv_per, (rank + 1) * kv_per))

            def run():
                kk, vv = (k, v) if not repeat else (k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2))
                return [chain_seq_to_head(x, world, None) for x in (q, kk, vv)]

            def check(outs):
                return sum(
                    patterns.count_wrong_4d(o, salt, S, H, 0, heads)
                    for o, salt, H, heads in zip(outs, (SALT_Q, SALT_K, SALT_V), (sh.heads, sh.kv_heads, sh.kv_heads), (q_heads, kv_heads, kv_heads))
                )  # fmt: skip
        else:
            x = _input_h2s(sh, plan, dtype, device, rank) if plan.q_ranges[rank] == (q_heads[0], q_heads[-1] + 1) else None
            if x is None:  # the plan's ranges equal the chain's whenever heads divide
                raise Skip("chain and plan head ranges differ")

            def run():
                return chain_head_to_seq(x, world, None)

            def check(out):
                return patterns.count_wrong_4d(out, SALT_OUT, S, sh.heads, rank * sh.seq, range(sh.heads))

        return Case(op, sh.count, run, check)

    kern = get_kernels(kernels, device)
    layout = Layout(plan, rank, (sh.seq,) * world, sh.batch, sh.head_dim)
    if sh.direction == "s2h":
        q, k, v = _inputs_s2h(sh, dtype, device, rank)
        (qa, qb), (ka, kb) = plan.q_ranges[rank], plan.kv_ranges[rank]

        def run():
            return a2a_seq_to_head(layout, (q, k, v), QKV, comm, kern)

        def check(outs):
            return sum(
                patterns.count_wrong_4d(o, salt, S, H, 0, range(a, b))
                for o, salt, H, (a, b) in zip(outs, (SALT_Q, SALT_K, SALT_V), (sh.heads, sh.kv_heads, sh.kv_heads), ((qa, qb), (ka, kb), (ka, kb)))
            )  # fmt: skip
    else:
        x = _input_h2s(sh, plan, dtype, device, rank)

        def run():
            return a2a_head_to_seq(layout, [x], Q_ONLY, comm, kern)[0]

        def check(out):
            return patterns.count_wrong_4d(out, SALT_OUT, S, sh.heads, rank * sh.seq, range(sh.heads))

    return Case(op, sh.count, run, check)


# ---- the sweep -----------------------------------------------------------------------------
COLUMNS = [
    ("size", "size(B)", "d"),
    ("count", "count", "d"),
    ("type", "type", ""),
    ("op", "op", ""),
    ("time_us", "time(us)", ".1f"),
    ("time_q1_us", "q1(us)", ".1f"),
    ("time_q3_us", "q3(us)", ".1f"),
    ("algbw", "algbw(GB/s)", ".2f"),
    ("busbw", "busbw(GB/s)", ".2f"),
    ("wrong", "#wrong", "d"),
    ("x_chain", "x_chain", ".2f"),
    ("x_a2a", "x_a2a", ".2f"),
]


def select_ops(spec: str, device: torch.device) -> list[str]:
    if spec in ("all", ""):
        wanted = list(ALL_OPS)
    else:
        wanted = [s.strip() for s in spec.split(",") if s.strip()]
        bad = [s for s in wanted if s not in ALL_OPS]
        if bad:
            raise SystemExit(f"bench_alltoall: unknown --op {bad}; choose from {', '.join(ALL_OPS)} or all")
    # Kernel sets that are not importable here are dropped silently only when the
    # selection is "all"; naming one explicitly and not having it is reported as a skip.
    if spec in ("all", ""):
        have = set(available_kernels())
        wanted = [op for op in wanted if not op.startswith("fused-") or op == "fused-nccl" or op[6:] in have]
    return wanted


def open_native(ops: list[str], device: torch.device):
    """Our native NCCL communicator when an op needs it, and ``{op: why}`` for the ops that
    cannot run because it could not be made (on any rank)."""
    if not any(op in ("nccl", "fused-nccl") for op in ops):
        return None, {}
    try:
        native, why = native_nccl_comm(device), None
    except Skip as e:
        native, why = None, str(e)
    if timing.all_ok(native is not None):
        return native, {}
    why = why or "NCCLCommunicator failed on another rank"
    return None, {"nccl": why, "fused-nccl": why}


def unique_shapes(args, elem: int, world: int) -> list[Shape]:
    """The row shapes of the size sweep; sizes that round to the same tensors run once."""
    shapes = {}
    for _, sh in sweep_shapes(args, elem, world):
        shapes.setdefault(sh.count, sh)
    return list(shapes.values())


def sweep_shapes(args, elem: int, world: int) -> list[tuple[int, Shape]]:
    """``(requested bytes, shape)`` of every size of ``-b -e -f``."""
    sweep = sizes.size_sweep(sizes.parse_size(args.minbytes), sizes.parse_size(args.maxbytes), args.stepfactor)
    return [(size, shape_for(size, elem, args, world)) for size in sweep]


def rounding_notes(args, elem: int, world: int) -> list[str]:
    """One line per requested size that the rows do not measure exactly, saying what they
    measure and why (before, ``-b 1K -e 16K`` printed 960 to 12288 bytes and said nothing)."""
    per_token = (args.heads + 2 * args.kv_heads) if args.dir == "s2h" else args.heads
    token = per_token * args.head_dim * elem
    what = "q+k+v" if args.dir == "s2h" else "the output"
    notes, seen = [], {}
    for size, sh in sweep_shapes(args, elem, world):
        got = sh.count * elem
        if got == size and sh.count not in seen:
            seen[sh.count] = size
            continue
        if sh.head_dim != args.head_dim:
            why = f"below one token ({token} B: {per_token} heads x head_dim {args.head_dim} x {elem} B), head_dim shrinks to {sh.head_dim}"
        else:
            why = f"whole tokens of {token} B ({per_token} heads x head_dim {args.head_dim} x {elem} B): {sh.seq} per rank"
        dup = f"; the same row as {sizes.format_size(seen[sh.count])}" if sh.count in seen else ""
        seen.setdefault(sh.count, size)
        notes.append(f"# size {sizes.format_size(size)} ({size} B) measured as {got} B of {what}: {why}{dup}")
    return notes


def make_case(op: str, sh: Shape, dtype, device, rank: int, world: int, comms: dict) -> Case:
    """The case of ``op``, run once untimed (a kernel set that cannot run here fails now)."""
    if op in ("a2a", "nccl", "symm"):
        case = bare_case(op, sh, dtype, device, rank, world, comm=comms["native"])
    else:
        kern = None if op == "fused-nccl" else op[len("fused-") :]
        comm = comms["native"] if op == "fused-nccl" else comms["torch"]
        case = layout_case(op, sh, dtype, device, rank, world, kernels=kern, comm=comm)
    case.run()
    return case


def measure_op(op: str, sh: Shape, args, dtype, device, rank: int, world: int, comms: dict):
    """``(row, None)``: the timed and checked row of ``op`` at shape ``sh``; ``(None, why)``
    when it cannot run on some rank. Collective: every rank calls it with the same op."""
    try:
        case, err = make_case(op, sh, dtype, device, rank, world, comms), None
    except (Skip, ValueError, RuntimeError, NotImplementedError) as e:
        case, err = None, str(e)
    if not timing.all_ok(case is not None):
        return None, err or "skipped on another rank"
    holder = {}

    def timed():
        holder["out"] = case.run()

    times = timing.time_iters(timed, device=device, warmup=args.warmup_iters, iters=args.iters)
    t = timing.reduce_max(timing.median(times))
    spread = timing.spread(times, 1e6, "us")
    wrong = int(timing.reduce_sum(case.check(holder["out"]))) if args.check else None
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = case.count * elem
    algbw = nbytes / t / 1e9
    row = {"size": nbytes, "count": case.count, "type": sizes.dtype_name(dtype), "op": op, "dir": args.dir, "time_us": t * 1e6,
           "algbw": algbw, "busbw": algbw * (world - 1) / world, "wrong": wrong, "seq_per_rank": sh.seq,
           "head_dim": sh.head_dim, "impl": case.note, **spread}  # fmt: skip
    return row, None


def add_ratios(size_rows: list[dict]) -> None:
    """``x_chain`` and ``x_a2a`` of the rows of one size (None where that row is missing)."""
    by_op = {r["op"]: r for r in size_rows}
    for r in size_rows:
        r["x_chain"] = by_op["chain"]["time_us"] / r["time_us"] if "chain" in by_op else None
        r["x_a2a"] = r["time_us"] / by_op["a2a"]["time_us"] if "a2a" in by_op else None


def print_header(args, world: int, transport: str, device: torch.device, dtype, ops: list[str]) -> None:
    cpu = "" if device.type == "cuda" else f"  [{record.CPU_LABEL}]"
    print(f"# bench_alltoall: {world} ranks, {transport}, {device.type}, dtype {sizes.dtype_name(dtype)}, "
          f"dir {args.dir}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
          f"warmup {args.warmup_iters}, iters {args.iters}{cpu}", flush=True)  # fmt: skip
    print(f"# ops: {', '.join(ops)}", flush=True)


def floor_notes(rows: list[dict]) -> list[str]:
    """A line for each layout row (chain, fused-*) faster than the bare all-to-all of its
    size: its floor, so the time is noise of the run, not a win (``x_chain`` of such a row
    means nothing)."""
    shape = lambda r: (r["seq_per_rank"], r["head_dim"])  # noqa: E731 - one row shape of the sweep
    floors = {shape(r): r for r in rows if r["op"] == "a2a"}
    out = []
    for r in rows:
        if r["op"] in ("a2a", "nccl", "symm"):
            continue
        flag = timing.floor_flag(r, floors.get(shape(r)), "time_us", "the bare a2a of the same bytes")
        if flag:
            out.append(f"# {r['op']} at {r['size']} B ({r['time_us']:.1f} us): {flag}")
    return out


def report(rows: list[dict], notes: dict, device: torch.device) -> None:
    """The table (median and quartiles of the iterations), the rows faster than their floor,
    the skipped ops with their reasons and the total of wrong elements."""
    title = "# time: median over the iterations, q1/q3 its quartiles" + ("" if device.type == "cuda" else f"; {record.CPU_LABEL}: a code-path check")
    record.print_table(COLUMNS, rows, title=title)
    for line in floor_notes(rows):
        print(line, flush=True)
    if device.type != "cuda" and any(r["op"] == "fused-cuda" for r in rows):
        print("# fused-cuda on a CPU: the C++ extension's CPU twin of the CUDA kernels", flush=True)
    harness.print_skipped(notes)
    harness.print_wrong_total(rows, "Out of bounds values ")  # nccl-tests' words


def run_bench(args, rank: int, world: int, device: torch.device, transport: str) -> tuple[list[dict], dict]:
    """Every op at every size of the sweep, on every rank: the rows and ``{op: why}`` for
    the ops that did not run. Rank 0 prints the table."""
    dtype = sizes.parse_dtype(args.datatype)
    elem = torch.empty((), dtype=dtype).element_size()
    ops = select_ops(args.op, device)
    native, notes = open_native(ops, device)
    comms = {"torch": TorchCommunicator(None), "native": native}
    if rank == 0:
        print_header(args, world, transport, device, dtype, ops)
        for line in rounding_notes(args, elem, world):
            print(line, flush=True)
    shapes = unique_shapes(args, elem, world)
    progress = harness.Progress(len(shapes), rank == 0 and args.progress, "alltoall")
    rows = []
    for sh in shapes:
        size_rows = []
        for op in (op for op in ops if op not in notes):
            row, why = measure_op(op, sh, args, dtype, device, rank, world, comms)
            if row is None:
                notes[op] = why
            else:
                size_rows.append(row)
        add_ratios(size_rows)
        rows.extend(size_rows)
        progress.step(f"size {sh.count * elem} B done")
    if rank == 0:
        report(rows, notes, device)
    if native is not None:
        native.close()
    return rows, notes


def plot(rows: list[dict], path: str, env: dict) -> bool:
    plt = record.load_pyplot()
    if plt is None or not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in dict.fromkeys(r["op"] for r in rows):
        pts = [(r["size"], r["busbw"]) for r in rows if r["op"] == op]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"all-to-all, {env['world_size']} ranks, {record.device_label(env)}")
    ax.legend()
    return record.save_figure(plt, fig, path)


def _body(args, rank, world, device, transport):
    rows, notes = run_bench(args, rank, world, device, transport)
    meta = dict(vars(args), skipped=notes)
    harness.finish(args, rank, "bench_alltoall", lambda: record.env_record(device, world, transport), rows, meta, plot, rows)


def parse_args(argv=None, default_out_dir=None):
    p = harness.parser(__doc__)
    p.add_argument("-b", "--minbytes", default="1K", help="smallest size per rank (default 1K)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest size per rank (default 64M)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size multiplier (default 2)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-d", "--datatype", default="bf16", help="bf16, fp16, fp32, fp64")
    p.add_argument("-c", "--check", type=int, default=1, help="check every row (1, default) or not (0)")
    p.add_argument("--op", default="all", help=f"comma list of {', '.join(ALL_OPS)} (default: all available)")
    p.add_argument("--dir", choices=("s2h", "h2s"), default="s2h", help="q/k/v seq->head (default) or output head->seq")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32, Llama-3-8B)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128)
    harness.add_spawn(p)
    harness.add_output(p, default_out_dir)
    harness.add_progress(p, "a progress line per size on stderr, rank 0")
    return p.parse_args(argv)


def main(argv=None, *, default_out_dir=None) -> int:
    """Run the benchmark; ``default_out_dir`` replaces ``--out-dir``'s default (the
    checkout's ``bench/bench_alltoall.py`` passes ``bench/results``)."""
    return harness.launch(_body, parse_args(argv, default_out_dir))


if __name__ == "__main__":
    sys.exit(main())
