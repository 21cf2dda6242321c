"""kdlib.memory: KV bytes per token, TP modes, weights, SGLang's pool, plans, YaRN checks, the CLI.

Exact figures come from models-hardware.md §1-§3 (computed there independently from the configs).
"""

import copy
import json
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kdlib.cli
import kdlib.memory as m
from kdlib import ROOT, hw

REAL = [
    "kimi-k2-0711",
    "kimi-k2-0905",
    "kimi-k2-thinking",
    "kimi-k2.6",
    "deepseek-v3",
    "deepseek-v2-lite",
    "qwen3-30b-a3b",
]
MLA_61 = ["kimi-k2-0711", "kimi-k2-0905", "kimi-k2-thinking", "kimi-k2.6", "deepseek-v3"]


def test_real_configs_shipped_with_provenance():
    assert set(REAL) <= set(m.shipped())
    for name in REAL:
        cfg = m.load_config(name)
        assert "_provenance" in cfg and "_uncertain" in cfg, name
        assert cfg["_provenance"]["sources"], name


# ------------------------------------------------------------------------------ KV bytes per token

@pytest.mark.parametrize("name", MLA_61)
def test_mla_61_layers_exact(name):
    assert m.kv_bytes_per_token(name) == 70_272  # 61 x (512 + 64) x 2
    assert m.kv_bytes_per_token(name, "fp8_e4m3") == 35_136
    assert m.kv_bytes_per_token(name, "fp4_e2m1") == 19_764  # SGLang FP4: 61 x (288 + 36)
    assert m.kv_bytes_per_token(name, "auto") == 70_272  # torch_dtype bfloat16


def test_small_models_exact():
    assert m.kv_bytes_per_token("deepseek-v2-lite") == 31_104
    assert m.kv_bytes_per_token("qwen3-30b-a3b") == 98_304  # 2 x 4 x 128 x 48 x 2
    assert m.kv_bytes_per_token("qwen3-30b-a3b", tp=4) == 24_576  # heads split


def test_mla_tp_modes():
    k = "kimi-k2.6"
    for tp in (1, 2, 4, 8, 16):
        assert m.kv_bytes_per_token(k, tp=tp) == 70_272  # replicated: never divided
        assert m.kv_bytes_per_token(k, tp=tp, kv_split="dp_attention") == 70_272  # own tokens, whole entries
        assert m.kv_bytes_per_token(k, tp=tp, kv_split="context_parallel") == 70_272 // tp
    assert m.kv_bytes_per_token(k, tp=8, kv_split="context_parallel") == 8_784
    assert m.kv_bytes_per_token(k, "fp8_e4m3", tp=8, kv_split="context_parallel") == 4_392
    assert m.kv_bytes_per_token(k, tp=3, kv_split="context_parallel") == pytest.approx(70_272 / 3)


def test_gqa_tp_modes():
    q = "qwen3-30b-a3b"  # 4 KV heads
    assert m.kv_bytes_per_token(q, tp=2) == 49_152
    assert m.kv_bytes_per_token(q, tp=8) == 24_576  # 1 head per rank, each head on 2 ranks
    assert m.kv_bytes_per_token(q, tp=8, kv_split="dp_attention") == 98_304
    # DCP2 removes the duplication
    assert m.kv_bytes_per_token(q, tp=8, kv_split="context_parallel") == 12_288
    assert m.kv_bytes_per_token(q, tp=4, kv_split="context_parallel") == 24_576  # no duplication to remove
    with pytest.raises(ValueError, match="fp4"):
        m.kv_bytes_per_token(q, "fp4_e2m1")


def test_kv_bytes_context_parallel_busiest_rank():
    assert m.kv_bytes("kimi-k2.6", 200_000, tp=8) == 200_000 * 70_272
    assert m.kv_bytes("kimi-k2.6", 17, tp=8, kv_split="context_parallel") == 3 * 70_272  # ceil(17/8)


def test_token_counts_and_splits_are_checked_first():
    """A NaN, fractional or bool token count gave NaN or fractional bytes; tp 0 under context parallelism
    divided by zero before the split was checked; a logged pool of -5 tokens implied a fraction."""
    for bad in (float("nan"), 1.5, True, -1):
        with pytest.raises(ValueError, match="tokens must be an int >= 0"):
            m.kv_bytes("kimi-k2.6", bad)
    with pytest.raises(ValueError, match="tp"):
        m.kv_bytes("kimi-k2.6", 10, tp=0, kv_split="context_parallel")
    for bad in (-5, 0, 2.5):
        with pytest.raises(ValueError, match="pool_tokens_logged must be an int >= 1"):
            m.implied_mem_fraction("kimi-k2.6", "rtx-pro-6000", 8, bad)
    notes = {o: next(r["note"] for r in m.plan("kimi-k2.6", "h200", 8, 4096, overhead_bytes=o)
                     if r["key"] == "overhead") for o in (m.DEFAULT_OVERHEAD_BYTES, 3 * m.GiB)}
    assert notes == {m.DEFAULT_OVERHEAD_BYTES: "assumed", 3 * m.GiB: "given"}


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 200),
    r=st.integers(1, 1024),
    rope=st.integers(0, 256),
    tp=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_mla_formula_property(layers, r, rope, tp):
    cfg = {"num_hidden_layers": layers, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
           "kv_lora_rank": r, "qk_rope_head_dim": rope, "qk_nope_head_dim": 8, "v_head_dim": 8}
    full = layers * (r + rope) * 2
    assert m.kv_bytes_per_token(cfg, tp=tp) == full
    assert m.kv_bytes_per_token(cfg, tp=tp, kv_split="context_parallel") == pytest.approx(full / tp)
    assert m.kv_bytes_per_token(cfg, "fp8_e4m3", tp=tp) * 2 == full


# ------------------------------------------------------------------------------ config parsing

def test_text_config_nesting_kimi_k25():
    nested = m.load_config("kimi-k2.6")
    assert nested["model_type"] == "kimi_k25" and "text_config" in nested
    assert "num_hidden_layers" not in nested  # the LM fields live only under text_config
    flat = copy.deepcopy(nested["text_config"])
    assert m.kv_bytes_per_token(nested) == m.kv_bytes_per_token(flat) == 70_272
    g = m.geometry(nested)
    assert (g.attention, g.num_layers, g.head_dim) == ("mla", 61, 192)  # 128 + 64, not 7168 / 64
    # quantization_config at top level is carried down into the LM view
    moved = copy.deepcopy(nested)
    moved["quantization_config"] = moved["text_config"].pop("quantization_config")
    assert m.resolve_weight_format(moved) == "int4_g32"


def test_load_config_from_path_dir_and_dict(tmp_path):
    cfg = m.load_config("deepseek-v3")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert m.kv_bytes_per_token(tmp_path / "config.json") == 70_272
    assert m.kv_bytes_per_token(str(tmp_path)) == 70_272
    assert m.kv_bytes_per_token(cfg) == 70_272
    with pytest.raises(ValueError, match="shipped"):
        m.load_config("no-such-model")


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_rope_head_dim", "num_hidden_layers", "vocab_size"])
def test_missing_field_named(field):
    cfg = m.load_config("deepseek-v3")
    cfg.pop(field)  # a DeepSeek config without kv_lora_rank must not be read as MHA
    with pytest.raises(m.ConfigError, match=field):
        m.kv_bytes_per_token(cfg)


def test_missing_field_in_text_config_named():
    cfg = m.load_config("kimi-k2.6")
    del cfg["text_config"]["num_hidden_layers"]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        m.plan(cfg, "h200", 8, 1000)


def test_bad_arguments():
    with pytest.raises(ValueError, match="kv_split"):
        m.kv_bytes_per_token("deepseek-v3", kv_split="sharded")
    with pytest.raises(ValueError, match="dtype"):
        m.kv_bytes_per_token("deepseek-v3", "int3")
    with pytest.raises(ValueError, match="tp"):
        m.kv_bytes_per_token("deepseek-v3", tp=0)
    with pytest.raises(ValueError, match="known"):
        m.plan("deepseek-v3", "a100", 8, 1000)


def test_tp_must_split_heads_kv_heads_and_experts():
    for tp in (3, 1024):
        with pytest.raises(ValueError, match=f"tp={tp} cannot split its 64 attention heads"):
            m.plan("kimi-k2.6", "h200", tp, 1000)
        with pytest.raises(ValueError, match="attention heads"):
            m.weight_bytes("kimi-k2.6", tp=tp)
    # DP-attention keeps attention whole; 384 experts go 128 to a rank
    assert m.weight_bytes("kimi-k2.6", tp=3, kv_split="dp_attention")["per_gpu"] > 0
    m.check_tp("qwen3-30b-a3b", 3, "dp_attention")  # 128 experts do not split over 3, their 768 columns do
    with pytest.raises(ValueError, match=r"tp=5 splits neither its 128 routed experts \(.*\) nor their "
                                         r"intermediate size 768"):
        m.check_tp("qwen3-30b-a3b", 5, "dp_attention")
    gqa = {"num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 4,
           "vocab_size": 10, "intermediate_size": 32}
    assert m.weight_bytes(gqa, tp=12)["per_gpu"] > 0  # 4 KV heads, each on 3 ranks
    with pytest.raises(ValueError, match="tp=6 is not a multiple of its 4 KV heads"):
        m.weight_bytes(gqa, tp=6)
    with pytest.raises(ValueError, match="not a multiple of its 4 KV heads"):
        m.kv_bytes_per_token(gqa, tp=6)


def test_weight_format_group_size_checked():
    for fmt in ("int4_g0", "int4_g", "int4_gabc", "int4_g-32"):
        with pytest.raises(ValueError, match="positive integer group size"):
            m.weight_bytes("kimi-k2.6", fmt, tp=8)
    assert m.resolve_weight_format("kimi-k2.6", "int4_g128") == "int4_g128"


def test_memory_that_does_not_fit_is_said():
    mem = hw.load("h200")["memory_bytes"]
    with pytest.raises(ValueError, match="overhead before weights.*is not below the GPU memory"):
        m.plan("kimi-k2.6", "h200", 8, 1000, overhead_bytes=500 * m.GiB)
    with pytest.raises(ValueError, match="is not below the GPU memory"):
        m.pool_bytes(mem, 0, 0.5, overhead_bytes=mem)
    with pytest.raises(ValueError, match="is not below the GPU memory"):
        m.mem_fraction_for_pool(mem, 0, 1, overhead_bytes=mem + 1)
    with pytest.raises(ValueError, match="overhead_bytes must be >= 0"):
        m.plan("kimi-k2.6", "h200", 8, 1000, overhead_bytes=-1)
    with pytest.raises(ValueError, match=r"mem_fraction_static must be in \(0, 1\), got 1.5"):
        m.plan("kimi-k2.6", "h200", 8, 1000, mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="default reserve of 112 GiB .* is not below the 96.00 GiB"):
        m.default_mem_fraction_static(96 * m.GiB, tp=200)
    p = m.plan("kimi-k2.6", "h200", 2, 1000)  # weights per GPU beyond the memory: a verdict, not an error
    assert not p.fits and p.verdict.startswith("DOES NOT FIT: the weights alone need")


def test_config_fields_must_be_numbers():
    cfg = m.load_config("deepseek-v3")
    cfg["num_hidden_layers"] = "61"
    with pytest.raises(m.ConfigError, match="'num_hidden_layers' must be a number, got '61'"):
        m.kv_bytes_per_token(cfg)


# ------------------------------------------------------------------------------ weights

def test_param_counts_match_reference():
    assert m.param_count("kimi-k2-0711")["total"] / 1e9 == pytest.approx(1026.4, abs=0.1)
    assert m.param_count("deepseek-v3")["total"] / 1e9 == pytest.approx(671.0, abs=0.1)  # "671B"
    assert m.param_count("deepseek-v3", include_mtp=True)["total"] > m.param_count("deepseek-v3")["total"]
    # MLA attention of one K2 layer: 101.1 M (models-hardware.md §1.5)
    per_layer = (
        m.param_count("kimi-k2-0711")["attention"] + m.param_count("kimi-k2-0711")["attention_replicated"]
    ) / 61
    assert per_layer / 1e6 == pytest.approx(101.1, abs=0.05)


def test_weight_formats():
    int4 = m.weight_bytes("kimi-k2-thinking")
    assert int4["format"] == "int4_g32"
    assert int4["total"] / 1e9 == pytest.approx(594, abs=1)  # 4.5 bit experts + bf16 rest (§1.5)
    pc = m.param_count("kimi-k2-thinking")
    # routed experts: 0.5 B + a 2-byte scale per 32 = 0.5625 B/param; every other part bf16
    assert int4["by_part"]["routed_experts"] == pytest.approx(pc["routed_experts"] * 0.5625, rel=1e-9)
    assert int4["by_part"]["attention"] == 2 * pc["attention"]
    assert int4["by_part"]["shared_experts"] == 2 * pc["shared_experts"]
    fp8 = m.weight_bytes("deepseek-v3")
    assert fp8["format"] == "fp8_block"
    assert 671e9 < fp8["total"] < 0.69e12  # 1 B/param + fp32 block scales + bf16 embeddings
    # bf16: 2 B/param, except the fp32 e_score_correction_bias (256 experts x 58 MoE layers)
    assert (
        m.weight_bytes("deepseek-v3", "bf16")["total"]
        == 2 * m.param_count("deepseek-v3")["total"] + 2 * 256 * 58
    )
    assert m.weight_bytes("qwen3-30b-a3b")["format"] == "bf16"
    with pytest.raises(ValueError, match="weight_format"):
        m.weight_bytes("deepseek-v3", "int2")


def test_weights_per_gpu_sharding():
    w1, w8 = m.weight_bytes("kimi-k2.6", tp=1), m.weight_bytes("kimi-k2.6", tp=8)
    assert w1["per_gpu"] == w1["total"]
    assert w1["total"] / 8 < w8["per_gpu"] < w1["total"] / 8 + 3e9  # replicated q_a/kv_a/norms/router
    dp = m.weight_bytes("kimi-k2.6", tp=8, kv_split="dp_attention")
    assert dp["per_gpu_by_part"]["attention"] == dp["by_part"]["attention"]  # attention whole on each rank
    assert dp["per_gpu"] > w8["per_gpu"]


# ------------------------------------------------------------------------------ pool and plan

def test_default_mem_fraction_static_buckets():
    # models-hardware.md §2.4 table: 0.833 (RTX PRO 6000), 0.886 (H200), 0.881 (B300) at TP8
    assert m.default_mem_fraction_static(hw.load("rtx-pro-6000")["memory_bytes"], 8)[0] == 0.833
    assert m.default_mem_fraction_static(hw.load("h200")["memory_bytes"], 8)[0] == 0.886
    assert m.default_mem_fraction_static(hw.load("b300")["memory_bytes"], 8)[0] == 0.881
    spec, _, bucket = m.default_mem_fraction_static(hw.load("h200")["memory_bytes"], 8, speculative=True)
    assert spec < 0.886 and "speculative" in bucket
    assert m.default_mem_fraction_static(80 * 2**30, 8)[1] == 13.5  # 9.5 + 8/2


def test_pool_formula():
    gib = 2**30
    # rest = (mem - overhead) x fraction - weights; tokens = rest // cell
    assert m.pool_bytes(100 * gib, 60 * gib, 0.8, overhead_bytes=0) == 20 * gib
    assert m.pool_tokens(100 * gib, 60 * gib, 70_272, 0.8, overhead_bytes=0) == (20 * gib) // 70_272
    assert m.pool_tokens(100 * gib, 90 * gib, 70_272, 0.8, overhead_bytes=0) == 0  # never negative
    assert m.mem_fraction_for_pool(100 * gib, 60 * gib, 20 * gib, overhead_bytes=0) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        m.pool_bytes(100 * gib, 60 * gib, 1.2)


def test_plan_terms_add_up():
    p = m.plan("kimi-k2.6", "rtx-pro-6000", 8, 200_000)
    mem = hw.load("rtx-pro-6000")["memory_bytes"]
    assert p.value("gpu_memory") == mem
    assert p.value("overhead") + p.value("static_budget") + p.value("reserve") == mem
    assert p.value("weights_per_gpu") + p.value("kv_pool") == pytest.approx(p.value("static_budget"), abs=1)
    assert p.value("pool_tokens") == p.value("kv_pool") // 70_272
    assert p.value("kv_bytes_per_token") == 70_272
    assert p.value("longest_request") == p.value("pool_tokens") - 1
    assert p.value("request_kv") == 200_000 * 70_272
    assert not p.fits and "DOES NOT FIT" in p.verdict and "200,000" in p.verdict
    frame = p.to_frame()
    assert frame.loc["pool_tokens", "value"] == p.value("pool_tokens")
    assert json.loads(json.dumps(p.to_dict()))["verdict"] == p.verdict
    assert "verdict:" in str(p)
    human = p.to_frame(human=True)
    assert human.loc["kv_bytes_per_token", "shown"] == "70,272 B/token"
    assert human.loc["request_kv", "shown"] == "13.09 GiB (14.05 GB)"


def test_a_request_of_the_whole_context_length_is_refused_by_the_model_not_the_pool():
    """SGLang's max_req_len is min(context_len - 1, pool - 1): on an H200 TP8 the pool holds more than
    262,144 tokens, so a 262,144-token request fails on the context length, with no memory remedy."""
    derived = m.plan("kimi-k2.6", "h200", 8, 1).value("derived_context")  # 262,144
    whole, under = m.plan("kimi-k2.6", "h200", 8, derived), m.plan("kimi-k2.6", "h200", 8, derived - 1)
    assert whole.value("pool_tokens") > derived
    assert not whole.fits and whole.verdict.startswith("DOES NOT FIT the model")
    assert whole.value("concurrent_at_context") == 0
    assert f"context_len - 1 = {derived - 1:,}" in whole.verdict
    assert "mem_fraction_static" not in whole.verdict
    assert under.fits and under.value("longest_request") == derived - 1


def test_plan_modes_for_200k_on_rtx_pro_6000():
    # a hand-set fraction near the seeds' (their logged pool implies 0.824)
    base = dict(config="kimi-k2.6", gpu="rtx-pro-6000", tp=8, context=200_000, mem_fraction_static=0.83)
    fp8 = m.plan(**base, kv_dtype="fp8_e4m3")
    assert fp8.fits and fp8.value("pool_tokens") >= 200_001
    cp = m.plan(**base, kv_split="context_parallel")
    assert cp.fits and cp.value("kv_bytes_per_token") == 70_272  # a slot is a whole token on one rank
    assert cp.value("group_tokens") == 8 * cp.value("pool_tokens")
    assert cp.value("concurrent_at_context") >= 4
    dp = m.plan(**base, kv_split="dp_attention")
    assert not dp.fits  # DP-attention raises weights per GPU and does not lengthen one request
    implied = m.implied_mem_fraction("kimi-k2.6", "rtx-pro-6000", 8, 101_134)
    assert 0.82 < implied < 0.83
    replay = m.plan(**{**base, "mem_fraction_static": implied + 1e-6})
    assert abs(replay.value("pool_tokens") - 101_134) <= 1  # 1e-6 of the fraction is ~1 token
    capped = m.plan(**base, max_total_tokens=101_134)
    assert capped.value("longest_request") == 101_133
    assert not m.plan(**base).fits


def test_context_parallel_counts_the_busiest_ranks_slots():
    """Under DCP a request takes ceil(context / c) slots of each rank's pool: the concurrent count and the
    fraction a too-small pool would need are those of the striped request, not of a whole one."""
    cp = m.plan("kimi-k2.6", "h200", 8, 100, kv_split="context_parallel")
    assert cp.value("concurrent_at_context") == cp.value("pool_tokens") // 13  # ceil(100 / 8)
    base = dict(config="kimi-k2.6", gpu="rtx-pro-6000", tp=8, context=200_000, kv_split="context_parallel")
    short = m.plan(**base, mem_fraction_static=0.7)  # the weights leave no pool at this fraction
    need = m.mem_fraction_for_pool(short.value("gpu_memory"), short.value("weights_per_gpu"),
                                   m.kv_bytes("kimi-k2.6", 200_001, tp=8, kv_split="context_parallel"),
                                   short.value("overhead"))
    assert not short.fits and f"mem_fraction_static >= {m.fraction_to_set(need):.3f}" in short.verdict
    assert m.plan(**base, mem_fraction_static=m.fraction_to_set(need)).fits


@pytest.mark.parametrize("kv_split", ["replicated", "context_parallel"])
def test_a_binding_max_total_tokens_is_the_advice_not_the_fraction(kv_split, capsys):
    """A pool capped by --max-total-tokens was told to raise mem_fraction_static to 0.606, below the
    0.8417 it already had; the verdict names the cap, and the cap it names fits (one fewer does not)."""
    argv = ["kimi-k2.6", "--gpu", "h200", "--tp", "8", "--context", "200000", "--max-total-tokens", "1000",
            "--kv-split", kv_split]
    assert m.cli(argv) == 0
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert "max_total_tokens=1,000 caps the pool" in verdict and "mem_fraction_static >=" not in verdict
    named = int(re.search(r"raise max_total_tokens to >= ([0-9,]+) or drop it", verdict)[1].replace(",", ""))
    base = dict(config="kimi-k2.6", gpu="h200", tp=8, context=200_000, kv_split=kv_split)
    assert m.plan(**base, max_total_tokens=named).fits and m.plan(**base).fits
    assert not m.plan(**base, max_total_tokens=named - 1).fits
    # a cap and a fraction both too small (plain TP): both named
    both = m.plan("kimi-k2.6", "h200", 8, 200_000, max_total_tokens=1000, mem_fraction_static=0.55)
    assert "mem_fraction_static >= 0.606 with max_total_tokens raised to >= 200,001" in both.verdict


def test_the_fraction_a_verdict_names_fits():
    """The verdict rounded the needed fraction to the nearest thousandth: the README's own example named
    0.893, at which the request still did not fit (0.894 does)."""
    base = dict(config="kimi-k2.6", gpu="rtx-pro-6000", tp=8, context=200_000)
    short = m.plan(**base)
    said = float(re.search(r"mem_fraction_static >= ([0-9.]+)", short.verdict).group(1))
    assert not short.fits and m.plan(**base, mem_fraction_static=said).fits
    assert m.fraction_to_set(0.8932) == 0.894 and m.fraction_to_set(0.893) == 0.893


def test_vlm_cut_of_the_default_fraction():
    # SGLang multiplies its default by 0.95 (x a ViT-size factor) for multimodal checkpoints
    assert m.vlm_mem_fraction_factor("kimi-k2.6") == 0.95
    assert m.vlm_mem_fraction_factor("kimi-k2-thinking") == 1.0
    assert (
        m.vlm_mem_fraction_factor({"vision_config": {"num_hidden_layers": 48, "hidden_size": 1024}})
        == 0.95 * 0.9
    )
    mm = m.plan("kimi-k2.6", "h200", 8, 1000)
    text = m.plan("kimi-k2-thinking", "h200", 8, 1000)
    assert mm.value("mem_fraction_static") == pytest.approx(0.95 * text.value("mem_fraction_static"))
    assert m.plan("kimi-k2.6", "h200", 8, 1000, mem_fraction_static=0.8).value("mem_fraction_static") == 0.8


def test_plan_dp_attention_counts_whole_pools():
    p = m.plan("deepseek-v2-lite", "h200", 8, 100_000, kv_split="dp_attention")
    assert p.value("group_tokens") == 8 * p.value("pool_tokens")
    assert p.value("concurrent_at_context") == 8 * (p.value("pool_tokens") // 100_000)


def test_cannot_fit_verdicts_never_negative():
    p = m.plan("kimi-k2-0711", "rtx-pro-6000", 8, 200_000)  # block-FP8 K2 needs ~121 GiB per GPU
    assert not p.fits and p.verdict.startswith("DOES NOT FIT: the weights alone")
    assert p.value("pool_tokens") == 0 and p.value("kv_pool") == 0 and p.value("longest_request") == 0
    q = m.plan("kimi-k2.6", "rtx-pro-6000", 8, 1000, mem_fraction_static=0.5)
    assert not q.fits and "leave no KV pool" in q.verdict and q.value("pool_tokens") == 0
    r = m.plan("kimi-k2.6", "b300", 8, 300_000)
    assert not r.fits and "derived context length 262,144" in r.verdict
    assert r.value("concurrent_at_context") == 0  # the pool would hold two; the context length, none
    one = m.plan("kimi-k2.6", "rtx-pro-6000", 8, 53_628)  # one token past the longest request the pool allows
    assert not one.fits and one.value("concurrent_at_context") == 0
    assert m.max_context("kimi-k2-0711", "rtx-pro-6000", 8) == 0
    assert m.max_context("kimi-k2.6", "b300", 8) == 262_143
    assert m.concurrent_requests("kimi-k2-0711", "rtx-pro-6000", 8, 1000) == 0
    assert m.concurrent_requests("kimi-k2-thinking", "b300", 8, 200_000) == 12


@settings(max_examples=40, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4, 8, 16]),
    ctx=st.integers(1, 400_000),
    mfs=st.one_of(st.none(), st.floats(0.05, 0.98)),
    split=st.sampled_from(m.KV_SPLITS),
    dtype=st.sampled_from(["bfloat16", "fp8_e4m3"]),
    gpu=st.sampled_from(["rtx-pro-6000", "h200", "b200", "b300"]),
)
def test_plan_property_no_negative_counts(tp, ctx, mfs, split, dtype, gpu):
    p = m.plan("kimi-k2.6", gpu, tp, ctx, kv_dtype=dtype, mem_fraction_static=mfs, kv_split=split)
    for key in ("kv_pool", "pool_tokens", "group_tokens", "longest_request", "concurrent_at_context"):
        assert p.value(key) >= 0, key
    assert p.fits == (ctx <= p.value("longest_request"))


def test_past_the_context_length_names_yarn_only_for_yarn_models():
    assert m.yarn("qwen3-30b-a3b")["yarn"] is False
    plain = m.plan("qwen3-30b-a3b", "h200", 8, 50_000)  # derived 40,960
    assert plain.verdict.startswith("DOES NOT FIT the model")
    assert "YaRN" not in plain.verdict and plain.verdict.endswith("past max_position_embeddings.")
    assert m.plan("kimi-k2.6", "h200", 8, 300_000).verdict.endswith("past the end of the YaRN range.")


def test_derived_context_note_names_its_key_and_factor(tmp_path):
    def note(cfg):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(cfg))
        p = m.plan(str(path), "h200", 8, 1)
        row = next(r for r in p if r["key"] == "derived_context")
        assert row["value"] == m.sglang_context_length(cfg)
        return row["note"]

    cfg = m.load_config("qwen3-30b-a3b")
    assert note(cfg) == "from max_position_embeddings"
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}  # no original: SGLang applies the factor
    assert note(cfg) == "from max_position_embeddings x rope factor 4"
    assert m.sglang_context_length(cfg) == 163_840
    cfg["seq_length"] = 8192  # read before max_position_embeddings
    assert note(cfg) == "from seq_length x rope factor 4"
    verdict = m.plan(cfg, "h200", 8, 40_000).verdict
    assert "derived context length 32,768" in verdict and "YaRN" in verdict


def test_cli_tp_help_says_dp_attention_does_not_split_heads(capsys):
    with pytest.raises(SystemExit):
        kdlib.cli.main(["memory", "--help"])
    assert "unless --kv-split dp_attention" in " ".join(capsys.readouterr().out.split())
    assert kdlib.cli.main(["memory", "kimi-k2.6", "--gpu", "h200", "--tp", "3", "--context", "1000",
                           "--kv-split", "dp_attention"]) == 0  # 64 heads, not split over 3


# ------------------------------------------------------------------------------ YaRN

def test_yarn_checks():
    k = m.yarn("kimi-k2.6")
    assert (
        k["factor"] == 64
        and k["factor_x_original"] == 262_144 == k["max_position_embeddings"]
        and k["consistent"]
    )
    assert k["logit_scale_factor"] == pytest.approx(2.0047, abs=1e-4)
    assert k["softmax_scale"] == pytest.approx(0.14468, abs=1e-5)
    assert k["correction_range"] == (19, 20)
    v3 = m.yarn("deepseek-v3")
    assert v3["logit_scale_factor"] == pytest.approx(1.8739, abs=1e-4) and v3["correction_range"] == (10, 23)
    lite = m.yarn("deepseek-v2-lite")
    assert lite["cos_sin_mscale"] == 1.0 and lite["logit_scale_factor"] == pytest.approx(1.5896, abs=1e-4)
    assert m.yarn("kimi-k2-0711")["logit_scale_factor"] == pytest.approx(1.8133, abs=1e-4)
    assert m.yarn("qwen3-30b-a3b")["yarn"] is False


def test_yarn_plain_hf_and_rope_parameters_spelling():
    cfg = m.load_config("qwen3-30b-a3b")
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    y = m.yarn(cfg)
    assert y["yarn"] and "cos/sin" in y["applied_by"]
    assert y["logit_scale_factor"] == pytest.approx((0.1 * __import__("math").log(4) + 1) ** 2)
    assert not y["consistent"]  # 4 x 32768 != 40960
    assert m.sglang_context_length(cfg) == 40_960  # original present: factor not applied
    del cfg["rope_parameters"]["original_max_position_embeddings"]
    assert m.sglang_context_length(cfg) == 4 * 40_960


# ------------------------------------------------------------------------------ the seeds' 200k check

def test_seeds_200k_recheck():
    rows = {r["key"]: r for r in m.seeds_200k_recheck()}
    assert rows["elements_per_token_layer"]["status"] == "reproduced"
    assert (
        rows["kv_per_token_per_gpu"]["status"] == "wrong"
        and rows["kv_per_token_per_gpu"]["recomputed"] == 70_272
    )
    assert rows["kv_200k_per_gpu"]["recomputed"] == 14_054_400_000
    assert rows["pool_tokens"]["recomputed"] == m.plan("kimi-k2.6", "rtx-pro-6000", 8, 200_000).value(
        "pool_tokens"
    )
    assert rows["kv_200k_headroom"]["recomputed"] == 101_134 * 70_272 - 200_000 * 70_272
    assert rows["longest_request"]["recomputed"] == 101_133
    assert rows["max_position_embeddings"]["status"] == "reproduced"
    assert rows["yarn_factor"]["status"] == "reproduced"
    assert rows["growth_vs_pool"]["status"] == "reproduced" and rows["growth_vs_pool"]["recomputed"] == 1.978
    assert {r["status"] for r in rows.values()} <= {"reproduced", "consistent", "wrong", "not checkable"}


# ------------------------------------------------------------------------------ CLI

def test_cli_in_process(capsys):
    assert (
        kdlib.cli.main(["memory", "kimi-k2.6", "--gpu", "rtx-pro-6000", "--tp", "8", "--context", "200000"])
        == 0
    )
    out = capsys.readouterr().out
    assert "70,272" in out and "DOES NOT FIT" in out
    assert kdlib.cli.main(["memory", "kimi-k2.6", "--gpu", "rtx-pro-6000", "--tp", "8", "--context", "200000",
                           "--kv-dtype", "fp8_e4m3", "--mem-fraction-static", "0.83", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is True and doc["inputs"]["kv_dtype"] == "fp8_e4m3"
    assert kdlib.cli.main(["memory", "nope", "--gpu", "h200", "--tp", "8", "--context", "1"]) == 2
    assert "nope" in capsys.readouterr().err


def test_cli_subprocess():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kdlib",
            "memory",
            "deepseek-v3",
            "--gpu",
            "h200",
            "--tp",
            "8",
            "--context",
            "100000",
            "--kv-split",
            "context_parallel",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    rows = {r["key"]: r["value"] for r in doc["rows"]}
    assert rows["kv_bytes_per_token"] == 70_272 and rows["group_tokens"] == 8 * rows["pool_tokens"]
    bad = subprocess.run(
        [sys.executable, "-m", "kdlib", "memory", "deepseek-v3", "--gpu", "h200", "--tp", "8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert bad.returncode == 2 and "--context" in bad.stderr
