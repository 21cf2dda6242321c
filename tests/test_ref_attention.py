"""kdlib.ref.attention against an independently written dense masked attention (torch SDPA, float64)."""

import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import kdlib.ref.attention as attn
from kdlib.check import assert_close
from kdlib.ref import (
    build_tree_batch,
    merge_attention,
    prefix_attention,
    tree_tail_attention,
    tree_verify_attention,
)

D, DV = 576, 512  # MLA absorb: 512 latent + 64 rope; the value is the latent
H = 4
SCALE = 1.0 / np.sqrt(192.0)  # DeepSeek-V3's scale for qk_head_dim 192; any finite value works


def make_case(seed, bsz=3, budget=9, max_prefix=11, slots=64, poison=True):
    """Random queries/keys over real DDTrees; every unused slot poisoned with NaN or a huge index."""
    rng = np.random.default_rng(seed)
    L, kp, vocab = 4, 3, 50
    ids = np.stack([np.stack([rng.permutation(vocab)[:kp] for _ in range(L)]) for _ in range(bsz)]).astype(
        np.int64
    )
    lp = -np.sort(-np.log(rng.dirichlet(np.ones(vocab), size=(bsz, L))), axis=-1)[..., :kp].astype(np.float32)
    trees = build_tree_batch(ids, lp, budget)
    q_len = budget + 1
    q = rng.standard_normal((bsz, q_len, H, D))  # [B, Q, H, 576]
    tree_kv = rng.standard_normal((bsz, q_len, D))  # [B, Q, 576]
    kv_cache = rng.standard_normal((slots, D))  # [S, 576]
    prefix_lens = rng.integers(0, max_prefix + 1, size=bsz)
    prefix_lens[0] = 0  # an empty prefix
    page_table = np.full((bsz, max_prefix), np.iinfo(np.int32).max, dtype=np.int32)  # poison: huge slot
    used = rng.permutation(slots)
    at = 0
    for b in range(bsz):
        page_table[b, : prefix_lens[b]] = used[at : at + prefix_lens[b]]
        at += prefix_lens[b]
    if poison:
        kv_cache[used[at:]] = np.nan
        for b in range(bsz):
            m = trees.sizes[b]
            q[b, m:] = np.nan
            tree_kv[b, m:] = np.nan
    return q, kv_cache, page_table, prefix_lens, tree_kv, trees.visibility, trees.sizes


def dense_reference(q, kv_cache, page_table, prefix_lens, tree_kv, vis, sizes):
    """Per request: keys = [prefix rows | tree rows], mask = [all True | visibility]; SDPA in float64."""
    bsz, qn = q.shape[:2]
    out = np.full((bsz, qn, H, DV), np.nan)
    lse = np.full((bsz, qn, H), np.nan)
    for b in range(bsz):
        m = int(sizes[b])
        # [P+m, 576]
        keys = np.concatenate([kv_cache[page_table[b, : prefix_lens[b]].astype(np.int64)], tree_kv[b, :m]])
        mask = np.concatenate([np.ones((m, prefix_lens[b]), bool), vis[b, :m, :m]], axis=1)  # [m, P+m]
        qt = torch.from_numpy(q[b, :m]).permute(1, 0, 2)  # [H, m, 576]
        kt = torch.from_numpy(keys)[None].expand(H, -1, -1)
        vt = torch.from_numpy(keys[:, :DV])[None].expand(H, -1, -1)
        mt = torch.from_numpy(mask)[None].expand(H, -1, -1)
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mt, scale=SCALE)
        s = (qt @ kt.transpose(1, 2)) * SCALE
        s = s.masked_fill(~mt, float("-inf"))
        out[b, :m] = o.permute(1, 0, 2).numpy()
        lse[b, :m] = torch.logsumexp(s, dim=-1).T.numpy()
    return out, lse


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_equals_dense_masked_attention(seed):
    args = make_case(seed)
    out, lse = tree_verify_attention(*args[:5], args[5], args[6], SCALE)
    ref_out, ref_lse = dense_reference(*args)
    sizes = args[6]
    assert out.dtype == lse.dtype == np.float64 and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    for b in range(len(sizes)):
        m = int(sizes[b])
        assert_close(out[b, :m], ref_out[b, :m], rtol=1e-12, name=f"out[{b}]", quiet=True)
        assert_close(lse[b, :m], ref_lse[b, :m], rtol=1e-12, name=f"lse[{b}]", quiet=True)
        assert np.isnan(out[b, m:]).all() and np.isnan(lse[b, m:]).all()  # poisoned rows


def test_bad_tail_arguments_fail_before_the_prefix_work(monkeypatch):
    """The whole verify checks the tree's arguments before it attends over the (long) prefix."""
    q, kv, pt, lens, tkv, vis, sizes = make_case(4)

    def prefix_ran(*args, **kwargs):
        raise AssertionError("the prefix ran before the tail's arguments were checked")

    monkeypatch.setattr(attn, "prefix_attention", prefix_ran)
    with pytest.raises(ValueError, match="visibility must be a bool array"):
        attn.tree_verify_attention(q, kv, pt, lens, tkv, vis.astype(np.int64), sizes, SCALE)


def test_empty_prefix_and_verify_equals_tail():
    q, kv, pt, lens, tkv, vis, sizes = make_case(5)
    out_p, lse_p = prefix_attention(q, kv, pt, lens, SCALE)
    assert (out_p[0] == 0).all() and np.isneginf(lse_p[0]).all()
    out_t, lse_t = tree_tail_attention(q, tkv, vis, sizes, SCALE)
    out, lse = tree_verify_attention(q, kv, pt, lens, tkv, vis, sizes, SCALE)
    m = int(sizes[0])
    np.testing.assert_array_equal(out[0, :m], out_t[0, :m])
    np.testing.assert_array_equal(lse[0, :m], lse_t[0, :m])


def test_merge_of_split_prefix_equals_unsplit():
    q, kv, pt, lens, *_ = make_case(7, max_prefix=20, poison=False)
    lens = np.array([20, 13, 1])
    pt = np.stack([np.random.default_rng(b).permutation(64)[:20] for b in range(3)]).astype(np.int64)
    whole = prefix_attention(q, kv, pt, lens, SCALE)
    cut = np.array([7, 13, 0])
    first = prefix_attention(q, kv, pt, cut, SCALE)
    rest_pt = np.stack([np.r_[pt[b, cut[b]:], np.zeros(cut[b], dtype=np.int64)] for b in range(3)])
    rest = prefix_attention(q, kv, rest_pt, lens - cut, SCALE)
    out, lse = merge_attention(*first, *rest)
    assert_close(out, whole[0], rtol=1e-13, name="split prefix out")
    assert_close(lse, whole[1], rtol=1e-13, name="split prefix lse")
    # merging with an empty part is the identity, bit for bit
    empty_out, empty_lse = np.zeros_like(whole[0]), np.full_like(whole[1], -np.inf)
    o2, l2 = merge_attention(*whole, empty_out, empty_lse)
    np.testing.assert_array_equal(o2, whole[0])
    np.testing.assert_array_equal(l2, whole[1])
    o3, l3 = merge_attention(empty_out, empty_lse, empty_out, empty_lse)
    assert (o3 == 0).all() and np.isneginf(l3).all()


def test_merge_of_empty_and_poisoned_parts_is_quiet():
    """-inf with -inf (both parts empty) and NaN (rows past the tree) merge without a floating-point
    warning: lse -inf / NaN as documented; finite lse agree with np.logaddexp."""
    ni, nan = -np.inf, np.nan
    la = np.array([ni, ni, nan, 1.5, ni, -3.0, 2.0])  # [7]
    lb = np.array([ni, 0.25, ni, nan, 4.0, ni, 2.0 + 1e-9])  # [7]
    oa, ob = np.ones((7, 2)), np.full((7, 2), 3.0)  # [7, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_attention(oa, la, ob, lb)
        q, kv, pt, lens, tkv, vis, sizes = make_case(5)
        tree_verify_attention(q, kv, pt, lens, tkv, vis, sizes, SCALE)
    assert np.isneginf(lse[0]) and (out[0] == 0).all()
    assert np.isnan(lse[2:4]).all() and np.isnan(out[2:4]).all()
    finite = np.isfinite(lse)
    assert finite.tolist() == [False, True, False, False, True, True, True]
    with np.errstate(invalid="ignore"):
        assert_close(lse[finite], np.logaddexp(la, lb)[finite], rtol=1e-14, name="lse vs np.logaddexp")
    np.testing.assert_array_equal(out[[1, 4]], ob[[1, 4]])
    np.testing.assert_array_equal(out[5], oa[5])


def test_chain_tail_equals_causal():
    rng = np.random.default_rng(9)
    n = 6
    q = rng.standard_normal((n, H, D))
    kv = rng.standard_normal((n, D))
    vis = np.tril(np.ones((n, n), dtype=bool))
    out, lse = tree_tail_attention(q, kv, vis, n, SCALE)  # the unbatched form
    o = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q).permute(1, 0, 2), torch.from_numpy(kv)[None].expand(H, -1, -1),
        torch.from_numpy(kv[:, :DV])[None].expand(H, -1, -1), is_causal=True, scale=SCALE)
    assert_close(out, o.permute(1, 0, 2).numpy(), rtol=1e-12, name="chain == causal")
    assert out.shape == (n, H, DV) and lse.shape == (n, H)


def test_unbatched_equals_batched():
    q, kv, pt, lens, tkv, vis, sizes = make_case(3)
    out, lse = tree_verify_attention(q, kv, pt, lens, tkv, vis, sizes, SCALE)
    b = 1
    o1, l1 = tree_verify_attention(q[b], kv, pt[b], int(lens[b]), tkv[b], vis[b], int(sizes[b]), SCALE)
    # separate matmuls: a BLAS may round the last bit by the operands' alignment
    np.testing.assert_allclose(o1, out[b], rtol=1e-13, atol=0)
    np.testing.assert_allclose(l1, lse[b], rtol=1e-13, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_low_precision_inputs_computed_in_float64(dtype):
    q, kv, pt, lens, tkv, vis, sizes = make_case(4, poison=False)
    lo = [x.astype(dtype) for x in (q, kv, tkv)]
    out, lse = tree_verify_attention(lo[0], lo[1], pt, lens, lo[2], vis, sizes, SCALE)
    ref = tree_verify_attention(
        *(x.astype(np.float64) for x in lo[:2]), pt, lens, lo[2].astype(np.float64), vis, sizes, SCALE
    )
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, ref[0], rtol=1e-13, atol=0)  # the same float64 inputs, other matmul calls
    np.testing.assert_allclose(lse, ref[1], rtol=1e-13, atol=0)


def test_bad_input():
    q, kv, pt, lens, tkv, vis, sizes = make_case(0, poison=False)
    with pytest.raises(ValueError, match="kv_cache"):
        prefix_attention(q, kv[:, :500], pt, lens, SCALE)
    with pytest.raises(ValueError, match="prefix_lens"):
        prefix_attention(q, kv, pt, lens + 100, SCALE)
    bad_pt = pt.copy()
    bad_pt[1, 0] = 10_000
    lens2 = lens.copy()
    lens2[1] = max(lens2[1], 1)
    with pytest.raises(ValueError, match="slots outside"):
        prefix_attention(q, kv, bad_pt, lens2, SCALE)
    with pytest.raises(ValueError, match="page_table"):
        prefix_attention(q, kv, pt.astype(np.float32), lens, SCALE)
    with pytest.raises(ValueError, match="softmax_scale"):
        prefix_attention(q, kv, pt, lens, float("nan"))
    with pytest.raises(ValueError, match="visibility"):
        tree_tail_attention(q, tkv, vis.astype(np.int8), sizes, SCALE)
    with pytest.raises(ValueError, match="tree_kv"):
        tree_tail_attention(q, tkv[:, :-1], vis, sizes, SCALE)
    with pytest.raises(ValueError, match="tree_sizes"):
        tree_tail_attention(q, tkv, vis, sizes + 100, SCALE)
    with pytest.raises(ValueError, match="floating"):
        tree_tail_attention(q.astype(np.int64), tkv, vis, sizes, SCALE)
    with pytest.raises(ValueError, match="merge shapes"):
        merge_attention(np.zeros((2, 3, 8)), np.zeros((2, 3)), np.zeros((2, 3, 8)), np.zeros((2, 4)))


def test_key_chunking_matches_one_pass(monkeypatch):
    """Long prefixes are processed in key blocks merged by LSE: same result as one pass."""
    q, kv, pt, lens, tkv, vis, sizes = make_case(8, max_prefix=40, poison=False)
    lens = np.array([40, 17, 3])
    pt = np.stack([np.random.default_rng(b).permutation(64)[:40] for b in range(3)]).astype(np.int32)
    whole = prefix_attention(q, kv, pt, lens, SCALE)
    monkeypatch.setattr(attn, "KEY_CHUNK", 7)
    chunked = prefix_attention(q, kv, pt, lens, SCALE)
    assert_close(chunked[0], whole[0], rtol=1e-14, name="chunked out")
    assert_close(chunked[1], whole[1], rtol=1e-14, name="chunked lse")
