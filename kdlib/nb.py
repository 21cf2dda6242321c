"""Notebook helpers: set-up, recorded headline values, findings.

    env = kdlib.nb.setup(seed=0)          # style, seeds, and where we run (env.live: a GPU is here)
    kdlib.nb.record("tree_build_speedup_b64", 1234.0, unit="x", source=result["_path"])
    kdlib.nb.findings([f"... {value:.0f}x ..."])

`record` displays a JSON bundle of MIME type `application/vnd.kdlib.record+json`; the batch runner
(`kdlib.report`) reads these bundles from the executed notebook into `reports/index.html`,
and tests read them back to assert on headline values.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

from kdlib import plot
from kdlib.perf.results import json_value

RECORD_MIME = "application/vnd.kdlib.record+json"


def setup(seed: int = 0) -> SimpleNamespace:
    """Seed numpy/random/torch, apply the plot style, and report whether a GPU is live here.

    Returns env with: live (bool), device ('cuda' or 'cpu'), gpu (name or None).
    """
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    live, gpu = False, None
    try:
        import torch

        torch.manual_seed(seed)
        if torch.cuda.is_available():
            live, gpu = True, torch.cuda.get_device_name(0)
    except ImportError:
        pass
    plot.style()
    if live:
        print(f"GPU live: {gpu}. GPU sections measure now.")
    else:
        print("No GPU here: GPU sections render recorded results from data/results/ (provenance shown with "
              "each).")
    return SimpleNamespace(live=live, device="cuda" if live else "cpu", gpu=gpu, seed=seed)


def record(name: str, value, *, unit: str = "", source: str = "", note: str = "") -> None:
    """Record a headline value for the report index (and for tests that read the executed notebook).
    numpy / torch values are recorded as the Python values they hold; ValueError naming the record where
    any part is not finite (NaN, infinity) or has no JSON form (a complex number)."""
    from IPython.display import display

    try:  # numpy / torch values as the Python values they hold (the result files' conversion)
        value = json.loads(json.dumps(value, allow_nan=False, default=json_value))
    except ValueError:
        raise ValueError(f"recorded value {name!r} is not finite: {value}") from None
    except TypeError as e:
        raise ValueError(f"recorded value {name!r} has no JSON form ({e})") from None
    payload = {"name": name, "value": value, "unit": unit, "source": source, "note": note}
    text = f"{name} = {value}{(' ' + unit) if unit else ''}" + (f"  [{source}]" if source else "")
    display({RECORD_MIME: payload, "text/plain": text}, raw=True)


def findings(lines: list[str]) -> None:
    """Render the Findings list as Markdown (each bullet built from recorded values)."""
    from IPython.display import Markdown, display

    if isinstance(lines, str):
        raise ValueError("findings takes a list of lines (a str would give a bullet per character)")
    display(Markdown("\n".join(f"- {line}" for line in lines)))


def read_records(notebook_path) -> dict:
    """name -> payload of every value recorded in an executed notebook; ValueError where two cells
    record the same name."""
    import nbformat

    nb = nbformat.read(str(notebook_path), as_version=4)
    out, cells = {}, {}
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if RECORD_MIME in data:
                payload = data[RECORD_MIME]
                name = payload["name"]
                if name in out and cells[name] != i:  # the index would keep one of the two, silently
                    raise ValueError(f"{notebook_path}: {name!r} is recorded in cells {cells[name]} and {i}")
                out[name], cells[name] = payload, i
    return out
