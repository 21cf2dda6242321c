// tree_build_v4: the frontier kept sorted across warp 0's lanes, one candidate per lane.
//
// Same contract and arithmetic as tree_build_v3 (bit-exact twin of kdlib.ref.tree.build_tree_batch:
// float64 scores, sibling `(logw - lp[d-1][r]) + lp[d-1][r+1]`, child `logw + lp[d][0]`, ties
// broken by the rank tuple in Python tuple order).
//
// The pop loop (warp 0). Position t = 32 * row + lane holds the t-th best frontier candidate
// (score, meta); position 0 is the head, of which every lane also holds a copy W with the three
// log-probs its pop needs. A pop then needs no argmax reduction:
//   * the sibling X and first child Y of the head are computed in every lane (float64 adds);
//   * each lane compares its own candidate with X and Y (scores only; when any compared score
//     is exactly equal, a warp-uniform slow path compares rank tuples, rebuilt from the popped
//     parents' tuples in shared memory); two ballots count the candidates before X and Y;
//   * one per-lane shuffle moves every candidate to its new position (it shifts by -1, 0 or +1);
//   * the next head is X, Y or the old second entry, chosen by selects in every lane (the second
//     entry and the log-probs of all three were fetched at the start of the pop, off the chain).
// Only the best (budget - pops done) candidates can still be popped (each pop removes one of
// them at most), so the list is cut there; it then never holds more than floor((budget + 1) / 2)
// candidates: 32 positions (one row) up to budget 64, 64 up to 128, 128 up to 256.
// tests/test_cuda_tree.py checks this loop as a Python model (v4_model) and runs this very source
// on the host (g++, lock-step warp emulation) against the reference, besides the GPU tests.
// After the pops, all warps build the LCRS lists and ancestor masks and write the outputs
// (visibility as 4-byte words where the buffer's alignment allows).
//
// Budgets above 64: R = 2 or 4 rows (positions 32 r + lane). Each pop then does R ballot pairs and,
// per row, 3 shuffles per word (the source of position t may sit in row r - 1, r or r + 1), so a
// pop's instruction count grows with R and a build costs about budget pops of that size. The limit
// is budget 256: 8-bit ranks in the rank key and meta word, and one thread per node token at the end.
//
// Kernels tree_build_v4_r{1,2,4}: budget <= 64, 128, 256 (R rows of the frontier).
// Dynamic shared memory (bytes), S = budget + 1, W = ceil(S / 32):
//   32 * S + 8 * S * W + 8 * LPS_ROWS * LPS_STRIDE (the log-prob table, 18 rows at stride 256)
// = 40,504 B at budget 64 and 63,592 B at budget 256 (the wrapper opts in above 48 KB).

#define TB4_THREADS 256  // 8 warps: warp 0 runs the pops; all 8 load the table (rows w, w + 8) and write the outputs

#include "common/exact_f64.cuh"

typedef unsigned long long u64;

// The rank tuple (r_1, ..., r_d) as bytes r_1..r_16 of (hi, lo), most significant first, then the
// depth: (hi, lo, depth) in lexicographic order is Python's tuple order (a proper prefix has zero
// bytes where its extensions have ranks >= 0, and the smaller depth).
__device__ __forceinline__ void put_rank4(u64& hi, u64& lo, int depth, int rank) {
    const int p = depth - 1;  // 0..15
    if (p < 8) hi |= (u64)rank << (8 * (7 - p));
    else lo |= (u64)rank << (8 * (15 - p));
}

__device__ __forceinline__ bool tuple_less4(u64 hi_a, u64 lo_a, int d_a, u64 hi_b, u64 lo_b, int d_b) {
    if (hi_a != hi_b) return hi_a < hi_b;
    if (lo_a != lo_b) return lo_a < lo_b;
    return d_a < d_b;
}

// Meta word of a candidate: parent (bits 0-15), rank (16-23), depth (24-31); so (m >> 16) - 256 =
// (depth - 1) * 256 + rank is the index of lp[depth-1][rank] in the table of row stride 256.
__device__ __forceinline__ int m_par(unsigned m) { return (int)(m & 0xFFFFu); }
__device__ __forceinline__ int m_rank(unsigned m) { return (int)((m >> 16) & 0xFFu); }
__device__ __forceinline__ int m_dep(unsigned m) { return (int)(m >> 24); }
__device__ __forceinline__ int m_lix(unsigned m) { return (int)(m >> 16) - 256; }
#define M_ROOT_CHILD (1u << 24)  // parent 0, rank 0, depth 1: the first candidate, and a safe filler

// The log-prob table: row stride 256 (K <= 256), so indices come from the meta word by a shift.
// Rows 0..17: reads at row L_eff + 1 <= 17 and one column past a row's end stay inside; such
// cells (and columns >= K) hold stale values, read only for candidates that do not exist.
#define LPS_STRIDE 256
#define LPS_ROWS 18

template <int R, int WM>
__device__ __forceinline__ void build4(
    const long long* __restrict__ ids, const float* __restrict__ lp,
    int L, int Kp, int K, int L_eff, int budget,
    long long* __restrict__ sizes, long long* __restrict__ node_token_ids, long long* __restrict__ node_depths,
    long long* __restrict__ parents, unsigned char* __restrict__ visibility, long long* __restrict__ next_token,
    long long* __restrict__ next_sibling, long long* __restrict__ positions, double* __restrict__ scores)
{
    // Limits the layout relies on (kdlib.cuda.tree checks them before the launch; a direct launch
    // outside them writes nothing rather than out of bounds).
    if (budget < 0 || budget > TB4_THREADS || (budget + 1) / 2 > 32 * R || L_eff < 0 || L_eff > 16 || K < 0 ||
        K > 256 || K > Kp || L_eff > L)
        return;
    const int b = blockIdx.x;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int S = budget + 1;
    const int W = (S + 31) >> 5;

    extern __shared__ __align__(16) unsigned char smem[];
    u64* n_tup = (u64*)smem;                     // [S, 2] rank tuple (hi, lo) of node i
    double* n_score = (double*)(n_tup + 2 * S);  // [S] score of node i (i >= 1)
    double* lps = n_score + S;                   // [LPS_ROWS, LPS_STRIDE] log-probs as float64
    int* n_parent = (int*)(lps + LPS_ROWS * LPS_STRIDE);  // [S]
    int* n_src = n_parent + S;                   // [S] (depth - 1) * Kp + rank of node i; n_src[0] = n
    unsigned* cmask = (unsigned*)(n_src + S);    // [S, W] children of node i
    unsigned* amask = cmask + S * W;             // [S, W] ancestors-or-self of node i

    const long long* ids_b = ids + (long long)b * L * Kp;
    const float* lp_b = lp + (long long)b * L * Kp;
    {
        // Rows warp and warp + 8 (L_eff <= 16), lanes along the row: coalesced, and every load of
        // this thread issued before the first use (one L2 round trip, not one per element).
        float v[2][8];  // [row][column / 32], K <= 256
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int d = warp + 8 * h;
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                const int c = lane + 32 * m;
                v[h][m] = (d < L_eff && c < K) ? lp_b[d * Kp + c] : 0.0f;
            }
        }
        for (int i = tid; i < S * W; i += TB4_THREADS) cmask[i] = 0u;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int d = warp + 8 * h;
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                const int c = lane + 32 * m;
                if (d < L_eff && c < K) lps[d * LPS_STRIDE + c] = to_f64(v[h][m]);
            }
        }
    }
    __syncthreads();

    if (warp == 0) {
        const unsigned FULL = 0xffffffffu;
        const bool empty_tree = (budget == 0 || L_eff == 0 || K == 0);
        double esc[R];     // score of the candidate at position 32 r + lane
        unsigned em[R];    // its meta word
#pragma unroll
        for (int r = 0; r < R; ++r) { esc[r] = 0.0; em[r] = M_ROOT_CHILD; }
        // The head W (position 0), in every lane, with lp[d-1][r], lp[d-1][r+1], lp[d][0].
        double wsc = 0.0, wla = 0.0, wlb = 0.0, wlc = 0.0;
        unsigned wm = M_ROOT_CHILD;
        int f = 0;               // frontier size
        if (!empty_tree) {
            wsc = lps[0];
            wla = lps[0];
            wlb = lps[1];            // stale when K = 1 (no sibling)
            wlc = lps[LPS_STRIDE];   // stale when L_eff = 1 (no child)
            if (lane == 0) esc[0] = wsc;
            f = 1;
        }
        // Node records: lane 0 alone writes them and reads them back in the pop loop; other lanes
        // read them only after a warp barrier (slow path) or the block barrier (outputs).
        if (lane == 0) { n_parent[0] = -1; n_tup[0] = 0ull; n_tup[1] = 0ull; }
        int n = 0;
        for (int count = 0; count < budget && f > 0; ++count) {
            const int idx = count + 1;
            const int par = m_par(wm), dep = m_dep(wm), rk = m_rank(wm);
            const bool nx = rk + 1 < K;     // the head has a next sibling X
            const bool ny = dep < L_eff;    // and a first child Y
            // Loads off the chain: the log-probs X and Y will need, the old second entry O1's.
            // Unguarded: a value past its row or depth belongs to a candidate that does not exist.
            const int wix = m_lix(wm);
            const double x_lb = lps[wix + 2];
            const double y_lb = lps[dep * LPS_STRIDE + 1];
            const double y_lc = lps[(dep + 1) * LPS_STRIDE];
            const double o1sc = __shfl_sync(FULL, esc[0], 1);
            const unsigned o1m_raw = __shfl_sync(FULL, em[0], 1);
            const unsigned o1m = (f >= 2) ? o1m_raw : M_ROOT_CHILD;  // a safe address when there is none
            const int o1ix = m_lix(o1m);
            const double o1la = lps[o1ix];
            const double o1lb = lps[o1ix + 1];
            const double o1lc = lps[m_dep(o1m) * LPS_STRIDE];
            if (lane == 0) {  // node idx = the head
                n_parent[idx] = par;
                n_src[idx] = (dep - 1) * Kp + rk;
                n_score[idx] = wsc;
                u64 hi = n_tup[2 * par], lo = n_tup[2 * par + 1];
                put_rank4(hi, lo, dep, rk);
                n_tup[2 * idx] = hi;
                n_tup[2 * idx + 1] = lo;
            }
            // The two new candidates.
            const double xsc = (wsc - wla) + wlb;
            const double ysc = wsc + wlc;
            const unsigned xm = wm + (1u << 16);                             // rank + 1 (used only when nx: < 256)
            const unsigned ym = (unsigned)idx | ((wm & 0xFF000000u) + (1u << 24));  // parent idx, rank 0, depth + 1
            // Compare every old entry (positions 1..f-1) with X and Y: one ballot per row and
            // candidate; ax, ay = how many old entries come before X, Y.
            bool yx = ysc > xsc;  // Y before X
            bool lane_tie = false;
            unsigned bx[R], by[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int t = 32 * r + lane;
                const bool v = t >= 1 && t < f;
                lane_tie |= v && ((nx && esc[r] == xsc) || (ny && esc[r] == ysc));
                bx[r] = __ballot_sync(FULL, v && esc[r] > xsc);
                by[r] = __ballot_sync(FULL, v && esc[r] > ysc);
            }
            // Votes issued together; the (rare) tie test does not delay the ballots above.
            if (__any_sync(FULL, lane_tie) || (nx && ny && xsc == ysc)) {
                // Exact score ties: rank tuples decide (the parents' tuples, stored in earlier pops).
                __syncwarp();
                u64 phi = n_tup[2 * par], plo = n_tup[2 * par + 1];
                u64 xhi = phi, xlo = plo, yhi = phi, ylo = plo;
                put_rank4(xhi, xlo, dep, rk + 1 < 256 ? rk + 1 : 255);  // X's tuple (used only when nx)
                put_rank4(yhi, ylo, dep, rk);                            // Y's = node idx's, one deeper
                yx = ysc > xsc || (ysc == xsc && tuple_less4(yhi, ylo, dep + 1, xhi, xlo, dep));
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const int t = 32 * r + lane;
                    const bool v = t >= 1 && t < f;
                    const int ep = v ? m_par(em[r]) : 0;
                    const int ed = v ? m_dep(em[r]) : 1;
                    u64 ehi = n_tup[2 * ep], elo = n_tup[2 * ep + 1];
                    put_rank4(ehi, elo, ed, v ? m_rank(em[r]) : 0);
                    bx[r] = __ballot_sync(FULL, v && (esc[r] > xsc || (esc[r] == xsc && tuple_less4(ehi, elo, ed, xhi, xlo, dep))));
                    by[r] = __ballot_sync(FULL, v && (esc[r] > ysc || (esc[r] == ysc && tuple_less4(ehi, elo, ed, yhi, ylo, dep + 1))));
                }
            }
            int ax = 0, ay = 0;
            unsigned anyx = 0u, anyy = 0u;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                ax += __popc(bx[r]);
                ay += __popc(by[r]);
                anyx |= bx[r];
                anyy |= by[r];
            }
            const int px = ax + ((ny && yx) ? 1 : 0);   // X's new position (when nx)
            const int py = ay + ((nx && !yx) ? 1 : 0);  // Y's new position (when ny)
            // px == 0 and py == 0 without the popcounts (the next head's chain)
            const bool hx = nx && anyx == 0u && !(ny && yx);
            const bool hy = !hx && ny && anyy == 0u && !(nx && !yx);
            const int total = f - 1 + (nx ? 1 : 0) + (ny ? 1 : 0);
            int fn = min(total, budget - idx);  // only these can still be popped
            fn = min(fn, 32 * R);               // never binds (see the header); keeps every index in range
            // Move every entry to its new position: position t takes X, Y, or old position o + 1.
            double nsc[R];
            unsigned nm[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int t = 32 * r + lane;
                const int o = t - ((nx && px < t) ? 1 : 0) - ((ny && py < t) ? 1 : 0);
                const int s = o + 1;  // in t-1 .. t+1
                const int sl = s & 31, sr = s >> 5;
                double v = __shfl_sync(FULL, esc[r], sl);
                unsigned m = __shfl_sync(FULL, em[r], sl);
                if (r + 1 < R) {
                    const double v1 = __shfl_sync(FULL, esc[r + 1 < R ? r + 1 : r], sl);
                    const unsigned m1 = __shfl_sync(FULL, em[r + 1 < R ? r + 1 : r], sl);
                    if (sr == r + 1) { v = v1; m = m1; }
                }
                if (r > 0) {
                    const double v0 = __shfl_sync(FULL, esc[r > 0 ? r - 1 : r], sl);
                    const unsigned m0 = __shfl_sync(FULL, em[r > 0 ? r - 1 : r], sl);
                    if (sr == r - 1) { v = v0; m = m0; }
                }
                const bool isx = nx && t == px, isy = ny && t == py;
                nsc[r] = isx ? xsc : (isy ? ysc : v);
                nm[r] = isx ? xm : (isy ? ym : m);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) { esc[r] = nsc[r]; em[r] = nm[r]; }
            // The next head: X, Y or O1 (all lanes agree: every operand is warp-uniform).
            wsc = hx ? xsc : (hy ? ysc : o1sc);
            wm = hx ? xm : (hy ? ym : o1m);
            wla = hx ? wlb : (hy ? wlc : o1la);
            const double nlb = hx ? x_lb : (hy ? y_lb : o1lb);
            wlc = hx ? wlc : (hy ? y_lc : o1lc);
            wlb = nlb;
            f = fn;
            n = idx;
        }
        if (lane == 0) n_src[0] = n;
    }
    __syncthreads();
    const int n = n_src[0];
    // Thread i < budget (<= 256 = TB4_THREADS) owns node i + 1's token: its global load is
    // issued now and used last, so the L2 round trip overlaps the list building below.
    const int tsrc = (tid < n) ? n_src[tid + 1] : 0;
    const long long tok = (tid < n) ? ids_b[tsrc] : -1ll;

    // LCRS from child bitmasks; ancestor bitmasks by walking each node's parent chain.
    for (int c = 1 + tid; c <= n; c += TB4_THREADS) atomicOr(&cmask[n_parent[c] * W + (c >> 5)], 1u << (c & 31));
    for (int i = tid; i <= n; i += TB4_THREADS) {
        unsigned bits[WM];
#pragma unroll
        for (int r = 0; r < WM; ++r) bits[r] = 0u;
        for (int a = i; a >= 0; a = n_parent[a]) {
#pragma unroll
            for (int r = 0; r < WM; ++r) bits[r] |= (r == (a >> 5)) ? (1u << (a & 31)) : 0u;
        }
#pragma unroll
        for (int r = 0; r < WM; ++r) if (r < W) amask[i * W + r] = bits[r];
    }
    __syncthreads();

    // Outputs; every element of every output is written (padding included).
    if (tid == 0) sizes[b] = n + 1;
    if (tid < budget) {
        const long long o = (long long)b * budget + tid;
        const bool v = tid < n;
        node_depths[o] = v ? (long long)(tsrc / Kp + 1) : -1ll;
        scores[o] = v ? n_score[tid + 1] : __longlong_as_double(0x7ff8000000000000ll);  // NaN padding
    }
    for (int i = tid; i < S; i += TB4_THREADS) {
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
    // Visibility [S, S] bytes: 4-byte words over the 4-byte-aligned middle of this request's
    // block, single bytes at its two ends (never a byte of a neighbouring request).
    unsigned char* vis_b = visibility + (long long)b * S * S;
    const int SS = S * S;
    const int head = min((int)((4u - (unsigned)((unsigned long long)vis_b & 3ull)) & 3u), SS);
    const int words = (SS - head) >> 2;
    const int tail = head + 4 * words;
    for (int e = tid; e < head; e += TB4_THREADS) {
        const int i = e / S, j = e - i * S;
        vis_b[e] = (i <= n && j <= n) ? (unsigned char)((amask[i * W + (j >> 5)] >> (j & 31)) & 1u) : (unsigned char)0;
    }
    for (int e = tail + tid; e < SS; e += TB4_THREADS) {
        const int i = e / S, j = e - i * S;
        vis_b[e] = (i <= n && j <= n) ? (unsigned char)((amask[i * W + (j >> 5)] >> (j & 31)) & 1u) : (unsigned char)0;
    }
    unsigned* vis_w = (unsigned*)(vis_b + head);
    for (int w = tid; w < words; w += TB4_THREADS) {
        const int e = head + 4 * w;
        int i = e / S, j = e - i * S;
        unsigned word = 0u;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned bit = (i <= n && j <= n) ? ((amask[i * W + (j >> 5)] >> (j & 31)) & 1u) : 0u;
            word |= bit << (8 * k);  // little-endian: byte k of the word is element e + k
            if (++j == S) { j = 0; ++i; }
        }
        vis_w[w] = word;
    }
    if (tid < budget) node_token_ids[(long long)b * budget + tid] = tok;
}

#define TB4_ARGS                                                                                   \
    const long long* __restrict__ ids, const float* __restrict__ lp, int L, int Kp, int K, int L_eff, \
    int budget, long long* __restrict__ sizes, long long* __restrict__ node_token_ids,              \
    long long* __restrict__ node_depths, long long* __restrict__ parents,                          \
    unsigned char* __restrict__ visibility, long long* __restrict__ next_token,                    \
    long long* __restrict__ next_sibling, long long* __restrict__ positions, double* __restrict__ scores
#define TB4_PASS ids, lp, L, Kp, K, L_eff, budget, sizes, node_token_ids, node_depths, parents, visibility, \
                 next_token, next_sibling, positions, scores

// Arguments (all kernels): ids [B, L, Kp] int64, lp [B, L, Kp] float32, then the DDTreeBatch
// outputs sizes [B], node_token_ids [B, budget], node_depths [B, budget], parents [B, S],
// visibility [B, S, S] bool, next_token [B, S], next_sibling [B, S], positions [B, S],
// scores [B, budget] float64. Template: R frontier rows, WM = most 32-bit words of a mask row.
extern "C" __global__ void __launch_bounds__(TB4_THREADS, 1) tree_build_v4_r1(TB4_ARGS) { build4<1, 3>(TB4_PASS); }
extern "C" __global__ void __launch_bounds__(TB4_THREADS, 1) tree_build_v4_r2(TB4_ARGS) { build4<2, 5>(TB4_PASS); }
extern "C" __global__ void __launch_bounds__(TB4_THREADS, 1) tree_build_v4_r4(TB4_ARGS) { build4<4, 9>(TB4_PASS); }
