// tree_build_v1: batched DDTree best-first builder, one thread block per request.
//
// Bit-exact twin of kdlib.ref.tree.build_tree_batch (survey §2.3):
//   * float32 log-probs promoted to float64; first child  = logw + lp[d][0];
//     next sibling = (logw - lp[d-1][r]) + lp[d-1][r+1]  (this grouping, no FMA possible);
//   * the pop is the minimum of the heap key (-logw, rank tuple): the frontier's maximum score,
//     ties broken by the rank tuple in Python tuple order (a proper prefix first).
// Any exact pop-min over the current frontier reproduces the heap's pop order, so the frontier
// lives in a flat slot array in shared memory and warp 0 selects the maximum each step.
//
// Rank tuples are exact in 128 bits: rank r_d (< K <= 256) is byte d-1 of a big-endian
// (hi, lo) pair, depth <= 16; comparing (hi, lo, depth) lexicographically is Python's tuple
// order (shorter tuples are zero-padded, and an equal padded prefix means a proper prefix).
//
// Scores compare as 64-bit order-preserving integers (okey); okey == 0 marks an empty slot.
// The cross-lane maximum uses two 32-bit __reduce_max_sync steps (sm_80+); exact score ties
// fall back to a rank comparison over the tied lanes.
//
// Limits (checked by kdlib.cuda.tree before launch): budget <= 256, K = min(budget, K') <= 256,
// L_eff = min(L, budget) <= 16. Dynamic shared memory (bytes), S = budget + 1, W = ceil(S / 32):
//   64 * S + 4 * S * W + 4 * L_eff * K
// (slot okey, score, rank hi, rank lo, node score: 8 B each; slot meta, node parent, src, next,
// sibling, last child: 4 B each; ancestor bitmask rows; log-probs) = 42,084 B at budget 256,
// L_eff 16, K 256: under the 48 KB a block gets without opting in.

#define TB_THREADS 128  // 4 warps: warp 0 runs the pops, all 4 write the outputs
#define TB_MAX_ROWS 9   // slot rows per lane: ceil(257 / 32) slots at budget 256

#include "common/exact_f64.cuh"
#include "common/tree_keys.cuh"

// True when slot a's rank tuple sorts before slot b's (Python tuple order). It reads lo and meta
// only when hi ties (ranks_less on loaded values compiles to other SASS).
__device__ __forceinline__ bool rank_less(const u64* hi, const u64* lo, const unsigned* meta, int a, int b) {
    if (hi[a] != hi[b]) return hi[a] < hi[b];
    if (lo[a] != lo[b]) return lo[a] < lo[b];
    return ((meta[a] >> 16) & 0xFF) < ((meta[b] >> 16) & 0xFF);
}

extern "C" __global__ void __launch_bounds__(TB_THREADS) tree_build_v1(
    const long long* __restrict__ ids,   // [B, L, Kp] int64
    const float* __restrict__ lp,        // [B, L, Kp] float32, rows sorted descending, finite
    int L, int Kp, int K, int L_eff, int budget,
    long long* __restrict__ sizes,           // [B]
    long long* __restrict__ node_token_ids,  // [B, budget]
    long long* __restrict__ node_depths,     // [B, budget]
    long long* __restrict__ parents,         // [B, S]
    unsigned char* __restrict__ visibility,  // [B, S, S] bool
    long long* __restrict__ next_token,      // [B, S]
    long long* __restrict__ next_sibling,    // [B, S]
    long long* __restrict__ positions,       // [B, S]
    double* __restrict__ scores)             // [B, budget]
{
    const int b = blockIdx.x;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int S = budget + 1;
    const int W = (S + 31) >> 5;

    extern __shared__ __align__(16) unsigned char smem[];
    u64* c_okey = (u64*)smem;                      // [S] slot score key, 0 = empty
    double* c_score = (double*)(c_okey + S);       // [S]
    u64* c_hi = (u64*)(c_score + S);               // [S] ranks of depths 1..8
    u64* c_lo = c_hi + S;                          // [S] ranks of depths 9..16
    double* n_score = (double*)(c_lo + S);         // [S] node i score (i >= 1)
    unsigned* c_meta = (unsigned*)(n_score + S);   // [S] parent | depth << 16 | rank << 24
    int* n_parent = (int*)(c_meta + S);            // [S]
    int* n_src = n_parent + S;                     // [S] (depth - 1) * Kp + rank of node i
    int* n_next = n_src + S;                       // [S] first child
    int* n_sib = n_next + S;                       // [S] next sibling
    int* n_last = n_sib + S;                       // [S] last child so far
    unsigned* anc = (unsigned*)(n_last + S);       // [S, W] ancestor-or-self bitmask rows
    float* lps = (float*)(anc + S * W);            // [L_eff, K] log-probs

    const long long* ids_b = ids + (long long)b * L * Kp;
    const float* lp_b = lp + (long long)b * L * Kp;

    for (int i = tid; i < S; i += TB_THREADS) {
        c_okey[i] = 0ull;
        n_next[i] = -1;
        n_sib[i] = -1;
        n_last[i] = -1;
    }
    for (int i = tid; i < S * W; i += TB_THREADS) anc[i] = 0u;
    for (int i = tid; i < L_eff * K; i += TB_THREADS) lps[i] = lp_b[(i / K) * Kp + (i % K)];
    __syncthreads();

    int n = 0;  // pops done (valid in warp 0)
    if (tid < 32) {
        const unsigned FULL = 0xffffffffu;
        const bool empty_tree = (budget == 0 || L_eff == 0 || K == 0);
        if (lane == 0) {
            n_parent[0] = -1;
            anc[0] = 1u;  // root row: itself
            if (!empty_tree) {
                double s0 = to_f64(lps[0]);
                c_score[0] = s0;
                c_okey[0] = okey(s0);
                c_hi[0] = 0ull;
                c_lo[0] = 0ull;
                c_meta[0] = 0u | (1u << 16);  // parent 0, depth 1, rank 0
            }
        }
        __syncwarp();
        u64 best = (lane == 0 && !empty_tree) ? c_okey[0] : 0ull;  // this lane's best slot key
        int best_slot = (lane == 0) ? 0 : -1;
        int nslots = empty_tree ? 0 : 1;

        for (int count = 0; count < budget && !empty_tree; ++count) {
            // 1) arg-max over the frontier: top 32 bits, then low 32 bits, then rank tuples.
            const unsigned hi32 = (unsigned)(best >> 32);
            const unsigned mhi = __reduce_max_sync(FULL, hi32);
            if (mhi == 0u) break;  // frontier empty: the tree is smaller than the budget
            unsigned tied = __ballot_sync(FULL, hi32 == mhi);
            if (__popc(tied) > 1) {
                const unsigned lo32 = (hi32 == mhi) ? (unsigned)best : 0u;
                const unsigned mlo = __reduce_max_sync(FULL, lo32);
                tied = __ballot_sync(FULL, hi32 == mhi && (unsigned)best == mlo);
            }
            int w = __shfl_sync(FULL, best_slot, __ffs(tied) - 1);
            tied &= tied - 1;
            while (tied) {  // equal scores in several lanes (rare): lowest rank tuple wins
                const int l = __ffs(tied) - 1;
                tied &= tied - 1;
                const int s = __shfl_sync(FULL, best_slot, l);
                if (rank_less(c_hi, c_lo, c_meta, s, w)) w = s;
            }

            // 2) pop slot w as node idx.
            const int idx = count + 1;
            const double logw = c_score[w];
            const unsigned meta = c_meta[w];
            const u64 khi = c_hi[w], klo = c_lo[w];
            const int parent = (int)(meta & 0xFFFFu);
            const int depth = (int)((meta >> 16) & 0xFFu);
            const int rank = (int)(meta >> 24);
            __syncwarp();  // every lane has read slot w before lane 0 overwrites it
            for (int j = lane; j < W; j += 32) anc[idx * W + j] = anc[parent * W + j] | ((j == (idx >> 5)) ? (1u << (idx & 31)) : 0u);
            const bool has_sib = rank + 1 < K;
            const bool has_child = depth < L_eff;
            const int cslot = has_sib ? nslots : w;
            if (lane == 0) {
                n_parent[idx] = parent;
                n_src[idx] = (depth - 1) * Kp + rank;
                n_score[idx] = logw;
                const int lc = n_last[parent];
                if (lc < 0) n_next[parent] = idx; else n_sib[lc] = idx;
                n_last[parent] = idx;
                c_okey[w] = 0ull;
                if (has_sib) {
                    const double sib = (logw - to_f64(lps[(depth - 1) * K + rank])) + to_f64(lps[(depth - 1) * K + rank + 1]);
                    const int p = depth - 1;  // byte of this depth's rank
                    c_score[w] = sib;
                    c_okey[w] = okey(sib);
                    c_hi[w] = (p < 8) ? khi + (1ull << (8 * (7 - p))) : khi;
                    c_lo[w] = (p < 8) ? klo : klo + (1ull << (8 * (15 - p)));
                    c_meta[w] = (unsigned)parent | ((unsigned)depth << 16) | ((unsigned)(rank + 1) << 24);
                }
                if (has_child) {
                    const double ch = logw + to_f64(lps[depth * K]);
                    c_score[cslot] = ch;
                    c_okey[cslot] = okey(ch);
                    c_hi[cslot] = khi;
                    c_lo[cslot] = klo;
                    c_meta[cslot] = (unsigned)idx | ((unsigned)(depth + 1) << 16);
                }
            }
            if (has_sib && has_child) ++nslots;
            __syncwarp();

            // 3) the lanes that own a changed slot rescan their slots.
            if (lane == (w & 31) || lane == (cslot & 31)) {
                best = 0ull;
                best_slot = -1;
#pragma unroll
                for (int c = 0; c < TB_MAX_ROWS; ++c) {
                    const int s = c * 32 + lane;
                    if (s < nslots) {
                        const u64 k = c_okey[s];
                        if (k > best || (k == best && k != 0ull && rank_less(c_hi, c_lo, c_meta, s, best_slot))) {
                            best = k;
                            best_slot = s;
                        }
                    }
                }
            }
            n = idx;
        }
    }
    if (tid == 0) n_src[0] = n;  // hand n to the other warps (slot 0 of n_src is otherwise unused)
    __syncthreads();
    n = n_src[0];

    // 4) outputs, all threads; every element of every output is written (padding included).
    if (tid == 0) sizes[b] = n + 1;
    for (int i = tid; i < budget; i += TB_THREADS) {
        const long long o = (long long)b * budget + i;
        const bool v = i < n;
        node_token_ids[o] = v ? ids_b[n_src[i + 1]] : -1ll;
        node_depths[o] = v ? (long long)(n_src[i + 1] / Kp + 1) : -1ll;
        scores[o] = v ? n_score[i + 1] : __longlong_as_double(0x7ff8000000000000ll);  // NaN padding
    }
    for (int i = tid; i < S; i += TB_THREADS) {
        const long long o = (long long)b * S + i;
        const bool v = i <= n;
        parents[o] = v ? (long long)n_parent[i] : -1ll;
        next_token[o] = v ? (long long)n_next[i] : -1ll;
        next_sibling[o] = v ? (long long)n_sib[i] : -1ll;
        positions[o] = v ? (i == 0 ? 0ll : (long long)(n_src[i] / Kp + 1)) : -1ll;
    }
    unsigned char* vis_b = visibility + (long long)b * S * S;
    for (int e = tid; e < S * S; e += TB_THREADS) {
        const int i = e / S, j = e - i * S;
        vis_b[e] = (i <= n && j <= n) ? (unsigned char)((anc[i * W + (j >> 5)] >> (j & 31)) & 1u) : (unsigned char)0;
    }
}
