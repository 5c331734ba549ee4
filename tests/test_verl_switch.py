"""The switch itself (``ulysses_kernels.integrations.verl``) in one process: which of verl's hooks
load it, what it rebinds, that nothing happens without it, and every refusal.

* Nothing happens because both packages are installed: a fresh process that imports
  ulysses_kernels, its integrations package and verl keeps verl's own ``apply_monkey_patch``,
  and no ``verl.plugins`` entry point names ulysses_kernels.
* verl's loader (``import_external_libs``, which ``HFModelConfig(external_lib=...)`` calls;
  the FSDP engine test goes through the config itself) and ``VERL_USE_EXTERNAL_MODULES``
  (read when verl is imported) switch it on; both bindings verl uses
  (``verl.models.transformers.monkey_patch`` and the FSDP engine's
  ``verl.workers.engine.fsdp.transformer_impl``) and the package's re-export are ours;
  ``apply()`` is idempotent (never wraps twice); ``revert()`` restores verl's.
* A prepared model called with no sequence-parallel group (world 1) equals the model as
  built on packed documents; preparing twice keeps one hook.
* Refusals, each a ``VerlIntegrationError`` naming the model or module and the setting:
  vision-language models, token mixers it does not run, ``sp`` larger than the query heads, a
  model switched by hand, and at call time a padding mask, a KV cache.
* What it refused until it ran ``hf.apply``'s attention function runs as the model as built:
  a sliding window shorter than the packed sequence, Gemma 2's softcap, GPT-OSS's sinks,
  seeded attention dropout.
  (That they are raised on every rank is shown on 4 gloo ranks in tests/test_verl.py.)
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

HAS_VERL = importlib.util.find_spec("verl") is not None
pytestmark = pytest.mark.skipif(not HAS_VERL, reason="verl is not installed (scripts/setup.sh installs it)")

SWITCH = "ulysses_kernels.integrations.verl"


def _python(code: str, **env) -> str:
    """Run ``code`` in a fresh interpreter (verl's import-time hooks need a clean process)."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
        env={**os.environ, **env}, cwd="/",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_nothing_happens_without_the_switch_and_verls_loader_turns_it_on():
    out = _python(f"""
        import importlib.metadata as md, sys
        import ulysses_kernels, ulysses_kernels.integrations, ulysses_kernels.integrations.hf
        import verl.models.transformers.monkey_patch as mp
        import verl.workers.engine.fsdp.transformer_impl as engine
        import verl.models.transformers as package
        verls = mp.apply_monkey_patch
        assert not hasattr(verls, "__ulysses_verl_original__") and engine.apply_monkey_patch is verls
        assert "{SWITCH}" not in sys.modules
        plugins = [f"{{ep.name}}={{ep.value}}" for ep in md.entry_points(group="verl.plugins")]
        assert not any("ulysses" in p for p in plugins), plugins

        from verl.utils.import_utils import import_external_libs
        import_external_libs("{SWITCH}")  # what HFModelConfig(external_lib=...) runs
        from ulysses_kernels.integrations import verl as uv
        ours = mp.apply_monkey_patch
        assert uv.is_applied() and ours is not verls and ours.__ulysses_verl_original__ is verls
        assert engine.apply_monkey_patch is ours and package.apply_monkey_patch is ours
        again = uv.apply(chunks=2)  # idempotent: rebinds, never wraps our own function
        assert again.__ulysses_verl_original__ is verls and engine.apply_monkey_patch is again
        uv.revert()
        assert mp.apply_monkey_patch is verls and engine.apply_monkey_patch is verls and package.apply_monkey_patch is verls
        assert not uv.is_applied()
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_verl_use_external_modules_turns_it_on_at_verls_import():
    out = _python(
        """
        import verl  # reads VERL_USE_EXTERNAL_MODULES
        import verl.workers.engine.fsdp.transformer_impl as engine
        from ulysses_kernels.integrations import verl as uv
        assert uv.is_applied() and hasattr(engine.apply_monkey_patch, "__ulysses_verl_original__")
        print("ok")
        """,
        VERL_USE_EXTERNAL_MODULES=SWITCH,
    )
    assert out.strip().endswith("ok")


# --------------------------------------------------------------------------------------
# In this process: the switch applied, no process group (verl's group is None: world 1)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uv():
    import verl.models.transformers.monkey_patch as mp

    from ulysses_kernels.integrations import verl as uv

    uv.apply()
    yield uv
    uv.revert()
    assert not hasattr(mp.apply_monkey_patch, "__ulysses_verl_original__")


def _qwen2(**kw):
    from transformers import AutoModelForCausalLM, Qwen2Config

    base = {"hidden_size": 16, "head_dim": 4, "num_attention_heads": 6, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "intermediate_size": 16, "vocab_size": 64}  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**{**base, **kw}), dtype=torch.float64, attn_implementation="sdpa")


def _patch(model, sp):
    import verl.models.transformers.monkey_patch as mp

    return mp.apply_monkey_patch(model, sp)


PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4]])  # three documents
IDS = torch.arange(11).unsqueeze(0) * 5 % 64
DOCS = ((0, 4), (4, 6), (6, 11))


def test_prepared_model_without_a_group_equals_the_model_as_built(uv):
    import copy

    model = _qwen2()
    reference = copy.deepcopy(model)
    _patch(model, 4)
    _patch(model, 4)  # idempotent: one hook
    assert model.config._attn_implementation == uv.ATTN_IMPLEMENTATION
    assert len(model.base_model._forward_pre_hooks) == 1
    want = reference(IDS, position_ids=PACKED, use_cache=False).logits
    got = model(IDS, position_ids=PACKED, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # The documents matter: one document over the same tokens differs by far more.
    single = reference(IDS, position_ids=torch.arange(11).unsqueeze(0), use_cache=False).logits
    assert (single - want).abs().max() > 1e-3


def test_documents_from_position_ids(uv):
    from ulysses_kernels.integrations.verl import _documents

    assert _documents(PACKED).cu_seqlens == (0, 4, 6, 11)
    assert _documents(torch.arange(7).unsqueeze(0)) is None  # one document: plain causal
    # A first position that is not 0 still starts a document (verl's ulysses_pad appends 0, 1, ...).
    assert _documents(torch.tensor([[3, 4, 0, 1]])).cu_seqlens == (0, 2, 4)
    # Several rows: each its own documents, joined end to end (the op attends them as one packed row).
    rows = _documents(torch.cat([PACKED, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]])]))
    assert rows.rows == 2 and rows.cu_seqlens == (0, 4, 6, 11, 14, 22)


def test_refused_when_preparing(uv):
    from transformers import AutoModelForCausalLM, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen3NextConfig

    with pytest.raises(uv.VerlIntegrationError, match=r"ulysses_sequence_parallel_size=8 cannot run Qwen2ForCausalLM \(6 query heads.*<= 6"):
        _patch(_qwen2(), 8)
    vl = Qwen2VLForConditionalGeneration(
        Qwen2VLConfig(
            text_config={
                "hidden_size": 16,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 1,
                "intermediate_size": 16,
                "vocab_size": 64,
            },
            vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2, "mlp_ratio": 1},
        )
    )
    forward = type(vl).forward
    with pytest.raises(uv.VerlIntegrationError, match=r"Qwen2VLForConditionalGeneration \(model_type 'qwen2_vl'\) is a vision-language model"):
        _patch(vl, 2)
    assert type(vl).forward is forward  # refused before verl's own patches touched the class
    nxt = AutoModelForCausalLM.from_config(
        Qwen3NextConfig(
            hidden_size=16,
            head_dim=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            intermediate_size=16,
            vocab_size=64,
            num_experts=2,
            num_experts_per_tok=1,
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=4,
            linear_value_head_dim=4,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
        )  # fmt: skip
    )
    # A hybrid's mixers run (tests/test_verl_hybrid.py) through the head exchange where their heads split
    # over the ranks; with mixer_parallel="heads", 2 Gated DeltaNet heads over 4 ranks are refused by the
    # mixer's class before anything changes, naming state passing (which "auto", the default, picks).
    uv.apply(mixer_parallel="heads")
    try:
        with pytest.raises(uv.VerlIntegrationError, match=r"Qwen3NextGatedDeltaNet \(2 heads, 2 groups\) cannot be split over 4 ranks.*mixer_parallel='state'"):
            _patch(nxt, 4)
    finally:
        uv.apply()
    assert nxt.config._attn_implementation != uv.ATTN_IMPLEMENTATION
    assert all("forward" not in vars(m) for m in nxt.modules())
    # An attention-free model whose mixers hf.apply runs (Mamba2): verl's switch plans attention heads.
    from ulysses_kernels.testing.tiny_models import build_tiny

    with pytest.raises(uv.VerlIntegrationError, match=r"Mamba2ForCausalLM .*its config has no num_attention_heads"):
        _patch(build_tiny("mamba2").float(), 2)
    # A mixer no layer type announces (a depthwise convolution over the sequence in an MLP): the audit finds it.
    conv = _qwen2()
    mlp = conv.model.layers[0].mlp
    conv.model.layers[0].mlp = _ConvBlock(mlp, conv.config.hidden_size)
    with pytest.raises(uv.VerlIntegrationError, match=r"apply_monkey_patch: Qwen2ForCausalLM has a module that mixes .* _ConvBlock at model\.layers\.0\.mlp"):
        _patch(conv, 2)
    assert conv.config._attn_implementation != uv.ATTN_IMPLEMENTATION
    with pytest.raises(uv.VerlIntegrationError, match="expected a transformers PreTrainedModel, got Linear"):
        _patch(torch.nn.Linear(2, 2), 2)
    by_hand = _qwen2()
    uv._register()
    by_hand.set_attn_implementation(uv.ATTN_IMPLEMENTATION)
    with pytest.raises(uv.VerlIntegrationError, match="without apply_monkey_patch"):
        _patch(by_hand, 2)
    with pytest.raises(uv.VerlIntegrationError, match="carries no VerlStep"):
        by_hand(IDS, position_ids=PACKED, use_cache=False)


class _ConvBlock(torch.nn.Module):
    """An MLP plus a causal depthwise convolution over the sequence (kernel 3)."""

    def __init__(self, mlp, hidden):
        super().__init__()
        self.mlp = mlp
        self.conv = torch.nn.Conv1d(hidden, hidden, 3, groups=hidden, padding=2)

    def forward(self, x):
        return self.mlp(x) + self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


def test_windows_softcap_sinks_and_dropout_run_as_the_model_as_built(uv):
    """What verl's switch refused until it ran hf.apply's attention function: a sliding window
    shorter than the packed sequence (Qwen2, sdpa), Gemma 2's softcap and window (eager),
    GPT-OSS's sinks (eager) and attention dropout (sdpa, seeded) equal the model as built on
    the same packed documents (world 1; 4 gloo ranks in tests/test_verl.py)."""
    import copy

    from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig

    small = {"hidden_size": 16, "head_dim": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
             "intermediate_size": 16, "vocab_size": 64}  # fmt: skip

    def build(config):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="eager")

    def oss(sinks: bool):
        model = build(GptOssConfig(**small, num_local_experts=2, num_experts_per_tok=1, experts_implementation="eager"))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_() if sinks else layer.self_attn.sinks.fill_(-1e9)  # built as zeros
        return model

    def gemma2(window: int, softcap: float | None):
        return build(Gemma2Config(**small, sliding_window=window, attn_logit_softcapping=softcap, query_pre_attn_scalar=4))

    # (the model with the setting, the same weights without it): the setting must matter here.
    cases = {
        "window": (_qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0), _qwen2()),
        "gemma2": (gemma2(3, 0.5), gemma2(11, None)),
        "sinks": (oss(True), oss(False)),
        "dropout": (_qwen2(attention_dropout=0.5), _qwen2()),
    }
    # NOTE: Gemma 2's eager attention takes its softmax in float32 (measured 4.1e-8 absolute from ours, float64).
    tolerance = {"gemma2": {"rtol": 1e-6, "atol": 1e-7}}
    for what, (model, without) in cases.items():
        reference = copy.deepcopy(model)
        _patch(model, 2)
        if what == "dropout":
            model.train(), reference.train()
        torch.manual_seed(7)
        if what == "dropout":  # the same random draws: the packed sequence as one (transformers finds its documents)
            want = reference(IDS, position_ids=PACKED, use_cache=False).logits
        else:  # each document alone (transformers' eager attention of GPT-OSS attends across packed documents)
            want = torch.cat([reference(IDS[:, a:b], position_ids=PACKED[:, a:b], use_cache=False).logits for a, b in DOCS], dim=1)
        torch.manual_seed(7)
        got = model(IDS, position_ids=PACKED, use_cache=False).logits
        tol = tolerance.get(what, {"rtol": 1e-12, "atol": 1e-12})
        torch.testing.assert_close(got, want, **tol, msg=lambda m, what=what: f"{what}: {m}")
        assert (got - without(IDS, position_ids=PACKED, use_cache=False).logits).abs().max() > 1e-4, what


def test_refused_at_call_time(uv):
    model = _qwen2()
    _patch(model, 2)
    mask = torch.ones(1, 11, dtype=torch.long)
    model(IDS, position_ids=PACKED, attention_mask=mask, use_cache=False)  # all ones: no padding, accepted
    mask[0, -2:] = 0
    with pytest.raises(uv.VerlIntegrationError, match="an attention_mask with padding"):
        model(IDS, position_ids=PACKED, attention_mask=mask, use_cache=False)
    with pytest.raises(uv.VerlIntegrationError, match="a KV cache"):
        model(IDS, position_ids=PACKED, use_cache=True)
