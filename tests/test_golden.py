"""data/golden: regeneration reproduces every file (bytes, computed floats at a tolerance) and the reference
reproduces every stored output."""

import importlib.util
import os
import shutil
import subprocess
import sys

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
# model_*.kdtr are the engine's golden logits, written by tools/make_golden_model.py
# (tests/test_engine_golden.py)
FILES = sorted(p.name for p in GOLDEN.glob("*.kdtr") if not p.name.startswith("model_"))


def test_expected_files_present():
    want = {f"tree_{n}.kdtr" for n in GEN.CONFIGS} | {f"attention_{n}.kdtr" for n in GEN.ATTENTION}
    want |= {"tree_example.kdtr", "accept_sample.kdtr", "compact.kdtr"}
    assert set(FILES) == want


def test_regeneration_matches(tmp_path):
    """Every byte regenerates except the attention outputs (GEN.COMPUTED): BLAS and numpy's SIMD exp pick
    their kernels, and so their rounding, by CPU; those match at the reference-recompute tolerance."""
    made = GEN.generate(tmp_path / "made")
    assert sorted(p.name for p in made) == FILES
    assert GEN.check(made, GOLDEN) == []
    # a committed file no config makes any more is named (model_* are the model generator's)
    shutil.copytree(GOLDEN, tmp_path / "committed")
    shutil.copy(GOLDEN / "tree_mid.kdtr", tmp_path / "committed" / "tree_removed.kdtr")
    assert GEN.check(made, tmp_path / "committed") == [
        f"tree_removed.kdtr: in {tmp_path / 'committed'}, not regenerated (no config makes it)"]
    exact = [p for p in made if not GEN.close_tensors(p)]
    assert len(exact) == len(FILES) - len(GEN.ATTENTION)
    for p in exact:
        assert p.read_bytes() == (GOLDEN / p.name).read_bytes(), f"{p.name} differs from the committed file"


def test_check_catches_changes(tmp_path):
    """The comparison can fail: an input off by one ulp, an output beyond rtol, a NaN moved, metadata."""
    src = GOLDEN / "attention_mid.kdtr"
    t, meta = {k: np.array(v) for k, v in kdtr.load(src).items()}, kdtr.read_metadata(src)
    kdtr.save(tmp_path / src.name, t, meta)
    assert (tmp_path / src.name).read_bytes() == src.read_bytes()  # load + save is the identity
    m = int(t["tree_sizes"][0])
    for name in ("q", "out", "lse"):
        changed = {k: v.copy() for k, v in t.items()}
        if name == "q":
            changed["q"].view(np.int32)[0, 0, 0, 0] += 1  # one ulp of an input
        elif name == "out":
            changed["out"][0, :m] *= 1 + 1e-10  # request 0's rows: beyond rtol 1e-12
        else:
            changed["lse"][0, 0, 0] = np.nan  # a finite value turned NaN
        kdtr.save(tmp_path / src.name, changed, meta)
        problems = GEN.check([tmp_path / src.name], GOLDEN, owns=lambda name: False)  # this file alone
        assert len(problems) == 1 and name in problems[0], (name, problems)
    kdtr.save(tmp_path / src.name, t, {**meta, "seed": "32"})
    assert "meta[seed].value" in " ".join(GEN.check([tmp_path / src.name], GOLDEN, owns=lambda name: False))


@pytest.mark.parametrize("tool, name", [("make_golden.py", "compact.kdtr"),
                                        ("make_golden_model.py", "model_tiny_a.kdtr")])
def test_check_reports_a_damaged_file(tool, name, tmp_path):
    """--check with a committed file truncated to 100 bytes: one problem line naming it, exit 1 (a KdtrError
    traceback before)."""
    shutil.copytree(GOLDEN, tmp_path / "committed")
    (tmp_path / "committed" / name).write_bytes((GOLDEN / name).read_bytes()[:100])
    run = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--check", "--out",
                          str(tmp_path / "committed")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stdout + run.stderr
    size = (GOLDEN / name).stat().st_size
    assert run.stdout.splitlines() == [
        f"{name}: {tmp_path / 'committed' / name}: truncated: the header says {size} bytes, the file has 100"]


def test_regeneration_on_another_code_path():
    """Both generators' --check with OpenBLAS forced onto its Sandybridge kernels (one thread), numpy's
    SIMD dispatch held to the SSE4.2 baseline and torch's to its default ISA: another CPU's rounding."""
    env = {
        **os.environ,
        "OPENBLAS_CORETYPE": "Sandybridge",
        "OPENBLAS_NUM_THREADS": "1",
        "OPENBLAS_VERBOSE": "2",
        "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",
        "ATEN_CPU_CAPABILITY": "default",
    }
    probe = ("from numpy._core._multiarray_umath import __cpu_features__ as f; "
             "print('V3', f['X86_V3'], f['X86_V4'])")
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert "Core: Sandybridge" in got.stdout + got.stderr and "V3 False False" in got.stdout, got
    for tool in ("make_golden.py", "make_golden_model.py"):
        run = subprocess.run(
            [sys.executable, str(ROOT / "tools" / tool), "--check"], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stdout + run.stderr


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
    assert (t["top_token_ids"][..., k:] == GEN.I64_POISON).all() and np.isnan(
        t["top_log_probs"][..., k:]
    ).all()
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
    _int_exact(
        ref.sample_tokens(np.array(t["st_probs"]), np.array(t["st_uniforms"])), t["st_tokens"], "st_tokens"
    )


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


@pytest.mark.parametrize("tool", ["make_golden.py", "make_golden_model.py"])
def test_golden_tools_refuse_a_file_as_their_folder(tool, tmp_path):
    """--out naming a file: one line and exit 2 (a FileExistsError traceback before)."""
    (tmp_path / "f").write_text("x")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--out", str(tmp_path / "f")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "is a file, not a folder" in run.stderr and "Traceback" not in run.stderr
