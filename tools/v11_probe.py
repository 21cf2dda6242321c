"""Version 11's cluster kernel at the 8 x 9 points, taken apart on the GPU machine (notebook 02b, 13u):

    KDLIB_COMMIT=<sha> python3 tools/v11_probe.py --out $OUT     -> $OUT/attention_v11_probe.<gpu>.json

* the two-CTA clusters of tree_verify_v11_attend the device holds at once (`loader.max_active_clusters`, at
  the kernel's shared memory), the persistent grid the wrapper launches;
* per point (8 heads x 9 queries over 200k for one request, over 32k for 8), for versions 10 and 11: each
  kernel's device time per verify (torch profiler, `--reps` eager calls on a workspace after warm-up) and
  the eager call's wall time (CUDA events over the same calls);
* version 11 with its grid forced to other cluster counts (`--clusters`: its plan made for that grid too),
  and each build switch of `--define` (NAME=VALUE: -DNAME=VALUE on the wrapper's build) at the device's count;
* each impl of `--also` timed the same way beside them (e.g. `--also wgmma_v12`: version 12's one-CTA kernel);
  `--define IMPL:NAME=VALUE` times that impl built with the switch instead of version 11 (e.g.
  `--define wgmma_v12:PLAN_SMALL_REQS=0`).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

from kdlib.cli import build_switch, folder, make_folder, positive_int, require_gpu
from kdlib.cuda import attention as cu
from kdlib.cuda import loader
from kdlib.perf import results

POINTS = {"8x9x200k": (1, 200_000), "8x9x32k_B8": (8, 32_768)}  # name -> (requests, prefix)


def problem(bsz: int, width: int, nq: int = 9, nh: int = 8) -> tuple:
    """tree_verify_attention's arguments: random bf16 rows, a scattered page table, full causal trees."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(bsz, nq, nh, cu.D_QK, device="cuda", generator=g).bfloat16()  # [B, Q, H, 576]
    kv = torch.randn(bsz * width, cu.D_QK, device="cuda", generator=g).bfloat16()  # [B*S, 576]
    pt = torch.randperm(bsz * width, device="cuda", generator=g).int().view(bsz, width)  # [B, S]
    tkv = torch.randn(bsz, nq, cu.D_QK, device="cuda", generator=g).bfloat16()  # [B, Q, 576]
    vis = torch.tril(torch.ones(nq, nq, dtype=torch.bool, device="cuda")).expand(bsz, nq, nq).contiguous()
    lens = torch.full((bsz,), width, dtype=torch.int32, device="cuda")  # [B]
    sizes = torch.full((bsz,), nq, dtype=torch.int32, device="cuda")  # [B]
    return q, kv, pt, lens, tkv, vis, sizes, cu.D_QK ** -0.5


def timed(args: tuple, impl: str, reps: int) -> dict:
    """{kernels_us: {kernel: device us a verify}, eager_us, jobs} of `reps` eager calls after three."""
    bsz, nq, nh = args[0].shape[:3]
    ws = cu.make_workspace(bsz, nq, nh)

    def call():
        cu.tree_verify_attention(*args, impl=impl, workspace=ws, validate=False)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    kernels = {e.key: e.device_time_total / reps for e in prof.key_averages() if e.device_time_total > 0}
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        call()
    t1.record()
    torch.cuda.synchronize()
    return {"kernels_us": kernels, "eager_us": t0.elapsed_time(t1) * 1e3 / reps,
            "jobs": int(ws.plan[0].get())}


def define_arm(define: str) -> tuple[str, str]:
    """A --define's (impl, NAME=VALUE): 'NAME=VALUE' is version 11's, 'IMPL:NAME=VALUE' that impl's."""
    impl, _, switch = define.rpartition(":")
    impl = impl or "wgmma_v11"
    try:
        build_switch(switch)
    except argparse.ArgumentTypeError:
        impl = None
    if cu.IMPLS.get(impl) is None:
        raise ValueError(f"--define takes NAME=VALUE or IMPL:NAME=VALUE (IMPL a kdlib.cuda.attention impl, "
                         f"e.g. wgmma_v12), got {define!r}")
    return impl, switch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=folder, help="folder of the record")
    ap.add_argument("--reps", type=positive_int, default=20)
    ap.add_argument("--clusters", type=positive_int, nargs="*", default=[33, 66],
                    help="forced cluster counts")
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=VALUE (version 11's) or IMPL:NAME=VALUE: a build switch's arm")
    ap.add_argument("--also", action="append", default=[], help="another impl timed beside (e.g. wgmma_v12)")
    a = ap.parse_args(argv)
    unknown = [impl for impl in a.also if cu.IMPLS.get(impl) is None]  # else a point ran, then this failed
    if unknown:
        ap.error(f"--also {unknown[0]}: not a kdlib.cuda.attention impl (e.g. wgmma_v12)")
    try:
        arms = [define_arm(d) for d in a.define]
    except ValueError as e:
        ap.error(str(e))
    require_gpu(ap)
    make_folder(ap, a.out)
    fn = loader.get_function(cu._V11, "tree_verify_v11_attend", options=cu.LAUNCHES[11].options)
    loader.set_max_dynamic_shared(fn, cu._V11_SMEM)
    resident = cu._resident_clusters(fn, cu._V7_THREADS, cu._V11_SMEM)  # the wrapper's grid
    doc = {"parameters": {"points": POINTS, "reps": a.reps, "heads": 8, "queries": 9, "smem": cu._V11_SMEM,
                          "clusters_forced": a.clusters, "defines": a.define, "also": a.also},
           "resident_clusters": resident, "points": {}}
    device_count = cu._resident_clusters
    for name, (bsz, width) in POINTS.items():
        args = problem(bsz, width)
        row = {"v10": timed(args, "wgmma_v10", a.reps), "v11": timed(args, "wgmma_v11", a.reps)}
        row.update({impl.removeprefix("wgmma_"): timed(args, impl, a.reps) for impl in a.also})
        for k in a.clusters:
            cu._resident_clusters = lambda *_, k=k: k  # the grid the wrapper launches and plans for
            row[f"v11 clusters {k}"] = timed(args, "wgmma_v11", a.reps)
        cu._resident_clusters = device_count
        for impl, d in arms:  # KDLIB_NVRTC_OPTIONS joins the module's cache key: a build of its own
            given = os.environ.get("KDLIB_NVRTC_OPTIONS")
            os.environ["KDLIB_NVRTC_OPTIONS"] = " ".join(filter(None, (given, f"-D{d}")))
            row[f"{impl.removeprefix('wgmma_')} -D{d}"] = timed(args, impl, a.reps)
            if given is None:  # the user's own options stay for the arms after
                del os.environ["KDLIB_NVRTC_OPTIONS"]
            else:
                os.environ["KDLIB_NVRTC_OPTIONS"] = given
        doc["points"][name] = row
        print(name, {k: round(v["eager_us"], 1) for k, v in row.items()}, flush=True)
    print(results.write("attention_v11_probe", doc, out_dir=a.out))


if __name__ == "__main__":
    main()
