"""The methods of the attention benchmark, by name: what each runs (``Method``), how it is
built (``build_method``), and which names a run tries (``method_names``). A method that
cannot run here raises ``Skip`` with the reason."""

from __future__ import annotations

import inspect
import math

import torch
import torch.distributed as dist

from ulysses_kernels import ulysses_attention
from ulysses_kernels.backends import doc_kwargs, for_rank, packed_kernel
from ulysses_kernels.baselines import permute_chain_attention
from ulysses_kernels.bench import patterns
from ulysses_kernels.bench.harness import Skip
from ulysses_kernels.kernels import available_kernels, get_kernels
from ulysses_kernels.kernels import torch_kernels as L
from ulysses_kernels.layout import Q_ONLY, QKV, Layout
from ulysses_kernels.packed import KERNELS, DocMask
from ulysses_kernels.ring import shard_rows
from ulysses_kernels.ring.schedule import ring_schedule

from .check import count_wrong
from .inputs import Inputs, equal_documents, packed_documents

COMM_METHODS = ("chain", "deepspeed", "yunchang")


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
    names += [f"{m}+graph" for m in ("local", "local-packed") if torch.cuda.is_available()]
    if args.methods != "all":
        names = [m.strip() for m in args.methods.split(",")]
    return names


def build_method(name, args, inp, plan, rank, world, P, backend, scale, layout):
    if name.startswith("local") and name.endswith("+graph"):
        if inp.device.type != "cuda":
            raise Skip("a CUDA graph needs a GPU")
        m = build_method(name[: -len("+graph")], args, inp, plan, rank, world, P, backend, scale, layout)
        m.name = name
        return graphed(m)
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
        kernel = name[len("local-packed-") :]
        if kernel not in KERNELS or not hasattr(backend, "packed_kernel"):
            raise Skip(f"{name}: no packed kernel {kernel!r} (one of {sorted(KERNELS)}) for backend {backend.name!r}")
        forced = type(backend)()
        forced.packed = kernel
        packed_kernel(inp.device, inp.dtype, prefer=kernel)  # ValueError (a skip) when it cannot run here
        m = local_method(plan, rank, forced, scale, name, docs=packed_documents(inp.S))
        m.backend = f"{backend.name}+{KERNELS[kernel].label}"
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
        kern = name[len("ulysses-") :]
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
    return f"{backend.name}+{packed_kernel(device, dtype, candidates=backend.packed_candidates, prefer=backend.packed).label}"


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
        return patterns.count_unequal_bits([send_qkv, send_q] + out + grads, [ref_qkv, ref_q] + ref_out + ref_grads)

    return Method(name, layout_only=True, fwd=fwd, bwd=bwd, check=check)


def graphed(m: Method) -> Method:
    """``local*+graph``: the attention call's forward and backward captured as CUDA graphs
    (``torch.cuda.make_graphed_callables``, at the first call, from that call's shapes) and
    replayed, its inputs copied into the graph's own: the kernels' time without the host's
    (the eager rows of a short call are host-bound: dense ``local`` at 4K spent ~0.35 ms on the
    host on the H200 for a few microseconds of kernels)."""
    base, cache = m.fn, {}

    def fn(q, k, v):
        if "fn" not in cache:
            samples = tuple(x.detach().clone().requires_grad_(True) for x in (q, k, v))
            cache["fn"] = torch.cuda.make_graphed_callables(base, samples)
        return cache["fn"](q, k, v)

    m.fn = fn
    return m


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
        wrong = patterns.count_unequal_bits([last[name] for name in copies], [want[name] for name in copies])
        wrong += sum(count_wrong(last[name], want[name].float(), dt) for name in sums if name in want and name in last)
        return wrong + sum(ref.numel() for name, ref in want.items() if name not in last)

    return Method("chain-layout", layout_only=True, fwd=fwd, bwd=bwd, check=check)
