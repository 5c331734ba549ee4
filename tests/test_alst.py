"""DeepSpeed ALST's transformers entry point through ours (``integrations.alst``, switched on
with ``enable_alst()``), against DeepSpeed's own ALST tests ported to CPU gloo ranks.

Ported from DeepSpeed's ``tests/unit/ulysses_alst/test_ulysses_sp_hf.py`` (and the helpers it
imports from ``unit/util.py``), and its checkpoint-load test ``TestUlyssesCheckpointLoad`` from
``tests/unit/sequence_parallelism/test_ulysses.py``: the same steps and assertions, written
here. ``test_deepspeed_alst_suite`` runs the whole suite once with DeepSpeed's class and once
through our switch (the script imports ``UlyssesSPAttentionHF`` from DeepSpeed's module after
``enable_alst()``, as a user's script does), ZeRO-2 and ZeRO-3. Differences from the original,
each forced by the CPU: float32 instead of ``preferred_dtype()`` (bf16 on GPUs; DeepSpeed
0.19.8's ZeRO-3 refuses float64), a torch Adam instead of the config's (DeepSpeed's would
build its CPU Adam op), a tiny Llama saved to a directory instead of
``hf-internal-testing/tiny-random-LlamaForCausalLM`` (no network; the same sizes),
CPU devices. ``TestUlyssesSPHFFlexAttention`` is not ported: on the CPU its baseline
(no sequence parallelism) already fails, "FlexAttention does not support backward on CPU".

Measured (float32, these models): the sequence-parallel loss equals the baseline bit for bit
with either class, as DeepSpeed's ``torch_assert_equal`` asserts; ZeRO-3 gradients agree to
1e-11. Under ZeRO-2 both classes' gradients are exactly ``sp`` times the baseline's (the
test's loss aggregation backpropagates the global loss on every rank and ZeRO-2 divides the
reduced sum by dp only): DeepSpeed's loose ZeRO-2 tolerance (atol 1e-3 against gradients of
2.5e-4) hides that; the port asserts the factor.

Beyond DeepSpeed's suite (``test_what_deepspeed_cannot``, ``test_per_head_state``): the head
layouts DeepSpeed refuses (10/2 and 6/2 heads over 4 ranks), packed documents and an sdpa
sliding window (DeepSpeed drops the mask: both differ from one process, measured), uneven
shards, the positions gathered once per step (DeepSpeed: every layer), the mpu's checkpoint
convention, and per-head state (sinks, ALiBi) at an uneven head split.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

from ulysses_kernels.testing import run_ranks

transformers = pytest.importorskip("transformers")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (CI installs it: ULYSSES_KERNELS_PEERS=1)")

VOCAB = 32000  # hf-internal-testing/tiny-random-LlamaForCausalLM's (the gradients' scale depends on it)


def save_llama(path: str, heads: int = 4, kv_heads: int = 4, head_dim: int = 4, layers: int = 2, **extra) -> str:
    """A tiny random Llama (the sizes of hf-internal-testing/tiny-random-LlamaForCausalLM) in ``path``."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=64, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


# ---- DeepSpeed's unit/util.py helpers, as the ported tests use them --------------------------


def torch_assert_equal(actual, expected, **kwargs) -> None:
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=0.0, **kwargs)


def torch_assert_dicts_of_tensors_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys(), (actual.keys(), expected.keys())
    for k in actual:
        torch_assert_equal(actual[k], expected[k], msg=lambda m: f"{k}: {m}")  # noqa: B023


# ---- the classes under test ------------------------------------------------------------------


def alst_classes(impl: str):
    """``(UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter)`` from DeepSpeed's module: DeepSpeed's
    own, or ours after the switch (imported after ``enable_alst()``, as a user's script does)."""
    if impl == "ours":
        from ulysses_kernels.integrations.deepspeed import enable_alst

        enable_alst()
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    expected = "ulysses_kernels.integrations.alst" if impl == "ours" else "deepspeed.runtime.sequence_parallel.ulysses_sp"
    assert UlyssesSPAttentionHF.__module__ == expected, UlyssesSPAttentionHF.__module__
    return UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter


def forget_registrations() -> None:
    """What a registration and an engine leave in the process, gone (each ported test starts
    from none, as DeepSpeed's run each in a fresh process)."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as parallel_state_sp
    from deepspeed.utils import groups as ds_groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ds_groups.mpu = None
    ds_groups.mesh_device = None
    parallel_state_sp._release_sequence_parallel_groups()
    for key in list(ALL_ATTENTION_FUNCTIONS._local_mapping):  # transformers' own instance has no local entries
        del ALL_ATTENTION_FUNCTIONS[key]


def ds_config(zero_stage: int, sp: int) -> dict:
    # DeepSpeed's test config (the optimizer comes from torch, see the module docstring).
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
            "sequence_parallel_size": sp}  # fmt: skip


def engine(model, zero_stage: int, sp: int, mpu=None):
    import deepspeed

    eng, *_ = deepspeed.initialize(config=ds_config(zero_stage, sp), model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), mpu=mpu)
    return eng


def collate_fn(batch):
    input_ids, position_ids = batch[0]
    return {"input_ids": input_ids.unsqueeze(0), "position_ids": position_ids.unsqueeze(0), "labels": input_ids.unsqueeze(0)}


def sp_loss(model_b, outputs, shift_labels, sp_group):
    """The test's loss: transformers' loss on this rank's shard, weighted by its valid tokens
    through a differentiable all-gather (DeepSpeed's, accelerate's and the Trainer's way)."""
    loss_b = model_b.module.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels, vocab_size=VOCAB)
    losses_per_rank = torch.distributed.nn.functional.all_gather(loss_b, group=sp_group)
    good_tokens = (shift_labels != -100).view(-1).sum()
    good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
    total = sum(loss * good for loss, good in zip(losses_per_rank, good_tokens_per_rank))
    return total / sum(good_tokens_per_rank)


# ---- TestUlyssesSPHF.test_ulysses_sp_hf -------------------------------------------------------


def ulysses_sp_hf(alst, adapter, path: str, zero_stage: int, sample: list[int]) -> None:
    """DeepSpeed's ``test_ulysses_sp_hf``: one sample through a plain DeepSpeed engine (A) and
    through ALST (B): the adapter's shards, the loss (equal), the q_proj gradient."""
    from deepspeed.utils import groups, safe_get_full_grad
    from transformers import AutoModelForCausalLM

    world = dist.get_world_size()
    seq = len(sample)
    input_ids = torch.tensor([sample, [x + 10 if x == 10 else x for x in sample]])
    position_ids = torch.arange(seq).repeat(2, 1)
    ds = torch.utils.data.TensorDataset(input_ids, position_ids)

    # 1. Baseline: DataLoader calibration
    dl_a = torch.utils.data.DataLoader(ds, batch_size=1, collate_fn=collate_fn)
    batch_a = next(iter(dl_a))
    torch_assert_dicts_of_tensors_equal(batch_a, {"input_ids": input_ids[:1], "position_ids": position_ids[:1], "labels": input_ids[:1]})
    # 2. Baseline: attention without sequence parallelism
    model_a = engine(AutoModelForCausalLM.from_pretrained(path), zero_stage, world)
    loss_a = model_a(**batch_a).loss
    model_a.backward(loss_a)
    grad_a = safe_get_full_grad(model_a.module.model.layers[0].self_attn.q_proj.weight).clone()
    assert grad_a is not None

    # Part 2. Ulysses: setup
    mpu = alst.register_with_transformers(model_name_or_path=path, core_attn_implementation="sdpa", sequence_parallel_size=world,
                                          micro_batch_size=1, seq_length=64, seq_length_is_variable=True)  # fmt: skip
    model_b = engine(AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa"), zero_stage, world, mpu)

    # 3. the adapter shards each sample in rank order, labels shifted globally
    sp_group, sp_rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
    assert groups._get_sequence_parallel_world_size() == world
    dl_b = adapter(dl_a, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=world, device=model_b.device)
    batch_b = next(iter(dl_b))
    n = seq // world
    shift_labels = torch.cat([input_ids[:1, 1:], torch.tensor([[-100]])], dim=1)
    cut = slice(sp_rank * n, (sp_rank + 1) * n)
    torch_assert_dicts_of_tensors_equal(batch_b, {"input_ids": input_ids[:1, cut], "position_ids": position_ids[:1, cut], "shift_labels": shift_labels[:, cut]})

    # 4. UlyssesSPAttentionHF
    outputs = model_b(**batch_b)
    loss_b = sp_loss(model_b, outputs, batch_b["shift_labels"], sp_group)
    model_b.backward(loss_b)
    grad_b = safe_get_full_grad(model_b.module.model.layers[0].self_attn.q_proj.weight)
    assert grad_b is not None
    torch_assert_equal(loss_a, loss_b)
    if zero_stage in (1, 2):
        torch.testing.assert_close(grad_a, grad_b, rtol=1.6e-02, atol=1e-03)  # DeepSpeed's tolerance
        # NOTE: the port's own check: exactly sp times the baseline (measured with both classes).
        torch.testing.assert_close(grad_b, world * grad_a, rtol=1e-5, atol=1e-9)
    else:
        torch.testing.assert_close(grad_a, grad_b)
    for eng in (model_a, model_b):
        eng.destroy()
    forget_registrations()


# ---- the other ported tests -------------------------------------------------------------------


def with_peft_model(alst, path: str) -> None:
    """``TestUlyssesSPHFPEFT``: an object with a ``config`` (a PEFT wrapper) is taken as the model."""
    from transformers import AutoConfig

    class MockPEFTModel:
        def __init__(self, config):
            self.config = config

    world = dist.get_world_size()
    mpu = alst.register_with_transformers(model_name_or_path=MockPEFTModel(AutoConfig.from_pretrained(path)), core_attn_implementation="sdpa",
                                          sequence_parallel_size=world, micro_batch_size=1, seq_length=64, seq_length_is_variable=True)  # fmt: skip
    assert mpu is not None
    assert mpu.get_sequence_parallel_group() is not None
    assert mpu.get_sequence_parallel_world_size() == world
    forget_registrations()


def disable_in_eval(alst, path: str) -> None:
    """``TestUlyssesSPHFDisableInEval``: in eval() the full sequence runs the model's own attention."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_ids = torch.tensor([[1, 10, 10, 10, 2, 2]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5]])
    baseline = AutoModelForCausalLM.from_pretrained(path).eval()
    original_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with torch.no_grad():
        logits_baseline = baseline(input_ids=input_ids, position_ids=position_ids).logits.clone()
    mpu = alst.register_with_transformers(model_name_or_path=path, core_attn_implementation="sdpa", sequence_parallel_size=dist.get_world_size(),
                                          micro_batch_size=1, seq_length=64, seq_length_is_variable=True, disable_in_eval=True)  # fmt: skip
    assert mpu is not None
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not original_sdpa, "register_with_transformers should have replaced the attention function"
    model_sp = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits_sp = model_sp(input_ids=input_ids, position_ids=position_ids).logits.clone()
    torch_assert_equal(logits_baseline, logits_sp)
    forget_registrations()


def hub_kernel(alst, path: str) -> None:
    """``TestUlyssesSPHFHubKernel``: a hub kernel's name is registered (transformers' lazy
    import, mocked as DeepSpeed's test does) before it is looked up; sdpa is left alone."""
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hub = "kernels-community/flash-attn2"
    called_with = []
    had_hub_key_before = hub in ALL_ATTENTION_FUNCTIONS
    original_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def mock_lazy_import_flash_attention(implementation, attention_wrapper=None, allow_all_kernels=False):
        called_with.append(implementation)
        if implementation == hub and implementation not in ALL_ATTENTION_FUNCTIONS:
            ALL_ATTENTION_FUNCTIONS.register(implementation, ALL_ATTENTION_FUNCTIONS["sdpa"])  # as transformers registers one
        return (None, None, None, None), None

    saved = fa_utils.lazy_import_flash_attention
    fa_utils.lazy_import_flash_attention = mock_lazy_import_flash_attention  # the test's monkeypatch
    try:
        mpu = alst.register_with_transformers(model_name_or_path=path, core_attn_implementation=hub, sequence_parallel_size=dist.get_world_size(),
                                              micro_batch_size=1, seq_length=64, seq_length_is_variable=True)  # fmt: skip
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original_sdpa
        assert ALL_ATTENTION_FUNCTIONS[hub] is not original_sdpa
    finally:
        fa_utils.lazy_import_flash_attention = saved
        if not had_hub_key_before and hub in ALL_ATTENTION_FUNCTIONS:
            ALL_ATTENTION_FUNCTIONS.pop(hub, None)
    assert mpu is not None
    assert called_with == [hub]
    forget_registrations()


def attn_impl_mismatch(alst, path: str) -> None:
    """``TestUlyssesSPHFAttnImplMismatch``: a model configured for another implementation is a ValueError."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    hf_config._attn_implementation = "sdpa"

    class MockModel:
        def __init__(self, config):
            self.config = config

    with pytest.raises(ValueError, match="does not match model config attn_implementation"):
        alst.register_with_transformers(model_name_or_path=MockModel(hf_config), core_attn_implementation="flash_attention_2",
                                        sequence_parallel_size=dist.get_world_size(), micro_batch_size=1, seq_length=64,
                                        seq_length_is_variable=True)  # fmt: skip
    forget_registrations()


class SimpleModel(torch.nn.Module):
    """DeepSpeed's ``unit/simple_model.py`` SimpleModel (one linear layer and a cross-entropy loss)."""

    def __init__(self, hidden_dim: int):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        return self.cross_entropy_loss(self.linears[0](x), y)


def checkpoint_load(mpu, checkpoint_dir: str) -> None:
    """``TestUlyssesCheckpointLoad``: a checkpoint saved without sequence parallelism loads into
    an engine with the sequence-parallel mpu (every rank names its files ``mp_rank_00``), and one
    saved with it resumes."""
    import deepspeed

    world = dist.get_world_size()
    config = {"train_batch_size": world, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}

    def make(model, mpu=None):
        eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=config, mpu=mpu)
        return eng

    source_model = SimpleModel(4)
    with torch.no_grad():
        for parameter in source_model.parameters():
            parameter.fill_(1.5)
    expected = {name: tensor.detach().clone() for name, tensor in source_model.state_dict().items()}
    source_engine = make(source_model)
    source_engine.save_checkpoint(checkpoint_dir, tag="no_sp")
    dist.barrier()

    target_engine = make(SimpleModel(4), mpu)
    assert target_engine.mp_world_size == 1
    assert target_engine.checkpoint_mp_rank == 0
    assert mpu.get_model_parallel_rank() == dist.get_rank()
    target_engine.load_checkpoint(checkpoint_dir, tag="no_sp", load_module_only=True, load_optimizer_states=False, load_lr_scheduler_states=False)
    for name, tensor in target_engine.module.state_dict().items():
        assert torch.equal(tensor.detach(), expected[name]), name
    target_engine.save_checkpoint(checkpoint_dir, tag="with_sp")
    dist.barrier()
    assert sorted(f for f in os.listdir(os.path.join(checkpoint_dir, "with_sp")) if f.startswith("mp_rank")) == ["mp_rank_00_model_states.pt"]
    resumed_engine = make(SimpleModel(4), mpu)
    resumed_engine.load_checkpoint(checkpoint_dir, tag="with_sp")
    for name, tensor in resumed_engine.module.state_dict().items():
        assert torch.equal(tensor.detach(), expected[name]), name
    for eng in (source_engine, target_engine, resumed_engine):
        eng.destroy()
    forget_registrations()


def _suite(rank, world, impl, path, checkpoint_dir):
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    alst, adapter = alst_classes(impl)
    for zero_stage in (2, 3):
        ulysses_sp_hf(alst, adapter, path, zero_stage, [1, 10, 10, 10, 2, 2])
    with_peft_model(alst, path)
    disable_in_eval(alst, path)
    hub_kernel(alst, path)
    attn_impl_mismatch(alst, path)
    if impl == "ours":
        from ulysses_kernels.integrations import mesh

        mpu = mesh.parallel_groups(sp_size=world).mpu()
    else:
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

        mpu.initialize_sequence_parallel(world)
    checkpoint_load(mpu, checkpoint_dir)


@needs_deepspeed
@pytest.mark.parametrize("impl", ["deepspeed", "ours"])
def test_deepspeed_alst_suite(impl, tmp_path):
    """DeepSpeed's ALST tests, once with its class and once through ``enable_alst()``."""
    run_ranks(_suite, 2, impl, save_llama(str(tmp_path / "llama")), str(tmp_path / "ckpt"))
