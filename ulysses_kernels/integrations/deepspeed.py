"""A drop-in for DeepSpeed's Ulysses ``DistributedAttention`` that runs our exchange.

    from ulysses_kernels.integrations.deepspeed import DistributedAttention
    # instead of: from deepspeed.sequence.layer import DistributedAttention
    dist_attn = DistributedAttention(local_attention, sequence_process_group)   # gather_idx=0
    context = dist_attn(query, key, value, batch_dim_idx)                     # [s/p, b, h, d]

The constructor and forward take DeepSpeed's arguments
(``deepspeed.sequence.layer.DistributedAttention``, 0.19.8 read) and call the user's local
attention the way DeepSpeed does: on this rank's heads over the whole sequence, in the
caller's layout, with the extra positional and keyword arguments passed through. What
differs is the exchange:

* q, k and v travel in one collective (``seq_to_head``: one fused pack, no permute
  chain), the attention output in one more (``head_to_seq``), instead of four
  all-to-alls each framed by permutes and copies;
* any head count (heads that do not divide the ranks: DeepSpeed asserts, or hung here
  on 6 heads over 4 ranks), and GQA with fewer KV heads than ranks (DeepSpeed asserts):
  the heads follow ``HeadPlan``; a rank whose query heads do not group uniformly over
  its KV heads gets its KV heads expanded to one per query head before the local
  attention sees them.

Layouts (DeepSpeed's; the sequence dimension is the one that is not the batch):

    batch_dim_idx=1, or None with gather_idx=0   [s/p, b, h, d] -> local attention [s, b, h/p, d]
        (Megatron-DeepSpeed's sequence-first layout)
    batch_dim_idx=0, or None with gather_idx=1   [b, s/p, h, d] -> local attention [b, s, h/p, d]

The local attention may return ``[.., .., h/p, d]`` or ``[.., .., h/p * d]`` (Megatron's
core attention flattens the heads); the result has the same form with all heads of this
rank's sequence shard. ``sp_stream`` is accepted and unused: DeepSpeed uses it to overlap
its separate q, k and v all-to-alls, and ours move the three in one collective.

Shards must be equal (every rank holds ``s/p`` tokens), as in DeepSpeed.

Which query heads a rank holds. Where the heads divide the group and each rank's query heads
use whole KV groups, both split the heads into equal contiguous ranges, the same on every
rank. Otherwise the splits differ: DeepSpeed (0.19.8, ``sequence/layer.py`` with
``num_kv_heads``, ``module_inject/tp_shard.py``) deals out whole KV groups, first ranks one
more (10 query / 5 KV heads over 4 ranks: query heads ``[4, 2, 2, 2]``); ours balances the
query heads (``HeadPlan``: ``[3, 3, 2, 2]``, a KV head sent to every rank whose query heads
use it). A local attention that keeps per-head state (ALiBi slopes, sinks, per-head scales)
must index it by the rank's global query heads, ``layer.query_heads(q_heads, kv_heads)``,
never by ``rank * heads_per_rank``, which is wrong under either split when the heads are
uneven (tests/test_alst.py: ALiBi at 10/5 heads over 4 ranks, exact against one process).

DeepSpeed's ALST entry point for transformers (``UlyssesSPAttentionHF``, what accelerate's
``ParallelismConfig(sp_backend="deepspeed")`` and the Trainer call) lives in
``integrations.deepspeed_alst``; ``enable_alst()`` (re-exported here) makes DeepSpeed's entry point run it
(docs/trainer.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import head_to_seq, seq_to_head
from ..checks import UlyssesInputError
from ..comm import get_communicator
from ..gqa import expand_kv
from ..plan import HeadPlan
from ..tracing import in_trace
from ..wire import wire_spec
from .deepspeed_alst import ALSTIntegrationError, UlyssesSPAttentionHF, alst_enabled, disable_alst, enable_alst

__all__ = [
    "DistributedAttention",
    "DeepSpeedIntegrationError",
    "UlyssesSPAttentionHF",
    "ALSTIntegrationError",
    "enable_alst",
    "disable_alst",
    "alst_enabled",
]


class DeepSpeedIntegrationError(UlyssesInputError):
    """An argument that DeepSpeed's ``DistributedAttention`` interface takes but this one cannot run."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (halves, not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first ``cos.shape[-1]`` features of ``t`` (the rest pass)."""
    rot = cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    head = head * cos + _rotate_half(head) * sin
    return head if rest.shape[-1] == 0 else torch.cat((head, rest), dim=-1)


class DistributedAttention(nn.Module):
    """DeepSpeed's ``DistributedAttention`` interface over ``seq_to_head``/``head_to_seq``.

    Args:
        local_attention: a module or callable ``fn(q, k, v, *args, **kwargs)`` over this
            rank's heads and the whole sequence, in the caller's layout (see the module
            docstring). k and v carry this rank's KV heads: ``q_local // kv_local`` query
            heads per KV head (grouped in order), or one per query head where the rank's
            query heads straddle KV groups unevenly.
        sequence_process_group: the sequence-parallel group (``None``: the world).
        scatter_idx: the head dimension; 2 (DeepSpeed's default, the only one it uses).
        gather_idx: the sequence dimension when ``forward`` gets no ``batch_dim_idx``:
            0 for ``[s, b, h, d]`` (default), 1 for ``[b, s, h, d]``.
        sp_stream: accepted for DeepSpeed compatibility; unused (one collective for q, k, v).
        num_kv_heads: accepted for DeepSpeed compatibility; when given it must equal
            ``key``'s head count.
        kernels: the pack/unpack kernels (``ulysses_attention``'s ``kernels``).
        contiguous: hand the local attention contiguous q, k, v as DeepSpeed does (its
            callers may ``.view`` them). ``False`` passes the exchange's strided views and
            saves one copy of q, k and v per call, for local attentions that accept
            strides (SDPA, flash-attn with a unit last stride).
        check: ``"once"`` (default) validates each new input signature across the ranks
            once (one tiny all-gather), ``"always"`` every call, ``"never"`` not at all.
        wire_dtype: ``None`` (the attention dtype on the wire), ``"fp8"`` or a
            ``ulysses_kernels.wire.WireSpec``: both exchanges in FP8 (docs/fp8_wire.md).

    Parameters: none. The head plan is built per ``(q_heads, kv_heads)`` on first use and
    kept on this instance.
    """

    def __init__(
        self,
        local_attention,
        sequence_process_group,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream=None,
        num_kv_heads: int | None = None,
        *,
        kernels=None,
        contiguous: bool = True,
        check: str = "once",
        wire_dtype=None,
    ) -> None:
        super().__init__()
        if scatter_idx != 2:
            raise DeepSpeedIntegrationError(
                f"DistributedAttention: scatter_idx expected 2 (the head dimension of [s, b, h, d] or [b, s, h, d]), got {scatter_idx!r}"
            )
        if gather_idx not in (0, 1):
            raise DeepSpeedIntegrationError(f"DistributedAttention: gather_idx expected 0 ([s, b, h, d]) or 1 ([b, s, h, d]), got {gather_idx!r}")
        if check not in ("once", "always", "never"):
            raise DeepSpeedIntegrationError(f"DistributedAttention: check expected 'once', 'always' or 'never', got {check!r}")
        self.wire_dtype = wire_spec(wire_dtype, "DistributedAttention", DeepSpeedIntegrationError)
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads
        self.kernels, self.contiguous, self.check = kernels, contiguous, check
        self._comm = get_communicator(sequence_process_group)
        self._plans: dict[tuple[int, int], HeadPlan] = {}
        self._checked: set[tuple] = set()

    def _seq_dim(self, batch_dim_idx) -> int:
        if batch_dim_idx is None:
            return self.gather_idx
        if batch_dim_idx not in (0, 1):
            raise DeepSpeedIntegrationError(
                f"DistributedAttention.forward: batch_dim_idx expected 0 ([b, s, h, d]), 1 ([s, b, h, d]) or None, got {batch_dim_idx!r}"
            )
        return 1 - batch_dim_idx

    def _plan(self, query: torch.Tensor, key: torch.Tensor) -> HeadPlan:
        if query.dim() != 4 or key.dim() != 4:
            raise DeepSpeedIntegrationError(
                f"DistributedAttention.forward: query and key expected 4-D [s, b, h, d] or [b, s, h, d], got shapes {list(query.shape)} and {list(key.shape)}"
            )
        heads = (query.shape[2], key.shape[2])
        if self.num_kv_heads is not None and self.num_kv_heads != heads[1]:
            raise DeepSpeedIntegrationError(f"DistributedAttention: num_kv_heads ({self.num_kv_heads}) expected to equal key's head count ({heads[1]})")
        plan = self._plans.get(heads)
        if plan is None:
            plan = self._plans[heads] = HeadPlan.build(heads[0], heads[1], self._comm.world_size)
        return plan

    def query_heads(self, q_heads: int, kv_heads: int) -> range:
        """The global indices of the query heads this rank's local attention gets for a call
        with ``q_heads`` query and ``kv_heads`` KV heads (in order: local head ``i`` is global
        head ``query_heads(...)[i]``). Index per-head state (ALiBi slopes, sinks) with it."""
        plan = self._plans.get((q_heads, kv_heads)) or HeadPlan.build(q_heads, kv_heads, self._comm.world_size)
        return range(*plan.q_ranges[self._comm.rank])

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int | None = None,
                rotary_pos_emb=None, *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        """Attention over the sequence sharded across the group.

        Args:
            query: ``[s/p, b, hq, d]`` or ``[b, s/p, hq, d]`` (see the module docstring).
            key, value: the same layout with ``hkv`` heads (``hq % hkv == 0``).
            batch_dim_idx: which dimension is the batch (0 or 1); ``None``: from ``gather_idx``.
            rotary_pos_emb: DeepSpeed's ``(cos, sin)``, applied to q and k after the
                exchange as DeepSpeed does (each permuted ``(1, 0, 2, 3)`` first).
            args, kwargs: passed to the local attention.

        Returns:
            This rank's sequence shard of the attention output, for all heads, in the
            input layout (``[.., .., hq, d]``, or ``[.., .., hq * d]`` when the local
            attention returns its heads flattened). Differentiable in q, k and v.
        """
        seq_dim = self._seq_dim(batch_dim_idx)
        plan = self._plan(query, key)
        q, k, v = (t.transpose(0, 1) if seq_dim == 0 else t for t in (query, key, value))  # -> [b, s/p, h, d]
        sig = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device)
        check = self.check == "always" or (self.check == "once" and sig not in self._checked)
        q, k, v = seq_to_head(q, k, v, group=self.spg, plan=plan, kernels=self.kernels, check=check, wire_dtype=self.wire_dtype)
        if check and not in_trace():
            self._checked.add(sig)
        k, v = expand_kv(k, v, plan.local_kv_map(self._comm.rank))
        q, k, v = (t.transpose(0, 1) if seq_dim == 0 else t for t in (q, k, v))  # -> the caller's layout
        if self.contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if rotary_pos_emb is not None:
            cos, sin = rotary_pos_emb[0].permute(1, 0, 2, 3), rotary_pos_emb[1].permute(1, 0, 2, 3)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)

        context = self.local_attn(q, k, v, *args, **kwargs)

        local_heads, head_dim = q.shape[2], q.shape[3]
        flat = context.dim() == 3
        if flat:
            context = context.unflatten(2, (local_heads, -1))
        if context.dim() != 4 or context.shape[:3] != q.shape[:3]:
            raise DeepSpeedIntegrationError(
                f"DistributedAttention: the local attention returned shape {list(context.shape)}, expected "
                f"{list(q.shape[:3]) + [head_dim]} (or the last two dimensions flattened)"
            )
        out = head_to_seq(context.transpose(0, 1) if seq_dim == 0 else context, plan, group=self.spg, kernels=self.kernels, wire_dtype=self.wire_dtype)
        if seq_dim == 0:
            out = out.transpose(0, 1).contiguous()
        return out.flatten(2) if flat else out

    def extra_repr(self) -> str:
        return f"scatter_idx={self.scatter_idx}, gather_idx={self.gather_idx}, world_size={self._comm.world_size}"
