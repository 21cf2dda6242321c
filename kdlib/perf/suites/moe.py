"""MoE layer, two regimes, on one GPU: the W4A16 CuPy kernels (`kernels/moe_w4a16/v1.cu` and the
decode-regime `kernels/moe_w4a16/v2.cu`) against a bf16 grouped GEMM in PyTorch, Kimi-K2 expert
shapes at the TP8 shard.

Shapes: 384 experts, hidden K = 7168, expert intermediate N = 2048 / 8 = 256 (TP8 shard), top-8
routing of M tokens (uniformly random experts, Dirichlet-like random weights), M = 1 ... 4096.

Arm names: `kernel` is version 1 (the default when this suite was written; the estimator's
`kernel_v1` calibration arm reads it); version 2 is `kernel_v2`; `kernel_default` is what `moe_w4a16`
runs without a version (below), whose graph replays the estimator's default `kernel` arm reads (its
fit over M <= 64 spans versions 2 and 3).

What is timed (CUDA events around each call, median of `iters` after warm-up):
- kernel: version 1, y.fill(0) + gate/up+SwiGLU launch + down+combine launch
  (`kdlib.cuda.moe.moe_w4a16(..., version=1)`), issued from Python (eager) and, separately,
  replayed from a CUDA graph (`kernel_graph`). `kernel_gate_up_8warps`: the same with v1's 8-warp
  gate/up block (decode regime only).
- kernel_v2: version 2 (default block shapes: 8-warp gate/up, two per SM), persistent gate/up
  launch (zeroes y) + persistent down launch, eager and graph (`kernel_v2_graph`); where some
  expert has more than 8 slots, version 2 runs version 1's kernels (the row's `kernel_v2_path`
  says which ran). Decode regime only: `kernel_v2_gate_up_16warps` (one 16-warp gate/up block per
  SM), `kernel_v2_k_interleave` (K chunks dealt to the warps round-robin), and the two v2 launches
  timed apart, `kernel_v2_gate_up_only` and `kernel_v2_down_only` (eager, each with its fraction
  of copy bandwidth over its own weight bytes: 2/3 and 1/3 of the touched experts').
- kernel_default: `moe_w4a16` as called without a version (`moe.default_version`: v3 or v2, v1's
  kernels above the decode regime), eager and graph; `kernel_default_version` says which ran.
- kernel_v3: version 3 (`kernels/moe_w4a16/v3.cu`): the same decode regime in one persistent
  launch (gate/up items from a global counter, down items waiting per expert for its h), eager
  and graph (`kernel_v3_graph`); v1's kernels where some expert has more than 8 slots.
  The routing metadata (sort by expert, offsets) is made once per routing outside the timing:
  an engine computes it once per layer call alongside the router, in a few small kernels.
- baseline: gather x by sorted slot, `torch._grouped_mm` gate/up, SwiGLU, `torch._grouped_mm`
  down, weighted `index_add_` combine (or, if `_grouped_mm` is missing or rejects the layout,
  a padded `torch.bmm` over every expert; the payload names the arm that ran).
L2: the touched experts at small M fit in the 60 MiB L2, so each timed call uses the next of
`rotations` independent routings (their touched sets together exceed L2), giving cold-weight
numbers. Bytes: touched experts' INT4 weights + bf16 scales + activations (x, h, y); FLOPs:
2 * M * 8 * 3 * K * N. Floors use the copy bandwidth measured in the same run (a 1 GiB
device-to-device copy, read + write counted) and the bf16 matmul ceiling of the running GPU's
`ceilings.<gpu>.json` (the H200's where that GPU has none; else 790e12 FLOP/s, said in the payload).
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from kdlib import perf
from kdlib.cuda import moe
from kdlib.perf import results, timing

E, K, N, TOPK = 384, 7168, 2048 // 8, 8
M_FULL = (1, 2, 4, 8, 9, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
M_QUICK = (1, 9, 32, 256, 1024, 4096)


def expected_touched(m: int, n_experts: int = E, topk: int = TOPK) -> float:
    """Distinct experts hit by m tokens under uniform top-k routing: E (1 - (1 - k/E)^m)."""
    return n_experts * (1.0 - (1.0 - topk / n_experts) ** m)


def routing(rng, m: int):
    """Random top-k routing of m tokens: ids [m, TOPK] int32 (distinct experts), weights [m, TOPK] (rows sum
    to 1)."""
    ids = np.argsort(rng.random((m, E)), axis=1)[:, :TOPK].astype(np.int32)   # k distinct experts
    w = rng.random((m, TOPK)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def random_words(torch, cp, n: int):
    t = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    return cp.from_dlpack(t).view(cp.uint32)


def random_scales(torch, cp, n: int):
    """n uint32 words, each two bf16 scales in [2^-9, 2^-7): small positive, finite."""
    lo = torch.randint(0x3B00, 0x3C00, (n,), dtype=torch.int32, device="cuda")
    hi = torch.randint(0x3B00, 0x3C00, (n,), dtype=torch.int32, device="cuda")
    return cp.from_dlpack(lo | (hi << 16)).view(cp.uint32)


def _baseline_arm(torch, wgu, wd):
    """The bf16 grouped GEMM that runs here: ('grouped_mm', fn) or ('padded_bmm', fn)."""

    def combine(yd, tok, wts, m):
        return torch.zeros(m, K, dtype=torch.float32, device="cuda").index_add_(
            0, tok, (yd * wts[:, None]).float()
        )

    def grouped(x, tok, wts, offs, m, cap):
        xs = x.index_select(0, tok)
        hu = torch._grouped_mm(xs, wgu, offs=offs)                     # [S, 2N]
        h = torch.nn.functional.silu(hu[:, :N]) * hu[:, N:]
        return combine(torch._grouped_mm(h, wd, offs=offs), tok, wts, m)

    def padded(x, tok, wts, offs, m, cap):
        ends = offs.long()
        starts = ends - torch.diff(ends, prepend=ends.new_zeros(1))
        slot = torch.arange(tok.numel(), device="cuda")
        expert = torch.searchsorted(ends, slot, right=True)
        pos = slot - starts[expert]
        xs = torch.zeros(E, cap, K, dtype=x.dtype, device="cuda")
        xs[expert, pos] = x.index_select(0, tok)
        hu = torch.bmm(xs, wgu)                                        # [E, cap, 2N]
        h = torch.nn.functional.silu(hu[..., :N]) * hu[..., N:]
        return combine(torch.bmm(h, wd)[expert, pos], tok, wts, m)

    if hasattr(torch, "_grouped_mm"):
        x = torch.randn(4, K, dtype=torch.bfloat16, device="cuda")
        offs = torch.tensor([2] + [4] * (E - 1), dtype=torch.int32, device="cuda")
        tok = torch.tensor([0, 1, 2, 3], device="cuda")
        # Row-major weights first; then the same values stored column-major (some builds want that).
        for layout in ("row-major", "column-major"):
            if layout == "column-major":
                wgu = wgu.transpose(-2, -1).contiguous().transpose(-2, -1)
                wd = wd.transpose(-2, -1).contiguous().transpose(-2, -1)
            try:
                grouped(x, tok, torch.ones(4, device="cuda"), offs, 4, 2)
                torch.cuda.synchronize()
                return f"grouped_mm ({layout} B)", grouped
            except Exception as err:  # any rejection means: try the next arm
                print(f"[moe] torch._grouped_mm with {layout} B unusable here: {err}", flush=True)
    return "padded_bmm", padded


def _knee_from_times(rows: list[dict], arm: str) -> float | None:
    """M (log-interpolated) at which the measured time reaches 85% of its plateau, the median time
    over 256 <= M <= 1024: the measured counterpart of `knee_m_bytes_85pct`."""
    pts = sorted((r["m"], r[arm]["median_ms"]) for r in rows)
    plateau = [t for m, t in pts if 256 <= m <= 1024]
    if not plateau:
        return None
    target = 0.85 * float(np.median(plateau))
    for (m0, t0), (m1, t1) in zip(pts, pts[1:], strict=False):
        if t0 < target <= t1:
            f = (math.log(target) - math.log(t0)) / (math.log(t1) - math.log(t0))
            return float(math.exp(math.log(m0) + f * (math.log(m1) - math.log(m0))))
    return float(pts[0][0]) if pts[0][1] >= target else None


def _min_key(rows: list[dict], key: str) -> float | None:
    """The smallest non-None rows[i][key], or None."""
    return min((r[key] for r in rows if r.get(key) is not None), default=None)


def _graph_time(routes, xb, packed, out, h, *, rotations: int, iters: int, **kw) -> dict:
    """The same launches (`moe_w4a16(..., **kw)`) replayed from one CUDA graph per routing: the
    device time without the ~5 us per launch of Python issue (kernels-perf.md §6), which dominates
    at M = 1."""
    launches = [partial(moe.moe_w4a16, xb, packed, r, out=out, h=h, **kw) for r, *_ in routes]
    return timing.graph_record(launches, iters=iters, warmup=rotations, warm=0)


def _measure(
    m: int, rng, packed, baseline, *, bw: float, flop_rate: float, rotations: int, iters: int
) -> dict:
    """Time the kernel and the baseline at M = m over `rotations` routings; bytes, FLOPs, floors."""
    import cupy as cp
    import torch

    x = torch.randn(m, K, device="cuda").to(torch.bfloat16)                    # [M, K]
    xb = cp.from_dlpack(x.view(torch.int16)).view(cp.uint16)                    # bf16 bits, no copy
    routes = []
    for _ in range(rotations):
        ids, w = routing(rng, m)
        r = moe.prepare_routing(cp.asarray(ids), cp.asarray(w), E)
        offs = torch.as_tensor(cp.asnumpy(r.expert_offsets[1:]), device="cuda")   # [E] int32 group ends
        routes.append((r, offs, torch.from_dlpack(r.sorted_token).long(), torch.from_dlpack(r.sorted_weight)))
    out = cp.empty((m, K), dtype=cp.float32)                                    # [M, K]
    h = cp.empty((m * TOPK, N), dtype=cp.uint16)                                # [M*topk, N]
    state = {"i": 0}

    def eager(**kw) -> dict:
        """Median timing of moe_w4a16(..., **kw) over the rotating routings (one synced call first:
        it surfaces launch errors)."""
        moe.moe_w4a16(xb, packed, routes[0][0], out=out, h=h, sync=True, **kw)

        def call():
            r = routes[state["i"] % rotations][0]
            state["i"] += 1
            moe.moe_w4a16(xb, packed, r, out=out, h=h, **kw)

        return timing.cuda_time(call, warmup=rotations, iters=iters, backend="cupy").as_dict()

    def baseline_call():
        r, offs, tok, wts = routes[state["i"] % rotations]
        state["i"] += 1
        baseline(x, tok, wts, offs, m, r.max_count)

    def stage(launch) -> dict:
        """Median timing of one v2 launch alone, launch(routing), over the rotating routings."""

        def call():
            launch(routes[state["i"] % rotations][0])
            state["i"] += 1

        return timing.cuda_time(call, warmup=rotations, iters=iters, backend="cupy").as_dict()

    decode = all(moe.v2_applies(rr[0], N) for rr in routes)   # v1's n8 kernels and v2's own kernels
    t_kernel = eager(version=1)
    t_graph = _graph_time(routes, xb, packed, out, h, rotations=rotations, iters=iters, version=1)
    t_w8 = eager(version=1, gate_up_warps=8) if decode else None
    t_v2 = eager(version=2)
    t_v2_graph = _graph_time(routes, xb, packed, out, h, rotations=rotations, iters=iters, version=2)
    t_v2_w16 = t_v2_il = t_v2_gu = t_v2_dn = None
    if decode:
        t_v2_w16 = eager(version=2, gate_up_warps=16)
        t_v2_il = eager(version=2, k_interleave=True)
        t_v2_gu = stage(lambda r: moe.launch_v2_gate_up(xb, packed, r, out, h))
        t_v2_dn = stage(lambda r: moe.launch_v2_down(packed, r, out, h))
    t_def = eager()
    t_def_graph = _graph_time(routes, xb, packed, out, h, rotations=rotations, iters=iters)
    picked = sorted({moe.default_version(rr[0], N) for rr in routes})
    t_v3 = eager(version=3)
    t_v3_graph = _graph_time(routes, xb, packed, out, h, rotations=rotations, iters=iters, version=3)
    t_base = timing.cuda_time(baseline_call, warmup=rotations, iters=iters)
    touched = float(np.mean([rr[0].n_active for rr in routes]))
    acct = moe.layer_bytes_flops(m, touched, K, N, TOPK)
    base_bytes = touched * 3 * K * N * 2 + (acct["bytes"] - acct["weight_bytes"])
    fl_k = perf.floor_ms(acct["bytes"], acct["flops"], bandwidth_Bps=bw, flop_rate=flop_rate)
    fl_b = perf.floor_ms(base_bytes, acct["flops"], bandwidth_Bps=bw, flop_rate=flop_rate)
    sec_k, sec_b = t_kernel["median_ms"] * 1e-3, t_base.median_ms * 1e-3

    def frac(t: dict | None, nbytes: float = acct["bytes"]) -> float | None:
        """nbytes (default: the layer's) / median time / copy bandwidth (None for an arm that did not run)."""
        return nbytes / (t["median_ms"] * 1e-3) / bw if t and "median_ms" in t else None

    return {
        "m": m,
        "touched_experts": touched,
        "expected_touched": expected_touched(m),
        "max_tokens_per_expert": max(rr[0].max_count for rr in routes),
        "kernel_variants": sorted({"n8" if rr[0].max_count <= 8 else "n16" if rr[0].max_count <= 16 else "n32"
                                   for rr in routes}),
        "bytes": acct["bytes"],
        "weight_bytes": acct["weight_bytes"],
        "flops": acct["flops"],
        "kernel": t_kernel,
        "kernel_floor": fl_k,
        "kernel_GBps": acct["bytes"] / sec_k / 1e9,
        "kernel_frac_copy_bw": frac(t_kernel),
        "kernel_TFLOPs": acct["flops"] / sec_k / 1e12,
        "kernel_frac_floor": fl_k["floor_ms"] / t_kernel["median_ms"],
        "kernel_graph": t_graph,
        "kernel_gate_up_8warps": t_w8,
        "kernel_gate_up_8warps_frac_copy_bw": frac(t_w8),
        "kernel_graph_frac_copy_bw": frac(t_graph),
        "kernel_v2_path": "v2" if decode else "v1 kernels (an expert has > 8 slots)",
        "kernel_v2": t_v2,
        "kernel_v2_frac_copy_bw": frac(t_v2),
        "kernel_v2_graph": t_v2_graph,
        "kernel_v2_graph_frac_copy_bw": frac(t_v2_graph),
        "kernel_v2_gate_up_16warps": t_v2_w16,
        "kernel_v2_gate_up_16warps_frac_copy_bw": frac(t_v2_w16),
        "kernel_v2_k_interleave": t_v2_il,
        "kernel_v2_k_interleave_frac_copy_bw": frac(t_v2_il),
        "kernel_v2_gate_up_only": t_v2_gu,
        "kernel_v2_gate_up_only_frac_copy_bw": frac(t_v2_gu, acct["weight_bytes"] * 2 / 3),
        "kernel_v2_down_only": t_v2_dn,
        "kernel_v2_down_only_frac_copy_bw": frac(t_v2_dn, acct["weight_bytes"] / 3),
        "speedup_v2_vs_v1": t_kernel["median_ms"] / t_v2["median_ms"],
        "kernel_default": t_def,
        "kernel_default_frac_copy_bw": frac(t_def),
        "kernel_default_graph": t_def_graph,
        "kernel_default_graph_frac_copy_bw": frac(t_def_graph),
        "kernel_default_version": picked,
        "kernel_v3": t_v3,
        "kernel_v3_frac_copy_bw": frac(t_v3),
        "kernel_v3_graph": t_v3_graph,
        "kernel_v3_graph_frac_copy_bw": frac(t_v3_graph),
        "speedup_v3_vs_v2": t_v2["median_ms"] / t_v3["median_ms"],
        "baseline": t_base.as_dict(),
        "baseline_bytes": base_bytes,
        "baseline_floor": fl_b,
        "baseline_GBps": base_bytes / sec_b / 1e9,
        "baseline_frac_floor": fl_b["floor_ms"] / t_base.median_ms,
        "speedup_vs_baseline": t_base.median_ms / t_kernel["median_ms"],
    }


def run(*, quick: bool = False) -> dict:
    """The suite on the CUDA device (see the module docstring): M_FULL with 40 replays a point, or
    M_QUICK with 24 when quick."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the moe suite needs a CUDA device (torch.cuda.is_available() is False)")
    try:
        import cupy as cp
    except ImportError as err:
        raise SystemExit(f"the moe suite needs CuPy for the W4A16 kernel: {err}") from err

    ms = M_QUICK if quick else M_FULL
    rotations = 8
    iters = 24 if quick else 40
    rng = np.random.default_rng(0)

    copy = timing.copy_bandwidth()
    ceil = results.ceilings()  # the running GPU's (the H200's where none is recorded)
    flop_rate, flop_source = ceil.flop_rate, ceil.source
    bw = copy["Bps"]

    # INT4 experts in the kernel layout (random bits: timing does not depend on the values).
    P, KC = N // 16, K // 64
    packed = {
        "w1": random_words(torch, cp, E * P * KC * 2 * 32 * 4).reshape(E, P, KC, 2, 32, 4),
        "s1": random_scales(torch, cp, E * P * KC * 2 * 16).reshape(E, P, KC, 2, 16),
        "w2": random_words(torch, cp, E * (K // 16) * (N // 64) * 32 * 4).reshape(
            E, K // 16, N // 64, 32, 4
        ),
        "s2": random_scales(torch, cp, E * (K // 16) * (N // 64) * 16).reshape(E, K // 16, N // 64, 16),
    }
    wgu = (torch.randn(E, K, 2 * N, device="cuda") * 0.02).to(torch.bfloat16)   # [E, K, 2N]
    wd = (torch.randn(E, N, K, device="cuda") * 0.02).to(torch.bfloat16)        # [E, N, K]
    arm, baseline = _baseline_arm(torch, wgu, wd)

    rows = []
    for m in ms:
        row = _measure(m, rng, packed, baseline, bw=bw, flop_rate=flop_rate, rotations=rotations, iters=iters)
        rows.append(row)
        print(
            f"[moe] M={m:5d} touched {row['touched_experts']:6.1f}  kernel {row['kernel']['median_ms']:7.3f} "
            "ms "
            f"({row['kernel_GBps']:6.0f} GB/s, {row['kernel_frac_copy_bw']:.0%} of copy, "
            f"{row['kernel_TFLOPs']:.1f} TF; graph {row['kernel_graph'].get('median_ms', float('nan')):7.3f} "
            "ms)  "
            f"v2 {row['kernel_v2']['median_ms']:7.3f} ms ({row['kernel_v2_frac_copy_bw']:.0%}; graph "
            f"{row['kernel_v2_graph'].get('median_ms', float('nan')):7.3f} ms; "
            f"w16 {row['kernel_v2_gate_up_16warps_frac_copy_bw'] or float('nan'):.0%} "
            f"k-il {row['kernel_v2_k_interleave_frac_copy_bw'] or float('nan'):.0%} "
            f"gu {row['kernel_v2_gate_up_only_frac_copy_bw'] or float('nan'):.0%} "
            f"dn {row['kernel_v2_down_only_frac_copy_bw'] or float('nan'):.0%})  "
            f"default[v{row['kernel_default_version']}] {row['kernel_default_frac_copy_bw']:.0%}  "
            f"v3 {row['kernel_v3']['median_ms']:7.3f} ms ({row['kernel_v3_frac_copy_bw']:.0%}; graph "
            f"{row['kernel_v3_graph_frac_copy_bw'] or float('nan'):.0%})  "
            f"baseline[{arm}] {row['baseline']['median_ms']:7.3f} ms",
            flush=True,
        )

    small = [r for r in rows if r["m"] <= 32]
    knee_time = _knee_from_times(rows, "kernel")
    # Arithmetic knee: the M at which every expert is touched (weight bytes stop growing) is where
    # expected_touched reaches ~99.5% of E; the compute ridge for this shape is where useful FLOPs
    # at the bf16 ceiling equal streaming all experts' INT4 bytes at the copy bandwidth.
    all_bytes = E * moe.packed_bytes_per_expert(K, N)
    ridge_m = all_bytes / bw * flop_rate / (2.0 * TOPK * 3 * K * N)
    saturate_m = math.log(0.005) / math.log(1.0 - TOPK / E)
    return {
        "params": {
            "experts": E,
            "hidden": K,
            "expert_inter_tp8": N,
            "topk": TOPK,
            "ms": list(ms),
            "rotations": rotations,
            "iters": iters,
            "quick": quick,
            "timed_kernel": "y.fill(0) + gate_up + down launches; routing prepared outside",
            "timed_kernel_v2": "gate_up (zeroes y) + down launches, persistent; v1's kernels "
            "where an expert has > 8 slots; routing prepared outside",
            "timed_kernel_v3": "one persistent launch (zeroes y); v1's kernels where an expert has "
            "> 8 slots; routing prepared outside",
            "timed_baseline": f"gather + {arm} gate/up + SwiGLU + {arm} down + index_add combine",
        },
        "copy": copy,
        "copy_bandwidth_Bps": bw,
        "bf16_flops_ceiling": flop_rate,
        "bf16_flops_source": flop_source,
        "baseline_arm": arm,
        "rows": rows,
        "summary": {
            "kernel_min_frac_copy_bw_m_le_32": min(r["kernel_frac_copy_bw"] for r in small)
            if small
            else None,
            "kernel_graph_min_frac_copy_bw_m_le_32": min(
                (r["kernel_graph_frac_copy_bw"] for r in small if r["kernel_graph_frac_copy_bw"] is not None),
                default=None,
            ),
            "kernel_gate_up_8warps_min_frac_copy_bw_m_le_32": min(
                (
                    r["kernel_gate_up_8warps_frac_copy_bw"]
                    for r in small
                    if r["kernel_gate_up_8warps_frac_copy_bw"] is not None
                ),
                default=None,
            ),
            "kernel_median_frac_copy_bw_m_le_32": float(np.median([r["kernel_frac_copy_bw"] for r in small]))
            if small
            else None,
            "kernel_v2_min_frac_copy_bw_m_le_32": _min_key(small, "kernel_v2_frac_copy_bw"),
            "kernel_v2_graph_min_frac_copy_bw_m_le_32": _min_key(small, "kernel_v2_graph_frac_copy_bw"),
            "kernel_v2_gate_up_16warps_min_frac_copy_bw_m_le_32": _min_key(
                small, "kernel_v2_gate_up_16warps_frac_copy_bw"
            ),
            "kernel_v2_k_interleave_min_frac_copy_bw_m_le_32": _min_key(
                small, "kernel_v2_k_interleave_frac_copy_bw"
            ),
            "kernel_v2_median_frac_copy_bw_m_le_32": (
                float(np.median([r["kernel_v2_frac_copy_bw"] for r in small])) if small else None
            ),
            "kernel_v2_graph_min_frac_copy_bw_m_2_to_32": _min_key(
                [r for r in small if r["m"] >= 2], "kernel_v2_graph_frac_copy_bw"
            ),
            "kernel_v2_min_speedup_vs_v1_m_le_32": _min_key(small, "speedup_v2_vs_v1"),
            "kernel_v3_min_frac_copy_bw_m_le_32": _min_key(small, "kernel_v3_frac_copy_bw"),
            "kernel_default_min_frac_copy_bw_m_le_32": _min_key(small, "kernel_default_frac_copy_bw"),
            "kernel_default_graph_min_frac_copy_bw_m_le_32": _min_key(
                small, "kernel_default_graph_frac_copy_bw"
            ),
            "kernel_v3_graph_min_frac_copy_bw_m_le_32": _min_key(small, "kernel_v3_graph_frac_copy_bw"),
            "kernel_v3_graph_min_frac_copy_bw_m_2_to_32": _min_key(
                [r for r in small if r["m"] >= 2], "kernel_v3_graph_frac_copy_bw"
            ),
            "kernel_v3_min_speedup_vs_v2_m_le_32": _min_key(small, "speedup_v3_vs_v2"),
            "all_experts_bytes": all_bytes,
            "all_experts_floor_ms": all_bytes / bw * 1e3,
            "knee_m_all_touched": saturate_m,
            "knee_m_bytes_85pct": math.log(0.15) / math.log(1.0 - TOPK / E),
            "knee_m_time_85pct_kernel": knee_time,
            "knee_m_time_85pct_baseline": _knee_from_times(rows, "baseline"),
            "ridge_m_compute": ridge_m,
        },
    }
