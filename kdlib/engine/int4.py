"""INT4 group-32 routed experts for the engine: the torch twins of `kdlib.cuda.moe`'s quantizer and packer,
routing built on the device, and the MoE call through `moe_w4a16` (CUDA) or the dequantized weights (CPU).

    q, s = quantize_w4_torch(w)      # w [..., R, C] -> q uint8 0..15, s bf16 bits per 32 columns
    packed = pack_moe_torch(qg, sg, qu, su, qd, sd)       # kdlib.cuda.moe.pack_moe's layout (w1, s1, w2, s2)
    rt = device_routing(ids, weights, e0, n_local)        # kdlib.cuda.moe.Routing's arrays, no host sync
                                                          # (CUDA: one launch of kernels/moe_routing/v1.cu)
    y = routed_kernel(x, packed, rt, topk, inter, bound)  # CUDA: moe_w4a16 with a static slot bound
    y = routed_dequantized(x, qs, rt)                     # any device: the same maths in torch, float32 sums

Quantization as `kdlib.cuda.moe.quantize_w4`: per group of 32 inputs s = bf16(max|w| / 7),
q = round(w / s) + 8 (round half to even, clamped to 0..15); the kernel multiplies (q - 8) * s in bf16.
`kdlib.engine.model.MoE` (`Model.quantize_experts_int4`) and `kdlib.engine.rank` (one Kimi-K2.6 rank)
run their routed experts through this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kdlib.cuda.loader import as_cupy
from kdlib.cuda.moe import GROUP, check_bf16_bits, check_int4, check_tiles, check_w4_shapes


def quantize_w4_torch(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """`kdlib.cuda.moe.quantize_w4` in torch: w [..., R, C] float32 -> q [..., R, C] uint8 (0..15),
    scales [..., R, C / group] int16 (bf16 bits). Same arithmetic: s = bf16(max|g| / 7), round half even."""
    check_w4_shapes(tuple(w.shape), None, group, "quantize_w4_torch")
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // group, group)
    s = (g.abs().amax(-1) / 7.0).to(torch.bfloat16).float()  # [..., R, C/group]
    safe = torch.where(s > 0, s, torch.ones_like(s))[..., None]
    q = torch.clamp(torch.round(g / safe), -8, 7) + 8
    q = torch.where(s[..., None] > 0, q, torch.full_like(q, 8)).to(torch.uint8).reshape(w.shape)
    return q, s.to(torch.bfloat16).view(torch.int16)


def _dtype_name(t: torch.Tensor) -> str:
    """t's dtype as the numpy checks of kdlib.cuda.moe name it ("int16" for torch.int16)."""
    return str(t.dtype).removeprefix("torch.")


def pack_rows_torch(q: torch.Tensor) -> torch.Tensor:
    """`kdlib.cuda.moe.pack_rows` in torch: q [..., R, C] integers 0..15 -> [..., R/16, C/64, 32, 4] int32
    (uint32 bits). Syncs with the host for the range check."""
    *lead, R, C = q.shape
    n = len(lead)
    check_tiles(R, C, "pack_rows_torch")
    integer = not (q.dtype.is_floating_point or q.dtype.is_complex or q.dtype == torch.bool)
    v = q.to(torch.int64)  # torch has no min / max of uint16..uint64
    bounds = tuple(map(int, torch.aminmax(v))) if integer and q.numel() else None
    check_int4(_dtype_name(q), integer, bounds, "pack_rows_torch")
    v = v.reshape(*lead, R // 16, 2, 8, C // 64, 4, 4, 4)  # [.., rt, h, g, kc, t, i, j]
    v = v.permute(*range(n), n, n + 3, n + 2, n + 4, n + 5, n + 1, n + 6)  # [.., rt, kc, g, t, i, h, j]
    words = torch.zeros(v.shape[:-2], dtype=torch.int64, device=q.device)
    for h in range(2):
        for j in range(4):
            words |= v[..., h, j] << (4 * (h + 2 * (j // 2) + 4 * (j % 2)))
    return _as_int32(words).reshape(*lead, R // 16, C // 64, 32, 4).contiguous()


def _as_int32(w: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same 32 bits."""
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def pack_scales_torch(s: torch.Tensor) -> torch.Tensor:
    """`kdlib.cuda.moe.pack_scales` in torch: s [..., R, C/32] int16 or uint16 (bf16 bits) ->
    [..., R/16, C/64, 16] int32."""
    check_bf16_bits(_dtype_name(s), "pack_scales_torch: s")
    *lead, R, G = s.shape
    n = len(lead)
    check_tiles(R, G * GROUP, "pack_scales_torch")
    v = (s.to(torch.int64) & 0xFFFF).reshape(*lead, R // 16, 2, 8, G // 2, 2)  # [.., rt, h, g, kc, grp]
    v = v.permute(*range(n), n, n + 3, n + 4, n + 2, n + 1)  # [.., rt, kc, grp, g, h]
    words = _as_int32(v[..., 0] | (v[..., 1] << 16))
    return words.reshape(*lead, R // 16, G // 2, 16).contiguous()


def pack_moe_torch(q_gate, s_gate, q_up, s_up, q_down, s_down) -> dict[str, torch.Tensor]:
    """`kdlib.cuda.moe.pack_moe` in torch (int32 words, the kernel reads them as uint32): w1, s1, w2, s2."""
    return {"w1": torch.stack([pack_rows_torch(q_gate), pack_rows_torch(q_up)], dim=3).contiguous(),
            "s1": torch.stack([pack_scales_torch(s_gate), pack_scales_torch(s_up)], dim=3).contiguous(),
            "w2": pack_rows_torch(q_down), "s2": pack_scales_torch(s_down)}


def dequantize_w4_torch(q: torch.Tensor, s: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """bf16((q - 8) * s) as float32: q [..., R, C] uint8, s [..., R, C/group] int16 or uint16 (bf16
    bits)."""
    check_bf16_bits(_dtype_name(s), "dequantize_w4_torch: s")
    check_w4_shapes(tuple(q.shape), tuple(s.shape), group, "dequantize_w4_torch")
    sc = s.view(torch.bfloat16).float().repeat_interleave(group, dim=-1)
    return ((q.float() - 8.0) * sc).to(torch.bfloat16).float()


# ----------------------------------------------------------------------------- routing on the device
@dataclass
class DeviceRouting:
    """`kdlib.cuda.moe.Routing`'s device arrays as torch tensors (int32 / float32), made without a host
    sync."""

    expert_offsets: torch.Tensor  # [E + 1]
    active_experts: torch.Tensor  # [E] experts with >= 1 slot first, ascending
    n_active: torch.Tensor  # [1]
    active_ranges: torch.Tensor  # [E, 2]
    sorted_token: torch.Tensor  # [M k] (local slots first, by expert)
    sorted_weight: torch.Tensor  # [M k]
    max_count: torch.Tensor  # [] the largest slot count of one expert


ROUTING_KERNEL = ("moe_routing/v1", "moe_routing_v1")  # (loader stem, kernel name)
ROUTING_WARPS = 16  # RT_WARPS in moe_routing/v1.cu
# the largest launch bound (slots per expert) that `routed_kernel` runs on moe_w4a16's decode-regime pick;
# above it, version 1 (the estimator fits the two launches apart: kdlib.estimator.calibration.moe_piece)
MOE_NARROW_BOUND = 8
ROUTING_MAX_SMEM = 227 * 1024  # the kernel's dynamic shared memory at most on sm_90 (its opt-in limit)


def routing_max_smem(device: torch.device) -> int:
    """The kernel's dynamic shared memory at most on a CUDA `device`: its opt-in limit per block
    (ROUTING_MAX_SMEM on sm_90, 163 KB on an A100, 99 KB on sm_86 / sm_89 / sm_120)."""
    import cupy

    from kdlib.cuda import loader

    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        return loader.device_limits()["smem_block"]


def routing_smem(slots: int, n_local: int) -> int:
    """Bytes of dynamic shared memory moe_routing_v1 takes for `slots` (M k) slots over n_local experts."""
    return 4 * (ROUTING_WARPS * (n_local + 1) + n_local + 2 + slots)


def device_routing(ids: torch.Tensor, weights: torch.Tensor, e0: int, n_local: int, bound: int = 0,
                   overflow: torch.Tensor | None = None) -> DeviceRouting:
    """ids, weights [M, k] (global expert ids) -> the routing of the local experts [e0, e0 + n_local).

    Slots of other ranks' experts sort after every local one and no expert range covers them. CUDA:
    `routing_kernel` (one launch of moe_routing_v1) where its shared memory fits (`routing_smem`: up to
    ~51k slots at 384 experts, a 6k-token prefill at top-8); elsewhere, and beyond, `routing_torch`. Both
    give the same arrays (the slot order of a stable argsort by expert). overflow (a [] int64 tensor):
    += 1 when an expert has more than `bound` slots (the kernel counts it in the same launch)."""
    if ids.device.type == "cuda" and routing_smem(ids.numel(), n_local) <= routing_max_smem(ids.device):
        return routing_kernel(ids, weights, e0, n_local, bound, overflow)
    rt = routing_torch(ids, weights, e0, n_local)
    if overflow is not None:
        overflow += (rt.max_count > bound).to(overflow.dtype)
    return rt


def routing_kernel(ids: torch.Tensor, weights: torch.Tensor, e0: int, n_local: int, bound: int = 0,
                   overflow: torch.Tensor | None = None) -> DeviceRouting:
    """`device_routing` on CUDA: one block of `kernels/moe_routing/v1.cu`, outputs in fresh torch tensors
    (graph-capturable: no host sync, no CuPy allocation); overflow += 1 in the kernel when an expert has
    more than `bound` slots."""
    from kdlib.cuda import loader

    M, k = ids.shape
    # the device's limit (sm_90's where there is no device to ask: the sizes are refused all the same)
    limit = routing_max_smem(ids.device) if ids.device.type == "cuda" else ROUTING_MAX_SMEM
    smem = routing_smem(M * k, n_local)
    if n_local < 1 or smem > limit:
        raise ValueError(f"routing_kernel: n_local {n_local} must be >= 1 and {M * k} slots over it fit "
                         f"{limit} B of shared memory (need {smem} B)")
    dev = ids.device
    if overflow is not None and (overflow.dtype != torch.int64 or overflow.numel() != 1
                                 or overflow.device != dev):
        raise ValueError(f"overflow must be one int64 on {dev}, got {overflow.dtype} {tuple(overflow.shape)} "
                         f"on {overflow.device}")
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    i32 = dict(dtype=torch.int32, device=dev)
    rt = DeviceRouting(
        torch.empty(n_local + 1, **i32), torch.empty(n_local, **i32), torch.empty(1, **i32),
        torch.empty(n_local, 2, **i32), torch.empty(M * k, **i32),
        torch.empty(M * k, dtype=torch.float32, device=dev), torch.empty((), dtype=torch.int64, device=dev))
    fn = loader.get_function(*ROUTING_KERNEL)
    loader.set_max_dynamic_shared(fn, smem)
    args = (ids, weights, np.int32(M * k), np.int32(k), np.int64(e0), np.int32(n_local), rt.expert_offsets,
            rt.active_experts, rt.n_active, rt.active_ranges, rt.sorted_token, rt.sorted_weight, rt.max_count,
            np.int32(bound), overflow if overflow is not None else np.uintp(0))
    fn((1,), (32 * ROUTING_WARPS,), tuple(as_cupy(a) if torch.is_tensor(a) else a for a in args),
       shared_mem=smem)
    return rt


def routing_torch(ids: torch.Tensor, weights: torch.Tensor, e0: int, n_local: int) -> DeviceRouting:
    """`device_routing` in torch ops (any device; the CPU path and the kernel's reference): a counting
    sort with no sort kernels and no host sync."""
    M, k = ids.shape
    dev = ids.device
    local = (ids >= e0) & (ids < e0 + n_local)
    key = torch.where(local, ids - e0, torch.full_like(ids, n_local)).reshape(-1)  # [M k]
    # a counting sort (no sort kernels: the small ops fuse): slot i goes to the start of its expert's
    # bucket plus the number of earlier slots of that expert, so order is argsort(key, stable=True)
    onehot = torch.nn.functional.one_hot(key, n_local + 1)  # [M k, E + 1]
    counts = onehot.sum(0)  # [E + 1]
    rank = (onehot.cumsum(0) - onehot).gather(1, key[:, None])[:, 0]  # [M k] earlier slots of the same expert
    starts = counts.cumsum(0) - counts
    arange = torch.arange(M * k, device=dev)
    order = torch.empty_like(arange).scatter_(0, starts[key] + rank, arange)
    counts = counts[:n_local]
    offsets = torch.zeros(n_local + 1, dtype=torch.int64, device=dev)
    offsets[1:] = counts.cumsum(0)
    # experts with slots first, then the empty ones, each ascending (argsort(counts == 0, stable=True))
    busy = counts > 0
    n_busy = busy.cumsum(0)  # experts with slots up to and including e
    experts = torch.arange(n_local, device=dev)
    to = torch.where(busy, n_busy - 1, n_busy[-1] + experts - n_busy)
    active = torch.empty_like(experts).scatter_(0, to, experts)  # [E]
    ranges = torch.stack([offsets[active], offsets[active + 1]], dim=1)  # [E, 2]
    i32 = torch.int32
    return DeviceRouting(
        offsets.to(i32),
        active.to(i32),
        (counts > 0).sum().reshape(1).to(i32),
        ranges.to(i32),
        (order // k).to(i32),
        weights.reshape(-1)[order].float(),
        counts.max(),
    )


def count_bound(m: int, topk: int, n_experts_global: int, factor: float) -> int:
    """Static bound on one expert's slots for the launch sizes: m itself (exact) when m <= 8 (the
    decode kernels' regime), else min(m, max(8, ceil(factor x the uniform-routing mean)))."""
    if m <= 8:
        return m
    return min(m, max(8, math.ceil(factor * m * topk / n_experts_global)))


def routed_kernel(x: torch.Tensor, packed: dict, rt: DeviceRouting, topk: int, inter: int, bound: int,
                  cupy_packed: dict | None = None) -> torch.Tensor:
    """The routed experts' weighted sum [M, H] in x.dtype through `kdlib.cuda.moe.moe_w4a16` (x bf16 on CUDA).

    packed: `pack_moe_torch`'s int32 tensors; bound: the static per-expert slot bound the launch sizes
    come from (`count_bound`; M itself is always safe); cupy_packed: uint32 CuPy views of packed, kept by
    the caller so that a graph capture makes none."""
    import cupy

    from kdlib.cuda import moe

    M, K = x.shape
    E = rt.active_experts.shape[0]
    views = (cupy_packed if cupy_packed is not None
             else {n: as_cupy(t).view(cupy.uint32) for n, t in packed.items()})
    routing = moe.Routing(as_cupy(rt.expert_offsets), as_cupy(rt.active_experts), as_cupy(rt.n_active),
                          as_cupy(rt.active_ranges), as_cupy(rt.sorted_token), as_cupy(rt.sorted_weight),
                          m=M, topk=topk, n_experts=E, n_active=min(E, M * topk), max_count=bound)
    out = torch.empty(M, K, dtype=torch.float32, device=x.device)  # [M, H]
    h = torch.empty(M * topk, inter, dtype=torch.int16, device=x.device)  # [M k, N] bf16 bits
    moe.moe_w4a16(x.contiguous(), views, routing, out=as_cupy(out), h=as_cupy(h).view(cupy.uint16),
                  version=None if bound <= MOE_NARROW_BOUND else 1)
    return out.to(x.dtype)


def routed_dequantized(x: torch.Tensor, qs: tuple, rt: DeviceRouting) -> torch.Tensor:
    """The same sum from the unpacked weights qs = (q_gate, s_gate, q_up, s_up, q_down, s_down) [E, ...]:
    bf16-rounded dequantized weights, SwiGLU rounded to bf16 as the kernel's h, float32 sums -> x.dtype.
    One iteration per expert with slots (a host sync each): the CPU path and the reference."""
    qg, sg, qu, su, qd, sd = qs
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    offs = rt.expert_offsets.long().tolist()
    for e in range(qg.shape[0]):
        a, b = offs[e], offs[e + 1]
        if a == b:
            continue
        rows = rt.sorted_token[a:b].long()
        xe = x[rows].float()
        g = xe @ dequantize_w4_torch(qg[e], sg[e]).T
        u = xe @ dequantize_w4_torch(qu[e], su[e]).T
        hh = (F.silu(g) * u).to(torch.bfloat16).float()
        out.index_add_(0, rows, rt.sorted_weight[a:b, None] * (hh @ dequantize_w4_torch(qd[e], sd[e]).T))
    return out.to(x.dtype)
