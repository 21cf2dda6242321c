// tree_verify_v4: the paged-prefix part of tree-verify MLA attention on the tensor cores (bf16).
//
// v4 = v3 with a three-stage K pipeline: the gather of tile t+2 is issued while tile t is
// computed (v3: tile t+1), so a gather that misses L2 (the first row block of a split to touch
// the keys) has two tile times to land; page-table slots are fetched three tiles ahead. v3 (and
// v2) describe the rest; the only other difference is the shared-memory size (203 KB).
//
// tree_verify_v4_prefix_bf16: flash-style fused kernel, split along the KV length (flash-decoding).
// Same contract as tree_verify_v1_prefix_bf16 (whose tail and combine kernels complete it):
//   q [B, Q, H, 576] bf16, kv [S, 576] bf16, page_table [B, P] int32, prefix_lens [B] int32 ->
//   out [B, nsplit, M, 512] fp32 (normalised partials), lse [B, nsplit, M] fp32 (natural log),
//   M = Q*H rows per request (row r = q*H + h); an empty split writes out 0, lse -inf.
// Grid (ceil(M/BM), nsplit, B) with the row block fastest, so the blocks of one split run together
// and share its keys through L2. Block: 8 warps. Warp w owns rows 16*(w%4) .. +15 of the block's
// BM = 64 rows and half h = w/4 of the work:
//   S = Q K^T   (16 rows x BN keys): warp h sums dims [288h, 288h+288); the two halves swap their
//               partial S through shared memory, so each holds the full S (identical in both);
//   online softmax in the log2 domain, P kept in registers as the A operand (bf16);
//   O += P V    (16 rows x 256 dims): warp h owns value dims [256h, 256h+256) (128 fp32 accumulators).
// K tiles (BN keys x 576, gathered through the page table with cp.async, 3 stages) double as V.
// mma.sync.m16n8k16 bf16 -> fp32 (sm_80+ PTX; runs on sm_90 and sm_120); ldmatrix from shared rows
// padded by 16 B so that 8 consecutive rows hit distinct banks.

#include <cuda_bf16.h>

#define D_QK 576           // kv_lora_rank 512 + rope 64
#define D_V 512            // value width = kv_lora_rank
#define BM 64              // query rows (q, h pairs) per block
#define BN 32              // keys per pipeline stage
#define NWARPS 8
#define NTHREADS (NWARPS * 32)
#define ROW_BYTES (D_QK * 2 + 16)  // 1168: +16 B pad -> conflict-free ldmatrix (rows shift by 4 banks)
#define CHUNKS_PER_ROW (D_QK * 2 / 16)  // 72 x 16-byte pieces per 576-wide bf16 row
#define STAGES 3
#define Q_SMEM (BM * ROW_BYTES)
#define K_SMEM (BN * ROW_BYTES)
#define X_SMEM (2 * 4 * 16 * 32 * 4)  // partial-S exchange: [half][row group][16 values][32 lanes] fp32
#define SMEM_BYTES (Q_SMEM + STAGES * K_SMEM + X_SMEM)
#define LOADS_PER_THREAD (BN * CHUNKS_PER_ROW / NTHREADS)  // 9 x 16 B per thread per K tile
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF __int_as_float(0xff800000)  // -inf without math.h (NVRTC has no host headers)

#include "common/mma_sm80.cuh"

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v4_prefix_bf16(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const int* __restrict__ prefix_lens, int P, int Q, int H, int nsplit, int chunk, float scale,
    float* __restrict__ out, float* __restrict__ lse) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* qs = smem;
    unsigned char* ks = smem + Q_SMEM;
    float* xs = reinterpret_cast<float*>(smem + Q_SMEM + STAGES * K_SMEM);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rg = warp & 3, half = warp >> 2;
    const int g = lane >> 2, t4 = lane & 3;
    const int b = blockIdx.z, split = blockIdx.y, row0 = blockIdx.x * BM;
    const int M = Q * H;
    const int len = min(max(prefix_lens[b], 0), P);
    const int start = min(split * chunk, len);
    const int end = min(start + chunk, len);
    const long long obase = ((long long)b * nsplit + split) * M;

    if (start >= end) {  // empty split: out 0, lse -inf for this block's rows
        for (int e = tid; e < BM * D_V; e += NTHREADS) {
            const int r = row0 + e / D_V;
            if (r < M) out[(obase + r) * D_V + (e % D_V)] = 0.f;
        }
        if (tid < BM && row0 + tid < M) lse[obase + row0 + tid] = NEG_INF;
        return;
    }

    // Q tile (rows past M zero-filled)
    const char* qg = reinterpret_cast<const char*>(q + (long long)b * M * D_QK);
    for (int e = tid; e < BM * CHUNKS_PER_ROW; e += NTHREADS) {
        const int r = e / CHUNKS_PER_ROW, c = e - r * CHUNKS_PER_ROW;
        const bool ok = row0 + r < M;
        const char* src = ok ? qg + ((long long)(row0 + r) * D_QK) * 2 + c * 16 : qg;
        cp_async16(smem_u32(qs + r * ROW_BYTES + c * 16), src, ok ? 16 : 0);
    }
    const int* pt = page_table + (long long)b * P;
    const char* kvb = reinterpret_cast<const char*>(kv);
    static_assert(BN * CHUNKS_PER_ROW == LOADS_PER_THREAD * NTHREADS, "K tile splits evenly over the threads");
    int slot[LOADS_PER_THREAD];  // page-table slots of the next tile to issue (-1: past the split end)
    auto fetch_slots = [&](int k0) {
#pragma unroll
        for (int i = 0; i < LOADS_PER_THREAD; ++i) {
            const int j = k0 + (tid + i * NTHREADS) / CHUNKS_PER_ROW;
            slot[i] = j < end ? pt[j] : -1;
        }
    };
    auto issue_tile = [&](int stage) {
        unsigned char* dst = ks + stage * K_SMEM;
#pragma unroll
        for (int i = 0; i < LOADS_PER_THREAD; ++i) {
            const int e = tid + i * NTHREADS;
            const int kk = e / CHUNKS_PER_ROW, c = e - kk * CHUNKS_PER_ROW;
            const bool ok = slot[i] >= 0;
            const char* src = ok ? kvb + (long long)slot[i] * (D_QK * 2) + c * 16 : kvb;
            cp_async16(smem_u32(dst + kk * ROW_BYTES + c * 16), src, ok ? 16 : 0);
        }
    };
    const int ntiles = (end - start + BN - 1) / BN;
    fetch_slots(start);
    issue_tile(0);
    asm volatile("cp.async.commit_group;\n" ::);
    if (ntiles > 1) {
        fetch_slots(start + BN);
        issue_tile(1);
    }
    asm volatile("cp.async.commit_group;\n" ::);  // possibly empty: keeps one group per tile
    if (ntiles > 2) fetch_slots(start + 2 * BN);

    float o[D_V / 2 / 8][4];  // 32 n-tiles of 8 value dims: this warp's 16 rows x 256 dims
#pragma unroll
    for (int i = 0; i < D_V / 2 / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF;  // running max (log2 domain) of rows g and g+8
    float l0 = 0.f, l1 = 0.f;              // this thread's share of the running sums
    const float sl2 = scale * LOG2E;

    const unsigned q_addr = smem_u32(qs + (rg * 16 + (lane & 15)) * ROW_BYTES + ((lane >> 4) * 8) * 2);
    // K as the B operand of S (n = key, k = dim): matrices (keys 0-7 | 8-15) x (dims 0-7 | 8-15)
    const int kb_row = (lane & 7) + ((lane >> 4) << 3), kb_col = ((lane >> 3) & 1) * 8;
    // V as the B operand of O (k = key, n = dim), transposed load: (keys 0-7 | 8-15) x (dims 0-7 | 8-15)
    const int vb_row = (lane & 7) + ((lane >> 3) & 1) * 8, vb_col = (lane >> 4) * 8;
    float* x_mine = xs + (half * 4 + rg) * 16 * 32;
    float* x_other = xs + ((1 - half) * 4 + rg) * 16 * 32;

    for (int t = 0; t < ntiles; ++t) {
        const int k0 = start + t * BN;
        if (t + 2 < ntiles) {
            issue_tile((t + 2) % STAGES);                      // into the stage tile t-1 used
            if (t + 3 < ntiles) fetch_slots(k0 + 3 * BN);  // consumed next iteration: latency hidden
        }
        asm volatile("cp.async.commit_group;\n" ::);  // possibly empty: keeps one group per tile
        asm volatile("cp.async.wait_group 2;\n" ::);   // all but the two newest groups: tile t landed
        __syncthreads();
        const unsigned kst = smem_u32(ks + (t % STAGES) * K_SMEM);

        // S partial over this half's 288 dims: 16 rows x 32 keys = 4 n-tiles
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll 6
        for (int kk = 0; kk < 18; ++kk) {
            const int d0 = half * 288 + kk * 16;
            unsigned a[4];
            ldsm_x4(q_addr + d0 * 2, a[0], a[1], a[2], a[3]);
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                unsigned b0, b1, b2, b3;
                ldsm_x4(kst + (np * 16 + kb_row) * ROW_BYTES + (d0 + kb_col) * 2, b0, b1, b2, b3);
                mma16816(s[2 * np], a, b0, b1);
                mma16816(s[2 * np + 1], a, b2, b3);
            }
        }
        // swap partial S with the other half (same fragment layout: index by lane)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) x_mine[(i * 4 + c) * 32 + lane] = s[i][c];
        asm volatile("bar.sync %0, 64;\n" ::"r"(1 + rg));
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[i][c] += x_other[(i * 4 + c) * 32 + lane];

        // online softmax (log2 domain); keys past the split end -> -inf
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int j = k0 + i * 8 + 2 * t4;
            const bool v0 = j < end, v1 = j + 1 < end;
            s[i][0] = v0 ? s[i][0] * sl2 : NEG_INF;
            s[i][1] = v1 ? s[i][1] * sl2 : NEG_INF;
            s[i][2] = v0 ? s[i][2] * sl2 : NEG_INF;
            s[i][3] = v1 ? s[i][3] * sl2 : NEG_INF;
            mx0 = fmaxf(mx0, fmaxf(s[i][0], s[i][1]));
            mx1 = fmaxf(mx1, fmaxf(s[i][2], s[i][3]));
        }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);  // finite: every tile has a valid key
        const float c0 = exp2f(m0 - mn0), c1 = exp2f(m1 - mn1);
        m0 = mn0;
        m1 = mn1;
        l0 *= c0;
        l1 *= c1;
        if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {  // some row max of this warp moved
#pragma unroll
            for (int i = 0; i < D_V / 2 / 8; ++i) {
                o[i][0] *= c0;
                o[i][1] *= c0;
                o[i][2] *= c1;
                o[i][3] *= c1;
            }
        }
        unsigned pa[2][4];  // P as two A fragments (keys 0-15, 16-31)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float p0 = exp2f(s[i][0] - mn0), p1 = exp2f(s[i][1] - mn0);
            const float p2 = exp2f(s[i][2] - mn1), p3 = exp2f(s[i][3] - mn1);
            l0 += p0 + p1;
            l1 += p2 + p3;
            pa[i >> 1][(i & 1) * 2 + 0] = pack_bf16(p0, p1);
            pa[i >> 1][(i & 1) * 2 + 1] = pack_bf16(p2, p3);
        }

        // O += P V over this half's 256 value dims
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
            for (int np = 0; np < 16; ++np) {
                const int n0 = half * 256 + np * 16;
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(kst + (kk * 16 + vb_row) * ROW_BYTES + (n0 + vb_col) * 2, b0, b1, b2, b3);
                mma16816(o[2 * np], pa[kk], b0, b1);
                mma16816(o[2 * np + 1], pa[kk], b2, b3);
            }
        }
        __syncthreads();  // this stage and the exchange buffer are free again
    }

#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    const int r0 = row0 + rg * 16 + g, r1 = r0 + 8;
    const float i0 = 1.f / l0, i1 = 1.f / l1;  // l >= 1: the row max contributes exp2(0)
    if (r0 < M) {
        float* dst = out + (obase + r0) * D_V + half * 256 + 2 * t4;
#pragma unroll
        for (int i = 0; i < D_V / 2 / 8; ++i)
            *reinterpret_cast<float2*>(dst + i * 8) = make_float2(o[i][0] * i0, o[i][1] * i0);
        if (half == 0 && t4 == 0) lse[obase + r0] = (m0 + log2f(l0)) * LN2;
    }
    if (r1 < M) {
        float* dst = out + (obase + r1) * D_V + half * 256 + 2 * t4;
#pragma unroll
        for (int i = 0; i < D_V / 2 / 8; ++i)
            *reinterpret_cast<float2*>(dst + i * 8) = make_float2(o[i][2] * i1, o[i][3] * i1);
        if (half == 0 && t4 == 0) lse[obase + r1] = (m1 + log2f(l1)) * LN2;
    }
}
