// W4A16 grouped MoE GEMM, decode regime (<= 8 tokens per expert per layer call), in ONE launch:
// the math, the packed weight layout, the routing metadata and the dequantization are those of
// moe_w4a16_v1.cu (read its header); the per-warp cp.async rings are those of moe_w4a16_v2.cu.
//
// Why one launch: v2's two launches (gate/up, then down) each pay a ramp and a drain, and the down
// launch cannot start loading its weights until the last gate/up block is done. Measured on the
// H200 (data/results/moe_stream.h200.json), a plain streaming read of the M = 4 layer's bytes
// loses 7 points of copy bandwidth when split into two launches. Here every block runs
//   phase 1, gate/up: work items (active expert, 16-row tile pair p) handed out by a global
//     counter; per item the 8 warps' partial sums meet in shared memory, SwiGLU, h stored in bf16,
//     then the item is published (ready[expert] += 1). The first Z items also zero a stripe of y.
//   phase 2, down: when the counter is exhausted, each warp takes a contiguous range of the
//     (active expert, 16-row output tile) items; its ring starts loading down weights at once
//     (they do not depend on h) and the warp waits for ready[expert] == N / 16 only before it
//     reads that expert's h, and for all Z stripes of y before its first atomic add.
// No wait can deadlock without co-residency: phase-1 items go only to running blocks, which
// finish them without waiting, and a block enters phase 2 only after the counter is exhausted.
// The last block to finish resets the counters, so launches on one workspace must be ordered
// (one stream); a launch that is aborted leaves them dirty (the wrapper re-zeroes on a new
// workspace only).
//
// Down streams one whole work item (NC <= 4 chunks: 2 KB of weights + their scales) per ring stage,
// and both phases walk their items with running indices rather than divisions: v2's down kernel was
// issue-bound (ncu, M = 32: 66% SM throughput at 51% of DRAM bandwidth; data/results/ncu/).
//
// Workspace (int32, zero before the first launch): [0] next phase-1 item, [1] y stripes zeroed,
// [2] blocks finished, [3 ...] ready count per active expert (n_active entries).
// Requirements (checked by the wrapper): every expert has <= 8 slots, K % 64 == 0, N % 64 == 0,
// N <= 256, 16-byte aligned bases, dynamic shared memory kWarps * kStages * kStageBytes.
#include <cuda_bf16.h>

// NVRTC (CuPy) has no host headers such as <stdint.h>: fixed-width names of our own.
typedef unsigned int u32;
typedef unsigned short u16;

namespace {

constexpr int kWarps = 8;          // 256 threads, two blocks per SM on an H200
constexpr int kStages = 4;         // ring stages per warp (3 in flight)
constexpr int kQueue = 8;          // phase-1 item slots of a block (see gate_up_phase)
constexpr int kUngrabbed = -2, kGrabbing = -3;   // slot states besides an item id or -1 (none left)
constexpr int kDownMaxChunks = 4;  // N <= 256: the B fragments of a whole h row fit in 32 registers
constexpr int kZeroStripe = 1024;  // float4s of y per zeroing item (16 KB)
// Ring stage per warp, in uint4: gate/up uses 4 x 32 (gate w, up w, x cols 0-7, x cols 8-15) and
// 2 x 32 scale words after them; down uses kDownMaxChunks x 32 (weights) and kDownMaxChunks x 32
// scale words. The larger (down) sets the stride.
constexpr int kStageVec = kDownMaxChunks * 32 + kDownMaxChunks * 32 / 4;   // 160 uint4 = 2560 B
constexpr int kWsNext = 0, kWsZeroed = 1, kWsDone = 2, kWsReady = 3;

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

// Eight nibbles -> the four bf16x2 registers of an mma A fragment (identical to v1's dequant8).
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

// ---------------------------------------------------------------- cp.async (sm_80+), flags
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

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Spin (the whole warp, one address) until *p >= target.
__device__ __forceinline__ void wait_at_least(const int* p, int target) {
  while (load_acquire(p) < target) __nanosleep(64);
}

// The item id of block queue slot s (called by a whole warp): the first warp to need the slot takes
// the next id from the global counter (-1 once all n_items are handed out); the others read it.
// Taking ids only when a ring first needs them keeps a block from holding items that idle blocks
// could run (at M = 1 there are fewer gate/up items than blocks).
__device__ __forceinline__ int slot_item(int* q, int s, int* ws, int n_items) {
  int v = 0;
  if ((threadIdx.x & 31) == 0) {
    v = atomicCAS(q + s, kUngrabbed, kGrabbing);
    if (v == kUngrabbed) {
      const int j = atomicAdd(ws + kWsNext, 1);
      v = j < n_items ? j : -1;
      atomicExch(q + s, v);
    }
    while (v == kGrabbing) v = atomicAdd(q + s, 0);
  }
  return __shfl_sync(0xffffffffu, v, 0);
}

// ---------------------------------------------------------------- phase 1: gate / up
// Items come from the global counter through a block queue q[kQueue] in shared memory: item it of
// the block sits in slot it % kQueue, taken by the first warp whose ring reaches it (slot_item).
// Rings run at most kStages - 1 chunks ahead, so every slot a warp touches belongs to an item
// within kStages - 1 of the one being consumed, and warp 0 (cnt >= 1) touches item it + 1 before
// the barriers that end item it. Thread 0 frees the slot of item it - 1 once item it starts.
// Warp `warp` streams the chunks [kfirst, kfirst + cnt) of every item's K range.
__device__ __forceinline__ void gate_up_phase(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts, int n_items,
    const int* __restrict__ sorted_token, u16* __restrict__ h, float* __restrict__ y, int* ws,
    int M, int K, int N, int* q, float (*red)[8][32], uint4* wring) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int P = N >> 4, KC = K >> 6;
  const int n4 = (M * K) >> 2;                                   // y in float4s (K % 64 == 0)
  const int Z = min(n_items, (n4 + kZeroStripe - 1) / kZeroStripe);
  const int zlen = (n4 + Z - 1) / Z;
  const int per_warp = (KC + kWarps - 1) / kWarps;
  const int kfirst = min(KC, warp * per_warp);
  const int cnt = min(KC, kfirst + per_warp) - kfirst;            // 0 for idle warps when KC < kWarps

  if (tid < kQueue) q[tid] = kUngrabbed;
  __syncthreads();

  // Issue cursor: queue position it_i, chunk c_i; per-item addresses set when c_i == 0.
  int it_i = 0, c_i = 0, stage_i = 0;
  bool more = cnt > 0;
  const uint4* wsrc = w1;
  const u32* ssrc = s1;
  const u16* xsrc = x;
  bool xvalid = false;
  auto issue_next = [&]() {
    if (more && c_i == 0) {
      const int j = slot_item(q, it_i % kQueue, ws, n_items);
      if (j < 0) {
        more = false;
      } else {
        const int a_idx = j / P, p = j - a_idx * P;
        const int e = active_experts[a_idx];
        const int slot = expert_offsets[e] + g;
        xvalid = slot < expert_offsets[e + 1];
        xsrc = x + (xvalid ? (size_t)sorted_token[slot] * K : 0) + (size_t)kfirst * 64 + 16 * t;
        const size_t chunk0 = ((size_t)e * P + p) * KC + kfirst;
        wsrc = w1 + chunk0 * 2 * 32 + lane;
        ssrc = s1 + chunk0 * 2 * 16 + (t >> 1) * 8 + g;
      }
    }
    if (more) {
      uint4* sw = wring + stage_i * kStageVec + lane;
      u32* ss = reinterpret_cast<u32*>(wring + stage_i * kStageVec + 4 * 32) + lane;
      cp16_cg(sw, wsrc);             // gate
      cp16_cg(sw + 32, wsrc + 32);   // up
      cp16_ca_zfill(sw + 64, xsrc, xvalid);
      cp16_ca_zfill(sw + 96, xsrc + 8, xvalid);
      cp4(ss, ssrc);
      cp4(ss + 32, ssrc + 16);
      wsrc += 2 * 32;
      ssrc += 2 * 16;
      xsrc += 64;
      stage_i = stage_i + 1 == kStages ? 0 : stage_i + 1;
      if (++c_i == cnt) { c_i = 0; ++it_i; }
    }
    cp_commit();
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue_next();
  __syncthreads();   // warp 0 has taken item 0

  int stage_c = 0;
  for (int it = 0;; ++it) {
    const int j = *(volatile int*)(q + it % kQueue);   // taken before the last barrier; -1: none left
    if (j < 0) break;
    if (tid == 0) q[(it + kQueue - 1) % kQueue] = kUngrabbed;   // item it - 1's slot: no reader left
    const int a_idx = j / P, p = j - a_idx * P;

    if (j < Z) {  // one stripe of y, zeroed before any down atomic (phase 2 waits on ws[kWsZeroed])
      float4* y4 = reinterpret_cast<float4*>(y);
      const int end = min(n4, (j + 1) * zlen);
      for (int i = j * zlen + tid; i < end; i += kWarps * 32) y4[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }

    float acc[2][4];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[u][r] = 0.0f;
    for (int c = 0; c < cnt; ++c) {
      issue_next();
      cp_wait<kStages - 1>();   // this thread's copies of the chunk being consumed have landed
      const uint4* sw = wring + stage_c * kStageVec + lane;
      const u32* ss = reinterpret_cast<const u32*>(wring + stage_c * kStageVec + 4 * 32) + lane;
      const uint4 wg = sw[0], wu = sw[32], xl = sw[64], xh = sw[96];
      const u32 sg = ss[0], su = ss[32];
      stage_c = stage_c + 1 == kStages ? 0 : stage_c + 1;
      const u32 b[8] = {xl.x, xl.y, xl.z, xl.w, xh.x, xh.y, xh.z, xh.w};
      mma_chunk(acc[0], wg, sg, b);
      mma_chunk(acc[1], wu, su, b);
    }

#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int r = 0; r < 4; ++r) red[warp][u * 4 + r][lane] = acc[u][r];
    __syncthreads();

    // One thread per (register r, lane): sum gate and up over the warps, SwiGLU, bf16 store.
    if (tid < 4 * 32) {
      const int e = active_experts[a_idx];
      const int ln = tid & 31, r = tid >> 5;
      const int slot = expert_offsets[e] + 2 * (ln & 3) + (r & 1);  // C fragment: token column 2t, 2t+1
      if (slot < expert_offsets[e + 1]) {
        float gs = 0.0f, us = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          gs += red[w][r][ln];
          us += red[w][4 + r][ln];
        }
        const int row = (ln >> 2) + (r >= 2 ? 8 : 0);  // C fragment: rows g / g + 8
        const float hv = gs / (1.0f + __expf(-gs)) * us;
        h[(size_t)slot * N + p * 16 + row] = f32_to_bf16_bits(hv);
      }
    }
    __threadfence();   // h and the y stripe before the item is published
    __syncthreads();   // also: red is free for the next item
    if (tid == 0) {
      atomicAdd(ws + kWsReady + a_idx, 1);
      if (j < Z) atomicAdd(ws + kWsZeroed, 1);
    }
  }
  cp_wait<0>();  // the ring is reused by phase 2 (only empty groups remain)
}

// ---------------------------------------------------------------- phase 2: down
// One ring stage = one whole item: the NC chunks of one 16-row output tile over the full reduction
// N (weights and this lane's scale word of each chunk). The B fragments of the current expert's h
// rows stay in registers while the warp walks that expert's row tiles.
__device__ __forceinline__ void down_phase(
    const u16* __restrict__ h, const uint4* __restrict__ w2, const u32* __restrict__ s2,
    const int* __restrict__ expert_offsets, const int* __restrict__ active_experts, int n_active,
    const int* __restrict__ sorted_token, const float* __restrict__ sorted_weight, float* __restrict__ y,
    const int* ws, int M, int K, int N, uint4* wring) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int RT = K >> 4, NC = N >> 6, P = N >> 4;
  const int n4 = (M * K) >> 2;
  const int Z = min(n_active * P, (n4 + kZeroStripe - 1) / kZeroStripe);   // as in gate_up_phase
  const long long n_items = (long long)n_active * RT;
  const long long gw = (long long)blockIdx.x * kWarps + warp, tw = (long long)gridDim.x * kWarps;
  const int i0 = (int)(n_items * gw / tw), i1 = (int)(n_items * (gw + 1) / tw);  // this warp's items

  // Issue cursor: item it_i as (expert index ia, row tile rt_i), advanced without divisions.
  int it_i = i0, ia = i0 / RT, rt_i = i0 - ia * RT, stage_i = 0;
  const uint4* wsrc = w2;
  const u32* ssrc = s2;
  auto set_src = [&]() {
    const size_t chunk0 = ((size_t)active_experts[ia] * RT + rt_i) * NC;
    wsrc = w2 + chunk0 * 32 + lane;
    ssrc = s2 + chunk0 * 16 + (t >> 1) * 8 + g;
  };
  if (i0 < i1) set_src();
  auto issue_next = [&]() {
    if (it_i < i1) {
      uint4* sw = wring + stage_i * kStageVec + lane;
      u32* ss = reinterpret_cast<u32*>(wring + stage_i * kStageVec + kDownMaxChunks * 32) + lane;
#pragma unroll
      for (int c = 0; c < kDownMaxChunks; ++c) {
        if (c < NC) {
          cp16_cg(sw + c * 32, wsrc + c * 32);
          cp4(ss + c * 32, ssrc + c * 16);
        }
      }
      stage_i = stage_i + 1 == kStages ? 0 : stage_i + 1;
      if (++it_i < i1) {
        if (++rt_i == RT) { rt_i = 0; ++ia; set_src(); }
        else { wsrc += NC * 32; ssrc += NC * 16; }
      }
    }
    cp_commit();
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue_next();

  int stage_c = 0, cur_a = -1, rt = i0 - (i0 / RT) * RT, a_idx = i0 / RT;
  bool zeroed = false;
  u32 b[kDownMaxChunks][8];      // this lane's B registers of every chunk (token row g of the expert)
  float* yrow[2] = {y, y};       // C fragment token columns 2t, 2t + 1: their y rows ...
  float wgt[2] = {0.0f, 0.0f};   // ... and routing weights (0 and unused when the slot is absent)
  bool has[2] = {false, false};
  for (int item = i0; item < i1; ++item) {
    if (a_idx != cur_a) {  // a new expert: wait for its h, then its slots' rows
      cur_a = a_idx;
      wait_at_least(ws + kWsReady + a_idx, P);
      const int e = active_experts[a_idx];
      const int off = expert_offsets[e], end = expert_offsets[e + 1];
      const u16* hrow = off + g < end ? h + (size_t)(off + g) * N + 16 * t : nullptr;
#pragma unroll
      for (int c = 0; c < kDownMaxChunks; ++c) {
        uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
        if (hrow != nullptr && c < NC) {
          const uint4* p = reinterpret_cast<const uint4*>(hrow + c * 64);
          lo = __ldcg(p);    // written in this launch: from L2, never a stale L1 line
          hi = __ldcg(p + 1);
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
    issue_next();
    cp_wait<kStages - 1>();
    const uint4* sw = wring + stage_c * kStageVec + lane;
    const u32* ss = reinterpret_cast<const u32*>(wring + stage_c * kStageVec + kDownMaxChunks * 32) + lane;
    stage_c = stage_c + 1 == kStages ? 0 : stage_c + 1;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < kDownMaxChunks; ++c)
      if (c < NC) mma_chunk(acc, sw[c * 32], ss[c * 32], b[c]);
    if (!zeroed) {
      wait_at_least(ws + kWsZeroed, Z);
      zeroed = true;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (has[half]) {
        atomicAdd(yrow[half] + rt * 16 + g, wgt[half] * acc[half]);
        atomicAdd(yrow[half] + rt * 16 + g + 8, wgt[half] * acc[2 + half]);
      }
    }
    if (++rt == RT) { rt = 0; ++a_idx; }
  }
  cp_wait<0>();
}

}  // namespace

// One launch per MoE layer call; grid = the resident blocks (2 per SM on an H200), 256 threads,
// dynamic shared memory kWarps * kStages * kStageVec * 16 = 80 KB, static 8 KB + the queue.
extern "C" __global__ void __launch_bounds__(kWarps * 32, 2) moe_w4a16_v3(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const uint4* __restrict__ w2, const u32* __restrict__ s2, const int* __restrict__ expert_offsets,
    const int* __restrict__ active_experts, const int* __restrict__ n_active_dev,
    const int* __restrict__ sorted_token, const float* __restrict__ sorted_weight, u16* __restrict__ h,
    float* __restrict__ y, int* ws, int M, int K, int N) {
  __shared__ float red[kWarps][8][32];
  __shared__ int q[kQueue];
  extern __shared__ uint4 ring[];
  uint4* wring = ring + (threadIdx.x >> 5) * kStages * kStageVec;   // this warp's [kStages][kStageVec]
  const int n_active = *n_active_dev;
  gate_up_phase(x, w1, s1, expert_offsets, active_experts, n_active * (N >> 4), sorted_token, h, y, ws, M, K,
                N, q, red, wring);
  down_phase(h, w2, s2, expert_offsets, active_experts, n_active, sorted_token, sorted_weight, y, ws, M, K, N,
             wring);

  // The last block out resets the counters for the next launch on this workspace.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(ws + kWsDone, 1) == (int)gridDim.x - 1) {
      for (int i = 0; i < n_active; ++i) ws[kWsReady + i] = 0;
      ws[kWsNext] = 0;
      ws[kWsZeroed] = 0;
      ws[kWsDone] = 0;
      __threadfence();
    }
  }
}
