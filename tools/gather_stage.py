"""The tree-verify kernels' K-stage fill without their math: the same 64-row tiles of scattered latent-cache
rows into the same 128-byte-swizzled stages, by the verify's 16-byte cp.async copies (`cp16`) or by one TMA
box a 128-byte row piece (`tma`, eight times fewer copy instructions), kernels/gather_read/stage_v1.cu
(notebook 02b, 13zp); and by two CTAs of a cluster that both need every tile, as two row blocks of one key
chunk do: each fetching every row itself by cp16's copies (`dup`, today's verify) or each fetching half the
rows and pushing them into the other's stage with the bulk copy engine (`push`, each row read once from L2).

The single arms run one CTA a streaming multiprocessor, the pair arms every CTA pair the device holds at once,
over --reads random rows (with repeats) of a pool of --slots rows (default: the 64 x 65 x 32k goal point's
prefix, which L2 holds; 200000, the 8 x 9 x 200k point's, which it does not). Recorded per arm, as
tools/gather_pair.py records its arms: each CTA rank's rotated XOR against the one computed here (`exact`: a
chunk in the wrong place of the swizzle changes it), the CUDA-event median of 20 launches after 3, the rows'
bytes a second at that time (`gbps`; `delivered_gbps` into every CTA's shared memory and `l2_read_gbps` from
L2), the copy instructions a CTA a tile, and --rounds interleaved rounds under NVML's energy counter.
`tma_over_cp16`, `push_over_dup`: the energy ratios a round, where both arms ran.

On the GPU machine:
    KDLIB_COMMIT=<sha> PYTHONPATH=$PWD python3 tools/gather_stage.py --out $OUT [--arms cp16,dup,push]
        -> $OUT/gather_stage.<gpu>.json
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from gather_pair import ROW_WORDS, checked_args, energy_ratio, finish, measure, parser, random_pool

from kdlib.cuda import loader
from kdlib.perf.energy import Meter

SOURCE = "gather_read/stage_v1"
ARMS = ("cp16", "tma", "dup", "push")
PAIR_ARMS = ("dup", "push")  # clusters of two CTAs that both read every tile
_C = loader.source_constants(SOURCE)
THREADS, SMEM, BN, NCB = _C["STAGE_THREADS"], _C["STAGE_SMEM"], _C["BN"], _C["NCB"]
CHUNKS = ROW_WORDS // 4  # 16-byte chunks of a row: 72
# copy instructions a CTA issues a 64-row tile (push: its 32 rows' cp.async, one bulk copy a column block)
COPIES = {"cp16": BN * CHUNKS, "tma": BN * NCB, "dup": BN * CHUNKS, "push": BN // 2 * CHUNKS + NCB}


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


def expected_out(pool: np.ndarray, rows: np.ndarray, arm: str) -> np.ndarray:
    """What arm's launch folds into out [2, 4] uint32 (`expected_xor` of the rows read): each CTA rank's XOR,
    rank 1's zero where the arm runs no clusters."""
    want = expected_xor(pool, rows)
    return np.stack([want, want if arm in PAIR_ARMS else np.zeros_like(want)])


def launch(arm: str, pool, tmap, rows, out, grid: int) -> None:
    """One launch of arm's kernel on `grid` CTAs (even for the pair arms: clusters of two) over CuPy pool
    [slots, ROW_WORDS] uint32, its tensor map tmap (pool_map; the tma arm's), rows [n] int32 -> out [2, 4]
    uint32: out [r] ^= the readers' XOR of CTA rank r."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    if grid <= 0 or (arm in PAIR_ARMS and grid % 2):
        even = ", even (pairs)," if arm in PAIR_ARMS else ""
        raise ValueError(f"grid must be a positive number of CTAs{even} got {grid}")
    kernel(arm)((grid,), (THREADS,), (pool, tmap, rows, np.int64(rows.size), out), shared_mem=SMEM)


def kernel(arm: str):
    """arm's kernel, built for sm_90a, its dynamic shared memory allowed."""
    fn = loader.get_function(SOURCE, f"gather_stage_v1_{arm}", options=loader.SM90A_OPTIONS)
    loader.set_max_dynamic_shared(fn, SMEM)
    return fn


def arm_list(text: str) -> tuple[str, ...]:
    """--arms: a comma-separated subset of ARMS, in ARMS' order."""
    got = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in got if x not in ARMS]
    if bad or not got:
        raise argparse.ArgumentTypeError(
            f"arms must be a comma-separated subset of {', '.join(ARMS)}, got {text!r}")
    return tuple(x for x in ARMS if x in got)


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--arms", type=arm_list, default=ARMS, help=f"comma-separated, of {', '.join(ARMS)}")
    a = checked_args(ap, argv)
    import cupy

    pool_h, rows_h = random_pool(a)
    pool, rows = cupy.asarray(pool_h), cupy.asarray(rows_h)
    tmap = pool_map(pool) if "tma" in a.arms else None
    out = cupy.zeros((2, 4), dtype=cupy.uint32)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]  # one CTA an SM (STAGE_SMEM > half of one)
    grid = {arm: 2 * loader.max_active_clusters(kernel(arm), 2, THREADS, SMEM) if arm in PAIR_ARMS else sms
            for arm in a.arms}
    launches = {arm: lambda arm=arm: launch(arm, pool, tmap, rows, out, grid[arm]) for arm in a.arms}
    meter = Meter()
    want = {arm: expected_out(pool_h, rows_h, arm) for arm in a.arms}
    arms = measure("gather_stage", launches, out, want, a, meter)
    row_bytes = ROW_WORDS * 4
    for arm, v in arms.items():
        ms = v["timing"]["median_ms"]
        delivered = (2 if arm in PAIR_ARMS else 1) * a.reads * row_bytes  # into every CTA's shared memory
        l2 = delivered // 2 if arm == "push" else delivered  # from L2: push reads each row once for both CTAs
        v.update(grid=grid[arm], copies_a_tile=COPIES[arm], gbps=a.reads * row_bytes / ms / 1e6,
                 delivered_gbps=delivered / ms / 1e6, l2_read_gbps=l2 / ms / 1e6)
    ratios = {f"{num}_over_{den}": energy_ratio(arms, num, den)
              for num, den in (("tma", "cp16"), ("push", "dup")) if num in arms and den in arms}
    for k, r in ratios.items():
        print(f"[gather_stage] {k} energy, median round {statistics.median(r):.4f}", flush=True)
    finish("gather_stage", arms, ratios, a, meter, THREADS, SMEM)


if __name__ == "__main__":
    main()
