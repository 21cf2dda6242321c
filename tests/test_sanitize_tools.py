"""tools/sanitize_attention.py's log reading (CPU): the findings summed over summary lines, the print
limit's second line not counted again, a run without a summary read as unknown, and `summarize` over a
folder of real files."""

import importlib.util
import json

import pytest

from kdlib import ROOT


def _tool(name="sanitize_attention"):
    path = ROOT / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
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


def test_summarize_takes_the_runs_build_and_a_run_of_no_case_is_not_clean(tmp_path, monkeypatch):
    """A case filter matching nothing ran no case and read clean ("every case passed", all of none); a
    folder summarized later recorded the summarizing process's build options and provenance."""
    t = _tool()
    monkeypatch.setenv("KDLIB_NVRTC_OPTIONS", "")  # the summarizing process's
    (tmp_path / "memcheck.log").write_text("========= ERROR SUMMARY: 0 errors\n")
    (tmp_path / "memcheck.rc").write_text("0\n")
    run = {"provenance": {"commit": "abc1234", "gpu": "NVIDIA H200"}, "nvrtc_options": "-DTV7_RACECHECK=1"}
    (tmp_path / "memcheck.json").write_text(json.dumps({"ok": True, "cases": [], "kernels": [], **run}))
    assert t.summarize(tmp_path) == 1
    doc = json.loads((tmp_path / "sanitize.json").read_text())
    assert not doc["tools"]["memcheck"]["clean"] and doc["tools"]["memcheck"]["cases"] == 0
    assert doc["provenance"] == run["provenance"] and doc["nvrtc_options"] == "-DTV7_RACECHECK=1"
    monkeypatch.setenv("KDLIB_SANITIZE_CASES", "V7")  # names start with a lower-case v
    monkeypatch.setattr(t, "run_case", lambda *a: pytest.fail("ran a case"))
    assert t.run(tmp_path / "x.json", pool=True) == 2 and not (tmp_path / "x.json").exists()


def test_a_pattern_case_that_did_not_run_sees_no_order(tmp_path, monkeypatch):
    """compute-sanitizer prints its summary after a target that failed: 0 hazards from a case that crashed
    read as 'racecheck sees the order' for it, and the run passed on its control case alone."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))  # the tool imports sanitize_attention beside it
    t = _tool("racecheck_patterns")

    def fake(cmd, **kw):
        summary = "========= RACECHECK SUMMARY: {0} hazards displayed ({0} errors, 0 warnings)\n"
        if cmd[-1] == "no_barrier":  # 9: racecheck's exit code on a hazard
            return type("P", (), {"returncode": 9, "stderr": "",
                                  "stdout": "no_barrier: ran\n" + summary.format(4)})
        return type("P", (), {"returncode": 1, "stdout": "", "stderr": "Traceback ...\n" + summary.format(0)})

    monkeypatch.setattr(t.subprocess, "run", fake)
    monkeypatch.setattr(t, "provenance", lambda: {})
    assert t.run_all(tmp_path) == 1
    doc = json.loads((tmp_path / "patterns.json").read_text())
    assert doc["control_caught"] and not doc["all_ran"]
    assert all(c["sees_order"] is None and not c["ran"] for n, c in doc["cases"].items() if n != "no_barrier")

