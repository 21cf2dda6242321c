"""What bandwidth can a W4A16 MoE layer call reach at all, at its size? Streaming-read ceilings
(`kernels/stream_read/v1.cu`) and the two launches of `moe_w4a16` version 2 timed apart, all
replayed from CUDA graphs, on one GPU.

Sizes: the touched experts' INT4 weight + scale bytes of one layer call at M = 1 ... 64 tokens
(Kimi-K2 experts at the TP8 shard, top-8 of 384, uniform routing: the expected touched count),
plus 1 GiB.

- stream: one launch reads that many bytes; every warp streams a contiguous range through a
  cp.async ring (the MoE kernels' pattern, no math). Configurations: bytes per warp and stage
  (512 B x vec), ring depth (stages), warps per SM (one block per SM), and the blockwise order
  (a block's warps read adjacent units). `two_launch`: the same bytes as two dependent launches
  of 2/3 and 1/3 (the gate/up + down split), so the cost of the launch boundary shows.
- moe_v2: graph replay of `launch_v2_gate_up` alone, `launch_v2_down` alone and both, each as
  a fraction of copy bandwidth over its own weight bytes (2/3 and 1/3 of the layer's); `v3`:
  version 3's single launch over the same routings (`v3`: its default K split and down batch;
  `v3_parts`: every K split it accepts; `v3_down_batch`: down batches of 4 ... 64 row tiles).
Each timed replay reads a different region (8 rotations, together larger than L2), so the
numbers are cold-weight numbers. The copy bandwidth is measured in the same run (1 GiB
device-to-device copy, read + write counted), as in the moe suite.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from kdlib.cuda import moe
from kdlib.cuda.loader import get_function, set_max_dynamic_shared
from kdlib.perf import timing
from kdlib.perf.suites import moe as moe_suite

SOURCE = "stream_read/v1"  # kernels/stream_read/v1.cu
STEM = "stream_read_v1"  # its kernels' name prefix
M_SIZES = (1, 2, 4, 8, 16, 32, 64)
ROTATIONS = 8
# (kernel suffix, stages, vec, blockwise, warps per SM to try)
CONFIGS = (
    ("s8_v1", 8, 1, False, (8, 16, 32)),
    ("s4_v2", 4, 2, False, (8, 16, 32)),
    ("s8_v2", 8, 2, False, (16,)),
    ("s4_v4", 4, 4, False, (16,)),
    ("s8_v1_b", 8, 1, True, (16,)),
    ("s4_v2_b", 4, 2, True, (16,)),
)


def _replay(launches_per_rotation, iters: int) -> dict:
    """CUDA-graph replays, one graph per rotation (an error dict where capture fails)."""
    return timing.graph_record(launches_per_rotation, iters=iters, warmup=len(launches_per_rotation), warm=0)


def _stream_rows(cp, pool, sizes: dict, bw: float, sms: int, iters: int) -> list[dict]:
    sink = cp.zeros(sms * 1024 * 4, dtype=cp.uint32)
    pool_units = pool.size * 4 // 512                     # pool of uint32 words, units of 512 B
    rows = []
    for suffix, stages, vec, blockwise, warp_list in CONFIGS:
        fn = get_function(SOURCE, f"{STEM}_{suffix}")
        unit = 512 * vec
        for warps in warp_list:
            dyn = warps * stages * unit
            set_max_dynamic_shared(fn, dyn)
            for label, nbytes in sizes.items():
                n_units = max(1, int(nbytes // unit))
                span = max(n_units * unit, 64 << 20) // 512     # rotation stride, in 512 B units
                starts = [(r * span) % (pool_units - n_units * vec) for r in range(ROTATIONS)]

                def read(start, n, fn=fn, warps=warps, dyn=dyn):
                    fn((sms,), (32 * warps,), (pool[start * 128:], np.int64(n), sink), shared_mem=dyn)

                def two(start, n=n_units, vec=vec, read=read):
                    n1 = 2 * n // 3
                    read(start, n1)
                    read(start + n1 * vec, n - n1)

                t = _replay([partial(read, s, n_units) for s in starts], iters)
                row = {
                    "config": suffix,
                    "stages": stages,
                    "unit_bytes": unit,
                    "blockwise": blockwise,
                    "warps_per_sm": warps,
                    "size": label,
                    "bytes": n_units * unit,
                    "timing": t,
                    "frac_copy_bw": n_units * unit / (t["median_ms"] * 1e-3) / bw
                    if "median_ms" in t
                    else None,
                }
                if suffix == "s8_v1" and warps == 16:
                    t2 = _replay([partial(two, s) for s in starts], iters)
                    row["two_launch"] = t2
                    row["two_launch_frac_copy_bw"] = (n_units * unit / (t2["median_ms"] * 1e-3) / bw
                                                      if "median_ms" in t2 else None)
                rows.append(row)
                print(f"[moe_stream] {suffix:8s} w{warps:2d} {label:>6s} {n_units * unit / 1e6:8.1f} MB "
                      f"{t.get('median_ms', float('nan')) * 1e3:8.1f} us  "
                      f"{row['frac_copy_bw'] or float('nan'):.0%}"
                      + (f"  two launches {row['two_launch_frac_copy_bw'] or float('nan'):.0%}"
                         if "two_launch" in row else ""), flush=True)
    return rows


def _moe_rows(cp, torch, bw: float, iters: int) -> list[dict]:
    E, K, N, TOPK = moe_suite.E, moe_suite.K, moe_suite.N, moe_suite.TOPK
    P, KC = N // 16, K // 64
    packed = {
        "w1": moe_suite.random_words(torch, cp, E * P * KC * 2 * 32 * 4).reshape(E, P, KC, 2, 32, 4),
        "s1": moe_suite.random_scales(torch, cp, E * P * KC * 2 * 16).reshape(E, P, KC, 2, 16),
        "w2": moe_suite.random_words(torch, cp, E * (K // 16) * (N // 64) * 32 * 4).reshape(
            E, K // 16, N // 64, 32, 4
        ),
        "s2": moe_suite.random_scales(torch, cp, E * (K // 16) * (N // 64) * 16).reshape(
            E, K // 16, N // 64, 16
        ),
    }
    rng = np.random.default_rng(0)
    rows = []
    for m in (1, 2, 4, 8, 16, 32):
        x = torch.randn(m, K, device="cuda").to(torch.bfloat16)                 # [M, K]
        xb = cp.from_dlpack(x.view(torch.int16)).view(cp.uint16)
        routes = [moe.prepare_routing(cp.asarray(i), cp.asarray(w), E)
                  for i, w in (moe_suite.routing(rng, m) for _ in range(ROTATIONS))]
        out = cp.empty((m, K), dtype=cp.float32)                                # [M, K]
        h = cp.empty((m * TOPK, N), dtype=cp.uint16)                            # [M*topk, N]
        touched = float(np.mean([r.n_active for r in routes]))
        wbytes = moe.layer_bytes_flops(m, touched, K, N, TOPK)["weight_bytes"]
        arms = {
            "gate_up": (
                [partial(moe.launch_v2_gate_up, xb, packed, r, out, h) for r in routes],
                wbytes * 2 / 3,
            ),
            "down": ([partial(moe.launch_v2_down, packed, r, out, h) for r in routes], wbytes / 3),
            "both": (
                [partial(moe.moe_w4a16, xb, packed, r, out=out, h=h, version=2) for r in routes],
                wbytes,
            ),
            "v3": ([partial(moe.moe_w4a16, xb, packed, r, out=out, h=h, version=3) for r in routes], wbytes),
        }
        row = {"m": m, "touched_experts": touched, "weight_bytes": wbytes}
        for name, (launches, nbytes) in arms.items():
            t = _replay(launches, iters)
            row[name] = t
            row[f"{name}_frac_copy_bw"] = nbytes / (t["median_ms"] * 1e-3) / bw if "median_ms" in t else None
        # v3 with every K split it accepts (the default is moe.v3_parts): where the split pays off.
        row["v3_parts"] = {}
        for d in [d for d in range(1, KC + 1) if KC % d == 0 and KC // d >= 4]:
            t = _replay([partial(moe.moe_w4a16, xb, packed, r, out=out, h=h, version=3, parts=d)
                                 for r in routes], iters)
            row["v3_parts"][str(d)] = {"timing": t, "frac_copy_bw": wbytes / (t["median_ms"] * 1e-3) / bw
                                       if "median_ms" in t else None}
        row["v3_down_batch"] = {}
        for d in (4, 8, 16, 28, 32, 64):
            t = _replay([partial(moe.moe_w4a16, xb, packed, r, out=out, h=h, version=3, down_batch=d)
                                 for r in routes], iters)
            row["v3_down_batch"][str(d)] = {"timing": t, "frac_copy_bw": wbytes / (t["median_ms"] * 1e-3) / bw
                                            if "median_ms" in t else None}
        rows.append(row)
        print(
            f"[moe_stream] v3 down_batch M={m:3d} "
            + "  ".join(
                f"{d}: {v['frac_copy_bw'] or float('nan'):.0%}" for d, v in row["v3_down_batch"].items()
            ),
            flush=True,
        )
        print(f"[moe_stream] v3 parts M={m:3d} " + "  ".join(
            f"{d}: {v['frac_copy_bw'] or float('nan'):.0%}" for d, v in row["v3_parts"].items()), flush=True)
        print(f"[moe_stream] moe v2 M={m:3d} " + "  ".join(
            f"{k} {row[k].get('median_ms', float('nan')) * 1e3:7.1f} us "
            f"({row[k + '_frac_copy_bw'] or float('nan'):.0%})"
            for k in arms), flush=True)
    return rows


def run(*, quick: bool = False) -> dict:
    """The suite on the CUDA device (see the module docstring); quick: 20 replays a point instead of 40."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the moe_stream suite needs a CUDA device (torch.cuda.is_available() is False)")
    import cupy as cp

    iters = 20 if quick else 40
    copy = timing.copy_bandwidth()
    bw = copy["Bps"]
    per_expert = moe.packed_bytes_per_expert(moe_suite.K, moe_suite.N)
    sizes = {f"M={m}": moe_suite.expected_touched(m) * per_expert for m in M_SIZES}
    sizes["1GiB"] = float(1 << 30)
    sms = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["multiProcessorCount"])
    pool = cp.from_dlpack(torch.randint(-(2**31), 2**31 - 1, (3 << 28,), dtype=torch.int32,
                                        device="cuda")).view(cp.uint32)      # 3 GiB of random words
    stream_rows = _stream_rows(cp, pool, sizes, bw, sms, iters)
    del pool
    moe_rows = _moe_rows(cp, torch, bw, iters)
    return {
        "params": {"m_sizes": list(M_SIZES), "rotations": ROTATIONS, "iters": iters, "sms": sms,
                   "configs": [{"kernel": f"{STEM}_{c[0]}", "stages": c[1], "unit_bytes": 512 * c[2],
                                "blockwise": c[3], "warps_per_sm": list(c[4])} for c in CONFIGS],
                   "timed": "CUDA graph replay, one graph per rotation, events around each replay"},
        "copy": copy,
        "copy_bandwidth_Bps": bw,
        "sizes": sizes,
        "stream": stream_rows,
        "moe_v2": moe_rows,
    }
