"""The FP8 wire's four operations of each kernel set (Triton, and the C++ extension's CPU twin
and CUDA kernels) against the torch reference (``kernels.torch_kernels``), bit for bit, on
one rank's buffers (no collective: the layout math alone). Triton runs under
``TRITON_INTERPRET=1`` on the CPU (conftest.py), so the shapes are small."""

from __future__ import annotations

import pytest
import torch
from triton_compile import sm90_output

from ulysses_kernels.kernels import torch_kernels as R
from ulysses_kernels.layout import OUT, QKV, Layout
from ulysses_kernels.plan import HeadPlan
from ulysses_kernels.wire import E4M3, E5M2, SCALE_BYTES, wire_layout


def _kernel_set(name):
    if name == "triton":
        mod = pytest.importorskip("ulysses_kernels.kernels.triton_kernels")
        if not mod.TritonKernels.available():
            pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
        return mod.TritonKernels()
    from ulysses_kernels.kernels import KERNEL_SETS, available_kernels, get_kernels

    if name not in available_kernels():
        pytest.skip(f"kernels={name!r} cannot run here")
    assert name in KERNEL_SETS
    return get_kernels(name, torch.device("cpu"))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (q_heads, kv_heads, world, rank, seq_lens, batch, D, Dv)
CASES = [
    (6, 6, 2, 1, (3, 5), 1, 8, 8),
    (10, 2, 4, 2, (2, 3, 1, 2), 2, 8, 6),  # KV replicas, batch 2, MLA
    (4, 2, 3, 0, (2, 2, 3), 1, 6, 10),  # head dims not a multiple of 4: scales unaligned
    (2, 2, 2, 1, (2, 1), 1, 136, 66),  # rows past one warp's 128 (vector) and 32 (scalar) elements
]
FORMATS = [E4M3, E5M2]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _spread(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g, dtype=torch.float64))
    x = x * torch.exp(1.5 * torch.randn(shape, generator=g, dtype=torch.float64))
    x = x.clamp(-1e4, 1e4).to(dtype)
    if x.numel():
        x.view(-1, shape[-1])[0] = 0  # an all-zero row
    return x.to(DEVICE)


def _layout(case):
    hq, hkv, world, rank, seq_lens, B, D, Dv = case
    return Layout(HeadPlan.build(hq, hkv, world), rank, seq_lens, B, D, Dv)


@pytest.mark.parametrize("name", ["triton", "cuda"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_quant_pack_s2h_matches_the_reference(name, case):
    kern, lay = _kernel_set(name), _layout(case)
    B, s_r = lay.batch, lay.seq_local
    for fmt, dtype in zip(FORMATS * 2, DTYPES + DTYPES[:1]):
        # q as a strided view ([B, H, s, D] in memory), k and v contiguous.
        q = _spread((B, lay.plan.q_heads, s_r, lay.head_dim), dtype, 1).transpose(1, 2)
        k = _spread((B, s_r, lay.plan.kv_heads, lay.head_dim), dtype, 2)
        v = _spread((B, s_r, lay.plan.kv_heads, lay.v_head_dim), dtype, 3)
        wl = wire_layout(lay, fmt)
        for own in (True, False):
            n_send = sum(wl.s2h_send_splits(QKV, own=own))
            want_s, got_s = (torch.full((n_send,), 7, dtype=torch.uint8, device=DEVICE) for _ in range(2))
            want_r = got_r = None
            if not own:
                want_r, got_r = (torch.full((sum(wl.s2h_recv_splits(QKV)),), 7, dtype=torch.uint8, device=DEVICE) for _ in range(2))
            R.quant_pack_s2h(lay, (q, k, v), QKV, want_s, fmt, recv=want_r)
            kern.quant_pack_s2h(lay, (q, k, v), QKV, got_s, fmt, recv=got_r)
            assert torch.equal(got_s, want_s), (fmt, dtype, own)
            if not own:
                assert torch.equal(got_r, want_r), (fmt, dtype)


@pytest.mark.parametrize("name", ["triton", "cuda"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_quant_pack_h2s_and_dequant_s2h_match_the_reference(name, case):
    kern, lay = _kernel_set(name), _layout(case)
    B, S, rank = lay.batch, lay.seq_total, lay.rank
    for fmt, dtype in zip(FORMATS * 2, DTYPES + DTYPES[:1]):
        h = lay.head_count("o", rank)
        local = _spread((B, S, h + 1, lay.v_head_dim), dtype, 4)[:, :, 1:]  # heads strided
        want, got = (torch.full((B * S * h * (lay.v_head_dim + SCALE_BYTES),), 7, dtype=torch.uint8, device=DEVICE) for _ in range(2))
        R.quant_pack_h2s(lay, local, want, fmt)
        kern.quant_pack_h2s(lay, local, got, fmt)
        assert torch.equal(got, want), (fmt, dtype)
        # The receive buffer of q/k/v: every source's rows quantized by the reference.
        wl = wire_layout(lay, fmt)
        recv = torch.empty(sum(wl.s2h_recv_splits(QKV)), dtype=torch.uint8, device=DEVICE)
        for i, (role, view) in enumerate(zip(QKV, wl.s2h_recv_views(recv, QKV))):
            view.copy_(R.wire_rows(_spread(view.shape[:-1] + (lay.dim(role),), dtype, 10 + i), fmt))
        shapes = [(B, S, lay.head_count(r, rank), lay.dim(r)) for r in QKV]
        want = [torch.full(s, 3.0, dtype=dtype, device=DEVICE) for s in shapes]
        got = [torch.full(s, 3.0, dtype=dtype, device=DEVICE) for s in shapes]
        R.dequant_s2h(lay, recv, QKV, want, fmt)
        kern.dequant_s2h(lay, recv, QKV, got, fmt)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (fmt, dtype)


@pytest.mark.parametrize("name", ["triton", "cuda"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_dequant_unpack_h2s_matches_the_reference(name, case):
    kern, lay = _kernel_set(name), _layout(case)
    B, s_r, P = lay.batch, lay.seq_local, lay.world_size
    for fmt, dtype in zip(FORMATS * 2, DTYPES + DTYPES[:1]):
        for roles in (QKV, OUT):
            blocks = [
                [R.wire_rows(_spread((B, s_r, lay.head_count(r, p), lay.dim(r)), dtype, 100 * p + i), fmt) for i, r in enumerate(roles)] for p in range(P)
            ]
            shapes = [(B, s_r, lay.total_heads(r), lay.dim(r)) for r in roles]
            want = [torch.full(s, 3.0, dtype=dtype, device=DEVICE) for s in shapes]
            got = [torch.full(s, 3.0, dtype=dtype, device=DEVICE) for s in shapes]
            R.dequant_unpack_h2s(lay, blocks, roles, want, fmt)
            kern.dequant_unpack_h2s(lay, blocks, roles, got, fmt)
            for g, w in zip(got, want):
                assert torch.equal(g, w), (fmt, dtype, roles)
            if getattr(kern, "flat_blocks", False):  # the same blocks as flat 1-D pieces
                got = [torch.full(s, 3.0, dtype=dtype, device=DEVICE) for s in shapes]
                kern.dequant_unpack_h2s(lay, [[b.reshape(-1) for b in per] for per in blocks], roles, got, fmt)
                for g, w in zip(got, want):
                    assert torch.equal(g, w), (fmt, dtype, roles, "flat")


@pytest.mark.parametrize("name", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quant_and_dequant_of_rows_that_start_unaligned(name, dtype):
    """Contiguous rows of D % 4 == 0 elements whose starts are not aligned for a 4-element load
    (a [..., 1:] view of D + 1): the CUDA kernels and their twin take the element path there."""
    kern, lay = _kernel_set(name), _layout((4, 2, 2, 0, (3, 2), 1, 8, 8))
    B, S, h, D = lay.batch, lay.seq_total, lay.head_count("o", 0), lay.v_head_dim
    local = _spread((B, S, h, D + 1), dtype, 5)[..., 1:]
    assert local.stride(-1) == 1 and local.data_ptr() % (4 * local.element_size()) != 0
    want, got = (torch.full((B * S * h * (D + SCALE_BYTES),), 7, dtype=torch.uint8, device=DEVICE) for _ in range(2))
    R.quant_pack_h2s(lay, local, want, E4M3)
    kern.quant_pack_h2s(lay, local, got, E4M3)
    assert torch.equal(got, want)
    s_r, P = lay.seq_local, lay.world_size
    blocks = [[R.wire_rows(_spread((B, s_r, lay.head_count("o", p), D), dtype, 20 + p), E4M3)] for p in range(P)]
    outs = [_spread((B, s_r, lay.total_heads("o"), D + 1), dtype, 30)[..., 1:] for _ in range(2)]
    R.dequant_unpack_h2s(lay, blocks, OUT, [outs[0]], E4M3)
    kern.dequant_unpack_h2s(lay, blocks, OUT, [outs[1]], E4M3)
    assert torch.equal(outs[1], outs[0])


# ---- Triton's compiled (GPU) path, checked without a GPU ------------------------------------
_COMPILE_SM90 = r"""
import re, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ulysses_kernels.kernels import triton_fp8 as F

def compile(fn, sig, const, tables):
    sig.update({n: "constexpr" for n in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(tables)}
    options = {"num_warps": 8, "enable_fp_fusion": False}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

def quant(vec, wire_align):
    sig = {"addr_ptr": "*i64", "col_ptr": "*i64", "n_rows": "i32", "batch": "i32", "n_cols": "i32"}
    const = dict(D=128, LOAD=tl.uint16, IS_BF16=True, FMT_MAX=448.0, MB=3, BIAS=7, SUB_EXP=-9, MIN_NORMAL=2.0**-6, FLOOR=1e-12,
                 SRC_CONTIG=True, SRC_VEC=vec, SRC_ALIGN=2 * vec, WIRE_ALIGN=wire_align, BLOCK_R=64, BLOCK_D=128)
    return compile(F._quant_kernel, sig, const, 2)

def dequant(vec, wire_align):
    sig = {"addr_ptr": "*i64", "col_ptr": "*i64", "src_ptr": "*i64", "n_rows": "i32", "batch": "i32", "n_cols": "i32"}
    const = dict(D=128, FLOAT=tl.bfloat16, IS_BF16=True, BF16_NAN=0x7FFF, MB=3, BIAS=7, SUB_STEP=2.0**-9, IS_E4M3=True,
                 WIRE_ALIGN=wire_align, OUT_VEC=vec, OUT_ALIGN=2 * vec, BLOCK_R=64, BLOCK_D=128)
    return compile(F._dequant_kernel, sig, const, 3)

def data_accesses(p):  # the int64 tables' reads (b64) left out
    return sorted(set(re.findall(r"(?:ld|st)\.global(?:\.v\d)?\.b(?:8|16|32)\b", p)))

for vec, wire_align in ((8, 4), (1, 1)):
    print("quant", vec, wire_align, *data_accesses(quant(vec, wire_align)))
    print("dequant", vec, wire_align, *data_accesses(dequant(vec, wire_align)))
"""


def test_triton_fp8_kernels_compile_for_sm90_with_vector_accesses_where_aligned():
    """The quantizing pack and the dequantizing unpack compile for sm_90 (Triton's LLVM and
    ptxas, no GPU), and their hints take effect: aligned, bf16 is read and written 16 bytes at a
    time and the wire (rows of D + 4 bytes, so 4-byte aligned) 4 bytes at a time, the scale
    included; unaligned, every access is one element (before the hints, that was every launch:
    10% of a copy's bandwidth on an H200, bench/results/2026-11-30_h200_world/pack_fp8.txt)."""
    stdout = sm90_output(_COMPILE_SM90)
    assert stdout.split("\n")[:4] == [
        "quant 8 4 ld.global.v4.b32 st.global.b32",
        "dequant 8 4 ld.global.b32 st.global.v4.b32",
        "quant 1 1 ld.global.b16 st.global.b8",
        "dequant 1 1 ld.global.b8 st.global.b16",
    ], stdout


def test_triton_fp8_launch_geometry_and_alignment():
    F = pytest.importorskip("ulysses_kernels.kernels.triton_fp8")
    assert [F._alignment(v) for v in ([132, 264, 0], [12, 8], [10], [6, 64], [])] == [4, 4, 2, 2, 16]
    grid, block_r, block_d = F._launch_geometry(1000, 24, 136, False)  # one axis: row blocks x columns
    assert block_d == 256 and grid == (triton_cdiv(1000, block_r) * 24,)
    with pytest.raises(ValueError, match="CUDA's limit"):
        F._launch_geometry(1 << 40, 64, 128, False)
    # MLA: q/k columns (D = 8) and v columns (D = 6) are two launches; the wire rows of the
    # second (pitch 10 bytes) are only 2-byte aligned, the first's (12) 4-byte.
    cols = [1, 0, 12, 0, 0, 0, 8, 0, 1, 8] + [1, 12, 10, 0, 0, 0, 6, 0, 1, 6]
    table = F._Launches(cols, itemsize=2)
    assert [(g[0], g[4]) for g in table.groups] == [(6, 2), (8, 4)]


def triton_cdiv(a, b):
    return -(-a // b)


def test_fp8_op_errors_name_the_tensor():
    """The FP8 wire's C++ ops check their inputs as the plain ops do (one host helper for
    both, csrc/op_params.h): head ranges, world size, recv and seq_offset, byte buffers."""
    from ulysses_kernels import extension

    if not extension.available():
        pytest.skip("ulysses_kernels._C is not built")
    ops = torch.ops.ulysses_kernels
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
    send = torch.empty(2 * 3 * 6 * 12, dtype=torch.uint8)
    ops.quant_pack_s2h([q, k], [0, 4, 0, 2], send)  # the well-formed call
    with pytest.raises(RuntimeError, match=r"quant_pack_s2h: head range of peer 0, tensors\[1\] expected within \[0, 2\], got \[0, 3\)"):
        ops.quant_pack_s2h([q, k], [0, 4, 0, 3], send)
    with pytest.raises(RuntimeError, match=r"quant_pack_s2h: world_size expected at most 64, got 65"):
        ops.quant_pack_s2h([q], [0, 1] * 65, send)
    with pytest.raises(RuntimeError, match=r"quant_pack_s2h: send\.dtype expected uint8 \(wire bytes\), got Float"):
        ops.quant_pack_s2h([q, k], [0, 4, 0, 2], torch.empty(10))
    # Two peers, this rank (1) keeps heads [2, 4) of q and [1, 2) of k: 3 heads of 12 bytes a token.
    ranges = [0, 2, 0, 1, 2, 4, 1, 2]
    half = torch.empty(2 * 3 * 3 * 12, dtype=torch.uint8)
    recv = torch.empty(2 * 5 * 3 * 12, dtype=torch.uint8)  # 5 tokens in all
    ops.quant_pack_s2h([q, k], ranges, half, recv, 1, 2)
    with pytest.raises(RuntimeError, match=r"quant_pack_s2h: recv expected a contiguous 1-D tensor of B \* S \* h \* \(D \+ 4\) bytes = 2 \* S \* 3 \* 12"):
        ops.quant_pack_s2h([q, k], ranges, half, recv[:-1], 1, 2)
    with pytest.raises(RuntimeError, match=r"quant_pack_s2h: seq_offset expected in \[0, 2\] \(recv holds 5 tokens, tensors\[0\] 3\), got 3"):
        ops.quant_pack_s2h([q, k], ranges, half, recv, 1, 3)
    with pytest.raises(RuntimeError, match=r"quant_pack_s2h: rank expected in \[0, 2\) when recv is given, got 2"):
        ops.quant_pack_s2h([q, k], ranges, half, recv, 2, 0)
    out = torch.empty(2, 3, 4, 8)
    blocks = [torch.empty(2, 3, 2, 12, dtype=torch.uint8)] * 2
    ops.dequant_unpack_h2s(blocks, [0, 2, 2, 4], [out])
    with pytest.raises(RuntimeError, match=r"dequant_unpack_h2s: head range of blocks\[1\] \(source 1, role 0\) expected within \[0, 4\], got \[3, 5\)"):
        ops.dequant_unpack_h2s(blocks, [0, 2, 3, 5], [out])
    with pytest.raises(RuntimeError, match=r"dequant_unpack_h2s: outs expected 1 to 3 tensors, got 4"):
        ops.dequant_unpack_h2s(blocks, [0, 4] * 4, [out] * 4)
    with pytest.raises(RuntimeError, match=r"fmt expected 0 \(e4m3\) or 1 \(e5m2\), got 2"):
        ops.dequant_unpack_h2s(blocks, [0, 2, 2, 4], [out], 2)
