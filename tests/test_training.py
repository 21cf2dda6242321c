"""kdlib.training: the batched training forwards equal the engine's, a few steps reduce the loss, bad input."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlib import DATA
from kdlib import training as T
from kdlib.engine.cache import LatentCache
from kdlib.engine.config import ModelConfig
from kdlib.engine.generate import generate
from kdlib.engine.model import Model


def _micro_target(vocab=64, seed=0) -> Model:
    cfg = T.target_config(vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                          num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                          v_head_dim=8, n_routed_experts=4, max_position_embeddings=256)
    m = Model(ModelConfig.from_dict(cfg))
    T.init_target(m, seed)
    return m


def _micro_drafter(target, block=6, seed=0):
    torch.manual_seed(seed)
    dc = T.DraftConfig(hidden_size=target.cfg.hidden_size, target_layer_ids=(0, target.cfg.num_hidden_layers - 1),
                       mask_token_id=1, block_size=block, num_layers=2, num_heads=2, head_dim=8, intermediate_size=32)
    return T.DraftNet(dc, target.cfg)


def _streams(vocab, period=12, n=4000):
    """A periodic stream (learnable in a few steps) for every kind's train split."""
    s = (np.arange(n) % period + 2).astype(np.int32) % vocab
    return {(k, "train"): s for k in ("code", "prose", "templated")}


@pytest.mark.parametrize("name", ["tiny-a", "tiny-b"])
def test_target_forward_equals_engine(name):
    """The batched training forward (SDPA MLA, dense-expert MoE) is the engine's model, row by row."""
    cfg = ModelConfig.from_json(DATA / "configs" / f"{name}.json")
    m = Model.random(cfg, seed=3)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 17)))
    capture = (0, cfg.num_hidden_layers - 1)
    with torch.no_grad():
        h, taps = T.target_forward(m, ids, capture=capture)
        for b in range(ids.shape[0]):
            h_ref, _, taps_ref = m.forward_plain(ids[b], capture=capture)
            torch.testing.assert_close(m.head(h[b]), m.logits(ids[b]), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(taps[b], taps_ref, rtol=1e-5, atol=1e-5)


def test_block_forward_equals_inference_draft():
    """Training blocks (many anchors, block-attention mask) give the logits the engine's DFlashDrafter
    gives, with the same weights, after a prefill of the anchor's prefix."""
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    target = Model.random(cfg, seed=1)
    net = _micro_drafter(target).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24)))
    anchors = torch.tensor([[1, 5, 17], [3, 9, 18]])
    with torch.no_grad():
        _, feats = T.target_forward(target, ids, capture=net.cfg.target_layer_ids)
        logits, labels = net.block_forward(target, ids, feats, anchors)
    d = T.to_engine(net.cfg, cfg.vocab_size, net.state_dict())
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            assert labels[b, j].tolist() == ids[b, a + 1 : a + net.cfg.block_size].tolist()
            cache = LatentCache(cfg, 64)
            _, f = target.prefill(cache, ids[b, :a], net.cfg.target_layer_ids)
            d.begin(target, ids[b, :a], f, 8)
            torch.testing.assert_close(d.draft(int(ids[b, a]), a), logits[b, j], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="position"):
        d.draft(0, 3)


def test_a_few_target_steps_reduce_the_loss():
    target = _micro_target()
    streams = _streams(64)
    window = streams[("code", "train")]
    before = T.evaluate_target(target, window, 32, 8, max_windows=8)["nll"]
    spec = T.TrainSpec(max_steps=3, batch=8, seq=32, lr=1e-2, warmup_steps=1, log_every=1)
    curve = T.train_target(target, streams, spec, log=lambda _: None)
    after = T.evaluate_target(target, window, 32, 8, max_windows=8)["nll"]
    assert curve["steps"] == 3 and len(curve["loss"]) == 3
    assert after < before


def test_a_few_drafter_steps_reduce_the_loss_and_ddtree_stays_exact():
    target = _micro_target()
    streams = _streams(64)
    T.train_target(target, streams, T.TrainSpec(max_steps=20, batch=8, seq=32, lr=1e-2, warmup_steps=1,
                                                log_every=10), log=lambda _: None)
    net = _micro_drafter(target)
    window = streams[("code", "train")]
    before = T.evaluate_drafter(net, target, window, 32, 8, windows=8)["loss"]
    spec = T.TrainSpec(max_steps=3, batch=8, seq=32, lr=1e-2, warmup_steps=1, log_every=1, anchors=8)
    T.train_drafter(net, target, streams, spec, log=lambda _: None)
    after = T.evaluate_drafter(net, target, window, 32, 8, windows=8)["loss"]
    assert after < before
    assert not any(p.requires_grad for p in target.parameters())  # the target stayed frozen
    d = T.to_engine(net.cfg, target.cfg.vocab_size, net.state_dict())
    prompt = window[:20].tolist()
    ar = generate(target, prompt, 24)
    for budget in (4, 16):
        assert generate(target, prompt, 24, method="ddtree", drafter=d, budget=budget).tokens == ar.tokens


def test_kept_state_is_the_best_validation_score():
    target = _micro_target()
    scores = iter([3.0, 1.0, 2.0])
    snapshots = []

    def eval_fn():
        snapshots.append(target.model.norm.weight.detach().clone())
        return {"score": next(scores)}

    spec = T.TrainSpec(max_steps=3, batch=4, seq=16, lr=1e-2, warmup_steps=1, log_every=1)
    curve = T.train_target(target, _streams(64), spec, log=lambda _: None, eval_fn=eval_fn, eval_every=1)
    assert curve["kept_step"] == 2
    torch.testing.assert_close(target.model.norm.weight, snapshots[1])


def test_router_bias_moves_towards_the_mean_load():
    target = _micro_target()
    n_moe = sum(cfg_is for cfg_is in target.cfg.is_moe_layer)
    loads = [torch.tensor([10, 0, 3, 3])] * n_moe
    T.balance_router(target, loads, rate=0.5)
    bias = target.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.tolist() == [-0.5, 0.5, 0.5, 0.5]


@settings(max_examples=25, deadline=None)
@given(st.text(max_size=200))
def test_tokenizer_round_trips(text):
    assert _tok().decode(_tok().encode(text, add_special_tokens=False).ids) == text


_TOK = []


def _tok():
    if not _TOK:
        _TOK.append(T.train_tokenizer(["def f(x):\n    return x + 1\n", "Hello, world. " * 20, "é ü 中文 🙂"], 300))
    return _TOK[0]


def test_bad_input():
    with pytest.raises(ValueError, match="vocab_size"):
        T.train_tokenizer(["x"], 100)
    with pytest.raises(ValueError, match="unknown"):
        T.target_config(64, hidden=3)
    with pytest.raises(ValueError, match="block_size"):
        T.DraftConfig(hidden_size=32, target_layer_ids=(0,), mask_token_id=1, block_size=1)
    target = _micro_target()
    with pytest.raises(ValueError, match="hidden"):
        T.DraftNet(T.DraftConfig(hidden_size=48, target_layer_ids=(0,), mask_token_id=1), target.cfg)
    with pytest.raises(ValueError, match="target_layer_ids"):
        T.DraftNet(T.DraftConfig(hidden_size=32, target_layer_ids=(5,), mask_token_id=1), target.cfg)
    with pytest.raises(ValueError, match="anchor"):
        T.drafter_loss(_micro_drafter(target, block=16), target, torch.zeros(2, 10, dtype=torch.int64), 4,
                       torch.Generator())
    with pytest.raises(ValueError, match="names"):
        T.to_engine(_micro_drafter(target).cfg, 64, {"fc.weight": torch.zeros(32, 64)})
