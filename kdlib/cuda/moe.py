"""W4A16 MoE layer: the numpy reference, the weight packing, and the CuPy wrapper of
`kernels/moe_w4a16/v1.cu`, `v2.cu` and `v3.cu` (same packed layout and routing metadata).

The math (reference and kernel alike), for an expert with gate/up weights Wg, Wu [N, K] and down
weights Wd [K, N], all INT4 with one bf16 scale per 32 consecutive reduction elements:

    q = clip(rint(w / s), -8, 7) + 8,   s = bf16(max|w| over the group / 7)   (symmetric, zero point 8)
    W = bf16((q - 8) * s)                                                       (dequantized weight)
    h = bf16(silu(W_g x) * (W_u x))     y[token] = sum over its top-k slots of weight * (W_d h)

with bf16 activations, fp32 (kernel) or float64 (reference) accumulation, h rounded to bf16 as the
kernel stores it. bf16 values travel as uint16 bit patterns (CuPy has no bf16 dtype; torch bf16
tensors are viewed as int16 at the boundary), so this module needs only numpy on the CPU.

- `quantize_w4`, `dequantize_w4`: the INT4 group quantizer and its inverse (numpy).
- `pack_rows`, `pack_scales`, `pack_moe`: the kernel's register-fragment layout (see the .cu header).
- `moe_w4a16_reference`: the layer in float64 (numpy).
- `prepare_routing`, `moe_w4a16`: the GPU path (CuPy; torch CUDA tensors enter by DLPack);
  `pick_version`, `v3_parts`, `v3_down_batch`: the launch choices it makes, from H200 sweeps.

The reference lives here rather than in `kdlib.ref` because its only twin is this kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kdlib.cuda.loader import (
    aligned16,
    as_cupy,
    check_version,
    device_limits,
    get_function,
    is_torch,
    set_max_dynamic_shared,
)

GROUP = 32          # reduction elements per scale (the kernel reads one scale per lane per chunk)
TILE_ROWS = 16      # mma m16: rows per tile
CHUNK_COLS = 64     # columns per uint4 per lane (4 mma k16 steps)
# Sources (loader stems) and the prefixes of their kernel names.
SOURCE, SOURCE_V2, SOURCE_V3 = "moe_w4a16/v1", "moe_w4a16/v2", "moe_w4a16/v3"
STEM = "moe_w4a16_v1"
STEM_V2 = "moe_w4a16_v2"   # decode-regime kernels (<= 8 slots per expert), same layout
STEM_V3 = "moe_w4a16_v3"   # the decode regime in one launch, same layout
PACKED = ("w1", "s1", "w2", "s2")   # the keys of `pack_moe`'s dict


# ----------------------------------------------------------------------------- bf16 bit helpers
def f32_to_bf16_bits(a) -> np.ndarray:
    """float -> bf16 bit pattern (uint16), round to nearest even (finite inputs)."""
    a = np.asarray(a, dtype=np.float32)
    u = np.ascontiguousarray(a).view(np.uint32).reshape(a.shape)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + rounding) >> 16).astype(np.uint16)


def check_bf16_bits(dtype: str, what: str) -> None:
    """ValueError naming `what` unless `dtype` (a numpy dtype's str, a torch dtype's without "torch.") is
    uint16 or int16, bf16 bit patterns (a cast would truncate float scales to 0): the check of the numpy
    helpers and their torch twins (kdlib.engine.int4)."""
    if dtype not in ("uint16", "int16"):
        raise ValueError(f"{what} must hold bf16 bit patterns (uint16 or int16), got {dtype}")


def _bf16_bits(b, what: str) -> np.ndarray:
    """`b` as uint16 bf16 bit patterns (int16 viewed as uint16), after `check_bf16_bits`."""
    b = np.asarray(b)
    check_bf16_bits(str(b.dtype), what)
    return b.view(np.uint16)


def bf16_bits_to_f32(b) -> np.ndarray:
    """bf16 bit pattern (uint16, or int16) -> float32 (exact)."""
    b = _bf16_bits(b, "bf16_bits_to_f32: b")
    return np.ascontiguousarray(b.astype(np.uint32) << 16).view(np.float32).reshape(b.shape)


def round_bf16(a) -> np.ndarray:
    """float -> the nearest bf16 value, as float32."""
    return bf16_bits_to_f32(f32_to_bf16_bits(a))


# ----------------------------------------------------------------------------- quantizer
def check_w4_shapes(shape: tuple, scales: tuple | None, group: int, what: str) -> None:
    """ValueError unless `shape` ([..., R, C]) has a last axis of whole groups and, given, `scales` is its
    [..., R, C // group]: the checks of the numpy quantizers and their torch twins (kdlib.engine.int4)."""
    if len(shape) < 2 or shape[-1] % group:
        raise ValueError(f"{what}: last axis {shape[-1:]} must be a multiple of the group {group} "
                         f"(shape {shape})")
    if scales is not None and (shape[-1] != scales[-1] * group or shape[:-1] != scales[:-1]):
        raise ValueError(f"{what}: q {shape} and scales {scales} disagree (group {group})")


def quantize_w4(w, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT4 group quantization along the last axis.

    Shape: w [..., R, C] float -> q [..., R, C] uint8 in 0..15 (zero point 8),
    scales [..., R, C // group] uint16 (bf16 bits). An all-zero group gets scale 0 and q = 8.
    """
    w = np.asarray(w, dtype=np.float32)
    check_w4_shapes(tuple(w.shape), None, group, "quantize_w4")
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group, group)
    s = round_bf16(np.abs(g).max(axis=-1) / 7.0)                                  # [..., R, C/group]
    safe = np.where(s > 0, s, 1.0)[..., None]
    q = np.clip(np.rint(g / safe), -8, 7).astype(np.int16) + 8
    q = np.where(s[..., None] > 0, q, 8).astype(np.uint8).reshape(w.shape)
    return q, f32_to_bf16_bits(s)


def dequantize_w4(q, scales, group: int = GROUP) -> np.ndarray:
    """bf16((q - 8) * s) as float32. Shape: q [..., R, C], scales [..., R, C // group] -> [..., R, C]."""
    q = np.asarray(q)
    scales = _bf16_bits(scales, "dequantize_w4: scales")
    check_w4_shapes(tuple(q.shape), tuple(scales.shape), group, "dequantize_w4")
    s = np.repeat(bf16_bits_to_f32(scales), group, axis=-1)
    return round_bf16((q.astype(np.float32) - 8.0) * s)


# ----------------------------------------------------------------------------- packing
def check_tiles(rows: int, cols: int, what: str) -> None:
    """ValueError naming `what` unless rows and columns are whole tiles (TILE_ROWS x CHUNK_COLS): the check
    of the packers and their torch twins (kdlib.engine.int4)."""
    if rows % TILE_ROWS or cols % CHUNK_COLS:
        raise ValueError(f"{what}: rows {rows} must be a multiple of {TILE_ROWS} and columns {cols} of "
                         f"{CHUNK_COLS}")


def check_int4(dtype: str, integer: bool, bounds: tuple[int, int] | None, what: str) -> None:
    """ValueError naming `what` unless q is of an integer dtype (`integer`; `dtype` its name) and its
    (min, max) `bounds` (None: empty) lie in 0..15: the check of `pack_rows` and its torch twin."""
    if not integer:
        raise ValueError(f"{what}: q must hold integers 0..15 (INT4 with zero point 8), got {dtype}")
    if bounds is not None and (bounds[0] < 0 or bounds[1] > 15):
        raise ValueError(f"{what}: q must hold 0..15 (INT4 with zero point 8, as `quantize_w4` returns; "
                         f"add 8 to signed -8..7), got [{bounds[0]}, {bounds[1]}]")


def pack_rows(q) -> np.ndarray:
    """INT4 matrix -> the kernel's fragment layout.

    Shape: q [..., R, C] integers 0..15 -> [..., R/16, C/64, 32 lanes, 4 words] uint32, where word i
    of lane 4g + t holds rows g, g + 8 and columns 16t + 4i + j (j = 0..3) at nibble
    h + 2 (j // 2) + 4 (j % 2) (h = 0 for row g, 1 for row g + 8).
    """
    q = np.asarray(q)
    *lead, R, C = q.shape
    check_tiles(R, C, "pack_rows")
    integer = q.dtype.kind in "iu"
    bounds = (int(q.min()), int(q.max())) if integer and q.size else None
    check_int4(str(q.dtype), integer, bounds, "pack_rows")
    # row = rt*16 + h*8 + g; col = kc*64 + t*16 + i*4 + j
    v = q.astype(np.uint32).reshape(*lead, R // 16, 2, 8, C // 64, 4, 4, 4)
    n = len(lead)
    h_ax, g_ax, kc_ax, t_ax, i_ax, j_ax = (n + 1, n + 2, n + 3, n + 4, n + 5, n + 6)
    # -> [..., rt, kc, g, t, i, h, j]
    v = np.moveaxis(v, (kc_ax, g_ax, t_ax, i_ax, h_ax, j_ax), (n + 1, n + 2, n + 3, n + 4, n + 5, n + 6))
    h = np.arange(2).reshape(2, 1)
    j = np.arange(4).reshape(1, 4)
    shift = (4 * (h + 2 * (j // 2) + 4 * (j % 2))).astype(np.uint32)           # [2, 4]
    words = (v << shift).sum(axis=(-2, -1), dtype=np.uint64).astype(np.uint32)   # [..., rt, kc, g, t, i]
    return np.ascontiguousarray(words.reshape(*lead, R // 16, C // 64, 32, 4))


def pack_scales(scales) -> np.ndarray:
    """Group scales -> per (tile, chunk) 16 uint32 {s[row g] | s[row g + 8] << 16} at index grp * 8 + g.

    Shape: scales [..., R, C/32] uint16 or int16 (bf16 bits) -> [..., R/16, C/64, 16] uint32.
    """
    s = _bf16_bits(scales, "pack_scales: scales")
    *lead, R, G = s.shape
    check_tiles(R, G * GROUP, "pack_scales")
    v = s.astype(np.uint32).reshape(*lead, R // 16, 2, 8, G // 2, 2)   # [.., rt, h, g, kc, grp]
    n = len(lead)
    v = np.moveaxis(v, (n + 3, n + 4, n + 2, n + 1), (n + 1, n + 2, n + 3, n + 4))  # [.., rt, kc, grp, g, h]
    words = v[..., 0] | (v[..., 1] << 16)
    return np.ascontiguousarray(words.reshape(*lead, R // 16, G // 2, 16))


@dataclass(frozen=True)
class MoEWeights:
    """Quantized experts in the canonical (unpacked) form.

    Shape: q_gate, q_up [E, N, K] uint8; s_gate, s_up [E, N, K/32] uint16 (bf16 bits);
    q_down [E, K, N] uint8; s_down [E, K, N/32] uint16.
    """

    q_gate: np.ndarray
    s_gate: np.ndarray
    q_up: np.ndarray
    s_up: np.ndarray
    q_down: np.ndarray
    s_down: np.ndarray

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E experts, K hidden, N expert intermediate)."""
        E, N, K = self.q_gate.shape
        return E, K, N

    @classmethod
    def random(
        cls, n_experts: int, hidden: int, inter: int, *, seed: int = 0, std: float = 0.02
    ) -> MoEWeights:
        """Gaussian weights (std `std`), quantized."""
        rng = np.random.default_rng(seed)
        qg, sg = quantize_w4(rng.normal(0, std, (n_experts, inter, hidden)))
        qu, su = quantize_w4(rng.normal(0, std, (n_experts, inter, hidden)))
        qd, sd = quantize_w4(rng.normal(0, std, (n_experts, hidden, inter)))
        return cls(qg, sg, qu, su, qd, sd)


def pack_moe(w: MoEWeights) -> dict[str, np.ndarray]:
    """The four arrays the kernels read (see the .cu header for the layouts)."""
    E, K, N = w.shape
    check_tiles(N, K, "gate/up")
    check_tiles(K, N, "down")
    w1 = np.stack([pack_rows(w.q_gate), pack_rows(w.q_up)], axis=3)       # [E, N/16, K/64, 2, 32, 4]
    s1 = np.stack([pack_scales(w.s_gate), pack_scales(w.s_up)], axis=3)   # [E, N/16, K/64, 2, 16]
    return {
        "w1": np.ascontiguousarray(w1),
        "s1": np.ascontiguousarray(s1),
        "w2": pack_rows(w.q_down),      # [E, K/16, N/64, 32, 4]
        "s2": pack_scales(w.s_down),    # [E, K/16, N/64, 16]
    }


def packed_bytes_per_expert(hidden: int, inter: int) -> int:
    """INT4 weights + bf16 scales of one expert's gate, up and down matrices."""
    params = 3 * hidden * inter
    return params // 2 + params // GROUP * 2


# ----------------------------------------------------------------------------- reference
def _check_routing(topk_ids, topk_weights, m: int, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(topk_ids)
    wts = np.asarray(topk_weights, dtype=np.float32)
    if ids.ndim != 2 or ids.shape[0] != m or wts.shape != ids.shape:
        raise ValueError(f"topk_ids {ids.shape} and topk_weights {wts.shape} must both be [M={m}, topk]")
    if ids.dtype.kind not in "iu":  # before the int64 cast, which would truncate 0.9 to expert 0
        raise ValueError(f"topk_ids must hold integers, got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= n_experts):
        raise ValueError(f"topk_ids must lie in [0, {n_experts})")
    return ids.astype(np.int64), wts


def moe_w4a16_reference(x_bits, w: MoEWeights, topk_ids, topk_weights) -> np.ndarray:
    """The MoE layer in float64 from the bf16 / INT4 inputs.

    Shape: x_bits [M, K] uint16 (bf16), topk_ids / topk_weights [M, topk] -> y [M, K] float64.
    """
    x_bits = np.asarray(x_bits)
    E, K, N = w.shape
    if x_bits.dtype != np.uint16 or x_bits.ndim != 2 or x_bits.shape[1] != K:
        raise ValueError(f"x_bits must be uint16 (bf16 bits) [M, {K}], got {x_bits.dtype} {x_bits.shape}")
    ids, wts = _check_routing(topk_ids, topk_weights, x_bits.shape[0], E)
    x = bf16_bits_to_f32(x_bits).astype(np.float64)
    y = np.zeros((x.shape[0], K), dtype=np.float64)
    for e in np.unique(ids):
        rows, cols = np.nonzero(ids == e)
        xe = x[rows]                                                      # [n_e, K]
        g = xe @ dequantize_w4(w.q_gate[e], w.s_gate[e]).astype(np.float64).T
        u = xe @ dequantize_w4(w.q_up[e], w.s_up[e]).astype(np.float64).T
        h = round_bf16(g / (1.0 + np.exp(-g)) * u).astype(np.float64)    # [n_e, N], stored as bf16
        d = h @ dequantize_w4(w.q_down[e], w.s_down[e]).astype(np.float64).T
        np.add.at(y, rows, wts[rows, cols, None].astype(np.float64) * d)
    return y


def layer_bytes_flops(m: int, touched_experts: int, hidden: int, inter: int, topk: int) -> dict:
    """Bytes the kernel must move and useful FLOPs of one layer call.

    bytes = touched experts' INT4 weights + scales, x in (bf16), h out and in (bf16), y (fp32, one
    read-modify-write per slot's contribution counted once); flops = 2 * M * topk * 3 * K * N.
    """
    weight = touched_experts * packed_bytes_per_expert(hidden, inter)
    act = m * hidden * 2 + 2 * m * topk * inter * 2 + m * hidden * 4
    return {"weight_bytes": weight, "bytes": weight + act, "flops": 2.0 * m * topk * 3 * hidden * inter}


# ----------------------------------------------------------------------------- GPU path
@dataclass
class Routing:
    """Device routing metadata (see the .cu header). Host ints: m, topk, n_active, max_count."""

    expert_offsets: object
    active_experts: object
    n_active_dev: object
    active_ranges: object
    sorted_token: object
    sorted_weight: object
    m: int
    topk: int
    n_experts: int
    n_active: int
    max_count: int


def prepare_routing(topk_ids, topk_weights, n_experts: int) -> Routing:
    """Sort the (token, expert) slots by expert on the device. Synchronises with the host several times
    (the id range check, CuPy's bincount and nonzero, the largest count), so it runs outside graph capture.

    Shape: topk_ids [M, topk] int, topk_weights [M, topk] float (CuPy or torch CUDA).
    """
    import cupy as cp

    ids = as_cupy(topk_ids)
    wts = as_cupy(topk_weights)
    if ids.ndim != 2 or wts.shape != ids.shape:
        raise ValueError(f"topk_ids {ids.shape} and topk_weights {wts.shape} must both be [M, topk]")
    m, topk = ids.shape
    if m == 0:
        raise ValueError("prepare_routing: M must be >= 1")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"topk_ids must hold integers, got {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())  # before the int32 cast, which would wrap 2**32 + 3 to 3
    if lo < 0 or hi >= n_experts:
        raise ValueError(f"topk_ids must lie in [0, {n_experts}), got [{lo}, {hi}]")
    flat = ids.reshape(-1).astype(cp.int32)
    order = cp.argsort(flat)                      # slots grouped by expert
    counts = cp.bincount(flat, minlength=n_experts).astype(cp.int32)
    offsets = cp.zeros(n_experts + 1, dtype=cp.int32)
    offsets[1:] = cp.cumsum(counts)
    active = cp.nonzero(counts)[0].astype(cp.int32)
    n_active = int(active.size)
    active_pad = cp.zeros(n_experts, dtype=cp.int32)
    active_pad[:n_active] = active
    ranges = cp.zeros((n_experts, 2), dtype=cp.int32)       # [E, 2]: slot range of active expert a
    ranges[:n_active, 0] = offsets[active]
    ranges[:n_active, 1] = offsets[active + 1]
    return Routing(
        expert_offsets=offsets,
        active_experts=active_pad,
        n_active_dev=cp.asarray([n_active], dtype=cp.int32),
        active_ranges=ranges,
        sorted_token=(order // topk).astype(cp.int32),
        sorted_weight=wts.reshape(-1)[order].astype(cp.float32),
        m=m, topk=topk, n_experts=n_experts, n_active=n_active, max_count=int(counts.max()),
    )


def _bf16_bits_cupy(x, name: str):
    """A uint16 CuPy view of bf16 data (torch bf16 tensor or CuPy uint16 array)."""
    import cupy as cp

    if is_torch(x):
        import torch

        if x.dtype != torch.bfloat16:
            raise ValueError(f"{name}: expected a torch.bfloat16 tensor, got {x.dtype}")
        x = x.contiguous().view(torch.int16)
        return as_cupy(x).view(cp.uint16)
    x = as_cupy(x)
    if x.dtype != cp.uint16:
        raise ValueError(f"{name}: expected uint16 bf16 bits, got {x.dtype}")
    return cp.ascontiguousarray(x)


def upload(packed: dict) -> dict:
    """Packed numpy arrays -> contiguous CuPy arrays (same keys)."""
    import cupy as cp

    return {k: cp.ascontiguousarray(cp.asarray(v)) for k, v in packed.items()}


def _check(sync: bool, what: str) -> None:
    """Surface an asynchronous launch failure right after the launch when `sync` (tests, first call)."""
    if sync:
        import cupy as cp

        try:
            cp.cuda.runtime.deviceSynchronize()
        except cp.cuda.runtime.CUDARuntimeError as err:
            raise RuntimeError(f"{STEM}: {what} failed: {err}") from err


# warps -> (threads, ring stages, __launch_bounds__ min blocks), as instantiated in moe_w4a16/v2.cu
_V2_GATE_UP = {16: (512, 5, 1), 8: (256, 4, 2)}
_V2_DOWN = (512, 8)                         # kDownWarps * 32 threads, kDownStages
_V2_STAGE_BYTES_GATE_UP = 32 * (4 * 16 + 2 * 4)   # per warp and stage: 4 uint4 + 2 words per lane
_V2_STAGE_BYTES_DOWN = 32 * (16 + 4)              # per warp and stage: 1 uint4 + 1 word per lane
_V2_RED_BYTES_PER_WARP = 2 * 8 * 32 * 4           # static red[2][WARPS][8][32] floats (gate/up only)
_V2_MAX_SLOTS = 8                                  # tokens per expert the v2 kernels take in one pass
_V2_MAX_N = 256                                    # kDownMaxChunks * 64: h rows held in registers
_V1_THREADS = 256                                  # kThreads in moe_w4a16/v1.cu (the n8 gate/up: 32 x warps)
_V1_DOWN_TILES_PER_BLOCK = 16                      # kWarps * kDownTilesPerWarp
_V3_THREADS = 256                                  # kWarps * 32 in moe_w4a16/v3.cu
_V3_MIN_BLOCKS = 2                                 # __launch_bounds__(kWarps * 32, 2): resident blocks per SM
_V3_STAGES = 4                                     # moe_v3_body<4>: ring stages per warp
_V3_STAGE_BYTES = 2560                             # kStageVec * 16
_V3_DYN_SMEM = _V3_STAGES * _V3_THREADS // 32 * _V3_STAGE_BYTES   # 80 KB
_V3_STATIC_SMEM = 0
_V3_LINE = 32                                      # ints per 128-byte line (kLine)
_V3_MIN_CHUNKS = 8                                 # chunks per gate/up item at least (the ring needs 3)
# Item ids, routing reads and the hand-off of a split item cost each item a few microseconds of
# latency: on the H200 (moe_stream.h200.json, v3_parts) v3 was fastest with the fewest parts giving
# ~1.3 items per warp, and fastest with >= 8 chunks an item; below ~0.35 tile pairs per resident
# warp (M <= 4 tokens of Kimi-K2 top-8) v2 was faster than v3 at any split.
_V3_ITEMS_PER_WARP = 1.3
_V3_MIN_PAIRS_PER_WARP = 0.35
_V3_WORKSPACE: dict[tuple, tuple] = {}


def v2_gate_up_shape(warps: int, limits: dict) -> dict:
    """The v2 gate/up block with `warps` warps on a device with `limits` (see `device_limits`):
    threads, dynamic shared memory, resident blocks per SM (0 = does not fit)."""
    threads, stages, by_bounds = _V2_GATE_UP[warps]
    dyn = warps * stages * _V2_STAGE_BYTES_GATE_UP
    static = warps * _V2_RED_BYTES_PER_WARP
    per_block = dyn + static + limits["smem_reserved"]
    fits = dyn + static <= limits["smem_block"]
    by_smem = limits["smem_sm"] // per_block if limits["smem_sm"] else 1
    return {"threads": threads, "dyn_smem": dyn, "blocks_per_sm": min(by_smem, by_bounds) if fits else 0}


def v3_shape(limits: dict) -> dict:
    """The v3 block on a device with `limits` (see `device_limits`): threads, dynamic shared
    memory, resident blocks per SM (0 = does not fit); the grid is sms x blocks_per_sm."""
    dyn = _V3_DYN_SMEM
    per_block = dyn + _V3_STATIC_SMEM + limits["smem_reserved"]
    fits = dyn + _V3_STATIC_SMEM <= limits["smem_block"]
    by_smem = limits["smem_sm"] // per_block if limits["smem_sm"] else 1
    return {"threads": _V3_THREADS, "dyn_smem": dyn,
            "blocks_per_sm": min(by_smem, _V3_MIN_BLOCKS) if fits else 0}


def v3_workspace_sizes(n_experts: int, n_pairs: int) -> tuple[int, int]:
    """(int32 counters, float32 scratch) element counts of a v3 workspace for E experts of P = N / 16
    tile pairs each: 4 counter lines, a ready line per expert, a part count per (expert, pair);
    the scratch holds the gate and up C fragments of every pair ([E * P][2][4][32])."""
    return _V3_LINE * (4 + n_experts) + n_experts * n_pairs, n_experts * n_pairs * 256


def v3_workspace(n_experts: int, n_pairs: int) -> tuple:
    """The current device's v3 workspace (counters, scratch), zeroed when made; each launch leaves it
    zero again. Launches that share it must be ordered (one stream); give concurrent streams their
    own (`moe_w4a16(..., workspace=(cupy.zeros(n, cupy.int32), cupy.zeros(f, cupy.float32)))` with
    (n, f) = `v3_workspace_sizes(E, P)`)."""
    import cupy as cp

    dev = cp.cuda.runtime.getDevice()
    n_int, n_float = v3_workspace_sizes(n_experts, n_pairs)
    ws = _V3_WORKSPACE.get((dev, n_experts, n_pairs))
    if ws is None:
        ws = _V3_WORKSPACE[(dev, n_experts, n_pairs)] = (cp.zeros(n_int, dtype=cp.int32),
                                                         cp.zeros(n_float, dtype=cp.float32))
    return ws


def v3_parts(k_chunks: int, n_pairs: int, n_warps: int) -> int:
    """K parts per gate/up item: the fewest that give >= 1.3 items per warp of the grid (n_pairs =
    active experts x tile pairs), among the divisors of k_chunks that leave >= 8 chunks a part; the
    most such parts when none gives that many items."""
    ok = [
        d for d in range(1, k_chunks + 1) if k_chunks % d == 0 and (d == 1 or k_chunks // d >= _V3_MIN_CHUNKS)
    ]
    return next((d for d in ok if n_pairs * d >= _V3_ITEMS_PER_WARP * n_warps), ok[-1])


def v3_down_batch(row_tiles: int, n_active: int, n_warps: int) -> int:
    """Down items (16-row output tiles) per take: 8 when that still gives >= 1.3 batches per warp of
    the grid and divides row_tiles (K / 16), else the smallest divisor >= 3 (the ring runs 3 stages
    ahead). The last batches end while most warps are idle, so a batch's duration is a tail the
    kernel pays: on the H200 4 and 8 were best and larger batches lost more the larger they got
    (`kdlib.perf.load("moe_stream")`, rows' `v3_down_batch`)."""
    ok = [d for d in range(3, row_tiles + 1) if row_tiles % d == 0]
    if 8 in ok and n_active * row_tiles / 8 >= _V3_ITEMS_PER_WARP * n_warps:
        return 8
    return ok[0]


def pick_version(n_pairs: int, n_warps: int) -> int:
    """The decode-regime kernel `moe_w4a16` runs by default: 3 when there are >= 0.35 tile pairs
    (active experts x N / 16) per resident warp of v3's grid, else 2 (see _V3_MIN_PAIRS_PER_WARP)."""
    return 3 if n_pairs >= _V3_MIN_PAIRS_PER_WARP * n_warps else 2


def default_version(routing: Routing, n_inter: int) -> int:
    """The kernel version `moe_w4a16` runs for `routing` when none is given: 1 outside the decode
    regime (`v2_applies`), else `pick_version` on this device's v3 grid, or 2 where v3's block does
    not fit. Needs CuPy (device limits)."""
    if not v2_applies(routing, n_inter):
        return 1
    limits = device_limits()
    resident = v3_shape(limits)["blocks_per_sm"]
    if not resident:
        return 2
    return pick_version(max(1, routing.n_active) * (n_inter // TILE_ROWS),
                        limits["sms"] * resident * _V3_THREADS // 32)


def v2_applies(routing: Routing, n_inter: int) -> bool:
    """Whether versions 2 and 3 run their own kernels (decode regime, N <= 256) rather than version 1's."""
    return routing.max_count <= _V2_MAX_SLOTS and n_inter <= _V2_MAX_N


@dataclass(frozen=True)
class V1Settings:
    """Version 1's launch choice: the gate/up block of the decode regime's n8 kernels, 16 or 8 warps."""

    version: ClassVar[int] = 1
    gate_up_warps: int = 16


@dataclass(frozen=True)
class V2Settings:
    """Version 2's launch choices: the gate/up block, 8 warps (None: 8; version 1's 16 where v2 runs v1's
    kernels) or 16; k_interleave=True (8 warps only) deals the K chunks to the warps round-robin."""

    version: ClassVar[int] = 2
    gate_up_warps: int | None = None
    k_interleave: bool = False


@dataclass(frozen=True)
class V3Settings:
    """Version 3's launch choices: K parts per gate/up item (None: `v3_parts`) and down items per take
    (None: `v3_down_batch`); see `launch_v3`."""

    version: ClassVar[int] = 3
    parts: int | None = None
    down_batch: int | None = None

    def __post_init__(self):
        for name in ("parts", "down_batch"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")


VERSIONS = (1, 2, 3)
SETTINGS = {1: V1Settings, 2: V2Settings, 3: V3Settings}
# No fixed default: version None runs `default_version(routing, N)`, picked per call from the routing
# (tests/test_kernel_constants.py checks the pick against data/results/moe.h200.json).
DEFAULT_VERSION = None


def launch_settings(version: int | None = None, settings=None, *, gate_up_warps: int | None = None,
                    k_interleave: bool = False, parts: int | None = None, down_batch: int | None = None):
    """(version or None, settings or None) for `moe_w4a16`'s arguments, checked (ValueError).

    `settings` (a V1Settings / V2Settings / V3Settings) names its version; the deprecated keywords build
    one: gate_up_warps / k_interleave imply version 2 and parts / down_batch version 3 when version is
    None. None, None: `moe_w4a16` picks `default_version` and its default settings.
    """
    version = check_version(version, VERSIONS, None)
    old = gate_up_warps is not None or k_interleave or parts is not None or down_batch is not None
    if settings is not None:
        if old:
            raise ValueError("give settings or the deprecated keywords (gate_up_warps, k_interleave, parts, "
                             "down_batch), not both")
        if not isinstance(settings, tuple(SETTINGS.values())):
            raise ValueError(f"settings must be a V1Settings, V2Settings or V3Settings, got {settings!r}")
        if version not in (None, settings.version):
            raise ValueError(f"settings {settings!r} are version {settings.version}'s, the call asks for "
                             f"version {version}")
        version = settings.version
        gate_up_warps = getattr(settings, "gate_up_warps", None)
        k_interleave = getattr(settings, "k_interleave", False)
    elif old:
        if version == 3 and (gate_up_warps is not None or k_interleave):
            raise ValueError("version 3 has one block shape: gate_up_warps and k_interleave do not apply")
        if (parts is not None or down_batch is not None) and version not in (None, 3):
            raise ValueError("parts and down_batch apply to version 3 only")
        if (gate_up_warps is not None or k_interleave) and (parts is not None or down_batch is not None):
            raise ValueError("gate_up_warps / k_interleave (version 2) and parts / down_batch (version 3) "
                             "do not mix")
        if version is None:
            version = 2 if gate_up_warps is not None or k_interleave else 3
        settings = {1: lambda: V1Settings(16 if gate_up_warps is None else gate_up_warps),
                    2: lambda: V2Settings(gate_up_warps, k_interleave),
                    3: lambda: V3Settings(parts, down_batch)}[version]()
    if gate_up_warps not in (None, 8, 16):
        raise ValueError(f"gate_up_warps must be 8 or 16, got {gate_up_warps}")
    if k_interleave and (version != 2 or gate_up_warps == 16):
        raise ValueError("k_interleave needs version=2 and the 8-warp gate/up block")
    return version, settings


def moe_w4a16(x, packed: dict, routing: Routing, *, out=None, h=None, sync: bool = False,
              version: int | None = None, settings=None, workspace=None, gate_up_warps: int | None = None,
              k_interleave: bool = False, parts: int | None = None, down_batch: int | None = None):
    """y = MoE(x) with INT4 experts.

    Shape: x [M, K] bf16 (torch bf16 or CuPy uint16 bits); packed = `upload(pack_moe(w))`;
    returns y [M, K] float32 (CuPy). `out` (float32 [M, K]) and `h` (uint16 [M * topk, N]) may be
    given to avoid allocations; `out` is overwritten. sync=True synchronizes after each launch.

    version: one of VERSIONS, or None (the default): `default_version` picks per call, 3 or 2 in the
    decode regime by `pick_version` (3 where it was faster on the H200: many active experts; 2 at few
    tokens, and wherever v3's block does not fit), 1 above it. settings: the chosen version's launch
    choices (`V1Settings`, `V2Settings`, `V3Settings`; it names its version, so version may be left
    None); None: that version's defaults. The keywords gate_up_warps, k_interleave, parts and
    down_batch are deprecated aliases of the settings' fields (`launch_settings`; with version None,
    gate_up_warps or k_interleave mean version 2, parts or down_batch version 3).

    version 1 (`kernels/moe_w4a16/v1.cu`): y.fill(0), gate/up + SwiGLU launch, down + weighted
    combine launch; `V1Settings.gate_up_warps` 16 (default) or 8 picks the gate/up block in the decode
    regime.
    version 2 (replayed from CUDA graphs, as fast as version 1 or faster at every M <= 64 on the
    H200 and the same kernels above, see `kdlib.perf.load("moe")`; `kernels/moe_w4a16/v2.cu`,
    decode regime: every expert has <= 8 slots, N <= 256): two persistent launches streaming the
    weights through per-warp cp.async rings, y zeroed inside the gate/up launch; `V2Settings`:
    gate_up_warps 8 (default: two 256-thread blocks per SM on an H200, one on a 100 KB part) or 16
    (one 512-thread block per SM, H100/H200 class only); k_interleave=True (8 warps only) deals the K
    chunks to the warps round-robin instead of in contiguous ranges.
    Outside its regime version 2 runs version 1's kernels.
    version 3 (`kernels/moe_w4a16/v3.cu`, the same regime): one launch of independent warps taking
    gate/up items (K split in `V3Settings.parts` when there are few tile pairs) and then down batches
    from global counters, down waiting per expert for its h; `workspace` = (int32 counters, float32
    scratch), zero, by default one per device and shape (`v3_workspace`). Outside its regime
    version 3 runs version 1's kernels too.
    """
    version, settings = launch_settings(version, settings, gate_up_warps=gate_up_warps,
                                        k_interleave=k_interleave, parts=parts, down_batch=down_batch)
    import cupy as cp

    xb = _bf16_bits_cupy(x, "x")
    w1, s1, w2, s2 = (packed[k] for k in PACKED)
    if w1.ndim != 6 or w1.shape[3:] != (2, 32, 4) or w1.dtype != cp.uint32:
        raise ValueError(f"packed['w1'] must be uint32 [E, N/16, K/64, 2, 32, 4], got {w1.dtype} {w1.shape}")
    E, P, KC = w1.shape[:3]
    K, N = KC * CHUNK_COLS, P * TILE_ROWS
    expect = {"s1": (E, P, KC, 2, 16), "w2": (E, K // 16, N // 64, 32, 4), "s2": (E, K // 16, N // 64, 16)}
    for name, shape in expect.items():
        if tuple(packed[name].shape) != shape or packed[name].dtype != cp.uint32:
            raise ValueError(f"packed[{name!r}] must be uint32 {shape}, got {packed[name].dtype} "
                             f"{packed[name].shape}")
    for name in PACKED:
        if not packed[name].flags.c_contiguous:
            raise ValueError(f"packed[{name!r}] must be C-contiguous (as `upload` makes it), got strides "
                             f"{packed[name].strides}")
    if N % CHUNK_COLS:
        raise ValueError(f"expert intermediate N = {N} must be a multiple of {CHUNK_COLS}")
    if xb.ndim != 2 or xb.shape != (routing.m, K):
        raise ValueError(f"x must be [M={routing.m}, K={K}], got {xb.shape}")
    if routing.n_experts != E:
        raise ValueError(f"routing was made for {routing.n_experts} experts, weights hold {E}")
    S = routing.m * routing.topk
    if out is None:
        out = cp.empty((routing.m, K), dtype=cp.float32)
    elif out.shape != (routing.m, K) or out.dtype != cp.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be contiguous float32 [{routing.m}, {K}]")
    if h is None:
        h = cp.empty((S, N), dtype=cp.uint16)
    elif h.shape != (S, N) or h.dtype != cp.uint16 or not h.flags.c_contiguous:
        raise ValueError(f"h must be contiguous uint16 [{S}, {N}]")
    # the kernels index every buffer from its base as packed, in 16-byte pieces (uint4 loads, float4 y)
    for name, a in (("x", xb), ("out", out), ("h", h), *((f"packed[{k!r}]", packed[k]) for k in PACKED)):
        aligned16(a, name)
    if version is None:
        version = default_version(routing, N)
    if settings is None:
        settings = SETTINGS[version]()
    if version == 3 and v2_applies(routing, N) and KC >= 3:   # the ring runs 3 chunks ahead
        launch_v3(xb, packed, routing, out, h, workspace=workspace, parts=settings.parts,
                  down_batch=settings.down_batch)
        _check(sync, "v3 launch")
    elif version == 2 and v2_applies(routing, N):
        launch_v2_gate_up(xb, packed, routing, out, h, gate_up_warps=settings.gate_up_warps or 8,
                          k_interleave=settings.k_interleave)
        _check(sync, "v2 gate_up launch")
        launch_v2_down(packed, routing, out, h)
        _check(sync, "v2 down launch")
    else:
        warps = getattr(settings, "gate_up_warps", None) or 16   # v3's fallback, and v2's without a choice
        _launch_v1(xb, w1, s1, w2, s2, routing, out, h, K, N, warps, sync)
    return out


def _launch_v1(xb, w1, s1, w2, s2, routing: Routing, out, h, K: int, N: int, gate_up_warps: int, sync: bool):
    """version 1: y.fill(0), gate/up launch, down launch (kernels/moe_w4a16/v1.cu)."""
    P = N // TILE_ROWS
    out.fill(0)
    per_pass = 8 if routing.max_count <= 8 else 16 if routing.max_count <= 16 else 32
    variant = f"n{per_pass}"
    passes = -(-routing.max_count // per_pass)
    n_active = max(1, routing.n_active)
    meta = (routing.expert_offsets, routing.active_experts, routing.n_active_dev, routing.sorted_token)
    gate_up_name = f"{STEM}_gate_up_{variant}"
    threads_gate_up = _V1_THREADS
    if variant == "n8":
        threads_gate_up = 32 * gate_up_warps            # kThreadsN8 (16 warps) or kThreads (_n8w8)
        gate_up_name += "" if gate_up_warps == 16 else "w8"

    gate_up = get_function(SOURCE, gate_up_name)
    # grid: (token pass, pair / row group, active expert) - passes over one expert run back to back
    gate_up((passes, P, n_active), (threads_gate_up,), (xb, w1, s1, *meta, h, np.int32(K), np.int32(N)))
    _check(sync, "gate_up launch")
    down = get_function(SOURCE, f"{STEM}_down_{variant}")
    down((passes, -(-(K // 16) // _V1_DOWN_TILES_PER_BLOCK), n_active), (_V1_THREADS,),
         (h, w2, s2, *meta, routing.sorted_weight, out, np.int32(K), np.int32(N)))
    _check(sync, "down launch")


def launch_v2_gate_up(xb, packed: dict, routing: Routing, out, h, *, gate_up_warps: int = 8,
                      k_interleave: bool = False) -> None:
    """The v2 gate/up launch alone (it also zeroes `out`): `moe_w4a16(version=2)` checks the
    arguments and calls this, then `launch_v2_down`; benchmarks time the two apart.

    Shape: xb [M, K] uint16 (bf16 bits), out [M, K] float32, h [M * topk, N] uint16 (CuPy).
    """
    limits = device_limits()
    shape = v2_gate_up_shape(gate_up_warps, limits)
    if not shape["blocks_per_sm"]:
        raise ValueError(f"the v2 gate/up block with {gate_up_warps} warps needs {shape['dyn_smem']} B of "
                         "dynamic "
                         f"shared memory; this device allows {limits['smem_block']} B per block")
    E, P, KC = packed["w1"].shape[:3]
    name = f"{STEM_V2}_gate_up_w{gate_up_warps}{'i' if k_interleave else ''}"
    gate_up = get_function(SOURCE_V2, name)
    set_max_dynamic_shared(gate_up, shape["dyn_smem"])
    items = max(1, routing.n_active) * P               # (expert, 16-row tile pair) work items
    meta = (routing.expert_offsets, routing.active_experts, routing.n_active_dev, routing.sorted_token)
    gate_up((min(items, limits["sms"] * shape["blocks_per_sm"]),), (shape["threads"],),
            (xb, packed["w1"], packed["s1"], *meta, h, out, np.int32(routing.m), np.int32(KC * CHUNK_COLS),
             np.int32(P * TILE_ROWS)), shared_mem=shape["dyn_smem"])


def launch_v2_down(packed: dict, routing: Routing, out, h) -> None:
    """The v2 down launch alone: out += the routing-weighted down projection of h (see
    `launch_v2_gate_up`)."""
    limits = device_limits()
    E, RT, NC = packed["w2"].shape[:3]
    down = get_function(SOURCE_V2, f"{STEM_V2}_down")
    threads, stages = _V2_DOWN
    dyn = threads // 32 * stages * _V2_STAGE_BYTES_DOWN
    set_max_dynamic_shared(down, dyn)
    grid = min(-(-max(1, routing.n_active) * RT // (threads // 32)), limits["sms"])   # >= 1 item per warp
    meta = (routing.expert_offsets, routing.active_experts, routing.n_active_dev, routing.sorted_token)
    down((grid,), (threads,), (h, packed["w2"], packed["s2"], *meta, routing.sorted_weight, out,
                               np.int32(RT * TILE_ROWS), np.int32(NC * CHUNK_COLS)), shared_mem=dyn)


def launch_v3(xb, packed: dict, routing: Routing, out, h, *, workspace=None, parts: int | None = None,
              down_batch: int | None = None) -> None:
    """The v3 launch (gate/up, SwiGLU, down and the weighted combine into `out`, which it zeroes);
    `moe_w4a16(version=3)` checks the arguments and calls this.

    Shape: xb [M, K] uint16 (bf16 bits), out [M, K] float32, h [M * topk, N] uint16 (CuPy);
    workspace (int32, float32) as `v3_workspace`; parts: K parts per gate/up item (default
    `v3_parts`), a divisor of K / 64 leaving >= 3 chunks a part; down_batch: down items per take
    (default `v3_down_batch`), a divisor of K / 16, >= 3.
    """
    import cupy as cp

    limits = device_limits()
    shape = v3_shape(limits)
    if not shape["blocks_per_sm"]:
        raise ValueError(f"the v3 block needs {shape['dyn_smem']} B of shared memory; this device allows "
                         f"{limits['smem_block']} B per block")
    E, P, KC = packed["w1"].shape[:3]
    grid = limits["sms"] * shape["blocks_per_sm"]
    if parts is None:
        parts = v3_parts(KC, max(1, routing.n_active) * P, grid * shape["threads"] // 32)
    elif KC % parts or KC // parts < 3:
        raise ValueError(f"parts must divide K / 64 = {KC} and leave >= 3 chunks a part, got {parts}")
    RT = KC * CHUNK_COLS // TILE_ROWS
    if down_batch is None:
        down_batch = v3_down_batch(RT, max(1, routing.n_active), grid * shape["threads"] // 32)
    elif RT % down_batch or down_batch < 3:
        raise ValueError(f"down_batch must divide K / 16 = {RT} and be >= 3, got {down_batch}")
    n_int, n_float = v3_workspace_sizes(E, P)
    if workspace is None:
        workspace = v3_workspace(E, P)
    ws, scratch = workspace
    if ws.dtype != cp.int32 or ws.size < n_int or scratch.dtype != cp.float32 or scratch.size < n_float:
        raise ValueError(f"workspace must be (int32 >= {n_int}, float32 >= {n_float} elements), got "
                         f"({ws.dtype} {ws.size}, {scratch.dtype} {scratch.size})")
    fn = get_function(SOURCE_V3, STEM_V3)
    set_max_dynamic_shared(fn, shape["dyn_smem"])
    meta = (routing.active_experts, routing.n_active_dev, routing.active_ranges, routing.sorted_token,
            routing.sorted_weight)
    fn((grid,), (shape["threads"],),
       (xb, packed["w1"], packed["s1"], packed["w2"], packed["s2"], *meta, h, out, ws, scratch, np.int32(E),
        np.int32(routing.m), np.int32(KC * CHUNK_COLS), np.int32(P * TILE_ROWS), np.int32(parts),
        np.int32(down_batch)), shared_mem=shape["dyn_smem"])
