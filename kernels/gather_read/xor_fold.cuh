// The gather-read probes' exact check (gather_read/v1.cu, gather_read/pair_v1.cu): each warp folds the words
// it read into a uint4 by XOR, then into out [4] at the end.
#pragma once

// acc ^= the first nc 16-byte chunks at b (a stage in shared memory), lane l taking chunks l, l + 32, ...
__device__ __forceinline__ void xor_chunks(uint4& acc, const uint4* b, int nc, int lane) {
    for (int c = lane; c < nc; c += 32) {
        const uint4 w = b[c];
        acc.x ^= w.x;
        acc.y ^= w.y;
        acc.z ^= w.z;
        acc.w ^= w.w;
    }
}

// The warp's XOR into out (one atomicXor per word from lane 0).
__device__ __forceinline__ void warp_xor_out(uint4 acc, int lane, unsigned* __restrict__ out) {
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
