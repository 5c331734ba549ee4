"""The calculator's replay of a hybrid's mixer layers (``memory_step.mixer``) against the bytes
a tiny model allocates under ``hf.apply`` on 2 gloo ranks (``traffic.LiveBytes``, as
tests/test_longctx_memory.py measures attention models; transformers 5.23's torch fallbacks):
Qwen3.5's Gated DeltaNet (``torch_chunk_gated_delta_rule``, the torch causal conv1d), Bamba's
Mamba2 (``mamba2_chunk_scan``), Kimi-Linear's KDA (``chunk_kimi_delta_attention``), LFM2's
short convolution.

What is compared, and why not the whole step: the calculator's attention layer is Llama's,
Qwen3.5's is gated (an output gate, q/k norms, partial RoPE), so the step of a Qwen3.5 is not
the calculator's step; and ``hf.apply`` refuses a model without attention. The difference
between two models that differ by one Gated DeltaNet layer is that layer alone, and both the
measurement and the calculator see it: per rank, the forward's end (what the layer keeps for
the backward, with its MLP and norms) without checkpointing, within 2% (measured +0.6%: the
kernel's and the gated norm's kept tensors are counted from transformers' code, not traced),
and with checkpointing (the layer's input only) the forward's end and the step's peak, exact.
Kimi-Linear's KDA, Bamba's Mamba2 and LFM2's short conv the same way (measured: Kimi +0.04%
at 1024 tokens, +0.07% at 513; Bamba +0.02%, +0.03%; LFM2 exact; all within 2% at 513 as
well: their kernels' padded chunk tensors are real copies, counted as such). Nemotron-H's layers
are single blocks (norm -> Mamba2, attention without RoPE, or a relu2 MLP -> residual): each kind
of block is one more layer, measured the same way (``test_nemotron_h_blocks_on_2_ranks``).
Falcon-H1's layers run Mamba2 beside attention, then an MLP (its muP multipliers' products kept
where the next op saves its input): one more layer, without (``falcon_h1``) and with its gated
norm (``falcon_h1_norm``), measured +0.02% at 1024 tokens, +0.03% at 513, checkpointed exact
(NOTE, measured per rank: without its norm 6071834 B / calculator 6072858 B at 1024 tokens, 3201584 /
3202608 at 513 on rank 0; with it 6338074 / 6339098 and 3335224 / 3336248; the whole tiny one-layer
step at 1024 tokens, without its norm: peak 7319074 / 7320090 B).
Jamba's Mamba1 (three exchanges and one back, the recurrent scan keeping a state per token), dense
MLPs (``num_experts=1``; its MoE layers are refused by name), attention without RoPE: one layer
more measured exact at 1024 and 513 tokens, checkpointed exact (NOTE, measured: 6355072 B at 1024
tokens on both ranks, 3187764 / 3183936 at 513 on rank 0 / 1). Its backward's transient (the scan's
per-token slices' full-size gradients) is modelled from the code, not traced: the whole tiny
two-layer step's peak (in a Mamba1 backward) measured 9727240 B at 1024 tokens, 4875736 at 513,
checkpointed 4875736; the calculator 9695360, 4860336, 4860336 (-0.3% each).
State passing (``mixer_parallel="state"``, ``test_mixer_layer_state_passing_on_2_ranks``): the
same comparison for Gated DeltaNet, KDA, Mamba2, short conv and Mamba1 (NOTE, measured at 1024
tokens, rank 0 / 1: Qwen3.5 6270880 / 6277536 B, calculator +0.85%; at 513 rank 0's 257 tokens
pad the last chunk, +5.7%; Kimi +0.04%, Bamba +0.05% (513: -0.61% / +0.10%), Falcon-H1 with and
without its norm +0.05% (513: -0.58% / +0.09%), Nemotron-H's Mamba2 block +0.06% (513: -0.74% /
+0.12%; its attention and MLP blocks exact), LFM2 and Jamba exact; checkpointed exact).
Not compared: the mixer's backward transients (where the step's peak falls inside a mixer's
backward the calculator's figure is an estimate; docs/longctx.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_longctx_memory import _ours, _tracked_step  # noqa: E402
from test_memory import _settled_collectives  # noqa: E402

from ulysses_kernels import memory  # noqa: E402
from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.memory_step import step_memory  # noqa: E402
from ulysses_kernels.memory_step.mixer import Mixer  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

TOLERANCE = 0.02  # as tests/test_longctx_memory.py
# A sequence that is not a multiple of the kernel's chunk (64): the calculator counts the
# kernel's chunk-level tensors over the padded length; measured, fewer of them are (513 tokens
# on one rank: calculator +5.7%, on 2 ranks +5.6%): there it is a bound from above, asked to
# stay within 7%.
PADDED_OVER = 0.07
L, F = "linear_attention", "full_attention"
SIZES = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
GDN = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}


NEMOTRON_H = {"mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4, "chunk_size": 64}
FALCON_H1 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
             "mamba_chunk_size": 64}  # fmt: skip
JAMBA = {"mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 1, "mamba_dt_rank": 8, "num_experts": 1}
MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 64, "mamba_expand": 1}


def _config(types, family="qwen3.5"):
    """A tiny model of ``family`` whose layer ``i`` is a mixer (``L``) or attention (``F``)."""
    if family == "bamba":
        return transformers.BambaConfig(**SIZES, **MAMBA, num_hidden_layers=len(types), attn_layer_indices=[i for i, t in enumerate(types) if t == F],
                                        attn_implementation="sdpa")  # fmt: skip
    if family == "kimi":  # MLA attention (its own sizes), dense MLPs
        return transformers.KimiLinearConfig(**{**SIZES, "num_key_value_heads": 4}, num_hidden_layers=len(types), layer_types=types,
                                             mlp_layer_types=["dense"] * len(types), kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                             v_head_dim=12, linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4},
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")  # fmt: skip
    if family == "nemotron_h":  # types: its blocks ("mamba", "attention", "mlp")
        return transformers.NemotronHConfig(**SIZES, **NEMOTRON_H, layers_block_type=types, attn_implementation="sdpa")
    if family.startswith("falcon_h1"):  # every layer is Mamba2 beside attention: len(types) layers
        return transformers.FalconH1Config(**SIZES, **FALCON_H1, num_hidden_layers=len(types), mamba_rms_norm=family == "falcon_h1_norm",
                                           attn_implementation="sdpa")  # fmt: skip
    if family == "jamba":  # dense MLPs; the last layer attention
        return transformers.JambaConfig(**{k: v for k, v in SIZES.items() if k != "head_dim"}, **JAMBA, num_hidden_layers=len(types),
                                        attn_layer_period=len(types), attn_layer_offset=len(types) - 1, attn_implementation="sdpa")  # fmt: skip
    if family == "lfm2":  # the MLP as the calculator's (no automatic width)
        return transformers.Lfm2Config(**SIZES, num_hidden_layers=len(types), layer_types=["conv" if t == L else F for t in types], conv_L_cache=3,
                                       block_auto_adjust_ff_dim=False, attn_implementation="sdpa")  # fmt: skip
    return transformers.Qwen3_5TextConfig(**SIZES, **GDN, num_hidden_layers=len(types), layer_types=types, attn_implementation="sdpa")


_MODELS = {"qwen3.5": "Qwen3_5ForCausalLM", "bamba": "BambaForCausalLM", "lfm2": "Lfm2ForCausalLM", "kimi": "KimiLinearForCausalLM",
           "nemotron_h": "NemotronHForCausalLM", "falcon_h1": "FalconH1ForCausalLM", "falcon_h1_norm": "FalconH1ForCausalLM",
           "jamba": "JambaForCausalLM"}  # fmt: skip


def _measure(types, seq, ckpt, family="qwen3.5", parallel="heads"):
    torch.manual_seed(0)
    model = getattr(transformers, _MODELS[family])(_config(types, family)).float().train()
    if ckpt:
        model.activation_checkpointing_enable({"use_reentrant": False})
    hf.apply(model, None, mixer_parallel=parallel)
    assert set(hf.mixer_strategies(model).values()) == {parallel}
    ids = torch.randint(0, SIZES["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    return _tracked_step(model, hf.shard_batch(ids, ids.clone()), _ours, ())


def _calculate(types, seq, ckpt, world, rank, family="qwen3.5", parallel="heads"):
    mixer = dataclasses.replace(Mixer.from_config(_config(types, family)), parallel=parallel)
    setup = memory.Setup(layers=len(types), hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=96, seq=seq, sp=world,
                         dtype="float32", checkpointing=ckpt, mixer=mixer, mlp="plain" if family == "nemotron_h" else "gated")  # fmt: skip
    return step_memory(setup, rank)


def _body(rank, world, family, parallel="heads"):
    restore = _settled_collectives()
    try:
        misses = []
        for seq, ckpt in ((1024, False), (513, False), (513, True)):  # 513: uneven shards, a padded last chunk
            a, b = _measure([L, F], seq, ckpt, family, parallel), _measure([L, L, F], seq, ckpt, family, parallel)
            ca, cb = _calculate([L, F], seq, ckpt, world, rank, family, parallel), _calculate([L, L, F], seq, ckpt, world, rank, family, parallel)
            got, calc = b[1] - a[1], cb.forward_end - ca.forward_end
            print(f"{family} {parallel} rank {rank}/{world} seq {seq} ckpt {ckpt}: one mixer layer's forward end measured {got} B, "
                  f"calculator {calc} B ({(calc - got) / got:+.2%})")  # fmt: skip
            if ckpt:  # a checkpointed layer keeps its input: exact
                bad = calc != got
            elif seq % 64 and family == "qwen3.5":
                bad = not 0 <= calc - got <= PADDED_OVER * got
            else:
                bad = abs(calc - got) > TOLERANCE * got
            if bad:
                misses.append(f"{family} rank {rank}/{world} seq {seq} ckpt {ckpt}: one mixer layer's forward end measured {got} B, calculator {calc} B")
            if ckpt and (cb.peak - ca.peak) != (b[0] - a[0]):
                misses.append(f"{family} rank {rank}/{world} seq {seq}: one checkpointed mixer layer's peak measured {b[0] - a[0]} B, "
                              f"calculator {cb.peak - ca.peak} B")  # fmt: skip
        assert not misses, "\n".join(misses)
    finally:
        restore()


@pytest.mark.parametrize("family", ["qwen3.5", "bamba", "lfm2", "kimi", "falcon_h1", "falcon_h1_norm", "jamba"])
def test_mixer_layer_on_2_ranks(family):
    run_ranks(_body, 2, family)


@pytest.mark.parametrize("family", ["qwen3.5", "bamba", "lfm2", "kimi", "falcon_h1", "falcon_h1_norm", "jamba"])
def test_mixer_layer_state_passing_on_2_ranks(family):
    """``mixer_parallel="state"`` (docs/state_passing.md): each rank's tokens for every head, the
    conv after its halo, the widened kernel, the fold; no exchange. The same bounds as the head
    exchange's (the 513-token Gated DeltaNet: rank 0's 257 tokens pad the last chunk)."""
    run_ranks(_body, 2, family, "state")


# Nemotron-H, one more block of each kind after [mamba, attention, mlp] (1024 tokens, rank 0/1 alike;
# 513 on rank 0, rank 1 the same within 0.05%): measured forward end / calculator
#   mamba      4492826 / 4493850 B (+0.02%; 513: +0.04%: the Mamba2 replay as Bamba's)
#   attention   927744 /  927744 B (exact; no RoPE: the projections go to the op)
#   mlp         788480 /  788480 B (exact; norm, up -> relu2 -> down keeps 2 [n, intermediate])
# Checkpointed (513): the forward end and the step's peak difference exact for each block. The whole
# tiny model's step (1024, not checkpointed): measured peak 7390754 B, calculator 7391770 B (+0.01%);
# checkpointed its peak falls in a Mamba2 block's backward, which the replay estimates (+30% here).
_NEMOTRON_BASE = ["mamba", "attention", "mlp"]


def _nemotron_body(rank, world, parallel="heads"):
    restore = _settled_collectives()
    try:
        misses = []
        for seq, ckpt in ((1024, False), (513, False), (513, True)):
            a = _measure(_NEMOTRON_BASE, seq, ckpt, "nemotron_h", parallel)
            ca = _calculate(_NEMOTRON_BASE, seq, ckpt, world, rank, "nemotron_h", parallel)
            for block in ("mamba", "attention", "mlp"):
                types = _NEMOTRON_BASE + [block]
                b, cb = _measure(types, seq, ckpt, "nemotron_h", parallel), _calculate(types, seq, ckpt, world, rank, "nemotron_h", parallel)
                got, calc = b[1] - a[1], cb.forward_end - ca.forward_end
                print(f"nemotron_h {parallel} rank {rank}/{world} seq {seq} ckpt {ckpt}: one {block} block's forward end measured {got} B, "
                      f"calculator {calc} B ({(calc - got) / got:+.2%})")  # fmt: skip
                exact = ckpt or block != "mamba"
                if (calc != got) if exact else abs(calc - got) > TOLERANCE * got:
                    misses.append(f"rank {rank} seq {seq} ckpt {ckpt}: one {block} block's forward end measured {got} B, calculator {calc} B")
                if ckpt and (cb.peak - ca.peak) != (b[0] - a[0]):
                    misses.append(f"rank {rank} seq {seq}: one checkpointed {block} block's peak measured {b[0] - a[0]} B, calculator {cb.peak - ca.peak} B")
        assert not misses, "\n".join(misses)
    finally:
        restore()


@pytest.mark.parametrize("parallel", ["heads", "state"])
def test_nemotron_h_blocks_on_2_ranks(parallel):
    run_ranks(_nemotron_body, 2, parallel)


def test_mixer_description_and_refusals():
    m = Mixer.from_config(_config([L, L, F]))
    assert (m.heads, m.groups, m.head_dim, m.key_dim, m.conv) == (4, 2, 8, 8, 4)
    assert [m.is_mixer(i) for i in range(3)] == [True, True, False]
    assert [Mixer(4, 2, 8, 8, attention_every=4).is_mixer(i) for i in range(8)] == [True] * 3 + [False] + [True] * 3 + [False]
    with pytest.raises(memory.UlyssesInputError, match="layer_types expected 2 entries"):
        memory.Setup(layers=2, hidden=64, heads=4, vocab=96, seq=64, mixer=m)
    for config, why in ((transformers.JambaConfig(), "16 experts: its MoE layers are not modelled"),
                        (transformers.FalconH1Config(mamba_rms_norm=True, mamba_norm_before_gate=False), "not mamba_norm_before_gate"),
                        (transformers.NemotronHConfig(layers_block_type=["mamba", "moe"]), r"\['moe'\].*mamba, attention and mlp blocks"),
                        (transformers.NemotronHConfig(layers_block_type=["mamba"], mlp_bias=True), "with mlp_bias"),
                        (transformers.Mamba2Config(), "attention-free .* not model yet"),
                        (transformers.LlamaConfig(), "has no token mixer")):  # fmt: skip
        with pytest.raises(memory.UlyssesInputError, match=f"config '{config.model_type}'.*{why}"):
            Mixer.from_config(config)
    with pytest.raises(memory.MemoryInputError, match=r"sp \(8\) expected at most the mixer's heads \(4\)"):
        memory.Setup(layers=3, hidden=64, heads=8, vocab=96, seq=64, sp=8, mixer=m)
    blocks = Mixer.from_config(_config(["mamba", "attention", "mlp"], "nemotron_h"))
    assert [blocks.block(i) for i in range(3)] == ["mixer", "attention", "mlp"] and blocks.form == "blocks"
    with pytest.raises(memory.UlyssesInputError, match="mlp expected 'plain' for a mixer of form 'blocks'.*got 'gated'"):
        memory.Setup(layers=3, hidden=64, heads=4, vocab=96, seq=64, mixer=blocks)
    with pytest.raises(memory.UlyssesInputError, match=r"layer_types expected one of \['linear_attention', 'full_attention'\] \(form 'stacked'\)"):
        Mixer(4, 2, 8, 8, layer_types=("mlp",))


def test_cli_reports_a_hybrid(capsys, tmp_path):
    import json

    base = ["--layers", "8", "--hidden", "2048", "--heads", "16", "--kv-heads", "2", "--head-dim", "256", "--vocab", "151936",
            "--intermediate", "5120", "--seq", "65536", "--sp", "8", "--json"]  # fmt: skip
    assert memory.main(base + ["--mixer", "qwen3.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mixer_layers"] == [0, 1, 2, 4, 5, 6] and "activations" not in out
    again = memory.Setup(**out["setup"])  # the JSON's setup describes the same hybrid
    assert again.mixer.heads == 32 and step_memory(again).peak == out["step"]["peak"]
    assert memory.main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "mixer" not in plain["setup"] and plain["step"]["forward_end"] != out["step"]["forward_end"] and plain["parameters"] != out["parameters"]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"text_config": {**GDN, "linear_num_value_heads": 8, "layer_types": [L] * 7 + [F]}}))
    assert memory.main(base + ["--mixer", str(cfg)]) == 0
    assert json.loads(capsys.readouterr().out)["mixer_layers"] == list(range(7))
    cfg.write_text(json.dumps({"model_type": "jamba", "num_hidden_layers": 8}))
    with pytest.raises(SystemExit):
        memory.main(base + ["--mixer", str(cfg)])
    assert "config 'jamba' with 16 experts: its MoE layers are not modelled" in capsys.readouterr().err
    for family, kind in (("bamba", "mamba2"), ("lfm2", "short-conv"), ("kimi", "kimi-delta")):
        config = _config([L, F, L, F, L, L, F, F], family)
        cfg.write_text(config.to_json_string())
        assert memory.main(base[:-2] + ["4", "--json", "--mixer", str(cfg)]) == 0  # 4 ranks: the tiny mixers' 4 heads
        out = json.loads(capsys.readouterr().out)
        assert out["mixer_layers"] == [0, 2, 4, 5] and out["setup"]["mixer"]["kind"] == kind
        assert step_memory(memory.Setup(**out["setup"])).peak == out["step"]["peak"]
    cfg.write_text(_config(["mamba", "attention", "mlp", "mamba", "mlp", "mamba", "attention", "mlp"], "nemotron_h").to_json_string())
    nemotron = base[:-2] + ["4", "--json", "--mixer", str(cfg)]
    with pytest.raises(SystemExit):  # its MLP blocks are up -> relu2 -> down
        memory.main(nemotron)
    assert "mlp expected 'plain' for a mixer of form 'blocks'" in capsys.readouterr().err
    assert memory.main(nemotron + ["--mlp", "plain"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mixer_layers"] == [0, 3, 5] and out["setup"]["mixer"]["form"] == "blocks"
    assert step_memory(memory.Setup(**out["setup"])).peak == out["step"]["peak"]
    cfg.write_text(_config([L] * 8, "falcon_h1").to_json_string())
    assert memory.main(base[:-2] + ["4", "--json", "--mixer", str(cfg)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mixer_layers"] == list(range(8)) and out["setup"]["mixer"]["form"] == "parallel"
    assert step_memory(memory.Setup(**out["setup"])).peak == out["step"]["peak"]
    cfg.write_text(_config([L] * 8, "jamba").to_json_string())  # attention last
    assert memory.main(base[:-2] + ["4", "--json", "--mixer", str(cfg)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mixer_layers"] == list(range(7)) and out["setup"]["mixer"]["kind"] == "mamba1"
    assert step_memory(memory.Setup(**out["setup"])).peak == out["step"]["peak"]


@pytest.mark.parametrize("family", ["qwen3.5", "bamba", "lfm2", "kimi", "nemotron_h", "falcon_h1", "falcon_h1_norm", "jamba"])
def test_mixer_parameters_are_the_modules(family):
    """``Mixer.parameters`` counts the mixer module's own parameters."""
    types = ["mamba", "attention"] if family == "nemotron_h" else [L, F]
    model = getattr(transformers, _MODELS[family])(_config(types, family))
    layer = model.model.layers[0]
    mixer = layer.linear_attn if family == "qwen3.5" else layer.self_attn if family == "kimi" else layer.mixer if family == "nemotron_h" else \
        getattr(layer, "mamba", None) or layer.conv  # fmt: skip
    assert Mixer.from_config(_config(types, family)).parameters(64) == sum(p.numel() for p in mixer.parameters())


@pytest.mark.parametrize("family", ["nemotron_h", "falcon_h1", "falcon_h1_norm", "jamba"])
def test_layer_forms_parameters_are_the_model(family):
    """A Nemotron-H's blocks (one norm each, an MLP of two projections, attention without RoPE), a
    Falcon-H1's layers (Mamba2 and attention, two norms, a gated MLP): the calculator's whole-model
    count is the model's."""
    types = ["mamba", "attention", "mlp", "mamba", "mlp"]
    model = getattr(transformers, _MODELS[family])(_config(types, family))
    setup = memory.Setup(layers=5, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=96, seq=64,
                         mlp="plain" if family == "nemotron_h" else "gated", tie_embeddings=model.config.tie_word_embeddings,
                         mixer=Mixer.from_config(_config(types, family)))  # fmt: skip
    assert memory.parameter_count(setup)[0] == sum(p.numel() for p in model.parameters())


def test_mixer_parallel_choice(capsys):
    """``Mixer.parallel`` (the calculator's ``hf.apply(mixer_parallel=)``): checked by name; state
    passing holds every head on each rank (so more ranks than heads is a setup), its ranks differ
    (the halo, the fold); ``"auto"`` resolves as ``hf.apply`` does; the CLI's ``--mixer-parallel``."""
    with pytest.raises(memory.UlyssesInputError, match=r"mixer parallel expected one of \['heads', 'state', 'auto'\].*got 'ring'"):
        Mixer(4, 2, 8, 8, parallel="ring")
    m = Mixer.from_config(_config([L, L, F]))
    state, auto = dataclasses.replace(m, parallel="state"), dataclasses.replace(m, parallel="auto")
    assert m.parallel == "heads" and (auto.strategy(2), auto.strategy(8), state.strategy(2)) == ("heads", "state", "state")
    wide = memory.Setup(layers=3, hidden=64, heads=8, vocab=96, seq=64, sp=8, mixer=state)  # 8 ranks, 4 mixer heads
    assert memory.Setup(layers=3, hidden=64, heads=8, vocab=96, seq=64, sp=8, mixer=auto).mixer.strategy(8) == "state"
    assert [state.heads_on(wide, r) for r in (0, 7)] == [(4, 2), (4, 2)] and [state.halo_on(wide, r) for r in (0, 1, 7)] == [0, 3, 3]
    short = dataclasses.replace(wide, seq=16)  # 2 tokens a rank: rank 1's halo is the 2 before it
    assert [state.halo_on(short, r) for r in (0, 1, 2)] == [0, 2, 3]
    steps = [step_memory(wide, r) for r in range(3)]
    assert steps[0].forward_end < steps[1].forward_end < steps[2].forward_end  # the halo, then the fold's states
    two = memory.Setup(layers=3, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=96, seq=1024, sp=2, dtype="float32", mixer=m)
    assert step_memory(two).forward_end != step_memory(dataclasses.replace(two, mixer=state)).forward_end
    import json

    base = ["--layers", "8", "--hidden", "2048", "--heads", "16", "--kv-heads", "2", "--head-dim", "256", "--vocab", "151936",
            "--intermediate", "5120", "--seq", "65536", "--sp", "16", "--json", "--mixer", "qwen3.5"]  # fmt: skip
    assert memory.main(base) == 0
    heads = json.loads(capsys.readouterr().out)
    assert memory.main(base + ["--mixer-parallel", "state"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["mixer"]["parallel"] == "state" and heads["setup"]["mixer"]["parallel"] == "heads"
    again = memory.Setup(**out["setup"])  # the worst rank is the last: its fold keeps the most
    assert memory.worst_step(again).peak == out["step"]["peak"] == step_memory(again, 15).peak > step_memory(again, 0).peak
    assert out["step"]["peak"] != heads["step"]["peak"]
    with pytest.raises(SystemExit):
        memory.main(base[:-2] + ["--mixer-parallel", "state"])
    assert "--mixer-parallel needs --mixer" in capsys.readouterr().err
