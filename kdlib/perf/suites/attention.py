"""Attention suite (issue 19): the whole tree verify at the issue's shapes, every arm on the same inputs.

`python3 -m kdlib.perf.run --suite attention [--quick]` (or tools/attention_gpu.sh), or
`run(quick=..., impls=..., time_budget_s=...)`; env KDLIB_ATTENTION_IMPLS (a comma list of kernel
variants) and KDLIB_ATTENTION_BUDGET_S (after which no new point starts; the points run in priority
order) are those parameters' defaults. Per point
(heads H, tree queries Q, prefix S, batch B; bf16, page_size 1, scattered slots, random trees):

  * `wgmma` (tree_verify_v5), `wgmma_v6` (tree_verify_v6), `wgmma_v7` (tree_verify_v7), `wgmma_v8`
    (v7's attend kernel, its own combine) and the previous bf16 default (`MMA_DEFAULT`): the whole verify
    (prefix + tail + merge) captured in a CUDA graph and replayed, median of CUDA-event timings after
    warm-up; the wgmma versions run on a preallocated workspace (nothing allocated in the graph);
  * the PyTorch baselines of `_attention.torch_baselines` (uniform points only);
  * FlashInfer's `BatchMLAPagedAttentionWrapper` (page_size 1, causal=False) over the prefix alone,
    when `flashinfer` imports (tools/attention_gpu.sh carries its wheels): one planned wrapper per
    rotated page table, eager runs over the tables in turn, median of CUDA events (its runs over one
    table beside them, as the records before 2026-12-03 timed it), and the same runs captured into CUDA
    graphs and replayed in turn (`graph`; env KDLIB_ATTENTION_FI_GRAPH=off leaves them out); it has no tree
    mask, so its time is a lower bound of a verify built on it;
  * at the GOAL_MS points, a duel: DUEL_ROUNDS interleaved rounds of the headline's whole verify, its
    plan reused, the other impls' whole verify (arms named by impl: an A/B round by round) and FlashInfer,
    eager and graph-replayed (`duel`), after every point's arms; the goal
    "faster than FlashInfer" asks for every round, against FlashInfer's faster arm of that round;
  * floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate) of `_attention.cost` (FLOPs: the
    prefix, 2 H Q S (576 + 512)); the ragged point counts each request's own prefix and tree rows.
The ragged point is C = 16 requests with prefixes spread from 1k to 64k and trees of 9 to 65 rows.
"""

from __future__ import annotations

import functools
import itertools
import os
import statistics
import time
from collections.abc import Sequence

from kdlib import perf
from kdlib.perf import results, timing
from kdlib.perf.suites import _attention as base
from kdlib.perf.suites import env_flag

D_QK, D_V = base.D_QK, base.D_V
# Priority order: the three rows first, then the rest of its grid.
POINTS = [
    {"heads": 8, "queries": 65, "prefix": 200_000, "batch": 1},
    {"heads": 64, "queries": 65, "prefix": 32_768, "batch": 1},
    {"heads": 8, "queries": 9, "prefix": 200_000, "batch": 1},
    {"heads": 8, "queries": 1, "prefix": 200_000, "batch": 1},
    {"heads": 8, "queries": 9, "prefix": 32_768, "batch": 8},
    {"heads": 8, "queries": 33, "prefix": 200_000, "batch": 1},
    {"heads": 16, "queries": 65, "prefix": 131_072, "batch": 1},
    {"heads": 8, "queries": 65, "prefix": 32_768, "batch": 8},
]
QUICK_POINTS = POINTS[:3]
RAGGED = {"heads": 8, "queries": 65, "batch": 16, "prefix_range": (1024, 65_536), "tree_range": (9, 65)}
GOAL_MS = {(8, 65, 200_000, 1): 0.45, (64, 65, 32_768, 1): 0.50}  # issue 19: whole verify at most
GOAL_RAGGED_FRACTION = 0.60
GOAL_MEMORY_FRACTION = 0.70  # queries 1..9: of copy bandwidth
DUEL_ROUNDS = 7  # interleaved rounds at the GOAL_MS points: faster in all 7 has a 1 in 128 chance at a tie


def ragged_shape(batch: int = RAGGED["batch"]) -> tuple[list[int], list[int]]:
    """(prefix lens, tree sizes) of the ragged point: evenly spread, trees in an interleaved order."""
    lo, hi = RAGGED["prefix_range"]
    tlo, thi = RAGGED["tree_range"]
    lens = [round(lo + (hi - lo) * i / (batch - 1)) for i in range(batch)]
    trees = [tlo + ((7 * i) % batch) * (thi - tlo) // (batch - 1) for i in range(batch)]
    return lens, trees


def ragged_point() -> dict:
    """The ragged point as `run_point` takes it: heads, queries, batch, lens and trees (`ragged_shape`)."""
    lens, trees = ragged_shape()
    return {"heads": RAGGED["heads"], "queries": RAGGED["queries"], "batch": RAGGED["batch"], "lens": lens,
            "trees": trees}


def point_requests(p: dict) -> tuple[list[int], list[int]]:
    """(prefix lens, tree sizes) of a point's requests: its lens and trees (ragged), else its prefix and
    queries for each of its batch."""
    if "lens" in p:
        return list(p["lens"]), list(p["trees"])
    return [p["prefix"]] * p["batch"], [p["queries"]] * p["batch"]


def pool_rows(pts: list[dict]) -> int:
    """KV rows of a pool that holds any one of `pts` (`point_inputs` gives each request its own rows)."""
    return max(sum(point_requests(p)[0]) for p in pts)


def ragged_cost(nh: int, lens: list[int], trees: list[int]) -> dict:
    """Bytes and FLOPs of a ragged verify: each request's prefix, tree rows, queries and outputs once."""
    nbytes = sum(s * (D_QK * 2 + 4) + t * D_QK * 2 + t * t + t * nh * D_QK * 2 + t * nh * (D_V * 4 + 4)
                 for s, t in zip(lens, trees, strict=True))
    flops = 2.0 * nh * sum(s * t for s, t in zip(lens, trees, strict=True)) * (D_QK + D_V)
    return {"bytes": nbytes, "flops": flops}


def _flashinfer():
    """The flashinfer module, or the reason it is not there."""
    try:
        import flashinfer
        from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401
    except Exception as e:  # noqa: BLE001 - absent or broken: recorded, the suite goes on
        return None, f"flashinfer not importable: {type(e).__name__}: {str(e)[:200]}"
    return flashinfer, None


def _flashinfer_prefix(fi, q, ckv, kpe, tables, lens, scale, iters, *, graph: bool = True):
    """FlashInfer MLA over the prefix alone, one planned wrapper per page table of the point's L2 rotation.
    -> (record, out [B, Q, H, 512] bf16 over tables[0], timers): timers["flashinfer"](iters=, warmup=None)
    times eager runs that take the rotated tables in turn (each run reads rows that the previous runs did
    not leave in L2, as the suite's graph replays of its own arms do); with `graph`, timers
    ["flashinfer_graph"] replays those runs captured into CUDA graphs, in the same turn. The record: the
    eager timing (mode "eager", rotated_tables), `graph` (that timing, or why there is none), and
    `one_table`, the eager runs over tables[0] alone that the records before 2026-12-03 hold (FlashInfer's
    rows then stayed in L2 where they fit). Graph capture faulted inside the suite's process until
    `timing.graph_timer` held its launches (data/results/gpu_tests.h200.json, the calls of 2026-12-03)."""
    import torch

    bsz, nq, nh, _ = q.shape
    dev = q.device
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)  # [B]
    kv_indptr = torch.zeros(bsz + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(lens_t, 0)
    qo_indptr = torch.arange(0, (bsz + 1) * nq, nq, dtype=torch.int32, device=dev)  # [B + 1]
    flat = q.reshape(bsz * nq, nh, D_QK)
    q_nope, q_pe = flat[..., :D_V].contiguous(), flat[..., D_V:].contiguous()  # [B*Q, H, 512], [B*Q, H, 64]
    t0 = time.monotonic()
    runs = []
    for pt in tables:
        kv_indices = torch.cat([pt[b, :n] for b, n in enumerate(lens)]).to(torch.int32)  # [sum S]
        workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # [256 MB]
        wrapper = fi.mla.BatchMLAPagedAttentionWrapper(workspace)
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, lens_t, nh, D_V, D_QK - D_V, 1, False, scale,
                     torch.bfloat16, torch.bfloat16)
        runs.append(functools.partial(wrapper.run, q_nope, q_pe, ckv, kpe))
    first = runs[0]()
    torch.cuda.synchronize()
    plan_s = time.monotonic() - t0  # the first call JIT-compiles the kernel
    turn = itertools.count()

    def rotated():
        return runs[next(turn) % len(runs)]()

    def timer(*, iters: int, warmup: int | None = None):
        return perf.cuda_time(rotated, warmup=max(3, len(runs)) if warmup is None else warmup, iters=iters,
                              backend="torch")

    rec = {**timer(iters=iters).as_dict(), "mode": "eager", "rotated_tables": len(runs),
           "one_table": perf.cuda_time(runs[0], warmup=3, iters=iters, backend="torch").as_dict(),
           "first_call_s": plan_s}
    timers = {"flashinfer": timer}
    if not graph:
        rec["graph"] = {"skipped": "KDLIB_ATTENTION_FI_GRAPH=0"}
    else:
        try:
            timers["flashinfer_graph"] = timing.graph_timer(runs, backend="torch")
            rec["graph"] = {**timers["flashinfer_graph"](iters=iters, warmup=len(runs)).as_dict(),
                            "mode": "graph", "rotated_tables": len(runs)}
        except Exception as e:  # noqa: BLE001 - a capture failure is recorded, the eager arm stands
            rec["graph"] = {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
    return rec, first.reshape(bsz, nq, nh, D_V), timers


def flashinfer_best_ms(rec: dict) -> float | None:
    """FlashInfer's faster median of a point's record (`_flashinfer_prefix`): eager or graph-replayed
    (`results.flashinfer_best`)."""
    best = results.flashinfer_best(rec)
    return None if best is None else best[0]["median_ms"]


def duel(timers: dict, rounds: int, iters: int) -> dict:
    """Interleaved rounds of timed arms: in round r each arm's timer (time(iters=) -> Timing: graph replays
    from `timing.graph_timer`, or `_flashinfer_prefix`'s eager runs and graph replays) takes `iters` calls,
    the arms in turn starting from the r-th (no arm always first). -> {"arms", "rounds", "iters", "ms":
    {arm: [its median in each round]}}: the ratio of two arms in one round shares most of the GPU's state
    of that round (under the sustained load the clocks fall and the arms' times step up between rounds,
    not all in the same one: data/results/attention.h200.json, notebook 02b section 13n)."""
    names = list(timers)
    ms = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            ms[k].append(timers[k](iters=iters).median_ms)
    return {"arms": names, "rounds": rounds, "iters": iters, "ms": ms}


def point_inputs(p: dict, pool) -> dict:
    """The inputs of one point, seeded by its shape. p: heads, queries, batch and either prefix (uniform) or
    lens + trees; pool [N, 576] bf16 KV rows. -> q [B, Q, H, 576], tkv [B, Q, 576], vis [B, Q, Q], lens_t and
    sizes_t [B] int32, tables (one [B, max lens] int32 page table per L2 rotation: request b's rows scattered
    over its own slot range), lens, trees, ragged, scale, cost (bytes and FLOPs)."""
    import torch

    h, nq, bsz = p["heads"], p["queries"], p["batch"]
    ragged = "lens" in p
    lens, trees = point_requests(p)
    width = max(lens)
    dev = pool.device
    gen = torch.Generator().manual_seed(h * 1_000_003 + nq * 10_007 + width + bsz)
    total = sum(lens)
    n_rot = timing.l2_rotations(total * D_QK * 2, fit=pool.shape[0] // total)
    starts = [sum(lens[:b]) for b in range(bsz)]
    tables = []  # [B, width] int32 each: request b's rows scattered over its own slot range, per rotation
    for r in range(n_rot):
        pt = torch.zeros(bsz, width, dtype=torch.int32, device=dev)
        for b, n in enumerate(lens):
            pt[b, :n] = torch.randperm(n, generator=gen).to(dev, torch.int32) + r * total + starts[b]
        tables.append(pt)
    return {
        "q": torch.randn(bsz, nq, h, D_QK, generator=gen).to(dev, torch.bfloat16),  # [B, Q, H, 576]
        "tkv": torch.randn(bsz, nq, D_QK, generator=gen).to(dev, torch.bfloat16),  # [B, Q, 576]
        "vis": base.random_tree_visibility(torch, bsz, nq, gen).to(dev),  # [B, Q, Q]
        "lens_t": torch.tensor(lens, dtype=torch.int32, device=dev),
        "sizes_t": torch.tensor(trees, dtype=torch.int32, device=dev),
        "tables": tables, "lens": lens, "trees": trees, "ragged": ragged, "scale": D_QK**-0.5,
        "cost": ragged_cost(h, lens, trees) if ragged else base.cost(h, nq, width, bsz),
    }


def verify_call(x: dict, pool, ws, **pick):
    """The whole verify of point inputs x (`point_inputs`) over pool on workspace ws (None: none), as a
    function of the page table: call(pt, validate=False) -> (out, lse). pick: `version=` or `impl=` of
    `kdlib.cuda.attention.tree_verify_attention` (neither: its default), and `plan_ready=` (ws's plan
    reused)."""
    from kdlib.cuda import attention as cu

    def call(pt, validate: bool = False):
        return cu.tree_verify_attention(x["q"], pool, pt, x["lens_t"], x["tkv"], x["vis"], x["sizes_t"],
                                        x["scale"], validate=validate, workspace=ws, **pick)

    return call


def time_arm(arm: str, pts: list[dict], inputs: list[dict], pool, times: list[dict], outs: list[dict],
             iters: int, layers: int = 1, **pick) -> None:
    """One arm of an A/B over points (tools/kernel_ab.py, the attention_gate suite): at each point p with
    inputs x, the whole verify (`verify_call`, pick as there) on a fresh workspace, its first output kept in
    outs [i][arm] (once: the arm's first set) and the median of graph replays over x's tables appended to
    times [i][arm]. layers > 1: a step of that many verifies instead, as the engine's layers run them (the
    first with reuse_plan, the others plan_ready), its median over `layers` appended (the time a layer)."""
    from kdlib.cuda import attention as cu

    for p, x, t, o in zip(pts, inputs, times, outs, strict=True):
        ws = cu.make_workspace(p["batch"], p["queries"], p["heads"])
        call = verify_call(x, pool, ws, **pick)
        if layers > 1:
            first = verify_call(x, pool, ws, reuse_plan=True, **pick)
            later = verify_call(x, pool, ws, plan_ready=True, **pick)

            def call(pt, first=first, later=later):  # one step: the plan made once, reused by the others
                first(pt)
                for _ in range(layers - 2):
                    later(pt)
                return later(pt)

        o.setdefault(arm, call(x["tables"][0])[0].copy())
        replays = [lambda pt=pt, call=call: call(pt) for pt in x["tables"]]
        t[arm].append(base.graph_time(replays, iters).median_ms / layers)


def run_point(p: dict, pool, kv_split, ceil: dict, impls, *, iters: int, baseline_iters: int, fi,
              duels: list | None = None) -> dict:
    """Every arm at one point. p: heads, queries, batch and either prefix (uniform) or lens + trees. At a
    GOAL_MS point with FlashInfer, (row, timers) for `duel` is appended to `duels` (when given): the caller
    runs the duel after every point's arms."""
    import cupy
    import torch

    from kdlib.cuda import attention as cu

    h, nq, bsz = p["heads"], p["queries"], p["batch"]
    x = point_inputs(p, pool)
    q, tkv, vis, lens_t, tables = x["q"], x["tkv"], x["vis"], x["lens_t"], x["tables"]
    lens, trees, ragged, scale, c = x["lens"], x["trees"], x["ragged"], x["scale"], x["cost"]
    width, n_rot = max(lens), len(tables)
    fl = perf.floor_ms(c["bytes"], c["flops"], bandwidth_Bps=ceil["bandwidth_Bps"],
                       flop_rate=ceil["flop_rate"])
    row = {"heads": h, "queries": nq, "batch": bsz, "prefix": None if ragged else width, "ragged": ragged,
           "lens": lens if ragged else None, "trees": trees if ragged else None, **c, **fl,
           "rotations": n_rot, "l2_resident": timing.l2_resident(sum(lens) * D_QK * 2, n_rot), "variants": {}}
    outs, timers = {}, {}  # timers: the whole verify of each impl (the headline's "verify") and plan reused
    for impl in impls:
        ws = cu.make_workspace(bsz, nq, h) if cu.IMPLS[impl] in cu.WGMMA_VERSIONS else None

        call = verify_call(x, pool, ws, impl=impl)
        call(tables[0], validate=True)
        timer = base.graph_timer([lambda pt=pt, call=call: call(pt) for pt in tables])
        t = timer(iters=iters, warmup=3)
        timers["verify" if impl == impls[0] else impl] = timer
        row["variants"][impl] = {"kernel": t.as_dict(), "fraction_of_floor": fl["floor_ms"] / t.median_ms,
                                 "achieved_TBps": c["bytes"] / (t.median_ms * 1e-3) / 1e12,
                                 "achieved_TFLOPs": c["flops"] / (t.median_ms * 1e-3) / 1e12}
        outs[impl] = call(tables[0])[0].copy()
        if impl == impls[0] and ws is not None:  # its plan reused, as a step's layers after the first run it
            reuse = verify_call(x, pool, ws, impl=impl, plan_ready=True)
            timers["plan_reused"] = base.graph_timer([lambda pt=pt, reuse=reuse: reuse(pt) for pt in tables])
            t = timers["plan_reused"](iters=iters, warmup=3)
            same = bool(cupy.array_equal(reuse(tables[0])[0], outs[impl], equal_nan=True))
            row["variants"][impl]["plan_reused"] = {"kernel": t.as_dict(), "bitwise_equal": same}
    if len(outs) > 1:  # the arms agree (bf16 operands: ~1e-3)
        first = next(iter(outs.values()))
        keep = ~cupy.isnan(first)
        row["rel_diff_between_variants"] = {
            k: float(cupy.linalg.norm((o - first)[keep]) / cupy.linalg.norm(first[keep]))
            for k, o in outs.items()}
    if ragged:
        row["baselines"] = {"matmul": {"skipped": "ragged batch"}, "sdpa": {"skipped": "ragged batch"}}
    else:
        row["baselines"] = base.torch_baselines(q, pool, tables[0], tkv, vis, scale, outs, fl, baseline_iters)
    if fi is None:
        row["flashinfer"] = {"skipped": "flashinfer not importable"}
    else:
        try:
            rec, fo, fi_timers = _flashinfer_prefix(fi, q, *kv_split, tables, lens, scale, iters,
                                                    graph=env_flag("KDLIB_ATTENTION_FI_GRAPH", True))
            ours = cu.prefix_attention(q, pool, tables[0], lens_t, scale, impl=impls[0], validate=False)[0]
            ours_t = torch.from_dlpack(ours)
            diff = float(torch.linalg.vector_norm(fo.float() - ours_t) / torch.linalg.vector_norm(ours_t))
            row["flashinfer"] = {**rec, "scope": "prefix only (no tree tail, no merge)",
                                 "rel_diff_vs_prefix_" + impls[0]: diff}
            if (h, nq, row["prefix"], bsz) in GOAL_MS and "verify" in timers and duels is not None:
                duels.append((row, {**timers, **fi_timers}))
        except Exception as e:  # noqa: BLE001 - a FlashInfer failure is recorded, the sweep goes on
            row["flashinfer"] = {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
    fi_ms = flashinfer_best_ms(row["flashinfer"])
    reused = [v["plan_reused"] for v in row["variants"].values() if "plan_reused" in v]
    for v in [*row["variants"].values(), *reused]:
        v["speedup_vs_flashinfer_prefix"] = fi_ms / v["kernel"]["median_ms"] if fi_ms else None
    torch.cuda.empty_cache()
    return row


def goals(points: list[dict], impl: str, headline: str) -> dict:
    """Issue 19's goals against the recorded points of `impl` (None where the point was not run).
    headline: the impl whose whole verify the duels timed (their "verify" arm, `parameters.impls[0]`): a duel
    judges `impl` against FlashInfer only where it is that one, else the two medians do."""
    out = {}
    for r in points:
        v = r["variants"].get(impl)
        if v is None:
            continue
        key = (r["heads"], r["queries"], r["prefix"], r["batch"])
        ms = v["kernel"]["median_ms"]
        fi_ms = flashinfer_best_ms(r.get("flashinfer", {}))
        if key in GOAL_MS:
            e = {"ms": ms, "goal_ms": GOAL_MS[key], "met": ms <= GOAL_MS[key], "flashinfer_prefix_ms": fi_ms,
                 "faster_than_flashinfer": fi_ms is not None and ms < fi_ms}
            if "duel" in r and impl == headline:  # faster in every interleaved round, not on two medians
                d = r["duel"]["ms"]
                fi_arms = [k for k in d if k.startswith("flashinfer")]
                best = [min(t) for t in zip(*(d[k] for k in fi_arms), strict=True)]  # its faster arm a round
                ratios = [a / b for a, b in zip(d["verify"], best, strict=True)]
                e.update(faster_than_flashinfer=max(ratios) < 1, judged_on="duel", flashinfer_arms=fi_arms,
                         rounds_faster=sum(x < 1 for x in ratios), rounds=len(ratios),
                         ratio_to_flashinfer={"min": min(ratios), "median": statistics.median(ratios),
                                              "max": max(ratios)})
            out[f"H{key[0]}xQ{key[1]}xS{key[2]}"] = e
        elif r["ragged"]:
            out["ragged"] = {"fraction_of_floor": v["fraction_of_floor"], "goal": GOAL_RAGGED_FRACTION,
                             "met": v["fraction_of_floor"] >= GOAL_RAGGED_FRACTION}
        elif r["queries"] <= 9 and r["bound"] == "memory":
            frac = r["mem_ms"] / ms  # bytes / time over the copy bandwidth
            out[f"H{key[0]}xQ{key[1]}xS{key[2]}xB{key[3]}"] = {
                "fraction_of_copy_bandwidth": frac, "goal": GOAL_MEMORY_FRACTION,
                "met": frac >= GOAL_MEMORY_FRACTION}
    return out


def run(*, quick: bool = False, impls: Sequence[str] | None = None,
        time_budget_s: float | None = None) -> dict:
    """The suite (see the module docstring).

    quick: QUICK_POINTS and the ragged point, 10 kernel / 3 baseline replays (else POINTS, 20 / 5).
    impls: kernel variants (`kdlib.cuda.attention.IMPLS` names), the first the headline; None: env
        `KDLIB_ATTENTION_IMPLS` (a comma list), else the wgmma versions (BF16_DEFAULT first) where the
        device runs them and MMA_DEFAULT.
    time_budget_s: past this many seconds no new point starts; None: env `KDLIB_ATTENTION_BUDGET_S`,
        else no limit.
    """
    import torch

    from kdlib.cuda import attention as cu

    ragged = ragged_point()
    pts = QUICK_POINTS + [ragged] if quick else POINTS[:3] + [ragged] + POINTS[3:]
    if impls is None:
        chosen = os.environ.get("KDLIB_ATTENTION_IMPLS")  # comma list; else the wgmma versions + MMA_DEFAULT
        wgmma = sorted((cu.LAUNCHES[v].impl for v in cu.WGMMA_VERSIONS), key=lambda i: i != cu.BF16_DEFAULT)
        wgmma = wgmma if cu.wgmma_available() else []  # the default first: the headline
        impls = [m.strip() for m in chosen.split(",")] if chosen else wgmma + [cu.MMA_DEFAULT]
    impls = list(impls)
    ceil = results.ceilings().as_dict()
    pool = torch.randn(pool_rows(pts), D_QK, device="cuda", dtype=torch.bfloat16)  # [N, 576] KV rows
    fi, fi_why = _flashinfer()
    fi_graph = env_flag("KDLIB_ATTENTION_FI_GRAPH", True)  # checked before measuring (run_point hides errors)
    kv_split = None
    if fi is not None:  # FlashInfer's page_size-1 caches: [N, 1, 512] latent and [N, 1, 64] rope
        kv_split = (pool[:, :D_V].contiguous().view(-1, 1, D_V),
                    pool[:, D_V:].contiguous().view(-1, 1, D_QK - D_V))
    iters, b_iters = (10, 3) if quick else (20, 5)
    budget = time_budget_s or os.environ.get("KDLIB_ATTENTION_BUDGET_S")
    budget = float(budget) if budget else None
    clocks_before = timing.clocks()
    t0 = time.monotonic()
    rows, left_out, duels = [], [], []
    for p in pts:
        if budget is not None and time.monotonic() - t0 > budget:
            left_out.append(p)
            continue
        rows.append(run_point(p, pool, kv_split, ceil, impls, iters=iters, baseline_iters=b_iters, fi=fi,
                              duels=duels))
        r = rows[-1]
        print(f"[attention] H{r['heads']} Q{r['queries']} S{r['prefix'] or 'ragged'} B{r['batch']} "
              f"floor {r['floor_ms']:.4f} | " + "  ".join(
                  f"{k} {v['kernel']['median_ms']:.4f} ({v['fraction_of_floor']:.2f})"
                  for k, v in r["variants"].items())
              + "".join(f" | {k} plan reused {v['plan_reused']['kernel']['median_ms']:.4f}"
                        for k, v in r["variants"].items() if "plan_reused" in v)
              + f" | flashinfer {r['flashinfer'].get('median_ms')}"
              + f" graph {r['flashinfer'].get('graph', {}).get('median_ms')}", flush=True)
    # The duels after every point's arms: run inside its point, a duel (its rounds back to back) slowed the
    # arm timed next, the next point's first (data/results/history/attention.duel_in_point.de0380a.h200.json).
    for row, timers in duels:
        row["duel"] = duel(timers, DUEL_ROUNDS, iters)
    return {
        "parameters": {"quick": quick, "impls": impls, "mma_default": cu.MMA_DEFAULT, "iters": iters,
                       "pdl": cu.PDL, "baseline_iters": b_iters, "points": pts, "dtype": "bfloat16",
                       "page_size": 1, "softmax_scale": "576**-0.5",
                       "tree": "random trees; uniform points: full trees (tree_sizes = Q)",
                       "flashinfer": getattr(fi, "__version__", None) if fi is not None else fi_why,
                       "flashinfer_graph": fi_graph},
        "ceilings": ceil,
        "clocks_before": clocks_before,
        "clocks_after": timing.clocks(),
        "points": rows,
        "left_out_for_time": left_out,
        "goals": goals(rows, impls[0], impls[0]),
        "wall_s": time.monotonic() - t0,
        "notes": [
            "variants: the whole verify (prefix + tail + merge) replayed from CUDA graphs; wgmma on a "
            "workspace",
            "flashinfer: BatchMLAPagedAttentionWrapper(page_size 1, causal=False) over the prefix alone, "
            "a wrapper per rotated table, eager runs over the tables in turn (graph: the same runs replayed "
            "from CUDA graphs); one_table: the first alone",
            f"duel: {DUEL_ROUNDS} interleaved rounds at the goal points; faster_than_flashinfer there means "
            "faster in every round than FlashInfer's faster arm (eager or graph) of that round; elsewhere "
            "flashinfer_prefix_ms and speedup_vs_flashinfer_prefix take its faster median",
            "FLOPs count the prefix only: 2 H Q S (576 + 512) (ragged: each request's own S and tree rows)",
            "pdl: version 10 launched its attend and combine kernels with programmatic dependent launch",
        ],
    }
