"""Headline figures that a notebook shows and the seed audit checks: one function each, called by both.

    from kdlib import headlines
    headlines.pro6000_crosscheck_tok_s()   # {1: tok/s, 10: tok/s}: the seeds' stack on the PRO 6000
    headlines.b300_native_tok_s()          # tok/s: the native engine on a B300 at C = 1

The audit (`kdlib.audit`) reads `data/` and calls kdlib; it reads no executed notebook. A figure that a
notebook computes and the audit also shows is computed here, from `data/` alone, so that notebook 06
records the same number the audit states, whichever runs first. Both figures use the estimator
calibrated on the recorded H200 component results, as notebook 06 does (`calibrated`).
"""

from __future__ import annotations

from kdlib import estimator as est
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
    at the seeds' two service points C = 1 and 10: the model's answer to their measured 138.7 / 517."""
    a = est.seeds_stack("b300", calibrated())
    return {c: est.step_time("rtx-pro-6000", _current_drafter(c, context, "cpu"), a)["tok_s"]
            for c in CROSSCHECK_CONCURRENCY}


def b300_native_tok_s(context: int = CONTEXT) -> float:
    """Aggregate tok/s of the native engine (GPU tree build, calibrated host terms) on a B300 at C = 1
    with the seeds' current drafter: the model's counterpart of their measured 303 tok/s."""
    return est.step_time("b300", _current_drafter(1, context, "gpu"), calibrated())["tok_s"]
