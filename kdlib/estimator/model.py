"""The step-time model: one verify step of tree speculative decoding on one GPU of a TP group.

    t_step = moe + dense + attention + draft + tree + dispatch + allreduce + fixed

- moe: per MoE layer, max(touched-expert bytes / (BW x eff), useful FLOPs / (bf16 x eff)) + a
  per-layer latency, with M = concurrency x q_len tokens and touched experts
  E(M) = E (1 - (1 - k/E)^M) (uniform routing): weight streaming below M ~ 256, a plateau of all
  experts above it, compute only at M in the thousands (kernels-perf.md §5).
- dense: the weights every step streams besides the routed experts (MLA projections, router,
  shared experts, dense layer, lm_head), as plain TP places them (`ModelShape.dense_params_per_gpu`).
- attention: MLA latent cache of every request read once per layer (replicated under TP), or the
  tree queries' FLOPs if those bind (kernels-perf.md §7).
- draft: the block drafter's weights (+ the shared lm_head) for `block` tokens per stream.
- tree: CPU heapq per request, or one GPU kernel per step.
- dispatch: host cost per step; allreduce: ~2 per layer, the embedding's, and the drafter's (its
  embedding, ~2 per draft layer, its input fc), each latency + ring bytes / link bandwidth;
  fixed: kernels per layer x a per-kernel latency.
Throughput = accepted / t_step per stream; x concurrency in aggregate. `project` also sets the KV tokens
a scenario holds against the pool one GPU has for them (`kv_capacity`): a row past it is not a deployment.
"""

from __future__ import annotations

import math

from kdlib import hw, memory
from kdlib.estimator.params import SHAPE_CONFIG, Assumptions, ModelShape, RankLayerTerms, Scenario

COMPONENTS = ("moe", "dense", "attention", "draft", "tree", "dispatch", "allreduce", "fixed")


def hardware(gpu) -> dict:
    """A spec dict from `data/hw/` (by slug), or the dict itself when one is given (its rates positive and
    finite, its interconnect of a kind `kdlib.hw` knows)."""
    if not isinstance(gpu, dict):
        return hw.load(gpu)
    for key in ("hbm_bandwidth_Bps", "bf16_dense_flops", "interconnect"):
        if key not in gpu:
            raise ValueError(f"hardware spec lacks {key!r}")
    link = gpu["interconnect"]
    rates = {"hbm_bandwidth_Bps": gpu["hbm_bandwidth_Bps"], "bf16_dense_flops": gpu["bf16_dense_flops"],
             "interconnect.bandwidth_Bps_per_direction": link.get("bandwidth_Bps_per_direction")}
    for key, v in rates.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
            raise ValueError(f"hardware spec {key} must be a positive finite number, got {v!r}")
    if link.get("kind") not in hw.INTERCONNECT_KINDS:
        raise ValueError(f"hardware spec interconnect kind {link.get('kind')!r} not in "
                         f"{hw.INTERCONNECT_KINDS}")
    return gpu


def touched_experts(m: float, n_experts: int, top_k: int) -> float:
    """Expected distinct experts hit by m tokens with uniform top-k routing."""
    if m < 0:
        raise ValueError(f"m must be >= 0, got {m}")
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** m)


def moe_layer(m: float, gpu, a: Assumptions | None = None, shape: ModelShape | None = None) -> dict:
    """One MoE layer on one GPU: bytes, FLOPs, the physical floor at peak, and the modelled time (s)."""
    a, shape, spec = a or Assumptions(), shape or ModelShape(), hardware(gpu)
    touched = touched_experts(m, shape.n_experts, shape.top_k)
    weight = touched * shape.expert_bytes() / shape.tp
    inter = shape.moe_inter / shape.tp
    act = m * shape.hidden * (2 + 4) + 2 * m * shape.top_k * inter * 2
    flops = 2.0 * m * shape.top_k * 3 * shape.hidden * inter
    bw, fl = spec["hbm_bandwidth_Bps"], spec["bf16_dense_flops"]
    mem_s = (weight + act) / (bw * a.v("moe_bw_eff"))
    comp_s = flops / (fl * a.v("moe_compute_eff"))
    return {
        "m": m, "touched": touched, "bytes": weight + act, "flops": flops,
        "floor_s": max((weight + act) / bw, flops / fl),
        "time_s": max(mem_s, comp_s) + a.v("moe_layer_latency_s") + touched * a.v("moe_per_expert_latency_s"),
        "bound": "memory" if mem_s >= comp_s else "compute",
    }


def allreduce_s(nbytes: float, gpu, a: Assumptions, tp: int) -> float:
    """One ring all-reduce of `nbytes` over `tp` GPUs of `gpu`'s link: latency (the spec's, else the
    assumed NVLink / PCIe one) + 2 (tp - 1) / tp x bytes / (link bandwidth x allreduce_bw_eff)."""
    link = hardware(gpu)["interconnect"]
    lat = link.get("latency_s")
    if lat is None:
        lat = a.v("allreduce_latency_nvlink_s" if link["kind"] == "nvlink" else "allreduce_latency_pcie_s")
    bw = link["bandwidth_Bps_per_direction"] * a.v("allreduce_bw_eff")
    return lat + 2.0 * (tp - 1) / tp * nbytes / bw


def _roofline(nbytes: float, flops: float, bw: float, bw_eff: float, fl: float, fl_eff: float) -> float:
    return max(nbytes / (bw * bw_eff), flops / (fl * fl_eff))


def step_time(gpu, scenario: Scenario, a: Assumptions | None = None, shape: ModelShape | None = None) -> dict:
    """Seconds per verify step by component, their sum (`total`), and throughput.

    Returns {component: s, ..., 'total': s, 'tok_s_per_stream', 'tok_s'}.
    """
    a, shape, spec = a or Assumptions(), shape or ModelShape(), hardware(gpu)
    sc = scenario
    bw, fl = spec["hbm_bandwidth_Bps"], spec["bf16_dense_flops"]
    m = sc.m
    out = {}

    out["moe"] = shape.n_moe_layers * moe_layer(m, spec, a, shape)["time_s"]

    out["dense"] = _roofline(shape.dense_bytes_per_gpu(), 2.0 * m * shape.dense_params_per_gpu(),
                             bw, a.v("dense_bw_eff"), fl, a.v("dense_compute_eff"))

    kv = sc.concurrency * (sc.context + sc.q_len) * shape.latent_dim * a.v("kv_bytes_per_elem")
    attn_flops = (2.0 * sc.concurrency * shape.heads_per_gpu * sc.q_len * (sc.context + sc.q_len)
                  * (shape.latent_dim + shape.kv_lora_rank))
    out["attention"] = shape.n_layers * _roofline(kv, attn_flops, bw, a.v("attn_bw_eff"), fl,
                                                  a.v("attn_compute_eff"))

    draft_bytes = ((a.v("draft_layers") * a.v("draft_layer_params") * 2 + shape.vocab * shape.hidden * 2)
                   / shape.tp)
    draft_flops = 2.0 * sc.concurrency * sc.block * draft_bytes / 2
    out["draft"] = (_roofline(draft_bytes, draft_flops, bw, a.v("dense_bw_eff"), fl, a.v("dense_compute_eff"))
                    + a.v("draft_layers") * a.v("kernels_per_layer") * a.v("kernel_latency_s")
                    + a.v("draft_host_s"))

    out["tree"] = (sc.concurrency * a.v("tree_build_cpu_s_per_request") if sc.tree_builder == "cpu"
                   else a.v("tree_build_gpu_s"))
    out["dispatch"] = a.v("dispatch_s")

    if shape.tp > 1:  # as kdlib.engine.rank.step_allreduces: the embedding's and each layer's on the m rows;
        # the drafter's embedding and layers on its concurrency x block rows, its fc on the m rows
        def rows(n: float) -> float:
            return allreduce_s(n * shape.hidden * 2, spec, a, shape.tp)

        per_layer = a.v("allreduces_per_layer")
        out["allreduce"] = ((2 + shape.n_layers * per_layer) * rows(m)
                            + (1 + a.v("draft_layers") * per_layer) * rows(sc.concurrency * sc.block))
    else:
        out["allreduce"] = 0.0

    out["fixed"] = shape.n_layers * a.v("kernels_per_layer") * a.v("kernel_latency_s")
    total = sum(out[c] for c in COMPONENTS)
    out["total"] = total
    out["tok_s_per_stream"] = sc.accepted / total
    out["tok_s"] = sc.concurrency * sc.accepted / total
    return out


def rank_step_time(gpu, terms: RankLayerTerms, streams: int, rows_per_stream: int, context: int,
                   ddtree: bool, drafter=None, config: str = SHAPE_CONFIG) -> dict:
    """Seconds of one step of a TP rank from its per-piece terms (`calibrate_rank_layer`): the layers'
    pieces (first_k_dense_replace dense layers, the rest MoE: dense + norms, attention, MoE each), the
    step's head, commit and with `ddtree` the drafter's draft, tree and accept, each kernels(M) x kernel_s +
    bytes / (peak x mem_eff) + FLOPs / (peak x comp_eff) (`PieceTerms`, bytes and FLOPs from
    `kdlib.perf.rank_work.estimator_work` at these shapes: the attention's as its plan executes it), one graph
    replay's overhead, and the step's all-reduces (`kdlib.engine.rank.step_allreduces`, each `allreduce_s`
    from `terms.a`). On the GPU the terms were timed on, the attention follows its plan instead
    (`terms.attention_plan`, `AttentionPlanTerms`).

    drafter: the DDTree rows' `DraftShape` (None: DFLASH_KIMI); config: a shipped config name.
    Returns {dense, attention, moe (the step's, k2_rank's pieces), head, draft, tree, accept, commit,
    graph, allreduce, step (all but the all-reduce), total, kernels (predicted per step)}."""
    from kdlib import memory
    from kdlib.engine.config import ModelConfig
    from kdlib.engine.rank import DFLASH_KIMI, RankShape, step_allreduces
    from kdlib.estimator.calibration import moe_piece
    from kdlib.perf import rank_work

    spec = hardware(gpu)
    bw, fl = spec["hbm_bandwidth_Bps"], spec["bf16_dense_flops"]
    cfg = ModelConfig.from_dict(memory.load_config(config))
    shape = RankShape(cfg, tp=terms.tp, rank=0, moe_mode=terms.moe_mode)
    ds = (drafter or DFLASH_KIMI) if ddtree else None
    C, W = streams, rows_per_stream
    M = C * W
    work = rank_work.estimator_work(shape, ds, C, W, context)
    t, kern = {}, {}
    plan = terms.attention_plan
    for p, w in work.items():
        name = "commit_ar" if p == "commit" and not ddtree else moe_piece(cfg, M) if p == "moe" else p
        if name not in terms.pieces:
            raise ValueError(f"the rank's terms have no '{name}' piece (the layer suite measured "
                             f"{sorted(terms.pieces)})")
        pt = terms.pieces[name]
        kern[p] = pt.kernels_at(M)
        if p == "attention" and plan is not None and plan.gpu == spec.get("slug", gpu):
            t[p] = plan.time(rank_work.attention_plan(shape, C, W, context, plan.grid))
            continue
        t[p] = pt.seconds(kern[p], w["bytes"], w["flops"], bw, fl)
    L, n_dense = cfg.num_hidden_layers, cfg.first_k_dense_replace
    n = {"dense_first": n_dense, "dense": L - n_dense, "moe": L - n_dense, "attention": L}
    out = {"dense": n_dense * t["dense_first"] + (L - n_dense) * t["dense"] + t["head"],
           "attention": L * t["attention"], "moe": (L - n_dense) * t["moe"]}
    out.update({p: t[p] for p in ("head", "draft", "tree", "accept", "commit") if p in t})
    out["graph"] = terms.graph_overhead_s.value
    out["allreduce"] = sum(allreduce_s(b, spec, terms.a, terms.tp)
                           for b in step_allreduces(shape, M, C * ds.block_size if ds else 0, M, ds))
    out["step"] = (out["dense"] + out["attention"] + out["moe"] + out["graph"]
                   + sum(t[p] for p in ("draft", "tree", "accept", "commit") if p in t))
    out["total"] = out["step"] + out["allreduce"]
    out["kernels"] = sum(n.get(p, 1) * k for p, k in kern.items())
    return out


_KV_DTYPES = {2.0: "bfloat16", 1.0: "fp8_e4m3"}  # kv_bytes_per_elem -> kdlib.memory's KV dtype


def kv_capacity(gpu: str, sc: Scenario, a: Assumptions | None = None, tp: int = 8) -> dict:
    """The latent-cache tokens `sc` holds (concurrency x (context + q_len)) against the pool one GPU of a TP
    `tp` deployment of SHAPE_CONFIG has for them (`kdlib.memory.plan`: the latent replicated, SGLang's
    default memory fraction, the assumption's bytes per element): {kv_tokens, pool_tokens, fits}; the pool
    and fits None where kdlib.memory has no plan (another GPU file, bytes per element not 1 or 2)."""
    a = a or Assumptions()
    need = int(sc.concurrency * (sc.context + sc.q_len))
    dtype = _KV_DTYPES.get(float(a.v("kv_bytes_per_elem")))
    if dtype is None or gpu not in hw.slugs():
        return {"kv_tokens": need, "pool_tokens": None, "fits": None}
    # Scenario's counts are whole: a numpy int or a whole float (a pandas row's) is the int plan takes
    pool = memory.plan(SHAPE_CONFIG, gpu, tp, int(sc.context + sc.q_len), kv_dtype=dtype).value("pool_tokens")
    return {"kv_tokens": need, "pool_tokens": pool, "fits": need <= pool}


def project(gpus, scenarios, a: Assumptions | None = None, shape: ModelShape | None = None) -> list[dict]:
    """One row per (gpu, scenario): step ms, each component's ms and share, tok/s, dominant term; with the
    default shape (SHAPE_CONFIG's) and a gpu of kdlib.hw, the KV tokens against the pool (`kv_capacity`),
    else those three None."""
    rows = []
    for gpu in gpus:
        spec = hardware(gpu)
        for sc in scenarios:
            st = step_time(spec, sc, a, shape)
            row = {"gpu": spec.get("slug", spec.get("name", "?")), "scenario": sc.name,
                   "concurrency": sc.concurrency, "q_len": sc.q_len, "block": sc.block,
                   "accepted": sc.accepted, "context": sc.context, "m": sc.m,
                   "step_ms": st["total"] * 1e3, "tok_s_per_stream": st["tok_s_per_stream"],
                   "tok_s": st["tok_s"]}
            for c in COMPONENTS:
                row[f"{c}_ms"] = st[c] * 1e3
            row["dominant"] = max(COMPONENTS, key=lambda c: st[c])
            cap = (kv_capacity(gpu, sc, a, ModelShape().tp) if shape is None and isinstance(gpu, str)
                   else dict.fromkeys(("kv_tokens", "pool_tokens", "fits")))
            rows.append(row | cap)
    return rows


def sensitivity(gpu, scenario: Scenario, a: Assumptions | None = None, shape: ModelShape | None = None,
                factor: float = 2.0) -> list[dict]:
    """Tornado data: tok/s with each assumption divided and multiplied by `factor` (others fixed),
    plus the accepted length; sorted by the swing, largest first."""
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    a, shape = a or Assumptions(), shape or ModelShape()
    base = step_time(gpu, scenario, a, shape)["tok_s"]
    rows = []
    for name in a.names():
        up = min(factor, 1.0 / a.v(name)) if name.endswith("_eff") else factor  # an efficiency stops at 1
        lo = step_time(gpu, scenario, a.scaled(name, 1 / factor), shape)["tok_s"]
        hi = step_time(gpu, scenario, a.scaled(name, up), shape)["tok_s"]
        rows.append({"name": name, "low": lo, "high": hi, "base": base, "swing": abs(hi - lo)})
    acc_lo = max(1.0, scenario.accepted / factor)
    acc_hi = min(float(scenario.max_accepted), scenario.accepted * factor)  # a block-16 step commits <= 17
    rows.append({"name": "accepted (scenario)", "base": base, "swing": 0.0,
                 "low": base * acc_lo / scenario.accepted, "high": base * acc_hi / scenario.accepted})
    rows[-1]["swing"] = abs(rows[-1]["high"] - rows[-1]["low"])
    return sorted(rows, key=lambda r: -r["swing"])


def moe_curve(ms, gpu, a: Assumptions | None = None, shape: ModelShape | None = None) -> list[dict]:
    """The modelled MoE layer time and its floor against M (ms)."""
    rows = []
    for m in ms:
        r = moe_layer(m, gpu, a, shape)
        rows.append({"m": m, "touched": r["touched"], "bytes": r["bytes"], "flops": r["flops"],
                     "floor_ms": r["floor_s"] * 1e3, "model_ms": r["time_s"] * 1e3, "bound": r["bound"]})
    return rows


def knee_m(shape: ModelShape | None = None, fraction: float = 0.995) -> float:
    """M at which `fraction` of the experts are touched (the weight-streaming -> plateau knee)."""
    shape = shape or ModelShape()
    return math.log(1.0 - fraction) / math.log(1.0 - shape.top_k / shape.n_experts)
