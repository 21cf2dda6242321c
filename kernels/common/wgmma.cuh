// Warpgroup MMA primitives of sm_90a (wgmma): shared-memory addresses and operand descriptors, the
// fences and groups around an asynchronous MMA, and the MMAs of the shapes the kernels issue. The tree-verify
// kernels (tree_verify/wgmma_common.cuh) and the wgmma_rate probe (wgmma_rate/v1.cu) use them.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// Shared memory written through the generic proxy (st.shared, cp.async) is next read by wgmma.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Pin a register between the wgmma issue / wait points (the compiler does not see the async writes).
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void reg_fence(unsigned& r) { asm volatile("" : "+r"(r)::"memory"); }
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) reg_fence(r[i]);
}
__device__ __forceinline__ void reg_fence(unsigned (&r)[4][4]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) reg_fence(r[i / 4][i % 4]);
}

// Shared-memory matrix descriptor, 128-byte swizzle, 8-row groups 1024 B apart; lbo: the
// leading-dimension offset (unused for K-major; the 64-column block stride for MN-major).
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr, unsigned lbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

#define ACC8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                   "+f"(d[i + 6]), "+f"(d[i + 7])
#define ACC32(d, i) ACC8(d, i), ACC8(d, i + 8), ACC8(d, i + 16), ACC8(d, i + 24)

// d[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B K-major in shared memory.
__device__ __forceinline__ void wgmma_s(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : ACC32(d, 0)
        : "l"(da), "l"(db), "r"(acc));
}

#define ACC4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define ACC16(d, i) ACC8(d, i), ACC8(d, i + 8)

// d[64 x N] (+)= A[64 x 16] B[16 x N], both in shared memory; B K-major, A K-major (TA 0) or MN-major
// (TA 1); acc 0: d = A B. d: the N / 2 accumulators of this thread.
template <int N, int TA>
__device__ __forceinline__ void wgmma_n(float* d, unsigned long long da, unsigned long long db, int acc) {
    if constexpr (N == 8)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3}, "
                     "%4, %5, p, 1, 1, %7, 0;\n}\n"
                     : ACC4(d, 0)
                     : "l"(da), "l"(db), "r"(acc), "n"(TA));
    if constexpr (N == 16)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7}, "
                     "%8, %9, p, 1, 1, %11, 0;\n}\n"
                     : ACC8(d, 0)
                     : "l"(da), "l"(db), "r"(acc), "n"(TA));
    if constexpr (N == 24)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %14, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, "
                     "%12, %13, p, 1, 1, %15, 0;\n}\n"
                     : ACC8(d, 0), ACC4(d, 8)
                     : "l"(da), "l"(db), "r"(acc), "n"(TA));
    if constexpr (N == 32)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                     "%16, %17, p, 1, 1, %19, 0;\n}\n"
                     : ACC16(d, 0)
                     : "l"(da), "l"(db), "r"(acc), "n"(TA));
    if constexpr (N == 40)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %22, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19}, "
                     "%20, %21, p, 1, 1, %23, 0;\n}\n"
                     : ACC16(d, 0), ACC4(d, 16)
                     : "l"(da), "l"(db), "r"(acc), "n"(TA));
    if constexpr (N == 48)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23}, "
                     "%24, %25, p, 1, 1, %27, 0;\n}\n"
                     : ACC16(d, 0), ACC8(d, 16)
                     : "l"(da), "l"(db), "r"(acc), "n"(TA));
    if constexpr (N == 56)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %30, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27}, "
                     "%28, %29, p, 1, 1, %31, 0;\n}\n"
                     : ACC16(d, 0), ACC8(d, 16), ACC4(d, 24)
                     : "l"(da), "l"(db), "r"(acc), "n"(TA));
    if constexpr (N == 72)  // version 11's 72 rows (tree_verify/wgmma_v11.cu)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35}, "
                     "%36, %37, p, 1, 1, %39, 0;\n}\n"
                     : ACC32(d, 0), ACC4(d, 32)
                     : "l"(da), "l"(db), "r"(acc), "n"(TA));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
