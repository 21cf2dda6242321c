"""One kernel source against another revision's, in one process, on the same inputs: the tree-verify
attention (version 7 by default), whole verify replayed from CUDA graphs, the arms alternating new, old,
new, old over the whole grid (one compile each) so that clocks and heat fall on both; the arms' outputs
compared bit for bit.

Here (git; the old tree lands in build/, which is git-ignored, so carry it):
    python3 tools/kernel_ab.py export <rev>            -> build/ab/<rev>/kernels
On the GPU machine (carry ["build/ab"]):
    python3 tools/kernel_ab.py run build/ab/<rev>/kernels --out $OUT
    python3 tools/kernel_ab.py run build/ab/<old>/kernels --new build/ab/<new>/kernels --version 10 \
        --suite kernel_ab_x --out $OUT   # two exported trees, neither this one
    python3 tools/kernel_ab.py run build/ab/<rev>/kernels --version 10 --suite kernel_ab_plan --out $OUT
    python3 tools/kernel_ab.py run --version 10 --suite kernel_ab_pdl --out $OUT   # PDL on / off
    python3 tools/kernel_ab.py run --version 10 --toggle COMBINE_ROWS --suite kernel_ab_rows --out $OUT
    python3 tools/kernel_ab.py run --version 10 --toggle DEAL_COST --layers 61 --suite kernel_ab_deal \
        --out $OUT   # a step of 61 layers: the first makes the plan (reuse_plan), the rest reuse it
    python3 tools/kernel_ab.py run --version 10 --define PLAN_SMALL_REQS=0 --suite kernel_ab_four_warps \
        --out $OUT   # this tree built with -DPLAN_SMALL_REQS=0 (new) against its default build (old)
    python3 tools/kernel_ab.py run --version 10 --define PLAN_SMALL_REQS=0 --define ORDER_GAIN=-64 \
        --suite kernel_ab_x --out $OUT   # two switches together in the new arm
    python3 tools/kernel_ab.py run --version 10 --define AB_NO_SWITCH=1 --suite kernel_ab_aa \
        --out $OUT   # an A/A: a macro no source reads, the same kernels in both arms (the tool's own spread)
    python3 tools/kernel_ab.py repeat build/ab/<rev>/kernels --prefix 32000 --batch 16 \
        --out $OUT   # each arm n times at one point, against float64
    python3 tools/kernel_ab.py repeat --define ORDER_GAIN=-64 --version 10 --out $OUT  # a build switch's arms

Points: the attention suite's (`kdlib.perf.suites.attention`: POINTS and the ragged one) and one TP8
Kimi-K2.6 rank's verify at C = 1, 4, 10, 16 streams of 9 or 65 tree rows over 5,500 or 32,000 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
from pathlib import Path

from kdlib.cli import folder, make_folder, positive_int, require_gpu
from kdlib.cuda.attention import MAX_Q, WGMMA_VERSIONS

ROOT = Path(__file__).resolve().parents[1]
# kdlib.cuda.attention's switches the arms of `run` can set on and off, each with the versions it changes
# (attention._launch_wgmma: `pdl = version >= 10 and PDL`, `if version >= 8 and COMBINE_ROWS`,
# `own = ordered and ...` with `ordered = version in (10, 13)`, and the plan kernel's
# `reuse_plan and DEAL_COST`, which only a step of layers (--layers) sets)
TOGGLES = {"PDL": (10, 11, 12, 13), "COMBINE_ROWS": (8, 9, 10, 11, 12, 13), "OWN_PLAN": (10, 13),
           "DEAL_COST": (10, 13)}
RANK_POINTS = [{"heads": 8, "queries": w, "prefix": s, "batch": c}
               for s in (5500, 32_000) for c in (1, 4, 10, 16) for w in (9, 65)]


def export(rev: str) -> Path:
    """`git archive` of rev's kernels/ into build/ab/<rev>/."""
    from kdlib.cuda import loader

    return loader.export_kernels(rev, ROOT / "build" / "ab" / rev)


def _flags(defines: list[str]) -> str:
    """The -D options of defines ('NAME=VALUE' each)."""
    return " ".join(f"-D{d}" for d in defines)


def _arm_build(defines: list[str] | None, arm: str):
    """The build an arm's calls compile: with a -D option per define for the new arm where defines are given,
    else as the tree (or the exported kernels) has it."""
    from kdlib.cuda import loader

    return loader.extra_options(_flags(defines)) if defines and arm == "new" else contextlib.nullcontext()


def run(old_kernels: Path | None, out: Path, version: int, iters: int, suite_name: str = "kernel_ab",
        new_kernels: Path | None = None, toggle: str = "PDL", defines: list[str] | None = None,
        layers: int = 1) -> Path:
    """Both arms at every point into <out>/<suite_name>.<gpu>.json; the new arm runs new_kernels (None: this
    tree's). old_kernels None: the arms are this tree's kernels with the switch `toggle` of
    kdlib.cuda.attention on ("new") and off ("old"): PDL, programmatic dependent launch; COMBINE_ROWS, the
    combine with a warp per row where the rows are many. defines ('NAME=VALUE' each, no old kernels): instead,
    this tree's kernels built with a -DNAME=VALUE per define (new) and without (old), the host's switches as
    they are. layers > 1: each point timed as a step of that many layers (`kdlib.perf.suites.attention.
    time_arm`), the time a layer recorded."""
    import cupy
    import torch

    from kdlib import perf
    from kdlib.cuda import attention as cu
    from kdlib.cuda import loader
    from kdlib.perf import results
    from kdlib.perf.suites import attention as suite

    pts = suite.POINTS + [suite.ragged_point()] + RANK_POINTS
    pool = torch.randn(suite.pool_rows(pts), suite.D_QK, device="cuda",
                       dtype=torch.bfloat16)  # [N, 576] KV rows
    ceil = results.ceilings().as_dict()
    arms = [("new", new_kernels), ("old", old_kernels), ("new", new_kernels), ("old", old_kernels)]
    inputs = [suite.point_inputs(p, pool) for p in pts]
    times = [{"new": [], "old": []} for _ in pts]
    outs = [{} for _ in pts]
    saved = getattr(cu, toggle)
    for name, src in arms:  # arm-major: one compile per arm; the arms alternate over the whole grid
        loader.use_kernels(src)
        setattr(cu, toggle, saved if old_kernels is not None or defines else name == "new")
        with _arm_build(defines, name):
            suite.time_arm(name, pts, inputs, pool, times, outs, iters, layers=layers, version=version)
        print(f"[ab] arm {name} ({src or 'this tree'}, {toggle} {getattr(cu, toggle)}"
              f"{f', {_flags(defines)}' if defines and name == 'new' else ''}) done", flush=True)
    loader.use_kernels(None)
    setattr(cu, toggle, saved)
    rows = []
    for p, x, t, o in zip(pts, inputs, times, outs, strict=True):
        fl = perf.floor_ms(x["cost"]["bytes"], x["cost"]["flops"], bandwidth_Bps=ceil["bandwidth_Bps"],
                           flop_rate=ceil["flop_rate"])
        med = {k: statistics.median(v) for k, v in t.items()}
        row = {**{k: p[k] for k in ("heads", "queries", "batch")}, "prefix": p.get("prefix"),
               "ragged": "lens" in p, "floor_ms": fl["floor_ms"], "new_ms": med["new"], "old_ms": med["old"],
               "arm_medians_ms": t, "old_over_new": med["old"] / med["new"],
               "new_fraction_of_floor": fl["floor_ms"] / med["new"],
               "bitwise_equal": bool(cupy.array_equal(o["new"], o["old"], equal_nan=True))}
        rows.append(row)
        print(f"[ab] H{p['heads']} Q{p['queries']} S{p.get('prefix') or 'ragged'} B{p['batch']}: new "
              f"{med['new']:.4f} old {med['old']:.4f} ms, old/new {row['old_over_new']:.3f}, "
              f"bitwise {row['bitwise_equal']}", flush=True)
    doc = {"parameters": {"version": version, "old_kernels": str(old_kernels) if old_kernels else None,
                          "new_kernels": str(new_kernels) if new_kernels else None,
                          "old_commit": loader.exported_commit(old_kernels) if old_kernels else None,
                          "new_commit": loader.exported_commit(new_kernels) if new_kernels else None,
                          "pdl_arms": old_kernels is None and not defines and toggle == "PDL",
                          "toggle_arms": toggle if old_kernels is None and not defines else None,
                          "define_arms": defines, "iters": iters, "layers": layers,
                          "arms": [a for a, _ in arms], "points": pts},
           "ceilings": ceil, "rows": rows,
           "verdict": {"bitwise_equal_everywhere": all(r["bitwise_equal"] for r in rows),
                       "old_over_new_min": min(r["old_over_new"] for r in rows),
                       "old_over_new_max": max(r["old_over_new"] for r in rows)}}
    print(json.dumps(doc["verdict"]))
    return results.write(suite_name, doc, out_dir=out, command=" ".join(["python3"] + sys.argv))


def reference(x: dict, pool, b: int):
    """Request b's verify in float64 (on pool's device): [Q*H, 512], rows past its tree size NaN."""
    import torch

    from kdlib.perf.suites import attention as suite

    q = x["q"][b]  # [Q, H, 576]
    nq, nh = q.shape[:2]
    n, t = x["lens"][b], x["trees"][b]
    keys = torch.cat([pool[x["tables"][0][b, :n].long()], x["tkv"][b, :t]]).double()  # [n + t, 576]
    s = q.reshape(nq * nh, -1).double() @ keys.T * x["scale"]  # [Q*H, n + t], row = q * H + h
    vis = x["vis"][b, :, :t].repeat_interleave(nh, 0)  # [Q*H, t]
    s[:, n:] = s[:, n:].masked_fill(~vis, float("-inf"))
    out = torch.softmax(s, -1) @ keys[:, : suite.D_V]
    out[t * nh:] = float("nan")
    return out


def repeat(old_kernels: Path | None, out: Path, point: dict, n: int, version: int,
           defines: list[str] | None = None) -> Path:
    """Each arm n times at one point (fresh workspace each call, the same inputs): how many distinct outputs
    each gives, the largest difference between any two, each run's error against float64, and the two arms'
    first outputs against each other (`new_vs_old`: bit-equal, largest difference, rows that differ), into
    <out>/kernel_ab_repeat.<gpu>.json. The arms: this tree (new) and old_kernels (old), or with defines
    ('NAME=VALUE' each) this tree built with a -DNAME=VALUE per define (new) and without (old)."""
    import torch

    from kdlib.cuda import attention as cu
    from kdlib.cuda import loader
    from kdlib.perf import results
    from kdlib.perf.suites import attention as suite

    pool = torch.randn(point["prefix"] * point["batch"], suite.D_QK, device="cuda", dtype=torch.bfloat16)
    x = suite.point_inputs(point, pool)
    ref = torch.cat([reference(x, pool, b) for b in range(point["batch"])])  # [B*Q*H, 512] float64
    keep = ~torch.isnan(ref[:, 0])
    arms, first = {}, {}
    for name, src in (("new", None), ("old", old_kernels)):
        loader.use_kernels(src)
        runs = []
        with _arm_build(defines, name):
            for _ in range(n):
                ws = cu.make_workspace(point["batch"], point["queries"], point["heads"])
                o = suite.verify_call(x, pool, ws, version=version)(x["tables"][0])[0]
                runs.append(torch.from_dlpack(o).reshape(-1, suite.D_V).clone())  # [B*Q*H, 512]
        err = [float((r[keep].double() - ref[keep]).abs().max() / ref[keep].abs().max()) for r in runs]
        spread = max(float((r[keep] - runs[0][keep]).abs().max()) for r in runs)
        distinct = len({r[keep].cpu().numpy().tobytes() for r in runs})
        first[name] = runs[0][keep]
        arms[name] = {"distinct_outputs": distinct, "max_abs_diff_between_runs": spread,
                      "max_rel_err_vs_float64": max(err), "min_rel_err_vs_float64": min(err)}
        print(f"[ab repeat] {name}: {distinct} distinct of {n}, spread {spread:.3g}, err vs float64 "
              f"{min(err):.3g}..{max(err):.3g}", flush=True)
    loader.use_kernels(None)
    gap = (first["new"] - first["old"]).abs()
    across = {"bitwise_equal": bool(torch.equal(first["new"], first["old"])),
              "max_abs_diff": float(gap.max()), "rows_differing": int((gap > 0).any(1).sum()),
              "rows": int(gap.shape[0])}
    print(f"[ab repeat] new against old: {across}", flush=True)
    doc = {"parameters": {"version": version, "old_kernels": str(old_kernels) if old_kernels else None,
                          "old_commit": loader.exported_commit(old_kernels) if old_kernels else None,
                          "define_arms": defines, "point": point, "n": n},
           "arms": arms, "new_vs_old": across}
    return results.write("kernel_ab_repeat", doc, out_dir=out, command=" ".join(["python3"] + sys.argv))


def tree_queries(text: str) -> int:
    """argparse type: tree queries per request, 1 to attention.MAX_Q."""
    value = positive_int(text)
    if value > MAX_Q:
        raise argparse.ArgumentTypeError(f"must lie in [1, {MAX_Q}] (attention.MAX_Q), got {text!r}")
    return value


def _check_define(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--define (repeatable): NAME=VALUE each, each NAME once, and no old kernels beside them (they set the
    new arm's build of this tree)."""
    if a.define is None:
        return
    if a.old_kernels is not None:
        ap.error("--define sets the new arm's build of this tree: no old kernels with it")
    for d in a.define:
        if not re.fullmatch(r"[A-Za-z_]\w*=\S+", d):
            ap.error(f"--define takes NAME=VALUE, got {d!r}")
    names = [d.split("=")[0] for d in a.define]
    if len(set(names)) < len(names):
        ap.error(f"--define names a switch twice: {' '.join(a.define)}")


def _check_kernels(ap: argparse.ArgumentParser, a) -> None:
    """The arms' exported kernels are there (the new arm timed every point before the old arm's failed)."""
    for given in (a.old_kernels, getattr(a, "new_kernels", None)):
        if given is not None and not (given / "tree_verify").is_dir():
            ap.error(f"{given} is not an exported kernels/ folder (export it, and carry build/ab to the GPU)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="kernels/ of a git revision into build/ab/<rev>")
    e.add_argument("rev")
    r = sub.add_parser("run", help="time this tree's kernel against the exported one (GPU)")
    r.add_argument("old_kernels", type=Path, nargs="?",
                   help="the exported kernels; left out: this tree's kernels in both arms, with the --toggle "
                        "switch (default PDL) or the --define builds on (new) and off (old)")
    r.add_argument("--new", type=Path, dest="new_kernels",
                   help="the new arm's exported kernels (left out: this tree's)")
    r.add_argument("--out", type=folder, required=True, help="folder (made once the arguments pass)")
    r.add_argument("--version", type=int, choices=WGMMA_VERSIONS, default=7)
    r.add_argument("--iters", type=positive_int, default=20)
    r.add_argument("--suite", default="kernel_ab", help="the result's name: <suite>.<gpu>.json")
    r.add_argument("--toggle", choices=TOGGLES, default="PDL",
                   help="without old kernels: the kdlib.cuda.attention switch the arms set on (new) and off "
                        "(old)")
    r.add_argument("--define", metavar="NAME=VALUE", action="append",
                   help="without old kernels: this tree's kernels built with -DNAME=VALUE (new) and without "
                        "(old), instead of a --toggle; repeat it for switches together")
    r.add_argument("--layers", type=positive_int, default=1,
                   help="time a step of this many layers, the first making the plan that the others reuse "
                        "(reuse_plan, plan_ready), and record the time a layer (default 1: one whole verify)")
    p = sub.add_parser("repeat", help="each arm n times at one point, against float64 (GPU)")
    p.add_argument("old_kernels", type=Path, nargs="?", help="the exported kernels (or --define)")
    p.add_argument("--define", metavar="NAME=VALUE", action="append",
                   help="instead of old kernels: this tree built with -DNAME=VALUE (new) and without (old); "
                        "repeatable")
    for k, v in (("heads", 8), ("prefix", 32_000), ("batch", 16), ("n", 8)):
        p.add_argument(f"--{k}", type=positive_int, default=v)
    p.add_argument("--queries", type=tree_queries, default=65)
    p.add_argument("--version", type=int, choices=WGMMA_VERSIONS, default=7)
    p.add_argument("--out", type=folder, required=True, help="folder (made once the arguments pass)")
    a = ap.parse_args(argv)
    if a.cmd == "export":
        try:
            print(export(a.rev))
        except ValueError as e:  # a revision git does not know
            ap.error(str(e))
        return 0
    if a.cmd == "repeat":
        if (a.old_kernels is None) == (a.define is None):
            ap.error("repeat takes old kernels or --define, one of the two")
        _check_define(ap, a)
        _check_kernels(ap, a)
        require_gpu(ap)
        make_folder(ap, a.out)
        repeat(a.old_kernels, a.out, {k: getattr(a, k) for k in ("heads", "queries", "prefix", "batch")}, a.n,
               a.version, a.define)
    else:
        if a.old_kernels is None and a.new_kernels is not None:
            ap.error("--new needs the old arm's kernels")
        if a.toggle != "PDL" and (a.old_kernels is not None or a.define is not None):  # it would be ignored
            ap.error("--toggle applies without old kernels and without --define only")
        if a.define is not None:
            _check_define(ap, a)
        elif a.old_kernels is None and a.version not in TOGGLES[a.toggle]:
            ap.error(f"without old kernels the arms are {a.toggle} on / off, which versions "
                     f"{', '.join(map(str, TOGGLES[a.toggle]))} follow, not --version {a.version}")
        if a.toggle == "DEAL_COST" and a.layers == 1:  # a lone verify makes no plan for later calls
            ap.error("--toggle DEAL_COST changes only a plan later layers reuse: give --layers 2 or more")
        _check_kernels(ap, a)
        require_gpu(ap)
        make_folder(ap, a.out)
        run(a.old_kernels, a.out, a.version, a.iters, a.suite, a.new_kernels, a.toggle, a.define, a.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
