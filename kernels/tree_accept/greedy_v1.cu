// tree_accept greedy_v1: the greedy acceptance walk over DDTree batches (twin of kdlib.ref.accept).
//
// tree_accept_greedy_v1: one block per request. The block stages the request's LCRS lists,
// node tokens and target tokens in shared memory (coalesced), then thread 0 walks: at node cur,
// scan next_token[cur], next_sibling[...] for the child whose token equals t = target[cur];
// move there, or stop (t is the bonus). Then all threads write the path, padded with -1.
// A path longer than `width` is truncated in `paths` while `lengths` keeps its true length
// (the reference raises ValueError; the wrapper documents lengths > width as that case).
//
// Shared memory of tree_accept_greedy_v1 (bytes), S = budget + 1: 8 * (4 * S) + 8 * S
// (next_token, next_sibling, node tokens, targets as int64; the path) = 40 S, 10,280 B at S 257.

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
