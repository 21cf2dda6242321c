"""Bring recorded result files to `kdlib.perf.results.SCHEMA`: `python3 tools/migrate_results.py [--check]`.

Schema 1 (what `results.write` stamps): a top-level `"schema": 1`, and the copy-bandwidth block of the
moe, moe_stream and accept (`sampling`) payloads in the shape `kdlib.perf.timing.copy_bandwidth` and the
ceilings suite write: {method, bytes_per_copy, bytes_moved, timing, Bps, checked}. The files recorded
before it hold {bytes (= moved), timing, copy_bandwidth_Bps}: a memcpy of 1 GiB whose result nobody
compared with its source (`checked: false`). No measured value changes; --check only reports the files
that would change (exit 1 when any would).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdlib.files import atomic_write_text  # noqa: E402
from kdlib.perf.results import RESULTS, SCHEMA, dumps  # noqa: E402

# the commit whose data/results/ the migration was run on (tests/test_perf_results.py reads it back)
MIGRATED_FROM = "fd61de1"
MIGRATED_BY = "3b0298c"  # the commit that holds the migrated files


def _copy_block(c: dict) -> dict:
    """An old copy block -> the timing layer's shape (the same figures, renamed)."""
    if "Bps" in c:
        return c
    moved = c["bytes"]
    return {"method": "memcpy", "bytes_per_copy": moved // 2, "bytes_moved": moved, "timing": c["timing"],
            "Bps": c["copy_bandwidth_Bps"], "checked": False}


def migrate(doc: dict) -> dict:
    """`doc` at schema SCHEMA (a new dict; a file already there comes back equal)."""
    out = {}
    for key, value in doc.items():
        out[key] = value
        if key == "suite":
            out["schema"] = SCHEMA
    out.setdefault("schema", SCHEMA)
    if isinstance(out.get("copy"), dict):
        out["copy"] = _copy_block(out["copy"])
    sampling = out.get("sampling")
    if isinstance(sampling, dict) and isinstance(sampling.get("copy"), dict):
        out["sampling"] = {**sampling, "copy": _copy_block(sampling["copy"])}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 tools/migrate_results.py", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(RESULTS), help="folder of result files (default data/results/)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file would change")
    args = ap.parse_args(argv)
    folder = Path(args.dir)
    if not folder.is_dir():
        ap.error(f"{folder} is not a folder")
    texts, new = {}, {}
    for path in sorted(folder.glob("*.json")):  # every file read, parsed and migrated before any is written
        try:
            texts[path] = path.read_text(encoding="utf-8")
            doc = json.loads(texts[path])
        except OSError as e:  # a folder named *.json, an unreadable file
            ap.error(f"{path}: cannot be read ({e.strerror or e}); nothing migrated")
        except UnicodeDecodeError as e:  # before ValueError, which it is
            ap.error(f"{path}: not UTF-8 text ({e}); nothing migrated")
        except ValueError as e:
            ap.error(f"{path}: not JSON ({e}); nothing migrated")
        if not isinstance(doc, dict):
            ap.error(f"{path}: a result file holds a JSON object, not {type(doc).__name__}; nothing migrated")
        try:
            new[path] = dumps(migrate(doc))
        except (KeyError, TypeError) as e:
            ap.error(f"{path}: cannot be migrated ({type(e).__name__}: {e}, a copy block lacking a field?); "
                     "nothing migrated")
    changed = [path for path, text in texts.items() if new[path] != text]
    if not args.check:
        for path in changed:
            atomic_write_text(path, new[path])
    changed = [path.name for path in changed]
    print(f"{'would change' if args.check else 'migrated'} {len(changed)} file(s): "
          f"{', '.join(changed) or '-'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
