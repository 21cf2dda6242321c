"""kdlib.engine.rank: the torch INT4 packer against kdlib.cuda.moe, the device routing against
prepare_routing's metadata, the rank's slicing against kdlib.tp, its weight bytes against kdlib.memory,
a whole step at a scaled-down config on the CPU; on CUDA (marked gpu) the moe_w4a16 path with device
routing against the torch dequantized path, and a captured step replayed against the eager one."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from kdlib import memory
from kdlib.cuda import moe
from kdlib.engine import rank as rank_mod
from kdlib.engine.config import ModelConfig
from kdlib.engine.int4 import count_bound, device_routing, pack_moe_torch, quantize_w4_torch
from kdlib.engine.model import Model
from kdlib.engine.rank import (
    DFLASH_KIMI,
    DraftShape,
    RankDrafter,
    RankModel,
    RankShape,
    RankStep,
    _cupy_stream,
    allreduce_ms,
    draft_profile,
    forced_targets,
)
from kdlib.perf.suites import k2_rank
from kdlib.tp.engine import shard_state_dict


def small_config(**kw) -> dict:
    """Kimi-K2.6's config scaled down (kernel-legal widths: K % 64, N % 64, the 576-wide latent)."""
    d = json.loads((memory.CONFIGS / "kimi-k2.6.json").read_text())
    t = d["text_config"]
    t.update(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        n_routed_experts=16,
        q_lora_rank=64,
        vocab_size=512,
        num_experts_per_tok=4,
    )
    t.update(kw)
    return d


def test_torch_packer_matches_pack_moe():
    rng = np.random.default_rng(3)
    w = [rng.normal(0, 0.02, s).astype(np.float32) for s in ((3, 64, 128), (3, 64, 128), (3, 128, 64))]
    w[0][0, 5, :32] = 0.0  # an all-zero group: scale 0, q = 8
    ref = moe.MoEWeights(*(x for a in w for x in moe.quantize_w4(a)))
    qs = [quantize_w4_torch(torch.from_numpy(a)) for a in w]
    for (q, s), name in zip(qs, ("gate", "up", "down"), strict=True):
        np.testing.assert_array_equal(q.numpy(), getattr(ref, f"q_{name}"))
        np.testing.assert_array_equal(s.numpy().view(np.uint16), getattr(ref, f"s_{name}"))
    got = pack_moe_torch(*(x for qs_ in qs for x in qs_))
    want = moe.pack_moe(ref)
    for k in ("w1", "s1", "w2", "s2"):
        np.testing.assert_array_equal(got[k].numpy().view(np.uint32), want[k])


def test_device_routing_matches_prepare_routing_metadata():
    rng = np.random.default_rng(0)
    E, M, k = 16, 9, 4
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)])
    w = rng.random((M, k)).astype(np.float32)
    for e0, n in ((0, 16), (8, 8)):  # all experts (tp), the second half (ep, rank 1 of 2)
        rt = device_routing(torch.from_numpy(ids), torch.from_numpy(w), e0, n)
        local = (ids >= e0) & (ids < e0 + n)
        counts = np.bincount((ids[local] - e0), minlength=n)
        np.testing.assert_array_equal(rt.expert_offsets.numpy(), np.concatenate([[0], np.cumsum(counts)]))
        act = np.nonzero(counts)[0]
        assert int(rt.n_active[0]) == len(act)
        np.testing.assert_array_equal(rt.active_experts.numpy()[: len(act)], act)
        off = rt.expert_offsets.numpy()
        for a, e in enumerate(act):
            assert tuple(rt.active_ranges[a].tolist()) == (off[e], off[e + 1])
            toks = sorted(rt.sorted_token[off[e]:off[e + 1]].tolist())
            assert toks == sorted(np.nonzero((ids == e + e0).any(1))[0].tolist())
            for t, wt in zip(
                rt.sorted_token[off[e] : off[e + 1]].tolist(),
                rt.sorted_weight[off[e] : off[e + 1]].tolist(),
                strict=True,
            ):
                assert wt == pytest.approx(float(w[t][list(ids[t]).index(e + e0)]))
        assert int(rt.max_count) == counts.max()


@pytest.mark.parametrize("M", [1, 7, 130])
def test_device_routing_orders_as_stable_argsorts(M):
    """The counting sort gives the slot order and the active-expert order of stable argsorts (the sort
    kernels it replaces), with the other ranks' slots after every local one (ep, rank 1 of 3)."""
    g = torch.Generator().manual_seed(M)
    E, k = 48, 8
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    w = torch.rand(M, k, generator=g)
    for e0, n in ((0, E), (16, 16)):
        rt = device_routing(ids, w, e0, n)
        local = (ids >= e0) & (ids < e0 + n)
        key = torch.where(local, ids - e0, torch.full_like(ids, n)).reshape(-1)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=n + 1)[:n]
        assert torch.equal(rt.sorted_token.long(), order // k)
        assert torch.equal(rt.sorted_weight, w.reshape(-1)[order])
        assert torch.equal(rt.active_experts.long(), torch.argsort((counts == 0).to(torch.int8), stable=True))


def test_count_bound():
    assert count_bound(5, 8, 384, 4.0) == 5  # exact in the decode regime
    assert count_bound(16, 8, 384, 4.0) == 8
    assert count_bound(1040, 8, 384, 4.0) == 87
    assert count_bound(20, 8, 8, 4.0) == 20  # never above m


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_slicing_matches_kdlib_tp(mode):
    d = small_config(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=8,
        vocab_size=96,
        num_experts_per_tok=2,
    )
    cfg = ModelConfig.from_dict(d)
    sd = Model(cfg).state_dict()
    for rank in range(2):
        s = RankShape(cfg, tp=2, rank=rank, moe_mode=mode)
        sh = shard_state_dict(sd, cfg, rank, 2, mode)
        a = "model.layers.1.self_attn."
        assert sh[a + "q_b_proj.weight"].shape[0] == s.heads * cfg.qk_head_dim
        assert sh[a + "o_proj.weight"].shape[1] == s.heads * cfg.v_head_dim
        assert sh["model.layers.0.mlp.gate_proj.weight"].shape[0] == s.dense_inter
        assert sh["model.layers.1.mlp.shared_experts.up_proj.weight"].shape[0] == s.shared_inter
        experts = {
            int(k.split(".")[5]) for k in sh if ".mlp.experts." in k and k.startswith("model.layers.1.")
        }
        assert len(experts) == s.n_experts
        assert sh["model.layers.1.mlp.experts.0.gate_proj.weight"].shape[0] == s.expert_inter
        assert sh["lm_head.weight"].shape[0] == s.vocab_range[1] - s.vocab_range[0]


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_weight_bytes_match_kdlib_memory(mode):
    d = small_config()
    m = RankModel(RankShape(ModelConfig.from_dict(d), tp=2, rank=1, moe_mode=mode), device="cpu")
    assert m.weight_bytes() == memory.weight_bytes(d, tp=2)["per_gpu"]


def test_forced_targets_walk_the_first_child_chain():
    # root (slot 0) -> slot 1 (token 11) -> slot 2 (token 12); slot 3 (token 13) a sibling of slot 1
    tokens = torch.tensor([[5, 11, 12, 13]])
    positions = torch.tensor([[0, 1, 2, 1]])
    next_token = torch.tensor([[1, 2, -1, -1]])
    argmax = torch.tensor([[90, 91, 92, 93]])
    assert forced_targets(tokens, positions, next_token, argmax, 3).tolist() == [[11, 12, 92, 93]]
    assert forced_targets(tokens, positions, next_token, argmax, 2).tolist() == [[11, 91, 92, 93]]
    assert forced_targets(tokens, positions, next_token, argmax, 1).tolist() == [[90, 91, 92, 93]]


def test_draft_profile_rows_descend_and_sum_to_one():
    p = draft_profile(7, 16, 0.8)
    assert p.shape == (7, 16)
    assert float(p[0].exp().sum()) == pytest.approx(1.0, abs=1e-6)
    assert bool((p[:, 1:] < p[:, :-1]).all())


def test_dflash_shape_is_the_published_one():
    assert (DFLASH_KIMI.num_layers, DFLASH_KIMI.num_heads, DFLASH_KIMI.num_kv_heads) == (6, 64, 8)
    assert (DFLASH_KIMI.intermediate_size, DFLASH_KIMI.block_size) == (18432, 8)
    assert "z-lab" in DFLASH_KIMI.source


def test_allreduce_model_is_the_ring_formula():
    fit = {"latency_s": 1e-5, "bus_bandwidth_Bps": 1e11}
    assert allreduce_ms(7168 * 2, fit, 8) == pytest.approx((1e-5 + 2 * 7 / 8 * 14336 / 1e11) * 1e3)


def test_grid_cuts_rows_beyond_the_pool():
    rows, cut = k2_rank.grid(702_300, quick=False)
    assert (200000, 1, 64) in rows and (5500, 10, None) in rows
    assert all(c * (ctx + (b or 0) + 1) <= 702_300 for ctx, c, b in rows)
    assert {(r["context"], r["streams"]) for r in cut} >= {(200000, 4), (128000, 10)}
    assert rows[0][0] == 5500  # the seeds' context first
    long, _ = k2_rank.grid(702_300, quick=False, contexts=(200000, 128000))
    assert {r[0] for r in long} == {200000, 128000} and long[0][0] == 200000
    assert set(k2_rank.PLAIN_ROWS) <= set(rows)  # the compiled rows' plain baseline is on the grid
    with pytest.raises(ValueError, match="not in the grid"):
        k2_rank.grid(702_300, quick=False, contexts=(1000,))


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_cpu_step_runs_every_part(mode):
    d = small_config()
    m = RankModel(RankShape(ModelConfig.from_dict(d), tp=2, rank=0, moe_mode=mode), device="cpu")
    dr = RankDrafter(m, DraftShape(2, 4, 2, 32, 256, 4, (0, 2)))
    ar = RankStep(m, streams=2, context=20)
    ar.run(save=True)
    assert ar.lens_next.tolist() == [21, 21]
    st = RankStep(m, streams=2, context=20, budget=8, drafter=dr, accepted=3)
    dr.make_pool(st.pool.shape[1])
    st.run(save=True)
    assert st.tau.tolist() == [3, 3]  # the forced accepted length (the chain is deep enough)
    assert st.lens_next.tolist() == [23, 23]
    assert bool(torch.isfinite(st.o_saved).all()) and bool(torch.isfinite(st.f_saved).all())
    before = st.argmax.clone()
    for only in (("dense",), ("attention",), ("moe",)):
        st.run(only=only)  # the pieces alone (for their timings) leave the step's inputs as they were
    st.part("verify")
    assert torch.equal(st.argmax, before)
    assert int(st.overflow) == 0


def test_rank_step_refuses_what_failed_deep_in_torch():
    """A budget of 0 or None beside a drafter, 0 streams and an accepted length past the block failed as
    raw torch errors (or, accepted, ran at tau = horizon + 1); a step run before the drafter's pool was
    made failed inside the drafter; a top-K past the rank's vocabulary shard, inside topk."""
    m = RankModel(RankShape(ModelConfig.from_dict(small_config()), tp=2, rank=0), device="cpu")
    ds = DraftShape(2, 4, 2, 32, 256, 4, (0, 2))
    dr = RankDrafter(m, ds)
    for kw, message in ((dict(budget=0), "needs budget an int in \\[1, 64\\]"),
                        (dict(budget=None), "needs budget an int"), (dict(budget=65), "needs budget"),
                        (dict(budget=8, accepted=5), "must lie in \\[1, 4\\]: at most block_size = 4"),
                        (dict(budget=2, accepted=4), "accepted must lie in \\[1, 3\\].*budget \\+ 1 = 3"),
                        (dict(budget=8, streams=0), "streams must be >= 1")):
        with pytest.raises(ValueError, match=message):
            RankStep(m, **{"streams": 2, "context": 20, "drafter": dr, **kw})
    st = RankStep(m, streams=2, context=20, budget=8, drafter=dr)
    with pytest.raises(ValueError, match=r"holds 0 slots, the step's table 58: call drafter.make_pool"):
        st.run()
    # a pool shared with larger steps: the drafter needs the step's own slots only (2 x (20 + 9))
    shared = RankStep(m, streams=2, context=20, budget=8, drafter=dr, accepted=3,
                      pool=torch.zeros(m.cfg.num_hidden_layers, 174, m.cfg.latent_dim, dtype=torch.bfloat16))
    dr.make_pool(58)
    shared.run()
    assert shared.tau.tolist() == [3, 3]
    m96 = RankModel(RankShape(ModelConfig.from_dict(small_config(vocab_size=96)), tp=2, rank=0), device="cpu")
    dr96 = RankDrafter(m96, ds)  # a shard of 48 ids, fewer than the budget's 64 candidates
    wide = RankStep(m96, streams=1, context=20, budget=64, drafter=dr96)
    dr96.make_pool(wide.pool.shape[1])
    wide.run()
    assert wide.k == 48 == m96.shape.vocab_range[1] - m96.shape.vocab_range[0]
    for bad, message in ((dict(block_size=1), "block_size must be >= 2"), (dict(head_dim=31), "even"),
                         (dict(num_heads=6, num_kv_heads=4), "not a multiple of num_kv_heads"),
                         (dict(target_layer_ids=()), "at least one target layer")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(ds, **bad)


@pytest.mark.parametrize("budget", [None, 4])
def test_cpu_engine_row(budget):
    """k2_rank's engine section on the CPU: the rank through BatchEngine (eager), every request served."""
    m = RankModel(RankShape(ModelConfig.from_dict(small_config()), tp=2, rank=0), device="cpu")
    dr = RankDrafter(m, DraftShape(2, 4, 2, 32, 256, 4, (0, 2)))
    e = k2_rank.measure_engine(m, dr, ctx=40, C=2, budget=budget, steps=3)
    assert e["method"] == ("ddtree" if budget else "ar") and not e["graphs"]
    assert e["replay_ms"] is None and e["device_share"] is None  # no device spans on the CPU
    assert e["profile"] is None  # nor a device profile
    assert e["step_ms"] > 0 and e["overflow"] == 0
    assert e["steps"] == 4  # admitted together: the prefill's step and 3 more, every lane still at work
    assert 1.0 <= e["accepted_mean"] <= (budget or 0) + 1


def test_uniform_routing_forces_distinct_experts_and_never_overflows():
    m = RankModel(RankShape(ModelConfig.from_dict(small_config()), tp=2, rank=0, moe_mode="tp"), device="cpu")
    dr = RankDrafter(m, DraftShape(2, 4, 2, 32, 256, 4, (0, 2)))
    st = RankStep(m, streams=3, context=20, budget=8, drafter=dr)
    dr.make_pool(st.pool.shape[1])
    c = m.cfg
    assert st.route_ids.shape == (c.num_hidden_layers, st.M, c.num_experts_per_tok)
    k = c.num_experts_per_tok
    assert all(len(set(r.tolist())) == k for r in st.route_ids.reshape(-1, k))  # k distinct experts a row
    assert int(st.route_ids.max()) < c.n_routed_experts
    st.run(save=True)
    assert int(st.overflow) == 0
    w, idx = m.route(m.layers[1], st.logits_saved[1], st.route_ids[1])
    assert torch.equal(idx, st.route_ids[1]) and w.shape == idx.shape  # the scores' weights at the forced ids
    assert RankStep(m, streams=1, context=20, routing="router").route_ids is None
    with pytest.raises(ValueError, match="routing must be one of"):
        RankStep(m, streams=1, context=20, routing="hash")


def _saved(st: RankStep) -> dict:
    return {k: getattr(st, k).float().clone()
            for k in ("x_saved", "q_saved", "rows_saved", "o_saved", "f_saved", "logits_saved")}


def test_compiled_pieces_trace_whole_and_agree():
    """compile_pieces traces each piece as one graph (fullgraph: a break raises) at two row counts, and the
    traced step gives the pieces' values of the plain one (aot_eager runs the same aten ops)."""
    m = RankModel(RankShape(ModelConfig.from_dict(small_config()), tp=2, rank=0, moe_mode="tp"), device="cpu")
    plain = {}
    for C in (1, 3):
        st = RankStep(m, streams=C, context=20)
        st.run(save=True)
        plain[C] = (_saved(st), st.argmax.clone())
    torch._dynamo.reset()
    m.compile_pieces(backend="aot_eager")
    for C in (1, 3):
        st = RankStep(m, streams=C, context=20)
        st.run(save=True)
        got = _saved(st)
        for k, v in plain[C][0].items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
        assert torch.equal(st.argmax, plain[C][1])
    assert m.compiled


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_packer_and_moe_kernel_with_device_routing():
    d = small_config(hidden_size=256, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=8)
    cfg = ModelConfig.from_dict(d)
    m = RankModel(RankShape(cfg, tp=2, rank=0, moe_mode="tp"), device="cuda", seed=2, keep_unpacked=True)
    L = m.layers[1]

    for M in (1, 4, 8, 33, 200):
        x = torch.randn(M, cfg.hidden_size, device="cuda").to(torch.bfloat16)
        w, idx = m.route(L, m.mlp(L, x)[1])  # the router's logits come with the shared expert's GEMM
        rt = device_routing(idx, w, 0, m.shape.n_experts)
        bound = max(count_bound(M, cfg.num_experts_per_tok, cfg.n_routed_experts, 4.0), int(rt.max_count))
        with _cupy_stream():
            got = m._routed_kernel(L, x, rt, bound).float()
        ref = m.routed_torch(L, x, rt).float()
        err = (got - ref).norm() / ref.norm()
        assert err < 2e-2, (M, float(err))


@pytest.mark.gpu
def test_gpu_unpack_inverts_the_packer():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = [torch.randn(s, device="cuda", generator=g) for s in ((2, 64, 128), (2, 64, 128), (2, 128, 64))]
    qs = [quantize_w4_torch(a) for a in w]
    p = pack_moe_torch(*(x for q in qs for x in q))
    ref = moe.pack_moe(
        moe.MoEWeights(
            *(
                x.cpu().numpy().view(np.uint16) if x.dtype == torch.int16 else x.cpu().numpy()
                for q in qs
                for x in q
            )
        )
    )
    for k in ("w1", "s1", "w2", "s2"):
        np.testing.assert_array_equal(p[k].cpu().numpy().view(np.uint32), ref[k])


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 16])
def test_gpu_step_graph_replay_matches_eager(budget):
    d = small_config(hidden_size=256, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=8)
    m = RankModel(RankShape(ModelConfig.from_dict(d), tp=2, rank=0, moe_mode="tp"), device="cuda")
    dr = RankDrafter(m, DraftShape(2, 4, 2, 64, 256, 8, (0, 2))) if budget else None
    st = RankStep(m, streams=3, context=300, budget=budget, drafter=dr, accepted=4)
    if dr is not None:
        dr.make_pool(st.pool.shape[1])
    st.run(save=True)
    torch.cuda.synchronize()
    eager = (st.argmax.clone(), st.tau.clone())
    timing, err = k2_rank.timed(st.run, torch.cuda.graph_pool_handle(), iters=3)
    assert err is None, err
    assert timing["median_ms"] > 0
    assert torch.equal(st.tau, eager[1])
    # atomics in the MoE kernels may move the last bit of a sum: the argmax agrees almost everywhere
    assert float((st.argmax == eager[0]).float().mean()) >= 0.9
    if budget:
        assert st.tau.tolist() == [4, 4, 4]
    assert int(st.overflow) == 0


def test_floors_divide_by_the_running_gpus_ceilings(monkeypatch):
    """k2_rank and k2_layer read the H200's ceilings on any GPU: an H100 run's memory floors 1.41x low."""
    from kdlib.perf import results

    monkeypatch.setattr(results, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    h100 = results.ceilings("h100")
    assert k2_rank.ceilings() == {"copy_bandwidth_Bps": h100.bandwidth_Bps,
                                  "bf16_matmul_flops": h100.flop_rate, "path": h100.source}
    assert h100.bandwidth_Bps != results.ceilings("h200").bandwidth_Bps


def test_the_attention_pieces_bytes_count_its_queries_and_outputs():
    """The cache and the step's rows were counted; the queries [M, heads, 576] bf16 in and the latent outputs
    [M, heads, 512] float32 out were not (at 128 tokens, C = 16, 65 rows: 4.8 of 31 MB)."""
    from kdlib.perf import rank_work

    shape = RankShape(ModelConfig.load("kimi-k2.6"), tp=8, rank=0)
    C, W, ctx, M = 16, 65, 128, 16 * 65
    got = rank_work.piece_work(shape, None, C, W, ctx)["attention"]["bytes"]
    assert shape.heads == 8 and got == C * ctx * 576 * 2 + 2 * M * 576 * 2 + M * 8 * 576 * 2 + M * 8 * 512 * 4


@pytest.mark.gpu
def test_gpu_measure_row_captures_every_graph_twice_running():
    """The suite's row twice in a row, as a run's retry does: every piece's graph captured (each in a pool
    of its own), the step's and the pieces' medians, the profile."""
    d = small_config(hidden_size=256, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=8)
    m = RankModel(RankShape(ModelConfig.from_dict(d), tp=2, rank=0, moe_mode="tp"), device="cuda")
    dr = RankDrafter(m, DraftShape(2, 4, 2, 64, 256, 8, (0, 2)))
    probe = RankStep(m, streams=3, context=300, budget=16, drafter=dr, accepted=4)
    pool = torch.zeros(m.cfg.num_hidden_layers, probe.pool.shape[1], m.cfg.latent_dim, dtype=torch.bfloat16,
                       device="cuda")
    dr.make_pool(probe.pool.shape[1])
    ceil, fit = k2_rank.ceilings(), k2_rank.allreduce_fit()
    for _ in range(2):
        row = k2_rank.measure_row(m, dr, pool, 300, 3, 16, ceil, fit, iters=3)
        assert row["graphs"] and row["graph_errors"] == {}, row["graph_errors"]
        assert row["step_ms"] > 0 and all(p["median_ms"] > 0 for p in row["pieces"].values())
        assert set(row["parts"]) == set(probe.parts())
        assert row["profile"] is not None and row["profile"]["kernels_per_step"] > 0


@pytest.mark.gpu
def test_gpu_compiled_step_graph_replay_matches_plain():
    """Inductor-compiled pieces: each piece on the same inputs within a few bf16 roundings of the plain one
    (the router's experts exactly, from the same bf16 scores; its fp32 weights to 1e-6); inside
    the captured step the same accepted lengths and the argmax almost everywhere (60 layers of bf16
    differences compound)."""
    d = small_config(hidden_size=256, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=8)
    m = RankModel(RankShape(ModelConfig.from_dict(d), tp=2, rank=0, moe_mode="tp"), device="cuda")
    dr = RankDrafter(m, DraftShape(2, 4, 2, 64, 256, 8, (0, 2)))
    st = RankStep(m, streams=3, context=300, budget=16, drafter=dr, accepted=4)
    dr.make_pool(st.pool.shape[1])
    st.run(save=True)
    torch.cuda.synchronize()
    argmax = st.argmax.clone()
    c, L, M = m.cfg, m.layers[1], st.M
    g = torch.Generator(device="cuda").manual_seed(5)
    h = torch.randn(M, c.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    cos, sin = (torch.rand(M, c.qk_rope_head_dim // 2, device="cuda", generator=g).to(torch.bfloat16)
                for _ in "cs")
    o_lat = torch.randn(M, m.heads, c.kv_lora_rank, device="cuda", generator=g)
    pre_w, post_w = [L[k] for k in rank_mod._PRE], [L[k] for k in rank_mod._POST]
    plain_post = m._post(h, o_lat, *post_w)
    logits = plain_post[3]  # the router's logits, from the shared expert's GEMM: both routes read these
    plain = (m._pre(h, cos, sin, *pre_w), plain_post, m._route(logits, L["router_bias"]))
    torch._dynamo.reset()
    m.compile_pieces()
    got = (m._pre_fn(h, cos, sin, *pre_w), m._post_fn(h, o_lat, *post_w),
           m._route_fn(logits, L["router_bias"]))
    for name, a, b in zip(("pre", "post"), got[:2], plain[:2], strict=True):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            err = float((x.float() - y.float()).norm() / y.float().norm())
            assert err < 1e-2, (name, i, err)
    (w_got, ids_got), (w_plain, ids_plain) = got[2], plain[2]  # the router's [M, k] weights and experts
    assert torch.equal(ids_got, ids_plain)
    # the weights: the fused normalisation may round differently
    torch.testing.assert_close(w_got, w_plain, rtol=1e-6, atol=0)
    st.run(save=True)  # compiles the step's row count
    timing, err = k2_rank.timed(st.run, torch.cuda.graph_pool_handle(), iters=3)
    assert err is None, err
    torch.cuda.synchronize()
    assert st.tau.tolist() == [4, 4, 4]
    assert float((st.argmax == argmax).float().mean()) >= 0.9
