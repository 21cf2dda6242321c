// tree_verify_v7: the whole tree-verify MLA attention (paged prefix + tree tail) on Hopper's
// warpgroup tensor cores, bf16 in, fp32 out: v5's plan and combine and v6's seesaw (both in
// tree_verify/wgmma_common.cuh) around an attend kernel with warp specialisation. Three launches, no
// host sync, fixed buffers (CUDA-graph capturable): tree_verify_v5_plan, tree_verify_v7_attend,
// tree_verify_v5_combine; jobs, partials and their merge as in v5.
//
// Why (data/results/ncu/tree_verify_v6_attend.8x65x200k.txt: issue slots mostly idle, few eligible
// warps): in v6 the two MMA warpgroups also gathered the K tiles, so a large share of their
// instructions were page-table lookups, cp.async of the scattered rows, address math and the job
// decode, and a stage was refilled only when its gathering warpgroup came to it in its own stream. Here a CTA is three warpgroups (384 threads):
//
//   warpgroup 0, the producer (setmaxnreg 40): walks the CTA's stream of tile pairs, decodes the jobs,
//     looks up the rows' page-table slots a pair ahead, prefetches the rows of the pair after next into
//     L2, loads each job's Q, and gathers every K tile (cp.async, 16 B pieces, keys past the end
//     zero-filled) into the stage blocks as soon as their readers release them. Per pair it writes a
//     descriptor (job, first / last pair, request, rows, each tile's keys) that the consumers read.
//   warpgroups 1 and 2, the consumers (setmaxnreg 232): v6's warpgroups 0 and 1, the seesaw over
//     the pair (tile A in stage 0, tile B in stage 1: S, softmax, P V; P through the stage's rope
//     block, the maxima and factors through a row array, named barriers of the 256 consumer threads
//     for those handoffs), with no copies of their own: they wait on "full" mbarriers and arrive on
//     "empty" ones.
//
// Barriers. full (stage, column block) [18], 128 producer arrivals (cp.async, once the thread's copies
// land), completing once per pair: a consumer waits on pair n with parity n & 1. empty (stage, group)
// [6], groups: blocks 0..3 (V_L), 4..7 (V_R), 8 (rope, then P); the last readers arrive (lane 0 of each
// reading warp) once their MMAs are done: stage 0 V_L consumer 0 after P_A V_AL, V_R consumer 1 after
// P_A V_AR (consumer 0's S_A is ordered before it by NB_SCALE_A), rope both; stage 1 V_L consumer 0
// after P_B V_BL (consumer 1's S_B before it by NB_PB), V_R consumer 1 after P_B V_BR, rope both. Counts
// 4, 4, 8. The producer's fill n of a group waits on its release n - 1 (parity (n & 1) ^ 1: a fresh
// barrier passes it at once). Q full (128 producer arrivals) and Q empty (8: every consumer warp once
// its S of the job's last pair is done), one phase per job. desc [4], a ring of pair descriptors, one
// producer arrival each: the producer writes descriptor n only after its fills of pair n - 1, which
// waited on the release of pair n - 2 by both consumers, who read descriptor n - 4 (the slot's
// previous one) into registers before that.
//
// Shared memory (1024-aligned base): v6's Q (9 blocks) | K stage 0 (9 blocks) | K stage 1 | rows (m,
// c_A, c_B, the two l of a job) | descriptors | mbarriers: 223,920 bytes with the alignment slack.
// No third stage fits (227 KB a block); the producer runs ahead by the column blocks released early.
// P is rounded to bf16 before P V; l: each consumer sums its own tiles' P (fp32), rescaled as its O
// is; the job's l is l_0 + l_1. Every reduction has a fixed order: bit-for-bit reproducible (not v6's
// bits: both consumers sum S over the blocks 0..8 in order, v6's second warpgroup over 4..7, 0..3, 8).
//
// The attend kernel needs sm_90a (wgmma, setmaxnreg); built for another target its body traps.
// kdlib-arch: sm_90a wgmma=tree_verify_v7_attend (tests/test_kernels_compile.py builds it so, checks the SASS)

#include "tree_verify/wgmma_common.cuh"

#define NTHREADS 384                           // producer + two consumer warpgroups
#define PRODUCER_REGS 40                       // setmaxnreg: 128 x 40 + 256 x 232 = 64512 <= 65536
#define CONSUMER_REGS 232
#define OFF_K0 TILE_BYTES
#define OFF_K1 (2 * TILE_BYTES)
#define OFF_ROWS (3 * TILE_BYTES)              // float [5][64]: m, c_A, c_B, l_0, l_1
#define NDESC 4                                // pair descriptors in the ring
#define DESC_INTS 12                           // job, flags, request, row0, rows, (tail, k0, kend) x 2, pad
#define OFF_DESC (OFF_ROWS + 5 * BM * 4)       // int [NDESC][DESC_INTS]
#define OFF_BARS (OFF_DESC + NDESC * DESC_INTS * 4)  // full[2][9], empty[2][3], Q full, Q empty, desc[4]
#define NBARS (2 * NCB + 6 + 2 + NDESC)
#define SMEM_BYTES (OFF_BARS + NBARS * 8 + 1024)  // + slack to align the base to 1024 B: 223920
#define V_R0 4                                 // consumer 1's V half: column blocks 4..7
#define D_FIRST 1                              // descriptor flags: the job's first pair,
#define D_LAST 2                               // its last pair,
#define D_END 4                                // the stream's last pair
// named barriers (0 is __syncthreads), the 256 consumer threads: one consumer arrives, the other waits
#define NB_SCALE_A 1  // consumer 0: m_A, c_A and P_A written
#define NB_SCALE_B 2  // consumer 1: m_B, c_B written
#define NB_PB 3       // consumer 1: P_B written
#define NB_LSUM 4     // both: their l of the job written

// TV7_RACECHECK=1 (-DTV7_RACECHECK=1): a checking build for compute-sanitizer racecheck. Every consumer
// handoff is a bar.sync of both consumers, and every lane of a releasing warp arrives on the empty
// barriers (their counts x 32): the forms racecheck sees as ordered (tools/racecheck_patterns.py). Slower,
// never the default, which keeps bar.arrive and one arrival a warp.
#ifndef TV7_RACECHECK
#define TV7_RACECHECK 0
#endif
#define WARP_ARRIVALS (TV7_RACECHECK ? 32 : 1)  // arrivals one releasing warp makes

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define BAR_EMPTY(bars, s, g) ((bars) + 8 * (2 * NCB + 3 * (s) + (g)))
#define BAR_QFULL(bars) ((bars) + 8 * (2 * NCB + 6))
#define BAR_QEMPTY(bars) ((bars) + 8 * (2 * NCB + 7))
#define BAR_DESC(bars, d) ((bars) + 8 * (2 * NCB + 8 + (d)))

// An arrive by lane 0 of the warp (predicated, no branch): one arrival per warp. The __syncwarp first
// orders the other lanes' shared-memory accesses (their P stores) before lane 0's release. The checking
// build: every lane arrives.
__device__ __forceinline__ void warp_arrive(unsigned bar, int lane) {
    __syncwarp();
    if (TV7_RACECHECK) {
        bar_arrive(bar);
        return;
    }
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 st;\nsetp.eq.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar),
        "r"(lane)
        : "memory");
}

// A consumer's handoff to the other on named barrier id: bar.arrive (bar.sync in the checking build).
__device__ __forceinline__ void handoff(int id) {
    if (TV7_RACECHECK) nb_sync(id);
    else nb_arrive(id);
}

// Stage s's fill for pair n: each group of blocks (V_L, V_R, rope) once its readers of pair n - 1 are
// done (their release n - 1 has parity (n & 1) ^ 1: a fresh barrier passes it at once), in release order.
__device__ __forceinline__ void fill_stage(unsigned kst, unsigned bars, int s, int n, const TileRows& t,
                                           const char* kvb, const char* tkb, int lrow, int ch) {
    const unsigned ep = (n & 1) ^ 1;
    bar_wait(BAR_EMPTY(bars, s, 0), ep);
    gather_half<0, V_R0>(kst, bars, s, t, kvb, tkb, lrow, ch);
    bar_wait(BAR_EMPTY(bars, s, 1), ep);
    gather_half<V_R0, ROPE_CB>(kst, bars, s, t, kvb, tkb, lrow, ch);
    bar_wait(BAR_EMPTY(bars, s, 2), ep);
    gather_half<ROPE_CB, NCB>(kst, bars, s, t, kvb, tkb, lrow, ch);
}

// Keys [k0, kend) and tail flag of tile `it` of jb; past the job's tiles: an empty tile.
__device__ __forceinline__ void pair_tile(const Job& jb, int it, int* d) {
    bool tail = false;
    int k0 = 0, kend = 0;
    if (it < jb.ntiles) tile_keys(jb, it, tail, k0, kend);
    d[0] = tail;
    d[1] = k0;
    d[2] = kend;
}

// One row of the pair at p into L2: thread pt takes row pt % 64 of the pair's tile pt / 64 (prefix rows only).
// p's job: cur (the job of the pair before p), or decoded from the plan where p is fresh (starts another).
__device__ __forceinline__ void prefetch_pair(const int* plan, int nreq, const int* page_table, const char* kvb,
                                              int P, Pos p, bool fresh, const Job& cur, int pt) {
    if (p.j < 0) return;
    const Job jb = fresh ? decode_job(plan, nreq, p.j) : cur;
    const int it = 2 * p.i + (pt >> 6);
    if (it >= jb.ntiles) return;
    bool tail;
    int k0, kend;
    tile_keys(jb, it, tail, k0, kend);
    const int key = k0 + (pt & 63);
    if (tail || key >= kend) return;
    prefetch_l2(kvb + (long long)page_table[(long long)jb.b * P + key] * (D_QK * 2), D_QK * 2);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ------------------------------------------------------------------------------------------ attend

// q [B, M, 576] bf16 (M = Q*H, row = q*H + h), kv [S, 576] bf16, page_table [B, P] int32,
// tree_kv [B, Q, 576] bf16 and vis [B, Q, Q] uint8 (both null for the prefix alone), plan ->
// parts [jobs, 64, 512] fp32, part_lse [jobs, 64] fp32 (rows past a job's valid rows unwritten).
// Grid G (one per SM), block 384, dynamic shared memory SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v7_attend(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    int nreq, int P, int Q, int H, float scale, float* __restrict__ parts, float* __restrict__ part_lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    if ((int)blockIdx.x >= plan_jobs(plan)) return;
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* gbase = smem_raw + (base - smem_u32(smem_raw));
    int* desc = reinterpret_cast<int*>(gbase + OFF_DESC);  // [NDESC][DESC_INTS]
    const unsigned bars = base + OFF_BARS;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < 2; ++s) {
            for (int c = 0; c < NCB; ++c) bar_init(BAR_CBFULL(bars, s, c), 128);
            bar_init(BAR_EMPTY(bars, s, 0), 4 * WARP_ARRIVALS);
            bar_init(BAR_EMPTY(bars, s, 1), 4 * WARP_ARRIVALS);
            bar_init(BAR_EMPTY(bars, s, 2), 8 * WARP_ARRIVALS);
        }
        bar_init(BAR_QFULL(bars), 128);
        bar_init(BAR_QEMPTY(bars), 8 * WARP_ARRIVALS);
        for (int d = 0; d < NDESC; ++d) bar_init(BAR_DESC(bars, d), 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int wg = tid >> 7, wt = tid & 127;
    const unsigned k0s = base + OFF_K0, k1s = base + OFF_K1;

    if (wg == 0) {
        // ------------------------------------------------------------------------------ producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        const char* kvb = reinterpret_cast<const char*>(kv);
        const char* tkb = reinterpret_cast<const char*>(tree_kv);
        const int lrow = wt >> 3, ch = wt & 7;  // gather: rows lrow + 16p, 16-byte chunk ch of each block
        // Each job is decoded from the plan twice (its first pair's prefetch, then as cur), not per pair:
        // decode_job is a binary search over the requests, a chain of dependent loads in the producer's path.
        Pos cur{(int)blockIdx.x, 0};
        Job jb = decode_job(plan, nreq, cur.j);  // cur's job
        TileRows ra = tile_rows(jb, page_table, P, Q, 0, lrow);  // the pair's tiles A and B
        TileRows rb = tile_rows(jb, page_table, P, Q, 1, lrow);
        bool fresh;  // nx starts another job
        Pos nx = pos_next(plan, jb, cur, fresh);
        prefetch_pair(plan, nreq, page_table, kvb, P, nx, fresh, jb, wt);
        int jobs = 0;  // Q loads so far
        for (int n = 0;; ++n) {
            if (cur.i == 0) {  // a new job: its Q once both consumers' S of the last job are done
                bar_wait(BAR_QEMPTY(bars), (jobs & 1) ^ 1);
                load_q(base, BAR_QFULL(bars), q, jb, Q * H, wt);
                ++jobs;
            }
            if (wt == 0) {
                int* d = desc + (n % NDESC) * DESC_INTS;
                d[0] = cur.j;
                d[1] = (cur.i == 0 ? D_FIRST : 0) | (nx.j < 0 || fresh ? D_LAST : 0) | (nx.j < 0 ? D_END : 0);
                d[2] = jb.b;
                d[3] = jb.row0;
                d[4] = jb.nrows;
                pair_tile(jb, 2 * cur.i, d + 5);
                pair_tile(jb, 2 * cur.i + 1, d + 8);
                bar_arrive(BAR_DESC(bars, n % NDESC));
            }
            fill_stage(k0s, bars, 0, n, ra, kvb, tkb, lrow, ch);  // stage 0 is released first
            fill_stage(k1s, bars, 1, n, rb, kvb, tkb, lrow, ch);
            if (nx.j < 0) break;
            if (fresh) jb = decode_job(plan, nreq, nx.j);
            cur = nx;  // the next pair's slots now, the rows of the one after it into L2
            ra = tile_rows(jb, page_table, P, Q, 2 * cur.i, lrow);
            rb = tile_rows(jb, page_table, P, Q, 2 * cur.i + 1, lrow);
            nx = pos_next(plan, jb, cur, fresh);
            prefetch_pair(plan, nreq, page_table, kvb, P, nx, fresh, jb, wt);
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
    } else {
        // ----------------------------------------------------------------------------- consumers
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
        float* rows = reinterpret_cast<float*>(gbase + OFF_ROWS);
        float* s_m = rows;            // running max after the last consumer's update
        float* s_ca = rows + BM;      // c_A
        float* s_cb = rows + 2 * BM;  // c_B
        float* s_l = rows + 3 * BM;   // [2][64]: l of each consumer at the job's end
        const int c = wg - 1, warp = wt >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
        const int lr0 = warp * 16 + g, lr1 = lr0 + 8;  // this thread's accumulator rows in the block
        const float sl2 = scale * LOG2E;
        const unsigned pa = k0s + ROPE_CB * CB_BYTES, pb = k1s + ROPE_CB * CB_BYTES;  // P_A, P_B
        const unsigned kst = c == 0 ? k0s : k1s;  // this consumer's tile: A (stage 0) or B (stage 1)

        float o[128];
        float s[32];
#pragma unroll
        for (int i = 0; i < 128; ++i) o[i] = 0.f;
        float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
        int jobs = 0;  // jobs started: the Q barrier's phase
        for (int n = 0;; ++n) {
            // the pair's descriptor, all of it into registers (the producer reuses the slot NDESC pairs on)
            bar_wait(BAR_DESC(bars, n % NDESC), (n / NDESC) & 1);
            const int* d = desc + (n % NDESC) * DESC_INTS;
            const int j = d[0], flags = d[1];
            Job jb;  // the fields mask_tile reads
            jb.b = d[2];
            jb.row0 = d[3];
            jb.nrows = d[4];
            const bool tail = d[5 + 3 * c] != 0;
            const int k0 = d[6 + 3 * c], kend = d[7 + 3 * c];
            const bool first = flags & D_FIRST, last = flags & D_LAST;

            // S of this consumer's tile, block by block as they land
            if (first) {
                bar_wait(BAR_QFULL(bars), jobs & 1);
                ++jobs;
            }
#pragma unroll
            for (int i = 0; i < 32; ++i) s[i] = 0.f;  // the accumulator starts afresh (its old value is dead)
            reg_fence(s);
            wg_fence();
            issue_s_blocks<0, NCB>(s, base, kst, bars, c, n & 1, true);
            wg_commit();
            wg_wait<0>();
            reg_fence(s);
            if (last) warp_arrive(BAR_QEMPTY(bars), lane);  // the job's Q is read

            float mx0, mx1;
            mask_tile(s, mx0, mx1, tail, k0, kend, vis, jb, Q, H, lr0, lr1, t4, sl2);
            if (c == 0) {
                // ------------------------------------------------ tile A: softmax, O_L += P_A V_AL
                float mn0, mn1, c0, c1;
                softmax_step(s, m0, m1, mx0, mx1, mn0, mn1, c0, c1, l0, l1);
                rescale(o, c0, c1);
                s_m[lr0] = mn0;  // the quad's four threads store the same values: no branch
                s_m[lr1] = mn1;
                s_ca[lr0] = c0;
                s_ca[lr1] = c1;
                store_p(s, pa, lr0, lr1, t4);
                fence_async_smem();
                handoff(NB_SCALE_A);
                reg_fence(o);
                wg_fence();
                issue_pv_ss(o, pa, k0s, first);
                wg_commit();
                wg_wait<0>();
                reg_fence(o);
                warp_arrive(BAR_EMPTY(bars, 0, 0), lane);  // stage 0: V_AL read, P_A read on this side
                warp_arrive(BAR_EMPTY(bars, 0, 2), lane);

                // ------------------------------------------------ tile B: O_L = O_L c_B + P_B V_BL
                nb_sync(NB_SCALE_B);
                const float cb0 = s_cb[lr0], cb1 = s_cb[lr1];
                m0 = s_m[lr0];
                m1 = s_m[lr1];
                l0 *= cb0;
                l1 *= cb1;
                rescale(o, cb0, cb1);
                nb_sync(NB_PB);
                fence_async_smem();
                reg_fence(o);
                wg_fence();
                issue_pv_ss(o, pb, k1s);
                wg_commit();
                wg_wait<0>();
                reg_fence(o);
                warp_arrive(BAR_EMPTY(bars, 1, 0), lane);  // stage 1: V_BL read, P_B read on this side
                warp_arrive(BAR_EMPTY(bars, 1, 2), lane);
            } else {
                // ------------------------------------------------ tile A: O_R = O_R c_A + P_A V_AR
                nb_sync(NB_SCALE_A);
                fence_async_smem();
                const float ma0 = s_m[lr0], ma1 = s_m[lr1], ca0 = s_ca[lr0], ca1 = s_ca[lr1];
                l0 *= ca0;
                l1 *= ca1;
                rescale(o, ca0, ca1);
                reg_fence(o);
                wg_fence();
                issue_pv_ss(o, pa, k0s + V_R0 * CB_BYTES, first);
                wg_commit();
                // ------------------------------------------------ tile B: softmax, O_R = O_R c_B + P_B V_BR
                float mn0, mn1, cb0, cb1;
                softmax_step(s, ma0, ma1, mx0, mx1, mn0, mn1, cb0, cb1, l0, l1);
                __syncwarp();    // the quad's reads of s_m / s_ca above come before its stores
                s_m[lr0] = mn0;  // under this consumer's MMAs: no branch
                s_m[lr1] = mn1;
                s_cb[lr0] = cb0;
                s_cb[lr1] = cb1;
                m0 = mn0;
                m1 = mn1;
                handoff(NB_SCALE_B);
                store_p(s, pb, lr0, lr1, t4);
                fence_async_smem();
                handoff(NB_PB);
                wg_wait<0>();
                reg_fence(o);
                warp_arrive(BAR_EMPTY(bars, 0, 1), lane);  // stage 0: V_AR read, P_A read on this side
                warp_arrive(BAR_EMPTY(bars, 0, 2), lane);
                rescale(o, cb0, cb1);
                reg_fence(o);
                wg_fence();
                issue_pv_ss(o, pb, k1s + V_R0 * CB_BYTES);
                wg_commit();
                wg_wait<0>();
                reg_fence(o);
                warp_arrive(BAR_EMPTY(bars, 1, 1), lane);  // stage 1: V_BR read, P_B read on this side
                warp_arrive(BAR_EMPTY(bars, 1, 2), lane);
            }

            if (last)  // the job's rows normalised; then a fresh accumulator
                job_end(o, m0, m1, l0, l1, s_l, NB_LSUM, c, parts, part_lse, j, [&] { return jb.nrows; }, lr0, lr1,
                        t4);
            if (flags & D_END) break;
        }
    }
#else
    __trap();  // built without sm_90a: no wgmma
#endif
}
