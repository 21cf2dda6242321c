"""The batch runner over every real notebook with its smoke parameters (`notebooks/params/
<stem>.smoke.yaml`), one test per notebook so that a failure names it; each page must show no stderr
output (a warning is fixed where it arises, not shown to the reader). Notebook 07 (the seed audit)
runs from another working directory through `kdlib report --out` and through plain papermill: its
paths come from the package, not the working directory, and its verdicts are the ones `kdlib.audit`
gives in this process, whatever executed notebooks the --out folder holds."""

import json
import subprocess
import sys

import nbformat
import pytest

from kdlib import NOTEBOOKS, audit, report
from kdlib.nb import RECORD_MIME, read_records

FOUND = sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))
# No notebooks is a failure, not an empty (skipped) parameter set.
CASES = [pytest.param(p, id=p.stem) for p in FOUND] or [pytest.param(None, id="no-notebooks")]
AUDIT = NOTEBOOKS / "07_seed_audit.ipynb"


@pytest.mark.slow
@pytest.mark.parametrize("notebook", CASES)
def test_smoke_profile_runs(notebook, tmp_path):
    assert notebook is not None, f"no notebooks ([0-9]*.ipynb) found in {NOTEBOOKS}"
    entries = report.run_reports([notebook.stem], profile="smoke", out_dir=tmp_path)
    (entry,) = entries
    err = entry["error"] or {}
    assert entry["status"] == "passed", (
        f"{notebook.name} failed under its smoke profile: {err.get('ename')}: {err.get('evalue')} "
        f"(executed notebook: {tmp_path / notebook.stem}.ipynb)"
    )
    assert (tmp_path / f"{notebook.stem}.html").is_file()
    assert entry["title"] != notebook.stem, f"{notebook.name}: first cell is not a '# NN · Title' heading"
    index = json.loads((tmp_path / "index.json").read_text())
    assert [e["stem"] for e in index["notebooks"]] == [notebook.stem]
    assert entry["stderr"] == [], f"{notebook.stem}.html shows stderr output: {entry['stderr']}"


def _recorded(path, values: dict) -> None:
    """An executed notebook holding recorded values, as `kdlib.nb.record` writes them."""
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        RECORD_MIME: {"name": n, "value": v, "unit": "", "source": "synthetic", "note": ""}, "text/plain": n})
        for n, v in values.items()]
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), str(path))


# Values the other notebooks record, planted at numbers no run gives: an audit that read them would differ.
PLANTED = {
    "02_cuda_kernels": {"tree_build_speedup_b64": 1.0},
    "04_throughput_diagnosis": {"diag_two_point_over_sustained": 9.0, "diag_accept_len_reasoning": 9.0,
                                "diag_accept_len_predictable": 0.1},
    "05_context_memory": {"mem_seed_kv_per_token_per_gpu_recomputed": 1},
    "06_b300_estimator": {"est_crosscheck_pro6000_c1_tok_s": 1.0, "est_crosscheck_pro6000_c10_tok_s": 1.0,
                          "est_model_b300_c1_native_tok_s": 1.0, "est_moe_knee_m": 1.0},
}
# The figures those values once fed; their notes (the workbook's figure) come from data/ and the
# estimator's arithmetic, so they are compared too, not only the verdicts.
FED = ("kern_tree_speedup_b64", "diag_accept_by_text", "diag_overestimate_2x", "mem_8_6_kb_per_gpu",
       "diag_baseline_c1_c10", "b300_303_c1", "moe_plateau_256")


@pytest.fixture(scope="module")
def expected():
    """audit_verdict_<id> -> (verdict, note) as `kdlib.audit` gives them here, reading no notebook."""
    return {f"{audit.RECORD_PREFIX}{fid}": (v.verdict, audit.record_note(v))
            for fid, v in audit.run_all().items()}


def _same_verdicts(executed, expected: dict) -> None:
    got = {n: (r["value"], r["note"]) for n, r in read_records(executed).items()
           if n.startswith(audit.RECORD_PREFIX)}
    assert set(got) == set(expected)
    assert {n: v for n, (v, _) in got.items()} == {n: v for n, (v, _) in expected.items()}
    for fid in FED:
        name = f"{audit.RECORD_PREFIX}{fid}"
        assert got[name] == expected[name], fid


@pytest.mark.slow
def test_seed_audit_verdicts_do_not_depend_on_the_out_folder(tmp_path, expected):
    out, elsewhere = tmp_path / "my reports", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    for stem, values in PLANTED.items():
        _recorded(out / f"{stem}.ipynb", values)
    proc = subprocess.run([sys.executable, "-m", "kdlib", "report", "07_seed_audit", "--profile", "smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=elsewhere)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (entry,) = json.loads((out / "index.json").read_text())["notebooks"]
    assert entry["status"] == "passed" and "REPORTS_DIR" not in entry["parameters"]
    _same_verdicts(out / "07_seed_audit.ipynb", expected)
    # the index's verdict count reads the executed audit
    assert f"Seed audit, {len(expected)} figures" in (out / "index.html").read_text()
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow
def test_seed_audit_runs_under_plain_papermill_from_another_cwd(tmp_path, expected):
    executed = tmp_path / "07.ipynb"
    code = ("import papermill, sys; papermill.execute_notebook(sys.argv[1], sys.argv[2], "
            "kernel_name='python3', "
            "progress_bar=False)")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(AUDIT), str(executed)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_verdicts(executed, expected)
