"""One call set-up: the arguments of a Ulysses call, resolved once into a frozen value.

Every entry point (``ulysses_attention`` and its module, ``seq_to_head``, ``head_to_seq``,
the compiled path and the chunked pipeline) calls ``setup_attention`` or
``setup_exchange`` and hands the resulting ``CallSetup`` down; nothing below re-derives
the plan, the layout, the communicator, the kernel set, the attention backend (with the
shared-KV rule of ``backends.for_rank``), the scale, the KV map or the chunk count.

Order of resolution, the same for every entry point:

1. the group's members (``comm`` if given, else torch.distributed on ``group``, or a
   world of one): rank, world size and the small all-gather of the input checks;
2. the input checks (``checks.prepare``: the same error on every rank) and, from them,
   the ``HeadPlan`` and this rank's ``Layout``;
3. the communicator that moves the data (``comm`` if given, else the group's default
   for the tensors' device; chosen after the checks because torch creates a group's NCCL
   communicator at the group's first collective, which the checks' all-gather may be);
4. the kernel set, the attention backend, the scale and the chunk count.

Resolved once per input signature. Steps 2 and 4 depend on values only (shapes, dtypes,
devices, options, the rank and world size; ``checks.call_key``), so each is computed once
per key and kept in bounded caches keyed by those values, never by a group (``checks``'
for the plan and ``Layout``, ``_cached_parts`` here for the backend, kernel set and scale, with a
backend or kernel set given as an object resolved per call: it is its own answer). What
remains per call is what cannot be cached by value: the members (the group's rank and world
size, a few attribute reads), ``check=True``'s all-gather, and the chunk count when
``chunks`` is not 1 (it depends on saved-tensor hooks being active). ``UlyssesAttention``
goes further: it keeps each signature's whole ``CallSetup`` (its own group's members and
communicator included), so its calls after the first resolve nothing.

Inside ``torch.compile`` (``traced``) the checks are rank-local, the kernel set must be
traceable, the communicator is the members' (torch's functional collectives) and
``chunks`` is 1 (see ``attention.traced``).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch

from ..backends import AttentionBackend, for_rank, named_backend, resolve_backend
from ..checkpointing import chunks_recompute_apart
from ..checks import CallKey, UlyssesInputError, call_key, check_across_ranks, check_head_to_seq, float_bits, planned, prepare
from ..comm import Communicator, get_communicator, native_nccl_enabled
from ..documents import Documents, documents
from ..kernels import KernelSet, get_kernels, registry_generation
from ..layout import Layout
from ..math_attention import default_scale
from ..plan import HeadPlan
from ..ring import SPGroups, check_ring_inputs, ring_backend
from ..wire import WireSpec, resolve_wire
from .chunked import choose_chunks, chunk_plans

__all__ = ["CallSetup", "members_of", "setup_attention", "setup_exchange", "setup_head_to_seq"]


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
    the attention dtype on the wire (the default; always with one rank).
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


def _kernel_set(kernels, device: torch.device, layout: Layout, traced: bool) -> KernelSet:
    """``get_kernels``' set for the call: once per value key for a name (or None/"auto");
    a kernel-set object is its own answer."""
    if traced or not _named(kernels):
        return get_kernels(kernels, device, layout, traceable=traced)
    return _cached_kernel_set(kernels, device, layout, registry_generation())


@functools.lru_cache(maxsize=512)
def _cached_kernel_set(name, device: torch.device, layout: Layout, generation: int) -> KernelSet:
    # The registry's generation: a set registered (or replaced) later is seen by later calls.
    return get_kernels(name, device, layout)


def _backend(attn_fn, q: torch.Tensor, kv_map: tuple[int, ...], traced: bool):
    """``(base, split_kv_groups, backend)``: ``resolve_backend``'s pick, whether it is a built-in
    ``AttentionBackend`` (the chunked pipeline may then split a shared KV head), and the
    rank's backend (``for_rank``). Once per value key for a name (or None); a backend or a
    callable given as an object is wrapped per call (nothing to resolve)."""
    if traced or not _named(attn_fn):
        base = resolve_backend(attn_fn, q)
        return base, isinstance(base, AttentionBackend), for_rank(base, kv_map)
    return _cached_backend(attn_fn, q.device, q.dtype, kv_map)


@functools.lru_cache(maxsize=512)
def _cached_backend(attn_fn: str | None, device: torch.device, dtype: torch.dtype, kv_map: tuple[int, ...]):
    # Built-in backends hold no state: one object serves every call of a key.
    base = named_backend(attn_fn, device, dtype)
    return base, isinstance(base, AttentionBackend), for_rank(base, kv_map)


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
            stacklevel=4,
        )
        return 1
    return 1 if n == 1 else len(chunk_plans(layout.plan, n, split_kv_groups=split_kv_groups))


def _prepare_2d(sp: SPGroups, q, k, v, *, members, plan, seq_lens, causal, softmax_scale, check, docs):
    """``prepare`` inside this rank's Ulysses group, then the whole 2-D group's agreement
    (``ring.check_ring_inputs``: every rank raises when any rank's inputs are bad; packed
    documents are checked there, against the whole group's length)."""
    failed = None
    try:
        lens = None if seq_lens is None else (int(seq_lens[0]),) * sp.ulysses_size  # equal shards: checked below
        prepared = prepare(q, k, v, comm=members, plan=plan, seq_lens=lens, causal=causal, softmax_scale=softmax_scale, check=check)
    except UlyssesInputError as e:
        failed, prepared = e, None
    scale = default_scale(q.shape[3], softmax_scale) if q.dim() == 4 else 0.0
    check_ring_inputs(sp, q, k, causal=causal, scale_bits=float_bits(scale), seq_lens=seq_lens, failed=failed, check=check, docs=docs, v=v)
    return prepared


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
    traced = torch.compiler.is_compiling()
    if isinstance(group, SPGroups):
        return _setup_2d(group, q, k, v, comm=comm, plan=plan, seq_lens=seq_lens, causal=causal, softmax_scale=softmax_scale,
                         attn_fn=attn_fn, kernels=kernels, chunks=chunks, check=check, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         wire_dtype=wire_dtype)  # fmt: skip
    if members is None:
        members = members_of(group, comm)
    docs = None if cu_seqlens is None and max_seqlen is None else documents(cu_seqlens, max_seqlen)
    key = call_key(q, k, v, rank=members.rank, world_size=members.world_size, causal=causal, softmax_scale=softmax_scale,
                   seq_lens=seq_lens, plan=plan, docs=docs)  # fmt: skip
    if check and not traced and members.world_size > 1:
        check_across_ranks(key, members, q.device)
    if not traced and (attn_fn is None or type(attn_fn) is str) and (kernels is None or type(kernels) is str):
        parts = _cached_parts(key, attn_fn, kernels, registry_generation())  # the common case: once per input signature
    else:
        parts = _resolve_parts(key, q, attn_fn, kernels, traced)
    plan, layout, kv_map, base, split, backend, kern, scale = parts
    n = 1 if traced or (type(chunks) is int and chunks == 1) else _resolve_chunks(chunks, layout, q.element_size(), causal, q.device.type, split)
    comm = _transport(group, comm, members, q.device, traced)
    wire = None if wire_dtype is None else resolve_wire(wire_dtype, kern, members.world_size, traced)
    return CallSetup(plan, layout, comm, kern, backend, split, bool(causal), scale, kv_map, n, traced, docs, wire)


def _resolve_parts(key: CallKey, q: torch.Tensor, attn_fn, kernels, traced: bool) -> tuple:
    """``(plan, layout, kv_map, base, split_kv_groups, backend, kernel set, scale)`` of the flat
    call ``key`` (``checks.call_key``): the checks with the plan and the ``Layout``
    (``checks.planned``), ``resolve_backend``'s pick, whether it is a built-in
    ``AttentionBackend`` (the chunked pipeline may then split a shared KV head), the rank's
    backend (``for_rank``), ``get_kernels``' set and the softmax scale."""
    plan, layout = planned(key)
    kv_map = layout.kv_map
    base, split, backend = _backend(attn_fn, q, kv_map, traced)
    return plan, layout, kv_map, base, split, backend, _kernel_set(kernels, q.device, layout, traced), default_scale(key.q_shape[3], key.scale)


@functools.lru_cache(maxsize=512)
def _cached_parts(key: CallKey, attn_fn: str | None, kernels: str | None, generation: int) -> tuple:
    """``_resolve_parts`` for a named (or default) backend and kernel set, once per key and
    kernel-set registry generation (only keys that pass the checks are kept)."""
    plan, layout = planned(key)
    device, dtype = key.q_device, key.q_dtype
    base, split, backend = _cached_backend(attn_fn, device, dtype, layout.kv_map)
    kern = _cached_kernel_set(kernels, device, layout, generation)
    return plan, layout, layout.kv_map, base, split, backend, kern, default_scale(key.q_shape[3], key.scale)


def _setup_2d(sp: SPGroups, q, k, v, *, comm, plan, seq_lens, causal, softmax_scale, attn_fn, kernels, chunks, check, cu_seqlens,
              max_seqlen, wire_dtype=None) -> CallSetup:  # fmt: skip
    """``setup_attention`` for a 2-D group (resolved per call: the ring level agrees across
    the whole group, ``_prepare_2d``)."""
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "ulysses_attention: a 2-D group (SPGroups, ring attention) does not run inside torch.compile yet; "
            "run the op eagerly (torch.compiler.disable) or pass a flat group"
        )
    sp.member_rank()
    group = sp.ulysses_group
    members = members_of(group, comm)
    docs = documents(cu_seqlens, max_seqlen)
    plan, layout = _prepare_2d(
        sp, q, k, v, members=members, plan=plan, seq_lens=seq_lens, causal=causal, softmax_scale=softmax_scale, check=check, docs=docs,
    )  # fmt: skip
    comm = _transport(group, comm, members, q.device, False)
    base, split, _ = _backend(attn_fn, q, layout.kv_map, False)
    kern = _kernel_set(kernels, q.device, layout, False)
    n = 1 if type(chunks) is int and chunks == 1 else _resolve_chunks(chunks, layout, q.element_size(), causal, q.device.type, split)
    wire = None if wire_dtype is None else resolve_wire(wire_dtype, kern, members.world_size, False)
    return CallSetup(plan, layout, comm, kern, ring_backend(sp, base), split, bool(causal), default_scale(q.shape[3], softmax_scale),
                     layout.kv_map, n, False, docs, wire)  # fmt: skip


def setup_exchange(q, k, v, *, group, comm, plan, seq_lens, kernels, check, wire_dtype=None) -> CallSetup:
    """The ``CallSetup`` of ``seq_to_head``: ``k``, ``v`` may be None (q moves alone; the
    plan's KV head count is used for the checks). ``wire_dtype``: as for ``setup_attention``
    (``seq_to_head`` moves its tensors in the ``qkv`` format, their gradients in ``grads``)."""
    traced = torch.compiler.is_compiling()
    if (k is None) != (v is None):
        raise UlyssesInputError("seq_to_head: pass both k and v, or neither")
    if k is None:
        # q alone: stand-in k/v views with the plan's KV head count, for the checks only.
        kv_heads = plan.kv_heads if plan is not None else q.shape[2] if q.dim() == 4 else 1
        k = v = q[:, :, :kv_heads] if q.dim() == 4 else q
    members = members_of(group, comm)
    plan, layout = prepare(q, k, v, comm=members, plan=plan, seq_lens=seq_lens, causal=False, softmax_scale=None, check=check and not traced)
    comm = _transport(group, comm, members, q.device, traced)
    kern = _kernel_set(kernels, q.device, layout, traced)
    wire = None if wire_dtype is None else resolve_wire(wire_dtype, kern, members.world_size, traced)
    return CallSetup(plan, layout, comm, kern, traced=traced, wire=wire)


def setup_head_to_seq(x, plan: HeadPlan, *, group, comm, seq_lens, kernels, wire_dtype=None) -> CallSetup:
    """The ``CallSetup`` of ``head_to_seq``: rank-local checks of ``x`` against ``plan``
    (``UlyssesInputError``, as every entry point raises). ``wire_dtype``: ``x`` moves in the
    ``out`` format, its gradient in ``dout``."""
    traced = torch.compiler.is_compiling()
    members = members_of(group, comm)
    layout = check_head_to_seq(x, plan, rank=members.rank, world_size=members.world_size, seq_lens=seq_lens)
    comm = _transport(group, comm, members, x.device, traced)
    kern = _kernel_set(kernels, x.device, layout, traced)
    wire = None if wire_dtype is None else resolve_wire(wire_dtype, kern, members.world_size, traced)
    return CallSetup(plan, layout, comm, kern, traced=traced, wire=wire)
