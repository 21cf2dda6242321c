"""Hardware table: one JSON per GPU under `data/hw/`, every number with its source.

    spec = kdlib.hw.load("h200")        # dict: memory_bytes, hbm_bandwidth_Bps, bf16_dense_flops, ...
    kdlib.hw.all()                      # slug -> spec for every shipped GPU
    kdlib.hw.measured("h200")           # recorded ceilings (data/results/ceilings.h200.json) or None

Schema of a spec (units in the key names; rates are dense, no sparsity):
    name, slug, arch, memory_bytes (what the driver reports as total), hbm_bandwidth_Bps,
    bf16_dense_flops, fp8_dense_flops, fp4_dense_flops (None where the GPU has no FP4 tensor cores),
    int8_dense_ops, sm_count,
    interconnect: {kind: "nvlink" | "pcie", bandwidth_Bps_per_direction, latency_s (None if unknown)},
    sources: {field: citation}, notes.
Spec-sheet figures are peaks; measured ceilings (what a copy kernel or a bf16 matmul reaches) come
from `measured`, never from this table.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

from kdlib import DATA, perf

HW_DIR = DATA / "hw"

REQUIRED = (
    "name", "slug", "memory_bytes", "hbm_bandwidth_Bps", "bf16_dense_flops", "fp8_dense_flops",
    "fp4_dense_flops", "int8_dense_ops", "sm_count", "interconnect", "sources", "notes",
)
INTERCONNECT_KINDS = ("nvlink", "pcie")


def _validate(spec: dict, path: Path) -> dict:
    missing = [k for k in REQUIRED if k not in spec]
    if missing:
        raise ValueError(f"{path.name}: missing field(s) {missing}")
    if spec["slug"] != path.stem:
        raise ValueError(f"{path.name}: slug {spec['slug']!r} does not match the file name")
    link = spec["interconnect"]
    for k in ("kind", "bandwidth_Bps_per_direction", "latency_s"):
        if k not in link:
            raise ValueError(f"{path.name}: interconnect lacks {k!r}")
    if link["kind"] not in INTERCONNECT_KINDS:
        raise ValueError(f"{path.name}: interconnect kind {link['kind']!r} not in {INTERCONNECT_KINDS}")
    def positive(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf

    for k in ("memory_bytes", "hbm_bandwidth_Bps", "bf16_dense_flops", "fp8_dense_flops", "int8_dense_ops"):
        if not positive(spec[k]):
            raise ValueError(f"{path.name}: {k} must be a positive number, got {spec[k]!r}")
    if spec["fp4_dense_flops"] is not None and not positive(spec["fp4_dense_flops"]):
        raise ValueError(f"{path.name}: fp4_dense_flops must be None or a positive number, "
                         f"got {spec['fp4_dense_flops']!r}")
    if isinstance(spec["sm_count"], bool) or not isinstance(spec["sm_count"], int) or spec["sm_count"] < 1:
        raise ValueError(f"{path.name}: sm_count must be a positive int, got {spec['sm_count']!r}")
    if not positive(link["bandwidth_Bps_per_direction"]):
        raise ValueError(f"{path.name}: interconnect bandwidth_Bps_per_direction must be a positive number, "
                         f"got {link['bandwidth_Bps_per_direction']!r}")
    if link["latency_s"] is not None and not positive(link["latency_s"]):
        raise ValueError(f"{path.name}: interconnect latency_s must be None or a positive number, "
                         f"got {link['latency_s']!r}")
    unsourced = [k for k in REQUIRED[2:9] if k not in spec["sources"]]
    if unsourced:
        raise ValueError(f"{path.name}: no source for {unsourced}")
    return spec


@cache
def _table() -> dict[str, dict]:
    return {p.stem: _validate(json.loads(p.read_text()), p) for p in sorted(HW_DIR.glob("*.json"))}


def slugs() -> list[str]:
    """The slugs of every shipped GPU spec, sorted."""
    return sorted(_table())


def all() -> dict[str, dict]:  # noqa: A001 - the public name the estimator reads
    """slug -> spec (a fresh copy) for every file in data/hw/."""
    return {slug: json.loads(json.dumps(spec)) for slug, spec in _table().items()}


def load(slug: str) -> dict:
    """The spec of one GPU (a fresh copy). ValueError naming the known slugs on a miss."""
    table = _table()
    if slug not in table:
        raise ValueError(f"unknown GPU {slug!r}; known: {', '.join(sorted(table))}")
    return json.loads(json.dumps(table[slug]))


def measured(slug: str) -> dict | None:
    """Recorded ceilings for `slug` (`data/results/ceilings.<slug>*.json`, with provenance), or None.

    The keys a ceilings suite records are `copy_bandwidth_Bps` and `bf16_matmul_flops`; the result
    also carries `provenance` and `_path` (show them with `kdlib.perf.describe`).
    """
    load(slug)  # a typo is an error, not a silent None
    # The perf slug comes from the driver's name ('NVIDIA RTX PRO 6000 Blackwell Server Edition'
    # -> 'rtx-pro-6000-blackwell-server-edition'), so a prefix match is needed for some GPUs.
    return perf.load("ceilings", gpu=slug) or perf.load("ceilings", gpu=f"{slug}-*")
