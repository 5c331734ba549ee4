"""The GPU runbook's plan and the pieces of issue 49's call that run without a GPU.

* ``GPU_SESSION_DRY_RUN=1 bash scripts/gpu_session.sh world``: every step with its budget, the
  most decisive first, the budgets summing under the one 9-minute deadline, and the several-ranks-
  on-one-GPU steps launched as N torchrun ranks;
* the self-test's torchrun transport when ranks share a GPU (``launched_transport``);
* ``info``'s NCCL line (which NCCL runs, and two copies in one process said loudly);
* scripts/nccl_carry.py's fatbin rewrite on a small ELF made here (the real library's checks,
  size, version, symbols and cuobjdump, are the script's own: ``python scripts/nccl_carry.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from ulysses_kernels import info
from ulysses_kernels.selftest.cli import launched_transport

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 540  # 9 minutes: the device tool's 600 s command limit less start-up and copy-back


def dry_run(tmp_path, *stages, **env) -> str:
    env = {**os.environ, "GPU_SESSION_DRY_RUN": "1", **env}
    env.pop("OUT", None)
    out = subprocess.run(["bash", "scripts/gpu_session.sh", *stages], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def plan(text: str) -> tuple[list[tuple[str, int]], int, int]:
    """The plan table's (step, budget) rows, its stated sum and deadline (the summary's copy)."""
    text = text.split("======== gpu_session")[0]
    rows = [(m[1], int(m[2])) for m in re.finditer(r"^\[gpu_session\]   (\S+) +(\d+) +\d+$", text, re.M)]
    total = re.search(r"plan: (\d+) steps, budgets sum (\d+) s of the (\d+) s deadline", text)
    assert total and int(total[1]) == len(rows), text
    return rows, int(total[2]), int(total[3])


@pytest.fixture
def carry(tmp_path):
    """A stand-in carry folder: the dry run only reads that its manifest exists."""
    (tmp_path / "carry").mkdir()
    (tmp_path / "carry" / "manifest.json").write_text(json.dumps({"nccl": "2.30.7"}))
    return str(tmp_path / "carry")


def test_world_plan_fits_one_deadline_most_decisive_first_and_says_which_nccl(tmp_path, carry):
    out = dry_run(tmp_path, "world", GPU_SESSION_NCCL_CARRY_DIR=carry)
    rows, total, deadline = plan(out)
    names = [n for n, _ in rows]
    assert total == sum(b for _, b in rows) and deadline == DEADLINE_S
    assert total <= DEADLINE_S - 15, f"the step budgets ({total} s) leave no room under the {DEADLINE_S} s deadline"
    assert names[:7] == ["nccl_carry", "setup", "info", "selftest_w8", "bench_pack_fp8", "packed_probe", "two_ranks"]
    # what the 2026-11-30 record left undecided; not what it recorded (the hybrid steps, the w2 self-test, the layout rows)
    assert names[7:] == ["alltoall_w8", "overlap_w8", "selftest_w4", "bench_pack", "bench_attention_cudnn"]
    # each printed command's timeout is its plan row, in the same order
    launched = re.findall(r">>> (\S+) \(timeout (\d+)s\)", out)
    assert [(n, int(t)) for n, t in launched] == rows
    for world in (8, 4):
        assert re.search(rf">>> selftest_w{world} .*torch.distributed.run --standalone --nproc-per-node {world} -m ulysses_kernels.selftest", out)
    assert "one_gpu_w8" in out and "pytest -v -s -ra -k two_ranks" in out
    assert "the carried one would run ahead of the machine's" in out
    assert "one deadline of 540 s" in out
    # without a carried NCCL (one test: both dry runs write build/gpu_session/world/, so never side by side)
    out = dry_run(tmp_path, "world", GPU_SESSION_NCCL_CARRY="0")
    rows, total, _ = plan(out)
    assert "nccl_carry" not in [n for n, _ in rows] and total <= DEADLINE_S
    assert "NCCL: none carried" in out


def test_unknown_stage_is_refused(tmp_path):
    out = subprocess.run(["bash", "scripts/gpu_session.sh", "wrold"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown stage: wrold" in out.stderr


@pytest.mark.parametrize(
    "gpus, local, env, expected",
    [(8, 8, {}, "nccl"), (1, 2, {}, "gloo"), (1, 8, {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, "nccl"),
     (0, 2, {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, "gloo"), (2, 4, {"NCCL_MULTI_RANK_GPU_ENABLE": "0"}, "gloo")],
)  # fmt: skip
def test_selftest_ranks_share_a_gpu_only_when_nccl_may(gpus, local, env, expected):
    assert launched_transport(gpus, local, env) == expected


def test_info_names_the_nccl_that_runs():
    collected = {"torch_nccl": "2.30.7", "extension": {"nccl": True, "nccl_runtime_version": "2.30.7"}, "ld_preload": "/c/libnccl.so.2"}
    one = info.nccl_line({**collected, "nccl_libraries": ["/c/libnccl.so.2"]})
    assert one == "torch 2.30.7; _C 2.30.7; mapped: /c/libnccl.so.2; LD_PRELOAD=/c/libnccl.so.2"
    two = info.nccl_line({**collected, "nccl_libraries": ["/a/libnccl.so.2", "/c/libnccl.so.2"]})
    assert "2 COPIES IN ONE PROCESS" in two
    assert all("libnccl" in path for path in info.nccl_libraries())


# ---- scripts/nccl_carry.py on a small ELF with two fatbin sections --------------------------
def _load_carry():
    spec = importlib.util.spec_from_file_location("nccl_carry", ROOT / "scripts" / "nccl_carry.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def _fatbin(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _elf(section_bodies: dict[str, bytes]) -> bytearray:
    """An ELF64 header, the sections' bytes laid end to end, .shstrtab, then the section headers."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*section_bodies, ".shstrtab"])
    data, headers = bytearray(64), [bytes(64)]
    for name, body in [*section_bodies.items(), (".shstrtab", names)]:
        name_idx = names.index(name.encode() + b"\0")
        headers.append(struct.pack("<IIQQQQIIQQ", name_idx, 1, 2, 0x1000 + len(data), len(data), len(body), 0, 0, 8, 0))
        data += body + bytes(-len(body) % 8)
    shoff = len(data)
    data += b"".join(headers)
    data[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", data, 0x28, shoff)
    struct.pack_into("<HHH", data, 0x3A, 64, len(headers), len(headers) - 1)
    return data


def test_nccl_carry_keeps_one_arch_in_place():
    carry = _load_carry()
    sm80, sm90, ptx, sm100 = _entry(2, 80, b"a" * 24), _entry(2, 90, b"b" * 40), _entry(1, 120, b"c" * 16), _entry(2, 100, b"d" * 8)
    first, only_100 = _fatbin([sm80, sm90, ptx]), _fatbin([sm100])
    data = _elf({".nv_fatbin": first + only_100, "__nv_relfatbin": _fatbin([sm90, sm80])})
    before = bytes(data)
    stats = carry.keep_arch(data, 90)
    assert len(data) == len(before) and carry.sections(data) == carry.sections(before)
    assert stats["rewritten"] == 2 and stats["left_without_arch"] == 1 and stats["entries_dropped"] == 3
    assert carry.arch_entries(data, 90) == carry.arch_entries(before, 90) == [sm90, sm90]
    off, size, _ = carry.sections(data)[".nv_fatbin"]
    found = carry.fatbins(data, off, size)  # the zeros the first one left are skipped, the sm_100-only one is intact
    assert [[e[3] for e in entries] for _s, _h, entries in found] == [[90], [100]]
    assert found[1][0] == off + len(first) and data[off + len(first) : off + len(first) + len(only_100)] == only_100
    assert data[off + 16 + len(sm90) : off + len(first)] == bytes(len(first) - 16 - len(sm90))


def test_info_prints_the_report_and_writes_its_json(tmp_path, capsys):
    path = tmp_path / "info.json"
    assert info.main(["--json-to", str(path)]) == 0
    written = json.loads(path.read_text())
    assert re.search(rf"^NCCL +{re.escape(info.nccl_line(written))}$", capsys.readouterr().out, re.M)
    assert written["torch_nccl"] and isinstance(written["nccl_libraries"], list)


def test_a_record_of_ranks_sharing_a_gpu_says_so(monkeypatch):
    from ulysses_kernels.bench import record

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    env = record.env_record(torch.device("cuda", 0), 8, "nccl")
    assert env["local_ranks"] == 8 and env["gpus_visible"] == 1 and env["shared_gpu"].startswith("8 ranks on 1 GPU")
    assert record.device_label(env) == "NVIDIA H200 (8 ranks on 1 GPU)"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = record.env_record(torch.device("cuda", 0), 1, "nccl")
    assert "shared_gpu" not in alone and record.device_label(alone) == "NVIDIA H200"
