"""Acceptance: mean accepted length per step of DDTree vs the chain vs AR, per text kind, on the trained models.

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
"""

from __future__ import annotations

BUDGETS = (8, 16, 32, 64)
PROMPT_TOKENS = 128  # enough context for the drafter's features; short enough for a fast CPU sample
NEW_TOKENS = 96  # several DDTree rounds even at full-block acceptance (16 per round)
FULL_PROMPTS = 12  # per kind on the GPU
QUICK_PROMPTS = 2  # per kind for the CPU sample
QUICK_NEW_TOKENS = 48
QUICK_BUDGETS = (8, 32)


def prompts(tok, kind: str, n: int, prompt_tokens: int, folder=None) -> list[list[int]]:
    """The first `prompt_tokens` ids of up to n held-out documents of `kind` (shorter ones skipped)."""
    from kdlib import zoo

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

    import numpy as np

    from kdlib import zoo
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
    acc = {kind: {name: {"per_prompt": [], "taus": [], "sizes": [], "equal": []} for name, _ in plan} for kind in ps}
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
        log(f"[accept] round {rounds}: " + "  ".join(
            f"{k} " + "/".join(f"{np.mean(acc[k][n]['taus']):.2f}" for n, _ in plan) for k in ps if acc[k]["ar"]["taus"]))
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
                **({"budget": kw["budget"], "top_k": kw.get("top_k", kw["budget"])} if kw["method"] == "ddtree" else {}),
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


def run(args) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        return measure(device, QUICK_PROMPTS, QUICK_NEW_TOKENS, QUICK_BUDGETS)
    return measure(device, FULL_PROMPTS, NEW_TOKENS, BUDGETS)
