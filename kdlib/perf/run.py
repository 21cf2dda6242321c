"""GPU entry point: `python3 -m kdlib.perf.run --suite NAME [--out DIR] [--quick]`.

A suite is a module `kdlib.perf.suites.<NAME>` with `run(args) -> dict` (the payload: parameters,
medians, quantiles, bytes and FLOPs with their floor). This script stamps it with provenance
and writes `<out>/<NAME>.<gpu>.json` (default out: data/results/).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from kdlib.perf import results, suites


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(suites.__path__))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m kdlib.perf.run", description=__doc__.splitlines()[0])
    ap.add_argument("--suite", required=True, action="append", help=f"one of {available()} (repeatable)")
    ap.add_argument("--out", default=None, help="folder for the result JSON (default data/results/)")
    ap.add_argument("--quick", action="store_true", help="a reduced sweep, for a smoke run")
    args = ap.parse_args(argv)
    unknown = [s for s in args.suite if s not in available()]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; available: {available()}")
    command = "python3 -m kdlib.perf.run " + " ".join(sys.argv[1:] if argv is None else argv)
    for name in args.suite:
        module = importlib.import_module(f"kdlib.perf.suites.{name}")
        payload = module.run(args)
        path = results.write(name, payload, out_dir=args.out, command=command)
        print(f"[perf] {name}: wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
