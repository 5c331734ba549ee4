"""One bf16 training step of hybrid models (Qwen3.5: Gated DeltaNet + gated attention; Bamba:
Mamba2 + attention), ``hf.apply`` on 2 ranks against the same model in one process, each against
a float64 one-process reference: ``python -m ulysses_kernels.bench.hybrid_step`` (issue #38's
GPU goal). On a GPU the two ranks share it over gloo, with the kernels transformers picks
(flash-linear-attention's when importable); here the same script runs on the CPU at the
tests' tiny sizes, bf16 included (the CPU proxy), so that the GPU run finds a working script.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")

from ulysses_kernels.bench import hybrid_step  # noqa: E402


def _record(out_dir) -> dict:
    return json.loads((out_dir / f"{hybrid_step.NAME}_latest.json").read_text())


def _grads(rec, model) -> list[dict]:
    return [r for r in rec["rows"] if r["model"] == model and r["quantity"].startswith("grad ")]


def test_cpu_proxy_with_state_passing(tmp_path, capsys):
    """``--mixer-parallel state``: the step with the mixers' state passed between the 2 ranks, in
    float32, every check within 2x one process + floor, the record saying which strategy ran.
    NOTE: measured in bf16 (this CPU, tiny sizes): 83 of 84 checks pass; Bamba's A_log gradient is
    2.7e-2 from float64 against one process's 7.2e-3 (bound 1.8e-2), the head exchange's bf16
    step passing all 84. Isolated: under state passing every rank holds a part of each head's
    A_log gradient (under the head exchange one rank holds it whole), and the parts are bf16
    before ``sync_gradients`` sums them: Bamba's layer-0 head 2 gets +1.26e-7 on rank 0 and
    -8.9e-8 on rank 1 (sum 3.68e-8; the head exchange's 3.61e-8 whole on one rank): each part's
    bf16 rounding is ~1.4% of the sum. A reduction in float32 (FSDP's reduce_dtype) avoids it;
    the GPU call's bf16 run (hybrid_state_w2) measures it at real sizes."""
    argv = ["--device", "cpu", "--size", "tiny", "--dtype", "float32", "--mixer-parallel", "state", "--out-dir", str(tmp_path)]
    assert hybrid_step.main(argv) == 0
    rec = _record(tmp_path)
    assert rec["env"]["mixer_parallel"] == "state" and rec["meta"]["failed"] == 0
    assert all(r["ok"] for r in rec["rows"]) and len(_grads(rec, "qwen3.5")) > 0
    assert "(mixers: state)" in capsys.readouterr().out


def test_cpu_proxy(tmp_path, capsys):
    """The script on 2 gloo ranks on the CPU in bf16 (tiny sizes): every check passes, one row
    per loss, logits and parameter of each model, the record names the kernels that ran
    (transformers' torch fallbacks here) with their calls in both runs.
    NOTE: measured ~25 s wall on 2 busy cores (most of it spawning the 2 ranks)."""
    assert hybrid_step.main(["--device", "cpu", "--size", "tiny", "--out-dir", str(tmp_path)]) == 0
    rec = _record(tmp_path)
    assert rec["env"]["device"] == "cpu" and rec["env"]["world_size"] == 2 and rec["env"]["transport"] == "gloo"
    assert rec["env"]["dtype"] == "bfloat16" and rec["meta"]["failed"] == 0
    assert rec["meta"]["floor"] == pytest.approx(2.0**-8)
    from ulysses_kernels.testing.hybrids import build

    for case, mixer_kernel in zip(hybrid_step.cases(["qwen3.5", "bamba"], "tiny"), ("torch_chunk_gated_delta_rule", "mamba2_chunk_scan")):
        model = case[0]
        mine, grads = [r for r in rec["rows"] if r["model"] == model], _grads(rec, model)
        assert [r["quantity"] for r in mine[:2]] == ["loss", "logits"] and len(grads) == len(list(build(case).parameters()))
        assert all(r["ok"] for r in mine), model
        assert all(r["err_one"] > 1e-4 for r in grads), model  # bf16 is bf16: one process is measurably off float64
        family = {"qwen3.5": "qwen3_5", "bamba": "bamba"}[model]
        ran = rec["meta"]["models"][model]
        kernel = ran["kernels_one"][f"modeling_{family}.{mixer_kernel}"]
        assert kernel["source"] == f"transformers.models.{family}.modeling_{family}" and kernel["calls"] == 2, kernel
        assert ran["kernels_ranks_rank0"][f"modeling_{family}.{mixer_kernel}"]["calls"] == 2
    out = capsys.readouterr().out
    assert "checks within 2x one process + floor: OK" in out and "CPU (not a GPU claim)" in out


def test_check_fails_beyond_twice_one_process():
    """``check``: a sharded result at 3x the one-process error (above the floor) fails; at 1.5x passes."""
    ref = (torch.tensor(2.0, dtype=torch.float64), {"w": torch.ones(4, dtype=torch.float64)}, torch.ones(3, 5, dtype=torch.float64))
    one = (ref[0] * (1 + 1e-2), {"w": ref[1]["w"] * (1 + 1e-2)}, ref[2] * (1 + 1e-2))

    def off(k):
        return (ref[0] * (1 + k * 1e-2), {"w": ref[1]["w"] * (1 + k * 1e-2)}, ref[2] * (1 + k * 1e-2))

    rows = hybrid_step.check("m", ref, one, off(1.5), floor=1e-3)
    assert [r["quantity"] for r in rows] == ["loss", "logits", "grad w"] and all(r["ok"] for r in rows)
    assert rows[0]["bound"] == pytest.approx(2e-2 + 1e-3) and rows[0]["ranks_vs_one"] == pytest.approx(0.5e-2 / 1.01)
    rows = hybrid_step.check("m", ref, one, off(3), floor=1e-3)
    assert not any(r["ok"] for r in rows)
    with pytest.raises(RuntimeError, match="gradients present in one run only: v"):
        hybrid_step.check("m", ref, one, (ref[0], {"w": ref[1]["w"], "v": ref[1]["w"]}, ref[2]), floor=1e-3)


def test_one_config_autotuners():
    """Every autotuner of the named package's loaded modules (also one under ``triton.heuristics``)
    keeps one config, its smallest (block sizes x stages, then warps); modules outside the
    package are untouched."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    def kernel(x, BLOCK: tl.constexpr):  # never launched: only its autotuners are looked at
        pass

    def configs():
        return [triton.Config({"BLOCK": 64}, num_warps=4, num_stages=2), triton.Config({"BLOCK": 32}, num_warps=8, num_stages=3),
                triton.Config({"BLOCK": 32, "P": "ieee"}, num_warps=2, num_stages=3), triton.Config({"BLOCK": 128}, num_warps=1, num_stages=1)]  # fmt: skip

    tuned = triton.autotune(configs=configs(), key=[])(triton.jit(kernel))
    wrapped = triton.heuristics({"X": lambda args: 1})(triton.autotune(configs=configs(), key=[])(triton.jit(kernel)))
    outside = triton.autotune(configs=configs(), key=[])(triton.jit(kernel))
    mine, other = types.ModuleType("fakepkg.ops"), types.ModuleType("otherpkg")
    mine.tuned, mine.wrapped, other.tuned = tuned, wrapped, outside
    sys.modules.update({"fakepkg.ops": mine, "otherpkg": other})
    try:
        assert hybrid_step.one_config_autotuners("fakepkg") == 2
        # 32 x 3 stages = 96 is the smallest footprint (128 x 1 = 128, 64 x 2 = 128); of the two, 2 warps
        assert [(c.kwargs, c.num_warps) for c in tuned.configs] == [({"BLOCK": 32, "P": "ieee"}, 2)]
        assert len(wrapped.fn.configs) == 1 and len(outside.configs) == 4
        assert hybrid_step.one_config_autotuners("fakepkg") == 0
    finally:
        del sys.modules["fakepkg.ops"], sys.modules["otherpkg"]


def test_sizes_refuse_by_name():
    """A model without small sizes, or not in the table, is refused with the choices."""
    with pytest.raises(SystemExit, match="--size small has no sizes for 'lfm2'"):
        hybrid_step.cases(["lfm2"], "small")
    with pytest.raises(SystemExit, match="unknown model 'nope'"):
        hybrid_step.cases(["nope"], "tiny")
    small = hybrid_step.cases(["qwen3.5", "bamba"], "small")
    assert small[0][4]["linear_key_head_dim"] == 64 and small[1][4]["mamba_d_head"] == 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_step(tmp_path):
    """On the GPU: 2 gloo ranks sharing it, bf16, small sizes (999 tokens: 500 + 499), every
    check within 2x one process + floor; when flash-linear-attention is importable the Gated
    DeltaNet ran its ``chunk_gated_delta_rule`` in both runs."""
    import importlib.util

    rc = hybrid_step.main(["--out-dir", str(tmp_path)])
    rec = _record(tmp_path)
    assert rc == 0 and rec["meta"]["failed"] == 0, [r for r in rec["rows"] if not r["ok"]]
    gdn = rec["meta"]["models"]["qwen3.5"]["kernels_one"]["modeling_qwen3_5.torch_chunk_gated_delta_rule"]
    assert gdn["calls"] == 2 and rec["meta"]["models"]["qwen3.5"]["kernels_ranks_rank0"]["modeling_qwen3_5.torch_chunk_gated_delta_rule"]["calls"] == 2
    if importlib.util.find_spec("fla") is not None:
        assert gdn["source"].startswith("fla."), gdn
