"""The "cuda" kernel set (C++ extension) against the pure-PyTorch reference, bit for bit.

On the CPU this runs the CPU twin of the CUDA kernels (the same index math,
csrc/kernels/layout_math.h); on a GPU, test_cuda_kernels_gpu.py checks the CUDA kernels
against the twin on the same cases (cuda_cases.py).
Every plan is checked from every rank: world sizes 1..8, MHA/GQA/MQA, uneven heads,
batch > 1, uneven sequence shards, non-contiguous and fused-QKV inputs.
"""

import pytest
import torch
from cuda_cases import CASES, FILL, blocks_of, check_chunks, layout_of, outs_of, pack_both, qkv

from ulysses_kernels import extension
from ulysses_kernels.kernels import available_kernels, get_kernels
from ulysses_kernels.kernels import torch_kernels as L
from ulysses_kernels.layout import Q_ONLY, QKV, Layout
from ulysses_kernels.plan import HeadPlan

cuda_kernels = pytest.importorskip("ulysses_kernels.kernels.cuda_kernels")
pytestmark = pytest.mark.skipif(not cuda_kernels.CudaKernels.available(), reason="ulysses_kernels._C is not built")
CK = cuda_kernels.CudaKernels
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kind", ["contiguous", "fused", "strided"])
@pytest.mark.parametrize("plan,rank,batch,d,dtype", CASES)
def test_pack_s2h_matches_reference(plan, rank, batch, d, dtype, kind):
    lay = layout_of(plan, rank, batch, d)
    q, k, v = qkv(lay, dtype, "cpu", kind)
    for tensors, roles in (((q, k, v), QKV), ((q,), Q_ONLY)):
        for with_recv in (False, True):
            (ref, got), (ref_r, got_r) = pack_both(lay, tensors, roles, CK, with_recv)
            assert torch.equal(ref, got), f"send differs ({roles}, recv={with_recv})"
            assert torch.equal(ref_r, got_r), f"recv differs ({roles}, recv={with_recv})"


def test_pack_s2h_with_recv_wants_the_peers_blocks_only():
    # With recv the rank's own block goes to the receive buffer; a send buffer with room
    # for it too is the old contract and is refused by size, by name.
    lay = layout_of(HeadPlan.build(10, 2, 4), 1, 2, 8)
    q, k, v = qkv(lay, torch.float32, "cpu", "contiguous")
    ranges = lay.head_ranges(QKV)
    full, peers = sum(lay.s2h_send_splits(QKV)), sum(lay.s2h_send_splits(QKV, own=False))
    recv = torch.empty(sum(lay.s2h_recv_splits(QKV)))
    with pytest.raises(RuntimeError, match=f"pack_s2h: send.numel\\(\\) expected {peers}, got {full}"):
        torch.ops.ulysses_kernels.pack_s2h([q, k, v], ranges, torch.empty(full), recv, lay.rank, lay.seq_offset(lay.rank))


@pytest.mark.parametrize("plan,rank,batch,d,dtype", CASES)
def test_unpack_h2s_matches_reference(plan, rank, batch, d, dtype):
    lay = layout_of(plan, rank, batch, d)
    for roles in (QKV, Q_ONLY):
        blocks = blocks_of(lay, roles, dtype, "cpu", seed=plan.q_heads + 7 * rank)
        ref, got = outs_of(lay, roles, dtype, "cpu"), outs_of(lay, roles, dtype, "cpu")
        L.unpack_h2s(lay, blocks, roles, ref)
        CK.unpack_h2s(lay, blocks, roles, got)
        for i, (a, b) in enumerate(zip(ref, got)):
            assert torch.equal(a, b), f"role {i} of {roles} differs"


def test_unpack_sums_replicas_in_rank_order():
    # MQA over 8 ranks: every rank holds KV head 0, so the output is ((b0 + b1) + b2) + ...
    # rounded after each addition; the operands are chosen so a different order or a
    # single final rounding gives a different fp16 result.
    plan = HeadPlan.build(8, 1, 8)
    lay = Layout(plan, 0, (1,) * 8, 1, 8)
    vals = torch.tensor([2048.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    blocks = [[torch.full((1, 1, 1, 8), float(x), dtype=torch.float16)] for x in vals]
    (out,) = outs_of(lay, ("kv",), torch.float16, "cpu")
    CK.unpack_h2s(lay, blocks, ("kv",), [out])
    # 2048 + 1 rounds to 2048 in fp16 (spacing 2) at every step; summing in fp32 would give 2055 -> 2056.
    assert torch.equal(out, torch.full_like(out, 2048.0))
    (ref,) = outs_of(lay, ("kv",), torch.float16, "cpu")
    L.unpack_h2s(lay, blocks, ("kv",), [ref])
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_h2s_matches_reference(dtype):
    plan = HeadPlan.build(10, 2, 4)
    lay = Layout(plan, 1, (3, 2, 4, 1), 3, 8)
    for local in (
        torch.randn(3, 10, 3, 8).to(dtype),
        torch.randn(10, 3, 3, 8).to(dtype).transpose(0, 1),
        torch.randn(3, 3, 10, 8).to(dtype).transpose(1, 2),
    ):
        ref = torch.full((local.numel(),), FILL, dtype=dtype)
        got = ref.clone()
        L.pack_h2s(lay, local, ref)
        CK.pack_h2s(lay, local, got)
        assert torch.equal(ref, got)


def test_alignment_fallbacks():
    # Offsets that break 16-byte alignment force smaller units; results stay exact.
    plan = HeadPlan.build(6, 2, 3)
    lay = Layout(plan, 2, (2, 3, 2), 2, 8)
    for offset in (1, 2, 4):
        base = torch.randn(2 * 2 * 10 * 8 + offset)
        x = base[offset:].view(2, 2, 10, 8)
        q, k, v = x[:, :, :6], x[:, :, 6:8], x[:, :, 8:]
        (ref, got), _ = pack_both(lay, (q, k, v), QKV, CK, with_recv=False)
        assert torch.equal(ref, got), offset


def test_rank_with_no_heads():
    # A chunk of the pipelined path can leave a rank without heads: empty receive buffer.
    plan = HeadPlan(6, 2, 3, ((0, 3), (3, 3), (3, 6)), ((0, 1), (1, 1), (1, 2)))
    for rank in range(3):
        lay = Layout(plan, rank, (2, 3, 1), 2, 8)
        q, k, v = qkv(lay, torch.float32, "cpu", "fused")
        for with_recv in (False, True):
            (ref, got), (ref_r, got_r) = pack_both(lay, (q, k, v), QKV, CK, with_recv)
            assert torch.equal(ref, got) and torch.equal(ref_r, got_r)
        blocks = blocks_of(lay, QKV, torch.float32, "cpu", seed=rank)
        want, got = outs_of(lay, QKV, torch.float32, "cpu"), outs_of(lay, QKV, torch.float32, "cpu")
        L.unpack_h2s(lay, blocks, QKV, want)
        CK.unpack_h2s(lay, blocks, QKV, got)
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_unpack_of_head_chunks_leaves_other_heads():
    check_chunks(CK, "cpu")


# ---- NaN sums: the bits torch's add_ writes on the same device -----------------------------
# Per dtype: quiet, negative quiet, signaling (the add makes it quiet), odd payloads.
NAN_BITS = {
    torch.bfloat16: (0x7FC0, 0xFFC0, 0x7F81, 0xFFA5, 0x7FFF),
    torch.float16: (0x7E00, 0xFE00, 0x7D11, 0xFC01, 0x7FFF),
}
TORCH_CPU_VECTORIZED = torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512"))


def _i16(x: int) -> int:
    return x - 0x10000 if x >= 0x8000 else x


def _nan_case(dtype, device, world=4, d=64):
    """MQA over ``world`` ranks: each rank's [1, 2, 1, d] block of the one KV head is summed.
    Columns 0-4 hold NaN payloads in replica 0, 5-9 in replica 2; column 10 is inf + (-inf),
    11 (bf16 only) NaN in replicas 0 and 3 (which of two fp16 payloads an add keeps is the
    hardware's choice, see csrc/kernels/layout_math.h), 12 inf. d = 64: the reference's add_
    runs on whole rows of 64, all in torch's vector path on the CPU."""
    lay = Layout(HeadPlan.build(8, 1, world), 0, (2,) * world, 1, d)
    g = torch.Generator().manual_seed(5)
    blocks = [torch.randn(1, 2, 1, d, generator=g).to(dtype) for _ in range(world)]
    bits = [b.view(torch.int16) for b in blocks]
    for i, nan in enumerate(NAN_BITS[dtype]):
        bits[0][..., i] = _i16(nan)
        bits[2][..., 5 + i] = _i16(nan)
    blocks[1][..., 10], blocks[3][..., 10], blocks[0][..., 12] = float("inf"), float("-inf"), float("inf")
    if dtype == torch.bfloat16:
        bits[0][..., 11], bits[3][..., 11] = _i16(0x7FC0), _i16(0xFFA5)
    return lay, [[b.to(device)] for b in blocks]


def _unpack_nan_case(dtype, device):
    lay, blocks = _nan_case(dtype, device)
    (want,), (got,) = outs_of(lay, ("kv",), dtype, device), outs_of(lay, ("kv",), dtype, device)
    L.unpack_h2s(lay, blocks, ("kv",), [want])
    CK.unpack_h2s(lay, blocks, ("kv",), [got])
    nan = torch.isnan(want)
    assert int(nan.sum()) == 2 * (12 if dtype == torch.bfloat16 else 11)
    assert torch.equal(want.view(torch.int16), got.view(torch.int16))
    assert bool(torch.isinf(got[..., 12]).all())
    return got.view(torch.int16)[nan]


@pytest.mark.skipif(not TORCH_CPU_VECTORIZED, reason="torch's CPU add_ writes these NaN bits in its AVX2/AVX-512 kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unpack_nan_sums_match_torch_cpu_add(dtype):
    nan_bits = _unpack_nan_case(dtype, "cpu")
    if dtype == torch.bfloat16:
        assert bool((nan_bits == _i16(0xFFFF)).all())  # at::vec's cvtfp32_bf16
    else:  # F16C: the payload survives (quiet bit set), e.g. 0x7D11 -> 0x7F11
        assert {_i16(0x7F11), _i16(0xFE01)} <= set(nan_bits.tolist())


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_unpack_nan_sums_match_torch_cuda_add(dtype):
    nan_bits = _unpack_nan_case(dtype, "cuda")
    assert bool((nan_bits == 0x7FFF).all())  # cvt.rn.bf16.f32 / cvt.rn.f16.f32: canonical NaN


def test_auto_prefers_cuda_only_on_gpu_tensors():
    assert "cuda" in available_kernels()
    assert get_kernels("cuda", torch.device("cpu")).name == "cuda"
    assert get_kernels(None, torch.device("cpu")).name == "torch"


# ---- errors ---------------------------------------------------------------------------------
def test_errors_name_the_tensor():
    ops = torch.ops.ulysses_kernels
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
    send = torch.empty(2 * 3 * 6 * 8)
    with pytest.raises(RuntimeError, match=r"tensors\[1\]\.shape expected \[2, 3, \*, 8\].*got \[2, 4, 2, 8\]"):
        ops.pack_s2h([q, torch.randn(2, 4, 2, 8)], [0, 4, 0, 2], send)
    with pytest.raises(RuntimeError, match=r"send\.numel\(\) expected 288, got 10"):
        ops.pack_s2h([q, k], [0, 4, 0, 2], torch.empty(10))
    with pytest.raises(RuntimeError, match=r"tensors\[1\]\.dtype expected Float.*got Half"):
        ops.pack_s2h([q, k.half()], [0, 4, 0, 2], send)
    with pytest.raises(RuntimeError, match=r"head range of peer 0, tensors\[1\] expected within \[0, 2\], got \[0, 3\)"):
        ops.pack_s2h([q, k], [0, 4, 0, 3], send)
    with pytest.raises(RuntimeError, match=r"head_ranges expected"):
        ops.pack_s2h([q, k], [0, 4, 0], send)
    with pytest.raises(RuntimeError, match=r"pack_s2h: world_size expected at most 64, got 65"):
        ops.pack_s2h([q], [0, 1] * 65, send)
    with pytest.raises(RuntimeError, match=r"unpack_h2s: outs expected 1 to 3 tensors, got 4"):
        ops.unpack_h2s([q], [0, 4] * 4, [q] * 4)
    out = torch.empty(2, 3, 4, 8)
    with pytest.raises(RuntimeError, match=r"blocks\[1\] \(source 1, role 0\)\.shape expected \[2, 3, 2, 8\], got \[2, 3, 3, 8\]"):
        ops.unpack_h2s([torch.randn(2, 3, 2, 8), torch.randn(2, 3, 3, 8)], [0, 2, 2, 4], [out])
    with pytest.raises(RuntimeError, match=r"expected float32, float64, float16 or bfloat16 to sum replicated heads, got Int"):
        ops.unpack_h2s([torch.ones(2, 3, 2, 8, dtype=torch.int32)] * 2, [0, 2, 1, 3], [torch.empty(2, 3, 4, 8, dtype=torch.int32)])


def test_integer_dtypes_move_bit_exact_without_replicas():
    plan = HeadPlan.build(6, 6, 3)
    lay = Layout(plan, 1, (2, 1, 3), 2, 4)
    q = torch.randint(-(2**31), 2**31 - 1, (2, 1, 6, 4), dtype=torch.int32)
    (ref, got), _ = pack_both(lay, (q,), Q_ONLY, CK, with_recv=False)
    assert torch.equal(ref, got)


# ---- opcheck and torch.compile ------------------------------------------------------------
def _op_samples():
    plan = HeadPlan.build(10, 2, 4)
    lay = Layout(plan, 1, (3, 2, 4, 1), 2, 8)
    q, k, v = qkv(lay, torch.float32, "cpu", "fused")
    ranges = lay.head_ranges(QKV)
    send = torch.empty(sum(lay.s2h_send_splits(QKV)))
    send_peers = torch.empty(sum(lay.s2h_send_splits(QKV, own=False)))  # with recv: the peers' blocks only
    recv = torch.empty(sum(lay.s2h_recv_splits(QKV)))
    blocks = [b for per in blocks_of(lay, QKV, torch.float32, "cpu", seed=3) for b in per]
    outs = outs_of(lay, QKV, torch.float32, "cpu")
    local = torch.randn(10, 2, 3, 8).transpose(0, 1)
    ops = torch.ops.ulysses_kernels
    return [
        (ops.pack_s2h.default, ([q, k, v], ranges, send), {}),
        (ops.pack_s2h.default, ([q, k, v], ranges, send_peers, recv, 1, lay.seq_offset(1)), {}),
        (ops.pack_h2s.default, (local, torch.empty(local.numel())), {}),
        (ops.unpack_h2s.default, (blocks, ranges, outs), {}),
    ]


@pytest.mark.parametrize("index", range(4))
def test_opcheck(index):
    op, args, kwargs = _op_samples()[index]
    torch.library.opcheck(op, args, kwargs)


def test_torch_compile_fullgraph_pack():
    plan = HeadPlan.build(10, 2, 4)
    lay = Layout(plan, 2, (3, 2, 4, 1), 2, 8)

    def f(q, k, v):
        send = torch.empty(sum(lay.s2h_send_splits(QKV)), dtype=q.dtype)
        CK.pack_s2h(lay, (q, k, v), QKV, send)
        return send * 2

    q, k, v = qkv(lay, torch.float32, "cpu", "contiguous")
    send = torch.empty(sum(lay.s2h_send_splits(QKV)))
    L.pack_s2h(lay, (q, k, v), QKV, send)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(out, send * 2)


# ---- the kernel variant switch ---------------------------------------------------------------
def test_pack_variant_switch_reaches_the_extension():
    module = extension.load()
    previous = extension.set_pack_variant("new")
    try:
        assert extension.pack_variant() == "new" and module.pack_variant() == 1
        assert extension.kernel_variant("cuda") == "new" and extension.kernel_variant("triton") == "new"
        # "old" is a triton variant only: the cuda set falls back to "new".
        assert extension.set_pack_variant("old") == "new"
        assert extension.kernel_variant("cuda") == "new" and module.pack_variant() == 1
        assert extension.kernel_variant("triton") == "old"
    finally:
        extension.set_pack_variant(previous)
    assert extension.SET_VARIANTS["cuda"] == ("new",)  # "wide" lost on the H200 and was removed (issue 49)
    for name in ("wide", "fast"):
        with pytest.raises(ValueError, match=rf"set_pack_variant: name expected one of \['old', 'new'\], got '{name}'"):
            extension.set_pack_variant(name)
    assert extension.pack_variant() == previous  # unchanged by a refused name
    with pytest.raises(ValueError, match=r"_C.pack_variant: variant expected 1 \(new\), got 2"):
        module.pack_variant(2)  # 2 was the removed wide variant
    assert module.pack_variant() == 1


def test_pack_variant_env_is_read_once_and_checked(monkeypatch):
    monkeypatch.setattr(extension, "_VARIANT", {})
    monkeypatch.setenv("ULYSSES_KERNELS_PACK_VARIANT", "bogus")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_PACK_VARIANT='bogus'; expected one of"):
        extension.pack_variant()
    monkeypatch.setenv("ULYSSES_KERNELS_PACK_VARIANT", "Old")
    assert extension.pack_variant() == "old"
    monkeypatch.setenv("ULYSSES_KERNELS_PACK_VARIANT", "new")
    assert extension.pack_variant() == "old"  # read once
    monkeypatch.setattr(extension, "_VARIANT", {})
    monkeypatch.delenv("ULYSSES_KERNELS_PACK_VARIANT")
    assert extension.pack_variant() == extension.DEFAULT_PACK_VARIANT
    assert extension.DEFAULT_PACK_VARIANT in extension.SET_VARIANTS["cuda"]  # the default names a cuda variant
    monkeypatch.setattr(extension, "_VARIANT", {})
    monkeypatch.setenv("ULYSSES_KERNELS_PACK_VARIANT", "wide")  # removed (issue 49)
    with pytest.raises(ValueError, match=r"ULYSSES_KERNELS_PACK_VARIANT='wide'; expected one of \['old', 'new'\]"):
        extension.pack_variant()


# ---- end to end on gloo ranks: the "cuda" kernel set is bit-identical to "torch" -----------
def _ranks_cuda_vs_torch(rank, world):
    from ulysses_kernels import ulysses_attention
    from ulysses_kernels.comm import TorchCommunicator

    comm = TorchCommunicator()
    for hq, hkv, lens, batch, chunks, dtype in (
        (40, 8, (5, 2, 4), 2, 1, torch.float32),
        (9, 3, (3, 3, 2), 1, 1, torch.bfloat16),
        (12, 2, (4, 1, 3), 2, 2, torch.float16),
    ):
        g = torch.Generator().manual_seed(hq)
        S, off = sum(lens), sum(lens[:rank])
        full = [torch.randn(batch, S, h, 8, generator=g).to(dtype) for h in (hq, hkv, hkv)]
        dout = torch.randn(batch, S, hq, 8, generator=g).to(dtype)[:, off : off + lens[rank]]
        results = []
        for kernels in ("torch", "cuda"):
            leaves = [x[:, off : off + lens[rank]].clone().requires_grad_() for x in full]
            out = ulysses_attention(*leaves, seq_lens=lens, attn_fn="sdpa", comm=comm, kernels=kernels, chunks=chunks)
            out.backward(dout)
            results.append([out.detach()] + [x.grad for x in leaves])
        same = [torch.equal(a, b) for a, b in zip(*results)]
        assert all(same), f"rank {rank}: {hq}/{hkv} lens={lens} B={batch} chunks={chunks} {dtype}: out,dq,dk,dv equal={same}"


def test_attention_on_gloo_ranks_cuda_kernels_equal_torch():
    from ulysses_kernels.testing import run_ranks

    run_ranks(_ranks_cuda_vs_torch, 3)


def test_auto_passes_over_the_cuda_kernels_beyond_their_peer_limit(monkeypatch):
    import re
    from pathlib import Path

    from ulysses_kernels import extension
    from ulysses_kernels.kernels import KERNEL_SETS

    # A GPU that _C carries code for (no GPU is touched: the capability is faked); the C++
    # kernels have passed on a GPU (gpu_validated), so "auto" may pick them on CUDA.
    assert KERNEL_SETS["cuda"].gpu_validated
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    extension.load()  # first, so that the arch list faked next is not overwritten by it
    monkeypatch.setitem(extension._STATE, "archs", ("9.0",))

    MAX_WORLD_SIZE = extension.limits()["max_peers"]  # read from the C++ side
    header = (Path(__file__).resolve().parents[1] / "csrc" / "kernels" / "layout_math.h").read_text()
    assert int(re.search(r"constexpr int kMaxPeers = (\d+);", header).group(1)) == MAX_WORLD_SIZE
    assert int(re.search(r"constexpr int kMaxRoles = (\d+);", header).group(1)) == extension.limits()["max_roles"]
    cuda = torch.device("cuda")  # a device object only: no GPU is touched
    small = Layout(HeadPlan.build(128, 8, 8), 0, (1,) * 8, 1, 8)
    large = Layout(HeadPlan.build(128, 8, MAX_WORLD_SIZE + 1), 0, (1,) * (MAX_WORLD_SIZE + 1), 1, 8)
    assert get_kernels("auto", cuda, small).name == "cuda"
    assert get_kernels("auto", cuda, large).name != "cuda"


def test_auto_on_cuda_picks_only_sets_that_have_run_on_a_gpu(monkeypatch):
    """A kernel set that has never run on a GPU is never the default for CUDA tensors; it can
    still be named. The CPU default is unchanged."""
    import dataclasses

    from ulysses_kernels import extension
    from ulysses_kernels.kernels import KERNEL_SETS

    cuda = torch.device("cuda")  # a device object only: no GPU is touched
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    extension.load()  # first, so that the arch list faked next is not overwritten by it
    monkeypatch.setitem(extension._STATE, "archs", ("9.0",))
    lay = Layout(HeadPlan.build(8, 2, 2), 0, (4, 4), 1, 8)
    assert get_kernels(None, cuda, lay).name == "cuda"  # validated, and _C has sm_90 code
    # As if the C++ and Triton kernels had never run on a GPU: "auto" passes over both.
    for name in ("cuda", "triton"):
        monkeypatch.setitem(KERNEL_SETS, name, dataclasses.replace(KERNEL_SETS[name], gpu_validated=()))
    assert get_kernels("auto", cuda, lay).name == "torch"
    assert get_kernels("cuda", torch.device("cpu")).name == "cuda"  # naming it still works
    assert get_kernels("auto", torch.device("cpu"), lay).name == "torch"


# ---- the SASS of the built extension: 128-bit accesses (no GPU needed) ----------------------
def _cuobjdump():
    import os
    import shutil

    import triton

    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"), shutil.which("cuobjdump")]
    candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _sass_by_kernel(path: str, tool: str) -> dict[tuple[str, str], str]:
    """``{(arch, demangled-ish kernel name): SASS text}`` of every kernel in ``path``."""
    import re
    import subprocess

    res = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        pytest.skip(f"cuobjdump failed: {res.stderr[-300:]}")
    out, arch, name = {}, "", None
    for line in res.stdout.splitlines():
        m = re.search(r"arch = (sm_\d+)", line)
        if m:
            arch = m.group(1)
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = (arch, m.group(1))
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def test_sass_moves_16_bytes_per_access_in_both_kernels():
    # The 16-byte instantiations of the pack and unpack kernels (every sum type) load and
    # store 128 bits at a time (global LDG.E.128 / STG.E.128): docs/performance.md.
    pytest.importorskip("triton")
    tool = _cuobjdump()
    info = extension.build_info()
    if tool is None or not info.get("cuda"):
        pytest.skip("no cuobjdump, or the extension was built without CUDA (no SASS to read)")
    sass = _sass_by_kernel(extension.load().__file__, tool)
    archs = {a for a, _ in sass}
    # Every arch the build says it carries (CI: 8.0 and 9.0; a GPU machine: its own arch only).
    built = {"sm_" + a.split("+")[0].replace(".", "") for a in extension.cuda_archs()}
    assert built and built <= archs, (built, archs)
    # Mangled names: pack_kernel_new<16, I> is ...15pack_kernel_newILi16E..., unpack_kernel_new<Op, 16, I> ...ELi16E...
    picked = {
        "pack new": [k for k in sass if "15pack_kernel_newILi16E" in k[1]],
        "unpack new": [k for k in sass if "17unpack_kernel_newI" in k[1] and "ELi16E" in k[1]],
    }
    assert not [k for k in sass if "kernel_wide" in k[1]]  # the wide variant's code is gone (issue 49)
    for what, kernels in picked.items():
        assert len(kernels) >= 2 * len(built), (what, kernels)  # archs x 2 index widths (x 5 sum types for unpack)
        for key in kernels:  # global 128-bit accesses (LDG.E.128[.CONSTANT], STG.E.128)
            assert "LDG.E.128" in sass[key] and "STG.E.128" in sass[key], (what, key)
