typedef void (*emu_kernel_t)(const long long*, const float*, int, int, int, int, int, long long*, long long*,
                             long long*, long long*, unsigned char*, long long*, long long*, long long*, double*);
static emu_kernel_t emu_fn;
static const long long* a_ids; static const float* a_lp; static int a_L, a_Kp, a_K, a_Leff, a_budget;
static long long *a_sizes, *a_tok, *a_dep, *a_par, *a_nt, *a_ns, *a_pos; static unsigned char* a_vis; static double* a_sc;
static void tree_build_body() {
    emu_fn(a_ids, a_lp, a_L, a_Kp, a_K, a_Leff, a_budget, a_sizes, a_tok, a_dep, a_par, a_vis, a_nt, a_ns, a_pos, a_sc);
}
// 0: done; 1: deadlock (a barrier some thread never reaches); 2: unknown kernel.
extern "C" int emu_launch(const char* name, int grid, int threads, int smem_bytes, const long long* ids, const float* lp,
                          int L, int Kp, int K, int L_eff, int budget, long long* sizes, long long* tok, long long* dep,
                          long long* par, unsigned char* vis, long long* nt, long long* ns, long long* pos, double* sc) {
    if (!std::strcmp(name, "tree_build_v4_r1")) emu_fn = tree_build_v4_r1;
    else if (!std::strcmp(name, "tree_build_v4_r2")) emu_fn = tree_build_v4_r2;
    else if (!std::strcmp(name, "tree_build_v4_r4")) emu_fn = tree_build_v4_r4;
    else return 2;
    a_ids = ids; a_lp = lp; a_L = L; a_Kp = Kp; a_K = K; a_Leff = L_eff; a_budget = budget;
    a_sizes = sizes; a_tok = tok; a_dep = dep; a_par = par; a_vis = vis; a_nt = nt; a_ns = ns; a_pos = pos; a_sc = sc;
    return emu_run(grid, threads, smem_bytes, tree_build_body);
}
