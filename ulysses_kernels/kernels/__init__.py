"""Data-movement kernels behind one interface, chosen per call.

A kernel set is an object with three methods that match the reference in
``ulysses_kernels.layout`` bit for bit (same arguments, same results):

* ``pack_s2h(layout, tensors, roles, send)``: sequence-sharded tensors -> flat send buffer;
* ``pack_h2s(layout, local, send)``: a local ``[B, S, h, D]`` tensor -> flat wire format;
* ``unpack_h2s(layout, blocks, roles, outs)``: received blocks -> ``[B, s_r, H, D]``
  outputs, summing replicated KV heads in rank order.

Names: ``"torch"`` (the reference, any device), ``"triton"`` (Triton kernels; CUDA, or the
CPU under ``TRITON_INTERPRET=1``), ``"cuda"`` (the C++/CUDA extension, with its CPU twin on
CPU tensors). ``None``/``"auto"`` picks ``"cuda"`` when the extension is built and the
tensors are on a GPU, then ``"triton"`` on a GPU, else ``"torch"``.
"""

from __future__ import annotations

import functools
import importlib

import torch

from .. import layout as _layout

__all__ = ["TorchKernels", "get_kernels", "available_kernels", "UNTRACEABLE"]


class TorchKernels:
    """The pure-PyTorch reference (``ulysses_kernels.layout``)."""

    name = "torch"
    pack_s2h = staticmethod(_layout.pack_s2h)
    pack_h2s = staticmethod(_layout.pack_h2s)
    unpack_h2s = staticmethod(_layout.unpack_h2s)


# name -> (module, attribute): imported lazily; a module that fails to import is unavailable.
_LOADERS = {
    "triton": ("ulysses_kernels.kernels.triton_kernels", "TritonKernels"),
    "cuda": ("ulysses_kernels.kernels.cuda_kernels", "CudaKernels"),
}


@functools.cache
def _import_or_why(name: str):
    """``(class, "")``, or ``(None, why)`` when the set cannot run in this process."""
    module, attr = _LOADERS[name]
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"
    if not getattr(cls, "available", lambda: True)():
        why = getattr(cls, "unavailable_reason", None)
        return None, why() if why is not None else f"{attr}.available() is False"
    return cls, ""


# Inside torch.compile the result is a constant of the trace: dynamo does not trace
# importlib (it would break the graph), and whether a kernel set can run does not change
# during a process (the import is attempted once, then cached).
@torch.compiler.assume_constant_result
def _load(name: str):
    """The kernel-set class for ``name``, or None when it cannot run in this process."""
    return TorchKernels if name == "torch" else _import_or_why(name)[0]


def available_kernels() -> list[str]:
    """Kernel sets that can run in this process."""
    return [n for n in ("torch", *_LOADERS) if _load(n) is not None]


# Why "triton" cannot run inside torch.compile (``get_kernels(..., traceable=True)``).
UNTRACEABLE = {
    "triton": "its launcher reads tensor addresses (data_ptr) into a descriptor table at run time, "
    "which a traced graph cannot do; use kernels='cuda' or 'torch' under torch.compile",
}


def get_kernels(name, device: torch.device, layout=None, *, traceable: bool = False):
    """The kernel set for ``name`` (None, "auto", "torch", "triton", "cuda" or an object).

    With ``"auto"``, a set whose ``supports(layout)`` says no (the C++ kernels take at most
    64 ranks) is passed over for the next one. ``traceable=True`` (the path inside
    ``torch.compile``): ``"auto"`` passes over the sets in ``UNTRACEABLE`` and naming one
    raises ``ValueError`` saying why."""
    if name is not None and not isinstance(name, str):
        why = UNTRACEABLE.get(getattr(name, "name", None)) if traceable else None
        if why:
            raise ValueError(f"ulysses_kernels: kernel set {name.name!r} does not trace: {why}")
        return name
    if name in (None, "auto"):
        order = ("cuda", "triton", "torch") if device.type == "cuda" else ("torch",)
        if traceable:
            order = tuple(n for n in order if n not in UNTRACEABLE)
        for candidate in order:
            cls = _load(candidate)
            if cls is None:
                continue
            # Ask the instance, not the class: inside torch.compile the class is a constant
            # of the trace that dynamo cannot guard attribute look-ups on.
            kern = cls()
            if layout is None or getattr(kern, "supports", lambda _: True)(layout):
                return kern
        return TorchKernels()
    if name not in ("torch", *_LOADERS):
        raise ValueError(f"ulysses_kernels: kernels={name!r}; expected 'auto', 'torch', 'triton' or 'cuda'")
    if traceable and name in UNTRACEABLE:
        raise ValueError(f"ulysses_kernels: kernels={name!r} does not trace: {UNTRACEABLE[name]}")
    cls = _load(name)
    if cls is None:
        raise ValueError(
            f"ulysses_kernels: kernels={name!r} is not available here ({_import_or_why(name)[1]}); "
            f"available: {available_kernels()}"
        )
    return cls()
