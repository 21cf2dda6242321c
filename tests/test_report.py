"""The batch runner (`kdlib report`) on tiny notebooks made here: one passes and records values, one
fails, one sleeps past its budget. Real papermill runs on the venv's kernel, real files."""

import json
import time
from pathlib import Path

import nbformat
import pytest
import zmq
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from kdlib import NOTEBOOKS, audit, files, report

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
    _write_nb(
        folder / "10_pass.ipynb",
        [
            new_markdown_cell(
                "# 10 · Passing notebook\nIt multiplies **N** by 21; the headline is the product."
            ),
            _params('N = 2  # int: >= 1\nLABEL = "plain"  # str: any label'),
            new_code_cell(
                "import pathlib\nimport sys\nimport kdlib.nb\n"
                "assert pathlib.Path('10_pass.ipynb').is_file(), 'cwd is not the notebook folder'\n"
                "kdlib.nb.record('kernel_python', sys.executable)"
            ),
            new_code_cell(
                "kdlib.nb.record('answer', N * 21, unit='x', source='data/results/fake.h200.json')\n"
                "kdlib.nb.record('weights', 594_205_351_936, unit='B', source='10_pass.html')\n"
                "kdlib.nb.record('audit_verdict_claim_a', 'confirmed', note=LABEL)\n"
                "kdlib.nb.record('audit_verdict_mem_576_elements', 'reproduced', note='576 = 512 + 64')"
            ),
            new_code_cell("print('boilerplate ' + 'output')", metadata={"tags": ["remove-cell"]}),
        ],
    )
    _write_nb(
        folder / "20_fail.ipynb",
        [
            new_markdown_cell("# 20 · Failing notebook\nIts second cell raises."),
            _params("K = 1  # int: any"),
            new_code_cell(
                "import sys\nimport kdlib.nb\nkdlib.nb.record('before_failure', 7)\n"
                "sys.stderr.write('careful: a warning\\n')"
            ),
            new_code_cell("raise RuntimeError(f'boom {K}')"),
            new_code_cell("print('never runs')"),
        ],
    )
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
    # what the page shows on stderr is listed in the index (cell 2: after parameters, nothing injected)
    assert entries["20_fail"]["stderr"] == [{"exec_count": 2, "text": "careful: a warning"}]
    assert entries["10_pass"]["stderr"] == [] and "careful: a warning" in page
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
    assert entries["20_fail"]["parameters"]["K"] == {"value": 1, "default": 1, "source": "default",
                                                     "help": "int: any"}
    assert entries["10_pass"]["title"] == "10 · Passing notebook"
    assert "multiplies" in entries["10_pass"]["abstract"] and "<strong>N</strong>" in page


def test_pages_exist_and_nothing_half_written(batch):
    _, out = batch
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "10_pass.html",
        "10_pass.ipynb",
        "20_fail.html",
        "20_fail.ipynb",
        "index.html",
        "index.json",
    ]
    html = (out / "10_pass.html").read_text()
    assert html.rstrip().endswith("</html>") and 'href="index.html"' in html
    executed = nbformat.read(str(out / "10_pass.ipynb"), as_version=4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)
    # a cell tagged remove-cell runs (its output is in the notebook) but stays out of the page
    assert "boilerplate output" in (out / "10_pass.ipynb").read_text() and "boilerplate" not in html
    assert json.loads((out / "index.json").read_text())["summary"] == {"passed": 1, "failed": 1}


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    """The writer every kdlib file goes through (reports, results, KDTR): a write that fails part way
    leaves the old file and no temporary one."""
    target = tmp_path / "index.html"
    target.write_text("old")

    def broken_write(f):
        f.write(b"new")  # part of the data reaches the temporary file, then the write fails
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(target, broken_write)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.html"]
    files.atomic_write_text(target, "new content")
    assert target.read_text() == "new content"


def test_atomic_write_path_hands_a_name_and_keeps_old_file_on_failure(tmp_path):
    """The path-taking writer (safetensors opens the file itself): a failure keeps the old file and
    leaves no temporary one; success replaces it with the old file's permissions."""
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")
    target.chmod(0o640)

    def broken_write(name):
        Path(name).write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write_path(target, broken_write)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    files.atomic_write_path(target, lambda name: Path(name).write_bytes(b"new"))
    assert target.read_bytes() == b"new" and target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_console_script_shows_progress_and_exit_code(tmp_path):
    import subprocess
    import sys

    nbs = make_notebooks(tmp_path / "notebooks")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kdlib",
            "report",
            "20_fail",
            "--notebooks-dir",
            str(nbs),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert (
        "[1/1] 20_fail" in proc.stdout
        and "failed in" in proc.stdout
        and "RuntimeError: boom 1" in proc.stdout
    )
    assert "0 passed, 1 failed" in proc.stdout
    if zmq.has("curve"):  # the kernel got CurveZMQ keys: ipykernel's warning of plain-text TCP is not printed
        assert "without encryption" not in proc.stderr, proc.stderr


def test_index_is_self_contained(batch):
    _, out = batch
    _, page = _index(out)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert "<style>" in page


def test_audit_block_counts_on_top_table_last_claims_in_words(batch):
    _, out = batch
    _, page = _index(out)
    claim = audit.catalogue()["mem_576_elements"].figure
    assert page.index('id="verdicts"') < page.index('id="10_pass"') < page.index('id="audit"')
    assert '<details class="audit" id="audit">' in page  # folded
    assert claim in page and "mem_576_elements" not in page  # the claim in words, not its id
    assert "claim_a" in page  # an id the catalogue does not know stays as it is
    counts = report.verdict_counts(_index(out)[0].values())
    assert counts == {audit.REPRODUCED: 1, audit.READING: 0, audit.CONTRADICTED: 0, audit.OUT_OF_REACH: 0,
                      "confirmed": 1}
    assert report.audit_summary_html([{"stem": "x", "records": [{"name": "other", "value": 1}]}]) == ""
    assert report.audit_counts_html([{"stem": "x", "records": []}]) == ""


def test_values_in_units_and_rounded(batch):
    _, out = batch
    _, page = _index(out)
    assert "553" in page and "GiB" in page and "594,205,351,936" not in page.replace('title="594,205,351,936 '
                                                                                     'B"', "")
    assert report.fmt_value(594_205_351_936, "B") == ("553", "GiB")
    assert report.fmt_value(70_272, "B") == ("70,272", "B")
    assert report.fmt_value(3 * 2**20, "bytes") == ("3.00", "MiB")
    assert report.fmt_value(412.748, "x") == ("413", "x")
    assert report.fmt_value(4.3712, "") == ("4.37", "")
    assert report.fmt_value(0.06251, "s") == ("0.0625", "s")
    assert report.fmt_value(8.04e-6, "") == ("8e-06", "")
    assert report.fmt_value(123456.7, "tok") == ("123,457", "tok")
    assert report.fmt_value(True, "") == ("True", "") and report.fmt_value(1024, "tokens") == (
        "1,024",
        "tokens",
    )


def test_provenance_pages_are_links_even_with_an_apostrophe():
    heading = "5. The seeds' 200k decision, re-checked"
    source = f"05_context_memory.html#{audit.anchor(heading)}"
    link = report.source_link(source, {"05_context_memory.html"})
    assert link.startswith('<a href="05_context_memory.html#5.-The-seeds&#x27;-200k-decision,-re-checked"')
    assert ">05_context_memory §5</a>" in link
    assert "<a " not in report.source_link(source, set()) and "not in this report" in report.source_link(
        source, set()
    )
    assert (
        report.source_link("data/results/kernels.h200.json", set())
        == "<code>data/results/kernels.h200.json</code>"
    )


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
    doc = json.loads((out / "index.json").read_text())  # this run's count; the kept page counted apart
    assert doc["summary"] == {"passed": 0, "failed": 1} and doc["carried_over"] == 1
    assert "1 more from an earlier run" in (out / "index.html").read_text()


def test_an_interrupted_batch_says_so_in_its_index(tmp_path, monkeypatch, capsys):
    nbs = make_notebooks(tmp_path / "notebooks")
    out = tmp_path / "out"
    real = report.run_one

    def interrupt_the_second(job, *args, **kw):
        if job["path"].stem == "20_fail":
            raise KeyboardInterrupt
        return real(job, *args, **kw)

    monkeypatch.setattr(report, "run_one", interrupt_the_second)
    assert report.cli(["--notebooks-dir", str(nbs), "--out", str(out)]) == 130
    doc = json.loads((out / "index.json").read_text())
    assert doc["interrupted"] == ["20_fail"] and doc["summary"] == {"passed": 1, "failed": 0}
    assert "interrupted" in (out / "index.html").read_text() and "did not finish" in capsys.readouterr().err


def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path, capsys):
    nbs = make_notebooks(tmp_path / "notebooks")
    (tmp_path / "file").write_text("x")
    assert report.cli(["--notebooks-dir", str(nbs), "--out", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kdlib report: error: --out") and "cannot create it" in err and err.count("\n") == 1


def test_the_notebooks_own_folder_is_refused_as_out(tmp_path, capsys):
    """An executed copy <out>/<stem>.ipynb in the notebooks' folder would replace the notebook itself."""
    nbs = make_notebooks(tmp_path / "notebooks")
    before = {p.name: p.read_bytes() for p in nbs.iterdir() if p.is_file()}
    assert report.cli(["10_pass", "--notebooks-dir", str(nbs), "--out", str(nbs)]) == 2
    err = capsys.readouterr().err
    assert "is the notebooks' own folder" in err and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in nbs.iterdir() if p.is_file()} == before
    (tmp_path / "f").write_text("x")
    assert report.cli(["--notebooks-dir", str(tmp_path / "f"), "--out", str(tmp_path / "out")]) == 2
    assert "notebook folder " + str(tmp_path / "f") + " is a file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["-p", "NOPE", "1"], "-p NOPE: no chosen notebook has such a parameter"),
    (["-p", "N", "notanint"], "-p N: N of 10_pass takes an int (>= 1); got 'notanint' (str)"),
    (["-p", "N", "0"], "N of 10_pass takes an int (>= 1); got 0, which is not >= 1"),
    (["-p", "N", "2.5"], "got 2.5 (float)"),
    (["-p", "N", "010"], "-p N '010': a number with a leading zero is ambiguous (YAML reads 010 as octal 8)"),
    (["-p", "LABEL", "3"], "LABEL of 10_pass takes a str; got 3 (int)"),
    (["-p", "K", "[1, 2]"], "K of 20_fail takes an int; got [1, 2] (list)"),
    (["-p", "N", "[1"], "not a YAML value"),
    (["--profile", "h200"], "10_pass.h200.yaml"),
    (["99_missing"], "matches no notebook"),
    (["--timeout", "0"], "timeout must be a positive number of seconds"),
    (["--timeout", "inf"], "timeout must be a positive number of seconds, got inf"),
    (["--timeout", "nan"], "timeout must be a positive number of seconds, got nan"),
])
def test_bad_input_fails_before_running(tmp_path, capsys, argv, message):
    nbs = make_notebooks(tmp_path / "notebooks")
    out = tmp_path / "out"
    assert report.cli(argv + ["--notebooks-dir", str(nbs), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("kdlib report: error: ") and err.count("\n") == 1, err
    assert not out.exists()


def test_profile_values_are_checked_too(tmp_path):
    nbs = make_notebooks(tmp_path / "notebooks")
    (nbs / "params" / "10_pass.smoke.yaml").write_text("N: -3\n")
    with pytest.raises(
        ValueError, match=r"10_pass.smoke.yaml: N: N of 10_pass takes an int \(>= 1\); got -3"
    ):
        report.run_reports(["10_pass"], profile="smoke", notebooks_dir=nbs, out_dir=tmp_path / "out")


def test_a_default_that_breaks_its_own_comment_is_refused(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _write_nb(nbs / "40_bad.ipynb", [new_markdown_cell("# 40 · Bad"), _params('MODE = "fast"  # str: "a" or '
                                                                              '"b"')])
    with pytest.raises(ValueError, match="the default of MODE does not fit its own comment"):
        report.run_reports(notebooks_dir=nbs, out_dir=tmp_path / "out")


def test_the_real_command_line_refuses_a_bad_value_before_running(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kdlib",
            "report",
            "05_context_memory",
            "-p",
            "CONTEXT",
            "notanint",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("kdlib report: error: cannot run the reports: -p CONTEXT: CONTEXT of "
                           "05_context_memory "
                           "takes an int (>= 1); got 'notanint' (str)\n")
    assert not out.exists()


@pytest.mark.parametrize(
    "default, comment, spec",
    [
        (
            8,
            "int >= 1: heads",
            {"kind": int, "is_list": False, "none_ok": False, "bounds": [(">=", 1.0)], "choices": None},
        ),
        (5, "int 1..16: depth", {"kind": int, "bounds": [(">=", 1.0), ("<=", 16.0)]}),
        (0.75, "float in [0, 1): a share", {"kind": float, "bounds": [(">=", 0.0), ("<", 1.0)]}),
        (2.0, "float > 1: factor", {"kind": float, "bounds": [(">", 1.0)]}),
        (1, "float: a length", {"kind": float}),
        (
            256,
            "int: tokens (>= 16); None = the model's limit",
            {"kind": int, "none_ok": True, "bounds": [(">=", 16.0)]},
        ),
        (None, "str | None: a folder", {"kind": str, "none_ok": True}),
        (
            [1, 4],
            "list of int in 1..16: streams",
            {"kind": int, "is_list": True, "bounds": [(">=", 1.0), ("<=", 16.0)]},
        ),
        (["a"], "list of data/hw slugs", {"kind": str, "is_list": True, "choices": None}),
        ("auto", 'str "auto" | "never": use them', {"kind": str, "choices": ("auto", "never")}),
        (
            "h200",
            "str: rtx-pro-6000 | h200 | b300",
            {"kind": str, "choices": ("rtx-pro-6000", "h200", "b300")},
        ),
        ("kimi-k2.6", "str: a config, e.g. kimi-k2.6, deepseek-v3", {"kind": str, "choices": None}),
        (True, "bool: compile", {"kind": bool}),
        (
            "max(1, 2)",
            "",
            {"kind": str},
        ),  # an unparsed expression is its source text: only the literal's type
    ],
)
def test_parameter_spec(default, comment, spec):
    got = report.parameter_spec(default, comment)
    assert {k: got[k] for k in spec} == spec
    assert report.check_parameter(default, got) is None


def test_check_parameter():
    spec = report.parameter_spec([1, 4], "list of int in 1..16: streams")
    assert report.check_parameter([16], spec) is None
    assert report.check_parameter([17], spec) == "element got 17, which is not <= 16"
    assert report.check_parameter(3, spec) == "got 3 (int), not a list"
    assert report.check_parameter([True], spec) == "element got True (bool)"
    assert report.check_parameter(None, spec) == "got None"
    choice = report.parameter_spec("auto", 'str: "auto" or "never"')
    assert report.check_parameter("sometimes", choice) == "got 'sometimes'"
    assert report.check_parameter(float("nan"), report.parameter_spec(1.0, "float")) == "got nan"
    assert report.check_parameter([], spec) == "got an empty list"  # max() of it failed in the notebook
    huge = report.check_parameter(10 ** 400, report.parameter_spec(1.0, "float"))
    assert huge == "got an int of 401 digits, past a float's range"


def test_every_notebook_default_fits_its_declared_type():
    """The specs parse the real parameters cells: each default fits its own comment, and a few known ones."""
    jobs = report.plan(report.discover(NOTEBOOKS), "cpu", {}, NOTEBOOKS / "params")
    specs = {(j["path"].stem, n): report.parameter_spec(p["default"], p["help"])
             for j in jobs for n, p in j["parameters"].items()}
    assert specs[("05_context_memory", "CONTEXT")]["kind"] is int
    assert specs[("05_context_memory", "GPU")]["choices"] == ("rtx-pro-6000", "h200", "b200", "b300")
    assert specs[("01_numpy_references", "FOLLOW")]["bounds"] == [(">=", 0.0), ("<=", 1.0)]
    assert specs[("07_seed_audit", "CATALOGUE")]["none_ok"]
    # the cpu profile is the defaults: nothing is injected, not even a folder of executed notebooks
    assert all(j["injected"] == {} for j in jobs)


def test_profile_file_with_unknown_name_is_rejected(tmp_path):
    nbs = make_notebooks(tmp_path / "notebooks")
    (nbs / "params" / "10_pass.smoke.yaml").write_text("N: 1\nTYPO: 3\n")
    with pytest.raises(ValueError, match="TYPO"):
        report.run_reports(["10_pass"], profile="smoke", notebooks_dir=nbs, out_dir=tmp_path / "out")


def test_notebook_budget_stops_a_slow_notebook(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _write_nb(
        nbs / "30_slow.ipynb",
        [new_markdown_cell("# 30 · Slow"), new_code_cell("import time\ntime.sleep(120)")],
    )
    entries = report.run_reports(notebooks_dir=nbs, out_dir=tmp_path / "out", timeout_s=4)
    assert entries[0]["status"] == "failed"
    assert "Timeout" in entries[0]["error"]["ename"] and entries[0]["duration_s"] < 60


def test_a_budget_is_the_whole_notebooks_and_a_name_recorded_twice_fails_one_notebook(tmp_path):
    """Each cell had at least 1 s of a spent budget, so short cells ran past it and passed; a name recorded
    in two cells raised out of the batch (exit 2, the notebooks after it never ran)."""
    nbs, slow = tmp_path / "notebooks", tmp_path / "slow"
    nbs.mkdir()
    slow.mkdir()
    _write_nb(slow / "10_short.ipynb", [new_markdown_cell("# 10 · Short cells")]
              + [new_code_cell("import time\ntime.sleep(0.6)") for _ in range(8)])  # 4.8 s of cells
    short = report.run_reports(notebooks_dir=slow, out_dir=tmp_path / "out_slow", timeout_s=2.5)[0]
    assert short["status"] == "failed" and short["error"]["ename"] == "Timeout", short["error"]
    assert "past its 2.5 s" in short["error"]["evalue"]
    twice = "import kdlib.nb\nkdlib.nb.record('n', 1)"
    _write_nb(nbs / "20_twice.ipynb", [new_markdown_cell("# 20 · Twice"), new_code_cell(twice),
                                       new_code_cell(twice)])
    _write_nb(nbs / "30_after.ipynb", [new_markdown_cell("# 30 · After"), new_code_cell("1")])
    entries = {e["stem"]: e for e in report.run_reports(notebooks_dir=nbs, out_dir=tmp_path / "out")}
    twice = entries["20_twice"]
    assert twice["status"] == "failed" and "recorded in cells" in twice["error"]["evalue"]
    assert entries["30_after"]["status"] == "passed"


def test_sigterm_stops_a_batch_cleanly(tmp_path):
    """kill (SIGTERM) on `kdlib report` mid-notebook: exit 143, no temporary notebook left, and the index
    names the notebook that did not finish."""
    import signal
    import subprocess
    import sys

    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _write_nb(nbs / "30_slow.ipynb",
              [new_markdown_cell("# 30 · Slow"), new_code_cell("import time\ntime.sleep(120)")])
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdlib", "report", "--notebooks-dir", str(nbs), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = out / ".30_slow.running.ipynb"
    deadline = time.monotonic() + 90
    while not partial.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert partial.exists(), "the notebook never started"
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "terminated" in err and not partial.exists()
    assert json.loads((out / "index.json").read_text())["interrupted"] == ["30_slow"]


def test_parse_parameters_cell():
    src = (
        "A = 3  # int: 1..8\nB: float = 0.5  # float\nC = [1, 2]\nD = max(1, 2)  # not a literal\nimport os\n"
    )
    p = report.parse_parameters_cell(src)
    assert p["A"] == {"value": 3, "help": "int: 1..8"}
    assert p["B"] == {"value": 0.5, "help": "float"}
    assert p["C"]["value"] == [1, 2] and p["D"]["value"] == "max(1, 2)"
    assert set(p) == {"A", "B", "C", "D"}
    with pytest.raises(ValueError, match="not valid Python"):
        report.parse_parameters_cell("A = (")
    wrapped = ('E = [\n    8,\n    16,\n]  # list of int >= 1: wrapped by the formatter\n'
               'F = "a#b"  # str: "a#b" or "c"\n')
    w = report.parse_parameters_cell(wrapped)
    assert w["E"] == {"value": [8, 16], "help": "list of int >= 1: wrapped by the formatter"}
    assert w["F"] == {"value": "a#b", "help": 'str: "a#b" or "c"'}
    spec = report.parameter_spec(w["E"]["value"], w["E"]["help"])
    assert report.check_parameter([8], spec) is None and ">= 1" in report.check_parameter([0], spec)


def test_an_expression_default_is_typed_by_its_comment():
    """`SIZE = 8 * 2**20  # int >= 1` came back as its source text, a str: -p SIZE 1024 was refused as not a
    str and -p SIZE abc accepted."""
    p = report.parse_parameters_cell("SIZE = 8 * 2**20  # int >= 1\nRATE = 1 / 3  # float in [0, 1]\n")
    size = report.parameter_spec(p["SIZE"]["value"], p["SIZE"]["help"])
    rate = report.parameter_spec(p["RATE"]["value"], p["RATE"]["help"])
    assert report.check_parameter(1024, size) is None and report.check_parameter(0.5, rate) is None
    assert "(str)" in report.check_parameter("abc", size) and "not >= 1" in report.check_parameter(0, size)
    assert "not <= 1" in report.check_parameter(2.0, rate)


def test_a_notebook_with_an_expression_default_plans(tmp_path):
    """The default's own check held its source text against the comment's kind: every plan refused it."""
    nbs = make_notebooks(tmp_path / "notebooks")
    _write_nb(nbs / "50_expr.ipynb",
              [new_markdown_cell("# 50 · Sizes"), _params("SIZE = 8 * 2**20  # int >= 1")])
    assert report.plan([nbs / "50_expr.ipynb"], "cpu", {}, nbs / "params")[0]["injected"] == {}
    job = report.plan([nbs / "50_expr.ipynb"], "cpu", {"SIZE": 1024}, nbs / "params")[0]
    assert job["injected"] == {"SIZE": 1024}
    for whole in (16.0, "1.6e1"):  # a whole number is an int however it is written
        job = report.plan([nbs / "50_expr.ipynb"], "cpu", {"SIZE": whole}, nbs / "params")[0]
        assert job["injected"] == {"SIZE": 16} and type(job["injected"]["SIZE"]) is int
    with pytest.raises(ValueError, match="SIZE of 50_expr takes an int"):
        report.plan([nbs / "50_expr.ipynb"], "cpu", {"SIZE": "big"}, nbs / "params")


def test_numbers_yaml_reads_as_strings_are_numbers_where_numbers_are_taken(tmp_path):
    """PyYAML reads 1e-1 and 1e3 as strings (YAML 1.1 wants a dot): -p RATE 1e-1 was refused."""
    nbs = make_notebooks(tmp_path / "notebooks")
    _write_nb(nbs / "30_rates.ipynb", [new_markdown_cell("# 30 · Rates"),
                                       _params("RATE = 0.5  # float\nSIZES = [1, 2]  # list of int")])
    overrides = report.parse_overrides([["RATE", "1e-1"], ["SIZES", "[1e3, 2]"], ["N", "1e1"]])
    jobs = report.plan([nbs / "10_pass.ipynb", nbs / "30_rates.ipynb"], "cpu", overrides, nbs / "params")
    assert jobs[0]["injected"] == {"N": 10} and jobs[1]["injected"] == {"RATE": 0.1, "SIZES": [1000, 2]}
    with pytest.raises(ValueError, match=r"N of 10_pass takes an int \(>= 1\); got 0.5 \(float\)"):
        report.plan([nbs / "10_pass.ipynb"], "cpu", {"N": "5e-1"}, nbs / "params")


@pytest.mark.parametrize("text", ["{}", "[]", '{"cells": 3}'])
def test_a_malformed_notebook_is_one_line(tmp_path, capsys, text):
    nbs = make_notebooks(tmp_path / "notebooks")
    (nbs / "40_bad.ipynb").write_text(text)
    assert report.cli(["40_bad", "--notebooks-dir", str(nbs), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{nbs / '40_bad.ipynb'}: not a readable notebook" in err and err.count("\n") == 1, err


def test_a_folder_named_like_a_notebook_is_not_one(tmp_path, capsys):
    """A folder 9dir.ipynb was discovered as a notebook, and reading it an IsADirectoryError traceback."""
    nbs = make_notebooks(tmp_path / "notebooks")
    (nbs / "9dir.ipynb").mkdir()
    assert nbs / "9dir.ipynb" not in report.discover(nbs)
    assert report.cli(["9", "--notebooks-dir", str(nbs), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "notebook '9' matches no notebook" in err and err.count("\n") == 1, err
    # an unreadable file (OSError) is refused like a malformed one
    with pytest.raises(ValueError, match="9dir.ipynb: not a readable notebook \\(IsADirectoryError"):
        report.notebook_info(nbs / "9dir.ipynb")


def test_one_notebook_named_two_ways_runs_once(tmp_path, monkeypatch):
    """Under a relative --notebooks-dir, a stem and the notebook's path were two entries: it ran twice."""
    make_notebooks(tmp_path / "notebooks")
    monkeypatch.chdir(tmp_path)
    got = report.discover(Path("notebooks"), ["10_pass", "notebooks/10_pass.ipynb", "10"])
    assert got == [Path("notebooks") / "10_pass.ipynb"]
    other = make_notebooks(tmp_path / "elsewhere") / "10_pass.ipynb"  # another notebook of the same name
    with pytest.raises(ValueError, match="share the name '10_pass': their pages would be one"):
        report.discover(Path("notebooks"), ["10_pass", str(other)])


def test_a_malformed_entry_of_an_earlier_index_is_dropped(tmp_path):
    """An entry with its page and notebook but not every key (edited by hand, an older layout) raised
    KeyError in every later run into that folder, after index.json had saved it again."""
    out = tmp_path / "out"
    out.mkdir()
    nb = tmp_path / "zz.ipynb"
    nb.write_text("{}")
    (out / "zz.html").write_text("<html></html>")
    bad = {"stem": "zz", "html": "zz.html", "notebook": str(nb), "status": "passed"}
    # every key a page needs, but a stem that is no name: sorting the index raised TypeError
    whole = {**bad, "stem": 5, "title": "T", "abstract": "", "duration_s": 1.0, "ran_at": "now",
             "error": None, "parameters": {}, "records": []}
    assert report._entry_html(whole, set())
    (out / "index.json").write_text(json.dumps({"notebooks": [bad, whole, {**whole, "stem": None}]}))
    for _ in range(2):
        doc = report.write_index(out, [], profile="cpu")
        assert doc["notebooks"] == [] and doc["carried_over"] == 0
    assert "zz" not in (out / "index.html").read_text()


def test_an_interrupt_while_rendering_leaves_no_page_of_another_run(tmp_path, monkeypatch):
    """Ctrl-C after the executed notebook was renamed into place but before its HTML was written left
    this run's .ipynb beside the earlier run's .html, which the index then carried over as that run's."""
    nbs = make_notebooks(tmp_path / "notebooks")
    out = tmp_path / "out"
    assert report.cli(["10_pass", "--notebooks-dir", str(nbs), "--out", str(out), "-p", "N", "2"]) == 0
    assert (out / "10_pass.html").is_file() and (out / "10_pass.ipynb").is_file()

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "render_html", interrupted)
    assert report.cli(["10_pass", "--notebooks-dir", str(nbs), "--out", str(out), "-p", "N", "5"]) == 130
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "index.json"]
    doc = json.loads((out / "index.json").read_text())
    assert doc["notebooks"] == [] and doc["interrupted"] == ["10_pass"]


def test_parse_overrides_is_yaml():
    assert report.parse_overrides(
        [["A", "3"], ["B", "0.5"], ["C", "[1, 2]"], ["D", "text"], ["E", "true"]]
    ) == {"A": 3, "B": 0.5, "C": [1, 2], "D": "text", "E": True}
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


def test_record_refuses_non_finite_values_anywhere_and_findings_a_lone_str():
    """NaN / inf in numpy scalars, lists and dicts is refused as plain floats are (they reached the index
    as JSON NaN); findings("text") is refused (a bullet per character)."""
    import numpy as np

    from kdlib import nb

    for bad in (float("nan"), np.float32("nan"), np.float16("inf"), [1.0, float("nan")], {"a": float("inf")},
                np.array([1.0, np.nan]), (np.float64(2.0), np.inf)):
        with pytest.raises(ValueError, match="not finite"):
            nb.record("x", bad)
    with pytest.raises(ValueError, match=r"'z' has no JSON form"):
        nb.record("z", np.complex128(1 + 2j))
    with pytest.raises(ValueError, match="list of lines"):
        nb.findings("some text")


def test_numpy_values_are_recorded_as_python_values_and_a_name_twice_is_refused(tmp_path, monkeypatch):
    """np.bool_ and arrays reached the kernel's display unconverted ("Can't clean for JSON: np.True_");
    two cells recording one name left the index with one of them, silently."""
    import numpy as np
    from IPython import display as ipd

    from kdlib import nb

    shown = []
    monkeypatch.setattr(ipd, "display", lambda obj, raw=False: shown.append(obj))
    nb.record("flag", np.all(np.ones(3) > 0))
    nb.record("arr", np.arange(3, dtype=np.int32))
    values = [obj[nb.RECORD_MIME]["value"] for obj in shown]
    assert values == [True, [0, 1, 2]] and type(values[0]) is bool and json.dumps(values)
    _write_nb(tmp_path / "twice.ipynb", [new_code_cell("1"), new_code_cell("2")])
    book = nbformat.read(str(tmp_path / "twice.ipynb"), as_version=4)
    payload = {nb.RECORD_MIME: {"name": "n", "value": 1}}
    for cell in book.cells:
        cell.outputs = [nbformat.v4.new_output("display_data", data=payload)]
    nbformat.write(book, str(tmp_path / "twice.ipynb"))
    with pytest.raises(ValueError, match=r"'n' is recorded in cells 0 and 1"):
        nb.read_records(tmp_path / "twice.ipynb")
