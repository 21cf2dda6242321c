// tree_verify_v1_tail_{f32,bf16}: the tree-tail stage of tree_verify v1 (see attend_rows_v1.cuh); every
// version's prefix kernel is followed by this tail and combine_v1.

#include "attend_rows_v1.cuh"

// q [B, Q, H, 576], tree_kv [B, Q, 576], vis [B, Q, Q] uint8, tree_sizes [B] int32 ->
// out [B, Q, H, 512] fp32, lse [B, Q, H] fp32. Grid (ceil(Q*H/ROWS), 1, B), block ROWS*32.
extern "C" __global__ void __launch_bounds__(ROWS * 32) tree_verify_v1_tail_f32(
    const float* q, const float* tree_kv, const unsigned char* vis, const int* tree_sizes, int Q, int H, float scale,
    float* out, float* lse) {
    attend_rows<float, true>(q, tree_kv, nullptr, tree_sizes, vis, 0, Q, H, 1, 0, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(ROWS * 32) tree_verify_v1_tail_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* tree_kv, const unsigned char* vis, const int* tree_sizes, int Q, int H,
    float scale, float* out, float* lse) {
    attend_rows<__nv_bfloat16, true>(q, tree_kv, nullptr, tree_sizes, vis, 0, Q, H, 1, 0, scale, out, lse);
}
