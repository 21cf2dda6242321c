"""The attention_gate suite's parts on the CPU: its points pass one round and stay within the order cap on an
H200's 132 CTAs, their predicted gains spread over the gate, the seeded ragged draw, the prediction against
the plan mirrors, and the threshold choice over measured rows."""

from __future__ import annotations

import numpy as np
import pytest

from kdlib.cuda import attention as cu
from kdlib.perf.suites import attention_gate as gate

GRID = 132  # the H200's SMs: the grid the points were chosen for


def test_every_point_passes_one_round_within_the_cap_and_the_gains_spread():
    pts = gate.points()
    pred = [gate.predicted(p, GRID) for p in pts]
    assert all(GRID < d["jobs"] <= cu._V10_ORDER_CAP for d in pred)
    gains = sorted(d["predicted_gain"] for d in pred)
    assert gains[0] <= 1.0 and gains[-1] > 1.1  # from none (the snake deal no lighter) to over 10 %
    # no wide hole up to 1.08, past the gate (1 + 1/64) by far; above it the chunks that count the tail tiles
    # (CHUNK_WITH_TAIL) left one point alone
    low = [g for g in gains if g <= 1.08]
    assert len(low) >= 20 and np.diff(low).max() < 0.015, "no wide hole in the predicted gains"
    built = cu.order_threshold()
    assert built == 1 + cu._V10_ORDER_GAIN / cu._V10_ORDER_UNIT
    assert {d["ordered_as_built"] for d in pred} == {True, False}
    assert all(d["ordered_as_built"] == (d["predicted_gain"] > built) for d in pred)
    assert max(sum(p["lens"]) if "lens" in p else p["prefix"] * p["batch"] for p in pts) <= 600_000


def test_ragged_batch_is_seeded_and_in_range():
    a, b = gate.ragged_batch(46), gate.ragged_batch(46)
    assert a == b and a != gate.ragged_batch(47)
    assert 4 <= a["batch"] == len(a["lens"]) == len(a["trees"]) <= 32
    assert a["queries"] in (9, 17, 33, 65) and a["heads"] == 8
    assert all(1000 <= n <= 131_072 for n in a["lens"])
    assert all(max(1, a["queries"] // 8) <= t <= a["queries"] for t in a["trees"])


def test_predicted_weighs_the_deals_as_the_plan_mirror_does():
    p = gate.ragged_batch(144)
    plan = cu.plan_v5(np.array(p["lens"]), np.array(p["trees"]), max(p["lens"]), p["queries"], 8, GRID)
    d = gate.predicted(p, GRID)
    order = cu.plan_order(plan, GRID)
    assert order is not None and d["ordered_as_built"]
    assert d["snake_busiest"] == cu.cta_loads(plan, cu.snake_deal(order, GRID)).max()
    assert d["static_busiest"] == cu.cta_loads(plan, cu.static_deal(int(plan[0]), GRID)).max()
    assert d["predicted_gain"] == pytest.approx(d["static_busiest"] / d["snake_busiest"])


def test_best_threshold_takes_the_snake_deal_only_where_it_measured_faster():
    rows = [{"predicted_gain": g, "static_ms": 1.0, "snake_ms": s}
            for g, s in ((1.0, 1.01), (1.01, 1.02), (1.02, 0.99), (1.04, 0.97), (1.08, 0.93))]
    v = gate.best_threshold(rows)
    assert v["threshold"] == 1.01  # above it every point measured faster dealt by size
    assert v["total_ms"] == pytest.approx(1.0 + 1.0 + 0.99 + 0.97 + 0.93)
    assert v["static_total_ms"] == 5.0
    assert v["built_threshold"] == cu.order_threshold()
    assert v["built_total_ms"] == pytest.approx(
        sum(r["snake_ms"] if r["predicted_gain"] > cu.order_threshold() else 1.0 for r in rows))


def test_time_arm_keeps_the_first_output_and_appends_one_median_a_point(monkeypatch):
    """suite.time_arm (this suite's and tools/kernel_ab.py's arms): a fresh workspace and a verify per point,
    the arm's first output kept across its repeats, one graph-replay median appended a call."""
    from types import SimpleNamespace

    from kdlib.perf.suites import _attention as base
    from kdlib.perf.suites import attention as suite

    made, seen = [], []
    monkeypatch.setattr(cu, "make_workspace", lambda b, q, h: made.append((b, q, h)) or len(made))

    def verify_call(x, pool, ws, **pick):
        seen.append((x["id"], ws, pick))
        return lambda pt: (np.full(2, 10.0 * x["id"] + len(seen)),)

    monkeypatch.setattr(suite, "verify_call", verify_call)
    monkeypatch.setattr(base, "graph_time", lambda rep, iters: SimpleNamespace(median_ms=len(rep) + iters))
    pts = [{"batch": 2, "queries": 9, "heads": 8}, {"batch": 1, "queries": 65, "heads": 16}]
    inputs = [{"id": 1, "tables": ["t0"]}, {"id": 2, "tables": ["t0", "t1"]}]
    times, outs = [{"a": []} for _ in pts], [{} for _ in pts]
    for _ in range(2):
        suite.time_arm("a", pts, inputs, None, times, outs, 20, version=10)
    assert made == [(2, 9, 8), (1, 65, 16)] * 2
    assert [s[0] for s in seen] == [1, 2, 1, 2] and all(s[2] == {"version": 10} for s in seen)
    assert [t["a"] for t in times] == [[21, 21], [22, 22]]
    assert outs[0]["a"].tolist() == [11.0, 11.0] and outs[1]["a"].tolist() == [22.0, 22.0], "the first kept"
