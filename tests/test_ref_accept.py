"""kdlib.ref.accept: greedy walk against a causal re-decode, sampling (exact and statistical)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdlib.ref import accept as acc_ref
from kdlib.ref import (
    accept_greedy,
    accept_greedy_batch,
    accept_sample,
    accept_sample_batch,
    build_tree,
    build_tree_batch,
    sample_tokens,
)
from kdlib.ref.accept import SAMPLE_ORDERS, SAMPLE_PIECE, SAMPLE_THREADS, blocked_order

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
    ids = np.stack([np.stack([rng.permutation(V)[:kp] for _ in range(L)]) for _ in range(bsz)]).astype(
        np.int64
    )
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
    assert all(
        np.array_equal(x, y)
        for x, y in zip(accept_greedy_batch(trees, poisoned), (paths, lengths, bonus), strict=True)
    )


def test_max_depth_too_small():
    t = build_tree_batch(
        np.array([[[1], [2], [3]]], dtype=np.int64), np.zeros((1, 3, 1), dtype=np.float32), 3
    )
    with pytest.raises(ValueError, match="max_depth"):
        accept_greedy_batch(t, np.array([[1, 2, 3, 4]], dtype=np.int64), max_depth=1)


# ----------------------------------------------------------------------------- sampling


def test_sequential_order_matches_sequential_sums():
    rng = np.random.default_rng(0)
    probs = rng.random((300, 17)).astype(np.float32)
    probs[:, 3] = 0.0  # never drawn
    u = rng.random(300)
    u[:5] = 0.0
    got = sample_tokens(probs, u, order="sequential")
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


@pytest.mark.parametrize("order", SAMPLE_ORDERS)
def test_sample_tokens_unnormalised_and_edges(order):
    # V <= SAMPLE_PIECE: one thread holds the whole row in index order, so both orders agree
    probs = np.array([[0.0, 2.0, 2.0], [1.0, 0.0, 0.0]], dtype=np.float64)
    assert sample_tokens(probs, np.array([0.0, 0.999999]), order=order).tolist() == [1, 0]
    # u*total == cum[1] -> next
    assert sample_tokens(probs, np.array([0.5, 0.5]), order=order).tolist() == [2, 0]
    assert sample_tokens(probs, np.array([np.nextafter(1.0, 0), 0.0]), order=order).tolist() == [2, 0]


def blocked_by_definition(p, u: float, threads: int, piece: int) -> int:
    """The blocked draw of one row written out with Python floats (IEEE doubles) and loops."""
    v = len(p)
    tile = threads * piece
    seqs = [
        [
            k * tile + t * piece + e
            for k in range(-(-v // tile))
            for e in range(piece)
            if k * tile + t * piece + e < v
        ]
        for t in range(threads)
    ]
    partial = []
    for seq in seqs:
        s = 0.0
        for i in seq:
            s += float(p[i])
        partial.append(s)

    def scan32(a):  # shuffle-up scan: at step d lane i adds lane i - d's value from before the step
        for d in (1, 2, 4, 8, 16):
            a = [a[i] + a[i - d] if i >= d else a[i] for i in range(32)]
        return a

    lanes = [scan32(partial[w * 32:(w + 1) * 32]) for w in range(threads // 32)]
    warp_inc = scan32([lane[31] for lane in lanes] + [0.0] * (32 - len(lanes)))
    excl = [([0.0] + warp_inc)[w] + ([0.0] + lanes[w])[lane] for w in range(len(lanes)) for lane in range(32)]
    ends = [excl[t] + partial[t] for t in range(threads)]
    total = max(ends[t] for t in range(threads) if partial[t] > 0)
    x = u * total
    if not x < total:
        x = float(np.nextafter(total, 0.0))
    for t, seq in enumerate(seqs):
        s = 0.0
        for i in seq:
            s += float(p[i])
            if p[i] > 0 and x < excl[t] + s:
                return i
    raise AssertionError("no token drawn")


def adversarial_row(rng, v: int, dtype):
    """Skewed mass with zeros, runs of zeros as long as a tile, subnormals and one dominant entry."""
    p = rng.random(v) ** rng.choice([1, 3, 12])
    p[rng.random(v) < rng.choice([0.0, 0.3, 0.9])] = 0.0
    if v > 8 and rng.random() < 0.5:
        a = int(rng.integers(0, v))
        p[a:a + int(rng.integers(1, v))] = 0.0
    tiny = np.float32(1e-40) if dtype == np.float32 else 5e-324  # subnormal in the row's dtype
    p[rng.random(v) < 0.05] = tiny
    p[int(rng.integers(0, v))] += rng.choice([0.0, 1e-30, 1.0, 1e6])
    if not (p > 0).any():
        p[int(rng.integers(0, v))] = tiny
    return p.astype(dtype)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([(32, 1), (32, 4), (64, 2), (128, 4), (SAMPLE_THREADS, SAMPLE_PIECE)]),
    st.sampled_from([np.float32, np.float64]),
)
def test_blocked_draw_equals_its_definition(seed, layout, dtype):
    """The vectorised blocked draw against loops over Python floats: several thread and piece counts
    (one to 16 warps, one to several tiles, V not a multiple of the tile), zeros, subnormals, u = 0
    and u just below 1."""
    threads, piece = layout
    rng = np.random.default_rng(seed)
    v = int(rng.integers(1, 3 * threads * piece + 7))
    p = adversarial_row(rng, v, dtype)
    u = np.array([0.0, np.nextafter(1.0, 0.0), rng.random(), rng.random()])
    got = acc_ref._draw_blocked(np.tile(p.astype(np.float64), (4, 1)), u, threads, piece)
    want = [blocked_by_definition(p, float(x), threads, piece) for x in u]
    assert got.tolist() == want
    assert (p[got] > 0).all()
    if layout == (SAMPLE_THREADS, SAMPLE_PIECE):
        assert sample_tokens(p[None].repeat(4, axis=0), u).tolist() == want
    assert got[0] == next(i for i in blocked_order(v, threads, piece) if p[i] > 0)  # u = 0: first positive


@pytest.mark.parametrize("v", [1, 4, 5, 2047, 2048, 2049, 6143, 32000])
def test_blocked_order_is_a_permutation(v):
    order = blocked_order(v)
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(v))
    tile = SAMPLE_THREADS * SAMPLE_PIECE
    # thread 0 starts the row
    assert order[: min(v, SAMPLE_PIECE)].tolist() == list(range(min(v, SAMPLE_PIECE)))
    if v > tile:
        assert order[SAMPLE_PIECE] == tile  # thread 0 goes on with its piece of tile 1


@pytest.mark.parametrize("order", SAMPLE_ORDERS)
@pytest.mark.parametrize("v", [1500, 6000, 9001])
def test_u_on_exact_boundaries(order, v):
    """1024 ones among zeros: every sum is an exact integer and u = m / 1024 is exact, so x = m lands on
    a CDF step exactly (thread and warp boundaries of the blocked order included) and the draw is the
    (m+1)-th positive token of the order."""
    rng = np.random.default_rng(v)
    ones = np.sort(rng.choice(v, 1024, replace=False))
    probs = np.zeros((1024, v), dtype=np.float32)
    probs[:, ones] = 1.0
    m = np.arange(1024)
    visit = blocked_order(v) if order == "blocked" else np.arange(v)
    positives = visit[probs[0, visit] > 0]  # positive tokens in the order's sequence
    got = sample_tokens(probs, m / 1024.0, order=order)
    assert got.tolist() == positives[m].tolist()


@pytest.mark.parametrize("order", SAMPLE_ORDERS)
@pytest.mark.parametrize("dtype,tiny", [(np.float32, 1e-40), (np.float64, 5e-324), (np.float32, 1.0)])
def test_single_nonzero_is_always_drawn(order, dtype, tiny):
    rng = np.random.default_rng(4)
    v = 5000
    where = rng.integers(0, v, 64)
    probs = np.zeros((64, v), dtype=dtype)
    probs[np.arange(64), where] = tiny
    u = rng.random(64)
    u[:2] = [0.0, np.nextafter(1.0, 0.0)]
    got = sample_tokens(probs, u, order=order)
    if order == "sequential":  # u * total rounds up to a subnormal total (here for u > 1/2): V, out of range
        where = np.where(u * tiny < tiny, where, v)
    assert got.tolist() == where.tolist()


def test_orders_agree_when_one_thread_holds_the_mass():
    """With every positive entry in one thread's elements the blocked CDF is the sequential one (the
    other threads add only zeros), so both orders draw the same token for every u."""
    rng = np.random.default_rng(8)
    v = 3 * SAMPLE_THREADS * SAMPLE_PIECE + 5
    order = blocked_order(v)
    rows = 200
    probs = np.zeros((rows, v), dtype=np.float32)
    u = rng.random(rows)
    u[:3] = [0.0, np.nextafter(1.0, 0.0), 0.5]
    for r in range(rows):
        t = int(rng.integers(0, SAMPLE_THREADS))
        own = [i for i in order if (i % (SAMPLE_THREADS * SAMPLE_PIECE)) // SAMPLE_PIECE == t]
        probs[r, own] = rng.random(len(own)) ** 3 * (rng.random(len(own)) < 0.7)
        probs[r, own[int(rng.integers(len(own)))]] += 1e-3
    assert (sample_tokens(probs, u) == sample_tokens(probs, u, order="sequential")).all()


@pytest.mark.parametrize("order", SAMPLE_ORDERS)
def test_stratified_uniforms_give_the_distribution(order):
    """u_i = (i + 1/2) / M hits token k about M p_k / sum(p) times; an inverse CDF in any order misses
    that count by at most one (plus float64 rounding), so the two orders have the same distribution."""
    rng = np.random.default_rng(6)
    v, m = 3000, 8192
    p = adversarial_row(rng, v, np.float32)
    counts = np.bincount(
        sample_tokens(np.tile(p, (m, 1)), (np.arange(m) + 0.5) / m, order=order), minlength=v
    )
    expect = m * p.astype(np.float64) / p.astype(np.float64).sum()
    assert np.abs(counts - expect).max() <= 1 + 1e-6
    assert counts[p == 0].sum() == 0


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
    ids = np.stack([np.stack([rng.permutation(V)[:kp] for _ in range(L)]) for _ in range(bsz)]).astype(
        np.int64
    )
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


def test_first_two_emitted_tokens_follow_the_target_jointly():
    """Lossless past the first token: rounds of sample-and-walk chained on their own output, against a
    target whose next-token distribution depends on the context, emit their first two tokens (a, b) as
    p(a) p(b | a). The first token alone cannot see a walk that draws an accepted node's successor from
    the wrong row (its parent's), this can."""
    rng = np.random.default_rng(5)
    v = 4  # tokens: 16 pairs, 15 degrees of freedom
    logits = rng.standard_normal((v, v, v)) * 1.5

    def p_of(ctx):  # [v]: the target's next-token distribution after the context's last two tokens
        a, b = (ctx[-2] if len(ctx) > 1 else 0), (ctx[-1] if ctx else 0)
        x = np.exp(logits[a, b])
        return x / x.sum()

    ids = np.stack([rng.permutation(v)[:3] for _ in range(3)]).astype(np.int64)  # [L 3, K' 3]
    lp = -np.sort(rng.random((3, 3)) * 3, axis=1).astype(np.float32)
    tree = build_tree(ids, lp, 8)
    seqs = node_sequences(tree)
    draws = 8_000
    counts = np.zeros((v, v))
    for _ in range(draws):
        out = []
        while len(out) < 2:
            probs = np.stack([p_of(out + list(seqs[i])) for i in range(tree.n + 1)])  # [n+1, v]
            path, bonus = accept_sample(tree, probs, rng.random(tree.n + 1))
            out += [*seqs[int(path[-1])], int(bonus)]
        counts[out[0], out[1]] += 1
    expected = np.array([[p_of([])[a] * p_of([a])[b] for b in range(v)] for a in range(v)]) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 99.99% quantile of chi-square with 15 degrees of freedom: 44.3 (fixed seed: deterministic)
    assert chi2 < 44.3, (chi2, counts / draws)


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
@pytest.mark.parametrize("order", SAMPLE_ORDERS)
def test_sample_tokens_bad_input(probs, u, msg, order):
    with pytest.raises(ValueError, match=msg):
        sample_tokens(probs, u, order=order)


def test_sample_tokens_bad_order():
    with pytest.raises(ValueError, match="order"):
        sample_tokens(np.ones((1, 2)), np.zeros(1), order="pairwise")


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
