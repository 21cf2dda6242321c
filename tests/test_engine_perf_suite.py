"""The engine perf suite's CPU-checkable parts: byte/FLOP accounting and the row format the
estimator reads."""

import numpy as np
import pytest

import kdlib.perf as perf
from kdlib import DATA
from kdlib.engine.config import ModelConfig
from kdlib.engine.loading import parameter_shapes, random_weights_on_device
from kdlib.engine.model import Model
from kdlib.estimator import engine_rows
from kdlib.perf.suites import engine as suite


def test_bench_config_parses_and_is_kernel_compatible():
    cfg = ModelConfig.from_dict(suite.BENCH_CONFIG)
    assert cfg.latent_dim == 576 and cfg.qk_head_dim == 192  # the kernels' MLA shape
    assert suite.BLOCK - 1 <= 16


def test_verify_cost_counts_every_weight_once():
    cfg = ModelConfig.from_dict(suite.BENCH_CONFIG)
    shapes = parameter_shapes(cfg)
    n = sum(
        int(np.prod(s)) for k, s in shapes.items() if "norm" not in k and "embed" not in k and "bias" not in k
    )
    nbytes, flops = suite.verify_cost(cfg, 0, 1000, 2)  # q large: every expert touched
    kv = cfg.num_hidden_layers * 1000 * cfg.latent_dim * 2
    assert nbytes - kv == pytest.approx(2 * n, rel=1e-9)
    b1, f1 = suite.verify_cost(cfg, 4096, 1, 2)
    b2, f2 = suite.verify_cost(cfg, 8192, 1, 2)
    assert b2 - b1 == cfg.num_hidden_layers * 4096 * cfg.latent_dim * 2 and f2 > f1
    # FLOPs: 2 per active weight per row (the absorb projections are kv_b_proj's weights, counted once)
    # plus scores and values over the keys; at no context and one row, the keys are the row itself
    _, f0 = suite.verify_cost(cfg, 0, 1, 2)
    att = cfg.num_hidden_layers * 2 * cfg.num_attention_heads * (cfg.latent_dim + cfg.kv_lora_rank)
    H, expert = cfg.hidden_size, 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = (cfg.n_routed_experts - cfg.num_experts_per_tok) * expert + cfg.n_routed_experts * H  # and router
    own_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * H
    active = n - own_head - (cfg.num_hidden_layers - cfg.first_k_dense_replace) * idle + cfg.vocab_size * H
    assert f0 == pytest.approx(2 * active + att, rel=1e-9)
    # 9 rows of top-4 over 32 experts touch 22.4 on average, not min(32, 36): a floor counts no more
    b9, _ = suite.verify_cost(cfg, 0, 9, 2)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert b9 - b1 + cfg.num_hidden_layers * 4096 * cfg.latent_dim * 2 == pytest.approx(
        2 * (n_moe * (E * (1 - (1 - k / E) ** 9) - k) * expert + cfg.num_hidden_layers * 8 * cfg.latent_dim),
        rel=1e-9)


def test_rows_feed_the_estimator():
    model = Model.random(ModelConfig.from_json(DATA / "configs" / "tiny-a.json"), seed=0)
    rows = suite._generate_sweep(model, [8], [4], [0.3], 10, np.random.default_rng(0))
    assert [r["method"] for r in rows] == ["ar", "ddtree"]
    assert rows[1]["matches_ar"] is True and rows[0]["tokens_per_forward"] == 1.0
    parsed = engine_rows({"runs": rows})
    assert len(parsed) == 1 and parsed[0]["budget"] == 4 and parsed[0]["context"] == 8
    assert set(parsed[0]["phase_ms"]) == {"draft", "build", "verify", "accept", "compaction"}


def test_repeats_keep_the_fastest_and_list_all():
    model = Model.random(ModelConfig.from_json(DATA / "configs" / "tiny-a.json"), seed=0)
    rows = suite._generate_sweep(model, [8], [4, 8], [0.3], 6, np.random.default_rng(0), repeats=3)
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", 0), ("ddtree", 4), ("ddtree", 8)]
    for r in rows:
        assert len(r["repeats"]) == 3 and all(rp["host_probe_ms"] > 0 for rp in r["repeats"])
        assert r["step_ms"] == min(rp["step_ms"] for rp in r["repeats"])
    assert all(r["drafter"] == "noisy_oracle" and r["matches_ar"] is True for r in rows[1:])
    assert "drafter" not in rows[0] and rows[0]["matches_ar"] is None


def test_verify_sweep_runs_with_a_cpu_clock(monkeypatch):
    """The verify-forward sweep's set-up and bookkeeping, with CPU timing standing in for CUDA events."""
    monkeypatch.setattr(perf, "cuda_time", lambda fn, warmup, iters: perf.cpu_time(fn, warmup=1, iters=2))
    model = Model.random(ModelConfig.from_json(DATA / "configs" / "tiny-a.json"), seed=0)
    rows = suite._verify_sweep(
        model, [16, 64], [1, 9, 70], 4.3e12, 790e12, attentions=("torch", "ops"), repeats=2
    )
    pts = [(r["attention"], r["context"], r["q"]) for r in rows]
    assert pts == [
        (a, c, q) for a in ("torch", "ops") for c in (16, 64) for q in (1, 9, 70) if a == "torch" or q <= 65
    ]
    assert model.attention == "torch"
    assert all(r["median_ms"] > 0 and r["floor_ms"] > 0 for r in rows)
    assert all(
        len(r["repeat_medians_ms"]) == 2 and r["median_ms"] == min(r["repeat_medians_ms"]) for r in rows
    )


def test_dflash_sweep_runs_with_a_cpu_clock(monkeypatch):
    monkeypatch.setattr(perf, "cuda_time", lambda fn, warmup, iters: perf.cpu_time(fn, warmup=1, iters=2))
    model = Model.random(ModelConfig.from_json(DATA / "configs" / "tiny-a.json"), seed=0)
    rows = suite._dflash_sweep(model, [16, 40])
    assert [r["context"] for r in rows] == [16, 40] and all(r["median_ms"] > 0 for r in rows)


def test_random_weights_on_device_scales_and_determinism():
    import torch

    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    a, b = Model(cfg).eval(), Model(cfg).eval()
    random_weights_on_device(a, seed=3)
    random_weights_on_device(b, seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for name, p in sa.items():
        if name.endswith("norm.weight"):
            assert abs(float(p.mean()) - 1.0) < 0.1
        elif p.ndim == 2 and name != "model.embed_tokens.weight" and p.numel() >= 4096:
            assert float(p.std()) * p.shape[1] ** 0.5 == pytest.approx(1.0, rel=0.1), name
    random_weights_on_device(b, seed=4)
    assert not torch.equal(sa["lm_head.weight"], b.state_dict()["lm_head.weight"])


def test_quick_suite_end_to_end_on_cpu(monkeypatch):
    """The whole --quick payload on a tiny config with a CPU clock: every section notebooks 03 and 06 read."""
    import json

    monkeypatch.setattr(
        perf, "cuda_time", lambda fn, warmup=3, iters=15: perf.cpu_time(fn, warmup=1, iters=2)
    )
    out = suite._run(True, device="cpu", config=json.loads((DATA / "configs" / "tiny-a.json").read_text()))
    assert {
        "parameters",
        "config",
        "runs",
        "runs_kernel_attention",
        "verify_forward",
        "dflash_draft",
        "trained",
        "bf16",
    } <= set(out)
    assert out["parameters"]["repeats"] == 1 and out["parameters"]["cpu_affinity"]
    assert [r["method"] for r in out["runs"]] == ["ar", "ddtree"] and out["runs"][1]["matches_ar"] is True
    rows = engine_rows(out)
    assert len(rows) == 1 and rows[0]["drafter"] == "noisy_oracle"
