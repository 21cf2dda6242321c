// tree_verify_v5: the whole tree-verify MLA attention (paged prefix + tree tail) on Hopper's
// warpgroup tensor cores (wgmma, sm_90a), bf16 in, fp32 out. Three launches, no host sync, fixed
// buffers (CUDA-graph capturable):
//
//   tree_verify_v5_plan     one block: cuts the work into jobs of equal size (below) and writes the
//                           plan [1 + PLAN_STRIDE * B] int32 that the other two kernels read;
//   tree_verify_v5_attend   persistent, one CTA per SM (grid G = SM count): runs jobs blockIdx.x,
//                           blockIdx.x + G, ... and writes per job a normalised partial
//                           out [64, 512] fp32 and natural-log lse [64] at the job's index;
//   tree_verify_v5_combine  COMBINE_SLICES blocks per query row, 128 columns each: LSE merge of the
//                           row's jobs -> out [B*M, 512], lse [B*M].
//
// Work. Request b has rows_b query rows (row = q * H + h; Q * H rows for the prefix alone,
// tree_sizes[b] * H in the verify, whose later rows are padding and come out NaN), in row blocks
// of BM = 64; a prefix of T_b = ceil(len_b / 64) key tiles; and in the verify U_b = ceil(tree_sizes[b]
// / 64) <= 2 tail tiles (the tree's own rows, visible under the visibility mask). A job is
// (request, key chunk, row block): 64 rows over one chunk of key tiles, in one online softmax: chunk 0 the
// tail tiles first, then its share of the prefix (CHUNK_WITH_TAIL: a chunk's length counts the tail tiles;
// built with 0, the prefix alone is cut and chunk 0 reads the tail on top). Jobs are numbered request-major,
// then chunk, then row block, so the CTAs that run the same request and chunk for its other row blocks run
// in the same round and read the keys once from DRAM, the rest from L2. The plan picks the chunk length among the
// shortest that fit the jobs into k = 1..MAX_ROUNDS rounds of G, by a cost of rounds x (job tiles +
// JOB_OVERHEAD) + jobs / 32 (the combine's reads).
//
// CTA of the attend kernel (256 threads, 218 KB of shared memory): the Q block [64 x 576] and two
// K stages [64 keys x 576], each stored as nine 64-dim column blocks [rows][128 B] in the 128-byte
// swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), the layout wgmma reads.
//   warpgroup 0: loads Q; S = Q K^T (36 x wgmma m64n64k16, both operands from shared memory); the
//     online softmax (log2 domain) with the mask (keys past the job's end; the visibility mask on
//     tail tiles); writes P (bf16) over the stage's rope column block (dims 512..575, dead once S
//     is done) and the rows' rescale factors; O[:, 0:256] += P V (4 x wgmma m64n256k16, P from
//     registers); then S of the next tile is issued before waiting on this P V.
//   warpgroup 1: gathers the K tiles through the page table (cp.async, 16 B pieces, completion on
//     an mbarrier; keys past the end zero-filled), prefetches rows two tiles ahead into L2, and
//     accumulates O[:, 256:512] += P V (P read from shared memory).
// Handoffs (mbarriers, one per stage): full (tile landed), pready (P and factors written), vfree
// (warpgroup 0 done with the stage). P is rounded to bf16 before P V; the sums l use fp32 P.
// Every reduction has a fixed order: results are bit-for-bit reproducible.
//
// The attend kernel needs sm_90a (wgmma); built for another target its body traps.
// kdlib-arch: sm_90a wgmma=tree_verify_v5_attend (tests/test_kernels_compile.py builds it so, checks the SASS)

#include "tree_verify/wgmma_common.cuh"

#define MSG_BYTES (2 * BM * 4)          // per stage: rescale factor and 1/l of each row
#define BAR_OFF (3 * TILE_BYTES + 2 * MSG_BYTES)
#define SMEM_BYTES (BAR_OFF + 6 * 8 + 1024)  // + slack to align the base to 1024 B: 223280
#define NTHREADS 256

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Stage s of the K ring, and its barriers.
#define KST(base, s) ((base) + TILE_BYTES * (1 + (s)))
#define BAR_FULL(bars, s) ((bars) + 8 * (s))
#define BAR_PREADY(bars, s) ((bars) + 16 + 8 * (s))
#define BAR_VFREE(bars, s) ((bars) + 32 + 8 * (s))

// S = Q K^T of the stage at kst: 36 k-steps over the nine column blocks.
__device__ __forceinline__ void issue_s(float (&s)[32], unsigned qs, unsigned kst) {
    const unsigned long long dq = sw128_desc(opaque(qs), 16), dk = sw128_desc(opaque(kst), 16);
#pragma unroll
    for (int k = 0; k < 36; ++k) {
        const unsigned off = (k >> 2) * CB_BYTES + (k & 3) * 32;
        wgmma_s(s, dq + (off >> 4), dk + (off >> 4), k > 0);
    }
}

// Gather sources of stream tile (j, it) for rows lrow + 16p: tree rows (tail) or page-table slots.
__device__ __forceinline__ void gather_sources(const int* plan, int nreq, const int* page_table, const char* kvb,
                                               const char* tkb, int P, int Q, int j, int it, int lrow,
                                               const char* (&src)[4], int& nvalid) {
    const Job jb = decode_job(plan, nreq, j);
    bool tail;
    int k0, kend;
    tile_keys(jb, it, tail, k0, kend);
    nvalid = kend - k0;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int key = k0 + lrow + 16 * p;
        const bool ok = lrow + 16 * p < nvalid;
        src[p] = tail ? tkb + ((long long)jb.b * Q + (ok ? key : 0)) * (D_QK * 2)
                      : kvb + (long long)(ok ? page_table[(long long)jb.b * P + key] : 0) * (D_QK * 2);
    }
}

// One tile into the stage at dst (128 threads, 36 x 16 B each; rows past nvalid zero), then the
// thread's arrive on the stage's full barrier once its copies land.
__device__ __forceinline__ void gather(unsigned dst, unsigned full, const char* const (&src)[4], int nvalid, int lrow,
                                       int ch) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int row = lrow + 16 * p;
        const int bytes = row < nvalid ? 16 : 0;
        const unsigned d = dst + row * 128 + ((ch ^ (row & 7)) << 4);
#pragma unroll
        for (int cb = 0; cb < NCB; ++cb) cp_async16(d + cb * CB_BYTES, src[p] + cb * 128 + ch * 16, bytes);
    }
    bar_arrive_copies(full);
}

// The prefix rows of stream tile (j, it) into L2, one row per thread wt < 64.
__device__ __forceinline__ void prefetch_rows(const int* plan, int nreq, int njobs, const int* page_table,
                                              const char* kvb, int P, int j, int it, int wt) {
    if (j >= njobs || wt >= BN) return;
    const Job jb = decode_job(plan, nreq, j);
    bool tail;
    int k0, kend;
    tile_keys(jb, it, tail, k0, kend);
    const int key = k0 + wt;
    if (tail || key >= kend) return;
    prefetch_l2(kvb + (long long)page_table[(long long)jb.b * P + key] * (D_QK * 2), D_QK * 2);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ------------------------------------------------------------------------------------------ attend

// q [B, M, 576] bf16 (M = Q*H, row = q*H + h), kv [S, 576] bf16, page_table [B, P] int32,
// tree_kv [B, Q, 576] bf16 and vis [B, Q, Q] uint8 (both null for the prefix alone), plan ->
// parts [jobs, 64, 512] fp32, part_lse [jobs, 64] fp32 (rows past a job's valid rows unwritten).
// Grid G (one per SM), block 256, dynamic shared memory SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v5_attend(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    int nreq, int P, int Q, int H, float scale, float* __restrict__ parts, float* __restrict__ part_lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    const int njobs = plan[0];
    if ((int)blockIdx.x >= njobs) return;
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* gbase = smem_raw + (base - smem_u32(smem_raw));
    float* msg = reinterpret_cast<float*>(gbase + 3 * TILE_BYTES);  // [stage][factor | 1/l][64]
    const unsigned bars = base + BAR_OFF;
    const int tid = threadIdx.x;
    const int M = Q * H;
    if (tid == 0) {
        for (int s = 0; s < 2; ++s) {
            bar_init(BAR_FULL(bars, s), 128);
            bar_init(BAR_PREADY(bars, s), 128);
            bar_init(BAR_VFREE(bars, s), 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int wt = tid & 127, warp = wt >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int lr0 = warp * 16 + g, lr1 = lr0 + 8;  // this thread's accumulator rows in the block

    if (tid < 128) {
        // ------------------------------------------------ warpgroup 0: S, softmax, O[:, 0:256]
        const float sl2 = scale * LOG2E;
        float o[128];
        float s[32];
        unsigned pa[4][4];
        int t = 0;  // stream position: stage t & 1, phase (t >> 1) & 1
        for (int j = blockIdx.x; j < njobs; j += gridDim.x) {
            const Job jb = decode_job(plan, nreq, j);
            {  // Q block, rows past the valid ones zero
                copy_q(base, q, jb, M, wt);
                asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
                asm volatile("bar.sync 1, 128;\n" ::: "memory");
                fence_async_smem();
            }
#pragma unroll
            for (int i = 0; i < 128; ++i) o[i] = 0.f;
            float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

            bar_wait(BAR_FULL(bars, t & 1), (t >> 1) & 1);
            fence_async_smem();
            reg_fence(s);
            wg_fence();
            issue_s(s, base, KST(base, t & 1));
            wg_commit();
            wg_wait<0>();
            reg_fence(s);

            for (int it = 0; it < jb.ntiles; ++it, ++t) {
                const int st = t & 1;
                bool tail;
                int k0, kend;
                tile_keys(jb, it, tail, k0, kend);
                float mx0, mx1;  // mask, the row maxima over the quad in the log2 domain (s stays unscaled)
                mask_tile(s, mx0, mx1, tail, k0, kend, vis, jb, Q, H, lr0, lr1, t4, sl2);
                const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
                const float ms0 = mn0 == NEG_INF ? 0.f : mn0, ms1 = mn1 == NEG_INF ? 0.f : mn1;  // no key yet
                const float c0 = ex2(m0 - ms0), c1 = ex2(m1 - ms1);
                m0 = mn0;
                m1 = mn1;
                l0 *= c0;
                l1 *= c1;
                rescale(o, c0, c1);
                // P: bf16 A fragments, and over the stage's rope column block for warpgroup 1
                const unsigned rope = KST(base, st) + ROPE_CB * CB_BYTES;
#pragma unroll
                for (int jj = 0; jj < 8; ++jj) {
                    const float p0 = ex2(fmaf(s[4 * jj + 0], sl2, -ms0)), p1 = ex2(fmaf(s[4 * jj + 1], sl2, -ms0));
                    const float p2 = ex2(fmaf(s[4 * jj + 2], sl2, -ms1)), p3 = ex2(fmaf(s[4 * jj + 3], sl2, -ms1));
                    l0 += p0 + p1;
                    l1 += p2 + p3;
                    const unsigned u0 = pack_bf16(p0, p1), u1 = pack_bf16(p2, p3);
                    pa[jj >> 1][(jj & 1) * 2 + 0] = u0;
                    pa[jj >> 1][(jj & 1) * 2 + 1] = u1;
                    const unsigned a0 = rope + (lr0 >> 3) * 1024 + (lr0 & 7) * 128 + ((jj ^ (lr0 & 7)) << 4) + 4 * t4;
                    const unsigned a1 = rope + (lr1 >> 3) * 1024 + (lr1 & 7) * 128 + ((jj ^ (lr1 & 7)) << 4) + 4 * t4;
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a0), "r"(u0) : "memory");
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a1), "r"(u1) : "memory");
                }
                const bool last = it + 1 == jb.ntiles;
                float i0 = 0.f, i1 = 0.f;
                if (last) {
#pragma unroll
                    for (int off = 1; off < 4; off <<= 1) {
                        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
                        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
                    }
                    i0 = l0 > 0.f ? 1.f / l0 : 0.f;
                    i1 = l1 > 0.f ? 1.f / l1 : 0.f;
                }
                if (t4 == 0) {
                    float* mg = msg + st * 2 * BM;
                    mg[lr0] = c0;
                    mg[lr1] = c1;
                    mg[BM + lr0] = i0;
                    mg[BM + lr1] = i1;
                }
                fence_async_smem();
                bar_arrive(BAR_PREADY(bars, st));

                // O[:, 0:256] += P V, then S of the next tile behind it
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                    for (int e = 0; e < 4; ++e) reg_fence(pa[kk][e]);
                reg_fence(o);
                wg_fence();
                const unsigned long long dv = sw128_desc(KST(base, st), CB_BYTES);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) wgmma_pv_rs(o, pa[kk], dv + ((kk * 2048) >> 4));
                wg_commit();
                if (!last) {
                    bar_wait(BAR_FULL(bars, st ^ 1), ((t + 1) >> 1) & 1);
                    fence_async_smem();
                    reg_fence(s);
                    wg_fence();
                    issue_s(s, base, KST(base, st ^ 1));
                    wg_commit();
                    wg_wait<1>();
                    bar_arrive(BAR_VFREE(bars, st));
                    wg_wait<0>();
                    reg_fence(s);
                } else {
                    wg_wait<0>();
                    bar_arrive(BAR_VFREE(bars, st));
                }
                reg_fence(o);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                    for (int e = 0; e < 4; ++e) reg_fence(pa[kk][e]);
                if (last) {
                    const long long orow = (long long)j * BM;
                    if (lr0 < jb.nrows) {
                        float* dst = parts + (orow + lr0) * D_V + 2 * t4;
#pragma unroll
                        for (int i = 0; i < 32; ++i)
                            *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[4 * i] * i0, o[4 * i + 1] * i0);
                        if (t4 == 0) part_lse[orow + lr0] = l0 > 0.f ? (m0 + log2f(l0)) * LN2 : NEG_INF;
                    }
                    if (lr1 < jb.nrows) {
                        float* dst = parts + (orow + lr1) * D_V + 2 * t4;
#pragma unroll
                        for (int i = 0; i < 32; ++i)
                            *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[4 * i + 2] * i1, o[4 * i + 3] * i1);
                        if (t4 == 0) part_lse[orow + lr1] = l1 > 0.f ? (m1 + log2f(l1)) * LN2 : NEG_INF;
                    }
                }
            }
        }
    } else {
        // ------------------------------------------ warpgroup 1: K gather, O[:, 256:512]
        const char* kvb = reinterpret_cast<const char*>(kv);
        const char* tkb = reinterpret_cast<const char*>(tree_kv);
        const int lrow = wt >> 3, ch = wt & 7;  // gather: rows lrow + 16p, 16-byte chunk ch of each column block
        // Stream positions (job, tile) of the next tile to gather and the next to prefetch into L2;
        // jobs are decoded again where needed (a binary search over the requests, cached loads).
        int ld_j = blockIdx.x, ld_it = 0, pf_j = blockIdx.x, pf_it = 0;
        const char* src[4];  // gather sources of the tile at (ld_j, ld_it), read one tile ahead
        int nvalid = 0;      // its rows inside the key range
        gather_sources(plan, nreq, page_table, kvb, tkb, P, Q, ld_j, ld_it, lrow, src, nvalid);
        stream_next(plan, nreq, njobs, pf_j, pf_it);
        stream_next(plan, nreq, njobs, pf_j, pf_it);
        for (int s0 = 0; s0 < 2 && ld_j < njobs; ++s0) {  // prologue: stream tiles 0 and 1
            gather(KST(base, s0), BAR_FULL(bars, s0), src, nvalid, lrow, ch);
            prefetch_rows(plan, nreq, njobs, page_table, kvb, P, pf_j, pf_it, wt);
            stream_next(plan, nreq, njobs, ld_j, ld_it);
            stream_next(plan, nreq, njobs, pf_j, pf_it);
            if (ld_j < njobs) gather_sources(plan, nreq, page_table, kvb, tkb, P, Q, ld_j, ld_it, lrow, src, nvalid);
        }

        float o[128];
        int t = 0;
        for (int j = blockIdx.x; j < njobs; j += gridDim.x) {
            const Job jb = decode_job(plan, nreq, j);
            const int ntiles = jb.ntiles, nrows = jb.nrows;
#pragma unroll
            for (int i = 0; i < 128; ++i) o[i] = 0.f;
            for (int it = 0; it < ntiles; ++it, ++t) {
                const int st = t & 1;
                bar_wait(BAR_PREADY(bars, st), (t >> 1) & 1);
                fence_async_smem();
                const float* mg = msg + st * 2 * BM;
                const float c0 = mg[lr0], c1 = mg[lr1];
                rescale(o, c0, c1);
                reg_fence(o);
                wg_fence();
                const unsigned kst = KST(base, st);
                const unsigned long long dp = sw128_desc(kst + ROPE_CB * CB_BYTES, 16);
                const unsigned long long dv = sw128_desc(kst + 4 * CB_BYTES, CB_BYTES);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) wgmma_pv_ss(o, dp + ((kk * 32) >> 4), dv + ((kk * 2048) >> 4));
                wg_commit();
                wg_wait<0>();
                reg_fence(o);
                const bool last = it + 1 == ntiles;
                const float i0 = last ? mg[BM + lr0] : 0.f, i1 = last ? mg[BM + lr1] : 0.f;
                if (ld_j < njobs) {  // refill this stage with stream tile t + 2
                    bar_wait(BAR_VFREE(bars, st), (t >> 1) & 1);
                    gather(kst, BAR_FULL(bars, st), src, nvalid, lrow, ch);
                    prefetch_rows(plan, nreq, njobs, page_table, kvb, P, pf_j, pf_it, wt);
                    stream_next(plan, nreq, njobs, ld_j, ld_it);
                    stream_next(plan, nreq, njobs, pf_j, pf_it);
                    if (ld_j < njobs) gather_sources(plan, nreq, page_table, kvb, tkb, P, Q, ld_j, ld_it, lrow, src, nvalid);
                }
                if (last) {
                    const long long orow = (long long)j * BM;
                    if (lr0 < nrows) {
                        float* dst = parts + (orow + lr0) * D_V + 256 + 2 * t4;
#pragma unroll
                        for (int i = 0; i < 32; ++i)
                            *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[4 * i] * i0, o[4 * i + 1] * i0);
                    }
                    if (lr1 < nrows) {
                        float* dst = parts + (orow + lr1) * D_V + 256 + 2 * t4;
#pragma unroll
                        for (int i = 0; i < 32; ++i)
                            *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[4 * i + 2] * i1, o[4 * i + 3] * i1);
                    }
                }
            }
        }
    }
#else
    __trap();  // built without sm_90a: no wgmma
#endif
}
