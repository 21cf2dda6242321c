"""GPU entry point: `python3 -m kdlib.perf.run --suite NAME [--out DIR] [--quick]`.

A suite is a module `kdlib.perf.suites.<NAME>` with a keyword-only `run(*, quick=False, ...) -> dict`
(the payload: parameters, medians, quantiles, bytes and FLOPs with their floor). This script calls
it with those of its options the suite's signature names (`quick`, `out`: see `ENTRY_OPTIONS`), so
notebooks and tests call the same `run` with plain keywords. A suite still written as `run(args)`
(one positional parameter) gets the argparse Namespace. The payload is stamped with provenance and
written to `<out>/<NAME>.<gpu>.json` (default out: data/results/).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys

from kdlib.cli import Parser, folder, make_folder
from kdlib.perf import results, suites

# The entry point's options a suite may take as keywords: `quick` (a reduced sweep) and `out` (the
# result folder, for a suite that writes partial results as it goes).
ENTRY_OPTIONS = ("quick", "out")


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(suites.__path__))


def is_keyword_only(fn) -> bool:
    """True when every parameter of `fn` is keyword-only (the suite form); False for `run(args)`."""
    return all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in inspect.signature(fn).parameters.values())


def suite_kwargs(fn, args: argparse.Namespace) -> dict:
    """The entry point's options (ENTRY_OPTIONS, from `args`) that the keyword-only `fn` accepts."""
    accepted = inspect.signature(fn).parameters
    return {name: getattr(args, name) for name in ENTRY_OPTIONS if name in accepted}


def call_suite(module, args: argparse.Namespace) -> dict:
    """`module.run(**suite_kwargs)`, or `module.run(args)` for a suite in the older `run(args)` form."""
    if not is_keyword_only(module.run):
        return module.run(args)
    kwargs = suite_kwargs(module.run, args)
    if args.quick and "quick" not in kwargs:
        print(f"[perf] {module.__name__} has no quick mode: --quick ignored", flush=True)
    return module.run(**kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="python3 -m kdlib.perf.run", description=__doc__.splitlines()[0])
    ap.add_argument("--suite", required=True, action="append", help=f"one of {available()} (repeatable)")
    ap.add_argument("--out", default=None, type=folder,
                    help="folder for the result JSON (default data/results/; made before any suite runs)")
    ap.add_argument("--quick", action="store_true", help="a reduced sweep, for a smoke run")
    args = ap.parse_args(argv)
    unknown = [s for s in args.suite if s not in available()]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; available: {available()}")
    modules = [(name, importlib.import_module(f"kdlib.perf.suites.{name}")) for name in args.suite]
    gpu_only = [n for n, m in modules if not (getattr(m, "CPU_ONLY", False) or getattr(m, "CPU_OK", False))]
    if gpu_only:
        import torch

        if not torch.cuda.is_available():
            ap.error(f"suite(s) {gpu_only} need a CUDA GPU, and torch sees none here")
    if args.out is not None:  # after the checks: a refused run leaves no folder behind
        make_folder(ap, args.out)
    command = "python3 -m kdlib.perf.run " + " ".join(sys.argv[1:] if argv is None else argv)
    for name, module in modules:
        payload = call_suite(module, args)
        # a host-only suite's file is <suite>.cpu.json on any machine (its loader reads that name)
        file = f"{name}.cpu" if getattr(module, "CPU_ONLY", False) else None
        path = results.write(name, payload, out_dir=args.out, command=command, name=file)
        print(f"[perf] {name}: wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
