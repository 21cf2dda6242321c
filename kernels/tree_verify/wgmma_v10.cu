// tree_verify_v10: version 9's verify (tree_verify/wgmma_v9.cu) with the jobs dealt to the CTAs in decreasing
// size. Three launches, no host sync, fixed buffers (CUDA-graph capturable): tree_verify_v10_plan, the ordered
// attend kernel (tree_verify_v10_attend_t, v9's consumers, where v9 runs its own kernel: Q*H <= 16, built per
// shape with -DTV9_NR; else tree_verify_v10_attend, v7's consumers), tree_verify_v8_combine_w<W>. The host
// launches the attend and combine kernels with programmatic dependent launch (pdl_wait, wgmma_common.cuh).
// Up to OWN_PLAN_REQS requests it launches no plan kernel: tree_verify_v10_attend_own and _t_own make the
// plan themselves (own_plan, below) and deal it statically (kdlib.cuda.attention.OWN_PLAN; the whole verify
// 1.005-1.053x faster at the A/B's points of 1 to 8 requests the plan kernel leaves unordered, 0.980 at the one
// it orders, bit for bit: data/results/history/kernel_ab_own_plan.c96c1f9.h200.json).
//
// Why: the attend kernels are persistent, CTA c running jobs c, c + G, c + 2G, ... (the static round-robin).
// Where the jobs differ in size (a ragged batch: requests of different prefixes and trees) the busiest CTA
// carries well above the mean (kdlib.cuda.attention.cta_loads: each CTA's tiles under a deal).
//
// Here the plan (v5's, then the order) ranks the jobs by decreasing key tiles (ties: the smaller index first)
// and costs two deals of them (tiles + JOB_OVERHEAD a job, kdlib.cuda.attention.cta_loads): the static one,
// and the snake deal, in which round r CTA c takes the k-th largest job, k = r G + c in even rounds,
// r G + G - 1 - c in odd ones (dealt_job, tree_verify/wgmma_ws.cuh). Where the snake deal's busiest CTA is
// lighter than the static deal's by more than ORDER_GAIN / ORDER_UNIT (1/64), it writes order [jobs], the jobs
// by size; else order [0] = -1 and the attend kernels run the static round-robin, version 9's producer. With at
// most G jobs (one round) or past ORDER_CAP (its shared memory) nothing is ranked: the static one. The
// threshold is measured (data/results/attention_gate.h200.json, 25 batches): predicted gains of 1.007-1.013
// measured 0.990-1.011x dealt by size, those of 1.021-1.031 1.008-1.032x (1/32, the threshold before, left
// these unordered).
// The consumers take the job index from the pair descriptors and write parts [j] of the real job j, so the
// combine is v8's and the result is version 9's bit for bit (the same jobs, each computed alike, merged in
// the same fixed order).
//
// Built with -DTV_FP8=1 (kdlib.cuda.attention.FP8_OPTIONS) the attend kernels read the prefix pool in the FP8
// layout (656-byte rows: e4m3 latent, float32 scales, bf16 rope), dequantized into the bf16 stages
// (tree_verify/wgmma_ws.cuh): in tree_verify_v10_attend by the producer (fill_stage), in tree_verify_v10_attend_t
// by each consumer, its own stage's tile before its S^T (dequant_half, one V half at a time; the producer only
// stages the bytes); both attend kernels then take FP8_SMEM of shared memory.
//
// The attend kernels need sm_90a (wgmma, setmaxnreg); built for another target their bodies trap.
// kdlib-arch: sm_90a wgmma=tree_verify_v7_attend,tree_verify_v9_attend,tree_verify_v10_attend,tree_verify_v10_attend_t,tree_verify_v10_attend_own,tree_verify_v10_attend_t_own
// (tests/test_kernels_compile.py builds it so, checks the SASS)

#include "tree_verify/wgmma_v9.cu"

// ------------------------------------------------------------------------------------------ plan

// Arguments as tree_verify_v5_plan, and deal_cost (below) -> plan [1 + PLAN_STRIDE * B] and order [jobs] int32:
// the jobs by size where that deal gains (see above), else order [0] = -1 (nothing written without jobs). Grid 1,
// block 256.
// The ranking reads the plan where plan_v5 built it (shared memory up to PLAN_SMEM_REQS requests).
//
// The ranking goes by groups, the row blocks of one request's key chunk: jobs first .. first + rb - 1, all of
// one size, so their ranks run on from the group's. A group's sort key, tiles << 10 | (1023 - first), is
// distinct, larger for more tiles, then for the smaller first job (jobs of at most 2^22 tiles, 268M keys);
// its first rank counts the jobs of the groups above it: O(groups^2 / 256) with groups = jobs / rb, where
// ranking each job against every other cost O(jobs^2 / 256) (1.1 % of the verify at 8 x 65 x 32k B8,
// data/results/history/attention.v10_job_rank.33c8360.h200.json, and 0.7 % at 16 x 65 x 131k).
//
// deal_cost != 0 (the host's reuse_plan: later calls reuse the plan, kdlib.cuda.attention): plan_v5's cost of a
// round count's chunks, rounds x (longest + JOB_OVERHEAD), is the busiest CTA where every job is as long as the
// longest. A ragged batch's jobs are not: there each candidate of G < jobs <= ORDER_CAP (past PLAN_SMALL_REQS and
// up to PLAN_SMEM_REQS requests) is planned into cplan, ranked and dealt as the final plan is, and weighed by the
// busiest CTA of the deal the attend kernels would run (x 32, + jobs as before). One round and past the cap the
// cost stays plan_v5's, there the static deal's busiest CTA or above it. The weighing costs the plan kernel up
// to 13 us (8 x 9 x 5,500 over 10 requests, notebook 02b 13zc), more than it gains in one verify, so only a
// plan the step's later layers reuse pays for it.
extern "C" __global__ void __launch_bounds__(256) tree_verify_v10_plan(
    const int* __restrict__ prefix_lens, const int* __restrict__ tree_sizes, int B, int P, int Q, int H, int G,
    int* plan, int* __restrict__ order, int deal_cost) {
    static_assert(ORDER_CAP == 1 << 10, "the sort key's 10 index bits");
    pdl_trigger();  // the attend kernel may launch (it waits for this plan before reading it)
    __shared__ long long cost[MAX_ROUNDS];
    __shared__ int chunk_of_k[MAX_ROUNDS];
    __shared__ int tmax_warp[8];
    __shared__ int tiles[ORDER_CAP];   // [job] its key tiles
    __shared__ uint2 group[ORDER_CAP];  // [group, in no set order] its sort key, its jobs
    __shared__ int sorted[ORDER_CAP];  // [rank] the job
    __shared__ int ngroups, busiest[2];  // busiest: the busiest CTA's cost, static deal and snake deal
    __shared__ int splan[PLAN_HDR + PLAN_SMEM_REQS * PLAN_STRIDE];
    __shared__ int cplan[PLAN_HDR + PLAN_SMEM_REQS * PLAN_STRIDE];  // a candidate's plan
    const int tid = threadIdx.x;
    // the n jobs of plan pl (G < n <= ORDER_CAP) ranked into sorted, both deals' busiest CTA into busiest; true
    // where the snake deal gains (the order is written)
    auto rank_and_deal = [&](const int* pl, int n) {
        if (tid == 0) ngroups = 0, busiest[0] = 0, busiest[1] = 0;
        __syncthreads();
        for (int j = tid; j < n; j += 256) {
            const Job jb = decode_job(pl, B, j);
            tiles[j] = jb.ntiles;
            if (jb.row0 == 0)  // the first row block: a group's first job
                group[atomicAdd(&ngroups, 1)] = make_uint2((unsigned)jb.ntiles << 10 | (ORDER_CAP - 1 - j),
                                                           pl[PLAN_HDR + jb.b * PLAN_STRIDE + P_RB]);
        }
        __syncthreads();
        const int ng = ngroups;
        for (int g = tid; g < ng; g += 256) {  // the sum is the same in any order of the groups
            const uint2 mine = group[g];
            int rank = 0;
            for (int h = 0; h < ng; ++h) {
                const uint2 o = group[h];
                rank += o.x > mine.x ? (int)o.y : 0;
            }
            const int first = ORDER_CAP - 1 - (int)(mine.x & (ORDER_CAP - 1));
            for (int i = 0; i < (int)mine.y; ++i) sorted[rank + i] = first + i;
        }
        __syncthreads();
        const int rounds = (n + G - 1) / G;
        for (int c = tid; c < G; c += 256) {  // CTA c's cost under each deal
            int dealt_static = 0, dealt_snake = 0;
            for (int r = 0; r < rounds; ++r) {
                const int ks = r * G + c, k = r * G + (r & 1 ? G - 1 - c : c);
                if (ks < n) dealt_static += tiles[ks] + JOB_OVERHEAD;
                if (k < n) dealt_snake += tiles[sorted[k]] + JOB_OVERHEAD;
            }
            atomicMax(&busiest[0], dealt_static);
            atomicMax(&busiest[1], dealt_snake);
        }
        __syncthreads();
        return (long long)busiest[0] * ORDER_UNIT > (long long)busiest[1] * (ORDER_UNIT + ORDER_GAIN);
    };
    auto weigh = [&](const int* p, long long* cost_k, const int* chunk_k) {
        if (!deal_cost || B > PLAN_SMEM_REQS) return;
        for (int k = 0; k < MAX_ROUNDS; ++k) {
            if (k > 0 && chunk_k[k] == chunk_k[k - 1]) {  // the same plan
                if (tid == 0) cost_k[k] = cost_k[k - 1];
            } else {
                if (tid < 32) write_chunks(p, cplan, B, chunk_k[k]);
                __syncthreads();
                const int n = cplan[0];
                if (G < n && n <= ORDER_CAP) {
                    const bool snake = rank_and_deal(cplan, n);
                    if (tid == 0) cost_k[k] = (long long)busiest[snake ? 1 : 0] * 32 + n;
                }
            }
            __syncthreads();
        }
    };
    const int* pl = plan_v5(prefix_lens, tree_sizes, B, P, Q, H, G, plan, splan, cost, chunk_of_k, tmax_warp, weigh);
    const int n = pl[0];
    if (n <= G || n > ORDER_CAP) {  // the static round-robin
        if (tid == 0 && n > 0) order[0] = -1;
        return;
    }
    if (rank_and_deal(pl, n)) {
        for (int k = tid; k < n; k += 256) order[k] = sorted[k];
    } else if (tid == 0) {
        order[0] = -1;
    }
}

// ------------------------------------------------------------------------------------------ attend

#ifndef OWN_PLAN_REQS
#define OWN_PLAN_REQS 8  // the most requests the _own kernels plan for (kdlib.cuda.attention.own_plan's cut)
#endif
static_assert(OWN_PLAN_REQS >= 1 && OWN_PLAN_REQS <= 8, "OWN_PLAN_REQS: plan_small's search of up to 8 requests");
#define OWN_PLAN_INTS (PLAN_HDR + OWN_PLAN_REQS * PLAN_STRIDE + 1)  // a plan of OWN_PLAN_REQS, then order [0]

// The plan made by the attend kernel itself (the _own kernels, launched with no plan kernel ahead: up to
// OWN_PLAN_REQS requests): warp 0 of every CTA makes plan_small's plan into fplan [OWN_PLAN_INTS] (shared;
// its last int order [0] = -1, the static deal), CTA 0 also into plan and order [0], which the combine and
// later calls with plan_ready read. The CTA reads its fplan. A plan of more than G jobs is dealt statically
// here, where the plan kernel may order it.
__device__ __forceinline__ void own_plan(const int* __restrict__ prefix_lens, const int* __restrict__ tree_sizes,
                                         int B, int P, int Q, int H, int* plan, int* order, int* fplan) {
    pdl_wait();  // the lengths, and the previous call's reads of plan and order, are done
    if (threadIdx.x < 32)
        plan_small(prefix_lens, tree_sizes, B, P, Q, H, gridDim.x, blockIdx.x == 0 ? plan : fplan, fplan);
    if (threadIdx.x == 0) fplan[PLAN_HDR + B * PLAN_STRIDE] = -1;
    __syncthreads();
    if (threadIdx.x == 0 && blockIdx.x == 0 && fplan[0] > 0) order[0] = -1;
}

// Arguments and outputs as tree_verify_v7_attend, plus order [jobs] from tree_verify_v10_plan. Grid G (one
// per SM), block 384, dynamic shared memory SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v10_attend(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    const int* __restrict__ order, int nreq, int P, int Q, int H, float scale, float* __restrict__ parts,
    float* __restrict__ part_lse) {
    attend_v7<true>(q, kv, page_table, tree_kv, vis, plan, order, nreq, P, Q, H, scale, parts, part_lse);
}

// As tree_verify_v10_attend, its plan made by itself (own_plan) from prefix_lens [B] and tree_sizes [B] (or
// null), B <= OWN_PLAN_REQS; plan and order are only written (CTA 0).
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v10_attend_own(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, int* __restrict__ plan,
    int* __restrict__ order, int nreq, int P, int Q, int H, float scale, float* __restrict__ parts,
    float* __restrict__ part_lse, const int* __restrict__ prefix_lens, const int* __restrict__ tree_sizes) {
    __shared__ int fplan[OWN_PLAN_INTS];
    own_plan(prefix_lens, tree_sizes, nreq, P, Q, H, plan, order, fplan);
    attend_v7<true>(q, kv, page_table, tree_kv, vis, fplan, fplan + PLAN_HDR + nreq * PLAN_STRIDE, nreq, P, Q, H,
                    scale, parts, part_lse);
}

// The body of the kernels with v9's consumers (ORDERED's producer, produce_v10).
__device__ __forceinline__ void attend_v10_t(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                                             const int* __restrict__ page_table,
                                             const __nv_bfloat16* __restrict__ tree_kv,
                                             const unsigned char* __restrict__ vis, const int* __restrict__ plan,
                                             const int* __restrict__ order, int nreq, int P, int Q, int H,
                                             float scale, float* __restrict__ parts, float* __restrict__ part_lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    pdl_wait();
    if ((int)blockIdx.x >= plan_jobs(plan)) return;
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char* gbase = smem_raw + (base - smem_u32(smem_raw));
    int* desc = reinterpret_cast<int*>(gbase + OFF_DESC);  // [NDESC][DESC_INTS]
    const unsigned bars = base + OFF_BARS;
    const int tid = threadIdx.x;
    if (tid == 0) init_bars<TV_FP8 != 0>(bars);
    __syncthreads();

    const int wg = tid >> 7, wt = tid & 127;
    if (wg == 0) {
        produce_v10<TV_FP8 != 0>(base, desc, bars, q, kv, page_table, tree_kv, plan, order, nreq, P, Q, H, wt);
        return;
    }
    consume_v9<TV_FP8 != 0>(base, gbase, desc, bars, tid, wg, wt, vis, Q, H, scale, parts, part_lse);
#else
    __trap();  // built without sm_90a: no wgmma
#endif
}

// As tree_verify_v10_attend with v9's consumers (jobs of at most TV9_NR rows). Dynamic shared memory V9_SMEM.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v10_attend_t(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, const int* __restrict__ plan,
    const int* __restrict__ order, int nreq, int P, int Q, int H, float scale, float* __restrict__ parts,
    float* __restrict__ part_lse) {
    attend_v10_t(q, kv, page_table, tree_kv, vis, plan, order, nreq, P, Q, H, scale, parts, part_lse);
}

// As tree_verify_v10_attend_t, its plan made by itself, as tree_verify_v10_attend_own's.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) tree_verify_v10_attend_t_own(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kv, const int* __restrict__ page_table,
    const __nv_bfloat16* __restrict__ tree_kv, const unsigned char* __restrict__ vis, int* __restrict__ plan,
    int* __restrict__ order, int nreq, int P, int Q, int H, float scale, float* __restrict__ parts,
    float* __restrict__ part_lse, const int* __restrict__ prefix_lens, const int* __restrict__ tree_sizes) {
    __shared__ int fplan[OWN_PLAN_INTS];
    own_plan(prefix_lens, tree_sizes, nreq, P, Q, H, plan, order, fplan);
    attend_v10_t(q, kv, page_table, tree_kv, vis, fplan, fplan + PLAN_HDR + nreq * PLAN_STRIDE, nreq, P, Q, H,
                 scale, parts, part_lse);
}
