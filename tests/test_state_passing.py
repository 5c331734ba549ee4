"""State passing (``ulysses_kernels.state_passing``, ``mixer_parallel="state"``): the sequence
stays sharded, each layer's conv halo and recurrent state pass between ranks.

* The core on gloo ranks, float64: Gated DeltaNet's recurrence (per-head and per-channel
  decays: Kimi's), Mamba2's SSD scan, Mamba1's selective scan and a causal conv's halo, each rank on its shard (uneven, a shard
  shorter than the conv's halo, packed documents crossing and starting at shard boundaries)
  against one process per document: outputs and the gradient of every input within 1e-12.
* Whole models under ``hf.apply(mixer_parallel="state")`` (float64 sequential kernels both
  runs, as tests/test_hf_hybrid.py): loss, logits and every gradient at that file's
  tolerances, uneven and packed, 2 and 4 ranks; a one-key-head Qwen3.5 that the head exchange
  cannot split over 2 ranks runs under ``"auto"``.
* Bytes on the wire of an attention-free model's step do not grow with the sequence under
  ``"state"`` (counted at two lengths); under ``"heads"`` they do.
"""

from __future__ import annotations

import pytest
import torch

from ulysses_kernels.state_passing import DELTA, SSD, local_pieces, preceding, run_sharded, selective
from ulysses_kernels.testing.hybrids import gated_delta_rule_float64, mamba2_scan_float64, selective_scan_float64
from ulysses_kernels.testing.ranks import run_ranks

TOL = 1e-12
# Whole models: the head exchange runs each head's recurrence in one process's order (loss
# within 1e-12, gradients 1e-9: test_hf_hybrid); state passing sums the carried state in
# another order (A S_0 + c, the correction J S_0): float64 rounding apart (the core: 1e-12,
# above). Gradients of parameters test_hf_hybrid rounds to float32 (its FLOAT32_NORMS and
# float32-cast parameters), and the loss, logits and gradients of models whose float32
# rounding reaches everything (Nemotron-H's final norm, Bailing's unbounded gate:
# test_hf_hybrid's loss_rtol; Qwen3.5-MoE: its router's float32 softmax) are at
# STATE_FLOAT32_RTOL, as are packed batches (test_hf_hybrid's PACKED note); everything else
# (loss, logits, every other gradient) at STATE_RTOL, the bound.
# NOTE: measured at 2 and 4 ranks, uneven and packed, float64 kernels: loss 0 to 4e-16 (Qwen3.5-MoE
# 1.2e-10, Nemotron-H 1.2e-7), float32-rounded gradients <= 1.8e-7 (Qwen3.5-MoE 8.7e-6).
STATE_RTOL = 1e-9
STATE_FLOAT32_RTOL = 3e-5
# Parameters the mixers cast to float32 before use besides test_hf_hybrid's (``self.D.float()``,
# ``dt_proj.bias.float()`` in Mamba1's scan, Zamba's ``dt_proj_bias.float()``; ``a.float() +
# dt_bias`` in Gated DeltaNet's gate):
# their gradient is a float32 sum over the tokens, which the ranks sum in parts.
CAST = (".D", ".dt_proj.bias", ".dt_proj_bias", ".dt_bias")
ATTENTION_FREE = ("mamba", "falcon-mamba", "mamba2")  # what runs at 8 ranks (12 or 13 tokens: shards of 1 or 2)
FLOAT32_ROUTED = {"qwen3.5-moe", "nemotron-h", "bailing-hybrid-softplus", "minimax"}


def _gdn(per_channel: bool):
    def run(q, k, v, g, beta, initial_state):
        return gated_delta_rule_float64(q, k, v, g, beta, initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def inputs(total, gen):
        b, h, hk, dk, dv = 1, 4, 2, 5, 3
        q, k = torch.randn(b, total, hk, dk, generator=gen, dtype=torch.float64), torch.randn(b, total, hk, dk, generator=gen, dtype=torch.float64)
        v = torch.randn(b, total, h, dv, generator=gen, dtype=torch.float64)
        g = -torch.rand(b, total, h, *((dk,) if per_channel else ()), generator=gen, dtype=torch.float64)
        beta = torch.rand(b, total, h, generator=gen, dtype=torch.float64)
        if per_channel:  # Kimi: one key head per value head
            q, k = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
        return [q, k, v, g, beta]

    return run, inputs, DELTA


def _ssd():
    a_neg = -torch.tensor([0.5, 1.0, 0.25])
    d_skip = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)

    def run(x, dt, bm, cm, initial_states):
        return mamba2_scan_float64(x, dt, a_neg, bm, cm, 4, D=d_skip, dt_softplus=True, initial_states=initial_states, return_final_states=True)

    def inputs(total, gen):
        b, h, p, n = 2, 3, 4, 6
        x = torch.randn(b, total, h, p, generator=gen, dtype=torch.float64)
        dt = torch.randn(b, total, h, generator=gen, dtype=torch.float64)
        bm, cm = (torch.randn(b, total, h, n, generator=gen, dtype=torch.float64) for _ in range(2))
        return [x, dt, bm, cm]

    return run, inputs, SSD


def _selective():
    a_neg = -torch.rand(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 0.2
    bias = torch.tensor([0.1, -0.3, 0.2, 0.0, 0.5], dtype=torch.float64)
    d_skip = torch.tensor([0.3, -0.2, 0.1, 0.4, 1.0], dtype=torch.float64)
    t = lambda v: v.transpose(1, 2)  # noqa: E731

    def run(x, dt, bm, cm, initial_state):
        assert initial_state is None  # the kernel takes none: selective's closed form corrects
        y, last = selective_scan_float64(t(x), t(dt), a_neg, t(bm), t(cm), D=d_skip, delta_bias=bias, delta_softplus=True, return_last_state=True)
        return t(y), last

    def inputs(total, gen):
        b, c, n = 2, 5, 4
        return [torch.randn(b, total, c, generator=gen, dtype=torch.float64) for _ in range(2)] + [
            torch.randn(b, total, n, generator=gen, dtype=torch.float64) for _ in range(2)
        ]

    return run, inputs, selective(a_neg, bias)


CASES = {"gdn": lambda: _gdn(False), "kda": lambda: _gdn(True), "ssd": _ssd, "selective": _selective}
# (seq_lens, documents' spans): uneven; a document crossing two boundaries; one starting exactly
# at a shard's start, one inside a shard, one of a single token.
SHARDS = {
    8: [((2, 1, 3, 1, 2, 2, 1, 3), None), ((2, 2, 2, 2, 2, 2, 2, 2), [(0, 3), (3, 4), (4, 11), (11, 16)])],
    2: [((7, 4), None), ((6, 5), [(0, 3), (3, 6), (6, 11)])],
    3: [((5, 1, 6), None), ((4, 4, 4), [(0, 1), (1, 4), (4, 10), (10, 12)])],
    4: [((3, 4, 2, 5), None), ((3, 3, 3, 3), [(0, 5), (5, 6), (6, 12)])],
}


def job_core(rank, world):
    from ulysses_kernels.comm import get_communicator

    comm = get_communicator(None)
    for name, make in CASES.items():
        run, inputs, algebra = make()
        for seq_lens, spans in SHARDS[world]:
            total = sum(seq_lens)
            gen = torch.Generator().manual_seed(7)
            full = inputs(total, gen)
            weight = None
            # One process: each document from a zero state.
            leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in full]
            docs = spans or [(0, total)]
            ref = torch.cat([run(*(t[:, a:b] for t in leaves), None)[0] for a, b in docs], dim=1)
            weight = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
            (ref * weight).sum().backward()
            # The ranks: this rank's shard of every input.
            start, s_r = sum(seq_lens[:rank]), seq_lens[rank]
            mine = [t[:, start : start + s_r].clone().requires_grad_() for t in full]
            out = run_sharded(comm, seq_lens, docs, run, algebra, mine)
            what = f"{name}, shards {seq_lens}, documents {spans}"
            err = (out - ref[:, start : start + s_r]).abs().max().item()
            assert err <= TOL, f"{what}: output off by {err:.1e}"
            (out * weight[:, start : start + s_r]).sum().backward()
            for i, (got, leaf) in enumerate(zip(mine, leaves)):
                err = (got.grad - leaf.grad[:, start : start + s_r]).abs().max().item()
                assert err <= TOL, f"{what}: grad of input {i} off by {err:.1e}"
    # The conv's halo: the tokens before the shard, from several ranks when shards are short.
    for seq_lens, _ in SHARDS[world]:
        total, width = sum(seq_lens), 4
        x = torch.arange(total, dtype=torch.float64).view(1, total, 1).expand(2, total, 3).contiguous()
        start = sum(seq_lens[:rank])
        mine = x[:, start : start + seq_lens[rank]].clone().requires_grad_()
        before = preceding(comm, seq_lens, mine, width)
        assert torch.equal(before, x[:, max(0, start - width) : start]), (seq_lens, rank, before[0, :, 0])
        (before.sum() + mine.sum() * 0).backward()
        # Each token's gradient: 1 for every later rank whose halo holds it.
        ends = [sum(seq_lens[: j + 1]) for j in range(world)]
        pos = torch.arange(start, start + seq_lens[rank])
        want = sum(((pos >= max(0, ends[j - 1] - width)) & (pos < ends[j - 1])).double() for j in range(1, world))
        assert torch.equal(mine.grad[0, :, 0], want), (seq_lens, rank, mine.grad[0, :, 0], want)


def test_every_family_has_state_passing_and_a_family_without_is_refused(monkeypatch):
    """Every family the mixers register runs under ``"state"`` (a new family without it fails
    here first); one without it is refused by class under ``"state"`` and stays on the head
    exchange under ``"auto"``."""
    from ulysses_kernels.integrations import hf
    from ulysses_kernels.layers import mixers
    from ulysses_kernels.testing.hybrids import MODELS, build

    assert {family for family, _, _ in mixers._ADAPTERS.values()} <= set(mixers.STATE_FAMILIES)
    model = build(next(c for c in MODELS if c[0] == "bamba"))
    monkeypatch.setattr(mixers, "STATE_FAMILIES", tuple(f for f in mixers.STATE_FAMILIES if f != "mamba2"))
    with pytest.raises(hf.HFIntegrationError, match=r"BambaMixer \(mamba2\) does not run with mixer_parallel='state'"):
        mixers.plan_mixers(mixers.mixer_modules(model), 2, "state")
    assert {strategy for _, _, strategy in mixers.plan_mixers(mixers.mixer_modules(model), 2)} == {"heads"}
    with pytest.raises(hf.HFIntegrationError, match=r"apply: mixer_parallel expected 'heads', 'state' or 'auto', got 'ring'"):
        hf.apply(model, mixer_parallel="ring")


def test_a_rank_without_tokens_is_refused():
    from ulysses_kernels.comm import get_communicator

    run, inputs, algebra = _ssd()
    with pytest.raises(ValueError, match=r"every rank needs at least one token, got seq_lens \(3, 0\)"):
        run_sharded(get_communicator(None), (3, 0), [(0, 3)], run, algebra, inputs(3, torch.Generator().manual_seed(0)))


def test_local_pieces():
    assert local_pieces((4, 4), 1, [(0, 6), (6, 8)]) == ([(0, 2), (2, 4)], True)
    assert local_pieces((4, 4), 1, [(0, 4), (4, 8)]) == ([(0, 4)], False)
    assert local_pieces((4, 4), 1, [(0, 8)], lead=3) == ([(0, 7)], True)
    assert local_pieces((4, 4), 1, [(0, 2), (2, 8)], lead=3) == ([(0, 1), (1, 7)], True)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_core_against_one_process(world):
    run_ranks(job_core, world)


def _state_models():
    from ulysses_kernels.layers.mixers import _ADAPTERS, STATE_FAMILIES
    from ulysses_kernels.testing.hybrids import MODELS

    return [case for case in MODELS if _ADAPTERS[case[3]][0] in STATE_FAMILIES]


def job_models(rank, world):
    """Every model whose mixers state passing covers, under ``mixer_parallel="state"``, against
    one process (float64 kernels in both runs; ``STATE_RTOL`` and ``STATE_FLOAT32_RTOL``)."""
    from test_hf import global_batch
    from test_hf import reference as reference_unpacked
    from test_hf_hybrid import GRAD_RTOL, _rel, grad_tolerances
    from test_hf_packed import packed_batch
    from test_hf_packed import reference as reference_packed

    from ulysses_kernels.integrations import hf
    from ulysses_kernels.layers.mixers.exchange import MIXER_SETTINGS_ATTR
    from ulysses_kernels.testing.hybrids import build, float64_kernels, sharded_step
    from ulysses_kernels.testing.reference import computed_once

    ids, labels = global_batch()
    pids, plabels, positions, cu = packed_batch()
    worst = {}
    # The hybrids' attention has 4 heads: at most 4 ranks.
    cases = [case for case in _state_models() if world <= 4 or case[0] in ATTENTION_FREE]
    with float64_kernels():
        # The one-process references, each computed on one rank and sent to all (not by every rank).
        refs = computed_once(
            [lambda c=case: reference_unpacked(build(c), ids, labels) for case in cases]
            + [lambda c=case: reference_packed(build(c), pids, plabels, cu) for case in cases]
        )  # fmt: skip
        for i, case in enumerate(cases):
            name = case[0]
            model = hf.apply(build(case), None, mixer_parallel="state")
            switched = [m for m in model.modules() if type(m).__name__ == case[3]]
            assert switched and all(getattr(m, MIXER_SETTINGS_ATTR).strategy == "state" for m in switched), name
            loose = name in FLOAT32_ROUTED
            strict = set() if loose else {"loss", "logits"} | {n for n, t in grad_tolerances(model).items() if t == GRAD_RTOL and not n.endswith(CAST)}
            runs = (
                ("uneven", refs[i], hf.shard_batch(ids, labels, group=None)),
                ("packed", refs[len(cases) + i], hf.shard_batch(pids, plabels, group=None, position_ids=positions)),
            )
            for kind, ref, batch in runs:
                loss, grads, logits = sharded_step(model, batch, None)
                errs = {"loss": _rel(loss, ref[0]), "logits": _rel(logits, ref[2])}
                errs |= {n: _rel(g, ref[1][n]) for n, g in grads.items()}
                for what, err in errs.items():
                    # Packed: everything at the float32 bound, as test_hf_hybrid (its PACKED note).
                    tol = STATE_RTOL if what in strict and kind != "packed" else STATE_FLOAT32_RTOL
                    assert err <= tol, f"{name}, world {world}, state passing, {kind}: {what}: relative error {err:.2e} > {tol:.0e}"
                    key = (name, kind, "strict" if tol == STATE_RTOL else "float32")
                    worst[key] = max(worst.get(key, 0.0), err)
    if rank == 0:
        for key, err in sorted(worst.items()):
            print(f"state passing, world {world}, {key}: {err:.1e}", flush=True)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_models_under_state_passing(world):
    run_ranks(job_models, world)


def job_heads_and_bytes(rank, world):
    """(1) Qwen3.5 whose linear attention has one head: the head exchange cannot split it over 2
    ranks (refused by name, naming the fix); ``"auto"`` (the default) runs it with state passing,
    exact. (2) Mamba2 and Mamba (attention-free): the bytes each rank sends in one forward+backward, at two
    lengths: constant under ``"state"``, growing under ``"heads"``."""
    from test_hf import reference as reference_unpacked
    from test_hf_hybrid import _rel

    from ulysses_kernels.comm import get_communicator
    from ulysses_kernels.integrations import hf
    from ulysses_kernels.testing.hybrids import MODELS, VOCAB, build, float64_kernels, sharded_step
    from ulysses_kernels.traffic import WireCounter as CountingComm

    gen = torch.Generator().manual_seed(3)
    qwen = next(c for c in MODELS if c[0] == "qwen3.5")
    one_head = (*qwen[:4], qwen[4] | {"linear_num_value_heads": 1, "linear_num_key_heads": 1})
    with pytest.raises(hf.HFIntegrationError, match=r"Qwen3_5GatedDeltaNet \(1 heads, 1 groups\) cannot be split over 2 ranks.*mixer_parallel='state'"):
        hf.apply(build(one_head), None, mixer_parallel="heads")
    ids = torch.randint(0, VOCAB, (2, 11), generator=gen)
    labels = ids.clone()
    with float64_kernels():
        model = hf.apply(build(one_head), None)  # "auto"
        assert hf.mixer_strategies(model) == {"model.layers.0.linear_attn": "state", "model.layers.2.linear_attn": "state"}, hf.mixer_strategies(model)
        assert hf.mixer_strategies(hf.apply(build(qwen), None)) == dict.fromkeys(("model.layers.0.linear_attn", "model.layers.2.linear_attn"), "heads")
        ref = reference_unpacked(build(one_head), ids, labels)
        loss, grads, logits = sharded_step(model, hf.shard_batch(ids, labels, group=None), None)
        assert _rel(loss, ref[0]) <= STATE_RTOL and _rel(logits, ref[2]) <= STATE_RTOL, (_rel(loss, ref[0]), _rel(logits, ref[2]))
        for n, g in grads.items():
            assert _rel(g, ref[1][n]) <= STATE_FLOAT32_RTOL, (n, _rel(g, ref[1][n]))
    for name in ("mamba2", "mamba"):
        case = next(c for c in MODELS if c[0] == name)
        sent = {}
        for strategy in ("state", "heads"):
            for length in (16, 64):
                comm = CountingComm(get_communicator(None))
                model = hf.apply(build(case), None, comm=comm, mixer_parallel=strategy)
                ids = torch.randint(0, VOCAB, (1, length), generator=gen)
                batch = hf.shard_batch(ids, ids.clone(), group=None)
                batch.loss(model(**batch.model_inputs(loss=False)).logits).backward()
                sent[(strategy, length)] = sum(comm.sent)
        assert sent[("state", 16)] == sent[("state", 64)] > 0, (name, sent)
        assert sent[("heads", 64)] > 3 * sent[("heads", 16)], (name, sent)
        if rank == 0:
            print(f"bytes sent by rank 0, {name} forward+backward (2 layers): {sent}", flush=True)


def _sac(saved, asked):
    """torch's selective activation checkpointing as transformers takes it (``context_fn``): the
    ops ``saved`` says are kept, every other one recomputed in the backward; ``asked`` counts the
    policy's calls (torch 2.14 asks in the forward only and keeps the answers for the recompute)."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        asked[ctx.is_recompute] += 1
        return CheckpointPolicy.MUST_SAVE if saved(op) else CheckpointPolicy.PREFER_RECOMPUTE

    return {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}


MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}
CHECKPOINTING = {  # transformers' gradient_checkpointing_kwargs: full, and SAC saving matmuls / nothing
    "full": None,
    "sac-save-matmuls": lambda asked: _sac(lambda op: op in MATMULS, asked),
    "sac-recompute-all": lambda asked: _sac(lambda op: False, asked),
}


def job_checkpointed(rank, world):
    """Activation checkpointing (transformers' gradient checkpointing, the layer recomputed in the
    backward with its gathers; full and torch's selective checkpointing, whose recompute must run
    once, the gathers' collectives included) under state passing: the step equals the same
    model's without it."""
    from ulysses_kernels.integrations import hf
    from ulysses_kernels.testing.hybrids import MODELS, VOCAB, build, sharded_step

    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(5))
    for name in ("qwen3.5", "bamba", "mamba", "recurrent-gemma"):
        case = next(c for c in MODELS if c[0] == name)
        plain = sharded_step(hf.apply(build(case), None, mixer_parallel="state"), hf.shard_batch(ids, ids.clone(), group=None), None)
        for how, kwargs in CHECKPOINTING.items():
            model = hf.apply(build(case), None, mixer_parallel="state")
            asked, ran = {False: 0, True: 0}, []
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None if kwargs is None else kwargs(asked))
            # transformers checkpoints each layer's forward: its children run again in the recompute
            layers = model.base_model.layers
            for layer in layers:
                next(layer.children()).register_forward_pre_hook(lambda m, a, ran=ran: ran.append(m))
            got = sharded_step(model, hf.shard_batch(ids, ids.clone(), group=None), None)
            assert len(ran) == 2 * len(layers), (name, how, len(ran))  # each layer recomputed once
            assert kwargs is None or asked[False] > 0, (name, how, asked)  # SAC's policy chose
            assert torch.equal(got[0], plain[0]), (name, how, got[0], plain[0])
            for n, g in got[1].items():
                assert torch.allclose(g, plain[1][n], rtol=1e-12, atol=0), (name, how, n, (g - plain[1][n]).abs().max())


def test_state_passing_under_activation_checkpointing():
    run_ranks(job_checkpointed, 2)


def test_one_head_and_bytes():
    run_ranks(job_heads_and_bytes, 2)


def test_bench_runs_both_strategies(tmp_path, capfd):
    """``python -m ulysses_kernels.bench.state_passing --spawn 2`` (the CPU form): a timed row per
    strategy, the two losses equal within rounding, state passing's bytes the same at both lengths
    and the head exchange's growing, a record written (CPU-labelled)."""
    import json

    from ulysses_kernels.bench import state_passing as bench

    assert bench.main(["--spawn", "2", "--models", "mamba2", "--seqs", "32,128", "-n", "2", "--out-dir", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    assert "not a GPU claim" in out and "beyond rounding: 0 OK" in out, out
    (path,) = (p for p in tmp_path.glob("bench_state_passing_*.json") if not p.name.endswith("_latest.json"))
    rows = {(r["seq"], r["strategy"]): r for r in json.loads(path.read_text())["rows"]}
    assert all(r["median_ms"] > 0 for r in rows.values()), rows
    assert rows[(32, "state")]["bytes_sent"] == rows[(128, "state")]["bytes_sent"] > 0, rows
    assert rows[(128, "heads")]["bytes_sent"] > 3 * rows[(32, "heads")]["bytes_sent"], rows
    assert rows[(128, "state")]["loss_rel"] <= 1e-5 and rows[(128, "state")]["ratio"] > 0, rows


def job_two_d(rank, world):
    """A hybrid on a 2-D group, Ulysses x ring for attention (4 heads over 8 ranks: ulysses 4 x
    ring 2), its mixers with state passing over the whole group: the step against one process
    (padded equal shards, as a 2-D group takes them). Zigzag shards and ``"heads"`` are refused
    by name."""
    from test_hf import global_batch
    from test_hf import reference as reference_unpacked
    from test_hf_hybrid import _rel

    import ulysses_kernels as uk
    from ulysses_kernels.integrations import hf
    from ulysses_kernels.testing.hybrids import MODELS, build, float64_kernels, sharded_step

    sp = uk.make_sp_groups(ulysses_size=4, ring_size=2)
    ids, labels = global_batch()
    with float64_kernels():
        for name in ("qwen3.5", "bamba"):
            case = next(c for c in MODELS if c[0] == name)
            model = hf.apply(build(case), sp)
            assert set(hf.mixer_strategies(model).values()) == {"state"}, hf.mixer_strategies(model)
            ref = reference_unpacked(build(case), ids, labels)
            loss, grads, logits = sharded_step(model, hf.shard_batch(ids, labels, group=sp, pad=True), sp)
            errs = {"loss": _rel(loss, ref[0]), "logits": _rel(logits, ref[2])} | {n: _rel(g, ref[1][n]) for n, g in grads.items()}
            worst = max(errs, key=errs.get)
            assert errs[worst] <= STATE_FLOAT32_RTOL, (name, worst, errs[worst])
            if rank == 0:
                print(f"2-D group 4 x 2, {name}: worst {worst} {errs[worst]:.1e}, loss {errs['loss']:.1e}", flush=True)
        case = next(c for c in MODELS if c[0] == "qwen3.5")
        with pytest.raises(hf.HFIntegrationError, match=r"on a 2-D SPGroups they run with state passing.*not with mixer_parallel='heads'"):
            hf.apply(build(case), sp, mixer_parallel="heads")
        zigzag = uk.make_sp_groups(ulysses_size=4, ring_size=2, seq_layout="zigzag")
        with pytest.raises(hf.HFIntegrationError, match=r"not with seq_layout 'zigzag'"):
            hf.apply(build(case), zigzag)


def test_hybrid_on_a_two_d_group():
    run_ranks(job_two_d, 8)
