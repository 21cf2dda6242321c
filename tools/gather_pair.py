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
from kdlib.perf.energy import Meter, check_window, launch_rounds

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


def parser(doc: str) -> argparse.ArgumentParser:
    """The gather probes' arguments (this tool's and tools/gather_stage.py's), doc: the tool's docstring."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=folder, help="folder of the record")
    ap.add_argument("--slots", type=positive_int, default=32768, help="rows of the pool")
    ap.add_argument("--reads", type=positive_int, default=1 << 20, help="rows read a launch")
    ap.add_argument("--rounds", type=positive_int, default=7)
    ap.add_argument("--seconds", type=float, default=2.0, help="an arm's launches a round (seconds, about)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def checked_args(ap: argparse.ArgumentParser, argv):
    """ap's arguments once the --seconds window, the GPU and the --out folder are checked (one line each)."""
    a = ap.parse_args(argv)
    check_window(ap, a.seconds)
    require_gpu(ap)
    make_folder(ap, a.out)
    return a


def random_pool(a) -> tuple[np.ndarray, np.ndarray]:
    """The probe's pool [slots, ROW_WORDS] uint32 (random words) and rows [reads] int32 (random slots, with
    repeats), from --seed."""
    rng = np.random.default_rng(a.seed)
    return (rng.integers(0, 2**32, size=(a.slots, ROW_WORDS), dtype=np.uint32),
            rng.integers(0, a.slots, size=a.reads, dtype=np.int32))


def measure(tag: str, launches: dict, out, want: dict, a, meter: Meter) -> dict:
    """Each arm (launches: arm -> a launch of it into out) once from a zeroed out against the host's
    want [arm] (`exact`), its full-clock CUDA-event median of 20 launches after 3 (`timing`), then --rounds
    interleaved rounds under the energy counter (`rounds`) -> {arm: record}; each arm's medians printed."""
    import cupy

    from kdlib.perf import timing

    arms = {}
    for arm, go in launches.items():
        out.fill(0)
        go()
        exact = bool((cupy.asnumpy(out) == want[arm]).all())
        t = timing.cuda_time(go, warmup=3, iters=20, backend="cupy")
        arms[arm] = {"exact": exact, "timing": t.as_dict()}
        print(f"[{tag}] {arm}: exact {exact}, {t.median_ms:.4f} ms", flush=True)
    for arm, got in launch_rounds(launches, meter, a.rounds, a.seconds).items():
        arms[arm]["rounds"] = got
    print(f"[{tag}] " + "; ".join(
        f"{arm} {statistics.median(x['joules'] for x in v['rounds']) * 1e3:.3f} mJ "
        f"{statistics.median(x['median_ms'] for x in v['rounds']):.4f} ms "
        f"{statistics.median(x['sm_mhz'] for x in v['rounds']):.0f} MHz" for arm, v in arms.items()),
        flush=True)
    return arms


def energy_ratio(arms: dict, num: str, den: str) -> list[float]:
    """Arm num's energy a launch over arm den's, round by round."""
    return [x["joules"] / y["joules"] for x, y in zip(arms[num]["rounds"], arms[den]["rounds"], strict=True)]


def finish(tag: str, arms: dict, extra: dict, a, meter: Meter, threads: int, smem: int) -> None:
    """Write the record (results.write: the run's parameters, the arms, `extra`), then exit 1 naming it where
    an arm was not exact."""
    from kdlib.perf import results

    doc = {"parameters": {"slots": a.slots, "reads": a.reads, "rounds": a.rounds, "seconds": a.seconds,
                          "seed": a.seed, "row_bytes": ROW_WORDS * 4, "threads": threads, "smem": smem,
                          "power_limit_w": meter.limit_w},
           "arms": arms, **extra}
    print(results.write(tag, doc, out_dir=a.out, command=" ".join(["python3"] + sys.argv)))
    if not all(v["exact"] for v in doc["arms"].values()):
        sys.exit(f"{tag}: an arm's XOR differs from the host's (recorded, exact false)")


def main(argv=None) -> None:
    ap = parser(__doc__)
    a = checked_args(ap, argv)
    import cupy

    pool_h, rows_h = random_pool(a)
    pool, rows = cupy.asarray(pool_h), cupy.asarray(rows_h)
    out = cupy.zeros((2, 4), dtype=cupy.uint32)
    grid = {arm: pairs_held(arm) for arm in ARMS}
    launches = {arm: lambda arm=arm: launch(arm, pool, rows, out, grid[arm]) for arm in ARMS}
    want = np.stack([expected_xor(pool_h, rows_h)] * 2)  # each rank's
    meter = Meter()
    arms = measure("gather_pair", launches, out, {arm: want for arm in ARMS}, a, meter)
    row_bytes = ROW_WORDS * 4
    for arm, v in arms.items():
        ms = v["timing"]["median_ms"]
        delivered = 2 * a.reads * row_bytes  # into both CTAs' shared memory
        l2 = delivered if arm == "dup" else delivered // 2
        v.update(grid=grid[arm], delivered_gbps=delivered / ms / 1e6, l2_read_gbps=l2 / ms / 1e6)
    ratio = energy_ratio(arms, "mcast", "dup")
    print(f"[gather_pair] mcast / dup energy, median round {statistics.median(ratio):.4f}", flush=True)
    finish("gather_pair", arms, {"mcast_over_dup": ratio}, a, meter, THREADS, SMEM)


if __name__ == "__main__":
    main()
