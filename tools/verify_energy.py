"""Energy a verify under sustained load, beside FlashInfer's prefix (notebook 02b): at issue 19's two goal
points the attention suite's duel arms (our whole verify replayed from CUDA graphs; FlashInfer's
BatchMLAPagedAttentionWrapper over the prefix, eager and graph-replayed) run in interleaved rounds, each arm
for about --seconds a round, back to back. Per arm and round: the GPU's energy counter (NVML, mJ) over the
calls, their wall time, the mean power, the SM clock and NVML's clock-event reasons at the round's end (power
cap or not). Each --define NAME=VALUE adds an arm of our verify built with -DNAME=VALUE (e.g. the timing
probes TV7_PROBE=1, the gathers alone, and =2, the consumers alone: where the energy goes); each --impl
another whole-verify impl's arm (e.g. wgmma_v13), beside the default verify's.

Where the power cap holds the clocks (within seconds of sustained load), a call takes about what its energy
allows, so the energy a call is what a steady stream of verifies compares.

On the GPU machine (FlashInfer from the carried site, as the levers script's duel step):
    KDLIB_COMMIT=<sha> PYTHONPATH=$PWD:/tmp/site python3 tools/verify_energy.py --out $OUT \
        [--point 64x65x32k] [--define TV7_PROBE=2] [--impl wgmma_v13]   -> $OUT/verify_energy.<gpu>.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

from kdlib.cli import build_switch, folder, make_folder, positive_int, require_gpu
from kdlib.perf.energy import Meter, check_window, interleaved, sustained


def point_name(p: dict) -> str:
    """'64x65x32k': heads x queries x prefix (k: thousands, or 1024s where it divides)."""
    s = p["prefix"]
    return f"{p['heads']}x{p['queries']}x{s // 1024 if s % 1024 == 0 else s // 1000}k"


def our_timer(x: dict, pool, ws, impl: str | None):
    """Our whole verify of `impl` (None: the default) over point inputs x's rotated tables, graph-replayed,
    captured now: with the kernels the loader builds now (a -D switch inside `loader.extra_options`)."""
    from kdlib.perf.suites import _attention as base
    from kdlib.perf.suites import attention as suite

    call = suite.verify_call(x, pool, ws, **({"impl": impl} if impl else {}))
    return base.graph_timer([lambda pt=pt: call(pt) for pt in x["tables"]])


def our_arms(impls: list[str], defines: list[str]) -> dict:
    """Our arms, name -> (impl, -D switch), None for the default: the default verify ("verify") first."""
    return {"verify": (None, None), **{f"verify {i}": (i, None) for i in impls},
            **{f"verify -D{d}": (None, d) for d in defines}}


def measure_point(p: dict, pool, kv_split, fi, meter: Meter, ours: dict, rounds: int, seconds: float) -> dict:
    """Every arm at goal point p, `rounds` interleaved rounds of about `seconds` each -> the point's row:
    each arm's rounds (`sustained`) and each of our arms' energy over FlashInfer's leaner arm, a round.
    ours: our_arms; then FlashInfer's two arms."""
    from kdlib.cuda import attention as cu
    from kdlib.cuda import loader
    from kdlib.perf.suites import attention as suite

    x = suite.point_inputs(p, pool)
    ws = cu.make_workspace(p["batch"], p["queries"], p["heads"])
    for impl in {i for i, d in ours.values() if d is None}:  # the arms of right outputs, checked once
        suite.verify_call(x, pool, ws, **({"impl": impl} if impl else {}))(x["tables"][0], validate=True)
    _, _, fi_timers = suite._flashinfer_prefix(fi, x["q"], *kv_split, x["tables"], x["lens"], x["scale"], 20)
    arms = [*ours, *fi_timers]

    def timed(k, calls=None):  # an arm's calls (None: its calibration, 20 calls after 3) -> its record
        impl, d = ours.get(k, (None, None))
        with loader.extra_options(f"-D{d}") if d else contextlib.nullcontext():
            # ours captured afresh in its build each time: the loader forgets a build's modules past it
            timer = our_timer(x, pool, ws, impl) if k in ours else fi_timers[k]
            return timer(iters=20, warmup=3) if calls is None else sustained(timer, meter, calls)

    got = interleaved(arms, timed, rounds, seconds)  # the arms in turn, as the suite's duel
    fi_least = [min(got[k][i]["joules"] for k in fi_timers) for i in range(rounds)]
    ratios = {k: [v["joules"] / f for v, f in zip(got[k], fi_least, strict=True)] for k in ours}
    return {**p, "rounds": got, "energy_ratio_to_flashinfer": ratios["verify"], "arm_energy_ratios": ratios}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=folder, help="folder of the record")
    ap.add_argument("--rounds", type=positive_int, default=7)
    ap.add_argument("--seconds", type=float, default=2.0, help="an arm's calls a round, in seconds (about)")
    ap.add_argument("--impl", action="append", default=[],
                    help="an arm of our verify of this kdlib.cuda.attention impl (e.g. wgmma_v13)")
    ap.add_argument("--define", action="append", default=[], type=build_switch,
                    help="NAME=VALUE: an arm of our verify built with -DNAME=VALUE")
    ap.add_argument("--point", action="append", default=[],
                    help="a goal point by name, e.g. 64x65x32k (default: both)")
    a = ap.parse_args(argv)
    check_window(ap, a.seconds)
    from kdlib.cuda import attention as cu
    from kdlib.perf.suites import attention as suite

    for impl in a.impl:
        if cu.IMPLS.get(impl) not in cu.WGMMA_VERSIONS:
            ap.error(f"--impl {impl}: not a whole-verify impl of kdlib.cuda.attention (e.g. wgmma_v13)")
    pts = [{"heads": h, "queries": q, "prefix": s, "batch": b} for h, q, s, b in suite.GOAL_MS]
    names = [point_name(p) for p in pts]
    unknown = [n for n in a.point if n not in names]
    if unknown:
        ap.error(f"--point {unknown[0]}: not a goal point ({', '.join(names)})")
    pts = [p for p, n in zip(pts, names, strict=True) if not a.point or n in a.point]
    require_gpu(ap)
    fi, why = suite._flashinfer()
    if fi is None:
        ap.error(f"{why} (put the carried site on PYTHONPATH)")
    make_folder(ap, a.out)
    import torch

    from kdlib.perf import results

    meter = Meter()
    ours = our_arms(a.impl, a.define)
    pool = torch.randn(suite.pool_rows(pts), suite.D_QK, device="cuda",
                       dtype=torch.bfloat16)  # [N, 576] KV rows
    kv_split = (pool[:, :suite.D_V].contiguous().view(-1, 1, suite.D_V),
                pool[:, suite.D_V:].contiguous().view(-1, 1, suite.D_QK - suite.D_V))  # FlashInfer's caches
    rows = []
    for p in pts:
        rows.append(measure_point(p, pool, kv_split, fi, meter, ours, a.rounds, a.seconds))
        print(f"[energy] {point_name(p)}: " + "; ".join(
            f"{k} {statistics.median(r['joules'] for r in v) * 1e3:.3f} mJ "
            f"{statistics.median(r['median_ms'] for r in v):.4f} ms "
            f"{statistics.median(r['sm_mhz'] for r in v):.0f} MHz" for k, v in rows[-1]["rounds"].items())
            + "; energy / FlashInfer's least, median round: " + ", ".join(
            f"{k} {statistics.median(v):.4f}" for k, v in rows[-1]["arm_energy_ratios"].items()), flush=True)
        torch.cuda.empty_cache()
    doc = {"parameters": {"points": pts, "rounds": a.rounds, "seconds": a.seconds, "impls": a.impl,
                          "defines": a.define, "power_limit_w": meter.limit_w}, "rows": rows}
    print(results.write("verify_energy", doc, out_dir=a.out, command=" ".join(["python3"] + sys.argv)))


if __name__ == "__main__":
    main()
