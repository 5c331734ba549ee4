"""FP8 on the wire (``wire_dtype``, ``ulysses_kernels.wire``): the quantize-dequantize against
the formats' rounding bounds, each exchange against its definition (bit for bit) and its
bound at 2 and 4 gloo ranks, the whole op forward and backward against the attention dtype
on the wire, and the bytes the collectives carry."""

from __future__ import annotations

import pytest
import torch

import ulysses_kernels as uk
from ulysses_kernels.attention.exchange import a2a_head_to_seq, a2a_seq_to_head
from ulysses_kernels.comm import get_communicator
from ulysses_kernels.kernels.torch_kernels import TorchKernels, dequantize_rows, quantize_rows, wire_rows
from ulysses_kernels.layout import OUT, QKV, Layout
from ulysses_kernels.testing import run_ranks
from ulysses_kernels.traffic import WireCounter
from ulysses_kernels.wire import E4M3, E5M2, WireSpec, error_bound, resolve_wire, wire_bytes_ratio, wire_spec

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def qdq(x: torch.Tensor, fmt) -> torch.Tensor:
    """The quantize-dequantize of ``x`` (``[..., D]``) through one wire row per ``[D]``."""
    return dequantize_rows(wire_rows(x, fmt), fmt, x.dtype)


def _spread(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Values over many binades (rows of very different amax, elements far below their row's
    amax): the FP8 subnormals and the float32 scale are exercised, not only the normal range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x = x * torch.exp(3 * torch.randn(*shape[:-1], 1, generator=g, dtype=torch.float64))  # per row
    x = x * torch.exp(2 * torch.randn(*shape, generator=g, dtype=torch.float64))  # per element
    big = torch.finfo(dtype).max / 4  # float16: finite
    return x.clamp(-big, big).to(dtype)


# ---- the quantize-dequantize, rank-local -------------------------------------------------------
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_dequantize_within_the_format_bound(fmt, dtype):
    x = _spread(3, 50, 4, 24, seed=1, dtype=dtype)
    x[0, 0, 0] = 0  # an all-zero row: zeros back, a finite scale
    x[1, 2, 3, 5] = -x[1, 2, 3].abs().max() * 2  # a row's amax negative
    got = qdq(x, fmt)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got[0, 0, 0], torch.zeros_like(got[0, 0, 0]))
    err = (got.double() - x.double()).abs()
    bound = error_bound(x, fmt, dtype)
    assert (err <= bound).all(), f"{fmt} {dtype}: worst error / bound {(err / bound).max().item():.3f}"
    # The bound is not loose: some element comes near it. Its ceiling is 1 / (1 + 2^-(m+1)) (a
    # value halfway between two FP8 values errs by 2^-(m+1) of the smaller one): 0.941 for e4m3,
    # 0.889 for e5m2, both reached here.
    assert (err / bound).max() > 0.85
    # The format's relative rounding holds for elements within the format's normal range.
    rel = 2.0 ** -(fmt.mantissa_bits + 1)
    amax = x.double().abs().amax(-1, keepdim=True)
    normal = x.double().abs() * fmt.max / amax >= 2.0 ** (fmt.min_subnormal_exp + fmt.mantissa_bits)
    out_eps = torch.finfo(dtype).eps
    assert (err[normal] <= (rel + out_eps) * x.double().abs()[normal]).all()


def test_wire_row_layout_is_fp8_then_a_float32_scale():
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0]])
    buf = torch.empty(1, 8, dtype=torch.uint8)
    quantize_rows(x, buf, E4M3)
    assert buf[0, 4:].view(torch.float32).item() == pytest.approx(4.0 / 448.0, rel=1e-7)
    assert buf[0, :4].view(torch.float8_e4m3fn).float().tolist() == [112.0, -224.0, 56.0, 448.0]


def test_wire_spec_values():
    assert wire_spec(None) is None and wire_spec(WireSpec(None, None, None, None)) is None
    assert wire_spec("fp8") == WireSpec(E4M3, E4M3, E5M2, E5M2)
    assert WireSpec(qkv="e5m2", out=None).qkv is E5M2
    with pytest.raises(ValueError, match="wire_dtype='fp16'"):
        wire_spec("fp16")
    with pytest.raises(ValueError, match="qkv='e4m4'"):
        WireSpec(qkv="e4m4")
    assert wire_bytes_ratio(128, 2) == 0.515625 and wire_bytes_ratio(64, 2) == 0.53125


def test_one_rank_is_the_op_without_a_wire():
    q, k, v = (_spread(1, 12, h, 8, seed=s).requires_grad_() for s, h in ((1, 4), (2, 2), (3, 2)))
    a = uk.ulysses_attention(q, k, v, wire_dtype="fp8", kernels="torch")
    b = uk.ulysses_attention(q, k, v, kernels="torch")
    assert torch.equal(a, b)


def test_bad_wire_dtype_and_kernel_sets_are_refused_by_name():
    q = k = v = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="wire_dtype='int8'"):
        uk.ulysses_attention(q, k, v, wire_dtype="int8")
    with pytest.raises(ValueError, match="wire_dtype"):
        uk.UlyssesAttention(2, 2, wire_dtype="bf8")

    class NoFp8:  # a kernel set of the plain protocol only
        name = "nofp8"
        pack_s2h, pack_h2s, unpack_h2s = TorchKernels.pack_s2h, TorchKernels.pack_h2s, TorchKernels.unpack_h2s

    with pytest.raises(ValueError, match="kernels='nofp8' lacks quant_pack_s2h, quant_pack_h2s"):
        resolve_wire("fp8", NoFp8(), world_size=2)
    assert resolve_wire("fp8", TorchKernels(), world_size=2) == WireSpec()  # inside torch.compile too: test_compile


# ---- each exchange at 2 and 4 ranks -----------------------------------------------------------
def _local_of(source: int, shape, dtype, salt: int) -> torch.Tensor:
    """Source rank ``source``'s head-sharded tensor: every rank can make every source's."""
    return _spread(*shape, seed=1000 * salt + source, dtype=dtype)


def _exchanges(rank, world, hq, hkv, B, seq_lens, D, Dv, dtype):
    comm = get_communicator(None)
    plan = uk.HeadPlan.build(hq, hkv, world)
    lay = Layout(plan, rank, tuple(seq_lens), B, D, Dv)
    S, off, s_r = sum(seq_lens), sum(seq_lens[:rank]), seq_lens[rank]
    glob = [_spread(B, S, h, d, seed=s, dtype=dtype) for s, h, d in ((11, hq, D), (12, hkv, D), (13, hkv, Dv))]
    shards = [x[:, off : off + s_r] for x in glob]
    for fmt in (E4M3, E5M2):
        # q/k/v (and d_out) to heads: the moved rows, each quantized and dequantized once.
        plain = a2a_seq_to_head(lay, shards, QKV, comm, TorchKernels)
        got = a2a_seq_to_head(lay, shards, QKV, comm, TorchKernels, wire=fmt)
        for p, g in zip(plain, got):
            assert g.dtype == dtype and torch.equal(g, qdq(p, fmt))
            assert ((g.double() - p.double()).abs() <= error_bound(p, fmt, dtype)).all()
        # The output (and dq) back: query heads, no replica.
        hq_l = lay.head_count("o", rank)
        local = _local_of(rank, (B, S, hq_l, Dv), dtype, 1)
        (plain,) = a2a_head_to_seq(lay, [local], OUT, comm, TorchKernels)
        (got,) = a2a_head_to_seq(lay, [local], OUT, comm, TorchKernels, wire=fmt)
        assert torch.equal(got, qdq(plain, fmt))
        assert ((got.double() - plain.double()).abs() <= error_bound(plain, fmt, dtype)).all()
        # dq/dk/dv back: replicated KV heads are dequantized per source, then summed in rank order.
        locals_ = [_local_of(rank, (B, S, lay.head_count(r, rank), lay.dim(r)), dtype, 2 + i) for i, r in enumerate(QKV)]
        plain = a2a_head_to_seq(lay, locals_, QKV, comm, TorchKernels)
        got = a2a_head_to_seq(lay, locals_, QKV, comm, TorchKernels, wire=fmt)
        for i, (r, g, p) in enumerate(zip(QKV, got, plain)):
            want = torch.empty_like(g)
            bound = torch.zeros(g.shape, dtype=torch.float64)
            filled = 0
            for src in range(world):
                a, b = lay.head_range(r, src)
                rows = _local_of(src, (B, S, b - a, lay.dim(r)), dtype, 2 + i)[:, off : off + s_r]
                bound[:, :, a:b] += error_bound(rows, fmt, dtype)
                for h in range(a, b):
                    part = qdq(rows[:, :, h - a], fmt)
                    if h < filled:
                        want[:, :, h].add_(part)
                    else:
                        want[:, :, h].copy_(part)
                filled = max(filled, b)
            assert torch.equal(g, want), (fmt, r)
            exact = p.double()  # the sum of the unrounded replicas, rounded once per add as the plain unpack does
            slack = 2 * torch.finfo(dtype).eps * exact.abs()
            assert ((g.double() - exact).abs() <= bound + slack).all(), (fmt, r)


def _exchange_body(rank, world):
    torch.set_num_threads(1)
    # Uneven shards; GQA with replicated KV heads at 4 ranks (2 KV heads over 4 ranks);
    # batch 2 (grouped send/recv); MLA (v's head dim not q's); head dims not a multiple of 4
    # (the scale is then read unaligned).
    cases = [(4, 2, 1, [5, 3, 4, 4][:world], 8, 8), (8, 2, 2, [3, 4, 2, 5][:world], 16, 12), (6, 6, 1, [4] * world, 6, 10)]
    for hq, hkv, B, seq_lens, D, Dv in cases:
        for dtype in (torch.float32, torch.bfloat16):
            _exchanges(rank, world, hq, hkv, B, seq_lens, D, Dv, dtype)


@pytest.mark.parametrize("world", [2, 4])
def test_each_exchange_is_its_definition_and_within_the_bound(world):
    run_ranks(_exchange_body, world)


# ---- the whole op at 2 and 4 ranks -----------------------------------------------------------
CountingComm = WireCounter  # the group's communicator, counting the bytes each collective puts on the wire


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _step(q, k, v, dout, **kw):
    """One forward+backward: ``(out, dq, dk, dv)``."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    kw.setdefault("kernels", "torch")
    out = uk.ulysses_attention(q, k, v, attn_fn="sdpa", check=False, **kw)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


# NOTE: measured relative (Frobenius) errors of the op with wire_dtype="fp8" against the same op
# without (float32, random normal inputs, the cases and packed documents below, every rank of 2
# and 4): out <= 0.044, dq <= 0.086, dk <= 0.099, dv <= 0.083 (2026-11-29). The tolerances are
# those maxima rounded up to the next 0.01, plus 0.01. The scale of what to expect: a uniform
# rounding error of up to 2^-4 (e4m3) or 2^-3 (e5m2) of each element has an RMS of 2^-4/sqrt(3)
# = 0.036 or 0.072 of the values; the output carries two e4m3 exchanges (q/k/v, out), the
# gradients two e5m2 ones (d_out, dq/dk/dv) and the forward's.
OP_TOL = {"out": 0.06, "dq": 0.10, "dk": 0.11, "dv": 0.10}


def _op_body(rank, world):
    torch.set_num_threads(1)
    base = get_communicator(None)
    cases = [(4, 2, 1, [5, 3, 4, 4][:world], 8, 8), (8, 2, 2, [3, 4, 2, 5][:world], 16, 12)]
    for hq, hkv, B, seq_lens, D, Dv in cases:
        S, off, s_r = sum(seq_lens), sum(seq_lens[:rank]), seq_lens[rank]
        g = [_spread(B, S, h, d, seed=s) for s, h, d in ((21, hq, D), (22, hkv, D), (23, hkv, Dv), (24, hq, Dv))]
        q, k, v, dout = (torch.randn(x.shape, generator=torch.Generator().manual_seed(i))[:, off : off + s_r] for i, x in enumerate(g))
        plain = _step(q, k, v, dout, seq_lens=seq_lens)
        fp8 = _step(q, k, v, dout, seq_lens=seq_lens, wire_dtype="fp8")
        errs = dict(zip(OP_TOL, (_rel(a, b) for a, b in zip(fp8, plain))))
        for name, e in errs.items():
            assert 0 < e <= OP_TOL[name], (name, e)
        # Chunks: the chunked schedule moves the same rows through the same formats, bit for bit.
        assert all(torch.equal(a, b) for a, b in zip(_step(q, k, v, dout, seq_lens=seq_lens, wire_dtype="fp8", chunks=2), fp8))
        # The module, with a spec: the same call.
        mod = uk.UlyssesAttention(hq, hkv, kernels="torch", attn_fn="sdpa", check="never", wire_dtype=WireSpec())
        qm, km, vm = (x.detach().clone().requires_grad_() for x in (q, k, v))
        om = mod(qm, km, vm, seq_lens=seq_lens)
        om.backward(dout)
        assert all(torch.equal(a, b) for a, b in zip((om.detach(), qm.grad, km.grad, vm.grad), fp8))
        # A spec without formats is the op without a wire, bit for bit.
        none = _step(q, k, v, dout, seq_lens=seq_lens, wire_dtype=WireSpec(None, None, None, None))
        assert all(torch.equal(a, b) for a, b in zip(none, plain))

    # Bytes on the wire, per exchange (forward: q/k/v, out; backward: d_out, dq/dk/dv), bf16.
    hq, hkv, D = 4, 2, 8
    q, k, v, dout = (torch.randn(1, 6, h, D, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
    counts = {}
    for name, wd in (("bf16", None), ("fp8", "fp8"), ("qkv", WireSpec(qkv=E4M3, out=None, dout=None, grads=None)),
                     ("grads", WireSpec(qkv=None, out=None, dout=None, grads=E5M2))):  # fmt: skip
        comm = CountingComm(base)
        _step(q, k, v, dout, wire_dtype=wd, comm=comm)
        counts[name] = comm.sent
    assert len(counts["bf16"]) == 4 and min(counts["bf16"]) > 0
    ratio = wire_bytes_ratio(D, 2)  # (D + 4) / (2 D): 0.75 at D = 8, 0.515625 at D = 128
    assert counts["fp8"] == [n * ratio for n in counts["bf16"]]
    assert counts["qkv"] == [counts["fp8"][0], *counts["bf16"][1:]]
    assert counts["grads"] == [*counts["bf16"][:3], counts["fp8"][3]]

    # Packed documents (batch 1, global boundaries crossing the shards).
    S = 8 * world
    cu = [0, 3, S // 2 + 1, S]
    q, k, v, dout = (torch.randn(1, 8, h, D, generator=torch.Generator().manual_seed(40 + rank + 10 * i)) for i, h in enumerate((4, 2, 2, 4)))
    plain = _step(q, k, v, dout, cu_seqlens=cu)
    fp8 = _step(q, k, v, dout, cu_seqlens=cu, wire_dtype="fp8")
    for name, a, b in zip(OP_TOL, fp8, plain):
        assert 0 < _rel(a, b) <= OP_TOL[name], (name, _rel(a, b))
    assert all(torch.equal(a, b) for a, b in zip(_step(q, k, v, dout, cu_seqlens=cu, wire_dtype="fp8", chunks=2), fp8))


@pytest.mark.parametrize("world", [2, 4])
def test_op_fwd_bwd_against_the_plain_wire_chunks_documents_and_bytes(world):
    run_ranks(_op_body, world)


def _kernel_sets_body(rank, world, names):
    torch.set_num_threads(1)
    hq, hkv, B, seq_lens, D, Dv = 4, 2, 2, [3, 5, 2, 4][:world], 8, 6
    S, off, s_r = sum(seq_lens), sum(seq_lens[:rank]), seq_lens[rank]
    q, k, v, dout = (torch.randn(B, S, h, d, generator=torch.Generator().manual_seed(i))[:, off : off + s_r].to(torch.bfloat16)
                     for i, (h, d) in enumerate(((hq, D), (hkv, D), (hkv, Dv), (hq, Dv))))  # fmt: skip
    want = _step(q, k, v, dout, seq_lens=seq_lens, wire_dtype="fp8")
    for name in names:
        for chunks in (1, 2):
            got = _step(q, k, v, dout, seq_lens=seq_lens, wire_dtype="fp8", kernels=name, chunks=chunks)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (name, chunks)


@pytest.mark.parametrize("world", [2, 4])
def test_the_op_with_each_kernel_set_equals_the_torch_set(world):
    from ulysses_kernels.kernels import available_kernels

    names = [n for n in ("triton", "cuda") if n in available_kernels()]
    if not names:
        pytest.skip("neither the Triton nor the C++ kernel set runs here")
    run_ranks(_kernel_sets_body, world, names)
