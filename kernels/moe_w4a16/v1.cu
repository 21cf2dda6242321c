// W4A16 grouped MoE GEMM: INT4 expert weights (group 32 along the reduction dim, bf16 scales,
// symmetric: w = (q - 8) * s), bf16 activations, fp32 accumulation on the tensor cores
// (mma.sync m16n8k16 bf16, so it runs on sm_80 ... sm_120 alike), weights dequantized in registers.
//
// One MoE layer is two launches:
//   moe_w4a16_v1_gate_up_n{8,8w8,16,32}: h[slot, :] = silu(x[tok] . Wg^T) * (x[tok] . Wu^T)  -> bf16 [S, N]
//   moe_w4a16_v1_down_n{8,16,32}:        y[tok, :] += weight[slot] * (h[slot] . Wd^T)           fp32 atomics
// where slots are the M*topk (token, expert) pairs sorted by expert (routing metadata below).
// The _n8 variants multiply one chunk of 8 tokens per weight pass (decode, <= 8 tokens per expert;
// gate/up _n8 with 16 warps, _n8w8 with 8), _n16 two chunks, _n32 four chunks (32 tokens) per pass.
// More tokens take further passes: grid.x, the fastest-varying block index, so the passes over one
// expert's weights run back to back and re-read them from L2 rather than HBM.
//
// Routing metadata (int32, device), made by kdlib.cuda.moe.prepare_routing:
//   expert_offsets [E + 1]  slot range [off[e], off[e+1]) of expert e in sorted order
//   active_experts [E]      the experts with >= 1 slot, first *n_active entries valid
//   sorted_token   [S]      token of each sorted slot;  sorted_weight [S] (fp32) its routing weight
//
// Packed weight layout (written by kdlib.cuda.moe.pack_rows): a matrix W [R, C] (R rows = output
// features, C = reduction dim) is cut into 16-row tiles and 64-column chunks; in each (tile, chunk)
// lane L = 4 g + t of a warp owns one uint4 whose word i (i = 0..3, one mma k16 step each) holds
// eight nibbles: rows g and g + 8, physical columns 16 t + 4 i + {0, 1, 2, 3}. The mma's k order
// is a permutation of the physical one (virtual k {2t, 2t+1, 2t+8, 2t+9} of step i = physical
// 16 t + 4 i + {0, 1, 2, 3}); A and B use the same permutation, so the product is unchanged, and
// each lane's activations are 16 contiguous bf16 (two 16-byte loads) of one scale group (t / 2).
// Nibble position of (row half h, column j) = h + 2 (j / 2) + 4 (j % 2), so one lop3 per pair
// yields a bf16x2 register of the mma A fragment (see dequant8). Scales: per (tile, chunk) 16
// uint32, index grp * 8 + g = {s[row g][grp] (low half), s[row g + 8][grp] (high half)}.
//
//   gate/up: w1 [E][N/16][K/64][2 (gate, up)][32] uint4,  s1 [E][N/16][K/64][2][16] uint32
//   down:    w2 [E][K/16][N/64][32] uint4,               s2 [E][K/16][N/64][16] uint32
//
// Limits (checked by the wrapper before launch): K % 64 == 0, N % 64 == 0, 16-byte aligned bases.
#include <cuda_bf16.h>

#include "common/w4a16.cuh"

namespace {

constexpr int kWarps = 8;               // down, and gate/up _n32: 256 threads
constexpr int kThreads = kWarps * 32;
constexpr int kWarpsN8 = 16;            // gate/up _n8: 16 warps split K (7 chunks each at K = 7168),
constexpr int kThreadsN8 = kWarpsN8 * 32;  // so one round of loads covers a block's whole slice
constexpr int kDownTilesPerWarp = 2;    // down: 2 row tiles per warp, 16 per block

// The B fragments of one 64-column chunk for token row `row` (nullptr: a padding column of zeros).
// Registers 2i, 2i+1 = b0, b1 of k16 step i (physical columns 16t + 4i + {0,1} and {2,3}).
__device__ __forceinline__ void load_b(const u16* row, int col0, int t, u32 b[8]) {
  if (row == nullptr) {
#pragma unroll
    for (int i = 0; i < 8; ++i) b[i] = 0u;
    return;
  }
  const uint4* p = reinterpret_cast<const uint4*>(row + col0 + 16 * t);
  const uint4 lo = __ldg(p), hi = __ldg(p + 1);
  b[0] = lo.x; b[1] = lo.y; b[2] = lo.z; b[3] = lo.w;
  b[4] = hi.x; b[5] = hi.y; b[6] = hi.z; b[7] = hi.w;
}

// Block (token pass x, pair p = y, active expert z): gate tile p and up tile p of one expert over the
// full K, split across WARPS warps, reduced in shared memory, SwiGLU, bf16 store.
// NCH chunks of 8 tokens per pass; KB chunks of 64 columns loaded before they are used.
template <int NCH, int KB, int WARPS>
__device__ __forceinline__ void gate_up_body(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token, u16* __restrict__ h,
    int K, int N, float (*red)[NCH * 8][32]) {
  const int a_idx = blockIdx.z;
  if (a_idx >= *n_active) return;  // block-uniform
  const int e = active_experts[a_idx];
  const int end = expert_offsets[e + 1];
  const int slot0 = expert_offsets[e] + blockIdx.x * (8 * NCH);
  if (slot0 >= end) return;  // block-uniform

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int p = blockIdx.y, P = N >> 4, KC = K >> 6;

  const u16* xrow[NCH];
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const int slot = slot0 + 8 * c + g;
    xrow[c] = slot < end ? x + (size_t)sorted_token[slot] * K : nullptr;
  }
  float acc[NCH][2][4];
#pragma unroll
  for (int c = 0; c < NCH; ++c)
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[c][u][r] = 0.0f;

  const size_t tile_base = (size_t)e * P + p;
  const uint4* wp = w1 + tile_base * KC * 2 * 32;
  const u32* sp = s1 + tile_base * KC * 2 * 16;
  const int per_warp = (KC + WARPS - 1) / WARPS;
  const int kbeg = warp * per_warp, kend = min(KC, kbeg + per_warp);

  for (int k0 = kbeg; k0 < kend; k0 += KB) {
    uint4 wv[KB][2];
    u32 sv[KB][2];
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      if (k0 + j < kend) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          wv[j][u] = __ldcs(wp + ((size_t)(k0 + j) * 2 + u) * 32 + lane);  // streamed once: evict-first
          sv[j][u] = __ldcs(sp + ((size_t)(k0 + j) * 2 + u) * 16 + (t >> 1) * 8 + g);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      if (k0 + j < kend) {
        u32 b[NCH][8];
#pragma unroll
        for (int c = 0; c < NCH; ++c) load_b(xrow[c], (k0 + j) * 64, t, b[c]);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const u32 words[4] = {wv[j][u].x, wv[j][u].y, wv[j][u].z, wv[j][u].w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            u32 afrag[4];
            dequant8(words[i], sv[j][u], afrag);
#pragma unroll
            for (int c = 0; c < NCH; ++c) mma_bf16(acc[c][u], afrag, b[c][2 * i], b[c][2 * i + 1]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int c = 0; c < NCH; ++c)
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < 4; ++r) red[warp][(c * 2 + u) * 4 + r][lane] = acc[c][u][r];
  __syncthreads();

  // One thread per (token chunk c, register r, lane): sum gate and up over the warps.
  for (int idx = threadIdx.x; idx < NCH * 4 * 32; idx += WARPS * 32) {
    const int ln = idx & 31, r = (idx >> 5) & 3, c = idx >> 7;
    float gs = 0.0f, us = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      gs += red[w][(c * 2 + 0) * 4 + r][ln];
      us += red[w][(c * 2 + 1) * 4 + r][ln];
    }
    const int row = (ln >> 2) + (r >= 2 ? 8 : 0);  // C fragment: rows g / g + 8
    const int col = 2 * (ln & 3) + (r & 1);         // C fragment: token column 2t, 2t + 1
    const int slot = slot0 + 8 * c + col;
    if (slot < end) {
      const float hv = gs / (1.0f + __expf(-gs)) * us;  // SwiGLU: silu(gate) * up
      h[(size_t)slot * N + p * 16 + row] = f32_to_bf16_bits(hv);
    }
  }
}

// Block (token pass x, row-tile group y, active expert z): each warp owns 2 row tiles of the
// output (16 rows each) over the full reduction N; results scaled by the routing weight are
// added into y (fp32, zeroed by the caller) with atomics, since topk experts share a token row.
template <int NCH, int KB>
__device__ __forceinline__ void down_body(
    const u16* __restrict__ h, const uint4* __restrict__ w2, const u32* __restrict__ s2,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token,
    const float* __restrict__ sorted_weight, float* __restrict__ y, int K, int N) {
  const int a_idx = blockIdx.z;
  if (a_idx >= *n_active) return;
  const int e = active_experts[a_idx];
  const int end = expert_offsets[e + 1];
  const int slot0 = expert_offsets[e] + blockIdx.x * (8 * NCH);
  if (slot0 >= end) return;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int RT = K >> 4, NC = N >> 6;
  const int rt0 = (blockIdx.y * kWarps + warp) * kDownTilesPerWarp;
  if (rt0 >= RT) return;  // warp-uniform; no block barrier in this kernel

  const u16* hrow[NCH];
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const int slot = slot0 + 8 * c + g;
    hrow[c] = slot < end ? h + (size_t)slot * N : nullptr;
  }
  float acc[kDownTilesPerWarp][NCH][4];
#pragma unroll
  for (int q = 0; q < kDownTilesPerWarp; ++q)
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[q][c][r] = 0.0f;

  for (int k0 = 0; k0 < NC; k0 += KB) {
    uint4 wv[KB][kDownTilesPerWarp];
    u32 sv[KB][kDownTilesPerWarp];
#pragma unroll
    for (int j = 0; j < KB; ++j) {
#pragma unroll
      for (int q = 0; q < kDownTilesPerWarp; ++q) {
        const int rt = rt0 + q;
        if (k0 + j < NC && rt < RT) {
          const size_t tile = ((size_t)e * RT + rt) * NC + (k0 + j);
          wv[j][q] = __ldcs(w2 + tile * 32 + lane);
          sv[j][q] = __ldcs(s2 + tile * 16 + (t >> 1) * 8 + g);
        } else {
          wv[j][q] = make_uint4(0u, 0u, 0u, 0u);
          sv[j][q] = 0u;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      if (k0 + j < NC) {
        u32 b[NCH][8];
#pragma unroll
        for (int c = 0; c < NCH; ++c) load_b(hrow[c], (k0 + j) * 64, t, b[c]);
#pragma unroll
        for (int q = 0; q < kDownTilesPerWarp; ++q) {
          if (rt0 + q < RT) {
            const u32 words[4] = {wv[j][q].x, wv[j][q].y, wv[j][q].z, wv[j][q].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              u32 afrag[4];
              dequant8(words[i], sv[j][q], afrag);
#pragma unroll
              for (int c = 0; c < NCH; ++c) mma_bf16(acc[q][c], afrag, b[c][2 * i], b[c][2 * i + 1]);
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (int c = 0; c < NCH; ++c) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // C fragment token columns 2t + half
      const int slot = slot0 + 8 * c + 2 * t + half;
      if (slot < end) {
        const float wgt = sorted_weight[slot];
        float* yrow = y + (size_t)sorted_token[slot] * K;
#pragma unroll
        for (int q = 0; q < kDownTilesPerWarp; ++q) {
          const int rt = rt0 + q;
          if (rt < RT) {
            atomicAdd(yrow + rt * 16 + g, wgt * acc[q][c][half]);
            atomicAdd(yrow + rt * 16 + g + 8, wgt * acc[q][c][2 + half]);
          }
        }
      }
    }
  }
}

}  // namespace

// Decode regime: <= 8 tokens per expert per pass, 7 column chunks (7 x 2 x 16 B per lane) in flight.
extern "C" __global__ void __launch_bounds__(kThreadsN8) moe_w4a16_v1_gate_up_n8(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token, u16* __restrict__ h,
    int K, int N) {
  __shared__ float red[kWarpsN8][8][32];
  gate_up_body<1, 7, kWarpsN8>(x, w1, s1, expert_offsets, active_experts, n_active, sorted_token, h, K, N, red);
}

// The same with 8 warps (two rounds of loads per warp at K = 7168, two blocks per SM): the
// benchmark measures both block shapes in the decode regime.
extern "C" __global__ void __launch_bounds__(kThreads) moe_w4a16_v1_gate_up_n8w8(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token, u16* __restrict__ h,
    int K, int N) {
  __shared__ float red[kWarps][8][32];
  gate_up_body<1, 7, kWarps>(x, w1, s1, expert_offsets, active_experts, n_active, sorted_token, h, K, N, red);
}

// 16 tokens per expert per pass, 4 column chunks in flight.
extern "C" __global__ void __launch_bounds__(kThreads) moe_w4a16_v1_gate_up_n16(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token, u16* __restrict__ h,
    int K, int N) {
  __shared__ float red[kWarps][16][32];
  gate_up_body<2, 4, kWarps>(x, w1, s1, expert_offsets, active_experts, n_active, sorted_token, h, K, N, red);
}

// Batched regime: 32 tokens per expert per pass (grid.x passes), 2 column chunks in flight.
extern "C" __global__ void __launch_bounds__(kThreads) moe_w4a16_v1_gate_up_n32(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token, u16* __restrict__ h,
    int K, int N) {
  __shared__ float red[kWarps][32][32];
  gate_up_body<4, 2, kWarps>(x, w1, s1, expert_offsets, active_experts, n_active, sorted_token, h, K, N, red);
}

extern "C" __global__ void __launch_bounds__(kThreads, 2) moe_w4a16_v1_down_n8(
    const u16* __restrict__ h, const uint4* __restrict__ w2, const u32* __restrict__ s2,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token,
    const float* __restrict__ sorted_weight, float* __restrict__ y, int K, int N) {
  down_body<1, 4>(h, w2, s2, expert_offsets, active_experts, n_active, sorted_token, sorted_weight, y, K, N);
}

extern "C" __global__ void __launch_bounds__(kThreads) moe_w4a16_v1_down_n16(
    const u16* __restrict__ h, const uint4* __restrict__ w2, const u32* __restrict__ s2,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token,
    const float* __restrict__ sorted_weight, float* __restrict__ y, int K, int N) {
  down_body<2, 4>(h, w2, s2, expert_offsets, active_experts, n_active, sorted_token, sorted_weight, y, K, N);
}

extern "C" __global__ void __launch_bounds__(kThreads) moe_w4a16_v1_down_n32(
    const u16* __restrict__ h, const uint4* __restrict__ w2, const u32* __restrict__ s2,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token,
    const float* __restrict__ sorted_weight, float* __restrict__ y, int K, int N) {
  down_body<4, 2>(h, w2, s2, expert_offsets, active_experts, n_active, sorted_token, sorted_weight, y, K, N);
}
