"""The register split of the tree verify's warp-specialised attend kernels (issue 19), from ptxas (no GPU).

Version 10's file (kernels/tree_verify/wgmma_v10.cu, sm_90a) is built with setmaxnreg's two values moved one
at a time (-DPRODUCER_REGS over PRODUCERS with the consumers at their default, -DCONSUMER_REGS over CONSUMERS
with the producer at its default), and ptxas's report (-Xptxas -v) of every kernel is kept: registers, stack
frame, spills. A warpgroup's code fits its count where no kernel that runs it spills. What it answers: the
fewest registers each warpgroup needs, so what the SM's 65,536 leave for anything else (notebook 02b, 13s).

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
from kdlib.perf.suites.attention_bounds import SM_REGS  # noqa: E402

STEM = "tree_verify/wgmma_v10"
ARCH = "sm_90a"
WARPGROUP = 128  # threads of a warpgroup (4 warps): the producer's, and each consumer's
PRODUCERS = (24, 32, 40)
CONSUMERS = (160, 168, 176, 200, 208, 216, 224, 232)  # past where v9's consumers (attend_t) spill, and v7's


def builds() -> list[tuple[int, int]]:
    """(producer, consumer) registers of each build: one count moved at a time from the source's defaults."""
    c = loader.source_constants(STEM)
    p0, c0 = c["PRODUCER_REGS"], c["CONSUMER_REGS"]
    grid = [(p, c0) for p in PRODUCERS] + [(p0, r) for r in CONSUMERS]
    return sorted(set(grid))


def report(producer: int, consumer: int) -> dict:
    """ptxas's report of one build: {kernel: {registers, stack, spill_stores, spill_loads, static_smem}}."""
    defines = (f"PRODUCER_REGS={producer}", f"CONSUMER_REGS={consumer}")
    rc, text = loader.compile_report(STEM, ARCH, defines=defines)
    if rc != 0:
        raise RuntimeError(f"nvcc failed on {STEM} with {' '.join(defines)}:\n{text}")
    return loader.parse_ptxas(text)


def measure() -> dict:
    """The record's payload: parameters and one row per build."""
    grid = builds()
    with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        done = pool.map(lambda b: report(*b), grid)
        reports = list(tqdm(done, total=len(grid), desc="ptxas", unit="build"))
    c = loader.source_constants(STEM)
    return {
        "parameters": {"stem": STEM, "arch": ARCH, "producers": list(PRODUCERS), "consumers": list(CONSUMERS),
                       "default": {"producer": c["PRODUCER_REGS"], "consumer": c["CONSUMER_REGS"]},
                       "threads": {"producer": WARPGROUP, "consumers": c["NTHREADS"] - WARPGROUP},
                       "register_file": SM_REGS, "nvcc": loader.nvcc_version().strip().splitlines()[-1]},
        "builds": [{"producer": p, "consumer": r, "kernels": k}
                   for (p, r), k in zip(grid, reports, strict=True)],
        "notes": ["a build per (producer, consumer): setmaxnreg's values as -DPRODUCER_REGS, -DCONSUMER_REGS "
                  "(kernels/tree_verify/wgmma_ws.cuh), nvcc -cubin -arch=sm_90a -Xptxas -v, no GPU",
                  "kernels: ptxas's report per kernel (kdlib.cuda.loader.parse_ptxas)"],
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
