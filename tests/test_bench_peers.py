"""The attention benchmark's peer rows (DeepSpeed's DistributedAttention, yunchang's UlyssesAttention)
run at a tiny size on 2 gloo ranks, are timed and are checked correct; a peer that is not
installed, or cannot run here, skips with the reason the benchmark gives."""

from __future__ import annotations

import importlib.util
import json

import pytest

from ulysses_kernels.bench import attention

PEERS = ("deepspeed", "yunchang")


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
    """One spawn for every installed peer: the result document of bench_attention."""
    installed = [p for p in PEERS if importlib.util.find_spec(p) is not None]
    if not installed:
        return None
    out = tmp_path_factory.mktemp("peers")
    # 6/2 on 2 ranks: query and KV heads divide, which both peers assume.
    argv = ["--spawn", "2", "--layouts", "6/2", "--seqs", "32", "--head-dim", "8", "-w", "0", "-n", "1",
            "--methods", ",".join(["local", *installed]), "--passes", "fwd,fwdbwd", "--out-dir", str(out)]  # fmt: skip
    assert attention.main(argv) == 0
    (path,) = [p for p in out.glob("bench_attention_*.json") if not p.name.endswith("_latest.json")]
    return json.loads(path.read_text())


@pytest.mark.parametrize("peer", PEERS)
def test_peer_row_is_measured_and_correct(peer, peer_run):
    if importlib.util.find_spec(peer) is None:
        pytest.skip(f"{peer} is not installed (an optional baseline)")
    why = peer_run["meta"]["skipped"].get(f"6/2 S=32 {peer}")
    if why and ("not importable" in why or "cannot be built here" in why):
        pytest.skip(f"{peer} cannot run here: {why}")
    assert not why, f"{peer} is installed but its row failed: {why}"  # e.g. a call its API rejects
    rows = [r for r in peer_run["rows"] if r["method"] == peer]
    assert {r["pass"] for r in rows} == {"fwd", "fwdbwd"}, peer_run["rows"]
    for r in rows:
        assert r["time_ms"] > 0 and r["x_floor"] > 0
        assert r["wrong"] == 0, r  # checked (not None) against the float32 reference, and right
