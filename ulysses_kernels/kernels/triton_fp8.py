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
One launch per head dim (D is a constexpr, as in ``triton_kernels``); programs on one axis,
the column fastest; alignment hints (16-byte float accesses, the wire's rows at the
alignment of their ``D + 4``-byte pitch, a 4-byte scale) where the host found every offset,
stride and address aligned (``_Launches``), the byte-by-byte path elsewhere.
FP8 encoding and decoding are integer operations on float32 bits (round to nearest even,
as PyTorch's conversion), so the result does not depend on the compiler's or the
interpreter's conversions; the divisions are ``div_rn`` (correctly rounded, as PyTorch's),
and the launches pass ``enable_fp_fusion=False`` (Triton would fuse a dequantized product
and the replica sum's add into one FMA, which the reference rounds twice).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from ..layout import Layout
from ..wire import AMAX_FLOOR, SCALE_BYTES, Fp8Format, wire_layout
from .triton_launch import _int64_table, _interpreting, _launch_geometry

__all__ = ["quant_pack_s2h", "quant_pack_h2s", "dequant_s2h", "dequant_unpack_h2s"]

_TL_FLOAT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_LOAD = {torch.float16: tl.float16, torch.bfloat16: tl.uint16, torch.float32: tl.float32}  # bf16 read by its bits
_QCOL, _DCOL, _DSRC = 10, 7, 4


@triton.jit
def _load_f32(ptrs, mask, IS_BF16: tl.constexpr):
    """The values at ``ptrs`` (float16/float32, or bf16 read as uint16) as float32 (exact)."""
    if IS_BF16:
        x = tl.load(ptrs, mask=mask, other=0)
        return (x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


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
def _program(n_cols, BLOCK_R: tl.constexpr):
    """``(rows, column)`` of this program: one axis of ``row blocks x columns`` programs, the
    column fastest, so programs that run side by side move the heads of the same tokens
    (neighbouring bytes of the source and of the wire), as triton_kernels' "new" variant."""
    pid = tl.program_id(0).to(tl.int64)
    return pid // n_cols * BLOCK_R + tl.arange(0, BLOCK_R), pid % n_cols


@triton.jit
def _quant_kernel(addr_ptr, col_ptr, n_rows, batch, n_cols, D: tl.constexpr, LOAD: tl.constexpr, IS_BF16: tl.constexpr,
                  FMT_MAX: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr, SUB_EXP: tl.constexpr, MIN_NORMAL: tl.constexpr,
                  FLOOR: tl.constexpr, SRC_CONTIG: tl.constexpr, SRC_VEC: tl.constexpr, SRC_ALIGN: tl.constexpr, WIRE_ALIGN: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    r, col = _program(n_cols, BLOCK_R)
    c = col_ptr + col * 10
    tok, b = r // batch, r % batch
    d = tl.arange(0, BLOCK_D)
    rmask = r < n_rows
    mask = rmask[:, None] & (d < D)[None, :]
    # Alignment hints on the pointers, in bytes (see triton_kernels' NOTE): SRC_VEC elements
    # per 16-byte load and WIRE_ALIGN bytes per store where the host checked every offset,
    # stride and address; 1 otherwise.
    src = tl.multiple_of(tl.load(addr_ptr + tl.load(c + 4)).to(tl.pointer_type(LOAD)), SRC_ALIGN)
    src_row = tl.multiple_of(tl.load(c + 5) + tok * tl.load(c + 6) + b * tl.load(c + 7), SRC_VEC)
    if SRC_CONTIG:
        src_d = d
    else:
        src_d = d * tl.load(c + 8)
    x = _load_f32(src + src_row[:, None] + src_d[None, :], mask, IS_BF16)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR)
    mx = tl.zeros_like(amax) + FMT_MAX
    inv = tl.math.div_rn(mx, amax)
    scale = tl.math.div_rn(amax, mx)
    y = tl.minimum(tl.maximum(x * inv[:, None], -FMT_MAX), FMT_MAX)
    dst = tl.multiple_of(tl.load(addr_ptr + tl.load(c)).to(tl.pointer_type(tl.uint8)), WIRE_ALIGN)
    dst_row = tl.multiple_of(tl.load(c + 1) + tok * tl.load(c + 2) + b * tl.load(c + 3), WIRE_ALIGN)
    tl.store(dst + dst_row[:, None] + d[None, :], _encode(y, MB, BIAS, SUB_EXP, MIN_NORMAL), mask=mask)
    if WIRE_ALIGN >= 4:  # the scale after the row's D values: one 4-byte store
        tl.store((dst + dst_row + D).to(tl.pointer_type(tl.float32)), scale, mask=rmask)
    else:  # its 4 bytes, little-endian
        s = scale.to(tl.uint32, bitcast=True)
        for j in tl.static_range(4):
            tl.store(dst + dst_row + D + j, ((s >> (8 * j)) & 0xFF).to(tl.uint8), mask=rmask)


@triton.jit
def _dequant_source(addr_ptr, s, tok, b, d, D: tl.constexpr, mask, rmask, FLOAT: tl.constexpr, IS_BF16: tl.constexpr,
                    BF16_NAN: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr, SUB_STEP: tl.constexpr, IS_E4M3: tl.constexpr,
                    WIRE_ALIGN: tl.constexpr):  # fmt: skip
    """One wire source's ``[BLOCK_R, BLOCK_D]`` tile, dequantized and rounded to FLOAT, as float32."""
    base = tl.multiple_of(tl.load(addr_ptr + tl.load(s)).to(tl.pointer_type(tl.uint8)), WIRE_ALIGN)
    row = tl.multiple_of(tl.load(s + 1) + tok * tl.load(s + 2) + b * tl.load(s + 3), WIRE_ALIGN)
    bits = tl.load(base + row[:, None] + d[None, :], mask=mask, other=0)
    if WIRE_ALIGN >= 4:  # the scale after the row's D values: one 4-byte load
        sc = tl.load((base + row + D).to(tl.pointer_type(tl.float32)), mask=rmask, other=0.0)
    else:  # its 4 bytes, little-endian (any alignment)
        u = tl.zeros_like(row).to(tl.uint32)
        for j in tl.static_range(4):
            u = u | (tl.load(base + row + D + j, mask=rmask, other=0).to(tl.uint32) << (8 * j))
        sc = u.to(tl.float32, bitcast=True)
    x = _decode(bits, MB, BIAS, SUB_STEP, IS_E4M3) * sc[:, None]
    return _round_to(x, FLOAT, IS_BF16, BF16_NAN).to(tl.float32)


@triton.jit
def _dequant_kernel(addr_ptr, col_ptr, src_ptr, n_rows, batch, n_cols, D: tl.constexpr, FLOAT: tl.constexpr, IS_BF16: tl.constexpr,
                    BF16_NAN: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr, SUB_STEP: tl.constexpr, IS_E4M3: tl.constexpr,
                    WIRE_ALIGN: tl.constexpr, OUT_VEC: tl.constexpr, OUT_ALIGN: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):  # fmt: skip
    r, col = _program(n_cols, BLOCK_R)
    c = col_ptr + col * 7
    tok, b = r // batch, r % batch
    d = tl.arange(0, BLOCK_D)
    rmask = r < n_rows
    mask = rmask[:, None] & (d < D)[None, :]
    n_src = tl.load(c + 4)
    s0 = tl.load(c + 5)
    acc = _dequant_source(addr_ptr, src_ptr + s0 * 4, tok, b, d, D, mask, rmask, FLOAT, IS_BF16, BF16_NAN, MB, BIAS, SUB_STEP, IS_E4M3,
                          WIRE_ALIGN)  # fmt: skip
    k = 1
    while k < n_src:  # a while, as in triton_kernels (the interpreter's loop bounds)
        x = _dequant_source(addr_ptr, src_ptr + (s0 + k) * 4, tok, b, d, D, mask, rmask, FLOAT, IS_BF16, BF16_NAN, MB, BIAS, SUB_STEP,
                            IS_E4M3, WIRE_ALIGN)  # fmt: skip
        acc = _round_to(acc + x, FLOAT, IS_BF16, BF16_NAN).to(tl.float32)  # add_'s sum: rounded after every add
        k += 1
    dst = tl.multiple_of(tl.load(addr_ptr + tl.load(c)).to(tl.pointer_type(FLOAT)), OUT_ALIGN)
    dst_row = tl.multiple_of(tl.load(c + 1) + tok * tl.load(c + 2) + b * tl.load(c + 3), OUT_VEC)
    tl.store(dst + dst_row[:, None] + d[None, :], acc.to(FLOAT), mask=mask)


# ---- host side ----------------------------------------------------------------------------
_tables: OrderedDict[tuple, _Launches] = OrderedDict()  # keyed by values (layouts, strides)


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


def _alignment(values, cap: int = 16) -> int:
    """The largest power of two up to ``cap`` that divides every value (0 divides by anything)."""
    a = cap
    for v in values:
        while v % a:
            a //= 2
    return a


class _Launches:
    """One operation's column table split into launches of one head dim each (D is a constexpr:
    the mask ``d < D`` is then known per vector; MLA's narrower v is a second launch), with what
    the alignment hints need from the table, found once: per launch, the alignment its offsets
    and strides allow (elements of the float tensors, bytes of the wire) and which tensors'
    addresses must be aligned too (checked at each launch: buffers move)."""

    __slots__ = ("groups", "srcs", "itemsize", "device_tables")

    def __init__(self, cols: list[int], srcs: list[int] | None = None, *, itemsize: int):
        quant, vec = srcs is None, 16 // itemsize
        width, d_at = (_QCOL, 9) if quant else (_DCOL, 6)
        by_d: dict[int, list[int]] = {}
        for i in range(len(cols) // width):
            col = cols[i * width : (i + 1) * width]
            by_d.setdefault(col[d_at], []).extend(col)
        self.groups = []
        for D, g in sorted(by_d.items()):
            rows = [g[i * width : (i + 1) * width] for i in range(len(g) // width)]
            if quant:  # float source -> wire
                contig = all(c[8] == 1 for c in rows)
                floats = [x for c in rows for x in c[5:8]] if contig and D % vec == 0 else [1]
                wire = [x for c in rows for x in c[1:4]] + [D]
                float_t, wire_t = {c[4] for c in rows}, {c[0] for c in rows}
            else:  # wire sources -> float output
                contig = True
                floats = [x for c in rows for x in c[1:4]] if D % vec == 0 else [1]
                used = [srcs[k * _DSRC : (k + 1) * _DSRC] for c in rows for k in range(c[5], c[5] + c[4])]
                wire = [x for u in used for x in u[1:4]] + [D]
                float_t, wire_t = {c[0] for c in rows}, {u[0] for u in used}
            self.groups.append((D, g, contig, _alignment(floats, vec) == vec, _alignment(wire), sorted(float_t), sorted(wire_t)))
        self.srcs, self.itemsize = srcs, itemsize
        self.device_tables: dict[torch.device, tuple] = {}

    def tables(self, device: torch.device):
        if device not in self.device_tables:
            cols = [_int64_table(g[1], device) for g in self.groups]
            self.device_tables[device] = (cols, _int64_table(self.srcs, device) if self.srcs is not None else None)
        return self.device_tables[device]

    def launches(self, device: torch.device, addrs: list[int]):
        """Per launch: ``(D, column table, n_cols, contiguous, VEC, float ALIGN bytes, wire ALIGN bytes)``."""
        col_tables, _ = self.tables(device)
        width, vec = (_QCOL if self.srcs is None else _DCOL), 16 // self.itemsize
        for (D, cols, contig, vec_ok, wire_align, float_t, wire_t), col_t in zip(self.groups, col_tables):
            vec_ok = vec_ok and all(addrs[t] % 16 == 0 for t in float_t)
            wire_align = _alignment([addrs[t] for t in wire_t], wire_align)
            yield D, col_t, len(cols) // width, contig, vec if vec_ok else 1, 16 if vec_ok else self.itemsize, wire_align


def _launch_quant(table: _Launches, tensors, n_tok: int, batch: int, fmt: Fp8Format, dtype: torch.dtype) -> None:
    n_rows = n_tok * batch
    if not table.groups or n_rows == 0:
        return
    device = tensors[0].device
    addrs = [t.data_ptr() for t in tensors]
    addr = _int64_table(addrs, device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for D, col_t, n_cols, contig, vec, align, wire_align in table.launches(device, addrs):
            grid, block_r, block_d = _launch_geometry(n_rows, n_cols, D, _interpreting())
            _quant_kernel[grid](addr, col_t, n_rows, batch, n_cols, D=D, LOAD=_LOAD[dtype], IS_BF16=dtype == torch.bfloat16,
                                FMT_MAX=fmt.max, MB=fmt.mantissa_bits, BIAS=_bias(fmt), SUB_EXP=fmt.min_subnormal_exp,
                                MIN_NORMAL=_min_normal(fmt), FLOOR=AMAX_FLOOR, SRC_CONTIG=contig, SRC_VEC=vec, SRC_ALIGN=align,
                                WIRE_ALIGN=wire_align, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=8, enable_fp_fusion=False)  # fmt: skip
    del addr  # kept alive until the launches are queued


def _launch_dequant(table: _Launches, tensors, n_tok: int, batch: int, fmt: Fp8Format, out: torch.Tensor) -> None:
    n_rows = n_tok * batch
    if not table.groups or n_rows == 0:
        return
    device, dtype = out.device, out.dtype
    addrs = [t.data_ptr() for t in tensors]
    _, src_t = table.tables(device)
    addr = _int64_table(addrs, device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for D, col_t, n_cols, _, vec, align, wire_align in table.launches(device, addrs):
            grid, block_r, block_d = _launch_geometry(n_rows, n_cols, D, _interpreting())
            _dequant_kernel[grid](addr, col_t, src_t, n_rows, batch, n_cols, D=D, FLOAT=_float_of(dtype), IS_BF16=dtype == torch.bfloat16,
                                  BF16_NAN=0x7FFF if device.type == "cuda" else 0xFFFF, MB=fmt.mantissa_bits, BIAS=_bias(fmt),
                                  SUB_STEP=2.0**fmt.min_subnormal_exp, IS_E4M3=fmt.name == "e4m3", WIRE_ALIGN=wire_align,
                                  OUT_VEC=vec, OUT_ALIGN=align, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=8,
                                  enable_fp_fusion=False)  # fmt: skip
    del addr  # kept alive until the launches are queued


def _bias(fmt: Fp8Format) -> int:
    return 7 if fmt.name == "e4m3" else 15


def _min_normal(fmt: Fp8Format) -> float:
    return 2.0 ** (fmt.min_subnormal_exp + fmt.mantissa_bits)


def _geom(view: torch.Tensor, base: torch.Tensor):
    return view.storage_offset() - base.storage_offset(), view.stride()


# ---- the four operations (the kernel set's methods) -------------------------------------------
def quant_pack_s2h(layout: Layout, tensors, roles, send: torch.Tensor, fmt: Fp8Format, recv: torch.Tensor | None = None) -> None:
    """``torch_kernels.quant_pack_s2h`` in one launch per head dim."""
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
        return _Launches(cols, itemsize=tensors[0].element_size())

    key = ("qs2h", layout, roles, tuple(t.stride() for t in tensors), recv is not None, fmt, tensors[0].dtype)
    table = _cached(key, build)
    _launch_quant(table, [*tensors, send] + ([recv] if recv is not None else []), layout.seq_local, layout.batch, fmt, tensors[0].dtype)


def quant_pack_h2s(layout: Layout, local: torch.Tensor, send: torch.Tensor, fmt: Fp8Format) -> None:
    """``torch_kernels.quant_pack_h2s``: ``local`` ``[B, S, h, D]`` -> bytes ``[B, S, h, D + 4]``."""
    B, S, h, D = local.shape

    def build():
        w = D + SCALE_BYTES
        sb, ss, sh, sd = local.stride()
        return _Launches([x for hh in range(h) for x in (1, hh * w, h * w, S * h * w, 0, hh * sh, ss, sb, sd, D)], itemsize=local.element_size())

    table = _cached(("qh2s", tuple(local.shape), local.stride(), local.dtype), build)
    _launch_quant(table, [local, send], S, B, fmt, local.dtype)


def dequant_s2h(layout: Layout, recv: torch.Tensor, roles, outs, fmt: Fp8Format) -> None:
    """``torch_kernels.dequant_s2h`` in one launch per head dim."""
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
        return _Launches(cols, srcs, itemsize=outs[0].element_size())

    table = _cached(("ds2h", layout, roles, tuple(o.stride() for o in outs), fmt, outs[0].dtype), build)
    _launch_dequant(table, [recv, *outs], layout.seq_total, layout.batch, fmt, outs[0])


def dequant_unpack_h2s(layout: Layout, blocks, roles, outs, fmt: Fp8Format) -> None:
    """``torch_kernels.dequant_unpack_h2s`` in one launch per head dim: blocks (per source, per role) of
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
        return _Launches(cols, srcs, itemsize=outs[0].element_size())

    key = ("dh2s", layout, roles, tuple((t.shape, t.stride()) for t in flat), tuple(o.stride() for o in outs), fmt, outs[0].dtype)
    table = _cached(key, build)
    _launch_dequant(table, [*flat, *outs], s_r, B, fmt, outs[0])
