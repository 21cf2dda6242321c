"""The default verify at 8 heads as each request's tree grows from 1 to 9 queries (8 to 72 query rows a
request), over one 200k prefix and over 8 requests of 32k: the attention suite's two 8 x 9 points and every
tree size below them, where the rows stop being free beside the gathers (notebook 02b, 13z).

On the GPU machine:
    KDLIB_COMMIT=<sha> python3 tools/rows_sweep.py --out $OUT     -> $OUT/attention_rows.<gpu>.json

Each point: the whole verify replayed from CUDA graphs and one replay profiled (`attention_bounds`' timing:
the median ms, each kernel's device us), its bytes at the GPU's copy bandwidth (the ceilings recorded for it)
and the fraction of copy that makes, the consumers the attend kernel runs (version 9's, the rows as the MMAs'
N, up to 16 rows; else version 7's, jobs of 64 rows) and the row blocks; the attend kernel built as the
consumers alone (`attention_bounds.PROBES`' second build, TV7_PROBE 2: the producer, which both consumer forms
share, fills each stage once) and, where version 7's consumers run, as the gathers alone (its first build: its
wait-and-release is in version 7's consumers' code).

    --queries 1 2 8      only those tree sizes
"""

from __future__ import annotations

import argparse
import math

from kdlib.cli import folder, make_folder, positive_int, require_gpu
from kdlib.cuda import attention as cu
from kdlib.perf import results
from kdlib.perf.suites import attention
from kdlib.perf.suites import attention_bounds as bounds

GRIDS = ((200_000, 1), (32_768, 8))  # (prefix a request, requests)
HEADS = 8
QUERIES = tuple(range(1, 10))
PROBES = {k: bounds.PROBES[k] for k in ("gathers", "consumers")}


def probes(rows: int) -> dict:
    """The probe builds that hold at `rows` query rows a request: both under version 7's consumers, the
    consumers alone under version 9's."""
    return PROBES if cu.v9_options(rows) is None else {"consumers": PROBES["consumers"]}


def points(queries=QUERIES) -> list[dict]:
    """The sweep: every tree size of `queries` over each grid of GRIDS, at HEADS heads."""
    return [{"heads": HEADS, "queries": nq, "prefix": s, "batch": b}
            for s, b in GRIDS for nq in queries]


def consumers(rows: int) -> str:
    """The consumers the default attend kernel runs at `rows` query rows a request."""
    return "version 9's" if cu.v9_options(rows) else "version 7's"


def run_point(p: dict, pool, copy_Bps: float, iters: int) -> dict:
    """One point's whole verify and its probes (`probes`) -> its record row."""
    x = attention.point_inputs(p, pool)
    h, rows = p["heads"], p["heads"] * p["queries"]
    got = bounds._profiled(bounds._verify_launch(x, pool, h, x["tables"]), iters)
    ms = got["timing"]["median_ms"]
    mem_ms = x["cost"]["bytes"] / copy_Bps * 1e3
    row = {**p, "rows": rows, "row_blocks": math.ceil(rows / bounds.ROW_BLOCK), "consumers": consumers(rows),
           "bytes": x["cost"]["bytes"], "verify": got, "attend_us": bounds.attend_us(got["kernels"]),
           "mem_ms": mem_ms, "fraction_of_copy": mem_ms / ms}
    row["probes"] = {k: bounds.probe(x, pool, h, x["tables"], opts, iters)
                     for k, opts in probes(rows).items()}
    print(f"[rows] H{h} Q{p['queries']} S{p['prefix']} B{p['batch']} ({rows} rows, {row['consumers']} "
          f"consumers): {ms:.4f} ms, {row['fraction_of_copy']:.0%} of copy, attend {row['attend_us']:.1f} us"
          + "".join(f", {k} alone {v['attend_us']:.1f} us" for k, v in row.get("probes", {}).items()),
          flush=True)
    return row


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=folder, help="folder of the record")
    ap.add_argument("--iters", type=positive_int, default=20, help="graph replays a timing")
    ap.add_argument("--queries", type=int, nargs="+", default=QUERIES, choices=QUERIES, help="tree sizes")
    a = ap.parse_args()
    require_gpu(ap)
    make_folder(ap, a.out)
    ceil = results.ceilings()
    pts = points(a.queries)
    pool = torch.randn(attention.pool_rows(pts), attention.D_QK, device="cuda",
                       dtype=torch.bfloat16)  # [N, 576] KV rows
    rows = []
    doc = {"parameters": {"points": pts, "iters": a.iters, "default_version": cu.BF16_DEFAULT,
                          "probes": PROBES, "pdl": cu.PDL},
           "ceilings": ceil.as_dict(), "points": rows,
           "notes": ["verify: the whole default verify over the point's rotated tables, graph replays; "
                     "kernels: one replay profiled",
                     "mem_ms: the point's bytes (the attention suite's cost) at the copy bandwidth; "
                     "fraction_of_copy = mem_ms / the verify's median",
                     "probes: the verify with the attend kernel built -DTV7_PROBE=2 (consumers alone) and, "
                     "where version 7's consumers run, =1 (gathers alone)",
                     "written after every point: a run cut short keeps the points it timed"]}
    for p in pts:
        rows.append(run_point(p, pool, ceil.bandwidth_Bps, a.iters))
        path = results.write("attention_rows", doc, out_dir=a.out)
        torch.cuda.empty_cache()
    print(path)


if __name__ == "__main__":
    main()
