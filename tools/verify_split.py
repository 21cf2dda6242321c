"""Where a whole verify's time goes, kernel by kernel (notebook 02b): at issue 19's two goal points and its
two 8 x 9 points, the default verify's kernels (plan, attend, combine) with their device time a verify
(torch.profiler over eager calls after warm-up), against the verify's graph-replayed time in the same process.
Each --define NAME=VALUE adds an arm, this tree built with -DNAME=VALUE, timed the same way after the default.

On the GPU machine:
    KDLIB_COMMIT=<sha> python3 tools/verify_split.py --out $OUT [--define TV_PREFETCH_B=1]
        -> $OUT/verify_split.<gpu>.json

The kernels overlap (programmatic dependent launch), so their sum can exceed the replayed time; the attend
kernel's share of that time is what a faster attend kernel can win.
"""

from __future__ import annotations

import argparse
import sys

from kdlib.cli import build_switch, folder, make_folder, positive_int, require_gpu
from kdlib.perf.suites import attention as suite

POINTS = [p for p in suite.POINTS  # the goal points and the two 8 x 9 points
          if (p["heads"], p["queries"], p["prefix"], p["batch"]) in suite.GOAL_MS or p["queries"] == 9]


def arm(pts: list[dict], inputs: list[dict], pool, iters: int) -> list[dict]:
    """Per point: the graph-replayed verify's median (`time_arm`) and each kernel's device us a verify."""
    from kdlib.cuda import attention as cu
    from kdlib.perf.profile import device_profile

    times = [{"x": []} for _ in pts]
    suite.time_arm("x", pts, inputs, pool, times, [{} for _ in pts], iters)
    rows = []
    for p, x, t in zip(pts, inputs, times, strict=True):
        call = suite.verify_call(x, pool, cu.make_workspace(p["batch"], p["queries"], p["heads"]))
        for _ in range(3):
            call(x["tables"][0])
        prof = device_profile(lambda call=call, pt=x["tables"][0]: call(pt), steps=iters)
        rows.append({"replay_ms": t["x"][0], "device_ms": prof["device_ms"],
                     "kernels": [{"name": n, "calls": c, "us": us} for n, c, us in prof["kernels"]]})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=folder, help="folder of the record")
    ap.add_argument("--iters", type=positive_int, default=20)
    ap.add_argument("--define", action="append", default=[], type=build_switch,
                    help="NAME=VALUE: an arm built with -DNAME=VALUE")
    a = ap.parse_args(argv)
    require_gpu(ap)
    make_folder(ap, a.out)
    import torch

    from kdlib.cuda import loader
    from kdlib.perf import results

    pool = torch.randn(suite.pool_rows(POINTS), suite.D_QK, device="cuda",
                       dtype=torch.bfloat16)  # [N, 576] KV rows
    inputs = [suite.point_inputs(p, pool) for p in POINTS]
    arms = {"default": arm(POINTS, inputs, pool, a.iters)}
    for d in a.define:
        with loader.extra_options(f"-D{d}"):
            arms[f"-D{d}"] = arm(POINTS, inputs, pool, a.iters)
    for name, rows in arms.items():
        for p, r in zip(POINTS, rows, strict=True):
            top = ", ".join(f"{k['name'][:40]} {k['us']:.1f}" for k in r["kernels"][:3])
            print(f"[split] {name} H{p['heads']} Q{p['queries']} S{p['prefix']} B{p['batch']}: replay "
                  f"{r['replay_ms']:.4f} ms; {top} us", flush=True)
    doc = {"parameters": {"points": POINTS, "iters": a.iters, "defines": a.define}, "arms": arms}
    print(results.write("verify_split", doc, out_dir=a.out, command=" ".join(["python3"] + sys.argv)))


if __name__ == "__main__":
    main()
