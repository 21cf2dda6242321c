"""Acceptance: the greedy walk (survey §4.1) and sample-and-walk at temperature > 0 (§4.2 REF).

The walk starts at the root with the target's token t = target[0]; at node `cur` it scans the
children in LCRS order (next_token, then next_sibling) for the one whose token is t (siblings
carry distinct tokens, so at most one matches), moves there and reads t = target[child]. It stops
at the first node with no matching child; that node's target token is the bonus (the next round's
root). `path` is the list of accepted node indices, root included, so tau = len(path).

Sampling is lossless sample-and-walk (REF `liranringel/ddtree:ddtree.py:420` with
`model/utils.py:28-35`): draw one token from the target at every node with an explicit uniform,
then walk exactly as in the greedy case. The draw is an inverse CDF written so a kernel can
match it bit for bit: every sum is float64, in an order fixed here (`sample_tokens`: the blocked
order of `tree_accept_v3`, one block of SAMPLE_THREADS threads per row; or the sequential index
order of the one-thread-per-row kernels v1/v2), and a token is drawn only where its probability
is positive.
"""

from __future__ import annotations

import numbers

import numpy as np

from kdlib.ref.tree import PAD, DDTree, DDTreeBatch


def _walk(node_token_ids, next_token, next_sibling, target) -> tuple[list[int], int]:
    """Greedy walk over one tree's LCRS lists (Python sequences). Returns (path, bonus)."""
    path = [0]
    cur = 0
    t = target[0]
    while True:
        c = next_token[cur]
        while c != PAD and node_token_ids[c - 1] != t:
            c = next_sibling[c]
        if c == PAD:
            return path, int(t)
        path.append(c)
        cur = c
        t = target[c]


def _check_int_array(name, a, shape=None, ndim=None):
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(a).__name__}")
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array, got {a.dtype}")
    if shape is not None and a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape}")


def _check_tree(tree) -> None:
    if not isinstance(tree, DDTree):
        raise ValueError(f"tree must be a DDTree, got {type(tree).__name__}")


def _check_batch(trees) -> None:
    if not isinstance(trees, DDTreeBatch):
        raise ValueError(f"trees must be a DDTreeBatch, got {type(trees).__name__}")


def _paths_width(trees: DDTreeBatch, max_depth) -> int:
    if max_depth is None:
        return trees.budget + 1
    if isinstance(max_depth, bool) or not isinstance(max_depth, numbers.Integral) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0 or None, got {max_depth!r}")
    return int(max_depth) + 1


def accept_greedy(tree: DDTree, target_tokens: np.ndarray) -> tuple[np.ndarray, int]:
    """Greedy acceptance walk of one tree.

    Shape: target_tokens [n+1] int (the target's argmax at every node, root first).
    Returns (path [tau] int64 with path[0] == 0 and strictly increasing, bonus int).
    """
    _check_tree(tree)
    _check_int_array("target_tokens", target_tokens, shape=(tree.n + 1,))
    path, bonus = _walk(
        tree.node_token_ids.tolist(),
        tree.next_token.tolist(),
        tree.next_sibling.tolist(),
        target_tokens.tolist(),
    )
    return np.asarray(path, dtype=np.int64), bonus


def accept_greedy_batch(
    trees: DDTreeBatch, target_tokens: np.ndarray, max_depth: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy walk of every tree of a batch.

    Shape: target_tokens [B, budget+1] int; entries at slots >= sizes[b] are never read.
    max_depth: width of `paths` minus one; default `budget` (the deepest a tree of that budget
    can be, a static shape); pass the build's L for [B, L+1]. A path longer than
    max_depth + 1 raises ValueError.
    Returns paths [B, max_depth+1] int64 padded -1, lengths [B] int64 (tau), bonus [B] int64.
    """
    _check_batch(trees)
    bsz, budget = trees.batch, trees.budget
    _check_int_array("target_tokens", target_tokens, shape=(bsz, budget + 1))
    width = _paths_width(trees, max_depth)
    paths = np.full((bsz, width), PAD, dtype=np.int64)  # [B, max_depth+1]
    lengths = np.zeros(bsz, dtype=np.int64)  # [B]
    bonus = np.zeros(bsz, dtype=np.int64)  # [B]
    tok, nxt, sib, tgt = (
        a.tolist() for a in (trees.node_token_ids, trees.next_token, trees.next_sibling, target_tokens)
    )
    for b in range(bsz):
        path, bonus[b] = _walk(tok[b], nxt[b], sib[b], tgt[b])
        if len(path) > width:
            raise ValueError(f"request {b}: accepted path of length {len(path)} exceeds max_depth + 1 = "
                             f"{width}")
        paths[b, : len(path)] = path
        lengths[b] = len(path)
    return paths, lengths, bonus


SAMPLE_THREADS = 512  # threads per row in the blocked order (tree_accept_v3 gets it as -DTA3_THREADS)
SAMPLE_PIECE = 4  # consecutive elements a thread owns per tile (-DTA3_PIECE: one float4 load)
SAMPLE_ORDERS = ("blocked", "sequential")
_ROW_ELEMENTS = 1 << 22  # padded elements per slab of rows in the blocked draw (bounds its memory)


def _check_sample_inputs(probs, uniforms) -> None:
    if not isinstance(probs, np.ndarray) or probs.ndim != 2:
        raise ValueError("probs must be a numpy array of shape [N, V], got "
                         f"{getattr(probs, 'shape', type(probs).__name__)}")
    if probs.dtype not in (np.float32, np.float64):
        raise ValueError(f"probs must be float32 or float64, got {probs.dtype}")
    if (
        not isinstance(uniforms, np.ndarray)
        or uniforms.dtype != np.float64
        or uniforms.shape != probs.shape[:1]
    ):
        raise ValueError(
            f"uniforms must be a float64 array of shape {probs.shape[:1]}, got "
            f"{getattr(uniforms, 'dtype', type(uniforms).__name__)} {getattr(uniforms, 'shape', '')}"
        )
    if probs.shape[1] == 0 and probs.shape[0] > 0:
        raise ValueError("probs has an empty vocabulary axis")
    if not np.isfinite(probs).all():
        raise ValueError("probs contains NaN or infinite values")
    if (probs < 0).any():
        raise ValueError("probs contains negative values")
    if not ((uniforms >= 0) & (uniforms < 1)).all():
        raise ValueError("uniforms must lie in [0, 1)")
    if probs.shape[0] and not (probs.sum(axis=1, dtype=np.float64) > 0).all():  # exact test: terms are >= 0
        raise ValueError("a probs row sums to zero")


def blocked_order(v: int, threads: int = SAMPLE_THREADS, piece: int = SAMPLE_PIECE) -> np.ndarray:
    """The token indices [V] int64 in the order the blocked CDF visits them.

    A row is cut into tiles of threads * piece elements; thread t owns elements
    k * threads * piece + t * piece + e (e < piece) of every tile k, and visits them tile by tile;
    the order is thread 0's elements, then thread 1's, and so on.
    """
    tiles = -(-v // (threads * piece))
    idx = np.arange(tiles * threads * piece, dtype=np.int64).reshape(tiles, threads, piece)
    seq = idx.transpose(1, 0, 2).reshape(-1)
    return seq[seq < v]


def _warp_scan(a: np.ndarray) -> np.ndarray:
    """Inclusive scan over the last axis (32 lanes) in a warp's shuffle-up order: at steps
    d = 1, 2, 4, 8, 16 lane i adds the value lane i - d held before the step."""
    for d in (1, 2, 4, 8, 16):
        b = a.copy()
        b[..., d:] += a[..., :-d]
        a = b
    return a


def _shift(a: np.ndarray) -> np.ndarray:
    """Exclusive from inclusive: every lane takes its left neighbour's value, lane 0 takes 0.0."""
    return np.concatenate([np.zeros_like(a[..., :1]), a[..., :-1]], axis=-1)


def _draw_blocked(p: np.ndarray, u: np.ndarray, threads: int, piece: int) -> np.ndarray:
    """The blocked draw of `sample_tokens` on float64 rows p [N, V] with u [N]; tokens [N] int64."""
    n, v = p.shape
    tile = threads * piece
    tiles = -(-v // tile)
    grid = np.zeros((n, tiles * tile))  # [N, K * tile], zero past V (adding +0.0 changes no sum)
    grid[:, :v] = p
    grid = grid.reshape(n, tiles, threads, piece)  # [N, K, T, P]: element k * tile + t * P + e
    partial = np.zeros((n, threads))  # [N, T] each thread's sequential sum over (k, e)
    for k in range(tiles):
        for e in range(piece):
            partial = partial + grid[:, k, :, e]
    warps = threads // 32
    lanes = _warp_scan(partial.reshape(n, warps, 32))  # [N, W, 32] inclusive within each warp
    totals = np.zeros((n, 32))  # [N, 32] warp totals in warp 0's lanes, 0.0 past the last warp
    totals[:, :warps] = lanes[:, :, 31]
    warp_excl = _shift(_warp_scan(totals))[:, :warps]  # [N, W]
    excl = (warp_excl[:, :, None] + _shift(lanes)).reshape(n, threads)  # [N, T] CDF before thread t
    end = excl + partial  # [N, T] CDF after thread t
    live = partial > 0
    total = np.where(live, end, 0.0).max(axis=1)  # [N]
    x = u * total
    # u * total rounds to total only for subnormal totals
    x = np.where(x < total, x, np.nextafter(total, 0.0))
    t = (live & (x[:, None] < end)).argmax(axis=1)  # [N] the first thread with mass whose block ends above x
    rows = np.arange(n)
    seq = grid[rows, :, t, :].reshape(n, tiles * piece)  # [N, K * P] thread t's elements in its order
    cum = excl[rows, t][:, None] + np.cumsum(seq, axis=1)  # cumsum is add.accumulate: sequential
    j = ((seq > 0) & (x[:, None] < cum)).argmax(axis=1)  # [N]
    return (j // piece) * tile + t * piece + j % piece


def _draw_sequential(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The sequential draw of `sample_tokens` on float64 rows p [N, V] with u [N]; tokens [N] int64."""
    cum = np.cumsum(p, axis=1)  # [N, V], add.accumulate: sequential in index order
    out = np.empty(p.shape[0], dtype=np.int64)  # [N]
    for r in range(p.shape[0]):
        out[r] = np.searchsorted(cum[r], u[r] * cum[r, -1], side="right")  # first i with x < cum[i]
    return out


def sample_tokens(probs: np.ndarray, uniforms: np.ndarray, *, order: str = "blocked") -> np.ndarray:
    """Inverse-CDF draw, one token per row, bit-reproducible.

    Shape: probs [N, V] float32 or float64, non-negative, finite, each row with a positive sum
    (need not be normalised); uniforms [N] float64 in [0, 1). Returns tokens [N] int64.
    Every sum is float64 (float32 probabilities convert exactly) in one of two orders:

    order="blocked" (the twin of tree_accept_v3, the CUDA default): the tokens in
    `blocked_order(V)`. Thread t (of T = SAMPLE_THREADS) sums its elements sequentially in that
    order into partial[t]; an exclusive scan of partial in warp order (a 32-lane shuffle-up scan
    inside each warp of 32 threads, the same scan over the warp totals, then
    excl[t] = warp_excl + lane_excl) gives the CDF before thread t, end[t] = excl[t] + partial[t].
    total = the largest end[t] of a thread with partial > 0; x = u * total (the float below total
    where that rounds up to it). The token is the first in the order with probability > 0 and
    x < excl[t] + (t's sequential sum up to and including it); one exists whenever total > 0.

    order="sequential" (the twin of kernels v1/v2): cumsum = sequential prefix sums in index order,
    x = u * cumsum[V-1], the token is the first i with x < cumsum[i] (V, out of range, where x
    rounds up to a subnormal float64 total: float64 rows of subnormal mass only).

    Either way a zero-probability token is never drawn, u = 0 gives the first positive token of
    the order, and over uniforms the draw has the distribution probs / sum(probs) up to float64
    rounding; the two orders give different tokens for the same u.
    """
    if order not in SAMPLE_ORDERS:
        raise ValueError(f"order must be one of {SAMPLE_ORDERS}, got {order!r}")
    _check_sample_inputs(probs, uniforms)
    n, v = probs.shape
    if order == "sequential":
        return _draw_sequential(probs.astype(np.float64), uniforms)
    out = np.empty(n, dtype=np.int64)  # [N]
    tile = SAMPLE_THREADS * SAMPLE_PIECE
    step = max(1, _ROW_ELEMENTS // (-(-v // tile) * tile)) if n else 1
    for r0 in range(0, n, step):
        out[r0:r0 + step] = _draw_blocked(probs[r0:r0 + step].astype(np.float64), uniforms[r0:r0 + step],
                                          SAMPLE_THREADS, SAMPLE_PIECE)
    return out


def accept_sample(tree: DDTree, probs: np.ndarray, uniforms: np.ndarray, *, order: str = "blocked"
                  ) -> tuple[np.ndarray, int]:
    """Sample-and-walk acceptance of one tree (lossless at any temperature).

    Shape: probs [n+1, V] float32/float64 (the tempered target distribution at every node),
    uniforms [n+1] float64 in [0, 1) (one per node). Equals
    `accept_greedy(tree, sample_tokens(probs, uniforms, order=order))`.
    Returns (path [tau] int64, bonus int).
    """
    _check_tree(tree)
    if not isinstance(probs, np.ndarray) or probs.ndim != 2 or probs.shape[0] != tree.n + 1:
        raise ValueError(f"probs must have shape [{tree.n + 1}, V], got {getattr(probs, 'shape', None)}")
    return accept_greedy(tree, sample_tokens(probs, uniforms, order=order))


def accept_sample_batch(
    trees: DDTreeBatch, probs: np.ndarray, uniforms: np.ndarray, max_depth: int | None = None, *,
    order: str = "blocked"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample-and-walk over a batch: `sample_tokens` (in `order`) on every node, then the greedy walk.

    Shape: probs [B, budget+1, V] float32/float64, uniforms [B, budget+1] float64; slots
    >= sizes[b] are never read (may hold anything, NaN included).
    Returns paths [B, max_depth+1] int64 padded -1, lengths [B] int64, bonus [B] int64
    (max_depth as in `accept_greedy_batch`).
    """
    _check_batch(trees)
    bsz, budget = trees.batch, trees.budget
    if not isinstance(probs, np.ndarray) or probs.ndim != 3 or probs.shape[:2] != (bsz, budget + 1):
        raise ValueError(f"probs must have shape [{bsz}, {budget + 1}, V], got "
                         f"{getattr(probs, 'shape', None)}")
    if not isinstance(uniforms, np.ndarray) or uniforms.shape != (bsz, budget + 1):
        raise ValueError(f"uniforms must have shape [{bsz}, {budget + 1}], got "
                         f"{getattr(uniforms, 'shape', None)}")
    targets = np.full((bsz, budget + 1), PAD, dtype=np.int64)  # [B, budget+1]
    for b in range(bsz):
        m = int(trees.sizes[b])
        targets[b, :m] = sample_tokens(probs[b, :m], uniforms[b, :m], order=order)
    return accept_greedy_batch(trees, targets, max_depth=max_depth)
