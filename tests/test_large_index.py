"""Pack/unpack at the sizes users run (32K to 1M+ tokens), where 32-bit offsets break.

At 1M tokens, 64 heads, head_dim 128, one tensor has 8.6e9 elements and one rank's
buffers pass 2^31 (and 2^32) bytes. Three kinds of checks, on the CPU and, where there
is one, on a GPU:

* far views: tensors whose strides put elements past 2^31 elements and 2^32 bytes from
  their storage's start, in a few pages of a lazily committed allocation (torch.empty is
  not touched beyond what a view covers), so the kernels compute 64-bit offsets while the
  work is tiny. Run for the CUDA kernels' CPU twin (32-bit index path, 64-bit offsets,
  through csrc/ops.cpp's size/stride passing) and for the Triton kernel (interpreter on
  the CPU, compiled on a GPU).
* big moves: more than 2^31 one-byte units (int8 with a buffer one byte past an aligned
  address, so the unit is one byte), which takes the 64-bit index instantiation: the CPU
  twin's (row indices; it decides the width as the CUDA launch does) and, on a GPU, the
  CUDA kernel's grid-stride unit index. Checks the host layer's element counts past 2^31
  too. Each needs ~5 GiB of memory and ~4 s on the CPU; skipped when less is free.
* the Triton launch geometry as a pure function at 1M tokens.

The C++ index math itself is checked at these sizes without memory in
tests/cpp/test_large_offsets.cpp (scripts/ctest.sh).
"""

from __future__ import annotations

import pytest
import torch

from ulysses_kernels.kernels import torch_kernels as L
from ulysses_kernels.layout import Q_ONLY, QKV, Layout
from ulysses_kernels.plan import HeadPlan

cuda_kernels = pytest.importorskip("ulysses_kernels.kernels.cuda_kernels")
CK = cuda_kernels.CudaKernels
needs_ext = pytest.mark.skipif(not CK.available(), reason="ulysses_kernels._C is not built")

GiB = 1 << 30


def _triton():
    try:
        from ulysses_kernels.kernels import triton_kernels
    except ImportError as e:  # triton not installed
        pytest.skip(f"triton: {e}")
    if not triton_kernels.TritonKernels.available():
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    return triton_kernels


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- far views --------------------------------------------------------------------------
# Byte strides of a far [B, s, H, D] view, sequence-major in memory (as Megatron's
# [s, b, h, d]): token t starts at t * (2 GiB + 4 KiB), so t * stride itself passes 4 GiB.
FAR_SB, FAR_SS = 256, 2 * GiB + 4096


def _far(shape, dtype, seed, device="cpu"):
    """A [B, s, H, D] view (s = 3, H * D * itemsize <= 256) whose last element lies past
    2^31 elements and 2^32 bytes from the start of its storage; only the pages the view
    covers are ever touched."""
    B, s, H, D = shape
    item = torch.empty(0, dtype=dtype).element_size()
    strides = (FAR_SB // item, FAR_SS // item, D, 1)
    size = 1 + sum((n - 1) * st for n, st in zip(shape, strides))
    assert size > 2**31 and size * item > 2**32
    x = torch.empty(size, dtype=dtype, device=device).as_strided(shape, strides)
    g = torch.Generator().manual_seed(seed)
    vals = torch.randn(shape, generator=g) * (1 if dtype.is_floating_point else 50)
    x.copy_(vals.to(dtype))
    return x


def _far_layout(batch=2, head_dim=16):
    """4 q / 2 KV heads on 2 ranks, seen from rank 1 with 3 local tokens after 2^25 of
    rank 0: the receive buffer (QKV, 4 heads of rank 1) is 2 * (2^25 + 3) * 4 * 16
    elements, so rank 1's own rows start 2^31 elements in and batch 1's past 2^32."""
    return Layout(HeadPlan.build(4, 2, 2), 1, (1 << 25, 3), batch, head_dim)


def _untouched(n, dtype, device="cpu"):
    """n elements, none touched on the CPU (only the rows written are compared)."""
    return torch.empty(n, dtype=dtype, device=device)


def _recv_rows(lay, recv, roles):
    """This rank's own rows of the receive buffer: [B, s_r, h, D] (a view)."""
    r4 = recv.view(lay.batch, lay.seq_total, lay.heads(roles, lay.rank), lay.head_dim)
    off = lay.seq_offset(lay.rank)
    return r4[:, off : off + lay.seq_local]


def _check_pack_s2h_far(kernels, dtype, device):
    lay = _far_layout()
    B, s, D = lay.batch, lay.seq_local, lay.head_dim
    q = _far((B, s, 4, D), dtype, 1, device)
    k = _far((B, s, 2, D), dtype, 2, device)
    v = _far((B, s, 2, D), dtype, 3, device)
    n_send, n_recv = sum(lay.s2h_send_splits(QKV, own=False)), sum(lay.s2h_recv_splits(QKV))  # with recv: the peers' blocks
    assert n_recv > 2**32
    ref_send, got_send = (torch.full((n_send,), 7, dtype=dtype, device=device) for _ in range(2))
    ref_recv, got_recv = (_untouched(n_recv, dtype, device) for _ in range(2))
    L.pack_s2h(lay, (q, k, v), QKV, ref_send, recv=ref_recv)
    kernels.pack_s2h(lay, (q, k, v), QKV, got_send, recv=got_recv)
    assert torch.equal(ref_send, got_send)
    assert torch.equal(_recv_rows(lay, ref_recv, QKV), _recv_rows(lay, got_recv, QKV))
    # And against the layout's definition directly: rank 1 holds q heads [2, 4), kv head 1.
    want = torch.cat([q[:, :, 2:4], k[:, :, 1:2], v[:, :, 1:2]], dim=2)
    assert torch.equal(_recv_rows(lay, got_recv, QKV), want)


def _check_pack_h2s_far(kernels, dtype, device):
    lay = _far_layout()
    local = _far((2, 3, 4, 16), dtype, 4, device)
    send = torch.full((local.numel(),), 7, dtype=dtype, device=device)
    kernels.pack_h2s(Layout(lay.plan, 0, (1, 2), 2, 16), local, send)
    assert torch.equal(send.view(local.shape), local)


def _check_unpack_h2s_far(kernels, dtype, device, replicas):
    # Q_ONLY over 2 ranks, q heads [0, 2) and [2, 4); with replicas, one KV head held by
    # both ranks (MQA), summed in rank order.
    plan = HeadPlan.build(4, 1, 2) if replicas else HeadPlan.build(4, 4, 2)
    roles = ("kv",) if replicas else Q_ONLY
    lay = Layout(plan, 0, (3, 3), 2, 16)
    h = lambda p: lay.head_count(roles[0], p)  # noqa: E731
    blocks = [[_far((2, 3, h(p), 16), dtype, 10 + p, device)] for p in range(2)]
    H = lay.total_heads(roles[0])
    ref = torch.full((2, 3, H, 16), 7, dtype=dtype, device=device)
    got = _far((2, 3, H, 16), dtype, 20, device)
    got.fill_(7)
    L.unpack_h2s(lay, blocks, roles, [ref])
    kernels.unpack_h2s(lay, blocks, roles, [got])
    assert torch.equal(ref, got)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.int8, torch.float16])
def test_cuda_kernels_far_views(dtype):
    """The CUDA kernels' CPU twin (and on a GPU the CUDA kernels) on far views."""
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        _check_pack_s2h_far(CK, dtype, device)
        _check_pack_h2s_far(CK, dtype, device)
        _check_unpack_h2s_far(CK, dtype, device, replicas=False)
        if dtype.is_floating_point:
            _check_unpack_h2s_far(CK, dtype, device, replicas=True)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16])
def test_triton_kernels_far_views(dtype):
    tk = _triton().TritonKernels
    device = _device()
    _check_pack_s2h_far(tk, dtype, device)
    _check_pack_h2s_far(tk, dtype, device)
    _check_unpack_h2s_far(tk, dtype, device, replicas=False)
    if dtype.is_floating_point:
        _check_unpack_h2s_far(tk, dtype, device, replicas=True)


# ---- big moves: more than 2^31 units (64-bit index path) --------------------------------
def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


BIG_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _need_memory(device, nbytes=7 * GiB):
    free = _mem_available() if device == "cpu" else torch.cuda.mem_get_info()[0]
    if free < nbytes:
        pytest.skip(f"needs {nbytes / GiB:.0f} GiB of free memory on {device}, {free / GiB:.1f} GiB free")


# One rank's share at 1M+ tokens: [1, S, 8, 128] int8 with S = 2^21 + 2^16 (2.2e9 elements).
BIG_B, BIG_S, BIG_H, BIG_D = 1, (1 << 21) + (1 << 16), 8, 128


def _odd(n, device):
    """n int8 elements starting one byte past an aligned address: every unit is one byte,
    so the launch has one unit per element (more than 2^31 here)."""
    buf = torch.empty(n + 1, dtype=torch.int8, device=device)
    x = buf[1:]
    assert x.data_ptr() % 2 == 1
    return x


def _row_ids(x2d: torch.Tensor) -> torch.Tensor:
    """The int64 in the first 8 bytes of each row of a [rows, D] int8 tensor."""
    return x2d[:, :8].contiguous().view(torch.int64).view(-1)


def _tag_rows(x2d: torch.Tensor, ids: torch.Tensor) -> None:
    x2d[:, :8] = ids.view(torch.int8).view(-1, 8)


@needs_ext
@pytest.mark.parametrize("device", BIG_DEVICES)
def test_pack_h2s_past_2_31_units(device):
    _need_memory(device)
    B, S, H, D = BIG_B, BIG_S, BIG_H, BIG_D
    rows = B * H * S
    assert rows * D > 2**31
    base = torch.empty(rows * D, dtype=torch.int8, device=device)
    base.fill_(5)
    _tag_rows(base.view(rows, D), torch.arange(rows, device=device))
    local = base.view(B, H, S, D).permute(0, 2, 1, 3)  # [B, S, H, D], head-major memory
    send = _odd(rows * D, device)
    torch.ops.ulysses_kernels.pack_h2s(local, send)
    want = torch.arange(rows, device=device).view(B, H, S).permute(0, 2, 1).reshape(-1)
    assert torch.equal(_row_ids(send.view(rows, D)), want)
    # Every byte, at the far end (past 2^31) and the start.
    for t in (0, 1, S - 2, S - 1):
        assert torch.equal(send.view(B, S, H, D)[:, t], local[:, t])
    assert torch.equal(send[-7:].cpu(), torch.full((7,), 5, dtype=torch.int8))


@needs_ext
@pytest.mark.parametrize("device", BIG_DEVICES)
def test_unpack_h2s_past_2_31_units(device):
    # Two sources of 4 heads each into one [B, S, 8, D] output (the h2s direction at 1M+
    # local tokens).
    _need_memory(device)
    B, S, H, D = BIG_B, BIG_S, BIG_H, BIG_D
    hp = H // 2
    rows_p = B * S * hp
    blocks = []
    for p in range(2):
        blk = torch.empty(rows_p * D, dtype=torch.int8, device=device)
        blk.fill_(3 + p)
        _tag_rows(blk.view(rows_p, D), torch.arange(rows_p, device=device) + p * rows_p)
        blocks.append(blk.view(B, S, hp, D))
    out = _odd(B * S * H * D, device)
    assert out.numel() > 2**31
    torch.ops.ulysses_kernels.unpack_h2s(blocks, [0, hp, hp, H], [out.view(B, S, H, D)])
    ids = torch.arange(2 * rows_p, device=device).view(2, B, S, hp).permute(1, 2, 0, 3).reshape(-1)
    assert torch.equal(_row_ids(out.view(-1, D)), ids)
    o4 = out.view(B, S, H, D)
    for t in (0, S - 1):
        assert torch.equal(o4[:, t], torch.cat([blocks[0][:, t], blocks[1][:, t]], dim=1))


# ---- Triton launch geometry -------------------------------------------------------------
@pytest.mark.parametrize("interpreting", [False, True])
@pytest.mark.parametrize("tokens,batch,cols,head_dim", [(1 << 20, 1, 80, 128), (1 << 20, 4, 64, 128), (1 << 21, 8, 8, 64), ((1 << 20) + 3, 1, 1, 1)])
def test_triton_grid_at_1m_tokens(tokens, batch, cols, head_dim, interpreting):
    """Old variant: rows (which grow with the sequence) on axis 0 (x: 2^31 - 1), head columns
    on axis 1 (y: 65535). New variant (#36): one axis of row blocks x columns (x: 2^31 - 1).
    Either way the tiles cover every row."""
    tk = _triton()
    n_rows = tokens * batch
    (gx, gy), block_r, block_d = tk._launch_geometry(n_rows, cols, head_dim, interpreting, False)
    assert gy == cols <= 65535
    assert 1 <= gx <= 2**31 - 1 and (gx - 1) * block_r < n_rows <= gx * block_r
    assert block_d >= head_dim and block_r * block_d <= max(1 << 14, block_d)
    if n_rows >= 1 << 24:
        assert gx > 65535  # would not fit on axis 1 or 2
    (g,), block_r, block_d = tk._launch_geometry(n_rows, cols, head_dim, interpreting, True)
    assert g % cols == 0 and 1 <= g <= 2**31 - 1
    n_blocks = g // cols
    assert (n_blocks - 1) * block_r < n_rows <= n_blocks * block_r
    assert block_d >= head_dim and block_r * block_d <= max(1 << 14, block_d)


def test_triton_grid_limits_raise():
    tk = _triton()
    # old variant: head columns on axis 1 (at most 65535), row blocks on axis 0
    with pytest.raises(ValueError, match="grid"):
        tk._launch_geometry(8, 65536, 8, False, False)
    with pytest.raises(ValueError, match="grid"):
        tk._launch_geometry(2**31 * 4096, 1, 1, False, False)
    # new variant: 65536 columns fit its one axis; row blocks x columns past 2^31 - 1 do not
    assert tk._launch_geometry(8, 65536, 8, False, True)[0] == (65536,)
    with pytest.raises(ValueError, match="grid"):
        tk._launch_geometry(2**31 * 8192, 1, 1, False, True)


# ---- head indices are 32-bit in the kernels' parameter structs --------------------------
@needs_ext
def test_head_counts_past_int32_are_rejected():
    n = 2**31 + 1
    x = torch.zeros(1, 1, 1, 1, dtype=torch.int8).expand(1, 1, n, 1)  # no memory
    send = torch.empty(4, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="32-bit head"):
        torch.ops.ulysses_kernels.pack_s2h([x], [0, n], send)
    out = torch.zeros(1, 1, 1, 1, dtype=torch.int8).expand(1, 1, n, 1)
    with pytest.raises(RuntimeError, match="32-bit head"):
        torch.ops.ulysses_kernels.unpack_h2s([x], [0, n], [out])
