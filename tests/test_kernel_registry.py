"""The kernel registry says why a named kernel set cannot run, instead of only listing the others."""

import pytest
import torch

from ulysses_kernels import extension
from ulysses_kernels import kernels as K


@pytest.fixture
def fresh_registry():
    K._import_or_why.cache_clear()
    yield
    K._import_or_why.cache_clear()


def test_unusable_extension_names_its_import_error(monkeypatch, fresh_registry):
    # What extension.load() records when _C was built against another NCCL than torch's
    # (or was not built at all): kernels="cuda" must carry that reason.
    why = "ulysses_kernels._C is not usable: built against NCCL 2.28.3 but torch loaded NCCL 2.30.7; rebuild"
    monkeypatch.setattr(extension, "_STATE", {"error": why})
    with pytest.raises(ValueError, match=r"kernels='cuda' is not available here \(.*built against NCCL 2\.28\.3.*rebuild.*\); available: \['torch'"):
        K.get_kernels("cuda", torch.device("cpu"))
    assert "cuda" not in K.available_kernels()
    assert K.get_kernels("auto", torch.device("cpu")).name == "torch"


def test_triton_without_gpu_or_interpreter_says_so(monkeypatch, fresh_registry):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"kernels='triton' is not available here \(no CUDA device, and TRITON_INTERPRET=1 is not set\)"):
        K.get_kernels("triton", torch.device("cpu"))


# ---- the default on CUDA follows the GPU record (bench/results/2026-11-27_h200/) -----------
@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of a chosen compute capability and a _C built for chosen archs, faked on the CPU
    (only torch.device("cuda") objects are used: no GPU is touched)."""
    if not extension.available():
        pytest.skip(f"needs the C++ extension: {extension.build_info().get('error')}")
    extension.load()  # first: the arch list faked below must not be overwritten by the first load

    def fake(capability, archs):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setitem(extension._STATE, "archs", tuple(archs))

    return fake


@pytest.mark.parametrize(
    "capability, archs, expected",
    [
        ((9, 0), ("8.0", "9.0"), "cuda"),  # the H200 of the record, the default build
        ((8, 6), ("8.0", "9.0"), "cuda"),  # sm_80 code runs on sm_86 (same major)
        ((8, 0), ("9.0",), "triton"),  # a build for this GPU's arch only, on another GPU
        ((10, 0), ("8.0", "9.0"), "triton"),  # Blackwell: no sm_100 code, no PTX
        ((10, 0), ("9.0+PTX",), "cuda"),  # PTX is compiled by the driver for a later GPU
        ((10, 0), ("9.0a",), "triton"),  # an "a" arch runs on exactly that GPU
        ((9, 0), (), "triton"),  # a CPU-only _C on a CUDA torch
    ],
)
def test_auto_on_cuda_is_the_cuda_set_where_C_has_code_for_the_gpu(fake_gpu, capability, archs, expected):
    fake_gpu(capability, archs)
    kern, passed = K.auto_choice(torch.device("cuda"))
    if expected == "triton" and "triton" not in K.available_kernels():
        expected = "torch"  # no Triton here: the next in line
    assert kern.name == expected, passed
    assert K.get_kernels(None, torch.device("cuda")).name == expected
    assert K.get_kernels("auto", torch.device("cuda")).name == expected
    if expected != "cuda":
        assert "cuda" in passed and ("carries code for" in passed["cuda"] or "without CUDA" in passed["cuda"]), passed
    assert K.get_kernels("auto", torch.device("cpu")).name == "torch"  # the CPU default is unchanged


def test_auto_on_cuda_without_triton_is_torch(fake_gpu, monkeypatch, fresh_registry):
    fake_gpu((10, 0), ("8.0", "9.0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # Triton cannot run: no GPU, no interpreter
    kern, passed = K.auto_choice(torch.device("cuda"))
    assert kern.name == "torch", passed
    assert set(passed) == {"cuda", "triton"} and "TRITON_INTERPRET" in passed["triton"], passed


def test_the_gpu_record_marks_what_was_validated_where():
    rec = K.H200_2026_11_27
    assert (rec.gpu, rec.arch, rec.torch, rec.world_size) == ("NVIDIA H200", "sm_90", "2.11.0+cu130", 1)
    for name in ("torch", "triton", "cuda"):
        assert rec in K.KERNEL_SETS[name].gpu_validated
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in rec.records:
        assert (root / path).is_file(), f"{path}: the record a GpuRecord cites must be committed"
