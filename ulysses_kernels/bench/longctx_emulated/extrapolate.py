"""The models built on the measured rows: the real layer count's device bytes (``layer_models``),
the step time at each length with its MFU (``time_model``), and the proxy attention against
the real kernel (``proxy_check``)."""

from __future__ import annotations

from dataclasses import replace

import torch

from .calculator import GB, calc_step, calc_total, model_flops, setup_of, zero3_state_bytes
from .runner import Runner
from .step import Config

# Dense bf16 peak of the GPUs MFU is quoted against (NVIDIA's data sheets, SXM parts).
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


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
