"""Tree-verify attention in the MLA absorb form: the float64 reference.

In the absorb form every head's query is a 576-wide vector (512 latent + 64 rope) and all heads
share one 576-wide key per token, the cached latent `c_kv` with its rope part; the value is the
first 512 dims of the same row (the latent). So, for one query row q and keys K:

    s_j = softmax_scale * (q . K_j)          over all 576 dims
    lse = log(sum_j exp(s_j))                natural log
    out = sum_j exp(s_j - lse) * K_j[:512]

The verify pass of a tree splits the keys in two parts computed apart and merged by LSE:
  * prefix: the request's committed tokens, read through a page table (page_size 1: one slot per
    token), visible to every tree query;
  * tail:   the tree's own rows, visible under the tree's visibility mask (ancestors and self).

Conventions: compute in float64 from any float input dtype; an empty key set gives out 0 and
lse -inf; query rows at or past a request's tree size are poisoned with NaN in the tail (and so in
the merged result). Every function also takes the unbatched single-request form (no B axis:
q [Q, H, 576], page_table [P], prefix_lens and tree_sizes plain ints) and then returns unbatched
outputs.
"""

from __future__ import annotations

import numbers

import numpy as np

KV_LORA_RANK = 512  # MLA latent width (DeepSeek-V3 / Kimi-K2 kv_lora_rank): the value dims


def _float_array(name, a, ndim, upcast: bool = True):
    """Validate a floating array of `ndim` dims; return it in float64 (or as it is, upcast=False)."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16":
        raise ValueError(f"{name} must be a floating array, got {a.dtype}")
    return a.astype(np.float64) if upcast else a


def _int_array(name, a, shape):
    if not isinstance(a, np.ndarray) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(
            f"{name} must be an integer numpy array, got {getattr(a, 'dtype', type(a).__name__)}"
        )
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return a.astype(np.int64)


def _scale(softmax_scale) -> float:
    if (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, numbers.Real)
        or not np.isfinite(softmax_scale)
    ):
        raise ValueError(f"softmax_scale must be a finite real number, got {softmax_scale!r}")
    return float(softmax_scale)


def _as_batched_lengths(name, x, batched: bool, bsz: int):
    if batched:
        return _int_array(name, x, (bsz,))
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise ValueError(f"{name} must be an int in the unbatched form, got {type(x).__name__}")
    return np.array([int(x)], dtype=np.int64)


KEY_CHUNK = 8192  # keys per block: bounds the [Q*H, chunk] float64 score block (65 x 8 heads -> 34 MB)


def _attend_block(qf: np.ndarray, keys: np.ndarray, mask: np.ndarray | None, scale: float, dv: int, nh: int):
    """qf [Q*H, D], keys [S, D], mask [Q, S] -> out [Q*H, dv], lse [Q*H] (float64, one pass)."""
    s = (qf @ keys.T) * scale  # [Q*H, S]
    if mask is not None:
        s = np.where(np.repeat(mask, nh, axis=0), s, -np.inf)
    m = s.max(axis=-1)  # [Q*H]
    has = ~np.isneginf(m)  # rows with a visible key (NaN rows stay NaN)
    m_safe = np.where(has, m, 0.0)
    p = np.exp(s - m_safe[:, None])  # [Q*H, S]; masked -> 0
    z = p.sum(axis=-1)  # [Q*H]
    z_safe = np.where(has, z, 1.0)
    out = np.where(has[:, None], (p @ keys[:, :dv]) / z_safe[:, None], 0.0)
    lse = np.where(has, np.log(z_safe) + m_safe, -np.inf)
    return out, lse


def _attend(q: np.ndarray, keys: np.ndarray, mask: np.ndarray | None, scale: float, dv: int):
    """q [Q, H, D], keys [S, D], mask [Q, S] bool or None -> out [Q, H, dv], lse [Q, H] (float64).

    Keys are taken in blocks of KEY_CHUNK, merged by LSE, so a 200k-token prefix fits in memory.
    """
    nq, nh, d = q.shape
    out = np.zeros((nq * nh, dv), dtype=np.float64)  # [Q*H, dv]
    lse = np.full(nq * nh, -np.inf, dtype=np.float64)  # [Q*H]
    qf = q.reshape(nq * nh, d)
    for c0 in range(0, keys.shape[0], KEY_CHUNK):
        c1 = min(c0 + KEY_CHUNK, keys.shape[0])
        o, l = _attend_block(qf, keys[c0:c1], None if mask is None else mask[:, c0:c1], scale, dv, nh)
        out, lse = merge_attention(out, lse, o, l) if c0 else (o, l)
    return out.reshape(nq, nh, dv), lse.reshape(nq, nh)


def prefix_attention(q, kv_cache, page_table, prefix_lens, softmax_scale, kv_lora_rank: int = KV_LORA_RANK):
    """Attention of every query over its request's paged latent prefix (page_size 1).

    Shape:
      q           [B, Q, H, D]   D = kv_lora_rank + rope dims (576)
      kv_cache    [S, D]         one row per slot (latent + rope)
      page_table  [B, P] int     page_table[b, t] = slot of prefix token t; only t < prefix_lens[b] is read
      prefix_lens [B] int        0 <= prefix_lens[b] <= P
    Returns out [B, Q, H, kv_lora_rank] float64, lse [B, Q, H] float64 (natural log); an empty
    prefix gives out 0 and lse -inf.
    """
    batched = isinstance(q, np.ndarray) and q.ndim == 4
    q64 = _float_array("q", q, 4 if batched else 3)
    if not batched:
        q64 = q64[None]
    bsz, nq, nh, d = q64.shape
    kv = _float_array("kv_cache", kv_cache, 2, upcast=False)  # only the rows read are upcast
    if kv.shape[1] != d:
        raise ValueError(f"kv_cache rows are {kv.shape[1]} wide but q is {d} wide")
    if not 0 < kv_lora_rank <= d:
        raise ValueError(f"kv_lora_rank must lie in (0, {d}], got {kv_lora_rank}")
    if not isinstance(page_table, np.ndarray) or page_table.ndim != (2 if batched else 1):
        raise ValueError(f"page_table must be a numpy array of {'[B, P]' if batched else '[P]'}, got "
                         f"{getattr(page_table, 'shape', None)}")
    pt = _int_array("page_table", page_table if batched else page_table[None], (bsz, page_table.shape[-1]))
    lens = _as_batched_lengths("prefix_lens", prefix_lens, batched, bsz)
    if ((lens < 0) | (lens > pt.shape[1])).any():
        raise ValueError(f"prefix_lens must lie in [0, {pt.shape[1]}] (the page table width)")
    for b in range(bsz):
        slots = pt[b, : lens[b]]
        if ((slots < 0) | (slots >= kv.shape[0])).any():
            raise ValueError(f"request {b}: page_table holds slots outside [0, {kv.shape[0]})")
    scale = _scale(softmax_scale)
    out = np.zeros((bsz, nq, nh, kv_lora_rank), dtype=np.float64)  # [B, Q, H, 512]
    lse = np.full((bsz, nq, nh), -np.inf, dtype=np.float64)  # [B, Q, H]
    for b in range(bsz):
        keys = kv[pt[b, : lens[b]]].astype(np.float64)  # [prefix_len, D]
        out[b], lse[b] = _attend(q64[b], keys, None, scale, kv_lora_rank)
    return (out, lse) if batched else (out[0], lse[0])


def tree_tail_attention(q, tree_kv, visibility, tree_sizes, softmax_scale, kv_lora_rank: int = KV_LORA_RANK):
    """Attention of every tree query over the tree's own rows under the visibility mask.

    Shape:
      q          [B, Q, H, D]
      tree_kv    [B, Q, D]     latent + rope row of every tree node (slot 0 = root)
      visibility [B, Q, Q] bool  query i sees key j iff visibility[b, i, j] (ancestor or self)
      tree_sizes [B] int       n_b + 1 <= Q; rows and keys at or past it are padding, never read
    Returns out [B, Q, H, kv_lora_rank] float64, lse [B, Q, H] float64; query rows >= tree_sizes[b]
    are NaN (poison); a valid row with no visible key gives out 0, lse -inf.
    """
    batched = isinstance(q, np.ndarray) and q.ndim == 4
    q64 = _float_array("q", q, 4 if batched else 3)
    kv = _float_array("tree_kv", tree_kv, 3 if batched else 2)
    if not batched:
        q64, kv = q64[None], kv[None]
    bsz, nq, nh, d = q64.shape
    if kv.shape != (bsz, nq, d):
        raise ValueError(f"tree_kv must have shape {(bsz, nq, d)[0 if batched else 1:]}, got {tree_kv.shape}")
    if not 0 < kv_lora_rank <= d:
        raise ValueError(f"kv_lora_rank must lie in (0, {d}], got {kv_lora_rank}")
    want = (bsz, nq, nq) if batched else (nq, nq)
    if not isinstance(visibility, np.ndarray) or visibility.dtype != bool or visibility.shape != want:
        raise ValueError(f"visibility must be a bool array of shape {want}, got "
                         f"{getattr(visibility, 'dtype', None)} {getattr(visibility, 'shape', None)}")
    vis = visibility if batched else visibility[None]
    sizes = _as_batched_lengths("tree_sizes", tree_sizes, batched, bsz)
    if ((sizes < 0) | (sizes > nq)).any():
        raise ValueError(f"tree_sizes must lie in [0, {nq}]")
    scale = _scale(softmax_scale)
    out = np.full((bsz, nq, nh, kv_lora_rank), np.nan, dtype=np.float64)  # [B, Q, H, 512]
    lse = np.full((bsz, nq, nh), np.nan, dtype=np.float64)  # [B, Q, H]
    for b in range(bsz):
        m = int(sizes[b])
        out[b, :m], lse[b, :m] = _attend(q64[b, :m], kv[b, :m], vis[b, :m, :m], scale, kv_lora_rank)
    return (out, lse) if batched else (out[0], lse[0])


def _logaddexp(a, b):
    """log(exp(a) + exp(b)) without floating-point warnings: -inf with -inf gives -inf and NaN (a
    poisoned row) gives NaN, both quietly (np.logaddexp flags these as invalid)."""
    hi = np.maximum(a, b)  # NaN propagates
    return hi + np.log1p(np.exp(np.minimum(a, b) - np.where(np.isneginf(hi), 0.0, hi)))


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Merge two attention results over disjoint key sets by their LSE.

    Shape: out_* [..., Dv], lse_* [...] (same leading shape). lse = logaddexp(lse_a, lse_b);
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b, in float64. Both parts empty
    (lse -inf) gives out 0, lse -inf; NaN in either part propagates.
    """
    oa = _float_array("out_a", out_a, np.ndim(out_a))
    ob = _float_array("out_b", out_b, np.ndim(out_b))
    la = _float_array("lse_a", lse_a, np.ndim(lse_a))
    lb = _float_array("lse_b", lse_b, np.ndim(lse_b))
    if oa.shape != ob.shape or la.shape != lb.shape or oa.shape[:-1] != la.shape:
        raise ValueError(f"merge shapes disagree: out {oa.shape} / {ob.shape}, lse {la.shape} / {lb.shape}")
    lse = _logaddexp(la, lb)  # [...]
    empty = np.isneginf(lse)
    base = np.where(empty, 0.0, lse)
    wa = np.where(np.isneginf(la), 0.0, np.exp(la - base))
    wb = np.where(np.isneginf(lb), 0.0, np.exp(lb - base))
    out = wa[..., None] * oa + wb[..., None] * ob
    return out, lse


def tree_verify_attention(
    q,
    kv_cache,
    page_table,
    prefix_lens,
    tree_kv,
    visibility,
    tree_sizes,
    softmax_scale,
    kv_lora_rank: int = KV_LORA_RANK,
):
    """The whole verify attention: merge(prefix_attention, tree_tail_attention).

    Shapes as in the two parts (batched or unbatched). Returns out [B, Q, H, kv_lora_rank]
    float64 and the natural-log lse [B, Q, H]; rows >= tree_sizes[b] are NaN.
    """
    # the small tail first: its arguments are checked before the prefix's work, as the CUDA twin checks all
    out_t, lse_t = tree_tail_attention(q, tree_kv, visibility, tree_sizes, softmax_scale, kv_lora_rank)
    out_p, lse_p = prefix_attention(q, kv_cache, page_table, prefix_lens, softmax_scale, kv_lora_rank)
    return merge_attention(out_p, lse_p, out_t, lse_t)
