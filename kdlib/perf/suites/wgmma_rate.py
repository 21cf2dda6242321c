"""How long one SM's tensor cores take for each warpgroup MMA shape of the verify's attend kernels (issue 19;
notebook 02b, 13v: the form a pass of 72 rows could take is 64 rows one way and 8 the other, and what the 8
cost decides it).

`python3 -m kdlib.perf.run --suite wgmma_rate [--quick]`. `kernels/wgmma_rate/v1.cu` runs each shape on every
SM at once, both operands in shared memory as the kernels issue them, with nothing else running:

  * `st`: S^T's issue (version 9's `issue_st`), m64nNk16 over the 36 k-steps of a 576-dim row, N = 8 .. 72,
    and at N = 64 version 7's S = Q K^T (m64n64k16);
  * `pv`: O^T's issue (`issue_pv_t`), V^T MN-major from the key tile, 8 wgmmas a round.

Each at W = 1 and 2 warpgroups a CTA (two: versions 7-11's consumers issue at once). Recorded per row:

  * `timing`: the kernel's CUDA-event time (eager launches);
  * `cycles_per_wgmma`: each warpgroup's clock64 span / its wgmmas (median, min, max over the warpgroups);
  * `macs_per_clock`: the SM's multiply-adds a clock, W x 64 N 16 / the median cycles a wgmma;
  * `exact`: every accumulator equals `expected` (operands of -1, 0, 1: every sum exact in fp32).
"""

from __future__ import annotations

import numpy as np

from kdlib.cuda import loader
from kdlib.perf import timing

SOURCE = "wgmma_rate/v1"
KINDS = ("st", "pv")
_C = loader.source_constants(SOURCE)
CB, D, NMAX, MB, ACC, SMEM, MAX_WG = (_C[k] for k in ("RATE_CB", "RATE_D", "RATE_NMAX", "RATE_MB", "RATE_ACC",
                                                     "RATE_SMEM", "RATE_MAX_WG"))
SHAPES = {"st": (8, 16, 24, 32, 40, 48, 56, 64, 72), "pv": (8, 16, 24, 32, 40, 48, 56, 72)}
STEPS = {"st": 4 * CB, "pv": 4 * MB}  # wgmmas a round
REPS, QUICK_REPS = 2048, 128
_BF16_BITS = np.array([0xBF80, 0x0000, 0x3F80], dtype=np.uint16)  # -1, 0, 1


def _check(kind: str, n: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if n not in SHAPES[kind]:
        raise ValueError(f"n must be one of {SHAPES[kind]} for {kind}, got {n}")


def operands(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """a [64, D] and b [n, D] int8 of -1, 0, 1 (the key tile and the rows)."""
    rng = np.random.default_rng(seed)
    return rng.integers(-1, 2, size=(64, D), dtype=np.int8), rng.integers(-1, 2, size=(n, D), dtype=np.int8)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """-1, 0, 1 as bf16 bit patterns (uint16), the kernel's operand type."""
    return _BF16_BITS[x.astype(np.int64) + 1]


def expected(kind: str, n: int, reps: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A warpgroup's D after `reps` rounds -> [blocks, 64, n] float32: st one block, reps a b^T over all D
    dims; pv MB blocks, block mb reps V_mb^T P^T, V_mb a's dims [64 mb, 64 mb + 64), P b's first 64."""
    _check(kind, n)
    a, b = a.astype(np.int64), b.astype(np.int64)
    if kind == "st":
        d = (a @ b.T)[None]
    else:
        d = np.stack([a[:, 64 * mb:64 * mb + 64].T @ b[:, :64].T for mb in range(MB)])
    return (reps * d).astype(np.float32)


def unscramble(kind: str, n: int, vals: np.ndarray) -> np.ndarray:
    """A warpgroup's out [128, ACC] -> D [blocks, 64, n]: thread t (warp w, lane 4 g + t4) holds, of block mb,
    value 4 jj + 2 h + e at mb n / 2 + 4 jj + 2 h + e, row 16 w + g + 8 h, column 8 jj + 2 t4 + e."""
    _check(kind, n)
    t = np.arange(128)
    w, g, t4 = t // 32, t % 32 // 4, t % 4
    blocks = 1 if kind == "st" else MB
    d = np.empty((blocks, 64, n), dtype=vals.dtype)
    for mb in range(blocks):
        for jj in range(n // 8):
            for h in range(2):
                for e in range(2):
                    i = mb * (n // 2) + 4 * jj + 2 * h + e
                    d[mb, 16 * w + g + 8 * h, 8 * jj + 2 * t4 + e] = vals[:, i]
    return d


def launch(kind: str, n: int, warpgroups: int, reps: int, grid: int, a, b, out, cycles) -> None:
    """One launch: `grid` CTAs of `warpgroups` x 128 threads, a [64, D] and b [n, D] bf16 bits (uint16, CuPy),
    out [grid, warpgroups, 128, ACC] float32, cycles [grid, warpgroups] int64 (CuPy)."""
    _check(kind, n)
    if not 1 <= warpgroups <= MAX_WG:
        raise ValueError(f"warpgroups must be in [1, {MAX_WG}], got {warpgroups}")
    if reps < 1 or grid < 1:
        raise ValueError(f"reps and grid must be positive, got {reps} and {grid}")
    if a.shape != (64, D) or b.shape != (n, D):
        raise ValueError(f"a [64, {D}] and b [{n}, {D}], got {a.shape} and {b.shape}")
    if out.shape != (grid, warpgroups, 128, ACC) or cycles.shape != (grid, warpgroups):
        raise ValueError(f"out [{grid}, {warpgroups}, 128, {ACC}] and cycles [{grid}, {warpgroups}], got "
                         f"{out.shape} and {cycles.shape}")
    fn = loader.get_function(SOURCE, f"wgmma_rate_v1_{kind}", options=loader.SM90A_OPTIONS)
    loader.set_max_dynamic_shared(fn, SMEM)
    fn((grid,), (128 * warpgroups,), (a, b, np.int32(n), np.int32(reps), out, cycles), shared_mem=SMEM)


def _measure(kind: str, n: int, wgs: int, reps: int, iters: int, grid: int) -> dict:
    """One row of the record: shape (kind, n) at `wgs` warpgroups a CTA on `grid` CTAs."""
    import cupy

    a, b = operands(n)
    da, db = cupy.asarray(bf16_bits(a)), cupy.asarray(bf16_bits(b))
    out = cupy.zeros((grid, wgs, 128, ACC), dtype=cupy.float32)
    cycles = cupy.zeros((grid, wgs), dtype=cupy.int64)
    t = timing.cuda_time(lambda: launch(kind, n, wgs, reps, grid, da, db, out, cycles), warmup=2, iters=iters,
                         backend="cupy")
    got, want = cupy.asnumpy(out), expected(kind, n, reps, a, b)
    exact = all(np.array_equal(unscramble(kind, n, got[c, w]), want) for c in range(grid) for w in range(wgs))
    per = cupy.asnumpy(cycles).ravel() / (reps * STEPS[kind])
    med = float(np.median(per))
    return {"kind": kind, "n": n, "warpgroups": wgs, "timing": t.as_dict(),
            "cycles_per_wgmma": {"median": med, "min": float(per.min()), "max": float(per.max())},
            "macs_per_clock": wgs * 64 * n * 16 / med, "exact": exact}


def run(*, quick: bool = False) -> dict:
    """The suite (see the module docstring); quick: QUICK_REPS rounds, 5 timed launches (else REPS, 10)."""
    import cupy

    reps, iters = (QUICK_REPS, 5) if quick else (REPS, 10)
    grid = cupy.cuda.Device().attributes["MultiProcessorCount"]
    clocks_before = timing.clocks()
    rows = []
    for kind in KINDS:
        for n in SHAPES[kind]:
            for wgs in range(1, MAX_WG + 1):
                r = _measure(kind, n, wgs, reps, iters, grid)
                rows.append(r)
                print(f"[wgmma_rate] {kind} n={n} W={wgs}: {r['cycles_per_wgmma']['median']:.1f} cycles a "
                      f"wgmma, {r['macs_per_clock']:.0f} MAC a clock an SM, exact {r['exact']}", flush=True)
    return {
        "parameters": {"quick": quick, "reps": reps, "iters": iters, "grid": grid, "smem": SMEM,
                       "steps_per_round": STEPS, "shapes": {k: list(v) for k, v in SHAPES.items()},
                       "dims": D, "pv_blocks": MB},
        "clocks_before": clocks_before,
        "clocks_after": timing.clocks(),
        "rows": rows,
        "notes": [
            "st: m64nNk16, A the key tile K-major, B the rows K-major (N = 64: version 7's m64n64k16), 36 a "
            "round; pv: m64nNk16, A = V^T MN-major, B = P^T K-major, 8 a round; one commit and wait a round",
            "cycles_per_wgmma: a warpgroup's clock64 span / its wgmmas, over every CTA's warpgroups; "
            "macs_per_clock: the SM's, warpgroups x 64 N 16 / the median cycles",
        ],
    }
