"""The Ulysses x ring rows of the benchmarks: ``bench_attention``'s ``hybrid-UxR`` and
``packed-hybrid-UxR[-zigzag]`` rows on 4 gloo ranks (timed and checked against float32
attention; the packed rows report what the ring schedule skipped) and ``perf_model --hybrid``."""

import json

from ulysses_kernels.bench import attention as att
from ulysses_kernels.bench import perf_model as pm
from ulysses_kernels.ring.schedule import ring_schedule


def test_bench_attention_hybrid_rows(tmp_path, capfd):
    argv = ["--spawn", "4", "--layouts", "8/2", "--seqs", "64", "--head-dim", "8", "-w", "0", "-n", "1",
            "--methods", "local,hybrid-2x2,hybrid-1x4,hybrid-4x2,packed-hybrid-2x2,packed-hybrid-1x4-zigzag", "--out-dir", str(tmp_path)]  # fmt: skip
    assert att.main(argv) == 0
    out = capfd.readouterr().out
    (path,) = [p for p in tmp_path.glob("bench_attention_*.json") if not p.name.endswith("_latest.json")]
    rows = json.loads(path.read_text())["rows"]
    hybrid = [r for r in rows if "hybrid-" in r["method"]]
    assert {r["method"] for r in hybrid} == {"hybrid-2x2", "hybrid-1x4", "packed-hybrid-2x2", "packed-hybrid-1x4-zigzag"}
    assert {r["pass"] for r in hybrid} == {"fwd", "bwd", "fwdbwd"}
    assert all(r["wrong"] == 0 for r in hybrid), hybrid  # checked against float32 attention
    assert "skipped 8/2 S=64 hybrid-4x2: hybrid-4x2 needs U*R = 4 real ranks" in out
    # The packed rows: documents (the bench's mix, more than one at 64 tokens) and what the
    # schedule skipped, as ring_schedule computes it for the same documents.
    docs = att.packed_documents(64)
    for r in hybrid:
        if r["method"].startswith("packed-"):
            zig = r["method"].endswith("zigzag")
            R = 4 if zig else 2
            sched = ring_schedule(R, "zigzag" if zig else "contiguous", 64 // R, True, docs.cu_seqlens)
            assert r["docs"] == docs.count > 1 and r["ring_steps"] == f"{sched.computed_steps()}/{R * R}", r
            assert r["ring_hops"] == f"{sched.hops()}/{R * (R - 1)}", r
        else:
            assert r["ring_steps"] is None and r["docs"] == 1


def _args(*extra):
    return pm.parse_args(["--models", "llama3-8b", *extra])


def test_perf_model_hybrid_without_ring_is_the_flat_model():
    args = _args()
    for P, S in ((8, 32768), (16, 1 << 20)):
        flat, hybrid = pm.model_layer(32, 8, P, S, args), pm.model_hybrid(32, 8, P, 1, S, args)
        for p in ("fwd", "bwd"):
            assert abs(flat["compute"][p] - hybrid["compute"][p]) <= 1e-12 * flat["compute"][p]
            assert abs(flat["wire"][p] - hybrid["ulysses"][p]) <= 1e-12 * flat["wire"][p]
            assert hybrid["ring_wire"][p] == 0


def test_perf_model_hybrid_ring_links_and_overlap():
    assert not pm.ring_crosses_nodes(2, 4, 8) and pm.ring_crosses_nodes(8, 2, 8) and pm.ring_crosses_nodes(4, 4, 8)
    args = _args()
    # Short sequences: a step's K/V transfer over InfiniBand outlasts its attention.
    short = pm.model_hybrid(32, 8, 8, 4, 8192, args)
    assert short["crosses"] and short["ring"]["fwd"] > short["compute"]["fwd"]
    # Long ones: the transfers hide behind attention, the ring costs its compute alone.
    long = pm.model_hybrid(32, 8, 8, 4, 1 << 20, args)
    assert abs(long["ring"]["fwd"] - long["compute"]["fwd"]) <= 1e-12 * long["compute"]["fwd"]
    # World larger than the heads: no flat plan, the hybrid has one.
    assert pm.model_layer(32, 8, 64, 1 << 20, args) is None and pm.model_hybrid(32, 8, 8, 8, 1 << 20, args) is not None


def test_perf_model_hybrid_table(capsys):
    assert pm.main(["--hybrid", "--models", "llama3-8b", "--worlds", "8,32", "--seqs", "32K", "--passes", "fwdbwd"]) == 0
    out = capsys.readouterr().out
    assert "Ulysses x ring (formulas, not measurements)" in out
    lines = [line.split() for line in out.splitlines() if line.startswith("llama3-8b")]
    assert {(int(x[1]), int(x[2]), int(x[3])) for x in lines} == {(8, u, 8 // u) for u in (1, 2, 4, 8)} | {(32, u, 32 // u) for u in (1, 2, 4, 8, 16, 32)}
    assert all(x[-1] == "IB" for x in lines if int(x[1]) == 32 and int(x[3]) > 1)
