"""What one MoE layer call can reach at its size: the W4A16 kernels against pure streaming reads.

Two recorded payloads, as `kdlib.perf.load` returns them:

- `moe_stream` (suite `kdlib.perf.suites.moe_stream`): one launch of `kernels/stream_read/v1.cu`
  reads exactly the touched experts' weight + scale bytes of a layer call at M tokens, in several
  configurations (ring depth, bytes per stage, warps per SM, order); one configuration also reads
  them as two dependent launches (2/3 then 1/3, the gate/up + down split). Replayed from CUDA
  graphs, cold weights. Keys used: `suite`, `copy_bandwidth_Bps`, `sizes` ({"M=1": bytes, ...,
  "1GiB": bytes}), `stream` (rows with `size`, `bytes`, `config`, `warps_per_sm`, `frac_copy_bw`,
  optionally `two_launch_frac_copy_bw`; a failed configuration has `frac_copy_bw` None).
- `moe` (suite `kdlib.perf.suites.moe`): the W4A16 kernels per M. Keys used: `suite`,
  `copy_bandwidth_Bps`, `rows` (each with `m`, `bytes` and `<arm>_frac_copy_bw` per arm measured).

A pure read is the most any kernel reading the same bytes in one launch can reach; at small M its
fraction of copy bandwidth is far below the large-size figure (launch ramp-up and drain are not
amortised). Every fraction here is relative to the copy bandwidth measured in its own run (a
device-to-device copy counting read + write, so a pure read exceeds 1.0 at large sizes).

    ceil = stream_ceilings(kdlib.perf.load("moe_stream", "h200"))     # one row per M
    tab = ceiling_table(kdlib.perf.load("moe", "h200"), kdlib.perf.load("moe_stream", "h200"))
    v = verdict(tab, "v2 graph")                                      # which M <= 32 meet 70%
"""

from __future__ import annotations

import math
import re

import pandas as pd

# Issue 9: the touched experts' bytes at >= 70% of the measured copy bandwidth for every M <= 32.
GOAL_FRAC = 0.70
GOAL_M_MAX = 32

# (arm name, key prefix in a moe row): the fraction is `<prefix>_frac_copy_bw`. Eager arms launch
# from the host each call; graph arms replay a CUDA graph, as the stream ceilings do.
ARMS = (
    ("v1 eager", "kernel"),
    ("v1 graph", "kernel_graph"),
    ("v2 eager", "kernel_v2"),
    ("v2 graph", "kernel_v2_graph"),
    ("v3 eager", "kernel_v3"),
    ("v3 graph", "kernel_v3_graph"),
    ("default eager", "kernel_default"),        # what moe_w4a16 runs when no version is given
    ("default graph", "kernel_default_graph"),
)
CEILINGS = ("one_launch", "two_launch")

_SIZE_LABEL = re.compile(r"^M=(\d+)$")


def _require(payload, suite: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(payload, dict):
        raise ValueError(f"expected the recorded {suite!r} payload (a dict from kdlib.perf.load), "
                         f"got {type(payload).__name__}")
    got = payload.get("suite")
    if got != suite:
        raise ValueError(f"expected a payload of suite {suite!r}, got suite {got!r}")
    missing = [k for k in keys if k not in payload]
    if missing:
        raise ValueError(f"{suite!r} payload lacks {', '.join(missing)}")
    bw = payload["copy_bandwidth_Bps"]
    if not isinstance(bw, (int, float)) or not bw > 0:
        raise ValueError(f"{suite!r} payload: copy_bandwidth_Bps must be a positive number, got {bw!r}")
    return payload


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def stream_ceilings(stream: dict) -> pd.DataFrame:
    """Per M of the moe_stream sizes: the best one-launch streaming fraction and the two-launch one.

    Shape: one row per size labelled "M=<m>" in `stream["sizes"]` (the "1GiB" reference is left
    out), sorted by m. Columns: m (int), bytes (bytes one launch read), one_launch (best
    `frac_copy_bw` over the configurations that ran; NaN when none did), one_launch_config
    ("<config> w<warps per SM>" of that best), n_configs (configurations that ran at this size),
    two_launch (best `two_launch_frac_copy_bw` at this size; NaN when not measured).
    Raises ValueError when `stream` is not a moe_stream payload.
    """
    _require(stream, "moe_stream", ("copy_bandwidth_Bps", "sizes", "stream"))
    out = []
    for label, size_bytes in stream["sizes"].items():
        hit = _SIZE_LABEL.match(label)
        if not hit:
            continue
        rows = [r for r in stream["stream"] if r.get("size") == label]
        ran = [r for r in rows if _finite(r.get("frac_copy_bw"))]
        best = max(ran, key=lambda r: r["frac_copy_bw"]) if ran else None
        two = [r["two_launch_frac_copy_bw"] for r in rows if _finite(r.get("two_launch_frac_copy_bw"))]
        out.append({
            "m": int(hit.group(1)),
            "bytes": float(best["bytes"]) if best else float(size_bytes),
            "one_launch": float(best["frac_copy_bw"]) if best else math.nan,
            "one_launch_config": f"{best['config']} w{best['warps_per_sm']}" if best else "",
            "n_configs": len(ran),
            "two_launch": float(max(two)) if two else math.nan,
        })
    if not out:
        raise ValueError("moe_stream payload has no sizes labelled 'M=<m>'")
    return pd.DataFrame(out).sort_values("m").reset_index(drop=True)


def arms_present(moe: dict) -> list[str]:
    """Names (from ARMS) of the kernel arms with at least one finite fraction in `moe["rows"]`."""
    _require(moe, "moe", ("copy_bandwidth_Bps", "rows"))
    return [name for name, key in ARMS
            if any(_finite(r.get(f"{key}_frac_copy_bw")) for r in moe["rows"])]


def ceiling_table(moe: dict, stream: dict, *, m_max: int = 64) -> pd.DataFrame:
    """Each kernel arm present in `moe`, per M <= m_max, beside the pure-read ceilings at that M.

    Shape: long, one row per (m, arm) where the arm has a finite fraction at that m; arms the
    payload lacks (e.g. v3 before it is measured) have no rows. Sorted by m, then ARMS order.
    Columns: m, arm, frac_copy_bw (the kernel's, over its own bytes), kernel_bytes, stream_bytes,
    one_launch, two_launch (the ceilings at the same m; NaN when the stream suite did not measure
    that m, e.g. M = 9), ratio_one_launch, ratio_two_launch: the kernel's bytes/s over the pure
    read's bytes/s (each fraction times its own run's copy bandwidth, so the two copy measurements
    cancel out). Eager arms include host launch gaps; the ceilings are graph replays.
    Raises ValueError when either payload is not the expected suite, or m_max < 1.
    """
    _require(moe, "moe", ("copy_bandwidth_Bps", "rows"))
    if m_max < 1:
        raise ValueError(f"m_max must be >= 1, got {m_max}")
    ceil = stream_ceilings(stream).set_index("m")
    bw_k, bw_s = float(moe["copy_bandwidth_Bps"]), float(stream["copy_bandwidth_Bps"])
    present = set(arms_present(moe))
    out = []
    for row in sorted(moe["rows"], key=lambda r: r["m"]):
        m = int(row["m"])
        if m > m_max:
            continue
        c = ceil.loc[m] if m in ceil.index else None
        for name, key in ARMS:
            frac = row.get(f"{key}_frac_copy_bw")
            if name not in present or not _finite(frac):
                continue
            one = float(c["one_launch"]) if c is not None else math.nan
            two = float(c["two_launch"]) if c is not None else math.nan
            out.append({
                "m": m, "arm": name, "frac_copy_bw": float(frac),
                "kernel_bytes": float(row.get("bytes", math.nan)),
                "stream_bytes": float(c["bytes"]) if c is not None else math.nan,
                "one_launch": one, "two_launch": two,
                "ratio_one_launch": frac * bw_k / (one * bw_s) if one > 0 else math.nan,
                "ratio_two_launch": frac * bw_k / (two * bw_s) if two > 0 else math.nan,
            })
    cols = ["m", "arm", "frac_copy_bw", "kernel_bytes", "stream_bytes", "one_launch", "two_launch",
            "ratio_one_launch", "ratio_two_launch"]
    return pd.DataFrame(out, columns=cols)


def verdict(table: pd.DataFrame, arm: str, *, goal: float = GOAL_FRAC, m_max: int = GOAL_M_MAX,
            ceiling: str = "one_launch") -> dict:
    """Which M <= m_max an arm meets the goal at, and why it misses the others.

    `table` is `ceiling_table(...)`. A miss is `unreachable` when the goal is above the pure-read
    ceiling at that M (no kernel reading those bytes in one launch gets there), `reachable` when
    the ceiling is at or above the goal, `no_ceiling` when the stream suite did not measure that M.
    Returns {arm, goal, ceiling, m_max, met, unreachable, reachable, no_ceiling} (the last four:
    sorted lists of m) and `frac` / `ceil`: {m: value} for the M considered.
    Raises ValueError for an arm without rows, a ceiling other than CEILINGS, or a goal outside (0, 2).
    """
    if ceiling not in CEILINGS:
        raise ValueError(f"ceiling must be one of {CEILINGS}, got {ceiling!r}")
    if not 0 < goal < 2:
        raise ValueError(f"goal is a fraction of copy bandwidth in (0, 2), got {goal!r}")
    rows = table[(table.arm == arm) & (table.m <= m_max)]
    if rows.empty:
        have = sorted(set(table.arm)) if len(table) else []
        raise ValueError(f"arm {arm!r} has no rows at M <= {m_max} (arms in the table: {have})")
    out = {"arm": arm, "goal": goal, "ceiling": ceiling, "m_max": m_max,
           "met": [], "unreachable": [], "reachable": [], "no_ceiling": [], "frac": {}, "ceil": {}}
    for r in rows.sort_values("m").itertuples(index=False):
        m, frac, c = int(r.m), float(r.frac_copy_bw), float(getattr(r, ceiling))
        out["frac"][m], out["ceil"][m] = frac, c
        if frac >= goal:
            out["met"].append(m)
        elif math.isnan(c):
            out["no_ceiling"].append(m)
        elif c < goal:
            out["unreachable"].append(m)
        else:
            out["reachable"].append(m)
    return out


def format_verdict(v: dict) -> str:
    """One line per verdict: the arm, the goal, and the M in each class."""
    def ms(key):
        return ", ".join(map(str, v[key])) or "none"

    return (f"{v['arm']}: >= {v['goal']:.0%} of copy bandwidth at M = {ms('met')}; missed where the "
            f"{v['ceiling'].replace('_', '-')} ceiling is below the goal (unreachable) at M = "
            f"{ms('unreachable')}; "
            f"missed though reachable at M = {ms('reachable')}"
            + (f"; no ceiling measured at M = {ms('no_ceiling')}" if v["no_ceiling"] else ""))
