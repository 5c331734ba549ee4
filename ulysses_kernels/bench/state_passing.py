"""The two ways a hybrid's linear-attention and SSM layers run, timed side by side: the head
exchange (``mixer_parallel="heads"``) and state passing (``"state"``, docs/state_passing.md).

    python -m ulysses_kernels.bench.state_passing --spawn 2 --seqs 512,2048          # CPU, gloo ranks
    torchrun --nproc-per-node 2 -m ulysses_kernels.bench.state_passing --seqs 32K    # GPU ranks

Per model (``--models``, rows of ``ulysses_kernels.testing.hybrids.MODELS``: default the
attention-free ``mamba2`` (Mamba2) and ``mamba`` (Mamba1, whose head exchange is three
all-to-alls) and ``qwen3.5`` (two Gated DeltaNet layers and one attention layer)) and global
sequence length (``--seqs``, batch 1), the same model under ``hf.apply`` with each strategy:
one training step (forward, the loss, backward) on every rank, ``-w`` warm-up steps, then ``-n``
timed ones (a barrier before each; CUDA events on a GPU, ``perf_counter`` on the CPU); the
median, min and max of rank 0, the bytes rank 0 put on the wire in one step (counted:
``traffic.WireCounter``), and ``state/heads``, the ratio of the medians in the same run. The
models' own kernels in ``--dtype`` (transformers' torch fallbacks here: flash-linear-attention
and mamba_ssm when installed); the loss of the two strategies is compared (``loss_rel``).

On the CPU every number is a CPU timing of gloo ranks sharing the cores, not a GPU claim: the
rows say so. The step includes the layers both strategies run alike (embeddings, MLPs, norms,
attention), so the ratio understates the mixers' own difference.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from ulysses_kernels.bench import harness, record
from ulysses_kernels.bench.sizes import parse_size
from ulysses_kernels.comm import get_communicator
from ulysses_kernels.integrations import hf
from ulysses_kernels.testing.hybrids import MODELS, build
from ulysses_kernels.traffic import WireCounter

NAME = "bench_state_passing"
STRATEGIES = ("heads", "state")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
COLUMNS = [  # (key, header, format)
    ("model", "model", "s"),
    ("world", "world", "d"),
    ("seq", "seq", "d"),
    ("strategy", "strategy", "s"),
    ("median_ms", "ms", ".2f"),
    ("min_ms", "min", ".2f"),
    ("max_ms", "max", ".2f"),
    ("bytes_sent", "bytes", "d"),
    ("ratio", "state/heads", ".2f"),
    ("loss_rel", "loss_rel", ".1e"),
]


def parse_args(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--models", default="mamba2,mamba,qwen3.5", help="comma list of testing.hybrids.MODELS names")
    p.add_argument("--seqs", default=None, help="global sequence lengths (default: 512,2048 on the CPU, 8K,32K on a GPU)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default float32 on the CPU, bfloat16 on a GPU")
    p.add_argument("-w", "--warmup-iters", dest="warmup_iters", type=int, default=1)
    p.add_argument("-n", "--iters", type=int, default=5)
    harness.add_spawn(p, 0, "spawn N gloo ranks on the CPU instead of torchrun")
    harness.add_output(p)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - {c[0] for c in MODELS})
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)} (testing.hybrids.MODELS: {', '.join(c[0] for c in MODELS)})")
    if args.iters < 1 or args.warmup_iters < 0:
        p.error("-n must be >= 1 and -w >= 0")
    return args


def _timed(step, device: torch.device) -> float:
    """One ``step()`` in milliseconds, every rank starting together."""
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t = time.perf_counter()
    step()
    return (time.perf_counter() - t) * 1e3


def _rows_of(args, world: int, device: torch.device, case, seq: int, dtype: torch.dtype) -> list[dict]:
    """Both strategies of one model at one length: a row each (a strategy that cannot run is a row saying why)."""
    ids = torch.randint(0, case[4]["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq)).to(device)
    where = "GPU" if device.type == "cuda" else "CPU (gloo ranks sharing the cores: not a GPU claim)"
    rows, losses = [], {}
    for strategy in STRATEGIES:
        row = {"model": case[0], "world": world, "seq": seq, "strategy": strategy, "where": where, "ratio": None, "loss_rel": None, "wrong": 0}
        comm = WireCounter(get_communicator(None))
        try:
            model = hf.apply(build(case).to(device=device, dtype=dtype), None, comm=comm, mixer_parallel=strategy)
        except hf.HFIntegrationError as e:
            rows.append(row | {"median_ms": None, "min_ms": None, "max_ms": None, "bytes_sent": None, "skipped": str(e)})
            continue
        batch = hf.shard_batch(ids, ids, group=None)
        kept = {}

        def step(model=model, batch=batch, kept=kept):
            loss = batch.loss(model(**batch.model_inputs(loss=False)).logits)
            loss.backward()
            model.zero_grad(set_to_none=True)
            kept["loss"] = hf.reduce_loss(loss.detach(), None)

        for _ in range(args.warmup_iters):
            step()
        comm.sent.clear()
        times = [_timed(step, device) for _ in range(args.iters)]
        losses[strategy] = kept["loss"].double()
        row |= {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "bytes_sent": sum(comm.sent) // args.iters}
        rows.append(row)
    if len(losses) == 2:
        rel = ((losses["state"] - losses["heads"]).abs() / losses["heads"].abs()).item()
        rows[1]["loss_rel"] = rel
        rows[1]["ratio"] = rows[1]["median_ms"] / rows[0]["median_ms"]
        # the same step either way: a loss apart by more than the dtype's rounding is wrong
        rows[1]["wrong"] = int(rel > (1e-3 if dtype != torch.float32 else 1e-5))
    return rows


def _body(args, rank: int, world: int, device: torch.device, transport: str) -> None:
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    seqs = [parse_size(s) for s in (args.seqs or ("8K,32K" if device.type == "cuda" else "512,2048")).split(",")]
    cases = [c for c in MODELS if c[0] in args.models]
    rows = [r for case in cases for seq in seqs for r in _rows_of(args, world, device, case, seq, dtype)]
    if rank == 0:
        title = (f"# hybrid step, head exchange vs state passing, {world} {transport} ranks on {rows[0]['where']}, "
                 f"{dtype}, batch 1, median of {args.iters} after {args.warmup_iters} warm-up; bytes: rank 0's per step")  # fmt: skip
        record.print_table(COLUMNS, rows, title=title)
        for r in rows:
            if r.get("skipped"):
                print(f"# skipped {r['model']} {r['strategy']} at {r['seq']}: {r['skipped']}", flush=True)
        harness.print_wrong_total(rows, "steps whose two strategies' losses differ beyond rounding")
    meta = {"rule": "ratio = median(state) / median(heads), same run; loss_rel: the two strategies' global losses"}
    harness.finish(args, rank, NAME, lambda: record.env_record(device, world, transport, dtype=str(dtype)), rows, meta, lambda *a: False, rows)


def main(argv=None) -> int:
    return harness.launch(_body, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
