"""The check of every attention row: the output and dq on a sample of rows against a float32
reference computed from the same inputs (elements outside the dtype's tolerance), and the
layout rows' bit-for-bit check, summed over the ranks."""

from __future__ import annotations

import torch

from ulysses_kernels.bench import timing
from ulysses_kernels.plan import HeadPlan

from .inputs import Inputs

# (rtol, atol relative to the largest reference value) per dtype for the sampled-row check.
TOLERANCE = {torch.float64: (1e-7, 1e-7), torch.float32: (1e-3, 1e-3), torch.bfloat16: (3e-2, 3e-2), torch.float16: (1e-2, 1e-2)}


def sample_rows(n_rows: int, count: int) -> list[int]:
    """Up to ``count`` row indices spread over ``range(n_rows)``, first and last included."""
    if n_rows <= count:
        return list(range(n_rows))
    return sorted({round(i * (n_rows - 1) / (count - 1)) for i in range(count)})


def reference_rows(inp: Inputs, rows, heads, scale, k_full, v_full, docs=None):
    """float32 causal attention output and dq for global ``rows`` x global query ``heads``
    (with ``docs``: within each document only)."""
    g = inp.H // inp.Hkv
    rows_t = torch.tensor(rows, device=inp.device)
    per_block = {}
    for t in rows:
        per_block.setdefault(t // inp.s, []).append(t)
    q_rows = torch.cat([inp.block(p, "q")[:, [t - p * inp.s for t in ts]] for p, ts in sorted(per_block.items())], 1)
    do_rows = torch.cat([inp.block(p, "dout")[:, [t - p * inp.s for t in ts]] for p, ts in sorted(per_block.items())], 1)
    cols = torch.arange(inp.S, device=inp.device)
    mask = cols.view(1, -1) > rows_t.view(-1, 1)  # [n, S] causal
    if docs is not None:
        doc = torch.bucketize(cols, torch.tensor(docs.cu_seqlens[1:-1], device=inp.device), right=True)
        mask |= doc.view(1, -1) != doc[rows_t].view(-1, 1)  # other documents
    outs, dqs = [], []
    for h in heads:
        kk = k_full[:, :, h // g].float()  # [B, S, D]
        vv = v_full[:, :, h // g].float()
        qh, doh = q_rows[:, :, h].float(), do_rows[:, :, h].float()  # [B, n, D]
        p = torch.softmax((qh @ kk.transpose(1, 2) * scale).masked_fill(mask, float("-inf")), dim=-1)
        o = p @ vv
        dp = doh @ vv.transpose(1, 2)
        ds = p * (dp - (doh * o).sum(-1, keepdim=True))
        outs.append(o)
        dqs.append(ds @ kk * scale)
    return torch.stack(outs, 2), torch.stack(dqs, 2)  # [B, n, h, D]


def count_wrong(actual: torch.Tensor, ref: torch.Tensor, dtype) -> int:
    rtol, atol = TOLERANCE.get(dtype, (3e-2, 3e-2))
    a = actual.float()
    bound = atol * max(1.0, float(ref.abs().max())) + rtol * ref.abs()
    return int(((a - ref).abs() > bound).sum().item()) + int((~torch.isfinite(a)).sum().item())


def check_method(m, outs, inp: Inputs, plan: HeadPlan, rank: int, scale: float, kv_full, n_rows: int) -> int:
    out, dq = outs
    if m.seq_sharded:
        local = sample_rows(inp.s, n_rows)
        rows = [rank * inp.s + t if m.rows is None else int(m.rows[t]) for t in local]
        heads = list(range(inp.H))
    else:
        local = sample_rows(inp.S, n_rows)
        rows = local
        heads = list(range(*plan.q_ranges[rank]))
    ref_o, ref_dq = reference_rows(inp, rows, heads, scale, *kv_full, docs=m.docs)
    return count_wrong(out[:, local], ref_o, inp.dtype) + count_wrong(dq[:, local], ref_dq, inp.dtype)


def count_method_wrong(m, outs, args, g) -> int | None:
    """Wrong elements of method ``m`` (a ``methods.Method``) in group ``g`` (a ``run.Group``),
    summed over ranks (layout rows: bit for bit; attention rows: sampled rows against
    float32), or None with ``--check 0``."""
    if not args.check:
        return None
    if m.layout_only:
        return None if m.check_layout is None else int(timing.reduce_sum(m.check_layout()))
    if outs is None:
        return None
    if g.kv_full is None:
        g.kv_full = (g.inp.full("k", range(g.inp.Hkv)), g.inp.full("v", range(g.inp.Hkv)))
    return int(timing.reduce_sum(check_method(m, outs, g.inp, g.plan, g.rank, g.scale, g.kv_full, args.check_rows)))
