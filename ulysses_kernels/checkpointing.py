"""How the op's state for the backward meets activation checkpointing and saved-tensor hooks.

Saved-tensor hooks (non-reentrant ``torch.utils.checkpoint``, FSDP2's ``checkpoint_wrapper``,
transformers' gradient checkpointing, ``save_on_cpu``) see autograd's saved tensors and
nothing else, so the state an attention backward needs lives there (``save_tensors``), never
in a Python attribute. The op's backward runs nested backward passes (one per head chunk);
``one_recompute`` makes a checkpointed region recompute once for all of them, and
``chunks_recompute_apart`` says when that is impossible (torch before 2.9: the call then runs
unchunked). docs/design.md ("Buffers and who owns them") tells the whole story.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

__all__ = ["SavedHandle", "save_tensors", "graph_exec_group", "one_recompute", "chunks_recompute_apart"]


class _SavedTensors(torch.autograd.Function):
    """Holds tensors in its saved tensors; never differentiated (``save_tensors``)."""

    @staticmethod
    def forward(ctx, dummy, *tensors):
        ctx.save_for_backward(*tensors)
        ctx.count = len(tensors)
        return dummy.view_as(dummy)

    @staticmethod
    def backward(ctx, grad):
        return (None,) * (1 + ctx.count)


class SavedHandle:
    """What ``save_tensors`` returns: the node's 0-element output, so the node stays alive.
    Holding the node alone (``grad_fn``) is not enough on torch 2.11 (it is on 2.14): there,
    when a custom Function's outputs are all freed, its saved tensors are released, and
    reading them raises "Trying to backward through the graph a second time" (measured)."""

    __slots__ = ("_marker",)

    def __init__(self, marker: torch.Tensor):
        self._marker = marker

    @property
    def saved_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._marker.grad_fn.saved_tensors


def save_tensors(*tensors: torch.Tensor) -> SavedHandle:
    """``tensors`` kept in autograd's saved tensors, for a backend with its own backward
    (its state holds the returned handle, not the tensors): saved-tensor hooks (activation
    checkpointing, ``save_on_cpu``) see them as they see any saved tensor, and the tensors
    go when the handle does. ``handle.saved_tensors`` gives them back (once, in the backward)."""
    dummy = torch.empty(0, device=tensors[0].device, requires_grad=True)
    with torch.enable_grad():
        return SavedHandle(_SavedTensors.apply(dummy, *tensors))


def graph_exec_group():
    """``torch.utils.checkpoint.GraphExecGroup`` (torch >= 2.9), else None."""
    return getattr(torch.utils.checkpoint, "GraphExecGroup", None)


def one_recompute():
    """A context for a backward that runs nested backward passes (``torch.autograd.grad`` over
    attention graphs, as ``AttentionBackend.backward`` does). Under non-reentrant activation
    checkpointing a region is recomputed once per graph task (or per
    ``torch.utils.checkpoint.GraphExecGroup``) that unpacks one of its saved tensors, and each
    nested pass is a graph task of its own: without this, the region would be recomputed by
    the outer backward (for the layer's other saved tensors) and again by each nested pass
    (our collectives again, at points that differ between ranks whose chunks hold no heads: a
    hang). Under selective checkpointing (``create_selective_checkpoint_contexts``) the second
    recompute reads the ops the policy saved a second time: "Trying to backward an extra
    time" (measured on torch 2.14, a policy saving matmuls, before this joined the outer task).

    So the nested passes join the backward that runs this node: inside the context the
    checkpoint's recompute key (``GraphExecGroup._get_current_group()``, which
    ``torch.utils.checkpoint`` reads before falling back to the graph task id) is the
    enclosing group if the caller opened one, else the id of the graph task running this
    backward, the key the outer backward's own unpacks use. The region is then recomputed
    once for the outer backward and every nested pass, whichever unpacks first. The nested
    passes unpack only their attention graph's saved tensors, which no other pass reads (the
    group's contract). Outside a backward (no graph task) a fresh group. Torch without
    ``GraphExecGroup`` (older than 2.9): a no-op (chunked calls then run unchunked:
    ``chunks_recompute_apart``)."""
    group = graph_exec_group()
    if group is None or torch._C._get_graph_exec_group() is not None:
        return contextlib.nullcontext()
    task = torch._C._current_graph_task_id()
    return group() if task == -1 else _JoinTask(task)


class _JoinTask:
    """Sets the checkpoint's recompute key to graph task ``task`` (``one_recompute``)."""

    __slots__ = ("task",)

    def __init__(self, task: int):
        self.task = task

    def __enter__(self):
        torch._C._set_graph_exec_group(self.task)
        return self

    def __exit__(self, *exc) -> None:
        torch._C._set_graph_exec_group(None)


def chunks_recompute_apart() -> bool:
    """Whether a chunked backward would recompute a checkpointed region once per nested pass:
    saved-tensor hooks are active (non-reentrant ``torch.utils.checkpoint``, ``save_on_cpu``)
    and torch has no ``GraphExecGroup`` (before 2.9). A rank whose chunk holds no head runs
    fewer nested passes, so fewer recomputes (our collectives again) than its peers: a hang,
    measured on torch 2.8 (the self-test's uneven-heads checkpoint path at chunks=2 timed
    out). The call then runs unchunked (``attention.call._resolve_chunks``), which the forward and the
    recompute decide alike: both run under the checkpoint's hooks."""
    if graph_exec_group() is not None:
        return False
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
