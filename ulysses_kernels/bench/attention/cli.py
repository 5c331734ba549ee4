"""The attention layer: forward, backward and forward+backward time, TFLOP/s and peak memory.

    torchrun --nproc-per-node 8 -m ulysses_kernels.bench.attention --min-seq 4K --max-seq 1M
    python -m ulysses_kernels.bench.attention --sp 8 --min-seq 4K --max-seq 1M   # one GPU, rank 0 of 8
    python -m ulysses_kernels.bench.attention --spawn 2 --heads-sets 8/2 --seqs 64,128 --head-dim 16  # CPU

Head counts (``--models``): Llama-3-8B (32 query / 8 KV heads), Qwen2.5-14B (40/8),
Llama-3-70B (64/8), head_dim 128, or any ``--heads-sets Hq/Hkv,...``
(``--layouts``, its old name, still works). Sequence lengths double
from ``--min-seq`` to ``--max-seq`` (global tokens, batch ``--batch``); a size whose estimated
memory does not fit is skipped, and a method that runs out of memory stops there.

Methods (``--methods``, default all that can run):

  local        the compute floor: this rank's heads (HeadPlan) over the full sequence,
               the same attention backend as ours, no communication and no layout work
  chain        ``baselines.permute_chain_attention`` (DeepSpeed/yunchang's three permutes),
               when the query heads divide over the ranks
  ulysses-<k>  ``ulysses_attention`` with kernel set <k> (torch, triton, cuda; on a CPU,
               cuda is the C++ extension's CPU twin)
  deepspeed    ``deepspeed.sequence.layer.DistributedAttention`` when importable
  yunchang     ``yunchang.UlyssesAttention`` when importable
  hybrid-UxR   ``ulysses_attention`` on a 2-D group ``make_sp_groups(U, R)`` (Ulysses over U
               contiguous ranks, ring attention over R; contiguous shards, the torch kernel
               set); with real ranks, one row per split of the world (U*R = world)
  packed-<k>    ``ulysses_attention`` on one packed sequence (batch 1) of documents with a
               realistic length mix (``packed_documents``: log-normal, median 512 tokens,
               from 16 tokens up to half the sequence), block-diagonal causal attention
  equal-<k>     the same tokens as the same number of equal-length documents: what a batch
               of equal-length sequences computes (``x_equal`` = packed / equal time)
  packed-hybrid-UxR[-zigzag]
               the packed rows' documents on the 2-D group ``make_sp_groups(U, R)``, contiguous
               or zigzag shards (real ranks, U*R = world): columns ``steps`` (ring steps that
               compute, of R*R) and ``hops`` (K/V block transfers per forward, of R*(R-1))
               say what the ring schedule skipped (``ring.schedule``); compare the time with
               ``hybrid-UxR`` (the same tokens unpacked) and ``packed-<k>`` (the flat group)
  local-packed the compute floor of the packed rows (this rank's heads, all rows, no
               communication), on the packed-documents kernel the chooser picks
               (``backends.packed_kernel``; column ``backend``: ``<backend>+<kernel>``)
  local-packed-<kernel>
               the same on one packed-documents kernel (``packed.KERNELS``: flash, varlen,
               cudnn, flex, loop), by default every one that runs here besides the pick and flex
               (named only: its first call compiles FlexAttention; that time, ``first_s``, is
               printed and kept out of the timing)
  local+graph, local-packed+graph, local-packed-<kernel>+graph
               the same call's forward and backward captured as CUDA graphs and replayed
               (GPU only): the kernels without the host's time; their ``x_dense`` is against
               ``local+graph`` where it ran
  layout-<k>   ours, data movement only: the packs/unpacks of one layer without the
               collectives (fwd: q/k/v pack + output unpack; bwd: dout pack + dq/dk/dv unpack)
  chain-layout the chain's permute copies without the collectives

With one process and ``--sp P`` the local and layout rows are those of rank 0 of a ``P``-way
group (the input of ``ulysses_kernels.bench.perf_model``); the communicating methods need real ranks.

TFLOP/s: causal attention FLOPs of this rank's heads, 4*B*S^2*h*D/2 forward (packed and
equal rows: 4*h*D*sum(L_i^2)/2 over their documents, column ``docs``), 2.5x that
backward, 3.5x forward+backward (the FlashAttention convention), over the time of the
slowest rank. ``x_chain`` = chain time / this time (speed-up over the chain, same run);
``x_floor`` = this time / local time (packed rows: / local-packed's). ``x_dense`` (packed
rows) = this row's TFLOP/s / local's: the packed kernel's speed against the same tokens
unpacked (the goal of issue 37: local-packed >= 0.5 at S >= 32K on a GPU). #wrong: elements of the output and of dq, on a sample
of rows on every rank, outside the dtype's tolerance against a float32 reference computed
from the same inputs; for the layout rows, elements of every buffer they write that differ
bit for bit from the pure-PyTorch reference (``ulysses_kernels.layout`` pack/unpack; for
chain-layout, the slicing its copies amount to without the collective). Breakdown rows
(per kernel set): compute = local, layout = layout-<k>, exposed communication =
ulysses-<k> - local - layout-<k>.
"""

from __future__ import annotations

import argparse

from ulysses_kernels.bench import harness, record, sizes

from .report import plot
from .run import run_bench

MODELS = sizes.MODELS
PASSES = ("fwd", "bwd", "fwdbwd")


def _body(args, rank, world, device, backend):
    rows, breakdown, notes = run_bench(args, rank, world, device, backend)
    meta = dict(vars(args), skipped=notes, breakdown=breakdown)
    env_fn = lambda: record.env_record(device, world, backend, emulated_group=args.sp if world == 1 else None)  # noqa: E731
    harness.finish(args, rank, "bench_attention", env_fn, rows, meta, plot, breakdown)


def parse_args(argv=None, default_out_dir=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="all", help=f"comma list of {', '.join(MODELS)} (default all)")
    p.add_argument(
        "--heads-sets", "--layouts", dest="heads_sets", default=None, help="custom head counts Hq/Hkv,... (overrides --models; --layouts is its old name)"
    )
    p.add_argument("--min-seq", default="4K", help="smallest global sequence (default 4K)")
    p.add_argument("--max-seq", default="1M", help="largest global sequence (default 1M)")
    p.add_argument("--seqs", default=None, help="explicit global sequence lengths, e.g. 4K,32K")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("-d", "--datatype", default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--methods", default="all", help="comma list (see above; default all that can run)")
    p.add_argument("--passes", default="fwd,bwd,fwdbwd", help="comma list of fwd, bwd, fwdbwd")
    p.add_argument("--attn-fn", default=None, help="attention backend: flash, sdpa, math (default: flash if importable, else sdpa)")
    p.add_argument("--chunks", default=1, help="ulysses_attention(chunks=...) (default 1)")
    p.add_argument("--sp", type=int, default=8, help="with one process: the group size to emulate (default 8)")
    p.add_argument("-w", "--warmup-iters", dest="warmup_iters", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("--check", type=int, default=1, help="check every row against a float32 reference (1) or not (0)")
    p.add_argument("--check-rows", type=int, default=8, help="rows per rank the check samples (default 8)")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="skip a size whose estimate exceeds this share of free memory")
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="spawn N gloo ranks on the CPU instead of torchrun")
    p.add_argument(
        "--out-dir",
        default=str(default_out_dir or record.DEFAULT_OUT_DIR),
        help=f"where the CSV/JSON/PNG go (default {default_out_dir or record.DEFAULT_OUT_DIR})",
    )
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    args.passes = tuple(x.strip() for x in args.passes.split(","))
    if any(x not in PASSES for x in args.passes):
        p.error(f"--passes: choose from {', '.join(PASSES)}")
    if args.chunks != "auto":
        args.chunks = int(args.chunks)
    return args


def main(argv=None, *, default_out_dir=None, prog=None) -> int:
    """Run the benchmark; ``default_out_dir`` replaces ``--out-dir``'s default (the
    checkout's ``bench/bench_attention.py`` passes ``bench/results``); ``prog`` names the command
    in the usage line (default: the script's file name)."""
    return harness.launch(_body, parse_args(argv, default_out_dir, prog))
