"""The rows under a time budget: the plan (``Job``s with priorities), the FLOP rate measured so
far (``Budget``), the longest-sequence search, and each row's measured step (``Runner``)."""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ... import memory
from ...comm import EmulatedPeers
from .. import sizes
from .calculator import GB, calc_step, compare, executed_flops, setup_of, zero3_state_bytes
from .step import Config, _element_size, apply_pieces, build_model, measured_step, shard


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
                return 2 * max(sizes.parse_size(x) for x in self.args.seqs.split(","))
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
