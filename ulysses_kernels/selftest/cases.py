"""What the self-test runs: its cases (head counts, sequence shards, documents, 2-D groups,
v head dims, sized to the world) and its paths (kernel set x communicator x chunk count x
case), and the kernel sets it picks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..kernels import KERNEL_SETS, available_kernels, kernel_set_report
from ..layout import split_lengths

__all__ = [
    "CASE_NAMES", "COMMS", "CHUNKS", "QUICK_CASES", "QUICK_CHUNKS", "CHECKPOINT_CHUNKS", "Case", "PathSpec",
    "short_and_crossing_documents", "ring_splits", "make_cases", "make_paths", "chunk_value", "kernel_choice",
]  # fmt: skip

# The self-test's case names (``--cases``); a ring name gives one case per ``ring_splits``.
CASE_NAMES = ("mha", "gqa", "uneven-heads", "uneven-shards", "packed", "ring", "ring-zigzag", "ring-packed", "ring-zigzag-packed",
              "mla", "mla-wide-v", "ring-mla")  # fmt: skip
COMMS = ("torch-dist", "nccl", "nccl-borrowed")
CHUNKS = ("1", "2", "auto")
QUICK_CASES = ("gqa", "uneven-shards", "packed", "ring-zigzag", "mla")
QUICK_CHUNKS = ("1", "2")
# The chunked pipeline (its exchanges in flight while attention runs, nested backward
# passes per chunk) is the path that met the checkpoint's recompute badly: checked here.
CHECKPOINT_CHUNKS = 2


@dataclass(frozen=True)
class Case:
    """One case: ``[batch, seq_lens[r], q_heads, head_dim]`` q on rank r.

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
    """One kernel set x communicator x chunk count x case; ``checkpoint``: run once plainly
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
    """Document lengths of the ``packed`` case's ``world * seq_per_rank`` tokens: one
    shorter than the world (``world // 2`` tokens, 1 at least), one of a shard's length that
    starts there and so crosses the first shard boundary, and the rest in two of mixed lengths."""
    total, short = world * seq_per_rank, max(1, world // 2)
    lengths = [short, min(seq_per_rank, total - short)]
    rest = total - sum(lengths)
    return tuple(n for n in lengths + [rest // 3, rest - rest // 3] if n)


def ring_splits(world: int) -> list[tuple[int, int]]:
    """The ``(ulysses_size, ring_size)`` splits the ring cases run at ``world`` ranks: the
    largest Ulysses group with a ring (ring size the smallest divisor above 1), and the
    smallest Ulysses group above 1 with the longest ring (at 8 ranks 4x2 and 2x4, at 4 ranks
    2x2, at 2 or 3 ranks one ring); none at one rank."""
    if world < 2:
        return []
    d = _smallest_divisor(world)
    return list(dict.fromkeys([(world // d, d)] + ([(d, world // d)] if world // d >= 2 else [])))


def make_cases(world: int, seq_per_rank: int, names=CASE_NAMES) -> list[Case]:
    """The cases ``names`` for a world of ``world`` ranks (``cli``'s docstring, which
    ``--help`` prints, says what each is); the ring names give one case per
    ``ring_splits(world)``, none at one rank."""
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
        every["ring" + suffix] = [Case(f"ring-{u}x{r}{suffix}", 2 * u, _fewer_kv_heads(2 * u, u), even2, 2, True, (u, r), layout) for u, r in ring_splits(p)]
        every["ring" + suffix + "-packed"] = [
            Case(f"ring-{u}x{r}{suffix}-packed", 2 * u, _fewer_kv_heads(2 * u, u), even2, 1, True, (u, r), layout, short_and_crossing_documents(p, even2[0]))
            for u, r in ring_splits(p)
        ]
    every["ring-mla"] = [Case(f"ring-{u}x{r}-mla", u + 1, u + 1, (s + s % 2,) * p, 2, True, (u, r), "contiguous", v_dim=(3, 4)) for u, r in ring_splits(p)]
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


def chunk_value(text: str) -> int | str:
    """A ``--chunks`` entry as ``ulysses_attention`` takes it: ``"auto"`` or a count."""
    return text if text == "auto" else int(text)


def kernel_choice(requested: list[str] | None) -> tuple[list[str], dict[str, str]]:
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
