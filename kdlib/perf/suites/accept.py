"""Acceptance: mean accepted length per step of DDTree vs the chain vs AR per text kind, trained models.

    python3 -m kdlib.perf.run --suite accept [--quick]   ->  data/results/accept.<gpu>.json

For every text kind (code, prose, templated) the prompts are the first PROMPT_TOKENS tokens of
held-out documents (`kdlib.zoo.held_out`), never seen in training. Each prompt is continued
greedily for NEW_TOKENS tokens with `kdlib.engine.generate` by
  * AR: one token per target forward (accepted length 1 by definition);
  * chain: DFlash's linear verify, the drafter's top-1 at each of the L = B_blk - 1 depths
    (DDTree with K = 1 and budget L);
  * DDTree at each budget of BUDGETS (K = budget, the paper code's default).
The accepted length of a step is tau = root + accepted drafts (survey §1); per method the figure
is sum(tau) / steps over all prompts of a kind (the mean per step), with the per-prompt means
beside it. Every speculative output is compared token for token with AR's (the engine's
invariant at T = 0) and the result recorded. This suite measures acceptance, which is a count:
it has no byte or FLOP floor, and its wall times are not reported (the Python engine's step time
is not the object here; notebook 04 and the diagnose suite time steps).

The GPU run goes through the CUDA tree builder (kdlib.ops dispatch); if the first CUDA generate
raises, the suite says so in the payload and measures on the CPU instead (acceptance does not
depend on the device beyond float rounding).

On CUDA the payload also has `sampling`: the inverse-CDF draw of sampled acceptance
(`kdlib.cuda.accept.sample_tokens`), kernel v3 (a block per row) against v2 (a thread per row),
at V in SAMPLE_VOCABS (4,096, 32,000 and Kimi-K2's 163,840) and rows in SAMPLE_ROWS, float32
softmax rows. Each point is checked against the reference (`kdlib.ref.accept.sample_tokens` in
the version's order) on its first rows, then timed as CUDA-graph replays of back-to-back draws
(median over replays, per draw), cycling through enough copies of the rows that they do not
stay in L2 where the rows are many (`l2_resident` marks the points, small row counts, whose
replays read L2-warm rows, as a decode step that has just written its softmax does). Floor: the
bytes a draw must read (probs, uniforms) and write (tokens) over the device-to-device copy
bandwidth measured in the same run. `run(parts=...)` (default: env `KDLIB_ACCEPT_PARTS`) picks
the parts: `acceptance,sampling` (default) or either alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from kdlib import ref, zoo
from kdlib.cuda import accept
from kdlib.perf import timing

CPU_OK = True  # runs on the CUDA device when there is one, else on the CPU
BUDGETS = (8, 16, 32, 64)
PROMPT_TOKENS = 128  # enough context for the drafter's features; short enough for a fast CPU sample
NEW_TOKENS = 96  # several DDTree rounds even at full-block acceptance (16 per round)
FULL_PROMPTS = 12  # per kind on the GPU
QUICK_PROMPTS = 2  # per kind for the CPU sample
QUICK_NEW_TOKENS = 48
QUICK_BUDGETS = (8, 32)
PARTS = ("acceptance", "sampling")
SAMPLE_VOCABS = (4096, 32000, 163840)
SAMPLE_ROWS = (1, 4, 16, 64, 256, 1024)
QUICK_SAMPLE_ROWS = (1, 64, 1024)
SAMPLE_TIMED = (2, 3)  # kdlib.cuda.accept sampling versions timed: the thread-per-row v2 and v3
SAMPLE_REPEAT = {2: 1, 3: 20}  # draws per graph: v2 takes milliseconds, v3 microseconds
SAMPLE_CHECK_ROWS = 8  # rows of each point checked against the reference
SAMPLE_FOOTPRINT = 4  # cycled copies of the rows span at least this many L2 sizes


def prompts(tok, kind: str, n: int, prompt_tokens: int, folder=None) -> list[list[int]]:
    """The first `prompt_tokens` ids of up to n held-out documents of `kind` (shorter ones skipped)."""
    out = []
    for text in zoo.held_out(kind, folder=folder):
        ids = tok.encode(text)
        if len(ids) >= prompt_tokens:
            out.append(ids[:prompt_tokens])
        if len(out) == n:
            break
    return out


def methods(block_size: int, budgets) -> list[tuple[str, dict]]:
    """(name, generate kwargs) of every method measured."""
    horizon = block_size - 1
    out = [("ar", {"method": "ar"}), ("chain", {"method": "ddtree", "budget": horizon, "top_k": 1})]
    out += [(f"ddtree_b{b}", {"method": "ddtree", "budget": b}) for b in budgets]
    return out


def measure(device: str, n_prompts: int, new_tokens: int, budgets=BUDGETS, prompt_tokens: int = PROMPT_TOKENS,
            folder=None, log=print, time_limit_s: float | None = None) -> dict:
    """The acceptance payload for the trained models in `folder` (default data/models) on `device`.

    Prompts are taken in rounds (prompt i of every kind, every method), so that a run stopped by
    `time_limit_s` (no new round starts after it) still has the same prompts for every method.
    """
    import time

    from kdlib.engine.generate import generate

    t0 = time.perf_counter()
    tok = zoo.load_tokenizer(folder)
    target = zoo.load_target(device=device, folder=folder)
    drafter = zoo.load_drafter(target, folder=folder)
    notes = []
    if device != "cpu":
        try:
            generate(target, list(range(2, 20)), 8, method="ddtree", drafter=drafter, budget=8)
        except Exception as e:  # the CUDA path may be broken mid-development: measure on the CPU instead
            notes.append(f"CUDA generate failed ({type(e).__name__}: {e}); measured on the CPU")
            log(notes[-1])
            device = "cpu"
            target = zoo.load_target(device="cpu", folder=folder)
            drafter = zoo.load_drafter(target, folder=folder)
    plan = methods(drafter.block_size, budgets)
    ps = {kind: prompts(tok, kind, n_prompts, prompt_tokens, folder) for kind in zoo.KINDS}
    acc = {
        kind: {name: {"per_prompt": [], "taus": [], "sizes": [], "equal": []} for name, _ in plan}
        for kind in ps
    }
    rounds = 0
    for i in range(max(len(v) for v in ps.values())):
        if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
            notes.append(f"stopped after {rounds} prompt rounds (time limit {time_limit_s:.0f} s)")
            log(notes[-1])
            break
        for kind, kind_prompts in ps.items():
            if i >= len(kind_prompts):
                continue
            ar_tokens = None
            for name, kw in plan:
                res = generate(target, kind_prompts[i], new_tokens,
                               drafter=drafter if kw["method"] == "ddtree" else None, **kw)
                ar_tokens = res.tokens if name == "ar" else ar_tokens
                a = acc[kind][name]
                a["per_prompt"].append(round(res.mean_accepted, 4))
                a["taus"] += res.accepted
                a["sizes"] += res.tree_sizes
                a["equal"].append(res.tokens == ar_tokens)
        rounds += 1
        log(
            f"[accept] round {rounds}: "
            + "  ".join(
                f"{k} " + "/".join(f"{np.mean(acc[k][n]['taus']):.2f}" for n, _ in plan)
                for k in ps
                if acc[k]["ar"]["taus"]
            )
        )
    table = {}
    for kind in ps:
        rows = {}
        for name, kw in plan:
            a = acc[kind][name]
            n = len(a["per_prompt"])
            rows[name] = {
                "mean_accepted": float(np.mean(a["taus"])) if a["taus"] else None,
                "per_prompt": a["per_prompt"],
                "steps": len(a["taus"]),
                "mean_verified_rows": float(np.mean(a["sizes"])) if a["sizes"] else None,
                # tau_hist[t] = steps that accepted t tokens (root included), t = 0..B_blk
                "tau_hist": np.bincount(a["taus"], minlength=drafter.block_size + 1).tolist(),
                "tokens_per_forward": new_tokens * n / (len(a["taus"]) + n) if n else None,
                "equal_to_ar": all(a["equal"]),
                **(
                    {"budget": kw["budget"], "top_k": kw.get("top_k", kw["budget"])}
                    if kw["method"] == "ddtree"
                    else {}
                ),
            }
        table[kind] = {"prompts": len(acc[kind]["ar"]["per_prompt"]), "methods": rows}
    return {
        "parameters": {"device": device, "prompts_per_kind": n_prompts, "prompt_tokens": prompt_tokens,
                       "new_tokens": new_tokens, "budgets": list(budgets), "block_size": drafter.block_size,
                       "temperature": 0.0, "methods": [name for name, _ in plan],
                       "models_sha256": zoo.training_record(folder).get("models_sha256", {})},
        "notes": notes,
        "accept": table,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _sample_point(probs_all, u_all, rows: int, version: int, iters: int) -> dict:
    """One timed (rows, version) point over the cycled copies probs_all [C, N, V], u_all [C, N]."""
    import cupy

    copies, _, v = probs_all.shape
    repeat = SAMPLE_REPEAT[version]
    tokens = cupy.full((copies, rows), -7, dtype=cupy.int64)  # [C, rows]
    calls = [
        (probs_all[i % copies, :rows], u_all[i % copies, :rows], tokens[i % copies]) for i in range(repeat)
    ]

    def draws():
        for p, u, out in calls:
            accept.sample_tokens(p, u, out=out, version=version)

    t = timing.graph_time(draws, iters=iters, warmup=5).as_dict()
    k = min(rows, SAMPLE_CHECK_ROWS)
    want = ref.sample_tokens(probs_all[0, :k].get(), u_all[0, :k].get(), order=accept.SAMPLE_ORDER[version])
    return {
        "rows": rows,
        "vocab": v,
        "version": version,
        "kernel": accept.sample_kernel(np.float32, version)[1],
        "exact_first_rows": bool((tokens[0, :k].get() == want).all()),
        "checked_rows": k,
        "draws_per_graph": repeat,
        "graph_replay": t,
        "kernel_us": t["median_ms"] * 1e3 / repeat,
    }


def bench_sampling(vocabs=SAMPLE_VOCABS, rows=SAMPLE_ROWS, iters: int = 10, log=print) -> dict:
    """The `sampling` payload: v2 and v3 per (V, rows), with the copy-bandwidth floor of each point."""
    import cupy

    copy = timing.copy_bandwidth()
    bw = copy["Bps"]
    l2 = int(cupy.cuda.Device().attributes["L2CacheSize"])
    gen = cupy.random.RandomState(0)
    points = []
    for v in vocabs:
        n = max(rows)
        copies = max(1, min(SAMPLE_REPEAT[3], -(-SAMPLE_FOOTPRINT * l2 // (n * v * 4))))
        z = gen.standard_normal((copies, n, v), dtype=cupy.float32) * 3.0  # [C, N, V] logits
        z -= z.max(axis=-1, keepdims=True)
        probs = cupy.exp(z)
        probs /= probs.sum(axis=-1, keepdims=True)  # [C, N, V] float32 softmax rows
        del z
        u = gen.random_sample((copies, n))  # [C, N] float64
        for r in rows:
            nbytes = r * v * 4 + r * 8 + r * 8  # probs and uniforms read, tokens written
            floor_us = nbytes / bw * 1e6
            for version in SAMPLE_TIMED:
                pt = _sample_point(probs, u, r, version, iters)
                # probs bytes one replay cycles through
                footprint = min(copies, pt["draws_per_graph"]) * r * v * 4
                pt.update(bytes=nbytes, floor_us=floor_us, fraction_of_copy_bw=floor_us / pt["kernel_us"],
                          cycled_copies=copies, footprint_bytes=footprint, l2_resident=footprint < l2)
                points.append(pt)
                log(f"[accept] sample v{version} V={v} rows={r}: {pt['kernel_us']:.1f} us "
                    f"(floor {floor_us:.2f} us, exact={pt['exact_first_rows']})")
        del probs, u
        cupy.get_default_memory_pool().free_all_blocks()
    speedup = []
    for p3 in (p for p in points if p["version"] == 3):
        p2 = next(
            p for p in points if p["version"] == 2 and p["vocab"] == p3["vocab"] and p["rows"] == p3["rows"]
        )
        speedup.append(
            {"vocab": p3["vocab"], "rows": p3["rows"], "v2_over_v3": p2["kernel_us"] / p3["kernel_us"]}
        )
    return {"parameters": {"vocabs": list(vocabs), "rows": list(rows), "versions": list(SAMPLE_TIMED),
                           "replays": iters, "dtype": "float32",
                           "inputs": "softmax of N(0, 3^2) logits per row, uniforms from "
                                     "cupy.random.RandomState(0)",
                           "l2_bytes": l2, "footprint": f">= {SAMPLE_FOOTPRINT} x L2 per graph where rows "
                                                        "allow"},
            "copy": copy, "copy_bandwidth_Bps": bw, "points": points, "speedup": speedup}


def _parts(parts: Sequence[str] | None = None) -> tuple[str, ...]:
    """The parts to run: `parts`, else env `KDLIB_ACCEPT_PARTS` (comma-separated), else PARTS."""
    if parts is not None:
        chosen, source = tuple(parts), "parts"
    else:
        raw = os.environ.get("KDLIB_ACCEPT_PARTS", ",".join(PARTS))
        chosen, source = tuple(p.strip() for p in raw.split(",") if p.strip()), "KDLIB_ACCEPT_PARTS"
    bad = [p for p in chosen if p not in PARTS]
    if bad or not chosen:
        got = list(parts) if parts is not None else os.environ.get("KDLIB_ACCEPT_PARTS")
        raise ValueError(f"{source} must name some of {PARTS}, got {got!r}")
    return chosen


def run(*, quick: bool = False, parts: Sequence[str] | None = None) -> dict:
    """The suite (see the module docstring).

    quick: QUICK_PROMPTS prompts of QUICK_NEW_TOKENS tokens at QUICK_BUDGETS, and sampling at
        QUICK_SAMPLE_ROWS with 3 replays (else the full sweep, 10 replays).
    parts: some of PARTS; None: env `KDLIB_ACCEPT_PARTS`, else both.
    """
    import torch

    parts = _parts(parts)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    payload = {"parts": list(parts)}
    if "acceptance" in parts:
        if quick:
            payload.update(measure(device, QUICK_PROMPTS, QUICK_NEW_TOKENS, QUICK_BUDGETS))
        else:
            payload.update(measure(device, FULL_PROMPTS, NEW_TOKENS, BUDGETS))
    if "sampling" in parts:
        if device != "cuda":
            payload["sampling"] = {"absent": "no CUDA device"}
        else:
            payload["sampling"] = bench_sampling(rows=QUICK_SAMPLE_ROWS if quick else SAMPLE_ROWS,
                                                 iters=3 if quick else 10)
    return payload
