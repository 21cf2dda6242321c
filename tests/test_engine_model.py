"""kdlib.engine model: config parsing, HF checkpoint loading, equality with transformers'
DeepseekV3ForCausalLM, and the absorbed (cached) MLA form against the plain one."""

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from kdlib import DATA, check
from kdlib.engine.cache import LatentCache
from kdlib.engine.config import ConfigError, ModelConfig
from kdlib.engine.loading import save_pretrained
from kdlib.engine.model import Model

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.8,
    "mscale_all_dim": 1.0,
}


def _hf_dict(q_lora, rope, n_group, topk_group, interleave=True, tie=False):
    return dict(
        model_type="deepseek_v3",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        kv_lora_rank=16,
        q_lora_rank=q_lora,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=10,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        rope_scaling=rope,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_interleave=interleave,
        tie_word_embeddings=tie,
    )


CASES = {
    "qlora-yarn-groups2": _hf_dict(24, YARN, 2, 1),
    "no-qlora-yarn-groups4": _hf_dict(None, YARN, 4, 2),
    "no-qlora-plain-rope-neox": _hf_dict(None, None, 1, 1, interleave=False),
    "qlora-yarn-defaults-tied": _hf_dict(
        24, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}, 2, 2, tie=True
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case, tmp_path):
    """A random HF DeepseekV3ForCausalLM, saved with save_pretrained, loads and gives the same logits
    (FP32)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = ModelConfig.from_dict(CASES[case])
    hd = cfg.to_hf_dict()
    for k in ("model_type", "architectures"):
        hd.pop(k)
    hcfg = DeepseekV3Config(**hd)
    hcfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(hcfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # unit-gain weights and a non-zero router bias: every part shows in the logits
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / (1 if "embed" in name else p.shape[-1] ** 0.5))
    hf.save_pretrained(tmp_path)
    model = Model.from_pretrained(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    check.assert_close(model.logits(ids), ref, rtol=1e-4, name=f"engine vs transformers {case}")


def test_a_bfloat16_model_keeps_its_router_in_float32():
    """As transformers (_keep_in_fp32_modules_strict): the router's weight and correction bias stay
    float32 when the model is cast to bfloat16, so its routing is the float32 router's on the same
    activations (a bias rounded to bfloat16 moved some tokens to other experts); a cast to float64
    widens them as the rest."""
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    wide = Model.random(cfg, seed=0)
    narrow = Model.random(cfg, seed=0, dtype=torch.bfloat16)
    routers = [(a.mlp.gate, b.mlp.gate) for a, b in zip(wide.model.layers, narrow.model.layers, strict=True)
               if hasattr(b.mlp, "gate")]
    assert routers
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, cfg.hidden_size, generator=g).bfloat16()
    for a, b in routers:
        assert b.weight.dtype == b.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(a.weight, b.weight)
        assert torch.equal(a.e_score_correction_bias, b.e_score_correction_bias)
        assert torch.equal(a(x)[1], b(x)[1])
    assert narrow.to(dtype=torch.float64).model.layers[-1].mlp.gate.weight.dtype == torch.float64


def test_save_pretrained_round_trip(tmp_path):
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    m = Model.random(cfg, seed=3)
    save_pretrained(m, tmp_path)
    m2 = Model.from_pretrained(tmp_path)
    ids = torch.arange(20) % cfg.vocab_size
    check.assert_equal(m2.logits(ids), m.logits(ids), name="save/load round trip")


def test_a_saved_kimi_k2_model_loads_in_transformers(tmp_path):
    """save_pretrained wrote model_type kimi_k2, which names remote code transformers does not ship: its
    AutoModel refused the folder ('does not recognize this architecture')."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-b.json")
    assert cfg.model_type == "kimi_k2"
    m = Model.random(cfg, seed=0)
    save_pretrained(m, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    ids = torch.arange(24) % cfg.vocab_size
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    check.assert_close(m.logits(ids), ref, rtol=1e-4, name="engine vs transformers, a saved kimi_k2 model")


def test_a_float64_checkpoint_loads_whole_as_float64(tmp_path):
    """The model was built and filled in float32, then cast: 1 + 1e-10 came back as 1.0."""
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    m = Model.random(cfg, seed=3).double()
    with torch.no_grad():
        m.model.norm.weight[0] = 1 + 1e-10
    save_pretrained(m, tmp_path)
    back = Model.from_pretrained(tmp_path, dtype=torch.float64)
    for (k, a), b in zip(m.state_dict().items(), back.state_dict().values(), strict=True):
        assert a.dtype == b.dtype == torch.float64 and torch.equal(a, b), k
    narrow = Model.from_pretrained(tmp_path, dtype=torch.bfloat16)  # the router stays float32
    assert narrow.model.layers[-1].mlp.gate.weight.dtype == torch.float32


def test_save_pretrained_refuses_what_it_could_not_load_back(tmp_path):
    """A shard index left in the folder made loading read the old shards, not the new file (the old
    weights came back, silently); an INT4 model wrote no expert weights (reload: 'missing 48 weights')."""
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    a, b = Model.random(cfg, seed=1), Model.random(cfg, seed=2)
    sharded = tmp_path / "sharded"
    save_pretrained(a, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in a.state_dict()}}))
    before = sorted(p.name for p in sharded.iterdir())
    with pytest.raises(ValueError, match=r"holds another checkpoint's files \(model-00001-of-00001"
                                         r"\.safetensors, model\.safetensors\.index\.json\)"):
        save_pretrained(b, sharded)
    assert sorted(p.name for p in sharded.iterdir()) == before
    ids = torch.arange(12) % cfg.vocab_size
    check.assert_equal(Model.from_pretrained(sharded).logits(ids), a.logits(ids), name="old checkpoint kept")
    plain = tmp_path / "plain"  # a killed save's temp file and a backup: loading reads neither, so they stay
    save_pretrained(a, plain)
    for name in (".model.safetensors.k3j2h1.tmp", "model.safetensors.bak"):
        (plain / name).write_text("x")
    save_pretrained(b, plain)
    check.assert_equal(Model.from_pretrained(plain).logits(ids), b.logits(ids), name="saved over")
    d = json.loads((DATA / "configs" / "tiny-a.json").read_text())
    d["moe_intermediate_size"] = 32  # INT4 groups of 32
    q = Model.random(ModelConfig.from_dict(d), seed=2).quantize_experts_int4()
    with pytest.raises(ValueError, match="not its config's dense layout"):
        save_pretrained(q, tmp_path / "int4")
    assert not (tmp_path / "int4").exists()


def test_a_damaged_safetensors_file_is_named(tmp_path):
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    save_pretrained(Model.random(cfg, seed=0), tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"^{f}: not a readable safetensors file \("):
        Model.from_pretrained(tmp_path)


def test_config_spellings_agree():
    """rope_parameters (transformers 5) == rope_scaling + rope_theta; type == rope_type; kimi_k25
    text_config."""
    a = CASES["qlora-yarn-groups2"]
    b = copy.deepcopy(a)
    rope = dict(b.pop("rope_scaling"))
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = b.pop("rope_theta")
    b["rope_parameters"] = rope
    k25 = {
        "model_type": "kimi_k25",
        "text_config": {**copy.deepcopy(a), "model_type": "kimi_k2"},
        "vision_config": {},
    }
    ca, cb, ck = ModelConfig.from_dict(a), ModelConfig.from_dict(b), ModelConfig.from_dict(k25)
    assert ca == cb
    assert ck.model_type == "kimi_k25" and ck.rope == ca.rope and ck.hidden_size == ca.hidden_size
    assert ModelConfig.from_dict(ca.to_hf_dict()) == ca


def test_config_values_kimi_k2_yarn():
    """Softmax scale of Kimi-K2-0905 (models-hardware.md §3 table: x2.0047 over 1/sqrt(192))."""
    d = _hf_dict(
        1536,
        {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        1,
        1,
    )
    d.update(model_type="kimi_k2", qk_nope_head_dim=128, qk_rope_head_dim=64, rope_theta=50000.0)
    cfg = ModelConfig.from_dict(d)
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * 2.0047, rel=1e-4)
    assert cfg.rope_attention_factor == 1.0


@pytest.mark.parametrize(
    "edit, field",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"hidden_size": None}, "hidden_size"),
        ({"kv_lora_rank": "512"}, "kv_lora_rank"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_type"),
        ({"rope_scaling": {"type": "yarn", "factor": 8.0}}, "original_max_position_embeddings"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 3}, "topk_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"rope_theta": None}, "rope_theta"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ],
)
def test_config_errors_name_the_field(edit, field):
    d = copy.deepcopy(CASES["qlora-yarn-groups2"])
    for k, v in edit.items():
        if v is None:
            d.pop(k)
        else:
            d[k] = v
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(d)


def test_kimi_k25_needs_text_config():
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_dict({"model_type": "kimi_k25"})


def test_tiny_configs_parse():
    for name in ("tiny-a", "tiny-b"):
        cfg = ModelConfig.from_json(DATA / "configs" / f"{name}.json")
        assert cfg.rope is not None
        assert json.loads(json.dumps(cfg.to_hf_dict()))["vocab_size"] == cfg.vocab_size


@pytest.mark.parametrize("name", ["tiny-a", "tiny-b"])
@pytest.mark.parametrize("mode", ["compact", "remap"])
@pytest.mark.parametrize("attention", ["torch", "ops"])
def test_absorbed_decode_matches_plain(name, mode, attention):
    """Prefill + one-token absorbed decode steps give the full causal forward's logits (attention in
    torch, or through kdlib.ops.tree_verify_attention: the numpy reference here)."""
    cfg = ModelConfig.from_json(DATA / "configs" / f"{name}.json")
    model = Model.random(cfg, seed=5)
    model.attention = attention
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, cfg.vocab_size, 24))
    full = model.logits(ids)
    cache = LatentCache(cfg, 64, mode=mode)
    h, _ = model.prefill(cache, ids[:10])
    rows = [model.head(h)]
    for t in range(10, 24):
        h, _ = model.forward_cached(cache, ids[t : t + 1], [t])
        cache.commit()
        rows.append(model.head(h))
    check.assert_close(torch.cat(rows), full, rtol=1e-5, name=f"absorbed decode vs plain {name} {mode} "
                                                              f"{attention}")


@pytest.mark.parametrize("attention", ["torch", "ops"])
def test_tree_verify_rows_match_causal_paths(attention):
    """Each verify row's logits equal a causal forward over root..node (survey §9 item 3)."""
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    model = Model.random(cfg, seed=6)
    model.attention = attention
    prompt = torch.tensor([3, 1, 4, 1, 5])
    # root 0 -> 1 -> 3, root 0 -> 2 (a sibling of 1), node 4 child of 2
    parents = [-1, 0, 0, 1, 2]
    tokens = torch.tensor([9, 2, 6, 5, 3])
    depth = [0, 1, 1, 2, 2]
    vis = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    cache = LatentCache(cfg, 32)
    model.prefill(cache, prompt)
    h, _ = model.forward_cached(cache, tokens, [5 + d for d in depth], vis)
    got = model.head(h)
    for i in range(5):
        chain, j = [], i
        while j >= 0:
            chain.append(int(tokens[j]))
            j = parents[j]
        full = model.logits(torch.cat([prompt, torch.tensor(chain[::-1])]))
        check.assert_close(got[i], full[-1], rtol=1e-5, name=f"tree row {i}", quiet=True)


def test_bad_token_ids():
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    model = Model.random(cfg, seed=0)
    for bad in ([], [0, cfg.vocab_size], [-1], [[1, 2]], [0.5]):
        with pytest.raises(ValueError):
            model.logits(bad)
    with pytest.raises(ValueError, match="must be integers, got torch.complex64"):  # was torch's min error
        model.check_tokens(torch.tensor([1 + 2j]))
    # a uint64 id past 2**63 was reported as a negative minimum
    with pytest.raises(ValueError, match="values of 2\\*\\*63 and more, out of the vocabulary"):
        model.check_tokens(np.array([1, 2**63 + 5], dtype=np.uint64))
    assert model.check_tokens(np.array([1, 2], dtype=np.uint64)).tolist() == [1, 2]


def test_a_cache_or_positions_that_do_not_fit_the_model_are_refused():
    """A float32 cache under a bfloat16 model failed at the first decode step, after its prefill; a cache of
    more layers with a raw shape error; positions of 3.7 (truncated) or -5 ran with the wrong RoPE."""
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    bf16 = Model.random(cfg, seed=0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the cache is torch.float32 on cpu, the model torch.bfloat16"):
        bf16.prefill(LatentCache(cfg, 32), [1, 2, 3])
    model = Model.random(cfg, seed=0)
    deeper = dataclasses.replace(cfg, num_hidden_layers=cfg.num_hidden_layers + 2)
    with pytest.raises(ValueError, match=f"holds {cfg.num_hidden_layers + 2} layers"):
        model.prefill(LatentCache(deeper, 32), [1, 2, 3])
    cache = LatentCache(cfg, 32)
    model.prefill(cache, [1, 2, 3])
    for bad, message in (([3.7], "must be integers"), ([-5], r"must lie in \[3, 4\)"),
                         ([4], r"must lie in \[3, 4\)"), ([3, 4], r"shape \[1\]")):
        with pytest.raises(ValueError, match=message):
            model.forward_cached(cache, [4], bad)
    model.forward_cached(cache, [4, 5], [3, 4], torch.ones(2, 2, dtype=torch.bool).tril())  # in range: runs
    cache.discard()
    model.forward_cached(cache, [4], np.array([3], dtype=np.uint32))  # unsigned positions, as before


def test_checkpoint_mismatch_is_named(tmp_path):
    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-b.json")
    save_pretrained(Model.random(cfg, seed=0), tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"missing 30 weights.*model\.layers\.2\."):
        Model.from_pretrained(tmp_path)


def test_checkpoint_checked_from_headers_before_the_model_is_built(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-b.json")
    save_pretrained(Model.random(cfg, seed=0), tmp_path)
    w = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    w[name] = w[name][:, :-1].contiguous()
    save_file(w, str(tmp_path / "model.safetensors"))

    def built(*args, **kwargs):
        raise AssertionError("the model was built before the checkpoint was checked")

    monkeypatch.setattr(Model, "__init__", built)
    shape = tuple(w[name].shape)
    with pytest.raises(ValueError, match=rf"model.safetensors: {name}: shape \({shape[0]}, {shape[1]}\) "
                                         r"does not match the config's"):
        Model.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "name, scale",
    # softmax scales from models-hardware.md §3 (1/sqrt(192) x mscale(factor, mscale_all_dim)^2)
    [("deepseek-v3", 0.13523), ("kimi-k2-0711", 0.13086), ("kimi-k2-0905", 0.14468), ("kimi-k2.6", 0.14468)],
)
def test_real_configs_parse(name, scale):
    path = DATA / "configs" / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path.name} not in data/configs/")
    cfg = ModelConfig.from_json(path)
    assert cfg.softmax_scale == pytest.approx(scale, abs=5e-6)
    assert cfg.latent_dim == 576 and cfg.qk_head_dim == 192 and cfg.rope_attention_factor == 1.0


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "qwen3-30b-a3b"])
def test_other_families_are_refused(name):
    path = DATA / "configs" / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path.name} not in data/configs/")
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_json(path)


def test_mtp_layers_skipped_quantized_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-b.json")
    m = Model.random(cfg, seed=0)
    save_pretrained(m, tmp_path)
    w = load_file(str(tmp_path / "model.safetensors"))
    # an MTP layer (DeepSeek-V3 layout: num_nextn_predict_layers past the last decoder layer)
    w[f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"] = torch.zeros(2, 2)
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected.*eh_proj"):  # the config declares no MTP layer
        Model.from_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**conf, "num_nextn_predict_layers": 1}))
    ids = torch.arange(9)
    check.assert_equal(Model.from_pretrained(tmp_path).logits(ids), m.logits(ids), name="MTP layer ignored")
    # a config that names fewer decoder layers than the checkpoint holds is a mismatch, not a truncation
    fewer = {**conf, "num_hidden_layers": cfg.num_hidden_layers - 1}
    (tmp_path / "config.json").write_text(json.dumps(fewer))
    with pytest.raises(ValueError, match="unexpected"):
        Model.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**conf, "num_nextn_predict_layers": 1}))
    w["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="quantized"):
        Model.from_pretrained(tmp_path)


def test_sharded_checkpoints_read_the_shards_their_index_names(tmp_path):
    """model.safetensors.index.json decides the files: a stale file beside the shards is not read, a
    missing shard is named, a name in two files and a non-float tensor are refused."""
    from safetensors.torch import load_file, save_file

    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-a.json")
    m = Model.random(cfg, seed=1)
    save_pretrained(m, tmp_path)
    w = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(w)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: w[k] for k in keys}, str(tmp_path / shard))
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({k: torch.zeros_like(v) for k, v in w.items()}, str(tmp_path / "zz-stale.safetensors"))
    ids = torch.arange(9)
    check.assert_equal(Model.from_pretrained(tmp_path).logits(ids), m.logits(ids), name="sharded load")
    (tmp_path / "model-00002-of-00002.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors \\(named in model.safetensors"):
        Model.from_pretrained(tmp_path)
    (tmp_path / "moved.safetensors").rename(tmp_path / "model-00002-of-00002.safetensors")
    for shard in (1, str(tmp_path / "model-00001-of-00002.safetensors"), "../elsewhere.safetensors"):
        # a name that is no file of the folder: a raw TypeError, or a file read from outside it
        odd = {**index, "weight_map": {**index["weight_map"], names[0]: shard}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(odd))
        with pytest.raises(ValueError, match="not a safetensors index .*not a file name in the folder"):
            Model.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no config.json"):
        Model.from_pretrained(tmp_path / "empty")
    (tmp_path / "model.safetensors.index.json").unlink()  # without an index: every file, so the stale one
    with pytest.raises(ValueError, match="is in both"):
        Model.from_pretrained(tmp_path)
    (tmp_path / "zz-stale.safetensors").unlink()
    first = halves["model-00001-of-00002.safetensors"]
    save_file({**{k: w[k] for k in first}, first[0]: w[first[0]].to(torch.int8)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    with pytest.raises(ValueError, match="is I8; the engine loads dense float checkpoints"):
        Model.from_pretrained(tmp_path)


def test_a_kimi_k25_wrapper_checkpoint_loads_and_other_prefixes_are_named(tmp_path):
    """A Kimi-K2.5-style wrapper checkpoint (every LM weight under `language_model.`, a vision tower and a
    projector beside) loads as the same model; a name past those towers is still refused, and so is the
    same prefix under a config that is not the wrapper's, naming the prefix."""
    from safetensors.torch import load_file, save_file

    cfg = ModelConfig.from_json(DATA / "configs" / "tiny-b.json")
    ref = Model.random(cfg, seed=0)
    save_pretrained(ref, tmp_path)
    w = load_file(str(tmp_path / "model.safetensors"))
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": conf}))
    wrapped = {"language_model." + k: v for k, v in w.items()}
    towers = {"vision_tower.patch_embed.weight": torch.zeros(2, 2),
              "mm_projector.proj.0.weight": torch.ones(3)}
    save_file({**wrapped, **towers}, str(tmp_path / "model.safetensors"))
    got = Model.from_pretrained(tmp_path)
    assert got.cfg.model_type == "kimi_k25"
    mine, theirs = got.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    # a weight of no known tower beside the wrapped ones
    save_file({**wrapped, **towers, "audio_tower.w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"1 unexpected, e\.g\. \['audio_tower\.w'\]$"):
        Model.from_pretrained(tmp_path)
    # the prefix under the plain config: refused, naming it
    (tmp_path / "config.json").write_text(json.dumps(conf))
    save_file({**wrapped, **towers}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"missing {len(w)} weights.*; the checkpoint's weights carry the "
                                         r"prefix 'language_model\.', which the loader does not strip$"):
        Model.from_pretrained(tmp_path)
    # one weight under another name: no prefix is claimed
    w["lm_head.weight.old"] = w.pop("lm_head.weight")
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 weights, e\.g\. \['lm_head\.weight'\]; 1 unexpected, "
                                         r"e\.g\. \['lm_head\.weight\.old'\]$"):
        Model.from_pretrained(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-a", "tiny-b"])
def test_cuda_matches_cpu(name):
    """Device-agnostic: the same weights give the same logits (FP32, TF32 off) on CUDA, both forms."""
    cfg = ModelConfig.from_json(DATA / "configs" / f"{name}.json")
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = Model.random(cfg, seed=9)
    gpu = Model.random(cfg, seed=9, device="cuda")
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, cfg.vocab_size, 40))
    check.assert_close(gpu.logits(ids.cuda()).cpu(), cpu.logits(ids), rtol=1e-5, name=f"cuda vs cpu {name}")
    cache = LatentCache(cfg, 64, device="cuda", mode="remap")
    h, _ = gpu.prefill(cache, ids[:20].cuda())
    rows = [gpu.head(h)]
    for t in range(20, 40):
        h, _ = gpu.forward_cached(cache, ids[t : t + 1].cuda(), [t])
        cache.commit()
        rows.append(gpu.head(h))
    check.assert_close(torch.cat(rows).cpu(), cpu.logits(ids), rtol=1e-5, name=f"cuda absorbed decode {name}")


def test_attention_backend_is_validated():
    model = Model.random(ModelConfig.from_json(DATA / "configs" / "tiny-a.json"), seed=0)
    with pytest.raises(ValueError, match="attention"):
        model.attention = "flash"
