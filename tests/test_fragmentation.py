"""KV-slot allocator simulation (kdlib.fragmentation) and the fragmentation suite's CPU parts."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlib import fragmentation as fr
from kdlib.perf.suites import fragmentation as suite


def test_allocator_fifo_appends_freed_slots_behind_unused_ones():
    a = fr.Allocator(8, "fifo")
    got = a.alloc(3)
    assert got.tolist() == [1, 2, 3]  # slot 0 is reserved, as in SGLang
    a.free([2])
    assert a.alloc(5).tolist() == [4, 5, 6, 7, 8]
    assert a.alloc(1).tolist() == [2]
    with pytest.raises(MemoryError):
        a.alloc(1)


def test_allocator_lifo_reuses_at_once_and_sorted_merges_when_short():
    a = fr.Allocator(8, "lifo")
    a.alloc(4)
    a.free([3, 1])
    assert a.alloc(2).tolist() == [3, 1]
    s = fr.Allocator(6, "sorted")
    s.alloc(4)
    s.free([4, 2])
    assert s.alloc(2).tolist() == [5, 6]  # the free list still holds them: no merge yet
    assert s.alloc(2).tolist() == [2, 4]  # short now: release list merged in ascending order
    assert s.available() == 0


def test_allocator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        fr.Allocator(8, "best-fit")
    with pytest.raises(ValueError, match="size"):
        fr.Allocator(0)


def test_layout_stats_contiguous_and_strided():
    c = fr.layout_stats(fr.contiguous_table(640, start=64))
    assert (c["runs"], c["mean_run"], c["pages_touched"], c["page_amplification"], c["page_fill"]) == (
        1,
        640,
        10,
        1,
        1,
    )
    s = fr.layout_stats(np.arange(0, 128, 2))  # every other slot: no two positions adjacent
    assert s["runs"] == 64 and s["mean_run"] == 1 and s["pages_touched"] == 2 and s["page_fill"] == 0.5
    with pytest.raises(ValueError):
        fr.layout_stats([])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=300, unique=True), st.sampled_from([1, 16, 64]))
def test_layout_stats_invariants(slots, page):
    s = fr.layout_stats(slots, page)
    n = len(slots)
    assert 1 <= s["runs"] <= n
    assert s["mean_run"] * s["runs"] == pytest.approx(n)
    assert s["pages_min"] <= s["pages_touched"] <= n
    assert 0 < s["page_fill"] <= 1 and s["page_amplification"] >= 1


def test_top1_chains_follow_first_children():
    chains = fr.top1_chains(budget=16, depth=6, trees=8, seed=3)
    assert len(chains) == 8
    for c in chains:
        assert 1 <= len(c) <= 6
        assert (np.diff(c) > 0).all() and c.min() >= 1 and c.max() <= 16  # parents pop before children


@pytest.mark.parametrize("policy", fr.POLICIES)
def test_simulation_tables_are_consistent(policy):
    sim = fr.simulate(requests=3, prompt_len=40, new_tokens=300, budget=16, depth=8, policy=policy, seed=1)
    assert len(sim.tables) == 6  # total defaults to two waves
    taus = np.array(sim.accepted)
    assert (taus >= 1).all() and (taus <= 9).all()
    for t in sim.tables:
        assert len(np.unique(t)) == len(t)  # a slot holds one position
        assert t.min() >= 1 and t.max() <= sim.pool_slots
        assert len(t) >= 40 + 150  # prompt + at least the shortest generation (jitter 0.5)
    summ = fr.summary(sim)
    assert summ["requests"] == 6 and summ["generated_mean_run"] >= 1


def test_simulation_live_requests_never_share_slots():
    # One wave, no reuse across requests that ran together: their tables must be disjoint.
    sim = fr.simulate(requests=4, total=4, prompt_len=16, new_tokens=200, budget=8, depth=6, seed=2)
    all_slots = np.concatenate(sim.tables)
    assert len(np.unique(all_slots)) == len(all_slots)


def test_simulation_is_deterministic_and_scatters_generated_slots():
    a = fr.simulate(requests=2, prompt_len=64, new_tokens=400, seed=5)
    b = fr.simulate(requests=2, prompt_len=64, new_tokens=400, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(a.tables, b.tables, strict=True))
    s = fr.summary(a)
    # budget 32: each step keeps ~3 of 33 verify slots, so generated positions cannot stay contiguous
    assert s["generated_mean_run"] < 4 and s["generated_page_amplification"] > 2
    # params holds the arguments; the mean tau drawn is its own key (accept_mean held it: 2.714 for 2.5)
    c = fr.simulate(requests=2, prompt_len=64, new_tokens=400, accept_mean=2.5, seed=0)
    assert c.params["accept_mean"] == 2.5 and c.params["realised_accept_mean"] == np.mean(c.accepted) != 2.5
    given = fr.simulate(requests=2, prompt_len=64, new_tokens=400, accepted=[1, 3], seed=0)
    assert given.params["accept_mean"] is None
    assert given.params["realised_accept_mean"] == np.mean(given.accepted)


def test_accept_one_keeps_only_roots():
    sim = fr.simulate(requests=1, total=1, prompt_len=0, new_tokens=50, budget=4, depth=4, accepted=[1],
                      length_jitter=0.0, pool_slots=1000)
    t = sim.tables[0]
    assert len(t) == 50 and (np.diff(t) == 5).all()  # fifo, fresh pool: one root per 5-slot block


@pytest.mark.parametrize("kw", [{"requests": 0}, {"budget": 0}, {"policy": "x"}, {"accept_mean": 0.5},
                                {"accepted": []}, {"length_jitter": 1.0}, {"requests": 4, "total": 2}])
def test_simulation_rejects_bad_arguments(kw):
    with pytest.raises(ValueError):
        fr.simulate(**kw)


def test_scattered_table():
    t = fr.scattered_table(1000, 8000, seed=1)
    assert len(np.unique(t)) == 1000 and t.max() < 8000
    with pytest.raises(ValueError):
        fr.scattered_table(10, 5)


def test_suite_layouts_and_costs_on_cpu():
    tables = suite.layouts(4096, seed=0)
    assert set(tables) == set(suite.LAYOUTS)
    for name, t in tables.items():
        assert t.shape == (4096,) and len(np.unique(t)) == 4096, name
    assert fr.layout_stats(tables["contiguous"])["runs"] == 1
    assert fr.layout_stats(tables["simulated"])["runs"] > 1
    c = suite.cost(8, 65, 4096)
    assert c["flops"] == 2.0 * 8 * 65 * 4096 * (576 + 512) and c["bytes"] > 4096 * 1152


@pytest.mark.gpu
def test_suite_runs_on_gpu(tmp_path):
    res = suite.run(quick=True)
    assert res["points"]
    for p in res["points"]:
        for name in suite.LAYOUTS:
            assert p["layouts"][name]["kernel"]["median_ms"] > 0
            assert p["layouts"][name]["rel_diff_vs_contiguous"] < 1e-2  # same keys, other slots: same output


def test_bad_samples_and_frees_are_refused():
    """Float or 2-D tau samples (floats were truncated: mean 2.55 for [2.9, 3.7]), a negative alloc (an
    empty array before) and a stray or double free (it grew the pool past its size) are ValueErrors."""
    for bad in ([2.9, 3.7], [[2, 3]], []):
        with pytest.raises(ValueError, match="accepted must be"):
            fr.simulate(requests=2, prompt_len=4, new_tokens=8, budget=4, depth=3, accepted=bad)
    fr.simulate(requests=2, prompt_len=4, new_tokens=8, budget=4, depth=3, accepted=[2.0, 3.0])
    a = fr.Allocator(10)
    with pytest.raises(ValueError, match="n must be"):
        a.alloc(-3)
    got = a.alloc(3)
    with pytest.raises(ValueError, match="not held"):
        a.free([9])
    a.free(got)
    with pytest.raises(ValueError, match="not held"):
        a.free(got[:1])
    assert a.available() == 10
