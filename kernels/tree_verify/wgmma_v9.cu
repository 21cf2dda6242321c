// tree_verify_v9: v8's whole verify (tree_verify_v5_plan, v8's combine: tree_verify/wgmma_v8.cu) around an
// attend kernel that computes the transposed products ("swap-AB"), so that a job's rows are the wgmma N
// (NR, a multiple of 8) instead of being padded to its M of 64. Three launches, no host sync, fixed buffers
// (CUDA-graph capturable): tree_verify_v5_plan, tree_verify_v9_attend, tree_verify_v8_combine_w<W>.
//
// Why (data/results/attention_bounds.h200.json): at 8 heads x 1 query a job has 8 rows, but v7's consumers
// compute S = Q K^T and O += P V over 64 rows (wgmma m64), so the tensor time of a 64-key tile is about its
// gather time.
//
// Here v7's CTA, producer, barriers, stages and descriptor ring are kept (tree_verify/wgmma_ws.cuh: the
// producer warpgroup is the same code) and the consumers compute, for a job of nrows <= NR rows:
//   S^T [64 keys x NR rows] = K Q^T: wgmma m64nNRk16, A = the K tile (the stage, K-major), B = Q (the Q block,
//     K-major, rows past nrows zero); thread (warp w, g = lane / 4, t4 = lane % 4) holds keys 16 w + g (+8),
//     rows 8 jj + 2 t4 (+1): s[4 jj + 2 h + e] is key 16 w + g + 8 h, row 8 jj + 2 t4 + e;
//   each row's tile max over its 64 keys: shuffles over g, then the 4 warps through shared memory (red);
//   the seesaw's online softmax as v7, per row (the maxima and factors of tiles A and B handed over by rows);
//   P^T (bf16) into the stage's rope block, K-major (per row its 64 keys, 128-B swizzle);
//   O^T [512 dims x NR rows] += V^T P^T: wgmma m64nNRk16, A = V^T straight from the stage (MN-major: the
//     transpose bit), B = P^T; each consumer owns 256 dims (4 M blocks of 64) over both tiles of the pair.
// The job's end sums l over lanes, warps and both consumers in a fixed order (bit-for-bit reproducible)
// and writes the valid rows into parts [j, row, dim] and part_lse, the layout v7 writes.
//
// NR (TV9_NR, the host's -D option) is a compile-time constant: the request's rows (Q*H) rounded up to 8,
// every job of it at most NR rows (ragged trees only shrink jobs). It builds without spills up to 56; the
// host runs this kernel only where it measured faster than v7's (kdlib.cuda.attention.v9_options; the dev
// record data/results/history/attention.v9_dev.4d83aab.h200.json: faster at 8 and 16 rows, slower at 32 and
// 48 rows and where a request also has full 64-row blocks, there run by v7's pair code in the same kernel,
// a build since taken out), elsewhere version 8's kernels.
//
// Shared memory: v7's layout (Q, two K stages, rows, descriptors, barriers) + v9's rows after the barriers
// (m_A, c_A, m_B, c_B [4][64], the tile maxima red [2][4][64] and the job's sums lsum [2][4][64]).
//
// The attend kernel needs sm_90a (wgmma, setmaxnreg); built for another target its body traps.
// kdlib-arch: sm_90a wgmma=tree_verify_v7_attend,tree_verify_v9_attend (tests/test_kernels_compile.py builds it so, checks the SASS)

#include "tree_verify/wgmma_v8.cu"

#ifndef TV9_NR
#define TV9_NR 8                           // rows of the jobs that run the transposed products
#endif
#ifndef V9_MAX_NR                         // raised only by tools/register_budget.py's rows sweep, to build
#define V9_MAX_NR 56                       // past it: beyond, the consumers' registers spill
#endif
#define V9_FP8_MAX_NR 32                   // the FP8 build's (consumers of 208 registers that dequantize)
static_assert(TV9_NR % 8 == 0 && TV9_NR >= 8 && TV9_NR <= V9_MAX_NR, "TV9_NR: a multiple of 8 in [8, V9_MAX_NR]");
static_assert(!TV_FP8 || TV9_NR <= V9_FP8_MAX_NR, "TV9_NR: at most V9_FP8_MAX_NR in FP8 builds");

#define OFF_V9 (OFF_BARS + NBARS * 8)      // float: m_A, c_A, m_B, c_B [4][64], red [2][4][64], lsum [2][4][64]
#define V9_SMEM (OFF_V9 + 20 * BM * 4 + 1024)  // + slack to align the base to 1024 B: 229040
static_assert(OFF_V9 + 20 * BM * 4 == OFF_SCALES, "the FP8 build's scales follow v9's rows (wgmma_ws.cuh)");
#define NB_WG 5                            // named barriers 5, 6: the 128 threads of consumer 0, 1

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// reg_fence of K registers held through a pointer.
template <int K>
__device__ __forceinline__ void reg_fence_n(float* r) {
#pragma unroll
    for (int i = 0; i < K; ++i) reg_fence(r[i]);
}

// What a consumer thread needs across the pair code: its place, the shared rows, the outputs.
struct V9Ctx {
    unsigned base, k0s, k1s, bars;
    float *s_ma, *s_ca, *s_mb, *s_cb;  // [64] each: the maxima and factors of tiles A and B
    float* red;                        // [2][4][64]: each consumer's per-warp tile maxima
    float* lsum;                       // [2][4][64]: each consumer's per-warp sums at the job's end
    int c, warp, lane, g, t4, wt;
    float sl2;
};

// A consumer's context: stages at k0s, k1s, the row arrays from rows (RS floats each), its thread (tid, wg, wt).
template <int RS>
__device__ __forceinline__ void init_ctx(V9Ctx& x, unsigned base, unsigned k0s, unsigned k1s, unsigned bars,
                                         float* rows, int tid, int wg, int wt, float scale) {
    x.base = base;
    x.k0s = k0s;
    x.k1s = k1s;
    x.bars = bars;
    x.s_ma = rows;
    x.s_ca = rows + RS;
    x.s_mb = rows + 2 * RS;
    x.s_cb = rows + 3 * RS;
    x.red = rows + 4 * RS;
    x.lsum = rows + 12 * RS;
    x.c = wg - 1;
    x.warp = wt >> 5;
    x.lane = tid & 31;
    x.g = x.lane >> 2;
    x.t4 = x.lane & 3;
    x.wt = wt;
    x.sl2 = scale * LOG2E;
}

// Row n of this thread's r-th row (r = 2 jj + e < N / 4).
__device__ __forceinline__ int row_of(int r, int t4) { return 8 * (r >> 1) + 2 * t4 + (r & 1); }

// S^T (+)= K Q^T over column blocks [cb0, cb1) of the stage at kst, each after its barrier (parity par; wait
// false: they are whole already, dequant_half). GROUPS (CDQ): a barrier for each group of blocks alone (V_L,
// V_R, rope: blocks 0, V_R0, ROPE_CB), waited on before the group's first block.
template <int N, bool GROUPS = false>
__device__ __forceinline__ void issue_st(float* s, unsigned base, unsigned kst, unsigned bars, int st,
                                         unsigned par, bool wait, int cb0, int cb1) {
    const unsigned long long dk = sw128_desc(opaque(kst), 16), dq = sw128_desc(opaque(base), 16);
#pragma unroll 1
    for (int cb = cb0; cb < cb1; ++cb) {
        if (wait && (!GROUPS || cb == 0 || cb == V_R0 || cb == ROPE_CB)) {
            bar_wait(BAR_CBFULL(bars, st, cb), par);
            fence_async_smem();
        }
        wg_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned off = cb * CB_BYTES + k * 32;
            wgmma_n<N, 0>(s, dk + (off >> 4), dq + (off >> 4), cb > 0 || k > 0);
        }
    }
}

// O^T[dims of vst's MB blocks] (+)= V^T P^T over the 64 keys of a stage; fresh: the job's first (overwrites).
template <int N, int MB = 4>
__device__ __forceinline__ void issue_pv_t(float* o, unsigned pbuf, unsigned vst, bool fresh) {
    const unsigned long long dp = sw128_desc(pbuf, 16), dv = sw128_desc(vst, CB_BYTES);
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_n<N, 1>(o + mb * (N / 2), dv + ((mb * CB_BYTES + kk * 2048) >> 4), dp + ((kk * 32) >> 4),
                          kk > 0 || !fresh);
}

// mask_max_t's masks and each row's max over the quad's g lanes. ANY: tail tiles too (where tail, the
// visibility rows, found by a division a row); else a prefix tile, keys past kend alone.
template <int N, bool ANY>
__device__ __forceinline__ void mask_rows_t(float* s, float* mx, bool tail, int key, int kend,
                                            const unsigned char* vis, const Job& jb, int Q, int H, const V9Ctx& x) {
#pragma unroll
    for (int r = 0; r < N / 4; ++r) {
        const int n = row_of(r, x.t4);
        const unsigned char* v =
            ANY && tail && n < jb.nrows ? vis + ((long long)jb.b * Q + (jb.row0 + n) / H) * Q : nullptr;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = 4 * (r >> 1) + 2 * h + (r & 1), kh = key + 8 * h;
            const bool ok = kh < kend && (!ANY || !tail || (v != nullptr && v[kh]));
            s[i] = ok ? s[i] : NEG_INF;
        }
        float m = fmaxf(s[4 * (r >> 1) + (r & 1)], s[4 * (r >> 1) + 2 + (r & 1)]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        mx[r] = m;
    }
}

// Mask S^T (keys past kend; tail tiles: the visibility row of each row's query, rows past nrows see no
// tail key: -inf) and each row's max over the tile's 64 keys (fixed order: the quad's g lanes, then warps
// 0..3 through red, RS floats a warp), scaled to the log2 domain as v7's mask_tile does; s stays unscaled.
// SPLIT: prefix tiles take a branch of their own (mask_rows_t without the tail's code: version 11's 18 rows
// a thread made the one body the largest part of its consumers' loop, ncu: mostly instruction-fetch stalls).
template <int N, int RS = BM, bool SPLIT = false>
__device__ __forceinline__ void mask_max_t(float* s, float* mx, bool tail, int k0, int kend,
                                           const unsigned char* vis, const Job& jb, int Q, int H, const V9Ctx& x) {
    const int key = k0 + 16 * x.warp + x.g;
    if (SPLIT && !tail) mask_rows_t<N, false>(s, mx, tail, key, kend, vis, jb, Q, H, x);
    else mask_rows_t<N, true>(s, mx, tail, key, kend, vis, jb, Q, H, x);
    float* red = x.red + x.c * 4 * RS;
    if (x.g == 0)
#pragma unroll
        for (int r = 0; r < N / 4; ++r) red[x.warp * RS + row_of(r, x.t4)] = mx[r];
    wg_sync(NB_WG + x.c);
#pragma unroll
    for (int r = 0; r < N / 4; ++r) {
        const int n = row_of(r, x.t4);
        mx[r] = fmaxf(fmaxf(red[n], red[RS + n]), fmaxf(red[2 * RS + n], red[3 * RS + n])) * x.sl2;
    }
}

// The online-softmax step of one tile per row (log2 domain, as v7's softmax_step): mn = max(mp, mx),
// c = 2^(mp - mn), l = l c + the row's sum of P, s <- P = 2^(s sl2 - mn) (fp32, one FFMA).
template <int N>
__device__ __forceinline__ void softmax_t(float* s, float sl2, const float* mp, const float* mx, float* mn,
                                          float* cf, float* l) {
#pragma unroll
    for (int r = 0; r < N / 4; ++r) {
        mn[r] = fmaxf(mp[r], mx[r]);
        const float ms = mn[r] == NEG_INF ? 0.f : mn[r];  // no key yet
        cf[r] = ex2(mp[r] - ms);
        const int i0 = 4 * (r >> 1) + (r & 1), i1 = i0 + 2;
        s[i0] = ex2(fmaf(s[i0], sl2, -ms));
        s[i1] = ex2(fmaf(s[i1], sl2, -ms));
        l[r] = l[r] * cf[r] + (s[i0] + s[i1]);
    }
}

// O^T columns (rows) of this thread (MB dim blocks) *= their factors, skipped when no row of the warp moved.
template <int N, int MB = 4>
__device__ __forceinline__ void rescale_t(float* o, const float* cf) {
    bool moved = false;
#pragma unroll
    for (int r = 0; r < N / 4; ++r) moved |= cf[r] != 1.f;
    if (!__any_sync(0xffffffffu, moved)) return;
#pragma unroll
    for (int i = 0; i < MB * N / 2; ++i) o[i] *= cf[2 * ((i % (N / 2)) >> 2) + (i & 1)];
}

// P^T (bf16) into pbuf, K-major: row n's 64 keys on line n (8-row groups 1024 B apart), 128-B swizzle.
template <int N>
__device__ __forceinline__ void store_pt(const float* s, unsigned pbuf, const V9Ctx& x) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
        const int jj = i >> 2, h = (i >> 1) & 1, ln = 2 * x.t4 + (i & 1);  // row 8 jj + ln, key 16 w + 8 h + g
        const unsigned a = pbuf + jj * 1024 + ln * 128 + (((2 * x.warp + h) ^ ln) << 4) + 2 * x.g;
        const __nv_bfloat16 p = __float2bfloat16_rn(s[i]);
        asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(a), "h"(*reinterpret_cast<const unsigned short*>(&p))
                     : "memory");
    }
}

// Rows of this thread into a row array (warp 0's g = 0 lanes hold every row once).
template <int N>
__device__ __forceinline__ void put_rows(float* dst, const float* v, const V9Ctx& x) {
    if (x.warp == 0 && x.g == 0)
#pragma unroll
        for (int r = 0; r < N / 4; ++r) dst[row_of(r, x.t4)] = v[r];
}

template <int N>
__device__ __forceinline__ void get_rows(float* v, const float* src, const V9Ctx& x) {
#pragma unroll
    for (int r = 0; r < N / 4; ++r) v[r] = src[row_of(r, x.t4)];
}

// The pair after S^T (s, the tile's whole S^T in consumer x.c): the masks, the softmax of tile A (consumer 0)
// or B (1), the handoffs and the consumer's P V of both tiles over its MB V blocks (from x.k0s, x.k1s +
// c MB blocks), P_A^T and P_B^T at pa, pb; each V group's release once read (ROPE: and the rope group's, which
// holds P^T in v9). RS: the row arrays' stride; SPLIT: mask_max_t's.
template <int N, int RS = BM, int MB = 4, bool ROPE = true, bool SPLIT = false>
__device__ __forceinline__ void pair_rest_t(float* o, float* s, float* m, float* l, const Job& jb, bool tail, int k0,
                                            int kend, bool first, const unsigned char* vis, int Q, int H,
                                            const V9Ctx& x, unsigned pa, unsigned pb) {
    float mx[N / 4], mn[N / 4], cf[N / 4];
    mask_max_t<N, RS, SPLIT>(s, mx, tail, k0, kend, vis, jb, Q, H, x);
    if (x.c == 0) {
        // ---------------------------------------------------- tile A: softmax, O_L += V_AL^T P_A^T
        softmax_t<N>(s, x.sl2, m, mx, mn, cf, l);
        rescale_t<N, MB>(o, cf);
        put_rows<N>(x.s_ma, mn, x);
        put_rows<N>(x.s_ca, cf, x);
        store_pt<N>(s, pa, x);
        fence_async_smem();
        wg_sync(NB_WG);  // P_A^T whole for this consumer's MMAs; red free again
        handoff(NB_SCALE_A);
        reg_fence_n<MB * N / 2>(o);
        wg_fence();
        issue_pv_t<N, MB>(o, pa, x.k0s, first);
        wg_commit();
        wg_wait<0>();
        reg_fence_n<MB * N / 2>(o);
        warp_arrive(BAR_EMPTY(x.bars, 0, 0), x.lane);  // stage 0: V_AL read, P_A read on this side
        if (ROPE) warp_arrive(BAR_EMPTY(x.bars, 0, 2), x.lane);

        // ---------------------------------------------------- tile B: O_L = O_L c_B + V_BL^T P_B^T
        nb_sync(NB_SCALE_B);
        get_rows<N>(cf, x.s_cb, x);
        get_rows<N>(m, x.s_mb, x);
#pragma unroll
        for (int r = 0; r < N / 4; ++r) l[r] *= cf[r];
        rescale_t<N, MB>(o, cf);
        nb_sync(NB_PB);
        fence_async_smem();
        reg_fence_n<MB * N / 2>(o);
        wg_fence();
        issue_pv_t<N, MB>(o, pb, x.k1s, false);
        wg_commit();
        wg_wait<0>();
        reg_fence_n<MB * N / 2>(o);
        warp_arrive(BAR_EMPTY(x.bars, 1, 0), x.lane);  // stage 1: V_BL read, P_B read on this side
        if (ROPE) warp_arrive(BAR_EMPTY(x.bars, 1, 2), x.lane);
    } else {
        // ---------------------------------------------------- tile A: O_R = O_R c_A + V_AR^T P_A^T
        nb_sync(NB_SCALE_A);
        fence_async_smem();
        float ma[N / 4];
        get_rows<N>(ma, x.s_ma, x);
        get_rows<N>(cf, x.s_ca, x);
#pragma unroll
        for (int r = 0; r < N / 4; ++r) l[r] *= cf[r];
        rescale_t<N, MB>(o, cf);
        reg_fence_n<MB * N / 2>(o);
        wg_fence();
        issue_pv_t<N, MB>(o, pa, x.k0s + MB * CB_BYTES, first);
        wg_commit();
        // ---------------------------------------------------- tile B: softmax, O_R = O_R c_B + V_BR^T P_B^T
        softmax_t<N>(s, x.sl2, ma, mx, mn, cf, l);
        put_rows<N>(x.s_mb, mn, x);  // under this consumer's MMAs
        put_rows<N>(x.s_cb, cf, x);
#pragma unroll
        for (int r = 0; r < N / 4; ++r) m[r] = mn[r];
        handoff(NB_SCALE_B);
        store_pt<N>(s, pb, x);
        fence_async_smem();
        wg_sync(NB_WG + 1);  // P_B^T whole for this consumer's MMAs; red free again
        handoff(NB_PB);
        wg_wait<0>();
        reg_fence_n<MB * N / 2>(o);
        warp_arrive(BAR_EMPTY(x.bars, 0, 1), x.lane);  // stage 0: V_AR read, P_A read on this side
        if (ROPE) warp_arrive(BAR_EMPTY(x.bars, 0, 2), x.lane);
        rescale_t<N, MB>(o, cf);
        reg_fence_n<MB * N / 2>(o);
        wg_fence();
        issue_pv_t<N, MB>(o, pb, x.k1s + MB * CB_BYTES, false);
        wg_commit();
        wg_wait<0>();
        reg_fence_n<MB * N / 2>(o);
        warp_arrive(BAR_EMPTY(x.bars, 1, 1), x.lane);  // stage 1: V_BR read, P_B read on this side
        if (ROPE) warp_arrive(BAR_EMPTY(x.bars, 1, 2), x.lane);
    }
}

// One pair of tiles in consumer x.c (v7's seesaw with the transposed products; v7's barriers and releases).
// o [2 N]: O^T of the consumer's 4 dim blocks, m, l [N / 4]: its rows' running max and sum. CDQ: the consumer
// dequantizes its stage's prefix tiles (FP8 builds, dequant_half); the other consumer reads that stage's V half
// only after a handoff that follows it (NB_SCALE_A, NB_PB). In the checking build (TV7_RACECHECK) a consumer
// whose tile is a tree tail passes dequant_half's two barriers anyway: racecheck flags the row exchanges of two
// warpgroups that pass unequal numbers of their own barriers between them, ordered or not
// (tools/racecheck_patterns.py: seesaw_wg0_sync_384, cdq_ring_*).
template <int N, bool CDQ>
__device__ __forceinline__ void pair_t(float* o, float* s, float* m, float* l, const Job& jb, bool tail, int k0,
                                       int kend, bool first, bool last, unsigned par, const unsigned char* vis,
                                       int Q, int H, const V9Ctx& x) {
    const unsigned pa = x.k0s + ROPE_CB * CB_BYTES, pb = x.k1s + ROPE_CB * CB_BYTES;  // P_A^T, P_B^T
#pragma unroll
    for (int i = 0; i < N / 2; ++i) s[i] = 0.f;  // the accumulator starts afresh (its old value is dead)
    reg_fence_n<N / 2>(s);
    wg_fence();
    const unsigned kst = x.c == 0 ? x.k0s : x.k1s;
    if constexpr (CDQ) {  // a prefix tile: each V half's S^T MMAs run under the next half's dequantization
        const bool dq = !tail;
        const unsigned sc = x.base + OFF_SCALES + x.c * BN * 16;
        if (dq) dequant_half(kst, x.bars, x.c, par, sc, x.wt, 0, NB_WG + x.c);
        else if (TV7_RACECHECK) wg_sync(NB_WG + x.c);  // the checking build's equal count (above)
        issue_st<N, true>(s, x.base, kst, x.bars, x.c, par, !dq, 0, V_R0);
        if (dq) dequant_half(kst, x.bars, x.c, par, sc, x.wt, 1, NB_WG + x.c);
        else if (TV7_RACECHECK) wg_sync(NB_WG + x.c);
        issue_st<N, true>(s, x.base, kst, x.bars, x.c, par, !dq, V_R0, NCB);
    } else {
        issue_st<N>(s, x.base, kst, x.bars, x.c, par, true, 0, NCB);
    }
    wg_commit();
    wg_wait<0>();
    reg_fence_n<N / 2>(s);
    if (CDQ) warp_arrive(BAR_EMPTY(x.bars, x.c, 1 - x.c), x.lane);  // the other's V half: written, read (init_bars)
    if (last) warp_arrive(BAR_QEMPTY(x.bars), x.lane);  // the job's Q is read
    pair_rest_t<N>(o, s, m, l, jb, tail, k0, kend, first, vis, Q, H, x, pa, pb);
}

// The job's end in consumer x.c: each row's l summed over the g lanes, then (through lsum, RS floats a warp,
// named barrier NB_LSUM) over consumers 0, 1 and warps 0..3 in that order; the consumer's MB blocks of dims
// from col0 (v9: its 256) of the valid rows normalised into parts [j, row, dim] (rows past 63 run on into job
// j + 1's: version 11's 72-row jobs), where lse the rows' lse; then m -inf and l 0 for the next job. WARPS 4:
// one warpgroup's rows (version 12's producer, x.c 0), its warps 0..3 through its own barrier NB_WG.
template <int N, int RS = BM, int MB = 4, int WARPS = 8>
__device__ __forceinline__ void job_end_t(const float* o, float* m, float* l, int j, int nrows, float* parts,
                                          float* part_lse, const V9Ctx& x, int col0, bool lse) {
#pragma unroll
    for (int r = 0; r < N / 4; ++r)
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) l[r] += __shfl_xor_sync(0xffffffffu, l[r], off);
    if (x.g == 0)
#pragma unroll
        for (int r = 0; r < N / 4; ++r) x.lsum[(x.c * 4 + x.warp) * RS + row_of(r, x.t4)] = l[r];
    if constexpr (WARPS == 8) nb_sync(NB_LSUM);
    else wg_sync(NB_WG + x.c);
    const long long orow = (long long)j * BM;
#pragma unroll
    for (int r = 0; r < N / 4; ++r) {
        const int n = row_of(r, x.t4);
        float lt = 0.f;
#pragma unroll
        for (int k = 0; k < WARPS; ++k) lt += x.lsum[k * RS + n];
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        if (n < nrows) {
            float* dst = parts + (orow + n) * D_V + col0 + 16 * x.warp + x.g;
#pragma unroll
            for (int mb = 0; mb < MB; ++mb)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    dst[64 * mb + 8 * h] = o[mb * (N / 2) + 4 * (r >> 1) + 2 * h + (r & 1)] * inv;
            if (lse && x.warp == 0 && x.g == 0) part_lse[orow + n] = lt > 0.f ? (m[r] + log2f(lt)) * LN2 : NEG_INF;
        }
        m[r] = NEG_INF;
        l[r] = 0.f;
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ------------------------------------------------------------------------------------------ attend

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Consumer warpgroup wg (1 or 2; tid, wt: its thread in the CTA, in the warpgroup) of v9's attend kernel and
// of version 10's ordered one (tree_verify/wgmma_v10.cu): the CTA's shared memory at base (gbase), the pair
// descriptors at desc, the barriers at bars. CDQ (FP8 builds): each consumer dequantizes its prefix tiles.
template <bool CDQ = false>
__device__ __forceinline__ void consume_v9(unsigned base, unsigned char* gbase, const int* desc, unsigned bars,
                                           int tid, int wg, int wt, const unsigned char* __restrict__ vis, int Q,
                                           int H, float scale, float* __restrict__ parts,
                                           float* __restrict__ part_lse) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_NREG));
    float* rows = reinterpret_cast<float*>(gbase + OFF_V9);
    V9Ctx x;
    init_ctx<BM>(x, base, base + OFF_K0, base + OFF_K1, bars, rows, tid, wg, wt, scale);

    float o[2 * TV9_NR];  // O^T of the consumer's 4 dim blocks
    float s[32];          // S^T (its first TV9_NR / 2)
#pragma unroll
    for (int i = 0; i < 2 * TV9_NR; ++i) o[i] = 0.f;
    float m[TV9_NR / 4], l[TV9_NR / 4];  // the rows' running max and sum
#pragma unroll
    for (int r = 0; r < TV9_NR / 4; ++r) {
        m[r] = NEG_INF;
        l[r] = 0.f;
    }
    int jobs = 0;  // jobs started: the Q barrier's phase
    for (int n = 0;; ++n) {
        // the pair's descriptor, all of it into registers (the producer reuses the slot NDESC pairs on)
        int j, flags, k0, kend;
        Job jb;
        bool tail;
        get_desc(desc, bars, n, x.c, j, flags, jb, tail, k0, kend);
        const bool first = flags & D_FIRST, last = flags & D_LAST;
        if (first) {  // the job's Q
            bar_wait(BAR_QFULL(bars), jobs & 1);
            ++jobs;
        }
        pair_t<TV9_NR, CDQ>(o, s, m, l, jb, tail, k0, kend, first, last, n & 1, vis, Q, H, x);
        if (last) job_end_t<TV9_NR>(o, m, l, j, jb.nrows, parts, part_lse, x, 256 * x.c, x.c == 0);
        if (flags & D_END) break;
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Arguments and outputs as tree_verify_v7_attend. Grid G (one per SM), block 384, dynamic shared memory
// V9_SMEM.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v9_attend(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    int nreq, int P, int Q, int H, float scale, float* __restrict__ parts, float* __restrict__ part_lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if ((int)blockIdx.x >= plan_jobs(plan)) return;
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* gbase = smem_raw + (base - smem_u32(smem_raw));
    int* desc = reinterpret_cast<int*>(gbase + OFF_DESC);  // [NDESC][DESC_INTS]
    const unsigned bars = base + OFF_BARS;
    const int tid = threadIdx.x;
    if (tid == 0) init_bars(bars);
    __syncthreads();

    const int wg = tid >> 7, wt = tid & 127;
    if (wg == 0) {
        produce<false>(base, desc, bars, q, kv, page_table, tree_kv, plan, nullptr, nreq, P, Q, H, wt);
        return;
    }
    consume_v9(base, gbase, desc, bars, tid, wg, wt, vis, Q, H, scale, parts, part_lse);
#else
    __trap();  // built without sm_90a: no wgmma
#endif
}
