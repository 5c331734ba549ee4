"""Test utilities for code that runs on a group of ranks (ours, and code built on it).

* ``ranks``: ``run_ranks(fn, world_size, *args)`` runs ``fn`` on real ``torch.distributed``
  ranks, spawned processes with gloo on the CPU (or NCCL), and re-raises a rank's failure in
  the caller (``RanksFailed``) instead of hanging;
* ``thread_ranks``: ``ThreadGroup(world_size).run(fn, *args)`` runs ``fn(comm, *args)`` on
  "ranks" that are threads of this process, each with a ``ThreadCommunicator``: a fake of the
  ``ulysses_kernels.comm.Communicator`` interface that moves real bytes between the threads
  and is stricter than a real collective (mismatched collectives, failed peers, receive
  buffers read too early, CUDA stream ordering);
* ``rank_pool``: ``RankPool`` keeps gloo worlds alive and runs one call after another on
  them; ``set_default_pool(pool)`` makes ``run_ranks`` use it (the test suite does).
* ``tiny_models``: ``build_tiny(model_type)``, a transformers causal LM of that type shrunk to
  ~0.1M parameters, random weights, float64, no download (``build_tiny("qwen3_5_text")``: a
  Qwen3.5 hybrid, the README's first example).
"""

from __future__ import annotations

from .rank_pool import RankPool
from .ranks import RanksFailed, rank_context, run_ranks, set_default_pool
from .thread_ranks import FakeCommError, PeerFailed, ThreadCommunicator, ThreadGroup, ThreadRanksFailed
from .tiny_models import NotBuildable, build_tiny

__all__ = [
    "FakeCommError",
    "NotBuildable",
    "PeerFailed",
    "RankPool",
    "RanksFailed",
    "ThreadCommunicator",
    "ThreadGroup",
    "ThreadRanksFailed",
    "build_tiny",
    "rank_context",
    "run_ranks",
    "set_default_pool",
]
