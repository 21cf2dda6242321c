"""The register split of the tree verify's warp-specialised attend kernels (issue 19), from ptxas (no GPU).

Version 10's file (kernels/tree_verify/wgmma_v10.cu, sm_90a) is built with setmaxnreg's two values moved one
at a time (-DPRODUCER_REGS over PRODUCERS with the consumers at their default, -DCONSUMER_REGS over CONSUMERS
with the producer at its default), and ptxas's report (-Xptxas -v) of every kernel is kept: registers, stack
frame, spills. A warpgroup's code fits its count where no kernel that runs it spills. What it answers: the
fewest registers each warpgroup needs, so what the SM's 65,536 leave for anything else (notebook 02b, 13s).

The rows sweep builds the same file with version 9's consumers (the swap-AB code) at every row count -DTV9_NR
up to 72 (8 heads x 9 queries in one job, past the V9_MAX_NR the source allows) at the defaults, and keeps the
report of the kernels that run those consumers: where they spill (notebook 02b, 13v). ptxas reports spills by
kernel, not by warpgroup, so the sweep keeps the producer at its default, where it does not spill.

    python3 tools/register_budget.py --out DIR        -> DIR/register_budget.cpu.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdlib.cli import output_folder  # noqa: E402
from kdlib.cuda import loader  # noqa: E402
from kdlib.perf import results  # noqa: E402
from kdlib.perf.suites.attention_bounds import SM_REGS, cta_register_pool  # noqa: E402

STEM = "tree_verify/wgmma_v10"
ARCH = "sm_90a"
WARPGROUP = 128  # threads of a warpgroup (4 warps): the producer's, and each consumer's
PRODUCERS = (24, 32, 40)
CONSUMERS = (160, 168, 176, 200, 208, 216, 224, 232)  # past where v9's consumers (attend_t) spill, and v7's
ROWS = tuple(range(8, 73, 8))  # -DTV9_NR of the rows sweep: 8 .. 72 rows a job
V9_KERNELS = ("tree_verify_v9_attend", "tree_verify_v10_attend_t", "tree_verify_v10_attend_t_own")


def builds() -> list[tuple[int, int]]:
    """(producer, consumer) registers of each build: one count moved at a time from the source's defaults."""
    c = loader.source_constants(STEM)
    p0, c0 = c["PRODUCER_REGS"], c["CONSUMER_REGS"]
    grid = [(p, c0) for p in PRODUCERS] + [(p0, r) for r in CONSUMERS]
    return sorted(set(grid))


def consumers_left(producer: int) -> int:
    """The registers a thread setmaxnreg can give the consumer warpgroups beside a producer at `producer`:
    what that leaves of the CTA's register pool (the registers it launches with), a multiple of 8."""
    threads = loader.source_constants(STEM)["NTHREADS"]
    per_thread = cta_register_pool(threads) // WARPGROUP
    return (per_thread - producer) // (threads // WARPGROUP - 1) // 8 * 8


def rows_builds() -> list[tuple[int, int, int]]:
    """(rows, producer, consumer) of the rows sweep: every ROWS at the defaults."""
    c = loader.source_constants(STEM)
    return [(r, c["PRODUCER_REGS"], c["CONSUMER_REGS"]) for r in ROWS]


def report(producer: int, consumer: int, rows: int | None = None) -> dict:
    """ptxas's report of one build: {kernel: {registers, stack, spill_stores, spill_loads, static_smem}}; with
    `rows`, version 9's consumers built for that many (-DTV9_NR, the source's V9_MAX_NR raised to it)."""
    defines = (f"PRODUCER_REGS={producer}", f"CONSUMER_REGS={consumer}")
    if rows is not None:
        defines += (f"TV9_NR={rows}", f"V9_MAX_NR={max(rows, loader.source_constants(STEM)['V9_MAX_NR'])}")
    rc, text = loader.compile_report(STEM, ARCH, defines=defines)
    if rc != 0:
        raise RuntimeError(f"nvcc failed on {STEM} with {' '.join(defines)}:\n{text}")
    return loader.parse_ptxas(text)


def measure() -> dict:
    """The record's payload: parameters and one row per build."""
    grid = builds()
    sweep = rows_builds()
    with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        done = pool.map(lambda b: report(*b), grid)
        reports = list(tqdm(done, total=len(grid), desc="ptxas", unit="build"))
        done = pool.map(lambda b: report(b[1], b[2], rows=b[0]), sweep)
        swept = list(tqdm(done, total=len(sweep), desc="ptxas, rows", unit="build"))
    c = loader.source_constants(STEM)
    return {
        "parameters": {"stem": STEM, "arch": ARCH, "producers": list(PRODUCERS), "consumers": list(CONSUMERS),
                       "default": {"producer": c["PRODUCER_REGS"], "consumer": c["CONSUMER_REGS"]},
                       "threads": {"producer": WARPGROUP, "consumers": c["NTHREADS"] - WARPGROUP},
                       "register_file": SM_REGS, "nvcc": loader.nvcc_version().strip().splitlines()[-1],
                       "rows": list(ROWS), "v9_max_nr": c["V9_MAX_NR"],
                       "consumers_left": {str(p): consumers_left(p) for p in PRODUCERS}},
        "builds": [{"producer": p, "consumer": r, "kernels": k}
                   for (p, r), k in zip(grid, reports, strict=True)],
        "rows_builds": [{"rows": n, "producer": p, "consumer": r, "kernels": {v: k[v] for v in V9_KERNELS}}
                        for (n, p, r), k in zip(sweep, swept, strict=True)],
        "notes": ["a build per (producer, consumer): setmaxnreg's values as -DPRODUCER_REGS, -DCONSUMER_REGS "
                  "(kernels/tree_verify/wgmma_ws.cuh), nvcc -cubin -arch=sm_90a -Xptxas -v, no GPU",
                  "kernels: ptxas's report per kernel (kdlib.cuda.loader.parse_ptxas)",
                  "rows_builds: version 9's consumers built for `rows` rows a job (-DTV9_NR, -DV9_MAX_NR "
                  "raised past the source's v9_max_nr where needed), the kernels that run them"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=output_folder, help="folder for register_budget.cpu.json")
    a = ap.parse_args(argv)
    if loader.nvcc_path() is None:
        ap.error("nvcc not found (PATH or $NVCC)")
    path = results.write("register_budget", measure(), out_dir=a.out, name="register_budget.cpu")  # host-only
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
