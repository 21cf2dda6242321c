"""Where a pair of tiles spends its cycles in the tree verify's attend kernel (issue 19), in SM clocks.

`python3 -m kdlib.perf.run --suite attention_timeline [--quick]`. At each point of `POINTS` (the attention
suite's goal points run by v7's consumers: the two compute-bound ones, then the two of 8 heads x 9 queries)
the default version's verify runs twice from the same inputs, built as it ships and built with `-DTV_TRACE=1`
(tree_verify/wgmma_ws.cuh): there lane 0 of each warp of each consumer warpgroup stamps its SM's clock at nine
points of each of its first pairs (`EVENTS`), into the module's `tv_trace`. Warp 0's stamps (thread 0's) give
the segments, the period and the sample; the four warps' together give the spread. Recorded per point:

  * `bitwise_equal`: the traced build's output and lse against the shipped build's (stamps change no math);
  * `timing`: both builds' whole verify, CUDA-graph replays, so that what the stamps cost is on record;
  * `segments`: per consumer, the median cycles of each stretch between two of its stamps (`SEGMENTS`) over
    the steady pairs (`steady`: past each CTA's first two, neither a job's first pair nor its last), which
    tile the consumer's loop from one pair's top to the next;
  * `period`: consumer 0's cycles from one pair's top to the next (median, p10, p90), against `floor_cycles`,
    the pair's MMAs at the tensor cores' dense bf16 rate per SM clock (`TENSOR_FLOPS_PER_CLOCK`);
  * `sample`: CTA 0's first `SAMPLE_PAIRS` pairs, every stamp in cycles from the first: the plot's timeline;
  * `warp_spread`: per consumer and event, the cycles between the first and the last of its four warps to
    stamp it (median and p90 over the steady pairs): whether a warpgroup's warps pass each point together.
"""

from __future__ import annotations

import numpy as np

from kdlib.cuda import loader
from kdlib.perf import timing
from kdlib.perf.suites import _attention as base
from kdlib.perf.suites import attention

POINTS = [
    {"heads": 8, "queries": 65, "prefix": 200_000, "batch": 1},
    {"heads": 64, "queries": 65, "prefix": 32_768, "batch": 1},
    # the memory goal's points run by v7's consumers: how long the consumers wait there for the gathers
    {"heads": 8, "queries": 9, "prefix": 200_000, "batch": 1},
    {"heads": 8, "queries": 9, "prefix": 32_768, "batch": 8},
]
TRACE = "-DTV_TRACE=1"
STEM = "tree_verify/wgmma_v10"  # the file the default version's kernels come from
_C = loader.source_constants(STEM)
CTAS, WARPS, PAIRS, NEVENTS, SLOTS = (_C[k] for k in ("TRACE_CTAS", "TRACE_WARPS", "TRACE_PAIRS",
                                                      "TRACE_EVENTS", "TRACE_SLOTS"))
D_FIRST, D_LAST = _C["D_FIRST"], _C["D_LAST"]
# the stamps of each consumer, in the order tree_verify/wgmma_v7.cu makes them (trace_mark's event index)
EVENTS = {
    0: ("top", "S issued", "S done", "P_A handed off", "P_A V_L done", "c_B read", "P_B read", "P_B V_L done",
        "job end done"),
    1: ("top", "S issued", "S done", "c_A read", "c_B handed off", "P_B handed off", "P_A V_R done",
        "P_B V_R done", "job end done"),
}
# stretch name -> (from event, to event; None: the next pair's top), per consumer
SEGMENTS = {
    0: {"stage wait + S issue": (0, 1), "S MMAs": (1, 2), "mask, softmax A, P_A out": (2, 3),
        "P_A V_L": (3, 4), "wait for c_B": (4, 5), "rescale, wait for P_B": (5, 6), "P_B V_L": (6, 7),
        "job end": (7, 8), "to the next pair": (8, None)},
    1: {"stage wait + S issue": (0, 1), "S MMAs": (1, 2), "mask, wait for c_A": (2, 3),
        "rescale, P_A V_R issue, softmax B": (3, 4), "P_B out": (4, 5), "P_A V_R wait": (5, 6),
        "rescale, P_B V_R": (6, 7), "job end": (7, 8), "to the next pair": (8, None)},
}
# what each stretch is, for the plots: the S MMAs (with the waits for their stage), softmax work, P V MMAs, a
# wait on the other consumer, the loop's own end
KIND = {"stage wait + S issue": "S", "S MMAs": "S", "mask, softmax A, P_A out": "softmax", "P_A V_L": "P V",
        "wait for c_B": "wait", "rescale, wait for P_B": "wait", "P_B V_L": "P V", "job end": "loop",
        "to the next pair": "loop", "mask, wait for c_A": "wait",
        "rescale, P_A V_R issue, softmax B": "softmax", "P_B out": "softmax", "P_A V_R wait": "P V",
        "rescale, P_B V_R": "P V"}
# dense bf16 tensor-core FLOPs per SM clock on sm_90: 989.4 TFLOP/s at 1,830 MHz over 132 SMs (NVIDIA H100
# SXM datasheet; the H200 has the same SMs); FlashMLA's deep-dive puts ~865 TFLOP/s at ~1,600 MHz: the same
TENSOR_FLOPS_PER_CLOCK = 4096
# shared memory's bytes per SM clock: 32 banks of 4 bytes, one access each a clock
SMEM_BYTES_PER_CLOCK = 32 * 4
SAMPLE_PAIRS = 6


def pair_flops() -> int:
    """FLOPs of one pair of tiles: two tiles of BM rows x BN keys, S over 576 dims and P V over 512."""
    return 2 * 2 * _C["BM"] * _C["BN"] * (_C["D_QK"] + _C["D_V"])


def floor_cycles() -> float:
    """SM clocks of one pair's MMAs at the tensor cores' dense rate (`TENSOR_FLOPS_PER_CLOCK`)."""
    return pair_flops() / TENSOR_FLOPS_PER_CLOCK


def pair_smem_bytes() -> dict[str, int]:
    """A model, not a measurement: the shared-memory bytes one pair of tiles moves if each wgmma reads each
    of its shared-memory operands once. S: per consumer D_QK / 16 m64n64k16 wgmmas, Q's and its tile's 16
    columns each; P V: per tile and V half BN / 16 m64n256k16 wgmmas, P's 16 keys and V's 16 rows of 256
    columns; the producer's gathers of both tiles; both consumers' P stores in bf16."""
    bm, bn, dqk, dv = _C["BM"], _C["BN"], _C["D_QK"], _C["D_V"]
    return {"S operands": 2 * (dqk // 16) * (bm * 16 + bn * 16) * 2,
            "P V operands": 2 * 2 * (bn // 16) * (bm * 16 + 16 * dv // 2) * 2,
            "gathers": 2 * bn * dqk * 2,
            "P stores": 2 * bm * bn * 2}


def smem_cycles() -> float:
    """SM clocks of `pair_smem_bytes` at `SMEM_BYTES_PER_CLOCK`: the pair's floor where shared memory, not
    the tensor cores, is what runs out (the model's, as pair_smem_bytes says)."""
    return sum(pair_smem_bytes().values()) / SMEM_BYTES_PER_CLOCK


def pair_mask(trace: np.ndarray) -> np.ndarray:
    """[CTAS, 2, PAIRS] bool: the pairs that ran to their last stamp and whose next pair's top is stamped."""
    ran = (trace[..., 0] > 0) & (trace[..., NEVENTS - 1] > 0)
    nxt = np.zeros_like(ran)
    nxt[..., :-1] = trace[..., 1:, 0] > 0
    return ran & nxt


def steady(trace: np.ndarray) -> np.ndarray:
    """[CTAS, 2, PAIRS] bool: `pair_mask` pairs past each CTA's first two that neither start nor end a job."""
    flags = trace[..., NEVENTS + 1].astype(np.int64)
    keep = pair_mask(trace) & ((flags & (D_FIRST | D_LAST)) == 0)
    keep[..., :2] = False
    return keep


def stretches(trace: np.ndarray, c: int) -> dict[str, np.ndarray]:
    """Consumer c's cycles in each stretch of `SEGMENTS[c]`, [CTAS, PAIRS] int64 each (garbage where no
    pair ran: mask with `steady`)."""
    t = trace[:, c].astype(np.int64)  # [CTAS, PAIRS, SLOTS]
    nxt_top = np.zeros_like(t[..., 0])
    nxt_top[:, :-1] = t[:, 1:, 0]
    return {name: (nxt_top if b is None else t[..., b]) - t[..., a] for name, (a, b) in SEGMENTS[c].items()}


def summarize(trace: np.ndarray) -> dict:
    """The `segments` and `period` of one traced run (trace [CTAS, 2, PAIRS, SLOTS] uint64, zero where
    unstamped); ValueError where no CTA has a steady pair in both consumers."""
    keep = steady(trace)
    both = keep[:, 0] & keep[:, 1]
    if not both.any():
        raise ValueError("no steady pair in the trace: a point of too few pairs a job")
    segs = {}
    for c in (0, 1):
        parts = stretches(trace, c)
        segs[f"consumer {c}"] = {name: float(np.median(v[both])) for name, v in parts.items()}
    t0 = trace[:, 0, :, 0].astype(np.int64)
    period = np.zeros_like(t0)
    period[:, :-1] = t0[:, 1:] - t0[:, :-1]
    per = period[both]
    return {"segments": segs, "steady_pairs": int(both.sum()),
            "period": {"median": float(np.median(per)), "p10": float(np.percentile(per, 10)),
                       "p90": float(np.percentile(per, 90))},
            "floor_cycles": floor_cycles(), "floor_fraction": floor_cycles() / float(np.median(per))}


def sample(trace: np.ndarray, cta: int = 0) -> dict:
    """CTA `cta`'s first SAMPLE_PAIRS pairs: per consumer, per pair, its stamps in cycles from the CTA's
    first."""
    t = trace[cta, :, :SAMPLE_PAIRS, :NEVENTS].astype(np.int64) - int(trace[cta, :, 0, 0].min())
    return {f"consumer {c}": [[int(v) for v in t[c, n]] for n in range(SAMPLE_PAIRS)] for c in (0, 1)}


def warp_spread(trace: np.ndarray) -> dict:
    """Per consumer and event, the cycles from the first to the last of the consumer's warps to stamp it,
    median and p90 over the steady pairs of warp 0's trace where every warp stamped (trace [CTAS, 2, WARPS,
    PAIRS, SLOTS] uint64, zero where unstamped)."""
    keep = steady(trace[:, :, 0])
    both = keep[:, 0] & keep[:, 1]  # [CTAS, PAIRS]
    out = {}
    for c in (0, 1):
        t = trace[:, c, :, :, :NEVENTS].astype(np.int64)  # [CTAS, WARPS, PAIRS, NEVENTS]
        stamped = (t > 0).all(axis=(1, 3)) & both
        if not stamped.any():
            raise ValueError(f"consumer {c}: no steady pair that all {WARPS} warps stamped")
        spread = (t.max(axis=1) - t.min(axis=1))[stamped]  # [pairs, NEVENTS]
        out[f"consumer {c}"] = {name: {"median": float(np.median(spread[:, e])),
                                       "p90": float(np.percentile(spread[:, e], 90))}
                                for e, name in enumerate(EVENTS[c])}
    return out


def read_trace(options: tuple[str, ...]):
    """The traced module's `tv_trace`, a CuPy view [CTAS, 2, WARPS, PAIRS, SLOTS] uint64 (zero it to
    reset)."""
    import cupy

    mod = loader.get_module(STEM, options=options)
    return cupy.ndarray((CTAS, 2, WARPS, PAIRS, SLOTS), dtype=cupy.uint64, memptr=mod.get_global("tv_trace"))


def run_point(p: dict, pool, iters: int) -> dict:
    import cupy

    from kdlib.cuda import attention as cu

    h, nq = p["heads"], p["queries"]
    if cu.v9_options(h * nq) is not None:
        raise ValueError(f"{p}: run by v9's consumers, which carry no trace")
    x = attention.point_inputs(p, pool)
    launch = cu.LAUNCHES[cu.DEFAULT_VERSION]
    assert launch.stem == STEM, "the trace's constants come from the default version's file"
    row = {**p, "version": cu.DEFAULT_VERSION, "timing": {}}
    outs = {}
    for build, extra in (("shipped", ""), ("traced", TRACE)):
        with loader.extra_options(extra):
            call = attention.verify_call(x, pool, cu.make_workspace(len(x["lens"]), nq, h))
            out, lse = call(x["tables"][0])
            outs[build] = (out.copy(), lse.copy())
            row["timing"][build] = base.graph_time(
                [lambda pt=pt, call=call: call(pt) for pt in x["tables"]], iters).as_dict()
            if extra:
                trace = read_trace(launch.options)
                trace.fill(0)
                call(x["tables"][0])
                cupy.cuda.runtime.deviceSynchronize()
                host = cupy.asnumpy(trace)
    row["bitwise_equal"] = all(bool(cupy.array_equal(a, b)) for a, b in zip(*outs.values(), strict=True))
    row["trace_cost"] = row["timing"]["traced"]["median_ms"] / row["timing"]["shipped"]["median_ms"]
    row |= summarize(host[:, :, 0])
    row["sample"] = sample(host[:, :, 0])
    row["warp_spread"] = warp_spread(host)
    c0 = row["segments"]["consumer 0"]
    ws = {c: row["warp_spread"][f"consumer {c}"] for c in (0, 1)}
    print(f"[attention_timeline] H{h} Q{nq} S{p['prefix']} B{p['batch']}: pair {row['period']['median']:.0f} "
          f"cycles (floor {row['floor_cycles']:.0f}, {row['floor_fraction']:.0%}) over {row['steady_pairs']} "
          f"pairs; consumer 0: " + ", ".join(f"{k} {v:.0f}" for k, v in c0.items())
          + f" | warps' spread at the top {ws[0]['top']['median']:.0f} / {ws[1]['top']['median']:.0f}, "
          f"S issued {ws[0]['S issued']['median']:.0f} / {ws[1]['S issued']['median']:.0f}"
          + f" | traced / shipped {row['trace_cost']:.3f}, bit-equal {row['bitwise_equal']}", flush=True)
    return row


def run(*, quick: bool = False) -> dict:
    """The suite (see the module docstring); quick: the first point, 10 replays (else 20)."""
    import torch

    pts = POINTS[:1] if quick else POINTS
    iters = 10 if quick else 20
    pool = torch.randn(attention.pool_rows(pts), attention.D_QK, device="cuda",
                       dtype=torch.bfloat16)  # [N, 576] KV rows
    clocks_before = timing.clocks()
    rows = [run_point(p, pool, iters) for p in pts]
    return {
        "parameters": {"quick": quick, "points": pts, "iters": iters, "trace": TRACE,
                       "trace_pairs": PAIRS, "trace_warps": WARPS,
                       "tensor_flops_per_clock": TENSOR_FLOPS_PER_CLOCK,
                       "pair_flops": pair_flops(),
                       "events": {f"consumer {c}": list(e) for c, e in EVENTS.items()},
                       "segments": {f"consumer {c}": {k: list(v) for k, v in s.items()}
                                    for c, s in SEGMENTS.items()},
                       "dtype": "bfloat16", "page_size": 1},
        "clocks_before": clocks_before,
        "clocks_after": timing.clocks(),
        "rows": rows,
        "notes": [
            "cycles: the SM clock (%clock64) as lane 0 of each consumer warp read it; segments, period and "
            "sample from warp 0's (thread 0's), warp_spread from all four; the CTA's warps read one counter",
            "segments: median over the steady pairs of CTAs where both consumers have one (past the CTA's "
            "first two pairs, neither a job's first nor its last); they tile one pair's loop, top to top",
            "floor_cycles: a pair's MMA FLOPs (pair_flops) over tensor_flops_per_clock",
        ],
    }
