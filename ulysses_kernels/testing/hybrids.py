"""Tiny random hybrid models (token mixers that are not attention beside attention) and the
float64 forms of their recurrences: what the hybrid tests (tests/test_hf_hybrid.py and the verl,
ALST and GPU-step tests built on it) and ``python -m ulysses_kernels.bench.hybrid_step`` run.

* ``MODELS``: ``(name, config class, model class, mixer class, config)`` per model, sizes small
  enough for float64 on 2 CPU cores; ``build(case)`` makes the model from its transformers
  config (no download), float64, seeded, with the per-head gates drawn at random;
* ``float64_kernels()``: the models' recurrences (Gated DeltaNet, Kimi's delta rule, the Mamba2
  scan, Mamba1's selective scan; Jamba's and Zamba2's norms) in float64 sequential forms in
  place of transformers' float32 fallbacks (and of flash-linear-attention / mamba_ssm when
  those are installed), in the modeling modules both a one-process run and a sharded run call
  them from: a reference that rounds at float64 only;
* ``one_process_step`` (``testing.reference``'s) / ``sharded_step``: one training step (loss,
  every parameter gradient, the logits) of a model in one process, and of a model under
  ``hf.apply`` on its shard (the loss reduced, the gradients synced, the logits gathered over
  the group).
"""

from __future__ import annotations

import contextlib

import torch

from ..integrations import hf
from .reference import one_process_step

__all__ = [
    "MODELS",
    "VOCAB",
    "build",
    "float64_kernels",
    "gated_delta_rule_float64",
    "mamba2_scan_float64",
    "one_process_step",
    "selective_scan_float64",
    "sharded_step",
]

VOCAB = 61
_ATTN = {"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 12, "max_position_embeddings": 64, "attn_implementation": "sdpa"}  # fmt: skip
_GDN = {"linear_num_value_heads": 6, "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}
_SSM = {"vocab_size": VOCAB, "hidden_size": 48, "num_hidden_layers": 2, "state_size": 8, "conv_kernel": 4, "expand": 1, "residual_in_fp32": False}
_MAMBA = {"mamba_n_heads": 6, "mamba_d_head": 8, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 8, "mamba_expand": 1}

# (name, config class, model class, the mixer class, config). Mamba2's chunk of 8 tokens: the
# 13-token sequence is two chunks (the inter-chunk state passing runs). Qwen3-Next with dense
# MLPs (``mlp_only_layers``): its MoE router's float32 softmax turns the float64 rounding of
# one document run alone into float32 steps of the routing weights (1.6e-10 on the packed
# logits, measured), which says nothing about the mixer; MoE under apply is tests/test_hf_models.py.
MODELS = [
    ("qwen3.5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3_5GatedDeltaNet", _ATTN | _GDN | {
        "layer_types": ["linear_attention", "full_attention", "linear_attention"], "num_hidden_layers": 3}),
    ("qwen3-next", "Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3NextGatedDeltaNet", _ATTN | _GDN | {
        "layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2, "mlp_only_layers": [0, 1]}),
    ("olmo-hybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM", "OlmoHybridGatedDeltaNet", _ATTN | _GDN | {
        "layer_types": ["linear_attention", "full_attention", "linear_attention"], "num_hidden_layers": 3, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2}),
    ("qwen3.5-moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeGatedDeltaNet", _ATTN | _GDN | {
        "layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "experts_implementation": "eager"}),
    ("kimi-linear", "KimiLinearConfig", "KimiLinearForCausalLM", "KimiLinearDeltaAttention", _ATTN | {
        "layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2, "mlp_layer_types": ["dense", "dense"],
        "linear_attn_config": {"head_dim": 8, "num_heads": 6, "short_conv_kernel_size": 4}, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8, "v_head_dim": 12, "num_key_value_heads": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Bailing Hybrid: KDA with one gate projection and the bounded (safe) gate, MLA attention, dense MLPs.
    ("bailing-hybrid", "BailingHybridConfig", "BailingHybridForCausalLM", "BailingHybridDeltaAttention", _ATTN | {
        "layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2, "mlp_layer_types": ["dense", "dense"],
        "linear_head_dim": 8, "linear_num_heads": 6, "linear_conv_kernel_dim": 4, "kv_lora_rank": 16, "q_lora_rank": None,
        "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 12, "num_key_value_heads": 4, "num_nextn_predict_layers": 0,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # The same with its unbounded gate (kda_safe_gate=False: Kimi's -exp(A_log) * softplus).
    ("bailing-hybrid-softplus", "BailingHybridConfig", "BailingHybridForCausalLM", "BailingHybridDeltaAttention", _ATTN | {
        "layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2, "mlp_layer_types": ["dense", "dense"],
        "linear_head_dim": 8, "linear_num_heads": 6, "linear_conv_kernel_dim": 4, "kv_lora_rank": 16, "q_lora_rank": None,
        "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 12, "num_key_value_heads": 4, "num_nextn_predict_layers": 0,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "kda_safe_gate": False}),
    ("bamba", "BambaConfig", "BambaForCausalLM", "BambaMixer", _ATTN | _MAMBA | {"num_hidden_layers": 3, "attn_layer_indices": [1]}),
    ("nemotron-h", "NemotronHConfig", "NemotronHForCausalLM", "NemotronHMamba2Mixer", _ATTN | {
        "layers_block_type": ["mamba", "attention", "mlp", "mamba"], "num_hidden_layers": 4, "mamba_num_heads": 6, "mamba_head_dim": 8,
        "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4, "chunk_size": 8}),
    ("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", "GraniteMoeHybridMambaLayer", _ATTN | _MAMBA | {
        "layer_types": ["linear_attention", "full_attention", "linear_attention"], "num_hidden_layers": 3, "position_embedding_type": "rope",
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 16, "experts_implementation": "eager",
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.25, "logits_scaling": 4.0}),
    # Zamba2: its shared attention reads 2 x hidden per token (the hidden state and the embeddings), heads of 2 x 48 / 4 (no
    # head_dim); MHA: transformers' LoRA adapters of the shared block are sized for MHA (GQA with them fails in one process).
    ("zamba2", "Zamba2Config", "Zamba2ForCausalLM", "Zamba2MambaMixer", {k: v for k, v in _ATTN.items() if k != "head_dim"} | {
        "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"], "num_hidden_layers": 4, "n_mamba_heads": 6,
        "mamba_expand": 1, "mamba_ngroups": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "chunk_size": 8, "use_mem_rope": True,
        "use_shared_attention_adapter": True, "adapter_rank": 4, "num_mem_blocks": 2, "num_key_value_heads": 4}),
    ("falcon-h1", "FalconH1Config", "FalconH1ForCausalLM", "FalconH1Mixer", _ATTN | _MAMBA | {"num_hidden_layers": 2, "mamba_d_ssm": 48}),
    ("jamba", "JambaConfig", "JambaForCausalLM", "JambaMambaMixer", _ATTN | {
        "num_hidden_layers": 3, "attn_layer_period": 3, "attn_layer_offset": 1, "num_experts": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
        "mamba_expand": 1, "mamba_dt_rank": 8, "use_mamba_kernels": False}),
    # MiniMax: lightning attention (blocks of 8: the 13 tokens are two) beside softmax attention, top-2 of 4 eager experts.
    ("minimax", "MiniMaxConfig", "MiniMaxForCausalLM", "MiniMaxLightningAttention", _ATTN | {
        "layer_types": ["linear_attention", "full_attention", "linear_attention"], "num_hidden_layers": 3, "block_size": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2, "experts_implementation": "eager"}),
    # Zamba (v1): Mamba1 in 4 heads of 12 channels, each with its own x_proj/dt_proj, and a shared attention block over
    # [hidden, embeddings] (2 x 48 wide, 4 heads of 24) at layers 2 and 4 (transformers ties the shared block's weights to
    # layer 2's: it needs two hybrid layers, the first at 2).
    ("zamba", "ZambaConfig", "ZambaForCausalLM", "ZambaMambaMixer", {
        "vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 5, "attn_layer_period": 3, "attn_layer_offset": 1,
        "attention_hidden_size": 96, "attention_head_dim": 24, "num_attention_heads": 4, "num_key_value_heads": 4, "n_mamba_heads": 4,
        "mamba_expand": 1, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_dt_rank": 8, "use_associative_scan": False,
        "attn_implementation": "sdpa", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # RecurrentGemma (Griffin): RG-LRU blocks (4 heads of 12 channels) and a local-attention layer (MQA), partial RoPE, logit softcap.
    ("recurrent-gemma", "RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", "RecurrentGemmaRecurrentBlock", {
        "vocab_size": VOCAB, "hidden_size": 48, "lru_width": 48, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 12, "num_hidden_layers": 3, "block_types": ["recurrent", "attention", "recurrent"], "attention_window_size": 64,
        "conv1d_width": 4, "attn_implementation": "sdpa", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Attention-free: Mamba (Mamba1), Falcon-Mamba (Mamba1 with its dt/B/C norms), Mamba2 (Codestral Mamba's architecture).
    ("mamba", "MambaConfig", "MambaForCausalLM", "MambaMixer", _SSM | {"time_step_rank": 8, "use_mambapy": False}),
    ("falcon-mamba", "FalconMambaConfig", "FalconMambaForCausalLM", "FalconMambaMixer", _SSM | {"time_step_rank": 8, "use_mambapy": False}),
    ("mamba2", "Mamba2Config", "Mamba2ForCausalLM", "Mamba2Mixer", _SSM | {"num_heads": 6, "head_dim": 8, "n_groups": 2, "chunk_size": 8}),
    ("lfm2", "Lfm2Config", "Lfm2ForCausalLM", "Lfm2ShortConv", _ATTN | {
        "layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3, "conv_L_cache": 3}),
    ("lfm2-moe", "Lfm2MoeConfig", "Lfm2MoeForCausalLM", "Lfm2MoeShortConv", _ATTN | {
        "layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3, "conv_L_cache": 3, "num_dense_layers": 1,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "experts_implementation": "eager"}),
    ("lfm3", "Lfm3Config", "Lfm3ForCausalLM", "Lfm3ShortConv", _ATTN | {
        "layer_types": ["conv", "full_attention", "conv", "sliding_attention"], "num_hidden_layers": 4, "conv_L_cache": 7,
        "sliding_window": 5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
]  # fmt: skip


def gated_delta_rule_float64(query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """``torch_recurrent_gated_delta_rule``'s recurrence in the inputs' dtype (no float32 cast):
    per token, the state decays by ``exp(g)`` (per head, or per key channel: Kimi), takes the delta-rule update ``beta (v - S^T k)``
    along ``k``, and is read by ``q / sqrt(Dk)`` (q, k L2-normalized)."""
    hv, hk = value.shape[2], key.shape[2]
    query, key = query.repeat_interleave(hv // hk, dim=2), key.repeat_interleave(hv // hk, dim=2)
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query * query.shape[-1] ** -0.5
    g, beta = g.to(value.dtype), beta.to(value.dtype)
    state = value.new_zeros(value.shape[0], hv, key.shape[-1], value.shape[-1]) if initial_state is None else initial_state.to(value.dtype)
    outs = []
    for t in range(value.shape[1]):
        # GDN: one decay per head [B, H]; Kimi's KDA: one per key channel [B, H, Dk].
        state = state * (g[:, t].exp()[..., None, None] if g.dim() == 3 else g[:, t].exp()[..., None])
        delta = (value[:, t] - (state * key[:, t].unsqueeze(-1)).sum(-2)) * beta[:, t].unsqueeze(-1)
        state = state + key[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * query[:, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outs, dim=1), state if output_final_state else None


def mamba2_scan_float64(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
                         dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):  # fmt: skip
    """``mamba2_chunk_scan``'s SSM as a sequential scan in the inputs' dtype: per token and head,
    ``state = exp(dt A) state + dt x B^T``, ``y = state C + D x``."""
    heads, groups = hidden_states.shape[2], B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    B, C = B.repeat_interleave(heads // groups, dim=2), C.repeat_interleave(heads // groups, dim=2)
    A = A.to(hidden_states.dtype)
    state = hidden_states.new_zeros(hidden_states.shape[0], heads, hidden_states.shape[3], B.shape[3])
    if initial_states is not None:
        state = initial_states.to(hidden_states.dtype)
    outs = []
    for t in range(hidden_states.shape[1]):
        x, d = hidden_states[:, t], dt[:, t]
        state = state * (d * A).exp()[..., None, None] + (d[..., None] * x).unsqueeze(-1) * B[:, t].unsqueeze(-2)
        outs.append((state * C[:, t].unsqueeze(-2)).sum(-1) + (D[:, None] * x if D is not None else 0))
    out = torch.stack(outs, dim=1)
    return (out, state) if return_final_states else out


def selective_scan_float64(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False,
                            **kwargs):  # fmt: skip
    """``mamba_selective_scan``'s recurrence (Mamba1) in the inputs' dtype: per channel and token,
    ``state = exp(dt A) state + dt x B``, ``y = state C + D x``, times ``silu(z)``; ``[B, I, S]``
    x/dt/z, ``[B, N, S]`` B/C."""
    dt = dt + delta_bias.to(dt.dtype)[..., None] if delta_bias is not None else dt
    dt = torch.nn.functional.softplus(dt) if delta_softplus else dt
    A = A.to(hidden_states.dtype)
    state = hidden_states.new_zeros(hidden_states.shape[0], hidden_states.shape[1], A.shape[-1])
    outs = []
    for t in range(hidden_states.shape[2]):
        d, x = dt[:, :, t], hidden_states[:, :, t]
        state = (d[..., None] * A).exp() * state + (d * x)[..., None] * B[:, None, :, t]
        outs.append((state * C[:, None, :, t]).sum(-1))
    out = torch.stack(outs, dim=-1)
    if D is not None:
        out = out + hidden_states * D.to(hidden_states.dtype)[None, :, None]
    if z is not None:
        out = out * torch.nn.functional.silu(z)
    return (out, state) if return_last_state else out


def _rms_norm_float64(self, hidden_states):
    """An RMSNorm (JambaRMSNorm, Zamba2RMSNorm) in the input's dtype (transformers' normalize in
    float32). Jamba's x_proj
    output goes through three of them (dt, B, C) inside the mixer: their float32 backward sums
    in an order that depends on the tensors' layout, so the gradients upstream of them (x_proj,
    the conv, in_proj) moved by float32 steps between two correct runs.
    NOTE: measured in one process, apply against the model with float32 norms: x_proj 1.7e-8,
    in_proj 2.7e-9, loss and logits 0."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _one_plus_rms_norm_float64(self, x):
    """RecurrentGemmaRMSNorm (Gemma's ``1 + weight``) in the input's dtype."""
    return self._norm(x) * (1.0 + self.weight)


def _rnn_scan_in_input_dtype(own):
    """RecurrentGemmaRglru's ``_rnn_scan`` (``own``) accumulating in the inputs' dtype (the model's: float32)."""

    def scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=None):
        return own(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=hidden_states.dtype)

    return scan


def _weightless_rms_norm_float64(self, x):
    """FalconMambaWeightlessRMSNorm (its mixer's dt/B/C norms) in the input's dtype."""
    return self._norm(x)


def _gated_rms_norm_float64(self, hidden_states, gate=None):
    """Zamba2RMSNormGated (Bamba's code) in the input's dtype: ``silu(gate)`` times the input,
    normalized per group of ``group_size`` channels, times the weight."""
    if gate is not None:
        hidden_states = hidden_states * torch.nn.functional.silu(gate)
    *prefix, last = hidden_states.shape
    grouped = hidden_states.view(*prefix, last // self.group_size, self.group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * grouped.view(*prefix, last)


def _sigmoid_gated_rms_norm_float64(self, hidden_states, gate=None):
    """BailingHybridRMSNormGated in the input's dtype: normalized over the head, times the
    weight, times ``sigmoid(gate)`` (transformers' runs in float32 whatever the input).
    NOTE: measured, Bailing Hybrid at 2 ranks with its float32 gated norm: its weight's gradient
    9.1e-8 from one process (the float32 sums over each rank's tokens), against 1e-9."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon)) * torch.sigmoid(gate)


# Norms in float64 where the model's float32 ones move a packed check near its tolerance: Zamba2's
# shared attention block, run at two layers, reads its RMSNorm's float32-rounded output.
# NOTE: measured, Zamba2 packed at 4 ranks with its float32 norms: gradients 7.2e-7 (the shared
# attention's q adapter; logits 7.8e-8), against 1e-6; with both norms in float64 in both runs:
# 1.4e-15 (A_log, cast to float32 by the model, 7.1e-8).
_FLOAT64_NORMS = {
    "jamba": (("JambaRMSNorm", _rms_norm_float64),),
    "zamba2": (("Zamba2RMSNorm", _rms_norm_float64), ("Zamba2RMSNormGated", _gated_rms_norm_float64)),
    "bailing_hybrid": (("BailingHybridRMSNormGated", _sigmoid_gated_rms_norm_float64),),
    "recurrent_gemma": (("RecurrentGemmaRMSNorm", _one_plus_rms_norm_float64),),
    "zamba": (("ZambaRMSNorm", _rms_norm_float64),),
    "mamba": (("MambaRMSNorm", _rms_norm_float64),),
    "falcon_mamba": (("FalconMambaRMSNorm", _rms_norm_float64), ("FalconMambaWeightlessRMSNorm", _weightless_rms_norm_float64)),
    "mamba2": (("Mamba2RMSNorm", _rms_norm_float64), ("MambaRMSNormGated", _gated_rms_norm_float64)),
}

_FLOAT64_KERNELS = {
    "jamba": ("mamba_selective_scan", selective_scan_float64),
    "mamba": ("mamba_selective_scan", selective_scan_float64),
    "zamba": ("mamba_selective_scan", selective_scan_float64),
    "falcon_mamba": ("mamba_selective_scan", selective_scan_float64),
    "mamba2": ("mamba2_chunk_scan", mamba2_scan_float64),
    "qwen3_5": ("torch_chunk_gated_delta_rule", gated_delta_rule_float64),
    "qwen3_next": ("torch_chunk_gated_delta_rule", gated_delta_rule_float64),
    "olmo_hybrid": ("torch_chunk_gated_delta_rule", gated_delta_rule_float64),
    "kimi_linear": ("chunk_kimi_delta_attention", gated_delta_rule_float64),
    "bailing_hybrid": ("chunk_kimi_delta_attention", gated_delta_rule_float64),
    "bamba": ("mamba2_chunk_scan", mamba2_scan_float64),
    "nemotron_h": ("mamba2_chunk_scan", mamba2_scan_float64),
    "falcon_h1": ("mamba2_chunk_scan", mamba2_scan_float64),
    "granitemoehybrid": ("mamba2_chunk_scan", mamba2_scan_float64),
    "zamba2": ("mamba2_chunk_scan", mamba2_scan_float64),
}


@contextlib.contextmanager
def float64_kernels():
    """The float64 recurrences above in place of the models' float32 fallbacks, in the modeling
    modules both runs call them from, and the norms of ``_FLOAT64_NORMS`` (restored on exit)."""
    import importlib

    saved = []
    try:
        for family, (name, fn) in _FLOAT64_KERNELS.items():
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, fn)
        from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg

        saved.append((rg.RecurrentGemmaRglru, "_rnn_scan", rg.RecurrentGemmaRglru._rnn_scan))
        rg.RecurrentGemmaRglru._rnn_scan = _rnn_scan_in_input_dtype(rg.RecurrentGemmaRglru._rnn_scan)
        for family, norms in _FLOAT64_NORMS.items():
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            for name, fn in norms:
                norm = getattr(module, name)
                saved.append((norm, "forward", norm.forward))
                norm.forward = fn
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


class _Float64Logits(torch.Tensor):
    """Logits whose ``.float()`` keeps float64 (an alias on the autograd graph): Mamba's,
    Falcon-Mamba's and Mamba2's causal LMs cast their logits to float32 (``lm_head(h).float()``),
    which would round a float64 difference upstream to a float32 step in the loss and in every
    gradient behind it.
    NOTE: measured, Falcon-Mamba at 2 ranks with its float32 logits: loss 9.7e-8 from one process."""

    def float(self, *args, **kwargs):
        plain = self.as_subclass(torch.Tensor)
        return plain if plain.dtype == torch.float64 else plain.float(*args, **kwargs)


_FLOAT32_LOGITS = {"MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM"}


def build(case):
    """``case``'s model (a row of ``MODELS``), float64 on the CPU, seeded: the same weights every call."""
    import transformers

    _, config_name, model_name, _, cfg = case
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**cfg)).double()
    with torch.no_grad():  # Mamba2's D starts at 1 and its dt bias at 1 in some models: random, so that each matters per head
        for name, p in model.named_parameters():
            if name.endswith((".D", ".dt_bias", ".A_log")):
                p.uniform_(0.2, 1.5)
        for m in model.modules():  # MoE routers start at zero (every expert tied): random, so that routing matters
            if type(m).__name__.endswith("TopKRouter"):
                m.weight.normal_(std=0.5)
    if model_name in _FLOAT32_LOGITS:
        model.lm_head.register_forward_hook(lambda module, args, out: out.as_subclass(_Float64Logits))
    return model.train()


def sharded_step(model, batch, group) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One step of a model under ``hf.apply`` on this rank's ``batch`` (``hf.shard_batch``):
    the global mean loss (``reduce_loss``), ``{name: gradient}`` summed over ``group``
    (``sync_gradients``) and the logits gathered into the global sequence (``gather_sequence``).
    Collective: call it on every rank; the gradients are cleared on the model afterwards."""
    out = model(**batch.model_inputs(loss=False))
    loss = batch.loss(out.logits)
    loss.backward()
    hf.sync_gradients(model, group)
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return hf.reduce_loss(loss, group), grads, hf.gather_sequence(out.logits.detach(), batch.shard, group)
