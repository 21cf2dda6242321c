// kv_compact_v1: KV-cache bookkeeping after acceptance (twins of kdlib.ref.compact).
//
// kv_compact_v1_u{128,32,8}: contiguous cache [num_slots, row_units] of 16-, 4- or 1-byte units
// (the wrapper picks the widest unit dividing the row bytes and the base alignment).
// Grid (ceil(row_units / 256), B): thread (x, b) owns unit column c of request b and copies
//   cache[start + i, c] = cache[start + path[i], c]   for i = 0 .. len-1 in ascending order.
// In place is safe: path is strictly increasing with path[i] >= i, so the row a step reads
// (start + path[i]) is never a row an earlier step wrote (start + j, j < i <= path[i]); and a
// column is read and written by its one thread only, in order, so no other thread can observe a
// half-done state. Requests touch disjoint row ranges (checked by the reference, assumed here).
// Steps with path[i] == i are skipped (no copy). Invalid input never reads or writes out of bounds: a
// length past maxlen is cut to it (the greedy walk reports a path's whole length, longer than a
// truncated path buffer), a step whose row would leave [0, num_slots) is skipped.
//
// kv_remap_v1_i64 / _i32 (req_to_token int64 or int32): page_size 1 commit, one block per request:
//   req_to_token[b, start + i] = tree_slots[b, path[i]]  for i < len;
//   freed[b, j] = 1 when node j's slot (tree_slots[b, j] >= 0) is not on the path, else 0.
// The wrapper turns `freed` into the reference's compact freed-slot list.

#define KC_THREADS 256

template <typename U>
__device__ __forceinline__ void compact_cols(U* __restrict__ cache, long long num_slots, long long row_units,
                                             const long long* __restrict__ starts,
                                             const long long* __restrict__ paths, int maxlen,
                                             const long long* __restrict__ lengths) {
    const int b = blockIdx.y;
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= row_units) return;
    const long long start = starts[b];
    const long long len = min(lengths[b], (long long)maxlen);
    const long long* path = paths + (long long)b * maxlen;
    for (long long i = 0; i < len; ++i) {
        const long long p = path[i];
        const bool out = start + i < 0 || start + i >= num_slots || start + p < 0 || start + p >= num_slots;
        if (p == i || out) continue;
        cache[(start + i) * row_units + c] = cache[(start + p) * row_units + c];
    }
}

extern "C" __global__ void __launch_bounds__(KC_THREADS) kv_compact_v1_u128(
    uint4* __restrict__ cache,             // [num_slots, row_units]
    long long num_slots,
    long long row_units,
    const long long* __restrict__ starts,  // [B]
    const long long* __restrict__ paths,   // [B, maxlen]
    int maxlen,
    const long long* __restrict__ lengths) // [B]
{
    compact_cols<uint4>(cache, num_slots, row_units, starts, paths, maxlen, lengths);
}

extern "C" __global__ void __launch_bounds__(KC_THREADS) kv_compact_v1_u32(
    unsigned* __restrict__ cache,          // [num_slots, row_units]
    long long num_slots,
    long long row_units,
    const long long* __restrict__ starts,  // [B]
    const long long* __restrict__ paths,   // [B, maxlen]
    int maxlen,
    const long long* __restrict__ lengths) // [B]
{
    compact_cols<unsigned>(cache, num_slots, row_units, starts, paths, maxlen, lengths);
}

extern "C" __global__ void __launch_bounds__(KC_THREADS) kv_compact_v1_u8(
    unsigned char* __restrict__ cache,     // [num_slots, row_units]
    long long num_slots,
    long long row_units,
    const long long* __restrict__ starts,  // [B]
    const long long* __restrict__ paths,   // [B, maxlen]
    int maxlen,
    const long long* __restrict__ lengths) // [B]
{
    compact_cols<unsigned char>(cache, num_slots, row_units, starts, paths, maxlen, lengths);
}

template <typename R>
__device__ __forceinline__ void remap(R* __restrict__ req_to_token, long long max_ctx,
                                      const long long* __restrict__ starts,
                                      const long long* __restrict__ tree_slots, int width,
                                      const long long* __restrict__ paths, int maxlen,
                                      const long long* __restrict__ lengths,
                                      unsigned char* __restrict__ freed) {
    extern __shared__ unsigned char on_path[];  // [width]
    const int b = blockIdx.x;
    const int tid = threadIdx.x;
    const long long len = min(lengths[b], (long long)maxlen);
    const long long start = starts[b];
    const long long* path = paths + (long long)b * maxlen;
    const long long* slots = tree_slots + (long long)b * width;
    for (int j = tid; j < width; j += KC_THREADS) on_path[j] = 0;
    __syncthreads();
    for (long long i = tid; i < len; i += KC_THREADS) {
        const long long p = path[i];
        if (p < 0 || p >= width || start + i < 0 || start + i >= max_ctx) continue;  // invalid input: never write out of bounds
        on_path[p] = 1;
        req_to_token[(long long)b * max_ctx + start + i] = (R)slots[p];
    }
    __syncthreads();
    for (int j = tid; j < width; j += KC_THREADS)
        freed[(long long)b * width + j] = (unsigned char)(slots[j] >= 0 && !on_path[j]);
}

extern "C" __global__ void __launch_bounds__(KC_THREADS) kv_remap_v1_i64(
    long long* __restrict__ req_to_token,      // [B, max_ctx]
    long long max_ctx,
    const long long* __restrict__ starts,      // [B]
    const long long* __restrict__ tree_slots,  // [B, width]
    int width,
    const long long* __restrict__ paths,       // [B, maxlen]
    int maxlen,
    const long long* __restrict__ lengths,     // [B]
    unsigned char* __restrict__ freed)         // [B, width] bool
{
    remap<long long>(req_to_token, max_ctx, starts, tree_slots, width, paths, maxlen, lengths, freed);
}

extern "C" __global__ void __launch_bounds__(KC_THREADS) kv_remap_v1_i32(
    int* __restrict__ req_to_token,            // [B, max_ctx]
    long long max_ctx,
    const long long* __restrict__ starts,      // [B]
    const long long* __restrict__ tree_slots,  // [B, width]
    int width,
    const long long* __restrict__ paths,       // [B, maxlen]
    int maxlen,
    const long long* __restrict__ lengths,     // [B]
    unsigned char* __restrict__ freed)         // [B, width] bool
{
    remap<int>(req_to_token, max_ctx, starts, tree_slots, width, paths, maxlen, lengths, freed);
}
