"""Tiny random-weight transformers models, built from a config class with no download: what the
model-coverage walk (``tests/test_hf_walk.py``, ``scripts/hf_coverage.py``) runs.

``tiny_causal_lms()`` lists transformers' causal LMs (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``);
``build_tiny(model_type)`` shrinks that model type's default config generically (hidden 64, 4
layers, 4 query heads over 2 KV heads of 16, vocab 61, 96-wide MLPs, 4 experts top 2; every other
size field the config has that reads as a width, a count of experts or a rank, cut down) and
builds the model in float64 on the CPU. A model that cannot be shrunk or built that way raises
``NotBuildable`` with the reason; nothing is dropped silently.

Public (``from ulysses_kernels.testing import build_tiny``): a model for a first try with no
download, e.g. ``build_tiny("qwen3_5_text")``, a Qwen3.5 hybrid (Gated DeltaNet and attention
layers), as the README's first example builds it.

4 layers, so that a hybrid's default layer pattern (an attention layer every 2nd, 3rd or 4th
layer, Mamba or linear attention between) has both kinds.
"""

from __future__ import annotations

import re

import torch

__all__ = ["NotBuildable", "tiny_causal_lms", "build_tiny", "MAX_PARAMETERS"]

VOCAB = 61
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
LAYERS = 4
MAX_PARAMETERS = 2_000_000  # a tiny model is ~0.1M; more means a size field was not shrunk

# Standard names (a config's ``attribute_map`` points its own names at these).
_STANDARD = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "intermediate_size": 96,
    "max_position_embeddings": 64,
}

# Other fields, by exact name, when the config has them: widths, expert counts, ranks.
_FIELDS = {
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "ffn_hidden_size": 96,
    "ffn_dim": 96,
    "decoder_ffn_dim": 96,
    "encoder_ffn_dim": 96,
    "d_ff": 96,
    "n_inner": 96,
    "decoder_attention_heads": HEADS,
    "encoder_attention_heads": HEADS,
    "num_decoder_attention_heads": HEADS,
    "num_encoder_attention_heads": HEADS,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "num_decoder_layers": 2,
    "num_encoder_layers": 2,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    # linear attention / state-space sizes
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_d_state": 8,
    "mamba_n_groups": 1,
    "mamba_expand": 1,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 8,
    "ssm_state_size": 8,
    "state_size": 8,
    "n_groups": 1,
    "chunk_size": 8,
    "time_step_rank": 8,
    "conv_L_cache": 3,
    "block_dim": 64,
    "block_ff_dim": 96,
    "lru_width": 64,
    "attention_window_size": 64,
    "sliding_window": 64,
    "n_positions": 64,
    "n_ctx": 64,
    "max_seq_len": 64,
    "num_local_attention_heads": HEADS,
}


# Model-specific fields the generic rules above cannot guess: the hybrids' layer layouts (both
# kinds among 4 layers) and the sizes their configs check against each other.
_OVERRIDES: dict[str, dict] = {
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 1},
    "bamba": {"attn_layer_indices": [1, 3]},
    # its default layout is Mamba2 layers only (no attention for apply to switch)
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
    "mamba2": {"num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 1, "state_size": 8, "chunk_size": 8},
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_expand": 1},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1, "mamba_dt_rank": 8},
    "zamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "attention_hidden_size": 128,
        "attention_head_dim": 32,
        "mamba_dt_rank": 8,
        "n_mamba_heads": 2,
        "num_key_value_heads": HEADS,
    },
    "zamba2": {
        "attention_hidden_size": 128,
        "attention_head_dim": 32,
        "mamba_headdim": 16,
        "n_mamba_heads": 8,
        "mamba_expand": 2,  # 8 heads of 16 = 2 x hidden (the generic rules cut the expansion to 1)
        "hybrid_layer_ids": [1, 3],
        "num_key_value_heads": HEADS,
        "num_query_groups": HEADS,
    },
    "mamba": {"time_step_rank": 8},
    "falcon_mamba": {"time_step_rank": 8},
    "rwkv": {"attention_hidden_size": 64, "intermediate_size": 96},
    "xlstm": {"embedding_dim": 64, "num_heads": 4, "num_blocks": 4},
    "reformer": {"is_decoder": True},
    "zaya": {"num_experts_per_tok": 1},
    "xlnet": {"d_head": 16},
    "gpt_neo": {"attention_types": [[["global", "local"], 2]]},
    "ctrl": {"dff": 96},
    "kimi_linear": {"linear_head_dim": 16, "linear_num_heads": 4, "qk_head_dim": 24, "num_key_value_heads": HEADS},
}

# Fields that lay layers out: cut to 4 layers that keep every kind (first appearance order,
# cycled), so that a hybrid's attention and its other mixers both appear.
_LAYOUTS = ("layer_types", "layers_block_type", "mlp_layer_types", "block_types")
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


class NotBuildable(Exception):
    """A model type whose config could not be shrunk, or whose model could not be built, on the CPU."""


def tiny_causal_lms() -> dict[str, str]:
    """``{model_type: model class name}`` of transformers' causal LMs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _config(model_type: str, overrides: dict):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_cls = CONFIG_MAPPING[model_type]
    except (KeyError, ImportError) as e:
        raise NotBuildable(f"no config class: {e}") from e
    try:
        defaults = config_cls()
    except Exception as e:  # noqa: BLE001 - any failure is the reason it is not buildable
        raise NotBuildable(f"{config_cls.__name__}() failed: {type(e).__name__}: {e}") from e
    if hasattr(defaults, "text_config") and getattr(defaults, "text_config", None) is not None and model_type not in _TEXT_INSIDE:
        raise NotBuildable(f"{config_cls.__name__} nests a text config (a multimodal wrapper): shrink its text model's type instead")
    keys = set(defaults.to_dict()) | set(getattr(config_cls, "attribute_map", {}))
    kwargs = {}
    for name, value in _STANDARD.items():
        aliases = [k for k, v in getattr(config_cls, "attribute_map", {}).items() if v == name]
        for key in [name, *aliases]:
            if key in keys:
                kwargs[key] = value
    kwargs.update({k: v for k, v in _FIELDS.items() if k in keys})
    for key in _LAYOUTS:
        layout = defaults.to_dict().get(key)
        if isinstance(layout, (list, tuple)) and layout and key != "block_types":
            kinds = list(dict.fromkeys(layout))
            kwargs[key] = [kinds[i % len(kinds)] for i in range(LAYERS)]
    for key, value in _TOKEN_IDS.items():
        current = getattr(defaults, key, None)
        if isinstance(current, int) and current >= VOCAB:
            kwargs[key] = value
    if "qk_rope_head_dim" in keys:  # MLA: the config's head_dim is the rotary part of q/k; k/v per query head
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
        kwargs["num_key_value_heads"] = HEADS
    # No randomness in a training step: dropout (which each rank draws for its own tokens) and
    # router jitter off, so that one process and the ranks compute the same function.
    for key, value in defaults.to_dict().items():
        if re.search(r"dropout|pdrop|jitter", key) and isinstance(value, float) and value > 0:
            kwargs[key] = 0.0
    kwargs.update(_OVERRIDES.get(model_type, {}))
    kwargs.update(overrides)
    kwargs.setdefault("attn_implementation", "sdpa")
    kwargs.setdefault("experts_implementation", "eager")  # grouped_mm has no float64 kernel on the CPU
    del transformers
    try:
        return config_cls(**kwargs)
    except Exception as e:  # noqa: BLE001
        raise NotBuildable(f"{config_cls.__name__}(tiny sizes) failed: {type(e).__name__}: {e}") from e


_TEXT_INSIDE: set[str] = set()


def build_tiny(model_type: str, overrides: dict | None = None, dtype: torch.dtype = torch.float64, seed: int = 0):
    """A tiny random ``model_type`` causal LM (its class in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``),
    in ``dtype`` on the CPU. Raises ``NotBuildable`` with the reason."""
    import transformers

    class_name = tiny_causal_lms()[model_type]
    model_cls = getattr(transformers, class_name, None)
    if model_cls is None:
        raise NotBuildable(f"transformers has no class {class_name}")
    overrides = dict(overrides or {})
    config = _config(model_type, overrides)
    if "attn_implementation" not in overrides and not getattr(model_cls, "_supports_sdpa", True):
        config = _config(model_type, {**overrides, "attn_implementation": "eager"})  # the model has no sdpa path
    # Counted on the meta device first: a size field left at its default can mean gigabytes.
    try:
        with torch.device("meta"):
            shape = model_cls(config)
    except Exception as e:  # noqa: BLE001 - any failure is the reason it is not buildable
        raise NotBuildable(f"{class_name}(tiny config) failed: {type(e).__name__}: {str(e)[:200]}") from e
    count = sum(p.numel() for p in shape.parameters()) + sum(b.numel() for b in shape.buffers())
    if count > MAX_PARAMETERS:
        big = max([*shape.named_parameters(), *shape.named_buffers()], key=lambda kv: kv[1].numel())
        raise NotBuildable(
            f"{count / 1e6:.1f}M parameters after shrinking (largest: {big[0]} {list(big[1].shape)}): a size field the generic shrinking does not know"
        )
    del shape
    torch.manual_seed(seed)
    try:
        model = model_cls(config)
    except Exception as e:  # noqa: BLE001
        raise NotBuildable(f"{class_name}(tiny config) failed: {type(e).__name__}: {str(e)[:200]}") from e
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0  # the hard-coded ones too
    return model.to(dtype).train()
