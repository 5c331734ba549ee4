"""The README's main job, at a small size: it must pass its own check and print the plan."""

from ulysses_kernels import demo


def test_demo_runs_and_matches_the_reference(capfd):
    assert demo.main(["--world-size", "3", "--q-heads", "10", "--kv-heads", "2", "--seq", "11", "--batch", "2", "--head-dim", "8"]) == 0
    printed = capfd.readouterr().out
    assert "HeadPlan: 10 query heads, 2 KV heads (group 5), 3 ranks" in printed
    assert "ulysses_attention matches single-process attention" in printed
    assert "MISMATCH" not in printed
