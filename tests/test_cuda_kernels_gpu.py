"""The "cuda" kernel set's CUDA kernels on a GPU: against the CPU twin (the same index math,
csrc/kernels/layout_math.h), bit for bit, on the cases of cuda_cases.py; CUDA graphs;
attention at world size 1. Skipped without a GPU."""

import pytest
import torch
from cuda_cases import CASES, blocks_of, check_chunks, layout_of, outs_of, pack_both, qkv

from ulysses_kernels.kernels import available_kernels, get_kernels
from ulysses_kernels.kernels import torch_kernels as L
from ulysses_kernels.layout import OUT, Q_ONLY, QKV, Layout
from ulysses_kernels.plan import HeadPlan

cuda_kernels = pytest.importorskip("ulysses_kernels.kernels.cuda_kernels")
pytestmark = pytest.mark.skipif(not cuda_kernels.CudaKernels.available(), reason="ulysses_kernels._C is not built")
CK = cuda_kernels.CudaKernels
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---- GPU: CUDA kernels against the CPU twin ------------------------------------------------
@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["contiguous", "fused", "strided"])
@pytest.mark.parametrize("plan,rank,batch,d,dtype", CASES)
def test_gpu_pack_matches_cpu_twin(plan, rank, batch, d, dtype, kind):
    lay = layout_of(plan, rank, batch, d)
    cpu = qkv(lay, dtype, "cpu", kind)
    gpu = qkv(lay, dtype, "cuda", kind)
    for roles, n in ((QKV, 3), (Q_ONLY, 1)):
        for with_recv in (False, True):
            (_, want), (_, want_r) = pack_both(lay, cpu[:n], roles, CK, with_recv)
            (ref, got), (ref_r, got_r) = pack_both(lay, gpu[:n], roles, CK, with_recv)
            assert torch.equal(got.cpu(), want) and torch.equal(got_r.cpu(), want_r)
            assert torch.equal(ref, got) and torch.equal(ref_r, got_r)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("plan,rank,batch,d,dtype", CASES)
def test_gpu_unpack_matches_cpu_twin(plan, rank, batch, d, dtype):
    lay = layout_of(plan, rank, batch, d)
    for roles in (QKV, Q_ONLY):
        seed = plan.q_heads + 7 * rank
        want = outs_of(lay, roles, dtype, "cpu")
        CK.unpack_h2s(lay, blocks_of(lay, roles, dtype, "cpu", seed), roles, want)
        got = outs_of(lay, roles, dtype, "cuda")
        CK.unpack_h2s(lay, blocks_of(lay, roles, dtype, "cuda", seed), roles, got)
        for a, b in zip(want, got):
            assert torch.equal(a, b.cpu())


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype", [(8, torch.bfloat16), (72, torch.bfloat16), (1, torch.float32), (600, torch.float32)])
def test_gpu_pack_row_lengths(d, dtype):
    # The 2-D pack launch at 1 unit per row (256 rows per block), 9, and 600 units (more
    # than the block's 256 threads: each lane loops); contiguous and strided sources.
    lay = Layout(HeadPlan.build(10, 2, 4), 1, (33, 17, 40, 5), 2, d)
    for kind in ("contiguous", "strided"):
        q, k, v = qkv(lay, dtype, "cuda", kind)
        for with_recv in (False, True):
            (ref, got), (ref_r, got_r) = pack_both(lay, (q, k, v), QKV, CK, with_recv)
            assert torch.equal(ref, got) and torch.equal(ref_r, got_r), (kind, with_recv)


@needs_gpu
@pytest.mark.gpu
def test_gpu_unpack_of_head_chunks_leaves_other_heads():
    check_chunks(CK, "cuda")


@needs_gpu
@pytest.mark.gpu
def test_gpu_large_pack_uses_vector_path_and_matches():
    plan = HeadPlan.build(40, 8, 8)
    lay = Layout(plan, 3, (4096,) * 8, 2, 128)
    q, k, v = qkv(lay, torch.bfloat16, "cuda", "fused")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        (ref, got), (ref_r, got_r) = pack_both(lay, (q, k, v), QKV, CK, with_recv=True)
        torch.cuda.synchronize()
    assert torch.equal(ref, got) and torch.equal(ref_r, got_r)
    # The 16-byte path was taken: pack_kernel_new<16, I>, and no narrower instantiation
    # (aligned bf16 rows of 128 elements, 256 bytes each).
    packs = {e.name for e in prof.events() if "pack_kernel" in e.name and "unpack" not in e.name}
    assert packs and all("pack_kernel_new<16" in n for n in packs), packs


@needs_gpu
@pytest.mark.gpu
def test_gpu_new_unpack_is_one_launch_for_qkv():
    # q, k and v unpack in one kernel launch (the removed old variant launched per role).
    lay = Layout(HeadPlan.build(40, 8, 8), 3, (64,) * 8, 1, 128)
    blocks, outs = blocks_of(lay, QKV, torch.bfloat16, "cuda", 2), outs_of(lay, QKV, torch.bfloat16, "cuda")
    CK.unpack_h2s(lay, blocks, QKV, outs)  # warm-up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        CK.unpack_h2s(lay, blocks, QKV, outs)
        torch.cuda.synchronize()
    launches = [e.name for e in prof.events() if "unpack_kernel" in e.name]
    assert len(launches) == 1 and "unpack_kernel_new<" in launches[0], launches


class _LoopbackComm:
    """Rank 0 of ``world``, one process: each collective copies what it sends, piece by piece,
    into what it receives (as far as sizes allow; the rest zeroed). A deterministic stand-in
    for the transport, so that an eager and a replayed layer can be compared bit for bit."""

    def __init__(self, world):
        self.rank, self.world_size = 0, world

    @staticmethod
    def _move(dst, src):
        dst.zero_()
        n = min(dst.numel(), src.numel())
        dst.view(-1)[:n].copy_(src.reshape(-1)[:n])

    def all_to_all(self, output, input, output_splits, input_splits, async_op=False):
        self._move(output, input)

    def send_recv(self, sends, recvs, async_op=False):
        for (_, src), (_, dst) in zip(sends, recvs):
            self._move(dst, src)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
def test_gpu_layer_exchanges_capture_in_cuda_graph(batch):
    # One layer's four exchanges (q/k/v and the output forward, dout and dq/dk/dv backward),
    # the eager movers with the "cuda" set, captured in one CUDA graph: no host sync, no
    # host-side value anywhere; a replay on new inputs equals an eager run bit for bit.
    from ulysses_kernels.attention.exchange import a2a_head_to_seq, a2a_seq_to_head

    lay = Layout(HeadPlan.build(32, 8, 8), 0, (64,) * 8, batch, 128)
    comm, dev, dt = _LoopbackComm(8), "cuda", torch.bfloat16
    q, k, v = (torch.randn(batch, 64, h, 128, device=dev, dtype=dt) for h in (32, 8, 8))
    local = [torch.randn(batch, 512, lay.head_count(r, 0), 128, device=dev, dtype=dt) for r in ("q", "kv", "kv")]

    def layer():
        fwd = a2a_seq_to_head(lay, (q, k, v), QKV, comm, CK) + a2a_head_to_seq(lay, [local[0]], OUT, comm, CK)
        bwd = a2a_seq_to_head(lay, [q], OUT, comm, CK) + a2a_head_to_seq(lay, local, QKV, comm, CK)
        return fwd + bwd

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()  # warm-up: every kernel loaded, the grid sizes cached
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer()
    for x in (q, k, v, *local):
        x.copy_(torch.randn_like(x))
    graph.replay()
    want = layer()
    torch.cuda.synchronize()
    assert len(captured) == len(want) == 8
    for a, b in zip(captured, want):
        assert torch.equal(a, b)


@needs_gpu
@pytest.mark.gpu
def test_gpu_pack_unpack_capture_in_cuda_graph():
    # Role-ordered with no host sync: a captured pack/unpack replays on new inputs.
    plan = HeadPlan.build(40, 8, 3)
    lay = Layout(plan, 1, (64, 48, 80), 2, 64)
    q, k, v = qkv(lay, torch.bfloat16, "cuda", "fused")
    send = torch.empty(sum(lay.s2h_send_splits(QKV)), device="cuda", dtype=torch.bfloat16)
    blocks = blocks_of(lay, QKV, torch.bfloat16, "cuda", seed=1)
    outs = outs_of(lay, QKV, torch.bfloat16, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph: every kernel loaded once
        CK.pack_s2h(lay, (q, k, v), QKV, send)
        CK.unpack_h2s(lay, blocks, QKV, outs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        CK.pack_s2h(lay, (q, k, v), QKV, send)
        CK.unpack_h2s(lay, blocks, QKV, outs)
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    for per_source in blocks:
        for b in per_source:
            b.copy_(torch.randn_like(b))
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.empty_like(send)
    L.pack_s2h(lay, (q, k, v), QKV, ref)
    assert torch.equal(send, ref)
    want = outs_of(lay, QKV, torch.bfloat16, "cuda")
    L.unpack_h2s(lay, blocks, QKV, want)
    assert all(torch.equal(a, b) for a, b in zip(want, outs))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_attention_world_size_1(dtype):
    from ulysses_kernels import ulysses_attention

    torch.manual_seed(0)
    q = torch.randn(2, 64, 8, 64, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 64, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 64, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
    outs, grads = [], []
    for kernels in ("cuda", "torch"):
        out = ulysses_attention(q, k, v, kernels=kernels, attn_fn="sdpa")
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    assert torch.equal(outs[0], outs[1])  # same bytes into the same attention kernel
    for a, b in zip(*grads):
        # The attention backward may accumulate dq with atomics: allow its rounding noise.
        torch.testing.assert_close(a, b)
    # "auto" is the C++ kernels on a GPU whose architecture _C carries code for (it was built
    # here for this GPU's arch), once their GPU run is recorded (gpu_validated).
    from ulysses_kernels import extension
    from ulysses_kernels.kernels import KERNEL_SETS

    assert KERNEL_SETS["cuda"].gpu_validated
    fits = extension.arch_code_for(torch.cuda.get_device_capability(q.device)) is not None
    assert get_kernels(None, q.device).name == ("cuda" if fits else "triton" if "triton" in available_kernels() else "torch")
