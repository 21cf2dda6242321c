"""GPU suite `serve`: `kdlib serve` under load, measured by `kdlib diagnose`'s load mode.

    python3 -m kdlib.perf.run --suite serve [--quick] --out DIR

`kdlib serve` runs as a child process (the trained tiny models, continuous batching over the batched
engine, --max-num-seqs 16) and `kdlib.diagnose.load_test` drives it through the official openai client at
fixed concurrency C = 1, 2, 4, 8, 16, once per arm (ARMS: method, dtype and the server's flags; DDTree in
float32, AR in float32 as the lever's baseline, DDTree in bfloat16 as the engine_batch suite runs it, and
that with the engine's step-time levers, --async-scheduling and then --enable-torch-compile too, an arm
that runs only on CUDA and only when asked for by name): TTFT / TPOT / ITL / end-to-end percentiles,
aggregate (output) and per-stream tok/s, goodput under SLO, the accepted-length x step-time decomposition
per level, the greedy check (outputs under load against the sequential ones of the same server) and every
figure's spread over repeats. `scaling[arm]` sums it up: aggregate and per-stream tok/s by C, aggregate
over C = 1, and the issue's goal (aggregate at C = 16 >= GOAL x C = 1, with no greedy mismatch).

The GPU machine has no FastAPI, uvicorn, pydantic or openai: carry the wheels of
tools/serve_wheels.txt (its header gives the commands). `run(arms=...)` (default: $KDLIB_SERVE_ARMS,
comma-separated names of ARMS) picks the arms; each arm's table is printed as soon as it is measured.
Wall-clock figures as a client sees them over loopback HTTP; the tiny models make every step launch-bound,
so they speak to the server and the batching, not to a large model's speed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

# arm -> (method, dtype, *the server's flags)
CPU_OK = True  # runs on the CUDA device when there is one, else on the CPU
ARMS = {"ddtree": ("ddtree", "float32"), "ar": ("ar", "float32"), "ddtree_bf16": ("ddtree", "bfloat16"),
        "ddtree_bf16_async": ("ddtree", "bfloat16", "--async-scheduling"),
        "ddtree_bf16_async_compile": ("ddtree", "bfloat16", "--async-scheduling", "--enable-torch-compile")}
CUDA_ONLY = "--enable-torch-compile"  # an arm with this flag runs only when asked for by name, on CUDA
FULL = {"concurrency": (1, 2, 4, 8, 16), "repeats": 3, "input_len": 128, "output_len": 256, "distinct": 16,
        "arms": tuple(a for a, spec in ARMS.items() if CUDA_ONLY not in spec)}
QUICK = {"concurrency": (1, 4, 16), "repeats": 1, "input_len": 64, "output_len": 64, "distinct": 8,
         "arms": ("ddtree",)}
GOAL = 8.0  # aggregate tok/s at C = 16 over C = 1
SLO = {"ttft_ms": 500.0, "tpot_ms": 50.0}  # goodput's latency targets
MAX_NUM_SEQS = 16


def scaling(result: dict) -> dict:
    """Aggregate / per-stream tok/s by concurrency (means over repeats) and the goal check."""
    levels = [lv for lv in result["levels"] if lv["mode"] == "concurrency"]
    agg = {lv["concurrency"]: lv["summary"]["output_throughput"]["mean"] for lv in levels}
    per = {lv["concurrency"]: lv["summary"].get("per_stream_tok_s", {}).get("mean") for lv in levels}
    mismatches = sum(r["greedy_mismatches"] or 0 for lv in levels for r in lv["runs"])
    base, top = agg.get(1), max(agg) if agg else None
    ratio = agg[top] / base if base and top else None
    return {"aggregate_tok_s": agg, "per_stream_tok_s": per,
            "aggregate_over_c1": {c: a / base for c, a in agg.items()} if base else None,
            "goal": {"concurrency": top, "over_c1": ratio, "target": GOAL, "greedy_mismatches": mismatches,
                     "met": bool(ratio is not None and top == MAX_NUM_SEQS and ratio >= GOAL
                                 and mismatches == 0)}}


def measure(device: str = "cpu", *, concurrency, repeats: int, input_len: int, output_len: int, distinct: int,
            arms=("ddtree",), serve_args=(), slo=SLO) -> dict:
    """load_test against a fresh `kdlib serve` per arm (ARMS) on `device` (the suite's core; runs on CPU
    too)."""
    from kdlib import diagnose
    from kdlib.serve import ServerProcess

    out = {"parameters": {"concurrency": list(concurrency), "repeats": repeats, "input_len": input_len,
                          "output_len": output_len, "distinct": distinct,
                          "arms": {a: list(ARMS[a]) for a in arms},
                          "slo": slo, "max_num_seqs": MAX_NUM_SEQS, "serve_args": list(serve_args)},
           "by_arm": {}, "scaling": {}}
    for arm in arms:
        method, dtype, *flags = ARMS[arm]
        args = ["--device", device, "--method", method, "--dtype", dtype, "--max-num-seqs", str(MAX_NUM_SEQS),
                "--log-level", "warning", *flags, *serve_args]
        with ServerProcess(args, startup_s=900) as srv:
            client = diagnose.OpenAIClient(srv.url)
            try:
                res = diagnose.load_test(client, concurrency=concurrency, repeats=repeats,
                                         input_len=input_len, output_len=output_len, distinct=distinct,
                                         slo=slo, progress=False)
            finally:
                client.close()
        out["by_arm"][arm] = res
        out["scaling"][arm] = scaling(res)
        print(f"[serve] {arm} ({', '.join([method, dtype, *flags])}):\n{diagnose.load_table(res)}\n"
              f"goal: {out['scaling'][arm]['goal']}", flush=True)
    first = out["by_arm"][arms[0]]
    out["model"], out["model_info"] = first["model"], first["model_info"]
    return out


def run(*, quick: bool = False, arms: Sequence[str] | None = None) -> dict:
    """`measure` on CUDA when present (else the CPU) with the QUICK profile (quick) or FULL.

    arms: names of ARMS to measure, in order; None: env `KDLIB_SERVE_ARMS` (comma-separated), else
        the profile's arms.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = dict(QUICK if quick else FULL)
    source = "arms"
    if arms is None and os.environ.get("KDLIB_SERVE_ARMS"):
        arms = [a.strip() for a in os.environ["KDLIB_SERVE_ARMS"].split(",") if a.strip()]
        source = "KDLIB_SERVE_ARMS"
    if arms is not None:
        p["arms"] = tuple(arms)
        unknown = [a for a in p["arms"] if a not in ARMS]
        if unknown:
            raise ValueError(f"{source}: unknown arms {unknown}; the arms are {list(ARMS)}")
        cuda_only = [a for a in p["arms"] if CUDA_ONLY in ARMS[a]]
        if cuda_only and device != "cuda":
            raise ValueError(f"{source}: arms {cuda_only} pass {CUDA_ONLY}, which needs a CUDA device")
    res = measure(device, **p)
    res["parameters"].update({"device": device, "profile": "quick" if quick else "full"})
    return res
