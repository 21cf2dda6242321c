// Gather of the tree-verify kernels' K stages (tree_verify/wgmma_ws.cuh, fill_stage) without their math: what the
// same bytes cost the producer in 16-byte cp.async copies (today) against one TMA box a 128-byte row piece, and what
// two CTAs that need the same tiles (two row blocks of one key chunk) pay to fetch each row once for both. Notebook
// 02b, 13zp; tools/gather_stage.py times and meters it.
//
// pool [slots, 576] bf16 (one latent-cache row, 1152 B), rows [n] int32 slots. Tile t is rows [64 t, 64 t + 64):
// keys past n are zeros. A stage holds one tile as the verify's MMAs read it: nine column blocks of 64 rows x 128 B
// (CB_BYTES apart), chunk c (16 B) of row r's piece at r 128 + 16 (c ^ r % 8), the 128-byte swizzle. A CTA is two
// warpgroups and two stages (its tiles alternately into stage 0 and 1); one CTA takes tiles blockIdx.x,
// + gridDim.x, ..., the two CTAs of a cluster (the pair arms) both take tiles c, c + C, ... (cluster c of C):
//   warpgroup 0, the producer, fills a stage once its reader (both CTAs' readers: push) has released it:
//     gather_stage_v1_cp16  the verify's own fill: gather_half (tree_verify/wgmma_common.cuh), 36 cp.async of
//                           16 B a thread a tile, each thread arriving on the stage's full mbarrier once they land;
//     gather_stage_v1_tma   one TMA box a row piece (tma_load_2d; map: the pool as a [slots, 576] bf16 tensor,
//                           box 1 x 64, 128-byte swizzle, which follows the box's shared-memory address): thread
//                           t takes row t % 64, column blocks 0-4 (t < 64) or 5-8, expecting their bytes on the
//                           full mbarrier before it issues them; 576 boxes a tile. A key past n reads row -1,
//                           outside the tensor: zeros.
//     gather_stage_v1_dup   cp16 in both CTAs of a cluster: each fetches every row of the tile itself, each row
//                           read twice from L2, as the verify's two row blocks of a chunk read it today;
//     gather_stage_v1_push  CTA rank r copies the tile's rows 32 r .. 32 r + 31 by 16-byte cp.async, its
//                           producer's warps 0-1 (36 copies a thread, as cp16's 128 threads make for 64 rows),
//                           onto the stage's half mbarrier; warp 2's lane 0, the pusher, waits for them to land
//                           and pushes them from its shared memory into the same place of the other CTA's stage:
//                           nine bulk copies of the 32 rows of a column block (4 KB, contiguous), completing on
//                           that CTA's full mbarrier, on which it then expects the other's 9 x 4 KB. The copiers
//                           never wait for a landing. Each row read once from L2.
//   warpgroup 1, the reader, reads the stage back in the swizzled layout and releases it: word k of logical chunk q
//     (0..71) of each row, rotated left by q % 32, into its XOR k. XOR is order-free across rows, so the result is
//     exact whatever the grid and checkable against the host; a chunk landed in the wrong place changes it. Each CTA
//     folds into out [4 rank] (rank 0 outside a cluster).
// Blocks of 256 threads, dynamic shared memory STAGE_SMEM bytes; sm_90a (built for another target the body traps).
// Measured (data/results/gather_stage.h100-80gb-hbm3.json, notebook 02b 13zp): the TMA arm is the slower and takes
// more energy at both pools measured, so the verify keeps its cp.async fill. The pair arms
// (data/results/history/gather_stage.share.{32k,200k}.ac1ea32.h100-80gb-hbm3.json): push is the slower and takes
// more energy than dup at both pools, so the verify's row blocks keep fetching their own rows.
#include "common/cluster.cuh"
#include "gather_read/xor_fold.cuh"
#include "tree_verify/wgmma_common.cuh"

#define STAGE_THREADS 256
#define STAGE_OFF_BARS (2 * TILE_BYTES)  // [2][NCB] (BAR_CBFULL: block 0's the full barrier, 1's push's half), empty [2]
#define STAGE_SMEM (STAGE_OFF_BARS + 8 * (2 * NCB + 2) + 1024)  // + slack to align the base to 1024 B
#define STAGE_TMA_SPLIT 5                // tma: column blocks 0..4 by threads 0-63, 5..8 by 64-127
#define STAGE_HALF_BYTES (BN / 2 * 128)  // push: one CTA's 32 rows of a column block, 4 KB
#define STAGE_COPIERS 64                 // push: the producer's threads that copy (warps 0-1); warp 2's lane 0 pushes
#define ARM_CP16 0
#define ARM_TMA 1
#define ARM_DUP 2
#define ARM_PUSH 3

namespace {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The box of 2D tensor map `map` (a CUtensorMap in global memory, kdlib.cuda.loader.tensor_map_2d) at element
// (col x, row y) into shared memory at dst by TMA, its bytes completed on mbarrier bar. In a swizzled map the
// swizzle follows dst's address bits, so a one-row box of 128 bytes at row r of a 1024-aligned 128-byte-swizzle
// block lands as that row of a whole block's box would.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const void* map, int x, int y, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(bar)
        : "memory");
}

// n_bytes of this CTA's shared memory at src into cluster address dst (the other CTA's), by the bulk copy engine,
// completing on the mbarrier at cluster address bar.
__device__ __forceinline__ void push_bulk(unsigned dst, unsigned src, unsigned n_bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "r"(src), "r"(n_bytes), "r"(bar)
                 : "memory");
}

// The pool slots of keys key0 + lrow + 16 p (p < NP) of rows [n], and which of them are below n.
template <int NP>
__device__ __forceinline__ TileRows tile_rows_of(const int* __restrict__ rows, long long n, long long key0,
                                                 int lrow) {
    TileRows tr;
    tr.tail = false;
    tr.valid = 0;
#pragma unroll
    for (int p = 0; p < NP; ++p) {
        const long long key = key0 + lrow + 16 * p;
        const bool ok = key < n;
        tr.valid |= ok << p;
        tr.row[p] = ok ? rows[key] : 0;
    }
    return tr;
}

// The push arm's copiers (ft: thread 0..63 of the producer): rows 32 rank .. 32 rank + 31 of each of the CTA's
// tiles into its stage, once both CTAs' readers have released it (the push into the other's stage waits on the
// same release, through the half mbarrier); thread (lrow = ft / 4, ch = ft % 4) rows lrow + 16 p (p < 2),
// chunks ch and ch + 4 of each row piece, arriving on the stage's half mbarrier once they land.
__device__ __forceinline__ void push_copy(const __nv_bfloat16* __restrict__ pool, const int* __restrict__ rows,
                                          long long n, long long tiles, long long first, long long step,
                                          unsigned base, unsigned bars, unsigned empty0, unsigned rank, int ft) {
    const char* kvb = reinterpret_cast<const char*>(pool);
    const int lrow = ft >> 2, ch = ft & 3;
    long long k = 0;  // fills so far
    for (long long t = first; t < tiles; t += step, ++k) {
        const int s = (int)(k & 1);
        if (k >= 2) mbar_wait(empty0 + 8 * s, (unsigned)(((k >> 1) - 1) & 1));
        const TileRows tr = tile_rows_of<2>(rows, n, t * BN + BN / 2 * rank, lrow);
        // bars + 8: the stage's half mbarrier (BAR_CBFULL (s, 1)) in gather_half's ONE arrival
        gather_half<0, NCB, 2, true, 2>(base + s * TILE_BYTES + rank * STAGE_HALF_BYTES, bars + 8, s, tr, kvb, kvb,
                                        lrow, ch);
    }
}

// The push arm's pusher (one thread): each fill's half, once landed, into the same place of the other CTA's stage,
// completing on that CTA's full mbarrier; then this CTA's arrival on its own full, expecting the other's half.
__device__ __forceinline__ void push_send(long long tiles, long long first, long long step, unsigned base,
                                          unsigned bars, unsigned rank) {
    const unsigned other = rank ^ 1u;
    long long k = 0;  // fills so far
    for (long long t = first; t < tiles; t += step, ++k) {
        const int s = (int)(k & 1);
        const unsigned half = base + s * TILE_BYTES + rank * STAGE_HALF_BYTES, full = BAR_CBFULL(bars, s, 0);
        mbar_wait(BAR_CBFULL(bars, s, 1), (unsigned)((k >> 1) & 1));
        fence_async_smem();  // the landed copies, read by the bulk copies' async proxy
        const unsigned peer_full = peer_addr(full, other);
        for (int cb = 0; cb < NCB; ++cb)
            push_bulk(peer_addr(half + cb * CB_BYTES, other), half + cb * CB_BYTES, STAGE_HALF_BYTES, peer_full);
        mbar_expect(full, NCB * STAGE_HALF_BYTES);  // the other CTA's half, still to come
    }
}

// The reader's wait for mbarrier bar's phase of parity `parity`: at cluster scope in the push arm (half the stage
// is the other CTA's copies), at the CTA's elsewhere (the verify's wait, bar_wait).
template <int ARM>
__device__ __forceinline__ void wait_stage(unsigned bar, unsigned parity) {
    if constexpr (ARM == ARM_PUSH) mbar_wait(bar, parity);
    else bar_wait(bar, parity);
}

template <int ARM>
__device__ __forceinline__ void gather_stage(const __nv_bfloat16* __restrict__ pool, const void* map,
                                             const int* __restrict__ rows, long long n,
                                             unsigned* __restrict__ out) {
    constexpr bool PAIR = ARM == ARM_DUP || ARM == ARM_PUSH;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
    const unsigned bars = base + STAGE_OFF_BARS, empty0 = bars + 8 * 2 * NCB;  // empty (s): empty0 + 8 s
    const int wg = threadIdx.x >> 7, wt = threadIdx.x & 127, lane = threadIdx.x & 31;
    const unsigned rank = PAIR ? cluster_rank() : 0u, other = rank ^ 1u;
    if (threadIdx.x == 0) {
        for (int s = 0; s < 2; ++s) {
            // every producer thread once a fill; push: the pusher's expect of the other CTA's half
            bar_init(BAR_CBFULL(bars, s, 0), ARM == ARM_PUSH ? 1 : 128);
            if (ARM == ARM_PUSH) bar_init(BAR_CBFULL(bars, s, 1), STAGE_COPIERS);  // this CTA's half landed
            bar_init(empty0 + 8 * s, ARM == ARM_PUSH ? 8 : 4);  // lane 0 of each reader warp (of both CTAs) a read
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // seen by the TMA unit too
    }
    if constexpr (PAIR) cluster_sync();  // both CTAs' barriers set before either arrives at or copies into the other's
    else __syncthreads();
    const long long tiles = (n + BN - 1) / BN;
    const long long first = PAIR ? blockIdx.x >> 1 : blockIdx.x, step = PAIR ? gridDim.x >> 1 : gridDim.x;
    if (wg == 0) {
        if constexpr (ARM == ARM_PUSH) {
            if (wt < STAGE_COPIERS) push_copy(pool, rows, n, tiles, first, step, base, bars, empty0, rank, wt);
            else if (wt == STAGE_COPIERS) push_send(tiles, first, step, base, bars, rank);
        } else {
            const char* kvb = reinterpret_cast<const char*>(pool);
            long long k = 0;  // this CTA's fills so far
            for (long long t = first; t < tiles; t += step, ++k) {
                const int s = (int)(k & 1);
                if (k >= 2) bar_wait(empty0 + 8 * s, (unsigned)(((k >> 1) - 1) & 1));
                const unsigned dst = base + s * TILE_BYTES;
                if constexpr (ARM == ARM_TMA) {
                    const int row = wt & 63, cb0 = wt < 64 ? 0 : STAGE_TMA_SPLIT;
                    const int cb1 = wt < 64 ? STAGE_TMA_SPLIT : NCB;
                    const long long key = t * BN + row;
                    const int y = key < n ? rows[key] : -1;
                    const unsigned full = BAR_CBFULL(bars, s, 0);
                    mbar_expect(full, (cb1 - cb0) * 128);
                    for (int cb = cb0; cb < cb1; ++cb)
                        tma_load_2d(dst + cb * CB_BYTES + row * 128, map, cb * 64, y, full);
                } else {
                    const int lrow = wt >> 3, ch = wt & 7;
                    const TileRows tr = tile_rows_of<4>(rows, n, t * BN, lrow);
                    gather_half<0, NCB, 1, true>(dst, bars, s, tr, kvb, kvb, lrow, ch);
                }
            }
        }
    } else {
        uint4 acc = make_uint4(0u, 0u, 0u, 0u);
        long long k = 0;  // this CTA's reads so far
        for (long long t = first; t < tiles; t += step, ++k) {
            const int s = (int)(k & 1);
            wait_stage<ARM>(BAR_CBFULL(bars, s, 0), (unsigned)((k >> 1) & 1));
            const unsigned char* st = smem_raw + (base - raw) + s * TILE_BYTES;
            for (int i = wt; i < BN * NCB * 8; i += 128) {
                const int r = i / (NCB * 8), q = i % (NCB * 8), cb = q >> 3, c = q & 7;
                const uint4 w = *reinterpret_cast<const uint4*>(st + cb * CB_BYTES + r * 128 + ((c ^ (r & 7)) << 4));
                const int rot = q & 31;
                acc.x ^= __funnelshift_l(w.x, w.x, rot);
                acc.y ^= __funnelshift_l(w.y, w.y, rot);
                acc.z ^= __funnelshift_l(w.z, w.z, rot);
                acc.w ^= __funnelshift_l(w.w, w.w, rot);
            }
            __syncwarp();  // every lane's reads of the stage are done before it is released
            if (lane == 0) {
                if constexpr (ARM == ARM_PUSH) {  // both CTAs' stage s: this one's next fill, the other's next push
                    mbar_arrive_remote(peer_addr(empty0 + 8 * s, rank));
                    mbar_arrive_remote(peer_addr(empty0 + 8 * s, other));
                } else {
                    bar_arrive(empty0 + 8 * s);
                }
            }
        }
        warp_xor_out(acc, lane, out + 4 * rank);
    }
    if constexpr (PAIR) {  // neither CTA leaves while the other may still copy into or arrive at it
        __syncwarp();      // the pusher's warp whole again for the aligned cluster barrier
        cluster_sync();
    }
}
#endif

}  // namespace

// pool, rows, n, out [2][4] as above; map: the pool's tensor map (tma), unread by the others.
// Any grid; block STAGE_THREADS, STAGE_SMEM bytes.
extern "C" __global__ void __launch_bounds__(STAGE_THREADS, 1)
    gather_stage_v1_cp16(const __nv_bfloat16* __restrict__ pool, const void* map, const int* __restrict__ rows,
                         long long n, unsigned* __restrict__ out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    gather_stage<ARM_CP16>(pool, map, rows, n, out);
#else
    __trap();  // built for sm_90a alone (the verify's primitives)
#endif
}

extern "C" __global__ void __launch_bounds__(STAGE_THREADS, 1)
    gather_stage_v1_tma(const __nv_bfloat16* __restrict__ pool, const void* map, const int* __restrict__ rows,
                        long long n, unsigned* __restrict__ out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    gather_stage<ARM_TMA>(pool, map, rows, n, out);
#else
    __trap();
#endif
}

// The pair arms: grid an even number of CTAs (clusters of two).
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(STAGE_THREADS, 1)
    gather_stage_v1_dup(const __nv_bfloat16* __restrict__ pool, const void* map, const int* __restrict__ rows,
                        long long n, unsigned* __restrict__ out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    gather_stage<ARM_DUP>(pool, map, rows, n, out);
#else
    __trap();
#endif
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(STAGE_THREADS, 1)
    gather_stage_v1_push(const __nv_bfloat16* __restrict__ pool, const void* map, const int* __restrict__ rows,
                         long long n, unsigned* __restrict__ out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    gather_stage<ARM_PUSH>(pool, map, rows, n, out);
#else
    __trap();
#endif
}
