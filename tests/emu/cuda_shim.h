#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(a, b)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
using std::max;
using std::min;
struct emu_dim3 { unsigned x, y, z; };
static int emu_threads = 0, emu_cur = 0, emu_block = 0;
static inline emu_dim3 emu_thread_idx() { return {(unsigned)emu_cur, 0u, 0u}; }
static inline emu_dim3 emu_block_idx() { return {(unsigned)emu_block, 0u, 0u}; }
#define threadIdx (emu_thread_idx())
#define blockIdx (emu_block_idx())
struct EmuBar { int count = 0; long gen = 0; };
struct EmuThr { ucontext_t ctx; EmuBar* bar = nullptr; long gen = 0; bool done = false; };
static EmuThr* emu_thr = nullptr;
static ucontext_t emu_sched;
static EmuBar emu_block_bar, emu_warp_bar[32];
static uint64_t emu_xbuf[32][32];
static unsigned char* emu_smem_base = nullptr;
static void emu_wait(EmuBar* bar, int n) {
    const long g = bar->gen;
    if (++bar->count == n) { bar->count = 0; bar->gen++; return; }
    emu_thr[emu_cur].bar = bar;
    emu_thr[emu_cur].gen = g;
    swapcontext(&emu_thr[emu_cur].ctx, &emu_sched);
}
static void __syncthreads() { emu_wait(&emu_block_bar, emu_threads); }
static void __syncwarp(unsigned = 0xffffffffu) { emu_wait(&emu_warp_bar[emu_cur >> 5], 32); }
static uint64_t emu_exchange(uint64_t v, int src) {
    const int w = emu_cur >> 5;
    emu_xbuf[w][emu_cur & 31] = v;
    __syncwarp();
    const uint64_t r = emu_xbuf[w][src & 31];
    __syncwarp();
    return r;
}
static unsigned __ballot_sync(unsigned, bool p) {
    const int w = emu_cur >> 5;
    emu_xbuf[w][emu_cur & 31] = p ? 1u : 0u;
    __syncwarp();
    unsigned r = 0u;
    for (int l = 0; l < 32; ++l) r |= (unsigned)emu_xbuf[w][l] << l;
    __syncwarp();
    return r;
}
static bool __any_sync(unsigned m, bool p) { return __ballot_sync(m, p) != 0u; }
static unsigned __shfl_sync(unsigned, unsigned v, int src) { return (unsigned)emu_exchange(v, src); }
static double __shfl_sync(unsigned, double v, int src) {
    uint64_t u; std::memcpy(&u, &v, 8); u = emu_exchange(u, src); double r; std::memcpy(&r, &u, 8); return r;
}
static int __popc(unsigned x) { return __builtin_popcount(x); }
static int __ffs(int x) { return __builtin_ffs(x); }
static unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static double __longlong_as_double(long long u) { double d; std::memcpy(&d, &u, 8); return d; }
static unsigned atomicOr(unsigned* p, unsigned v) { const unsigned o = *p; *p = o | v; return o; }
static unsigned char* emu_smem() { return emu_smem_base; }
