"""DeepSpeed ALST's transformers entry point, backed by ulysses_kernels.

accelerate (``ParallelismConfig(sp_backend="deepspeed", sp_size=N)``), transformers' Trainer
(``TrainingArguments(parallelism_config=...)``), TRL and ArcticTraining make a model
sequence-parallel through DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers``
(``deepspeed/runtime/sequence_parallel/ulysses_sp.py``, 0.19.8 read). This module has a class
of that name with the same class method (same arguments, same return: the mpu for
``deepspeed.initialize``), and the switch that makes those stacks call it:

    from ulysses_kernels.integrations.deepspeed import enable_alst
    enable_alst()     # once per process, before the trainer calls DeepSpeed's ALST
                      # (enable_alst(wire_dtype="fp8"): FP8 on the wire, docs/fp8_wire.md)
    # the script as it was: Trainer / accelerate / ArcticTraining, or directly
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_or_name, "sdpa", sequence_parallel_size=8,
                                                          micro_batch_size=1)
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)

Like DeepSpeed's, ``register_with_transformers`` replaces the entry of the requested
implementation (``"sdpa"``, ``"flash_attention_2"``, ...) in transformers'
``ALL_ATTENTION_FUNCTIONS`` with this object, so the model keeps its configured
implementation (and transformers' code paths that test it) and every attention call goes
through ``forward``. That entry is the one process-wide effect, as in DeepSpeed; the group
settings live on the object.

One attention call, q/k/v ``[B, H, s_r, D]`` of this rank's ``s_r`` tokens (RoPE applied
with the global positions that ``UlyssesSPDataLoaderAdapter`` put in the batch):

    first call of a step (a new position_ids tensor): gather every rank's position_ids (two
        small all-gathers), find the shard lengths and, where positions restart (packed
        documents, each row its own), the global document boundaries -> the step's SequenceShard
    every call: hf.sequence_parallel_attention -> the fused ulysses_attention for plain causal
        attention (one all-to-all for q, k, v, one for the output; any head layout, KV heads
        sent only to the ranks that use them), else the model's own implementation on the
        rank's heads over the global sequence with the layer's mask rebuilt globally
        (sliding windows, softcapping, sinks)

What differs from DeepSpeed's class (measured in tests/test_alst.py): any head count (query
heads that the group does not divide, GQA with fewer KV heads than ranks: no
``repeat_interleave`` of KV heads before the exchange), uneven shards (``split_lengths``),
packed documents exact under the built-in implementations (DeepSpeed's sdpa path drops the
mask and attends across documents), the sliding window of sdpa layers kept (DeepSpeed drops the mask),
and the positions gathered once per step instead of in every layer.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..checks import UlyssesInputError
from ..comm import LocalCommunicator
from ..layers import audit as hf_audit
from ..layers.mixers import GROUP_KWARG, HANDLED_MIXERS, check_mixer_parallel, mixer_modules, plan_mixers, switch_mixers
from ..layers.state import switch_state
from ..layers.step import SHARD_KWARG
from ..layout import split_lengths
from ..plan import HeadPlan
from ..wire import wire_spec
from . import hf, mesh
from .hf import model as hf_model
from .hf import multimodal as hf_multimodal

__all__ = ["ALSTIntegrationError", "UlyssesSPAttentionHF", "enable_alst", "disable_alst", "alst_enabled"]

_UNSUPPORTED = ("eager", "paged|eager")  # not dispatched through ALL_ATTENTION_FUNCTIONS: nothing to intercept
_HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")  # "org/repo[@rev][:fn]", as transformers names hub kernels


class ALSTIntegrationError(UlyssesInputError):
    """A setting or batch that the ALST entry point cannot run (a ``ValueError``, as DeepSpeed raises)."""


class UlyssesSPAttentionHF(torch.nn.Module):
    """DeepSpeed's ``UlyssesSPAttentionHF`` over ``ulysses_attention``.

    The constructor takes DeepSpeed's arguments (``register_with_transformers`` makes the
    object; constructing it directly is for the same callers DeepSpeed's serves):

    Args:
        attn: the model's attention function (``ALL_ATTENTION_FUNCTIONS[impl]`` before the
            interception): what runs on each rank's heads when a call is not plain causal,
            and the whole call when sequence parallelism is off in evaluation.
        batch_size: the micro batch size (accepted; any batch size runs).
        attn_head_count, attn_head_size, kv_head_count: the model's query heads, head size
            and KV heads (the head plan is checked here: ``HeadPlan.build``).
        num_hidden_layers: accepted (DeepSpeed's debug mode counts layers with it).
        process_group: the sequence-parallel group.
        seq_length_is_variable: ``False`` checks every step's global length against
            ``global_seq_length``.
        local_seq_length, global_seq_length: the fixed lengths (``seq_length_is_variable=False``).
        disable_in_eval: in ``module.eval()``, call ``attn`` on the unsharded input instead.
        core_attn_implementation: the implementation's name (``register_with_transformers``
            sets it, as DeepSpeed does, also as an attribute).
        attn_fn, kernels, chunks, check, wire_dtype: ``ulysses_attention``'s (``hf.apply``'s)
            options (``register_with_transformers`` passes ``enable_alst``'s ``wire_dtype``).
    """

    def __init__(
        self,
        attn,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
        *,
        core_attn_implementation: str | None = None,
        attn_fn=None,
        kernels=None,
        chunks: int | str = 1,
        check: str = "step",
        wire_dtype=None,
    ) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise ALSTIntegrationError("UlyssesSPAttentionHF: torch.distributed is not initialized (init_process_group first)")
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.attn_head_size = attn_head_size
        self.attn_head_count = attn_head_count
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        # The head plan (the value the op builds for these heads), made here so that a layout no
        # group can run (more ranks than query heads) fails at registration, naming a
        # make_sp_groups split.
        self.plan = HeadPlan.build(attn_head_count, kv_head_count, self.world_size)
        if not seq_length_is_variable and global_seq_length is None:
            raise ALSTIntegrationError("UlyssesSPAttentionHF: seq_length_is_variable=False needs global_seq_length (the fixed length)")
        wire = wire_spec(wire_dtype, "UlyssesSPAttentionHF", ALSTIntegrationError)  # a bad value fails at registration
        self._options = {"attn_fn": attn_fn, "kernels": kernels, "chunks": chunks, "check": check, "wire_dtype": wire}
        self._settings = None  # hf.attention_settings, made at the first call (it knows the implementation by then)
        self._core = core_attn_implementation
        # The step's SequenceShard, keyed by the identity and version of its position_ids
        # tensor (every layer of one forward, and its recompute, get the same tensor).
        self._step: tuple | None = None
        self._restore: tuple | None = None  # (registry, key, previous local entry or None), set by register_with_transformers
        self._hook = None  # the decoder pre-hook that feeds a hybrid's mixers (register_with_transformers)
        self._class_patch = None  # (decoder class, its own forward or None, ours): a hybrid given by name or path

    @property
    def core_attn_implementation(self) -> str | None:
        return self._core

    @core_attn_implementation.setter
    def core_attn_implementation(self, name: str | None) -> None:
        self._core, self._settings = name, None

    def extra_repr(self) -> str:
        return f"{self._core!r}, heads={self.attn_head_count}/{self.global_kv_head_count}, world_size={self.world_size}"

    # ---- one attention call ---------------------------------------------------------------

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask, *args: Any, **kwargs: Any):  # fmt: skip
        """transformers' attention-function call: ``[B, H, s_r, D]`` q/k/v of this rank's
        sequence shard in, ``([B, s_r, Hq, D], None)`` out.

        ``attention_mask`` (what the model's mask function built for the local shard) is not
        used: the layer's mask is rebuilt over the global sequence from the model's
        ``sliding_window`` keyword and the step's documents. ``kwargs`` must carry
        ``position_ids`` (the global positions of this rank's tokens).
        """
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if args:
            raise ALSTIntegrationError(
                f"UlyssesSPAttentionHF: got {len(args)} positional argument(s) after the mask; transformers passes the "
                "attention options by keyword (scaling=, dropout=, ...)"
            )
        if self._class_patch is not None and GROUP_KWARG not in kwargs:
            # a hybrid registered by name or path whose decoder is not the audited class: its
            # mixers would run on this rank's shard alone (silently wrong)
            raise ALSTIntegrationError(
                f"UlyssesSPAttentionHF: registered by name or path for {self._class_patch[0].__name__}'s hybrid mixers, but "
                f"{type(module).__name__} ran in a model whose decoder is not a {self._class_patch[0].__name__}; pass the loaded "
                "model to register_with_transformers"
            )
        # The mixers' keywords (a hybrid's decoder pre-hook; sequence_parallel_attention passes
        # neither on). Its shard is the step's (the same cache, made from the model's position
        # ids before layer 0); a hybrid that does not hand position_ids to its layers
        # (GraniteMoeHybrid) runs on it.
        fed = kwargs.get(SHARD_KWARG)
        position_ids = kwargs.get("position_ids")
        if position_ids is None and fed is not None:
            self._check_no_cache(query, key)
            shard = fed
        else:
            shard = self.step_shard(query, key, position_ids)
        return hf.sequence_parallel_attention(module, query, key, value, settings=self._attention_settings(), shard=shard, **kwargs)

    def _attention_settings(self):
        if self._settings is None:
            impl = self._core if self._core is not None else _implementation_name(self.attn)
            self._settings = hf.attention_settings(self.process_group, impl=impl, fn=self.attn, **self._options)
        return self._settings

    def step_shard(self, query: torch.Tensor, key: torch.Tensor, position_ids) -> hf.SequenceShard:
        """The step's ``SequenceShard`` (shard lengths, packed documents), made at the first
        call with a new ``position_ids`` tensor and reused for the others. Collective the
        first time (two all-gathers over the group); every rank of the group runs the same
        layers, so they agree on when."""
        if position_ids is None:
            raise ALSTIntegrationError(
                "UlyssesSPAttentionHF: the model was called without position_ids; sequence parallelism needs the global "
                "position of every token of this rank's shard (UlyssesSPDataLoaderAdapter puts them in each batch, or "
                "pass hf.shard_batch(...).position_ids)"
            )
        self._check_no_cache(query, key)
        return self._shard_for(query.shape[0], query.shape[2], position_ids)

    @staticmethod
    def _check_no_cache(query: torch.Tensor, key: torch.Tensor) -> None:
        if key.shape[2] != query.shape[2]:
            raise ALSTIntegrationError(
                f"UlyssesSPAttentionHF: {key.shape[2]} keys for {query.shape[2]} queries (a KV cache): generation is not "
                "supported under sequence parallelism; generate with the model in eval() and disable_in_eval=True"
            )

    def _shard_for(self, bsz: int, local: int, position_ids) -> hf.SequenceShard:
        """``step_shard`` for ``bsz`` rows of ``local`` tokens (also called by a hybrid's
        decoder pre-hook, before its first layer: the same cache, so attention reuses it)."""
        if position_ids is None:
            raise ALSTIntegrationError(
                "UlyssesSPAttentionHF: the model was called without position_ids; sequence parallelism needs the global "
                "position of every token of this rank's shard (UlyssesSPDataLoaderAdapter puts them in each batch, or "
                "pass hf.shard_batch(...).position_ids)"
            )
        try:
            version = position_ids._version
        except RuntimeError:  # inference tensors have no version counter
            version = None
        cached = self._step
        if cached is not None and cached[0]() is position_ids and cached[1] == version:
            return cached[2]
        shard = self._new_shard(bsz, local, position_ids)
        self._step = (weakref.ref(position_ids), version, shard)
        return shard

    def _new_shard(self, bsz: int, local: int, position_ids: torch.Tensor) -> hf.SequenceShard:
        # Checked after the exchange of the shapes, so that a rank with a bad shape and its
        # peers raise the same error (none waits in a collective the other skipped).
        shape = list(position_ids.shape)
        fits = position_ids.dim() == 2 and shape[1] == local and shape[0] in (1, bsz)
        comm = self._attention_settings().comm
        everyone = comm.all_gather_ints([bsz, shape[0] if fits else -1, local, int(fits)], position_ids.device)
        if not all(v[3] for v in everyone):
            bad = ", ".join(f"rank {r}" for r, v in enumerate(everyone) if not v[3])
            raise ALSTIntegrationError(
                f"UlyssesSPAttentionHF: position_ids expected [batch or 1, this rank's tokens] on every rank; wrong on {bad} "
                f"(this rank: expected [{bsz} or 1, {local}], got {shape})"
            )
        lens = [v[2] for v in everyone]
        if any(v[:2] != everyone[0][:2] for v in everyone):
            rows = ", ".join(f"rank {r}: batch {v[0]}, position_ids rows {v[1]}" for r, v in enumerate(everyone))
            raise ALSTIntegrationError(f"UlyssesSPAttentionHF: the ranks of the sequence-parallel group hold different batches ({rows})")
        total = sum(lens)
        if lens != split_lengths(total, self.world_size):
            raise ALSTIntegrationError(
                f"UlyssesSPAttentionHF: the ranks hold {lens} tokens of a {total}-token sequence; expected the contiguous "
                f"split {split_lengths(total, self.world_size)} (UlyssesSPDataLoaderAdapter's equal shards, or "
                "hf.shard_batch's uneven ones)"
            )
        if not self.seq_length_is_variable and total != self.global_seq_length:
            raise ALSTIntegrationError(
                f"UlyssesSPAttentionHF: seq_length_is_variable=False with seq_length {self.global_seq_length}, got a {total}-token sequence"
            )
        width = max(lens)
        padded = torch.nn.functional.pad(position_ids, (0, width - local)).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.process_group)
        positions = torch.cat([p[:, :n] for p, n in zip(parts, lens)], dim=1)
        # hf.shard_batch knows the layout from the global positions alone: the shard lengths
        # (the same split_lengths rule) and, where positions restart, the documents.
        ids = torch.zeros(bsz, total, dtype=torch.long, device=position_ids.device)
        try:
            return hf.shard_batch(ids, group=self.process_group, position_ids=positions, check=False).shard
        except hf.HFIntegrationError as e:
            raise ALSTIntegrationError(f"UlyssesSPAttentionHF: the gathered position_ids cannot be sharded: {e}") from e

    # ---- DeepSpeed's entry point ----------------------------------------------------------

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path,
        core_attn_implementation,
        sequence_parallel_size,
        micro_batch_size,
        seq_length=None,
        seq_length_is_variable=True,
        disable_in_eval=False,
        # deprecated in DeepSpeed
        max_length=None,
    ):
        """Make the model's attention implementation sequence-parallel; return the mpu.

        DeepSpeed's arguments and return:

        Args:
            model_name_or_path: a model (or any object with a transformers ``config``, e.g. a
                PEFT model), or a name or path ``AutoConfig`` loads. A model's configured
                implementation must be ``core_attn_implementation``.
            core_attn_implementation: the implementation to intercept: ``"sdpa"``,
                ``"flash_attention_2/3"``, ``"flex_attention"``, a hub kernel
                (``"kernels-community/flash-attn2"``) or any registered name; ``None`` takes
                the model's configured one (``"sdpa"`` for a name or path). ``"eager"`` is
                refused (transformers calls it without the registry, so it cannot be
                intercepted; ``hf.apply`` runs eager models).
            sequence_parallel_size: ranks per sequence group (1: nothing is done, ``None``
                is returned).
            micro_batch_size: accepted (any batch size runs).
            seq_length, seq_length_is_variable: a fixed global length is checked every step
                when ``seq_length_is_variable`` is ``False``.
            disable_in_eval: run the model's own attention on unsharded input in ``eval()``.
            max_length: deprecated by DeepSpeed; the same as ``seq_length``.

        Returns:
            ``mesh.parallel_groups(sp_size=sequence_parallel_size).mpu()``: groups of
            ``sequence_parallel_size`` consecutive ranks (DeepSpeed's layout), in DeepSpeed's
            mpu convention (``mesh.DeepSpeedMPU``).

        Collective (it makes process groups): call it on every rank.
        """
        if sequence_parallel_size == 1:
            return None
        if max_length is not None and seq_length is None:
            seq_length = max_length
        if not seq_length_is_variable and seq_length is None:
            raise ALSTIntegrationError("register_with_transformers: seq_length_is_variable=False needs seq_length (the fixed length of every batch)")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        loaded = hasattr(model_name_or_path, "config")
        config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        configured = getattr(config, "_attn_implementation", None) if loaded else None
        if core_attn_implementation is None:
            core_attn_implementation = configured or "sdpa"
        if configured is not None and configured != core_attn_implementation:
            raise ALSTIntegrationError(
                f"register_with_transformers: core_attn_implementation='{core_attn_implementation}' does not match model "
                f"config attn_implementation='{configured}'; set both to the same value (the model's implementation is "
                "the one intercepted)"
            )
        if core_attn_implementation in _UNSUPPORTED:
            raise ALSTIntegrationError(
                f"register_with_transformers: {core_attn_implementation!r} is called by the model without transformers' "
                "AttentionInterface, so it cannot be intercepted; use 'sdpa' or a flash-attention implementation, or "
                "ulysses_kernels.integrations.hf.apply(model, group) for an eager model"
            )
        if isinstance(core_attn_implementation, str) and _HUB_KERNEL.search(core_attn_implementation):
            # transformers registers hub kernels when it loads them; register before looking it up.
            import transformers.modeling_flash_attention_utils as fa_utils

            fa_utils.lazy_import_flash_attention(core_attn_implementation)
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ALSTIntegrationError(
                f"register_with_transformers: {core_attn_implementation!r} is not a registered attention implementation; "
                f"expected one of {ALL_ATTENTION_FUNCTIONS.valid_keys()}"
            )
        core_fn = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        if isinstance(core_fn, UlyssesSPAttentionHF):  # registered before: wrap the model's function, not the wrapper
            core_fn = core_fn.attn

        mixers, decoder = _audit(model_name_or_path if loaded else None, config, sequence_parallel_size)
        text = config.get_text_config()
        if not isinstance(getattr(text, "num_attention_heads", None), int):
            raise ALSTIntegrationError(
                f"register_with_transformers: {type(text).__name__} has no num_attention_heads: ALST intercepts the model's "
                "attention, which an attention-free model (Mamba, Mamba2, Falcon-Mamba) does not call; run it with "
                "ulysses_kernels.integrations.hf.apply(model, group) (docs/hf.md)"
            )
        groups = mesh.parallel_groups(sp_size=sequence_parallel_size)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        uattn = cls(
            core_fn, micro_batch_size, text.num_attention_heads, head_dim, kv_heads, text.num_hidden_layers,
            groups.sp_group, seq_length_is_variable=seq_length_is_variable,
            local_seq_length=None if seq_length_is_variable else seq_length // sequence_parallel_size,
            global_seq_length=None if seq_length_is_variable else seq_length, disable_in_eval=disable_in_eval,
            core_attn_implementation=core_attn_implementation, wire_dtype=_OPTIONS.get("wire_dtype"),
        )  # fmt: skip
        # As DeepSpeed does: the implementation's own entry, so transformers' code paths that
        # test config._attn_implementation still run; only the call is intercepted.
        local = ALL_ATTENTION_FUNCTIONS._local_mapping
        uattn._restore = (ALL_ATTENTION_FUNCTIONS, core_attn_implementation, local.get(core_attn_implementation))
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn
        if mixers and loaded:
            uattn._feed_mixers(decoder, mixers)
        elif mixers:  # by name or path: the model is built later; its decoder class switches them
            uattn._feed_mixers_of_class(type(decoder), sequence_parallel_size)
        return groups.mpu()

    def _feed_mixers(self, decoder: torch.nn.Module, mixers: list) -> None:
        """A hybrid's token mixers that are not attention (``layers.mixers``): switched on their
        instances, fed by a forward pre-hook on the decoder stack with this step's
        ``SequenceShard`` (from the call's position ids, the cache attention reads too) and the
        group. The shard must be known before layer 0, which is a mixer in Qwen3.5, so it cannot
        wait for the first attention call."""
        switch_mixers(mixers, None, None)
        self._hook = decoder.register_forward_pre_hook(self._mixer_step, with_kwargs=True)

    def _feed_mixers_of_class(self, decoder_cls: type, sp_size: int) -> None:
        """``_feed_mixers`` for a model given by name or path, built after this call: the decoder
        class's ``forward`` (the audited config's text model, e.g. ``Qwen3_5TextModel``) is
        wrapped until ``unregister``, as the attention implementation's registry entry is: at
        an instance's first call its mixers are planned and switched, then each call gets the
        step's shard and group, as the pre-hook gives them. Process-wide for that class (DeepSpeed's
        entry point intercepts the attention implementation process-wide too)."""
        original = decoder_cls.__dict__.get("forward")
        inherited = decoder_cls.forward

        def forward(module, *args, **kwargs):
            state = switch_state(module)
            if not state.mixers_switched:
                switch_mixers(plan_mixers(mixer_modules(module), sp_size, _OPTIONS.get("mixer_parallel", "auto")), None, None)
                state.mixers_switched = True
            args, kwargs = self._mixer_step(module, args, kwargs)
            return inherited(module, *args, **kwargs)

        forward.__wrapped__ = inherited
        decoder_cls.forward = forward
        self._class_patch = (decoder_cls, original, forward)

    def _mixer_step(self, module, args, kwargs):
        # transformers' models call their decoder with keywords; a caller may pass input_ids first.
        named = {**({"input_ids": args[0]} if args else {}), **kwargs}
        tokens = named.get("input_ids")
        if tokens is None:
            tokens = named.get("inputs_embeds")
        if tokens is None:
            raise ALSTIntegrationError(f"UlyssesSPAttentionHF: {type(module).__name__} called with neither input_ids nor inputs_embeds")
        if self.disable_in_eval and not module.training:  # the model's own layers on the unsharded input
            return args, {**kwargs, GROUP_KWARG: (None, LocalCommunicator())}
        shard = self._shard_for(int(tokens.shape[0]), int(tokens.shape[1]), named.get("position_ids"))
        return args, {**kwargs, SHARD_KWARG: shard, GROUP_KWARG: (self.process_group, self._attention_settings().comm)}

    def unregister(self) -> None:
        """Give the implementation's registry entry back (what it was before
        ``register_with_transformers``). DeepSpeed's class has no such call."""
        if self._restore is None:
            return
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._class_patch is not None:
            cls, original, ours = self._class_patch
            if cls.__dict__.get("forward") is ours:
                if original is None:
                    del cls.forward
                else:
                    cls.forward = original
            self._class_patch = None
        registry, key, previous = self._restore
        if registry._local_mapping.get(key) is self:
            if previous is None:
                del registry[key]
            else:
                registry[key] = previous
        self._restore = None


def _audit(model, config, sp_size: int) -> tuple[list, torch.nn.Module | None]:
    """``hf.apply``'s audit of token mixers (``layers.audit``), before any group is made: every module
    that mixes tokens along the sequence must be attention this entry point intercepts or a
    mixer ``layers.mixers`` runs. Returns ``(mixers with their head plans at sp_size, the decoder
    stack or None without mixers)``. A model given by name or path (or a config holder that is
    not a module) is audited as built from its config on the meta device (no memory, no
    weights): its plans say the heads split, its decoder's class is what
    ``_feed_mixers_of_class`` wraps."""
    from transformers import AutoModel, AutoModelForCausalLM

    handled = HANDLED_MIXERS
    if not isinstance(model, torch.nn.Module):
        try:
            with torch.device("meta"):
                try:
                    model = AutoModelForCausalLM.from_config(config)
                except ValueError:  # not a causal LM: its base model
                    model = AutoModel.from_config(config)
        except Exception as e:  # noqa: BLE001 - any failure leaves the model unaudited: refuse
            raise ALSTIntegrationError(
                f"register_with_transformers: could not build {type(config).__name__} on the meta device to check its token mixers "
                f"({type(e).__name__}: {e}); pass the loaded model instead of its name or path"
            ) from e
    texts = hf_multimodal.text_model(model) if hasattr(model, "config") and hasattr(model.config, "get_text_config") else None
    modules = [m for m in hf_model.attention_modules(model) if texts is None or m.config is texts.config]
    try:
        hf_audit.check_token_mixers(model, handled, attention=modules, scope=texts, caller="register_with_transformers")
        mixers = plan_mixers(mixer_modules(model if texts is None else texts), sp_size, _OPTIONS.get("mixer_parallel", "auto"))
        return mixers, ((texts if texts is not None else model.base_model) if mixers else None)
    except hf.HFIntegrationError as e:
        raise ALSTIntegrationError(str(e)) from e


def _implementation_name(fn) -> str:
    """The registered name of a transformers attention function ("" for an unregistered one)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, registered in ALL_ATTENTION_FUNCTIONS._global_mapping.items():
        if registered is fn:
            return name
    return ""


# ---- the switch ---------------------------------------------------------------------------

# What enable_alst replaced in DeepSpeed, for disable_alst: the module attribute and the class
# method of DeepSpeed's class (the switch's own record; nothing here depends on a group).
_REPLACED: dict[str, Any] = {}
# enable_alst's options, which register_with_transformers passes on (DeepSpeed's arguments have
# no room for them; the stacks above call it with those alone).
_OPTIONS: dict[str, Any] = {}


def _delegate(deepspeed_cls, *args, **kwargs):
    return UlyssesSPAttentionHF.register_with_transformers(*args, **kwargs)


def enable_alst(*, wire_dtype=None, mixer_parallel: str = "auto") -> None:
    """Make DeepSpeed's ALST entry point run ``UlyssesSPAttentionHF`` of this module.

    After it, ``deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF`` is this
    module's class (what accelerate imports when it prepares a model with
    ``ParallelismConfig(sp_backend="deepspeed")``, and what scripts that import it afterwards
    get), and DeepSpeed's own class's ``register_with_transformers`` delegates to ours (for
    code that imported DeepSpeed's class before the switch, like ArcticTraining's trainer).
    DeepSpeed's ``UlyssesSPDataLoaderAdapter`` is kept: it shards the batches our attention
    reads. Idempotent; ``disable_alst()`` undoes it. Needs DeepSpeed.

    ``wire_dtype``: ``None``, ``"fp8"`` or a ``wire.WireSpec``: FP8 on every exchange of the
    attention calls of models registered from now on (docs/fp8_wire.md; a bad value raises
    ``ALSTIntegrationError`` here, before anything changes). A later call sets it again.
    ``mixer_parallel``: ``"heads"``, ``"state"`` or ``"auto"``: how a hybrid's linear-attention
    and SSM layers run in models registered from now on (``hf.apply``'s keyword), set likewise.
    """
    wire = wire_spec(wire_dtype, "enable_alst", ALSTIntegrationError)
    check_mixer_parallel(mixer_parallel, "enable_alst", ALSTIntegrationError)
    _OPTIONS["mixer_parallel"] = mixer_parallel
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    _OPTIONS["wire_dtype"] = wire
    if _REPLACED:
        return
    theirs = ulysses_sp.UlyssesSPAttentionHF
    _REPLACED.update(cls=theirs, method=theirs.__dict__["register_with_transformers"])
    theirs.register_with_transformers = classmethod(_delegate)
    ulysses_sp.UlyssesSPAttentionHF = UlyssesSPAttentionHF


def disable_alst() -> None:
    """Undo ``enable_alst`` (DeepSpeed's class and method back). Registrations already made
    stay until their objects' ``unregister()``."""
    _OPTIONS.clear()
    if not _REPLACED:
        return
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    theirs = _REPLACED.pop("cls")
    theirs.register_with_transformers = _REPLACED.pop("method")
    ulysses_sp.UlyssesSPAttentionHF = theirs


def alst_enabled() -> bool:
    """Whether ``enable_alst()`` is in effect in this process."""
    return bool(_REPLACED)
