"""torchtitan's context parallelism on ``ulysses_attention``: ``enable(config)`` is the switch.

::

    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from ulysses_kernels.integrations import torchtitan as ulysses_titan

    config = llama3_debugmodel()
    config.parallelism.context_parallel_degree = 4
    config.parallelism.context_parallel_load_balancer = None   # contiguous shards
    config = ulysses_titan.enable(config, chunks=1, kernels=None)
    trainer = config.build()          # an UlyssesTrainer: torchtitan's Trainer, one hook changed
    trainer.train()

Without code, torchtitan's own command line (``zero_code``; the cp degree from the command line)::

    torchrun --nproc-per-node 8 -m torchtitan.train --module ulysses_kernels.integrations.torchtitan \
        --config llama3_8b --parallelism.context_parallel_degree 8

What ``enable`` changes (torchtitan 0.3.0), and nothing else:

* the model's inner attention: an ``override`` (torchtitan's own mechanism,
  ``config.override.imports``, applied by the Trainer after ``update_from_config``) replaces
  every ``layers.*.attention.inner_attention`` by ``UlyssesInnerAttention``: ``GQAttention``
  hands it q ``[B, s_local, Hq, D]``, k and v ``[B, s_local, Hkv, D]`` (this rank's contiguous
  shard of the sequence, all heads) and it returns ``[B, s_local, Hq, D]``: one
  ``UlyssesAttention`` over the cp mesh's group. Any head counts with one query head per
  rank run (6/3 heads at cp 4: the ``HeadPlan`` splits them); KV heads travel once to the
  ranks that use them, never repeated to the query count.
* the model's ``parallelize_fn``: torchtitan's own, then each ``UlyssesInnerAttention`` is
  given the cp group (``parallel_dims.get_mesh("cp")``).
* the trainer class and the validator's (``UlyssesTrainer``, ``UlyssesValidator``): their
  ``post_dataloading_process`` (``shard_batch``) shards inputs, labels
  and positions contiguously with torchtitan's ``prepare_context_parallel_input(...,
  load_balancer_type=None)`` and passes the documents of the whole sequence to every
  attention call as ``attention_masks``: FlexAttention's mask in torchtitan's decoder is
  causal within packed documents, a document starting where ``positions`` is 0; ours is the
  same mask (rows of one document: plain causal).

Refused in ``enable`` with ``TorchtitanIntegrationError`` naming the setting, what is
expected and what was given (never silently different from one process): a load balancer,
``context_parallel_degree`` 1, pipeline/expert parallelism, an ``spmd_backend``
other than ``spmd_types``, SPMD type checking, an attention
other than ``GQAttention`` and DeepSeek V3's MLA ``Attention`` (FlexAttention's ``score_mod``,
gpt-oss's sinks ``out_transform`` enter through the others), an inner attention other than FlexAttention (varlen; SDPA, which
torchtitan 0.3.0 no longer builds for language models), a model
whose ``get_attention_masks`` is not the decoder's own causal/document mask (sliding
windows), a config that is not a plain ``Trainer.Config``, a validator other than
torchtitan's ``Validator``. ``UlyssesInnerAttention`` refuses
``score_mod``/``out_transform`` at every call too, and a scale other than its first call's
(each layer runs the scale the model passes: MLA's, with its yarn factor; ``None``: ``head_dim ** -0.5``).
Tensor parallelism (tp x cp): torchtitan's local_map hands each rank its tp heads as plain
tensors; Ulysses splits those over cp. ``torch.compile`` of the model (``compile.enable``
with ``"model"`` in ``compile.components``: torchtitan compiles each transformer block,
fullgraph): our attention runs its traced path inside each block's graph (one all-to-all
per exchange as a graph node, ``chunks`` ignored there); packed documents are constants of
that graph, so each new document layout is a new graph (torch's recompile limit then runs
the block eagerly). See docs/torchtitan.md.

torchtitan is imported when this module is (torchtitan's ``import torchtitan.trainer``:
about 12 s on the shared CPU); without torchtitan the module still imports and ``enable``
raises ``ImportError``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch

from ..attention.interface import UlyssesAttention
from ..wire import wire_spec
from .requirements import TESTED, absent, unusable

try:
    from torchtitan.components.validate import Validator
    from torchtitan.config.override import override
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.models.common.attention import FlexAttention, GQAttention
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.models.deepseek_v3.model import Attention as MLAttention
    from torchtitan.protocols.module import Module
    from torchtitan.trainer import Trainer
except ImportError as e:  # torchtitan absent: the module imports, enable() says why it cannot run
    _MISSING: ImportError | None = e
else:
    _MISSING = None

__all__ = ["enable", "zero_code", "TorchtitanIntegrationError", "document_boundaries", "shard_batch"]

# The override's import path, as torchtitan's ``override.imports`` names it.
OVERRIDE = f"{__name__}.ulysses_inner_attention"
INNER_ATTENTION_FQNS = ["*layers.*.attention.inner_attention"]  # under model_spec.model


class TorchtitanIntegrationError(ValueError):
    """A torchtitan setting this integration cannot run exactly (raised before the first step)."""


def _refuse(setting: str, expected: str, actual: Any) -> None:
    raise TorchtitanIntegrationError(f"ulysses_kernels torchtitan: {setting}: expected {expected}, got {actual!r}")


def document_boundaries(positions: torch.Tensor) -> list[list[int]] | None:
    """The packed documents of ``positions`` ``[B, S]`` (the whole sequence, before sharding):
    a document starts where the position is 0 (torchtitan's rule for its document masks).
    One boundary list ``[0, ..., S]`` per row, or ``None`` when every row is one document
    (then plain causal attention is the same mask)."""
    if positions.dim() != 2:
        raise TorchtitanIntegrationError(f"ulysses_kernels torchtitan: positions: expected [batch, seq], got shape {tuple(positions.shape)}")
    seq = positions.shape[1]
    starts = (positions == 0).cpu()
    starts[:, 0] = True  # a row that does not start at position 0 is still one document from token 0
    rows = [[*row.nonzero().flatten().tolist(), seq] for row in starts]
    return None if all(len(r) == 2 for r in rows) else rows


def _check(config, *, enabled: bool = False, deferred: bool = False) -> None:
    """Every refusal of ``enable``: settings under which the result would not equal one process.
    ``enabled``: ``config`` is ``enable``'s result, checked again when its trainer is built (after
    torchtitan's command line has set what it sets). ``deferred``: the zero-code form before the
    command line: the cp degree and load balancer are checked at the build."""
    trainer, validator = (UlyssesTrainer, UlyssesValidator) if enabled else (Trainer, Validator)
    if type(config) is not trainer.Config:
        _refuse("config", f"{trainer.__module__}.{trainer.__qualname__}.Config (its post_dataloading_process is the one replaced)", type(config).__qualname__)
    p = config.parallelism
    if not deferred and p.context_parallel_load_balancer is not None:
        _refuse("parallelism.context_parallel_load_balancer", "None (contiguous shards: rank r holds the r-th slice)", p.context_parallel_load_balancer)
    if not deferred and p.context_parallel_degree < 2:
        _refuse("parallelism.context_parallel_degree", "> 1 (Ulysses runs over the cp mesh)", p.context_parallel_degree)
    for name in ("pipeline_parallel_degree", "expert_parallel_degree"):
        if getattr(p, name) != 1:
            _refuse(f"parallelism.{name}", "1 (not validated with Ulysses over cp)", getattr(p, name))
    if p.spmd_backend != "spmd_types":
        _refuse("parallelism.spmd_backend", "'spmd_types' (the others wrap the inner attention for cp themselves)", p.spmd_backend)
    if config.debug.spmd_typechecking:
        _refuse("debug.spmd_typechecking", "False (the Ulysses exchange is not SPMD-typed)", True)
    spec = config.model_spec
    if spec is None:
        _refuse("model_spec", "a ModelSpec", None)
    model = spec.model
    if not isinstance(model, Decoder.Config):
        _refuse("model_spec.model", "a Decoder.Config", type(model).__qualname__)
    owner = type(model)._owner
    if owner is not None and getattr(owner, "get_attention_masks", None) is not Decoder.get_attention_masks:
        _refuse(f"{owner.__qualname__}.get_attention_masks", "Decoder's causal/packed-document mask", "a model-specific mask")
    for i, layer in enumerate(model.layers):
        attention = getattr(layer, "attention", None)
        if type(attention) not in (GQAttention.Config, MLAttention.Config):
            _refuse(
                f"model.layers[{i}].attention",
                "GQAttention.Config or DeepSeek V3's MLA Attention.Config (no score_mod, no out_transform)",
                type(attention).__qualname__,
            )
        if type(attention) is MLAttention.Config and p.tensor_parallel_degree != 1:
            _refuse("parallelism.tensor_parallel_degree", "1 with DeepSeek V3's MLA attention (tp x MLA is not validated yet)", p.tensor_parallel_degree)
        inner = attention.inner_attention
        if type(inner) is not FlexAttention.Config:
            _refuse(f"model.layers[{i}].attention.inner_attention", "FlexAttention.Config (attn_backend='flex')", type(inner).__qualname__)
    if type(config.validator) is not validator.Config:
        _refuse("validator", f"{validator.__qualname__}.Config (its batches are sharded as the trainer's)", type(config.validator).__qualname__)
    ours = [entry for entry in config.override.imports if (entry if isinstance(entry, str) else entry[0]) == OVERRIDE]
    if len(ours) != int(enabled):
        _refuse("override.imports", f"{OVERRIDE} {'once' if enabled else 'not before enable (enable adds it once)'}", ours)


def enable(config, *, chunks: int | str = 1, kernels: str | None = None, wire_dtype=None):
    """A copy of torchtitan's ``Trainer.Config`` ``config`` whose attention is
    ``ulysses_attention`` over the cp mesh (``UlyssesTrainer.Config``; ``config`` itself is
    not changed). ``chunks``, ``kernels`` and ``wire_dtype``: as in ``UlyssesAttention`` (head
    chunks whose exchanges overlap attention; the pack/unpack kernel set; ``"fp8"`` or a
    ``wire.WireSpec``: FP8 on the wire, docs/fp8_wire.md). Raises ``TorchtitanIntegrationError``
    for a setting it cannot run exactly (module docstring) and for a bad ``wire_dtype``."""
    return _enable(config, chunks=chunks, kernels=kernels, wire_dtype=wire_dtype)


def _missing_reason(error: ImportError) -> str:
    """Why torchtitan cannot be used; for an installed one that does not import, the versions the suite passes with."""
    titan, torch_version = TESTED["torchtitan"], TESTED["torch"]
    reason = unusable("torchtitan", error, f"pip install torchtitan=={titan}")
    if not absent("torchtitan", error):
        reason += (
            f". This integration is tested with torchtitan {titan} on torch {torch_version} (torchtitan {titan} is "
            "written for a recent torch: on torch 2.11 its import stops at `from torch.distributed.fsdp import DataParallelMeshDims`, "
            "which torch 2.13 has)"
        )
    return f"ulysses_kernels.integrations.torchtitan: {reason}"


def _enable(config, *, chunks: int | str = 1, kernels: str | None = None, wire_dtype=None, deferred: bool = False):
    if _MISSING is not None:
        raise ImportError(_missing_reason(_MISSING)) from _MISSING
    wire = wire_spec(wire_dtype, "ulysses_kernels torchtitan: enable", TorchtitanIntegrationError)
    _check(config, deferred=deferred)
    spec = config.model_spec
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config)}
    values["model_spec"] = dataclasses.replace(
        spec, model=copy.deepcopy(spec.model), parallelize_fn=functools.partial(_parallelize, parallelize_fn=spec.parallelize_fn)
    )  # fmt: skip
    values["parallelism"] = dataclasses.replace(config.parallelism)
    values["validator"] = UlyssesValidator.Config(**{f.name: getattr(config.validator, f.name) for f in dataclasses.fields(Validator.Config)})
    ours = (OVERRIDE, {"chunks": chunks, "kernels": kernels, "wire_dtype": wire})
    values["override"] = dataclasses.replace(config.override, imports=[*config.override.imports, ours])
    return UlyssesTrainer.Config(**values)


def _parallelize(model, *, parallelize_fn, parallel_dims, **kwargs):
    """torchtitan's ``parallelize_fn``, then the cp group given to every ``UlyssesInnerAttention``."""
    model = parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)
    group = parallel_dims.get_mesh("cp").get_group()
    found = 0
    for module in model.modules():
        if isinstance(module, UlyssesInnerAttention):
            module.group = group
            found += 1
    if found == 0:
        raise TorchtitanIntegrationError(
            f"ulysses_kernels torchtitan: model: expected UlyssesInnerAttention modules (the override {OVERRIDE} applied), got none"
        )
    return model


if _MISSING is None:

    class UlyssesInnerAttention(Module):
        """torchtitan's inner attention as ``UlyssesAttention`` over the cp group.

        ``forward(q, k, v, *, attention_masks, scale, enable_gqa)``: q ``[B, s_local, Hq, D]``,
        k ``[B, s_local, Hkv, D]``, v ``[B, s_local, Hkv, Dv]``, this rank's contiguous
        shard; ``attention_masks``: ``None`` (causal) or the documents
        (``document_boundaries``) ``UlyssesTrainer`` passes. Returns ``[B, s_local, Hq, Dv]``.
        The group is set by the model's ``parallelize_fn`` (``enable``)."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            chunks: int | str = 1
            kernels: str | None = None
            wire_dtype: Any = None  # None or a wire.WireSpec (enable checks and resolves it)

        def __init__(self, config: Config):
            super().__init__()
            self.chunks, self.kernels, self.wire_dtype = config.chunks, config.kernels, config.wire_dtype
            self.group = None
            # Made at the first call (the head counts come with q and k). Kept outside the
            # module tree: it has no parameters, and torchtitan's init and sharding walks
            # expect its own Module protocol of every child.
            self.__dict__["_op"] = None

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
            # The argument names are the ones torchtitan's sharding config keys on: under tensor
            # parallelism its local_map hands this rank's heads as plain tensors.
            q, k, v = q_BLNH, k_BLNH, v_BLNH
            for name in ("score_mod", "out_transform"):
                if kwargs.get(name) is not None:
                    _refuse(f"inner_attention({name}=)", "None", kwargs[name])
            if self.group is None:
                raise TorchtitanIntegrationError(
                    "ulysses_kernels torchtitan: UlyssesInnerAttention.group: expected the cp group (set by enable's parallelize_fn), got None"
                )
            op = self.__dict__["_op"]
            if op is None:  # the model's scale (None: head_dim ** -0.5; MLA's with its yarn factor)
                op = UlyssesAttention(
                    q.shape[2], k.shape[2], self.group, softmax_scale=scale, kernels=self.kernels, chunks=self.chunks, wire_dtype=self.wire_dtype
                )
                self.__dict__["_op"], self.__dict__["_scale"] = op, scale
            elif scale != self.__dict__["_scale"]:
                _refuse("attention scale", f"{self.__dict__['_scale']!r} (the first call's: one layer, one scale)", scale)
            docs = attention_masks
            if docs is not None and not isinstance(docs, list):
                _refuse("attention_masks", "None or document boundaries (UlyssesTrainer's)", type(docs).__qualname__)
            if docs is not None and len(docs) == 1:
                docs = docs[0]
            return op(q, k, v, cu_seqlens=docs)

    @override(target=FlexAttention.Config, fqns=INNER_ATTENTION_FQNS, exact=True, description="ulysses_kernels: Ulysses attention over the cp mesh")
    def ulysses_inner_attention(cfg, *, chunks: int | str = 1, kernels: str | None = None, wire_dtype=None):
        """The override ``enable`` activates: FlexAttention's config -> ``UlyssesInnerAttention.Config``
        (its mask, causal within the documents of ``positions``, is what ours runs)."""
        return UlyssesInnerAttention.Config(chunks=chunks, kernels=kernels, wire_dtype=wire_dtype, sharding_config=_local_heads(cfg.sharding_config))

    def _local_heads(sharding):
        """FlexAttention's sharding config for ours: under tensor parallelism its local_map hands
        the inner attention this rank's heads (sharded over tp) as plain tensors; FlexAttention's
        also gathers k and v over cp (``Replicate``, gradients ``Partial``): ours takes every
        tensor as q is (this rank's contiguous shard; the all-to-all is ours)."""
        if sharding is None or sharding.local_map is None:
            return sharding
        q = sharding.in_src_shardings["q_BLNH"]
        names = ("q_BLNH", "k_BLNH", "v_BLNH")
        return dataclasses.replace(
            sharding,
            in_src_shardings=dict.fromkeys(names, q),
            in_dst_shardings=dict.fromkeys(names, q),
            out_src_shardings=q,
            local_map=dataclasses.replace(sharding.local_map, in_grad_placements=(q, q, q)),
        )

    class UlyssesTrainer(Trainer):
        """torchtitan's ``Trainer`` with contiguous cp shards and the documents passed to our attention."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Trainer.Config):
            pass

        def __init__(self, config: Config):
            # enable's checks again on the config as built: torchtitan's command line (or the
            # caller) may have changed it since, and the zero-code form leaves two to here.
            _check(config, enabled=True)
            super().__init__(config)

        def post_dataloading_process(self, input_dict, labels):
            """``Trainer.post_dataloading_process`` for Ulysses: ``shard_batch``, then torchtitan's
            token count and SPMD annotation."""
            inputs, labels, extra = shard_batch(input_dict, labels, self.parallel_dims, self.device)
            self.ntokens_seen += labels.numel()
            if self.config.parallelism.spmd_backend == "spmd_types":
                inputs, labels, extra = annotate_input_spmd_types(self.parallel_dims, inputs, labels, extra)
            return inputs, labels, extra

    class UlyssesValidator(Validator):
        """torchtitan's ``Validator`` whose batches are sharded as ``UlyssesTrainer``'s (``shard_batch``)."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Validator.Config):
            pass

        def post_dataloading_process(self, input_dict, labels, model_parts):
            return shard_batch(input_dict, labels, self.parallel_dims, input_dict["input"].device)


def shard_batch(input_dict: dict, labels: torch.Tensor, parallel_dims, device: torch.device) -> tuple:
    """One batch of torchtitan's dataloader (``input_dict["input"]`` ``[B, S]``, maybe
    ``"positions"``; ``labels`` ``[B, S]``) -> ``(inputs, labels, extra_kwargs)`` for the model on
    this cp rank: positions (default ``arange(S)`` per row, so that RoPE sees global positions),
    the documents of the whole sequence (``document_boundaries``, as ``attention_masks``; none
    when every row is one document), and torchtitan's own ``prepare_context_parallel_input``
    with no load balancer: rank r keeps the r-th contiguous slice of inputs, labels and
    positions."""
    inputs = input_dict["input"]
    extra = {key: value for key, value in input_dict.items() if key != "input"}
    if extra.get("positions") is None:
        extra["positions"] = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1)
    docs = document_boundaries(extra["positions"])
    mesh = parallel_dims.get_mesh("cp")
    inputs, labels, extra = prepare_context_parallel_input(inputs, labels, extra, mesh, device, load_balancer_type=None)
    if docs is not None:
        extra["attention_masks"] = docs
    return inputs, labels, extra


# ---- the zero-code form ---------------------------------------------------------------------
# torchrun ... -m torchtitan.train --module ulysses_kernels.integrations.torchtitan \
#     --config llama3_8b --parallelism.context_parallel_degree 8
# torchtitan's ConfigManager imports this module (it has no ``config_registry`` submodule) and
# calls ``getattr(module, "<config>")()``: the module's ``__getattr__`` answers every stock config
# name of torchtitan's models with that config through ``zero_code``; the command line's
# settings apply after it, and ``UlyssesTrainer`` checks the result when it is built.


def zero_code(config, *, chunks: int | str = 1, kernels: str | None = None, wire_dtype=None):
    """``enable`` for a stock config before torchtitan's command line applies: contiguous shards
    (the load balancer set to ``None``), the cp degree left to the command line
    (``--parallelism.context_parallel_degree``); both checked, with the rest again, when the
    trainer is built."""
    config = copy.copy(config)
    config.parallelism = dataclasses.replace(config.parallelism, context_parallel_load_balancer=None)
    return _enable(config, chunks=chunks, kernels=kernels, wire_dtype=wire_dtype, deferred=True)


def stock_config(name: str, unreadable: dict | None = None):
    """The config function ``name`` of torchtitan's own models' registries
    (``torchtitan.models.<model>.config_registry``), or ``None``. A registry that does not
    import here (a model's optional dependency) is skipped, its error kept in ``unreadable``."""
    import importlib

    from torchtitan.models import _supported_models

    for model in sorted(_supported_models):
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except Exception as e:  # noqa: BLE001 - one model's registry must not hide the others'
            if unreadable is not None:
                unreadable[model] = f"{type(e).__name__}: {e}"
            continue
        fn = getattr(registry, name, None)
        if callable(fn):
            return fn
    return None


def __getattr__(name: str):
    """A stock config name (``llama3_debugmodel``, ``llama3_8b``, ``qwen3_...``) -> a function
    returning that config through ``zero_code`` (what ``--config <name>`` calls)."""
    if name.startswith("_") or _MISSING is not None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    unreadable: dict = {}
    fn = stock_config(name, unreadable)
    if fn is None:
        skipped = f"; registries that did not import: {unreadable}" if unreadable else ""
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (no torchtitan model registers a config of that name{skipped})")

    @functools.wraps(fn)
    def config():
        return zero_code(fn())

    return config
