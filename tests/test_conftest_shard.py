"""tests/conftest.py's --shard K/N: the shares of a selection are disjoint, together the whole, each file in
one share; a malformed K/N stops pytest with a usage error."""

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


def test_shards_split_the_selection_by_file():
    whole = _ids(_collect())
    shares = [_ids(_collect("--shard", f"{k}/2")) for k in (1, 2)]
    assert whole and all(shares)
    assert sorted(shares[0] + shares[1]) == sorted(whole)
    files = [{i.split("::")[0] for i in share} for share in shares]
    assert not files[0] & files[1]
    assert files[0] == {FILES[0], FILES[2]} and files[1] == {FILES[1]}  # dealt in path order


@pytest.mark.parametrize("spec", ["0/2", "3/2", "1-2", "a/b"])
def test_a_malformed_shard_is_a_usage_error(spec):
    run = _collect("--shard", spec)
    assert run.returncode == 4 and "--shard wants K/N" in run.stderr, run.stdout + run.stderr
