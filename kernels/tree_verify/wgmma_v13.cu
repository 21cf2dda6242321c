// tree_verify_v13: version 10's whole verify, but where its own plan (up to OWN_PLAN_REQS requests) gives one
// request's row blocks two key chunks each, one job a CTA, the two jobs of a row block run as the two CTAs of a
// cluster and merge there: no partials written, the combine left with nothing to do. Two launches, no host sync,
// fixed buffers (CUDA-graph capturable): tree_verify_v13_attend_own (clusters of two CTAs), then
// tree_verify_v13_combine_rows (v8's combine_rows, which returns at once where the attend kernel merged).
// kdlib.cuda.attention runs version 10's kernels wherever version 10 would not launch its _own kernel with v7's
// consumers and the combine a warp per row, and wherever the host's shapes rule the pairs out (v13_pairs).
//
// Why (notebook 02b, 13o): at 64 heads x 65 queries x 32k the plan makes 130 jobs, two a row block, one a CTA,
// and the combine kernel took 1.7 % of the whole verify (data/results/attention_bounds.h200.json), where the
// verify ran at par with FlashInfer's prefix alone. cluster_exchange (data/results/cluster_exchange.h200.json) measured the stores between a cluster's two
// CTAs: swapping the half of a row block's O each merges (64 rows x 256 dims, fp32) costs a sixth of that.
//
// The pairs: where the plan (made in every CTA, own_plan) has one request, two chunks, the request's full rows
// (rows = Q*H) and at most G jobs, CTA 2c + r takes job r rb + c (chunk r of row block c; rb row blocks) through
// version 10's ordered producer (the order it reads: pair_order); elsewhere the kernel is
// tree_verify_v10_attend_own. At a pair's end (pair_end), in CTA r:
//   both consumers arrive on the other CTA's FREE mbarrier (release, cluster scope): their reads of stage 0, the
//     swap buffer, are done;
//   consumer 1 - r (its dims are the other CTA's to merge) normalises its O as job_end does and, once its own
//     FREE completes, stores it into the other CTA's stage 0 (st.async: float4 i of thread t at (i 128 + t) 16
//     bytes, then each quad's two rows' lse), completing the bytes on that CTA's FULL mbarrier;
//   consumer r waits on its FULL (armed for V13_SWAP_BYTES), and merges its own and the received rows as v8's
//     combine merges a row's two jobs (chunk 0 first; the same operations: version 10's bits), writing out's dims
//     256 r .. 256 r + 255 of its rows, and (r 0) their lse.
// A CTA's shared memory outlives every access of the other's: its sender waits for the other's arrivals on its
// FREE, its receiver for the other's stores on its FULL. CTA 0 writes order [0] = V13_MERGED (else -1), which
// the combine reads. tools/barrier_model.py runs this protocol (run_pair) as a model under random schedules.
//
// The attend kernel needs sm_90a (wgmma, setmaxnreg, clusters); built for another target its body traps.
// kdlib-arch: sm_90a wgmma=tree_verify_v7_attend,tree_verify_v9_attend,tree_verify_v10_attend,tree_verify_v10_attend_t,tree_verify_v10_attend_own,tree_verify_v10_attend_t_own,tree_verify_v13_attend_own

#include "common/cluster.cuh"
#include "tree_verify/wgmma_v10.cu"

#define V13_MAX_JOBS 256                        // the most jobs (two a row block) the pairs take
#define V13_MERGED (-2)                         // order [0]: the attend kernel merged every row
#define V13_LSE_OFF (32 * 128 * 16)             // the swap buffer: O [32][128 threads] float4, then lse [32] float2
#define V13_SWAP_BYTES (V13_LSE_OFF + 32 * 8)   // 65,792 B, within stage 0
static_assert(V13_SWAP_BYTES <= TILE_BYTES, "the swap buffer within stage 0");

// The CTA's pair state, set by tree_verify_v13_attend_own before the consumers start.
__shared__ int v13_on;                            // 1: this CTA's row block merges with its cluster peer's
__shared__ float* v13_out;                        // out [B*M, 512], lse [B*M]
__shared__ float* v13_lse;
__shared__ __align__(8) unsigned long long v13_bars[2];  // FREE, FULL

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// v into the other CTA's shared memory at cluster address a, its 8 bytes completed on its mbarrier bar.
__device__ __forceinline__ void store_async2(unsigned a, float x, float y, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n"
                 ::"r"(a), "f"(x), "f"(y), "r"(bar)
                 : "memory");
}

// v8's combine of a row's two jobs, chunk 0's lse la and chunk 1's lb (combine_rows at two chunks: the max,
// z = e_0 + e_1, each weight e_i / z): weights wa, wb and the row's lse.
__device__ __forceinline__ void merge_weights(float la, float lb, float& wa, float& wb, float& lse) {
    const float mx = fmaxf(la, lb);
    const float base = mx == NEG_INF ? 0.f : mx;
    const float z = expf(la - base) + expf(lb - base);
    const float inv = z > 0.f ? 1.f / z : 0.f;
    wa = expf(la - base) * inv;
    wb = expf(lb - base) * inv;
    lse = z > 0.f ? base + logf(z) : NEG_INF;
}

// combine_rows' sum of a column over two jobs: warp 0's and warp 1's fma, then warps 2 and 3's zeros.
__device__ __forceinline__ float merged(float wa, float xa, float wb, float xb) {
    return (fmaf(wa, xa, 0.f) + fmaf(wb, xb, 0.f)) + 0.f + 0.f;
}

// The end of consumer c's job in CTA `rank` of a pair (the file's header): o, m, l as job_end takes them, the
// job's rows row0 .. row0 + nrows - 1 of the one request.
__device__ __forceinline__ void pair_merge(const float (&o)[128], float m0, float m1, float l0, float l1, float* s_l,
                                           int c, int row0, int nrows, int lr0, int lr1, int t4, int lane,
                                           const unsigned char* gbase) {
    const unsigned rank = cluster_rank(), peer = rank ^ 1u;
    const unsigned free_bar = smem_u32(&v13_bars[0]), full_bar = smem_u32(&v13_bars[1]);
    const unsigned buf = smem_u32(gbase + OFF_K0);
    const int wt = threadIdx.x & 127;
    fence_async_smem();  // the stage's reads (wgmma: the async proxy) before the peer's stores into it
    __syncwarp();
    if (TV7_RACECHECK || lane == 0) mbar_arrive_remote(peer_addr(free_bar, peer));
    float i0, i1, lse0, lse1;
    job_sums(m0, m1, l0, l1, s_l, NB_LSUM, c, lr0, lr1, t4, i0, i1, lse0, lse1);
    if (c != (int)rank) {  // the sender: these dims are the peer's to merge
        mbar_wait(free_bar, 0);
        const unsigned dst = peer_addr(buf, peer), bar = peer_addr(full_bar, peer);
#pragma unroll
        for (int i = 0; i < 32; ++i)
            store_async(dst + (i * 128 + wt) * 16,
                        make_float4(o[4 * i] * i0, o[4 * i + 1] * i0, o[4 * i + 2] * i1, o[4 * i + 3] * i1), bar);
        if (t4 == 0) store_async2(dst + V13_LSE_OFF + (wt >> 2) * 8, lse0, lse1, bar);
        return;
    }
    if (wt == 0) mbar_expect(full_bar, V13_SWAP_BYTES);
    mbar_wait(full_bar, 0);
    const float4* rx = reinterpret_cast<const float4*>(gbase + OFF_K0);
    const float2 pl = reinterpret_cast<const float2*>(gbase + OFF_K0 + V13_LSE_OFF)[wt >> 2];
    float wa0, wb0, wa1, wb1, ls0, ls1;  // chunk 0 is rank 0's job
    merge_weights(rank ? pl.x : lse0, rank ? lse0 : pl.x, wa0, wb0, ls0);
    merge_weights(rank ? pl.y : lse1, rank ? lse1 : pl.y, wa1, wb1, ls1);
    float* dst0 = v13_out + (long long)(row0 + lr0) * D_V + 256 * c + 2 * t4;
    float* dst1 = v13_out + (long long)(row0 + lr1) * D_V + 256 * c + 2 * t4;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const float4 p = rx[i * 128 + wt];
        const float a0 = o[4 * i] * i0, a1 = o[4 * i + 1] * i0, a2 = o[4 * i + 2] * i1, a3 = o[4 * i + 3] * i1;
        if (lr0 < nrows)
            *reinterpret_cast<float2*>(dst0 + 8 * i) =
                rank ? make_float2(merged(wa0, p.x, wb0, a0), merged(wa0, p.y, wb0, a1))
                     : make_float2(merged(wa0, a0, wb0, p.x), merged(wa0, a1, wb0, p.y));
        if (lr1 < nrows)
            *reinterpret_cast<float2*>(dst1 + 8 * i) =
                rank ? make_float2(merged(wa1, p.z, wb1, a2), merged(wa1, p.w, wb1, a3))
                     : make_float2(merged(wa1, a2, wb1, p.z), merged(wa1, a3, wb1, p.w));
    }
    if (rank == 0 && t4 == 0) {
        if (lr0 < nrows) v13_lse[row0 + lr0] = ls0;
        if (lr1 < nrows) v13_lse[row0 + lr1] = ls1;
    }
}

// attend_v7's policy for version 13 (tree_verify/wgmma_v7.cu): version 7's kernel, each job's end the pair's
// merge where the CTA is one of a pair (v13_on), else job_end.
struct V13Pairs {
    static constexpr bool on = false;
    static constexpr bool pairs = true;
    static __device__ __forceinline__ void pair_end(const float (&o)[128], float& m0, float& m1, float& l0,
                                                    float& l1, float* s_l, int c, float* parts, float* part_lse,
                                                    int j, const Job& jb, int lr0, int lr1, int t4, int lane,
                                                    const unsigned char* gbase) {
        if (v13_on)
            pair_merge(o, m0, m1, l0, l1, s_l, c, jb.row0, jb.nrows, lr0, lr1, t4, lane, gbase);
        else
            job_end(o, m0, m1, l0, l1, s_l, NB_LSUM, c, parts, part_lse, j, [&] { return jb.nrows; }, lr0, lr1,
                    t4);
    }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// As tree_verify_v10_attend_own (its plan made by itself), launched in clusters of two CTAs (grid even), plus
// out [B*M, 512] and lse [B*M] fp32, which the pairs write (the file's header). Dynamic shared memory SMEM_BYTES.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(NTHREADS, 1) tree_verify_v13_attend_own(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, int* __restrict__ plan,
    int* __restrict__ order, int nreq, int P, int Q, int H, float scale, float* __restrict__ parts,
    float* __restrict__ part_lse, const int* __restrict__ prefix_lens, const int* __restrict__ tree_sizes,
    float* __restrict__ out, float* __restrict__ lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ int fplan[OWN_PLAN_INTS];
    __shared__ int pair_order[V13_MAX_JOBS];  // CTA 2c + r: job r rb + c
    own_plan(prefix_lens, tree_sizes, nreq, P, Q, H, plan, order, fplan);
    const int* e = fplan + PLAN_HDR;  // request 0
    const int jobs = plan_jobs(fplan), rb = e[P_RB];
    const bool pairs = nreq == 1 && e[P_NCHUNK] == 2 && e[P_ROWS] == Q * H && jobs == 2 * rb &&
                       jobs <= (int)gridDim.x && jobs <= V13_MAX_JOBS;
    const bool mine = pairs && (int)blockIdx.x < jobs;  // both CTAs of a cluster alike (jobs even)
    if (threadIdx.x == 0) {
        v13_on = mine;
        v13_out = out;
        v13_lse = lse;
        if (mine) {
            mbar_init(smem_u32(&v13_bars[0]), 8 * WARP_ARRIVALS);  // the peer's consumer warps
            mbar_init(smem_u32(&v13_bars[1]), 1);                  // this receiver's expect_tx
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        if (blockIdx.x == 0) order[0] = pairs ? V13_MERGED : -1;  // what the combine reads
    }
    for (int k = threadIdx.x; pairs && k < jobs; k += NTHREADS) pair_order[k] = (k & 1) * rb + (k >> 1);
    if (mine)
        cluster_sync();  // both CTAs' barriers initialised before either arrives on the other's
    else
        __syncthreads();
    attend_v7<true, V13Pairs>(q, kv, page_table, tree_kv, vis, fplan,
                              pairs ? pair_order : fplan + PLAN_HDR + nreq * PLAN_STRIDE, nreq, P, Q, H, scale,
                              parts, part_lse);
#else
    __trap();  // built without sm_90a: no wgmma, no clusters
#endif
}

// tree_verify_v8_combine_rows, but nothing where the attend kernel merged every row (order [0] V13_MERGED).
extern "C" __global__ void __launch_bounds__(32 * ROWS_WARPS) tree_verify_v13_combine_rows(
    const float* __restrict__ parts, const float* __restrict__ part_lse, const int* __restrict__ plan,
    const int* __restrict__ order, int M, int N, float* __restrict__ out, float* __restrict__ lse) {
    pdl_wait();  // the attend kernel's order [0] and parts
    if (order[0] == V13_MERGED) return;
    combine_rows(parts, part_lse, plan, M, N, out, lse);
}
