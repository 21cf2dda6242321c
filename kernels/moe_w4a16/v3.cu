// W4A16 grouped MoE GEMM, decode regime (<= 8 tokens per expert per layer call), in ONE launch of
// independent warps: the math, the packed weight layout, the routing metadata and the
// dequantization are those of moe_w4a16/v1.cu (read its header); the per-warp cp.async rings are
// those of moe_w4a16/v2.cu.
//
// Why: v2's two launches each pay a ramp and a drain (a plain streaming read of a small layer's
// bytes is slower split in two launches: data/results/moe_stream.h200.json, `two_launch`),
// and its gate/up items (expert, 16-row tile pair), one per 8-warp block, come in waves that leave
// blocks idle: 488 items on 264 blocks at M = 4. A first one-launch design (block-wide items from a
// global counter, static down ranges; commit ae34b5e) measured no faster than v2 and slower at M = 1
// (data/results/gpu_tests.h200.json, the call at that commit).
//
// Here every warp is a worker with its own ring; no block barriers.
//   gate/up: item = (active expert, tile pair p, K part) of KC / n_parts chunks, from a global
//     counter; its partial gate and up sums are added (fp32 atomics) into a scratch the last part
//     reads (a per-pair count says which part is last); that part applies SwiGLU, stores h, zeroes
//     the scratch, and publishes the pair (ready[expert] += 1). With n_parts = 1 the only part does
//     it from registers. The first Z items also zero a stripe of y (with no item, no expert of the
//     device routed to, every warp zeroes its grid-stride share). The parts add up in whatever
//     order they finish, so with n_parts > 1 h (like y, in every version) can differ in the last
//     bits from run to run.
//   down: when gate/up items run out, the warp takes batches of down_batch (active expert, 16-row
//     output tile) items from a second counter, one whole item (NC <= 4 chunks) per ring stage;
//     before reading an expert's h it waits for ready[expert] == N / 16, and before its first
//     atomic add into y for all Z stripes.
// The ring runs on across item, batch and phase boundaries. A unit costs latency before its loads
// can start (the counter's atomic, then the routing reads its addresses need), so the next id is
// taken STAGES - 1 stages before the ring needs it, and the routing reads are one level deep
// (active_ranges holds each active expert's slot range). No wait can deadlock: gate/up items go only to
// running warps, which finish them without waiting, and a warp turns to down only after the
// gate/up counter is exhausted. Both counters hand out work in expert order, so down starts on the
// experts whose h is done first. The last warp to finish resets the counters; launches on one
// workspace must be ordered (one stream).
//
// Workspace (int32, zero before the first launch, zero again after each): counters on 128-byte lines
// of their own (many warps poll them): [0] next gate/up item, [32] next down batch, [64] y stripes
// zeroed, [96] warps finished, [128 + 32 a] ready pairs of active expert a (a < E),
// [128 + 32 E + pair] parts done of pair a * P + p. Scratch (fp32, zero likewise): [E * P][2][4][32]
// (gate and up C fragments of a pair, lane-minor).
// Requirements (checked by the wrapper): every expert has <= 8 slots, K % 64 == 0, N % 64 == 0,
// N <= 256, (K / 64) % n_parts == 0 with >= STAGES - 1 chunks per part, (K / 16) % down_batch == 0
// with down_batch >= STAGES - 1 (every unit spans >= STAGES - 1 stages, so the issue side is at
// most one unit ahead of the consume side), 16-byte aligned bases,
// dynamic shared memory kWarps * STAGES * kStageVec * 16 bytes (STAGES = 4).
#include <cuda_bf16.h>

#include "common/w4a16.cuh"

namespace {

constexpr int kWarps = 8;          // warps per block (blocks only share an SM's shared memory)
constexpr int kDownMaxChunks = 4;  // N <= 256: the B fragments of a whole h row fit in 32 registers
constexpr int kZeroStripe = 1024;  // float4s of y per zeroing item (16 KB)
// Ring stage per warp, in uint4: 4 x 32 vectors, then 4 x 32 scale words (gate/up uses vectors
// gate w, up w, x cols 0-7, x cols 8-15 and two scale words; down uses NC of each).
constexpr int kStageVec = 4 * 32 + 4 * 32 / 4;   // 160 uint4 = 2560 B
constexpr int kLine = 32;                         // ints per 128-byte line
constexpr int kWsGateUp = 0, kWsDown = kLine, kWsZeroed = 2 * kLine, kWsDone = 3 * kLine, kWsReady = 4 * kLine;
constexpr int kNone = -1, kEmpty = -0x7fffffff;  // unit ids: >= 0 gate/up item, <= -2 down batch -(b + 2)

// mma_chunk with the even and odd k16 steps in two accumulators: two dependency chains of mma.sync
// instead of one (down accumulates a whole 16-row output tile over N in one warp).
__device__ __forceinline__ void mma_chunk2(float acc0[4], float acc1[4], uint4 w, u32 s, const u32 b[8]) {
  const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 afrag[4];
    dequant8(words[i], s, afrag);
    mma_bf16((i & 1) ? acc1 : acc0, afrag, b[2 * i], b[2 * i + 1]);
  }
}

// ---------------------------------------------------------------- cp.async (sm_80+), counters
__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// cp.async into shared-memory addresses (u32) the caller keeps, so no copy converts an address.
// 16 bytes, L2 only (the weights are read once).
__device__ __forceinline__ void cp16_cg(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// 16 bytes through L1 (activations, re-read by the other items of the expert); zeros when !valid.
__device__ __forceinline__ void cp16_ca_zfill(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void cp4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The whole warp waits until *p >= target: lane 0 polls with a growing pause (one request per
// poll, not 32), then every lane reads the counter once with acquire semantics.
__device__ __forceinline__ void wait_at_least(const int* p, int target) {
  if ((threadIdx.x & 31) == 0) {
    unsigned ns = 32;
    while (load_acquire(p) < target) {
      __nanosleep(ns);
      ns = ns < 1024 ? 2 * ns : ns;
    }
  }
  __syncwarp();
  (void)load_acquire(p);
}

// A counter's next value for the whole warp: the one lane 0 took ahead (`early`, when valid),
// else a fresh take.
__device__ __forceinline__ int take(int* counter, int early) {
  int v = early;
  if ((threadIdx.x & 31) == 0 && early < 0) v = atomicAdd(counter, 1);
  return __shfl_sync(0xffffffffu, v, 0);
}

}  // namespace

// The kernel body, STAGES ring stages per warp (STAGES - 1 in flight).
template <int STAGES>
__device__ __forceinline__ void moe_v3_body(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const uint4* __restrict__ w2, const u32* __restrict__ s2, const int* __restrict__ active_experts,
    const int* __restrict__ n_active_dev, const int2* __restrict__ active_ranges,
    const int* __restrict__ sorted_token, const float* __restrict__ sorted_weight, u16* __restrict__ h,
    float* __restrict__ y, int* __restrict__ ws, float* __restrict__ scratch, int n_experts, int M, int K,
    int N, int n_parts, int down_batch, uint4* ring) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint4* wring = ring + warp * STAGES * kStageVec;                 // this warp's [STAGES][kStageVec]

  const int n_active = *n_active_dev;
  const int P = N >> 4, KC = K >> 6, RT = K >> 4, NC = N >> 6;
  const int cpp = KC / n_parts;                                     // chunks per gate/up item
  const int n_gu = n_active * P * n_parts;                          // gate/up items
  const int n_dn = n_active * RT;                                   // down items
  const int n_batches = n_dn / down_batch;
  const int n4 = (M * K) >> 2;                                      // y in float4s (K % 64 == 0)
  const int Z = min(n_gu, (n4 + kZeroStripe - 1) / kZeroStripe);   // y stripes, one per item j < Z
  const int zlen = Z > 0 ? (n4 + Z - 1) / Z : 0;
  if (n_gu == 0) {  // none of the device's experts routed to (an expert-parallel rank): y is all zero
    float4* y4 = reinterpret_cast<float4*>(y);
    for (int i = (blockIdx.x * kWarps + warp) * 32 + lane; i < n4; i += gridDim.x * kWarps * 32)
      y4[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  int* ready = ws + kWsReady;                                       // [E][kLine]
  int* parts_done = ws + kWsReady + kLine * n_experts;              // [E * P]

  // ---------------------------------------------------------------- the issue side of the ring
  // Unit being issued: `iu` (a gate/up item j >= 0, a down batch -(b + 2), or kNone when both
  // counters ran out), stage ic within it; `pend` hands each unit taken to the consume side.
  // Ring addresses run with the stages: ivec / cvec = this lane's first vector of the stage being
  // issued / consumed (its scale words lie kScaleOff - 12 * lane bytes further).
  constexpr u32 kStageBytes = kStageVec * 16, kScaleOff = 4 * 32 * 16;
  const u32 ring0 = smem_u32(wring) + 16 * lane, ring_last = ring0 + (STAGES - 1) * kStageBytes;
  const u32 sdelta = kScaleOff - 12 * lane;
  u32 ivec = ring0;
  const uint4* cvec = wring + lane;
  const uint4* const cvec_last = wring + (STAGES - 1) * kStageVec + lane;
  auto next_ivec = [&]() { ivec = ivec == ring_last ? ring0 : ivec + kStageBytes; };
  auto next_cvec = [&]() { cvec = cvec == cvec_last ? wring + lane : cvec + kStageVec; };

  int pend = kEmpty;
  int iu = kEmpty, ic = 0, i_end = 0;
  int early = -1;        // lane 0: the counter value taken ahead for the next unit (-1: none)
  const uint4* wsrc = w1;
  const u32* ssrc = s1;
  const u16* xsrc = x;
  bool xvalid = false;
  int ia = 0, irt = 0;   // down: expert index and row tile of the item being issued

  auto start_gate_up = [&](int j) {   // addresses of item j's first chunk for this lane
    const int pair = j / n_parts, part = j - pair * n_parts;
    const int a_idx = pair / P, p = pair - a_idx * P;
    const int e = active_experts[a_idx];
    const int2 range = active_ranges[a_idx];
    const int slot = range.x + g;
    const int k0 = part * cpp;
    xvalid = slot < range.y;
    xsrc = x + (xvalid ? (size_t)sorted_token[slot] * K : 0) + (size_t)k0 * 64 + 16 * t;
    const size_t chunk0 = ((size_t)e * P + p) * KC + k0;
    wsrc = w1 + chunk0 * 2 * 32 + lane;
    ssrc = s1 + chunk0 * 2 * 16 + (t >> 1) * 8 + g;
  };
  auto set_down_src = [&]() {
    const size_t chunk0 = ((size_t)active_experts[ia] * RT + irt) * NC;
    wsrc = w2 + chunk0 * 32 + lane;
    ssrc = s2 + chunk0 * 16 + (t >> 1) * 8 + g;
  };
  auto next_unit = [&]() {            // take the next unit: gate/up first, then down batches
    if (iu >= 0 || iu == kEmpty) {
      const int j = take(ws + kWsGateUp, early);
      early = -1;
      if (j < n_gu) {
        iu = j;
        ic = 0;
        i_end = cpp;
        start_gate_up(j);
        pend = iu;
        return;
      }
    }
    const int b = take(ws + kWsDown, early);
    early = -1;
    if (b < n_batches) {
      iu = -(b + 2);
      ic = 0;
      const int i0 = b * down_batch;
      i_end = down_batch;
      ia = i0 / RT;
      irt = i0 - ia * RT;
      set_down_src();
    } else {
      iu = kNone;
    }
    pend = iu;
  };
  auto issue_gate_up = [&]() {        // the next chunk of the gate/up item being issued
    if (ic == i_end - (STAGES - 1) && lane == 0)   // the next unit's id, taken ahead
      early = atomicAdd(ws + kWsGateUp, 1);
    cp16_cg(ivec, wsrc);                // gate
    cp16_cg(ivec + 512, wsrc + 32);     // up
    cp16_ca_zfill(ivec + 1024, xsrc, xvalid);
    cp16_ca_zfill(ivec + 1536, xsrc + 8, xvalid);
    cp4(ivec + sdelta, ssrc);
    cp4(ivec + sdelta + 128, ssrc + 16);
    wsrc += 2 * 32;
    ssrc += 2 * 16;
    xsrc += 64;
    ++ic;
    next_ivec();
  };
  auto issue_next = [&]() {           // one ring stage of the unit being issued, then commit
    if (iu == kEmpty || (iu != kNone && ic == i_end)) next_unit();
    if (iu >= 0) {
      issue_gate_up();
    } else if (iu != kNone) {
      if (ic == i_end - (STAGES - 1) && lane == 0) early = atomicAdd(ws + kWsDown, 1);
#pragma unroll
      for (int c = 0; c < kDownMaxChunks; ++c) {
        if (c < NC) {
          cp16_cg(ivec + 512 * c, wsrc + c * 32);
          cp4(ivec + sdelta + 128 * c, ssrc + c * 16);
        }
      }
      if (++ic < i_end) {
        if (++irt == RT) { irt = 0; ++ia; set_down_src(); }
        else { wsrc += NC * 32; ssrc += NC * 16; }
      }
      next_ivec();
    }
    cp_commit();
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_next();

  // ---------------------------------------------------------------- the consume side
  int cur_a = -1;                // down: the expert whose h is in b[] ...
  bool zeroed = false;           // ... and whether y is known to be zero
  u32 b[kDownMaxChunks][8];      // this lane's B registers of every chunk (token row g of the expert)
  float* yrow[2] = {y, y};       // C fragment token columns 2t, 2t + 1: their y rows ...
  float wgt[2] = {0.0f, 0.0f};   // ... and routing weights (0 and unused when the slot is absent)
  bool has[2] = {false, false};

  for (int cu = pend; cu != kNone; cu = pend) {
    pend = kEmpty;
    if (cu >= 0) {
      // ------------------------------------------------ gate/up item cu
      const int j = cu, pair = j / n_parts;
      const int a_idx = pair / P, p = pair - a_idx * P;
      if (j < Z) {  // one stripe of y, zeroed before any down atomic (down waits on ws[kWsZeroed])
        float4* y4 = reinterpret_cast<float4*>(y);
        const int end = min(n4, (j + 1) * zlen);
        for (int i = j * zlen + lane; i < end; i += 32) y4[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
      float acc[2][4];
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[u][r] = 0.0f;
      const int fast = cpp - (STAGES - 1);   // chunks whose issue stays inside this item
      for (int c = 0; c < cpp; ++c) {
        if (c < fast) {
          issue_gate_up();
          cp_commit();
        } else {
          issue_next();
        }
        cp_wait<STAGES - 1>();   // this thread's copies of the chunk being consumed have landed
        const u32* ss = reinterpret_cast<const u32*>(reinterpret_cast<const char*>(cvec) + sdelta);
        const uint4 wg = cvec[0], wu = cvec[32], xl = cvec[64], xh = cvec[96];
        const u32 sg = ss[0], su = ss[32];
        next_cvec();
        const u32 bx[8] = {xl.x, xl.y, xl.z, xl.w, xh.x, xh.y, xh.z, xh.w};
        mma_chunk(acc[0], wg, sg, bx);
        mma_chunk(acc[1], wu, su, bx);
      }
      bool last = true;
      float* sp = scratch + (size_t)pair * 256 + lane;    // [2][4][32] of this pair, this lane
      if (n_parts > 1) {                                  // add this part; the last part finishes
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int r = 0; r < 4; ++r) atomicAdd(sp + (u * 4 + r) * 32, acc[u][r]);
        __threadfence();
        __syncwarp();
        int old = 0;
        if (lane == 0) old = atomicAdd(parts_done + pair, 1);
        last = __shfl_sync(0xffffffffu, old, 0) == n_parts - 1;
        if (last) {
          __threadfence();
#pragma unroll
          for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              acc[u][r] = __ldcg(sp + (u * 4 + r) * 32);
              __stcg(sp + (u * 4 + r) * 32, 0.0f);
            }
          if (lane == 0) parts_done[pair] = 0;
        }
      }
      if (last) {   // SwiGLU of the C fragment: rows g / g + 8, token columns 2t / 2t + 1
        const int2 range = active_ranges[a_idx];
        const int off = range.x, end = range.y;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int slot = off + 2 * t + (r & 1);
          if (slot < end) {
            const float gs = acc[0][r], us = acc[1][r];
            h[(size_t)slot * N + p * 16 + g + (r >= 2 ? 8 : 0)] = f32_to_bf16_bits(gs / (1.0f + __expf(-gs)) * us);
          }
        }
      }
      if (last || j < Z) {
        __threadfence();   // h and the y stripe before they are published
        __syncwarp();
        if (lane == 0) {
          if (last) atomicAdd(ready + a_idx * kLine, 1);
          if (j < Z) atomicAdd(ws + kWsZeroed, 1);
        }
      }
    } else {
      // ------------------------------------------------ down batch -(cu + 2)
      const int i0 = -(cu + 2) * down_batch, i1 = i0 + down_batch;
      int a_idx = i0 / RT, rt = i0 - a_idx * RT;
      for (int item = i0; item < i1; ++item) {
        if (a_idx != cur_a) {  // a new expert: its slots' rows, and its h once it is ready
          cur_a = a_idx;
          const int2 range = active_ranges[a_idx];
          const int off = range.x, end = range.y;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int slot = off + 2 * t + half;
            has[half] = slot < end;
            yrow[half] = has[half] ? y + (size_t)sorted_token[slot] * K : y;
            wgt[half] = has[half] ? sorted_weight[slot] : 0.0f;
          }
          wait_at_least(ready + a_idx * kLine, P);
          const u16* hrow = off + g < end ? h + (size_t)(off + g) * N + 16 * t : nullptr;
#pragma unroll
          for (int c = 0; c < kDownMaxChunks; ++c) {
            uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
            if (hrow != nullptr && c < NC) {
              const uint4* q = reinterpret_cast<const uint4*>(hrow + c * 64);
              lo = __ldcg(q);    // written in this launch: from L2, never a stale L1 line
              hi = __ldcg(q + 1);
            }
            b[c][0] = lo.x; b[c][1] = lo.y; b[c][2] = lo.z; b[c][3] = lo.w;
            b[c][4] = hi.x; b[c][5] = hi.y; b[c][6] = hi.z; b[c][7] = hi.w;
          }
        }
        issue_next();
        cp_wait<STAGES - 1>();
        const u32* ss = reinterpret_cast<const u32*>(reinterpret_cast<const char*>(cvec) + sdelta);
        const uint4* sw = cvec;
        next_cvec();
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc_odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int c = 0; c < kDownMaxChunks; ++c)
          if (c < NC) mma_chunk2(acc, acc_odd, sw[c * 32], ss[c * 32], b[c]);
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[r] += acc_odd[r];
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
    }
  }
  cp_wait<0>();

  // The last warp out resets the counters for the next launch on this workspace.
  __syncwarp();
  if (lane == 0) {
    __threadfence();
    if (atomicAdd(ws + kWsDone, 1) == (int)(gridDim.x * kWarps) - 1) {
      for (int i = 0; i < n_active; ++i) ready[i * kLine] = 0;
      ws[kWsGateUp] = 0;
      ws[kWsDown] = 0;
      ws[kWsZeroed] = 0;
      ws[kWsDone] = 0;
      __threadfence();
    }
  }
}

// One launch per MoE layer call; grid = the resident blocks (2 per SM on an H200) of kWarps warps,
// 4 ring stages: dynamic shared memory kWarps * 4 * kStageVec * 16 bytes = 80 KB. (5 stages, one
// more chunk in flight per warp, measured no faster on the H200: data/results/gpu_tests.h200.json,
// the call at 8ca6c79.)
extern "C" __global__ void __launch_bounds__(kWarps * 32, 2) moe_w4a16_v3(
    const u16* __restrict__ x, const uint4* __restrict__ w1, const u32* __restrict__ s1,
    const uint4* __restrict__ w2, const u32* __restrict__ s2, const int* __restrict__ active_experts,
    const int* __restrict__ n_active_dev, const int2* __restrict__ active_ranges,
    const int* __restrict__ sorted_token, const float* __restrict__ sorted_weight, u16* __restrict__ h,
    float* __restrict__ y, int* __restrict__ ws, float* __restrict__ scratch, int n_experts, int M, int K, int N,
    int n_parts, int down_batch) {
  extern __shared__ uint4 ring[];
  moe_v3_body<4>(x, w1, s1, w2, s2, active_experts, n_active_dev, active_ranges, sorted_token, sorted_weight, h,
                   y, ws, scratch, n_experts, M, K, N, n_parts, down_batch, ring);
}
