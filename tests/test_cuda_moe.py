"""W4A16 MoE: the quantizer and packing on the CPU (against an emulation of the mma.sync fragment
layout, written from the PTX ISA's m16n8k16 tables), the kernel against the float64 reference on
the GPU (gpu-marked)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlib import check
from kdlib.cuda import moe

# ----------------------------------------------------------------------------- CPU: quantizer


def test_bf16_round_trip_and_rounding():
    vals = np.array([1.0, -2.5, 3.0e-3, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8], dtype=np.float32)
    out = moe.bf16_bits_to_f32(moe.f32_to_bf16_bits(vals))
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: nearest even is 1.0; 1 + 3*2^-8 rounds up to 1 + 2^-6
    np.testing.assert_array_equal(out, np.array([1.0, -2.5, np.float32(out[2]), 1.0, 1.0 + 2.0**-6], np.float32))
    assert abs(out[2] - 3.0e-3) <= 3.0e-3 * 2.0**-8


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-4, 10.0))
def test_quantize_error_bounded_by_half_step(seed, scale):
    w = np.random.default_rng(seed).normal(0, scale, (4, 64)).astype(np.float32)
    q, s = moe.quantize_w4(w)
    assert q.dtype == np.uint8 and q.max() <= 15 and s.shape == (4, 2)
    deq = moe.dequantize_w4(q, s)
    step = np.repeat(moe.bf16_bits_to_f32(s), 32, axis=-1)
    # half a quantization step, plus the bf16 roundings of the scale (absmax/7) and of the product
    assert np.all(np.abs(deq - w) <= 0.5 * step + np.abs(w) * 2.0**-7 + 1e-30)


def test_quantize_extremes_and_zero_group():
    w = np.zeros((16, 64), np.float32)
    w[0, :32] = np.linspace(-7, 7, 32)
    q, s = moe.quantize_w4(w)
    assert moe.bf16_bits_to_f32(s)[0, 0] == 1.0
    assert q[0, 0] == 1 and q[0, 31] == 15          # -7 -> 1, +7 -> 15 (zero point 8)
    assert s[1, 0] == 0 and np.all(q[1] == 8)       # an all-zero group dequantizes to exact zeros
    np.testing.assert_array_equal(moe.dequantize_w4(q, s)[1], 0.0)


def test_quantize_rejects_bad_shape():
    with pytest.raises(ValueError, match="multiple of the group"):
        moe.quantize_w4(np.zeros((4, 40)))


# ----------------------------------------------------------------------------- CPU: packing


def _a_fragment_tile(words: np.ndarray, scales: np.ndarray, i: int) -> np.ndarray:
    """Emulate dequant8 for all 32 lanes of k16 step i and place the registers where the PTX
    m16n8k16 A layout puts them: reg0 (row g, k 2t..2t+1), reg1 (row g+8, same k),
    reg2 (row g, k 2t+8..2t+9), reg3 (row g+8, same). Returns the virtual A tile [16, 16]."""
    A = np.full((16, 16), np.nan)
    for lane in range(32):
        g, t = divmod(lane, 4)
        w = int(words[lane, i])
        sw = int(scales[(t >> 1) * 8 + g])
        s_row = {0: float(moe.bf16_bits_to_f32(np.uint16(sw & 0xFFFF))), 1: float(moe.bf16_bits_to_f32(np.uint16(sw >> 16)))}
        for j in range(4):
            v = (w >> (4 * j)) & 0x000F000F
            lo, hi = v & 0xF, v >> 16
            half = j & 1                                     # odd registers: row g + 8
            row = g + 8 * half
            kbase = 2 * t + (8 if j >= 2 else 0)
            A[row, kbase] = float(moe.round_bf16((lo - 8) * s_row[half]))
            A[row, kbase + 1] = float(moe.round_bf16((hi - 8) * s_row[half]))
    assert not np.isnan(A).any(), "some A element was never written: the nibble map misses a slot"
    return A


def _b_fragment_tile(x: np.ndarray, col0: int, i: int) -> np.ndarray:
    """B [16 (virtual k), 8 (token)] as load_b fills it: lane (g, t) reads token g, physical columns
    col0 + 16t + 4i + {0,1} (b0 -> virtual k 2t, 2t+1) and {2,3} (b1 -> virtual k 2t+8, 2t+9)."""
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        if g >= x.shape[0]:
            continue
        base = col0 + 16 * t + 4 * i
        B[2 * t, g], B[2 * t + 1, g] = x[g, base], x[g, base + 1]
        B[2 * t + 8, g], B[2 * t + 9, g] = x[g, base + 2], x[g, base + 3]
    return B


def test_packing_matches_mma_fragment_emulation():
    rng = np.random.default_rng(7)
    R, C, T = 32, 128, 5
    q, s = moe.quantize_w4(rng.normal(0, 1, (R, C)))
    x = moe.round_bf16(rng.normal(0, 1, (T, C))).astype(np.float64)
    words, scales = moe.pack_rows(q), moe.pack_scales(s)
    assert words.shape == (2, 2, 32, 4) and words.dtype == np.uint32 and scales.shape == (2, 2, 16)
    D = np.zeros((R, 8))
    for rt in range(R // 16):
        for kc in range(C // 64):
            for i in range(4):
                A = _a_fragment_tile(words[rt, kc], scales[rt, kc], i)
                D[rt * 16:(rt + 1) * 16] += A @ _b_fragment_tile(x, kc * 64, i)
    ref = moe.dequantize_w4(q, s).astype(np.float64) @ x.T
    np.testing.assert_allclose(D[:, :T], ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(D[:, T:], 0.0)


def test_pack_rows_places_each_nibble_once():
    q = np.zeros((16, 64), np.uint8)
    q[9, 37] = 0xF                                       # row g + 8 with g = 1; col 37 = 16*2 + 4*1 + 1
    words = moe.pack_rows(q)
    nz = np.argwhere(words)
    assert nz.tolist() == [[0, 0, 1 * 4 + 2, 1]]         # lane 4g + t = 6, word i = 1
    assert int(words[0, 0, 6, 1]) == 0xF << (4 * (1 + 2 * 0 + 4 * 1))   # h=1, j=1 -> nibble 5


def test_pack_moe_shapes_and_bytes():
    w = moe.MoEWeights.random(3, 128, 64, seed=1)
    p = moe.pack_moe(w)
    assert p["w1"].shape == (3, 4, 2, 2, 32, 4) and p["s1"].shape == (3, 4, 2, 2, 16)
    assert p["w2"].shape == (3, 8, 1, 32, 4) and p["s2"].shape == (3, 8, 1, 16)
    total = sum(a.nbytes for a in p.values())
    assert total == 3 * moe.packed_bytes_per_expert(128, 64)


def test_pack_rejects_untileable():
    with pytest.raises(ValueError, match="multiple of 16"):
        moe.pack_rows(np.zeros((10, 64), np.uint8))


def test_reference_matches_dense_float64_layer():
    rng = np.random.default_rng(3)
    E, K, N, M, k = 4, 64, 64, 6, 2
    w = moe.MoEWeights.random(E, K, N, seed=3, std=0.1)
    x_bits = moe.f32_to_bf16_bits(rng.normal(0, 1, (M, K)))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)])
    wts = rng.random((M, k)).astype(np.float32)
    y = moe.moe_w4a16_reference(x_bits, w, ids, wts)
    x = moe.bf16_bits_to_f32(x_bits).astype(np.float64)
    for m in range(M):
        acc = np.zeros(K)
        for j in range(k):
            e = ids[m, j]
            g = moe.dequantize_w4(w.q_gate[e], w.s_gate[e]) @ x[m]
            u = moe.dequantize_w4(w.q_up[e], w.s_up[e]) @ x[m]
            h = moe.round_bf16(g / (1 + np.exp(-g)) * u)
            acc += wts[m, j] * (moe.dequantize_w4(w.q_down[e], w.s_down[e]) @ h)
        np.testing.assert_allclose(y[m], acc, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="topk_ids"):
        moe.moe_w4a16_reference(x_bits, w, ids + E, wts)


# ----------------------------------------------------------------------------- GPU


def _gpu_case(E, K, N, M, k, seed):
    import cupy as cp

    rng = np.random.default_rng(seed)
    w = moe.MoEWeights.random(E, K, N, seed=seed, std=0.05)
    x_bits = moe.f32_to_bf16_bits(rng.normal(0, 1, (M, K)))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    wts = rng.random((M, k)).astype(np.float32)
    ref = moe.moe_w4a16_reference(x_bits, w, ids, wts)
    routing = moe.prepare_routing(cp.asarray(ids), cp.asarray(wts), E)
    packed = moe.upload(moe.pack_moe(w))

    def run(**kw):
        return moe.moe_w4a16(cp.asarray(x_bits), packed, routing, sync=True, **kw)

    return run(), ref, routing, run


@pytest.mark.gpu
@pytest.mark.parametrize(
    "E,K,N,M,k,variant",
    [
        (16, 512, 128, 5, 4, "n8"),        # decode: <= 8 tokens per expert
        (16, 512, 128, 200, 4, "n32"),     # ~50 tokens per expert: two 32-token passes
        (16, 7168, 256, 3, 8, "n8"),       # Kimi-K2 TP8 shard shapes
        (8, 7168, 256, 40, 8, "n32"),      # every expert touched, 40 tokens each
    ],
)
def test_kernel_matches_reference(E, K, N, M, k, variant):
    y, ref, routing, run = _gpu_case(E, K, N, M, k, seed=E + M)
    assert (routing.max_count <= 8) == (variant == "n8")
    check.assert_close(y, ref, rtol=5e-3, name=f"moe_w4a16 E{E} K{K} N{N} M{M} top{k}")
    if variant == "n8":   # the 8-warp gate/up block shape computes the same
        check.assert_close(run(gate_up_warps=8), ref, rtol=5e-3, name=f"moe_w4a16 (8-warp gate/up) M{M}")


@pytest.mark.gpu
def test_kernel_accepts_torch_bf16_and_rejects_bad_input():
    import cupy as cp
    import torch

    E, K, N, M, k = 8, 256, 64, 4, 2
    rng = np.random.default_rng(0)
    w = moe.MoEWeights.random(E, K, N, seed=0, std=0.05)
    packed = moe.upload(moe.pack_moe(w))
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    wts = np.full((M, k), 0.5, np.float32)
    routing = moe.prepare_routing(torch.from_numpy(ids).cuda(), torch.from_numpy(wts).cuda(), E)
    y = moe.moe_w4a16(x, packed, routing, sync=True)
    x_bits = x.view(torch.int16).cpu().numpy().view(np.uint16)
    check.assert_close(y, moe.moe_w4a16_reference(x_bits, w, ids, wts), rtol=5e-3, name="torch bf16 input")
    with pytest.raises(ValueError, match="x must be"):
        moe.moe_w4a16(cp.zeros((M + 1, K), cp.uint16), packed, routing)
    with pytest.raises(ValueError, match="uint16"):
        moe.moe_w4a16(cp.zeros((M, K), cp.float32), packed, routing)
    with pytest.raises(ValueError, match="gate_up_warps"):
        moe.moe_w4a16(x, packed, routing, gate_up_warps=4)
    with pytest.raises(ValueError, match="topk_ids must lie"):
        moe.prepare_routing(cp.asarray(ids + E), cp.asarray(wts), E)
