// The parts of the wgmma tree-verify kernels (tree_verify/wgmma_v5.cu, wgmma_v6.cu, wgmma_v7.cu) that
// they share: the layout constants, the plan kernel that cuts the work into jobs, the job decode, the
// tile mask, the Hopper primitives (cp.async, mbarriers, wgmma), the seesaw's parts of v6 and v7 and
// the LSE combine kernel. Each version's file describes the whole verify and adds its own attend kernel.
#pragma once

#include <cuda_bf16.h>

#define D_QK 576
#define D_V 512
#define BM 64                           // query rows per job
#define BN 64                           // keys per tile
#define NCB 9                           // 64-dim column blocks of a 576-wide row
#define CB_BYTES (64 * 128)             // one column block of 64 rows: 8 KB
#define TILE_BYTES (NCB * CB_BYTES)     // 73728: the Q block or one K stage
#define ROPE_CB 8                       // column block of dims 512..575 (the rope part of a row)
#define PLAN_HDR 1                      // plan[0] = number of jobs
#define PLAN_STRIDE 8                   // per request: base job, chunks, chunk tiles, row blocks, len, rows, tail rows,
                                        // the cut
#define P_BASE 0
#define P_NCHUNK 1
#define P_CHUNK 2
#define P_RB 3
#define P_LEN 4
#define P_ROWS 5
#define P_NTAIL 6
#define P_CUT 7  // CHUNK_WITH_TAIL as built: the cut the chunks follow (kdlib's mirrors read it)
#define PLAN_SMEM_REQS 256              // requests whose plan the plan kernels build in shared memory
#define MAX_ROUNDS 4                    // jobs <= MAX_ROUNDS * G + B * ceil(M / 64): the partials' bound
#ifndef JOB_OVERHEAD                    // -DJOB_OVERHEAD=N: the plans weigh a job at its tiles + N
#define JOB_OVERHEAD 5                  // tiles' worth of a job's Q load, pipeline fill and output write
#endif
#ifndef PLAN_SMALL_REQS                 // -DPLAN_SMALL_REQS=0: every plan by plan_v5's four warps
#define PLAN_SMALL_REQS 8               // up to this many requests warp 0 makes the plan alone (plan_small)
#endif
#define ORDER_CAP 1024                  // the most jobs the v10 plan orders (wgmma_v10.cu)
#define ORDER_UNIT 64                   // the gate's unit: the busiest CTA's gain in 64ths
#ifndef ORDER_GAIN                      // -DORDER_GAIN=-64 orders every plan past one round (attention_gate)
#define ORDER_GAIN 1                    // it orders them where the busiest CTA gains > ORDER_GAIN / ORDER_UNIT
#endif
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define NEG_INF __int_as_float(0xff800000)
#define QNAN __int_as_float(0x7fc00000)

// ------------------------------------------------------------------------------------------ plan

#ifndef CHUNK_WITH_TAIL  // 1: a chunk's c tiles count the tail tiles chunk 0 carries, so every chunk of a request
#define CHUNK_WITH_TAIL 1  // holds about the same key tiles (the search's chunks at least the tail's tiles); 0: the
#endif                     // prefix alone is cut and chunk 0 carries the tail on top (notebook 02b, 13zb)

// Key chunks of a request with prefix tiles T and tail tiles U when chunks are at most c tiles (CHUNK_WITH_TAIL:
// c >= U, the tail tiles counted; else prefix tiles alone).
__device__ __forceinline__ int chunks_of(int T, int U, int c) {
    if (CHUNK_WITH_TAIL) return T + U > 0 ? (T + U + c - 1) / c : 0;
    return T > 0 ? (T + c - 1) / c : (U > 0 ? 1 : 0);
}

// The record's tiles a chunk (P_CHUNK) of a request cut into nc > 0 chunks: equal chunks within the request.
__device__ __forceinline__ int chunk_tiles(int T, int U, int nc) {
    if (CHUNK_WITH_TAIL) return max(U, (T + U + nc - 1) / nc);
    return T > 0 ? (T + nc - 1) / nc : 0;
}

// The longest job of a request cut into nc > 0 chunks, in key tiles: chunk 0's (its tail tiles and prefix).
__device__ __forceinline__ int longest_job(int T, int U, int nc) {
    return CHUNK_WITH_TAIL ? chunk_tiles(T, U, nc) : chunk_tiles(T, U, nc) + U;
}

// plan_v5 of at most PLAN_SMALL_REQS (<= 32) requests, in warp 0 alone: lane b holds request b in registers,
// lanes 8k .. 8k + 7 search the shortest chunk for k + 1 rounds, eight candidates a step (a ballot each, each
// lane walking every request), and the scan is one pass: no shared-memory round trips and one __syncthreads,
// where plan_v5's four warps took three. Writes plan and splan (the same ints as plan_v5's); the other warps
// only wait at the end.
// Measured with clock64 stamps (tools/plan_phases.py, data/results/history/plan_phases.091caad.h200.json): at
// one request 4,407 cycles to the v10 plan's end against 10,333 by the four warps (their searches 73 % of
// those), faster up to 8 requests, slower from 10 built for 32 (hence PLAN_SMALL_REQS); the whole verify
// 1.033-1.083x faster at the memory-bound points of one request, 0.998 at 64 x 65 x 32k
// (history/kernel_ab_plan_small.5f90f18.h200.json). A search past 8 requests whose group lanes shared the
// requests (plan_v5's binary search) reached the plan's end sooner at 10 and 16 requests, later at 32, and left
// the whole verify as it was (data/results/plan_phases.h200.json's small32 runs, kernel_ab_small32.h200.json,
// a470e0b): taken out.
__device__ __forceinline__ void plan_small(const int* __restrict__ prefix_lens, const int* __restrict__ tree_sizes,
                                           int B, int P, int Q, int H, int G, int* plan, int* splan) {
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x & 31, k = lane >> 3, i = lane & 7;
    int len = 0, ts = 0, rows = 0, rb = 0, T = 0, U = 0;
    if (lane < B) {
        len = min(max(prefix_lens[lane], 0), P);
        ts = tree_sizes ? min(max(tree_sizes[lane], 0), Q) : Q;
        rows = ts * H, rb = (rows + BM - 1) / BM;
        T = (len + BN - 1) / BN, U = tree_sizes ? (ts + BN - 1) / BN : 0;
    }
    auto jobs = [&](int c) {  // every lane: the jobs of all B requests at chunk c
        long long n = 0;
        for (int b = 0; b < B; ++b)
            n += (long long)__shfl_sync(all, rb, b) * chunks_of(__shfl_sync(all, T, b), __shfl_sync(all, U, b), c);
        return n;
    };
    const long long limit = (long long)(k + 1) * G;
    int lo = CHUNK_WITH_TAIL ? max(1, (int)__reduce_max_sync(all, U)) : 1;  // chunks hold the tail's tiles
    int hi = max(lo, (int)__reduce_max_sync(all, CHUNK_WITH_TAIL ? T + U : T));  // tmax
    long long n;
    for (;;) {  // group k: the shortest c in [lo, hi] with jobs(c) <= limit, hi where none is
        const int step = (hi - lo + 8) >> 3;  // 8 candidates split [lo, hi], the last one hi
        n = jobs(min(lo + (i + 1) * step - 1, hi));
        const unsigned fit = __ballot_sync(all, n <= limit) >> (8 * k) & 0xffu;
        const int first = fit ? __ffs(fit) - 1 : 7;  // none: hi (only ever tmax), weighed by lane 7
        n = __shfl_sync(all, n, 8 * k + first);  // jobs at the group's new hi
        hi = min(lo + (first + 1) * step - 1, hi);
        lo = fit ? lo + first * step : hi;  // candidate first - 1 does not fit, so it is not hi
        if (__all_sync(all, lo == hi)) break;
    }
    int longest = 0;  // group k: the longest job in tiles at chunk lo
    for (int b0 = 0; b0 < B; b0 += 8) {
        const int b = min(b0 + i, 31);
        const int rb_b = __shfl_sync(all, rb, b), T_b = __shfl_sync(all, T, b), U_b = __shfl_sync(all, U, b);
        const int nc = chunks_of(T_b, U_b, lo);
        if (b0 + i < B && rb_b > 0 && nc > 0) longest = max(longest, longest_job(T_b, U_b, nc));
    }
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) longest = max(longest, __shfl_xor_sync(all, longest, off));
    const long long cost = (n + G - 1) / G * (long long)(longest + JOB_OVERHEAD) * 32 + n;
    int best = 0;  // the fewest rounds among the cheapest
    for (int g = 1; g < MAX_ROUNDS; ++g)
        if (__shfl_sync(all, cost, 8 * g) < __shfl_sync(all, cost, 8 * best)) best = g;
    const int c = __shfl_sync(all, lo, 8 * best);
    const int nc = rb > 0 ? chunks_of(T, U, c) : 0;
    int upto = nc * rb;  // the jobs of requests 0 .. lane
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_up_sync(all, upto, off);
        if (lane >= off) upto += o;
    }
    if (lane < B) {
        const int e[PLAN_STRIDE] = {upto - nc * rb, nc, nc > 0 ? chunk_tiles(T, U, nc) : 0, rb, len, rows,
                                    tree_sizes ? ts : 0, CHUNK_WITH_TAIL};
#pragma unroll
        for (int f = 0; f < PLAN_STRIDE; ++f) {
            plan[PLAN_HDR + lane * PLAN_STRIDE + f] = e[f];
            splan[PLAN_HDR + lane * PLAN_STRIDE + f] = e[f];
        }
    }
    if (lane == 31) plan[0] = upto, splan[0] = upto;
}

// plan_v5's candidates as it weighs them: rounds x (longest job + JOB_OVERHEAD) x 32 + jobs (tree_verify_v5_plan).
struct NoWeigh {
    __device__ void operator()(const int*, long long*, const int*) const {}
};

// One warp: each request's chunks and first job where chunks are at most c tiles, a scan over the requests, 32
// at a time. src: plan_v5's records mid-search (T and U in P_NCHUNK and P_CHUNK); dst: the plan, in place where
// dst == src, else whole records.
__device__ __forceinline__ void write_chunks(const int* src, int* dst, int B, int c) {
    const int lane = threadIdx.x & 31;
    int base = 0;
    for (int b0 = 0; b0 < B; b0 += 32) {
        const int b = b0 + lane;
        const int* s = src + PLAN_HDR + b * PLAN_STRIDE;
        int* e = dst + PLAN_HDR + b * PLAN_STRIDE;
        int T = 0, U = 0, rb = 0;
        if (b < B) T = s[P_NCHUNK], U = s[P_CHUNK], rb = s[P_RB];
        const int nc = rb > 0 ? chunks_of(T, U, c) : 0;
        int upto = nc * rb;  // the jobs of requests b0 .. b
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int o = __shfl_up_sync(0xffffffffu, upto, off);
            if (lane >= off) upto += o;
        }
        if (b < B) {
            if (dst != src) e[P_RB] = rb, e[P_LEN] = s[P_LEN], e[P_ROWS] = s[P_ROWS], e[P_NTAIL] = s[P_NTAIL],
                            e[P_CUT] = s[P_CUT];
            e[P_BASE] = base + upto - nc * rb;
            e[P_NCHUNK] = nc;
            e[P_CHUNK] = nc > 0 ? chunk_tiles(T, U, nc) : 0;  // equal chunks within the request
        }
        base += __shfl_sync(0xffffffffu, upto, 31);
    }
    if (lane == 0) dst[0] = base;
}

// The plan of tree_verify_v5_plan, shared with the v10 plan (tree_verify/wgmma_v10.cu, which then orders the
// jobs). cost [MAX_ROUNDS], chunk_of_k [MAX_ROUNDS], tmax_warp [8], splan [PLAN_HDR + PLAN_SMEM_REQS *
// PLAN_STRIDE]: the kernel's shared memory. Up to PLAN_SMEM_REQS requests the plan is built in splan and copied
// out at the end (past it, in place), and warp 0 scans the requests' first jobs where thread 0 walked them with
// the plan in global memory: 5.8 us against 7.0 at 8 requests, alike at one (7.1 against 6.6), where the kernel's
// time is not the plan's reads (data/results/history/attention_bounds.prefetch.72c0c91.h200.json against
// history/attention_bounds.v10.1b0d029.h200.json; data/results/kernel_ab_plan.h200.json, the whole verify).
// Up to PLAN_SMALL_REQS requests warp 0 makes the plan alone (plan_small). Past them, once the four warps have
// each round count's candidate in cost and chunk_of_k, every thread calls weigh(p, cost, chunk_of_k), which may
// replace cost [k] (the v10 plan's deal_cost). Returns the plan built (splan or plan), whole and readable by every
// thread.
template <class Weigh = NoWeigh>
__device__ __forceinline__ const int* plan_v5(const int* __restrict__ prefix_lens, const int* __restrict__ tree_sizes,
                                              int B, int P, int Q, int H, int G, int* plan, int* splan,
                                              long long* cost, int* chunk_of_k, int* tmax_warp, Weigh weigh = {}) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    static_assert(PLAN_SMALL_REQS <= 32, "plan_small: a lane a request");
    if (B <= PLAN_SMALL_REQS) {
        if (warp == 0) plan_small(prefix_lens, tree_sizes, B, P, Q, H, G, plan, splan);
        __syncthreads();
        return splan;
    }
    int* const p = B <= PLAN_SMEM_REQS ? splan : plan;  // generic: shared or global
    int tmax = 0;
    for (int b = tid; b < B; b += blockDim.x) {
        const int len = min(max(prefix_lens[b], 0), P);
        const int ts = tree_sizes ? min(max(tree_sizes[b], 0), Q) : Q;
        const int rows = ts * H, T = (len + BN - 1) / BN, U = tree_sizes ? (ts + BN - 1) / BN : 0;
        int* e = p + PLAN_HDR + b * PLAN_STRIDE;
        e[P_RB] = (rows + BM - 1) / BM;
        e[P_LEN] = len;
        e[P_ROWS] = rows;
        e[P_NTAIL] = tree_sizes ? ts : 0;
        e[P_CUT] = CHUNK_WITH_TAIL;
        e[P_NCHUNK] = T;  // scratch: prefix tiles
        e[P_CHUNK] = U;   // scratch: tail tiles
        tmax = max(tmax, CHUNK_WITH_TAIL ? T + U : T);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) tmax = max(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
    if (lane == 0) tmax_warp[warp] = tmax;
    __syncthreads();
    tmax = 1;
    for (int w = 0; w < 8; ++w) tmax = max(tmax, tmax_warp[w]);
    if (warp < MAX_ROUNDS) {  // warp k-1: the shortest chunk that fits the jobs into k rounds
        const long long limit = (long long)(warp + 1) * G;
        auto jobs = [&](int c) {
            long long n = 0;
            for (int b = lane; b < B; b += 32) {
                const int* e = p + PLAN_HDR + b * PLAN_STRIDE;
                n += (long long)e[P_RB] * chunks_of(e[P_NCHUNK], e[P_CHUNK], c);
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) n += __shfl_xor_sync(0xffffffffu, n, off);
            return n;
        };
        int lo = 1;
        if (CHUNK_WITH_TAIL) {  // chunks of the tail's tiles at least
            for (int b = lane; b < B; b += 32) lo = max(lo, p[PLAN_HDR + b * PLAN_STRIDE + P_CHUNK]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) lo = max(lo, __shfl_xor_sync(0xffffffffu, lo, off));
        }
        int hi = max(lo, tmax);
        while (lo < hi) {  // jobs(c) does not grow with c
            const int mid = (lo + hi) >> 1;
            if (jobs(mid) <= limit) hi = mid;
            else lo = mid + 1;
        }
        const long long n = jobs(lo);
        int longest = 0;  // the longest job in tiles
        for (int b = lane; b < B; b += 32) {
            const int* e = p + PLAN_HDR + b * PLAN_STRIDE;
            const int T = e[P_NCHUNK], U = e[P_CHUNK], nc = chunks_of(T, U, lo);
            if (e[P_RB] > 0 && nc > 0) longest = max(longest, longest_job(T, U, nc));
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, off));
        if (lane == 0) {
            cost[warp] = (n + G - 1) / G * (long long)(longest + JOB_OVERHEAD) * 32 + n;
            chunk_of_k[warp] = lo;
        }
    }
    __syncthreads();
    weigh(p, cost, chunk_of_k);  // every thread: the v10 plan weighs the candidates by the deal it runs
    if (warp == 0) {  // each request's chunks and first job
        int best = 0;
        for (int k = 1; k < MAX_ROUNDS; ++k)
            if (cost[k] < cost[best]) best = k;
        write_chunks(p, p, B, chunk_of_k[best]);
    }
    __syncthreads();
    if (p != plan)
        for (int i = tid; i < PLAN_HDR + B * PLAN_STRIDE; i += blockDim.x) plan[i] = p[i];
    return p;
}

// prefix_lens [B] int32, tree_sizes [B] int32 or null (prefix alone) -> plan [1 + PLAN_STRIDE * B].
// Grid 1, block 256. Scratch: plan entries of each request hold T and U until warp 0 writes them.
extern "C" __global__ void __launch_bounds__(256) tree_verify_v5_plan(
    const int* __restrict__ prefix_lens, const int* __restrict__ tree_sizes, int B, int P, int Q, int H, int G,
    int* __restrict__ plan) {
    __shared__ long long cost[MAX_ROUNDS];
    __shared__ int chunk_of_k[MAX_ROUNDS];
    __shared__ int tmax_warp[8];
    __shared__ int splan[PLAN_HDR + PLAN_SMEM_REQS * PLAN_STRIDE];
    plan_v5(prefix_lens, tree_sizes, B, P, Q, H, G, plan, splan, cost, chunk_of_k, tmax_warp);
}

// ------------------------------------------------------------------------------------- job decode

struct Job {
    int b;       // request
    int row0;    // first row of the block
    int nrows;   // valid rows of the block, 1..64
    int ntail;   // tree rows read as tail keys (0 but in chunk 0 of the verify)
    int utiles;  // tail tiles, read first
    int ks, ke;  // prefix keys [ks, ke)
    int ntiles;  // utiles + prefix tiles
};

__device__ __forceinline__ Job decode_job(const int* __restrict__ plan, int nreq, int j) {
    int lo = 0, hi = nreq - 1;  // the last request whose first job is <= j holds j
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (plan[PLAN_HDR + mid * PLAN_STRIDE + P_BASE] <= j) lo = mid;
        else hi = mid - 1;
    }
    const int* e = plan + PLAN_HDR + lo * PLAN_STRIDE;
    const int local = j - e[P_BASE], chunk = local / e[P_RB], rb = local - chunk * e[P_RB];
    Job jb;
    jb.b = lo;
    jb.row0 = rb * BM;
    jb.nrows = min(BM, e[P_ROWS] - jb.row0);
    jb.ntail = chunk == 0 ? e[P_NTAIL] : 0;
    jb.utiles = (jb.ntail + BN - 1) / BN;
    if (CHUNK_WITH_TAIL) {
        const int U = (e[P_NTAIL] + BN - 1) / BN;  // the request's tail tiles, counted in chunk 0's P_CHUNK
        jb.ks = max(0, chunk * e[P_CHUNK] - U) * BN;
        jb.ke = min(e[P_LEN], ((chunk + 1) * e[P_CHUNK] - U) * BN);
    } else {
        jb.ks = chunk * e[P_CHUNK] * BN;
        jb.ke = min(e[P_LEN], jb.ks + e[P_CHUNK] * BN);
    }
    jb.ntiles = jb.utiles + (jb.ke > jb.ks ? (jb.ke - jb.ks + BN - 1) / BN : 0);
    return jb;
}

// Keys [k0, kend) of tile it of a job; tail tiles index the tree rows, prefix tiles the page table.
__device__ __forceinline__ void tile_keys(const Job& jb, int it, bool& tail, int& k0, int& kend) {
    tail = it < jb.utiles;
    k0 = tail ? it * BN : jb.ks + (it - jb.utiles) * BN;
    kend = tail ? jb.ntail : jb.ke;
}

// Next position (j, it) in a CTA's stream of tiles (its jobs' tiles in order); j >= njobs: the end.
__device__ __forceinline__ void stream_next(const int* plan, int nreq, int njobs, int& j, int& it) {
    if (j >= njobs) return;
    if (++it < decode_job(plan, nreq, j).ntiles) return;
    j += gridDim.x;
    it = 0;
}

// ------------------------------------------------------------------------------------------ mask

// The maximum of eight, as a tree (fmaxf is exact: any order gives the same bits).
__device__ __forceinline__ float max8(const float (&r)[8]) {
    return fmaxf(fmaxf(fmaxf(r[0], r[1]), fmaxf(r[2], r[3])), fmaxf(fmaxf(r[4], r[5]), fmaxf(r[6], r[7])));
}

// Mask S of one tile (keys past kend; the visibility rows on tail tiles; padding rows see no tail
// key: -inf) and the two rows' maxima over the quad, scaled to the log2 domain (mx = max(s) sl2: the same
// bits as the maximum of the scaled s, rounding keeps order); s itself stays unscaled, exp_tile scales it.
// s: this thread's part of the m64n64 S fragment, rows lr0 and lr1, keys k0 + 8 jj + 2 t4 + {0, 1}. A prefix
// tile of BN keys in range has nothing to mask: its maxima taken as a tree. The masked path, which every tile
// took before, is about 500 SASS instructions on consumer 0's way from S to P_A; the whole verify went
// 0.968-1.097x, median 1.060, bit for bit the same (data/results/history/kernel_ab_m.cd9f93c.h200.json).
__device__ __forceinline__ void mask_tile(float (&s)[32], float& mx0, float& mx1, bool tail, int k0, int kend,
                                          const unsigned char* vis, const Job& jb, int Q, int H, int lr0, int lr1,
                                          int t4, float sl2) {
    if (!tail && kend - k0 >= BN) {
        float r0[8], r1[8];  // each row's maximum of the pair of keys jj
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            r0[jj] = fmaxf(s[4 * jj + 0], s[4 * jj + 1]);
            r1[jj] = fmaxf(s[4 * jj + 2], s[4 * jj + 3]);
        }
        mx0 = max8(r0);
        mx1 = max8(r1);
    } else {
        mx0 = NEG_INF;
        mx1 = NEG_INF;
        // the visibility rows of this thread's two query rows (vis is null for the prefix alone)
        const unsigned char* v0 = tail ? vis + ((long long)jb.b * Q + (jb.row0 + lr0) / H) * Q : vis;
        const unsigned char* v1 = tail ? vis + ((long long)jb.b * Q + (jb.row0 + lr1) / H) * Q : vis;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            const int key = k0 + jj * 8 + 2 * t4;
            bool a0 = key < kend, a1 = key + 1 < kend;
            bool b0 = a0, b1 = a1;
            if (tail) {
                a0 = a0 && lr0 < jb.nrows && v0[key];
                a1 = a1 && lr0 < jb.nrows && v0[key + 1];
                b0 = b0 && lr1 < jb.nrows && v1[key];
                b1 = b1 && lr1 < jb.nrows && v1[key + 1];
            }
            s[4 * jj + 0] = a0 ? s[4 * jj + 0] : NEG_INF;
            s[4 * jj + 1] = a1 ? s[4 * jj + 1] : NEG_INF;
            s[4 * jj + 2] = b0 ? s[4 * jj + 2] : NEG_INF;
            s[4 * jj + 3] = b1 ? s[4 * jj + 3] : NEG_INF;
            mx0 = fmaxf(mx0, fmaxf(s[4 * jj + 0], s[4 * jj + 1]));
            mx1 = fmaxf(mx1, fmaxf(s[4 * jj + 2], s[4 * jj + 3]));
        }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    mx0 *= sl2;  // the maxima scaled (the same bits as the maxima of the scaled s: rounding keeps order)
    mx1 *= sl2;
}

// ------------------------------------------------------------------ programmatic dependent launch

// Where the host launches a kernel with programmatic stream serialization (kdlib.cuda.loader.launch, pdl=True),
// it may start while the kernel ahead of it in the stream runs: pdl_wait blocks until that kernel has completed
// and its writes are visible, so a kernel calls it before its first read of them. pdl_trigger lets the kernel
// behind this one start launching; without it that launch begins as this kernel's CTAs exit. Both are no-ops
// in a kernel launched without the attribute (sm_90 on). Version 10 (tree_verify/wgmma_v10.cu) launches its
// attend and combine kernels so: launched without, the whole verify took 0.996-1.047x the time at 25 points,
// the most where it is short (data/results/kernel_ab_pdl.h200.json). Its plan kernel triggers at once; the
// attend kernels do not: with a trigger at their start it took 0.998-1.027x the time
// (data/results/kernel_ab_trigger.h200.json).
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ----------------------------------------------------------------------------- Hopper primitives

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#include "common/wgmma.cuh"

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void prefetch_l2(const void* src, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

// Arrives once every cp.async this thread issued so far has landed (the count must include it).
__device__ __forceinline__ void bar_arrive_copies(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// d[64 x 64] (+)= A[64 x 16] B[16 x 64]: A from registers (the mma.m16n8k16 A fragment per warp), B K-major
// in shared memory.
__device__ __forceinline__ void wgmma_s_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : ACC32(d, 0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

#define WG_N256_D                                                                                    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                        \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "               \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "               \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "               \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "               \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "               \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "   \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "

// d[64 x 256] (+)= A[64 x 16] B[16 x 256]: A from registers (the mma.m16n8k16 A fragment per warp),
// B MN-major in shared memory; acc 0: d = A B.
__device__ __forceinline__ void wgmma_pv_rs(float (&d)[128], const unsigned (&a)[4], unsigned long long db,
                                            int acc = 1) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " WG_N256_D
        "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        : ACC32(d, 0), ACC32(d, 32), ACC32(d, 64), ACC32(d, 96)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

// d[64 x 256] (+)= A[64 x 16] B[16 x 256]: A K-major, B MN-major, both in shared memory; acc 0: d = A B.
__device__ __forceinline__ void wgmma_pv_ss(float (&d)[128], unsigned long long da, unsigned long long db,
                                            int acc = 1) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " WG_N256_D
        "%128, %129, p, 1, 1, 0, 1;\n}\n"
        : ACC32(d, 0), ACC32(d, 32), ACC32(d, 64), ACC32(d, 96)
        : "l"(da), "l"(db), "r"(acc));
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// An accumulator's rows of this thread (its m64 fragment: rows g at 4i, 4i + 1, g + 8 at 4i + 2, 4i + 3)
// *= their factors c0, c1.
template <int N>
__device__ __forceinline__ void scale_rows(float (&x)[N], float c0, float c1) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        x[4 * i + 0] *= c0;
        x[4 * i + 1] *= c0;
        x[4 * i + 2] *= c1;
        x[4 * i + 3] *= c1;
    }
}

// O rows of this thread *= their factors (rows g: c0, g + 8: c1), skipped when no row of the warp moved.
__device__ __forceinline__ void rescale(float (&o)[128], float c0, float c1) {
    if (!__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) return;
    scale_rows(o, c0, c1);
}

// An opaque copy: keeps the compiler from hoisting the 36 loop-invariant descriptors of a tile
// out of the loop into registers (it would otherwise hold them all live).
__device__ __forceinline__ unsigned opaque(unsigned x) {
    unsigned y;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// ----------------------------------------------------------------- the seesaw's parts (v6, v7)

// Versions 6 and 7 run the same two MMA warpgroups over a job's tiles two at a time (stage 0: tile A,
// stage 1: tile B, each K stage nine column blocks with a full barrier each; wgmma_v6.cu says how).

// The full barriers of the two K stages, one per (stage, column block), at the start of the barriers.
#define BAR_CBFULL(bars, s, c) ((bars) + 8 * ((s) * NCB + (c)))

// Named barriers of the two MMA warpgroups (256 threads): one arrives, the other waits.
__device__ __forceinline__ void nb_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void nb_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
// Named barrier id of one MMA warpgroup's 128 threads.
__device__ __forceinline__ void wg_sync(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

// A position in a CTA's stream of tile pairs: job j (-1: the end), pair i of it.
struct Pos {
    int j, i;
};

__device__ __forceinline__ int npairs(const Job& jb) { return (jb.ntiles + 1) >> 1; }

// plan[0] (the number of jobs) read where needed rather than held in a register all along. The plan is in
// global memory (a kernel argument: the space is known at compile time) or, in the attend kernels that make
// their own (tree_verify_v10_attend_own), in shared memory.
__device__ __forceinline__ int plan_jobs(const int* plan) {
    int n;
    if (__isShared(plan))
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(n) : "r"((unsigned)__cvta_generic_to_shared(plan)));
    else
        asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(n) : "l"(plan));
    return n;
}

// The pair after p, whose job is jb; sets fresh when it starts another job, whose index next() gives (-1: the end).
template <class Next>
__device__ __forceinline__ Pos pos_after(const Job& jb, Pos p, bool& fresh, Next next) {
    fresh = false;
    if (p.j < 0) return p;
    if (p.i + 1 < npairs(jb)) return Pos{p.j, p.i + 1};
    fresh = true;
    return Pos{next(), 0};
}

// pos_after in the static round-robin: CTA c's jobs c, c + G, c + 2G, ...
__device__ __forceinline__ Pos pos_next(const int* plan, const Job& jb, Pos p, bool& fresh) {
    return pos_after(jb, p, fresh, [&] {
        const int j = p.j + (int)gridDim.x;
        return j < plan_jobs(plan) ? j : -1;
    });
}

// pos_next with p's job decoded from the plan.
__device__ __forceinline__ Pos pos_next(const int* plan, int nreq, Pos p, bool& fresh) {
    if (p.j < 0) {
        fresh = false;
        return p;
    }
    return pos_next(plan, decode_job(plan, nreq, p.j), p, fresh);
}

// The gather sources of one tile for this thread's rows lrow + 16 p: row indices into the prefix
// pool (page-table slots) or into tree_kv (b * Q + key); bit p of `valid`: row p is inside the key
// range; `tail`: the rows are tree rows.
struct TileRows {
    int row[4];
    unsigned char valid;
    bool tail;
};

// Tile `it` of job jb (past the job's tiles: an empty tile, every key masked and zero-filled).
__device__ __forceinline__ TileRows tile_rows(const Job& jb, const int* page_table, int P, int Q, int it, int lrow) {
    TileRows t;
    int k0 = 0, kend = 0;
    t.tail = false;
    if (it < jb.ntiles) tile_keys(jb, it, t.tail, k0, kend);
    t.valid = 0;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int key = k0 + lrow + 16 * p;
        const bool ok = key < kend;
        t.valid |= ok << p;
        t.row[p] = t.tail ? jb.b * Q + (ok ? key : 0) : (ok ? page_table[(long long)jb.b * P + key] : 0);
    }
    return t;
}

// tile_rows of job j, decoded from the plan.
__device__ __forceinline__ TileRows tile_rows(const int* plan, int nreq, const int* page_table, int P, int Q, int j,
                                              int it, int lrow) {
    return tile_rows(decode_job(plan, nreq, j), page_table, P, Q, it, lrow);
}

// Column blocks [cb0, cb1) of a tile into the stage at dst, one mbarrier arrive per block once the
// thread's copies of it (and of every block before) have landed. copies: each chunk's copies, 1 but in the
// timing probes of tree_verify/wgmma_ws.cuh (0: the arrives alone, the stage keeps what it holds, TV7_PROBE 2
// and 8; 2: the same bytes twice, TV7_PROBE 9). NCH: 16-byte chunks a thread copies of
// each 128-byte row piece, ch and ch + 8 / NCH ... (2: the FP8 build's 64-thread fillers). ONE: a single
// arrive, on block CB0's barrier, once the copies of every block have landed. NP: the thread's rows lrow + 16 p,
// p < NP (2: the first 32 rows of the tile at dst, gather_read/stage_v1.cu's push arm).
template <int CB0, int CB1, int NCH = 1, bool ONE = false, int NP = 4>
__device__ __forceinline__ void gather_half(unsigned dst, unsigned bars, int s, const TileRows& t, const char* kvb,
                                            const char* tkb, int lrow, int ch, int copies = 1) {
    static_assert(NP >= 1 && NP <= 4, "NP: 1 to 4 rows a thread");
    const char* src[NP];
#pragma unroll
    for (int p = 0; p < NP; ++p) src[p] = (t.tail ? tkb : kvb) + (long long)t.row[p] * (D_QK * 2) + ch * 16;
#pragma unroll 1
    for (int cb = CB0; cb < CB1; ++cb) {
#pragma unroll 1
        for (int r = 0; r < copies; ++r)
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                const int row = lrow + 16 * p;
#pragma unroll
                for (int k = 0; k < NCH; ++k) {
                    const int c = ch + 8 / NCH * k;
                    cp_async16(dst + cb * CB_BYTES + row * 128 + ((c ^ (row & 7)) << 4),
                               src[p] + cb * 128 + 8 / NCH * k * 16, (t.valid >> p) & 1 ? 16 : 0);
                }
            }
        if (!ONE) bar_arrive_copies(BAR_CBFULL(bars, s, cb));
    }
    if (ONE) bar_arrive_copies(BAR_CBFULL(bars, s, CB0));
}

// Q of job jb into shared memory by cp.async (one warpgroup, wt its thread; rows past the valid ones zero).
__device__ __forceinline__ void copy_q(unsigned base, const __nv_bfloat16* q, const Job& jb, int M, int wt) {
    const char* qg = reinterpret_cast<const char*>(q + ((long long)jb.b * M + jb.row0) * D_QK);
    const int r = wt >> 3, c = wt & 7;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int row = r + 16 * p;
        const bool ok = row < jb.nrows;
        const char* src = qg + (ok ? (long long)row * D_QK * 2 : 0) + c * 16;
        const unsigned dst = base + row * 128 + ((c ^ (row & 7)) << 4);
#pragma unroll
        for (int cb = 0; cb < NCB; ++cb) cp_async16(dst + cb * CB_BYTES, src + cb * 128, ok ? 16 : 0);
    }
}

// copy_q, then the thread's arrive on the Q barrier once its copies land.
__device__ __forceinline__ void load_q(unsigned base, unsigned qbar, const __nv_bfloat16* q, const Job& jb, int M,
                                       int wt) {
    copy_q(base, q, jb, M, wt);
    bar_arrive_copies(qbar);
}

// S (+)= Q K^T over column blocks [CB0, CB1) of the stage at kst, S_GROUP blocks at a time (issue_s_group): the
// group's barriers (parity par), one proxy fence, the group's MMAs. first: the first block of this S (it starts
// the sum). The proxy fence is a MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S in SASS; a fence per block (9 a tile) cost
// more than the finer waits gain. Measured on the whole verify, bit for bit the same output at 25 points
// (data/results/history/kernel_ab_*.h200.json): three blocks a fence 1.000-1.056x one a block (fence3.05e751f);
// against that, unrolled groups of 2, 3 and 4 blocks 0.996-1.016x, 0.998-1.015x and 1.005-1.032x (sgroup2u,
// sgroup3u, sgroup4u); on an H100, against groups of 4 at 2e6f7e6, groups of 5 (two fences a tile) 0.991-1.038x,
// median 1.019 (kernel_ab_g5.1d4189b.h100-80gb-hbm3.json), as fast as no reader fence at all (the bound, not a
// valid kernel: median 1.019, kernel_ab_nf.b16aeef). The producer fencing its own landed copies before it
// arrives, readers unfenced, measured 0.78-0.98x (kernel_ab_pf*.h100-80gb-hbm3.json): its fences stall its gathers.
// One group of all nine blocks (one fence a tile, every wait before the first MMA) against groups of 5: 0.956-1.016x,
// slower at 22 of 25 points (kernel_ab_sgroup9.ac60415.h100-80gb-hbm3.json).
#define S_GROUP 5

// Blocks [g0, g0 + NB) of issue_s_blocks: their barriers, one proxy fence, their MMAs, unrolled. With a loop of
// a run-time count around the wgmmas ptxas put a WARPGROUP.DEPBAR after every wgmma (kernel_ab_sgroup3.ab20b66,
// 0.71-0.75x); so it did in version 6's SASS with one wgmma.fence ahead of the waits of each of its three calls.
// acc0: the group's first MMA adds to s. qf (non-null): Q's rope block as A fragments (q_rope_frags), its MMAs
// with A from registers.
template <int NB>
__device__ __forceinline__ void issue_s_group(float (&s)[32], unsigned long long dq, unsigned long long dk,
                                              unsigned bars, int st, unsigned par, int g0, bool acc0,
                                              const unsigned (*qf)[4] = nullptr) {
#pragma unroll
    for (int j = 0; j < NB; ++j) bar_wait(BAR_CBFULL(bars, st, g0 + j), par);
    fence_async_smem();
    wg_fence();
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned off = (g0 + j) * CB_BYTES + k * 32;
            if (qf != nullptr && g0 + j == ROPE_CB) wgmma_s_rs(s, qf[k], dk + (off >> 4), acc0 || j > 0 || k > 0);
            else wgmma_s(s, dq + (off >> 4), dk + (off >> 4), acc0 || j > 0 || k > 0);
        }
}

template <int CB0, int CB1>
__device__ __forceinline__ void issue_s_blocks(float (&s)[32], unsigned base, unsigned kst, unsigned bars, int st,
                                               unsigned par, bool first, const unsigned (*qf)[4] = nullptr) {
    constexpr int NG = (CB1 - CB0) / S_GROUP, TAIL = (CB1 - CB0) % S_GROUP;
    const unsigned long long dq = sw128_desc(opaque(base), 16), dk = sw128_desc(opaque(kst), 16);
#pragma unroll 1  // a loop over the groups: the kernel's code fits the instruction cache better
    for (int g = 0; g < NG; ++g)
        issue_s_group<S_GROUP>(s, dq, dk, bars, st, par, CB0 + g * S_GROUP, !first || g > 0, qf);
    if constexpr (TAIL > 0) issue_s_group<TAIL>(s, dq, dk, bars, st, par, CB1 - TAIL, !first || NG > 0, qf);
}

// 2^x on the SFU alone (MUFU.EX2, results below 2^-126 flushed to 0): exp2f adds a compare and two
// predicated multiplies a value to keep those results denormal. Alone it kept the bits at 25 points and timed
// 0.986-1.006x, median 0.996 (data/results/history/kernel_ab_e.66734e6.h200.json): what it saves is issue
// slots, and the softmax stretch is not bound by them (a cubic for a quarter or half of the exponentials, off
// the SFU, measured 0.975-1.006x and 0.950-0.998x: kernel_ab_p8.ca7ba10, kernel_ab_p16.91f0544).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// s <- 2^(s sl2 - ms) row-wise, the scale and the shift one FFMA (one rounding, where a multiply in
// mask_tile and a subtract here made two: other bits than before, 0.996-1.014x the whole verify, median 1.007,
// data/results/history/kernel_ab_f.e645edf.h200.json, and one device call later 0.976-1.012x, median 1.004,
// kernel_ab_fold.81fcb3e: a gain within the spread between calls); s then holds P in fp32; the rows' partial
// sums added to l0, l1.
__device__ __forceinline__ void exp_tile(float (&s)[32], float sl2, float ms0, float ms1, float& l0, float& l1) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
        s[4 * jj + 0] = ex2(fmaf(s[4 * jj + 0], sl2, -ms0));
        s[4 * jj + 1] = ex2(fmaf(s[4 * jj + 1], sl2, -ms0));
        s[4 * jj + 2] = ex2(fmaf(s[4 * jj + 2], sl2, -ms1));
        s[4 * jj + 3] = ex2(fmaf(s[4 * jj + 3], sl2, -ms1));
        l0 += s[4 * jj + 0] + s[4 * jj + 1];
        l1 += s[4 * jj + 2] + s[4 * jj + 3];
    }
}

// The rows' new running maxima: the last ones mp and the tile's mx (mask_tile's).
__device__ __forceinline__ void new_maxima(float mp0, float mp1, float mx0, float mx1, float& mn0, float& mn1) {
    mn0 = fmaxf(mp0, mx0);
    mn1 = fmaxf(mp1, mx1);
}

// The shift a row's exponentials take from its running maximum m: 0 for a row with no key yet (m -inf).
__device__ __forceinline__ float shift_of(float m) { return m == NEG_INF ? 0.f : m; }

// The online-softmax step of one tile (log2 domain): from the rows' running maxima mp and the tile's
// maxima mx (mask_tile's), the new maxima mn and the factors c = 2^(mp - mn) of what came before; l = l c +
// the rows' sums of P; s (unscaled) <- P = 2^(s sl2 - mn) (fp32). A row with no key yet keeps mn -inf, c and
// P 0.
__device__ __forceinline__ void softmax_step(float (&s)[32], float sl2, float mp0, float mp1, float mx0, float mx1,
                                             float& mn0, float& mn1, float& c0, float& c1, float& l0, float& l1) {
    new_maxima(mp0, mp1, mx0, mx1, mn0, mn1);
    const float ms0 = shift_of(mn0), ms1 = shift_of(mn1);
    c0 = ex2(mp0 - ms0);
    c1 = ex2(mp1 - ms1);
    l0 *= c0;
    l1 *= c1;
    exp_tile(s, sl2, ms0, ms1, l0, l1);
}

// P (bf16, fp32 s) as the A fragments of P V's four k16 steps: the S accumulator's layout is the m16n8k16 A
// fragment's, so step kk takes keys 16 kk .. 16 kk + 15 of the thread's rows (rows g: [kk][0], [kk][2]; g + 8:
// [kk][1], [kk][3]).
__device__ __forceinline__ void p_frags(const float (&s)[32], unsigned (&pf)[4][4]) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
        pf[jj >> 1][(jj & 1) * 2 + 0] = pack_bf16(s[4 * jj + 0], s[4 * jj + 1]);
        pf[jj >> 1][(jj & 1) * 2 + 1] = pack_bf16(s[4 * jj + 2], s[4 * jj + 3]);
    }
}

// Where P's bf16 pair (row lr, keys 8 jj + 2 t4 and the next) goes in a column block's K-major swizzled layout.
__device__ __forceinline__ unsigned p_addr(unsigned dst, int lr, int jj, int t4) {
    return dst + (lr >> 3) * 1024 + (lr & 7) * 128 + ((jj ^ (lr & 7)) << 4) + 4 * t4;
}

// P (bf16, fp32 s) into shared memory at dst in a column block's K-major swizzled layout.
__device__ __forceinline__ void store_p(const float (&s)[32], unsigned dst, int lr0, int lr1, int t4) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
        const unsigned a0 = p_addr(dst, lr0, jj, t4), a1 = p_addr(dst, lr1, jj, t4);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a0), "r"(pack_bf16(s[4 * jj + 0], s[4 * jj + 1])) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a1), "r"(pack_bf16(s[4 * jj + 2], s[4 * jj + 3])) : "memory");
    }
}

// store_p from P's fragments (p_frags).
__device__ __forceinline__ void store_p(const unsigned (&pf)[4][4], unsigned dst, int lr0, int lr1, int t4) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
        const unsigned a0 = p_addr(dst, lr0, jj, t4), a1 = p_addr(dst, lr1, jj, t4);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a0), "r"(pf[jj >> 1][(jj & 1) * 2 + 0]) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a1), "r"(pf[jj >> 1][(jj & 1) * 2 + 1]) : "memory");
    }
}

// Q's rope block (column block ROPE_CB of Q at base) as the A fragments of S's four k16 steps over it, as
// p_frags lays P's: the same K-major swizzled layout, read where store_p writes.
__device__ __forceinline__ void q_rope_frags(unsigned base, unsigned (&qf)[4][4], int lr0, int lr1, int t4) {
    const unsigned rope = base + ROPE_CB * CB_BYTES;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(qf[jj >> 1][(jj & 1) * 2 + 0]) : "r"(p_addr(rope, lr0, jj, t4)));
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(qf[jj >> 1][(jj & 1) * 2 + 1]) : "r"(p_addr(rope, lr1, jj, t4)));
    }
}

// O[:, half] += P V over the 64 keys of a stage: P (pbuf) and V's half (vhalf) in shared memory.
// fresh: the job's first P V, which overwrites O (whatever the previous job left there) instead of adding.
__device__ __forceinline__ void issue_pv_ss(float (&o)[128], unsigned pbuf, unsigned vhalf, bool fresh = false) {
    const unsigned long long dp = sw128_desc(pbuf, 16), dv = sw128_desc(vhalf, CB_BYTES);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_pv_ss(o, dp + ((kk * 32) >> 4), dv + ((kk * 2048) >> 4), kk > 0 || !fresh);
}

// O[:, half] += P V over the 64 keys of a stage, P from registers (p_frags), V's half (vhalf) in shared memory.
__device__ __forceinline__ void issue_pv_rs(float (&o)[128], const unsigned (&pf)[4][4], unsigned vhalf,
                                            bool fresh = false) {
    const unsigned long long dv = sw128_desc(vhalf, CB_BYTES);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_pv_rs(o, pf[kk], dv + ((kk * 2048) >> 4), kk > 0 || !fresh);
}

// The job's rows of this warpgroup's O half, normalised, and (warpgroup 0) their lse.
__device__ __forceinline__ void write_out(const float (&o)[128], float* parts, float* part_lse, int j, int col0,
                                          int nrows, int lr0, int lr1, int t4, float i0, float i1, float lse0,
                                          float lse1, bool lse) {
    const long long orow = (long long)j * BM;
    if (lr0 < nrows) {
        float* dst = parts + (orow + lr0) * D_V + col0 + 2 * t4;
#pragma unroll
        for (int i = 0; i < 32; ++i) *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[4 * i] * i0, o[4 * i + 1] * i0);
        if (lse && t4 == 0) part_lse[orow + lr0] = lse0;
    }
    if (lr1 < nrows) {
        float* dst = parts + (orow + lr1) * D_V + col0 + 2 * t4;
#pragma unroll
        for (int i = 0; i < 32; ++i)
            *reinterpret_cast<float2*>(dst + 8 * i) = make_float2(o[4 * i + 2] * i1, o[4 * i + 3] * i1);
        if (lse && t4 == 0) part_lse[orow + lr1] = lse1;
    }
}

// The job's l = l_0 + l_1 in MMA warpgroup wg (each warpgroup's sums through s_l [2][64], named barrier lsum)
// -> its rows' factors i0, i1 (1 / l) and lse0, lse1 (natural log).
__device__ __forceinline__ void job_sums(float m0, float m1, float l0, float l1, float* s_l, int lsum, int wg,
                                         int lr0, int lr1, int t4, float& i0, float& i1, float& lse0, float& lse1) {
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    if (t4 == 0) {
        s_l[wg * BM + lr0] = l0;
        s_l[wg * BM + lr1] = l1;
    }
    nb_sync(lsum);
    const float lt0 = s_l[lr0] + s_l[BM + lr0], lt1 = s_l[lr1] + s_l[BM + lr1];
    i0 = lt0 > 0.f ? 1.f / lt0 : 0.f;
    i1 = lt1 > 0.f ? 1.f / lt1 : 0.f;
    lse0 = lt0 > 0.f ? (m0 + log2f(lt0)) * LN2 : NEG_INF;
    lse1 = lt1 > 0.f ? (m1 + log2f(lt1)) * LN2 : NEG_INF;
}

// The job's end in MMA warpgroup wg: job_sums, the warpgroup's half of O normalised into parts and (wg 0) the
// rows' lse; then m -inf and l 0 for the next job, whose first P V overwrites o. nrows() gives the job's valid
// rows (called only past the barrier: nothing extra held live across it).
template <class Rows>
__device__ __forceinline__ void job_end(const float (&o)[128], float& m0, float& m1, float& l0, float& l1, float* s_l,
                                        int lsum, int wg, float* parts, float* part_lse, int j, Rows nrows, int lr0,
                                        int lr1, int t4) {
    float i0, i1, lse0, lse1;
    job_sums(m0, m1, l0, l1, s_l, lsum, wg, lr0, lr1, t4, i0, i1, lse0, lse1);
    write_out(o, parts, part_lse, j, wg * 256, nrows(), lr0, lr1, t4, i0, i1, lse0, lse1, wg == 0);
    m0 = m1 = NEG_INF;
    l0 = l1 = 0.f;
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ----------------------------------------------------------------------------------------- combine

// LSE merge of each row's jobs. parts / part_lse as the attend kernel wrote them, plan ->
// out [B*M, 512] fp32, lse [B*M] fp32. Rows at or past a request's rows_b (verify padding) are NaN;
// a row without jobs (empty prefix, no tail) is out 0, lse -inf. Grid (B*M, COMBINE_SLICES), block
// 128: block (n, s) merges row n's columns [128 s, 128 s + 128). The block's threads take the max and
// the sum of exp over the row's jobs (strided, then a fixed-order tree); for the weighted sum warp w
// takes jobs w, w + 4, ..., lane l the float4 of columns 128 s + 4 l, four loads in flight, and the
// four warps' sums are added in warp order: bit-for-bit reproducible, many rows' worth of loads in
// flight where one block per row left a short prefix's few rows waiting on one load each.
#define COMBINE_COLS 128
#define COMBINE_SLICES (D_V / COMBINE_COLS)

// The warp's 32 lanes reduced by a butterfly (xor 16, 8, 4, 2, 1; max when is_max, else sum): each step adds
// or compares the same two values on both sides, so every lane gets the same bits.
__device__ __forceinline__ float warp_reduce(float v, bool is_max) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, v, off);
        v = is_max ? fmaxf(v, o) : v + o;
    }
    return v;
}

// Block-wide reduction of 128 threads in a fixed order (max when is_max, else sum); every thread gets it.
__device__ __forceinline__ float block_reduce128(float v, bool is_max, float* red) {
    v = warp_reduce(v, is_max);
    const int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) red[w] = v;
    __syncthreads();
    v = is_max ? fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3])) : (red[0] + red[1]) + (red[2] + red[3]);
    __syncthreads();  // red is reused by the next reduction
    return v;
}

extern "C" __global__ void __launch_bounds__(128) tree_verify_v5_combine(
    const float* __restrict__ parts, const float* __restrict__ part_lse, const int* __restrict__ plan, int M,
    float* __restrict__ out, float* __restrict__ lse) {
    __shared__ float red[4];
    __shared__ float4 wsum[3][32];
    const long long n = blockIdx.x;
    const int b = (int)(n / M), r = (int)(n - (long long)b * M);
    const int t = threadIdx.x, w = t >> 5, l = t & 31;
    const int col = blockIdx.y * COMBINE_COLS + 4 * l;
    const int* e = plan + PLAN_HDR + b * PLAN_STRIDE;
    float4* o = reinterpret_cast<float4*>(out + n * D_V + col);
    if (r >= e[P_ROWS]) {
        if (w == 0) *o = make_float4(QNAN, QNAN, QNAN, QNAN);
        if (t == 0 && blockIdx.y == 0) lse[n] = QNAN;
        return;
    }
    const int nch = e[P_NCHUNK], rbn = e[P_RB];
    const long long first = (long long)e[P_BASE] + r / BM, lr = r % BM;  // job of chunk i: first + i * rbn
    float mx = NEG_INF;
    for (int i = t; i < nch; i += 128) mx = fmaxf(mx, part_lse[(first + (long long)i * rbn) * BM + lr]);
    mx = block_reduce128(mx, true, red);
    const float base = mx == NEG_INF ? 0.f : mx;
    float z = 0.f;
    for (int i = t; i < nch; i += 128) z += expf(part_lse[(first + (long long)i * rbn) * BM + lr] - base);
    z = block_reduce128(z, false, red);
    const float inv = z > 0.f ? 1.f / z : 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int i = w; i < nch; i += 4) {
        const long long jrow = (first + (long long)i * rbn) * BM + lr;
        const float wt = expf(part_lse[jrow] - base) * inv;
        const float4 v = *reinterpret_cast<const float4*>(parts + jrow * D_V + col);
        acc.x = fmaf(wt, v.x, acc.x);
        acc.y = fmaf(wt, v.y, acc.y);
        acc.z = fmaf(wt, v.z, acc.z);
        acc.w = fmaf(wt, v.w, acc.w);
    }
    if (w > 0) wsum[w - 1][l] = acc;
    __syncthreads();
    if (w == 0) {
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            const float4 v = wsum[k][l];
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        *o = acc;
        if (t == 0 && blockIdx.y == 0) lse[n] = z > 0.f ? base + logf(z) : NEG_INF;
    }
}
