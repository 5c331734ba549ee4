"""Self-test: every path this installation can run here, forward and backward, against float64.

    python -m ulysses_kernels.selftest                       # one rank per local GPU; no GPU: 2 gloo ranks on the CPU
    torchrun --nproc-per-node 8 -m ulysses_kernels.selftest  # the launched ranks (NCCL on GPUs, else gloo)
    NCCL_MULTI_RANK_GPU_ENABLE=1 torchrun --nproc-per-node 4 -m ulysses_kernels.selftest  # 4 NCCL ranks on 1 GPU (NCCL >= 2.30)
    python -m ulysses_kernels.selftest --spawn 2             # 2 gloo ranks on the CPU
    python -m ulysses_kernels.selftest --json selftest.json  # also write every result as JSON

A *path* is one kernel set x one communicator x one chunk count x one case:

* kernel sets: every one ``kernels.available_kernels()`` lists here (on a CPU, ``cuda`` is
  the C++ extension's CPU twin of the CUDA kernels, and ``triton`` runs only with
  ``TRITON_INTERPRET=1`` set: Triton's interpreter, about 0.25 s a path at the CPU's
  default size, slow at larger ones);
* communicators: ``torch-dist`` (torch.distributed on the group); on GPUs whose extension has
  NCCL also ``nccl`` (an ``NCCLCommunicator`` of its own, made once for the run) and
  ``nccl-borrowed`` (``NCCLCommunicator.borrow``: our calls on torch's own communicator);
* chunks: 1, 2 and ``auto`` (the head-chunked pipeline that overlaps the all-to-alls with
  attention; the table shows the count that ran);
* cases (``--cases``), sized to the world ``P`` (``--seq-per-rank`` tokens per rank): ``mha`` (2P
  query and KV heads, batch 1: one all-to-all), ``gqa`` (2P query heads and the most KV
  heads below P that divide them), ``uneven-heads`` (P+1 query heads, no causal mask), ``uneven-shards`` (a
  sequence that P does not divide, ``seq_lens`` from ``layout.split_lengths``), ``packed``
  (``gqa``'s heads, batch 1, documents of mixed lengths given as ``cu_seqlens``, one shorter
  than P and one crossing a shard boundary: ``short_and_crossing_documents``), and the 2-D group
  (``make_sp_groups``, Ulysses inside groups of U ranks, ring attention across R = P/U) in
  ``ring`` (contiguous shards) and ``ring-zigzag`` (``seq_layout="zigzag"``, the inputs
  sharded with ``ring.shard_sequence``): one case ``ring-UxR`` per split of ``ring_splits``
  (at 2 ranks 1x2, at 4 2x2, at 8 4x2 and 2x4; none at 1), 2U query heads over fewer KV
  heads, causal; ``ring-packed`` and ``ring-zigzag-packed`` (cases ``ring-UxR-packed``,
  ``ring-UxR-zigzag-packed``): the same on one packed sequence (batch 1, ``packed``'s
  document mix; at 2 to 8 ranks one document crosses a ring block boundary and, in zigzag,
  one crosses the fold in the middle of the last ring rank's block); MLA, v (and the output) at
  a head dim of its own: ``mla`` (P+1 query and KV heads, batch 2, v 3/4 of q's and k's head
  dim: narrower, as DeepSeek's 128 against 192), ``mla-wide-v`` (``gqa``'s heads, uneven
  shards, batch 1, v 3/2 of it) and ``ring-mla`` (cases ``ring-UxR-mla``: U+1 heads over the
  2-D group, v narrower). The 2-D groups are made once per run, in the same order on every rank (and
  again after the group recovery below); their Ulysses level runs on torch.distributed, so
  they are ``torch-dist`` paths only. Their groups get ``--timeout`` too
  (``make_sp_groups(timeout=)``), and the hang timer below backs it;
* checkpointing: per case and kernel set one more path (``.../checkpoint``, chunks
  ``CHECKPOINT_CHUNKS``) runs the op plainly and then under
  ``torch.utils.checkpoint(..., use_reentrant=False)``, as training does: the checkpointed
  run is checked against float64 like any path, and against the plain run (bit-equal on the
  CPU; within the bound on a GPU, whose backward need not be deterministic, and before
  torch 2.9, where the checkpointed call runs unchunked: ``checkpointing.chunks_recompute_apart``).

Each path runs ``ulysses_attention`` forward and backward once on every rank and compares
out, dq, dk and dv with single-process float64 attention (``testing.reference.attention_reference``,
per document for ``packed``) on the same device. Bound: 1e-10 for float64 inputs (the CPU default); in a lower precision
(bf16, the GPU default) at most 2x PyTorch's own error in that dtype on the same device
(SDPA in one process against the same reference), per tensor; dk and dv of a case whose KV
heads are replicated over r ranks one ulp more per extra holder (each holder's gradient is
rounded before the exchange sums them: ``judge.replica_roundings``). The time is that of the
one checked call (first-call set-up included): a check, not a benchmark.

Rank 0 prints a progress line per path (stderr), then a table (stdout); ``--json PATH``
writes every path's result and the environment (GPU, torch, CUDA, NCCL, the extension's
build, git sha or package version). The exit status is non-zero on every rank when any
path fails.

Every rank runs the same paths in the same order. After each step of a path the ranks
exchange their outcome over a gloo group kept for that, so a path that fails on one rank
is a FAIL on all and the next path starts together. A rank that raises while its peers
wait in a collective leaves them waiting until ``--timeout``: the timeout of the group the
paths run on, and of the native communicators' own watchdog (``timeout_s``), which aborts
NCCL work stuck that long. The run then goes on over a new group (and a new native
communicator where one was aborted), on a GPU only once every rank's device has finished
its queued work (else the remaining paths are reported as not run). A rank whose path
runs longer than ``2 * --timeout + 60`` seconds is ended as hung, rank 0 writing what it
has first.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
import tempfile

import torch
import torch.distributed as dist

from ..bench.sizes import parse_dtype
from ..testing import RanksFailed, run_ranks
from .cases import CASE_NAMES, CHUNKS, COMMS, QUICK_CASES, QUICK_CHUNKS, kernel_choice
from .ranks import Rank
from .run import run

__all__ = ["parse_args", "main"]

SPAWN_BACKSTOP_S = 3600  # run_ranks' deadline for the whole run (hangs are caught per path before)


def _rank_main(rank: int, world: int, device: torch.device, transport: str, args) -> bool:
    """This rank's self-test; True when no path failed."""
    for name in args.imports:
        importlib.import_module(name)
    me = Rank(rank, world, device, transport, args)
    ok = run(me)
    if me.stopped:
        # The device still holds work that waits on a collective that never comes: a normal
        # teardown could wait on it forever. Rank 0 has written everything (run() ends in a barrier).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    me.close()
    return ok


def _spawned(rank: int, world: int, args, transport: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")
    _rank_main(rank, world, device, transport, args)


def _names(allowed, what: str):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if allowed is not None and n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{what}: expected a comma list of {', '.join(allowed)}, got {text!r}")
        return names

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ulysses_kernels.selftest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spawn", type=int, default=0, metavar="N",
                   help="spawn N gloo ranks on the CPU (default without torchrun: one NCCL rank per GPU, else 2 CPU ranks)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write the results and the environment as JSON")
    p.add_argument("--kernels", type=_names(None, "--kernels"),
                   help="kernel sets to test (comma list, or 'all'; default: every one that runs here)")  # fmt: skip
    p.add_argument("--comms", type=_names(COMMS, "--comms"), help=f"communicators ({', '.join(COMMS)}; default: every one usable here)")
    p.add_argument("--chunks", type=_names(CHUNKS, "--chunks"), help=f"chunk counts ({', '.join(CHUNKS)}; default: all)")
    # --layouts: the flag's name before the cases were named cases (kept for command lines that use it).
    p.add_argument("--cases", "--layouts", dest="cases", type=_names(CASE_NAMES, "--cases"),
                   help=f"cases ({', '.join(CASE_NAMES)}; default: all; --layouts is an old name of this flag)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help=f"chunks {','.join(QUICK_CHUNKS)} and cases {','.join(QUICK_CASES)} (unless given)")
    p.add_argument("--dtype", help="input dtype (default: bf16 on GPUs, fp64 on the CPU)")
    p.add_argument("--seq-per-rank", type=int, default=0, help="tokens per rank (default: 128 on GPUs, 8 on the CPU)")
    p.add_argument("--head-dim", type=int, default=0, help="head dim (default: 64 on GPUs, 16 on the CPU)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait for a peer before the path fails (default 300)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first on every rank, e.g. one that registers a kernel set of yours (repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.dtype:
        try:
            parse_dtype(args.dtype)
        except ValueError as e:
            p.error(str(e))
    for name in ("spawn", "seq_per_rank", "head_dim"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.timeout <= 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    return args


def launched_transport(gpus: int, local_ranks: int, environ) -> str:
    """A torchrun rank's transport: NCCL when every local rank has a GPU of its own, or when ranks
    may share one (``NCCL_MULTI_RANK_GPU_ENABLE=1``: NCCL >= 2.30 accepts several ranks on one GPU,
    rank r on GPU r % GPUs; an older NCCL refuses that by name when the communicator is made);
    else gloo on the CPU."""
    shared = environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
    return "nccl" if gpus > 0 and (gpus >= local_ranks or shared) else "gloo"


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in args.imports:
        importlib.import_module(name)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not args.spawn:
        # Launched by torchrun: this process is one rank.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        transport = launched_transport(gpus, local, os.environ)
        kernel_choice(args.kernels)  # a bad --kernels stops every rank here, alike
        if transport == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
        dist.init_process_group(transport)
        device = torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")
        try:
            ok = _rank_main(dist.get_rank(), dist.get_world_size(), device, transport, args)
        finally:
            dist.destroy_process_group()
        return 0 if ok else 1
    world, transport = (args.spawn, "gloo") if args.spawn else (gpus, "nccl") if gpus else (2, "gloo")
    kernel_choice(args.kernels)
    with tempfile.TemporaryDirectory(prefix="ulysses_selftest_") as tmp:
        args.verdict_file = os.path.join(tmp, "verdict.json")
        failure = None
        try:
            run_ranks(_spawned, world, args, transport, backend=transport, timeout_s=SPAWN_BACKSTOP_S)
        except (RanksFailed, TimeoutError) as e:
            failure = e
        verdict = json.loads(pathlib.Path(args.verdict_file).read_text()) if os.path.exists(args.verdict_file) else None
    if verdict is None:
        print(f"selftest: the ranks ended before rank 0 wrote the results:\n{failure}", file=sys.stderr)
        return 1
    return 0 if verdict["ok"] and failure is None else 1
