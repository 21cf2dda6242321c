static const long long* r_ids; static const float* r_w; static int r_n, r_k, r_nl; static long long r_e0;
static int *r_off, *r_act, *r_na, *r_rng, *r_tok, r_bound; static float* r_sw; static long long *r_max, *r_over;
static void moe_routing_body() {
    moe_routing_v1(r_ids, r_w, r_n, r_k, r_e0, r_nl, r_off, r_act, r_na, r_rng, r_tok, r_sw, r_max, r_bound,
                   r_over);
}
// moe_routing_v1 as one block of `threads`; 0: done; 1: deadlock.
extern "C" int emu_routing(int threads, int smem_bytes, const long long* ids, const float* w, int n_slots, int topk,
                           long long e0, int n_local, int* offsets, int* active, int* n_active, int* ranges,
                           int* sorted_token, float* sorted_weight, long long* max_count, int bound,
                           long long* overflow) {
    r_ids = ids; r_w = w; r_n = n_slots; r_k = topk; r_e0 = e0; r_nl = n_local;
    r_off = offsets; r_act = active; r_na = n_active; r_rng = ranges; r_tok = sorted_token; r_sw = sorted_weight;
    r_max = max_count; r_bound = bound; r_over = overflow;
    return emu_run(1, threads, smem_bytes, moe_routing_body);
}
