"""The benchmarks run end to end on the CPU (2 gloo ranks, tiny sizes), every row is
correct, the result files are written; and the helpers they share do what they claim
(including noticing a wrong result)."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ulysses_kernels
from ulysses_kernels.bench import harness, patterns, record, sizes, timing
from ulysses_kernels.kernels import available_kernels
from ulysses_kernels.layout import Layout
from ulysses_kernels.math_attention import default_scale
from ulysses_kernels.plan import HeadPlan
from ulysses_kernels.testing.reference import attention_reference

# The result files keep the names bench_<module>_*; the modules are ulysses_kernels.bench.<module>.
MODULES = {"bench_alltoall": "alltoall", "bench_attention": "attention", "bench_overlap": "overlap", "bench_pack": "pack",
           "perf_model": "perf_model"}  # fmt: skip


# The directory the package is imported from (the checkout, for an editable install).
ROOT = Path(ulysses_kernels.__file__).resolve().parents[1]


def _load(name: str):
    return importlib.import_module(f"ulysses_kernels.bench.{MODULES[name]}")


# ---- helpers ---------------------------------------------------------------------------
def test_sizes():
    assert [sizes.parse_size(x) for x in ("512", "1K", "4M", "1G", "2KB", "1.5K")] == [512, 1024, 4 << 20, 1 << 30, 2048, 1536]
    with pytest.raises(ValueError):
        sizes.parse_size("1.3K")
    with pytest.raises(ValueError):
        sizes.parse_size("lots")
    assert sizes.size_sweep(1024, 8192, 2) == [1024, 2048, 4096, 8192]
    assert sizes.size_sweep(1000, 5000, 3) == [1000, 3000]
    assert sizes.size_sweep(7, 7, 2) == [7]
    assert [sizes.format_size(n) for n in (1024, 1536, 3 << 30)] == ["1K", "1536", "3G"]


def test_pattern_is_exact_and_finds_a_misplaced_block():
    x = torch.empty(2, 6, 3, 4, dtype=torch.bfloat16)
    patterns.fill_pattern_4d(x, salt=1, seq_total=12, heads_total=5, t0=6, heads=[4, 0, 2], chunk_elems=7)
    assert patterns.count_wrong_4d(x, 1, 12, 5, 6, [4, 0, 2]) == 0
    # every value is an integer in [-125, 125], so bf16 holds it exactly
    assert torch.equal(x.float(), x.float().round()) and x.float().abs().max() <= 125
    wrong_rows = patterns.count_wrong_4d(x, 1, 12, 5, 0, [4, 0, 2])  # the same data, claimed to be rows 0..5
    swapped = x.clone()
    swapped[:, :, [0, 1]] = x[:, :, [1, 0]]  # two heads swapped
    assert wrong_rows > 0.9 * x.numel()
    assert patterns.count_wrong_4d(swapped, 1, 12, 5, 6, [4, 0, 2]) > 0.9 * 2 * 2 * 6 * 4
    one = x.clone()
    one[1, 5, 2, 3] += 1
    assert patterns.count_wrong_4d(one, 1, 12, 5, 6, [4, 0, 2]) == 1


def test_write_results_and_table(tmp_path, capsys):
    rows = [{"size": 1024, "op": "a2a", "time_us": 1.5}, {"size": 2048, "op": "chain", "time_us": float("nan"), "extra": 1}]
    env = record.env_record(torch.device("cpu"), 2, "gloo")
    assert env["gpu"] == "cpu" and record.CPU_LABEL in env["timer"] and env["torch"] == torch.__version__
    paths = record.write_results(tmp_path, "demo", env, rows, {"note": "x"})
    doc = json.loads(Path(paths["json"]).read_text())
    assert doc["env"]["world_size"] == 2 and doc["rows"][1]["extra"] == 1 and doc["meta"]["note"] == "x"
    with open(paths["csv"]) as f:
        got = list(csv.DictReader(f))
    assert [r["op"] for r in got] == ["a2a", "chain"] and got[0]["extra"] == ""
    assert (tmp_path / "demo_latest.json").exists()
    text = record.print_table([("size", "size", "d"), ("time_us", "time", ".1f")], rows)
    assert "n/a" in text and "1.5" in capsys.readouterr().out


def test_env_record_names_the_transport_and_old_records_still_read(tmp_path):
    """The torch.distributed backend is the record's ``transport`` (#40: "backend" is the
    attention backend's word); a record written before, with only ``backend``, reads the same."""
    env = record.env_record(torch.device("cpu"), 2, "gloo")
    assert env["transport"] == "gloo" and "backend" not in env and record.transport_of(env) == "gloo"
    assert record.transport_of(record.env_record(torch.device("cpu"), 1, None)) is None  # one process, no collective
    # "nccl" is the NCCL that ran: none over gloo or in one process; torch's build's version named apart.
    built = record._versions()["nccl"]
    for transport in ("gloo", None):
        env_t = record.env_record(torch.device("cpu"), 2, transport)
        assert env_t["nccl"] is None and env_t["nccl_in_torch_build"] == built, env_t
    if built is not None:  # an NCCL transport keeps the loaded library's version under "nccl"
        assert record.env_record(torch.device("cpu"), 2, "nccl")["nccl"] == built
    old = dict(env)
    del old["transport"]
    old["backend"] = "nccl"
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"name": "bench_alltoall", "env": old, "meta": {}, "rows": []}))
    assert record.transport_of(json.loads(path.read_text())["env"]) == "nccl"
    # The first GPU run's records (checked in) say "backend".
    h200 = json.loads((ROOT / "bench" / "results" / "2026-11-27_h200" / "bench_alltoall_w1.json").read_text())["env"]
    assert "transport" not in h200 and record.transport_of(h200) == "nccl"


def test_heads_sets_flag_keeps_its_old_name():
    """``--heads-sets Hq/Hkv,...`` and ``--layouts`` (its name before #40) fill the same
    ``args.heads_sets``, which ``sizes.parse_heads_sets`` reads."""
    p = harness.parser("heads")
    harness.add_heads_sets(p, "head sets")
    for flag in ("--heads-sets", "--layouts"):
        args = p.parse_args([flag, "32/8,10/2"])
        assert sizes.parse_heads_sets("t", args.heads_sets, None) == [("32/8", 32, 8), ("10/2", 10, 2)]
    assert p.parse_args([]).heads_sets is None
    assert sizes.parse_heads_sets("t", None, "llama3-8b") == [("llama3-8b", 32, 8)]
    assert sizes.parse_heads_sets("t", None, None, heads=8) == [("8/8", 8, 8)]
    with pytest.raises(SystemExit, match="t: unknown --models"):
        sizes.parse_heads_sets("t", None, "gpt-9")


def test_alltoall_says_when_it_rounds_a_size():
    """``-b 1K -e 16K`` with the defaults (Llama-3-8B: 32 + 2x8 heads, head_dim 128, bf16):
    every size is below or between whole tokens of 12288 B; each line says what is measured
    and why; sizes measured exactly print nothing."""
    a2a = _load("bench_alltoall")
    notes = a2a.rounding_notes(a2a.parse_args(["-b", "1K", "-e", "16K"]), 2, 2)
    assert notes[0] == "# size 1K (1024 B) measured as 960 B of q+k+v: below one token (12288 B: 48 heads x head_dim 128 x 2 B), head_dim shrinks to 10"
    assert notes[-1] == "# size 16K (16384 B) measured as 12288 B of q+k+v: whole tokens of 12288 B (48 heads x head_dim 128 x 2 B): 1 per rank"
    assert len(notes) == 5
    assert a2a.rounding_notes(a2a.parse_args(["-b", "12K", "-e", "48K"]), 2, 2) == []  # 1, 2 and 4 tokens: exact
    notes = a2a.rounding_notes(a2a.parse_args(["-b", "12K", "-e", "13K", "-f", "1.05"]), 2, 2)
    assert notes and all("the same row as 12K" in n for n in notes), notes  # 12.6K, 13K: still one token


def test_a_time_below_its_floor_is_flagged_not_a_speedup():
    rows = [{"op": "a2a", "size": 960, "seq_per_rank": 1, "head_dim": 10, "time_us": 100.0},
            {"op": "chain", "size": 960, "seq_per_rank": 1, "head_dim": 10, "time_us": 300.0},
            {"op": "fused-torch", "size": 960, "seq_per_rank": 1, "head_dim": 10, "time_us": 90.0},
            {"op": "fused-torch", "size": 1920, "seq_per_rank": 2, "head_dim": 10, "time_us": 150.0}]  # fmt: skip
    notes = _load("bench_alltoall").floor_notes(rows)
    assert notes == ["# fused-torch at 960 B (90.0 us): FLAGGED: faster than its floor (the bare a2a of the same bytes: 100 us): timing noise, not a win"]
    base, ours = {"time_ms": 2.0}, {"time_ms": 1.0}
    assert timing.speedup_text(base, ours, "time_ms", "the chain", cpu=False) == "2.0x faster than the chain (quartiles 2.0-2.0x)"
    assert timing.speedup_text(base, ours, "time_ms", "the chain", cpu=True, floor={"time_ms": 1.5}, floor_name="x").startswith("FLAGGED")
    # The base below the floor: no ratio either (it would measure noise).
    text = timing.speedup_text(base, {"time_ms": 3.0}, "time_ms", "the chain", cpu=False, floor={"time_ms": 2.5}, floor_name="x")
    assert text.startswith("no ratio: the chain ran faster than the floor"), text


def test_attention_check_matches_float64_reference_and_catches_errors():
    att = _load("bench_attention")
    inp = att.Inputs(1, 24, 4, 2, 8, 3, torch.float64, torch.device("cpu"))
    q, k, v, dout = (inp.full(n, range(h)) for n, h in (("q", 4), ("k", 2), ("v", 2), ("dout", 4)))
    q.requires_grad_()
    ref = attention_reference(q, k, v, causal=True)
    ref.backward(dout)
    rows, heads = [0, 7, 8, 23], [1, 3]
    scale = 8**-0.5
    o, dq = att.reference_rows(inp, rows, heads, scale, k, v)
    torch.testing.assert_close(o.double(), ref[:, rows][:, :, heads], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dq.double(), q.grad[:, rows][:, :, heads], rtol=1e-4, atol=1e-4)
    good = ref[:, rows][:, :, heads].float()
    assert att.count_wrong(good, o, torch.float32) == 0
    bad = good.clone()
    bad[0, 2, 1, :3] += 0.5
    assert att.count_wrong(bad, o, torch.float32) == 3
    assert att.count_wrong(good[:, [1, 0, 2, 3]], o, torch.float32) > 0  # rows swapped


# ---- the scripts, end to end -------------------------------------------------------------
def _main(script: str, args: list[str]) -> None:
    """The benchmark module's ``main(args)`` in this process (the spawned ranks import it
    by its module name)."""
    assert _load(script).main(args) == 0


def _result(out_dir: Path, name: str) -> dict:
    jsons = sorted(p for p in out_dir.glob(f"{name}_*.json") if not p.name.endswith("_latest.json"))
    csvs = sorted(out_dir.glob(f"{name}_*.csv"))
    assert len(jsons) == 1 and len(csvs) == 1, sorted(p.name for p in out_dir.iterdir())
    if importlib.util.find_spec("matplotlib") is not None:  # the run drew its PNG next to the JSON
        png = jsons[0].with_suffix(".png")
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    with open(csvs[0]) as f:
        assert len(list(csv.DictReader(f))) == len(json.loads(jsons[0].read_text())["rows"])
    return json.loads(jsons[0].read_text())


def test_bench_alltoall_smoke(tmp_path, capfd):
    # Every kernel set available here runs (Triton under the interpreter: ~1 s a call).
    _main(
        "bench_alltoall",
        ["--spawn", "2", "-b", "1K", "-e", "4K", "-f", "4", "-w", "0", "-n", "1", "--heads", "6", "--kv-heads", "2",
         "--head-dim", "8", "--out-dir", str(tmp_path)],
    )  # fmt: skip
    out = capfd.readouterr().out
    doc = _result(tmp_path, "bench_alltoall")
    rows = doc["rows"]
    assert doc["env"]["world_size"] == 2 and doc["env"]["gpu"] == "cpu" and doc["env"]["git_sha"]
    ops = {r["op"] for r in rows}
    assert {"a2a", "chain"} | {f"fused-{k}" for k in available_kernels()} <= ops
    assert all(r["wrong"] == 0 for r in rows), rows
    assert len({r["size"] for r in rows if r["op"] == "chain"}) == 2
    for r in rows:
        assert r["time_us"] > 0 and r["busbw"] == pytest.approx(r["algbw"] / 2)
        assert r["time_min_us"] <= r["time_q1_us"] <= r["time_us"] <= r["time_q3_us"] <= r["time_max_us"], r
    assert "#wrong" in out and record.CPU_LABEL in out and "q1(us)" in out
    # 1K is 6.4 tokens of 6+2+2 heads x head_dim 8 x 2 B: the row measures 6 and says so.
    assert "# size 1K (1024 B) measured as 960 B of q+k+v: whole tokens of 160 B (10 heads x head_dim 8 x 2 B): 6 per rank" in out, out
    assert "skipped symm" in out  # no CUDA: the symmetric-memory row says why
    if "cuda" in available_kernels():  # on a CPU the cuda set's row is named for what runs
        assert "fused-cuda on a CPU: the C++ extension's CPU twin" in out


def test_bench_attention_smoke(tmp_path, capfd):
    # Not the Triton set: its interpreter would take most of a minute here.
    kern = [k for k in available_kernels() if k != "triton"]
    methods = ",".join(["local", "chain", "deepspeed", "yunchang", "chain-layout"] + [f"{m}-{k}" for k in kern for m in ("ulysses", "layout")])
    _main(
        "bench_attention",
        ["--spawn", "2", "--heads-sets", "6/2", "--seqs", "32", "--head-dim", "8", "-w", "0", "-n", "1",
         "--methods", methods, "--out-dir", str(tmp_path)],
    )  # fmt: skip
    out = capfd.readouterr().out
    doc = _result(tmp_path, "bench_attention")
    rows = doc["rows"]
    methods = {r["method"] for r in rows}
    assert {"local", "chain", "chain-layout"} | {f"ulysses-{k}" for k in kern} | {f"layout-{k}" for k in kern} <= methods
    assert {r["pass"] for r in rows} == {"fwd", "bwd", "fwdbwd"}
    checked = [r for r in rows if r["wrong"] is not None]
    assert checked == rows  # every row, the layout-only ones included, was checked
    assert all(r["wrong"] == 0 for r in checked), checked
    assert all(r["mem_gib"] is None for r in rows)  # no peak memory claims on the CPU
    assert doc["meta"]["breakdown"] and "exposed comm" in out
    assert "skipped 6/2 S=32 deepspeed" in out or "deepspeed" in methods_seen(rows)


def test_bench_attention_heads_sets_flag_and_its_old_name():
    # --heads-sets names the head counts (Hq/Hkv,...); --layouts, its old name, is an alias of it.
    att = _load("bench_attention")
    assert att.parse_args(["--heads-sets", "32/8,40/8"]).heads_sets == "32/8,40/8"
    old = att.parse_args(["--layouts", "8/2"])
    assert old.heads_sets == "8/2" and not hasattr(old, "layouts")
    assert att.parse_args([]).heads_sets is None


def methods_seen(rows):
    return {r["method"] for r in rows}


def _attention_case(P=2, H=6, Hkv=2, S=16, D=8):
    att = _load("bench_attention")
    inp = att.Inputs(1, S, H, Hkv, D, P, torch.float32, torch.device("cpu"))
    plan = HeadPlan.build(H, Hkv, P)
    q, k, v, dout = (inp.full(n, range(h)) for n, h in (("q", H), ("k", Hkv), ("v", Hkv), ("dout", H)))
    q.requires_grad_()
    out = attention_reference(q, k, v, causal=True)
    out.backward(dout)
    return att, inp, plan, out.detach(), q.grad, (k, v)


def test_attention_check_method_catches_wrong_rows_heads_and_values():
    """check_method counts 0 on the right rank's rows and heads, and more on a corrupted value,
    on another rank's rows (sequence-sharded methods) or heads (the local floor)."""
    att, inp, plan, out, dq, kv_full = _attention_case()
    s, scale = inp.s, default_scale(inp.D, None)
    sharded, local = att.Method("x", None), att.Method("local", None, seq_sharded=False)
    for rank in range(2):
        rows = slice(rank * s, (rank + 1) * s)
        outs = (out[:, rows], dq[:, rows])
        assert att.check_method(sharded, outs, inp, plan, rank, scale, kv_full, 4) == 0
        other = slice((1 - rank) * s, (2 - rank) * s)
        assert att.check_method(sharded, (out[:, other], dq[:, other]), inp, plan, rank, scale, kv_full, 4) > 0
        bad = outs[0].clone()
        bad[0, s - 1, 5, 2] += 0.25  # the last row is always sampled
        assert att.check_method(sharded, (bad, outs[1]), inp, plan, rank, scale, kv_full, 4) == 1
        bad_dq = outs[1].clone()
        bad_dq[0, 0, 0, 0] = float("nan")
        assert att.check_method(sharded, (outs[0], bad_dq), inp, plan, rank, scale, kv_full, 4) == 1
        (a, b), (oa, ob) = plan.q_ranges[rank], plan.q_ranges[1 - rank]
        assert att.check_method(local, (out[:, :, a:b], dq[:, :, a:b]), inp, plan, rank, scale, kv_full, 4) == 0
        assert att.check_method(local, (out[:, :, oa:ob], dq[:, :, oa:ob]), inp, plan, rank, scale, kv_full, 4) > 0


@pytest.mark.parametrize("H,Hkv", [(6, 2), (6, 3)])  # 6/3 on 2 ranks: KV head 1 on both ranks (summed)
def test_layout_rows_are_checked_and_catch_corruption(H, Hkv, monkeypatch):
    """layout-<k> and chain-layout check() is 0 for the real kernels and counts an element a
    kernel wrote wrong or never wrote."""
    from ulysses_kernels.kernels import get_kernels

    att = _load("bench_attention")
    P, dev = 2, torch.device("cpu")
    inp = att.Inputs(2, 8, H, Hkv, 4, P, torch.float32, dev)
    plan = HeadPlan.build(H, Hkv, P)
    like = torch.empty(0)
    for rank in range(P):
        layout = Layout(plan, rank, (inp.s,) * P, inp.B, inp.D)
        for k in [k for k in available_kernels() if k != "triton"]:
            assert att.layout_method(f"layout-{k}", get_kernels(k, dev), layout, like).check_layout() == 0

        class OneOff:  # the torch set, with one element of the unpacked output wrong
            pack_s2h = staticmethod(get_kernels("torch", dev).pack_s2h)

            @staticmethod
            def unpack_h2s(lay, blocks, roles, outs):
                get_kernels("torch", dev).unpack_h2s(lay, blocks, roles, outs)
                outs[-1].view(-1)[7] += 1.0

        assert att.layout_method("layout-bad", OneOff, layout, like).check_layout() == 2  # fwd out, bwd dv

        class Lazy(OneOff):  # leaves the first element of the send buffer unwritten
            @staticmethod
            def pack_s2h(lay, tensors, roles, send, recv=None):
                get_kernels("torch", dev).pack_s2h(lay, tensors, roles, send, recv)
                send[0] = float("nan")

            unpack_h2s = staticmethod(get_kernels("torch", dev).unpack_h2s)

        assert att.layout_method("layout-lazy", Lazy, layout, like).check_layout() == 2  # q/k/v and dout packs
    chain = att.chain_layout_method(inp, P)
    assert chain.check_layout() == 0
    real = torch.Tensor.contiguous
    calls = []

    def shifted(x, *a, **kw):  # every 5th copy of the chain comes out one element off
        y = real(x, *a, **kw)
        calls.append(1)
        return y.clone().view(-1).roll(1).view(y.shape) if len(calls) % 5 == 0 else y

    monkeypatch.setattr(torch.Tensor, "contiguous", shifted)
    assert chain.check_layout() > 0


# Cost-model inputs under which chunks="auto" picks more than one chunk at the smoke sizes
# (attention slow against the link, no latency, no slowdown), so the auto row runs the pipeline.
_AUTO_ENV = {
    "ULYSSES_KERNELS_LINK_GBPS": "0.1", "ULYSSES_KERNELS_ATTN_TFLOPS": "0.001",
    "ULYSSES_KERNELS_LINK_LATENCY_US": "0", "ULYSSES_KERNELS_OVERLAP_SLOWDOWN": "0",
}  # fmt: skip


def test_bench_overlap_smoke(tmp_path, capfd, monkeypatch):
    from ulysses_kernels.attention.chunked import choose_chunks
    from ulysses_kernels.layout import Layout
    from ulysses_kernels.plan import HeadPlan

    for k, v in _AUTO_ENV.items():
        monkeypatch.setenv(k, v)  # the spawned ranks inherit the environment
    # 8/2 on 2 ranks: one shared KV head per rank (split by query heads, up to 4 chunks);
    # 6/3: KV head 1 on both ranks (split by KV groups, up to 2; its gradient summed across ranks).
    _main(
        "bench_overlap",
        ["--spawn", "2", "--layouts", "8/2,6/3", "--seqs", "32", "--head-dim", "8", "-w", "0", "-n", "1",
         "--chunks", "1,2,4,auto", "--long-from", "32", "--out-dir", str(tmp_path)],
    )  # fmt: skip
    out = capfd.readouterr().out
    doc = _result(tmp_path, "bench_overlap")
    rows = doc["rows"]
    assert doc["env"]["world_size"] == 2 and doc["env"]["gpu"] == "cpu" and doc["env"]["git_sha"]
    assert doc["meta"]["cost_model"]["link_gbps"] == pytest.approx(0.1)
    groups = {}
    for r in rows:
        groups.setdefault((r["layout"], r["pass"]), []).append(r)
    assert set(groups) == {(lay, p) for lay in ("8/2", "6/3") for p in ("fwd", "fwdbwd")}
    want_chunks = {"8/2": [1, 2, 4], "6/3": [1, 2]}  # 4 chunks: more than 6/3 on 2 ranks allows
    for (lay, _pass), g in groups.items():
        assert [r["chunks"] for r in g] == want_chunks[lay], g
        # Every row was checked against chunks=1, bit for bit on the CPU, and matched.
        assert all(r["wrong"] == 0 and r["exact"] for r in g), g
        assert all(r["layer_ms"] > 0 and r["attn_ms"] > 0 and r["a2a_ms"] > 0 for r in g)
        assert all(r["exposed_ms"] == pytest.approx(max(0.0, r["layer_ms"] - r["attn_ms"])) for r in g)
        assert all(r["exposed_frac"] == pytest.approx(r["exposed_ms"] / r["a2a_ms"]) for r in g)
        assert g[0]["speedup"] == 1.0
        H, Hkv = (int(x) for x in lay.split("/"))
        auto = choose_chunks(Layout(HeadPlan.build(H, Hkv, 2), 0, (16, 16), 1, 8), 4, True, "cpu")
        assert auto > 1  # the env above makes "auto" chunk: that row ran chunks="auto"
        assert [r["chunks"] for r in g if r["auto"]] == [auto]
        assert g[[r["chunks"] for r in g].index(auto)]["chunks_label"] == f"{auto}*"
    assert {r["checked"] for r in rows if r["pass"] == "fwdbwd"} == {"out,dq,dk,dv"}
    assert "#wrong" in out and "exposed/a2a" in out and record.CPU_LABEL in out and "x_chunks1  spread" in out
    assert "skipped 6/3 chunks=4" in out and "wrong elements: 0 OK" in out
    # The targets are judged on the rows but never claimed from a CPU run.
    v = doc["meta"]["verdicts"]
    for name in ("exposed", "auto"):
        assert v[name]["status"] == "not evaluated" and "CPU run" in v[name]["reason"], v[name]
    for name in ("exposed", "auto"):
        assert all(g["measured"] in ("PASS", "FAIL") and g["status"] == "not evaluated" for g in v[name]["groups"])
        assert {(g["layout"], g["pass"]) for g in v[name]["groups"]} == set(groups)
    assert "# target exposed/a2a <= 10%:" in out and "# target auto <= chunks=1:" in out


def test_bench_overlap_counts_a_wrong_chunked_result(monkeypatch, capsys):
    """A chunked layer that differs from chunks=1 in one element makes #wrong non-zero and
    the script fail (in this process, a world of one on the CPU, where chunks still run)."""
    import ulysses_kernels.attention.chunked as pipeline

    real = pipeline.chunked_attention

    def off_by_one(*args, **kwargs):
        out = real(*args, **kwargs)
        with torch.no_grad():
            out.view(-1)[3] += 1.0
        return out

    monkeypatch.setattr(pipeline, "chunked_attention", off_by_one)
    monkeypatch.setenv("ULYSSES_KERNELS_BENCH_CPU", "1")
    with pytest.raises(SystemExit, match="bench_overlap: 2 wrong elements"):
        _main("bench_overlap", ["--spawn", "0", "--layouts", "8/2", "--seqs", "16", "--head-dim", "8", "-w", "0", "-n", "1",
                                "--chunks", "1,2", "--no-write"])  # fmt: skip
    out = capsys.readouterr().out
    assert "wrong elements: 2 FAILED" in out  # one in the fwd output, one in the fwdbwd output


def test_bench_overlap_check_rules():
    ov = _load("bench_overlap")
    g = torch.Generator().manual_seed(0)
    ref = [torch.randn(2, 5, 3, 4, generator=g) for _ in range(2)]
    assert ov.count_wrong([x.clone() for x in ref], ref) == 0
    bad = [x.clone() for x in ref]
    bad[1][1, 4, 2, 3] = torch.nextafter(bad[1][1, 4, 2, 3], torch.tensor(9.0))  # one ulp
    bad[0][0, 0, 0, 0] = float("nan")
    assert ov.count_wrong(bad, ref) == 2
    assert ov.count_wrong([ref[0][:, :4]], ref[:1]) == ref[0].numel()  # wrong shape: all of it
    # GPU rule: within 8x the chunks=1 run-to-run noise (plus ulps * max|ref|), not beyond.
    ref2 = [x + 1e-3 for x in ref]
    near = [x + 5e-3 for x in ref]
    assert ov.count_wrong(near, ref, ref2, exact=False) == 0
    far = [x.clone() for x in near]
    far[0][1, 2, 0, 1] += 1.0
    far[1][0, 3, 1, 2] = float("inf")
    assert ov.count_wrong(far, ref, ref2, exact=False) == 2
    assert ov.count_wrong(near, ref, ref, exact=False) == sum(x.numel() for x in ref)  # no noise: 5e-3 is too far


# ---- as users run them: -m from anywhere, the checkout's bench/ scripts ---------------------
def _written_in_source_tree() -> set[Path]:
    """Result files a run could have left in the source tree (not .venv: too big to walk)."""
    found = set(ROOT.glob("bench_*")) | set((ROOT / "ulysses_kernels").rglob("bench_*_*"))
    return found | set((ROOT / "bench" / "results").glob("*")) | set((ROOT / "bench").glob("bench_results"))


def _python_as_installed(cwd: Path) -> tuple[list[str], dict]:
    """The interpreter as an installed user runs it, and its environment: isolated (``-I``:
    no PYTHON* variables, neither the working nor the script directory on ``sys.path``) when
    the package is installed; in a checkout used without an install, ``PYTHONPATH`` naming
    only the package's parent directory (what an editable install amounts to)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["OMP_NUM_THREADS"] = "1"
    probe = subprocess.run([sys.executable, "-I", "-c", "import ulysses_kernels"], cwd=cwd, env=env, capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-I"], env
    return [sys.executable], dict(env, PYTHONPATH=str(ROOT))


def test_alltoall_module_runs_from_outside_the_checkout(tmp_path):
    """``python -m ulysses_kernels.bench.alltoall`` in a directory outside the checkout (the
    package importable, as an install makes it; the working directory not a source tree):
    the spawned ranks run, the results land in --out-dir, nothing is written in the source
    tree or the working directory."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    before = _written_in_source_tree()
    python, env = _python_as_installed(work)
    argv = ["-m", "ulysses_kernels.bench.alltoall", "--spawn", "2", "-b", "1K", "-e", "1K", "-w", "0", "-n", "1", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "8", "--op", "a2a,chain,fused-torch", "--no-progress", "--out-dir", str(out)]  # fmt: skip
    proc = subprocess.run([*python, *argv], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = _result(out, "bench_alltoall")
    assert {r["op"] for r in doc["rows"]} == {"a2a", "chain", "fused-torch"} and all(r["wrong"] == 0 for r in doc["rows"])
    assert doc["env"]["world_size"] == 2 and doc["env"]["ulysses_kernels"] == ulysses_kernels.__version__
    if (ROOT / ".git").exists():  # imported from this checkout: its sha
        assert re.fullmatch(r"[0-9a-f]{40}", doc["env"]["git_sha"]), doc["env"]["git_sha"]
    assert "Out of bounds values : 0 OK" in proc.stdout
    assert list(work.iterdir()) == []
    assert _written_in_source_tree() == before
    # Without --out-dir the files go to ./bench_results, relative to the working directory.
    alltoall = _load("bench_alltoall")
    assert alltoall.parse_args([]).out_dir == "bench_results" and not Path(record.DEFAULT_OUT_DIR).is_absolute()
    assert alltoall.parse_args([], default_out_dir=tmp_path).out_dir == str(tmp_path)


def test_git_sha_names_a_checkout_only_when_it_tracks_the_package(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    monkeypatch.delenv("ULYSSES_KERNELS_GIT_SHA", raising=False)
    repo, pkg = tmp_path / "repo", tmp_path / "repo" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    assert record.git_sha(pkg) == "unknown"  # not a checkout at all

    def git(*args):
        ident = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
        return subprocess.run(["git", *ident, *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "empty")
    # A checkout, but the package in it is untracked (an install into a venv inside a checkout).
    assert record.git_sha(pkg) == "unknown"
    git("add", "pkg/__init__.py")
    git("commit", "-q", "-m", "pkg")
    assert record.git_sha(pkg) == git("rev-parse", "HEAD")
    monkeypatch.setenv("ULYSSES_KERNELS_GIT_SHA", "abc123")  # a copy of the tree without .git
    assert record.git_sha(tmp_path) == "abc123"


def test_perf_model_without_its_attention_json_says_what_is_missing(tmp_path, capsys):
    """A fresh clone has no results yet: the README's perf_model command must say which file
    is missing and which command writes it, and exit non-zero (no traceback)."""
    pm = _load("perf_model")
    missing = tmp_path / "bench_attention_latest.json"
    with pytest.raises(SystemExit) as exc:
        pm.main(["--attention-json", str(missing)])
    msg = str(exc.value.code)
    assert f"--attention-json {missing}: no such file" in msg and "python -m ulysses_kernels.bench.attention" in msg
    assert capsys.readouterr().out == ""  # no half-printed table
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"env": {}}))
    with pytest.raises(SystemExit, match="expected a bench_attention result"):
        pm.main(["--attention-json", str(bad)])
    # The checkout's script, as the README runs it (the package importable, as installed).
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "perf_model.py"), "--attention-json", str(missing)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)  # fmt: skip
    assert proc.returncode == 1 and "no such file" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_perf_model_formulas():
    pm = _load("perf_model")
    args = pm.parse_args(["--worlds", "8"])
    m = pm.model_layer(32, 8, 8, 32768, args)
    # Llama-3-8B over 8 GPUs: each rank sends 7/8 of its q/k/v and of its output.
    s, tok = 32768 / 8, 2 * 128
    fwd = (s * tok * 48 * 7 / 8 + s * tok * 32 * 7 / 8) / 370e9
    assert m["wire"]["fwd"] == pytest.approx(fwd) and m["chain"]["wire"]["fwd"] == pytest.approx(fwd)
    assert m["compute"]["fwd"] == pytest.approx(4 * 32768**2 * 4 * 128 / 2 / 350e12)
    assert m["chain"]["layout"]["fwd"] > m["layout"]["fwd"]  # two copies per tensor vs one pack
    assert pm.model_layer(40, 8, 16, 32768, args)["chain"] is None  # 40 heads do not divide by 16
    # 16 ranks: the chain repeats each KV head 4x, the plan sends each KV head to 2 ranks.
    m16 = pm.model_layer(32, 8, 16, 32768, args)
    assert m16["plan"].kv_replication == 2 and m16["chain"]["wire"]["fwd"] > m16["wire"]["fwd"]
    assert pm.model_layer(8, 8, 16, 1024, args) is None  # more ranks than heads


def test_perf_model_table_uses_the_measured_rows(tmp_path):
    """With a bench_attention JSON, compute comes from its ``local`` row and layout from the
    fastest ``layout-*`` row (the kernel set "auto" runs), not the first one listed."""
    pm = _load("perf_model")
    S, P = 32768, 8
    rows = [
        {"model": "llama3-8b", "seq": S, "world": P, "pass": "fwd", "method": m, "time_ms": t}
        for m, t in (("local", 5.0), ("layout-torch", 0.9), ("layout-cuda", 0.2), ("layout-triton", 0.3))
    ]
    path = tmp_path / "attn.json"
    path.write_text(json.dumps({"rows": rows}))
    args = pm.parse_args(["--models", "llama3-8b", "--worlds", str(P), "--seqs", "32K", "--passes", "fwd", "--attention-json", str(path)])
    (row,) = pm.table(args)
    assert row["source"] == "measured"
    assert row["compute_ms"] == pytest.approx(5.0) and row["layout_ms"] == pytest.approx(0.2)
    # On ranks that run SharedKV the layer's attention is that row, not the GQA floor.
    rows.append({"model": "llama3-8b", "seq": S, "world": P, "pass": "fwd", "method": "local-sharedkv", "time_ms": 5.5})
    path.write_text(json.dumps({"rows": rows}))
    (row,) = pm.table(args)
    assert row["compute_ms"] == pytest.approx(5.5)


def test_perf_model_refuses_an_attention_json_that_matches_no_row(tmp_path, capsys):
    """Before, a JSON of other sizes left every row the model's, silently; now no match at all
    exits naming the JSON, what it has and what the table asks for, and a partial match says
    how many rows it fed (the ``source`` column says which)."""
    pm = _load("perf_model")
    rows = [{"model": "llama3-8b", "seq": 4096, "world": 2, "pass": "fwd", "method": m, "time_ms": t} for m, t in (("local", 1.0), ("layout-torch", 0.5))]
    path = tmp_path / "attn.json"
    path.write_text(json.dumps({"rows": rows}))
    with pytest.raises(SystemExit) as exc:
        pm.main(["--models", "llama3-8b", "--worlds", "8", "--seqs", "32K", "--passes", "fwd", "--attention-json", str(path)])
    msg = str(exc.value.code)
    assert f"--attention-json {path}: none of its rows matches a row of this table" in msg, msg
    assert "it has llama3-8b seq 4096 P 2 fwd" in msg and "seqs 32K" in msg and "P 8" in msg, msg
    assert capsys.readouterr().out == ""
    assert pm.main(["--models", "llama3-8b", "--worlds", "2,8", "--seqs", "4K", "--passes", "fwd", "--attention-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"# --attention-json {path}: measured times in 1 of 2 rows" in out, out
    sources = [line.split()[-1] for line in out.splitlines() if line.startswith("llama3-8b")]
    assert sources == ["measured", "model"], out


def test_perf_model_main_prints_a_consistent_table(capsys):
    """The script end to end (what scripts/bench_smoke.sh runs): one line per (model, P, seq,
    pass); ours = compute + wire + layout, chain likewise, x_chain = chain / ours, exposed =
    (wire + layout) / ours; compute follows the FLOP formula and grows as S^2; 40 query heads
    over 16 ranks have no chain row (the chain needs heads that divide)."""
    pm = _load("perf_model")
    assert pm.main(["--models", "llama3-8b,qwen2.5-14b", "--worlds", "8,16", "--seqs", "32K,64K", "--passes", "fwd,fwdbwd"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# perf model") and "350.0 / bwd 260.0 TFLOP/s" in out[0]
    header = out[1].split()
    assert header[:5] == ["model", "P", "seq", "pass", "compute(ms)"]
    assert " ".join(header).endswith("x_chain kv_repl fp8 wire fp8(ms) x_fp8 source")  # the FP8 wire's three columns last
    num = lambda x: None if x == "n/a" else float(x.rstrip("%"))  # noqa: E731
    rows = {}
    for line in out[3:]:
        c = line.split()
        model, P, S, p = c[0], int(c[1]), int(c[2]), c[3]
        comp, wire, lay, ours, exposed, cw, cl, chain, x_chain, repl = map(num, c[4:14])
        rows[(model, P, S, p)] = (comp, chain)
        assert c[-1] == "model"
        fp8_wire, fp8, x_fp8 = map(num, c[14:17])
        assert fp8_wire < wire and fp8 < ours
        assert x_fp8 == pytest.approx(ours / fp8, rel=0.01)
        assert ours == pytest.approx(comp + wire + lay, abs=0.02)
        assert exposed == pytest.approx(100 * (wire + lay) / ours, abs=0.1 + 100 * 0.02 / ours)
        assert repl == (2.0 if P == 16 else 1.0)  # 8 KV heads: each sent to 2 of 16 ranks
        if chain is None:
            assert (model, P) == ("qwen2.5-14b", 16) and cw is None and x_chain is None
        else:
            assert chain == pytest.approx(comp + cw + cl, abs=0.02)
            assert x_chain == pytest.approx(chain / ours, rel=0.01) and x_chain >= 1.0
    want = {(m, P, S, p) for m in ("llama3-8b", "qwen2.5-14b") for P in (8, 16) for S in (32768, 65536) for p in ("fwd", "fwdbwd")}
    assert set(rows) == want and len(out) == 3 + len(want)
    fwd = 4 * 32768**2 * (32 // 8) * 128 / 2 / 350e12 * 1e3  # Llama-3-8B, 4 query heads per rank
    assert rows[("llama3-8b", 8, 32768, "fwd")][0] == pytest.approx(fwd, abs=0.01)
    assert rows[("llama3-8b", 8, 32768, "fwdbwd")][0] == pytest.approx(fwd * (1 + 2.5 * 350 / 260), abs=0.01)
    for (m, P, S, p), (comp, _) in rows.items():
        if S == 65536:
            assert comp == pytest.approx(4 * rows[(m, P, 32768, p)][0], rel=0.01)


def test_packed_probe_dry_run_on_the_cpu(capsys):
    """The packed probe's code paths on the CPU (its GPU numbers come from the next GPU call):
    both rows per length, labelled as a dry run, the packed row over several documents."""
    from ulysses_kernels.bench import packed_probe

    assert packed_probe.main(["--device", "cpu", "--seqs", "128", "--head-dim", "8", "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "CPU: a dry run of the code paths, no GPU claim" in out.splitlines()[0]
    rows = re.findall(r"S=\s+128 (local|local-packed)\s+docs\s+(\d+)\s+host ([0-9.]+) ms\s+device n/a ms\s+syncs 0", out)
    assert [r[0] for r in rows] == ["local", "local-packed"] and int(rows[1][1]) > 1, out
