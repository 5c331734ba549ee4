"""The spawn helper itself: failures come back with the rank's traceback, hangs time out."""

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

from ulysses_kernels.testing import RanksFailed, run_ranks


def _fails_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank 1 says no")


def _rank_1_skips_the_collective(rank, world):
    if rank == 0:
        dist.barrier()


def _sleeps(rank, world):
    time.sleep(60)


def test_a_failure_is_reraised_with_its_message():
    # Rank 0's final barrier fails too once rank 1 is gone; rank 1's own error must show.
    with pytest.raises(RanksFailed, match="(?s)rank 1 raised.*rank 1 says no"):
        run_ranks(_fails_on_rank_1, 2)


def test_a_collective_that_one_rank_skips_does_not_hang():
    # Rank 0 waits in a barrier that rank 1 never joins (it joins the final one instead,
    # which pairs with rank 0's): whatever happens, the call returns or raises in time.
    start = time.monotonic()
    with contextlib.suppress(Exception):  # either outcome is fine, a hang is not
        run_ranks(_rank_1_skips_the_collective, 2, timeout_s=5)
    assert time.monotonic() - start < 90


def test_a_rank_that_never_returns_is_killed():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        run_ranks(_sleeps, 2, timeout_s=1)
    assert time.monotonic() - start < 60


def _says_its_transport(rank, world, path):
    if rank == 0:
        with open(path, "w") as fh:
            fh.write(dist.get_backend())


def test_the_transport_keyword_and_its_old_spelling(tmp_path):
    # The group's transport (torch's "backend") is `transport=`; `backend=` still works, with a warning.
    run_ranks(_says_its_transport, 2, str(tmp_path / "new"), transport="gloo")
    assert (tmp_path / "new").read_text() == "gloo"
    with pytest.warns(DeprecationWarning, match=r"run_ranks\(backend=\.\.\.\) is now run_ranks\(transport=\.\.\.\)"):
        run_ranks(_says_its_transport, 2, str(tmp_path / "old"), backend="gloo")
    assert (tmp_path / "old").read_text() == "gloo"


def test_build_tiny_is_public_and_builds_the_readme_hybrid():
    """The README's first example builds its hybrid with ``ulysses_kernels.testing.build_tiny``
    (no config from testing/hybrids.py needed): a Qwen3.5 with both of its token mixers."""
    pytest.importorskip("transformers")
    from ulysses_kernels import testing

    assert "build_tiny" in testing.__all__
    model = testing.build_tiny("qwen3_5_text")
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.dtype == torch.float64 and model.training
    assert set(model.config.layer_types) == {"linear_attention", "full_attention"}, model.config.layer_types
    assert sum(p.numel() for p in model.parameters()) < testing.tiny_models.MAX_PARAMETERS
    again = testing.build_tiny("qwen3_5_text")  # seeded: the same weights on every rank
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    with pytest.raises(testing.NotBuildable):
        testing.build_tiny("qwen3_5")  # a multimodal wrapper: the reason is given, nothing built
