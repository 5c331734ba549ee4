"""The packed rows of the attention benchmark: their check sees the documents (it counts
a result that attends across documents), and the rows run end to end on 2 gloo ranks with
every row correct and compared with its equal-length twin."""

from __future__ import annotations

import json
import types

import pytest
import torch

from ulysses_kernels.bench import attention as att
from ulysses_kernels.documents import documents
from ulysses_kernels.math_attention import default_scale
from ulysses_kernels.plan import HeadPlan
from ulysses_kernels.testing.reference import attention_reference, packed_attention_reference


def test_packed_check_sees_the_documents():
    P, H, Hkv, S, D = 2, 6, 2, 24, 8
    inp = att.Inputs(1, S, H, Hkv, D, P, torch.float32, torch.device("cpu"))
    plan = HeadPlan.build(H, Hkv, P)
    q, k, v, dout = (inp.full(n, range(h)) for n, h in (("q", H), ("k", Hkv), ("v", Hkv), ("dout", H)))
    docs = documents([0, 5, 6, 17, 24])  # documents cross the shard boundary (12)
    results = {}
    for name, fn in (("packed", lambda *x: packed_attention_reference(*x, docs.cu_seqlens)), ("causal", attention_reference)):
        qq = q.clone().requires_grad_()
        out = fn(qq, k, v)
        out.backward(dout)
        results[name] = (out.detach().float(), qq.grad.float())
    scale = default_scale(D, None)
    for rank in range(P):
        rows = slice(rank * inp.s, (rank + 1) * inp.s)
        packed, causal = ((o[:, rows], g[:, rows]) for o, g in (results["packed"], results["causal"]))
        m = att.Method("packed-torch", None, docs=docs)
        assert att.check_method(m, packed, inp, plan, rank, scale, (k, v), 8) == 0
        assert att.check_method(m, causal, inp, plan, rank, scale, (k, v), 8) > 0  # attends across documents
        assert att.check_method(att.Method("ulysses-torch", None), packed, inp, plan, rank, scale, (k, v), 8) > 0


def test_document_mixes():
    mix = att.packed_documents(64 * 1024)
    lengths = [b - a for a, b in mix.spans()]
    assert mix.total == 64 * 1024 and min(lengths[:-1]) >= 16 and max(lengths) <= 32 * 1024
    assert len(set(lengths)) > 1 and mix.count > 20  # a mix, many documents
    assert att.packed_documents(64 * 1024) == mix  # the same on every rank
    eq = att.equal_documents(100, 7)
    assert eq.count == 7 and eq.cu_seqlens[-1] == 100 and {b - a for a, b in eq.spans()[:-1]} == {14}


def test_bench_attention_packed_rows(tmp_path, capfd):
    assert att.main(
        ["--spawn", "2", "--layouts", "6/2", "--seqs", "128", "--head-dim", "8", "-w", "0", "-n", "1",
         "--methods", "local-packed,ulysses-torch,packed-torch,equal-torch", "--out-dir", str(tmp_path)]
    ) == 0  # fmt: skip
    out = capfd.readouterr().out
    (path,) = [p for p in tmp_path.glob("bench_attention_*.json") if not p.name.endswith("_latest.json")]
    rows = json.loads(path.read_text())["rows"]
    assert {r["method"] for r in rows} == {"local-packed", "ulysses-torch", "packed-torch", "equal-torch"}
    assert all(r["wrong"] == 0 for r in rows), rows
    packed = [r for r in rows if r["method"] == "packed-torch"]
    assert all(r["docs"] == att.packed_documents(128).count > 1 and r["x_equal"] > 0 and r["x_floor"] > 0 for r in packed)
    assert all(r["docs"] == 1 and r["x_equal"] is None for r in rows if r["method"] == "ulysses-torch")
    assert "x_equal" in out and "# wrong elements: 0 OK" in out


def test_graphed_rows_skip_on_the_cpu_and_compare_with_the_graphed_dense_row():
    """``local*+graph`` rows need a GPU (a clear skip here); their ``x_dense`` is against
    ``local+graph`` where that ran (both without host time), else against ``local``."""
    import importlib

    from ulysses_kernels.bench.harness import Skip

    methods = importlib.import_module("ulysses_kernels.bench.attention.methods")
    report = importlib.import_module("ulysses_kernels.bench.attention.report")  # the package's `report` is a function

    inp = types.SimpleNamespace(device=torch.device("cpu"))
    for name in ("local+graph", "local-packed+graph", "local-packed-varlen+graph"):
        with pytest.raises(Skip, match="a CUDA graph needs a GPU"):
            methods.build_method(name, None, inp, None, 0, 1, 8, None, 1.0, None)

    def row(method, tflops, time_ms=1.0):
        return {"method": method, "pass": "fwd", "tflops": tflops, "time_ms": time_ms, "mem_gib": None}

    rows = [row("local", 100.0), row("local+graph", 400.0), row("local-packed", 50.0), row("local-packed+graph", 200.0, 0.5)]
    report._ratios(rows)
    by = {r["method"]: r for r in rows}
    assert by["local-packed"]["x_dense"] == 0.5  # eager against eager
    assert by["local-packed+graph"]["x_dense"] == 0.5  # graphed against graphed (not 2.0 against eager)
    assert by["local-packed+graph"]["x_floor"] == 0.5  # its time over local-packed's
    assert by["local+graph"]["x_dense"] is None and by["local+graph"]["x_floor"] == 1.0
    report._ratios(rows[:1] + rows[2:])  # no graphed dense row: against local
    assert by["local-packed+graph"]["x_dense"] == 2.0
