"""What bounds the tree verify at its memory-bound points (issue 19): the gathers, the padding, or the kernel.

`python3 -m kdlib.perf.run --suite attention_bounds [--quick]`. Per point of `POINTS` (the attention
suite's memory-bound points, queries 1 and 9, and the 8 x 65 x 200k point for contrast; the attention
suite's inputs, `attention.point_inputs`, whose page tables scatter each request's rows over its slots):

  * `verify`: the whole verify of `kdlib.cuda.attention`'s default version, replayed from CUDA graphs, on
    the scattered page tables and on sequential ones (slot = key: the same bytes, contiguous);
  * `kernels`: the replay profiled (`kdlib.perf.profile.device_profile`): device us per kernel (plan,
    attend, combine), so the attend kernel's share is measured rather than assumed;
  * `gather`: `kernels/gather_read/v1.cu` over the same rows through the same page tables (scattered and
    sequential): 16-byte loads into registers with R = 2, 4, 8 rows in flight per warp, and one copy-engine
    bulk copy per row into a shared-memory ring (`bulk`), each on a grid of the blocks an SM holds at once:
    the bandwidth page_size-1 row gathers reach with no math at all, checked exact against a CPU XOR;
  * `padded`: the FLOPs the wgmma kernels execute (each request's H x Q rows rounded up to jobs of 64,
    every key of the prefix) over the recorded bf16 matmul rate: the floor of a kernel that pads its rows;
  * `probes` (the points run by v7's consumers, more than 16 rows a request): the same verify with the attend
    kernel built as a probe (`TV7_PROBE`, tree_verify/wgmma_ws.cuh; `PROBES`): its gathers alone (the
    consumers only wait for the stages and release them), its MMA warpgroups' work alone (the producer
    gathers each stage once, then only arrives), and that work without the P V MMAs or without the S ones,
    each attend kernel's device us beside the default's from the same run; `staged_bytes`: the rows the
    producer gathers, every job's row block reading its keys (each row once per row block of its request).
The copy bandwidth is measured in the same run (`timing.copy_bandwidth`); each point's floors are its
bytes (`attention.point_inputs`' cost) over that and over the best gather rate.
"""

from __future__ import annotations

import math

import numpy as np

from kdlib.cuda import loader
from kdlib.perf import profile, results, timing
from kdlib.perf.rank_work import ROW_BLOCK
from kdlib.perf.suites import _attention as base
from kdlib.perf.suites import attention

SOURCE = "gather_read/v1"  # kernels/gather_read/v1.cu
# its kernels gather_read_v1_<arm>: R = 2, 4, 8 rows in flight per warp into registers, or the copy engine
ARMS = ("r2", "r4", "r8", "bulk")
# threads per block: each kernel's __launch_bounds__; the bulk ring's shared memory: its BULK_SMEM
BLOCK = {arm: loader.launch_bounds(SOURCE)[f"gather_read_v1_{arm}"][0] for arm in ARMS}
BULK_SMEM = loader.source_constants(SOURCE)["BULK_SMEM"]
SM_REGS, SM_THREADS, SM_SMEM = 65536, 2048, 227 * 1024  # per SM on sm_90 (the H200)
ROW_BYTES = attention.D_QK * 2
POINTS = [
    {"heads": 8, "queries": 1, "prefix": 200_000, "batch": 1},
    {"heads": 8, "queries": 9, "prefix": 200_000, "batch": 1},
    {"heads": 8, "queries": 9, "prefix": 32_768, "batch": 8},
    {"heads": 8, "queries": 65, "prefix": 200_000, "batch": 1},
    {"heads": 64, "queries": 65, "prefix": 32_768, "batch": 1},
]
# the probe builds of v7's consumers (TV7_PROBE): the producer's gathers alone, the consumers' work alone,
# and that work without the P V MMAs, without the S MMAs
PROBES = {"gathers": "-DTV7_PROBE=1", "consumers": "-DTV7_PROBE=2", "consumers_no_pv": "-DTV7_PROBE=3",
          "consumers_no_s": "-DTV7_PROBE=4"}


def sequential_tables(tables: list, lens: list[int]) -> list:
    """Tables of the same shape as `tables` whose request b reads its slots in key order: the slot set of
    each rotation and request is the scattered table's own (its smallest slot onwards), so only the
    order differs."""
    import torch

    out = []
    for pt in tables:
        seq = torch.zeros_like(pt)  # [B, width] int32
        for b, n in enumerate(lens):
            seq[b, :n] = torch.arange(n, dtype=torch.int32, device=pt.device) + pt[b, :n].min()
        out.append(seq)
    return out


def gather_rows(tables: list, lens: list[int]) -> list:
    """Each table's prefix rows as one flat int32 slot list (request by request): what the probe reads."""
    import torch

    return [torch.cat([pt[b, :n] for b, n in enumerate(lens)]).contiguous() for pt in tables]


def xor_rows(pool_words: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The probe's exact result on the host: the XOR of every 32-bit word of the rows, word-position by word
    position modulo 4 (a uint4's x, y, z, w). pool_words [slots, 288] uint32, rows [n] int."""
    return np.bitwise_xor.reduce(pool_words[rows].reshape(-1, 4), axis=0)


def cta_register_pool(threads: int) -> int:
    """The registers a block of `threads` threads launches with at one block an SM (__launch_bounds__(threads,
    1): a thread's share of SM_REGS rounded down to a multiple of 8): the pool setmaxnreg moves registers
    within, an .inc past it waiting for ever. 384 threads -> 64512, 512 -> all 65536."""
    return threads * (SM_REGS // threads // 8 * 8)


def blocks_per_sm(num_regs: int, threads: int, smem: int) -> int:
    """Blocks of `threads` threads, `num_regs` registers each and `smem` bytes an SM holds at once (registers
    are allocated per warp in units of 256)."""
    per_warp = -(-num_regs * 32 // 256) * 256
    fit = [SM_THREADS // threads, SM_REGS // (per_warp * (threads // 32))]
    if smem:
        fit.append(SM_SMEM // (smem + 1024))  # + the 1 KB the runtime reserves per block
    return max(1, min(fit))


def gather(pool, rows, arm: str, out=None):
    """Launch the probe's `arm` (`ARMS`) over `rows` ([n] int32) of `pool` ([slots, 576] bf16), both torch
    CUDA tensors, on as many blocks as the SMs hold at once; -> out [4] uint32 (CuPy; zeroed first when
    made here)."""
    import cupy
    import torch

    pw = loader.as_cupy(pool.view(torch.int32)).view(cupy.uint32)  # [slots, 288] words
    rw = loader.as_cupy(rows)
    if out is None:
        out = cupy.zeros(4, dtype=cupy.uint32)
    fn = loader.get_function(SOURCE, f"gather_read_v1_{arm}")
    smem = BULK_SMEM if arm == "bulk" else 0
    loader.set_max_dynamic_shared(fn, smem)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    grid = sms * blocks_per_sm(fn.num_regs, BLOCK[arm], smem)
    fn((grid,), (BLOCK[arm],), (pw, rw, np.int64(rw.size), out), shared_mem=smem)
    return out


def _verify_launch(x: dict, pool, h: int, tables: list):
    """One callable per table: the whole default-version verify of point inputs x on a workspace."""
    from kdlib.cuda import attention as cu

    call = attention.verify_call(x, pool, cu.make_workspace(len(x["lens"]), x["q"].shape[1], h))
    call(tables[0])
    return [lambda pt=pt: call(pt) for pt in tables]


def _profiled(launches, iters: int) -> dict:
    """Graph replays of `launches` timed, then one profiled: median ms and device us per kernel."""
    graphs, stream = timing.cupy_graphs(launches, torch_stream=True)
    t = timing.replay_time(graphs, stream, iters=iters)
    with stream:
        prof = profile.device_profile(lambda: graphs[0].launch(stream=stream), steps=3)
    return {"timing": t.as_dict(),
            "kernels": [{"name": n, "calls": c, "us": us} for n, c, us in prof["kernels"]]}


def attend_us(kernels: list[dict]) -> float:
    """Device us of the attend kernels in a `_profiled` kernel list."""
    return sum(k["us"] for k in kernels if "attend" in k["name"])


def probe(x: dict, pool, h: int, tables: list, options: str, iters: int) -> dict:
    """`_profiled` of the verify with its kernels built with `options` (a TV7_PROBE build: only the attend
    kernel changes; its outputs are not the verify's)."""
    with loader.extra_options(options):
        got = _profiled(_verify_launch(x, pool, h, tables), iters)
    return {**got, "options": options, "attend_us": attend_us(got["kernels"])}


def staged_bytes(heads: int, queries: int, lens: list[int]) -> int:
    """Bytes the attend kernel's producer gathers: every prefix row once per row block of its request."""
    return math.ceil(heads * queries / ROW_BLOCK) * sum(lens) * ROW_BYTES


def padded_flops(heads: int, queries: int, lens: list[int]) -> float:
    """FLOPs of the prefix as the wgmma kernels execute it: H x Q rows rounded up to jobs of ROW_BLOCK."""
    rows = math.ceil(heads * queries / ROW_BLOCK) * ROW_BLOCK
    return sum(2.0 * rows * s * (attention.D_QK + attention.D_V) for s in lens)


def run_point(p: dict, pool, ceil: dict, copy_Bps: float, iters: int) -> dict:
    import cupy
    import torch

    from kdlib.cuda import attention as cu

    h, nq = p["heads"], p["queries"]
    x = attention.point_inputs(p, pool)
    lens, c = x["lens"], x["cost"]
    scattered = x["tables"]
    seq = sequential_tables(scattered, lens)
    row = {**p, "bytes": c["bytes"], "flops": c["flops"], "rotations": len(scattered),
           "gathered_bytes": sum(lens) * ROW_BYTES}
    row["verify"] = {"scattered": _profiled(_verify_launch(x, pool, h, scattered), iters),
                     "sequential": _profiled(_verify_launch(x, pool, h, seq), iters)}
    pool_words = None
    row["gather"] = {}
    for kind, tabs in (("scattered", scattered), ("sequential", seq)):
        flat = gather_rows(tabs, lens)
        want = None
        arms = {}
        for arm in ARMS:
            got = gather(pool, flat[0], arm)
            if want is None:  # the exact XOR of the rows, once per table kind
                if pool_words is None:  # [slots, 288] uint32
                    pool_words = pool.view(torch.int32).cpu().numpy().view(np.uint32)
                want = xor_rows(pool_words, flat[0].cpu().numpy())
            exact = bool(np.array_equal(cupy.asnumpy(got), want))
            sink = cupy.zeros(4, dtype=cupy.uint32)
            t = base.graph_time([lambda f=f, a=arm, o=sink: gather(pool, f, a, o) for f in flat], iters)
            nbytes = flat[0].numel() * (ROW_BYTES + 4)  # rows + their slot indices
            arms[arm] = {"timing": t.as_dict(), "bytes": nbytes, "exact": exact,
                             "Bps": nbytes / (t.median_ms * 1e-3),
                             "fraction_of_copy": nbytes / (t.median_ms * 1e-3) / copy_Bps}
        best = max(arms, key=lambda k: arms[k]["Bps"])
        row["gather"][kind] = {"arms": arms, "best": best, "best_Bps": arms[best]["Bps"]}
    v_ms = row["verify"]["scattered"]["timing"]["median_ms"]
    gather_Bps = row["gather"]["scattered"]["best_Bps"]
    executed = padded_flops(h, nq, lens)
    row["floors_ms"] = {
        "copy": c["bytes"] / copy_Bps * 1e3,
        "gather": c["bytes"] / gather_Bps * 1e3,
        "flops": c["flops"] / ceil["flop_rate"] * 1e3,
        "padded_flops": executed / ceil["flop_rate"] * 1e3,
    }
    row["padded_flops"] = executed
    row["fraction_of_copy"] = row["floors_ms"]["copy"] / v_ms
    row["fraction_of_gather"] = row["floors_ms"]["gather"] / v_ms
    row["attend_us"] = attend_us(row["verify"]["scattered"]["kernels"])
    if cu.v9_options(h * nq) is None:  # v7's consumers, the ones the probes build
        row["probes"] = {name: probe(x, pool, h, scattered, opts, iters) for name, opts in PROBES.items()}
        row["staged_bytes"] = staged_bytes(h, nq, lens)
        g_us, c_us, no_pv, no_s = (row["probes"][k]["attend_us"] for k in PROBES)
        staged_tbs = row["staged_bytes"] / (g_us * 1e-6) / 1e12
        print(f"[attention_bounds] H{h} Q{nq} S{p['prefix']} B{p['batch']} probes: attend "
              f"{row['attend_us']:.1f} us, gathers alone {g_us:.1f} us ({staged_tbs:.2f} TB/s staged), "
              f"consumers alone {c_us:.1f} us (without P V {no_pv:.1f}, without S {no_s:.1f})", flush=True)
    print(f"[attention_bounds] H{h} Q{nq} S{p['prefix']} B{p['batch']}: verify {v_ms:.4f} ms (sequential "
          f"{row['verify']['sequential']['timing']['median_ms']:.4f}), attend {row['attend_us']:.1f} us | "
          f"floors copy {row['floors_ms']['copy']:.4f} gather {row['floors_ms']['gather']:.4f} padded "
          f"{row['floors_ms']['padded_flops']:.4f} | gather {gather_Bps / 1e12:.2f} TB/s "
          f"({gather_Bps / copy_Bps:.0%} of copy), sequential "
          f"{row['gather']['sequential']['best_Bps'] / 1e12:.2f}", flush=True)
    return row


def run(*, quick: bool = False) -> dict:
    """The suite (see the module docstring); quick: the first two points, 10 replays (else 20)."""
    import torch

    from kdlib.cuda import attention as cu

    pts = POINTS[:2] if quick else POINTS
    iters = 10 if quick else 20
    ceil = results.ceilings().as_dict()
    copy = timing.copy_bandwidth()
    pool = torch.randn(attention.pool_rows(pts), attention.D_QK, device="cuda",
                       dtype=torch.bfloat16)  # [N, 576] KV rows
    clocks_before = timing.clocks()
    rows = [run_point(p, pool, ceil, copy["Bps"], iters) for p in pts]
    return {
        "parameters": {"quick": quick, "points": pts, "iters": iters, "version": cu.DEFAULT_VERSION,
                       "pdl": cu.PDL, "gather_arms": list(ARMS), "block": BLOCK, "bulk_smem": BULK_SMEM,
                       "dtype": "bfloat16", "page_size": 1},
        "ceilings": ceil,
        "copy": copy,
        "clocks_before": clocks_before,
        "clocks_after": timing.clocks(),
        "points": rows,
        "notes": [
            "verify: the whole verify (plan, attend, combine) of the default version, CUDA-graph replays",
            "gather: bytes = the prefix rows (1152 B) + their int32 slots, read once; exact = the probe's "
            "XOR equals the host's",
            "floors_ms: the point's bytes (attention suite's cost) over the copy rate and over the best "
            "scattered gather rate; its FLOPs and the padded FLOPs over the recorded bf16 matmul rate",
            "probes: the verify with the attend kernel built -DTV7_PROBE=1 (gathers alone), =2 (consumers "
            "alone, over the rows of each stage's first fill), =3 (2 without the P V MMAs), =4 (2 without "
            "the S MMAs), profiled as verify; attend_us: its attend kernel's device us; staged_bytes: the "
            "rows gathered into the stages (each row once per row block of its request)",
            "pdl: version 10 launched its attend and combine kernels with programmatic dependent launch; "
            "each then starts while the kernel ahead runs; its device us include its wait for that kernel",
        ],
    }
