"""GPU acceptance: `accept_greedy_batch`, `sample_tokens`, `accept_sample_batch`, the CUDA twins of
`kdlib.ref.accept` (same names, same signatures, CuPy arrays in and out).

Kernels: `tree_accept_greedy_v1` (`kernels/tree_accept/greedy_v1.cu`), one block per request, stages
the LCRS lists in shared memory and walks them with one thread. The inverse-CDF draw
`tree_sample_rows_v<N>_f32/_f64`, bit-exact with `kdlib.ref.accept.sample_tokens` in the order
`SAMPLE_ORDER[N]`; `version=None` (the default) runs `DEFAULT_VERSION` = 3, and `sample_launch`
gives each version's launch settings:
  * v3 (`kernels/tree_accept/sample_v3.cu`, the default): one block of `ref.accept.SAMPLE_THREADS` threads
    per row, the "blocked" order; the thread and piece counts reach the compiler as -D options
    from `kdlib.ref.accept`, so kernel and reference share one definition;
  * v2 (`tree_accept/sample_v2.cu`) and v1 (`tree_accept/sample_v1.cu`): one thread per row, the "sequential"
    order (the whole vocabulary through one dependent chain: slow at large V).

Differences from the reference, all forced by not synchronising with the host:
  * a path longer than `max_depth + 1` is truncated in `paths`, and `lengths[b]` keeps its true
    length (> max_depth + 1 marks the case the reference raises ValueError for);
  * value checks (uniforms in [0, 1), probs finite and non-negative, positive row sums) run only
    with `check_values=True` (one host sync); shapes, dtypes and limits are always checked.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from kdlib.cuda import loader
from kdlib.ref import accept as ref_accept
from kdlib.ref.tree import DDTree, DDTreeBatch

GREEDY = ("tree_accept/greedy_v1", "tree_accept_greedy_v1")  # (stem, kernel name)
# v3: a block per row; v2: one thread per row, pipelined loads; v1: one load per add
VERSIONS = SAMPLE_VERSIONS = (1, 2, 3)  # of the draw; the greedy walk has one version
DEFAULT_VERSION = SAMPLE_DEFAULT = 3
SAMPLE_ORDER = {1: "sequential", 2: "sequential", 3: "blocked"}  # the kdlib.ref.accept order each one matches
GREEDY_THREADS = 64  # TA_THREADS in tree_accept/greedy_v1.cu
ROW_THREADS = 128  # threads per block of v1/v2 (their launch bound), one row each
MAX_VOCAB = 1 << 30  # v3 indexes a row with 32-bit offsets


@dataclass(frozen=True)
class SampleLaunch:
    """How one version of the draw runs: its loader stem, threads per block, rows per block, and the
    compiler options (v3's thread and piece counts, taken from kdlib.ref.accept)."""

    version: int
    stem: str
    threads: int
    rows_per_block: int
    options: tuple[str, ...]


def sample_launch(version: int | None = None) -> SampleLaunch:
    """The launch settings of sampling `version` (None: DEFAULT_VERSION)."""
    version = loader.check_version(version, VERSIONS, DEFAULT_VERSION)
    if version == 3:  # one block per row
        options = (f"-DTA3_THREADS={ref_accept.SAMPLE_THREADS}", f"-DTA3_PIECE={ref_accept.SAMPLE_PIECE}")
        return SampleLaunch(3, "tree_accept/sample_v3", ref_accept.SAMPLE_THREADS, 1, options)
    return SampleLaunch(version, f"tree_accept/sample_v{version}", ROW_THREADS, ROW_THREADS, ())


def sample_kernel(dtype, version: int | None = None) -> tuple[str, str]:
    """(stem, kernel name) of the inverse-CDF draw for probs of this dtype, e.g.
    ("tree_accept/sample_v3", "tree_sample_rows_v3_f32"); version None: DEFAULT_VERSION."""
    settings = sample_launch(version)
    suffix = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}.get(np.dtype(dtype))
    if suffix is None:
        raise ValueError(f"probs must be float32 or float64, got {np.dtype(dtype)}")
    return settings.stem, f"tree_sample_rows_v{settings.version}_{suffix}"


def version_for_order(order: str | None, version: int | None = None) -> int | None:
    """The draw version that runs for the reference's `order=` and/or `version=`.

    order None leaves version as given; otherwise the default version of that order: "blocked" -> 3,
    "sequential" -> 2 (v1 and v2 give the same bits; v2 pipelines its loads). A version whose order is
    not `order` is a ValueError.
    """
    if order is None:
        return version
    if order not in ref_accept.SAMPLE_ORDERS:
        raise ValueError(f"order must be one of {ref_accept.SAMPLE_ORDERS}, got {order!r}")
    if version is None:
        return 3 if order == "blocked" else 2
    version = loader.check_version(version, VERSIONS, DEFAULT_VERSION)
    if SAMPLE_ORDER[version] != order:
        raise ValueError(f"sampling version {version} draws in the {SAMPLE_ORDER[version]!r} order, "
                         f"not {order!r}")
    return version


def sample_options(version: int | None = None) -> tuple[str, ...]:
    """Compiler options of the draw (`sample_launch(version).options`)."""
    return sample_launch(version).options


def _batch(trees):
    if not isinstance(trees, DDTreeBatch):
        raise ValueError(f"trees must be a DDTreeBatch, got {type(trees).__name__}")
    fields = {}
    for name in ("sizes", "node_token_ids", "next_token", "next_sibling"):
        a = loader.as_cupy(getattr(trees, name))
        if a.dtype != np.int64:
            raise ValueError(f"trees.{name} must be int64, got {a.dtype}")
        fields[name] = a
    bsz, budget = fields["node_token_ids"].shape if fields["node_token_ids"].ndim == 2 else (None, None)
    if bsz is None or fields["sizes"].shape != (bsz,) or fields["next_token"].shape != (bsz, budget + 1) \
            or fields["next_sibling"].shape != (bsz, budget + 1):
        raise ValueError(
            "trees must be a padded batch: sizes [B], node_token_ids [B, budget], next_token/next_sibling "
            f"[B, budget+1]; got {[tuple(a.shape) for a in fields.values()]}"
        )
    return bsz, budget, fields


def _width(budget: int, max_depth) -> int:
    if max_depth is None:
        return budget + 1
    if isinstance(max_depth, bool) or not isinstance(max_depth, numbers.Integral) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0 or None, got {max_depth!r}")
    return int(max_depth) + 1


def _out_arrays(out, bsz, width):
    import cupy

    if out is None:
        return (cupy.empty((bsz, width), dtype=cupy.int64),  # paths [B, max_depth+1]
                cupy.empty(bsz, dtype=cupy.int64),  # lengths [B]
                cupy.empty(bsz, dtype=cupy.int64))  # bonus [B]
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise ValueError("out must be a (paths, lengths, bonus) tuple")
    checked = []
    shapes = ((bsz, width), (bsz,), (bsz,))
    for name, a, shape in zip(("paths", "lengths", "bonus"), out, shapes, strict=True):
        a = loader.as_cupy(a)  # torch CUDA tensors by DLPack: the kernel writes the caller's memory
        if a.shape != shape or a.dtype != np.int64 or not a.flags.c_contiguous:
            raise ValueError(f"out {name} must be a C-contiguous int64 array of shape {shape}")
        checked.append(a)
    return tuple(checked)


def accept_greedy_batch(trees, target_tokens, max_depth: int | None = None, *, out=None):
    """Greedy walk of every tree of a batch on the GPU (see `kdlib.ref.accept.accept_greedy_batch`).

    Shape: target_tokens [B, budget+1] int (slots >= sizes[b] never read).
    Returns paths [B, max_depth+1] int64 padded -1, lengths [B] int64, bonus [B] int64.
    out: optional (paths, lengths, bonus) buffers to write into (graph capture).
    """
    bsz, budget, f = _batch(trees)
    target = loader.int_array(target_tokens, "target_tokens", "int64", shape=(bsz, budget + 1))
    width = _width(budget, max_depth)
    paths, lengths, bonus = _out_arrays(out, bsz, width)
    if bsz == 0:
        return paths, lengths, bonus
    import cupy

    s = budget + 1
    fn = loader.get_function(*GREEDY)
    smem = 40 * s  # five int64 arrays of S entries (see tree_accept/greedy_v1.cu)
    loader.set_max_dynamic_shared(fn, smem)
    fn((bsz,), (GREEDY_THREADS,),
       (cupy.ascontiguousarray(f["node_token_ids"]), cupy.ascontiguousarray(f["next_token"]),
        cupy.ascontiguousarray(f["next_sibling"]), cupy.ascontiguousarray(f["sizes"]), target,
        np.int32(s), np.int32(width), paths, lengths, bonus),
       shared_mem=smem)
    return paths, lengths, bonus


def _check_sample_values(probs, uniforms) -> None:
    import cupy

    flags = cupy.stack([
        ~cupy.isfinite(probs).all(),
        (probs < 0).any(),
        ~((uniforms >= 0) & (uniforms < 1)).all(),
        (probs.astype(cupy.float64).sum(axis=-1) <= 0).any() if probs.size else cupy.zeros((), bool),
    ]).get().tolist()
    for bad, msg in zip(flags, ("probs contains NaN or infinite values", "probs contains negative values",
                                "uniforms must lie in [0, 1)", "a probs row sums to zero"), strict=True):
        if bad:
            raise ValueError(msg)


def _sample_launch(probs, uniforms, sizes, rows_per_req: int, tokens, version: int | None) -> None:
    settings = sample_launch(version)
    version = settings.version
    n, v = probs.shape[0] * (probs.shape[1] if probs.ndim == 3 else 1), probs.shape[-1]
    if version == 3 and v > MAX_VOCAB:
        raise ValueError(f"sampling version 3 takes a vocabulary of at most {MAX_VOCAB}, got {v}")
    if n == 0:
        return
    fn = loader.get_function(*sample_kernel(probs.dtype, version), options=settings.options)
    sizes_arg = sizes if sizes is not None else np.uint64(0)
    grid = (-(-n // settings.rows_per_block),)
    if version == 3:
        fn(grid, (settings.threads,),
           (probs, uniforms, sizes_arg, np.int64(rows_per_req), np.int64(v), tokens))
        return
    fn(grid, (settings.threads,),
       (probs, uniforms, sizes_arg, np.int64(rows_per_req), np.int64(n), np.int64(v), tokens))


def _check_probs(probs, ndim: int):
    import cupy

    probs = loader.as_cupy(probs)
    if probs.ndim != ndim:
        raise ValueError(f"probs must have {ndim} dimensions, got shape {probs.shape}")
    if probs.dtype not in (np.float32, np.float64):
        raise ValueError(f"probs must be float32 or float64, got {probs.dtype}")
    if probs.shape[-1] == 0 and probs.size == 0 and int(np.prod(probs.shape[:-1])) > 0:
        raise ValueError("probs has an empty vocabulary axis")
    return cupy.ascontiguousarray(probs)


def _check_uniforms(uniforms, shape):
    import cupy

    uniforms = loader.as_cupy(uniforms)
    if uniforms.dtype != np.float64 or uniforms.shape != shape:
        raise ValueError(f"uniforms must be a float64 array of shape {shape}, got {uniforms.dtype} "
                         f"{uniforms.shape}")
    return cupy.ascontiguousarray(uniforms)


def sample_tokens(probs, uniforms, *, order: str | None = None, check_values: bool = False, out=None,
                  version: int | None = None):
    """Inverse-CDF draw per row, bit-exact with `kdlib.ref.accept.sample_tokens(probs, uniforms,
    order=SAMPLE_ORDER[version])` (version None: DEFAULT_VERSION, v3, the reference's default order;
    order given: `version_for_order(order, version)`).

    Shape: probs [N, V] float32/float64, uniforms [N] float64 in [0, 1). Returns tokens [N] int64
    (out: an int64 [N] buffer to write into). Without check_values, a row with no positive entry
    gets -1 from v3 (V from v1/v2).
    """
    import cupy

    probs = _check_probs(probs, 2)
    uniforms = _check_uniforms(uniforms, probs.shape[:1])
    if check_values:
        _check_sample_values(probs, uniforms)
    tokens = cupy.empty(probs.shape[0], dtype=cupy.int64) if out is None else loader.as_cupy(out)  # [N]
    if tokens.shape != probs.shape[:1] or tokens.dtype != np.int64 or not tokens.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous int64 array of shape {probs.shape[:1]}")
    _sample_launch(probs, uniforms, None, 1, tokens, version_for_order(order, version))
    return tokens


def accept_sample_batch(
    trees,
    probs,
    uniforms,
    max_depth: int | None = None,
    *,
    order: str | None = None,
    check_values: bool = False,
    out=None,
    targets=None,
    version: int | None = None,
):
    """Sample-and-walk over a batch on the GPU (see `kdlib.ref.accept.accept_sample_batch`, whose
    `order=SAMPLE_ORDER[version]` it matches bit for bit; version None: DEFAULT_VERSION; order given:
    `version_for_order(order, version)`).

    Shape: probs [B, budget+1, V] float32/float64, uniforms [B, budget+1] float64; rows >= sizes[b]
    are never read. Returns paths [B, max_depth+1] int64 padded -1, lengths [B], bonus [B].
    out: (paths, lengths, bonus) buffers; targets: an int64 [B, budget+1] buffer for the drawn
    tokens (-1 past sizes[b]). With both and check_values=False nothing is allocated and nothing
    synchronises (graph capture).
    """
    import cupy

    version = version_for_order(order, version)
    bsz, budget, f = _batch(trees)
    probs = _check_probs(probs, 3)
    if probs.shape[:2] != (bsz, budget + 1):
        raise ValueError(f"probs must have shape [{bsz}, {budget + 1}, V], got {probs.shape}")
    uniforms = _check_uniforms(uniforms, (bsz, budget + 1))
    if check_values:
        sizes = f["sizes"].get()
        rows = np.arange(budget + 1)[None, :] < sizes[:, None]
        mask = cupy.asarray(rows)
        _check_sample_values(probs[mask], uniforms[mask])
    if targets is None:
        targets = cupy.empty((bsz, budget + 1), dtype=cupy.int64)  # [B, budget+1]
    elif ((targets := loader.as_cupy(targets)).shape != (bsz, budget + 1) or targets.dtype != np.int64
          or not targets.flags.c_contiguous):
        raise ValueError(f"targets must be a C-contiguous int64 array of shape {(bsz, budget + 1)}")
    _sample_launch(probs, uniforms, cupy.ascontiguousarray(f["sizes"]), budget + 1, targets, version)
    return accept_greedy_batch(trees, targets, max_depth=max_depth, out=out)


def _single(tree):
    if not isinstance(tree, DDTree):
        raise ValueError(f"tree must be a DDTree, got {type(tree).__name__}")
    import cupy

    tok = loader.as_cupy(tree.node_token_ids)
    n = int(tok.shape[0])
    return DDTreeBatch(
        sizes=cupy.full(1, n + 1, dtype=cupy.int64), node_token_ids=tok[None],
        node_depths=loader.as_cupy(tree.node_depths)[None], parents=loader.as_cupy(tree.parents)[None],
        visibility=loader.as_cupy(tree.visibility)[None], next_token=loader.as_cupy(tree.next_token)[None],
        next_sibling=loader.as_cupy(tree.next_sibling)[None], positions=loader.as_cupy(tree.positions)[None],
        scores=loader.as_cupy(tree.scores)[None])


def accept_greedy(tree, target_tokens):
    """Greedy walk of one tree (see `kdlib.ref.accept.accept_greedy`).

    Shape: target_tokens [n+1] int. Returns (path [tau] int64 CuPy, bonus int); synchronises once.
    """
    batch = _single(tree)
    tgt = loader.as_cupy(target_tokens)
    if tgt.shape != (batch.budget + 1,):
        raise ValueError(f"target_tokens must have shape {(batch.budget + 1,)}, got {tgt.shape}")
    paths, lengths, bonus = accept_greedy_batch(batch, tgt[None])
    return paths[0, : int(lengths[0])], int(bonus[0])


def accept_sample(tree, probs, uniforms, *, order: str | None = None, check_values: bool = False):
    """Sample-and-walk of one tree (see `kdlib.ref.accept.accept_sample`; order as there, None: the
    default version's; check_values as in `accept_sample_batch`).

    Shape: probs [n+1, V] float32/float64, uniforms [n+1] float64. Returns (path [tau], bonus int).
    """
    batch = _single(tree)
    s = batch.budget + 1
    probs, uniforms = loader.as_cupy(probs), loader.as_cupy(uniforms)
    if probs.ndim != 2 or probs.shape[0] != s:
        raise ValueError(f"probs must have shape [{s}, V], got {probs.shape}")
    if uniforms.shape != (s,):
        raise ValueError(f"uniforms must have shape {(s,)}, got {uniforms.shape}")
    paths, lengths, bonus = accept_sample_batch(batch, probs[None], uniforms[None], order=order,
                                                check_values=check_values)
    return paths[0, : int(lengths[0])], int(bonus[0])
