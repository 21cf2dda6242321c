"""kdlib.perf.timing, the one timing layer of the suites: its CPU-checkable rules here, CUDA-graph
replay, the eager fallback and the copy rate on the GPU (`python3 -m pytest -m gpu
tests/test_perf_timing.py`)."""

import ast
import gc
import os
import weakref
from pathlib import Path

import pytest

from kdlib import ROOT
from kdlib.perf import timing

SUITES = ROOT / "kdlib" / "perf" / "suites"


def test_l2_rotations_reach_the_target_within_the_bounds():
    assert timing.l2_rotations(256e6) == 1
    assert timing.l2_rotations(100e6) == 3  # ceil(256 / 100)
    assert timing.l2_rotations(1e6) == 8  # capped at max_sets
    assert timing.l2_rotations(1e6, max_sets=20) == 20
    assert timing.l2_rotations(1e6, fit=5) == 5  # what the pool holds
    assert timing.l2_rotations(1e6, fit=0) == 1  # never fewer than one set
    assert timing.l2_rotations(10e9) == 1
    # a small set cycles under the L2 however many sets the cap allows: the point says so
    n = timing.l2_rotations(1.2e6)
    assert n == 8 and timing.l2_resident(1.2e6, n, l2_bytes=60e6)
    assert not timing.l2_resident(100e6, timing.l2_rotations(100e6), l2_bytes=60e6)


def test_graph_time_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be 'cupy' or 'torch'"):
        timing.graph_time(lambda: None, iters=1, backend="numpy")


def test_graph_record_turns_a_capture_failure_into_an_error_row():
    row = timing.graph_record(lambda: None, iters=1, backend="numpy")
    assert set(row) == {"error"} and row["error"].startswith("ValueError: backend must be")


def test_copy_bandwidth_rejects_an_unknown_method():
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="copy method must be 'memcpy' or 'kernel'"):
        timing.copy_bandwidth(1 << 10, method="dma")


def _nvidia_smi(tmp_path, monkeypatch, script: str) -> None:
    """A stand-in `nvidia-smi` (sh `script`) first on PATH."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    exe = bin_ / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{script}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")


def test_clocks_is_the_reading_line(tmp_path, monkeypatch):
    _nvidia_smi(tmp_path, monkeypatch, 'echo "  1980 MHz, 2619 MHz, 41, 72.50 W  "')
    assert timing.clocks() == "1980 MHz, 2619 MHz, 41, 72.50 W"


def test_clocks_is_none_where_nvidia_smi_fails_or_is_missing(tmp_path, monkeypatch):
    # nvidia-smi prints its failure to stdout and exits non-zero: no reading
    _nvidia_smi(tmp_path, monkeypatch,
                "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                "Make sure that the latest NVIDIA driver is installed and running.\"\nexit 9")
    assert timing.clocks() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert timing.clocks() is None


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)


def _private_uses(path: Path) -> list[str]:
    """`mod._name` where mod is a kdlib module imported into the file (from-imports of `_name` too)."""
    tree = ast.parse(path.read_text())
    modules, out = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kdlib"):
            for a in node.names:
                modules.add(a.asname or a.name)
                # _attention: the attention suites' shared module inside this package, not a private name
                if a.name.startswith("_") and a.name != "_attention":
                    out.append(f"from {node.module} import {a.name}")
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name.startswith("kdlib"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            out.append(f"{node.value.id}.{node.attr}")
    return out


def test_no_suite_imports_a_private_name_or_times_graphs_itself():
    """Every suite times CUDA graphs through kdlib.perf.timing and uses only public names of other modules."""
    for path in sorted(SUITES.glob("*.py")):
        text = path.read_text()
        private = _private_uses(path)
        assert not private, f"{path.name} uses private names: {private}"
        for marker in ("begin_capture(", "torch.cuda.CUDAGraph(", "nvidia-smi"):
            assert marker not in text, f"{path.name} does its own {marker!r}: use kdlib.perf.timing"
        assert ".cuda.graph(" not in text, f"{path.name} captures a torch graph itself"


# Private names imported across modules outside kdlib.perf and still allowed: none since issue 21 made
# them public. A new one fails the test below; an entry added here goes once its file no longer has it.
PENDING: set[tuple[str, str]] = set()


def test_no_kdlib_module_imports_a_private_name_of_another():
    kdlib = ROOT / "kdlib"
    found = {(p.relative_to(kdlib).as_posix(), u) for p in kdlib.rglob("*.py") for u in _private_uses(p)}
    assert not found - PENDING, f"private names used across modules: {sorted(found - PENDING)}"
    assert not PENDING - found, f"gone, drop from PENDING: {sorted(PENDING - found)}"


def test_tp_workers_and_the_tp_suite_do_not_import_each_other_in_a_circle():
    workers = dict(_imports(ROOT / "kdlib" / "tp" / "workers.py"))
    assert not any(m.startswith("kdlib.perf.suites") for m in workers), "kdlib.tp.workers imports a suite"


@pytest.mark.gpu
def test_cupy_graph_replay_times_the_captured_launches():
    cupy = pytest.importorskip("cupy")
    x = cupy.arange(1 << 20, dtype=cupy.float32)  # [1M]
    outs = [cupy.empty_like(x) for _ in range(3)]
    launches = [lambda o=o: cupy.multiply(x, 2.0, out=o) for o in outs]
    t = timing.graph_time(launches, iters=20)
    assert t.n == 20 and 0 < t.p10_ms <= t.median_ms <= t.p90_ms
    for o in outs:  # every rotation's graph ran
        assert bool((o == 2 * x).all())
    t10 = timing.graph_time(launches[0], iters=20, repeats=10)
    assert t10.median_ms > t.median_ms  # ten launches per graph take longer than one


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch"])
def test_graph_timer_captures_once_and_replays_the_same_graphs_each_time(backend):
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)  # [1M]
    y = torch.zeros_like(x)
    calls = []

    def launch():  # Python runs only while warming and capturing; a replay adds 1 on the device
        calls.append(1)
        y.add_(1.0)

    timer = timing.graph_timer(launch, backend=backend, torch_stream=backend == "cupy")
    ran = len(calls)  # the warm call and the capture
    a, b = timer(iters=5, warmup=1), timer(iters=7, warmup=2)
    torch.cuda.synchronize()
    assert len(calls) == ran == 2 and (a.n, b.n) == (5, 7)
    assert torch.equal(y, torch.full_like(x, 1 + 5 + 1 + 7 + 2))  # the warm call, then every replay


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch"])
def test_graph_timer_keeps_the_buffers_its_graphs_use(backend):
    """A timer built where its inputs are local (the attention suite's points) still replays into them once
    every other reference is gone and the caching allocators were asked to give memory back."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")

    def build():
        y = torch.zeros(1 << 20, device="cuda", dtype=torch.float32)  # [1M]
        return timing.graph_timer(lambda: y.add_(1.0), backend=backend, torch_stream=backend == "cupy"), \
            weakref.ref(y)

    timer, y_ref = build()
    gc.collect()
    torch.cuda.empty_cache()
    assert y_ref() is not None, "the timer let its graph's buffer go"
    timer(iters=5, warmup=1)
    torch.cuda.synchronize()
    assert torch.equal(y_ref(), torch.full((1 << 20,), 1.0 + 5 + 1, device="cuda"))  # warm call, replays


@pytest.mark.gpu
def test_torch_graph_time_and_the_eager_fallback():
    torch = pytest.importorskip("torch")
    x = torch.randn(1 << 20, device="cuda")  # [1M]
    y = torch.empty_like(x)
    t, mode, err = timing.graph_or_eager(lambda: torch.mul(x, 3.0, out=y), iters=10)
    assert (mode, err) == ("graph", None) and t.n == 10
    assert torch.equal(y, x * 3.0)

    def syncing():  # .item() synchronises: not capturable
        return float(x.sum().item())

    t, mode, err = timing.graph_or_eager(syncing, iters=5)
    assert mode == "eager" and err and t.n == 5


@pytest.mark.gpu
def test_copy_bandwidth_is_checked_and_positive():
    pytest.importorskip("torch")
    for method in ("memcpy", "kernel"):
        c = timing.copy_bandwidth(64 << 20, method=method, iters=5)
        assert c["checked"] and c["bytes_moved"] == 2 * c["bytes_per_copy"] == 2 * (64 << 20)
        assert c["Bps"] == pytest.approx(c["bytes_moved"] / (c["timing"]["median_ms"] * 1e-3))
