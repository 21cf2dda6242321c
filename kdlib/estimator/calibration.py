"""Calibration on recorded H200 component measurements, and validation against the engine.

    results = load_results("h200")             # {suite: payload} for ceilings, moe, kernels, attention, ...
    a, notes = calibrate(results, report=True)  # Assumptions with measured efficiencies and latencies
    table = validate(a, results["engine"])      # predicted vs measured step time per engine run

`calibrate` reads only component suites: `moe` (the W4A16 kernel's or the bf16 baseline's curve ->
MoE bandwidth efficiency, per-layer latency, plateau compute efficiency), `kernels` (tree build ->
CPU / GPU build costs; its early verify-attention sweep -> attention efficiencies where `attention`,
the default kernel's sweep, is not recorded), `attention`, `tp` (the NCCL
all-reduce sweep -> all-reduce latency and bus efficiency). The engine's runs are
kept out of it; `validate` then anchors the engine's host-side costs (per-layer launch latency,
drafter and accept/compaction overheads, which no component suite measures) on ONE engine run and
predicts every other run, reporting the residuals both for the held-out runs and for the anchor.
"""

from __future__ import annotations

import statistics

from kdlib.estimator.model import hardware, step_time
from kdlib.estimator.params import (
    ATTENTION_PLAN_TERMS,
    RANK_PIECES,
    SHAPE_CONFIG,
    Assumptions,
    AttentionPlanTerms,
    ModelShape,
    Param,
    PieceTerms,
    RankLayerTerms,
    Scenario,
)
from kdlib.perf.bench_model import BENCH_CONFIG, BLOCK
from kdlib.perf.results import VERIFY_OP, Recorded, attention_rows, attention_version, moe_rows

SUITES = ("ceilings", "moe", "kernels", "attention", "engine", "tp")
MOE_ARMS = ("kernel", "kernel_v1", "baseline")


def load_results(gpu: str = "h200") -> dict:
    """{suite: recorded payload} for the suites recorded on `gpu` (missing ones are left out)."""
    from kdlib import perf

    out = {}
    for suite in SUITES:
        r = perf.load(suite, gpu)
        if r is not None:
            out[suite] = r
    return out


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares y = a + b x; None when under-determined."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


# The kernels of a MoE layer that the moe suite makes outside its timing (router top-k, the sort by expert and
# its offsets: kdlib/perf/suites/moe.py); the calibrated per-layer latency adds them at kernel_latency_s each.
ROUTING_KERNELS = 3


def _calibrate_moe(a: Assumptions, moe: dict, spec: dict, arm: str, notes: list) -> Assumptions:
    """The MoE's streaming fit on the arm's CUDA-graph replays where recorded (a step replays a graph), else
    on its eager calls, whose intercept then holds the host's launches too (the bf16 baseline has only
    those)."""
    src = moe.get("_path", "moe result")
    pick = {"kernel": {"op": "moe_w4a16", "variant": "default"},
            "kernel_v1": {"op": "moe_w4a16", "variant": "", "version": 1},
            "baseline": {"op": "moe_bf16_grouped_mm"}}[arm]
    recorded = Recorded(moe, moe_rows(moe))
    rows, how = recorded.select(**pick, mode="graph"), "graph replays"
    if not rows:
        rows, how = recorded.select(**pick, mode="eager"), "eager calls (the host's launches included)"
    if arm == "kernel" and rows:
        versions = sorted({r.version for r in rows}, key=lambda v: (v is None, v or 0))
        arm = "kernel (default: " + ", ".join("mixed" if v is None else f"v{v}" for v in versions) + ")"
    pts = [(r.shape["m"], r.bytes, r.median_ms * 1e-3, r.flops) for r in rows]
    if not pts:
        notes.append(f"moe: no '{arm}' rows in {src}; MoE assumptions left at their defaults")
        return a
    bw, fl = spec["hbm_bandwidth_Bps"], spec["bf16_dense_flops"]
    stream = [p for p in pts if p[0] <= 64]          # weight-streaming regime (< ~1/4 of the knee)
    fit = _fit_line([p[1] for p in stream], [p[2] for p in stream])
    changes = {}
    if fit and fit[1] > 0:
        lat, slope = fit
        eff = 1.0 / (slope * bw)
        changes["moe_bw_eff"] = (eff, f"fit t = lat + bytes / (eff x {bw / 1e12:.2f} TB/s) on the {arm} "
                                      f"{how} with M <= 64 of {src}")
        routing = ROUTING_KERNELS * a.v("kernel_latency_s")
        changes["moe_layer_latency_s"] = (
            max(0.0, lat) + routing,
            f"intercept of the same fit ({how}, {src}) + {ROUTING_KERNELS} routing kernels outside the "
            f"suite's timing x kernel_latency_s ({routing * 1e6:.3g} us)")
    else:
        notes.append(f"moe: the {arm} {how} with M <= 64 do not determine a streaming fit")
    comp = max(p[3] / (p[2] * fl) for p in pts)
    changes["moe_compute_eff"] = (comp, f"largest useful FLOP rate / bf16 peak over the {arm} {how} of {src}")
    notes.append(f"moe ({arm}, {how}): " + ", ".join(f"{k} = {v[0]:.3g}" for k, v in changes.items()))
    return a.with_(**changes)


def _median(xs):
    return statistics.median(xs) if xs else None


def _attention_changes(points: list[tuple], spec: dict, src: str) -> dict:
    """attn_bw_eff and attn_compute_eff: the medians of bytes / (s x peak) over the memory-bound points and of
    FLOPs / (s x peak) over the compute-bound ones; points: (bytes, FLOPs, seconds, bound)."""
    bw, fl = spec["hbm_bandwidth_Bps"], spec["bf16_dense_flops"]
    mem = [b / (t * bw) for b, f, t, bound in points if bound == "memory"]
    comp = [f / (t * fl) for b, f, t, bound in points if bound != "memory"]
    changes = {}
    if mem:
        changes["attn_bw_eff"] = (_median(mem), f"median over memory-bound verify-attention points of {src}")
    if comp:
        changes["attn_compute_eff"] = (_median(comp),
                                       f"median over compute-bound verify-attention points of {src}")
    return changes


def _calibrate_attention(a: Assumptions, doc: dict, spec: dict, notes: list) -> Assumptions:
    """Attention efficiencies from the attention suite: the whole verify (prefix + tail + merge) of its first
    kernel, the default it records as its headline, at every point; bound by the spec's ridge point."""
    src = doc.get("_path", "attention result")
    params = doc.get("parameters") or {}
    impls = params.get("impls") or [None]
    version = attention_version(impls[0], params) if impls[0] else None
    bw, fl = spec["hbm_bandwidth_Bps"], spec["bf16_dense_flops"]
    rows = [r for r in attention_rows(doc)
            if version is not None and (r.op, r.version) == (VERIFY_OP, version)]
    points = [(r.bytes, r.flops, r.median_ms * 1e-3, "memory" if r.bytes / bw >= r.flops / fl else "compute")
              for r in rows]
    changes = _attention_changes(points, spec, f"{src} (the default kernel, version {version}, whole verify)")
    if not changes:
        notes.append(f"attention: no timed point of its default kernel in {src}; attention assumptions left "
                     "as they were")
        return a
    notes.append(f"attention (version {version}): "
                 + ", ".join(f"{k} = {v[0]:.3g}" for k, v in changes.items()))
    return a.with_(**changes)


def _calibrate_kernels(a: Assumptions, kernels: dict, spec: dict, notes: list,
                       attention: bool = True) -> Assumptions:
    """Tree-build costs, and with `attention` the attention efficiencies of its verify_attention sweep (the
    kernel the suite ran, an early one: the attention suite's default kernel replaces it where recorded)."""
    # here, not at the top: the estimator imports no numpy (test_config), and kdlib.cuda.tree does
    from kdlib.cuda.tree import DEFAULT_VERSION as TREE_DEFAULT_VERSION

    src = kernels.get("_path", "kernels result")
    att = ((kernels.get("verify_attention") or {}).get("points") or []) if attention else []
    changes = _attention_changes(
        [(p["bytes"], p["flops"], p["kernel"]["median_ms"] * 1e-3, p.get("bound")) for p in att
         if (p.get("kernel") or {}).get("median_ms") and "bytes" in p and "flops" in p], spec, src)
    # the default builder's rows (rows without a version predate the others)
    builds = [b for b in kernels.get("tree_build") or [] if b.get("version", TREE_DEFAULT_VERSION)
              == TREE_DEFAULT_VERSION]
    if builds:
        small = min(builds, key=lambda b: b.get("batch", 1e9))
        big = max(builds, key=lambda b: b.get("batch", 0))
        if small.get("graph_replay_us"):
            changes["tree_build_gpu_s"] = (small["graph_replay_us"] * 1e-6,
                                           f"GPU builder (version {TREE_DEFAULT_VERSION}) graph replay at "
                                           f"batch {small.get('batch')} ({src})")
        if big.get("cpu_ref_us") and big.get("batch"):
            changes["tree_build_cpu_s_per_request"] = (
                big["cpu_ref_us"] * 1e-6 / big["batch"],
                f"CPU reference build / batch at batch {big['batch']} ({src})")
    if changes:
        notes.append("kernels: " + ", ".join(f"{k} = {v[0]:.3g}" for k, v in changes.items()))
        return a.with_(**changes)
    notes.append(f"kernels: no usable verify-attention or tree-build points in {src}")
    return a


def calibrate(results: dict, *, gpu: str = "h200", moe_arm: str = "kernel", a: Assumptions | None = None,
              report: bool = False):
    """Assumptions calibrated on component measurements (`moe`, `kernels`; `ceilings` noted).

    moe_arm: "kernel" (the library's default W4A16 kernel, the moe payload's `kernel_default`; for
    INT4 experts), "kernel_v1" (the first W4A16 kernel, its `kernel`) or "baseline" (torch bf16
    grouped GEMM: for a bf16 engine); `kdlib.perf.results.moe_rows` reads the arms. `tp` (NCCL
    all-reduce sweep) sets the all-reduce latency and bus efficiency. Efficiencies are relative to
    the spec peaks in `data/hw/<gpu>.json`, so they carry to other GPUs as fractions of peak.
    report=True also returns the notes.
    """
    if moe_arm not in MOE_ARMS:
        raise ValueError(f"moe_arm must be one of {MOE_ARMS}, got {moe_arm!r}")
    a = a or Assumptions()
    spec = hardware(gpu)
    notes = []
    if "ceilings" in results:
        c = results["ceilings"]
        notes.append(f"ceilings: copy {c.get('copy_bandwidth_Bps', 0) / 1e12:.2f} TB/s = "
                     f"{c.get('copy_bandwidth_Bps', 0) / spec['hbm_bandwidth_Bps']:.0%} of the spec peak")
        if c.get("bf16_matmul_flops"):  # the dense GEMMs' rate: the bf16 matmul the suite timed
            eff = c["bf16_matmul_flops"] / spec["bf16_dense_flops"]
            src = f"{c.get('_path', 'ceilings')}: bf16_matmul_flops / spec peak"
            a = a.with_(dense_compute_eff=(eff, src))
            notes.append(f"ceilings: bf16 matmul {c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s = {eff:.0%} of "
                         "the spec peak (dense_compute_eff)")
    if "moe" in results:
        a = _calibrate_moe(a, results["moe"], spec, moe_arm, notes)
    else:
        notes.append("moe: not recorded; MoE assumptions left at their defaults")
    if "kernels" in results:
        a = _calibrate_kernels(a, results["kernels"], spec, notes, attention="attention" not in results)
    else:
        notes.append("kernels: not recorded; tree-build assumptions left at their defaults")
    if "attention" in results:
        a = _calibrate_attention(a, results["attention"], spec, notes)
    elif "kernels" not in results:
        notes.append("attention: not recorded; attention assumptions left at their defaults")
    if "tp" in results:
        a = _calibrate_allreduce(a, results["tp"], spec, notes)
    else:
        notes.append("tp: not recorded; all-reduce assumptions left at their defaults")
    return (a, notes) if report else a


def _calibrate_allreduce(a: Assumptions, tp: dict, spec: dict, notes: list) -> Assumptions:
    """All-reduce latency and bus efficiency from the NCCL sweep's fit t = latency + ring bytes / bus
    bandwidth (kdlib.tp.workers.fit_allreduce), at the largest world size recorded: the sweep
    captured in a CUDA graph where recorded (how a serving step issues its collectives), else the
    eager one (which adds a Python launch per collective)."""
    src = tp.get("_path", "tp result")
    link = spec.get("interconnect") or {}
    graph, eager = ({int(w): f for w, f in (tp.get(key) or {}).items() if f.get("latency_s") is not None}
                    for key in ("allreduce_graph_fit", "allreduce_fit"))
    fits, how = (graph, "in a CUDA graph") if graph else (eager, "eager")
    if not fits or link.get("kind") != "nvlink":
        notes.append(f"tp: no all-reduce fit over NVLink in {src}; all-reduce assumptions left at their "
                     "defaults")
        return a
    w = max(fits)
    fit = fits[w]
    changes = {"allreduce_latency_nvlink_s": (  # a straight-line fit's intercept may fall below 0
        max(0.0, fit["latency_s"]), f"intercept of the NCCL all-reduce fit ({how}) at {w} GPUs, at least 0 "
                                    f"({src})")}
    if fit.get("bus_bandwidth_Bps"):
        eff = fit["bus_bandwidth_Bps"] / link["bandwidth_Bps_per_direction"]
        changes["allreduce_bw_eff"] = (eff, f"fit bus bandwidth {fit['bus_bandwidth_Bps'] / 1e9:.0f} GB/s "
                                            f"at {w} GPUs / "
                                            f"{link['bandwidth_Bps_per_direction'] / 1e9:.0f} GB/s "
                                            f"per direction ({src})")
    notes.append(f"tp ({w} GPUs, {how}): " + ", ".join(f"{k} = {v[0]:.3g}" for k, v in changes.items()))
    return a.with_(**changes)


# ----------------------------------------------------------------------------- the engine
_CTX = ("context", "context_len", "prompt_len", "prefix_len", "cache_len")
_STEP = ("step_ms", "median_step_ms", "mean_step_ms")
_ACC = ("mean_accepted", "accepted", "tau")


def _first(d: dict, keys, what: str):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    raise ValueError(f"engine row lacks {what} (looked for {list(keys)}; has {sorted(d)})")


def _phases(r: dict) -> dict:
    """Per-step phase ms: a dict of floats, of per-step lists (median taken), or totals / steps."""
    ph = r.get("phase_ms")
    if isinstance(ph, dict):
        return {k: statistics.median(v) if isinstance(v, list) else float(v)
                for k, v in ph.items() if v is not None}
    totals, steps = r.get("phase_totals_ms"), r.get("steps")
    if isinstance(totals, dict) and steps:
        return {k: float(v) / steps for k, v in totals.items()}
    return {}


def engine_rows(result: dict) -> list[dict]:
    """The engine payload's runs as {context, budget, concurrency, accepted, step_ms, phase_ms}."""
    runs = None
    for key in ("runs", "rows", "points", "ddtree"):
        if isinstance(result.get(key), list):
            runs = result[key]
            break
    if runs is None:
        raise ValueError(f"engine result has no list of runs (keys: {sorted(result)})")
    out = []
    for r in runs:
        if r.get("method", "ddtree") != "ddtree":
            continue
        step = _first(r, _STEP, "a step time")
        if isinstance(step, dict):
            step = step.get("median_ms")
        elif isinstance(step, list):
            step = statistics.median(step)
        out.append({
            "context": int(_first(r, _CTX, "a context length")),
            "budget": int(_first(r, ("budget",), "a budget")),
            "concurrency": int(r.get("concurrency", r.get("batch", 1))),
            "accepted": float(_first(r, _ACC, "an accepted length")),
            "block": int(r.get("block", r.get("draft_depth", r.get("budget")))),
            "step_ms": float(step),
            "phase_ms": _phases(r),
            # the engine suite's drafter is the noisy oracle (a table look-up); older payloads lack the
            # field but carry its error rate
            "drafter": r.get("drafter") or ("noisy_oracle" if r.get("p_wrong") is not None else "model"),
        })
    if not out:
        raise ValueError("engine result holds no DDTree runs")
    return out


_DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}


def engine_shape(result: dict) -> ModelShape:
    """The engine's model shape from the config its payload carries: tp 1, every weight in the dtype the
    run used (`parameters.dtype`; bfloat16 when a payload predates that field)."""
    params = result.get("parameters") or {}
    cfg = result.get("config") or (result.get("params") or {}).get("config") or params.get("config")
    if not isinstance(cfg, dict):
        raise ValueError("engine result carries no model config (looked for config, params.config, "
                         "parameters.config)")
    dtype = params.get("dtype", "bfloat16")
    if dtype not in _DTYPE_BITS:
        raise ValueError(f"engine result dtype {dtype!r} is not one of {sorted(_DTYPE_BITS)}")
    bits = _DTYPE_BITS[dtype]
    return ModelShape.from_config(cfg, tp=1, expert_bits=bits, dense_bits=bits)


def _scenario(row: dict) -> Scenario:
    q = row["budget"] + 1
    return Scenario(concurrency=row["concurrency"], q_len=q, block=max(1, row["block"]),
                    accepted=min(max(row["accepted"], 1.0), q), context=row["context"], tree_builder="cpu")


def calibrate_verify(a: Assumptions, engine: dict, shape: ModelShape, gpu="h200") -> tuple[Assumptions, str]:
    """Per-kernel and per-touched-expert latencies from the engine's verify-forward sweep (a component
    measurement: one target forward at contexts x rows, CUDA-event timed; its torch-attention rows in
    the run's dtype, the arm the runs use): least squares of
    (measured - modelled device time) on [layers x kernels, MoE layers x touched experts(q)]."""
    from kdlib.estimator.model import touched_experts

    # the arm the validated runs use: torch attention in the run's dtype (the CuPy-kernel arm pays
    # its own launch and interop costs, and is validated nowhere)
    dtype = (engine.get("parameters") or {}).get("dtype")
    rows = [r for r in engine.get("verify_forward") or [] if "median_ms" in r and "q" in r and "context" in r
            and r.get("attention", "torch") == "torch" and (dtype is None or r.get("dtype", dtype) == dtype)]
    if len(rows) < 3:
        return a, "engine verify_forward: fewer than 3 points; per-kernel latency left to the anchor run"
    base = a.with_(kernel_latency_s=(0.0, "zeroed to solve"),
                   moe_per_expert_latency_s=(0.0, "zeroed to solve"))
    xs0, xs1, ys = [], [], []
    for r in rows:
        sc = Scenario(1, int(r["q"]), 1, 1.0, int(r["context"]))
        st = step_time(gpu, sc, base, shape)
        device = st["moe"] + st["dense"] + st["attention"] + st["allreduce"]
        xs0.append(shape.n_layers * a.v("kernels_per_layer"))
        xs1.append(shape.n_moe_layers * touched_experts(sc.m, shape.n_experts, shape.top_k))
        ys.append(r["median_ms"] * 1e-3 - device)
    # two-feature least squares without intercept (normal equations)
    s00 = sum(x * x for x in xs0)
    s01 = sum(x * y for x, y in zip(xs0, xs1, strict=True))
    s11 = sum(y * y for y in xs1)
    b0 = sum(x * y for x, y in zip(xs0, ys, strict=True))
    b1 = sum(x * y for x, y in zip(xs1, ys, strict=True))
    det = s00 * s11 - s01 * s01
    if det <= 0:
        return a, "engine verify_forward: points do not separate per-kernel and per-expert costs"
    k_lat = (b0 * s11 - b1 * s01) / det
    e_lat = (s00 * b1 - s01 * b0) / det
    if k_lat < 0 or e_lat < 0:      # keep the fit physical: refit the one that is positive alone
        k_lat, e_lat = (max(0.0, b0 / s00), 0.0) if k_lat >= e_lat else (0.0, max(0.0, b1 / s11))
    src = engine.get("_path", "engine result")
    a = a.with_(kernel_latency_s=(k_lat, f"fit on the verify_forward sweep of {src} ({len(rows)} points)"),
                moe_per_expert_latency_s=(e_lat, f"fit on the verify_forward sweep of {src}"))
    return a, f"engine verify_forward: kernel_latency_s = {k_lat:.3g}, moe_per_expert_latency_s = {e_lat:.3g}"


def for_drafter(a: Assumptions, row: dict) -> Assumptions:
    """`a` for the row's drafter: a noisy oracle runs no drafter forward (its draft phase is host
    work only), so its drafter layers are zero; a model drafter keeps the assumed ones."""
    if row.get("drafter") == "noisy_oracle":
        return a.with_(draft_layers=(0, "noisy-oracle drafter: a table look-up, no drafter forward"))
    return a


def anchor_host_costs(a: Assumptions, row: dict, shape: ModelShape, gpu="h200", *,
                      verify: bool = True) -> Assumptions:
    """Set the host-side terms no component suite measures from one engine run: the per-layer
    launch latency (verify phase minus the modelled device terms), the drafter's host cost, the
    build cost per request, and accept + compaction as dispatch."""
    sc = _scenario(row)
    ph = row["phase_ms"]
    src = f"engine anchor run (context {row['context']}, budget {row['budget']})"
    changes = {}
    zero_fixed = a.with_(kernel_latency_s=(0.0, "zeroed to solve"), dispatch_s=(0.0, "zeroed"))
    st = step_time(gpu, sc, zero_fixed, shape)
    if verify and "verify" in ph:
        device = st["moe"] + st["dense"] + st["attention"] + st["allreduce"]
        per_kernel = max(0.0, ph["verify"] * 1e-3 - device) / (shape.n_layers * a.v("kernels_per_layer"))
        changes["kernel_latency_s"] = (per_kernel,
                                       f"{src}: (verify - modelled device time) / (layers x kernels)")
    if "draft" in ph:
        # the drafter's launches pay the per-kernel latency just solved; the rest is host time
        a_k = a.with_(**{k: v for k, v in changes.items() if k == "kernel_latency_s"}) if changes else a
        st_k = step_time(gpu, sc, a_k.with_(draft_host_s=(0.0, "zeroed to solve")), shape)
        changes["draft_host_s"] = (max(0.0, ph["draft"] * 1e-3 - st_k["draft"]),
                                   f"{src}: draft phase - modelled drafter device and launch time")
    if "build" in ph:
        changes["tree_build_cpu_s_per_request"] = (ph["build"] * 1e-3 / sc.concurrency, f"{src}: build phase")
    host = sum(ph.get(k, 0.0) for k in ("accept", "compaction"))
    if host:
        changes["dispatch_s"] = (host * 1e-3, f"{src}: accept + compaction phases")
    return a.with_(**changes)


def validate(a: Assumptions, engine: dict, *, gpu="h200", anchor: int = 0, shape: ModelShape | None = None,
             notes: list | None = None) -> list[dict]:
    """Predicted vs measured engine step time per run.

    The verify forward's launch costs come from the engine's verify-forward sweep when it holds
    >= 3 points (`calibrate_verify`); `anchor` (an index into the runs, ordered by context, budget,
    concurrency, acceptance) is the one run that sets the host-side phases (draft, build, accept + compaction,
    and the verify launch cost when no sweep is recorded). Each row: context, budget, accepted,
    measured_ms, predicted_ms, residual (predicted / measured - 1), device_ms (the predicted
    device work: MoE, dense, attention, all-reduce, less the MoE's launch latencies; the rest is
    launch and host time), role
    ('anchor' / 'held out'), and the prediction from `a` alone (components_only_*)."""
    rows = sorted(engine_rows(engine),
                  key=lambda r: (r["context"], r["budget"], r["concurrency"], r["accepted"]))
    if not 0 <= anchor < len(rows):
        raise ValueError(f"anchor {anchor} out of range for {len(rows)} engine runs")
    shape = shape or engine_shape(engine)
    a_v, note = calibrate_verify(a, engine, shape, gpu)
    if notes is not None:
        notes.append(note)
    anchored = anchor_host_costs(for_drafter(a_v, rows[anchor]), rows[anchor], shape, gpu, verify=a_v is a)
    no_launch = anchored.with_(moe_layer_latency_s=(0.0, "zeroed: device work alone"),
                               moe_per_expert_latency_s=(0.0, "zeroed: device work alone"))
    out = []
    for i, r in enumerate(rows):
        st = step_time(gpu, _scenario(r), for_drafter(anchored, r), shape)
        dev = step_time(gpu, _scenario(r), for_drafter(no_launch, r), shape)
        pure = step_time(gpu, _scenario(r), for_drafter(a, r), shape)
        out.append({
            "context": r["context"], "budget": r["budget"], "concurrency": r["concurrency"],
            "accepted": r["accepted"], "measured_ms": r["step_ms"], "predicted_ms": st["total"] * 1e3,
            "residual": st["total"] * 1e3 / r["step_ms"] - 1.0,
            "device_ms": (dev["moe"] + dev["dense"] + dev["attention"] + dev["allreduce"]) * 1e3,
            "components_only_ms": pure["total"] * 1e3,
            "components_only_residual": pure["total"] * 1e3 / r["step_ms"] - 1.0,
            "role": "anchor" if i == anchor else "held out",
        })
    return out


def assumptions_diff(before: Assumptions, after: Assumptions) -> list[dict]:
    """The parameters calibration changed: name, default, calibrated, source."""
    rows = []
    for name in before.names():
        b, c = getattr(before, name), getattr(after, name)
        if b != c:
            rows.append({"name": name, "default": b.value, "calibrated": c.value, "unit": c.unit,
                         "source": c.source})
    return rows


def _bench_shape_and_drafter(a: Assumptions) -> tuple[ModelShape, Assumptions, int]:
    """The engine_batch bench model (kdlib.perf.bench_model.BENCH_CONFIG, bf16, one GPU) as a ModelShape,
    `a` with its DFlash drafter's layers and per-layer parameters (DFlashConfig.for_target at the suite's
    block: q/k/v/o projections at hidden width + a gated MLP), and that block size."""
    from kdlib.engine.config import ModelConfig
    from kdlib.engine.drafter import DFlashConfig

    shape = ModelShape.from_config(BENCH_CONFIG, tp=1, expert_bits=16, dense_bits=16)
    d = DFlashConfig.for_target(ModelConfig.from_dict(BENCH_CONFIG), block_size=BLOCK)
    per_layer = 4 * d.hidden_size ** 2 + 3 * d.hidden_size * d.intermediate_size
    src = "DFlashConfig.for_target(BENCH_CONFIG) of kdlib.perf.suites.engine_batch's bench drafter"
    return shape, a.with_(draft_layers=(d.num_layers, src), draft_layer_params=(per_layer, src)), BLOCK


DEVICE_TERMS = ("moe", "dense", "attention", "draft", "tree", "fixed")
# the per-kernel and per-layer latencies of the step model (the MoE's, the drafter's kernels, `fixed`)
LATENCY_TERMS = ("moe_layer_latency_s", "moe_per_expert_latency_s", "kernel_latency_s")


def validate_batch(a: Assumptions, doc: dict, *, gpu="h200") -> list[dict]:
    """Predicted vs measured step of every `bench` row of an engine_batch result (the 8-layer model, bf16,
    one CUDA-graph replay per step), from `a` alone: nothing is fitted on these rows.

    A graph step has no host work inside it, so the drafter's host cost is zero and every term but
    `dispatch` is device time; AR rows have no draft and no tree build. Each row: context, method, budget,
    streams, accepted, measured_ms / measured_device_ms (wall step and profiler device time),
    predicted_ms / predicted_device_ms, residual and device_residual (predicted / measured - 1), fixed_ms
    (the per-kernel term, layers x kernels_per_layer x kernel_latency_s), the measured device time the
    model leaves unexplained beyond its bytes/FLOP terms and the tree build's measured time
    (unexplained_device_ms: every latency term, `LATENCY_TERMS`, counted as unexplained: what per-kernel
    costs would have to cover), and, where the row counts its kernels, that time per kernel."""
    shape, a, block = _bench_shape_and_drafter(a)
    a = a.with_(draft_host_s=(0.0, "inside the CUDA graph: no host work per drafter call"))
    lean = a.with_(**{n: (0.0, "left out of the bytes/FLOP terms") for n in LATENCY_TERMS})
    out = []
    for r in doc.get("bench") or []:
        dd = r["method"] == "ddtree"
        q = r["budget"] + 1 if dd else 1
        sc = Scenario(concurrency=r["streams"], q_len=q, block=block if dd else 1,
                      accepted=min(max(r["mean_accepted"], 1.0), q), context=r["context"], tree_builder="gpu")
        st = step_time(gpu, sc, a, shape)
        terms = {c: st[c] for c in DEVICE_TERMS if dd or c not in ("draft", "tree")}
        device = sum(terms.values()) * 1e3
        total = device + st["dispatch"] * 1e3
        dev = float(r["device_ms"]) if r.get("device_ms") is not None else float("nan")
        kern = r.get("kernels_per_step")
        unexplained = dev - sum(step_time(gpu, sc, lean, shape)[c] for c in terms) * 1e3
        out.append({
            "context": r["context"], "method": r["method"], "budget": r["budget"], "streams": r["streams"],
            "accepted": r["mean_accepted"], "measured_ms": r["step_ms"], "measured_device_ms": dev,
            "predicted_ms": total, "predicted_device_ms": device, "residual": total / r["step_ms"] - 1.0,
            "device_residual": device / dev - 1.0 if dev == dev else float("nan"),
            "fixed_ms": terms["fixed"] * 1e3, "unexplained_device_ms": unexplained,
            "kernels_per_step": kern, "unexplained_us_per_kernel": unexplained * 1e3 / kern if kern else None,
        })
    if not out:
        raise ValueError("engine_batch result holds no bench rows")
    return out


# ----------------------------------------------------------------------------- one rank layer, piece by piece
def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """m x = v by Gaussian elimination with partial pivoting (a few unknowns); None when m is singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[piv][c]) < 1e-300:
            return None
        a[c], a[piv] = a[piv], a[c]
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            for k in range(c, n + 1):
                a[r][k] -= f * a[c][k]
    x = [0.0] * n
    for c in range(n - 1, -1, -1):
        x[c] = (a[c][n] - sum(a[c][k] * x[k] for k in range(c + 1, n))) / a[c][c]
    return x


def _fit_relative(xs: list[list[float]], ys: list[float], lower: list[float]) -> list[float]:
    """c minimising sum(((sum_j c_j x_j - y) / y)^2) subject to c_j >= lower_j: the least squares of the
    relative residuals with lower bounds, solved exactly by trying every set of coefficients held at their
    bound (a convex problem's optimum is the best feasible one of those reduced fits; a few unknowns).
    xs[j]: the j-th regressor over the rows. A regressor that is zero on every row stays at its bound."""
    n, w = len(xs), [1.0 / y ** 2 for y in ys]

    def dot(a, b):
        return sum(wi * ai * bi for wi, ai, bi in zip(w, a, b, strict=True))

    def loss(c):
        return sum(wi * (sum(cj * x[i] for cj, x in zip(c, xs, strict=True)) - y) ** 2
                   for i, (wi, y) in enumerate(zip(w, ys, strict=True)))

    live = [j for j in range(n) if any(v != 0.0 for v in xs[j])]
    best = None
    for mask in range(1 << len(live)):
        free = [j for k, j in enumerate(live) if mask >> k & 1]
        c = list(lower)
        if free:
            held = [j for j in range(n) if j not in free]
            resid = [y - sum(lower[j] * xs[j][i] for j in held) for i, y in enumerate(ys)]
            sol = _solve([[dot(xs[j], xs[k]) for k in free] for j in free], [dot(xs[j], resid) for j in free])
            if sol is None or any(s < lower[j] for s, j in zip(sol, free, strict=True)):
                continue
            for s, j in zip(sol, free, strict=True):
                c[j] = s
        if best is None or loss(c) < loss(best):
            best = c
    return best


def moe_piece(cfg, m: int, bound_factor: float = 4.0) -> str:
    """The MoE layer's `RANK_PIECES` name at m rows: "moe", or "moe_wide" where the expert launch bound
    (`count_bound` at the rank's default factor) passes MOE_NARROW_BOUND and moe_w4a16 runs version 1."""
    from kdlib.engine.int4 import MOE_NARROW_BOUND, count_bound

    bound = count_bound(m, cfg.num_experts_per_tok, cfg.n_routed_experts, bound_factor)
    return "moe_wide" if bound > MOE_NARROW_BOUND else "moe"


def rank_piece(row: dict, cfg) -> str:
    """The `RANK_PIECES` name of a k2_layer row (cfg: the rank's model config): its piece, the AR commit
    apart ("commit_ar": no drafter), the MoE by its launch (`moe_piece`)."""
    if row["piece"] == "moe":
        return moe_piece(cfg, row["m_rows"])
    return "commit_ar" if row["piece"] == "commit" and row["method"] == "ar" else row["piece"]


def calibrate_rank_layer(a: Assumptions, doc: dict, *, gpu="h200") -> RankLayerTerms:
    """The rank's per-piece terms from a recorded k2_layer suite (kdlib/perf/suites/k2_layer.py: the rank's
    layers, each piece timed alone as a CUDA-graph replay at the k2_rank grid's M and contexts, a layer's
    piece over several layers in one graph, its rows per call).

    Per piece (`rank_piece`), over its rows: time - the suite's graph overhead over the row's calls in its
    graph (`layers_per_graph`; 1 where a file has none, the one-layer form) = kernels x kernel_s + bytes
    / (HBM peak x mem_eff) + FLOPs / (bf16 peak x comp_eff), the peaks of `gpu`'s spec (the row's bytes and
    FLOPs, `kdlib.perf.rank_work.piece_work`'s, but the attention's: what its kernels execute,
    `rank_work.attention_executed` at the row's shape, as `rank_step_time` evaluates it), fit by least
    squares of the relative residuals (`_fit_relative`: kernel_s >= 0, both efficiencies <= 1: no piece
    beats a peak); the kernels per call at each M are the median of the piece's rows at that M (the
    profile). `a` (calibrated on the component suites: the all-reduce) is kept for the rest. The attention
    also gets its plan-form terms on this GPU (`AttentionPlanTerms`, `_fit_attention_plan`): one set of
    efficiencies cannot follow a plan whose jobs fill the SMs at one shape and a few of them at another. The
    rank's step is `kdlib.estimator.model.rank_step_time`."""
    from kdlib import memory
    from kdlib.engine.config import ModelConfig
    from kdlib.engine.rank import RankShape
    from kdlib.perf import rank_work

    par = doc["parameters"]
    shape = RankShape(ModelConfig.from_dict(memory.load_config(par.get("config", SHAPE_CONFIG))),
                      tp=int(par["tp"]), rank=0, moe_mode=par["moe_mode"])

    def work(r):
        if r["piece"] != "attention":
            return r["bytes"], r["flops"]
        w = rank_work.attention_executed(shape, r["streams"], r["rows_per_stream"], r["context"])
        return w["bytes"], w["flops"]

    spec = hardware(gpu)
    bw, fl = spec["hbm_bandwidth_Bps"], spec["bf16_dense_flops"]
    src = doc.get("_path", "k2_layer result")
    over = max(0.0, doc["graph_overhead"]["overhead_ms"] * 1e-3)
    by_piece: dict[str, list[dict]] = {}
    for r in doc.get("rows") or []:
        by_piece.setdefault(rank_piece(r, shape.cfg), []).append(r)
    pieces = {}
    def over_of(r):  # a row's share of its graph's replay overhead (none eager)
        return over * (r["mode"] == "graph") / r.get("layers_per_graph", 1)

    for p in RANK_PIECES:
        rows = [r for r in by_piece.get(p, []) if r["median_ms"] * 1e-3 > over_of(r)]
        if not rows:
            continue
        ys = [r["median_ms"] * 1e-3 - over_of(r) for r in rows]
        ks = [float(r["kernels"]) for r in rows]
        bf = [work(r) for r in rows]
        c0, c1, c2 = _fit_relative([ks, [b / bw for b, _ in bf], [f / fl for _, f in bf]], ys,
                                   [0.0, 1.0, 1.0])
        fit = (f"k2_layer ({src}): least squares of the relative residuals of (time - its share of the "
               f"graph overhead) = kernels x kernel_s + bytes / (peak x mem_eff) + FLOPs / (peak x comp_eff) "
               f"over its {len(rows)} '{p}' rows, against the {spec.get('slug', gpu)} spec peaks")
        ms = sorted({int(r["m_rows"]) for r in rows})
        kernels = tuple((m, statistics.median(k for r, k in zip(rows, ks, strict=True) if r["m_rows"] == m))
                        for m in ms)
        pieces[p] = PieceTerms(
            kernel_s=Param(c0, "s per kernel", fit), mem_eff=Param(1.0 / c1, "fraction of HBM peak", fit),
            comp_eff=Param(1.0 / c2, "fraction of bf16 peak", fit),
            kernels=kernels, kernels_source=f"median kernels per call of the '{p}' rows at each M "
                                            f"(kdlib.perf.profile) of {src}")
    return RankLayerTerms(
        pieces=pieces, moe_mode=doc["parameters"]["moe_mode"], a=a, tp=int(doc["parameters"]["tp"]),
        graph_overhead_s=Param(over, "s per graph replay",
                               f"one-kernel graph replay minus its kernel's device time ({src})"),
        attention_plan=_fit_attention_plan(
            shape, [(r, r["median_ms"] * 1e-3 - over_of(r)) for r in by_piece.get("attention", [])],
            doc.get("provenance", {}).get("sm_count"), spec.get("slug", gpu), src))


def _fit_attention_plan(shape, rows: list[tuple[dict, float]], grid, gpu: str, src: str):
    """`AttentionPlanTerms` from k2_layer's attention rows (row, seconds less its share of the graph
    overhead), by least squares of the relative residuals, every term >= 0; None without the SM count the
    plan needs or without more rows than unknowns (the terms and the fixed time a layer: a fit that
    could pass through every row exactly)."""
    from kdlib.perf import rank_work

    rows = [(r, y) for r, y in rows if y > 0]
    if not grid or len(rows) <= len(ATTENTION_PLAN_TERMS) + 1:
        return None
    plans = [rank_work.attention_plan(shape, r["streams"], r["rows_per_stream"], r["context"], int(grid))
             for r, _ in rows]
    xs = [[1.0] * len(plans)] + [[float(pl[t]) for pl in plans] for t in ATTENTION_PLAN_TERMS]
    c = _fit_relative(xs, [y for _, y in rows], [0.0] * len(xs))
    fit = (f"k2_layer ({src}): least squares of the relative residuals of its {len(rows)} attention rows "
           f"(time - its share of the graph overhead) against the plan's work at {grid} CTAs "
           f"(rank_work.attention_plan), every term >= 0")
    return AttentionPlanTerms(gpu=gpu, grid=int(grid), fixed_s=Param(c[0], "s per layer", fit),
                              per={t: Param(v, f"s per {t}", fit)
                                   for t, v in zip(ATTENTION_PLAN_TERMS, c[1:], strict=True)})


def validate_rank(terms: RankLayerTerms, doc: dict, *, gpu="h200") -> list[dict]:
    """Predicted (`rank_step_time`, from `terms` alone) vs measured step of every grid row of a k2_rank
    payload (the rows torch.compile ran; the plain baseline rows left out): context, streams, method,
    budget, m_rows, measured_ms (graph step + its modelled all-reduce), predicted_ms, residual (predicted /
    measured - 1), each component predicted / measured (dense, attention, moe over k2_rank's pieces),
    kernels measured and predicted per step, and moe_bound_overflows (> 0: the measured MoE dropped slots,
    a lower bound)."""
    from kdlib.estimator.model import rank_step_time

    out = []
    for r in doc.get("rows") or []:
        if not r.get("compiled", True):
            continue
        st = rank_step_time(gpu, terms, r["streams"], r["rows_per_stream"], r["context"], bool(r["budget"]))
        meas = r["step_with_allreduce_ms"]
        row = {"context": r["context"], "streams": r["streams"], "method": r["method"], "budget": r["budget"],
               "m_rows": r["m_rows"], "measured_ms": meas, "predicted_ms": st["total"] * 1e3,
               "residual": st["total"] * 1e3 / meas - 1,
               "kernels_measured": (r.get("profile") or {}).get("kernels_per_step"),
               "kernels_predicted": st["kernels"], "moe_bound_overflows": r["moe_bound_overflows"]}
        for p in ("dense", "attention", "moe"):
            row[f"{p}_ratio"] = st[p] * 1e3 / r["pieces"][p]["median_ms"]
        out.append(row)
    return out


__all__ = ["DEVICE_TERMS", "Param", "anchor_host_costs", "assumptions_diff", "calibrate", "calibrate_verify",
           "calibrate_rank_layer", "engine_rows", "engine_shape", "for_drafter", "load_results", "rank_piece",
           "validate", "validate_batch", "validate_rank"]
