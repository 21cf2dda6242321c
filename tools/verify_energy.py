"""Energy a verify under sustained load, beside FlashInfer's prefix (notebook 02b): at issue 19's two goal
points the attention suite's duel arms (our whole verify replayed from CUDA graphs; FlashInfer's
BatchMLAPagedAttentionWrapper over the prefix, eager and graph-replayed) run in interleaved rounds, each arm
for about --seconds a round, back to back. Per arm and round: the GPU's energy counter (NVML, mJ) over the
calls, their wall time, the mean power, the SM clock and NVML's clock-event reasons at the round's end (power
cap or not).

Where the power cap holds the clocks (within seconds of sustained load), a call takes about what its energy
allows, so the energy a call is what a steady stream of verifies compares.

On the GPU machine (FlashInfer from the carried site, as the levers script's duel step):
    KDLIB_COMMIT=<sha> PYTHONPATH=$PWD:/tmp/site python3 tools/verify_energy.py --out $OUT
        -> $OUT/verify_energy.<gpu>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from kdlib.cli import folder, make_folder, positive_int, require_gpu

SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


class Meter:
    """NVML's view of the CUDA device torch uses: energy since the driver loaded (J), SM clock (MHz), the
    clock-event reasons (a bit mask), the enforced power limit (W)."""

    def __init__(self):
        import pynvml
        import torch

        pynvml.nvmlInit()
        self.nv = pynvml
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.h = pynvml.nvmlDeviceGetHandleByPciBusId(
            f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0")
        self.limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(self.h) / 1e3
        self.reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons  # the older name

    def joules(self) -> float:
        return self.nv.nvmlDeviceGetTotalEnergyConsumption(self.h) / 1e3

    def state(self) -> dict:
        reasons = self.reasons(self.h)
        return {"sm_mhz": self.nv.nvmlDeviceGetClockInfo(self.h, self.nv.NVML_CLOCK_SM), "reasons": reasons,
                "power_capped": bool(reasons & SW_POWER_CAP)}


def sustained(timer, meter: Meter, calls: int) -> dict:
    """`calls` calls of an arm back to back (timer(iters=calls, warmup=0): each call between CUDA events)
    -> its median ms a call (events), wall ms a call, joules a call, mean watts, the GPU's state after."""
    import torch

    torch.cuda.synchronize()
    e0, t0 = meter.joules(), time.perf_counter()
    t = timer(iters=calls, warmup=0)
    torch.cuda.synchronize()
    e1, t1 = meter.joules(), time.perf_counter()
    return {"median_ms": t.median_ms, "wall_ms": (t1 - t0) * 1e3 / calls, "joules": (e1 - e0) / calls,
            "watts": (e1 - e0) / (t1 - t0), "calls": calls, **meter.state()}


def point_arms(p: dict, pool, kv_split, fi, impl: str | None) -> dict:
    """The duel's timers at point p: "verify" (the whole verify of `impl`, None: the default, graph replays
    over the rotated tables), "flashinfer" and "flashinfer_graph" (`_flashinfer_prefix`)."""
    from kdlib.cuda import attention as cu
    from kdlib.perf.suites import _attention as base
    from kdlib.perf.suites import attention as suite

    x = suite.point_inputs(p, pool)
    ws = cu.make_workspace(p["batch"], p["queries"], p["heads"])
    call = suite.verify_call(x, pool, ws, **({"impl": impl} if impl else {}))
    call(x["tables"][0], validate=True)
    timers = {"verify": base.graph_timer([lambda pt=pt: call(pt) for pt in x["tables"]])}
    _, _, fi_timers = suite._flashinfer_prefix(fi, x["q"], *kv_split, x["tables"], x["lens"], x["scale"], 20)
    return {**timers, **fi_timers, "_keep": (x, ws)}  # the graphs replay x's and ws's buffers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=folder, help="folder of the record")
    ap.add_argument("--rounds", type=positive_int, default=7)
    ap.add_argument("--seconds", type=float, default=2.0, help="an arm's calls a round, in seconds (about)")
    ap.add_argument("--impl", help="the verify arm's kdlib.cuda.attention impl (default: the default verify)")
    a = ap.parse_args(argv)
    if not 0.2 <= a.seconds <= 20:
        ap.error(f"--seconds {a.seconds}: take 0.2 to 20 (NVML's energy counter needs a window)")
    from kdlib.cuda import attention as cu

    if a.impl is not None and cu.IMPLS.get(a.impl) not in cu.WGMMA_VERSIONS:
        ap.error(f"--impl {a.impl}: not a whole-verify impl of kdlib.cuda.attention (e.g. wgmma_v13)")
    require_gpu(ap)
    from kdlib.perf.suites import attention as suite

    fi, why = suite._flashinfer()
    if fi is None:
        ap.error(f"{why} (put the carried site on PYTHONPATH)")
    make_folder(ap, a.out)
    import torch

    from kdlib.perf import results

    meter = Meter()
    pts = [{"heads": h, "queries": q, "prefix": s, "batch": b} for h, q, s, b in suite.GOAL_MS]
    pool = torch.randn(suite.pool_rows(pts), suite.D_QK, device="cuda",
                       dtype=torch.bfloat16)  # [N, 576] KV rows
    kv_split = (pool[:, :suite.D_V].contiguous().view(-1, 1, suite.D_V),
                pool[:, suite.D_V:].contiguous().view(-1, 1, suite.D_QK - suite.D_V))  # FlashInfer's caches
    rows = []
    for p in pts:
        arms = point_arms(p, pool, kv_split, fi, a.impl)
        names = [k for k in arms if not k.startswith("_")]
        calls = {k: max(10, round(a.seconds * 1e3 / arms[k](iters=20, warmup=3).median_ms)) for k in names}
        rounds = {k: [] for k in names}
        for r in range(a.rounds):  # the arms in turn from the r-th, as the suite's duel
            for k in names[r % len(names):] + names[:r % len(names)]:
                rounds[k].append(sustained(arms[k], meter, calls[k]))
        fi_best = [min(rounds[k][i]["joules"] for k in names if k != "verify") for i in range(a.rounds)]
        ratio = [v["joules"] / f for v, f in zip(rounds["verify"], fi_best, strict=True)]
        rows.append({**p, "rounds": rounds, "energy_ratio_to_flashinfer": ratio})
        print(f"[energy] H{p['heads']} Q{p['queries']} S{p['prefix']}: " + "; ".join(
            f"{k} {statistics.median(x['joules'] for x in v) * 1e3:.3f} mJ "
            f"{statistics.median(x['median_ms'] for x in v):.4f} ms "
            f"{statistics.median(x['sm_mhz'] for x in v):.0f} MHz" for k, v in rounds.items())
            + f"; verify / FlashInfer's least, median round {statistics.median(ratio):.4f}", flush=True)
        del arms
        torch.cuda.empty_cache()
    doc = {"parameters": {"points": pts, "rounds": a.rounds, "seconds": a.seconds, "impl": a.impl,
                          "power_limit_w": meter.limit_w}, "rows": rows}
    print(results.write("verify_energy", doc, out_dir=a.out, command=" ".join(["python3"] + sys.argv)))


if __name__ == "__main__":
    main()
