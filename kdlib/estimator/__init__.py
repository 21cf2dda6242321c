"""Step-time and throughput estimator for tree speculative decoding on MLA + MoE models.

    from kdlib import estimator as est
    sc = est.Scenario(concurrency=4, q_len=33, block=16, accepted=12.0, context=4096)
    est.step_time("b300", sc)                    # seconds per component, total, tok/s
    est.project(["h200", "b300"], [sc])          # table rows
    est.seeds.reproduce()                        # the seeds' B300 projections, rebuilt
    a = est.calibrate(est.load_results("h200"))  # efficiencies from H200 measurements
    est.validate(a, est.load_results("h200")["engine"])   # against the engine's measured step times
    est.validate_batch(a, kdlib.perf.load("engine_batch", "h200"))   # against the batched graph engine
    terms = est.calibrate_rank_layer(a, kdlib.perf.load("k2_layer", "h200"))   # one rank layer's pieces
    est.validate_rank(terms, kdlib.perf.load("k2_rank", "h200"))   # against the measured TP8 rank

CLI: `kdlib estimate [--scenario seeds] [--json]` (the seeds' B300 scenarios, nothing else to set), or
`kdlib estimate [--gpu b300] [--concurrency 1 4 10] [--context N] [--block-size B] [--accepted-length A]
[--tree cpu|gpu] [--calibrated] [--json]`.
Hardware peaks come from `data/hw/` (`kdlib.hw`); every other input is a named `Param` of
`Assumptions` with its source; the model shape defaults to Kimi-K2 at TP8.
"""

from __future__ import annotations

import json
import sys

from kdlib import memory
from kdlib.cli import Parser, fail, positive_float, positive_int
from kdlib.estimator import seeds
from kdlib.estimator.calibration import (
    calibrate,
    calibrate_rank_layer,
    engine_rows,
    load_results,
    validate,
    validate_batch,
    validate_rank,
)
from kdlib.estimator.model import (
    COMPONENTS,
    hardware,
    knee_m,
    moe_curve,
    moe_layer,
    project,
    rank_step_time,
    sensitivity,
    step_time,
    touched_experts,
)
from kdlib.estimator.params import (
    SHAPE_CONFIG,
    Assumptions,
    AttentionPlanTerms,
    ModelShape,
    Param,
    RankLayerTerms,
    Scenario,
)

__all__ = [
    "COMPONENTS", "SHAPE_CONFIG", "AttentionPlanTerms", "Assumptions", "ModelShape", "Param",
    "RankLayerTerms", "Scenario",
    "calibrate", "calibrate_rank_layer", "cli", "engine_rows", "hardware", "knee_m", "load_results",
    "model_seed_rows", "moe_curve", "moe_layer", "project", "rank_step_time", "seed_scenarios", "seeds",
    "seeds_stack", "sensitivity", "step_time", "touched_experts", "validate", "validate_batch",
    "validate_rank",
]


def seeds_stack(gpu="b300", a: Assumptions | None = None, shape: ModelShape | None = None,
                context: int = 2048) -> Assumptions:
    """Assumptions whose host overhead (`dispatch_s`) makes this model hit the seeds' B300
    calibration point (303 tok/s at C = 1, block 8, ~4.4 accepted, CPU tree build) at `context` cached
    tokens (the seeds name none): the seeds' Python/SGLang stack, expressed in this model's terms."""
    a = a or Assumptions()
    p = seeds.points()
    sc = Scenario(concurrency=1, q_len=9, block=int(p["b300_block"]["value"]),
                  accepted=p["b300_accepted"]["value"], context=context, tree_builder="cpu")
    target = sc.accepted / p["b300_c1_tok_s"]["value"]
    rest = step_time(gpu, sc, a.with_(dispatch_s=(0.0, "zeroed to solve for it")), shape)["total"]
    if target <= rest:
        raise ValueError(f"the model's non-dispatch terms ({rest * 1e3:.2f} ms) already exceed the seeds' "
                         f"step ({target * 1e3:.2f} ms); no dispatch overhead can reproduce 303 tok/s")
    return a.with_(dispatch_s=(target - rest,
                               "solved: the seeds' B300 303 tok/s at C = 1, block 8, ~4.4 accepted "
                               "(seed article “The Three Acts of Engineering”, lines 45 and 69) "
                               "minus this model's other terms"))


def seed_scenarios(context: int = 2048) -> dict:
    """The seeds' three B300 scenarios as Scenario pairs (low, high acceptance) at C = 1."""
    p = seeds.points()
    block, acc = int(p["b300_block"]["value"]), p["b300_accepted"]["value"]
    sb, budget = int(p["strong_block"]["value"]), int(p["strong_budget"]["value"])
    lo, hi = p["strong_accepted"]["value"]
    strong = [Scenario(1, budget + 1, sb, x, context, "cpu", f"strong drafter, {x:g} accepted")
              for x in (lo, hi)]
    return {
        "current": [Scenario(1, block + 1, block, acc, context, "cpu", "current drafter")],
        "strong": strong,
        "overhead_cut": strong,
    }


def model_seed_rows(gpu: str = "b300", a: Assumptions | None = None, context: int = 2048) -> list[dict]:
    """This model's own projection of the seeds' scenarios at `context` cached tokens: assumptions `a`
    (default: the uncalibrated ones) with the dispatch solved on the B300 point there (`seeds_stack`)."""
    p = seeds.points()
    a = seeds_stack("b300", a, context=context)
    cut_by = (p["overhead_ms"]["value"] - p["overhead_cut_ms"]["value"]) * 1e-3
    a_cut = a.with_(dispatch_s=(max(0.0, a.v("dispatch_s") - cut_by),
                                "seeds' stack minus the 12.5 -> 8 ms cut"))
    rows = []
    for key, assumptions in (("current", a), ("strong", a), ("overhead_cut", a_cut)):
        scs = seed_scenarios(context)[key]
        vals = [step_time(gpu, sc, assumptions)["tok_s"] for sc in scs]
        row = {"name": key, "gpu": gpu}
        if len(vals) == 1:
            row["tok_s"] = vals[0]
        else:
            row["tok_s_low"], row["tok_s_high"] = min(vals), max(vals)
        rows.append(row)
    return rows


_PROJECTION_ONLY = ("gpu", "concurrency", "context", "block_size", "accepted_length", "tree", "calibrated")


def _seeds_doc() -> dict:
    rep = seeds.reproduce()
    return {"gpu": "b300", "scenarios": rep["scenarios"], "terms_ms": rep["terms_ms"],
            "model": model_seed_rows("b300"), "readings": seeds.readings(),
            "contradictions": seeds.contradictions()}


def _print_seeds(doc: dict) -> None:
    print("The seeds' B300 projections, rebuilt from their calibration points:")
    for s in doc["scenarios"]:
        got = f"{s['tok_s']:.0f}" if "tok_s" in s else f"{s['tok_s_low']:.0f}-{s['tok_s_high']:.0f}"
        want = (f"{s['seed_tok_s']:.0f}" if "seed_tok_s" in s
                else f"{s['seed_tok_s_low']:.0f}-{s['seed_tok_s_high']:.0f}")
        print(f"  {s['name']:<55} {got:>10} tok/s   (seeds: {want})")
    print("Under each reading of their inputs (B300 tok/s: current | strong | overhead cut):")
    for r in doc["readings"]:
        print(f"  {r['reading'][:78]:<78} {r['current_tok_s']:5.0f} | {r['strong_tok_s_low']:4.0f}-"
              f"{r['strong_tok_s_high']:<4.0f} | {r['cut_tok_s_low']:4.0f}-{r['cut_tok_s_high']:.0f}")


def cli(argv: list[str] | None = None) -> int:
    """`kdlib estimate [...]`: the seeds' scenarios rebuilt, or a projection of this model at C = 1, 4, 10
    (or --concurrency ...). Bad input is one line on stderr and exit 2."""
    p = seeds.points()
    block0, acc0 = int(p["b300_block"]["value"]), p["b300_accepted"]["value"]
    max_pos = int(memory.text_config(SHAPE_CONFIG)["max_position_embeddings"])
    ap = Parser(prog="kdlib estimate", description="step-time and throughput estimator (the model: "
                f"{SHAPE_CONFIG} at TP8); every flag but --json belongs to the default scenario")
    ap.add_argument("--scenario", default="default", choices=("default", "seeds"),
                    help="seeds: the seeds' own B300 scenarios at C = 1, rebuilt; default: a projection at "
                         "C = 1, 4, 10")
    ap.add_argument("--gpu", default=None, help="a slug of data/hw/ (default b300)")
    ap.add_argument("--concurrency", type=positive_int, nargs="+", default=None,
                    help="streams per step, each >= 1 (default 1 4 10)")
    ap.add_argument("--context", type=positive_int, default=None,
                    help=f"tokens already cached per stream (default 2048); with the block + 1 tokens a step "
                         f"verifies at most max_position_embeddings = {max_pos:,}")
    ap.add_argument("--block-size", type=positive_int, default=None,
                    help=f"drafter block: tokens drafted per stream per step; a step verifies block + 1 "
                         f"(default {block0}, the seeds' current drafter)")
    ap.add_argument("--accepted-length", type=positive_float, default=None,
                    help=f"tokens committed per stream per step, the bonus token included, in [1, block + 1] "
                         f"(default {acc0:g}, the seeds' current drafter)")
    ap.add_argument("--tree", default=None, choices=("cpu", "gpu"), help="tree builder (default cpu)")
    ap.add_argument("--calibrated", action="store_true",
                    help="calibrate on the recorded H200 component results (data/results/*.h200.json) first")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    given = ["--" + k.replace("_", "-") for k in _PROJECTION_ONLY if getattr(args, k) not in (None, False)]
    if args.scenario == "seeds":
        if given:
            them = "it" if len(given) == 1 else "them"
            ap.error(f"--scenario seeds rebuilds the seeds' own B300 figures at C = 1 and takes no "
                     f"{', '.join(given)}; drop {them}, or leave out --scenario")
        try:
            doc = _seeds_doc()
        except ValueError as err:
            return fail(ap.prog, err)
        if args.json:
            print(json.dumps(doc, indent=1))
        else:
            _print_seeds(doc)
        return 0
    gpu = "b300" if args.gpu is None else args.gpu  # --gpu "" is refused as an unknown GPU, not taken as b300
    concurrency = args.concurrency or [1, 4, 10]
    context = 2048 if args.context is None else args.context
    block = args.block_size or block0
    acc = acc0 if args.accepted_length is None else args.accepted_length
    tree = args.tree or "cpu"
    if not 1 <= acc <= block + 1:
        default = "" if args.accepted_length else " (the default; give --accepted-length)"
        ap.error(f"accepted length {acc:g}{default} must lie in [1, block + 1 = {block + 1}] (a step commits "
                 f"at least the bonus token and at most every token it verifies)")
    if context + block + 1 > max_pos:
        ap.error(f"context {context:,} + the {block + 1} tokens a step verifies exceed {SHAPE_CONFIG}'s "
                 f"max_position_embeddings {max_pos:,}")
    try:
        hardware(gpu)
        scs = [Scenario(c, block + 1, block, acc, context, tree, f"C={c}") for c in concurrency]
        a = calibrate(load_results("h200")) if args.calibrated else Assumptions()
        rows = project([gpu], scs, a)
    except ValueError as err:
        return fail(ap.prog, err)
    if args.json:
        print(json.dumps({"gpu": gpu, "assumptions": a.table(), "rows": rows}, indent=1))
    else:
        what = "H200-calibrated" if args.calibrated else "default"
        drafter = " (the seeds' current drafter)" if (block, acc) == (block0, acc0) else ""
        print(f"{gpu}: block {block}, ~{acc:g} accepted{drafter}, context {context}, {tree} tree build, "
              f"{what} assumptions")
        for r in rows:
            over = (f"  does not fit: {r['kv_tokens']:,} KV tokens, the pool holds {r['pool_tokens']:,} "
                    f"(kdlib memory)" if r["fits"] is False else "")
            print(f"  C={r['concurrency']:<3} step {r['step_ms']:7.2f} ms  {r['tok_s']:8.0f} tok/s  "
                  f"dominant: {r['dominant']}{over}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
