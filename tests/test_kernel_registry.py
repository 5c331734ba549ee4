"""The kernel registry says why a named kernel set cannot run, instead of only listing the others."""

import pytest
import torch

from ulysses_kernels import kernels as K
from ulysses_kernels import ops


@pytest.fixture
def fresh_registry():
    K._import_or_why.cache_clear()
    yield
    K._import_or_why.cache_clear()


def test_unusable_extension_names_its_import_error(monkeypatch, fresh_registry):
    # What ops.load() records when _C was built against another NCCL than torch's
    # (or was not built at all): kernels="cuda" must carry that reason.
    why = "ulysses_kernels._C is not usable: built against NCCL 2.28.3 but torch loaded NCCL 2.30.7; rebuild"
    monkeypatch.setattr(ops, "_STATE", {"error": why})
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
