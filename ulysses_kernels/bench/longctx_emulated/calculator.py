"""The calculator's side of each row, term by term: the ``memory.Setup`` of a row, its replay
(``memory_step``), its ZeRO-3 state and total, the model and executed FLOPs, and the
measured terms against the calculator's."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from ... import memory
from ...memory_step import step_memory
from ...plan import HeadPlan
from .step import PIECES, Config

GB = 1e9


def setup_of(cfg: Config, layers: int, seq: int, pieces: str, dtype, zero: int = 0, flash: bool | None = None) -> memory.Setup:
    """The calculator's setup of a row. ``flash``: count the flash kernel's float32 backward
    workspace (default: where this runs, on CUDA in half precision, as SDPA's flash kernel has one)."""
    s = cfg.sizes
    on = PIECES[pieces]
    if flash is None:
        flash = torch.cuda.is_available() and dtype in (torch.float16, torch.bfloat16)
    return memory.Setup(
        layers=layers, hidden=s["hidden"], heads=s["heads"], kv_heads=s["kv_heads"], intermediate=s["intermediate"],
        vocab=s["vocab"], seq=seq, sp=cfg.sp, dtype=str(dtype).removeprefix("torch."),
        checkpointing=True, tie_embeddings=False, zero=zero, offload_optimizer=zero >= 1,
        tiled_loss="tiled_loss" in on, tiled_mlp="tiled_mlp" in on, tiled_norms="tiled_norms" in on,
        offload_activations="offload_activations" in on, flash_workspace=flash,
    )  # fmt: skip


def zero3_state_bytes(setup: memory.Setup) -> int:
    """The ZeRO-3 (optimizer offloaded) rows of the calculator on a rank: parameters / N,
    gradients / N, the largest gathered module."""
    return memory.state_bytes(replace(setup, zero=3, offload_optimizer=True))


@functools.lru_cache(maxsize=256)
def calc_step(setup: memory.Setup):
    """The calculator's replay of rank 0 (cached: the 48-layer replay takes a while in Python)."""
    return step_memory(setup, 0)


@functools.lru_cache(maxsize=256)
def calc_total(setup: memory.Setup) -> int:
    """The calculator's bytes per GPU under ZeRO-3 with the optimizer offloaded (its worst rank)."""
    return memory.total_gpu(replace(setup, zero=3, offload_optimizer=True))


def model_flops(cfg: Config, seq: int, causal: bool = True) -> float:
    """Model FLOPs of one step on rank 0 (forward + backward, no recompute; the usual MFU
    convention): 6 x matmul parameters x local tokens, and causal attention of rank 0's heads
    over the whole sequence (6 x S^2/2 x 2 x head_dim per head)."""
    s = cfg.sizes
    d = s["hidden"] // s["heads"]
    local = -(-seq // cfg.sp)
    layer = s["hidden"] * d * (2 * s["heads"] + 2 * s["kv_heads"]) + 3 * s["hidden"] * s["intermediate"]
    hq = HeadPlan.build(s["heads"], s["kv_heads"], cfg.sp).q_count(0)
    attn = 6 * seq * seq * d * hq if causal else 0  # 2 matmuls x 2 FLOPs x S^2/2, times 3 (forward + backward)
    return 6.0 * local * (cfg.real_layers * layer + s["vocab"] * s["hidden"]) + cfg.real_layers * attn


def executed_flops(cfg: Config, layers: int, seq: int, attention: str, block: int) -> float:
    """What one measured step computes (checkpointing recomputes each layer; the tiled pieces
    their tiles), for the time-budget estimate only."""
    s = cfg.sizes
    d = s["hidden"] // s["heads"]
    local = -(-seq // cfg.sp)
    layer = s["hidden"] * d * (2 * s["heads"] + 2 * s["kv_heads"]) + 5 * s["hidden"] * s["intermediate"]
    hq = HeadPlan.build(s["heads"], s["kv_heads"], cfg.sp).q_count(0)
    span = seq / 2 if attention == "causal" else min(block, seq) / 2
    attn = 4.5 * 4 * seq * span * d * hq
    return local * (8.0 * layers * layer + 8.0 * s["vocab"] * s["hidden"]) + layers * attn


def compare(rec: dict, setup: memory.Setup, params_expected: int) -> dict:
    """The row's terms: measured, the calculator's, and the relative difference (measured / calculator - 1)."""
    calc = calc_step(setup)
    out = {
        "params_gb": rec["before"] / GB, "calc_params_gb": params_expected / GB,
        "forward_end_gb": rec["forward_end"] / GB, "calc_forward_end_gb": calc.forward_end / GB,
        "act_peak_gb": rec["peak"] / GB, "calc_act_peak_gb": calc.peak / GB, "calc_moment": calc.moment,
        "host_gb": rec["host_peak"] / GB, "calc_host_gb": calc.host_peak / GB,
        "reserved_gb": None if rec["reserved_peak"] is None else rec["reserved_peak"] / GB,
    }  # fmt: skip
    for key in ("params", "forward_end", "act_peak", "host"):
        m, c = out[f"{key}_gb"], out[f"calc_{key}_gb"]
        out[f"{key}_diff"] = (m / c - 1) if c else None
    if rec["reserved_peak"] is not None:
        # what the allocator held at its peak beyond what tensors did: fragmentation and caching
        out["reserved_over_allocated"] = rec["reserved_peak"] / max(rec["before"] + rec["peak"], 1)
    if "pinned_host" in rec:
        out["pinned_host"] = rec["pinned_host"]
    return out
