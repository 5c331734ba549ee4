"""Rank 0 of an N-way group emulated in one process (``comm.EmulatedPeers``, what
``bench.longctx --emulate-rank0-of N`` runs on one GPU): exact, and holding what rank 0 holds.

* Exactness: rank 0 of a real 4-rank gloo run records what its exchanges brought from the
  peers (``RecordingCommunicator``); the emulated rank 0 of 4, given those blocks, computes the
  same loss and the same parameter gradients, bit for bit (``torch.equal``), and its step's
  live bytes match the calculator's replay (``memory_step``) within 2%.
* Memory with stand-ins (the peers' blocks copies of the rank's own, as on the GPU): the
  emulated step's peak, forward end and offload host peak under ``traffic.LiveBytes`` are within
  2% of ``memory_step`` for rank 0 of 4, 8 and 16, Llama-like 8/4 heads and Qwen2.5-14B-like
  40/8 heads (uneven query heads, replicated KV heads), each long-context piece off and on.

One spawn of 4 ranks (about 10 s on 2 cores); the rest runs in the test process.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_longctx_memory import OURS_HOST, TILE, _ours, _tracked_step  # noqa: E402

from ulysses_kernels import longctx, memory  # noqa: E402
from ulysses_kernels.comm import EmulatedPeers, EmulationError, PeerRecording, RecordingCommunicator, TorchCommunicator  # noqa: E402
from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.memory_step import step_memory  # noqa: E402
from ulysses_kernels.testing import run_ranks  # noqa: E402

TOLERANCE = 0.02  # the calculator's bound (tests/test_longctx_memory.py); measured: exact to the loss scalar
VOCAB, LAYERS, FFN = 96, 2, 96
ALL = "loss mlp norms offload"
# (name, hidden, heads, kv heads): Llama-3-8B's 32/8 scaled down; Qwen2.5-14B's 40/8 (head_dim 4)
SHAPES = {"llama": (64, 8, 4), "qwen": (160, 40, 8)}


def build(shape: str, dtype: str):
    hidden, heads, kv = SHAPES[shape]
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=heads,
        num_key_value_heads=kv, max_position_embeddings=1 << 16, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def pieces_kwargs(pieces: str) -> dict:
    return {
        "tiled_loss": TILE if "loss" in pieces else False, "tiled_mlp": TILE if "mlp" in pieces else False,
        "tiled_norms": TILE if "norms" in pieces else False,
        "offload_activations": longctx.ActivationOffload() if "offload" in pieces else False,
    }  # fmt: skip


def setup_of(shape: str, dtype: str, seq: int, world: int, pieces: str) -> memory.Setup:
    hidden, heads, kv = SHAPES[shape]
    return memory.Setup(
        layers=LAYERS, hidden=hidden, heads=heads, kv_heads=kv, intermediate=FFN, vocab=VOCAB, seq=seq, sp=world, dtype=dtype,
        checkpointing=True, tiled_loss="loss" in pieces, tiled_mlp="mlp" in pieces, tiled_norms="norms" in pieces,
        offload_activations="offload" in pieces, loss_tile_rows=TILE, mlp_tile_rows=TILE, norm_tile_rows=TILE,
    )  # fmt: skip


def ids_of(seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq))


def emulated_step(shape, dtype, seq, world, pieces, peers=None):
    """One step of the emulated rank 0 of ``world`` under ``LiveBytes``: (model, loss, (peak, forward end, host peak))."""
    model = build(shape, dtype)
    comm = EmulatedPeers(world, peers=peers)
    hf.apply(model, None, comm=comm, check="never", **pieces_kwargs(pieces))
    batch = hf.shard_batch(ids_of(seq), comm=comm, check=False)
    losses = []

    def loss_fn(m, b):
        loss, held = _ours(m, b)
        losses.append(loss.detach().clone())
        return loss, held

    measured = _tracked_step(model, batch, loss_fn, OURS_HOST)
    if peers is not None and comm.calls != len(peers.calls):
        raise AssertionError(f"the emulated step ran {comm.calls} exchanges, the real rank {len(peers.calls)}")
    return model, losses[0], measured


def within(measured, calc) -> list[str]:
    misses = []
    for what, got, want in zip(("peak", "forward end", "host"), measured, (calc.peak, calc.forward_end, calc.host_peak)):
        if abs(want - got) > TOLERANCE * max(got, 1):
            misses.append(f"{what}: measured {got} B, calculator {want} B")
    return misses


# (shape, dtype, global tokens, pieces): uneven shards (rank 0 holds one token more), every piece, bf16, 40/8 heads
EXACT_CASES = [
    ("llama", "float32", 4 * 256 + 3, ""),
    ("llama", "bfloat16", 4 * 256 + 1, ALL),
    ("qwen", "float32", 4 * 64, ALL),
]


def _exactness_body(rank, world):
    for shape, dtype, seq, pieces in EXACT_CASES:
        model = build(shape, dtype)
        inner = TorchCommunicator(None)
        comm = RecordingCommunicator(inner) if rank == 0 else inner
        hf.apply(model, None, comm=comm, **pieces_kwargs(pieces))
        out = model(**hf.shard_batch(ids_of(seq)).model_inputs())
        with torch.utils.checkpoint.GraphExecGroup():
            out.loss.backward()
        if rank != 0:
            continue
        real_loss, real_grads = out.loss.detach(), [p.grad for p in model.parameters()]
        emulated, loss, measured = emulated_step(shape, dtype, seq, world, pieces, peers=comm.recording)
        case = f"{shape} {dtype} seq {seq} [{pieces}]"
        assert torch.equal(loss, real_loss), f"{case}: loss emulated {loss.item()!r}, real rank 0 {real_loss.item()!r}"
        for (name, p), g in zip(emulated.named_parameters(), real_grads):
            assert torch.equal(p.grad, g), f"{case}: {name}.grad differs, max |diff| {(p.grad - g).abs().max().item()}"
        misses = within(measured, step_memory(setup_of(shape, dtype, seq, world, pieces), 0))
        assert not misses, f"{case}: " + "; ".join(misses)


def test_emulated_rank0_of_4_equals_real_rank0_of_4_gloo():
    run_ranks(_exactness_body, 4)


@pytest.mark.parametrize(
    "shape,dtype,world,pieces",
    [("llama", "float32", 4, ""), ("llama", "float32", 8, ALL), ("llama", "bfloat16", 8, ""), ("llama", "bfloat16", 8, ALL),
     ("qwen", "float32", 16, ""), ("qwen", "bfloat16", 16, ALL)],
)  # fmt: skip
def test_emulated_memory_within_2_percent_of_the_replay(shape, dtype, world, pieces):
    seq = 192 * world + 5  # uneven shards: rank 0 holds the longest
    _, loss, measured = emulated_step(shape, dtype, seq, world, pieces)
    assert math.isfinite(loss.item())
    misses = within(measured, step_memory(setup_of(shape, dtype, seq, world, pieces), 0))
    assert not misses, f"rank 0 of {world}, {shape} {dtype} [{pieces}]: " + "; ".join(misses)


def test_emulated_group_refuses_what_needs_peers():
    comm = EmulatedPeers(4)
    with pytest.raises(EmulationError, match="check='never'"):
        hf.shard_batch(ids_of(64), comm=comm)
    model = hf.apply(build("llama", "float32"), None, comm=comm)  # check="step": the first attention call asks the peers
    with pytest.raises(EmulationError, match="no peers"):
        model(**hf.shard_batch(ids_of(64), comm=comm, check=False).model_inputs())
    with pytest.raises(ValueError, match="rank expected"):
        EmulatedPeers(4, rank=4)


def test_a_replay_out_of_step_is_refused():
    rec = PeerRecording(0, 2, [("send_recv", [])])
    comm = EmulatedPeers(2, peers=rec)
    out, inp = torch.zeros(4), torch.ones(4)
    with pytest.raises(EmulationError, match="exchange 0 is all_to_all here, send_recv in the recording"):
        comm.all_to_all(out, inp, [2, 2], [2, 2])
    rec = PeerRecording(0, 2, [("all_to_all", [None, torch.zeros(3)])])
    with pytest.raises(EmulationError, match=r"buffer is torch.float32 \[2\], the recording torch.float32 \[3\]"):
        EmulatedPeers(2, peers=rec).all_to_all(out, inp, [2, 2], [2, 2])
    with pytest.raises(ValueError, match="recording is of rank 0 of 2"):
        EmulatedPeers(4, peers=rec)


def test_stand_ins_fill_the_peers_blocks_from_the_own_block():
    comm = EmulatedPeers(3, rank=1)
    inp = torch.arange(9.0)  # blocks of 2, 3, 4 elements to ranks 0, 1, 2
    out = torch.full((3 + 3 + 2,), -1.0)  # 3 from rank 0, 3 own, 2 from rank 2
    comm.all_to_all(out, inp, [3, 3, 2], [2, 3, 4])
    assert out.tolist() == [2.0, 3.0, 4.0, 2.0, 3.0, 4.0, 2.0, 3.0]


def test_bench_emulated_rows_match_the_calculator(tmp_path):
    """``bench.longctx --emulate-rank0-of 4`` at tiny sizes, Llama and Qwen2 (40/8 heads, rank 0 of 16),
    the GPU command's code path: every
    measured row within 2% of the calculator, term by term; the proxy attention's bytes equal the
    causal kernel's; the longest-sequence probes bracket the calculator's answer; the JSON written."""
    import json

    from ulysses_kernels.bench.longctx import main

    argv = ["--emulate-rank0-of", "4", "--model", "tiny,tiny-qwen2@16", "--seqs", "512,1K", "--layers", "2,3", "--max-seq", "--gpu-gb", "0.006",
            "--max-probes", "2", "--out-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((tmp_path / "bench_longctx_emulated_latest.json").read_text())
    rows = [r for r in doc["rows"] if r["status"] == "ok"]
    assert {r["what"] for r in rows} >= {"time", "memory", "max-seq probe"}, [r["status"] for r in doc["rows"]]
    for r in rows:
        for term in ("params", "forward_end", "act_peak", "host"):
            assert r[f"{term}_diff"] is None or abs(r[f"{term}_diff"]) <= TOLERANCE, (term, r)
        assert abs(r["total_diff"]) <= TOLERANCE, r  # 4 layers: the slope measured between 2 and 3 layers, or the calculator's
    assert {(c["model"], c["sp"]) for c in doc["meta"]["proxy_check"]} == {("tiny", 4), ("tiny-qwen2", 16)}
    assert all(c["act_peak_diff"] == 0.0 for c in doc["meta"]["proxy_check"]), doc["meta"]["proxy_check"]
    for search in doc["meta"]["max_seq"]:  # a fit at most one probe step (the block unit) past the calculator's answer
        unit = search["sp"] * 64
        assert search["longest_fit"] is not None and search["longest_fit"] <= search["calc_max_seq"] + unit, search
    assert doc["env"]["process"].startswith("rank 0 of an emulated group")
    assert not (tmp_path / "bench_longctx_emulated_partial.json").exists()


def test_bench_emulated_time_budget_skips_rows(tmp_path):
    import json

    from ulysses_kernels.bench.longctx import main

    argv = ["--emulate-rank0-of", "4", "--model", "tiny", "--seqs", "1K", "--time-budget", "0", "--out-dir", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "bench_longctx_emulated_latest.json").read_text())
    assert doc["rows"] and all(r["status"].startswith("skipped: estimated") for r in doc["rows"]), doc["rows"]
