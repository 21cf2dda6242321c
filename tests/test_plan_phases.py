"""tools/plan_phases.py without a GPU: its stamped copy of the kernels builds (nvcc PTX for sm_90a), the
version 10 plan kernel reads the clock at every stamp there and nowhere in the shipped build; its CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kdlib import KERNELS, ROOT
from kdlib.cuda import loader

sys.path.insert(0, str(ROOT / "tools"))
import plan_phases  # noqa: E402


def _plan_ptx(kernels, out):
    """The PTX body of tree_verify_v10_plan built from the tree `kernels`."""
    cmd = [loader.nvcc_path(), "-std=c++17", "-ptx", "-arch=sm_90a", f"-I{kernels}", "-o", str(out),
           str(kernels / "tree_verify" / "wgmma_v10.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    bodies = {b.split("(")[0]: b for b in out.read_text().split(".entry ")[1:]}
    return bodies["tree_verify_v10_plan"]


@pytest.mark.skipif(loader.nvcc_path() is None, reason="nvcc not found on PATH")
def test_stamped_copy_builds_and_stamps_the_plan_kernel_only(tmp_path):
    tree = plan_phases.stamped_tree(tmp_path / "kernels")
    stamped = _plan_ptx(tree, tmp_path / "stamped.ptx")
    shipped = _plan_ptx(KERNELS, tmp_path / "shipped.ptx")
    # the places a stamp is written (less the #define; one place writes stamps 3-6, a warp's each)
    sites = sum(new.count("STAMP(") for _, new in plan_phases.COMMON + plan_phases.V10) - 1
    assert sites == len(plan_phases.PHASES) - 3 + 2  # stamps 9 and 11 are each written at two places
    assert stamped.count("%clock64") >= sites
    assert "%clock64" not in shipped
    assert (tmp_path / "kernels" / "tree_verify" / "wgmma_v10.cu").read_text() != \
        (KERNELS / "tree_verify" / "wgmma_v10.cu").read_text()


def test_a_missing_anchor_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_phases, "V10", plan_phases.V10 + [("no such line\n", "")])
    with pytest.raises(SystemExit, match="no such line"):
        plan_phases.stamped_tree(tmp_path / "kernels")


def test_cli_takes_phases_or_cost(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["plan_phases.py", "timeline", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        plan_phases.main()
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
