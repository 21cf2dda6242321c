"""tools/v11_probe.py's build-switch arms (--define): version 11's by default, another impl's when named, and
a clear refusal of anything else (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import v11_probe  # noqa: E402


def test_a_define_is_version_11s_unless_it_names_an_impl():
    assert v11_probe.define_arm("PLAN_SMALL_REQS=0") == ("wgmma_v11", "PLAN_SMALL_REQS=0")
    assert v11_probe.define_arm("wgmma_v12:PLAN_SMALL_REQS=0") == ("wgmma_v12", "PLAN_SMALL_REQS=0")


@pytest.mark.parametrize("bad", ["wgmma_v99:X=1", "auto:X=1", "X", "wgmma_v12:=1", "wgmma_v12:1X=2"])
def test_a_define_of_no_impl_or_no_switch_is_refused(bad):
    with pytest.raises(ValueError, match="NAME=VALUE or IMPL:NAME=VALUE"):
        v11_probe.define_arm(bad)


def test_an_also_that_names_no_impl_is_refused_before_anything_runs(capsys, tmp_path):
    """--also wgmma_v21 failed after the first point's arms ran, and nothing was written."""
    with pytest.raises(SystemExit) as exit_:
        v11_probe.main(["--out", str(tmp_path / "made"), "--also", "wgmma_v21"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--also wgmma_v21: not a kdlib.cuda.attention impl" in err
    assert not (tmp_path / "made").exists()
