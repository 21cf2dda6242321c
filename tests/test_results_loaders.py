"""kdlib.perf.results' typed loaders, one per recorded suite, over the committed data/results files:
row counts and one figure per suite read back from the raw JSON, typed shapes, SchemaError on a file
of another schema, None where no file is recorded."""

from __future__ import annotations

import json
import math

import pytest

from kdlib import DATA
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
    assert len(rec.select(op="tree_verify_attention")) == n_variants == 2 * len(raw["points"])
    assert len(rec.rows) == n_variants + n_base + n_fi
    assert {r.version for r in rec.select(op="tree_verify_attention")} == {5, 3}  # wgmma, mma_v3
    p0 = raw["points"][0]
    wg = rec.select(op="tree_verify_attention", version=5, shape={k: p0[k] for k in
                                                                  ("heads", "queries", "batch", "prefix")})
    assert [r.median_ms for r in wg] == [p0["variants"]["wgmma"]["kernel"]["median_ms"]]
    assert wg[0].floor_ms == p0["floor_ms"] and wg[0].bytes == p0["bytes"] and wg[0].mode == "graph"
    sdpa = rec.select(op="torch_sdpa_attention")[0]
    assert sdpa.p90_ms == p0["baselines"]["sdpa"]["p90_ms"] and sdpa.mode == p0["baselines"]["sdpa"]["mode"]
    fi = rec.select(op="flashinfer_mla_prefix")[0]
    assert fi.median_ms == p0["flashinfer"]["median_ms"] and fi.mode == "eager"
    for r in rec.rows:
        assert _ints(r.shape, ("heads", "queries", "batch"))
        assert r.shape["prefix"] is None or type(r.shape["prefix"]) is int
    ragged = [r for r in rec.rows if r.shape["prefix"] is None]
    assert ragged and all(len(r.shape["lens"]) == r.shape["batch"] == len(r.shape["trees"]) for r in ragged)
    assert not [r for r in ragged if r.op.startswith("torch_")]  # the baselines skip the ragged batch
    assert rec.doc["goals"] == raw["goals"]


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
    last = raw["rows"][-1]
    shape = {k: last[k] for k in ("context", "streams", "method", "budget")}
    step = rec.select(variant="", shape=shape)
    assert [r.median_ms for r in step] == [last["step"]["median_ms"]] and step[0].floor_ms == last["floor_sum_ms"]
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


# ----------------------------------------------------------------------------- every loader
LOADERS = {"attention": results.load_attention, "k2_rank": results.load_k2_rank}


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(results, "ROOT", tmp_path)
    return tmp_path


@pytest.mark.parametrize("suite", sorted(LOADERS))
def test_loader_refuses_another_schema_and_is_none_when_absent(results_dir, suite):
    load = LOADERS[suite]
    assert load(gpu="h200") is None
    (results_dir / f"{suite}.h200.json").write_text(json.dumps({"suite": suite, "schema": 0, "provenance": {}}))
    with pytest.raises(results.SchemaError, match=rf"{suite}.h200.json: schema 0"):
        load(gpu="h200")
