"""How much all-to-all time the chunked pipeline hides (``ulysses_attention(chunks=N)``).

    torchrun --nproc-per-node 8 -m ulysses_kernels.bench.overlap --heads-sets 32/8,40/8,64/8 --seqs 8K,32K,128K,256K
    python -m ulysses_kernels.bench.overlap --heads-sets 32/8,40/8 --seqs 8K,32K      # one GPU: world of one
    NCCL_MULTI_RANK_GPU_ENABLE=1 torchrun --nproc-per-node 2 -m ulysses_kernels.bench.overlap --seqs 8K,32K  # 2 ranks, 1 GPU
    python -m ulysses_kernels.bench.overlap                                         # CPU smoke: 2 gloo ranks, tiny
    python -m ulysses_kernels.bench.overlap --spawn 4 --heads-sets 10/2 --seqs 64,256 --head-dim 16   # CPU

For every head layout (``--heads-sets Hq/Hkv,...``, ``--heads/--kv-heads`` or ``--models``),
global sequence length (``--seqs``) and pass (``--passes fwd,fwdbwd``), on this rank's
share of one attention layer (causal):

  a2a        the all-to-alls of the pass alone (``attention.exchange.a2a_seq_to_head``/``a2a_head_to_seq``
             with the layer's layout and kernel set): fwd = q/k/v seq->head + output
             head->seq; fwdbwd adds dout seq->head and dq/dk/dv head->seq
  attention  the local attention of the pass alone on this rank's heads, through the backend
             object the layer runs (``backends.for_rank(resolve_backend(...), kv_map)``):
             ``forward`` (fwd) or ``forward(needs_grad=True)`` + ``backward`` (fwdbwd)
  layer      ``ulysses_attention(..., chunks=n)`` for n = 1, the count ``"auto"`` picks
             (``attention.chunked.choose_chunks``; called with ``chunks="auto"``) and every fixed
             ``--chunks`` count the plan can split into (``len(chunk_plans(plan, n)) == n``);
             fwd under ``no_grad``, fwdbwd = forward + ``backward(dout)``

Columns: ``exposed`` = layer - attention (floored at 0): the communication (and layout
work) the layer does not hide; ``exposed/a2a`` = exposed / a2a, the share of the
all-to-all time left exposed; ``x_chunks1`` = layer time with chunks=1 / this row's (the
speed-up of chunking); ``*`` marks the count ``chunks="auto"`` picks. Times: median over
``-n`` iterations after ``-w`` warm-up ones, a barrier before each, the slowest rank's
median; the JSON's ``spread`` is the largest rank's half range of the layer's iteration
times over their median.

The overlap targets, judged under the table and recorded in the JSON's
``meta.verdicts`` (``overlap_targets.verdicts``), per (layout, seq, pass): exposed/a2a <= 10% at long
sequences (``seq >= --long-from``, default 32K; the fastest chunked row), and the auto
count never slower than chunks=1 (within ``--auto-slack``, default the run's own spread).
Each is PASS, FAIL or "not evaluated" with the reason: no long sequence, no chunked or
auto row, or timings that cannot carry the claim (CPU, a world of one, ranks sharing a GPU).

#wrong: elements (summed over ranks) of the output, and for fwdbwd of dq, dk and dv, that
differ from the chunks=1 layer on the same inputs. On the CPU bit for bit (the pipeline's
contract with SDPA); on CUDA outside ``8 * noise + ulps(dtype) * max|ref|``, where
``noise`` is the largest difference between two chunks=1 runs (SDPA's backward
accumulates with atomics), as ``tests/test_pipeline.py`` checks; non-finite values always
count. The ``"math"`` backend is not head-chunk invariant on the CPU (docs/overlap.md), so
it gets the tolerance rule there too.

Rank 0 prints a progress line per (layout, seq, pass) on stderr (``--no-progress``: none);
the table and the verdicts go to stdout at the end.

One GPU (world of one, or two ranks sharing it: ranks beyond the GPU count share GPUs
round-robin, which NCCL allows from 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``) checks the
code path, not the overlap claim: that needs one GPU per rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

from ulysses_kernels import ulysses_attention
from ulysses_kernels.attention.chunked import CostModel, choose_chunks, chunk_plans
from ulysses_kernels.attention.exchange import a2a_head_to_seq, a2a_seq_to_head
from ulysses_kernels.backends import AttentionBackend, for_rank, resolve_backend
from ulysses_kernels.bench import harness, record, sizes, timing
from ulysses_kernels.bench.overlap_targets import claim_context, print_verdicts, verdicts
from ulysses_kernels.comm import TorchCommunicator
from ulysses_kernels.kernels import get_kernels
from ulysses_kernels.layout import Q_ONLY, QKV, Layout
from ulysses_kernels.math_attention import default_scale
from ulysses_kernels.plan import HeadPlan

MODELS = sizes.MODELS
PASSES = ("fwd", "fwdbwd")
# GPU tolerance: ulps(dtype) * max|ref| on top of 8x the chunks=1 run-to-run noise
# (the rule of tests/test_pipeline.py::_check_gpu).
ULPS = {torch.float64: 1e-12, torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
TENSORS = {"fwd": ("out",), "fwdbwd": ("out", "dq", "dk", "dv")}


# ---- the check ---------------------------------------------------------------------------
def count_wrong(got, ref, ref2=None, exact: bool = True) -> int:
    """Elements of the tensors ``got`` that differ from ``ref`` (same order).

    ``exact``: any difference counts (NaN included). Else an element counts when
    ``|got - ref| > 8 * noise + ulps * max|ref|`` (or is not finite), ``noise`` being
    ``max|ref - ref2|``, per tensor. A shape mismatch counts every element.
    """
    wrong = 0
    for g, a, a2 in zip(got, ref, ref2 if ref2 is not None else ref):
        if g.shape != a.shape:
            wrong += max(g.numel(), a.numel())
            continue
        if a.numel() == 0:
            continue
        if exact:
            wrong += int((g != a).sum().item())
            continue
        af, gf = a.float(), g.float()
        noise = (af - a2.float()).abs().max()
        tol = 8 * noise + ULPS.get(a.dtype, 2e-2) * af.abs().max()
        wrong += int((~((gf - af).abs() <= tol)).sum().item())  # NaN compares false: counted
    return wrong


# ---- what the sweep runs -------------------------------------------------------------------
def parse_chunks(text: str) -> tuple[list[int], bool]:
    """``"1,2,4,auto"`` -> ([1, 2, 4], True)."""
    fixed, auto = [], False
    for tok in (t.strip() for t in text.split(",") if t.strip()):
        if tok == "auto":
            auto = True
            continue
        n = int(tok)
        if n < 1:
            raise ValueError(f"--chunks: counts must be >= 1, got {n}")
        fixed.append(n)
    return sorted(set(fixed)), auto


def chunk_counts(plan: HeadPlan, fixed, want_auto: bool, auto: int, split: bool):
    """Counts to run (1 first) and ``(count, why)`` for fixed counts the plan cannot split into."""
    counts, notes = {1}, []
    for n in fixed:
        got = len(chunk_plans(plan, n, split_kv_groups=split))
        if got == n:
            counts.add(n)
        else:
            notes.append((n, f"the plan splits into at most {got}"))
    if want_auto:
        counts.add(auto)
    return sorted(counts), notes


class Case:
    """One (layout, sequence) on this rank: inputs, plan, layout, backend, kernel set."""

    def __init__(self, args, H, Hkv, S, rank, world, dtype, device):
        self.plan = HeadPlan.build(H, Hkv, world)  # ValueError when world > H
        self.rank, self.device, self.dtype = rank, device, dtype
        B, D, s = args.batch, args.head_dim, S // world
        self.layout = Layout(self.plan, rank, (s,) * world, B, D)
        g = torch.Generator(device=device).manual_seed(1234 * 1000 + rank)

        def rnd(h):
            return torch.randn(B, s, h, D, generator=g, device=device, dtype=torch.float32).to(dtype)

        self.q, self.k, self.v, self.dout = rnd(H), rnd(Hkv), rnd(Hkv), rnd(H)
        # The backend the layer resolves, and what it runs on this rank (SharedKV where all
        # query heads share one KV head); the pipeline splits groups only for AttentionBackend.
        self.backend = resolve_backend(args.attn_fn, self.q)
        self.split = isinstance(self.backend, AttentionBackend)
        self.kv_map = self.plan.local_kv_map(rank)
        self.rank_backend = for_rank(self.backend, self.kv_map)
        self.kern = get_kernels(args.kernels, device, self.layout)
        self.kernels = args.kernels
        self.scale = default_scale(D, None)
        self.comm = TorchCommunicator(None)

    def estimate_bytes(self) -> int:
        """A rough per-rank peak of one fwd+bwd with three kept results (a pre-check so that
        big sizes skip instead of one rank running out of memory inside a collective)."""
        lay, e = self.layout, torch.empty((), dtype=self.dtype).element_size()
        heads = self.plan.q_count(self.rank) + 2 * self.plan.kv_count(self.rank)
        head_side = lay.batch * lay.seq_total * heads * lay.head_dim * e
        seq_side = lay.batch * lay.seq_local * (self.plan.q_heads + 2 * self.plan.kv_heads) * lay.head_dim * e
        return int(6 * head_side + 12 * seq_side)

    # -- the pieces, timed one at a time --
    def local_tensors(self, pass_: str):
        """Head-sharded inputs of the pass (untimed): q/k/v views of the receive buffer, the
        backend's output, and for fwdbwd dout and the backend's dq/dk/dv."""
        ql, kl, vl = a2a_seq_to_head(self.layout, (self.q, self.k, self.v), QKV, self.comm, self.kern)
        t = {"qkv": (ql, kl, vl)}
        fwd = self.rank_backend.forward
        t["out"], state = fwd(ql, kl, vl, causal=True, scale=self.scale, kv_map=self.kv_map, needs_grad=pass_ == "fwdbwd")
        if pass_ == "fwdbwd":
            (t["dout"],) = a2a_seq_to_head(self.layout, [self.dout], Q_ONLY, self.comm, self.kern)
            t["grads"] = list(self.rank_backend.backward(state, t["dout"]))
        return t

    def a2a_fn(self, pass_: str, t):
        lay, comm, kern = self.layout, self.comm, self.kern

        def fwd():
            a2a_seq_to_head(lay, (self.q, self.k, self.v), QKV, comm, kern)
            a2a_head_to_seq(lay, [t["out"]], Q_ONLY, comm, kern)

        def fwdbwd():
            fwd()
            a2a_seq_to_head(lay, [self.dout], Q_ONLY, comm, kern)
            a2a_head_to_seq(lay, t["grads"], QKV, comm, kern)

        return fwd if pass_ == "fwd" else fwdbwd

    def attention_fn(self, pass_: str, t):
        ql, kl, vl = t["qkv"]
        be, kw = self.rank_backend, {"causal": True, "scale": self.scale, "kv_map": self.kv_map}

        def fwd():
            with torch.no_grad():
                be.forward(ql, kl, vl, needs_grad=False, **kw)

        def fwdbwd():
            _, state = be.forward(ql, kl, vl, needs_grad=True, **kw)
            be.backward(state, t["dout"])

        return fwd if pass_ == "fwd" else fwdbwd

    def layer_fn(self, pass_: str, chunks, holder: dict):
        """The layer; each call leaves its results (out, and dq, dk, dv) in ``holder``."""
        leaves = [x.detach().requires_grad_(True) for x in (self.q, self.k, self.v)]

        def call(q, k, v):
            return ulysses_attention(q, k, v, causal=True, attn_fn=self.backend, comm=self.comm,
                                     kernels=self.kernels, chunks=chunks, check=False)  # fmt: skip

        def fwd():
            with torch.no_grad():
                holder["res"] = (call(self.q, self.k, self.v),)

        def fwdbwd():
            for x in leaves:
                x.grad = None
            out = call(*leaves)
            out.backward(self.dout)
            holder["res"] = (out.detach(), *(x.grad for x in leaves))

        return fwd if pass_ == "fwd" else fwdbwd


def print_header(args, world: int, transport: str, device: torch.device, dtype) -> None:
    model = CostModel.from_env(device.type)
    lab = "" if device.type == "cuda" else f"  [{record.CPU_LABEL}]"
    print(
        f"# bench_overlap: {world} ranks, {transport}, {device.type}, {sizes.dtype_name(dtype)}, batch {args.batch}, "
        f"head_dim {args.head_dim}, causal, kernels {args.kernels}, attn_fn {args.attn_fn or 'default'}, "
        f"warmup {args.warmup_iters}, iters {args.iters}{lab}",
        flush=True,
    )
    print(f"# chunks='auto' cost model (ULYSSES_KERNELS_* env): link {model.link_gbps:g} GB/s, attention "
          f"{model.attn_tflops:g} TFLOP/s, latency {model.latency_us:g} us, overlap slowdown "
          f"{model.overlap_slowdown:g}, min gain {model.min_gain:g}", flush=True)  # fmt: skip


def make_case(args, H, Hkv, S, rank, world, dtype, device):
    """``(case, None)``, or ``(None, why)`` when the plan cannot be built or the size's
    estimated memory does not fit."""
    try:
        case = Case(args, H, Hkv, S, rank, world, dtype, device)
        if device.type == "cuda":
            need, free = case.estimate_bytes(), torch.cuda.mem_get_info(device)[0]
            if need > args.mem_fraction * free:
                raise harness.Skip(f"estimated {need / 2**30:.1f} GiB > {args.mem_fraction:.0%} of free {free / 2**30:.1f} GiB")
    except harness.Skip as e:
        return None, str(e)
    except (ValueError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"
    return case, None


def run_case(args, case: Case, name: str, S: int, world: int, notes: dict, progress) -> list[dict]:
    """Every pass of one (layout, sequence): the chunk counts to run (1, the plan's splits of
    ``--chunks``, the count "auto" picks), measured; an OOM is noted, any other error propagates."""
    fixed, want_auto = parse_chunks(args.chunks)
    cuda = case.device.type == "cuda"
    auto = choose_chunks(case.layout, case.q.element_size(), True, case.device.type, split_kv_groups=case.split)
    counts, chunk_notes = chunk_counts(case.plan, fixed, want_auto, auto, case.split)
    for n, why in chunk_notes:
        notes.setdefault(f"{name} chunks={n}", why)
    # Bit for bit on the CPU (not the "math" einsum, see the module docstring).
    exact = not cuda and case.backend.name != "math"
    rows = []
    for p in args.passes:
        progress.step(f"{name} S={S} {p}")
        try:
            rows += measure(args, case, p, counts, auto if want_auto else None, exact, name, S, world)
            why = None
        except torch.OutOfMemoryError as e:
            why = f"OOM: {str(e).splitlines()[0] if str(e) else ''}"
        if not timing.all_ok(why is None):
            notes[f"{name} S={S} {p}"] = why or "failed on another rank"
        if cuda:
            torch.cuda.empty_cache()
    return rows


def report(rows, notes: dict, v: dict, device: torch.device) -> None:
    """The table, the skipped cases with their reasons, the targets' verdicts, the wrong total."""
    title = "# layer = ulysses_attention(chunks=N); exposed = layer - attention; * = chunks='auto'; spread = half the range of the layer's iterations / median"
    title += "" if device.type == "cuda" else f"\n# times: {record.CPU_LABEL}: a code-path check"
    record.print_table(COLUMNS, rows, title=title)
    harness.print_skipped(notes)
    print_verdicts(v)
    harness.print_wrong_total(rows)


def run_bench(args, rank: int, world: int, device: torch.device, transport: str):
    """Every (layout, sequence, pass) on every rank: the rows, ``{what: why}`` for what did
    not run, and the targets' verdicts. Rank 0 prints the table and the verdicts."""
    dtype = sizes.parse_dtype(args.datatype or ("bf16" if device.type == "cuda" else "fp32"))
    layouts = sizes.parse_heads_sets("bench_overlap", args.heads_sets, args.models or "llama3-8b", args.heads, args.kv_heads)
    seqs = [-(-sizes.parse_size(x) // world) * world for x in args.seqs.split(",")]  # equal shards
    if rank == 0:
        print_header(args, world, transport, device, dtype)
    rows, notes = [], {}
    progress = harness.Progress(len(layouts) * len(seqs) * len(args.passes), rank == 0 and args.progress, "overlap")
    for name, H, Hkv in layouts:
        for S in seqs:
            case, why = make_case(args, H, Hkv, S, rank, world, dtype, device)
            if not timing.all_ok(case is not None):
                notes[f"{name} S={S}"] = why or "skipped on another rank"
                for p in args.passes:
                    progress.step(f"{name} S={S} {p} skipped")
                continue
            rows += run_case(args, case, name, S, world, notes, progress)
            del case
    v = verdicts(rows, args.long_from, args.auto_slack, claim_context(device, world))
    if rank == 0:
        report(rows, notes, v, device)
    return rows, notes, v


def measure(args, case: Case, pass_: str, counts, auto, exact: bool, name: str, S: int, world: int) -> list[dict]:
    """The rows of one (layout, sequence, pass): a2a, attention, then the layer per count."""
    dev, w, n_it = case.device, args.warmup_iters, args.iters

    def timed(fn) -> tuple[float, float]:
        """(the slowest rank's median, the largest rank's relative spread: half the range of
        its iteration times over their median; 0 with one iteration)."""
        times = timing.time_iters(fn, device=dev, warmup=w, iters=n_it)
        med = timing.median(times)
        return timing.reduce_max(med), timing.reduce_max((max(times) - min(times)) / (2 * med) if med > 0 else 0.0)

    t = case.local_tensors(pass_)
    t_a2a, _ = timed(case.a2a_fn(pass_, t))
    t_attn, _ = timed(case.attention_fn(pass_, t))
    del t
    holder = {}
    ref = ref2 = None
    if args.check:  # untimed chunks=1 runs: the reference (and on CUDA its run-to-run noise)
        base = case.layer_fn(pass_, 1, holder)
        base()
        ref = holder.pop("res")
        if not exact:
            base()
            ref2 = holder.pop("res")
    rows, t1 = [], None
    for n in counts:
        is_auto = auto is not None and n == auto
        fn = case.layer_fn(pass_, "auto" if is_auto and n != 1 else n, holder)
        t_layer, spread = timed(fn)
        wrong = None
        if args.check:
            wrong = int(timing.reduce_sum(count_wrong(holder.pop("res"), ref, ref2, exact)))
        holder.clear()
        t1 = t_layer if n == 1 else t1
        exposed = max(0.0, t_layer - t_attn)
        rows.append({
            "layout": name, "seq": S, "world": world, "pass": pass_, "chunks": n, "auto": is_auto,
            "chunks_label": f"{n}{'*' if is_auto else ''}", "layer_ms": t_layer * 1e3, "attn_ms": t_attn * 1e3,
            "a2a_ms": t_a2a * 1e3, "exposed_ms": exposed * 1e3, "exposed_frac": exposed / t_a2a if t_a2a > 0 else None,
            "speedup": t1 / t_layer, "spread": spread, "wrong": wrong, "checked": ",".join(TENSORS[pass_]) if args.check else None,
            "exact": exact, "batch": args.batch, "head_dim": args.head_dim, "dtype": sizes.dtype_name(case.dtype),
            "backend": case.backend.name, "kernels": case.kern.name,
        })  # fmt: skip
    return rows


COLUMNS = [
    ("layout", "layout", ""), ("seq", "seq", "d"), ("world", "P", "d"), ("pass", "pass", ""),
    ("chunks_label", "chunks", ""), ("layer_ms", "layer(ms)", ".3f"), ("attn_ms", "attn(ms)", ".3f"),
    ("a2a_ms", "a2a(ms)", ".3f"), ("exposed_ms", "exposed(ms)", ".3f"), ("exposed_frac", "exposed/a2a", ".1%"),
    ("speedup", "x_chunks1", ".2f"), ("spread", "spread", ".1%"), ("wrong", "#wrong", "d"),
]  # fmt: skip


def plot(rows, path, env) -> bool:
    """exposed/a2a against the sequence length, one line per (layout, pass, chunk count)."""
    plt = record.load_pyplot()
    if plt is None or not rows:
        return False
    passes = list(dict.fromkeys(r["pass"] for r in rows))
    fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4.5), squeeze=False)
    for ax, p in zip(axes[0], passes):
        sel = [r for r in rows if r["pass"] == p and r["exposed_frac"] is not None]
        for series in dict.fromkeys((r["layout"], r["chunks_label"]) for r in sel):
            pts = [(r["seq"], 100 * r["exposed_frac"]) for r in sel if (r["layout"], r["chunks_label"]) == series]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{series[0]} chunks={series[1]}")
        ax.axhline(10, color="grey", linestyle="--", linewidth=1, label="target 10%")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global sequence length")
        ax.set_ylabel("exposed / all-to-all time (%)")
        ax.set_title(f"{p}, {env['world_size']} ranks, {record.device_label(env)}", fontsize=9)
        ax.legend(fontsize=7)
    return record.save_figure(plt, fig, path)


def _body(args, rank, world, device, transport):
    rows, notes, v = run_bench(args, rank, world, device, transport)
    model = CostModel.from_env(device.type)
    meta = dict(vars(args), skipped=notes, cost_model=dataclasses.asdict(model), verdicts=v)
    env_fn = lambda: record.env_record(  # noqa: E731
        device, world, transport, ulysses_env={k: v for k, v in os.environ.items() if k.startswith("ULYSSES_KERNELS_")}
    )
    harness.finish(args, rank, "bench_overlap", env_fn, rows, meta, plot, rows)


def parse_args(argv=None, default_out_dir=None):
    p = harness.parser(__doc__)
    p.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} or all (GPU default llama3-8b)")
    harness.add_heads_sets(p, "query/KV head counts Hq/Hkv,... (overrides --heads and --models; CPU default 8/2)")
    p.add_argument("--heads", type=int, default=None, help="query heads of one layout (with --kv-heads)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads of that layout (default --heads)")
    p.add_argument("--seqs", default=None, help="global sequence lengths, e.g. 8K,32K (default GPU 8K,32K,64K; CPU 64,128)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=None, help="default GPU 128, CPU 16")
    p.add_argument("-d", "--datatype", default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--chunks", default="1,2,4,auto", help="chunk counts to run, 'auto' included (1 always runs)")
    p.add_argument("--passes", default="fwd,fwdbwd", help="comma list of fwd, fwdbwd")
    p.add_argument("--kernels", default="auto", help="pack/unpack kernel set: auto, torch, triton, cuda")
    p.add_argument("--attn-fn", default=None, help="attention backend: flash, sdpa, math (default: flash if importable, else sdpa)")
    p.add_argument("-w", "--warmup-iters", dest="warmup_iters", type=int, default=None, help="default GPU 2, CPU 1")
    p.add_argument("-n", "--iters", type=int, default=None, help="default GPU 5, CPU 3")
    p.add_argument("--check", type=int, default=1, help="compare every row with chunks=1 (1) or not (0)")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="skip a size whose estimate exceeds this share of free memory")
    harness.add_spawn(p, None, "spawn N gloo ranks on the CPU (default: 2 without torchrun and without a GPU, else 0)")
    p.add_argument("--long-from", default="32K", help="the exposed/a2a <= 10%% target is judged at global sequences >= this (default 32K)")
    p.add_argument(
        "--auto-slack",
        type=float,
        default=None,
        metavar="FRAC",
        help="noise allowance of the auto <= chunks=1 target (0: strict; default: the run's own spread)",
    )
    harness.add_progress(p, "one line per (heads, seq, pass) on stderr, rank 0")
    harness.add_output(p, default_out_dir)
    args = p.parse_args(argv)
    args.passes = tuple(x.strip() for x in args.passes.split(",") if x.strip())
    if not args.passes or any(x not in PASSES for x in args.passes):
        p.error(f"--passes: choose from {', '.join(PASSES)}")
    try:
        parse_chunks(args.chunks)
        args.long_from = sizes.parse_size(args.long_from)
    except ValueError as e:
        p.error(str(e))
    if args.auto_slack is not None and args.auto_slack < 0:
        p.error("--auto-slack must be >= 0")
    cuda = torch.cuda.is_available() and os.environ.get("ULYSSES_KERNELS_BENCH_CPU", "0") != "1"
    if args.spawn is None:
        args.spawn = 2 if not cuda and "RANK" not in os.environ else 0
    gpu = cuda and not args.spawn  # --spawn runs gloo ranks on the CPU: CPU-sized defaults
    if args.heads_sets is None and args.heads is None and args.models is None and not gpu:
        args.heads_sets = "8/2"  # Llama-3-8B's 4:1 grouping, scaled down
    gpu_defaults = {"seqs": "8K,32K,64K", "head_dim": 128, "warmup_iters": 2, "iters": 5}
    defaults = gpu_defaults if gpu else {"seqs": "64,128", "head_dim": 16, "warmup_iters": 1, "iters": 3}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.iters < 1 or args.warmup_iters < 0:
        p.error("-n must be >= 1 and -w >= 0")
    return args


def main(argv=None, *, default_out_dir=None) -> int:
    """Run the benchmark; ``default_out_dir`` replaces ``--out-dir``'s default (the
    checkout's ``bench/bench_overlap.py`` passes ``bench/results``)."""
    return harness.launch(_body, parse_args(argv, default_out_dir))


if __name__ == "__main__":
    sys.exit(main())
