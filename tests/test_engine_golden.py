"""Golden model logits (data/golden/model_*.kdtr): the torch model against the float64 numpy forward."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from kdlib import DATA, ROOT, check, kdtr
from kdlib.engine.cache import LatentCache
from kdlib.engine.config import ModelConfig
from kdlib.engine.loading import random_weights
from kdlib.engine.model import Model
from kdlib.ref.model import forward

FILES = ["model_tiny_a.kdtr", "model_tiny_b.kdtr"]


def _load(name):
    path = DATA / "golden" / name
    t, meta = kdtr.load(path), kdtr.read_metadata(path)
    cfg = ModelConfig.from_dict(json.loads(meta["config"]))
    weights = {k[len("weight."):]: np.array(v) for k, v in t.items() if k.startswith("weight.")}
    return cfg, weights, np.array(t["token_ids"]), np.array(t["logits"]), meta


@pytest.mark.parametrize("name", FILES)
def test_torch_fp32_matches_golden(name):
    cfg, weights, ids, logits, meta = _load(name)
    model = Model(cfg)
    model.load_weights(weights)
    out = model.eval().logits(torch.from_numpy(ids))
    check.assert_close(out, logits, rtol=float(meta["rtol_fp32"]), name=f"torch fp32 vs golden {name}")


@pytest.mark.parametrize("name", FILES)
def test_torch_fp64_and_cached_path_match_golden(name):
    """Two forms, one answer: torch float64 (plain MLA) and the absorbed cached decode against the golden."""
    cfg, weights, ids, logits, _ = _load(name)
    model = Model(cfg)
    model.load_weights(weights)
    model = model.double().eval()
    check.assert_close(model.logits(torch.from_numpy(ids)), logits, rtol=1e-12, name="torch fp64 vs golden "
                                                                                     f"{name}")
    cache = LatentCache(cfg, len(ids), dtype=torch.float64)
    h, _ = model.prefill(cache, torch.from_numpy(ids[:5]))
    rows = [model.head(h)]
    for t in range(5, len(ids)):
        h, _ = model.forward_cached(cache, torch.from_numpy(ids[t : t + 1]), [t])
        cache.commit()
        rows.append(model.head(h))
    check.assert_close(torch.cat(rows), logits, rtol=1e-12, name=f"absorbed decode fp64 vs golden {name}")


@pytest.mark.parametrize("name", FILES)
def test_seeds_and_reference_reproduce(name):
    """The stored weights are random_weights(cfg, seed) and the reference recomputes the stored logits."""
    cfg, weights, ids, logits, meta = _load(name)
    again = random_weights(cfg, int(meta["weight_seed"]))
    assert sorted(again) == sorted(weights)
    for k in again:
        check.assert_equal(weights[k], again[k], name=k, quiet=True)
    check.assert_close(forward(cfg, weights, ids), logits, rtol=1e-13, name=f"ref recompute {name}")


@pytest.mark.parametrize("token_ids", [[1.7, 40.7], np.array([1.0, 2.0]), [True, False], np.ones(3, bool)])
def test_reference_refuses_non_integer_token_ids(token_ids):
    """Floats and bools are not token ids: the int64 cast once ran [1.7, 40.7] as [1, 40]."""
    cfg, weights, *_ = _load(FILES[0])
    with pytest.raises(ValueError, match="token_ids must be integer"):
        forward(cfg, weights, token_ids)


def test_a_wrong_weight_fails():
    """The comparison can fail: one perturbed weight moves the logits far outside the tolerance."""
    cfg, weights, ids, logits, _ = _load(FILES[0])
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    weights[key] = weights[key] + np.float32(0.5) * (np.arange(weights[key].size) % 2)
    model = Model(cfg)
    model.load_weights(weights)
    with pytest.raises(AssertionError):
        check.assert_close(model.eval().logits(torch.from_numpy(ids)), logits, rtol=1e-5, quiet=True)


def test_regeneration_matches():
    """Every byte regenerates except the logits: BLAS and numpy's SIMD exp choose their kernels, and so their
    rounding, by CPU; the logits match at the tool's RTOL_REGEN (tests/test_golden.py: another code path)."""
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "make_golden_model.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and "regenerate" in run.stdout, run.stdout + run.stderr
