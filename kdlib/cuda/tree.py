"""GPU DDTree builder: `build_tree_batch`, the CUDA twin of `kdlib.ref.tree.build_tree_batch`.

Kernels, one thread block per request (`launch(budget, version).threads`: 128, or 256 for v4),
bit-exact with the reference (same float64 arithmetic order, same rank-tuple tie-break), padding
included; `version=None` (the default) runs `DEFAULT_VERSION` = 4:
  * `tree_build_v4_r{1,2,4}` (`version=4`, the default): the frontier kept sorted across warp 0's
    lanes, so a pop needs no argmax reduction: both new candidates are placed by two ballots and
    one per-lane shuffle; only the best (budget - pops done) candidates are kept, at most
    floor((budget + 1) / 2), so one row of 32 lanes up to budget 64, two up to 128, four up to
    256; outputs as in v3, visibility written as 4-byte words;
  * `tree_build_v3_r{1,3,9}` (`version=3`): the frontier in warp 0's registers (R rows of 32
    slots, R = 1, 3 or 9 picked from the budget), each slot carrying the log-probs its pop needs;
    tree lists (LCRS, ancestor masks) built by the whole block after the pops;
  * `tree_build_v2_r{1,3,9}` (`version=2`): v3 without the carried log-probs (one shared-memory
    round trip more per pop);
  * `tree_build_v1` (`version=1`): the frontier and the lists in shared memory, inside the loop.
The recorded times (and the CPU reference) are in data/results/kernels.h200.json
(suite `kdlib.perf.suites.kernels`); the default is the version of its headline, the fastest
bit-exact one recorded at batch 64 (tests/test_kernel_constants.py checks the two agree). All are
latency-bound: one warp runs the dependent chain of every pop (v1-v3: an argmax reduction,
shuffles, float64 adds, register updates; v4: float64 adds, ballots, one shuffle, selects), so a
build costs about the same at batch 1 and batch 64. v4 is also checked without a device
(tests/test_cuda_tree.py: a model of its warp loop and its source run on the host).

Limits (ValueError before any launch): budget <= MAX_BUDGET (256), K = min(budget, K') <= 256
(implied), L_eff = min(L, budget) <= MAX_DEPTH (16): trees deeper than 16 would need a wider
rank-tuple key. Larger budgets are refused rather than silently degraded. Dynamic shared memory
per block is `shared_bytes(budget, L_eff, K, version)` (the formulas stated in the .cu files, which
tests/test_kernel_constants.py evaluates against it; at the limits 42,084 B for v1, 39,000 B for v2,
55,384 B for v3, 63,592 B for v4; v3 and v4 opt in above the default 48 KB).

Value checks (finite, descending rows, distinct ids, ids in the vocabulary) need the data on
the host or a device reduction plus a synchronisation, so they run only with
`check_values=True`; the default keeps the call asynchronous and graph-capturable.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from kdlib.cuda import loader
from kdlib.ref.tree import BATCH_FIELDS, POSITIVE_LOG_PROB, DDTreeBatch, capacity

MAX_BUDGET = 256  # rank bytes are 8 bits (ranks < K <= budget) and the meta word holds parents < 2**16
MAX_DEPTH = 16  # 16 rank bytes in the 128-bit rank-tuple key
THREADS = 128  # TB_THREADS / TB2_THREADS / TB3_THREADS in kernels/tree_build/v{1,2,3}.cu
V4_THREADS = 256  # TB4_THREADS in kernels/tree_build/v4.cu
VERSIONS = (1, 2, 3, 4)
DEFAULT_VERSION = 4  # the headline version of data/results/kernels.h200.json: the fastest bit-exact one
V2_ROWS = (1, 3, 9)  # register rows of tree_build_v{2,3}_r{R}: budget + 1 <= 32 R
V4_ROWS = (1, 2, 4)  # frontier rows of tree_build_v4_r{R}: floor((budget + 1) / 2) <= 32 R
V4_TABLE_CELLS = 18 * 256  # LPS_ROWS * LPS_STRIDE in kernels/tree_build/v4.cu (indices by shifts)


@dataclass(frozen=True)
class TreeLaunch:
    """How one version builds trees of one budget: loader stem, kernel name, threads per block."""

    version: int
    stem: str
    kernel: str
    threads: int


def launch(budget: int, version: int | None = None) -> TreeLaunch:
    """The launch settings of `version` (None: DEFAULT_VERSION) at this budget, e.g.
    TreeLaunch(4, "tree_build/v4", "tree_build_v4_r1", 256) at budget 64."""
    budget = _check_budget(budget)
    version = loader.check_version(version, VERSIONS, DEFAULT_VERSION)
    if version == 1:
        return TreeLaunch(1, "tree_build/v1", "tree_build_v1", THREADS)
    if version in (2, 3):
        rows = next(r for r in V2_ROWS if budget + 1 <= 32 * r)
        return TreeLaunch(version, f"tree_build/v{version}", f"tree_build_v{version}_r{rows}", THREADS)
    rows = next(r for r in V4_ROWS if (budget + 1) // 2 <= 32 * r)
    return TreeLaunch(4, "tree_build/v4", f"tree_build_v4_r{rows}", V4_THREADS)


def kernel_name(budget: int, version: int | None = None) -> tuple[str, str]:
    """(stem, kernel name) that builds trees of this budget, e.g. ("tree_build/v4", "tree_build_v4_r4");
    version None: DEFAULT_VERSION."""
    settings = launch(budget, version)
    return settings.stem, settings.kernel


def shared_bytes(budget: int, l_eff: int, k: int, version: int | None = None) -> int:
    """Dynamic shared memory of one block (see the layout comments in tree_build/v{1,2,3,4}.cu);
    version None: DEFAULT_VERSION."""
    budget = _check_budget(budget)
    version = loader.check_version(version, VERSIONS, DEFAULT_VERSION)
    s = budget + 1
    w = (s + 31) // 32
    if version == 1:
        return 64 * s + 4 * s * w + 4 * l_eff * k
    if version == 2:
        return 16 * s + 8 * s * w + 4 * l_eff * k
    if version == 4:
        # v4: fixed table at row stride 256, the nodes' rank tuples
        return 32 * s + 8 * s * w + 8 * V4_TABLE_CELLS
    return 16 * s + 8 * s * w + 8 * l_eff * k  # v3: the log-prob table as float64


def _check_budget(budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise ValueError(f"budget must be an int, got {type(budget).__name__}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if budget > MAX_BUDGET:
        raise ValueError(f"budget {budget} exceeds the GPU builder's limit {MAX_BUDGET} (use kdlib.ref on "
                         "the host)")
    return int(budget)


def _check_values(ids, lp, k: int, vocab_size) -> None:
    """Device reductions over the K columns read, one synchronisation; ValueError like the reference."""
    import cupy

    ids, lp = ids[..., :k], lp[..., :k]
    flags = [
        cupy.isnan(lp).any(),
        ~cupy.isfinite(lp).all(),
        (lp[..., 1:] > lp[..., :-1]).any() if k > 1 else cupy.zeros((), bool),
        (lp[..., :1] > 0).any(),
        (ids < 0).any(),
        (ids >= vocab_size).any() if vocab_size is not None else cupy.zeros((), bool),
    ]
    if k > 1:
        s = cupy.sort(ids, axis=-1)
        flags.append((s[..., 1:] == s[..., :-1]).any())
    else:
        flags.append(cupy.zeros((), bool))
    nan, nonfinite, unsorted, positive, negative, oov, repeated = cupy.stack(flags).get().tolist()
    if nan:
        raise ValueError("top_log_probs contains NaN")
    if nonfinite:
        raise ValueError("top_log_probs must be finite (±inf makes sibling scores NaN)")
    if unsorted:
        raise ValueError("top_log_probs rows are not sorted in descending order")
    if positive:
        raise ValueError(POSITIVE_LOG_PROB)
    if negative:
        raise ValueError("top_token_ids contains negative token ids")
    if oov:
        raise ValueError(f"top_token_ids contains token ids outside [0, {vocab_size})")
    if repeated:
        raise ValueError("top_token_ids repeats a token within one row (siblings must be distinct)")


def empty_batch(bsz: int, budget: int) -> DDTreeBatch:
    """Output buffers for `build_tree_batch(..., out=)` (e.g. fixed addresses for a CUDA graph)."""
    import cupy

    s = budget + 1
    return DDTreeBatch(
        sizes=cupy.empty(bsz, dtype=cupy.int64),  # [B]
        node_token_ids=cupy.empty((bsz, budget), dtype=cupy.int64),  # [B, budget]
        node_depths=cupy.empty((bsz, budget), dtype=cupy.int64),  # [B, budget]
        parents=cupy.empty((bsz, s), dtype=cupy.int64),  # [B, budget+1]
        visibility=cupy.empty((bsz, s, s), dtype=cupy.bool_),  # [B, budget+1, budget+1]
        next_token=cupy.empty((bsz, s), dtype=cupy.int64),  # [B, budget+1]
        next_sibling=cupy.empty((bsz, s), dtype=cupy.int64),  # [B, budget+1]
        positions=cupy.empty((bsz, s), dtype=cupy.int64),  # [B, budget+1]
        scores=cupy.empty((bsz, budget), dtype=cupy.float64),  # [B, budget]
    )


def _check_out(out, bsz: int, budget: int) -> DDTreeBatch:
    """`out`'s fields as CuPy arrays (torch CUDA tensors by DLPack, no copy), checked against
    `empty_batch(bsz, budget)`'s."""
    if not isinstance(out, DDTreeBatch):
        raise ValueError(f"out must be a DDTreeBatch, got {type(out).__name__}")
    ref = empty_batch(0, budget)
    fields = {}
    for name in BATCH_FIELDS:
        a, r = loader.as_cupy(getattr(out, name)), getattr(ref, name)
        want = (bsz,) + r.shape[1:]
        if a.shape != want or a.dtype != r.dtype or not a.flags.c_contiguous:
            raise ValueError(f"out.{name} must be a C-contiguous {r.dtype} array of shape {want}, got "
                             f"{a.dtype} {a.shape}")
        fields[name] = a
    return DDTreeBatch(**fields)


def build_tree_batch(
    top_token_ids,
    top_log_probs,
    budget: int,
    vocab_size: int | None = None,
    *,
    check_values: bool = False,
    out=None,
    version: int | None = None,
) -> DDTreeBatch:
    """Build B DDTrees on the GPU, padded to budget + 1 slots (see `kdlib.ref.tree.DDTreeBatch`).

    Shape: top_token_ids [B, L, K'] int64, top_log_probs [B, L, K'] float32 (CuPy arrays or
    torch CUDA tensors); rows sorted descending, finite. Returns a DDTreeBatch of CuPy arrays,
    bit-identical to `kdlib.ref.tree.build_tree_batch` on the same inputs.
    check_values: also run the reference's value checks on the device (one host sync).
    out: an `empty_batch(B, budget)` to write into (no allocation; graph capture).
    version: the kernel version, one of VERSIONS (None: DEFAULT_VERSION, v4); all give identical results.
    """
    budget = _check_budget(budget)
    settings = launch(budget, version)
    ids = loader.as_cupy(top_token_ids)
    lp = loader.as_cupy(top_log_probs)
    for name, a, dtype in (("top_token_ids", ids, np.int64), ("top_log_probs", lp, np.float32)):
        if a.ndim != 3:
            raise ValueError(f"{name} must have shape [B, L, K'], got shape {a.shape}")
        if a.dtype != dtype:
            raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if ids.shape != lp.shape:
        raise ValueError(f"top_token_ids {ids.shape} and top_log_probs {lp.shape} differ in shape")
    if ids.device.id != lp.device.id:
        raise ValueError("top_token_ids and top_log_probs are on different devices")
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size <= 0
    ):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    bsz, depth, kp = ids.shape
    k = min(budget, kp)
    l_eff = min(depth, budget)
    if l_eff > MAX_DEPTH:
        raise ValueError(f"min(L, budget) = {l_eff} exceeds the GPU builder's depth limit {MAX_DEPTH}")
    if bsz >= 2**31:
        raise ValueError(f"batch {bsz} exceeds the grid limit")
    if check_values:
        _check_values(ids, lp, k, vocab_size)
    if out is None:
        out = empty_batch(bsz, budget)
    else:
        out = _check_out(out, bsz, budget)
    if bsz == 0:
        return out
    import cupy

    ids = cupy.ascontiguousarray(ids)
    lp = cupy.ascontiguousarray(lp)
    fn = loader.get_function(settings.stem, settings.kernel)
    smem = shared_bytes(budget, l_eff, k, settings.version)
    loader.set_max_dynamic_shared(fn, smem)
    i32 = np.int32
    fn(
        (bsz,), (settings.threads,),
        (ids, lp, i32(depth), i32(kp), i32(k), i32(l_eff), i32(budget),
         out.sizes, out.node_token_ids, out.node_depths, out.parents, out.visibility,
         out.next_token, out.next_sibling, out.positions, out.scores),
        shared_mem=smem,
    )
    return out


def build_tree(
    top_token_ids, top_log_probs, budget: int, vocab_size: int | None = None, *, check_values: bool = False
):
    """One request's DDTree on the GPU (see `kdlib.ref.tree.build_tree`): a batch of one, unpadded.

    Shape: top_token_ids [L, K'] int64, top_log_probs [L, K'] float32. Returns a DDTree of CuPy
    views; reading the tree size synchronises with the host once. As in the reference, a budget
    past the tree's capacity (sum_d K^d nodes) builds the whole tree: the limit MAX_BUDGET applies
    to min(budget, capacity).
    """
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    ids, lp = loader.as_cupy(top_token_ids), loader.as_cupy(top_log_probs)
    for name, a in (("top_token_ids", ids), ("top_log_probs", lp)):
        if a.ndim != 2:
            raise ValueError(f"{name} must have shape [L, K'], got shape {a.shape}")
    depth, kp = ids.shape
    built = capacity(depth, min(int(budget), kp), int(budget))  # K = min(budget, K') and min(L, budget) stay
    batch = build_tree_batch(ids[None], lp[None], built, vocab_size, check_values=check_values)
    return batch.tree(0)
