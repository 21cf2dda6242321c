// tree_verify_v11: version 10's whole verify where a request has 65 to 72 query rows (8 heads x 9 queries), its
// attend kernel run by clusters of two CTAs that take all of a key chunk's rows in one pass. Three launches, no
// host sync, fixed buffers (CUDA-graph capturable): tree_verify_v5_plan, tree_verify_v11_attend,
// tree_verify_v8_combine_w<W> (or _rows); kdlib.cuda.attention runs version 10 at every other shape.
//
// Why (notebook 02b, 13s and 13t): 72 rows are two 64-row jobs a key chunk, so versions 7-10 multiply every key
// tile twice with the rows padded to 128, and those MMAs alone take longer than 70 % of copy allows the 8 x 9
// points. One CTA cannot hold the 72 rows' Q, two stages and their P^T in shared memory, nor version 9's
// transposed products of 72 rows in its registers (it builds without spills to 56).
//
// Here the two CTAs of a cluster split each row's 576 dims: CTA rank 0 holds column blocks 0-3 (V_L) and the
// rope block 8, rank 1 blocks 4-7 (V_R), each as its local blocks 0.. of its Q and stages. For each tile each
// CTA's consumer computes the partial S^T [64 keys x 72 rows] over its blocks (wgmma m64n72k16, version 9's
// swap-AB: the rows are N, none padded), stores it into the other CTA's X buffer through distributed shared
// memory and adds the other's: s + x in both CTAs, an fp32 sum of two terms, so both hold the same bits of S.
// Both then run version 9's pair (pair_rest_t: masks, softmax, handoffs) on the same S, the same P^T, and each
// consumer accumulates O^T over its CTA's two V blocks (128 dims): rank r, consumer c, dims 256 r + 128 c ...
//
// Jobs: the v5 plan is unchanged (64-row jobs); the kernel runs its groups, a request's key chunk with its one
// or two row-block jobs (first, first + 1), rows 0 .. rows - 1 <= 72 in one pass, whose rows past 63 land in
// parts [first + 1] (parts [j, row] is row 64 j + row of one array). Cluster k of the G / 2 takes groups k,
// k + G / 2, ... (the static round-robin). v8's combine then reads the jobs as it reads version 10's.
//
// Exchange (the X buffers, per consumer and pair parity): a consumer's threads store their 36 floats of S^T
// into the other CTA's X [c][n % 2] (float4 i of thread t at (i 128 + t) 16 bytes) and arrive there on
// XFULL [c][n % 2] (release, cluster scope); each waits on its own XFULL (acquire) and reads its X. A CTA
// writes X [c][p] again at pair n + 2 only once the other arrived at pair n + 1, after its reads of pair n.
//
// Stages: version 9's barriers, per stage the full barriers of the CTA's blocks and three empty ones: group 0
// (local blocks 0, 1: consumer 0's P V), group 1 (2, 3: consumer 1's), group 2 (rank 0's rope block, read by
// the stage's S alone and released after it). P_A^T and P_B^T have their own buffers (72 rows do not fit a
// block); their reuse is ordered by the stage refills, as in version 9.
//
// The attend kernel needs sm_90a (wgmma, setmaxnreg, clusters); built for another target its body traps.
// kdlib-arch: sm_90a wgmma=tree_verify_v7_attend,tree_verify_v9_attend,tree_verify_v11_attend

#include "common/cluster.cuh"
#include "tree_verify/wgmma_v9.cu"

#define V11_NR 72                                     // rows of a group (the 8 x 9 request's Q*H)
#define V11_QB (V11_NR * 128)                         // one column block of the rows' Q, or a P^T: 9216 B
#define V11_LB 5                                      // the most column blocks a CTA holds (rank 0)
#define V11_OFF_S0 (V11_LB * V11_QB)                  // Q [5][72 rows], then the two stages [5][64 keys]
#define V11_OFF_S1 (V11_OFF_S0 + V11_LB * CB_BYTES)
#define V11_OFF_PT (V11_OFF_S1 + V11_LB * CB_BYTES)   // P_A^T, P_B^T [2][72 rows x 64 keys] bf16
#define V11_XF (BN * V11_NR)                          // floats of one partial S^T: 4608
#define V11_OFF_X (V11_OFF_PT + 2 * V11_QB)           // X [consumer][pair parity][V11_XF] fp32
#define V11_OFF_ROWS (V11_OFF_X + 4 * V11_XF * 4)     // m_A, c_A, m_B, c_B [4][72], red [2][4][72], lsum [2][4][72]
#define V11_OFF_DESC (V11_OFF_ROWS + 20 * V11_NR * 4)  // int [NDESC][DESC_INTS]
#define V11_OFF_BARS (V11_OFF_DESC + NDESC * DESC_INTS * 4)
#define V11_NBARS (NBARS + 4)                         // version 7's, then XFULL [consumer][parity]
#define V11_SMEM (V11_OFF_BARS + V11_NBARS * 8 + 1024)  // + slack to align the base to 1024 B: 227408
// setmaxnreg: 128 x 48 + 256 x 224 = 63488 <= 64512, the CTA's pool (wgmma_ws.cuh; the producer's group walk
// spills at version 9's 40)
#define V11_PRODUCER_REGS 48
#define V11_CONSUMER_REGS 224
#define BAR_XFULL(bars, c, p) ((bars) + 8 * (NBARS + 2 * (c) + (p)))
static_assert(V11_OFF_S0 % 1024 == 0 && V11_OFF_PT % 1024 == 0, "128-B swizzled operands on 1024-B atoms");
static_assert(!TV_FP8 && !TV7_PROBE && !TV_TRACE, "version 11: the bf16 default build only");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The groups of a plan (each request's key chunks) and group g's first job (-1 past them).
__device__ __forceinline__ int plan_groups(const int* plan, int nreq) {
    int n = 0;
    for (int b = 0; b < nreq; ++b) {
        const int* e = plan + PLAN_HDR + b * PLAN_STRIDE;
        n += e[P_RB] > 0 ? e[P_NCHUNK] : 0;
    }
    return n;
}

__device__ __forceinline__ int group_job(const int* plan, int nreq, int g) {
    for (int b = 0; b < nreq; ++b) {
        const int* e = plan + PLAN_HDR + b * PLAN_STRIDE;
        const int nc = e[P_RB] > 0 ? e[P_NCHUNK] : 0;
        if (g < nc) return e[P_BASE] + g * e[P_RB];
        g -= nc;
    }
    return -1;
}

// Job j (a group's first) with the group's rows: all of its request's, at most V11_NR.
__device__ __forceinline__ Job group_of(const int* plan, int nreq, int j) {
    Job jb = decode_job(plan, nreq, j);
    jb.nrows = min(plan[PLAN_HDR + jb.b * PLAN_STRIDE + P_ROWS], V11_NR);
    return jb;
}

// The global column block of local block lb of CTA rank.
__device__ __forceinline__ int global_cb(unsigned rank, int lb) { return rank ? V_R0 + lb : (lb < V_R0 ? lb : ROPE_CB); }

// The group's Q (its rows, the CTA's blocks) into qs by cp.async (the producer, wt its thread; rows past the
// valid ones zero), then the thread's arrive on the Q barrier once its copies land.
__device__ __forceinline__ void load_q_v11(unsigned qs, unsigned qbar, const __nv_bfloat16* q, const Job& jb, int M,
                                           int wt, unsigned rank) {
    const char* qg = reinterpret_cast<const char*>(q + (long long)jb.b * M * D_QK);
    const int r = wt >> 3, c = wt & 7, nlb = rank ? V_R0 : V11_LB;
#pragma unroll
    for (int p = 0; p < (V11_NR + 15) / 16; ++p) {
        const int row = r + 16 * p;
        if (row >= V11_NR) break;
        const bool ok = row < jb.nrows;
        const char* src = qg + (ok ? (long long)row * D_QK * 2 : 0) + c * 16;
        const unsigned dst = qs + row * 128 + ((c ^ (row & 7)) << 4);
        for (int lb = 0; lb < nlb; ++lb) cp_async16(dst + lb * V11_QB, src + global_cb(rank, lb) * 128, ok ? 16 : 0);
    }
    bar_arrive_copies(qbar);
}

// The barriers at bars (tid 0 of the CTA; the cluster barrier must follow before the other CTA arrives).
__device__ __forceinline__ void init_bars_v11(unsigned bars) {
    for (int s = 0; s < 2; ++s) {
        for (int c = 0; c < V11_LB; ++c) bar_init(BAR_CBFULL(bars, s, c), FILLER);
        for (int g = 0; g < 3; ++g) bar_init(BAR_EMPTY(bars, s, g), 4 * WARP_ARRIVALS);  // one consumer's warps
    }
    bar_init(BAR_QFULL(bars), 128);
    bar_init(BAR_QEMPTY(bars), 8 * WARP_ARRIVALS);
    for (int d = 0; d < NDESC; ++d) bar_init(BAR_DESC(bars, d), 1);
    for (int x = 0; x < 4; ++x) bar_init(BAR_XFULL(bars, x >> 1, x & 1), 128);  // the other CTA's consumer
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Stage s's fill for pair n (version 9's fill_stage over the CTA's blocks): each group once its reader of pair
// n - 1 released it. vkb, vtb: the pool and tree rows from the CTA's first V dim.
__device__ __forceinline__ void fill_v11(unsigned kst, unsigned bars, int s, int n, const TileRows& t, const char* vkb,
                                         const char* vtb, const char* kvb, const char* tkb, int lrow, int ch,
                                         unsigned rank) {
    const unsigned ep = (n & 1) ^ 1;
    bar_wait(BAR_EMPTY(bars, s, 0), ep);
    gather_half<0, 2>(kst, bars, s, t, vkb, vtb, lrow, ch);
    bar_wait(BAR_EMPTY(bars, s, 1), ep);
    gather_half<2, V_R0>(kst, bars, s, t, vkb, vtb, lrow, ch);
    if (rank == 0) {  // the rope block (global 8) into local block 4: 4 blocks on from the row's start
        bar_wait(BAR_EMPTY(bars, s, 2), ep);
        gather_half<V_R0, V11_LB>(kst, bars, s, t, kvb + V_R0 * 128, tkb + V_R0 * 128, lrow, ch);
    }
}

// The producer warpgroup (wt: its thread) over the cluster's groups: Q of each, the pair descriptors, the CTA's
// blocks of each tile into the stages.
__device__ __forceinline__ void produce_v11(unsigned base, int* desc, unsigned bars, unsigned rank,
                                            const __nv_bfloat16* q, const __nv_bfloat16* kv, const int* page_table,
                                            const __nv_bfloat16* tree_kv, const int* plan, int nreq, int P, int Q,
                                            int H, int wt, int ngroups) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(V11_PRODUCER_REGS));
    const unsigned k0s = base + V11_OFF_S0, k1s = base + V11_OFF_S1;
    const char* kvb = reinterpret_cast<const char*>(kv);
    const char* tkb = reinterpret_cast<const char*>(tree_kv);
    const char* vkb = kvb + rank * V_R0 * 128;
    const char* vtb = tkb + rank * V_R0 * 128;
    const int lrow = wt >> 3, ch = wt & 7;
    const int clusters = (int)gridDim.x >> 1;
    int g = (int)blockIdx.x >> 1;
    auto next = [&] {
        g += clusters;
        return g < ngroups ? group_job(plan, nreq, g) : -1;
    };
    Pos cur{group_job(plan, nreq, g), 0};
    Job jb = group_of(plan, nreq, cur.j);
    TileRows ra = tile_rows(jb, page_table, P, Q, 0, lrow), rb = tile_rows(jb, page_table, P, Q, 1, lrow);
    bool fresh;
    Pos nx = pos_after(jb, cur, fresh, next);
    int jobs = 0;
    for (int n = 0;; ++n) {
        if (cur.i == 0) {  // a new group: its Q once both consumers' S of the last one are done
            bar_wait(BAR_QEMPTY(bars), (jobs & 1) ^ 1);
            load_q_v11(base, BAR_QFULL(bars), q, jb, Q * H, wt, rank);
            ++jobs;
        }
        if (wt == 0) put_desc(desc, bars, n, jb, cur, nx, fresh);
        fill_v11(k0s, bars, 0, n, ra, vkb, vtb, kvb, tkb, lrow, ch, rank);
        fill_v11(k1s, bars, 1, n, rb, vkb, vtb, kvb, tkb, lrow, ch, rank);
        if (nx.j < 0) break;
        if (fresh) jb = group_of(plan, nreq, nx.j);
        cur = nx;
        ra = tile_rows(jb, page_table, P, Q, 2 * cur.i, lrow);
        rb = tile_rows(jb, page_table, P, Q, 2 * cur.i + 1, lrow);
        nx = pos_after(jb, cur, fresh, next);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
}

// This consumer's partial S^T (s: the tile over its CTA's blocks) into the other CTA's X [c][n % 2] and the
// arrival on its XFULL, then the other's partial, waited for, added: s + x in both CTAs (the same bits).
__device__ __forceinline__ void exchange_st(float* s, const V9Ctx& x, int n, unsigned other) {
    const unsigned xb = x.base + V11_OFF_X + (2 * x.c + (n & 1)) * V11_XF * 4 + x.wt * 16;
    const unsigned xbar = BAR_XFULL(x.bars, x.c, n & 1), xr = peer_addr(xb, other);
#pragma unroll
    for (int i = 0; i < V11_NR / 8; ++i)
        store_cluster(xr + i * 128 * 16, make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]));
    mbar_arrive_remote(peer_addr(xbar, other));  // (st.async completing on XFULL instead: no faster, 13u)
    mbar_wait(xbar, (n >> 1) & 1);
#pragma unroll
    for (int i = 0; i < V11_NR / 8; ++i) {
        const uint4 v = ld_shared_v4(xb + i * 128 * 16);
        s[4 * i] += __uint_as_float(v.x);
        s[4 * i + 1] += __uint_as_float(v.y);
        s[4 * i + 2] += __uint_as_float(v.z);
        s[4 * i + 3] += __uint_as_float(v.w);
    }
}

// One pair in consumer x.c of a CTA holding LB column blocks: its tile's partial S^T over them, the rope block
// released (rank 0), the exchange, then version 9's pair over the CTA's two V blocks of each consumer.
template <int LB>
__device__ __forceinline__ void pair_v11(float* o, float* s, float* m, float* l, const Job& jb, bool tail, int k0,
                                         int kend, bool first, bool last, int n, const unsigned char* vis, int Q,
                                         int H, const V9Ctx& x, unsigned other) {
    constexpr int N = V11_NR;
    const unsigned par = n & 1, kst = x.c == 0 ? x.k0s : x.k1s;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) s[i] = 0.f;
    reg_fence_n<N / 2>(s);
    const unsigned long long dk = sw128_desc(opaque(kst), 16), dq = sw128_desc(opaque(x.base), 16);
#pragma unroll
    for (int lb = 0; lb < LB; ++lb) {
        bar_wait(BAR_CBFULL(x.bars, x.c, lb), par);
        fence_async_smem();
        wg_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k)
            wgmma_n<N, 0>(s, dk + ((lb * CB_BYTES + k * 32) >> 4), dq + ((lb * V11_QB + k * 32) >> 4), lb > 0 || k > 0);
    }
    wg_commit();
    wg_wait<0>();
    reg_fence_n<N / 2>(s);
    if (LB == V11_LB) warp_arrive(BAR_EMPTY(x.bars, x.c, 2), x.lane);  // the rope block: read by this S alone
    if (last) warp_arrive(BAR_QEMPTY(x.bars), x.lane);
    exchange_st(s, x, n, other);
    pair_rest_t<N, V11_NR, 2, false, true>(o, s, m, l, jb, tail, k0, kend, first, vis, Q, H, x, x.base + V11_OFF_PT,
                                     x.base + V11_OFF_PT + V11_QB);
}

// Consumer warpgroup wg (1 or 2) of a CTA holding LB column blocks (rank 0: 5, rank 1: 4).
template <int LB>
__device__ __forceinline__ void consume_v11(unsigned base, unsigned char* gbase, const int* desc, unsigned bars,
                                            unsigned rank, int tid, int wg, int wt, const unsigned char* vis, int Q,
                                            int H, float scale, float* parts, float* part_lse) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(V11_CONSUMER_REGS));
    V9Ctx x;
    init_ctx<V11_NR>(x, base, base + V11_OFF_S0, base + V11_OFF_S1, bars,
                     reinterpret_cast<float*>(gbase + V11_OFF_ROWS), tid, wg, wt, scale);

    float o[V11_NR];      // O^T of the consumer's 2 dim blocks
    float s[V11_NR / 2];  // S^T
#pragma unroll
    for (int i = 0; i < V11_NR; ++i) o[i] = 0.f;
    float m[V11_NR / 4], l[V11_NR / 4];
#pragma unroll
    for (int r = 0; r < V11_NR / 4; ++r) {
        m[r] = NEG_INF;
        l[r] = 0.f;
    }
    int jobs = 0;
    for (int n = 0;; ++n) {
        int j, flags, k0, kend;
        Job jb;
        bool tail;
        get_desc(desc, bars, n, x.c, j, flags, jb, tail, k0, kend);
        const bool first = flags & D_FIRST, last = flags & D_LAST;
        if (first) {
            bar_wait(BAR_QFULL(bars), jobs & 1);
            ++jobs;
        }
        pair_v11<LB>(o, s, m, l, jb, tail, k0, kend, first, last, n, vis, Q, H, x, rank ^ 1u);
        if (last)
            job_end_t<V11_NR, V11_NR, 2>(o, m, l, j, jb.nrows, parts, part_lse, x, 256 * rank + 128 * x.c,
                                         rank == 0 && x.c == 0);
        if (flags & D_END) break;
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Arguments and outputs as tree_verify_v7_attend (plan: tree_verify_v5_plan's, every request at most V11_NR
// rows). Grid G (even: G / 2 clusters of two), block 384, dynamic shared memory V11_SMEM.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(NTHREADS, 1) tree_verify_v11_attend(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    int nreq, int P, int Q, int H, float scale, float* __restrict__ parts, float* __restrict__ part_lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    pdl_wait();
    const int ngroups = plan_jobs(plan) > 0 ? plan_groups(plan, nreq) : 0;  // (a plan of no jobs: none)
    if ((int)blockIdx.x >> 1 >= ngroups) return;  // both CTAs of the cluster
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* gbase = smem_raw + (base - smem_u32(smem_raw));
    int* desc = reinterpret_cast<int*>(gbase + V11_OFF_DESC);
    const unsigned bars = base + V11_OFF_BARS, rank = cluster_rank();
    const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127;
    if (tid == 0) init_bars_v11(bars);
    cluster_sync();  // both CTAs' barriers set before either arrives on the other's
    if (wg == 0)
        produce_v11(base, desc, bars, rank, q, kv, page_table, tree_kv, plan, nreq, P, Q, H, wt, ngroups);
    else if (rank == 0)
        consume_v11<V11_LB>(base, gbase, desc, bars, rank, tid, wg, wt, vis, Q, H, scale, parts, part_lse);
    else
        consume_v11<V_R0>(base, gbase, desc, bars, rank, tid, wg, wt, vis, Q, H, scale, parts, part_lse);
    cluster_sync();  // neither CTA leaves while the other may still write its X buffers
#else
    __trap();  // built without sm_90a: no wgmma
#endif
}
