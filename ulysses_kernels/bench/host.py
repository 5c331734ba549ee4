"""Host time per call: the op, its module and the peers' permute chain, in one interleaved run.

    python -m ulysses_kernels.bench.host                  # world 1 (one process, a gloo group of one)
    python -m ulysses_kernels.bench.host --spawn 2        # 2 gloo ranks on the CPU
    torchrun --nproc-per-node 8 -m ulysses_kernels.bench.host --seq 16   # on GPUs: host time is the step time at short sequences

At tiny shapes (default: batch 1, 16 tokens per rank, 8 query and 2 KV heads, head_dim 16,
float32, forward only) the attention itself costs little, so the time per call is what the
host spends around it: resolving the call, packing, posting collectives, autograd. Rows:

  op           ``ulysses_attention(..., check=False)``
  op+check     ``ulysses_attention(..., check=True)``: one small all-gather of every rank's
               input signature per call, so that bad inputs raise on every rank
  module       ``UlyssesAttention`` (checks each new input signature once)
  chain        ``baselines.permute_chain_attention``: what DeepSpeed/yunchang run (per tensor
               a permute, a copy, ``all_to_all_single``, a permute and a copy; SDPA)
  op+gather    (more than one rank) ``op``, then one bare all-gather of the integers
               ``op+check`` gathers: what the check should cost, and nothing else

Timing: after a warm-up, ``--reps`` rounds; in each round every row runs ``--calls`` calls
back to back after a barrier, the rows in a shuffled order (so that a burst of load on a
shared machine, or the wake of a collective, hits every row alike); a row's time per call
is the median over rounds, the slowest rank's. ``x_chain``: the row's time over the
chain's. ``resolve``: the time a call spends resolving its set-up (plan, layout,
communicator, kernel set, backend: ``attention.call.setup_attention`` for the op, the
module's look-up of the signature it has resolved before) after the first call, timed
alone the same way; ``resolve %``: its share of the row's time. ``colls``: the
torch.distributed collectives one call after the first posts (counted, not timed). The
``check`` line compares op+check minus op with op+gather minus op.
#wrong: output elements (summed over ranks) off the float64 reference by more than 1e-4.

These are host timings on the machine they ran on (the table prints the load average): a
shared, busy machine stretches everything, the gloo collectives most (their threads wait
to be scheduled). Compare rows of one run, not runs.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_kernels import UlyssesAttention, ulysses_attention
from ulysses_kernels.attention.call import setup_attention
from ulysses_kernels.baselines import permute_chain_attention
from ulysses_kernels.bench import harness, record, sizes, timing
from ulysses_kernels.checks import call_key, encoded
from ulysses_kernels.comm import get_communicator
from ulysses_kernels.testing.reference import attention_reference, contiguous_shard

warnings.filterwarnings("ignore", message=r".*all_to_all_single is deprecated", category=FutureWarning)

ROWS = ("op", "op+check", "module", "chain")  # and op+gather on more than one rank
# torch.distributed's collectives, counted per call (``count_collectives``).
COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "batch_isend_irecv",
               "reduce_scatter_tensor", "barrier")  # fmt: skip
TOL = 1e-4  # float32 SDPA against float64 at 16 tokens: errors of a few 1e-7


@contextlib.contextmanager
def count_collectives():
    """Count the calls of torch.distributed's collectives while the block runs: yields a
    dict ``{name: calls}`` (names with no call left out)."""
    counts: dict[str, int] = {}
    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in real.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


# ---- what one layer's data movement dispatches (counted, not timed) -------------------------
# Ops that read a value back to the host (a device sync on a GPU).
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "masked_select", "unique", "_unique", "_unique2", "equal"})
# Ops that only allocate (no kernel).
EMPTY_OPS = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"})


class DispatchCount(TorchDispatchMode):
    """Counts the ops dispatched while active, by what they cost on a GPU: ``launch`` (an op
    that moves or computes data: a kernel launch on a GPU, ours or aten's), ``alloc``
    (outputs that get fresh storage), ``view`` (a view: host work only), ``sync`` (an op
    that reads a value back to the host). ``ops``: every dispatched op, ``names``: launches by
    op name. Works on CPU tensors: the CPU twin of the ``cuda`` kernel set runs the very
    host path the CUDA kernels do (the same Python, the same op calls)."""

    def __init__(self):
        super().__init__()
        self.counts = {"ops": 0, "launch": 0, "alloc": 0, "view": 0, "sync": 0}
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counts
        c["ops"] += 1
        name = func._schema.name.split("::")[-1]
        returns = func._schema.returns
        if name in SYNC_OPS:
            c["sync"] += 1
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            c["view"] += 1
        else:
            c["alloc"] += sum(1 for r in returns if r.alias_info is None and str(r.type).startswith("Tensor"))
            if name not in EMPTY_OPS:
                c["launch"] += 1
                self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class NullCommunicator:
    """A communicator whose collectives move nothing (``rank`` of ``world_size``): what the
    movers do around the collectives, counted without them. ``posts``: collectives posted."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.posts = rank, world_size, 0

    def all_to_all(self, output, input, output_splits, input_splits, async_op=False):
        self.posts += 1

    def send_recv(self, sends, recvs, async_op=False):
        self.posts += 1

    def all_gather_ints(self, values, device):
        return [list(values)] * self.world_size


def layer_exchange_counts(layout, kernels, dtype=torch.float32) -> dict:
    """Dispatch counts (``DispatchCount``) and collectives of one attention layer's data
    movement, fwd + bwd, as the eager path runs it for rank ``layout.rank`` (collectives
    replaced by nothing): forward q/k/v to heads and the output back, backward dout to heads
    and dq/dk/dv back (``SeqToHead``/``HeadToSeq`` forward and backward). CPU tensors."""
    from ulysses_kernels.attention.exchange import a2a_head_to_seq, a2a_seq_to_head
    from ulysses_kernels.layout import OUT, QKV

    B, s, S, D = layout.batch, layout.seq_local, layout.seq_total, layout.head_dim
    q, k, v = (torch.randn(B, s, layout.total_heads(r), D, dtype=dtype) for r in ("q", "kv", "kv"))
    dout = torch.randn(B, s, layout.total_heads("q"), D, dtype=dtype)
    local = [torch.randn(B, S, layout.head_count(r, layout.rank), D, dtype=dtype) for r in ("q", "kv", "kv")]
    comm = NullCommunicator(layout.rank, layout.world_size)
    with DispatchCount() as fwd:
        a2a_seq_to_head(layout, (q, k, v), QKV, comm, kernels)
        a2a_head_to_seq(layout, [local[0]], OUT, comm, kernels)
    with DispatchCount() as bwd:
        a2a_seq_to_head(layout, [dout], OUT, comm, kernels)
        a2a_head_to_seq(layout, local, QKV, comm, kernels)
    return {"fwd": fwd.counts, "bwd": bwd.counts, "collectives": comm.posts, "names": _merge(fwd.names, bwd.names)}


def chain_layer_counts(B: int, s: int, heads: int, kv_heads: int, world: int, D: int, dtype=torch.float32) -> dict:
    """The same counts for the peers' chain (``baselines.chain_seq_to_head``/``chain_head_to_seq``:
    DeepSpeed's and yunchang's per-tensor permute copies), its ``all_to_all_single`` replaced
    by nothing; KV heads repeated up to the query heads when they do not divide, as the peers
    do (the repeat and its backward's sum counted)."""
    import ulysses_kernels.baselines as B_

    repeat = kv_heads % world != 0
    kv = heads if repeat else kv_heads
    q = torch.randn(B, s, heads, D, dtype=dtype)
    k = torch.randn(B, s, kv_heads, D, dtype=dtype)
    local = [torch.randn(B, s * world, h // world, D, dtype=dtype) for h in (heads, kv, kv)]
    posts = [0]

    def null_all_to_all(x, group):
        posts[0] += 1
        return torch.empty_like(x)

    with DispatchCount() as fwd:
        kk = k.repeat_interleave(heads // kv_heads, dim=2) if repeat else k
        for x in (q, kk, kk):
            B_.chain_seq_to_head(x, world, None, null_all_to_all)
        B_.chain_head_to_seq(local[0], world, None, null_all_to_all)
    with DispatchCount() as bwd:
        B_.chain_seq_to_head(q, world, None, null_all_to_all)  # dout has q's shape
        grads = [B_.chain_head_to_seq(x, world, None, null_all_to_all) for x in local]
        if repeat:  # the backward of repeat_interleave: sum the copies of dk and dv
            for g in grads[1:]:
                g.view(B, s, kv_heads, heads // kv_heads, D).sum(3)
    return {"fwd": fwd.counts, "bwd": bwd.counts, "collectives": posts[0], "names": _merge(fwd.names, bwd.names)}


def _merge(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b))}


def make_inputs(args, rank: int, world: int, device: torch.device, dtype: torch.dtype):
    """The global q, k, v (the same on every rank: one seed) and this rank's shards."""
    g = torch.Generator().manual_seed(1234)
    S = args.seq * world
    full = [torch.randn(args.batch, S, h, args.head_dim, generator=g, dtype=torch.float64) for h in (args.heads, args.kv_heads, args.kv_heads)]
    lens = [args.seq] * world
    mine = [contiguous_shard(x, lens, rank).to(device, dtype).contiguous().requires_grad_(args.requires_grad) for x in full]
    return full, mine


def rows_fns(q, k, v, module, gather) -> dict:
    """What each row runs once: ``{row: fn}``; ``gather``: the check's all-gather alone (on
    more than one rank: the ``op+gather`` row)."""
    fns = {
        "op": lambda: ulysses_attention(q, k, v, check=False),
        "op+check": lambda: ulysses_attention(q, k, v, check=True),
        "module": lambda: module(q, k, v),
        "chain": lambda: permute_chain_attention(q, k, v),
    }
    if gather is not None:
        fns["op+gather"] = lambda: (ulysses_attention(q, k, v, check=False), gather())[0]
    return fns


def resolve_fns(q, k, v, module):
    """The set-up part of the op's and the module's calls, alone: ``{row: fn}``."""
    # ulysses_attention(q, k, v, check=False)'s arguments
    kw = {"group": None, "comm": None, "plan": None, "seq_lens": None, "causal": True, "softmax_scale": None, "attn_fn": None,
          "kernels": None, "chunks": 1, "check": False}  # fmt: skip
    return {"op": lambda: setup_attention(q, k, v, **kw), "module": lambda: module._resolve(q, k, v)}


def interleaved(fns: dict, *, reps: int, calls: int, warmup: int, world: int) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns``: one value per round (module docstring)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    order = random.Random(0)  # the same orders on every rank
    for _ in range(reps):
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name].append((time.perf_counter() - t0) / calls)
    return out


def run_bench(args, rank: int, world: int, device: torch.device, transport: str) -> tuple[list[dict], dict]:
    dtype = sizes.parse_dtype(args.datatype)
    full, (q, k, v) = make_inputs(args, rank, world, device, dtype)
    module = UlyssesAttention(args.heads, args.kv_heads)
    # The check's one collective, bare: an all-gather of the integers op+check gathers.
    key = call_key(q, k, v, rank=rank, world_size=world, causal=True, softmax_scale=None, seq_lens=None, plan=None)
    ints, members = list(encoded(key)), get_communicator(None)
    fns = rows_fns(q, k, v, module, (lambda: members.all_gather_ints(ints, device)) if world > 1 else None)
    ref = contiguous_shard(attention_reference(*full), [args.seq] * world, rank)
    wrong, colls = {}, {}
    for name, fn in fns.items():
        fn()  # the first call: the module checks and resolves its new signature
        with count_collectives() as counts:
            out = fn()  # a call after the first, as every call the rounds time
        colls[name] = counts
        wrong[name] = int(timing.reduce_sum(float(((out.detach().double().cpu() - ref).abs() > TOL).sum())))
    grad = contextlib.nullcontext() if args.requires_grad else torch.no_grad()
    load_before = os.getloadavg()
    with grad:
        times = interleaved(fns, reps=args.reps, calls=args.calls, warmup=args.warmup, world=world)
        resolve = interleaved(resolve_fns(q, k, v, module), reps=args.reps, calls=args.calls, warmup=args.warmup, world=world)
    load_after = os.getloadavg()
    med = {n: timing.reduce_max(timing.median(ts)) for n, ts in times.items()}
    res = {n: timing.reduce_max(timing.median(ts)) for n, ts in resolve.items()}
    rows = []
    for name in fns:
        t = med[name]
        row = {
            "row": name,
            "world": world,
            "us_per_call": t * 1e6,
            "x_chain": t / med["chain"],
            "colls": sum(colls[name].values()),
            "collectives": ",".join(f"{k}:{n}" for k, n in sorted(colls[name].items())) or "-",
            "resolve_us": res[name] * 1e6 if name in res else None,
            "resolve_pct": 100 * res[name] / t if name in res else None,
            "wrong": wrong[name],
        }
        rows.append(row)
    meta = dict(
        vars(args), load_before=load_before, load_after=load_after, check_extra_us=(med["op+check"] - med["op"]) * 1e6,
        all_gather_us=(med["op+gather"] - med["op"]) * 1e6 if world > 1 else 0.0, signature_ints=len(ints),
    )  # fmt: skip
    if rank == 0:
        report(rows, meta, world, device)
    return rows, meta


COLUMNS = [
    ("row", "row", ""),
    ("us_per_call", "us/call", ".1f"),
    ("x_chain", "x_chain", ".2f"),
    ("colls", "colls", ""),
    ("resolve_us", "resolve us", ".1f"),
    ("resolve_pct", "resolve %", ".1f"),
    ("wrong", "#wrong", ""),
]


def report(rows: list[dict], meta: dict, world: int, device: torch.device) -> None:
    load = "/".join(f"{x:.1f}" for x in meta["load_before"]) + " -> " + "/".join(f"{x:.1f}" for x in meta["load_after"])
    timer = record.CPU_LABEL if device.type != "cuda" else "perf_counter, host time"
    title = (f"# host time per call, forward{' (inputs require grad)' if meta['requires_grad'] else ''}: world {world}, B={meta['batch']}, "
             f"{meta['seq']} tokens/rank, {meta['heads']}/{meta['kv_heads']} heads, D={meta['head_dim']}, {meta['datatype']}; "
             f"{meta['reps']} rounds x {meta['calls']} calls; {timer}; load average {load} on {os.cpu_count()} CPUs")  # fmt: skip
    record.print_table(COLUMNS, rows, title=title)
    by = {r["row"]: r for r in rows}
    target = "<= 0.5" if world == 1 else "< 1"
    for name in ("op", "module"):
        print(f"# {name} / chain = {by[name]['x_chain']:.2f} (target {target})")
    if world > 1:
        print(f"# check: op+check - op = {meta['check_extra_us']:.1f} us per call; op+gather (op, then one bare all_gather of the same "
              f"{meta['signature_ints']} ints) - op = {meta['all_gather_us']:.1f} us; collectives per call {by['op+check']['colls']} "
              f"vs {by['op']['colls']}")  # fmt: skip
    else:
        print("# check: nothing to exchange at world 1 (op+check runs the op alone)")
    print(f"# resolve after the first call: op {by['op']['resolve_pct']:.1f}%, module {by['module']['resolve_pct']:.1f}% of the call (target < 10%)")


def plot(rows: list[dict], path: str, env: dict) -> bool:
    plt = record.load_pyplot()
    if plt is None or not rows:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.barh([r["row"] for r in rows], [r["us_per_call"] for r in rows])
    ax.set_xlabel("host time per call (us)")
    ax.set_title(f"host time, world {env['world_size']}, {record.device_label(env)}")
    return record.save_figure(plt, fig, path)


def _body(args, rank, world, device, transport):
    rows, meta = run_bench(args, rank, world, device, transport)
    env = lambda: record.env_record(device, world, transport, load_average=list(os.getloadavg()))  # noqa: E731
    harness.finish(args, rank, "bench_host", env, rows, meta, plot, rows)


def parse_args(argv=None, default_out_dir=None):
    p = harness.parser(__doc__)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=16, help="tokens per rank (default 16)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("-d", "--datatype", default="fp32", help="bf16, fp16, fp32, fp64 (default fp32)")
    p.add_argument("--requires-grad", action="store_true", help="inputs that require grad (the forward records autograd nodes)")
    p.add_argument("-w", "--warmup", type=int, default=20, help="calls of each row before timing (default 20)")
    p.add_argument("-r", "--reps", type=int, default=200, help="rounds (default 200)")
    p.add_argument("-n", "--calls", type=int, default=10, help="calls per row per round (default 10)")
    harness.add_spawn(p)
    harness.add_output(p, default_out_dir)
    return p.parse_args(argv)


def main(argv=None, *, default_out_dir=None) -> int:
    """Run the benchmark; ``default_out_dir`` replaces ``--out-dir``'s default (the
    checkout's ``bench/bench_host.py`` passes ``bench/results``)."""
    return harness.launch(_body, parse_args(argv, default_out_dir))


if __name__ == "__main__":
    sys.exit(main())
