"""One call set-up: the arguments of a Ulysses call, resolved once into a frozen value.

Every entry point (``ulysses_attention`` and its module, ``seq_to_head``, ``head_to_seq``,
the compiled path and the chunked pipeline) calls ``setup_attention`` or
``setup_exchange`` and hands the resulting ``CallSetup`` down; nothing below re-derives
the plan, the layout, the communicator, the kernel set, the attention backend (with the
shared-KV rule of ``backends.for_rank``), the scale, the KV map or the chunk count.

Order of resolution, the same for every entry point, top-down in ``setup_attention``:

1. the group's members (``comm`` if given, else torch.distributed on ``group``, or a
   world of one): rank and world size;
2. the call key (``checks.call_key``: shapes, dtypes, devices, options; no tensor) and its
   checks (``checks.check_call``: with ``check``, across ranks, one small all-gather, the
   same error on every rank; else this rank's own, once per key), all before planning;
3. ``resolve``: what the key and the backend and kernel-set names decide (``Parts``: the
   ``HeadPlan`` and this rank's ``Layout``, the backend, the kernel set, the scale), once
   per key in one bounded cache keyed by values (never by a group; a
   backend or kernel set given as an object is put in per call around the kept rest);
4. the chunk count, the communicator that moves the data (``comm`` if given, else the
   group's default for the tensors' device; chosen after the checks because torch creates a
   group's NCCL communicator at the group's first collective, which the checks' all-gather
   may be), the wire format and the route of each exchange in it (``wire.call_routes``: the
   sizes every buffer is cut by, kept on the layout).

What remains per call is what cannot be cached by value: the members (a few attribute
reads), ``check=True``'s all-gather, the look-up of the routes on the layout, and the chunk
count when ``chunks`` is not 1 (it depends on saved-tensor hooks being active).
``UlyssesAttention`` goes further: it keeps each signature's whole ``CallSetup`` (its own
group's members and communicator included), so its calls after the first resolve nothing.

Inside ``torch.compile`` (``traced``) the checks are rank-local, the kernel set must be
traceable, the communicator is the members' (torch's functional collectives) and
``chunks`` is 1 (see ``attention.traced``).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch

from ..backends import AttentionBackend, backend_of, for_rank
from ..checkpointing import chunks_recompute_apart
from ..checks import CallKey, UlyssesInputError, call_key, check_call, check_head_to_seq, float_bits
from ..comm import Communicator, get_communicator, native_nccl_enabled
from ..documents import Documents, documents
from ..kernels import KernelSet, get_kernels, registry_generation
from ..layout import Q_ONLY, QKV, Layout, Routes
from ..math_attention import checked_scale
from ..plan import HeadPlan
from ..ring import SPGroups, check_ring_inputs, ring_backend
from ..tracing import in_trace
from ..wire import WireSpec, call_routes, resolve_wire
from .chunked import choose_chunks, chunk_plans

__all__ = ["CallSetup", "Parts", "members_of", "resolve", "setup_attention", "setup_exchange", "setup_head_to_seq"]


class CallSetup(NamedTuple):
    """Everything one call needs, resolved (see the module docstring). A named tuple: a
    frozen value made per call of the functional op from parts resolved once, in a fraction
    of a frozen dataclass's construction time (0.5 against 2 microseconds, measured).

    ``backend``: what this rank runs (``backends.for_rank``'s pick: ``SharedKV`` around a
    built-in backend on a rank whose query heads share its one KV head), ``None`` for the
    bare exchanges. ``split_kv_groups``: the backend is a built-in one, so the chunked
    pipeline may split a shared KV head's query heads (the same answer on every rank).
    ``chunks``: the resolved chunk count (1: the unchunked op). ``docs``: the document
    boundaries of a packed sequence (``documents.Documents``: the global ``cu_seqlens``,
    which are also every rank's view after the sequence-to-head exchange), ``None`` for
    ordinary batches; the backend receives them as ``docs=``. ``traced`` and ``chunks`` say
    which schedule runs the call: ``interface.run_schedule`` reads them (the only place that
    picks one). ``wire``: the FP8 format of each exchange (``wire.WireSpec``), ``None`` for
    the attention dtype on the wire (the default; always with one rank). ``routes``: the
    route of each exchange the call makes (``layout.Routes``, by ``wire.call_routes``: in the
    units of its wire), which the movers take (``attention.exchange``).
    """

    plan: HeadPlan
    layout: Layout
    comm: Communicator
    kernels: KernelSet
    backend: object | None = None
    split_kv_groups: bool = False
    causal: bool = False
    scale: float = 1.0
    kv_map: tuple[int, ...] = ()
    chunks: int = 1
    traced: bool = False
    docs: Documents | None = None
    wire: WireSpec | None = None
    routes: Routes | None = None


def members_of(group, comm) -> Communicator:
    """Who takes part: ``comm`` if given, else torch.distributed on ``group`` (a world of
    one without torch.distributed). Cheap: it holds the group only."""
    if isinstance(group, SPGroups):  # only the attention op runs both levels
        raise TypeError(
            "seq_to_head/head_to_seq: group is an SPGroups (2-D); the bare exchanges run inside one group: "
            "pass its ulysses_group (and a HeadPlan over ulysses_size ranks)"
        )
    return comm if comm is not None else get_communicator(group)


def _transport(group, comm, members: Communicator, device: torch.device, traced: bool) -> Communicator:
    """The communicator that moves the data: ``comm`` if given; inside torch.compile the
    members' (torch's collectives trace as functional collectives); else the group's
    default for ``device`` (``comm.get_communicator``), which is the members' own
    torch.distributed unless native NCCL is switched on for CUDA tensors (then looked up
    per call: torch creates the group's communicator at its first collective)."""
    if comm is not None or traced or device.type != "cuda" or not native_nccl_enabled():
        return members
    return get_communicator(group, device=device)


def _named(x) -> bool:
    """``None`` or a name: a value the call's pieces can be cached by."""
    return x is None or isinstance(x, str)


class Parts(NamedTuple):
    """What a call's values decide (``checks.CallKey``, the backend and kernel-set names),
    resolved by ``resolve`` (after ``checks.check_call``) in this order: the ``HeadPlan`` and
    this rank's ``Layout``, the backend (``base``: ``backends.backend_of``'s pick;
    ``split_kv_groups``: it is a built-in ``AttentionBackend``, so the chunked pipeline may
    split a shared KV head; ``backend``: what this rank runs, ``for_rank``), the kernel set and
    the softmax scale (``checked_scale`` of the key's, already checked: a float or the default)."""

    plan: HeadPlan
    layout: Layout
    scale: float
    base: object = None
    split_kv_groups: bool = False
    backend: object = None
    kernels: KernelSet | None = None


_GIVEN = object()  # resolve()'s stand-in for a backend or kernel set given as an object


def _resolve(key: CallKey, attn_fn, kernels, traced: bool, kept: Parts | None = None) -> Parts:
    """``Parts`` of ``key``, computed (``resolve`` keeps them); ``_GIVEN`` for ``attn_fn`` or
    ``kernels``: left for the caller. ``kept``: the key's kept parts, into which a backend or
    kernel set given as an object is put (per call): the one place both are resolved."""
    parts = kept
    if parts is None:
        plan, world = key.plan, key.world_size
        if plan is None:
            plan = HeadPlan.build(key.q_shape[2], key.k_shape[2], world)
        elif plan.world_size != world:
            raise UlyssesInputError(f"ulysses_attention: plan.world_size expected {world} (the group), got {plan.world_size}")
        lens = key.seq_lens if key.seq_lens is not None else (key.q_shape[1],) * world
        layout = Layout(plan, key.rank, lens, key.q_shape[0], key.q_shape[3], key.v_shape[3])
        parts = Parts(plan, layout, checked_scale(key.q_shape[3], key.scale))
    if attn_fn is not _GIVEN:
        base = backend_of(attn_fn, key.q_device, key.q_dtype)
        parts = parts._replace(base=base, split_kv_groups=isinstance(base, AttentionBackend), backend=for_rank(base, parts.layout.kv_map))
    if kernels is not _GIVEN:
        parts = parts._replace(kernels=get_kernels(kernels, key.q_device, parts.layout, traceable=traced))
    return parts


# Bounded, keyed by values (a few hundred input signatures, a few KB each; never by a group),
# and by the kernel-set registry's generation (a set registered or replaced later is seen by
# later calls). A key that fails is not kept: it raises again, the same error, on its next call.
@functools.lru_cache(maxsize=512)
def _kept(key: CallKey, attn_fn, kernels, generation: int) -> Parts:
    return _resolve(key, attn_fn, kernels, False)


def resolve(key: CallKey, attn_fn, kernels, traced: bool = False) -> Parts:
    """The call's ``Parts``: once per key for a named (or default) backend and kernel set. A
    backend or kernel set given as an object is its own answer, put in per call around the
    kept rest (an object is never a cache key: a closure would keep its tensors alive).
    Inside torch.compile (``traced``) computed per trace, the kernel set a traceable one."""
    if traced:
        return _resolve(key, attn_fn, kernels, True)
    fn_named, kern_named = _named(attn_fn), _named(kernels)
    parts = _kept(key, attn_fn if fn_named else _GIVEN, kernels if kern_named else _GIVEN, registry_generation())
    if fn_named and kern_named:
        return parts
    return _resolve(key, _GIVEN if fn_named else attn_fn, _GIVEN if kern_named else kernels, False, kept=parts)


def _resolve_chunks(chunks, layout: Layout, itemsize: int, causal: bool, device_type: str, split_kv_groups: bool) -> int:
    """The number of head chunks the call runs: ``chunks`` (an int >= 1, or ``"auto"``:
    ``chunked.choose_chunks``'s cost model), capped by what the plan can split."""
    if chunks == "auto":
        n = choose_chunks(layout, itemsize, causal, device_type, split_kv_groups=split_kv_groups)
    elif isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1:
        n = chunks
    else:
        raise ValueError(f"ulysses_attention: chunks expected an int >= 1 or 'auto', got {chunks!r}")
    if n > 1 and chunks_recompute_apart():
        warnings.warn(
            f"ulysses_attention: chunks={chunks!r} runs as 1 chunk under activation checkpointing (saved-tensor hooks) on "
            f"torch {torch.__version__}: before torch 2.9 (torch.utils.checkpoint.GraphExecGroup) the chunked backward "
            "would recompute the region once per chunk, unevenly across ranks (a hang); upgrade torch for the overlap",
            stacklevel=5,
        )
        return 1
    return 1 if n == 1 else len(chunk_plans(layout.plan, n, split_kv_groups=split_kv_groups))


def setup_attention(
    q,
    k,
    v,
    *,
    group,
    comm,
    plan,
    seq_lens,
    causal,
    softmax_scale,
    attn_fn,
    kernels,
    chunks,
    check,
    cu_seqlens=None,
    max_seqlen=None,
    members: Communicator | None = None,
    wire_dtype=None,
) -> CallSetup:
    """The ``CallSetup`` of ``ulysses_attention`` (arguments as documented there).
    ``members``: the group's members when the caller holds them (``UlyssesAttention``).

    ``group`` an ``SPGroups`` (2-D): the Ulysses group takes the place of the group (members,
    checks, plan, exchange; ``comm``, if given, is the Ulysses group's) and the rank's backend
    is ``ring.RingBackend`` around the built-in backend, which the chunked pipeline runs per
    head chunk like any backend; packed documents (``cu_seqlens``) go to it as ``docs=``
    (their checks against the whole group: ``ring.check_ring_inputs``)."""
    if isinstance(group, SPGroups):
        return _setup_2d(group, q, k, v, comm=comm, plan=plan, seq_lens=seq_lens, causal=causal, softmax_scale=softmax_scale,
                         attn_fn=attn_fn, kernels=kernels, chunks=chunks, check=check, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         wire_dtype=wire_dtype)  # fmt: skip
    docs = None if cu_seqlens is None and max_seqlen is None else documents(cu_seqlens, max_seqlen)
    return _setup_flat(q, k, v, group=group, comm=comm, members=members, plan=plan, seq_lens=seq_lens, causal=causal, softmax_scale=softmax_scale,
                       attn_fn=attn_fn, kernels=kernels, chunks=chunks, check=check, docs=docs, wire_dtype=wire_dtype)[0]  # fmt: skip


def _setup_flat(q, k, v, *, group, comm, members, plan, seq_lens, causal, softmax_scale, attn_fn, kernels, chunks, check, docs,
                wire_dtype) -> tuple[CallSetup, Parts]:  # fmt: skip
    """``setup_attention`` inside one group, in the module docstring's order; with the ``Parts``."""
    traced = in_trace()
    if members is None:
        members = members_of(group, comm)
    key = call_key(q, k, v, rank=members.rank, world_size=members.world_size, causal=causal, softmax_scale=softmax_scale,
                   seq_lens=seq_lens, plan=plan, docs=docs)  # fmt: skip
    check_call(key, members, q.device, check, traced)
    parts = resolve(key, attn_fn, kernels, traced)
    layout, split = parts.layout, parts.split_kv_groups
    n = 1 if traced or (type(chunks) is int and chunks == 1) else _resolve_chunks(chunks, layout, q.element_size(), causal, q.device.type, split)
    comm = _transport(group, comm, members, q.device, traced)
    wire = None if wire_dtype is None else resolve_wire(wire_dtype, parts.kernels, members.world_size)
    routes = call_routes(layout, wire)
    call = CallSetup(parts.plan, layout, comm, parts.kernels, parts.backend, split, bool(causal), parts.scale, layout.kv_map, n, traced, docs, wire, routes)
    return call, parts


def _setup_2d(sp: SPGroups, q, k, v, *, comm, plan, seq_lens, causal, softmax_scale, attn_fn, kernels, chunks, check, cu_seqlens,
              max_seqlen, wire_dtype=None) -> CallSetup:  # fmt: skip
    """``setup_attention`` for a 2-D group: the flat set-up inside this rank's Ulysses group,
    then the whole 2-D group's agreement (``ring.check_ring_inputs``: every rank raises when
    any rank's inputs are bad, the Ulysses group's error included; packed documents are
    checked there, against the whole group's length); the rank's backend is
    ``ring.RingBackend`` around the resolved one."""
    if in_trace():
        raise NotImplementedError(
            "ulysses_attention: a 2-D group (SPGroups, ring attention) does not run inside torch.compile yet; "
            "run the op eagerly (torch.compiler.disable) or pass a flat group"
        )
    sp.member_rank()
    docs = documents(cu_seqlens, max_seqlen)
    failed = call = None
    try:
        lens = None if seq_lens is None else (int(seq_lens[0]),) * sp.ulysses_size  # equal shards: checked below
        call, parts = _setup_flat(q, k, v, group=sp.ulysses_group, comm=comm, members=None, plan=plan, seq_lens=lens, causal=causal,
                                  softmax_scale=softmax_scale, attn_fn=attn_fn, kernels=kernels, chunks=chunks, check=check, docs=None,
                                  wire_dtype=wire_dtype)  # fmt: skip
    except UlyssesInputError as e:
        failed = e
    # A rank whose set-up failed raises its own error in check_ring_inputs: its scale is never compared.
    scale_bits = float_bits(call.scale) if call is not None else 0
    check_ring_inputs(sp, q, k, causal=causal, scale_bits=scale_bits, seq_lens=seq_lens, failed=failed, check=check, docs=docs, v=v)
    return call._replace(backend=ring_backend(sp, parts.base), docs=docs)


def setup_exchange(q, k, v, *, group, comm, plan, seq_lens, kernels, check, wire_dtype=None) -> CallSetup:
    """The ``CallSetup`` of ``seq_to_head``: ``k``, ``v`` may be None (q moves alone; the
    plan's KV head count is used for the checks). ``wire_dtype``: as for ``setup_attention``
    (``seq_to_head`` moves its tensors in the ``qkv`` format, their gradients in ``grads``)."""
    traced = in_trace()
    if (k is None) != (v is None):
        raise UlyssesInputError("seq_to_head: pass both k and v, or neither")
    roles = QKV if k is not None else Q_ONLY
    if k is None:
        # q alone: stand-in k/v views with the plan's KV head count, for the checks only.
        kv_heads = plan.kv_heads if plan is not None else q.shape[2] if q.dim() == 4 else 1
        k = v = q[:, :, :kv_heads] if q.dim() == 4 else q
    members = members_of(group, comm)
    key = call_key(q, k, v, rank=members.rank, world_size=members.world_size, causal=False, softmax_scale=None, seq_lens=seq_lens, plan=plan)
    check_call(key, members, q.device, check, traced)
    parts = resolve(key, None, kernels, traced)  # the default backend's name: resolved, not run
    comm = _transport(group, comm, members, q.device, traced)
    wire = None if wire_dtype is None else resolve_wire(wire_dtype, parts.kernels, members.world_size)
    routes = call_routes(parts.layout, wire, roles, out=False)
    return CallSetup(parts.plan, parts.layout, comm, parts.kernels, traced=traced, wire=wire, routes=routes)


def setup_head_to_seq(x, plan: HeadPlan, *, group, comm, seq_lens, kernels, wire_dtype=None) -> CallSetup:
    """The ``CallSetup`` of ``head_to_seq``: rank-local checks of ``x`` against ``plan``
    (``UlyssesInputError``, as every entry point raises). ``wire_dtype``: ``x`` moves in the
    ``out`` format, its gradient in ``dout``."""
    traced = in_trace()
    members = members_of(group, comm)
    lens = check_head_to_seq(x, plan, rank=members.rank, world_size=members.world_size, seq_lens=seq_lens)
    if traced or not _named(kernels):
        layout = Layout(plan, members.rank, lens, x.shape[0], x.shape[3])
        kern = get_kernels(kernels, x.device, layout, traceable=traced)
    else:
        layout, kern = _kept_head_to_seq(plan, members.rank, lens, x.shape[0], x.shape[3], kernels, x.device, registry_generation())
    comm = _transport(group, comm, members, x.device, traced)
    wire = None if wire_dtype is None else resolve_wire(wire_dtype, kern, members.world_size)
    return CallSetup(plan, layout, comm, kern, traced=traced, wire=wire, routes=call_routes(layout, wire, (), out=True))


@functools.lru_cache(maxsize=512)
def _kept_head_to_seq(plan: HeadPlan, rank: int, lens: tuple[int, ...], batch: int, dim: int, kernels, device: torch.device, generation: int):
    """``head_to_seq``'s ``Layout`` and kernel set, once per value key (as ``resolve``'s; the
    ``Layout`` keeps its memoized splits across calls)."""
    layout = Layout(plan, rank, lens, batch, dim)
    return layout, get_kernels(kernels, device, layout)
