"""Self-test: every path this installation can run here, forward and backward, against float64.

    python -m ulysses_kernels.selftest                       # one rank per local GPU; no GPU: 2 gloo ranks on the CPU
    torchrun --nproc-per-node 8 -m ulysses_kernels.selftest  # the launched ranks (NCCL on GPUs, else gloo)

What it runs, how it judges and how it stays in step: ``cli``'s docstring (``--help``
prints it). The pieces, one job each, in the order a run meets them: ``cli`` (the command
line, spawning or joining the ranks), ``cases`` (the cases and paths, ``CASE_NAMES``),
``ranks`` (one rank: its sizes, groups and communicators), ``run`` (every path in order),
``paths`` (one path on every rank), ``judge`` (the float64 truth, the bounds, the verdict),
``recovery`` (the hang timer; the ranks back in step after a failure) and ``report``
(rank 0's table and JSON).
"""

from .cases import CASE_NAMES, CHECKPOINT_CHUNKS, CHUNKS, COMMS, QUICK_CASES, QUICK_CHUNKS, Case, PathSpec, make_cases, make_paths, ring_splits
from .cli import main, parse_args

__all__ = [
    "CASE_NAMES", "COMMS", "CHUNKS", "QUICK_CASES", "QUICK_CHUNKS", "CHECKPOINT_CHUNKS", "Case", "PathSpec",
    "make_cases", "make_paths", "ring_splits", "main", "parse_args",
]  # fmt: skip
