"""kdlib.perf.engine_batch_view on the recorded engine_batch result and on edited copies of it."""

import copy

import pytest

from kdlib import perf
from kdlib.perf import engine_batch_view as ebv
from kdlib.perf import profile

DOC = perf.load("engine_batch", "h200")
needs_doc = pytest.mark.skipif(DOC is None, reason="no data/results/engine_batch.h200.json recorded")


@needs_doc
def test_goals_table_reads_the_recorded_goals():
    table = ebv.goals_table(DOC)
    assert {r["goal"] for r in table} == {1, 2, 3, 4}
    assert ebv.goal_mismatches(DOC) == []
    kinds = {r["kind"] for r in DOC["trained"]}
    assert sum(r["goal"] == 3 for r in table) == len(kinds)
    for r in table:
        assert r["met"] == (r["measured"] >= float(r["target"].split()[1]) if r["target"].startswith(">=")
                            else r["measured"] <= float(r["target"].split()[1]))


@needs_doc
def test_a_file_without_goals_is_reported_not_a_crash():
    """goal_mismatches promises the goals a file lacks; it compared a measured float with the missing
    target (TypeError) instead. engine_batch.partial.json has no goals."""
    doc = {k: v for k, v in copy.deepcopy(DOC).items() if k != "goals"}
    table = ebv.goals_table(doc)
    assert table and all(r["met"] is None and r["target"] == "?" and r["recorded"] is None for r in table)
    assert len(ebv.goal_mismatches(doc)) == len(table)


@needs_doc
def test_goal_mismatch_is_reported():
    doc = copy.deepcopy(DOC)
    doc["goals"]["ar_step_ms_c1"] *= 1.5
    del doc["goals"]["ddtree32_ratio_by_kind"][next(iter(doc["goals"]["ddtree32_ratio_by_kind"]))]
    bad = ebv.goal_mismatches(doc)
    assert len(bad) == 2 and any("AR step" in b for b in bad) and any("recorded None" in b for b in bad)
    # a changed row changes the recomputed value, not the recorded one
    doc = copy.deepcopy(DOC)
    row = next(r for r in doc["trained"] if r["streams"] == 1 and r["method"] == "ar")
    row["busy"] = 0.01
    assert any(b.startswith("goal 1") for b in ebv.goal_mismatches(doc))


@needs_doc
def test_rows_tolerate_missing_and_present_kernel_fields():
    df = ebv.rows(DOC)
    assert len(df) == len(DOC["trained"]) and "kernels_per_step" in df and "top_kernels" in df
    doc = copy.deepcopy(DOC)
    for r in doc["trained"]:
        r["kernels_per_step"] = 100.0
        top = [["void gemm_kernel<bf16>", 2.0, 30.0], ["tree_verify_attn", 1.0, 12.5]]
        r["top_kernels"] = top if r["streams"] == 1 else None
    df = ebv.rows(doc)
    one = df[df.streams == 1].iloc[0]
    assert ebv.kernel_classes(one.top_kernels) == {"GEMM": 30.0, "attention": 12.5}
    with pytest.raises(ValueError, match="section"):
        ebv.rows(DOC, "other")


@needs_doc
def test_eager_vs_graph_pairs_the_same_method():
    eg = ebv.eager_vs_graph(DOC)
    eager = DOC["baselines"]["eager_loop"]
    assert list(eg.label) == [ebv.method_label(e["method"], e["budget"]) for e in eager]
    assert (eg.speedup == eg.eager_step_ms / eg.graph_step_ms).all()


@needs_doc
def test_agreement_counts_first_difference():
    agr = ebv.agreement(DOC)
    assert len(agr) == sum(r["method"] == "ddtree" for r in DOC["trained"])
    assert (agr.all_agree == (agr.first_difference == agr["of"])).all()


def test_kernel_class_order_and_other():
    kc = profile.kernel_class
    assert kc("tree_verify_v4_wgmma_attend") == "attention"  # attention before GEMM
    assert kc("moe_w4a16_grouped_gemm") == "MoE routing / experts"
    assert kc("rms_norm_kernel") == "norm"
    assert kc("at::native::vectorized_elementwise_kernel") == "elementwise / reduce"
    assert kc("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "fused (torch.compile)"
    assert kc("mystery") == profile.OTHER
    assert ebv.kernel_classes(None) == {}
    rows = [("gemv_kernel", 2.0, 5.0), ("tree_verify_v5_attend", 1.0, 7.0), ("sm90_xmma_gemm", 1.0, 1.5)]
    assert ebv.kernel_classes(rows) == {"attention": 7.0, "GEMM": 6.5}
    assert profile.kernel_classes(rows)["GEMM"] == {"calls": 3.0, "us": 6.5}


def test_first_difference():
    assert ebv.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert ebv.first_difference([1, 2], [1, 2, 3]) == 2
    assert ebv.first_difference([], [1]) == 0
