"""Integrations of ``ulysses_attention`` with model libraries.

* ``ulysses_kernels.integrations.hf``: Hugging Face transformers (Llama, Qwen2/Qwen3,
  Mistral, Gemma 2/3, GPT-OSS families: windows, softcapping, sinks): ``apply(model, group)`` plus the data helpers ``shard_batch``,
  ``reduce_loss``, ``sync_gradients`` and ``gather_sequence``. See docs/hf.md.
* ``ulysses_kernels.integrations.deepspeed``: ``DistributedAttention``, a drop-in for
  DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention`` over our exchange.
* ``ulysses_kernels.integrations.verl``: verl's Ulysses switched to ours; importing it is the
  switch (``actor_rollout_ref.model.external_lib=ulysses_kernels.integrations.verl``). See
  docs/verl.md.
* ``ulysses_kernels.integrations.torchtitan``: torchtitan's context parallelism over our
  Ulysses: ``config = enable(config)`` on a ``Trainer.Config``. See docs/torchtitan.md.
* ``ulysses_kernels.integrations.mesh``: ``parallel_groups`` (the dp x sp DeviceMesh, the
  sp group, the flattened mesh for FSDP2, an ``mpu`` for ``deepspeed.initialize``) and
  ``grad_divisor``/``scale_loss`` (the token-mean loss each engine needs).

Each integration imports its library lazily (on first use), so importing this package
never requires the library (``verl``, the switch, imports verl when it is installed;
``torchtitan`` imports torchtitan when it is installed).
"""
