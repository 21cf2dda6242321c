"""Result files with provenance: `data/results/<suite>.<gpu>.json`.

Every GPU figure the workbook shows comes from such a file. The provenance block names the GPU,
driver, CUDA / CuPy / torch versions, git commit (from $KDLIB_COMMIT when the tree travelled
without .git), the UTC date and the command that made it.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kdlib import DATA, ROOT
from kdlib.files import atomic_write_text

RESULTS = DATA / "results"
SCHEMA = 1  # the layout `write` stamps; tools/migrate_results.py brought the older files to it


def git_commit() -> str:
    """The repository's HEAD commit ($KDLIB_COMMIT first: a tree copied to a GPU machine has no .git)."""
    env = os.environ.get("KDLIB_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def tree_modified() -> bool | None:
    """Whether tracked files differ from HEAD (uncommitted changes); None where git cannot tell."""
    if os.environ.get("KDLIB_COMMIT"):
        return None
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA RTX PRO 6000 Blackwell ...' -> 'rtx-pro-6000-blackwell-...'."""
    s = re.sub(r"^nvidia\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "cpu"


def gpu_name() -> str:
    """The name of the GPU this process runs on (device 0, through torch else CuPy); "cpu" where none is."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:
        pass
    return "cpu"


def provenance(command: str | None = None) -> dict:
    """What produced a measurement: hardware, software versions, commit, date, command, and the NVRTC
    options the environment adds to every kernel build (`KDLIB_NVRTC_OPTIONS`: a -D switch's build) where
    it sets any."""
    info = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "command": command or " ".join([os.path.basename(sys.executable)] + sys.argv),
        "tree_modified": tree_modified(),
        "python": platform.python_version(),
        "host_cpu": platform.processor() or platform.machine(),
        "gpu": gpu_name(),
        "driver": None,
        "cuda": None,
        "cupy": None,
        "torch": None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["cuda"] = torch.version.cuda
            props = torch.cuda.get_device_properties(0)
            info["sm_count"] = props.multi_processor_count
            info["gpu_memory_bytes"] = props.total_memory
    except ImportError:
        pass
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        info["driver"] = (
            out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        )
    except (OSError, subprocess.SubprocessError):
        pass
    options = os.environ.get("KDLIB_NVRTC_OPTIONS", "").strip()
    if options:  # the command line does not show it, and the kernels it times are not the tree's default
        info["nvrtc_options"] = options
    return info


def json_value(o):
    """JSON for the values suites hand over beside plain ones: numpy / CuPy / torch scalars and arrays
    keep their kind (an int stays an int); anything else is a TypeError naming its type."""
    if hasattr(o, "tolist"):  # numpy scalars and arrays, CuPy arrays, torch tensors
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"a result payload holds a {type(o).__name__}, which has no JSON form")


def dumps(doc: dict) -> str:
    """The text of a result file (what `write` writes; tools/migrate_results.py rewrites files with it)."""
    return json.dumps(doc, indent=1, sort_keys=False, default=json_value) + "\n"


def write(
    suite: str, payload: dict, *, out_dir: str | os.PathLike | None = None, command: str | None = None,
    name: str | None = None,
) -> Path:
    """Write `{suite, schema, provenance, **payload}` atomically to `<out_dir>/<name>.json`, by default
    `<suite>.<gpu>.json` (a record of its own name, such as tools/ncu_source.py's per kernel and point).
    A payload may not carry the stamp's own keys (ValueError), so the stamp is always this run's."""
    stamped = sorted({"suite", "schema", "provenance"} & set(payload))
    if stamped:
        raise ValueError(f"a result payload may not set {stamped}: write stamps them")
    prov = provenance(command)
    text = dumps({"suite": suite, "schema": SCHEMA, "provenance": prov, **payload})
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name or suite + '.' + gpu_slug(prov['gpu'])}.json"
    atomic_write_text(path, text)
    return path


def read_result(path: Path) -> dict:
    """A result file's JSON object; ValueError naming the file when it is not one (damaged, truncated)."""
    try:
        doc = json.loads(Path(path).read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a result file holds a JSON object, not {type(doc).__name__}")
    return doc


def _recorded_order(path: Path) -> tuple[str, str]:
    """Sort key of a result file: its provenance date (ISO 8601 UTC, so it sorts as text; '' when the
    file records none), then its name."""
    prov = read_result(path).get("provenance") or {}
    if not isinstance(prov, dict) or not isinstance(prov.get("date") or "", str):
        raise ValueError(f"{path}: provenance must be an object whose date is an ISO 8601 string, got "
                         f"{prov!r:.80}")
    return prov.get("date") or "", path.name


def load(suite: str, gpu: str | None = None) -> dict | None:
    """The recorded result of `suite` (on `gpu`, a slug or a glob such as 'h200' / 'h200-*'), or None.

    Where several files match, the one with the latest provenance date wins, ties broken by the
    greatest file name: the choice depends on the files' contents, never on when they were copied."""
    pattern = f"{suite}.{gpu}.json" if gpu else f"{suite}.*.json"
    paths = sorted(RESULTS.glob(pattern), key=_recorded_order)
    if not paths:
        return None
    doc = read_result(paths[-1])
    doc["_path"] = str(paths[-1].relative_to(ROOT))
    return doc


def describe(result: dict) -> str:
    """One line saying where a recorded figure comes from."""
    p = result["provenance"]
    where = result.get("_path", "?")
    return (
        f"recorded on {p.get('gpu', '?')} (driver {p.get('driver')}, CUDA {p.get('cuda')}, torch "
        f"{p.get('torch')}, CuPy {p.get('cupy')}), commit {str(p.get('commit', '?'))[:10]}, "
        f"{p.get('date', 'date not recorded')}, by `{p.get('command', '?')}` -> {where}"
    )


# ----------------------------------------------------------------------------- typed loaders
class SchemaError(ValueError):
    """A recorded file whose layout this code does not read."""


@dataclass(frozen=True)
class Row:
    """One timed arm at one sweep point, whatever suite measured it.

    op: the operation ('moe_w4a16', 'moe_bf16_grouped_mm', 'stream_read'); version: the kernel version
    (None for a torch baseline, or where the routings of one point picked different versions);
    mode: 'eager' (CUDA events, or the host's clock around a synchronised GPU step), 'graph' (CUDA-graph
    replay) or 'cpu' (a host-only run, wall clock); variant: '' for the plain launch, else a tuning or a
    stage ('gate_up_only', 'default' = the library's default choice); median_ms / p10_ms / p90_ms: the
    recorded quantiles (NaN where the payload records only a median);
    shape: the sweep point ({'m': 16}); bytes / flops: what the arm must move and compute (NaN where
    the payload records neither); key: the payload key the timing was read from; floor_ms: the
    physical floor the payload records beside the arm, None where it records none."""

    op: str
    version: int | None
    mode: str
    variant: str
    shape: dict
    median_ms: float
    p10_ms: float
    p90_ms: float
    bytes: float
    flops: float
    key: str
    floor_ms: float | None = None


@dataclass(frozen=True)
class Recorded:
    """A recorded result file: its payload, its tidy rows and where it came from."""

    doc: dict
    rows: tuple[Row, ...]

    @property
    def path(self) -> str:
        return self.doc.get("_path", "?")

    def select(self, **fields) -> list[Row]:
        """The rows whose fields equal every given value, e.g. select(op='moe_w4a16', mode='graph')."""
        return [r for r in self.rows if all(getattr(r, k) == v for k, v in fields.items())]


# file stems whose runs record another suite name
RECORDED_AS = {"accept_sampling": "accept", "verify_attention_dev_v2": "verify_attention_dev"}


def load_checked(suite: str, gpu: str | None = None) -> dict | None:
    """`load(suite, gpu)`, refusing a file of another schema or of another suite (one saved under the
    wrong name read as no rows); SchemaError names the file."""
    doc = load(suite, gpu)
    if doc is None:
        return None
    if doc.get("schema") != SCHEMA:
        raise SchemaError(f"{doc['_path']}: schema {doc.get('schema')!r}, this code reads {SCHEMA} "
                          f"(migrate it with `python3 tools/migrate_results.py`)")
    if doc.get("suite") != RECORDED_AS.get(suite, suite):
        raise SchemaError(f"{doc['_path']}: a record of suite {doc.get('suite')!r}, not of "
                          f"{RECORDED_AS.get(suite, suite)!r}")
    return doc


def _rows_of(doc: dict, rows) -> tuple[Row, ...]:
    """rows(doc); SchemaError naming the file where the payload lacks a field the reader needs."""
    try:
        return rows(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SchemaError(f"{doc.get('_path', '?')}: not the {doc.get('suite')!r} layout this code reads "
                          f"({type(e).__name__}: {e})") from None


def _timed(op, version, mode, variant, shape, t: dict, nbytes: float, flops: float, key: str,
           floor: float | None = None, per: int = 1) -> Row:
    """A Row from a timing block {median_ms, p10_ms, p90_ms} (a quantile it lacks: NaN); `per` > 1 divides
    the times of a graph of `per` back-to-back launches into the time of one."""
    def q(name):
        return float(t[name]) / per if t.get(name) is not None else math.nan

    return Row(op, version, mode, variant, shape, q("median_ms"), q("p10_ms"), q("p90_ms"), float(nbytes),
               float(flops), key, None if floor is None else float(floor))


def _shape(r: dict, *keys: str) -> dict:
    """The sweep point of a payload row: those of `keys` it records."""
    return {k: r[k] for k in keys if k in r}


def _step_timing(r: dict, prefix: str = "step_ms") -> dict:
    """The timing block of a row that records `step_ms`, `step_ms_p10`, `step_ms_p90` side by side."""
    return {"median_ms": r[prefix], "p10_ms": r.get(prefix + "_p10"), "p90_ms": r.get(prefix + "_p90")}


def _is_timing(t) -> bool:
    """A recorded timing block (a skipped arm records {'skipped': why} instead)."""
    return isinstance(t, dict) and "median_ms" in t


def _recorded(suite: str, gpu: str | None, rows) -> Recorded | None:
    doc = load_checked(suite, gpu)
    return None if doc is None else Recorded(doc, _rows_of(doc, rows))


# moe payload key -> (version, mode, variant, share of the layer's (weight bytes, FLOPs) it moves).
# A share of None means the whole layer: its `bytes` (weights and activations) and `flops`.
_MOE_ARMS = {
    "kernel": (1, "eager", "", None),
    "kernel_graph": (1, "graph", "", None),
    "kernel_gate_up_8warps": (1, "eager", "gate_up_8warps", None),
    "kernel_v2": (2, "eager", "", None),
    "kernel_v2_graph": (2, "graph", "", None),
    "kernel_v2_gate_up_16warps": (2, "eager", "gate_up_16warps", None),
    "kernel_v2_k_interleave": (2, "eager", "k_interleave", None),
    "kernel_v2_gate_up_only": (2, "eager", "gate_up_only", 2 / 3),
    "kernel_v2_down_only": (2, "eager", "down_only", 1 / 3),
    "kernel_default": (None, "eager", "default", None),
    "kernel_default_graph": (None, "graph", "default", None),
    "kernel_v3": (3, "eager", "", None),
    "kernel_v3_graph": (3, "graph", "", None),
}


def moe_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of a moe payload (kdlib/perf/suites/moe.py): every W4A16 arm (op 'moe_w4a16') and
    the bf16 baseline (op 'moe_bf16_grouped_mm') at every M that timed it.

    The payload's arm `kernel` is version 1; `kernel_default` is the library's default choice, its
    version the one `kernel_default_version` names (None where the routings picked several); a v2 or v3
    arm at an M where an expert has > 8 slots (outside their shared regime) ran v1's kernels (variant
    'v1_kernels'). floor_ms: the layer's recorded floor (kernel_floor, baseline_floor) for the arms that
    run the whole layer; None for a stage alone (gate_up_only, down_only)."""
    out = []
    for r in doc.get("rows") or []:
        shape = {"m": int(r["m"])}
        for key, (version, mode, variant, share) in _MOE_ARMS.items():
            t = r.get(key)
            if not isinstance(t, dict) or "median_ms" not in t:
                continue
            if variant == "default":
                picked = r.get("kernel_default_version") or []
                version = picked[0] if len(picked) == 1 else None
            elif version in (2, 3) and r.get("kernel_v2_path", "v2") != "v2":  # v3 has v2's regime
                variant = variant or "v1_kernels"
            nbytes, flops = ((r["bytes"], r["flops"]) if share is None
                             else (r["weight_bytes"] * share, r["flops"] * share))
            floor = (r.get("kernel_floor") or {}).get("floor_ms") if share is None else None  # whole layer's
            out.append(_timed("moe_w4a16", version, mode, variant, shape, t, nbytes, flops, key, floor))
        if isinstance(r.get("baseline"), dict) and "baseline_bytes" in r:
            out.append(_timed("moe_bf16_grouped_mm", None, "eager", "", shape, r["baseline"],
                              r["baseline_bytes"], r["flops"], "baseline",
                              (r.get("baseline_floor") or {}).get("floor_ms")))
    return tuple(out)


def load_moe(gpu: str = "h200") -> Recorded | None:
    """The recorded moe suite on `gpu` with its tidy rows (`moe_rows`), or None."""
    doc = load_checked("moe", gpu)
    return None if doc is None else Recorded(doc, _rows_of(doc, moe_rows))


def moe_stream_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of a moe_stream payload (kdlib/perf/suites/moe_stream.py): the stream-read probe
    (op 'stream_read', version 1, graph replay; variant its config and warps per SM, shape its size,
    stages, unit and block-wise flag). It reads bytes and computes nothing: flops 0."""
    out = []
    for r in doc.get("stream") or []:
        shape = {k: r[k] for k in ("size", "stages", "unit_bytes", "blockwise", "warps_per_sm")}
        variant = f"{r['config']}_w{r['warps_per_sm']}"
        out.append(_timed("stream_read", 1, "graph", variant, shape, r["timing"], r["bytes"], 0.0, "stream"))
    return tuple(out)


def load_moe_stream(gpu: str = "h200") -> Recorded | None:
    """The recorded moe_stream suite on `gpu` with its stream-read rows (`moe_stream_rows`), or None."""
    doc = load_checked("moe_stream", gpu)
    return None if doc is None else Recorded(doc, _rows_of(doc, moe_stream_rows))


# ---- verify attention (suites attention, kernels' verify_attention, verify_attention_dev*)
VERIFY_OP = "tree_verify_attention"  # kdlib.cuda.attention's whole verify (prefix + tail + merge)
TORCH_BASELINE_OPS = {"matmul": "torch_matmul_attention", "sdpa": "torch_sdpa_attention"}
FLASHINFER_OP = "flashinfer_mla_prefix"  # FlashInfer's MLA over the prefix alone (no tree mask)


def attention_version(impl: str, parameters: dict) -> int | None:
    """The kernel version a recorded impl name ran: `kdlib.cuda.attention.IMPLS`, with 'mma' read as the
    payload's recorded `mma_default` and 'auto' as its `resolved_impls` (None where the file does not
    say which version those names meant when it was recorded)."""
    # here, not at the top: kdlib.memory and the estimator read results and import no numpy (test_config)
    from kdlib.cuda.attention import IMPLS

    impl = (parameters.get("resolved_impls") or {}).get(impl, impl)
    if impl == "mma":
        impl = parameters.get("mma_default")
    return None if impl in (None, "mma", "auto") else IMPLS.get(impl)


def attention_shape(p: dict) -> dict:
    """The sweep point of a verify-attention row: heads, queries, batch and prefix (None for a ragged
    batch, which adds its per-request `lens` and `trees` as tuples)."""
    shape = {k: int(p[k]) for k in ("heads", "queries", "batch")}
    shape["prefix"] = None if p.get("prefix") is None else int(p["prefix"])
    if p.get("lens"):
        shape["lens"] = tuple(int(n) for n in p["lens"])
        shape["trees"] = tuple(int(n) for n in p["trees"])
    return shape


def _verify_point_rows(p: dict, parameters: dict) -> list[Row]:
    """The rows of one verify-attention point: each kernel variant (graph replay), the torch baselines
    that ran (their recorded mode) and FlashInfer's prefix; all carry the point's bytes, FLOPs and floor."""
    shape = attention_shape(p)
    cost = (p["bytes"], p["flops"])
    out = []
    kernels = {impl: (v.get("kernel"), f"variants.{impl}.kernel")
               for impl, v in (p.get("variants") or {}).items()}
    if not kernels:  # an older sweep: one kernel, its impl named by the point, else 'auto'
        kernels = {p.get("impl", "auto"): (p.get("kernel"), "kernel")}
    for impl, (t, key) in kernels.items():
        if _is_timing(t):
            version = attention_version(impl, parameters)
            out.append(_timed(VERIFY_OP, version, "graph", "", shape, t, *cost, key, p["floor_ms"]))
    for name, b in (p.get("baselines") or {}).items():
        if _is_timing(b):
            out.append(_timed(TORCH_BASELINE_OPS[name], None, b.get("mode", "graph"), "", shape, b, *cost,
                              f"baselines.{name}", p["floor_ms"]))
    fi = flashinfer_best(p.get("flashinfer"))
    if fi is not None:
        out.append(_timed(FLASHINFER_OP, None, fi[0].get("mode", "eager"), "prefix_only", shape, fi[0], *cost,
                          fi[1], p["floor_ms"]))
    return out


def flashinfer_best(rec) -> tuple[dict, str] | None:
    """FlashInfer's faster timing of a verify-attention point's record (the attention suite's
    `flashinfer`: its eager runs, and since a36feef `graph`, the same runs replayed from CUDA graphs)
    -> (timing block, its key in the point), or None where it did not run."""
    if not _is_timing(rec):
        return None
    graph = rec.get("graph")
    return (graph, "flashinfer.graph") if _is_timing(graph) and graph["median_ms"] < rec["median_ms"] \
        else (rec, "flashinfer")


def attention_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of an attention payload (kdlib/perf/suites/attention.py), at every point that ran:

    op 'tree_verify_attention' for each kernel variant (the whole verify replayed from a CUDA graph;
    version from `attention_version`: wgmma 5, mma_v3 3), 'torch_matmul_attention' / 'torch_sdpa_attention'
    for the PyTorch baselines (uniform points only; mode as recorded, graph where capture worked) and
    'flashinfer_mla_prefix' (variant 'prefix_only': FlashInfer over the prefix alone, its faster mode,
    `flashinfer_best`: eager, or since a36feef replayed from CUDA graphs where that is faster; since
    2026-12-03 over the point's rotated tables, before over one). Every row
    carries its point's bytes, FLOPs and floor (those of the whole verify: FlashInfer's prefix-only run
    moves slightly less). Issue 19's goal table (`goals`) and the variants' agreement
    (`rel_diff_between_variants`) are not timings: read them from `Recorded.doc`."""
    params = doc.get("parameters") or {}
    return tuple(r for p in doc.get("points") or [] for r in _verify_point_rows(p, params))


def load_attention(gpu: str = "h200") -> Recorded | None:
    """The recorded attention suite on `gpu` with its tidy rows (`attention_rows`), or None."""
    return _recorded("attention", gpu, attention_rows)


GATHER_OP = "gather_read"


def attention_bounds_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of an attention_bounds payload (kdlib/perf/suites/attention_bounds.py), at each (heads,
    queries, prefix, batch) point: op 'tree_verify_attention' (the payload's `version`, graph replay) with
    variant 'scattered' or 'sequential' (the page tables), the point's bytes, FLOPs and copy floor; op
    'gather_read' (version 1, graph) with variant '<tables>_<arm>' (e.g. 'scattered_bulk'), the rows and
    slots it read as bytes, no FLOPs, no floor. The kernels' device times per verify (`verify.*.kernels`),
    the floors (copy, gather, FLOPs, padded FLOPs) and the probe's exactness are in `Recorded.doc`."""
    version = (doc.get("parameters") or {}).get("version")
    out = []
    for p in doc.get("points") or []:
        shape = {k: p[k] for k in ("heads", "queries", "prefix", "batch")}
        for tables, v in (p.get("verify") or {}).items():
            out.append(_timed(VERIFY_OP, version, "graph", tables, shape, v["timing"], p["bytes"], p["flops"],
                              f"verify.{tables}.timing", p["floors_ms"]["copy"]))
        for tables, g in (p.get("gather") or {}).items():
            for arm, a in g["arms"].items():
                out.append(_timed(GATHER_OP, 1, "graph", f"{tables}_{arm}", shape, a["timing"], a["bytes"],
                                  0.0, f"gather.{tables}.arms.{arm}.timing"))
    return tuple(out)


def load_attention_bounds(gpu: str = "h200") -> Recorded | None:
    """The recorded attention_bounds suite on `gpu` with its tidy rows (`attention_bounds_rows`), or None."""
    return _recorded("attention_bounds", gpu, attention_bounds_rows)


def attention_fp8_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of an attention_fp8 payload (kdlib/perf/suites/attention_fp8.py), at each point
    (`attention_shape`: heads, queries, prefix, batch; a ragged batch's lens and trees): op
    'tree_verify_attention' (version 10, graph replay) with variant 'bf16' (the bf16 pool), 'fp8' (the FP8
    layout, the -DTV_FP8=1 build) or, where recorded, 'fp8_dequant_first' (the FP8 layout gathered into a
    bf16 pool first), the median of its rounds' medians (no quantiles: NaN), that pool's bytes, the FLOPs and
    the floor. The rounds, the gather alone, the bit-for-bit checks and the error are in `Recorded.doc`."""
    version = (doc.get("parameters") or {}).get("version")
    out = []
    for p in doc.get("points") or []:
        shape = attention_shape(p)
        for arm, a in p["arms"].items():
            out.append(_timed(VERIFY_OP, version, "graph", arm, shape, {"median_ms": a["ms"]}, a["bytes"],
                              p["flops"], f"arms.{arm}.ms", a["floor_ms"]))
    return tuple(out)


def load_attention_fp8(gpu: str = "h200") -> Recorded | None:
    """The recorded attention_fp8 suite on `gpu` with its tidy rows (`attention_fp8_rows`), or None."""
    return _recorded("attention_fp8", gpu, attention_fp8_rows)


# ---- one TP8 rank of Kimi-K2.6 (suite k2_rank)
K2_RANK_OP = "k2_rank_step"


def k2_rank_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of a k2_rank payload (kdlib/perf/suites/k2_rank.py): op 'k2_rank_step', version None,
    at each measured (context, streams, method 'ar' | 'ddtree', budget, compiled, routing) shape:

    variant '' the whole step, 'draft' / 'tree' / 'verify' / 'accept' / 'commit' each part in its own
    graph (the parts the method has), 'dense' / 'attention' / 'moe' the verify forward's pieces each alone
    over all layers. mode 'graph', or 'eager' where that capture failed (`graph_errors`). floor_ms is
    the component's recorded floor (the step's: `floor_sum_ms`; the verify part has none); bytes and
    FLOPs are NaN (the payload records a floor's memory and compute terms, `floors`, not its bytes).
    The memory check, the modelled all-reduce, the accepted lengths, tokens/s and the cut rows are not
    timings: read them from `Recorded.doc`."""
    out = []
    for r in doc.get("rows") or []:
        shape = {"context": int(r["context"]), "streams": int(r["streams"]), "method": r["method"],
                 "budget": None if r["budget"] is None else int(r["budget"]),
                 # a plain and a compiled row of one point are two measurements (rows before the routing
                 # setting used the router's own choice)
                 "compiled": bool(r.get("compiled", False)), "routing": r.get("routing", "router")}
        errors = r.get("graph_errors") or {}
        floors = r.get("floors") or {}
        timed = [("", "step", r.get("step"))]
        timed += [(k, f"parts.{k}", t) for k, t in (r.get("parts") or {}).items()]
        timed += [(k, f"pieces.{k}", t) for k, t in (r.get("pieces") or {}).items()]
        for variant, key, t in timed:
            if not _is_timing(t):
                continue
            floor = floors[variant]["floor_ms"] if variant in floors else None
            mode = "eager" if errors.get(variant or "step") else "graph"
            out.append(_timed(K2_RANK_OP, None, mode, variant, shape, t, math.nan, math.nan, key,
                              floor if variant else r.get("floor_sum_ms")))
    return tuple(out)


def load_k2_rank(gpu: str = "h200") -> Recorded | None:
    """The recorded k2_rank suite on `gpu` with its tidy rows (`k2_rank_rows`), or None."""
    return _recorded("k2_rank", gpu, k2_rank_rows)


# ---- one layer of that rank, piece by piece (suite k2_layer)
K2_LAYER_OP = "k2_layer_piece"


def k2_layer_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of a k2_layer payload (kdlib/perf/suites/k2_layer.py): op 'k2_layer_piece', version None,
    variant the piece ('dense_first', 'dense', 'attention', 'moe', 'head', 'draft', 'tree', 'accept',
    'commit'), mode 'graph' or 'eager' (a failed capture), shape {piece, layers_per_graph, context,
    streams, rows_per_stream, m_rows, budget, method}, the piece's time, bytes, FLOPs and floor per call
    (layers_per_graph 1 in files of one layer a graph). The kernels per call, the device time and the
    graph overhead are not timings: read them from the payload rows (`Recorded.doc`)."""
    out = []
    for r in doc.get("rows") or []:
        shape = {"piece": r["piece"], "layers_per_graph": int(r.get("layers_per_graph", 1)),
                 "context": int(r["context"]),
                 "streams": int(r["streams"]), "rows_per_stream": int(r["rows_per_stream"]),
                 "m_rows": int(r["m_rows"]), "budget": None if r["budget"] is None else int(r["budget"]),
                 "method": r["method"]}
        if _is_timing(r.get("timing")):
            out.append(_timed(K2_LAYER_OP, None, r["mode"], r["piece"], shape, r["timing"], r["bytes"],
                              r["flops"], "timing", r["floor"]["floor_ms"]))
    return tuple(out)


def load_k2_layer(gpu: str = "h200") -> Recorded | None:
    """The recorded k2_layer suite on `gpu` with its tidy rows (`k2_layer_rows`), or None."""
    return _recorded("k2_layer", gpu, k2_layer_rows)


def verify_attention_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of a verify-attention sweep (kdlib/perf/suites/_attention.py, recorded alone as
    verify_attention_dev / verify_attention_dev_v2, or embedded in the kernels payload): as
    `attention_rows`, at every (heads, queries, prefix, batch) point. A point's top-level `kernel` copies
    its first variant and is not read twice; a sweep without variants (verify_attention_dev_v2) gives its
    one kernel, version None (the file names it only as impl 'auto', not which version that was). The
    sweep's GPU test outcomes (`gpu_tests`) and the points left out for time are in `Recorded.doc`."""
    return attention_rows(doc)


def load_verify_attention_dev(gpu: str = "h200") -> Recorded | None:
    """The recorded verify_attention_dev sweep on `gpu` (`verify_attention_rows`), or None."""
    return _recorded("verify_attention_dev", gpu, verify_attention_rows)


def load_verify_attention_dev_v2(gpu: str = "h200") -> Recorded | None:
    """The recorded verify_attention_dev_v2 sweep on `gpu` (the first tensor-core version's;
    `verify_attention_rows`), or None."""
    return _recorded("verify_attention_dev_v2", gpu, verify_attention_rows)


# ---- the tree kernels (suite kernels)
TREE_SHAPE = ("batch", "depth", "budget", "k_prime")


_GRAPH, _EAGER = ("graph_replay", None, "graph", ""), ("eager", None, "eager", "")
# kernels payload section -> (op, shape keys, arms: (timing key, op of another arm or None, mode, variant));
# "x" stands for the back-to-back graph, gpu_graph_x<repeat_per_graph>
_KERNEL_SECTIONS = {
    "tree_build": ("tree_build", TREE_SHAPE, (
        ("gpu_eager", None, "eager", ""), ("gpu_graph_replay", None, "graph", ""), "x",
        ("cpu_ref", "tree_build_ref", "cpu", ""),
        ("cpu_ref_with_copies", "tree_build_ref", "cpu", "with_copies"))),
    "tree_build_tied": ("tree_build", ("batch",), ("x",)),
    "accept": ("tree_accept", ("batch",), (_GRAPH, "x", ("cpu_ref", "tree_accept_ref", "cpu", ""))),
    "sample": ("tree_sample_rows", ("batch", "vocab", "dtype"), (_EAGER,)),
    "compact": ("kv_compact", ("batch", "layers", "row_bytes", "moved_rows"), (_GRAPH,)),
    "remap": ("page_remap", ("batch",), (_GRAPH,)),
    "step": ("tree_step", ("batch",), (_GRAPH, _EAGER)),
}


def kernels_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of a kernels payload (kdlib/perf/suites/kernels.py), per batch:

    'tree_build' (version as recorded; shape batch, depth, budget, k_prime; the tied inputs add
    inputs='tied'), 'tree_accept', 'tree_sample_rows' (eager), 'kv_compact' (its bytes, FLOPs 0 and
    floor), 'page_remap', 'tree_step' (build -> stand-in verify -> accept -> compact). Modes: 'eager'
    (one launch between events), 'graph' variant '' (a graph of one launch: what a captured step
    pays) and 'graph' variant 'back_to_back' (a graph of `repeat_per_graph` launches, replay time / that
    count: the suite's kernel_us). The numpy references are op '<op>_ref' (no kernel version), mode
    'cpu', timed again beside each kernel version (variant 'with_copies': plus the device->host->device
    copies). key '<section>[i].<timing>' names the payload entry, so the rows of one entry (a kernel
    and the reference timed beside it) stay together. The other kernels have no byte / FLOP floor
    (bytes, FLOPs NaN). The embedded verify-attention sweep gives `verify_attention_rows`; the bit-exact
    checks and the headline are in `Recorded.doc`."""
    params = doc.get("parameters") or {}
    per = int(params.get("repeat_per_graph", 1))
    back_to_back = (f"gpu_graph_x{per}", None, "graph", "back_to_back")
    out = []
    for section, (op, keys, arms) in _KERNEL_SECTIONS.items():
        for i, r in enumerate(doc.get(section) or []):
            shape = _shape(r, *keys)
            if section == "tree_build_tied":
                shape = {**shape, **_shape(params, *TREE_SHAPE[1:]), "inputs": "tied"}
            nbytes, flops = (r["bytes"], 0.0) if section == "compact" else (math.nan, math.nan)
            for arm in arms:
                key, arm_op, mode, variant = back_to_back if arm == "x" else arm
                if _is_timing(r.get(key)):
                    version = None if arm_op else r.get("version")
                    out.append(_timed(arm_op or op, version, mode, variant, shape, r[key], nbytes, flops,
                                      f"{section}[{i}].{key}", r.get("floor_ms"), per if arm == "x" else 1))
    va = doc.get("verify_attention")
    if isinstance(va, dict) and va.get("points"):
        out += attention_rows(va)
    return tuple(out)


def load_kernels(gpu: str = "h200") -> Recorded | None:
    """The recorded kernels suite on `gpu` with its tidy rows (`kernels_rows`), or None."""
    return _recorded("kernels", gpu, kernels_rows)


# ---- sampled acceptance's draw (suite accept; the sampling part recorded alone as accept_sampling)
def accept_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of an accept payload (kdlib/perf/suites/accept.py): its `sampling` part, op
    'tree_sample_rows' (version as recorded; shape rows, vocab, dtype), a CUDA graph of back-to-back
    draws, replay time / `draws_per_graph` (the suite's kernel_us); bytes as recorded, FLOPs 0, floor
    the recorded `floor_us`. The acceptance part (`accept`: mean accepted lengths per text kind and
    method) counts tokens and times nothing: read it from `Recorded.doc`."""
    sampling = doc.get("sampling") or {}
    dtype = (sampling.get("parameters") or {}).get("dtype")
    out = []
    for p in sampling.get("points") or []:
        if _is_timing(p.get("graph_replay")):
            shape = {"rows": p["rows"], "vocab": p["vocab"], "dtype": dtype}
            out.append(_timed("tree_sample_rows", p.get("version"), "graph", "", shape, p["graph_replay"],
                              p["bytes"], 0.0, "graph_replay", p["floor_us"] * 1e-3,
                              int(p["draws_per_graph"])))
    return tuple(out)


def load_accept(gpu: str = "h200") -> Recorded | None:
    """The recorded accept suite on `gpu` (`accept_rows`: none where it holds acceptance only), or None."""
    return _recorded("accept", gpu, accept_rows)


def load_accept_sampling(gpu: str = "h200") -> Recorded | None:
    """The recorded accept_sampling file on `gpu` (the accept suite's sampling part alone, `accept_rows`),
    or None."""
    return _recorded("accept_sampling", gpu, accept_rows)


# ---- the engines (suites engine, engine_batch, engine_arms, tp)
ENGINE_STEP_OP = "engine_step"  # one step of kdlib.engine.generate's eager loop (host clock, synchronised)
BATCH_STEP_OP = "batch_engine_step"  # one BatchEngine.step: a graph replay and its one wait (host clock)
RUN_SHAPE = ("model", "kind", "method", "context", "budget", "block", "p_wrong", "concurrency", "top_k")


def engine_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of an engine payload (kdlib/perf/suites/engine.py):

    op 'engine_step' (mode 'eager': the median step of a generate run, wall clock around synchronised
    phases; variant the verify attention, 'torch' or 'ops', '' where the run does not say) for `runs`,
    `runs_kernel_attention` (model 'bench') and `trained.runs` (model 'trained', per text kind);
    op 'verify_forward' (CUDA events; shape dtype, context, q, budget; its bytes, FLOPs and floor) for
    `verify_forward` and `bf16.verify_forward`; op 'dflash_draft' (CUDA events; bytes, FLOPs NaN).
    Tokens/s, accepted lengths, per-phase medians, repeats and the AR comparisons are in `Recorded.doc`."""
    out = []
    runs = [("runs", "bench", r) for r in doc.get("runs") or []]
    runs += [("runs_kernel_attention", "bench", r) for r in doc.get("runs_kernel_attention") or []]
    runs += [("trained.runs", "trained", r) for r in (doc.get("trained") or {}).get("runs") or []]
    for key, model, r in runs:
        shape = _shape({"model": model, **r}, *RUN_SHAPE)
        out.append(_timed(ENGINE_STEP_OP, None, "eager", r.get("attention", ""), shape, _step_timing(r),
                          math.nan, math.nan, key))
    vf = [("verify_forward", r) for r in doc.get("verify_forward") or []]
    vf += [("bf16.verify_forward", r) for r in (doc.get("bf16") or {}).get("verify_forward") or []]
    for key, r in vf:
        shape = _shape(r, "dtype", "context", "q", "budget")
        out.append(_timed("verify_forward", None, "eager", r["attention"], shape, r, r["bytes"], r["flops"],
                          key, r.get("floor_ms")))
    for r in doc.get("dflash_draft") or []:
        shape = _shape(r, "context", "layers", "block")
        out.append(_timed("dflash_draft", None, "eager", "", shape, r, math.nan, math.nan, "dflash_draft"))
    return tuple(out)


def load_engine(gpu: str = "h200") -> Recorded | None:
    """The recorded engine suite on `gpu` with its tidy rows (`engine_rows`), or None."""
    return _recorded("engine", gpu, engine_rows)


BATCH_SHAPE = ("model", "kind", "context", "method", "budget", "streams")


def _batch_rows(rows, key: str, variant) -> list[Row]:
    return [_timed(BATCH_STEP_OP, None, "graph", variant(r), _shape(r, *BATCH_SHAPE), _step_timing(r),
                   math.nan, math.nan, key) for r in rows]


def engine_batch_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of an engine_batch payload (kdlib/perf/suites/engine_batch.py): op 'batch_engine_step'
    (mode 'graph': the wall step, host time of one BatchEngine.step; variant 'compiled' for the
    `compiled` section's torch.compile rows) of `trained`, `bench` and `compiled`, and op 'engine_step'
    (mode 'eager', median only) of the eager single-stream loop (`baselines.eager_loop`). Bytes and
    FLOPs NaN. The profiler's device time, busy, tokens/s, accepted lengths, tokens, transformers'
    generate and the goals are not step timings: read them from `Recorded.doc`
    (kdlib.perf.engine_batch_view tabulates them)."""
    out = []
    for key in ("trained", "bench", "compiled"):
        out += _batch_rows(doc.get(key) or [], key, lambda r: "compiled" if r.get("compiled") else "")
    for r in (doc.get("baselines") or {}).get("eager_loop") or []:
        out.append(_timed(ENGINE_STEP_OP, None, "eager", "", _shape(r, "method", "budget"), _step_timing(r),
                          math.nan, math.nan, "baselines.eager_loop"))
    return tuple(out)


def load_engine_batch(gpu: str = "h200") -> Recorded | None:
    """The recorded engine_batch suite on `gpu` with its tidy rows (`engine_batch_rows`), or None."""
    return _recorded("engine_batch", gpu, engine_batch_rows)


def engine_arms_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of an engine_arms payload (kdlib/perf/suites/engine_arms.py): op 'batch_engine_step'
    (mode 'graph', the wall step) per row, variant its arm ('graphs', 'overlap', 'compile',
    'compile+overlap').
    Device times, spans, tokens/s and the rows cut for time are in `Recorded.doc`."""
    return tuple(_batch_rows(doc.get("rows") or [], "rows", lambda r: r.get("arm", "")))


def load_engine_arms(gpu: str = "h200") -> Recorded | None:
    """The recorded engine_arms suite on `gpu` with its tidy rows (`engine_arms_rows`), or None."""
    return _recorded("engine_arms", gpu, engine_arms_rows)


def tp_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of a tp payload (kdlib/perf/suites/tp.py): op 'engine_step' (mode 'eager', variant the
    engine: 'tp' or 'single'; shape world, method, moe_mode) per run, and op 'nccl_allreduce' (shape
    world, rows; its bytes, FLOPs 0; recorded in us, given in ms): mode 'eager' from `allreduce`, mode
    'graph' from `allreduce_graph` (per collective of a graph of 20). The all-reduce fits, shares,
    logit differences and rank checks are in `Recorded.doc`."""
    out = []
    for r in doc.get("runs") or []:
        shape = _shape(r, "world", "method", "moe_mode")
        out.append(_timed(ENGINE_STEP_OP, None, "eager", r["engine"], shape, _step_timing(r), math.nan,
                          math.nan, "runs"))
    for key, mode in (("allreduce", "eager"), ("allreduce_graph", "graph")):
        for r in doc.get(key) or []:
            if "median_us" not in r:
                continue
            t = {f"{q}_ms": r[f"{q}_us"] * 1e-3 for q in ("median", "p10", "p90") if f"{q}_us" in r}
            shape = _shape(r, "world", "rows")
            out.append(_timed("nccl_allreduce", None, mode, "", shape, t, r["bytes"], 0.0, key))
    return tuple(out)


def load_tp(gpu: str = "h200") -> Recorded | None:
    """The recorded tp suite on `gpu` with its tidy rows (`tp_rows`), or None."""
    return _recorded("tp", gpu, tp_rows)


# ---- fragmentation, diagnosis, serve
def fragmentation_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of a fragmentation payload (kdlib/perf/suites/fragmentation.py), per point and KV layout
    (shape heads, queries, prefix, layout 'contiguous' | 'simulated' | 'random'), each a graph replay:
    op 'prefix_attention' (kdlib.cuda.attention's prefix kernel + combine, version None: the file does
    not record it) and 'torch_matmul_attention' (gather + bmm + softmax + bmm), with the point's bytes,
    FLOPs and floor; 'torch_index_select' (the gather alone: bytes NaN, FLOPs 0, no floor). The layouts'
    statistics and the slowdowns against contiguous are in `Recorded.doc`."""
    out = []
    for p in doc.get("points") or []:
        point = ((p["bytes"], p["flops"]), p["floor_ms"])
        for layout, arms in (p.get("layouts") or {}).items():
            shape = {**_shape(p, "heads", "queries", "prefix"), "layout": layout}
            for key, op, (cost, floor) in (("kernel", "prefix_attention", point),
                                           ("torch", "torch_matmul_attention", point),
                                           ("gather", "torch_index_select", ((math.nan, 0.0), None))):
                t = arms.get(key)
                if _is_timing(t):
                    out.append(_timed(op, None, t.get("mode", "graph"), "", shape, t, *cost,
                                      f"layouts.{layout}.{key}", floor))
    return tuple(out)


def load_fragmentation(gpu: str = "h200") -> Recorded | None:
    """The recorded fragmentation suite on `gpu` with its tidy rows (`fragmentation_rows`), or None."""
    return _recorded("fragmentation", gpu, fragmentation_rows)


def _no_rows(doc: dict) -> tuple[Row, ...]:
    return ()


def load_diagnosis(gpu: str = "h200") -> Recorded | None:
    """The recorded diagnosis suite on `gpu`, or None. It has no rows: its figures are wall-clock seconds
    and tokens/s of whole requests (two-point and sustained runs, their decompositions), not timings of
    an op; read them from `Recorded.doc` (`sweep`, `by_kind`)."""
    return _recorded("diagnosis", gpu, _no_rows)


def load_kernel_ab(gpu: str = "h200", suite: str = "kernel_ab") -> Recorded | None:
    """The recorded tools/kernel_ab.py run on `gpu` (a kernel tree against another revision's, arms
    alternating in one process), or None; `suite` names the run (its --suite: "kernel_ab", version 7's job
    decode, "kernel_ab_plan", the plan in shared memory and the combine's loads ahead, "kernel_ab_prefetch",
    the producer's L2 prefetch against none, "kernel_ab_pdl", version 10 with programmatic dependent launch
    against without, "kernel_ab_trigger", its attend kernels triggering their dependents at their start
    or not, or "kernel_ab_rows", the combine with a warp per row against the 4-warp one). No rows: each
    point holds both arms' medians (`new_ms`, `old_ms`, `arm_medians_ms`),
    `old_over_new` and `bitwise_equal`; read `Recorded.doc["rows"]`."""
    return _recorded(suite, gpu, _no_rows)


def load_attention_gate(gpu: str = "h200") -> Recorded | None:
    """The recorded attention_gate suite on `gpu` (version 10's gate: the static and the snake deal timed at
    points of spread predicted gains), or None. No rows: read `Recorded.doc["rows"]` (predicted_gain,
    measured_gain, static_ms, snake_ms, bitwise_equal) and `doc["verdict"]` (the best threshold)."""
    return _recorded("attention_gate", gpu, _no_rows)


def load_plan_phases(gpu: str = "h200") -> Recorded | None:
    """The recorded `tools/plan_phases.py phases` run on `gpu` (the tree verify's version 10 plan kernel
    alone, clock64 stamps at its phases, three builds of PLAN_SMALL_REQS), or None. No rows: `doc["runs"]`
    maps "<build>_<shape>_<warm|cold>" to `phases_cycles` (16 medians, cycles after stamp 0; None where the
    build's path passes no such stamp), `doc["parameters"]` names the stamps, shapes and builds."""
    return _recorded("plan_phases", gpu, _no_rows)


def load_plan_cost(gpu: str = "h200") -> Recorded | None:
    """The recorded `tools/plan_phases.py cost` run on `gpu` (the whole verify with its plan kernel, with the
    plan reused, and with a do-nothing kernel before a reused plan, interleaved rounds), or None. No rows:
    `doc["points"]` hold each arm's `medians_ms` and `rounds_ms` and the profiled kernels, aligned with
    `doc["parameters"]["points"]`."""
    return _recorded("plan_cost", gpu, _no_rows)


def load_attention_timeline(gpu: str = "h200") -> Recorded | None:
    """The recorded attention_timeline suite on `gpu` (the attend kernel's consumers stamped in cycles at each
    pair), or None. No rows: read `Recorded.doc["rows"]` (per point `segments`, `period`, `floor_cycles`,
    `sample`, `timing` of both builds, `bitwise_equal`)."""
    return _recorded("attention_timeline", gpu, _no_rows)


def load_register_budget(gpu: str = "cpu") -> Recorded | None:
    """The recorded `tools/register_budget.py` run (a CPU record: ptxas's report of version 10's attend
    kernels built with setmaxnreg's producer and consumer counts moved one at a time), or None. No rows:
    read `Recorded.doc["builds"]` (per build `producer`, `consumer`, each kernel's ptxas report)."""
    return _recorded("register_budget", gpu, _no_rows)


def load_code_size(gpu: str = "cpu") -> Recorded | None:
    """The recorded `tools/code_size.py` run (a CPU record: the SASS instructions of the verify's attend
    kernels by role, NVRTC and nvdisasm, no GPU), or None. No rows: read `Recorded.doc["rows"]` (per build
    `name`, `commit`, `kernel`, `rows_a_thread`, `instructions`, `roles`, `consumer_code`)."""
    return _recorded("code_size", gpu, _no_rows)


def load_same_build(gpu: str = "*.cpu") -> Recorded | None:
    """A recorded `tools/same_build.py` run (a CPU record: whether two commits build version 10's module
    to the same SASS), or None. Its files are named `same_build.<a>.<b>.cpu.json`: `gpu` is the name's tail,
    "<a>.<b>.cpu" for one pair of commits (7-hex), the default the latest of any. No rows: read
    `Recorded.doc["same"]` and `doc["builds"]` (per option set `options`, `same` and `kernels`: per kernel
    `same`, `instructions_*`, `sha256_*`)."""
    return _recorded("same_build", gpu, _no_rows)


def load_cluster_exchange(gpu: str = "h200") -> Recorded | None:
    """The recorded cluster_exchange suite on `gpu` (two CTAs of a cluster swapping a tile's partial S^T
    through distributed shared memory, against local stores and the barrier alone), or None. No rows: read
    `Recorded.doc["rows"]` (per mode `us_per_tile`, `cycles_per_tile`, `timing`, `exact`)."""
    return _recorded("cluster_exchange", gpu, _no_rows)


def load_wgmma_rate(gpu: str = "h200") -> Recorded | None:
    """The recorded wgmma_rate suite on `gpu` (each warpgroup MMA shape of the attend kernels alone on every
    SM), or None. No rows: read `Recorded.doc["rows"]` (per kind, n and warpgroups `cycles_per_wgmma`,
    `macs_per_clock`, `timing`, `exact`)."""
    return _recorded("wgmma_rate", gpu, _no_rows)


def load_verify_split(gpu: str = "h200") -> Recorded | None:
    """The recorded `tools/verify_split.py` run on `gpu` (each kernel's device time in one whole verify,
    against the graph-replayed verify, at issue 19's goal and 8 x 9 points), or None. No rows: `doc["arms"]`
    maps each build ("default", "-DNAME=VALUE") to a row per point of `doc["parameters"]["points"]`
    (`replay_ms`, `device_ms`, `kernels`: name, calls and us a verify)."""
    return _recorded("verify_split", gpu, _no_rows)


def load_verify_energy(gpu: str = "h200") -> Recorded | None:
    """The recorded `tools/verify_energy.py` run on `gpu` (the energy a call under sustained load, our whole
    verify and FlashInfer's prefix in interleaved rounds at issue 19's goal points), or None: read
    `Recorded.doc["rows"]` (per point `rounds`: each arm's rounds with `joules`, `median_ms`, `wall_ms`,
    `watts`, `sm_mhz`, `power_capped`; `energy_ratio_to_flashinfer` a round, the default verify's over
    FlashInfer's leaner arm; since the --impl arms, `arm_energy_ratios`: the same for each of our arms)."""
    return _recorded("verify_energy", gpu, _no_rows)


def load_gather_pair(gpu: str = "h200") -> Recorded | None:
    """The recorded `tools/gather_pair.py` run on `gpu` (two CTAs of a cluster that need the same rows, each
    fetching all of them or each half of them for both by TMA multicast), or None. No rows: `doc["arms"]`
    maps each arm ("dup", "mcast") to its grid, `exact`, full-clock `timing`, GB/s into shared memory and
    from L2, and its sustained `rounds` (`joules`, `median_ms`, `watts`, `sm_mhz`, `power_capped`);
    `doc["mcast_over_dup"]`: the energy ratio a round."""
    return _recorded("gather_pair", gpu, _no_rows)


def load_gather_stage(gpu: str = "h200") -> Recorded | None:
    """The recorded `tools/gather_stage.py` run on `gpu` (the verify's K-stage fill without its math, by
    16-byte cp.async copies or one TMA box a 128-byte row piece; and by two CTAs of a cluster that both need
    every tile, each fetching every row or half of them, pushed into the other's stage), or None. No rows:
    `doc["arms"]` maps each arm it ran ("cp16", "tma", "dup", "push") to its grid, `exact`, full-clock
    `timing`, `gbps` of rows (records since the pair arms also `delivered_gbps` and `l2_read_gbps`),
    `copies_a_tile`, and its sustained `rounds`; `doc["tma_over_cp16"]`, `doc["push_over_dup"]`: the energy
    ratio a round, where both arms ran."""
    return _recorded("gather_stage", gpu, _no_rows)


def load_kernel_ab_repeat(gpu: str = "h200") -> Recorded | None:
    """The recorded `tools/kernel_ab.py repeat` run on `gpu` (each arm n times at one point against a float64
    verify), or None. No rows: read `Recorded.doc["arms"]` (distinct outputs, spread, error per arm)."""
    return _recorded("kernel_ab_repeat", gpu, _no_rows)


def load_serve(gpu: str = "h200") -> Recorded | None:
    """The recorded serve suite on `gpu`, or None. It has no rows: its figures are a client's request
    latencies (TTFT / TPOT / ITL / end-to-end percentiles over requests), throughputs and goodput per
    concurrency, not timings of an op; read them from `Recorded.doc` (`by_arm`, `scaling`)."""
    return _recorded("serve", gpu, _no_rows)


# ---- the CPU suites (kdtr_io, tree_build_cpu)
def kdtr_io_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of a kdtr_io payload (kdlib/perf/suites/kdtr_io.py): op the format ('kdtr', 'npy', 'npz',
    'safetensors', 'raw_overwrite', 'raw_atomic'), variant the action ('save', 'load', 'load_noverify',
    'mmap_open', 'mmap_verify'), mode 'cpu'; shape total_bytes, n_tensors, dtype; bytes the data bytes,
    FLOPs 0. File sizes and GB/s are in `Recorded.doc`."""
    params = doc.get("parameters") or {}
    shape = _shape(params, "total_bytes", "n_tensors", "dtype")
    out = []
    for fmt, actions in (doc.get("formats") or {}).items():
        for action, a in actions.items():
            if isinstance(a, dict) and _is_timing(a.get("timing")):
                out.append(_timed(fmt, None, "cpu", action, shape, a["timing"], doc["data_bytes"], 0.0,
                                  f"formats.{fmt}.{action}.timing"))
    return tuple(out)


def load_kdtr_io(gpu: str = "cpu") -> Recorded | None:
    """The recorded kdtr_io suite (a CPU suite: `gpu` 'cpu') with its tidy rows (`kdtr_io_rows`), or None."""
    return _recorded("kdtr_io", gpu, kdtr_io_rows)


def tree_build_cpu_rows(doc: dict) -> tuple[Row, ...]:
    """Tidy rows of a tree_build_cpu payload (kdlib/perf/suites/tree_build_cpu.py): op 'tree_build_ref'
    (the numpy reference builder), mode 'cpu', shape batch, depth, budget, k_prime, from `headline`,
    `vs_batch` and `vs_budget` (each its own measurement: a shape in two of them is timed twice);
    bytes and FLOPs NaN."""
    timed = [("headline", doc.get("headline"))]
    timed += [(k, r) for k in ("vs_batch", "vs_budget") for r in doc.get(k) or []]
    return tuple(_timed("tree_build_ref", None, "cpu", "", _shape(r, *TREE_SHAPE), r, math.nan, math.nan, key)
                 for key, r in timed if _is_timing(r))


def load_tree_build_cpu(gpu: str = "cpu") -> Recorded | None:
    """The recorded tree_build_cpu suite (a CPU suite: `gpu` 'cpu') with its tidy rows, or None."""
    return _recorded("tree_build_cpu", gpu, tree_build_cpu_rows)


@dataclass(frozen=True)
class Ceilings:
    """What a floor divides by: the device-to-device copy rate and the bf16 matmul rate, and where
    they come from (a recorded file, or the stated fallback)."""

    bandwidth_Bps: float
    flop_rate: float
    source: str
    recorded: bool

    def as_dict(self) -> dict:
        """The block a payload records: bandwidth_Bps, flop_rate, source."""
        return {"bandwidth_Bps": self.bandwidth_Bps, "flop_rate": self.flop_rate, "source": self.source}


# What a suite divides by when no ceilings file is recorded: the device-to-device copy and the bf16
# 8k^3 matmul measured on an H200 (design/reference/kernels-perf.md).
FALLBACK_BW, FALLBACK_FLOPS = 4.3e12, 790e12


def ceilings(gpu: str | None = None) -> Ceilings:
    """The recorded ceilings of `gpu` (`data/results/ceilings.<gpu>.json`, a slug or its prefix such as
    'h100'), else the stated fallback; a recorded file without both figures is a ValueError naming it.
    None: those of the GPU this process runs on (a suite's), else the H200's, the workbook's reference GPU
    (on the CPU, or a GPU with no ceilings recorded; the source names the file)."""
    def find(slug: str) -> dict | None:  # 'h100' finds ceilings.h100-80gb-hbm3.json, as kdlib.hw does
        return load("ceilings", slug) or load("ceilings", f"{slug}-*")

    doc = find(gpu) if gpu else (find(gpu_slug(gpu_name())) or find("h200"))
    if doc is not None:
        values = (doc.get("copy_bandwidth_Bps"), doc.get("bf16_matmul_flops"))
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
            raise ValueError(f"{doc['_path']}: copy_bandwidth_Bps and bf16_matmul_flops must be positive "
                             f"numbers, got {values}")
        return Ceilings(float(values[0]), float(values[1]), doc["_path"], True)
    return Ceilings(FALLBACK_BW, FALLBACK_FLOPS, "no ceilings file recorded: 4.3 TB/s copy and 790 TFLOP/s "
                    "bf16, measured on an H200 (design/reference/kernels-perf.md)", False)
