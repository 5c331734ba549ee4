"""Step time and memory of the long-context pieces, each on and off.

    python -m ulysses_kernels.bench.longctx                                   # CPU: 2 gloo ranks, a tiny Llama
    python -m ulysses_kernels.bench.longctx --spawn 4 --seqs 4K,16K
    torchrun --nproc-per-node 8 -m ulysses_kernels.bench.longctx --hidden 2048 --layers 16 --heads 32 --kv-heads 8 \\
        --intermediate 8192 --vocab 128256 --seqs 64K,256K -d bf16                   # GPU

A Llama of the given sizes (random weights, activation checkpointing, SDPA) through
``hf.apply(model, world, ...)``; for each global sequence length (``--seqs``) one training
step, ``model(**shard_batch(...).model_inputs())`` and ``out.loss.backward()`` inside one
``GraphExecGroup``, with no piece, each piece alone (``loss``: tiled_loss, ``mlp``:
tiled_mlp, ``norms``: tiled_norms, ``offload``: offload_activations) and all four.

Columns: ``step ms`` (median of ``-n`` steps after ``-w``, the slowest rank's), ``x_none``
(step time over the row without pieces: the cost of the memory), ``peak MB`` measured (CUDA:
``max_memory_allocated`` above what was allocated before the step; CPU: ``traffic.LiveBytes``
on one more, untimed step, parameter gradients forgotten once accumulated as an engine
frees them), ``calc MB`` (the calculator's replay, ``memory_step``, for this rank),
``B/token`` (peak / global tokens), ``host MB`` (the offload's host bytes at its peak) and
``#wrong``: elements of the loss and parameter gradients (reduced over the group) that
differ from the row without pieces by more than ``1e-4`` (float32; ``5e-2`` in half
precision) times the largest of them. CPU timings are a code-path check, not a claim.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

from .. import longctx, memory
from ..memory_step import step_memory
from ..traffic import LiveBytes
from . import harness, record, sizes, timing
from .longctx_emulated import PIECES, run

COLUMNS = [
    ("seq", "seq", "d"), ("pieces", "pieces", "s"), ("step_ms", "step ms", ".2f"), ("x_none", "x_none", ".2f"),
    ("peak_mb", "peak MB", ".2f"), ("calc_mb", "calc MB", ".2f"), ("bytes_per_token", "B/token", ".0f"),
    ("host_mb", "host MB", ".2f"), ("wrong", "#wrong", "d"),
]  # fmt: skip


def build_model(args, device, dtype):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=1 << 24,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def _kwargs(name: str, tile: int | None) -> dict:
    kw = {k: (tile or True) if k.startswith("tiled") else longctx.ActivationOffload() for k in PIECES[name]}
    return {"tiled_loss": False, "tiled_mlp": False, "tiled_norms": False, "offload_activations": False, **kw}


def _step(model, batch):
    out = model(**batch.model_inputs())
    with torch.utils.checkpoint.GraphExecGroup():
        out.loss.backward()
    return out.loss.detach()


def _measured_peak(model, batch, device) -> tuple[int, int]:
    """(peak device bytes of one step, offload host peak) on this rank."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(model, batch)
        torch.cuda.synchronize(device)
        state = longctx.state(model)
        host = state.offload.stats()["host_peak"] if state is not None and state.offload is not None else 0
        return torch.cuda.max_memory_allocated(device) - before, host
    tracker = LiveBytes(host_sites=("offload._host_copy",))
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.forget(p.grad)) for p in model.parameters()]
    try:
        with tracker:
            _step(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return tracker.peak, tracker.host_peak


def _grads(model, loss) -> list[torch.Tensor]:
    flat = [loss.reshape(1).float()] + [p.grad.reshape(-1).float() for p in model.parameters() if p.grad is not None]
    out = torch.cat(flat)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
    return out


def bench(args, rank, world, device, transport):
    from ..integrations import hf

    dtype = sizes.parse_dtype(args.dtype)
    half = dtype in (torch.float16, torch.bfloat16)
    rows = []
    for seq in [sizes.parse_size(s) for s in args.seqs.split(",")]:
        ids = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(args.seed + seq)).to(device)
        reference, base_ms = None, None
        for name in args.pieces.split(","):
            if name not in PIECES:
                raise SystemExit(f"bench.longctx: --pieces expected a comma list of {', '.join(PIECES)}, got {name!r}")
            model = hf.apply(build_model(args, device, dtype), None, **_kwargs(name, args.tile))
            batch = hf.shard_batch(ids, group=None)
            model.zero_grad(set_to_none=True)
            flat = _grads(model, _step(model, batch))
            if reference is None:
                reference = flat
            bad = (flat - reference).abs() > (5e-2 if half else 1e-4) * reference.abs().max()
            wrong = int(bad.sum()) if name != "none" else 0
            times = timing.time_iters(lambda m=model, b=batch: (m.zero_grad(set_to_none=True), _step(m, b)), device=device,
                                      warmup=args.warmup, iters=args.iters)  # fmt: skip
            ms = timing.reduce_max(timing.median(times)) * 1e3
            base_ms = ms if name == "none" else base_ms
            peak, host = _measured_peak(model, batch, device)
            peak, host = int(timing.reduce_max(peak)), int(timing.reduce_max(host))
            setup = memory.Setup(
                layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate,
                vocab=args.vocab, seq=seq, sp=world, dtype=str(dtype).removeprefix("torch."), checkpointing=True,
                tiled_loss="tiled_loss" in PIECES[name], tiled_mlp="tiled_mlp" in PIECES[name], tiled_norms="tiled_norms" in PIECES[name],
                offload_activations="offload_activations" in PIECES[name], loss_tile_rows=args.tile, mlp_tile_rows=args.tile,
                norm_tile_rows=args.tile, flash_workspace=device.type == "cuda" and half,
            )  # fmt: skip
            calc = max(step_memory(setup, r).peak for r in range(world))
            rows.append({
                "seq": seq, "pieces": name, "step_ms": ms, "x_none": ms / base_ms if base_ms else None, "peak_mb": peak / 1e6,
                "calc_mb": calc / 1e6, "bytes_per_token": peak / seq, "host_mb": host / 1e6, "wrong": wrong,
            })  # fmt: skip
            if rank == 0 and not args.no_progress:
                print(f"# seq {seq} {name}: {ms:.2f} ms, peak {peak / 1e6:.2f} MB (calculator {calc / 1e6:.2f})", file=sys.stderr, flush=True)
            del model, batch
    if rank == 0:
        record.print_table(COLUMNS, rows, title=f"# long-context pieces, {world} ranks, {sizes.dtype_name(dtype)}, {record.kernel_label('sdpa', device)}")

    def env_fn():
        return record.env_record(device, world, transport, dtype=sizes.dtype_name(dtype))

    harness.finish(args, rank, "bench_longctx", env_fn, rows, vars(args), lambda *a: False, rows)


def parse_args(argv=None, default_out_dir=None):
    cpu = not torch.cuda.is_available()
    p = harness.parser(__doc__)
    harness.add_spawn(p, 2 if cpu else 0, "gloo ranks to spawn on the CPU (default 2 without a GPU; 0: this torchrun)")
    p.add_argument("--seqs", default="1K,4K" if cpu else "64K,256K", help="global sequence lengths")
    p.add_argument("--pieces", default=",".join(PIECES), help=f"comma list of {', '.join(PIECES)} (the first row should be none)")
    p.add_argument("--hidden", type=int, default=64 if cpu else 2048)
    p.add_argument("--layers", default=None, help="layers (default 3, GPU 16); with --emulate-rank0-of a comma list (default 2,4, CPU 2,3)")
    p.add_argument("--heads", type=int, default=8 if cpu else 32)
    p.add_argument("--kv-heads", type=int, default=4 if cpu else 8)
    p.add_argument("--intermediate", type=int, default=160 if cpu else 8192)
    p.add_argument("--vocab", type=int, default=256 if cpu else 128256)
    p.add_argument("--tile", type=int, default=None, help="rows per tile for every tiled piece (default: each piece's own)")
    p.add_argument("--dtype", "-d", default="fp32" if cpu else "bf16")
    p.add_argument("-w", "--warmup", type=int, default=1 if cpu else 2)
    p.add_argument("-n", "--iters", type=int, default=3 if cpu else 5)
    p.add_argument("--seed", type=int, default=0)
    harness.add_output(p, default_out_dir)
    p.add_argument("--no-progress", action="store_true")
    e = p.add_argument_group("rank 0 of an N-way group in one process (ulysses_kernels/bench/longctx_emulated/; docs/longctx.md)")
    e.add_argument("--emulate-rank0-of", type=int, default=None, metavar="N", help="run rank 0 of an N-way group here (no spawn, no torchrun)")
    e.add_argument(
        "--model", default=None, help="comma list of llama3-8b, qwen2.5-14b, tiny, tiny-qwen2, each optionally @sp (default: tiny on the CPU, llama3-8b)"
    )
    e.add_argument("--time-seq", default=None, help="the length of the timed rows (default: the first of --seqs)")
    e.add_argument("--proxy-block", type=int, default=64 if cpu else 4096, help="tokens per block of the proxy attention")
    e.add_argument("--max-seq", action="store_true", help="probe the longest sequence under --gpu-gb")
    e.add_argument("--gpu-gb", type=float, default=80.0, help="memory per GPU for --max-seq (GB, 1e9 bytes)")
    e.add_argument("--max-probes", type=int, default=4)
    e.add_argument("--max-seq-step", type=float, default=0.1, help="first step of the search, a fraction of the length")
    e.add_argument("--ablation", action="store_true", help="each piece alone at the timed length (first model)")
    e.add_argument("--time-budget", type=float, default=None, help="seconds for all rows: later rows that would not fit are skipped")
    e.add_argument("--assume-tflops", type=float, default=None, help="the first guess of the executed TFLOP/s for the estimates (default 250 on CUDA)")
    e.add_argument("--dry-run", action="store_true", help="print the planned rows and their estimates, run nothing")
    args = p.parse_args(argv)
    if args.emulate_rank0_of is None:
        args.layers = int(args.layers or (3 if cpu else 16))
    else:
        if args.emulate_rank0_of < 1:
            p.error(f"--emulate-rank0-of expected a group size >= 1, got {args.emulate_rank0_of}")
        args.layers = args.layers or ("2,3" if cpu else "2,4")
        args.model = args.model or ("tiny" if cpu else "llama3-8b")
        if "--seqs" not in " ".join(argv if argv is not None else sys.argv):
            args.seqs = "1K,2K" if cpu else "256K,1M,2M,4M"
    return args


def main(argv=None, *, default_out_dir=None) -> int:
    args = parse_args(argv, default_out_dir)
    if args.emulate_rank0_of is not None:
        return run(args)
    with contextlib.suppress(KeyboardInterrupt):
        return harness.launch(bench, args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
