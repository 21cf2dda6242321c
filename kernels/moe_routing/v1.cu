// moe_routing v1: the routing metadata of kdlib.cuda.moe.Routing for the experts of one rank, built in
// one block and one launch, no host sync (twin of kdlib.engine.int4.routing_torch; integer work and
// copied weights, so the outputs are identical).
//
// Slot i (token i / topk) has key e = ids[i] - e0 when that is a local expert (0 <= e < n_local), else
// n_local: other ranks' slots sort after every local one. The slot order is the stable sort by key.
//   0. every thread stages keys: skey[i] for all slots (independent loads, all in flight at once);
// warp w owns the contiguous segment [w seg, (w + 1) seg) of the slots, seg = ceil(n_slots / RT_WARPS):
//   1. it counts its segment's keys into hist[w][key], 32 slots at a time (__match_any_sync groups the
//      equal keys of a chunk; the group's lowest lane adds the group's size);
//   2. per key, hist[w][key] becomes the count of that key in warps before w, and a block scan of the
//      key totals gives start[key], the key's first position;
//   3. it walks its segment again in order: position = start[key] + hist[w][key] + the chunk's earlier
//      lanes of the same key (kept in skey[i]), then the group's lowest lane advances hist[w][key];
//   4. every thread scatters: sorted_token / sorted_weight at skey[i] (independent, all in flight);
// then the experts with slots first, then the empty ones, each ascending (a scan of the busy flags),
// their slot ranges, the number with slots and the largest local count; with `overflow`, one more when that
// count passes `bound` (the caller's check that no expert kernel dropped slots, counted with no extra launch).
//
// Dynamic shared memory: 4 (RT_WARPS (n_local + 1) + n_local + 2 + n_slots) bytes,
// 59,464 B at n_local = 384 and 8,320 slots (M = 1,040, top-8); the wrapper keeps it within the device's.

#define RT_WARPS 16
#define RT_THREADS (RT_WARPS * 32)

// Exclusive prefix sum of one int per thread over the block -> (this thread's prefix, the block's sum).
// Every thread calls it.
__device__ __forceinline__ int2 block_exclusive_scan(int v, int* s_warp)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) s_warp[w] = x;
    __syncthreads();
    if (w == 0) {
        int t = lane < RT_WARPS ? s_warp[lane] : 0;
        for (int o = 1; o < RT_WARPS; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        if (lane < RT_WARPS) s_warp[lane] = t;  // inclusive warp totals
    }
    __syncthreads();
    const int2 out = make_int2((w ? s_warp[w - 1] : 0) + x - v, s_warp[RT_WARPS - 1]);
    __syncthreads();  // s_warp is reused by the next scan
    return out;
}

__device__ __forceinline__ int slot_key(long long id, long long e0, int n_local)
{
    return (id >= e0 && id < e0 + n_local) ? (int)(id - e0) : n_local;
}

extern "C" __global__ void __launch_bounds__(RT_THREADS) moe_routing_v1(
    const long long* __restrict__ ids,    // [n_slots] global expert ids (the [M, topk] choice, row-major)
    const float* __restrict__ weights,    // [n_slots]
    int n_slots, int topk, long long e0, int n_local,
    int* __restrict__ offsets,            // [n_local + 1]
    int* __restrict__ active,             // [n_local]
    int* __restrict__ n_active,           // [1]
    int* __restrict__ ranges,             // [n_local, 2]
    int* __restrict__ sorted_token,       // [n_slots]
    float* __restrict__ sorted_weight,    // [n_slots]
    long long* __restrict__ max_count,    // [1]
    int bound,                            // the launch bound of the expert kernels (slots per expert)
    long long* __restrict__ overflow)     // [1] or null: += 1 when an expert has more than `bound` slots
{
    extern __shared__ int smem[];
    const int keys = n_local + 1;
    int* hist = smem;                     // [RT_WARPS][keys]
    int* start = hist + RT_WARPS * keys;  // [keys + 1]
    int* skey = start + keys + 1;         // [n_slots] the slot's key, then its position
    __shared__ int s_warp[RT_WARPS];
    __shared__ int s_max;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const unsigned lower = (1u << lane) - 1u;

    for (int i = tid; i < RT_WARPS * keys; i += RT_THREADS) hist[i] = 0;
    for (int i = tid; i < n_slots; i += RT_THREADS) skey[i] = slot_key(ids[i], e0, n_local);  // 0.
    if (tid == 0) s_max = 0;
    __syncthreads();

    const int seg = (n_slots + RT_WARPS - 1) / RT_WARPS;
    const int lo = min(w * seg, n_slots), hi = min(lo + seg, n_slots);
    int* mine = hist + w * keys;
    for (int base = lo; base < hi; base += 32) {  // 1. this warp's histogram
        const int i = base + lane;
        const bool ok = i < hi;
        const int key = ok ? skey[i] : -1;  // -1: past the segment
        const unsigned peers = __match_any_sync(0xffffffffu, key);
        if (ok && (peers & lower) == 0) mine[key] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();

    // 2. thread t owns keys [t per, (t + 1) per): per-warp bases and its keys' total
    const int per = (keys + RT_THREADS - 1) / RT_THREADS;
    const int k_lo = min(tid * per, keys), k_hi = min(k_lo + per, keys);
    int own = 0;
    for (int e = k_lo; e < k_hi; ++e) {
        int run = 0;
        for (int v = 0; v < RT_WARPS; ++v) {
            const int c = hist[v * keys + e];
            hist[v * keys + e] = run;
            run += c;
        }
        start[e] = run;  // the count, until the scan below
        own += run;
    }
    const int2 scan = block_exclusive_scan(own, s_warp);
    int at = scan.x;
    int biggest = 0;
    for (int e = k_lo; e < k_hi; ++e) {
        const int c = start[e];
        start[e] = at;
        if (e < n_local) biggest = max(biggest, c);
        at += c;
    }
    if (tid == 0) start[keys] = scan.y;
    if (biggest) atomicMax(&s_max, biggest);
    __syncthreads();

    for (int base = lo; base < hi; base += 32) {  // 3. stable positions
        const int i = base + lane;
        const bool ok = i < hi;
        const int key = ok ? skey[i] : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, key);
        if (ok) skey[i] = start[key] + mine[key] + __popc(peers & lower);
        __syncwarp();
        if (ok && (peers & lower) == 0) mine[key] += __popc(peers);
        __syncwarp();
    }

    __syncthreads();
    for (int i = tid; i < n_slots; i += RT_THREADS) {  // 4.
        const int pos = skey[i];
        sorted_token[pos] = (int)((unsigned)i / (unsigned)topk);
        sorted_weight[pos] = weights[i];
    }

    // the expert lists: busy experts first, then the empty ones, each ascending
    int busy_own = 0;
    for (int e = k_lo; e < min(k_hi, n_local); ++e) busy_own += start[e + 1] > start[e];
    const int2 busy_scan = block_exclusive_scan(busy_own, s_warp);
    int busy_before = busy_scan.x;
    const int n_busy = busy_scan.y;
    for (int e = k_lo; e < min(k_hi, n_local); ++e) {
        const bool busy = start[e + 1] > start[e];
        const int to = busy ? busy_before : n_busy + e - busy_before;
        busy_before += busy;
        active[to] = e;
        ranges[2 * to] = start[e];
        ranges[2 * to + 1] = start[e + 1];
    }
    for (int e = tid; e <= n_local; e += RT_THREADS) offsets[e] = start[e];
    if (tid == 0) {
        n_active[0] = n_busy;
        max_count[0] = s_max;
        if (overflow != nullptr && s_max > bound) ++overflow[0];  // one block, one writer: no atomic
    }
}
