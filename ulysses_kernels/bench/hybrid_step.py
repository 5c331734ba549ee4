"""One training step of a hybrid model (token mixers that are not attention beside attention) in
bf16, ``hf.apply`` over ranks against the same model in one process, both against float64.

    python -m ulysses_kernels.bench.hybrid_step --out-dir bench/results/<date>_<gpu>   # a GPU: bf16, 2 ranks on it
    python -m ulysses_kernels.bench.hybrid_step --device cpu --size tiny --no-write     # the CPU proxy (~30 s)

Per model (``--models``; default ``qwen3.5`` (Gated DeltaNet x2 + gated attention) and ``bamba``
(Mamba2 x2 + attention)), a random model from ``ulysses_kernels.testing.hybrids`` at ``--size``
(``tiny``: the CPU tests' sizes, head dims 8, 13 tokens; ``small``: head dims 64, 999 tokens,
sizes the fast kernels' tiles take), the same weights in three runs:

* reference: one process, float64, the recurrences in float64 sequential forms
  (``testing.hybrids.float64_kernels``), on ``--device``;
* one: one process, ``--dtype``, the model's own kernels, as transformers resolved them:
  flash-linear-attention's ``chunk_gated_delta_rule`` when ``fla`` is importable, mamba_ssm's and
  causal-conv1d's when installed, transformers' torch fallbacks otherwise (``kernels`` in the
  record says which ran, with call counts);
* ranks: ``--world`` ranks (``--transport gloo``: processes sharing the one GPU, NCCL before
  2.30 cannot put two ranks on one; torch's ProcessGroupGloo stages CUDA tensors through pinned
  host memory for all_to_all_single, all_reduce and all_gather, and ``TorchCommunicator`` does
  for the exchanges' grouped send/recv: a batch above 1, several tensors back to sequence
  shards), ``--dtype``, ``hf.apply`` + ``shard_batch`` (uneven shards: 999 tokens are 500 +
  499) + ``sync_gradients`` + ``reduce_loss`` + ``gather_sequence``, the same kernels as "one".

Check, per quantity (the loss, the logits, each parameter's gradient), with ``err(x)`` =
``max|x - reference| / max|reference|``: ``err(ranks) <= 2 err(one) + floor`` (the
flash-attention rule: the sharded step may be at most twice as far from float64 as the same
dtype in one process, plus ``--floor`` for quantities that one process happens to hit almost
exactly). ``ranks_vs_one`` is the direct relative difference. Exit status 1 when a check fails.

``--autotune one`` (default) cuts every Triton autotuner of flash-linear-attention to one config,
its smallest (tiles x stages), so that each kernel compiles once instead of once per config
(~70 configs for the Gated DeltaNet forward and backward) and no config can run out of shared
memory: the config is a speed choice, the arithmetic is the kernel's; ``full`` keeps the
autotuning (a slower first step). No timing here is a performance
claim: the record's ``seconds`` are the wall time of each phase, compilation included.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ulysses_kernels.bench import harness, record
from ulysses_kernels.integrations import hf
from ulysses_kernels.kernels import auto_choice
from ulysses_kernels.testing import run_ranks
from ulysses_kernels.testing.hybrids import MODELS, build, float64_kernels, one_process_step, sharded_step

NAME = "bench_hybrid_step"
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}  # fmt: skip
DEFAULT_MODELS = ("qwen3.5", "bamba")


def default_floor(dtype: torch.dtype) -> float:
    """Relative error a check allows on top of 2x the one-process error: half an ulp of the
    dtype at 1 (bf16: 2^-8 = 3.9e-3). The sharded step rounds once more than one process by
    construction: each rank's share of a gradient (a sum over its tokens) is rounded to the
    dtype before ``sync_gradients`` adds the shares, up to half an ulp of the largest share.
    NOTE: measured (CPU, tiny sizes, bf16): worst gradient 1.22e-2 sharded against 7.2e-3 one
    process (Bamba's down_proj, 1.7x); loss and logits within 1.01x."""
    return torch.finfo(dtype).eps / 2


_SMALL_ATTN = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "max_position_embeddings": 2048}  # fmt: skip
# ``--size small``: per model, what replaces the tiny sizes. GDN: 4 value heads over 2 key heads of
# 64 (flash-linear-attention's tiles want dims >= 16); Mamba2: 4 heads of 64 over 2 groups, state
# 64, chunks of 64 tokens (999 tokens: 16 chunks, the last one partial).
SMALL = {
    "qwen3.5": _SMALL_ATTN | {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 64, "linear_value_head_dim": 64},
    "qwen3-next": _SMALL_ATTN | {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 64, "linear_value_head_dim": 64},
    "bamba": _SMALL_ATTN | {"mamba_n_heads": 4, "mamba_d_head": 64, "mamba_n_groups": 2, "mamba_d_state": 64, "mamba_chunk_size": 64},
}
SEQ = {"tiny": 13, "small": 999}
BATCH = 2
# The module-level kernels the models' forwards (and ``hf.apply``'s mixers) call by name: which
# implementation each one is (fla / mamba_ssm / causal_conv1d / transformers' torch code) and
# how often it ran are recorded.
KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "mamba2_chunk_scan", "mamba_selective_scan", "causal_conv1d_fn")

COLUMNS = [
    ("model", "model", ""),
    ("quantity", "quantity", ""),
    ("err_ranks", "err ranks", ".2e"),
    ("err_one", "err one", ".2e"),
    ("bound", "2*one+floor", ".2e"),
    ("ranks_vs_one", "ranks vs one", ".2e"),
    ("ok", "ok", ""),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list (default {','.join(DEFAULT_MODELS)})")
    p.add_argument("--size", choices=("tiny", "small"), default=None, help="model and sequence sizes (default: small on a GPU, tiny on the CPU)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 999 small, 13 tiny)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="the dtype of the two runs checked (default bfloat16)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when available")
    p.add_argument("--world", type=int, default=2, help="ranks of the sharded run (default 2)")
    p.add_argument("--transport", choices=("gloo", "nccl"), default="gloo", help="torch.distributed backend of the ranks (default gloo)")
    p.add_argument("--floor", type=float, default=None, help="relative error allowed on top of 2x one process's (default: half an ulp of --dtype)")
    p.add_argument(
        "--autotune", choices=("one", "full"), default="one", help="flash-linear-attention's autotuners: their smallest config only (default) or all"
    )
    p.add_argument(
        "--mixer-parallel", choices=("heads", "state", "auto"), default="auto",
        help="how the ranks run the mixers: the head exchange, state passing (docs/state_passing.md) or auto (default)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=300, help="seconds the ranks may take (default 300)")
    harness.add_output(p)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    args.size = args.size or ("small" if args.device == "cuda" else "tiny")
    args.seq = args.seq or SEQ[args.size]
    if args.floor is None:
        args.floor = default_floor(DTYPES[args.dtype])
    return args


def cases(names, size: str) -> list[tuple]:
    """The ``testing.hybrids.MODELS`` rows named ``names``, their configs at ``size``."""
    table = {c[0]: c for c in MODELS}
    out = []
    for name in names:
        if name not in table:
            raise SystemExit(f"hybrid_step: unknown model {name!r}; choices: {', '.join(table)}")
        case = table[name]
        if size == "small":
            if name not in SMALL:
                raise SystemExit(f"hybrid_step: --size small has no sizes for {name!r}; choices: {', '.join(SMALL)} (or --size tiny)")
            case = (*case[:4], case[4] | SMALL[name])
        out.append(case)
    return out


def batch(seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2, seq]`` token ids and labels (a masked prompt on row 0, one masked label on row 1)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (BATCH, seq), generator=g)
    labels = ids.clone()
    labels[0, : max(1, seq // 5)] = -100
    labels[1, seq // 2] = -100
    return ids, labels


# ---- which kernels run --------------------------------------------------------------------------
def kernel_source(fn) -> str:
    """Where the function transformers calls under a kernel's name comes from: the module of the
    implementation its ``use_kernel_func_from_hub_with_fallback`` wrapper chose (``fla.ops...``,
    ``mamba_ssm...``, ``causal_conv1d...``, or the modeling module itself: the torch fallback)."""
    for f in (fn, getattr(fn, "__wrapped__", None)):
        if f is None or not callable(f):
            continue
        try:
            impl = inspect.getclosurevars(f).nonlocals.get("implementation")
        except (TypeError, ValueError):
            impl = None
        if impl is not None:
            return getattr(impl, "__module__", None) or repr(impl)
    return getattr(fn, "__module__", None) or repr(fn)


@contextmanager
def counting_kernels(models):
    """Count the calls of each ``KERNEL_NAMES`` function of the models' modeling modules while
    inside (the forwards and ``hf.apply``'s mixers look them up there at call time); yields
    ``{module.name: {"source", "calls"}}``."""
    seen = {}
    saved = []
    for model in models:
        module = sys.modules[type(model).__module__]
        for name in KERNEL_NAMES:
            fn = getattr(module, name, None)
            key = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
            if fn is None or key in seen:
                continue
            entry = seen[key] = {"source": kernel_source(fn), "calls": 0}

            def spy(*args, _fn=fn, _entry=entry, **kwargs):
                _entry["calls"] += 1
                return _fn(*args, **kwargs)

            saved.append((module, name, fn))
            setattr(module, name, spy)
    try:
        yield seen
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def _footprint(config) -> tuple:
    """How much a Triton config asks of a multiprocessor: the product of its integer block sizes
    times its pipeline stages, then its warps (smallest first)."""
    size = 1
    for value in config.kwargs.values():
        if isinstance(value, int) and not isinstance(value, bool):
            size *= max(value, 1)
    return (size * max(config.num_stages or 1, 1), config.num_warps or 0)


def one_config_autotuners(prefix: str = "fla") -> int:
    """Cut every Triton autotuner in the loaded ``prefix`` modules to one config, its smallest
    (``_footprint``: the one least likely to run out of shared memory or registers on any GPU,
    as a config that does is skipped by autotuning but would fail alone); one compile per kernel,
    no benchmarking. Returns how many were cut; a no-op without Triton."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return 0
    cut = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for obj in list(vars(module).values()):
            for _ in range(4):  # @triton.heuristics wraps the autotuner: follow ``.fn``
                if isinstance(obj, Autotuner):
                    if len(obj.configs) > 1:
                        obj.configs = [min(obj.configs, key=_footprint)]
                        cut += 1
                    break
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
    return cut


# ---- the runs -----------------------------------------------------------------------------------
def _to_cpu(result) -> tuple:
    loss, grads, logits = result
    return loss.detach().double().cpu(), {n: g.detach().double().cpu() for n, g in grads.items()}, logits.double().cpu()


def one_process(case, ids, labels, dtype, device, autotune: str) -> tuple[tuple, tuple, dict, dict]:
    """The float64 reference and the one-process step in ``dtype``: ``(reference, one, kernels of
    one, seconds)``, on the CPU in float64 (``_to_cpu``)."""
    ids, labels = ids.to(device), labels.to(device)
    seconds = {}
    t = time.perf_counter()
    with float64_kernels():
        ref = _to_cpu(one_process_step(build(case).to(device), ids, labels))
    seconds["reference"] = time.perf_counter() - t
    model = build(case).to(device=device, dtype=dtype)
    if autotune == "one":
        one_config_autotuners()
    t = time.perf_counter()
    with counting_kernels([model]) as kernels:
        one = _to_cpu(one_process_step(model, ids, labels))
    seconds["one"] = time.perf_counter() - t
    return ref, one, kernels, seconds


def _rank_job(rank, world, names, size, seq, dtype, device_type, autotune, out_path, mixer_parallel="auto"):
    """On each rank: every model under ``hf.apply`` on the world group, one sharded step; rank 0
    saves ``{model: (result, kernels, seconds)}`` to ``out_path``."""
    device = torch.device("cpu")
    if device_type == "cuda":
        if dist.get_backend() != "nccl":
            torch.cuda.set_device(0)  # gloo ranks share the one GPU (run_ranks places NCCL ranks itself)
        device = torch.device("cuda", torch.cuda.current_device())
    results = {}
    for case in cases(names, size):
        ids, labels = batch(seq, case[4]["vocab_size"])
        model = hf.apply(build(case).to(device=device, dtype=dtype), mixer_parallel=mixer_parallel)
        if autotune == "one":
            one_config_autotuners()
        t = time.perf_counter()
        with counting_kernels([model]) as kernels:
            got = sharded_step(model, hf.shard_batch(ids.to(device), labels.to(device)), None)
        results[case[0]] = (_to_cpu(got), kernels, time.perf_counter() - t)
    if rank == 0:
        torch.save(results, out_path)


class _Background:
    """``fn(*args, **kwargs)`` on a thread, started now; ``join()`` waits and re-raises its error."""

    def __init__(self, fn, *args, **kwargs):
        self.error, self.seconds = None, None
        start = time.perf_counter()

        def run():
            try:
                fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised by join() in the caller's thread
                self.error = e
            self.seconds = time.perf_counter() - start

        self.thread = threading.Thread(target=run, name="hybrid_step ranks", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check(model: str, ref, one, ranks, floor: float) -> list[dict]:
    """One row per quantity (loss, logits, each gradient): the errors of ``one`` and ``ranks``
    (each ``(loss, {name: grad}, logits)``) against ``ref``, the bound, ``ranks_vs_one``, ok."""
    pairs = [("loss", ref[0], one[0], ranks[0]), ("logits", ref[2], one[2], ranks[2])]
    missing = sorted(set(ref[1]) ^ set(ranks[1]))
    if missing:
        raise RuntimeError(f"hybrid_step: {model}: gradients present in one run only: {', '.join(missing)}")
    pairs += [(f"grad {n}", ref[1][n], one[1][n], ranks[1][n]) for n in ref[1]]
    rows = []
    for what, r, o, s in pairs:
        err_one, err_ranks = _rel(o, r), _rel(s, r)
        bound = 2 * err_one + floor
        rows.append({"model": model, "quantity": what, "err_ranks": err_ranks, "err_one": err_one, "bound": bound,
                     "ranks_vs_one": _rel(s, o), "ok": err_ranks <= bound})  # fmt: skip
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per model: the loss row, the logits row and the gradient row closest to its bound."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        grads = [r for r in mine if r["quantity"].startswith("grad ")]
        worst = max(grads, key=lambda r: r["err_ranks"] / r["bound"])
        out += [mine[0], mine[1], {**worst, "quantity": f"worst of {len(grads)} grads: {worst['quantity'][5:]}"}]
        if not all(r["ok"] for r in grads):
            out += [r for r in grads if not r["ok"] and r is not worst]
    return out


def _versions() -> dict:
    found = {}
    for name in ("transformers", "huggingface_hub", "fla", "einops", "triton", "mamba_ssm", "causal_conv1d"):
        module = sys.modules.get(name)
        found[name] = getattr(module, "__version__", "present") if module is not None else None
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype, device = DTYPES[args.dtype], torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    chosen = cases(args.models, args.size)
    with tempfile.TemporaryDirectory(prefix="ulysses_hybrid_step_") as tmp:
        out_path = os.path.join(tmp, "ranks.pt")
        # The ranks start first and run beside this process's two runs: their kernels are other
        # specializations (a rank's head counts), so neither waits for the other's compilation.
        ranks_run = _Background(run_ranks, _rank_job, args.world, args.models, args.size, args.seq, dtype, args.device, args.autotune,
                                out_path, args.mixer_parallel, transport=args.transport, timeout_s=args.timeout)  # fmt: skip
        t0 = time.perf_counter()
        try:
            per_model = {}
            for case in chosen:
                ids, labels = batch(args.seq, case[4]["vocab_size"])
                per_model[case[0]] = one_process(case, ids, labels, dtype, device, args.autotune)
            t_one = time.perf_counter() - t0
        finally:
            ranks_run.join()
        t_ranks = ranks_run.seconds
        ranks = torch.load(out_path, weights_only=False)
    rows, meta_models = [], {}
    for case in chosen:
        name = case[0]
        ref, one, kernels_one, seconds = per_model[name]
        got, kernels_ranks, seconds_ranks = ranks[name]
        rows += check(name, ref, one, got, args.floor)
        meta_models[name] = {
            "config": dict(case[4]),
            "kernels_one": kernels_one,
            "kernels_ranks_rank0": kernels_ranks,
            "seconds": {**seconds, "ranks_step_rank0": seconds_ranks},
        }
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else record.CPU_LABEL
    title = (f"# hybrid step on {where}: {args.dtype}, {args.world} {args.transport} ranks (mixers: {args.mixer_parallel}) vs one process, "
             "both vs float64; "
             f"{args.size} sizes, batch {BATCH} x {args.seq} tokens, floor {args.floor:g}")  # fmt: skip
    record.print_table(COLUMNS, summary(rows), title=title)
    found = ", ".join(f"{k} {v}" for k, v in _versions().items() if v is not None)
    print(f"# torch {torch.__version__} (CUDA {torch.version.cuda}), {found}; attention kernels: {auto_choice(device)[0].name}", flush=True)
    for name, meta in meta_models.items():
        ran = ", ".join(f"{k} -> {v['source']} ({v['calls']} calls one, {meta['kernels_ranks_rank0'].get(k, {}).get('calls', 0)} rank 0)"
                        for k, v in meta["kernels_one"].items())  # fmt: skip
        print(f"# {name} kernels: {ran}", flush=True)
    bad = [r for r in rows if not r["ok"]]
    print(f"# {len(rows) - len(bad)} of {len(rows)} checks within 2x one process + floor: {'OK' if not bad else 'FAILED'} (one-process "
          f"runs {t_one:.1f} s beside the ranks' {t_ranks:.1f} s, wall, start-up and compilation included: not a timing claim)", flush=True)  # fmt: skip
    if not args.no_write:
        env = record.env_record(device, args.world, args.transport, dtype=args.dtype, size=args.size, seq=args.seq, batch=BATCH,
                                packages=_versions(), autotune=args.autotune, attention_kernels=auto_choice(device)[0].name,
                                mixer_parallel=args.mixer_parallel)  # fmt: skip
        meta = {"floor": args.floor, "rule": "err_ranks <= 2 * err_one + floor; err = max|x - ref| / max|ref|, ref: one process float64",
                "models": meta_models, "seconds": {"one_process_all_models": t_one, "ranks_wall": t_ranks}, "failed": len(bad)}  # fmt: skip
        paths = record.write_results(args.out_dir, NAME, env, rows, meta)
        print(f"# wrote {', '.join(paths.values())}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
