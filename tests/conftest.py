"""Shared pytest set-up: the `gpu` marker skips cleanly without a CUDA device, and modules that need
the notebook or web stack are left out where that stack is absent (the GPU machine has no nbformat,
papermill or FastAPI; `python3 -m pytest -m gpu tests` must still collect there). On CPU machines the
Makefile's venv has all of them, so nothing is left out."""

import importlib.util

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


def pytest_collection_modifyitems(config, items):
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
