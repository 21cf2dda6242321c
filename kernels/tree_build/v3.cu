// tree_build_v3: tree_build_v2 with the log-probs a candidate will need carried in its slot.
//
// Same contract, arithmetic and layout as tree_build_v2 (bit-exact twin of
// kdlib.ref.tree.build_tree_batch; frontier in warp 0's registers, R rows of 32 slots). v2 reads
// lp[d-1][r], lp[d-1][r+1] and lp[d][0] from shared memory after the winner is known, one shared
// round trip on the dependent chain of every pop. Here each slot also holds those three values
// (as float64: the table is converted once, in the prologue), so the winner's arrive with its
// score in the same shuffles, and the shared loads for the two new candidates (lp[d-1][r+2],
// lp[d][1], lp[d+1][0]) overlap the float64 adds.
//
// Kernels tree_build_v3_r{1,3,9}: budget + 1 <= 32 R (budget <= 31, 95, 256).
// Dynamic shared memory (bytes), S = budget + 1, W = ceil(S / 32):
//   16 * S + 8 * S * W + 8 * L_eff * K
// = 55,384 B at budget 256, L_eff 16, K 256 (the wrapper opts in above 48 KB).

#define TB3_THREADS 128  // 4 warps: warp 0 runs the pops, all 4 build the lists and write outputs

#include "common/exact_f64.cuh"
#include "common/tree_keys.cuh"

template <int R>
__device__ __forceinline__ void build3(
    const long long* __restrict__ ids, const float* __restrict__ lp,
    int L, int Kp, int K, int L_eff, int budget,
    long long* __restrict__ sizes, long long* __restrict__ node_token_ids, long long* __restrict__ node_depths,
    long long* __restrict__ parents, unsigned char* __restrict__ visibility, long long* __restrict__ next_token,
    long long* __restrict__ next_sibling, long long* __restrict__ positions, double* __restrict__ scores)
{
    const int b = blockIdx.x;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int S = budget + 1;
    const int W = (S + 31) >> 5;

    extern __shared__ __align__(16) unsigned char smem[];
    double* n_score = (double*)smem;            // [S] score of node i (i >= 1)
    int* n_parent = (int*)(n_score + S);        // [S]
    int* n_src = n_parent + S;                  // [S] (depth - 1) * Kp + rank of node i; n_src[0] = n
    unsigned* cmask = (unsigned*)(n_src + S);   // [S, W] children of node i
    unsigned* amask = cmask + S * W;            // [S, W] ancestors-or-self of node i
    double* lps = (double*)(smem + 16 * S + 8 * S * W);  // [L_eff, K] float64 (offset a multiple of 8)

    const long long* ids_b = ids + (long long)b * L * Kp;
    const float* lp_b = lp + (long long)b * L * Kp;
    for (int i = tid; i < S * W; i += TB3_THREADS) cmask[i] = 0u;
    for (int i = tid; i < L_eff * K; i += TB3_THREADS) {
        const int d = i / K;
        lps[i] = to_f64(lp_b[d * Kp + (i - d * K)]);
    }
    __syncthreads();

    if (tid < 32) {
        const unsigned FULL = 0xffffffffu;
        const bool empty_tree = (budget == 0 || L_eff == 0 || K == 0);
        // The frontier: slot r * 32 + lane.
        u64 key[R], hi[R], lo[R];
        double sc[R], la[R], lb[R], lc[R];  // lp[d-1][r], lp[d-1][r+1], lp[d][0] of the slot's node
        unsigned meta[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            key[r] = 0ull; hi[r] = 0ull; lo[r] = 0ull; sc[r] = 0.0; meta[r] = 0u; la[r] = 0.0; lb[r] = 0.0; lc[r] = 0.0;
        }
        if (lane == 0 && !empty_tree) {
            sc[0] = lps[0];
            key[0] = okey(sc[0]);
            meta[0] = 1u << 16;  // parent 0, depth 1, rank 0
            la[0] = lps[0];
            lb[0] = (K > 1) ? lps[1] : 0.0;
            lc[0] = (L_eff > 1) ? lps[K] : 0.0;
        }
        // This lane's best slot (a copy of its registers).
        u64 bkey = key[0], bhi = 0ull, blo = 0ull;
        double bsc = sc[0], bla = la[0], blb = lb[0], blc = lc[0];
        unsigned bmeta = meta[0];
        int brow = 0;
        int nslots = empty_tree ? 0 : 1;
        int n = 0;
        if (lane == 0) n_parent[0] = -1;

        for (int count = 0; count < budget && !empty_tree; ++count) {
            // 1) winner lane: max okey (top then low 32 bits), then lowest rank tuple.
            const unsigned h32 = (unsigned)(bkey >> 32);
            const unsigned mhi = __reduce_max_sync(FULL, h32);
            if (mhi == 0u) break;  // frontier empty
            unsigned cand = __ballot_sync(FULL, h32 == mhi);
            if (__popc(cand) > 1) {
                const unsigned mlo = __reduce_max_sync(FULL, (h32 == mhi) ? (unsigned)bkey : 0u);
                cand = __ballot_sync(FULL, h32 == mhi && (unsigned)bkey == mlo);
            }
            int wl = __ffs(cand) - 1;
            if (__popc(cand) > 1) {  // exact score tie across lanes (rare): compare rank tuples
                u64 whi = __shfl_sync(FULL, bhi, wl), wlo = __shfl_sync(FULL, blo, wl);
                unsigned wm = __shfl_sync(FULL, bmeta, wl);
                unsigned rest = cand & (cand - 1);
                while (rest) {
                    const int l = __ffs(rest) - 1;
                    rest &= rest - 1;
                    const u64 ohi = __shfl_sync(FULL, bhi, l), olo = __shfl_sync(FULL, blo, l);
                    const unsigned om = __shfl_sync(FULL, bmeta, l);
                    if (ranks_less(ohi, olo, om, whi, wlo, wm)) { wl = l; whi = ohi; wlo = olo; wm = om; }
                }
            }
            // 2) the winner, broadcast from its lane.
            const double logw = __shfl_sync(FULL, bsc, wl);
            const double lp_r = __shfl_sync(FULL, bla, wl);
            const double lp_r1 = __shfl_sync(FULL, blb, wl);
            const double lp_c = __shfl_sync(FULL, blc, wl);
            const unsigned m = __shfl_sync(FULL, bmeta, wl);
            const u64 khi = __shfl_sync(FULL, bhi, wl), klo = __shfl_sync(FULL, blo, wl);
            const int wrow = __shfl_sync(FULL, brow, wl);
            const int idx = count + 1;
            const int parent = (int)(m & 0xFFFFu);
            const int depth = (int)((m >> 16) & 0xFFu);
            const int rank = (int)(m >> 24);
            const bool has_sib = rank + 1 < K;
            const bool has_child = depth < L_eff;
            // log-probs the two new candidates will need when they are popped
            const double sib_lb = (rank + 2 < K) ? lps[(depth - 1) * K + rank + 2] : 0.0;
            const double ch_lb = (has_child && K > 1) ? lps[depth * K + 1] : 0.0;
            const double ch_lc = (depth + 1 < L_eff) ? lps[(depth + 1) * K] : 0.0;
            if (lane == 0) {
                n_parent[idx] = parent;
                n_src[idx] = (depth - 1) * Kp + rank;
                n_score[idx] = logw;
            }
            // 3) the two pushes.
            const double sib = (logw - lp_r) + lp_r1;
            const double ch = logw + lp_c;
            const u64 sib_key = okey(sib), ch_key = okey(ch);
            const int p8 = depth - 1;  // byte of this depth's rank in (hi, lo)
            const u64 sib_hi = (p8 < 8) ? khi + (1ull << (8 * (7 - p8))) : khi;
            const u64 sib_lo = (p8 < 8) ? klo : klo + (1ull << (8 * (15 - p8)));
            const unsigned sib_meta = (unsigned)parent | ((unsigned)depth << 16) | ((unsigned)(rank + 1) << 24);
            const unsigned ch_meta = (unsigned)idx | ((unsigned)(depth + 1) << 16);
            const int ns = nslots;  // the child's slot when the sibling takes the popped one
            const bool both = has_sib && has_child;
            // Row masks rather than `r == row` tests: the latter lets the compiler fold the
            // unrolled stores into one indexed store, which moves the arrays to local memory.
            const unsigned wbits = (lane == wl) ? (1u << wrow) : 0u;
            const unsigned cbits = (both && lane == (ns & 31)) ? (1u << (ns >> 5)) : 0u;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if ((wbits >> r) & 1u) {
                    key[r] = has_sib ? sib_key : (has_child ? ch_key : 0ull);
                    sc[r] = has_sib ? sib : ch;
                    hi[r] = has_sib ? sib_hi : khi;
                    lo[r] = has_sib ? sib_lo : klo;
                    meta[r] = has_sib ? sib_meta : ch_meta;
                    la[r] = has_sib ? lp_r1 : lp_c;
                    lb[r] = has_sib ? sib_lb : ch_lb;
                    lc[r] = has_sib ? lp_c : ch_lc;
                }
                if ((cbits >> r) & 1u) {
                    key[r] = ch_key;
                    sc[r] = ch;
                    hi[r] = khi;
                    lo[r] = klo;
                    meta[r] = ch_meta;
                    la[r] = lp_c;
                    lb[r] = ch_lb;
                    lc[r] = ch_lc;
                }
            }
            if (both) ++nslots;
            // 4) this lane's best again (only the winner's lane and the child's lane changed).
            if (wbits | cbits) {
                bkey = 0ull;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const bool better = key[r] > bkey ||
                        (key[r] == bkey && key[r] != 0ull && ranks_less(hi[r], lo[r], meta[r], bhi, blo, bmeta));
                    if (better) {
                        bkey = key[r]; bsc = sc[r]; bhi = hi[r]; blo = lo[r]; bmeta = meta[r]; brow = r;
                        bla = la[r]; blb = lb[r]; blc = lc[r];
                    }
                }
            }
            n = idx;
        }
        if (lane == 0) n_src[0] = n;
    }
    __syncthreads();
    const int n = n_src[0];

    // 5) LCRS from child bitmasks; ancestor bitmasks by walking each row's parent chain.
    for (int c = 1 + tid; c <= n; c += TB3_THREADS) atomicOr(&cmask[n_parent[c] * W + (c >> 5)], 1u << (c & 31));
    for (int i = tid; i <= n; i += TB3_THREADS) {
        unsigned bits[R];
#pragma unroll
        for (int r = 0; r < R; ++r) bits[r] = 0u;
        for (int a = i; a >= 0; a = n_parent[a]) {
#pragma unroll
            for (int r = 0; r < R; ++r) bits[r] |= (r == (a >> 5)) ? (1u << (a & 31)) : 0u;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) if (r < W) amask[i * W + r] = bits[r];
    }
    __syncthreads();

    // 6) outputs, all threads; every element of every output is written (padding included).
    if (tid == 0) sizes[b] = n + 1;
    for (int i = tid; i < budget; i += TB3_THREADS) {
        const long long o = (long long)b * budget + i;
        const bool v = i < n;
        const int src = v ? n_src[i + 1] : 0;
        node_token_ids[o] = v ? ids_b[src] : -1ll;
        node_depths[o] = v ? (long long)(src / Kp + 1) : -1ll;
        scores[o] = v ? n_score[i + 1] : __longlong_as_double(0x7ff8000000000000ll);  // NaN padding
    }
    for (int i = tid; i < S; i += TB3_THREADS) {
        const long long o = (long long)b * S + i;
        long long first = -1, sib = -1, par = -1, pos = -1;
        if (i <= n) {
            par = n_parent[i];
            pos = (i == 0) ? 0 : (long long)(n_src[i] / Kp + 1);
            for (int w = 0; w < W; ++w) {
                const unsigned word = cmask[i * W + w];
                if (word) { first = w * 32 + __ffs(word) - 1; break; }
            }
            if (i > 0) {
                const int p = (int)par;
                for (int w = i >> 5; w < W; ++w) {
                    unsigned word = cmask[p * W + w];
                    if (w == (i >> 5)) word &= ((i & 31) == 31) ? 0u : (~0u << ((i & 31) + 1));
                    if (word) { sib = w * 32 + __ffs(word) - 1; break; }
                }
            }
        }
        parents[o] = par;
        next_token[o] = first;
        next_sibling[o] = sib;
        positions[o] = pos;
    }
    unsigned char* vis_b = visibility + (long long)b * S * S;
    for (int e = tid; e < S * S; e += TB3_THREADS) {
        const int i = e / S, j = e - i * S;
        vis_b[e] = (i <= n && j <= n) ? (unsigned char)((amask[i * W + (j >> 5)] >> (j & 31)) & 1u) : (unsigned char)0;
    }
}

#define TB3_ARGS                                                                                   \
    const long long* __restrict__ ids, const float* __restrict__ lp, int L, int Kp, int K, int L_eff, \
    int budget, long long* __restrict__ sizes, long long* __restrict__ node_token_ids,              \
    long long* __restrict__ node_depths, long long* __restrict__ parents,                          \
    unsigned char* __restrict__ visibility, long long* __restrict__ next_token,                    \
    long long* __restrict__ next_sibling, long long* __restrict__ positions, double* __restrict__ scores
#define TB3_PASS ids, lp, L, Kp, K, L_eff, budget, sizes, node_token_ids, node_depths, parents, visibility, \
                 next_token, next_sibling, positions, scores

// Arguments (all kernels): ids [B, L, Kp] int64, lp [B, L, Kp] float32, then the DDTreeBatch
// outputs sizes [B], node_token_ids [B, budget], node_depths [B, budget], parents [B, S],
// visibility [B, S, S] bool, next_token [B, S], next_sibling [B, S], positions [B, S],
// scores [B, budget] float64.
extern "C" __global__ void __launch_bounds__(TB3_THREADS, 1) tree_build_v3_r1(TB3_ARGS) { build3<1>(TB3_PASS); }
extern "C" __global__ void __launch_bounds__(TB3_THREADS, 1) tree_build_v3_r3(TB3_ARGS) { build3<3>(TB3_PASS); }
extern "C" __global__ void __launch_bounds__(TB3_THREADS, 1) tree_build_v3_r9(TB3_ARGS) { build3<9>(TB3_PASS); }
