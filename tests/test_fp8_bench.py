"""The FP8 wire's benchmark pieces on the CPU: the quantizing pack's rows (a dry run, every
row checked bit for bit) and the performance model's FP8 columns."""

from __future__ import annotations

import re

import pytest

from ulysses_kernels.bench import pack_fp8, perf_model
from ulysses_kernels.kernels import available_kernels
from ulysses_kernels.wire import wire_bytes_ratio


def test_pack_fp8_dry_run_checks_every_row(capsys):
    names = ",".join(n for n in ("torch", "cuda") if n in available_kernels())
    assert pack_fp8.main(["--device", "cpu", "--kernels", names, "--configs", "4/2/2/1/8/8", "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "pack-fp8" in out and "CPU: a dry run" in out
    # every FP8 row checked bit for bit: "#wrong" 0 on the pack and on the dequantizing unpack, per kernel set
    for op in ("pack-fp8", "unpack-fp8"):
        counts = re.findall(rf"\s{op}\s+\d+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+%\s+(\d+)", out)
        assert counts == ["0"] * len(names.split(",")), (op, out)


@pytest.mark.parametrize("world", [8, 16])
def test_perf_model_fp8_halves_the_wire(world):
    args = perf_model.parse_args(["--models", "llama3-8b", "--worlds", str(world), "--seqs", "128K", "--passes", "fwdbwd"])
    (row,) = perf_model.table(args)
    # Every exchange's bytes scale by (D + 4) / (2 D); the wire time with them (bandwidth-bound model).
    assert row["fp8_wire_ms"] == pytest.approx(row["wire_ms"] * wire_bytes_ratio(128, 2), rel=1e-9)
    assert row["fp8_ms"] < row["ours_ms"] and row["x_fp8"] > 1
