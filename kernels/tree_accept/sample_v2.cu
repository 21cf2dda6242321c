// tree_accept sample_v2: the inverse-CDF draw of sample_v1 with the row loads software-pipelined.
//
// Same contract and result as tree_sample_rows_v1_* (bit-exact with kdlib.ref.accept.sample_tokens):
// per row, total = sequential float64 sum in index order, x = u * total, token = the number of
// prefix sums <= x. v1 issues one load per add, so every add waits for its load (times recorded in
// data/results/kernels.h200.json). Here one thread still owns a row (the float64 adds must stay in
// order), but it loads the next TA2_CHUNK elements while it adds the current ones, so the time
// tends to the dependent chain of conversions and adds (2 V adds per row).

#include "common/exact_f64.cuh"

#define TA2_CHUNK 32  // elements in flight per thread: hides an L2 round trip behind 32 float64 adds

template <typename T>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, long long j, long long V, T (&v)[TA2_CHUNK]) {
#pragma unroll
    for (int t = 0; t < TA2_CHUNK; ++t) v[t] = (j + t < V) ? row[j + t] : (T)0;
}

template <typename T>
__device__ long long draw_row(const T* __restrict__ row, double u, long long V) {
    T cur[TA2_CHUNK], nxt[TA2_CHUNK];
    double total = 0.0;
    load_chunk<T>(row, 0, V, cur);
    for (long long j = 0; j < V; j += TA2_CHUNK) {
        load_chunk<T>(row, j + TA2_CHUNK, V, nxt);
#pragma unroll
        for (int t = 0; t < TA2_CHUNK; ++t)
            if (j + t < V) total += to_f64(cur[t]);
#pragma unroll
        for (int t = 0; t < TA2_CHUNK; ++t) cur[t] = nxt[t];
    }
    const double x = u * total;
    double acc = 0.0;
    long long count = 0;
    bool done = false;
    load_chunk<T>(row, 0, V, cur);
    for (long long j = 0; j < V && !done; j += TA2_CHUNK) {
        load_chunk<T>(row, j + TA2_CHUNK, V, nxt);
#pragma unroll
        for (int t = 0; t < TA2_CHUNK; ++t) {
            if (!done && j + t < V) {
                acc += to_f64(cur[t]);
                if (acc > x) done = true; else ++count;
            }
        }
#pragma unroll
        for (int t = 0; t < TA2_CHUNK; ++t) cur[t] = nxt[t];
    }
    return count;
}

// Row r belongs to request r / rows_per_req and is that request's node r % rows_per_req; it is
// drawn when sizes == nullptr or node < sizes[request], otherwise its token is -1.
template <typename T>
__device__ __forceinline__ void draw_rows(const T* __restrict__ probs, const double* __restrict__ uniforms,
                                          const long long* __restrict__ sizes, long long rows_per_req,
                                          long long N, long long V, long long* __restrict__ tokens) {
    const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= N) return;
    if (sizes != nullptr && (r % rows_per_req) >= sizes[r / rows_per_req]) {
        tokens[r] = -1;
        return;
    }
    tokens[r] = draw_row<T>(probs + r * V, uniforms[r], V);
}

extern "C" __global__ void __launch_bounds__(128) tree_sample_rows_v2_f32(
    const float* __restrict__ probs,      // [N, V]
    const double* __restrict__ uniforms,  // [N]
    const long long* __restrict__ sizes,  // [N / rows_per_req] or nullptr
    long long rows_per_req, long long N, long long V,
    long long* __restrict__ tokens)       // [N]
{
    draw_rows<float>(probs, uniforms, sizes, rows_per_req, N, V, tokens);
}

extern "C" __global__ void __launch_bounds__(128) tree_sample_rows_v2_f64(
    const double* __restrict__ probs,     // [N, V]
    const double* __restrict__ uniforms,  // [N]
    const long long* __restrict__ sizes,  // [N / rows_per_req] or nullptr
    long long rows_per_req, long long N, long long V,
    long long* __restrict__ tokens)       // [N]
{
    draw_rows<double>(probs, uniforms, sizes, rows_per_req, N, V, tokens);
}
