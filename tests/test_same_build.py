"""tools/same_build.py: its option sets are the wrapper's, its comparison finds a difference where there is
one, and the committed record covers every option set and kernel with equal builds."""

from __future__ import annotations

import sys
from pathlib import Path

from kdlib.cuda import attention as cu
from kdlib.perf import results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import same_build as sb  # noqa: E402


def test_option_sets_are_the_wrappers_for_version_10():
    sets = sb.option_sets()
    assert len(set(sets)) == len(sets) == 6
    base = cu.LAUNCHES[10].options
    assert base in sets and base + cu.FP8_OPTIONS in sets
    for rows in (1, 8, 9, 16):
        v9 = base + cu.v9_options(rows)
        assert v9 in sets and v9 + cu.FP8_OPTIONS in sets, rows


def test_compare_names_the_first_difference_and_a_missing_kernel():
    a = {"k": ("MOV R1, R2", "EXIT"), "only_a": ("EXIT",), "same": ("NOP",)}
    b = {"k": ("MOV R1, R2", "BRA 0x10"), "same": ("NOP",)}
    rows = {r["kernel"]: r for r in sb.compare(a, b)}
    assert rows["same"]["same"] and rows["same"]["sha256_a"] == rows["same"]["sha256_b"]
    assert not rows["k"]["same"]
    assert rows["k"]["first_difference"] == {"index": 1, "a": "EXIT", "b": "BRA 0x10"}
    assert rows["k"]["sha256_a"] != rows["k"]["sha256_b"]
    assert not rows["only_a"]["same"] and rows["only_a"]["instructions_b"] is None
    assert "first_difference" not in rows["only_a"]
    shorter = sb.compare({"k": ("NOP",)}, {"k": ("NOP", "EXIT")})[0]
    assert shorter["first_difference"] == {"index": 1, "a": None, "b": "EXIT"}


def test_the_record_builds_every_set_the_same():
    rec = results.load_same_build("a3891f0.3947e63.cpu")
    assert rec is not None, "no record: python3 tools/same_build.py a3891f0 3947e63 --out data/results"
    doc = rec.doc
    assert doc["suite"] == "same_build" and doc["same"] is True
    assert doc["parameters"]["a"].startswith("a3891f0") and doc["parameters"]["b"].startswith("3947e63")
    assert [tuple(b["options"]) for b in doc["builds"]] == sb.option_sets()
    for b in doc["builds"]:
        names = {r["kernel"] for r in b["kernels"]}
        # the kernels the default launches at the headline points
        assert {"tree_verify_v10_attend_own", "tree_verify_v10_attend_t_own", "tree_verify_v10_plan",
                "tree_verify_v8_combine_rows"} <= names, b["options"]
        for r in b["kernels"]:
            assert r["same"] and r["sha256_a"] == r["sha256_b"], (b["options"], r["kernel"])
            assert r["instructions_a"] == r["instructions_b"] > 0
