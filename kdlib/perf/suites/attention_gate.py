"""Version 10's gate, measured: where dealing the jobs by size pays against the static round-robin.

Version 10's plan orders the jobs (the snake deal by decreasing key tiles) only where its cost model
predicts that the busiest CTA gets lighter by more than ORDER_GAIN / 64 (`kdlib.cuda.attention.plan_order`).
Here, at 25 shapes whose predicted gain (`deal_busiest`: the static deal's busiest CTA over the snake deal's)
runs from 1.00 to 1.10, both deals are timed in one process:

  * static: version 9 (the static round-robin; what version 10 runs where its plan declines);
  * snake: version 10 built with -DORDER_GAIN=-64, so that its plan orders every plan of more than one round.

Both compute the same jobs and merge them in the same order, so their outputs must be equal bit for bit
(checked). Both launch as CuPy calls: version 10's programmatic dependent launch (`attention.PDL`) is off
for the run, so that the arms differ in the deal alone, and so is its plan made by the attend kernels
(`attention.OWN_PLAN`, which deals statically): version 10 runs its plan kernel at every batch. Whole
verify replayed from CUDA graphs, the arms alternating static, snake, static, snake over the whole grid
(one compile each), each point's time the median of its arm's two replay sets.

Points: the attention suite's three that pass one round (its ragged batch, 16 x 65 x 131k, 8 x 65 x 32k B8),
uniform batches and ragged ones (`ragged_batch`: 8 heads, a seeded draw of requests, prefixes and trees),
chosen so that the predicted gains spread over 1.00-1.10, at most 600k prefix rows each.

`python3 -m kdlib.perf.run --suite attention_gate`. The verdict: the measured ratio (static / snake) against
the predicted gain, and the gate threshold that would have given the least total time over the points.
"""

from __future__ import annotations

import statistics

import numpy as np

from kdlib.cuda import attention as cu
from kdlib.perf.suites import attention as suite

FORCE_ORDER = "-DORDER_GAIN=-64"  # ORDER_UNIT + ORDER_GAIN = 0: it orders whenever the jobs pass one round
UNIFORM = [  # heads, queries, prefix, batch
    (16, 33, 131_072, 4), (16, 65, 8192, 4), (8, 65, 8192, 16), (8, 65, 8192, 8), (8, 65, 4096, 8),
    (16, 65, 131_072, 1), (8, 65, 32_768, 8),
]
RAGGED_SEEDS = (318, 328, 313, 178, 336, 135, 72, 265, 46, 215, 83, 144, 163, 31, 240, 122, 378)


def ragged_batch(seed: int) -> dict:
    """A ragged point of 8 heads drawn from `seed`: 4-32 requests, a tree of Q in {9, 17, 33, 65} rows,
    prefixes uniform in [lo, hi] (lo of 1k, 4k, 16k; hi of 32k, 64k, 128k), trees in [Q / 8, Q]."""
    rng = np.random.default_rng(seed)
    bsz, nq = int(rng.integers(4, 33)), int(rng.choice([9, 17, 33, 65]))
    lo, hi = int(rng.choice([1000, 4000, 16_000])), int(rng.choice([32_000, 65_536, 131_072]))
    lens = rng.integers(lo, hi + 1, size=bsz)
    trees = rng.integers(max(1, nq // 8), nq + 1, size=bsz)
    return {"heads": 8, "queries": nq, "batch": bsz, "lens": [int(v) for v in lens],
            "trees": [int(v) for v in trees], "seed": seed}


def points() -> list[dict]:
    """The attention suite's ragged point, the uniform points, then the seeded ragged ones."""
    uniform = [{"heads": h, "queries": q, "prefix": s, "batch": b} for h, q, s, b in UNIFORM]
    return [suite.ragged_point()] + uniform + [ragged_batch(s) for s in RAGGED_SEEDS]


def predicted(p: dict, grid: int) -> dict:
    """The v10 plan's view of point p on `grid` CTAs: jobs, the busiest CTA under each deal, their ratio,
    and whether the plan as built (ORDER_GAIN) orders it."""
    lens, trees = suite.point_requests(p)
    plan = cu.plan_v5(np.array(lens), np.array(trees), max(lens), p["queries"], p["heads"], grid)
    static, snake, _ = cu.deal_busiest(plan, grid)
    return {"jobs": int(plan[0]), "static_busiest": static, "snake_busiest": snake,
            "predicted_gain": static / snake, "ordered_as_built": cu.plan_order(plan, grid) is not None}


def total_ms(rows: list[dict], threshold: float) -> float:
    """The rows' total time under a gate at `threshold`: each point's snake time where its predicted gain
    exceeds it, else its static time."""
    return sum(r["snake_ms"] if r["predicted_gain"] > threshold else r["static_ms"] for r in rows)


def best_threshold(rows: list[dict]) -> dict:
    """The gate threshold on the predicted gain that gives the least total time over the rows (`total_ms`),
    against always-static and the threshold as built (`kdlib.cuda.attention.order_threshold`)."""
    cuts = sorted({1.0} | {r["predicted_gain"] for r in rows})
    best = min(cuts, key=lambda t: total_ms(rows, t))
    built = cu.order_threshold()
    return {"threshold": best, "total_ms": total_ms(rows, best),
            "static_total_ms": total_ms(rows, float("inf")), "built_threshold": built,
            "built_total_ms": total_ms(rows, built)}


def run(*, quick: bool = False) -> dict:
    """The suite (see the module docstring); quick: the first four points, 10 replays (else 20)."""
    import cupy
    import torch

    from kdlib.cuda import loader

    pts = points()[:4] if quick else points()
    iters = 10 if quick else 20
    grid = cupy.cuda.Device().attributes["MultiProcessorCount"]
    pool = torch.randn(suite.pool_rows(pts), suite.D_QK, device="cuda",
                       dtype=torch.bfloat16)  # [N, 576] KV rows
    inputs = [suite.point_inputs(p, pool) for p in pts]
    arms = [("static", 9, ""), ("snake", 10, FORCE_ORDER)] * 2
    times = [{"static": [], "snake": []} for _ in pts]
    outs = [{} for _ in pts]
    pdl, own = cu.PDL, cu.OWN_PLAN
    cu.PDL = False  # version 9 has no PDL launches: the arms differ in the deal alone
    cu.OWN_PLAN = False  # the plan kernel orders; the attend kernels' own plan would deal statically
    try:
        for name, version, opts in arms:  # arm-major: one compile each; the arms alternate over the grid
            with loader.extra_options(opts):
                suite.time_arm(name, pts, inputs, pool, times, outs, iters, version=version)
            print(f"[attention_gate] arm {name} (version {version} {opts}) done", flush=True)
    finally:
        cu.PDL, cu.OWN_PLAN = pdl, own
    rows = []
    for p, t, o in zip(pts, times, outs, strict=True):
        med = {k: statistics.median(v) for k, v in t.items()}
        row = {"heads": p["heads"], "queries": p["queries"], "batch": p["batch"], "prefix": p.get("prefix"),
               "ragged": "lens" in p, "seed": p.get("seed"), **predicted(p, grid),
               "static_ms": med["static"], "snake_ms": med["snake"], "arm_medians_ms": t,
               "measured_gain": med["static"] / med["snake"],
               "bitwise_equal": bool(cupy.array_equal(o["static"], o["snake"], equal_nan=True))}
        rows.append(row)
        print(f"[attention_gate] H{p['heads']} Q{p['queries']} B{p['batch']} "
              f"{'seed ' + str(p['seed']) if 'seed' in p else p.get('prefix') or 'ragged'}: predicted "
              f"{row['predicted_gain']:.3f}, measured {row['measured_gain']:.3f} (static "
              f"{med['static']:.4f}, snake {med['snake']:.4f} ms), bitwise {row['bitwise_equal']}",
              flush=True)
    return {
        "parameters": {"quick": quick, "iters": iters, "grid": grid, "arms": [a for a, _, _ in arms],
                       "force_order": FORCE_ORDER, "order_threshold": cu.order_threshold(), "points": pts},
        "rows": rows,
        "verdict": {"bitwise_equal_everywhere": all(r["bitwise_equal"] for r in rows),
                    **best_threshold(rows)},
        "notes": ["static: version 9; snake: version 10 built with -DORDER_GAIN=-64 (orders every plan past "
                  "one round), launched without PDL as version 9 is; predicted_gain: the plan's busiest CTA, "
                  "static deal over snake deal (kdlib.cuda.attention.deal_busiest); measured_gain: "
                  "static_ms / snake_ms"],
    }
