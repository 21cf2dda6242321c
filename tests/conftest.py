"""Shared pytest set-up: the `gpu` marker skips cleanly without a CUDA device, and modules that need
the notebook or web stack are left out where that stack is absent (the GPU machine has no nbformat,
papermill or FastAPI; `python3 -m pytest -m gpu tests` must still collect there). On CPU machines the
Makefile's venv has all of them, so nothing is left out. `--shard K/N` runs the K-th of N shares of the
selected tests (the GPU suite outlasts one device call). `host_emulation` builds a kernel source for the
host (tests/emu)."""

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

# test module -> the package it imports at module level
_NEEDS = {
    "test_audit.py": "nbformat",
    "test_notebooks_batch.py": "papermill",
    "test_render_chromium.py": "nbformat",
    "test_report.py": "nbformat",
    "test_serve.py": "fastapi",
}
collect_ignore = [name for name, package in _NEEDS.items() if importlib.util.find_spec(package) is None]


def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        pass
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N shares of the selected tests (after -m and -k): the selection "
                          "in collection order cut into N runs of as many tests as can be, so that one large "
                          "file does not make one share (a suite longer than one device call over N calls)")


def _shard(spec: str) -> tuple[int, int]:
    """'K/N' -> (K, N) with 1 <= K <= N; anything else is a usage error."""
    m = re.fullmatch(r"(\d+)/(\d+)", spec)
    if m is None or not 1 <= int(m[1]) <= int(m[2]):
        raise pytest.UsageError(f"--shard wants K/N with 1 <= K <= N, got {spec!r}")
    return int(m[1]), int(m[2])


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected: the shares deal the files that remain
def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec is not None:
        k, n = _shard(spec)
        lo, hi = len(items) * (k - 1) // n, len(items) * k // n  # a file may span two shares
        config.hook.pytest_deselected(items=items[:lo] + items[hi:])
        items[:] = items[lo:hi]
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run with python3 -m pytest -m gpu on the GPU "
                                   "machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _torch_one_thread():
    """Tiny models gain nothing from intra-op threads; one thread keeps parallel test workers (xdist,
    2 cores) from thrashing. Only where the test module has imported torch already."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The kernel's one dynamic shared-memory declaration, which the emulation points at its guarded buffer
_SMEM_DECL = re.compile(r"extern __shared__ (?:__align__\(16\) )?(unsigned char|int) smem\[\];")


@pytest.fixture(scope="session")
def host_emulation(tmp_path_factory):
    """build(stem, driver) -> ctypes handle of kernels/<stem>.cu compiled by g++ for the host, with
    tests/emu/cuda_shim.h in front (one ucontext per CUDA thread of a block, blocks one after another;
    warp intrinsics exchange through a buffer between two warp barriers, so lanes run in lock step where
    the kernel relies on it; shared memory ends at a guard page and starts out stale) and
    tests/emu/<driver>.cpp behind it (the kernel's C entry point)."""
    import ctypes

    from kdlib.cuda import loader

    def build(stem: str, driver: str):
        gxx = shutil.which("g++")
        if gxx is None:
            pytest.skip("g++ not found")
        src = loader.expanded_source(stem)  # headers inlined: g++ sees one file
        decls = _SMEM_DECL.findall(src)
        assert len(decls) == 1, "the shim replaces the kernel's one dynamic shared-memory declaration"
        d = tmp_path_factory.mktemp(stem.replace("/", "_"))
        emu = Path(__file__).parent / "emu"
        (d / "emu.cpp").write_text(
            (emu / "cuda_shim.h").read_text()
            + _SMEM_DECL.sub(lambda m: f"{m.group(1)}* smem = ({m.group(1)}*)emu_smem();", src)
            + (emu / f"{driver}.cpp").read_text()
        )
        run = subprocess.run(
            [gxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-o", str(d / "emu.so"), str(d / "emu.cpp")],
            capture_output=True, text=True,
        )
        assert run.returncode == 0, run.stderr
        return ctypes.CDLL(str(d / "emu.so"))

    return build
