// tree_verify_v12: version 10's whole verify where a request has 65 to 72 query rows (8 heads x 9 queries), its
// attend kernel taking each key chunk's rows in one pass: rows 0-63 in version 7's consumers, the rest (at most
// 8) in the producer warpgroup as version 9's transposed products. Three launches, no host sync, fixed buffers
// (CUDA-graph capturable): tree_verify_v5_plan (over twice the CTAs: kdlib.cuda.attention.v12_plan_grid),
// tree_verify_v12_attend, tree_verify_v8_combine_w<W> (or _rows); kdlib.cuda.attention runs version 10 at every
// other shape.
//
// Why (notebook 02b, 13s-13v): versions 7-10 run 72 rows as two 64-row jobs a key chunk, so every key tile is
// multiplied twice with the rows padded to 128; version 11 took the 72 rows transposed (none padded) in one pass
// split over two CTAs, and its consumers' per-row code, 18 rows a thread, made it three times slower. Here the
// first 64 rows keep version 7's code and the other 8 take the transposed products at N = 8, version 9's
// shortest loop, in the warpgroup that has time to spare: the producer (13t: a third of its samples wait for
// the consumers' releases).
//
// The producer (setmaxnreg V12_PRODUCER_REGS) gathers each pair as version 7's does (but reading each tile's
// page-table slots as it fills it, prefetched a pair ahead: prefetch_slots), then, once the pair has landed (its
// own copies), over the request's rows 64 .. 64 + r8 - 1 (Q8, their 576 dims, zero past r8):
//   S8^T [64 keys x 8 rows] = K Q8^T for both tiles (wgmma m64n8k16, A the stage, B Q8), the rope blocks'
//     products first: once they are done it arrives on ROPE8 of both stages, and consumer c waits on ROPE8 [c]
//     before it writes its P into its stage's rope block (the producer arrives on it every pair, also where a
//     group has no such rows);
//   per tile, A then B: version 9's masks and row maxima over its 4 warps, the online softmax, P8^T (bf16),
//     O8^T [512 dims x 8 rows] += V^T P8^T over the stage's eight V blocks;
//   at the group's end its rows normalised into parts [j + 1] (the group's second job) with their lse.
// Its reads of a stage end before its next fill of it (the same threads, in order), so the stages' empty
// barriers count the consumers alone, as in version 7.
//
// Jobs: version 11's groups (a request's key chunk with its one or two row-block jobs j, j + 1), CTA c taking
// groups c, c + G, ... (the static round-robin); the consumers see job j (rows 0-63) in the pair descriptors and
// run as version 7's. v8's combine reads parts [j + 1] as it reads version 10's.
//
// Shared memory: version 7's layout, its barriers then QROPE and ROPE8 [2]; Q8's eight latent blocks (8 rows x
// 128 B each, 128-B swizzle) past them, to 227 KB. Q's rope block, which the bf16 build's consumers hold in
// registers once read (q_rope_frags; they arrive on QROPE), then holds Q8's rope block, P8^T and the rows'
// arrays: the producer writes there only after QROPE, and its next load of Q comes after its own last reads.
//
// tools/barrier_model.py runs this protocol (version 7's and these barriers) as a model under random schedules:
// no deadlock, no wait two phases behind its barrier.
//
// The attend kernel needs sm_90a (wgmma, setmaxnreg); built for another target its body traps.
// kdlib-arch: sm_90a wgmma=tree_verify_v7_attend,tree_verify_v9_attend,tree_verify_v11_attend,tree_verify_v12_attend

#include "tree_verify/wgmma_v11.cu"

#define V12_NR 8                                        // the producer's rows: past 64, at most 8 (N of its wgmma)
#define V12_MB (D_V / 64)                               // its O8^T's dim blocks: all 512 dims
#define V12_QB (V12_NR * 128)                           // one column block of Q8, or P8^T: 1024 B
#define V12_OFF_Q8 ((OFF_BARS + (NBARS + 3) * 8 + 1023) / 1024 * 1024)  // Q8's latent blocks [8][8 rows]
#define V12_SMEM (V12_OFF_Q8 + ROPE_CB * V12_QB + 1024)  // + slack to align the base to 1024 B: 232448
#define V12_OFF_R8 (ROPE_CB * CB_BYTES)                 // in Q's rope block: Q8's rope block,
#define V12_OFF_PT8 (V12_OFF_R8 + V12_QB)               // P8^T,
#define V12_OFF_ROWS8 (V12_OFF_PT8 + V12_QB)            // the rows' arrays (init_ctx's, RS = V12_NR)
#define NB_P8 NB_WG                                     // the producer's 128 threads (v7's consumers use 1-4)
static_assert(V12_SMEM <= 227 * 1024, "the most shared memory a block may take");
static_assert(V12_OFF_ROWS8 + 20 * V12_NR * 4 <= OFF_K0, "the producer's rows within Q's rope block");
static_assert(V11_NR == BM + V12_NR, "a group's rows: one block of 64 and the producer's");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Q8's column blocks [cb0, cb0 + ncb) of job jb8 (rows jb8.row0 .. + nrows - 1; past them zero) into dst, block i's
// 8 rows of 128 B at dst + i V12_QB (128-B swizzle), by cp.async: thread wt copies chunk wt % 8 of row wt / 8 % 8
// of blocks wt / 64, wt / 64 + 2, ...
__device__ __forceinline__ void copy_q8(unsigned dst, const __nv_bfloat16* q, const Job& jb8, int M, int wt, int cb0,
                                        int ncb) {
    const int r = (wt >> 3) & 7, c = wt & 7;
    const bool ok = r < jb8.nrows;
    const char* src = reinterpret_cast<const char*>(q + ((long long)jb8.b * M + jb8.row0 + (ok ? r : 0)) * D_QK);
    for (int i = wt >> 6; i < ncb; i += 2)
        cp_async16(dst + i * V12_QB + r * 128 + ((c ^ r) << 4), src + (cb0 + i) * 128 + c * 16, ok ? 16 : 0);
}

// The producer's rows of jb's group (jb: the group's first job), rows 64 .. 64 + r8 - 1 of the request: r8
// (<= 0: none).
__device__ __forceinline__ int rows8_of(const int* plan, const Job& jb) {
    return plan[PLAN_HDR + jb.b * PLAN_STRIDE + P_ROWS] - BM;
}

// Tiles it, it + 1 of job jb (a pair): their page-table slots towards L1, threads wt < 5 a 128-B line each (the
// pair's 128 slots, 512 B, at any alignment), no registers held past it. Version 7's producer looks the slots up a
// pair ahead and holds them; this one holds the 8 rows' O^T (with the slots too it spills), so it reads them as
// it fills and prefetches them a pair ahead. Tree-key tiles read no slots.
__device__ __forceinline__ void prefetch_slots(const Job& jb, const int* page_table, int P, int it, int wt) {
    bool tail = true;
    int k0 = 0, kend = 0;
    if (it < jb.ntiles) tile_keys(jb, it, tail, k0, kend);
    if (wt >= 5 || tail) return;
    const int* a = page_table + (long long)jb.b * P + min(k0 + 32 * wt, kend - 1);
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(a));
}

// Job jb's tiles over rows 64 .. 64 + r8 - 1.
__device__ __forceinline__ Job job8(Job jb, int r8) {
    jb.row0 = BM;
    jb.nrows = r8;
    return jb;
}

// Tile it of the producer's rows (s: its S^T; the V blocks in the stage at vst): the masks and row maxima, the
// online softmax, P8^T, then O8^T (+)= V^T P8^T (fresh: the group's first, which overwrites O8^T).
__device__ __forceinline__ void tile8(float (&o)[V12_MB * V12_NR / 2], float (&s)[V12_NR / 2], float (&m)[2],
                                      float (&l)[2], const Job& jb8, int it, unsigned vst, bool fresh,
                                      const unsigned char* vis, int Q, int H, const V9Ctx& x) {
    bool tail = false;
    int k0 = 0, kend = 0;  // past the job's tiles: an empty tile
    if (it < jb8.ntiles) tile_keys(jb8, it, tail, k0, kend);
    float mx[2], mn[2], cf[2];
    mask_max_t<V12_NR, V12_NR, true>(s, mx, tail, k0, kend, vis, jb8, Q, H, x);
    softmax_t<V12_NR>(s, x.sl2, m, mx, mn, cf, l);
    m[0] = mn[0];
    m[1] = mn[1];
    rescale_t<V12_NR, V12_MB>(o, cf);
    store_pt<V12_NR>(s, opaque(x.base + V12_OFF_PT8), x);
    fence_async_smem();
    wg_sync(NB_P8);  // P8^T whole for every warp's MMAs; the row maxima read
    reg_fence_n<V12_MB * V12_NR / 2>(o);
    wg_fence();
    issue_pv_t<V12_NR, V12_MB>(o, x.base + V12_OFF_PT8, vst, fresh);
    wg_commit();
    wg_wait<0>();
    reg_fence_n<V12_MB * V12_NR / 2>(o);
    wg_sync(NB_P8);  // every warp's MMAs done: P8^T free for the next tile
}

// S8^T (s) of stage st's tile for pair parity par, once its blocks land (the full barriers the consumers wait on
// too): the rope block's products first, then ROPE8 [st] once they are done (the consumer may put its P there),
// then the latent blocks' (left in flight).
__device__ __forceinline__ void issue_s8(float (&s)[V12_NR / 2], unsigned kst, int st, unsigned par, const V9Ctx& x) {
    for (int cb = 0; cb < NCB; ++cb) bar_wait(BAR_CBFULL(x.bars, st, cb), par);
    fence_async_smem();
    const unsigned long long dk = sw128_desc(opaque(kst), 16), q8 = sw128_desc(opaque(x.base + V12_OFF_Q8), 16);
    const unsigned long long r8 = sw128_desc(opaque(x.base + V12_OFF_R8), 16);
    wg_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
        wgmma_n<V12_NR, 0>(s, dk + ((ROPE_CB * CB_BYTES + k * 32) >> 4), r8 + ((k * 32) >> 4), k > 0);
    wg_commit();
#pragma unroll
    for (int cb = 0; cb < ROPE_CB; ++cb)
#pragma unroll
        for (int k = 0; k < 4; ++k)
            wgmma_n<V12_NR, 0>(s, dk + ((cb * CB_BYTES + k * 32) >> 4), q8 + ((cb * V12_QB + k * 32) >> 4), 1);
    wg_commit();
    wg_wait<1>();
    warp_arrive(BAR_ROPE8(x.bars, st), x.lane);
}

// The producer's rows over pair n, pair i of the group (tiles 2i, 2i + 1 in stages 0, 1): S8^T of both tiles
// (issue_s8, stage 0's first: consumer 0 waits for its ROPE8 while stage 1 may still be landing), then tile8
// of each. The group's first pair (i 0) first waits for Q8's copies (with all of this warpgroup's).
__device__ __forceinline__ void pair8(float (&o)[V12_MB * V12_NR / 2], float (&m)[2], float (&l)[2], const Job& jb8,
                                      int n, int i, const unsigned char* vis, int Q, int H, const V9Ctx& x) {
    if (i == 0) {
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        wg_sync(NB_P8);  // every producer thread's copies landed
    }
    float sa[V12_NR / 2], sb[V12_NR / 2];
    issue_s8(sa, x.k0s, 0, n & 1, x);
    issue_s8(sb, x.k1s, 1, n & 1, x);
    wg_wait<0>();
    reg_fence_n<V12_NR / 2>(sa);
    reg_fence_n<V12_NR / 2>(sb);
    tile8(o, sa, m, l, jb8, 2 * i, x.k0s, i == 0, vis, Q, H, x);
    tile8(o, sb, m, l, jb8, 2 * i + 1, x.k1s, false, vis, Q, H, x);
}

// The producer warpgroup (wt: its thread) over the CTA's groups: version 7's gathers, Q and descriptors (the
// consumers' job: the group's first), then the group's rows past 64 (pair8), written at the group's end.
__device__ __forceinline__ void produce_v12(unsigned base, unsigned char* gbase, int* desc, unsigned bars,
                                            const __nv_bfloat16* q, const __nv_bfloat16* kv, const int* page_table,
                                            const __nv_bfloat16* tree_kv, const int* plan, int nreq, int P, int Q,
                                            int H, float scale, const unsigned char* vis, float* parts,
                                            float* part_lse, int wt) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(V12_PRODUCER_REGS));
    const unsigned k0s = base + OFF_K0, k1s = base + OFF_K1;
    const char* kvb = reinterpret_cast<const char*>(kv);
    const char* tkb = reinterpret_cast<const char*>(tree_kv);
    const int lrow = wt >> 3, ch = wt & 7;
    V9Ctx x;
    init_ctx<V12_NR>(x, base, k0s, k1s, bars, reinterpret_cast<float*>(gbase + V12_OFF_ROWS8), wt, 1, wt, scale);
    const int ngroups = plan_groups(plan, nreq);
    int g = (int)blockIdx.x;
    auto next = [&] {
        g += (int)gridDim.x;
        return g < ngroups ? group_job(plan, nreq, g) : -1;
    };
    Pos cur{group_job(plan, nreq, g), 0};
    Job jb = decode_job(plan, nreq, cur.j);
    int r8 = rows8_of(plan, jb);
    bool fresh;
    Pos nx = pos_after(jb, cur, fresh, next);
    float o[V12_MB * V12_NR / 2];  // O8^T: dims 64 mb + 16 warp + g (+8), rows 2 t4 (+1)
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < V12_MB * V12_NR / 2; ++i) o[i] = 0.f;
    int groups = 0;        // Q loads so far
    for (int n = 0;; ++n) {
        if (cur.i == 0) {  // a new group: its Q once both consumers' S of the last one are done
            bar_wait(BAR_QEMPTY(bars), (groups & 1) ^ 1);
            load_q(base, BAR_QFULL(bars), q, jb, Q * H, opaque(wt));
            if (r8 > 0) copy_q8(opaque(base + V12_OFF_Q8), q, job8(jb, r8), Q * H, opaque(wt), 0, ROPE_CB);
            ++groups;
        }
        if (wt == 0) put_desc(desc, bars, n, jb, cur, nx, fresh);
        // each stage's rows as it is filled (fewer registers live across the pair than version 7's producer)
        fill_stage(k0s, bars, 0, n, tile_rows(jb, page_table, P, Q, 2 * cur.i, lrow), kvb, tkb, lrow, ch, 0);
        fill_stage(k1s, bars, 1, n, tile_rows(jb, page_table, P, Q, 2 * cur.i + 1, lrow), kvb, tkb, lrow, ch, 0);
        if (nx.j >= 0 && !fresh) prefetch_slots(jb, page_table, P, 2 * nx.i, wt);  // the next pair's, this job's
        if (r8 > 0) {
            if (cur.i == 0) {  // Q's rope block in the consumers' registers: Q8's rope block there
                bar_wait(BAR_QROPE(bars), (groups - 1) & 1);
                copy_q8(base + V12_OFF_R8, q, job8(jb, r8), Q * H, opaque(wt), ROPE_CB, 1);
            }
            pair8(o, m, l, job8(jb, r8), n, cur.i, vis, Q, H, x);
            if (nx.j < 0 || fresh) {
                job_end_t<V12_NR, V12_NR, V12_MB, 4>(o, m, l, cur.j + 1, r8, parts, part_lse, x, 0, true);
                wg_sync(NB_P8);  // every thread's reads of the rows' sums done: the next Q lands on them
            }
        } else {  // no rows of the producer's: the rope blocks are the consumers'
            warp_arrive(BAR_ROPE8(bars, 0), x.lane);
            warp_arrive(BAR_ROPE8(bars, 1), x.lane);
        }
        if (nx.j < 0) break;
        if (fresh) {
            jb = decode_job(plan, nreq, nx.j);
            r8 = rows8_of(plan, jb);
        }
        cur = nx;
        nx = pos_after(jb, cur, fresh, next);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
}

// attend_v7's policy for version 12 (tree_verify/wgmma_v7.cu): this producer, a CTA per group, the barriers.
struct V12Mix {
    static constexpr bool on = true;
    static constexpr bool pairs = false;
    static __device__ __forceinline__ int ctas(const int* plan, int nreq) {
        return plan_jobs(plan) > 0 ? plan_groups(plan, nreq) : 0;  // (a plan of no jobs: none)
    }
    static __device__ __forceinline__ void init(unsigned bars) {  // init_bars' fence follows
        bar_init(BAR_QROPE(bars), 8 * WARP_ARRIVALS);
        bar_init(BAR_ROPE8(bars, 0), 4 * WARP_ARRIVALS);
        bar_init(BAR_ROPE8(bars, 1), 4 * WARP_ARRIVALS);
    }
    static __device__ __forceinline__ void produce(unsigned base, unsigned char* gbase, int* desc, unsigned bars,
                                                   const __nv_bfloat16* q, const __nv_bfloat16* kv,
                                                   const int* page_table, const __nv_bfloat16* tree_kv,
                                                   const int* plan, int nreq, int P, int Q, int H, float scale,
                                                   const unsigned char* vis, float* parts, float* part_lse, int wt) {
        produce_v12(base, gbase, desc, bars, q, kv, page_table, tree_kv, plan, nreq, P, Q, H, scale, vis, parts,
                    part_lse, wt);
    }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Arguments and outputs as tree_verify_v7_attend (plan: tree_verify_v5_plan's, every request at most V11_NR rows).
// Grid G (one per SM), block 384, dynamic shared memory V12_SMEM.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v12_attend(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    int nreq, int P, int Q, int H, float scale, float* __restrict__ parts, float* __restrict__ part_lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    attend_v7<false, V12Mix>(q, kv, page_table, tree_kv, vis, plan, nullptr, nreq, P, Q, H, scale, parts, part_lse);
#else
    __trap();  // built without sm_90a: no wgmma
#endif
}
