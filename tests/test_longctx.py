"""The long-context pieces (``ulysses_kernels.longctx``) switched on through ``hf.apply``: the
same loss and every parameter gradient as the plain run, each parameter's gradient
accumulated once per step, the model's output, the offload's host bytes, and the errors.

One spawn of 4 gloo ranks: sequence parallelism over all 4 ranks and over two 2-rank groups
side by side; tiny float64 Llama (4 query heads, 1 KV head: fewer KV heads than ranks),
Qwen2 (6/2 heads over 4 ranks, tied embeddings) and Qwen3 (per-head q/k norms) models,
13 tokens (uneven shards), batch 2 with masked targets; each piece alone and all four
together, tiles of 2-5 rows (several per rank, the last one shorter), against the
one-process float64 reference of tests/test_hf.py. Then the pieces alone, in one process:
the tiled loss and MLP against the untiled ops in float64 and, in bfloat16, the error
against float64 at most twice the untiled op's own (the house rule for numerics).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ulysses_kernels import longctx  # noqa: E402
from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

SEQ, VOCAB = 13, 61
# family: (config, model, config overrides)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 32}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32}),
}  # fmt: skip
ALL = {"tiled_loss": 4, "tiled_mlp": 3, "tiled_norms": 2, "offload_activations": True}
PIECES = [{"tiled_loss": 3}, {"tiled_mlp": 4}, {"tiled_norms": 5}, {"offload_activations": True}, ALL]
LOSS_RTOL, GRAD_RTOL = 1e-12, 1e-9  # as tests/test_hf.py for float64 (measured: 2e-16 loss, 6e-16 grads)


def build(family: str, checkpointing: bool = False):
    config_name, model_name, extra = FAMILIES[family]
    cfg = {"vocab_size": VOCAB, "intermediate_size": 40, "num_hidden_layers": 2, "head_dim": 8, "max_position_embeddings": 64,
           "attn_implementation": "sdpa", **extra}  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**cfg)).double().train()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def global_batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    labels[1, 5] = -100
    return ids, labels


def reference(family: str, ids, labels):
    """One process, float64: the global mean loss and every parameter gradient."""
    model = build(family)
    logits = model(input_ids=ids).logits
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    loss = loss / (target != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def close(a, b, rtol, what):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


def _counting(model):
    """How often each parameter's gradient is accumulated (post-accumulate-grad hooks: where
    DeepSpeed ZeRO hangs its reduce)."""
    counts = dict.fromkeys((n for n, _ in model.named_parameters()), 0)
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def sharded_step(family, group, ids, labels, pieces, exec_group=True):
    """One sharded forward + backward with ``pieces``; returns (global loss, grads, counts, model, out)."""
    offload = pieces.get("offload_activations", False)
    model = build(family, checkpointing=bool(offload))
    pieces = {**pieces, "offload_activations": longctx.ActivationOffload() if offload else False}
    hf.apply(model, group, **pieces)
    counts = _counting(model)
    batch = hf.shard_batch(ids, labels, group=group)
    if pieces.get("tiled_loss"):
        out = model(**batch.model_inputs())  # out.loss: the tiled loss, float64
        share = out.loss
    else:  # transformers' own loss upcasts to float32: the float64 share from the logits
        out = model(**batch.model_inputs(loss=False))
        share = batch.loss(out.logits)
    if exec_group:
        with torch.utils.checkpoint.GraphExecGroup():
            share.backward()
    else:
        share.backward()
    hf.sync_gradients(model, group)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return hf.reduce_loss(share, group), grads, counts, model, out


def check_pieces(group, what):
    ids, labels = global_batch()
    for family in FAMILIES:
        ref_loss, ref_grads = reference(family, ids, labels)
        plain_counts = sharded_step(family, group, ids, labels, {})[2]
        for pieces in PIECES:
            case = f"{what}, {family}, {pieces}"
            loss, grads, counts, model, out = sharded_step(family, group, ids, labels, pieces)
            close(loss, ref_loss, LOSS_RTOL, f"{case}: loss")
            for name, g in grads.items():
                close(g, ref_grads[name], GRAD_RTOL, f"{case}: grad of {name}")
            assert counts == plain_counts, f"{case}: gradient accumulations per parameter {counts}, plain run {plain_counts}"
            if pieces.get("tiled_loss"):
                assert out.logits is None and out.loss.dtype == torch.float64, case
            state = longctx.state(model)
            if pieces.get("offload_activations"):
                stats = state.offload.stats()
                hidden = model.config.hidden_size
                local = hf.shard_batch(ids, labels, group=group).input_ids.numel()
                assert stats["offloaded"] == 2 and stats["restored"] == 2, f"{case}: {stats}"
                assert stats["host_peak"] == 2 * local * hidden * 8 and stats["host_bytes"] == 0, f"{case}: {stats}"
    # Without a GraphExecGroup around the backward: still one recompute per checkpointed layer
    # (checkpointing.one_recompute joins the attention's nested passes to the running graph
    # task), so the input is brought back once per layer, as with the group.
    loss, grads, _, model, _ = sharded_step("llama", group, ids, labels, ALL, exec_group=False)
    ref_loss, ref_grads = reference("llama", ids, labels)
    close(loss, ref_loss, LOSS_RTOL, f"{what}: loss, backward outside a GraphExecGroup")
    for name, g in grads.items():
        close(g, ref_grads[name], GRAD_RTOL, f"{what}: grad of {name}, backward outside a GraphExecGroup")
    stats = longctx.state(model).offload.stats()
    assert stats["offloaded"] == 2 and stats["restored"] == 2, f"{what}, backward outside a GraphExecGroup: {stats}"


def check_outputs_and_errors(group):
    ids, labels = global_batch()
    model = hf.apply(build("llama"), group, tiled_loss=True, tiled_mlp=True)
    batch = hf.shard_batch(ids, labels, group=group)
    plain = hf.apply(build("llama"), group)
    with torch.no_grad():  # without labels the model returns its logits, as without the pieces
        torch.testing.assert_close(model(**batch.model_inputs(loss=False)).logits, plain(**batch.model_inputs(loss=False)).logits)
        # labels and logits_to_keep: the loss needs every position
        with pytest.raises(longctx.LongContextError, match=r"tiled_loss got hidden states \[2, 1, 32\]"):
            model(**batch.model_inputs(), logits_to_keep=1)
    # offload without checkpointing: the same error on every rank (every rank has the model)
    model = hf.apply(build("llama"), group, offload_activations=True)
    with pytest.raises(longctx.LongContextError, match="LlamaDecoderLayer: offload_activations .* not checkpointed"):
        model(**batch.model_inputs())


def job(rank, world):
    import torch.distributed as dist

    check_pieces(None, "4 ranks")
    check_outputs_and_errors(None)
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    check_pieces(pair, "2-rank groups")


def test_pieces_equal_the_plain_run_on_4_and_2_ranks():
    run_ranks(job, 4)


# ---- one process ----------------------------------------------------------------------------
def test_apply_settings_and_undo():
    model = build("llama")
    with pytest.raises(longctx.LongContextError, match=r"tiled_mlp expected False, True or a positive int \(tokens per tile\), got 0"):
        hf.apply(model, None, tiled_mlp=0)
    with pytest.raises(longctx.LongContextError, match="offload_activations expected False, True or an ActivationOffload, got str"):
        hf.apply(model, None, offload_activations="yes")
    assert longctx.state(model) is None and "forward" not in model.lm_head.__dict__  # refused: unchanged
    hf.apply(model, None, tiled_loss=True, tiled_mlp=True, tiled_norms=True)
    assert "forward" in model.lm_head.__dict__ and "forward" in model.model.layers[0].mlp.__dict__
    hf.apply(model, None)  # every piece off: undone
    assert longctx.state(model) is None
    assert "forward" not in model.lm_head.__dict__ and "forward" not in model.model.layers[0].mlp.__dict__
    assert "_loss_function" not in model.__dict__ and "forward" not in model.model.norm.__dict__


def test_final_logit_softcapping_is_refused():
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, final_logit_softcapping=30.0, attn_implementation="eager")  # fmt: skip
    model = transformers.Gemma2ForCausalLM(cfg)
    with pytest.raises(longctx.LongContextError, match=r"final_logit_softcapping \(30.0\)"):
        hf.apply(model, None, tiled_loss=True)


def test_lm_head_loss_alone_float64():
    torch.manual_seed(0)
    head = torch.nn.Linear(24, 37, bias=True).double()
    hidden = torch.randn(3, 11, 24, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 37, (3, 11))
    targets[0, :4] = -100
    ref = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / 17
    ref_grads = torch.autograd.grad(ref, [hidden, head.weight, head.bias])
    for tiles in (1, 4, 33, 40):  # 40 > 33 rows: empty tiles
        loss = longctx.lm_head_loss(head, hidden, targets, divisor=17, tiles=tiles)
        grads = torch.autograd.grad(loss, [hidden, head.weight, head.bias])
        close(loss, ref, 1e-14, f"loss, {tiles} tiles")
        for g, r, name in zip(grads, ref_grads, ("hidden", "weight", "bias")):
            close(g, r, 1e-13, f"{name}, {tiles} tiles")
    assert "forward" not in head.__dict__  # the redirection was for that call only
    with pytest.raises(longctx.TilingError, match=r"targets.shape expected \[3, 11\]"):
        longctx.lm_head_loss(head, hidden, targets[:, :5], divisor=17)


def test_tiled_apply_alone_float64():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.SiLU(), torch.nn.Linear(40, 16)).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    ref = mlp(x)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [x, *mlp.parameters()], g)
    for tiles in (1, 5, 18, 25):
        y = longctx.tiled_apply(mlp, x, tiles=tiles)
        torch.testing.assert_close(y, ref, rtol=0, atol=1e-15)
        for got, want in zip(torch.autograd.grad(y, [x, *mlp.parameters()], g), ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)


def _bf16_error(fn_tiled, fn_plain, fn_ref):
    """Largest relative error against float64 of the tiled and the plain bf16 computation."""
    ref = fn_ref()
    return [max(((a.double() - r).abs().max() / r.abs().max()).item() for a, r in zip(fn(), ref)) for fn in (fn_tiled, fn_plain)]


def test_bfloat16_within_twice_the_untiled_error():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 300, bias=False)
    hidden = torch.randn(1, 256, 64)
    targets = torch.randint(0, 300, (1, 256))

    def loss_grads(h_dtype, tiled):
        hd = head.to(h_dtype)
        h = hidden.to(h_dtype).requires_grad_()
        if tiled:
            loss = longctx.lm_head_loss(hd, h, targets, divisor=256, tiles=16)
        else:
            logits = hd(h).float() if h_dtype == torch.bfloat16 else hd(h)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / 256
        return [loss, *torch.autograd.grad(loss, [h, hd.weight])]

    tiled, plain = _bf16_error(lambda: loss_grads(torch.bfloat16, True), lambda: loss_grads(torch.bfloat16, False),
                               lambda: [t.double() for t in loss_grads(torch.float64, False)])  # fmt: skip
    assert tiled <= 2 * plain, f"tiled loss bf16 error {tiled:.2e} > 2 x the untiled {plain:.2e}"

    mlp = torch.nn.Sequential(torch.nn.Linear(64, 160, bias=False), torch.nn.SiLU(), torch.nn.Linear(160, 64, bias=False))
    x = torch.randn(1, 256, 64)
    g = torch.randn(1, 256, 64)

    def mlp_grads(dtype, tiled):
        m = mlp.to(dtype)
        xx = x.to(dtype).requires_grad_()
        y = longctx.tiled_apply(m, xx, tiles=8) if tiled else m(xx)
        return [y, *torch.autograd.grad(y, [xx, *m.parameters()], g.to(dtype))]

    tiled, plain = _bf16_error(lambda: mlp_grads(torch.bfloat16, True), lambda: mlp_grads(torch.bfloat16, False),
                               lambda: [t.double() for t in mlp_grads(torch.float64, False)])  # fmt: skip
    assert tiled <= 2 * plain, f"tiled MLP bf16 error {tiled:.2e} > 2 x the untiled {plain:.2e}"


def test_activation_offload_alone():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)).double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)

    def run(offload):
        h = x
        for layer in layers:
            if offload is None:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            else:
                with offload.hooks():
                    h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
        return torch.autograd.grad(h.square().sum(), [x, *layers.parameters()])

    off = longctx.ActivationOffload()
    for got, want in zip(run(off), run(None)):
        assert torch.equal(got, want)
    stats = off.stats()
    assert stats == {"host_bytes": 0, "host_peak": 3 * 4 * 16 * 8, "offloaded": 3, "restored": 3}, stats


# ---- the head-chunked attention backward ----------------------------------------------------------
def _chunked_job(rank, world):
    """``attn_fn=HeadChunkedAttention(n)`` through hf.apply: every gradient and the loss equal the
    default backend's bit for bit (float32 and float64), for ranks whose query heads share one KV
    head (Llama 8/2 over 2 ranks), MHA ranks (8/8) and grouped ranks that fall back (8/4: 4 query
    heads over 2 KV heads), chunk sizes 1 and 3 (not dividing), with checkpointing and the offload."""
    ids, labels = global_batch()

    def step(heads, kv, dtype, attn_fn, ckpt):
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=40, num_hidden_layers=2,
                                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=8, attn_implementation="sdpa")  # fmt: skip
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(dtype).train()
        if ckpt:
            model.activation_checkpointing_enable({"use_reentrant": False})
        hf.apply(model, None, attn_fn=attn_fn, tiled_loss=4, offload_activations=ckpt)
        batch = hf.shard_batch(ids, labels)
        out = model(**batch.model_inputs())
        with torch.utils.checkpoint.GraphExecGroup():
            out.loss.backward()
        return out.loss.detach(), [p.grad for p in model.parameters()]

    for heads, kv in ((8, 2), (8, 8), (8, 4)):
        for dtype in (torch.float64, torch.float32):
            for ckpt in (False, True):
                ref_loss, ref_grads = step(heads, kv, dtype, None, ckpt)
                for n in (1, 3):
                    loss, grads = step(heads, kv, dtype, longctx.HeadChunkedAttention(n), ckpt)
                    what = f"rank {rank}: {heads}/{kv} heads, {dtype}, checkpointing {ckpt}, {n} heads per chunk"
                    assert torch.equal(loss, ref_loss), what
                    for g, r in zip(grads, ref_grads):
                        assert torch.equal(g, r), what


def test_head_chunked_attention_equals_the_default_backend():
    run_ranks(_chunked_job, 2)
    with pytest.raises(ValueError, match="heads_per_chunk expected a positive int, got 0"):
        longctx.HeadChunkedAttention(0)
