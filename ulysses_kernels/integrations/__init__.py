"""Integrations of ``ulysses_attention`` with model libraries.

* ``ulysses_kernels.integrations.hf``: Hugging Face transformers (Llama, Qwen2/Qwen3,
  Mistral, Gemma 2/3, GPT-OSS families: windows, softcapping, sinks): ``apply(model, group)`` plus the data helpers ``shard_batch``,
  ``reduce_loss``, ``sync_gradients`` and ``gather_sequence``. See docs/hf.md.

Each integration imports its library lazily (on first use), so importing this package
never requires the library.
"""
