"""Input checks that raise the same error on every rank.

Each rank encodes what it was given (shapes, dtypes, devices, options) as a short list of
ints. With ``check=True`` the lists are exchanged in one small all-gather and every rank
runs the same pure-Python validator over all of them, so a bad tensor on rank 3 raises the
same error (naming rank 3, the tensor, the expected and the actual value) on every rank
instead of raising on rank 3 and leaving the others waiting in the all-to-all.

With ``check=False`` only the local list is validated: cheaper (no collective, no host
sync), but a rank-local error then raises on that rank alone and the contract that all
ranks pass the same shapes and options is the caller's.

Inside ``torch.compile`` only the local checks run, once, while tracing (shapes are static
in a graph, and the all-gather plus host decode would break it); the exchange is skipped
whatever ``check`` says (``ulysses_kernels.attention.traced``).

Each call checks once per input signature. ``call_key`` turns the inputs into a small key
of values (shapes, dtypes, devices, options; no tensor), and what follows from the key
alone is computed once per key and kept in bounded caches keyed by those values (never by a
group): the encoded signature a rank sends (``encoded``) and the verdict on a gathered set of
signatures (``_validate_gathered``, keyed by every rank's integers) and the rank-local
verdict (``check_rank``, once per key). ``check_call`` is the one entry: every check of a
call, before ``attention.call.resolve`` plans it. A key that fails is not kept: it raises
again, the same error, on its next call. So ``check=True`` costs the one all-gather per call
and nothing else. Checking only: planning is ``attention.call``'s.
"""

from __future__ import annotations

import functools
import math
import numbers
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .documents import Documents, boundaries_digest, first_unordered, longest_document
from .plan import HeadPlan, more_ranks_than_heads

__all__ = [
    "UlyssesInputError", "softmax_scale_value", "Signature", "signature", "validate", "CallKey", "call_key", "check_rank", "check_across_ranks",
    "encoded", "check_head_to_seq", "dtype_code", "float_bits", "rank_list", "by_value", "document_summary", "document_problems", "document_text",
]  # fmt: skip

_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
_DEVICES = ["cpu", "cuda", "meta", "xpu", "mps"]
_FLOAT_CODES = range(6)  # the floating-point entries of _DTYPES: what attention and the exchange take


class UlyssesInputError(ValueError):
    """Inputs that the sequence-parallel group cannot run, raised on every rank."""


def dtype_code(dtype: torch.dtype) -> int:
    """A small int naming ``dtype`` in the integers ranks exchange (the per-call signature,
    the ring level's agreement check)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if code < len(_DTYPES) else "other"


def _device_code(device: torch.device) -> int:
    return _DEVICES.index(device.type) if device.type in _DEVICES else len(_DEVICES)


def _device_name(code: int, index: int) -> str:
    name = _DEVICES[code] if code < len(_DEVICES) else "other"
    return name if index < 0 else f"{name}:{index}"


def rank_list(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 7]`` as ``"ranks 0-3, 7"`` (``"rank 5"`` for one): an error names a set of
    ranks in a line that does not grow with the world."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def by_value(values: Sequence, shown=str) -> str:
    """Per-rank ``values`` grouped by value, in order of first appearance: ``"ranks 0-2, 4
    have float32; rank 3 has float16"``."""
    groups: dict = {}
    for rank, x in enumerate(values):
        groups.setdefault(x, []).append(rank)
    return "; ".join(f"{rank_list(rs)} {'has' if len(rs) == 1 else 'have'} {shown(x)}" for x, rs in groups.items())


def float_bits(x: float) -> int:
    """The IEEE-754 bits of ``x`` as a float64, as an int: ranks compare scales exactly."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


@dataclass
class Signature:
    """What one rank was given, as ints (see ``encode``/``decode``)."""

    rank: int
    world_size: int
    shapes: tuple[tuple[int, ...], ...]  # q, k, v
    dtypes: tuple[int, int, int]
    devices: tuple[tuple[int, int], ...]  # (type code, index) per tensor
    causal: int
    scale_bits: int
    seq_lens: tuple[int, ...] | None
    plan_heads: tuple[int, int] | None  # (q_heads, kv_heads) of a prebuilt plan
    docs: tuple[int, ...] = ()  # packed documents: ``document_summary`` (empty: none)

    def encode(self) -> list[int]:
        vals = [self.rank, self.world_size]
        for shape in self.shapes:
            vals += [len(shape)] + list(shape[:4]) + [-1] * (4 - min(len(shape), 4))
        vals += list(self.dtypes)
        for dev in self.devices:
            vals += list(dev)
        vals += [self.causal, self.scale_bits]
        vals += [-1, -1] if self.plan_heads is None else list(self.plan_heads)
        vals += [0] + [0] * self.world_size if self.seq_lens is None else [1] + list(self.seq_lens)
        vals += [len(self.docs)] + list(self.docs) + [0] * (DOC_FIELDS - len(self.docs))
        return vals

    @classmethod
    def decode(cls, vals: Sequence[int]) -> Signature:
        it = iter(vals)
        rank, world = next(it), next(it)
        shapes = []
        for _ in range(3):
            n = next(it)
            dims = [next(it) for _ in range(4)]
            shapes.append(tuple(dims[: min(n, 4)]) + (("...",) if n > 4 else ()))
        dtypes = tuple(next(it) for _ in range(3))
        devices = tuple((next(it), next(it)) for _ in range(3))
        causal, scale_bits = next(it), next(it)
        ph = (next(it), next(it))
        plan_heads = None if ph[0] < 0 else ph
        given = next(it)
        lens = tuple(next(it) for _ in range(world))
        n_docs = next(it)
        docs = tuple(next(it) for _ in range(DOC_FIELDS))[:n_docs]
        return cls(rank, world, tuple(shapes), dtypes, devices, causal, scale_bits, lens if given else None, plan_heads, docs)


# The boundaries travel in the signature as a fixed-size summary (the all-gather needs one
# length on every rank): what the rank-local checks report, and a digest for agreement.
DOC_FIELDS = 11


def document_summary(docs: Documents | None) -> tuple[int, ...]:
    """``(entries, first, last, bad index, value before it, bad value, max_seqlen, longest
    document, digest, rows, bad row)``: ``bad index`` is the first boundary not above the one
    before it (-1: none); ``rows`` and ``bad row`` as in ``Documents``. What ranks exchange about their boundaries (here and in the 2-D group's
    check, ``ring.check_ring_inputs``); empty for ``None``."""
    if docs is None:
        return ()
    cu = docs.cu_seqlens
    bad = first_unordered(cu)
    first, last = (cu[0], cu[-1]) if cu else (0, 0)
    return (len(cu), first, last, bad, cu[bad - 1] if bad > 0 else 0, cu[bad] if bad > 0 else 0, docs.max_seqlen, longest_document(cu),
            boundaries_digest(cu), docs.rows, docs.bad_row)  # fmt: skip


def document_text(summary: Sequence[int]) -> str | None:
    """How a disagreement message shows one rank's boundaries (``document_summary``)."""
    if not summary:
        return None
    return f"{summary[0]} entries from {summary[1]} to {summary[2]} (digest {summary[8]:016x})"


def _doc_text(sig: Signature) -> str | None:
    return document_text(sig.docs)


def _doc_problems(sig: Signature, total: int) -> list[str]:
    """Rank-local problems of the boundaries of a packed sequence of ``total`` tokens."""
    how = "sum(seq_lens)" if sig.seq_lens is not None else "q.shape[1] x world size; pass seq_lens for uneven shards"
    return document_problems(sig.docs, sig.shapes[0][0], total, how)


def document_problems(summary: Sequence[int], batch: int, total: int, how: str) -> list[str]:
    """Problems of one rank's boundaries (``document_summary``) for a packed sequence of
    ``total`` tokens per row (``how``: where that length comes from) and batch ``batch``:
    one row's boundaries ``(0, ..., total)`` at batch 1, one such list per row above."""
    n, first, last, bad, before, value, max_seqlen, longest, _, rows, bad_row = summary
    if rows != batch:
        if batch == 1 or rows == 1:
            given = "one list of boundaries" if rows == 1 else f"{rows} lists of boundaries"
            return [f"cu_seqlens: packed documents at batch {batch} (q.shape[0]) take one list of boundaries (0, ..., {total}) per row, got {given}"]
        return [f"cu_seqlens expected one list of boundaries per row: {batch} (q.shape[0]), got {rows}"]
    if bad_row:
        return [f"cu_seqlens row {bad_row - 1}: expected boundaries from 0 to the global length {total} ({how}), as in every row"]
    if n < 2:
        return [f"cu_seqlens expected at least 2 entries (0 and the global length {total}), got {n}"]
    out = []
    if first != 0:
        out.append(f"cu_seqlens[0] expected 0, got {first}")
    if last != total * rows:
        what = f"{total} (the global sequence length: {how})" if rows == 1 else f"{total} in every row (the global sequence length: {how})"
        out.append(f"cu_seqlens[-1] expected {what}, got {last if rows == 1 else last // rows}")
    if bad > 0:
        where = "" if rows == 1 else " (rows joined end to end)"
        out.append(f"cu_seqlens must be strictly increasing (documents of length >= 1){where}: cu_seqlens[{bad}] = {value} <= cu_seqlens[{bad - 1}] = {before}")
    elif max_seqlen < longest:
        out.append(f"max_seqlen expected >= {longest} (the longest document), got {max_seqlen}")
    return out


def _tensors_and_lens(q, k, v, seq_lens, world_size: int) -> tuple[int, ...] | None:
    """The checks that come before any signature: q, k, v are tensors, and ``seq_lens`` (as
    a tuple of ints) has one entry per rank."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ulysses_attention: {name} must be a torch.Tensor, got {type(x).__name__}")
    if seq_lens is None:
        return None
    seq_lens = tuple(int(s) for s in seq_lens)
    if len(seq_lens) != world_size:
        # Lengths of other size cannot be encoded; this is the same on every rank
        # that passes the same list, which is the contract for seq_lens.
        raise UlyssesInputError(f"ulysses_attention: seq_lens has {len(seq_lens)} entries, expected one per rank ({world_size})")
    return seq_lens


def _signature(shapes, dtypes, devices, *, rank, world_size, causal, scale, seq_lens, plan_heads, docs) -> Signature:
    return Signature(
        rank=rank,
        world_size=world_size,
        shapes=tuple(tuple(x) for x in shapes),
        dtypes=tuple(dtype_code(x) for x in dtypes),
        devices=tuple((_device_code(x), -1 if x.index is None else x.index) for x in devices),
        causal=int(bool(causal)),
        scale_bits=float_bits(scale) if scale is not None else 0,
        seq_lens=seq_lens,
        plan_heads=plan_heads,
        docs=document_summary(docs),
    )


def signature(q, k, v, *, rank, world_size, causal, scale, seq_lens, plan_heads, docs=None) -> Signature:
    seq_lens = _tensors_and_lens(q, k, v, seq_lens, world_size)
    return _signature(
        (q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype), (q.device, k.device, v.device), rank=rank, world_size=world_size,
        causal=causal, scale=scale, seq_lens=seq_lens, plan_heads=plan_heads, docs=docs,
    )  # fmt: skip


def _local_problems(sig: Signature) -> list[str]:
    """Problems visible from one rank's own inputs."""
    out = []
    names = ("q", "k", "v")
    for name, shape in zip(names, sig.shapes):
        if len(shape) != 4 or "..." in shape:
            out.append(f"{name} must be 4-D [batch, seq_local, heads, head_dim], got shape {list(shape)}")
    if out:
        return out
    (b, s, hq, d), kshape, vshape = sig.shapes
    for name, shape in (("k", kshape), ("v", vshape)):
        if shape[0] != b:
            out.append(f"{name}.shape[0] (batch) expected {b} (q.shape[0]), got {shape[0]}")
        if shape[1] != s:
            out.append(f"{name}.shape[1] (seq_local) expected {s} (q.shape[1]), got {shape[1]}")
    if kshape[3] != d:
        out.append(f"k.shape[3] (head_dim) expected {d} (q.shape[3]), got {kshape[3]}")
    # v's head dim is its own (MLA: v_head_dim != head_dim); its heads are k's.
    if vshape[2] != kshape[2]:
        out.append(f"v.shape[2] (kv_heads) expected {kshape[2]} (k.shape[2]), got {vshape[2]}")
    if vshape[3] < 1 or d < 1:
        out.append(f"head dims must be positive, got head_dim={d} (q.shape[3]), v_head_dim={vshape[3]} (v.shape[3])")
    hkv = kshape[2]
    if hkv < 1 or hq < 1:
        out.append(f"head counts must be positive, got q_heads={hq}, kv_heads={hkv}")
    elif hq % hkv:
        out.append(f"q_heads ({hq}, q.shape[2]) must be a multiple of kv_heads ({hkv}, k.shape[2])")
    if sig.plan_heads is not None and sig.plan_heads != (hq, hkv):
        out.append(f"(q_heads, kv_heads) expected {sig.plan_heads} (the plan), got ({hq}, {hkv}) from q.shape[2], k.shape[2]")
    if hq >= 1 and sig.world_size > hq:
        out.append(more_ranks_than_heads(sig.world_size, hq, f"world_size ({sig.world_size})"))
    if sig.dtypes[0] not in _FLOAT_CODES:
        out.append(f"q.dtype expected a floating-point dtype (float32, bfloat16, float16, float64), got {_dtype_name(sig.dtypes[0])}")
    for name, code in zip(names[1:], sig.dtypes[1:]):
        if code != sig.dtypes[0]:
            out.append(f"{name}.dtype expected {_dtype_name(sig.dtypes[0])} (q.dtype), got {_dtype_name(code)}")
    for name, dev in zip(names[1:], sig.devices[1:]):
        if dev != sig.devices[0]:
            out.append(f"{name}.device expected {_device_name(*sig.devices[0])} (q.device), got {_device_name(*dev)}")
    if sig.seq_lens is not None:
        if any(x < 0 for x in sig.seq_lens) or sum(sig.seq_lens) < 1:
            out.append(f"seq_lens must be >= 0 with a positive total, got {list(sig.seq_lens)}")
        elif sig.seq_lens[sig.rank] != s:
            out.append(f"q.shape[1] (seq_local) expected seq_lens[{sig.rank}] = {sig.seq_lens[sig.rank]}, got {s}")
    if sig.docs and not out:
        out += _doc_problems(sig, sum(sig.seq_lens) if sig.seq_lens is not None else s * sig.world_size)
    return out


def _global_problems(sigs: Sequence[Signature]) -> list[str]:
    """Disagreements between ranks (each rank's own inputs already valid)."""
    ref = sigs[0]
    out = []
    fields = (
        ("batch (q.shape[0])", lambda g: g.shapes[0][0]),
        ("q_heads (q.shape[2])", lambda g: g.shapes[0][2]),
        ("kv_heads (k.shape[2])", lambda g: g.shapes[1][2]),
        ("head_dim (q.shape[3])", lambda g: g.shapes[0][3]),
        ("v_head_dim (v.shape[3])", lambda g: g.shapes[2][3]),
        ("dtype", lambda g: _dtype_name(g.dtypes[0])),
        ("device type", lambda g: _device_name(g.devices[0][0], -1)),
        ("causal", lambda g: bool(g.causal)),
        ("softmax_scale", lambda g: struct.unpack("<d", struct.pack("<q", g.scale_bits))[0]),
        ("max_seqlen", lambda g: g.docs[6] if g.docs else None),
        ("cu_seqlens", _doc_text),
    )  # seq_lens: _seq_lens_disagreement, checked first
    for what, get in fields:
        values = [get(g) for g in sigs]
        if any(x != values[0] for x in values):
            out.append(f"ranks disagree on {what}: {by_value(values)}")
    if ref.seq_lens is None:
        lens = [g.shapes[0][1] for g in sigs]
        if any(x != lens[0] for x in lens):
            out.append(
                f"ranks hold different sequence lengths {lens} (q.shape[1] per rank) but seq_lens was "
                f"not given; pass seq_lens={lens} (the default assumes equal shards)"
            )
    return out


def _seq_lens_disagreement(sigs: Sequence[Signature]) -> list[str]:
    """Ranks that were given different ``seq_lens`` lists: reported before anything else,
    since each rank would otherwise measure its shard against its own list and fail on a
    shape."""
    lists = [g.seq_lens for g in sigs]
    if all(x == lists[0] for x in lists):
        return []
    shown = lambda x: None if x is None else list(x)
    return [f"ranks disagree on seq_lens: {by_value(lists, shown)} (pass the same list on every rank)"]


def _layout_hint(sig: Signature) -> str:
    """A hint when q, k, v look like ``[B, H, S, D]`` (heads before the sequence) instead of
    the ``[B, S, H, D]`` the op takes: q's "heads" dimension holds this rank's ``seq_lens``
    entry, or q and k agree on dimension 2 (the sequence) but not on dimension 1 (their
    head counts) while q has more "heads" than local tokens."""
    shapes = sig.shapes
    if any(len(x) != 4 or "..." in x for x in shapes[:2]):
        return ""
    (_, s, h, _), (_, ks, kh, _) = shapes[0], shapes[1]
    by_lens = sig.seq_lens is not None and h == sig.seq_lens[sig.rank] != s
    by_gqa = h > s and kh == h and ks != s
    if not (by_lens or by_gqa):
        return ""
    return (
        f" (hint: q.shape is {list(shapes[0])}; q, k and v are [batch, seq_local, heads, head_dim]: "
        f"a [batch, heads, seq, head_dim] tensor needs .transpose(1, 2) first)"
    )


def validate(sigs: Sequence[Signature], *, gathered: bool) -> None:
    """Raise ``UlyssesInputError`` listing every problem, the same text on every rank."""
    problems = _seq_lens_disagreement(sigs) if gathered else []
    if not problems:
        # Each distinct problem once, with the ranks that have it (the same error on 64 ranks is one line).
        where: dict[str, list[int]] = {}
        for g in sigs:
            for p in _local_problems(g):
                where.setdefault(p, []).append(g.rank)
        problems = [f"{rank_list(ranks)}: {p}" if gathered else p for p, ranks in where.items()]
    if not problems and gathered and len(sigs) > 1:
        problems = _global_problems(sigs)
    if problems:
        hints = [h for h in map(_layout_hint, sigs) if h]  # a list: torch 2.8's dynamo cannot trace next(genexpr)
        hint = hints[0] if hints else ""
        raise UlyssesInputError("ulysses_attention: " + "; ".join(problems) + hint)


def softmax_scale_value(softmax_scale) -> float | None:
    """``softmax_scale`` as a float (``None`` stays ``None``: the default ``1/sqrt(head_dim)``).
    Anything but a finite real number, or a one-element tensor holding one, raises
    ``UlyssesInputError`` naming the parameter, the expected and the actual value (before:
    float()'s "could not convert string to float: 'x'"). Rank-local, like the other checks of
    ``call_key``: every rank given the same value raises the same error."""
    if softmax_scale is None:
        return None
    ok = isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
    ok = ok or (isinstance(softmax_scale, torch.Tensor) and softmax_scale.numel() == 1 and softmax_scale.is_floating_point())
    value = float(softmax_scale) if ok else math.nan
    if not math.isfinite(value):
        raise UlyssesInputError(f"ulysses_attention: softmax_scale expected a finite number or None, got {softmax_scale!r} ({type(softmax_scale).__name__})")
    return value


class CallKey(NamedTuple):
    """What the checks, the plan and the ``Layout`` of a call depend on (no tensor): the key
    of the caches below and of ``attention.call``'s (a tuple: hashable, compared by value)."""

    q_shape: torch.Size
    k_shape: torch.Size
    v_shape: torch.Size
    q_dtype: torch.dtype
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    q_device: torch.device
    k_device: torch.device
    v_device: torch.device
    rank: int
    world_size: int
    causal: bool
    scale: float | None
    seq_lens: tuple[int, ...] | None
    plan: HeadPlan | None
    docs: Documents | None


def call_key(q, k, v, *, rank: int, world_size: int, causal, softmax_scale, seq_lens, plan: HeadPlan | None, docs=None) -> CallKey:
    """The ``CallKey`` of a call. Raises (locally, as before any exchange) for non-tensors and a
    ``seq_lens`` list of the wrong length."""
    if seq_lens is not None or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        seq_lens = _tensors_and_lens(q, k, v, seq_lens, world_size)
    scale = softmax_scale_value(softmax_scale)
    return CallKey(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, rank, world_size, bool(causal), scale,
                   seq_lens, plan, docs)  # fmt: skip


def _signature_of(key: CallKey) -> Signature:
    plan_heads = None if key.plan is None else (key.plan.q_heads, key.plan.kv_heads)
    return _signature((key.q_shape, key.k_shape, key.v_shape), (key.q_dtype, key.k_dtype, key.v_dtype), (key.q_device, key.k_device, key.v_device),
                      rank=key.rank, world_size=key.world_size, causal=key.causal, scale=key.scale, seq_lens=key.seq_lens,
                      plan_heads=plan_heads, docs=key.docs)  # fmt: skip


def check_rank(key: CallKey) -> None:
    """This rank's checks of the call ``key`` (``validate`` of its own signature): every
    rank-local error, named, before anything is planned."""
    validate([_signature_of(key)], gathered=False)


_check_rank_once = functools.lru_cache(maxsize=512)(check_rank)  # a key that fails is not kept


def check_call(key: CallKey, comm, device: torch.device, check: bool, traced: bool) -> None:
    """The checks of the call ``key``, all of them before anything is planned: with ``check``
    on more than one rank of ``comm``, outside ``torch.compile``, every rank's signature over
    ``comm`` (``check_across_ranks``, which includes each rank's own checks: the same error on
    every rank); else this rank's own (``check_rank``): once per key, or per trace inside
    ``torch.compile`` (``traced``: no cache lookup in the graph's code)."""
    if check and not traced and comm.world_size > 1:
        check_across_ranks(key, comm, device)
    elif traced:
        check_rank(key)
    else:
        _check_rank_once(key)


# Bounded caches keyed by values (the call key, or every rank's integers).
@functools.lru_cache(maxsize=512)
def encoded(key: CallKey) -> tuple[int, ...]:
    """The integers this rank sends in the cross-rank check of the call ``key``."""
    return tuple(_signature_of(key).encode())


@functools.lru_cache(maxsize=512)
def _validate_gathered(rows: tuple[tuple[int, ...], ...]) -> None:
    validate([Signature.decode(x) for x in rows], gathered=True)


def check_across_ranks(key: CallKey, comm, device: torch.device) -> None:
    """The cross-rank check of ``check=True``: one all-gather of this rank's encoded signature
    over ``comm``, then the same validator over every rank's, so that bad or mismatched inputs
    raise the same ``UlyssesInputError`` on every rank. Collective."""
    gathered = comm.all_gather_ints(list(encoded(key)), device)
    _validate_gathered(tuple(tuple(x) for x in gathered))


def check_head_to_seq(x, plan: HeadPlan, *, rank: int, world_size: int, seq_lens) -> tuple[int, ...]:
    """Rank-local checks of ``head_to_seq``'s input ``x`` (``[B, S, hq, D]``, this rank's
    heads of ``plan``); returns every rank's sequence length. ``UlyssesInputError``
    names the tensor, the expected and the actual value."""
    if plan.world_size != world_size:
        raise UlyssesInputError(f"head_to_seq: plan.world_size expected {world_size} (the group), got {plan.world_size}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"head_to_seq: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4 or x.shape[2] != plan.q_count(rank):
        raise UlyssesInputError(f"head_to_seq: x.shape expected [B, S, {plan.q_count(rank)}, D] (rank {rank}'s heads), got {list(x.shape)}")
    if seq_lens is None:
        if x.shape[1] % world_size:
            raise UlyssesInputError(f"head_to_seq: x.shape[1] ({x.shape[1]}) is not divisible by world_size ({world_size}); pass seq_lens")
        seq_lens = (x.shape[1] // world_size,) * world_size
    elif len(seq_lens) != world_size or sum(seq_lens) != x.shape[1]:
        raise UlyssesInputError(f"head_to_seq: seq_lens expected {world_size} entries summing to x.shape[1] = {x.shape[1]}, got {list(seq_lens)}")
    return tuple(int(s) for s in seq_lens)
