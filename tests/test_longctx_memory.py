"""Peak device bytes of one training step with each long-context piece on and off: measured,
against the calculator's replay (``memory_step``), and against DeepSpeed's ALST pieces.

A step is ``hf.shard_batch`` -> ``model(**batch.model_inputs())`` -> ``out.loss.backward()``
inside one ``torch.utils.checkpoint.GraphExecGroup`` (docs/longctx.md), with activation
checkpointing, under ``traffic.LiveBytes``: every tensor the step allocates, from allocation
to free; parameters, inputs, and parameter gradients once accumulated (the test forgets them,
as an engine reduces and frees them) are not counted; the offload's host copies count apart
(``host_sites``). The calculator (``memory_step.step_memory``) must be within 2% of every
measured peak, forward end and host peak on every rank.

Cases: tiny Llama, Qwen2 and Qwen3 models, float32 (one bfloat16 Llama), 2 and 4 gloo ranks,
two sequence lengths each, every piece alone and all four, and all four with the attention
backward in head chunks (``longctx.HeadChunkedAttention``). DeepSpeed 0.19.8's ALST pieces run
side by side on the same model and lengths (its ``TiledMLP`` on each MLP,
``TiledFusedLogitsLoss`` on the LM head, ``CheckpointHiddenStatesOffload`` made to move CPU
tensors, as it moves CUDA tensors on a GPU): ours with all pieces keeps at most as many bytes
per token.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_memory import _settled_collectives  # noqa: E402  (gloo lets go of finished buffers before we count)

from ulysses_kernels import longctx, memory  # noqa: E402
from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.memory_step import step_memory  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402
from ulysses_kernels.traffic import LiveBytes  # noqa: E402

# NOTE: measured, every case is exact to the 8-byte loss scalar (2 and 4 ranks, float32 and
# bfloat16); the bound asked of the calculator is 2%.
TOLERANCE = 0.02
HIDDEN, HEADS, KV, FFN, VOCAB, LAYERS, TILE = 64, 8, 4, 96, 96, 3, 64
PIECES = ["", "loss", "mlp", "norms", "offload", "loss mlp norms offload"]
OURS_HOST = ("offload._host_copy",)
DEEPSPEED_HOST = ("offload_activations._empty_cpu_like",)


def build(family: str, dtype: str, head_dim: int | None = None):
    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    cfg = getattr(transformers, f"{cls}Config")(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, head_dim=head_dim or HIDDEN // HEADS, max_position_embeddings=8192, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg).to(getattr(torch, dtype)).train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def _tracked_step(model, batch, loss_fn, host_sites, context=None):
    """One step under ``LiveBytes``: (peak, forward end, host peak). ``loss_fn`` returns the loss
    and what the caller holds through the backward (the model's output, as a training loop does)."""
    tracker = LiveBytes(host_sites=host_sites)
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.forget(p.grad)) for p in model.parameters()]
    try:
        # DeepSpeed's offload context must span the backward too (it forgets its tensors on exit).
        with tracker, context if context is not None else contextlib.nullcontext():
            loss, held = loss_fn(model, batch)
            forward_end = tracker.current
            with torch.utils.checkpoint.GraphExecGroup():
                loss.backward()
            del held
    finally:
        for h in hooks:
            h.remove()
    return tracker.peak, forward_end, tracker.host_peak


def _ours(model, batch):
    out = model(**batch.model_inputs())
    return out.loss, out


def measure(family, dtype, seq, pieces, head_dim=None):
    model = build(family, dtype, head_dim)
    kw = {"tiled_loss": TILE if "loss" in pieces else False, "tiled_mlp": TILE if "mlp" in pieces else False,
          "tiled_norms": TILE if "norms" in pieces else False,
          "offload_activations": longctx.ActivationOffload() if "offload" in pieces else False}  # fmt: skip
    if "heads" in pieces:  # the attention backward one query head at a time
        kw["attn_fn"] = longctx.HeadChunkedAttention(1)
    hf.apply(model, None, **kw)
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    return _tracked_step(model, hf.shard_batch(ids, ids.clone()), _ours, OURS_HOST)


def setup_of(family, dtype, seq, world, pieces, head_dim=None) -> memory.Setup:
    return memory.Setup(
        layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV, head_dim=head_dim, intermediate=FFN, vocab=VOCAB, seq=seq, sp=world,
        dtype=dtype, checkpointing=True, qk_norm=family == "qwen3", tiled_loss="loss" in pieces, tiled_mlp="mlp" in pieces,
        tiled_norms="norms" in pieces, offload_activations="offload" in pieces, loss_tile_rows=TILE, mlp_tile_rows=TILE,
        norm_tile_rows=TILE, attention_head_chunk=1 if "heads" in pieces else None,
    )  # fmt: skip


def _cases(world):
    """At 2 ranks every family at two lengths; at 4 ranks (the costlier spawn) Llama at one."""
    families, lengths = (("llama", "qwen2"), (256, 1024)) if world == 2 else (("llama",), (512,))
    cases = [(f, "float32", s * world, p) for f in families for s in lengths for p in PIECES]
    cases += [("qwen3", "float32", 512 * world, p) for p in ("", "loss mlp norms offload")[world // 2 - 1 :]]
    cases += [("llama", "bfloat16", 512 * world + 3, p) for p in ("", "loss mlp norms offload")[world // 2 - 1 :]]  # uneven shards
    # HeadChunkedAttention: Llama's 8/4 heads share one KV head per rank at 4 ranks, are grouped
    # (the default backend) at 2; at head_dim 32 the attention backward is the step's peak.
    cases += [("llama", dtype, 512 * world, "loss mlp norms offload heads", 32) for dtype in ("float32", "bfloat16")]
    return cases


def _calculator_body(rank, world):
    restore = _settled_collectives()
    try:
        misses = []
        for family, dtype, seq, pieces, *head_dim in _cases(world):
            head_dim = head_dim[0] if head_dim else None
            peak, forward_end, host = measure(family, dtype, seq, pieces, head_dim)
            want = step_memory(setup_of(family, dtype, seq, world, pieces, head_dim), rank)
            for what, got, calc in (("peak", peak, want.peak), ("forward end", forward_end, want.forward_end), ("host", host, want.host_peak)):
                if abs(calc - got) > TOLERANCE * max(got, 1):
                    misses.append(f"rank {rank}/{world} {family} {dtype} seq {seq} [{pieces}]: {what} measured {got} B, calculator {calc} B")
        assert not misses, "\n".join(misses)
    finally:
        restore()


def test_calculator_within_2_percent_on_2_ranks():
    run_ranks(_calculator_body, 2)


def test_calculator_within_2_percent_on_4_ranks():
    run_ranks(_calculator_body, 4)


def test_each_piece_lengthens_the_longest_sequence():
    """The calculator's ablation for Llama-3-8B at sp 8 on 80 GB (ZeRO-3, optimizer offload,
    bf16; docs/scaling.md): each piece, added in ALST's order (the fused loss, the tiled MLP,
    the offload; then our tiled norms), makes a longer sequence fit."""
    base = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 128256, "tie_embeddings": False,
            "sp": 8, "zero": 3, "offload_optimizer": True, "checkpointing": True, "seq": 8}  # fmt: skip
    pieces, previous = {}, memory.max_seq(memory.Setup(**base), 80e9)
    for piece in ("tiled_loss", "tiled_mlp", "offload_activations", "tiled_norms"):
        pieces[piece] = True
        longest = memory.max_seq(memory.Setup(**base, **pieces), 80e9)
        assert longest > previous, f"adding {piece}: {longest:,} tokens, without it {previous:,}"
        previous = longest


# ---- DeepSpeed's ALST pieces, side by side -----------------------------------------------------------
def _deepspeed_pieces(model, tiles):
    """DeepSpeed 0.19.8's TiledMLP on each MLP (as ArcticTraining's ``tiled_mlp_forward_common``
    patches the class) and the step's loss through its TiledFusedLogitsLoss on the LM head."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

    for layer in model.model.layers:
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            fn = lambda self, x: self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))  # noqa: E731
            n = math.ceil(x.shape[-2] / tiles)
            return TiledMLP.apply(fn, mlp, x, n, [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight])

        mlp.forward = forward

    def loss_fn(model, batch):
        hidden = model.model(**batch.model_inputs(loss=False)).last_hidden_state
        head = model.lm_head

        def ce(self, x, y):
            return torch.nn.functional.cross_entropy(self(x).float(), y, ignore_index=-100, reduction="sum")

        n = math.ceil(hidden.shape[1] / tiles)
        return TiledFusedLogitsLoss.apply(ce, head, hidden, batch.labels, None, n, [head.weight], "sum") / batch.num_tokens, None

    return loss_fn


def _deepspeed_offload():
    """DeepSpeed's checkpoint-input offload; on the CPU it skips every tensor (they are on the
    host already), so its skip test is narrowed to what it skips on a GPU besides the device."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    class OnTheCpu(CheckpointHiddenStatesOffload):
        def _should_skip(self, tensor):
            return tensor.numel() == 0 or isinstance(tensor, torch.nn.Parameter)

    return OnTheCpu(use_pin_memory=False, use_streams=False)


def _versus_deepspeed(rank, world):
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    restore = _settled_collectives()
    try:
        rows = []
        for seq in (512 * world, 2048 * world):
            ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
            theirs_model = hf.apply(build("llama", "float32"), None)
            loss_fn = _deepspeed_pieces(theirs_model, TILE)
            theirs = _tracked_step(theirs_model, hf.shard_batch(ids, ids.clone()), loss_fn, DEEPSPEED_HOST, _deepspeed_offload())
            same_three = measure("llama", "float32", seq, "loss mlp offload")
            ours = measure("llama", "float32", seq, "loss mlp norms offload")
            rows.append((seq, theirs, same_three, ours))
            for name, got in (("ours, the same three pieces", same_three), ("ours, all pieces", ours)):
                assert got[0] <= theirs[0], f"rank {rank}, seq {seq}: {name} peak {got[0]} B > DeepSpeed ALST's {theirs[0]} B"
            # Host: DeepSpeed keeps the last layer's input on the device (keep_last_count=1), we
            # offload every layer's: one layer input more on the host, one less on the device.
            assert same_three[2] == theirs[2] + theirs[2] // (LAYERS - 1), (seq, same_three[2], theirs[2])
        if rank == 0:
            for seq, theirs, same, ours in rows:
                print(
                    f"seq {seq}: bytes per token DeepSpeed ALST {theirs[0] / seq:.0f}, ours (same pieces) {same[0] / seq:.0f}, "
                    f"ours (all) {ours[0] / seq:.0f}; host per token {theirs[2] / seq:.0f} / {same[2] / seq:.0f} / {ours[2] / seq:.0f}"
                )
    finally:
        restore()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (scripts/setup.sh installs it)")
def test_bytes_per_token_at_or_below_deepspeed_alst():
    run_ranks(_versus_deepspeed, 2)
