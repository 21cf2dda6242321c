// wgmma rate probe (issue 19, notebook 02b 13v): how long one SM's tensor cores take for each warpgroup MMA
// shape the verify's attend kernels issue, both operands in shared memory as the kernels issue them, with
// nothing else running. The 8 x 9 points' designs differ in these shapes: version 7 multiplies 64 rows
// (S = Q K^T, m64n64k16), the transposed products N rows (S^T = K Q^T and O^T = V^T P^T, m64nNk16), and a
// pass of 72 rows could take 64 of them one way and 8 the other.
//
// wgmma_rate_v1_st: S^T's issue (version 9's issue_st): A the key tile [64 rows x RATE_CB column blocks], K-major;
//   B the rows [N x RATE_CB blocks], K-major; a round is RATE_CB x 4 wgmmas into one accumulator (the first of the
//   first round overwrites it). N = 64 runs version 7's m64n64k16 (wgmma_s), every other N wgmma_n.
// wgmma_rate_v1_pv: O^T's issue (issue_pv_t over RATE_MB blocks): A = V^T, MN-major, from the key tile's first
//   RATE_MB blocks; B = P^T [N rows x 64 keys], K-major, the rows' first block; a round is RATE_MB x 4 wgmmas,
//   four into each block's accumulators.
//
// Grid G CTAs, one an SM (RATE_SMEM), W x 128 threads: W warpgroups issue at once on the same operands (two, as
// versions 7-11's consumers). The CTA first stores a [64 x RATE_D] and b [N x RATE_D] (bf16, row-major in global)
// into the 128-B swizzle the kernels' stages use (16-byte chunk c of row r at chunk c ^ (r % 8)). Each warpgroup
// then runs `reps` rounds, each one commit and one wait as the kernels' S and P V are, and writes its accumulators
// to out [G, W, 128, RATE_ACC] (thread t's value i at i; the wgmma layout: value 4 jj + 2 h + e of warp w, lane
// 4 g + t4 is row 16 w + g + 8 h, column 8 jj + 2 t4 + e of its block's D [64 x N]; pv: block mb at mb N / 2).
// cycles [G, W]: the warpgroup's thread 0 clock64 from after the stores to after its last wait.
//
// kdlib-arch: sm_90a wgmma=wgmma_rate_v1_st,wgmma_rate_v1_pv

#include <cuda_bf16.h>

#include "common/wgmma.cuh"

#define RATE_CB 9                           // column blocks of 64 dims: the 576 of a latent row with its rope
#define RATE_D (64 * RATE_CB)
#define RATE_NMAX 72                        // the most rows: version 11's 72
#define RATE_MB 2                           // pv: the V^T blocks a round (version 11's per consumer)
#define RATE_ACC (RATE_MB * RATE_NMAX / 2)  // the most accumulators a thread: 72
#define RATE_A_BYTES (RATE_CB * 64 * 128)   // 73,728
#define RATE_B_OFF RATE_A_BYTES
#define RATE_B_BYTES (RATE_CB * RATE_NMAX * 128)
#define RATE_SMEM (RATE_B_OFF + RATE_B_BYTES + 1024)  // + slack to align the base to 1024 B: 157,696
#define RATE_MAX_WG 2

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// rows [n x RATE_D] bf16 (row-major, global) into RATE_CB column blocks of n rows at dst, 128-B swizzled.
__device__ __forceinline__ void put_swizzled(unsigned dst, const __nv_bfloat16* rows, int n) {
    const uint4* src = reinterpret_cast<const uint4*>(rows);  // 8 bf16 a chunk, RATE_CB * 8 chunks a row
    for (int i = threadIdx.x; i < n * RATE_CB * 8; i += blockDim.x) {
        const int r = i / (RATE_CB * 8), cb = i / 8 % RATE_CB, c = i % 8;
        const uint4 v = src[i];
        const unsigned a = dst + cb * n * 128 + r * 128 + ((c ^ (r & 7)) << 4);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
    }
}

// Warpgroup wg's rounds of shape (PV, N) on the operands at a, b, then its accumulators and cycles (each shape
// its own accumulator array: one array shared by all of them made ptxas serialize the wgmmas).
template <int N, bool PV>
__device__ __forceinline__ void rounds(unsigned a, unsigned b, int reps, float* out, long long* cycles, int wg,
                                       int t) {
    constexpr int NACC = PV ? RATE_MB * N / 2 : N / 2;
    float d[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) d[i] = 0.f;
    const unsigned long long da = sw128_desc(a, PV ? 64 * 128 : 16), db = sw128_desc(b, 16);
    const long long t0 = clock64();
    for (int r = 0; r < reps; ++r) {
        wg_fence();
        if constexpr (PV) {  // issue_pv_t's: V^T of RATE_MB blocks, four k-steps of 16 keys each
#pragma unroll
            for (int mb = 0; mb < RATE_MB; ++mb)
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
                    wgmma_n<N, 1>(d + mb * (N / 2), da + ((mb * 64 * 128 + kk * 2048) >> 4), db + ((kk * 32) >> 4),
                                  r > 0 || kk > 0);
        } else {  // issue_st's: the RATE_CB column blocks, four k-steps each
#pragma unroll
            for (int k = 0; k < RATE_CB * 4; ++k) {
                const unsigned offa = (k >> 2) * 64 * 128 + (k & 3) * 32, offb = (k >> 2) * N * 128 + (k & 3) * 32;
                if constexpr (N == 64)
                    wgmma_s(d, da + (offa >> 4), db + (offb >> 4), r > 0 || k > 0);
                else
                    wgmma_n<N, 0>(d, da + (offa >> 4), db + (offb >> 4), r > 0 || k > 0);
            }
        }
        wg_commit();
        wg_wait<0>();
    }
    const long long t1 = clock64();
    reg_fence(d);  // the last wait's accumulators, pinned before they are stored
    float* o = out + (((long long)blockIdx.x * (blockDim.x >> 7) + wg) * 128 + t) * RATE_ACC;
#pragma unroll
    for (int i = 0; i < NACC; ++i) o[i] = d[i];
    if (t == 0) cycles[blockIdx.x * (blockDim.x >> 7) + wg] = t1 - t0;
}

// The CTA's operands into shared memory, then each warpgroup's rounds of shape (PV, n).
template <bool PV>
__device__ __forceinline__ void rate(int n, const __nv_bfloat16* a, const __nv_bfloat16* b, int reps, float* out,
                                     long long* cycles) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u, bb = base + RATE_B_OFF;
    put_swizzled(base, a, 64);
    put_swizzled(bb, b, n);
    fence_async_smem();
    __syncthreads();
    const int wg = threadIdx.x >> 7, t = threadIdx.x & 127;
    switch (n) {
        case 8: rounds<8, PV>(base, bb, reps, out, cycles, wg, t); break;
        case 16: rounds<16, PV>(base, bb, reps, out, cycles, wg, t); break;
        case 24: rounds<24, PV>(base, bb, reps, out, cycles, wg, t); break;
        case 32: rounds<32, PV>(base, bb, reps, out, cycles, wg, t); break;
        case 40: rounds<40, PV>(base, bb, reps, out, cycles, wg, t); break;
        case 48: rounds<48, PV>(base, bb, reps, out, cycles, wg, t); break;
        case 56: rounds<56, PV>(base, bb, reps, out, cycles, wg, t); break;
        case 64:  // version 7's S alone (wgmma_n has no N = 64)
            if constexpr (PV) __trap();
            else rounds<64, false>(base, bb, reps, out, cycles, wg, t);
            break;
        case 72: rounds<72, PV>(base, bb, reps, out, cycles, wg, t); break;
        default: __trap();  // the host checks the shape
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// a [64 x RATE_D], b [n x RATE_D] bf16; reps >= 1 rounds; out [G, W, 128, RATE_ACC] fp32; cycles [G, W] int64.
// Grid G, block W x 128 (W <= RATE_MAX_WG), dynamic shared memory RATE_SMEM. n: 8, 16, .., 56, 64 or 72.
extern "C" __global__ void __launch_bounds__(RATE_MAX_WG * 128, 1) wgmma_rate_v1_st(
    const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b, int n, int reps, float* __restrict__ out,
    long long* __restrict__ cycles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    rate<false>(n, a, b, reps, out, cycles);
#else
    __trap();  // built without sm_90a: no wgmma
#endif
}

// As wgmma_rate_v1_st, O^T's shape: n 8, 16, .., 56 or 72 (b's first 64 columns are P^T's keys).
extern "C" __global__ void __launch_bounds__(RATE_MAX_WG * 128, 1) wgmma_rate_v1_pv(
    const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b, int n, int reps, float* __restrict__ out,
    long long* __restrict__ cycles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    rate<true>(n, a, b, reps, out, cycles);
#else
    __trap();
#endif
}
