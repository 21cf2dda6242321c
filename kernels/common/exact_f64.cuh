// Exact float -> double for the kernels that must match numpy bit for bit.
//
// CuPy compiles with -ftz=true, under which a plain conversion may flush float32 subnormals to
// zero; numpy keeps them. Inline PTX is emitted as written, so the cvt below keeps them.
#pragma once

__device__ __forceinline__ double to_f64(float f) {
    double d;
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(f));  // no .ftz: subnormals kept, one instruction
    return d;
}
__device__ __forceinline__ double to_f64(double d) { return d; }
