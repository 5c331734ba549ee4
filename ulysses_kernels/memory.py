"""Per-GPU memory of a training setup with Ulysses sequence parallelism (an estimate by formula).

    python -m ulysses_kernels.memory --layers 96 --hidden 12288 --heads 96 --vocab 50257 \\
        --mlp plain --seq 32768 --sp 8 --zero 3 --offload-optimizer --checkpointing
    python -m ulysses_kernels.memory ... --json        # the same numbers for a program
    python -m ulysses_kernels.memory ... --tiled-loss --tiled-mlp --tiled-norms --offload-activations \\
        --max-seq --gpu-gb 80                          # the longest sequence that fits 80 GB

The model is a decoder of ``layers`` identical layers as transformers writes Llama, Qwen2 and
Qwen3 (``--qk-norm``) (RMSNorm, RoPE, attention through ``hf.apply``, a gated MLP;
``--mlp plain`` for a GPT-style ``fc -> activation -> fc``, its norms still counted as
RMSNorms), trained with ZeRO stage 0-3 over the ``dp x sp`` ranks and mixed-precision Adam
(a float32 master copy and two moments; no master copy in float32).

Rows: parameters, gradients and optimizer state (ZeRO's arithmetic), under ZeRO-3 the
largest module the engine gathers at once, and the activations of one training step,
replayed tensor by tensor (``memory_step``: the forward's and backward's allocations and
frees in order, with activation checkpointing and the long-context pieces of
``ulysses_kernels.longctx``): what the forward leaves for the backward, and the step's peak
above it. The host column has the offloaded optimizer (and parameters) and, with
``--offload-activations``, the checkpointed layer inputs. The replay is measured against a
live-bytes tracker for tiny Llama, Qwen2 and Qwen3 models on 2 and 4 gloo ranks
(``tests/test_longctx_memory.py``: within 2%, exact in practice).

A hybrid (``--mixer qwen3.5`` or ``--mixer config.json``): its mixer layers (Gated DeltaNet,
Kimi Delta Attention, Bamba's, Nemotron-H's and Falcon-H1's Mamba2, Jamba's Mamba1, LFM2's short convolution) replayed as
``hf.apply`` runs them (``memory_step.mixer``; docs/longctx.md, "Hybrid models in
the calculator"; measured per layer by tests/test_memory_hybrid.py), through the head exchange
or, ``--mixer-parallel state``, with the sequence kept sharded (docs/state_passing.md).

``activation_bytes`` (the forward alone, as docs/scaling.md's older figures were made) is
kept: ``saved`` and ``peak_forward`` per layer type, measured by tests/test_memory_calculator.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace

from .checks import UlyssesInputError
from .layout import QKV, Layout, split_lengths
from .memory_step import StepMemory, rank_key, step_memory
from .memory_step.mixer import PARALLEL as MIXER_PARALLEL
from .memory_step.mixer import PRESETS as MIXER_PRESETS
from .memory_step.mixer import Mixer
from .plan import HeadPlan

__all__ = [
    "MemoryInputError", "Setup", "parameter_count", "activation_bytes", "state_bytes", "worst_activations", "worst_step", "memory_rows",
    "max_seq", "main", "Mixer",
]  # fmt: skip

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9


class MemoryInputError(UlyssesInputError):
    """A training setup the memory calculator cannot describe."""


@dataclass(frozen=True)
class Setup:
    """One training setup. ``seq``: tokens of one sequence (split over ``sp`` ranks);
    ``batch``: sequences per replica per step; ``dp x sp`` ranks form ZeRO's group."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    head_dim: int | None = None
    intermediate: int | None = None  # default: 4 x hidden (plain), 8/3 x hidden rounded up to 256 (gated)
    mlp: str = "gated"
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    batch: int = 1
    sp: int = 1
    dp: int = 1
    zero: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    dtype: str = "bfloat16"
    checkpointing: bool = False
    tie_embeddings: bool = True
    # The long-context pieces (ulysses_kernels.longctx); tile rows None: their defaults.
    tiled_loss: bool = False
    tiled_mlp: bool = False
    tiled_norms: bool = False
    offload_activations: bool = False
    loss_tile_rows: int | None = None
    mlp_tile_rows: int | None = None
    norm_tile_rows: int | None = None
    # flash-attn's backward workspace (a float32 dq accumulator [B, S, hq, D] and the float32
    # [B, hq, S] softmax_d, beside dq, dk, dv): read from flash-attn's mha_bwd, not measured.
    flash_workspace: bool = False
    # longctx.HeadChunkedAttention: the attention backward's kernel per this many query heads
    attention_head_chunk: int | None = None
    # A hybrid's mixer layers (memory_step.mixer); None: every layer is attention
    mixer: Mixer | None = None

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "vocab", "seq", "batch", "sp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MemoryInputError(f"memory: {name} expected a positive int, got {value!r}")
        for name in ("kv_heads", "head_dim", "intermediate", "loss_tile_rows", "mlp_tile_rows", "norm_tile_rows", "attention_head_chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise MemoryInputError(f"memory: {name} expected a positive int or None, got {value!r}")
        if self.head_dim is None and self.hidden % self.heads:
            raise MemoryInputError(f"memory: hidden ({self.hidden}) expected a multiple of heads ({self.heads}), or give head_dim")
        if self.heads % self.kv_count:
            raise MemoryInputError(f"memory: heads ({self.heads}) expected a multiple of kv_heads ({self.kv_count})")
        if self.sp > self.heads:
            raise MemoryInputError(f"memory: sp ({self.sp}) expected at most heads ({self.heads}): Ulysses needs a query head per rank")
        if self.seq < self.sp:
            raise MemoryInputError(f"memory: seq ({self.seq}) expected at least sp ({self.sp}) tokens")
        if self.mlp not in ("gated", "plain"):
            raise MemoryInputError(f"memory: mlp expected 'gated' or 'plain', got {self.mlp!r}")
        if self.zero not in (0, 1, 2, 3):
            raise MemoryInputError(f"memory: zero expected a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if self.dtype not in DTYPE_BYTES:
            raise MemoryInputError(f"memory: dtype expected one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.offload_param and self.zero != 3:
            raise MemoryInputError(f"memory: offload_param expected ZeRO stage 3, got stage {self.zero}")
        if self.offload_optimizer and self.zero == 0:
            raise MemoryInputError("memory: offload_optimizer expected ZeRO stage 1, 2 or 3, got stage 0")
        if isinstance(self.mixer, dict):  # as the JSON writes it
            lt = self.mixer.get("layer_types")
            object.__setattr__(self, "mixer", Mixer(**{**self.mixer, "layer_types": None if lt is None else tuple(lt)}))
        if self.mixer is not None:
            if not isinstance(self.mixer, Mixer):
                raise MemoryInputError(f"memory: mixer expected a memory_step.mixer.Mixer or None, got {type(self.mixer).__name__}")
            self.mixer.check_setup(self)
            if self.sp > self.mixer.heads and self.mixer.strategy(self.sp) == "heads":
                raise MemoryInputError(
                    f"memory: sp ({self.sp}) expected at most the mixer's heads ({self.mixer.heads}): the head exchange splits its heads "
                    "(mixer parallel 'state' keeps the sequence sharded)"
                )
        if self.offload_activations and not self.checkpointing:
            raise MemoryInputError("memory: offload_activations expected checkpointing (it offloads the inputs checkpointing keeps)")

    @property
    def kv_count(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def dim(self) -> int:
        return self.hidden // self.heads if self.head_dim is None else self.head_dim

    @property
    def ffn(self) -> int:
        if self.intermediate is not None:
            return self.intermediate
        return 4 * self.hidden if self.mlp == "plain" else -(-8 * self.hidden // 3 // 256) * 256

    @property
    def element_size(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def layout(self, rank: int) -> Layout:
        """The Ulysses exchange of one attention layer as ``rank`` of the sequence group sees it."""
        return Layout(HeadPlan.build(self.heads, self.kv_count, self.sp), rank, tuple(split_lengths(self.seq, self.sp)), self.batch, self.dim)


def parameter_count(setup: Setup) -> tuple[int, int]:
    """``(whole model, one layer)`` parameters: attention (no biases), MLP, two norms per
    layer, the embedding (twice when untied) and the final norm."""
    h, d = setup.hidden, setup.dim
    attention = h * setup.heads * d * 2 + h * setup.kv_count * d * 2
    mlp = (3 if setup.mlp == "gated" else 2) * h * setup.ffn
    layer = attention + mlp + 2 * h
    embeddings = setup.vocab * h * (1 if setup.tie_embeddings else 2)
    if setup.mixer is not None:  # a hybrid: its mixer layers in place of attention (memory_step.mixer)
        per = [setup.mixer.layer_parameters(i, h, attention, mlp) for i in range(setup.layers)]
        return sum(per) + embeddings + h, max(per)
    return setup.layers * layer + embeddings + h, layer


def _norm_saved(setup: Setup, tokens: int) -> int:
    """Bytes an RMSNorm keeps: its normalized input and its output in the model's dtype,
    and (transformers upcasts) a float32 copy of its input when the dtype is not float32."""
    e, h = setup.element_size, setup.hidden
    return tokens * h * (2 * e + (4 if e != 4 else 0))


def _attention_state(setup: Setup, rank: int) -> int:
    """Bytes of the Ulysses op's attention state: the q/k/v receive buffer and the attention output."""
    lay = setup.layout(rank)
    e, hq = setup.element_size, lay.head_count("q", rank)
    return sum(lay.s2h_recv_splits(QKV)) * e + hq * setup.batch * lay.seq_total * setup.dim * e


def activation_bytes(setup: Setup, rank: int = 0) -> dict[str, int]:
    """Forward activation bytes on ``rank`` of the sequence group (see the module docstring):
    ``saved`` (alive when the forward ends), ``peak_forward``, ``per_layer`` (what one layer
    keeps) and ``layer_working_set`` (one layer's forward without checkpointing: what the
    recompute of one layer allocates in the backward)."""
    e, b, h, f, d = setup.element_size, setup.batch, setup.hidden, setup.ffn, setup.dim
    lay = setup.layout(rank)
    tokens = b * lay.seq_local
    wide = max(e, 4)  # the float32 (float64) logsumexp and loss
    # The residual stream (embedding output, each residual sum) is kept only in float32: in
    # other dtypes the RMSNorm after it keeps its float32 copy instead (``_norm_saved``).
    stream = tokens * h * e if e == 4 else 0
    lse = wide * b * lay.head_count("q", rank) * lay.seq_total
    gathered = tokens * setup.heads * d * e if setup.sp > 1 else 0  # the o_proj input (at sp 1: the attention output itself)
    attention = _attention_state(setup, rank) + lse + gathered
    mlp = (4 if setup.mlp == "gated" else 2) * tokens * f * e
    full_layer = 2 * _norm_saved(setup, tokens) + attention + 2 * stream + mlp
    # The last layer's output (in float32; under checkpointing the embedding output is
    # layer 0's input), the final norm, RoPE's cos and sin.
    head = stream + _norm_saved(setup, tokens) + 2 * tokens * d * e
    loss = tokens * setup.vocab * wide  # log_softmax (kept), and the logits (or their float32 copy) beside it
    if setup.checkpointing:
        per_layer = tokens * h * e
        body = setup.layers * per_layer
        # The last layer's MLP, before its output and the final norm exist (``head`` less
        # both): the residual sum, the norm's output and gate, up, act(gate) (plain: fc, act(fc)).
        working = tokens * e * (2 * h + (3 if setup.mlp == "gated" else 2) * f)
        peak = max(head - _norm_saved(setup, tokens) - stream + body + working, head + body + 2 * loss)
    else:
        per_layer = full_layer
        body = setup.layers * per_layer
        peak = head + body + 2 * loss
    return {"saved": head + body + loss, "peak_forward": peak, "per_layer": per_layer, "layer_working_set": full_layer}


@dataclass(frozen=True)
class Row:
    """One line of the table: ``gpu`` bytes per GPU, ``host`` bytes per rank in CPU memory."""

    item: str
    formula: str
    gpu: int
    host: int = 0


def _state_rows(setup: Setup) -> list[Row]:
    """Parameters, gradients and optimizer state under ZeRO over the ``dp x sp`` ranks."""
    p, layer = parameter_count(setup)
    e, n = setup.element_size, setup.dp * setup.sp
    master = 4 if e != 4 else 0  # the float32 master copy of mixed precision
    opt = (master + 8) * p // (n if setup.zero >= 1 else 1)
    params = e * p // (n if setup.zero == 3 else 1)
    rows = [
        Row("parameters", f"{e} P" + (f" / {n}" if setup.zero == 3 else "") + (" (offloaded)" if setup.offload_param else ""),
            0 if setup.offload_param else params, params if setup.offload_param else 0),
        Row("gradients", f"{e} P" + (f" / {n}" if setup.zero >= 2 else ""), e * p // (n if setup.zero >= 2 else 1)),
        Row("optimizer (fp32 master, Adam m, v)" if master else "optimizer (Adam m, v)",
            f"{master + 8} P" + (f" / {n}" if setup.zero >= 1 else "") + (" (offloaded)" if setup.offload_optimizer else ""),
            0 if setup.offload_optimizer else opt, opt if setup.offload_optimizer else 0),
    ]  # fmt: skip
    if setup.zero == 3:
        # The module whose parameters the engine gathers at once: a layer, or the LM head
        # (or embedding) when it is larger (Llama-3-8B: 0.53e9 against a layer's 0.22e9).
        head = setup.vocab * setup.hidden
        what, big = ("one layer", layer) if layer >= head else ("the LM head", head)
        rows.append(Row(f"{what} gathered (parameters, its gradients)", f"2 x {e} x {big:.3g}", 2 * e * big))
    return rows


def state_bytes(setup: Setup) -> int:
    """Bytes per GPU of parameters, gradients, optimizer state and (ZeRO-3) the gathered module:
    the rows of ``memory_rows`` before the activations (they do not depend on the sequence)."""
    return sum(r.gpu for r in _state_rows(setup))


def worst_activations(setup: Setup) -> dict[str, int]:
    """``activation_bytes`` of the sequence rank with the highest forward peak."""
    return max((activation_bytes(setup, r) for r in range(setup.sp)), key=lambda a: a["peak_forward"])


def worst_step(setup: Setup) -> StepMemory:
    """``memory_step.step_memory`` of the sequence rank with the highest step peak (ranks with
    the same sizes, the usual case, are replayed once)."""
    seen: dict[tuple, StepMemory] = {}
    for r in range(setup.sp):
        key = rank_key(setup, r)
        if key not in seen:
            seen[key] = step_memory(setup, r)
    return max(seen.values(), key=lambda m: m.peak)


def memory_rows(setup: Setup) -> list[Row]:
    """The table for the sequence rank that needs the most (ranks differ only with uneven heads or shards).

    The activation rows are one training step replayed tensor by tensor (``memory_step``):
    what the forward leaves for the backward, and the step's peak above it; their sum is the
    step's activation peak, measured within 2% (tests/test_longctx_memory.py)."""
    step = worst_step(setup)
    pieces = [n for n, on in (("tiled loss", setup.tiled_loss), ("tiled MLP", setup.tiled_mlp), ("tiled norms", setup.tiled_norms),
                              ("offloaded inputs", setup.offload_activations)) if on]  # fmt: skip
    kept = "layer inputs" if setup.checkpointing else "saved by every layer"
    if setup.mixer is not None:
        kept += f"; {sum(setup.mixer.is_mixer(i) for i in range(setup.layers))} of {setup.layers} layers {setup.mixer.kind}"
    rows = _state_rows(setup) + [
        Row(f"activations kept for the backward ({kept})", "forward end (memory_step)" + (f"; {', '.join(pieces)}" if pieces else ""),
            step.forward_end, step.host_peak),
        Row(f"step peak above them (at {step.moment})", "step peak - forward end (memory_step)", step.peak - step.forward_end),
    ]  # fmt: skip
    return rows


def total_gpu(setup: Setup) -> int:
    """Bytes per GPU: the sum of ``memory_rows``."""
    return sum(r.gpu for r in memory_rows(setup))


def max_seq(setup: Setup, gpu_bytes: float, host_bytes: float | None = None) -> int:
    """The longest sequence (a multiple of ``sp`` tokens) whose rows fit ``gpu_bytes`` per GPU
    (and ``host_bytes`` of host memory per rank, if given); 0 when not even ``sp`` tokens fit.
    ``setup.seq`` is ignored.

    Each probe replays a whole step, and the bytes grow about linearly with the sequence, so
    the search interpolates where the room left crosses zero (``_last_fit``): the GPU's bound
    first, then, where the host's does not hold there, the host's below it. About ten replays
    per bound instead of forty for a doubling and bisection, with the same answer."""
    step = setup.sp
    probed: dict[int, tuple[int, int]] = {}

    def used(k: int) -> tuple[int, int]:
        if k not in probed:
            rows = memory_rows(replace(setup, seq=k * step))
            probed[k] = (sum(r.gpu for r in rows), sum(r.host for r in rows))
        return probed[k]

    if used(1)[0] > gpu_bytes or (host_bytes is not None and used(1)[1] > host_bytes):
        return 0
    k = _last_fit(lambda k: gpu_bytes - used(k)[0], None)
    if host_bytes is not None and used(k)[1] > host_bytes:
        k = _last_fit(lambda k: host_bytes - used(k)[1], k)
    return k * step


def _last_fit(room, bound: int | None) -> int:
    """The largest ``k >= 1`` with ``room(k) >= 0``, for a ``room`` that falls as ``k`` grows
    (about linearly) and ``room(1) >= 0``; ``bound``: a ``k`` known not to fit, if any."""
    first = lo_room = room(1)
    lo = 1
    if bound is None:  # grow past the answer: twice the linear guess from k = 1, at least doubling
        hi, hi_room = 2, room(2)
        while hi_room >= 0:
            lo, lo_room = hi, hi_room
            per_k = (first - hi_room) / (hi - 1)
            hi = max(2 * hi, int(2 * (hi + hi_room / per_k)) if per_k > 0 else 0)
            if hi > 1 << 40:
                raise MemoryInputError("memory: max_seq found no bound below 2^40 tokens per rank")
            hi_room = room(hi)
    else:
        hi, hi_room = bound, room(bound)
    while hi - lo > 1:  # room(lo) >= 0 > room(hi): probe the interpolated crossing and its neighbour
        width = hi - lo
        guess = lo + int(width * lo_room / (lo_room - hi_room))
        for k in (guess, guess + 1):
            if lo < k < hi:
                r = room(k)
                lo, lo_room, hi, hi_room = (k, r, hi, hi_room) if r >= 0 else (lo, lo_room, k, r)
        if hi - lo > max(1, width // 2):  # the guess did not halve the bracket: bisect once
            mid = (lo + hi) // 2
            r = room(mid)
            lo, lo_room, hi, hi_room = (mid, r, hi, hi_room) if r >= 0 else (lo, lo_room, mid, r)
    return lo


def render(setup: Setup, rows: list[Row]) -> str:
    """The table a person reads (markdown: docs/scaling.md quotes it)."""
    lines = ["| item | formula | per GPU | host, per rank |", "|---|---|---|---|"]
    lines += [f"| {r.item} | `{r.formula}` | {r.gpu / GB:.1f} GB | {r.host / GB:.1f} GB |" for r in rows]
    lines.append(f"| total | | {sum(r.gpu for r in rows) / GB:.1f} GB | {sum(r.host for r in rows) / GB:.1f} GB |")
    return "\n".join(lines)


def _mixer_arg(value: str) -> Mixer:
    """``--mixer``: a preset's name, or a transformers config.json (its ``text_config`` if nested)."""
    if value in MIXER_PRESETS:
        return MIXER_PRESETS[value]
    try:
        with open(value) as f:
            cfg = json.load(f)
        return Mixer.from_config(cfg.get("text_config", cfg))
    except (OSError, ValueError, UlyssesInputError) as e:
        raise argparse.ArgumentTypeError(f"expected a preset ({', '.join(sorted(MIXER_PRESETS))}) or a readable config.json: {e}") from e


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ulysses_kernels.memory", description=__doc__.split("\n\n")[0])
    for name in ("layers", "hidden", "heads", "vocab"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--seq", type=int, default=None, help="tokens of one sequence (not with --max-seq)")
    for name in ("kv-heads", "head-dim", "intermediate", "loss-tile-rows", "mlp-tile-rows", "norm-tile-rows"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--attention-head-chunk", type=int, default=None, help="the attention backward per this many query heads (longctx.HeadChunkedAttention)")
    p.add_argument("--mlp", default="gated", help="gated (Llama, Qwen2) or plain (GPT)")
    for name in ("batch", "sp", "dp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    p.add_argument("--dtype", default="bfloat16", help=", ".join(DTYPE_BYTES))
    for flag in ("offload-optimizer", "offload-param", "checkpointing", "untied-embeddings", "qk-norm"):
        p.add_argument(f"--{flag}", action="store_true")
    for flag, what in (("tiled-loss", "LM head and loss over sequence tiles (no logits)"),
                       ("tiled-mlp", "MLP over sequence tiles, recomputed in the backward"),
                       ("tiled-norms", "RMSNorms over sequence tiles, recomputed in the backward"),
                       ("offload-activations", "checkpointed layer inputs in host memory (needs --checkpointing)"),
                       ("flash-workspace", "count flash-attn's float32 backward workspace (from its source; not measured)")):  # fmt: skip
        p.add_argument(f"--{flag}", action="store_true", help=what)
    p.add_argument("--max-seq", action="store_true", help="find the longest sequence that fits --gpu-gb")
    p.add_argument("--gpu-gb", type=float, default=None, help="memory per GPU in GB (1e9 bytes), for --max-seq")
    p.add_argument("--host-gb", type=float, default=None, help="host memory per rank in GB, a second limit for --max-seq")
    p.add_argument(
        "--mixer",
        default=None,
        type=_mixer_arg,
        metavar="PRESET|CONFIG.json",
        help=f"a hybrid's mixer layers (memory_step.mixer): a preset ({', '.join(sorted(MIXER_PRESETS))}: Gated DeltaNet, "
        "attention every 4th layer) or a transformers Qwen3.5 / Qwen3-Next, Kimi-Linear, Bamba, LFM2, Nemotron-H (with --mlp plain) "
        "Falcon-H1 or Jamba (dense MLPs) config.json (its mixer sizes, layer_types); MoE layers are refused by name",
    )
    p.add_argument(
        "--mixer-parallel",
        default=None,
        choices=MIXER_PARALLEL,
        help="how hf.apply runs the --mixer layers (its mixer_parallel, docs/state_passing.md): heads (the head exchange, the default "
        "here), state (the sequence kept sharded, the state passed between ranks) or auto (heads where they split over --sp)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = vars(parser.parse_args(argv))
    as_json, find, gpu_gb, host_gb = args.pop("json"), args.pop("max_seq"), args.pop("gpu_gb"), args.pop("host_gb")
    args["tie_embeddings"] = not args.pop("untied_embeddings")
    parallel = args.pop("mixer_parallel")
    if parallel is not None:
        if args["mixer"] is None:
            parser.error("--mixer-parallel needs --mixer (a hybrid's mixer layers)")
        args["mixer"] = replace(args["mixer"], parallel=parallel)
    if find and gpu_gb is None:
        parser.error("--max-seq needs --gpu-gb (the memory per GPU, in GB)")
    if find and args["seq"] is not None:
        parser.error("--max-seq finds --seq: give one of them")
    if not find and args["seq"] is None:
        parser.error("the following arguments are required: --seq (or --max-seq with --gpu-gb)")
    for flag, value in (("--gpu-gb", gpu_gb), ("--host-gb", host_gb)):
        if value is not None and not value > 0:
            parser.error(f"{flag} expected a positive number of GB, got {value}")
    longest = None
    try:
        if find:
            setup = Setup(**{**args, "seq": args["sp"]})
            longest = max_seq(setup, gpu_gb * GB, None if host_gb is None else host_gb * GB)
            if longest == 0:
                limit = f"{gpu_gb} GB per GPU" + ("" if host_gb is None else f" and {host_gb} GB of host memory per rank")
                parser.error(f"memory: not even {setup.sp} tokens fit {limit} with this setup")
            setup = replace(setup, seq=longest)
        else:
            setup = Setup(**args)
        rows = memory_rows(setup)
        step = worst_step(setup)
    except UlyssesInputError as e:
        parser.error(str(e))
    if as_json:
        described = asdict(setup)
        if setup.mixer is None:
            del described["mixer"]  # an attention-only model: the JSON as before hybrids
        out = {"setup": described, "parameters": parameter_count(setup)[0], "activations": worst_activations(setup),
               "step": asdict(step), "rows": [asdict(r) for r in rows], "total_gpu": sum(r.gpu for r in rows),
               "total_host": sum(r.host for r in rows)}  # fmt: skip
        if setup.mixer is not None:
            # activation_bytes is the attention-only formula: a hybrid has the replay's figures only
            del out["activations"]
            out["mixer_layers"] = [i for i in range(setup.layers) if setup.mixer.is_mixer(i)]
        if find:
            out.update(max_seq=longest, gpu_gb=gpu_gb, host_gb=host_gb)
        print(json.dumps(out, indent=1))
    else:
        if find:
            host = "" if host_gb is None else f" and {host_gb:g} GB of host memory per rank"
            print(f"longest sequence within {gpu_gb:g} GB per GPU{host}: {longest:,} tokens ({longest // setup.sp:,} per rank)\n")
        print(render(setup, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
