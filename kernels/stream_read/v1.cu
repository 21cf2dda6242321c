// Streaming-read probe: the bandwidth a kernel gets when every warp streams a contiguous range of
// global memory through its own cp.async ring in shared memory, the access pattern of the W4A16 MoE
// kernels (moe_w4a16/v2.cu), without their math. It answers: at a given total size (the touched
// experts' bytes of one MoE layer call) and a given shape of request (bytes per warp and ring
// stage, ring depth, warps per SM), what fraction of the copy bandwidth can such a kernel reach?
//
// unit = VEC x 512 bytes (each lane copies VEC x 16 B per stage). n_units units from src:
//   contiguous (BLOCKWISE false): warp gw of tw streams units [n gw / tw, n (gw + 1) / tw)
//   blockwise  (BLOCKWISE true):  block b takes units [n b / G, n (b + 1) / G) and its warps
//                                 read them round-robin (warp w: w, w + W, ...), so the block's
//                                 requests of one step are adjacent.
// Each lane XORs the words it copied; the result is stored only when it equals an impossible
// value, so the loads cannot be dropped and nothing is written. Dynamic shared memory:
// warps x STAGES x VEC x 512 bytes.
typedef unsigned int u32;

namespace {

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp16_cg(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <int STAGES, int VEC, bool BLOCKWISE>
__device__ __forceinline__ void stream_body(const uint4* __restrict__ src, long long n_units,
                                            uint4* __restrict__ sink, uint4* ring) {
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  long long first, step, count;
  if (BLOCKWISE) {
    const long long b0 = n_units * blockIdx.x / gridDim.x, b1 = n_units * (blockIdx.x + 1) / gridDim.x;
    first = b0 + warp;
    step = warps;
    count = b1 - first > 0 ? (b1 - first + warps - 1) / warps : 0;
  } else {
    const long long gw = (long long)blockIdx.x * warps + warp, tw = (long long)gridDim.x * warps;
    first = n_units * gw / tw;
    step = 1;
    count = n_units * (gw + 1) / tw - first;
  }
  uint4* wring = ring + (size_t)warp * STAGES * VEC * 32;   // [STAGES][VEC][32]
  long long issued = 0;
  int stage_i = 0, stage_c = 0;
  auto issue_next = [&]() {
    if (issued < count) {
      const uint4* s = src + (size_t)(first + issued * step) * VEC * 32 + lane;
#pragma unroll
      for (int v = 0; v < VEC; ++v) cp16_cg(wring + (stage_i * VEC + v) * 32 + lane, s + v * 32);
      ++issued;
      stage_i = stage_i + 1 == STAGES ? 0 : stage_i + 1;
    }
    cp_commit();
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_next();
  uint4 acc = make_uint4(0u, 0u, 0u, 0u);
  for (long long c = 0; c < count; ++c) {
    issue_next();
    cp_wait<STAGES - 1>();
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const uint4 w = wring[(stage_c * VEC + v) * 32 + lane];
      acc.x ^= w.x; acc.y ^= w.y; acc.z ^= w.z; acc.w ^= w.w;
    }
    stage_c = stage_c + 1 == STAGES ? 0 : stage_c + 1;
  }
  cp_wait<0>();
  if (acc.x == 0x9E3779B9u && acc.y == 0x7F4A7C15u && acc.z == 0x2545F491u && acc.w == 0x4F6CDD1Du)
    sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

}  // namespace

// Configurations: stages S, 512 B x V per lane group and stage (s<S>_v<V>), _b = blockwise order.
extern "C" __global__ void __launch_bounds__(1024) stream_read_v1_s8_v1(const uint4* __restrict__ src, long long n_units,
                                                         uint4* __restrict__ sink) {
  extern __shared__ uint4 ring[];
  stream_body<8, 1, false>(src, n_units, sink, ring);
}

extern "C" __global__ void __launch_bounds__(1024) stream_read_v1_s4_v2(const uint4* __restrict__ src, long long n_units,
                                                         uint4* __restrict__ sink) {
  extern __shared__ uint4 ring[];
  stream_body<4, 2, false>(src, n_units, sink, ring);
}

extern "C" __global__ void __launch_bounds__(1024) stream_read_v1_s8_v2(const uint4* __restrict__ src, long long n_units,
                                                         uint4* __restrict__ sink) {
  extern __shared__ uint4 ring[];
  stream_body<8, 2, false>(src, n_units, sink, ring);
}

extern "C" __global__ void __launch_bounds__(1024) stream_read_v1_s4_v4(const uint4* __restrict__ src, long long n_units,
                                                         uint4* __restrict__ sink) {
  extern __shared__ uint4 ring[];
  stream_body<4, 4, false>(src, n_units, sink, ring);
}

extern "C" __global__ void __launch_bounds__(1024) stream_read_v1_s8_v1_b(const uint4* __restrict__ src, long long n_units,
                                                         uint4* __restrict__ sink) {
  extern __shared__ uint4 ring[];
  stream_body<8, 1, true>(src, n_units, sink, ring);
}

extern "C" __global__ void __launch_bounds__(1024) stream_read_v1_s4_v2_b(const uint4* __restrict__ src, long long n_units,
                                                         uint4* __restrict__ sink) {
  extern __shared__ uint4 ring[];
  stream_body<4, 2, true>(src, n_units, sink, ring);
}
