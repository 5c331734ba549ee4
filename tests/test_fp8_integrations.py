"""FP8 on the wire (``wire_dtype``) through the model-side entry points, on 2 gloo ranks.

* ``hf.apply(model, group, wire_dtype="fp8")``: a tiny Llama (the fused op) and a tiny
  Mistral with a window shorter than the sequence (the model's own attention between
  ``seq_to_head``/``head_to_seq``): loss and every gradient close to ``wire_dtype=None``
  (the whole op's measured tolerance, tests/test_fp8_wire.py's ``OP_TOL``) and not equal to
  it; every attention module holds the spec; the bytes on the wire are the FP8 share of the
  plain run's, forward and backward; a bad value is refused at ``apply`` on every rank, the
  model left as it was.
* verl's switch, ``ulysses_kernels.integrations.verl.apply(wire_dtype="fp8")``: the same on
  tests/test_verl.py's packed step (verl's own data path), 2-rank sp group.
* DeepSpeed ALST, ``enable_alst(wire_dtype="fp8")``: the same through DeepSpeed's
  ``UlyssesSPAttentionHF.register_with_transformers``.
* The bare exchanges ``seq_to_head``/``head_to_seq`` with ``wire_dtype``: the op's exchanges.
* DeepSpeed's interface, ``integrations.deepspeed.DistributedAttention(..., wire_dtype="fp8")``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from test_fp8_wire import OP_TOL, CountingComm  # noqa: E402 - CountingComm: counts each collective's bytes on the wire

from ulysses_kernels.layers.state import switch_state  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402
from ulysses_kernels.wire import WireSpec, wire_bytes_ratio  # noqa: E402

HAS_VERL = importlib.util.find_spec("verl") is not None
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
SEQ, VOCAB, HEAD_DIM = 14, 61, 16

# The model-level tolerances are the op's (tests/test_fp8_wire.py, OP_TOL): the loss and the
# logits are the attention output's (out), parameter gradients the largest of dq/dk/dv's.
# NOTE: measured here (relative Frobenius error against wire_dtype=None, both ranks, 2026-11-29):
# hf.apply Llama loss 2.1e-4, worst gradient 0.073; Mistral (window) 5.8e-5, 0.083; verl (float64
# Qwen2, head dim 4) logits 5.5e-3, gradient 0.104; ALST loss 3.0e-4, gradient 0.097. Within the
# op's tolerances, so no model-level tolerance of its own.
LOSS_TOL = OP_TOL["out"]
GRAD_TOL = max(OP_TOL["dq"], OP_TOL["dk"], OP_TOL["dv"])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _compare(what: str, got: tuple, want: tuple) -> dict:
    """``(loss, {name: grad})`` of an FP8 run against the plain run: within the op's
    tolerances, and not equal (FP8 ran). Returns the measured errors."""
    loss, grads = got
    ref_loss, ref_grads = want
    errs = {"loss": _rel(loss, ref_loss), **{n: _rel(grads[n], ref_grads[n]) for n in ref_grads}}
    assert 0 < errs["loss"] <= LOSS_TOL, (what, "loss", errs["loss"])
    worst = max((e, n) for n, e in errs.items() if n != "loss")
    assert worst[0] <= GRAD_TOL, (what, worst)
    assert any(e > 0 for n, e in errs.items() if n != "loss"), (what, "gradients bit-equal: FP8 did not run")
    return errs


# ---- hf.apply ----------------------------------------------------------------------------------
def _build(model_type: str, **overrides):
    from ulysses_kernels.testing import build_tiny

    cfg = {"vocab_size": VOCAB, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": HEAD_DIM, "attn_implementation": "sdpa"}
    return build_tiny(model_type, {**cfg, **overrides}, dtype=torch.float32)


def _hf_step(model, ids, labels):
    """One sharded step: ``(global loss, {name: synced grad})``."""
    from ulysses_kernels.integrations import hf

    batch = hf.shard_batch(ids, labels)
    loss = batch.loss(model(**batch.model_inputs(loss=False)).logits)
    loss.backward()
    hf.sync_gradients(model)
    return hf.reduce_loss(loss).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _hf_body(rank, world):
    from ulysses_kernels.comm import get_communicator
    from ulysses_kernels.integrations import hf
    from ulysses_kernels.layers.attention import ATTENTION_SETTINGS_ATTR

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    # Llama: plain causal, the fused op. Mistral, window 5 < 14 tokens: the model's own sdpa
    # attention on the rank's heads, between seq_to_head and head_to_seq.
    for model_type, extra in (("llama", {}), ("mistral", {"sliding_window": 5})):
        runs, sent = {}, {}
        for wd in (None, "fp8"):
            comm = CountingComm(get_communicator(None))
            model = hf.apply(_build(model_type, **extra), wire_dtype=wd, comm=comm)
            attention = [m for m in model.modules() if hasattr(m, ATTENTION_SETTINGS_ATTR)]
            assert len(attention) == 2 and all(getattr(m, ATTENTION_SETTINGS_ATTR).wire == (WireSpec() if wd else None) for m in attention)
            runs[wd] = _hf_step(model, ids, labels)
            sent[wd] = comm.sent
        errs = _compare(f"hf.apply {model_type}", runs["fp8"], runs[None])
        print(f"rank {rank} hf {model_type}: loss {errs['loss']:.2e}, worst grad {max(e for n, e in errs.items() if n != 'loss'):.2e}")
        # Every exchange (forward q/k/v and out, backward d_out and dq/dk/dv, 2 layers) moved FP8 rows.
        assert len(sent[None]) == 8 and min(sent[None]) > 0, sent
        assert sent["fp8"] == [n * wire_bytes_ratio(HEAD_DIM, 4) for n in sent[None]], sent

    # A bad value: refused at apply, on every rank, the model as it was.
    model = _build("llama")
    for bad in ("fp4", 8):
        with pytest.raises(hf.HFIntegrationError, match=f"apply: wire_dtype={bad!r}; expected None, 'fp8' or a ulysses_kernels.wire.WireSpec"):
            hf.apply(model, wire_dtype=bad)
        assert model.config._attn_implementation == "sdpa"
    with pytest.raises(hf.HFIntegrationError, match="attention_settings: wire_dtype='e4m3'"):
        hf.attention_settings(wire_dtype="e4m3")


def test_hf_apply_fp8_close_to_plain_not_equal_and_bad_values_refused():
    run_ranks(_hf_body, 2)


# ---- the bare exchanges ------------------------------------------------------------------------
def _exchange_body(rank, world):
    import ulysses_kernels as uk

    torch.set_num_threads(1)
    plan = uk.HeadPlan.build(4, 2, world)
    seq_lens = [5, 3]
    g = torch.Generator().manual_seed(9 + rank)
    q, k, v = (torch.randn(1, seq_lens[rank], h, 8, generator=g) for h in (4, 2, 2))
    results = {}
    for wd in (None, "fp8"):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        ql, kl, vl = uk.seq_to_head(*qkv, seq_lens=seq_lens, plan=plan, kernels="torch", wire_dtype=wd)
        out = uk.head_to_seq(ql * 2 + kl.repeat_interleave(2, dim=2) - vl.repeat_interleave(2, dim=2), plan, seq_lens=seq_lens,
                             kernels="torch", wire_dtype=wd)  # fmt: skip
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3 + rank)))
        results[wd] = (out.detach(), *(t.grad for t in qkv))
        # q alone moves in the same format
        results[wd, "q"] = uk.seq_to_head(q, seq_lens=seq_lens, plan=uk.HeadPlan.build(4, 4, world), kernels="torch", wire_dtype=wd)
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["fp8"], results[None]):
        assert 0 < _rel(a, b) <= OP_TOL[name], (name, _rel(a, b))
    assert 0 < _rel(results["fp8", "q"], results[None, "q"]) <= OP_TOL["out"]
    with pytest.raises(ValueError, match="wire_dtype='fp4'"):
        uk.seq_to_head(q, k, v, seq_lens=seq_lens, plan=plan, wire_dtype="fp4")
    with pytest.raises(ValueError, match="wire_dtype=8"):
        uk.head_to_seq(torch.zeros(1, 8, 2, 8), plan, seq_lens=seq_lens, wire_dtype=8)


def test_seq_to_head_and_head_to_seq_take_wire_dtype():
    run_ranks(_exchange_body, 2)


# ---- DeepSpeed's DistributedAttention interface ------------------------------------------------
def _local_sdpa(q, k, v):
    """A local attention in [b, s, h, d], as DeepSpeed's callers hand it."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def _distributed_attention_body(rank, world):
    from ulysses_kernels.integrations.deepspeed import DeepSpeedIntegrationError, DistributedAttention

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(21 + rank)
    q, k, v = (torch.randn(2, 6, h, 16, generator=g) for h in (4, 2, 2))  # [b, s/p, h, d], GQA
    d_out = torch.randn(2, 6, 4, 16, generator=torch.Generator().manual_seed(5 + rank))
    results = {}
    for wd in (None, "fp8"):
        layer = DistributedAttention(_local_sdpa, None, gather_idx=1, wire_dtype=wd)
        assert (layer.wire_dtype is None) == (wd is None)
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        out = layer(*qkv)
        out.backward(d_out)
        results[wd] = (out.detach(), *(t.grad for t in qkv))
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["fp8"], results[None]):
        assert 0 < _rel(a, b) <= OP_TOL[name], (name, _rel(a, b))
    for bad in ("fp4", 8):
        with pytest.raises(DeepSpeedIntegrationError, match=rf"DistributedAttention: wire_dtype={bad!r}; expected None, 'fp8'"):
            DistributedAttention(_local_sdpa, None, gather_idx=1, wire_dtype=bad)


def test_distributed_attention_fp8_close_to_plain_not_equal_and_bad_values_refused():
    run_ranks(_distributed_attention_body, 2)


# ---- verl --------------------------------------------------------------------------------------
def _verl_body(rank, world):
    import test_verl as tv

    from ulysses_kernels.integrations import verl as uv

    torch.set_num_threads(1)
    tv._verl_on_cpu()  # the switch, imported through verl's own loader: the defaults
    mesh = tv._mesh(world, world)
    runs = {}
    for wd in (None, "fp8"):
        uv.apply(wire_dtype=wd)  # what a worker's own external_lib module calls
        model, _ = tv._models(tv._config("qwen2", 4, 2), "flash")
        tv._patch(model, world)
        assert switch_state(model).verl.options.wire_dtype == (WireSpec() if wd else None)
        logits, _, _ = tv._sp_step(model, mesh, rank, model.config.vocab_size)
        logits.mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for n in grads:
            dist.all_reduce(grads[n], group=mesh["sp"].get_group())
        runs[wd] = (logits.detach(), grads)
    # float64 model: the FP8 rows are dequantized into float64 (test_verl's models); the logits
    # stand for the loss (verl's test's loss is their mean).
    errs = _compare("verl", runs["fp8"], runs[None])
    print(f"rank {rank} verl: logits {errs['loss']:.2e}, worst grad {max(e for n, e in errs.items() if n != 'loss'):.2e}")
    for bad in ("fp4", 8):
        with pytest.raises(uv.VerlIntegrationError, match=f"apply: wire_dtype={bad!r}; expected None, 'fp8'"):
            uv.apply(wire_dtype=bad)
    uv.apply()


@pytest.mark.skipif(not HAS_VERL, reason="verl is not installed (scripts/setup.sh installs it)")
def test_verl_apply_fp8_close_to_plain_not_equal_and_bad_values_refused():
    run_ranks(_verl_body, 2, fresh=True)  # verl's platform and the switch are process-wide


# ---- DeepSpeed ALST ----------------------------------------------------------------------------
def _alst_body(rank, world):
    from test_alst import register, shifted, sp_step
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ulysses_kernels.integrations.deepspeed import alst_enabled, disable_alst, enable_alst
    from ulysses_kernels.integrations.deepspeed_alst import ALSTIntegrationError, UlyssesSPAttentionHF

    torch.set_num_threads(1)
    for bad in ("fp4", 8):  # refused before anything changes
        with pytest.raises(ALSTIntegrationError, match=f"enable_alst: wire_dtype={bad!r}; expected None, 'fp8'"):
            enable_alst(wire_dtype=bad)
        assert not alst_enabled()
    with pytest.raises(ALSTIntegrationError, match="UlyssesSPAttentionHF: wire_dtype='fp4'"):
        UlyssesSPAttentionHF(None, 1, 4, HEAD_DIM, 2, 2, None, seq_length_is_variable=True, wire_dtype="fp4")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(6))
    targets, positions = shifted(ids), torch.arange(SEQ).repeat(2, 1)
    runs = {}
    for wd in (None, "fp8"):
        enable_alst(wire_dtype=wd)
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF as alst

        model = _build("llama")
        register(alst, model, batch=2)
        uattn = ALL_ATTENTION_FUNCTIONS["sdpa"]
        assert isinstance(uattn, UlyssesSPAttentionHF) and uattn._options["wire_dtype"] == (WireSpec() if wd else None)
        runs[wd] = sp_step(model, ids, targets, positions)
        assert uattn._attention_settings().wire == (WireSpec() if wd else None)
        uattn.unregister()
    disable_alst()
    errs = _compare("ALST", runs["fp8"], runs[None])
    print(f"rank {rank} alst: loss {errs['loss']:.2e}, worst grad {max(e for n, e in errs.items() if n != 'loss'):.2e}")


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (scripts/setup.sh installs it)")
def test_alst_enable_fp8_close_to_plain_not_equal_and_bad_values_refused():
    run_ranks(_alst_body, 2, fresh=True)  # the switch and transformers' registry are process-wide
