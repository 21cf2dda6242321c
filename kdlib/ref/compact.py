"""KV-cache bookkeeping after acceptance (survey §5.1).

After verify, a request's tree KV sits at cache rows `start + i` for tree slot i (flat pop order).
The accepted path (root first, strictly increasing, so path[i] >= i) must end up contiguous at
`start .. start + len - 1`:

  * contiguous cache / page_size > 1: move the rows, `cache[start + i] = cache[start + path[i]]`
    for i ascending; safe in place because path[i] >= i (REF `liranringel/ddtree:ddtree.py:226-277`);
  * page_size 1: no data moves; point `req_to_token[b, start + i]` at the accepted node's slot and
    free the slots of the rejected nodes (SGL-B `DB-Guo/sglang-ddtree-dev:dflash_info.py:579-583`).
"""

from __future__ import annotations

import numbers

import numpy as np


def _check_path(name: str, path: np.ndarray) -> None:
    if path.size and (path[0] < 0 or (np.diff(path) <= 0).any()):
        raise ValueError(f"{name} must be non-negative and strictly increasing, got {path.tolist()}")


def _int(name, x) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(x).__name__}")
    return int(x)


def _int_array(name, a, ndim):
    if not isinstance(a, np.ndarray) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(
            f"{name} must be an integer numpy array, got {getattr(a, 'dtype', type(a).__name__)}"
        )
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {a.shape}")


def compact_kv(cache: np.ndarray, start: int, path: np.ndarray) -> np.ndarray:
    """Move one request's accepted rows together, in place.

    Shape: cache [S, D...] (any dtype; axis 0 = sequence/slot), path [len] int (strictly
    increasing, path[0] usually 0). For i = 0..len-1 ascending: cache[start+i] = cache[start+path[i]].
    Rows past start+len-1 keep stale data. Returns cache (the same object).
    """
    if not isinstance(cache, np.ndarray) or cache.ndim < 1:
        raise ValueError("cache must be a numpy array with a slot axis")
    start = _int("start", start)
    _int_array("path", path, 1)
    _check_path("path", path)
    if start < 0 or (path.size and start + int(path[-1]) >= cache.shape[0]):
        raise ValueError(f"start {start} + path reaches past the cache ({cache.shape[0]} rows)")
    for i, p in enumerate(path.tolist()):
        if p != i:
            cache[start + i] = cache[start + p]
    return cache


def compact_kv_batch(
    cache: np.ndarray, starts: np.ndarray, paths: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """compact_kv for B requests sharing one cache, in place.

    Shape: cache [num_slots, D...], starts [B] int, paths [B, maxlen] int (padding past
    lengths[b] is never read), lengths [B] int in [0, maxlen]. The row ranges a request touches,
    [starts[b], starts[b] + paths[b, lengths[b]-1]], must not overlap between requests.
    Returns cache.
    """
    if not isinstance(cache, np.ndarray) or cache.ndim < 1:
        raise ValueError("cache must be a numpy array with a slot axis")
    _int_array("starts", starts, 1)
    _int_array("paths", paths, 2)
    _int_array("lengths", lengths, 1)
    bsz = starts.shape[0]
    if paths.shape[0] != bsz or lengths.shape[0] != bsz:
        raise ValueError(f"starts {starts.shape}, paths {paths.shape} and lengths {lengths.shape} disagree "
                         "on B")
    if ((lengths < 0) | (lengths > paths.shape[1])).any():
        raise ValueError(f"lengths must lie in [0, {paths.shape[1]}]")
    spans = []
    for b in range(bsz):
        path = paths[b, : lengths[b]]
        _check_path(f"paths[{b}]", path)
        s = int(starts[b])
        if s < 0 or (path.size and s + int(path[-1]) >= cache.shape[0]):
            raise ValueError(f"request {b}: start {s} + path reaches past the cache ({cache.shape[0]} rows)")
        if path.size:
            spans.append((s, s + int(path[-1]), b))
    spans.sort()
    for (_, hi, b0), (lo, _, b1) in zip(spans, spans[1:], strict=False):
        if lo <= hi:
            raise ValueError(f"requests {b0} and {b1} touch overlapping cache rows")
    for b in range(bsz):
        compact_kv(cache, int(starts[b]), paths[b, : lengths[b]])
    return cache


def remap_slots(
    req_to_token: np.ndarray,
    starts: np.ndarray,
    tree_slots: np.ndarray,
    paths: np.ndarray,
    lengths: np.ndarray,
) -> np.ndarray:
    """page_size 1 commit: point the request's token table at the accepted slots, free the rest.

    Shape: req_to_token [B, max_ctx] int (updated in place), starts [B] int (position of the
    root), tree_slots [B, budget+1] int (the cache slot of every tree node; negative = no slot
    allocated, padding), paths [B, maxlen] int, lengths [B] int.
    Sets req_to_token[b, starts[b] + i] = tree_slots[b, paths[b, i]] for i < lengths[b]; entries
    past starts[b] + lengths[b] - 1 are left as they are (the sequence length marks the end).
    Returns freed_slots [k] (dtype of tree_slots): every allocated slot of a rejected node, in
    request order, then node index order.
    """
    for name, a, nd in (
        ("req_to_token", req_to_token, 2),
        ("starts", starts, 1),
        ("tree_slots", tree_slots, 2),
        ("paths", paths, 2),
        ("lengths", lengths, 1),
    ):
        _int_array(name, a, nd)
    bsz = req_to_token.shape[0]
    if not (starts.shape[0] == tree_slots.shape[0] == paths.shape[0] == lengths.shape[0] == bsz):
        raise ValueError("req_to_token, starts, tree_slots, paths and lengths disagree on B")
    if ((lengths < 0) | (lengths > paths.shape[1])).any():
        raise ValueError(f"lengths must lie in [0, {paths.shape[1]}]")
    width = tree_slots.shape[1]
    for b in range(bsz):
        path = paths[b, : lengths[b]]
        _check_path(f"paths[{b}]", path)
        if path.size and path[-1] >= width:
            raise ValueError(f"paths[{b}] indexes past tree_slots (width {width})")
        if path.size and (tree_slots[b, path] < 0).any():
            raise ValueError(f"paths[{b}] accepts a node with no allocated slot")
        if path.size and tree_slots[b, path].max() > np.iinfo(req_to_token.dtype).max:
            raise ValueError(f"paths[{b}] accepts a slot past req_to_token's {req_to_token.dtype} range "
                             "(it would wrap)")
        s = int(starts[b])
        if s < 0 or s + path.size > req_to_token.shape[1]:
            raise ValueError(f"request {b}: start {s} + {path.size} accepted tokens exceed max_ctx "
                             f"{req_to_token.shape[1]}")
    freed = []
    for b in range(bsz):
        path = paths[b, : lengths[b]]
        s = int(starts[b])
        req_to_token[b, s : s + path.size] = tree_slots[b, path]
        keep = np.zeros(width, dtype=bool)
        keep[path] = True
        rejected = tree_slots[b, ~keep]
        freed.append(rejected[rejected >= 0])
    if not freed:
        return np.zeros(0, dtype=tree_slots.dtype)
    return np.concatenate(freed).astype(tree_slots.dtype, copy=False)
