// tree_verify_v6: the whole tree-verify MLA attention (paged prefix + tree tail) on Hopper's
// warpgroup tensor cores, bf16 in, fp32 out: v5's plan and combine (tree_verify/wgmma_common.cuh) around
// a new attend kernel that keeps the tensor cores busy while softmax runs. Three launches, no host
// sync, fixed buffers (CUDA-graph capturable): tree_verify_v5_plan, tree_verify_v6_attend,
// tree_verify_v5_combine; jobs, partials and their merge as in v5.
//
// Why v5 idles (data/results/ncu/tree_verify_v5_attend.8x65x200k.txt: the tensor pipe mostly idle, no
// warp eligible in most cycles): one warpgroup ran all of S = Q K^T and the softmax between its MMAs, and
// a K stage was refilled only after both halves of P V had read all of it. Here the two warpgroups work
// in a seesaw over the tiles of a job taken two at a time (tile A in stage 0, tile B in stage 1):
//
//   warpgroup 0 holds O[:, 0:256] (O_L) and computes S_A = Q K_A^T; warpgroup 1 holds O[:, 256:512]
//   (O_R) and computes S_B = Q K_B^T. Per pair, with m the rows' running maximum (log2 domain):
//     wg 0: m_A = max(m, rowmax S_A), c_A = 2^(m - m_A), P_A = 2^(S_A - m_A); O_L = O_L c_A + P_A V_AL
//     wg 1: O_R = O_R c_A + P_A V_AR; m_B = max(m_A, rowmax S_B), c_B = 2^(m_A - m_B),
//           P_B = 2^(S_B - m_B); O_R = O_R c_B + P_B V_BR
//     wg 0: O_L = O_L c_B + P_B V_BL;  m = m_B
//   so one warpgroup's softmax runs under the other's MMAs. P_A and P_B (bf16) cross over through the
//   rope block of their own stage (dims 512..575, dead once S is done); the maxima and factors through
//   a row array; named barriers order the handoffs.
//   Each warpgroup gathers part of every K tile through the page table (cp.async, 16 B pieces, keys
//   past the end zero-filled) as soon as the last reader of that part is done: warpgroup 0 the column
//   blocks 0..3 of both tiles (what its P V reads) and the rope block of tile B (after its P_B V_BL),
//   warpgroup 1 the blocks 4..7 of both and the rope block of tile A (after both P_A V reads). One
//   mbarrier per (stage, column block): S of the next tile starts on the first blocks that land.
//   Row slots are looked up one pair ahead; the rows of the pair after next are prefetched into L2.
//
// Shared memory (1024-aligned base): Q (9 blocks) | K stage 0 (9 blocks) | K stage 1 | rows (m, c_A,
// c_B, the two l of a job) | mbarriers: 223,640 bytes with the alignment slack.
// l: each warpgroup sums its own tiles' P (fp32), rescaled as its O is; the job's l is l_0 + l_1.
// P is rounded to bf16 before P V. Every reduction has a fixed order: bit-for-bit reproducible.
//
// The attend kernel needs sm_90a (wgmma); built for another target its body traps.
// kdlib-arch: sm_90a wgmma=tree_verify_v6_attend (tests/test_kernels_compile.py builds it so, checks the SASS)

#include "tree_verify/wgmma_common.cuh"

#define NTHREADS 256
#define OFF_K0 TILE_BYTES
#define OFF_K1 (2 * TILE_BYTES)
#define OFF_ROWS (3 * TILE_BYTES)              // float [5][64]: m, c_A, c_B, l_0, l_1
#define OFF_BARS (OFF_ROWS + 5 * BM * 4)       // full[2][9], the Q barrier
#define SMEM_BYTES (OFF_BARS + 19 * 8 + 1024)  // + slack to align the base to 1024 B: 223640
#define WG1_CB0 4                              // warpgroup 1's column blocks: 4..7
// named barriers (0 is __syncthreads), 256 threads each: one warpgroup arrives, the other waits
#define NB_SCALE_A 1  // wg 0: m_A, c_A and P_A written
#define NB_SCALE_B 2  // wg 1: m_B, c_B written
#define NB_PB 3       // wg 1: P_B written
#define NB_PA_READ 4  // wg 0: its P_A V_AL done (stage 0's blocks 0..3 and P_A free on its side)
#define NB_LSUM 5     // both: their l of the job written

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define BAR_Q(bars) ((bars) + 8 * 2 * NCB)

// The tile's prefix rows into L2 (threads of chunk 0, four rows each), predicated rather than branched:
// it runs while this warpgroup's MMAs are in flight, where a divergent branch would serialise them.
__device__ __forceinline__ void prefetch_tile(const TileRows& t, bool on_wg, const char* kvb, int lrow, int ch) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int on = on_wg && !t.tail && ch == 0 && (t.valid >> p) & 1;
        asm volatile(
            "{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n"
            "@q cp.async.bulk.prefetch.L2.global [%0], %1;\n}\n" ::"l"(kvb + (long long)t.row[p] * (D_QK * 2)),
            "r"(D_QK * 2), "r"(on)
            : "memory");
    }
}

// S = Q K^T of this warpgroup's tile: warpgroup 0 over stage 0 in block order, warpgroup 1 over stage 1
// from its own blocks (4..7, refilled first), then 0..3 and 8.
__device__ __forceinline__ void issue_s(float (&s)[32], unsigned base, unsigned bars, int wg, unsigned par) {
    if (wg == 0) {
        issue_s_blocks<0, NCB>(s, base, base + TILE_BYTES, bars, 0, par, true);
    } else {
        const unsigned k1s = base + 2 * TILE_BYTES;
        issue_s_blocks<WG1_CB0, ROPE_CB>(s, base, k1s, bars, 1, par, true);
        issue_s_blocks<0, WG1_CB0>(s, base, k1s, bars, 1, par, false);
        issue_s_blocks<ROPE_CB, NCB>(s, base, k1s, bars, 1, par, false);
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ------------------------------------------------------------------------------------------ attend

// q [B, M, 576] bf16 (M = Q*H, row = q*H + h), kv [S, 576] bf16, page_table [B, P] int32,
// tree_kv [B, Q, 576] bf16 and vis [B, Q, Q] uint8 (both null for the prefix alone), plan ->
// parts [jobs, 64, 512] fp32, part_lse [jobs, 64] fp32 (rows past a job's valid rows unwritten).
// Grid G (one per SM), block 256, dynamic shared memory SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v6_attend(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    int nreq, int P, int Q, int H, float scale, float* __restrict__ parts, float* __restrict__ part_lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    if ((int)blockIdx.x >= plan_jobs(plan)) return;
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    float* rows = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)) + OFF_ROWS);
    float* s_m = rows;            // running max after the last warpgroup's update
    float* s_ca = rows + BM;      // c_A
    float* s_cb = rows + 2 * BM;  // c_B
    float* s_l = rows + 3 * BM;   // [2][64]: l of each warpgroup at the job's end
    const unsigned bars = base + OFF_BARS;
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int i = 0; i < 2 * NCB + 1; ++i) bar_init(bars + 8 * i, 128);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int wg = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int lr0 = warp * 16 + g, lr1 = lr0 + 8;  // this thread's accumulator rows in the block
    const int lrow = wt >> 3, ch = wt & 7;         // gather: rows lrow + 16p, 16-byte chunk ch of each block
    const int M = Q * H;
    const float sl2 = scale * LOG2E;
    const char* kvb = reinterpret_cast<const char*>(kv);
    const char* tkb = reinterpret_cast<const char*>(tree_kv);
    const unsigned k0s = base + OFF_K0, k1s = base + OFF_K1;
    const unsigned pa = k0s + ROPE_CB * CB_BYTES, pb = k1s + ROPE_CB * CB_BYTES;  // P_A, P_B

    float o[128];
    float s[32];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    // prologue: Q and the first pair; the sources of the second
    Pos cur{(int)blockIdx.x, 0};
    if (wg == 0) load_q(base, BAR_Q(bars), q, decode_job(plan, nreq, cur.j), M, wt);
    {
        const TileRows ta = tile_rows(plan, nreq, page_table, P, Q, cur.j, 0, lrow);
        const TileRows tb = tile_rows(plan, nreq, page_table, P, Q, cur.j, 1, lrow);
        if (wg == 0) {
            gather_half<0, WG1_CB0>(k0s, bars, 0, ta, kvb, tkb, lrow, ch);
            gather_half<0, WG1_CB0>(k1s, bars, 1, tb, kvb, tkb, lrow, ch);
            gather_half<ROPE_CB, NCB>(k1s, bars, 1, tb, kvb, tkb, lrow, ch);
        } else {
            gather_half<WG1_CB0, NCB>(k0s, bars, 0, ta, kvb, tkb, lrow, ch);
            gather_half<WG1_CB0, ROPE_CB>(k1s, bars, 1, tb, kvb, tkb, lrow, ch);
        }
    }
    bool fresh;
    Pos nx = pos_next(plan, nreq, cur, fresh);
    bool nx_fresh = fresh;
    TileRows na{}, nb{};  // the next pair's tiles A and B
    if (nx.j >= 0) {
        na = tile_rows(plan, nreq, page_table, P, Q, nx.j, 2 * nx.i, lrow);
        nb = tile_rows(plan, nreq, page_table, P, Q, nx.j, 2 * nx.i + 1, lrow);
    }
    int qphase = 0;  // jobs started - 1: the Q barrier's phase
    bar_wait(BAR_Q(bars), 0);
    fence_async_smem();
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    reg_fence(s);
    wg_fence();
    issue_s(s, base, bars, wg, 0);
    wg_commit();
    prefetch_tile(na, wg == 0, kvb, lrow, ch);  // tile A by warpgroup 0, B by 1
    prefetch_tile(nb, wg == 1, kvb, lrow, ch);
    wg_wait<0>();
    reg_fence(s);

    for (int n = 0;; ++n) {
        const bool more = nx.j >= 0;          // a next pair exists
        const bool last = !more || nx_fresh;  // this pair ends its job
        const unsigned par = (n + 1) & 1;     // parity of the next pair's stage fills
        bool tail = false;
        int k0 = 0, kend = 0;
        float mx0, mx1;
        if (wg == 0) {
            // ------------------------------------------------ tile A: softmax, O_L += P_A V_AL
            const Job jb = decode_job(plan, nreq, cur.j);  // decoded where needed: fewer live registers
            if (2 * cur.i < jb.ntiles) tile_keys(jb, 2 * cur.i, tail, k0, kend);
            mask_tile(s, mx0, mx1, tail, k0, kend, vis, jb, Q, H, lr0, lr1, t4, sl2);
            float mn0, mn1, c0, c1;
            softmax_step(s, sl2, m0, m1, mx0, mx1, mn0, mn1, c0, c1, l0, l1);
            rescale(o, c0, c1);
            s_m[lr0] = mn0;  // the quad's four threads store the same values: no branch
            s_m[lr1] = mn1;
            s_ca[lr0] = c0;
            s_ca[lr1] = c1;
            store_p(s, pa, lr0, lr1, t4);
            fence_async_smem();
            nb_arrive(NB_SCALE_A);
            reg_fence(o);
            wg_fence();
            issue_pv_ss(o, pa, k0s, cur.i == 0);
            wg_commit();
            wg_wait<0>();
            reg_fence(o);
            nb_arrive(NB_PA_READ);
            if (more) gather_half<0, WG1_CB0>(k0s, bars, 0, na, kvb, tkb, lrow, ch);  // next tile A, blocks 0..3

            // ------------------------------------------------ tile B: O_L = O_L c_B + P_B V_BL
            nb_sync(NB_SCALE_B);
            const float cb0 = s_cb[lr0], cb1 = s_cb[lr1];
            m0 = s_m[lr0];
            m1 = s_m[lr1];
            if (more && nx_fresh)  // both S of this pair are done: the next job's Q
                load_q(base, BAR_Q(bars), q, decode_job(plan, nreq, nx.j), M, wt);
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
            if (more) {  // next tile B, blocks 0..3 and the rope block (P_B is read)
                gather_half<0, WG1_CB0>(k1s, bars, 1, nb, kvb, tkb, lrow, ch);
                gather_half<ROPE_CB, NCB>(k1s, bars, 1, nb, kvb, tkb, lrow, ch);
            }
        } else {
            // ------------------------------------------------ tile A: O_R = O_R c_A + P_A V_AR
            const Job jb = decode_job(plan, nreq, cur.j);
            if (2 * cur.i + 1 < jb.ntiles) tile_keys(jb, 2 * cur.i + 1, tail, k0, kend);
            mask_tile(s, mx0, mx1, tail, k0, kend, vis, jb, Q, H, lr0, lr1, t4, sl2);
            nb_sync(NB_SCALE_A);
            fence_async_smem();
            const float ma0 = s_m[lr0], ma1 = s_m[lr1], ca0 = s_ca[lr0], ca1 = s_ca[lr1];
            l0 *= ca0;
            l1 *= ca1;
            rescale(o, ca0, ca1);
            reg_fence(o);
            wg_fence();
            issue_pv_ss(o, pa, k0s + WG1_CB0 * CB_BYTES, cur.i == 0);
            wg_commit();
            // ------------------------------------------------ tile B: softmax, O_R = O_R c_B + P_B V_BR
            float mn0, mn1, cb0, cb1;
            softmax_step(s, sl2, ma0, ma1, mx0, mx1, mn0, mn1, cb0, cb1, l0, l1);
            s_m[lr0] = mn0;  // under this warpgroup's MMAs: no branch (see prefetch_tile)
            s_m[lr1] = mn1;
            s_cb[lr0] = cb0;
            s_cb[lr1] = cb1;
            m0 = mn0;
            m1 = mn1;
            nb_arrive(NB_SCALE_B);
            store_p(s, pb, lr0, lr1, t4);
            fence_async_smem();
            nb_arrive(NB_PB);
            wg_wait<0>();
            reg_fence(o);
            rescale(o, cb0, cb1);
            reg_fence(o);
            wg_fence();
            issue_pv_ss(o, pb, k1s + WG1_CB0 * CB_BYTES);
            wg_commit();
            nb_sync(NB_PA_READ);  // next tile A, blocks 4..8, once warpgroup 0 has read P_A too
            gather_half<WG1_CB0, NCB>(k0s, bars, 0, na, kvb, tkb, lrow, ch);  // no next pair: empty, no branch
            wg_wait<0>();
            reg_fence(o);
            if (more) gather_half<WG1_CB0, ROPE_CB>(k1s, bars, 1, nb, kvb, tkb, lrow, ch);  // next tile B, 4..7
        }

        if (last) {  // the job's l = l_0 + l_1, its rows normalised; then a fresh accumulator
#pragma unroll
            for (int off = 1; off < 4; off <<= 1) {
                l0 += __shfl_xor_sync(0xffffffffu, l0, off);
                l1 += __shfl_xor_sync(0xffffffffu, l1, off);
            }
            if (t4 == 0) {
                s_l[wg * BM + lr0] = l0;
                s_l[wg * BM + lr1] = l1;
            }
            nb_sync(NB_LSUM);
            const float lt0 = s_l[lr0] + s_l[BM + lr0], lt1 = s_l[lr1] + s_l[BM + lr1];
            const float i0 = lt0 > 0.f ? 1.f / lt0 : 0.f, i1 = lt1 > 0.f ? 1.f / lt1 : 0.f;
            write_out(o, parts, part_lse, cur.j, wg * 256, decode_job(plan, nreq, cur.j).nrows, lr0, lr1, t4, i0, i1,
                      lt0 > 0.f ? (m0 + log2f(lt0)) * LN2 : NEG_INF, lt1 > 0.f ? (m1 + log2f(lt1)) * LN2 : NEG_INF,
                      wg == 0);
            m0 = m1 = NEG_INF;  // o is overwritten by the next job's first P V
            l0 = l1 = 0.f;
        }
        if (!more) break;

        // the next pair: its sources were looked up a pair ago; look up the one after it
        cur = nx;
        if (nx_fresh) ++qphase;
        nx = pos_next(plan, nreq, cur, fresh);
        nx_fresh = fresh;
        na = nb = TileRows{};  // past the stream's end: empty tiles
        if (nx.j >= 0) {
            na = tile_rows(plan, nreq, page_table, P, Q, nx.j, 2 * nx.i, lrow);
            nb = tile_rows(plan, nreq, page_table, P, Q, nx.j, 2 * nx.i + 1, lrow);
        }
        // S of the new pair: warpgroup 0 over K_A, warpgroup 1 over K_B
        if (cur.i == 0) {  // a new job: its Q
            bar_wait(BAR_Q(bars), qphase & 1);
            fence_async_smem();
        }
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;  // the accumulator starts afresh (its old value is dead)
        reg_fence(s);
        wg_fence();
        issue_s(s, base, bars, wg, par);
        wg_commit();
        wg_wait<0>();
        reg_fence(s);
        prefetch_tile(na, wg == 0, kvb, lrow, ch);  // tile A by warpgroup 0, B by 1
        prefetch_tile(nb, wg == 1, kvb, lrow, ch);  // the lookups have landed by now
    }
#else
    __trap();  // built without sm_90a: no wgmma
#endif
}
