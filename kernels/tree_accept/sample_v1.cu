// tree_accept sample_v1: inverse-CDF sampling of DDTree rows (twin of kdlib.ref.accept.sample_tokens).
//
// tree_sample_rows_v1_f32 / _f64: inverse-CDF draw per row, one thread per row:
//   total = sequential float64 sum of the row (index order), x = u * total,
//   token = the number of prefix sums <= x  (= first i with x < cumsum[i], numpy's
//   searchsorted(side="right")), recomputing the same sequential sums in a second pass.
// Bit-exact with kdlib.ref.accept.sample_tokens; rows a request does not use (i >= sizes[b])
// get -1, as in accept_sample_batch. Cost: 2 V dependent float64 adds per row.

#include "common/exact_f64.cuh"

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
