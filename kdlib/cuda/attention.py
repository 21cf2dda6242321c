"""Tree-verify MLA attention on the GPU: CuPy wrappers of `kernels/tree_verify/*.cu`.

Same names and signatures as `kdlib.ref.attention` (plus keyword-only `version`, `validate` and
`workspace`):

    out, lse = tree_verify_attention(q, kv_cache, page_table, prefix_lens, tree_kv, visibility,
                                     tree_sizes, softmax_scale)
    # q [B, Q, H, 576] fp32 or bf16 (CuPy, or torch CUDA by DLPack) -> out [B, Q, H, 512] fp32,
    # lse [B, Q, H] fp32 (natural log), both CuPy

The work is three launches: the prefix kernel over the paged latent prefix (page_size 1), split
along the KV length so that a single long request fills every SM (flash-decoding); the tail kernel
over the tree's own rows under the visibility mask; and the LSE combine of all prefix splits with
the tail. Conventions follow the reference: an empty key set gives out 0 and lse -inf; query rows
at or past `tree_sizes[b]` are NaN in the tail and so in the merged result.

Versions (`version`, one of `VERSIONS`; `LAUNCHES[v]` holds each one's launch settings):
  * 1 (`tree_verify_v1`, the files prefix_v1 / tail_v1 / combine_v1): one warp per row on the CUDA
    cores, fp32 accumulation; the only version with an fp32 path (within 1e-5 of the float64
    reference), bf16 too;
  * 2, 3, 4 (`tree_verify/prefix_v{2,3,4}.cu`, then v1's tail and combine): the bf16 prefix on the
    tensor cores with `mma.sync.m16n8k16`, fp32 accumulators; P rounded to bf16 before P·V, so bf16
    inputs land near 1e-3 of the float64 reference of the same bf16 values; 3 (`MMA_DEFAULT`) was
    the fastest of the three in data/results/verify_attention_dev.h200.json;
  * 5 (`tree_verify/wgmma_v5.cu`, sm_90a only): the whole verify on Hopper's warpgroup tensor cores
    in three launches: a one-block plan that cuts the work into equal jobs
    (`plan_v5` is its numpy mirror), a persistent kernel (one CTA per SM) over the prefix with the
    tree tail fused in, and an LSE combine; its buffers can be allocated once (`make_workspace`) so
    that a call allocates nothing and syncs nothing (CUDA-graph capturable);
  * 6 (`tree_verify/wgmma_v6.cu`, sm_90a only): v5's plan, jobs, workspace and
    combine around another attend kernel, whose two warpgroups take the tiles of a job two at a time
    so that one's softmax runs under the other's MMAs (the kernel file says how);
  * 7 (`tree_verify/wgmma_v7.cu`, sm_90a only): v6's plan, workspace, combine and
    two MMA warpgroups with warp specialisation: a third, producer warpgroup (384 threads a CTA,
    registers rebalanced with setmaxnreg) decodes the jobs and gathers every K tile, the MMA warpgroups
    only wait on its full barriers and release the stage blocks on empty ones (the kernel file says how);
  * 8 (`tree_verify/wgmma_v8.cu`, sm_90a only): v7's plan, workspace and attend kernel
    with a combine of 4 to 32 warps per row (`v8_combine_warps`; a warp per row where the rows are many,
    `v8_combine_rows`), so that a row's many jobs (a long prefix
    over few rows) are merged with their loads in flight at once rather than four at a time; faster than 7
    where a row has many jobs (8 heads x 1 query x 200k), the same or within 1 % elsewhere
    (data/results/history/attention.v8_default.c49c344.h200.json);
  * 9 (`tree_verify/wgmma_v9.cu`, sm_90a only): v8's plan, workspace and combine around
    an attend kernel that computes the transposed products ("swap-AB": the job's rows are the wgmma N, not
    padded to its M of 64), built per call shape; it runs where Q*H <= 16 (`v9_options`: there it measured
    faster than v8, data/results/history/attention.v9_dev.4d83aab.h200.json), elsewhere version 9 runs
    version 8's kernels;
  * 10 (`tree_verify/wgmma_v10.cu`, sm_90a only, `DEFAULT_VERSION`): version 9 with the jobs dealt to the
    CTAs by size where that pays: where the jobs pass one round its plan ranks them by key tiles and costs
    two deals (`cta_loads`), the static round-robin of versions 5-9 (`static_deal`), which leaves the
    busiest CTA of a ragged batch above the mean, and the snake deal of the jobs by size (`snake_deal`);
    where the snake deal's busiest CTA is lighter by more than 1/64 it writes the order and the attend
    kernels (v9's consumers where version 9 runs its own kernel, else v7's) take it, else they run
    version 9's producer (`plan_order` and `v10_deal` mirror the choice). The same jobs and combine:
    version 9's output bit for bit. In the 036efc4 run
    (data/results/history/attention.prefetch.036efc4.h200.json) 0.95x version 9's time at the ragged batch,
    within 9's replay spread at the other eight points; 0.93x there in d919b95's
    (history/attention.no_pdl.d919b95.h200.json) and in d609d1b's, with PDL
    (history/attention.before_sgroup.d609d1b.h200.json); 0.94x in 01f1fd5's, the S loop's fewer proxy fences
    (history/attention.before_g5.01f1fd5.h200.json), which had it behind 9 at one uniform batch, and in
    c8ac886's, fewer still (history/attention.before_mask.c8ac886.h200.json), which has it behind no arm,
    as 4b198bb's (the consumers' mask and rescale, history/attention.before_fold.4b198bb.h200.json),
    81fcb3e's (the softmax's scale folded into its FFMA, history/attention.fold.81fcb3e.h200.json) and
    89ffb6c's (the combine a warp per row, history/attention.rows.89ffb6c.h200.json) do; e8c3878's
    (history/attention.plan_reused.e8c3878.h200.json) has it behind 9, 8 and 7 at 16 x 65 x 131k by about
    the spread between runs, bbc3f6e's (history/attention.fi_eager.bbc3f6e.h200.json) there and behind 9
    and 8 at 8 x 65 x 32k B8, a36feef's (history/attention.before_regs.a36feef.h200.json) behind 7 at
    16 x 65 x 131k alone, 108e8c5's (the consumers' register operands,
    history/attention.before_plan_small.108e8c5.h200.json) behind 8 and 7 there alone, 5f90f18's (the plan
    of up to 8 requests made by one warp, history/attention.before_own_plan.5f90f18.h200.json) behind 9 and 8
    at 8 x 9 x 32k B8 alone, and c96c1f9's (the plan made by the attend kernels,
    data/results/attention.h200.json) behind no arm (`BF16_DEFAULT_TRADES`). It launches its attend and
    combine kernels with programmatic dependent launch (`PDL`; data/results/kernel_ab_pdl.h200.json). Up to
    8 requests (`OWN_PLAN`) there is no plan kernel: the attend kernels make the plan themselves
    (tree_verify_v10_attend_own, _t_own) and deal it statically. Ungated, the order measured 1.1-1.3 % slower
    than 9 at the suite's two uniform batches over two rounds (gains the plan's cost put at 1.007x and
    1.013x, data/results/history/attention.v10.8371cbb.h200.json), and ranking job by job cost 0.7-1.1 %
    there (history/attention.v10_job_rank.33c8360.h200.json).
  * 11 (`tree_verify/wgmma_v11.cu`, sm_90a only): version 10, but where a request has 65 to 72 query rows
    (`v11_rows`: 8 heads x 9 queries), which versions 5-10 run as two 64-row jobs a key chunk (every key tile
    multiplied twice, the rows padded to 128), it runs v5's plan, an attend kernel of two-CTA clusters and
    v8's combine: the CTAs of a cluster split each row's dims (rank 0: dims 0-255 and the rope, rank 1: dims
    256-511), each computes its partial S^T of a tile over all 72 rows (version 9's transposed products), the
    two swap the partials through distributed shared memory and add them (the same bits in both), and each
    accumulates the output over its own 256 dims (the kernel file says how). bf16 only; an FP8 pool is
    refused (version 10 runs it).
  * 12 (`tree_verify/wgmma_v12.cu`, sm_90a only): version 10, but where a request has 65 to 72 query rows
    (`v11_rows`) one CTA takes a key chunk's rows in one pass: rows 0-63 in version 7's consumers, the rest
    (at most 8) in the producer warpgroup, which gathers as before and, once a pair has landed, computes
    those rows' transposed products (version 9's, `wgmma m64n8k16`), their softmax and their output over all
    512 dims. Its plan is v5's over `v12_plan_grid` CTAs (about one key chunk a CTA); v8's combine. bf16 only;
    an FP8 pool is refused (version 10 runs it). Its first GPU run hung (a setmaxnreg split past the CTA's
    register pool, since fixed). Fixed, it passes its GPU tests and compute-sanitizer, but is not the
    default: it measured slower than version 10 at both 8 x 9 points (notebook 02b, 13w-13x).
  * 13 (`tree_verify/wgmma_v13.cu`, sm_90a only): version 10, but where version 10 launches its own-plan
    attend kernel with v7's consumers and the combine a warp per row, and one request's row blocks fit two
    key chunks each on the clusters' grid (`v13_pairs`), its attend kernel runs in clusters of two CTAs, and
    where the plan it makes gives one request's full rows two key chunks a row block, one job a CTA (64 heads
    x 65 queries), the two jobs of a row block run on a cluster's two CTAs and merge there: each
    sends the other the half of its normalised output the other merges, through distributed shared memory, and
    each writes its half of the rows with v8's combine's arithmetic (version 10's bits); the combine kernel
    then returns at once. Elsewhere its kernels are version 10's. bf16 only; an FP8 pool is refused
    (version 10 runs it).
FP8 latent cache (issue 19's stretch goal): a kv_cache of dtype uint8 and shape [S, 656] holds each token in
the layout of `kdlib.ref.fp8` (DeepSeek-V3.2's, FlashMLA's "FP8 with scale", vLLM's `fp8_ds_mla`: 512 e4m3
latent values, 4 float32 scales, one per 128 of them, 64 bf16 rope values; `kdlib.ref.fp8.pack_latent` writes
it). Version 10 alone runs it, built with `FP8_OPTIONS` (-DTV_FP8=1): its producer warpgroup stages each
prefix tile's e4m3 bytes in the stage, and they are dequantized to bf16 in place (each e4m3 value times the
tile's scale rounded to bf16, one rounding: exact for the layout's power-of-two scales; `fp8_dequantized`)
by the producer, or, in the kernel of at most 16 rows a request (8 x 1, 8 x 2), by the consumer that owns the
stage; the MMAs are the bf16 build's. q and tree_kv stay bf16. On a pool of power-of-two scales the output is
the bf16 build's on the dequantized pool, bit for bit. A prefix row is 656 bytes where bf16's is 1,152: 57 %
of the bytes; yet the build is slower than bf16's at every point of the attention_fp8 suite on the H200
(data/results/attention_fp8.h200.json): the dequantization in each stage's turn bounds it (notebook 02b,
15b), and where a request has many row blocks the producer dequantizes each tile once for each of them.
That build is the "fused" path (`fp8_path`, FP8_PATHS). The other, "dequant_first", dequantizes each prefix
row once: tree_verify_fp8_gather_v1 gathers the requests' rows through the page table into a bf16 pool of
the workspace (B x P x 1,152 bytes, `VerifyWorkspace.fp8_staging`) with the same conversion, and the bf16
build reads that; the output is the fused path's, bit for bit. vLLM's MLA backends gather a prefill's
context into a bf16 workspace so (vllm-project/vllm, vllm/v1/attention/backends/mla/common.py). It costs one
pass over the rows (656 bytes read, 1,152 written a row) and pays where the MMAs bound the verify:
fp8_path=None takes it past FP8_DEQUANT_FIRST_ROWS query rows (Q x H) a request, where it measured faster at
every point of that record, else the fused path (notebook 02b, 15c).
`version=None` (the default) picks by dtype and device: fp32 runs 1 (a dtype path, not a choice);
bf16 runs `DEFAULT_VERSION` (10, `BF16_DEFAULT`: the fastest in data/results/attention.h200.json)
where the device runs it, else 3 where the device grants its 166 KB of shared memory (not on sm_120's
99 KB), else 1.

Deprecated alias: `impl=` names a version as recorded results and kdlib.perf suites do
(`IMPLS`: "simple" = 1, "mma_v2" / "mma_v3" / "mma_v4" = 2 / 3 / 4, "mma" = `MMA_DEFAULT`,
"wgmma" = 5, "wgmma_v6" = 6, "wgmma_v7" = 7, "wgmma_v8" = 8, "wgmma_v9" = 9, "wgmma_v10" = 10,
"wgmma_v11" = 11, "wgmma_v12" = 12, "wgmma_v13" = 13, "auto" = None); give `version` or `impl`, not both.

Checks before any launch raise ValueError: shapes, dtypes (float32 or bfloat16, all float inputs
alike), Q <= 65, widths 576/512, and, with `validate=True` (the default; a few device syncs), the
values: prefix_lens in [0, P], tree_sizes in [0, Q], every read page-table slot in [0, S), and
integer inputs wider than int32 within the int32 range (they are narrowed to int32).
Timed loops pass `validate=False`.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np

from kdlib.cuda import loader
from kdlib.ref import fp8 as fp8_ref

D_QK = 576  # MLA absorb width: kv_lora_rank 512 + rope 64 (DeepSeek-V3 / Kimi-K2)
KV_LORA_RANK = 512  # value width: the latent part of each cached row
MAX_Q = 65  # tree queries per request: a 64-node budget + the root (issue 4)

# v1 is three stages, each its own file; every prefix version is followed by tail_v1 and combine_v1.
_V1_PREFIX, _V1_TAIL, _V1_COMBINE = "tree_verify/prefix_v1", "tree_verify/tail_v1", "tree_verify/combine_v1"
_V1_ROWS = 8  # rows (warps) per block in tree_verify/attend_rows_v1.cuh (ROWS)
_V1_KCHUNK = 16  # keys per shared-memory step in tree_verify/attend_rows_v1.cuh (KCHUNK)
_V1_BLOCKS_PER_SM = 4  # sm_90: 256 threads x 64 registers and 37 KB shared -> 4 blocks resident per SM
_COMBINE_THREADS = KV_LORA_RANK // 4  # tree_verify_v1_combine / tree_verify_v5_combine: 4 columns a thread
_MMA_THREADS = 256  # NTHREADS in tree_verify/prefix_v{2,3,4}.cu
_MMA_BM = 64  # query rows per block in tree_verify/prefix_v{2,3,4}.cu (BM)
_MMA_BN = 32  # keys per pipeline stage (BN)
_MMA_Q_SMEM = 64 * 1168  # Q tile: BM rows of 576 bf16 + 16 B pad
_MMA_K_SMEM = 32 * 1168  # one K stage: BN rows
_MMA_X_SMEM = 2 * 4 * 16 * 32 * 4  # partial-S exchange between the two halves of each row group
# The wgmma whole-verify kernels (tree_verify/wgmma_v5.cu, wgmma_v6.cu, wgmma_v7.cu: one plan, one combine,
# each its own attend kernel; wgmma_v8.cu: v7's plan and attend kernel, its own combine; wgmma_v9.cu: v8's
# kernels and its own attend kernel; wgmma_v10.cu: v9's with its own plan and ordered attend kernels;
# wgmma_v11.cu: v9's plan and combine, its own attend kernel of two-CTA clusters; wgmma_v12.cu: the same with
# an attend kernel of v7's consumers and a producer that also computes the rows past 64; wgmma_v13.cu: v10's
# kernels and an own-plan attend kernel of two-CTA clusters that merges a row block's two jobs, with its
# combine), built for sm_90a through NVRTC.
_V5 = "tree_verify/wgmma_v5"
_V6 = "tree_verify/wgmma_v6"
_V7 = "tree_verify/wgmma_v7"
_V8 = "tree_verify/wgmma_v8"
_V9 = "tree_verify/wgmma_v9"
_V10 = "tree_verify/wgmma_v10"
_V11 = "tree_verify/wgmma_v11"
_V12 = "tree_verify/wgmma_v12"
_V13 = "tree_verify/wgmma_v13"
_V5_OPTIONS = loader.SM90A_OPTIONS
_V5_THREADS = 256  # NTHREADS of the plan and attend kernels (v5, v6)
_V7_THREADS = 384  # NTHREADS of v7's attend kernel: a producer and two MMA warpgroups
# Q block + two K stages + factors + barriers + alignment (SMEM_BYTES)
_V5_SMEM = 3 * 73728 + 2 * 512 + 6 * 8 + 1024
# v6: Q block + two K stages + rows (m, two factors, two sums) + 19 barriers + alignment (SMEM_BYTES)
_V6_SMEM = 3 * 73728 + 5 * 64 * 4 + 19 * 8 + 1024
# v7: v6's blocks and rows + 4 pair descriptors of 12 ints + 30 barriers + alignment (SMEM_BYTES)
_V7_SMEM = 3 * 73728 + 5 * 64 * 4 + 4 * 12 * 4 + 30 * 8 + 1024
# v9: v7's + its own rows (maxima and factors of tiles A and B, per-warp maxima and sums) (V9_SMEM)
_V9_SMEM = _V7_SMEM + 20 * 64 * 4
# the FP8 build of version 10 (-DTV_FP8=1): v9's layout + each stage's 64 rows of 4 float32 scales (FP8_SMEM)
_FP8_SMEM = _V9_SMEM + 2 * 64 * 16
# v11 (V11_SMEM): Q [5 blocks][72 rows], two stages [5][64 keys], P_A^T and P_B^T [72 rows], the partial-S^T
# buffers [2 consumers][2 parities][64 x 72] fp32, rows [20][72] fp32, 4 descriptors, 34 barriers, alignment
_V11_NR = 72  # V11_NR: the rows of a request version 11's attend kernel takes in one pass
_V11_CLUSTER = 2  # its __cluster_dims__: the CTAs of a cluster
_V11_SMEM = (5 * 72 * 128 + 2 * 5 * 8192 + 2 * 72 * 128 + 4 * 64 * 72 * 4 + 20 * 72 * 4 + 4 * 12 * 4 + 34 * 8
             + 1024)
# v12 (V12_SMEM): v7's layout and barriers with 3 barriers more (no alignment), to a 1024-B boundary, then
# the 8 latent blocks of its producer's rows (8 rows x 128 B each), alignment: 227 KB, a block's most
_V12_SMEM = -(-(_V7_SMEM - 1024 + 3 * 8) // 1024) * 1024 + 8 * 8 * 128 + 1024
FP8_OPTIONS = ("-DTV_FP8=1",)
FP8_ROW_BYTES = fp8_ref.layout_bytes()  # 656: 512 e4m3 + 4 float32 scales + 64 bf16 rope (FP8_ROW)
# An FP8 pool's two paths (fp8_path): "fused", the FP8 build, each tile dequantized in the attend kernel;
# "dequant_first", tree_verify/fp8_gather_v1.cu dequantizing the prefix rows into the workspace's bf16 pool,
# then the bf16 build over it. Both give the same output bit for bit.
FP8_PATHS = ("fused", "dequant_first")
_FP8_GATHER = "tree_verify/fp8_gather_v1"
_FP8_GATHER_KEYS = 8  # FG_KEYS: keys (a warp each) a block of the gather
# fp8_path None: "dequant_first" past this many query rows (Q x H) a request, else "fused". In
# data/results/attention_fp8.h200.json the fused path is faster at 72 rows (8 x 9, batch 1 and 8) and below,
# dequant first from 264 (8 x 33) up; between, history/attention_fp8.path_cut.5ec8398.h200.json has the
# fused path faster at 104 rows (two 64-row jobs a request, each dequantizing its tiles) and dequant first at
# 136 and 144 (three jobs), at batch 1 and 8: the cut lies between 104 and 136 rows.
FP8_DEQUANT_FIRST_ROWS = 128
_V9_MAX_NR = 56  # V9_MAX_NR: the rows v9's attend kernel builds for without spills
# Q*H up to which version 9 runs its own attend kernel: where it measured faster than v8's (8 and 16 rows;
# slower at 32 and 48) in data/results/history/attention.v9_dev.4d83aab.h200.json; on version 10's kernels
# v7's consumers are faster at 24-56 rows too (history/attention_v9_rows.335f51b.h200.json)
_V9_MAX_ROWS = 16
_V5_BM = 64  # rows per job (BM)
_V5_BN = 64  # keys per tile (BN)
_V5_ROUNDS = 4  # MAX_ROUNDS: the plan fits the jobs into at most this many rounds of one job per CTA
_V5_JOB_OVERHEAD = 5  # JOB_OVERHEAD, in tiles
# CHUNK_WITH_TAIL: a key chunk's tiles count the tail tiles chunk 0 carries, so every chunk of a request holds
# about the same key tiles; False (-DCHUNK_WITH_TAIL=0): the prefix alone is cut and chunk 0 carries the tail
# on top (notebook 02b, 13zb)
_V5_CHUNK_WITH_TAIL = True
_V10_ORDER_CAP = 1024  # ORDER_CAP: the most jobs the v10 plan orders (beyond, the static round-robin)
_V10_ORDER_GAIN = 1  # ORDER_GAIN: it orders where the busiest CTA gains more than ORDER_GAIN / ORDER_UNIT
_V10_ORDER_UNIT = 64  # ORDER_UNIT: the gate's unit (data/results/attention_gate.h200.json set it)
# Versions 10-13 launch their attend and combine kernels with programmatic dependent launch (loader.launch,
# pdl): each may start while the kernel ahead of it runs and waits in-kernel for its writes (pdl_wait).
PDL = True
# Every version from 8 on (8-13) merges with a warp per row where `v8_combine_rows` says (the 4-warp
# combine's bits; version 13's pairs through tree_verify_v13_combine_rows); False: always `v8_combine_warps`'s
# combine, and version 13 runs no pairs (tools/kernel_ab.py run --toggle COMBINE_ROWS times the two).
COMBINE_ROWS = True
# Version 10's plan kernel weighs its candidates by the deal it runs (deal_cost) where later calls reuse the
# plan (`reuse_plan`); False: by rounds x (longest job + JOB_OVERHEAD) always (tools/kernel_ab.py run --toggle
# DEAL_COST --layers N times the two over steps of N layers)
DEAL_COST = True
# Versions 10 and 13 make the plan of up to _V10_OWN_PLAN_REQS requests in their attend kernels
# (tree_verify_v10_attend_own, _t_own: no plan launch, the static deal); False: the plan kernel first.
# `tools/kernel_ab.py run --version 10 --toggle OWN_PLAN` (history/kernel_ab_own_plan.c96c1f9.h200.json, bit
# for bit): 1.005-1.053x at the points of 1 to 8 requests but one, 0.980 at 4 requests of 8 x 65 over 32k,
# where the plan kernel orders the jobs and these kernels deal them statically; batches of 10 and 16 take the
# plan kernel in both arms (0.988-1.003: the A/B's spread).
OWN_PLAN = True
_V5_PLAN_SMALL_REQS = 8  # PLAN_SMALL_REQS: up to this many requests warp 0 makes the plan alone
_V10_OWN_PLAN_REQS = 8  # OWN_PLAN_REQS: up to this many requests the attend kernels make it (`own_plan`)
_V5_PLAN_STRIDE = 8  # PLAN_STRIDE: per request base, chunks, chunk tiles, row blocks, len, rows, tail rows,
#   the cut (CHUNK_WITH_TAIL as built)
_V5_PLAN_SMEM_REQS = 256  # PLAN_SMEM_REQS: the plan kernels build plans of this many requests in smem
_V5_COMBINE_COLS = 128  # COMBINE_COLS: columns of one combine block (its 4 warps' float4 lanes)
_V5_COMBINE_SLICES = KV_LORA_RANK // _V5_COMBINE_COLS  # COMBINE_SLICES: combine blocks per row
_V8_COMBINE_WARPS = (4, 8, 16, 32)  # tree_verify_v8_combine_w<W>: warps per combine block
_V8_UNROLL = 4  # V8_UNROLL: the jobs one warp of v8's combine has in flight
_V8_JOBS_PER_WARP = 2 * _V8_UNROLL  # two rounds of loads a warp: fewer warps where a row has few jobs
_V8_ROWS_WARPS = 4  # ROWS_WARPS: rows (a warp each) of a tree_verify_v8_combine_rows block


@dataclass(frozen=True)
class VerifyLaunch:
    """Launch settings of one version: the name results record it by (`impl`), the prefix (v5: the
    whole-verify) source, threads per block, dynamic shared memory, query rows per block (v5: per
    job) and keys per step, the dtypes it takes and NVRTC options."""

    version: int
    impl: str
    stem: str
    threads: int
    smem: int
    rows: int
    keys: int
    dtypes: tuple[str, ...] = ("bf16",)
    options: tuple[str, ...] = ()


_MMA_X = _MMA_Q_SMEM + _MMA_X_SMEM  # the Q tile and the partial-S exchange; K stages come on top
# v2 gathers each tile behind nine serial page-table reads; v3 prefetches the slots a tile ahead; v4 adds a
# third K stage.
_MMA_K2, _MMA_K3 = _MMA_X + 2 * _MMA_K_SMEM, _MMA_X + 3 * _MMA_K_SMEM  # two / three K stages
LAUNCHES = {
    1: VerifyLaunch(1, "simple", _V1_PREFIX, 32 * _V1_ROWS, 0, _V1_ROWS, _V1_KCHUNK, ("f32", "bf16")),
    2: VerifyLaunch(2, "mma_v2", "tree_verify/prefix_v2", _MMA_THREADS, _MMA_K2, _MMA_BM, _MMA_BN),
    3: VerifyLaunch(3, "mma_v3", "tree_verify/prefix_v3", _MMA_THREADS, _MMA_K2, _MMA_BM, _MMA_BN),
    4: VerifyLaunch(4, "mma_v4", "tree_verify/prefix_v4", _MMA_THREADS, _MMA_K3, _MMA_BM, _MMA_BN),
    5: VerifyLaunch(5, "wgmma", _V5, _V5_THREADS, _V5_SMEM, _V5_BM, _V5_BN, options=_V5_OPTIONS),
    6: VerifyLaunch(6, "wgmma_v6", _V6, _V5_THREADS, _V6_SMEM, _V5_BM, _V5_BN, options=_V5_OPTIONS),
    7: VerifyLaunch(7, "wgmma_v7", _V7, _V7_THREADS, _V7_SMEM, _V5_BM, _V5_BN, options=_V5_OPTIONS),
    8: VerifyLaunch(8, "wgmma_v8", _V8, _V7_THREADS, _V7_SMEM, _V5_BM, _V5_BN, options=_V5_OPTIONS),
    9: VerifyLaunch(9, "wgmma_v9", _V9, _V7_THREADS, _V9_SMEM, _V5_BM, _V5_BN, options=_V5_OPTIONS),
    # smem: the most its two attend kernels take (v9's layout; v7's kernel launches with _V7_SMEM)
    10: VerifyLaunch(10, "wgmma_v10", _V10, _V7_THREADS, _V9_SMEM, _V5_BM, _V5_BN, ("bf16", "fp8"),
                     _V5_OPTIONS),
    # version 10 but where a request has 65-72 rows (v11_rows): there clusters of two CTAs of _V11_SMEM
    11: VerifyLaunch(11, "wgmma_v11", _V11, _V7_THREADS, _V11_SMEM, _V5_BM, _V5_BN, options=_V5_OPTIONS),
    # version 10 but where a request has 65-72 rows (v11_rows): there one CTA a key chunk of _V12_SMEM
    12: VerifyLaunch(12, "wgmma_v12", _V12, _V7_THREADS, _V12_SMEM, _V5_BM, _V5_BN, options=_V5_OPTIONS),
    # version 10, its own-plan attend kernel (v7's consumers) in two-CTA clusters (v7's smem + 1,328 static)
    13: VerifyLaunch(13, "wgmma_v13", _V13, _V7_THREADS, _V9_SMEM, _V5_BM, _V5_BN, options=_V5_OPTIONS),
}
WGMMA_VERSIONS = (5, 6, 7, 8, 9, 10, 11, 12, 13)  # the whole-verify versions: sm_90a, plan + attend + combine
VERSIONS = tuple(LAUNCHES)
# The tensor-core prefix kernels by name -> (stem, shared memory bytes), as recorded results name them.
MMA_VERSIONS = {LAUNCHES[v].impl: (LAUNCHES[v].stem, LAUNCHES[v].smem) for v in (2, 3, 4)}
# The mma version "mma" names, and the one bf16 falls back to without sm_90a: v3, the fastest in the
# recorded sweep (data/results/verify_attention_dev.h200.json times v3 and v4 side by side; the third
# stage did not pay).
MMA_DEFAULT = "mma_v3"
# What version None runs for bf16 where the device has sm_90a: the fastest of the wgmma versions and
# MMA_DEFAULT in the recorded attention sweep (data/results/attention.h200.json: the fastest median at most
# points, elsewhere within the other arm's replay spread but at the points of BF16_DEFAULT_TRADES;
# tests/test_kernel_constants.py checks both against the record).
BF16_DEFAULT = "wgmma_v10"
# (heads, queries, prefix, batch) -> why: the recorded points where another arm is faster than the default
# beyond that arm's replay spread, the price of its gains elsewhere. None in the c96c1f9 record; in the
# records before it one each: 8 x 9 x 32k B8 in 5f90f18's (history/attention.before_own_plan.5f90f18,
# versions 9 and 8 ahead by about 1 %, the same consumers and jobs), 16 x 65 x 131k in 108e8c5's
# (history/attention.before_plan_small.108e8c5), a36feef's and e8c3878's (versions 8 and 7 ahead, where
# other runs had 10 ahead of both: the same consumers and jobs, one round in the static deal, the spread
# between runs as wide as the gap), none in 89ffb6c's, 81fcb3e's or 4b198bb's, 8 x 65 x 32k B8 in bbc3f6e's
# and 01f1fd5's, and 8 x 9 x 32k B8 in d919b95's (version 10 without PDL).
BF16_DEFAULT_TRADES: dict[tuple[int, int, int, int], str] = {}
_BY_IMPL = {launch.impl: v for v, launch in LAUNCHES.items()}
DEFAULT_VERSION = _BY_IMPL[BF16_DEFAULT]
# The deprecated impl= names -> versions ("auto": None, the default pick).
IMPLS = {**_BY_IMPL, "mma": _BY_IMPL[MMA_DEFAULT], "auto": None}
_MAX_SPLITS = 64  # beyond this the partial-output traffic outweighs the gain in parallelism
_MIN_TILES_PER_SPLIT = 8  # a split shorter than 8 key tiles spends its time on set-up


def _scale(softmax_scale) -> float:
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
            or not math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite real number, got {softmax_scale!r}")
    return float(softmax_scale)


def _float_kind(x, name: str) -> tuple[object, str]:
    """(CuPy C-contiguous view, 'f32' | 'bf16'); bf16 crosses as raw uint16 bits and must start on a 16-byte
    boundary (the bf16 kernels copy 16-byte pieces: a view at an odd offset faulted the launch)."""
    import cupy

    if loader.is_torch(x):
        import torch

        if x.dtype == torch.bfloat16:
            bits = loader.as_cupy(x.contiguous().view(torch.int16))
            return loader.aligned16(cupy.ascontiguousarray(bits).view(cupy.uint16), name), "bf16"
        if x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 or bfloat16, got {x.dtype}")
        return cupy.ascontiguousarray(loader.as_cupy(x)), "f32"
    a = loader.as_cupy(x)
    if a.dtype.name == "bfloat16":
        return loader.aligned16(cupy.ascontiguousarray(a).view(cupy.uint16), name), "bf16"
    if a.dtype != cupy.float32:
        raise ValueError(f"{name} must be float32 or bfloat16, got {a.dtype}")
    return cupy.ascontiguousarray(a), "f32"


def _lengths(x, name: str, batched: bool, bsz: int, validate: bool):
    import cupy

    if batched:
        return loader.int_array(x, name, "int32", shape=(bsz,), check_range=validate)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise ValueError(f"{name} must be an int in the unbatched form, got {type(x).__name__}")
    if not -2**31 <= int(x) < 2**31:
        raise ValueError(f"{name} {int(x)} is outside the int32 range")
    return cupy.asarray([int(x)], dtype=cupy.int32)


def _check_q(q):
    """q -> (CuPy [B, Q, H, 576], kind, batched)."""
    nd = len(getattr(q, "shape", ()))
    if nd not in (3, 4):
        raise ValueError(f"q must be [B, Q, H, {D_QK}] (or unbatched [Q, H, {D_QK}]), "
                         f"got shape {getattr(q, 'shape', None)}")
    qa, kind = _float_kind(q, "q")
    batched = nd == 4
    if not batched:
        qa = qa[None]
    bsz, nq, nh, d = qa.shape
    if bsz < 1:
        raise ValueError("q needs at least one request (B >= 1)")
    if d != D_QK:
        raise ValueError(f"q rows must be {D_QK} wide (512 latent + 64 rope), got {d}")
    if not 1 <= nq <= MAX_Q:
        raise ValueError(f"Q (tree queries per request) must lie in [1, {MAX_Q}], got {nq}")
    if nh < 1:
        raise ValueError("q needs at least one head")
    return qa, kind, batched


def _check_rank(kv_lora_rank):
    if kv_lora_rank != KV_LORA_RANK:
        raise ValueError(f"the CUDA kernels are built for kv_lora_rank {KV_LORA_RANK}, got {kv_lora_rank}")


def _fp8_pool(kv_cache, kind):
    """A uint8 kv_cache [S, 656] (the FP8 layout, kdlib.ref.fp8.pack_latent's rows) -> its CuPy view; None for
    any other dtype."""
    import cupy

    if loader.is_torch(kv_cache):
        import torch

        if kv_cache.dtype != torch.uint8:
            return None
    elif getattr(kv_cache, "dtype", None) != np.uint8:
        return None
    kv = cupy.ascontiguousarray(loader.as_cupy(kv_cache))
    if kv.shape[1] != FP8_ROW_BYTES:
        raise ValueError(f"a uint8 kv_cache holds the FP8 latent layout, {FP8_ROW_BYTES} bytes a row "
                         f"(kdlib.ref.fp8.pack_latent), got rows of {kv.shape[1]}")
    if kind != "bf16":
        raise ValueError(f"the FP8 kv_cache takes bfloat16 q and tree_kv, got {kind}")
    if kv.data.ptr % 16:
        raise ValueError("the FP8 kv_cache must start on a 16-byte boundary (the kernel copies 16-byte "
                         "pieces)")
    return kv


def fp8_pool(kv):
    """A bf16 latent pool -> the FP8 layout the FP8 build reads: torch [S, 576] bfloat16 (any device) ->
    [S, 656] uint8 on the same device, the rows of `kdlib.ref.fp8.pack_latent(*quantize_latent(rows))` (the
    "pow2" scale rule: each 128-dim tile's max |x| / 448, floored at MIN_SCALE, rounded up to a power of two,
    computed in float64 as the reference does; x / scale is exact in float32 and cast to e4m3 once)."""
    import torch

    if not (loader.is_torch(kv) and kv.dtype == torch.bfloat16 and kv.ndim == 2 and kv.shape[1] == D_QK):
        raise ValueError(f"fp8_pool takes a torch bfloat16 pool [S, {D_QK}], got "
                         f"{type(kv).__name__} {getattr(kv, 'dtype', '')} {tuple(getattr(kv, 'shape', ()))}")
    n = kv.shape[0]
    lat = kv[:, :KV_LORA_RANK].float().view(n, fp8_ref.TILES, fp8_ref.TILE)  # [S, 4, 128]
    amax = lat.abs().amax(dim=-1).double()  # [S, 4]
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("the pool holds NaN or inf")
    mant, exp = torch.frexp(torch.clamp(amax / fp8_ref.E4M3_MAX, min=fp8_ref.MIN_SCALE))
    scales = torch.ldexp(torch.ones_like(mant), torch.where(mant == 0.5, exp - 1, exp)).float()  # [S, 4]
    bits = (lat / scales[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(n, KV_LORA_RANK)
    rope = kv[:, KV_LORA_RANK:].contiguous().view(torch.uint8)  # [S, 128]: little-endian bf16
    return torch.cat([bits, scales.view(torch.uint8), rope], dim=1)  # [S, 656]


def fp8_dequantized(pool8):
    """The FP8 layout's rows as a bf16 pool: torch [S, 656] uint8 -> [S, 576] bfloat16, each e4m3 value times
    its tile's scale rounded to bf16 (the product rounded once: exact for the layout's power-of-two scales),
    then the rope: what the FP8 build puts in its stages, FlashMLA's dequantization."""
    import torch

    if not (loader.is_torch(pool8) and pool8.dtype == torch.uint8 and pool8.ndim == 2
            and pool8.shape[1] == FP8_ROW_BYTES):
        raise ValueError(f"fp8_dequantized takes a torch uint8 pool [S, {FP8_ROW_BYTES}], got "
                         f"{type(pool8).__name__} {getattr(pool8, 'dtype', '')}")
    n, o = pool8.shape[0], KV_LORA_RANK + 4 * fp8_ref.TILES
    vals = pool8[:, :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float().view(n, fp8_ref.TILES,
                                                                                        fp8_ref.TILE)
    scales = pool8[:, KV_LORA_RANK:o].contiguous().view(torch.float32)  # [S, 4]
    # e4m3 (4 significant bits) times a bf16 (8) is exact in float32: one rounding, to bf16
    lat = (vals * scales.bfloat16().float()[..., None]).view(n, KV_LORA_RANK).bfloat16()
    return torch.cat([lat, pool8[:, o:].contiguous().view(torch.bfloat16)], dim=1)  # [S, 576]


def _check_prefix(bsz, kind, kv_cache, page_table, prefix_lens, batched, validate):
    """The prefix inputs of B = bsz requests whose q is of `kind` -> (kv, page table, prefix lengths, the
    pool's kind: kind, or "fp8" for the FP8 layout)."""
    if len(getattr(kv_cache, "shape", ())) != 2:
        raise ValueError(f"kv_cache must be [S, {D_QK}] (or [S, {FP8_ROW_BYTES}] uint8, the FP8 layout), got "
                         f"shape {getattr(kv_cache, 'shape', None)}")
    kv = _fp8_pool(kv_cache, kind)
    if kv is not None:
        kv_kind = "fp8"
    else:
        kv, kv_kind = _float_kind(kv_cache, "kv_cache")
        if kv.shape[1] != D_QK:
            raise ValueError(f"kv_cache rows are {kv.shape[1]} wide but q is {D_QK} wide")
        if kv_kind != kind:
            raise ValueError(f"kv_cache is {kv_kind} but q is {kind}: give both the same dtype")
    if kv.shape[0] >= 2**31:
        raise ValueError("kv_cache has more than 2**31 - 1 slots (int32 page table)")
    pt_shape = getattr(page_table, "shape", None)
    if pt_shape is None or len(pt_shape) != (2 if batched else 1):
        raise ValueError(f"page_table must be {'[B, P]' if batched else '[P]'}, got shape {pt_shape}")
    pt = loader.int_array(page_table if batched else loader.as_cupy(page_table)[None], "page_table", "int32",
                          shape=(bsz, pt_shape[-1]), check_range=validate)
    lens = _lengths(prefix_lens, "prefix_lens", batched, bsz, validate)
    return kv, pt, lens, kv_kind


def _check_tail(qa, kind, tree_kv, visibility, tree_sizes, batched, validate):
    import cupy

    bsz, nq = qa.shape[:2]
    want = (bsz, nq, D_QK) if batched else (nq, D_QK)
    if tuple(getattr(tree_kv, "shape", ())) != want:
        raise ValueError(f"tree_kv must have shape {want}, got {getattr(tree_kv, 'shape', None)}")
    tkv, t_kind = _float_kind(tree_kv, "tree_kv")
    if t_kind != kind:
        raise ValueError(f"tree_kv is {t_kind} but q is {kind}: give both the same dtype")
    vwant = (bsz, nq, nq) if batched else (nq, nq)
    vis = loader.as_cupy(visibility)  # torch bool crosses as bytes viewed as bool
    if vis.dtype != cupy.bool_ or vis.shape != vwant:
        raise ValueError(f"visibility must be a bool array of shape {vwant}, got {vis.dtype} {vis.shape}")
    vis = cupy.ascontiguousarray(vis if batched else vis[None])
    sizes = _lengths(tree_sizes, "tree_sizes", batched, bsz, validate)
    return (tkv if batched else tkv[None]), vis, sizes


def _validate_prefix(kv, pt, lens):
    import cupy

    n_slots, width = kv.shape[0], pt.shape[1]
    if bool(((lens < 0) | (lens > width)).any()):
        raise ValueError(f"prefix_lens must lie in [0, {width}] (the page table width)")
    used = cupy.arange(width, dtype=cupy.int32)[None, :] < lens[:, None]  # [B, P]
    if bool((used & ((pt < 0) | (pt >= n_slots))).any()):
        raise ValueError(f"page_table holds slots outside [0, {n_slots}) among the read entries")


def _validate_tail(sizes, nq):
    if bool(((sizes < 0) | (sizes > nq)).any()):
        raise ValueError(f"tree_sizes must lie in [0, {nq}]")


def _device_info() -> tuple[int, int]:
    """(SM count, opt-in shared memory per block) of the current device."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    props = cupy.cuda.runtime.getDeviceProperties(dev)
    return int(props["multiProcessorCount"]), int(props["sharedMemPerBlockOptin"])


def _wgmma_smem() -> int:
    """The shared memory a block of the largest sm_90a layout takes."""
    return max(_V5_SMEM, _V6_SMEM, _V7_SMEM, _V9_SMEM, _FP8_SMEM, _V11_SMEM, _V12_SMEM)


def wgmma_available() -> bool:
    """True when the current device runs the sm_90a kernels (compute capability 9.0, their shared memory)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    props = cupy.cuda.runtime.getDeviceProperties(dev)
    return ((int(props["major"]), int(props["minor"])) == (9, 0)
            and int(props["sharedMemPerBlockOptin"]) >= _wgmma_smem())


def split_plan(bsz: int, row_blocks: int, width: int, tile: int, slots: int) -> tuple[int, int]:
    """(nsplit, chunk): how to cut a page table of `width` keys so the grid fills the GPU.

    `row_blocks` blocks per request and split, `slots` blocks resident at once over all SMs. Picks
    the split count that minimises waves / splits (the time of one request-row-block's keys),
    with a 2% charge per split for its partial output and combine, at least
    `_MIN_TILES_PER_SPLIT` tiles of `tile` keys per split, and at most `_MAX_SPLITS`.
    """
    if width <= 0:
        return 1, tile
    base = bsz * row_blocks
    max_n = max(1, min(_MAX_SPLITS, width // (_MIN_TILES_PER_SPLIT * tile)))

    def cost(n):
        return math.ceil(base * n / slots) / n * (1 + 0.02 * n)

    n = min(range(1, max_n + 1), key=cost)
    per_split = -(-width // n)
    chunk = -(-per_split // tile) * tile  # a whole number of tiles
    return -(-width // chunk), chunk


def pick_version(version: int | None = None, impl: str | None = None, kind: str = "bf16") -> int:
    """The version a call on inputs of `kind` ("bf16" or "f32") runs: `version` (or the deprecated `impl`
    name) checked against the dtype and the device, or the default pick for None (see the module
    docstring). Needs CuPy and a device for the default pick and for the WGMMA_VERSIONS."""
    if impl is not None:
        if version is not None:
            raise ValueError(f"give version or the deprecated impl, not both (got {version!r} and {impl!r})")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {tuple(IMPLS)}, got {impl!r}")
        version = IMPLS[impl]
    version = loader.check_version(version, VERSIONS, None)
    if kind == "fp8" and version is None:  # the one version with an FP8 build (the device checked below)
        version = next(v for v, launch in LAUNCHES.items() if "fp8" in launch.dtypes)
    if version is None:
        if kind != "bf16":
            return 1
        if DEFAULT_VERSION not in WGMMA_VERSIONS or wgmma_available():
            return DEFAULT_VERSION
        mma = IMPLS[MMA_DEFAULT]
        return mma if _device_info()[1] >= LAUNCHES[mma].smem else 1
    if kind not in LAUNCHES[version].dtypes:
        if kind == "fp8":
            raise ValueError(f"the FP8 kv_cache runs version 10 alone, not version {version} "
                             f"({LAUNCHES[version].impl!r})")
        raise ValueError(f"version {version} ({LAUNCHES[version].impl!r}) needs bfloat16 inputs (the fp32 "
                         "path is version 1)")
    if version in WGMMA_VERSIONS and not wgmma_available():
        raise ValueError(f"version {version} ({LAUNCHES[version].impl!r}) needs an sm_90 device (H100/H200) "
                         f"with {_wgmma_smem():,} B of shared memory per block")
    return version


def _ceil(a, b):
    return -(-a // b)


def v5_max_jobs(bsz: int, rows: int, grid: int) -> int:
    """The most jobs the v5 plan makes for B requests of `rows` query rows on `grid` CTAs (MAX_ROUNDS * G
    + B * ceil(rows / 64)): the partial buffers' first dimension."""
    return _V5_ROUNDS * grid + bsz * _ceil(rows, _V5_BM)


def plan_v5(prefix_lens, tree_sizes, width: int, nq: int, nh: int, grid: int,
            chunk_with_tail: bool = _V5_CHUNK_WITH_TAIL, job_overhead: int = _V5_JOB_OVERHEAD,
            weigh_deal: bool = False) -> np.ndarray:
    """numpy mirror of `tree_verify_v5_plan` and of version 10's plan (`tree_verify_v10_plan`, weigh_deal its
    deal_cost): the int32 plan [1 + 8 B] the kernels read.

    prefix_lens [B] ints; tree_sizes [B] ints or None (the prefix alone, no tail); width = P, the
    page-table width; grid = G CTAs. plan[0] = jobs; per request b at 1 + 8 b: first job, key chunks,
    tiles per chunk, row blocks, prefix length, query rows, tail rows, the cut (chunk_with_tail: the kernels'
    CHUNK_WITH_TAIL, 1 where the tiles per chunk count chunk 0's tail tiles; `job_tiles` reads it). Jobs of
    request b are numbered chunk-major then row block: job = first + chunk * row_blocks + block.
    job_overhead: the kernels' JOB_OVERHEAD (-DJOB_OVERHEAD), the tiles a job weighs on top of its own in the
    cost the plan takes the least of, rounds x (longest job + job_overhead) x 32 + jobs, over up to MAX_ROUNDS
    candidates (each round count's shortest chunk). weigh_deal (version 10's plan where later calls reuse
    it, `reuse_plan`): from PLAN_SMALL_REQS + 1 to PLAN_SMEM_REQS requests a candidate of more than `grid`
    jobs and at most ORDER_CAP is weighed instead by the busiest CTA of the deal version 10 runs
    (`deal_busiest`: the snake deal where `snake_gains`, else the static one) x 32 + jobs.
    """
    lens = np.asarray(prefix_lens, dtype=np.int64)  # [B]
    if lens.ndim != 1:
        raise ValueError(f"prefix_lens must be [B], got shape {lens.shape}")
    bsz = lens.shape[0]
    lens = np.clip(lens, 0, width)
    tail = tree_sizes is not None
    ts = np.asarray(tree_sizes, dtype=np.int64) if tail else np.full(bsz, nq, dtype=np.int64)
    if ts.shape != (bsz,):
        raise ValueError(f"tree_sizes must be None or [B] = [{bsz}] as prefix_lens, got shape {ts.shape}")
    ts = np.clip(ts, 0, nq)
    rows = ts * nh
    rb = -(-rows // _V5_BM)
    tiles = -(-lens // _V5_BN)  # T: prefix tiles
    utiles = -(-ts // _V5_BN) if tail else np.zeros(bsz, dtype=np.int64)  # U: tail tiles
    cut = tiles + utiles if chunk_with_tail else tiles  # [B] the tiles the chunks cut

    def chunks(c):
        if chunk_with_tail:
            return -(-cut // c)
        return np.where(tiles > 0, -(-tiles // c), np.where(utiles > 0, 1, 0))

    def chunk_tiles(nc):  # [B] the record's tiles a chunk: equal chunks within each request
        per = np.where(cut > 0, -(-cut // np.maximum(nc, 1)), 0)
        return np.maximum(per, utiles) if chunk_with_tail else per

    def jobs(c):
        return int((rb * chunks(c)).sum())

    def records(c):  # the plan of chunks of at most c tiles
        nc = np.where(rb > 0, chunks(c), 0)  # [B]
        per = np.where(nc > 0, chunk_tiles(nc), 0)  # [B]
        plan = np.zeros(1 + _V5_PLAN_STRIDE * bsz, dtype=np.int32)  # [1 + 8 B]
        base = 0
        for b in range(bsz):
            e = 1 + _V5_PLAN_STRIDE * b
            ntail = ts[b] if tail else 0
            plan[e:e + 8] = (base, nc[b], per[b], rb[b], lens[b], rows[b], ntail, chunk_with_tail)
            base += int(nc[b] * rb[b])
        plan[0] = base
        return plan

    weigh = weigh_deal and _V5_PLAN_SMALL_REQS < bsz <= _V5_PLAN_SMEM_REQS
    shortest = max(1, int(utiles.max(initial=0))) if chunk_with_tail else 1  # chunks hold the tail's tiles
    tmax = max(shortest, int(cut.max(initial=0)))
    best = None
    for k in range(1, _V5_ROUNDS + 1):
        lo, hi = shortest, tmax
        while lo < hi:  # the shortest chunk that fits the jobs into k rounds of `grid`
            mid = (lo + hi) // 2
            if jobs(mid) <= k * grid:
                hi = mid
            else:
                lo = mid + 1
        n, nc = jobs(lo), chunks(lo)
        live = (rb > 0) & (nc > 0)
        size = chunk_tiles(nc) + (0 if chunk_with_tail else utiles)  # [B] each request's longest job
        longest = int(size[live].max(initial=0))
        cost = _ceil(n, grid) * (longest + job_overhead) * 32 + n
        if weigh and grid < n <= _V10_ORDER_CAP:
            static, snake, _ = deal_busiest(records(lo), grid, job_overhead)
            cost = (snake if snake_gains(static, snake) else static) * 32 + n
        if best is None or cost < best[0]:
            best = (cost, lo)
    return records(best[1])


def job_tiles(plan: np.ndarray) -> np.ndarray:
    """Key tiles of each job of a v5 plan (`plan_v5`) -> [jobs] int64, as the attend kernels decode them
    (decode_job): the prefix tiles of the job's chunk, plus the tail tiles in chunk 0. Where the plan's cut is
    1 (CHUNK_WITH_TAIL) the tiles a chunk count chunk 0's tail, so the prefix chunks shift by it."""
    plan = np.asarray(plan, dtype=np.int64)
    tiles = np.zeros(int(plan[0]), dtype=np.int64)  # [jobs]
    for b in range((plan.shape[0] - 1) // _V5_PLAN_STRIDE):
        base, nc, chunk, rb, ln, _, ntail, cut = plan[1 + _V5_PLAN_STRIDE * b:][:8]
        shift = _ceil(ntail, _V5_BN) if cut else 0
        for c in range(nc):
            ks = max(0, c * chunk - shift) * _V5_BN
            ke = min(ln, ((c + 1) * chunk - shift) * _V5_BN)
            tiles[base + c * rb:base + (c + 1) * rb] = (_ceil(ke - ks, _V5_BN) if ke > ks else 0) + (
                _ceil(ntail, _V5_BN) if c == 0 else 0)
    return tiles


def static_deal(jobs: int, grid: int) -> list[list[int]]:
    """The jobs each of `grid` CTAs runs in the static round-robin of versions 5-9: c, c + G, c + 2G, ..."""
    return [list(range(c, jobs, grid)) for c in range(grid)]


def snake_deal(order: np.ndarray, grid: int) -> list[list[int]]:
    """The jobs each of `grid` CTAs runs in version 10's snake deal of `order` (dealt_job in
    tree_verify/wgmma_ws.cuh): in round r CTA c takes order [k], k = r G + c in even rounds, r G + G - 1 - c
    in odd ones."""
    n = len(order)
    deal = [[] for _ in range(grid)]
    for r in range(_ceil(n, grid)):
        for c in range(grid):
            k = r * grid + (grid - 1 - c if r % 2 else c)
            if k < n:
                deal[c].append(int(order[k]))
    return deal


def plan_order(plan: np.ndarray, grid: int, job_overhead: int = _V5_JOB_OVERHEAD) -> np.ndarray | None:
    """numpy mirror of `tree_verify_v10_plan`'s order: the jobs of a v5 plan by decreasing key tiles
    (`job_tiles`; ties: the smaller index first) -> [jobs] int64, where their `snake_deal` leaves the
    busiest CTA lighter than the `static_deal` does by more than _V10_ORDER_GAIN / 64 (`cta_loads`); None
    where the plan writes none (order [0] = -1): no such gain, at most `grid` jobs, or more than
    `_V10_ORDER_CAP`. job_overhead: the build's JOB_OVERHEAD, the tiles the gate adds a job (`cta_loads`)."""
    n = int(plan[0])
    if not grid < n <= _V10_ORDER_CAP:
        return None
    static, snake, order = deal_busiest(plan, grid, job_overhead)
    return order if snake_gains(static, snake) else None


def snake_gains(static: int, snake: int) -> bool:
    """Version 10's gate: whether the snake deal's busiest CTA (`deal_busiest`) is lighter than the static
    deal's by more than ORDER_GAIN / ORDER_UNIT, so that its plan writes the order."""
    return static * _V10_ORDER_UNIT > snake * (_V10_ORDER_UNIT + _V10_ORDER_GAIN)


def order_threshold() -> float:
    """The predicted gain (`deal_busiest`: static over snake) past which version 10's plan orders the jobs:
    1 + ORDER_GAIN / ORDER_UNIT."""
    return 1 + _V10_ORDER_GAIN / _V10_ORDER_UNIT


def deal_busiest(plan: np.ndarray, grid: int,
                 job_overhead: int = _V5_JOB_OVERHEAD) -> tuple[int, int, np.ndarray]:
    """What version 10's plan weighs: the busiest CTA's load (`cta_loads`, job_overhead tiles a job: the
    build's JOB_OVERHEAD) under the `static_deal` and under the `snake_deal` of the jobs by decreasing key
    tiles (ties: the smaller index first), and that order [jobs] int64. static / snake is the gain the plan
    predicts for dealing by size."""
    order = np.argsort(-job_tiles(plan), kind="stable")
    static = cta_loads(plan, static_deal(int(plan[0]), grid), job_overhead)
    return int(static.max()), int(cta_loads(plan, snake_deal(order, grid), job_overhead).max()), order


def v11_groups(plan: np.ndarray) -> list[list[int]]:
    """The groups version 11's attend kernel runs a v5 plan as (plan_groups, group_job in
    tree_verify/wgmma_v11.cu), in its order: each request's key chunks, each the chunk's row-block jobs
    (one or two where a request has at most 72 rows); none where the plan has no jobs. Cluster k of C runs
    groups k, k + C, ... (`static_deal` of the groups)."""
    plan = np.asarray(plan, dtype=np.int64)
    if plan[0] == 0:
        return []
    groups = []
    for b in range((plan.shape[0] - 1) // _V5_PLAN_STRIDE):
        base, nc, _, rb = (int(v) for v in plan[1 + _V5_PLAN_STRIDE * b:][:4])
        groups += [list(range(base + c * rb, base + (c + 1) * rb)) for c in range(nc if rb > 0 else 0)]
    return groups


def own_plan(bsz: int, reuse_plan: bool = False) -> bool:
    """Whether version 10's verify of `bsz` requests runs no plan kernel (`OWN_PLAN`): its attend kernels
    make the plan themselves and deal the jobs statically. Not where later calls reuse the plan
    (`reuse_plan`, tree_verify_attention's): there the plan kernel makes it, and its order stays for them."""
    return OWN_PLAN and not reuse_plan and bsz <= _V10_OWN_PLAN_REQS


def v10_deal(plan: np.ndarray, grid: int, reuse_plan: bool = False,
             job_overhead: int = _V5_JOB_OVERHEAD) -> list[list[int]]:
    """The jobs each of `grid` CTAs of version 10's attend kernels runs, in order: the `snake_deal` of
    `plan_order` where the plan kernel makes the plan and writes an order, else the `static_deal` (also
    where the attend kernels make the plan, `own_plan`). reuse_plan: the call's, tree_verify_attention's
    (True for the first layer of a step and, through its plan, the plan_ready calls after it).
    job_overhead: the build's JOB_OVERHEAD, the weight a job carries in `plan_order`'s gate."""
    own = own_plan((len(plan) - 1) // _V5_PLAN_STRIDE, reuse_plan)
    order = None if own else plan_order(plan, grid, job_overhead)
    return static_deal(int(plan[0]), grid) if order is None else snake_deal(order, grid)


def cta_loads(plan: np.ndarray, deal: list[list[int]], job_overhead: int = _V5_JOB_OVERHEAD) -> np.ndarray:
    """Each CTA's work under `deal` (lists of job indices, as `v10_deal` gives) -> [len(deal)] int64: its
    jobs' key tiles (`job_tiles`) plus job_overhead a job (the build's JOB_OVERHEAD), the cost the plans
    weigh jobs by."""
    tiles = job_tiles(plan)
    return np.array([sum(int(tiles[j]) + job_overhead for j in jobs) for jobs in deal], dtype=np.int64)


def deal_balance(plan: np.ndarray, grid: int, job_overhead: int = _V5_JOB_OVERHEAD) -> tuple[int, int, int]:
    """How evenly version 10 spreads a plan's work over `grid` CTAs -> (the busiest CTA's load under
    `v10_deal`, the busiest under `even_split_loads`, the CTAs without a job under `v10_deal`); loads as
    `cta_loads` weighs them, job_overhead tiles a job (the build's JOB_OVERHEAD). The ratio of the first two
    is the most the attend kernel could gain from cutting the same work into equal shares, where its time
    follows the busiest CTA."""
    loads = cta_loads(plan, v10_deal(plan, grid, job_overhead=job_overhead), job_overhead)
    even = even_split_loads(plan, grid, job_overhead)
    return int(loads.max(initial=0)), int(even.max(initial=0)), int((loads == 0).sum())


def even_split_loads(plan: np.ndarray, grid: int, job_overhead: int = _V5_JOB_OVERHEAD) -> np.ndarray:
    """Each CTA's load (`cta_loads`' weights: tiles + job_overhead a job, the build's JOB_OVERHEAD) where a
    plan's work is cut into `grid` equal shares of key tiles ("stream-K"): the row blocks' tiles (their tail
    tiles, then their prefix tiles) laid end to end, CTA c taking tiles [c W / G, (c + 1) W / G) of the W,
    one job for each row block its share touches (none for a share of no tiles) -> [grid] int64. A model:
    no kernel here runs such a plan."""
    plan = np.asarray(plan, dtype=np.int64)
    per_rb = []  # [row blocks] each one's key tiles
    for b in range((plan.shape[0] - 1) // _V5_PLAN_STRIDE):
        _, nc, _, rb, ln, _, ntail = plan[1 + _V5_PLAN_STRIDE * b:][:7]
        if nc > 0:
            per_rb += [_ceil(int(ln), _V5_BN) + _ceil(int(ntail), _V5_BN)] * int(rb)
    ends = np.cumsum(np.asarray(per_rb, dtype=np.int64))  # [row blocks] where each one's tiles end
    starts = ends - np.asarray(per_rb, dtype=np.int64)
    total = int(ends[-1]) if per_rb else 0
    cuts = np.array([c * total // grid for c in range(grid + 1)], dtype=np.int64)  # [grid + 1]
    jobs = [int(((starts < hi) & (ends > lo)).sum()) if hi > lo else 0
            for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]
    return np.diff(cuts) + job_overhead * np.array(jobs, dtype=np.int64)


def v8_combine_warps(bsz: int, rows: int, width: int, grid: int) -> int:
    """Warps per block of version 8's combine (`_V8_COMBINE_WARPS`): the fewest that leave a row at most
    `_V8_JOBS_PER_WARP` jobs a warp (two rounds of its loads in flight), then fewer while the B x rows x 4
    blocks would not all be resident at once (2048 threads an SM on `grid` SMs): a second wave of blocks
    costs more than slower warps, and at 8 heads x 33 queries x 200k (26 jobs a row, 1056 blocks) 8 warps
    measured slower than 4 (data/results/history/attention.v8_four_jobs_a_warp.500404d.h200.json).

    A row's jobs are estimated as the plan makes them in one round (its usual choice: about `grid` jobs
    over the B x ceil(rows / 64) row blocks, at most the tiles of `width` keys); the host knows no prefix
    length (the plan is made on the device). Any choice merges every job; this one only sets how many
    loads are in flight at once."""
    blocks = bsz * rows * _V5_COMBINE_SLICES
    chunks = max(1, min(_ceil(width, _V5_BN), _ceil(grid, bsz * _ceil(rows, _V5_BM))))
    fit = [w for w in _V8_COMBINE_WARPS if blocks * w * 32 <= grid * 2048] or [_V8_COMBINE_WARPS[0]]
    return next((w for w in fit if _ceil(chunks, w) <= _V8_JOBS_PER_WARP), fit[-1])


def v8_combine_rows(bsz: int, rows: int, grid: int) -> bool:
    """Whether version 8's merge runs `tree_verify_v8_combine_rows` (a warp per row, the bits of the 4-warp
    combine): where even the 4-warp combine's B x rows x 4 blocks are more than `grid` SMs hold at once
    (2048 threads an SM), as at 64 heads x 65 queries (4,160 rows, 16,640 blocks, eight waves of them, each
    block waiting on a row's few jobs behind its barriers). There `v8_combine_warps` gives 4 warps."""
    return bsz * rows * _V5_COMBINE_SLICES * 32 * _V8_COMBINE_WARPS[0] > grid * 2048


def fp8_path_for(rows: int, fp8_path: str | None = None) -> str:
    """The path a verify over an FP8 pool runs at `rows` = Q x H query rows a request: `fp8_path` checked
    against FP8_PATHS, or for None "dequant_first" past FP8_DEQUANT_FIRST_ROWS rows, else "fused"."""
    if fp8_path is None:
        return "dequant_first" if rows > FP8_DEQUANT_FIRST_ROWS else "fused"
    if fp8_path not in FP8_PATHS:
        raise ValueError(f"fp8_path must be one of {FP8_PATHS} or None, got {fp8_path!r}")
    return fp8_path


def _pool_path(kv_kind: str, rows: int, fp8_path: str | None) -> str | None:
    """_launch_wgmma's fp8: the FP8 pool's path (`fp8_path_for`); None for a float pool, where fp8_path must
    be None."""
    if kv_kind == "fp8":
        return fp8_path_for(rows, fp8_path)
    if fp8_path is not None:
        raise ValueError(f"fp8_path applies to an FP8 kv_cache ([S, {FP8_ROW_BYTES}] uint8), the call's is "
                         f"{kv_kind}")
    return None


@functools.cache
def _resident_clusters(fn, threads: int, smem: int) -> int:
    """The two-CTA clusters of version 11's or 13's attend kernel the device holds at once (its persistent
    grid; a GPC of an odd number of free SMs leaves one idle)."""
    return loader.max_active_clusters(fn, _V11_CLUSTER, threads, smem)


def v11_rows(rows: int) -> bool:
    """Whether versions 11 and 12 run their own attend kernels at Q*H = `rows` a request: two 64-row jobs a
    key chunk whose rows fit their one pass (64 < rows <= 72); elsewhere they run version 10."""
    return _V5_BM < rows <= _V11_NR


def v13_pairs(bsz: int, rows: int, grid: int) -> bool:
    """Whether version 13 launches its cluster kernel for B = `bsz` requests of Q*H = `rows` on `grid` CTAs
    (its clusters'): one request whose rb row blocks of 64 rows take 2 rb <= grid < 3 rb, the only shapes
    where its plan can give the full rows two key chunks a row block, one job a CTA (the pairs), at a prefix
    of more than a few key tiles. From 3 rb CTAs on, the plan's first round holds three chunks a row block;
    within the range, its cost model can still choose more chunks in more rounds (48 x 65 x 32k on 132
    CTAs), and there the cluster kernel runs version 10's path. Elsewhere version 13 launches version 10's
    kernels: its cluster kernel measured 1-2 % slower than them where it ran version 10's path (notebook 02b,
    13y)."""
    rb = _ceil(rows, _V5_BM)
    return bsz == 1 and 2 * rb <= grid < 3 * rb


def v12_plan_grid(grid: int) -> int:
    """The CTA count version 12 makes its v5 plan for on `grid` SMs: twice them, so that the plan's jobs, two
    a key chunk at 65-72 rows, come to about one chunk (a group) a CTA in its first round."""
    return 2 * grid


def v9_options(rows: int) -> tuple[str, ...] | None:
    """Version 9's NVRTC options at Q*H = `rows` a request: TV9_NR, the rows its attend kernel is built for
    (rows rounded up to 8: one row block, whose jobs ragged trees only shrink); None past `_V9_MAX_ROWS`
    (there version 9 runs version 8's kernels)."""
    return (f"-DTV9_NR={8 * _ceil(rows, 8)}",) if rows <= _V9_MAX_ROWS else None


class VerifyWorkspace:
    """Buffers of one version 5 ... 13 ("wgmma" ... "wgmma_v13") call shape (B requests, Q queries, H heads):
    with it a call allocates nothing.

    plan [1 + 8 B] int32, order [jobs] int32 (version 10's order of the jobs), parts [jobs, 64, 512] fp32 and
    part_lse [jobs, 64] fp32 (jobs = v5_max_jobs, over `v12_plan_grid` CTAs where `v11_rows`), out [B*Q*H,
    512] fp32 and lse [B*Q*H] fp32 (the returned arrays are views of these: the next call with the same
    workspace overwrites them). An FP8 pool's dequant-first path adds a bf16 pool and its page table
    (`fp8_staging`).
    """

    def __init__(self, bsz: int, nq: int, nh: int, fp8_width: int | None = None):
        import cupy

        if bsz < 1 or not 1 <= nq <= MAX_Q or nh < 1:
            raise ValueError(f"workspace shape needs B >= 1, 1 <= Q <= {MAX_Q}, H >= 1, got {(bsz, nq, nh)}")
        self.shape = (bsz, nq, nh)
        self.grid = _device_info()[0]
        rows = nq * nh
        jobs = v5_max_jobs(bsz, rows, v12_plan_grid(self.grid) if v11_rows(rows) else self.grid)
        self.plan = cupy.zeros(1 + _V5_PLAN_STRIDE * bsz, dtype=cupy.int32)  # [1 + 8B]
        self.order = cupy.full(jobs, -1, dtype=cupy.int32)  # [jobs]; order [0] = -1: the static deal
        self.parts = cupy.empty((jobs, _V5_BM, KV_LORA_RANK), dtype=cupy.float32)  # [jobs, 64, 512]
        self.part_lse = cupy.empty((jobs, _V5_BM), dtype=cupy.float32)  # [jobs, 64]
        self.out = cupy.empty((bsz * rows, KV_LORA_RANK), dtype=cupy.float32)  # [B*Q*H, 512]
        self.lse = cupy.empty((bsz * rows,), dtype=cupy.float32)  # [B*Q*H]
        self._staging = None  # (P, bf16 pool, page table): fp8_staging's buffers
        if fp8_width is not None:
            self.fp8_staging(fp8_width)

    def fp8_staging(self, width: int):
        """The dequant-first path's buffers for page tables `width` = P keys wide -> (a bf16 pool [B*P, 576]
        as uint16 bits, B x P x 1,152 bytes, request b's key k at row b P + k; its page table [B, P] int32).
        Made by the first call of a width, reused by the next ones (so a call under CUDA-graph capture must
        find them made: make_workspace's fp8_width); a call of another width replaces them, after which a
        graph captured on the old ones must not replay."""
        import cupy

        if not isinstance(width, numbers.Integral) or width < 0:
            raise ValueError(f"fp8_width must be an int >= 0, got {width!r}")
        if self._staging is None or self._staging[0] != width:
            bsz = self.shape[0]
            self._staging = None  # the old pool freed before the new one is made
            pool = cupy.empty((bsz * width, D_QK), dtype=cupy.uint16)  # [B*P, 576] bf16 bits
            table = cupy.arange(bsz * width, dtype=cupy.int32).reshape(bsz, width)  # [B, P]
            self._staging = (int(width), pool, table)
        return self._staging[1:]


def make_workspace(bsz: int, nq: int, nh: int, *, fp8_width: int | None = None) -> VerifyWorkspace:
    """Preallocated buffers for version 5 ... 13 ("wgmma" ... "wgmma_v13") calls on q of shape
    [bsz, nq, nh, 576] (see VerifyWorkspace). fp8_width: also the dequant-first path's buffers for page
    tables that wide (VerifyWorkspace.fp8_staging), as a call made under CUDA-graph capture needs them."""
    return VerifyWorkspace(bsz, nq, nh, fp8_width)


def dequant_prefix(kv_cache, page_table, prefix_lens, workspace: VerifyWorkspace, *, validate: bool = True):
    """The dequant-first path's first launch alone (tree_verify_fp8_gather_v1, `fp8_path`): each request's
    prefix rows of an FP8 pool dequantized into the workspace's bf16 pool -> (that pool [B*P, 576] as uint16
    bits, its page table [B, P] int32): the workspace's buffers (`VerifyWorkspace.fp8_staging`), whose rows
    past a request's prefix keep what they held. Shapes: kv_cache [S, 656] uint8 (the FP8 layout),
    page_table [B, P] int, prefix_lens [B] int, B the workspace's. validate (device syncs): as the verify's,
    prefix_lens in [0, P] and every read slot in [0, S)."""
    if not isinstance(workspace, VerifyWorkspace):
        raise ValueError(f"workspace must come from make_workspace, got {type(workspace).__name__}")
    dtype = getattr(kv_cache, "dtype", None)
    if str(dtype).removeprefix("torch.") != "uint8":  # before the checks that compare its dtype with q's
        raise ValueError(f"dequant_prefix takes an FP8 kv_cache ([S, {FP8_ROW_BYTES}] uint8), got {dtype}")
    kv, pt, lens, _ = _check_prefix(workspace.shape[0], "bf16", kv_cache, page_table, prefix_lens, True,
                                    validate)
    if validate:
        _validate_prefix(kv, pt, lens)
    return _dequant_prefix(kv, pt, lens, workspace)


def _dequant_prefix(pool8, pt, lens, ws: VerifyWorkspace):
    """The dequant-first path's gather (tree_verify_fp8_gather_v1): each request's prefix rows of the FP8 pool
    [S, 656] uint8, dequantized into ws's bf16 pool -> (that pool [B*P, 576], its page table [B, P])."""
    bsz, width = pt.shape
    kv16, table = ws.fp8_staging(width)
    if width:
        fn = loader.get_function(_FP8_GATHER, "tree_verify_fp8_gather_v1")
        fn((_ceil(width, _FP8_GATHER_KEYS), bsz), (32 * _FP8_GATHER_KEYS,),
           (pool8, pt, lens, np.int32(width), kv16))
    return kv16, table


def _launch_wgmma(version, qa, kv, pt, lens, scale, ws, tail=None, plan_ready=False, fp8=None,
                  reuse_plan=False):
    """The three launches of version 5 ... 13 (plan, the version's attend, its combine) -> (out [B*M, 512],
    lse [B*M]) fp32 views of the workspace.

    tail = (tree_kv [B, Q, 576], visibility [B, Q, Q], tree_sizes [B]) for the whole verify, None
    for the prefix alone. plan_ready: the plan launch is skipped, ws.plan is read as it is; reuse_plan: later
    calls will (version 10 runs its plan kernel, `own_plan`). fp8 (version 10):
    kv is the FP8 pool [S, 656] uint8 and fp8 its path (FP8_PATHS): "fused", the FP8 build; "dequant_first",
    the gather into the workspace's bf16 pool (`_dequant_prefix`) launched first, then the bf16 build.
    """
    bsz, nq, nh, _ = qa.shape
    if ws is None:
        ws = VerifyWorkspace(bsz, nq, nh)
    elif ws.shape != (bsz, nq, nh):
        raise ValueError(f"workspace was made for (B, Q, H) = {ws.shape}, the call has {(bsz, nq, nh)}")
    rows = nq * nh
    null = np.uintp(0)
    tkv, vis, sizes = tail if tail is not None else (null, null, null)
    if fp8 == "dequant_first":
        kv, pt = _dequant_prefix(kv, pt, lens, ws)
        fp8 = None
    if version in (11, 12) and not v11_rows(rows):  # pick_version refuses them an FP8 pool
        version = 10
    v9 = v9_options(rows) if version in (9, 10, 13) else None
    if version == 9 and v9 is None:
        version = 8
    settings = LAUNCHES[version]
    options = settings.options + (v9 or ()) + (FP8_OPTIONS if fp8 else ())
    width = pt.shape[1]
    ordered = version in (10, 13)  # v10's plan also writes ws.order, its attend kernels read it
    plan_fn = loader.get_function(settings.stem, "tree_verify_v10_plan" if ordered else "tree_verify_v5_plan",
                                  options=options)
    smem, grid = settings.smem, ws.grid
    if ordered:  # v9's consumers where version 9 runs its own kernel, else v7's
        attend, smem = ("tree_verify_v10_attend_t", _V9_SMEM) if v9 else ("tree_verify_v10_attend", _V7_SMEM)
        smem = _FP8_SMEM if fp8 else smem
    elif version in (11, 12):  # 11: clusters of two CTAs, as many as the device holds at once
        attend = f"tree_verify_v{version}_attend"
    else:
        attend = f"tree_verify_v{7 if version == 8 else version}_attend"  # v8 runs v7's attend kernel
    own = ordered and not plan_ready and own_plan(bsz, reuse_plan)  # no plan kernel
    order = (ws.order,) if ordered else ()
    # the combine: its kernel, grid, block and the arguments between plan and out (v9 and v10 run v8's)
    combine, cblock = "tree_verify_v5_combine", _COMBINE_THREADS
    cgrid, cargs = (bsz * rows, _V5_COMBINE_SLICES), (np.int32(rows),)
    if version >= 8 and COMBINE_ROWS and v8_combine_rows(bsz, rows, ws.grid):
        combine, cblock = "tree_verify_v8_combine_rows", 32 * _V8_ROWS_WARPS
        cgrid, cargs = (_ceil(bsz * rows, _V8_ROWS_WARPS),), (np.int32(rows), np.int32(bsz * rows))
    elif version >= 8:
        warps = v8_combine_warps(bsz, rows, width, ws.grid)
        combine, cblock = f"tree_verify_v8_combine_w{warps}", 32 * warps
    # 13: the row blocks of two jobs merged in the attend kernel where its plan can have them (v13_pairs, on
    # its clusters' grid); its combine the rest. Elsewhere version 10's kernels.
    pairs = False
    if version == 13 and own and not v9 and combine == "tree_verify_v8_combine_rows":
        fn = loader.get_function(settings.stem, "tree_verify_v13_attend_own", options=options)
        loader.set_max_dynamic_shared(fn, smem)
        clusters = _resident_clusters(fn, settings.threads, smem)
        pairs_grid = _V11_CLUSTER * min(ws.grid // _V11_CLUSTER, clusters)
        pairs = v13_pairs(bsz, rows, pairs_grid)
    if pairs:
        attend, combine, cargs = "tree_verify_v13_attend", "tree_verify_v13_combine_rows", (ws.order, *cargs)
        grid = pairs_grid
    attend_fn = loader.get_function(settings.stem, attend + ("_own" if own else ""), options=options)
    combine_fn = loader.get_function(settings.stem, combine, options=options)
    loader.set_max_dynamic_shared(attend_fn, smem)
    if version == 11:
        clusters = _resident_clusters(attend_fn, settings.threads, smem)
        grid = _V11_CLUSTER * min(ws.grid // _V11_CLUSTER, clusters)
    if not plan_ready and not own:
        plan_grid = v12_plan_grid(grid) if version == 12 else grid
        deal_cost = (np.int32(reuse_plan and DEAL_COST),) if ordered else ()  # weighed by its deal if reused
        plan_fn((1,), (_V5_THREADS,), (lens, sizes, np.int32(bsz), np.int32(width), np.int32(nq),
                                       np.int32(nh), np.int32(plan_grid), ws.plan, *order, *deal_cost))
    pdl = version >= 10 and PDL
    loader.launch(attend_fn, (grid,), (settings.threads,),
                  (qa, kv, pt, tkv, vis, ws.plan, *order, np.int32(bsz), np.int32(width), np.int32(nq),
                   np.int32(nh), np.float32(scale), ws.parts, ws.part_lse, *((lens, sizes) if own else ()),
                   *((ws.out, ws.lse) if pairs else ())),
                  shared_mem=smem, pdl=pdl)
    loader.launch(combine_fn, cgrid, (cblock,), (ws.parts, ws.part_lse, ws.plan, *cargs, ws.out, ws.lse),
                  pdl=pdl)
    return ws.out, ws.lse


def _launch_prefix(qa, kind, kv, pt, lens, scale, version: int):
    """Versions 1-4 -> (parts [B, nsplit, M, 512], lse [B, nsplit, M]) fp32, normalised partials per split."""
    import cupy

    bsz, nq, nh, _ = qa.shape
    rows = nq * nh
    width = pt.shape[1]
    n_sm, _ = _device_info()
    settings = LAUNCHES[version]
    rb = -(-rows // settings.rows)
    # v2-v4: one 256-thread block per SM; v1: _V1_BLOCKS_PER_SM
    slots = n_sm * (_V1_BLOCKS_PER_SM if version == 1 else 1)
    nsplit, chunk = split_plan(bsz, rb, width, settings.keys, slots)
    fn = loader.get_function(settings.stem, f"tree_verify_v{version}_prefix_{kind}")
    loader.set_max_dynamic_shared(fn, settings.smem)
    block, smem = settings.threads, settings.smem
    parts = cupy.empty((bsz, nsplit, rows, KV_LORA_RANK), dtype=cupy.float32)  # [B, nsplit, Q*H, 512]
    plse = cupy.empty((bsz, nsplit, rows), dtype=cupy.float32)  # [B, nsplit, Q*H]
    fn(
        (rb, nsplit, bsz),
        (block,),
        (qa, kv, pt, lens, np.int32(width), np.int32(nq), np.int32(nh), np.int32(nsplit), np.int32(chunk),
         np.float32(scale), parts, plse),
        shared_mem=smem,
    )
    return parts, plse


def _launch_tail(qa, kind, tkv, vis, sizes, scale):
    import cupy

    bsz, nq, nh, _ = qa.shape
    out = cupy.empty((bsz, nq, nh, KV_LORA_RANK), dtype=cupy.float32)  # [B, Q, H, 512]
    lse = cupy.empty((bsz, nq, nh), dtype=cupy.float32)  # [B, Q, H]
    fn = loader.get_function(_V1_TAIL, f"tree_verify_v1_tail_{kind}")
    fn((-(-(nq * nh) // _V1_ROWS), 1, bsz), (_V1_ROWS * 32,),
       (qa, tkv, vis, sizes, np.int32(nq), np.int32(nh), np.float32(scale), out, lse))
    return out, lse


def _launch_combine(parts, plse, rows_per_batch, extra=None, extra_lse=None):
    """Merge parts [B, n, M, 512] (+ extra [B*M, 512]) -> out [B*M, 512], lse [B*M]."""
    import cupy

    bsz, nparts = parts.shape[:2]
    nrows = bsz * rows_per_batch
    out = cupy.empty((nrows, KV_LORA_RANK), dtype=cupy.float32)  # [B*M, 512]
    lse = cupy.empty((nrows,), dtype=cupy.float32)  # [B*M]
    if nrows == 0:
        return out, lse
    null = np.uintp(0)
    fn = loader.get_function(_V1_COMBINE, "tree_verify_v1_combine")
    fn((nrows,), (_COMBINE_THREADS,),
       (parts, plse, np.int32(nparts), np.int32(rows_per_batch),
        null if extra is None else extra, null if extra_lse is None else extra_lse, out, lse))
    return out, lse


def _check_workspace(workspace, version: int, plan_ready: bool = False):
    if plan_ready and workspace is None:
        raise ValueError("plan_ready=True reads the plan of an earlier call on the same workspace: pass it")
    if workspace is not None and version not in WGMMA_VERSIONS:
        names = ", ".join(repr(LAUNCHES[v].impl) for v in WGMMA_VERSIONS)
        raise ValueError(f"workspace buffers serve versions {WGMMA_VERSIONS} ({names}) only, the call runs "
                         f"version {version}")
    if workspace is not None and not isinstance(workspace, VerifyWorkspace):
        raise ValueError(f"workspace must come from make_workspace, got {type(workspace).__name__}")


def prefix_attention(q, kv_cache, page_table, prefix_lens, softmax_scale, kv_lora_rank: int = KV_LORA_RANK, *,
                     version: int | None = None, validate: bool = True,
                     workspace: VerifyWorkspace | None = None, impl: str | None = None,
                     fp8_path: str | None = None):
    """Attention of every query over its request's paged latent prefix (page_size 1), split-KV.

    Shape: q [B, Q, H, 576], kv_cache [S, 576] (or [S, 656] uint8, the FP8 layout: module docstring),
    page_table [B, P] int, prefix_lens [B] int (or the unbatched form). Returns out [B, Q, H, 512] fp32,
    lse [B, Q, H] fp32 (CuPy).
    version: one of VERSIONS, None (the default): by dtype and device (fp32: 1; bf16: DEFAULT_VERSION
    where it runs). impl: deprecated name of a version (IMPLS). workspace (WGMMA_VERSIONS only): buffers
    from make_workspace; the results are views of it. fp8_path (an FP8 kv_cache only): one of FP8_PATHS,
    None: `fp8_path_for` picks by Q x H (module docstring).
    """
    _check_rank(kv_lora_rank)
    qa, kind, batched = _check_q(q)
    bsz, nq, nh, _ = qa.shape
    kv, pt, lens, kv_kind = _check_prefix(bsz, kind, kv_cache, page_table, prefix_lens, batched, validate)
    path = _pool_path(kv_kind, nq * nh, fp8_path)
    scale = _scale(softmax_scale)
    version = pick_version(version, impl, kv_kind)
    _check_workspace(workspace, version)
    if validate:
        _validate_prefix(kv, pt, lens)
    if version in WGMMA_VERSIONS:
        out, lse = _launch_wgmma(version, qa, kv, pt, lens, scale, workspace, fp8=path)
        out, lse = out.reshape(bsz, nq, nh, KV_LORA_RANK), lse.reshape(bsz, nq, nh)
        return (out, lse) if batched else (out[0], lse[0])
    parts, plse = _launch_prefix(qa, kind, kv, pt, lens, scale, version)
    if parts.shape[1] == 1:
        out, lse = parts, plse
    else:
        out, lse = _launch_combine(parts, plse, nq * nh)
    out, lse = out.reshape(bsz, nq, nh, KV_LORA_RANK), lse.reshape(bsz, nq, nh)
    return (out, lse) if batched else (out[0], lse[0])


def tree_tail_attention(q, tree_kv, visibility, tree_sizes, softmax_scale, kv_lora_rank: int = KV_LORA_RANK,
                        *, validate: bool = True):
    """Attention of every tree query over the tree's own rows under the visibility mask.

    Shape: q [B, Q, H, 576], tree_kv [B, Q, 576], visibility [B, Q, Q] bool, tree_sizes [B] int.
    Returns out [B, Q, H, 512] fp32, lse [B, Q, H] fp32; rows >= tree_sizes[b] are NaN.
    """
    _check_rank(kv_lora_rank)
    qa, kind, batched = _check_q(q)
    tkv, vis, sizes = _check_tail(qa, kind, tree_kv, visibility, tree_sizes, batched, validate)
    scale = _scale(softmax_scale)
    if validate:
        _validate_tail(sizes, qa.shape[1])
    out, lse = _launch_tail(qa, kind, tkv, vis, sizes, scale)
    return (out, lse) if batched else (out[0], lse[0])


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Merge two attention results over disjoint key sets by their natural-log LSE.

    Shape: out_* [..., 512] float32, lse_* [...] float32 (same leading shape). Both parts empty
    (lse -inf) gives out 0, lse -inf; NaN in either lse gives a NaN row.
    """
    import cupy

    arrs = [loader.as_cupy(x) for x in (out_a, lse_a, out_b, lse_b)]
    for name, a in zip(("out_a", "lse_a", "out_b", "lse_b"), arrs, strict=True):
        if a.dtype != cupy.float32:
            raise ValueError(f"{name} must be float32, got {a.dtype}")
    oa, la, ob, lb = (cupy.ascontiguousarray(a) for a in arrs)
    if oa.shape != ob.shape or la.shape != lb.shape or oa.shape[:-1] != la.shape:
        raise ValueError(f"merge shapes disagree: out {oa.shape} / {ob.shape}, lse {la.shape} / {lb.shape}")
    if oa.ndim < 1 or oa.shape[-1] != KV_LORA_RANK:
        raise ValueError(f"the merged outputs must be {KV_LORA_RANK} wide, got {oa.shape}")
    lead = la.shape
    n = int(np.prod(lead, dtype=np.int64))
    out, lse = _launch_combine(oa.reshape(1, 1, n, KV_LORA_RANK), la.reshape(1, 1, n), n,
                               ob.reshape(n, KV_LORA_RANK), lb.reshape(n))
    return out.reshape(*lead, KV_LORA_RANK), lse.reshape(lead)


def tree_verify_attention(q, kv_cache, page_table, prefix_lens, tree_kv, visibility, tree_sizes,
                          softmax_scale, kv_lora_rank: int = KV_LORA_RANK, *, version: int | None = None,
                          validate: bool = True, workspace: VerifyWorkspace | None = None,
                          impl: str | None = None, plan_ready: bool = False, reuse_plan: bool = False,
                          fp8_path: str | None = None):
    """The whole verify attention: split-KV prefix + masked tail, merged in one combine launch
    (versions 5-13: the tail fused into the prefix kernel).

    Shapes as in the two parts (batched or unbatched); kv_cache may be the FP8 layout, [S, 656] uint8 (module
    docstring; version 10 runs it, bf16 q and tree_kv). Returns out [B, Q, H, 512] fp32 and the
    natural-log lse [B, Q, H] fp32 (CuPy); rows >= tree_sizes[b] are NaN. version: one of VERSIONS,
    None (the default): by dtype and device (fp32: 1; bf16: DEFAULT_VERSION where it runs). impl:
    deprecated name of a version (IMPLS). workspace (WGMMA_VERSIONS only): buffers from
    make_workspace; the results are views of it. plan_ready (with a workspace): its plan is the one the
    previous call on it made for the same prefix_lens, tree_sizes and page-table width, and the plan
    launch is skipped (the layers of one verify step share a plan); the caller vouches for the sameness.
    Version 10 also reads the order its own plan wrote there: after another version's plan on the
    workspace, run version 10's plan before a plan_ready call of version 10. reuse_plan: later calls will
    reuse this call's plan (the first layer of a step); version 10 then makes it with its plan kernel, whose
    order by size (where its gate takes one) those calls keep, not in its attend kernels (`OWN_PLAN`, up to
    8 requests), which deal the jobs statically. fp8_path (an FP8 kv_cache
    only): one of FP8_PATHS, None: `fp8_path_for` picks by Q x H (module docstring).
    """
    _check_rank(kv_lora_rank)
    qa, kind, batched = _check_q(q)
    bsz, nq, nh, _ = qa.shape
    kv, pt, lens, kv_kind = _check_prefix(bsz, kind, kv_cache, page_table, prefix_lens, batched, validate)
    tkv, vis, sizes = _check_tail(qa, kind, tree_kv, visibility, tree_sizes, batched, validate)
    path = _pool_path(kv_kind, nq * nh, fp8_path)
    scale = _scale(softmax_scale)
    version = pick_version(version, impl, kv_kind)
    _check_workspace(workspace, version, plan_ready)
    if validate:
        _validate_prefix(kv, pt, lens)
        _validate_tail(sizes, qa.shape[1])
    if version in WGMMA_VERSIONS:
        out, lse = _launch_wgmma(version, qa, kv, pt, lens, scale, workspace, tail=(tkv, vis, sizes),
                                 plan_ready=plan_ready, fp8=path, reuse_plan=reuse_plan)
        out, lse = out.reshape(bsz, nq, nh, KV_LORA_RANK), lse.reshape(bsz, nq, nh)
        return (out, lse) if batched else (out[0], lse[0])
    parts, plse = _launch_prefix(qa, kind, kv, pt, lens, scale, version)
    t_out, t_lse = _launch_tail(qa, kind, tkv, vis, sizes, scale)
    out, lse = _launch_combine(parts, plse, nq * nh, t_out.reshape(-1, KV_LORA_RANK), t_lse.reshape(-1))
    out, lse = out.reshape(bsz, nq, nh, KV_LORA_RANK), lse.reshape(bsz, nq, nh)
    return (out, lse) if batched else (out[0], lse[0])
