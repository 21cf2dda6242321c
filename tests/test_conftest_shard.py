"""tests/conftest.py's --shard K/N: the shares of a selection are disjoint, together the whole in collection
order, of as many tests as can be (a large file split between shares); a malformed K/N stops pytest with a
usage error."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = ["tests/test_hw.py", "tests/test_memory.py", "tests/test_plot.py"]


def _collect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *args, *FILES], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _ids(run: subprocess.CompletedProcess) -> list[str]:
    assert run.returncode == 0, run.stdout + run.stderr
    return [line for line in run.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def whole() -> list[str]:
    return _ids(_collect())


@pytest.mark.parametrize("n", [2, 3])
def test_shards_cut_the_selection_into_runs_of_equal_counts(whole, n):
    shares = [_ids(_collect("--shard", f"{k}/{n}")) for k in range(1, n + 1)]
    assert len(whole) >= 2 * n and all(shares)
    assert [i for share in shares for i in share] == whole  # in order, each test once
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("spec", ["0/2", "3/2", "1-2", "a/b"])
def test_a_malformed_shard_is_a_usage_error(spec):
    run = _collect("--shard", spec)
    assert run.returncode == 4 and "--shard wants K/N" in run.stderr, run.stdout + run.stderr
