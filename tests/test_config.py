"""kdlib.config: the one config.json reader (every view agrees), the one ConfigError, the one YaRN."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from kdlib import ROOT, check, config, memory
from kdlib import estimator as est
from kdlib.config import ConfigError, ModelConfig, YarnScaling, rope_inv_freq, yarn_mscale

ENGINE_CONFIGS = [n for n in config.shipped() if json.loads((config.CONFIGS / f"{n}.json").read_text())
                  .get("model_type") in config.SUPPORTED_MODEL_TYPES]


def test_pure_python_at_import():
    """The memory math, the estimator and the CLI import neither torch nor numpy."""
    code = ("import sys, kdlib.config, kdlib.memory, kdlib.estimator, kdlib.cli; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_one_config_error():
    from kdlib.engine import config as engine_config

    assert memory.ConfigError is ConfigError is engine_config.ConfigError
    assert engine_config.ModelConfig is ModelConfig and issubclass(ConfigError, ValueError)


def test_bad_files_raise_config_error(tmp_path):
    (tmp_path / "a.json").write_text("{not json")
    (tmp_path / "b.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not valid JSON"):
        config.load_config(tmp_path / "a.json")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.load(tmp_path / "b.json")
    with pytest.raises(ValueError, match="shipped configs"):
        config.load_config("no-such-model")
    (tmp_path / "c.json").write_bytes(b"KDTR\xff\x00")  # a binary file named as a config
    with pytest.raises(ConfigError, match=r"c\.json: not UTF-8 text, so no config\.json"):
        config.load_config(tmp_path / "c.json")
    with pytest.raises(ConfigError, match=r"^/proc/self/mem: cannot be read"):  # a file read() refuses
        config.load_config("/proc/self/mem")


def test_a_folder_without_config_json_is_named_as_such(tmp_path, capsys):
    """`kdlib memory /tmp` said "not a file, and not one of the shipped configs" of a folder."""
    with pytest.raises(ValueError, match=r"a folder that holds no config\.json$"):
        config.load_config(tmp_path)
    assert memory.cli([str(tmp_path), "--gpu", "h200", "--tp", "8", "--context", "1000"]) == 2
    err = capsys.readouterr().err
    assert err == f"kdlib memory: error: no config {str(tmp_path)!r}: a folder that holds no config.json\n"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    assert config.load_config(tmp_path)["_name"] == tmp_path.name  # a folder with one still loads


def test_from_json_reads_as_load(tmp_path):
    """from_json was a second reader: a shipped name, a missing file or a folder without config.json
    raised a raw FileNotFoundError where `load` works or names the problem."""
    assert ModelConfig.from_json("tiny-a") == ModelConfig.load("tiny-a")
    (tmp_path / "empty").mkdir()
    (tmp_path / "list.json").write_text("[1, 2]")
    for bad, match in [(tmp_path / "empty", r"a folder that holds no config\.json$"),
                       (tmp_path / "none.json", "not a file, and not one of the shipped configs"),
                       (tmp_path / "list.json", "must hold a JSON object$")]:
        for read in (ModelConfig.load, ModelConfig.from_json):
            with pytest.raises(ValueError, match=match):
                read(bad)


@pytest.mark.parametrize("name", ENGINE_CONFIGS)
def test_the_views_agree(name):
    """geometry (memory), ModelConfig (engine) and ModelShape (estimator) read the same numbers."""
    c, g = ModelConfig.load(name), config.geometry(name)
    shape = est.ModelShape.from_config(name)
    assert g.attention == "mla" and g.kv_elements_per_layer == c.latent_dim == shape.latent_dim
    assert g.head_dim == c.qk_head_dim and g.rotary_dim == c.qk_rope_head_dim == shape.qk_rope_dim
    assert g.num_layers == c.num_hidden_layers == shape.n_layers
    assert g.vocab_size == c.vocab_size == shape.vocab
    assert g.num_heads == c.num_attention_heads == shape.n_heads
    y = memory.yarn(name)
    assert y["softmax_scale"] == c.softmax_scale and y["cos_sin_mscale"] == c.rope_attention_factor
    assert y["correction_range"] == c.rope.correction_range(c.qk_rope_head_dim, c.rope_theta)


def test_router_fields_left_out_read_as_transformers_reads_them():
    """A trimmed config.json without the router's fields: the engine built a router of one group, no
    shared expert, no scaling and unnormalised weights, where transformers builds DeepSeek-V3's."""
    from transformers import DeepseekV3Config

    d = json.loads((ROOT / "data" / "configs" / "deepseek-v3.json").read_text())
    fields = ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
              "norm_topk_prob", "q_lora_rank")
    cfg = ModelConfig.from_dict({k: v for k, v in d.items() if k not in fields})
    hf = DeepseekV3Config()
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(hf, f) for f in fields}
    assert {f: getattr(cfg, f) for f in fields} == config.DEEPSEEK_V3_DEFAULTS
    # memory reads them alike: the same layers and shared experts counted
    full = memory.weight_bytes(d, "bf16")["total"]
    assert memory.weight_bytes({k: v for k, v in d.items() if k not in fields}, "bf16")["total"] == full
    # a default the config cannot take is named as one (a 2-layer model, 3 dense layers by default)
    tiny = json.loads((ROOT / "data" / "configs" / "tiny-b.json").read_text())
    with pytest.raises(ConfigError, match="got 3 \\(absent from the config: transformers' DeepseekV3Config"):
        ModelConfig.from_dict({k: v for k, v in tiny.items() if k != "first_k_dense_replace"})
    assert tiny["q_lora_rank"] is None and ModelConfig.from_dict(tiny).q_lora_rank is None  # null: none


def test_inv_freq_kimi_k2_written_out():
    """Kimi-K2.6: d 64, base 50000, 4096 x 64, beta 1 / 1: the original context turns once at pair
    64 ln(4096 / 2 pi) / (2 ln 50000) = 19.16, so pairs 0..19 keep base^(-2i/64) and 20..31 are / 64."""
    c = ModelConfig.load("kimi-k2.6")
    assert c.rope.correction_range(64, 50000.0) == (19, 20)
    i = np.arange(32)
    want = np.where(i <= 19, 50000.0 ** (-i / 32), 50000.0 ** (-i / 32) / 64)  # [32]
    check.assert_close(rope_inv_freq(c), want, rtol=1e-14, name="kimi-k2.6 inverse frequencies")


def test_inv_freq_tiny_a_ramp_written_out():
    """tiny-a: d 8, base 1e4, 256 x 4, beta 32 / 1: low floor(0.105) = 0, high ceil(1.61) = 2, ramp
    [0, 1/2, 1, 1] over the 4 pairs; magnitude mscale(4, 0.8) / mscale(4, 1), softmax x mscale(4, 1)^2."""
    c = ModelConfig.load("tiny-a")
    base = 1e4 ** (-np.arange(4) / 4)  # [4]
    ramp = np.array([0.0, 0.5, 1.0, 1.0])
    check.assert_close(rope_inv_freq(c), base * (1 - ramp) + base / 4 * ramp, rtol=1e-14, name="tiny-a")
    ln4 = math.log(4)
    assert c.rope_attention_factor == pytest.approx((0.08 * ln4 + 1) / (0.1 * ln4 + 1), rel=1e-14)
    assert c.softmax_scale == pytest.approx(c.qk_head_dim**-0.5 * (0.1 * ln4 + 1) ** 2, rel=1e-14)


def test_plain_rope_has_no_yarn():
    d = ModelConfig.load("tiny-a").to_hf_dict()
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    c = ModelConfig.from_dict(d)
    assert c.rope is None and c.rope_attention_factor == 1.0 and c.softmax_scale == c.qk_head_dim**-0.5
    check.assert_close(rope_inv_freq(c), 1e4 ** (-np.arange(4) / 4), rtol=1e-14, name="plain RoPE")


@pytest.mark.parametrize("change, message", [
    ({"n_shared_experts": -1}, "n_shared_experts: must be >= 0, got -1"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}},
     "a 'default' RoPE is not scaled"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 0.5,
                          "original_max_position_embeddings": 64}}, "must be >= 1, got 0.5"),
    ({"max_position_embeddings": "4096", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                                                             "original_max_position_embeddings": 64}},
     "max_position_embeddings"),
    # these passed and gave a ZeroDivisionError, a math domain error or an inverted ramp later
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 0}},
     "original_max_position_embeddings: must be >= 1, got 0"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 1.0,
                          "beta_slow": 32.0, "original_max_position_embeddings": 64}},
     "need beta_fast >= beta_slow > 0"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": -1.0,
                          "original_max_position_embeddings": 64}}, "need beta_fast >= beta_slow > 0"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale_all_dim": -50.0,
                          "original_max_position_embeddings": 64}}, "mscale_all_dim: must be >= 0"),
    ({"routed_scaling_factor": -2.5}, "routed_scaling_factor: must be > 0, got -2.5"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor: must be > 0, got 0"),
])
def test_config_values_that_cannot_run_are_named(change, message):
    """Each of these used to pass and fail later (a negative tensor size, a str / int), or said the opposite
    of itself ('default' is not supported (only 'default' ...))."""
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**ModelConfig.load("tiny-a").to_hf_dict(), **change})


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("hidden_size", float("nan")),
                                          ("num_hidden_layers", 61.9), ("kv_lora_rank", 512.7),
                                          ("num_hidden_layers", 0), ("vocab_size", float("inf"))])
def test_geometry_refuses_sizes_that_are_not_sizes(field, value):
    """0 heads divided by zero, NaN failed as 'cannot convert float NaN to integer', 61.9 layers read as 61
    and a kv_lora_rank of 512.7 gave 576.7 elements a token, none of them naming the field."""
    d = json.loads((config.CONFIGS / "kimi-k2.6.json").read_text())
    d["text_config"]["num_hidden_layers"] = 61.0  # a whole float reads as its int
    assert config.geometry(d).num_layers == 61
    d["text_config"][field] = value
    with pytest.raises(ConfigError, match=rf"field '{field}' must be a whole number >= 1 \(a size\)"):
        config.geometry(d)


def test_config_file_errors_name_the_file_and_hf_fields_round_trip(tmp_path):
    """A field error read from a file names the file; bos / eos ids survive to_hf_dict; a kimi_k25
    wrapper's tie_word_embeddings reaches the LM (and a contradiction is named); rope_parameters
    and a rope_scaling that disagree are refused instead of one silently winning."""
    d = ModelConfig.load("tiny-a").to_hf_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**d, "n_shared_experts": -1}))
    with pytest.raises(ConfigError, match=f"^{path}: n_shared_experts"):
        ModelConfig.from_json(tmp_path)
    back = ModelConfig.from_dict({**d, "bos_token_id": 7, "eos_token_id": 9}).to_hf_dict()
    assert (back["bos_token_id"], back["eos_token_id"]) == (7, 9)
    lm = {k: v for k, v in d.items() if k != "tie_word_embeddings"}
    wrapped = {"model_type": "kimi_k25", "tie_word_embeddings": True, "text_config": lm}
    assert ModelConfig.from_dict(wrapped).tie_word_embeddings
    k26 = ModelConfig.load("kimi-k2.6")  # to_hf_dict flattens the wrapper: all else comes back as it was
    assert dataclasses.replace(ModelConfig.from_dict(k26.to_hf_dict()), model_type="kimi_k25") == k26
    with pytest.raises(ConfigError, match="tie_word_embeddings: the wrapper says True"):
        ModelConfig.from_dict({**wrapped, "text_config": {**lm, "tie_word_embeddings": False}})
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    same = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
    assert ModelConfig.from_dict({**d, "rope_parameters": same, "rope_scaling": yarn}).rope.factor == 4.0
    with pytest.raises(ConfigError, match=r"disagree on \['factor'\]"):
        ModelConfig.from_dict({**d, "rope_parameters": {**same, "factor": 2.0}, "rope_scaling": yarn})
    with pytest.raises(ConfigError, match=r"disagree on \['rope_type'\]"):
        ModelConfig.from_dict({**d, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                               "rope_scaling": yarn})


def test_yarn_magnitudes_follow_transformers():
    assert yarn_mscale(1.0, 5.0) == 1.0 and yarn_mscale(math.e, 2.0) == pytest.approx(1.2)
    both = YarnScaling(factor=16.0, original_max_position_embeddings=64, mscale=0.5, mscale_all_dim=1.0)
    assert both.attention_scale() == pytest.approx(yarn_mscale(16, 0.5) / yarn_mscale(16, 1.0))
    assert both.softmax_factor() == pytest.approx(yarn_mscale(16, 1.0) ** 2)
    # mscale alone is ignored (transformers needs both), the default 0.1 ln s + 1 applies
    alone = YarnScaling(factor=16.0, original_max_position_embeddings=64, mscale=0.5)
    assert alone.attention_scale() == yarn_mscale(16) and alone.softmax_factor() == 1.0
    given = YarnScaling(factor=16.0, original_max_position_embeddings=64, mscale=0.5, mscale_all_dim=1.0,
                        attention_factor=0.9)
    assert given.attention_scale() == 0.9


def test_correction_range_truncate_and_clamp():
    y = YarnScaling(factor=8.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)
    low, high = y.correction_range(64, 10000.0)
    exact = [64 * math.log(4096 / (b * 2 * math.pi)) / (2 * math.log(10000.0)) for b in (32.0, 1.0)]
    assert (low, high) == (math.floor(exact[0]), math.ceil(exact[1]))
    loose = YarnScaling(factor=8.0, original_max_position_embeddings=4096, truncate=False)
    assert loose.correction_range(64, 10000.0) == pytest.approx(tuple(exact))
    # beta_fast turns before pair 0 and beta_slow after the last pair: low 0, high d - 1
    wide = YarnScaling(factor=8.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1e-6)
    assert wide.correction_range(8, 10.0) == (0, 7)
