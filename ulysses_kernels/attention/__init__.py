"""The Ulysses attention op, in one package: its public face, the resolved call, the
exchanges, and its three schedules side by side.

The path of one call, top-down:

* ``interface``: ``ulysses_attention``, ``UlyssesAttention``, ``seq_to_head``,
  ``head_to_seq`` (shapes, dtypes and options are documented there);
* ``call``: the arguments resolved once into a frozen ``CallSetup`` (plan, layout,
  communicator, kernel set, backend, scale, KV map, chunks, documents), after the input
  checks that raise the same error on every rank;
* one of three schedules, each taking that ``CallSetup``, picked in one place
  (``interface.run_schedule``, from ``call.traced`` and ``call.chunks``):
  eager (``interface.eager_attention``, the default, next to the choice: three autograd
  nodes, exchange, the rank's attention backend, exchange back), ``chunked`` (head chunks
  whose exchanges overlap attention; ``chunks > 1``) and ``traced`` (inside
  ``torch.compile``); a 2-D group's ring level is an attention backend
  (``ring.RingBackend``) that the eager and chunked schedules run;
* ``exchange``: the two all-to-alls (the movers: pack, collective, unpack through the call's
  kernel set and communicator) and the autograd functions over them.

What the schedules share lives once, below this package: the layout math (``layout``), the
kernel sets (``kernels``), gathering KV heads to query heads and summing their gradients
back (``gqa``), keeping the backward's state where checkpointing sees it (``checkpointing``),
and the attention backends (``backends``).
"""

from .interface import UlyssesAttention, head_to_seq, seq_to_head, ulysses_attention

__all__ = ["ulysses_attention", "UlyssesAttention", "seq_to_head", "head_to_seq"]
