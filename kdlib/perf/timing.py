"""Timing with warm-up, many repeats, median and quantiles.

GPU work is timed with CUDA events (torch or CuPy, whichever array module the callable uses);
CPU work with `time.perf_counter`. A benchmark reports the median; p10/p90 show the spread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    n: int

    def as_dict(self) -> dict:
        return asdict(self)


def _summarise(samples_ms: list[float]) -> Timing:
    s = sorted(samples_ms)
    q = statistics.quantiles(s, n=10, method="inclusive") if len(s) > 1 else [s[0]] * 9
    return Timing(median_ms=statistics.median(s), p10_ms=q[0], p90_ms=q[-1], min_ms=s[0], n=len(s))


def cpu_time(fn: Callable[[], object], *, warmup: int = 3, iters: int = 20) -> Timing:
    """Median wall time of `fn()` in ms after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _summarise(samples)


def host_probe_ms(n: int = 1_000_000) -> float:
    """Wall ms of a fixed pure-Python loop of `n` additions: a gauge of the host CPU's current speed.

    A host-bound measurement (Python dispatch, eager launches) taken next to it can be read against
    it: on a shared machine this probe itself drifts by ~2x over seconds."""
    t0 = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i
    return (time.perf_counter() - t0) * 1e3


def cuda_time(
    fn: Callable[[], object], *, warmup: int = 5, iters: int = 50, backend: str = "torch"
) -> Timing:
    """Median device time of `fn()` in ms, each call bracketed by CUDA events on the current stream.

    backend: "torch" (torch.cuda.Event) or "cupy" (cupy.cuda.Event); both see the same device.
    """
    if backend == "torch":
        import torch

        def make_event():
            return torch.cuda.Event(enable_timing=True)

        def elapsed(a, b):
            return a.elapsed_time(b)

        sync = torch.cuda.synchronize
    elif backend == "cupy":
        import cupy

        def make_event():
            return cupy.cuda.Event()

        def elapsed(a, b):
            return cupy.cuda.get_elapsed_time(a, b)

        sync = cupy.cuda.runtime.deviceSynchronize
    else:
        raise ValueError(f"backend must be 'torch' or 'cupy', got {backend!r}")
    for _ in range(warmup):
        fn()
    sync()
    pairs = [(make_event(), make_event()) for _ in range(iters)]
    for start, stop in pairs:
        start.record()
        fn()
        stop.record()
    sync()
    return _summarise([elapsed(a, b) for a, b in pairs])


def floor_ms(bytes_moved: float, flops: float, *, bandwidth_Bps: float, flop_rate: float) -> dict:
    """The physical floor: max(bytes / bandwidth, FLOPs / rate), and which term binds."""
    mem_ms = bytes_moved / bandwidth_Bps * 1e3
    compute_ms = flops / flop_rate * 1e3
    return {
        "floor_ms": max(mem_ms, compute_ms),
        "mem_ms": mem_ms,
        "compute_ms": compute_ms,
        "bound": "memory" if mem_ms >= compute_ms else "compute",
    }
