// tree_accept sample_v3: the inverse-CDF draw with one block per row, in the blocked order of
// kdlib.ref.accept.sample_tokens (order="blocked"), bit-exact with it.
//
// v1/v2 give each row to one thread that reads the whole vocabulary twice through a dependent
// chain of 2 V float64 adds. Here a block of TA3_THREADS threads shares a row:
//   1. thread t sums, sequentially in float64, its elements k * TILE + t * 4 + e (e < 4) of every
//      tile k of TILE = TA3_THREADS * 4 elements (coalesced 16-byte loads where the row allows);
//   2. an exclusive scan of those partial sums (shuffle-up scan inside each warp, the same scan
//      over the warp totals in warp 0) gives excl[t] and end[t] = excl[t] + partial[t];
//   3. total = max end[t] over threads with mass, x = u * total; the first thread with mass
//      and x < end[t] re-reads its own elements (L2-warm) and picks the first positive one
//      with x < excl[t] + its running sum.
// The row is read once from memory; the dependent chains are V / TA3_THREADS adds long.
// Float32 probabilities convert to float64 exactly (cvt without .ftz, whatever -ftz says),
// every sum is a plain float64 add (nothing to contract into an FMA), so the numpy twin that
// does the same adds in the same order gives the same token.

#ifndef TA3_THREADS
#define TA3_THREADS 512  // offline compiles only: kdlib passes kdlib.ref.accept.SAMPLE_THREADS
#endif
#ifndef TA3_PIECE
#define TA3_PIECE 4  // offline compiles only: kdlib passes kdlib.ref.accept.SAMPLE_PIECE
#endif
static_assert(TA3_PIECE == 4, "tree_accept_v3 loads pieces of 4 elements");
static_assert(TA3_THREADS % 32 == 0 && TA3_THREADS >= 32 && TA3_THREADS <= 1024, "1 to 32 whole warps");

#define TA3_WARPS (TA3_THREADS / 32)
#define TA3_MIN_BLOCKS (1024 / TA3_THREADS)  // 1024 resident threads per SM: <= 64 registers
#define TA3_TILE (TA3_THREADS * TA3_PIECE)
#define TA3_FULL 0xffffffffu

// Exact float -> double; a plain conversion under CuPy's -ftz=true may flush subnormals. One cvt
// without .ftz; common/exact_f64.cuh's to_f64 does it with integer ops, as the tree builds it serves
// also compile as host C++ (their CPU emulation), where PTX cannot go.
__device__ __forceinline__ double exact_f64(float f) {
    double d;
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(f));
    return d;
}
__device__ __forceinline__ double exact_f64(double d) { return d; }

// Pieces in flight per thread: hides an L2/HBM round trip behind the adds of the previous ones.
template <typename T> struct Unroll;
template <> struct Unroll<float> { static constexpr int value = 8; };
template <> struct Unroll<double> { static constexpr int value = 4; };

// U pieces at p, p + TILE, ... that lie inside the row and are 16-byte aligned.
template <int U>
__device__ __forceinline__ void load_full(const float* __restrict__ p, float (&v)[U][TA3_PIECE]) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
        const float4 q = __ldg(reinterpret_cast<const float4*>(p + j * TA3_TILE));
        v[j][0] = q.x; v[j][1] = q.y; v[j][2] = q.z; v[j][3] = q.w;
    }
}

template <int U>
__device__ __forceinline__ void load_full(const double* __restrict__ p, double (&v)[U][TA3_PIECE]) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
        const double2 a = __ldg(reinterpret_cast<const double2*>(p + j * TA3_TILE));
        const double2 b = __ldg(reinterpret_cast<const double2*>(p + j * TA3_TILE + 2));
        v[j][0] = a.x; v[j][1] = a.y; v[j][2] = b.x; v[j][3] = b.y;
    }
}

// U pieces starting at element i, i + TILE, ... of a row of V elements, 0 past V (scalar loads).
template <int U, typename T>
__device__ __forceinline__ void load_checked(const T* __restrict__ row, unsigned i, unsigned V, T (&v)[U][TA3_PIECE]) {
#pragma unroll
    for (int j = 0; j < U; ++j)
#pragma unroll
        for (int e = 0; e < TA3_PIECE; ++e) {
            const unsigned at = i + j * TA3_TILE + e;
            v[j][e] = at < V ? row[at] : (T)0;
        }
}

// Inclusive scan over the 32 lanes: at d = 1, 2, 4, 8, 16 lane i adds lane i - d's value.
__device__ __forceinline__ double warp_scan(double v, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const double n = __shfl_up_sync(TA3_FULL, v, d);
        if (lane >= d) v += n;
    }
    return v;
}

// The walk over U pieces of tiles k .. k+U-1 of the thread that holds x: true once the token
// (the first positive element with x < excl + running sum) is written.
template <int U, typename T>
__device__ __forceinline__ bool walk(const T (&v)[U][TA3_PIECE], unsigned k, unsigned own, double excl, double x,
                                     double& acc, long long* __restrict__ token) {
#pragma unroll
    for (int j = 0; j < U; ++j)
#pragma unroll
        for (int e = 0; e < TA3_PIECE; ++e) {
            const double q = exact_f64(v[j][e]);
            acc += q;
            if (q > 0.0 && x < excl + acc) {
                *token = (long long)(k + j) * TA3_TILE + own + e;
                return true;
            }
        }
    return false;
}

template <typename T>
__device__ __forceinline__ void draw_row(const T* __restrict__ row, double u, unsigned V, bool vec,
                                         long long* __restrict__ token) {
    constexpr int U = Unroll<T>::value;
    __shared__ double s_warp[TA3_WARPS];  // warp totals, then the exclusive warp prefix
    __shared__ double s_max[TA3_WARPS];
    __shared__ int s_first[TA3_WARPS];    // first thread of the warp that holds x, or -1
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    const unsigned tiles = (V + TA3_TILE - 1) / TA3_TILE;
    const unsigned own = t * TA3_PIECE;

    // Tiles [0, full) are read with unchecked vector loads, the rest with checked scalar ones.
    const unsigned full = vec ? V / TA3_TILE : 0;
    double partial = 0.0;
    unsigned k = 0;
    for (; k + U <= full; k += U) {
        T v[U][TA3_PIECE];
        load_full<U>(row + k * TA3_TILE + own, v);
#pragma unroll
        for (int j = 0; j < U; ++j)
#pragma unroll
            for (int e = 0; e < TA3_PIECE; ++e) partial += exact_f64(v[j][e]);
    }
    for (; k < tiles; k += U) {
        T v[U][TA3_PIECE];
        load_checked<U>(row, k * TA3_TILE + own, V, v);
#pragma unroll
        for (int j = 0; j < U; ++j)
#pragma unroll
            for (int e = 0; e < TA3_PIECE; ++e) partial += exact_f64(v[j][e]);
    }

    const double inc = warp_scan(partial, lane);
    double lane_excl = __shfl_up_sync(TA3_FULL, inc, 1);
    if (lane == 0) lane_excl = 0.0;
    if (lane == 31) s_warp[w] = inc;
    __syncthreads();
    if (w == 0) {
        const double y = warp_scan(lane < TA3_WARPS ? s_warp[lane] : 0.0, lane);
        double ex = __shfl_up_sync(TA3_FULL, y, 1);
        if (lane == 0) ex = 0.0;
        if (lane < TA3_WARPS) s_warp[lane] = ex;  // each lane rewrites the entry it read
    }
    __syncthreads();
    const double excl = s_warp[w] + lane_excl;
    const double end = excl + partial;
    const bool live = partial > 0.0;

    double m = live ? end : 0.0;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) m = fmax(m, __shfl_xor_sync(TA3_FULL, m, d));
    if (lane == 0) s_max[w] = m;
    __syncthreads();
    double total = s_max[0];
#pragma unroll
    for (int i = 1; i < TA3_WARPS; ++i) total = fmax(total, s_max[i]);
    double x = u * total;
    if (!(x < total)) x = nextafter(total, 0.0);  // only a subnormal total rounds up to itself

    const unsigned hit = __ballot_sync(TA3_FULL, live && x < end);
    if (lane == 0) s_first[w] = hit ? w * 32 + __ffs(hit) - 1 : -1;
    __syncthreads();
    int first = -1;
#pragma unroll
    for (int i = TA3_WARPS - 1; i >= 0; --i) first = s_first[i] >= 0 ? s_first[i] : first;
    if (first < 0) {  // no mass (an invalid row): -1, as for rows that are not drawn
        if (t == 0) *token = -1;
        return;
    }
    if (t != first) return;

    double acc = 0.0;
    k = 0;
    for (; k + U <= full; k += U) {
        T v[U][TA3_PIECE];
        load_full<U>(row + k * TA3_TILE + own, v);
        if (walk<U>(v, k, own, excl, x, acc, token)) return;
    }
    for (; k < tiles; k += U) {
        T v[U][TA3_PIECE];
        load_checked<U>(row, k * TA3_TILE + own, V, v);
        if (walk<U>(v, k, own, excl, x, acc, token)) return;
    }
}

// Row r belongs to request r / rows_per_req and is that request's node r % rows_per_req; it is
// drawn when sizes == nullptr or node < sizes[request], otherwise its token is -1.
template <typename T>
__device__ __forceinline__ void draw_rows(const T* __restrict__ probs, const double* __restrict__ uniforms,
                                          const long long* __restrict__ sizes, long long rows_per_req,
                                          long long V, long long* __restrict__ tokens) {
    const long long r = blockIdx.x;
    if (sizes != nullptr && (r % rows_per_req) >= sizes[r / rows_per_req]) {
        if (threadIdx.x == 0) tokens[r] = -1;
        return;
    }
    const bool vec = (reinterpret_cast<unsigned long long>(probs) % 16 == 0) && (V % TA3_PIECE == 0);
    draw_row<T>(probs + r * V, uniforms[r], (unsigned)V, vec, tokens + r);
}

extern "C" __global__ void __launch_bounds__(TA3_THREADS, TA3_MIN_BLOCKS) tree_sample_rows_v3_f32(
    const float* __restrict__ probs,      // [N, V]
    const double* __restrict__ uniforms,  // [N]
    const long long* __restrict__ sizes,  // [N / rows_per_req] or nullptr
    long long rows_per_req, long long V,
    long long* __restrict__ tokens)       // [N]; grid = N blocks of TA3_THREADS
{
    draw_rows<float>(probs, uniforms, sizes, rows_per_req, V, tokens);
}

extern "C" __global__ void __launch_bounds__(TA3_THREADS, TA3_MIN_BLOCKS) tree_sample_rows_v3_f64(
    const double* __restrict__ probs,     // [N, V]
    const double* __restrict__ uniforms,  // [N]
    const long long* __restrict__ sizes,  // [N / rows_per_req] or nullptr
    long long rows_per_req, long long V,
    long long* __restrict__ tokens)       // [N]; grid = N blocks of TA3_THREADS
{
    draw_rows<double>(probs, uniforms, sizes, rows_per_req, V, tokens);
}
