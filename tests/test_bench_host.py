"""The host benchmark (``python -m ulysses_kernels.bench.host``) runs at world 1 and on 2
gloo ranks, every row is right, and the structural claims behind its numbers hold: the
collectives one call posts (the op's two exchanges, ``check=True``'s one all-gather and
nothing else, the chain's four), and a call after the first resolves nothing (no plan, kernel
set or backend is looked up again). Timings are printed, never asserted: this machine is shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ulysses_kernels as uk
from ulysses_kernels.attention import call as call_module
from ulysses_kernels.attention import interface
from ulysses_kernels.bench import host
from ulysses_kernels.comm import LocalCommunicator
from ulysses_kernels.plan import HeadPlan


def _run(tmp_path: Path, world: int) -> dict:
    out = tmp_path / f"w{world}"
    assert host.main(["--spawn", str(world), "-w", "2", "-r", "4", "-n", "2", "--out-dir", str(out)]) == 0
    (path,) = [p for p in out.glob("bench_host_*.json") if not p.name.endswith("_latest.json")]
    doc = json.loads(path.read_text())
    assert doc["env"]["world_size"] == world and len(doc["env"]["load_average"]) == 3
    return {r["row"]: r for r in doc["rows"]} | {"meta": doc["meta"]}


@pytest.mark.parametrize("world", [1, 2])
def test_bench_host_rows_and_collectives(tmp_path, capfd, world):
    rows = _run(tmp_path, world)
    text = capfd.readouterr().out
    assert "# host time per call" in text and "resolve after the first call" in text and "load average" in text
    for name in host.ROWS:
        assert rows[name]["wrong"] == 0 and rows[name]["us_per_call"] > 0, rows[name]
    assert rows["op"]["resolve_pct"] is not None and rows["module"]["resolve_pct"] is not None
    # The chain: one all_to_all_single per tensor, q, k, v and the output, at any world size.
    assert rows["chain"]["collectives"] == "all_to_all_single:4"
    if world == 1:
        # Nothing leaves the rank; the check has no one to ask.
        assert rows["op"]["colls"] == rows["op+check"]["colls"] == rows["module"]["colls"] == 0
    else:
        # One collective per exchange (batch 1: all_to_all); check=True adds the one all-gather.
        assert rows["op"]["collectives"] == rows["module"]["collectives"] == "all_to_all_single:2"
        assert rows["op+check"]["collectives"] == rows["op+gather"]["collectives"] == "all_gather:1,all_to_all_single:2"
        assert rows["op+gather"]["wrong"] == 0 and rows["meta"]["signature_ints"] > 0
    if world == 1:
        assert "op+gather" not in rows


def test_a_call_after_the_first_resolves_nothing(monkeypatch):
    """The plan, the kernel set and the backend are resolved once per input signature: the
    functional op's later calls find them by value; the module's skip the set-up entirely."""
    counts = {"plan": 0, "kernels": 0, "backend": 0, "setup": 0}
    real_build, real_kernels, real_backend, real_setup = HeadPlan.build.__func__, call_module.get_kernels, call_module.backend_of, interface.setup_attention

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(HeadPlan, "build", classmethod(counted("plan", real_build)))
    monkeypatch.setattr(call_module, "get_kernels", counted("kernels", real_kernels))
    monkeypatch.setattr(call_module, "backend_of", counted("backend", real_backend))
    monkeypatch.setattr(interface, "setup_attention", counted("setup", real_setup))
    comm = LocalCommunicator()
    # The value caches emptied (a test that ran before may have resolved the same backend key:
    # sdpa, cpu, float32, this kv map), so that the first call resolves each piece.
    call_module._kept.cache_clear()
    q, k, v = torch.randn(1, 8, 6, 24), torch.randn(1, 8, 3, 24), torch.randn(1, 8, 3, 24)
    first = uk.ulysses_attention(q, k, v, comm=comm, attn_fn="sdpa")
    assert counts == {"plan": 1, "kernels": 1, "backend": 1, "setup": 1}, counts
    for _ in range(5):
        assert torch.equal(uk.ulysses_attention(q, k, v, comm=comm, attn_fn="sdpa"), first)
    assert counts == {"plan": 1, "kernels": 1, "backend": 1, "setup": 6}, counts  # set up, nothing resolved again
    layer = uk.UlyssesAttention(6, 3, comm=comm, attn_fn="sdpa")  # its plan: HeadPlan.build once more
    for _ in range(5):
        assert torch.equal(layer(q, k, v), first)
    # The module's first call only: its own plan makes a new call key, resolved once (backend and kernel set
    # with it: one resolution per key, attention.call.resolve).
    assert counts == {"plan": 2, "kernels": 2, "backend": 2, "setup": 7}, counts
    # A new signature is resolved once, and the old one is still found.
    layer(q[:, :4], k[:, :4], v[:, :4])
    layer(q, k, v)
    assert counts["setup"] == 8 and counts["plan"] == 2, counts


# ---- what one layer's data movement dispatches: ours against the peers' chain ---------------
# (q heads, kv heads, ranks, batch): GQA with KV heads over the ranks, MHA, batch 2 (the
# grouped send/recv path of both directions), and KV heads repeated by the chain (2 < 4).
LAYER_CASES = [(32, 8, 8, 1), (32, 32, 8, 1), (32, 8, 8, 2), (8, 2, 4, 1)]


@pytest.mark.parametrize("hq,hkv,world,batch", LAYER_CASES)
def test_layer_data_movement_dispatches_no_more_than_the_chain(hq, hkv, world, batch):
    # One layer fwd+bwd, rank 0, collectives replaced by nothing (bench.host.layer_exchange_counts:
    # SeqToHead/HeadToSeq's movers with the "cuda" set, its CPU twin here: the same host path).
    # Kernel launches, allocations, host syncs, collectives and every dispatched op (views
    # included: host time) of ours are at most the chain's, in each pass.
    pytest.importorskip("ulysses_kernels.kernels.cuda_kernels")
    from ulysses_kernels.kernels import available_kernels, get_kernels
    from ulysses_kernels.layout import Layout

    if "cuda" not in available_kernels():
        pytest.skip("ulysses_kernels._C is not built")
    lay = Layout(HeadPlan.build(hq, hkv, world), 0, (4,) * world, batch, 16)
    ours = host.layer_exchange_counts(lay, get_kernels("cuda", torch.device("cpu")))
    chain = host.chain_layer_counts(batch, 4, hq, hkv, world, 16)
    for p in ("fwd", "bwd"):
        for what in ("launch", "alloc", "sync", "ops"):
            assert ours[p][what] <= chain[p][what], (p, what, ours[p], chain[p])
        assert ours[p]["sync"] == 0 and ours[p]["launch"] == 2, ours[p]  # one pack and one unpack per pass
    assert ours["names"] == {"pack_s2h": 2, "unpack_h2s": 2}
    assert ours["collectives"] == 4 < chain["collectives"] == 8


def test_dispatch_count_sorts_ops_by_cost():
    x = torch.randn(4, 6)
    with host.DispatchCount() as c:
        y = x.view(24)  # a view
        z = x.t().contiguous()  # a view and a copy (clone: launch + allocation)
        y.add_(1)  # in place: a launch, no allocation
        torch.empty(3)  # an allocation, no launch
        float(z.sum())  # a launch and an allocation, then a copy back to the host (a sync)
    assert c.counts == {"ops": 7, "launch": 4, "alloc": 3, "view": 2, "sync": 1}, (c.counts, c.names)
    assert c.names == {"clone": 1, "add_": 1, "sum": 1, "_local_scalar_dense": 1}
