// Shared device code of the W4A16 MoE kernels (moe_w4a16/v1..v3): the int4 -> bf16 dequantisation
// into mma A fragments, the m16n8k16 bf16 MMA, bf16 bit casts and the cp.async group fences.
#pragma once

#include <cuda_bf16.h>

// NVRTC (CuPy) has no host headers such as <stdint.h>: fixed-width names of our own.
typedef unsigned int u32;
typedef unsigned short u16;

namespace {

// (a & b) | c in one instruction (lop3 truth table 0xEA).
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ u32 bf162_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<u32*>(&v);
}

__device__ __forceinline__ __nv_bfloat162 bits_bf162(u32 v) {
  return *reinterpret_cast<__nv_bfloat162*>(&v);
}

// Eight nibbles -> the four bf16x2 registers of an mma A fragment, dequantized exactly as the
// reference does: bf16(q - 8) is exact, then one bf16 multiply by the group scale.
// Nibbles n and n + 4 land in the low/high halves with exponent bits 0x43 (2^7): value 128 + q.
__device__ __forceinline__ void dequant8(u32 w, u32 scales, u32 a[4]) {
  const __nv_bfloat162 bias = __float2bfloat162_rn(136.0f);  // 128 (magic exponent) + 8 (zero point)
  const __nv_bfloat162 s_lo = bits_bf162(__byte_perm(scales, 0, 0x1010));  // row g, both halves
  const __nv_bfloat162 s_hi = bits_bf162(__byte_perm(scales, 0, 0x3232));  // row g + 8
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 q = bits_bf162(and_or(w >> (4 * j), 0x000F000Fu, 0x43004300u));
    a[j] = bf162_bits(__hmul2(__hsub2(q, bias), (j & 1) ? s_hi : s_lo));
  }
}

__device__ __forceinline__ void mma_bf16(float c[4], const u32 a[4], u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One k16 step group: the 4 words of one 16-row tile's chunk against the 8 B registers.
__device__ __forceinline__ void mma_chunk(float acc[4], uint4 w, u32 s, const u32 b[8]) {
  const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 afrag[4];
    dequant8(words[i], s, afrag);
    mma_bf16(acc, afrag, b[2 * i], b[2 * i + 1]);
  }
}

__device__ __forceinline__ u16 f32_to_bf16_bits(float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  return *reinterpret_cast<const u16*>(&b);
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace
