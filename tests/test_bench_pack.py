"""The pack/unpack benchmark (``ulysses_kernels.bench.pack``): every row's bit-exact check counts 0 on a correct result and more on
a corrupted, partly written or stale one; a wrong kernel makes the script exit non-zero; a
CPU run prints the table and writes the shared result files with the row fields the GPU
runbook (scripts/gpu_session.sh, pack_summary) reads."""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ulysses_kernels.bench import pack as bp
from ulysses_kernels.bench import patterns, record
from ulysses_kernels.kernels import available_kernels, get_kernels
from ulysses_kernels.layout import QKV, Layout
from ulysses_kernels.plan import HeadPlan

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DT = torch.bfloat16
# (Hq, Hkv, P, B, s, D): heads divide (chain rows, batch 2), and KV heads replicated over
# ranks (10/2 on 4 ranks: the unpack sums replicas; no chain rows).
CHAIN_CFG, REPLICA_CFG = (8, 4, 4, 2, 6, 4), (10, 2, 4, 1, 5, 4)


def _flip_one(x: torch.Tensor, index: int) -> None:
    """Flip the lowest bit of one element (a one-element, one-ulp error)."""
    x.view(-1).view(torch.int16)[index] ^= 1


class Corrupt:
    """A kernel set that is wrong in exactly one element of each pack and unpack."""

    def __init__(self, inner):
        self.inner, self.name = inner, f"corrupt-{inner.name}"

    def pack_s2h(self, layout, tensors, roles, send, recv=None):
        self.inner.pack_s2h(layout, tensors, roles, send)
        _flip_one(send, 5)

    def pack_h2s(self, layout, local, send):
        self.inner.pack_h2s(layout, local, send)

    def unpack_h2s(self, layout, blocks, roles, outs):
        self.inner.unpack_h2s(layout, blocks, roles, outs)
        _flip_one(outs[1], 3)  # the k role: on REPLICA_CFG a summed KV head


class SkipsLastPeer(Corrupt):
    """A pack that never writes the last peer's block of the send buffer (unpack correct)."""

    def unpack_h2s(self, layout, blocks, roles, outs):
        self.inner.unpack_h2s(layout, blocks, roles, outs)

    def pack_s2h(self, layout, tensors, roles, send, recv=None):
        full = torch.empty_like(send)
        self.inner.pack_s2h(layout, tensors, roles, full)
        n = sum(layout.s2h_send_splits(roles)[:-1])
        send[:n].copy_(full[:n])


def _kernel_or_skip(name):
    if name not in available_kernels():
        pytest.skip(f"kernel set {name!r} cannot run here (available: {available_kernels()})")
    return name


# ---- the check itself ----------------------------------------------------------------------
def test_count_unequal_bits_is_bit_exact():
    g = torch.Generator().manual_seed(1)
    a = [torch.randn(2, 3, 4, 5, generator=g).to(DT), torch.randn(7, generator=g).to(DT)]
    assert patterns.count_unequal_bits([x.clone() for x in a], a) == 0
    b = [x.clone() for x in a]
    b[0].view(torch.int16)[1, 2, 3, 4] += 1  # one ulp
    b[1][0] = -b[1][0]
    assert patterns.count_unequal_bits(b, a) == 2
    z = torch.zeros(4)
    assert patterns.count_unequal_bits([-z], [z]) == 4  # -0.0 == 0.0 numerically, not bit for bit
    nan = torch.full((3,), float("nan"))
    assert patterns.count_unequal_bits([nan.clone()], [nan]) == 0  # the same NaN bits moved intact
    assert patterns.count_unequal_bits([nan], [torch.ones(3)]) == 3
    assert patterns.count_unequal_bits([a[0][:, :2]], a[:1]) == a[0].numel()  # wrong shape: all of it
    assert patterns.count_unequal_bits([a[0].float()], a[:1]) == a[0].numel()  # wrong dtype: all of it
    assert patterns.count_unequal_bits(a[:1], a) == a[1].numel()  # a missing output: all of it
    # Strided views compare element by element.
    assert patterns.count_unequal_bits([a[0].transpose(1, 2).contiguous().transpose(1, 2)], a[:1]) == 0


@pytest.mark.parametrize("cfg", [CHAIN_CFG, REPLICA_CFG], ids=["chain", "replicas"])
@pytest.mark.parametrize("kernels", ["torch", "triton", "cuda"])
def test_check_is_zero_on_correct_rows_and_counts_corruption(kernels, cfg):
    cases, skipped = bp.build_cases(cfg, DEVICE, DT, [_kernel_or_skip(kernels)])
    assert skipped == {}
    # On a CPU the cuda set's row says what runs: the C++ extension's CPU twin.
    want = ["copy", f"fused ({record.kernel_label(kernels, DEVICE)})", "torch"] + (["chain"] if cfg == CHAIN_CFG else [])
    assert [c.method for c in cases if c.op == "pack"] == want
    assert [c.method for c in cases if c.op == "unpack"] == want
    for case in cases:
        assert bp.check(case) == 0, (case.op, case.method)
        # A one-element error in the first output is one wrong element.
        run = case.run

        def corrupted(run=run):
            outs = run()
            _flip_one(outs[0], 2)
            return outs

        assert bp.check(dataclasses.replace(case, run=corrupted)) == 1, (case.op, case.method)
        if case.poison:
            # A call that writes nothing, on buffers that still hold the previous (correct)
            # result: the NaN poison makes every element count.
            outs = case.run()
            assert patterns.count_unequal_bits(case.view(outs), case.expected) == 0
            stale = dataclasses.replace(case, run=lambda outs=outs: outs)
            assert bp.check(stale) == sum(e.numel() for e in case.expected), (case.op, case.method)


@pytest.mark.parametrize("cfg", [CHAIN_CFG, REPLICA_CFG], ids=["chain", "replicas"])
def test_wrong_kernels_are_counted_only_in_their_rows(cfg):
    inner = get_kernels("torch", DEVICE)
    for kern, want_pack, want_unpack in (
        (Corrupt(inner), 1, 1),
        (SkipsLastPeer(inner), None, 0),  # None: the last peer's block, computed below
    ):
        cases, _ = bp.build_cases(cfg, DEVICE, DT, [kern])
        wrong = {(c.op, c.method): bp.check(c) for c in cases}
        name = f"fused ({kern.name})"
        if want_pack is None:
            hq, hkv, world, batch, seq, d = cfg
            case = next(c for c in cases if c.method == name and c.op == "pack")
            last = case.size // DT.itemsize - sum(Layout(HeadPlan.build(hq, hkv, world), 0, (seq,) * world, batch, d).s2h_send_splits(QKV)[:-1])
            assert last > 0
            want_pack = last
        assert wrong.pop(("pack", name)) == want_pack
        assert wrong.pop(("unpack", name)) == want_unpack
        assert set(wrong.values()) == {0}, wrong


def test_unavailable_kernel_set_is_reported_not_run():
    cases, skipped = bp.build_cases(REPLICA_CFG, DEVICE, DT, ["no-such-kernels"])
    assert list(skipped) == ["fused (no-such-kernels)"] and "expected" in skipped["fused (no-such-kernels)"]
    assert not any(c.method.startswith("fused") for c in cases)
    assert bp.parse_configs("8/4/4/2/6/4,10/2/4/1/5/4", gpu=False) == [CHAIN_CFG, REPLICA_CFG]
    with pytest.raises(SystemExit, match="Hq/Hkv/P/B/s/D"):
        bp.parse_configs("8/4/4", gpu=False)


# ---- the script ----------------------------------------------------------------------------
def _result(out: Path) -> dict:
    files = sorted(out.glob("bench_pack_2*_w1.json"))
    assert len(files) == 1, files
    doc = json.loads(files[0].read_text())
    assert json.loads((out / "bench_pack_latest.json").read_text()) == doc
    with open(files[0].with_suffix(".csv")) as f:
        assert [r["method"] for r in csv.DictReader(f)] == [r["method"] for r in doc["rows"]]
    return doc


def _pack_summary(rows) -> dict:
    """What scripts/gpu_session.sh's pack_summary() reads: (config, op) -> first word of
    the method -> time_us; it divides copy by fused and chain by fused."""
    by = collections.defaultdict(dict)
    for r in rows:
        by[(r["config"], r["op"])][r["method"].split()[0]] = r["time_us"]
    return by


def test_cpu_smoke_prints_checks_and_writes(tmp_path, capsys):
    # The CLI of scripts/bench_smoke.sh (the default CPU configs: the smallest sizes).
    assert bp.main(["--device", "cpu", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for text in ("size(B)", "time(us)", "GB/s", "% copy", "x_chain", "#wrong", record.CPU_LABEL, "wrong elements: 0 OK"):
        assert text in out, text
    doc = _result(tmp_path)
    env, rows = doc["env"], doc["rows"]
    assert env["gpu"] == "cpu" and record.CPU_LABEL in env["timer"] and env["world_size"] == 1
    assert env["git_sha"] and env["torch"] == torch.__version__ and "git_dirty" in env
    assert doc["meta"]["configs"] == [bp.config_label(c) for c in bp.CPU_CONFIGS]
    assert all(r["wrong"] == 0 for r in rows)
    labels = tuple(bp.config_label(c) for c in bp.CPU_CONFIGS)
    table = [line.split() for line in out.splitlines() if line.strip().startswith(labels)]
    assert len(table) == len(rows) and all(cells[-1] == "0" for cells in table)  # one line per row, #wrong last
    by = _pack_summary(rows)
    assert len(by) == 2 * len(bp.CPU_CONFIGS)
    for m in by.values():
        assert {"copy", "fused", "torch"} <= set(m) <= {"copy", "fused", "torch", "chain"}
        assert m["copy"] > 0 and m["fused"] > 0
    assert ("chain" in by[(bp.config_label(bp.CPU_CONFIGS[0]), "pack")]) and "chain" not in by[(bp.config_label(bp.CPU_CONFIGS[1]), "pack")]
    for r in rows:
        copy_row = next(x for x in rows if (x["config"], x["op"], x["method"]) == (r["config"], r["op"], "copy"))
        assert r["pct_copy"] == pytest.approx(100 * r["gbps"] / copy_row["gbps"])  # bandwidth, not time
        chain = by[(r["config"], r["op"])].get("chain")
        assert r["x_chain"] == (None if chain is None else pytest.approx(chain / r["time_us"]))
        assert r["gbps"] == pytest.approx(r["bytes_moved"] / r["time_us"] / 1e3)


def test_script_exits_non_zero_on_a_wrong_kernel(tmp_path, capsys, monkeypatch):
    real = bp.get_kernels
    monkeypatch.setattr(bp, "get_kernels", lambda name, device, layout=None: Corrupt(real(name, device, layout)))
    argv = ["--device", "cpu", "-w", "0", "-n", "1", "--kernels", "torch", "--configs", "10/2/4/1/5/4", "--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="bench_pack: 2 wrong elements") as exc:
        bp.main(argv)
    assert exc.value.code not in (0, None)  # sys.exit("...") exits with status 1
    assert "wrong elements: 2 FAILED" in capsys.readouterr().out
    rows = _result(tmp_path)["rows"]  # the files are written before the exit
    assert {(r["op"], r["method"]): r["wrong"] for r in rows if r["wrong"]} == {
        ("pack", "fused (corrupt-torch)"): 1,
        ("unpack", "fused (corrupt-torch)"): 1,
    }


@pytest.mark.skipif("cuda" not in available_kernels(), reason="needs the C++ extension")
def test_variant_sweep_runs_each_sets_own_variants(tmp_path, capsys):
    # --variants old,new: the cuda rows run new only (cuda's one variant; "old" is triton's), one
    # row each, and the "# variants" line has no ratio (no second cuda variant to compare with).
    from ulysses_kernels import extension

    before = extension.pack_variant()
    argv = ["--device", str(DEVICE), "-w", "0", "-n", "1", "--kernels", "cuda,torch", "--variants", "old,new"]
    assert bp.main([*argv, "--configs", "10/2/4/1/5/4", "--out-dir", str(tmp_path)]) == 0
    assert extension.pack_variant() == before  # each row's variant is restored after it
    out = capsys.readouterr().out
    doc = _result(tmp_path)
    fused = sorted({(r["op"], r["variant"]) for r in doc["rows"] if r["method"].startswith("fused (cuda")})
    assert fused == [("pack", "new"), ("unpack", "new")]
    assert all(r["wrong"] == 0 for r in doc["rows"])
    summary = doc["meta"]["variants"]["cuda"]
    for op in ("pack", "unpack"):
        assert set(summary[op]) == {"new"}, summary[op]
        assert f"# variants cuda {op}: new worst" in out
    assert "time new/" not in out
    with pytest.raises(SystemExit, match=r"--variants wants a comma list of \['old', 'new'\], got 'new,wide'"):
        bp.parse_variants("new,wide")  # the cuda "wide" variant was removed (issue 49)


def test_variant_summary_ratio_is_per_set():
    # Synthetic rows: triton old is twice as slow as new (x_old_over_new = 2: new faster).
    rows = [
        {"method": f"fused (triton {v})", "op": "pack", "variant": v, "config": c, "pct_copy": p, "time_us": t}
        for c in ("a", "b")
        for v, p, t in (("old", 40.0, 20.0), ("new", 80.0, 10.0))
    ]
    ent = bp.variant_summary(rows)["triton"]["pack"]
    assert ent["x_old_over_new"] == pytest.approx(2.0) and ent["faster"] == "new"
    assert ent["old"]["worst_pct_copy"] == 40.0 and ent["new"]["worst_pct_copy"] == 80.0
