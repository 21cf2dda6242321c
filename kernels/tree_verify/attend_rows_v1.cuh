// tree_verify v1 (prefix_v1.cu, tail_v1.cu, combine_v1.cu): tree-verify MLA attention (absorb form),
// the simple CUDA-core path. attend_rows_v1.cuh holds the row loop prefix_v1 and tail_v1 share.
//
// Every query row is 576 wide (512 latent + 64 rope); all heads share one 576-wide key per token,
// whose first 512 dims are also the value. Three stages:
//   tree_verify_v1_prefix_{f32,bf16}: the paged prefix (page_size 1), split along the KV length
//       (flash-decoding): grid (row blocks, splits, B); each block writes a normalised partial
//       out [B, nsplit, M, 512] and its natural-log lse [B, nsplit, M] (M = Q*H rows per request,
//       row r = q*H + h); an empty split writes out 0, lse -inf.
//   tree_verify_v1_tail_{f32,bf16}: the tree's own rows under the visibility mask, one split;
//       rows q >= tree_sizes[b] are poisoned with NaN (the reference's padding convention).
//   tree_verify_v1_combine: LSE merge of nparts partials per row (+ one optional extra part, the
//       tail); NaN in any lse poisons the row.
// One warp per row, a block of ROWS rows shares a chunk of KCHUNK keys staged in shared memory
// as float. fp32 accumulation, expf/logf (no fast math) so that fp32 inputs match a float64
// reference to ~1e-6.

#pragma once

#include <cuda_bf16.h>

#define D_QK 576            // MLA absorb query/key width: kv_lora_rank 512 + rope 64
#define D_V 512             // value width = kv_lora_rank
#define ROWS 8              // warps (rows) per block
#define KCHUNK 16           // keys staged per step: 16 * 576 * 4 B = 36 KB of shared memory
#define QK_PER_LANE (D_QK / 32)
#define V_PER_LANE (D_V / 32)
#define NEG_INF __int_as_float(0xff800000)  // -inf without math.h (NVRTC has no host headers)

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

// Attention of ROWS rows of request b over keys [start, end), either the paged prefix
// (TAIL = false: key j is kv[page_table[b, j]]) or the tree tail (TAIL = true: key j is
// tree_kv[b, j], visible to query q iff vis[b, q, j]).
template <typename T, bool TAIL>
__device__ void attend_rows(const T* __restrict__ q, const T* __restrict__ keys, const int* __restrict__ page_table,
                            const int* __restrict__ lens, const unsigned char* __restrict__ vis, int P, int Q, int H,
                            int nsplit, int chunk, float scale, float* __restrict__ out, float* __restrict__ lse) {
    __shared__ float ks[KCHUNK][D_QK];
    __shared__ float sc[ROWS][KCHUNK];  // each warp's scores of the current chunk
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = blockIdx.z, split = blockIdx.y;
    const int M = Q * H;
    const int r = blockIdx.x * ROWS + warp;
    const int qi = r / H;
    int start, end;
    if (TAIL) {
        start = 0;
        end = min(max(lens[b], 0), Q);
    } else {
        const int len = min(max(lens[b], 0), P);
        start = min(split * chunk, len);
        end = min(start + chunk, len);
    }
    const bool row_ok = r < M;
    const bool poisoned = TAIL && qi >= end;  // a padding query row of the tree
    const long long orow = ((long long)b * nsplit + split) * M + r;

    float qv[QK_PER_LANE];
    if (row_ok) {
        const T* qr = q + ((long long)b * M + r) * D_QK;
#pragma unroll
        for (int i = 0; i < QK_PER_LANE; ++i) qv[i] = to_f(qr[lane + 32 * i]);
    }
    float acc[V_PER_LANE];
#pragma unroll
    for (int i = 0; i < V_PER_LANE; ++i) acc[i] = 0.f;
    float m = NEG_INF, l = 0.f;

    for (int c0 = start; c0 < end; c0 += KCHUNK) {
        __syncthreads();  // the previous chunk is consumed
        for (int e = threadIdx.x; e < KCHUNK * D_QK; e += ROWS * 32) {
            const int kk = e / D_QK, d = e - kk * D_QK, j = c0 + kk;
            float v = 0.f;
            if (j < end) {
                const long long row = TAIL ? (long long)b * Q + j : (long long)page_table[(long long)b * P + j];
                v = to_f(keys[row * D_QK + d]);
            }
            ks[kk][d] = v;
        }
        __syncthreads();
        if (!row_ok || poisoned) continue;
        float* sw = sc[warp];
#pragma unroll 1
        for (int kk = 0; kk < KCHUNK; ++kk) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < QK_PER_LANE; ++i) dot = fmaf(qv[i], ks[kk][lane + 32 * i], dot);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            const int j = c0 + kk;
            bool ok = j < end;
            if (TAIL && ok) ok = vis[((long long)b * Q + qi) * Q + j] != 0;
            if (lane == 0) sw[kk] = ok ? dot * scale : NEG_INF;
        }
        __syncwarp();
        float cmax = NEG_INF;
#pragma unroll
        for (int kk = 0; kk < KCHUNK; ++kk) cmax = fmaxf(cmax, sw[kk]);
        const float m_new = fmaxf(m, cmax);
        if (m_new == NEG_INF) continue;  // nothing visible yet
        const float corr = expf(m - m_new);
        l *= corr;
#pragma unroll
        for (int i = 0; i < V_PER_LANE; ++i) acc[i] *= corr;
#pragma unroll 4
        for (int kk = 0; kk < KCHUNK; ++kk) {
            const float p = expf(sw[kk] - m_new);
            l += p;
#pragma unroll
            for (int i = 0; i < V_PER_LANE; ++i) acc[i] = fmaf(p, ks[kk][lane + 32 * i], acc[i]);
        }
        m = m_new;
    }
    if (!row_ok) return;
    float* orow_p = out + orow * D_V;
    if (poisoned) {
#pragma unroll
        for (int i = 0; i < V_PER_LANE; ++i) orow_p[lane + 32 * i] = __int_as_float(0x7fc00000);
        if (lane == 0) lse[orow] = __int_as_float(0x7fc00000);
        return;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int i = 0; i < V_PER_LANE; ++i) orow_p[lane + 32 * i] = acc[i] * inv;
    if (lane == 0) lse[orow] = l > 0.f ? m + logf(l) : NEG_INF;
}
