"""Verify-attention benchmark: `kdlib.cuda.attention.tree_verify_attention` against PyTorch baselines.

`sweep(*, quick=False, ...) -> dict`, also the suite's `run` (the `kernels` suite embeds it under
`verify_attention`; on its own: `python3 -m kdlib.perf.run --suite _attention`, or `main` below;
notebooks/02b calls `sweep`). Per point
(heads H, tree queries Q, prefix S, batch B), all bf16 inputs, page_size 1 with scattered slots:

  * kernel: the whole verify (split-KV prefix + masked tail + LSE combine, three launches) captured
    in a CUDA graph and replayed, median of CUDA-event timings; the KV rows are rotated among
    several page tables when one set would sit in the 60 MB L2;
  * baseline `matmul`: gather the paged prefix, concatenate the tree rows, bmm (cuBLAS) -> masked
    softmax in fp32 -> bmm, bf16 (also graph-captured);
  * baseline `sdpa`: `torch.nn.functional.scaled_dot_product_attention` with a bool mask and
    enable_gqa over the same gathered keys;
  * bytes = each input read once + outputs written once; FLOPs = 2 B H Q S (576 + 512) (the
    prefix; the tail adds < 0.1%); floor = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate).
Baselines are skipped (and the reason recorded) where their score matrices would pass
`_BASELINE_MAX_BYTES`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kdlib import perf
from kdlib.perf import results, timing

D_QK, D_V = 576, 512
_BASELINE_MAX_BYTES = 24e9  # scores bf16 + probabilities fp32 + bf16 copy: keep well inside 141 GB

FULL_GRID = {
    "primary": {"heads": [8], "queries": [1, 9, 17, 33, 65], "prefix": [1024, 8192, 32768, 131072, 200000],
                "batch": [1, 8, 64]},
    "heads": {"heads": [16, 64], "queries": [9, 65], "prefix": [1024, 8192, 32768, 131072, 200000],
              "batch": [1, 8]},
}
QUICK_GRID = {
    "primary": {"heads": [8], "queries": [9, 65], "prefix": [8192, 200000], "batch": [1]},
    "heads": {"heads": [64], "queries": [65], "prefix": [32768], "batch": [1]},
}


def points(quick: bool) -> list[dict]:
    """The (H, Q, S, B) grid: Kimi-K2.6 at TP8 (8 heads per GPU), plus 16 and 64 heads."""
    grid = QUICK_GRID if quick else FULL_GRID
    out = []
    for part in grid.values():
        for h in part["heads"]:
            for b in part["batch"]:
                for s in part["prefix"]:
                    for q in part["queries"]:
                        out.append({"heads": h, "queries": q, "prefix": s, "batch": b})
    return out


def cost(h: int, q: int, s: int, b: int) -> dict:
    """Bytes (each input once, outputs once) and FLOPs of one verify call."""
    per_req = (s * (D_QK * 2 + 4)  # KV rows (bf16) + page-table entries (int32)
               + q * D_QK * 2 + q * q  # tree rows + visibility
               + q * h * D_QK * 2  # queries
               + q * h * (D_V * 4 + 4))  # out fp32 + lse
    return {"bytes": b * per_req, "flops": 2.0 * b * h * q * s * (D_QK + D_V)}


def random_tree_visibility(torch, bsz: int, nq: int, gen):
    """[B, Q, Q] bool: ancestors-and-self of random trees (parent of node i drawn below i)."""
    vis = torch.zeros(bsz, nq, nq, dtype=torch.bool)
    parents = (torch.rand(bsz, nq, generator=gen) * torch.arange(nq)).long()
    for i in range(nq):
        vis[:, i, i] = True
        if i:
            vis[:, i] |= vis[torch.arange(bsz), parents[:, i]]
    return vis


def graph_time(launches, iters: int):
    """Device time of CUDA-graph replays of `launches` (CuPy launches on torch inputs, one callable per
    rotated input set), torch's current stream set to the capture stream (the DLPack hand-over of torch
    inputs needs no cross-stream event inside the capture)."""
    return graph_timer(launches)(iters=iters, warmup=3)


def graph_timer(launches):
    """`graph_time`'s graphs captured once: time(iters=, warmup=None) replays them (`timing.graph_timer`)."""
    return timing.graph_timer(launches, torch_stream=True)


def torch_baselines(q, pool, pt, tkv, vis, scale: float, outs: dict, fl: dict, iters: int, *,
                    enabled: bool = True) -> dict:
    """The PyTorch baselines of one point (full trees, every request of prefix pt.shape[1]):

    `matmul` (gather the paged prefix + tree rows, bmm -> masked fp32 softmax -> bmm, bf16) and
    `sdpa` (scaled_dot_product_attention with a bool mask, enable_gqa), each graph-replayed where
    capture works, with its relative difference from each kernel output in `outs` (impl -> CuPy
    out [B, Q, H, 512]); skipped (the reason recorded) past _BASELINE_MAX_BYTES of score matrices.
    q [B, Q, H, 576], pool [N, 576], pt [B, S] int32, tkv [B, Q, 576], vis [B, Q, Q] (torch CUDA).
    """
    import torch

    bsz, nq, h, _ = q.shape
    s = pt.shape[1]
    dev = q.device
    score_bytes = bsz * nq * h * (s + nq) * (2 + 4 + 2)
    if not enabled:
        return {"matmul": {"skipped": "baselines off"}, "sdpa": {"skipped": "baselines off"}}
    if score_bytes > _BASELINE_MAX_BYTES:
        why = f"score matrices {score_bytes / 1e9:.0f} GB > {_BASELINE_MAX_BYTES / 1e9:.0f} GB limit"
        return {"matmul": {"skipped": why}, "sdpa": {"skipped": why}}
    base = {}
    pt = pt.long()
    tail_mask = vis[:, :, None, :].expand(bsz, nq, h, nq).reshape(bsz, nq * h, nq)  # [B, Q*H, Q]
    sdpa_mask = torch.cat([torch.ones(bsz, 1, nq, s, dtype=torch.bool, device=dev), vis[:, None]], -1)

    def keys():
        return torch.cat([pool[pt], tkv], 1)  # [B, S+Q, 576] gather of the paged prefix + tree rows

    res = {}

    def matmul():
        k = keys()
        sc = torch.bmm(q.reshape(bsz, nq * h, D_QK), k.transpose(1, 2)) * scale  # [B, Q*H, S+Q] bf16
        sc[:, :, s:].masked_fill_(~tail_mask, float("-inf"))
        pr = torch.softmax(sc, -1, dtype=torch.float32).to(torch.bfloat16)
        res["matmul"] = torch.bmm(pr, k[:, :, :D_V])  # [B, Q*H, 512]

    def sdpa():
        k = keys()[:, None]  # [B, 1, S+Q, 576]
        res["sdpa"] = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k, k[..., :D_V], attn_mask=sdpa_mask, scale=scale, enable_gqa=True)

    first = next(iter(outs), None)
    for name, fn in (("matmul", matmul), ("sdpa", sdpa)):
        try:
            bt, mode, _ = timing.graph_or_eager(fn, iters=iters)
            ref_out = res[name].float().reshape(bsz, nq, h, D_V) if name == "matmul" else \
                res[name].float().transpose(1, 2)
            norm = torch.linalg.vector_norm(ref_out)
            diff = {k: float(torch.linalg.vector_norm(torch.from_dlpack(o) - ref_out) / norm)
                    for k, o in outs.items()}
            base[name] = {**bt.as_dict(), "mode": mode, "fraction_of_floor": fl["floor_ms"] / bt.median_ms,
                          "rel_diff_vs_kernel": diff.get(first), "rel_diff_by_variant": diff}
        except torch.OutOfMemoryError as e:
            base[name] = {"skipped": f"out of memory: {str(e).splitlines()[0][:120]}"}
        res.clear()
        torch.cuda.empty_cache()
    return base


def run_point(p: dict, pool, ceil: dict, *, iters: int, baseline_iters: int, baselines: bool = True,
              impls: tuple[str, ...] = ("auto",)) -> dict:
    """Time one (H, Q, S, B) point for each kernel variant in `impls` (the first is the headline).

    `pool` is a bf16 [N, 576] torch tensor of KV rows (N >= B*S).
    """
    import torch

    from kdlib.cuda import attention as cu

    h, nq, s, bsz = p["heads"], p["queries"], p["prefix"], p["batch"]
    dev = pool.device
    gen = torch.Generator().manual_seed(h * 1_000_003 + nq * 10_007 + s + bsz)
    q = torch.randn(bsz, nq, h, D_QK, generator=gen).to(dev, torch.bfloat16)  # [B, Q, H, 576]
    tkv = torch.randn(bsz, nq, D_QK, generator=gen).to(dev, torch.bfloat16)  # [B, Q, 576]
    vis = random_tree_visibility(torch, bsz, nq, gen).to(dev)  # [B, Q, Q]
    lens = torch.full((bsz,), s, dtype=torch.int32, device=dev)
    sizes = torch.full((bsz,), nq, dtype=torch.int32, device=dev)
    scale = D_QK**-0.5
    c = cost(h, nq, s, bsz)
    kv_bytes = bsz * s * D_QK * 2
    n_rot = timing.l2_rotations(kv_bytes, fit=pool.shape[0] // (bsz * s))
    perm = torch.randperm(s, device=dev, dtype=torch.int32)  # scattered slots within each request's range
    tables = [(perm[None, :] + (r * bsz + torch.arange(bsz, device=dev, dtype=torch.int32)[:, None]) * s)
              for r in range(n_rot)]  # [B, S] each, disjoint slot ranges

    fl = perf.floor_ms(c["bytes"], c["flops"], bandwidth_Bps=ceil["bandwidth_Bps"],
                       flop_rate=ceil["flop_rate"])
    row = {**p, **c, **fl, "rotations": n_rot, "l2_resident": timing.l2_resident(kv_bytes, n_rot),
           "variants": {}}
    outs = {}
    for impl in impls:
        def call(pt, impl=impl):
            return cu.tree_verify_attention(q, pool, pt, lens, tkv, vis, sizes, scale, impl=impl,
                                            validate=False)

        # validated once
        cu.tree_verify_attention(q, pool, tables[0], lens, tkv, vis, sizes, scale, impl=impl)
        t = graph_time([lambda pt=pt, call=call: call(pt) for pt in tables], iters)
        row["variants"][impl] = {"kernel": t.as_dict(), "fraction_of_floor": fl["floor_ms"] / t.median_ms,
                                 "achieved_TBps": c["bytes"] / (t.median_ms * 1e-3) / 1e12,
                                 "achieved_TFLOPs": c["flops"] / (t.median_ms * 1e-3) / 1e12}
        outs[impl] = call(tables[0])[0]
    head = row["variants"][impls[0]]  # the headline variant, also at the top level
    row.update({"impl": impls[0], "kernel": head["kernel"], "fraction_of_floor": head["fraction_of_floor"],
                "achieved_TBps": head["achieved_TBps"], "achieved_TFLOPs": head["achieved_TFLOPs"]})
    head_ms = head["kernel"]["median_ms"]

    base = torch_baselines(q, pool, tables[0], tkv, vis, scale, outs, fl, baseline_iters, enabled=baselines)
    for b in base.values():
        if "median_ms" in b:
            b["speedup"] = b["median_ms"] / head_ms
    row["baselines"] = base
    best = [v["median_ms"] for v in base.values() if "median_ms" in v]
    for v in row["variants"].values():
        v["speedup_vs_best_baseline"] = min(best) / v["kernel"]["median_ms"] if best else None
    row["speedup_vs_best_baseline"] = head["speedup_vs_best_baseline"]
    return row


def sweep(*, quick: bool = False, impls: Sequence[str] = ("auto",), iters: int = 20,
          baseline_iters: int = 5, time_budget_s: float | None = None) -> dict:
    """The verify-attention sweep.

    quick: QUICK_GRID with 10 kernel / 3 baseline replays per point (else FULL_GRID).
    impls: kernel variants (`kdlib.cuda.attention.IMPLS` names) timed at every point; the first is
        the headline.
    iters, baseline_iters: CUDA-graph replays per point of each kernel variant / each baseline on
        the full grid (quick runs 10 / 3; `parameters` records the counts run).
    time_budget_s: past this many seconds no new point starts (the grid is in priority order);
        None: no limit.
    """
    import torch

    grid = points(quick)
    ceil = results.ceilings().as_dict()
    max_slots = max(p["batch"] * p["prefix"] for p in grid)
    pool = torch.randn(max_slots, D_QK, device="cuda", dtype=torch.bfloat16)  # [N, 576] KV rows
    clocks_before = timing.clocks()
    from kdlib.cuda import attention as cu

    impls = tuple(impls)
    resolved = {i: cu.LAUNCHES[cu.pick_version(None, i, "bf16")].impl for i in impls}  # 'auto' -> what ran
    if quick:
        iters, baseline_iters = 10, 3
    t0 = time.monotonic()
    rows, left_out = [], []
    for p in grid:
        if time_budget_s is not None and time.monotonic() - t0 > time_budget_s:
            left_out.append(p)
            continue
        rows.append(run_point(p, pool, ceil, iters=iters, baseline_iters=baseline_iters, impls=impls))
        torch.cuda.empty_cache()
    return {
        "parameters": {"quick": quick, "impls": list(impls), "resolved_impls": resolved, "iters": iters,
                       "baseline_iters": baseline_iters, "grid": QUICK_GRID if quick else FULL_GRID,
                       "dtype": "bfloat16", "page_size": 1, "kv_pool_rows": max_slots,
                       "softmax_scale": "576**-0.5",
                       "tree": "random trees, every request full (tree_sizes = Q), prefix_lens = S"},
        "ceilings": ceil,
        "clocks_before": clocks_before,
        "clocks_after": timing.clocks(),
        "points": rows,
        "left_out_for_time": left_out,
        "wall_s": time.monotonic() - t0,
        "notes": [
            "kernel time = CUDA-graph replay of tree_verify_attention (3 launches) per variant in "
            "parameters.impls ('auto' = the bf16 mma prefix default at the recorded commit); the top-level "
            "kernel fields are impls[0]",
            "baselines include the page-table gather of the prefix (PyTorch has no paged MLA path), "
            "graph-replayed "
            "where capture works (see mode); they read one KV set (no rotation), the kernel rotates",
            "FLOPs count the prefix only: 2 B H Q S (576 + 512)",
        ],
    }


run = sweep  # the suite's entry (kdlib.perf.run calls every suite's `run`)


GOAL_MIN_PREFIX = 8192  # issue 4: beat the best PyTorch baseline at every prefix >= 8k ...
GOAL_FRACTION = 0.30  # ... and reach 30% of the floor at 200k prefix, 8 heads x 65 queries
GOAL_POINT = {"heads": 8, "queries": 65, "prefix": 200000, "batch": 1}


def variant_names(result: dict) -> list[str]:
    """The kernel variants a recorded sweep timed (older records: the one headline kernel)."""
    pts = result.get("points") or []
    return list(pts[0]["variants"]) if pts and "variants" in pts[0] else ["kernel"]


def frame(result: dict, variant: str | None = None) -> list[dict]:
    """One flat row per point: shape, floor, the kernel variant's time and rates, the baselines.

    variant: a name from `variant_names` (default: the headline, the top-level fields).
    """
    rows = []
    for r in result.get("points", []):
        v = r["variants"][variant] if variant and variant != "kernel" else r
        base = r.get("baselines", {})
        ms = {k: b.get("median_ms") for k, b in base.items()}
        best = min((x for x in ms.values() if x is not None), default=None)
        rows.append({
            "heads": r["heads"], "queries": r["queries"], "prefix": r["prefix"], "batch": r["batch"],
            "bound": r["bound"], "floor_ms": r["floor_ms"], "kernel_ms": v["kernel"]["median_ms"],
            "kernel_p10_ms": v["kernel"]["p10_ms"], "kernel_p90_ms": v["kernel"]["p90_ms"],
            "fraction_of_floor": v["fraction_of_floor"], "TBps": v["achieved_TBps"],
            "TFLOPs": v["achieved_TFLOPs"],
            "matmul_ms": ms.get("matmul"), "sdpa_ms": ms.get("sdpa"), "best_baseline_ms": best,
            "speedup_vs_best": best / v["kernel"]["median_ms"] if best else None,
            "baseline_note": "; ".join(f"{k}: {b['skipped']}" for k, b in base.items() if "skipped" in b)
            or None,
            "rel_diff_vs_matmul": base.get("matmul", {}).get("rel_diff_by_variant", {}).get(variant)
            if variant and variant != "kernel" else base.get("matmul", {}).get("rel_diff_vs_kernel"),
        })
    return rows


def goal(result: dict, variant: str | None = None) -> dict:
    """Issue 4's verify-attention goal against a recorded sweep.

    Returns the fraction of the floor at GOAL_POINT (None when not measured), the smallest
    speed-up over the best baseline among points with prefix >= GOAL_MIN_PREFIX where a baseline
    ran (and that point), and whether each half of the goal is met.
    """
    rows = frame(result, variant)
    at = [r for r in rows if all(r[k] == GOAL_POINT[k] for k in GOAL_POINT)]
    frac = at[0]["fraction_of_floor"] if at else None
    long = [r for r in rows if r["prefix"] >= GOAL_MIN_PREFIX and r["speedup_vs_best"] is not None]
    worst = min(long, key=lambda r: r["speedup_vs_best"]) if long else None
    return {
        "fraction_at_goal_point": frac,
        "tflops_at_goal_point": at[0]["TFLOPs"] if at else None,
        "min_speedup_ge_8k": worst["speedup_vs_best"] if worst else None,
        "worst_point": {k: worst[k] for k in ("heads", "queries", "prefix", "batch")} if worst else None,
        "points_compared": len(long),
        "beats_baselines": bool(worst and worst["speedup_vs_best"] > 1.0),
        "fraction_met": bool(frac is not None and frac >= GOAL_FRACTION),
    }


def junit_summary(path) -> dict | None:
    """{passed, failed, skipped, failures: [test ids]} of a pytest --junitxml file (None when absent)."""
    import xml.etree.ElementTree as ET
    from pathlib import Path

    if not path or not Path(path).is_file():
        return None
    cases = ET.parse(path).getroot().iter("testcase")
    out = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "cases": []}
    for c in cases:
        name = f"{c.get('classname', '')}::{c.get('name', '')}"
        kind = "failed" if c.find("failure") is not None or c.find("error") is not None else \
            "skipped" if c.find("skipped") is not None else "passed"
        out[kind] += 1
        out["cases"].append({"test": name, "outcome": kind, "seconds": float(c.get("time", 0))})
        if kind == "failed":
            out["failures"].append(name)
    return out


def main(argv=None) -> int:  # pragma: no cover - the GPU entry of a development run
    """`python3 -m kdlib.perf.suites._attention --out DIR [--impls a,b] [--quick] [--junit FILE] ...`

    Writes `<DIR>/verify_attention_dev.<gpu>.json` (provenance stamped), with the summary of a
    pytest --junitxml file from the same session when given.
    """
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python3 -m kdlib.perf.suites._attention")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--impls", default="auto",
                    help="comma list of kernel variants; the first is the headline")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds after which no new point starts")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--baseline-iters", type=int, default=5)
    ap.add_argument("--junit", default=None, help="pytest --junitxml file of the GPU tests run just before")
    a = ap.parse_args(argv)
    payload = sweep(quick=a.quick, impls=a.impls.split(","), time_budget_s=a.time_budget, iters=a.iters,
                    baseline_iters=a.baseline_iters)
    payload["gpu_tests"] = junit_summary(a.junit)
    command = "python3 -m kdlib.perf.suites._attention " + " ".join(sys.argv[1:] if argv is None else argv)
    path = perf.write("verify_attention_dev", payload, out_dir=a.out, command=command)
    print(f"[perf] wrote {path}")
    for r in payload["points"]:
        if r["heads"] == 8 and r["batch"] == 1 or r["queries"] == 65 and r["prefix"] == 200000:
            v = "  ".join(f"{k} {x['kernel']['median_ms']:.4f} ms {x['fraction_of_floor']:.3f}"
                          for k, x in r["variants"].items())
            b = "  ".join(f"{k} {x['median_ms']:.4f}" for k, x in r["baselines"].items() if "median_ms" in x)
            print(f"H{r['heads']} Q{r['queries']} S{r['prefix']} B{r['batch']} floor {r['floor_ms']:.4f} "
                  f"| {v} | {b}")
    print("left out for time:", len(payload["left_out_for_time"]), "wall", round(payload["wall_s"], 1),
          "tests:", {k: v for k, v in (payload["gpu_tests"] or {}).items() if k != "cases"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
