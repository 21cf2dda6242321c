// tree_verify_v1: tree-verify MLA attention (absorb form), the simple CUDA-core path.
//
// Every query row is 576 wide (512 latent + 64 rope); all heads share one 576-wide key per token,
// whose first 512 dims are also the value. Three kernels:
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

// q [B, Q, H, 576], kv [S, 576], page_table [B, P] int32, prefix_lens [B] int32 ->
// out [B, nsplit, Q*H, 512] fp32, lse [B, nsplit, Q*H] fp32. Grid (ceil(Q*H/ROWS), nsplit, B), block ROWS*32.
extern "C" __global__ void __launch_bounds__(ROWS * 32) tree_verify_v1_prefix_f32(
    const float* q, const float* kv, const int* page_table, const int* prefix_lens, int P, int Q, int H, int nsplit,
    int chunk, float scale, float* out, float* lse) {
    attend_rows<float, false>(q, kv, page_table, prefix_lens, nullptr, P, Q, H, nsplit, chunk, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(ROWS * 32) tree_verify_v1_prefix_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* kv, const int* page_table, const int* prefix_lens, int P, int Q, int H,
    int nsplit, int chunk, float scale, float* out, float* lse) {
    attend_rows<__nv_bfloat16, false>(q, kv, page_table, prefix_lens, nullptr, P, Q, H, nsplit, chunk, scale, out, lse);
}

// q [B, Q, H, 576], tree_kv [B, Q, 576], vis [B, Q, Q] uint8, tree_sizes [B] int32 ->
// out [B, Q, H, 512] fp32, lse [B, Q, H] fp32. Grid (ceil(Q*H/ROWS), 1, B), block ROWS*32.
extern "C" __global__ void __launch_bounds__(ROWS * 32) tree_verify_v1_tail_f32(
    const float* q, const float* tree_kv, const unsigned char* vis, const int* tree_sizes, int Q, int H, float scale,
    float* out, float* lse) {
    attend_rows<float, true>(q, tree_kv, nullptr, tree_sizes, vis, 0, Q, H, 1, 0, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(ROWS * 32) tree_verify_v1_tail_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* tree_kv, const unsigned char* vis, const int* tree_sizes, int Q, int H,
    float scale, float* out, float* lse) {
    attend_rows<__nv_bfloat16, true>(q, tree_kv, nullptr, tree_sizes, vis, 0, Q, H, 1, 0, scale, out, lse);
}

// LSE merge. parts [B, nparts, M, 512] and part_lse [B, nparts, M] (normalised partials), plus an
// optional extra part [B*M, 512] / [B*M] (extra == nullptr: none). out [B*M, 512], lse [B*M].
// Grid (B*M), block 128 (4 dims per thread, float4).
extern "C" __global__ void __launch_bounds__(128) tree_verify_v1_combine(
    const float* __restrict__ parts, const float* __restrict__ part_lse, int nparts, int M,
    const float* __restrict__ extra, const float* __restrict__ extra_lse, float* __restrict__ out,
    float* __restrict__ lse) {
    const long long n = blockIdx.x;
    const long long b = n / M, r = n - b * M;
    const int t = threadIdx.x;
    const float* pl = part_lse + b * nparts * M + r;
    float mx = NEG_INF;
    bool nan = false;
    for (int s = 0; s < nparts; ++s) {
        const float v = pl[(long long)s * M];
        nan |= (v != v);
        mx = fmaxf(mx, v);
    }
    if (extra) {
        const float v = extra_lse[n];
        nan |= (v != v);
        mx = fmaxf(mx, v);
    }
    float4* o = reinterpret_cast<float4*>(out + n * D_V) + t;
    if (nan) {
        const float qn = __int_as_float(0x7fc00000);
        *o = make_float4(qn, qn, qn, qn);
        if (t == 0) lse[n] = qn;
        return;
    }
    const float base = mx == NEG_INF ? 0.f : mx;
    float z = 0.f;
    for (int s = 0; s < nparts; ++s) z += expf(pl[(long long)s * M] - base);
    if (extra) z += expf(extra_lse[n] - base);
    const float inv = z > 0.f ? 1.f / z : 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < nparts; ++s) {
        const float w = expf(pl[(long long)s * M] - base) * inv;
        const float4 v = reinterpret_cast<const float4*>(parts + ((b * nparts + s) * M + r) * D_V)[t];
        acc.x = fmaf(w, v.x, acc.x);
        acc.y = fmaf(w, v.y, acc.y);
        acc.z = fmaf(w, v.z, acc.z);
        acc.w = fmaf(w, v.w, acc.w);
    }
    if (extra) {
        const float w = expf(extra_lse[n] - base) * inv;
        const float4 v = reinterpret_cast<const float4*>(extra + n * D_V)[t];
        acc.x = fmaf(w, v.x, acc.x);
        acc.y = fmaf(w, v.y, acc.y);
        acc.z = fmaf(w, v.z, acc.z);
        acc.w = fmaf(w, v.w, acc.w);
    }
    *o = acc;
    if (t == 0) lse[n] = z > 0.f ? base + logf(z) : NEG_INF;
}
