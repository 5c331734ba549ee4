"""The ground truth that tests, the self-test and the demo compare against.

* ``attention_reference``: single-process attention over the whole sequence (float64 by
  default), what ``ulysses_attention`` must equal;
* ``packed_attention_reference``: the same for a packed sequence, one document at a time
  (each document run on its own, as one process would without packing);
* ``contiguous_shard``: the rows of a global tensor that one rank holds under ``seq_lens``
  (contiguous shards; ``ulysses_kernels.shard_sequence`` shards for a 2-D group);
* ``one_process_step``: one training step of a transformers model in one process (loss,
  gradients, logits), what a step under ``hf.apply`` must equal;
* ``computed_once``: such references computed once per group, spread over its ranks, rather
  than by every rank (the same values: each is one process's computation either way).

Built from the explicit softmax of ``ulysses_kernels.math_attention``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..math_attention import default_scale, math_attention

__all__ = ["ComputedElsewhereError", "attention_reference", "computed_once", "contiguous_shard", "one_process_step", "packed_attention_reference"]


def attention_reference(q, k, v, causal=True, softmax_scale=None, dtype=torch.float64):
    """``[B, S, Hq, D]`` attention over the full sequence, computed in ``dtype``."""
    scale = default_scale(q.shape[3], softmax_scale)
    return math_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal, scale)


def packed_attention_reference(q, k, v, cu_seqlens, causal=True, softmax_scale=None, dtype=torch.float64):
    """``[1, S, Hq, D]`` attention of a packed sequence: ``attention_reference`` over each
    document ``[cu_seqlens[i], cu_seqlens[i + 1])`` on its own, joined along the sequence."""
    cu = [int(x) for x in cu_seqlens]
    parts = [attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal, softmax_scale, dtype) for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(parts, dim=1)


def contiguous_shard(x: torch.Tensor, seq_lens, rank: int) -> torch.Tensor:
    """Rows of ``x`` (``[B, S, ...]``) that rank ``rank`` holds under ``seq_lens``."""
    start = sum(seq_lens[:rank])
    return x[:, start : start + seq_lens[rank]]


def one_process_step(model, ids: torch.Tensor, labels: torch.Tensor, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One training step of a transformers causal LM on the whole ``[batch, seq]`` batch in this
    process (``inputs``: the model's other inputs, e.g. a vision-language model's pixel values):
    the mean next-token loss over the labels that are not -100 (half-precision logits upcast to
    float32, as ``SequenceShard.loss`` does on the ranks), ``{name: gradient}`` and the logits
    ``[batch, seq, vocab]`` (detached); the gradients are cleared on the model afterwards."""
    logits = model(input_ids=ids, use_cache=False, **inputs).logits
    scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(scores[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    loss = loss / (target != -100).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, logits.detach()


class ComputedElsewhereError(RuntimeError):
    """A thunk of ``computed_once`` raised; every rank raises this, the same text: the
    exception's type and first line (``rank``: where it ran; ``index``: which thunk)."""

    def __init__(self, text: str, rank: int, index: int):
        super().__init__(text)
        self.rank, self.index = rank, index


def computed_once(thunks: Sequence[Callable[[], object]], group=None, first: int = 0) -> list:
    """Each thunk's result on every rank of ``group``, each computed on one rank only: thunk
    ``i`` on rank ``(first + i) % world`` (``first`` spreads single thunks over the ranks),
    the results sent to all in one ``all_gather_object``. For the one-process references a
    test would otherwise compute on every rank (at 4 ranks, four times the same float64 step):
    a reference is one process's computation wherever it runs, so the values are those each
    rank would have computed. Results must pickle (tensors do). A thunk that raises makes
    every rank raise ``ComputedElsewhereError`` (no rank is left waiting). Collective; without
    torch.distributed (or in a world of one) the thunks run here, with the same error."""
    import torch.distributed as dist

    ranks = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if ranks else (1, 0)
    mine = {}
    for i, thunk in enumerate(thunks):
        if (first + i) % world == rank:
            try:
                mine[i] = ("ok", thunk())
            except Exception as e:  # noqa: BLE001 - sent to every rank, raised there
                text = str(e).splitlines()[0] if str(e) else ""
                mine[i] = ("raised", f"{type(e).__name__}: {text}"[:1000])
    gathered: list = [mine]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
    results = {}
    for r, part in enumerate(gathered):
        for i, (how, value) in part.items():
            if how == "raised":
                raise ComputedElsewhereError(value, r, i)
            results[i] = value
    return [results[i] for i in range(len(thunks))]
