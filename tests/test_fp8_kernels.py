"""The FP8 wire's four operations of each kernel set (Triton, and the C++ extension's CPU twin
and CUDA kernels) against the torch reference (``kernels.torch_kernels``), bit for bit, on
one rank's buffers (no collective: the layout math alone). Triton runs under
``TRITON_INTERPRET=1`` on the CPU (conftest.py), so the shapes are small."""

from __future__ import annotations

import pytest
import torch

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


def _wire(x, fmt):
    """``x`` ``[..., D]`` as reference wire rows ``[..., D + 4]``."""
    buf = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    R.quantize_rows(x, buf, fmt)
    return buf


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
            view.copy_(_wire(_spread(view.shape[:-1] + (lay.dim(role),), dtype, 10 + i), fmt))
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
            blocks = [[_wire(_spread((B, s_r, lay.head_count(r, p), lay.dim(r)), dtype, 100 * p + i), fmt) for i, r in enumerate(roles)] for p in range(P)]
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
    blocks = [[_wire(_spread((B, s_r, lay.head_count("o", p), D), dtype, 20 + p), E4M3)] for p in range(P)]
    outs = [_spread((B, s_r, lay.total_heads("o"), D + 1), dtype, 30)[..., 1:] for _ in range(2)]
    R.dequant_unpack_h2s(lay, blocks, OUT, [outs[0]], E4M3)
    kern.dequant_unpack_h2s(lay, blocks, OUT, [outs[1]], E4M3)
    assert torch.equal(outs[1], outs[0])
