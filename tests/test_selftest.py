"""``python -m ulysses_kernels.selftest``, run as users run it: installed, from a directory
outside the checkout, on gloo ranks on the CPU.

* every path this machine can run passes at 2 spawned ranks (flat and 2-D Ulysses x ring
  groups, plain and under activation checkpointing), and the JSON lists each one;
* the torchrun launch at 3 ranks (an awkward world size) with ``--quick``;
* deliberately broken kernel sets (one that corrupts one element on rank 1, one that
  raises on rank 1 only, before the all-to-all its peer waits in, one whose results drift
  by 1e-13 a call, so a checkpointed run differs from the plain one) and a ring level that
  corrupts its zigzag output on rank 1 are FAILs with the reason, the exit status is
  non-zero, and the ranks stay in step: the paths after them run and pass;
* the cases have the properties their names promise at every world size;
* ``--layouts``, the old name of ``--cases``, still picks the cases.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ulysses_kernels import selftest
from ulysses_kernels.kernels import available_kernels
from ulysses_kernels.layout import split_lengths
from ulysses_kernels.plan import HeadPlan

CK = selftest.CHECKPOINT_CHUNKS  # the chunk count of the checkpoint paths
# Before torch 2.9 a checkpointed call runs unchunked (checkpointing.chunks_recompute_apart), so the
# self-test holds it to the bound, not to bit-equality with the chunked plain run.
BIT_EQUAL_CHECKPOINT = hasattr(torch.utils.checkpoint, "GraphExecGroup")

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def user_env(**extra) -> dict:
    """A user's shell: no PYTHONPATH; TRITON_INTERPRET only where given."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run(argv, cwd, *, env, timeout=400) -> subprocess.CompletedProcess:
    argv = [str(a) for a in argv]
    try:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{shlex.join(argv)} did not finish in {timeout} s (a hang?):\n{e.stdout}\n{e.stderr}")


def load(path: Path, r: subprocess.CompletedProcess) -> dict:
    assert path.exists(), f"no {path.name} written:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return json.loads(path.read_text())


def progress_lines(stderr: str) -> list[str]:
    return re.findall(r"^\[selftest (\d+)/(\d+) .*\] (PASS|FAIL|SKIP) ([^\s:]+):", stderr, re.M)


def test_cpu_run_at_two_gloo_ranks_passes_every_path(tmp_path):
    # The Triton interpreter on: every kernel set this machine has is a path.
    argv = [sys.executable, "-I", "-m", "ulysses_kernels.selftest", "--spawn", "2", "--json", "out/selftest.json"]
    r = run(argv, tmp_path, env=user_env(TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = load(tmp_path / "out" / "selftest.json", r)
    kernels = available_kernels()  # conftest sets TRITON_INTERPRET=1 here too
    assert "triton" in kernels and "torch" in kernels
    names = ("mha", "gqa", "uneven-heads", "uneven-shards", "packed", "ring-1x2", "ring-1x2-zigzag", "ring-1x2-packed", "ring-1x2-zigzag-packed",
             "mla", "mla-wide-v", "ring-1x2-mla")  # fmt: skip
    expected = {f"{k}/torch-dist/chunks={c}/{name}" for k, c, name in itertools.product(kernels, ("1", "2", "auto"), names)}
    expected |= {f"{k}/torch-dist/chunks={CK}/{name}/checkpoint" for k, name in itertools.product(kernels, names)}
    paths = {p["path"]: p for p in doc["paths"]}
    assert len(doc["paths"]) == len(paths) and set(paths) == expected, sorted(set(paths) ^ expected)
    assert doc["ok"] and doc["complete"] and doc["counts"] == {"PASS": len(expected), "FAIL": 0, "SKIP": 0}
    for p in doc["paths"]:
        assert p["status"] == "PASS" and p["dtype"] == "fp64", p
        assert set(p["errors"]) == {"out", "dq", "dk", "dv"} and max(p["errors"].values()) <= 1e-10, p
        assert p["max_error"] == max(p["errors"].values()) and p["bound"] == 1e-10 and p["time_ms"] > 0, p
        if p["chunks"] == 2:
            assert p["chunks_run"] == 2, p  # the chunked pipeline ran, not the unchunked op
        assert set(p) == set(doc["paths"][0]), p  # every record has the same fields
        # The checkpointed run is bit-equal to the plain one on the CPU (from torch 2.9).
        assert p["checkpoint"] == p["path"].endswith("/checkpoint") and (p["checkpoint_diff"] is None) != p["checkpoint"], p
        if p["checkpoint"]:
            assert set(p["checkpoint_diff"].values()) == {0.0} if BIT_EQUAL_CHECKPOINT else max(p["checkpoint_diff"].values()) <= 1e-10, p
        assert p["case"] == p["layout"], p  # "layout": the key records carried before cases were named cases
        two_d = p["case"].startswith("ring-")
        assert (p["ulysses_size"], p["ring_size"]) == ((1, 2) if two_d else (2, 1)), p
        assert p["seq_layout"] == ("zigzag" if "zigzag" in p["case"] else "contiguous"), p
        assert p["backend"].startswith("ring(") == two_d, p
        assert (p["cu_seqlens"] == [0, 1, 9, 11, 16]) if p["case"].endswith("packed") else p["cu_seqlens"] is None, p
        # MLA: v (and the output) at 3/4 and 3/2 of q's head dim (16 on the CPU).
        assert p["v_head_dim"] == {"mla": 12, "mla-wide-v": 24, "ring-1x2-mla": 12}.get(p["case"], p["head_dim"]), p
    # The cases at 2 ranks: GQA with one KV head, 3 query heads, a 17-token sequence.
    gqa, heads, shards = (paths[f"torch/torch-dist/chunks=1/{name}"] for name in ("gqa", "uneven-heads", "uneven-shards"))
    assert gqa["kv_heads"] < 2 and heads["q_heads"] % 2 and sum(shards["seq_lens"]) % 2 and shards["seq_lens"] == split_lengths(sum(shards["seq_lens"]), 2)
    env = doc["environment"]
    for key in ("torch", "cuda", "nccl", "gpu", "git_sha", "ulysses_kernels", "date"):
        assert key in env, key
    assert env["gpu"] == "cpu" and doc["settings"]["world_size"] == 2 and doc["settings"]["transport"] == "gloo"
    assert doc["settings"]["cases"] == doc["settings"]["layouts"] == list(dict.fromkeys(p["case"] for p in doc["paths"]))
    assert "comm nccl" in doc["not_tested"] and "comm nccl-borrowed" in doc["not_tested"]
    # A progress line per path on stderr, in order; the table and the verdict on stdout.
    lines = progress_lines(r.stderr)
    assert [int(n) for n, *_ in lines] == list(range(1, len(expected) + 1)), r.stderr
    assert [name for *_, name in lines] == [p["path"] for p in doc["paths"]]
    table = [line for line in r.stdout.splitlines() if line.split(" ")[0] in expected]
    assert len(table) == len(expected) and all(re.search(r"\bPASS\b", line) for line in table), r.stdout
    # The header is our first line (torch 2.8's gloo prints "[Gloo] Rank 0 is connected ..." before it).
    ours = [line for line in r.stdout.splitlines() if not line.startswith("[Gloo]")]
    assert ours[0].startswith("ulysses_kernels self-test") and "CPU (not a GPU claim)" in ours[0], r.stdout[:2000]
    assert f"{len(expected)} passed, 0 failed" in r.stdout and "every path matches the float64 reference" in r.stdout


def test_torchrun_at_three_ranks_quick(tmp_path):
    kernels = [k for k in ("torch", "cuda") if k in available_kernels()]  # cuda: the C++ extension's CPU twin
    argv = [BIN / "torchrun", "--standalone", "--nproc-per-node", "3", "-m", "ulysses_kernels.selftest", "--quick"]
    argv += ["--kernels", ",".join(kernels), "--json", "q.json"]
    r = run(argv, tmp_path, env=user_env())
    assert r.returncode == 0, r.stdout + r.stderr
    doc = load(tmp_path / "q.json", r)
    names = ("gqa", "uneven-shards", "packed", "ring-1x3-zigzag", "mla")  # QUICK_CASES at 3 ranks
    expected = {f"{k}/torch-dist/chunks={c}/{name}" for k in kernels for c in selftest.QUICK_CHUNKS for name in names}
    expected |= {f"{k}/torch-dist/chunks={CK}/{name}/checkpoint" for k in kernels for name in names}
    assert {p["path"] for p in doc["paths"]} == expected and doc["ok"] and doc["counts"]["PASS"] == len(expected)
    assert doc["settings"]["world_size"] == 3
    shards = next(p for p in doc["paths"] if p["case"] == "uneven-shards")
    assert len(set(shards["seq_lens"])) == 2  # 25 tokens over 3 ranks
    if "cuda" in kernels:
        assert next(p for p in doc["paths"] if p["kernels"] == "cuda")["kernels_label"] == "cuda: C++ CPU twin"


FAULTS = '''
"""Kernel sets that fail on purpose, for the self-test's own test."""
from ulysses_kernels.kernels import torch_kernels as L
from ulysses_kernels.kernels import KernelSetSpec, TorchKernels, register_kernel_set


class CorruptKernels(TorchKernels):
    """torch's kernels, but rank 1 adds 1 to one element of every tensor it unpacks."""

    name = "corrupt"

    @staticmethod
    def unpack_h2s(layout, blocks, roles, outs):
        L.unpack_h2s(layout, blocks, roles, outs)
        if layout.rank == 1:
            outs[0][(0,) * outs[0].dim()] += 1.0


class RaiseKernels(TorchKernels):
    """Rank 1 raises before the first all-to-all; rank 0 goes on into it and waits."""

    name = "raise-on-rank-1"

    @staticmethod
    def pack_s2h(layout, tensors, roles, send, recv=None):
        if layout.rank == 1:
            raise RuntimeError("deliberate failure on rank 1")
        L.pack_s2h(layout, tensors, roles, send, recv)


class DriftKernels(TorchKernels):
    """Rank 1 adds 1e-13 more to one element at every unpack: each call is within float64's
    bound, but no two calls agree (a checkpointed run differs from the plain one)."""

    name = "drift"
    calls = 0

    @staticmethod
    def unpack_h2s(layout, blocks, roles, outs):
        L.unpack_h2s(layout, blocks, roles, outs)
        if layout.rank == 1:
            DriftKernels.calls += 1
            outs[0][(0,) * outs[0].dim()] += 1e-13 * DriftKernels.calls


register_kernel_set(KernelSetSpec("corrupt", __name__, "CorruptKernels"))
register_kernel_set(KernelSetSpec("raise-on-rank-1", __name__, "RaiseKernels"))
register_kernel_set(KernelSetSpec("drift", __name__, "DriftKernels"))
'''

RING_FAULTS = '''
"""A ring level whose zigzag output is wrong by 1 in one element on rank 1."""
import torch.distributed as dist
from ulysses_kernels.ring.attention import RingBackend

_forward = RingBackend.forward


def forward(self, q, k, v, **kw):
    out, state = _forward(self, q, k, v, **kw)
    if self.seq_layout == "zigzag" and dist.get_rank() == 1:
        out = out.clone()
        out[(0,) * out.dim()] += 1.0
    return out, state


RingBackend.forward = forward
'''


def test_broken_paths_fail_with_their_reason_and_the_ranks_stay_in_step(tmp_path):
    (tmp_path / "selftest_faults.py").write_text(textwrap.dedent(FAULTS))
    # Not -I: the module of faults is imported from the working directory, as a user's own
    # kernel set would be (--import); the checkout is still not on the path.
    argv = [
        sys.executable, "-m", "ulysses_kernels.selftest", "--spawn", "2", "--import", "selftest_faults",
        "--kernels", "raise-on-rank-1,corrupt,drift,torch", "--chunks", "1,2", "--layouts", "gqa,ring", "--timeout", "4",  # --layouts: --cases by its old name
        "--json", "faults.json",
    ]  # fmt: skip
    # --timeout 4: rank 0 waits that long in each of the three paths where rank 1 raised (with 8, those
    # waits were 24 of the test's 33 s, measured); a sound path's collectives wait milliseconds for a peer.
    r = run(argv, tmp_path, env=user_env(), timeout=300)
    assert r.returncode != 0, r.stdout + r.stderr
    doc = load(tmp_path / "faults.json", r)
    # Before torch 2.9 drift's checkpoint path passes (held to the bound, as on a GPU).
    fails = 7 if BIT_EQUAL_CHECKPOINT else 6
    assert not doc["ok"] and doc["complete"] and doc["counts"] == {"PASS": 24 - fails, "FAIL": fails, "SKIP": 0}, doc["counts"]
    by = {p["path"]: p for p in doc["paths"]}
    for chunks in (1, 2):
        raised = by[f"raise-on-rank-1/torch-dist/chunks={chunks}/gqa"]
        # Both ranks report: rank 1 its exception, rank 0 the collective that timed out waiting for it.
        assert raised["status"] == "FAIL" and "rank 1: RuntimeError: deliberate failure on rank 1" in raised["message"], raised
        assert "rank 0: " in raised["message"] and raised["errors"] is None, raised
        corrupt = by[f"corrupt/torch-dist/chunks={chunks}/gqa"]
        assert corrupt["status"] == "FAIL" and corrupt["errors"]["out"] >= 0.5 and corrupt["max_error"] > corrupt["bound"], corrupt
        assert "out " in corrupt["message"] and "> bound" in corrupt["message"], corrupt
        # After both failures the ranks are in step: the next paths run and pass.
        assert by[f"torch/torch-dist/chunks={chunks}/gqa"]["status"] == "PASS", by
        assert by[f"drift/torch-dist/chunks={chunks}/gqa"]["status"] == "PASS", by  # 1e-13 is within the bound
    # Under checkpointing: drift's two runs differ (a FAIL that names the tensor), torch's are bit-equal.
    drift = by[f"drift/torch-dist/chunks={CK}/gqa/checkpoint"]
    if BIT_EQUAL_CHECKPOINT:
        assert drift["status"] == "FAIL" and drift["max_error"] <= drift["bound"] and 0 < drift["checkpoint_diff"]["out"] < 1e-11, drift
        assert drift["message"].startswith("out under checkpoint differs from the plain run by"), drift
        assert "bit-equal expected on the CPU" in drift["message"], drift
    else:
        assert drift["status"] == "PASS" and 0 < drift["checkpoint_diff"]["out"] < 1e-11, drift
    assert by[f"torch/torch-dist/chunks={CK}/gqa/checkpoint"]["status"] == "PASS", by
    for kernels in ("raise-on-rank-1", "corrupt"):
        assert by[f"{kernels}/torch-dist/chunks={CK}/gqa/checkpoint"]["status"] == "FAIL", by
    kernel_sets = ["raise-on-rank-1", "corrupt", "drift", "torch"]
    assert [p["path"].split("/")[0] for p in doc["paths"]] == ([k for k in kernel_sets for _ in (1, 2)] + kernel_sets) * 2
    # The 2-D group after the group recovery (made again with the new data group): every
    # path passes (its Ulysses groups have one rank: none of the faults fires there).
    ring = [p for p in doc["paths"] if p["case"] == "ring-1x2"]
    assert len(ring) == 12 and all(p["status"] == "PASS" for p in ring), ring
    assert f"{24 - fails} passed, {fails} failed" in r.stdout and "FAILED" in r.stdout and "deliberate failure on rank 1" in r.stdout
    # Checkpoint paths: raise, corrupt, drift (PASS before torch 2.9: held to the bound), torch.
    statuses = ["FAIL"] * 4 + ["PASS"] * 4 + ["FAIL", "FAIL", "FAIL" if BIT_EQUAL_CHECKPOINT else "PASS", "PASS"] + ["PASS"] * 12
    assert [s for _, _, s, _ in progress_lines(r.stderr)] == statuses, r.stderr


def test_a_wrong_ring_level_fails_and_the_next_paths_pass(tmp_path):
    (tmp_path / "selftest_ring_faults.py").write_text(textwrap.dedent(RING_FAULTS))
    argv = [
        sys.executable, "-m", "ulysses_kernels.selftest", "--spawn", "2", "--import", "selftest_ring_faults",
        "--kernels", "torch", "--chunks", "1", "--cases", "ring-zigzag,ring", "--json", "ring.json",
    ]  # fmt: skip
    r = run(argv, tmp_path, env=user_env(), timeout=300)
    assert r.returncode != 0, r.stdout + r.stderr
    doc = load(tmp_path / "ring.json", r)
    assert not doc["ok"] and doc["complete"] and doc["counts"] == {"PASS": 2, "FAIL": 2, "SKIP": 0}, doc["counts"]
    status = {p["path"]: p["status"] for p in doc["paths"]}
    assert status == {
        "torch/torch-dist/chunks=1/ring-1x2-zigzag": "FAIL", f"torch/torch-dist/chunks={CK}/ring-1x2-zigzag/checkpoint": "FAIL",
        "torch/torch-dist/chunks=1/ring-1x2": "PASS", f"torch/torch-dist/chunks={CK}/ring-1x2/checkpoint": "PASS",
    }, status  # fmt: skip
    zigzag = doc["paths"][0]
    assert zigzag["errors"]["out"] >= 0.5 and zigzag["message"].startswith("out ") and zigzag["seq_layout"] == "zigzag", zigzag
    assert [s for _, _, s, _ in progress_lines(r.stderr)] == ["FAIL", "FAIL", "PASS", "PASS"], r.stderr
    assert "2 passed, 2 failed" in r.stdout and "FAILED" in r.stdout


def test_bad_arguments_name_what_is_wrong(capsys):
    with pytest.raises(SystemExit, match=r"--kernels: unknown kernel set\(s\) \['nope'\]; registered: \['torch'"):
        selftest.main(["--kernels", "nope"])
    with pytest.raises(SystemExit):
        selftest.main(["--chunks", "3"])
    assert "--chunks: expected a comma list of 1, 2, auto, got '3'" in capsys.readouterr().err


def test_layouts_is_an_old_name_of_cases(capsys):
    # --layouts was the flag's name before the self-test's cases were named cases: command
    # lines that use it pick the same cases, and a bad name is refused alike.
    assert selftest.parse_args(["--layouts", "gqa,ring"]).cases == selftest.parse_args(["--cases", "gqa,ring"]).cases == ["gqa", "ring"]
    assert selftest.parse_args([]).cases is None  # every case
    for flag in ("--cases", "--layouts"):
        with pytest.raises(SystemExit):
            selftest.parse_args([flag, "gqa,32/8"])
        assert "--cases: expected a comma list of mha, gqa," in capsys.readouterr().err


@pytest.mark.parametrize("world", range(1, 10))
def test_cases_are_what_their_names_say(world):
    cases = {c.name: c for c in selftest.make_cases(world, 7)}  # 7: zigzag's shards still even
    splits = selftest.ring_splits(world)
    rings = [f"ring-{u}x{r}{s}" for s in ("", "-zigzag", "-packed", "-zigzag-packed") for u, r in splits]
    mla = ["mla", "mla-wide-v"] + [f"ring-{u}x{r}-mla" for u, r in splits]
    assert list(cases) == list(selftest.CASE_NAMES[:5]) + rings + mla
    for c in cases.values():
        HeadPlan.build(c.q_heads, c.kv_heads, c.split[0] if c.split else world)  # every case can be planned
        assert len(c.seq_lens) == world
        # v's head dim differs from q's exactly in the MLA cases: narrower, wider, narrower.
        assert (c.v_head_dim(16), c.v_head_dim(64)) == {"mla": (12, 48), "mla-wide-v": (24, 96)}.get(
            c.name, (12, 48) if c.name.endswith("-mla") else (16, 64)
        ), c
        if c.name in mla:
            assert c.causal and (c.q_heads == c.kv_heads) == (c.name != "mla-wide-v"), c
            if c.name == "mla" and world > 1:
                assert c.q_heads % world, c  # ranks hold different head counts
            continue
        if c.split:
            u, r = c.split
            assert u * r == world and r >= 2 and c.kv_heads < max(u, 2) and c.causal, c
            assert len(set(c.seq_lens)) == 1 and c.seq_lens[0] % 2 == 0, c
            assert (c.docs is not None) == c.name.endswith("-packed") and (c.batch == 1 or c.docs is None), c
    assert splits == {1: [], 2: [(1, 2)], 3: [(1, 3)], 4: [(2, 2)], 6: [(3, 2), (2, 3)], 8: [(4, 2), (2, 4)], 9: [(3, 3)]}.get(world, splits)
    assert cases["mha"].q_heads == cases["mha"].kv_heads and cases["mha"].batch == 1
    assert cases["gqa"].kv_heads < cases["gqa"].q_heads
    assert cases["uneven-shards"].seq_lens == tuple(split_lengths(sum(cases["uneven-shards"].seq_lens), world))
    packed = cases["packed"]
    assert packed.batch == 1 and sum(packed.docs) == 7 * world and min(packed.docs) >= 1 and len(set(packed.docs)) > 1
    assert packed.cu_seqlens[0] == 0 and packed.cu_seqlens[-1] == 7 * world
    if world >= 2:
        assert min(packed.docs) < world  # a document shorter than the group
        # and one that crosses a shard boundary
        assert any(a < 7 * r < b for a, b in itertools.pairwise(packed.cu_seqlens) for r in range(1, world))
        assert cases["gqa"].kv_heads < world  # KV heads replicated across ranks
        assert cases["uneven-heads"].q_heads % world
        assert sum(cases["uneven-shards"].seq_lens) % world


def test_replicated_kv_heads_widen_the_dk_dv_bound_by_one_ulp_per_extra_holder():
    """The bf16 bound of dk/dv: 2x SDPA's error, plus one ulp at the tensor's largest value per
    extra rank holding a KV head (each holder rounds its piece before the exchange sums them)."""
    from ulysses_kernels.selftest.judge import replica_roundings, torch_bounds, ulp_at

    cases = {c.name: c for c in selftest.make_cases(8, 8)}
    assert replica_roundings(cases["mha"]) == 1  # 16 KV heads over 8 ranks: none replicated
    assert replica_roundings(cases["ring-2x4-packed"]) == 2  # 1 KV head over 2 Ulysses ranks
    assert replica_roundings(cases["ring-4x2"]) == 2  # 2 KV heads over 4
    assert ulp_at(10.0, torch.bfloat16) == 2.0**-4 and ulp_at(1.0, torch.bfloat16) == 2.0**-7 and ulp_at(0.0, torch.bfloat16) == 0.0
    case = cases["ring-2x4-packed"]
    g = torch.Generator().manual_seed(0)
    S = sum(case.seq_lens)
    inputs = [torch.randn(case.batch, S, h, 8, generator=g, dtype=torch.float64) for h in (case.q_heads, case.kv_heads, case.kv_heads, case.q_heads)]
    full = [x.clone().requires_grad_() for x in inputs[:3]]
    from ulysses_kernels.selftest.judge import per_document
    from ulysses_kernels.testing.reference import attention_reference

    out = per_document(case, lambda q, k, v: attention_reference(q, k, v, causal=True), *full)
    out.backward(inputs[3])
    ref = [out.detach()] + [x.grad for x in full]
    alone = dataclasses.replace(case, split=(1, 8))  # the same case over one Ulysses rank: no replica
    assert replica_roundings(alone) == 1
    plain = torch_bounds(alone, inputs, ref, torch.device("cpu"), torch.bfloat16)
    wide = torch_bounds(case, inputs, ref, torch.device("cpu"), torch.bfloat16)
    assert wide[:2] == plain[:2]
    for i in (2, 3):
        assert wide[i] == plain[i] + ulp_at(ref[i].abs().max().item(), torch.bfloat16) > plain[i]
