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

Inside ``torch.compile`` (``traced``) the checks are rank-local, the kernel set must be
traceable, the communicator is the members' (torch's functional collectives) and
``chunks`` is 1 (see ``attention.traced``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..backends import AttentionBackend, for_rank, resolve_backend
from ..checkpointing import chunks_recompute_apart
from ..checks import UlyssesInputError, check_head_to_seq, float_bits, prepare
from ..comm import Communicator, get_communicator
from ..documents import Documents, documents
from ..kernels import KernelSet, get_kernels
from ..layout import Layout
from ..plan import HeadPlan
from ..reference import default_scale
from ..ring import SPGroups, check_ring_inputs, ring_backend
from .chunked import choose_chunks, chunk_plans

__all__ = ["CallSetup", "setup_attention", "setup_exchange", "setup_head_to_seq"]


@dataclass(frozen=True)
class CallSetup:
    """Everything one call needs, resolved (see the module docstring).

    ``backend``: what this rank runs (``backends.for_rank``'s pick: ``SharedKV`` around a
    built-in backend on a rank whose query heads share its one KV head), ``None`` for the
    bare exchanges. ``split_groups``: the backend is a built-in one, so the chunked
    pipeline may split a shared KV head's query heads (the same answer on every rank).
    ``chunks``: the resolved chunk count (1: the unchunked op). ``docs``: the document
    boundaries of a packed sequence (``documents.Documents``: the global ``cu_seqlens``,
    which are also every rank's view after the sequence-to-head exchange), ``None`` for
    ordinary batches; the backend receives them as ``docs=``.
    """

    plan: HeadPlan
    layout: Layout
    comm: Communicator
    kernels: KernelSet
    backend: object | None = None
    split_groups: bool = False
    causal: bool = False
    scale: float = 1.0
    kv_map: tuple[int, ...] = ()
    chunks: int = 1
    traced: bool = False
    docs: Documents | None = None


def _members(group, comm) -> Communicator:
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
    default for ``device`` (``comm.get_communicator``)."""
    if comm is not None or traced:
        return members
    return get_communicator(group, device=device)


def _resolve_chunks(chunks, layout: Layout, itemsize: int, causal: bool, device_type: str, split_groups: bool) -> int:
    """The number of head chunks the call runs: ``chunks`` (an int >= 1, or ``"auto"``:
    ``chunked.choose_chunks``'s cost model), capped by what the plan can split."""
    if chunks == "auto":
        n = choose_chunks(layout, itemsize, causal, device_type, split_groups=split_groups)
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
    return 1 if n == 1 else len(chunk_plans(layout.plan, n, split_groups=split_groups))


def _prepare_2d(sp: SPGroups, q, k, v, *, members, plan, seq_lens, causal, softmax_scale, check):
    """``prepare`` inside this rank's Ulysses group, then the whole 2-D group's agreement
    (``ring.check_ring_inputs``: every rank raises when any rank's inputs are bad)."""
    failed = None
    try:
        lens = None if seq_lens is None else (int(seq_lens[0]),) * sp.ulysses_size  # equal shards: checked below
        prepared = prepare(q, k, v, comm=members, plan=plan, seq_lens=lens, causal=causal, softmax_scale=softmax_scale, check=check)
    except UlyssesInputError as e:
        failed, prepared = e, None
    scale = default_scale(q.shape[3], softmax_scale) if q.dim() == 4 else 0.0
    check_ring_inputs(sp, q, k, causal=causal, scale_bits=float_bits(scale), seq_lens=seq_lens, failed=failed, check=check)
    return prepared


def setup_attention(
    q, k, v, *, group, comm, plan, seq_lens, causal, softmax_scale, attn_fn, kernels, chunks, check, cu_seqlens=None, max_seqlen=None
) -> CallSetup:
    """The ``CallSetup`` of ``ulysses_attention`` (arguments as documented there).

    ``group`` an ``SPGroups`` (2-D): the Ulysses group takes the place of the group (members,
    checks, plan, exchange; ``comm``, if given, is the Ulysses group's) and the rank's backend
    is ``ring.RingBackend`` around the built-in backend, which the chunked pipeline runs per
    head chunk like any backend. Packed documents (``cu_seqlens``) with a 2-D group are
    refused (a ``ValueError`` raised alike on every rank: it depends on the arguments only)."""
    traced = torch.compiler.is_compiling()
    sp = group if isinstance(group, SPGroups) else None
    if sp is not None:
        if traced:
            raise NotImplementedError(
                "ulysses_attention: a 2-D group (SPGroups, ring attention) does not run inside torch.compile yet; "
                "run the op eagerly (torch.compiler.disable) or pass a flat group"
            )
        sp.member_rank()
        group = sp.ulysses_group
    members = _members(group, comm)
    docs = documents(cu_seqlens, max_seqlen)
    if sp is not None:
        if docs is not None:
            raise ValueError(
                "ulysses_attention: packed documents (cu_seqlens) with a 2-D group (SPGroups, ring attention) are not supported "
                "yet; pass a flat Ulysses group for packed batches, or unpacked batches to the 2-D group"
            )
        plan, layout = _prepare_2d(sp, q, k, v, members=members, plan=plan, seq_lens=seq_lens, causal=causal, softmax_scale=softmax_scale, check=check)
    else:
        plan, layout = prepare(
            q, k, v, comm=members, plan=plan, seq_lens=seq_lens, causal=causal, softmax_scale=softmax_scale,
            check=check and not traced, docs=docs,
        )  # fmt: skip
    comm = _transport(group, comm, members, q.device, traced)
    kv_map = plan.local_kv_map(layout.rank)
    base = resolve_backend(attn_fn, q)
    split = isinstance(base, AttentionBackend)
    kern = get_kernels(kernels, q.device, layout, traceable=traced)
    n = 1 if traced else _resolve_chunks(chunks, layout, q.element_size(), causal, q.device.type, split)
    backend = ring_backend(sp, base) if sp is not None else for_rank(base, kv_map)
    return CallSetup(
        plan, layout, comm, kern, backend, split, bool(causal), default_scale(q.shape[3], softmax_scale), kv_map, n, traced,
        docs,
    )  # fmt: skip


def setup_exchange(q, k, v, *, group, comm, plan, seq_lens, kernels, check) -> CallSetup:
    """The ``CallSetup`` of ``seq_to_head``: ``k``, ``v`` may be None (q moves alone; the
    plan's KV head count is used for the checks)."""
    traced = torch.compiler.is_compiling()
    if (k is None) != (v is None):
        raise UlyssesInputError("seq_to_head: pass both k and v, or neither")
    if k is None:
        # q alone: stand-in k/v views with the plan's KV head count, for the checks only.
        kv_heads = plan.kv_heads if plan is not None else q.shape[2] if q.dim() == 4 else 1
        k = v = q[:, :, :kv_heads] if q.dim() == 4 else q
    members = _members(group, comm)
    plan, layout = prepare(q, k, v, comm=members, plan=plan, seq_lens=seq_lens, causal=False, softmax_scale=None, check=check and not traced)
    comm = _transport(group, comm, members, q.device, traced)
    return CallSetup(plan, layout, comm, get_kernels(kernels, q.device, layout, traceable=traced), traced=traced)


def setup_head_to_seq(x, plan: HeadPlan, *, group, comm, seq_lens, kernels) -> CallSetup:
    """The ``CallSetup`` of ``head_to_seq``: rank-local checks of ``x`` against ``plan``
    (``UlyssesInputError``, as every entry point raises)."""
    traced = torch.compiler.is_compiling()
    members = _members(group, comm)
    layout = check_head_to_seq(x, plan, rank=members.rank, world_size=members.world_size, seq_lens=seq_lens)
    comm = _transport(group, comm, members, x.device, traced)
    return CallSetup(plan, layout, comm, get_kernels(kernels, x.device, layout, traceable=traced), traced=traced)
