"""Sequence parallelism for Hugging Face transformers models in one call.

    from ulysses_kernels.integrations import hf

    hf.apply(model, group)                       # once, after building the model
    for input_ids in loader:                     # the same global batch on every rank
        batch = hf.shard_batch(input_ids, group=group)
        out = model(**batch.model_inputs())      # loss = this rank's share of the mean
        out.loss.backward()
        hf.sync_gradients(model, group)          # all-reduce SUM over the group
        opt.step(); opt.zero_grad()
        print(hf.reduce_loss(out.loss, group))   # the global mean loss

``apply`` registers an attention function in transformers' ``AttentionInterface`` (and a
mask function in ``AttentionMaskInterface``) under the name ``"ulysses"`` and switches the
model to it with ``set_attn_implementation``; no model class is patched. The process-group
settings live on the model's own attention modules; the per-step sequence layout
(``seq_lens``) travels with the batch as the ``ulysses_shard`` keyword that transformers
passes down to every attention call. Nothing is stored in module-level state.

The layout of one step is drawn in ``batch``'s docstring, one attention call in ``adapter``'s.

Under Ulysses a window, a softcap or a sink is local to a head: after the exchange each
rank holds the whole sequence for its heads, so the model's attention computes exactly
what one process would (attention dropout draws its own random mask on each rank).

Packed sequences (batch 1, documents end to end, as ``DataCollatorWithFlattening`` makes
them): ``shard_batch`` finds the documents from position ids that restart at 0 (or takes
``cu_seqlens``), keeps the per-document positions (RoPE as if each document ran alone),
drops the target of each document's last token, and puts the global boundaries on the
step's ``SequenceShard``; every layer passes them to ``ulysses_attention(cu_seqlens=...)``
(block-diagonal attention; the boundaries are found once per step, never gathered per layer).
Causal layers with a sliding window and/or softcapping (no sinks, no dropout) run on the
packed-documents kernel the chooser picks for that mask (``backends.packed_kernel``); layers
that run the model's own attention (sinks, dropout, a registered implementation) get the
documents overlaid on the global mask they build (the ``eager`` and ``sdpa`` implementations).

The package, by job (each imports only the ones above it):

* ``batch``: the data side: ``SequenceShard``, ``ShardedBatch``, ``shard_batch`` (sharding,
  the global label shift, positions, packed documents, zigzag shards of a 2-D group, the
  same-batch check) and ``HFIntegrationError``;
* ``training``: ``reduce_loss``, ``sync_gradients``, ``gather_sequence``, ``router_loss`` (an
  MoE load-balancing loss over the global batch);
* ``adapter``: what runs in every layer: the ``"ulysses"`` attention function and mask
  function (fused op, or the model's own attention between the exchanges),
  ``sequence_parallel_attention`` (the same for callers that intercept a model's own
  attention) and ``attention_settings``;
* ``multimodal``: vision-language models: ``multimodal_inputs`` (the model's own code up to
  its text model on the global batch: the vision tower before sharding, replicated or split
  over the ranks) and the hooks ``apply`` installs on a vision-language model;
* ``mixers``: hybrid models' token mixers that are not attention (Gated DeltaNet, Kimi Delta
  Attention, Mamba2, Jamba's Mamba1, LFM2's short convolution: ``HANDLED_MIXERS``), each run per
  head over the whole sequence between all-to-alls; ``apply`` switches them with the attention;
* ``audit``: ``check_token_mixers`` (never silently wrong: every module that mixes tokens along
  the sequence is switched attention or a handled mixer, else ``apply`` refuses the model by
  the module's class and place; the verl and ALST switches run it too);
* ``model``: ``register`` and ``apply`` (checking a model and switching it over).

Supported: self-attention models whose attention goes through ``AttentionInterface``:
decoder-only causal LMs (Llama, Qwen2/Qwen3, Mistral, Gemma 2/3, GPT-OSS, Qwen3-MoE: sliding
windows, mixed layer types, logit softcapping, attention sinks, attention dropout; MoE
experts run as built on the rank's tokens) and bidirectional encoders (BERT, ModernBERT
with its local layers, ViT towers: ``ulysses_attention(causal=False)``), any head layout
(GQA with fewer KV heads than ranks, heads not divisible by the ranks), uneven shards or
padding (causal models), packed documents (plain layers on any built-in implementation;
windows, softcapping, sinks on ``eager``/``sdpa``); vision-language models (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Llava, Mistral3: the text model sequence-parallel, the vision tower
before sharding, replicated or split: ``multimodal_inputs``). docs/hf.md's "Model coverage"
lists what is tested.
Not supported (clear errors): token mixers other than attention that ``apply`` does not run
exactly (refused before anything changes: docs/hf.md, "Never silently wrong"), padding/custom masks, padded batches of bidirectional models
(pack them), cross-attention, the MoE router loss (``output_router_logits``), packed
documents on the model's own attention with flash or a registered implementation, chunked
attention, KV caches (generation: ``unapply`` puts the model back as built, to generate),
torch.compile of the switched model.
"""

import sys as _sys

from ...layers import attention as _attention
from ...layers import audit as _audit
from ...layers import masks as _masks
from ...layers import mixers as _mixers
from ...layers.attention import ATTN_IMPLEMENTATION, attention_settings, sequence_parallel_attention
from ...layers.mixers import exchange as _exchange
from ...layers.mixers import mixer_strategies
from .batch import HFIntegrationError, SequenceShard, ShardedBatch, shard_batch, split_lengths
from .model import apply, unapply
from .model import register as register  # hf.register(): public, outside __all__ as before
from .multimodal import multimodal_inputs
from .training import gather_sequence, reduce_loss, router_loss, sync_gradients

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HFIntegrationError",
    "SequenceShard",
    "ShardedBatch",
    "apply",
    "unapply",
    "mixer_strategies",
    "multimodal_inputs",
    "attention_settings",
    "sequence_parallel_attention",
    "shard_batch",
    "split_lengths",
    "reduce_loss",
    "router_loss",
    "sync_gradients",
    "gather_sequence",
]

# The model side every framework runs moved to ulysses_kernels.layers (#47); its modules still
# answer under their old names here (``import ulysses_kernels.integrations.hf.mixers``, ``hf.mixers``).
for _old, _new in (("adapter", _attention), ("audit", _audit), ("masks", _masks), ("mixers", _mixers), ("mixer_exchange", _exchange)):
    _sys.modules.setdefault(f"{__name__}.{_old}", _new)
    globals().setdefault(_old, _new)
del _old, _new
