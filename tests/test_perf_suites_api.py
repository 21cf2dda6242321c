"""The suites' calling convention (issue 21): every `kdlib.perf.suites.<name>.run` takes keyword arguments
only, each typed, defaulted and documented, and `kdlib.perf.run` passes it only names it accepts. Checked
from signatures (no GPU); the CPU suites run end to end through the entry point."""

import argparse
import importlib
import inspect
import json
import re
import types

import pytest

from kdlib.perf import run as entry
from kdlib.perf.suites import accept, engine_arms, kernels, serve

# Suites still in the `run(args)` form (the lead's, being rewritten); run.py hands them the Namespace.
LEGACY: set[str] = set()


def _suites() -> dict:
    return {name: importlib.import_module(f"kdlib.perf.suites.{name}") for name in entry.available()}


def test_every_suite_run_is_keyword_only_typed_defaulted_and_documented():
    suites = _suites()
    for name, module in suites.items():
        if name in LEGACY:
            assert not entry.is_keyword_only(module.run), f"{name} is keyword-only now: drop it from LEGACY"
            continue
        assert entry.is_keyword_only(module.run), f"{name}.run takes positional parameters"
        doc = inspect.getdoc(module.run) or ""
        for p in inspect.signature(module.run).parameters.values():
            assert p.default is not inspect.Parameter.empty, f"{name}.run({p.name}) has no default"
            assert p.annotation is not inspect.Parameter.empty, f"{name}.run({p.name}) has no type"
            assert _documents(doc, p.name), f"{name}.run's docstring does not document {p.name!r}"
    assert LEGACY <= set(suites)


def _documents(doc: str, name: str) -> bool:
    """Whether doc names `name` as a whole word (not as out in without, or iters in baseline_iters)."""
    return re.search(rf"\b{re.escape(name)}\b", doc) is not None


def test_a_parameter_is_documented_by_its_whole_name_only():
    assert _documents("out: the folder; iters: timed runs", "out") and _documents("(iters)", "iters")
    for doc, name in (("without a GPU", "out"), ("baseline_iters: runs", "iters"),
                      ("attention_budget: tokens", "attention")):
        assert not _documents(doc, name), (doc, name)


def test_the_entry_point_passes_only_the_names_a_suite_accepts():
    args = argparse.Namespace(suite=["x"], quick=True, out="/tmp/x")
    for name, module in _suites().items():
        if name in LEGACY:
            continue
        accepted = inspect.signature(module.run).parameters
        kwargs = entry.suite_kwargs(module.run, args)
        assert set(kwargs) <= set(accepted), name
        assert set(kwargs) == set(entry.ENTRY_OPTIONS) & set(accepted), name
        if "quick" in accepted:
            assert kwargs["quick"] is True, name
    assert "quick" not in inspect.signature(engine_arms.run).parameters  # the one suite with no quick mode


def test_call_suite_in_each_form(capsys):
    args = argparse.Namespace(suite=["x"], quick=True, out="/tmp/x")

    def keyword(*, quick: bool = False, out: str | None = None, extra: int = 3):
        return {"quick": quick, "out": out, "extra": extra}

    def no_quick(*, budget_s: float | None = None):
        return {"budget_s": budget_s}

    def legacy(ns):
        return {"got": ns}

    mods = {}
    for fn in (keyword, no_quick, legacy):
        mods[fn.__name__] = types.ModuleType(f"kdlib.perf.suites.{fn.__name__}")
        mods[fn.__name__].run = fn
    assert entry.call_suite(mods["keyword"], args) == {"quick": True, "out": "/tmp/x", "extra": 3}
    assert entry.call_suite(mods["no_quick"], args) == {"budget_s": None}
    assert "kdlib.perf.suites.no_quick has no quick mode: --quick ignored" in capsys.readouterr().out
    assert entry.call_suite(mods["legacy"], args) == {"got": args}
    entry.call_suite(mods["no_quick"], argparse.Namespace(suite=["x"], quick=False, out=None))
    assert capsys.readouterr().out == ""


def test_the_cpu_suites_through_the_entry_point(tmp_path):
    argv = ["--suite", "kdtr_io", "--suite", "tree_build_cpu", "--quick", "--out", str(tmp_path)]
    assert entry.main(argv) == 0
    io = json.loads((tmp_path / "kdtr_io.cpu.json").read_text())
    build = json.loads((tmp_path / "tree_build_cpu.cpu.json").read_text())
    assert io["suite"] == "kdtr_io" and build["suite"] == "tree_build_cpu"
    assert io["parameters"]["total_bytes"] == 16 << 20 and io["parameters"]["repeats"] == 2  # quick
    assert build["parameters"]["iters"] == 3 and build["headline"]["median_ms"] > 0
    assert io["provenance"]["command"].endswith(f"--quick --out {tmp_path}")


def test_gpu_suites_are_refused_in_one_line_where_torch_sees_no_gpu(tmp_path, capsys, monkeypatch):
    """Every suite that is neither CPU_ONLY nor CPU_OK, on a machine without CUDA: exit 2 naming it, before
    any suite runs (each had ended in a traceback of its own: no cupy, no CUDA generator, ...)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    monkeypatch.setattr(entry, "call_suite", lambda module, args: ran.append(module) or {})
    cpu = {"kdtr_io", "tree_build_cpu", "accept", "diagnosis", "serve"}
    for name in entry.available():
        argv = ["--suite", "kdtr_io", "--suite", name, "--out", str(tmp_path)]
        if name in cpu:
            assert entry.main(argv) == 0, name
            continue
        with pytest.raises(SystemExit) as e:
            entry.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"suite(s) ['{name}'] need a CUDA GPU" in err, (name, err)
    assert len(ran) == 2 * len(cpu)  # the refused runs measured nothing, kdtr_io included


def test_the_entry_point_refuses_an_unknown_suite(capsys):
    with pytest.raises(SystemExit) as e:
        entry.main(["--suite", "nope"])
    assert e.value.code == 2 and "unknown suite(s) ['nope']" in capsys.readouterr().err


def test_a_refused_run_leaves_no_out_folder(tmp_path, capsys):
    """--out was made while the arguments were parsed, before the unknown-suite check refused the run."""
    with pytest.raises(SystemExit) as e:
        entry.main(["--suite", "nope", "--out", str(tmp_path / "made")])
    assert e.value.code == 2 and not (tmp_path / "made").exists()


def test_the_entry_point_refuses_a_file_as_out_before_measuring(tmp_path, capsys, monkeypatch):
    """--out naming a file is refused before the suite runs (it failed at the write, the run lost)."""
    (tmp_path / "f").write_text("x")
    ran = []
    monkeypatch.setattr(entry, "call_suite", lambda module, args: ran.append(module) or {})
    for out, message in ((tmp_path / "f", "is a file, not a folder"),
                         (tmp_path / "f" / "sub", "as a folder (Not a directory)")):
        with pytest.raises(SystemExit) as e:
            entry.main(["--suite", "kdtr_io", "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "argument --out: " in err and message in err and not ran, err


def test_parameters_come_before_their_environment_defaults(monkeypatch):
    monkeypatch.setenv("KDLIB_TREE_VERSIONS", "3,4")
    monkeypatch.setenv("KDLIB_ACCEPT_PARTS", "sampling")
    assert kernels.tree_versions() == (3, 4)
    assert kernels.tree_versions([2]) == (2,)
    assert accept._parts() == ("sampling",)
    assert accept._parts(["acceptance"]) == ("acceptance",)
    with pytest.raises(ValueError, match=r"versions \[9\]: versions must be among"):
        kernels.tree_versions([9])
    with pytest.raises(ValueError, match="parts must name some of"):
        accept._parts(["speed"])
    monkeypatch.delenv("KDLIB_TREE_VERSIONS")
    assert kernels.tree_versions() == tuple(kernels.tree.VERSIONS)


def test_serve_arms_parameter_is_checked_before_any_server_starts(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("KDLIB_SERVE_ARMS", "ddtree")
    with pytest.raises(ValueError, match=r"arms: unknown arms \['fast'\]"):
        serve.run(quick=True, arms=["fast"])
    monkeypatch.setenv("KDLIB_SERVE_ARMS", "ddtree,fast")
    with pytest.raises(ValueError, match=r"KDLIB_SERVE_ARMS: unknown arms \['fast'\]"):
        serve.run(quick=True)


def test_environment_switches_refuse_misspelt_values(monkeypatch):
    """A typo in a suite's switch is an error naming the variable (KDLIB_KERNELS_ATTENTION=skpi ran the
    whole verify-attention sweep; only "0" turned the graph switches off)."""
    from kdlib.perf.suites import env_choice, env_flag

    for raw, want in (("0", False), ("off", False), ("False", False), ("1", True), ("yes", True), ("", True)):
        monkeypatch.setenv("KDLIB_T_FLAG", raw)
        assert env_flag("KDLIB_T_FLAG", True) is want
    monkeypatch.setenv("KDLIB_T_FLAG", "nope")
    with pytest.raises(ValueError, match="KDLIB_T_FLAG='nope'"):
        env_flag("KDLIB_T_FLAG", True)
    monkeypatch.setenv("KDLIB_KERNELS_ATTENTION", "skpi")
    with pytest.raises(ValueError, match="KDLIB_KERNELS_ATTENTION='skpi'"):
        kernels._attention(quick=True, attention=None, budget_s=None)
    monkeypatch.setenv("KDLIB_KERNELS_ATTENTION", "skip")
    assert "skipped" in kernels._attention(quick=True, attention=None, budget_s=None)["absent"]
    assert env_choice("KDLIB_T_UNSET", ("a", "b"), "b") == "b"



def test_k2_rank_refuses_a_resume_file_that_is_not_there():
    """A mistyped K2_RANK_RESUME started the grid over and overwrote the record with its first rows."""
    from kdlib.perf.suites import k2_rank

    with pytest.raises(ValueError, match="does not exist"):
        k2_rank.run(resume="/nonexistent/k2_rank.h200.json")


def test_k2_rank_refuses_to_resume_rows_of_another_routing(tmp_path):
    """The rows of another routing were kept in the payload (and measured again), under a parameters block
    naming the new routing alone."""
    from kdlib.perf.suites import k2_rank

    old = tmp_path / "k2_rank.h200.json"
    row = {"context": 5500, "streams": 1, "budget": None, "routing": "router"}
    old.write_text(json.dumps({"rows": [row]}))
    with pytest.raises(ValueError, match=r"holds rows of routing \['router'\], not 'uniform'"):
        k2_rank.run(resume=str(old), routing="uniform")
    # the rows carry no MoE mode or GPU: the record's header does, and a resume at others is refused
    row["routing"] = "uniform"
    old.write_text(json.dumps({"rows": [row], "parameters": {"moe_mode": "tp"},
                               "provenance": {"gpu": "NVIDIA H200"}}))
    with pytest.raises(ValueError, match="was measured at moe_mode 'tp', this run at 'ep'"):
        k2_rank.run(resume=str(old), routing="uniform", moe_mode="ep")
    with pytest.raises(ValueError, match="was measured at GPU 'NVIDIA H200', this run at 'cpu'"):
        k2_rank.run(resume=str(old), routing="uniform", moe_mode="tp")


def test_host_only_suites_are_named_cpu_on_a_gpu_machine(tmp_path, monkeypatch):
    """kdtr_io and tree_build_cpu time the host: their files are <suite>.cpu.json, the name their loaders
    read, on a GPU machine too (they were named after the GPU there)."""
    monkeypatch.setattr(entry.results, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(entry, "call_suite", lambda module, args: {"value": 1})
    assert entry.main(["--suite", "kdtr_io", "--suite", "tree_build_cpu", "--suite", "accept",
                       "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accept.h200.json", "kdtr_io.cpu.json",
                                                          "tree_build_cpu.cpu.json"]

