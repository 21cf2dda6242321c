"""Where the tree verify's plan kernel spends its time, and what it costs the whole verify (issue 19).

    python3 tools/plan_phases.py phases --out $OUT   -> <out>/plan_phases.<gpu>.json
    python3 tools/plan_phases.py cost --out $OUT     -> <out>/plan_cost.<gpu>.json

`phases`: a copy of kernels/ in build/plan_phases/ whose version 10 plan kernel (tree_verify_v10_plan and the
plan_v5 / plan_small it calls, tree_verify/wgmma_common.cuh) writes clock64() at its phases into a device
global; the kernel alone, launched 50 times per shape with its L2 warm and flushed (`timing.l2_flush`), in
three builds: PLAN_SMALL_REQS 8 (the default), 32 and 0 (every plan by the four warps). Each run's median
cycles after stamp 0, the kernel's first instruction (None where a build's path passes no such stamp).

`cost`: the whole verify of version 10 at five points of the attention suite, CUDA-graph replays over its L2
rotation, five interleaved rounds of three arms: `whole` (its plan kernel first), `ready` (plan_ready=True:
no plan launch) and `noop` (a one-CTA kernel that only releases the attend kernel's programmatic launch, then
plan_ready): the plan's share and the launch boundary's alone; each arm's kernels profiled (device us). It
sets `kdlib.cuda.attention.OWN_PLAN` off, so that `whole` runs the plan kernel at every point, as when the
record was made (since then the attend kernels make the plan of up to 8 requests themselves;
`tools/kernel_ab.py run --version 10 --toggle OWN_PLAN` times the two).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

from kdlib.cli import folder, make_folder, require_gpu

ROOT = Path(__file__).resolve().parents[1]
STAMPED = ROOT / "build" / "plan_phases" / "kernels"
BUILDS = {"default": (), "small32": ("-DPLAN_SMALL_REQS=32",), "four_warps": ("-DPLAN_SMALL_REQS=0",)}
PHASES = {0: "start", 1: "four warps: lens read", 2: "four warps: tmax", 3: "four warps: warp 0 searched",
          4: "warp 1", 5: "warp 2", 6: "warp 3", 7: "four warps: costs shared and weighed",
          8: "four warps: scan written",
          9: "plan_v5 returned", 10: "v10: jobs read", 11: "v10: order written (end)",
          12: "warp 0 alone: lens read", 13: "warp 0 alone: searched", 14: "warp 0 alone: costs",
          15: "warp 0 alone: plan written"}
STAMP = ("__device__ long long g_stamps[16];\n#define STAMP(i) do { long long t_; asm volatile(\"mov.u64 %0, "
         "%%clock64;\" : \"=l\"(t_) :: \"memory\"); g_stamps[i] = t_; } while (0)\n")
# (anchor in the source, the same text with its stamp): each anchor occurs once
PLAN_RULE = "// " + "-" * 90 + " plan\n"
COMMON = [
    (PLAN_RULE, STAMP + PLAN_RULE),
    ("        T = (len + BN - 1) / BN, U = tree_sizes ? (ts + BN - 1) / BN : 0;\n    }\n",
     "        T = (len + BN - 1) / BN, U = tree_sizes ? (ts + BN - 1) / BN : 0;\n    }\n"
     "    if (lane == 0) STAMP(12);\n"),
    ("    int longest = 0;  // group k", "    if (lane == 0) STAMP(13);\n    int longest = 0;  // group k"),
    ("    const int c = __shfl_sync(all, lo, 8 * best);",
     "    if (lane == 0) STAMP(14);\n    const int c = __shfl_sync(all, lo, 8 * best);"),
    ("    if (lane == 31) plan[0] = upto, splan[0] = upto;\n",
     "    if (lane == 31) plan[0] = upto, splan[0] = upto;\n    if (lane == 0) STAMP(15);\n"),
    ("        __syncthreads();\n        return splan;",
     "        __syncthreads();\n        if (tid == 0) STAMP(9);\n        return splan;"),
    ("        tmax = max(tmax, CHUNK_WITH_TAIL ? T + U : T);\n    }\n",
     "        tmax = max(tmax, CHUNK_WITH_TAIL ? T + U : T);\n    }\n    if (tid == 0) STAMP(1);\n"),
    ("    tmax = 1;\n    for (int w = 0; w < 8; ++w)",
     "    if (tid == 0) STAMP(2);\n    tmax = 1;\n    for (int w = 0; w < 8; ++w)"),
    ("            chunk_of_k[warp] = lo;\n        }\n",
     "            chunk_of_k[warp] = lo;\n            STAMP(3 + warp);\n        }\n"),
    ("    if (warp == 0) {  // each request's chunks",
     "    if (tid == 0) STAMP(7);\n    if (warp == 0) {  // each request's chunks"),
    ("        write_chunks(p, p, B, chunk_of_k[best]);\n",
     "        write_chunks(p, p, B, chunk_of_k[best]);\n        if (lane == 0) STAMP(8);\n"),
    ("    return p;\n}\n", "    if (tid == 0) STAMP(9);\n    return p;\n}\n"),
]
V10 = [
    ("    pdl_trigger();  // the attend kernel may launch",
     "    if (threadIdx.x == 0) STAMP(0);\n    pdl_trigger();  // the attend kernel may launch"),
    ("    if (n <= G || n > ORDER_CAP) {  // the static round-robin\n"
     "        if (tid == 0 && n > 0) order[0] = -1;\n",
     "    if (tid == 0) STAMP(10);\n    if (n <= G || n > ORDER_CAP) {  // the static round-robin\n"
     "        if (tid == 0 && n > 0) order[0] = -1;\n        if (tid == 0) STAMP(11);\n"),
    ("    } else if (tid == 0) {\n        order[0] = -1;\n    }\n}\n",
     "    } else if (tid == 0) {\n        order[0] = -1;\n    }\n    if (tid == 0) STAMP(11);\n}\n"),
]


def stamped_tree(dest: Path = STAMPED) -> Path:
    """kernels/ copied to dest (build/plan_phases/kernels) with the stamps in place -> dest."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(ROOT / "kernels", dest)
    for name, edits in (("wgmma_common.cuh", COMMON), ("wgmma_v10.cu", V10)):
        path = dest / "tree_verify" / name
        text = path.read_text()
        for old, new in edits:
            if text.count(old) != 1:
                raise SystemExit(f"{name}: the anchor {old.strip()[:60]!r} is not there once; "
                                 f"update {Path(__file__).name}")
            text = text.replace(old, new)
        path.write_text(text)
    return dest


def shapes() -> dict:
    from kdlib.perf.suites import attention as suite

    rp = suite.ragged_point()
    return {"64x65x32k": ([32768], [65], 65, 64), "8x1x200k": ([200000], [1], 1, 8),
            "8x65x32k_B4": ([32000] * 4, [65] * 4, 65, 8), "8x9x32k_B8": ([32768] * 8, [9] * 8, 9, 8),
            "8x9x5500_B10": ([5500] * 10, [9] * 10, 9, 8), "ragged16": (rp["lens"], rp["trees"], 65, 8),
            "8x9x5500_B32": ([5500] * 32, [9] * 32, 9, 8), "8x9x5500_B33": ([5500] * 33, [9] * 33, 9, 8)}


def phases(out: Path, launches: int = 50) -> Path:
    import cupy
    import numpy as np

    from kdlib.cuda import attention as cu
    from kdlib.cuda import loader
    from kdlib.perf import results, timing

    loader.use_kernels(stamped_tree())
    flush = timing.l2_flush()
    grid = cu._device_info()[0]
    runs = {}
    todo = shapes()
    for build, opts in BUILDS.items():
        options = cu._V5_OPTIONS + opts
        fn = loader.get_function(cu._V10, "tree_verify_v10_plan", options=options)
        glob = loader.get_module(cu._V10, options=options).get_global("g_stamps")
        stamps = cupy.ndarray((16,), cupy.int64, glob)  # [16] clock64 per phase
        for name, (lens, trees, nq, nh) in todo.items():
            bsz = len(lens)
            plan = cupy.zeros(1 + 8 * bsz, dtype=cupy.int32)  # [1 + 8B]
            order = cupy.full(cu.v5_max_jobs(bsz, nq * nh, grid), -1, dtype=cupy.int32)  # [jobs bound]
            args = (cupy.asarray(lens, dtype=cupy.int32), cupy.asarray(trees, dtype=cupy.int32),
                    np.int32(bsz), np.int32(max(lens)), np.int32(nq), np.int32(nh), np.int32(grid), plan,
                    order, np.int32(0))  # deal_cost 0: the plan of a call whose plan is not reused
            for cold in (False, True):
                rows = []
                for _ in range(launches):
                    if cold:
                        flush()
                    stamps.fill(0)
                    fn((1,), (256,), args)
                    cupy.cuda.runtime.deviceSynchronize()
                    s = stamps.get()
                    rows.append([int(x - s[0]) if x else None for x in s])
                med = [statistics.median(r[i] for r in rows) if all(r[i] is not None for r in rows) else None
                       for i in range(16)]
                runs[f"{build}_{name}_{'cold' if cold else 'warm'}"] = {"phases_cycles": med}
                print(build, name, "cold" if cold else "warm", med, flush=True)
    loader.use_kernels(None)
    params = {"shapes": {k: {"lens": list(map(int, v[0])), "trees": list(map(int, v[1])), "queries": v[2],
                             "heads": v[3]} for k, v in todo.items()},
              "builds": {k: " ".join(v) or "default" for k, v in BUILDS.items()}, "grid": grid,
              "launches": launches, "stamps": PHASES,
              "clock": "clock64 of the plan's SM, cycles after stamp 0 (the kernel's first instruction)"}
    return results.write("plan_phases", {"parameters": params, "runs": runs}, out_dir=out,
                         command=" ".join(["python3"] + sys.argv))


NOOP = r'''extern "C" __global__ void noop_plan(int* plan) {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (threadIdx.x == 1023) plan[0] = 0;  // never: keeps the argument
}'''


def cost(out: Path, rounds: int = 5, iters: int = 60) -> Path:
    """The `cost` record (the module docstring), with `OWN_PLAN` off for the run and restored after."""
    from kdlib.cuda import attention as cu

    own, cu.OWN_PLAN = cu.OWN_PLAN, False  # the plan kernel first at every point
    try:
        return _cost(out, rounds, iters)
    finally:
        cu.OWN_PLAN = own


def _cost(out: Path, rounds: int, iters: int) -> Path:
    import cupy
    import torch

    from kdlib.cuda import attention as cu
    from kdlib.perf import profile, results
    from kdlib.perf.suites import _attention as base
    from kdlib.perf.suites import attention as suite

    noop = cupy.RawKernel(NOOP, "noop_plan")
    pts = [{"heads": 64, "queries": 65, "prefix": 32768, "batch": 1},
           {"heads": 8, "queries": 1, "prefix": 200000, "batch": 1},
           {"heads": 8, "queries": 9, "prefix": 200000, "batch": 1},
           {"heads": 8, "queries": 9, "prefix": 32768, "batch": 8}, suite.ragged_point()]
    pool = torch.randn(suite.pool_rows(pts), suite.D_QK, device="cuda", dtype=torch.bfloat16)  # [N, 576]
    arms = {"whole": "the verify, plan kernel first", "ready": "plan_ready=True (no plan launch)",
            "noop": "a 1-CTA kernel that only triggers the attend's launch, then plan_ready"}
    doc = {"parameters": {"points": pts, "rounds": rounds, "iters": iters, "version": 10}, "points": [],
           "arms": arms}
    for p in pts:
        x = suite.point_inputs(p, pool)
        ws = cu.make_workspace(p["batch"], p["queries"], p["heads"])
        reused = suite.verify_call(x, pool, ws, plan_ready=True)

        def after_noop(pt, reused=reused, ws=ws):
            noop((1,), (256,), (ws.plan,))
            return reused(pt)

        calls = {"whole": suite.verify_call(x, pool, ws), "ready": reused, "noop": after_noop}
        calls["whole"](x["tables"][0])  # the plan the reused arms read
        timers = {a: base.graph_timer([lambda pt=pt, f=f: f(pt) for pt in x["tables"]])
                  for a, f in calls.items()}
        t = {a: [] for a in arms}
        for _ in range(rounds):
            for a in arms:
                t[a].append(timers[a](iters=iters, warmup=3).median_ms)
        first = x["tables"][0]
        prof = {a: profile.device_profile(lambda f=f, pt=first: f(pt), steps=30)["kernels"]
                for a, f in calls.items()}
        med = {a: statistics.median(v) for a, v in t.items()}
        doc["points"].append({**{k: p[k] for k in ("heads", "queries", "batch")}, "prefix": p.get("prefix"),
                              "medians_ms": med, "rounds_ms": t, "kernels_us": prof})
        print(p.get("prefix"), p["heads"], p["queries"], p["batch"],
              {a: round(v * 1e3, 2) for a, v in med.items()}, flush=True)
    return results.write("plan_cost", doc, out_dir=out, command=" ".join(["python3"] + sys.argv))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("phases", "cost"))
    ap.add_argument("--out", type=folder, required=True)
    a = ap.parse_args()
    require_gpu(ap)
    make_folder(ap, a.out)
    print(phases(a.out) if a.what == "phases" else cost(a.out))


if __name__ == "__main__":
    main()
