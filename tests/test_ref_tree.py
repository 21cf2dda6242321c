"""kdlib.ref.tree: the worked example, structural properties, brute-force equality, bad input."""

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdlib.ref import DDTree, build_tree, build_tree_batch

# ----------------------------------------------------------------------------- helpers


def example_inputs():
    """Survey §2.7: L=3, K'=2."""
    ids = np.array([[10, 11], [20, 21], [30, 31]], dtype=np.int64)
    lp = np.log(np.array([[0.60, 0.30], [0.90, 0.05], [0.45, 0.40]], dtype=np.float32))
    return ids, lp


def brute_force(ids: np.ndarray, lp: np.ndarray, budget: int):
    """Every rank prefix of the K-ary tree (K = min(budget, K')), scored by a plain left-to-right
    float64 sum, sorted by (score desc, rank tuple). Returns [(score, ranks)]."""
    L = ids.shape[0]
    k = min(budget, ids.shape[1])
    out = []
    for d in range(1, L + 1):
        for ranks in itertools.product(range(k), repeat=d):
            s = 0.0
            for j, r in enumerate(ranks):
                s += float(lp[j, r])
            out.append((s, ranks))
    out.sort(key=lambda e: (-e[0], e[1]))
    return out


def node_ranks(tree: DDTree, ids: np.ndarray) -> list[tuple]:
    """Rank tuple of every non-root node, read back through parents and the token rows."""
    ranks = [()]
    for i in range(1, tree.n + 1):
        d = int(tree.node_depths[i - 1])
        r = int(np.flatnonzero(ids[d - 1] == tree.node_token_ids[i - 1])[0])
        ranks.append(ranks[int(tree.parents[i])] + (r,))
    return ranks[1:]


def check_structure(tree: DDTree, ids: np.ndarray, lp: np.ndarray, budget: int) -> None:
    """Every invariant of survey §2.4 (plus LCRS and positions), checked independently."""
    n = tree.n
    L, kp = ids.shape
    k = min(budget, kp)
    cap = sum(k**d for d in range(1, L + 1))
    assert n == min(budget, cap)
    assert tree.node_token_ids.dtype == tree.node_depths.dtype == tree.parents.dtype == np.int64
    assert tree.visibility.dtype == bool and tree.scores.dtype == np.float64
    assert tree.parents.shape == (n + 1,) and tree.parents[0] == -1
    for i in range(1, n + 1):
        p = int(tree.parents[i])
        assert 0 <= p < i
        assert tree.node_depths[i - 1] == (0 if p == 0 else tree.node_depths[p - 1]) + 1
    assert np.all(np.diff(tree.scores) <= 0), "scores must be non-increasing by index"
    np.testing.assert_array_equal(tree.positions, np.concatenate([[0], tree.node_depths]))
    # siblings: distinct tokens; rank r > 0 has its rank r-1 sibling earlier
    ranks = node_ranks(tree, ids)
    index_of = {r: i + 1 for i, r in enumerate(ranks)}
    for i in range(1, n + 1):
        sibs = [j for j in range(1, n + 1) if tree.parents[j] == tree.parents[i]]
        toks = [int(tree.node_token_ids[j - 1]) for j in sibs]
        assert len(set(toks)) == len(toks)
        r = ranks[i - 1]
        if r[-1] > 0:
            assert index_of[r[:-1] + (r[-1] - 1,)] < i
    # visibility == ancestor-or-self closure
    vis = np.zeros((n + 1, n + 1), dtype=bool)
    for i in range(n + 1):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = int(tree.parents[j])
    np.testing.assert_array_equal(tree.visibility, vis)
    # LCRS: first child = lowest index, siblings in increasing index
    nt = np.full(n + 1, -1)
    ns = np.full(n + 1, -1)
    for p in range(n + 1):
        kids = [j for j in range(1, n + 1) if tree.parents[j] == p]
        if kids:
            nt[p] = kids[0]
            for a, b in zip(kids, kids[1:], strict=False):
                ns[a] = b
    np.testing.assert_array_equal(tree.next_token, nt)
    np.testing.assert_array_equal(tree.next_sibling, ns)


def sorted_rows(draw, L, kp, values):
    lp = np.array(
        draw(st.lists(st.lists(values, min_size=kp, max_size=kp), min_size=L, max_size=L)), dtype=np.float32
    )
    lp = -np.sort(-lp.reshape(L, kp), axis=1)
    return lp.astype(np.float32)


@st.composite
def topk_case(draw, ties: bool = False):
    L = draw(st.integers(0, 4))
    kp = draw(st.integers(1, 4))
    # keep the brute force small: capacity <= 4 + 16 + 64 + 256
    budget = draw(st.integers(0, 40))
    vocab = 50
    ids = np.stack([np.array(draw(st.permutations(range(vocab)))[:kp]) for _ in range(L)]).astype(np.int64) \
        if L else np.zeros((0, kp), dtype=np.int64)
    if ties:
        values = st.sampled_from([0.0, -0.5, -1.0, -1.5, -2.0])  # dyadic: every sum exact in float64
    else:
        values = st.floats(-6.0, 0.0, width=32)
    lp = sorted_rows(draw, L, kp, values) if L else np.zeros((0, kp), dtype=np.float32)
    return ids, lp, budget


# ----------------------------------------------------------------------------- tests


def test_worked_example_2_7():
    ids, lp = example_inputs()
    t = build_tree(ids, lp, 5)
    np.testing.assert_array_equal(t.node_token_ids, [10, 20, 11, 20, 30])
    np.testing.assert_array_equal(t.node_depths, [1, 2, 1, 2, 3])
    np.testing.assert_array_equal(t.parents, [-1, 0, 1, 0, 3, 2])
    np.testing.assert_array_equal(t.positions, [0, 1, 2, 1, 2, 3])
    rows = ["100000", "110000", "111000", "100100", "100110", "111001"]
    np.testing.assert_array_equal(t.visibility, np.array([[c == "1" for c in r] for r in rows]))
    np.testing.assert_array_equal(t.next_token, [1, 2, 5, 4, -1, -1])
    np.testing.assert_array_equal(t.next_sibling, [-1, 3, -1, -1, -1, -1])
    np.testing.assert_allclose(np.exp(t.scores), [0.60, 0.54, 0.30, 0.27, 0.243], rtol=1e-6)
    check_structure(t, ids, lp, 5)


def test_float64_sibling_arithmetic():
    """Scores are the float64 values of the heap's own formulas, not a fresh sum."""
    ids, lp = example_inputs()
    t = build_tree(ids, lp, 5)
    a, b = (float(x) for x in lp[0])
    c = float(lp[1, 0])
    d = float(lp[2, 0])
    expect = [a, a + c, (a - a) + b, ((a - a) + b) + c, (a + c) + d]
    assert t.scores.tolist() == expect


@pytest.mark.parametrize(
    "a,c,c2",
    [
        # found by search: here (logw - c) + c2 != logw + (c2 - c)
        (-0.20978518, -7.384491e-13, -2.4436637e-11),
        # and here (logw - c) + c2 != a + c2 (a fresh sum along the path)
        (-1.2378056e-14, -0.00014095061, -0.00065688114),
    ],
)
def test_sibling_score_grouping_is_exact(a, c, c2):
    """Log-probs with a wide exponent spread make float64 sums inexact: the grouping must be REF's."""
    a, c, c2 = (float(np.float32(v)) for v in (a, c, c2))
    ids = np.array([[1, 2], [3, 4]], dtype=np.int64)
    lp = np.array([[a, a - 5.0], [c, c2]], dtype=np.float32)
    t = build_tree(ids, lp, 3)
    assert node_ranks(t, ids) == [(0,), (0, 0), (0, 1)]
    logw = a + c
    expect = (logw - c) + c2
    assert expect != logw + (c2 - c) or expect != a + c2
    assert t.scores[2] == expect


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topk_case())
def test_properties_and_brute_force(case):
    ids, lp, budget = case
    t = build_tree(ids, lp, budget)
    check_structure(t, ids, lp, budget)
    # tie-aware set comparison with the brute-force top-N (scores agree to float64 rounding)
    bf = brute_force(ids, lp, budget)
    n = t.n
    if n == 0:
        return
    tol = 1e-9
    thr = bf[n - 1][0]
    got = set(node_ranks(t, ids))
    for s, r in bf:
        if s > thr + tol:
            assert r in got, f"{r} (score {s}) above the cut {thr} is missing"
        elif s < thr - tol:
            assert r not in got, f"{r} (score {s}) below the cut {thr} is selected"
    brute = dict((r, s) for s, r in bf)
    for r, s in zip(node_ranks(t, ids), t.scores, strict=True):
        assert math.isclose(s, brute[r], rel_tol=0, abs_tol=tol)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topk_case(ties=True))
def test_exact_ties_equal_brute_force_order(case):
    """With dyadic log-probs all arithmetic is exact, so the pop order must equal the brute-force
    order by (score desc, rank tuple with a proper prefix first), node for node."""
    ids, lp, budget = case
    t = build_tree(ids, lp, budget)
    check_structure(t, ids, lp, budget)
    bf = brute_force(ids, lp, budget)[: t.n]
    assert node_ranks(t, ids) == [r for _, r in bf]
    assert t.scores.tolist() == [s for s, _ in bf]


def test_all_equal_log_probs():
    """Every log-prob equal: breadth-first by rank tuple (shallow first, then lexicographic)."""
    L, kp, budget = 3, 3, 10
    ids = np.arange(L * kp, dtype=np.int64).reshape(L, kp)
    lp = np.zeros((L, kp), dtype=np.float32)
    t = build_tree(ids, lp, budget)
    check_structure(t, ids, lp, budget)
    assert node_ranks(t, ids) == [(0,), (0, 0), (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1), (0, 1, 0), (0, 1, 1),
                                  (0, 1, 2), (0, 2)]


@pytest.mark.parametrize("L,budget", [(15, 64), (15, 7), (4, 4), (1, 3)])
def test_chain(L, budget):
    rng = np.random.default_rng(L * 100 + budget)
    ids = rng.integers(0, 1000, size=(L, 1)).astype(np.int64)
    lp = -np.abs(rng.standard_normal((L, 1))).astype(np.float32)
    t = build_tree(ids, lp, budget)
    n = min(budget, L)
    assert t.n == n
    np.testing.assert_array_equal(t.parents, np.arange(-1, n))
    np.testing.assert_array_equal(t.node_token_ids, ids[:n, 0])
    np.testing.assert_array_equal(t.visibility, np.tril(np.ones((n + 1, n + 1), dtype=bool)))
    np.testing.assert_array_equal(t.next_token, np.r_[np.arange(1, n + 1), -1])


@pytest.mark.parametrize("L,kp,budget", [(0, 4, 8), (5, 4, 0), (0, 0, 0), (3, 0, 5)])
def test_root_only(L, kp, budget):
    ids = np.zeros((L, kp), dtype=np.int64)
    ids[...] = np.arange(kp)
    lp = np.zeros((L, kp), dtype=np.float32)
    t = build_tree(ids, lp, budget)
    assert t.n == 0
    np.testing.assert_array_equal(t.visibility, [[True]])
    np.testing.assert_array_equal(t.parents, [-1])
    np.testing.assert_array_equal(t.next_token, [-1])
    np.testing.assert_array_equal(t.next_sibling, [-1])
    np.testing.assert_array_equal(t.positions, [0])
    assert t.node_token_ids.shape == (0,) and t.scores.shape == (0,)


def random_topk(rng, bsz, L, kp, vocab=32000, scale=1.0):
    ids = np.stack([np.stack([rng.choice(vocab, kp, replace=False) for _ in range(L)]) for _ in range(bsz)])
    lp = np.log(rng.dirichlet(np.full(vocab if vocab < 200 else 200, scale), size=(bsz, L)))
    lp = -np.sort(-lp, axis=-1)[..., :kp].astype(np.float32)
    return ids.astype(np.int64), lp


@pytest.mark.parametrize("bsz,L,kp,budget", [(6, 15, 64, 64), (5, 4, 8, 30), (4, 3, 2, 100), (3, 2, 5, 0)])
def test_batch_equals_per_request(bsz, L, kp, budget):
    rng = np.random.default_rng(bsz + L + kp + budget)
    ids, lp = random_topk(rng, bsz, L, kp, scale=0.3)
    batch = build_tree_batch(ids, lp, budget)
    s = budget + 1
    assert batch.sizes.dtype == np.int64 and batch.sizes.shape == (bsz,)
    assert batch.visibility.shape == (bsz, s, s) and batch.parents.shape == (bsz, s)
    assert batch.node_token_ids.shape == (bsz, budget) and batch.scores.shape == (bsz, budget)
    for b in range(bsz):
        one = build_tree(ids[b], lp[b], budget)
        got = batch.tree(b)
        m = one.n + 1
        assert batch.sizes[b] == m
        for f in (
            "node_token_ids",
            "node_depths",
            "parents",
            "visibility",
            "next_token",
            "next_sibling",
            "positions",
        ):
            np.testing.assert_array_equal(getattr(got, f), getattr(one, f), err_msg=f)
        assert got.scores.tobytes() == one.scores.tobytes()
        # padding
        for f in ("node_token_ids", "node_depths", "scores"):
            pad = getattr(batch, f)[b, m - 1:]
            assert (np.isnan(pad).all() if f == "scores" else (pad == -1).all()), f
        for f in ("parents", "next_token", "next_sibling", "positions"):
            assert (getattr(batch, f)[b, m:] == -1).all(), f
        assert not batch.visibility[b, m:].any() and not batch.visibility[b, :, m:].any()


def test_underfull_and_token_zero():
    """Capacity < budget gives an underfull tree; token 0 is an ordinary token."""
    ids = np.array([[0, 1, 2], [0, 5, 6]], dtype=np.int64)
    lp = np.log(np.array([[0.5, 0.3, 0.2], [0.7, 0.2, 0.1]], dtype=np.float32))
    batch = build_tree_batch(ids[None], lp[None], 64)
    assert batch.sizes.tolist() == [13]
    assert batch.node_token_ids[0, 0] == 0


def test_budget_past_capacity_sizes_the_arrays_by_the_tree():
    """build_tree sizes its arrays by what it builds (the DDTree's views keep their whole base alive): budget
    10**6 on a 6-node tree once asked for a [1, 10**6 + 1, 10**6 + 1] visibility (931 GiB)."""
    ids, lp = example_inputs()
    ids, lp = ids[:2], lp[:2]  # L = 2, K' = 2: capacity 2 + 4 = 6
    tree = build_tree(ids, lp, 10**6)
    assert tree.n == 6
    for f in dataclasses.fields(DDTree):
        a = getattr(tree, f.name)
        assert (a if a.base is None else a.base).size <= 7 * 7, f.name
    want = build_tree_batch(ids[None], lp[None], 1_000).tree(0)  # the same tree, from padded arrays
    for f in dataclasses.fields(DDTree):
        assert getattr(tree, f.name).tobytes() == getattr(want, f.name).tobytes(), f.name


def test_cuda_twins_share_positional_arguments():
    """The kdlib.ref docstring's claim, read from the signatures (importing kdlib.cuda needs no CuPy): each
    twin takes the reference's positional arguments with their defaults and may add keyword-only options;
    order= is the one shared keyword whose default differs (None: the default kernel's order)."""
    import inspect

    import kdlib.cuda
    import kdlib.ref
    from kdlib.ops import OPS

    assert sorted(OPS) == kdlib.cuda.__all__
    for name in OPS:
        want = inspect.signature(getattr(kdlib.ref, name)).parameters.values()
        got = inspect.signature(getattr(kdlib.cuda, name)).parameters
        assert [(p.name, p.default) for p in want if p.kind != p.KEYWORD_ONLY] == [
            (p.name, p.default) for p in got.values() if p.kind != p.KEYWORD_ONLY], name
        for p in want:
            if p.kind == p.KEYWORD_ONLY:
                assert got[p.name].kind == p.KEYWORD_ONLY, (name, p.name)
                assert got[p.name].default == (None if p.name == "order" else p.default), (name, p.name)


def test_only_first_k_columns_are_read():
    """Columns >= min(budget, K') may hold anything (the golden files poison them)."""
    ids, lp = example_inputs()
    ids2 = np.concatenate([ids, np.full((3, 2), 2**62, dtype=np.int64)], axis=1)
    lp2 = np.concatenate([lp, np.full((3, 2), np.nan, dtype=np.float32)], axis=1)
    a = build_tree(ids[:, :1], lp[:, :1], 1)
    b = build_tree(ids2, lp2, 1, vocab_size=100)
    np.testing.assert_array_equal(a.parents, b.parents)
    np.testing.assert_array_equal(a.node_token_ids, b.node_token_ids)


# ----------------------------------------------------------------------------- bad input


def _bad_cases():
    ids, lp = example_inputs()
    unsorted = lp.copy()
    unsorted[1] = unsorted[1, ::-1]
    nan = lp.copy()
    nan[2, 1] = np.nan
    inf = lp.copy()
    inf[0, 1] = -np.inf
    dup = ids.copy()
    dup[1, 1] = dup[1, 0]
    neg = ids.copy()
    neg[0, 0] = -3
    logits = lp + np.float32(3)  # sorted and finite, but not log-probabilities
    return [
        ((ids.astype(np.int32), lp, 5), {}, "int64"),
        ((ids, lp.astype(np.float64), 5), {}, "float32"),
        ((ids[None], lp, 5), {}, "shape"),
        ((ids, lp[:, :1], 5), {}, "differ in shape"),
        ((ids.tolist(), lp, 5), {}, "numpy array"),
        ((ids, unsorted, 5), {}, "sorted"),
        ((ids, nan, 5), {}, "NaN"),
        ((ids, inf, 5), {}, "finite"),
        ((ids, logits, 5), {}, "log-probabilities"),
        ((ids, lp, -1), {}, "budget"),
        ((ids, lp, 2.5), {}, "budget"),
        ((ids, lp, 5), {"vocab_size": 31}, "outside"),
        ((ids, lp, 5), {"vocab_size": 0}, "vocab_size"),
        ((neg, lp, 5), {}, "negative"),
        ((dup, lp, 5), {}, "repeats"),
    ]


@pytest.mark.parametrize("args,kwargs,msg", _bad_cases())
def test_bad_input(args, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        build_tree(*args, **kwargs)


@pytest.mark.parametrize("args,kwargs,msg", _bad_cases())
def test_bad_input_batch(args, kwargs, msg):
    ids, lp, budget = args
    ids = ids[None] if isinstance(ids, np.ndarray) else [ids]
    lp = lp[None] if isinstance(lp, np.ndarray) else lp
    if msg == "shape":
        ids = args[0][0]  # 2-D where [B, L, K'] is wanted
    with pytest.raises(ValueError, match=msg):
        build_tree_batch(ids, lp, budget, **kwargs)
