"""Result files with provenance: `data/results/<suite>.<gpu>.json`.

Every GPU figure the workbook shows comes from such a file. The provenance block names the GPU,
driver, CUDA / CuPy / torch versions, git commit (from $KDLIB_COMMIT when the tree travelled
without .git), the UTC date and the command that made it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from kdlib import DATA, ROOT

RESULTS = DATA / "results"


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


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA RTX PRO 6000 Blackwell ...' -> 'rtx-pro-6000-blackwell-...'."""
    s = re.sub(r"^nvidia\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "cpu"


def provenance(command: str | None = None) -> dict:
    """What produced a measurement: hardware, software versions, commit, date, command."""
    info = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "command": command or " ".join([os.path.basename(sys.executable)] + sys.argv),
        "python": platform.python_version(),
        "host_cpu": platform.processor() or platform.machine(),
        "gpu": "cpu",
        "driver": None,
        "cuda": None,
        "cupy": None,
        "torch": None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
            props = torch.cuda.get_device_properties(0)
            info["sm_count"] = props.multi_processor_count
            info["gpu_memory_bytes"] = props.total_memory
    except ImportError:
        pass
    try:
        import cupy

        info["cupy"] = cupy.__version__
        if info["gpu"] == "cpu" and cupy.cuda.runtime.getDeviceCount() > 0:
            info["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
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
    return info


def write(
    suite: str, payload: dict, *, out_dir: str | os.PathLike | None = None, command: str | None = None
) -> Path:
    """Write `{suite, provenance, **payload}` atomically to `<out_dir>/<suite>.<gpu>.json`."""
    prov = provenance(command)
    doc = {"suite": suite, "provenance": prov, **payload}
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{suite}.{gpu_slug(prov['gpu'])}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False, default=float) + "\n")
    os.replace(tmp, path)
    return path


def _recorded_order(path: Path) -> tuple[str, str]:
    """Sort key of a result file: its provenance date (ISO 8601 UTC, so it sorts as text; '' when the
    file records none), then its name."""
    date = (json.loads(path.read_text()).get("provenance") or {}).get("date") or ""
    return date, path.name


def load(suite: str, gpu: str | None = None) -> dict | None:
    """The recorded result of `suite` (on `gpu`, a slug or a glob such as 'h200' / 'h200-*'), or None.

    Where several files match, the one with the latest provenance date wins, ties broken by the
    greatest file name: the choice depends on the files' contents, never on when they were copied."""
    pattern = f"{suite}.{gpu}.json" if gpu else f"{suite}.*.json"
    paths = sorted(RESULTS.glob(pattern), key=_recorded_order)
    if not paths:
        return None
    doc = json.loads(paths[-1].read_text())
    doc["_path"] = str(paths[-1].relative_to(ROOT))
    return doc


def describe(result: dict) -> str:
    """One line saying where a recorded figure comes from."""
    p = result["provenance"]
    where = result.get("_path", "?")
    return (
        f"recorded on {p['gpu']} (driver {p.get('driver')}, CUDA {p.get('cuda')}, torch {p.get('torch')}, "
        f"CuPy {p.get('cupy')}), commit {p['commit'][:10]}, {p['date']}, by `{p['command']}` -> {where}"
    )
