// tree_verify_v7: the whole tree-verify MLA attention (paged prefix + tree tail) on Hopper's
// warpgroup tensor cores, bf16 in, fp32 out: v5's plan and combine and v6's seesaw (both in
// tree_verify/wgmma_common.cuh) around an attend kernel with warp specialisation. Three launches, no
// host sync, fixed buffers (CUDA-graph capturable): tree_verify_v5_plan, tree_verify_v7_attend,
// tree_verify_v5_combine; jobs, partials and their merge as in v5. The producer's loop, the CTA's
// shared-memory layout and its barriers: tree_verify/wgmma_ws.cuh (version 9 runs the same producer).
//
// Why (data/results/ncu/tree_verify_v6_attend.8x65x200k.txt: issue slots mostly idle, few eligible
// warps): in v6 the two MMA warpgroups also gathered the K tiles, so a large share of their
// instructions were page-table lookups, cp.async of the scattered rows, address math and the job
// decode, and a stage was refilled only when its gathering warpgroup came to it in its own stream. Here a CTA is three warpgroups (384 threads):
//
//   warpgroup 0, the producer (setmaxnreg 40): walks the CTA's stream of tile pairs, decodes the jobs,
//     looks up the rows' page-table slots a pair ahead, loads each job's Q, and gathers every K tile
//     (cp.async, 16 B pieces, keys past the end zero-filled) into the stage blocks as soon as their
//     readers release them. Per pair it writes a descriptor (job, first / last pair, request, rows, each
//     tile's keys) that the consumers read. It prefetches nothing into L2: its prefetch of the pair after
//     next made the whole verify 2-18 % slower at every point measured, and at 8 heads x 1 query its attend
//     read 299 MB from DRAM for 231 MB of rows (data/results/kernel_ab_prefetch.h200.json).
//   warpgroups 1 and 2, the consumers (setmaxnreg 232): v6's warpgroups 0 and 1, the seesaw over
//     the pair (tile A in stage 0, tile B in stage 1: S, softmax, P V; P through the stage's rope
//     block, the maxima and factors through a row array, named barriers of the 256 consumer threads
//     for those handoffs), with no copies of their own: they wait on "full" mbarriers and arrive on
//     "empty" ones. Two operands come from registers (wgmma RS), not shared memory: P in each consumer's
//     P V of its own tile (the other's P from the rope block), and Q's rope block in S (bf16 builds). The
//     two together against the tree before them, two alternating runs, the same bits at all 25 points
//     (data/results/history/kernel_ab_regs{1,2}.f15a48b.h200.json): 0.9998-1.028x the whole verify at the
//     attention suite's six compute-bound points, median 1.012 and 1.015; the rope block alone
//     (kernel_ab_qonly*) moved those points no more than 8 x 1, whose kernel it leaves alone. Cutting 32 KB
//     of the 608 KB of shared-memory reads a pair that attention_timeline.pair_smem_bytes models bought
//     about 1 %: shared memory's bandwidth is not what bounds the pair (notebook 02b, 13k).
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

#include "tree_verify/wgmma_ws.cuh"

// ------------------------------------------------------------------------------------------ attend

// Version 7's attend kernel as it is (version 12's, tree_verify/wgmma_v12.cu, names its own policy).
struct NoMix {
    static constexpr bool on = false;
    static constexpr bool pairs = false;  // version 13's (tree_verify/wgmma_v13.cu): Mix::pair_end ends each job
};

// The attend kernel's body: the producer (ORDERED: version 10's, produce_v10; else the static round-robin) and
// v7's consumers. Mix (version 12's): its producer (Mix::produce), the CTAs with work (Mix::ctas), its barriers
// (Mix::init); the consumers then wait, before they write P into a stage's rope block, until the producer has read
// it (ROPE8), and arrive on QROPE once they hold a job's Q rope block in registers (the producer reuses it).
// Shared with version 10's ordered kernel (tree_verify/wgmma_v10.cu).
template <bool ORDERED, class Mix = NoMix>
__device__ __forceinline__ void attend_v7(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                                          const int* __restrict__ page_table,
                                          const __nv_bfloat16* __restrict__ tree_kv,
                                          const unsigned char* __restrict__ vis, const int* __restrict__ plan,
                                          const int* __restrict__ order, int nreq, int P, int Q, int H,
                                          float scale, float* __restrict__ parts, float* __restrict__ part_lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    pdl_wait();  // the plan kernel's writes (a launch with programmatic serialization)
    if constexpr (Mix::on) {
        if ((int)blockIdx.x >= Mix::ctas(plan, nreq)) return;
    } else if ((int)blockIdx.x >= plan_jobs(plan)) {
        return;
    }
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* gbase = smem_raw + (base - smem_u32(smem_raw));
    int* desc = reinterpret_cast<int*>(gbase + OFF_DESC);  // [NDESC][DESC_INTS]
    const unsigned bars = base + OFF_BARS;
    const int tid = threadIdx.x;
    if (tid == 0) {
        if constexpr (Mix::on) Mix::init(bars);
        init_bars(bars);
    }
    __syncthreads();

    const int wg = tid >> 7, wt = tid & 127;
    const unsigned k0s = base + OFF_K0, k1s = base + OFF_K1;

    if (wg == 0) {
        // ------------------------------------------------------------------------------ producer
        if constexpr (Mix::on)
            Mix::produce(base, gbase, desc, bars, q, kv, page_table, tree_kv, plan, nreq, P, Q, H, scale, vis,
                         parts, part_lse, wt);
        else if constexpr (ORDERED)
            produce_v10(base, desc, bars, q, kv, page_table, tree_kv, plan, order, nreq, P, Q, H, wt);
        else
            produce<false>(base, desc, bars, q, kv, page_table, tree_kv, plan, order, nreq, P, Q, H, wt);
    } else {
        // ----------------------------------------------------------------------------- consumers
        constexpr int NREG = Mix::on ? V12_CONSUMER_REGS : CONSUMER_NREG;
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(NREG));
        float* rows = reinterpret_cast<float*>(gbase + OFF_ROWS);
        float* s_m = rows;            // running max after the last consumer's update
        float* s_ca = rows + BM;      // c_A
        float* s_cb = rows + 2 * BM;  // c_B
        float* s_l = rows + 3 * BM;   // [2][64]: l of each consumer at the job's end
        const int c = wg - 1, warp = wt >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
        const int lr0 = warp * 16 + g, lr1 = lr0 + 8;  // this thread's accumulator rows in the block
        const float sl2 = scale * LOG2E;
        const unsigned pa = k0s + ROPE_CB * CB_BYTES, pb = k1s + ROPE_CB * CB_BYTES;  // P_A, P_B
        // this consumer's tile: A (stage 0) or B (stage 1), through lane 0 so that ptxas knows it warp-uniform and
        // builds S's K descriptors in uniform registers; selected by c, a per-thread value to it, each of S's 32
        // shared-memory wgmmas waited on two R2UR moves of its descriptor. The same bits, 1.004-1.035x the whole
        // verify at all 25 points of an A/B (data/results/history/kernel_ab_suni.314a8dd.h100-80gb-hbm3.json)
        const unsigned kst = __shfl_sync(0xffffffffu, c == 0 ? k0s : k1s, 0);

        float o[128];
        float s[32];
#pragma unroll
        for (int i = 0; i < 128; ++i) o[i] = 0.f;
        float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
        // the job's Q rope block, S's A operand over it from registers (q_rope_frags); not in the FP8 build, whose
        // consumers (FP8_CONSUMER_REGS) spilled 36 B with it
        constexpr bool QRS = !TV_FP8;
        unsigned qf[4][4];
        int jobs = 0;  // jobs started: the Q barrier's phase
        for (int n = 0;; ++n) {
            trace_mark(c, n, 0, wt);
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
            trace_put(c, n, TRACE_EVENTS, wt, j);
            trace_put(c, n, TRACE_EVENTS + 1, wt, flags);

            // S of this consumer's tile, block by block as they land
            if (first) {
                bar_wait(BAR_QFULL(bars), jobs & 1);
                ++jobs;
                if constexpr (QRS) q_rope_frags(base, qf, lr0, lr1, t4);
                if constexpr (Mix::on) warp_arrive(BAR_QROPE(bars), lane);
            }
            if (TV7_PROBE == 1) {  // the probe: both stages waited for, then released as the pair code does
                for (int cb = 0; cb < NCB; ++cb) {
                    bar_wait(BAR_CBFULL(bars, 0, cb), n & 1);
                    bar_wait(BAR_CBFULL(bars, 1, cb), n & 1);
                }
                if (last) warp_arrive(BAR_QEMPTY(bars), lane);
                for (int st = 0; st < 2; ++st) {
                    warp_arrive(BAR_EMPTY(bars, st, c), lane);
                    warp_arrive(BAR_EMPTY(bars, st, 2), lane);
                }
                if (flags & D_END) break;
                continue;
            }
#pragma unroll
            for (int i = 0; i < 32; ++i) s[i] = 0.f;  // the accumulator starts afresh (its old value is dead)
            reg_fence(s);
            wg_fence();
            if (TV7_PROBE == 4 || (TV7_PROBE >= 6 && c == 1))
                for (int cb = 0; cb < NCB; ++cb) bar_wait(BAR_CBFULL(bars, c, cb), n & 1);
            else
                issue_s_blocks<0, NCB>(s, base, TV7_PROBE == 5 ? k0s : kst, bars, c, n & 1, true, QRS ? qf : nullptr);
            if (TV7_PROBE == 7 && c == 0)  // the same products added again: S's cost past its start
                issue_s_blocks<0, NCB>(s, base, kst, bars, c, n & 1, false, QRS ? qf : nullptr);
            trace_mark(c, n, 1, wt);
            wg_commit();
            wg_wait<0>();
            reg_fence(s);
            if constexpr (QRS) reg_fence(qf);  // held to here: the rope block's wgmmas read them until the wait
            trace_mark(c, n, 2, wt);
            if (last) warp_arrive(BAR_QEMPTY(bars), lane);  // the job's Q is read

            float mx0, mx1;
            mask_tile(s, mx0, mx1, tail, k0, kend, vis, jb, Q, H, lr0, lr1, t4, sl2);
            if (c == 0) {
                // ------------------------------------------------ tile A: softmax, O_L += P_A V_AL
                float mn0, mn1, c0, c1;
                softmax_step(s, sl2, m0, m1, mx0, mx1, mn0, mn1, c0, c1, l0, l1);
                s_m[lr0] = mn0;  // the quad's four threads store the same values: no branch
                s_m[lr1] = mn1;
                s_ca[lr0] = c0;
                s_ca[lr1] = c1;
                unsigned pf[4][4];  // P_A: consumer 1 reads it from shared memory, this side from registers
                if constexpr (Mix::on) bar_wait(BAR_ROPE8(bars, 0), n & 1);  // the producer's S^T read the rope
                publish_p(s, pf, pa, NB_SCALE_A, lr0, lr1, t4);
                trace_mark(c, n, 3, wt);
                // O's rescale after the handoff, so consumer 1 goes on meanwhile: with the mask's fast path,
                // 1.096x and 1.112x 8e563a8 at 8 x 65 x 200k and 64 x 65 x 32k, the fast path alone 1.086x and
                // 1.097x (data/results/history/kernel_ab_mr.4b198bb.h200.json, kernel_ab_m.cd9f93c)
                reg_fence(o);
                rescale(o, c0, c1);
                // stage 0: V_AL read, the rope block's S_A and P_A done
                pv_own_tile(o, pf, k0s, first, bars, 0, 0, lane, c, n, 4, wt);

                nb_sync(NB_SCALE_B);
                trace_mark(c, n, 5, wt);
                const float cb0 = s_cb[lr0], cb1 = s_cb[lr1];  // c_B, from consumer 1
                m0 = s_m[lr0];
                m1 = s_m[lr1];
                // ------------------------------------------------ tile B: O_L = O_L c_B + P_B V_BL
                l0 *= cb0;
                l1 *= cb1;
                rescale(o, cb0, cb1);
                nb_sync(NB_PB);
                trace_mark(c, n, 6, wt);
                fence_async_smem();
                reg_fence(o);
                wg_fence();
                if (TV7_PROBE != 3) issue_pv_ss(o, pb, k1s);
                wg_commit();
                wg_wait<0>();
                reg_fence(o);
                trace_mark(c, n, 7, wt);
                warp_arrive(BAR_EMPTY(bars, 1, 0), lane);  // stage 1: V_BL read, P_B read on this side
                warp_arrive(BAR_EMPTY(bars, 1, 2), lane);
            } else {
                // ------------------------------------------------ tile A: O_R = O_R c_A + P_A V_AR
                nb_sync(NB_SCALE_A);
                trace_mark(c, n, 3, wt);
                fence_async_smem();
                const float ma0 = s_m[lr0], ma1 = s_m[lr1], ca0 = s_ca[lr0], ca1 = s_ca[lr1];
                l0 *= ca0;
                l1 *= ca1;
                rescale(o, ca0, ca1);
                reg_fence(o);
                wg_fence();
                if (TV7_PROBE != 3) issue_pv_ss(o, pa, k0s + V_R0 * CB_BYTES, first);
                wg_commit();
                // ------------------------------------------------ tile B: softmax, O_R = O_R c_B + P_B V_BR
                float mn0, mn1, cb0, cb1;
                softmax_step(s, sl2, ma0, ma1, mx0, mx1, mn0, mn1, cb0, cb1, l0, l1);
                __syncwarp();    // the quad's reads of s_m / s_ca above come before its stores
                s_m[lr0] = mn0;  // under this consumer's MMAs: no branch
                s_m[lr1] = mn1;
                s_cb[lr0] = cb0;
                s_cb[lr1] = cb1;
                m0 = mn0;
                m1 = mn1;
                handoff(NB_SCALE_B);
                trace_mark(c, n, 4, wt);
                unsigned pf[4][4];  // P_B: consumer 0 reads it from shared memory, this side from registers
                if constexpr (Mix::on) bar_wait(BAR_ROPE8(bars, 1), n & 1);
                publish_p(s, pf, pb, NB_PB, lr0, lr1, t4);
                trace_mark(c, n, 5, wt);
                wg_wait<0>();
                reg_fence(o);
                trace_mark(c, n, 6, wt);
                warp_arrive(BAR_EMPTY(bars, 0, 1), lane);  // stage 0: V_AR read, P_A read on this side
                warp_arrive(BAR_EMPTY(bars, 0, 2), lane);
                rescale(o, cb0, cb1);
                // stage 1: V_BR read, the rope block's S_B and P_B done
                pv_own_tile(o, pf, k1s + V_R0 * CB_BYTES, false, bars, 1, 1, lane, c, n, 7, wt);
            }

            if (last) {  // the job's rows normalised; then a fresh accumulator
                if constexpr (Mix::pairs)
                    Mix::pair_end(o, m0, m1, l0, l1, s_l, c, parts, part_lse, j, jb, lr0, lr1, t4, lane, gbase);
                else
                    job_end(o, m0, m1, l0, l1, s_l, NB_LSUM, c, parts, part_lse, j, [&] { return jb.nrows; }, lr0,
                            lr1, t4);
            }
            trace_mark(c, n, 8, wt);
            if (flags & D_END) break;
        }
    }
#else
    __trap();  // built without sm_90a: no wgmma
#endif
}

// q [B, M, 576] bf16 (M = Q*H, row = q*H + h), kv [S, 576] bf16, page_table [B, P] int32,
// tree_kv [B, Q, 576] bf16 and vis [B, Q, Q] uint8 (both null for the prefix alone), plan ->
// parts [jobs, 64, 512] fp32, part_lse [jobs, 64] fp32 (rows past a job's valid rows unwritten).
// Grid G (one per SM), block 384, dynamic shared memory SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v7_attend(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    int nreq, int P, int Q, int H, float scale, float* __restrict__ parts, float* __restrict__ part_lse) {
    attend_v7<false>(q, kv, page_table, tree_kv, vis, plan, nullptr, nreq, P, Q, H, scale, parts, part_lse);
}
