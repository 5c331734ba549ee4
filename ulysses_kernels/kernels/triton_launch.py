"""What the Triton kernel sets' launches share (``triton_kernels``' data movement and
``triton_fp8``'s FP8 wire): the grid of one launch over head columns and the int64 tables
the kernels read their descriptors and addresses from."""

from __future__ import annotations

import os

import torch
import triton


def _int64_table(values: list[int], device: torch.device, capturing: bool = False) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device`` without a host sync.

    On CUDA, a pinned host copy sent ``non_blocking`` (the caching host allocator keeps it
    until the copy has run). Inside a CUDA graph capture, one ``fill_`` per value instead:
    the values become arguments of the captured kernels, so a replay reads no host memory
    (a captured copy would read the pinned block again at every replay, long after it went
    back to the allocator). Only the short address tables are built so.
    """
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64)
    if capturing:
        out = torch.empty(len(values), dtype=torch.int64, device=device)
        for i, x in enumerate(values):
            out[i].fill_(x)
        return out
    return torch.tensor(values, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch_geometry(n_rows: int, n_cols: int, head_dim: int, interpreting: bool, new: bool = True) -> tuple[tuple[int, ...], int, int]:
    """``(grid, BLOCK_R, BLOCK_D)`` of one launch over ``n_rows = n_tok * batch`` rows and
    ``n_cols`` head columns.

    Old variant: rows on grid axis 0 (CUDA's x: up to 2^31 - 1 programs), head columns on
    axis 1 (y: at most 65535). The row count grows with the sequence (1M tokens x batch 4,
    D = 128: 131072 programs, past the y limit) while the column count is the head count,
    so the axes must not be swapped. ~4K elements per program, 4 warps.

    New variant: one axis of ``row blocks x columns`` programs, the column fastest, so the
    programs that run side by side (consecutive ids) move the heads of the same tokens:
    neighbouring rows of the source (a token's heads are contiguous) and of the send buffer,
    rather than one head of many tokens (rows ``H * D`` elements apart). ~8K elements per
    program (16 KB of bf16), 8 warps: twice the bytes in flight per program. Inside the
    kernel, row indices and every offset are int64.
    """
    block_d = triton.next_power_of_2(head_dim)
    # Bigger tiles in the interpreter, where each program instance costs ~4 ms regardless of its size.
    target = 1 << 14 if interpreting else (8192 if new else 4096)
    block_r = max(1, min(triton.next_power_of_2(n_rows), max(1, target // block_d)))
    n_blocks = triton.cdiv(n_rows, block_r)
    if new:
        grid = (n_blocks * n_cols,)
        if grid[0] > 2**31 - 1:
            raise ValueError(f"TritonKernels: grid {grid} exceeds CUDA's limit (2^31 - 1 programs; {n_cols} head columns)")
        return grid, block_r, block_d
    grid = (n_blocks, n_cols)
    if grid[1] > 65535 or grid[0] > 2**31 - 1:  # CUDA's grid limits (y, x)
        raise ValueError(f"TritonKernels: grid {grid} exceeds CUDA's limits ({n_cols} head columns)")
    return grid, block_r, block_d
