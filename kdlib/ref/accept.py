"""Acceptance: the greedy walk (survey §4.1) and sample-and-walk at temperature > 0 (§4.2 REF).

The walk starts at the root with the target's token t = target[0]; at node `cur` it scans the
children in LCRS order (next_token, then next_sibling) for the one whose token is t (siblings
carry distinct tokens, so at most one matches), moves there and reads t = target[child]. It stops
at the first node with no matching child; that node's target token is the bonus (the next round's
root). `path` is the list of accepted node indices, root included, so tau = len(path).

Sampling is lossless sample-and-walk (REF `liranringel/ddtree:ddtree.py:420` with
`model/utils.py:28-35`): draw one token from the target at every node with an explicit uniform,
then walk exactly as in the greedy case. The draw is an inverse CDF written so a kernel can
match it bit for bit: cumsum and total are sequential float64 sums in index order, and the token
is the first index i with `u * total < cumsum[i]`.
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
        tree.node_token_ids.tolist(), tree.next_token.tolist(), tree.next_sibling.tolist(), target_tokens.tolist()
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
    tok, nxt, sib, tgt = (a.tolist() for a in (trees.node_token_ids, trees.next_token, trees.next_sibling, target_tokens))
    for b in range(bsz):
        path, bonus[b] = _walk(tok[b], nxt[b], sib[b], tgt[b])
        if len(path) > width:
            raise ValueError(f"request {b}: accepted path of length {len(path)} exceeds max_depth + 1 = {width}")
        paths[b, : len(path)] = path
        lengths[b] = len(path)
    return paths, lengths, bonus


def sample_tokens(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw, one token per row, bit-reproducible.

    Shape: probs [N, V] float32 or float64, non-negative, finite, each row with a positive sum
    (need not be normalised); uniforms [N] float64 in [0, 1).
    For each row: cumsum = sequential float64 prefix sums in index order, total = cumsum[V-1];
    the token is the first i with `u * total < cumsum[i]` (zero-probability tokens are never drawn).
    Returns tokens [N] int64.
    """
    if not isinstance(probs, np.ndarray) or probs.ndim != 2:
        raise ValueError(f"probs must be a numpy array of shape [N, V], got {getattr(probs, 'shape', type(probs).__name__)}")
    if probs.dtype not in (np.float32, np.float64):
        raise ValueError(f"probs must be float32 or float64, got {probs.dtype}")
    if not isinstance(uniforms, np.ndarray) or uniforms.dtype != np.float64 or uniforms.shape != probs.shape[:1]:
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
    cum = np.cumsum(probs.astype(np.float64), axis=1)  # [N, V], add.accumulate: sequential in index order
    if probs.shape[0] and not (cum[:, -1] > 0).all():
        raise ValueError("a probs row sums to zero")
    out = np.empty(probs.shape[0], dtype=np.int64)  # [N]
    for r in range(probs.shape[0]):
        x = uniforms[r] * cum[r, -1]
        out[r] = np.searchsorted(cum[r], x, side="right")  # first i with x < cum[i]
    return out


def accept_sample(tree: DDTree, probs: np.ndarray, uniforms: np.ndarray) -> tuple[np.ndarray, int]:
    """Sample-and-walk acceptance of one tree (lossless at any temperature).

    Shape: probs [n+1, V] float32/float64 (the tempered target distribution at every node),
    uniforms [n+1] float64 in [0, 1) (one per node). Equals
    `accept_greedy(tree, sample_tokens(probs, uniforms))`.
    Returns (path [tau] int64, bonus int).
    """
    _check_tree(tree)
    if not isinstance(probs, np.ndarray) or probs.ndim != 2 or probs.shape[0] != tree.n + 1:
        raise ValueError(f"probs must have shape [{tree.n + 1}, V], got {getattr(probs, 'shape', None)}")
    return accept_greedy(tree, sample_tokens(probs, uniforms))


def accept_sample_batch(
    trees: DDTreeBatch, probs: np.ndarray, uniforms: np.ndarray, max_depth: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample-and-walk over a batch.

    Shape: probs [B, budget+1, V] float32/float64, uniforms [B, budget+1] float64; slots
    >= sizes[b] are never read (may hold anything, NaN included).
    Returns paths [B, max_depth+1] int64 padded -1, lengths [B] int64, bonus [B] int64
    (max_depth as in `accept_greedy_batch`).
    """
    _check_batch(trees)
    bsz, budget = trees.batch, trees.budget
    if not isinstance(probs, np.ndarray) or probs.ndim != 3 or probs.shape[:2] != (bsz, budget + 1):
        raise ValueError(f"probs must have shape [{bsz}, {budget + 1}, V], got {getattr(probs, 'shape', None)}")
    if not isinstance(uniforms, np.ndarray) or uniforms.shape != (bsz, budget + 1):
        raise ValueError(f"uniforms must have shape [{bsz}, {budget + 1}], got {getattr(uniforms, 'shape', None)}")
    targets = np.full((bsz, budget + 1), PAD, dtype=np.int64)  # [B, budget+1]
    for b in range(bsz):
        m = int(trees.sizes[b])
        targets[b, :m] = sample_tokens(probs[b, :m], uniforms[b, :m])
    return accept_greedy_batch(trees, targets, max_depth=max_depth)
