"""The batch runner (`kdlib report`) on tiny notebooks made here: one passes and records values, one
fails, one sleeps past its budget. Real papermill runs on the venv's kernel, real files."""

import json

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from kdlib import report

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def _write_nb(path, cells):
    nb = new_notebook(cells=cells, metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}})
    nbformat.write(nb, str(path))


def _params(src):
    return new_code_cell(src, metadata={"tags": ["parameters"]})


def make_notebooks(folder):
    """10_pass (records values, checks its cwd), 20_fail (records, then raises); params for smoke."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params").mkdir(exist_ok=True)
    _write_nb(folder / "10_pass.ipynb", [
        new_markdown_cell("# 10 · Passing notebook\nIt multiplies **N** by 21; the headline is the product."),
        _params('N = 2  # int: >= 1\nLABEL = "plain"  # str: any label'),
        new_code_cell("import pathlib\nimport sys\nimport kdlib.nb\n"
                      "assert pathlib.Path('10_pass.ipynb').is_file(), 'cwd is not the notebook folder'\n"
                      "kdlib.nb.record('kernel_python', sys.executable)"),
        new_code_cell("kdlib.nb.record('answer', N * 21, unit='x', source='data/results/fake.h200.json')\n"
                      "kdlib.nb.record('audit_verdict_claim_a', 'confirmed', note=LABEL)"),
        new_code_cell("print('boilerplate ' + 'output')", metadata={"tags": ["remove-cell"]}),
    ])
    _write_nb(folder / "20_fail.ipynb", [
        new_markdown_cell("# 20 · Failing notebook\nIts second cell raises."),
        _params("K = 1  # int: any"),
        new_code_cell("import kdlib.nb\nkdlib.nb.record('before_failure', 7)"),
        new_code_cell("raise RuntimeError(f'boom {K}')"),
        new_code_cell("print('never runs')"),
    ])
    (folder / "params" / "10_pass.smoke.yaml").write_text("N: 1\n")
    (folder / "params" / "20_fail.smoke.yaml").write_text("{}\n")
    return folder


def _index(out):
    doc = json.loads((out / "index.json").read_text())
    return {e["stem"]: e for e in doc["notebooks"]}, (out / "index.html").read_text()


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """Both notebooks, profile cpu, one -p override: the exit code and the out folder."""
    root = tmp_path_factory.mktemp("report")
    nbs = make_notebooks(root / "notebooks")
    out = root / "reports"
    rc = report.cli(["--notebooks-dir", str(nbs), "--out", str(out), "-p", "N", "5"])
    return rc, out


def test_failure_gives_nonzero_exit_and_keeps_the_others(batch):
    rc, out = batch
    assert rc == 1
    entries, _ = _index(out)
    assert set(entries) == {"10_pass", "20_fail"}
    assert entries["10_pass"]["status"] == "passed"
    assert entries["20_fail"]["status"] == "failed"


def test_failure_is_marked_with_its_error_and_partial_page(batch):
    _, out = batch
    entries, page = _index(out)
    err = entries["20_fail"]["error"]
    assert err["ename"] == "RuntimeError" and err["evalue"] == "boom 1"
    assert err["line"] == "raise RuntimeError(f'boom {K}')"
    assert entries["20_fail"]["html"] == "20_fail.html" and (out / "20_fail.html").is_file()
    assert "RuntimeError" in page and "boom 1" in page and 'href="20_fail.html"' in page
    # the partial notebook holds what ran before the failure, and not what came after
    assert entries["20_fail"]["records"][0]["value"] == 7
    executed = nbformat.read(str(out / "20_fail.ipynb"), as_version=4)
    last = executed.cells[-1]
    assert "never runs" in last.source and last.outputs == [] and last.execution_count is None


def test_records_with_provenance_and_override(batch):
    _, out = batch
    entries, page = _index(out)
    recs = {r["name"]: r for r in entries["10_pass"]["records"]}
    assert recs["answer"]["value"] == 105  # N = 5 from -p, not the default 2
    assert recs["answer"]["source"] == "data/results/fake.h200.json"
    assert "answer" in page and "105" in page and "data/results/fake.h200.json" in page
    params = entries["10_pass"]["parameters"]
    assert params["N"] == {"value": 5, "default": 2, "source": "-p", "help": "int: >= 1"}
    assert params["LABEL"]["source"] == "default" and params["LABEL"]["value"] == "plain"
    assert "K" in entries["20_fail"]["parameters"]  # -p N applies only where N is a parameter
    assert entries["10_pass"]["title"] == "10 · Passing notebook"
    assert "multiplies" in entries["10_pass"]["abstract"] and "<strong>N</strong>" in page


def test_pages_exist_and_nothing_half_written(batch):
    _, out = batch
    names = sorted(p.name for p in out.iterdir())
    assert names == ["10_pass.html", "10_pass.ipynb", "20_fail.html", "20_fail.ipynb", "index.html", "index.json"]
    html = (out / "10_pass.html").read_text()
    assert html.rstrip().endswith("</html>") and 'href="index.html"' in html
    executed = nbformat.read(str(out / "10_pass.ipynb"), as_version=4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)
    # a cell tagged remove-cell runs (its output is in the notebook) but stays out of the page
    assert "boilerplate output" in (out / "10_pass.ipynb").read_text() and "boilerplate" not in html
    assert json.loads((out / "index.json").read_text())["summary"] == {"passed": 1, "failed": 1}


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "index.html"
    target.write_text("old")

    def broken_write(self, text, encoding=None):
        with open(self, "w", encoding=encoding) as f:
            f.write(text[:3])  # part of the data reaches the disk, then the write fails
        raise OSError("disk full")

    monkeypatch.setattr(type(target), "write_text", broken_write)
    with pytest.raises(OSError, match="disk full"):
        report._atomic_write_text(target, "new content")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.html"]


def test_console_script_shows_progress_and_exit_code(tmp_path):
    import subprocess
    import sys

    nbs = make_notebooks(tmp_path / "notebooks")
    proc = subprocess.run(
        [sys.executable, "-m", "kdlib", "report", "20_fail", "--notebooks-dir", str(nbs), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "[1/1] 20_fail" in proc.stdout and "failed in" in proc.stdout and "RuntimeError: boom 1" in proc.stdout
    assert "0 passed, 1 failed" in proc.stdout


def test_index_is_self_contained(batch):
    _, out = batch
    _, page = _index(out)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert "<style>" in page


def test_audit_summary_block(batch):
    _, out = batch
    _, page = _index(out)
    assert 'id="audit"' in page and "claim_a" in page
    assert page.index('id="audit"') < page.index('id="10_pass"')  # at the top
    assert report.audit_summary_html([{"stem": "x", "records": [{"name": "other", "value": 1}]}]) == ""


def test_smoke_profile_reads_params_file(tmp_path, caplog):
    nbs = make_notebooks(tmp_path / "notebooks")
    out = tmp_path / "out"
    assert report.cli(["10", "--notebooks-dir", str(nbs), "--out", str(out), "--profile", "smoke"]) == 0
    # papermill's line-based guess trips over '>=' in the help comment; our own check replaces it
    assert "unknown parameter" not in caplog.text and "Unable to parse" not in caplog.text
    entries, _ = _index(out)
    assert list(entries) == ["10_pass"]
    assert {r["name"]: r["value"] for r in entries["10_pass"]["records"]}["answer"] == 21
    assert entries["10_pass"]["parameters"]["N"]["source"] == "10_pass.smoke.yaml"
    # a second run of the other notebook keeps the first one's entry in the index
    assert report.cli(["20_fail", "--notebooks-dir", str(nbs), "--out", str(out), "--profile", "smoke"]) == 1
    entries, _ = _index(out)
    assert entries["10_pass"]["carried_over"] and entries["20_fail"]["status"] == "failed"


@pytest.mark.parametrize("argv, message", [
    (["-p", "NOPE", "1"], "no chosen notebook has such a parameter"),
    (["--profile", "h200"], "10_pass.h200.yaml"),
    (["99_missing"], "matches no notebook"),
    (["--timeout", "0"], "timeout must be positive"),
])
def test_bad_input_fails_before_running(tmp_path, capsys, argv, message):
    nbs = make_notebooks(tmp_path / "notebooks")
    out = tmp_path / "out"
    assert report.cli(argv + ["--notebooks-dir", str(nbs), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_profile_file_with_unknown_name_is_rejected(tmp_path):
    nbs = make_notebooks(tmp_path / "notebooks")
    (nbs / "params" / "10_pass.smoke.yaml").write_text("N: 1\nTYPO: 3\n")
    with pytest.raises(ValueError, match="TYPO"):
        report.run_reports(["10_pass"], profile="smoke", notebooks_dir=nbs, out_dir=tmp_path / "out")


def test_notebook_budget_stops_a_slow_notebook(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _write_nb(nbs / "30_slow.ipynb", [new_markdown_cell("# 30 · Slow"), new_code_cell("import time\ntime.sleep(120)")])
    entries = report.run_reports(notebooks_dir=nbs, out_dir=tmp_path / "out", timeout_s=4)
    assert entries[0]["status"] == "failed"
    assert "Timeout" in entries[0]["error"]["ename"] and entries[0]["duration_s"] < 60


def test_parse_parameters_cell():
    src = 'A = 3  # int: 1..8\nB: float = 0.5  # float\nC = [1, 2]\nD = max(1, 2)  # not a literal\nimport os\n'
    p = report.parse_parameters_cell(src)
    assert p["A"] == {"value": 3, "help": "int: 1..8"}
    assert p["B"] == {"value": 0.5, "help": "float"}
    assert p["C"]["value"] == [1, 2] and p["D"]["value"] == "max(1, 2)"
    assert set(p) == {"A", "B", "C", "D"}
    with pytest.raises(ValueError, match="not valid Python"):
        report.parse_parameters_cell("A = (")


def test_parse_overrides_is_yaml():
    assert report.parse_overrides([["A", "3"], ["B", "0.5"], ["C", "[1, 2]"], ["D", "text"], ["E", "true"]]) == {
        "A": 3, "B": 0.5, "C": [1, 2], "D": "text", "E": True}
    with pytest.raises(ValueError, match="identifier"):
        report.parse_overrides([["1bad", "3"]])


def test_kernel_is_this_interpreters(batch):
    import sys
    from pathlib import Path

    _, out = batch
    entries, _ = _index(out)
    recs = {r["name"]: r["value"] for r in entries["10_pass"]["records"]}
    assert Path(recs["kernel_python"]).parent == Path(sys.executable).parent  # the notebook ran in this venv
    assert Path(report.check_kernel("python3")).parent == Path(sys.executable).parent
    with pytest.raises(ValueError, match="no Jupyter kernel"):
        report.check_kernel("no_such_kernel_kdlib")
