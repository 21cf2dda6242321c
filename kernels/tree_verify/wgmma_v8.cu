// tree_verify_v8: v7's whole verify (tree_verify_v5_plan, tree_verify_v7_attend: tree_verify/wgmma_v7.cu)
// with a combine that keeps enough loads in flight when a row has many jobs. Three launches, no host sync,
// fixed buffers (CUDA-graph capturable): tree_verify_v5_plan, tree_verify_v7_attend,
// tree_verify_v8_combine_w<W> (tree_verify_v8_combine_rows, a warp per row with combine_w<4>'s bits, where the
// rows are too many for even 4-warp blocks to be resident at once: kdlib.cuda.attention.v8_combine_rows).
//
// Why (data/results/history/attention_bounds.v7.95e9f6a.h200.json): v5's combine is a block of 4 warps per
// (row, 128 columns); at 8 heads x 1 query x 200k keys a row has about one job per SM, so each warp walks a
// quarter of them four loads at a time behind two block-wide reductions, a tenth of the verify there for a
// few MB of partials.
// Here a block has W warps (W = 4, 8, 16 or 32, chosen by the host from the jobs a one-round plan gives a
// row, with every block resident at once: kdlib.cuda.attention.v8_combine_warps), so a row's jobs are spread
// over W warps and the loads of most of them are in flight at once.
//
// Block (n, s) merges row n's columns [128 s, 128 s + 128) over its nch jobs (job first + i rbn, i < nch):
// the max of their lse (thread t takes jobs t, t + 32 W, ...; a fixed-order block reduction), then
// z = sum_i exp(lse_i - max) the same way; warp w sums wt_i parts_i (wt_i = exp(lse_i - max) / z) over jobs
// w, w + W, ... (lane l: the float4 of columns 128 s + 4 l, V8_UNROLL loads in flight) and warp 0 adds the
// W warps' sums in warp order: bit-for-bit reproducible. Output conventions as v5's combine: rows at or
// past a request's rows are NaN, a row without jobs is out 0, lse -inf.
//
// kdlib-arch: sm_90a wgmma=tree_verify_v7_attend (tests/test_kernels_compile.py builds it so, checks the SASS)

#include "tree_verify/wgmma_v7.cu"

constexpr int V8_UNROLL = 4;  // loads of parts in flight per warp (a constant: #pragma unroll takes no macro)

// Block-wide reduction of W warps in a fixed order (max when is_max, else sum); every thread gets it.
template <int W>
__device__ __forceinline__ float block_reduce_w(float v, bool is_max, float* red) {
    v = warp_reduce(v, is_max);
    const int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) red[w] = v;
    __syncthreads();
    v = red[0];
#pragma unroll
    for (int k = 1; k < W; ++k) v = is_max ? fmaxf(v, red[k]) : v + red[k];
    __syncthreads();  // red is reused by the next reduction
    return v;
}

template <int W>
__device__ __forceinline__ void combine_w(const float* __restrict__ parts, const float* __restrict__ part_lse,
                                          const int* __restrict__ plan, int M, float* __restrict__ out,
                                          float* __restrict__ lse) {
    __shared__ float red[W];
    __shared__ float4 wsum[W][32];
    pdl_wait();  // the attend kernel's parts (a launch with programmatic serialization)
    const long long n = blockIdx.x;
    const int b = (int)(n / M), r = (int)(n - (long long)b * M);
    const int t = threadIdx.x, w = t >> 5, l = t & 31;
    const int col = blockIdx.y * COMBINE_COLS + 4 * l;
    const int* e = plan + PLAN_HDR + b * PLAN_STRIDE;
    float4* o = reinterpret_cast<float4*>(out + n * D_V + col);
    if (r >= e[P_ROWS]) {
        if (w == 0) *o = make_float4(QNAN, QNAN, QNAN, QNAN);
        if (t == 0 && blockIdx.y == 0) lse[n] = QNAN;
        return;
    }
    const int nch = e[P_NCHUNK], rbn = e[P_RB];
    const long long first = (long long)e[P_BASE] + r / BM, lr = r % BM;  // job of chunk i: first + i * rbn
    float mx = NEG_INF;
    for (int i = t; i < nch; i += 32 * W) mx = fmaxf(mx, part_lse[(first + (long long)i * rbn) * BM + lr]);
    mx = block_reduce_w<W>(mx, true, red);
    const float base = mx == NEG_INF ? 0.f : mx;
    float z = 0.f;
    for (int i = t; i < nch; i += 32 * W) z += expf(part_lse[(first + (long long)i * rbn) * BM + lr] - base);
    z = block_reduce_w<W>(z, false, red);
    const float inv = z > 0.f ? 1.f / z : 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll V8_UNROLL
    for (int i = w; i < nch; i += W) {
        const long long jrow = (first + (long long)i * rbn) * BM + lr;
        const float wt = expf(part_lse[jrow] - base) * inv;
        const float4 v = *reinterpret_cast<const float4*>(parts + jrow * D_V + col);
        acc.x = fmaf(wt, v.x, acc.x);
        acc.y = fmaf(wt, v.y, acc.y);
        acc.z = fmaf(wt, v.z, acc.z);
        acc.w = fmaf(wt, v.w, acc.w);
    }
    wsum[w][l] = acc;
    __syncthreads();
    if (w == 0) {
        acc = wsum[0][l];
#pragma unroll
        for (int k = 1; k < W; ++k) {
            const float4 v = wsum[k][l];
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        *o = acc;
        if (t == 0 && blockIdx.y == 0) lse[n] = z > 0.f ? base + logf(z) : NEG_INF;
    }
}

constexpr int ROWS_WARPS = 4;  // rows (warps) of a block of combine_rows

// combine_w<4>'s merge with a warp per row: lane l takes the float4 of columns 128 s + 4 l for s = 0..3 (a
// row's four blocks there), and does the arithmetic of all four of that block's warps in their order: the
// max; z as thread l + 32 k (k = 0..3) sums jobs l + 32 k, l + 32 k + 128, ..., each k's butterfly, then k in
// order; warp w's fma chain over jobs w, w + 4, ..., then w in order. The same bits as combine_w<4>, with no
// shared memory and no block barrier. Why: where a row has a few jobs and there are many rows (64 heads x 65
// queries: 4,160 rows, two jobs each), combine_w<4>'s four blocks a row (16,640 blocks of 128 threads, eight
// times what the SMs hold at once) each wait on two loads behind four barriers; here 4,160 warps run at once,
// each with its row's loads in flight. There the combine took 8.2 us against 19.0 (data/results/
// attention_bounds.h200.json, history/attention_bounds.fold.81fcb3e.h200.json) and the whole verify ran 1.024x
// faster, 1.050-1.066x at the rank's 65-row batches of 4-16 over 5,500 tokens (data/results/kernel_ab_rows.h200.json).
__device__ __forceinline__ void combine_rows(const float* __restrict__ parts, const float* __restrict__ part_lse,
                                             const int* __restrict__ plan, int M, int N, float* __restrict__ out,
                                             float* __restrict__ lse) {
    pdl_wait();  // the attend kernel's parts (a launch with programmatic serialization)
    const long long n = (long long)blockIdx.x * ROWS_WARPS + (threadIdx.x >> 5);
    if (n >= N) return;
    const int b = (int)(n / M), r = (int)(n - (long long)b * M), l = threadIdx.x & 31;
    const int* e = plan + PLAN_HDR + b * PLAN_STRIDE;
    float4* o = reinterpret_cast<float4*>(out + n * D_V + 4 * l);
    if (r >= e[P_ROWS]) {
#pragma unroll
        for (int s = 0; s < COMBINE_SLICES; ++s) o[s * COMBINE_COLS / 4] = make_float4(QNAN, QNAN, QNAN, QNAN);
        if (l == 0) lse[n] = QNAN;
        return;
    }
    const int nch = e[P_NCHUNK], rbn = e[P_RB];
    const long long first = (long long)e[P_BASE] + r / BM, lr = r % BM;  // job of chunk i: first + i * rbn
    auto job_lse = [&](int i) { return part_lse[(first + (long long)i * rbn) * BM + lr]; };
    float mx = NEG_INF;
    for (int i = l; i < nch; i += 32) mx = fmaxf(mx, job_lse(i));
    mx = warp_reduce(mx, true);
    const float base = mx == NEG_INF ? 0.f : mx;
    float z = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float zk = 0.f;
        for (int i = l + 32 * k; i < nch; i += 128) zk += expf(job_lse(i) - base);
        const float red = warp_reduce(zk, false);  // block_reduce_w's first step for k's warp
        z = k == 0 ? red : z + red;
    }
    const float inv = z > 0.f ? 1.f / z : 0.f;
    float4 acc[4][COMBINE_SLICES];  // [warp w of combine_w<4>][slice]
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int s = 0; s < COMBINE_SLICES; ++s) acc[w][s] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int i0 = 0; i0 < nch; i0 += 4) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const int i = i0 + w;
            if (i < nch) {
                const long long jrow = (first + (long long)i * rbn) * BM + lr;
                const float wt = expf(part_lse[jrow] - base) * inv;
                const float4* v = reinterpret_cast<const float4*>(parts + jrow * D_V + 4 * l);
#pragma unroll
                for (int s = 0; s < COMBINE_SLICES; ++s) {
                    const float4 x = v[s * COMBINE_COLS / 4];
                    acc[w][s].x = fmaf(wt, x.x, acc[w][s].x);
                    acc[w][s].y = fmaf(wt, x.y, acc[w][s].y);
                    acc[w][s].z = fmaf(wt, x.z, acc[w][s].z);
                    acc[w][s].w = fmaf(wt, x.w, acc[w][s].w);
                }
            }
        }
    }
#pragma unroll
    for (int s = 0; s < COMBINE_SLICES; ++s) {
        float4 a = acc[0][s];
#pragma unroll
        for (int w = 1; w < 4; ++w) {
            a.x += acc[w][s].x;
            a.y += acc[w][s].y;
            a.z += acc[w][s].z;
            a.w += acc[w][s].w;
        }
        o[s * COMBINE_COLS / 4] = a;
    }
    if (l == 0) lse[n] = z > 0.f ? base + logf(z) : NEG_INF;
}

// parts [jobs, 64, 512] fp32 and part_lse [jobs, 64] fp32 as the attend kernel wrote them, plan, M = Q*H ->
// out [B*M, 512] fp32, lse [B*M] fp32. Grid (B*M, COMBINE_SLICES), block 32 W: tree_verify_v8_combine_w<W>.
extern "C" __global__ void __launch_bounds__(128) tree_verify_v8_combine_w4(
    const float* __restrict__ parts, const float* __restrict__ part_lse, const int* __restrict__ plan, int M,
    float* __restrict__ out, float* __restrict__ lse) {
    combine_w<4>(parts, part_lse, plan, M, out, lse);
}

// As tree_verify_v8_combine_w4 (the same bits), a warp per row: N = B*M rows. Grid ceil(N / 4), block 128:
// tree_verify_v8_combine_rows.
extern "C" __global__ void __launch_bounds__(32 * ROWS_WARPS) tree_verify_v8_combine_rows(
    const float* __restrict__ parts, const float* __restrict__ part_lse, const int* __restrict__ plan, int M, int N,
    float* __restrict__ out, float* __restrict__ lse) {
    combine_rows(parts, part_lse, plan, M, N, out, lse);
}

extern "C" __global__ void __launch_bounds__(256) tree_verify_v8_combine_w8(
    const float* __restrict__ parts, const float* __restrict__ part_lse, const int* __restrict__ plan, int M,
    float* __restrict__ out, float* __restrict__ lse) {
    combine_w<8>(parts, part_lse, plan, M, out, lse);
}

extern "C" __global__ void __launch_bounds__(512) tree_verify_v8_combine_w16(
    const float* __restrict__ parts, const float* __restrict__ part_lse, const int* __restrict__ plan, int M,
    float* __restrict__ out, float* __restrict__ lse) {
    combine_w<16>(parts, part_lse, plan, M, out, lse);
}

extern "C" __global__ void __launch_bounds__(1024) tree_verify_v8_combine_w32(
    const float* __restrict__ parts, const float* __restrict__ part_lse, const int* __restrict__ plan, int M,
    float* __restrict__ out, float* __restrict__ lse) {
    combine_w<32>(parts, part_lse, plan, M, out, lse);
}
