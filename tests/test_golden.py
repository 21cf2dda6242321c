"""data/golden: regeneration is byte-identical, and the reference reproduces every stored output."""

import importlib.util

import numpy as np
import pytest

from kdlib import DATA, ROOT, kdtr, ref
from kdlib.check import assert_close, assert_equal

GOLDEN = DATA / "golden"


def _generator():
    spec = importlib.util.spec_from_file_location("make_golden", ROOT / "tools" / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = _generator()
# model_*.kdtr are the engine's golden logits, written by tools/make_golden_model.py (tests/test_engine_golden.py)
FILES = sorted(p.name for p in GOLDEN.glob("*.kdtr") if not p.name.startswith("model_"))


def test_expected_files_present():
    want = {f"tree_{n}.kdtr" for n in GEN.CONFIGS} | {f"attention_{n}.kdtr" for n in GEN.ATTENTION}
    want |= {"tree_example.kdtr", "accept_sample.kdtr", "compact.kdtr"}
    assert set(FILES) == want


def test_regeneration_is_byte_identical(tmp_path):
    made = GEN.generate(tmp_path)
    assert sorted(p.name for p in made) == FILES
    for p in made:
        assert p.read_bytes() == (GOLDEN / p.name).read_bytes(), f"{p.name} differs from the committed file"


def _int_exact(actual, expected, name):
    assert_equal(actual, expected, name=name, quiet=True)


def _tree_check(t):
    trees = ref.build_tree_batch(np.array(t["top_token_ids"]), np.array(t["top_log_probs"]), int(t["budget"]))
    for f in GEN.TREE_FIELDS:
        _int_exact(getattr(trees, f), t[f], f)  # scores too: bytes, NaN padding included
    return trees


@pytest.mark.parametrize("name", [f for f in FILES if f.startswith("tree_")])
def test_tree_files(name):
    t = kdtr.load(GOLDEN / name)
    meta = kdtr.read_metadata(GOLDEN / name)
    assert meta["generator"] == GEN.GENERATOR and meta["kind"] == "tree"
    trees = _tree_check(t)
    paths, lengths, bonus = ref.accept_greedy_batch(trees, np.array(t["target_tokens"]))
    _int_exact(paths, t["paths"], "paths")
    _int_exact(lengths, t["lengths"], "lengths")
    _int_exact(bonus, t["bonus"], "bonus")
    # unused inputs really are poisoned
    k = min(int(t["budget"]), t["top_token_ids"].shape[-1])
    assert (t["top_token_ids"][..., k:] == GEN.I64_POISON).all() and np.isnan(t["top_log_probs"][..., k:]).all()
    for b, m in enumerate(t["sizes"]):
        assert (t["target_tokens"][b, m:] == GEN.I64_POISON).all()


def test_accept_sample_file():
    t = kdtr.load(GOLDEN / "accept_sample.kdtr")
    trees = _tree_check(t)
    probs, uniforms = np.array(t["probs"]), np.array(t["uniforms"])
    paths, lengths, bonus = ref.accept_sample_batch(trees, probs, uniforms)
    for name, a in (("paths", paths), ("lengths", lengths), ("bonus", bonus)):
        _int_exact(a, t[name], name)
    for b, m in enumerate(trees.sizes):
        _int_exact(ref.sample_tokens(probs[b, :m], uniforms[b, :m]), t["tokens"][b, :m], "tokens")
        assert np.isnan(probs[b, m:]).all()
    _int_exact(ref.sample_tokens(np.array(t["st_probs"]), np.array(t["st_uniforms"])), t["st_tokens"], "st_tokens")


@pytest.mark.parametrize("name", [f for f in FILES if f.startswith("attention_")])
def test_attention_files(name):
    t = {k: np.array(v) for k, v in kdtr.load(GOLDEN / name).items()}
    scale = float(t["softmax_scale"])
    p = ref.prefix_attention(t["q"], t["kv_cache"], t["page_table"], t["prefix_lens"], scale)
    tail = ref.tree_tail_attention(t["q"], t["tree_kv"], t["visibility"], t["tree_sizes"], scale)
    whole = ref.tree_verify_attention(t["q"], t["kv_cache"], t["page_table"], t["prefix_lens"], t["tree_kv"],
                                      t["visibility"], t["tree_sizes"], scale)
    for key, got in (("prefix_out", p[0]), ("prefix_lse", p[1]), ("tail_out", tail[0]), ("tail_lse", tail[1]),
                     ("out", whole[0]), ("lse", whole[1])):
        odd = ~np.isfinite(t[key])  # NaN poison rows, -inf LSE of an empty prefix
        np.testing.assert_array_equal(got[odd], t[key][odd], err_msg=f"{key}: NaN / -inf pattern")
        assert np.isfinite(got[~odd]).all(), key
        assert_close(np.where(odd, 0.0, got), np.where(odd, 0.0, t[key]), rtol=1e-12, name=key, quiet=True)
    for b, m in enumerate(t["tree_sizes"]):
        assert np.isnan(t["out"][b, m:]).all() and np.isfinite(t["out"][b, :m]).all()
        assert (t["page_table"][b, t["prefix_lens"][b]:] == GEN.I32_POISON).all()


def test_compact_file():
    t = {k: np.array(v) for k, v in kdtr.load(GOLDEN / "compact.kdtr").items()}
    cache = ref.compact_kv_batch(t["cache"].copy(), t["starts"], t["paths"], t["lengths"])
    _int_exact(cache, t["cache_out"], "cache_out")
    req = t["req_to_token"].copy()
    freed = ref.remap_slots(req, t["remap_starts"], t["tree_slots"], t["paths"], t["lengths"])
    _int_exact(req, t["req_to_token_out"], "req_to_token_out")
    _int_exact(freed, t["freed_slots"], "freed_slots")
