"""Self-test: every path this installation can run here, forward and backward, against float64.

    python -m ulysses_kernels.selftest                       # one rank per local GPU; no GPU: 2 gloo ranks on the CPU
    torchrun --nproc-per-node 8 -m ulysses_kernels.selftest  # the launched ranks (NCCL on GPUs, else gloo)
    python -m ulysses_kernels.selftest --spawn 2             # 2 gloo ranks on the CPU
    python -m ulysses_kernels.selftest --json selftest.json  # also write every result as JSON

A *path* is one kernel set x one communicator x one chunk count x one layout:

* kernel sets: every one ``kernels.available_kernels()`` lists here (on a CPU, ``cuda`` is
  the C++ extension's CPU twin of the CUDA kernels, and ``triton`` runs only with
  ``TRITON_INTERPRET=1`` set: Triton's interpreter, about 0.25 s a path at the CPU's
  default size, slow at larger ones);
* communicators: ``torch-dist`` (torch.distributed on the group); on GPUs whose extension has
  NCCL also ``nccl`` (an ``NCCLCommunicator`` of its own, made once for the run) and
  ``nccl-borrowed`` (``NCCLCommunicator.borrow``: our calls on torch's own communicator);
* chunks: 1, 2 and ``auto`` (the head-chunked pipeline that overlaps the all-to-alls with
  attention; the table shows the count that ran);
* layouts, sized to the world ``P`` (``--seq-per-rank`` tokens per rank): ``mha`` (2P
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
* checkpointing: per layout and kernel set one more path (``.../checkpoint``, chunks
  ``CHECKPOINT_CHUNKS``) runs the op plainly and then under
  ``torch.utils.checkpoint(..., use_reentrant=False)``, as training does: the checkpointed
  run is checked against float64 like any path, and against the plain run (bit-equal on the
  CPU; within the bound on a GPU, whose backward need not be deterministic, and before
  torch 2.9, where the checkpointed call runs unchunked: ``checkpointing.chunks_recompute_apart``).

Each path runs ``ulysses_attention`` forward and backward once on every rank and compares
out, dq, dk and dv with single-process float64 attention (``testing.reference.attention_reference``,
per document for ``packed``) on the same device. Bound: 1e-10 for float64 inputs (the CPU default); in a lower precision
(bf16, the GPU default) at most 2x PyTorch's own error in that dtype on the same device
(SDPA in one process against the same reference), per tensor. The time is that of the
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
import datetime
import importlib
import itertools
import json
import os
import pathlib
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import info, toolchain
from .attention import ulysses_attention
from .attention.call import setup_attention
from .backends import resolve_backend
from .bench.harness import Progress
from .bench.record import CPU_LABEL, env_record, kernel_label
from .bench.sizes import dtype_name, parse_dtype
from .checkpointing import graph_exec_group
from .comm import NCCLCommunicator, TorchCommunicator, nccl_available
from .kernels import KERNEL_SETS, available_kernels, kernel_set_report
from .layout import split_lengths
from .ring import SPGroups, make_sp_groups
from .ring import shard_sequence as shard_2d
from .testing import RanksFailed, run_ranks
from .testing.reference import attention_reference, contiguous_shard

__all__ = ["LAYOUTS", "COMMS", "Case", "PathSpec", "make_cases", "main"]

TENSORS = ("out", "dq", "dk", "dv")
FLOAT64_BOUND = 1e-10  # as the tests: float64 all the way, only summation order differs
LAYOUTS = ("mha", "gqa", "uneven-heads", "uneven-shards", "packed", "ring", "ring-zigzag", "ring-packed", "ring-zigzag-packed",
           "mla", "mla-wide-v", "ring-mla")  # fmt: skip
COMMS = ("torch-dist", "nccl", "nccl-borrowed")
CHUNKS = ("1", "2", "auto")
QUICK_LAYOUTS = ("gqa", "uneven-shards", "packed", "ring-zigzag", "mla")
QUICK_CHUNKS = ("1", "2")
# The chunked pipeline (its exchanges in flight while attention runs, nested backward
# passes per chunk) is the path that met the checkpoint's recompute badly: checked here.
CHECKPOINT_CHUNKS = 2
SPAWN_BACKSTOP_S = 3600  # run_ranks' deadline for the whole run (hangs are caught per path before)


# ---- what runs -------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One layout: ``[batch, seq_lens[r], q_heads, head_dim]`` q on rank r.

    ``split``: ``(ulysses_size, ring_size)`` of a 2-D group (``make_sp_groups``), whose shards
    follow ``seq_layout``; ``None``: the flat group. ``docs``: the lengths of the packed
    documents of the global sequence (``cu_seqlens``); ``None``: one sequence per batch row.
    ``v_dim``: v's head dim (and the output's) as a fraction ``(num, den)`` of q's and k's
    (MLA: ``(3, 4)``, v narrower; ``(3, 2)``, v wider); ``(1, 1)``: the same."""

    name: str
    q_heads: int
    kv_heads: int
    seq_lens: tuple[int, ...]
    batch: int
    causal: bool
    split: tuple[int, int] | None = None
    seq_layout: str = "contiguous"
    docs: tuple[int, ...] | None = None
    v_dim: tuple[int, int] = (1, 1)

    def v_head_dim(self, head_dim: int) -> int:
        return max(1, head_dim * self.v_dim[0] // self.v_dim[1])

    @property
    def cu_seqlens(self) -> tuple[int, ...] | None:
        return None if self.docs is None else (0, *itertools.accumulate(self.docs))


@dataclass(frozen=True)
class PathSpec:
    """One kernel set x communicator x chunk count x layout; ``checkpoint``: run once plainly
    and once under activation checkpointing, the two runs compared."""

    kernels: str
    comm: str
    chunks: int | str
    case: Case
    checkpoint: bool = False

    @property
    def label(self) -> str:
        return f"{self.kernels}/{self.comm}/chunks={self.chunks}/{self.case.name}" + ("/checkpoint" if self.checkpoint else "")


def _smallest_divisor(n: int) -> int:
    """The smallest divisor of ``n`` above 1 and below ``n``; ``n`` itself when prime."""
    return next((d for d in range(2, n) if n % d == 0), n)


def _fewer_kv_heads(q_heads: int, ranks: int) -> int:
    """The most KV heads below ``ranks`` that divide ``q_heads`` (1 at least)."""
    return max([d for d in range(1, ranks) if q_heads % d == 0], default=1)


def short_and_crossing_documents(world: int, seq_per_rank: int) -> tuple[int, ...]:
    """Document lengths of the ``packed`` layout's ``world * seq_per_rank`` tokens: one
    shorter than the world (``world // 2`` tokens, 1 at least), one of a shard's length that
    starts there and so crosses the first shard boundary, and the rest in two of mixed lengths."""
    total, short = world * seq_per_rank, max(1, world // 2)
    lengths = [short, min(seq_per_rank, total - short)]
    rest = total - sum(lengths)
    return tuple(n for n in lengths + [rest // 3, rest - rest // 3] if n)


def ring_splits(world: int) -> list[tuple[int, int]]:
    """The ``(ulysses_size, ring_size)`` splits the ring layouts run at ``world`` ranks: the
    largest Ulysses group with a ring (ring size the smallest divisor above 1), and the
    smallest Ulysses group above 1 with the longest ring (at 8 ranks 4x2 and 2x4, at 4 ranks
    2x2, at 2 or 3 ranks one ring); none at one rank."""
    if world < 2:
        return []
    d = _smallest_divisor(world)
    return list(dict.fromkeys([(world // d, d)] + ([(d, world // d)] if world // d >= 2 else [])))


def make_cases(world: int, seq_per_rank: int, names=LAYOUTS) -> list[Case]:
    """The layouts ``names`` for a world of ``world`` ranks (see the module docstring); the
    ring layouts give one case per ``ring_splits(world)``, none at one rank."""
    p, s = world, seq_per_rank
    even = (s,) * p
    every = {
        "mha": [Case("mha", 2 * p, 2 * p, even, 1, True)],
        "gqa": [Case("gqa", 2 * p, _fewer_kv_heads(2 * p, p), even, 2, True)],
        "uneven-heads": [Case("uneven-heads", p + 1, _smallest_divisor(p + 1), even, 2, False)],
        "uneven-shards": [Case("uneven-shards", 2 * p, 2, tuple(split_lengths(p * s + max(1, p // 2), p)), 2, True)],
        "packed": [Case("packed", 2 * p, _fewer_kv_heads(2 * p, p), even, 1, True, docs=short_and_crossing_documents(p, s))],
        # MLA (DeepSeek-V2/V3, MiniCPM3): as many KV heads as query heads, v narrower than
        # q and k (192/128 there); P + 1 heads, so the ranks hold different head counts.
        "mla": [Case("mla", p + 1, p + 1, even, 2, True, v_dim=(3, 4))],
        # Any v head dim: v wider than q and k, with grouped KV heads and uneven shards.
        "mla-wide-v": [Case("mla-wide-v", 2 * p, _fewer_kv_heads(2 * p, p), tuple(split_lengths(p * s + 1, p)), 1, True, v_dim=(3, 2))],
    }
    for layout, suffix in (("contiguous", ""), ("zigzag", "-zigzag")):
        # Zigzag cuts each rank's shard in two halves: an even shard for every --seq-per-rank.
        even2 = (s + s % 2,) * p
        every["ring" + suffix] = [
            Case(f"ring-{u}x{r}{suffix}", 2 * u, _fewer_kv_heads(2 * u, u), even2, 2, True, (u, r), layout) for u, r in ring_splits(p)
        ]
        every["ring" + suffix + "-packed"] = [
            Case(f"ring-{u}x{r}{suffix}-packed", 2 * u, _fewer_kv_heads(2 * u, u), even2, 1, True, (u, r), layout, short_and_crossing_documents(p, even2[0]))
            for u, r in ring_splits(p)
        ]
    every["ring-mla"] = [
        Case(f"ring-{u}x{r}-mla", u + 1, u + 1, (s + s % 2,) * p, 2, True, (u, r), "contiguous", v_dim=(3, 4)) for u, r in ring_splits(p)
    ]
    return [c for n in names for c in every[n]]


def make_paths(cases: list[Case], kernels: list[str], comms: list[str], chunks: list) -> list[PathSpec]:
    """Per case: every kernel set x communicator x chunk count, then one checkpoint path per
    kernel set (the first communicator, ``CHECKPOINT_CHUNKS``). A 2-D case runs its Ulysses
    level on torch.distributed (the run's communicators belong to the flat group):
    ``torch-dist`` only."""
    paths = []
    for case in cases:
        usable = [c for c in comms if case.split is None or c == "torch-dist"]
        paths += [PathSpec(k, comm, c, case) for k in kernels for comm in usable for c in chunks]
        if usable:
            paths += [PathSpec(k, usable[0], CHECKPOINT_CHUNKS, case, checkpoint=True) for k in kernels]
    return paths


def _chunk_value(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _kernel_choice(requested: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """The kernel sets to test and, for every other registered one, why not.

    ``requested``: ``None`` or ``["all"]`` (every set that runs here) or names; a name
    that is not registered or cannot run here is a ``SystemExit`` that says why."""
    runs = available_kernels()
    why = {r["name"]: r["detail"] for r in kernel_set_report() if not r["runs_here"]}
    if requested is None or requested == ["all"]:
        return runs, why
    unknown = [n for n in requested if n not in KERNEL_SETS]
    if unknown:
        raise SystemExit(f"selftest: --kernels: unknown kernel set(s) {unknown}; registered: {list(KERNEL_SETS)} (or 'all')")
    missing = [f"{n} ({why.get(n, 'not available')})" for n in requested if n not in runs]
    if missing:
        raise SystemExit(f"selftest: --kernels: cannot run here: {'; '.join(missing)}; runs here: {runs}")
    return list(dict.fromkeys(requested)), {}


# ---- one rank's run --------------------------------------------------------------------
def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 400 else text[:397] + "..."


def _packed_kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    """The packed-documents kernel the packed paths run here (``backends.packed_kernel`` for
    the default backend, with a backward)."""
    probe = torch.empty(1, 1, 1, 8, device=device, dtype=dtype)
    return resolve_backend(None, probe).packed_kernel(probe, True, grad=True).name


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (x.detach().double() - ref).abs().max()


def _per_document(case: Case, attend, q, k, v) -> torch.Tensor:
    """``attend(q, k, v)`` over the global ``[B, S, H, D]`` sequence, or over each packed
    document of ``case`` on its own (the outputs concatenated)."""
    if case.docs is None:
        return attend(q, k, v)
    spans = list(itertools.pairwise(case.cu_seqlens))
    return torch.cat([attend(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in spans], dim=1)


class _HangTimer:
    """Ends this process when a path runs past ``seconds`` (a hang that no timeout caught);
    ``on_fire(seconds)`` writes what there is first."""

    def __init__(self, seconds: float, on_fire):
        self.seconds, self.on_fire, self.timer = seconds, on_fire, None

    def __enter__(self):
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()

    def _fire(self):
        try:
            self.on_fire(self.seconds)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


class _Rank:
    """One rank's self-test. ``results`` is the same list on every rank: each entry is
    decided from values that all ranks exchanged over ``control``."""

    def __init__(self, rank: int, world: int, device: torch.device, transport: str, args):
        self.rank, self.world, self.device, self.transport, self.args = rank, world, device, transport, args
        self.dtype = parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float64)
        self.head_dim = args.head_dim or (64 if device.type == "cuda" else 16)
        self.seq_per_rank = args.seq_per_rank or (128 if device.type == "cuda" else 8)
        self.timeout = float(args.timeout)
        self.results: list[dict] = []
        self.not_tested: dict[str, str] = {}
        self.settings: dict = {}
        self.env: dict = {}
        self.stopped = ""  # why the remaining paths cannot run (a device that did not drain)
        self.out_of_step = False  # a rank raised inside a path's collectives: recover() before the next
        self.own_nccl: NCCLCommunicator | None = None
        # Outcomes travel on a gloo group of their own: a path that leaves the data group's
        # collectives out of step can neither delay nor mismatch them. Its timeout outlasts
        # a data-group timeout plus a drain.
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3 * self.timeout + 120))
        self.data = self._data_group()
        self.comms: dict = {}
        self.sp: dict[tuple[int, int], SPGroups | str] = {}  # per ring split: its groups, or why none

    # -- exchanges, groups, communicators
    def gather(self, value) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.control)
        return out

    def _why_not_everywhere(self, why: str) -> str:
        """The ranks' reasons joined ("" when no rank gave one)."""
        return "; ".join(f"rank {r}: {w}" for r, w in enumerate(self.gather(why)) if w)

    def _data_group(self):
        group = dist.new_group(backend=self.transport, timeout=datetime.timedelta(seconds=self.timeout))
        # torch creates a group's NCCL communicator at its first collective (borrow needs it).
        dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        return group

    def _borrow(self) -> tuple[NCCLCommunicator | None, str]:
        try:
            return NCCLCommunicator.borrow(self.data, timeout_s=self.timeout), ""
        except RuntimeError as e:
            return None, _short(e)

    def make_communicators(self, wanted: list[str]) -> None:
        """``self.comms``: the wanted communicators that every rank can use (collective:
        every rank calls it at the same point); why not the others in ``not_tested``."""
        comms: dict = {"torch-dist": TorchCommunicator(self.data)}
        native = ""
        if self.device.type != "cuda":
            native = "needs CUDA tensors (this run is on the CPU)"
        else:
            native = self._why_not_everywhere("" if nccl_available() else "the C++ extension has no NCCL (python -m ulysses_kernels.info)")
        if "nccl" in wanted:
            why = native
            if not why:
                made, mine = None, ""
                # Collective: a rank that fails before ncclCommInitRank leaves the others in it.
                with _HangTimer(2 * self.timeout + 60, lambda seconds: self._hung(seconds, "comm nccl")):
                    try:
                        made = NCCLCommunicator(self.data, timeout_s=self.timeout)
                    except RuntimeError as e:
                        mine = _short(e)
                why = self._why_not_everywhere(mine)
                if made is not None and why:
                    made.close()
                elif made is not None:
                    comms["nccl"] = self.own_nccl = made
            if why:
                self.not_tested["comm nccl"] = why
        if "nccl-borrowed" in wanted:
            why = native
            if not why:
                borrowed, mine = self._borrow()
                why = self._why_not_everywhere(mine)
                if not why:
                    comms["nccl-borrowed"] = borrowed
            if why:
                self.not_tested["comm nccl-borrowed"] = why
        self.comms = {n: c for n, c in comms.items() if n in wanted}

    def make_sp_groups(self, splits) -> None:
        """``self.sp``: the 2-D groups of each ``(ulysses_size, ring_size)`` split over the
        data group, or why not (collective: every rank makes every group, in this order)."""
        self.sp = {}
        for split in splits:
            made, mine = None, ""
            try:
                made = make_sp_groups(*split, group=self.data, timeout=datetime.timedelta(seconds=self.timeout))
            except (RuntimeError, ValueError) as e:
                mine = _short(e)
            why = self._why_not_everywhere(mine)
            self.sp[split] = f"the 2-D group {split[0]}x{split[1]} could not be made: {why}" if why else made

    def _drain(self) -> bool:
        """True when this rank's device finishes its queued work within ``--timeout`` + 30 s
        (the native communicators' own watchdog aborts their work stuck for ``--timeout``,
        which frees the stream)."""
        if self.device.type != "cuda":
            return True
        done = threading.Event()

        def sync():
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:
                return  # a device error: not drained
            done.set()

        threading.Thread(target=sync, daemon=True).start()
        return done.wait(self.timeout + 30)

    def recover(self, after: str) -> None:
        """After a path in which some rank raised inside the collective part: once every
        rank's device has drained its queued work, a new data group and its communicators
        (our own NCCL communicator is made again if its watchdog aborted it on any rank).
        Else the queued work waits on a collective that never comes, and the run stops."""
        self.out_of_step = False
        if not all(self.gather(self._drain())):
            self.stopped = f"after {after}, some rank's device did not finish its queued work (collectives out of step)"
            return
        self.data = self._data_group()
        self.make_sp_groups(list(self.sp))  # the old ones may be out of step too
        if "torch-dist" in self.comms:
            self.comms["torch-dist"] = TorchCommunicator(self.data)
        if "nccl" in self.comms and any(self.gather(self.own_nccl.failure)):
            self.own_nccl.close()
            del self.comms["nccl"]
            made, mine = None, ""
            try:
                made = NCCLCommunicator(self.data, timeout_s=self.timeout)
            except RuntimeError as e:
                mine = _short(e)
            why = self._why_not_everywhere(mine)
            if why or made is None:
                if made is not None:
                    made.close()
                self.own_nccl = None
                self.not_tested["comm nccl"] = f"could not be made again after {after}: {why}"
            else:
                self.comms["nccl"] = self.own_nccl = made
        if "nccl-borrowed" in self.comms:
            borrowed, mine = self._borrow()
            why = self._why_not_everywhere(mine)
            if why:
                del self.comms["nccl-borrowed"]
                self.not_tested["comm nccl-borrowed"] = f"lost after {after}: {why}"
            else:
                self.comms["nccl-borrowed"] = borrowed

    # -- one layout: inputs, float64 truth, bounds
    def truth(self, case: Case, index: int):
        """Global inputs q, k, v, dout (float64 on the CPU, the same on every rank), the
        float64 reference out, dq, dk, dv on this device, and the per-tensor bounds; or
        a string saying why not (the same on every rank)."""
        mine = {"error": None, "bounds": None}
        try:
            g = torch.Generator().manual_seed(1234 + index)
            seq = sum(case.seq_lens)
            dv = case.v_head_dim(self.head_dim)
            shape_q = (case.batch, seq, case.q_heads, self.head_dim)
            shape_kv = (case.batch, seq, case.kv_heads, self.head_dim)
            shape_v, shape_out = (*shape_kv[:3], dv), (*shape_q[:3], dv)
            inputs = [torch.randn(s, generator=g, dtype=torch.float64) for s in (shape_q, shape_kv, shape_v, shape_out)]
            full = [x.to(self.device).clone().requires_grad_() for x in inputs[:3]]
            out = _per_document(case, lambda q, k, v: attention_reference(q, k, v, causal=case.causal), *full)
            out.backward(inputs[3].to(self.device))
            ref = [out.detach()] + [x.grad for x in full]
            if self.dtype == torch.float64:
                mine["bounds"] = [FLOAT64_BOUND] * len(TENSORS)
            elif self.rank == 0:
                # One rank measures PyTorch's error and all use it: a GPU's backward need
                # not be deterministic, and every rank must reach the same verdict.
                mine["bounds"] = self._torch_bounds(case, inputs, ref)
        except Exception as e:  # noqa: BLE001 - reported by every rank as the layout's failure
            mine["error"] = _short(e)
        seen = self.gather(mine)
        errors = [f"rank {r}: {s['error']}" for r, s in enumerate(seen) if s["error"]]
        if errors:
            return "the float64 reference or the bound failed: " + "; ".join(errors)
        return inputs, ref, seen[0]["bounds"]

    def _torch_bounds(self, case: Case, inputs, ref) -> list[float]:
        """2x the error of one-process SDPA in ``self.dtype`` on this device, per tensor."""
        low = [x.to(self.device, self.dtype).clone().requires_grad_() for x in inputs[:3]]

        def sdpa(q, k, v):
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=True).transpose(1, 2)

        out = _per_document(case, sdpa, *low)
        out.backward(inputs[3].to(self.device, self.dtype))
        errs = [_max_err(out, ref[0])] + [_max_err(x.grad, r) for x, r in zip(low, ref[1:])]
        return [2 * e.item() for e in errs]

    # -- one path
    def _shard(self, x: torch.Tensor, case: Case) -> torch.Tensor:
        """This rank's rows of the global ``x`` (``[B, S, ...]``) in ``case``'s layout."""
        if case.split is None:
            return contiguous_shard(x, case.seq_lens, self.rank)
        return shard_2d(x, self.sp[case.split], layout=case.seq_layout)

    def _group(self, path: PathSpec):
        """``group`` and ``comm`` of ``ulysses_attention`` for ``path``: a 2-D group runs its
        Ulysses level on torch.distributed (the run's communicators are the flat group's)."""
        case = path.case
        if case.split is None:
            return self.data, self.comms[path.comm]
        return self.sp[case.split].with_layout(case.seq_layout), None

    def blank(self, path: PathSpec, status: str = "FAIL", message: str = "", bounds=None) -> dict:
        """The result record of ``path`` before it ran."""
        case = path.case
        return {
            "path": path.label, "kernels": path.kernels, "kernels_label": kernel_label(path.kernels, self.device),
            "comm": path.comm, "chunks": path.chunks, "chunks_run": None, "layout": case.name,
            "ulysses_size": case.split[0] if case.split else self.world, "ring_size": case.split[1] if case.split else 1,
            "seq_layout": case.seq_layout, "checkpoint": path.checkpoint, "checkpoint_diff": None,
            "cu_seqlens": None if case.docs is None else list(case.cu_seqlens),
            "q_heads": case.q_heads, "kv_heads": case.kv_heads, "seq_lens": list(case.seq_lens), "batch": case.batch,
            "head_dim": self.head_dim, "v_head_dim": case.v_head_dim(self.head_dim), "causal": case.causal, "dtype": dtype_name(self.dtype), "backend": None,
            "status": status, "tensor": None, "max_error": None, "bound": None, "errors": None,
            "bounds": None if bounds is None else dict(zip(TENSORS, bounds)), "time_ms": None, "message": message,
        }  # fmt: skip

    @staticmethod
    def _raised(result: dict, messages: list) -> bool:
        """Record the ranks' exception messages (``None``: that rank did not raise) in
        ``result``; True when some rank raised."""
        errors = [f"rank {r}: {m}" for r, m in enumerate(messages) if m]
        if errors:
            result["message"] = "; ".join(errors)
        return bool(errors)

    def run_path(self, path: PathSpec, truth) -> dict:
        """Run ``path`` on every rank; its result (the same on every rank)."""
        case = path.case
        inputs, ref, bounds = truth
        result = self.blank(path, bounds=bounds)

        # 1. Rank-local, no collective: what the call resolves to, and whether it can run.
        mine = {"error": None, "skip": "", "chunks": None, "backend": None}
        try:
            ref_shards = [self._shard(r, case) for r in ref]
            shards = [self._shard(x, case).to(self.device, self.dtype) for x in inputs]
            group, comm = self._group(path)
            call = setup_attention(
                *shards[:3], group=group, comm=comm, plan=None, seq_lens=case.seq_lens, causal=case.causal,
                softmax_scale=None, attn_fn=None, kernels=path.kernels, chunks=path.chunks, check=False, cu_seqlens=case.cu_seqlens,
            )  # fmt: skip
            if not getattr(call.kernels, "supports", lambda _: True)(call.layout):
                mine["skip"] = f"kernel set {path.kernels!r} does not take {call.layout.world_size} ranks"
            mine["chunks"], mine["backend"] = call.chunks, getattr(call.backend, "name", type(call.backend).__name__)
        except Exception as e:  # noqa: BLE001 - any failure of a path is its result, reported by every rank
            mine["error"] = _short(e)
        seen = self.gather(mine)
        if self._raised(result, [s["error"] for s in seen]):
            return result
        skips = [s["skip"] for s in seen]
        if any(skips):
            if len(set(skips)) > 1:
                result["message"] = "ranks disagree whether to run it: " + "; ".join(f"rank {r}: {s or 'runs'}" for r, s in enumerate(skips))
            else:
                result["status"], result["message"] = "SKIP", skips[0]
            return result
        result["chunks_run"], result["backend"] = seen[0]["chunks"], seen[0]["backend"]
        if len({s["chunks"] for s in seen}) > 1:
            result["message"] = "ranks resolved different chunk counts: " + ", ".join(str(s["chunks"]) for s in seen)
            return result

        with _HangTimer(2 * self.timeout + 60, lambda seconds: self._hung(seconds, path.label, result)):
            # 2. Collective: forward and backward. No host sync after the input checks, so on
            # a GPU a rank whose peer raised still reaches the exchange below.
            ran, mine = None, None
            try:
                ran = self._call(path, shards)
            except Exception as e:  # noqa: BLE001 - reported by every rank, then the ranks re-sync
                mine = _short(e)
            if self._raised(result, self.gather(mine)):
                self.out_of_step = True
                return result

            # 3. Rank-local: errors, the checkpointed run against the plain one, and time (host syncs).
            mine = {"error": None}
            try:
                runs, elapsed = ran
                out, grads = runs[-1]
                mine["errors"] = [_max_err(x, r).item() for x, r in zip((out, *grads), ref_shards)]
                if path.checkpoint:
                    plain = (runs[0][0], *runs[0][1])
                    mine["diff"] = [(x.detach() - y.detach()).abs().max().item() for x, y in zip((out, *grads), plain)]
                mine["ms"] = elapsed() * 1e3
            except Exception as e:  # noqa: BLE001 - as above
                mine["error"] = _short(e)
            seen = self.gather(mine)
        if self._raised(result, [s["error"] for s in seen]):
            return result
        return self._judge(result, seen, bounds)

    def _judge(self, result: dict, seen: list[dict], bounds) -> dict:
        """``result`` decided from every rank's errors (and checkpoint differences): each
        tensor within its bound; a checkpointed run bit-equal to the plain one on the CPU,
        within the bound on a GPU (whose backward need not be deterministic)."""
        worst = [max(s["errors"][i] for s in seen) for i in range(len(TENSORS))]
        bad = [i for i, (e, b) in enumerate(zip(worst, bounds)) if not e <= b]  # NaN fails too
        pick = bad[0] if bad else max(range(len(TENSORS)), key=lambda i: worst[i] / bounds[i] if bounds[i] else 0.0)
        problems = [f"{TENSORS[i]} {worst[i]:.3e} > bound {bounds[i]:.1e}" for i in bad]
        if "diff" in seen[0]:
            diff = [max(s["diff"][i] for s in seen) for i in range(len(TENSORS))]
            # Before torch 2.9 the checkpointed call runs unchunked (chunks_recompute_apart), the
            # plain one chunked: another summation order, so within the bound, not bit-equal.
            exact = self.device.type != "cuda" and graph_exec_group() is not None
            allowed = [0.0] * len(TENSORS) if exact else bounds
            result["checkpoint_diff"] = dict(zip(TENSORS, diff))
            problems += [
                f"{TENSORS[i]} under checkpoint differs from the plain run by {diff[i]:.3e} "
                + (f"> bound {allowed[i]:.1e}" if allowed[i] else "(bit-equal expected on the CPU)")
                for i in range(len(TENSORS)) if not diff[i] <= allowed[i]
            ]  # fmt: skip
        result.update(
            status="FAIL" if problems else "PASS", errors=dict(zip(TENSORS, worst)), time_ms=max(s["ms"] for s in seen),
            tensor=TENSORS[pick], max_error=worst[pick], bound=bounds[pick], message=", ".join(problems),
        )  # fmt: skip
        return result

    def _attend(self, path: PathSpec, q, k, v) -> torch.Tensor:
        group, comm = self._group(path)
        case = path.case
        return ulysses_attention(
            q, k, v, group=group, causal=case.causal, seq_lens=case.seq_lens, comm=comm, kernels=path.kernels, chunks=path.chunks,
            cu_seqlens=case.cu_seqlens,
        )  # fmt: skip

    def _call(self, path: PathSpec, shards):
        """Forward and backward on this rank (plainly, then for a checkpoint path under
        ``torch.utils.checkpoint``): ``(runs, elapsed)``, each run's out and grads, and a
        function giving the last run's seconds (called after the exchange: on a GPU it syncs)."""
        runs, elapsed, cuda = [], None, self.device.type == "cuda"
        for checkpointed in (False, True) if path.checkpoint else (False,):
            q, k, v = (x.detach().clone().requires_grad_() for x in shards[:3])
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            if checkpointed:
                out = checkpoint(self._attend, path, q, k, v, use_reentrant=False)
            else:
                out = self._attend(path, q, k, v)
            out.backward(shards[3])
            if cuda:
                end.record()
                elapsed = lambda start=start, end=end: (end.synchronize(), start.elapsed_time(end) / 1e3)[1]  # noqa: E731
            else:
                seconds = time.perf_counter() - t0
                elapsed = lambda seconds=seconds: seconds  # noqa: E731
            runs.append((out, (q.grad, k.grad, v.grad)))
        return runs, elapsed

    def _hung(self, seconds: float, what: str, result: dict | None = None) -> None:
        """The hang timer's last words: rank 0 writes what there is (``result``: the path that hung)."""
        print(f"selftest: rank {self.rank}: {what} did not finish in {seconds:.0f} s (a hang); ending this rank", file=sys.stderr, flush=True)
        if self.rank == 0:
            results = list(self.results)
            if result is not None:
                result["message"] = f"did not finish in {seconds:.0f} s on rank 0 (a hang); the run was ended here"
                results.append(result)
            else:
                self.not_tested[what] = f"did not finish in {seconds:.0f} s on rank 0 (a hang); the run was ended here"
            report(results, self.env, self.settings, self.not_tested, self.args, complete=False)
        else:
            time.sleep(10)  # the ranks' hang timers fire together: let rank 0 write before a launcher ends it

    # -- the whole run
    def run(self) -> bool:
        """Every path, in the same order on every rank; rank 0 reports. True: no FAIL."""
        args = self.args
        kernels, why = _kernel_choice(args.kernels)
        self.not_tested.update({f"kernels {n}": w for n, w in why.items()})
        every_rank = self.gather(kernels)
        cases = make_cases(self.world, self.seq_per_rank, args.layouts or (QUICK_LAYOUTS if args.quick else LAYOUTS))
        chunks = [_chunk_value(c) for c in (args.chunks or (QUICK_CHUNKS if args.quick else CHUNKS))]
        self.settings = {
            "world_size": self.world, "transport": self.transport, "device": self.device.type,
            "dtype": dtype_name(self.dtype), "head_dim": self.head_dim, "seq_per_rank": self.seq_per_rank,
            "kernels": kernels, "comms": None, "chunks": chunks, "layouts": [c.name for c in cases],
            "timeout_s": self.timeout, "argv": args.argv, "packed_kernel": _packed_kernel_name(self.device, self.dtype),
            "bound_rule": f"{FLOAT64_BOUND:g} in float64; else 2x PyTorch's own SDPA error in the same dtype on the same device, per tensor",
        }  # fmt: skip
        if self.rank == 0:
            self.env = env_record(self.device, self.world, self.transport, install=info.collect())
        wanted = args.comms or list(COMMS)
        self.make_communicators(wanted)
        # Communicators that are not here: left out by default, a FAIL when asked for.
        comms = self.settings["comms"] = [c for c in wanted if c in self.comms or args.comms]
        paths = make_paths(cases, kernels, comms, chunks)
        self._note_ring_left_out(cases, paths, args.layouts or (QUICK_LAYOUTS if args.quick else LAYOUTS))
        self.make_sp_groups(list(dict.fromkeys(p.case.split for p in paths if p.case.split)))
        progress = Progress(len(paths), self.rank == 0, "selftest")
        differ = "" if all(k == kernels for k in every_rank) else "ranks list different kernel sets: " + "; ".join(
            f"rank {r}: {k}" for r, k in enumerate(every_rank)
        )
        for index, case in enumerate(cases):
            # Once stopped, nothing more goes to the device: its queue is stuck.
            truth = None if self.stopped or differ else self.truth(case, index)
            for path in (p for p in paths if p.case is case):
                if self.stopped or differ:
                    result = self.blank(path, message=f"not run: {self.stopped or differ}")
                elif isinstance(truth, str):
                    result = self.blank(path, message=f"not run: {truth}")
                elif path.comm not in self.comms:
                    result = self.blank(path, message=f"not run: {self.not_tested.get('comm ' + path.comm, 'not available')}")
                elif isinstance(self.sp.get(path.case.split), str):
                    result = self.blank(path, message=f"not run: {self.sp[path.case.split]}")
                else:
                    result = self.run_path(path, truth)
                self.results.append(result)
                progress.step(_progress_line(result))
                if self.out_of_step:
                    self.recover(path.label)
        if self.rank == 0:
            report(self.results, self.env, self.settings, self.not_tested, args)
        dist.barrier(group=self.control)  # rank 0 has written everything before any rank exits
        return not any(r["status"] == "FAIL" for r in self.results)

    def _note_ring_left_out(self, cases: list[Case], paths: list[PathSpec], names) -> None:
        """``not_tested``: why a ring layout asked for has no path."""
        for name in (n for n in names if n.startswith("ring")):
            zigzag, packed = "zigzag" in name, name.endswith("packed")
            if not any(c.split and c.seq_layout == ("zigzag" if zigzag else "contiguous") and (c.docs is not None) == packed for c in cases):
                self.not_tested[f"layout {name}"] = f"needs at least 2 ranks (ring_size >= 2), this run has {self.world}"
            elif not any(p.case.split for p in paths):
                self.not_tested[f"layout {name}"] = "runs with comm torch-dist only (not in --comms)"

    def close(self) -> None:
        if self.own_nccl is not None:
            self.own_nccl.close()


# ---- rank 0's output -------------------------------------------------------------------
def _progress_line(r: dict) -> str:
    if r["status"] == "PASS":
        return f"PASS {r['path']}: {r['tensor']} {r['max_error']:.2e} <= {r['bound']:.1e}, {r['time_ms']:.1f} ms"
    msg = r["message"] if len(r["message"]) <= 160 else r["message"][:157] + "..."
    return f"{r['status']} {r['path']}: {msg}"


def _table(results: list[dict]) -> str:
    """The result table: text columns left-aligned, numbers right-aligned."""
    cols = ("path", "heads", "batch x seq", "chunks run", "max error", "bound", "result", "ms")
    rows = []
    for r in results:
        heads = f"{r['q_heads']}q/{r['kv_heads']}kv"
        seq = f"{r['batch']}x{sum(r['seq_lens'])}" + ("" if len(set(r["seq_lens"])) == 1 else " uneven")
        seq += f" {len(r['cu_seqlens']) - 1} docs" if r["cu_seqlens"] else ""
        err = "" if r["max_error"] is None else f"{r['tensor']} {r['max_error']:.2e}"
        bound = "" if r["bound"] is None else f"{r['bound']:.1e}"
        ms = "" if r["time_ms"] is None else f"{r['time_ms']:.1f}"
        run = "" if r["chunks_run"] is None else str(r["chunks_run"])
        rows.append((r["path"], heads, seq, run, err, bound, r["status"], ms))
    widths = [max(len(x) for x in col) for col in zip(cols, *rows)]
    right = {3, 4, 5, 7}

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _install_lines(install: dict | None) -> list[str]:
    """What ``info`` found that a user of this run must know: the default kernel set (and
    where it was validated) and whether ``_C``'s error path survives this toolchain."""
    if not install:
        return []
    lines = [f"default kernels (kernels='auto'): {info.default_line(install)}"]
    if install.get("extension_error_path") is not None:
        lines.append(f"_C error path: {toolchain.probe_line(install['extension_error_path'])}")
    return lines


def report(results: list[dict], env: dict, settings: dict, not_tested: dict, args, complete: bool = True) -> None:
    """Rank 0: the table and the failures (stdout), ``--json``, and the verdict file of a
    spawned run. ``complete=False``: the run was ended early (a hang)."""
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    ok = complete and counts["FAIL"] == 0
    where = env.get("gpu") if settings.get("device") == "cuda" else CPU_LABEL
    dtype = settings.get("dtype")
    rule = f"{FLOAT64_BOUND:g}" if dtype == "fp64" else f"2x PyTorch's own {dtype} error (SDPA, same device)"
    out = [
        f"ulysses_kernels self-test: {settings.get('world_size')} ranks ({settings.get('transport')}) on {where}, "
        f"{dtype}, head_dim {settings.get('head_dim')}, packed documents on {settings.get('packed_kernel')}; bound per tensor (out, dq, dk, dv): {rule}",
        *_install_lines(env.get("install")),
        _table(results),
    ]
    failed = [r for r in results if r["status"] == "FAIL"]
    if failed:
        out.append("failures:")
        out += [f"  {r['path']}: {r['message']}" for r in failed]
    if not_tested:
        out.append("not tested here:")
        out += [f"  {name}: {why}" for name, why in not_tested.items()]
    verdict = "every path matches the float64 reference" if ok else ("FAILED" if complete else "ENDED EARLY (a hang)")
    out.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped of {len(results)} paths: {verdict}")
    print("\n".join(out), flush=True)
    doc = {"ok": ok, "complete": complete, "counts": counts, "settings": settings, "environment": env, "not_tested": not_tested, "paths": results}
    for path in (args.json, getattr(args, "verdict_file", None)):
        if path:
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(path).write_text(json.dumps(doc, indent=2))
    if args.json:
        print(f"# wrote {args.json}", flush=True)


# ---- launch ------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, device: torch.device, transport: str, args) -> bool:
    """This rank's self-test; True when no path failed."""
    for name in args.imports:
        importlib.import_module(name)
    me = _Rank(rank, world, device, transport, args)
    ok = me.run()
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
    p.add_argument("--layouts", type=_names(LAYOUTS, "--layouts"), help=f"head layouts ({', '.join(LAYOUTS)}; default: all)")
    p.add_argument("--quick", action="store_true", help=f"chunks {','.join(QUICK_CHUNKS)} and layouts {','.join(QUICK_LAYOUTS)} (unless given)")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in args.imports:
        importlib.import_module(name)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not args.spawn:
        # Launched by torchrun: this process is one rank (NCCL when every local rank has a GPU).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        transport = "nccl" if gpus >= local else "gloo"
        _kernel_choice(args.kernels)  # a bad --kernels stops every rank here, alike
        if transport == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(transport)
        device = torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")
        try:
            ok = _rank_main(dist.get_rank(), dist.get_world_size(), device, transport, args)
        finally:
            dist.destroy_process_group()
        return 0 if ok else 1
    world, transport = (args.spawn, "gloo") if args.spawn else (gpus, "nccl") if gpus else (2, "gloo")
    _kernel_choice(args.kernels)
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


if __name__ == "__main__":
    sys.exit(main())
