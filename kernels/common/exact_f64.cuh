// Exact float -> double for the kernels that must match numpy bit for bit.
//
// CuPy compiles with -ftz=true, under which a plain conversion may flush float32 subnormals to
// zero; numpy keeps them. Subnormal f = mantissa * 2^-149, exact in double.
#pragma once

__device__ __forceinline__ double to_f64(float f) {
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0u) {
        const double d = (double)(int)(u & 0x007fffffu) * 0x1p-149;
        return (u >> 31) ? -d : d;
    }
    return (double)f;
}
__device__ __forceinline__ double to_f64(double d) { return d; }
