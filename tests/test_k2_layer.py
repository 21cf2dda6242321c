"""The k2_layer suite and the estimator's rank terms: `kdlib.perf.rank_work`'s byte counts against the
tensors the rank allocates, the suite's pieces and rows on the CPU at a scaled-down config, its loader,
`calibrate_rank_layer` recovering known terms from a synthetic layer payload, `rank_step_time` composing
them into a 61-layer step; on CUDA (marked gpu) one piece captured, replayed and profiled."""

from __future__ import annotations

import json

import pytest
import torch
from test_k2_rank import small_config

from kdlib import estimator as est
from kdlib import memory
from kdlib.cuda.attention import plan_v5
from kdlib.engine.config import ModelConfig
from kdlib.engine.rank import DFLASH_KIMI, DraftShape, RankDrafter, RankModel, RankShape, RankStep
from kdlib.estimator import calibration
from kdlib.estimator.model import allreduce_s, hardware
from kdlib.estimator.params import ATTENTION_PLAN_TERMS
from kdlib.perf import rank_work, results
from kdlib.perf.suites import k2_layer, k2_rank
from kdlib.perf.timing import floor_ms

CEIL = {"copy_bandwidth_Bps": 3e12, "bf16_matmul_flops": 7e14}
SMALL_DRAFT = DraftShape(2, 4, 2, 32, 256, 4, (1, 5))


def _tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.parametrize("mode, rank", [("tp", 0), ("ep", 1)])
def test_rank_work_counts_the_tensors_the_rank_allocates(mode, rank):
    shape = RankShape(ModelConfig.from_dict(small_config()), tp=2, rank=rank, moe_mode=mode)
    m = RankModel(shape, device="cpu")
    dr = RankDrafter(m, SMALL_DRAFT)
    for i, L in enumerate(m.layers):
        dense = "router_bias" not in L
        want = _tensor_bytes(v for k, v in L.items() if k not in ("experts", "experts_q"))
        assert rank_work.layer_weight_bytes(m.shape, dense) == want, i
    assert rank_work.head_weight_bytes(m.shape) == _tensor_bytes([m.lm_head, m.norm])
    assert rank_work.drafter_weight_bytes(m.shape, dr.ds) == dr.weight_bytes()
    s = rank_work.drafter_slice(m.shape, dr.ds)
    assert (s["heads"], s["kv_heads"], s["fc_cols"]) == (dr.nh, dr.nkv, dr.fc.shape[1])


def test_rank_work_totals_are_the_layers_summed():
    cfg = ModelConfig.from_dict(memory.load_config("kimi-k2.6"))
    shape = RankShape(cfg, tp=8)
    w = rank_work.piece_work(shape, DFLASH_KIMI, 4, 17, 5500)
    tot = rank_work.totals(w, cfg, ddtree=True)
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert tot["moe"]["bytes"] == n_moe * w["moe"]["bytes"]
    assert tot["attention"]["flops"] == cfg.num_hidden_layers * w["attention"]["flops"]
    n_dense = cfg.first_k_dense_replace
    dense = n_dense * w["dense_first"]["bytes"] + n_moe * w["dense"]["bytes"] + w["head"]["bytes"]
    assert tot["dense"]["bytes"] == dense
    assert set(tot) == {"moe", "attention", "dense", "draft", "tree", "accept", "commit"}
    assert set(rank_work.totals(rank_work.piece_work(shape, None, 4, 1, 5500), cfg, ddtree=False)) == {
        "moe", "attention", "dense"}
    assert w["dense_first"]["bytes"] > w["dense"]["bytes"]  # the dense MLP is 9x the shared expert's slice


def test_layer_config_keeps_the_dense_first_layer_and_the_moe_layers_each_piece_runs():
    d = k2_layer.layer_config(memory.load_config("kimi-k2.6"))
    cfg = ModelConfig.from_dict(d)
    assert cfg.num_hidden_layers == cfg.first_k_dense_replace + k2_layer.LAYERS == 9
    assert memory.load_config("kimi-k2.6")["text_config"]["num_hidden_layers"] == 61  # not changed in place
    ls = k2_layer.layers_of(cfg)
    moe = tuple(range(1, 9))
    assert ls == {"dense_first": (0,) * 8, "dense": moe, "attention": moe, "moe": moe}
    assert [k2_layer.graph_calls(ls.get(p)) for p in ("dense_first", "moe", "head", "draft")] == [8, 8, 1, 1]
    assert ModelConfig.from_dict(k2_layer.layer_config(d, moe_layers=1)).num_hidden_layers == 2


@pytest.mark.parametrize("budget", [None, 8])
def test_suite_pieces_and_rows_on_the_cpu(budget):
    cfg = ModelConfig.from_dict(k2_layer.layer_config(small_config()))
    m = RankModel(RankShape(cfg, tp=2, rank=0, moe_mode="tp"), device="cpu")
    dr = RankDrafter(m, SMALL_DRAFT) if budget else None
    st = RankStep(m, 2, 20, budget, dr)
    if dr is not None:
        dr.make_pool(st.pool.shape[1])
    st.run(save=True)
    before = st.argmax.clone()
    fns = k2_layer.piece_fns(st)
    want = k2_layer.wanted(st, set(), set())
    assert set(want) <= set(fns)
    assert ("draft" in want) == ("tree" in want) == bool(budget) and "commit" in want
    layers = k2_layer.layers_of(cfg)
    pool0 = st.pool.clone()
    for p in want:
        fns[p]()
    assert torch.equal(st.pool, pool0)  # the attention piece rewrote the rows the step wrote, no others
    seen, attend = [], st.attention
    st.attention = lambda i, *a: (seen.append(i), attend(i, *a))[1]
    fns["attention"]()
    assert seen == list(layers["attention"]) == list(range(1, cfg.num_hidden_layers))  # every MoE layer's
    v0, v1 = m.shape.vocab_range
    want_head = m.head_local(m.embed_rows(st.tokens.reshape(-1))).view(2, st.W, -1).argmax(-1) + v0
    assert torch.equal(st.argmax, want_head) and int(st.overflow) == 0  # the head of the embedded rows
    st.part("verify")
    assert torch.equal(st.argmax, before)  # the pieces left the step's inputs as they were
    # a point whose M and (C, W) were measured before adds attention (and the draft) only
    again = k2_layer.wanted(st, {st.M}, {(st.C, st.W)})
    assert again == ["attention"] + (["draft"] if budget else [])
    timed = {p: {"median_ms": 1.0, "kernels": 3.0} for p in want}
    rows = k2_layer.piece_rows(st, timed, CEIL)
    work = rank_work.piece_work(m.shape, dr.ds if dr else None, 2, st.W, 20)
    for r in rows:
        w = work[r["piece"]]
        assert (r["bytes"], r["flops"]) == (w["bytes"], w["flops"])
        assert r["floor"] == floor_ms(w["bytes"], w["flops"], bandwidth_Bps=CEIL["copy_bandwidth_Bps"],
                                      flop_rate=CEIL["bf16_matmul_flops"])
        ls = layers.get(r["piece"])
        assert r["layers"] == (None if ls is None else list(ls)) and r["m_rows"] == 2 * st.W
        assert r["layers_per_graph"] == (k2_layer.LAYERS if r["piece"] in layers else 1)
        assert r["method"] == ("ddtree" if budget else "ar") and r["budget"] == budget


# ----------------------------------------------------------------------------- synthetic layer payload
TRUE = {  # piece -> (kernel_s, mem_eff, comp_eff, kernels at M = 1, kernels at M > 1)
    "dense_first": (3e-6, 0.6, 0.7, 20, 24), "dense": (2.5e-6, 0.5, 0.6, 20, 24),
    "attention": (5e-6, 0.7, 0.3, 4, 4), "moe": (4e-6, 0.4, 0.2, 12, 14),
    "moe_wide": (3e-6, 0.5, 0.3, 14, 14), "head": (2e-6, 0.8, 0.9, 8, 9),
    "draft": (3e-6, 0.3, 0.5, 150, 160), "tree": (6e-6, 0.9, 0.9, 3, 3), "accept": (4e-6, 0.9, 0.9, 5, 5),
    "commit": (2e-6, 0.5, 0.8, 60, 70), "commit_ar": (3e-6, 0.5, 0.8, 2, 2),
}
OVERHEAD_MS = 2.5e-3


def _kernels(p: str, m: int) -> float:
    return TRUE[p][3] if m == 1 else TRUE[p][4]


def _synthetic_doc(spec: dict, calls: int = k2_layer.LAYERS) -> dict:
    """A k2_layer payload whose times per call are exactly overhead / calls in the graph + kernels x
    kernel_s + bytes / (peak x mem_eff) + FLOPs / (peak x comp_eff) (TRUE), at the k2_rank grid's points,
    bytes and FLOPs from rank_work at the real shapes (`estimator_work`'s: the attention's as executed; the
    rows record piece_work's, as the suite does). calls: a layer's piece's calls in its graph; 1 writes the
    rows of one layer a graph without `layers_per_graph`, as the files before it."""
    full = memory.load_config("kimi-k2.6")
    cfg = ModelConfig.from_dict(full)
    per_layer = k2_layer.layers_of(ModelConfig.from_dict(k2_layer.layer_config(full)))
    shape = RankShape(cfg, tp=8)
    points, _ = k2_rank.grid(702_300, quick=False)
    rows = []
    for ctx, c, b in points:
        W = (b or 0) + 1
        work = rank_work.piece_work(shape, DFLASH_KIMI if b else None, c, W, ctx)
        done = rank_work.estimator_work(shape, DFLASH_KIMI if b else None, c, W, ctx)  # what the time follows
        for piece, w in work.items():
            row = {"piece": piece, "method": "ddtree" if b else "ar", "m_rows": c * W}
            name = calibration.rank_piece(row, cfg)
            ks, mem, comp, _, _ = TRUE[name]
            floor = max(w["bytes"] / spec["hbm_bandwidth_Bps"], w["flops"] / spec["bf16_dense_flops"])
            bw, fl = spec["hbm_bandwidth_Bps"], spec["bf16_dense_flops"]
            n = calls if piece in per_layer else 1
            t = (OVERHEAD_MS * 1e-3 / n + _kernels(name, c * W) * ks + done[piece]["bytes"] / (bw * mem)
                 + done[piece]["flops"] / (fl * comp))
            rows.append({"piece": piece, "context": ctx, "streams": c,
                         "rows_per_stream": W, "m_rows": c * W, "budget": b,
                         "method": "ddtree" if b else "ar",
                         "timing": {"median_ms": t * 1e3, "p10_ms": t * 1e3, "p90_ms": t * 1e3},
                         "median_ms": t * 1e3, "mode": "graph", "kernels": _kernels(name, c * W), **w,
                         "floor": {"floor_ms": floor * 1e3}} | ({"layers_per_graph": n} if calls > 1 else {}))
    return {"suite": "k2_layer", "schema": results.SCHEMA, "provenance": {}, "_path": "synthetic",
            "parameters": {"moe_mode": "tp", "tp": 8}, "graph_overhead": {"overhead_ms": OVERHEAD_MS},
            "rows": rows}


@pytest.mark.parametrize("calls", [k2_layer.LAYERS, 1])
def test_calibrate_rank_layer_recovers_known_terms(calls):
    """Where a piece's kernels, bytes and FLOPs vary independently over the grid, the fit recovers the
    three terms; where they do not (the commit's bytes and FLOPs both grow with M, the tree's FLOPs are too
    few to weigh), it still reproduces every row's time. A layer's piece carries 1 / calls of the graph
    overhead; files of one layer a graph (no layers_per_graph) the whole of it."""
    spec = hardware("h200")
    doc = _synthetic_doc(spec, calls)
    terms = est.calibrate_rank_layer(est.Assumptions(), doc)
    assert set(terms.pieces) == set(TRUE)
    for p, (ks, mem, comp, k1, kn) in TRUE.items():
        t = terms.pieces[p]
        if p in ("dense_first", "dense", "attention", "moe", "moe_wide", "head", "draft"):
            assert (t.kernel_s.value, t.mem_eff.value, t.comp_eff.value) == pytest.approx((ks, mem, comp),
                                                                                        rel=1e-6), p
        on_m1 = p not in ("draft", "tree", "accept", "commit")  # DDTree pieces: M >= 9 only
        assert t.kernels_at(1) == (k1 if on_m1 else kn) and t.kernels_at(300) == kn, p
        assert "k2_layer (synthetic)" in t.kernel_s.source and f"'{p}' rows" in t.mem_eff.source
    bw, fl = spec["hbm_bandwidth_Bps"], spec["bf16_dense_flops"]
    shape = RankShape(ModelConfig.from_dict(memory.load_config("kimi-k2.6")), tp=8)
    for r in doc["rows"]:
        t = terms.pieces[calibration.rank_piece(r, shape.cfg)]
        w = (rank_work.attention_executed(shape, r["streams"], r["rows_per_stream"], r["context"])
             if r["piece"] == "attention" else r)
        fit = (OVERHEAD_MS * 1e-3 / r.get("layers_per_graph", 1) + r["kernels"] * t.kernel_s.value
               + w["bytes"] / (bw * t.mem_eff.value) + w["flops"] / (fl * t.comp_eff.value))
        assert fit == pytest.approx(r["median_ms"] * 1e-3, rel=1e-4), (r["piece"], r["m_rows"], r["context"])
    assert terms.graph_overhead_s.value == pytest.approx(OVERHEAD_MS * 1e-3)
    assert [r["piece"] for r in terms.table()] == list(TRUE)


def test_calibrate_rank_layer_keeps_the_terms_physical():
    """A piece timed below its floor gets both efficiencies 1 (no piece beats a peak), a kernel term >= 0."""
    spec = hardware("h200")
    doc = _synthetic_doc(spec)
    for r in doc["rows"]:
        if r["piece"] == "moe":
            floor = max(r["bytes"] / spec["hbm_bandwidth_Bps"], r["flops"] / spec["bf16_dense_flops"])
            r["median_ms"] = (OVERHEAD_MS * 1e-3 / r["layers_per_graph"] + 0.5 * floor) * 1e3
    t = est.calibrate_rank_layer(est.Assumptions(), doc).pieces["moe"]
    assert t.mem_eff.value == 1.0 and t.comp_eff.value == 1.0 and t.kernel_s.value >= 0


def test_attention_executed_counts_the_padded_row_blocks_and_tiles():
    """8 heads a rank: an AR row is 8 query rows, one row block padded to 64; 65 rows are 520, 9 blocks.
    Keys are context + rows in tiles of 64. Padding makes the executed FLOPs exceed the useful ones, most for
    AR."""
    shape = RankShape(ModelConfig.from_dict(memory.load_config("kimi-k2.6")), tp=8)
    c = shape.cfg
    per_tile = 2.0 * 64 * 64 * (c.latent_dim + c.kv_lora_rank)
    per_block = 64 * (c.latent_dim * 2 + c.kv_lora_rank * 4)
    for C, W, ctx, blocks, tiles in ((1, 1, 5500, 1, 86), (4, 65, 128, 36, 36 * 4), (10, 17, 0, 30, 30)):
        w = rank_work.attention_executed(shape, C, W, ctx)
        assert (w["bytes"], w["flops"]) == (blocks * per_block, tiles * per_tile), (C, W, ctx)
    useful = rank_work.piece_work(shape, None, 1, 1, 5500)["attention"]["flops"]
    assert rank_work.attention_executed(shape, 1, 1, 5500)["flops"] > 7 * useful
    assert rank_work.estimator_work(shape, None, 1, 1, 5500)["attention"] == rank_work.attention_executed(
        shape, 1, 1, 5500)


def test_attention_plan_lays_the_jobs_over_the_ctas():
    """The plan's jobs dealt to the CTAs round-robin: their tiles sum to the executed tiles, the busiest CTA
    holds at least the mean and at most one round more; one long AR stream's chunks spread over every CTA;
    tiny work leaves most CTAs idle."""
    shape = RankShape(ModelConfig.from_dict(memory.load_config("kimi-k2.6")), tp=8)
    for C, W, ctx in ((1, 1, 200_000), (4, 65, 128_000), (16, 9, 5_500), (10, 1, 128)):
        pl = rank_work.attention_plan(shape, C, W, ctx, 132)
        plan = plan_v5([ctx] * C, [W] * C, ctx, W, shape.heads, 132, weigh_deal=True)  # the step's, reused
        e = plan[1:].reshape(C, -1)
        tiles = sum(int(r[3]) * (-(-ctx // 64) + (-(-W // 64))) for r in e)  # every row block over every key
        assert pl["jobs"] == plan[0] and pl["rows"] == C * W * 8
        assert pl["latent_bytes"] == C * (ctx + W) * 576 * 2
        longest = int(e[:, 2].max()) + 1  # a job's most tiles: a chunk and the tail
        assert tiles / 132 <= pl["busiest_tiles"] <= tiles / 132 + pl["busiest_jobs"] * longest
        assert pl["busiest_jobs"] <= -(-pl["jobs"] // 132)
    one = rank_work.attention_plan(shape, 1, 1, 200_000, 132)
    assert one["jobs"] > 100 and one["busiest_jobs"] == -(-one["jobs"] // 132)  # its chunks on ~every CTA
    assert rank_work.attention_plan(shape, 1, 1, 128, 132)["jobs"] < 132


def test_attention_plan_follows_the_default_versions_deal():
    """Where version 10's plan kernel orders a uniform batch's jobs (16 streams x 65 rows at 5,500 and 8,192:
    chunks of unequal tiles over two rounds or more), attention_plan's busiest CTA is the one of that deal
    (v10_deal of the engine's step, whose first layer makes the plan with reuse_plan), lighter than the
    round-robin's; where it orders none (every K2 grid shape), the round-robin's. A call of at most 8 streams
    that no later call reuses deals statically (its attend kernels make the plan: own_plan)."""
    from kdlib.cuda.attention import job_tiles, own_plan, plan_order, static_deal, v10_deal

    shape = RankShape(ModelConfig.from_dict(memory.load_config("kimi-k2.6")), tp=8)
    for C, W, ctx, ordered in ((16, 65, 8192, True), (16, 65, 5500, True), (8, 65, 4096, False),
                               (4, 65, 128_000, False), (16, 17, 5500, False)):
        plan = plan_v5([ctx] * C, [W] * C, ctx, W, shape.heads, 132, weigh_deal=True)  # the step's, reused
        assert (plan_order(plan, 132) is not None) == ordered
        tiles = job_tiles(plan)
        dealt = [int(tiles[d].sum()) for d in v10_deal(plan, 132, reuse_plan=True)]
        static = [int(tiles[d].sum()) for d in static_deal(int(plan[0]), 132)]
        assert rank_work.attention_plan(shape, C, W, ctx, 132)["busiest_tiles"] == max(dealt)
        assert (max(dealt) < max(static)) == ordered
        assert own_plan(C) == (C <= 8) and not own_plan(C, reuse_plan=True)
        alone = [int(tiles[d].sum()) for d in v10_deal(plan, 132)]
        assert alone == (static if C <= 8 else dealt)


def _plan_terms(fixed=8e-6, per=(2e-6, 3e-6, 1e-13, 4e-9, 5e-8)) -> est.AttentionPlanTerms:
    src = "test"
    return est.AttentionPlanTerms(gpu="h200", grid=132, fixed_s=est.Param(fixed, "s", src),
                                  per={t: est.Param(v, "s", src) for t, v in zip(ATTENTION_PLAN_TERMS, per,
                                                                                  strict=True)})


def test_calibrate_rank_layer_fits_the_attention_plan_and_the_step_uses_it_on_that_gpu_only():
    """Attention rows timed exactly as known plan terms (plus the overhead share): the fit recovers them;
    rank_step_time takes 61 x the plan form on the H200 the rows came from, the peak-scaled piece on a B300;
    a file without the SM count gets no plan terms."""
    spec = hardware("h200")
    shape = RankShape(ModelConfig.from_dict(memory.load_config("kimi-k2.6")), tp=8)
    true = _plan_terms()
    doc = _synthetic_doc(spec)
    for r in doc["rows"]:
        if r["piece"] == "attention":
            pl = rank_work.attention_plan(shape, r["streams"], r["rows_per_stream"], r["context"], 132)
            t = true.time(pl)
            r["median_ms"] = (t + OVERHEAD_MS * 1e-3 / r["layers_per_graph"]) * 1e3
    assert est.calibrate_rank_layer(est.Assumptions(), doc).attention_plan is None  # no sm_count
    doc["provenance"] = {"sm_count": 132}
    terms = est.calibrate_rank_layer(est.Assumptions(), doc)
    fit = terms.attention_plan
    assert (fit.gpu, fit.grid) == ("h200", 132)
    assert fit.fixed_s.value == pytest.approx(true.fixed_s.value, rel=1e-4)
    for k in ATTENTION_PLAN_TERMS:
        assert fit.per[k].value == pytest.approx(true.per[k].value, rel=1e-4), k
    for C, W, ctx in ((1, 1, 5500), (16, 65, 32_000)):
        att = est.rank_step_time("h200", terms, C, W, ctx, W > 1)["attention"]
        assert att == pytest.approx(61 * true.time(rank_work.attention_plan(shape, C, W, ctx, 132)), rel=1e-4)
        pt, w = terms.pieces["attention"], rank_work.attention_executed(shape, C, W, ctx)
        b3 = hardware("b300")
        want = 61 * (pt.kernels_at(C * W) * pt.kernel_s.value
                     + w["bytes"] / (b3["hbm_bandwidth_Bps"] * pt.mem_eff.value)
                     + w["flops"] / (b3["bf16_dense_flops"] * pt.comp_eff.value))
        b300 = est.rank_step_time("b300", terms, C, W, ctx, W > 1)["attention"]
        assert b300 == pytest.approx(want, rel=1e-12)


def test_rank_step_time_is_61_layers_of_the_pieces():
    spec = hardware("h200")
    a = est.Assumptions()
    terms = est.calibrate_rank_layer(a, _synthetic_doc(spec))
    cfg = ModelConfig.from_dict(memory.load_config("kimi-k2.6"))
    shape = RankShape(cfg, tp=8)
    for C, W, ctx, dd in ((1, 1, 5500, False), (10, 17, 32000, True)):
        st = est.rank_step_time("h200", terms, C, W, ctx, dd)
        work = rank_work.estimator_work(shape, DFLASH_KIMI if dd else None, C, W, ctx)

        def t(p, name=None, work=work, m=C * W):  # one piece from the fitted terms
            pt, w = terms.pieces[name or p], work[p]
            return (_kernels(name or p, m) * pt.kernel_s.value
                    + w["bytes"] / (spec["hbm_bandwidth_Bps"] * pt.mem_eff.value)
                    + w["flops"] / (spec["bf16_dense_flops"] * pt.comp_eff.value))

        moe = calibration.moe_piece(cfg, C * W)  # "moe" at M = 1, "moe_wide" at M = 170
        assert moe == ("moe" if C * W == 1 else "moe_wide")
        layers = t("dense_first") + 60 * (t("dense") + t("moe", moe)) + 61 * t("attention")
        parts = t("draft") + t("tree") + t("accept") + t("commit") if dd else t("commit", "commit_ar")
        want = layers + t("head") + parts + OVERHEAD_MS * 1e-3
        assert st["step"] == pytest.approx(want, rel=1e-9)
        n_ar = 1 + 2 * 61 + ((1 + 2 * DFLASH_KIMI.num_layers + 1) if dd else 0)
        assert st["allreduce"] >= n_ar * allreduce_s(0, spec, a, 8)
        assert st["total"] == pytest.approx(st["step"] + st["allreduce"], rel=1e-12)
    with pytest.raises(ValueError, match="no 'draft' piece"):
        est.rank_step_time("h200", est.calibrate_rank_layer(a, {**_synthetic_doc(spec), "rows": [
            r for r in _synthetic_doc(spec)["rows"] if r["piece"] != "draft"]}), 1, 9, 128, True)


def test_validate_rank_on_a_rank_payload_built_from_the_same_terms():
    """A k2_rank-shaped payload whose steps are the terms' own prediction: residual 0 on every row; the
    plain (uncompiled) rows are left out."""
    spec = hardware("h200")
    terms = est.calibrate_rank_layer(est.Assumptions(), _synthetic_doc(spec))
    rows = []
    for ctx, c, b, comp in ((5500, 1, None, True), (128, 10, 16, True), (5500, 1, None, False)):
        W = (b or 0) + 1
        st = est.rank_step_time("h200", terms, c, W, ctx, bool(b))
        rows.append({"context": ctx, "streams": c, "method": "ddtree" if b else "ar", "budget": b,
                     "rows_per_stream": W, "m_rows": c * W, "compiled": comp,
                     "step_with_allreduce_ms": st["total"] * 1e3, "moe_bound_overflows": 0,
                     "profile": {"kernels_per_step": 1.0},
                     "pieces": {p: {"median_ms": 2 * st[p] * 1e3} for p in ("dense", "attention", "moe")}})
    got = est.validate_rank(terms, {"rows": rows})
    assert len(got) == 2
    for r in got:
        assert r["residual"] == pytest.approx(0.0, abs=1e-12) and r["moe_ratio"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- loader
def test_load_k2_layer_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(results, "ROOT", tmp_path)
    assert results.load_k2_layer("h200") is None
    doc = _synthetic_doc(hardware("h200"))
    doc.pop("_path")
    doc["rows"][0] = {**doc["rows"][0], "mode": "eager", "graph_error": "RuntimeError: capture"}
    (tmp_path / "k2_layer.h200.json").write_text(json.dumps(doc))
    rec = results.load_k2_layer("h200")
    assert len(rec.rows) == len(doc["rows"])
    r0, raw = rec.rows[0], doc["rows"][0]
    assert (r0.op, r0.variant, r0.mode, r0.median_ms, r0.bytes) == (
        "k2_layer_piece", raw["piece"], "eager", raw["median_ms"], raw["bytes"])
    assert r0.shape["piece"] == raw["piece"] and r0.floor_ms == raw["floor"]["floor_ms"]
    att = rec.select(variant="attention")
    assert len(att) == sum(r["piece"] == "attention" for r in doc["rows"])
    assert all(type(r.shape["m_rows"]) is int for r in rec.rows)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_pieces_capture_replay_and_profile():
    d = small_config(hidden_size=256, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=8)
    cfg = ModelConfig.from_dict(k2_layer.layer_config(d))
    m = RankModel(RankShape(cfg, tp=2, rank=0, moe_mode="tp"), device="cuda")
    dr = RankDrafter(m, DraftShape(2, 4, 2, 64, 256, 8, (1, 5)))
    st = RankStep(m, 3, 300, 16, dr)
    dr.make_pool(st.pool.shape[1])
    st.run(save=True)
    torch.cuda.synchronize()
    fns = k2_layer.piece_fns(st)
    flush = k2_layer.timing.l2_flush()
    over = k2_layer.graph_overhead(flush, iters=5)
    assert over["kernels"] == 1 and over["replay_ms"] > 0
    layers = k2_layer.layers_of(cfg)
    for p in k2_layer.wanted(st, set(), set()):
        n = k2_layer.graph_calls(layers.get(p))
        t = k2_layer.measure(fns[p], flush, iters=5, calls=n)
        assert t["mode"] == "graph", (p, t["graph_error"])
        assert t["median_ms"] > 0 and t["kernels"] >= 1 and t["device_ms"] > 0, p
        assert t["replay_ms"] == pytest.approx(t["median_ms"] * n) == t["timing"]["median_ms"] * n
    rows = k2_layer.routing_rows(st, k2_layer.compiled_routing_torch(), flush, iters=5)
    assert [r["impl"] for r in rows] == ["kernel", "torch_compiled"]
    assert rows[0]["kernels"] == 1 and all(r["mode"] == "graph" and r["median_ms"] > 0 for r in rows)
    assert int(st.overflow) == 0
