"""tools/register_budget.py: its builds move one of setmaxnreg's two counts at a time, and the committed
record is what ptxas reports now for the builds it checks (where this nvcc is the record's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kdlib.cuda import loader
from kdlib.perf import results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import register_budget as rb  # noqa: E402


def test_builds_move_one_count_at_a_time_from_the_defaults():
    c = loader.source_constants(rb.STEM)
    p0, c0 = c["PRODUCER_REGS"], c["CONSUMER_REGS"]
    got = rb.builds()
    assert (p0, c0) in got and len(got) == len(set(got))
    assert {p for p, r in got if r == c0} == set(rb.PRODUCERS) | {p0}
    assert {r for p, r in got if p == p0} == set(rb.CONSUMERS) | {c0}
    assert all(p == p0 or r == c0 for p, r in got)


def test_the_rows_sweep_runs_past_the_sources_cap():
    c = loader.source_constants(rb.STEM)
    assert max(rb.ROWS) > c["V9_MAX_NR"] and all(r % 8 == 0 for r in rb.ROWS)
    assert rb.rows_builds() == [(r, c["PRODUCER_REGS"], c["CONSUMER_REGS"]) for r in rb.ROWS]
    assert set(rb.V9_KERNELS) <= set(loader.KERNEL_DECL.findall(loader.expanded_source(rb.STEM)))


def test_consumers_left_fill_the_pool_beside_the_producer():
    """The producer and the consumer warpgroups at what it leaves them fit the CTA's pool, with less than a
    step of 8 registers a consumer thread to spare; the source's default split is such a split."""
    c = loader.source_constants(rb.STEM)
    threads = c["NTHREADS"]
    pool, consumers = rb.cta_register_pool(threads), threads // rb.WARPGROUP - 1
    for p in rb.PRODUCERS:
        r = rb.consumers_left(p)
        used = rb.WARPGROUP * (p + consumers * r)
        assert r % 8 == 0 and used <= pool < used + rb.WARPGROUP * consumers * 8
    assert rb.consumers_left(c["PRODUCER_REGS"]) == c["CONSUMER_REGS"]


def test_the_record_has_every_build_and_kernel():
    rec = results.load_register_budget()
    assert rec is not None, "no register_budget.cpu.json: python3 tools/register_budget.py --out data/results"
    got = [(b["producer"], b["consumer"]) for b in rec.doc["builds"]]
    assert got == rb.builds()
    names = set(loader.KERNEL_DECL.findall(loader.expanded_source(rb.STEM)))
    assert all(names <= set(b["kernels"]) for b in rec.doc["builds"])
    assert [(b["rows"], b["producer"], b["consumer"]) for b in rec.doc["rows_builds"]] == rb.rows_builds()
    assert all(set(b["kernels"]) == set(rb.V9_KERNELS) for b in rec.doc["rows_builds"])


@pytest.mark.skipif(loader.nvcc_path() is None, reason="needs nvcc")
def test_the_record_is_what_ptxas_reports_now():
    """The default build, the producer at 32 (it spills), the consumers one step below the fewest at which
    v7's build without a spill in the record (v7's spill there, v9's do not) and at 160 (v9's spill too),
    compiled here with the -D options, against the record; skipped where this nvcc is not the record's."""
    rec = results.load_register_budget()
    if loader.nvcc_version().strip().splitlines()[-1] != rec.doc["parameters"]["nvcc"]:
        pytest.skip(f"this nvcc is not the record's ({rec.doc['parameters']['nvcc']})")
    recorded = {(b["producer"], b["consumer"]): b["kernels"] for b in rec.doc["builds"]}
    d = rec.doc["parameters"]["default"]
    fewest = min(c for (p, c), k in recorded.items() if p == d["producer"]
                 and k["tree_verify_v10_attend"]["spill_stores"] == 0)
    below = max(c for (p, c) in recorded if p == d["producer"] and c < fewest)
    builds = ((d["producer"], d["consumer"]), (32, d["consumer"]), (d["producer"], below),
              (d["producer"], 160))
    for build in builds:
        assert rb.report(*build) == recorded[build], build
    spills = {b: {k: v["spill_stores"] for k, v in recorded[b].items() if "attend" in k} for b in builds}
    assert all(spills[(32, d["consumer"])].values()), "the producer at 32 spills in every attend kernel"
    assert spills[(d["producer"], below)]["tree_verify_v10_attend"] > 0
    assert spills[(d["producer"], below)]["tree_verify_v10_attend_t"] == 0
    assert spills[(d["producer"], 160)]["tree_verify_v10_attend_t"] > 0


@pytest.mark.skipif(loader.nvcc_path() is None, reason="needs nvcc")
def test_the_rows_sweep_is_what_ptxas_reports_now():
    """Version 9's consumers at the source's cap (V9_MAX_NR) and one step past it, at the defaults, compiled
    here against the record (skipped where this nvcc is not the record's): no kernel that runs them spills at
    the cap, every one spills past it."""
    rec = results.load_register_budget()
    if loader.nvcc_version().strip().splitlines()[-1] != rec.doc["parameters"]["nvcc"]:
        pytest.skip(f"this nvcc is not the record's ({rec.doc['parameters']['nvcc']})")
    recorded = {(b["rows"], b["producer"], b["consumer"]): b["kernels"] for b in rec.doc["rows_builds"]}
    cap = loader.source_constants(rb.STEM)["V9_MAX_NR"]
    d = rec.doc["parameters"]["default"]
    builds = ((cap, d["producer"], d["consumer"]), (cap + 8, d["producer"], d["consumer"]))
    for n, p, r in builds:
        got = rb.report(p, r, rows=n)
        assert {k: got[k] for k in rb.V9_KERNELS} == recorded[(n, p, r)], (n, p, r)
    spills = {b: [recorded[b][k]["spill_stores"] for k in rb.V9_KERNELS] for b in builds}
    assert not any(spills[builds[0]]), "no spill at the source's cap"
    assert all(all(spills[b]) for b in builds[1:]), "every kernel of v9's consumers spills past the cap"
