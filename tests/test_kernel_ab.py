"""tools/kernel_ab.py on the CPU: its float64 reference against kdlib.ref's on a ragged batch; its CLI."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from kdlib import ROOT
from kdlib.cuda import attention, loader
from kdlib.perf.suites import attention as suite
from kdlib.ref import attention as ref

sys.path.insert(0, str(ROOT / "tools"))
import kernel_ab  # noqa: E402


def test_reference_matches_kdlib_ref_on_a_ragged_batch():
    p = {"heads": 4, "queries": 9, "batch": 3, "lens": [5, 70, 33], "trees": [9, 4, 1]}
    pool = torch.randn(108, suite.D_QK, generator=torch.Generator().manual_seed(3)).bfloat16()  # [N, 576]
    x = suite.point_inputs(p, pool)
    want, _ = ref.tree_verify_attention(
        x["q"].double().numpy(), pool.double().numpy(), x["tables"][0].numpy(), np.array(x["lens"]),
        x["tkv"].double().numpy(), x["vis"].numpy(), np.array(x["trees"]), x["scale"])  # [B, Q, H, 512]
    for b in range(3):
        got = kernel_ab.reference(x, pool, b).numpy().reshape(9, 4, 512)
        np.testing.assert_allclose(got, want[b], rtol=1e-12, atol=1e-12, equal_nan=True)
        assert np.isnan(got[p["trees"][b]:]).all() and not np.isnan(got[: p["trees"][b]]).any()


def test_a_refused_run_leaves_no_out_folder(capsys, tmp_path):
    """--out was made while the arguments were parsed, before the checks that refused the run."""
    for argv in (["run", "--version", "7"], ["repeat"], ["run", "--version", "10", "--define", "BAD"]):
        with pytest.raises(SystemExit) as exit_:
            kernel_ab.main([*argv, "--out", str(tmp_path / "made")])
        assert exit_.value.code == 2 and not (tmp_path / "made").exists(), argv
    capsys.readouterr()


def test_an_arms_kernels_that_are_not_there_are_refused_first(capsys, tmp_path, monkeypatch):
    """The new arm timed every point before the old arm's missing folder failed with a traceback."""
    monkeypatch.setattr(kernel_ab, "require_gpu", lambda ap: None)  # what a GPU machine passes
    monkeypatch.setattr(kernel_ab, "run", lambda *a: pytest.fail("ran an arm"))
    monkeypatch.setattr(kernel_ab, "repeat", lambda *a: pytest.fail("ran an arm"))
    for argv in (["run", "build/ab/no-such-rev/kernels"], ["repeat", "/nonexistent/kernels"],
                 ["run", str(ROOT / "kernels"), "--new", "/nonexistent/kernels"]):
        with pytest.raises(SystemExit) as exit_:
            kernel_ab.main([*argv, "--out", str(tmp_path / "made")])
        assert exit_.value.code == 2 and "is not an exported kernels/ folder" in capsys.readouterr().err, argv
        assert not (tmp_path / "made").exists()


def test_run_without_old_kernels_needs_a_version_its_toggle_changes(capsys, tmp_path, monkeypatch):
    """Each toggle runs at the versions attention._launch_wgmma reads it at (COMBINE_ROWS 8 and up, PDL 10 and
    up, OWN_PLAN 10 and 13), not at version 10 alone; elsewhere the refusal names those versions."""
    got = []
    monkeypatch.setattr(kernel_ab, "require_gpu", lambda ap: None)  # the GPU work is stubbed out
    monkeypatch.setattr(kernel_ab, "run", lambda *a: got.append((a[2], a[6])))  # (version, toggle)
    runs = [("8", "COMBINE_ROWS"), ("13", "COMBINE_ROWS"), ("13", "OWN_PLAN"), ("10", "OWN_PLAN"),
            ("11", "PDL")]
    for version, toggle in runs:
        kernel_ab.main(["run", "--out", str(tmp_path), "--version", version, "--toggle", toggle])
    assert got == [(int(v), t) for v, t in runs]
    for version, toggle, follow in (("7", "PDL", "10, 11, 12, 13"), ("9", "PDL", "10, 11, 12, 13"),
                                    ("7", "COMBINE_ROWS", "8, 9, 10, 11, 12, 13"),
                                    ("11", "OWN_PLAN", "10, 13")):
        with pytest.raises(SystemExit) as exit_:
            kernel_ab.main(["run", "--out", str(tmp_path), "--version", version, "--toggle", toggle])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"versions {follow} follow, not --version {version}" in err, err
    assert all(set(v) <= set(attention.WGMMA_VERSIONS) for v in kernel_ab.TOGGLES.values())


def test_deal_cost_toggle_times_a_step_of_layers(capsys, tmp_path, monkeypatch):
    """DEAL_COST changes only a plan that later layers reuse: without --layers 2 or more its arms would be the
    same calls, so the run is refused before anything starts; --layers reaches run."""
    got = []
    monkeypatch.setattr(kernel_ab, "require_gpu", lambda ap: None)
    monkeypatch.setattr(kernel_ab, "run", lambda *a: got.append((a[6], a[8])))  # (toggle, layers)
    for layers in ([], ["--layers", "1"]):
        with pytest.raises(SystemExit) as exit_:
            kernel_ab.main(["run", "--out", str(tmp_path / "made"), "--version", "10",
                            "--toggle", "DEAL_COST", *layers])
        assert exit_.value.code == 2 and "give --layers 2 or more" in capsys.readouterr().err
        assert not (tmp_path / "made").exists()
    kernel_ab.main(["run", "--out", str(tmp_path), "--version", "10", "--toggle", "DEAL_COST",
                    "--layers", "61"])
    assert got == [("DEAL_COST", 61)]


def test_version_and_queries_are_checked_while_parsing(capsys, tmp_path, monkeypatch):
    """run and repeat --version outside attention.WGMMA_VERSIONS, repeat --queries outside 1..MAX_Q: a usage
    error naming the option before anything starts (they failed on the GPU machine, in the first call)."""
    monkeypatch.setattr(kernel_ab, "require_gpu", lambda ap: None)  # what a GPU machine passes
    monkeypatch.setattr(kernel_ab, "run", lambda *a: pytest.fail("ran an arm"))
    monkeypatch.setattr(kernel_ab, "repeat", lambda *a: pytest.fail("ran an arm"))
    old = str(ROOT / "kernels")  # an exported-looking kernels/ folder: the old arm's check passes
    for cmd, option, value in (("run", "--version", "3"), ("run", "--version", "14"),
                               ("repeat", "--version", "1"), ("repeat", "--version", "14"),
                               ("repeat", "--queries", str(attention.MAX_Q + 1)),
                               ("repeat", "--queries", "0")):
        with pytest.raises(SystemExit) as exit_:
            kernel_ab.main([cmd, old, option, value, "--out", str(tmp_path / "made")])
        assert exit_.value.code == 2 and f"argument {option}" in capsys.readouterr().err, (cmd, option, value)
        assert not (tmp_path / "made").exists()
    got = {}
    monkeypatch.setattr(kernel_ab, "repeat", lambda *a: got.setdefault("repeat", a))
    kernel_ab.main(["repeat", old, "--version", "13", "--queries", str(attention.MAX_Q),
                    "--out", str(tmp_path)])
    assert got["repeat"][2]["queries"] == attention.MAX_Q and got["repeat"][4] == 13


def test_run_toggles_are_the_attention_modules_switches(capsys, tmp_path):
    assert all(isinstance(getattr(attention, t), bool) for t in kernel_ab.TOGGLES)
    with pytest.raises(SystemExit) as exit_:
        kernel_ab.main(["run", "--out", str(tmp_path), "--version", "7", "--toggle", "COMBINE_ROWS"])
    assert exit_.value.code == 2 and "COMBINE_ROWS on / off" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        kernel_ab.main(["run", "--out", str(tmp_path), "--version", "10", "--toggle", "NOT_A_SWITCH"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
    # a --toggle beside old kernels or --define was ignored, silently
    for extra in (["build/ab/x/kernels"], ["--define", "PLAN_SMALL_REQS=0"]):
        with pytest.raises(SystemExit) as exit_:
            kernel_ab.main(["run", *extra, "--out", str(tmp_path), "--version", "10", "--toggle", "OWN_PLAN"])
        assert exit_.value.code == 2 and "--toggle applies without old kernels" in capsys.readouterr().err


def test_run_define_builds_this_tree_alone_and_takes_name_value(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        kernel_ab.main(["run", "build/ab/x/kernels", "--out", str(tmp_path), "--define", "PLAN_SMALL_REQS=0"])
    assert exit_.value.code == 2 and "no old kernels" in capsys.readouterr().err
    for bad in ("PLAN_SMALL_REQS", "=1", "1X=2", "A=1 -DB=2"):
        with pytest.raises(SystemExit) as exit_:
            kernel_ab.main(["run", "--out", str(tmp_path), "--define", bad])
        assert exit_.value.code == 2 and "NAME=VALUE" in capsys.readouterr().err


def test_repeat_takes_old_kernels_or_a_define(capsys, tmp_path):
    for args in ([], ["build/ab/x/kernels", "--define", "PLAN_SMALL_REQS=0"]):
        with pytest.raises(SystemExit) as exit_:
            kernel_ab.main(["repeat", *args, "--out", str(tmp_path)])
        assert exit_.value.code == 2 and "one of the two" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        kernel_ab.main(["repeat", "--define", "PLAN_SMALL_REQS", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "NAME=VALUE" in capsys.readouterr().err


def test_define_repeats_for_switches_together_each_name_once(capsys, monkeypatch, tmp_path):
    """Two --define give the new arm both -D options (run and repeat get the list, the arm's build joins it);
    one switch named twice is a usage error."""
    got = {}
    monkeypatch.setattr(kernel_ab, "run", lambda *a: got.setdefault("run", a))
    monkeypatch.setattr(kernel_ab, "repeat", lambda *a: got.setdefault("repeat", a))
    monkeypatch.setattr(kernel_ab, "require_gpu", lambda ap: None)  # the GPU work is stubbed out
    kernel_ab.main(["run", "--out", str(tmp_path), "--version", "10", "--define", "PLAN_SMALL_REQS=0",
                    "--define", "ORDER_GAIN=-64"])
    kernel_ab.main(["repeat", "--define", "PLAN_SMALL_REQS=0", "--define", "ORDER_GAIN=-64",
                    "--out", str(tmp_path)])
    assert got["run"][7] == got["repeat"][-1] == ["PLAN_SMALL_REQS=0", "ORDER_GAIN=-64"]
    assert kernel_ab._flags(got["run"][7]) == "-DPLAN_SMALL_REQS=0 -DORDER_GAIN=-64"
    with pytest.raises(SystemExit) as exit_:
        kernel_ab.main(["run", "--out", str(tmp_path), "--define", "PLAN_SMALL_REQS=0",
                        "--define", "PLAN_SMALL_REQS=8"])
    assert exit_.value.code == 2 and "twice" in capsys.readouterr().err


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_export_kernels_unpacks_a_revisions_kernels_and_refuses_no_commit(tmp_path):
    """kdlib.cuda.loader.export_kernels (kernel_ab.py export, ncu_source.py's build): the revision's files as
    committed, under <dest>/kernels; a name that is no commit is a ValueError before anything is written."""
    got = loader.export_kernels("HEAD", tmp_path / "head")
    path = "kernels/tree_verify/wgmma_common.cuh"
    committed = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{path}"], capture_output=True,
                               check=True).stdout
    assert got == tmp_path / "head" / "kernels" and (got.parent / path).read_bytes() == committed
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert loader.exported_commit(got) == head and loader.exported_commit(ROOT / "kernels") is None
    with pytest.raises(ValueError, match="no commit"):
        loader.export_kernels("no-such-revision", tmp_path / "none")
    assert not (tmp_path / "none").exists()
    # the first commit, before kernels/: git archive failed with a traceback and left an empty folder
    git = ["git", "-C", str(ROOT)]
    root = subprocess.run([*git, "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.split()[0]
    if subprocess.run([*git, "cat-file", "-e", f"{root}:kernels"], capture_output=True).returncode == 0:
        pytest.skip("a shallow clone: its first commit holds kernels/")
    with pytest.raises(ValueError, match="has no kernels/ folder"):
        loader.export_kernels(root, tmp_path / "early")
    assert not (tmp_path / "early").exists()
