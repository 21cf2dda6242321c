"""kdlib.perf.results' typed loaders, one per recorded suite, over the committed data/results files:
row counts and one figure per suite read back from the raw JSON, typed shapes, SchemaError on a file
of another schema, None where no file is recorded."""

from __future__ import annotations

import functools
import json
import math

import pytest

from kdlib import DATA
from kdlib.cuda import attention
from kdlib.perf import results


def _raw(name: str) -> dict:
    """A committed result file as plain JSON, not through kdlib."""
    return json.loads((DATA / "results" / name).read_text())


def _timing(t) -> bool:
    return isinstance(t, dict) and "median_ms" in t


def _ints(shape: dict, keys) -> bool:
    return all(type(shape[k]) is int for k in keys)


# ----------------------------------------------------------------------------- attention
def test_load_attention_every_arm_of_every_point():
    raw = _raw("attention.h200.json")
    rec = results.load_attention("h200")
    n_variants = sum(len(p["variants"]) for p in raw["points"])
    n_base = sum(_timing(b) for p in raw["points"] for b in p["baselines"].values())
    n_fi = sum(_timing(p["flashinfer"]) for p in raw["points"])
    impls = raw["parameters"]["impls"]
    assert len(rec.select(op="tree_verify_attention")) == n_variants == len(impls) * len(raw["points"])
    assert len(rec.rows) == n_variants + n_base + n_fi
    versions = {impl: attention.IMPLS[impl] for impl in impls}  # the record's arms by version
    assert {r.version for r in rec.select(op="tree_verify_attention")} == set(versions.values()) >= {
        attention.DEFAULT_VERSION, 9, 8, 3}  # the bf16 default (02b's headline arm) and three before it
    p0 = raw["points"][0]
    for impl, version in versions.items():
        wg = rec.select(op="tree_verify_attention", version=version,
                        shape={k: p0[k] for k in ("heads", "queries", "batch", "prefix")})
        assert [r.median_ms for r in wg] == [p0["variants"][impl]["kernel"]["median_ms"]]
    assert wg[0].floor_ms == p0["floor_ms"] and wg[0].bytes == p0["bytes"] and wg[0].mode == "graph"
    sdpa = rec.select(op="torch_sdpa_attention")[0]
    assert sdpa.p90_ms == p0["baselines"]["sdpa"]["p90_ms"] and sdpa.mode == p0["baselines"]["sdpa"]["mode"]
    fi = rec.select(op="flashinfer_mla_prefix")[0]  # its faster mode: eager, or graph-replayed where recorded
    modes = [t for t in (p0["flashinfer"], p0["flashinfer"].get("graph", {})) if _timing(t)]
    fastest = min(modes, key=lambda t: t["median_ms"])
    assert fi.median_ms == fastest["median_ms"] and fi.mode == fastest.get("mode", "eager")
    for r in rec.rows:
        assert _ints(r.shape, ("heads", "queries", "batch"))
        assert r.shape["prefix"] is None or type(r.shape["prefix"]) is int
    ragged = [r for r in rec.rows if r.shape["prefix"] is None]
    assert ragged and all(len(r.shape["lens"]) == r.shape["batch"] == len(r.shape["trees"]) for r in ragged)
    assert not [r for r in ragged if r.op.startswith("torch_")]  # the baselines skip the ragged batch
    assert rec.doc["goals"] == raw["goals"]


def test_load_attention_fp8_rows_of_every_arm_at_every_point():
    raw = _raw("attention_fp8.h200.json")
    rec = results.load_attention_fp8("h200")
    assert len(rec.rows) == sum(len(p["arms"]) for p in raw["points"])
    for p in raw["points"]:
        shape = results.attention_shape(p)
        rows = {r.variant: r for r in rec.select(op="tree_verify_attention", shape=shape)}
        assert set(rows) == set(p["arms"]) >= {"bf16", "fp8"} and {r.version for r in rows.values()} == {10}
        for arm, r in rows.items():
            a = p["arms"][arm]
            want = (a["ms"], a["bytes"], p["flops"], a["floor_ms"])
            assert (r.median_ms, r.bytes, r.flops, r.floor_ms) == want
            assert math.isnan(r.p10_ms) and math.isnan(r.p90_ms)
        assert rows["fp8"].bytes < rows["bf16"].bytes  # 656 bytes a prefix row against 1,152
        assert rows["bf16"].median_ms / rows["fp8"].median_ms == pytest.approx(p["speedup_fp8"])
        if "fp8_dequant_first" in rows:  # the other path reads the same FP8 bytes
            assert rows["fp8_dequant_first"].bytes == rows["fp8"].bytes
            assert rows["bf16"].median_ms / rows["fp8_dequant_first"].median_ms == pytest.approx(
                p["speedup_fp8_dequant_first"])


def test_load_attention_bounds_verify_and_gather_rows_of_every_point():
    raw = _raw("attention_bounds.h200.json")
    rec = results.load_attention_bounds("h200")
    version = raw["parameters"]["version"]
    for p in raw["points"]:
        shape = {k: p[k] for k in ("heads", "queries", "prefix", "batch")}
        verify = rec.select(op="tree_verify_attention", shape=shape)
        assert {r.variant for r in verify} == {"scattered", "sequential"}
        assert {r.version for r in verify} == {version}
        assert all(r.bytes == p["bytes"] and r.floor_ms == p["floors_ms"]["copy"] for r in verify)
        gather = rec.select(op="gather_read", shape=shape)
        arms = {f"{t}_{a}": v for t, g in p["gather"].items() for a, v in g["arms"].items()}
        want = {k: v["timing"]["median_ms"] for k, v in arms.items()}
        assert {r.variant: r.median_ms for r in gather} == want
        assert all(v["exact"] for v in arms.values()) and all(r.flops == 0 for r in gather)


def test_attention_version_reads_the_recorded_names():
    assert results.attention_version("wgmma", {}) == 5
    assert results.attention_version("mma", {"mma_default": "mma_v2"}) == 2
    assert results.attention_version("mma", {}) is None
    assert results.attention_version("auto", {"resolved_impls": {"auto": "mma_v3"}}) == 3


# ----------------------------------------------------------------------------- k2_rank
def test_load_k2_rank_step_parts_and_pieces():
    raw = _raw("k2_rank.h200.json")
    rec = results.load_k2_rank("h200")
    per_row = [1 + len(r["parts"]) + len(r["pieces"]) for r in raw["rows"]]
    assert len(rec.rows) == sum(per_row) and len(rec.select(variant="")) == len(raw["rows"])
    # one step row a shape: the plain and the compiled row of one point were two rows with one shape
    shapes = [tuple(sorted(r.shape.items())) for r in rec.select(variant="")]
    assert len(set(shapes)) == len(shapes)
    last = raw["rows"][-1]
    shape = {**{k: last[k] for k in ("context", "streams", "method", "budget", "compiled")},
             "routing": last.get("routing", "router")}
    step = rec.select(variant="", shape=shape)
    assert [r.median_ms for r in step] == [last["step"]["median_ms"]]
    assert step[0].floor_ms == last["floor_sum_ms"]
    moe = rec.select(variant="moe", shape=shape)[0]
    assert moe.p10_ms == last["pieces"]["moe"]["p10_ms"] and moe.floor_ms == last["floors"]["moe"]["floor_ms"]
    assert rec.select(variant="verify", shape=shape)[0].floor_ms is None
    assert all(math.isnan(r.bytes) and math.isnan(r.flops) for r in rec.rows)
    failed = [r for r in raw["rows"] if r["graph_errors"]]
    for r in failed:
        shape = {k: r[k] for k in ("context", "streams", "method", "budget")}
        assert {x.variant for x in rec.select(shape=shape, mode="eager")} == set(r["graph_errors"])
    assert all(_ints(r.shape, ("context", "streams")) for r in rec.rows)
    assert rec.doc["memory"]["within_2pct"] == raw["memory"]["within_2pct"]


# ----------------------------------------------------------------------------- verify-attention sweeps
def test_load_verify_attention_dev_reads_each_variant_once():
    raw = _raw("verify_attention_dev.h200.json")
    rec = results.load_verify_attention_dev("h200")
    kernels = rec.select(op="tree_verify_attention")
    assert len(kernels) == sum(len(p["variants"]) for p in raw["points"])  # not the top-level copy again
    assert {r.version for r in kernels} == {3, 4}
    p = raw["points"][-1]
    shape = {k: p[k] for k in ("heads", "queries", "batch", "prefix")}
    v4 = rec.select(op="tree_verify_attention", version=4, shape=shape)[0]
    assert v4.median_ms == p["variants"]["mma_v4"]["kernel"]["median_ms"] and v4.floor_ms == p["floor_ms"]
    n_base = sum(_timing(b) for q in raw["points"] for b in q["baselines"].values())
    assert len(rec.rows) == len(kernels) + n_base
    assert rec.doc["gpu_tests"]["failed"] == raw["gpu_tests"]["failed"]


def test_load_verify_attention_dev_v2_one_kernel_of_unnamed_version():
    raw = _raw("verify_attention_dev_v2.h200.json")
    rec = results.load_verify_attention_dev_v2("h200")
    kernels = rec.select(op="tree_verify_attention")
    assert len(kernels) == len(raw["points"]) and {r.version for r in kernels} == {None}
    assert [r.p10_ms for r in kernels] == [p["kernel"]["p10_ms"] for p in raw["points"]]
    assert all(r.key == "kernel" for r in kernels)


# ----------------------------------------------------------------------------- kernels
def test_load_kernels_every_kernel_and_the_embedded_sweep():
    raw = _raw("kernels.h200.json")
    rec = results.load_kernels("h200")
    per = raw["parameters"]["repeat_per_graph"]
    b0 = raw["tree_build"][0]
    shape = {k: b0[k] for k in ("batch", "depth", "budget", "k_prime")}
    b2b = rec.select(op="tree_build", version=b0["version"], variant="back_to_back", shape=shape)
    assert len(b2b) == 1 and b2b[0].median_ms * 1e3 == pytest.approx(b0["kernel_us"], rel=1e-12)
    assert b2b[0].key == f"tree_build[0].gpu_graph_x{per}"
    assert b2b[0].p90_ms == b0["gpu_graph_x20"]["p90_ms"] / per
    eager = rec.select(op="tree_build", version=b0["version"], mode="eager", shape=shape)
    assert [r.median_ms for r in eager] == [b0["gpu_eager"]["median_ms"]]
    refs = rec.select(op="tree_build_ref")
    assert len(refs) == 2 * len(raw["tree_build"]) and {r.version for r in refs} == {None}
    tied = [r for r in rec.select(op="tree_build") if r.shape.get("inputs") == "tied"]
    assert len(tied) == len(raw["tree_build_tied"])
    compact = rec.select(op="kv_compact")
    assert [(r.bytes, r.floor_ms) for r in compact] == [(c["bytes"], c["floor_ms"]) for c in raw["compact"]]
    assert len(rec.select(op="tree_accept", variant="")) == len(raw["accept"])
    assert len(rec.select(op="tree_accept", variant="back_to_back")) == len(raw["accept"])
    assert len(rec.select(op="tree_accept_ref")) == len(raw["accept"])
    assert len(rec.select(op="tree_step")) == 2 * len(raw["step"])
    assert len(rec.select(op="page_remap")) == len(raw["remap"])
    assert [r.version for r in rec.select(op="tree_sample_rows")] == [s["version"] for s in raw["sample"]]
    va = rec.select(op="tree_verify_attention")  # impl 'auto', resolved to mma_v3 when recorded
    assert len(va) == len(raw["verify_attention"]["points"]) and {r.version for r in va} == {3}
    assert all(_ints(r.shape, ("batch",)) for r in rec.rows)


# ----------------------------------------------------------------------------- accept
def test_load_accept_sampling_per_draw_and_acceptance_without_rows():
    raw = _raw("accept_sampling.h200.json")
    rec = results.load_accept_sampling("h200")
    assert len(rec.rows) == len(raw["sampling"]["points"])
    for row, p in zip(rec.rows, raw["sampling"]["points"], strict=True):
        assert row.median_ms * 1e3 == pytest.approx(p["kernel_us"], rel=1e-12)
        got = (row.version, row.shape["rows"], row.shape["vocab"], row.bytes)
        assert got == (p["version"], p["rows"], p["vocab"], p["bytes"])
    acc = results.load_accept("h200")
    assert acc.rows == () and acc.doc["accept"] == _raw("accept.h200.json")["accept"]
    assert results.load_accept("cpu").path == "data/results/accept.cpu.json"


# ----------------------------------------------------------------------------- engines
def test_load_engine_steps_verify_forward_and_draft():
    raw = _raw("engine.h200.json")
    rec = results.load_engine("h200")
    steps = rec.select(op="engine_step")
    assert len(steps) == len(raw["runs"]) + len(raw["runs_kernel_attention"]) + len(raw["trained"]["runs"])
    first = steps[0]
    r0 = raw["runs"][0]
    got = (first.median_ms, first.p10_ms, first.p90_ms)
    assert got == (r0["step_ms"], r0["step_ms_p10"], r0["step_ms_p90"])
    assert first.shape["model"] == "bench" and first.variant == r0["attention"]
    assert {r.shape["kind"] for r in steps if r.shape["model"] == "trained"} == {"code", "prose", "templated"}
    vf = rec.select(op="verify_forward")
    assert len(vf) == len(raw["verify_forward"]) + len(raw["bf16"]["verify_forward"])
    assert (vf[0].median_ms, vf[0].bytes, vf[0].floor_ms) == (raw["verify_forward"][0]["median_ms"],
                                                              raw["verify_forward"][0]["bytes"],
                                                              raw["verify_forward"][0]["floor_ms"])
    assert [r.shape["dtype"] for r in vf].count("bfloat16") == len(raw["bf16"]["verify_forward"])
    assert len(rec.select(op="dflash_draft")) == len(raw["dflash_draft"])
    assert all(_ints(r.shape, ("context",)) for r in rec.rows)


def test_load_engine_batch_wall_steps_and_the_eager_loop():
    raw = _raw("engine_batch.h200.json")
    rec = results.load_engine_batch("h200")
    graph = rec.select(op="batch_engine_step")
    assert len(graph) == len(raw["trained"]) + len(raw["bench"]) + len(raw["compiled"])
    assert len(rec.select(variant="compiled")) == len(raw["compiled"])
    t = raw["trained"][-1]
    shape = {k: t[k] for k in ("model", "kind", "context", "method", "budget", "streams")}
    got = rec.select(op="batch_engine_step", variant="", shape=shape)
    assert [(r.median_ms, r.p90_ms) for r in got] == [(t["step_ms"], t["step_ms_p90"])]
    eager = rec.select(op="engine_step")
    assert [r.median_ms for r in eager] == [e["step_ms"] for e in raw["baselines"]["eager_loop"]]
    assert all(math.isnan(r.p10_ms) for r in eager)  # the payload records the median alone
    assert all(_ints(r.shape, ("streams", "budget")) for r in graph)


def test_engine_arms_rows_from_a_payload_of_the_suite(results_dir):
    row = {"model": "trained", "kind": "code", "context": 256, "arm": "overlap", "method": "ddtree",
           "budget": 32, "streams": 16, "step_ms": 1.5, "step_ms_p10": 1.4, "step_ms_p90": 1.7,
           "tokens_per_s": 1e4}
    doc = {"suite": "engine_arms", "schema": results.SCHEMA, "provenance": {}, "rows": [row],
           "cut_for_time": []}
    (results_dir / "engine_arms.h200.json").write_text(json.dumps(doc))
    rec = results.load_engine_arms("h200")
    assert [(r.variant, r.mode, r.median_ms, r.p10_ms, r.shape["streams"]) for r in rec.rows] == [
        ("overlap", "graph", 1.5, 1.4, 16)]


def test_load_tp_steps_and_allreduce():
    raw = _raw("tp.h200.json")
    rec = results.load_tp("h200")
    assert len(rec.select(op="engine_step")) == len(raw["runs"])
    r = raw["runs"][-1]
    shape = {k: r[k] for k in ("world", "method", "moe_mode")}
    step = rec.select(op="engine_step", variant=r["engine"], shape=shape)
    assert [s.median_ms for s in step] == [r["step_ms"]]
    graph = rec.select(op="nccl_allreduce", mode="graph")
    assert len(graph) == sum("median_us" in a for a in raw["allreduce_graph"])
    assert graph[0].median_ms == pytest.approx(raw["allreduce_graph"][0]["median_us"] * 1e-3, rel=1e-15)
    assert graph[0].bytes == raw["allreduce_graph"][0]["bytes"] and graph[0].flops == 0
    assert len(rec.select(op="nccl_allreduce", mode="eager")) == len(raw["allreduce"])


def test_load_k2_rank_none_for_a_gpu_never_recorded():
    assert results.load_k2_rank("b300") is None


# ------------------------------------------------------------------------- fragmentation, diagnosis, serve
def test_load_fragmentation_three_arms_per_layout():
    raw = _raw("fragmentation.h200.json")
    rec = results.load_fragmentation("h200")
    p = raw["points"][0]
    assert len(rec.rows) == 3 * sum(len(q["layouts"]) for q in raw["points"])
    shape = {"heads": p["heads"], "queries": p["queries"], "prefix": p["prefix"], "layout": "simulated"}
    sim = rec.select(op="prefix_attention", shape=shape)
    assert [r.median_ms for r in sim] == [p["layouts"]["simulated"]["kernel"]["median_ms"]]
    assert sim[0].floor_ms == p["floor_ms"]
    gather = rec.select(op="torch_index_select")
    assert all(r.floor_ms is None and math.isnan(r.bytes) for r in gather)


@pytest.mark.parametrize("suite, key",
                         [("diagnosis", "by_kind"), ("serve", "scaling"), ("kernel_ab", "rows"),
                          ("kernel_ab_repeat", "arms")])
def test_request_level_suites_have_no_rows(suite, key):
    rec = getattr(results, f"load_{suite}")("h200")
    assert rec.rows == () and rec.doc[key] == _raw(f"{suite}.h200.json")[key]


# ----------------------------------------------------------------------------- CPU suites
def test_load_kdtr_io_every_format_and_action():
    raw = _raw("kdtr_io.cpu.json")
    rec = results.load_kdtr_io()
    assert len(rec.rows) == sum(isinstance(a, dict) for f in raw["formats"].values() for a in f.values())
    load = rec.select(op="kdtr", variant="load")
    assert [r.median_ms for r in load] == [raw["formats"]["kdtr"]["load"]["timing"]["median_ms"]]
    assert load[0].mode == "cpu" and load[0].bytes == raw["data_bytes"]
    assert all(_ints(r.shape, ("total_bytes", "n_tensors")) for r in rec.rows)


def test_load_tree_build_cpu_headline_and_sweeps():
    raw = _raw("tree_build_cpu.cpu.json")
    rec = results.load_tree_build_cpu()
    assert len(rec.rows) == 1 + len(raw["vs_batch"]) + len(raw["vs_budget"])
    head = [r for r in rec.rows if r.key == "headline"]
    h = raw["headline"]
    assert [(r.median_ms, r.p10_ms) for r in head] == [(h["median_ms"], h["p10_ms"])]
    assert all(_ints(r.shape, ("batch", "depth", "budget", "k_prime")) for r in rec.rows)


# ----------------------------------------------------------------------------- every loader
LOADERS = {
    "attention": results.load_attention, "k2_rank": results.load_k2_rank, "k2_layer": results.load_k2_layer,
    "attention_bounds": results.load_attention_bounds, "attention_gate": results.load_attention_gate,
    "attention_fp8": results.load_attention_fp8,
    "attention_timeline": results.load_attention_timeline,
    "kernel_ab_plan": functools.partial(results.load_kernel_ab, suite="kernel_ab_plan"),
    "kernel_ab_prefetch": functools.partial(results.load_kernel_ab, suite="kernel_ab_prefetch"),
    "kernel_ab_pdl": functools.partial(results.load_kernel_ab, suite="kernel_ab_pdl"),
    "kernel_ab_trigger": functools.partial(results.load_kernel_ab, suite="kernel_ab_trigger"),
    "kernel_ab_rows": functools.partial(results.load_kernel_ab, suite="kernel_ab_rows"),
    **{f"kernel_ab_{s}": functools.partial(results.load_kernel_ab, suite=f"kernel_ab_{s}")
       for s in ("maxfirst", "mbfirst", "stmatrix", "small32")},
    "kernels": results.load_kernels,
    "verify_attention_dev": results.load_verify_attention_dev,
    "verify_attention_dev_v2": results.load_verify_attention_dev_v2, "engine": results.load_engine,
    "engine_batch": results.load_engine_batch, "engine_arms": results.load_engine_arms,
    "accept": results.load_accept, "accept_sampling": results.load_accept_sampling,
    "fragmentation": results.load_fragmentation, "diagnosis": results.load_diagnosis, "tp": results.load_tp,
    "serve": results.load_serve, "kdtr_io": results.load_kdtr_io, "kernel_ab": results.load_kernel_ab,
    "kernel_ab_repeat": results.load_kernel_ab_repeat,
    "tree_build_cpu": results.load_tree_build_cpu,
    "plan_phases": results.load_plan_phases, "plan_cost": results.load_plan_cost,
    "register_budget": results.load_register_budget, "cluster_exchange": results.load_cluster_exchange,
    "code_size": results.load_code_size, "same_build": results.load_same_build,
    "wgmma_rate": results.load_wgmma_rate,
    "verify_split": results.load_verify_split, "verify_energy": results.load_verify_energy,
    "gather_pair": results.load_gather_pair, "gather_stage": results.load_gather_stage,
}


def test_every_recorded_suite_has_a_loader():
    recorded = {p.name.split(".")[0] for p in (DATA / "results").glob("*.json")}
    assert recorded - set(LOADERS) <= {"ceilings", "moe", "moe_stream", "gpu_tests"}


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(results, "ROOT", tmp_path)
    return tmp_path


@pytest.mark.parametrize("suite", sorted(LOADERS))
def test_loader_refuses_another_schema_and_is_none_when_absent(results_dir, suite):
    load = LOADERS[suite]
    assert load(gpu="h200") is None
    other = {"suite": suite, "schema": 0, "provenance": {}}
    (results_dir / f"{suite}.h200.json").write_text(json.dumps(other))
    with pytest.raises(results.SchemaError, match=rf"{suite}.h200.json: schema 0"):
        load(gpu="h200")
