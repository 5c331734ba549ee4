"""``python -m ulysses_kernels.info``: what this installation can run here, and why not the rest.

Reports the C++/CUDA extension (built or not, archs, the NCCL it was built against and
the NCCL loaded at run time; when it is missing or CPU-only on a CUDA torch, the command
that builds it), its C++ runtime (the shared libstdc++, or a private copy linked in) and
its error path (one bad call in a subprocess: ok, crashed with a signal, or a message that
lost its numbers: ``toolchain``), the NCCL torch loaded, Triton, flash-attn, every kernel
set (whether it runs in this process, and why not), the default kernel set
(``kernels="auto"``) with the GPU runs it was validated on, and the packed-documents kernel
the chooser picks here (``backends.packed_kernel``; CUDA bf16 where a GPU is visible, else CPU
float32), and the libraries of the integrations: the installed version beside the one the suite
passes with (``--imports``: each imported too, which takes seconds). ``--json`` prints the same as JSON.

The NCCL row says which NCCL runs in this process: torch's ``ncclGetVersion``, the one ``_C``
calls, and every libnccl file mapped (``/proc/self/maps``), so that a carried NCCL put ahead of
torch's (``LD_PRELOAD``, scripts/gpu_session.sh) is seen to be the one that runs, and two copies
in one process are seen at all.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

from . import extension, toolchain
from .backends import packed_report
from .integrations import requirements
from .kernels import KERNEL_SETS, auto_choice, kernel_set_report

nccl_libraries = extension.nccl_libraries  # the libnccl files mapped into this process


def nccl_line(info: dict) -> str:
    """torch's NCCL, _C's, the files mapped, and LD_PRELOAD when it names one: the NCCL that runs here."""
    ext = info["extension"]
    parts = [f"torch {info['torch_nccl']}"]
    if ext.get("nccl"):
        parts.append(f"_C {ext['nccl_runtime_version']}")
    libs = info["nccl_libraries"]
    parts.append(f"mapped: {', '.join(libs) if libs else 'none'}")
    if len(libs) > 1:
        parts.append(f"{len(libs)} COPIES IN ONE PROCESS")
    if "nccl" in info["ld_preload"]:
        parts.append(f"LD_PRELOAD={info['ld_preload']}")
    return "; ".join(parts)


def collect(import_integrations: bool = False) -> dict:
    loaded, header = extension.loaded_nccl_version(), extension.torch_nccl_header_version()
    torch_nccl = ".".join(map(str, loaded)) if loaded else "unavailable"
    if loaded and header and header != loaded:  # a carried NCCL ahead of torch's: the one that runs, then torch's header
        torch_nccl += f" (torch built with {'.'.join(map(str, header))})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    ext = extension.build_info()
    for key in ("nccl_header_version", "nccl_runtime_version"):
        if key in ext:
            ext[key] = ".".join(map(str, ext[key]))
    report = kernel_set_report()
    runtime = probe = None
    if ext.get("built"):
        runtime = toolchain.libstdcxx_report(extension.load().__file__)
        probe = toolchain.probe_error_path()
    cuda = torch.cuda.is_available()
    packed_on = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch_nccl": torch_nccl,
        "nccl_libraries": nccl_libraries(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "triton": triton_version,
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "extension": ext,
        "rebuild_command": extension.rebuild_command(),
        "extension_runtime": runtime,
        "extension_error_path": probe,
        "kernel_sets": [r["name"] for r in report if r["runs_here"]],
        "kernel_set_report": report,
        "default_kernels": default_kernels(),
        "packed_documents": {
            "device": f"{packed_on[0].type} {str(packed_on[1]).removeprefix('torch.')}",
            "kernels": [{"name": n, "status": why} for n, why in packed_report(*packed_on)],
        },
        "integrations": requirements.report(import_integrations),
    }


def default_kernels() -> dict:
    """What ``kernels="auto"`` runs on CPU tensors and, with a GPU visible, on this GPU (the
    sets passed over and why), and the GPU runs each set was validated on."""
    out = {"cpu": auto_choice(torch.device("cpu"))[0].name, "cuda": None, "cuda_passed_over": {}}
    if torch.cuda.is_available():
        kern, passed = auto_choice(torch.device("cuda"))
        major, minor = torch.cuda.get_device_capability()
        out.update(cuda=kern.name, cuda_passed_over=passed, capability=f"{major}.{minor}")
    out["validated"] = {name: [r.line() for r in spec.gpu_validated] for name, spec in KERNEL_SETS.items()}
    return out


def default_line(info: dict) -> str:
    """The default kernel set: on this GPU (and why), or, without one, the rule and the CPU's choice."""
    d = info["default_kernels"]
    validated = d["validated"].get(d["cuda"] or "cuda") or ["never on a GPU"]
    if d["cuda"] is None:
        ext = info["extension"]
        archs = ext.get("archs") or ("no CUDA code" if ext.get("built") else "not built")
        return (
            f"{d['cpu']} on CPU tensors; on a GPU: cuda where _C carries code for its arch (_C here: {archs}), "
            f"else triton, else torch. cuda validated on {'; '.join(validated)}"
        )
    over = "; ".join(f"{name} passed over: {why}" for name, why in d["cuda_passed_over"].items())
    line = f"{d['cuda']} on this GPU (compute capability {d['capability']}){f' ({over})' if over else ''}; validated on {'; '.join(validated)}"
    return line + f"; {d['cpu']} on CPU tensors"


def extension_line(info: dict) -> str:
    """One line on ``_C``: what was built, or (loudly) what is missing and the command that builds it."""
    ext = info["extension"]
    if not ext.get("built"):
        return f"NOT BUILT: {ext.get('error')}"
    nccl = (
        f"built against NCCL {ext['nccl_header_version']}, loaded {ext['nccl_runtime_version']}{', ncclAlltoAll' if ext.get('nccl_alltoall') else ''}"
        if ext.get("nccl")
        else "no NCCL"
    )
    if ext.get("cuda"):
        return f"built (CUDA, archs {ext['archs']}; {nccl})"
    line = f"built (CPU only; {nccl})"
    if info["torch_cuda"]:
        line += (
            f". CPU ONLY although torch is a CUDA build (no CUDA toolkit at build time): no CUDA kernels, no native NCCL. "
            f"Build them with a toolkit: {extension.rebuild_command('CUDA_HOME=/usr/local/cuda')}"
        )
    return line


def format_report(info: dict) -> str:
    rows = [
        ("python", info["python"]),
        ("torch", f"{info['torch']} (CUDA {info['torch_cuda']})"),
        ("GPU", info["gpu"] or "none visible"),
        ("NCCL", nccl_line(info)),
        ("triton", info["triton"] or "not installed"),
        ("flash-attn", "present" if info["flash_attn"] else "not installed"),
        ("_C extension", extension_line(info)),
        ("kernel sets", "runs here: " + (", ".join(info["kernel_sets"]) or "none")),
    ]
    if info["extension_runtime"] is not None:
        rows.insert(7, ("_C C++ runtime", info["extension_runtime"]["detail"]))
        rows.insert(8, ("_C error path", toolchain.probe_line(info["extension_error_path"], extension.rebuild_command)))
    last = ("default kernels", default_line(info))
    packed = info["packed_documents"]
    picked = next((k["name"] for k in packed["kernels"] if k["status"] == "picked"), "none")
    packed_row = ("packed docs", f"{picked} picked for {packed['device']} (backends.packed_kernel)")
    width = max(len(k) for k, _ in [*rows, last, packed_row])
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    name_width = max((len(r["name"]) for r in info["kernel_set_report"]), default=0)
    for r in info["kernel_set_report"]:
        status = "runs here" if r["runs_here"] else "not here "
        lines.append(f"{'':<{width}}    {r['name']:<{name_width}}  {status}  {r['detail']}")
    lines.append(f"{last[0]:<{width}}  {last[1]}")
    lines.append(f"{packed_row[0]:<{width}}  {packed_row[1]}")  # the packed row after the kernel sets' lines
    for k in packed["kernels"]:
        lines.append(f"{'':<{width}}    {k['name']:<{name_width}}  {k['status']}")
    libs = info.get("integrations", [])
    if libs:
        tried = "each imported" if any("import_error" in r for r in libs) else "not imported (--imports imports each)"
        lines.append(f"{'integrations':<{width}}  versions installed, {tried}")
        lib_width = max(len(r["name"]) for r in libs)
        lines += [f"{'':<{width}}    {r['name']:<{lib_width}}  {requirements.row_text(r)}" for r in libs]
    return "\n".join(lines)


def main(argv=None) -> int:
    """``--json``: print JSON instead of the report; ``--json-to PATH``: print the report and write
    the JSON to PATH (one collection: the GPU runbook's record); ``--imports``: import each
    integration's library too (seconds) and say whether it imports."""
    argv = sys.argv[1:] if argv is None else argv
    info = collect(import_integrations="--imports" in argv)
    print(json.dumps(info, indent=2) if "--json" in argv else format_report(info))
    if "--json-to" in argv:
        with open(argv[argv.index("--json-to") + 1], "w") as f:
            json.dump(info, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
