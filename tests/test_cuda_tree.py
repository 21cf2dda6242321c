"""The tree kernels (build, accept, sample, compact, remap, the graph-captured step) against
`kdlib.ref`, bit for bit, on the survey's worked example, every golden file, and >= 1,000 random
cases per kernel (random, tied and subnormal log-probs). Outputs are poisoned before each launch
and compared in full, so an element the kernel forgot to write fails the test.

GPU tests are marked `gpu` (skipped without CUDA); the limit checks that need no device run on CPU.
tree_build_v4 is also checked without a device: a Python model of its warp algorithm, and the
kernel source itself compiled for the host (g++, one user-level thread per CUDA thread, warp
intrinsics in lock step), both against the reference on >= 1,000 random, tied, subnormal and
frontier-filling cases.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import kdlib.cuda as cu
from kdlib import DATA, KERNELS, kdtr, ref
from kdlib.cuda import accept, compact, loader, pipeline, tree
from kdlib.cuda.tree import VERSIONS
from kdlib.perf.suites import accept as suite
from kdlib.ref import accept as ref_accept
from kdlib.ref import tree as ref_tree
from kdlib.ref.tree import BATCH_FIELDS

POISON_INT = -7777  # never a valid token, index, size or padding value
FIELDS = BATCH_FIELDS

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
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{what} {name}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        )
        if name == "visibility":
            g = g.view(np.uint8)
            w = w.view(np.uint8)
        if name == "scores":  # bit-exact, NaN padding included
            g, w = g.view(np.int64), w.view(np.int64)
        bad = np.argwhere(g != w)
        assert bad.size == 0, (
            f"{what} {name} differs at {bad[:5].tolist()}: got {g[tuple(bad[0])]}, want {w[tuple(bad[0])]}"
        )


# ----------------------------------------------------------------------------- CPU: limits


def test_build_limits_raise_before_any_work():
    with pytest.raises(ValueError, match="budget"):
        tree.build_tree_batch(None, None, tree.MAX_BUDGET + 1)
    with pytest.raises(ValueError, match="budget"):
        tree.build_tree_batch(None, None, -1)
    for version in (1, 2):  # the documented worst case needs no opt-in (v3 opts in)
        assert tree.shared_bytes(256, 16, 256, version) <= 48 * 1024
    assert tree.shared_bytes(256, 16, 256, 3) <= 227 * 1024  # Hopper's per-block maximum
    assert tree.kernel_name(31, 2) == ("tree_build/v2", "tree_build_v2_r1")
    assert tree.kernel_name(32, 2) == ("tree_build/v2", "tree_build_v2_r3")
    assert tree.kernel_name(256, 2) == ("tree_build/v2", "tree_build_v2_r9")
    assert tree.kernel_name(1, 1) == ("tree_build/v1", "tree_build_v1")
    assert tree.kernel_name(64, 3) == ("tree_build/v3", "tree_build_v3_r3")
    assert [tree.kernel_name(b, 4)[1][-2:] for b in (0, 64, 65, 128, 129, 256)] == [
        "r1",
        "r1",
        "r2",
        "r2",
        "r4",
        "r4",
    ]
    assert tree.shared_bytes(256, 16, 256, 4) <= 227 * 1024
    with pytest.raises(ValueError, match="version"):
        tree.kernel_name(8, 5)
    with pytest.raises(ValueError, match="version"):
        tree.launch(8, True)
    # version None is DEFAULT_VERSION everywhere
    assert tree.launch(64) == tree.launch(64, tree.DEFAULT_VERSION) == tree.launch(64, None)
    assert tree.launch(64).version == tree.DEFAULT_VERSION
    assert tree.kernel_name(200) == tree.kernel_name(200, tree.DEFAULT_VERSION)
    assert tree.shared_bytes(64, 15, 64) == tree.shared_bytes(64, 15, 64, tree.DEFAULT_VERSION)


def test_step_and_draw_limits_need_no_device():
    """make_step checks the budget before it takes any device memory (and before CuPy is needed);
    sample_kernel names an unsupported probs dtype instead of a KeyError."""
    for budget, match in ((tree.MAX_BUDGET + 1, "exceeds the GPU builder's limit 256"), (-1, ">= 0"),
                          (True, "must be an int"), (8.0, "must be an int")):
        with pytest.raises(ValueError, match=match):
            pipeline.make_step(None, None, None, None, None, None, budget)
    with pytest.raises(ValueError, match="probs must be float32 or float64, got float16"):
        accept.sample_kernel(np.float16)


@pytest.mark.parametrize("version", [None, *VERSIONS])
def test_launch_helpers_refuse_budgets_past_the_limit(version):
    """launch, kernel_name and shared_bytes check the budget as build_tree_batch does: past 256 there is
    no kernel row to name (v2/v3 budgets 257..287 would name r9, which cannot hold them; v4 found none)."""
    for budget, match in ((tree.MAX_BUDGET + 1, "exceeds the GPU builder's limit 256"),
                          (287, "exceeds the GPU builder's limit 256"), (300, "exceeds"),
                          (-1, "budget must be >= 0"), (64.0, "budget must be an int")):
        for call, args in ((tree.launch, (budget, version)), (tree.kernel_name, (budget, version)),
                           (tree.shared_bytes, (budget, 16, 256, version))):
            with pytest.raises(ValueError, match=match):
                call(*args)
    assert tree.launch(tree.MAX_BUDGET, version).version == (version or tree.DEFAULT_VERSION)


def test_compaction_grid_refuses_a_batch_past_grid_y():
    """The compaction's grid puts the requests on gridDim.y (at most 65535): a larger batch is refused by
    name before the launch rather than failing in the driver (no device)."""
    assert compact._compact_grid(72, 65535) == (1, 65535)
    assert compact._compact_grid(compact.THREADS + 1, 3) == (2, 3)
    with pytest.raises(ValueError, match="starts: 65536 requests exceed the compaction's grid limit 65535"):
        compact._compact_grid(72, 65536)


# ----------------------------------------------------------------------------- build


@pytest.mark.gpu
@pytest.mark.parametrize("version", VERSIONS)
def test_build_worked_example(version):
    """Survey §2.7: L=3, N=5, K'=2."""
    cp = _cp()

    ids = np.array([[[10, 11], [20, 21], [30, 31]]], dtype=np.int64)
    lp = np.log(np.array([[[0.60, 0.30], [0.90, 0.05], [0.45, 0.40]]])).astype(np.float32)
    got = tree.build_tree_batch(
        cp.asarray(ids), cp.asarray(lp), 5, out=_poisoned_batch(1, 5), version=version
    )
    assert got.node_token_ids.get().tolist() == [[10, 20, 11, 20, 30]]
    assert got.parents.get().tolist() == [[-1, 0, 1, 0, 3, 2]]
    assert got.next_token.get().tolist() == [[1, 2, 5, 4, -1, -1]]
    assert got.next_sibling.get().tolist() == [[-1, 3, -1, -1, -1, -1]]
    rows = ["".join("1" if v else "0" for v in r) for r in got.visibility.get()[0]]
    assert rows == ["100000", "110000", "111000", "100100", "100110", "111001"]
    assert_trees_equal(got, ref.build_tree_batch(ids, lp, 5), "worked example")


@pytest.mark.gpu
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget,depth,kp,vocab", BUILD_CONFIGS)
def test_build_random_bit_exact(budget, depth, kp, vocab, mode, version):
    cp = _cp()

    rng = np.random.default_rng(zlib.crc32(repr((budget, depth, kp, vocab, mode)).encode()))
    bsz = 16 if budget == 256 else 64
    ids, lp = pipeline.random_topk(rng, bsz, depth, kp, vocab, mode)
    want = ref.build_tree_batch(ids, lp, budget)
    got = tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp), budget, out=_poisoned_batch(bsz, budget),
                                version=version)
    assert_trees_equal(got, want, f"v{version} budget={budget} L={depth} K'={kp} {mode}")


def frontier_filling_topk(rng, bsz: int, budget: int, kp: int):
    """Inputs whose frontier reaches floor((budget + 1) / 2) live candidates and whose last pop is the
    worst of them (L = 2, K' = kp >= budget): the budget // 2 best depth-1 ranks come first, each
    leaving its first child behind; those children are popped last, in score order, and every other
    candidate scores far below. Shape: ids, lp [bsz, 2, kp]."""
    h = budget // 2
    ids = np.stack([np.stack([rng.permutation(kp) for _ in range(2)]) for _ in range(bsz)]).astype(np.int64)
    lp = np.empty((bsz, 2, kp), np.float32)
    for b in range(bsz):
        lp[b, 0] = np.concatenate([-np.sort(rng.random(h)) * 1e-3, -100 - np.sort(rng.random(kp - h))])
        lp[b, 1] = np.concatenate([[-1.0], -50 - np.sort(rng.random(kp - 1))])
    return ids, lp


FILLING_BUDGETS = (31, 32, 63, 64, 65, 127, 128, 129, 255, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("budget", FILLING_BUDGETS)
def test_build_frontier_filling_bit_exact(budget, version):
    """The largest frontier a budget allows, its worst candidate popped last (v4 keeps only that many)."""
    cp = _cp()

    ids, lp = frontier_filling_topk(np.random.default_rng(budget), 8, budget, budget + 3)
    want = ref.build_tree_batch(ids, lp, budget)
    got = tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp), budget, out=_poisoned_batch(8, budget),
                                version=version)
    assert_trees_equal(got, want, f"v{version} filling budget={budget}")


@pytest.mark.gpu
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("budget,depth,kp", [(0, 5, 4), (5, 0, 4), (5, 3, 0), (0, 0, 0)])
def test_build_root_only(budget, depth, kp, version):
    cp = _cp()

    ids = np.arange(3 * depth * kp, dtype=np.int64).reshape(3, depth, kp)
    lp = np.zeros((3, depth, kp), dtype=np.float32)
    got = tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp), budget, out=_poisoned_batch(3, budget),
                                version=version)
    assert_trees_equal(got, ref.build_tree_batch(ids, lp, budget), f"v{version} root-only")


@pytest.mark.gpu
def test_build_limits_and_check_values():
    cp = _cp()

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
    with pytest.raises(ValueError, match="log-probabilities"):
        tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp + np.float32(3)), 8, check_values=True)


@pytest.mark.gpu
def test_torch_output_buffers_are_written_in_place():
    """Torch CUDA tensors as out / targets buffers (the wrappers take torch CUDA tensors): accepted, and
    the kernels write the caller's memory."""
    cp = _cp()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = np.random.default_rng(3)
    bsz, budget, vocab = 4, 12, 50
    ids, lp = pipeline.random_topk(rng, bsz, 5, 4, vocab)
    want = ref.build_tree_batch(ids, lp, budget)
    empty = tree.empty_batch(bsz, budget)
    dtypes = {np.dtype(np.int64): torch.int64, np.dtype(np.float64): torch.float64,
              np.dtype(np.bool_): torch.bool}
    out = ref.DDTreeBatch(**{f: torch.empty(getattr(empty, f).shape, dtype=dtypes[getattr(empty, f).dtype],
                                            device="cuda") for f in FIELDS})
    tree.build_tree_batch(cp.asarray(ids), cp.asarray(lp), budget, out=out)
    got = ref.DDTreeBatch(**{f: getattr(out, f).cpu().numpy() for f in FIELDS})
    assert_trees_equal(got, want, "torch out")
    tgt = _targets(rng, want, vocab)
    w_paths, w_lengths, w_bonus = ref.accept_greedy_batch(want, tgt)
    bufs = tuple(torch.full(shape, -9, dtype=torch.int64, device="cuda")
                 for shape in (w_paths.shape, w_lengths.shape, w_bonus.shape))
    d_trees = ref.DDTreeBatch(**{f: cp.asarray(getattr(want, f)) for f in FIELDS})
    accept.accept_greedy_batch(d_trees, cp.asarray(tgt), out=bufs)
    for got, w in zip(bufs, (w_paths, w_lengths, w_bonus), strict=True):
        assert (got.cpu().numpy() == w).all()
    probs, u = _probs(rng, 64, vocab, np.float32), _uniforms(rng, 64)
    tokens = torch.full((64,), -9, dtype=torch.int64, device="cuda")
    accept.sample_tokens(cp.asarray(probs), cp.asarray(u), out=tokens)
    assert (tokens.cpu().numpy() == ref.sample_tokens(probs, u)).all()


@pytest.mark.gpu
def test_build_torch_dlpack_zero_copy():
    cp = _cp()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")

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


@pytest.mark.gpu
def test_single_request_twins_checks():
    """build_tree past the tree's capacity builds the whole tree, as the reference does (the limit 256 holds
    for what is built); accept_sample checks the uniforms' shape and, on request, their values; make_step
    refuses non-integer ids, integer log-probs and a depth past the builder's."""
    cp = _cp()

    rng = np.random.default_rng(13)
    ids, lp = pipeline.random_topk(rng, 1, 3, 4, 20)  # capacity 4 + 16 + 64 = 84
    for budget in (84, 85, 10**6):
        want = ref.build_tree(ids[0], lp[0], budget)
        got = cu.build_tree(cp.asarray(ids[0]), cp.asarray(lp[0]), budget)
        assert got.n == want.n == 84
        for f in ("node_token_ids", "parents", "visibility", "next_token", "next_sibling", "positions"):
            assert (getattr(got, f).get() == getattr(want, f)).all(), f
    wide, wide_lp = pipeline.random_topk(rng, 1, 3, 8, 20)  # capacity 584
    with pytest.raises(ValueError, match="exceeds the GPU builder's limit 256"):
        cu.build_tree(cp.asarray(wide[0]), cp.asarray(wide_lp[0]), 300)
    with pytest.raises(ValueError, match="budget must be an int >= 0"):
        cu.build_tree(cp.asarray(ids[0]), cp.asarray(lp[0]), -1)

    t = cu.build_tree(cp.asarray(ids[0]), cp.asarray(lp[0]), 10)
    probs = cp.asarray(_probs(rng, 11, 20, np.float32))
    with pytest.raises(ValueError, match=r"uniforms must have shape \(11,\)"):
        cu.accept_sample(t, probs, cp.asarray(_uniforms(rng, 11)[:, None]))
    u = _uniforms(rng, 11)
    u[0] = 1.0
    cu.accept_sample(t, probs, cp.asarray(u))  # unchecked: runs
    with pytest.raises(ValueError, match=r"uniforms must lie in \[0, 1\)"):
        cu.accept_sample(t, probs, cp.asarray(u), check_values=True)

    inp = pipeline.random_step_inputs(rng, 2, 6, 4, 20, 8)
    args = [cp.asarray(inp[k]) for k in ("top_token_ids", "top_log_probs", "root_tokens", "target_table",
                                         "cache", "starts")]
    pipeline.make_step(*args, 8)
    for i, bad, match in ((0, args[0].astype(cp.float64), "top_token_ids must be an integer array"),
                          (1, args[1].astype(cp.int64), "top_log_probs must be a floating array"),
                          (3, args[3].astype(cp.float32), "target_table must be an integer array")):
        with pytest.raises(ValueError, match=match):
            pipeline.make_step(*args[:i], bad, *args[i + 1:], 8)
    deep_ids, deep_lp = pipeline.random_topk(rng, 2, 17, 4, 20)
    with pytest.raises(ValueError, match="depth limit 16"):
        pipeline.make_step(cp.asarray(deep_ids), cp.asarray(deep_lp), *args[2:], 17)


# ----------------------------------------------------------------------------- golden files


GOLDEN = sorted((DATA / "golden").glob("*.kdtr"))
GOLDEN_KINDS = ("tree", "accept_sample", "compact")


def _golden(path):
    import json

    meta = kdtr.read_metadata(path)
    return kdtr.load(path, mmap=False), meta, json.loads(meta.get("config", "{}"))


def _stored_trees(t, cp):
    return ref.DDTreeBatch(**{f: cp.asarray(t[f]) for f in FIELDS})


@pytest.mark.gpu
@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden(path):
    """Every golden file of kind tree / accept_sample / compact, against its stored outputs."""
    cp = _cp()

    t, meta, config = _golden(path)
    kind = meta.get("kind")
    if kind not in GOLDEN_KINDS:
        pytest.skip(f"kind {kind!r} belongs to another kernel")
    if "top_token_ids" in t:  # tree build (tree, accept_sample)
        budget = int(t["budget"])
        want = ref.DDTreeBatch(**{f: np.asarray(t[f]) for f in FIELDS})
        for version in tree.VERSIONS:
            got = tree.build_tree_batch(
                cp.asarray(t["top_token_ids"]),
                cp.asarray(t["top_log_probs"]),
                budget,
                out=_poisoned_batch(t["top_token_ids"].shape[0], budget),
                version=version,
            )
            assert_trees_equal(got, want, f"{path.name} v{version}")
    max_depth = config.get("max_depth")
    if kind == "tree":
        got = accept.accept_greedy_batch(
            _stored_trees(t, cp), cp.asarray(t["target_tokens"]), max_depth=max_depth
        )
        for name, g in zip(("paths", "lengths", "bonus"), got, strict=True):
            assert (g.get() == t[name]).all(), f"{path.name}: {name}"
    elif kind == "accept_sample":
        got = accept.accept_sample_batch(
            _stored_trees(t, cp), cp.asarray(t["probs"]), cp.asarray(t["uniforms"]), max_depth=max_depth
        )
        for name, g in zip(("paths", "lengths", "bonus"), got, strict=True):
            assert (g.get() == t[name]).all(), f"{path.name}: {name}"
        tokens = accept.sample_tokens(cp.asarray(t["st_probs"]), cp.asarray(t["st_uniforms"]))
        assert (tokens.get() == t["st_tokens"]).all()
    else:
        cache = cp.asarray(t["cache"])
        compact.compact_kv_batch(
            cache, cp.asarray(t["starts"]), cp.asarray(t["paths"]), cp.asarray(t["lengths"])
        )
        assert (cache.get().view(np.uint8) == t["cache_out"].view(np.uint8)).all(), f"{path.name}: cache"
        r2t = cp.asarray(t["req_to_token"])
        freed = compact.remap_slots(r2t, cp.asarray(t["remap_starts"]), cp.asarray(t["tree_slots"]),
                                    cp.asarray(t["paths"]), cp.asarray(t["lengths"]))
        assert (r2t.get() == t["req_to_token_out"]).all(), f"{path.name}: req_to_token"
        assert freed.dtype == t["freed_slots"].dtype and (freed.get() == t["freed_slots"]).all(), (
            f"{path.name}: freed"
        )


def test_golden_files_present():
    kinds = set()
    for path in GOLDEN:
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


@pytest.mark.gpu
def test_accept_greedy_refuses_a_tree_past_the_shared_memory():
    cp = _cp()

    # The greedy walk holds 40 B a node in shared memory: a budget of 8,192 asks for 320 KB,
    # past any GPU's opt-in limit a block. Refused by name, not a CUDA error at the launch.
    budget = 8192
    assert 40 * (budget + 1) > loader.device_limits()["smem_block"]
    trees = tree.empty_batch(1, budget)
    trees.sizes.fill(1)
    with pytest.raises(ValueError, match="tree_accept_greedy_v1 needs 327,720 B of dynamic shared memory"):
        accept.accept_greedy_batch(trees, cp.zeros((1, budget + 1), dtype=cp.int64))


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


SAMPLE_VERSIONS = (1, 2, 3)  # kdlib.cuda.accept.SAMPLE_VERSIONS, spelled out: importing it needs no device


def test_sample_v3_constants_come_from_the_reference():
    """v3's thread and piece counts reach the compiler from kdlib.ref.accept; the defaults in the source
    (offline compiles only) are the same numbers, so the ptxas and NVRTC checks compile what runs."""
    import re

    assert accept.SAMPLE_VERSIONS == SAMPLE_VERSIONS and accept.SAMPLE_DEFAULT == 3
    assert accept.SAMPLE_ORDER[accept.SAMPLE_DEFAULT] == "blocked" == ref_accept.SAMPLE_ORDERS[0]
    assert accept.sample_options(3) == (f"-DTA3_THREADS={ref_accept.SAMPLE_THREADS}",
                                        f"-DTA3_PIECE={ref_accept.SAMPLE_PIECE}")
    assert accept.sample_options(2) == ()
    assert accept.sample_kernel(np.float32) == ("tree_accept/sample_v3", "tree_sample_rows_v3_f32")
    src = (KERNELS / "tree_accept" / "sample_v3.cu").read_text()
    defaults = dict(re.findall(r"#define (TA3_THREADS|TA3_PIECE) (\d+)", src))
    assert defaults == {
        "TA3_THREADS": str(ref_accept.SAMPLE_THREADS),
        "TA3_PIECE": str(ref_accept.SAMPLE_PIECE),
    }
    with pytest.raises(ValueError, match="version"):
        accept.sample_kernel(np.float32, 4)


def test_order_picks_the_draw_version():
    """The reference's order= on the CUDA twins: each order runs a version of that order, a version
    of the other order is refused, no order leaves the version alone."""
    assert accept.version_for_order(None, None) is None and accept.version_for_order(None, 1) == 1
    for order in ref_accept.SAMPLE_ORDERS:
        assert accept.SAMPLE_ORDER[accept.version_for_order(order)] == order
        for version in SAMPLE_VERSIONS:
            if accept.SAMPLE_ORDER[version] == order:
                assert accept.version_for_order(order, version) == version
            else:
                with pytest.raises(ValueError, match="order"):
                    accept.version_for_order(order, version)
    with pytest.raises(ValueError, match="order must be one of"):
        accept.version_for_order("random")


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["blocked", "sequential"])
def test_ops_order_on_the_gpu(order):
    """kdlib.ops advertises the reference's signature: order= on CuPy arrays draws in that order."""
    cp = _cp()
    from kdlib import ops

    rng = np.random.default_rng(11)
    probs, u = _probs(rng, 256, 1000, np.float32), _uniforms(rng, 256)
    want = ref.sample_tokens(probs, u, order=order)
    assert (ops.sample_tokens(cp.asarray(probs), cp.asarray(u), order=order).get() == want).all()
    ids, lp = pipeline.random_topk(rng, 1, 4, 4, 1000)
    tree = ref.build_tree(ids[0], lp[0], 12)
    p1, u1 = _probs(rng, tree.n + 1, 1000, np.float32), _uniforms(rng, tree.n + 1)
    path, bonus = ref.accept_sample(tree, p1, u1, order=order)
    d_tree = ops.build_tree(cp.asarray(ids[0]), cp.asarray(lp[0]), 12)
    got_path, got_bonus = ops.accept_sample(d_tree, cp.asarray(p1), cp.asarray(u1), order=order)
    assert (got_path.get() == path).all() and got_bonus == bonus


@pytest.mark.gpu
@pytest.mark.parametrize("version", SAMPLE_VERSIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("v", [1, 7, 32, 33, 1000, 2048, 2049, 4099, 6147])
def test_sample_tokens_bit_exact(dtype, v, version):
    cp = _cp()

    rng = np.random.default_rng(v)
    n = 1024
    probs, u = _probs(rng, n, v, dtype), _uniforms(rng, n)
    out = cp.full(n, POISON_INT, dtype=cp.int64)
    got = accept.sample_tokens(cp.asarray(probs), cp.asarray(u), out=out, version=version).get()
    want = ref.sample_tokens(probs, u, order=accept.SAMPLE_ORDER[version])
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"rows {bad[:5].tolist()}: got {got[bad[:5]]}, want {want[bad[:5]]}"


@pytest.mark.gpu
@pytest.mark.parametrize("version", SAMPLE_VERSIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accept_sample_batch_exact(dtype, version):
    cp = _cp()

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
    want = ref.accept_sample_batch(trees, probs, u, order=accept.SAMPLE_ORDER[version])
    d_trees = ref.DDTreeBatch(**{f: cp.asarray(getattr(trees, f)) for f in FIELDS})
    got = accept.accept_sample_batch(d_trees, cp.asarray(probs), cp.asarray(u), version=version)
    for g, w in zip(got, want, strict=True):
        assert (g.get() == w).all()
    assert want[1].max() > 2  # the test exercised real walks


def _hard_rows(rng, n, v, dtype):
    """[n, v] rows that stress an inverse CDF: softmax-like peaks, tile-long runs of zeros, a single
    nonzero, subnormal-only mass, exact integer masses; and uniforms [n] with 0, the largest double
    below 1 and u = m / 1024 on the integer rows (x lands exactly on a CDF step, thread boundaries
    included)."""
    probs = np.zeros((n, v), dtype=np.float64)  # [n, v]
    u = rng.random(n)  # [n]
    # subnormal in the row's dtype (float64: sums of them too)
    tiny = 1e-40 if dtype == np.float32 else 5e-324
    for r in range(n):
        kind = r % 6
        if kind == 0:  # a tempered softmax over random logits
            z = rng.standard_normal(v) * rng.choice([1.0, 4.0, 12.0])
            probs[r] = np.exp(z - z.max())
        elif kind == 1:  # skewed, zeros, a zero run as long as several tiles
            probs[r] = rng.random(v) ** 4 * (rng.random(v) < 0.5)
            a = int(rng.integers(0, v))
            probs[r, a:a + int(rng.integers(1, 3 * 2048))] = 0.0
            probs[r, int(rng.integers(0, v))] += 1e-3
        elif kind == 2:  # a single nonzero
            probs[r, int(rng.integers(0, v))] = rng.choice([tiny, 1.0])
        elif kind == 3:  # subnormal mass only
            probs[r, rng.random(v) < 0.01] = tiny
            probs[r, int(rng.integers(0, v))] = tiny
        else:  # 1024 ones: exact sums, u = m / 1024 exact
            probs[r, rng.choice(v, 1024, replace=False)] = 1.0
            u[r] = int(rng.integers(0, 1024)) / 1024.0
    u[::7] = 0.0
    u[3::7] = np.nextafter(1.0, 0.0)
    return probs.astype(dtype), u


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("v,rows", [(4096, 1536), (32000, 768), (163840, 192)])
def test_sample_v3_bit_exact_at_model_vocabularies(v, rows, dtype):
    """v3 against the blocked reference over many rows at V = 4096, 32,000 and 163,840 (Kimi-K2);
    also with the rows misaligned for vector loads (an odd element offset) and at V + 1 (no float4)."""
    cp = _cp()

    rng = np.random.default_rng(v + (dtype == np.float64))
    probs, u = _hard_rows(rng, rows, v, dtype)
    want = ref.sample_tokens(probs, u)
    d_u = cp.asarray(u)
    out = cp.full(rows, POISON_INT, dtype=cp.int64)
    got = accept.sample_tokens(cp.asarray(probs), d_u, out=out).get()
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (
        f"rows {bad[:5].tolist()} (kinds {(bad[:5] % 6).tolist()}): got {got[bad[:5]]}, want {want[bad[:5]]}"
    )
    flat = cp.zeros(rows * v + 1, dtype=dtype)
    flat[1:] = cp.asarray(probs).reshape(-1)
    shifted = flat[1:].reshape(rows, v)  # C-contiguous, 4 or 8 bytes off a 16-byte boundary
    assert shifted.data.ptr % 16 != 0
    assert (accept.sample_tokens(shifted, d_u).get() == want).all()
    wider = np.concatenate([probs, np.zeros((rows, 1), dtype=dtype)], axis=1)  # [rows, V + 1]
    wider[::5, -1] = 0.25  # some rows with mass in that last, lone column
    assert (accept.sample_tokens(cp.asarray(wider), d_u).get() == ref.sample_tokens(wider, u)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("v", [4096, 32000])
def test_sample_v3_has_v2s_distribution(v):
    """Stratified uniforms u_i = (i + 1/2) / M over M copies of one row: an inverse CDF in any order
    draws token k within one of M p_k / sum(p) times, so v3 and v2 agree on the distribution to 2 / M."""
    cp = _cp()

    rng = np.random.default_rng(v)
    m = 8192 if v == 4096 else 2048
    z = rng.standard_normal(v) * 3
    p = np.exp(z - z.max()).astype(np.float32)
    p[rng.random(v) < 0.2] = 0.0
    probs = cp.tile(cp.asarray(p), (m, 1))  # [M, V]
    u = cp.asarray((np.arange(m) + 0.5) / m)  # [M]
    expect = m * p.astype(np.float64) / p.astype(np.float64).sum()
    counts = {
        ver: np.bincount(accept.sample_tokens(probs, u, version=ver).get(), minlength=v) for ver in (2, 3)
    }
    for ver, c in counts.items():
        assert np.abs(c - expect).max() <= 1 + 1e-6, ver
        assert c[p == 0].sum() == 0, ver
    assert np.abs(counts[3] - counts[2]).max() <= 2


@pytest.mark.gpu
def test_sample_v3_in_a_cuda_graph():
    """sample_tokens (out=) and accept_sample_batch (out=, targets=) captured in one CUDA graph and replayed
    on new inputs written into the captured buffers: bit-exact with the reference every time."""
    cp = _cp()

    rng = np.random.default_rng(21)
    bsz, depth, kp, vocab, budget = 8, 6, 8, 32000, 24
    ids, lp = pipeline.random_topk(rng, bsz, depth, kp, 50)
    trees = ref.build_tree_batch(ids, lp, budget)
    d_trees = ref.DDTreeBatch(**{f: cp.asarray(getattr(trees, f)) for f in FIELDS})
    probs = cp.empty((bsz, budget + 1, vocab), dtype=cp.float32)  # [B, S, V]
    u = cp.empty((bsz, budget + 1))  # [B, S]
    tokens = cp.empty(bsz * (budget + 1), dtype=cp.int64)  # [B * S]
    targets = cp.empty((bsz, budget + 1), dtype=cp.int64)  # [B, S]
    outs = (
        cp.empty((bsz, budget + 1), dtype=cp.int64),
        cp.empty(bsz, dtype=cp.int64),
        cp.empty(bsz, dtype=cp.int64),
    )

    def step():
        accept.sample_tokens(probs.reshape(-1, vocab), u.reshape(-1), out=tokens)
        accept.accept_sample_batch(d_trees, probs, u, out=outs, targets=targets)

    probs.fill(1.0)
    u.fill(0.5)
    step()  # compiles the kernels before the capture
    cp.cuda.runtime.deviceSynchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    for _ in range(3):
        p_h = (rng.random((bsz, budget + 1, vocab)) ** 8).astype(np.float32)  # [B, S, V]
        tgt = _targets(rng, trees, 50, p_follow=0.9)
        rows, cols = np.nonzero(tgt >= 0)
        p_h[rows, cols, tgt[rows, cols]] += 20000.0  # mostly on one child's token, so that walks go deep
        u_h = rng.random((bsz, budget + 1))
        with stream:  # the copies and poison on the graph's stream, ordered before the replay
            probs.set(p_h)
            u.set(u_h)
            for buf in (tokens, targets, *outs):
                buf.fill(POISON_INT)
            graph.launch(stream)
        stream.synchronize()
        assert (tokens.get() == ref.sample_tokens(p_h.reshape(-1, vocab), u_h.reshape(-1))).all()
        want = ref.accept_sample_batch(trees, p_h, u_h)
        for g, w in zip(outs, want, strict=True):
            assert (g.get() == w).all()
        assert want[1].max() > 2  # real walks


def test_accept_suite_parts(monkeypatch):
    """KDLIB_ACCEPT_PARTS picks the accept suite's parts; a name it does not know is a clear error."""
    monkeypatch.delenv("KDLIB_ACCEPT_PARTS", raising=False)
    assert suite._parts() == ("acceptance", "sampling")
    monkeypatch.setenv("KDLIB_ACCEPT_PARTS", "sampling")
    assert suite._parts() == ("sampling",)
    monkeypatch.setenv("KDLIB_ACCEPT_PARTS", "sampling,speed")
    with pytest.raises(ValueError, match="KDLIB_ACCEPT_PARTS"):
        suite._parts()


@pytest.mark.gpu
def test_accept_suite_sampling_points():
    """The accept suite's sampling sweep on a small grid: every point bit-exact on its checked rows,
    a floor below the time, both versions at every point and the speedup table complete."""
    _cp()

    out = suite.bench_sampling(vocabs=(4096, 32000), rows=(1, 16), iters=2, log=lambda _: None)
    pts = out["points"]
    assert {(p["vocab"], p["rows"], p["version"]) for p in pts} == {
        (v, r, ver) for v in (4096, 32000) for r in (1, 16) for ver in suite.SAMPLE_TIMED}
    assert all(p["exact_first_rows"] and 0 < p["floor_us"] < p["kernel_us"] for p in pts)
    assert all(p["bytes"] == p["rows"] * (p["vocab"] * 4 + 16) for p in pts)
    assert len(out["speedup"]) == 4 and out["copy_bandwidth_Bps"] > 0


# ----------------------------------------------------------------------------- compaction, remap


def _random_paths(rng, bsz, width, maxlen):
    lengths = rng.integers(0, maxlen + 1, bsz)
    paths = np.full((bsz, maxlen), POISON_INT, dtype=np.int64)
    for b in range(bsz):
        m = int(lengths[b])
        if m:
            rest = (
                np.sort(rng.choice(np.arange(1, width), m - 1, replace=False))
                if m > 1
                else np.zeros(0, np.int64)
            )
            paths[b, :m] = np.concatenate([[0], rest])
    return paths, lengths.astype(np.int64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,row_shape", [(np.float32, (576,)), (np.uint16, (576,)), (np.int8, (7,)),
                                             (np.float32, (3,)), (np.float64, (2, 5))])
def test_compact_kv_batch_exact(dtype, row_shape):
    cp = _cp()

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
def test_compaction_and_remap_stay_in_bounds_on_unchecked_input():
    """The greedy walk reports a path's whole length, past a truncated path buffer: the kernels cut it to
    the buffer (they read the next request's row, or past the last), and a copy from or to a row past
    the cache (a view of the first n rows of a larger buffer here) is skipped: the rows after the view
    and the next request's path are untouched."""
    cp = _cp()
    n, d = 16, 8
    buf = cp.arange((n + 8) * d, dtype=cp.float32).reshape(n + 8, d)  # rows n .. n + 7 guard the view
    before = buf.get()
    paths = cp.asarray([[0, 2, 5], [0, 1, 2]], dtype=cp.int64)  # maxlen 3; request 0's length says 10
    lengths = cp.asarray([10, 0], dtype=cp.int64)
    compact.compact_kv_batch(buf[:n], cp.asarray([n - 2, 0], dtype=cp.int64), paths, lengths)
    assert (buf.get() == before).all(), "rows n - 1 and n - 2 + 2 = n would read past the view"
    r2t = cp.full((2, 8), -7, dtype=cp.int64)
    slots = cp.asarray([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]], dtype=cp.int64)
    freed = compact.remap_slots_masked(r2t, cp.asarray([0, 0], dtype=cp.int64), slots, paths, lengths)
    assert r2t.get()[0].tolist() == [10, 12, 15, -7, -7, -7, -7, -7] and (r2t.get()[1] == -7).all()
    assert freed.get()[0].tolist() == [False, True, False, True, True, False]


@pytest.mark.gpu
def test_remap_slots_exact():
    cp = _cp()

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
    got_freed = compact.remap_slots(
        got_r2t, cp.asarray(starts), cp.asarray(slots), cp.asarray(paths), cp.asarray(lengths)
    )
    assert (got_r2t.get() == want_r2t).all()
    assert got_freed.dtype == want_freed.dtype and (got_freed.get() == want_freed).all()


@pytest.mark.gpu
def test_remap_checks_refuse_a_wrapping_slot_and_a_strided_freed():
    """check_values refuses an accepted slot an int32 table would wrap (as the reference does), and a
    strided freed buffer is refused (the kernel writes it as contiguous)."""
    cp = _cp()
    r2t = cp.full((1, 8), -7, dtype=cp.int32)
    args = (cp.asarray([0]), cp.asarray([[5, 2**31 + 7, 9]]), cp.asarray([[0, 1]]), cp.asarray([2]))
    with pytest.raises(ValueError, match="wrap"):
        compact.remap_slots(r2t, *args, check_values=True)
    assert (r2t.get() == -7).all()
    backing = cp.zeros((1, 6), dtype=cp.bool_)
    with pytest.raises(ValueError, match="C-contiguous"):
        compact.remap_slots_masked(cp.zeros((1, 8), cp.int64), *args, freed=backing[:, ::2])
    assert not backing.get().any()


@pytest.mark.gpu
def test_remap_writes_a_torch_bool_freed_in_place():
    """A torch CUDA bool `freed` buffer (torch.bool is no numpy dtype) is taken as a CuPy bool view and
    written in place, as the CuPy one is."""
    cp = _cp()
    import torch

    paths, lengths = cp.asarray([[0, 2, 5]], dtype=cp.int64), cp.asarray([3], dtype=cp.int64)
    slots = cp.asarray([[10, 11, 12, 13, 14, -1]], dtype=cp.int64)
    freed = torch.ones((1, 6), dtype=torch.bool, device="cuda")
    r2t = cp.full((1, 8), -7, dtype=cp.int64)
    got = compact.remap_slots_masked(r2t, cp.asarray([0], dtype=cp.int64), slots, paths, lengths, freed=freed)
    assert got.data.ptr == freed.data_ptr()
    assert freed.cpu().tolist() == [[False, True, False, True, True, False]]
    assert r2t.get()[0].tolist() == [10, 12, -1, -7, -7, -7, -7, -7]


# ----------------------------------------------------------------------------- the graph-captured step

# a TreeStep's input buffer -> the random_step_inputs / reference_step key it holds
STEP_BUFFERS = (("ids", "top_token_ids"), ("lp", "top_log_probs"), ("root", "root_tokens"),
                ("table", "target_table"), ("cache", "cache"), ("starts", "starts"))


def _captured_step(cp, inp, budget):
    """A TreeStep made from `inp` (random_step_inputs) on the device, its graph captured."""
    step = pipeline.make_step(*(cp.asarray(inp[key]) for _, key in STEP_BUFFERS), budget)
    step.capture()
    return step


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_step_graph_equals_reference(mode):
    cp = _cp()
    rng = np.random.default_rng(11)
    bsz, depth, kp, vocab, budget = 64, 15, 64, 300, 64
    step = _captured_step(cp, pipeline.random_step_inputs(rng, bsz, depth, kp, vocab, budget, mode=mode),
                          budget)
    for it in range(4):  # fresh inputs each replay, written into the captured buffers
        inp = pipeline.random_step_inputs(rng, bsz, depth, kp, vocab, budget, mode=mode)
        for name, key in STEP_BUFFERS:
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


@pytest.mark.gpu
def test_step_replay_waits_for_inputs_written_on_the_current_stream():
    """replay() orders the graph's non-blocking stream after the current stream: inputs written there behind a
    long kernel (a 4096^3 fp32 matmul, milliseconds) are the ones the replay reads."""
    cp = _cp()
    rng = np.random.default_rng(12)
    bsz, depth, kp, vocab, budget = 64, 15, 64, 300, 64
    step = _captured_step(cp, pipeline.random_step_inputs(rng, bsz, depth, kp, vocab, budget, mode="random"),
                          budget)
    fresh = pipeline.random_step_inputs(rng, bsz, depth, kp, vocab, budget, mode="random")
    staged = {key: cp.asarray(fresh[key]) for _, key in STEP_BUFFERS}
    cp.cuda.Device().synchronize()
    x = cp.ones((4096, 4096), dtype=cp.float32)  # [4096, 4096]
    x @ x  # keeps the current stream busy while the writes below wait behind it
    for name, key in STEP_BUFFERS:
        getattr(step, name)[...] = staged[key]
    step.replay()
    step.stream.synchronize()
    got = pipeline.step_outputs(step)
    want = pipeline.reference_step(**fresh)
    assert_trees_equal(got["trees"], want["trees"], "after the current stream's writes")
    for key in ("targets", "paths", "lengths", "bonus", "cache"):
        assert (got[key] == want[key]).all(), key


# ----------------------------------------------------------------------------- v4 without a device


def _rank_key(tuples, parent: int, depth: int, rank: int) -> tuple[int, int]:
    """(hi, lo) of the rank tuple parent's + (rank at depth): v4's 16-byte key, rank r_d in byte d-1."""
    hi, lo = tuples[parent]
    if rank == 0:  # a zero byte (also a first child one past depth 16, which v4 never orders)
        return hi, lo
    p = depth - 1
    return (hi | rank << 8 * (7 - p), lo) if p < 8 else (hi, lo | rank << 8 * (15 - p))


def v4_model(ids, lp, budget: int, k: int, rows: int):
    """tree_build_v4's pop loop, position by position (kernels/tree_build/v4.cu, warp 0).

    ids/lp: [L][>= k] lists. Position t of `ent` is lane t % 32 of row t // 32; a candidate is
    (score, parent, depth, rank). Returns ((tokens, depths, parents, scores), most live candidates).
    """
    leff = min(len(ids), budget)
    if budget == 0 or leff == 0 or k == 0:
        return ([], [], [-1], []), 0

    def lpv(d, r):  # lps[d][r], 0.0 outside the table (as the kernel's guarded loads)
        return float(lp[d][r]) if d < leff and r < k else 0.0

    def carried(c):  # lp[d-1][r], lp[d-1][r+1], lp[d][0] of candidate c
        return lpv(c[2] - 1, c[3]), lpv(c[2] - 1, c[3] + 1), lpv(c[2], 0)

    tuples = {0: (0, 0)}

    def before(a, b, slow):  # a is popped before b
        if not slow or a[0] != b[0]:
            return a[0] > b[0]
        ka, kb = _rank_key(tuples, *a[1:]), _rank_key(tuples, *b[1:])
        return (*ka, a[2]) < (*kb, b[2])

    size = 32 * rows
    ent = [(lpv(0, 0), 0, 1, 0)] + [(0.0, 0, 1, 0)] * (size - 1)
    w, wl = ent[0], carried(ent[0])
    f, most = 1, 0
    tokens, depths, parents, scores = [], [], [-1], []
    for count in range(budget):
        if f == 0:
            break
        idx = count + 1
        sc, par, dep, rk = w
        tokens.append(ids[dep - 1][rk])
        depths.append(dep)
        parents.append(par)
        scores.append(sc)
        tuples[idx] = _rank_key(tuples, par, dep, rk)
        nx, ny = rk + 1 < k, dep < leff
        x, y = ((sc - wl[0]) + wl[1], par, dep, rk + 1), (sc + wl[2], idx, dep + 1, 0)
        xl, yl = (wl[1], lpv(dep - 1, rk + 2), wl[2]), (wl[2], lpv(dep, 1), lpv(dep + 1, 0))
        o1 = ent[1] if f >= 2 else (0.0, 0, 1, 0)
        live = range(1, f)
        slow = (nx and ny and x[0] == y[0]) or any(
            (nx and ent[t][0] == x[0]) or (ny and ent[t][0] == y[0]) for t in live
        )
        y_first = before(y, x, slow)
        px = sum(before(ent[t], x, slow) for t in live) + (ny and y_first)
        py = sum(before(ent[t], y, slow) for t in live) + (nx and not y_first)
        fn = min(f - 1 + nx + ny, budget - idx)
        most = max(most, fn)
        fn = min(fn, size)
        new = []
        for t in range(size):
            if nx and t == px:
                new.append(x)
            elif ny and t == py:
                new.append(y)
            else:
                s = t - (nx and px < t) - (ny and py < t) + 1  # shuffle source: t - 1, t or t + 1
                new.append(ent[s] if s < size else (0.0, 0, 1, 0))
        ent, f = new, fn
        w, wl = (x, xl) if (nx and px == 0) else (y, yl) if (ny and py == 0) else (o1, carried(o1))
    return (tokens, depths, parents, scores), most


def _v4_cases():
    """(ids, lp, budget): >= 1,000 requests over BUILD_CONFIGS x MODES, more budgets, frontier-filling
    inputs."""
    configs = BUILD_CONFIGS + [(63, 7, 70, 90), (65, 10, 65, 100), (128, 16, 128, 200), (129, 5, 200, 300)]
    for budget, depth, kp, vocab in configs:
        for mode in MODES:
            rng = np.random.default_rng(zlib.crc32(repr(("v4", budget, depth, kp, mode)).encode()))
            bsz = 6 if budget > 128 else 24
            ids, lp = pipeline.random_topk(rng, bsz, depth, kp, vocab, mode)
            yield ids, lp, budget
    for budget in FILLING_BUDGETS:
        ids, lp = frontier_filling_topk(np.random.default_rng(budget), 4, budget, budget + 3)
        yield ids, lp, budget
    for budget, depth, kp in ((0, 5, 4), (5, 0, 4), (5, 3, 0), (1, 1, 1), (16, 16, 1), (3, 20, 2)):
        yield (
            np.arange(2 * depth * kp, dtype=np.int64).reshape(2, depth, kp),
            np.zeros((2, depth, kp), np.float32),
            budget,
        )


def test_v4_model_matches_reference():
    """The warp algorithm (sorted positions, ballot counts, cut list, head by selects) pops exactly
    the reference's nodes, and never needs more than floor((budget + 1) / 2) positions."""
    requests = 0
    for ids, lp, budget in _v4_cases():
        k = min(budget, ids.shape[-1])
        rows = int(tree.kernel_name(budget, 4)[1][-1])
        for b in range(ids.shape[0]):
            il, ll = ids[b, :, :k].tolist(), lp[b, :, :k].tolist()
            got, most = v4_model(il, ll, budget, k, rows)
            assert got == ref_tree._heap_build(il, ll, budget, k), f"budget {budget} request {b}"
            assert most <= (budget + 1) // 2 <= 32 * rows
            requests += 1
    assert requests >= 1000


# The host emulation (conftest's `host_emulation`): kernels/tree_build/v4.cu with tests/emu/cuda_shim.h
# in front and tests/emu/tree_build_driver.cpp behind it. Shared memory starts out as stale bytes (finite
# doubles in even blocks, NaNs in odd ones).


@pytest.fixture(scope="module")
def v4_host(host_emulation):
    """ctypes handle of kernels/tree_build/v4.cu built for the host with the emulation shim."""
    return host_emulation("tree_build/v4", "tree_build_driver")


def host_build_v4(lib, ids, lp, budget, vis_offset=0, kernel=None):
    """Run tree_build_v4 (`kernel`, default the wrapper's pick) on the host emulation; outputs
    poisoned, visibility at a byte offset `vis_offset` inside a poisoned buffer whose margins must
    stay untouched."""
    import ctypes

    bsz, depth, kp = ids.shape
    k, l_eff, s = min(budget, kp), min(depth, budget), budget + 1
    out = {}
    for name in FIELDS:
        shape = {
            "sizes": (bsz,),
            "node_token_ids": (bsz, budget),
            "node_depths": (bsz, budget),
            "scores": (bsz, budget),
        }.get(name, (bsz, s))
        if name == "scores":
            out[name] = np.full(shape, np.inf)
        elif name != "visibility":
            out[name] = np.full(shape, POISON_INT, dtype=np.int64)
    margin = 8
    buf = np.full(bsz * s * s + vis_offset + margin, 0x5A, dtype=np.uint8)
    vis = buf[vis_offset: vis_offset + bsz * s * s]
    ids, lp = np.ascontiguousarray(ids), np.ascontiguousarray(lp)
    ptr = ctypes.c_void_p
    rc = lib.emu_launch(
        (kernel or tree.kernel_name(budget, 4)[1]).encode(),
        bsz,
        tree.V4_THREADS,
        tree.shared_bytes(budget, l_eff, k, 4),
        ptr(ids.ctypes.data),
        ptr(lp.ctypes.data),
        depth,
        kp,
        k,
        l_eff,
        budget,
        *(ptr(out[n].ctypes.data) for n in ("sizes", "node_token_ids", "node_depths", "parents")),
        ptr(vis.ctypes.data),
        *(ptr(out[n].ctypes.data) for n in ("next_token", "next_sibling", "positions", "scores")),
    )
    assert rc == 0, f"emulation returned {rc}"
    assert (buf[:vis_offset] == 0x5A).all() and (buf[vis_offset + bsz * s * s :] == 0x5A).all(), (
        "write outside visibility"
    )
    out["visibility"] = vis.reshape(bsz, s, s).view(np.bool_)
    return ref.DDTreeBatch(**out)


def test_v4_host_worked_example(v4_host):
    ids = np.array([[[10, 11], [20, 21], [30, 31]]], dtype=np.int64)
    lp = np.log(np.array([[[0.60, 0.30], [0.90, 0.05], [0.45, 0.40]]])).astype(np.float32)
    got = host_build_v4(v4_host, ids, lp, 5)
    assert got.parents.tolist() == [[-1, 0, 1, 0, 3, 2]]
    assert_trees_equal(got, ref.build_tree_batch(ids, lp, 5), "host worked example")


@pytest.mark.slow
def test_v4_host_bit_exact(v4_host):
    """The kernel source itself, on >= 1,000 requests (every visibility alignment), against the reference."""
    requests = 0
    for case, (ids, lp, budget) in enumerate(_v4_cases()):
        want = ref.build_tree_batch(ids, lp, budget)
        got = host_build_v4(v4_host, ids, lp, budget, vis_offset=case % 4)
        assert_trees_equal(got, want, f"host v4 case {case} budget={budget} shape={ids.shape}")
        requests += ids.shape[0]
    assert requests >= 1000


def test_v4_host_launch_outside_limits_writes_nothing(v4_host):
    """A direct launch past a kernel's rows (budget 65 on r1: 33 live candidates > 32 lanes) returns
    before touching memory; the wrapper never does this (kernel_name picks r2)."""
    ids, lp = frontier_filling_topk(np.random.default_rng(3), 2, 65, 68)
    got = host_build_v4(v4_host, ids, lp, 65, kernel="tree_build_v4_r1")
    assert (got.sizes == POISON_INT).all() and (got.node_token_ids == POISON_INT).all()
    assert (got.visibility.view(np.uint8) == 0x5A).all() and np.isinf(got.scores).all()
