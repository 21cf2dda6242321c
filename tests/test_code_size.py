"""tools/code_size.py: its builds, the committed record's rows (every build, the roles adding up to the
kernel), and a recount of two builds against the record where NVRTC and nvdisasm are here."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kdlib import ROOT
from kdlib.cuda import loader
from kdlib.perf import results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import code_size as cs  # noqa: E402
import ncu_source as ns  # noqa: E402


def _record():
    rec = results.load_code_size()
    assert rec is not None, "no code_size.cpu.json: python3 tools/code_size.py --out data/results"
    return rec.doc


def test_builds_are_distinct_and_name_their_rows():
    got = cs.builds("0" * 40)
    assert len({b.name for b in got}) == len(got)
    v9 = [b for b in got if "-DTV9_NR=" in " ".join(b.options)]
    assert v9 and all(b.rows_a_thread * 4 == int(b.options[0].split("=")[1]) for b in v9)
    assert {b.consumers_in for b in got} <= set(cs.ROLES)


def test_the_record_has_every_build_and_its_roles_add_up():
    doc = _record()
    head = next(r["commit"] for r in doc["rows"] if r["name"].endswith("(head)"))
    want = cs.builds(head)
    assert [r["name"] for r in doc["rows"]] == [b.name for b in want]
    for r, b in zip(doc["rows"], want, strict=True):
        assert (r["kernel"], r["stem"], r["options"]) == (b.kernel, b.stem, list(b.options)), b.name
        assert sum(r["roles"].values()) == r["instructions"]
        assert r["consumer_code"] == r["roles"][b.consumers_in] == sum(r["consumer_functions"].values())
        assert r["consumer_loop"] + r["job_end"] == r["consumer_code"] and r["job_end"] > 0
        assert r["consumer_code"] > 0, b.name
    v11 = next(r for r in doc["rows"] if r["name"] == "v11 (42d5651)")
    ncu = results.RESULTS / "ncu" / "tree_verify_v11_attend.src.8x9x200k.42d5651.json"
    assert v11["instructions"] == json.loads(ncu.read_text())["totals"]["instructions"], \
        "the count of the build the device profiled"


@pytest.mark.skipif(bool(ns.missing_tools()), reason="needs NVRTC and nvdisasm (the venv's CUDA wheels)")
def test_a_recount_is_the_record():
    """Version 9's consumers at 8 rows at 4d83aab and this tree's at 40, counted again (about 10 s); skipped
    where this NVRTC is not the record's."""
    doc = _record()
    lib = loader.libnvrtc()
    if ns.nvrtc_version(lib) != doc["parameters"]["nvrtc"]:
        pytest.skip(f"this NVRTC is not the record's ({doc['parameters']['nvrtc']})")
    rows = {r["name"]: r for r in doc["rows"]}
    todo = [b for b in cs.builds(rows["v10 (head)"]["commit"])
            if b.name in ("v9 NR=8 (4d83aab)", "v10 v9 consumers NR=40 (head)")]
    for b in todo:
        git = ["git", "-C", str(ROOT), "cat-file", "-e", f"{b.rev}^{{commit}}"]
        if subprocess.run(git, capture_output=True).returncode:
            pytest.skip(f"commit {b.rev} is not in this checkout")
    with tempfile.TemporaryDirectory() as work:
        for b in todo:
            _, kernels = ns.export(b.rev, Path(work) / b.rev)
            got = cs.count(b, kernels, lib)
            keys = ("instructions", "roles", "consumer_code", "consumer_loop", "consumer_functions")
            assert {k: got[k] for k in keys} == {k: rows[b.name][k] for k in keys}, b.name
