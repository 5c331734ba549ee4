"""FlexAttention's block masks of packed documents: each query row's allowed key interval
(``doc_intervals``), reduced to blocks (partial / full, ``_block_sparsity``) and built into a
``BlockMask`` once per (boundaries, device, mask) (``doc_block_mask``). The ``flex`` packed
kernel (packed.py) runs on them."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from .documents import DocMask, Documents
from .tracing import in_trace

FLEX_BLOCK = 128  # FlexAttention's default block size (rows and columns of a mask block)


def doc_intervals(docs_q: Documents, docs_k: Documents, mask: DocMask, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``, int32 ``[Tq]``: the key rows query row ``r`` sees are exactly
    ``lo[r] <= c <= hi[r]`` (global key rows; ``lo > hi``: none). Contiguous documents make
    every row's visible keys one interval, so this is the whole mask, and block sparsity
    follows from it without evaluating the ``Tq x Tk`` mask (``doc_block_mask``)."""
    cq = torch.tensor(docs_q.cu_seqlens, dtype=torch.int64, device=device)
    ck = torch.tensor(docs_k.cu_seqlens, dtype=torch.int64, device=device)
    if cq.numel() != ck.numel():
        raise ValueError(f"packed documents: {cq.numel() - 1} query documents but {ck.numel() - 1} key documents")
    lq = cq.diff()
    doc = torch.repeat_interleave(torch.arange(lq.numel(), device=device), lq)
    r = torch.arange(int(cq[-1]), device=device)
    ks, ke = ck[:-1][doc], ck[1:][doc] - 1  # the document's first and last key row
    if not mask.causal:
        return ks.int(), ke.int()
    last = ks + (r - cq[:-1][doc]) + (ck.diff() - lq)[doc]  # bottom-right aligned diagonal
    hi = torch.minimum(last, ke)
    lo = ks if mask.window is None else torch.maximum(ks, last - (mask.window - 1))
    return lo.int(), hi.int()


def _block_sparsity(lo: torch.Tensor, hi: torch.Tensor, tk: int, block: int):
    """``(partial, full)`` bool ``[nq, nk]``: mask blocks where some / every (row, key) pair is
    visible, from each row's interval (rows past the end of the last block see nothing)."""
    tq = lo.numel()
    nq, nk = -(-tq // block), -(-tk // block)
    lo, hi = lo.long(), hi.long()
    rows = torch.arange(tq, device=lo.device) // block
    seen = lo <= hi
    # Some: a difference array over the key blocks each row's interval touches.
    diff = torch.zeros(nq, nk + 1, dtype=torch.int64, device=lo.device)
    ones = seen.long()
    diff.index_put_((rows, torch.where(seen, lo // block, 0)), ones, accumulate=True)
    diff.index_put_((rows, torch.where(seen, hi // block + 1, 0)), -ones, accumulate=True)
    some = diff.cumsum(1)[:, :nk] > 0
    # Every: the key blocks inside every row's interval of the query block; each row's is a
    # range of blocks, their intersection one range per query block.
    first = torch.where(seen, -(-lo // block), nk)  # first key block that starts at or after lo
    ends = torch.arange(1, nk + 1, device=lo.device) * block  # end (exclusive) of each key block
    ends[-1] = tk
    # last key block whose end - 1 <= hi: count of ends <= hi + 1, minus one
    last = torch.where(seen, torch.searchsorted(ends, hi + 1, right=True) - 1, -1)
    big = torch.full((nq,), nk, dtype=torch.int64, device=lo.device)
    lo_b = torch.zeros(nq, dtype=torch.int64, device=lo.device).scatter_reduce(0, rows, first, "amax", include_self=False)
    hi_b = big.scatter_reduce(0, rows, last, "amin", include_self=False)
    j = torch.arange(nk, device=lo.device)
    full = (j >= lo_b[:, None]) & (j <= hi_b[:, None])
    if tq % block:  # the last query block has padding rows: never full (they see nothing)
        full[-1] = False
    return some & ~full, full


def _kv_blocks(flags: torch.Tensor):
    """``(num [1, 1, nq] int32, indices [1, 1, nq, nk] int32)``: each query block's flagged key
    blocks first, in order (BlockMask's layout)."""
    num = flags.sum(1, dtype=torch.int32)
    order = torch.argsort((~flags).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return num[None, None], order[None, None]


@functools.lru_cache(maxsize=8)
def _cached_block_mask(cu_q, cu_k, device, mask: DocMask):
    return _build_block_mask(Documents(cu_q, 0), Documents(cu_k, 0), device, mask)


def _build_block_mask(docs_q, docs_k, device, mask):
    from torch.nn.attention.flex_attention import BlockMask

    lo, hi = doc_intervals(docs_q, docs_k, mask, device)
    tq, tk = docs_q.total, docs_k.total
    partial, full = _block_sparsity(lo, hi, tk, FLEX_BLOCK)
    # The mask function reads the intervals by query row; padded to whole blocks (rows past the
    # end see nothing) so that no kernel reads past the tensor.
    pad = -(-tq // FLEX_BLOCK) * FLEX_BLOCK - tq
    lo = F.pad(lo, (0, pad), value=1)
    hi = F.pad(hi, (0, pad), value=0)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[q_idx]) & (kv_idx <= hi[q_idx])

    kw = {"seq_lengths": (tq, tk)} if "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters else {}
    return BlockMask.from_kv_blocks(*_kv_blocks(partial), *_kv_blocks(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, **kw)


def doc_block_mask(docs_q: Documents, docs_k: Documents, device: torch.device, mask: DocMask):
    """FlexAttention's ``BlockMask`` of the documents: built from the row intervals
    (``doc_intervals``) in ``O(Tq + blocks^2)`` (never the ``Tq x Tk`` mask), kept per
    (boundaries, device, causal, window) in a small bounded cache, as ``Documents.on``."""
    key = DocMask(mask.causal, mask.window)  # the softcap is a score_mod, not part of the mask
    if in_trace():
        return _build_block_mask(docs_q, docs_k, device, key)
    return _cached_block_mask(docs_q.cu_seqlens, docs_k.cu_seqlens, device, key)
