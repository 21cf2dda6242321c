"""W4A16 MoE: the quantizer and packing on the CPU (against an emulation of the mma.sync fragment
layout, written from the PTX ISA's m16n8k16 tables), the kernel against the float64 reference on
the GPU (gpu-marked)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlib import check
from kdlib.cuda import loader, moe
from kdlib.perf.suites import moe as suite

# ----------------------------------------------------------------------------- CPU: quantizer


def test_bf16_round_trip_and_rounding():
    vals = np.array([1.0, -2.5, 3.0e-3, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8], dtype=np.float32)
    out = moe.bf16_bits_to_f32(moe.f32_to_bf16_bits(vals))
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: nearest even is 1.0; 1 + 3*2^-8 rounds up to 1 + 2^-6
    np.testing.assert_array_equal(
        out, np.array([1.0, -2.5, np.float32(out[2]), 1.0, 1.0 + 2.0**-6], np.float32)
    )
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
    """The numpy quantizers and their torch twins (kdlib.engine.int4) refuse the same shapes; the twins
    gave torch's reshape errors (a last axis of 33 or 16) and a bare size mismatch."""
    import torch

    from kdlib.engine import int4

    for quantize in (moe.quantize_w4, int4.quantize_w4_torch):
        for shape in ((4, 40), (2, 33), (2, 16), (32,)):
            x = np.zeros(shape, np.float32)
            with pytest.raises(ValueError, match=r"multiple of the group 32 \(shape"):
                quantize(x if quantize is moe.quantize_w4 else torch.from_numpy(x))
    q, s = moe.quantize_w4(np.ones((2, 64), np.float32))
    for dequantize, wrap in ((moe.dequantize_w4, np.asarray), (int4.dequantize_w4_torch, torch.from_numpy)):
        for bad in (s[:, :1], s[:1]):
            with pytest.raises(ValueError, match=r"q \(2, 64\) and scales \(\d, \d\) disagree \(group 32\)"):
                dequantize(wrap(q), wrap(bad.view(np.int16) if wrap is torch.from_numpy else bad))


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
        s_row = {
            0: float(moe.bf16_bits_to_f32(np.uint16(sw & 0xFFFF))),
            1: float(moe.bf16_bits_to_f32(np.uint16(sw >> 16))),
        }
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


def test_pack_rows_refuses_signed_and_non_integer_q():
    """Signed INT4 (-8..7) would wrap to 0xFFFFFFFF in the uint32 cast and spill into the other nibbles;
    floats and bools are no INT4 codes. Integer dtypes holding 0..15 pack as uint8 does."""
    for bad in (np.full((16, 64), -1, np.int8), np.arange(-8, 8, dtype=np.int16).repeat(64).reshape(16, 64)):
        with pytest.raises(ValueError, match=r"pack_rows: q must hold 0\.\.15 \(INT4 with zero point 8"):
            moe.pack_rows(bad)
    for bad in (np.full((16, 64), 3.0, np.float32), np.ones((16, 64), np.bool_)):
        with pytest.raises(ValueError, match=r"q must hold integers 0\.\.15 .* got (float32|bool)"):
            moe.pack_rows(bad)
    q = np.random.default_rng(0).integers(0, 16, (2, 16, 64))
    for dtype in (np.int8, np.int32, np.uint16):
        np.testing.assert_array_equal(moe.pack_rows(q.astype(dtype)), moe.pack_rows(q.astype(np.uint8)))


def test_bf16_bits_refuse_float_scales():
    """A float array cast to uint16 truncates scales below 1 to 0: the bf16 bit helpers take only uint16
    (or int16, the same bits) and name the argument otherwise."""
    q, s = moe.quantize_w4(np.random.default_rng(1).normal(0, 0.02, (16, 64)))
    floats = moe.bf16_bits_to_f32(s)                             # the scales' values, < 1
    for call, match in ((moe.pack_scales, "pack_scales: scales"),
                        (lambda a: moe.dequantize_w4(q, a), "dequantize_w4: scales"),
                        (moe.bf16_bits_to_f32, "bf16_bits_to_f32: b")):
        for bad in (floats, floats.astype(np.float64), s.astype(np.int32)):
            with pytest.raises(ValueError, match=f"{match} must hold bf16 bit patterns"):
                call(bad)
    np.testing.assert_array_equal(moe.pack_scales(s.view(np.int16)), moe.pack_scales(s))
    np.testing.assert_array_equal(moe.dequantize_w4(q, s.view(np.int16)), moe.dequantize_w4(q, s))
    assert moe.bf16_bits_to_f32(np.uint16(0x3F80)) == 1.0


def test_torch_twins_refuse_what_the_numpy_ones_refuse():
    """kdlib.engine.int4's packers and dequantizer share the numpy checks: scale values (not bf16 bits)
    packed to zeros, float16 scales were read as bf16 bits, signed -8..7 packed into the wrong words and a
    partial tile gave torch's reshape error. Integer q and int16 / uint16 scales pack as the numpy ones."""
    import torch

    from kdlib.engine import int4

    q, s = moe.quantize_w4(np.random.default_rng(2).normal(0, 0.02, (2, 16, 64)))
    qt, st16 = torch.from_numpy(q), torch.from_numpy(s.view(np.int16))
    for bad in (st16.view(torch.bfloat16), st16.view(torch.bfloat16).float(), st16.view(torch.float16),
                st16.to(torch.int32)):
        with pytest.raises(ValueError, match="pack_scales_torch: s must hold bf16 bit patterns"):
            int4.pack_scales_torch(bad)
        with pytest.raises(ValueError, match="dequantize_w4_torch: s must hold bf16 bit patterns"):
            int4.dequantize_w4_torch(qt, bad)
    with pytest.raises(ValueError, match=r"pack_rows_torch: q must hold 0\.\.15 .*got \[-\d, \d\]"):
        int4.pack_rows_torch(qt.to(torch.int8) - 8)
    for bad, dtype in ((qt.float(), "float32"), (qt > 7, "bool")):
        with pytest.raises(ValueError, match=rf"pack_rows_torch: q must hold integers .* got {dtype}$"):
            int4.pack_rows_torch(bad)
    for call, bad in ((int4.pack_rows_torch, qt[:, :8]), (int4.pack_rows_torch, qt[..., :32]),
                      (int4.pack_scales_torch, st16[:, :8]), (int4.pack_scales_torch, st16[..., :1])):
        with pytest.raises(ValueError, match=r"_torch: rows \d+ must be a multiple of 16 and columns \d+ of"):
            call(bad)
    words = moe.pack_rows(q).view(np.int32)
    for dtype in (torch.uint8, torch.int8, torch.int32, torch.uint16):
        np.testing.assert_array_equal(int4.pack_rows_torch(qt.to(dtype)).numpy(), words)
    for scales in (st16, torch.from_numpy(s).view(torch.uint16)):
        packed = int4.pack_scales_torch(scales).numpy()
        np.testing.assert_array_equal(packed, moe.pack_scales(s).view(np.int32))
        np.testing.assert_array_equal(int4.dequantize_w4_torch(qt, scales).numpy(), moe.dequantize_w4(q, s))


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


def test_reference_refuses_non_integer_ids():
    """As prepare_routing (its GPU twin) does: the int64 cast truncated float ids (0.9 -> expert 0) and
    took bools as experts 0 and 1."""
    w = moe.MoEWeights.random(2, 64, 64, seed=0)
    x_bits = moe.f32_to_bf16_bits(np.ones((2, 64)))
    wts = np.ones((2, 1), np.float32)
    for ids, dtype in ((np.full((2, 1), 0.9), "float64"), (np.ones((2, 1), np.float32), "float32"),
                       (np.ones((2, 1), np.bool_), "bool")):
        with pytest.raises(ValueError, match=f"topk_ids must hold integers, got {dtype}"):
            moe.moe_w4a16_reference(x_bits, w, ids, wts)
    y = moe.moe_w4a16_reference(x_bits, w, np.ones((2, 1), np.uint8), wts)
    np.testing.assert_array_equal(y, moe.moe_w4a16_reference(x_bits, w, np.ones((2, 1), np.int64), wts))


# ----------------------------------------------------------------------------- GPU


@functools.cache   # the versions share a case's weights, reference and routing
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

    return ref, routing, run


@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2, 3, None])
@pytest.mark.parametrize(
    "E,K,N,M,k,variant",
    [
        (16, 512, 128, 5, 4, "n8"),        # decode: <= 8 tokens per expert
        (16, 7168, 256, 1, 8, "n8"),       # one token: fewer gate/up items than v3's blocks
        (16, 512, 128, 200, 4, "n32"),     # ~50 tokens per expert: two 32-token passes (v2: v1's kernels)
        (16, 512, 128, 32, 4, "n16"),      # ~8 tokens per expert, at most 12
        (16, 7168, 256, 3, 8, "n8"),       # Kimi-K2 TP8 shard shapes
        (8, 7168, 256, 40, 8, "n32"),      # every expert touched, 40 tokens each
        (32, 2048, 256, 24, 4, "n8"),      # 512 gate/up items: v2's persistent blocks walk several each
    ],
)
def test_kernel_matches_reference(E, K, N, M, k, variant, version):
    ref, routing, run = _gpu_case(E, K, N, M, k, seed=E + M)
    per_pass = 8 if routing.max_count <= 8 else 16 if routing.max_count <= 16 else 32
    assert f"n{per_pass}" == variant, f"routing gave max {routing.max_count} tokens per expert"
    name = f"moe_w4a16 v{version} E{E} K{K} N{N} M{M} top{k}"
    check.assert_close(run(version=version), ref, rtol=5e-3, name=name)
    if variant == "n8" and version in (1, 2):   # the other gate/up block shapes compute the same
        others = [moe.V1Settings(8)] if version == 1 else [moe.V2Settings(16),
                                                            moe.V2Settings(k_interleave=True)]
        for settings in others:
            check.assert_close(run(settings=settings), ref, rtol=5e-3, name=f"{name} {settings}")


@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2, 3])
def test_kernel_overwrites_a_dirty_out(version):
    """`out` full of NaN from an earlier use: v1 fills it, v2 and v3 zero it inside their launch."""
    import cupy as cp

    ref, routing, run = _gpu_case(16, 512, 128, 5, 4, seed=11)
    out = cp.full((5, 512), cp.nan, dtype=cp.float32)
    check.assert_close(
        run(version=version, out=out), ref, rtol=5e-3, name=f"v{version} into a NaN-filled out"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2, 3])
def test_kernel_accepts_torch_bf16_and_rejects_bad_input(version):
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
    y = moe.moe_w4a16(x, packed, routing, sync=True, version=version)
    x_bits = x.view(torch.int16).cpu().numpy().view(np.uint16)
    check.assert_close(y, moe.moe_w4a16_reference(x_bits, w, ids, wts), rtol=5e-3, name=f"v{version} torch "
                                                                                        "bf16 input")
    with pytest.raises(ValueError, match="x must be"):
        moe.moe_w4a16(cp.zeros((M + 1, K), cp.uint16), packed, routing)
    with pytest.raises(ValueError, match="uint16"):
        moe.moe_w4a16(cp.zeros((M, K), cp.float32), packed, routing)
    with pytest.raises(ValueError, match="gate_up_warps"):
        moe.moe_w4a16(x, packed, routing, gate_up_warps=4, version=version)
    with pytest.raises(ValueError, match="version must be None or one of"):
        moe.moe_w4a16(x, packed, routing, version=4)
    with pytest.raises(ValueError, match="k_interleave"):
        moe.moe_w4a16(x, packed, routing, version=version, gate_up_warps=16, k_interleave=True)
    with pytest.raises(ValueError, match="topk_ids must lie"):
        moe.prepare_routing(cp.asarray(ids + E), cp.asarray(wts), E)
    with pytest.raises(ValueError, match="topk_ids must lie"):  # the int32 cast would make it a valid id
        moe.prepare_routing(cp.asarray(ids.astype(np.int64) + 2**32), cp.asarray(wts), E)
    with pytest.raises(ValueError, match="integers"):
        moe.prepare_routing(cp.asarray(ids.astype(np.float32)), cp.asarray(wts), E)


@pytest.mark.gpu
def test_kernel_refuses_strided_and_misaligned_buffers():
    """The kernels index every buffer from its base in 16-byte pieces: a strided view of the packed
    weights (every other expert) and bf16 x, out or h starting 2 or 4 bytes past a 16-byte boundary are
    refused by name before any launch; the same data copied runs."""
    import cupy as cp
    import torch

    E, K, N, M, k = 4, 256, 64, 3, 2
    w = moe.MoEWeights.random(E, K, N, seed=5, std=0.05)
    packed = moe.upload(moe.pack_moe(w))
    every_other = {key: a[::2] for key, a in packed.items()}     # experts 0 and 2, strided
    rng = np.random.default_rng(5)
    ids = np.stack([rng.choice(E // 2, k, replace=False) for _ in range(M)]).astype(np.int32)
    wts = np.full((M, k), 0.5, np.float32)
    routing = moe.prepare_routing(cp.asarray(ids), cp.asarray(wts), E // 2)
    x_bits = moe.f32_to_bf16_bits(rng.normal(0, 1, (M, K)))
    x = cp.asarray(x_bits)
    with pytest.raises(ValueError, match=r"packed\['w1'\] must be C-contiguous"):
        moe.moe_w4a16(x, every_other, routing)
    with pytest.raises(ValueError, match=r"packed\['s1'\] must be C-contiguous"):
        moe.moe_w4a16(x, {**every_other, "w1": cp.ascontiguousarray(every_other["w1"])}, routing)
    half = {key: cp.ascontiguousarray(a) for key, a in every_other.items()}
    w_half = moe.MoEWeights(*(getattr(w, f.name)[::2] for f in dataclasses.fields(w)))
    want = moe.moe_w4a16_reference(x_bits, w_half, ids, wts)
    check.assert_close(moe.moe_w4a16(x, half, routing, sync=True), want, rtol=5e-3, name="copied halves")
    flat = torch.zeros(M * K + 8, dtype=torch.bfloat16, device="cuda")
    shifted = flat[1:1 + M * K].view(M, K)                    # C-contiguous, 2 bytes off a boundary
    shifted.copy_(torch.from_numpy(x_bits.view(np.int16)).cuda().view(torch.bfloat16))
    with pytest.raises(ValueError, match="x must start on a 16-byte boundary"):
        moe.moe_w4a16(shifted, half, routing)
    with pytest.raises(ValueError, match="x must start on a 16-byte boundary"):
        moe.moe_w4a16(cp.zeros(M * K + 1, cp.uint16)[1:].reshape(M, K), half, routing)
    with pytest.raises(ValueError, match="out must start on a 16-byte boundary"):
        moe.moe_w4a16(x, half, routing, out=cp.zeros(M * K + 1, cp.float32)[1:].reshape(M, K))
    with pytest.raises(ValueError, match="h must start on a 16-byte boundary"):
        moe.moe_w4a16(x, half, routing, h=cp.zeros(M * k * N + 1, cp.uint16)[1:].reshape(M * k, N))
    check.assert_close(moe.moe_w4a16(shifted.clone(), half, routing, sync=True), want, rtol=5e-3,
                       name="aligned copy of x")


# ----------------------------------------------------------------------------- CPU: kernel emulation
# A line-by-line transliteration of the two kernels' index arithmetic (flat pointers, block / warp /
# lane decomposition, C-fragment epilogues) with the warp's mma done on the fragments all 32 lanes
# hold. It checks the kernel's addressing against the host packing and the reference, on the CPU.


def _emu_dequant(words: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """dequant8 for 32 lanes: words, scales [32] uint32 -> A registers as float64 pairs [32, 4, 2]."""
    out = np.empty((32, 4, 2))
    s_lo = moe.bf16_bits_to_f32((scales & 0xFFFF).astype(np.uint16)).astype(np.float64)
    s_hi = moe.bf16_bits_to_f32((scales >> 16).astype(np.uint16)).astype(np.float64)
    for j in range(4):
        v = ((words >> np.uint32(4 * j)) & np.uint32(0x000F000F)) | np.uint32(0x43004300)
        lo = moe.bf16_bits_to_f32((v & 0xFFFF).astype(np.uint16)).astype(np.float64)   # 128 + q
        hi = moe.bf16_bits_to_f32((v >> 16).astype(np.uint16)).astype(np.float64)
        s = s_hi if j & 1 else s_lo
        out[:, j, 0] = moe.round_bf16((lo - 136.0) * s)
        out[:, j, 1] = moe.round_bf16((hi - 136.0) * s)
    return out


def _emu_mma(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """acc [32, 4] += the m16n8k16 product of A regs a [32, 4, 2] and B regs b [32, 2, 2] (PTX layout)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for r, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, col:col + 2] = a[lane, r]
        B[2 * t:2 * t + 2, g] = b[lane, 0]
        B[2 * t + 8:2 * t + 10, g] = b[lane, 1]
    D = A @ B
    for lane in range(32):
        g, t = divmod(lane, 4)
        acc[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def _emu_load_b(src: np.ndarray, rows: list, col0: int) -> np.ndarray:
    """load_b for 32 lanes: rows[g] (row offset or None) -> B regs [32, 8 words, 2 halves] as float64."""
    b = np.zeros((32, 8, 2))
    for lane in range(32):
        g, t = divmod(lane, 4)
        if rows[g] is not None:
            vals = moe.bf16_bits_to_f32(src[rows[g] + col0 + 16 * t: rows[g] + col0 + 16 * t + 16])
            b[lane] = vals.reshape(8, 2)
    return b


def _emulate(x_bits, packed, ids, wts, E, K, N, warps_n8=16):
    M, k = ids.shape
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    off = np.concatenate([[0], np.cumsum(counts)])
    active = np.nonzero(counts)[0]
    stok, swt = order // k, wts.reshape(-1)[order]
    nch, kb_g, warps = (
        (1, 7, warps_n8) if counts.max() <= 8 else (2, 4, 8) if counts.max() <= 16 else (4, 2, 8)
    )
    kb_d = 4 if nch <= 2 else 2
    passes = -(-counts.max() // (8 * nch))
    w1 = packed["w1"].reshape(-1, 4)
    s1 = packed["s1"].reshape(-1)
    w2 = packed["w2"].reshape(-1, 4)
    s2 = packed["s2"].reshape(-1)
    x = np.asarray(x_bits).reshape(-1)
    S, P, KC, RT, NC = M * k, N // 16, K // 64, K // 16, N // 64
    h = np.zeros(S * N, np.uint16)
    y = np.zeros(M * K)
    lanes = np.arange(32)
    g_l, t_l = lanes // 4, lanes % 4
    for e in active:                                         # gate/up: blockIdx.y walks these
        for z in range(passes):
            end, slot0 = off[e + 1], off[e] + z * 8 * nch
            if slot0 >= end:
                continue
            for p in range(P):                               # blockIdx.x
                red = np.zeros((warps, nch * 8, 32))
                tile_base = e * P + p
                for warp in range(warps):
                    xrow = [[(stok[s] * K if (s := slot0 + 8 * c + g) < end else None) for g in range(8)]
                            for c in range(nch)]
                    acc = np.zeros((nch, 2, 32, 4))
                    per = -(-KC // warps)
                    kbeg, kend = warp * per, min(KC, warp * per + per)
                    for k0 in range(kbeg, kend, kb_g):
                        for j in range(kb_g):
                            if k0 + j >= kend:
                                continue
                            b = [_emu_load_b(x, xrow[c], (k0 + j) * 64) for c in range(nch)]
                            for u in range(2):
                                wv = w1[(tile_base * KC * 2 + (k0 + j) * 2 + u) * 32 + lanes]
                                sv = s1[
                                    tile_base * KC * 2 * 16 + ((k0 + j) * 2 + u) * 16 + (t_l >> 1) * 8 + g_l
                                ]
                                for i in range(4):
                                    af = _emu_dequant(wv[:, i], sv)
                                    for c in range(nch):
                                        _emu_mma(acc[c, u], af, b[c][:, 2 * i:2 * i + 2])
                    for c in range(nch):
                        for u in range(2):
                            for r in range(4):
                                red[warp, (c * 2 + u) * 4 + r] = acc[c, u, :, r]
                for idx in range(nch * 4 * 32):
                    ln, r, c = idx & 31, (idx >> 5) & 3, idx >> 7
                    gs = red[:, (c * 2) * 4 + r, ln].sum()
                    us = red[:, (c * 2 + 1) * 4 + r, ln].sum()
                    row = (ln >> 2) + (8 if r >= 2 else 0)
                    slot = slot0 + 8 * c + 2 * (ln & 3) + (r & 1)
                    if slot < end:
                        h[slot * N + p * 16 + row] = moe.f32_to_bf16_bits(gs / (1 + np.exp(-gs)) * us)
    for e in active:                                         # down
        for z in range(passes):
            end, slot0 = off[e + 1], off[e] + z * 8 * nch
            if slot0 >= end:
                continue
            for bx in range(-(-RT // 16)):
                for warp in range(8):
                    rt0 = (bx * 8 + warp) * 2
                    if rt0 >= RT:
                        continue
                    hrow = [
                        [(s * N if (s := slot0 + 8 * c + g) < end else None) for g in range(8)]
                        for c in range(nch)
                    ]
                    acc = np.zeros((2, nch, 32, 4))
                    for k0 in range(0, NC, kb_d):
                        for j in range(kb_d):
                            if k0 + j >= NC:
                                continue
                            b = [_emu_load_b(h, hrow[c], (k0 + j) * 64) for c in range(nch)]
                            for q in range(2):
                                rt = rt0 + q
                                if rt >= RT:
                                    continue
                                tile = (e * RT + rt) * NC + (k0 + j)
                                wv, sv = w2[tile * 32 + lanes], s2[tile * 16 + (t_l >> 1) * 8 + g_l]
                                for i in range(4):
                                    af = _emu_dequant(wv[:, i], sv)
                                    for c in range(nch):
                                        _emu_mma(acc[q, c], af, b[c][:, 2 * i:2 * i + 2])
                    for c in range(nch):
                        for half in range(2):
                            for lane in range(32):
                                g, t = divmod(lane, 4)
                                slot = slot0 + 8 * c + 2 * t + half
                                if slot >= end:
                                    continue
                                for q in range(2):
                                    rt = rt0 + q
                                    if rt < RT:
                                        y[stok[slot] * K + rt * 16 + g] += swt[slot] * acc[q, c, lane, half]
                                        y[stok[slot] * K + rt * 16 + g + 8] += (
                                            swt[slot] * acc[q, c, lane, 2 + half]
                                        )
    return y.reshape(M, K)


# n8, n8w8, n16, n32 x2
@pytest.mark.parametrize("M,k,warps", [(5, 2, 16), (5, 2, 8), (24, 2, 8), (80, 2, 8)])
def test_kernel_addressing_emulated_on_cpu(M, k, warps):
    E, K, N = 4, 128, 64
    rng = np.random.default_rng(M)
    w = moe.MoEWeights.random(E, K, N, seed=M, std=0.1)
    x_bits = moe.f32_to_bf16_bits(rng.normal(0, 1, (M, K)))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    wts = rng.random((M, k)).astype(np.float32)
    y = _emulate(x_bits, moe.pack_moe(w), ids, wts, E, K, N, warps_n8=warps)
    check.assert_close(y, moe.moe_w4a16_reference(x_bits, w, ids, wts), rtol=2e-3, name="emulated kernel "
                                                                                        f"M{M}")


def test_suite_helpers_route_distinct_experts_and_count_bytes():
    ids, w = suite.routing(np.random.default_rng(0), 50)
    assert ids.shape == (50, suite.TOPK) and all(len(set(r)) == suite.TOPK for r in ids.tolist())
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
    assert suite.expected_touched(1) == pytest.approx(suite.TOPK)
    acct = moe.layer_bytes_flops(9, 66.0, suite.K, suite.N, suite.TOPK)
    assert acct["weight_bytes"] == 66 * moe.packed_bytes_per_expert(suite.K, suite.N)
    assert acct["flops"] == 2 * 9 * 8 * 3 * 7168 * 256


def test_suite_knee_from_times_interpolates_the_plateau_onset():
    rows = [{"m": m, "kernel": {"median_ms": min(m, 100) / 100}} for m in (1, 10, 80, 90, 256, 512, 1024)]
    assert suite._knee_from_times(rows, "kernel") == pytest.approx(85.0, rel=0.01)
    assert suite._knee_from_times([{"m": 1, "kernel": {"median_ms": 1.0}}], "kernel") is None


# ----------------------------------------------------------------------------- CPU: v2 emulation
# The v2 kernels transliterated the same way: persistent grids, per-warp cp.async rings (a stage
# array written at issue and read at consume, so a wrong cursor or stage index shows up as a wrong
# result), the gate/up item stride and K split, the down kernel's per-warp item ranges.


def _emulate_v2(x_bits, packed, ids, wts, E, K, N, *, warps, stages, sms, interleave=False, down_warps=16,
                down_stages=8):
    M, k = ids.shape
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    assert counts.max() <= 8, "v2 takes <= 8 slots per expert"
    off = np.concatenate([[0], np.cumsum(counts)])
    active = np.nonzero(counts)[0]
    stok, swt = order // k, wts.reshape(-1)[order]
    w1, s1 = packed["w1"].reshape(-1, 4), packed["s1"].reshape(-1)
    w2, s2 = packed["w2"].reshape(-1, 4), packed["s2"].reshape(-1)
    x = np.asarray(x_bits).reshape(-1)
    S, P, KC, RT, NC = M * k, N // 16, K // 64, K // 16, N // 64
    h = np.zeros(S * N, np.uint16)
    y = np.full(M * K, np.nan)                   # the gate/up launch must zero it
    lanes = np.arange(32)
    g_l, t_l = lanes // 4, lanes % 4
    # gate/up: grid = min(items, sms) blocks (one per SM, as the wrapper sizes it)
    n_items = len(active) * P
    grid = min(n_items, sms)
    y[:] = 0.0
    for bx in range(grid):
        my_items = (n_items - 1 - bx) // grid + 1 if n_items > bx else 0
        per_warp = -(-KC // warps)
        partial = np.zeros((my_items, warps, 8, 32))
        for warp in range(warps):
            if interleave:
                kbeg, kstep, cnt = warp, warps, ((KC - 1 - warp) // warps + 1 if warp < KC else 0)
            else:
                kbeg, kstep = min(KC, warp * per_warp), 1
                cnt = min(KC, kbeg + per_warp) - kbeg
            total = my_items * cnt
            ring_w = np.zeros((stages, 2, 32, 4), np.uint32)
            ring_x = np.zeros((stages, 32, 16), np.uint16)
            ring_s = np.zeros((stages, 2, 32), np.uint32)
            cur = {"it": 0, "c": 0, "stage": 0}

            def issue(
                cur=cur, kbeg=kbeg, kstep=kstep, cnt=cnt, bx=bx, ring_w=ring_w, ring_x=ring_x, ring_s=ring_s
            ):
                item = bx + cur["it"] * grid
                a_idx, p = divmod(item, P)
                e = active[a_idx]
                slot = off[e] + g_l
                valid = slot < off[e + 1]
                chunk0 = (e * P + p) * KC + kbeg
                st, c = cur["stage"], cur["c"] * kstep
                for u in range(2):
                    ring_w[st, u] = w1[(chunk0 + c) * 2 * 32 + u * 32 + lanes]
                    ring_s[st, u] = s1[(chunk0 + c) * 2 * 16 + u * 16 + (t_l >> 1) * 8 + g_l]
                for ln in range(32):
                    if valid[ln]:
                        base = stok[slot[ln]] * K + (kbeg + c) * 64 + 16 * t_l[ln]
                        ring_x[st, ln] = x[base:base + 16]
                    else:
                        ring_x[st, ln] = 0
                cur["stage"] = (st + 1) % stages
                cur["c"] += 1
                if cur["c"] == cnt:
                    cur["c"], cur["it"] = 0, cur["it"] + 1

            issued = 0
            for _ in range(stages - 1):
                if issued < total:
                    issue()
                    issued += 1
            stage_c = 0
            for it in range(my_items):
                acc = np.zeros((2, 32, 4))
                for _ in range(cnt):
                    if issued < total:
                        issue()
                        issued += 1
                    xb = moe.bf16_bits_to_f32(ring_x[stage_c]).astype(np.float64).reshape(32, 8, 2)
                    for u in range(2):
                        for i in range(4):
                            af = _emu_dequant(ring_w[stage_c, u, :, i], ring_s[stage_c, u])
                            _emu_mma(acc[u], af, xb[:, 2 * i:2 * i + 2])
                    stage_c = (stage_c + 1) % stages
                for u in range(2):
                    for r in range(4):
                        partial[it, warp, u * 4 + r] = acc[u, :, r]
        for it in range(my_items):
            item = bx + it * grid
            a_idx, p = divmod(item, P)
            e = active[a_idx]
            for tid in range(128):
                ln, r = tid & 31, tid >> 5
                slot = off[e] + 2 * (ln & 3) + (r & 1)
                if slot < off[e + 1]:
                    gs, us = partial[it, :, r, ln].sum(), partial[it, :, 4 + r, ln].sum()
                    row = (ln >> 2) + (8 if r >= 2 else 0)
                    h[slot * N + p * 16 + row] = moe.f32_to_bf16_bits(gs / (1 + np.exp(-gs)) * us)
    # down: grid = min(ceil(items / warps), sms), contiguous item range per warp
    n_items = len(active) * RT
    grid = min(-(-n_items // down_warps), sms)
    tw = grid * down_warps
    for gw in range(tw):
        i0, i1 = n_items * gw // tw, n_items * (gw + 1) // tw
        total = (i1 - i0) * NC
        ring_w = np.zeros((down_stages, 32, 4), np.uint32)
        ring_s = np.zeros((down_stages, 32), np.uint32)
        cur = {"it": i0, "c": 0, "stage": 0}

        def issue_d(cur=cur, ring_w=ring_w, ring_s=ring_s):
            a_idx, rt = divmod(cur["it"], RT)
            chunk0 = (active[a_idx] * RT + rt) * NC
            st, c = cur["stage"], cur["c"]
            ring_w[st] = w2[(chunk0 + c) * 32 + lanes]
            ring_s[st] = s2[(chunk0 + c) * 16 + (t_l >> 1) * 8 + g_l]
            cur["stage"] = (st + 1) % down_stages
            cur["c"] += 1
            if cur["c"] == NC:
                cur["c"], cur["it"] = 0, cur["it"] + 1

        issued = 0
        for _ in range(down_stages - 1):
            if issued < total:
                issue_d()
                issued += 1
        stage_c = 0
        for item in range(i0, i1):
            a_idx, rt = divmod(item, RT)
            e = active[a_idx]
            hrow = [(s * N if (s := off[e] + g) < off[e + 1] else None) for g in range(8)]
            acc = np.zeros((32, 4))
            for c in range(NC):
                if issued < total:
                    issue_d()
                    issued += 1
                b = _emu_load_b(h, hrow, c * 64)
                for i in range(4):
                    _emu_mma(acc, _emu_dequant(ring_w[stage_c, :, i], ring_s[stage_c]), b[:, 2 * i:2 * i + 2])
                stage_c = (stage_c + 1) % down_stages
            for lane in range(32):
                g, t = divmod(lane, 4)
                for half in range(2):
                    slot = off[e] + 2 * t + half
                    if slot < off[e + 1]:
                        y[stok[slot] * K + rt * 16 + g] += swt[slot] * acc[lane, half]
                        y[stok[slot] * K + rt * 16 + g + 8] += swt[slot] * acc[lane, 2 + half]
    return y.reshape(M, K)


@pytest.mark.parametrize(
    "K,warps,stages,sms,interleave",
    [(128, 16, 5, 3, False), (1024, 16, 5, 2, False), (512, 8, 4, 5, False), (1344, 8, 4, 3, True)],
)
def test_kernel_v2_addressing_emulated_on_cpu(K, warps, stages, sms, interleave):
    """Few emulated SMs, so blocks walk several items and the rings wrap across item boundaries."""
    E, N, M, k = 4, 128, 6, 2
    rng = np.random.default_rng(K + warps)
    w = moe.MoEWeights.random(E, K, N, seed=K, std=0.1)
    x_bits = moe.f32_to_bf16_bits(rng.normal(0, 1, (M, K)))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    wts = rng.random((M, k)).astype(np.float32)
    y = _emulate_v2(x_bits, moe.pack_moe(w), ids, wts, E, K, N, warps=warps, stages=stages, sms=sms,
                    interleave=interleave)
    check.assert_close(y, moe.moe_w4a16_reference(x_bits, w, ids, wts), rtol=2e-3, name=f"emulated v2 K{K} "
                                                                                        f"w{warps}")


# ----------------------------------------------------------------------------- CPU: v3 emulation
# The v3 kernel's warps transliterated as coroutines that a random scheduler interleaves: the two
# global counters with the ids taken ahead, the hand-off of a unit from the issue side to the
# consume side (pend), per-warp rings, split items meeting in the scratch, the ready and zeroed
# waits, and the last warp's reset. A wrong id, cursor or stage shows up as a wrong y; a wait that
# can never end as a schedule that stops making progress.
_V3_STAGES = 4
_V3_NONE, _V3_EMPTY = -1, -0x7FFFFFFF


def _emulate_v3(x_bits, packed, ids, wts, E, K, N, *, n_warps, parts, down_batch, seed):
    M, k = ids.shape
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    assert counts.max() <= 8, "v3 takes <= 8 slots per expert"
    off = np.concatenate([[0], np.cumsum(counts)])
    active = np.nonzero(counts)[0]
    n_active = len(active)
    stok, swt = order // k, wts.reshape(-1)[order]
    w1, s1 = packed["w1"].reshape(-1, 4), packed["s1"].reshape(-1)
    w2, s2 = packed["w2"].reshape(-1, 4), packed["s2"].reshape(-1)
    x = np.asarray(x_bits).reshape(-1)
    S, P, KC, RT, NC = M * k, N // 16, K // 64, K // 16, N // 64
    cpp = KC // parts
    n_gu, n_dn = n_active * P * parts, n_active * RT
    n_batches = n_dn // down_batch
    n4 = M * K // 4
    Z = min(n_gu, -(-n4 // 1024))
    zlen = -(-n4 // Z)
    ws = {"gu": 0, "dn": 0, "zeroed": 0, "done": 0}
    ready = np.zeros(E, int)
    parts_done = np.zeros(E * P, int)
    scratch = np.zeros((E * P, 2, 4, 32))
    h = np.zeros(S * N, np.uint16)
    y = np.full(M * K, np.nan)                   # the first items must zero it
    lanes = np.arange(32)
    g_l, t_l = lanes // 4, lanes % 4

    def take(counter, early):
        if early >= 0:
            return early
        ws[counter] += 1
        return ws[counter] - 1

    def warp_proc():
        ring_w = np.zeros((_V3_STAGES, 4, 32, 4), np.uint32)   # vector slots (gate/up: gate, up; down: NC)
        ring_x = np.zeros((_V3_STAGES, 32, 16), np.uint16)
        ring_s = np.zeros((_V3_STAGES, 4, 32), np.uint32)
        st = {"iu": _V3_EMPTY, "ic": 0, "i_end": 0, "early": -1, "pend": _V3_EMPTY, "istage": 0,
              "wsrc": 0, "ssrc": 0, "xsrc": None, "ia": 0, "irt": 0}

        def start_gate_up(j):
            pair, part = divmod(j, parts)
            a_idx, p = divmod(pair, P)
            e = active[a_idx]
            slot = off[e] + g_l
            k0 = part * cpp
            st["xsrc"] = [stok[slot[ln]] * K + k0 * 64 + 16 * t_l[ln] if slot[ln] < off[e + 1] else None
                          for ln in range(32)]
            chunk0 = (e * P + p) * KC + k0
            st["wsrc"] = chunk0 * 2 * 32 + lanes
            st["ssrc"] = chunk0 * 2 * 16 + (t_l >> 1) * 8 + g_l

        def set_down_src():
            chunk0 = (active[st["ia"]] * RT + st["irt"]) * NC
            st["wsrc"] = chunk0 * 32 + lanes
            st["ssrc"] = chunk0 * 16 + (t_l >> 1) * 8 + g_l

        def next_unit():
            if st["iu"] >= 0 or st["iu"] == _V3_EMPTY:
                j = take("gu", st["early"])
                st["early"] = -1
                if j < n_gu:
                    st.update(iu=j, ic=0, i_end=cpp, pend=j)
                    start_gate_up(j)
                    return
            b = take("dn", st["early"])
            st["early"] = -1
            if b < n_batches:
                st.update(iu=-(b + 2), ic=0, i_end=down_batch)
                st["ia"], st["irt"] = divmod(b * down_batch, RT)
                set_down_src()
            else:
                st["iu"] = _V3_NONE
            st["pend"] = st["iu"]

        def issue_next():
            if st["iu"] == _V3_EMPTY or (st["iu"] != _V3_NONE and st["ic"] == st["i_end"]):
                next_unit()
            i = st["istage"]
            if st["iu"] >= 0:
                if st["ic"] == st["i_end"] - (_V3_STAGES - 1):
                    st["early"] = take("gu", -1)
                ring_w[i, 0], ring_w[i, 1] = w1[st["wsrc"]], w1[st["wsrc"] + 32]
                ring_s[i, 0], ring_s[i, 1] = s1[st["ssrc"]], s1[st["ssrc"] + 16]
                for ln in range(32):
                    src = st["xsrc"][ln]
                    ring_x[i, ln] = x[src:src + 16] if src is not None else 0
                st["wsrc"] = st["wsrc"] + 64
                st["ssrc"] = st["ssrc"] + 32
                st["xsrc"] = [None if src is None else src + 64 for src in st["xsrc"]]
                st["ic"] += 1
                st["istage"] = (i + 1) % _V3_STAGES
            elif st["iu"] != _V3_NONE:
                if st["ic"] == st["i_end"] - (_V3_STAGES - 1):
                    st["early"] = take("dn", -1)
                for c in range(NC):
                    ring_w[i, c], ring_s[i, c] = w2[st["wsrc"] + c * 32], s2[st["ssrc"] + c * 16]
                st["ic"] += 1
                if st["ic"] < st["i_end"]:
                    st["irt"] += 1
                    if st["irt"] == RT:
                        st["irt"], st["ia"] = 0, st["ia"] + 1
                        set_down_src()
                    else:
                        st["wsrc"], st["ssrc"] = st["wsrc"] + NC * 32, st["ssrc"] + NC * 16
                st["istage"] = (i + 1) % _V3_STAGES

        for _ in range(_V3_STAGES - 1):
            issue_next()
        cstage, cur_a, zeroed = 0, -1, False
        b_regs, rows_y = None, None
        cu = st["pend"]
        while cu != _V3_NONE:
            st["pend"] = _V3_EMPTY
            if cu >= 0:
                j = cu
                pair = j // parts
                a_idx, p = divmod(pair, P)
                if j < Z:
                    y[j * zlen * 4:min(n4, (j + 1) * zlen) * 4] = 0.0
                acc = np.zeros((2, 32, 4))
                for _ in range(cpp):
                    issue_next()
                    xb = moe.bf16_bits_to_f32(ring_x[cstage]).astype(np.float64).reshape(32, 8, 2)
                    for u in range(2):
                        for i in range(4):
                            _emu_mma(acc[u], _emu_dequant(ring_w[cstage, u, :, i], ring_s[cstage, u]),
                                     xb[:, 2 * i:2 * i + 2])
                    cstage = (cstage + 1) % _V3_STAGES
                    yield
                last = True
                if parts > 1:
                    scratch[pair] += acc.transpose(0, 2, 1)
                    parts_done[pair] += 1
                    last = parts_done[pair] == parts
                    if last:
                        acc = scratch[pair].transpose(0, 2, 1).copy()
                        scratch[pair] = 0.0
                        parts_done[pair] = 0
                if last:
                    e = active[a_idx]
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        for r in range(4):
                            slot = off[e] + 2 * t + (r & 1)
                            if slot < off[e + 1]:
                                gs, us = acc[0, lane, r], acc[1, lane, r]
                                h[slot * N + p * 16 + g + (8 if r >= 2 else 0)] = moe.f32_to_bf16_bits(
                                    gs / (1 + np.exp(-gs)) * us)
                    ready[a_idx] += 1
                if j < Z:
                    ws["zeroed"] += 1
            else:
                i0 = -(cu + 2) * down_batch
                a_idx, rt = divmod(i0, RT)
                for _item in range(i0, i0 + down_batch):
                    if a_idx != cur_a:
                        cur_a = a_idx
                        e = active[a_idx]
                        rows_y = [(stok[off[e] + 2 * t + half], swt[off[e] + 2 * t + half])
                                  if off[e] + 2 * t + half < off[e + 1] else None
                                  for t in range(4) for half in range(2)]
                        while ready[a_idx] < P:
                            yield
                        hrow = [(s * N if (s := off[e] + g) < off[e + 1] else None) for g in range(8)]
                        b_regs = [_emu_load_b(h, hrow, c * 64) for c in range(NC)]
                    issue_next()
                    acc = np.zeros((32, 4))
                    for c in range(NC):
                        for i in range(4):
                            _emu_mma(acc, _emu_dequant(ring_w[cstage, c, :, i], ring_s[cstage, c]),
                                     b_regs[c][:, 2 * i:2 * i + 2])
                    cstage = (cstage + 1) % _V3_STAGES
                    if not zeroed:
                        while ws["zeroed"] < Z:
                            yield
                        zeroed = True
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        for half in range(2):
                            tw = rows_y[t * 2 + half]
                            if tw is not None:
                                y[tw[0] * K + rt * 16 + g] += tw[1] * acc[lane, half]
                                y[tw[0] * K + rt * 16 + g + 8] += tw[1] * acc[lane, 2 + half]
                    rt += 1
                    if rt == RT:
                        rt, a_idx = 0, a_idx + 1
                    yield
            cu = st["pend"]
        ws["done"] += 1
        if ws["done"] == n_warps:           # the last warp out resets the counters
            ready[:n_active] = 0
            ws.update(gu=0, dn=0, zeroed=0, done=0)

    rng = np.random.default_rng(seed)
    procs = [warp_proc() for _ in range(n_warps)]
    steps = 0
    while procs:
        i = int(rng.integers(len(procs)))
        try:
            next(procs[i])
        except StopIteration:
            procs.pop(i)
        steps += 1
        assert steps < 200_000, "the emulated warps stopped making progress"
    state = {
        "ws": dict(ws),
        "ready": ready.copy(),
        "parts_done": parts_done.copy(),
        "scratch_zero": not scratch.any(),
    }
    return y.reshape(M, K), state


@pytest.mark.parametrize(
    "K,n_warps,parts,down_batch,seed",
    [(256, 3, 1, 4, 0), (256, 5, 1, 8, 1), (512, 2, 2, 4, 2), (768, 7, 3, 4, 3), (512, 16, 2, 8, 4)],
)
def test_kernel_v3_scheduling_emulated_on_cpu(K, n_warps, parts, down_batch, seed):
    """Warps interleaved at random, some taking several units and some none; K split into parts;
    y must match the reference and the workspace must be all zero afterwards."""
    E, N, M, k = 4, 128, 6, 2
    rng = np.random.default_rng(K + n_warps)
    w = moe.MoEWeights.random(E, K, N, seed=K, std=0.1)
    x_bits = moe.f32_to_bf16_bits(rng.normal(0, 1, (M, K)))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    wts = rng.random((M, k)).astype(np.float32)
    y, state = _emulate_v3(x_bits, moe.pack_moe(w), ids, wts, E, K, N, n_warps=n_warps, parts=parts,
                           down_batch=down_batch, seed=seed)
    check.assert_close(y, moe.moe_w4a16_reference(x_bits, w, ids, wts), rtol=2e-3,
                       name=f"emulated v3 K{K} warps {n_warps} parts {parts}")
    assert state["ws"] == {"gu": 0, "dn": 0, "zeroed": 0, "done": 0}
    assert not state["ready"].any() and not state["parts_done"].any() and state["scratch_zero"]


@pytest.mark.gpu
def test_v3_back_to_back_launches_leave_the_workspace_zero():
    """v3's counters live in a workspace the last block resets: 40 launches in a row on one stream,
    each with a new routing (some with fewer gate/up items than blocks), are each right, and the
    workspace is zero after them; a CUDA graph replay of the launch is right too."""
    import cupy as cp

    E, K, N, k = 32, 2048, 128, 4
    w = moe.MoEWeights.random(E, K, N, seed=5, std=0.05)
    packed = moe.upload(moe.pack_moe(w))
    rng = np.random.default_rng(5)
    ws, scratch = moe.v3_workspace(E, N // 16)
    for i in range(40):
        m = (1, 2, 7, 16)[i % 4]
        x_bits = moe.f32_to_bf16_bits(rng.normal(0, 1, (m, K)))
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(m)]).astype(np.int32)
        wts = rng.random((m, k)).astype(np.float32)
        routing = moe.prepare_routing(cp.asarray(ids), cp.asarray(wts), E)
        parts = (None, 1, 2, 8)[i % 4 if i < 8 else 0]   # K / 64 = 32 chunks: 32, 16 or 4 a part
        down_batch = (None, 4, 16, 128)[i // 2 % 4 if i < 8 else 0]   # K / 16 = 128 row tiles
        y = moe.moe_w4a16(cp.asarray(x_bits), packed, routing, version=3, parts=parts, down_batch=down_batch)
        if i % 8 == 7 or i < 8:
            check.assert_close(y, moe.moe_w4a16_reference(x_bits, w, ids, wts), rtol=5e-3,
                               name=f"v3 launch {i} M{m} parts {parts} down_batch {down_batch}")
    cp.cuda.runtime.deviceSynchronize()
    assert not cp.asnumpy(ws).any(), np.nonzero(cp.asnumpy(ws))
    assert not cp.asnumpy(scratch).any()
    with pytest.raises(ValueError, match="parts must divide"):
        moe.moe_w4a16(cp.asarray(x_bits), packed, routing, version=3, parts=3)
    with pytest.raises(ValueError, match="down_batch must divide"):
        moe.moe_w4a16(cp.asarray(x_bits), packed, routing, version=3, down_batch=3)
    with pytest.raises(ValueError, match="parts and down_batch apply"):
        moe.moe_w4a16(cp.asarray(x_bits), packed, routing, version=2, parts=2)

    out = cp.empty((m, K), dtype=cp.float32)
    h = cp.empty((m * k, N), dtype=cp.uint16)
    xb = cp.asarray(x_bits)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        moe.moe_w4a16(xb, packed, routing, out=out, h=h, version=3)
        graph = stream.end_capture()
        for _ in range(3):
            out.fill(cp.nan)
            graph.launch(stream=stream)
    stream.synchronize()
    check.assert_close(out, moe.moe_w4a16_reference(x_bits, w, ids, wts), rtol=5e-3, name="v3 graph replay")
    assert not cp.asnumpy(ws).any()


@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2, 3])
def test_no_local_expert_routed_to_gives_zeros(version):
    """A routing whose device count of active experts is 0 (an expert-parallel rank none of the batch's
    tokens chose): every version writes zeros over a poisoned output (version 3 divided by a zero count
    of items and left it as it was), and v3's workspace is zero after."""
    import cupy as cp

    E, K, N, k, m = 16, 1024, 128, 2, 5
    w = moe.MoEWeights.random(E, K, N, seed=9, std=0.05)
    packed = moe.upload(moe.pack_moe(w))
    rng = np.random.default_rng(9)
    x_bits = moe.f32_to_bf16_bits(rng.normal(0, 1, (m, K)))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(m)]).astype(np.int32)
    routing = moe.prepare_routing(cp.asarray(ids), cp.asarray(rng.random((m, k)).astype(np.float32)), E)
    none = dataclasses.replace(routing, n_active_dev=cp.zeros(1, dtype=cp.int32))
    out = cp.full((m, K), cp.nan, dtype=cp.float32)
    moe.moe_w4a16(cp.asarray(x_bits), packed, none, out=out, version=version)
    assert not cp.asnumpy(out).any() and not np.isnan(cp.asnumpy(out)).any()
    if version == 3:
        cp.cuda.runtime.deviceSynchronize()
        ws, scratch = moe.v3_workspace(E, N // 16)
        assert not cp.asnumpy(ws).any() and not cp.asnumpy(scratch).any()


def test_v3_parts_split_k_only_when_tile_pairs_are_few():
    """Kimi-K2 TP8 shapes on an H200 grid (264 blocks x 8 warps): one token (128 pairs) splits K into
    the most parts that keep 4 chunks each; many pairs need no split; the split always divides K."""
    warps = 264 * 8
    assert moe.v3_parts(112, 128, warps) == 14          # M = 1: the most parts of >= 8 chunks
    assert moe.v3_parts(112, 16 * 59, warps) == 4       # M = 8
    assert moe.v3_parts(112, 16 * 111, warps) == 2      # M = 16
    assert moe.v3_parts(112, 16 * 186, warps) == 1      # M = 32
    for pairs in (1, 16, 100, 500, 1000, 3000):
        d = moe.v3_parts(112, pairs, warps)
        assert 112 % d == 0 and (d == 1 or 112 // d >= 8)
    assert moe.v3_parts(4, 1, warps) == 1   # K = 256: 4 chunks, no split possible
    # down batches: >= 1.3 per warp, up to 32 row tiles, dividing K / 16 = 448
    assert [moe.v3_down_batch(448, n, warps) for n in (8, 31, 59, 111, 186, 384)] == [4, 4, 8, 8, 8, 8]
    assert moe.v3_down_batch(4, 1, warps) == 4 and moe.v3_down_batch(12, 500, warps) == 3
    # the default kernel: v2 at few tile pairs (M <= 4 of Kimi-K2 top-8), v3 from M = 8
    assert [moe.pick_version(16 * n, warps) for n in (8, 16, 31, 59, 111, 384)] == [2, 2, 2, 3, 3, 3]


# ----------------------------------------------------------------------------- compile: v2 resources


@pytest.mark.skipif(loader.nvcc_path() is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_v2_kernels_fit_the_launch_shapes_the_wrapper_assumes(arch):
    """ptxas's report of kernels/moe_w4a16/v2.cu against the wrapper's constants: no spills or stack,
    registers low enough for the resident blocks the persistent grids count on, static shared
    memory equal to the reduction buffer the wrapper budgets; and the H200's shared memory (228 KB
    per SM, 227 KB per block) holds one 16-warp or two 8-warp gate/up blocks."""
    rc, text = loader.compile_report(moe.SOURCE_V2, arch)
    assert rc == 0, text
    rep = loader.parse_ptxas(text)
    names = {
        f"{moe.STEM_V2}_gate_up_w16",
        f"{moe.STEM_V2}_gate_up_w8",
        f"{moe.STEM_V2}_gate_up_w8i",
        f"{moe.STEM_V2}_down",
    }
    assert names <= set(rep), sorted(rep)
    h200 = {"sms": 132, "smem_block": 227 * 1024, "smem_sm": 228 * 1024, "smem_reserved": 1024}
    for warps, suffix in ((16, ""), (8, ""), (8, "i")):
        info = rep[f"{moe.STEM_V2}_gate_up_w{warps}{suffix}"]
        shape = moe.v2_gate_up_shape(warps, h200)
        assert shape["blocks_per_sm"] == (1 if warps == 16 else 2)
        assert info["spill_stores"] == info["spill_loads"] == info["stack"] == 0, info
        assert info["registers"] * shape["threads"] * shape["blocks_per_sm"] <= 65536, info
        assert info["static_smem"] == warps * moe._V2_RED_BYTES_PER_WARP, info
    down = rep[f"{moe.STEM_V2}_down"]
    assert down["spill_stores"] == down["stack"] == 0 and down["registers"] * moe._V2_DOWN[0] <= 65536, down
    # A 100 KB part (sm_120: 99 KB per block) takes only the 8-warp gate/up block.
    small = {"sms": 1, "smem_block": 99 * 1024, "smem_sm": 100 * 1024, "smem_reserved": 1024}
    assert moe.v2_gate_up_shape(16, small)["blocks_per_sm"] == 0
    assert moe.v2_gate_up_shape(8, small)["blocks_per_sm"] == 1


@pytest.mark.skipif(loader.nvcc_path() is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_v3_kernel_fits_the_launch_shape_the_wrapper_assumes(arch):
    """ptxas's report of kernels/moe_w4a16/v3.cu: no spills or stack, registers for two 256-thread
    blocks per SM, static shared memory as budgeted; two blocks per SM on an H200, one on a
    100 KB part."""
    rc, text = loader.compile_report(moe.SOURCE_V3, arch)
    assert rc == 0, text
    info = loader.parse_ptxas(text)[moe.STEM_V3]
    assert info["spill_stores"] == info["spill_loads"] == info["stack"] == 0, info
    assert info["registers"] * moe._V3_THREADS * 2 <= 65536, info
    assert info["static_smem"] == moe._V3_STATIC_SMEM, info
    h200 = {"sms": 132, "smem_block": 227 * 1024, "smem_sm": 228 * 1024, "smem_reserved": 1024}
    assert moe.v3_shape(h200)["blocks_per_sm"] == 2
    small = {"sms": 1, "smem_block": 99 * 1024, "smem_sm": 100 * 1024, "smem_reserved": 1024}
    assert moe.v3_shape(small)["blocks_per_sm"] == 1


def test_launch_settings_name_versions_and_keep_the_old_keywords():
    """Settings objects name their version; the deprecated keywords build the same objects (no device)."""
    V1, V2, V3 = moe.V1Settings, moe.V2Settings, moe.V3Settings
    assert moe.VERSIONS == tuple(moe.SETTINGS) == (1, 2, 3)
    assert moe.launch_settings() == (None, None)
    assert moe.launch_settings(2) == (2, None)
    assert moe.launch_settings(settings=V3(parts=2)) == (3, V3(parts=2))
    assert moe.launch_settings(2, V2(16)) == (2, V2(16))
    # the old keywords: gate_up_warps / k_interleave imply 2, parts / down_batch imply 3
    assert moe.launch_settings(gate_up_warps=16) == (2, V2(16))
    assert moe.launch_settings(k_interleave=True) == (2, V2(k_interleave=True))
    assert moe.launch_settings(parts=4) == (3, V3(parts=4))
    assert moe.launch_settings(3, down_batch=8) == (3, V3(down_batch=8))
    assert moe.launch_settings(1, gate_up_warps=8) == (1, V1(8))
    for kwargs, match in (
        ({"version": 4}, "version must be None or one of"),
        ({"version": 1, "settings": V2()}, "version 2's"),
        ({"settings": V2(), "parts": 2}, "not both"),
        ({"settings": {"parts": 2}}, "V1Settings, V2Settings or V3Settings"),
        ({"settings": V1(4)}, "gate_up_warps must be 8 or 16"),
        ({"gate_up_warps": 4}, "gate_up_warps must be 8 or 16"),
        ({"version": 3, "gate_up_warps": 8}, "version 3 has one block shape"),
        ({"version": 2, "parts": 2}, "parts and down_batch apply"),
        ({"version": 1, "k_interleave": True}, "k_interleave needs"),
        ({"settings": V2(16, True)}, "k_interleave needs"),
    ):
        with pytest.raises(ValueError, match=match):
            moe.launch_settings(**kwargs)
    for bad in ({"parts": 0}, {"down_batch": 0}, {"parts": 2.0}, {"down_batch": True}):
        with pytest.raises(ValueError, match="must be an int >= 1 or None"):  # not a modulo by zero later
            V3(**bad)
        with pytest.raises(ValueError, match="must be an int >= 1 or None"):
            moe.launch_settings(**bad)


def test_launch_settings_refuse_version_2_and_3_keywords_together():
    """With version None, gate_up_warps / k_interleave mean version 2 and parts / down_batch version 3:
    given together, one half would be dropped, so the mix is refused (no device)."""
    mix = r"gate_up_warps / k_interleave \(version 2\) and parts / down_batch \(version 3\) do not mix"
    for kwargs in ({"gate_up_warps": 8, "parts": 2}, {"k_interleave": True, "down_batch": 4},
                   {"gate_up_warps": 16, "parts": 2, "down_batch": 4}):
        with pytest.raises(ValueError, match=mix):
            moe.launch_settings(**kwargs)
    assert moe.launch_settings(gate_up_warps=8) == (2, moe.V2Settings(8))
    assert moe.launch_settings(parts=2, down_batch=4) == (3, moe.V3Settings(2, 4))
