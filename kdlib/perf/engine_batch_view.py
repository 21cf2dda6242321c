"""Reading a recorded `engine_batch` result (suite kdlib/perf/suites/engine_batch.py) for notebook 03 and
tests.

    doc = kdlib.perf.load("engine_batch", "h200")
    df = rows(doc)              # the trained tiny model's rows; rows(doc, "bench") for the 8-layer model
    eager_vs_graph(doc)         # the eager loop baseline against the batched engine at C = 1
    goals_table(doc)            # the issue's goals recomputed from the rows, beside the file's own `goals`
    goal_mismatches(doc)        # [] when the recomputed values equal the recorded ones
    kernel_classes(row["top_kernels"])  # device us per step by kernel class (rows recorded with top_kernels)

Rows recorded before the suite counted kernels lack `kernels_per_step` and `top_kernels`: `rows` fills
both with None. Device time is NaN where the profiled steps could not hold every stream running.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kdlib.perf import profile

# DDTree tokens/s over (mean accepted x AR tokens/s) in the DDTree paper, as issue 16 states it
PAPER_RATIO_BAND = (0.60, 0.77)
PAPER = ("Ringel & Romano, “Accelerating Speculative Decoding with Block Diffusion Draft Trees” "
         "(arXiv 2604.12989; the paper kdlib/ref/tree.py follows)")
def method_label(method: str, budget: int | None) -> str:
    """'AR' or 'DDTree b32'."""
    return "AR" if method == "ar" else f"DDTree b{budget}"


def rows(doc: dict, section: str = "trained") -> pd.DataFrame:
    """One row per recorded run of `section` ('trained' or 'bench') with a `label` column (method and
    budget); `kernels_per_step` / `top_kernels` are None where the file does not hold them."""
    if section not in ("trained", "bench"):
        raise ValueError(f"section must be 'trained' or 'bench', got {section!r}")
    recs = doc.get(section) or []
    df = pd.DataFrame([{k: v for k, v in r.items() if k != "tokens"} for r in recs])
    if df.empty:
        return df
    for key in ("kernels_per_step", "top_kernels", "ratio_vs_accepted_ar", "agreement_with_ar", "kind"):
        if key not in df:
            df[key] = None
    df["label"] = [method_label(m, b) for m, b in zip(df.method, df.budget, strict=True)]
    df["device_ms"] = df.device_ms.astype(float)
    df["busy"] = df.busy.astype(float)
    return df


def eager_vs_graph(doc: dict, kind: str = "code") -> pd.DataFrame:
    """The eager single-stream loop (`baselines.eager_loop`, the code prompt) against the batched graph
    engine's C = 1 row of the same method and budget on `kind`: step times, device time, busy, tok/s."""
    df = rows(doc)
    eager = (doc.get("baselines") or {}).get("eager_loop") or []
    out = []
    for e in eager:
        g = df[(df.kind == kind) & (df.streams == 1) & (df.method == e["method"])
               & (df.budget == e["budget"])]
        if g.empty:
            continue
        g = g.iloc[0]
        out.append({"label": method_label(e["method"], e["budget"]), "eager_step_ms": e["step_ms"],
                    "graph_step_ms": g.step_ms, "graph_device_ms": g.device_ms, "graph_busy": g.busy,
                    "speedup": e["step_ms"] / g.step_ms, "eager_tokens_per_s": e["tokens_per_s"],
                    "graph_tokens_per_s": g.tokens_per_s, "eager_accepted": e["mean_accepted"],
                    "graph_accepted": g.mean_accepted})
    return pd.DataFrame(out)


def _median(xs) -> float | None:
    xs = [float(x) for x in xs]
    return float(np.median(xs)) if xs else None


def goals_table(doc: dict) -> list[dict]:
    """The issue's four goals recomputed from the trained rows: goal (1-4), what, target, measured, met,
    and `recorded` (the same quantity from the file's `goals`). Busy is the lowest recorded C = 1 busy
    (rows without a device time skipped); step times the median over text kinds at C = 1; the ratio per
    kind at budget 32, C = 1; scaling the mean aggregate tokens/s at C = 16 over that at C = 1 per method."""
    df = rows(doc)
    g = doc.get("goals") or {}
    tg = g.get("targets") or {}
    c1 = df[df.streams == 1]
    out = []

    def add(goal, what, target, cmp, measured, recorded):  # a file without goals: target None, met None
        met = None if target is None or measured is None or not math.isfinite(measured) else bool(
            measured >= target if cmp == ">=" else measured <= target)
        out.append({"goal": goal, "what": what, "target": "?" if target is None else f"{cmp} {target:g}",
                    "measured": measured, "met": met, "recorded": recorded})

    busy = [b for b in c1.busy if math.isfinite(b)]
    add(1, "device busy / wall step at C = 1 (lowest row)", tg.get("busy"), ">=", min(busy) if busy else None,
        g.get("busy_at_c1_min"))
    add(2, "AR step at C = 1 (ms, median over kinds)", tg.get("ar_step_ms"), "<=",
        _median(c1[c1.method == "ar"].step_ms), g.get("ar_step_ms_c1"))
    dd32 = c1[(c1.method == "ddtree") & (c1.budget == 32)]
    add(2, "DDTree b32 step at C = 1 (ms, median over kinds)", tg.get("ddtree32_step_ms"), "<=",
        _median(dd32.step_ms), g.get("ddtree32_step_ms_c1"))
    for r in dd32.itertuples():
        add(3, f"DDTree b32 tok/s / (accepted x AR tok/s), {r.kind}, C = 1", tg.get("ratio"), ">=",
            r.ratio_vs_accepted_ar, (g.get("ddtree32_ratio_by_kind") or {}).get(r.kind))
    for label in dict.fromkeys(df.label):
        sel = df[df.label == label]
        one, sixteen = sel[sel.streams == 1].tokens_per_s, sel[sel.streams == 16].tokens_per_s
        if len(one) and len(sixteen):
            m, b = sel.method.iloc[0], int(sel.budget.iloc[0])
            key = f"{m}{b or ''}"
            add(4, f"aggregate tok/s C = 16 / C = 1, {label}", tg.get("c16_over_c1"), ">=",
                float(sixteen.mean() / one.mean()), (g.get("aggregate_c16_over_c1") or {}).get(key))
    return out


def goal_mismatches(doc: dict, rel: float = 1e-9) -> list[str]:
    """Goal rows whose recomputed value differs from the file's `goals` (or that the file lacks)."""
    bad = []
    for r in goals_table(doc):
        m, rec = r["measured"], r["recorded"]
        if m is None or rec is None or not math.isclose(m, rec, rel_tol=rel):
            bad.append(f"goal {r['goal']} {r['what']}: recomputed {m}, recorded {rec}")
    return bad


def kernel_classes(top_kernels) -> dict:
    """{class: device us per step} over a row's `top_kernels` ([name, calls per step, us per step] each),
    largest first (`kdlib.perf.profile.kernel_classes`)."""
    by = profile.kernel_classes([(n, c, float(us)) for n, c, us in top_kernels or []])
    return {k: v["us"] for k, v in sorted(by.items(), key=lambda kv: -kv[1]["us"])}


def agreement(doc: dict, section: str = "trained") -> pd.DataFrame:
    """DDTree rows' bf16 token agreement with AR in the same engine: first_difference (the index of the
    first differing token; = of when all agree) and of (tokens compared), with the row's labels."""
    df = rows(doc, section)
    df = df[df.method == "ddtree"].copy()
    df["first_difference"] = [a["first_difference"] if a else None for a in df.agreement_with_ar]
    df["of"] = [a["of"] if a else None for a in df.agreement_with_ar]
    df["all_agree"] = df.first_difference == df.of
    return df.drop(columns=["agreement_with_ar", "top_kernels"])


def first_difference(a, b) -> int:
    """Index of the first position where token lists a and b differ (the shorter length when none does)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
