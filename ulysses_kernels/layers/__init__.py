"""What runs inside a switched model, for every framework that switches one.

Each integration turns its framework's step into one ``step.SequenceShard`` and installs the
pieces here; what runs in the model is then the same whichever switched it (``hf.apply``,
verl's switch, DeepSpeed ALST's entry point):

* ``step``: the step (``SequenceShard``: the shard lengths, this rank, the packed documents),
  the keyword it travels under, the model side's error;
* ``attention``: THE attention function (``sequence_parallel_attention``; the ``"ulysses"``
  implementation ``hf.apply`` registers is the same call with its settings on the module);
* ``masks``: the global mask of a layer type, rebuilt from the model's mask function;
* ``audit``: every module that mixes tokens along the sequence, found and named;
* ``mixers``: the linear-attention and state-space layers (Gated DeltaNet, Mamba, ...): their
  registry, planning and switching (``mixers``), the head exchange and state passing
  (``mixers.exchange``), one module per family (its forward and its ``mixers.registry`` rows).
"""
