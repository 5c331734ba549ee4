"""Data-movement kernels behind one protocol, chosen per call from a registry.

A kernel set (``KernelSet``) is an object with three methods that match the torch kernel
set (``torch_kernels``, the definition) bit for bit (same arguments, same results), over the
layout math of ``ulysses_kernels.layout``:

* ``pack_s2h(layout, tensors, roles, send, recv=None)``: sequence-sharded tensors -> flat
  send buffer (with ``recv``, this rank's own rows straight into the receive buffer);
* ``pack_h2s(layout, local, send)``: a local ``[B, S, h, D]`` tensor -> flat wire format;
* ``unpack_h2s(layout, blocks, roles, outs)``: received blocks -> ``[B, s_r, H, D]``
  outputs, summing replicated KV heads in rank order.

Optionally the FP8 wire's four (``ulysses_kernels.wire``; the torch set's are the definition,
``wire.resolve_wire`` refuses ``wire_dtype`` for a set without them):
``quant_pack_s2h(layout, tensors, roles, send, fmt, recv=None)``, ``quant_pack_h2s(layout,
local, send, fmt)``, ``dequant_s2h(layout, recv, roles, outs, fmt)`` and
``dequant_unpack_h2s(layout, blocks, roles, outs, fmt)``: the same operations on byte buffers
in the wire format of ``wire.wire_layout(layout, fmt)`` (rows of ``D`` FP8 values and a
float32 scale), quantizing in the packs and dequantizing into ``outs`` in the unpacks.

Optionally ``supports(layout) -> bool`` (the C++ kernels take at most ``kMaxPeers`` ranks),
and ``flat_blocks = True`` when ``unpack_h2s`` also takes each block as the flat 1-D piece of
``B * s_r * h * D`` elements it is in wire format (the exchange then makes no view per block).

The registry (``KERNEL_SETS``) holds one ``KernelSetSpec`` per named set, with the
properties the rest of the package asks about: whether it traces under ``torch.compile``
(and why not), on which device types ``"auto"`` may pick it, and why it cannot run here.
Names: ``"torch"`` (pure PyTorch, any device), ``"triton"`` (Triton kernels; CUDA, or the
CPU under ``TRITON_INTERPRET=1``), ``"cuda"`` (the C++/CUDA extension, with its CPU twin on
CPU tensors). ``None``/``"auto"`` takes, by ``auto_priority``, the first set that ``auto``
may pick on the tensors' device and that can run there (``auto_choice``): on a GPU
``"cuda"`` where ``_C`` carries code for the GPU's architecture, else ``"triton"``, else
``"torch"``; each only once it is ``gpu_validated``: all three passed the self-test and
their GPU tests on an H200 (sm_90, torch 2.11.0+cu130, 2026-11-27:
``bench/results/2026-11-27_h200/``, ``H200_2026_11_27``); elsewhere ``"torch"``.
docs/extending.md says how to add one.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .torch_kernels import TorchKernels

__all__ = [
    "KernelSet",
    "KernelSetSpec",
    "GpuRecord",
    "H200_2026_11_27",
    "KERNEL_SETS",
    "register_kernel_set",
    "TorchKernels",
    "get_kernels",
    "auto_choice",
    "available_kernels",
    "kernel_set_report",
    "registry_generation",
]


class KernelSet(Protocol):
    name: str

    def pack_s2h(self, layout, tensors: Sequence[torch.Tensor], roles: Sequence[str], send: torch.Tensor, recv: torch.Tensor | None = None) -> None: ...

    def pack_h2s(self, layout, local: torch.Tensor, send: torch.Tensor) -> None: ...

    def unpack_h2s(self, layout, blocks: Sequence[Sequence[torch.Tensor]], roles: Sequence[str], outs: Sequence[torch.Tensor]) -> None: ...


@dataclass(frozen=True)
class GpuRecord:
    """One GPU run in which a kernel set passed its GPU tests and the self-test: where, with what, and the files.

    ``arch``: the GPU's architecture (``"sm_90"``); ``records``: the committed files of the
    run (paths from the repository root), which docs/gpu_validation.md cites row by row.
    """

    gpu: str
    arch: str
    torch: str
    cuda: str
    nccl: str
    triton: str
    date: str
    git_sha: str
    world_size: int
    records: tuple[str, ...]

    def line(self) -> str:
        return f"{self.gpu} ({self.arch}), torch {self.torch}, world {self.world_size}, {self.date}, git {self.git_sha}: {self.records[0]}"


# The project's first GPU run (bench/results/2026-11-27_h200/README.md): the self-test's 210
# paths (every kernel set x communicator x chunks x layout, bf16 against float64) passed,
# and so did the GPU tests of each set (test_cuda_kernels, test_triton_kernels, ...), apart
# from three error-path tests that crashed on that toolchain (csrc/message.h, fixed since).
H200_2026_11_27 = GpuRecord(
    gpu="NVIDIA H200",
    arch="sm_90",
    torch="2.11.0+cu130",
    cuda="13.0",
    nccl="2.28.9",
    triton="3.6.0",
    date="2026-11-27",
    git_sha="0b0a5e3",
    world_size=1,
    records=("bench/results/2026-11-27_h200/selftest_w1.json", "bench/results/2026-11-27_h200/README.md"),
)


@dataclass(frozen=True)
class KernelSetSpec:
    """One named kernel set and its properties.

    ``module``/``attr``: where the class lives (imported on first use; a module that fails to
    import makes the set unavailable, with the import error as the reason). The class may
    define ``available()`` and ``unavailable_reason()``. ``untraceable``: why the set cannot
    run inside ``torch.compile`` (empty when it can). ``auto_on``: device types on which
    ``kernels="auto"`` may pick it (``None``: every device); ``"auto"`` tries the highest ``auto_priority`` first.
    ``gpu_validated``: the GPU runs (``GpuRecord``) in which its GPU tests and the
    self-test passed (recorded in docs/gpu_validation.md); while empty, ``"auto"`` does not
    pick it for CUDA tensors (a path that has never run on a GPU is never a default there;
    it can still be named). ``device_check(device) -> str``: why the set cannot run on that
    device ("" when it can), asked by ``"auto"`` (the C++ kernels need code for the GPU's
    architecture in ``_C``). ``describe``: one line on what runs here, for ``info``.
    """

    name: str
    module: str
    attr: str
    untraceable: str = ""
    auto_on: frozenset[str] | None = frozenset()
    auto_priority: int = 0
    gpu_validated: tuple[GpuRecord, ...] = ()
    device_check: Callable[[torch.device], str] | None = None
    describe: Callable[[], str] = lambda: ""

    @property
    def traceable(self) -> bool:
        return not self.untraceable


def _describe_triton() -> str:
    if torch.cuda.is_available():
        return "Triton kernels on the GPU"
    return "under TRITON_INTERPRET=1: Triton's CPU interpreter (slow; for tests)"


def _describe_cuda() -> str:
    if torch.cuda.is_available():
        return "C++/CUDA extension on the GPU (its CPU twin on CPU tensors)"
    return "C++ extension: its CPU twin (no GPU visible; the CUDA kernels need one)"


def _cuda_code_check(device: torch.device) -> str:
    """Why ``_C`` cannot run its CUDA kernels on ``device`` ("" when it carries code for the GPU's arch)."""
    if device.type != "cuda":
        return ""
    from .. import extension

    try:
        archs = extension.cuda_archs()
        capability = tuple(torch.cuda.get_device_capability(device))
    except (ImportError, RuntimeError, AssertionError) as e:
        return f"{type(e).__name__}: {e}"
    if not archs:
        return "_C was built without CUDA (CPU-only extension)"
    if extension.arch_code_for(capability) is None:
        arch = f"{capability[0]}.{capability[1]}"
        return (
            f"_C carries code for {', '.join(archs)} (ULYSSES_KERNELS_CUDA_ARCHS at build time), not for this GPU's {arch}; "
            f"rebuild it for this GPU: {extension.rebuild_command(f'ULYSSES_KERNELS_CUDA_ARCHS={arch}')}"
        )
    return ""


class _Registry(dict):
    """The registry's dict, counting its changes (``registry_generation``), so that a call's
    kernel set, resolved once per input signature, is resolved again after the registry
    changes (a new set, or a test replacing one)."""

    generation = 0

    def __setitem__(self, name, spec):
        super().__setitem__(name, spec)
        _Registry.generation += 1

    def __delitem__(self, name):
        super().__delitem__(name)
        _Registry.generation += 1


KERNEL_SETS: dict[str, KernelSetSpec] = _Registry()


def registry_generation() -> int:
    """A number that changes whenever ``KERNEL_SETS`` does."""
    return _Registry.generation


def register_kernel_set(spec: KernelSetSpec) -> None:
    """Add ``spec`` to the registry (a name registered twice is an error)."""
    if spec.name in KERNEL_SETS:
        raise ValueError(f"register_kernel_set: a kernel set named {spec.name!r} is registered already")
    KERNEL_SETS[spec.name] = spec
    _import_or_why.cache_clear()


@functools.cache
def _import_or_why(name: str):
    """``(class, "")``, or ``(None, why)`` when the set cannot run in this process."""
    spec = KERNEL_SETS[name]
    try:
        cls = getattr(importlib.import_module(spec.module), spec.attr)
    except (ImportError, AttributeError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"
    if not getattr(cls, "available", lambda: True)():
        why = getattr(cls, "unavailable_reason", None)
        return None, why() if why is not None else f"{spec.attr}.available() is False"
    return cls, ""


# The built-in sets, in the order they are listed (``available_kernels``, ``info``).
# torch: views and copies of stock PyTorch ops, whose CUDA kernels are PyTorch's own.
register_kernel_set(
    KernelSetSpec(
        "torch",
        "ulysses_kernels.kernels.torch_kernels",
        "TorchKernels",
        auto_on=None,
        gpu_validated=(H200_2026_11_27,),
        describe=lambda: "pure PyTorch, any device",
    )
)
register_kernel_set(
    KernelSetSpec(
        "triton",
        "ulysses_kernels.kernels.triton_kernels",
        "TritonKernels",
        untraceable="its launcher reads tensor addresses (data_ptr) into a descriptor table at run time, "
        "which a traced graph cannot do; use kernels='cuda' or 'torch' under torch.compile",
        auto_on=frozenset({"cuda"}),
        auto_priority=1,
        gpu_validated=(H200_2026_11_27,),
        describe=_describe_triton,
    )
)
register_kernel_set(
    KernelSetSpec(
        "cuda",
        "ulysses_kernels.kernels.cuda_kernels",
        "CudaKernels",
        auto_on=frozenset({"cuda"}),
        auto_priority=2,
        gpu_validated=(H200_2026_11_27,),
        device_check=_cuda_code_check,
        describe=_describe_cuda,
    )
)


def _constant_in_traces(fn):
    """``torch.compiler.assume_constant_result`` without importing torch._dynamo: torch's
    decorator imports it (2.9 s of the package's 6.6 s import on a 2-core CPU, paid by every
    rank process and command line), only to set this marker, which dynamo reads when it
    traces a call (torch 2.14; tests/test_compile.py checks the two agree)."""
    fn._dynamo_marked_constant = True
    return fn


# Inside torch.compile the result is a constant of the trace: dynamo does not trace
# importlib (it would break the graph), and whether a kernel set can run does not change
# during a process (the import is attempted once, then cached).
@_constant_in_traces
def _load(name: str):
    """The kernel-set class for ``name``, or None when it cannot run in this process."""
    return _import_or_why(name)[0]


def available_kernels() -> list[str]:
    """Kernel sets that can run in this process, in registration order."""
    return [n for n in KERNEL_SETS if _load(n) is not None]


def kernel_set_report() -> list[dict]:
    """Every registered set: ``{"name", "runs_here", "detail"}`` (what runs, or why not)."""
    report = []
    for name, spec in KERNEL_SETS.items():
        cls, why = _import_or_why(name)
        report.append({"name": name, "runs_here": cls is not None, "detail": spec.describe() if cls is not None else why})
    return report


# A device's architecture and _C's arch list do not change during a process: inside
# torch.compile the answer is a constant of the trace (dynamo would not trace the query).
@_constant_in_traces
def _device_reason(name: str, device: torch.device) -> str:
    check = KERNEL_SETS[name].device_check
    return check(device) if check is not None else ""


def auto_choice(device: torch.device, layout=None, *, traceable: bool = False) -> tuple[KernelSet, dict[str, str]]:
    """What ``kernels="auto"`` runs on ``device``: ``(kernel set, {name: why passed over})``.

    Tries the sets by ``auto_priority``, highest first, and takes the first that ``auto``
    may pick on the device type (``auto_on``), that has passed on a GPU when the device is
    one (``gpu_validated``), that can run in this process and on this device
    (``device_check``: ``_C``'s code for the GPU's arch), that traces when ``traceable``,
    and whose ``supports(layout)`` says yes. The reasons say why each set before it was
    passed over (``info`` and the self-test print them).
    """
    passed = {}
    for spec in sorted(KERNEL_SETS.values(), key=lambda x: -x.auto_priority):
        if spec.auto_on is not None and device.type not in spec.auto_on:
            continue  # not a candidate on this device type at all
        if traceable and not spec.traceable:
            passed[spec.name] = "does not trace under torch.compile"
            continue
        if device.type == "cuda" and not spec.gpu_validated:
            passed[spec.name] = "has not passed on a GPU yet (docs/gpu_validation.md)"
            continue
        cls = _load(spec.name)
        if cls is None:
            # (The reason is looked up outside a trace only: a plain call, a cached import.)
            passed[spec.name] = "cannot run in this process" + ("" if traceable else f" ({_import_or_why(spec.name)[1]})")
            continue
        why = _device_reason(spec.name, device)
        if why:
            passed[spec.name] = why
            continue
        # Ask the instance, not the class: inside torch.compile the class is a constant
        # of the trace that dynamo cannot guard attribute look-ups on.
        kern = cls()
        if layout is None or getattr(kern, "supports", lambda _: True)(layout):
            return kern, passed
        passed[spec.name] = "does not support this layout (supports() is False)"
    return TorchKernels(), passed


def get_kernels(name, device: torch.device, layout=None, *, traceable: bool = False):
    """The kernel set for ``name`` (None, "auto", a registered name, or a kernel-set object).

    With ``"auto"``, a set whose ``supports(layout)`` says no (the C++ kernels take at most
    ``kMaxPeers`` ranks) is passed over for the next one. ``traceable=True`` (the path inside
    ``torch.compile``): ``"auto"`` passes over untraceable sets and naming one raises
    ``ValueError`` saying why."""
    if name is not None and not isinstance(name, str):
        spec = KERNEL_SETS.get(getattr(name, "name", None))
        if traceable and spec is not None and not spec.traceable:
            raise ValueError(f"ulysses_kernels: kernel set {name.name!r} does not trace: {spec.untraceable}")
        return name
    if name in (None, "auto"):
        return auto_choice(device, layout, traceable=traceable)[0]
    if name not in KERNEL_SETS:
        raise ValueError(f"ulysses_kernels: kernels={name!r}; expected 'auto' or one of {list(KERNEL_SETS)}")
    spec = KERNEL_SETS[name]
    if traceable and not spec.traceable:
        raise ValueError(f"ulysses_kernels: kernels={name!r} does not trace: {spec.untraceable}")
    cls = _load(name)
    if cls is None:
        raise ValueError(f"ulysses_kernels: kernels={name!r} is not available here ({_import_or_why(name)[1]}); available: {available_kernels()}")
    return cls()
