"""tools/sanitize_attention.py's log reading (CPU): the findings summed over summary lines, the print
limit's second line not counted again, a run without a summary read as unknown, and `summarize` over a
folder of real files."""

import importlib.util
import json

from kdlib import ROOT


def _tool():
    path = ROOT / "tools" / "sanitize_attention.py"
    spec = importlib.util.spec_from_file_location("sanitize_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SYNC_LOG = """========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in block.
========= Target application returned an error
========= ERROR SUMMARY: 3328 errors
========= ERROR SUMMARY: 3228 errors were not printed. Use --print-limit option to adjust the number of \
printed errors
"""


def test_parse_log_counts_each_summary_once():
    t = _tool()
    assert t.parse_log(SYNC_LOG, "synccheck") == {"errors": 3328}
    two = "========= ERROR SUMMARY: 0 errors\n...\n========= ERROR SUMMARY: 1 error\n"
    assert t.parse_log(two, "memcheck") == {"errors": 1}  # two processes: summed
    assert t.parse_log("Traceback (most recent call last):\n", "memcheck") == {"errors": None}
    race = ("========= RACECHECK SUMMARY: 12 hazards displayed (10 errors, 2 warnings)\n"
            "========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)\n")
    assert t.parse_log(race, "racecheck") == {"errors": 15, "hazard_errors": 13, "hazard_warnings": 2}


def test_summarize_reads_a_folder(tmp_path, monkeypatch):
    t = _tool()
    monkeypatch.setenv("KDLIB_NVRTC_OPTIONS", "-DTV7_RACECHECK=1")
    (tmp_path / "synccheck.log").write_text(SYNC_LOG)
    (tmp_path / "synccheck.rc").write_text("9\n")
    (tmp_path / "memcheck.log").write_text("========= ERROR SUMMARY: 0 errors\n")
    (tmp_path / "memcheck.rc").write_text("0\n")
    cases = {"ok": True, "cases": [{"ok": True}, {"ok": True}], "kernels": ["tree_verify_v7_attend"]}
    (tmp_path / "memcheck.json").write_text(json.dumps(cases))
    assert t.summarize(tmp_path) == 1
    doc = json.loads((tmp_path / "sanitize.json").read_text())
    assert doc["nvrtc_options"] == "-DTV7_RACECHECK=1"
    assert doc["tools"]["memcheck"]["clean"] and doc["tools"]["memcheck"]["cases_passed"] == 2
    sync = doc["tools"]["synccheck"]
    assert sync["errors"] == 3328 and sync["cases"] is None and not sync["clean"] and not doc["clean"]
