"""The model-coverage walk: every transformers causal LM at tiny size through ``hf.apply``, either
refused by name or exact on the ranks against one process.

``audit(model_type)`` (one process): build the tiny model (``tiny_models.build_tiny``) and call
``hf.apply``: ``Outcome("not buildable", why)``, ``Outcome("refused", message)`` or
``Outcome("applied")``. ``exact(model_type, group)`` (on every rank of ``group``): for an applied
model, one training step, float64, 2 x 13 tokens (uneven shards), ``shard_batch`` +
``batch.loss`` + ``sync_gradients`` against the same model in one process: ``"exact"`` when the
loss and every parameter gradient agree within ``RTOL`` (relative to the largest entry), else
``"wrong"`` with the worst error, or ``"refused at the first step"`` / ``"error"`` when the step
raises. ``walk(rank, world, types, path)`` runs both for each type on spawned ranks (one spawn for
the whole list, ``run_ranks``) and rank 0 writes the outcomes to ``path`` (JSON).

``tests/test_hf_walk.py`` runs it; ``scripts/hf_coverage.py`` writes docs/hf.md's table from it.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import asdict, dataclass

import torch

from .tiny_models import VOCAB, NotBuildable, build_tiny

__all__ = ["Outcome", "RTOL", "SEQ", "audit", "exact", "walk"]

SEQ = 13  # 7/6 tokens over 2 ranks: uneven shards
RTOL = 1e-9  # loss and every gradient, relative to the reference's largest entry
# Models that compute in float32 inside a float64 model (Gemma's and Cohere's norms multiply by
# their weight in float32, a float32 softmax): sharded and one-process sums round differently, to
# float32's precision. Listed as "exact to float32 rounding" with the error measured; a module
# that runs on the shard alone errs by 1e-2 and more (tests/test_hf_walk.py shows one).
FLOAT32_RTOL = 2e-6
# A gradient that is zero in exact arithmetic (the key bias: softmax ignores a shift common to
# every key) holds rounding noise in both runs: compared in absolute terms, against this
# fraction of the largest gradient of the model.
NOISE_FLOOR = 1e-12


@dataclass
class Outcome:
    status: str  # "exact", "wrong", "refused", "refused at the first step", "error", "not buildable", "applied"
    detail: str = ""

    def mixer(self) -> str:
        """The class a refusal names first (``""`` if none)."""
        m = _NAMED.search(self.detail)
        return m.group(1) if m else ""

    def place(self) -> str:
        """Where that module sits in the model (``""``: the model itself, or none named)."""
        m = _NAMED.search(self.detail)
        return m.group(2) if m and m.group(2) != "<the" else ""


_NAMED = re.compile(r"(?:does not run sequence-parallel|positions of a sharded sequence): (\w+) at (\S+) ")


def _batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]


def audit(model_type: str, dtype: torch.dtype = torch.float64) -> Outcome:
    """Build ``model_type`` tiny and pass it to ``hf.apply`` (no group: the audit runs before any collective)."""
    from ..integrations import hf

    try:
        model = build_tiny(model_type, dtype=dtype)
    except NotBuildable as e:
        return Outcome("not buildable", str(e).splitlines()[0][:300])
    try:
        hf.apply(model)
    except hf.HFIntegrationError as e:
        return Outcome("refused", str(e))
    return Outcome("applied")


def _reference(model, ids, labels):
    logits = model(input_ids=ids, use_cache=False).logits
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    loss = loss / (target != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def exact(model_type: str, group=None) -> Outcome:
    """One float64 training step of the tiny ``model_type`` over ``group`` against one process
    (call on every rank of ``group``; the outcome is the same on every rank)."""
    import torch.distributed as dist

    from ..integrations import hf

    first = audit(model_type)
    if first.status != "applied":
        return first
    ids, labels = _batch()
    try:
        ref_loss, ref_grads = _reference(build_tiny(model_type), ids, labels)
    except Exception as e:  # noqa: BLE001 - the model's own failure on the CPU
        return Outcome("not buildable", f"one-process step failed: {_first_line(e)}")
    model = hf.apply(build_tiny(model_type), group)
    status, detail = "exact", ""
    try:
        batch = hf.shard_batch(ids, labels, group=group)
        out = model(**batch.model_inputs(loss=False))
        loss = batch.loss(out.logits)
        loss.backward()
        hf.sync_gradients(model, group)
        total = hf.reduce_loss(loss, group)
    except hf.HFIntegrationError as e:
        status, detail = "refused at the first step", _first_line(e)
    except Exception as e:  # noqa: BLE001 - recorded: a crash is not silently wrong, but it is listed
        status, detail = "error", _first_line(e)
    # Every rank agrees on the status before any comparison (a rank that raised skips the collectives).
    flags = torch.tensor([status == "exact"], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    if not flags.item():
        return Outcome(status if status != "exact" else "error", detail or "another rank raised")
    worst = ("loss", _rel(total, ref_loss))
    floor = NOISE_FLOOR * max((g.abs().max().item() for g in ref_grads.values()), default=0.0)
    for name, p in model.named_parameters():
        ref = ref_grads.get(name)
        if ref is None and p.grad is None:
            continue
        if ref is None or p.grad is None:
            worst = max(worst, (f"grad of {name} (present on one side only)", float("inf")), key=lambda w: w[1])
            continue
        if ref.abs().max() < floor:  # zero up to rounding: must stay so
            err = 0.0 if p.grad.abs().max() < floor else float("inf")
        else:
            err = _rel(p.grad, ref)
        worst = max(worst, (f"grad of {name}", err), key=lambda w: w[1])
    if worst[1] <= RTOL:
        return Outcome("exact", f"worst {worst[0]}: {worst[1]:.1e}")
    if worst[1] <= FLOAT32_RTOL:
        return Outcome("exact to float32 rounding", f"worst {worst[0]}: {worst[1]:.1e}")
    return Outcome("wrong", f"{worst[0]}: relative error {worst[1]:.2e}")


def walk(rank: int, world: int, types: list[str], path: str) -> None:
    """``exact`` for each of ``types`` over all ranks; rank 0 writes ``{type: outcome}`` as JSON to ``path``."""
    warnings.filterwarnings("ignore")
    results = {}
    for model_type in types:
        results[model_type] = asdict(exact(model_type))
    if rank == 0:
        with open(path, "w") as fh:
            json.dump(results, fh, indent=1)
