"""Train a tiny transformers model with Ulysses sequence parallelism: copy this loop.

    python examples/train_hf.py --spawn 2                   # 2 gloo ranks on the CPU
    python examples/train_hf.py --spawn 2 --model llama     # Llama instead of Qwen2
    python examples/train_hf.py --spawn 2 --model gpt_oss --window 8   # attention sinks, alternating 8-token windows
    python examples/train_hf.py --spawn 4 --sp-size 2       # 2 replicas x 2-rank sequence parallel
    python examples/train_hf.py --spawn 2 --packed          # documents packed into one sequence (padding-free)
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --sp-size 2 --seq 255    # NCCL on 4 GPUs (gloo on the CPU)

Every rank of the sequence-parallel group reads the same global batch; ``shard_batch``
keeps this rank's slice of the sequence (global positions, labels shifted globally),
``apply`` makes the model's attention sequence-parallel (the fused ``ulysses_attention``
for plain causal attention, the model's own attention on each rank's heads for sliding
windows, softcapping and sinks), and ``sync_gradients`` sums the gradients over the group. At step 0 the loss is checked
against the same model run in one process on the whole sequence, and at the end the
loss must have gone down; the exit code is non-zero otherwise.

``--packed``: each step's batch is one sequence of documents end to end, with position ids
that restart at 0 per document (the format of transformers' ``DataCollatorWithFlattening``);
``shard_batch`` finds the documents, and attention stays inside each one. Step 0 is checked
against the same model run in one process on each document separately.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from ulysses_kernels.integrations import hf

# --model: (config class, model class, attention implementation, config of a tiny model).
# Gemma 2 softcaps its attention logits and GPT-OSS adds sinks: sdpa can do neither, so
# they run eager here (flash_attention_2/3 where flash-attn is installed).
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "sdpa", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "sdpa", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", "sdpa", {"sliding_window": None}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "eager", {}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", "eager", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "experts_implementation": "eager",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
}  # fmt: skip


def build_model(args):
    """A tiny random model from a config (no download); the same weights on every rank."""
    import transformers

    config_name, model_name, attn_implementation, extra = FAMILIES[args.model]
    config = {
        "vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim, "max_position_embeddings": max(2 * args.seq, 128), "attn_implementation": attn_implementation,
        **extra,
    }  # fmt: skip
    if args.model == "gemma2":
        config["query_pre_attn_scalar"] = args.head_dim
    if args.window and args.model == "qwen2":
        config.update(use_sliding_window=True, sliding_window=args.window, max_window_layers=0)
    elif args.window:
        config["sliding_window"] = args.window  # Gemma 2 and GPT-OSS: every other layer
    torch.manual_seed(args.seed)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))


def make_batch(step: int, replica: int, args) -> torch.Tensor:
    """``[batch, seq]`` token ids: arithmetic progressions mod vocab (learnable).

    A toy data set of ``args.batches`` batches per data-parallel replica, cycled (the
    default, 1, repeats one batch, so the last step's loss ends below the first, which is
    what the exit code checks; single steps may rise: with ``--seq 255`` on 4 gloo ranks and
    the default lr it rose over steps 1-5, 3.72 to 4.06, and ended at 4.04 below step 0's 4.13). A real
    loader goes here: every rank of a sequence-parallel group must get the same global
    batch; the replicas get different ones.
    """
    g = torch.Generator().manual_seed(1000 * (replica + 1) + step % args.batches)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 4, (args.batch, 1), generator=g)
    return (start + stride * torch.arange(args.seq)) % args.vocab


def make_packed_batch(step: int, replica: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """``([1, seq] token ids, [1, seq] position ids)``: documents of mixed lengths (1 token
    up to half the sequence) end to end, positions 0, 1, ... within each document."""
    g = torch.Generator().manual_seed(1000 * (replica + 1) + step % args.batches)
    lengths = []
    while sum(lengths) < args.seq:
        lengths.append(min(int(torch.randint(1, max(2, args.seq // 2), (1,), generator=g)), args.seq - sum(lengths)))
    docs = []
    for n in lengths:
        start, stride = torch.randint(0, args.vocab, (1,), generator=g), torch.randint(1, 4, (1,), generator=g)
        docs.append((start + stride * torch.arange(n)) % args.vocab)
    return torch.cat(docs).unsqueeze(0), torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def one_process_loss(reference, ids: torch.Tensor, positions: torch.Tensor | None) -> float:
    """The mean loss of the whole batch in one process: over the whole sequence, or for a
    packed batch over each document run on its own (a document's last token has no target)."""
    if positions is None:
        return reference(input_ids=ids, labels=ids).loss.item()
    starts = torch.nonzero(positions[0] == 0).flatten().tolist() + [ids.shape[1]]
    total, count = 0.0, 0
    for a, b in zip(starts[:-1], starts[1:]):
        if b - a > 1:  # a one-token document has no target
            total += reference(input_ids=ids[:, a:b], labels=ids[:, a:b]).loss.item() * (b - a - 1)
            count += b - a - 1
    return total / count


def make_groups(rank: int, world: int, sp_size: int):
    """Sequence-parallel groups of ``sp_size`` consecutive ranks; data-parallel across them.

    Returns ``(sp_group, dp_group, replica, replicas)``; ``None`` stands for the world
    (one sequence-parallel group) or for "no data parallelism". Every rank creates every
    group, as ``torch.distributed.new_group`` requires.
    """
    if world % sp_size:
        raise SystemExit(f"--sp-size {sp_size} does not divide the world size {world}")
    replicas = world // sp_size
    if replicas == 1:
        return None, None, 0, 1
    sp_groups = [dist.new_group(list(range(i, i + sp_size))) for i in range(0, world, sp_size)]
    dp_groups = [dist.new_group(list(range(j, world, sp_size))) for j in range(sp_size)]
    return sp_groups[rank // sp_size], dp_groups[rank % sp_size], rank // sp_size, replicas


def train(rank: int, world: int, args) -> list[float]:
    """The training loop of one rank; returns the loss of each step (mean over replicas)."""
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if cuda else torch.float64)
    group, dp_group, replica, replicas = make_groups(rank, world, args.sp_size or world)

    model = build_model(args).to(device, dtype)
    reference = build_model(args).to(device, dtype)  # the same weights, one process, whole sequence
    hf.apply(model, group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    losses = []
    for step in range(args.steps):
        positions = None
        if args.packed:
            ids, positions = (x.to(device) for x in make_packed_batch(step, replica, args))
        else:
            ids = make_batch(step, replica, args).to(device)
        batch = hf.shard_batch(ids, group=group, pad=args.pad, position_ids=positions)
        out = model(**batch.model_inputs())  # out.loss: this rank's share of the mean loss
        out.loss.backward()
        hf.sync_gradients(model, group)  # SUM over the sequence-parallel group
        if replicas > 1:  # then the usual MEAN over data-parallel replicas
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= replicas
        opt.step()
        opt.zero_grad(set_to_none=True)
        replica_loss = hf.reduce_loss(out.loss, group)
        if step == 0:
            with torch.no_grad():
                expected = one_process_loss(reference, ids, positions)
            # NOTE: transformers computes the loss in float32 whatever the model dtype; the
            # sharded sum differs from the one-process sum by float32 rounding (measured
            # 1.2e-7 relative on the tiny float64 model at 4 ranks), hence 1e-5 and not 1e-9.
            rtol = 1e-5 if dtype in (torch.float64, torch.float32) else 2e-2
            if abs(replica_loss.item() - expected) > rtol * abs(expected):
                raise SystemExit(f"rank {rank}: step 0 loss {replica_loss.item():.8f} != one-process loss {expected:.8f}")
        if replicas > 1:
            dist.all_reduce(replica_loss, group=dp_group)
            replica_loss /= replicas
        losses.append(replica_loss.item())
        if rank == 0 and not args.quiet:
            print(f"step {step:3d}  loss {losses[-1]:.6f}" + ("  (matches one process)" if step == 0 else ""))
    if args.steps > 1 and not losses[-1] < losses[0]:
        raise SystemExit(f"rank {rank}: the loss did not decrease: {losses}")
    return losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spawn", type=int, default=0, help="spawn this many gloo ranks on the CPU (no torchrun)")
    p.add_argument("--sp-size", type=int, default=0, help="ranks per sequence-parallel group (default: all); the groups are data-parallel replicas")
    p.add_argument("--model", choices=tuple(FAMILIES), default="qwen2")
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="sliding window (qwen2: every layer, mistral: every "
        "layer, gemma2/gpt_oss: every other layer); default: none (the family's default for gemma2/gpt_oss)",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batches", type=int, default=1, help="distinct toy batches, cycled")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=37, help="global sequence length (need not divide the ranks)")
    p.add_argument("--pad", action="store_true", help="pad the sequence to a multiple of the ranks instead of uneven shards")
    p.add_argument("--packed", action="store_true", help="one sequence of documents end to end (position ids restart per document)")
    p.add_argument("--vocab", type=int, default=61)
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: heads x head_dim)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--dtype", default=None, help="float64 (CPU default), float32 (GPU default), bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.hidden is None:
        args.hidden = args.heads * args.head_dim
    if args.model in ("llama", "gemma2") and args.hidden % args.heads:
        # Their configs raise on it too, naming neither option.
        p.error(f"--hidden {args.hidden} expected a multiple of --heads {args.heads} for --model {args.model}")
    if args.window is not None and (args.model == "llama" or args.window < 1):
        p.error(f"--window {args.window}: expected a positive window and a family with sliding windows (not llama)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.spawn:
        from ulysses_kernels.testing import run_ranks

        run_ranks(train, args.spawn, args)
        return 0
    # torchrun (or a single plain process: world size 1).
    if "RANK" in os.environ:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        init_file = os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        train(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
