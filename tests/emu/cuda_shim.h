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
#define __launch_bounds__(...)
#define __shared__ static  // one copy for the block's threads (blocks run one after another)
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
static int __shfl_up_sync(unsigned, int v, int delta) {
    const int lane = emu_cur & 31;
    return (int)emu_exchange((uint64_t)(unsigned)v, lane >= delta ? lane - delta : lane);
}
static unsigned __match_any_sync(unsigned, int v) {
    const int w = emu_cur >> 5;
    emu_xbuf[w][emu_cur & 31] = (uint64_t)(unsigned)v;
    __syncwarp();
    unsigned r = 0u;
    for (int l = 0; l < 32; ++l) r |= (emu_xbuf[w][l] == (uint64_t)(unsigned)v ? 1u : 0u) << l;
    __syncwarp();
    return r;
}
static int atomicMax(int* p, int v) { const int o = *p; *p = std::max(o, v); return o; }
struct int2 { int x, y; };
static int2 make_int2(int x, int y) { return {x, y}; }
static int __popc(unsigned x) { return __builtin_popcount(x); }
static int __ffs(int x) { return __builtin_ffs(x); }
static unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static double __longlong_as_double(long long u) { double d; std::memcpy(&d, &u, 8); return d; }
static unsigned atomicOr(unsigned* p, unsigned v) { const unsigned o = *p; *p = o | v; return o; }
static unsigned char* emu_smem() { return emu_smem_base; }
static void (*emu_body)() = nullptr;  // the kernel call with its arguments, set by a driver
static void emu_entry() {
    emu_body();
    emu_thr[emu_cur].done = true;
    emu_thr[emu_cur].bar = nullptr;
    swapcontext(&emu_thr[emu_cur].ctx, &emu_sched);
}
// Run `body` as grid blocks of `threads` threads over smem_bytes of dynamic shared memory (ending at a
// guard page, stale bytes: finite doubles in even blocks, NaNs in odd ones).
// 0: done; 1: deadlock (a barrier some thread never reaches).
static int emu_run(int grid, int threads, int smem_bytes, void (*body)()) {
    emu_body = body;
    const long page = sysconf(_SC_PAGESIZE), used = (smem_bytes + 15) / 16 * 16;
    const long span = (used + page - 1) / page * page;
    unsigned char* map = (unsigned char*)mmap(nullptr, span + 2 * page, PROT_READ | PROT_WRITE,
                                              MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    mprotect(map, page, PROT_NONE);
    mprotect(map + page + span, page, PROT_NONE);
    emu_smem_base = map + page + span - used;
    const size_t stack = 1 << 16;
    emu_threads = threads;
    emu_thr = new EmuThr[threads];
    char* stacks = (char*)std::malloc(stack * threads);
    int rc = 0;
    for (int b = 0; b < grid && rc == 0; ++b) {
        emu_block = b;
        std::memset(map + page, (b & 1) ? 0xFF : 0xA5, span);  // stale: NaN bit patterns in odd blocks
        emu_block_bar = EmuBar();
        for (auto& w : emu_warp_bar) w = EmuBar();
        for (int t = 0; t < threads; ++t) {
            emu_thr[t] = EmuThr();
            getcontext(&emu_thr[t].ctx);
            emu_thr[t].ctx.uc_stack.ss_sp = stacks + stack * t;
            emu_thr[t].ctx.uc_stack.ss_size = stack;
            emu_thr[t].ctx.uc_link = &emu_sched;
            makecontext(&emu_thr[t].ctx, emu_entry, 0);
        }
        for (;;) {
            bool live = false, moved = false;
            for (int t = 0; t < threads; ++t) {
                if (emu_thr[t].done) continue;
                live = true;
                if (emu_thr[t].bar && emu_thr[t].bar->gen == emu_thr[t].gen) continue;
                emu_thr[t].bar = nullptr;
                emu_cur = t;
                moved = true;
                swapcontext(&emu_sched, &emu_thr[t].ctx);
            }
            if (!live) break;
            if (!moved) { rc = 1; break; }
        }
    }
    std::free(stacks);
    delete[] emu_thr;
    munmap(map, span + 2 * page);
    return rc;
}
