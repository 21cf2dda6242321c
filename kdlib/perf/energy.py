"""The GPU's energy under sustained load, through NVML (pynvml): `Meter` reads the energy counter, the SM
clock and the clock-event reasons of the CUDA device torch uses; `sustained` meters a timer's calls back to
back.
Where the power cap holds the clocks (within seconds of sustained load), a call takes about what its energy
allows, so the energy a call is what a steady stream of calls compares (tools/verify_energy.py,
tools/gather_pair.py, tools/gather_stage.py)."""

from __future__ import annotations

import time

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


def check_window(ap, seconds: float) -> None:
    """`ap.error` (one line) where an arm's --seconds a round is outside 0.2 to 20: NVML's energy counter
    needs a window, and a round past 20 s leaves too few."""
    if not 0.2 <= seconds <= 20:
        ap.error(f"--seconds {seconds}: take 0.2 to 20 (NVML's energy counter needs a window)")


def interleaved(arms: list[str], timed, rounds: int, seconds: float) -> dict[str, list[dict]]:
    """Each arm's `rounds` sustained records, the arms in turn from the r-th in round r. timed(arm, None):
    its calibration (a Timing of a few calls, `median_ms`); timed(arm, calls): `sustained` over that many
    calls, which each arm gets enough of for about `seconds` (at least 10)."""
    calls = {k: max(10, round(seconds * 1e3 / timed(k, None).median_ms)) for k in arms}
    got = {k: [] for k in arms}
    for r in range(rounds):
        for k in arms[r % len(arms):] + arms[:r % len(arms)]:
            got[k].append(timed(k, calls[k]))
    return got


def launch_rounds(launches: dict, meter: Meter, rounds: int, seconds: float) -> dict[str, list[dict]]:
    """`interleaved` over CuPy launches (arm -> a call of no arguments that launches it on the current
    stream), each arm's calls timed between CUDA events: its calibration 20 calls after 3, its rounds
    `sustained`."""
    from kdlib.perf import timing

    def timed(arm, calls):
        def timer(iters, warmup):
            return timing.cuda_time(launches[arm], warmup=warmup, iters=iters, backend="cupy")
        return timer(iters=20, warmup=3) if calls is None else sustained(timer, meter, calls)

    return interleaved(list(launches), timed, rounds, seconds)
