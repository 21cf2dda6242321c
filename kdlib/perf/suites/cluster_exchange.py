"""What it costs the two CTAs of a cluster to swap one key tile's partial S^T through distributed shared
memory (issue 19; notebook 02b, 13t: the 8 x 9 points' next lever splits each row's dims over two CTAs).

`python3 -m kdlib.perf.run --suite cluster_exchange [--quick]`. `kernels/cluster_exchange/v1.cu`'s four
modes, each on one CTA pair per two SMs (a CTA asks for `SMEM` bytes, so that one fills an SM as the attend
kernel does) over `TILES` tiles: `peer` stores each tile's 18,432-B partial into the other CTA's shared
memory, `local` into its own, `none` nowhere, all passing one cluster barrier a tile; `async` stores into the
other CTA's memory with `st.async`, each tile's bytes completing on the receiver's mbarrier, and no cluster
barrier (the receiver's warps hand each buffer back on the sender's mbarrier). Recorded per mode:

  * `timing`: the kernel's CUDA-event time (eager launches; a launch is milliseconds long);
  * `us_per_tile`: the median over the tiles, all CTA pairs running at once;
  * `cycles_per_tile`: thread 0's clock64 span over the tiles / tiles, median, min and max over the CTAs;
  * `exact`: every accumulator equals `expected` (the partials are small integers, so every sum is exact).

`peer` less `none` is what the remote stores cost beside the barrier; `local` less `none` what the same stores
cost into a CTA's own shared memory; `async` what the exchange costs without a barrier a tile.
"""

from __future__ import annotations

import numpy as np

from kdlib.cuda import loader
from kdlib.perf import timing

SOURCE = "cluster_exchange/v1"
MODES = ("peer", "async", "local", "none")
_C = loader.source_constants(SOURCE)
THREADS, VEC, BUF_BYTES = _C["EX_THREADS"], _C["EX_VEC"], _C["EX_BUF_BYTES"]
TILES, QUICK_TILES = 4096, 256
SMEM = 200 * 1024  # dynamic shared memory a CTA asks for: one CTA an SM (the buffers are its first BUF_BYTES)


def expected(mode: str, tiles: int, rank: int) -> np.ndarray:
    """The accumulators of a CTA of cluster rank `rank` after `tiles` tiles of `mode` -> [VEC * 4] float32:
    element e sums part(t, r, e) = (e + 7 t + 3 r) % 13 over the tiles, of its own rank, then the other's
    (peer, async) or its own again (local)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    e = np.arange(4 * VEC, dtype=np.int64)[:, None]  # [elements, 1]
    t = np.arange(tiles, dtype=np.int64)[None, :]  # [1, tiles]

    def own(r: int) -> np.ndarray:
        return ((e + 7 * t + 3 * r) % 13).sum(axis=1)

    extra = {"peer": own(1 - rank), "async": own(1 - rank), "local": own(rank), "none": 0}[mode]
    return (own(rank) + extra).astype(np.float32)


def launch(mode: str, tiles: int, grid: int, out, cycles) -> None:
    """One launch of mode's kernel: `grid` CTAs (even: pairs), out [grid, VEC * 4] float32 and cycles [grid]
    int64 (CuPy)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if grid <= 0 or grid % 2:
        raise ValueError(f"grid must be a positive even number of CTAs (pairs), got {grid}")
    if out.shape != (grid, 4 * VEC) or cycles.shape != (grid,):
        raise ValueError(f"out [{grid}, {4 * VEC}] and cycles [{grid}], got {out.shape} and {cycles.shape}")
    fn = loader.get_function(SOURCE, f"cluster_exchange_v1_{mode}")
    loader.set_max_dynamic_shared(fn, SMEM)
    fn((grid,), (THREADS,), (np.int32(tiles), out, cycles), shared_mem=SMEM)


def run(*, quick: bool = False) -> dict:
    """The suite (see the module docstring); quick: QUICK_TILES tiles, 5 timed launches (else TILES, 10)."""
    import cupy

    tiles, iters = (QUICK_TILES, 5) if quick else (TILES, 10)
    grid = cupy.cuda.Device().attributes["MultiProcessorCount"] // 2 * 2
    out = cupy.zeros((grid, 4 * VEC), dtype=cupy.float32)
    cycles = cupy.zeros(grid, dtype=cupy.int64)
    clocks_before = timing.clocks()
    rows = []
    for mode in MODES:
        t = timing.cuda_time(lambda mode=mode: launch(mode, tiles, grid, out, cycles), warmup=2, iters=iters,
                             backend="cupy")
        got, cyc = cupy.asnumpy(out), cupy.asnumpy(cycles) / tiles
        want = [expected(mode, tiles, r) for r in (0, 1)]  # by the CTA's rank in its pair
        exact = all(np.array_equal(got[b], want[b % 2]) for b in range(grid))
        rows.append({"mode": mode, "timing": t.as_dict(), "us_per_tile": t.median_ms * 1e3 / tiles,
                     "cycles_per_tile": {"median": float(np.median(cyc)), "min": float(cyc.min()),
                                         "max": float(cyc.max())},
                     "exact": exact})
        print(f"[cluster_exchange] {mode}: {rows[-1]['us_per_tile']:.3f} us a tile, "
              f"{rows[-1]['cycles_per_tile']['median']:.0f} cycles (median CTA), exact {exact}", flush=True)
    return {
        "parameters": {"quick": quick, "tiles": tiles, "iters": iters, "grid": grid, "threads": THREADS,
                       "smem": SMEM, "bytes_per_tile": VEC * 16, "modes": list(MODES),
                       "tile": {"keys": _C["EX_KEYS"], "rows": _C["EX_ROWS"], "dtype": "float32"}},
        "clocks_before": clocks_before,
        "clocks_after": timing.clocks(),
        "rows": rows,
        "notes": [
            "peer: each CTA stores its tile's partial into the other's shared memory (st.shared::cluster); "
            "local: into its own; none: no store. These three: one cluster barrier a tile, then (peer, "
            "local) the buffer read back and added. async: st.async into the other's memory, completing on "
            "its mbarrier; no cluster barrier",
            "us_per_tile: the kernel's median time / tiles, every CTA pair running at once; cycles_per_tile: "
            "thread 0's clock64 span / tiles over the CTAs",
        ],
    }
