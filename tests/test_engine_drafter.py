"""kdlib.engine.drafter: the DFlash block drafter (inference == training forward, persistence,
training step)."""

import numpy as np
import pytest
import torch
from test_engine_generate import assert_equals_ar_up_to_near_tie

from kdlib import DATA, check
from kdlib.engine.config import ModelConfig
from kdlib.engine.drafter import DFlashConfig, DFlashDrafter, NoisyOracleDrafter, default_target_layers
from kdlib.engine.generate import generate
from kdlib.engine.model import Model


@pytest.fixture(scope="module")
def target():
    return Model.random(ModelConfig.from_json(DATA / "configs" / "tiny-a.json"), seed=4)


def _drafter(target, seed=0, **kw):
    return DFlashDrafter(DFlashConfig.for_target(target.cfg, num_layers=2, block_size=5,
                                                 target_layer_ids=(0, 2), **kw), seed=seed)


def _seq(target, T=30, seed=0):
    ids = torch.randint(0, target.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(seed))
    _, _, feats = target.forward_plain(ids, capture=(0, 2))
    return ids, feats


def test_default_taps():
    assert default_target_layers(61, 5) == (1, 15, 30, 44, 58)
    assert default_target_layers(61, 1) == (30,)
    assert default_target_layers(3, 2) == (1,)


def test_inference_equals_training_forward(target):
    """draft(bonus=x_a, s=a) after the context 0..a-1 == block_forward's block at anchor a."""
    d = _drafter(target)
    ids, feats = _seq(target)
    anchors = torch.tensor([3, 11, 12, 25])
    train = d.block_forward(target, ids, feats, anchors)  # [A, L, V]
    for i, a in enumerate(anchors.tolist()):
        d.begin(target, ids[:a], feats[:a], 8)
        check.assert_close(d.draft(int(ids[a]), a), train[i], rtol=1e-5, name=f"anchor {a}", quiet=True)


def test_incremental_commit_equals_one_shot(target):
    d = _drafter(target)
    ids, feats = _seq(target)
    d.begin(target, ids[:20], feats[:20], 8)
    one = d.draft(int(ids[20]), 20)
    d.begin(target, ids[:7], feats[:7], 8)
    d.commit(ids[7:12], feats[7:12])
    d.commit(ids[12:20], feats[12:20])
    check.assert_close(d.draft(int(ids[20]), 20), one, rtol=1e-6, name="incremental context")
    with pytest.raises(ValueError, match="position"):
        d.draft(1, 19)


def test_save_load_round_trip(target, tmp_path):
    d = _drafter(target, seed=3)
    d.save(tmp_path / "d.kdtr", metadata={"note": "test"})
    d2 = DFlashDrafter.load(tmp_path / "d.kdtr")
    assert d2.c == d.c
    for k, v in d.state_dict().items():
        check.assert_equal(d2.state_dict()[k], v, name=k, quiet=True)
    assert not any(k.startswith(("embed", "lm_head")) for k in d.state_dict())


def test_training_step_lowers_the_loss(target):
    """The training forward is differentiable in the drafter only, and a few steps fit one sequence."""
    target.requires_grad_(False)
    d = _drafter(target, seed=1)
    ids, feats = _seq(target, T=40, seed=2)
    anchors = torch.arange(0, 36, 3)
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = d.loss(target, ids, feats, anchors, gamma=4.0)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.7 * first
    assert all(p.grad is None for p in target.parameters())


def test_ddtree_with_dflash_equals_ar(target):
    d = _drafter(target, seed=5)
    for budget, k in ((0, None), (3, 1), (9, 2), (20, None)):
        ar = generate(target, [5, 6, 7], 20)
        dd = generate(target, [5, 6, 7], 20, method="ddtree", drafter=d, budget=budget, top_k=k)
        assert_equals_ar_up_to_near_tie(target, [5, 6, 7], ar.tokens, dd.tokens, (budget, k))


def test_a_float32_drafter_drafts_for_a_bfloat16_target():
    """DFlashDrafter.load gives float32 by default; its block ran the bfloat16 target's head on float32
    states and failed on the first draft. The head now runs in its own dtype, and DDTree equals AR."""
    bf16 = Model.random(ModelConfig.from_json(DATA / "configs" / "tiny-a.json"), seed=4, dtype=torch.bfloat16)
    d = _drafter(bf16, seed=5)
    assert next(d.parameters()).dtype == torch.float32
    ar = generate(bf16, [5, 6, 7], 12)
    dd = generate(bf16, [5, 6, 7], 12, method="ddtree", drafter=d, budget=6)
    assert_equals_ar_up_to_near_tie(bf16, [5, 6, 7], ar.tokens, dd.tokens)


def test_commit_refuses_features_that_are_not_the_tokens(target):
    """The context advanced by the features' rows whatever the tokens (3 tokens, 1 row: a drafter a
    position short, found only at the next draft); None failed with an AttributeError."""
    d = _drafter(target, seed=2)
    ids, feats = _seq(target, T=10, seed=1)
    d.begin(target, ids, feats, 8)
    for bad in (feats[:1], None, feats[:3, :-1]):
        with pytest.raises(ValueError, match="commits the target's features of each token"):
            d.commit(ids[:3], bad)
    d.commit(ids[:3], feats[:3])


def test_config_errors(target):
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.for_target(target.cfg, mask_token_id=10_000).validate()
    d = _drafter(target)
    bad = DFlashDrafter(DFlashConfig.for_target(target.cfg, target_layer_ids=(7,)))
    with pytest.raises(ValueError, match="not layers"):
        bad.begin(target, torch.tensor([1]), torch.zeros(1, target.cfg.hidden_size), 4)
    assert d.block_size == 5 and d.vocab_size == target.cfg.vocab_size


def test_the_oracle_refuses_a_margin_that_unmakes_p_wrong_and_a_fractional_block():
    """At margin 0 or below the chosen token need not be the top one: p_wrong = 0 accepted 2.24 (margin 0)
    and 1.0 (margin -1) tokens a step, not whole blocks; block_size 2.5 failed later inside generate."""
    with pytest.raises(ValueError, match="margin must be > 0"):
        NoisyOracleDrafter(96, 0.0, block_size=5, margin=0.0)
    with pytest.raises(ValueError, match="block_size must be an int >= 2"):
        NoisyOracleDrafter(96, 0.0, block_size=2.5)


@pytest.mark.parametrize("seed", [-1, 1.5, True, None])
def test_the_oracle_refuses_a_bad_seed_before_generate_computes(target, seed, monkeypatch):
    """The seed went unchecked to np.random.PCG64 in `begin`, which raised after generate's prefill."""
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        d = NoisyOracleDrafter(target.cfg.vocab_size, 0.1, block_size=4, seed=seed)
        monkeypatch.setattr(target, "prefill", lambda *a, **k: pytest.fail("computed before validating"))
        generate(target, [1, 2, 3], 4, method="ddtree", drafter=d)


def test_sizes_must_be_ints_and_numpy_ints_are_taken(target, tmp_path):
    """block_size 4.0 failed at generate's cache ("num_slots must be an int >= 1, got 14.0"), vocab_size
    96.0 with a TypeError after the prefill; np.int64(4) was refused by the oracle, and taken by DFlash
    but then broke `save` (not JSON)."""
    cfg = target.cfg
    with pytest.raises(ValueError, match="vocab_size must be an int >= 2, got 96.0"):
        NoisyOracleDrafter(96.0, 0.1, block_size=4)
    assert NoisyOracleDrafter(np.int64(96), 0.1, block_size=np.int64(4)).block_size == 4
    for field, bad in (("block_size", 4.0), ("num_heads", 2.5), ("head_dim", True), ("intermediate_size", 0)):
        with pytest.raises(ValueError, match=f"{field} must be an int >= "):
            DFlashDrafter(DFlashConfig.for_target(cfg, **{field: bad}))
    with pytest.raises(ValueError, match="mask_token_id must be an int >= 0, got 95.0"):
        DFlashDrafter(DFlashConfig.for_target(cfg, mask_token_id=95.0))
    d = DFlashDrafter(DFlashConfig.for_target(cfg, block_size=np.int64(4), target_layer_ids=(np.int64(1),)))
    assert type(d.block_size) is int and type(d.target_layer_ids[0]) is int
    d.save(tmp_path / "d.kdtr")
    assert DFlashDrafter.load(tmp_path / "d.kdtr").c == d.c


def test_loss_refuses_a_gamma_that_is_not_positive_and_anchors_outside_the_sequence(target):
    """gamma 0 gave nan, a negative gamma weighted later slots more; anchor -1 wrapped to the last token."""
    d = _drafter(target)
    ids, feats = _seq(target, T=20)
    anchors = torch.tensor([0, 5, 10])
    assert torch.isfinite(d.loss(target, ids, feats, anchors, gamma=1.0))
    for gamma in (0.0, -1.0, float("nan"), "2"):
        with pytest.raises(ValueError, match="gamma must be a number > 0 or None"):
            d.loss(target, ids, feats, anchors, gamma=gamma)
    for bad in ([-1, 5], [5, 20]):
        with pytest.raises(ValueError, match=r"anchors must lie in \[0, 20\)"):
            d.loss(target, ids, feats, torch.tensor(bad))
