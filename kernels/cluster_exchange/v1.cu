// Cluster exchange probe (issue 19, notebook 02b 13t): what it costs the two CTAs of a cluster to swap one key
// tile's partial S^T (64 keys x 72 rows, fp32: 18,432 B) through distributed shared memory, a cluster barrier a
// tile, with nothing else running. The 8 x 9 points' next lever (13t) splits each row's dims over two CTAs, and
// each would send its partial S^T of every tile to the other this way before its softmax.
//
// cluster_exchange_v1_<mode>: a grid of CTA pairs (__cluster_dims__(2, 1, 1)), EX_THREADS threads, dynamic
// shared memory of at least EX_BUF_BYTES (the launch asks for more, so that one CTA fills an SM as the attend
// kernel does). For tile t < tiles each thread makes its float4s k = tid, tid + EX_THREADS, ... < EX_VEC of the
// CTA's partial, element e of it part(t, rank, e) = (7 t + 3 rank + e) % 13 (small integers: every sum exact),
//   peer:  stores them into the other CTA's buffer t % 2 (mapa + st.shared::cluster),
//   local: into its own buffer t % 2 (the same barrier, no remote store),
//   none:  nowhere (the barrier alone),
// passes the cluster barrier, and adds its part and (peer, local) the buffer's float4 k into its accumulators.
// Two buffers and one barrier a tile suffice: a CTA writes buffer t % 2 again at tile t + 2, after the barrier
// of tile t + 1, which the other CTA reaches only once it has read that buffer at tile t.
//   async: no cluster barrier: st.async stores into the other CTA's buffer t % 2, each completing its bytes on
//     that CTA's full[t % 2] mbarrier (armed by the receiver's thread 0 for EX_VEC * 16 bytes a tile); the
//     receiver waits on it, reads the buffer, and each of its warps then arrives on the sender's empty[t % 2],
//     which the sender waits on before it writes that buffer again (tile t + 2).
// out [grid, EX_VEC] float4: the accumulators; cycles [grid] int64: thread 0's clock64 from before the first
// tile to after the last.
#define EX_THREADS 256
#define EX_KEYS 64
#define EX_ROWS 72
#define EX_VEC (EX_KEYS * EX_ROWS / 4)         // 1152 float4s: one tile's partial S^T
#define EX_PER_THREAD ((EX_VEC + EX_THREADS - 1) / EX_THREADS)
#define EX_BUF_BYTES (2 * EX_VEC * 16 + 32)   // two buffers: 36,864 B, and (async) four mbarriers
#define EX_PEER 0
#define EX_LOCAL 1
#define EX_NONE 2
#define EX_ASYNC 3
#define EX_WARPS (EX_THREADS / 32)

#include "common/cluster.cuh"

namespace {

__device__ __forceinline__ float4 part(int t, unsigned rank, int k) {
    const int e = 4 * k + 7 * t + 3 * (int)rank;
    return make_float4((float)(e % 13), (float)((e + 1) % 13), (float)((e + 2) % 13), (float)((e + 3) % 13));
}

// a += p, by component.
__device__ __forceinline__ void add(float4& a, float4 p) { a.x += p.x, a.y += p.y, a.z += p.z, a.w += p.w; }

// The thread's float4s of buffer b into its accumulators.
__device__ __forceinline__ void add_buffer(float4 (&acc)[EX_PER_THREAD], const float4* b, int tid) {
#pragma unroll
    for (int i = 0; i < EX_PER_THREAD; ++i) {
        const int k = tid + i * EX_THREADS;
        if (k < EX_VEC) add(acc[i], b[k]);
    }
}

template <int MODE>
__device__ __forceinline__ void exchange(int tiles, float4* __restrict__ out, long long* __restrict__ cycles) {
    extern __shared__ __align__(16) float4 buf[];  // [2][EX_VEC], then (async) full [2], empty [2] mbarriers
    const int tid = threadIdx.x;
    const unsigned rank = cluster_rank(), other = rank ^ 1u;
    // async: full s at bars + 8 s, empty s at bars + 16 + 8 s
    const unsigned bars = (unsigned)__cvta_generic_to_shared(buf + 2 * EX_VEC);
    float4 acc[EX_PER_THREAD];
#pragma unroll
    for (int i = 0; i < EX_PER_THREAD; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (MODE == EX_ASYNC && tid == 0) {
        for (int s = 0; s < 2; ++s) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 16 + 8 * s, EX_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_sync();  // the other CTA runs (and its mbarriers are set) before its shared memory is written
    const long long t0 = clock64();
    if (MODE == EX_ASYNC) {
        for (int t = 0; t < tiles; ++t) {
            const int s = t & 1;
            const unsigned parity = (t >> 1) & 1;
            float4* b = buf + s * EX_VEC;
            if (t >= 2) mbar_wait(bars + 16 + 8 * s, parity ^ 1u);  // the other CTA read tile t - 2's
            const unsigned full_there = peer_addr(bars + 8 * s, other);
#pragma unroll
            for (int i = 0; i < EX_PER_THREAD; ++i) {
                const int k = tid + i * EX_THREADS;
                if (k < EX_VEC) {
                    const float4 p = part(t, rank, k);
                    store_async(peer_addr((unsigned)__cvta_generic_to_shared(b + k), other), p, full_there);
                    add(acc[i], p);
                }
            }
            if (tid == 0) mbar_expect(bars + 8 * s, EX_VEC * 16);
            mbar_wait(bars + 8 * s, parity);  // the other CTA's tile t is here
            add_buffer(acc, b, tid);
            __syncwarp();
            if ((tid & 31) == 0) mbar_arrive_remote(peer_addr(bars + 16 + 8 * s, other));
        }
    }
    for (int t = 0; MODE != EX_ASYNC && t < tiles; ++t) {
        float4* b = buf + (t & 1) * EX_VEC;
#pragma unroll
        for (int i = 0; i < EX_PER_THREAD; ++i) {
            const int k = tid + i * EX_THREADS;
            if (k < EX_VEC) {
                const float4 p = part(t, rank, k);
                if (MODE == EX_PEER) store_cluster(peer_addr((unsigned)__cvta_generic_to_shared(b + k), other), p);
                if (MODE == EX_LOCAL) b[k] = p;
                add(acc[i], p);
            }
        }
        cluster_sync();
        if (MODE != EX_NONE) add_buffer(acc, b, tid);
    }
    const long long t1 = clock64();
    cluster_sync();  // no CTA leaves while the other may still read its shared memory
    if (tid == 0) cycles[blockIdx.x] = t1 - t0;
#pragma unroll
    for (int i = 0; i < EX_PER_THREAD; ++i) {
        const int k = tid + i * EX_THREADS;
        if (k < EX_VEC) out[(long long)blockIdx.x * EX_VEC + k] = acc[i];
    }
}

}  // namespace

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(EX_THREADS)
    cluster_exchange_v1_peer(int tiles, float4* __restrict__ out, long long* __restrict__ cycles) {
    exchange<EX_PEER>(tiles, out, cycles);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(EX_THREADS)
    cluster_exchange_v1_local(int tiles, float4* __restrict__ out, long long* __restrict__ cycles) {
    exchange<EX_LOCAL>(tiles, out, cycles);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(EX_THREADS)
    cluster_exchange_v1_none(int tiles, float4* __restrict__ out, long long* __restrict__ cycles) {
    exchange<EX_NONE>(tiles, out, cycles);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(EX_THREADS)
    cluster_exchange_v1_async(int tiles, float4* __restrict__ out, long long* __restrict__ cycles) {
    exchange<EX_ASYNC>(tiles, out, cycles);
}
