"""The README's main job, at a small size: it must pass its own check and print the plan;
and the benchmark part of the demo is a short, labelled summary a newcomer can read."""

import re

from ulysses_kernels import demo
from ulysses_kernels.bench import summary
from ulysses_kernels.kernels import available_kernels


def test_demo_runs_and_matches_the_reference(capfd):
    assert demo.main(["--world-size", "3", "--q-heads", "10", "--kv-heads", "2", "--seq", "11", "--batch", "2", "--head-dim", "8"]) == 0
    printed = capfd.readouterr().out
    assert "HeadPlan: 10 query heads, 2 KV heads (KV group 5), 3 ranks" in printed
    assert "ulysses_attention matches single-process attention" in printed
    assert re.search(r"fwd\+bwd \d+\.\d ms on rank 0 \(one call on the CPU: a code-path check, not a GPU claim\)$", printed, re.M), printed
    assert "MISMATCH" not in printed


def test_benchmark_summary_is_short_labelled_and_checked(tmp_path, capfd):
    # Two benchmarks at a tiny size, 2 gloo ranks each (about 30 s here).
    assert summary.main(["--size", "4K", "--seq", "64", "-n", "1", "--out-dir", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) <= 14, out  # a handful of lines, not the full tables
    assert "CPU timings, not a GPU claim" in lines[0]
    # Ours against the permute chain, for the all-to-all and for the layer, every kernel set
    # named for what runs: on a CPU the cuda set is the C++ extension's CPU twin.
    sets = ["torch kernels"] + (["C++ CPU twin kernels"] if "cuda" in available_kernels() else [])
    for section in ("all-to-all of q, k, v", "attention layer, forward + backward"):
        start = next(i for i, line in enumerate(lines) if section in line)
        block = lines[start + 1 : start + 2 + len(sets) + 1]
        assert "permute chain" in block[0] and re.search(r"\d+\.\d{3} ms", block[0]), block
        for line, what in zip(block[1:], sets):
            assert f"ours ({what})" in line, block
            # A speed-up with its spread, or the flag of a time below its floor; either says it is a CPU timing.
            ratio = r"\d+\.\dx (faster|slower) than the chain \(quartiles \d+\.\d-\d+\.\dx\)"
            flags = r"FLAGGED: faster than its floor \(.*\): timing noise, not a win|no ratio: the chain ran faster than the floor .*"
            assert re.search(rf"({ratio}|{flags}); CPU \(not a GPU claim\): a code-path check$", line), block
    assert "(cuda)" not in out and "fused-cuda" not in out
    assert "every row checked against its reference: 0 wrong elements" in out
    # No chunked-overlap rows (CPU chunking at tiny sizes is a code-path check, not a result),
    # and no internal references.
    assert "chunks" not in out and not re.search(r"issue #|#\d item|item \d|engineer", out)
    assert (tmp_path / "bench_alltoall_latest.json").exists() and (tmp_path / "bench_attention_latest.json").exists()


def _row(key, median, q1, q3, **fields):
    unit = key.rsplit("_", 1)[1]
    return {key: median, f"time_q1_{unit}": q1, f"time_q3_{unit}": q3, **fields}


def test_summary_lines_give_the_spread_and_flag_a_time_below_the_floor():
    """The ratio of two medians alone read "13.5x" in one run and "2.7x" in the next: each
    speed-up comes with the ratio between the quartiles, and ours faster than the bare
    all-to-all it runs on (or a layer faster than its attention alone) is flagged, with no
    speed-up."""
    a2a = {"meta": {}, "rows": [_row("time_us", 1000.0, 900.0, 1500.0, op="chain", size=4096),
                                 _row("time_us", 250.0, 200.0, 500.0, op="fused-torch", size=4096),
                                 _row("time_us", 300.0, 280.0, 320.0, op="a2a", size=4096)]}  # fmt: skip
    lines = summary.alltoall_lines(a2a, ["torch"])
    ours = next(line for line in lines if "ours (torch kernels)" in line)
    assert "FLAGGED: faster than its floor (the bare all-to-all: 0.3 ms): timing noise, not a win" in ours, lines
    assert "faster than the chain" not in ours and "CPU (not a GPU claim): a code-path check" in ours, lines
    a2a["rows"][2].update(time_us=200.0, time_q1_us=190.0, time_q3_us=210.0)
    ours = next(line for line in summary.alltoall_lines(a2a, ["torch"]) if "ours (torch kernels)" in line)
    assert "4.0x faster than the chain (quartiles 1.8-7.5x); CPU (not a GPU claim): a code-path check" in ours, ours
    attn = {"meta": {}, "rows": [_row("time_ms", 10.0, 9.0, 11.0, method="chain", **{"pass": "fwdbwd"}),
                                  _row("time_ms", 12.0, 11.0, 14.0, method="ulysses-torch", **{"pass": "fwdbwd"}),
                                  _row("time_ms", 5.0, 4.0, 6.0, method="local", **{"pass": "fwdbwd"})]}  # fmt: skip
    ours = next(line for line in summary.attention_lines(attn, ["torch"], 64) if "ours (torch kernels)" in line)
    assert "1.2x slower than the chain (quartiles 1.0-1.6x)" in ours, ours
