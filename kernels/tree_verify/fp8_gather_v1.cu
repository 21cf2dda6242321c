// tree_verify_fp8_gather_v1: the prefix rows of an FP8 latent pool gathered into a bf16 pool, each value
// dequantized as version 10's FP8 build dequantizes it (tree_verify/fp8_e4m3.cuh: e4m3 times the tile's scale
// rounded to bf16), so that the bf16 build over the gathered rows gives the FP8 build's output bit for bit.
// kdlib.cuda.attention runs it before the bf16 build where a request has many query rows
// (fp8_path="dequant_first"): there the verify is bound by its MMAs, and the FP8 build dequantizes each tile
// once for every 64-row job that reads it, where this pass dequantizes each row once.
//
// pool8 [S, 656] uint8 (the layout, fp8_e4m3.cuh), page_table [B, P] int32, prefix_lens [B] int32 ->
// out [B * P, 576] bf16: row b P + k is slot page_table [b, k] dequantized, for k < prefix_lens [b] (clamped
// to [0, P]); the other rows are not written. Grid (ceil(P / FG_KEYS), B), block 32 FG_KEYS: warp w of block x
// takes key FG_KEYS x + w; lane l its e4m3 values 16 l .. 16 l + 15 (scale tile l / 8) and, lanes 0-7, the rope
// bytes 16 l .. 16 l + 15. Loads of 16 bytes, stores of 32: a warp reads its row's 656 bytes and writes its
// 1,152 once each.

#include <cuda_bf16.h>

#include "tree_verify/fp8_e4m3.cuh"

#define FG_KEYS 8     // keys a block, a warp each
#define FG_OUT_U4 72  // 16-byte units of a bf16 row (576 values)

extern "C" __global__ void __launch_bounds__(32 * FG_KEYS) tree_verify_fp8_gather_v1(
    const unsigned char* __restrict__ pool8, const int* __restrict__ page_table, const int* __restrict__ prefix_lens,
    int P, __nv_bfloat16* __restrict__ out) {
    const int b = blockIdx.y, k = blockIdx.x * FG_KEYS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (k >= min(max(prefix_lens[b], 0), P)) return;
    const long long row = (long long)b * P + k;
    const unsigned char* src = pool8 + (long long)page_table[row] * FP8_ROW;
    const uint4 x = __ldg(reinterpret_cast<const uint4*>(src) + lane);
    const unsigned s2 = scale_bf16x2(__ldg(reinterpret_cast<const float*>(src + FP8_SCALES) + lane / 8));
    uint4 lo, hi;  // values 16 lane .. + 7, + 8 .. + 15
    e4m3x4_scaled(x.x, s2, lo.x, lo.y);
    e4m3x4_scaled(x.y, s2, lo.z, lo.w);
    e4m3x4_scaled(x.z, s2, hi.x, hi.y);
    e4m3x4_scaled(x.w, s2, hi.z, hi.w);
    uint4* dst = reinterpret_cast<uint4*>(out) + row * FG_OUT_U4;
    dst[2 * lane] = lo;
    dst[2 * lane + 1] = hi;
    if (lane < 8) dst[64 + lane] = __ldg(reinterpret_cast<const uint4*>(src + FP8_ROPE) + lane);
}
