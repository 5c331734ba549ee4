"""Data-movement kernels behind one interface, chosen per call.

A kernel set is an object with three methods that match the reference in
``ulysses_kernels.layout`` bit for bit (same arguments, same results):

* ``pack_s2h(layout, tensors, streams, send)``: sequence-sharded tensors -> flat send buffer;
* ``pack_h2s(layout, local, send)``: a local ``[B, S, h, D]`` tensor -> flat wire format;
* ``unpack_h2s(layout, blocks, streams, outs)``: received blocks -> ``[B, s_r, H, D]``
  outputs, summing replicated KV heads in rank order.

Names: ``"torch"`` (the reference, any device), ``"triton"`` (Triton kernels; CUDA, or the
CPU under ``TRITON_INTERPRET=1``), ``"cuda"`` (the C++/CUDA extension, with its CPU twin on
CPU tensors). ``None``/``"auto"`` picks ``"cuda"`` when the extension is built and the
tensors are on a GPU, then ``"triton"`` on a GPU, else ``"torch"``.
"""

from __future__ import annotations

import importlib

import torch

from .. import layout as _layout

__all__ = ["TorchKernels", "get_kernels", "available_kernels"]


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


def _load(name: str):
    if name == "torch":
        return TorchKernels
    module, attr = _LOADERS[name]
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return cls if getattr(cls, "available", lambda: True)() else None


def available_kernels() -> list[str]:
    """Kernel sets that can run in this process."""
    return [n for n in ("torch", *_LOADERS) if _load(n) is not None]


def get_kernels(name, device: torch.device, layout=None):
    """The kernel set for ``name`` (None, "auto", "torch", "triton", "cuda" or an object).

    With ``"auto"``, a set whose ``supports(layout)`` says no (the C++ kernels take at most
    64 ranks) is passed over for the next one."""
    if name is not None and not isinstance(name, str):
        return name
    if name in (None, "auto"):
        order = ("cuda", "triton", "torch") if device.type == "cuda" else ("torch",)
        for candidate in order:
            cls = _load(candidate)
            if cls is not None and (layout is None or getattr(cls, "supports", lambda _: True)(layout)):
                return cls()
        return TorchKernels()
    if name not in ("torch", *_LOADERS):
        raise ValueError(f"ulysses_kernels: kernels={name!r}; expected 'auto', 'torch', 'triton' or 'cuda'")
    cls = _load(name)
    if cls is None:
        raise ValueError(f"ulysses_kernels: kernels={name!r} is not available here (available: {available_kernels()})")
    return cls()
