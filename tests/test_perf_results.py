"""kdlib.perf.results: which recorded file `load` picks, the typed loaders, the schema migration."""

from __future__ import annotations

import json
import os

import pytest

from kdlib.perf import results


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
