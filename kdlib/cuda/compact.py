"""GPU KV bookkeeping after acceptance: `compact_kv_batch`, `remap_slots`, the CUDA twins of
`kdlib.ref.compact` (same names and signatures; in place on the caller's CuPy / torch arrays).

Kernels (`kernels/kv_compact/v1.cu`):
  * `kv_compact_v1_u{128,32,8}`: one thread per (request, 16/4/1-byte column of a row), copying
    the accepted rows in ascending order; in place is exact because path[i] >= i (see the .cu).
  * `kv_remap_v1_i64/_i32` (req_to_token int64 / int32): page_size 1 commit, one block per request;
    writes req_to_token and a per-node freed mask. `remap_slots` turns the mask into the
    reference's freed-slot list (a boolean gather, which synchronises); `remap_slots_masked`
    returns the mask and stays asynchronous (graph-capturable).

Value checks the reference makes (strictly increasing paths, non-overlapping request spans,
indices in range, allocated slots) need the data on the host; they run only with
`check_values=True` (one host copy of the small index arrays, through `kdlib.ref`'s checks).
"""

from __future__ import annotations

import numpy as np

from kdlib.cuda import loader
from kdlib.ref import compact as ref

COMPACT = {16: ("kv_compact/v1", "kv_compact_v1_u128"), 4: ("kv_compact/v1", "kv_compact_v1_u32"),
           1: ("kv_compact/v1", "kv_compact_v1_u8")}
REMAP = {
    np.dtype(np.int64): ("kv_compact/v1", "kv_remap_v1_i64"),
    np.dtype(np.int32): ("kv_compact/v1", "kv_remap_v1_i32"),
}
THREADS = 256  # KC_THREADS in kv_compact/v1.cu
MAX_GRID_Y = 65535  # CUDA's gridDim.y limit: the compaction's requests axis


def _common(starts, paths, lengths):
    starts, paths, lengths = (loader.int_array(a, name, "int64", ndim=nd) for a, name, nd in
                              ((starts, "starts", 1), (paths, "paths", 2), (lengths, "lengths", 1)))
    bsz = starts.shape[0]
    if paths.shape[0] != bsz or lengths.shape[0] != bsz:
        raise ValueError(f"starts {starts.shape}, paths {paths.shape} and lengths {lengths.shape} disagree "
                         "on B")
    if paths.shape[1] >= 2**31:
        raise ValueError("paths is too wide")
    return bsz, starts, paths, lengths


def _unit(cache) -> int:
    row_bytes = cache.itemsize * (int(np.prod(cache.shape[1:])) if cache.ndim > 1 else 1)
    for unit in (16, 4, 1):
        if row_bytes % unit == 0 and cache.data.ptr % unit == 0:
            return unit
    return 1


def _compact_grid(row_units: int, bsz: int) -> tuple[int, int]:
    """The compaction's grid: (column blocks, requests); ValueError past gridDim.y's limit."""
    if bsz > MAX_GRID_Y:
        raise ValueError(f"starts: {bsz} requests exceed the compaction's grid limit {MAX_GRID_Y} "
                         "(gridDim.y); split the batch")
    return (row_units + THREADS - 1) // THREADS, bsz


def compact_kv_batch(cache, starts, paths, lengths, *, check_values: bool = False):
    """compact_kv for B requests sharing one cache, in place on the GPU.

    Shape: cache [num_slots, D...] (any dtype, C-contiguous), starts [B] int, paths [B, maxlen]
    int, lengths [B] int in [0, maxlen]. cache[starts[b] + i] = cache[starts[b] + paths[b, i]],
    i ascending. Returns cache (the same object the caller passed, torch tensors included). Without
    check_values the kernel still stays in bounds: a length past maxlen is cut to it, a copy from or to
    a row outside the cache is skipped.
    """
    c = loader.as_cupy(cache)
    if c.ndim < 1:
        raise ValueError("cache must have a slot axis")
    if not c.flags.c_contiguous:
        raise ValueError("cache must be C-contiguous (the kernel addresses rows by a fixed stride)")
    bsz, starts, paths, lengths = _common(starts, paths, lengths)
    if check_values:
        ref.compact_kv_batch(np.zeros((c.shape[0], 0), np.int8), starts.get(), paths.get(), lengths.get())
    if bsz == 0 or c.size == 0:
        return cache
    unit = _unit(c)
    row_units = c.itemsize * (c.size // c.shape[0]) // unit
    fn = loader.get_function(*COMPACT[unit])
    fn(_compact_grid(row_units, bsz), (THREADS,),
       (c, np.int64(c.shape[0]), np.int64(row_units), starts, paths, np.int32(paths.shape[1]), lengths))
    return cache


def remap_slots_masked(
    req_to_token, starts, tree_slots, paths, lengths, *, check_values: bool = False, freed=None
):
    """page_size 1 commit without a host sync: updates req_to_token in place, returns
    freed_mask [B, budget+1] bool (node j's slot is allocated and j is not on the path).

    req_to_token must be int64 or int32 (written in place). Shapes as in `remap_slots`. freed: the
    [B, budget+1] bool buffer to write (CuPy or torch CUDA), None to allocate one.
    """
    import cupy

    r2t = loader.as_cupy(req_to_token)
    if r2t.ndim != 2 or r2t.dtype not in REMAP or not r2t.flags.c_contiguous:
        raise ValueError("req_to_token must be a C-contiguous int64 or int32 array [B, max_ctx], got "
                         f"{r2t.dtype} {r2t.shape}")
    bsz, starts, paths, lengths = _common(starts, paths, lengths)
    slots = loader.int_array(tree_slots, "tree_slots", "int64", ndim=2)
    if r2t.shape[0] != bsz or slots.shape[0] != bsz:
        raise ValueError("req_to_token, starts, tree_slots, paths and lengths disagree on B")
    width = slots.shape[1]
    if check_values:
        # a stand-in table of the caller's dtype: the reference refuses slots that dtype would wrap
        ref.remap_slots(np.zeros(r2t.shape, r2t.dtype), starts.get(), slots.get(), paths.get(), lengths.get())
    if freed is None:
        freed = cupy.empty((bsz, width), dtype=cupy.bool_)  # [B, budget+1]
    freed = loader.as_cupy(freed)  # a torch bool tensor as a CuPy bool view
    if freed.shape != (bsz, width) or freed.dtype != np.bool_ or not freed.flags.c_contiguous:
        raise ValueError(f"freed must be a C-contiguous bool array of shape {(bsz, width)}")
    if bsz == 0:
        return freed
    fn = loader.get_function(*REMAP[r2t.dtype])
    fn((bsz,), (THREADS,),
       (r2t, np.int64(r2t.shape[1]), starts, slots, np.int32(width), paths, np.int32(paths.shape[1]), lengths,
        freed),
       shared_mem=width)
    return freed


def remap_slots(req_to_token, starts, tree_slots, paths, lengths, *, check_values: bool = False):
    """page_size 1 commit (see `kdlib.ref.compact.remap_slots`): req_to_token updated in place;
    returns freed_slots [k] (dtype of tree_slots): allocated slots of rejected nodes, in request
    order then node order. The compaction to [k] synchronises with the host.
    """
    slots = loader.as_cupy(tree_slots)
    freed = remap_slots_masked(req_to_token, starts, tree_slots, paths, lengths, check_values=check_values)
    return slots[freed].astype(slots.dtype, copy=False)


def compact_kv(cache, start: int, path, *, check_values: bool = False):
    """One request's compaction in place (see `kdlib.ref.compact.compact_kv`): a batch of one.

    Shape: cache [S, D...], path [len] int. Returns cache.
    """
    import numbers

    import cupy

    if isinstance(start, bool) or not isinstance(start, numbers.Integral):
        raise ValueError(f"start must be an int, got {type(start).__name__}")
    p = loader.int_array(path, "path", "int64", ndim=1)
    return compact_kv_batch(cache, cupy.full(1, int(start), dtype=cupy.int64), p[None],
                            cupy.full(1, p.shape[0], dtype=cupy.int64), check_values=check_values)
