"""Load balance of the ring level with packed documents: contiguous vs zigzag (computed, not timed).

    python -m ulysses_kernels.bench.ring_balance                          # the table of docs/scaling.md
    python -m ulysses_kernels.bench.ring_balance --seqs 128K --rings 4 --mix longtail --batches 50
    python -m ulysses_kernels.bench.ring_balance --json balance.json

On a 2-D group ``make_sp_groups(U, R)`` every rank of ring rank ``j`` computes its heads'
attention for the query rows of block ``j`` (``ring.seq_layout``): the attention work of a rank
is the number of visible (query, key) pairs of its block (``RingSchedule.pairs``, FLOPs =
``4 x head_dim x heads`` per pair forward, 2.5x that backward), the same for the ``U``
ranks of a ring rank. The slowest ring rank sets the pace of the layer, so the table gives
``max / mean`` of that work over the ``R`` ring ranks (1.00: balanced), averaged over
``--batches`` random packed batches, and the worst batch; plus what the ring schedule skips
(``steps``: ring steps that compute, of ``R*R``; ``hops``: K/V block transfers per
forward, of ``R*(R-1)``). With ``--balanced``, column ``balanced``: the same batches with
their documents reordered by ``ring.balance_documents`` (the order changes no result).

Document mixes (lengths in tokens, the last document of a batch cut to fit):

* ``sft``: log-normal, median 512, sigma 1, clipped to ``[16, S/2]`` (the attention
  benchmark's ``packed_documents``: chat/SFT data, many short documents);
* ``longtail``: log-normal, median 2048, sigma 1.8, clipped to ``[16, S]`` (long-context
  mixes: most documents short, a few of tens of thousands of tokens carrying much of the
  batch; about 6% of documents above 32K);
* ``none``: one document (unpacked), for reference: contiguous ``(2R-1)/R``, zigzag 1.

Everything here is arithmetic on the document boundaries (the schedule the op runs); no
attention is computed and no rank is started.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from ulysses_kernels.bench import harness, record, sizes
from ulysses_kernels.documents import documents
from ulysses_kernels.ring.balance import balance_documents, rank_work
from ulysses_kernels.ring.schedule import ring_schedule

MIXES = {"sft": (512, 1.0, "half"), "longtail": (2048, 1.8, "all"), "none": None}
COLUMNS = [
    ("seq", "seq", "d"), ("ring", "R", "d"), ("mix", "mix", ""), ("layout", "layout", ""), ("docs", "docs", ".0f"),
    ("imbalance", "max/mean", ".3f"), ("worst", "worst", ".3f"), ("balanced", "balanced", ".3f"), ("steps", "steps", ".1f"),
    ("hops", "hops", ".1f"),
    ("of_steps", "of", "d"), ("of_hops", "of", "d"),
]  # fmt: skip


def document_mix(S: int, mix: str, seed: int) -> tuple[int, ...]:
    """Global ``cu_seqlens`` of one packed batch of ``S`` tokens drawn from ``mix`` (seeded)."""
    if MIXES[mix] is None:
        return (0, S)
    median, sigma, top = MIXES[mix]
    g = torch.Generator().manual_seed(seed)
    hi = S // 2 if top == "half" else S
    cu = [0]
    while cu[-1] < S:
        n = int(torch.empty(1).log_normal_(mean=math.log(median), std=sigma, generator=g).clamp(16, max(16, hi)))
        cu.append(min(cu[-1] + n, S))
    return tuple(cu)


def balance(S: int, R: int, mix: str, layout: str, batches: int, balanced: bool = False) -> dict:
    """One row: the ring ranks' work over ``batches`` random batches (module docstring)."""
    ratios, steps, hops, docs, after = [], [], [], [], []
    for b in range(batches if mix != "none" else 1):
        cu = document_mix(S, mix, seed=b)
        sched = ring_schedule(R, layout, S // R, True, cu)
        work = [sched.pairs(j) for j in range(R)]
        ratios.append(max(work) / (sum(work) / R))
        steps.append(sched.computed_steps())
        hops.append(sched.hops())
        docs.append(documents(cu).count)
        if balanced:
            lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
            work = rank_work([lengths[i] for i in balance_documents(lengths, R, layout)], R, layout)
            after.append(max(work) / (sum(work) / R))
    n = len(ratios)
    return {
        "seq": S, "ring": R, "mix": mix, "layout": layout, "docs": sum(docs) / n, "imbalance": sum(ratios) / n,
        "worst": max(ratios), "balanced": sum(after) / n if after else None, "steps": sum(steps) / n, "hops": sum(hops) / n,
        "of_steps": R * R, "of_hops": R * (R - 1),
    }  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--seqs", default="128K,1M", help="global sequence lengths (default 128K,1M)")
    p.add_argument("--rings", default="2,4,8", help="ring sizes R (default 2,4,8)")
    p.add_argument("--mix", default="none,sft,longtail", help=f"comma list of {', '.join(MIXES)}")
    p.add_argument("--batches", type=int, default=20, help="random batches per row (default 20)")
    p.add_argument("--balanced", action="store_true", help="also the imbalance after ring.balance_documents (slower)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    args.seqs = [sizes.parse_size(x) for x in args.seqs.split(",")]
    args.rings = [int(x) for x in args.rings.split(",")]
    args.mix = [x.strip() for x in args.mix.split(",")]
    bad = [m for m in args.mix if m not in MIXES]
    if bad:
        p.error(f"--mix: unknown {bad}; choose from {', '.join(MIXES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for S in args.seqs:
        for R in args.rings:
            if S % (2 * R):
                print(f"# skipped seq {S} R {R}: zigzag needs a multiple of 2R = {2 * R}", file=sys.stderr)
                continue
            for mix in args.mix:
                rows += [balance(S, R, mix, layout, args.batches, args.balanced) for layout in ("contiguous", "zigzag")]
    record.print_table(COLUMNS, rows, title=f"# ring load balance, causal, {args.batches} batches per packed row (computed from the schedule, not timed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
