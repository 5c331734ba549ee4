"""The spawn helper itself: failures come back with the rank's traceback, hangs time out."""

import contextlib
import importlib.util
import os
import time

import pytest
import torch
import torch.distributed as dist

from ulysses_kernels.testing import RankPool, RanksFailed, run_ranks


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


# ---- the pool of live worlds (what the suite's run_ranks uses) ------------------------------
def _records_pid(rank, world, path):
    with open(f"{path}.{rank}", "w") as fh:
        fh.write(f"{os.getpid()} {os.environ.get('ULYSSES_KERNELS_POOL_PROBE', '')} {torch.get_default_dtype()}")
    torch.set_default_dtype(torch.float64)  # must not leak into the next call
    os.environ["ULYSSES_KERNELS_POOL_LEAK"] = "1"
    dist.all_reduce(torch.ones(1))


def _pids(path, world):
    return [open(f"{path}.{r}").read().split(" ") for r in range(world)]


def _makes_a_group(rank, world, destroy):
    group = dist.new_group(list(range(world)))
    dist.all_reduce(torch.ones(1), group=group)
    if destroy:
        dist.destroy_process_group(group)


def test_a_call_that_leaves_process_groups_ends_its_world(tmp_path):
    """A group left behind keeps a gloo thread polling on every rank for the rest of the run, and
    a peer may keep it in a module global: the pool ends that world, and the next call gets new
    processes. A call that destroys what it made keeps its world."""
    with RankPool(timeout_s=60) as pool:
        pool.run(_records_pid, 2, str(tmp_path / "a"))
        pool.run(_makes_a_group, 2, True)
        pool.run(_records_pid, 2, str(tmp_path / "b"))
        assert [p[0] for p in _pids(tmp_path / "b", 2)] == [p[0] for p in _pids(tmp_path / "a", 2)]
        pool.run(_makes_a_group, 2, False)
        assert pool.world_sizes == []
        pool.run(_records_pid, 2, str(tmp_path / "c"))
        assert {p[0] for p in _pids(tmp_path / "c", 2)}.isdisjoint(p[0] for p in _pids(tmp_path / "a", 2))


def _leak_check(rank, world):
    assert "ULYSSES_KERNELS_POOL_LEAK" not in os.environ
    assert torch.get_default_dtype() == torch.float32


def _sets_peers_state(rank, world):
    from accelerate.state import PartialState
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    _sets_peers_state.config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})  # kept alive
    assert is_deepspeed_zero3_enabled()
    assert PartialState().initialized


def _peers_state_gone(rank, world):
    from accelerate.state import PartialState
    from transformers.integrations import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()  # from_pretrained would build under zero.Init
    assert not PartialState._shared_state, PartialState._shared_state


def _fails_everywhere(rank, world):
    dist.all_reduce(torch.ones(1))
    raise ValueError(f"rank {rank} says no")


def _dies_on_rank_0(rank, world):
    if rank == 0:
        os._exit(3)
    dist.barrier()


def test_a_pool_reuses_its_world_and_recovers_from_failures_and_hangs(tmp_path, monkeypatch):
    with RankPool(timeout_s=60) as pool:
        monkeypatch.setenv("ULYSSES_KERNELS_POOL_PROBE", "first")
        pool.run(_records_pid, 2, str(tmp_path / "a"))
        first = _pids(tmp_path / "a", 2)
        assert [f[1:] for f in first] == [["first", "torch.float32"]] * 2  # the caller's environment, a fresh dtype
        pool.run(_leak_check, 2)  # the previous call's dtype and environment are gone
        if importlib.util.find_spec("transformers") and importlib.util.find_spec("accelerate"):
            pool.run(_sets_peers_state, 2)
            pool.run(_peers_state_gone, 2)  # the peers' process-wide settings too
        monkeypatch.setenv("ULYSSES_KERNELS_POOL_PROBE", "second")
        pool.run(_records_pid, 2, str(tmp_path / "b"))
        second = _pids(tmp_path / "b", 2)
        assert [s[0] for s in second] == [f[0] for f in first]  # the same processes
        assert {s[1] for s in second} == {"second"}
        # An error raised on every rank comes back with each rank's traceback; the world (the
        # same processes, a new process group) goes on.
        with pytest.raises(RanksFailed, match="(?s)rank 0 raised.*rank 0 says no.*rank 1 raised.*rank 1 says no"):
            pool.run(_fails_everywhere, 2)
        pool.run(_records_pid, 2, str(tmp_path / "c"))
        assert [c[0] for c in _pids(tmp_path / "c", 2)] == [f[0] for f in first]
        # One rank's failure leaves its peer waiting in a collective: that world is ended.
        with pytest.raises(RanksFailed, match="(?s)rank 1 raised.*rank 1 says no"):
            pool.run(_fails_on_rank_1, 2)
        pool.run(_records_pid, 2, str(tmp_path / "c2"))
        assert {c[0] for c in _pids(tmp_path / "c2", 2)}.isdisjoint(f[0] for f in first)
        # A hang is ended at the call's deadline; the next call gets a new world.
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish"):
            pool.run(_sleeps, 2, timeout_s=1)
        assert time.monotonic() - start < 60
        pool.run(_records_pid, 2, str(tmp_path / "d"))
        after_hang = [d[0] for d in _pids(tmp_path / "d", 2)]
        assert set(after_hang).isdisjoint(f[0] for f in first)
        # A rank that dies is reported by name; the next call gets a new world.
        with pytest.raises(RanksFailed, match="rank 0 died: process exited with code 3"):
            pool.run(_dies_on_rank_0, 2, timeout_s=30)
        pool.run(_records_pid, 2, str(tmp_path / "e"))
        assert {e[0] for e in _pids(tmp_path / "e", 2)}.isdisjoint(after_hang)


def test_a_pool_keeps_at_most_its_processes(tmp_path):
    with RankPool(timeout_s=60, max_processes=4) as pool:
        pool.run(_records_pid, 1, str(tmp_path / "a"))
        pool.run(_records_pid, 2, str(tmp_path / "b"))
        assert pool.world_sizes == [1, 2]
        pool.run(_records_pid, 1, str(tmp_path / "a2"))  # the world of 1 used again: the world of 2 is now the oldest
        assert _pids(tmp_path / "a2", 1)[0][0] == _pids(tmp_path / "a", 1)[0][0]
        pool.run(_records_pid, 3, str(tmp_path / "c"))  # 1 + 2 + 3 > 4: the least recently used world closes
        assert pool.world_sizes == [1, 3]


def test_run_ranks_fresh_spawns_new_processes(tmp_path):
    run_ranks(_records_pid, 2, str(tmp_path / "a"))
    run_ranks(_records_pid, 2, str(tmp_path / "b"), fresh=True)
    assert {p[0] for p in _pids(tmp_path / "a", 2)}.isdisjoint(p[0] for p in _pids(tmp_path / "b", 2))


def _what_a_rank_sees(rank, world, path):
    import sys

    with open(f"{path}.{rank}", "w") as fh:
        fh.write(f"{os.environ.get('ULYSSES_KERNELS_POOL_PROBE', '')}|{os.getcwd()}|{'torch' in sys.modules}|{sys.path[0]}")


def test_fresh_ranks_from_the_fork_server_see_the_caller_as_it_is_now(tmp_path, monkeypatch):
    """Fresh ranks start from multiprocessing's fork server (``rank_context``), whose own
    environment is that of its start: a rank must still see the caller's environment, working
    directory and sys.path as they are at the call, as a spawned rank would."""
    run_ranks(_what_a_rank_sees, 2, str(tmp_path / "a"), fresh=True)  # the server runs from here on
    monkeypatch.setenv("ULYSSES_KERNELS_POOL_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "first"))
    run_ranks(_what_a_rank_sees, 2, str(tmp_path / "b"), fresh=True)
    for rank in range(2):
        seen = (tmp_path / f"b.{rank}").read_text().split("|")
        assert seen == ["set after the server started", str(tmp_path), "True", str(tmp_path / "first")], seen


def test_rank_start_is_checked(monkeypatch):
    from ulysses_kernels.testing import rank_context

    assert rank_context().get_start_method() == ("spawn" if torch.cuda.is_available() else "forkserver")
    monkeypatch.setenv("ULYSSES_KERNELS_RANK_START", "spawn")
    assert rank_context().get_start_method() == "spawn"
    monkeypatch.setenv("ULYSSES_KERNELS_RANK_START", "fork")
    with pytest.raises(ValueError, match="ULYSSES_KERNELS_RANK_START must be 'forkserver' or 'spawn', got 'fork'"):
        rank_context()


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


def _prints(rank, world):
    print(f"rank {rank} says hello", flush=rank == 0)  # rank 1's line reaches the caller unflushed too


def test_a_pool_writes_to_the_callers_output_as_it_is_now(capfd):
    # A test's captured output is the caller's fd 1 at the call, not at the world's start.
    with RankPool(timeout_s=60) as pool:
        pool.run(_prints, 2)
        out = capfd.readouterr().out
        assert "rank 0 says hello" in out and "rank 1 says hello" in out
        pool.run(_prints, 2)
        assert capfd.readouterr().out.count("says hello") == 2


def _computed_once_job(rank, world):
    from ulysses_kernels.testing.reference import ComputedElsewhereError, computed_once

    ran = []

    def thunk(i):
        def run():
            ran.append(i)
            return torch.full((2,), float(i)), f"computed by rank {rank}"

        return run

    got = computed_once([thunk(i) for i in range(5)], first=1)
    # Every rank holds every result; thunk i ran on rank (1 + i) % world only.
    assert [int(t[0]) for t, _ in got] == list(range(5)), got
    assert [who for _, who in got] == [f"computed by rank {(1 + i) % world}" for i in range(5)], got
    assert ran == [i for i in range(5) if (1 + i) % world == rank], ran

    def fails():
        raise ValueError("no reference here\nsecond line")

    # A thunk that raises on one rank raises on every rank, the same text, and the next collective still pairs.
    with pytest.raises(ComputedElsewhereError, match=r"^ValueError: no reference here$") as e:
        computed_once([lambda: 0, fails, lambda: 2])
    assert (e.value.rank, e.value.index) == (1 % world, 1)
    assert computed_once([lambda: rank]) == [0]


def test_computed_once_spreads_the_thunks_and_raises_everywhere():
    run_ranks(_computed_once_job, 3)
    # Without torch.distributed: every thunk here, and the same error as on ranks.
    from ulysses_kernels.testing.reference import ComputedElsewhereError, computed_once

    assert computed_once([lambda: 1, lambda: 2]) == [1, 2]
    with pytest.raises(ComputedElsewhereError, match=r"^ZeroDivisionError: division by zero$"):
        computed_once([lambda: 1, lambda: 1 / 0])
