"""The FP8 latent cache in the tree verify (issue 19's stretch goal): version 10 over an FP8 pool, by both of
its paths, beside its bf16 build.

`python3 -m kdlib.perf.run --suite attention_fp8 [--quick]`. Per point of `POINTS` (attention_bounds' points:
the attention suite's memory-bound points, queries 1 and 9, then 8 x 33 x 200k, its two goal points and its
ragged batch; its inputs, `attention.point_inputs`, and the same page tables for every pool):

  * `bf16`: the whole verify of version 10 over the bf16 pool, replayed from CUDA graphs over the point's
    rotated tables (as the attention suite times its arms);
  * `fp8`: the same verify over the pool in the FP8 layout (`kdlib.cuda.attention.fp8_pool`: the bf16 rows
    with power-of-two scales, 656 bytes a row where bf16's take 1,152) by the FP8 build (fp8_path "fused"),
    replayed alike;
  * `fp8_dequant_first`: the same by the other path, the gather into the workspace's bf16 pool, then the bf16
    build (fp8_path "dequant_first"), replayed alike; `gather`: that gather alone, replayed alike, its bytes
    (each prefix row's 656 read and 1,152 written, and its slot) over the copy bandwidth;
  * `bitwise_equal_dequantized`: the FP8 build's output and lse against version 10's bf16 build over the
    dequantized pool (`fp8_dequantized`, what the producer stages): equal bit for bit, or the build is wrong;
    `bitwise_equal_paths`: the dequant-first path's against the FP8 build's, alike;
  * `fp8_path_default`: the path fp8_path=None takes there (`fp8_path_for`) and `speedup_fp8_default` its
    speed against bf16;
  * `error`: the FP8 output against the bf16 pool's, norm-relative over the rows inside the trees, and the
    lse's largest absolute difference: what the layout costs the verify on these inputs (random rows);
  * floors: each pool's bytes (`attention` suite's cost; the FP8 pool's prefix rows at 656 bytes) over the
    recorded copy bandwidth (`results.ceilings`, as the attention suite's goals), the flop floor alike; the
    fraction of copy is the memory floor over the median.
The timed arms alternate (bf16, fp8, fp8_dequant_first, gather, bf16, ...: ROUNDS rounds of `iters` replays
each) so that a clock step under load falls on all; each arm's time is the median of its rounds' medians.
"""

from __future__ import annotations

import statistics

from kdlib import perf
from kdlib.perf import results, timing
from kdlib.perf.suites import _attention as base
from kdlib.perf.suites import attention, attention_bounds
from kdlib.ref import fp8

# the memory-bound points, 8 x 33 x 200k (between them and the goal points in rows a request), the goal
# points, the ragged batch (C = 16, prefixes 1k-64k, trees 9-65)
POINTS = [*attention_bounds.POINTS[:3], {"heads": 8, "queries": 33, "prefix": 200_000, "batch": 1},
          *attention_bounds.POINTS[3:], attention.ragged_point()]
QUICK_POINTS = POINTS[:2]
ROUNDS = 3
ARMS = {"bf16": None, "fp8": "fused", "fp8_dequant_first": "dequant_first"}  # arm: its fp8_path


def fp8_bytes(cost: dict, lens: list[int]) -> float:
    """A point's bytes with its prefix rows in the FP8 layout: the bf16 cost less 1,152 - 656 a prefix row."""
    return cost["bytes"] - sum(lens) * (attention.D_QK * 2 - fp8.layout_bytes())


def gather_bytes(lens: list[int]) -> int:
    """The dequant-first gather's bytes: each prefix row's FP8 row read, its bf16 row written and its slot."""
    return sum(lens) * (fp8.layout_bytes() + attention.D_QK * 2 + 4)


def default_arm(row: dict) -> str:
    """The arm of the path fp8_path=None takes at a point's row (its fp8_path_default)."""
    return next(a for a, path in ARMS.items() if path == row["fp8_path_default"])


def run_point(p: dict, pool, pool8, deq, ceil: dict, *, iters: int) -> dict:
    """Every arm (ARMS), the gather alone, the bit-for-bit checks and the error at one point (pool: bf16
    [N, 576], pool8 its FP8 layout [N, 656] uint8, deq the FP8 rows in bf16 [N, 576])."""
    import cupy

    from kdlib.cuda import attention as cu

    x = attention.point_inputs(p, pool)
    lens, trees = x["lens"], x["trees"]
    width = int(x["tables"][0].shape[1])
    nbytes = {arm: x["cost"]["bytes"] if path is None else fp8_bytes(x["cost"], lens)
              for arm, path in ARMS.items()}
    calls, timers, outs = {}, {}, {}
    for arm, path in ARMS.items():
        ws = cu.make_workspace(p["batch"], p["queries"], p["heads"], fp8_width=width if path else None)
        calls[arm] = attention.verify_call(x, pool if path is None else pool8, ws, version=10, fp8_path=path)
        outs[arm] = [a.copy() for a in calls[arm](x["tables"][0], validate=True)]
        timers[arm] = base.graph_timer([lambda pt=pt, c=calls[arm]: c(pt) for pt in x["tables"]])
    gws = cu.make_workspace(p["batch"], p["queries"], p["heads"], fp8_width=width)
    cu.dequant_prefix(pool8, x["tables"][0], x["lens_t"], gws)  # checked once
    timers["gather"] = base.graph_timer(
        [lambda pt=pt: cu.dequant_prefix(pool8, pt, x["lens_t"], gws, validate=False) for pt in x["tables"]])
    rounds = {arm: [] for arm in timers}
    for _ in range(ROUNDS):
        for arm, timer in timers.items():
            rounds[arm].append(timer(iters=iters, warmup=3).median_ms)
    deq_out, deq_lse = attention.verify_call(x, deq, None, version=10)(x["tables"][0], validate=True)
    out8, lse8 = outs["fp8"]
    out16, lse16 = outs["bf16"]
    keep = ~cupy.isnan(out16)
    row = {**p, "lens": lens if x["ragged"] else None, "rotations": len(x["tables"]),
           "flops": x["cost"]["flops"], "arms": {},
           "bitwise_equal_dequantized": bool(cupy.array_equal(out8, deq_out, equal_nan=True)
                                             and cupy.array_equal(lse8, deq_lse, equal_nan=True)),
           "bitwise_equal_paths": all(bool(cupy.array_equal(a, b, equal_nan=True))
                                      for a, b in zip(outs["fp8"], outs["fp8_dequant_first"], strict=True)),
           "error": {"out_norm_rel": float(cupy.linalg.norm((out8 - out16)[keep])
                                           / cupy.linalg.norm(out16[keep])),
                     "lse_max_abs": float(cupy.nanmax(cupy.abs(lse8 - lse16)))},
           "nan_rows_match": bool(cupy.array_equal(cupy.isnan(out8), cupy.isnan(out16)))}
    for arm in ARMS:
        fl = perf.floor_ms(nbytes[arm], x["cost"]["flops"], bandwidth_Bps=ceil["bandwidth_Bps"],
                           flop_rate=ceil["flop_rate"])
        ms = statistics.median(rounds[arm])
        row["arms"][arm] = {"ms": ms, "rounds_ms": rounds[arm], "bytes": nbytes[arm], **fl,
                            "fraction_of_copy": fl["mem_ms"] / ms, "fraction_of_floor": fl["floor_ms"] / ms}
    gms, gb = statistics.median(rounds["gather"]), gather_bytes(lens)
    row["gather"] = {"ms": gms, "rounds_ms": rounds["gather"], "bytes": gb,
                     "fraction_of_copy": gb / ceil["bandwidth_Bps"] * 1e3 / gms}
    row["speedup_fp8"] = row["arms"]["bf16"]["ms"] / row["arms"]["fp8"]["ms"]
    row["speedup_fp8_dequant_first"] = row["arms"]["bf16"]["ms"] / row["arms"]["fp8_dequant_first"]["ms"]
    row["fp8_path_default"] = cu.fp8_path_for(p["heads"] * p["queries"])
    row["speedup_fp8_default"] = row["arms"]["bf16"]["ms"] / row["arms"][default_arm(row)]["ms"]
    row["trees"] = trees
    return row


def run(*, quick: bool = False) -> dict:
    """The suite (module docstring). quick: QUICK_POINTS, 10 replays a round (else POINTS, 20)."""
    import torch

    from kdlib.cuda import attention as cu

    if not cu.wgmma_available():
        raise RuntimeError("the attention_fp8 suite needs an sm_90 device (version 10)")
    pts = QUICK_POINTS if quick else POINTS
    iters = 10 if quick else 20
    ceil = results.ceilings().as_dict()
    pool = torch.randn(attention.pool_rows(pts), attention.D_QK, device="cuda", dtype=torch.bfloat16)
    pool8 = cu.fp8_pool(pool)  # [N, 656] uint8
    deq = cu.fp8_dequantized(pool8)  # [N, 576] bf16
    clocks_before = timing.clocks()
    rows = []
    for p in pts:
        rows.append(run_point(p, pool, pool8, deq, ceil, iters=iters))
        r = rows[-1]
        print(f"[attention_fp8] H{r['heads']} Q{r['queries']} S{r.get('prefix', 'ragged')} B{r['batch']} | "
              + "  ".join(f"{k} {a['ms']:.4f} ms ({a['fraction_of_copy']:.2f} of copy)"
                          for k, a in r["arms"].items())
              + f" | gather {r['gather']['ms']:.4f} ms ({r['gather']['fraction_of_copy']:.2f} of copy)"
              + f" | x{r['speedup_fp8']:.2f} fused, x{r['speedup_fp8_dequant_first']:.2f} dequant first"
              + f" | bitwise {r['bitwise_equal_dequantized']} {r['bitwise_equal_paths']} | "
              f"err {r['error']['out_norm_rel']:.2e}", flush=True)
    memory = [r for r in rows if r["queries"] <= 9]
    return {
        "parameters": {"quick": quick, "points": pts, "iters": iters, "rounds": ROUNDS, "version": 10,
                       "options": list(cu.FP8_OPTIONS), "pool_rows": int(pool.shape[0]), "page_size": 1,
                       "arms": ARMS, "fp8_dequant_first_rows": cu.FP8_DEQUANT_FIRST_ROWS,
                       "scale_rule": "pow2",
                       "row_bytes": {"bf16": attention.D_QK * 2, "fp8": fp8.layout_bytes()}},
        "ceilings": ceil,
        "clocks_before": clocks_before,
        "clocks_after": timing.clocks(),
        "points": rows,
        "goals": {f"H{r['heads']}xQ{r['queries']}xS{r['prefix']}xB{r['batch']}": {
            "fraction_of_copy_bandwidth": r["arms"][arm]["fraction_of_copy"], "arm": arm,
            "goal": attention.GOAL_MEMORY_FRACTION,
            "met": r["arms"][arm]["fraction_of_copy"] >= attention.GOAL_MEMORY_FRACTION}
            for r in memory for arm in [default_arm(r)]},
        "notes": [
            "arms: version 10's whole verify (prefix + tail + merge) from CUDA graphs over the rotated "
            "tables; fp8: the same build with -DTV_FP8=1 over the FP8 pool of the same rows; "
            "fp8_dequant_first: the gather into a bf16 pool, then the bf16 build, over the FP8 pool",
            "bytes: the attention suite's cost; the FP8 arms count 656 bytes a prefix row; fraction_of_copy: "
            "those bytes over the recorded copy bandwidth, over the median; the goals judge the path "
            "fp8_path=None takes",
            "error: the FP8 output against the bf16 pool's (random N(0, 1) rows: one scale per 128 dims)",
        ],
    }
