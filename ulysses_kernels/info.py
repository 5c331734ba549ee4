"""``python -m ulysses_kernels.info``: what this installation has active.

Reports the C++/CUDA extension (built or not, archs, the NCCL it was built against and
the NCCL loaded at run time), the NCCL torch loaded, Triton, flash-attn, and the kernel
sets that can run here.
"""

from __future__ import annotations

import importlib.util
import json
import sys


def collect() -> dict:
    import torch

    from . import _C_loader
    from .kernels import available_kernels

    try:
        torch_nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except (RuntimeError, AttributeError) as e:
        torch_nccl = f"unavailable ({e})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    ext = _C_loader.build_info()
    for key in ("nccl_header_version", "nccl_runtime_version"):
        if key in ext:
            ext[key] = ".".join(map(str, ext[key]))
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch_nccl": torch_nccl,
        "triton": triton_version,
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "extension": ext,
        "kernel_sets": available_kernels(),
    }


def format_report(info: dict) -> str:
    ext = info["extension"]
    if ext.get("built"):
        nccl = (
            f"built against NCCL {ext['nccl_header_version']}, loaded {ext['nccl_runtime_version']}"
            f"{', ncclAlltoAll' if ext.get('nccl_alltoall') else ''}"
            if ext.get("nccl")
            else "no NCCL"
        )
        ext_line = f"built ({'CUDA, archs ' + ext['archs'] if ext.get('cuda') else 'CPU only'}; {nccl})"
    else:
        ext_line = f"not built ({ext.get('error')})"
    rows = [
        ("python", info["python"]),
        ("torch", f"{info['torch']} (CUDA {info['torch_cuda']})"),
        ("GPU", info["gpu"] or "none visible"),
        ("torch NCCL", info["torch_nccl"]),
        ("triton", info["triton"] or "not installed"),
        ("flash-attn", "present" if info["flash_attn"] else "not installed"),
        ("_C extension", ext_line),
        ("kernel sets", ", ".join(info["kernel_sets"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    info = collect()
    print(json.dumps(info, indent=2) if "--json" in argv else format_report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
