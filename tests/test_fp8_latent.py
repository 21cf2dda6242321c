"""kdlib.ref.fp8 against independent oracles: torch's float8_e4m3fn and bfloat16 casts, exact nearest-value
search with fractions, and FlashMLA's quantization recipe rewritten in torch; the layout's bytes; the
fp8_ds_mla KV dtype of kdlib.memory; the accuracy study on loose, BLAS-independent bounds."""

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from kdlib import memory
from kdlib.ref import fp8

ALL_BYTES = np.arange(256, dtype=np.uint8)


def torch_e4m3_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3 bits through torch's cast (one rounding: the input is already float32)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.float8_e4m3fn).view(
        torch.uint8).numpy()


def torch_e4m3_values() -> np.ndarray:
    """The float64 value of each of the 256 bit patterns, decoded by torch."""
    return torch.from_numpy(ALL_BYTES.copy()).view(torch.float8_e4m3fn).double().numpy()


def torch_bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


FINITE = torch_e4m3_values()[np.isfinite(torch_e4m3_values())]  # 254 values, -0.0 and 0.0 included


# ----------------------------------------------------------------------------------------- the codec

def test_decode_every_bit_pattern_as_torch():
    want = torch_e4m3_values()
    for dtype in (np.float32, np.float64):
        got = fp8.from_e4m3_bits(ALL_BYTES, dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want.astype(dtype))  # NaN where NaN
        assert np.array_equal(np.signbit(got), np.signbit(want))  # 0x80 is -0.0
    assert np.flatnonzero(np.isnan(want)).tolist() == [0x7F, 0xFF]
    assert want[0x7E] == fp8.E4M3_MAX == 448.0 and want[0x01] == 2.0**-9 and want[0x08] == 2.0**-6


def encode_cases(rng) -> np.ndarray:
    """float32 values: random over every binade e4m3 can round into, every finite e4m3 value, every midpoint
    (a tie) and its float32 neighbours on both sides, subnormals, max, beyond max, ±inf, ±0, ±NaN."""
    pos = np.unique(np.abs(FINITE))  # [0, 2^-9, ..., 448]
    mids = ((pos[1:] + pos[:-1]) / 2).astype(np.float32)  # exact in float32
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))])
    rand = rng.standard_normal(200_000) * np.exp2(rng.uniform(-14, 10, 200_000))
    edge = [448.0, 449.0, 463.9, 464.0, 464.1, 480.0, 1e6, 3e38, np.inf, 2.0**-10, 2.0**-11, 3 * 2.0**-10,
            1e-30, 0.0, np.nan]
    x = np.concatenate([rand, pos, mids, near, edge]).astype(np.float32)
    return np.concatenate([x, -x])


def test_encode_matches_torch_on_float32():
    x = encode_cases(np.random.default_rng(0))
    got = fp8.to_e4m3_bits(x)
    assert got.dtype == np.uint8 and got.shape == x.shape
    # saturating, as KV-cache writers do it: clamp to ±448, then cast (torch 2.13's cast saturates too)
    np.testing.assert_array_equal(got, torch_e4m3_bits(np.clip(x, -448, 448)))
    np.testing.assert_array_equal(got, torch_e4m3_bits(x))


def test_encode_edges():
    enc = fp8.to_e4m3_bits
    f = np.array
    assert enc(f([0.0, -0.0])).tolist() == [0x00, 0x80]
    assert enc(f([np.nan, -np.nan])).tolist() == [0x7F, 0xFF]
    assert enc(f([448.0, 464.0, 464.0001, 1e30, np.inf, -np.inf])).tolist() == [0x7E] * 5 + [0xFE]
    assert enc(f([464.0001, 1e30, np.inf, -500.0]), saturate=False).tolist() == [0x7F, 0x7F, 0x7F, 0xFF]
    assert enc(f([448.0, 464.0, -464.0]), saturate=False).tolist() == [0x7E, 0x7E, 0xFE]  # the tie is 448
    # ties to even: 2^-10 lies halfway between 0 and 2^-9 (0 even), 3 * 2^-10 between 2^-9 and 2^-8
    ties = f([2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-10 * 1.0001])
    assert enc(ties).tolist() == [0x00, 0x02, 0x02, 0x01]
    assert enc(f([1.0625, 1.1875])).tolist() == [0x38, 0x3A]  # 1 + 1/16 -> 1.0, 1 + 3/16 -> 1.25


def nearest_e4m3(x: float) -> int:
    """The correctly rounded byte of a finite float64 x, |x| <= 448, by exact search (ties: even mantissa)."""
    fx = Fraction(x)
    codes = [b for b in range(256) if np.isfinite(torch_e4m3_values()[b]) and (b >= 128) == (x < 0)]
    dist = {b: abs(fx - Fraction(float(torch_e4m3_values()[b]))) for b in codes}
    best = min(dist.values())
    tied = [b for b in codes if dist[b] == best]
    return min(tied, key=lambda b: (b & 1, b))  # even last bit first (0 and -0: the sign's own zero)


def test_float64_is_rounded_once():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(600) * np.exp2(rng.uniform(-11, 8, 600))
    x = np.clip(x, -448, 448)
    assert fp8.to_e4m3_bits(x).tolist() == [nearest_e4m3(float(v)) for v in x]
    # just above a tie by 2^-40: float32 would make it an exact tie (torch rounds that down to 1.0)
    v = np.array([1 + 2.0**-4 + 2.0**-40])
    assert fp8.to_e4m3_bits(v).tolist() == [0x39] == [nearest_e4m3(float(v[0]))]


def test_every_finite_byte_round_trips():
    finite = ALL_BYTES[np.isfinite(torch_e4m3_values())]
    assert finite.size == 254
    for dtype in (np.float32, np.float64):
        np.testing.assert_array_equal(fp8.to_e4m3_bits(fp8.from_e4m3_bits(finite, dtype)), finite)
        values = fp8.from_e4m3_bits(finite, dtype)
        np.testing.assert_array_equal(fp8.to_e4m3_bits(values, saturate=False), finite)


def test_round_to_bf16_against_torch_and_once_from_float64():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(100_000) * np.exp2(rng.uniform(-140, 120, 100_000)),
                        [0.0, -0.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 2.0**-133, 3.3e38, np.inf, np.nan]])
    x = x.astype(np.float32)
    got = fp8.round_to_bf16(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, torch_bf16(x))
    num = ~np.isnan(x)
    assert np.array_equal(np.signbit(got[num]), np.signbit(torch_bf16(x)[num]))  # -0.0 stays -0.0
    # float64: 1 + 2^-8 + 2^-30 is nearer 1 + 2^-7 (torch goes through float32, ties, and gives 1.0)
    assert fp8.round_to_bf16(np.array([1 + 2.0**-8 + 2.0**-30]))[0] == 1 + 2.0**-7
    assert np.isinf(fp8.round_to_bf16(np.array([3.4e38, -1e39]))).all()


# ------------------------------------------------------------------------------------------ the layout

def latent_case(seed, dtype=np.float64) -> np.ndarray:
    """[3, 5, 576] rows with tiles across scales: ordinary, all-zero, tiny (under the 1e-4 floor), one
    outlier, huge; float32 or float64."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((3, 5, 576)) * np.exp2(rng.uniform(-6, 6, (3, 5, 1)))
    rows[0, 0, :128] = 0.0  # an all-zero tile
    rows[0, 1, 128:256] *= 1e-4  # below the floor: amax / 448 < 1e-4
    rows[0, 2, 300] = 5e3  # one outlier in tile 2
    rows[1, 0, 384:512] *= 1e20
    rows[1, 1, :512] = -rows[1, 1, :512]
    rows[2, 0, :128] = np.clip(rows[2, 0, :128], -1, 1)
    rows[2, 0, 7] = -56.0  # amax / 448 = 2^-3 exactly: already a power of two, so the scale stays 2^-3
    return rows.astype(dtype)


def half_ulp(y: np.ndarray) -> np.ndarray:
    """Half the e4m3 spacing in the binade of |y| (2^-10 in the subnormal range)."""
    a = np.abs(y)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    return np.exp2(np.maximum(e, -6) - 4)


@pytest.mark.parametrize("rule", fp8.SCALE_RULES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantize_dequantize_bound(rule, dtype):
    rows = latent_case(3, dtype)
    bits, scales, rope = fp8.quantize_latent(rows, rule)
    assert (bits.shape, bits.dtype, scales.shape, scales.dtype, rope.shape, rope.dtype) == (
        (3, 5, 512), np.uint8, (3, 5, 4), np.float32, (3, 5, 64), np.float32)
    dq = fp8.dequantize_latent(bits, scales, rope)
    assert dq.shape == (3, 5, 576) and dq.dtype == np.float64
    x = rows.astype(np.float64)
    s = np.repeat(scales.astype(np.float64), 128, axis=-1)  # [3, 5, 512]
    y = x[..., :512] / s
    slack = 0.0 if rule == "pow2" else 2.0**-50 * np.abs(y)  # amax: x / s is a rounded float64 quotient
    assert (np.abs(x[..., :512] - dq[..., :512]) <= s * (half_ulp(y) + slack)).all()
    assert np.abs(y).max() <= 448 * (1 + 2.0**-23)
    # every stored byte is a nearest e4m3 of x / s (never a NaN pattern)
    gaps = np.abs(y[..., None] - FINITE)  # [3, 5, 512, 254]
    assert (np.abs(y - dq[..., :512] / s) <= gaps.min(axis=-1) * (1 + 2.0**-40) + slack).all()
    assert not np.isin(bits, [0x7F, 0xFF]).any()
    # the rope: exactly the bf16 rounding, taken from float32 rows by torch (one rounding either way)
    np.testing.assert_array_equal(dq[..., 512:], fp8.round_to_bf16(x[..., 512:]))
    if dtype == np.float32:
        np.testing.assert_array_equal(rope, torch_bf16(rows[..., 512:]))
    assert (dq[0, 0, :128] == 0).all() and (bits[0, 0, :128] == 0).all()  # the all-zero tile


def test_scales_follow_flashmla_recipe_in_torch():
    """FlashMLA's V3.2 recipe, rewritten in torch: scale = 2^ceil(log2(max(amax / 448, 1e-4))), bits =
    (x.float() / scale).to(float8_e4m3fn)."""
    rows = latent_case(4, np.float32)
    bits, scales, _ = fp8.quantize_latent(rows)
    lat = torch.from_numpy(rows[..., :512].copy()).view(3, 5, 4, 128)
    amax = lat.abs().amax(dim=-1).float() / 448.0
    want_s = torch.pow(2, torch.clamp_min(amax, 1e-4).log2().ceil())
    np.testing.assert_array_equal(scales, want_s.numpy())
    want_bits = (lat.float() / want_s[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(3, 5, 512)
    np.testing.assert_array_equal(bits, want_bits.numpy())
    assert scales[0, 0, 0] == 2.0**-13  # the all-zero tile: 1e-4 rounded up
    assert scales[2, 0, 0] == 2.0**-3 and bits[2, 0, 7] == 0xFE  # -56 / 2^-3 = -448
    # the plain rule: float32(amax / 448), floored
    _, plain, _ = fp8.quantize_latent(rows, "amax")
    np.testing.assert_array_equal(plain, torch.clamp_min(amax, 1e-4).numpy())


def test_pow2_scales_are_exact_in_bf16():
    """What FlashMLA's Hopper kernel does with them: scale to bf16, e4m3 value to bf16, product in bf16."""
    bits, scales, _ = fp8.quantize_latent(latent_case(5, np.float32))
    assert (np.frexp(scales)[0] == 0.5).all()
    s16 = torch.from_numpy(np.repeat(scales, 128, axis=-1)).to(torch.bfloat16)
    v16 = torch.from_numpy(bits).view(torch.float8_e4m3fn).to(torch.bfloat16)
    got = (v16 * s16).double().numpy()
    want = fp8.dequantize_latent(bits, scales, np.zeros((3, 5, 64), np.float32))[..., :512]
    np.testing.assert_array_equal(got, want)


def test_pack_layout_bytes():
    rows = latent_case(6)
    bits, scales, rope = fp8.quantize_latent(rows)
    packed = fp8.pack_latent(bits, scales, rope)
    assert packed.shape == (3, 5, 656) == (3, 5, fp8.layout_bytes()) and packed.dtype == np.uint8
    t = torch.from_numpy(packed.reshape(15, 656).copy())
    np.testing.assert_array_equal(t[:, :512].numpy(), bits.reshape(15, 512))
    as_f32 = t[:, 512:528].contiguous().view(torch.float32).numpy()  # [15, 4]
    as_bf16 = t[:, 528:].contiguous().view(torch.bfloat16).float().numpy()  # [15, 64]
    np.testing.assert_array_equal(as_f32, scales.reshape(15, 4))
    np.testing.assert_array_equal(as_bf16, rope.reshape(15, 64))
    back = fp8.unpack_latent(packed)
    for a, b in zip(back, (bits, scales, rope), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fp8.dequantize_latent(*back), fp8.dequantize_latent(bits, scales, rope))


def test_bad_inputs_are_one_line_errors():
    ok = latent_case(7)
    bits, scales, rope = fp8.quantize_latent(ok)
    nan_rows, inf_rows = ok.copy(), ok.copy()
    nan_rows[1, 2, 3], inf_rows[0, 0, 550] = np.nan, np.inf
    huge = ok.copy()
    huge[0, 0, 0] = 1e300
    cases = [
        (lambda: fp8.quantize_latent(ok[..., :575]), "576"),
        (lambda: fp8.quantize_latent(np.zeros(576, np.int64)), "floating"),
        (lambda: fp8.quantize_latent(nan_rows), "finite"),
        (lambda: fp8.quantize_latent(inf_rows), "finite"),
        (lambda: fp8.quantize_latent(huge), "float32 scale"),
        (lambda: fp8.quantize_latent(ok, "ue8m0"), "scale_rule"),
        (lambda: fp8.to_e4m3_bits(np.arange(3)), "floating"),
        (lambda: fp8.from_e4m3_bits(np.arange(3)), "uint8"),
        (lambda: fp8.from_e4m3_bits(bits, np.float16), "float32 or float64"),
        (lambda: fp8.dequantize_latent(bits.astype(np.int16), scales, rope), "uint8"),
        (lambda: fp8.dequantize_latent(bits, scales[..., :3], rope), "scales must be"),
        (lambda: fp8.dequantize_latent(bits, scales, rope[:2]), "rope"),
        (lambda: fp8.dequantize_latent(bits, scales * np.inf, rope), "finite"),
        (lambda: fp8.pack_latent(bits, scales, rope + 2.0**-20), "bf16"),
        (lambda: fp8.pack_latent(bits, scales.astype(np.float64) * (1 + 2.0**-40), rope), "float32"),
        (lambda: fp8.unpack_latent(np.zeros((2, 655), np.uint8)), "656"),
        (lambda: fp8.layout_bytes(500), "multiple of 128"),
        (lambda: fp8.fp8_verify_error(prefix_lens=(0,)), "prefix_lens"),
        (lambda: fp8.fp8_verify_error(tree_sizes=()), "tree_sizes"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words) as e:
            call()
        assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------- kdlib.memory and the study

def test_memory_plans_with_the_layout(capsys):
    g = memory.geometry("kimi-k2.6")
    assert memory.kv_bytes_per_token("kimi-k2.6", "fp8_ds_mla") == g.num_layers * 656 == 61 * 656
    assert memory.kv_bytes_per_token("kimi-k2.6", "fp8_ds_mla", tp=8) == 61 * 656  # replicated latent
    assert memory.kv_bytes_per_token("kimi-k2.6", "fp8_ds_mla", tp=8, kv_split="context_parallel") == 61 * 82
    assert memory.kv_bytes_per_token("kimi-k2.6", "fp8_e4m3") == 61 * 576  # unchanged: 1 B x 576
    assert memory.kv_bytes_per_token("kimi-k2.6", "bfloat16") == 61 * 1152
    with pytest.raises(ValueError, match="MLA"):
        memory.kv_bytes_per_token("qwen3-30b-a3b", "fp8_ds_mla")
    pools = {d: memory.plan("kimi-k2.6", "h200", 8, 200_000, kv_dtype=d).value("pool_tokens")
             for d in ("bfloat16", "fp8_ds_mla", "fp8_e4m3")}
    assert pools["bfloat16"] < pools["fp8_ds_mla"] < pools["fp8_e4m3"]
    assert memory.cli(["kimi-k2.6", "--gpu", "h200", "--tp", "8", "--context", "200000",
                       "--kv-dtype", "fp8_ds_mla", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["kv_dtype"] == "fp8_ds_mla"
    assert next(r for r in doc["rows"] if r["key"] == "kv_bytes_per_token")["value"] == 61 * 656


def test_study_separates_fp8_from_bf16():
    rows = fp8.fp8_verify_error(prefix_lens=(16, 300), tree_sizes=(1, 9), heads=2)
    assert [(r["prefix"], r["tree"]) for r in rows] == [(16, 1), (300, 1), (16, 9), (300, 9)]
    for r in rows:
        assert 0 < r["bf16_out"] < 1e-2 and 0 < r["bf16_lse"] < 1e-2  # bf16: 8 significant bits
        for k in ("fp8", "fp8_amax"):  # e4m3: 4 significant bits, 16x coarser
            assert 2 * r["bf16_out"] < r[f"{k}_out"] < 0.2 and 0 < r[f"{k}_lse"] < 0.5
        assert 0.5 < r["logit_std"] < 3


def test_torch_packing_of_a_bf16_pool_is_the_references_layout():
    """kdlib.cuda.attention.fp8_pool (torch, here on the CPU; the GPU suite and tests run it on the device)
    writes the bytes of pack_latent(quantize_latent(rows)) for bf16 rows over 12 orders of magnitude, an
    all-zero tile and tiles whose max |x| / 448 is a power of two; fp8_dequantized gives dequantize_latent's
    values."""
    import torch

    from kdlib.cuda import attention

    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(400, 576, generator=g) * torch.logspace(-6, 6, 400, base=10.0)[:, None]).bfloat16()
    kv[5, :128] = 0  # the MIN_SCALE floor
    kv[7] = 448 * 2.0**-3  # amax / 448 a power of two: no rounding up
    kv[9, 128:256] = -448 * 2.0**4
    rows = kv.double().numpy()
    want = fp8.pack_latent(*fp8.quantize_latent(rows))
    got = attention.fp8_pool(kv)
    assert got.dtype == torch.uint8 and tuple(got.shape) == (400, attention.FP8_ROW_BYTES)
    np.testing.assert_array_equal(got.numpy(), want)
    back = attention.fp8_dequantized(got)
    assert back.dtype == torch.bfloat16
    np.testing.assert_array_equal(back.double().numpy(), fp8.dequantize_latent(*fp8.unpack_latent(want)))
    with pytest.raises(ValueError):
        attention.fp8_pool(kv.float())
    with pytest.raises(ValueError):
        attention.fp8_dequantized(got[:, :600])
