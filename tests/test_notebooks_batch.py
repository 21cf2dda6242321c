"""The batch runner over every real notebook with its smoke parameters (`notebooks/params/
<stem>.smoke.yaml`), one test per notebook so that a failure names it; each page must show no stderr
output (a warning is fixed where it arises, not shown to the reader). Notebook 07, which reads the
other notebooks' executed copies, runs from another working directory through `kdlib report --out`
and through plain papermill: its paths come from the package, not the working directory."""

import json
import subprocess
import sys

import nbformat
import pytest

from kdlib import NOTEBOOKS, report
from kdlib.nb import RECORD_MIME

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


def _recorded(path, name: str, value) -> None:
    """An executed notebook holding one recorded value, as `kdlib.nb.record` writes it."""
    cell = nbformat.v4.new_code_cell("")
    payload = {"name": name, "value": value, "unit": "", "source": "synthetic", "note": ""}
    cell.outputs = [nbformat.v4.new_output("display_data", data={RECORD_MIME: payload, "text/plain": name})]
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), str(path))


def _printed(executed) -> str:
    nb = nbformat.read(str(executed), as_version=4)
    return "".join(
        o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stdout"
    )


@pytest.mark.slow
def test_seed_audit_reads_the_out_folder_from_another_cwd(tmp_path):
    out, elsewhere = tmp_path / "my reports", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    _recorded(out / "90_other.ipynb", "some_value", 1)
    proc = subprocess.run([sys.executable, "-m", "kdlib", "report", "07_seed_audit", "--profile", "smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=elsewhere)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (entry,) = json.loads((out / "index.json").read_text())["notebooks"]
    assert entry["parameters"]["REPORTS_DIR"] == {**entry["parameters"]["REPORTS_DIR"], "value": str(out),
                                                  "source": "--out"}
    assert "1 values recorded by other notebooks under my reports/" in _printed(out / "07_seed_audit.ipynb")
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow
def test_seed_audit_runs_under_plain_papermill_from_another_cwd(tmp_path):
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
    assert "figures;" in _printed(executed) and "under reports/" in _printed(executed)
