import itertools

import pytest

from ulysses_kernels import HeadPlan, PlanError


def _check_invariants(plan: HeadPlan):
    hq, hkv, P = plan.q_heads, plan.kv_heads, plan.world_size
    g = hq // hkv
    counts = [plan.q_count(r) for r in range(P)]
    assert sum(counts) == hq
    assert max(counts) - min(counts) <= 1 and min(counts) >= 1
    assert plan.q_ranges[0][0] == 0 and plan.q_ranges[-1][1] == hq
    for r in range(P - 1):
        assert plan.q_ranges[r][1] == plan.q_ranges[r + 1][0]
    for r in range(P):
        needed = sorted({h // g for h in range(*plan.q_ranges[r])})
        assert list(range(*plan.kv_ranges[r])) == needed
        assert all(0 <= j < plan.kv_ranges[r][1] - plan.kv_ranges[r][0] for j in plan.local_kv_map(r))
    for j in range(hkv):
        assert len(plan.kv_holders(j)) >= 1


def _kv_sent(counts, g):
    start, total = 0, 0
    for c in counts:
        total += (start + c - 1) // g - start // g + 1
        start += c
    return total


def _brute_min_kv_sent(hq, hkv, P):
    lo, n_hi = divmod(hq, P)
    best = None
    for hi_ranks in itertools.combinations(range(P), n_hi):
        counts = [lo + (r in hi_ranks) for r in range(P)]
        sent = _kv_sent(counts, hq // hkv)
        best = sent if best is None else min(best, sent)
    return best


def test_qwen25_14b_plans_at_every_sp():
    for sp in range(1, 41):
        plan = HeadPlan.build(40, 8, sp)
        _check_invariants(plan)
        # Every rank needs at least one KV head and every KV head one holder.
        assert plan.kv_sent >= max(sp, 8)


def test_qwen25_14b_sp16_table():
    plan = HeadPlan.build(40, 8, 16)
    assert [plan.q_count(r) for r in range(16)] == [3, 2] * 8
    assert plan.kv_sent == 16 and plan.kv_replication == 2.0
    table = plan.table()
    assert "40 query heads, 8 KV heads" in table and "16 ranks" in table
    assert table.count("\n") == 2 + 16


@pytest.mark.parametrize("hq,hkv", [(8, 8), (12, 4), (10, 2), (40, 8), (24, 3), (16, 1), (30, 6)])
def test_least_kv_replication_matches_brute_force(hq, hkv):
    for P in range(1, min(hq, 10) + 1):
        plan = HeadPlan.build(hq, hkv, P)
        _check_invariants(plan)
        assert plan.kv_sent == _brute_min_kv_sent(hq, hkv, P), (hq, hkv, P)


def test_even_layouts_have_no_replication():
    for hq, hkv, P in [(32, 8, 8), (32, 8, 4), (64, 8, 8), (32, 8, 2)]:
        plan = HeadPlan.build(hq, hkv, P)
        assert plan.kv_replication == 1.0 and plan.imbalance == 1.0 and plan.traffic_ratio == 1.0


def test_mqa_sends_the_kv_head_to_every_rank():
    plan = HeadPlan.build(8, 1, 8)
    assert plan.kv_holders(0) == tuple(range(8))
    assert all(plan.local_kv_map(r) == (0,) for r in range(8))


def test_uneven_gqa_local_map():
    plan = HeadPlan.build(10, 2, 4)
    assert plan.q_ranges == ((0, 3), (3, 5), (5, 8), (8, 10))
    assert plan.kv_ranges == ((0, 1), (0, 1), (1, 2), (1, 2))
    plan = HeadPlan.build(40, 8, 3)
    assert plan.kv_ranges[1] == (2, 6)
    assert plan.local_kv_map(1)[:3] == (0, 1, 1)


def test_large_world_has_no_recursion_limit():
    plan = HeadPlan.build(4096, 64, 2048)
    _check_invariants(plan)


@pytest.mark.parametrize(
    "args,match",
    [
        ((4, 2, 8), r"world_size \(8\) > q_heads \(4\)"),
        ((6, 4, 2), r"q_heads \(6\) must be a multiple of kv_heads \(4\)"),
        ((0, 1, 1), r"q_heads must be a positive int, got 0"),
        ((8, 2, 0), r"world_size must be a positive int, got 0"),
        ((8, 2.0, 2), r"kv_heads must be a positive int, got 2.0"),
    ],
)
def test_impossible_layouts_raise(args, match):
    with pytest.raises(PlanError, match=match):
        HeadPlan.build(*args)


def test_plans_are_values_not_global_state():
    assert HeadPlan.build(40, 8, 5) == HeadPlan.build(40, 8, 5)
    assert hash(HeadPlan.build(40, 8, 5)) == hash(HeadPlan.build(40, 8, 5))


def test_kv_group_size_and_its_deprecated_old_name():
    """A GQA group is a *KV group* (a "group" is a process group): ``kv_group_size``; the old
    ``group_size`` still answers, with a ``DeprecationWarning``."""
    plan = HeadPlan.build(40, 8, 16)
    assert plan.kv_group_size == 5 and HeadPlan.build(8, 1, 4).kv_group_size == 8 and HeadPlan.build(6, 6, 3).kv_group_size == 1
    with pytest.warns(DeprecationWarning, match="kv_group_size"):
        assert plan.group_size == 5
    assert "(KV group 5)" in plan.table().splitlines()[0]
