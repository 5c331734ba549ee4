"""Train a tiny transformers model with DeepSpeed ZeRO-3 and Ulysses sequence parallelism.

    python examples/deepspeed_zero3/train.py --spawn 4 --sp-size 2      # 4 gloo ranks on the CPU: 2 replicas x 2
    torchrun --standalone --nproc-per-node 4 examples/deepspeed_zero3/train.py --sp-size 2
    deepspeed --num_gpus 8 examples/deepspeed_zero3/train.py --sp-size 8 --seq 32768 --dtype bfloat16   # 8 GPUs

The pieces: ``mesh.parallel_groups`` builds the ``[dp, sp]`` DeviceMesh; ``hf.apply`` makes
attention sequence-parallel over its sp group; ``deepspeed.initialize(..., mpu=groups.mpu())``
gives DeepSpeed the sequence, sequence-data and data-parallel groups (so ZeRO partitions
and reduces over dp x sp and counts the batch over dp replicas); ``mesh.grad_divisor`` reads
the engine's ZeRO settings and ``mesh.scale_loss`` makes the loss the global token mean
over dp x sp scaled for them. ``ds_config.json`` (next to this file) is ZeRO-3; its
sequence parallelism comes from the mpu, so it sets no ``sequence_parallel_size``.

At step 0 the global loss is checked against the same model run in one process on the
whole global batch; at the end the loss must have gone down (non-zero exit otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

from ulysses_kernels.integrations import hf, mesh

HERE = os.path.dirname(os.path.abspath(__file__))


def build_model(args):
    """A tiny random Qwen2 from a config (no download); the same weights on every rank."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.heads * args.head_dim, intermediate_size=2 * args.heads * args.head_dim,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=max(2 * args.seq, 128), attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    return transformers.Qwen2ForCausalLM(config)


def make_batch(step: int, replica: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` ``[micro_batch, seq]`` of one replica (learnable progressions; replica
    r masks its first r + 1 targets, so replicas count different numbers of tokens)."""
    g = torch.Generator().manual_seed(1000 * (replica + 1) + step)
    start = torch.randint(0, args.vocab, (args.micro_batch, 1), generator=g)
    stride = torch.randint(1, 4, (args.micro_batch, 1), generator=g)
    ids = (start + stride * torch.arange(args.seq)) % args.vocab
    labels = ids.clone()
    labels[:, : replica + 1] = -100
    return ids, labels


def one_process_loss(args, dp: int, dtype, device) -> float:
    """Step 0's loss of the same model in one process on every replica's batch."""
    model = build_model(args).to(device, dtype)
    ids, labels = (torch.cat(t).to(device) for t in zip(*[make_batch(0, r, args) for r in range(dp)]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    if logits.dtype in (torch.float16, torch.bfloat16):  # as ShardedBatch.loss computes
        logits = logits.float()
    target = labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    return (ce / (target != -100).sum()).item()


@contextlib.contextmanager
def zero3_deprecations_quiet():
    """DeepSpeed 0.19.8's ZeRO-3 calls ``torch.distributed.all_gather_into_tensor`` and
    ``reduce_scatter_tensor``, which torch 2.14 deprecates: a FutureWarning again and again
    on every rank (68 lines over this example's 8 steps on 4 ranks), about code that is
    DeepSpeed's to change. Silenced around the calls that make them, not for the process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", category=FutureWarning)
        yield


@contextlib.contextmanager
def cpu_init_quiet():
    """On the CPU, DeepSpeed 0.19.8's ``init_distributed`` loads its shared-memory op on every
    rank and says so twice per rank (torch's "No CUDA runtime is found" warning and "...
    deepspeed_shm_comm_op built successfully"), every run, the op built or not. Quiet around
    that call only: what it printed is shown if it raises."""
    out = io.StringIO()
    ext_log = logging.getLogger("torch.utils.cpp_extension")
    level = ext_log.level
    ext_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(out):
            yield
    except BaseException:
        sys.stdout.write(out.getvalue())
        raise
    finally:
        ext_log.setLevel(level)


def train(rank: int, world: int, args) -> list[float]:
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))  # set by the deepspeed and torchrun launchers
    with cpu_init_quiet() if dist.get_backend() == "gloo" else contextlib.nullcontext():
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    groups = mesh.parallel_groups(sp_size=args.sp_size or world)

    with open(args.config) as fh:
        config = json.load(fh)
    config["train_micro_batch_size_per_gpu"] = args.micro_batch
    if dtype in (torch.bfloat16, torch.float16):
        config["bf16" if dtype == torch.bfloat16 else "fp16"] = {"enabled": True}
    model = hf.apply(build_model(args).to(device, dtype), groups.sp_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    with zero3_deprecations_quiet():
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=groups.mpu())
    divisor = mesh.grad_divisor(engine, groups)  # raises on a setting whose gradient would be wrong

    losses = []
    for step in range(args.steps):
        ids, labels = make_batch(step, groups.dp_rank, args)
        batch = hf.shard_batch(ids.to(device), labels.to(device), group=groups.sp_group)
        with zero3_deprecations_quiet():
            share = batch.loss(engine(**batch.model_inputs(loss=False)).logits)  # this rank's share of its replica's mean
            engine.backward(mesh.scale_loss(share, batch.num_tokens, groups, divisor))
            engine.step()
        losses.append(mesh.global_loss(share, batch.num_tokens, groups).item())
        if step == 0:
            expected = one_process_loss(args, groups.dp_size, dtype, device)
            rtol = 1e-4 if dtype == torch.float32 else 2e-2
            if abs(losses[0] - expected) > rtol * abs(expected):
                raise SystemExit(f"rank {rank}: step 0 loss {losses[0]:.10f} != one-process loss {expected:.10f}")
        if rank == 0 and not args.quiet:
            print(f"step {step:3d}  loss {losses[-1]:.6f}  grad norm {float(engine.get_global_grad_norm()):.4f}"
                  + ("  (matches one process)" if step == 0 else ""))  # fmt: skip
    with zero3_deprecations_quiet():
        engine.destroy()
    if args.steps > 1 and not losses[-1] < losses[0]:
        raise SystemExit(f"rank {rank}: the loss did not decrease: {losses}")
    return losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spawn", type=int, default=0, help="spawn this many gloo ranks on the CPU (no launcher)")
    p.add_argument("--config", default=os.path.join(HERE, "ds_config.json"), help="DeepSpeed config (JSON)")
    p.add_argument("--sp-size", type=int, default=0, help="ranks per sequence group (default: all); world / sp replicas")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per replica per step")
    p.add_argument("--seq", type=int, default=29, help="global sequence length (need not divide the ranks)")
    p.add_argument("--vocab", type=int, default=61)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="parameter dtype (ZeRO-3 refuses float64: DeepSpeed 0.19.8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("deepspeed") is None:
        sys.exit(
            "this example needs DeepSpeed (tested with deepspeed==0.19.8): DS_BUILD_OPS=0 pip install deepspeed==0.19.8, "
            "or in a checkout: bash scripts/setup.sh (it installs DeepSpeed unless ULYSSES_KERNELS_PEERS=0)"
        )
    if args.spawn:
        from ulysses_kernels.testing import run_ranks

        # gloo ranks on the CPU: said to DeepSpeed, which otherwise warns on every rank that it found no GPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        run_ranks(train, args.spawn, args)
        return 0
    if "RANK" in os.environ:  # torchrun or the deepspeed launcher
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    else:  # one plain process
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        init_file = os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        train(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()  # without it a rank may abort at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
