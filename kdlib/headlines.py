"""Headline figures that a notebook shows and the seed audit checks: one function each, called by both.

    from kdlib import headlines
    headlines.pro6000_crosscheck_tok_s()   # {1: tok/s, 10: tok/s}: the seeds' stack on the PRO 6000
    headlines.b300_native_tok_s()          # tok/s: the native engine on a B300 at C = 1
    headlines.k2_rank_figures(doc)         # the seeds' step figures on the measured Kimi-K2.6 rank
    headlines.k2_rank_b300(doc)            # the B300 rank's two bounds re-derived from those rows
    headlines.k2_rank_sustained_gap(doc, frag, ...)   # the seeds' 2x two-point / sustained gap on those rows

The audit (`kdlib.audit`) reads `data/` and calls kdlib; it reads no executed notebook. A figure that a
notebook computes and the audit also shows is computed here, from `data/` alone, so that notebook 06
records the same number the audit states, whichever runs first. Both figures use the estimator
calibrated on the recorded H200 component results, as notebook 06 does (`calibrated`). The rank's
figures take the recorded k2_rank payload itself (notebook 03b passes the file it shows, the audit what
its `Sources` read), so both state the same numbers from the same file.
"""

from __future__ import annotations

from kdlib import estimator as est
from kdlib import hw
from kdlib.estimator import seeds

CONTEXT = 4096  # tokens of context per stream: notebook 06's default CONTEXT (tests/test_audit.py compares)
CROSSCHECK_CONCURRENCY = (1, 10)  # the seeds' two PRO 6000 service points (138.7 and 517 tok/s)


def calibrated(gpu: str = "h200") -> est.Assumptions:
    """The estimator's assumptions calibrated on `data/results/*.<gpu>.json` with the W4A16 MoE arm
    (`kdlib.estimator.calibrate`, as notebook 06's projections)."""
    return est.calibrate(est.load_results(gpu), gpu=gpu, moe_arm="kernel")


def _current_drafter(concurrency: int, context: int, tree_builder: str) -> est.Scenario:
    """The seeds' service drafter: block 8 (a tree of block + 1 rows), ~4.4 accepted per step."""
    p = seeds.points()
    block = int(p["b300_block"]["value"])
    return est.Scenario(concurrency, block + 1, block, p["b300_accepted"]["value"], context, tree_builder)


def pro6000_crosscheck_tok_s(context: int = CONTEXT) -> dict[int, float]:
    """concurrency -> aggregate tok/s on the RTX PRO 6000 of the seeds' stack solved on their B300 point
    (`kdlib.estimator.seeds_stack`: host overhead fitted to 303 tok/s, CPU tree build), current drafter,
    at the seeds' two service points C = 1 and 10: the model's answer to their measured 138.7 / 517. The
    stack is solved at the same `context` it projects at."""
    a = est.seeds_stack("b300", calibrated(), context=context)
    return {c: est.step_time("rtx-pro-6000", _current_drafter(c, context, "cpu"), a)["tok_s"]
            for c in CROSSCHECK_CONCURRENCY}


def b300_native_tok_s(context: int = CONTEXT) -> float:
    """Aggregate tok/s of the native engine (GPU tree build, calibrated host terms) on a B300 at C = 1
    with the seeds' current drafter: the model's counterpart of their measured 303 tok/s."""
    return est.step_time("b300", _current_drafter(1, context, "gpu"), calibrated())["tok_s"]


# ---- one TP8 rank of Kimi-K2.6, measured (suite k2_rank): notebook 03b shows these, the audit states them
K2_SEED_CONTEXT = 5500  # tokens: the seeds' "144ms at 5.5k tokens" verify step
K2_SHORT_CONTEXT = 128  # tokens: the grid's shortest context, beside the seeds' "34ms at 13 tokens"


def k2_rank_grid(doc: dict) -> dict:
    """(context, streams, budget) -> row of a k2_rank payload (kdlib/perf/suites/k2_rank.py), the grid's
    rows only (`compiled`, or every row of a run without torch.compile); budget None is AR."""
    rows = doc.get("rows") or []
    compiled = any(r.get("compiled") for r in rows)
    return {(r["context"], r["streams"], r["budget"]): r for r in rows if bool(r.get("compiled")) == compiled}


def k2_rank_dropped(doc: dict) -> list[tuple]:
    """The grid rows (`k2_rank_grid` keys) whose MoE dropped slots: an expert was routed more tokens than
    the launch's static bound (`moe_bound_overflows` > 0, which the suite requires to be 0), so the MoE
    kernels computed fewer slots than routed and the row's MoE piece and step are lower bounds."""
    return [k for k, r in k2_rank_grid(doc).items() if r["moe_bound_overflows"]]


def k2_rank_figures(doc: dict) -> dict:
    """The seeds' step figures re-read on the measured rank (a k2_rank payload, `k2_rank_grid` rows), from
    the rows whose MoE computed every routed slot only (`k2_rank_dropped` lists the others): a figure is
    given for a method (budget, None = AR) only where every row it needs is such a row. Steps are the graph
    step plus the modelled all-reduce (`step_with_allreduce_ms`), ms.

    verify_ms {C: {budget: ms}} at K2_SEED_CONTEXT, C = 1 and 10 (the seeds' two service points);
    growth {budget: step at K2_SEED_CONTEXT / step at K2_SHORT_CONTEXT} and attention_growth_ms {budget:
    attention ms at K2_SEED_CONTEXT minus at K2_SHORT_CONTEXT}, C = 1; c10_over_c1 {budget: step at C = 10
    / step at C = 1} at K2_SEED_CONTEXT; c10_over_c1_lower {budget: the same ratio} where only the C = 10
    row dropped slots (its step a lower bound, so the ratio is one); at K2_SEED_CONTEXT, C = 1 and 10,
    keyed (C, budget): moe_ms the routed-MoE piece, moe_share that piece / the graph step, moe_over_floor
    that piece / its floor; service {(C, budget): (tok/s per user, aggregate tok/s)} at K2_SEED_CONTEXT,
    every C of the grid (the rank's step is a TP8 service's step, all-reduce modelled; DDTree tok/s scale
    with the forced accepted length); budgets: the DDTree budgets of the grid; dropped:
    `k2_rank_dropped`; accepted: the forced accepted length (a parameter of the suite, not a
    measurement)."""
    g = k2_rank_grid(doc)
    dropped = k2_rank_dropped(doc)
    ok = {k: r for k, r in g.items() if k not in dropped}
    budgets = sorted({b for _, _, b in g if b is not None})
    methods = [None, *budgets]
    ctx, short = K2_SEED_CONTEXT, K2_SHORT_CONTEXT
    step = {k: r["step_with_allreduce_ms"] for k, r in ok.items()}
    piece = {k: r["components_ms"] for k, r in ok.items()}

    def have(*keys):
        return all(k in ok for k in keys)

    pairs = [(c, b) for c in CROSSCHECK_CONCURRENCY for b in methods if have((ctx, c, b))]
    return {
        "accepted": doc["parameters"]["accepted"],
        "budgets": budgets,
        "dropped": dropped,
        "verify_ms": {c: {b: step[ctx, c, b] for b in methods if have((ctx, c, b))}
                      for c in CROSSCHECK_CONCURRENCY},
        "growth": {b: step[ctx, 1, b] / step[short, 1, b] for b in methods
                   if have((ctx, 1, b), (short, 1, b))},
        "attention_growth_ms": {b: piece[ctx, 1, b]["attention"] - piece[short, 1, b]["attention"]
                                for b in methods if have((ctx, 1, b), (short, 1, b))},
        "c10_over_c1": {b: step[ctx, 10, b] / step[ctx, 1, b] for b in methods
                        if have((ctx, 10, b), (ctx, 1, b))},
        "c10_over_c1_lower": {b: g[ctx, 10, b]["step_with_allreduce_ms"] / step[ctx, 1, b] for b in methods
                              if (ctx, 10, b) in dropped and have((ctx, 1, b))},
        "moe_ms": {(c, b): piece[ctx, c, b]["moe"] for c, b in pairs},
        "moe_share": {(c, b): piece[ctx, c, b]["moe"] / ok[ctx, c, b]["step_ms"] for c, b in pairs},
        "moe_over_floor": {(c, b): piece[ctx, c, b]["moe"] / ok[ctx, c, b]["floors"]["moe"]["floor_ms"]
                           for c, b in pairs},
        "service": {(c, b): (r["tok_s_per_stream"], r["tok_s"]) for (x, c, b), r in ok.items() if x == ctx},
    }


def k2_rank_b300(doc: dict, gpu: str = "h200", target: str = "b300") -> dict:
    """A B300 rank's step re-derived from the measured one (a k2_rank payload recorded on `gpu`), rows of
    `k2_rank_figures` (MoE computed every slot) at K2_SEED_CONTEXT, C = 1 and 10, keyed (C, budget):
    two bounds on the step, ms, each plus the row's modelled all-reduce (an H200 NCCL fit, kept as is):
    'scaled_ms' the graph step over the HBM bandwidth ratio target / gpu (every kernel memory-bound: the
    optimistic end), 'unscaled_ms' the graph step as measured (bound by its kernels' count and fixed cost:
    the pessimistic end); 'tok_s_scaled' / 'tok_s_unscaled' the tok/s per user each gives at the forced
    accepted length (`parameters.accepted`, a parameter: a DDTree figure scales linearly with it);
    'ratio' the bandwidth ratio."""
    ratio = hw.load(target)["hbm_bandwidth_Bps"] / hw.load(gpu)["hbm_bandwidth_Bps"]
    dropped = set(k2_rank_dropped(doc))
    out = {}
    for (ctx, c, b), r in k2_rank_grid(doc).items():
        if ctx != K2_SEED_CONTEXT or c not in CROSSCHECK_CONCURRENCY or (ctx, c, b) in dropped:
            continue
        ar = r["allreduce_modelled_ms"]
        scaled, unscaled = r["step_ms"] / ratio + ar, r["step_ms"] + ar
        tau = r["accepted_mean"]
        out[c, b] = {"ratio": ratio, "scaled_ms": scaled, "unscaled_ms": unscaled,
                     "tok_s_scaled": tau / scaled * 1e3, "tok_s_unscaled": tau / unscaled * 1e3}
    return out


# the seeds' two-point probe: two requests of max_tokens 8 and 264 on one prompt, decode rate = 256 tokens
# over the time between them (seeds/000_104759eda2e62f25.txt:59), 66.8 t/s at 5,120 tokens of context (:61)
TWO_POINT_TOKENS = (8, 264)
TWO_POINT_CONTEXT = 5120


def k2_rank_sustained_gap(doc: dict, frag: dict | None, *, two_point_context: int, sustained_prompt: int,
                          sustained_generated: int, gap: float) -> dict:
    """How much of the seeds' two-point / sustained gap (`gap`: their two-point tok/s at
    `two_point_context` over their sustained tok/s, a `sustained_prompt`-token prompt generating
    `sustained_generated`) the measured rank's step time can carry, per method (budget, None = AR) with
    C = 1 rows at K2_SHORT_CONTEXT and K2_SEED_CONTEXT whose MoE computed every slot (`k2_rank_figures`).

    The step at a context is the line through those two rows (the attention reads the context once per
    layer: linear in it); each probe's step is the step at its mean context (the two-point probe over its
    TWO_POINT_TOKENS window, the sustained run over its generation). Fragmentation: the recorded
    fragmentation payload's worst kernel slowdown over a contiguous page table (`frag`, None: not
    recorded, taken as 1), applied to the attention's share of the C = 1 step at K2_SEED_CONTEXT: the most
    a fragmented cache can add. Per method: two_point_ms, sustained_ms, context_ratio (sustained step /
    two-point step), frag_factor, step_ratio (their product: the step-time part of the gap) and
    accept_ratio (gap / step_ratio: the two-point probe's accepted tokens per step over the sustained run's,
    which the rest of the gap needs); frag_slowdown and frag_source beside them."""
    g = k2_rank_grid(doc)
    dropped = set(k2_rank_dropped(doc))
    lo, hi = K2_SHORT_CONTEXT, K2_SEED_CONTEXT
    two_point_mean = two_point_context + sum(TWO_POINT_TOKENS) / 2
    sustained_mean = sustained_prompt + sustained_generated / 2
    slow, src = 1.0, "no fragmentation result recorded: taken as 1"
    if frag is not None:
        slow = max(lay["kernel_slowdown_vs_contiguous"]
                   for p in frag["points"] for lay in p["layouts"].values())
        src = f"fragmentation suite, commit {frag['provenance']['commit'][:7]}"
    out = {"frag_slowdown": slow, "frag_source": src, "gap": gap, "methods": {}}
    for b in sorted({k[2] for k in g}, key=lambda x: -1 if x is None else x):
        keys = [(lo, 1, b), (hi, 1, b)]
        if any(k not in g or k in dropped for k in keys):
            continue
        (x0, r0), (x1, r1) = ((k[0], g[k]) for k in keys)
        y0, y1 = r0["step_with_allreduce_ms"], r1["step_with_allreduce_ms"]

        def step(x, x0=x0, x1=x1, y0=y0, y1=y1):
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

        tp, su = step(two_point_mean), step(sustained_mean)
        frag_factor = 1 + (slow - 1) * r1["components_ms"]["attention"] / r1["step_ms"]
        ratio = su / tp * frag_factor
        out["methods"][b] = {"two_point_ms": tp, "sustained_ms": su, "context_ratio": su / tp,
                             "frag_factor": frag_factor, "step_ratio": ratio, "accept_ratio": gap / ratio}
    return out

