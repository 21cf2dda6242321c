"""Two CTAs that need the same latent-cache rows in shared memory, as two row blocks of one key chunk do in
the tree-verify kernels: each fetching every row itself (`dup`, today's verify) or each fetching half of them
for both by TMA multicast (`mcast`), kernels/gather_read/pair_v1.cu (notebook 02b, 13zo).

Both arms run on every CTA pair the device holds at once, over --reads random rows (with repeats) of a pool of
--slots rows (default: the 64 x 65 x 32k goal point's prefix, which L2 holds), and deliver the same bytes into
shared memory; `dup` reads twice the bytes from L2. Recorded per arm: the XOR of what each CTA rank received
against the one computed here (`exact`), the CUDA-event median of 20 launches after 3 (full clock), the bytes
delivered into shared memory and read from L2 a second at that time, and --rounds interleaved rounds of
about --seconds of launches back to back under NVML's energy counter (kdlib.perf.energy): joules a launch,
watts, the SM clock and whether the power cap held it. `mcast_over_dup`: the energy ratio a round.

On the GPU machine:
    KDLIB_COMMIT=<sha> PYTHONPATH=$PWD python3 tools/gather_pair.py --out $OUT  -> $OUT/gather_pair.<gpu>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from kdlib.cli import folder, make_folder, positive_int, require_gpu
from kdlib.cuda import loader
from kdlib.perf.energy import Meter, check_window, interleaved, sustained

SOURCE = "gather_read/pair_v1"
ARMS = ("dup", "mcast")
_C = loader.source_constants(SOURCE)
THREADS, SMEM, ROW_WORDS = _C["PAIR_WARPS"] * 32, _C["PAIR_SMEM"], _C["PAIR_ROW_CHUNKS"] * 4


def expected_xor(pool: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """What each CTA rank folds: the XOR of every row read ([n] slots into pool [slots, ROW_WORDS] uint32), by
    word lane (w % 4) -> [4] uint32. A row read twice cancels, so only the slots read an odd number of times
    count."""
    odd = np.bincount(rows, minlength=len(pool)) % 2 == 1
    return np.bitwise_xor.reduce(pool[odd].reshape(-1, 4), axis=0) if odd.any() else np.zeros(4, np.uint32)


def launch(arm: str, pool, rows, out, grid: int) -> None:
    """One launch of arm's kernel on `grid` CTAs (even: pairs) over CuPy pool [slots, ROW_WORDS] uint32 and
    rows [n] int32 -> out [2, 4] uint32 ^= each rank's XOR."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    if grid <= 0 or grid % 2:
        raise ValueError(f"grid must be a positive even number of CTAs (pairs), got {grid}")
    kernel(arm)((grid,), (THREADS,), (pool, rows, np.int64(rows.size), out), shared_mem=SMEM)


def kernel(arm: str):
    """arm's kernel, built for sm_90a, its dynamic shared memory allowed."""
    fn = loader.get_function(SOURCE, f"gather_pair_v1_{arm}", options=loader.SM90A_OPTIONS)
    loader.set_max_dynamic_shared(fn, SMEM)
    return fn


def pairs_held(arm: str) -> int:
    """The CTAs of arm's kernel the device holds at once (two a cluster)."""
    return 2 * loader.max_active_clusters(kernel(arm), 2, THREADS, SMEM)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=folder, help="folder of the record")
    ap.add_argument("--slots", type=positive_int, default=32768, help="rows of the pool")
    ap.add_argument("--reads", type=positive_int, default=1 << 20, help="rows read a launch")
    ap.add_argument("--rounds", type=positive_int, default=7)
    ap.add_argument("--seconds", type=float, default=2.0, help="an arm's launches a round (seconds, about)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    check_window(ap, a.seconds)
    require_gpu(ap)
    make_folder(ap, a.out)
    import cupy

    from kdlib.perf import results, timing

    rng = np.random.default_rng(a.seed)
    pool_h = rng.integers(0, 2**32, size=(a.slots, ROW_WORDS), dtype=np.uint32)  # [slots, 288] a row's words
    rows_h = rng.integers(0, a.slots, size=a.reads, dtype=np.int32)  # [reads] slots, with repeats
    pool, rows = cupy.asarray(pool_h), cupy.asarray(rows_h)
    want = expected_xor(pool_h, rows_h)
    out = cupy.zeros((2, 4), dtype=cupy.uint32)
    meter = Meter()
    row_bytes = ROW_WORDS * 4
    arms = {}
    for arm in ARMS:
        grid = pairs_held(arm)
        out.fill(0)
        launch(arm, pool, rows, out, grid)
        got = cupy.asnumpy(out)
        t = timing.cuda_time(lambda arm=arm, grid=grid: launch(arm, pool, rows, out, grid), warmup=3,
                             iters=20, backend="cupy")
        delivered = 2 * a.reads * row_bytes  # into both CTAs' shared memory
        l2 = delivered if arm == "dup" else delivered // 2
        arms[arm] = {"grid": grid, "exact": bool((got == want).all()), "timing": t.as_dict(),
                     "delivered_gbps": delivered / t.median_ms / 1e6, "l2_read_gbps": l2 / t.median_ms / 1e6}
        print(f"[gather_pair] {arm}: grid {grid}, exact {arms[arm]['exact']}, {t.median_ms:.4f} ms, "
              f"{arms[arm]['delivered_gbps']:.0f} GB/s into shared memory", flush=True)

    def timed(arm, calls):  # interleaved's: calls launches back to back, each between CUDA events
        grid = arms[arm]["grid"]

        def timer(iters, warmup):
            return timing.cuda_time(lambda: launch(arm, pool, rows, out, grid), warmup=warmup, iters=iters,
                                    backend="cupy")
        return timer(iters=20, warmup=3) if calls is None else sustained(timer, meter, calls)

    for arm, got in interleaved(list(ARMS), timed, a.rounds, a.seconds).items():
        arms[arm]["rounds"] = got
    ratio = [m["joules"] / d["joules"]
             for m, d in zip(arms["mcast"]["rounds"], arms["dup"]["rounds"], strict=True)]
    print("[gather_pair] " + "; ".join(
        f"{arm} {statistics.median(x['joules'] for x in v['rounds']) * 1e3:.3f} mJ "
        f"{statistics.median(x['median_ms'] for x in v['rounds']):.4f} ms "
        f"{statistics.median(x['sm_mhz'] for x in v['rounds']):.0f} MHz" for arm, v in arms.items())
        + f"; mcast / dup energy, median round {statistics.median(ratio):.4f}", flush=True)
    doc = {"parameters": {"slots": a.slots, "reads": a.reads, "rounds": a.rounds, "seconds": a.seconds,
                          "seed": a.seed, "row_bytes": row_bytes, "threads": THREADS, "smem": SMEM,
                          "power_limit_w": meter.limit_w},
           "arms": arms, "mcast_over_dup": ratio}
    print(results.write("gather_pair", doc, out_dir=a.out, command=" ".join(["python3"] + sys.argv)))
    if not all(v["exact"] for v in arms.values()):
        sys.exit("gather_pair: an arm's XOR differs from the host's (recorded, exact false)")


if __name__ == "__main__":
    main()
