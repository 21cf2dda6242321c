"""Small tree-verify attention calls for compute-sanitizer, each checked against the float64 reference.

    python3 tools/sanitize_attention.py run --json CASES.json        # the driver (under a sanitizer)
    python3 tools/sanitize_attention.py summarize DIR                # DIR/<tool>.log + DIR/<tool>.json

`run` makes bf16 problems (Kimi-K2 rows: 576 wide, page_size 1, scattered slots, random trees) and calls
`kdlib.cuda.attention` on them: version 5 ("wgmma") at 8 heads x 9 and x 65 queries over a 1,000-token
prefix, the prefix alone, a call on a preallocated workspace, a ragged batch of 3 (prefixes 1,000 / 0 / 357,
trees of 1 / 33 / 65 rows); one version 3 ("mma_v3") call on the ragged batch; versions 6 ("wgmma_v6"), 7
("wgmma_v7") and 8 ("wgmma_v8") each on the workspace call, the ragged batch and a prefix alone at 8 x 9;
version 8 also where its combine takes 8 and 32 warps a row (8 x 1 over 5,000 keys for 3 requests, over
20,000 for one); version 9 ("wgmma_v9") where it runs its own attend kernel (8 heads x 1 and x 2 queries:
the workspace call, a ragged batch, a prefix alone); version 10 ("wgmma_v10", the bf16 default) on a batch
whose jobs its plan orders (16 requests of 8 x 65 rows), at 8 x 1 (one round: the static deal) and at 16 x
65 (1,040 rows: v8's combine a warp per row); its FP8 build ("v10 fp8": the pool packed by `fp8_pool`, the
reference on its dequantized rows) on the ordered batch, at 8 x 1, on the ragged batch of 3, for a prefix
alone and on 160 ragged requests at 8 x 2 (more jobs than SMs, so a CTA meets tree tails after other jobs'
pairs); the FP8 pool's other path ("v10 fp8 dequant-first": the gather into a bf16 pool, then the bf16
build) on the ragged batch of 3 and the ordered batch; version 11 ("wgmma_v11": its cluster kernel) and
version 12 ("wgmma_v12": v7's consumers with the rows past 64 in the producer) each at 8 x 9 on a workspace
call, a ragged batch of 3, the prefix alone and 80 requests; version 13 ("wgmma_v13": the combine folded
into cluster pairs) at 64 x 65 over 1,000 keys on a workspace call (the pairs merge), at 48 x 65 (a last row
block of 48 rows) and on a tree of 31 rows (version 10's path in the cluster kernel).
KDLIB_SANITIZE_CASES (a comma list of name prefixes, e.g. "v7") keeps some of them. Each output is
compared with `kdlib.ref.attention` on the same bf16 values (norm-relative error <= 1e-2, lse within
2e-3, padding rows NaN), so a clean sanitizer run is also a correct one. The kernels a case covers are
those the wrapper fetched from `kdlib.cuda.loader` while it ran (each is fetched right before its
launch). CuPy's memory pool is off (`--pool` keeps it), so every array is its own allocation and memcheck
sees an out-of-bounds access at its first byte; set PYTORCH_NO_CUDA_MEMORY_CACHING=1 for the torch inputs
(tools/sanitize_gpu.sh does).

`summarize` reads the compute-sanitizer logs and the driver's case files a run of
tools/sanitize_gpu.sh left in DIR and writes DIR/sanitize.json: per tool its exit code, the
sanitizer's error (and racecheck hazard) counts, whether every case passed, and the kernels covered.
Exit code 0 when every tool ran clean and every case passed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from kdlib.check import errors
from kdlib.cli import require_gpu
from kdlib.cuda import attention as cu
from kdlib.cuda import loader
from kdlib.files import atomic_write_text
from kdlib.perf.results import provenance
from kdlib.ref import attention as ref

RTOL = 1e-2  # bf16 operands, P rounded to bf16 before P.V (tests/test_cuda_attention.py: BF16_RTOL)
LSE_ATOL = 2e-3  # lse of fp32 S on bf16 inputs: only the summation order differs
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")  # what `summarize` looks for in DIR
SCALE = 576**-0.5
PREFIX_KEYS = ("q", "kv_cache", "page_table", "prefix_lens", "softmax_scale")  # prefix_attention's inputs
_ERRORS = re.compile(r"ERROR SUMMARY: (\d+) errors?\s*$", re.M)  # not "... errors were not printed"
_HAZARDS = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def problem(seed: int, nh: int, nq: int, lens: list[int], sizes: list[int]) -> dict:
    """A batched float64 problem: B = len(lens) requests, prefix b of lens[b] scattered slots, tree b of
    sizes[b] valid rows (random ancestors-and-self visibility)."""
    import torch

    from kdlib.perf.suites._attention import random_tree_visibility

    rng = np.random.default_rng(seed)
    bsz, width = len(lens), max(max(lens), 1)
    slots = 2 * width + 7
    vis = random_tree_visibility(torch, bsz, nq, torch.Generator().manual_seed(seed)).numpy()  # [B, Q, Q]
    return {
        "q": rng.standard_normal((bsz, nq, nh, cu.D_QK)),  # [B, Q, H, 576]
        "kv_cache": rng.standard_normal((slots, cu.D_QK)),  # [S, 576] latent + rope rows
        # [B, P]
        "page_table": np.stack([rng.permutation(slots)[:width] for _ in range(bsz)]).astype(np.int32),
        "prefix_lens": np.array(lens, dtype=np.int32),  # [B]
        "tree_kv": rng.standard_normal((bsz, nq, cu.D_QK)),  # [B, Q, 576]
        "visibility": vis,
        "tree_sizes": np.array(sizes, dtype=np.int32),  # [B]
        "softmax_scale": SCALE,
    }


def to_device(case: dict) -> tuple[dict, dict]:
    """(device inputs: bf16 torch tensors and int32 / bool CuPy arrays, the float64 values they hold)."""
    import cupy
    import ml_dtypes
    import torch

    dev, seen = {}, {}
    for k, v in case.items():
        if isinstance(v, np.ndarray) and v.dtype == np.float64:
            bits = v.astype(ml_dtypes.bfloat16)
            seen[k] = bits.astype(np.float64)
            dev[k] = torch.from_numpy(bits.view(np.int16).copy()).cuda().view(torch.bfloat16)
        else:
            seen[k] = v
            dev[k] = cupy.asarray(v) if isinstance(v, np.ndarray) else v
    return dev, seen


def compare(out, lse, ref_out, ref_lse) -> dict:
    """Norm-relative error of out, max |lse error| and the NaN (padding) pattern against the reference."""
    out, lse = out.get().astype(np.float64), lse.get().astype(np.float64)
    pad = np.isnan(ref_lse)
    keep = ~pad
    fin = keep & np.isfinite(ref_lse)
    e = errors(out[keep], ref_out[keep]) if keep.any() else {"norm_rel": 0.0, "nan": False}
    lse_err = float(np.abs(lse[fin] - ref_lse[fin]).max(initial=0.0))
    padding_ok = bool(np.array_equal(np.isnan(lse), pad) and np.isnan(out[pad]).all())
    ok = not e["nan"] and e["norm_rel"] <= RTOL and lse_err <= LSE_ATOL and padding_ok
    return {"norm_rel": float(e["norm_rel"]), "lse_max_abs": lse_err, "padding_rows_nan": padding_ok,
            "ok": ok}


def cases(only: str = "") -> list[dict]:
    """What `run` calls: name, problem shape, version, the call ('verify' or 'prefix'), workspace or not;
    only: a comma list of name prefixes to keep (env KDLIB_SANITIZE_CASES, e.g. "v6"), "" all."""
    ragged = {"nh": 8, "nq": 65, "lens": [1000, 0, 357], "sizes": [1, 33, 65]}
    keep = tuple(s.strip() for s in only.split(",") if s.strip())
    every = [
        {"name": "v5 verify 8x9x1000", "shape": {"nh": 8, "nq": 9, "lens": [1000], "sizes": [9]},
         "version": 5, "call": "verify", "workspace": False},
        {"name": "v5 verify 8x65x1000 (workspace)",
         "shape": {"nh": 8, "nq": 65, "lens": [1000], "sizes": [65]},
         "version": 5, "call": "verify", "workspace": True},
        {"name": "v5 prefix 8x65x1000", "shape": {"nh": 8, "nq": 65, "lens": [1000], "sizes": [65]},
         "version": 5, "call": "prefix", "workspace": False},
        {"name": "v5 verify ragged B3", "shape": ragged, "version": 5, "call": "verify", "workspace": False},
        {"name": "v3 verify ragged B3", "shape": ragged, "version": 3, "call": "verify", "workspace": False},
    ]
    for v in (6, 7, 8):  # the seesaw versions: the workspace call, the ragged batch, a prefix alone
        every += [
            {"name": f"v{v} verify 8x65x1000 (workspace)",
             "shape": {"nh": 8, "nq": 65, "lens": [1000], "sizes": [65]},
             "version": v, "call": "verify", "workspace": True},
            {"name": f"v{v} verify ragged B3", "shape": ragged, "version": v, "call": "verify",
             "workspace": False},
            {"name": f"v{v} prefix 8x9x1000", "shape": {"nh": 8, "nq": 9, "lens": [1000], "sizes": [9]},
             "version": v, "call": "prefix", "workspace": False},
        ]
    # version 8's wider combines (`v8_combine_warps`; the calls above take 4 warps): 8 warps where 3 requests
    # of one query share the SMs' jobs, 32 where one request has them all
    every += [
        {"name": "v8 verify 8x1x5000 B3 (combine 8 warps)",
         "shape": {"nh": 8, "nq": 1, "lens": [5000, 5000, 5000], "sizes": [1, 1, 1]},
         "version": 8, "call": "verify", "workspace": False},
        {"name": "v8 verify 8x1x20000 (combine 32 warps)",
         "shape": {"nh": 8, "nq": 1, "lens": [20000], "sizes": [1]},
         "version": 8, "call": "verify", "workspace": False},
    ]
    # version 9's own attend kernel (Q * H <= 16): one query and two, the workspace call, a ragged batch
    small = {"nh": 8, "nq": 2, "lens": [1000, 0, 357], "sizes": [1, 2, 2]}
    every += [
        {"name": "v9 verify 8x1x1000 (workspace)", "shape": {"nh": 8, "nq": 1, "lens": [1000], "sizes": [1]},
         "version": 9, "call": "verify", "workspace": True},
        {"name": "v9 verify 8x2 ragged B3", "shape": small, "version": 9, "call": "verify",
         "workspace": False},
        {"name": "v9 prefix 8x2x1000", "shape": {"nh": 8, "nq": 2, "lens": [1000], "sizes": [2]},
         "version": 9, "call": "prefix", "workspace": False},
    ]
    # version 10: a batch whose plan has more jobs than SMs (16 requests of 520 rows: the jobs ordered and
    # dealt by size), its kernel with v9's consumers, and 1,040 rows (v8's combine a warp per row)
    every += [
        {"name": "v10 verify 8x65 B16 (ordered)",
         "shape": {"nh": 8, "nq": 65, "lens": list(range(100, 1700, 100)), "sizes": [65] * 16},
         "version": 10, "call": "verify", "workspace": True},
        {"name": "v10 verify 8x1x1000", "shape": {"nh": 8, "nq": 1, "lens": [1000], "sizes": [1]},
         "version": 10, "call": "verify", "workspace": False},
        {"name": "v10 verify 16x65x1000 (combine a warp per row)",
         "shape": {"nh": 16, "nq": 65, "lens": [1000], "sizes": [65]},
         "version": 10, "call": "verify", "workspace": False},
    ]
    # version 10's FP8 build (the pool in kdlib.ref.fp8's layout): the ordered batch, v9's consumers, the
    # ragged batch (an empty prefix among them), a prefix alone
    # (fp8: the path, fp8_path; "fused", the FP8 build, whatever fp8_path=None would pick)
    every += [{**c, "name": c["name"].replace("v10", "v10 fp8", 1), "fp8": "fused"} for c in every[-3:-1]]
    every += [
        {"name": "v10 fp8 verify ragged B3", "shape": ragged, "version": 10, "call": "verify",
         "workspace": False, "fp8": "fused"},
        {"name": "v10 fp8 prefix 8x9x1000", "shape": {"nh": 8, "nq": 9, "lens": [1000], "sizes": [9]},
         "version": 10, "call": "prefix", "workspace": False, "fp8": "fused"},
        # v9's consumers over more jobs than SMs: a CTA meets tree tails after other jobs' pairs
        {"name": "v10 fp8 verify 8x2 ragged B160",
         "shape": {"nh": 8, "nq": 2, "lens": [613 * b % 3001 for b in range(160)],
                   "sizes": [1 + b % 2 for b in range(160)]},
         "version": 10, "call": "verify", "workspace": False, "fp8": "fused"},
        # the other path: the gather (an empty prefix among the requests), then the bf16 build
        {"name": "v10 fp8 dequant-first verify ragged B3", "shape": ragged, "version": 10, "call": "verify",
         "workspace": True, "fp8": "dequant_first"},
        {**next(c for c in every if c["name"] == "v10 verify 8x65 B16 (ordered)"),
         "name": "v10 fp8 dequant-first verify 8x65 B16 (ordered)", "fp8": "dequant_first"},
    ]
    # version 11's cluster kernel (72 rows a request): one request, a ragged batch of trees of 9, 5 and 8
    # (groups of two jobs and of one, an empty prefix), the prefix alone, and more groups than clusters
    one_pass = [
        {"name": "verify 8x9x1000 (workspace)", "shape": {"nh": 8, "nq": 9, "lens": [1000], "sizes": [9]},
         "call": "verify", "workspace": True},
        {"name": "verify 8x9 ragged B3",
         "shape": {"nh": 8, "nq": 9, "lens": [1000, 0, 357], "sizes": [9, 5, 8]},
         "call": "verify", "workspace": False},
        {"name": "prefix 8x9x1000", "shape": {"nh": 8, "nq": 9, "lens": [1000], "sizes": [9]},
         "call": "prefix", "workspace": False},
        {"name": "verify 8x9 B80",
         "shape": {"nh": 8, "nq": 9, "lens": [613 * b % 3001 for b in range(80)], "sizes": [9] * 80},
         "call": "verify", "workspace": False},
    ]
    # and version 12's one-CTA kernel (v7's consumers, the rows past 64 in the producer) on the same four
    every += [{**c, "name": f"v{v} {c['name']}", "version": v} for v in (11, 12) for c in one_pass]
    # version 13: 64 x 65 over 1,000 keys (130 jobs, two a row block: the cluster pairs merge), 48 x 65 (a
    # last row block of 48 rows), and a tree of fewer rows (version 10's path in the cluster kernel)
    every += [
        {"name": "v13 verify 64x65x1000 (pairs, workspace)",
         "shape": {"nh": 64, "nq": 65, "lens": [1000], "sizes": [65]},
         "version": 13, "call": "verify", "workspace": True},
        {"name": "v13 verify 48x65x1000 (pairs)",
         "shape": {"nh": 48, "nq": 65, "lens": [1000], "sizes": [65]},
         "version": 13, "call": "verify", "workspace": False},
        {"name": "v13 verify 64x65x1000 tree 31 (unpaired)",
         "shape": {"nh": 64, "nq": 65, "lens": [1000], "sizes": [31]},
         "version": 13, "call": "verify", "workspace": False},
    ]
    return [c for c in every if not keep or c["name"].startswith(keep)]


def run_case(spec: dict, seed: int) -> dict:
    """One call of `spec` on fresh inputs, its output against the float64 reference, the kernels it
    fetched."""
    import cupy

    sh = spec["shape"]
    dev, seen = to_device(problem(seed, sh["nh"], sh["nq"], sh["lens"], sh["sizes"]))
    path = spec.get("fp8")
    if path:  # the pool in the FP8 layout; the reference on the rows the kernel dequantizes
        dev["kv_cache"] = cu.fp8_pool(dev["kv_cache"])
        seen["kv_cache"] = cu.fp8_dequantized(dev["kv_cache"]).double().cpu().numpy()
    fetched = []
    fetch = loader.get_function

    def recording(stem, name, **kw):
        fetched.append(name)
        return fetch(stem, name, **kw)

    loader.get_function = recording  # observe which kernels the wrapper loads (and then launches)
    try:
        if spec["call"] == "prefix":
            args = {k: dev[k] for k in PREFIX_KEYS}
            got = cu.prefix_attention(**args, version=spec["version"], fp8_path=path)
            want = ref.prefix_attention(**{k: seen[k] for k in PREFIX_KEYS})
        else:
            ws = cu.make_workspace(len(sh["lens"]), sh["nq"], sh["nh"]) if spec["workspace"] else None
            got = cu.tree_verify_attention(**dev, version=spec["version"], workspace=ws, fp8_path=path)
            want = ref.tree_verify_attention(**seen)
        cupy.cuda.runtime.deviceSynchronize()
    finally:
        loader.get_function = fetch
    verdict = compare(*got, *want)
    print(f"{'PASS' if verdict['ok'] else 'FAIL'} {spec['name']}: norm-rel {verdict['norm_rel']:.2e}, "
          f"lse {verdict['lse_max_abs']:.1e}, kernels {sorted(set(fetched))}", flush=True)
    return {**spec, "seed": seed, **verdict, "kernels": sorted(set(fetched))}


def run(json_path: Path, pool: bool) -> int:
    only = os.environ.get("KDLIB_SANITIZE_CASES", "")
    chosen = cases(only)
    if not chosen:  # a run of no case would read as clean
        firsts = sorted({c["name"].split()[0] for c in cases()})
        print(f"KDLIB_SANITIZE_CASES={only!r} keeps no case (names start with {firsts})", file=sys.stderr)
        return 2
    import cupy

    if not pool:
        cupy.cuda.set_allocator(None)  # every array its own cudaMalloc: exact bounds for memcheck
    if not cu.wgmma_available():
        print("versions 5, 6 and 7 need an sm_90 device (H100 / H200); nothing run", file=sys.stderr)
        return 1
    done = [run_case(spec, seed) for seed, spec in enumerate(chosen)]
    doc = {"provenance": provenance(), "nvrtc_options": os.environ.get("KDLIB_NVRTC_OPTIONS", ""),
           "pool": pool, "rtol": RTOL, "lse_atol": LSE_ATOL, "cases": done,
           "kernels": sorted({k for c in done for k in c["kernels"]}), "ok": all(c["ok"] for c in done)}
    atomic_write_text(json_path, json.dumps(doc, indent=1) + "\n")
    print("sanitize driver done:", "every case passed" if doc["ok"] else "a case FAILED", flush=True)
    return 0 if doc["ok"] else 1


def parse_log(text: str, tool: str) -> dict:
    """A compute-sanitizer log's findings, summed over every summary line: `errors` from ERROR SUMMARY
    (memcheck, synccheck, initcheck) or the hazards of RACECHECK SUMMARY (racecheck, with their errors
    and warnings); errors None where the log holds no such line (the run did not reach its end)."""
    if tool == "racecheck":
        found = [tuple(int(x) for x in m) for m in _HAZARDS.findall(text)]
        if not found:
            return {"errors": None}
        n, e, w = (sum(col) for col in zip(*found, strict=True))
        return {"errors": n, "hazard_errors": e, "hazard_warnings": w}
    found = [int(m) for m in _ERRORS.findall(text)]
    return {"errors": sum(found) if found else None}


def summarize(folder: Path) -> int:
    """Write folder/sanitize.json from the <tool>.log, <tool>.rc and <tool>.json of every tool run there.

    A tool is clean when compute-sanitizer exited 0, its log's summary counts no finding, and the
    driver wrote its case file with every case passed, of one case or more (a summary of 0 alone is not
    enough: a target that died early can leave one). The provenance and build options are the driver's,
    as its case files recorded them (a folder summarized later, elsewhere, keeps them)."""
    tools = {}
    run_info = {"provenance": provenance(), "nvrtc_options": os.environ.get("KDLIB_NVRTC_OPTIONS", "")}
    for tool in TOOLS:
        log = folder / f"{tool}.log"
        if not log.exists():
            continue
        rc_file, cases_file = folder / f"{tool}.rc", folder / f"{tool}.json"
        found = parse_log(log.read_text(errors="replace"), tool)
        driver = json.loads(cases_file.read_text()) if cases_file.exists() else None
        rc = int(rc_file.read_text().strip()) if rc_file.exists() else None
        tools[tool] = {
            "rc": rc, **found,
            "cases": None if driver is None else len(driver["cases"]),
            "cases_passed": None if driver is None else sum(c["ok"] for c in driver["cases"]),
            "kernels": None if driver is None else driver["kernels"],
            "clean": rc == 0 and found["errors"] == 0 and driver is not None and driver["ok"]
            and len(driver["cases"]) > 0,
        }
        if driver is not None and "provenance" in driver:  # the run's own, not the summarizing process's
            run_info = {"provenance": driver["provenance"],
                        "nvrtc_options": driver.get("nvrtc_options", run_info["nvrtc_options"])}
    if not tools:
        print(f"no <tool>.log in {folder}: nothing to summarize", file=sys.stderr)
        return 2
    doc = {**run_info, "tools": tools, "clean": all(t["clean"] for t in tools.values())}
    atomic_write_text(folder / "sanitize.json", json.dumps(doc, indent=1) + "\n")
    for tool, t in tools.items():
        print(f"{tool:10s} rc {t['rc']}  findings {t['errors']}  cases {t['cases_passed']}/{t['cases']}  "
              f"{'clean' if t['clean'] else 'NOT CLEAN'}")
    return 0 if doc["clean"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the driver: every case once, checked, cases written to --json")
    r.add_argument("--json", type=Path, required=True, help="where the case results go")
    r.add_argument("--pool", action="store_true", help="keep CuPy's memory pool (default: off)")
    s = sub.add_parser("summarize", help="DIR/<tool>.log + .json + .rc -> DIR/sanitize.json")
    s.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        require_gpu(ap)
        return run(args.json, args.pool)
    if not args.folder.is_dir():
        print(f"not a folder: {args.folder}", file=sys.stderr)
        return 2
    return summarize(args.folder)


if __name__ == "__main__":
    sys.exit(main())
