"""An attention backend whose backward runs the kernel one chunk of query heads at a time.

    hf.apply(model, group, attn_fn=longctx.HeadChunkedAttention(heads_per_chunk=1), ...)

The attention backward is the exchange's largest moment at long sequences (measured by the
calculator's replay: for Llama-3-8B at sp 8 with every long-context piece it is the step's
peak once flash-attn's workspace is counted). One kernel call holds, beside the saved
q/k/v receive buffer, output and log-sum-exp of the rank's ``hq`` heads over the whole
sequence: the head-sharded ``dout``, ``dq``, and (a rank whose query heads share its one KV
head, Llama-3-8B's 4/1 at sp 8) ``dk``, ``dv`` per *query* head, plus on a GPU flash-attn's
float32 ``dq`` accumulator: ``hq x (1 + 1 + 2 + 2)`` heads over the whole sequence. Heads
are independent, so the kernel's backward can run on a slice of the heads, from the saved
output and log-sum-exp (no recompute): then ``dq`` (``hq`` heads, which the exchange sends
back whole) and the KV sums are the only full-size gradients, and the kernel's per-head
``dk``, ``dv`` (and workspace) exist for one chunk at a time.

The forward is one kernel call as before (``aten._scaled_dot_product_flash_attention_for_cpu``,
what ``F.scaled_dot_product_attention`` runs on the CPU: bit-identical). Backward per chunk:
the kernel's own backward (``..._for_cpu_backward``) on head slices, bit-identical per head
to the unsliced call (measured), and the KV gradient summed per query head in head order as
``backends.SharedKV`` does (``gqa.KVGradSum``): the results equal the default backend's bit for bit on the CPU.

Scope: the CPU kernel (no CUDA path yet: nothing here has run on a GPU), plain causal or full
attention without packed documents, and ranks whose query heads share one KV head or whose
heads are MHA; other calls (CUDA tensors, documents, grouped heads) run the default backend.
The saved tensors live in autograd's saved tensors (``checkpointing.save_tensors``), so activation
checkpointing and the offload see them as they see the default backend's.
"""

from __future__ import annotations

import torch

from ..backends import SDPABackend, for_rank
from ..checkpointing import save_tensors
from ..gqa import KVGather, KVGradSum, shares_one_kv

__all__ = ["HeadChunkedAttention"]

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class HeadChunkedAttention:
    """``attn_fn`` backend: one forward kernel call, the backward in chunks of ``heads_per_chunk``
    query heads (default 1). ``q`` ``[B, S, hq, D]``, ``k``/``v`` ``[B, S, hkv, D]`` views of
    the exchange's receive buffer; ``kv_map``: each local query head's local KV head."""

    name = "sdpa"

    def __init__(self, heads_per_chunk: int = 1):
        if not isinstance(heads_per_chunk, int) or isinstance(heads_per_chunk, bool) or heads_per_chunk < 1:
            raise ValueError(f"HeadChunkedAttention: heads_per_chunk expected a positive int, got {heads_per_chunk!r}")
        self.heads_per_chunk = heads_per_chunk
        self._default = SDPABackend()

    def _runs(self, q, kv_map, docs) -> str | None:
        """``"shared"`` (one KV head for every query head), ``"mha"``, or None (the default backend)."""
        if q.is_cuda or docs is not None or q.shape[2] == 0:
            return None
        if shares_one_kv(kv_map):
            return "shared"
        if tuple(kv_map) == tuple(range(len(kv_map))):
            return "mha"
        return None

    def forward(self, q, k, v, *, causal, scale, kv_map, needs_grad, docs=None):
        kind = self._runs(q, kv_map, docs)
        if kind is None:
            inner = for_rank(self._default, kv_map)
            kw = {} if docs is None else {"docs": docs}
            out, state = inner.forward(q, k, v, causal=causal, scale=scale, kv_map=kv_map, needs_grad=needs_grad, **kw)
            return out, ("default", inner, state)
        if kind == "shared":  # the one KV head as stride-0 views of the query heads (no copy): KVGather's shared mode
            k, v = KVGather.of(kv_map, k.shape[2], shared=True).gather(k, v)
        with torch.no_grad():
            out, lse = _FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
        state = None
        if needs_grad:
            state = ("chunked", kind, causal, scale, save_tensors(q, k, v, out, lse))
        return out.transpose(1, 2), state

    def backward(self, state, dout):
        if state[0] == "default":
            return state[1].backward(state[2], dout)
        _, kind, causal, scale, handle = state
        q, k, v, out, lse = handle.saved_tensors
        hq = q.shape[2]
        g, qt, kt, vt = dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if kind == "mha":
            dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
            dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        else:
            kv_sum = KVGradSum()
        for a in range(0, hq, self.heads_per_chunk):
            c = slice(a, min(a + self.heads_per_chunk, hq))
            gq, gk, gv = _BWD(g[:, c], qt[:, c], kt[:, c], vt[:, c], out[:, c], lse[:, c], 0.0, causal, scale=scale)
            dq[:, :, c] = gq.transpose(1, 2)
            if kind == "mha":
                dk[:, :, c] = gk.transpose(1, 2)
                dv[:, :, c] = gv.transpose(1, 2)
            else:
                kv_sum.add(gk.transpose(1, 2), gv.transpose(1, 2))
            del gq, gk, gv
        if kind == "shared":
            dk, dv = kv_sum.result()
        return dq, dk, dv
