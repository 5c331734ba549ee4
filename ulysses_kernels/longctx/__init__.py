"""Longer sequences per GPU: optional, exact pieces that take the long-sequence terms off the device.

* ``loss``: the LM head and cross-entropy over sequence tiles (``lm_head_loss``,
  ``tiled_cross_entropy``): never a ``[seq_local, vocab]`` tensor, forward or backward.
* ``tiling``: a per-token module (the MLP) over sequence tiles, recomputed in the backward
  (``tiled_apply``): its ``[seq_local, intermediate]`` tensors exist for one tile; parameter
  gradients summed inside and delivered once per step.
* ``offload``: the inputs activation checkpointing keeps, in (pinned) host memory until the
  recompute (``ActivationOffload``).
* ``attention``: an attention backend whose backward runs the kernel per chunk of query heads
  (``HeadChunkedAttention``, passed as ``attn_fn``): the exchange's largest moment, smaller.
* ``patches``: the pieces on a transformers causal LM, what
  ``integrations.hf.apply(model, group, tiled_loss=, tiled_mlp=, offload_activations=)`` does.

Each piece is usable alone and gives the same loss and gradients as without it (float
rounding of sums over tiles aside). ``python -m ulysses_kernels.memory --tiled-loss
--tiled-mlp --offload-activations`` counts what they save; docs/longctx.md.
"""

from .attention import HeadChunkedAttention
from .loss import LOSS_TILE_BYTES, lm_head_loss, loss_tile_rows, tiled_cross_entropy
from .offload import ActivationOffload
from .patches import LongContext, LongContextError, enable, state
from .tiling import MLP_TILE_BYTES, TilingError, default_tile_rows, tile_bounds, tile_count, tiled_apply

__all__ = [
    "ActivationOffload",
    "HeadChunkedAttention",
    "LOSS_TILE_BYTES",
    "LongContext",
    "LongContextError",
    "MLP_TILE_BYTES",
    "TilingError",
    "default_tile_rows",
    "enable",
    "lm_head_loss",
    "loss_tile_rows",
    "state",
    "tile_bounds",
    "tile_count",
    "tiled_apply",
    "tiled_cross_entropy",
]
