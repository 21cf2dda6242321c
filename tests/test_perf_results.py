"""kdlib.perf.results: which recorded file `load` picks, the typed loaders, the schema migration."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kdlib.perf import results
from tools import migrate_results as mig


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(results, "ROOT", tmp_path)
    return tmp_path


def _put(folder, name: str, date: str | None, value: float) -> None:
    prov = {"gpu": "NVIDIA H200", "commit": "c" * 40, "command": "test"}
    if date is not None:
        prov["date"] = date
    (folder / name).write_text(json.dumps({"suite": "s", "provenance": prov, "value": value}))


def test_load_picks_latest_provenance_date_not_mtime(results_dir):
    _put(results_dir, "s.h200.json", "2026-11-29T12:00:00Z", 1.0)
    _put(results_dir, "s.h200-nvl.json", "2026-11-28T12:00:00Z", 2.0)
    # the older recording touched last: modification time must not decide
    os.utime(results_dir / "s.h200-nvl.json", (2e9, 2e9))
    os.utime(results_dir / "s.h200.json", (1e9, 1e9))
    got = results.load("s")
    assert got["value"] == 1.0 and got["_path"] == "s.h200.json"
    assert results.load("s", "h200-*")["value"] == 2.0
    assert results.load("s", "b300") is None


def test_load_breaks_date_ties_by_name_and_undated_files_lose(results_dir):
    _put(results_dir, "s.a.json", "2026-11-29T12:00:00Z", 1.0)
    _put(results_dir, "s.b.json", "2026-11-29T12:00:00Z", 2.0)
    _put(results_dir, "s.c.json", None, 3.0)
    for t, name in ((3e9, "s.a.json"), (1e9, "s.b.json"), (4e9, "s.c.json")):
        os.utime(results_dir / name, (t, t))
    assert results.load("s")["value"] == 2.0


# ----------------------------------------------------------------------------- the schema migration
def _numbers(node, path=()):
    """(path, value) of every number under a JSON node (bools are not numbers here)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _numbers(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _numbers(v, (*path, i))
    elif isinstance(node, int | float) and not isinstance(node, bool):
        yield path, node


_RENAMED = {"bytes": "bytes_moved", "copy_bandwidth_Bps": "Bps"}  # inside a migrated copy block


def _migrated_path(path: tuple) -> tuple:
    copy_at = path.index("copy") if "copy" in path else None
    if copy_at is not None and copy_at == len(path) - 2 and path[-1] in _RENAMED:
        return (*path[:-1], _RENAMED[path[-1]])
    return path


def _at(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def _recorded_at(rev: str) -> dict:
    """{name: text} of data/results/*.json at commit `rev` (skips without git history)."""
    try:
        names = subprocess.run(["git", "-C", str(results.ROOT), "ls-tree", "--name-only",
                                f"{rev}:data/results"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"no git history with {rev}: the migration's before and after are not at hand")
    out = {}
    for name in names.stdout.split():
        if name.endswith(".json"):
            out[name] = subprocess.run(["git", "-C", str(results.ROOT), "show", f"{rev}:data/results/{name}"],
                                       capture_output=True, text=True, check=True).stdout
    return out


def test_migration_keeps_every_number_of_every_recorded_file():
    """The migration commit (MIGRATED_BY) against the commit it ran on (MIGRATED_FROM), both read from
    git: files recorded later may hold new measurements, so the working tree is checked only for
    being at the current schema (the next test)."""
    before, after = _recorded_at(mig.MIGRATED_FROM), _recorded_at(mig.MIGRATED_BY)
    assert len(before) >= 15
    for name, text in before.items():
        old = json.loads(text)
        new = json.loads(after[name])
        assert new == mig.migrate(old), f"{name}: the migrated file is not the script's output"
        assert mig.dumps(mig.migrate(new)) == after[name], f"{name}: migrating twice changes it"
        old_numbers = dict(_numbers(old))
        for p, v in old_numbers.items():
            got = _at(new, _migrated_path(p))
            assert got == v and type(got) is type(v), f"{name}: {p} was {v!r}, is {got!r}"
        kept = {_migrated_path(q) for q in old_numbers}
        added = {p: v for p, v in _numbers(new) if p not in kept}
        for p, v in added.items():
            assert p == ("schema",) or p[-1] == "bytes_per_copy", f"{name}: a new number at {p}"
            if p[-1] == "bytes_per_copy":
                assert 2 * v == _at(new, (*p[:-1], "bytes_moved"))
        assert new["schema"] == results.SCHEMA


def test_every_recorded_file_is_at_the_current_schema():
    for path in sorted(results.RESULTS.glob("*.json")):
        text = path.read_text()
        doc = json.loads(text)
        assert doc.get("schema") == results.SCHEMA, path.name
        assert mig.migrate(doc) == doc, f"{path.name}: the migration would still change it"


def test_migrate_cli_checks_and_rewrites(tmp_path):
    old = {"suite": "moe", "provenance": {"date": "2026-11-29T00:00:00Z"},
           "copy": {"bytes": 2048, "timing": {"median_ms": 0.5}, "copy_bandwidth_Bps": 4096000.0}}
    (tmp_path / "moe.h200.json").write_text(mig.dumps(old))
    assert mig.main(["--dir", str(tmp_path), "--check"]) == 1
    assert json.loads((tmp_path / "moe.h200.json").read_text()) == old
    assert mig.main(["--dir", str(tmp_path)]) == 0
    new = json.loads((tmp_path / "moe.h200.json").read_text())
    assert list(new)[:2] == ["suite", "schema"]
    assert new["copy"] == {"method": "memcpy", "bytes_per_copy": 1024, "bytes_moved": 2048,
                           "timing": {"median_ms": 0.5}, "Bps": 4096000.0, "checked": False}
    assert mig.main(["--dir", str(tmp_path), "--check"]) == 0
    with pytest.raises(SystemExit) as err:
        mig.main(["--dir", str(tmp_path / "absent")])
    assert err.value.code == 2
    (tmp_path / "a.json").write_text(mig.dumps(old))  # would migrate, but another file is not JSON
    (tmp_path / "z.json").write_text("{not json")
    with pytest.raises(SystemExit) as err:
        mig.main(["--dir", str(tmp_path)])
    assert err.value.code == 2 and json.loads((tmp_path / "a.json").read_text()) == old  # nothing written
    # JSON but no object, or a copy block without its bytes: the earlier files were rewritten, then a crash
    for bad in ("[1]", json.dumps({"suite": "moe", "copy": {"timing": {}}})):
        (tmp_path / "z.json").write_text(bad)
        with pytest.raises(SystemExit) as err:
            mig.main(["--dir", str(tmp_path)])
        assert err.value.code == 2 and json.loads((tmp_path / "a.json").read_text()) == old


def test_migrate_cli_refuses_an_unreadable_file(tmp_path, capsys):
    """A folder named zz.json or a non-UTF-8 file: one line, exit 2, nothing written (a traceback before)."""
    old = {"suite": "moe", "copy": {"bytes": 2048, "timing": {}, "copy_bandwidth_Bps": 1.0}}
    (tmp_path / "a.json").write_text(mig.dumps(old))
    bad = tmp_path / "zz.json"

    def refused(why):
        with pytest.raises(SystemExit) as err:
            mig.main(["--dir", str(tmp_path)])
        msg = capsys.readouterr().err.splitlines()[-1]
        assert err.value.code == 2, msg
        assert msg.startswith(f"python3 tools/migrate_results.py: error: {bad}: {why}"), msg
        assert msg.endswith("; nothing migrated") and json.loads((tmp_path / "a.json").read_text()) == old

    bad.mkdir()
    refused("cannot be read (Is a directory)")
    bad.rmdir()
    bad.write_bytes(b'{"suite": "\xff"}')
    refused("not UTF-8 text ('utf-8' codec can't decode byte 0xff")


# ----------------------------------------------------------------------------- typed loaders
def test_load_moe_rows_carry_the_recorded_figures():
    rec = results.load_moe("h200")
    raw = {r["m"]: r for r in rec.doc["rows"]}
    assert len(rec.select(op="moe_bf16_grouped_mm")) == len(raw)
    for row in rec.rows:
        r = raw[row.shape["m"]]
        assert row.median_ms == r[row.key]["median_ms"] and row.p90_ms == r[row.key]["p90_ms"]
        assert row.flops <= r["flops"]
    v1 = {r.shape["m"]: r for r in rec.select(op="moe_w4a16", version=1, mode="eager", variant="")}
    assert {r.key for r in v1.values()} == {"kernel"} and set(v1) == set(raw)
    for row in rec.select(variant="default"):
        picked = raw[row.shape["m"]]["kernel_default_version"]
        assert row.version == (picked[0] if len(picked) == 1 else None)
    for row in rec.rows:
        if row.version in (2, 3) and row.variant in ("", "v1_kernels"):  # v3 shares v2's regime
            outside = raw[row.shape["m"]].get("kernel_v2_path", "v2") != "v2"
            assert (row.variant == "v1_kernels") == outside, (row.key, row.shape)
    stage = rec.select(variant="gate_up_only")[0]
    assert stage.bytes == pytest.approx(raw[stage.shape["m"]]["weight_bytes"] * 2 / 3)
    # the floors the payload records beside the whole-layer arms (every row's was None)
    assert stage.floor_ms is None
    for row in v1.values():
        assert row.floor_ms == raw[row.shape["m"]]["kernel_floor"]["floor_ms"]
    for row in rec.select(op="moe_bf16_grouped_mm"):
        assert row.floor_ms == raw[row.shape["m"]]["baseline_floor"]["floor_ms"]


def test_load_moe_stream_rows_and_copy_block():
    rec = results.load_moe_stream("h200")
    assert len(rec.rows) == len(rec.doc["stream"])
    assert all(r.op == "stream_read" and r.flops == 0 for r in rec.rows)
    copy = rec.doc["copy"]
    assert copy["Bps"] == rec.doc["copy_bandwidth_Bps"] and copy["bytes_moved"] == 2 * copy["bytes_per_copy"]


def test_typed_loader_refuses_another_schema(results_dir):
    (results_dir / "moe.h200.json").write_text(json.dumps({"suite": "moe", "provenance": {}, "rows": []}))
    with pytest.raises(results.SchemaError, match=r"moe.h200.json: schema None.*migrate_results"):
        results.load_moe("h200")
    assert results.load_moe("b300") is None


def test_typed_loader_refuses_another_suites_file_and_names_a_missing_field(results_dir):
    """An attention record saved as moe.h200.json loaded as no rows; a row without a field the reader
    needs was a bare KeyError; neither named the file."""
    prov = {"gpu": "NVIDIA H200", "date": "2026-12-01T00:00:00Z", "commit": "c" * 40, "command": "t"}
    doc = {"suite": "attention", "schema": results.SCHEMA, "provenance": prov, "points": []}
    (results_dir / "moe.h200.json").write_text(json.dumps(doc))
    with pytest.raises(results.SchemaError, match=r"moe.h200.json: a record of suite 'attention', not of"):
        results.load_moe("h200")
    doc = {"suite": "moe", "schema": results.SCHEMA, "provenance": prov,
           "rows": [{"m": 1, "kernel": {"median_ms": 1.0}, "flops": 1.0}]}
    (results_dir / "moe.h200.json").write_text(json.dumps(doc))
    with pytest.raises(results.SchemaError, match=r"moe.h200.json: not the 'moe' layout this code reads "
                                                  r"\(KeyError: 'bytes'\)"):
        results.load_moe("h200")
    doc = {"suite": "accept", "schema": results.SCHEMA, "provenance": prov, "rows": []}
    (results_dir / "accept_sampling.h200.json").write_text(json.dumps(doc))  # that run's own suite name
    assert results.load_accept_sampling("h200").rows == ()


def test_malformed_provenance_is_named_and_describe_takes_a_partial_one(results_dir):
    (results_dir / "s.a.json").write_text(json.dumps({"suite": "s", "provenance": "x"}))
    with pytest.raises(ValueError, match=r"s.a.json: provenance must be an object"):
        results.load("s")
    (results_dir / "s.a.json").write_text(json.dumps({"suite": "s", "provenance": {"date": 20261201}}))
    with pytest.raises(ValueError, match=r"s.a.json: provenance must be an object whose date is"):
        results.load("s")
    line = results.describe({"provenance": {"gpu": "NVIDIA H200"}, "_path": "x.json"})
    assert "commit ?" in line and "date not recorded" in line and line.endswith("-> x.json")


def test_ceilings_recorded_or_stated_fallback(results_dir, monkeypatch):
    """A suite divides by its own GPU's ceilings, the CPU (a notebook) and a GPU with none recorded by the
    H200's, an asked GPU with none by the stated fallback."""
    fb = results.ceilings()
    assert not fb.recorded and fb.bandwidth_Bps == results.FALLBACK_BW and "no ceilings file" in fb.source
    for slug, bw, date in (("h200", 4.2e12, "2026-11-29"), ("h100-80gb-hbm3", 3.0e12, "2026-12-05")):
        (results_dir / f"ceilings.{slug}.json").write_text(json.dumps(
            {"suite": "ceilings", "schema": 1, "provenance": {"date": f"{date}T00:00:00Z"},
             "copy_bandwidth_Bps": bw, "bf16_matmul_flops": 6.9e14}))
    h200 = results.Ceilings(4.2e12, 6.9e14, "ceilings.h200.json", True)
    assert results.ceilings("h200") == h200
    running = ["cpu"]
    monkeypatch.setattr(results, "gpu_name", lambda: running[0])
    assert results.ceilings() == h200
    running[0] = "NVIDIA H100 80GB HBM3"
    assert results.ceilings() == results.Ceilings(3.0e12, 6.9e14, "ceilings.h100-80gb-hbm3.json", True)
    running[0] = "NVIDIA B300"
    assert results.ceilings() == h200
    assert not results.ceilings("b300").recorded
    assert results.ceilings("h100").source == "ceilings.h100-80gb-hbm3.json"  # a prefix, as kdlib.hw takes
    (results_dir / "ceilings.b200.json").write_text(json.dumps(
        {"suite": "ceilings", "schema": 1, "provenance": {}, "copy_bandwidth_Bps": 7e12,
         "bf16_matmul_flops": None}))
    with pytest.raises(ValueError, match="ceilings.b200.json: copy_bandwidth_Bps and bf16_matmul_flops"):
        results.ceilings("b200")  # a damaged file is not "none recorded"


def test_write_names_the_file_by_suite_and_gpu_or_as_asked(tmp_path):
    default = results.write("s", {"value": 1}, out_dir=tmp_path, command="c")
    named = results.write("s", {"value": 2}, out_dir=tmp_path, command="c", name="k.src.8x9.abc1234")
    assert default.name == f"s.{results.gpu_slug(results.provenance()['gpu'])}.json"
    assert named == tmp_path / "k.src.8x9.abc1234.json"
    doc = json.loads(named.read_text())
    assert doc["suite"] == "s" and doc["value"] == 2 and doc["provenance"]["command"] == "c"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([default.name, named.name])  # no .tmp left


def test_write_keeps_numpy_kinds_and_its_own_stamp(tmp_path):
    """numpy values keep their JSON kind (an int stays an int, an array a list), an object without a
    JSON form is refused, and a payload cannot replace the provenance stamp."""
    import numpy as np

    path = results.write("s", {"n": np.int64(7), "x": np.float32(0.5), "ok": np.bool_(True),
                               "v": np.arange(3)}, out_dir=tmp_path, command="c")
    doc = json.loads(path.read_text())
    assert doc["n"] == 7 and isinstance(doc["n"], int) and doc["x"] == 0.5 and doc["ok"] is True
    assert doc["v"] == [0, 1, 2] and "tree_modified" in doc["provenance"]
    for bad in ({"provenance": {"gpu": "H200"}}, {"suite": "other"}, {"schema": 0}):
        with pytest.raises(ValueError, match="may not set"):
            results.write("s", {"value": 1, **bad}, out_dir=tmp_path, command="c", name="bad")
    with pytest.raises(TypeError, match="object"):
        results.write("s", {"value": object()}, out_dir=tmp_path, command="c", name="bad")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing half-written


def test_tree_modified_tells_a_clean_checkout_from_an_edited_one(tmp_path, monkeypatch):
    """A report names its commit; `tree_modified` says when tracked files differ from it."""
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("one\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    monkeypatch.setattr(results, "ROOT", tmp_path)
    monkeypatch.delenv("KDLIB_COMMIT", raising=False)
    (tmp_path / "untracked.txt").write_text("x\n")
    assert results.tree_modified() is False  # untracked files are not the commit's
    (tmp_path / "a.txt").write_text("two\n")
    assert results.tree_modified() is True
    monkeypatch.setenv("KDLIB_COMMIT", "0" * 40)  # a copied tree without .git: unknown
    assert results.tree_modified() is None


def test_a_damaged_result_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(results, "ROOT", tmp_path)
    (tmp_path / "toy.h200.json").write_text('{"provenance": {"date": "2026')  # cut short
    with pytest.raises(ValueError, match="toy.h200.json: not valid JSON"):
        results.load("toy", "h200")
    (tmp_path / "toy.h200.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="toy.h200.json: a result file holds a JSON object, not list"):
        results.load("toy")


def test_no_samples_is_a_clear_error():
    from kdlib.perf import timing

    with pytest.raises(ValueError, match="no timed samples"):
        timing.cpu_time(lambda: None, warmup=0, iters=0)


def test_provenance_names_the_nvrtc_options_of_a_switched_build(monkeypatch):
    """A run under KDLIB_NVRTC_OPTIONS (a -D switch's build, which the command line does not show) says so in
    its provenance; a default build's provenance has no such field."""
    monkeypatch.delenv("KDLIB_NVRTC_OPTIONS", raising=False)
    assert "nvrtc_options" not in results.provenance()
    monkeypatch.setenv("KDLIB_NVRTC_OPTIONS", " -DTV_TRACE=1 -lineinfo ")
    assert results.provenance()["nvrtc_options"] == "-DTV_TRACE=1 -lineinfo"
