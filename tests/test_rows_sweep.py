"""tools/rows_sweep.py's grid (no GPU): every tree size up to the attention suite's two 8 x 9 points, and the
consumers the default attend kernel runs at each, which decides where the sweep probes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import rows_sweep  # noqa: E402

from kdlib.perf.suites import attention  # noqa: E402


def test_the_sweep_ends_at_the_suites_8_x_9_points():
    pts = rows_sweep.points()
    assert len(pts) == 2 * 9 and len({tuple(p.values()) for p in pts}) == len(pts)
    nine = [p for p in pts if p["queries"] == 9]
    assert all(p in attention.POINTS for p in nine) and len(nine) == 2
    assert {p["queries"] for p in pts} == set(range(1, 10)) and {p["heads"] for p in pts} == {8}


def test_version_9s_consumers_up_to_16_rows_then_version_7s():
    got = {q: rows_sweep.consumers(8 * q) for q in rows_sweep.QUERIES}
    assert {q for q, c in got.items() if c == "version 9's"} == {1, 2}
    assert {got[q] for q in range(3, 10)} == {"version 7's"}
    both = {"gathers", "consumers"}
    assert [set(rows_sweep.probes(8 * q)) for q in (1, 2, 3, 9)] == [{"consumers"}] * 2 + [both] * 2
    assert [p["queries"] for p in rows_sweep.points((1, 8))] == [1, 8, 1, 8]
