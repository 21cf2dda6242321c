"""GPU suite `engine_arms`: the batched engine's two step-time levers beside its plain graph replay.

    python3 -m kdlib.perf.run --suite engine_arms --out $OUT

The trained tiny model (bf16, code prompts of 256 tokens), AR and DDTree budget 32, C = 1 and 16,
each in four arms: graphs (the plain replay, the baseline of the same run), overlap (the host reads
step k's tokens while step k+1 runs), compile (torch.compile's fused kernels inside the graph) and
both. Rows as `engine_batch.run_row` makes them (wall step, profiler device time and kernel count,
the graph's device span, tokens/s, accepted length, the first steps' wall with compilation).
`run(streams=..., budget_s=...)` trims the run (defaults: env KDLIB_ARMS_STREAMS, e.g. "1", and
KDLIB_ARMS_BUDGET_S).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

# (name, torch.compile, overlap)
ARMS = (("graphs", False, False), ("overlap", False, True), ("compile", True, False),
        ("compile+overlap", True, True))
METHODS = (("ar", None), ("ddtree", 32))
STREAMS = (1, 16)
BUDGET_S = 150  # no new row starts past this many seconds (KDLIB_ARMS_BUDGET_S)


def run(*, streams: Sequence[int] | None = None, budget_s: float | None = None) -> dict:
    """Every (streams, method, arm) row; no quick mode (trim the run with the parameters).

    streams: concurrent streams C of each row block; None: env `KDLIB_ARMS_STREAMS` (comma-separated),
        else STREAMS.
    budget_s: no new row starts past this many seconds; None: env `KDLIB_ARMS_BUDGET_S`, else BUDGET_S.
    """
    import torch

    from kdlib import zoo
    from kdlib.perf.suites.engine_batch import NEW_TRAINED, PROMPT, run_row

    tok = zoo.load_tokenizer()
    target = zoo.load_target(device="cuda", dtype=torch.bfloat16)
    drafter = zoo.load_drafter(target)
    enc = [tok.encode(t)[:PROMPT] for t in zoo.held_out("code") if len(tok.encode(t)) > PROMPT]
    budget_s = float(os.environ.get("KDLIB_ARMS_BUDGET_S", BUDGET_S) if budget_s is None else budget_s)
    if streams is None:
        streams = os.environ.get("KDLIB_ARMS_STREAMS", ",".join(map(str, STREAMS))).split(",")
    streams = tuple(int(s) for s in streams)
    rows, cut, t0 = [], [], time.perf_counter()
    for c in streams:
        for m, b in METHODS:
            for arm, compile_, overlap in ARMS:
                if time.perf_counter() - t0 > budget_s:
                    cut.append({"streams": c, "method": m, "budget": b or 0, "arm": arm})
                    continue
                row = run_row(target, m, b, drafter, [enc[i % len(enc)] for i in range(c)], NEW_TRAINED,
                              {"model": "trained", "kind": "code", "context": PROMPT, "arm": arm},
                              compile_=compile_, overlap=overlap)
                rows.append(row)
                print(f"[engine_arms] {arm:>15} {m}{b or ''} C={c}: {row['step_ms']:.3f} ms, span "
                      f"{row['replay_span_ms'] or float('nan'):.3f} ms, "
                      f"kernels {row.get('kernels_per_step')}, "
                      f"{row['tokens_per_s']:.0f} tok/s", flush=True)
    return {"parameters": {"arms": [a[0] for a in ARMS], "methods": [list(m) for m in METHODS],
                           "streams": list(streams), "prompt": PROMPT, "new_tokens": NEW_TRAINED,
                           "dtype": "bfloat16",
                           "budget_s": budget_s},
            "rows": rows, "cut_for_time": cut}
