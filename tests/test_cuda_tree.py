"""The tree kernels (build, accept, sample, compact, remap, the graph-captured step) against
`kdlib.ref`, bit for bit, on the survey's worked example, every golden file, and >= 1,000 random
cases per kernel (random, tied and subnormal log-probs). Outputs are poisoned before each launch
and compared in full, so an element the kernel forgot to write fails the test.

GPU tests are marked `gpu` (skipped without CUDA); the limit checks that need no device run on CPU.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from kdlib import DATA, ref
from kdlib.cuda import pipeline

POISON_INT = -7777  # never a valid token, index, size or padding value
FIELDS = ("sizes", "node_token_ids", "node_depths", "parents", "visibility", "next_token", "next_sibling",
          "positions", "scores")

# (budget, L, K', vocab): the benchmark shape, small and edge budgets, K' > budget, K' = 1 (chain),
# L > 16 with budget <= 16, and the limits (budget 256, depth 16).
BUILD_CONFIGS = [
    (64, 15, 64, 200), (8, 4, 3, 10), (1, 3, 2, 5), (20, 16, 40, 60), (33, 5, 1, 7),
    (12, 30, 5, 20), (256, 16, 300, 400), (100, 2, 10, 12), (31, 6, 31, 40), (32, 6, 32, 40), (95, 9, 20, 30),
    (96, 9, 20, 30),
]
MODES = ("random", "tied", "denormal")


def _cp():
    return pytest.importorskip("cupy")


def _poisoned_batch(bsz, budget):
    from kdlib.cuda import tree

    out = tree.empty_batch(bsz, budget)
    for name in FIELDS:
        a = getattr(out, name)
        if a.dtype == np.bool_:
            a.view(np.uint8).fill(0x5A)  # neither False nor True as the kernel writes them
        elif a.dtype == np.float64:
            a.fill(np.inf)
        else:
            a.fill(POISON_INT)
    return out


def assert_trees_equal(got, want, what=""):
    for name in FIELDS:
        g = getattr(got, name)
        g = g.get() if hasattr(g, "get") else np.asarray(g)
        w = getattr(want, name)
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} {name}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        if name == "visibility":
            g = g.view(np.uint8)
            w = w.view(np.uint8)
        if name == "scores":  # bit-exact, NaN padding included
            g, w = g.view(np.int64), w.view(np.int64)
        bad = np.argwhere(g != w)
        assert bad.size == 0, f"{what} {name} differs at {bad[:5].tolist()}: got {g[tuple(bad[0])]}, want {w[tuple(bad[0])]}"


# ----------------------------------------------------------------------------- CPU: limits


def test_build_limits_raise_before_any_work():
    from kdlib.cuda import tree

    with pytest.raises(ValueError, match="budget"):
        tree.build_tree_batch(None, None, tree.MAX_BUDGET + 1)
    with pytest.raises(ValueError, match="budget"):
        tree.build_tree_batch(None, None, -1)
    for version in (1, 2):  # the documented worst case needs no opt-in (v3 opts in)
        assert tree.shared_bytes(256, 16, 256, version) <= 48 * 1024
    assert tree.shared_bytes(256, 16, 256, 3) <= 227 * 1024  # Hopper's per-block maximum
    assert tree.kernel_name(31, 2) == ("tree_build_v2", "tree_build_v2_r1")
    assert tree.kernel_name(32, 2) == ("tree_build_v2", "tree_build_v2_r3")
    assert tree.kernel_name(256, 2) == ("tree_build_v2", "tree_build_v2_r9")
    assert tree.kernel_name(1, 1) == ("tree_build_v1", "tree_build_v1")
    assert tree.kernel_name(64, 3) == ("tree_build_v3", "tree_build_v3_r3")
    with pytest.raises(ValueError, match="version"):
        tree.kernel_name(8, 5)


# ----------------------------------------------------------------------------- build


@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2, 3])
def test_build_worked_example(version):
    """Survey §2.7: L=3, N=5, K'=2."""
    cp = _cp()
    from kdlib.cuda import tree

    ids = np.array([[[10, 11], [20, 21], [30, 31]]], dtype=np.int64)
    lp = np.log(np.array([[[0.60, 0.30], [0.90, 0.05], [0.45, 0.40]]])).astype(np.float32)
    got = tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp), 5, out=_poisoned_batch(1, 5), version=version)
    assert got.node_token_ids.get().tolist() == [[10, 20, 11, 20, 30]]
    assert got.parents.get().tolist() == [[-1, 0, 1, 0, 3, 2]]
    assert got.next_token.get().tolist() == [[1, 2, 5, 4, -1, -1]]
    assert got.next_sibling.get().tolist() == [[-1, 3, -1, -1, -1, -1]]
    rows = ["".join("1" if v else "0" for v in r) for r in got.visibility.get()[0]]
    assert rows == ["100000", "110000", "111000", "100100", "100110", "111001"]
    assert_trees_equal(got, ref.build_tree_batch(ids, lp, 5), "worked example")


@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget,depth,kp,vocab", BUILD_CONFIGS)
def test_build_random_bit_exact(budget, depth, kp, vocab, mode, version):
    cp = _cp()
    from kdlib.cuda import tree

    rng = np.random.default_rng(zlib.crc32(repr((budget, depth, kp, vocab, mode)).encode()))
    bsz = 16 if budget == 256 else 64
    ids, lp = pipeline.random_topk(rng, bsz, depth, kp, vocab, mode)
    want = ref.build_tree_batch(ids, lp, budget)
    got = tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp), budget, out=_poisoned_batch(bsz, budget),
                                version=version)
    assert_trees_equal(got, want, f"v{version} budget={budget} L={depth} K'={kp} {mode}")


@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("budget,depth,kp", [(0, 5, 4), (5, 0, 4), (5, 3, 0), (0, 0, 0)])
def test_build_root_only(budget, depth, kp, version):
    cp = _cp()
    from kdlib.cuda import tree

    ids = np.arange(3 * depth * kp, dtype=np.int64).reshape(3, depth, kp)
    lp = np.zeros((3, depth, kp), dtype=np.float32)
    got = tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp), budget, out=_poisoned_batch(3, budget),
                                version=version)
    assert_trees_equal(got, ref.build_tree_batch(ids, lp, budget), f"v{version} root-only")


@pytest.mark.gpu
def test_build_limits_and_check_values():
    cp = _cp()
    from kdlib.cuda import tree

    ids, lp = pipeline.random_topk(np.random.default_rng(1), 2, 17, 4, 10)
    with pytest.raises(ValueError, match="depth"):
        tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp), 17)
    tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp), 16)  # L_eff = 16: allowed
    with pytest.raises(ValueError, match="int64"):
        tree.build_tree_batch(cp.asarray(ids.astype(np.int32)), cp.asarray(lp), 8)
    with pytest.raises(ValueError, match="float32"):
        tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp.astype(np.float64)), 8)
    with pytest.raises(ValueError, match="shape"):
        tree.build_tree_batch(cp.asarray(ids[0]), cp.asarray(lp[0]), 8)
    bad = lp.copy()
    bad[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="finite"):
        tree.build_tree_batch(cp.asarray(ids), cp.asarray(bad), 8, check_values=True)
    bad = lp.copy()
    bad[0, 0, :2] = [-2, -1]
    with pytest.raises(ValueError, match="sorted"):
        tree.build_tree_batch(cp.asarray(ids), cp.asarray(bad), 8, check_values=True)


@pytest.mark.gpu
def test_build_torch_dlpack_zero_copy():
    cp = _cp()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from kdlib.cuda import loader, tree

    ids, lp = pipeline.random_topk(np.random.default_rng(2), 8, 15, 64, 100)
    t_ids, t_lp = torch.from_numpy(ids).cuda(), torch.from_numpy(lp).cuda()
    assert loader.as_cupy(t_ids).data.ptr == t_ids.data_ptr()
    got = tree.build_tree_batch(t_ids, t_lp, 64)
    assert isinstance(got.sizes, cp.ndarray)
    assert_trees_equal(got, ref.build_tree_batch(ids, lp, 64), "torch")


@pytest.mark.gpu
def test_single_request_twins():
    """build_tree, accept_greedy, accept_sample, compact_kv (batches of one) against kdlib.ref."""
    cp = _cp()
    import kdlib.cuda as cu

    rng = np.random.default_rng(12)
    for mode in MODES:
        ids, lp = pipeline.random_topk(rng, 1, 7, 6, 20, mode)
        want = ref.build_tree(ids[0], lp[0], 30)
        got = cu.build_tree(cp.asarray(ids[0]), cp.asarray(lp[0]), 30)
        for f in ("node_token_ids", "parents", "visibility", "next_token", "next_sibling", "positions"):
            assert (getattr(got, f).get() == getattr(want, f)).all(), f
        assert (got.scores.get().view(np.int64) == want.scores.view(np.int64)).all()
        batch = ref.build_tree_batch(ids, lp, 30)
        tgt = _targets(rng, batch, 20)[0, : want.n + 1]
        p_want, b_want = ref.accept_greedy(want, tgt)
        p_got, b_got = cu.accept_greedy(got, cp.asarray(tgt))
        assert (p_got.get() == p_want).all() and b_got == b_want
        probs, u = _probs(rng, want.n + 1, 20, np.float32), _uniforms(rng, want.n + 1)
        p_want, b_want = ref.accept_sample(want, probs, u)
        p_got, b_got = cu.accept_sample(got, cp.asarray(probs), cp.asarray(u))
        assert (p_got.get() == p_want).all() and b_got == b_want
        cache = rng.standard_normal((50, 5)).astype(np.float32)
        c_want = ref.compact_kv(cache.copy(), 3, p_want)
        c_got = cu.compact_kv(cp.asarray(cache), 3, cp.asarray(p_want))
        assert (c_got.get() == c_want).all()


# ----------------------------------------------------------------------------- golden files


GOLDEN = sorted((DATA / "golden").glob("*.kdtr"))
GOLDEN_KINDS = ("tree", "accept_sample", "compact")


def _golden(path):
    import json

    from kdlib import kdtr

    meta = kdtr.read_metadata(path)
    return kdtr.load(path, mmap=False), meta, json.loads(meta.get("config", "{}"))


def _stored_trees(t, cp):
    return ref.DDTreeBatch(**{f: cp.asarray(t[f]) for f in FIELDS})


@pytest.mark.gpu
@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden(path):
    """Every golden file of kind tree / accept_sample / compact, against its stored outputs."""
    cp = _cp()
    from kdlib.cuda import accept, compact, tree

    t, meta, config = _golden(path)
    kind = meta.get("kind")
    if kind not in GOLDEN_KINDS:
        pytest.skip(f"kind {kind!r} belongs to another kernel")
    if "top_token_ids" in t:  # tree build (tree, accept_sample)
        budget = int(t["budget"])
        want = ref.DDTreeBatch(**{f: np.asarray(t[f]) for f in FIELDS})
        for version in tree.VERSIONS:
            got = tree.build_tree_batch(cp.asarray(t["top_token_ids"]), cp.asarray(t["top_log_probs"]), budget,
                                        out=_poisoned_batch(t["top_token_ids"].shape[0], budget), version=version)
            assert_trees_equal(got, want, f"{path.name} v{version}")
    max_depth = config.get("max_depth")
    if kind == "tree":
        got = accept.accept_greedy_batch(_stored_trees(t, cp), cp.asarray(t["target_tokens"]), max_depth=max_depth)
        for name, g in zip(("paths", "lengths", "bonus"), got, strict=True):
            assert (g.get() == t[name]).all(), f"{path.name}: {name}"
    elif kind == "accept_sample":
        got = accept.accept_sample_batch(_stored_trees(t, cp), cp.asarray(t["probs"]), cp.asarray(t["uniforms"]),
                                         max_depth=max_depth)
        for name, g in zip(("paths", "lengths", "bonus"), got, strict=True):
            assert (g.get() == t[name]).all(), f"{path.name}: {name}"
        tokens = accept.sample_tokens(cp.asarray(t["st_probs"]), cp.asarray(t["st_uniforms"]))
        assert (tokens.get() == t["st_tokens"]).all()
    else:
        cache = cp.asarray(t["cache"])
        compact.compact_kv_batch(cache, cp.asarray(t["starts"]), cp.asarray(t["paths"]), cp.asarray(t["lengths"]))
        assert (cache.get().view(np.uint8) == t["cache_out"].view(np.uint8)).all(), f"{path.name}: cache"
        r2t = cp.asarray(t["req_to_token"])
        freed = compact.remap_slots(r2t, cp.asarray(t["remap_starts"]), cp.asarray(t["tree_slots"]),
                                    cp.asarray(t["paths"]), cp.asarray(t["lengths"]))
        assert (r2t.get() == t["req_to_token_out"]).all(), f"{path.name}: req_to_token"
        assert freed.dtype == t["freed_slots"].dtype and (freed.get() == t["freed_slots"]).all(), f"{path.name}: freed"


def test_golden_files_present():
    kinds = set()
    for path in GOLDEN:
        from kdlib import kdtr

        kinds.add(kdtr.read_metadata(path).get("kind"))
    assert set(GOLDEN_KINDS) <= kinds, f"golden kinds found: {sorted(kinds)}"


# ----------------------------------------------------------------------------- accept


def _targets(rng, trees, vocab, p_follow=0.8):
    """Target tokens that follow a random child with probability p_follow (so long paths occur)."""
    bsz, s = trees.next_token.shape
    tgt = np.full((bsz, s), POISON_INT, dtype=np.int64)
    for b in range(bsz):
        n1 = int(trees.sizes[b])
        for i in range(n1):
            kids = []
            c = trees.next_token[b, i]
            while c != -1:
                kids.append(c)
                c = trees.next_sibling[b, c]
            if kids and rng.random() < p_follow:
                tgt[b, i] = trees.node_token_ids[b, kids[rng.integers(len(kids))] - 1]
            else:
                tgt[b, i] = rng.integers(0, vocab)
    return tgt


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget,depth,kp,vocab", BUILD_CONFIGS)
def test_accept_greedy_random_exact(budget, depth, kp, vocab, mode):
    cp = _cp()
    from kdlib.cuda import accept

    rng = np.random.default_rng(zlib.crc32(repr(("accept", budget, depth, kp, mode)).encode()))
    bsz = 16 if budget == 256 else 64
    ids, lp = pipeline.random_topk(rng, bsz, depth, kp, vocab, mode)
    trees = ref.build_tree_batch(ids, lp, budget)
    tgt = _targets(rng, trees, vocab)
    d_trees = ref.DDTreeBatch(**{f: cp.asarray(getattr(trees, f)) for f in FIELDS})
    for max_depth in (None, min(depth, budget)):
        want = ref.accept_greedy_batch(trees, tgt, max_depth=max_depth)
        width = want[0].shape[1]
        out = tuple(cp.full(shape, POISON_INT, dtype=cp.int64) for shape in ((bsz, width), (bsz,), (bsz,)))
        got = accept.accept_greedy_batch(d_trees, cp.asarray(tgt), max_depth=max_depth, out=out)
        for name, g, w in zip(("paths", "lengths", "bonus"), got, want, strict=True):
            assert (g.get() == w).all(), f"{name}: got {g.get()[:3]}, want {w[:3]}"


def _probs(rng, n, v, dtype):
    p = rng.random((n, v)) ** 3  # skewed, unnormalised
    p[rng.random((n, v)) < 0.3] = 0.0  # zero-probability tokens are never drawn
    p[:, 0] = np.where(rng.random(n) < 0.2, 1e-40, p[:, 0])  # subnormal in float32
    p[np.arange(n), rng.integers(0, v, n)] += 0.5  # every row has a positive sum
    return p.astype(dtype)


def _uniforms(rng, n):
    u = rng.random(n)
    u[::17] = 0.0
    u[1::17] = np.nextafter(1.0, 0.0)  # the largest double below 1: u * total may round to total
    return u


@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("v", [1, 7, 32, 33, 1000, 4099])
def test_sample_tokens_bit_exact(dtype, v, version):
    cp = _cp()
    from kdlib.cuda import accept

    rng = np.random.default_rng(v)
    n = 1024
    probs, u = _probs(rng, n, v, dtype), _uniforms(rng, n)
    out = cp.full(n, POISON_INT, dtype=cp.int64)
    got = accept.sample_tokens(cp.asarray(probs), cp.asarray(u), out=out, version=version).get()
    want = ref.sample_tokens(probs, u)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"rows {bad[:5].tolist()}: got {got[bad[:5]]}, want {want[bad[:5]]}"


@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accept_sample_batch_exact(dtype, version):
    cp = _cp()
    from kdlib.cuda import accept

    rng = np.random.default_rng(5)
    bsz, depth, kp, vocab, budget = 64, 6, 8, 16, 24
    ids, lp = pipeline.random_topk(rng, bsz, depth, kp, vocab)
    trees = ref.build_tree_batch(ids, lp, budget)
    probs = _probs(rng, bsz * (budget + 1), vocab, dtype).reshape(bsz, budget + 1, vocab)
    # concentrate each node's mass on one child's token so that walks go deep
    tgt = _targets(rng, trees, vocab, p_follow=0.9)
    rows, cols = np.nonzero(tgt >= 0)
    probs[rows, cols, tgt[rows, cols]] += 20.0
    u = _uniforms(rng, bsz * (budget + 1)).reshape(bsz, budget + 1)
    unused = np.arange(budget + 1)[None, :] >= trees.sizes[:, None]
    probs[unused] = np.nan  # never read
    want = ref.accept_sample_batch(trees, probs, u)
    d_trees = ref.DDTreeBatch(**{f: cp.asarray(getattr(trees, f)) for f in FIELDS})
    got = accept.accept_sample_batch(d_trees, cp.asarray(probs), cp.asarray(u), version=version)
    for g, w in zip(got, want, strict=True):
        assert (g.get() == w).all()
    assert want[1].max() > 2  # the test exercised real walks


# ----------------------------------------------------------------------------- compaction, remap


def _random_paths(rng, bsz, width, maxlen):
    lengths = rng.integers(0, maxlen + 1, bsz)
    paths = np.full((bsz, maxlen), POISON_INT, dtype=np.int64)
    for b in range(bsz):
        m = int(lengths[b])
        if m:
            rest = np.sort(rng.choice(np.arange(1, width), m - 1, replace=False)) if m > 1 else np.zeros(0, np.int64)
            paths[b, :m] = np.concatenate([[0], rest])
    return paths, lengths.astype(np.int64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,row_shape", [(np.float32, (576,)), (np.uint16, (576,)), (np.int8, (7,)),
                                             (np.float32, (3,)), (np.float64, (2, 5))])
def test_compact_kv_batch_exact(dtype, row_shape):
    cp = _cp()
    from kdlib.cuda import compact

    rng = np.random.default_rng(len(row_shape) * 100 + row_shape[-1])
    bsz, width, maxlen = 256, 65, 17
    starts = (np.arange(bsz) * width + rng.integers(0, 3, bsz).cumsum()).astype(np.int64)
    paths, lengths = _random_paths(rng, bsz, width, maxlen)
    cache = np.abs(rng.standard_normal((int(starts[-1]) + width + 2, *row_shape)) * 100).astype(dtype)
    want = cache.copy()
    ref.compact_kv_batch(want, starts, paths, lengths)
    got = cp.asarray(cache)
    back = compact.compact_kv_batch(got, cp.asarray(starts), cp.asarray(paths), cp.asarray(lengths))
    assert back is got
    assert (got.get().view(np.uint8) == want.view(np.uint8)).all()


@pytest.mark.gpu
def test_remap_slots_exact():
    cp = _cp()
    from kdlib.cuda import compact

    rng = np.random.default_rng(9)
    bsz, width, maxlen, max_ctx = 1024, 65, 17, 200
    starts = rng.integers(0, max_ctx - maxlen, bsz).astype(np.int64)
    slots = rng.permutation(bsz * width * 2)[: bsz * width].reshape(bsz, width).astype(np.int64)
    slots[rng.random((bsz, width)) < 0.1] = -1  # unallocated (padding) nodes
    paths, lengths = _random_paths(rng, bsz, width, maxlen)
    for b in range(bsz):  # accepted nodes always have a slot
        slots[b, paths[b, : lengths[b]]] = np.abs(slots[b, paths[b, : lengths[b]]]) + bsz * width * 2
    r2t = rng.integers(0, 10**6, (bsz, max_ctx)).astype(np.int64)
    want_r2t = r2t.copy()
    want_freed = ref.remap_slots(want_r2t, starts, slots, paths, lengths)
    got_r2t = cp.asarray(r2t)
    got_freed = compact.remap_slots(got_r2t, cp.asarray(starts), cp.asarray(slots), cp.asarray(paths), cp.asarray(lengths))
    assert (got_r2t.get() == want_r2t).all()
    assert got_freed.dtype == want_freed.dtype and (got_freed.get() == want_freed).all()


# ----------------------------------------------------------------------------- the graph-captured step


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_step_graph_equals_reference(mode):
    cp = _cp()
    rng = np.random.default_rng(11)
    bsz, depth, kp, vocab, budget = 64, 15, 64, 300, 64
    inp = pipeline.random_step_inputs(rng, bsz, depth, kp, vocab, budget, mode=mode)
    step = pipeline.make_step(cp.asarray(inp["top_token_ids"]), cp.asarray(inp["top_log_probs"]),
                              cp.asarray(inp["root_tokens"]), cp.asarray(inp["target_table"]),
                              cp.asarray(inp["cache"]), cp.asarray(inp["starts"]), budget)
    step.capture()
    for it in range(4):  # fresh inputs each replay, written into the captured buffers
        inp = pipeline.random_step_inputs(rng, bsz, depth, kp, vocab, budget, mode=mode)
        for name, key in (("ids", "top_token_ids"), ("lp", "top_log_probs"), ("root", "root_tokens"),
                          ("table", "target_table"), ("cache", "cache"), ("starts", "starts")):
            getattr(step, name)[...] = cp.asarray(inp[key])
        for name in FIELDS:  # poison
            a = getattr(step.trees, name)
            a.view(np.uint8).fill(0x5A)
        for a in (step.paths, step.lengths, step.bonus):
            a.fill(POISON_INT)
        step.replay()
        step.stream.synchronize()
        got = pipeline.step_outputs(step)
        want = pipeline.reference_step(**inp)
        assert_trees_equal(got["trees"], want["trees"], f"replay {it}")
        for key in ("targets", "paths", "lengths", "bonus", "cache"):
            assert (got[key] == want[key]).all(), f"replay {it}: {key}"
    assert want["lengths"].max() > 1
