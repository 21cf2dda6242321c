typedef void (*emu_kernel_t)(const long long*, const float*, int, int, int, int, int, long long*, long long*,
                             long long*, long long*, unsigned char*, long long*, long long*, long long*, double*);
static emu_kernel_t emu_fn;
static const long long* a_ids; static const float* a_lp; static int a_L, a_Kp, a_K, a_Leff, a_budget;
static long long *a_sizes, *a_tok, *a_dep, *a_par, *a_nt, *a_ns, *a_pos; static unsigned char* a_vis; static double* a_sc;
static void emu_entry() {
    emu_fn(a_ids, a_lp, a_L, a_Kp, a_K, a_Leff, a_budget, a_sizes, a_tok, a_dep, a_par, a_vis, a_nt, a_ns, a_pos, a_sc);
    emu_thr[emu_cur].done = true;
    emu_thr[emu_cur].bar = nullptr;
    swapcontext(&emu_thr[emu_cur].ctx, &emu_sched);
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
