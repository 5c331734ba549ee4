"""The attention layer: forward, backward and forward+backward time, TFLOP/s and peak memory.

    torchrun --nproc-per-node 8 -m ulysses_kernels.bench.attention --min-seq 4K --max-seq 1M
    python -m ulysses_kernels.bench.attention --sp 8 --min-seq 4K --max-seq 1M   # one GPU, rank 0 of 8
    python -m ulysses_kernels.bench.attention --spawn 2 --layouts 8/2 --seqs 64,128 --head-dim 16  # CPU

Head layouts (``--models``): Llama-3-8B (32 query / 8 KV heads), Qwen2.5-14B (40/8),
Llama-3-70B (64/8), head_dim 128, or any ``--layouts Hq/Hkv,...``. Sequence lengths double
from ``--min-seq`` to ``--max-seq`` (global tokens, batch ``--batch``); a size whose estimated
memory does not fit is skipped, and a method that runs out of memory stops there.

Methods (``--methods``, default all that can run):

  local        the compute floor: this rank's heads (HeadPlan) over the full sequence,
               the same attention backend as ours, no communication and no layout work
  chain        ``baselines.permute_chain_attention`` (DeepSpeed/yunchang's three permutes),
               when the query heads divide over the ranks
  ulysses-<k>  ``ulysses_attention`` with kernel set <k> (torch, triton, cuda; on a CPU,
               cuda is the C++ extension's CPU twin)
  deepspeed    ``deepspeed.sequence.layer.DistributedAttention`` when importable
  yunchang     ``yunchang.UlyssesAttention`` when importable
  hybrid-UxR   ``ulysses_attention`` on a 2-D group ``make_sp_groups(U, R)`` (Ulysses over U
               contiguous ranks, ring attention over R; contiguous shards, the torch kernel
               set); with real ranks, one row per split of the world (U*R = world)
  packed-<k>    ``ulysses_attention`` on one packed sequence (batch 1) of documents with a
               realistic length mix (``packed_documents``: log-normal, median 512 tokens,
               from 16 tokens up to half the sequence), block-diagonal causal attention
  equal-<k>     the same tokens as the same number of equal-length documents: what a batch
               of equal-length sequences computes (``x_equal`` = packed / equal time)
  packed-hybrid-UxR[-zigzag]
               the packed rows' documents on the 2-D group ``make_sp_groups(U, R)``, contiguous
               or zigzag shards (real ranks, U*R = world): columns ``steps`` (ring steps that
               compute, of R*R) and ``hops`` (K/V block transfers per forward, of R*(R-1))
               say what the ring schedule skipped (``ring.schedule``); compare the time with
               ``hybrid-UxR`` (the same tokens unpacked) and ``packed-<k>`` (the flat group)
  local-packed the compute floor of the packed rows (this rank's heads, all rows, no
               communication), on the packed-documents kernel the chooser picks
               (``backends.packed_kernel``; column ``backend``: ``<backend>+<kernel>``)
  local-packed-<kernel>
               the same on one packed-documents kernel (``packed.KERNELS``: flash, varlen,
               flex, loop), by default every one that runs here besides the pick and flex
               (named only: its first call compiles FlexAttention; that time, ``first_s``, is
               printed and kept out of the timing)
  layout-<k>   ours, data movement only: the packs/unpacks of one layer without the
               collectives (fwd: q/k/v pack + output unpack; bwd: dout pack + dq/dk/dv unpack)
  chain-layout the chain's permute copies without the collectives

With one process and ``--sp P`` the local and layout rows are those of rank 0 of a ``P``-way
group (the input of ``ulysses_kernels.bench.perf_model``); the communicating methods need real ranks.

TFLOP/s: causal attention FLOPs of this rank's heads, 4*B*S^2*h*D/2 forward (packed and
equal rows: 4*h*D*sum(L_i^2)/2 over their documents, column ``docs``), 2.5x that
backward, 3.5x forward+backward (the FlashAttention convention), over the time of the
slowest rank. ``x_chain`` = chain time / this time (speed-up over the chain, same run);
``x_floor`` = this time / local time (packed rows: / local-packed's). ``x_dense`` (packed
rows) = this row's TFLOP/s / local's: the packed kernel's speed against the same tokens
unpacked (the goal of issue 37: local-packed >= 0.5 at S >= 32K on a GPU). #wrong: elements of the output and of dq, on a sample
of rows on every rank, outside the dtype's tolerance against a float32 reference computed
from the same inputs; for the layout rows, elements of every buffer they write that differ
bit for bit from the pure-PyTorch reference (``ulysses_kernels.layout`` pack/unpack; for
chain-layout, the slicing its copies amount to without the collective). Breakdown rows
(per kernel set): compute = local, layout = layout-<k>, exposed communication =
ulysses-<k> - local - layout-<k>.
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ulysses_kernels import extension, make_sp_groups, ulysses_attention
from ulysses_kernels.backends import doc_kwargs, for_rank, packed_kernel, resolve_backend
from ulysses_kernels.baselines import permute_chain_attention
from ulysses_kernels.bench import common as C
from ulysses_kernels.documents import Documents, documents
from ulysses_kernels.kernels import available_kernels, get_kernels
from ulysses_kernels.kernels import torch_kernels as L
from ulysses_kernels.layout import Q_ONLY, QKV, Layout
from ulysses_kernels.math_attention import default_scale
from ulysses_kernels.packed import KERNELS, DocMask
from ulysses_kernels.plan import HeadPlan
from ulysses_kernels.ring import shard_rows
from ulysses_kernels.ring.schedule import ring_schedule

warnings.filterwarnings("ignore", message=r".*all_to_all_single is deprecated", category=FutureWarning)

MODELS = C.MODELS
PASSES = ("fwd", "bwd", "fwdbwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
# (rtol, atol relative to the largest reference value) per dtype for the sampled-row check.
TOLERANCE = {torch.float64: (1e-7, 1e-7), torch.float32: (1e-3, 1e-3), torch.bfloat16: (3e-2, 3e-2), torch.float16: (1e-2, 1e-2)}
COMM_METHODS = ("chain", "deepspeed", "yunchang")


class Skip(Exception):
    """This method cannot run here (message says why)."""


# ---- inputs ------------------------------------------------------------------------------
class Inputs:
    """Random q, k, v, dout of one run, reproducible block by block on every rank.

    The global tensors are ``[B, S, H, D]``; the rows of rank ``p`` (``s = S/P`` tokens) come
    from a generator seeded with ``(seed, p, tensor)``, so any rank can rebuild any block
    (the local floor needs every row of its heads; the check needs all of k and v).
    """

    def __init__(self, batch, seq_total, heads, kv_heads, head_dim, world, dtype, device, seed=1234):
        self.B, self.S, self.H, self.Hkv, self.D = batch, seq_total, heads, kv_heads, head_dim
        self.P, self.s = world, seq_total // world
        self.dtype, self.device, self.seed = dtype, device, seed

    def block(self, p: int, name: str) -> torch.Tensor:
        which = "qkvo".index(name[0] if name != "dout" else "o")
        heads = self.H if name in ("q", "dout") else self.Hkv
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1000 + p * 10 + which)
        x = torch.randn(self.B, self.s, heads, self.D, generator=g, device=self.device, dtype=torch.float32)
        return x.to(self.dtype)

    def full(self, name: str, heads) -> torch.Tensor:
        """All rows, the given global heads: ``[B, S, len(heads), D]``."""
        idx = list(heads)
        return torch.cat([self.block(p, name)[:, :, idx] for p in range(self.P)], dim=1)


def sample_rows(n_rows: int, count: int) -> list[int]:
    """Up to ``count`` row indices spread over ``range(n_rows)``, first and last included."""
    if n_rows <= count:
        return list(range(n_rows))
    return sorted({round(i * (n_rows - 1) / (count - 1)) for i in range(count)})


def reference_rows(inp: Inputs, rows, heads, scale, k_full, v_full, docs=None):
    """float32 causal attention output and dq for global ``rows`` x global query ``heads``
    (with ``docs``: within each document only)."""
    g = inp.H // inp.Hkv
    rows_t = torch.tensor(rows, device=inp.device)
    per_block = {}
    for t in rows:
        per_block.setdefault(t // inp.s, []).append(t)
    q_rows = torch.cat([inp.block(p, "q")[:, [t - p * inp.s for t in ts]] for p, ts in sorted(per_block.items())], 1)
    do_rows = torch.cat([inp.block(p, "dout")[:, [t - p * inp.s for t in ts]] for p, ts in sorted(per_block.items())], 1)
    cols = torch.arange(inp.S, device=inp.device)
    mask = cols.view(1, -1) > rows_t.view(-1, 1)  # [n, S] causal
    if docs is not None:
        doc = torch.bucketize(cols, torch.tensor(docs.cu_seqlens[1:-1], device=inp.device), right=True)
        mask |= doc.view(1, -1) != doc[rows_t].view(-1, 1)  # other documents
    outs, dqs = [], []
    for h in heads:
        kk = k_full[:, :, h // g].float()  # [B, S, D]
        vv = v_full[:, :, h // g].float()
        qh, doh = q_rows[:, :, h].float(), do_rows[:, :, h].float()  # [B, n, D]
        p = torch.softmax((qh @ kk.transpose(1, 2) * scale).masked_fill(mask, float("-inf")), dim=-1)
        o = p @ vv
        dp = doh @ vv.transpose(1, 2)
        ds = p * (dp - (doh * o).sum(-1, keepdim=True))
        outs.append(o)
        dqs.append(ds @ kk * scale)
    return torch.stack(outs, 2), torch.stack(dqs, 2)  # [B, n, h, D]


def count_wrong(actual: torch.Tensor, ref: torch.Tensor, dtype) -> int:
    rtol, atol = TOLERANCE.get(dtype, (3e-2, 3e-2))
    a = actual.float()
    bound = atol * max(1.0, float(ref.abs().max())) + rtol * ref.abs()
    return int(((a - ref).abs() > bound).sum().item()) + int((~torch.isfinite(a)).sum().item())


# ---- one method: build, run, time ------------------------------------------------------------
class Method:
    """A callable ``forward(q, k, v) -> out`` with autograd, plus what it needs to check itself.

    ``seq_sharded``: inputs are this rank's rows for all heads (ours, chain, peers); else
    (``local``) the rank's heads over all rows. ``layout_only`` methods expose ``fwd()`` and
    ``bwd()`` instead, and ``check_layout()``: one more fwd+bwd whose buffers are compared bit
    for bit with the pure-PyTorch reference (elements that differ, on this rank).
    """

    def __init__(self, name, fn=None, seq_sharded=True, layout_only=False, fwd=None, bwd=None, check=None, docs=None, rows=None,
                 ring=None, backend=None):  # fmt: skip
        self.name, self.fn, self.seq_sharded, self.layout_only = name, fn, seq_sharded, layout_only
        self.fwd_only, self.bwd_only, self.check_layout = fwd, bwd, check
        self.docs = docs  # packed rows: the documents (``Documents``) the method attends within
        self.rows = rows  # the global positions this rank's inputs hold (None: the contiguous shard)
        self.ring = ring  # 2-D packed rows: the ``RingSchedule`` of the call (what it skips)
        self.backend = backend  # the backend column when not the group's (packed rows: "<backend>+<kernel>")
        self.first_s = None  # FlexAttention rows: the first fwd+bwd (its compilation), untimed


def local_method(plan, rank, backend, scale, name="local", docs=None):
    kv_map = plan.local_kv_map(rank)

    class _Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, state = backend.forward(q, k, v, causal=True, scale=scale, kv_map=kv_map, needs_grad=True, **doc_kwargs(docs))
            ctx.state = state
            return out

        @staticmethod
        def backward(ctx, dout):
            grads = backend.backward(ctx.state, dout)
            ctx.state = None
            return tuple(grads)

    return Method(name, lambda q, k, v: _Local.apply(q, k, v), seq_sharded=False, docs=docs)


def packed_documents(S: int, seed: int = 0) -> Documents:
    """A realistic document-length mix over ``S`` tokens (SFT-like: many short documents,
    a few long ones): lengths log-normal with median 512 and sigma 1, clipped to
    ``[16, S // 2]``, the last one cut to fit. The same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < S:
        n = int(torch.empty(1).log_normal_(mean=6.238, std=1.0, generator=g).clamp(16, max(16, S // 2)))  # e^6.238 = 512
        lens.append(min(n, S - sum(lens)))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return documents(cu)


def equal_documents(S: int, count: int) -> Documents:
    """``count`` documents of equal length over ``S`` tokens (the remainder in the last)."""
    n = S // count
    return documents([i * n for i in range(count)] + [S])


def layout_method(name, kern, layout: Layout, like: torch.Tensor, graph: bool = False):
    """Our packs and unpacks of one layer, without the collectives (rank ``layout.rank``).
    ``graph``: the forward's and the backward's launches captured in one CUDA graph each and
    replayed (``layout-<k>+graph``): the same kernels with no host work per call."""
    B, D, s = layout.batch, layout.head_dim, layout.seq_local
    dev, dt = like.device, like.dtype
    q = torch.randn(B, s, layout.total_heads("q"), D, device=dev).to(dt)
    k = torch.randn(B, s, layout.total_heads("kv"), D, device=dev).to(dt)
    v = torch.randn_like(k)
    n_qkv, n_q = sum(layout.s2h_send_splits(QKV)), sum(layout.s2h_send_splits(Q_ONLY))
    send_qkv, send_q = torch.empty(n_qkv, dtype=dt, device=dev), torch.empty(n_q, dtype=dt, device=dev)
    # Receive buffers of the head-to-sequence direction, filled once; unpack reads them.
    recv_q = torch.randn(sum(layout.h2s_splits(Q_ONLY)[1]), device=dev).to(dt)
    recv_qkv = torch.randn(sum(layout.h2s_splits(QKV)[1]), device=dev).to(dt)
    out = [torch.empty(B, s, layout.total_heads("q"), D, dtype=dt, device=dev)]
    grads = [torch.empty(B, s, layout.total_heads(x), D, dtype=dt, device=dev) for x in ("q", "kv", "kv")]
    dout_local = torch.randn(B, s, layout.total_heads("q"), D, device=dev).to(dt)

    flat = getattr(kern, "flat_blocks", False)  # as the exchange passes the blocks (attention.exchange)

    def fwd():
        kern.pack_s2h(layout, (q, k, v), QKV, send_qkv)
        kern.unpack_h2s(layout, layout.h2s_recv_views(recv_q, Q_ONLY, flat=flat), Q_ONLY, out)

    def bwd():
        kern.pack_s2h(layout, (dout_local,), Q_ONLY, send_q)
        kern.unpack_h2s(layout, layout.h2s_recv_views(recv_qkv, QKV, flat=flat), QKV, grads)

    if graph:
        fwd, bwd = _captured(fwd), _captured(bwd)

    def check() -> int:
        for buf in [send_qkv, send_q] + out + grads:
            buf.fill_(float("nan"))  # so an element the kernel never writes counts as wrong
        fwd()
        bwd()
        ref_qkv, ref_q = torch.empty_like(send_qkv), torch.empty_like(send_q)
        ref_out, ref_grads = [torch.empty_like(x) for x in out], [torch.empty_like(x) for x in grads]
        L.pack_s2h(layout, (q, k, v), QKV, ref_qkv)
        L.unpack_h2s(layout, layout.h2s_recv_views(recv_q, Q_ONLY), Q_ONLY, ref_out)
        L.pack_s2h(layout, (dout_local,), Q_ONLY, ref_q)
        L.unpack_h2s(layout, layout.h2s_recv_views(recv_qkv, QKV), QKV, ref_grads)
        return C.count_unequal_bits([send_qkv, send_q] + out + grads, [ref_qkv, ref_q] + ref_out + ref_grads)

    return Method(name, layout_only=True, fwd=fwd, bwd=bwd, check=check)


def _captured(fn):
    """``fn``'s launches captured in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def chain_layout_method(inp: Inputs, P: int):
    """The chain's permute+contiguous copies for one layer, without the collectives.

    With the collective replaced by nothing, each rank "receives" its own send buffer, so
    the sequence-to-head copies must give ``x``'s head block ``p`` as row block ``p``, and
    the head-to-sequence copies ``x``'s row block ``p`` as head block ``p``: ``check_layout()``
    compares every result with that slicing, bit for bit.
    """
    B, s, H, Hkv, D, S = inp.B, inp.s, inp.H, inp.Hkv, inp.D, inp.S
    if H % P:
        raise Skip(f"chain needs query heads ({H}) divisible by {P}")
    repeat = Hkv % P != 0
    kv_h = H if repeat else Hkv
    dev, dt = inp.device, inp.dtype
    q = torch.randn(B, s, H, D, device=dev).to(dt)
    k = torch.randn(B, s, Hkv, D, device=dev).to(dt)
    out_l = torch.randn(B, S, H // P, D, device=dev).to(dt)
    dk_l = torch.randn(B, S, kv_h // P, D, device=dev).to(dt)
    dk_rep = torch.randn(B, s, H, D, device=dev).to(dt) if repeat else None
    last = {}

    def s2h(x):  # the two copies of baselines.chain_seq_to_head, the collective replaced by nothing
        b, n, h, d = x.shape
        send = x.reshape(b, n, P, h // P, d).permute(2, 1, 0, 3, 4).contiguous()
        return send.permute(2, 0, 1, 3, 4).reshape(b, P * n, h // P, d).contiguous()

    def h2s(x):
        b, n, h, d = x.shape
        send = x.reshape(b, P, n // P, h, d).permute(1, 2, 0, 3, 4).contiguous()
        return send.permute(2, 1, 0, 3, 4).reshape(b, n // P, P * h, d).contiguous()

    def fwd():
        kk = k.repeat_interleave(H // Hkv, dim=2) if repeat else k
        last["q"], last["k"], last["v"] = s2h(q), s2h(kk), s2h(kk)
        last["out"] = h2s(out_l)

    def bwd():
        last["dout"] = s2h(q)  # dout has the shape of q
        last["dq"], last["dk"], last["dv"] = h2s(out_l), h2s(dk_l), h2s(dk_l)
        if repeat:  # the backward of repeat_interleave sums the copies, for dk and dv
            last["dk_sum"] = dk_rep.view(B, s, Hkv, H // Hkv, D).sum(3)
            last["dv_sum"] = dk_rep.view(B, s, Hkv, H // Hkv, D).sum(3)

    def check() -> int:
        last.clear()
        fwd()
        bwd()

        def s2h_ref(x):  # row block p = head block p (this rank's rows, every "source")
            h = x.shape[2] // P
            return torch.cat([x[:, :, p * h : (p + 1) * h] for p in range(P)], dim=1)

        def h2s_ref(x):  # head block p = row block p
            n = x.shape[1] // P
            return torch.cat([x[:, p * n : (p + 1) * n] for p in range(P)], dim=2)

        kk = k[:, :, [h // (H // Hkv) for h in range(H)]] if repeat else k
        want = {"q": s2h_ref(q), "k": s2h_ref(kk), "v": s2h_ref(kk), "out": h2s_ref(out_l), "dout": s2h_ref(q),
                "dq": h2s_ref(out_l), "dk": h2s_ref(dk_l), "dv": h2s_ref(dk_l)}  # fmt: skip
        if repeat:
            g = H // Hkv
            want["dk_sum"] = want["dv_sum"] = torch.stack([dk_rep[:, :, j * g : (j + 1) * g].sum(2) for j in range(Hkv)], 2)
        # The copies bit for bit; the sums (arithmetic, their order is torch's) within the dtype's tolerance.
        sums = {"dk_sum", "dv_sum"}
        copies = [name for name in want if name in last and name not in sums]
        wrong = C.count_unequal_bits([last[name] for name in copies], [want[name] for name in copies])
        wrong += sum(count_wrong(last[name], want[name].float(), dt) for name in sums if name in want and name in last)
        return wrong + sum(ref.numel() for name, ref in want.items() if name not in last)

    return Method("chain-layout", layout_only=True, fwd=fwd, bwd=bwd, check=check)


def peer_method(name, backend, scale, P, H, Hkv):
    """DeepSpeed's DistributedAttention or yunchang's UlyssesAttention, or ``Skip``."""

    def local_attn(q, k, v, *args, **kwargs):
        return backend.attend(q, k, v, True, scale)

    repeat = Hkv % P != 0
    g = H // Hkv
    if name == "deepspeed":
        try:
            import deepspeed
            from deepspeed.sequence.layer import DistributedAttention
        except Exception as e:  # noqa: BLE001 - any import-time failure means "not available"
            raise Skip(f"deepspeed not importable ({type(e).__name__}: {e})") from None
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        layer = DistributedAttention(local_attn, None, scatter_idx=2, gather_idx=1)
        # Current releases (0.19.8 read) require forward(q, k, v, batch_dim_idx, ...): the
        # batch dimension picks the all-to-all's layout; older ones take (q, k, v, *args).
        ds_kwargs = {"batch_dim_idx": 0} if "batch_dim_idx" in inspect.signature(layer.forward).parameters else {}
    else:
        try:
            from yunchang import UlyssesAttention
        except Exception as e:  # noqa: BLE001
            raise Skip(f"yunchang not importable ({type(e).__name__}: {e})") from None
        try:  # its default attention (AttnType.FA) asserts that flash-attn is importable
            layer = UlyssesAttention(None, scatter_idx=2, gather_idx=1)
        except (AssertionError, ImportError, ValueError, RuntimeError) as e:
            raise Skip(f"yunchang UlyssesAttention cannot be built here ({type(e).__name__}: {e})") from None

    def fn(q, k, v):
        if repeat:  # both assume KV heads divide over the ranks; repeat them as the chain does
            k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
        if name == "deepspeed":
            return layer(q, k, v, **ds_kwargs)
        return layer(q, k, v, softmax_scale=scale, causal=True)

    return Method(name, fn)


# ---- the sweep --------------------------------------------------------------------------------
def seq_lengths(args, P: int) -> list[int]:
    if args.seqs:
        seqs = [C.parse_size(x) for x in args.seqs.split(",")]
    else:
        seqs = C.size_sweep(C.parse_size(args.min_seq), C.parse_size(args.max_seq), 2)
    return [-(-s // P) * P for s in seqs]  # equal shards: round up to a multiple of P


def packed_variants(backend, device: torch.device, dtype) -> list[str]:
    """``local-packed-<kernel>`` for every packed-documents kernel ``backend`` can be forced to
    here with a backward, besides the one the chooser picks (that is ``local-packed``), and
    besides FlexAttention, which runs only when named (``--methods``): its compilation takes
    tens of seconds of a default run."""
    if not hasattr(backend, "packed_kernel"):
        return []
    pick = packed_kernel(device, dtype, candidates=backend.packed_candidates, prefer=backend.packed).name
    return [f"local-packed-{n}" for n, k in KERNELS.items() if n not in (pick, "flex") and k.why_not(device, dtype, DocMask(True), True) is None]


def packed_label(backend, device: torch.device, dtype) -> str:
    """The backend column of a packed row: ``<backend>+<packed kernel>``."""
    if not hasattr(backend, "packed_kernel"):
        return getattr(backend, "name", "?")
    return f"{backend.name}+{packed_kernel(device, dtype, candidates=backend.packed_candidates, prefer=backend.packed).name}"


def method_names(args, world: int, P: int, packed=()) -> list[str]:
    kernels = available_kernels()
    names = ["local", "local-sharedkv", "local-packed", *packed]
    if world > 1 or P == 1:
        names += ["chain"] + [f"ulysses-{k}" for k in kernels] + ["deepspeed", "yunchang"]
        names += [f"hybrid-{u}x{world // u}" for u in range(1, world) if world % u == 0]
        names += [f"{m}-{k}" for k in kernels for m in ("packed", "equal")]
        names += [f"packed-hybrid-{u}x{world // u}{z}" for u in range(1, world) if world % u == 0 for z in ("", "-zigzag")]
    names += [f"layout-{k}" for k in kernels] + ["chain-layout"]
    names += [f"layout-{k}+graph" for k in kernels if k == "cuda" and torch.cuda.is_available()]
    if args.methods != "all":
        names = [m.strip() for m in args.methods.split(",")]
    return names


def estimate_bytes(name: str, inp: Inputs, plan: HeadPlan, rank: int) -> int:
    """A rough per-rank peak for one fwd+bwd (a pre-check so that big sizes skip, not OOM)."""
    e, B, D, S, s = torch.empty((), dtype=inp.dtype).element_size(), inp.B, inp.D, inp.S, inp.s
    heads_local = plan.q_count(rank) + 2 * plan.kv_count(rank)
    if name.startswith("chain") or name in COMM_METHODS:
        heads_local = 3 * -(-inp.H // inp.P)
    seq_side = B * s * (inp.H + 2 * inp.Hkv) * D * e  # q/k/v or their grads, one copy
    head_side = B * S * heads_local * D * e  # received q/k/v, or their grads
    return int(4 * head_side + 6 * seq_side)


def build_method(name, args, inp, plan, rank, world, P, backend, scale, layout):
    if name == "local":
        return local_method(plan, rank, backend, scale)
    if name == "local-sharedkv":
        # What the layer runs where all query heads share the rank's one KV head
        # (backends.SharedKV: stride-0 KV view, KV gradient summed per query head): its
        # cost over the floor above.
        wrapped = for_rank(backend, plan.local_kv_map(rank))
        if wrapped is backend:
            raise Skip("this rank's query heads do not all share one KV head (no SharedKV)")
        return local_method(plan, rank, wrapped, scale, name)
    if name == "local-packed":
        m = local_method(plan, rank, backend, scale, name, docs=packed_documents(inp.S))
        m.backend = packed_label(backend, inp.device, inp.dtype)
        return m
    if name.startswith("local-packed-"):
        kernel = name[len("local-packed-"):]
        if kernel not in KERNELS or not hasattr(backend, "packed_kernel"):
            raise Skip(f"{name}: no packed kernel {kernel!r} (one of {sorted(KERNELS)}) for backend {backend.name!r}")
        forced = type(backend)()
        forced.packed = kernel
        packed_kernel(inp.device, inp.dtype, prefer=kernel)  # ValueError (a skip) when it cannot run here
        m = local_method(plan, rank, forced, scale, name, docs=packed_documents(inp.S))
        m.backend = f"{backend.name}+{kernel}"
        return m
    if name.startswith("packed-hybrid-"):
        m = packed_hybrid_method(name, args, inp, backend, rank)
        m.backend = packed_label(backend, inp.device, inp.dtype)
        return m
    if name.startswith(("packed-", "equal-")):
        m = packed_method(name, args, inp, backend)
        m.backend = packed_label(backend, inp.device, inp.dtype)
        return m
    if name == "chain":
        if inp.H % world:
            raise Skip(f"chain needs query heads ({inp.H}) divisible by the world size ({world})")
        attn = lambda q, k, v, causal, softmax_scale: backend.attend(q, k, v, causal, softmax_scale)  # noqa: E731
        return Method("chain", lambda q, k, v: permute_chain_attention(q, k, v, causal=True, attn_fn=attn))
    if name.startswith("ulysses-"):
        kern = name[len("ulysses-"):]
        get_kernels(kern, inp.device)  # raises ValueError when the set is not available

        def fn(q, k, v):
            return ulysses_attention(q, k, v, causal=True, attn_fn=backend, kernels=kern, chunks=args.chunks, check=False)

        return Method(name, fn)
    if name in ("deepspeed", "yunchang"):
        return peer_method(name, backend, scale, world, inp.H, inp.Hkv)
    if name.startswith("hybrid-"):
        sp = args.sp_groups.get(name)
        if sp is None:
            raise Skip(f"{name} needs U*R = {world} real ranks")
        return Method(name, lambda q, k, v: ulysses_attention(q, k, v, sp, causal=True, attn_fn=backend, chunks=args.chunks, check=False))
    if name.startswith("layout-"):
        graph = name.endswith("+graph")
        if graph and inp.device.type != "cuda":
            raise Skip("a CUDA graph needs a GPU")
        kern = get_kernels(name[len("layout-") : len(name) - len("+graph") * graph], inp.device)
        return layout_method(name, kern, layout, torch.empty(0, dtype=inp.dtype, device=inp.device), graph=graph)
    if name == "chain-layout":
        return chain_layout_method(inp, P)
    raise Skip(f"unknown method {name!r}")


def packed_method(name: str, args, inp: Inputs, backend) -> Method:
    """``packed-<k>``: the realistic document mix; ``equal-<k>``: as many equal documents."""
    if inp.B != 1:
        raise Skip(f"packed rows need --batch 1 (documents end to end), got {inp.B}")
    kind, kern = name.split("-", 1)
    get_kernels(kern, inp.device)  # raises ValueError when the set is not available
    docs = packed_documents(inp.S)
    if kind == "equal":
        docs = equal_documents(inp.S, docs.count)

    def fn(q, k, v):
        return ulysses_attention(
            q, k, v, causal=True, attn_fn=backend, kernels=kern, chunks=args.chunks, check=False, cu_seqlens=docs.cu_seqlens,
            max_seqlen=docs.max_seqlen,
        )  # fmt: skip

    return Method(name, fn, docs=docs)


def packed_hybrid_method(name: str, args, inp: Inputs, backend, rank: int) -> Method:
    """``packed-hybrid-UxR[-zigzag]``: the packed rows' documents on a 2-D group."""
    sp = args.sp_groups.get(name)
    if sp is None:
        raise Skip(f"{name} needs U*R = world real ranks")
    if inp.B != 1:
        raise Skip(f"packed rows need --batch 1 (documents end to end), got {inp.B}")
    R = sp.ring_size
    if sp.seq_layout == "zigzag" and inp.S % math.lcm(2 * R, sp.world_size):
        raise Skip(f"zigzag needs the sequence ({inp.S}) to be a multiple of lcm(2R, P) = {math.lcm(2 * R, sp.world_size)}")
    docs = packed_documents(inp.S)
    sched = ring_schedule(R, sp.seq_layout, inp.S // R, True, docs.cu_seqlens)
    rows = None if sp.seq_layout == "contiguous" else shard_rows(inp.S, sp.ulysses_size, R, rank, sp.seq_layout)

    def fn(q, k, v):
        return ulysses_attention(q, k, v, sp, causal=True, attn_fn=backend, chunks=args.chunks, check=False, cu_seqlens=docs.cu_seqlens,
                                 max_seqlen=docs.max_seqlen)  # fmt: skip

    return Method(name, fn, docs=docs, rows=rows, ring=sched)


def make_inputs(m: Method, inp: Inputs, plan: HeadPlan, rank: int):
    if m.rows is not None:  # a zigzag shard: rows of every block
        q, k, v, dout = (inp.full(n, range(inp.Hkv if n in "kv" else inp.H)).index_select(1, m.rows.to(inp.device)) for n in ("q", "k", "v", "dout"))
    elif m.seq_sharded:
        q, k, v, dout = (inp.block(rank, n) for n in ("q", "k", "v", "dout"))
    else:
        (qa, qb), (ka, kb) = plan.q_ranges[rank], plan.kv_ranges[rank]
        q, dout = inp.full("q", range(qa, qb)), inp.full("dout", range(qa, qb))
        k, v = inp.full("k", range(ka, kb)), inp.full("v", range(ka, kb))
    return [x.requires_grad_() for x in (q, k, v)], dout


def time_method(m: Method, args, inp, plan, rank, device):
    """{pass: (seconds, peak bytes or None, each iteration's seconds)} and the (out, dq) of the last fwd+bwd."""
    res, keep = {}, {}
    cuda = device.type == "cuda"
    if m.layout_only:
        fns = {"fwd": m.fwd_only, "bwd": m.bwd_only, "fwdbwd": lambda: (m.fwd_only(), m.bwd_only())}
        for p in args.passes:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t = C.time_iters(fns[p], device=device, warmup=args.warmup_iters, iters=args.iters)
            res[p] = (C.median(t), torch.cuda.max_memory_allocated(device) if cuda else None, t)
        return res, None
    (q, k, v), dout = make_inputs(m, inp, plan, rank)

    def clear():
        for x in (q, k, v):
            x.grad = None

    def fwd():
        m.fn(q, k, v)  # the graph is built (training forward) and dropped

    def bwd(out):
        out.backward(dout)

    def fwdbwd():
        clear()
        out = m.fn(q, k, v)
        out.backward(dout)
        keep["out"], keep["dq"] = out.detach(), q.grad

    def setup_bwd():
        clear()
        return m.fn(q, k, v)

    if m.name.endswith("-flex") and cuda:  # its first call compiles FlexAttention: kept out of the timing
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fwdbwd()
        torch.cuda.synchronize(device)
        m.first_s = time.perf_counter() - t0
    # The check needs one fwd+bwd: run that pass (untimed in the table) when not selected.
    extra = ("fwdbwd",) if args.check and "fwdbwd" not in args.passes else ()
    for p in args.passes + extra:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if p == "fwd":
            t = C.time_iters(fwd, device=device, warmup=args.warmup_iters, iters=args.iters)
        elif p == "bwd":
            t = C.time_iters(bwd, device=device, warmup=args.warmup_iters, iters=args.iters, setup=setup_bwd)
        else:
            t = C.time_iters(fwdbwd, device=device, warmup=args.warmup_iters, iters=args.iters)
        res[p] = (C.median(t), torch.cuda.max_memory_allocated(device) if cuda else None, t)
    return {p: res[p] for p in args.passes}, ((keep["out"], keep["dq"]) if keep else None)


def check_method(m: Method, outs, inp: Inputs, plan: HeadPlan, rank: int, scale: float, kv_full, n_rows: int) -> int:
    out, dq = outs
    if m.seq_sharded:
        local = sample_rows(inp.s, n_rows)
        rows = [rank * inp.s + t if m.rows is None else int(m.rows[t]) for t in local]
        heads = list(range(inp.H))
    else:
        local = sample_rows(inp.S, n_rows)
        rows = local
        heads = list(range(*plan.q_ranges[rank]))
    ref_o, ref_dq = reference_rows(inp, rows, heads, scale, *kv_full, docs=m.docs)
    return count_wrong(out[:, local], ref_o, inp.dtype) + count_wrong(dq[:, local], ref_dq, inp.dtype)


@dataclass
class Group:
    """One (head layout, sequence length) of the sweep on this rank: what every method of
    it shares. ``rank`` is the rank within the (possibly emulated) ``P``-way group."""

    model: str
    plan: HeadPlan
    inp: Inputs
    rank: int
    world: int
    P: int
    backend: object
    scale: float
    layout: Layout
    kv_full: tuple | None = None  # all rows of k and v, built once for the checks

    @property
    def emulated(self) -> bool:
        return self.world == 1 and self.P > 1

    def key(self, name: str) -> str:
        return f"{self.model} S={self.inp.S} {name}"


def make_group(args, model, H, Hkv, S, plan, rank, world, P, dtype, device) -> Group:
    inp = Inputs(args.batch, S, H, Hkv, args.head_dim, P if world == 1 else world, dtype, device)
    probe = torch.empty(1, 1, 1, args.head_dim, dtype=dtype, device=device)
    backend = resolve_backend(args.attn_fn, probe)
    layout = Layout(plan, rank, (inp.s,) * P, args.batch, args.head_dim)
    return Group(model, plan, inp, rank, world, P, backend, default_scale(args.head_dim, None), layout)


def prepare_method(name: str, args, g: Group, device: torch.device):
    """``(method, None)``, or ``(None, why)`` when it cannot run here (its own skip, a
    missing kernel set, or a size whose estimated memory does not fit)."""
    try:
        if g.emulated and (name in COMM_METHODS or name.startswith(("ulysses-", "hybrid-"))):
            raise Skip("needs real ranks (one process emulates only local/layout rows)")
        m = build_method(name, args, g.inp, g.plan, g.rank, g.world, g.P, g.backend, g.scale, g.layout)
        if device.type == "cuda":
            need, free = estimate_bytes(name, g.inp, g.plan, g.rank), torch.cuda.mem_get_info(device)[0]
            if need > args.mem_fraction * free:
                raise Skip(f"estimated {need / 2**30:.1f} GiB > {args.mem_fraction:.0%} of free {free / 2**30:.1f} GiB")
    except Skip as e:
        return None, str(e)
    except (ValueError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"
    return m, None


def run_method(m: Method, args, g: Group, device: torch.device):
    """``(results, outs, None)`` from ``time_method``, or ``(None, None, why)`` when the
    method ran out of memory or failed."""
    try:
        res, outs = time_method(m, args, g.inp, g.plan, g.rank, device)
    except torch.cuda.OutOfMemoryError as e:
        return None, None, f"OOM: {str(e).splitlines()[0]}"
    except (RuntimeError, NotImplementedError, AssertionError, TypeError) as e:
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return res, outs, None


def count_method_wrong(m: Method, outs, args, g: Group) -> int | None:
    """Wrong elements summed over ranks (layout rows: bit for bit; attention rows: sampled
    rows against float32), or None with ``--check 0``."""
    if not args.check:
        return None
    if m.layout_only:
        return None if m.check_layout is None else int(C.reduce_sum(m.check_layout()))
    if outs is None:
        return None
    if g.kv_full is None:
        g.kv_full = (g.inp.full("k", range(g.inp.Hkv)), g.inp.full("v", range(g.inp.Hkv)))
    return int(C.reduce_sum(check_method(m, outs, g.inp, g.plan, g.rank, g.scale, g.kv_full, args.check_rows)))


def method_rows(m: Method, res: dict, wrong, args, g: Group, dtype) -> list[dict]:
    """One row per pass: the slowest rank's time and peak memory, TFLOP/s of the busiest rank."""
    inp = g.inp
    hq_max = max(g.plan.q_count(r) for r in range(g.P))  # the slowest rank sets the pace
    pairs = inp.S * inp.S if m.docs is None else sum((b - a) ** 2 for a, b in m.docs.spans())
    flops_fwd = 4 * args.batch * pairs * hq_max * args.head_dim / 2
    rows = []
    for p in args.passes:
        t = C.reduce_max(res[p][0])
        mem = C.reduce_max(res[p][1]) if res[p][1] is not None else None
        rows.append({
            "model": g.model, "heads": f"{inp.H}/{inp.Hkv}", "seq": inp.S, "world": g.P, "method": m.name, "pass": p,
            "time_ms": t * 1e3, "tflops": None if m.layout_only else flops_fwd * FLOP_FACTOR[p] / t / 1e12,
            "mem_gib": None if mem is None else mem / 2**30, "wrong": wrong, "dtype": C.dtype_name(dtype),
            "backend": m.backend or g.backend.name, "docs": 1 if m.docs is None else m.docs.count, "first_s": m.first_s,
            "ring_steps": None if m.ring is None else f"{m.ring.computed_steps()}/{m.ring.ring_size ** 2}",
            "ring_hops": None if m.ring is None else f"{m.ring.hops()}/{m.ring.ring_size * (m.ring.ring_size - 1)}",
            **C.spread(res[p][2], 1e3, "ms"),
        })  # fmt: skip
    return rows


def run_group(args, g: Group, names: list[str], device, dtype, notes: dict, dead: set, progress) -> list[dict]:
    """Every method of one (layout, sequence): rows with ratios. A method that fails (not a
    skip for size or for want of ranks) is added to ``dead`` and not tried at longer sequences."""
    rows = []
    for name in names:
        progress.step(g.key(name))
        if (g.model, name) in dead:
            continue
        m, why = prepare_method(name, args, g, device)
        if not C.all_ok(m is not None):
            notes[g.key(name)] = why or "skipped on another rank"
            if why and "estimated" not in why and "needs real ranks" not in why:
                dead.add((g.model, name))
            continue
        res, outs, why = run_method(m, args, g, device)
        if not C.all_ok(res is not None):
            notes[g.key(name)] = why or "failed on another rank"
            dead.add((g.model, name))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if m.first_s is not None and g.rank == 0:
            print(f"# {g.key(name)}: first fwd+bwd {m.first_s:.1f} s (compiles FlexAttention), kept out of the timing", flush=True)
        wrong = count_method_wrong(m, outs, args, g)
        del outs
        rows += method_rows(m, res, wrong, args, g, dtype)
        del m
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _ratios(rows)
    return rows


def print_header(args, world: int, P: int, backend_name: str, device: torch.device, dtype, names) -> None:
    lab = "" if device.type == "cuda" else f"  [{C.CPU_LABEL}]"
    emu = f" (one process: rank 0 of an emulated {P}-way group)" if world == 1 and P > 1 else ""
    print(f"# bench_attention: {world} ranks{emu}, {backend_name}, {device.type}, {C.dtype_name(dtype)}, "
          f"batch {args.batch}, head_dim {args.head_dim}, causal, warmup {args.warmup_iters}, iters {args.iters}{lab}", flush=True)  # fmt: skip
    print(f"# methods: {', '.join(names)}", flush=True)
    default = get_kernels(None, device).name
    print(f"# default here (kernels='auto'): {default}, kernel variant {extension.pack_variant()} (ULYSSES_KERNELS_PACK_VARIANT)", flush=True)


def report(rows, breakdown, notes: dict, device: torch.device) -> None:
    """The table, the breakdown, the skipped methods with their reasons, the wrong total."""
    cuda = device.type == "cuda"
    spread = "# time: median over the iterations, q1/q3 its quartiles"
    C.print_table(COLUMNS, rows, title=spread if cuda else f"{spread}; {C.CPU_LABEL}: a code-path check; peak memory n/a on the CPU")
    for r in rows:  # a layer faster than its attention alone: noise, not a win
        flag = C.floor_flag(r, {"time_ms": r["time_ms"] / r["x_floor"]}, "time_ms", "attention alone") if r.get("x_floor") else None
        if flag and not r["method"].startswith("local"):
            print(f"# {r['model']} seq {r['seq']} {r['method']} {r['pass']}: {flag}", flush=True)
    if breakdown:
        C.print_table(BREAKDOWN_COLUMNS, breakdown, title="# layer time = compute (local) + layout + exposed communication")
    if not cuda and any(r["method"].endswith("-cuda") for r in rows):
        print("# ulysses-cuda, layout-cuda on a CPU: the C++ extension's CPU twin of the CUDA kernels", flush=True)
    for k, why in notes.items():
        print(f"# skipped {k}: {why}", flush=True)
    bad = sum(r["wrong"] or 0 for r in rows)
    print(f"# wrong elements: {bad} {'OK' if bad == 0 else 'FAILED'}", flush=True)


def run_bench(args, rank: int, world: int, device: torch.device, backend_name: str):
    """Every method at every (layout, sequence) on every rank: the rows, the breakdown of
    each ulysses row and ``{what: why}`` for what did not run. Rank 0 prints the tables."""
    dtype = C.parse_dtype(args.datatype or ("bf16" if device.type == "cuda" else "fp32"))
    P = world if world > 1 else args.sp  # rank 0 of an emulated group has the most heads
    layouts = C.parse_layouts("bench_attention", args.layouts, args.models)
    seqs = seq_lengths(args, P)
    probe = torch.empty(1, 1, 1, args.head_dim, dtype=dtype, device=device)
    names = method_names(args, world, P, packed_variants(resolve_backend(args.attn_fn, probe), device, dtype))
    args.sp_groups = hybrid_groups(names, world)
    if rank == 0:
        print_header(args, world, P, backend_name, device, dtype, names)
    rows, notes, dead = [], {}, set()
    progress = C.Progress(len(layouts) * len(seqs) * len(names), rank == 0, "attention")
    for model, H, Hkv in layouts:
        try:
            plan = HeadPlan.build(H, Hkv, P)
        except ValueError as e:
            notes[model] = str(e)
            continue
        for S in seqs:
            g = make_group(args, model, H, Hkv, S, plan, rank, world, P, dtype, device)
            rows += run_group(args, g, names, device, dtype, notes, dead, progress)
    breakdown = _breakdown(rows)
    if rank == 0:
        report(rows, breakdown, notes, device)
    return rows, breakdown, notes


def hybrid_groups(names, world: int) -> dict:
    """``{name: SPGroups}`` for the ``hybrid-UxR`` and ``packed-hybrid-UxR[-zigzag]`` methods
    that fit ``world`` real ranks, made once per split per run (collective: every rank makes
    them in the same order)."""
    groups, made = {}, {}
    for name in names:
        match = re.fullmatch(r"(?:packed-)?hybrid-(\d+)x(\d+)(-zigzag)?", name)
        if match is None or world == 1 or (match[3] and not name.startswith("packed-")):
            continue  # build_method says why
        u, r = int(match[1]), int(match[2])
        if u * r == world:
            if (u, r) not in made:
                made[u, r] = make_sp_groups(u, r)
            groups[name] = made[u, r].with_layout("zigzag" if match[3] else "contiguous")
    return groups


def _ratios(rows):
    """x_chain: the chain's time over this row's (layout rows: chain-layout's over this);
    x_floor: this row's time over the local floor's (attention rows only; packed rows:
    over local-packed's); x_equal: a packed row's time over its equal-length row's;
    extra_gib: this row's peak memory over the local floor's (the buffers and copies of the
    all-to-alls; GPU only)."""
    by = {(r["method"], r["pass"]): r for r in rows}
    for r in rows:
        equal = by.get(("equal-" + r["method"][len("packed-") :], r["pass"])) if r["method"].startswith("packed-") else None
        r["x_equal"] = r["time_ms"] / equal["time_ms"] if equal else None
        is_layout = r["method"].startswith("layout-") or r["method"] == "chain-layout"
        chain = by.get(("chain-layout" if is_layout else "chain", r["pass"]))
        name = r["method"]
        floor = "local-packed" if name.startswith(("packed-", "local-packed")) else None if name.startswith("equal-") else "local"
        local = by.get((floor, r["pass"]))
        dense = by.get(("local", r["pass"]))
        packed = name.startswith(("packed-", "local-packed"))
        r["x_dense"] = r["tflops"] / dense["tflops"] if packed and dense and r["tflops"] and dense["tflops"] else None
        r["x_chain"] = chain["time_ms"] / r["time_ms"] if chain else None
        r["x_floor"] = r["time_ms"] / local["time_ms"] if local and not is_layout else None
        has_mem = local and r["mem_gib"] is not None and local["mem_gib"] is not None and not is_layout
        r["extra_gib"] = r["mem_gib"] - local["mem_gib"] if has_mem else None


def _breakdown(rows):
    out = []
    by = {(r["model"], r["seq"], r["method"], r["pass"]): r for r in rows}
    for r in rows:
        if not r["method"].startswith("ulysses-"):
            continue
        kern = r["method"][len("ulysses-"):]
        # The attention the layer runs: SharedKV where this rank's heads share one KV head.
        local = by.get((r["model"], r["seq"], "local-sharedkv", r["pass"])) or by.get((r["model"], r["seq"], "local", r["pass"]))
        lay = by.get((r["model"], r["seq"], f"layout-{kern}", r["pass"]))
        if not local or not lay:
            continue
        out.append({
            "model": r["model"], "seq": r["seq"], "pass": r["pass"], "kernels": kern, "total_ms": r["time_ms"],
            "compute_ms": local["time_ms"], "layout_ms": lay["time_ms"],
            "exposed_comm_ms": r["time_ms"] - local["time_ms"] - lay["time_ms"],
        })  # fmt: skip
    return out


COLUMNS = [
    ("model", "model", ""), ("seq", "seq", "d"), ("world", "P", "d"), ("method", "method", ""), ("pass", "pass", ""),
    ("backend", "backend", ""), ("time_ms", "time(ms)", ".3f"), ("time_q1_ms", "q1", ".3f"), ("time_q3_ms", "q3", ".3f"),
    ("tflops", "TFLOP/s", ".1f"), ("x_chain", "x_chain", ".2f"),
    ("x_floor", "x_floor", ".2f"), ("mem_gib", "mem(GiB)", ".2f"), ("extra_gib", "extra(GiB)", ".2f"),
    ("docs", "docs", "d"), ("x_equal", "x_equal", ".2f"), ("x_dense", "x_dense", ".2f"), ("ring_steps", "steps", ""), ("ring_hops", "hops", ""),
    ("wrong", "#wrong", "d"),
]  # fmt: skip
BREAKDOWN_COLUMNS = [
    ("model", "model", ""), ("seq", "seq", "d"), ("pass", "pass", ""), ("kernels", "kernels", ""),
    ("total_ms", "total(ms)", ".3f"), ("compute_ms", "compute", ".3f"), ("layout_ms", "layout", ".3f"),
    ("exposed_comm_ms", "exposed comm", ".3f"),
]  # fmt: skip


def plot(breakdown, path, env) -> bool:
    plt = C.load_pyplot()
    if plt is None or not breakdown:
        return False
    sel = [b for b in breakdown if b["pass"] == "fwdbwd"] or breakdown
    labels = [f"{b['model']}\n{b['seq']}\n{b['kernels']}" for b in sel]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(sel)), 4.5))
    x = list(range(len(sel)))
    c = [b["compute_ms"] for b in sel]
    lay = [b["layout_ms"] for b in sel]
    com = [max(0.0, b["exposed_comm_ms"]) for b in sel]
    ax.bar(x, c, label="compute (local floor)")
    ax.bar(x, lay, bottom=c, label="layout (pack/unpack)")
    ax.bar(x, com, bottom=[a + b for a, b in zip(c, lay)], label="exposed communication")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_ylabel("ms per layer (" + sel[0]["pass"] + ")")
    ax.set_title(f"Ulysses attention, {env['world_size']} ranks, {C.device_label(env)}")
    ax.legend()
    return C.save_figure(plt, fig, path)


def _body(args, rank, world, device, backend):
    rows, breakdown, notes = run_bench(args, rank, world, device, backend)
    meta = dict(vars(args), skipped=notes, breakdown=breakdown)
    env_fn = lambda: C.env_record(device, world, backend, emulated_group=args.sp if world == 1 else None)  # noqa: E731
    C.finish(args, rank, "bench_attention", env_fn, rows, meta, plot, breakdown)


def parse_args(argv=None, default_out_dir=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="all", help=f"comma list of {', '.join(MODELS)} (default all)")
    p.add_argument("--layouts", default=None, help="custom head layouts Hq/Hkv,... (overrides --models)")
    p.add_argument("--min-seq", default="4K", help="smallest global sequence (default 4K)")
    p.add_argument("--max-seq", default="1M", help="largest global sequence (default 1M)")
    p.add_argument("--seqs", default=None, help="explicit global sequence lengths, e.g. 4K,32K")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("-d", "--datatype", default=None, help="bf16 (GPU default), fp16, fp32 (CPU default)")
    p.add_argument("--methods", default="all", help="comma list (see above; default all that can run)")
    p.add_argument("--passes", default="fwd,bwd,fwdbwd", help="comma list of fwd, bwd, fwdbwd")
    p.add_argument("--attn-fn", default=None, help="attention backend: flash, sdpa, math (default: flash if importable, else sdpa)")
    p.add_argument("--chunks", default=1, help="ulysses_attention(chunks=...) (default 1)")
    p.add_argument("--sp", type=int, default=8, help="with one process: the group size to emulate (default 8)")
    p.add_argument("-w", "--warmup-iters", dest="warmup_iters", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("--check", type=int, default=1, help="check every row against a float32 reference (1) or not (0)")
    p.add_argument("--check-rows", type=int, default=8, help="rows per rank the check samples (default 8)")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="skip a size whose estimate exceeds this share of free memory")
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="spawn N gloo ranks on the CPU instead of torchrun")
    p.add_argument("--out-dir", default=str(default_out_dir or C.DEFAULT_OUT_DIR),
                   help=f"where the CSV/JSON/PNG go (default {default_out_dir or C.DEFAULT_OUT_DIR})")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    args.passes = tuple(x.strip() for x in args.passes.split(","))
    if any(x not in PASSES for x in args.passes):
        p.error(f"--passes: choose from {', '.join(PASSES)}")
    if args.chunks != "auto":
        args.chunks = int(args.chunks)
    return args


def main(argv=None, *, default_out_dir=None) -> int:
    """Run the benchmark; ``default_out_dir`` replaces ``--out-dir``'s default (the
    checkout's ``bench/bench_attention.py`` passes ``bench/results``)."""
    return C.launch(_body, parse_args(argv, default_out_dir))


if __name__ == "__main__":
    sys.exit(main())
