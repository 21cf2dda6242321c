// The synchronisation patterns of the wgmma tree-verify kernels (tree_verify/wgmma_v6.cu, wgmma_v7.cu),
// each on its own and small, for compute-sanitizer racecheck (tools/racecheck_patterns.py): a hazard the
// tool reports on a pattern that is correct by the PTX memory model is a pattern the tool cannot see, not a
// race of the kernel. rc_no_barrier is the control, a real race the tool must report. One block; threads
// 0..127 are "warpgroup 0", 128..255 "warpgroup 1"; a third warpgroup (384 threads, as v7's producer)
// only waits at the end. out [blockDim] receives what each thread read, so nothing is optimised away.
#include "tree_verify/wgmma_common.cuh"

#define ROUNDS 8
#define ROWS 32  // one value per quad of a warpgroup (v7's row arrays: the quad's threads hold one row)

// Control: warpgroup 0 writes, warpgroup 1 reads, nothing orders them.
extern "C" __global__ void rc_no_barrier(float* out) {
    __shared__ float s[128];
    const int t = threadIdx.x, i = t & 127;
    if (t < 128) s[i] = float(i);
    if (t >= 128 && t < 256) out[t] = s[i];
}

// The reference: __syncthreads between the write and the read.
extern "C" __global__ void rc_syncthreads(float* out) {
    __shared__ float s[128];
    const int t = threadIdx.x, i = t & 127;
    if (t < 128) s[i] = float(i);
    __syncthreads();
    if (t >= 128 && t < 256) out[t] = s[i];
}

// One handoff through a named barrier of the 256 threads: one warpgroup writes and arrives, the other
// waits (bar.sync) and reads. FROM: the writing warpgroup.
template <int FROM>
__device__ __forceinline__ void handoff(float* out) {
    __shared__ float s[128];
    const int t = threadIdx.x, i = t & 127, wg = t >> 7;
    if (wg == FROM) {
        s[i] = float(i);
        nb_arrive(1);
    } else if (t < 256) {
        nb_sync(1);
        out[t] = s[i];
    }
    __syncthreads();
}

extern "C" __global__ void rc_named_handoff(float* out) { handoff<0>(out); }
extern "C" __global__ void rc_named_handoff_back(float* out) { handoff<1>(out); }

// The job end's exchange (job_end's s_l): every thread of the 256 writes its own value, all bar.sync, each
// reads the other warpgroup's.
extern "C" __global__ void rc_named_exchange(float* out) {
    __shared__ float s[256];
    const int t = threadIdx.x;
    if (t < 256) {
        s[t] = float(t);
        nb_sync(1);
        out[t] = s[t ^ 128];
    }
    __syncthreads();
}

// The seesaw's row handoff (v7's s_m, s_ca, s_cb and its named barriers), ROUNDS rounds. Warpgroup 0
// writes the rows, arrives on 1, waits on 2, reads, waits on 3; warpgroup 1 waits on 1, reads, writes,
// arrives on 2 and on 3 (v7: NB_SCALE_A, NB_SCALE_B, NB_PB). MODE 0: the quad's four threads store the
// same value (v7); 1: one thread of the quad stores; 2: as 0 with a __syncwarp around each warp's stores;
// 3: as 2 without barrier 3; 4: as 3 with warpgroup 1 in bar.sync 2 too (no bar.arrive); 5: as 4 with
// warpgroup 0 in bar.sync 1 too (every barrier a bar.sync of both); 6: as 5 with each warpgroup's own
// 128-thread bar.sync (ids 5, 6: v9's wg_sync) first in each round; 7: as 6 with three of them; 8: as 6 with
// warpgroup 0's alone.
template <int MODE>
__device__ __forceinline__ void seesaw(float* out) {
    __shared__ float s[ROWS];
    const int t = threadIdx.x, r = (t & 127) >> 2;
    const bool store = MODE != 1 || (t & 3) == 0, warp_sync = MODE >= 2;
    const int own = MODE == 7 ? 3 : MODE == 6 || (MODE == 8 && t < 128);  // this warpgroup's 128-thread barriers
    float acc = 0.f;
    if (t < 256) {
        for (int n = 0; n < ROUNDS; ++n) {
            for (int k = 0; k < own; ++k) wg_sync(5 + (t >> 7));
            if (t < 128) {
                if (warp_sync) __syncwarp();
                if (store) s[r] = float(r + n);
                if (warp_sync) __syncwarp();
                if (MODE >= 5) nb_sync(1);
                else nb_arrive(1);
                nb_sync(2);
                acc += s[r];
                if (MODE < 3) nb_sync(3);
            } else {
                nb_sync(1);
                const float v = s[r];
                acc += v;
                if (warp_sync) __syncwarp();
                if (store) s[r] = v + 1.f;
                if (warp_sync) __syncwarp();
                if (MODE >= 4) nb_sync(2);
                else nb_arrive(2);
                if (MODE < 3) nb_arrive(3);
            }
        }
        out[t] = acc;
    }
    __syncthreads();
}

extern "C" __global__ void rc_seesaw_quad(float* out) { seesaw<0>(out); }
extern "C" __global__ void rc_seesaw_one(float* out) { seesaw<1>(out); }
extern "C" __global__ void rc_seesaw_syncwarp(float* out) { seesaw<2>(out); }
extern "C" __global__ void rc_seesaw_two_barriers(float* out) { seesaw<3>(out); }
extern "C" __global__ void rc_seesaw_both_sync(float* out) { seesaw<4>(out); }
extern "C" __global__ void rc_seesaw_all_sync(float* out) { seesaw<5>(out); }
extern "C" __global__ void rc_seesaw_wg_sync(float* out) { seesaw<6>(out); }
extern "C" __global__ void rc_seesaw_wg_sync3(float* out) { seesaw<7>(out); }
extern "C" __global__ void rc_seesaw_wg0_sync(float* out) { seesaw<8>(out); }

// A full / empty mbarrier ring of one slot, ROUNDS rounds: warpgroup 0 waits "empty", writes, arrives
// "full"; warpgroup 1 waits "full", reads, arrives "empty" (v7's stage and descriptor barriers).
extern "C" __global__ void rc_mbarrier(float* out) {
    __shared__ float s[128];
    __shared__ alignas(8) unsigned long long bars[2];
    const int t = threadIdx.x, i = t & 127;
    const unsigned full = smem_u32(&bars[0]), empty = smem_u32(&bars[1]);
    if (t == 0) {
        bar_init(full, 128);
        bar_init(empty, 128);
    }
    __syncthreads();
    float acc = 0.f;
    for (int n = 0; n < ROUNDS && t < 256; ++n) {
        if (t < 128) {
            bar_wait(empty, (n & 1) ^ 1);  // a fresh barrier passes parity 1 at once
            s[i] = float(n + i);
            bar_arrive(full);
        } else {
            bar_wait(full, n & 1);
            acc += s[i];
            bar_arrive(empty);
        }
    }
    if (t >= 128 && t < 256) out[t] = acc;
    __syncthreads();
}

// v7's stage blocks: warpgroup 0 fills the slot with cp.async and arrives "full" when its copies land
// (cp.async.mbarrier.arrive.noinc); warpgroup 1 waits, reads the slot, overwrites it (v7's P over the rope
// block) and releases it on "empty"; the next fill waits on "empty". RELEASE 0: every consumer thread
// arrives (count 128); 1: lane 0 of each of the 4 warps (count 4: warp_arrive), with no __syncwarp first
// (the other lanes' stores are then not ordered before the arrive's release); 2: lane 0 after a __syncwarp.
// src [ROUNDS x 128] float4.
template <int RELEASE>
__device__ __forceinline__ void cp_async_ring(const float4* src, float* out) {
    __shared__ alignas(16) float4 s[128];
    __shared__ alignas(8) unsigned long long bars[2];
    const int t = threadIdx.x, i = t & 127, lane = t & 31;
    const unsigned full = smem_u32(&bars[0]), empty = smem_u32(&bars[1]);
    if (t == 0) {
        bar_init(full, 128);
        bar_init(empty, RELEASE == 0 ? 128 : 4);
    }
    __syncthreads();
    float acc = 0.f;
    for (int n = 0; n < ROUNDS && t < 256; ++n) {
        if (t < 128) {
            bar_wait(empty, (n & 1) ^ 1);
            cp_async16(smem_u32(&s[i]), src + n * 128 + i, 16);
            bar_arrive_copies(full);
        } else {
            bar_wait(full, n & 1);
            const float4 v = s[i];
            acc += v.x + v.y + v.z + v.w;
            s[i] = make_float4(acc, acc, acc, acc);
            if (RELEASE == 2) __syncwarp();
            if (RELEASE == 0 || lane == 0) bar_arrive(empty);
        }
    }
    if (t >= 128 && t < 256) out[t] = acc;
    __syncthreads();
}

extern "C" __global__ void rc_cp_async(const float4* src, float* out) { cp_async_ring<0>(src, out); }
extern "C" __global__ void rc_lane0_release(const float4* src, float* out) { cp_async_ring<1>(src, out); }
extern "C" __global__ void rc_lane0_release_syncwarp(const float4* src, float* out) {
    cp_async_ring<2>(src, out);
}

// The FP8 build's consumer dequantization in small (tree_verify/wgmma_ws.cuh, consume_v9 with CDQ), ROUNDS
// rounds, with the seesaw's rows (MODE 5) beside it: warpgroup 2 fills a slot by cp.async and arrives "full"
// as its copies land (F & RING_ASYNC; the consumer-dequant fills) or after waiting for them, by a plain arrive
// (main's producer, which dequantizes before it arrives). Warpgroup 0, the slot's owner, waits, rewrites the
// slot in place, syncs its 128 threads, then hands the rows to warpgroup 1, which reads the slot only after
// that handoff. Every lane of both releases "empty" (the owner's release); the next fill waits on it. The
// other flags take one part away or add one, to find which one racecheck does not follow: RING_WG1_SYNC
// warpgroup 1 syncs its own 128 threads first in each round; RING_NO_DQ no rewrite and no 128-thread sync;
// RING_NO_RING no producer and no mbarriers (the slot never filled, only its owner touches it); RING_WG1_WAIT
// warpgroup 1 waits "full" too; RING_ONE_WRITER lanes 0..3 of warp 0 write the rows (put_rows) instead of each
// quad its own. src [ROUNDS x 128] float4.
#define RING_ASYNC 1
#define RING_WG1_SYNC 2
#define RING_NO_DQ 4
#define RING_NO_RING 8
#define RING_WG1_WAIT 16
#define RING_ONE_WRITER 32
template <int F>
__device__ __forceinline__ void cdq_ring(const float4* src, float* out) {
    __shared__ alignas(16) float4 slot[128];
    __shared__ float s[ROWS];
    __shared__ alignas(8) unsigned long long bars[2];
    const int t = threadIdx.x, i = t & 127, wg = t >> 7, r = i >> 2, lane = t & 31;
    const bool ring = !(F & RING_NO_RING), one = F & RING_ONE_WRITER;
    const unsigned full = smem_u32(&bars[0]), empty = smem_u32(&bars[1]);
    if (t == 0) {
        bar_init(full, 128);
        bar_init(empty, 256);
    }
    __syncthreads();
    float acc = 0.f;
    for (int n = 0; n < ROUNDS; ++n) {
        if (wg == 2) {
            if (!ring) continue;
            bar_wait(empty, (n & 1) ^ 1);
            cp_async16(smem_u32(&slot[i]), src + n * 128 + i, 16);
            if (F & RING_ASYNC) {
                bar_arrive_copies(full);
            } else {
                asm volatile("cp.async.wait_all;\n" ::: "memory");
                bar_arrive(full);
            }
        } else if (wg == 0) {
            if (ring) bar_wait(full, n & 1);
            if (!(F & RING_NO_DQ)) {
                slot[i].x += 1.f;  // the owner's dequantization, in place
                wg_sync(5);
            }
            __syncwarp();
            if (!one) s[r] = float(r + n);
            else if (i < 4)
                for (int k = i; k < ROWS; k += 4) s[k] = float(k + n);
            __syncwarp();
            nb_sync(1);
            nb_sync(2);
            acc += s[r] + (ring ? slot[i].x : 0.f);
            if (ring) bar_arrive(empty);
        } else {
            if (F & RING_WG1_SYNC) wg_sync(6);
            if (ring && (F & RING_WG1_WAIT)) bar_wait(full, n & 1);
            nb_sync(1);
            const float v = s[r];
            acc += v + (ring ? slot[i].x : 0.f);
            __syncwarp();
            if (!one) s[r] = v + 1.f;
            else if (lane < 4 && i < 32)
                for (int k = lane; k < ROWS; k += 4) s[k] = acc + float(k);
            __syncwarp();
            nb_sync(2);
            if (ring) bar_arrive(empty);
        }
    }
    if (wg == 2) asm volatile("cp.async.wait_all;\n" ::: "memory");
    else out[t] = acc;
    __syncthreads();
}

extern "C" __global__ void rc_cdq_ring_async(const float4* src, float* out) { cdq_ring<RING_ASYNC>(src, out); }
extern "C" __global__ void rc_cdq_ring_plain(const float4* src, float* out) { cdq_ring<0>(src, out); }
extern "C" __global__ void rc_cdq_ring_wg1_sync(const float4* src, float* out) {
    cdq_ring<RING_ASYNC | RING_WG1_SYNC>(src, out);
}
extern "C" __global__ void rc_cdq_ring_no_dq(const float4* src, float* out) { cdq_ring<RING_ASYNC | RING_NO_DQ>(src, out); }
extern "C" __global__ void rc_cdq_ring_no_ring(const float4* src, float* out) { cdq_ring<RING_NO_RING>(src, out); }
extern "C" __global__ void rc_cdq_ring_wg1_wait(const float4* src, float* out) {
    cdq_ring<RING_ASYNC | RING_WG1_WAIT>(src, out);
}
extern "C" __global__ void rc_cdq_ring_one_writer(const float4* src, float* out) {
    cdq_ring<RING_ASYNC | RING_ONE_WRITER>(src, out);
}

// Both consumers of the FP8 build's consume_v9 with CDQ, one round a pair of tiles, ROUNDS rounds: slot c is
// stage c, filled by 64 producer threads (wg 2) by cp.async that arrive "full c" as the copies land (ASYNC)
// or by a plain arrive after them. Consumer c (wg c) waits "full c", rewrites its slot in place (DQ; the
// dequantization) and syncs its 128 threads (wg_sync 5 + c), reads its slot (S^T), exchanges a per-thread
// value through red (mask_max_t), then the seesaw's rows as pair_t hands them over: lanes 0..3 of warp 0
// write a row array (put_rows), the other consumer's every thread reads it (get_rows) after a 256-thread
// bar.sync (1: consumer 0's rows and slot 0, 2: consumer 1's rows, 3: consumer 1's slot 1). Consumer 0
// reads slot 1 after 3, consumer 1 slot 0 after 1; every lane of both releases both slots ("empty c").
// Every second round a job's end: each thread's sum into lsum, bar.sync 4, the other consumer's read.
template <bool ASYNC, bool DQ>
__device__ __forceinline__ void cdq_pair(const float4* src, float* out) {
    __shared__ alignas(16) float4 slot[2][128];
    __shared__ float rows[2][ROWS], red[2][128], lsum[256];
    __shared__ alignas(8) unsigned long long bars[4];  // full 0, full 1, empty 0, empty 1
    const int t = threadIdx.x, i = t & 127, wg = t >> 7, c = wg, lane = t & 31;
    const unsigned bar0 = smem_u32(&bars[0]);
    if (t == 0)
        for (int b = 0; b < 4; ++b) bar_init(bar0 + 8 * b, b < 2 ? 64 : 256);
    __syncthreads();
    float acc = 0.f;
    for (int n = 0; n < ROUNDS; ++n) {
        if (wg == 2) {
            const int s = i >> 6, k = i & 63;
            bar_wait(bar0 + 8 * (2 + s), (n & 1) ^ 1);
            for (int h = 0; h < 2; ++h) cp_async16(smem_u32(&slot[s][k + 64 * h]), src + n * 128 + k + 64 * h, 16);
            if (ASYNC) {
                bar_arrive_copies(bar0 + 8 * s);
            } else {
                asm volatile("cp.async.wait_all;\n" ::: "memory");
                bar_arrive(bar0 + 8 * s);
            }
            continue;
        }
        bar_wait(bar0 + 8 * c, n & 1);
        if (DQ) {
            slot[c][i].x += 1.f;
            wg_sync(5 + c);
        }
        acc += slot[c][i ^ 1].y;
        red[c][i] = acc;
        wg_sync(5 + c);
        acc += red[c][i ^ 32];
        if (c == 0) {
            if (lane < 4 && i < 32)
                for (int r = lane; r < ROWS; r += 4) rows[0][r] = acc + float(r);
            wg_sync(5);
            nb_sync(1);
            nb_sync(2);
            acc += rows[1][(i >> 2) & (ROWS - 1)];
            nb_sync(3);
            acc += slot[1][i].x;
        } else {
            nb_sync(1);
            acc += rows[0][(i >> 2) & (ROWS - 1)] + slot[0][i].x;
            if (lane < 4 && i < 32)
                for (int r = lane; r < ROWS; r += 4) rows[1][r] = acc + float(r);
            nb_sync(2);
            wg_sync(6);
            nb_sync(3);
        }
        bar_arrive(bar0 + 16);
        bar_arrive(bar0 + 24);
        if (n & 1) {
            lsum[t] = acc;
            nb_sync(4);
            acc += lsum[t ^ 128];
        }
    }
    if (wg == 2) asm volatile("cp.async.wait_all;\n" ::: "memory");
    else out[t] = acc;
    __syncthreads();
}

extern "C" __global__ void rc_cdq_pair_async(const float4* src, float* out) { cdq_pair<true, true>(src, out); }
extern "C" __global__ void rc_cdq_pair_plain(const float4* src, float* out) { cdq_pair<false, true>(src, out); }
extern "C" __global__ void rc_cdq_pair_nodq(const float4* src, float* out) { cdq_pair<true, false>(src, out); }
