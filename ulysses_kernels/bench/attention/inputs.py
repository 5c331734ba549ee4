"""The inputs of the attention benchmark: random q, k, v, dout that any rank rebuilds block by
block (``Inputs``), the documents of the packed rows, the sequence lengths of the sweep, and
what one method is fed (``make_inputs``)."""

from __future__ import annotations

import torch

from ulysses_kernels.bench import sizes
from ulysses_kernels.documents import Documents, documents
from ulysses_kernels.plan import HeadPlan


class Inputs:
    """Random q, k, v, dout of one run, reproducible block by block on every rank.

    The global tensors are ``[B, S, H, D]``; the rows of rank ``p`` (``s = S/P`` tokens) come
    from a generator seeded with ``(seed, p, tensor)``, so any rank can rebuild any block
    (the local floor needs every row of its heads; the check needs all of k and v).
    """

    def __init__(self, batch, seq_total, heads, kv_heads, head_dim, world, dtype, device, seed=1234):
        self.B, self.S, self.H, self.Hkv, self.D = batch, seq_total, heads, kv_heads, head_dim
        self.P, self.s = world, seq_total // world
        self.dtype, self.device, self.seed = dtype, device, seed

    def block(self, p: int, name: str) -> torch.Tensor:
        which = "qkvo".index(name[0] if name != "dout" else "o")
        heads = self.H if name in ("q", "dout") else self.Hkv
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1000 + p * 10 + which)
        x = torch.randn(self.B, self.s, heads, self.D, generator=g, device=self.device, dtype=torch.float32)
        return x.to(self.dtype)

    def full(self, name: str, heads) -> torch.Tensor:
        """All rows, the given global heads: ``[B, S, len(heads), D]``."""
        idx = list(heads)
        return torch.cat([self.block(p, name)[:, :, idx] for p in range(self.P)], dim=1)


def packed_documents(S: int, seed: int = 0) -> Documents:
    """A realistic document-length mix over ``S`` tokens (SFT-like: many short documents,
    a few long ones): lengths log-normal with median 512 and sigma 1, clipped to
    ``[16, S // 2]``, the last one cut to fit. The same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < S:
        n = int(torch.empty(1).log_normal_(mean=6.238, std=1.0, generator=g).clamp(16, max(16, S // 2)))  # e^6.238 = 512
        lens.append(min(n, S - sum(lens)))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return documents(cu)


def equal_documents(S: int, count: int) -> Documents:
    """``count`` documents of equal length over ``S`` tokens (the remainder in the last)."""
    n = S // count
    return documents([i * n for i in range(count)] + [S])


def seq_lengths(args, P: int) -> list[int]:
    if args.seqs:
        seqs = [sizes.parse_size(x) for x in args.seqs.split(",")]
    else:
        seqs = sizes.size_sweep(sizes.parse_size(args.min_seq), sizes.parse_size(args.max_seq), 2)
    return [-(-s // P) * P for s in seqs]  # equal shards: round up to a multiple of P


def make_inputs(m, inp: Inputs, plan: HeadPlan, rank: int):
    """``([q, k, v], dout)`` of method ``m`` (a ``methods.Method``) on ``rank``: its rows for all
    heads (seq-sharded methods; ``m.rows`` when a zigzag shard), else its heads over all rows;
    q, k, v require grad."""
    if m.rows is not None:  # a zigzag shard: rows of every block
        q, k, v, dout = (inp.full(n, range(inp.Hkv if n in "kv" else inp.H)).index_select(1, m.rows.to(inp.device)) for n in ("q", "k", "v", "dout"))
    elif m.seq_sharded:
        q, k, v, dout = (inp.block(rank, n) for n in ("q", "k", "v", "dout"))
    else:
        (qa, qb), (ka, kb) = plan.q_ranges[rank], plan.kv_ranges[rank]
        q, dout = inp.full("q", range(qa, qb)), inp.full("dout", range(qa, qb))
        k, v = inp.full("k", range(ka, kb)), inp.full("v", range(ka, kb))
    return [x.requires_grad_() for x in (q, k, v)], dout
