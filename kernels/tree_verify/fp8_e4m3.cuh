// The FP8 MLA latent layout (kdlib.ref.fp8: DeepSeek-V3.2's, FlashMLA's "FP8 with scale") and its e4m3 -> bf16
// conversion, shared by version 10's FP8 build (tree_verify/wgmma_ws.cuh) and the gather that dequantizes a
// prefix before the bf16 build runs (tree_verify/fp8_gather_v1.cu), so both put the same bits in bf16.
#pragma once

#define FP8_ROW 656                            // bytes per cached token
#define FP8_SCALES 512                         // offset of its 4 float32 scales
#define FP8_ROPE 528                           // offset of its 64 bf16 rope values

// Two e4m3 bytes -> two bf16 times 2^-120, no conversion instruction: w holds byte b of each in the high byte of
// its 16-bit half (PRMT); b's magnitude bits, shifted down 4, land on the low 4 bits of the bf16 exponent and the
// top 3 of its mantissa, its sign bit stays. Exponent field e > 0 is then 2^(e - 127) (1 + m / 8) against e4m3's
// 2^(e - 7) (1 + m / 8), and e = 0 the bf16 subnormal m / 8 2^-126 against m / 8 2^-6: 2^-120 either way.
// The NaN pattern S.1111.111 reads as 480 (the layout's writers saturate at 448 and never store it).
__device__ __forceinline__ unsigned e4m3x2_bf16_lo(unsigned w) {
    return ((w >> 4) & 0x07F007F0u) | (w & 0x80008000u);
}

// Four e4m3 values (the bytes of v, the lowest first) times the scale -> bf16 pairs lo (values 0, 1) and hi
// (2, 3), the first of each in its low half: two bf16x2 products a pair, by 2^120 (exact: a subnormal in, a
// normal out) and by the scale (s2: the tile's float32 scale rounded to bf16, in both halves), rounded once.
// For the layout's power-of-two scales that is exact, as FlashMLA's kernel computes it; inline PTX, and bf16
// products keep their subnormals. No conversion instruction a value (the cvt path, e4m3 -> f16 -> f32 ->
// times the scale -> bf16, had four a pair, at 16 a clock on an SM): the consumers can afford it (consume_v9).
__device__ __forceinline__ void e4m3x4_scaled(unsigned v, unsigned s2, unsigned& lo, unsigned& hi) {
    const unsigned two120 = 0x7B807B80u;  // bf16 2^120 in both halves
    unsigned wl, wh;
    asm("prmt.b32 %0, %2, 0, 0x1404;\nprmt.b32 %1, %2, 0, 0x3424;\n" : "=r"(wl), "=r"(wh) : "r"(v));
    asm("{\n.reg .b32 a, b;\n"
        "mul.rn.bf16x2 a, %2, %4;\nmul.rn.bf16x2 b, %3, %4;\n"
        "mul.rn.bf16x2 %0, a, %5;\nmul.rn.bf16x2 %1, b, %5;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(e4m3x2_bf16_lo(wl)), "r"(e4m3x2_bf16_lo(wh)), "r"(two120), "r"(s2));
}

// A tile's float32 scale rounded to bf16 once, in both halves: e4m3x4_scaled's s2.
__device__ __forceinline__ unsigned scale_bf16x2(float s) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;\n" : "=r"(r) : "f"(s));
    return r;
}
