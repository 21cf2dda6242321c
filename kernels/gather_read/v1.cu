// Gather-read probe: the bandwidth a kernel gets reading latent-cache rows one page-table slot at a time
// (page_size 1), the access pattern of the tree-verify kernels' prefix gathers (tree_verify/wgmma_v7.cu),
// without their math. It answers: what fraction of the copy bandwidth can any verify kernel reach on a
// memory-bound point, when its keys come as scattered 1152-byte rows rather than one contiguous range?
//
// pool [slots, 72] uint4 (one row: 576 bf16 = 72 chunks of 16 B), rows [n] int32 slots -> out [4] ^= the
// XOR of every 32-bit word of the n rows. XOR is order-free, so the result is exact whatever the grid and
// checkable against the host; each warp adds its XOR with one atomicXor per word at the end.
//
// Two ways to move the rows (both: warp gw of tw takes rows [R gw, R gw + R), then [R (gw + tw), ...); lane
// k < R reads row k's slot and shares it):
//   gather_read_v1_r<R>  (R = 2, 4, 8) into registers: lane l loads chunks l, l + 32 and l + 64 (< 72) of
//     each row, R x 3 loads of 16 B in flight per lane before the first use. Blocks of at most 256 threads
//     (R = 8 needs 96 registers of loads, more than a 1024-thread block leaves a thread).
//   gather_read_v1_bulk  into shared memory by the copy engine: one cp.async.bulk of 1152 B per row (what
//     "row gathers by TMA" would issue), BULK_R rows a stage, a ring of BULK_STAGES stages per warp, each
//     completing on its own mbarrier; the warp XORs a stage out of shared memory and refills it with its
//     next rows. Blocks of BULK_WARPS warps, dynamic shared memory BULK_SMEM bytes; sm_90 and later.
#define ROW_CHUNKS 72  // 16-byte chunks of a 576-wide bf16 row
#define ROW_BYTES (ROW_CHUNKS * 16)
#define BULK_R 4       // rows per stage of the bulk ring
#define BULK_STAGES 4  // stages per warp: 4 x 4 rows x 1152 B = 18 KB in flight per warp
#define BULK_WARPS 4
#define BULK_SMEM (BULK_WARPS * BULK_STAGES * (BULK_R * ROW_BYTES + 16))  // + a stage's mbarrier, 16-B aligned

#include "gather_read/xor_fold.cuh"

namespace {

template <int R>
__device__ __forceinline__ void gather_body(const uint4* __restrict__ pool, const int* __restrict__ rows,
                                            long long n, unsigned* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long tw = ((long long)gridDim.x * blockDim.x) >> 5;
    uint4 acc = make_uint4(0u, 0u, 0u, 0u);
    for (long long r0 = gw * R; r0 < n; r0 += tw * R) {
        const int mine = lane < R && r0 + lane < n ? rows[r0 + lane] : -1;
        uint4 v[R][3];
#pragma unroll
        for (int k = 0; k < R; ++k) {
            const int slot = __shfl_sync(0xffffffffu, mine, k);
#pragma unroll
            for (int c = 0; c < 3; ++c) {
                const int ch = lane + 32 * c;
                v[k][c] = slot >= 0 && ch < ROW_CHUNKS ? __ldg(pool + (long long)slot * ROW_CHUNKS + ch)
                                                       : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int k = 0; k < R; ++k) {
#pragma unroll
            for (int c = 0; c < 3; ++c) {
                acc.x ^= v[k][c].x;
                acc.y ^= v[k][c].y;
                acc.z ^= v[k][c].z;
                acc.w ^= v[k][c].w;
            }
        }
    }
    warp_xor_out(acc, lane, out);
}

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// Stage st's rows [r0, r0 + BULK_R) (those < n) into its buffer: lane 0 arms the stage's mbarrier with their
// bytes, then lane k < BULK_R copies row k. Returns nothing to wait on: the mbarrier's phase completes.
__device__ __forceinline__ void bulk_fill(unsigned buf, unsigned bar, const uint4* pool, const int* rows, long long r0,
                                          long long n, int lane) {
    const int nr = (int)min((long long)BULK_R, n - r0);
    if (lane == 0)
        asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
                     "r"(nr * ROW_BYTES)
                     : "memory");
    __syncwarp();
    if (lane < nr) {
        const uint4* src = pool + (long long)rows[r0 + lane] * ROW_CHUNKS;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                buf + lane * ROW_BYTES),
            "l"(src), "n"(ROW_BYTES), "r"(bar)
            : "memory");
    }
}
#endif

}  // namespace

// Rows in flight per warp: R = 2, 4, 8 (gather_read_v1_r<R>).
extern "C" __global__ void __launch_bounds__(256) gather_read_v1_r2(const uint4* __restrict__ pool,
                                                                     const int* __restrict__ rows, long long n,
                                                                     unsigned* __restrict__ out) {
    gather_body<2>(pool, rows, n, out);
}

extern "C" __global__ void __launch_bounds__(256) gather_read_v1_r4(const uint4* __restrict__ pool,
                                                                     const int* __restrict__ rows, long long n,
                                                                     unsigned* __restrict__ out) {
    gather_body<4>(pool, rows, n, out);
}

extern "C" __global__ void __launch_bounds__(256) gather_read_v1_r8(const uint4* __restrict__ pool,
                                                                     const int* __restrict__ rows, long long n,
                                                                     unsigned* __restrict__ out) {
    gather_body<8>(pool, rows, n, out);
}

// pool, rows, n, out as above. Block BULK_WARPS x 32, dynamic shared memory BULK_SMEM.
extern "C" __global__ void __launch_bounds__(BULK_WARPS * 32) gather_read_v1_bulk(const uint4* __restrict__ pool,
                                                                                const int* __restrict__ rows,
                                                                                long long n,
                                                                                unsigned* __restrict__ out) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // the warp's ring: BULK_STAGES buffers of BULK_R rows, then their mbarriers
    unsigned char* ring = smem + (size_t)warp * BULK_STAGES * (BULK_R * ROW_BYTES + 16);
    const unsigned buf0 = smem_u32(ring), bar0 = buf0 + BULK_STAGES * BULK_R * ROW_BYTES;
    const long long gw = ((long long)blockIdx.x * BULK_WARPS + warp), tw = (long long)gridDim.x * BULK_WARPS;
    const long long step = tw * BULK_R;
    if (lane == 0)
        for (int s = 0; s < BULK_STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar0 + 16 * s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncwarp();
    long long next = gw * BULK_R;  // the next row group to fill
#pragma unroll
    for (int s = 0; s < BULK_STAGES; ++s, next += step)
        if (next < n) bulk_fill(buf0 + s * BULK_R * ROW_BYTES, bar0 + 16 * s, pool, rows, next, n, lane);
    uint4 acc = make_uint4(0u, 0u, 0u, 0u);
    int s = 0;
    unsigned phase = 0;
    for (long long r0 = gw * BULK_R; r0 < n; r0 += step) {
        const unsigned bar = bar0 + 16 * s;
        asm volatile(
            "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n" ::"r"(
                bar),
            "r"(phase)
            : "memory");
        const uint4* b = reinterpret_cast<const uint4*>(ring + s * BULK_R * ROW_BYTES);
        const int nc = (int)min((long long)BULK_R, n - r0) * ROW_CHUNKS;
        xor_chunks(acc, b, nc, lane);
        __syncwarp();  // every lane's reads of the stage are done before the copy engine refills it
        if (next < n) bulk_fill(buf0 + s * BULK_R * ROW_BYTES, bar, pool, rows, next, n, lane);
        next += step;
        if (++s == BULK_STAGES) {
            s = 0;
            phase ^= 1u;
        }
    }
    warp_xor_out(acc, lane, out);
#else
    __trap();  // cp.async.bulk needs sm_90
#endif
}
