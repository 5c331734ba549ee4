"""The self-test's verdicts: the float64 truth of a case, the bound of each tensor (1e-10 in
float64, else 2x PyTorch's own error in the same dtype, dk/dv of replicated KV heads one ulp
more per extra holder), and a path's result decided from every rank's errors."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..checkpointing import graph_exec_group
from ..plan import HeadPlan
from ..testing.reference import attention_reference
from .cases import Case

__all__ = ["TENSORS", "FLOAT64_BOUND", "short_error", "max_err", "per_document", "truth", "torch_bounds", "replica_roundings", "ulp_at", "judge"]

TENSORS = ("out", "dq", "dk", "dv")
FLOAT64_BOUND = 1e-10  # as the tests: float64 all the way, only summation order differs


def short_error(e: BaseException) -> str:
    """``e`` as one line of a result's message (400 characters at most)."""
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 400 else text[:397] + "..."


def max_err(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (x.detach().double() - ref).abs().max()


def per_document(case: Case, attend, q, k, v) -> torch.Tensor:
    """``attend(q, k, v)`` over the global ``[B, S, H, D]`` sequence, or over each packed
    document of ``case`` on its own (the outputs concatenated)."""
    if case.docs is None:
        return attend(q, k, v)
    spans = list(itertools.pairwise(case.cu_seqlens))
    return torch.cat([attend(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in spans], dim=1)


def truth(rank, case: Case, index: int):
    """Global inputs q, k, v, dout (float64 on the CPU, the same on every rank), the
    float64 reference out, dq, dk, dv on ``rank.device``, and the per-tensor bounds; or a
    string saying why not (the same on every rank). Collective over ``rank`` (a ``ranks.Rank``)."""
    mine = {"error": None, "bounds": None}
    try:
        g = torch.Generator().manual_seed(1234 + index)
        seq = sum(case.seq_lens)
        dv = case.v_head_dim(rank.head_dim)
        shape_q = (case.batch, seq, case.q_heads, rank.head_dim)
        shape_kv = (case.batch, seq, case.kv_heads, rank.head_dim)
        shape_v, shape_out = (*shape_kv[:3], dv), (*shape_q[:3], dv)
        inputs = [torch.randn(s, generator=g, dtype=torch.float64) for s in (shape_q, shape_kv, shape_v, shape_out)]
        full = [x.to(rank.device).clone().requires_grad_() for x in inputs[:3]]
        out = per_document(case, lambda q, k, v: attention_reference(q, k, v, causal=case.causal), *full)
        out.backward(inputs[3].to(rank.device))
        ref = [out.detach()] + [x.grad for x in full]
        if rank.dtype == torch.float64:
            mine["bounds"] = [FLOAT64_BOUND] * len(TENSORS)
        elif rank.rank == 0:
            # One rank measures PyTorch's error and all use it: a GPU's backward need
            # not be deterministic, and every rank must reach the same verdict.
            mine["bounds"] = torch_bounds(case, inputs, ref, rank.device, rank.dtype)
    except Exception as e:  # noqa: BLE001 - reported by every rank as the case's failure
        mine["error"] = short_error(e)
    seen = rank.gather(mine)
    errors = [f"rank {r}: {s['error']}" for r, s in enumerate(seen) if s["error"]]
    if errors:
        return "the float64 reference or the bound failed: " + "; ".join(errors)
    return inputs, ref, seen[0]["bounds"]


def torch_bounds(case: Case, inputs, ref, device: torch.device, dtype: torch.dtype) -> list[float]:
    """2x the error of one-process SDPA in ``dtype`` on ``device``, per tensor; for dk and dv
    of a case with replicated KV heads, one ulp more per extra holder (``replica_roundings``)."""
    low = [x.to(device, dtype).clone().requires_grad_() for x in inputs[:3]]

    def sdpa(q, k, v):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=True).transpose(1, 2)

    out = per_document(case, sdpa, *low)
    out.backward(inputs[3].to(device, dtype))
    errs = [max_err(out, ref[0])] + [max_err(x.grad, r) for x, r in zip(low, ref[1:])]
    bounds = [2 * e.item() for e in errs]
    extra = replica_roundings(case) - 1
    for i in (2, 3) if extra > 0 else ():  # dk, dv
        bounds[i] += extra * ulp_at(ref[i].abs().max().item(), dtype)
    return bounds


def replica_roundings(case: Case) -> int:
    """The most ranks of the case's Ulysses group that hold one KV head (1: no replica).

    A KV head replicated over r ranks has its gradient rounded to the dtype on each of them
    and the r pieces summed in the dtype by the exchange back (``unpack_h2s``): r - 1 more
    roundings than one process's kernel, which sums in float32 and rounds once. Measured on
    an H200 (bench/results/2026-11-30_h200_world, 8 NCCL ranks): ring-2x4-packed, 4 query
    heads over one KV head on 2 Ulysses ranks, dv 5.6e-2 against 2x SDPA's 5.0e-2, the same
    bits on every kernel set and chunking; so dk and dv get one ulp more per extra holder."""
    ulysses = case.split[0] if case.split else len(case.seq_lens)
    plan = HeadPlan.build(case.q_heads, case.kv_heads, ulysses)
    return max(len(plan.kv_holders(h)) for h in range(case.kv_heads))


def ulp_at(x: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s values at magnitude ``x`` (its epsilon at 1.0, scaled)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(x)) if x > 0 else 0.0


def judge(result: dict, seen: list[dict], bounds, device: torch.device) -> dict:
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
        exact = device.type != "cuda" and graph_exec_group() is not None
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
