"""What compute-sanitizer racecheck reports on the synchronisation patterns of the wgmma tree-verify kernels
(tools/racecheck_patterns.cu), each alone in a small kernel: which correct patterns the tool sees as
ordered, and so which of its hazards on the real kernels are races and which are the tool's blind spots.

    python3 tools/racecheck_patterns.py all --out DIR     # each case under racecheck -> DIR/patterns.json
    python3 tools/racecheck_patterns.py run CASE          # one case, no sanitizer (what `all` runs)

A case is a kernel and a block size (256 threads: two warpgroups; 384: v7's three, the third idle). The
control, rc_no_barrier, is a real race: a run where racecheck does not report it is not evidence. So is
rc_lane0_release (lane 0 arrives for its warp with no __syncwarp first). Every other case is ordered by
the PTX memory model; `expected` says which. DIR/patterns.json: per case the
hazards racecheck counted, and `sees_order` (no hazard on a correct pattern, at least one on the control).
Exit code 0 when the control was caught, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from sanitize_attention import parse_log

from kdlib.cli import folder, make_folder, require_gpu
from kdlib.cuda import loader
from kdlib.files import atomic_write_text
from kdlib.perf.results import provenance

SOURCE = Path(__file__).with_suffix(".cu")
ROUNDS, THREADS_MAX = 8, 384  # the .cu's ROUNDS; the largest block a case uses
# name -> (kernel, threads, races): races True where the PTX memory model does not order the accesses (the
# control; lane 0 releasing the other lanes' stores with no __syncwarp)
CASES = {
    "no_barrier": ("rc_no_barrier", 256, True),
    "syncthreads": ("rc_syncthreads", 256, False),
    "named_handoff": ("rc_named_handoff", 256, False),
    "named_handoff_384": ("rc_named_handoff", 384, False),
    "named_handoff_back_384": ("rc_named_handoff_back", 384, False),
    "named_exchange": ("rc_named_exchange", 256, False),
    "named_exchange_384": ("rc_named_exchange", 384, False),
    "seesaw_quad": ("rc_seesaw_quad", 256, False),
    "seesaw_quad_384": ("rc_seesaw_quad", 384, False),
    "seesaw_one_384": ("rc_seesaw_one", 384, False),
    "seesaw_syncwarp_384": ("rc_seesaw_syncwarp", 384, False),
    "seesaw_two_barriers_384": ("rc_seesaw_two_barriers", 384, False),
    "seesaw_both_sync_384": ("rc_seesaw_both_sync", 384, False),
    "seesaw_all_sync_384": ("rc_seesaw_all_sync", 384, False),
    "seesaw_wg_sync_384": ("rc_seesaw_wg_sync", 384, False),
    "seesaw_wg_sync3_384": ("rc_seesaw_wg_sync3", 384, False),
    "seesaw_wg0_sync_384": ("rc_seesaw_wg0_sync", 384, False),
    "mbarrier": ("rc_mbarrier", 256, False),
    "cp_async": ("rc_cp_async", 256, False),
    "lane0_release": ("rc_lane0_release", 256, True),
    "lane0_release_syncwarp": ("rc_lane0_release_syncwarp", 256, False),
    "cdq_ring_async_384": ("rc_cdq_ring_async", 384, False),
    "cdq_ring_plain_384": ("rc_cdq_ring_plain", 384, False),
    "cdq_ring_wg1_sync_384": ("rc_cdq_ring_wg1_sync", 384, False),
    "cdq_ring_no_dq_384": ("rc_cdq_ring_no_dq", 384, False),
    "cdq_ring_no_ring_384": ("rc_cdq_ring_no_ring", 384, False),
    "cdq_ring_wg1_wait_384": ("rc_cdq_ring_wg1_wait", 384, False),
    "cdq_ring_one_writer_384": ("rc_cdq_ring_one_writer", 384, False),
    "cdq_pair_async_384": ("rc_cdq_pair_async", 384, False),
    "cdq_pair_plain_384": ("rc_cdq_pair_plain", 384, False),
    "cdq_pair_nodq_384": ("rc_cdq_pair_nodq", 384, False),
}
# the kernels that read src
SRC_KERNELS = {"rc_cp_async", "rc_lane0_release", "rc_lane0_release_syncwarp"} | {
    k for k, _, _ in CASES.values() if k.startswith("rc_cdq_")}


def run(names: list[str]) -> int:
    import cupy

    code = loader.expand_includes(SOURCE, loader.KERNELS)
    mod = cupy.RawModule(code=code, options=("--std=c++17", "-arch=sm_90a", "-lineinfo"))
    src = cupy.arange(ROUNDS * 128 * 4, dtype=cupy.float32)  # [ROUNDS * 128] float4
    for name in names:
        kernel, threads, _ = CASES[name]
        out = cupy.zeros(THREADS_MAX, dtype=cupy.float32)
        args = (src, out) if kernel in SRC_KERNELS else (out,)
        mod.get_function(kernel)((1,), (threads,), args)
        cupy.cuda.Device().synchronize()
        print(f"{name}: ran ({kernel}, {threads} threads)", flush=True)
    return 0


def sanitizer() -> str:
    """compute-sanitizer on PATH, else where CUDA installs it."""
    return shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"


def run_all(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    cases = {}
    for name, (kernel, threads, races) in CASES.items():
        cmd = [sanitizer(), "--tool", "racecheck", "--error-exitcode", "9", sys.executable, __file__,
               "run", name]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        log = proc.stdout + proc.stderr
        (out / f"{name}.log").write_text(log)
        hazards = parse_log(log, "racecheck")["errors"]
        ran = proc.returncode in (0, 9) and f"{name}: ran" in log  # 9: hazards found; else the case failed
        cases[name] = {"kernel": kernel, "threads": threads, "expected": "race" if races else "ordered",
                       "rc": proc.returncode, "ran": ran, "hazards": hazards,
                       "sees_order": None if hazards is None or not ran else (hazards > 0) == races}
        print(f"{name:22s} {cases[name]['expected']:8s} hazards {hazards}", flush=True)
    control = cases["no_barrier"]["hazards"]
    doc = {"provenance": provenance(), "sanitizer": sanitizer(), "cases": cases,
           "control_caught": bool(control), "all_ran": all(c["ran"] for c in cases.values())}
    atomic_write_text(out / "patterns.json", json.dumps(doc, indent=1) + "\n")
    return 0 if doc["control_caught"] and doc["all_ran"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run cases without a sanitizer")
    r.add_argument("case", nargs="+", help=f"one of {sorted(CASES)}")
    a = sub.add_parser("all", help="every case under racecheck -> OUT/patterns.json")
    a.add_argument("--out", type=folder, required=True)
    args = ap.parse_args(argv)
    require_gpu(ap)
    if args.cmd == "all" and not Path(sanitizer()).is_file():
        ap.error(f"compute-sanitizer not found (PATH, or {sanitizer()})")
    if args.cmd == "run":
        bad = [c for c in args.case if c not in CASES]
        if bad:
            print(f"unknown case {bad[0]!r}: one of {sorted(CASES)}", file=sys.stderr)
            return 2
        return run(args.case)
    return run_all(make_folder(ap, args.out))


if __name__ == "__main__":
    sys.exit(main())
