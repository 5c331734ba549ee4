"""The sizes the replay allocates: a tensor over some rows of tokens (``Rows``), one rank's step
(``StepSizes``) and its two exchanges' buffers (``ExchangeBytes``, docs/design.md "Buffers and
who owns them")."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..gqa import shares_one_kv, uniform_kv_groups
from ..layout import Q_ONLY, QKV
from ..traffic import h2s_recv_elems, s2h_send_elems

__all__ = ["Rows", "StepSizes", "ExchangeBytes"]


@dataclass(frozen=True)
class Rows:
    """Sizes of tensors over ``rows`` tokens (a per-head norm: one row per head and token)."""

    rows: int
    e: int  # element size
    h: int
    f: int
    dq: int  # q width (heads x head_dim)
    dkv: int  # k / v width

    def over(self, rows: int) -> Rows:
        """The same tensors over ``rows`` rows (a tile's)."""
        return replace(self, rows=rows)

    @property
    def X(self) -> int:
        return self.rows * self.h * self.e

    @property
    def W(self) -> int:
        return self.rows * self.h * 4

    @property
    def C(self) -> int:  # the norm's float32 copy (none in float32)
        return 0 if self.e == 4 else self.W

    @property
    def r(self) -> int:
        return self.rows * 4

    @property
    def Q(self) -> int:
        return self.rows * self.dq * self.e

    @property
    def K(self) -> int:
        return self.rows * self.dkv * self.e

    @property
    def F(self) -> int:
        return self.rows * self.f * self.e


@dataclass(frozen=True)
class StepSizes:
    """One rank's sizes: ``n`` tokens (batch x local sequence), ``tokens_max`` (batch x the
    group's longest shard: every rank's tile count), element sizes (``wide``: at least float32),
    the rows of a layer, of the per-head q and k norms, and the parameters' element counts."""

    e: int
    wide: int
    n: int
    tokens_max: int
    rows: Rows
    qrows: Rows
    krows: Rows
    params: dict[str, int]

    @classmethod
    def of(cls, setup, rank: int) -> StepSizes:
        lay = setup.layout(rank)
        e, d = setup.element_size, setup.dim
        n = setup.batch * lay.seq_local
        params = {
            "q": setup.hidden * setup.heads * d, "k": setup.hidden * setup.kv_count * d, "v": setup.hidden * setup.kv_count * d,
            "o": setup.hidden * setup.heads * d, "mlp": setup.hidden * setup.ffn, "norm": setup.hidden,
            "head": setup.vocab * setup.hidden,
        }  # fmt: skip
        return cls(
            e=e,
            wide=max(e, 4),
            n=n,
            tokens_max=setup.batch * max(lay.seq_lens),
            rows=Rows(n, e, setup.hidden, setup.ffn, setup.heads * d, setup.kv_count * d),
            qrows=Rows(n * setup.heads, e, d, 0, 0, 0),
            krows=Rows(n * setup.kv_count, e, d, 0, 0, 0),
            params=params,
        )


@dataclass(frozen=True)
class ExchangeBytes:
    """The attention op's buffers on one rank: ``head`` (one head's ``[B, S, D]``), the rank's
    query and KV head counts, the sends and receives of the q/k/v, output, dout and dq/dk/dv
    exchanges, the kernel's output, log-sum-exp and KV gradients, KV gathered to query heads
    (``gathered``) or one shared KV head (``shared``), and whether ``longctx.HeadChunkedAttention``
    runs the backward (``head_chunked``)."""

    world: int
    head: int
    hq: int
    hkv: int
    shared: bool
    gathered: bool
    send_qkv: int
    recv_qkv: int
    send_dout: int
    recv_dout: int
    out_l: int
    lse: int
    out_recv: int
    dqkv_recv: int
    kv2: int
    dkv_kernel: int
    head_chunked: bool

    @classmethod
    def of(cls, setup, rank: int) -> ExchangeBytes:
        lay, e = setup.layout(rank), setup.element_size
        B, S, D = lay.batch, lay.seq_total, lay.head_dim
        hq, hkv = lay.head_count("q", rank), lay.head_count("kv", rank)
        kv_map = lay.plan.local_kv_map(rank)
        shared = shares_one_kv(kv_map)
        gathered = not shared and not uniform_kv_groups(len(kv_map), hkv, kv_map)
        head = B * S * D * e
        one = lay.world_size == 1  # the exchange moves nothing: the op's buffers are its kernel's
        # longctx.HeadChunkedAttention runs where the rank's query heads share one KV head or
        # are MHA (elsewhere, and at world 1 here, the default backend)
        mha = tuple(kv_map) == tuple(range(len(kv_map)))
        return cls(
            world=lay.world_size,
            head=head,
            hq=hq,
            hkv=hkv,
            shared=shared,
            gathered=gathered,
            send_qkv=0 if one else s2h_send_elems(lay, QKV) * e,
            recv_qkv=sum(lay.s2h_recv_splits(QKV)) * e,
            send_dout=0 if one else s2h_send_elems(lay, Q_ONLY) * e,
            recv_dout=hq * head,
            out_l=hq * head,
            lse=B * hq * S * 4,
            out_recv=0 if one else h2s_recv_elems(lay, Q_ONLY) * e,
            dqkv_recv=0 if one else h2s_recv_elems(lay, QKV) * e,
            kv2=2 * hq * head if gathered else 0,
            dkv_kernel=2 * (hq if shared or gathered else hkv) * head,
            head_chunked=bool(setup.attention_head_chunk) and hq > 0 and (shared or mha),
        )
