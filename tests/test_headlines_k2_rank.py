"""kdlib.headlines.k2_rank_figures: the seeds' step figures re-read on a k2_rank payload (notebook 03b and
the audit both call it), on a synthetic payload whose answers are known and on the recorded file."""

import pytest

from kdlib import audit, headlines, hw, perf

BUDGETS = (None, 8, 16)


def _row(ctx, c, b, step, *, ar=1.0, attention=1.0, moe=2.0, moe_floor=1.0, compiled=True, dropped=0):
    tau = 4 if b else 1
    return {"context": ctx, "streams": c, "budget": b, "method": "ddtree" if b else "ar",
            "compiled": compiled, "moe_bound_overflows": dropped, "step_ms": step,
            "allreduce_modelled_ms": ar, "step_with_allreduce_ms": step + ar, "accepted_mean": tau,
            "tok_s_per_stream": tau / (step + ar) * 1e3, "tok_s": c * tau / (step + ar) * 1e3,
            "components_ms": {"moe": moe, "attention": attention, "dense": 1.0},
            "floors": {"moe": {"floor_ms": moe_floor}}}


def synthetic(c10_scale=2.0) -> dict:
    """Steps of 10 ms + 1 ms per budget node at C = 1 (9 ms + 1 of all-reduce at 128 tokens, so 5.5k is
    10 / 9 of 128 with attention 1 ms longer); C = 10 costs `c10_scale` x the C = 1 step (all-reduce
    included); a plain (not compiled) 5.5k C = 1 AR row twice as slow, which the grid must skip."""
    rows = [_row(5500, 1, None, 40.0, compiled=False)]
    for b in BUDGETS:
        n = b or 0
        rows.append(_row(128, 1, b, 8.0 + n, attention=1.0))
        rows.append(_row(5500, 1, b, 9.0 + n, attention=2.0, moe=3.0, moe_floor=1.5))
        rows.append(_row(5500, 10, b, c10_scale * (10.0 + n) - 1.0, moe=6.0, moe_floor=4.0))
    return {"parameters": {"accepted": 4}, "rows": rows, "_path": "synthetic",
            "provenance": {"gpu": "NVIDIA H200", "commit": "0" * 10, "date": "d", "command": "c"}}


def test_grid_keeps_the_compiled_rows_only():
    g = headlines.k2_rank_grid(synthetic())
    assert g[5500, 1, None]["step_ms"] == 9.0 and all(r["compiled"] for r in g.values())
    plain = {"rows": [_row(5500, 1, None, 40.0, compiled=False)]}
    assert headlines.k2_rank_grid(plain)[5500, 1, None]["step_ms"] == 40.0  # a run without torch.compile


def test_figures_on_a_synthetic_payload():
    k = headlines.k2_rank_figures(synthetic())
    assert k["budgets"] == [8, 16] and k["accepted"] == 4
    assert k["verify_ms"][1] == {None: 10.0, 8: 18.0, 16: 26.0}
    assert k["verify_ms"][10][16] == pytest.approx(2.0 * 26.0)
    assert k["growth"][None] == pytest.approx(10.0 / 9.0) and k["growth"][16] == pytest.approx(26.0 / 25.0)
    assert k["attention_growth_ms"] == {None: 1.0, 8: 1.0, 16: 1.0}
    assert all(v == pytest.approx(2.0) for v in k["c10_over_c1"].values())
    assert k["moe_share"][1, 8] == pytest.approx(3.0 / 17.0)
    assert k["moe_over_floor"][1, None] == 2.0 and k["moe_over_floor"][10, 16] == 1.5
    assert k["c10_over_c1_lower"] == {}
    assert k["service"][10, 16] == (pytest.approx(4 / 52.0 * 1e3), pytest.approx(40 / 52.0 * 1e3))
    assert set(k["service"]) == {(c, b) for c in (1, 10) for b in BUDGETS}  # 5.5k rows only


def test_b300_bounds_on_a_synthetic_payload():
    ratio = hw.load("b300")["hbm_bandwidth_Bps"] / hw.load("h200")["hbm_bandwidth_Bps"]
    b = headlines.k2_rank_b300(synthetic())
    assert set(b) == {(c, x) for c in (1, 10) for x in BUDGETS}
    one = b[1, 16]  # step 25 ms + 1 ms of all-reduce, tau 4
    assert one["ratio"] == pytest.approx(ratio) and one["unscaled_ms"] == 26.0
    assert one["scaled_ms"] == pytest.approx(25.0 / ratio + 1.0)
    assert one["tok_s_scaled"] == pytest.approx(4e3 / (25.0 / ratio + 1.0)) and one["tok_s_unscaled"] == (
        pytest.approx(4e3 / 26.0))
    doc = synthetic()
    doc["rows"][-1]["moe_bound_overflows"] = 3  # the 5.5k C = 10 budget-16 row
    assert (10, 16) not in headlines.k2_rank_b300(doc) and (1, 16) in headlines.k2_rank_b300(doc)


def test_rows_whose_moe_dropped_slots_are_left_out():
    doc = synthetic()
    for r in doc["rows"]:
        if (r["context"], r["streams"], r["budget"]) in ((128, 1, 16), (5500, 10, 8)):
            r["moe_bound_overflows"] = 60
    assert sorted(headlines.k2_rank_dropped(doc)) == [(128, 1, 16), (5500, 10, 8)]
    k = headlines.k2_rank_figures(doc)
    assert set(k["growth"]) == set(k["attention_growth_ms"]) == {None, 8}  # 16 lacks its 128-token row
    assert set(k["verify_ms"][1]) == {None, 8, 16} and set(k["verify_ms"][10]) == {None, 16}
    assert set(k["c10_over_c1"]) == {None, 16} and (10, 8) not in k["moe_share"]
    assert k["c10_over_c1_lower"] == {8: pytest.approx((2.0 * 18.0) / 18.0)}  # a lower bound, kept apart
    assert (10, 8) not in k["service"] and (1, 8) in k["service"]
    doc["rows"] = [r for r in doc["rows"] if (r["context"], r["streams"]) != (128, 1)]  # not recorded
    assert headlines.k2_rank_figures(doc)["growth"] == {}


def test_the_per_step_cost_of_c10_decides_the_baseline_verdict():
    cat = audit.catalogue()
    c1, c10 = cat.claim("diag_baseline_c1_c10")
    seed_ratio = 10 * c1 / c10
    fig = cat["diag_baseline_c1_c10"]
    for scale, verdict in ((seed_ratio, audit.READING), (seed_ratio * 1.5, audit.OUT_OF_REACH),
                           (seed_ratio / 1.5, audit.OUT_OF_REACH)):
        v = audit.run_one(fig, cat, audit.Sources(results={"k2_rank.h200": synthetic(scale)}))
        assert v.verdict == verdict, scale
        assert v.values["seed_ratio"] == pytest.approx(seed_ratio)
        assert "synthetic" in v.sources[-1]
    assert audit.run_one(fig, cat, audit.Sources(results={})).verdict == audit.OUT_OF_REACH


def test_the_rank_adds_its_measurement_to_the_step_and_moe_verdicts():
    cat = audit.catalogue()
    src = audit.Sources(results={"k2_rank.h200": synthetic()})
    step = audit.run_one(cat["diag_step_34_144"], cat, src)
    assert step.verdict == audit.CONTRADICTED  # the seeds' own figures decide it; the rank adds where from
    assert step.values["rank_attention_growth_ms"] == 1.0 and "+1.00 ms" in step.ours
    assert step.values["rank_growth"] == pytest.approx(10.0 / 9.0)
    moe = audit.run_one(cat["moe_share_step_80_90"], cat, src)
    assert moe.verdict == audit.CONTRADICTED
    assert moe.values["rank_moe_share_max"] == pytest.approx(3.0 / 9.0)  # C = 1 AR: 3 of 9 ms
    assert moe.values["rank_moe_over_floor"][1, 8] == 2.0
    every_row_dropped = synthetic()
    for r in every_row_dropped["rows"]:
        r["moe_bound_overflows"] = 1
    src = audit.Sources(results={"k2_rank.h200": every_row_dropped})
    expect = {"diag_baseline_c1_c10": audit.OUT_OF_REACH, "diag_step_34_144": audit.CONTRADICTED,
              "moe_share_step_80_90": audit.CONTRADICTED}
    for fid, verdict in expect.items():
        v = audit.run_one(cat[fid], cat, src)
        assert v.verdict == verdict and "dropped slots" in v.reason and "rank_" not in " ".join(v.values), fid


def test_figures_on_the_recorded_file():
    doc = perf.load("k2_rank", "h200")
    if doc is None:
        pytest.skip("no data/results/k2_rank.h200.json recorded")
    k = headlines.k2_rank_figures(doc)
    g = headlines.k2_rank_grid(doc)
    assert k["budgets"] == sorted({b for _, _, b in g if b is not None})
    for c, by_b in k["verify_ms"].items():
        for b, ms in by_b.items():
            assert ms == g[headlines.K2_SEED_CONTEXT, c, b]["step_with_allreduce_ms"] > 0
            assert g[headlines.K2_SEED_CONTEXT, c, b]["moe_bound_overflows"] == 0
    # one rank's step costs more at 5.5k than at 128 tokens of context, and more at C = 10 than at C = 1
    assert all(v > 1 for v in k["growth"].values()) and all(v > 1 for v in k["c10_over_c1"].values())
    assert all(0 < v < 1 for v in k["moe_share"].values())


def _c10_at(doc, budget, ratio, dropped=0):
    """Set the 5.5k C = 10 row of `budget` to `ratio` x its C = 1 step (all-reduce included)."""
    g = headlines.k2_rank_grid(doc)
    row, one = g[5500, 10, budget], g[5500, 1, budget]
    row["step_ms"] = ratio * one["step_with_allreduce_ms"] - row["allreduce_modelled_ms"]
    row["step_with_allreduce_ms"] = ratio * one["step_with_allreduce_ms"]
    row["moe_bound_overflows"] = dropped


def test_the_seeds_block_bracketed_when_its_c10_row_dropped_slots():
    cat = audit.catalogue()
    c1, c10 = cat.claim("diag_baseline_c1_c10")
    seed = 10 * c1 / c10
    fig = cat["diag_baseline_c1_c10"]

    def verdict(ar, lower8, dd16, dd32=None):
        doc = synthetic()
        _c10_at(doc, None, ar * seed)
        _c10_at(doc, 8, lower8 * seed, dropped=42)
        _c10_at(doc, 16, dd16 * seed)
        if dd32 is not None:  # a budget-32 tree at the three points the figures read
            doc["rows"] += [_row(128, 1, 32, 40.0), _row(5500, 1, 32, 41.0, attention=2.0),
                            _row(5500, 10, 32, 1.0)]
            _c10_at(doc, 32, dd32 * seed)
        return audit.run_one(fig, cat, audit.Sources(results={"k2_rank.h200": doc}))

    v = verdict(0.6, 0.9, 1.05)  # budget 8 at least 0.9 x, at most budget 16's 1.05 x: the seeds' inside
    assert v.verdict == audit.READING and "its own lower bound" in v.reason
    assert v.values["rank_bracket"] == (pytest.approx(0.9 * seed), pytest.approx(1.05 * seed))
    assert v.values["rank_c10_over_c1_lower"] == {8: pytest.approx(0.9 * seed)}
    assert verdict(0.6, 0.5, 1.05).values["rank_bracket"][0] == pytest.approx(0.6 * seed)  # AR the tighter
    assert verdict(0.6, 0.9, 0.95).verdict == audit.OUT_OF_REACH  # the seeds' above budget 16
    assert verdict(0.6, 1.02, 1.05).verdict == audit.OUT_OF_REACH  # budget 8 costs more than the seeds'
    flat = verdict(1.2, 0.9, 1.05)  # AR dearer than budget 16: no bracket from a cost that does not grow
    assert flat.verdict == audit.OUT_OF_REACH and "not growing" in flat.reason
    beyond = verdict(0.6, 0.9, 1.05, dd32=1.0)  # a larger tree cheaper than 16 does not bear on budget 8
    assert beyond.verdict == audit.READING and beyond.values["rank_bracket"] == v.values["rank_bracket"]


def test_the_baseline_verdict_on_the_recorded_file():
    doc = perf.load("k2_rank", "h200")
    if doc is None:
        pytest.skip("no data/results/k2_rank.h200.json recorded")
    cat = audit.catalogue()
    v = audit.run_one(cat["diag_baseline_c1_c10"], cat, audit.Sources(results={"k2_rank.h200": doc}))
    k = headlines.k2_rank_figures(doc)
    assert v.values["rank_c10_over_c1"] == k["c10_over_c1"]
    seed = v.values["seed_ratio"]
    if "rank_at_block" in v.values:
        assert (v.verdict == audit.READING) == (abs(v.values["rank_at_block"] / seed - 1) <= 0.10)
    else:
        lo, hi = v.values["rank_bracket"]
        assert (v.verdict == audit.READING) == (lo <= seed <= hi)


def _frag(slowdown):
    return {"points": [{"layouts": {"contiguous": {"kernel_slowdown_vs_contiguous": 1.0},
                                    "random": {"kernel_slowdown_vs_contiguous": slowdown}}}],
            "provenance": {"commit": "f" * 40}}


def test_sustained_gap_on_a_synthetic_payload():
    """C = 1 steps with all-reduce: 9 + n ms at 128 tokens, 10 + n at 5.5k; the probes' steps lie on that
    line at their mean contexts; fragmentation scales the attention's share (2 of 9 + n ms at 5.5k)."""
    kw = dict(two_point_context=5120, sustained_prompt=3200, sustained_generated=1500, gap=2.0)
    out = headlines.k2_rank_sustained_gap(synthetic(), None, **kw)
    assert out["frag_slowdown"] == 1.0 and "no fragmentation result" in out["frag_source"]
    assert set(out["methods"]) == set(BUDGETS)
    m = out["methods"][8]
    line = 5500 - 128  # ms per token of context: 1 / line

    def at(x):
        return 17.0 + (x - 128) / line

    assert m["two_point_ms"] == pytest.approx(at(5120 + 136)) and m["sustained_ms"] == pytest.approx(at(3950))
    assert m["frag_factor"] == 1.0 and m["step_ratio"] == pytest.approx(at(3950) / at(5256))
    assert m["accept_ratio"] == pytest.approx(2.0 / m["step_ratio"])
    f = headlines.k2_rank_sustained_gap(synthetic(), _frag(1.5), **kw)
    assert f["frag_slowdown"] == 1.5 and "fffffff" in f["frag_source"]
    assert f["methods"][None]["frag_factor"] == pytest.approx(1 + 0.5 * 2.0 / 9.0)
    assert f["methods"][None]["step_ratio"] == pytest.approx(
        out["methods"][None]["step_ratio"] * (1 + 0.5 * 2.0 / 9.0))
    doc = synthetic()
    for r in doc["rows"]:
        if (r["context"], r["streams"], r["budget"]) == (128, 1, 16):
            r["moe_bound_overflows"] = 5
    assert set(headlines.k2_rank_sustained_gap(doc, None, **kw)["methods"]) == {None, 8}


def test_the_rank_adds_the_step_part_of_the_two_point_gap():
    cat = audit.catalogue()
    fig = cat["diag_overestimate_2x"]
    bare = audit.run_one(fig, cat, audit.Sources(results={}))
    v = audit.run_one(fig, cat, audit.Sources(results={"k2_rank.h200": synthetic(),
                                                       "fragmentation.h200": _frag(1.01)}))
    assert v.verdict == bare.verdict  # the seeds' figures and the engine's diagnosis decide it
    steps, accept = v.values["rank_step_ratio"], v.values["rank_accept_ratio"]
    assert set(steps) == set(BUDGETS) and all(s < 1 for s in steps.values())  # shorter context, faster
    assert accept[16] == pytest.approx(v.values["ratio"] / steps[16])
    assert "carries none of the gap" in v.reason and len(v.sources) == len(bare.sources) + 2
