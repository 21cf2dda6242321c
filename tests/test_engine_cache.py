"""LatentCache: compact and remap commits keep exactly the accepted rows, in order (hypothesis)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlib import DATA
from kdlib.engine.cache import CacheFullError, LatentCache
from kdlib.engine.config import ModelConfig

CFG = dataclasses.replace(ModelConfig.from_json(DATA / "configs" / "tiny-a.json"), num_hidden_layers=2)


@st.composite
def rounds(draw):
    """A prompt length and a list of verify rounds: (rows q, accepted path as sorted indices with 0)."""
    prompt = draw(st.integers(1, 6))
    out = []
    for _ in range(draw(st.integers(0, 5))):
        q = draw(st.integers(1, 7))
        rest = draw(st.lists(st.integers(1, q - 1), unique=True, max_size=q - 1)) if q > 1 else []
        out.append((q, [0] + sorted(rest)))
    return prompt, out


def _run(mode, prompt, plan, seed):
    g = torch.Generator().manual_seed(seed)
    cache = LatentCache(CFG, 48, mode=mode)
    expect = []  # [positions] of [L, D] rows, the reference
    rows = torch.randn(prompt, CFG.num_hidden_layers, CFG.latent_dim, generator=g)
    cache.write_all(cache.pending(prompt), rows)
    cache.commit()
    expect += list(rows)
    for q, path in plan:
        slots = cache.pending(q)
        new = torch.randn(q, CFG.num_hidden_layers, CFG.latent_dim, generator=g)
        for layer in range(CFG.num_hidden_layers):
            cache.write(layer, slots, new[:, layer])
        width = 8
        paths = torch.full((1, width), -1, dtype=torch.int64)
        paths[0, : len(path)] = torch.tensor(path)
        n = cache.commit_path(paths, torch.tensor([len(path)]))
        assert n == len(path)
        expect += [new[i] for i in path]
    return cache, torch.stack(expect)


@settings(max_examples=60, deadline=None)
@given(rounds(), st.integers(0, 2**16))
def test_commits_keep_accepted_rows(plan, seed):
    prompt, rounds_ = plan
    for mode in ("compact", "remap"):
        cache, expect = _run(mode, prompt, rounds_, seed)
        assert cache.length == expect.shape[0]
        assert torch.equal(cache.committed_rows(), expect), mode
        if mode == "remap":  # no slot is lost: committed + free = the pool
            used = set(cache.req_to_token[0, : cache.length].tolist())
            assert len(used) == cache.length and used.isdisjoint(cache._free)
            assert len(used) + len(cache._free) == cache.num_slots


def test_capacity_errors():
    cache = LatentCache(CFG, 4, mode="remap")
    with pytest.raises(CacheFullError):
        cache.pending(5)
    cache.pending(3)
    cache.commit()
    with pytest.raises(CacheFullError):
        cache.pending(2)
    with pytest.raises(ValueError, match="mode"):
        LatentCache(CFG, 4, mode="paged")


@pytest.mark.parametrize("mode", ["compact", "remap"])
def test_a_refused_commit_keeps_its_pending_slots_and_a_negative_count_is_refused(mode):
    """In remap mode a commit_path refused for its length had taken the pending slots first: lost to the
    pool; pending(-2) returned no slots (remap) or raised a RuntimeError (compact)."""
    cache = LatentCache(CFG, 10, mode=mode)
    slots = cache.pending(3)
    with pytest.raises(ValueError, match=r"path length 4 must be in \[1, 3\]"):
        cache.commit_path(torch.tensor([[0, 1, 2, -1]]), torch.tensor([4]))
    assert torch.equal(cache._pending, slots)
    assert cache.commit_path(torch.tensor([[0, 2, -1]]), torch.tensor([2])) == 2
    if mode == "remap":
        assert len(cache._free) == 10 - 2  # the rejected row's slot is back in the pool
    with pytest.raises(ValueError, match="row count >= 0"):
        cache.pending(-2)
