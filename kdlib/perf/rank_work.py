"""Bytes and FLOPs of the pieces of one TP rank's step (`kdlib.engine.rank`), from its shapes alone.

    work = piece_work(RankShape(cfg, tp=8), DFLASH_KIMI, streams=10, rows_per_stream=17, context=5500)
    work["moe"]["bytes"], work["attention"]["flops"]      # one layer's piece
    totals(work, cfg, ddtree=True)["dense"]               # the whole step's dense + norms

Per layer: "dense_first" (the dense first layer's norms, MLA projections and dense MLP), "dense" (a MoE
layer's norms, MLA projections, router and shared expert), "attention" (the latent cache of every stream
read once, the new rows written), "moe" (the touched experts' INT4 weights under uniform routing,
`kdlib.cuda.moe.layer_bytes_flops`). Per step: "head" (final norm + the rank's LM head rows), "commit", and
with a drafter "draft", "tree", "accept". Every weight read once, activations counted as in
`kdlib.perf.suites.k2_rank.floors`, which sums these (`totals`; it has no AR commit); the byte counts equal
the tensors `RankModel` and `RankDrafter` allocate (tests/test_k2_layer.py checks it). No tensor is made:
the estimator calls this. `estimator_work` is the same but for the attention, whose work there is what its
kernels execute (`attention_executed`: the padded row blocks and key tiles) rather than the useful work the
floors count; `attention_plan` is that work as the plan lays it out over the GPU's CTAs, in its jobs.
"""

from __future__ import annotations

import numpy as np

from kdlib.cuda.attention import job_tiles, plan_v5, v10_deal
from kdlib.cuda.moe import layer_bytes_flops
from kdlib.estimator.model import touched_experts
from kdlib.tp.engine import partition

LAYER_PIECES = ("dense_first", "dense", "attention", "moe")
STEP_PIECES = ("head", "draft", "tree", "accept", "commit")
BF16 = 2
ROW_BLOCK = KEY_TILE = 64  # the tree-verify plan's query rows a job and keys a tile (kdlib.cuda.attention)


def _span(n: int, tp: int, rank: int) -> int:
    lo, hi = partition(n, tp)[rank]
    return hi - lo


def layer_weight_bytes(shape, dense: bool) -> int:
    """Bytes of one layer's tensors besides the routed experts: norms, MLA projections (the rank's heads),
    the MLP slice (the dense layer's, or the shared expert's and the router where `dense` is False)."""
    c, nh = shape.cfg, shape.heads
    H, r, rope, ql = c.hidden_size, c.kv_lora_rank, c.qk_rope_head_dim, c.q_lora_rank
    n = shape.dense_inter if dense else shape.shared_inter
    params = (2 * H + ql * H + ql + nh * c.qk_head_dim * ql + (r + rope) * H + r
              + nh * (c.qk_nope_head_dim + c.v_head_dim) * r + H * nh * c.v_head_dim + 3 * n * H)
    router = 0 if dense else c.n_routed_experts * H * BF16 + c.n_routed_experts * 4  # bias float32
    return params * BF16 + router


def head_weight_bytes(shape) -> int:
    """The rank's LM head rows and the final norm."""
    v0, v1 = shape.vocab_range
    return ((v1 - v0) * shape.cfg.hidden_size + shape.cfg.hidden_size) * BF16


def drafter_slice(shape, ds) -> dict:
    """A rank's slice of a DFlash drafter (`RankDrafter`): heads, KV heads, MLP width, fc input columns."""
    taps = len(ds.target_layer_ids)
    return {"heads": _span(ds.num_heads, shape.tp, shape.rank),
            "kv_heads": max(1, ds.num_kv_heads // shape.tp),
            "inter": _span(ds.intermediate_size, shape.tp, shape.rank),
            "fc_cols": _span(taps * shape.cfg.hidden_size, shape.tp, shape.rank)}


def drafter_weight_bytes(shape, ds) -> int:
    """Bytes of `RankDrafter.weight_bytes()`: fc, two norms, per layer two norms, q / k / v / o, the MLP."""
    H, hd, d = shape.cfg.hidden_size, ds.head_dim, drafter_slice(shape, ds)
    layer = (2 * H + d["heads"] * hd * H * 2 + 2 * d["kv_heads"] * hd * H + 2 * hd + 3 * d["inter"] * H)
    return (H * d["fc_cols"] + 2 * H + ds.num_layers * layer) * BF16


def _work(nbytes: float, flops: float) -> dict:
    return {"bytes": float(nbytes), "flops": float(flops)}


def piece_work(shape, ds, streams: int, rows_per_stream: int, context: int) -> dict:
    """{piece: {"bytes", "flops"}} of one layer's pieces (LAYER_PIECES) and the step's (STEP_PIECES; draft,
    tree, accept only with a drafter `ds`) for `streams` x `rows_per_stream` rows over `context` cached
    tokens a stream. shape: a `kdlib.engine.rank.RankShape`; ds: its `DraftShape`, or None (AR)."""
    c = shape.cfg
    C, W, ctx = streams, rows_per_stream, context
    M, H, k, lat = C * W, c.hidden_size, c.num_experts_per_tok, c.latent_dim
    act = 4 * M * H * BF16  # the residual and normed rows in and out of a layer
    out = {}
    for name, dense in (("dense_first", True), ("dense", False)):
        w = layer_weight_bytes(shape, dense)
        out[name] = _work(w + act, 2.0 * M * w / BF16)
    # the cached rows, the step's own rows written and read, its queries [M, heads, lat] bf16 in and its
    # latent outputs [M, heads, kv_lora_rank] float32 out
    out["attention"] = _work(C * ctx * lat * BF16 + 2 * M * lat * BF16 + M * shape.heads * lat * BF16
                             + M * shape.heads * c.kv_lora_rank * 4,
                             2.0 * M * shape.heads * (ctx + W) * (lat + c.kv_lora_rank))
    touched = shape.n_experts * (touched_experts(M, c.n_routed_experts, k) / c.n_routed_experts)
    slots_tokens = M if shape.moe_mode == "tp" else M * shape.n_experts / c.n_routed_experts
    moe = layer_bytes_flops(slots_tokens, touched, H, shape.expert_inter, k)
    out["moe"] = _work(moe["bytes"], moe["flops"])
    head = head_weight_bytes(shape)
    out["head"] = _work(head, 2.0 * M * head / BF16)
    if ds is not None:
        d, B = drafter_slice(shape, ds), ds.block_size
        wd, lm = drafter_weight_bytes(shape, ds), (head - H * BF16)  # the drafter reads the LM head rows
        ctx_kv = C * ctx * ds.num_layers * 2 * d["kv_heads"] * ds.head_dim * BF16
        out["draft"] = _work(wd + lm + ctx_kv, 2.0 * C * B * (wd + lm) / BF16)
        out["tree"] = _work(C * (B - 1) * min(W - 1, c.vocab_size) * 12 + C * W * W, 0.0)
        out["accept"] = _work(C * W * 8 * 4, 0.0)
        fc = H * d["fc_cols"]
        out["commit"] = _work(fc * BF16 + ds.num_layers * d["kv_heads"] * ds.head_dim * H * 4
                              + M * ds.num_layers * 2 * d["kv_heads"] * ds.head_dim * BF16, 2.0 * M * fc)
    else:
        out["commit"] = _work(2 * C * 8, 0.0)  # AR: the lengths read and the next ones written (int64)
    return out


def attention_executed(shape, streams: int, rows_per_stream: int, context: int) -> dict:
    """One layer's tree-verify attention as its kernels execute it: each stream's heads x rows query rows
    in row blocks of ROW_BLOCK (padded), each block over its stream's context + rows keys in tiles of
    KEY_TILE (padded as one run; the kernels pad the prefix and the tree's rows apart, a tile more at most).
    bytes: every row block's Q block in and one fp32 partial out (the keys stream through L2 and are the
    tiles' cost); the plan's key chunks, each a job that loads its Q block again and writes its own partial,
    are not counted (`attention_plan` lays the jobs out). FLOPs: S and P V of every tile, padding
    included."""
    c = shape.cfg
    blocks = streams * -(-shape.heads * rows_per_stream // ROW_BLOCK)
    tiles = blocks * -(-(context + rows_per_stream) // KEY_TILE)
    return _work(blocks * ROW_BLOCK * (c.latent_dim * BF16 + c.kv_lora_rank * 4),
                 2.0 * tiles * ROW_BLOCK * KEY_TILE * (c.latent_dim + c.kv_lora_rank))


def attention_plan(shape, streams: int, rows_per_stream: int, context: int, grid: int) -> dict:
    """One layer's tree-verify attention as its plan (`kdlib.cuda.attention.plan_v5`) lays it out over `grid`
    CTAs, each CTA taking the jobs the default version (10) deals it in the engine's step (`v10_deal` with
    its plan kernel's plan, which the layers reuse and which it therefore weighs by its deal, `weigh_deal`:
    cta, cta + grid, ... unless that plan orders them by size, which few uniform batches gain enough from):
    jobs (all), busiest_tiles and busiest_jobs (the key tiles and jobs of the CTA with the most tiles, ties to
    the most jobs: the attend kernel's critical path), latent_bytes (every stream's context and tree rows read
    once) and rows (query rows: the combine's). Each stream: `context` prefix keys, `rows_per_stream` tree
    rows; each job's key tiles as `kdlib.cuda.attention.job_tiles` counts them."""
    C, W, ctx = streams, rows_per_stream, context
    plan = plan_v5([ctx] * C, [W] * C, max(ctx, 1), W, shape.heads, grid, weigh_deal=True)  # reused: weighed
    cta = np.empty(int(plan[0]), dtype=np.int64)  # [jobs] each job's CTA
    for c, dealt in enumerate(v10_deal(plan, grid, reuse_plan=True)):  # one plan a step, for every layer
        cta[dealt] = c
    tiles = np.bincount(cta, weights=job_tiles(plan), minlength=grid)  # [grid]
    jobs = np.bincount(cta, minlength=grid)  # [grid]
    busiest = max(range(grid), key=lambda i: (tiles[i], jobs[i]))
    return {"jobs": int(plan[0]), "busiest_tiles": int(tiles[busiest]), "busiest_jobs": int(jobs[busiest]),
            "latent_bytes": C * (ctx + W) * shape.cfg.latent_dim * BF16, "rows": C * W * shape.heads}


def estimator_work(shape, ds, streams: int, rows_per_stream: int, context: int) -> dict:
    """`piece_work` with the attention's executed work (`attention_executed`) in place of its useful work:
    what `kdlib.estimator`'s rank terms are fitted on and evaluated with (the floors keep the useful work)."""
    out = piece_work(shape, ds, streams, rows_per_stream, context)
    out["attention"] = attention_executed(shape, streams, rows_per_stream, context)
    return out


def totals(work: dict, cfg, ddtree: bool) -> dict:
    """The step's components from one layer's `piece_work`: "moe" over the MoE layers, "attention" over
    every layer, "dense" = the dense layers' + the MoE layers' dense pieces + the head; with `ddtree` the
    drafter's parts as they are."""
    L, n_dense = cfg.num_hidden_layers, cfg.first_k_dense_replace
    n_moe = L - n_dense

    def total(parts):
        return _work(sum(n * work[p]["bytes"] for n, p in parts), sum(n * work[p]["flops"] for n, p in parts))

    out = {"moe": total([(n_moe, "moe")]), "attention": total([(L, "attention")]),
           "dense": total([(n_dense, "dense_first"), (n_moe, "dense"), (1, "head")])}
    if ddtree:
        out.update({p: work[p] for p in ("draft", "tree", "accept", "commit")})
    return out
