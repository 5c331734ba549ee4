"""The benchmarks' own judges can say no: the all-to-all benchmark's ``check()`` counts a
corrupted result as wrong for every kind of row, and the overlap benchmark's ``verdicts()``
fails its targets (exposed/a2a <= 10% at long sequences, auto no slower than chunks=1) when
the numbers miss them (and passes them when they do not)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from ulysses_kernels.bench import alltoall, overlap
from ulysses_kernels.comm import TorchCommunicator
from ulysses_kernels.kernels import available_kernels
from ulysses_kernels.testing import run_ranks


# ---- bench_alltoall: check() finds a wrong result -----------------------------------------
def _cases(a2a, rank: int, world: int):
    """(name, direction, case) for every kind of row that runs on the CPU: the bare
    collective, the permute chain and ours per kernel set, both directions."""
    cpu, comm = torch.device("cpu"), TorchCommunicator(None)
    out = []
    for direction in ("s2h", "h2s"):
        sh = a2a.Shape(batch=2, seq=5, heads=6, kv_heads=2, head_dim=4, direction=direction, world=world)
        if direction == "s2h":
            out.append(("a2a", direction, a2a.bare_case("a2a", sh, torch.float32, cpu, rank, world)))
        out.append(("chain", direction, a2a.layout_case("chain", sh, torch.float32, cpu, rank, world)))
        for k in available_kernels():
            case = a2a.layout_case(f"fused-{k}", sh, torch.float32, cpu, rank, world, kernels=k, comm=comm)
            out.append((f"fused-{k}", direction, case))
    return out


def _as_list(res):
    return [res] if isinstance(res, torch.Tensor) else list(res)


def _clone(res):
    return [x.clone() for x in _as_list(res)]


@pytest.fixture
def world_of_one():
    """A gloo group of one in this process (the collectives run; no process is spawned)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_alltoall_checks_count_a_corrupted_output(world_of_one):
    a2a = alltoall
    kinds = set()
    for name, direction, case in _cases(a2a, 0, 1):
        res = case.run()
        good = _clone(res)
        check = (lambda xs, case=case: case.check(xs[0])) if isinstance(res, torch.Tensor) else case.check
        assert check(good) == 0, (name, direction)
        # One element off by one: exactly one wrong element, in any of the tensors.
        for i in range(len(good)):
            bad = _clone(good)
            bad[i].view(-1)[bad[i].numel() // 2 + 1] += 1
            assert check(bad) == 1, (name, direction, i)
        # Two blocks exchanged (tokens of a flat buffer; heads of a 4-D output): many wrong.
        bad = _clone(good)
        x = bad[0]
        if x.dim() == 1:
            x[:2] = x[:2].flip(0).clone()
        else:
            x[:, :, :2] = x[:, :, :2].flip(2).clone()
        assert check(bad) > 0, (name, direction)
        kinds.add(name)
    assert {"a2a", "chain"} | {f"fused-{k}" for k in available_kernels()} <= kinds


def _swapped_peers_body(rank: int, world: int) -> None:
    """On each rank: every kind of row is right as it comes, and wrong (on this rank) when
    the blocks received from the peers are delivered in the wrong order."""
    a2a = alltoall
    for name, direction, case in _cases(a2a, rank, world):
        res = case.run()
        good = _clone(res)
        check = (lambda xs, case=case: case.check(xs[0])) if isinstance(res, torch.Tensor) else case.check
        assert check(good) == 0, (rank, name, direction)
        x = good[0]
        if x.dim() == 1:  # [world * chunk]: peer j's block at j
            bad = x.view(world, -1).roll(1, dims=0).reshape(-1)
        elif direction == "s2h":  # [B, world * s, h, D]: peer j's rows at j
            bad = x.roll(x.shape[1] // world, dims=1)
        else:  # [B, s, H, D]: peer j's heads; the plan gives each rank H / world here
            bad = x.roll(x.shape[2] // world, dims=2)
        assert check([bad] + good[1:]) > bad.numel() // 2, (rank, name, direction)


def test_alltoall_checks_find_blocks_from_the_wrong_peer():
    # Two gloo ranks (one spawn, ~10 s): at a world of one no block comes from a peer.
    run_ranks(_swapped_peers_body, 2)


# ---- bench_overlap: the targets' verdicts ---------------------------------------------------
def _row(seq, chunks, layer_ms, *, auto=False, spread=0.0, layout="32/8", pass_="fwd", attn_ms=100.0, a2a_ms=10.0):
    exposed = max(0.0, layer_ms - attn_ms)
    return {"layout": layout, "seq": seq, "pass": pass_, "chunks": chunks, "auto": auto, "layer_ms": layer_ms,
            "attn_ms": attn_ms, "a2a_ms": a2a_ms, "exposed_ms": exposed, "exposed_frac": exposed / a2a_ms,
            "spread": spread}  # fmt: skip


def _statuses(v, name):
    return [(g["seq"], g["status"]) for g in v[name]["groups"]]


def test_overlap_exposed_verdict_passes_5_percent_and_fails_15():
    ov = overlap
    L = 32768
    rows = [_row(L, 1, 110.0), _row(L, 2, 100.5), _row(L, 4, 101.0)]  # best chunked: 0.5 ms of 10 = 5%
    rows += [_row(2 * L, 1, 110.0), _row(2 * L, 4, 101.5)]  # 15%
    rows += [_row(L // 2, 1, 150.0), _row(L // 2, 2, 140.0)]  # short: not judged
    v = ov.verdicts(rows, long_from=L)
    ex = v["exposed"]
    assert _statuses(v, "exposed") == [(L, "PASS"), (2 * L, "FAIL")]
    assert ex["groups"][0]["chunks"] == 2 and ex["groups"][0]["value"] == pytest.approx(0.05)
    assert ex["groups"][1]["value"] == pytest.approx(0.15)
    assert ex["status"] == "FAIL" and "1 of 2" in ex["reason"]
    assert ov.verdicts(rows[:3], long_from=L)["exposed"]["status"] == "PASS"
    # The threshold moves the covered groups: from 64K only the 15% group is judged.
    assert _statuses(ov.verdicts(rows, long_from=2 * L), "exposed") == [(2 * L, "FAIL")]
    # Nothing long, or no chunked row at a long sequence: not evaluated, and why.
    short = ov.verdicts(rows, long_from=4 * L)["exposed"]
    assert short["status"] == "not evaluated" and "no sequence >= 131072" in short["reason"]
    one = ov.verdicts([_row(L, 1, 110.0)], long_from=L)["exposed"]
    assert one["status"] == "not evaluated" and one["groups"][0]["reason"].startswith("no chunked row")
    # CPU (or one GPU) timings: not evaluated, but the numbers' outcome is kept.
    cpu = ov.verdicts(rows, long_from=L, not_a_claim="CPU run: timings are not GPU claims")["exposed"]
    assert cpu["status"] == "not evaluated" and cpu["reason"].startswith("CPU run") and "FAIL" in cpu["reason"]
    assert [g["measured"] for g in cpu["groups"]] == ["PASS", "FAIL"]
    assert all(g["status"] == "not evaluated" for g in cpu["groups"])


def test_overlap_auto_verdict_within_the_run_spread():
    ov = overlap
    faster = [_row(64, 1, 10.0, spread=0.01), _row(64, 2, 8.0, auto=True, spread=0.01)]
    slower = [_row(128, 1, 10.0, spread=0.05), _row(128, 4, 12.0, auto=True, spread=0.02)]  # +20% > 5%
    noisy = [_row(256, 1, 10.0, spread=0.05), _row(256, 2, 10.3, auto=True, spread=0.01)]  # +3% <= 5%
    same = [_row(512, 1, 10.0, auto=True), _row(512, 2, 9.0)]  # auto picks 1: the same call
    v = ov.verdicts(faster + slower + noisy + same, long_from=1 << 30)
    assert _statuses(v, "auto") == [(64, "PASS"), (128, "FAIL"), (256, "PASS"), (512, "PASS")]
    g = {x["seq"]: x for x in v["auto"]["groups"]}
    assert g[128]["value"] == pytest.approx(1.2) and g[128]["allowance"] == pytest.approx(0.05)
    assert g[512]["value"] == 1.0 and g[512]["chunks"] == 1
    assert v["auto"]["status"] == "FAIL"
    # Strict (--auto-slack 0): the 3% slower auto row fails too.
    strict = ov.verdicts(faster + noisy, long_from=1 << 30, slack=0.0)
    assert _statuses(strict, "auto") == [(64, "PASS"), (256, "FAIL")]
    assert ov.verdicts(faster + noisy, long_from=1 << 30)["auto"]["status"] == "PASS"
    # No auto row: not evaluated, and why.
    none = ov.verdicts([_row(64, 1, 10.0), _row(64, 2, 9.0)], long_from=1 << 30)["auto"]
    assert none["status"] == "not evaluated" and none["reason"] == "no auto row"


@pytest.mark.parametrize("uuids, shared", [(["GPU-a", "GPU-a", "GPU-b"], [0, 1]), (["GPU-a", "GPU-b", "GPU-c"], [])])
def test_symmetric_memory_is_skipped_where_ranks_share_a_gpu(monkeypatch, uuids, shared):
    """NVSHMEM aborts a process whose GPU another rank uses (2026-11-30, 8 NCCL ranks on one H200):
    the symm op asks first which ranks share a GPU, from every rank's device UUID."""
    import types

    me = 1
    monkeypatch.setattr(alltoall.torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid=uuids[me]))
    monkeypatch.setattr(alltoall.dist, "get_world_size", lambda: len(uuids))
    monkeypatch.setattr(alltoall.dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj if r == me else u for r, u in enumerate(uuids)]))
    assert alltoall.ranks_sharing_a_gpu(torch.device("cuda", 0)) == shared
