"""Rank 0 of an N-way sequence-parallel job on one device: measured memory and time against the calculator.

    python -m ulysses_kernels.bench.longctx --emulate-rank0-of 4 --model tiny            # CPU: a code-path check
    python bench/bench_longctx.py --emulate-rank0-of 8 --model llama3-8b,qwen2.5-14b@16 \\
        --layers 2,4 --seqs 256K,1M,2M,4M --max-seq --gpu-gb 80 --time-budget 110       # one GPU (docs/longctx.md)

One process runs rank 0's share of the sequence through the model (``hf.apply`` with
``comm.EmulatedPeers``: rank 0's halves of the exchanges, on the buffers an N-way group
gives rank 0, the peers' blocks stand-ins), so that the device holds what rank 0 of the
job holds, except:

* parameters: held in full in the model's dtype (measured: the allocated bytes before the
  step), gradients freed as each is accumulated (as ZeRO reduces and frees them; each one
  counted while it exists), no optimizer step (ZeRO-3 with optimizer offload keeps it on
  the host). ZeRO-3's own state on the rank (parameters / N, gradients / N, the largest
  gathered module) is the calculator's, *modeled*, never measured here;
* layers: ``--layers`` (e.g. 2 and 4, not 32): with activation checkpointing and the
  offload, what a layer adds on the device is measured as the slope between two layer counts
  and the 32-layer (48-layer) figure is *modeled* from it;
* attention: ``proxy`` rows run the same SDPA kernel on the same buffers in blocks of
  ``--proxy-block`` tokens (the sequence as a batch of blocks, causal in each): the kernel's
  tensors and workspaces have the same sizes (all are per token), its FLOPs grow as S x block
  instead of S^2 / 2, so that a 4M-token step takes seconds; ``causal`` rows run the real
  kernel (the time rows, and one memory row that checks the proxy against it);
* no byte crosses a link: the step time has no communication, no NCCL buffer exists.

Each row says what was measured (``layers``, ``seq``, ``pieces``, ``attention``) and holds
the calculator's replay (``memory_step``) of the same setup, term by term: parameters held,
the forward's end, the step's activation peak (``max_memory_allocated`` less the bytes before
the step), the allocator's reserved peak (``max_memory_reserved``: no calculator term), the
offload's host bytes (and the pinned host allocator's); ``model_*`` fields are extrapolations
and say from what. ``--max-seq`` probes the longest sequence by measurement under a cap on the
allocator (``torch.cuda.set_per_process_memory_fraction``): 80 GB less the modeled ZeRO-3
state and the modeled layers beyond the measured ones, plus the parameters held here.
``--time-budget`` stops starting rows that its estimate says will not finish in time, and
records them as skipped. On the CPU, memory is ``traffic.LiveBytes`` and times are a code-path
check, not a claim.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import longctx, memory
from ..backends import SDPABackend
from ..comm import EmulatedPeers
from ..memory_step import step_memory
from ..plan import HeadPlan
from ..traffic import LiveBytes
from . import common as C

__all__ = ["MODELS", "ProxyAttention", "run"]

# Real sizes (config.json of each model); ``tiny``, ``tiny-qwen2`` (Qwen2.5-14B's 40/8 heads) for the CPU.
MODELS = {
    "llama3-8b": {"family": "llama", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 128256},
    "qwen2.5-14b": {"family": "qwen2", "layers": 48, "hidden": 5120, "heads": 40, "kv_heads": 8, "intermediate": 13824, "vocab": 152064},
    "tiny": {"family": "llama", "layers": 4, "hidden": 64, "heads": 8, "kv_heads": 4, "intermediate": 160, "vocab": 256},
    "tiny-qwen2": {"family": "qwen2", "layers": 4, "hidden": 160, "heads": 40, "kv_heads": 8, "intermediate": 96, "vocab": 256},
}
# The long-context pieces, each on and off (bench.longctx's rows too).
PIECES = {
    "none": {},
    "loss": {"tiled_loss": True},
    "mlp": {"tiled_mlp": True},
    "norms": {"tiled_norms": True},
    "offload": {"offload_activations": True},
    "all": {"tiled_loss": True, "tiled_mlp": True, "tiled_norms": True, "offload_activations": True},
}
# Dense bf16 peak of the GPUs MFU is quoted against (NVIDIA's data sheets, SXM parts).
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
COLUMNS = [
    ("model", "model", "s"), ("layers", "L", "d"), ("seq", "seq", "d"), ("pieces", "pieces", "s"), ("attention", "attn", "s"),
    ("status", "status", "s"), ("step_s", "step s", ".2f"), ("params_gb", "params GB", ".2f"), ("act_peak_gb", "act peak GB", ".2f"),
    ("calc_act_peak_gb", "calc GB", ".2f"), ("act_peak_diff", "diff", "+.3f"), ("reserved_gb", "reserved GB", ".2f"),
    ("host_gb", "host GB", ".2f"), ("model_total_gb", "model full GB", ".2f"), ("calc_total_gb", "calc full GB", ".2f"),
]  # fmt: skip
GB = 1e9


class ProxyAttention(SDPABackend):
    """SDPA on the sequence cut into blocks of ``block`` tokens, as a batch (causal inside each):
    the kernel, its inputs, outputs, log-sum-exp, gradients and workspaces have the sizes of the
    whole-sequence call (per token), its FLOPs are linear in the sequence. A memory stand-in for
    long rows, never a model of attention's values."""

    name = "sdpa-proxy"

    def __init__(self, block: int):
        self.block = block

    def attend(self, q, k, v, causal, scale, docs=None):
        if docs is not None:
            raise ValueError("ProxyAttention: packed documents are not emulated")
        B, S = q.shape[:2]
        b = math.gcd(S, self.block)
        blocks = lambda x: x.unflatten(1, (S // b, b)).flatten(0, 1)  # noqa: E731  [B*S/b, b, h, D] views
        out = super().attend(blocks(q), blocks(k), blocks(v), causal, scale)
        return out.unflatten(0, (B, S // b)).flatten(1, 2)


@dataclass(frozen=True)
class Config:
    """One model at one group size: ``sizes`` from ``MODELS`` (``layers`` there: the real count)."""

    name: str
    sp: int
    sizes: dict

    @property
    def key(self) -> str:
        return f"{self.name}@{self.sp}"

    @property
    def real_layers(self) -> int:
        return self.sizes["layers"]


def parse_models(spec: str, default_sp: int) -> list[Config]:
    out = []
    for item in spec.split(","):
        name, _, sp = item.partition("@")
        if name not in MODELS:
            raise SystemExit(f"bench.longctx: --model expected names of {', '.join(MODELS)} (optionally @sp), got {name!r}")
        out.append(Config(name, int(sp) if sp else default_sp, dict(MODELS[name])))
    return out


# ---- the model and one step --------------------------------------------------------------
def build_model(cfg: Config, layers: int, device, dtype, seed: int):
    import transformers

    s = cfg.sizes
    cls = {"llama": "Llama", "qwen2": "Qwen2"}[s["family"]]
    conf = getattr(transformers, f"{cls}Config")(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=layers,
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=1 << 25,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the model's dtype, on the device: no float32 copy on the host
    try:
        with torch.device(device):
            model = getattr(transformers, f"{cls}ForCausalLM")(conf)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(device=device, dtype=dtype).train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def apply_pieces(model, comm, pieces: str, attention: str, block: int):
    from ..integrations import hf

    kw = {k: longctx.ActivationOffload() if k == "offload_activations" else True for k in PIECES[pieces]}
    kw = {"tiled_loss": False, "tiled_mlp": False, "tiled_norms": False, "offload_activations": False, **kw}
    attn_fn = ProxyAttention(block) if attention == "proxy" else None
    return hf.apply(model, None, comm=comm, check="never", attn_fn=attn_fn, **kw)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_step(model, batch, device, fresh: bool = True) -> dict:
    """One training step: seconds, bytes before it, forward end and peak above them, reserved
    peak, offload host bytes. Each parameter gradient is dropped once accumulated (CUDA: freed;
    CPU: ``LiveBytes.forget``). ``fresh``: the allocator's cache emptied first (the reserved
    peak is this step's); a timed step keeps it (as a training loop's later steps do)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    tracker = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if fresh:
            torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        reset_host = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
        if reset_host is not None:
            reset_host()

        def drop(p):
            p.grad = None
    else:
        # LiveBytes counts what the step allocates; what was there before: parameters and buffers
        before = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        tracker = LiveBytes(host_sites=("offload._host_copy",))

        def drop(p):
            tracker.forget(p.grad)

    hooks = [p.register_post_accumulate_grad_hook(drop) for p in model.parameters()]
    try:
        t0 = time.perf_counter()
        if tracker is not None:
            tracker.__enter__()
        try:
            out = model(**batch.model_inputs())
            forward_end = torch.cuda.memory_allocated(device) - before if tracker is None else tracker.current
            with torch.utils.checkpoint.GraphExecGroup():
                out.loss.backward()
            loss = float(out.loss.detach())
            del out
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    state = longctx.state(model)
    host = state.offload.stats()["host_peak"] if state is not None and state.offload is not None else 0
    rec = {"loss": loss, "step_s": seconds, "before": before, "forward_end": forward_end, "host_peak": host}
    if tracker is None:
        rec.update(peak=torch.cuda.max_memory_allocated(device) - before, reserved_peak=torch.cuda.max_memory_reserved(device))
        stats = getattr(torch.cuda, "host_memory_stats", None)
        if stats is not None:
            with contextlib.suppress(RuntimeError):
                rec["pinned_host"] = {k: v for k, v in stats().items() if "bytes" in k and ("peak" in k or "current" in k)}
    else:
        rec.update(peak=tracker.peak, reserved_peak=None)
        rec["host_peak"] = tracker.host_peak
    return rec


# ---- the calculator, term by term -----------------------------------------------------------
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


# ---- the plan of rows under a time budget -------------------------------------------------------
class Budget:
    """Seconds left, and the FLOP rate measured so far (each row's estimate: its FLOPs at that
    rate, the pinned host memory its offload allocates, a model build)."""

    def __init__(self, seconds: float | None, device, tflops: float | None = None):
        self.deadline = None if seconds is None else time.monotonic() + seconds
        # a first guess of the executed FLOP rate, replaced once a row ran
        self.rate = tflops * 1e12 if tflops else (250e12 if device.type == "cuda" else 2e9)
        self.samples: list[float] = []

    def left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def estimate(self, flops: float, steps: int = 1, host_bytes: float = 0, build: bool = False) -> float:
        # NOTE: pinned host memory is allocated at a few GB/s (cudaHostAlloc): 3 GB/s assumed
        return 1.2 * steps * flops / self.rate + host_bytes / 3e9 + (5.0 if build else 0.0) + 1.0

    def ran(self, flops: float, seconds: float) -> None:
        self.samples.append(flops / max(seconds, 1e-9))
        # the first step of the run is cold (kernels loaded, handles made): used until others ran
        later = sorted(self.samples[1:])
        self.rate = later[len(later) // 2] if later else self.samples[0]


@dataclass
class Job:
    """One planned row (``probe``: one step of the longest-sequence search of ``cfg``), with its
    priority: a job starts only if it leaves the estimated time of every later job of a higher
    priority (a lower number)."""

    priority: int
    cfg: Config
    layers: int
    seq: int = 0
    pieces: str = "all"
    attention: str = "proxy"
    what: str = "memory"
    timed: int = 0
    probe: bool = False


class Runner:
    def __init__(self, args, device, dtype):
        self.args, self.device, self.dtype = args, device, dtype
        self.budget = Budget(args.time_budget, device, args.assume_tflops)
        self.rows: list[dict] = []
        self.searches: dict[str, dict] = {}
        self._model = None
        self._key = None
        self.env = None
        self.partial = None if args.no_write else Path(args.out_dir) / "bench_longctx_emulated_partial.json"

    # ---- the plan -----------------------------------------------------------------------------
    def _seq_of(self, job: Job, wait: bool = False) -> int:
        seq = self.next_probe(job.cfg, wait) if job.probe else job.seq
        if seq is None:
            return 0
        unit = job.cfg.sp * (self.args.proxy_block if job.probe else 1)  # a probe's lengths: whole proxy blocks
        return max(unit, seq - seq % unit)

    def estimate(self, job: Job, wait: bool = False) -> float:
        seq = self._seq_of(job, wait)
        if seq == 0:
            return 0.0
        flops = executed_flops(job.cfg, job.layers, seq, job.attention, self.args.proxy_block)
        host = job.layers * -(-seq // job.cfg.sp) * job.cfg.sizes["hidden"] * 2 if job.pieces in ("all", "offload") else 0
        return self.budget.estimate(flops, 1 + job.timed, host, build=(job.cfg.name, job.cfg.sp, job.layers) != self._key)

    def run_jobs(self, jobs: list[Job]) -> None:
        for i, job in enumerate(jobs):
            seq = self._seq_of(job, wait=True)
            if seq == 0:
                continue  # a search that is over
            need = self.estimate(job, wait=True)
            reserve = sum(self.estimate(j) for j in jobs[i + 1 :] if j.priority < job.priority)
            if need > self.budget.left() - reserve:
                row = self._row_head(job, seq)
                row.update(estimate_s=need, status=f"skipped: estimated {need:.0f} s; {self.budget.left():.0f} s of the budget left, "
                                                   f"{reserve:.0f} s of it kept for rows of a higher priority")  # fmt: skip
                self.record(row)
                if job.probe:
                    self.searches[job.cfg.key]["stopped"] = "time budget"
                continue
            row = self.step_row(job, seq, need)
            if job.probe:
                self.probed(job.cfg, row)

    # ---- the longest sequence: one probe per job ------------------------------------------------
    def start_search(self, cfg: Config, layers: int, gpu_bytes: float, pool) -> None:
        """The search's first probe is the calculator's answer, computed on ``pool`` (seconds of
        Python for a 48-layer model) while the first rows run."""
        setup = setup_of(cfg, cfg.real_layers, cfg.sp, "all", self.dtype, zero=3)
        self.searches[cfg.key] = {
            "model": cfg.name, "sp": cfg.sp, "gpu_gb": gpu_bytes / GB, "measured_layers": layers, "calc_max_seq": None,
            "next": None, "longest_fit": None, "shortest_oom": None, "probes": [], "stopped": None,
            "_calc": pool.submit(memory.max_seq, setup, gpu_bytes), "calc_flash_workspace": setup.flash_workspace,
            "_calc_no_workspace": pool.submit(memory.max_seq, replace(setup, flash_workspace=False), gpu_bytes) if setup.flash_workspace else None,
            "note": f"measured at {layers} layers, proxy attention, every piece on, under each probe's cap (cap_from); the longest "
                    "length that fit and the shortest that did not, as far as the probes and the budget went",
        }  # fmt: skip

    def next_probe(self, cfg: Config, wait: bool) -> int | None:
        """The next probe's length; ``None``: the search is over. Until the calculator's answer
        is in (``wait`` False), a guess for the estimates: twice the longest of ``--seqs``."""
        s = self.searches.get(cfg.key)
        if s is None or s["stopped"]:
            return None
        if s["next"] is None:
            if not wait and not s["_calc"].done():
                return 2 * max(C.parse_size(x) for x in self.args.seqs.split(","))
            calc, unit = s.pop("_calc").result(), cfg.sp * self.args.proxy_block
            other = s.pop("_calc_no_workspace")
            s["calc_max_seq_no_workspace"] = other.result() if other is not None else calc
            s["calc_max_seq"], s["next"] = calc, max(unit, calc - calc % unit)
        return s["next"]

    def probed(self, cfg: Config, row: dict) -> None:
        s, unit = self.searches[cfg.key], cfg.sp * self.args.proxy_block
        s["probes"].append({"seq": row["seq"], "status": row["status"], "cap_gb": row.get("cap_gb")})
        if row["status"] == "ok":
            s["longest_fit"] = max(s["longest_fit"] or 0, row["seq"])
        else:
            s["shortest_oom"] = min(s["shortest_oom"] or row["seq"], row["seq"])
        fit, miss = s["longest_fit"], s["shortest_oom"]
        step = max(unit, int(row["seq"] * self.args.max_seq_step) // unit * unit)
        if miss is None:
            s["next"] = row["seq"] + step
        elif fit is None:
            s["next"] = max(unit, row["seq"] - step)
        else:
            s["next"] = (fit + miss) // 2 // unit * unit
            if miss - fit <= unit or s["next"] in (fit, miss):
                s["stopped"] = f"resolved to {unit} tokens"

    def probe_cap(self, cfg: Config, layers: int, seq: int) -> tuple[float, str]:
        """The allocator cap of a probe at ``layers``: the GPU less what the real job holds that
        this one does not (the calculator's ZeRO-3 state, the layers beyond ``layers``), plus what
        this one holds that the job does not (the parameters held in full)."""
        s = self.searches[cfg.key]
        full = setup_of(cfg, cfg.real_layers, seq, "all", self.dtype)
        here = setup_of(cfg, layers, seq, "all", self.dtype)
        beyond = calc_step(full).peak - calc_step(here).peak
        state = zero3_state_bytes(full)
        held = memory.parameter_count(here)[0] * _element_size(self.dtype)
        cap = s["gpu_gb"] * GB - state - beyond + held
        return cap, (f"{s['gpu_gb']:g} GB - ZeRO-3 state {state / GB:.2f} GB (calculator) - {cfg.real_layers - layers} more layers "
                     f"{beyond / GB:.3f} GB (calculator's replay) + parameters held here {held / GB:.2f} GB")  # fmt: skip

    # ---- one row ------------------------------------------------------------------------------
    def model(self, cfg: Config, layers: int):
        key = (cfg.name, cfg.sp, layers)
        if self._key != key:
            self._model = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._model = build_model(cfg, layers, self.device, self.dtype, self.args.seed)
            self._key = key
        return self._model

    def record(self, row: dict) -> None:
        self.rows.append(row)
        if not self.args.no_progress:
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if not isinstance(v, dict)}
            print(f"# [{time.strftime('%H:%M:%S')}] {json.dumps(shown)}", file=sys.stderr, flush=True)
        if self.partial is not None:
            self.partial.parent.mkdir(parents=True, exist_ok=True)
            doc = {"name": "bench_longctx_emulated (partial: the run did not finish)", "env": self.env, "rows": self.rows,
                   "max_seq": list(self.searches.values())}  # fmt: skip
            self.partial.write_text(json.dumps(doc, indent=1, default=str))

    def _row_head(self, job: Job, seq: int) -> dict:
        return {"model": job.cfg.name, "sp": job.cfg.sp, "config": job.cfg.key, "rank": 0, "what": job.what, "layers": job.layers, "seq": seq,
                "seq_local": -(-seq // job.cfg.sp), "pieces": job.pieces,
                "attention": job.attention if job.attention == "causal" else f"proxy (blocks of {self.args.proxy_block})"}  # fmt: skip

    def step_row(self, job: Job, seq: int, estimate: float) -> dict:
        """One measured step of ``job`` at ``seq`` tokens (and ``job.timed`` more, timed): a row."""
        a, cfg, cuda = self.args, job.cfg, self.device.type == "cuda"
        row = self._row_head(job, seq)
        row["estimate_s"] = estimate
        t0 = time.monotonic()
        comm = EmulatedPeers(cfg.sp)
        model = apply_pieces(self.model(cfg, job.layers), comm, job.pieces, job.attention, a.proxy_block)
        batch = shard(model, seq, comm, self.device)
        cap = None
        if job.probe:
            cap, row["cap_from"] = self.probe_cap(cfg, job.layers, seq)
            row["cap_gb"] = cap / GB
            if cuda:
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), self.device)
        flops = executed_flops(cfg, job.layers, seq, job.attention, a.proxy_block)
        try:
            rec = measured_step(model, batch, self.device)
            row["status"] = "ok"
            if cap is not None and not cuda:  # the CPU has no allocator cap: the tracked bytes against it
                row["status"] = "ok" if rec["before"] + rec["peak"] <= cap else "over the cap (CPU: LiveBytes against it)"
            elif cap is not None and rec["reserved_peak"] > cap:  # the cap was not enforced (an allocator setting): no fit
                row["status"] = f"over the cap: reserved {rec['reserved_peak'] / GB:.2f} GB, the allocator did not stop it"
        except RuntimeError as e:  # torch.OutOfMemoryError, or a library's failed allocation (cuBLAS, cuDNN)
            text = str(e)
            if not isinstance(e, torch.cuda.OutOfMemoryError) and "out of memory" not in text.lower() and "ALLOC_FAILED" not in text:
                raise
            rec = None
            row["status"] = "oom"
            row["error"] = text.splitlines()[0][:300]
        finally:
            if cap is not None and cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        model.zero_grad(set_to_none=True)
        if rec is not None:
            self.budget.ran(flops, rec["step_s"])
            here = setup_of(cfg, job.layers, seq, job.pieces, self.dtype)
            row["loss"], row["loss_finite"] = rec["loss"], math.isfinite(rec["loss"])
            row.update(compare(rec, here, memory.parameter_count(here)[0] * _element_size(self.dtype)))
            row["step_s"], row["step_kind"] = rec["step_s"], "the measured step (first at this size: allocations included)"
            if job.timed:
                times = [measured_step(model, batch, self.device, fresh=False)["step_s"] for _ in range(job.timed)]
                row["step_s"], row["step_kind"] = min(times), f"best of {job.timed} after the measured step"
                self.budget.ran(flops, row["step_s"])
            row["tokens_per_s"] = row["seq_local"] / row["step_s"]
        del batch
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        row["wall_s"] = time.monotonic() - t0
        self.record(row)
        return row


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shard(model, seq: int, comm, device):
    """Rank ``comm.rank``'s share of a random global batch of ``seq`` tokens."""
    from ..integrations import hf

    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq)).to(device)
    return hf.shard_batch(ids, comm=comm, check=False)


# ---- the models built on the rows: the real layer count, the time -------------------------------
def layer_models(runner: Runner, cfg: Config, dtype) -> None:
    """For each measured row of ``cfg``: the real layer count's device bytes, modeled: the
    measured activation peak plus the layers beyond it times the per-layer slope (measured
    between two layer counts at the same length when both ran, else the calculator's), plus
    the calculator's ZeRO-3 state; beside it the calculator's total for the same setup."""
    L = cfg.real_layers
    ok = [r for r in runner.rows if r["config"] == cfg.key and r.get("status") == "ok" and "act_peak_gb" in r]
    for r in ok:
        full = setup_of(cfg, L, r["seq"], r["pieces"], dtype)
        others = [o for o in ok if o["seq"] == r["seq"] and o["pieces"] == r["pieces"] and o["attention"] == r["attention"]
                  and o["layers"] != r["layers"]]  # fmt: skip
        if r["layers"] == L:
            slope, source = 0.0, "none: the real layer count ran"
        elif others:
            o = others[0]
            slope = (o["act_peak_gb"] - r["act_peak_gb"]) / (o["layers"] - r["layers"]) * GB
            source = f"measured between {r['layers']} and {o['layers']} layers"
        else:
            here = calc_step(setup_of(cfg, r["layers"], r["seq"], r["pieces"], dtype)).peak
            slope = (calc_step(full).peak - here) / (L - r["layers"])
            source = "the calculator's"
        state = zero3_state_bytes(full)
        r["model_total_gb"] = (state + r["act_peak_gb"] * GB + (L - r["layers"]) * slope) / GB
        r["model_total_from"] = (f"{L} layers, modeled: measured activation peak at {r['layers']} layers + {L - r['layers']} x per-layer "
                                 f"slope {slope / GB:.4f} GB ({source}) + the calculator's ZeRO-3 state {state / GB:.2f} GB "
                                 "(parameters / N, gradients / N, largest gathered module; optimizer offloaded)")  # fmt: skip
        r["calc_total_gb"] = calc_total(full) / GB
        r["total_diff"] = r["model_total_gb"] / r["calc_total_gb"] - 1


def _peak_flops(device) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    if "PCIe" in name:
        return None  # not the SXM parts the table holds
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def time_model(runner: Runner, cfg: Config, seqs: list[int]) -> dict | None:
    """The step time of the real layer count at each length, modeled from the timed rows at one
    length S_t: a layer's work besides attention (proxy steps at two layer counts), attention
    (causal less proxy step at the same layers) scaled as S^2, the rest (embedding, head, loss)
    as S. ``measured``: the causal step as it ran (its layers), with its MFU."""
    rows = [r for r in runner.rows if r["config"] == cfg.key and r.get("what") == "time" and r.get("status") == "ok"]
    by = {(r["layers"], r["attention"].split(" ")[0]): r for r in rows}
    Ls = sorted({r["layers"] for r in rows})
    if not Ls or (Ls[0], "causal") not in by or (Ls[0], "proxy") not in by:
        return None
    l0, peak = Ls[0], _peak_flops(runner.device)
    s_t = by[(l0, "causal")]["seq"]
    if len(Ls) > 1 and (Ls[-1], "proxy") in by:
        per_layer = (by[(Ls[-1], "proxy")]["step_s"] - by[(l0, "proxy")]["step_s"]) / (Ls[-1] - l0)
        source = f"a layer's time besides attention measured between {l0} and {Ls[-1]} layers (proxy attention)"
    else:
        per_layer = by[(l0, "proxy")]["step_s"] / (l0 + 2)
        source = f"a layer's time besides attention assumed: the {l0}-layer proxy step over {l0 + 2} (one layer count ran)"
    rest = by[(l0, "proxy")]["step_s"] - l0 * per_layer
    # causal less proxy leaves attention's time less the proxy's own (block / S_t of it, at equal FLOP rates)
    block = min(runner.args.proxy_block, s_t)
    attn = (by[(l0, "causal")]["step_s"] - by[(l0, "proxy")]["step_s"]) / l0 / max(1 - block / s_t, 1e-9)
    L = cfg.real_layers
    c = by[(l0, "causal")]
    measured_flops = model_flops(replace(cfg, sizes={**cfg.sizes, "layers": l0}), s_t)
    out = {"model": cfg.name, "sp": cfg.sp, "from_seq": s_t, "per_layer_s": per_layer, "attention_per_layer_s": attn, "rest_s": rest,
           "measured": {"layers": l0, "seq": s_t, "attention": "causal", "step_s": c["step_s"],
                        "tokens_per_s_per_gpu": c["seq_local"] / c["step_s"], "mfu": None if peak is None else measured_flops / c["step_s"] / peak},
           "how": f"modeled: {source}; attention per layer: causal less proxy step at {l0} layers, over {l0} and 1 - block / S_t, scaled as (S / {s_t})^2; "
                  "the rest (embedding, head, loss) and a layer's other work scaled as S / S_t; no communication; MFU against "
                  f"{'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'} (dense bf16), model FLOPs (no recompute)",
           "at": []}  # fmt: skip
    valid = per_layer > 0 and attn >= 0 and rest > 0
    for seq in sorted(set(seqs)):
        x = seq / s_t
        t = (rest + L * per_layer) * x + L * attn * x * x
        out["at"].append({"seq": seq, "layers": L, "model_step_s": t if valid else None,
                          "model_tokens_per_s_per_gpu": seq / cfg.sp / t if valid else None,
                          "model_mfu": model_flops(cfg, seq) / t / peak if valid and peak else None})  # fmt: skip
    if not valid:
        out["how"] += "; NOT VALID: a fitted term came out negative (timing noise), no time is modeled"
    return out


# ---- the run ------------------------------------------------------------------------------------
def plan(args, configs: list[Config], layers: list[int], seqs: list[int], s_t: int) -> list[Job]:
    """The rows, in order, with priorities (a row starts only if it leaves the estimated time of
    the later rows of a lower number). 1: the first model's time row at S_t (proxy), its second
    length, its first probe. 2: its longest length and causal time row; the other models' time
    row and longest length. 3: the first model's other lengths; the other models' second
    length, first probe and causal time row. 4: the second layer count, more probes. 5: the
    rest, the ablation."""
    l0, l1 = layers[0], layers[-1]
    first, others = configs[0], configs[1:]
    rest = [s for s in seqs if s != s_t]
    second, longest = rest[:1], rest[-1:]
    jobs = [Job(1, first, l0, s_t, what="time", timed=1), Job(2, first, l0, s_t, attention="causal", what="time", timed=1)]
    jobs += [Job(1 if s in second else 2 if s in longest else 3, first, l0, s) for s in rest]
    for cfg in others:
        jobs += [Job(2, cfg, l0, s_t, what="time", timed=1), Job(3, cfg, l0, s_t, attention="causal", what="time", timed=1)]
        jobs += [Job(2 if s in longest else 3 if s in second else 5, cfg, l0, s) for s in rest]
    if args.max_seq:
        jobs += [Job(1 if i == 0 else 3, cfg, l0, what="max-seq probe", probe=True) for i, cfg in enumerate(configs)]
    if l1 != l0:
        jobs += [Job(4, first, l1, s_t, what="time", timed=1)] + [Job(4, first, l1, s) for s in second]
    if args.max_seq:
        for _ in range(args.max_probes - 1):
            jobs += [Job(4, cfg, l0, what="max-seq probe", probe=True) for cfg in configs]
    if args.ablation:
        jobs += [Job(5, first, l0, s_t, pieces=p, what="ablation") for p in ("none", "loss", "mlp", "norms", "offload")]
    return jobs


def proxy_check(runner: Runner, cfg: Config) -> dict | None:
    """The proxy attention against the real kernel: the measured activation peak (and forward
    end) of the causal and the proxy step at the same length and layers."""
    rows = {r["attention"].split(" ")[0]: r for r in runner.rows if r["config"] == cfg.key and r["what"] == "time" and r.get("status") == "ok"
            and r["layers"] == min(x["layers"] for x in runner.rows if x["config"] == cfg.key)}  # fmt: skip
    if "causal" not in rows or "proxy" not in rows or rows["causal"]["seq"] != rows["proxy"]["seq"]:
        return None
    c, p = rows["causal"], rows["proxy"]
    return {"model": cfg.name, "sp": cfg.sp, "seq": c["seq"], "layers": c["layers"], "causal_act_peak_gb": c["act_peak_gb"],
            "proxy_act_peak_gb": p["act_peak_gb"], "act_peak_diff": c["act_peak_gb"] / p["act_peak_gb"] - 1,
            "causal_reserved_gb": c["reserved_gb"], "proxy_reserved_gb": p["reserved_gb"]}  # fmt: skip


def run(args) -> int:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = C.parse_dtype(args.dtype)
    configs = parse_models(args.model, args.emulate_rank0_of)
    layers = [int(x) for x in str(args.layers).split(",")]
    seqs = [C.parse_size(s) for s in args.seqs.split(",")]
    s_t = C.parse_size(args.time_seq) if args.time_seq else seqs[0]
    runner = Runner(args, device, dtype)
    runner.env = C.env_record(
        device, 1, None, dtype=C.dtype_name(dtype), process="rank 0 of an emulated group, one process (comm.EmulatedPeers)",
        gpu_memory_bytes=torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    )  # fmt: skip
    if args.dry_run:  # the plan and each row's estimate at --assume-tflops, nothing run
        total = 0.0
        for job in plan(args, configs, layers, seqs, s_t):
            est = 0.0 if job.probe else runner.estimate(job)
            runner._key = (job.cfg.name, job.cfg.sp, job.layers)  # as if built
            total += est
            print(f"# P{job.priority} {job.cfg.key:16s} L{job.layers} {job.what:14s} {job.attention:6s} {job.pieces:7s} "
                  f"seq {'(probe)' if job.probe else job.seq:>9} ~{est:5.1f} s (sum {total:6.1f} s, probes not counted)")  # fmt: skip
        return 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        if args.max_seq:
            for cfg in configs:
                runner.start_search(cfg, layers[0], args.gpu_gb * GB, pool)
        runner.run_jobs(plan(args, configs, layers, seqs, s_t))
        for s in runner.searches.values():  # a search the budget never reached: its calculator answer still
            if "_calc" in s:
                s["calc_max_seq"] = s.pop("_calc").result()
                other = s.pop("_calc_no_workspace")
                s["calc_max_seq_no_workspace"] = other.result() if other is not None else s["calc_max_seq"]
    times, checks = [], []
    for cfg in configs:
        layer_models(runner, cfg, dtype)
        check = proxy_check(runner, cfg)
        if check is not None:
            checks.append(check)
        s = runner.searches.get(cfg.key)
        t = time_model(runner, cfg, seqs + ([s["longest_fit"], s["calc_max_seq"]] if s and s["longest_fit"] else []))
        if t is not None:
            times.append(t)
    unit = "GB" if device.type == "cuda" else "MB"
    scale = 1.0 if device.type == "cuda" else 1e3
    shown = [{k: v * scale if isinstance(v, float) and k.endswith("_gb") else v for k, v in r.items()} for r in runner.rows]
    for r in shown:
        r["status"] = r["status"].split(":")[0]  # the JSON has the whole reason
    cols = [(k, h.replace("GB", unit), f) for k, h, f in COLUMNS]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU: a code-path check, not a claim"
    C.print_table(cols, shown, title=f"# bench_longctx: rank 0 of an emulated group in one process, {C.dtype_name(dtype)}, {where}")
    for t in times:
        print(f"# time, {t['model']} at sp {t['sp']}: measured {json.dumps(t['measured'])}\n#   {t['how']}")
        for x in t["at"]:
            print(f"#   {json.dumps(x)}")
    for c in checks:
        print(f"# proxy attention against causal, {c['model']} at sp {c['sp']}, {c['seq']} tokens: {json.dumps(c)}")
    for s in runner.searches.values():
        print(f"# longest sequence, {s['model']} at sp {s['sp']} on {s['gpu_gb']:g} GB: calculator {s['calc_max_seq']:,}; measured: "
              f"fit {s['longest_fit']}, did not fit {s['shortest_oom']} ({s['stopped'] or 'probes used up'}); {s['probes']}")  # fmt: skip
    if not args.no_write:
        meta = {"args": vars(args), "max_seq": list(runner.searches.values()), "time": times, "proxy_check": checks}
        paths = C.write_results(args.out_dir, "bench_longctx_emulated", runner.env, runner.rows, meta)
        if runner.partial is not None and runner.partial.exists():
            runner.partial.unlink()
        print(f"# wrote {', '.join(paths.values())}", flush=True)
    return 0
