"""Step-time and throughput estimator for tree speculative decoding on MLA + MoE models.

    from kdlib import estimator as est
    sc = est.Scenario(concurrency=4, q_len=33, block=16, accepted=12.0, context=4096)
    est.step_time("b300", sc)                    # seconds per component, total, tok/s
    est.project(["h200", "b300"], [sc])          # table rows
    est.seeds.reproduce()                        # the seeds' B300 projections, rebuilt
    a = est.calibrate(est.load_results("h200"))  # efficiencies from H200 measurements
    est.validate(a, est.load_results("h200")["engine"])   # against the engine's measured step times

CLI: `kdlib estimate [--gpu b300] [--scenario seeds|default] [--concurrency 1 4 10] [--context N]
[--tree cpu|gpu] [--calibrated] [--json]`.
Hardware peaks come from `data/hw/` (`kdlib.hw`); every other input is a named `Param` of
`Assumptions` with its source; the model shape defaults to Kimi-K2 at TP8.
"""

from __future__ import annotations

import argparse
import json
import sys

from kdlib.estimator import seeds
from kdlib.estimator.calibration import calibrate, engine_rows, load_results, validate
from kdlib.estimator.model import (
    COMPONENTS,
    hardware,
    knee_m,
    moe_curve,
    moe_layer,
    project,
    sensitivity,
    step_time,
    touched_experts,
)
from kdlib.estimator.params import Assumptions, ModelShape, Param, Scenario

__all__ = [
    "COMPONENTS", "Assumptions", "ModelShape", "Param", "Scenario", "calibrate", "cli", "engine_rows", "hardware",
    "knee_m", "load_results", "model_seed_rows", "moe_curve", "moe_layer", "project", "seed_scenarios", "seeds",
    "seeds_stack", "sensitivity", "step_time", "touched_experts", "validate",
]


def seeds_stack(gpu="b300", a: Assumptions | None = None, shape: ModelShape | None = None) -> Assumptions:
    """Assumptions whose host overhead (`dispatch_s`) makes this model hit the seeds' B300
    calibration point (303 tok/s at C = 1, block 8, ~4.4 accepted, CPU tree build): the seeds'
    Python/SGLang stack, expressed in this model's terms."""
    a = a or Assumptions()
    p = seeds.points()
    sc = Scenario(concurrency=1, q_len=9, block=int(p["b300_block"]["value"]),
                  accepted=p["b300_accepted"]["value"], tree_builder="cpu")
    target = sc.accepted / p["b300_c1_tok_s"]["value"]
    rest = step_time(gpu, sc, a.with_(dispatch_s=(0.0, "zeroed to solve for it")), shape)["total"]
    if target <= rest:
        raise ValueError(f"the model's non-dispatch terms ({rest * 1e3:.2f} ms) already exceed the seeds' step "
                         f"({target * 1e3:.2f} ms); no dispatch overhead can reproduce 303 tok/s")
    return a.with_(dispatch_s=(target - rest, "solved: the seeds' B300 303 tok/s at C = 1, block 8, ~4.4 accepted "
                                              "(seed 002:45, :69) minus this model's other terms"))


def seed_scenarios(context: int = 2048) -> dict:
    """The seeds' three B300 scenarios as Scenario pairs (low, high acceptance) at C = 1."""
    p = seeds.points()
    block, acc = int(p["b300_block"]["value"]), p["b300_accepted"]["value"]
    sb, budget = int(p["strong_block"]["value"]), int(p["strong_budget"]["value"])
    lo, hi = p["strong_accepted"]["value"]
    strong = [Scenario(1, budget + 1, sb, x, context, "cpu", f"strong drafter, {x:g} accepted") for x in (lo, hi)]
    return {
        "current": [Scenario(1, block + 1, block, acc, context, "cpu", "current drafter")],
        "strong": strong,
        "overhead_cut": strong,
    }


def model_seed_rows(gpu: str = "b300") -> list[dict]:
    """This model's own projection of the seeds' scenarios (dispatch solved on the B300 point)."""
    p = seeds.points()
    a = seeds_stack("b300")
    cut_by = (p["overhead_ms"]["value"] - p["overhead_cut_ms"]["value"]) * 1e-3
    a_cut = a.with_(dispatch_s=(max(0.0, a.v("dispatch_s") - cut_by), "seeds' stack minus the 12.5 -> 8 ms cut"))
    rows = []
    for key, assumptions in (("current", a), ("strong", a), ("overhead_cut", a_cut)):
        scs = seed_scenarios()[key]
        vals = [step_time(gpu, sc, assumptions)["tok_s"] for sc in scs]
        row = {"name": key, "gpu": gpu}
        if len(vals) == 1:
            row["tok_s"] = vals[0]
        else:
            row["tok_s_low"], row["tok_s_high"] = min(vals), max(vals)
        rows.append(row)
    return rows


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kdlib estimate", description="step-time and throughput estimator")
    ap.add_argument("--gpu", default="b300", help="a slug of data/hw/ (default b300)")
    ap.add_argument("--scenario", default="default", choices=("default", "seeds"),
                    help="seeds: the seeds' B300 scenarios rebuilt; default: C = 1, 4, 10 projection")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 10])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tree", default="cpu", choices=("cpu", "gpu"), help="tree builder (default cpu)")
    ap.add_argument("--calibrated", action="store_true",
                    help="calibrate on the recorded H200 component results (data/results/*.h200.json) first")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    try:
        hardware(args.gpu)
    except ValueError as err:
        ap.error(str(err))
    if args.scenario == "seeds":
        rep = seeds.reproduce()
        doc = {"gpu": args.gpu, "scenarios": rep["scenarios"], "terms_ms": rep["terms_ms"],
               "model": model_seed_rows(args.gpu), "readings": seeds.readings(),
               "contradictions": seeds.contradictions()}
        if args.json:
            print(json.dumps(doc, indent=1))
        else:
            print("The seeds' B300 projections, rebuilt from their calibration points:")
            for s in rep["scenarios"]:
                got = f"{s['tok_s']:.0f}" if "tok_s" in s else f"{s['tok_s_low']:.0f}-{s['tok_s_high']:.0f}"
                want = f"{s['seed_tok_s']:.0f}" if "seed_tok_s" in s else f"{s['seed_tok_s_low']:.0f}-{s['seed_tok_s_high']:.0f}"
                print(f"  {s['name']:<55} {got:>10} tok/s   (seeds: {want})")
            print("Under each reading of their inputs (B300 tok/s: current | strong | overhead cut):")
            for r in doc["readings"]:
                print(f"  {r['reading'][:78]:<78} {r['current_tok_s']:5.0f} | {r['strong_tok_s_low']:4.0f}-"
                      f"{r['strong_tok_s_high']:<4.0f} | {r['cut_tok_s_low']:4.0f}-{r['cut_tok_s_high']:.0f}")
        return 0
    p = seeds.points()
    block, acc = int(p["b300_block"]["value"]), p["b300_accepted"]["value"]
    scs = [Scenario(c, block + 1, block, acc, args.context, args.tree, f"C={c}") for c in args.concurrency]
    a = calibrate(load_results("h200")) if args.calibrated else Assumptions()
    rows = project([args.gpu], scs, a)
    if args.json:
        print(json.dumps({"gpu": args.gpu, "assumptions": a.table(), "rows": rows}, indent=1))
    else:
        what = "H200-calibrated" if args.calibrated else "default"
        print(f"{args.gpu}: block {block}, ~{acc:g} accepted (the seeds' current drafter), context {args.context}, "
              f"{args.tree} tree build, {what} assumptions")
        for r in rows:
            print(f"  C={r['concurrency']:<3} step {r['step_ms']:7.2f} ms  {r['tok_s']:8.0f} tok/s  "
                  f"dominant: {r['dominant']}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
