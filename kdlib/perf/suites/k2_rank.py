"""GPU suite `k2_rank`: one TP8 rank of Kimi-K2.6 at real shapes on one GPU (`kdlib.engine.rank`).

    python3 -m kdlib.perf.run --suite k2_rank --out $OUT [--quick]
    env: K2_RANK_BUDGET_S (seconds for the grid, default 200), K2_RANK_MOE (tp | ep, default tp),
         K2_RANK_COMPILE (1: torch.compile the pieces between the kernels, after the PLAIN_ROWS are measured
         without it; 0: never; default 1), K2_RANK_CONTEXTS (comma list, default all, in CONTEXTS order),
         K2_RANK_RESUME (a k2_rank JSON of an earlier run: its rows are kept and not measured again),
         K2_RANK_ROUTING (uniform | router, default uniform: `kdlib.engine.rank.RankStep`)

Sections of the payload:
  memory     GPU memory allocated by the rank's weights and by one 200,000-token latent cache against
             `kdlib.memory` (weights per GPU, kv_bytes at tp 8): `ratio`, `within_2pct`
  setup      weight generation seconds, the drafter shape (DFLASH_KIMI, with its source), bytes
  ceilings   the recorded copy bandwidth and bf16 matmul rate (data/results/ceilings.h200.json) the floors use
  allreduce  the recorded NCCL fit (data/results/tp.h200.json, largest world, graph fit first) the modelled
             all-reduce uses, extrapolated to world 8 by the ring formula (modelled, not measured)
  rows       per (context, streams C, method): the whole step (one CUDA graph, median of replays), each
             part in its own graph (draft, tree, verify, accept, commit) and the verify forward's pieces
             (dense and norms, attention, routed MoE) each alone over all layers; each beside its floor
             (bytes / copy bandwidth, FLOPs / matmul rate); the modelled all-reduce; the accepted length
             the forced-acceptance drafter produced; MoE bound overflows (must be 0); `compiled`; the
             profiled replay of the whole step (`profile`: device ms against the replay's wall ms, kernels
             per step, device us and calls per kernel class, the top kernels); the row's commit and date
  cut        the grid rows not measured (time budget, or streams x context beyond the SGLang pool that
             `kdlib.memory` predicts for a TP8 H200 rank)
  engine     after the grid, ENGINE_ROWS through the batched engine itself (`BatchEngine` over
             `RankTarget`: uniform experts, synthetic prefill, CUDA graphs; `measure_engine`): per step the
             replay's device span and the host's wall, the accepted length the random drafter reaches, a
             profile of a few more steps (kernels per step and per class), and the RankStep row of the same
             point (`rank_step_ms`) beside them
The JSON is rewritten after every row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from kdlib import memory
from kdlib.perf import profile, rank_work, results, timing
from kdlib.perf.suites import env_flag
from kdlib.perf.timing import floor_ms

CONTEXTS = (5500, 200000, 128000, 32000, 128)  # the seeds' 5.5k first, then the longest
# measured without torch.compile before the pieces are compiled: the compiled rows' baseline in the same run
PLAIN_ROWS = ((5500, 1, None), (5500, 1, 16), (5500, 10, None), (5500, 10, 16))
STREAMS = (1, 10, 4, 16)
BUDGETS = (None, 8, 16, 32, 64)  # None = AR
ACCEPTED = 4  # the forced accepted length (bonus included) of the DDTree rows: a parameter
# (context, C, budget) run through BatchEngine after the grid, and the steps measured at each
ENGINE_ROWS = ((5500, 1, None), (5500, 1, 16), (5500, 10, None), (5500, 10, 16), (128, 16, 16))
ENGINE_STEPS = 12
ENGINE_PROFILED = 3  # engine steps profiled after the timed ones
P_TOP = 0.8  # top-1 probability of the draft profile (tree shape)


def grid(pool_tokens: int, quick: bool, contexts: tuple[int, ...] | None = None
         ) -> tuple[list[tuple[int, int, int | None]], list[dict]]:
    """(context, C, budget) rows in measuring order, and the rows cut because C x context exceeds the pool.
    contexts: only these (in CONTEXTS order)."""
    rows, cut = [], []
    ctxs, streams, budgets = ((5500, 128), (1, 10), (None, 16)) if quick else (CONTEXTS, STREAMS, BUDGETS)
    if contexts is not None:
        unknown = set(contexts) - set(CONTEXTS)
        if unknown:
            raise ValueError(f"contexts {sorted(unknown)} are not in the grid's {CONTEXTS}")
        ctxs = tuple(x for x in ctxs if x in contexts)
    for ctx in ctxs:
        for c in streams:
            for b in budgets:
                if c * (ctx + (b or 0) + 1) > pool_tokens:
                    cut.append(
                        {"context": ctx, "streams": c, "budget": b, "why": "beyond the predicted pool"}
                    )
                else:
                    rows.append((ctx, c, b))
    return rows, cut


def _floor(nbytes: float, flops: float, ceil: dict) -> dict:
    return floor_ms(
        nbytes, flops, bandwidth_Bps=ceil["copy_bandwidth_Bps"], flop_rate=ceil["bf16_matmul_flops"]
    )


def floors(step, ceil: dict) -> dict:
    """Per-component floors of a RankStep (bytes each read once, useful FLOPs: `kdlib.perf.rank_work`)."""
    work = rank_work.piece_work(step.m.shape, step.d.ds if step.ddtree else None, step.C, step.W, step.ctx)
    return {p: _floor(w["bytes"], w["flops"], ceil)
            for p, w in rank_work.totals(work, step.m.cfg, step.ddtree).items()}


def timed(fn, pool, iters: int, warmup: int = 1) -> tuple[dict, str | None]:
    """Median of CUDA-graph replays of fn (graphs in `pool`, None: a pool of their own); if the capture fails,
    eager calls (and the error, recorded): a capture failure must not lose the row."""
    t, _, err = timing.graph_or_eager(fn, iters=iters, warmup=warmup, pool=pool)
    return t.as_dict(), err


def measure_row(model, drafter, pool, ctx: int, C: int, budget, ceil: dict, fit: dict, iters: int,
                routing: str = "uniform") -> dict:
    import torch

    from kdlib.engine.rank import RankStep, allreduce_ms

    t0 = time.perf_counter()
    step = RankStep(
        model, C, ctx, budget, drafter if budget else None, accepted=ACCEPTED, p_top=P_TOP, pool=pool,
        routing=routing,
    )
    step.run(save=True)  # eager: fills the pieces' inputs, compiles kernels
    torch.cuda.synchronize()
    # each graph in a memory pool of its own, freed with it: a pool shared with graphs already freed can fail
    # the next capture inside torch's allocator (k2_layer.measure)
    errors = {}
    whole, errors["step"] = timed(step.run, None, iters, warmup=2)
    parts, pieces = {}, {}
    for p in step.parts():
        parts[p], errors[p] = timed(lambda p=p: step.part(p), None, iters)
    for p in ("dense", "attention", "moe"):
        pieces[p], errors[p] = timed(lambda p=p: step.run(only=(p,)), None, iters)
    torch.cuda.synchronize()
    prof = _profile(step)
    fl = floors(step, ceil)
    ar = [allreduce_ms(b, fit, model.shape.tp) for b in step.allreduce_bytes()]
    comps = {"moe": pieces["moe"]["median_ms"], "attention": pieces["attention"]["median_ms"],
             "dense": pieces["dense"]["median_ms"]}
    for p in ("draft", "tree", "accept", "commit"):
        if p in parts:
            comps[p] = parts[p]["median_ms"]
    row = {"context": ctx, "streams": C, "method": "ddtree" if budget else "ar", "budget": budget,
           "rows_per_stream": step.W, "m_rows": step.M, "moe_count_bound": step.bound,
           "step": whole, "step_ms": whole["median_ms"], "parts": parts, "pieces": pieces,
           "graph_errors": {k: v for k, v in errors.items() if v}, "graphs": not any(errors.values()),
           "components_ms": comps, "components_sum_ms": sum(comps.values()),
           "floors": fl, "floor_sum_ms": sum(f["floor_ms"] for f in fl.values()),
           "allreduce_modelled_ms": sum(ar), "allreduce_calls": len(ar),
           "step_with_allreduce_ms": whole["median_ms"] + sum(ar),
           "accepted_mean": float(step.tau.float().mean()), "accepted_target": step.accepted,
           "moe_bound_overflows": int(step.overflow), "routing": routing, "compiled": model.compiled,
           "profile": prof,
           "commit": results.git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "wall_s": time.perf_counter() - t0}
    if prof:
        prof["busy"] = prof["device_ms"] / whole["median_ms"]
    n = row["accepted_mean"]
    row["tok_s_per_stream"] = n / row["step_with_allreduce_ms"] * 1e3
    row["tok_s"] = C * row["tok_s_per_stream"]
    torch.cuda.empty_cache()
    return row


def measure_engine(model, drafter, ctx: int, C: int, budget, steps: int = ENGINE_STEPS,
                   profiled: int = ENGINE_PROFILED) -> dict:
    """C requests of `ctx` prompt tokens through `BatchEngine` over `RankTarget(model, "uniform",
    "synthetic")` (AR when budget is None, else DDTree with `drafter`), admitted together: steps + 1 engine
    steps timed (the first, prefill and capture, left out of the medians): the host wall (`step_ms`) and, on
    CUDA, each replay's device span (`replay_ms`; the engine's `replay_ms` list); then, on CUDA, `profiled`
    more steps under the profiler (`profile`: kernels per step, device ms, per-class sums, the top kernels;
    the requests are long enough that every profiled step has all C lanes at work). Acceptance is the random
    drafter's (tau ~ 1), not RankStep's forced one."""
    import statistics

    import torch

    from kdlib.engine.batch import BatchEngine
    from kdlib.engine.rank import RankTarget

    W = (budget or 0) + 1
    cuda = model.device.type == "cuda"
    profiled = profiled if cuda else 0
    # the prefill's token and at most W a step: every lane still at work in the last step
    new_tokens = (steps + 2 + profiled) * W
    target = RankTarget(model, routing="uniform", prefill="synthetic", max_rows=C * W)
    kw = dict(method="ddtree", drafter=drafter, budget=budget) if budget else dict(method="ar")
    eng = BatchEngine(target, max_streams=C, max_context=ctx + new_tokens, **kw)
    eng.replay_ms = [] if eng.graphs else None
    g = torch.Generator().manual_seed(ctx + C)
    for _ in range(C):
        eng.add_request(torch.randint(0, target.cfg.vocab_size, (ctx,), generator=g).tolist(), new_tokens)
    t0 = time.perf_counter()
    for _ in range(steps + 1):
        eng.step()
    wall = time.perf_counter() - t0
    steps_ms = list(eng.step_ms)  # the engine keeps the last STEP_HISTORY
    host = steps_ms[1:] or steps_ms
    replay = eng.replay_ms[1:] if eng.graphs else []
    st = eng.spec_stats
    row = {"context": ctx, "streams": C, "method": "ddtree" if budget else "ar", "budget": budget,
           "steps": len(eng.step_ms), "step_ms": statistics.median(host),
           "replay_ms": statistics.median(replay) if replay else None,
           "accepted_mean": (1 + st["accepted_tokens"] / st["drafts"]) if st["drafts"] else 1.0,
           "graphs": eng.graphs, "overflow": int(target.overflow), "compiled": model.compiled,
           "commit": results.git_commit(), "wall_s": wall}
    row["device_share"] = row["replay_ms"] / row["step_ms"] if replay else None
    row["profile"] = None
    if profiled:
        p = profile.device_profile(eng.step, steps=profiled, top=15)
        p["classes"] = profile.kernel_classes(p.pop("kernels"))
        row["profile"] = p
    del eng
    if cuda:
        torch.cuda.empty_cache()
    return row


def _profile(step) -> dict | None:
    """The whole step captured once more (a memory pool of its own) and three replays profiled
    (`kdlib.perf.profile`): device ms, kernels per step, per-class sums, the top 15 kernels; None where the
    capture fails."""
    import torch

    try:
        g = timing.torch_graph(step.run)
    except Exception:  # noqa: BLE001 - the step's own timing already records a capture failure
        torch.cuda.synchronize()
        return None
    g.replay()
    p = profile.device_profile(g.replay, steps=3, top=15)
    p["classes"] = profile.kernel_classes(p.pop("kernels"))
    return p


def _recorded(name: str) -> dict:
    r = results.load(name, "h200")
    if r is None:
        raise SystemExit(f"k2_rank needs the recorded {name} suite (data/results/{name}.h200.json)")
    return r


def ceilings() -> dict:
    """The recorded copy bandwidth and bf16 matmul rate the floors divide by, and their file: the running
    GPU's (`results.ceilings`; an H100 run divided by the H200's)."""
    c = results.ceilings()
    if not c.recorded:
        raise SystemExit(f"k2_rank needs a recorded ceilings suite for this GPU or the H200 ({c.source})")
    return {"copy_bandwidth_Bps": c.bandwidth_Bps, "bf16_matmul_flops": c.flop_rate, "path": c.source}


def allreduce_fit() -> dict:
    tp = _recorded("tp")
    fits = tp.get("allreduce_graph_fit") or tp["allreduce_fit"]
    w = max(fits, key=int)
    return {"world_measured": int(w), "source": "allreduce_graph_fit" if tp.get("allreduce_graph_fit") else
            "allreduce_fit", "path": tp["_path"], **fits[w]}


def run(*, quick: bool = False, out: str | None = None, budget_s: float | None = None,
        moe_mode: str | None = None, compile: bool | None = None, contexts: Sequence[int] | None = None,
        resume: str | None = None, routing: str | None = None) -> dict:
    """The memory check, then the grid (module docstring), the payload rewritten into `out` after each row.

    quick: contexts 5,500 and 128, C = 1 and 10, AR and budget 16 only.
    out: folder of the JSON (None: data/results/).
    budget_s: no new row starts past this many seconds of the grid; None: env K2_RANK_BUDGET_S, else 200.
    moe_mode: "tp" (experts sliced) or "ep" (whole experts); None: env K2_RANK_MOE, else "tp".
    compile: torch.compile the pieces between the kernels after PLAIN_ROWS are measured without it;
        None: env K2_RANK_COMPILE (0 / false / no / off: off), else on.
    contexts: only these contexts of CONTEXTS; None: env K2_RANK_CONTEXTS (comma list), else all.
    resume: a k2_rank JSON of an earlier run whose rows are kept and not measured again; None: env
        K2_RANK_RESUME, else none.
    routing: the experts' choice, "uniform" or "router" (`kdlib.engine.rank.RankStep`); None: env
        K2_RANK_ROUTING, else "uniform".
    """
    import torch

    from kdlib.engine.config import ModelConfig
    from kdlib.engine.rank import DFLASH_KIMI, RankDrafter, RankModel, RankShape

    env = os.environ.get
    budget_s = float(env("K2_RANK_BUDGET_S", "200") if budget_s is None else budget_s)
    moe_mode = env("K2_RANK_MOE", "tp") if moe_mode is None else moe_mode
    compile_ = env_flag("K2_RANK_COMPILE", True) if compile is None else bool(compile)
    if contexts is None:
        contexts = tuple(int(x) for x in env("K2_RANK_CONTEXTS", "").split(",") if x) or None
    resume = env("K2_RANK_RESUME") if resume is None else resume
    routing = env("K2_RANK_ROUTING", "uniform") if routing is None else routing
    if resume and not os.path.exists(resume):
        raise ValueError(f"K2_RANK_RESUME / resume: {resume} does not exist (the grid would start over and "
                         "overwrite the record)")
    old = json.loads(Path(resume).read_text()) if resume else {"rows": []}
    kept = old["rows"]
    # rows recorded before `routing` was a setting used the router's own choice
    other = sorted({r.get("routing", "router") for r in kept} - {routing})
    if other:  # kept, they would stand beside this run's rows under a routing they were not measured at
        raise ValueError(f"K2_RANK_RESUME / resume: {resume} holds rows of routing {other}, not {routing!r}; "
                         "resume with that routing or start a new record")
    was = {"moe_mode": old.get("parameters", {}).get("moe_mode", moe_mode),
           "GPU": old.get("provenance", {}).get("gpu", results.gpu_name())}
    for what, now in (("moe_mode", moe_mode), ("GPU", results.gpu_name())):
        if resume and was[what] != now:  # the rows carry neither: the record's header names them
            raise ValueError(f"K2_RANK_RESUME / resume: {resume} was measured at {what} {was[what]!r}, this "
                             f"run at {now!r}; resume with that {what} or start a new record")
    name = "kimi-k2.6"
    cfg_dict = memory.load_config(name)
    cfg = ModelConfig.from_dict(cfg_dict)
    shape = RankShape(cfg, tp=8, rank=0, moe_mode=moe_mode)
    ceil = ceilings()
    fit = allreduce_fit()
    payload = {"parameters": {"config": name, "tp": 8, "rank": 0, "moe_mode": moe_mode, "accepted": ACCEPTED,
                              "p_top": P_TOP, "quick": quick, "budget_s": budget_s, "iters": 10,
                              "compile": compile_, "routing": routing,
                              "plain_rows": [list(r) for r in PLAIN_ROWS] if compile_ else [],
                              "resumed_rows": len(kept)},
               "ceilings": ceil, "allreduce": fit, "rows": [], "cut": []}

    def save():
        results.write("k2_rank", payload, out_dir=out, command="python3 -m kdlib.perf.run --suite "
                                                                    "k2_rank")

    torch.cuda.synchronize()
    a0 = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = RankModel(shape, device="cuda", seed=0)
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    w_meas = torch.cuda.memory_allocated() - a0
    kv200 = torch.zeros(cfg.num_hidden_layers, 200_000, cfg.latent_dim, dtype=torch.bfloat16, device="cuda")
    kv_meas = torch.cuda.memory_allocated() - a0 - w_meas
    free, total = torch.cuda.mem_get_info()
    w_pred = memory.weight_bytes(cfg_dict, tp=8)["per_gpu"]
    kv_pred = memory.kv_bytes(cfg_dict, 200_000, tp=8)
    payload["memory"] = {
        "weights_allocated": w_meas,
        "weights_predicted": w_pred,
        "kv_200k_allocated": kv_meas,
        "kv_200k_predicted": kv_pred,
        "allocated": w_meas + kv_meas,
        "predicted": w_pred + kv_pred,
        "ratio": (w_meas + kv_meas) / (w_pred + kv_pred),
        "within_2pct": abs((w_meas + kv_meas) / (w_pred + kv_pred) - 1) <= 0.02,
        "weights_tensor_bytes": model.weight_bytes(),
        "device_used_bytes": total - free,
        "device_total_bytes": total,
    }
    del kv200
    torch.cuda.empty_cache()
    drafter = RankDrafter(model, DFLASH_KIMI)
    pool_tokens = memory.plan(cfg_dict, "h200", tp=8, context=200_000).value("pool_tokens")
    rows, cut = grid(pool_tokens, quick, contexts)
    slots = max(c * (ctx + (b or 0) + 1) for ctx, c, b in rows)
    pool = torch.zeros(cfg.num_hidden_layers, slots, cfg.latent_dim, dtype=torch.bfloat16, device="cuda")
    drafter.make_pool(slots)
    payload["setup"] = {
        "weight_generation_s": gen_s,
        "drafter": {**DFLASH_KIMI.__dict__, "weight_bytes_rank": drafter.weight_bytes()},
        "pool_slots": slots,
        "pool_tokens_predicted": pool_tokens,
    }
    payload["cut"] = cut if contexts is None else grid(pool_tokens, quick)[1]  # beyond the pool: all contexts
    payload["rows"] = list(kept)
    done = {(r["context"], r["streams"], r["budget"], r.get("compiled", False)) for r in kept}
    # (row, compiled): the plain baseline rows first, then the grid compiled (or plain when compile_ is off)
    todo = [(r, False) for r in PLAIN_ROWS if compile_ and r in rows] + [(r, compile_) for r in rows]
    todo = [(r, c) for r, c in todo if (*r, c) not in done]
    save()
    start = time.perf_counter()
    for i, ((ctx, c, b), comp) in enumerate(todo):
        if time.perf_counter() - start > budget_s:
            payload["cut"] += [{"context": x, "streams": y, "budget": z, "compiled": cc, "why": "time budget"}
                               for (x, y, z), cc in todo[i:]]
            break
        if comp and not model.compiled:
            t_c = time.perf_counter()
            model.compile_pieces()
            payload["setup"]["compile_started_s"] = t_c - start
        row = measure_row(model, drafter, pool, ctx, c, b, ceil, fit, iters=10, routing=routing)
        if not row["graphs"]:  # a part's capture failed (seen once on the first row of a run): once more
            row = {**measure_row(model, drafter, pool, ctx, c, b, ceil, fit, iters=10, routing=routing),
                   "first_attempt_graph_errors": row["graph_errors"]}
        payload["rows"].append(row)
        prof = row["profile"] or {}
        print(f"[k2_rank] ctx {ctx:>6} C {c:>2} {row['method']:>6} b {b or 0:>2}"
              f"{' compiled' if comp else '':>9}: "
              f"step {row['step_ms']:8.2f} ms (+ar {row['allreduce_modelled_ms']:.2f}) parts sum "
              f"{row['components_sum_ms']:8.2f} floors {row['floor_sum_ms']:7.2f} "
              f"tau {row['accepted_mean']:.2f} "
              f"kernels {prof.get('kernels_per_step', 0):.0f} busy {prof.get('busy', 0):.2f} "
              f"({row['wall_s']:.1f} s)", flush=True)
        save()
    if compile_ and not model.compiled:  # every grid row resumed: the engine runs the grid's compiled pieces
        model.compile_pieces()
    kept_engine = json.loads(Path(resume).read_text()).get("engine", []) if kept else []
    payload["engine"] = list(kept_engine)
    done_e = {(r["context"], r["streams"], r["budget"]) for r in kept_engine}
    for ctx, c, b in ENGINE_ROWS:
        if (ctx, c, b) in done_e or (ctx, c, b) not in rows:
            continue
        if time.perf_counter() - start > budget_s:
            payload["cut"].append({"context": ctx, "streams": c, "budget": b, "engine": True,
                                   "why": "time budget"})
            continue
        e = measure_engine(model, drafter, ctx, c, b)
        same = [r for r in payload["rows"] if (r["context"], r["streams"], r["budget"]) == (ctx, c, b)
                and r.get("compiled", False) == model.compiled]
        e["rank_step_ms"] = same[-1]["step_ms"] if same else None
        payload["engine"].append(e)
        print(f"[k2_rank] engine ctx {ctx:>6} C {c:>2} {e['method']:>6} b {b or 0:>2}: replay "
              f"{e['replay_ms'] or 0:8.2f} ms, host step {e['step_ms']:8.2f} ms, RankStep "
              f"{e['rank_step_ms'] or 0:8.2f} ms, tau {e['accepted_mean']:.2f}", flush=True)
        save()
    return payload


def table(doc: dict) -> str:
    """The short table tools/k2_rank_gpu.sh prints at the end."""
    m = doc.get("memory", {})
    lines = [f"memory: allocated {m.get('allocated', 0) / 1e9:.2f} GB vs predicted "
             f"{m.get('predicted', 0) / 1e9:.2f} GB "
             f"(ratio {m.get('ratio', 0):.4f}, within 2%: {m.get('within_2pct')})",
             f"{'ctx':>7} {'C':>3} {'method':>7} {'step ms':>9} {'+AR ms':>8} {'moe':>7} {'attn':>7} "
             f"{'dense':>7} "
             f"{'draft':>6} {'floor':>7} {'tau':>5} {'tok/s':>7}"]
    for r in doc.get("rows", []):
        cm = r["components_ms"]
        lines.append(f"{r['context']:>7} {r['streams']:>3} {r['method'][:2] + str(r['budget'] or ''):>7} "
                     f"{r['step_ms']:9.2f} {r['allreduce_modelled_ms']:8.2f} {cm['moe']:7.2f} "
                     f"{cm['attention']:7.2f} "
                     f"{cm['dense']:7.2f} {cm.get('draft', 0):6.2f} {r['floor_sum_ms']:7.2f} "
                     f"{r['accepted_mean']:5.2f} {r['tok_s']:7.0f}")
    lines.append(f"cut: {len(doc.get('cut', []))} rows")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(table(json.loads(open(sys.argv[1]).read())))
