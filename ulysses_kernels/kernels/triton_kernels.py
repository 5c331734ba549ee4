"""Triton pack/unpack kernels: bit-exact twins of the reference in ``ulysses_kernels.layout``.

Every operation of the kernel set is the same gather: for each *column* (one head of one
destination tensor) copy a ``[n_tok, B, D]`` tile of rows from one source column, or, for a
KV head that several ranks hold, from several source columns summed in rank order. One
``@triton.jit`` kernel does all three operations in **one launch each**::

    grid = (cdiv(n_tok * B, BLOCK_R), n_columns)

    column table (int64, 7 per column, cached per Layout/roles/strides):
        dst_tensor, dst_off, dst_s_tok, dst_s_batch, dst_s_d, n_src, first_src
    source table (int64, 5 per source, same cache):
        src_tensor, src_off, src_s_tok, src_s_batch, src_s_d
    address table (int64, one per tensor, built per call): data_ptr() of every tensor

Offsets and strides are in elements; a program loads its column's descriptors (scalars),
turns the tensor's address into a typed pointer, and moves ``BLOCK_R`` rows of ``D``
contiguous elements (``BLOCK_D`` = next power of two). Bytes are moved as same-width
integers, so any dtype moves (bf16, fp16, fp32, fp64, fp8, ints) and NaN payloads survive.
Replica sums bitcast to the float type and add in fp32 (fp64 for fp64): for bf16/fp16 the
sum of two values rounded once from fp32 is the correctly rounded sum, as PyTorch's CPU and
CUDA ``add_`` compute it; dtypes PyTorch cannot add (fp8) raise like the reference.

Column descriptors are cached on the class (a bounded LRU keyed by the frozen ``Layout``,
the roles and the tensors' strides); only the tensors' addresses travel per call (on
CUDA through a pinned buffer, with no host sync). Launches can be captured in a CUDA
graph after one warm-up launch: the address table is then written by captured kernels
(no host memory read at replay) and each column table's device copies are kept alive
(``TritonKernels._captured``) for the graphs that read them.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .. import extension
from ..layout import Layout
from . import triton_fp8
from .triton_launch import _int64_table, _interpreting, _launch_geometry

__all__ = ["TritonKernels"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TL_INT = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_TL_FLOAT = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}
_COL, _SRC = 7, 5


@triton.jit
def _to_acc(x, FLOAT: tl.constexpr, ACC: tl.constexpr, IS_BF16: tl.constexpr):
    """Same-width integers holding FLOAT values -> ACC values (exact)."""
    if IS_BF16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(FLOAT, bitcast=True).to(ACC)


@triton.jit
def _from_acc(x, FLOAT: tl.constexpr, ELEM: tl.constexpr, IS_BF16: tl.constexpr, BF16_NAN: tl.constexpr):
    """ACC values -> FLOAT rounded to nearest even, as same-width integers.

    bf16 is rounded with integer operations so the result does not depend on the
    compiler's (or the interpreter's, which does not round to nearest even) conversion.
    A NaN sum becomes BF16_NAN: what PyTorch's own bf16 add writes on that device (0x7FFF
    from CUDA's cvt.rn.bf16.f32, 0xFFFF from ATen's vectorized CPU conversion).
    """
    if IS_BF16:
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, BF16_NAN, r)
        return r.to(tl.uint16).to(ELEM, bitcast=True)
    else:
        return x.to(FLOAT).to(ELEM, bitcast=True)


@triton.jit
def _load_source(addr_ptr, s, tok, b, d, mask, ELEM: tl.constexpr, D_CONTIG: tl.constexpr, VEC: tl.constexpr, ALIGN: tl.constexpr):
    """The ``[BLOCK_R, BLOCK_D]`` tile of one source column (descriptor at ``s``)."""
    src_addr = tl.load(addr_ptr + tl.load(s))
    src_row = tl.load(s + 1) + tok * tl.load(s + 2) + b * tl.load(s + 3)
    if D_CONTIG:
        src_d = d
    else:
        src_d = d * tl.load(s + 4)
    src_row = tl.multiple_of(src_row, VEC)
    base = tl.multiple_of(src_addr.to(tl.pointer_type(ELEM)), ALIGN)
    return tl.load(base + src_row[:, None] + src_d[None, :], mask=mask)


@triton.jit
def _gather_columns_kernel(
    addr_ptr,  # int64 [n_tensors]: data_ptr of every tensor
    col_ptr,  # int64 [n_cols, 7]
    src_ptr,  # int64 [n_srcs, 5]
    n_rows,  # n_tok * batch
    batch,
    # head_dim, constexpr: with a runtime D the mask `d < D` is only known constant over the
    # divisibility Triton specializes (16), so D = 40 or 72 in bf16 fell back to 2-byte
    # accesses (ld.global.b16 in the sm_90 PTX). Constexpr costs one compile per head_dim.
    D: tl.constexpr,
    ELEM: tl.constexpr,  # integer type of the element width
    FLOAT: tl.constexpr,  # float type for replica sums (unused when not HAS_SUM)
    ACC: tl.constexpr,  # accumulation type of a sum
    HAS_SUM: tl.constexpr,
    IS_BF16: tl.constexpr,  # bf16 <-> fp32 by bit operations (see _from_acc)
    BF16_NAN: tl.constexpr,
    D_CONTIG: tl.constexpr,  # every tensor has stride 1 along D
    VEC: tl.constexpr,  # elements per 16 bytes when offsets/strides/addresses allow it, else 1
    # NOTE: alignment hints go on the *pointer* (in bytes): Triton's alignment analysis
    # drops an integer's divisibility at int_to_ptr, so a hint on the int64 address left
    # every access scalar (checked in the sm_90 PTX: ld.global.b16 before, v4.b32 after).
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    n_cols,  # head columns (the "new" variant's 1-D grid)
    COLS_FASTEST: tl.constexpr,  # the "new" variant: program p = (row block p // n_cols, column p % n_cols)
):
    if COLS_FASTEST:
        pid = tl.program_id(0).to(tl.int64)
        pid_r = pid // n_cols
        col = pid % n_cols
    else:
        pid_r = tl.program_id(0)
        col = tl.program_id(1).to(tl.int64)
    c = col_ptr + col * 7
    dst_t = tl.load(c)
    dst_off = tl.load(c + 1)
    dst_st = tl.load(c + 2)
    dst_sb = tl.load(c + 3)
    dst_sd = tl.load(c + 4)
    n_src = tl.load(c + 5)
    s0 = tl.load(c + 6)

    r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    tok = r // batch
    b = r % batch
    d = tl.arange(0, BLOCK_D)
    mask = (r < n_rows)[:, None] & (d < D)[None, :]

    ALIGN: tl.constexpr = 16 if VEC > 1 else 1  # bytes: every address % 16 == 0 when VEC > 1
    vals = _load_source(addr_ptr, src_ptr + s0 * 5, tok, b, d, mask, ELEM, D_CONTIG, VEC, ALIGN)

    if HAS_SUM:
        acc = _to_acc(vals, FLOAT, ACC, IS_BF16)
        # A while loop, not `for k in range(1, n_src)`: Triton 3.6's interpreter turns a loaded
        # bound into a Python int with int() of a 1-element array, which NumPy >= 2.5 refuses
        # (torch 2.11 ships Triton 3.6); the comparison in a while works everywhere.
        k = 1
        while k < n_src:
            x = _load_source(addr_ptr, src_ptr + (s0 + k) * 5, tok, b, d, mask, ELEM, D_CONTIG, VEC, ALIGN)
            # Round after every add: the reference adds replicas one `add_` at a time.
            acc = _to_acc(_from_acc(acc + _to_acc(x, FLOAT, ACC, IS_BF16), FLOAT, ELEM, IS_BF16, BF16_NAN), FLOAT, ACC, IS_BF16)
            k += 1
        vals = _from_acc(acc, FLOAT, ELEM, IS_BF16, BF16_NAN)

    dst_base = tl.multiple_of(tl.load(addr_ptr + dst_t).to(tl.pointer_type(ELEM)), ALIGN)
    dst_row = tl.multiple_of(dst_off + tok * dst_st + b * dst_sb, VEC)
    if D_CONTIG:
        dst_d = d
    else:
        dst_d = d * dst_sd
    tl.store(dst_base + dst_row[:, None] + dst_d[None, :], vals, mask=mask)


class _ColumnTable:
    """Cached column/source descriptors of one operation (host lists; device copies per device)."""

    __slots__ = ("cols", "srcs", "n_cols", "has_sum", "d_contig", "struct_vec_ok", "device_tables")

    def __init__(self, cols: list[int], srcs: list[int], head_dim: int, itemsize: int):
        self.cols, self.srcs = cols, srcs
        self.n_cols = len(cols) // _COL
        self.has_sum = any(cols[i * _COL + 5] > 1 for i in range(self.n_cols))
        strides_d = [cols[i * _COL + 4] for i in range(self.n_cols)] + [srcs[i * _SRC + 4] for i in range(len(srcs) // _SRC)]
        self.d_contig = all(x == 1 for x in strides_d)
        vec = max(1, 16 // itemsize)
        offsets = [cols[i * _COL + j] for i in range(self.n_cols) for j in (1, 2, 3)]
        offsets += [srcs[i * _SRC + j] for i in range(len(srcs) // _SRC) for j in (1, 2, 3)]
        self.struct_vec_ok = self.d_contig and head_dim % vec == 0 and all(x % vec == 0 for x in offsets)
        self.device_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device, capturing: bool = False):
        if device not in self.device_tables:
            if capturing:
                raise RuntimeError(
                    "TritonKernels: this layout's first launch is inside a CUDA graph capture; run the op "
                    "once before capturing (the usual warm-up: it also compiles the kernel)"
                )
            self.device_tables[device] = (_int64_table(self.cols, device), _int64_table(self.srcs, device))
        return self.device_tables[device]


class TritonKernels:
    """The Triton kernel set (see the module docstring). Stateless apart from a class-level
    LRU of column descriptors keyed by ``Layout`` (a value, not a process group)."""

    name = "triton"
    _tables: OrderedDict[tuple, _ColumnTable] = OrderedDict()
    _max_tables = 256
    # The column tables' device copies that launches captured in CUDA graphs read at every replay,
    # for as long as a graph lives (which this code cannot see; the LRU above may drop the
    # table). Kept for the process's life: a few hundred bytes per captured launch, and
    # graphs are captured once, then replayed.
    _captured: list = []

    @staticmethod
    def available() -> bool:
        return _interpreting() or torch.cuda.is_available()

    @staticmethod
    def unavailable_reason() -> str:
        return "" if TritonKernels.available() else "no CUDA device, and TRITON_INTERPRET=1 is not set"

    # ---- the three operations ---------------------------------------------------------
    @classmethod
    def pack_s2h(
        cls,
        layout: Layout,
        tensors: Sequence[torch.Tensor],
        roles: Sequence[str],
        send: torch.Tensor,
        recv: torch.Tensor | None = None,
    ) -> None:
        """``tensors`` (``[B, s_r, H, D]`` each, any strides) -> flat send buffer (peer-major);
        with ``recv``, this rank's own heads go straight into its rows of ``recv`` and
        ``send`` holds the peers' blocks only (``layout.s2h_send_splits(roles, own=False)``)."""
        key = ("s2h", layout, tuple(roles), tuple(t.stride() for t in tensors), recv is not None)
        g = layout.row_dim(roles)  # columns of g elements: one launch for mixed head dims (MLA)
        table = cls._get(key, lambda: _columns_pack_s2h(layout, tensors, roles, recv is not None, g), g, send.element_size())
        bufs = [send] if recv is None else [send, recv]
        cls._launch(table, [*tensors, *bufs], layout.seq_local, layout.batch, g, send)

    @classmethod
    def pack_h2s(cls, layout: Layout, local: torch.Tensor, send: torch.Tensor) -> None:
        """A local ``[B, S, h, D]`` tensor (any strides) -> its flat wire format
        (``send.view(local.shape)``)."""
        key = ("h2s", layout, tuple(local.shape), local.stride())
        table = cls._get(key, lambda: _columns_pack_h2s(local), local.shape[3], send.element_size())
        cls._launch(table, [local, send], local.shape[1], local.shape[0], local.shape[3], send)

    @classmethod
    def unpack_h2s(
        cls,
        layout: Layout,
        blocks: Sequence[Sequence[torch.Tensor]],
        roles: Sequence[str],
        outs: Sequence[torch.Tensor],
    ) -> None:
        """Received blocks (per source, per role, ``[B, s_r, h, D]``) -> ``outs``
        (``[B, s_r, H, D]``); replicated KV heads summed in rank order."""
        flat = [blk for per_role in blocks for blk in per_role]
        key = ("unpack", layout, tuple(roles), tuple(t.stride() for t in flat), tuple(o.stride() for o in outs))
        g = layout.row_dim(roles)  # columns of g elements: one launch for mixed head dims (MLA)
        table = cls._get(key, lambda: _columns_unpack_h2s(layout, blocks, roles, outs, g), g, outs[0].element_size())
        cls._launch(table, [*flat, *outs], layout.seq_local, layout.batch, g, outs[0])

    # ---- FP8 on the wire (ulysses_kernels.wire): kernels/triton_fp8.py ----------------------
    quant_pack_s2h = staticmethod(triton_fp8.quant_pack_s2h)
    quant_pack_h2s = staticmethod(triton_fp8.quant_pack_h2s)
    dequant_s2h = staticmethod(triton_fp8.dequant_s2h)
    dequant_unpack_h2s = staticmethod(triton_fp8.dequant_unpack_h2s)

    # ---- host side ----------------------------------------------------------------------
    @classmethod
    def _get(cls, key, build, head_dim: int, itemsize: int) -> _ColumnTable:
        key = (*key, itemsize)
        table = cls._tables.get(key)
        if table is None:
            cols, srcs = build()
            table = _ColumnTable(cols, srcs, head_dim, itemsize)
            cls._tables[key] = table
            while len(cls._tables) > cls._max_tables:
                cls._tables.popitem(last=False)
        else:
            cls._tables.move_to_end(key)
        return table

    @staticmethod
    def _launch(table: _ColumnTable, tensors: list[torch.Tensor], n_tok: int, batch: int, head_dim: int, like: torch.Tensor) -> None:
        n_rows = n_tok * batch
        if table.n_cols == 0 or n_rows == 0 or head_dim == 0:
            return
        dtype, device = like.dtype, like.device
        for t in tensors:
            if t.dtype != dtype or t.device != device:
                raise ValueError(f"TritonKernels: every tensor must be {dtype} on {device}, got {t.dtype} on {t.device}")
        itemsize = like.element_size()
        if table.has_sum and dtype not in _TL_FLOAT:
            raise TypeError(f"TritonKernels: summing replicated KV heads needs a float dtype with add, got {dtype}")
        addrs = [t.data_ptr() for t in tensors]
        vec = max(1, 16 // itemsize)
        aligned = table.struct_vec_ok and all(a % 16 == 0 for a in addrs)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        cols, srcs = table.tables(device, capturing)
        addr_t = _int64_table(addrs, device, capturing)  # captured: from the graph's own pool
        if capturing:
            TritonKernels._captured.append((cols, srcs))
        new = extension.kernel_variant("triton") == "new"
        grid, block_r, block_d = _launch_geometry(n_rows, table.n_cols, head_dim, _interpreting(), new)
        float_ty = _TL_FLOAT.get(dtype, tl.float32)
        acc_ty = tl.float64 if dtype == torch.float64 else tl.float32
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            _gather_columns_kernel[grid](
                addr_t, cols, srcs, n_rows, batch,
                D=head_dim, ELEM=_TL_INT[itemsize], FLOAT=float_ty, ACC=acc_ty, HAS_SUM=table.has_sum, IS_BF16=dtype == torch.bfloat16,
                BF16_NAN=0x7FFF if device.type == "cuda" else 0xFFFF,
                D_CONTIG=table.d_contig, VEC=vec if aligned else 1, BLOCK_R=block_r, BLOCK_D=block_d,
                n_cols=table.n_cols, COLS_FASTEST=new, num_warps=8 if new else 4,
            )  # fmt: skip
        # Keep the address table (and through the caller, the tensors) alive for the launch.
        del addr_t


# ---- descriptor builders (the layout math of layout.py, as columns) ---------------------
def _view_geometry(view: torch.Tensor, base: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """(element offset from ``base``, strides) of a view of ``base``'s storage."""
    return view.storage_offset() - base.storage_offset(), view.stride()


def _columns_pack_s2h(layout: Layout, tensors, roles, with_recv: bool, g: int) -> tuple[list[int], list[int]]:
    # The destinations are whatever views the layout defines (layout.s2h_send_views), taken
    # on meta buffers: the kernel follows the layout math instead of restating it.
    meta = {"device": "meta", "dtype": torch.float32}
    send = torch.empty(sum(layout.s2h_send_splits(roles, own=not with_recv)), **meta)
    recv = torch.empty(sum(layout.s2h_recv_splits(roles)), **meta) if with_recv else None
    send_idx, recv_idx = len(tensors), len(tensors) + 1
    cols, srcs = [], []
    for p, views in enumerate(layout.s2h_send_views(send, roles, recv)):
        for i, (s, dst) in enumerate(zip(roles, views)):
            sb, ss, sh, sd = tensors[i].stride()
            a, b = layout.head_range(s, p)
            on_recv = recv is not None and p == layout.rank  # as s2h_send_views places it
            base = recv if on_recv else send
            off, (db, ds, dh, dd) = _view_geometry(dst, base)
            for h in range(a, b):
                for j in range(layout.dim(s) // g):  # one column per g elements of the head
                    cols += [recv_idx if on_recv else send_idx, off + (h - a) * dh + j * g * dd, ds, db, dd, 1, len(srcs) // _SRC]
                    srcs += [i, h * sh + j * g * sd, ss, sb, sd]
    return cols, srcs


def _columns_pack_h2s(local: torch.Tensor) -> tuple[list[int], list[int]]:
    dst = torch.empty(local.shape, device="meta")  # the reference's send.view(local.shape)
    db, ds, dh, dd = dst.stride()
    sb, ss, sh, sd = local.stride()
    cols, srcs = [], []
    for hh in range(local.shape[2]):
        cols += [1, hh * dh, ds, db, dd, 1, len(srcs) // _SRC]
        srcs += [0, hh * sh, ss, sb, sd]
    return cols, srcs


def _columns_unpack_h2s(layout: Layout, blocks, roles, outs, g: int) -> tuple[list[int], list[int]]:
    n = len(roles)
    out_base = layout.world_size * n
    cols, srcs = [], []
    for i, (s, out) in enumerate(zip(roles, outs)):
        # The reference's walk: heads below `filled` already hold a value (add), others copy.
        sources: dict[int, list[tuple[int, int]]] = {}
        filled = 0
        for p in range(layout.world_size):
            a, b = layout.head_range(s, p)
            overlap = max(0, min(b, filled) - a)
            for h in range(a, b):
                entry = (p * n + i, h - a)
                if h < a + overlap:
                    sources[h].append(entry)
                else:
                    sources[h] = [entry]
            filled = max(filled, b)
        ob, os_, oh, od = out.stride()
        for h in sorted(sources):
            for j in range(layout.dim(s) // g):  # one column per g elements of the head
                cols += [out_base + i, h * oh + j * g * od, os_, ob, od, len(sources[h]), len(srcs) // _SRC]
                for t_idx, lh in sources[h]:
                    p = t_idx // n
                    bb, bs, bh, bd = blocks[p][i].stride()
                    srcs += [t_idx, lh * bh + j * g * bd, bs, bb, bd]
    return cols, srcs
