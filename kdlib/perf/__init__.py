"""Measurement: CUDA-event timing, byte/FLOP bookkeeping, result files with provenance.

`python3 -m kdlib.perf.run --suite NAME` is the GPU entry point; each suite lives in
`kdlib.perf.suites.<name>` and returns a payload that `results.write` stamps with provenance.
"""

from kdlib.perf.results import describe, load, provenance, write
from kdlib.perf.timing import Timing, cpu_time, cuda_time, floor_ms, host_probe_ms

__all__ = [
    "Timing",
    "cpu_time",
    "cuda_time",
    "floor_ms",
    "host_probe_ms",
    "describe",
    "load",
    "provenance",
    "write",
]
