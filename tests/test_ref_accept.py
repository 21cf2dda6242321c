"""kdlib.ref.accept: greedy walk against a causal re-decode, sampling (exact and statistical)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdlib.ref import (
    accept_greedy,
    accept_greedy_batch,
    accept_sample,
    accept_sample_batch,
    build_tree,
    build_tree_batch,
    sample_tokens,
)

V = 6  # a tiny vocabulary, so the lookup-table target often agrees with the draft


def example_tree():
    ids = np.array([[10, 11], [20, 21], [30, 31]], dtype=np.int64)
    lp = np.log(np.array([[0.60, 0.30], [0.90, 0.05], [0.45, 0.40]], dtype=np.float32))
    return build_tree(ids, lp, 5)


def table_target(table: np.ndarray):
    """A deterministic 'target model': the next token is a lookup on the last two tokens."""

    def next_token(seq):
        return int(table[(seq[-1] * 7 + seq[-2]) % table.shape[0]])

    return next_token


def node_sequences(tree):
    """Token sequence (excluding the root) from the root to every node."""
    seqs = [()]
    for i in range(1, tree.n + 1):
        seqs.append(seqs[int(tree.parents[i])] + (int(tree.node_token_ids[i - 1]),))
    return seqs


def random_tree(rng, L, kp, budget):
    ids = np.stack([rng.permutation(V)[:kp] for _ in range(L)]).astype(np.int64)
    lp = -np.sort(-np.log(rng.dirichlet(np.ones(V), size=L)), axis=1)[:, :kp].astype(np.float32)
    return build_tree(ids, lp, budget), ids, lp


def test_worked_example_walk():
    t = example_tree()
    targets = np.array([11, 0, 0, 20, 77, 0], dtype=np.int64)  # argmax 11 at 0, 20 at 3, 77 at 4
    path, bonus = accept_greedy(t, targets)
    assert path.dtype == np.int64 and path.tolist() == [0, 3, 4] and bonus == 77


def test_root_only_walk():
    t = build_tree(np.zeros((0, 3), dtype=np.int64), np.zeros((0, 3), dtype=np.float32), 8)
    path, bonus = accept_greedy(t, np.array([0], dtype=np.int64))
    assert path.tolist() == [0] and bonus == 0  # token 0 is a real token


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(1, 4), st.integers(0, 40))
def test_greedy_walk_equals_causal_redecode(seed, L, kp, budget):
    rng = np.random.default_rng(seed)
    tree, _, _ = random_tree(rng, L, kp, budget)
    f = table_target(rng.integers(0, V, size=13))
    context = [int(x) for x in rng.integers(0, V, size=3)]  # committed prefix, root (bonus) last
    seqs = node_sequences(tree)
    # the target at every node: its greedy next token after context + the node's path
    targets = np.array([f(context + list(s)) for s in seqs], dtype=np.int64)
    path, bonus = accept_greedy(tree, targets)
    # independent: decode autoregressively and keep the longest prefix that is a node of the tree
    index = {s: i for i, s in enumerate(seqs)}
    seq = list(context)
    emitted = []
    while True:
        y = f(seq)
        emitted.append(y)
        seq.append(y)
        if tuple(emitted) not in index:
            break
    accepted = emitted[:-1]
    expect = [index[tuple(accepted[:k])] for k in range(len(accepted) + 1)]
    assert path.tolist() == expect
    assert bonus == emitted[-1]
    assert np.all(np.diff(path) > 0)


@pytest.mark.parametrize("budget", [0, 1, 9, 40])
def test_greedy_batch_equals_per_request(budget):
    rng = np.random.default_rng(budget)
    bsz, L, kp = 7, 5, 4
    ids = np.stack([np.stack([rng.permutation(V)[:kp] for _ in range(L)]) for _ in range(bsz)]).astype(np.int64)
    lp = -np.sort(-np.log(rng.dirichlet(np.ones(V), size=(bsz, L))), axis=-1)[..., :kp].astype(np.float32)
    trees = build_tree_batch(ids, lp, budget)
    targets = rng.integers(0, V, size=(bsz, budget + 1)).astype(np.int64)
    paths, lengths, bonus = accept_greedy_batch(trees, targets)
    assert paths.shape == (bsz, budget + 1) and paths.dtype == np.int64
    p2, l2, b2 = accept_greedy_batch(trees, targets, max_depth=L)
    assert p2.shape == (bsz, L + 1)
    for b in range(bsz):
        m = int(trees.sizes[b])
        path, bb = accept_greedy(trees.tree(b), targets[b, :m])
        assert lengths[b] == l2[b] == len(path) and bonus[b] == b2[b] == bb
        assert paths[b, : len(path)].tolist() == path.tolist() and (paths[b, len(path):] == -1).all()
        assert p2[b, : len(path)].tolist() == path.tolist()
    # slots past the tree size are never read
    poisoned = targets.copy()
    for b in range(bsz):
        poisoned[b, trees.sizes[b]:] = 2**62
    assert all(np.array_equal(x, y) for x, y in zip(accept_greedy_batch(trees, poisoned), (paths, lengths, bonus), strict=True))


def test_max_depth_too_small():
    t = build_tree_batch(np.array([[[1], [2], [3]]], dtype=np.int64), np.zeros((1, 3, 1), dtype=np.float32), 3)
    with pytest.raises(ValueError, match="max_depth"):
        accept_greedy_batch(t, np.array([[1, 2, 3, 4]], dtype=np.int64), max_depth=1)


# ----------------------------------------------------------------------------- sampling


def test_sample_tokens_matches_sequential_sums():
    rng = np.random.default_rng(0)
    probs = rng.random((300, 17)).astype(np.float32)
    probs[:, 3] = 0.0  # never drawn
    u = rng.random(300)
    u[:5] = 0.0
    got = sample_tokens(probs, u)
    for r in range(300):
        acc = []
        s = 0.0
        for p in probs[r].tolist():
            s += p
            acc.append(s)
        x = u[r] * acc[-1]
        assert got[r] == next(i for i, c in enumerate(acc) if x < c)
    assert not (got == 3).any()
    assert got.dtype == np.int64


def test_sample_tokens_unnormalised_and_edges():
    probs = np.array([[0.0, 2.0, 2.0], [1.0, 0.0, 0.0]], dtype=np.float64)
    assert sample_tokens(probs, np.array([0.0, 0.999999])).tolist() == [1, 0]
    assert sample_tokens(probs, np.array([0.5, 0.5])).tolist() == [2, 0]  # u*total == cum[1] -> next index
    assert sample_tokens(probs, np.array([np.nextafter(1.0, 0), 0.0])).tolist() == [2, 0]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 30))
def test_accept_sample_equals_sample_then_walk(seed, budget):
    rng = np.random.default_rng(seed)
    tree, _, _ = random_tree(rng, 4, 3, budget)
    probs = rng.dirichlet(np.ones(V), size=tree.n + 1)
    u = rng.random(tree.n + 1)
    path, bonus = accept_sample(tree, probs, u)
    p2, b2 = accept_greedy(tree, sample_tokens(probs, u))
    assert path.tolist() == p2.tolist() and bonus == b2


def test_accept_sample_batch_equals_per_request():
    rng = np.random.default_rng(3)
    bsz, L, kp, budget = 5, 4, 3, 12
    ids = np.stack([np.stack([rng.permutation(V)[:kp] for _ in range(L)]) for _ in range(bsz)]).astype(np.int64)
    lp = -np.sort(-np.log(rng.dirichlet(np.ones(V), size=(bsz, L))), axis=-1)[..., :kp].astype(np.float32)
    trees = build_tree_batch(ids, lp, budget)
    probs = rng.dirichlet(np.ones(V), size=(bsz, budget + 1)).astype(np.float32)
    u = rng.random((bsz, budget + 1))
    for b in range(bsz):  # padding slots hold garbage that must never be read
        probs[b, trees.sizes[b]:] = np.nan
        u[b, trees.sizes[b]:] = 7.0
    paths, lengths, bonus = accept_sample_batch(trees, probs, u)
    for b in range(bsz):
        m = int(trees.sizes[b])
        path, bb = accept_sample(trees.tree(b), probs[b, :m], u[b, :m])
        assert paths[b, :lengths[b]].tolist() == path.tolist() and bonus[b] == bb


def test_first_emitted_token_follows_target():
    """Lossless: whatever the tree, the first emitted token is distributed as the root's target."""
    rng = np.random.default_rng(11)
    tree, _, _ = random_tree(rng, 3, 3, 10)
    probs = rng.dirichlet(np.ones(V), size=tree.n + 1)  # [n+1, V]
    draws = 40_000
    counts = np.zeros(V)
    seqs = node_sequences(tree)
    for _ in range(draws):
        path, bonus = accept_sample(tree, probs, rng.random(tree.n + 1))
        first = seqs[int(path[1])][0] if len(path) > 1 else bonus
        counts[first] += 1
    expected = probs[0] * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 99.99% quantile of chi-square with V - 1 = 5 degrees of freedom is 25.7 (fixed seed: deterministic)
    assert chi2 < 25.7, (chi2, counts / draws, probs[0])


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "probs,u,msg",
    [
        (np.ones((2, 3), dtype=np.float16), np.zeros(2), "float32 or float64"),
        (np.ones(3), np.zeros(3), r"\[N, V\]"),
        (np.ones((2, 3)), np.zeros(3), "uniforms"),
        (np.ones((2, 3)), np.zeros(2, dtype=np.float32), "uniforms"),
        (np.array([[1.0, np.nan, 0.0]]), np.zeros(1), "NaN"),
        (np.array([[1.0, -0.5, 0.0]]), np.zeros(1), "negative"),
        (np.array([[0.0, 0.0]]), np.zeros(1), "sums to zero"),
        (np.ones((1, 2)), np.ones(1), r"\[0, 1\)"),
        (np.ones((1, 2)), -np.ones(1) * 0.1, r"\[0, 1\)"),
    ],
)
def test_sample_tokens_bad_input(probs, u, msg):
    with pytest.raises(ValueError, match=msg):
        sample_tokens(probs, u)


def test_accept_bad_input():
    t = example_tree()
    with pytest.raises(ValueError, match="shape"):
        accept_greedy(t, np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match="integer"):
        accept_greedy(t, np.zeros(6, dtype=np.float64))
    with pytest.raises(ValueError, match="DDTree"):
        accept_greedy(None, np.zeros(6, dtype=np.int64))
    with pytest.raises(ValueError, match="probs"):
        accept_sample(t, np.ones((5, 4)), np.zeros(5))
    batch = build_tree_batch(np.array([[[1], [2]]], dtype=np.int64), np.zeros((1, 2, 1), dtype=np.float32), 2)
    with pytest.raises(ValueError, match="shape"):
        accept_greedy_batch(batch, np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="DDTreeBatch"):
        accept_greedy_batch(t, np.zeros((1, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="uniforms"):
        accept_sample_batch(batch, np.ones((1, 3, 4)), np.zeros((1, 2)))
