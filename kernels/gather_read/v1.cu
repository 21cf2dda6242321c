// Gather-read probe: the bandwidth a kernel gets reading latent-cache rows one page-table slot at a time
// (page_size 1), the access pattern of the tree-verify kernels' prefix gathers (tree_verify/wgmma_v7.cu),
// without their math. It answers: what fraction of the copy bandwidth can any verify kernel reach on a
// memory-bound point, when its keys come as scattered 1152-byte rows rather than one contiguous range?
//
// pool [slots, 72] uint4 (one row: 576 bf16 = 72 chunks of 16 B), rows [n] int32 slots -> out [4] ^= the
// XOR of every 32-bit word of the n rows. XOR is order-free, so the result is exact whatever the grid and
// checkable against the host; each warp adds its XOR with one atomicXor per word at the end.
//
// Warp gw of tw takes rows [R gw, R gw + R), then [R (gw + tw), ...): lane k < R reads row k's slot and
// shares it; lane l loads chunks l, l + 32 and l + 64 (< 72) of each row, so R x 3 loads of 16 B are in
// flight per lane before the first use. Any grid; blocks of at most 256 threads (a multiple of 32: R = 8 needs
// 96 registers of loads, more than a 1024-thread block leaves a thread).
#define ROW_CHUNKS 72  // 16-byte chunks of a 576-wide bf16 row

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
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        acc.x ^= __shfl_xor_sync(0xffffffffu, acc.x, off);
        acc.y ^= __shfl_xor_sync(0xffffffffu, acc.y, off);
        acc.z ^= __shfl_xor_sync(0xffffffffu, acc.z, off);
        acc.w ^= __shfl_xor_sync(0xffffffffu, acc.w, off);
    }
    if (lane == 0) {
        atomicXor(out + 0, acc.x);
        atomicXor(out + 1, acc.y);
        atomicXor(out + 2, acc.z);
        atomicXor(out + 3, acc.w);
    }
}

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
