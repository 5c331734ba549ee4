"""The C++/CUDA extension ``ulysses_kernels._C``, seen from Python: the one module that loads it.

``load()`` imports torch first (the extension links against it), then ``_C`` (which
registers the ``torch.ops.ulysses_kernels`` ops), checks that the NCCL we linked is the
NCCL torch loaded (two NCCL libraries in one process disagree on communicator internals,
so a mismatch is an error here rather than a crash later) and registers the fake kernels
of every op, so that ``torch.library.opcheck`` and ``torch.compile`` can see them. It is
done once per process; its result (the module, or why not) does not change.

The ops (schemas in ``csrc/ops.cpp`` and ``csrc/nccl_ops.cpp``); each mutates its
outputs and returns nothing:

* ``pack_s2h(tensors, head_ranges, send, recv=None, rank=-1, seq_offset=0)``: q, k, v
  (``[B, s_r, H_i, D]`` each, any strides: separate tensors or views of one fused QKV
  projection output) into the peer-major send buffer of ``kernels.torch_kernels.pack_s2h`` (with
  ``recv``, rank ``rank``'s own block into its rows of the receive buffer
  ``[B, S, h, D]``), in one kernel pass. ``head_ranges`` is ``[peer][role][start, end]``
  flattened (``Layout.head_ranges``).
* ``pack_h2s(local, send)``: ``[B, S, h, D]`` (any strides) -> contiguous wire format.
* ``unpack_h2s(blocks, head_ranges, outs)``: received ``[B, s_r, h, D]`` blocks
  (source-major, then role; a block may also be the flat 1-D contiguous piece of
  ``B * s_r * h * D`` elements it is in wire format) into ``[B, s_r, H, D]`` outputs,
  replicated KV heads summed in rank order (bit-identical to ``kernels.torch_kernels.unpack_h2s``).
* ``nccl_all_to_all(comm, output, input, output_splits, input_splits)`` and
  ``nccl_send_recv(comm, sends, send_peers, recvs, recv_peers)`` (CUDA tensors, extension
  built with NCCL): on the current CUDA stream; ``comm`` is a communicator handle of
  ``ulysses_kernels.comm.nccl.NCCLCommunicator``.

CUDA tensors run the CUDA kernels; CPU tensors run their CPU twin (the same index math,
``csrc/kernels/layout_math.h``). The pack ops are called by their one caller, the ``"cuda"``
kernel set (``kernels/cuda_kernels.py``: a ``Layout`` in, the op's arguments out), as
``torch.ops.ulysses_kernels.pack_s2h(...)``; the NCCL ops through the typed wrappers below,
which ``comm.nccl`` calls (and its tests replace).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = [
    "load",
    "available",
    "build_info",
    "limits",
    "cuda_archs",
    "arch_code_for",
    "rebuild_command",
    "decode_nccl_version",
    "check_nccl_versions",
    "lib",
    "nccl_all_to_all",
    "nccl_send_recv",
    "PACK_VARIANTS",
    "SET_VARIANTS",
    "kernel_variant",
    "pack_variant",
    "set_pack_variant",
]

# {"module": _C} or {"error": why}, filled by the first load(): whether the extension can
# be used does not change during a process.
_STATE: dict = {}

# ---- the kernel variant ----------------------------------------------------------------------
# The pack/unpack kernels of the "triton" set come in variants, all exact; the "cuda" set has one.
# One name per process selects them (``ULYSSES_KERNELS_PACK_VARIANT``, read once, or
# ``set_pack_variant``); each set runs it where it has a variant of that name, else its
# fallback (``VARIANT_FALLBACK``):
#   cuda:   "new" only (warp chunks of 32 rows, 4 units in flight per lane, one unpack launch
#           for q, k and v). "old" lost to it on an H200 (2026-11-28), and "wide" (equal row
#           shares per warp, 8 units in flight) too (issue 49; bench/results/2026-11-30_h200_world:
#           +0.6..+6.3 points of a copy on the even layouts, 25.1% against 57.6% on the uneven
#           unpack, 40/8 heads over 5 ranks); both were removed.
#   triton: "old" (the kernels before issue #36) and "new".
# ``python -m ulysses_kernels.bench.pack --variants old,new`` measures them side by side in one
# process; docs/performance.md.
PACK_VARIANTS = ("old", "new")
SET_VARIANTS = {"cuda": ("new",), "triton": ("old", "new")}
VARIANT_FALLBACK = {"cuda": "new", "triton": "new"}
DEFAULT_PACK_VARIANT = "new"
PACK_VARIANT_ENV = "ULYSSES_KERNELS_PACK_VARIANT"
_CUDA_VARIANT_CODES = {"new": 1}  # csrc/kernels/layout_math.h kVariantNew
_VARIANT: dict = {}  # {"name": ...} once read from the environment or set


def pack_variant() -> str:
    """The process's kernel variant name (one of ``PACK_VARIANTS``): ``ULYSSES_KERNELS_PACK_VARIANT``
    read once, unless ``set_pack_variant`` changed it since. ValueError naming the variable
    when it holds anything else. ``kernel_variant`` says what one kernel set runs under it."""
    name = _VARIANT.get("name")
    if name is None:
        name = os.environ.get(PACK_VARIANT_ENV, "").strip().lower() or DEFAULT_PACK_VARIANT
        if name not in PACK_VARIANTS:
            raise ValueError(f"ulysses_kernels: {PACK_VARIANT_ENV}={os.environ[PACK_VARIANT_ENV]!r}; expected one of {list(PACK_VARIANTS)}")
        _VARIANT["name"] = name
    return name


def kernel_variant(kernels: str) -> str:
    """The variant kernel set ``kernels`` (``"cuda"`` or ``"triton"``) runs now: the process's
    variant where the set has it, else the set's ``VARIANT_FALLBACK``."""
    name = pack_variant()
    return name if name in SET_VARIANTS[kernels] else VARIANT_FALLBACK[kernels]


def set_pack_variant(name: str) -> str:
    """Use kernel variant ``name`` (one of ``PACK_VARIANTS``) from now on in this process, for
    the ``"cuda"`` set (the C++ extension's setting, when it is loaded) and the ``"triton"``
    set, each as ``kernel_variant`` says; returns the previous one. For benchmarks and A/B checks."""
    if name not in PACK_VARIANTS:
        raise ValueError(f"ulysses_kernels.set_pack_variant: name expected one of {list(PACK_VARIANTS)}, got {name!r}")
    previous = pack_variant()
    _VARIANT["name"] = name
    if "module" in _STATE:
        _STATE["module"].pack_variant(_CUDA_VARIANT_CODES[kernel_variant("cuda")])
    return previous


def decode_nccl_version(code: int) -> tuple[int, int, int]:
    """``NCCL_VERSION_CODE`` -> ``(major, minor, patch)`` (2.9+ use 5 digits, older ones 4)."""
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


def rebuild_command(env: str = "") -> str:
    """The command that builds ``_C`` against this environment's torch, for how the package was installed.

    A source checkout (the package sits next to ``setup.py`` and ``csrc/``: an in-place or
    editable build) is rebuilt in place; an installed copy is reinstalled from its source
    with pip, without build isolation (the build must see this torch). ``env``
    (``"CUDA_HOME=/usr/local/cuda"``, say) goes right before the build command.
    """
    env = f"{env} " if env else ""
    root = Path(__file__).resolve().parent.parent
    if (root / "setup.py").is_file() and (root / "csrc").is_dir():
        return f"cd {root} && {env}python setup.py build_ext --inplace"
    source = "--no-binary ulysses_kernels ulysses_kernels"
    try:
        direct = json.loads(importlib.metadata.distribution("ulysses_kernels").read_text("direct_url.json") or "null")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        direct = None
    if direct and direct.get("url", "").startswith("file://") and "dir_info" in direct:
        source = direct["url"][len("file://") :]
    return f"{env}pip install --no-build-isolation --no-deps --force-reinstall {source}"


def check_nccl_versions(linked: tuple[int, ...], loaded: tuple[int, ...]) -> None:
    """Raise ImportError when the NCCL the extension was built against is not torch's."""
    if tuple(linked[:3]) != tuple(loaded[:3]):
        lv, tv = ".".join(map(str, linked[:3])), ".".join(map(str, loaded[:3]))
        raise ImportError(
            f"ulysses_kernels._C was built against NCCL {lv} but torch {torch.__version__} loaded NCCL {tv} "
            f"(ncclGetVersion of the libnccl mapped); rebuild the extension in this environment so that both use one NCCL: "
            f"{rebuild_command()}"
        )


def nccl_libraries() -> list[str]:
    """The libnccl files mapped into this process (Linux; empty elsewhere or before any is loaded)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split(None, 5)[5].strip() for line in f if "libnccl" in line and len(line.split(None, 5)) == 6})
    except OSError:
        return []


def torch_nccl_header_version() -> tuple[int, int, int] | None:
    """The NCCL torch was built with (``torch.cuda.nccl.version()`` is its header's NCCL_MAJOR/MINOR/PATCH, not the library loaded)."""
    try:
        v = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return tuple(v)[:3] if isinstance(v, tuple) else decode_nccl_version(int(v))


def loaded_nccl_version() -> tuple[int, int, int] | None:
    """The NCCL this process runs: ``ncclGetVersion`` of the one libnccl mapped (a carried NCCL put ahead of torch's
    runs instead of the one torch was built with), else torch's header version; None where torch has no NCCL."""
    libs = nccl_libraries()
    if len(libs) == 1:
        import ctypes

        try:
            code = ctypes.c_int()
            if ctypes.CDLL(libs[0]).ncclGetVersion(ctypes.byref(code)) == 0:
                return decode_nccl_version(code.value)
        except (OSError, AttributeError):
            pass
    return torch_nccl_header_version()


def _import_checked():
    """``_C``, checked against this process; ImportError saying why it cannot be used."""
    try:
        module = importlib.import_module("ulysses_kernels._C")
    except ModuleNotFoundError as e:
        if e.name != "ulysses_kernels._C":
            raise
        raise ImportError(
            "ulysses_kernels._C is not built: this installation has no C++/CUDA extension (no 'cuda' kernel set, "
            f"no native NCCL communicator; the torch and Triton paths still work). Build it: {rebuild_command()}"
        ) from e
    except ImportError as e:  # e.g. an undefined symbol: built against another torch
        raise ImportError(f"ulysses_kernels._C does not load here ({e}); rebuild it against torch {torch.__version__}: {rebuild_command()}") from e
    info = module.build_info()
    if "max_peers" not in info or not hasattr(module, "pack_variant"):
        raise ImportError(f"ulysses_kernels._C was built from older sources than this package (its build_info has no limits); rebuild it: {rebuild_command()}")
    if info.get("nccl"):
        loaded = loaded_nccl_version()
        if loaded is not None:
            check_nccl_versions(decode_nccl_version(info["nccl_header_version"]), loaded)
    return module


def load():
    """The imported ``_C`` module (its fake kernels registered); ImportError with the reason when it is not usable."""
    if "module" in _STATE:
        return _STATE["module"]
    if "error" in _STATE:
        raise ImportError(_STATE["error"])
    try:
        module = _import_checked()
    except ImportError as e:
        _STATE["error"] = str(e)
        _warn_if_a_gpu_misses_it(_STATE["error"])
        raise ImportError(_STATE["error"]) from e
    built = module.build_info()
    _STATE["limits"] = {k: int(built[k]) for k in ("max_peers", "max_roles")}
    _STATE["archs"] = tuple(a for a in built.get("archs", "").split("_") if a) if built.get("cuda") else ()
    _register_fakes(module)
    module.pack_variant(_CUDA_VARIANT_CODES[kernel_variant("cuda")])
    _STATE["module"] = module
    return module


def _warn_if_a_gpu_misses_it(why: str) -> None:
    # On the CPU nothing is lost (the default kernel set there is torch's); on a GPU the
    # fused kernels and native NCCL are, so say it where the user sees it.
    # ULYSSES_KERNELS_SKIP_EXTENSION=1 (the switch of a pure-Python build) silences it.
    if os.environ.get("ULYSSES_KERNELS_SKIP_EXTENSION", "0") != "1" and torch.cuda.is_available():
        warnings.warn(f"{why} (ULYSSES_KERNELS_SKIP_EXTENSION=1 silences this warning)", RuntimeWarning, stacklevel=3)


def available() -> bool:
    """True when ``_C`` loads and passes its checks in this process."""
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


def limits() -> dict:
    """``{"max_peers": int, "max_roles": int}``: the most ranks and q/k/v tensors one op takes.

    Read from the C++ side (``kMaxPeers``, ``kMaxRoles`` in ``csrc/kernels/layout_math.h``:
    the kernels' parameter structs hold every peer's head ranges). ImportError without ``_C``.
    """
    load()
    return _STATE["limits"]


def cuda_archs() -> tuple[str, ...]:
    """The CUDA archs ``_C`` carries kernels for (``("8.0", "9.0")``; ``+PTX`` kept where given), empty for a
    CPU-only build; ImportError without ``_C``."""
    load()
    return _STATE["archs"]


def _arch_tuple(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def arch_code_for(capability: tuple[int, int]) -> str | None:
    """The arch of ``_C``'s code that runs on a GPU of compute ``capability`` (``(9, 0)``), or None.

    CUDA's rule: a cubin for ``sm_XY`` runs on ``sm_XZ`` with ``Z >= Y`` (same major), and
    PTX (``"+PTX"``) is compiled by the driver for any later GPU. An ``a``-suffixed arch
    (``9.0a``) runs on exactly that GPU. ImportError without ``_C``.
    """
    for arch in sorted(cuda_archs(), key=_arch_tuple, reverse=True):
        base = arch.split("+")[0]
        major, minor = _arch_tuple(base)
        if base.endswith("a"):
            fits = (major, minor) == tuple(capability)
        elif arch.endswith("+PTX"):
            fits = (major, minor) <= tuple(capability)
        else:
            fits = major == capability[0] and minor <= capability[1]
        if fits:
            return arch
    return None


def lib():
    """``torch.ops.ulysses_kernels`` once ``_C`` is loaded (ImportError with the reason when it is not usable)."""
    load()
    return torch.ops.ulysses_kernels


# ---- typed wrappers of the NCCL ops --------------------------------------------------------------
def nccl_all_to_all(comm: int, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]) -> None:
    """All-to-all of contiguous CUDA buffers with per-rank split sizes (elements), on the current stream."""
    lib().nccl_all_to_all(comm, output, input, list(output_splits), list(input_splits))


def nccl_send_recv(comm: int, sends: Sequence[torch.Tensor], send_peers: Sequence[int], recvs: Sequence[torch.Tensor], recv_peers: Sequence[int]) -> None:
    """Every send and receive in one NCCL group, on the current stream (one peer per tensor)."""
    lib().nccl_send_recv(comm, list(sends), list(send_peers), list(recvs), list(recv_peers))


# ---- fake kernels: shape checks only (the ops mutate their outputs and return nothing) --------
def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"ulysses_kernels.{msg}")


def _fake_pack_s2h(tensors, head_ranges, send, recv=None, rank=-1, seq_offset=0):
    n, most = len(tensors), _STATE["limits"]["max_roles"]
    _require(1 <= n <= most, f"pack_s2h: tensors expected 1 to {most} tensors, got {n}")
    _require(len(head_ranges) % (2 * n) == 0 and len(head_ranges) > 0, f"pack_s2h: head_ranges expected 2 * {n} * world_size values, got {len(head_ranges)}")
    B, S, _, D = tensors[0].shape
    heads = sum(b - a for a, b in zip(head_ranges[0::2], head_ranges[1::2]))
    if recv is not None and 0 <= rank < len(head_ranges) // (2 * n):  # its block goes to recv
        mine = head_ranges[rank * 2 * n : (rank + 1) * 2 * n]
        heads -= sum(b - a for a, b in zip(mine[0::2], mine[1::2]))
    _require(send.dim() == 1 and send.numel() == S * B * D * heads, f"pack_s2h: send.numel() expected {S * B * D * heads}, got {send.numel()}")
    for i, x in enumerate(tensors):
        _require(x.dtype == send.dtype, f"pack_s2h: tensors[{i}].dtype expected {send.dtype} (the dtype of send), got {x.dtype}")


def _fake_pack_h2s(local, send):
    _require(local.dim() == 4, f"pack_h2s: local expected 4 dims [B, S, h, D], got shape {list(local.shape)}")
    _require(send.dim() == 1 and send.numel() == local.numel(), f"pack_h2s: send.numel() expected {local.numel()}, got {send.numel()}")


def _fake_unpack_h2s(blocks, head_ranges, outs):
    n, most = len(outs), _STATE["limits"]["max_roles"]
    _require(1 <= n <= most, f"unpack_h2s: outs expected 1 to {most} tensors, got {n}")
    _require(
        len(head_ranges) == 2 * len(blocks) and len(blocks) % n == 0,
        f"unpack_h2s: blocks expected world_size x {n} tensors and 2 head range values each, got {len(blocks)} blocks, {len(head_ranges)} values",
    )


def _fake_nccl_all_to_all(comm, output, input, output_splits, input_splits):
    _require(sum(output_splits) == output.numel(), f"nccl_all_to_all: sum(output_splits) expected {output.numel()}, got {sum(output_splits)}")
    _require(sum(input_splits) == input.numel(), f"nccl_all_to_all: sum(input_splits) expected {input.numel()}, got {sum(input_splits)}")


def _fake_nccl_send_recv(comm, sends, send_peers, recvs, recv_peers):
    _require(len(sends) == len(send_peers) and len(recvs) == len(recv_peers), "nccl_send_recv: one peer per tensor expected")


def _fake_quant_pack_s2h(tensors, head_ranges, send, recv=None, rank=-1, seq_offset=0, fmt=0):
    _require(send.dtype == torch.uint8 and send.dim() == 1, f"quant_pack_s2h: send expected 1-D uint8 (wire bytes), got {send.dtype} {list(send.shape)}")


def _fake_dequant_unpack_h2s(blocks, head_ranges, outs, fmt=0):
    _require(len(head_ranges) == 2 * len(blocks) and len(outs) >= 1, "dequant_unpack_h2s: blocks expected world_size x roles tensors, 2 head range values each")


def _register_fakes(module) -> None:
    fakes = {"pack_s2h": _fake_pack_s2h, "pack_h2s": _fake_pack_h2s, "unpack_h2s": _fake_unpack_h2s}
    if hasattr(torch.ops.ulysses_kernels, "quant_pack_s2h"):  # the FP8 wire's ops (csrc/fp8_ops.cpp)
        fakes.update(quant_pack_s2h=_fake_quant_pack_s2h, dequant_unpack_h2s=_fake_dequant_unpack_h2s)
    if module.build_info().get("nccl"):
        fakes.update(nccl_all_to_all=_fake_nccl_all_to_all, nccl_send_recv=_fake_nccl_send_recv)
    for name, fn in fakes.items():
        torch.library.register_fake(f"ulysses_kernels::{name}", fn)
