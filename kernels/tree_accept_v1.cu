// tree_accept_v1: acceptance walks over DDTree batches (twins of kdlib.ref.accept).
//
// tree_accept_greedy_v1: one block per request. The block stages the request's LCRS lists,
// node tokens and target tokens in shared memory (coalesced), then thread 0 walks: at node cur,
// scan next_token[cur], next_sibling[...] for the child whose token equals t = target[cur];
// move there, or stop (t is the bonus). Then all threads write the path, padded with -1.
// A path longer than `width` is truncated in `paths` while `lengths` keeps its true length
// (the reference raises ValueError; the wrapper documents lengths > width as that case).
//
// tree_sample_rows_v1_f32 / _f64: inverse-CDF draw per row, one thread per row:
//   total = sequential float64 sum of the row (index order), x = u * total,
//   token = the number of prefix sums <= x  (= first i with x < cumsum[i], numpy's
//   searchsorted(side="right")), recomputing the same sequential sums in a second pass.
// Bit-exact with kdlib.ref.accept.sample_tokens; rows a request does not use (i >= sizes[b])
// get -1, as in accept_sample_batch. Cost: 2 V dependent float64 adds per row.
//
// Shared memory of tree_accept_greedy_v1 (bytes), S = budget + 1: 8 * (4 * S) + 8 * S
// (next_token, next_sibling, node tokens, targets as int64; the path) = 40 S, 10,280 B at S 257.

#include "common/exact_f64.cuh"

#define TA_THREADS 64

extern "C" __global__ void __launch_bounds__(TA_THREADS) tree_accept_greedy_v1(
    const long long* __restrict__ node_token_ids,  // [B, S-1]
    const long long* __restrict__ next_token,      // [B, S]
    const long long* __restrict__ next_sibling,    // [B, S]
    const long long* __restrict__ sizes,           // [B] n + 1
    const long long* __restrict__ target,          // [B, S]
    int S, int width,
    long long* __restrict__ paths,    // [B, width]
    long long* __restrict__ lengths,  // [B]
    long long* __restrict__ bonus)    // [B]
{
    extern __shared__ __align__(16) unsigned char smem[];
    long long* s_next = (long long*)smem;  // [S]
    long long* s_sib = s_next + S;         // [S]
    long long* s_tok = s_sib + S;          // [S] s_tok[i] = token of node i (i >= 1)
    long long* s_tgt = s_tok + S;          // [S]
    long long* s_path = s_tgt + S;         // [S]
    __shared__ int s_len;

    const int b = blockIdx.x;
    const int tid = threadIdx.x;
    const long long size = sizes[b];
    const int m = (int)(size < (long long)S ? size : (long long)S);  // nodes present, root included
    for (int i = tid; i < m; i += TA_THREADS) {
        const long long o = (long long)b * S + i;
        s_next[i] = next_token[o];
        s_sib[i] = next_sibling[o];
        s_tgt[i] = target[o];
        s_tok[i] = (i == 0) ? -1ll : node_token_ids[(long long)b * (S - 1) + i - 1];
    }
    __syncthreads();
    if (tid == 0) {
        int len = 0, cur = 0;
        long long t = (m > 0) ? s_tgt[0] : -1ll;
        if (m > 0) s_path[len++] = 0;
        while (m > 0) {
            long long c = s_next[cur];
            while (c >= 0 && c < m && s_tok[c] != t) c = s_sib[c];
            if (c < 0 || c >= m || len >= S) break;
            cur = (int)c;
            s_path[len++] = cur;
            t = s_tgt[cur];
        }
        s_len = len;
        lengths[b] = len;
        bonus[b] = t;
    }
    __syncthreads();
    const int len = s_len;
    for (int i = tid; i < width; i += TA_THREADS) paths[(long long)b * width + i] = (i < len) ? s_path[i] : -1ll;
}

template <typename T>
__device__ __forceinline__ long long sample_row(const T* __restrict__ row, double u, long long V) {
    double total = 0.0;
    for (long long j = 0; j < V; ++j) total += to_f64(row[j]);
    const double x = u * total;
    double acc = 0.0;
    long long count = 0;
    for (long long j = 0; j < V; ++j) {
        acc += to_f64(row[j]);
        if (acc > x) break;
        ++count;
    }
    return count;
}

// Row r belongs to request r / rows_per_req and is that request's node r % rows_per_req; it is
// drawn when sizes == nullptr or node < sizes[request], otherwise its token is -1.
template <typename T>
__device__ __forceinline__ void sample_rows(const T* __restrict__ probs, const double* __restrict__ uniforms,
                                            const long long* __restrict__ sizes, long long rows_per_req,
                                            long long N, long long V, long long* __restrict__ tokens) {
    const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= N) return;
    if (sizes != nullptr && (r % rows_per_req) >= sizes[r / rows_per_req]) {
        tokens[r] = -1;
        return;
    }
    tokens[r] = sample_row<T>(probs + r * V, uniforms[r], V);
}

extern "C" __global__ void __launch_bounds__(128) tree_sample_rows_v1_f32(
    const float* __restrict__ probs,      // [N, V]
    const double* __restrict__ uniforms,  // [N]
    const long long* __restrict__ sizes,  // [N / rows_per_req] or nullptr
    long long rows_per_req, long long N, long long V,
    long long* __restrict__ tokens)       // [N]
{
    sample_rows<float>(probs, uniforms, sizes, rows_per_req, N, V, tokens);
}

extern "C" __global__ void __launch_bounds__(128) tree_sample_rows_v1_f64(
    const double* __restrict__ probs,     // [N, V]
    const double* __restrict__ uniforms,  // [N]
    const long long* __restrict__ sizes,  // [N / rows_per_req] or nullptr
    long long rows_per_req, long long N, long long V,
    long long* __restrict__ tokens)       // [N]
{
    sample_rows<double>(probs, uniforms, sizes, rows_per_req, N, V, tokens);
}
