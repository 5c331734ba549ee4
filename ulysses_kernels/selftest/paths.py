"""One path on every rank: its result record, the rank-local set-up (what the call resolves
to, whether it runs), forward and backward (plainly, then under activation checkpointing),
and the errors against the float64 truth, each step's outcome exchanged between the ranks."""

from __future__ import annotations

import time

import torch
from torch.utils.checkpoint import checkpoint

from ..attention import ulysses_attention
from ..attention.call import setup_attention
from ..bench.record import kernel_label
from ..bench.sizes import dtype_name
from ..ring import shard_sequence as shard_2d
from ..testing.reference import contiguous_shard
from .cases import Case, PathSpec
from .judge import TENSORS, judge, max_err, short_error
from .recovery import HangTimer, hang_seconds, hung

__all__ = ["blank", "run_path"]


def _shard(rank, x: torch.Tensor, case: Case) -> torch.Tensor:
    """``rank``'s rows of the global ``x`` (``[B, S, ...]``) in ``case``'s sequence layout."""
    if case.split is None:
        return contiguous_shard(x, case.seq_lens, rank.rank)
    return shard_2d(x, rank.sp[case.split], layout=case.seq_layout)


def _group(rank, path: PathSpec):
    """``group`` and ``comm`` of ``ulysses_attention`` for ``path``: a 2-D group runs its
    Ulysses level on torch.distributed (the run's communicators are the flat group's)."""
    case = path.case
    if case.split is None:
        return rank.data, rank.comms[path.comm]
    return rank.sp[case.split].with_layout(case.seq_layout), None


def blank(rank, path: PathSpec, status: str = "FAIL", message: str = "", bounds=None) -> dict:
    """The result record of ``path`` before it ran (``layout``: the case's name under the
    key that records before ``case`` was named carry)."""
    case = path.case
    return {
        "path": path.label, "kernels": path.kernels, "kernels_label": kernel_label(path.kernels, rank.device),
        "comm": path.comm, "chunks": path.chunks, "chunks_run": None, "case": case.name, "layout": case.name,
        "ulysses_size": case.split[0] if case.split else rank.world, "ring_size": case.split[1] if case.split else 1,
        "seq_layout": case.seq_layout, "checkpoint": path.checkpoint, "checkpoint_diff": None,
        "cu_seqlens": None if case.docs is None else list(case.cu_seqlens),
        "q_heads": case.q_heads, "kv_heads": case.kv_heads, "seq_lens": list(case.seq_lens), "batch": case.batch,
        "head_dim": rank.head_dim, "v_head_dim": case.v_head_dim(rank.head_dim), "causal": case.causal, "dtype": dtype_name(rank.dtype), "backend": None,
        "status": status, "tensor": None, "max_error": None, "bound": None, "errors": None,
        "bounds": None if bounds is None else dict(zip(TENSORS, bounds)), "time_ms": None, "message": message,
    }  # fmt: skip


def _raised(result: dict, messages: list) -> bool:
    """Record the ranks' exception messages (``None``: that rank did not raise) in
    ``result``; True when some rank raised."""
    errors = [f"rank {r}: {m}" for r, m in enumerate(messages) if m]
    if errors:
        result["message"] = "; ".join(errors)
    return bool(errors)


def run_path(rank, path: PathSpec, truth) -> dict:
    """Run ``path`` on every rank (``rank``: this one, a ``ranks.Rank``); its result (the same
    on every rank). ``truth``: ``judge.truth`` of the path's case. A rank that raised inside
    the collective part sets ``rank.out_of_step`` (``recovery.recover`` before the next path)."""
    case = path.case
    inputs, ref, bounds = truth
    result = blank(rank, path, bounds=bounds)

    # 1. Rank-local, no collective: what the call resolves to, and whether it can run.
    mine = {"error": None, "skip": "", "chunks": None, "backend": None}
    try:
        ref_shards = [_shard(rank, r, case) for r in ref]
        shards = [_shard(rank, x, case).to(rank.device, rank.dtype) for x in inputs]
        group, comm = _group(rank, path)
        call = setup_attention(
            *shards[:3], group=group, comm=comm, plan=None, seq_lens=case.seq_lens, causal=case.causal,
            softmax_scale=None, attn_fn=None, kernels=path.kernels, chunks=path.chunks, check=False, cu_seqlens=case.cu_seqlens,
        )  # fmt: skip
        if not getattr(call.kernels, "supports", lambda _: True)(call.layout):
            mine["skip"] = f"kernel set {path.kernels!r} does not take {call.layout.world_size} ranks"
        mine["chunks"], mine["backend"] = call.chunks, getattr(call.backend, "name", type(call.backend).__name__)
    except Exception as e:  # noqa: BLE001 - any failure of a path is its result, reported by every rank
        mine["error"] = short_error(e)
    seen = rank.gather(mine)
    if _raised(result, [s["error"] for s in seen]):
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

    with HangTimer(hang_seconds(rank.timeout), lambda seconds: hung(rank, seconds, path.label, result)):
        # 2. Collective: forward and backward. No host sync after the input checks, so on
        # a GPU a rank whose peer raised still reaches the exchange below.
        ran, mine = None, None
        try:
            ran = _call(rank, path, shards)
        except Exception as e:  # noqa: BLE001 - reported by every rank, then the ranks re-sync
            mine = short_error(e)
        if _raised(result, rank.gather(mine)):
            rank.out_of_step = True
            return result

        # 3. Rank-local: errors, the checkpointed run against the plain one, and time (host syncs).
        mine = {"error": None}
        try:
            runs, elapsed = ran
            out, grads = runs[-1]
            mine["errors"] = [max_err(x, r).item() for x, r in zip((out, *grads), ref_shards)]
            if path.checkpoint:
                plain = (runs[0][0], *runs[0][1])
                mine["diff"] = [(x.detach() - y.detach()).abs().max().item() for x, y in zip((out, *grads), plain)]
            mine["ms"] = elapsed() * 1e3
        except Exception as e:  # noqa: BLE001 - as above
            mine["error"] = short_error(e)
        seen = rank.gather(mine)
    if _raised(result, [s["error"] for s in seen]):
        return result
    return judge(result, seen, bounds, rank.device)


def _attend(rank, path: PathSpec, q, k, v) -> torch.Tensor:
    group, comm = _group(rank, path)
    case = path.case
    return ulysses_attention(
        q, k, v, group=group, causal=case.causal, seq_lens=case.seq_lens, comm=comm, kernels=path.kernels, chunks=path.chunks,
        cu_seqlens=case.cu_seqlens,
    )  # fmt: skip


def _call(rank, path: PathSpec, shards):
    """Forward and backward on this rank (plainly, then for a checkpoint path under
    ``torch.utils.checkpoint``): ``(runs, elapsed)``, each run's out and grads, and a
    function giving the last run's seconds (called after the exchange: on a GPU it syncs)."""
    runs, elapsed, cuda = [], None, rank.device.type == "cuda"
    for checkpointed in (False, True) if path.checkpoint else (False,):
        q, k, v = (x.detach().clone().requires_grad_() for x in shards[:3])
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        if checkpointed:
            out = checkpoint(_attend, rank, path, q, k, v, use_reentrant=False)
        else:
            out = _attend(rank, path, q, k, v)
        out.backward(shards[3])
        if cuda:
            end.record()
            elapsed = lambda start=start, end=end: (end.synchronize(), start.elapsed_time(end) / 1e3)[1]  # noqa: E731
        else:
            seconds = time.perf_counter() - t0
            elapsed = lambda seconds=seconds: seconds  # noqa: E731
        runs.append((out, (q.grad, k.grad, v.grad)))
    return runs, elapsed
