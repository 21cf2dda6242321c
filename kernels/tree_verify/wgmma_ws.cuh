// The warp-specialised skeleton of the wgmma tree-verify kernels (tree_verify/wgmma_v7.cu, wgmma_v9.cu,
// wgmma_v10.cu): the CTA of a producer and two consumer warpgroups, its shared-memory layout, barriers and
// pair descriptors, and the producer warpgroup's loop. wgmma_v7.cu describes the protocol; each attend kernel
// adds its consumers.
#pragma once

#include "tree_verify/fp8_e4m3.cuh"
#include "tree_verify/wgmma_common.cuh"

#define NTHREADS 384                           // producer + two consumer warpgroups
#ifndef TV_FP8
#define TV_FP8 0                               // 1: the prefix pool in FP8 (below, before fill_stage)
#endif
// setmaxnreg: 128 x 40 + 256 x 232 = 64512, the CTA's pool: the registers it launched with, 384 x 168 under
// __launch_bounds__(NTHREADS, 1), from which setmaxnreg.inc draws what .dec released, waiting until they are
// there (-D either to probe the split: tools/register_budget.py)
#ifndef PRODUCER_REGS
#define PRODUCER_REGS 40
#endif
#ifndef CONSUMER_REGS
#define CONSUMER_REGS 232
#endif
// the FP8 build's producer dequantizes, two chunks a row a thread (72: no spill in any kernel of the build,
// where 64 spilled; the consumers at 208 build v9's kernels without a spill up to 32 rows, tree_verify/wgmma_v9.cu's
// V9_FP8_MAX_NR: at 40 v9's own spills): 128 x 72 + 256 x 208 = 62464
// version 12 (tree_verify/wgmma_v12.cu): the producer also computes 8 rows (their O^T: 32 registers);
// 128 x 72 + 256 x 216 = 64512, the whole pool (v7's consumers built without spills from 216 then:
// data/results/history/register_budget.a974266.cpu.json; from 208 since S's uniform K descriptors, a3891f0).
// The first build's 128 x 80 + 256 x 216 = 65536, the SM's register file, is past the pool: its consumers'
// setmaxnreg.inc waited for ever (the GPU test hung, 742d34c).
#define V12_PRODUCER_REGS 72
#define V12_CONSUMER_REGS 216
#define FP8_PRODUCER_REGS 72
#define FP8_CONSUMER_REGS 208
// timing probe 9 (below): its producer, copying every chunk twice, spills at 40: 128 x 56 + 256 x 224 (its
// control, the default with the same consumers: -DCONSUMER_REGS=224)
#define PROBE9_PRODUCER_REGS 56
#define PROBE9_CONSUMER_REGS 224
#define PROBE9 (TV7_PROBE == 9)
// what the build's setmaxnreg passes
#define PRODUCER_NREG (TV_FP8 ? FP8_PRODUCER_REGS : PROBE9 ? PROBE9_PRODUCER_REGS : PRODUCER_REGS)
#define CONSUMER_NREG (TV_FP8 ? FP8_CONSUMER_REGS : PROBE9 ? PROBE9_CONSUMER_REGS : CONSUMER_REGS)
#define OFF_K0 TILE_BYTES
#define OFF_K1 (2 * TILE_BYTES)
#define OFF_ROWS (3 * TILE_BYTES)              // float [5][64]: m, c_A, c_B, l_0, l_1
#define NDESC 4                                // pair descriptors in the ring
#define DESC_INTS 12                           // job, flags, request, row0, rows, (tail, k0, kend) x 2, pad
#define OFF_DESC (OFF_ROWS + 5 * BM * 4)       // int [NDESC][DESC_INTS]
#define OFF_BARS (OFF_DESC + NDESC * DESC_INTS * 4)  // full[2][9], empty[2][3], Q full, Q empty, desc[4]
#define NBARS (2 * NCB + 6 + 2 + NDESC)
#define SMEM_BYTES (OFF_BARS + NBARS * 8 + 1024)  // + slack to align the base to 1024 B: 223920
#define V_R0 4                                 // consumer 1's V half: column blocks 4..7
#define D_FIRST 1                              // descriptor flags: the job's first pair,
#define D_LAST 2                               // its last pair,
#define D_END 4                                // the stream's last pair
// named barriers (0 is __syncthreads), the 256 consumer threads: one consumer arrives, the other waits
#define NB_SCALE_A 1  // consumer 0: m_A, c_A and P_A written
#define NB_SCALE_B 2  // consumer 1: m_B, c_B written
#define NB_PB 3       // consumer 1: P_B written
#define NB_LSUM 4     // both: their l of the job written

// TV7_RACECHECK=1 (-DTV7_RACECHECK=1): a checking build for compute-sanitizer racecheck. Every consumer
// handoff is a bar.sync of both consumers, every lane of a releasing warp arrives on the empty barriers
// (their counts x 32), and both consumers pass as many of their own 128-thread barriers between handoffs
// (consume_v9's pair_t): the forms racecheck sees as ordered (tools/racecheck_patterns.py). Slower, never the
// default, which keeps bar.arrive and one arrival a warp.
#ifndef TV7_RACECHECK
#define TV7_RACECHECK 0
#endif
#define WARP_ARRIVALS (TV7_RACECHECK ? 32 : 1)  // arrivals one releasing warp makes

// TV7_PROBE (-DTV7_PROBE=n): a timing probe of v7's consumers (tree_verify_v7_attend, tree_verify_v10_attend),
// never the default; its outputs are wrong. 1: the consumers wait for both stages of each pair and release
// them, no MMA (the producer's gathers alone); 2: the producer gathers each stage once, for the first pair,
// then only arrives on its barriers (the consumers' work over rows already in shared memory, no gather; it
// holds for version 9's consumers too, whose producer this is);
// 3: 2 without the P V MMAs; 4: 2 without the S MMAs (each consumer only waits for its stage's blocks);
// 5: 2 with consumer 1's S over stage 0's keys too (both S read one K tile: does a second tile slow them?);
// 6: 2 with consumer 1's S taken out (consumer 0's S alone on the tensor cores: its rate without the other's);
// 7: 6 with consumer 0's S issued twice, the second adding the same products again (a wgmma's cost in the pair's S
// past the first's start); 8: the producer gathers the stages of even pairs alone, and only arrives on odd pairs'
// (half the bytes from L2 into shared memory; the skipped copies also change the producer's waits: 02b, 13zn);
// 9: the producer copies every chunk of every stage twice (the same bytes: what the gathers' bytes cost, with
// the producer's waits as the default's). kdlib.perf.suites.attention_bounds times 1-4 beside the default build;
// attention_timeline traces 2-7; tools/verify_energy.py meters 1, 2, 8 and 9.
#ifndef TV7_PROBE
#define TV7_PROBE 0
#endif

// TV_TRACE (-DTV_TRACE=1): a timeline build of v7's consumers (tree_verify_v7_attend, tree_verify_v10_attend),
// never the default; the outputs are the default build's. Lane 0 of each warp of each consumer warpgroup stamps
// its SM's clock (%clock64, shared by the CTA's warps) at TRACE_EVENTS points of each of its first TRACE_PAIRS
// pairs (wgmma_v7.cu names them) into tv_trace [TRACE_CTAS][2][TRACE_WARPS][TRACE_PAIRS][TRACE_SLOTS] (warp 0's
// row: thread 0's stamps); the pair's job and its descriptor flags take the two slots past the events.
// kdlib.perf.suites.attention_timeline reads it.
#ifndef TV_TRACE
#define TV_TRACE 0
#endif
#define TRACE_CTAS 256
#define TRACE_WARPS 4  // a consumer warpgroup's warps
#define TRACE_PAIRS 96
#define TRACE_EVENTS 9
#define TRACE_SLOTS (TRACE_EVENTS + 2)

// TV_FP8 (-DTV_FP8=1): the prefix pool in the FP8 MLA latent layout of kdlib.ref.fp8 (DeepSeek-V3.2's, FlashMLA's
// "FP8 with scale"): 656-byte rows, the 512 latent values in e4m3, then 4 float32 scales (one per 128 latent
// dims), then the 64 rope values in bf16 (tree_verify/fp8_e4m3.cuh: the offsets and the conversion, which the
// dequant-first gather shares). The tree rows (tree_kv) stay bf16. Each prefix tile is dequantized
// into the stage's bf16 blocks, by the producer (fill_stage) or, in the kernel with v9's consumers, by the
// consumer that owns the stage (dequant_half), so the MMAs and their bits are the bf16 build's: on the
// dequantized pool the two builds give the same output bit for bit where the scales are powers of two (the
// layout's rule: e4m3 times the scale is then exact in bf16; other scales are rounded to bf16 first, FlashMLA's
// rule, kdlib.cuda.attention.fp8_dequantized).
static_assert(!(TV_FP8 && TV7_PROBE), "the timing probes are bf16 builds");
#define FILLER (TV_FP8 ? 64 : 128)             // threads filling one stage (FP8: a half of the producer each)
#define OFF_SCALES (OFF_BARS + NBARS * 8 + 20 * BM * 4)  // fp8 builds: float [2][64][4], past v9's rows
#define FP8_SMEM (OFF_SCALES + 2 * BN * 16 + 1024)       // 231088 with the alignment slack

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

extern __shared__ unsigned char smem_raw[];  // the attend kernels' dynamic shared memory

#if TV_TRACE
extern "C" {
__device__ unsigned long long tv_trace[TRACE_CTAS * 2 * TRACE_WARPS * TRACE_PAIRS * TRACE_SLOTS];
}
#endif

// Slot e of pair n of consumer c's warp wt / 32 in tv_trace: lane 0 of the warp only, where traced.
__device__ __forceinline__ void trace_put(int c, int n, int e, int wt, unsigned long long v) {
#if TV_TRACE
    if ((wt & 31) == 0 && n < TRACE_PAIRS && blockIdx.x < TRACE_CTAS)
        tv_trace[(((blockIdx.x * 2 + c) * TRACE_WARPS + (wt >> 5)) * TRACE_PAIRS + n) * TRACE_SLOTS + e] = v;
#endif
}

// Event e of pair n: the SM clock now (nothing in the default build).
__device__ __forceinline__ void trace_mark(int c, int n, int e, int wt) {
#if TV_TRACE
    unsigned long long t;
    asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(t)::"memory");
    trace_put(c, n, e, wt, t);
#endif
}

#define BAR_EMPTY(bars, s, g) ((bars) + 8 * (2 * NCB + 3 * (s) + (g)))
#define BAR_QFULL(bars) ((bars) + 8 * (2 * NCB + 6))
#define BAR_QEMPTY(bars) ((bars) + 8 * (2 * NCB + 7))
#define BAR_DESC(bars, d) ((bars) + 8 * (2 * NCB + 8 + (d)))
// version 12's, past version 7's: Q rope read (8 consumer warps, once a job), the rope block of stage s read by the
// producer (its 4 warps, once a pair)
#define BAR_QROPE(bars) ((bars) + 8 * NBARS)
#define BAR_ROPE8(bars, s) ((bars) + 8 * (NBARS + 1 + (s)))

// An arrive by lane 0 of the warp (predicated, no branch): one arrival per warp. The __syncwarp first
// orders the other lanes' shared-memory accesses (their P stores) before lane 0's release. The checking
// build: every lane arrives.
__device__ __forceinline__ void warp_arrive(unsigned bar, int lane) {
    __syncwarp();
    if (TV7_RACECHECK) {
        bar_arrive(bar);
        return;
    }
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 st;\nsetp.eq.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar),
        "r"(lane)
        : "memory");
}

// A consumer's handoff to the other on named barrier id: bar.arrive (bar.sync in the checking build).
__device__ __forceinline__ void handoff(int id) {
    if (TV7_RACECHECK) nb_sync(id);
    else nb_arrive(id);
}

// P (fp32 s) out to the other consumer: its bf16 fragments into pf (this side's P V operand from registers),
// stored at dst (store_p's layout), fenced for the async proxy's reads, then the handoff on named barrier nb.
// (Stored by stmatrix instead, the same bytes, it measured no faster: data/results/kernel_ab_stmatrix.h200.json.)
__device__ __forceinline__ void publish_p(const float (&s)[32], unsigned (&pf)[4][4], unsigned dst, int nb, int lr0,
                                          int lr1, int t4) {
    p_frags(s, pf);
    store_p(pf, dst, lr0, lr1, t4);
    fence_async_smem();
    handoff(nb);
}

// A consumer's P V over its own tile (P from registers, pf; V's half at vhalf) issued and waited for, stamped
// (event e), then stage st's V block group g and its rope block released to the producer.
__device__ __forceinline__ void pv_own_tile(float (&o)[128], unsigned (&pf)[4][4], unsigned vhalf, bool fresh,
                                            unsigned bars, int st, int g, int lane, int c, int n, int e, int wt) {
    reg_fence(o);
    reg_fence(pf);
    wg_fence();
    if (TV7_PROBE != 3) issue_pv_rs(o, pf, vhalf, fresh);
    wg_commit();
    wg_wait<0>();
    reg_fence(o);
    reg_fence(pf);  // held to here: the wgmma read them until its wait
    trace_mark(c, n, e, wt);
    warp_arrive(BAR_EMPTY(bars, st, g), lane);
    warp_arrive(BAR_EMPTY(bars, st, 2), lane);
}

// The FP8 path of fill_stage (TV_FP8 builds, prefix tiles), by the stage's filler: 64 threads, thread (lrow, ch)
// with ch < 4 taking rows lrow + 16 p and 16-byte chunks ch and ch + 4 of each 128-byte row piece. A V half
// (group g: blocks 4g .. 4g + 3, the latent dims of scale tiles 2g and 2g + 1) is staged in its own last two
// blocks: tile 2g + u's e4m3 bytes, 128 a row, in block 4g + 2 + u with the bf16 blocks' 128-B swizzle; the
// ch = 0 threads copy each row's 4 scales (into sc, float [64][4], with group 0). One cp.async group each.
__device__ __forceinline__ void stage_fp8(unsigned kst, int g, const TileRows& t, const char* kvb, unsigned sc,
                                          int lrow, int ch) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int row = lrow + 16 * p, bytes = (t.valid >> p) & 1 ? 16 : 0;
        const char* src = kvb + (long long)t.row[p] * FP8_ROW + 256 * g;
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // tile u = k / 2, chunk c = ch + 4 (k % 2)
            const int u = k >> 1, c = ch + 4 * (k & 1);
            cp_async16(kst + (4 * g + 2 + u) * CB_BYTES + row * 128 + ((c ^ (row & 7)) << 4),
                       src + 128 * u + 16 * c, bytes);
        }
        if (g == 0 && ch == 0) cp_async16(sc + row * 16, src + FP8_SCALES, bytes);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// 16 staged e4m3 values (chunk c of a row's scale tile 2g + u) -> their 16 bf16 values in the stage: block
// 4g + 2u + c / 4, chunks 2 (c % 4) and the next (128-B swizzle).
__device__ __forceinline__ void put_fp8_chunk(unsigned kst, int g, int u, int row, int c, uint4 x, unsigned s2) {
    const unsigned blk = kst + (4 * g + 2 * u + (c >> 2)) * CB_BYTES + row * 128;
    const int c0 = 2 * (c & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // 8 values a store
        unsigned r[4];
        e4m3x4_scaled(h ? x.z : x.x, s2, r[0], r[1]);
        e4m3x4_scaled(h ? x.w : x.y, s2, r[2], r[3]);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(blk + (((c0 + h) ^ (row & 7)) << 4)),
                     "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                     : "memory");
    }
}

__device__ __forceinline__ uint4 ld_shared_v4(unsigned a) {
    uint4 x;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "r"(a)
                 : "memory");
    return x;
}

// The float32 scale at a, rounded to bf16 once, in both halves of the result.
__device__ __forceinline__ unsigned ld_scale_bf16x2(unsigned a) {
    unsigned r;
    asm volatile("{\n.reg .f32 f;\nld.shared.f32 f, [%1];\ncvt.rn.bf16x2.f32 %0, f, f;\n}\n" : "=r"(r) : "r"(a)
                 : "memory");
    return r;
}

// Group g's dequantization once its copies land (PENDING: the cp.async groups committed after it). A thread
// reads only the staged chunks it copied, but a row's scales come from its ch = 0 thread and a row's tile
// 2g + 1 goes where the row's staged bytes are: the row's four threads are lanes of one warp, so __syncwarp
// orders both (after the landing, and between each row's reads and its writes). Tile 2g goes to blocks 4g,
// 4g + 1 (clear of the staging), tile 2g + 1 to 4g + 2, 4g + 3 row by row; then the proxy fence (st.shared,
// read by wgmma) and the thread's arrive on the four blocks' full barriers.
template <int PENDING>
__device__ __forceinline__ void dequant_fp8(unsigned kst, unsigned bars, int s, int g, unsigned sc, int lrow,
                                            int ch) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
    __syncwarp();
    const unsigned stg = kst + (4 * g + 2) * CB_BYTES;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int row = lrow + 16 * p;
        const unsigned s0 = ld_scale_bf16x2(sc + row * 16 + 8 * g);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int c = ch + 4 * k;
            put_fp8_chunk(kst, g, 0, row, c, ld_shared_v4(stg + row * 128 + ((c ^ (row & 7)) << 4)), s0);
        }
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int row = lrow + 16 * p;
        const unsigned a = stg + CB_BYTES + row * 128;
        const uint4 x0 = ld_shared_v4(a + ((ch ^ (row & 7)) << 4)), x1 = ld_shared_v4(a + (((ch + 4) ^ (row & 7)) << 4));
        const unsigned s1 = ld_scale_bf16x2(sc + row * 16 + 8 * g + 4);
        __syncwarp();  // the row's staged bytes read by its four threads
        put_fp8_chunk(kst, g, 1, row, ch, x0, s1);
        put_fp8_chunk(kst, g, 1, row, ch + 4, x1, s1);
    }
    fence_async_smem();
#pragma unroll
    for (int cb = 4 * g; cb < 4 * g + 4; ++cb) bar_arrive(BAR_CBFULL(bars, s, cb));
}

// V half g of a consumer's own stage st (FP8 builds, CDQ: a prefix tile of pair parity par, staged as stage_fp8
// puts it; sc: the stage's scales), dequantized by its 128 threads (wt) once the half's copies land (g = 1: the
// rope's too): thread (row wt / 2, h = wt % 2) takes chunks 4h .. 4h + 3 of the row's tiles 2g and 2g + 1, so
// it writes blocks 4g + h and 4g + 2 + h. Tile 2g + 1 goes where the row's staged bytes are: the row's two
// threads are lanes of one warp, and each loads all its bytes of the half before the __syncwarp. Its chunks in
// the order k ^ 2h, so that a store's eight threads (four rows, both h) hit eight bank groups. Then the proxy
// fence and the warpgroup's barrier (nb): the half is whole for every warp's wgmma.
__device__ __forceinline__ void dequant_half(unsigned kst, unsigned bars, int st, unsigned par, unsigned sc, int wt,
                                             int g, int nb) {
    const int row = wt >> 1, h = wt & 1;
    bar_wait(BAR_CBFULL(bars, st, 4 * g), par);
    if (g == 1) bar_wait(BAR_CBFULL(bars, st, ROPE_CB), par);
    uint4 x[2][4];  // [u][k]: chunk 4h + (k ^ 2h) of the row's tile 2g + u
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int c = 4 * h + (k ^ 2 * h);
            x[u][k] = ld_shared_v4(kst + (4 * g + 2 + u) * CB_BYTES + row * 128 + ((c ^ (row & 7)) << 4));
        }
    __syncwarp();  // the row's staged bytes of this half read by both its threads
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const unsigned s2 = ld_scale_bf16x2(sc + row * 16 + 4 * (2 * g + u));
#pragma unroll
        for (int k = 0; k < 4; ++k) put_fp8_chunk(kst, g, u, row, 4 * h + (k ^ 2 * h), x[u][k], s2);
    }
    fence_async_smem();
    wg_sync(nb);
}

// Stage s's fill for pair n: each group of blocks (V_L, V_R, rope) once its readers of pair n - 1 are
// done (their release n - 1 has parity (n & 1) ^ 1: a fresh barrier passes it at once), in release order.
// TV_FP8 builds, by the stage's 64-thread filler (NCH = 2 chunks a thread): prefix tiles staged (stage_fp8; sc:
// the stage's scales), then dequantized by the filler (dequant_fp8) once the stage's three groups are issued;
// CDQ, by the consumer that owns the stage (dequant_half): the filler's copies of group g arrive on the full
// barrier of block 4g, the rope's on its own, as they land; tail tiles' copies too (gather_half's ONE). The
// kernel uses these three full barriers of a stage alone, each completed once a pair and waited on once a
// pair (its consumer's issue_st, GROUPS).
template <bool CDQ = false>
__device__ __forceinline__ void fill_stage(unsigned kst, unsigned bars, int s, int n, const TileRows& t,
                                           const char* kvb, const char* tkb, int lrow, int ch, unsigned sc) {
    const unsigned ep = (n & 1) ^ 1;
    if (TV_FP8 && !t.tail) {
        bar_wait(BAR_EMPTY(bars, s, 0), ep);
        stage_fp8(kst, 0, t, kvb, sc, lrow, ch);
        if (CDQ) bar_arrive_copies(BAR_CBFULL(bars, s, 0));
        bar_wait(BAR_EMPTY(bars, s, 1), ep);
        stage_fp8(kst, 1, t, kvb, sc, lrow, ch);
        if (CDQ) bar_arrive_copies(BAR_CBFULL(bars, s, V_R0));
        bar_wait(BAR_EMPTY(bars, s, 2), ep);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const int row = lrow + 16 * p;
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int c = ch + 4 * k;
                cp_async16(kst + ROPE_CB * CB_BYTES + row * 128 + ((c ^ (row & 7)) << 4),
                           kvb + (long long)t.row[p] * FP8_ROW + FP8_ROPE + 16 * c, (t.valid >> p) & 1 ? 16 : 0);
            }
        }
        bar_arrive_copies(BAR_CBFULL(bars, s, ROPE_CB));
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        if (CDQ) return;
        dequant_fp8<2>(kst, bars, s, 0, sc, lrow, ch);
        dequant_fp8<1>(kst, bars, s, 1, sc, lrow, ch);
        return;
    }
    const int copies = TV7_PROBE == 9 ? 2 : TV7_PROBE == 8 ? (n & 1) == 0 : TV7_PROBE < 2 || n == 0;
    constexpr int NCH = 128 / FILLER;
    bar_wait(BAR_EMPTY(bars, s, 0), ep);
    gather_half<0, V_R0, NCH, CDQ>(kst, bars, s, t, kvb, tkb, lrow, ch, copies);
    bar_wait(BAR_EMPTY(bars, s, 1), ep);
    gather_half<V_R0, ROPE_CB, NCH, CDQ>(kst, bars, s, t, kvb, tkb, lrow, ch, copies);
    bar_wait(BAR_EMPTY(bars, s, 2), ep);
    gather_half<ROPE_CB, NCB, NCH>(kst, bars, s, t, kvb, tkb, lrow, ch, copies);
}

// Keys [k0, kend) and tail flag of tile `it` of jb; past the job's tiles: an empty tile.
__device__ __forceinline__ void pair_tile(const Job& jb, int it, int* d) {
    bool tail = false;
    int k0 = 0, kend = 0;
    if (it < jb.ntiles) tile_keys(jb, it, tail, k0, kend);
    d[0] = tail;
    d[1] = k0;
    d[2] = kend;
}

// Pair n's descriptor (job jb at position cur, nx the next; fresh: nx starts another job) into its ring slot,
// then the slot's arrive (the producer's thread 0).
__device__ __forceinline__ void put_desc(int* desc, unsigned bars, int n, const Job& jb, const Pos& cur, const Pos& nx,
                                         bool fresh) {
    int* d = desc + (n % NDESC) * DESC_INTS;
    d[0] = cur.j;
    d[1] = (cur.i == 0 ? D_FIRST : 0) | (nx.j < 0 || fresh ? D_LAST : 0) | (nx.j < 0 ? D_END : 0);
    d[2] = jb.b;
    d[3] = jb.row0;
    d[4] = jb.nrows;
    pair_tile(jb, 2 * cur.i, d + 5);
    pair_tile(jb, 2 * cur.i + 1, d + 8);
    bar_arrive(BAR_DESC(bars, n % NDESC));
}

// Pair n's descriptor, waited for, into registers (the producer reuses the slot NDESC pairs on): its job j,
// flags, the job's fields the masks read (jb), and consumer c's tile: tail, keys [k0, kend).
__device__ __forceinline__ void get_desc(const int* desc, unsigned bars, int n, int c, int& j, int& flags, Job& jb,
                                         bool& tail, int& k0, int& kend) {
    bar_wait(BAR_DESC(bars, n % NDESC), (n / NDESC) & 1);
    const int* d = desc + (n % NDESC) * DESC_INTS;
    j = d[0];
    flags = d[1];
    jb.b = d[2];
    jb.row0 = d[3];
    jb.nrows = d[4];
    tail = d[5 + 3 * c] != 0;
    k0 = d[6 + 3 * c];
    kend = d[7 + 3 * c];
}

// The barriers at bars (tid 0 of the CTA; a __syncthreads must follow). CDQ: the empty barrier of the V half
// that the stage's owner dequantizes for the other consumer (EMPTY(0, 1), EMPTY(1, 0)) takes the owner's 4
// warps too, so that its refill waits on every thread that wrote or read that half (consume_v9's pair_t).
template <bool CDQ = false>
__device__ __forceinline__ void init_bars(unsigned bars) {
    for (int s = 0; s < 2; ++s) {
        for (int c = 0; c < NCB; ++c) bar_init(BAR_CBFULL(bars, s, c), FILLER);
        bar_init(BAR_EMPTY(bars, s, 0), (CDQ && s == 1 ? 8 : 4) * WARP_ARRIVALS);
        bar_init(BAR_EMPTY(bars, s, 1), (CDQ && s == 0 ? 8 : 4) * WARP_ARRIVALS);
        bar_init(BAR_EMPTY(bars, s, 2), 8 * WARP_ARRIVALS);
    }
    bar_init(BAR_QFULL(bars), 128);
    bar_init(BAR_QEMPTY(bars), 8 * WARP_ARRIVALS);
    for (int d = 0; d < NDESC; ++d) bar_init(BAR_DESC(bars, d), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// CTA blockIdx.x's job of round r in the snake deal of the v10 plan's order (order [jobs]: the jobs by
// decreasing tiles): the (r G + c)-th largest in even rounds, the (r G + G - 1 - c)-th in odd ones; -1 past
// the jobs. Only where the plan wrote an order (order [0] >= 0).
__device__ __forceinline__ int dealt_job(const int* plan, const int* order, int r) {
    const int G = gridDim.x, c = blockIdx.x;
    const int k = r * G + (r & 1 ? G - 1 - c : c);
    return k < plan_jobs(plan) ? order[k] : -1;
}

// The producer warpgroup (wt: its thread) over the CTA's stream of tile pairs: Q of each job, the pair
// descriptors (ring at desc), the K tiles into the stages at base + OFF_K0 and base + OFF_K1. The CTA's jobs:
// ORDERED, the snake deal of order (dealt_job); else the static round-robin (order unread; produce_v10 picks).
// CDQ (FP8 builds): the consumers dequantize the prefix tiles (fill_stage).
template <bool ORDERED, bool CDQ = false>
__device__ __forceinline__ void produce(unsigned base, int* desc, unsigned bars, const __nv_bfloat16* q,
                                       const __nv_bfloat16* kv, const int* page_table,
                                       const __nv_bfloat16* tree_kv, const int* plan, const int* order, int nreq,
                                       int P, int Q, int H, int wt) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_NREG));
    const unsigned k0s = base + OFF_K0, k1s = base + OFF_K1;
    const char* kvb = reinterpret_cast<const char*>(kv);
    const char* tkb = reinterpret_cast<const char*>(tree_kv);
    // FP8 builds: two fillers of FILLER = 64 threads, filler f (wt / 64) filling stage f alone (tile 2i + f of
    // pair i) at its own pace, so that one stage's landing and dequantization overlap the other's copies (it
    // measured about as fast as one 128-thread filler for both: notebook 02b, 15b);
    // filler 0 also loads each job's Q (its 64 threads twice) and writes the descriptors. bf16: one filler.
    const int fl = TV_FP8 ? wt / FILLER : 0, ft = wt % FILLER;  // the thread's filler, its thread in it
    // gather: rows lrow + 16p, 16-byte chunk ch of each block (FP8: chunks ch and ch + 4)
    const int lrow = ft >> (TV_FP8 ? 2 : 3), ch = ft & (TV_FP8 ? 3 : 7);
    // Each job is decoded from the plan once, not per pair: decode_job is a binary search over the requests,
    // a chain of dependent loads in the producer's path.
    int round = 0;  // ORDERED: the round of the last job dealt
    auto next = [&](const Job& jb, Pos p, bool& fresh) {
        if constexpr (ORDERED) return pos_after(jb, p, fresh, [&] { return dealt_job(plan, order, ++round); });
        else return pos_next(plan, jb, p, fresh);
    };
    Pos cur{ORDERED ? dealt_job(plan, order, 0) : (int)blockIdx.x, 0};
    Job jb = decode_job(plan, nreq, cur.j);  // cur's job
    TileRows ra = tile_rows(jb, page_table, P, Q, fl, lrow);  // the pair's tiles A and B (FP8: the filler's)
    TileRows rb = tile_rows(jb, page_table, P, Q, 1, lrow);
    bool fresh;  // nx starts another job
    Pos nx = next(jb, cur, fresh);
    int jobs = 0;  // Q loads so far
    for (int n = 0;; ++n) {
        if (cur.i == 0 && fl == 0) {  // a new job: its Q once both consumers' S of the last job are done
            bar_wait(BAR_QEMPTY(bars), (jobs & 1) ^ 1);
            load_q(base, BAR_QFULL(bars), q, jb, Q * H, ft);
            if (TV_FP8) load_q(base, BAR_QFULL(bars), q, jb, Q * H, ft + FILLER);
            ++jobs;
        }
        if (wt == 0) put_desc(desc, bars, n, jb, cur, nx, fresh);
        if (TV_FP8) {
            fill_stage<CDQ>(fl ? k1s : k0s, bars, fl, n, ra, kvb, tkb, lrow, ch, base + OFF_SCALES + fl * BN * 16);
        } else {
            fill_stage(k0s, bars, 0, n, ra, kvb, tkb, lrow, ch, 0);  // stage 0 is released first
            fill_stage(k1s, bars, 1, n, rb, kvb, tkb, lrow, ch, 0);
        }
        if (nx.j < 0) break;
        if (fresh) jb = decode_job(plan, nreq, nx.j);
        cur = nx;  // the next pair's slots now
        ra = tile_rows(jb, page_table, P, Q, 2 * cur.i + fl, lrow);
        if (!TV_FP8) rb = tile_rows(jb, page_table, P, Q, 2 * cur.i + 1, lrow);
        nx = next(jb, cur, fresh);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
}

// Version 10's producer: the snake deal where its plan wrote an order (order [0] >= 0), else version 9's
// (the static round-robin); one branch for the whole warpgroup, before either path's setmaxnreg.
template <bool CDQ = false>
__device__ __forceinline__ void produce_v10(unsigned base, int* desc, unsigned bars, const __nv_bfloat16* q,
                                           const __nv_bfloat16* kv, const int* page_table,
                                           const __nv_bfloat16* tree_kv, const int* plan, const int* order,
                                           int nreq, int P, int Q, int H, int wt) {
    if (order[0] >= 0)
        produce<true, CDQ>(base, desc, bars, q, kv, page_table, tree_kv, plan, order, nreq, P, Q, H, wt);
    else
        produce<false, CDQ>(base, desc, bars, q, kv, page_table, tree_kv, plan, order, nreq, P, Q, H, wt);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
