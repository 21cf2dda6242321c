"""GPU suite `k2_layer`: the layers of the Kimi-K2.6 TP8 rank (`kdlib.engine.rank`), each piece timed alone.

    python3 -m kdlib.perf.run --suite k2_layer --out $OUT [--quick]
    env: K2_LAYER_BUDGET_S (seconds for the points, default 150), K2_LAYER_MOE (tp | ep, default tp)

The rank of the k2_rank suite cut to the dense first layer and LAYERS MoE layers (random weights on the
device, `RankModel.compile_pieces` as the k2_rank grid, uniform routing: no slot is dropped). At every
(context, streams C, budget) point of `kdlib.perf.suites.k2_rank.grid` (M = C x rows per stream, rows per
stream 1 for AR, budget + 1 for DDTree) each piece is captured into its own CUDA graph and replayed, CUDA
events around each replay, the L2 overwritten before each (`timing.l2_flush`: a layer's weights come cold
inside a whole step), the median kept. A layer's piece runs in its graph once for each of LAYERS layers
(`layers_of`: the MoE layers' own weights and latent cache; the dense first layer, the only one of its
kind, LAYERS times), as the step runs it layer after layer, so that the replay's fixed cost and the flushed
L2's write-back are shared by LAYERS calls as the step shares them by 61 (one layer a graph, the earlier
form, over-predicted the steps at 128 tokens: notebook 03b section 8b sets the two side by side); a row is
per call (replay / LAYERS):
  per layer  "dense_first" (layer 0: norms, MLA projections, dense MLP), "dense" (norms, MLA projections,
             shared expert), "attention" (latent rows written, tree-verify MLA over the context), "moe"
             (router, device routing, `moe_w4a16`)
  per step   "head" (`RankStep.prologue` + embedding rows + `RankStep.head`), and the step's other parts
             (`RankStep.parts`): "draft", "tree", "accept" (DDTree), "commit"; one call a graph
A piece that depends only on M (dense_first, dense, moe, head) is timed at the first point of each M, tree /
accept / commit at the first of each (C, rows per stream), attention and draft at every point.

Sections of the payload:
  parameters       config, tp, moe_mode, layers kept, layers_per_graph (LAYERS), accepted, p_top, iters,
                   quick, budget_s, routing
  ceilings         the recorded copy bandwidth and bf16 matmul rate the floors use (k2_rank's)
  setup            weight generation and first-compile seconds, the drafter, pool slots
  graph_overhead   a one-kernel graph's replay (same timing) and its kernel's device time: what each
                   piece's timing carries beyond its kernels, once per replayed graph
  rows             per piece and point: piece, layers (the model layers its graph ran), layers_per_graph,
                   context, streams, rows_per_stream, m_rows, budget, method, timing and median_ms (per
                   call), replay_ms (the whole graph), mode ('graph' or 'eager' where the capture failed,
                   with graph_error), kernels and device_ms (per call, `kdlib.perf.profile`), top_kernels
                   (per replay), bytes, flops (per call, `kdlib.perf.rank_work.piece_work`) and floor
                   (bytes / copy bandwidth, FLOPs / matmul rate)
  routing          per M: the MoE layer's slot sort alone (`device_routing`: the moe_routing_v1 kernel, one
                   launch) beside the torch counting sort it replaced (`routing_torch` under torch.compile,
                   as the rank compiled it until then), timed as the pieces (one call a graph)
  moe_bound_overflows   MoE calls (eager and replayed) whose busiest expert exceeded the launch bound (0
                   under uniform routing)
  cut              the k2_rank grid points not measured (time budget; the pool cut of k2_rank.grid)
The JSON is rewritten after every point, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import copy
import os
import time
from contextlib import nullcontext

from kdlib import memory
from kdlib.perf import profile, rank_work, results, timing
from kdlib.perf.suites import k2_rank
from kdlib.perf.timing import floor_ms

M_PIECES = ("dense_first", "dense", "moe", "head")  # depend on M alone
CW_PIECES = ("tree", "accept", "commit")  # depend on (C, rows per stream) alone
LAYERS = 8  # MoE layers of the cut model: a layer's piece runs once for each in its graph
ITERS = 20


def layer_config(cfg_dict: dict, moe_layers: int = LAYERS) -> dict:
    """The config with its layers cut to the dense first ones and `moe_layers` MoE layers."""
    d = copy.deepcopy(cfg_dict)
    t = d.get("text_config", d)
    t["num_hidden_layers"] = t["first_k_dense_replace"] + moe_layers
    return d


def layers_of(cfg) -> dict[str, tuple[int, ...]]:
    """{per-layer piece: the model layers its graph runs, in order} of a cut model (`layer_config`): the MoE
    layers' pieces over every MoE layer, the first dense layer's as many times."""
    moe = tuple(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    return {"dense_first": (0,) * len(moe), "dense": moe, "attention": moe, "moe": moe}


def graph_calls(layers: tuple[int, ...] | None) -> int:
    """A piece's calls in its graph: its layers (`layers_of`), or one for a step's piece (None)."""
    return 1 if layers is None else len(layers)


def piece_fns(step) -> dict:
    """{piece: callable} of one RankStep of the cut model after `step.run(save=True)` (the saved per-layer
    inputs feed the pieces, as in k2_rank's part-only forwards): each per-layer piece over its layers
    (`layers_of`), the head, the parts."""
    m = step.m
    cos, sin, slots = step.prologue()

    def dense(i):
        L, h = m.layers[i], step.x_saved[i]  # h [M, H]: a stand-in for the layer's input rows
        m.pre(L, h, cos, sin)
        h2, _, y, _ = m.post(L, h, step.o_saved[i])
        return h2 + y

    def head():
        step.prologue()
        step.head(m.embed_rows(step.tokens.reshape(-1)))

    def attention(i):
        step.attention(i, step.q_saved[i], step.rows_saved[i], slots)

    def moe(i):
        ids = None if step.route_ids is None else step.route_ids[i]
        m.routed(m.layers[i], step.f_saved[i], step.logits_saved[i], step.bound, step.overflow, ids)

    per_layer = {"dense_first": dense, "dense": dense, "attention": attention, "moe": moe}
    fns = {p: lambda f=per_layer[p], ls=ls: [f(i) for i in ls] for p, ls in layers_of(m.shape.cfg).items()}
    fns["head"] = head
    for p in step.parts():
        if p != "verify":
            fns[p] = lambda p=p: step.part(p)
    return {p: _scoped(fn, m.device.type == "cuda") for p, fn in fns.items()}


def _scoped(fn, cuda: bool):
    """fn under no_grad, with CuPy's launches on torch's current stream on CUDA (as `RankStep.run`)."""
    import torch

    from kdlib.engine.batch import cupy_on_torch_stream

    def call():
        with cupy_on_torch_stream() if cuda else nullcontext(), torch.no_grad():
            return fn()

    return call


def wanted(step, done_m: set, done_cw: set) -> list[str]:
    """The pieces of this point not yet measured (module docstring)."""
    out = [p for p in M_PIECES if step.M not in done_m] + ["attention"]
    if step.ddtree:
        out.append("draft")
    out += [p for p in CW_PIECES if (step.C, step.W) not in done_cw and (p == "commit" or step.ddtree)]
    return out


def measure(fn, flush, iters: int, calls: int = 1) -> dict:
    """One piece: captured (`timing.torch_graphs`, in a memory pool of its own, freed with the graph: a
    pool shared with graphs already freed fails the next capture inside torch's allocator), its replays
    timed with the L2 flushed before each, then profiled; eager calls where the capture fails (the error
    kept). fn makes `calls` calls of the piece: the timing, median_ms, kernels and device_ms are per call,
    replay_ms the whole of fn."""
    import torch

    try:
        (g,) = timing.torch_graphs(fn)
        run, mode, err = g.replay, "graph", None
    except Exception as e:  # noqa: BLE001 - a capture failure must not lose the point: timed eagerly
        torch.cuda.synchronize()
        run, mode, err = fn, "eager", f"{type(e).__name__}: {e}"[:300]
    t = timing.cuda_time(run, warmup=2, iters=iters, between=flush)
    prof = profile.device_profile(run, steps=2, top=5)
    per_call = {k: v / calls if k.endswith("_ms") else v for k, v in t.as_dict().items()}
    return {"timing": per_call, "median_ms": per_call["median_ms"], "replay_ms": t.median_ms, "mode": mode,
            "graph_error": err, "kernels": prof["kernels_per_step"] / calls,
            "device_ms": prof["device_ms"] / calls, "top_kernels": prof["top_kernels"]}


def piece_rows(step, timed: dict, ceil: dict) -> list[dict]:
    """The payload rows of one point: each timed piece with its layers (`layers_of`; None for the step's
    pieces), its work and floor per call (`rank_work.piece_work`)."""
    work = rank_work.piece_work(step.m.shape, step.d.ds if step.ddtree else None, step.C, step.W, step.ctx)
    layers = layers_of(step.m.shape.cfg)
    out = []
    for p, t in timed.items():
        w = work[p]
        ls = layers.get(p)
        out.append({"piece": p, "layers": None if ls is None else list(ls),
                    "layers_per_graph": graph_calls(ls), "context": step.ctx, "streams": step.C,
                    "rows_per_stream": step.W, "m_rows": step.M,
                    "budget": step.budget or None, "method": "ddtree" if step.ddtree else "ar", **t, **w,
                    "floor": floor_ms(w["bytes"], w["flops"], bandwidth_Bps=ceil["copy_bandwidth_Bps"],
                                      flop_rate=ceil["bf16_matmul_flops"])})
    return out


def routing_rows(step, baseline, flush, iters: int) -> list[dict]:
    """The MoE layer's slot sort at this point's M (module docstring, "routing"): impl "kernel"
    (`device_routing` on CUDA) and "torch_compiled" (`baseline`: `compiled_routing_torch`)."""
    from kdlib.engine.int4 import device_routing

    m, i = step.m, layers_of(step.m.shape.cfg)["moe"][0]
    L = m.layers[i]
    ids = None if step.route_ids is None else step.route_ids[i]
    w, idx = m.route(L, step.logits_saved[i], ids)  # [M, k] each
    impls = {"kernel": lambda: device_routing(idx, w, m.e0, m.n_local),
             "torch_compiled": lambda: baseline(idx, w, m.e0, m.n_local)}
    return [{"impl": name, "m_rows": step.M, "slots": idx.numel(), **measure(_scoped(fn, True), flush, iters)}
            for name, fn in impls.items()]


def compiled_routing_torch():
    """`routing_torch` compiled as the rank's routing piece was (Inductor, dynamic, whole graph)."""
    import torch

    from kdlib.engine.int4 import DeviceRouting, routing_torch

    def fn(ids, w, e0, n_local):
        rt = routing_torch(ids, w, e0, n_local)
        return tuple(getattr(rt, f) for f in DeviceRouting.__dataclass_fields__)

    return torch.compile(fn, dynamic=True, fullgraph=True)


def graph_overhead(flush, iters: int) -> dict:
    """A graph of one one-element add, timed as the pieces are, and its kernel's device time."""
    import torch

    x = torch.zeros(1, device="cuda")  # [1]
    t = measure(lambda: x.add_(1.0), flush, iters)
    return {"replay_ms": t["median_ms"], "kernel_device_ms": t["device_ms"], "kernels": t["kernels"],
            "overhead_ms": t["median_ms"] - t["device_ms"], "timing": t["timing"]}


def run(*, quick: bool = False, out: str | None = None, budget_s: float | None = None,
        moe_mode: str | None = None) -> dict:
    """The points (module docstring), the payload rewritten into `out` after each.

    quick: k2_rank's quick grid (contexts 5,500 and 128, C = 1 and 10, AR and budget 16).
    out: folder of the JSON (None: data/results/).
    budget_s: no new point starts past this many seconds; None: env K2_LAYER_BUDGET_S, else 150.
    moe_mode: "tp" (experts sliced) or "ep" (whole experts); None: env K2_LAYER_MOE, else "tp".
    """
    import torch

    from kdlib.engine.config import ModelConfig
    from kdlib.engine.rank import DFLASH_KIMI, RankDrafter, RankModel, RankShape, RankStep

    env = os.environ.get
    budget_s = float(env("K2_LAYER_BUDGET_S", "150") if budget_s is None else budget_s)
    moe_mode = env("K2_LAYER_MOE", "tp") if moe_mode is None else moe_mode
    name = "kimi-k2.6"
    full_dict = memory.load_config(name)
    cfg = ModelConfig.from_dict(layer_config(full_dict))
    shape = RankShape(cfg, tp=8, rank=0, moe_mode=moe_mode)
    ceil = k2_rank.ceilings()
    payload = {"parameters": {"config": name, "tp": 8, "rank": 0, "moe_mode": moe_mode,
                              "layers": cfg.num_hidden_layers, "layers_per_graph": LAYERS,
                              "first_k_dense_replace": cfg.first_k_dense_replace,
                              "accepted": k2_rank.ACCEPTED, "p_top": k2_rank.P_TOP, "iters": ITERS,
                              "quick": quick, "budget_s": budget_s, "routing": "uniform", "compiled": True},
               "ceilings": ceil, "rows": [], "routing": [], "cut": []}

    def save():
        results.write("k2_layer", payload, out_dir=out, command="python3 -m kdlib.perf.run --suite k2_layer")

    t0 = time.perf_counter()
    model = RankModel(shape, device="cuda", seed=0)
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    model.compile_pieces()
    drafter = RankDrafter(model, DFLASH_KIMI)
    # the pool cut of the whole rank (k2_rank.grid), so that the points are the grid's
    pool_tokens = memory.plan(full_dict, "h200", tp=8, context=200_000).value("pool_tokens")
    points, cut = k2_rank.grid(pool_tokens, quick)
    slots = max(c * (ctx + (b or 0) + 1) for ctx, c, b in points)
    pool = torch.zeros(cfg.num_hidden_layers, slots, cfg.latent_dim, dtype=torch.bfloat16, device="cuda")
    drafter.make_pool(slots)
    flush = timing.l2_flush()
    payload["setup"] = {"weight_generation_s": gen_s, "weight_bytes": model.weight_bytes(),
                        "drafter": {**DFLASH_KIMI.__dict__, "weight_bytes_rank": drafter.weight_bytes()},
                        "pool_slots": slots, "pool_tokens_predicted": pool_tokens}
    payload["graph_overhead"] = graph_overhead(flush, ITERS)
    payload["cut"] = cut
    save()
    baseline = compiled_routing_torch()
    layers = layers_of(cfg)
    done_m, done_cw, overflow = set(), set(), 0
    start = time.perf_counter()
    for i, (ctx, c, b) in enumerate(points):
        if time.perf_counter() - start > budget_s:
            payload["cut"] += [{"context": x, "streams": y, "budget": z, "why": "time budget"}
                               for x, y, z in points[i:]]
            break
        t_p = time.perf_counter()
        step = RankStep(model, c, ctx, b, drafter if b else None, accepted=k2_rank.ACCEPTED,
                        p_top=k2_rank.P_TOP, pool=pool, routing="uniform")
        step.run(save=True)  # eager: the pieces' inputs; the first call of a row count compiles
        torch.cuda.synchronize()
        if "first_compile_s" not in payload["setup"]:
            payload["setup"]["first_compile_s"] = time.perf_counter() - t_p
        fns = piece_fns(step)
        timed = {p: measure(fns[p], flush, ITERS, graph_calls(layers.get(p)))
                 for p in wanted(step, done_m, done_cw)}
        if step.M not in done_m:
            payload["routing"] += routing_rows(step, baseline, flush, ITERS)
            print("[k2_layer] routing M " + f"{step.M}: " + ", ".join(
                f"{r['impl']} {r['median_ms'] * 1e3:.1f} us" for r in payload["routing"][-2:]), flush=True)
        overflow += int(step.overflow)
        done_m.add(step.M)
        done_cw.add((step.C, step.W))
        payload["rows"] += piece_rows(step, timed, ceil)
        payload["moe_bound_overflows"] = overflow
        print(f"[k2_layer] ctx {ctx:>6} C {c:>2} b {b or 0:>2} M {step.M:>4}: "
              + " ".join(f"{p} {t['median_ms'] * 1e3:.0f}us/{t['kernels']:.0f}k" for p, t in timed.items())
              + f" ({time.perf_counter() - t_p:.1f} s)", flush=True)
        del step, fns
        torch.cuda.empty_cache()
        save()
    return payload
