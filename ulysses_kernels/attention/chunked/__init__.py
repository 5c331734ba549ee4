"""Chunked Ulysses attention: the all-to-alls of one head chunk overlap attention on another.

Each rank's heads are split into ``n`` chunks; chunk ``c`` is a ``HeadPlan`` whose per-rank
ranges are sub-ranges of the full plan's (``chunk_plans``), so the layout math of
``ulysses_kernels.layout`` and every kernel set apply to a chunk unchanged (global head
indices; a rank may hold no head of a chunk). Schedule of the forward (every rank issues
the collectives in the same order)::

    s2h(0)
    for c in 0..n-1:   wait s2h(c); start s2h(c+1); attention(c); start h2s(c); finish h2s(c-1)
    finish h2s(n-1)

The backward does the same with dout (s2h) and dq/dk/dv (h2s, one collective per tensor;
the dk/dv ones are skipped for a chunk in which no rank sends a KV gradient).
"Start" runs the collective asynchronously: on CUDA on a side stream ordered by events
(the buffers are ``record_stream``-ed on it, so the caching allocator cannot hand them out
while the collective may still touch them; no host sync); elsewhere with
``async_op=True`` work handles, whose buffers are referenced until ``wait()``.
NOTE: an exception between two starts (an OOM in attention, a failed input check) leaves
this rank's later collectives unposted while its peers post theirs: the peers hang until
the process group's timeout. The op does not try to recover; let the job fail.

Bit-identity with ``chunks=1``. A rank with several local KV groups is chunked on KV-group
boundaries: every local KV head (and its gradient) belongs to one chunk and the backend
sees whole KV groups. A rank whose query heads all share its one KV head (Llama-3-8B and
Qwen2.5-14B at sp 8, Llama-3-8B at sp 16, MQA) is chunked by query heads instead: its KV
head travels with its first chunk forward and with its last chunk backward, and both this
op and the unchunked one run ``backends.SharedKV`` on it, which sums the KV gradient over
query heads one head at a time in head order (``KVGradSum``), so the chunks add the same
numbers in the same order. Only backends built on ``AttentionBackend`` can be wrapped so;
with other backend objects such ranks keep one chunk. A KV head that several ranks hold
gets its gradient summed in rank order once all chunks have arrived, exactly as the
unchunked unpack does. Bit-identity also needs the backend to compute each head
independently of the others present: true of flash-attn, and of SDPA on the CPU with one
intra-op thread (``torch.set_num_threads(1)``, as the tests run ranks; with several
threads CPU SDPA's result for a head can change by an ulp with the heads computed beside
it); not of the ``"math"`` backend, whose einsum picks shape-dependent BLAS kernels.

``chunks="auto"`` uses ``choose_chunks``: a cost model from globally agreed numbers only
(layout sizes, dtype, env vars), so every rank picks the same count.
"""

from .chunking import chunk_plans, splits_shared_kv
from .cost import MAX_CHUNKS, CostModel, choose_chunks, estimate_seconds
from .function import ChunkedAttentionFunction, chunked_attention

__all__ = [
    "MAX_CHUNKS",
    "ChunkedAttentionFunction",
    "CostModel",
    "choose_chunks",
    "chunk_plans",
    "chunked_attention",
    "estimate_seconds",
    "splits_shared_kv",
]
