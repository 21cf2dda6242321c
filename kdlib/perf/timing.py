"""The one timing layer of the suites: warm-up, many repeats, median and quantiles.

GPU work is timed with CUDA events (torch or CuPy, whichever array module the callable uses):
`cuda_time` brackets eager calls, `graph_time` replays what a callable launches from CUDA graphs
(no Python launch cost: the device time; `graph_timer` keeps the graphs for timing again),
`replay_time` replays graphs captured elsewhere,
`graph_or_eager` falls back to eager calls where a torch capture fails. CPU work is timed with
`time.perf_counter`. A benchmark reports the median; p10/p90 show the spread.

Suites defeat the L2 by rotating disjoint input sets (`l2_rotations`), not by flushing it between
calls; `clocks` records the SM / memory clocks around a sweep, `copy_bandwidth` measures the
device-to-device copy rate a floor divides by.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
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
    if not samples_ms:
        raise ValueError("no timed samples (iters must be >= 1)")
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
    fn: Callable[[], object], *, warmup: int = 5, iters: int = 50, backend: str = "torch",
    between: Callable[[], object] | None = None,
) -> Timing:
    """Median device time of `fn()` in ms, each call bracketed by CUDA events on the current stream.

    backend: "torch" (torch.cuda.Event) or "cupy" (cupy.cuda.Event); both see the same device.
    between: called before each timed call, outside its events (e.g. `l2_flush`: every call then starts
    from a cold L2, as a layer's weights do inside a whole step).
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
        if between is not None:
            between()
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


def l2_rotations(set_bytes: float, *, target_bytes: float = 256e6, max_sets: int = 8,
                 fit: int | None = None) -> int:
    """How many disjoint input sets of `set_bytes` a timed point cycles through: enough that one pass
    moves `target_bytes` (> 4x the H200's 60 MB L2) where `max_sets` (and `fit`, the sets the allocated
    pool holds) allow, at least 1. Small sets stay under it: `l2_resident` says where a cycle may still
    find its inputs cached."""
    n = min(max_sets, math.ceil(target_bytes / set_bytes))
    return max(1, n if fit is None else min(n, fit))


def l2_resident(set_bytes: float, rotations: int, l2_bytes: float | None = None) -> bool:
    """Whether a cycle of `rotations` sets of `set_bytes` is under twice the L2 (`l2_bytes`; None: the
    current GPU's): a replay may then find its inputs there, and a time against HBM's bandwidth reads too
    fast."""
    if l2_bytes is None:
        import torch

        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    return set_bytes * rotations < 2 * l2_bytes


def l2_flush(factor: int = 2) -> Callable[[], None]:
    """A callable that overwrites `factor` x the current GPU's L2 (torch: one memset of a buffer made once),
    evicting whatever a timed call left there."""
    import torch

    buf = torch.empty(factor * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8,
                      device="cuda")  # [factor x L2 bytes]

    def flush():
        buf.zero_()

    return flush


def clocks() -> str | None:
    """nvidia-smi's 'SM clock, memory clock, temperature, power' of every GPU, or None without it or where
    it fails (it prints its failure message to stdout: not a reading)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
             "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _sequence(launches) -> list[Callable[[], object]]:
    return [launches] if callable(launches) else list(launches)


def cupy_graphs(launches, *, repeats: int = 1, warm: int = 1,
                torch_stream: bool = False) -> tuple[list, object]:
    """Capture each callable of `launches` (one or a sequence), called `repeats` times back to back,
    into its own CUDA graph on one non-blocking CuPy stream; returns (graphs, stream).

    warm: eager calls of each callable on that stream before any capture (compilation, pool
    growth). torch_stream: torch's current stream is the capture stream too, so that torch ops and
    the DLPack hand-over of torch inputs inside the callables are captured with no cross-stream event.
    """
    import cupy

    fns = _sequence(launches)
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs = []
    with contextlib.ExitStack() as ctx:
        ctx.enter_context(stream)
        if torch_stream:
            import torch

            ctx.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)))
        for fn in fns:
            for _ in range(warm):
                fn()
        stream.synchronize()
        for fn in fns:
            stream.begin_capture()
            for _ in range(repeats):
                fn()
            graphs.append(stream.end_capture())
    return graphs, stream


def replay_time(graphs, stream, *, iters: int, warmup: int | None = None) -> Timing:
    """Device time of one graph launch on `stream` (CuPy graphs, one or a list replayed in turn).
    warmup: untimed launches, by default one per graph and at least 3."""
    graphs = [graphs] if not isinstance(graphs, Sequence) else list(graphs)
    state = {"i": 0}

    def replay():
        graphs[state["i"] % len(graphs)].launch(stream=stream)
        state["i"] += 1

    with stream:
        return cuda_time(replay, warmup=max(3, len(graphs)) if warmup is None else warmup, iters=iters,
                         backend="cupy")


def graph_time(
    launches,
    *,
    iters: int,
    warmup: int | None = None,
    repeats: int = 1,
    warm: int = 1,
    backend: str = "cupy",
    torch_stream: bool = False,
    pool=None,
) -> Timing:
    """Device time of a CUDA-graph replay of what `launches` (one callable, or a sequence replayed in
    turn: rotated inputs) launches, each captured `repeats` times per graph (divide by `repeats` for
    one call). A capture failure raises.

    backend "cupy": CuPy stream capture (`cupy_graphs`; `torch_stream` as there); "torch":
    `torch.cuda.CUDAGraph` capture after `warm` calls on a side stream (as capture requires), in the
    memory pool `pool` when given. warmup: untimed replays (default as `replay_time`; 1 for torch).
    """
    return graph_timer(launches, repeats=repeats, warm=warm, backend=backend, torch_stream=torch_stream,
                       pool=pool)(iters=iters, warmup=warmup)


def graph_timer(launches, *, repeats: int = 1, warm: int = 1, backend: str = "cupy",
                torch_stream: bool = False, pool=None) -> Callable[..., Timing]:
    """`graph_time`'s capture done once: returns time(iters=, warmup=None) -> Timing, which replays the
    same graphs each call (interleaved A/B rounds time several arms in turn without capturing again).
    Arguments as `graph_time`. The timer holds `launches`, and so whatever their closures hold: a graph
    replays fixed addresses, and the buffers behind them, freed and reused, would be read and written
    (the attention suite's duels, timed after their point's inputs were dropped, hit an illegal address)."""
    if backend == "cupy":
        graphs, stream = cupy_graphs(launches, repeats=repeats, warm=warm, torch_stream=torch_stream)

        def time_cupy(*, iters: int, warmup: int | None = None) -> Timing:
            return replay_time(graphs, stream, iters=iters, warmup=warmup)

        time_cupy.launches = launches
        return time_cupy
    if backend != "torch":
        raise ValueError(f"backend must be 'cupy' or 'torch', got {backend!r}")
    tgraphs = torch_graphs(launches, warm=warm, repeats=repeats, pool=pool)
    state = {"i": 0}

    def replay():
        tgraphs[state["i"] % len(tgraphs)].replay()
        state["i"] += 1

    def time_torch(*, iters: int, warmup: int | None = None) -> Timing:
        return cuda_time(replay, warmup=1 if warmup is None else warmup, iters=iters, backend="torch")

    time_torch.launches = launches
    return time_torch


def torch_graphs(launches, *, warm: int = 1, repeats: int = 1, pool=None) -> list:
    """Each callable of `launches` (one or a sequence) called `warm` times on a side stream (as capture
    requires: kernels built, memory grown), then captured `repeats` times into its own
    `torch.cuda.CUDAGraph` (`torch_graph`, in the memory pool `pool` when given). A capture failure raises."""
    import torch

    fns = _sequence(launches)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            for _ in range(warm):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return [torch_graph(fn, repeats=repeats, pool=pool) for fn in fns]


def torch_graph(fn: Callable[[], object], *, repeats: int = 1, pool=None):
    """fn called `repeats` times, captured into a `torch.cuda.CUDAGraph` (in the memory pool `pool` when
    given) and returned for replay; warm fn up first (capture needs its kernels built and its memory
    grown). A capture failure raises."""
    import torch

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        for _ in range(repeats):
            fn()
    return g


def graph_record(launches, **kw) -> dict:
    """`graph_time(launches, **kw)` as a dict, or {"error": "..."} where the capture fails: one
    configuration of a sweep that cannot be captured must not cost the others their numbers."""
    try:
        return graph_time(launches, **kw).as_dict()
    except Exception as err:  # noqa: BLE001 - recorded in the row, the sweep goes on
        return {"error": f"{type(err).__name__}: {err}"[:300]}


def graph_or_eager(fn: Callable[[], object], *, iters: int, warmup: int = 1,
                   pool=None) -> tuple[Timing, str, str | None]:
    """torch `graph_time` of fn, or eager `cuda_time` where the capture fails: (timing, "graph" or
    "eager", the capture error or None). Time a row that cannot be captured rather than lose it."""
    import torch

    try:
        return graph_time(fn, iters=iters, warmup=warmup, backend="torch", pool=pool), "graph", None
    except Exception as err:  # noqa: BLE001 - an op that cannot be captured: time it eagerly and say why
        torch.cuda.synchronize()
        return cuda_time(fn, warmup=warmup, iters=iters), "eager", f"{type(err).__name__}: {err}"[:300]


def copy_bandwidth(nbytes: int = 1 << 30, *, method: str = "memcpy", warmup: int = 3,
                   iters: int = 20) -> dict:
    """Device-to-device copy rate of `nbytes` (torch, the current GPU), the copy checked exact.

    method "memcpy": `dst.copy_(src)` of uint8, one cudaMemcpyAsync; "kernel": `torch.mul(src, 1.0,
    out=dst)` of float32 in [1, 3] (finite and normal, so x * 1 reproduces x bit for bit), one
    streaming kernel. Bytes moved = 2 x nbytes (read + write); `Bps` = moved / median time. The data
    is a fixed non-constant pattern, not drawn from the CUDA generator: a failed graph capture earlier
    in the process (graph_or_eager's fallback) can leave that generator unusable."""
    import torch

    if method == "memcpy":
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # [nbytes] the bytes 0..250 repeating
        row = torch.arange(251, dtype=torch.uint8, device="cuda")
        src[: nbytes // 251 * 251].view(-1, 251).copy_(row)
        src[nbytes // 251 * 251 :] = row[: nbytes % 251]
    elif method == "kernel":
        # [nbytes / 4]
        src = torch.arange(nbytes // 4, dtype=torch.float32, device="cuda").mul_(0.618).sin_().add_(2.0)
    else:
        raise ValueError(f"copy method must be 'memcpy' or 'kernel', got {method!r}")
    dst = torch.empty_like(src)

    def fn():
        if method == "memcpy":
            dst.copy_(src)
        else:
            torch.mul(src, 1.0, out=dst)

    t = cuda_time(fn, warmup=warmup, iters=iters)
    if not torch.equal(dst, src):
        raise AssertionError(f"{method} copy of {nbytes} bytes did not reproduce its source")
    moved = 2 * nbytes
    return {"method": method, "bytes_per_copy": nbytes, "bytes_moved": moved, "timing": t.as_dict(),
            "Bps": moved / (t.median_ms * 1e-3), "checked": True}
