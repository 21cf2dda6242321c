// tree_verify_v10: version 9's verify (tree_verify/wgmma_v9.cu) with the jobs dealt to the CTAs in decreasing
// size. Three launches, no host sync, fixed buffers (CUDA-graph capturable): tree_verify_v10_plan, the ordered
// attend kernel (tree_verify_v10_attend_t, v9's consumers, where v9 runs its own kernel: Q*H <= 16, built per
// shape with -DTV9_NR; else tree_verify_v10_attend, v7's consumers), tree_verify_v8_combine_w<W>.
//
// Why: the attend kernels are persistent, CTA c running jobs c, c + G, c + 2G, ... (the static round-robin).
// Where the jobs differ in size (a ragged batch: requests of different prefixes and trees) the busiest CTA
// carries well above the mean (kdlib.cuda.attention.cta_loads: each CTA's tiles under a deal).
//
// Here the plan (v5's, then the order) writes order [jobs]: the job indices by decreasing key tiles (ties:
// the smaller index first), each thread ranking its jobs by counting over their tiles in shared memory
// (O(jobs^2 / 256)). The producer deals them in snake order: in round r CTA c takes the k-th largest job, k =
// r G + c in even rounds, r G + G - 1 - c in odd ones (dealt_job, tree_verify/wgmma_ws.cuh), until k passes
// the jobs. With at most G jobs (one round) the plan writes no order and the deal is the static one; past
// ORDER_CAP jobs (its shared memory) neither: the static round-robin. The consumers take the job index from
// the pair descriptors and write parts [j] of the real job j, so the combine is v8's and the result is
// version 9's bit for bit (the same jobs, each computed alike, merged in the same fixed order).
//
// The attend kernels need sm_90a (wgmma, setmaxnreg); built for another target their bodies trap.
// kdlib-arch: sm_90a wgmma=tree_verify_v7_attend,tree_verify_v9_attend,tree_verify_v10_attend,tree_verify_v10_attend_t
// (tests/test_kernels_compile.py builds it so, checks the SASS)

#include "tree_verify/wgmma_v9.cu"

// ------------------------------------------------------------------------------------------ plan

// Arguments as tree_verify_v5_plan -> plan [1 + PLAN_STRIDE * B] and, where G < jobs <= ORDER_CAP,
// order [jobs] int32 (else unwritten). Grid 1, block 256. plan is not __restrict__: every thread reads back
// past the barrier what thread 0 wrote (restrict let the compiler forward thread 0's plan[0] to the others).
extern "C" __global__ void __launch_bounds__(256) tree_verify_v10_plan(
    const int* __restrict__ prefix_lens, const int* __restrict__ tree_sizes, int B, int P, int Q, int H, int G,
    int* plan, int* __restrict__ order) {
    __shared__ long long cost[MAX_ROUNDS];
    __shared__ int chunk_of_k[MAX_ROUNDS];
    __shared__ int tmax_warp[8];
    __shared__ int tiles[ORDER_CAP];  // each job's key tiles
    plan_v5(prefix_lens, tree_sizes, B, P, Q, H, G, plan, cost, chunk_of_k, tmax_warp);
    __syncthreads();  // the plan whole (thread 0 wrote it)
    const int n = plan[0];
    if (n <= G || n > ORDER_CAP) return;  // no order: the static round-robin
    for (int j = threadIdx.x; j < n; j += blockDim.x) tiles[j] = decode_job(plan, B, j).ntiles;
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) {  // j's rank: the larger jobs and the equal ones before it
        const int t = tiles[j];
        int rank = 0;
        for (int k = 0; k < j; ++k) rank += tiles[k] >= t;
        for (int k = j + 1; k < n; ++k) rank += tiles[k] > t;
        order[rank] = j;
    }
}

// ------------------------------------------------------------------------------------------ attend

// Arguments and outputs as tree_verify_v7_attend, plus order [jobs] from tree_verify_v10_plan. Grid G (one
// per SM), block 384, dynamic shared memory SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v10_attend(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    const int* __restrict__ order, int nreq, int P, int Q, int H, float scale, float* __restrict__ parts,
    float* __restrict__ part_lse) {
    attend_v7<true>(q, kv, page_table, tree_kv, vis, plan, order, nreq, P, Q, H, scale, parts, part_lse);
}

// As tree_verify_v10_attend with v9's consumers (jobs of at most TV9_NR rows). Dynamic shared memory V9_SMEM.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v10_attend_t(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    const int* __restrict__ order, int nreq, int P, int Q, int H, float scale, float* __restrict__ parts,
    float* __restrict__ part_lse) {
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
        produce<true>(base, desc, bars, q, kv, page_table, tree_kv, plan, order, nreq, P, Q, H, wt);
        return;
    }
    consume_v9(base, gbase, desc, bars, tid, wg, wt, vis, Q, H, scale, parts, part_lse);
#else
    __trap();  // built without sm_90a: no wgmma
#endif
}
