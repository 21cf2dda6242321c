"""kdlib.engine.rank's RankTarget / RankDrafter.make_lanes: one tensor-parallel rank run by the batched
engine. On the CPU at a scaled-down Kimi-K2.6 config: DDTree's tokens equal AR's under continuous batching
(one request waits for a lane), a prompt's last prefill row equals that token verified as one row over the
paged pool, the chunked prefill against RankStep's verify, the synthetic prefill's scales, clear errors. On
CUDA (marked gpu) the real config cut to 4 layers (tp 8, INT4 experts): graphs == eager, DDTree == AR, and
the timing mode (uniform experts, synthetic 5,000-token contexts) replayed in graphs without overflow.

bf16 everywhere: two computations of the same logits differ by roundings, so token streams are compared
up to near ties (`_assert_agree`): each emitted token is greedy within TIE of the target's teacher-forced
logits, and where two streams part, the two tokens' logits lie within TIE of each other. On the GPU the
router's choice is pinned (a rounding flips near ties of a random 384-expert router) and the gap allowed
is at least twice the measured gap between two chunkings of the same logits."""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
from functools import cache

import pytest
import torch
from test_k2_rank import small_config

from kdlib import memory
from kdlib.engine.batch import BatchEngine, generate_batch
from kdlib.engine.config import ModelConfig
from kdlib.engine.rank import (
    DFLASH_KIMI,
    DraftShape,
    RankDrafter,
    RankModel,
    RankShape,
    RankStep,
    RankTarget,
)

TIE = {"cpu": 0.05, "cuda": 0.1}  # logit gap (logits ~ N(0, 1)) within which a greedy choice may flip
SMALL_DRAFT = DraftShape(2, 4, 2, 32, 256, 4, (0, 2))


@cache
def _model(tp: int, rank: int, vocab: int = 96, device: str = "cpu") -> RankModel:
    """Kimi-K2.6 scaled down: 3 layers (the first dense), 16 experts top-2, a small vocabulary (the drafter's
    top-K then holds the target's token now and then: trees get accepted)."""
    cfg = ModelConfig.from_dict(small_config(num_experts_per_tok=2, vocab_size=vocab))
    return RankModel(RankShape(cfg, tp=tp, rank=rank), device=device, seed=0)


def _prompts(lengths, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@contextmanager
def _pinned_router(m: RankModel, seed: int = 3):
    """Each MoE layer's top-k pinned to k experts by a bias of 2 (sigmoid scores lie in (0, 1)); the weights
    still come from the scores. A random router's near ties flip under roundings that differ between two
    computations of the same rows (another chunking, another batch), which moves h far beyond the
    roundings: where a test compares such computations, it pins the choice. The biases come back after."""
    c = m.cfg
    saved = [(L, L["router_bias"].clone()) for L in m.layers if "router_bias" in L]
    g = torch.Generator().manual_seed(seed)
    for L, _ in saved:
        pick = torch.randperm(c.n_routed_experts, generator=g)[: c.num_experts_per_tok]
        L["router_bias"].zero_()[pick.to(L["router_bias"].device)] = 2.0
    try:
        yield m
    finally:
        for L, b in saved:
            L["router_bias"].copy_(b)


def _assert_agree(target: RankTarget, prompt: list[int], a: list[int], b: list[int],
                  tie: float | None = None) -> None:
    """a and b are greedy continuations of prompt under target, equal up to a near tie (module docstring;
    tie: the gap allowed, TIE of the device by default)."""
    tie = TIE[target.device.type] if tie is None else tie
    for seq in (a, b):
        logits = target.logits(prompt + seq)[len(prompt) - 1 : -1]  # [n, V_r] row i predicts seq[i]
        ids = torch.tensor(seq, device=logits.device)[:, None]  # [n, 1]
        short = logits.max(-1).values - logits.gather(1, ids)[:, 0]
        assert float(short.max()) <= tie, (seq, short.tolist())
    part = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    if part is not None:
        row = target.logits(prompt + a[:part])[-1]
        assert abs(float(row[a[part]] - row[b[part]])) <= tie, (part, a, b)


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("tp,rank", [(2, 0), (1, 0), (2, 1)])
def test_engine_ddtree_equals_ar(tp, rank):
    with _pinned_router(_model(tp, rank)) as m:
        _engine_ddtree_equals_ar(m)


def _engine_ddtree_equals_ar(m: RankModel) -> None:
    c = m.cfg  # bound = M (factor E / k): no expert overflows, so the target is a pure function of the tokens
    target = RankTarget(m, routing="router", prefill="layers", max_rows=2 * 9,
                        bound_factor=c.n_routed_experts / c.num_experts_per_tok)
    V = target.cfg.vocab_size
    assert V == m.shape.vocab_range[1] - m.shape.vocab_range[0]
    prompts = _prompts((5, 23, 70), V)  # 70 > the 64-row prefill chunk
    ar = generate_batch(target, prompts, 10, method="ar", max_streams=2)
    d = RankDrafter(m, SMALL_DRAFT)
    eng = BatchEngine(target, max_streams=2, method="ddtree", drafter=d, budget=8, max_context=90,
                      keep_results=True)
    rids = [eng.add_request(p, 10) for p in prompts]
    eng.step()
    assert eng.num_running == 2 and eng.num_waiting == 1  # the third request waits for a lane
    while eng.has_work():
        eng.step()
    dd = [eng.result(r) for r in rids]
    for p, x, y in zip(prompts, ar, dd, strict=True):
        assert len(y.tokens) == 10
        _assert_agree(target, p, x.tokens, y.tokens)
    assert max(n for r in dd for n in r.accepted) >= 2  # some tree was accepted past its root
    assert eng.pool_free_slots == eng.pool_slots
    assert int(target.overflow) == 0


def test_last_prefill_row_equals_one_verify_row():
    """forward_plain(prompt)'s last row against prompt[:-1]'s prefill in a paged pool (scattered slots)
    plus the last token verified as one row by forward_batch."""
    with _pinned_router(_model(2, 1)) as m:
        _last_prefill_row_equals_one_verify_row(m)


def _last_prefill_row_equals_one_verify_row(m: RankModel) -> None:
    t = RankTarget(m)
    c, (p,) = t.cfg, _prompts((30,), t.cfg.vocab_size, seed=4)
    h, lats, _ = t.forward_plain(p)
    want = t.head(h[-1:])  # [1, V_r]
    _, prefix, _ = t.forward_plain(p[:-1])  # [P - 1, layers, D]
    S = 64
    kv = torch.zeros(c.num_hidden_layers, S + 1, c.latent_dim, dtype=torch.bfloat16)
    table = torch.randperm(S, generator=torch.Generator().manual_seed(0))[None, :40]  # [1, 40]
    kv[:, table[0, : len(p) - 1]] = prefix.transpose(0, 1)
    h1, _ = t.forward_batch(kv, table, torch.tensor([len(p) - 1]), torch.tensor([[p[-1]]]),
                            torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1, 1, dtype=torch.bool))
    torch.testing.assert_close(t.head(h1), want, atol=0.05, rtol=0.02)
    # the verify row's latents went to its slot: the prefill's last row
    torch.testing.assert_close(kv[:, table[0, len(p) - 1]].float(), lats[-1].float(), atol=0.05, rtol=0.02)


def test_chunked_prefill_matches_rank_step_verify():
    """The prefill's latent rows do not depend on the chunking, and RankStep's verify (its own buffers,
    one AR row at position s over the prefill's prefix) writes row s of the prefill's cache."""
    with _pinned_router(_model(2, 1)) as m:
        _chunked_prefill_matches_rank_step_verify(m)


def _chunked_prefill_matches_rank_step_verify(m: RankModel) -> None:
    free = m.cfg.n_routed_experts / m.cfg.num_experts_per_tok  # bound = M: no slot dropped at any chunking
    (p,) = _prompts((70,), RankTarget(m).cfg.vocab_size, seed=2)
    h64, lats64, f64 = RankTarget(m, bound_factor=free).forward_plain(p, (0, 2))
    h5, lats5, f5 = RankTarget(m, chunk=5, bound_factor=free).forward_plain(p, (0, 2))
    torch.testing.assert_close(lats5.float(), lats64.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(h5.float(), h64.float(), atol=0.05, rtol=0.02)
    assert f64.shape == (70, 2 * m.cfg.hidden_size)
    torch.testing.assert_close(f64[:, -m.cfg.hidden_size:], h64)  # the last layer's tap is its output
    s = 41
    st = RankStep(m, streams=1, context=s, routing="router", bound_factor=free)
    st.pool[:, st.table[0, :s]] = lats64[:s].transpose(0, 1)
    st.tokens.fill_(p[s] + m.shape.vocab_range[0])  # RankStep's ids are global
    st.part("verify")
    torch.testing.assert_close(st.pool[:, st.table[0, s]].float(), lats64[s].float(), atol=0.05, rtol=0.02)


def test_synthetic_prefill_scales_and_engine_steps():
    m = _model(2, 0)
    t = RankTarget(m, routing="uniform", prefill="synthetic", max_rows=2 * 9)
    c, r = t.cfg, t.cfg.kv_lora_rank
    (p,) = _prompts((300,), c.vocab_size, seed=3)
    h, lats, feats = t.forward_plain(p)
    assert feats is None and lats.shape == (300, c.num_hidden_layers, c.latent_dim)
    torch.testing.assert_close(h, m.embed_rows(torch.tensor(p[-1:])))
    rms = lats[..., :r].float().pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=0.02, rtol=0)  # c_kv as kv_a_norm leaves it
    assert abs(float(lats[..., r:].float().std()) - 1) < 0.05  # the RoPE part at unit scale
    assert t.route_ids.shape == (c.num_hidden_layers, 18, c.num_experts_per_tok)
    d = RankDrafter(m, SMALL_DRAFT)
    eng = BatchEngine(t, max_streams=2, method="ddtree", drafter=d, budget=8, max_context=400,
                      keep_results=True)
    rids = [eng.add_request(q, 4) for q in _prompts((300, 120), c.vocab_size, seed=5)]
    while eng.has_work():
        eng.step()
    assert all(len(eng.result(i).tokens) == 4 for i in rids)
    k = eng.drafter.kv[:, 0, :300].float()  # lane 0's context keys, random at k_norm's scale
    torch.testing.assert_close(k.pow(2).mean(-1).sqrt(), torch.ones(k.shape[:-1]), atol=0.02, rtol=0)
    assert int(t.overflow) == 0
    with pytest.raises(ValueError, match="no logits"):
        t.logits(p)


def test_bad_arguments_are_clear():
    m = _model(2, 0)
    for kw, msg in ((dict(routing="hash"), "routing must be one of"), (dict(prefill="fast"), "prefill must"),
                    (dict(max_rows=0), "max_rows must"), (dict(chunk=65), "chunk must"),
                    (dict(bound_factor=0), "bound_factor")):
        with pytest.raises(ValueError, match=msg):
            RankTarget(m, **kw)
    t = RankTarget(m, max_rows=8)
    small = dict(max_streams=2, max_context=64)  # a small pool
    eng = BatchEngine(t, method="ddtree", drafter=RankDrafter(m, SMALL_DRAFT), budget=8, **small)
    eng.add_request([1, 2, 3], 4)
    with pytest.raises(ValueError, match="exceeds RankTarget's max_rows 8"):
        eng.step()
    other = RankDrafter(_model(1, 0), SMALL_DRAFT)  # a RankModel of another shape
    with pytest.raises(ValueError, match="vocabulary"):
        BatchEngine(t, method="ddtree", drafter=other, budget=4, **small)
    twin = RankDrafter(RankModel(m.shape, device="cpu", seed=0), SMALL_DRAFT)  # same shape, another model
    with pytest.raises(ValueError, match="RankModel it was built on"):
        BatchEngine(t, method="ddtree", drafter=twin, budget=4, **small)
    deep = RankDrafter(m, dataclasses.replace(SMALL_DRAFT, target_layer_ids=(0, 3)))
    with pytest.raises(ValueError, match=r"target layers \[3\]"):
        BatchEngine(t, method="ddtree", drafter=deep, budget=4, **small)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        t.forward_plain([t.cfg.vocab_size])  # shard-local ids only


# ----------------------------------------------------------------------------- GPU
@cache
def _k2_rank(layers: int = 4) -> RankModel:
    """Kimi-K2.6 at its real shapes cut to `layers` (the dense first + MoE), rank 0 of tp 8, INT4 experts."""
    d = json.loads((memory.CONFIGS / "kimi-k2.6.json").read_text())
    d["text_config"]["num_hidden_layers"] = layers
    return RankModel(RankShape(ModelConfig.from_dict(d), tp=8, rank=0), device="cuda", seed=0)


def _k2_drafter(m: RankModel) -> RankDrafter:
    """The published DFlash shape reading the cut model's layers."""
    return RankDrafter(m, dataclasses.replace(DFLASH_KIMI, target_layer_ids=(1, 2, 3)))


@pytest.mark.gpu
def test_gpu_graphs_equal_eager_and_ddtree_equals_ar():
    m = _k2_rank()
    c = m.cfg
    # bound = M (factor E / k): no expert can overflow, so the target is a pure function of the tokens
    t = RankTarget(m, routing="router", prefill="layers", max_rows=2 * 17,
                   bound_factor=c.n_routed_experts / c.num_experts_per_tok)
    with _pinned_router(m):  # the random 384-expert router's near ties (the uniform test forces its ids)
        _graphs_ddtree_agree(m, t)


def _graphs_ddtree_agree(m: RankModel, t: RankTarget) -> None:
    c = m.cfg
    prompts = _prompts((40, 37), t.cfg.vocab_size, seed=7)
    runs = {g: generate_batch(t, prompts, 16, method="ar", graphs=g) for g in (False, True)}
    dd = generate_batch(t, prompts, 16, method="ddtree", drafter=_k2_drafter(m), budget=16, graphs=True)
    # the gap allowed: twice what two chunkings of the same teacher-forced logits differ by (other matmul
    # shapes, the same tokens), at least TIE; with the router's choice pinned no rounding flips an expert
    other = RankTarget(m, routing="router", prefill="layers", max_rows=2 * 17, chunk=16,
                       bound_factor=c.n_routed_experts / c.num_experts_per_tok)
    noise = max(float((t.logits(p + r.tokens) - other.logits(p + r.tokens)).abs().max())
                for p, r in zip(prompts, runs[True], strict=True))
    tie = max(TIE["cuda"], 2 * noise)
    for i, p in enumerate(prompts):
        _assert_agree(t, p, runs[True][i].tokens, runs[False][i].tokens, tie)
        _assert_agree(t, p, runs[True][i].tokens, dd[i].tokens, tie)
    assert noise < 0.25, noise  # logits ~ N(0, 1): bf16 roundings through 4 layers, no flipped expert
    assert int(t.overflow) == 0


@pytest.mark.gpu
def test_gpu_uniform_synthetic_5000_steps_replay_in_graphs():
    m = _k2_rank()
    t = RankTarget(m, routing="uniform", prefill="synthetic", max_rows=4 * 17)
    for method, kw in (("ar", {}), ("ddtree", dict(drafter=_k2_drafter(m), budget=16))):
        eng = BatchEngine(t, max_streams=4, method=method, max_context=5016, **kw)
        assert eng.graphs
        eng.replay_ms = []
        for p in _prompts((5000,) * 4, t.cfg.vocab_size, seed=8):
            eng.add_request(p, 6)
        while eng.has_work():
            eng.step()
        assert len(eng.replay_ms) == len(eng.step_ms) >= 1, method
        assert all(ms > 0 for ms in eng.replay_ms), method
    assert int(t.overflow) == 0
