// tree_verify_v1_prefix_{f32,bf16}: the paged-prefix stage of tree_verify v1 (see attend_rows_v1.cuh).

#include "attend_rows_v1.cuh"

// q [B, Q, H, 576], kv [S, 576], page_table [B, P] int32, prefix_lens [B] int32 ->
// out [B, nsplit, Q*H, 512] fp32, lse [B, nsplit, Q*H] fp32. Grid (ceil(Q*H/ROWS), nsplit, B), block ROWS*32.
extern "C" __global__ void __launch_bounds__(ROWS * 32) tree_verify_v1_prefix_f32(
    const float* q, const float* kv, const int* page_table, const int* prefix_lens, int P, int Q, int H, int nsplit,
    int chunk, float scale, float* out, float* lse) {
    attend_rows<float, false>(q, kv, page_table, prefix_lens, nullptr, P, Q, H, nsplit, chunk, scale, out, lse);
}

extern "C" __global__ void __launch_bounds__(ROWS * 32) tree_verify_v1_prefix_bf16(
    const __nv_bfloat16* q, const __nv_bfloat16* kv, const int* page_table, const int* prefix_lens, int P, int Q, int H,
    int nsplit, int chunk, float scale, float* out, float* lse) {
    attend_rows<__nv_bfloat16, false>(q, kv, page_table, prefix_lens, nullptr, P, Q, H, nsplit, chunk, scale, out, lse);
}
