"""What the benchmarks sweep, spelt as a person types it: byte sizes, dtypes, head sets.

``parse_size``/``format_size``/``size_sweep`` are nccl-tests' ``-b -e -f`` (binary units);
``parse_dtype``/``dtype_name`` the short dtype names of the tables; ``MODELS`` and
``parse_heads_sets`` the (query heads, KV heads) pairs of ``--heads-sets 32/8,40/8``.
"""

from __future__ import annotations

import math
import re

import torch

__all__ = ["MODELS", "parse_size", "format_size", "size_sweep", "parse_dtype", "dtype_name", "parse_heads_sets"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


# ---- sizes -------------------------------------------------------------------------------
def parse_size(text: str | int) -> int:
    """``"1K"`` -> 1024, ``"4M"`` -> 4194304, ``"512"`` -> 512 (binary units, as nccl-tests;
    an optional trailing ``B`` is ignored, ``"1.5K"`` is allowed when it is a whole number)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"parse_size: expected a size like 512, 1K, 4M or 1G, got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value != int(value) or value < 1:
        raise ValueError(f"parse_size: {text!r} is not a positive whole number of units")
    return int(value)


def format_size(n: int) -> str:
    """The shortest exact binary-unit spelling: 1024 -> ``"1K"``, 1536 -> ``"1536"``."""
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def size_sweep(begin: int, end: int, factor: float) -> list[int]:
    """``begin, begin*factor, ...`` up to and including ``end`` (nccl-tests ``-b -e -f``)."""
    if begin < 1 or end < begin:
        raise ValueError(f"size_sweep: need 1 <= begin <= end, got {begin}..{end}")
    if factor <= 1 and begin != end:
        raise ValueError(f"size_sweep: factor must be > 1 for a sweep, got {factor}")
    sizes, s = [], begin
    while s <= end:
        sizes.append(int(s))
        if begin == end:
            break
        s = int(math.floor(s * factor)) if s * factor > s + 0.5 else s + 1
    return sizes


# ---- dtypes ------------------------------------------------------------------------------
_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "half": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float": torch.float32, "float32": torch.float32,
    "fp64": torch.float64, "double": torch.float64, "float64": torch.float64,
}  # fmt: skip


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"parse_dtype: expected one of {sorted(set(_DTYPES))}, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


# ---- head sets ---------------------------------------------------------------------------
# The models the benchmarks sweep: (query heads, KV heads).
MODELS = {"llama3-8b": (32, 8), "qwen2.5-14b": (40, 8), "llama3-70b": (64, 8)}


def parse_heads_sets(
    script: str, heads_sets: str | None, models: str | None, heads: int | None = None, kv_heads: int | None = None
) -> list[tuple[str, int, int]]:
    """``(label, q_heads, kv_heads)`` from ``--heads-sets 32/8,40/8`` (labelled ``32/8``), else
    ``--heads/--kv-heads``, else ``--models`` (names of ``MODELS`` or ``all``; labelled by
    name). ``script`` names the caller in the error for an unknown model."""
    if heads_sets:
        out = []
        for spec in heads_sets.split(","):
            hq, hkv = (int(x) for x in spec.split("/"))
            out.append((f"{hq}/{hkv}", hq, hkv))
        return out
    if heads:
        hkv = kv_heads or heads
        return [(f"{heads}/{hkv}", heads, hkv)]
    names = list(MODELS) if models == "all" else [m.strip() for m in (models or "").split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS]
    if bad or not names:
        raise SystemExit(f"{script}: unknown --models {bad or models!r}; choose from {', '.join(MODELS)} or all")
    return [(m, *MODELS[m]) for m in names]
