// Gather-read of a CTA pair: what it saves two CTAs that both need the same latent-cache rows in shared memory
// (two row blocks of one key chunk in the tree-verify kernels, tree_verify/wgmma_v7.cu) to fetch each row once
// for both by TMA multicast, instead of once each. Notebook 02b, 13zo; tools/gather_pair.py times and meters it.
//
// pool [slots, 72] uint4 (one row: 576 bf16 = 72 chunks of 16 B), rows [n] int32 slots -> out [2][4]: out [r]
// ^= the XOR of every 32-bit word of the n rows, as CTA rank r of every cluster received them (XOR is order-free,
// so each half is exact whatever the grid, and checkable against the host).
//
// Clusters of two CTAs; warp w of cluster c takes row groups g = c W + w, then g + W C (W = PAIR_WARPS warps a
// CTA, C clusters), each group PAIR_R rows, into a ring of PAIR_STAGES stages in both CTAs of the cluster:
//   gather_pair_v1_dup    each CTA copies every row of the group into its own stage (cp.async.bulk, 1152 B a row):
//                         each row read twice from L2, as the verify's row blocks read their keys today;
//   gather_pair_v1_mcast  CTA rank r copies the group's rows k with k % 2 == r into both CTAs' stages
//                         (.multicast::cluster): each row read once. A stage is refilled only once the warps of
//                         both CTAs have read it (its empty mbarrier: one arrival from each CTA).
// Both fold what each CTA received into its rank's out, so both arms move the same bytes into shared memory and
// read them back alike; they differ in the L2 reads, and the multicast arm in its cross-CTA releases.
// Blocks of PAIR_WARPS warps, dynamic shared memory PAIR_SMEM bytes; dup needs sm_90, mcast sm_90a (built for
// another target its body traps).
#include "common/cluster.cuh"
#include "gather_read/xor_fold.cuh"

#define PAIR_ROW_CHUNKS 72  // 16-byte chunks of a 576-wide bf16 row
#define PAIR_ROW_BYTES (PAIR_ROW_CHUNKS * 16)
#define PAIR_R 4            // rows a stage
#define PAIR_STAGES 4       // stages a warp
#define PAIR_WARPS 4
#define PAIR_STAGE_BYTES (PAIR_R * PAIR_ROW_BYTES)
// a warp's ring: its stages, then a full and an empty mbarrier a stage
#define PAIR_RING_BYTES (PAIR_STAGES * PAIR_STAGE_BYTES + PAIR_STAGES * 16)
#define PAIR_SMEM (PAIR_WARPS * PAIR_RING_BYTES)

namespace {

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Row `src` into stage address dst of this CTA, or (MCAST) of both CTAs of the cluster, completing on the
// mbarrier at the same offset in each.
template <bool MCAST>
__device__ __forceinline__ void copy_row(unsigned dst, const uint4* src, unsigned bar) {
    if constexpr (MCAST)
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, "
            "[%3], %4;\n" ::"r"(dst),
            "l"(src), "n"(PAIR_ROW_BYTES), "r"(bar), "h"((unsigned short)0x3)
            : "memory");
    else
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                         dst),
                     "l"(src), "n"(PAIR_ROW_BYTES), "r"(bar)
                     : "memory");
}

template <bool MCAST>
__device__ __forceinline__ void gather_pair(const uint4* __restrict__ pool, const int* __restrict__ rows,
                                            long long n, unsigned* __restrict__ out) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned rank = cluster_rank(), other = rank ^ 1u;
    const unsigned ring = smem_addr(smem) + warp * PAIR_RING_BYTES;
    const unsigned full0 = ring + PAIR_STAGES * PAIR_STAGE_BYTES, empty0 = full0 + 8;  // stage s: + 16 s
    if (lane == 0)
        for (int s = 0; s < PAIR_STAGES; ++s) {
            mbar_init(full0 + 16 * s, 1);           // this CTA's expect_tx
            mbar_init(empty0 + 16 * s, MCAST ? 2 : 1);  // the stage read by this CTA's warp (and the other's)
        }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    cluster_sync();  // both CTAs' barriers are set before either copies into or arrives at the other's
    const long long clusters = gridDim.x / 2;
    const long long step = clusters * PAIR_WARPS * PAIR_R;  // rows between a warp's groups
    long long fill = ((long long)blockIdx.x / 2 * PAIR_WARPS + warp) * PAIR_R;  // the next group to fill
    // group r0 into stage s (its k-th fill): once the stage's readers have released it, this CTA's arrival
    // with the bytes it receives, then this CTA's copies
    auto fill_stage = [&](int s, long long r0, long long k) {
        const unsigned full = full0 + 16 * s, empty = empty0 + 16 * s;
        if (k > 0) mbar_wait(empty, (unsigned)((k - 1) & 1));
        const int nr = (int)min((long long)PAIR_R, n - r0);
        if (lane == 0) mbar_expect(full, nr * PAIR_ROW_BYTES);
        __syncwarp();
        if (lane < nr && (!MCAST || (lane & 1) == (int)rank))
            copy_row<MCAST>(ring + s * PAIR_STAGE_BYTES + lane * PAIR_ROW_BYTES,
                            pool + (long long)rows[r0 + lane] * PAIR_ROW_CHUNKS, full);
    };
    long long filled = 0;  // groups filled so far
    for (int s = 0; s < PAIR_STAGES && fill < n; ++s, fill += step, ++filled) fill_stage(s, fill, 0);
    uint4 acc = make_uint4(0u, 0u, 0u, 0u);
    long long g = 0;  // groups read so far
    for (long long r0 = ((long long)blockIdx.x / 2 * PAIR_WARPS + warp) * PAIR_R; r0 < n; r0 += step, ++g) {
        const int s = (int)(g % PAIR_STAGES);
        mbar_wait(full0 + 16 * s, (unsigned)((g / PAIR_STAGES) & 1));
        const uint4* b = reinterpret_cast<const uint4*>(smem + warp * PAIR_RING_BYTES + s * PAIR_STAGE_BYTES);
        const int nc = (int)min((long long)PAIR_R, n - r0) * PAIR_ROW_CHUNKS;
        xor_chunks(acc, b, nc, lane);
        __syncwarp();  // every lane's reads of the stage are done before it is released
        if (lane == 0) {
            const unsigned empty = empty0 + 16 * s;
            mbar_arrive_remote(peer_addr(empty, rank));
            if (MCAST) mbar_arrive_remote(peer_addr(empty, other));
        }
        if (fill < n) {
            fill_stage(s, fill, filled / PAIR_STAGES);
            fill += step;
            ++filled;
        }
    }
    warp_xor_out(acc, lane, out + 4 * rank);
    cluster_sync();  // neither CTA leaves while the other may still arrive at its barriers
}
#endif

}  // namespace

// pool, rows, n, out [2][4] as above; grid an even number of CTAs, block PAIR_WARPS x 32, PAIR_SMEM bytes.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(PAIR_WARPS * 32)
    gather_pair_v1_dup(const uint4* __restrict__ pool, const int* __restrict__ rows, long long n,
                       unsigned* __restrict__ out) {
#if __CUDA_ARCH__ >= 900
    gather_pair<false>(pool, rows, n, out);
#else
    __trap();  // clusters and cp.async.bulk need sm_90
#endif
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(PAIR_WARPS * 32)
    gather_pair_v1_mcast(const uint4* __restrict__ pool, const int* __restrict__ rows, long long n,
                         unsigned* __restrict__ out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    gather_pair<true>(pool, rows, n, out);
#else
    __trap();  // built for sm_90a alone: ptxas advises against .multicast::cluster on other targets
#endif
}
