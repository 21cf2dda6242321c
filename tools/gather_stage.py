"""The tree-verify kernels' K-stage fill without their math: the same 64-row tiles of scattered latent-cache
rows into the same 128-byte-swizzled stages, by the verify's 16-byte cp.async copies (`cp16`) or by one TMA
box a 128-byte row piece (`tma`, eight times fewer copy instructions), kernels/gather_read/stage_v1.cu
(notebook 02b, 13zp).

Both arms run one CTA a streaming multiprocessor over --reads random rows (with repeats) of a pool of --slots
rows (default: the 64 x 65 x 32k goal point's prefix, which L2 holds; 200000, the 8 x 9 x 200k point's, which
it does not). Recorded per arm, as tools/gather_pair.py records its arms: the reader's rotated XOR against
the one computed here (`exact`: a chunk in the wrong place of the swizzle changes it), the CUDA-event median
of 20 launches after 3, the rows' bytes a second at that time, the copy instructions a tile, and --rounds
interleaved rounds under NVML's energy counter. `tma_over_cp16`: the energy ratio a round.

On the GPU machine:
    KDLIB_COMMIT=<sha> PYTHONPATH=$PWD python3 tools/gather_stage.py --out $OUT
        -> $OUT/gather_stage.<gpu>.json
"""

from __future__ import annotations

import statistics

import numpy as np
from gather_pair import ROW_WORDS, checked_args, energy_ratio, finish, measure, parser, random_pool

from kdlib.cuda import loader
from kdlib.perf.energy import Meter

SOURCE = "gather_read/stage_v1"
ARMS = ("cp16", "tma")
_C = loader.source_constants(SOURCE)
THREADS, SMEM, BN, NCB = _C["STAGE_THREADS"], _C["STAGE_SMEM"], _C["BN"], _C["NCB"]
CHUNKS = ROW_WORDS // 4  # 16-byte chunks of a row: 72
COPIES = {"cp16": BN * CHUNKS, "tma": BN * NCB}  # copy instructions a 64-row tile


def expected_xor(pool: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """What the reader folds: word k of chunk q of every row read ([n] slots into pool [slots, ROW_WORDS]
    uint32), rotated left by q % 32, XORed by k -> [4] uint32. A row read twice cancels."""
    odd = np.bincount(rows, minlength=len(pool)) % 2 == 1
    w = pool[odd].reshape(-1, CHUNKS, 4).astype(np.uint64)  # [rows, 72 chunks, 4 words]
    r = (np.arange(CHUNKS, dtype=np.uint64) % 32)[None, :, None]
    rot = ((w << r) | (w >> (np.uint64(32) - r))) & np.uint64(0xFFFFFFFF)
    return np.bitwise_xor.reduce(rot.reshape(-1, 4), axis=0).astype(np.uint32) if odd.any() \
        else np.zeros(4, np.uint32)


def pool_map(pool):
    """The TMA arm's tensor map of CuPy pool [slots, ROW_WORDS] uint32 as [slots, 576] bf16 rows, boxes of one
    row by 64 columns (128 B) in the 128-byte swizzle, on the device (cupy uint8 [128])."""
    import cupy

    slots = pool.shape[0]
    return cupy.asarray(loader.tensor_map_2d(pool.data.ptr, "bfloat16", slots, 2 * ROW_WORDS, 4 * ROW_WORDS,
                                             1, 64, swizzle=128))


def launch(arm: str, pool, tmap, rows, out, grid: int) -> None:
    """One launch of arm's kernel on `grid` CTAs over CuPy pool [slots, ROW_WORDS] uint32, its tensor map tmap
    (pool_map; the tma arm's), rows [n] int32 -> out [4] uint32 ^= the reader's XOR."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    if grid <= 0:
        raise ValueError(f"grid must be a positive number of CTAs, got {grid}")
    kernel(arm)((grid,), (THREADS,), (pool, tmap, rows, np.int64(rows.size), out), shared_mem=SMEM)


def kernel(arm: str):
    """arm's kernel, built for sm_90a, its dynamic shared memory allowed."""
    fn = loader.get_function(SOURCE, f"gather_stage_v1_{arm}", options=loader.SM90A_OPTIONS)
    loader.set_max_dynamic_shared(fn, SMEM)
    return fn


def main(argv=None) -> None:
    ap = parser(__doc__)
    a = checked_args(ap, argv)
    import cupy

    pool_h, rows_h = random_pool(a)
    pool, rows = cupy.asarray(pool_h), cupy.asarray(rows_h)
    tmap = pool_map(pool)
    out = cupy.zeros(4, dtype=cupy.uint32)
    grid = cupy.cuda.Device().attributes["MultiProcessorCount"]  # one CTA an SM (STAGE_SMEM > half of one)
    launches = {arm: lambda arm=arm: launch(arm, pool, tmap, rows, out, grid) for arm in ARMS}
    meter = Meter()
    arms = measure("gather_stage", launches, out, expected_xor(pool_h, rows_h), a, meter)
    row_bytes = ROW_WORDS * 4
    for arm, v in arms.items():
        ms = v["timing"]["median_ms"]
        v.update(grid=grid, copies_a_tile=COPIES[arm], gbps=a.reads * row_bytes / ms / 1e6)
    ratio = energy_ratio(arms, "tma", "cp16")
    print(f"[gather_stage] tma / cp16 energy, median round {statistics.median(ratio):.4f}", flush=True)
    finish("gather_stage", arms, {"tma_over_cp16": ratio}, a, meter, THREADS, SMEM)


if __name__ == "__main__":
    main()
