"""Every fix an ``hf`` error suggests works when followed.

One spawn of 3 ranks (more ranks than the models' 2 heads): each refusal is raised on every
rank, its text suggests one fix and not the other, and the suggested fix, followed, runs the
step and matches one process. Before: a Gated DeltaNet with fewer heads than ranks suggested
``make_sp_groups(ulysses_size=1, ring_size=2)``, which ``apply`` refuses for such mixers.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

import ulysses_kernels as uk  # noqa: E402
from ulysses_kernels.integrations import hf  # noqa: E402
from ulysses_kernels.layers.mixers import mixer_modules, plan_mixers  # noqa: E402
from ulysses_kernels.testing import build_tiny, run_ranks  # noqa: E402

TWO_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
TWO_GDN_HEADS = {"linear_num_key_heads": 1, "linear_num_value_heads": 2}


def _refusal(fn, error=hf.HFIntegrationError) -> str:
    with pytest.raises(error) as e:
        fn()
    return str(e.value)


def _step_matches_one_process(model, ids, group, **shard) -> None:
    """``model`` under ``apply`` on ``group``: the global mean loss equals one process's."""
    reference = copy.deepcopy(model)
    hf.apply(model, group)
    out = model(**hf.shard_batch(ids, ids, group=group, **shard).model_inputs())
    out.loss.backward()
    loss = hf.reduce_loss(out.loss, group)
    torch.testing.assert_close(loss, reference(ids, labels=ids).loss)


def _job(rank, world):
    assert world == 3
    ids = torch.randint(0, 61, (1, 24), generator=torch.Generator().manual_seed(0))
    pair = dist.new_group([0, 1])  # the fix "a flat group of at most 2 ranks" (every rank makes it)

    # A hybrid whose Gated DeltaNet has 2 heads: the head exchange refuses it at apply, with the fixes
    # that work: state passing (what "auto", the default, picks: the step matches one process on all 3
    # ranks) or a flat group of 2.
    hybrid = lambda: build_tiny("qwen3_5_text", TWO_GDN_HEADS)  # noqa: E731
    msg = _refusal(lambda: hf.apply(hybrid(), mixer_parallel="heads"))
    assert "Qwen3_5GatedDeltaNet (2 heads, 1 groups) cannot be split over 3 ranks" in msg, msg
    assert "pass a flat sequence-parallel group of at most 2 ranks" in msg and "make_sp_groups(ulysses_size" not in msg, msg
    assert "mixer_parallel='state' runs it" in msg, msg
    # The old advice, a 2-D group: its ring level cannot carry the head exchange's mixers (refused by name);
    # under "auto" they pass their state over the whole group instead, and the step matches one process.
    sp = uk.make_sp_groups(1, 3)
    msg = _refusal(lambda: hf.apply(hybrid(), sp, mixer_parallel="heads"))
    assert "on a 2-D SPGroups they run with state passing" in msg and "not with mixer_parallel='heads'" in msg, msg
    _step_matches_one_process(hybrid(), ids, sp)
    _step_matches_one_process(hybrid(), ids, None)
    if rank < 2:
        _step_matches_one_process(hybrid(), ids, pair)

    # A hybrid whose attention has 2 heads (its Gated DeltaNet 4): refused at apply, not at the call, with
    # the 2-D group its mixers run on (state passing over the whole group; the step matches one process);
    # with mixer_parallel="heads", the flat group of 2 that its head exchange needs.
    msg = _refusal(lambda: hf.apply(build_tiny("qwen3_5_text", TWO_HEADS)))
    assert "Qwen3_5Attention (2 query heads) cannot be split over 3 ranks" in msg, msg
    assert "group=ulysses_kernels.make_sp_groups(ulysses_size=1, ring_size=3)" in msg, msg
    _step_matches_one_process(build_tiny("qwen3_5_text", TWO_HEADS), ids, uk.make_sp_groups(ulysses_size=1, ring_size=3))
    msg = _refusal(lambda: hf.apply(build_tiny("qwen3_5_text", TWO_HEADS), mixer_parallel="heads"))
    assert "at most 2 ranks" in msg and "make_sp_groups(ulysses_size" not in msg, msg
    if rank < 2:
        _step_matches_one_process(build_tiny("qwen3_5_text", TWO_HEADS), ids, pair)

    # The model's own attention (a sliding window shorter than the sequence) on 2 heads: refused at the call.
    windowed = lambda: build_tiny("mistral", {**TWO_HEADS, "sliding_window": 4})  # noqa: E731
    model = hf.apply(windowed())
    msg = _refusal(lambda: model(**hf.shard_batch(ids, ids).model_inputs()))
    assert "2 query heads cannot be split over 3 ranks" in msg and "pass a flat sequence-parallel group of at most 2 ranks" in msg, msg
    assert "make_sp_groups(ulysses_size" not in msg, msg
    if rank < 2:
        _step_matches_one_process(windowed(), ids, pair)

    # Plain causal attention on 2 heads: the op suggests a 2-D group, and apply runs it on one.
    plain = lambda: build_tiny("llama", TWO_HEADS)  # noqa: E731
    model = hf.apply(plain())
    msg = _refusal(lambda: model(**hf.shard_batch(ids, ids).model_inputs()), uk.UlyssesInputError)
    assert "group=ulysses_kernels.make_sp_groups(ulysses_size=1, ring_size=3)" in msg, msg
    sp = uk.make_sp_groups(ulysses_size=1, ring_size=3)
    # 25 tokens do not split in equal shards: shard_batch says pad=True, and pad=True runs.
    odd = torch.cat([ids, ids[:, :1]], dim=1)
    msg = _refusal(lambda: hf.shard_batch(odd, odd, group=sp))
    assert msg.endswith("use pad=True"), msg
    _step_matches_one_process(plain(), ids, sp)
    _step_matches_one_process(plain(), odd, sp, pad=True)


def test_suggested_fixes_work_at_3_ranks():
    run_ranks(_job, 3)


def test_one_mixer_head_over_two_ranks_runs_with_state_passing():
    """The issue's case, one Gated DeltaNet head over 2 ranks: no head split helps; the head
    exchange's refusal names state passing, which "auto" (the default) picks."""
    model = build_tiny("qwen3_5_text", {"linear_num_key_heads": 1, "linear_num_value_heads": 1})
    msg = _refusal(lambda: plan_mixers(mixer_modules(model), 2, "heads"))
    assert "Qwen3_5GatedDeltaNet (1 heads, 1 groups) cannot be split over 2 ranks" in msg, msg
    assert "run it without sequence parallelism" in msg and "make_sp_groups(ulysses_size" not in msg, msg
    assert msg.endswith("(mixer_parallel='state' runs it: the sequence stays sharded)"), msg
    (_, _, strategy), *_ = plan_mixers(mixer_modules(model), 2)  # "auto": state passing (tests/test_state_passing.py runs it)
    assert strategy == "state"


def test_generate_is_refused_with_the_kv_cache_message_and_its_fix_works():
    """``model.generate`` after ``apply`` says generation/KV cache (the docs' words; before, the
    attention call's "called without a sequence shard"), and generating with the trained
    weights loaded into a model apply did not change, as it says, works; so does ``hf.unapply``."""
    ids = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(0))
    model = build_tiny("llama")
    before = copy.deepcopy(model)
    hf.apply(model)
    msg = _refusal(lambda: model.generate(ids, max_new_tokens=3, do_sample=False))
    assert msg.startswith("LlamaForCausalLM.generate: generation is not supported sequence-parallel: it keeps a KV cache"), msg
    assert "fresh.load_state_dict(model.state_dict())" in msg, msg
    fresh = build_tiny("llama", seed=1)
    fresh.load_state_dict(model.state_dict())
    got = fresh.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert got.shape == (1, 9) and torch.equal(got, before.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0))
    assert "hf.unapply(model) puts it back as built" in msg, msg  # the other fix: the same model, unswitched
    hf.unapply(model)
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0), got)


def test_the_docs_refused_example_is_the_real_error():
    """docs/hf.md's example of a refused model ("Never silently wrong") is the error ``apply``
    raises for it, word for word ("[...]": a part the docs leave out). Before, the docs showed
    Zamba, which apply runs."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "hf.md").read_text()
    block = doc.split("<!-- refused-example:", 1)[1].split("```", 2)[1]
    model_class = re.match(r"\s*apply: (\w+)ForCausalLM", block).group(1).lower()
    msg = _refusal(lambda: hf.apply(build_tiny(model_class)))
    pattern = ".*?".join(re.escape(" ".join(part.split())) for part in block.split("[...]"))
    assert re.fullmatch(pattern, " ".join(msg.split())), f"docs/hf.md:\n{block}\nthe real error:\n{msg}"
