"""ulysses_kernels: Ulysses sequence parallelism for long-context attention.

    import ulysses_kernels as uk
    out = uk.ulysses_attention(q, k, v, group=None, causal=True)

See ``ulysses_attention`` for shapes and ``HeadPlan`` for which rank computes which heads.
"""

from .attention import UlyssesAttention, head_to_seq, seq_to_head, ulysses_attention
from .checks import UlyssesInputError
from .comm import Communicator, TorchCommunicator
from .plan import HeadPlan, PlanError
from .ring import SPGroups, make_sp_groups, shard_sequence, unshard_sequence

__version__ = "0.1.0"

__all__ = [
    "ulysses_attention",
    "UlyssesAttention",
    "seq_to_head",
    "head_to_seq",
    "HeadPlan",
    "PlanError",
    "UlyssesInputError",
    "Communicator",
    "TorchCommunicator",
    "SPGroups",
    "make_sp_groups",
    "shard_sequence",
    "unshard_sequence",
]
