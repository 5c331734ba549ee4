"""Training helpers of the transformers integration: the global mean loss for logging
(``reduce_loss``), the gradient sum over the sequence-parallel group (``sync_gradients``),
the global sequence from every rank's shard (``gather_sequence``) and this rank's share of
an MoE model's load-balancing loss over the global batch (``router_loss``). Each is
collective over the group: call it on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...layers.step import HFIntegrationError, SequenceShard, process_group

__all__ = ["reduce_loss", "sync_gradients", "gather_sequence", "router_loss"]


def reduce_loss(loss: torch.Tensor, group=None) -> torch.Tensor:
    """The global mean loss: the SUM over the group of each rank's ``out.loss`` (detached).

    Each rank's loss is ``sum(its token losses) / num_tokens(global)``, so the sum is the
    mean over all tokens of the global batch. Collective: call it on every rank.
    """
    total = loss.detach().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=process_group(group))
    return total


def sync_gradients(model: torch.nn.Module, group=None) -> None:
    """All-reduce SUM the parameter gradients over the sequence-parallel group.

    After ``out.loss.backward()`` each rank holds the gradient of its share of the loss;
    the sum is the gradient of the global mean loss (what one process would compute).
    One collective per (dtype, device), after one small all-reduce of which parameters have
    a gradient on any rank: a rank whose shard never reached a parameter (a vision tower
    with ``multimodal_inputs(vision="split")`` on a rank that encoded no image, an expert no
    token of the shard was routed to) has none there, and takes part with zeros, so the
    ranks' buffers line up; a parameter no rank reached keeps ``grad = None``. With data
    parallelism on top, reduce over the data-parallel group separately (as usual, averaging there).
    """
    group = process_group(group)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    have = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(have, op=dist.ReduceOp.MAX, group=group)
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p, anyone in zip(params, have.tolist()):
        if anyone and p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad is not None:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def gather_sequence(x: torch.Tensor, shard: SequenceShard, group=None, dim: int = 1) -> torch.Tensor:
    """Every rank's ``x`` (``seq_lens[r]`` long along ``dim``) joined into the global sequence.

    Padding is dropped (the result is ``shard.valid_len`` long). Not differentiable: use it
    for evaluation and logging (e.g. full logits). Collective: call it on every rank.
    """
    if x.shape[dim] != shard.local_len:
        raise HFIntegrationError(f"gather_sequence: x.shape[{dim}] expected {shard.local_len} (this rank's shard), got {x.shape[dim]}")
    if shard.world_size == 1:
        return x.narrow(dim, 0, shard.valid_len)
    width = max(shard.seq_lens)
    padded = x.detach()
    if x.shape[dim] < width:
        pad_shape = list(x.shape)
        pad_shape[dim] = width - x.shape[dim]
        padded = torch.cat([padded, padded.new_zeros(pad_shape)], dim=dim)
    parts = [torch.empty_like(padded) for _ in range(shard.world_size)]
    dist.all_gather(parts, padded.contiguous(), group=process_group(group))
    full = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, shard.seq_lens)], dim=dim)
    if shard.ring_layout is not None:  # zigzag: rank order is not sequence order
        rows = torch.cat([shard.rows(r) for r in range(shard.world_size)])
        full = full.index_select(dim, torch.argsort(rows).to(full.device))
    return full.narrow(dim, 0, shard.valid_len)


def router_loss(router_logits, shard: SequenceShard, group=None, *, num_experts: int, top_k: int) -> torch.Tensor:
    """This rank's share of an MoE model's load-balancing loss over the *global* batch (the
    Switch-Transformer loss transformers' MoE models add as ``router_aux_loss_coef * aux_loss``):
    ``num_experts * sum_e f_e * p_e``, where over all rows of all layers ``f_e`` is the number of
    top-``top_k`` assignments to expert ``e`` and ``p_e`` the sum of its router probabilities,
    each divided by the number of rows.

    Under sequence parallelism each rank routes only its tokens, and transformers' own
    ``aux_loss`` is that loss over them: not one process's. Here the counts ``f_e`` and the row
    count (no gradient in them) are summed over the group, and each rank keeps its own rows'
    ``p_e``; the loss is linear in ``p`` given ``f``, so the shares SUM to the one-process
    loss and their gradients, summed by ``sync_gradients``, to its gradient. Padding rows
    (``shard_batch(pad=True)``) are left out, as one process has none.

    Args:
        router_logits: the model's ``out.router_logits`` (a forward with
            ``output_router_logits=True``): one ``[batch * seq_lens[rank], num_experts]``
            tensor per MoE layer, rows in batch-major order.
        shard: the step's ``SequenceShard`` (``batch.shard``).
        group: the sequence-parallel group given to ``shard_batch``.
        num_experts, top_k: the model's (``config.num_experts`` / ``num_local_experts``,
            ``config.num_experts_per_tok``).

    Returns a 0-dim tensor in float32 (float64 for float64 logits): add
    ``config.router_aux_loss_coef * router_loss(...)`` to this rank's loss share. Collective.
    """
    layers = tuple(router_logits) if isinstance(router_logits, (tuple, list)) else (router_logits,)
    rows = shard.batch_size * shard.local_len
    for i, logits in enumerate(layers):
        if logits.dim() != 2 or tuple(logits.shape) != (rows, num_experts):
            raise HFIntegrationError(
                f"router_loss: router_logits[{i}] expected shape [{rows}, {num_experts}] (batch {shard.batch_size} x "
                f"{shard.local_len} tokens, num_experts), got {list(logits.shape)}"
            )
    dtype = torch.promote_types(layers[0].dtype, torch.float32)
    device = layers[0].device
    # Rows of this rank that are real tokens (not shard_batch's padding), batch-major.
    real = (shard.rows(shard.rank) < shard.valid_len).to(device=device, dtype=dtype).repeat(shard.batch_size)
    counts = torch.zeros(num_experts, dtype=dtype, device=device)
    probs = torch.zeros(num_experts, dtype=dtype, device=device)
    for logits in layers:
        p = torch.softmax(logits.to(dtype), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts = counts + torch.zeros_like(counts).index_add_(0, chosen.reshape(-1), real.repeat_interleave(top_k))
        probs = probs + (p * real.unsqueeze(-1)).sum(dim=0)
    stats = torch.cat([counts, (real.sum() * len(layers)).reshape(1)]).detach()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=process_group(group))
    total = stats[-1]
    return num_experts * ((stats[:-1] / total) * (probs / total)).sum()
