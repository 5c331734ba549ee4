"""One training step's device bytes on one rank, tensor by tensor: the calculator's step peak.

``step_memory(setup, rank)`` replays one forward and backward of a transformers Llama / Qwen2
model (RMSNorm, RoPE, attention through ``hf.apply`` with an SDPA-like kernel that saves its
output and float32 log-sum-exp, a gated MLP, transformers' causal-LM loss) as the tensors
it allocates and frees, in order, with their sizes for this rank, and returns the highest
sum (the step's peak) and where it happened. It covers activation checkpointing (on or off;
non-reentrant, backward inside one ``torch.utils.checkpoint.GraphExecGroup`` so that each
layer is recomputed once), and the long-context pieces of ``ulysses_kernels.longctx``:
the tiled loss, tiled MLP, tiled norms and activation offload (host bytes kept apart).

What is counted is what ``traffic.LiveBytes`` counts in ``tests/test_longctx_memory.py``:
every tensor the step allocates, from allocation to free; not the parameters, the caller's
inputs, or parameter gradients once accumulated (an engine reduces and frees them; each
parameter's gradient is counted while it is computed). The replay follows the order in
which transformers 5.23's Llama code and torch's autograd (2.14) allocate and free; the
test measures it on 2 and 4 gloo ranks. Sizes, per rank (``sizes.Rows``): ``n`` tokens
(batch x local sequence), ``X = n h e`` (a hidden-size activation), ``W = n h 4`` (its
float32 copy), ``Q``/``K`` (q / one of k, v projections), ``F = n f e`` (an MLP
intermediate), ``r = 4 n``.

Two facts that shape the peak at long sequences: transformers' RMSNorm keeps a float32
copy of its input and makes three float32 ``[n, hidden]`` temporaries in its backward
(``tiled_norms`` keeps them to one tile), and a checkpointed layer whose backward runs
nested backward passes (our attention) is recomputed twice unless the backward runs inside
one ``GraphExecGroup`` (docs/longctx.md): the replay assumes one recompute.

The pieces, one job each: ``replay.StepReplay`` (the step: layers, recompute, offload; the
entry point), ``norm``, ``mlp``, ``attention`` (projections, RoPE), ``attention_op``
(``ulysses_attention``: exchanges, kernel), ``loss`` (each block's forward and backward),
``mixer`` (a hybrid's mixer layers: Gated DeltaNet, KDA, Mamba2, Mamba1 (``mamba1``), short conv; their layers' forms:
stacked, Nemotron-H's blocks, Falcon-H1's parallel layer)
and ``mixer_replay`` (one such layer as ``hf.apply`` runs it), ``tiles``
(``SequenceTiled``: tile counts, the tiled forward), ``sizes`` (the bytes of a tensor,
of a rank's step, of the op's buffers) and ``ledger`` (the tensors alive, the peak).
"""

from .replay import StepMemory, StepReplay, rank_key, step_memory

__all__ = ["StepMemory", "StepReplay", "step_memory", "rank_key"]
