"""The main job: Ulysses attention across ranks, checked against one process.

    python -m ulysses_kernels.demo [--world-size 4] [--q-heads 10] [--kv-heads 2] ...

Uses NCCL on the local GPUs when there are at least ``--world-size`` of them, otherwise
gloo ranks on the CPU. Under ``torchrun`` (``torchrun --nproc-per-node N -m
ulysses_kernels.demo``) each process is one rank. Rank 0 prints the head plan, then forward and backward errors
against single-process float64 attention; the exit code is non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from .attention import ulysses_attention
from .layout import split_lengths
from .plan import HeadPlan
from .testing import run_ranks
from .testing.reference import attention_reference, contiguous_shard


def _job(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device()) if args.transport == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float64
    seq_lens = split_lengths(args.seq, world)
    g = torch.Generator().manual_seed(1234)
    shape_q = (args.batch, args.seq, args.q_heads, args.head_dim)
    shape_kv = (args.batch, args.seq, args.kv_heads, args.head_dim)
    q, dout = torch.randn(shape_q, generator=g), torch.randn(shape_q, generator=g)
    k, v = torch.randn(shape_kv, generator=g), torch.randn(shape_kv, generator=g)

    full = [x.double().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*full, causal=not args.no_causal)
    ref.backward(dout.double())

    mine = [contiguous_shard(x, seq_lens, rank).to(device, dtype).requires_grad_() for x in (q, k, v)]
    t0 = time.perf_counter()
    out = ulysses_attention(*mine, causal=not args.no_causal, seq_lens=seq_lens)
    out.backward(contiguous_shard(dout, seq_lens, rank).to(device, dtype))
    elapsed = time.perf_counter() - t0

    errs = [(out.double().cpu() - contiguous_shard(ref, seq_lens, rank)).abs().max().item()]
    errs += [(m.grad.double().cpu() - contiguous_shard(f.grad, seq_lens, rank)).abs().max().item() for m, f in zip(mine, full)]
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, errs)
    if rank == 0:
        # Low precision: our error may be at most 2x that of PyTorch's own single-process
        # attention in the same dtype on the same device (both against float64).
        budget = [1e-10] * 4 if dtype == torch.float64 else [2 * e for e in _torch_error(full, ref, dout, device, dtype, args)]
        plan = HeadPlan.build(args.q_heads, args.kv_heads, world)
        print(plan.table())
        what = "" if device.type == "cuda" else " (one call on the CPU: a code-path check, not a GPU claim)"
        print(
            f"\nsequence {args.seq} tokens over {world} ranks {seq_lens}, batch {args.batch}, "
            f"head_dim {args.head_dim}, {dtype} on {device.type} ({args.transport}), fwd+bwd {elapsed * 1e3:.1f} ms on rank 0{what}"
        )
        worst = [max(col) for col in zip(*gathered)]
        for name, e, tol in zip(("out", "dq", "dk", "dv"), worst, budget):
            print(f"  max |{name} - float64 reference| over ranks = {e:.3e}  (allowed {tol:.1e}: {'ok' if e <= tol else 'MISMATCH'})")
        if any(e > tol for e, tol in zip(worst, budget)):
            raise SystemExit(1)
        print("ulysses_attention matches single-process attention")


def _torch_error(full, ref, dout, device, dtype, args) -> list[float]:
    """Max error of one-process SDPA in ``dtype`` against the float64 reference."""
    low = [x.detach().to(device, dtype).requires_grad_() for x in full]
    q, k, v = (x.transpose(1, 2) for x in low)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=not args.no_causal, enable_gqa=True)
    out = out.transpose(1, 2)
    out.backward(dout.to(device, dtype))
    errs = [(out.double().cpu() - ref.detach()).abs().max().item()]
    return errs + [(x.grad.double().cpu() - f.grad).abs().max().item() for x, f in zip(low, full)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: GPUs if >= 2, else 4 CPU ranks)")
    p.add_argument("--q-heads", type=int, default=10)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=37, help="global sequence length (need not divide)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--no-causal", action="store_true")
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # Launched by torchrun: this process is one rank (NCCL when every local rank has a GPU).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        args.transport = "nccl" if gpus >= local else "gloo"
        if args.transport == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(args.transport)
        try:
            _job(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return 0
    world = args.world_size or (gpus if gpus >= 2 else 4)
    args.transport = "nccl" if gpus >= world >= 2 else "gloo"
    run_ranks(_job, world, args, transport=args.transport)
    return 0


if __name__ == "__main__":
    sys.exit(main())
