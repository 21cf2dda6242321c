"""kdlib.ref.compact: in-place ascending compaction and the page_size 1 remap."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlib.ref import compact_kv, compact_kv_batch, remap_slots


@st.composite
def path_case(draw, max_tree=12):
    size = draw(st.integers(1, max_tree))  # tree size n + 1
    rest = draw(st.lists(st.integers(1, size - 1), unique=True, max_size=size - 1)) if size > 1 else []
    path = np.array([0, *sorted(rest)], dtype=np.int64)
    return size, path


def test_worked_example():
    s = 5
    cache = np.arange(20 * 3, dtype=np.float32).reshape(20, 3)
    before = cache.copy()
    out = compact_kv(cache, s, np.array([0, 3, 4]))
    assert out is cache
    np.testing.assert_array_equal(cache[s : s + 3], before[[s, s + 3, s + 4]])
    np.testing.assert_array_equal(cache[:s], before[:s])
    np.testing.assert_array_equal(cache[s + 3 :], before[s + 3 :])


@settings(max_examples=200, deadline=None)
@given(path_case(), st.integers(0, 5), st.sampled_from([np.float32, np.float64, np.int8, np.uint16]))
def test_compact_equals_gather(case, start, dtype):
    size, path = case
    rng = np.random.default_rng(size * 31 + start)
    cache = rng.integers(0, 100, size=(start + size + 2, 2, 3)).astype(dtype)  # [S, 2, 3]: any trailing dims
    before = cache.copy()
    compact_kv(cache, start, path)
    np.testing.assert_array_equal(cache[start : start + len(path)], before[start + path])
    untouched = np.ones(cache.shape[0], bool)
    untouched[start : start + len(path)] = False
    np.testing.assert_array_equal(cache[untouched], before[untouched])


@settings(max_examples=100, deadline=None)
@given(st.lists(path_case(), min_size=1, max_size=5), st.integers(0, 3))
def test_batch_equals_sequential(cases, gap):
    starts, paths, lengths = [], [], []
    at = 1
    for size, path in cases:
        starts.append(at)
        paths.append(path)
        lengths.append(len(path))
        at += size + gap
    maxlen = max(lengths)
    padded = np.full((len(cases), maxlen + 1), 10**9, dtype=np.int64)  # poison past lengths
    for b, p in enumerate(paths):
        padded[b, : len(p)] = p
    rng = np.random.default_rng(at)
    cache = rng.standard_normal((at + 2, 4))
    expect = cache.copy()
    for s, p in zip(starts, paths, strict=True):
        compact_kv(expect, s, p)
    out = compact_kv_batch(cache, np.array(starts), padded, np.array(lengths))
    assert out is cache
    np.testing.assert_array_equal(cache, expect)


def test_remap_slots():
    req_to_token = np.full((2, 16), -7, dtype=np.int32)
    starts = np.array([4, 0])
    tree_slots = np.array([[100, 101, 102, 103, 104, 105], [200, 201, 202, -1, -1, -1]], dtype=np.int32)
    paths = np.array([[0, 3, 4, -1], [0, 2, -1, -1]])
    lengths = np.array([3, 2])
    freed = remap_slots(req_to_token, starts, tree_slots, paths, lengths)
    assert freed.dtype == np.int32
    assert freed.tolist() == [101, 102, 105, 201]
    assert req_to_token[0, 4:7].tolist() == [100, 103, 104]
    assert req_to_token[1, 0:2].tolist() == [200, 202]
    assert (
        (req_to_token[0, :4] == -7).all()
        and (req_to_token[0, 7:] == -7).all()
        and (req_to_token[1, 2:] == -7).all()
    )


def test_remap_slots_refuses_a_slot_the_table_cannot_hold():
    """int64 slots past 2**31 into an int32 table would wrap: refused, the table untouched."""
    req_to_token = np.full((1, 8), -7, dtype=np.int32)
    tree_slots = np.array([[5, 2**31, 6]], dtype=np.int64)
    with pytest.raises(ValueError, match="wrap"):
        remap_slots(req_to_token, np.array([0]), tree_slots, np.array([[0, 1]]), np.array([2]))
    assert (req_to_token == -7).all()
    freed = remap_slots(req_to_token, np.array([0]), tree_slots, np.array([[0, 2]]), np.array([2]))
    assert freed.tolist() == [2**31] and req_to_token[0, :2].tolist() == [5, 6]  # a freed one may be big


@settings(max_examples=100, deadline=None)
@given(st.lists(path_case(), min_size=1, max_size=4))
def test_remap_partitions_slots(cases):
    """Accepted slots (now in req_to_token) and freed slots partition the allocated tree slots."""
    bsz = len(cases)
    width = 13
    rng = np.random.default_rng(bsz)
    pool = rng.permutation(1000)
    tree_slots = np.full((bsz, width), -1, dtype=np.int64)
    paths = np.full((bsz, width), -1, dtype=np.int64)
    lengths = np.zeros(bsz, dtype=np.int64)
    for b, (size, path) in enumerate(cases):
        tree_slots[b, :size] = pool[b * width : b * width + size]
        paths[b, : len(path)] = path
        lengths[b] = len(path)
    starts = rng.integers(0, 5, size=bsz)
    req = np.zeros((bsz, 20), dtype=np.int64)
    freed = remap_slots(req, starts, tree_slots, paths, lengths)
    accepted = [req[b, starts[b] : starts[b] + lengths[b]] for b in range(bsz)]
    got = sorted(np.concatenate([*accepted, freed]).tolist())
    assert got == sorted(tree_slots[tree_slots >= 0].tolist())
    assert len(set(freed.tolist())) == len(freed)


def test_bad_input():
    cache = np.zeros((10, 4))
    with pytest.raises(ValueError, match="strictly increasing"):
        compact_kv(cache, 0, np.array([0, 2, 2]))
    with pytest.raises(ValueError, match="past the cache"):
        compact_kv(cache, 5, np.array([0, 5]))
    with pytest.raises(ValueError, match="integer"):
        compact_kv(cache, 0, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="start"):
        compact_kv(cache, 1.5, np.array([0]))
    with pytest.raises(ValueError, match="overlapping"):
        compact_kv_batch(cache, np.array([0, 2]), np.array([[0, 3], [0, 1]]), np.array([2, 2]))
    with pytest.raises(ValueError, match="lengths"):
        compact_kv_batch(cache, np.array([0]), np.array([[0, 3]]), np.array([3]))
    with pytest.raises(ValueError, match="disagree"):
        compact_kv_batch(cache, np.array([0, 5]), np.array([[0, 3]]), np.array([2]))
    req = np.zeros((1, 4), dtype=np.int32)
    slots = np.array([[5, 6, -1]], dtype=np.int32)
    with pytest.raises(ValueError, match="no allocated slot"):
        remap_slots(req, np.array([0]), slots, np.array([[0, 2]]), np.array([2]))
    with pytest.raises(ValueError, match="max_ctx"):
        remap_slots(req, np.array([3]), slots, np.array([[0, 1]]), np.array([2]))
    with pytest.raises(ValueError, match="past tree_slots"):
        remap_slots(req, np.array([0]), slots, np.array([[0, 3]]), np.array([2]))
