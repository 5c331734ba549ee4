"""Loading of the ``ulysses_kernels._C`` extension, with its import-time checks.

``load()`` imports torch first (the extension links against it), then ``_C`` (which
registers the ``torch.ops.ulysses_kernels`` ops), then checks that the NCCL we linked is
the NCCL torch loaded: two different NCCL libraries in one process disagree on
communicator internals, so a mismatch is an error here rather than a crash later.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["load", "available", "build_info", "decode_nccl_version", "check_nccl_versions"]

_STATE: dict = {}


def decode_nccl_version(code: int) -> tuple[int, int, int]:
    """``NCCL_VERSION_CODE`` -> ``(major, minor, patch)`` (2.9+ use 5 digits, older ones 4)."""
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


def check_nccl_versions(linked: tuple[int, ...], loaded: tuple[int, ...]) -> None:
    """Raise ImportError when the NCCL the extension was built against is not torch's."""
    if tuple(linked[:3]) != tuple(loaded[:3]):
        lv, tv = ".".join(map(str, linked[:3])), ".".join(map(str, loaded[:3]))
        raise ImportError(
            f"ulysses_kernels._C was built against NCCL {lv} but torch {torch.__version__} loaded NCCL {tv} "
            f"(torch.cuda.nccl.version()); rebuild the extension in this environment "
            f"(python setup.py build_ext --inplace) so that both use one NCCL"
        )


def _torch_nccl_version():
    try:
        v = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return tuple(v) if isinstance(v, tuple) else decode_nccl_version(int(v))


def load():
    """The imported ``_C`` module; ImportError (with the reason) when it is not usable."""
    if "module" in _STATE:
        return _STATE["module"]
    if "error" in _STATE:
        raise ImportError(_STATE["error"])
    try:
        module = importlib.import_module("ulysses_kernels._C")
        info = module.build_info()
        if info.get("nccl"):
            loaded = _torch_nccl_version()
            if loaded is not None:
                check_nccl_versions(decode_nccl_version(info["nccl_header_version"]), loaded)
    except ImportError as e:
        _STATE["error"] = f"ulysses_kernels._C is not usable: {e}"
        raise ImportError(_STATE["error"]) from e
    _STATE["module"] = module
    return module


def available() -> bool:
    try:
        load()
    except ImportError:
        return False
    return True


def build_info() -> dict:
    """``_C.build_info()`` plus the runtime NCCL version; ``{"built": False, "error": ...}`` without it."""
    try:
        module = load()
    except ImportError as e:
        return {"built": False, "error": str(e)}
    info = dict(module.build_info(), built=True)
    info["archs"] = info.get("archs", "").replace("_", ";")
    if info.get("nccl"):
        info["nccl_header_version"] = decode_nccl_version(info["nccl_header_version"])
        info["nccl_runtime_version"] = decode_nccl_version(module.nccl_version())
    return info
