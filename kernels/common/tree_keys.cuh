// Keys of the best-first tree builders (tree_build/v1..v3): score keys and rank-tuple order.
#pragma once

typedef unsigned long long u64;

// A double as a 64-bit order-preserving integer: larger x -> larger key, never 0 (0 marks an
// empty slot). +0.0 folds -0.0 into +0.0 (Python compares them equal).
__device__ __forceinline__ u64 okey(double x) {
    u64 b = (u64)__double_as_longlong(x + 0.0);
    return (b >> 63) ? ~b : (b | 0x8000000000000000ull);
}

// (hi_a, lo_a, depth_a) < (hi_b, lo_b, depth_b), depth = bits 16-23 of the meta word: Python
// tuple order of the rank tuples.
__device__ __forceinline__ bool ranks_less(u64 hi_a, u64 lo_a, unsigned meta_a, u64 hi_b, u64 lo_b, unsigned meta_b) {
    if (hi_a != hi_b) return hi_a < hi_b;
    if (lo_a != lo_b) return lo_a < lo_b;
    return ((meta_a >> 16) & 0xFFu) < ((meta_b >> 16) & 0xFFu);
}
