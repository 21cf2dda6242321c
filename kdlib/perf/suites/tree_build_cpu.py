"""Suite `tree_build_cpu` (CPU): the numpy reference tree builder's time, the GPU builder's baseline.

    python -m kdlib.perf.run --suite tree_build_cpu     # -> data/results/tree_build_cpu.cpu.json
    measure(batches=(1, 4), budgets=(8, 16), iters=3)   # the same from Python (notebook 01)
"""

from __future__ import annotations

from kdlib.perf import cpu_time
from kdlib.ref.tree import build_tree_batch, synthetic_topk

# issue 3: the seeds' SGLang comparison point
CPU_ONLY = True  # host-only: `kdlib.perf.run` names its file <suite>.cpu.json on any machine
BASELINE_POINT = {"batch": 64, "depth": 15, "budget": 64, "k_prime": 64}


def measure(
    batches=(1, 4, 16, 64), budgets=(8, 16, 32, 64, 128), *, depth: int = 15, iters: int = 10, seed: int = 0
) -> dict:
    """Time the reference `build_tree_batch` on the CPU (kdlib.perf.cpu_time: warm-up, median, p10/p90).

    Headline: BASELINE_POINT (B 64, L 15, budget 64, K' 64). Sweeps: against batch at budget 64,
    and against budget at the largest batch with K' = budget (REF's K = min(N, V)). Inputs from
    `synthetic_topk(seed, ...)`. Returns the suite's payload.
    """
    def measure(batch, budget, k_prime):
        ids, lps = synthetic_topk(seed, batch, depth, k_prime)
        t = cpu_time(lambda: build_tree_batch(ids, lps, budget), warmup=2, iters=iters)
        return {"batch": batch, "depth": depth, "budget": budget, "k_prime": k_prime, **t.as_dict(),
                "per_request_us": t.median_ms * 1e3 / batch}

    p = BASELINE_POINT
    headline = measure(p["batch"], p["budget"], p["k_prime"]) if depth == p["depth"] else None
    return {
        "parameters": {
            "batches": list(batches),
            "budgets": list(budgets),
            "depth": depth,
            "iters": iters,
            "seed": seed,
            "inputs": "kdlib.ref.tree.synthetic_topk (sharpness 5.0: mean top-1 prob about 0.56, "
            "draft_vocab 1024)",
        },
        "headline": headline,
        "vs_batch": [measure(b, 64, 64) for b in batches],
        "vs_budget": [measure(max(batches), n, n) for n in budgets],
    }


def run(*, quick: bool = False) -> dict:
    """The suite entry point (kdlib.perf.run): `measure` with 10 repeats, or 3 when quick."""
    return measure(iters=3 if quick else 10)
