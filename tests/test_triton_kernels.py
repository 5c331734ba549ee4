"""The Triton kernel set against the reference in ``ulysses_kernels.layout``, bit for bit.

Runs on the CPU under ``TRITON_INTERPRET=1`` (set by conftest.py when there is no GPU) and
on a GPU as is. Every program instance costs ~4 ms in the interpreter, so the shapes are
small (the grid is one program per head column) and big plans check a few ranks only.
"""

from __future__ import annotations

import pytest
import torch
from triton_compile import sm90_output

from ulysses_kernels import extension
from ulysses_kernels.kernels import torch_kernels as L
from ulysses_kernels.layout import Q_ONLY, QKV, Layout
from ulysses_kernels.plan import HeadPlan

triton_kernels = pytest.importorskip("ulysses_kernels.kernels.triton_kernels")
TritonKernels = triton_kernels.TritonKernels

if not TritonKernels.available():
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (q_heads, kv_heads, world, ranks to check: None = all)
PLANS = [
    (4, 4, 1, None),
    (6, 6, 2, None),
    (7, 7, 3, None),  # uneven MHA
    (10, 2, 4, None),  # GQA with groups split across ranks (KV replicas)
    (40, 8, 3, (0, 1)),
    (40, 8, 5, (0, 3)),
    (40, 8, 8, (7,)),
    (8, 1, 4, (0, 3)),  # MQA: every rank holds the one KV head
]


def _rand(shape, dtype, gen):
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if dtype.is_floating_point:
        return x.to(dtype).to(DEVICE)
    return (x * 50).to(dtype).to(DEVICE)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Same bytes as an integer tensor: torch.equal on bits (NaN payloads, fp8)."""
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _layouts(hq, hkv, world, ranks, batch=2, head_dim=8):
    plan = HeadPlan.build(hq, hkv, world)
    lens = tuple(2 + (3 * r) % 4 for r in range(world))  # uneven: 2, 5, 4, 3, ...
    for r in range(world) if ranks is None else ranks:
        yield Layout(plan, r, lens, batch, head_dim)


def _check_pack_s2h(lay: Layout, dtype, gen, fused=False):
    hq, hkv = lay.plan.q_heads, lay.plan.kv_heads
    B, s, D = lay.batch, lay.seq_local, lay.head_dim
    if fused:
        # Views of one fused QKV projection output [B, s, (hq + 2 hkv) * D].
        qkv = _rand((B, s, (hq + 2 * hkv) * D), dtype, gen)
        q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
        q, k, v = q.unflatten(-1, (hq, D)), k.unflatten(-1, (hkv, D)), v.unflatten(-1, (hkv, D))
    else:
        q = _rand((B, s, hq, D), dtype, gen)
        # Non-contiguous: seq-major storage, and a head_dim slice of a wider tensor.
        k = _rand((s, B, hkv, D), dtype, gen).transpose(0, 1)
        v = _rand((B, s, hkv, D + 3), dtype, gen)[..., 1 : D + 1]
    n = sum(lay.s2h_send_splits(QKV))
    ref = torch.full((n,), 3, dtype=dtype, device=DEVICE) if dtype.is_floating_point else torch.zeros(n, dtype=dtype, device=DEVICE)
    got = ref.clone()
    L.pack_s2h(lay, (q, k, v), QKV, ref)
    TritonKernels.pack_s2h(lay, (q, k, v), QKV, got)
    assert torch.equal(_bits(ref), _bits(got)), (lay, dtype, fused)
    # This rank's own heads straight into the receive buffer (the batch > 1 path).
    nr, ns = sum(lay.s2h_recv_splits(QKV)), sum(lay.s2h_send_splits(QKV, own=False))  # send: the peers' blocks only
    ref_r, got_r = torch.zeros(nr, dtype=dtype, device=DEVICE), torch.zeros(nr, dtype=dtype, device=DEVICE)
    ref, got = torch.zeros(ns, dtype=dtype, device=DEVICE), torch.ones(ns, dtype=dtype, device=DEVICE)
    L.pack_s2h(lay, (q, k, v), QKV, ref, recv=ref_r)
    TritonKernels.pack_s2h(lay, (q, k, v), QKV, got, recv=got_r)
    assert torch.equal(_bits(ref), _bits(got)) and torch.equal(_bits(ref_r), _bits(got_r)), (lay, dtype, fused)
    # One role (dout in the backward).
    n1 = sum(lay.s2h_send_splits(Q_ONLY))
    ref1, got1 = torch.zeros(n1, dtype=dtype, device=DEVICE), torch.ones(n1, dtype=dtype, device=DEVICE)
    L.pack_s2h(lay, (q,), Q_ONLY, ref1)
    TritonKernels.pack_s2h(lay, (q,), Q_ONLY, got1)
    assert torch.equal(_bits(ref1), _bits(got1)), (lay, dtype, fused)


def _check_h2s(lay: Layout, dtype, gen, roles=QKV, self_blocks=False, same_start=False):
    r, B, S, D = lay.rank, lay.batch, lay.seq_total, lay.head_dim
    _, recv_splits = lay.h2s_splits(roles)
    recv = _rand((sum(recv_splits),), dtype, gen)
    blocks = lay.h2s_recv_views(recv, roles)
    if self_blocks:
        # As a2a_head_to_seq does: this rank's own rows come from batch-major local tensors.
        local = [_rand((B, S, lay.head_count(s, r), D), dtype, gen) for s in roles]
        blocks[r] = [lay.h2s_send_blocks(x, r) for x in local]
    shapes = [(B, lay.seq_local, lay.total_heads(s), D) for s in roles]
    ref = [torch.zeros(sh, dtype=dtype, device=DEVICE) for sh in shapes]
    # Different starting values catch an unwritten head, unless the layout leaves heads
    # out on purpose (a head chunk): then both start equal and those heads must stay.
    got = [x.clone() if same_start else torch.full(sh, 5, dtype=dtype, device=DEVICE) for x, sh in zip(ref, shapes)]
    L.unpack_h2s(lay, blocks, roles, ref)
    TritonKernels.unpack_h2s(lay, blocks, roles, got)
    for a, b in zip(ref, got):
        assert torch.equal(_bits(a), _bits(b)), (lay, dtype, roles)
    # pack_h2s: a batch-major local tensor (not seq-major when B > 1) -> wire format.
    local = _rand((B, S, lay.head_count("q", r) + 1, D), dtype, gen)[:, :, 1:]
    n = local.numel()
    ref_w, got_w = torch.zeros(n, dtype=dtype, device=DEVICE), torch.ones(n, dtype=dtype, device=DEVICE)
    L.pack_h2s(lay, local, ref_w)
    TritonKernels.pack_h2s(lay, local, got_w)
    assert torch.equal(_bits(ref_w), _bits(got_w))


@pytest.mark.parametrize("hq,hkv,world,ranks", PLANS)
def test_plans_fp32(hq, hkv, world, ranks):
    gen = torch.Generator().manual_seed(hq * 100 + world)
    for lay in _layouts(hq, hkv, world, ranks):
        _check_pack_s2h(lay, torch.float32, gen)
        _check_h2s(lay, torch.float32, gen, self_blocks=lay.rank % 2 == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes_with_replica_sums(dtype):
    # 10/2 on 4 ranks and MQA on 3: every KV head is summed over 2-3 replicas.
    gen = torch.Generator().manual_seed(7)
    for hq, hkv, world in ((10, 2, 4), (6, 1, 3)):
        for lay in _layouts(hq, hkv, world, None, batch=3, head_dim=16):
            _check_pack_s2h(lay, dtype, gen, fused=lay.rank == 1)
            _check_h2s(lay, dtype, gen)


def test_bf16_sum_rounding_ties_and_specials():
    # Values whose fp32 sum sits exactly halfway between two bf16 values (ties to even),
    # plus inf, nan and signed zeros, summed over three replicas (MQA, 3 ranks).
    plan = HeadPlan.build(3, 1, 3)
    lay = Layout(plan, 0, (4, 4, 4), 1, 8)
    a = torch.tensor([1.0, 1.0078125, 256.0, float("inf"), -0.0, 1e38, 3.0, float("nan")])
    b = torch.tensor([0.00390625, 0.00390625, 1.0, 1.0, -0.0, 3e38, -3.0, 1.0])
    c = torch.tensor([2.0**-9, 0.0, 0.5, float("-inf"), 0.0, -1e38, 2.0**-20, 0.0])
    blocks = []
    for x in (a, b, c):
        blk = x.to(torch.bfloat16).to(DEVICE).expand(1, 4, 1, 8).contiguous()
        blocks.append([blk])
    ref = torch.zeros(1, 4, 1, 8, dtype=torch.bfloat16, device=DEVICE)
    got = torch.ones_like(ref)
    L.unpack_h2s(lay, blocks, ("kv",), [ref])
    TritonKernels.unpack_h2s(lay, blocks, ("kv",), [got])
    # NaN sums: same positions; their bits are the device's own (PyTorch's CPU scalar and
    # vector paths already disagree on them), every other value bit-exact.
    nan = torch.isnan(ref)
    assert torch.equal(nan, torch.isnan(got)) and nan.any()
    assert torch.equal(_bits(ref)[~nan], _bits(got)[~nan])


# NaN payloads through the replica sum (quiet, negative, signaling, odd payloads).
NAN_BITS = {
    torch.bfloat16: (0x7FC0, 0xFFC0, 0x7F81, 0xFFA5, 0x7FFF),
    torch.float16: (0x7E00, 0xFE00, 0x7D11, 0xFC01, 0x7FFF),
}


def _i16(x: int) -> int:
    return x - 0x10000 if x >= 0x8000 else x


@pytest.mark.skipif(
    DEVICE == "cpu" and not torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")),
    reason="torch's CPU add_ writes these NaN bits in its AVX2/AVX-512 kernels",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nan_sums_match_torch_add(dtype):
    """MQA over 4 ranks (4 replicas of the KV head summed) with NaN payloads in replica 0
    (columns 0-4) or 2 (5-9), inf + (-inf) (10), and for bf16 NaN in two replicas (11; which
    fp16 payload an add keeps then is the hardware's choice): the bits of PyTorch's own add_
    on this device (CPU: 0xFFFF for bf16, fp16 payloads kept; CUDA: 0x7FFF)."""
    world, d = 4, 64  # d = 64: the reference's add_ runs on whole rows, in torch's CPU vector path
    lay = Layout(HeadPlan.build(8, 1, world), 0, (2,) * world, 1, d)
    gen = torch.Generator().manual_seed(5)
    blocks = [torch.randn(1, 2, 1, d, generator=gen).to(dtype) for _ in range(world)]
    bits = [b.view(torch.int16) for b in blocks]
    for i, nan in enumerate(NAN_BITS[dtype]):
        bits[0][..., i] = _i16(nan)
        bits[2][..., 5 + i] = _i16(nan)
    blocks[1][..., 10], blocks[3][..., 10] = float("inf"), float("-inf")
    if dtype == torch.bfloat16:
        bits[0][..., 11], bits[3][..., 11] = _i16(0x7FC0), _i16(0xFFA5)
    blocks = [[b.to(DEVICE)] for b in blocks]
    ref = torch.zeros(1, 2, 1, d, dtype=dtype, device=DEVICE)
    got = torch.ones_like(ref)
    L.unpack_h2s(lay, blocks, ("kv",), [ref])
    TritonKernels.unpack_h2s(lay, blocks, ("kv",), [got])
    nan = torch.isnan(ref)
    assert int(nan.sum()) == 2 * (12 if dtype == torch.bfloat16 else 11)
    assert torch.equal(_bits(ref), _bits(got))
    if DEVICE == "cuda":
        assert bool((_bits(got)[nan] == 0x7FFF).all())
    elif dtype == torch.bfloat16:
        assert bool((_bits(got)[nan] == _i16(0xFFFF)).all())
    else:
        assert {_i16(0x7F11), _i16(0xFE01)} <= set(_bits(got)[nan].tolist())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int32, torch.uint8])
def test_bit_movers(dtype):
    """Pure data movement works for any element width, fp8 included."""
    gen = torch.Generator().manual_seed(3)
    for lay in _layouts(8, 8, 4, (1, 2)):
        _check_pack_s2h(lay, dtype, gen)
        # 8/8 has no replicas: unpack is pure movement too.
        _check_h2s(lay, dtype, gen, roles=Q_ONLY)


def test_nan_payloads_move_unchanged():
    lay = next(_layouts(4, 4, 2, (0,)))
    q = torch.randint(-(2**15), 2**15, (2, lay.seq_local, 4, 8), dtype=torch.int16).view(torch.float16).to(DEVICE)
    send_ref = torch.zeros(sum(lay.s2h_send_splits(Q_ONLY)), dtype=torch.float16, device=DEVICE)
    send = torch.ones_like(send_ref)
    L.pack_s2h(lay, (q,), Q_ONLY, send_ref)
    TritonKernels.pack_s2h(lay, (q,), Q_ONLY, send)
    assert torch.isnan(q).any()
    assert torch.equal(_bits(send_ref), _bits(send))


def test_fp8_replica_sum_raises_like_reference():
    lay = next(_layouts(6, 1, 3, (0,)))
    _, recv_splits = lay.h2s_splits(("kv",))
    recv = torch.zeros(sum(recv_splits), dtype=torch.float8_e4m3fn, device=DEVICE)
    out = torch.zeros(lay.batch, lay.seq_local, 1, lay.head_dim, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises((TypeError, RuntimeError, NotImplementedError)):
        TritonKernels.unpack_h2s(lay, lay.h2s_recv_views(recv, ("kv",)), ("kv",), [out])


def test_chunk_layout_subset_of_heads():
    """A head chunk (a plan restricted to sub-ranges, as the pipeline builds) packs and
    unpacks only its heads and leaves the others untouched."""
    from ulysses_kernels.attention.chunked import chunk_plans

    plan = HeadPlan.build(40, 8, 3)
    gen = torch.Generator().manual_seed(11)
    chunks = chunk_plans(plan, 3)
    assert len(chunks) >= 2
    for cp in chunks:
        lay = Layout(cp, 1, (3, 2, 4), 2, 8)
        _check_pack_s2h(lay, torch.float32, gen)
        _check_h2s(lay, torch.float32, gen, roles=Q_ONLY, same_start=True)


def test_descriptor_cache_is_per_layout_and_bounded():
    gen = torch.Generator().manual_seed(1)
    before = len(TritonKernels._tables)
    lay = next(_layouts(6, 6, 2, (0,)))
    _check_pack_s2h(lay, torch.float32, gen)
    n = len(TritonKernels._tables)
    _check_pack_s2h(lay, torch.float32, gen)  # same layout and strides: no new entry
    assert len(TritonKernels._tables) == n >= before
    assert len(TritonKernels._tables) <= TritonKernels._max_tables


def test_registry_resolves_triton():
    from ulysses_kernels.kernels import get_kernels

    kern = get_kernels("triton", torch.device(DEVICE))
    assert kern.name == "triton"


# ---- the compiled (GPU) path, checked without a GPU -------------------------------------
_COMPILE_SM90 = r"""
import re, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ulysses_kernels.kernels.triton_kernels import _gather_columns_kernel as fn

def ptx(elem, flt, has_sum, bf16, vec, d=128, cols_fastest=True):
    sig = {n: "*i64" for n in ("addr_ptr", "col_ptr", "src_ptr")}
    sig.update(n_rows="i32", batch="i32")
    const = dict(D=d, ELEM=elem, FLOAT=flt, ACC=tl.float32, HAS_SUM=has_sum, IS_BF16=bf16, BF16_NAN=0x7FFF,
                 D_CONTIG=True, VEC=vec, BLOCK_R=32, BLOCK_D=triton.next_power_of_2(d))
    sig.update({n: "constexpr" for n in const})
    sig["n_cols"] = "i32"
    const["COLS_FASTEST"] = cols_fastest
    sig["COLS_FASTEST"] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2)}  # the three table pointers
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return k.asm["ptx"]

def accesses(p):
    # "v4": 16-byte loads and stores, and no 2-byte access left anywhere.
    v4 = re.search(r"ld\.global\.v4", p) and re.search(r"st\.global\.v4", p)
    return "v4" if v4 and not re.search(r"(ld|st)\.global\.b16", p) else "scalar"

for name, args in {"copy": (tl.int16, tl.bfloat16, False, True), "sum": (tl.int16, tl.bfloat16, True, True)}.items():
    for vec in (8, 1):
        print(name, vec, accesses(ptx(*args, vec)))
for d in (40, 72, 80, 96, 128):
    for name, args in {"copy": (tl.int16, tl.bfloat16, False, True), "sum": (tl.int16, tl.bfloat16, True, True)}.items():
        print("D", d, name, accesses(ptx(*args, 8, d)))
print("old", accesses(ptx(tl.int16, tl.bfloat16, False, True, 8, 128, False)))
"""

HEAD_DIMS = (40, 72, 80, 96, 128)


def test_compiles_for_sm90_with_16_byte_accesses_only_when_aligned():
    """The kernel compiles for sm_90 (no GPU needed: Triton's own LLVM and ptxas), and the
    alignment hints take effect: 16-byte loads/stores with VEC > 1, scalar ones with VEC = 1.
    Triton drops an integer's divisibility at int_to_ptr, so hints must sit on the pointer.
    Every common head_dim gets 16-byte accesses and no 2-byte ones (bf16): D is constexpr,
    so the mask ``d < D`` is known constant over 8 elements at D = 40 or 72 too."""
    stdout = sm90_output(_COMPILE_SM90)
    lines = stdout.split("\n")
    assert lines[:4] == ["copy 8 v4", "copy 1 scalar", "sum 8 v4", "sum 1 scalar"], stdout
    assert lines[4:14] == [f"D {d} {op} v4" for d in HEAD_DIMS for op in ("copy", "sum")], stdout
    assert lines[14] == "old v4", stdout  # the old variant's 2-D grid (ULYSSES_KERNELS_PACK_VARIANT=old)


def test_too_many_head_columns_for_the_grid():
    # Old variant: head columns on grid axis y (at most 65535).
    table = triton_kernels._ColumnTable([0, 0, 1, 1, 1, 1, 0] * 65536, [0, 0, 1, 1, 1], 8, 4)
    x = torch.zeros(8)
    previous = extension.set_pack_variant("old")
    try:
        with pytest.raises(ValueError, match="grid"):
            TritonKernels._launch(table, [x], 1, 1, 8, x)
    finally:
        extension.set_pack_variant(previous)
    # New variant: one axis of row blocks x columns, limited to 2^31 - 1 programs.
    grid, block_r, _ = triton_kernels._launch_geometry(1, 65536, 8, False, new=True)
    assert grid == (65536,) and block_r == 1
    grid, block_r, _ = triton_kernels._launch_geometry(1 << 24, 64, 128, False, new=True)
    assert block_r == 64 and grid == ((1 << 24) // 64 * 64,)
    with pytest.raises(ValueError, match="grid"):
        triton_kernels._launch_geometry(1 << 40, 64, 1, False, new=True)


@pytest.fixture(params=["old", "new"])
def variant(request):
    """Run a test under each kernel variant (``extension.set_pack_variant``)."""
    previous = extension.set_pack_variant(request.param)
    yield request.param
    extension.set_pack_variant(previous)


@pytest.mark.parametrize("hq,hkv,world,ranks", [(10, 2, 4, (1,)), (7, 7, 3, (2,))])
def test_both_variants_bit_exact(hq, hkv, world, ranks, variant):
    # KV replica sums (10/2 on 4 ranks) and an uneven MHA plan, under each variant's grid.
    gen = torch.Generator().manual_seed(11)
    for lay in _layouts(hq, hkv, world, ranks):
        _check_pack_s2h(lay, torch.bfloat16, gen, fused=True)
        _check_h2s(lay, torch.bfloat16, gen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_capture_in_cuda_graph_survives_allocator_reuse():
    # A captured launch reads its address table and the plan's device tables at every
    # replay: after capture, churn the pinned host and device allocators and drop the table
    # LRU, then replay on new inputs. A first launch inside a capture says to warm up.
    from ulysses_kernels.kernels.triton_kernels import TritonKernels as TK

    gen = torch.Generator().manual_seed(7)
    lay = Layout(HeadPlan.build(40, 8, 3), 1, (64, 48, 80), 2, 64)
    q, k, v = (_rand((2, 48, h, 64), torch.bfloat16, gen).cuda() for h in (40, 8, 8))
    send = torch.empty(sum(lay.s2h_send_splits(QKV)), device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph (compiles the kernel)
        TK.pack_s2h(lay, (q, k, v), QKV, send)
    torch.cuda.current_stream().wait_stream(stream)
    TK._tables.clear()
    with pytest.raises(RuntimeError, match="first launch is inside a CUDA graph capture"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        TK.pack_s2h(lay, (q, k, v), QKV, send)
    torch.cuda.synchronize()
    TK.pack_s2h(lay, (q, k, v), QKV, send)  # warm the plan cache again
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        TK.pack_s2h(lay, (q, k, v), QKV, send)
    TK._tables.clear()
    junk = [torch.full((64,), -1, dtype=torch.int64).pin_memory() for _ in range(256)]
    junk += [torch.full((1 << 16,), -1, dtype=torch.int64, device="cuda") for _ in range(64)]
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.empty_like(send)
    L.pack_s2h(lay, (q, k, v), QKV, ref)
    assert torch.equal(_bits(send), _bits(ref))
    del junk
