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


def _two_rounds(mode):
    """A cache with 3 committed rows (value 1) and 3 pending tree rows (value 2)."""
    cache = LatentCache(CFG, 16, mode=mode)
    cache.write_all(cache.pending(3), torch.ones(3, CFG.num_hidden_layers, CFG.latent_dim))
    cache.commit()
    cache.write_all(cache.pending(3), torch.full((3, CFG.num_hidden_layers, CFG.latent_dim), 2.0))
    return cache


@pytest.mark.parametrize("mode", ["compact", "remap"])
@pytest.mark.parametrize(
    ("path", "n", "match"),
    [
        ([[0, 5]], 2, r"strictly increasing in \[0, 3\)"),  # past the tree: compact copied a stale row
        ([[0, -1]], 2, "strictly increasing"),
        ([[1, 0]], 2, "strictly increasing"),
        ([[0, 0]], 2, "strictly increasing"),
        ([[0]], 2, r"path length 2 must be in \[1, 1\]"),
        ([0, 1], 2, r"paths must be \[1, W\]"),
        ([[0, 1], [0, 1]], 2, r"paths must be \[1, W\]"),
    ],
)
def test_a_path_outside_the_pending_rows_is_refused_with_nothing_changed(mode, path, n, match):
    """Compact mode checked the path against the whole [L * num_slots] pool only: [[0, 5]] with 3 rows
    pending was accepted and copied a zero row into the committed prefix."""
    cache = _two_rounds(mode)
    pending, free = cache._pending.clone(), list(cache._free)
    kv, table = cache.kv.clone(), cache.req_to_token.clone()
    with pytest.raises(ValueError, match=match):
        cache.commit_path(torch.tensor(path), torch.tensor([n]))
    assert cache.length == 3 and torch.equal(cache._pending, pending) and cache._free == free
    assert torch.equal(cache.kv, kv) and torch.equal(cache.req_to_token, table)
    assert cache.commit_path(torch.tensor([[0, 2]]), torch.tensor([2])) == 2  # the pending rows still commit
    assert cache.committed_rows()[:, 0, 0].tolist() == [1.0, 1.0, 1.0, 2.0, 2.0]
    if mode == "remap":  # no slot lost: committed + free = the pool
        assert len(cache._free) == cache.num_slots - cache.length


@pytest.mark.parametrize("mode", ["compact", "remap"])
def test_a_commit_the_ops_refuse_keeps_its_pending_slots(mode):
    """Remap mode took the pending slots before ops.remap_slots validated: after a refused path they were
    neither committed nor free (10 slots, 3 pending -> 7 free; pending(8) then raised CacheFullError).
    A float path passes the cache's own checks and is refused by the op."""
    cache = LatentCache(CFG, 10, mode=mode)
    slots = cache.pending(3)
    with pytest.raises(ValueError, match="paths must be an integer"):
        cache.commit_path(torch.tensor([[0.0, 1.0]]), torch.tensor([2]))
    assert torch.equal(cache._pending, slots) and cache.length == 0
    assert cache.commit_path(torch.tensor([[0, 2]]), torch.tensor([2])) == 2
    cache.pending(8)  # 10 - 2 committed: no slot was lost


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_slots": 2.7}, "num_slots must be an int >= 1, got 2.7"),
        ({"num_slots": 0}, "num_slots must be an int >= 1, got 0"),
        ({"num_slots": True}, "num_slots must be an int >= 1, got True"),
        ({"num_slots": 4, "max_ctx": 0}, "max_ctx must be an int >= 1, got 0"),
        ({"num_slots": 4, "max_ctx": 3.5}, "max_ctx must be an int >= 1, got 3.5"),
        ({"num_slots": 4, "max_ctx": False}, "max_ctx must be an int >= 1, got False"),
    ],
)
def test_the_constructor_refuses_non_integer_and_non_positive_sizes(kwargs, match):
    """num_slots=2.7 became 2 slots and max_ctx=0 became num_slots."""
    with pytest.raises(ValueError, match=match):
        LatentCache(CFG, **kwargs)
    assert LatentCache(CFG, 4, max_ctx=6).max_ctx == 6 and LatentCache(CFG, 4).max_ctx == 4
