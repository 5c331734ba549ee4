"""The Triton kernel set's FP8 wire (``ulysses_kernels.wire``): the quantizing pack and the
dequantizing unpack, bit-exact twins of ``torch_kernels.quantize_rows``/``dequantize_rows``.

Two kernels over head *columns*, as ``triton_kernels`` moves data (one program: ``BLOCK_R``
rows of one head), with descriptor tables built from the layout's own views on meta buffers:

* ``_quant_kernel``: per column, a source head ``[n_tok, B, D]`` (any float dtype, any
  strides) -> wire rows of ``D + 4`` bytes (FP8 values, then the float32 scale);
  column table (int64, 10 per column)::

      dst_tensor, dst_off, dst_s_tok, dst_s_batch, src_tensor, src_off, src_s_tok, src_s_batch, src_s_d, D

* ``_dequant_kernel``: per output head column, one wire source or several (replicated KV
  heads), each dequantized and rounded to the output dtype, summed in rank order, rounding
  after every add (``add_``'s sum); column table (7 per column) and source table (4 each)::

      dst_tensor, dst_off, dst_s_tok, dst_s_batch, n_src, first_src, D
      src_tensor, src_off, src_s_tok, src_s_batch

Offsets and strides are in elements of each tensor's dtype (bytes for the wire buffers).
FP8 encoding and decoding are integer operations on float32 bits (round to nearest even,
as PyTorch's conversion), so the result does not depend on the compiler's or the
interpreter's conversions; the divisions are ``div_rn`` (correctly rounded, as PyTorch's),
and the launches pass ``enable_fp_fusion=False`` (Triton would fuse a dequantized product
and the replica sum's add into one FMA, which the reference rounds twice).
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from ..layout import Layout
from ..wire import AMAX_FLOOR, SCALE_BYTES, Fp8Format, wire_layout

__all__ = ["quant_pack_s2h", "quant_pack_h2s", "dequant_s2h", "dequant_unpack_h2s"]

_TL_FLOAT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_QCOL, _DCOL, _DSRC = 10, 7, 4


@triton.jit
def _load_f32(ptr, mask, FLOAT: tl.constexpr, IS_BF16: tl.constexpr):
    """Values of FLOAT at ``ptr`` as float32 (exact; bf16 by its bits)."""
    if IS_BF16:
        x = tl.load(ptr.to(tl.pointer_type(tl.uint16)), mask=mask, other=0)
        return (x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr.to(tl.pointer_type(FLOAT)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _encode(y, MB: tl.constexpr, BIAS: tl.constexpr, SUB_EXP: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """float32 ``y`` (finite, |y| <= the format's max) -> FP8 bits, round to nearest even."""
    u = y.to(tl.uint32, bitcast=True)
    sign = (u >> 31) << 7
    a = u & 0x7FFFFFFF
    DROP: tl.constexpr = 23 - MB
    r = a + ((1 << (DROP - 1)) - 1) + ((a >> DROP) & 1)
    norm = (r >> DROP) - ((127 - BIAS) << MB)
    # Below the normal range: the 24-bit significand shifted to units of the smallest subnormal.
    e8 = (a >> 23).to(tl.int32)
    k = tl.minimum(tl.maximum(150 + SUB_EXP - e8, 1), 31).to(tl.uint32)  # only k >= 21 is kept (where small)
    sig = (a & 0x7FFFFF) | 0x800000
    q = sig >> k
    rem = sig & ((1 << k) - 1)
    half = 1 << (k - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.uint32)
    small = a.to(tl.float32, bitcast=True) < MIN_NORMAL
    return (tl.where(small, sub, norm) | sign).to(tl.uint8)


@triton.jit
def _decode(bits, MB: tl.constexpr, BIAS: tl.constexpr, SUB_STEP: tl.constexpr, IS_E4M3: tl.constexpr):
    """FP8 bits -> float32 (exact)."""
    b = bits.to(tl.uint32)
    EMASK: tl.constexpr = (1 << (7 - MB)) - 1
    e = (b >> MB) & EMASK
    m = b & ((1 << MB) - 1)
    sign = (b >> 7) << 31
    normal = (sign | ((e + (127 - BIAS)) << 23) | (m << (23 - MB))).to(tl.float32, bitcast=True)
    sub = (sign | 0x3F800000).to(tl.float32, bitcast=True) * (m.to(tl.float32) * SUB_STEP)  # +-1 * m * 2^min_exp, exact
    x = tl.where(e == 0, sub, normal)
    if IS_E4M3:
        nan = (b & 0x7F) == 0x7F
    else:
        nan = (e == EMASK) & (m != 0)
        x = tl.where((e == EMASK) & (m == 0), (sign | 0x7F800000).to(tl.float32, bitcast=True), x)
    return tl.where(nan, float("nan"), x)


@triton.jit
def _round_to(x, FLOAT: tl.constexpr, IS_BF16: tl.constexpr, BF16_NAN: tl.constexpr):
    """float32 -> FLOAT, round to nearest even (bf16 by integer operations), as FLOAT."""
    if IS_BF16:
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, BF16_NAN, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(FLOAT)


@triton.jit
def _quant_kernel(addr_ptr, col_ptr, n_rows, batch, FLOAT: tl.constexpr, IS_BF16: tl.constexpr, ITEM: tl.constexpr, FMT_MAX: tl.constexpr,
                  MB: tl.constexpr,
                  BIAS: tl.constexpr, SUB_EXP: tl.constexpr, MIN_NORMAL: tl.constexpr, FLOOR: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_D: tl.constexpr):  # fmt: skip
    pid_r = tl.program_id(0).to(tl.int64)
    c = col_ptr + tl.program_id(1).to(tl.int64) * 10
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    tok, b = r // batch, r % batch
    d = tl.arange(0, BLOCK_D)
    D = tl.load(c + 9)
    rmask = r < n_rows
    mask = rmask[:, None] & (d < D)[None, :]
    src = tl.load(addr_ptr + tl.load(c + 4)).to(tl.pointer_type(tl.uint8))
    src_row = tl.load(c + 5) + tok * tl.load(c + 6) + b * tl.load(c + 7)
    x = _load_f32(src + (src_row[:, None] + d[None, :] * tl.load(c + 8)) * ITEM, mask, FLOAT, IS_BF16)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR)
    mx = tl.zeros_like(amax) + FMT_MAX
    inv = tl.math.div_rn(mx, amax)
    scale = tl.math.div_rn(amax, mx)
    y = tl.minimum(tl.maximum(x * inv[:, None], -FMT_MAX), FMT_MAX)
    dst = tl.load(addr_ptr + tl.load(c)).to(tl.pointer_type(tl.uint8))
    dst_row = tl.load(c + 1) + tok * tl.load(c + 2) + b * tl.load(c + 3)
    tl.store(dst + dst_row[:, None] + d[None, :], _encode(y, MB, BIAS, SUB_EXP, MIN_NORMAL), mask=mask)
    s = scale.to(tl.uint32, bitcast=True)
    for j in tl.static_range(4):  # the scale's 4 bytes, little-endian, after the row's D values
        tl.store(dst + dst_row + D + j, ((s >> (8 * j)) & 0xFF).to(tl.uint8), mask=rmask)


@triton.jit
def _dequant_source(addr_ptr, s, tok, b, d, D, mask, rmask, FLOAT: tl.constexpr, IS_BF16: tl.constexpr, BF16_NAN: tl.constexpr,
                    MB: tl.constexpr, BIAS: tl.constexpr, SUB_STEP: tl.constexpr, IS_E4M3: tl.constexpr):  # fmt: skip
    """One wire source's ``[BLOCK_R, BLOCK_D]`` tile, dequantized and rounded to FLOAT, as float32."""
    base = tl.load(addr_ptr + tl.load(s)).to(tl.pointer_type(tl.uint8))
    row = tl.load(s + 1) + tok * tl.load(s + 2) + b * tl.load(s + 3)
    bits = tl.load(base + row[:, None] + d[None, :], mask=mask, other=0)
    sc = tl.zeros_like(row).to(tl.uint32)
    for j in tl.static_range(4):  # the scale's 4 bytes, little-endian (any alignment)
        sc = sc | (tl.load(base + row + D + j, mask=rmask, other=0).to(tl.uint32) << (8 * j))
    x = _decode(bits, MB, BIAS, SUB_STEP, IS_E4M3) * sc.to(tl.float32, bitcast=True)[:, None]
    return _round_to(x, FLOAT, IS_BF16, BF16_NAN).to(tl.float32)


@triton.jit
def _dequant_kernel(addr_ptr, col_ptr, src_ptr, n_rows, batch, FLOAT: tl.constexpr, IS_BF16: tl.constexpr, BF16_NAN: tl.constexpr,
                    MB: tl.constexpr, BIAS: tl.constexpr, SUB_STEP: tl.constexpr, IS_E4M3: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):  # fmt: skip
    pid_r = tl.program_id(0).to(tl.int64)
    c = col_ptr + tl.program_id(1).to(tl.int64) * 7
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    tok, b = r // batch, r % batch
    d = tl.arange(0, BLOCK_D)
    D = tl.load(c + 6)
    rmask = r < n_rows
    mask = rmask[:, None] & (d < D)[None, :]
    n_src = tl.load(c + 4)
    s0 = tl.load(c + 5)
    acc = _dequant_source(addr_ptr, src_ptr + s0 * 4, tok, b, d, D, mask, rmask, FLOAT, IS_BF16, BF16_NAN, MB, BIAS, SUB_STEP, IS_E4M3)
    k = 1
    while k < n_src:  # a while, as in triton_kernels (the interpreter's loop bounds)
        x = _dequant_source(addr_ptr, src_ptr + (s0 + k) * 4, tok, b, d, D, mask, rmask, FLOAT, IS_BF16, BF16_NAN, MB, BIAS, SUB_STEP, IS_E4M3)
        acc = _round_to(acc + x, FLOAT, IS_BF16, BF16_NAN).to(tl.float32)  # add_'s sum: rounded after every add
        k += 1
    dst = tl.load(addr_ptr + tl.load(c)).to(tl.pointer_type(FLOAT))
    dst_row = tl.load(c + 1) + tok * tl.load(c + 2) + b * tl.load(c + 3)
    tl.store(dst + dst_row[:, None] + d[None, :], acc.to(FLOAT), mask=mask)


# ---- host side ----------------------------------------------------------------------------
_tables: OrderedDict[tuple, tuple[list[int], list[int]]] = OrderedDict()  # keyed by values (layouts, strides)


def _cached(key, build):
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = build()
        while len(_tables) > 256:
            _tables.popitem(last=False)
    else:
        _tables.move_to_end(key)
    return table


def _float_of(dtype: torch.dtype):
    if dtype not in _TL_FLOAT:
        raise TypeError(f"TritonKernels: the FP8 wire takes float16, bfloat16 or float32 tensors, got {dtype}")
    return _TL_FLOAT[dtype]


def _geometry(n_rows: int, n_cols: int, max_d: int) -> tuple[tuple[int, int], int, int]:
    """``(grid, BLOCK_R, BLOCK_D)``: rows on axis 0, head columns on axis 1 (at most 65535);
    bigger tiles in the interpreter, whose programs cost ~4 ms each whatever their size."""
    if n_cols > 65535:
        raise ValueError(f"TritonKernels: {n_cols} head columns exceed CUDA's grid limit (65535)")
    block_d = triton.next_power_of_2(max(max_d, 1))
    target = 1 << 14 if os.environ.get("TRITON_INTERPRET", "0") == "1" else 4096
    block_r = max(1, min(triton.next_power_of_2(n_rows), max(1, target // block_d)))
    return (triton.cdiv(n_rows, block_r), n_cols), block_r, block_d


def _int64(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` (on CUDA through pinned memory, no host sync)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t if device.type != "cuda" else t.pin_memory().to(device, non_blocking=True)


def _launch_quant(cols: list[int], tensors, n_tok: int, batch: int, fmt: Fp8Format, dtype: torch.dtype) -> None:
    n_cols, n_rows = len(cols) // _QCOL, n_tok * batch
    if n_cols == 0 or n_rows == 0:
        return
    device = tensors[0].device
    max_d = max(cols[i * _QCOL + 9] for i in range(n_cols))
    grid, block_r, block_d = _geometry(n_rows, n_cols, max_d)
    addr, table = _int64([t.data_ptr() for t in tensors], device), _int64(cols, device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _quant_kernel[grid](addr, table, n_rows, batch, FLOAT=_float_of(dtype), IS_BF16=dtype == torch.bfloat16,
                            ITEM=torch.empty(0, dtype=dtype).element_size(), FMT_MAX=fmt.max,
                            MB=fmt.mantissa_bits, BIAS=_bias(fmt), SUB_EXP=fmt.min_subnormal_exp, MIN_NORMAL=_min_normal(fmt),
                            FLOOR=AMAX_FLOOR, BLOCK_R=block_r, BLOCK_D=block_d, enable_fp_fusion=False)  # fmt: skip


def _launch_dequant(table: tuple[list[int], list[int]], tensors, n_tok: int, batch: int, fmt: Fp8Format, out: torch.Tensor) -> None:
    cols, srcs = table
    n_cols, n_rows = len(cols) // _DCOL, n_tok * batch
    if n_cols == 0 or n_rows == 0:
        return
    device = out.device
    max_d = max(cols[i * _DCOL + 6] for i in range(n_cols))
    grid, block_r, block_d = _geometry(n_rows, n_cols, max_d)
    addr, col_t, src_t = _int64([t.data_ptr() for t in tensors], device), _int64(cols, device), _int64(srcs, device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _dequant_kernel[grid](addr, col_t, src_t, n_rows, batch, FLOAT=_float_of(out.dtype), IS_BF16=out.dtype == torch.bfloat16,
                              BF16_NAN=0x7FFF if device.type == "cuda" else 0xFFFF, MB=fmt.mantissa_bits, BIAS=_bias(fmt),
                              SUB_STEP=2.0**fmt.min_subnormal_exp, IS_E4M3=fmt.name == "e4m3", BLOCK_R=block_r, BLOCK_D=block_d,
                              enable_fp_fusion=False)  # fmt: skip


def _bias(fmt: Fp8Format) -> int:
    return 7 if fmt.name == "e4m3" else 15


def _min_normal(fmt: Fp8Format) -> float:
    return 2.0 ** (fmt.min_subnormal_exp + fmt.mantissa_bits)


def _geom(view: torch.Tensor, base: torch.Tensor):
    return view.storage_offset() - base.storage_offset(), view.stride()


# ---- the four operations (the kernel set's methods) -------------------------------------------
def quant_pack_s2h(layout: Layout, tensors, roles, send: torch.Tensor, fmt: Fp8Format, recv: torch.Tensor | None = None) -> None:
    """``torch_kernels.quant_pack_s2h`` in one launch."""
    roles = tuple(roles)

    def build():
        wl = wire_layout(layout, fmt)
        meta = {"device": "meta", "dtype": torch.uint8}
        s = torch.empty(sum(wl.s2h_send_splits(roles, own=recv is None)), **meta)
        rv = torch.empty(sum(wl.s2h_recv_splits(roles)), **meta) if recv is not None else None
        send_idx, recv_idx = len(tensors), len(tensors) + 1
        cols = []
        for p, views in enumerate(wl.s2h_send_views(s, roles, rv)):
            on_recv = rv is not None and p == layout.rank
            for i, (role, dst) in enumerate(zip(roles, views)):
                sb, ss, sh, sd = tensors[i].stride()
                a, b = layout.head_range(role, p)
                off, (db, ds, dh, _) = _geom(dst, rv if on_recv else s)
                for h in range(a, b):
                    cols += [recv_idx if on_recv else send_idx, off + (h - a) * dh, ds, db, i, h * sh, ss, sb, sd, layout.dim(role)]
        return cols

    key = ("qs2h", layout, roles, tuple(t.stride() for t in tensors), recv is not None, fmt)
    cols = _cached(key, build)
    _launch_quant(cols, [*tensors, send] + ([recv] if recv is not None else []), layout.seq_local, layout.batch, fmt, tensors[0].dtype)


def quant_pack_h2s(layout: Layout, local: torch.Tensor, send: torch.Tensor, fmt: Fp8Format) -> None:
    """``torch_kernels.quant_pack_h2s``: ``local`` ``[B, S, h, D]`` -> bytes ``[B, S, h, D + 4]``."""
    B, S, h, D = local.shape

    def build():
        w = D + SCALE_BYTES
        sb, ss, sh, sd = local.stride()
        return [x for hh in range(h) for x in (1, hh * w, h * w, S * h * w, 0, hh * sh, ss, sb, sd, D)]

    cols = _cached(("qh2s", tuple(local.shape), local.stride()), build)
    _launch_quant(cols, [local, send], S, B, fmt, local.dtype)


def dequant_s2h(layout: Layout, recv: torch.Tensor, roles, outs, fmt: Fp8Format) -> None:
    """``torch_kernels.dequant_s2h`` in one launch."""
    roles = tuple(roles)

    def build():
        wl = wire_layout(layout, fmt)
        rv = torch.empty(sum(wl.s2h_recv_splits(roles)), device="meta", dtype=torch.uint8)
        cols, srcs = [], []
        for i, (role, src, out) in enumerate(zip(roles, wl.s2h_recv_views(rv, roles), outs)):
            off, (sb, ss, sh, _) = _geom(src, rv)
            ob, os_, oh, _ = out.stride()
            for h in range(out.shape[2]):
                cols += [1 + i, h * oh, os_, ob, 1, len(srcs) // _DSRC, layout.dim(role)]
                srcs += [0, off + h * sh, ss, sb]
        return cols, srcs

    table = _cached(("ds2h", layout, roles, tuple(o.stride() for o in outs), fmt), build)
    _launch_dequant(table, [recv, *outs], layout.seq_total, layout.batch, fmt, outs[0])


def dequant_unpack_h2s(layout: Layout, blocks, roles, outs, fmt: Fp8Format) -> None:
    """``torch_kernels.dequant_unpack_h2s`` in one launch: blocks (per source, per role) of
    bytes ``[B, s_r, h, D + 4]``; replicated KV heads summed in rank order."""
    roles, n = tuple(roles), len(roles)
    flat = [blocks[p][i] for p in range(layout.world_size) for i in range(n)]
    B, s_r = layout.batch, layout.seq_local

    def build():
        cols, srcs = [], []
        for i, (role, out) in enumerate(zip(roles, outs)):
            D = layout.dim(role)
            sources: dict[int, list[tuple[int, int]]] = {}
            filled = 0
            for p in range(layout.world_size):
                a, b = layout.head_range(role, p)
                for h in range(a, b):
                    # The reference's walk: heads below `filled` already hold a value (added to).
                    sources[h] = [*(sources[h] if h < filled else []), (p * n + i, h - a)]
                filled = max(filled, b)
            ob, os_, oh, _ = out.stride()
            for h in sorted(sources):
                cols += [len(flat) + i, h * oh, os_, ob, len(sources[h]), len(srcs) // _DSRC, D]
                for t, lh in sources[h]:
                    blk = flat[t]
                    if blk.dim() == 1:  # a flat piece: [B, s_r, heads, D + 4] contiguous
                        w = D + SCALE_BYTES
                        heads = blk.numel() // (B * s_r * w) if B * s_r else 0
                        bb, bs, bh = s_r * heads * w, heads * w, w
                    else:
                        bb, bs, bh, _ = blk.stride()
                    srcs += [t, lh * bh, bs, bb]
        return cols, srcs

    key = ("dh2s", layout, roles, tuple((t.shape, t.stride()) for t in flat), tuple(o.stride() for o in outs), fmt)
    table = _cached(key, build)
    _launch_dequant(table, [*flat, *outs], s_r, B, fmt, outs[0])
