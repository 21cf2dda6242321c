// W4A16 grouped MoE GEMM, decode regime (<= 8 tokens per expert per layer call): the math, the
// packed weight layout, the routing metadata and the dequantization are those of
// moe_w4a16/v1.cu (read its header); v2 changes how the weight bytes are streamed.
//
// One MoE layer is two launches (v1: a y fill + two):
//   moe_w4a16_v2_gate_up_w{16,8}: zero y, then h[slot, :] = silu(x[tok] . Wg^T) * (x[tok] . Wu^T)
//   moe_w4a16_v2_down:            y[tok, :] += weight[slot] * (h[slot] . Wd^T)   (fp32 atomics)
// Both are persistent: the grid is sized to the resident blocks, and every warp streams a long
// sequence of 64-column chunks through its own cp.async ring in shared memory (STAGES deep), so the
// loads of the next chunks - across work-item boundaries too - are in flight while the current one
// is dequantized and multiplied (v1 loads a block's slice, computes, reduces and exits, and the
// memory pipe of the SM idles in between unless another resident block happens to be loading).
//
// gate_up: work item = (active expert, 16-row tile pair p); items i = blockIdx.x, + gridDim.x, ...
//   Each warp owns a fixed share of every item's K chunks (K split WARPS ways: a contiguous range
//   as v1, or round-robin in the _w8i variant); per item the warps' partial sums meet in shared
//   memory (one barrier per item, double-buffered; the rings keep loading meanwhile).
//   A chunk's stage holds gate and up weights, their scales and the 8 token rows' activations.
// down: work item = (active expert, 16-row output tile) over the full reduction N; the flat item
//   range is cut into one contiguous piece per warp (no barriers, balance to one item). The B
//   fragments (the expert's h rows, N <= 256) are loaded into registers once per expert.
//
// Each lane reads back only the shared-memory words that its own cp.async wrote, so a per-thread
// cp.async.wait_group is the only synchronization the rings need. Requirements (checked by the
// wrapper): every expert has <= 8 slots (one token chunk), K % 64 == 0, N % 64 == 0, N <= 256, 16-byte
// aligned bases; dynamic shared memory as given by the kStages / kWarps constants below.
#include <cuda_bf16.h>

#include "common/w4a16.cuh"

namespace {

constexpr int kDownWarps = 16;   // down: 512 threads, one block per SM
constexpr int kDownStages = 8;   // 7 chunks (7 x 640 B) in flight per warp, ~70 KB per SM
constexpr int kDownMaxChunks = 4;  // N <= 256: the B fragments of a whole h row fit in 32 registers

// gate/up stage per warp: 4 x 32 uint4 (gate w, up w, x cols 0-7, x cols 8-15) + 2 x 32 scale words.
constexpr int kGuStageVec = 4 * 32;
constexpr int kGuStageWords = 2 * 32;
// down stage per warp: 32 uint4 of weights + 32 scale words.
constexpr int kDnStageVec = 32;
constexpr int kDnStageWords = 32;

// ---------------------------------------------------------------- cp.async (sm_80+)
__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16 bytes, L2 only (the weights are read once).
__device__ __forceinline__ void cp16_cg(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

// 16 bytes through L1 (activations, re-read by the other tiles of the expert); zeros when !valid.
__device__ __forceinline__ void cp16_ca_zfill(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

// The next chunk of a warp's stream into its ring (when one is left), then close the group: empty
// groups keep the group count uniform, so wait_group<STAGES - 1> always means "the oldest landed".
template <class Issue>
__device__ __forceinline__ void issue_next(Issue& issue, int& issued, int total) {
  if (issued < total) {
    issue();
    ++issued;
  }
  cp_commit();
}

// ---------------------------------------------------------------- gate / up
// Items of this block: blockIdx.x + it * gridDim.x (it = 0 .. my_items-1), item = a_idx * P + p.
// Warp `warp` streams cnt chunks kfirst + c * kstep (c = 0 .. cnt-1) of each item: a contiguous
// K range (kstep 1, INTERLEAVE false) or every WARPS-th chunk (kfirst = warp, kstep = WARPS), so
// that the block's warps read adjacent chunks at the same time. Stream position pos = it * cnt + c.
template <int WARPS, int STAGES, bool INTERLEAVE>
__device__ __forceinline__ void gate_up_body(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token, u16* __restrict__ h,
    float* __restrict__ y, int M, int K, int N, float (*red)[WARPS][8][32], uint4* ring) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  // y is the down launch's accumulator: zero it here (that launch starts after this one ends).
  {
    float4* y4 = reinterpret_cast<float4*>(y);
    const int n4 = (M * K) >> 2;  // K % 64 == 0
    for (int i = blockIdx.x * (WARPS * 32) + tid; i < n4; i += gridDim.x * (WARPS * 32))
      y4[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }

  const int P = N >> 4, KC = K >> 6;
  const int n_items = *n_active * P;
  const int my_items = n_items > (int)blockIdx.x ? (n_items - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
  const int per_warp = (KC + WARPS - 1) / WARPS;
  const int kfirst = INTERLEAVE ? warp : min(KC, warp * per_warp);
  const int kstep = INTERLEAVE ? WARPS : 1;
  const int cnt = INTERLEAVE ? (warp < KC ? (KC - 1 - warp) / WARPS + 1 : 0)
                             : min(KC, kfirst + per_warp) - kfirst;  // 0 for idle warps when KC < WARPS
  const int total = my_items * cnt;

  uint4* wring = ring + warp * STAGES * kGuStageVec;                                          // [S][4][32]
  u32* sring = reinterpret_cast<u32*>(ring + WARPS * STAGES * kGuStageVec) + warp * STAGES * kGuStageWords;  // [S][2][32]

  // Issue cursor: item it_i, chunk c_i; per-item addresses cached when it_i changes.
  int it_i = 0, c_i = 0, stage_i = 0;
  const uint4* wsrc = w1;
  const u32* ssrc = s1;
  const u16* xsrc = x;
  bool xvalid = false;
  auto issue_item = [&]() {
    const int item = blockIdx.x + it_i * gridDim.x;
    const int a_idx = item / P, p = item - a_idx * P;
    const int e = active_experts[a_idx];
    const int slot = expert_offsets[e] + g;
    xvalid = slot < expert_offsets[e + 1];
    xsrc = x + (xvalid ? (size_t)sorted_token[slot] * K : 0) + (size_t)kfirst * 64 + 16 * t;
    const size_t chunk0 = ((size_t)e * P + p) * KC + kfirst;
    wsrc = w1 + chunk0 * 2 * 32 + lane;
    ssrc = s1 + chunk0 * 2 * 16 + (t >> 1) * 8 + g;
  };
  auto issue = [&]() {  // the chunk at the cursor into ring stage stage_i, then advance
    if (c_i == 0) issue_item();
    uint4* sw = wring + stage_i * kGuStageVec + lane;
    u32* ss = sring + stage_i * kGuStageWords + lane;
    const int k = c_i * kstep;          // chunks past kfirst
    const size_t cw = (size_t)k * 2 * 32, cs = (size_t)k * 2 * 16;
    cp16_cg(sw, wsrc + cw);             // gate
    cp16_cg(sw + 32, wsrc + cw + 32);   // up
    cp16_ca_zfill(sw + 64, xsrc + k * 64, xvalid);
    cp16_ca_zfill(sw + 96, xsrc + k * 64 + 8, xvalid);
    cp4(ss, ssrc + cs);
    cp4(ss + 32, ssrc + cs + 16);
    stage_i = stage_i + 1 == STAGES ? 0 : stage_i + 1;
    if (++c_i == cnt) { c_i = 0; ++it_i; }
  };

  int issued = 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_next(issue, issued, total);

  int stage_c = 0;
  for (int it = 0; it < my_items; ++it) {
    float acc[2][4];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[u][r] = 0.0f;

    for (int c = 0; c < cnt; ++c) {
      issue_next(issue, issued, total);
      cp_wait<STAGES - 1>();  // this thread's copies of the chunk being consumed have landed
      const uint4* sw = wring + stage_c * kGuStageVec + lane;
      const u32* ss = sring + stage_c * kGuStageWords + lane;
      const uint4 wg = sw[0], wu = sw[32], xl = sw[64], xh = sw[96];
      const u32 sg = ss[0], su = ss[32];
      stage_c = stage_c + 1 == STAGES ? 0 : stage_c + 1;
      const u32 b[8] = {xl.x, xl.y, xl.z, xl.w, xh.x, xh.y, xh.z, xh.w};
      mma_chunk(acc[0], wg, sg, b);
      mma_chunk(acc[1], wu, su, b);
    }

    // Partial sums into red[it & 1]: the reads of this buffer two items ago all preceded the
    // barrier of the previous item, so one barrier per item suffices.
    float (*rb)[8][32] = red[it & 1];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < 4; ++r) rb[warp][u * 4 + r][lane] = acc[u][r];
    __syncthreads();

    // One thread per (register r, lane): sum gate and up over the warps, SwiGLU, bf16 store.
    if (tid < 4 * 32) {
      const int item = blockIdx.x + it * gridDim.x;
      const int a_idx = item / P, p = item - a_idx * P;
      const int e = active_experts[a_idx];
      const int ln = tid & 31, r = tid >> 5;
      const int slot = expert_offsets[e] + 2 * (ln & 3) + (r & 1);  // C fragment: token column 2t, 2t+1
      if (slot < expert_offsets[e + 1]) {
        float gs = 0.0f, us = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
          gs += rb[w][r][ln];
          us += rb[w][4 + r][ln];
        }
        const int row = (ln >> 2) + (r >= 2 ? 8 : 0);  // C fragment: rows g / g + 8
        const float hv = gs / (1.0f + __expf(-gs)) * us;
        h[(size_t)slot * N + p * 16 + row] = f32_to_bf16_bits(hv);
      }
    }
  }
  cp_wait<0>();  // no copy may outlive the block (only empty groups remain)
}

// ---------------------------------------------------------------- down
// The B fragments of all NC <= kDownMaxChunks chunks of the current expert's h rows stay in
// registers while the warp walks that expert's row tiles (h is the same for all of them).
template <int WARPS, int STAGES>
__device__ __forceinline__ void down_body(
    const u16* __restrict__ h, const uint4* __restrict__ w2, const u32* __restrict__ s2,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token,
    const float* __restrict__ sorted_weight, float* __restrict__ y, int K, int N, uint4* ring) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int RT = K >> 4, NC = N >> 6;  // NC <= kDownMaxChunks (checked by the wrapper)
  const long long n_items = (long long)*n_active * RT;
  const long long gw = (long long)blockIdx.x * WARPS + warp, tw = (long long)gridDim.x * WARPS;
  const int i0 = (int)(n_items * gw / tw), i1 = (int)(n_items * (gw + 1) / tw);  // this warp's items
  const int total = (i1 - i0) * NC;

  uint4* wring = ring + warp * STAGES * kDnStageVec;                                          // [S][32]
  u32* sring = reinterpret_cast<u32*>(ring + WARPS * STAGES * kDnStageVec) + warp * STAGES * kDnStageWords;  // [S][32]

  // Issue cursor: item it_i (absolute), chunk c_i.
  int it_i = i0, c_i = 0, stage_i = 0;
  const uint4* wsrc = w2;
  const u32* ssrc = s2;
  auto issue = [&]() {
    if (c_i == 0) {
      const int a_idx = it_i / RT, rt = it_i - a_idx * RT;
      const size_t chunk0 = ((size_t)active_experts[a_idx] * RT + rt) * NC;
      wsrc = w2 + chunk0 * 32 + lane;
      ssrc = s2 + chunk0 * 16 + (t >> 1) * 8 + g;
    }
    cp16_cg(wring + stage_i * kDnStageVec + lane, wsrc + (size_t)c_i * 32);
    cp4(sring + stage_i * kDnStageWords + lane, ssrc + (size_t)c_i * 16);
    stage_i = stage_i + 1 == STAGES ? 0 : stage_i + 1;
    if (++c_i == NC) { c_i = 0; ++it_i; }
  };

  int issued = 0;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_next(issue, issued, total);

  int stage_c = 0, cur_a = -1;
  u32 b[kDownMaxChunks][8];      // this lane's B registers of every chunk (token row g of the expert)
  float* yrow[2] = {y, y};       // C fragment token columns 2t, 2t + 1: their y rows ...
  float wgt[2] = {0.0f, 0.0f};   // ... and routing weights (0 and unused when the slot is absent)
  bool has[2] = {false, false};
  for (int item = i0; item < i1; ++item) {
    const int a_idx = item / RT, rt = item - a_idx * RT;
    if (a_idx != cur_a) {  // a new expert: its slots' rows
      cur_a = a_idx;
      const int e = active_experts[a_idx];
      const int off = expert_offsets[e], end = expert_offsets[e + 1];
      const u16* hrow = off + g < end ? h + (size_t)(off + g) * N + 16 * t : nullptr;
#pragma unroll
      for (int c = 0; c < kDownMaxChunks; ++c) {
        uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
        if (hrow != nullptr && c < NC) {
          const uint4* p = reinterpret_cast<const uint4*>(hrow + c * 64);
          lo = __ldg(p);
          hi = __ldg(p + 1);
        }
        b[c][0] = lo.x; b[c][1] = lo.y; b[c][2] = lo.z; b[c][3] = lo.w;
        b[c][4] = hi.x; b[c][5] = hi.y; b[c][6] = hi.z; b[c][7] = hi.w;
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int slot = off + 2 * t + half;
        has[half] = slot < end;
        yrow[half] = has[half] ? y + (size_t)sorted_token[slot] * K : y;
        wgt[half] = has[half] ? sorted_weight[slot] : 0.0f;
      }
    }
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < kDownMaxChunks; ++c) {
      if (c < NC) {
        issue_next(issue, issued, total);
        cp_wait<STAGES - 1>();
        const uint4 wv = wring[stage_c * kDnStageVec + lane];
        const u32 sv = sring[stage_c * kDnStageWords + lane];
        stage_c = stage_c + 1 == STAGES ? 0 : stage_c + 1;
        mma_chunk(acc, wv, sv, b[c]);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (has[half]) {
        atomicAdd(yrow[half] + rt * 16 + g, wgt[half] * acc[half]);
        atomicAdd(yrow[half] + rt * 16 + g + 8, wgt[half] * acc[2 + half]);
      }
    }
  }
  cp_wait<0>();
}

}  // namespace

// Gate/up. red: two item buffers of per-warp partial sums (see gate_up_body).
// 16 warps (512 threads), one block per SM, 5 stages: 180 KB dynamic + 32 KB static shared memory
// (H100/H200 class only).
extern "C" __global__ void __launch_bounds__(512, 1) moe_w4a16_v2_gate_up_w16(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token, u16* __restrict__ h,
    float* __restrict__ y, int M, int K, int N) {
  __shared__ float red[2][16][8][32];
  extern __shared__ uint4 ring[];
  gate_up_body<16, 5, false>(x, w1, s1, expert_offsets, active_experts, n_active, sorted_token, h, y, M, K, N,
                             red, ring);
}

// 8 warps (256 threads), 4 stages: 72 KB dynamic + 16 KB static shared memory, so two blocks per
// SM on an H200 and one on a 100 KB part (sm_120).
extern "C" __global__ void __launch_bounds__(256, 2) moe_w4a16_v2_gate_up_w8(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token, u16* __restrict__ h,
    float* __restrict__ y, int M, int K, int N) {
  __shared__ float red[2][8][8][32];
  extern __shared__ uint4 ring[];
  gate_up_body<8, 4, false>(x, w1, s1, expert_offsets, active_experts, n_active, sorted_token, h, y, M, K, N,
                            red, ring);
}

// The 8-warp block with the K chunks dealt out round-robin (warp w: chunks w, w + 8, ...).
extern "C" __global__ void __launch_bounds__(256, 2) moe_w4a16_v2_gate_up_w8i(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token, u16* __restrict__ h,
    float* __restrict__ y, int M, int K, int N) {
  __shared__ float red[2][8][8][32];
  extern __shared__ uint4 ring[];
  gate_up_body<8, 4, true>(x, w1, s1, expert_offsets, active_experts, n_active, sorted_token, h, y, M, K, N,
                           red, ring);
}

// Down: 16 warps, 8 stages: 80 KB dynamic shared memory.
extern "C" __global__ void __launch_bounds__(kDownWarps * 32, 1) moe_w4a16_v2_down(
    const u16* __restrict__ h, const uint4* __restrict__ w2, const u32* __restrict__ s2,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts,
    const int* __restrict__ n_active, const int* __restrict__ sorted_token,
    const float* __restrict__ sorted_weight, float* __restrict__ y, int K, int N) {
  extern __shared__ uint4 ring[];
  down_body<kDownWarps, kDownStages>(h, w2, s2, expert_offsets, active_experts, n_active, sorted_token,
                                     sorted_weight, y, K, N, ring);
}
