"""Packed documents at batch > 1: each row of ``[B, S, H, D]`` its own documents, given as
one list of boundaries per row (``cu_seqlens=[[0, ..., S], [0, ..., S], ...]``).

Against one process per row (the float64 per-document reference on that row alone, as a
batch-1 packed sequence), forward and backward: 2 and 4 gloo ranks, uneven shards, rows
with different document counts, documents crossing shards and shorter than the group,
GQA with fewer KV heads than ranks and heads that do not divide the group, causal and not,
chunks 1 and 2, SDPA and the math backend, the torch kernel set (Triton under the
interpreter and the C++ CPU twin in one case each), the module, and the errors: the same
message on every rank for a wrong row count, a row that does not span the sequence, and a
2-D group (refused by name).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_packed import random_cu

import ulysses_kernels as uk
from ulysses_kernels.checks import UlyssesInputError
from ulysses_kernels.documents import Documents, documents, documents_of_positions
from ulysses_kernels.kernels import available_kernels
from ulysses_kernels.testing import run_ranks
from ulysses_kernels.testing.reference import contiguous_shard, packed_attention_reference

D = 8


def _inputs(B, hq, hkv, S, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def _rows_cu(B, S, world, seed) -> list[list[int]]:
    # Row b has its own documents (a different count per row; the last row is one document).
    return [random_cu(S, world, seed=seed + b) for b in range(B - 1)] + [[0, S]]


def _check_case(rank, world, B, hq, hkv, seq_lens, S, causal, chunks, kernels="torch", attn_fn="sdpa", module=False):
    lens = seq_lens if seq_lens is not None else [S // world] * world
    cu = _rows_cu(B, S, world, seed=hq * 31 + S + B)
    q, k, v, do = _inputs(B, hq, hkv, S, seed=hq * 1000 + S + B)
    refs, grads = [], []
    for b in range(B):  # one process per row: a batch-1 packed sequence of that row's documents
        full = [x[b : b + 1].clone().requires_grad_() for x in (q, k, v)]
        ref = packed_attention_reference(*full, cu[b], causal=causal)
        ref.backward(do[b : b + 1])
        refs.append(ref.detach())
        grads.append([x.grad for x in full])
    ref = torch.cat(refs)
    ref_grads = [torch.cat([g[i] for g in grads]) for i in range(3)]
    mine = [contiguous_shard(x, lens, rank).clone().requires_grad_() for x in (q, k, v)]
    if module:
        layer = uk.UlyssesAttention(hq, hkv, causal=causal, attn_fn=attn_fn, kernels=kernels, chunks=chunks)
        out = layer(*mine, seq_lens=seq_lens, cu_seqlens=cu)
    else:
        out = uk.ulysses_attention(*mine, causal=causal, seq_lens=seq_lens, attn_fn=attn_fn, kernels=kernels, chunks=chunks, cu_seqlens=cu)
    out.backward(contiguous_shard(do, lens, rank))
    what = f"rank {rank}/{world} B={B} {hq}/{hkv} lens={lens} cu={cu} causal={causal} chunks={chunks} {kernels} {attn_fn}"
    torch.testing.assert_close(out, contiguous_shard(ref, lens, rank), rtol=1e-10, atol=1e-10, msg=lambda s: f"out {what}: {s}")
    for name, m, f in zip("qkv", mine, ref_grads):
        torch.testing.assert_close(m.grad, contiguous_shard(f, lens, rank), rtol=1e-10, atol=1e-10, msg=lambda s, n=name: f"d{n} {what}: {s}")


# world -> [(batch, q_heads, kv_heads, seq_lens or None (equal shards), S, causal, chunks)]
CASES = {
    2: [(2, 4, 1, [7, 6], 13, True, 1), (3, 6, 2, None, 12, False, 2), (2, 5, 5, [3, 8], 11, True, 2)],
    4: [(2, 10, 2, [5, 3, 4, 6], 18, True, 2), (3, 6, 3, None, 12, True, 1), (2, 8, 1, [1, 4, 2, 3], 10, False, 1)],
}


def _dist_job(rank, world):
    for B, hq, hkv, seq_lens, S, causal, chunks in CASES[world]:
        _check_case(rank, world, B, hq, hkv, seq_lens, S, causal, chunks)
        _check_case(rank, world, B, hq, hkv, seq_lens, S, causal, chunks, attn_fn="math")
    if world == 2:
        _check_case(rank, world, 2, 6, 3, [5, 4], 9, True, 2, module=True)
        if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in available_kernels():
            _check_case(rank, world, 2, 4, 2, [4, 3], 7, True, 1, kernels="triton")
        if "cuda" in available_kernels():  # on a CPU: the C++ extension's CPU twin
            _check_case(rank, world, 2, 6, 2, [5, 4], 9, True, 2, kernels="cuda")
        _check_errors(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_packed_rows_on_gloo(world):
    run_ranks(_dist_job, world)


def test_packed_rows_world_one():
    _check_case(0, 1, 3, 4, 2, None, 9, True, 1)
    _check_case(0, 1, 2, 6, 3, None, 10, False, 2, attn_fn="math")


def test_rows_join_end_to_end():
    docs = documents([[0, 2, 5], [0, 5], torch.tensor([0, 1, 4, 5])])
    assert docs == Documents((0, 2, 5, 10, 11, 14, 15), 5, rows=3)
    assert documents([[0, 2, 5], [1, 5]]).bad_row == 2 and documents([[0, 5], [0, 2, 6]]).bad_row == 2
    with pytest.raises(TypeError, match="one of those per batch row"):
        documents([[0, 2.5, 5]])


def _raises(pattern, fn):
    with pytest.raises(UlyssesInputError, match=pattern):
        fn()


def _check_errors(rank, world):
    q, k, v, _ = (contiguous_shard(x, [4, 4], rank) for x in _inputs(2, 4, 2, 8, seed=1))
    call = lambda cu, x=(q, k, v): uk.ulysses_attention(*x, cu_seqlens=cu)  # noqa: E731
    one_list = r"ranks 0-1: cu_seqlens: packed documents at batch 2 \(q.shape\[0\]\) take one list of boundaries \(0, ..., 8\) per row, got one list"
    _raises(one_list, lambda: call([0, 3, 8]))
    _raises(r"ranks 0-1: cu_seqlens expected one list of boundaries per row: 2 \(q.shape\[0\]\), got 3", lambda: call([[0, 8]] * 3))
    # Bad on one rank only: every rank raises, naming that rank.
    _raises(r"rank 1: cu_seqlens row 1: expected boundaries from 0 to the global length 8", lambda: call([[0, 8], [0, 8] if rank == 0 else [0, 3, 7]]))
    _raises(r"rank 0: cu_seqlens\[-1\] expected 8 in every row .*, got 7", lambda: call([[0, 3, 7], [0, 7]] if rank == 0 else [[0, 8], [0, 8]]))
    _raises(r"ranks disagree on cu_seqlens", lambda: call([[0, 3, 8], [0, 8]] if rank == 0 else [[0, 8], [0, 3, 8]]))
    one = tuple(x[:1] for x in (q, k, v))
    _raises(r"ranks 0-1: cu_seqlens: packed documents at batch 1 .* got 2 lists of boundaries", lambda: call([[0, 8], [0, 8]], one))
    ring = uk.make_sp_groups(1, world)
    _raises(r"packed documents at batch 2 on a 2-D group \(SPGroups\)", lambda: uk.ulysses_attention(q, k, v, ring, cu_seqlens=[[0, 8], [0, 3, 8]]))
    # The group still works afterwards.
    assert uk.ulysses_attention(q, k, v, cu_seqlens=[[0, 3, 8], [0, 8]]).shape == q.shape


def test_documents_of_positions_one_tuple_per_row():
    """The integrations' one finder: a document starts at token 0 and where the position is 0."""
    rows = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    assert documents_of_positions(rows) == ((0, 3, 5, 6), (0, 2, 6), (0, 6))
    assert documents_of_positions(rows[:1]) == ((0, 3, 5, 6),)
    assert rows[1, 0] == 3  # the input is left as it was
