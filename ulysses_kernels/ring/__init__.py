"""2-D sequence parallelism: Ulysses inside a group of ranks, ring attention across groups.

* ``groups``: ``make_sp_groups`` -> ``SPGroups`` (both levels' groups, printable plan);
* ``seq_layout``: where the sequence lives (``"contiguous"``/``"zigzag"``) and which rectangles
  of each ring step are computed;
* ``merge``: the overflow-safe log-sum-exp merge of partial results;
* ``attention``: ``RingBackend``, the attention backend a rank of a 2-D group runs between
  the two Ulysses exchanges, and the ring-level checks;
* ``shard``: ``shard_sequence``/``unshard_sequence``;
* ``schedule``: ``RingSchedule``, what one call computes and sends (what it skips);
* ``balance``: ``balance_documents``, an order of packed documents that evens the ring
  ranks' attention work;
* ``varlen``: one packed-documents kernel call per ring step of a packed sequence (``backends.packed_kernel``).

``ulysses_attention(q, k, v, group=make_sp_groups(U, R))`` runs it (``attention.call.setup_attention``).
"""

from .attention import RingBackend, check_ring_inputs, ring_backend
from .balance import balance_documents, rank_work
from .groups import PLACEMENTS, SPGroups, make_sp_groups, sp_rank_lists
from .merge import PartialAttention, acc_dtype, merge_lse
from .schedule import RingSchedule, ring_schedule
from .seq_layout import SEQ_LAYOUTS, block_pieces, shard_rows, tile_rows
from .shard import shard_sequence, unshard_sequence

__all__ = [
    "PLACEMENTS",
    "SEQ_LAYOUTS",
    "PartialAttention",
    "RingBackend",
    "RingSchedule",
    "SPGroups",
    "acc_dtype",
    "balance_documents",
    "block_pieces",
    "check_ring_inputs",
    "make_sp_groups",
    "merge_lse",
    "rank_work",
    "ring_backend",
    "ring_schedule",
    "shard_rows",
    "shard_sequence",
    "sp_rank_lists",
    "tile_rows",
    "unshard_sequence",
]
