"""kdlib.perf.moe_ceiling: stream ceilings, the kernel/ceiling table and the 70% verdict, on synthetic
payloads built here and on the recorded H200 files (skipped when absent)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kdlib.perf
from kdlib.perf import moe_ceiling as mc

BW = 4.0e12  # synthetic copy bandwidth, B/s


def stream_payload(fracs: dict, two: dict | None = None, bw: float = BW) -> dict:
    """moe_stream-shaped payload: fracs = {m: [frac per configuration]} (None = a failed one)."""
    rows = []
    for m, per_cfg in fracs.items():
        for i, f in enumerate(per_cfg):
            row = {"config": f"c{i}", "warps_per_sm": 16, "size": f"M={m}", "bytes": 1000 * m,
                   "frac_copy_bw": f}
            if i == 0 and two and m in two:
                row["two_launch_frac_copy_bw"] = two[m]
            rows.append(row)
        rows.append(
            {"config": "c0", "warps_per_sm": 16, "size": "1GiB", "bytes": 1 << 30, "frac_copy_bw": 1.08}
        )
    sizes = {f"M={m}": 1000.0 * m for m in fracs} | {"1GiB": float(1 << 30)}
    return {"suite": "moe_stream", "copy_bandwidth_Bps": bw, "sizes": sizes, "stream": rows}


def moe_payload(arms: dict, bw: float = BW) -> dict:
    """moe-shaped payload: arms = {key prefix: {m: frac}}."""
    ms = sorted({m for per_m in arms.values() for m in per_m})
    rows = [{"m": m, "bytes": 1000.0 * m} | {f"{k}_frac_copy_bw": v[m] for k, v in arms.items() if m in v}
            for m in ms]
    return {"suite": "moe", "copy_bandwidth_Bps": bw, "rows": rows}


def test_stream_ceilings_best_config_and_two_launch():
    s = stream_payload({4: [0.8, 0.9, None], 1: [0.5, 0.6]}, two={1: 0.45})
    c = mc.stream_ceilings(s)
    assert list(c.m) == [1, 4]                             # sorted, the 1GiB reference left out
    assert list(c.one_launch) == [0.6, 0.9]
    assert list(c.n_configs) == [2, 2]                     # the failed configuration does not count
    assert c.one_launch_config.iloc[1] == "c1 w16"
    assert c.two_launch.iloc[0] == 0.45 and math.isnan(c.two_launch.iloc[1])


def test_stream_ceiling_nan_when_every_configuration_failed():
    c = mc.stream_ceilings(stream_payload({1: [None, None], 2: [0.7]}))
    assert math.isnan(c.one_launch.iloc[0]) and c.n_configs.iloc[0] == 0 and c.one_launch.iloc[1] == 0.7


@pytest.mark.parametrize("bad, match", [
    (None, "got NoneType"),
    ({"suite": "moe", "copy_bandwidth_Bps": BW, "rows": []}, "suite 'moe_stream', got suite 'moe'"),
    ({"suite": "moe_stream", "copy_bandwidth_Bps": BW, "sizes": {}}, "lacks stream"),
    ({"suite": "moe_stream", "copy_bandwidth_Bps": 0, "sizes": {}, "stream": []}, "positive"),
    ({"suite": "moe_stream", "copy_bandwidth_Bps": BW, "sizes": {"1GiB": 1.0}, "stream": []}, "no sizes"),
])
def test_stream_ceilings_rejects_other_payloads(bad, match):
    with pytest.raises(ValueError, match=match):
        mc.stream_ceilings(bad)


def test_table_rejects_swapped_payloads():
    s, m = stream_payload({1: [0.6]}), moe_payload({"kernel": {1: 0.3}})
    with pytest.raises(ValueError, match="suite 'moe', got suite 'moe_stream'"):
        mc.ceiling_table(s, m)
    with pytest.raises(ValueError, match="m_max"):
        mc.ceiling_table(m, s, m_max=0)


def test_absent_v3_arm_is_left_out_not_zero():
    s = stream_payload({1: [0.6], 2: [0.8]})
    m = moe_payload({"kernel": {1: 0.2, 2: 0.4}, "kernel_v2_graph": {1: 0.3, 2: 0.5}})
    t = mc.ceiling_table(m, s)
    assert mc.arms_present(m) == ["v1 eager", "v2 graph"]
    assert set(t.arm) == {"v1 eager", "v2 graph"} and len(t) == 4
    m3 = moe_payload({"kernel": {1: 0.2, 2: 0.4}, "kernel_v3": {2: 0.75}})
    t3 = mc.ceiling_table(m3, s)
    assert t3[t3.arm == "v3 eager"].m.tolist() == [2]      # measured only at M = 2: no M = 1 row
    with pytest.raises(ValueError, match="'v3 graph' has no rows"):
        mc.verdict(t3, "v3 graph")


def test_table_joins_ceiling_per_m_and_ratios_in_bytes_per_second():
    s = stream_payload({1: [0.5], 4: [0.8]}, two={1: 0.4}, bw=2 * BW)
    m = moe_payload({"kernel_v2_graph": {1: 0.25, 4: 0.4, 9: 0.6, 128: 0.7}})
    t = mc.ceiling_table(m, s).set_index("m")
    assert list(t.index) == [1, 4, 9]                      # m_max = 64 drops M = 128
    assert t.loc[1, "one_launch"] == 0.5 and t.loc[1, "two_launch"] == 0.4
    # the stream run measured twice the copy bandwidth: its bytes/s are twice its fraction's worth
    assert t.loc[1, "ratio_one_launch"] == pytest.approx(0.25 / (2 * 0.5))
    assert t.loc[1, "ratio_two_launch"] == pytest.approx(0.25 / (2 * 0.4))
    assert math.isnan(t.loc[4, "ratio_two_launch"])
    # not measured: NaN
    assert math.isnan(t.loc[9, "one_launch"]) and math.isnan(t.loc[9, "ratio_one_launch"])


def test_verdict_classifies_miss_above_ceiling_as_unreachable():
    s = stream_payload({1: [0.6], 2: [0.75], 4: [0.9], 32: [1.05]}, two={1: 0.5, 2: 0.65, 4: 0.8, 32: 1.0})
    m = moe_payload({"kernel_v2_graph": {1: 0.32, 2: 0.44, 4: 0.72, 9: 0.6, 32: 0.71, 64: 0.5}})
    v = mc.verdict(mc.ceiling_table(m, s), "v2 graph")
    assert v["met"] == [4, 32]
    assert v["unreachable"] == [1]                         # 70% is above the 60% a pure read reaches
    assert v["reachable"] == [2]
    assert v["no_ceiling"] == [9]
    assert 64 not in v["frac"]                             # the goal is for M <= 32
    v2 = mc.verdict(mc.ceiling_table(m, s), "v2 graph", ceiling="two_launch")
    assert v2["unreachable"] == [1, 2] and v2["reachable"] == []
    line = mc.format_verdict(v)
    assert "unreachable) at M = 1;" in line and "reachable at M = 2" in line and "M = 9" in line


def test_verdict_rejects_bad_arguments():
    t = mc.ceiling_table(moe_payload({"kernel": {1: 0.3}}), stream_payload({1: [0.6]}))
    with pytest.raises(ValueError, match="ceiling must be"):
        mc.verdict(t, "v1 eager", ceiling="three_launch")
    with pytest.raises(ValueError, match="goal"):
        mc.verdict(t, "v1 eager", goal=70)
    with pytest.raises(ValueError, match="arms in the table: \\['v1 eager'\\]"):
        mc.verdict(t, "v2 graph")


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from([1, 2, 4, 8, 9, 16, 32, 64]),
                       st.tuples(st.floats(0.05, 1.1), st.floats(0.05, 1.1), st.booleans()), min_size=1))
def test_verdict_partitions_the_goal_range(cases):
    s = stream_payload({m: [c] for m, (_, c, has) in cases.items() if has})
    if not any(has for _, _, has in cases.values()):
        s = stream_payload({1000: [1.0]})
    m = moe_payload({"kernel_v2": {m: k for m, (k, _, _) in cases.items()}})
    t = mc.ceiling_table(m, s)
    small = sorted(x for x in cases if x <= mc.GOAL_M_MAX)
    if not small:
        with pytest.raises(ValueError):
            mc.verdict(t, "v2 eager")
        return
    v = mc.verdict(t, "v2 eager")
    classes = [v[k] for k in ("met", "unreachable", "reachable", "no_ceiling")]
    assert sorted(x for c in classes for x in c) == small
    for x in small:
        k, c, has = cases[x]
        want = ("met" if k >= mc.GOAL_FRAC else "no_ceiling" if not has
                else "unreachable" if c < mc.GOAL_FRAC else "reachable")
        assert x in v[want]


# --- the recorded H200 files ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def recorded():
    s, m = kdlib.perf.load("moe_stream", "h200"), kdlib.perf.load("moe", "h200")
    if s is None or m is None:
        pytest.skip("data/results/moe_stream.h200.json or moe.h200.json not recorded")
    return m, s


def test_recorded_ceilings_cover_every_measured_m(recorded):
    _, s = recorded
    c = mc.stream_ceilings(s)
    assert list(c.m) == list(s["params"]["m_sizes"])
    assert (c.n_configs > 0).all()
    for r in c.itertuples():                               # the best is a measured row at that size
        assert r.one_launch == max(x["frac_copy_bw"] for x in s["stream"]
                                   if x["size"] == f"M={r.m}" and x["frac_copy_bw"] is not None)


def test_recorded_table_holds_exactly_the_arms_measured(recorded):
    m, s = recorded
    t = mc.ceiling_table(m, s)
    keys = set().union(*(r.keys() for r in m["rows"]))
    want = [name for name, key in mc.ARMS if f"{key}_frac_copy_bw" in keys]
    assert sorted(set(t.arm), key=[name for name, _ in mc.ARMS].index) == want
    assert t.m.max() <= 64
    for r in t.itertuples():
        row = next(x for x in m["rows"] if x["m"] == r.m)
        assert r.frac_copy_bw == row[f"{dict(mc.ARMS)[r.arm]}_frac_copy_bw"]


def test_recorded_verdicts_agree_with_the_raw_rows(recorded):
    m, s = recorded
    t = mc.ceiling_table(m, s)
    ceil = {int(k[2:]): None for k in s["sizes"] if k.startswith("M=")}
    for k in ceil:
        ceil[k] = max(x["frac_copy_bw"] for x in s["stream"] if x["size"] == f"M={k}" and x["frac_copy_bw"])
    for arm in mc.arms_present(m):
        v = mc.verdict(t, arm)
        key = dict(mc.ARMS)[arm] + "_frac_copy_bw"
        for row in m["rows"]:
            if row["m"] > mc.GOAL_M_MAX or row.get(key) is None:
                continue
            f, c = row[key], ceil.get(row["m"])
            want = ("met" if f >= mc.GOAL_FRAC else "no_ceiling" if c is None
                    else "unreachable" if c < mc.GOAL_FRAC else "reachable")
            assert row["m"] in v[want], (arm, row["m"], want)
