"""The memory calculator (``python -m ulysses_kernels.memory``) against a measurement, its
command line as a user runs it, its input errors, and docs/scaling.md's 176B table.

Activations: a tiny Llama and a tiny Qwen2 through ``hf.apply`` (SDPA), trained forward
with ``ShardedBatch.loss`` under ``traffic.LiveBytes`` (the bytes of every tensor the
forward allocates, from allocation to free; parameters and inputs are made before and not
counted), on 2 gloo ranks and on 1 process: what is alive when the forward ends (what is
kept for the backward) and the forward's peak, each within 2% of
``memory.activation_bytes`` on every rank. Shapes: float32, bfloat16 and float64 (the
RMSNorm's float32 copies and the residual stream differ), activation checkpointing on and
off, GQA with fewer KV heads than ranks, batch 1 and 2, and a Llama whose MLP is GPT's
``fc -> GELU -> fc`` (``--mlp plain``, the 176B recipe's; its norms stay RMSNorms).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_memory import _settled_collectives  # noqa: E402  (gloo lets go of finished buffers before we count)
from test_user_commands import run, user_env  # noqa: E402

from ulysses_kernels import memory  # noqa: E402
from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402
from ulysses_kernels.traffic import LiveBytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# NOTE: the bound asked of the calculator is 10%; measured, every case is within 0.7% (what
# is left: RMSNorm's [b, s, 1] reciprocal and a few scalars), so the test holds it to 2%.
TOLERANCE = 0.02
# (family, dtype, checkpointing, batch, seq, hidden, heads, kv heads, intermediate, layers, vocab)
CASES = [
    ("llama", "float32", False, 2, 128, 64, 8, 4, 160, 2, 96),
    ("llama", "float32", True, 2, 128, 64, 8, 4, 160, 2, 96),
    ("qwen2", "bfloat16", False, 1, 96, 48, 6, 1, 112, 3, 80),
    ("qwen2", "bfloat16", True, 1, 96, 48, 6, 1, 112, 3, 80),
    ("llama", "float64", False, 2, 64, 32, 4, 2, 80, 2, 64),
    ("llama-plain", "bfloat16", False, 1, 64, 32, 4, 4, 128, 2, 64),  # a GPT-style MLP (the 176B recipe's)
    ("llama-plain", "bfloat16", True, 1, 64, 32, 4, 4, 256, 3, 64),  # its peak in a layer's MLP, not at the loss
]


class PlainMLP(torch.nn.Module):
    """GPT's ``fc -> GELU -> fc`` in place of Llama's gated MLP."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc_in = torch.nn.Linear(hidden, intermediate, bias=False)
        self.fc_out = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.fc_out(torch.nn.functional.gelu(self.fc_in(x)))


def _model(family, dtype, checkpointing, hidden, heads, kv_heads, intermediate, layers, vocab):
    cls, config = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                   "llama-plain": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                   "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[family]  # fmt: skip
    cfg = config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                 max_position_embeddings=512, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = cls(cfg)
    if family == "llama-plain":
        for layer in model.model.layers:
            layer.mlp = PlainMLP(hidden, intermediate)
    model = model.to(getattr(torch, dtype)).train()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return hf.apply(model, None)


def _measure(case, rank: int, world: int) -> list[str]:
    """This rank's measured ``saved``/``peak_forward`` of ``case`` against the calculator's; the misses."""
    family, dtype, ckpt, batch, seq, hidden, heads, kv, inter, layers, vocab = case
    model = _model(family, dtype, ckpt, hidden, heads, kv, inter, layers, vocab)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    sharded = hf.shard_batch(ids, ids.clone(), group=None)
    tracker = LiveBytes()
    with tracker:
        share = sharded.loss(model(**sharded.model_inputs(loss=False)).logits)
        measured = {"saved": tracker.current, "peak_forward": tracker.peak}
    share.backward()  # the kept tensors are the backward's: it runs
    setup = memory.Setup(layers=layers, hidden=hidden, heads=heads, kv_heads=kv, intermediate=inter, vocab=vocab, seq=seq,
                         batch=batch, sp=world, dtype=dtype, checkpointing=ckpt, mlp="plain" if family == "llama-plain" else "gated")  # fmt: skip
    want = memory.activation_bytes(setup, rank)
    misses = []
    for key, got in measured.items():
        if abs(want[key] - got) > TOLERANCE * got:
            misses.append(f"rank {rank}/{world} {case}: {key} measured {got} B, calculator {want[key]} B")
    return misses


def _all_cases(rank, world):
    restore = _settled_collectives()
    try:
        misses = [m for case in CASES for m in _measure(case, rank, world)]
    finally:
        restore()
    assert not misses, "\n".join(misses)


def test_activations_match_a_measurement_on_2_ranks():
    run_ranks(_all_cases, 2)


def _one_process_misses() -> list[str]:
    return [m for case in CASES for m in _measure(case, 0, 1)]


def test_activations_match_a_measurement_on_1_process():
    # In a fresh process, as a user's training runs: in pytest's own process, state that
    # earlier tests leave behind (measured: after tests/test_compile.py's torch.compile runs)
    # adds up to 16 KB to the bf16 forward peaks here.
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        misses = pool.submit(_one_process_misses).result(timeout=600)
    assert not misses, "\n".join(misses)


def test_activation_terms():
    """The terms that tell the cases apart, against hand arithmetic for one float32 layer."""
    kw = {"layers": 1, "hidden": 64, "heads": 8, "kv_heads": 4, "intermediate": 160, "vocab": 96, "seq": 128, "batch": 2, "sp": 2, "dtype": "float32"}
    tokens, e = 2 * 64, 4
    norms = 2 * 2 * tokens * 64 * e
    attention = (8 + 2 * 4) // 2 * 2 * 128 * 8 * e + 4 * 2 * 128 * 8 * e + 2 * 4 * 128 * 4 + tokens * 64 * e  # recv, out, lse, o_proj input
    layer = norms + attention + 2 * tokens * 64 * e + 4 * tokens * 160 * e
    assert memory.activation_bytes(memory.Setup(**kw))["per_layer"] == layer
    ckpt = memory.activation_bytes(memory.Setup(**kw, checkpointing=True))
    assert ckpt["per_layer"] == tokens * 64 * e  # the layer's input: checkpointing drops the attention state too
    assert ckpt["layer_working_set"] == layer


def _doc_command() -> list[str]:
    """The calculator's command line as docs/scaling.md shows it (one line, backslashes joined)."""
    text = (ROOT / "docs" / "scaling.md").read_text()
    m = re.search(r"^ {4}(python -m ulysses_kernels\.memory .*?)(?<!\\)\n", text, re.M | re.S)
    assert m, "docs/scaling.md shows no `python -m ulysses_kernels.memory` command"
    return shlex.split(m.group(1).replace("\\\n", " "))


def test_doc_176b_table_is_the_calculator_output_run_from_outside_the_checkout(tmp_path):
    argv = _doc_command()
    out = run([sys.executable, "-I", *argv[1:]], tmp_path, env=user_env()).stdout.strip()
    doc = (ROOT / "docs" / "scaling.md").read_text()
    assert out in doc, f"docs/scaling.md's table differs from what `{shlex.join(argv)}` prints:\n{out}"
    data = json.loads(run([sys.executable, "-I", *argv[1:], "--json"], tmp_path, env=user_env()).stdout)
    assert data["total_gpu"] == sum(r["gpu"] for r in data["rows"]) and data["parameters"] > 1.7e11
    # The 8-node figure the doc quotes (the same recipe over 64 ranks, dp 8).
    wide = memory.Setup(**{**data["setup"], "dp": 8})
    total = sum(r.gpu for r in memory.memory_rows(wide)) / memory.GB
    assert f"about {total:.0f} GB per GPU" in doc


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"heads": 7}, r"hidden \(64\) expected a multiple of heads \(7\)"),
        ({"kv_heads": 3}, r"heads \(8\) expected a multiple of kv_heads \(3\)"),
        ({"sp": 16}, r"sp \(16\) expected at most heads \(8\)"),
        ({"zero": 4}, "zero expected a ZeRO stage"),
        ({"dtype": "int8"}, "dtype expected one of"),
        ({"mlp": "moe"}, "mlp expected 'gated' or 'plain'"),
        ({"offload_param": True, "zero": 2}, "offload_param expected ZeRO stage 3, got stage 2"),
        ({"offload_optimizer": True}, "offload_optimizer expected ZeRO stage 1, 2 or 3"),
        ({"seq": 0}, "seq expected a positive int, got 0"),
    ],
)
def test_bad_input_names_the_argument(kwargs, needle):
    base = {"layers": 2, "hidden": 64, "heads": 8, "vocab": 96, "seq": 128}
    with pytest.raises(memory.MemoryInputError, match=needle):
        memory.Setup(**{**base, **kwargs})


def test_cli_bad_input_exits_with_the_message(tmp_path):
    argv = [sys.executable, "-I", "-m", "ulysses_kernels.memory", "--layers", "2", "--hidden", "64", "--heads", "8",
            "--vocab", "96", "--seq", "128", "--sp", "3", "--kv-heads", "3"]  # fmt: skip
    r = run(argv, tmp_path, env=user_env(), expect_rc=2)
    assert "kv_heads (3)" in r.stderr and r.stdout == ""
