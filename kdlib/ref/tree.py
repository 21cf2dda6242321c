"""DDTree construction from the drafter's per-depth top-k: the numpy reference.

The algorithm is the paper code's lazy best-first heap over rank prefixes (survey §2.3; REF
`liranringel/ddtree:ddtree.py:116-147` @c96427a, the same loop as SGLang's
`build_ddtree_tree_from_topk`). A candidate node is a rank prefix `(r_1, ..., r_d)`; its score is
`logw = sum_j top_log_probs[j-1, r_j]`. Rows are sorted descending, so moving to the next sibling
or to the first child never raises the score and the pops come out in globally non-increasing
score order: the first `budget` pops are the `budget` best prefixes, a prefix-closed set.

Arithmetic (kept exactly so a GPU kernel can match bit for bit):
  * float32 log-probs are promoted to float64 (every float32 is exact in float64);
  * first child:   `logw_child = logw + lp[depth, 0]`;
  * next sibling:  `logw_sib = (logw - lp[depth-1, rank]) + lp[depth-1, rank+1]` (this grouping);
  * the heap key is `(-logw, ranks)`: equal scores are broken by the rank tuple in Python
    tuple order, where a proper prefix sorts before its extensions;
  * only the first `K = min(budget, K')` columns are read (a node of rank r needs its r better
    siblings first, so the cap never removes a top-`budget` prefix).

Indices: the root (the bonus token, not stored in `node_token_ids`) is node 0; node `i >= 1` is
the i-th pop, so parents come before children and scores are non-increasing in index.
"""

from __future__ import annotations

import heapq
import numbers
from dataclasses import dataclass, fields

import numpy as np

PAD = -1  # padding value of every int array of a DDTreeBatch (and "none" in next_token/next_sibling)


@dataclass
class DDTree:
    """One request's draft tree with n non-root nodes (root = index 0 = the bonus token).

    Shapes and dtypes:
      node_token_ids [n]      int64  token of node i+1 (pop order)
      node_depths    [n]      int64  depth of node i+1, in 1..L (not monotone in index)
      parents        [n+1]    int64  parents[0] == -1; parents[i] < i
      visibility     [n+1, n+1] bool vis[i, j] iff j is i or an ancestor of i
      next_token     [n+1]    int64  first child (the lowest index child), -1 = none
      next_sibling   [n+1]    int64  next sibling in increasing index, -1 = none
      positions      [n+1]    int64  [0, node_depths...]: RoPE offset of each verify row
      scores         [n]      float64 logw of node i+1 (float64 sum of float32 log-probs)
    """

    node_token_ids: np.ndarray
    node_depths: np.ndarray
    parents: np.ndarray
    visibility: np.ndarray
    next_token: np.ndarray
    next_sibling: np.ndarray
    positions: np.ndarray
    scores: np.ndarray

    @property
    def n(self) -> int:
        """Number of non-root nodes."""
        return int(self.node_token_ids.shape[0])


@dataclass
class DDTreeBatch:
    """B draft trees padded to `budget + 1` slots (slot 0 = root).

    Shapes and dtypes (budget = node_token_ids.shape[1]):
      sizes          [B]                        int64  n_b + 1, root included (never inferred from
                                                      token values: token 0 is a valid token)
      node_token_ids [B, budget]                int64  padding -1
      node_depths    [B, budget]                int64  padding -1
      parents        [B, budget+1]              int64  padding -1 (parents[b, 0] == -1 too)
      visibility     [B, budget+1, budget+1]    bool   padding False (rows and columns)
      next_token     [B, budget+1]              int64  padding -1
      next_sibling   [B, budget+1]              int64  padding -1
      positions      [B, budget+1]              int64  padding -1
      scores         [B, budget]                float64 padding NaN
    """

    sizes: np.ndarray
    node_token_ids: np.ndarray
    node_depths: np.ndarray
    parents: np.ndarray
    visibility: np.ndarray
    next_token: np.ndarray
    next_sibling: np.ndarray
    positions: np.ndarray
    scores: np.ndarray

    @property
    def batch(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def budget(self) -> int:
        return int(self.node_token_ids.shape[1])

    def tree(self, b: int) -> DDTree:
        """Request b's tree, unpadded (views into this batch's arrays)."""
        n = int(self.sizes[b]) - 1
        return DDTree(
            node_token_ids=self.node_token_ids[b, :n],
            node_depths=self.node_depths[b, :n],
            parents=self.parents[b, : n + 1],
            visibility=self.visibility[b, : n + 1, : n + 1],
            next_token=self.next_token[b, : n + 1],
            next_sibling=self.next_sibling[b, : n + 1],
            positions=self.positions[b, : n + 1],
            scores=self.scores[b, :n],
        )


BATCH_FIELDS = tuple(f.name for f in fields(DDTreeBatch))  # the arrays of a DDTreeBatch, in order


# ----------------------------------------------------------------------------- validation


def _check_budget(budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise ValueError(f"budget must be an int, got {type(budget).__name__}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    return int(budget)


POSITIVE_LOG_PROB = "top_log_probs must be log-probabilities (<= 0); a positive one (logits?) was given"


def _check_topk(top_token_ids, top_log_probs, budget, vocab_size, ndim: int) -> tuple[int, int]:
    """Validate the top-k inputs (only the K = min(budget, K') columns the builder reads).

    Returns (budget, K).
    """
    budget = _check_budget(budget)
    what = "[L, K']" if ndim == 2 else "[B, L, K']"
    for name, a, dtype in (
        ("top_token_ids", top_token_ids, np.int64),
        ("top_log_probs", top_log_probs, np.float32),
    ):
        if not isinstance(a, np.ndarray):
            raise ValueError(f"{name} must be a numpy array, got {type(a).__name__}")
        if a.ndim != ndim:
            raise ValueError(f"{name} must have shape {what}, got shape {a.shape}")
        if a.dtype != dtype:
            raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if top_token_ids.shape != top_log_probs.shape:
        raise ValueError(f"top_token_ids {top_token_ids.shape} and top_log_probs {top_log_probs.shape} "
                         "differ in shape")
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size <= 0
    ):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    k = min(budget, top_token_ids.shape[-1])
    ids = top_token_ids[..., :k]
    lp = top_log_probs[..., :k]
    if np.isnan(lp).any():
        raise ValueError("top_log_probs contains NaN")
    if not np.isfinite(lp).all():
        raise ValueError("top_log_probs must be finite (±inf makes sibling scores NaN)")
    if k > 1 and (lp[..., 1:] > lp[..., :-1]).any():
        raise ValueError("top_log_probs rows are not sorted in descending order")
    if k and (lp[..., 0] > 0).any():  # rows are sorted: the first column holds each row's largest
        raise ValueError(POSITIVE_LOG_PROB)
    if (ids < 0).any():
        raise ValueError("top_token_ids contains negative token ids")
    if vocab_size is not None and (ids >= vocab_size).any():
        raise ValueError(f"top_token_ids contains token ids outside [0, {vocab_size})")
    if k > 1:
        s = np.sort(ids, axis=-1)
        if (s[..., 1:] == s[..., :-1]).any():
            raise ValueError("top_token_ids repeats a token within one row (siblings must be distinct)")
    return budget, k


# ----------------------------------------------------------------------------- the builder


def _heap_build(ids: list[list[int]], lp: list[list[float]], budget: int, k: int):
    """The best-first loop. ids/lp: [L][>=k] Python lists. Returns (tokens, depths, parents, scores)."""
    depth_limit = len(ids)
    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = [-1]
    scores: list[float] = []
    if budget == 0 or depth_limit == 0 or k == 0:
        return tokens, depths, parents, scores
    first = lp[0][0]
    heap = [(-first, (0,), 0, 1, 0, first)]
    push, pop = heapq.heappush, heapq.heappop
    count = 0
    while heap and count < budget:
        _, ranks, parent, depth, rank, logw = pop(heap)
        row = lp[depth - 1]
        tokens.append(ids[depth - 1][rank])
        depths.append(depth)
        parents.append(parent)
        scores.append(logw)
        count += 1
        if rank + 1 < k:
            sib = (logw - row[rank]) + row[rank + 1]
            push(heap, (-sib, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sib))
        if depth < depth_limit:
            child = logw + lp[depth][0]
            push(heap, (-child, ranks + (0,), count, depth + 1, 0, child))
    return tokens, depths, parents, scores


def _fill_visibility(parents: np.ndarray, sizes: np.ndarray, vis: np.ndarray) -> None:
    """vis[b, i, j] = j is i or an ancestor of i, for i < sizes[b]. parents: [B, S] padded -1.

    Walks every row up one parent per step (at most max-depth steps), all requests at once.
    """
    bsz, s = parents.shape
    rows = np.arange(s)
    valid = rows[None, :] < sizes[:, None]  # [B, S]
    b_idx, i_idx = np.nonzero(valid)
    cur = i_idx.copy()
    while cur.size:
        vis[b_idx, i_idx, cur] = True
        cur = parents[b_idx, cur]
        keep = cur >= 0
        b_idx, i_idx, cur = b_idx[keep], i_idx[keep], cur[keep]


def _fill_lcrs(parents: list[int], next_token: np.ndarray, next_sibling: np.ndarray) -> None:
    """First child = lowest index; each sibling chain runs in increasing index."""
    last_child = {}
    for child in range(1, len(parents)):
        p = parents[child]
        if p in last_child:
            next_sibling[last_child[p]] = child
        else:
            next_token[p] = child
        last_child[p] = child


def capacity(depth: int, k: int, budget: int) -> int:
    """min(budget, sum_{d=1..depth} k^d): the node count of the tree, stopping once budget is reached."""
    total, level = 0, 1
    for _ in range(depth):
        level *= k
        total += level
        if total >= budget:
            return budget
    return total


def build_tree(
    top_token_ids: np.ndarray, top_log_probs: np.ndarray, budget: int, vocab_size: int | None = None
) -> DDTree:
    """Build one request's DDTree (survey §2.3) from its per-depth top-k.

    Shape:
      top_token_ids [L, K'] int64, each row the top-K' tokens at depth d = row + 1
      top_log_probs [L, K'] float32, sorted descending in each row, finite
      budget        int >= 0: the number of non-root nodes wanted (n = min(budget, capacity))
      vocab_size    optional: token ids must lie in [0, vocab_size)
    Only the first K = min(budget, K') columns are read and validated.
    Returns a DDTree with n = min(budget, sum_{d=1..L} K^d) nodes. Budget 0, L = 0 or K' = 0
    give the root-only tree (visibility [[True]], next_token = next_sibling = [-1]).
    Raises ValueError (before any work) on wrong shapes/dtypes, unsorted rows, NaN, infinite or
    positive log-probs, negative budget, negative or out-of-vocabulary token ids, a token repeated in a row.
    """
    budget, k = _check_topk(top_token_ids, top_log_probs, budget, vocab_size, ndim=2)
    # the arrays are sized by what can be built: the returned views keep the whole batch alive
    batch = _build(top_token_ids[None], top_log_probs[None], capacity(top_token_ids.shape[0], k, budget), k)
    return batch.tree(0)


def build_tree_batch(
    top_token_ids: np.ndarray, top_log_probs: np.ndarray, budget: int, vocab_size: int | None = None
) -> DDTreeBatch:
    """Build B trees, padded to budget + 1 slots (see DDTreeBatch for padding).

    Shape: top_token_ids [B, L, K'] int64, top_log_probs [B, L, K'] float32; per request exactly
    `build_tree`. Validation as in `build_tree`, over the whole batch, before any work.
    Memory: O(B * budget^2) (visibility [B, budget+1, budget+1]), even where the trees are smaller.
    """
    budget, k = _check_topk(top_token_ids, top_log_probs, budget, vocab_size, ndim=3)
    return _build(top_token_ids, top_log_probs, budget, k)


def _build(top_token_ids: np.ndarray, top_log_probs: np.ndarray, budget: int, k: int) -> DDTreeBatch:
    bsz = top_token_ids.shape[0]
    s = budget + 1
    sizes = np.empty(bsz, dtype=np.int64)  # [B]
    tok = np.full((bsz, budget), PAD, dtype=np.int64)  # [B, budget]
    dep = np.full((bsz, budget), PAD, dtype=np.int64)  # [B, budget]
    par = np.full((bsz, s), PAD, dtype=np.int64)  # [B, budget+1]
    nxt = np.full((bsz, s), PAD, dtype=np.int64)  # [B, budget+1]
    sib = np.full((bsz, s), PAD, dtype=np.int64)  # [B, budget+1]
    pos = np.full((bsz, s), PAD, dtype=np.int64)  # [B, budget+1]
    sc = np.full((bsz, budget), np.nan, dtype=np.float64)  # [B, budget]
    vis = np.zeros((bsz, s, s), dtype=bool)  # [B, budget+1, budget+1]
    ids_all = top_token_ids[..., :k].tolist()
    lp_all = top_log_probs[..., :k].tolist()  # float32 -> Python float (float64), exact
    for b in range(bsz):
        tokens, depths, parents, scores = _heap_build(ids_all[b], lp_all[b], budget, k)
        n = len(tokens)
        sizes[b] = n + 1
        tok[b, :n] = tokens
        dep[b, :n] = depths
        par[b, : n + 1] = parents
        pos[b, 0] = 0
        pos[b, 1 : n + 1] = depths
        sc[b, :n] = scores
        _fill_lcrs(parents, nxt[b], sib[b])
    _fill_visibility(par, sizes, vis)
    return DDTreeBatch(sizes, tok, dep, par, vis, nxt, sib, pos, sc)


# ---------------------------------------------------------------------- synthetic inputs and the CPU baseline


def synthetic_topk(
    seed: int,
    batch: int,
    depth: int,
    k: int,
    *,
    vocab_size: int = 32000,
    draft_vocab: int = 1024,
    sharpness: float = 5.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Drafter-like top-k inputs, reproducible byte for byte on any platform.

    Per (request, depth) row: logits ~ N(0, sharpness^2) over `draft_vocab` candidate tokens with
    distinct random ids in [0, vocab_size); log-softmax computed in float64 with `math` (exact
    `fsum`, libm exp/log: no SIMD-dependent rounding), cast to float32, then the top k by
    descending log-prob (stable order on ties). Larger sharpness = more peaked = deeper trees.
    Shape: returns top_token_ids [batch, depth, k] int64, top_log_probs [batch, depth, k] float32.
    """
    import math

    if not 0 <= k <= draft_vocab <= vocab_size:
        raise ValueError(f"need 0 <= k <= draft_vocab <= vocab_size, got {k}, {draft_vocab}, {vocab_size}")
    rng = np.random.default_rng(seed)
    ids = np.empty((batch, depth, k), dtype=np.int64)  # [B, L, K']
    lps = np.empty((batch, depth, k), dtype=np.float32)  # [B, L, K']
    for b in range(batch):
        for d in range(depth):
            cand = rng.choice(vocab_size, size=draft_vocab, replace=False)
            logits = (rng.standard_normal(draft_vocab) * sharpness).tolist()
            top = max(logits)
            lse = top + math.log(math.fsum(math.exp(x - top) for x in logits))
            lp = np.array([x - lse for x in logits], dtype=np.float64).astype(np.float32)
            order = np.argsort(-lp, kind="stable")[:k]
            ids[b, d] = cand[order]
            lps[b, d] = lp[order]
    return ids, lps
