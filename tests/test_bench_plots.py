"""Each benchmark's plot() draws a non-empty PNG from a small result (matplotlib's Agg
backend, no display), and says False, writing nothing, when matplotlib is absent."""

from __future__ import annotations

import importlib

import pytest
import torch

from ulysses_kernels.bench import record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The result files keep the names bench_<module>_*; the modules are ulysses_kernels.bench.<module>.
MODULES = {"bench_alltoall": "alltoall", "bench_attention": "attention", "bench_overlap": "overlap", "bench_pack": "pack"}


def _load(name: str):
    return importlib.import_module(f"ulysses_kernels.bench.{MODULES[name]}")


def _alltoall():
    rows = [{"op": op, "size": n, "busbw": bw * n / 4096} for op in ("a2a", "chain", "fused-torch") for n, bw in ((1024, 1.0), (4096, 2.0))]
    return rows, {}


def _attention():
    breakdown = [
        {"model": "6/2", "seq": S, "pass": p, "kernels": "torch", "total_ms": 3.0 * S / 32, "compute_ms": 1.5 * S / 32,
         "layout_ms": 0.5 * S / 32, "exposed_comm_ms": (1.0 if S == 32 else -0.1) * S / 32}  # a negative gap is drawn as 0
        for S in (32, 64) for p in ("fwd", "fwdbwd")
    ]  # fmt: skip
    return breakdown, {}


def _overlap():
    rows = [
        {"pass": p, "layout": "8/2", "chunks_label": c, "seq": S, "exposed_frac": None if c == "1" and S == 64 else 0.5 / int(c[0])}
        for p in ("fwd", "fwdbwd") for c in ("1", "2", "4*") for S in (32, 64)
    ]  # fmt: skip
    return rows, {}


def _pack():
    rows = [
        {"config": cfg, "op": op, "method": m, "pct_copy": pct}
        for cfg in ("8/4/4/2/6/4", "10/2/4/1/5/4") for op in ("pack", "unpack")
        for m, pct in (("copy", 100.0), ("fused", 80.0), ("torch", 40.0), ("chain", 20.0))
        if not (m == "chain" and cfg.startswith("10/"))
    ]  # fmt: skip
    return rows, {"dtype": "bf16"}


CASES = {"bench_alltoall": _alltoall, "bench_attention": _attention, "bench_overlap": _overlap, "bench_pack": _pack}


@pytest.mark.parametrize("script", sorted(CASES))
def test_plot_writes_a_png(script, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib draws the PNGs (scripts/setup.sh installs it)")
    mod = _load(script)
    rows, extra = CASES[script]()
    env = dict(record.env_record(torch.device("cpu"), 2, "gloo"), **extra)
    path = tmp_path / f"{script}.png"
    assert mod.plot(rows, str(path), env) is True
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, len(data)  # a drawn figure, not an empty file
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []  # the figure was closed (a long sweep must not pile them up)


@pytest.mark.parametrize("script", sorted(CASES))
def test_plot_without_matplotlib_writes_nothing(script, tmp_path, monkeypatch):
    mod = _load(script)
    monkeypatch.setattr(record, "load_pyplot", lambda: None)
    rows, extra = CASES[script]()
    path = tmp_path / "none.png"
    assert mod.plot(rows, str(path), dict(record.env_record(torch.device("cpu"), 2, "gloo"), **extra)) is False
    assert not path.exists()


@pytest.mark.parametrize("script", ["bench_alltoall", "bench_overlap"])
def test_plot_of_no_rows_writes_nothing(script, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib draws the PNGs (scripts/setup.sh installs it)")
    mod = _load(script)
    path = tmp_path / "empty.png"
    assert mod.plot([], str(path), record.env_record(torch.device("cpu"), 2, "gloo")) is False
    assert not path.exists()
