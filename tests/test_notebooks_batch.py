"""The batch runner over every real notebook with its smoke parameters (`notebooks/params/
<stem>.smoke.yaml`), one test per notebook so that a failure names it."""

import json

import pytest

from kdlib import NOTEBOOKS, report

FOUND = sorted(NOTEBOOKS.glob("[0-9]*.ipynb"))
# No notebooks is a failure, not an empty (skipped) parameter set.
CASES = [pytest.param(p, id=p.stem) for p in FOUND] or [pytest.param(None, id="no-notebooks")]


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
