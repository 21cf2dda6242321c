"""FP8 E4M3 and the FP8 MLA latent-cache layout in numpy: what an FP8 verify kernel is checked against.

    bits = to_e4m3_bits(x)                        # uint8, round to nearest even, saturating
    x8 = from_e4m3_bits(bits)                     # float32 (or float64), exact
    lat, scales, rope = quantize_latent(rows)     # [..., 576] -> [..., 512] u8, [..., 4] f32, [..., 64]
    rows8 = dequantize_latent(lat, scales, rope)  # [..., 576] float64, exact
    packed = pack_latent(lat, scales, rope)       # [..., 656] uint8: the bytes a kernel reads per token
    fp8_verify_error(...)                         # what the layout costs the verify attention (notebook 02b)

The number format is OCP 8-bit floating point E4M3 ("e4m3fn" in torch and ml_dtypes): 1 sign bit, 4 exponent
bits (bias 7), 3 mantissa bits, no infinities. S.1111.111 (0x7f, 0xff) is NaN, so the largest finite value is
S.1111.110 = 448; exponent field 0 holds the subnormals k * 2^-9 (k = 1..7); the smallest normal is 2^-6.
`to_e4m3_bits` rounds the exact value of any float input once, to nearest with ties to even. torch's cast
goes through float32 first, so it rounds twice for a float64 within 2^-24 (relative) of a tie; on float32,
float16 and bf16 inputs the two agree. The conversion saturates by default: finite values past 448 and
±inf become ±448, and NaN stays NaN (NVIDIA's `cvt ... .satfinite`). The format has no infinity, so the
non-saturating form (`saturate=False`: overflow gives NaN) would turn one large cache entry into a NaN that
poisons every softmax row reading it. FP8 quantization kernels therefore clamp to ±448 before the cast, and
torch 2.13's CPU cast saturates too (tests/test_fp8_latent.py compares against it). Inside `quantize_latent`
the tile scale keeps |x / s| <= 448 anyway.

The layout is DeepSeek-V3.2's FP8 MLA cache, "FP8 with scale", as read from deepseek-ai/FlashMLA
(https://github.com/deepseek-ai/FlashMLA, commit 9241ae3, 2026-04-29):
  * README.md, "FP8 KV Cache": each token's cache takes 656 bytes. First come the 512 latent ("NoPE") values
    as float8_e4m3, then 4 float32 scales (one per 128 consecutive latent values), then the 64 rope values as
    bfloat16, left unquantized for accuracy. The kernel dequantizes to bf16 and computes in bf16.
  * tests/quant.py, `quantize_k_cache` (layout V32_FP8Sparse): a tile's scale is its max |x| over 448, clamped
    below at 1e-4 and rounded up to a power of two (stored as float32). The stored value is the e4m3 of
    x / scale, and the dequantized one is that value times the scale.
  * csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh: the Hopper decode kernel asserts a 656-byte row stride. It
    casts the four float32 scales to bf16 and multiplies each e4m3 value (as bf16) by its tile's scale in
    bf16, which is exact only because the scale is a power of two.
vLLM calls this cache dtype `fp8_ds_mla` and sizes its rows at 656 bytes (vllm-project/vllm,
vllm/v1/attention/backends/mla/flashmla_sparse.py, `FlashMLASparseBackend.get_kv_cache_shape`); `kdlib memory`
plans with it under that name.

The scale rule of `quantize_latent`, per token and per tile of TILE = 128 latent dims:
    s = max(amax / 448, MIN_SCALE)                          amax = max |x| over the tile; MIN_SCALE = 1e-4
    "pow2" (default): s = 2^ceil(log2 s)                    FlashMLA's rule: the bf16 dequant is exact
    "amax":           s = float32(s)                        the plain rule, for comparison
    bits = e4m3(x / s);   dequantized value = e4m3 value * s   (exact in float64)
so |x - dequantized| <= s * (half an e4m3 ulp at x / s), and |x / s| <= 448 (448 * (1 + 2^-24) at most
under "amax", which still rounds to 448). An all-zero tile gets s = MIN_SCALE rounded (2^-13 under "pow2") and
all-zero bytes. The floor also applies to tiles with amax < 0.0448; those keep e4m3's 3 mantissa bits for
every value above 2^-19. The rope dims are rounded to bf16 once, from their exact value
(`kdlib.cuda.moe.round_bf16` goes through float32 and rounds float64 twice; `round_to_bf16` here does not).
"""

from __future__ import annotations

import numpy as np

from kdlib.check import errors
from kdlib.ref.attention import KV_LORA_RANK, tree_verify_attention
from kdlib.ref.tree import build_tree_batch, synthetic_topk

E4M3_MAX = 448.0  # S.1111.110
E4M3_NAN = 0x7F  # S.1111.111 (the sign bit kept)
ROPE_DIMS = 64  # DeepSeek-V3 / Kimi-K2 qk_rope_head_dim
ROW_DIMS = KV_LORA_RANK + ROPE_DIMS  # 576
TILE = 128  # latent dims per scale
TILES = KV_LORA_RANK // TILE  # 4
MIN_SCALE = 1e-4  # FlashMLA's floor under amax / 448
SCALE_RULES = ("pow2", "amax")
_MAX_SCALE = 2.0**127  # the largest power of two a float32 scale holds


def layout_bytes(kv_lora_rank: int = KV_LORA_RANK, rope_dims: int = ROPE_DIMS) -> int:
    """Bytes per token and layer: the latent in e4m3, one float32 per TILE latent dims, the rope in bf16."""
    if kv_lora_rank <= 0 or kv_lora_rank % TILE or rope_dims < 0:
        raise ValueError(f"the fp8 latent layout needs kv_lora_rank a positive multiple of {TILE} and rope "
                         f"dims >= 0, got {kv_lora_rank} and {rope_dims}")
    return kv_lora_rank + 4 * (kv_lora_rank // TILE) + 2 * rope_dims


def _floats(name: str, x) -> np.ndarray:
    """x as a float64 array (any shape); ValueError unless it is floating."""
    a = np.asarray(x)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise ValueError(f"{name} must be a floating array, got {a.dtype}")
    return a.astype(np.float64)


def _round_even(a: np.ndarray, mantissa_bits: int, min_exp: int) -> np.ndarray:
    """Finite a >= 0 (float64) -> the nearest value with `mantissa_bits` bits after the binary point and
    exponent >= min_exp (evenly spaced subnormals below 2^min_exp), ties to even; no upper limit."""
    _, e = np.frexp(a)  # a = f * 2^e, f in [0.5, 1): a's binade is [2^(e-1), 2^e)
    quantum = np.ldexp(1.0, np.maximum(e - 1, min_exp) - mantissa_bits)
    return np.rint(a / quantum) * quantum  # both steps exact; rint rounds half to even


def to_e4m3_bits(x, saturate: bool = True) -> np.ndarray:
    """Float array -> E4M3 bit patterns (uint8, same shape), rounded once to nearest even.

    saturate=True: finite values past 448 and ±inf give ±448 (0x7e / 0xfe); saturate=False: they give NaN.
    NaN gives 0x7f (0xff when its sign bit is set); -0.0 gives 0x80.
    """
    v = _floats("x", x)
    sign = np.signbit(v).astype(np.uint8) << 7
    a = np.abs(v)
    nan, finite = np.isnan(a), np.isfinite(a)
    r = _round_even(np.where(finite, a, 0.0), 3, -6)
    over = (r > E4M3_MAX) | (~finite & ~nan)
    r = np.where(over, E4M3_MAX, r)  # on the e4m3 grid from here: 0 <= r <= 448
    _, e = np.frexp(r)
    normal = r >= 2.0**-6
    field = np.where(normal, e + 6, 0)  # the binade [2^(e-1), 2^e) has biased exponent e - 1 + 7
    mant = np.where(normal, np.ldexp(r, 4 - e) - 8, np.ldexp(r, 9))  # (r / 2^(e-1) - 1) * 8, or r / 2^-9
    bits = (field.astype(np.uint8) << 3) | mant.astype(np.uint8)
    bad = nan | (over & (not saturate))
    return np.where(bad, np.uint8(E4M3_NAN), bits).astype(np.uint8) | sign


def _e4m3_table() -> np.ndarray:
    """The float64 value of each of the 256 bit patterns."""
    b = np.arange(256)
    field, mant = (b >> 3) & 15, b & 7
    mag = np.where(field == 0, mant * 2.0**-9, (1 + mant / 8) * np.ldexp(1.0, field - 7))
    mag[(b & 0x7F) == E4M3_NAN] = np.nan
    return np.where(b & 0x80, -mag, mag)


_E4M3_VALUES = _e4m3_table()


def from_e4m3_bits(bits, dtype=np.float32) -> np.ndarray:
    """E4M3 bit patterns (uint8) -> their values (float32 or float64, exact; 0x7f / 0xff -> NaN)."""
    if not isinstance(bits, np.ndarray) or bits.dtype != np.uint8:
        raise ValueError(f"bits must be a uint8 numpy array, got "
                         f"{getattr(bits, 'dtype', type(bits).__name__)}")
    if np.dtype(dtype) not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {np.dtype(dtype)}")
    return _E4M3_VALUES[bits].astype(dtype)


def round_to_bf16(x) -> np.ndarray:
    """Float array -> the nearest bf16 values (ties to even, one rounding from the exact value), as float32.
    Past bf16's largest finite value (max + half an ulp and beyond) gives ±inf; NaN stays NaN."""
    v = _floats("x", x)
    a = np.abs(v)
    finite = np.isfinite(a)
    r = _round_even(np.where(finite, a, 0.0), 7, -126)
    r = np.where(finite, r, a)
    with np.errstate(over="ignore"):  # 2^128 rounds to inf in float32, as bf16 overflows
        return np.copysign(r, v).astype(np.float32)


def _bf16_bits(rope: np.ndarray) -> np.ndarray:
    """float32 holding bf16 values -> their bf16 bit patterns (uint16)."""
    return (np.ascontiguousarray(rope, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _rows(rows) -> np.ndarray:
    v = _floats("rows", rows)
    if v.ndim < 1 or v.shape[-1] != ROW_DIMS:
        raise ValueError(f"rows must be [..., {ROW_DIMS}] ({KV_LORA_RANK} latent + {ROPE_DIMS} rope), got "
                         f"shape {v.shape}")
    if not np.isfinite(v).all():
        raise ValueError("rows must be finite (NaN or inf found)")
    return v


def tile_scales(amax, scale_rule: str = "pow2") -> np.ndarray:
    """The scales of tiles whose max |x| is amax (finite, >= 0): float64 holding float32 values; the rule is
    in the module docstring."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    a = _floats("amax", amax)
    if (a < 0).any() or not np.isfinite(a).all():
        raise ValueError("amax must be finite and >= 0")
    s = np.maximum(a / E4M3_MAX, MIN_SCALE)
    if (s > _MAX_SCALE).any():
        raise ValueError(f"a tile's max |x| ({a.max():.3g}) is too large for a float32 scale")
    if scale_rule == "pow2":
        f, e = np.frexp(s)
        return np.ldexp(1.0, np.where(f == 0.5, e - 1, e))  # f == 0.5: s is a power of two already
    return s.astype(np.float32).astype(np.float64)


def quantize_latent(rows, scale_rule: str = "pow2") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLA cache rows -> the FP8 layout's three parts (scale rule: module docstring).

    Shape: rows [..., 576] float (512 latent + 64 rope, finite). Returns latent bits [..., 512] uint8 (e4m3),
    scales [..., 4] float32 (one per 128 latent dims), rope [..., 64] float32 holding bf16 values.
    """
    v = _rows(rows)
    lead = v.shape[:-1]
    lat = v[..., :KV_LORA_RANK].reshape(*lead, TILES, TILE)  # [..., 4, 128]
    s = tile_scales(np.abs(lat).max(axis=-1), scale_rule)  # [..., 4]
    rope = round_to_bf16(v[..., KV_LORA_RANK:])  # [..., 64]
    if np.isinf(rope).any():
        raise ValueError("rope values beyond bf16's range (|x| >= 3.4e38)")
    bits = to_e4m3_bits(lat / s[..., None]).reshape(*lead, KV_LORA_RANK)  # [..., 512]
    return bits, s.astype(np.float32), rope


def _bytes(name: str, a, width: int) -> None:
    """ValueError unless a is a uint8 array [..., width]."""
    if not (isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.ndim and a.shape[-1] == width):
        raise ValueError(f"{name} must be a uint8 array [..., {width}], got "
                         f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")


def _parts(bits, scales, rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate the layout's three parts (same leading shape); return them as uint8, float64, float64."""
    _bytes("latent bits", bits, KV_LORA_RANK)
    lead = bits.shape[:-1]
    s, r = _floats("scales", scales), _floats("rope", rope)
    if s.shape != (*lead, TILES) or r.shape != (*lead, ROPE_DIMS):
        raise ValueError(f"scales must be {(*lead, TILES)} and rope {(*lead, ROPE_DIMS)} for latent bits "
                         f"{bits.shape}, got {s.shape} and {r.shape}")
    if not (np.isfinite(s).all() and np.isfinite(r).all()):
        raise ValueError("scales and rope must be finite")
    return bits, s, r


def dequantize_latent(bits, scales, rope) -> np.ndarray:
    """The FP8 layout's parts -> rows [..., 576] float64: e4m3 value * its tile's scale, then the rope.
    Exact (a 4-bit significand times a float32 one fits float64); a NaN byte (0x7f / 0xff) gives NaN."""
    b, s, r = _parts(bits, scales, rope)
    lead = b.shape[:-1]
    lat = from_e4m3_bits(b, np.float64).reshape(*lead, TILES, TILE) * s[..., None]  # [..., 4, 128]
    return np.concatenate([lat.reshape(*lead, KV_LORA_RANK), r], axis=-1)


def pack_latent(bits, scales, rope) -> np.ndarray:
    """The layout's parts -> the bytes of each token's row, [..., 656] uint8: 512 e4m3 bytes, 4 float32
    scales (little-endian), 64 bf16 rope values (little-endian); rope must hold bf16 values."""
    b, s, r = _parts(bits, scales, rope)
    lead = b.shape[:-1]
    if (s.astype(np.float32) != s).any():
        raise ValueError("scales must be float32 values")
    r32 = r.astype(np.float32)
    if (r32 != r).any() or (np.ascontiguousarray(r32).view(np.uint32) & 0xFFFF).any():
        raise ValueError("rope must hold bf16 values (round it with round_to_bf16)")
    s_bytes = np.ascontiguousarray(s, dtype="<f4").view(np.uint8).reshape(*lead, 4 * TILES)  # [..., 16]
    r_bytes = np.ascontiguousarray(_bf16_bits(r32), dtype="<u2").view(np.uint8).reshape(*lead, 2 * ROPE_DIMS)
    return np.concatenate([b, s_bytes, r_bytes], axis=-1)


def unpack_latent(packed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[..., 656] uint8 rows -> latent bits [..., 512] uint8, scales [..., 4] float32, rope [..., 64]
    float32 (bf16 values)."""
    _bytes("packed rows", packed, layout_bytes())
    lead, o = packed.shape[:-1], KV_LORA_RANK + 4 * TILES
    scales = np.ascontiguousarray(packed[..., KV_LORA_RANK:o]).view("<f4").astype(np.float32)
    rope16 = np.ascontiguousarray(packed[..., o:]).view("<u2").astype(np.uint32) << 16
    return packed[..., :KV_LORA_RANK].copy(), scales.reshape(*lead, TILES), rope16.view(np.float32)


# ------------------------------------------------------------------------------------------ accuracy study

def latent_rows(rng: np.random.Generator, n: int, gain: np.ndarray) -> np.ndarray:
    """n synthetic MLA cache rows [n, 576] float64 in the model's scale: the latent is a N(0, 1) row scaled
    to RMS 1 (kv_a_layernorm) times a per-channel gain [512] (the norm's learned weight); rope N(0, 1)."""
    lat = rng.standard_normal((n, KV_LORA_RANK))  # [n, 512]
    lat *= gain / np.sqrt(np.mean(lat * lat, axis=-1, keepdims=True))
    return np.concatenate([lat, rng.standard_normal((n, ROPE_DIMS))], axis=-1)


def _tree_visibility(seed: int, size: int) -> np.ndarray:
    """[1, size, size] visibility of a DDTree of `size` rows (root + size - 1 nodes), drafter-like inputs."""
    depth = min(8, max(1, size - 1))
    trees = build_tree_batch(*synthetic_topk(seed, 1, depth, 8), size - 1)
    if int(trees.sizes[0]) != size:
        raise ValueError(f"the synthetic tree has {int(trees.sizes[0])} rows, not {size}")
    return trees.visibility


def fp8_verify_error(prefix_lens=(256, 1024, 4096), tree_sizes=(9, 65), *, heads: int = 4,
                     softmax_scale: float = ROW_DIMS**-0.5, query_scale: float = 1.0, gain_sigma: float = 0.5,
                     seed: int = 0) -> list[dict]:
    """What the FP8 layout costs the float64 verify reference, per (prefix length, tree size).

    One request: queries N(0, query_scale^2) [1, Q, heads, 576]; prefix and tree rows from `latent_rows` (gain
    log-normal, sigma `gain_sigma`) behind a shuffled page table; the tree is a real DDTree. The same
    problem runs on three caches, each through `tree_verify_attention` in float64:
      exact  the rows as drawn;   bf16  the rows rounded to bf16 (what the model writes);
      fp8    the bf16 rows through quantize_latent / dequantize_latent, under each scale rule.
    Returns one dict per point: prefix, tree, logit_std (of softmax_scale * q . k), and for bf16 against exact
    and for fp8 ("fp8" = pow2, "fp8_amax") against bf16: *_out (norm-relative output error) and *_lse
    (max |lse error|).
    """
    for name, xs, lo in (("prefix_lens", prefix_lens, 1), ("tree_sizes", tree_sizes, 1)):
        if not len(xs) or any(int(x) != x or x < lo for x in xs):
            raise ValueError(f"{name} must be integers >= {lo}, got {xs!r}")
    rng = np.random.default_rng(seed)
    gain = np.exp(gain_sigma * rng.standard_normal(KV_LORA_RANK))  # [512]
    p_max, q_max = max(prefix_lens), max(tree_sizes)
    rows = {"exact": latent_rows(rng, p_max + q_max, gain)}  # [P + Q, 576]: prefix rows, then tree rows
    rows["bf16"] = round_to_bf16(rows["exact"]).astype(np.float64)
    for rule in SCALE_RULES:
        key = "fp8" if rule == "pow2" else f"fp8_{rule}"
        rows[key] = dequantize_latent(*quantize_latent(rows["bf16"], rule))
    q = query_scale * rng.standard_normal((1, q_max, heads, ROW_DIMS))  # [1, Q, H, 576]
    slots = rng.permutation(p_max)  # the prefix's page table: scattered slots
    out = []
    for size in tree_sizes:
        vis = _tree_visibility(seed, size)  # [1, Q, Q]
        for p in prefix_lens:
            page_table = slots[:p][None].astype(np.int32)  # [1, P]
            res = {}
            for k, r in rows.items():
                res[k] = tree_verify_attention(q[:, :size], r[:p_max], page_table, np.array([p], np.int32),
                                               r[None, p_max:p_max + size], vis, np.array([size], np.int32),
                                               softmax_scale)
            keys = rows["exact"][slots[:p]]  # [P, 576]
            row = {"prefix": p, "tree": size,
                   "logit_std": float(np.std(softmax_scale * (q[0, :size].reshape(-1, ROW_DIMS) @ keys.T)))}
            for k, against in (("bf16", "exact"), ("fp8", "bf16"), ("fp8_amax", "bf16")):
                row[f"{k}_out"] = errors(res[k][0], res[against][0])["norm_rel"]
                row[f"{k}_lse"] = float(np.abs(res[k][1] - res[against][1]).max())
            out.append(row)
    return out
