"""Whether two commits build the same machine code for the default verify (issue 19), from the compiler alone.

A GPU record made at one commit stands for another's kernels only where both build to the same SASS. This tool
builds version 10's module (`kernels/tree_verify/wgmma_v10.cu`: its plan, attend and combine kernels, all the
default launches) as the loader builds it on the GPU (NVRTC, `tools/ncu_source.py`'s options without
-lineinfo, so line numbers that moved do not count) under every option set the wrapper passes it
(`kdlib.cuda.attention`: none, version 9's consumers at -DTV9_NR=8 and =16, each with and without -DTV_FP8=1),
at both commits, and compares each kernel's instructions one by one (nvdisasm, branch targets as offsets).

    python3 tools/same_build.py REV_A REV_B --out DIR   -> DIR/same_build.<a>.<b>.cpu.json
    exit 0: every kernel the same; 1: some differ (the record says which, and the first instruction that does)
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ncu_source as ns  # noqa: E402

from kdlib.cli import Terminated, interrupted_code, output_folder, sigterm_as_interrupt  # noqa: E402
from kdlib.cuda import attention as cu  # noqa: E402
from kdlib.cuda import loader  # noqa: E402
from kdlib.perf import results  # noqa: E402

STEM = cu.LAUNCHES[10].stem
_TEXT = re.compile(rb"\.text\.(\w+)\x00")  # a kernel's code section in the cubin's section names


def option_sets() -> list[tuple[str, ...]]:
    """The wrapper's options for version 10 (`attention._launch_wgmma`): its own, version 9's consumers at
    each row count they are built for, and each of those with the FP8 pool's."""
    v9 = sorted({cu.v9_options(rows) for rows in range(1, cu._V9_MAX_ROWS + 1)})
    base = [cu.LAUNCHES[10].options + extra for extra in [(), *v9]]
    return base + [o + cu.FP8_OPTIONS for o in base]


def build(lib, kernels: Path, options: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """{kernel: its SASS instructions} of the module built from `kernels` with `options`."""
    cubin = ns.compile_cubin(lib, kernels / f"{STEM}.cu", ns.nvrtc_options(kernels, options, lineinfo=False))
    names = sorted({m.decode() for m in _TEXT.findall(cubin)})
    return {k: tuple(x.sass for x in ns.disassemble(cubin, k, kernels)) for k in names}


def compare(a: dict[str, tuple[str, ...]], b: dict[str, tuple[str, ...]]) -> list[dict]:
    """A row per kernel of either build: its instruction count and hash in each, whether they are the same,
    and where not the first instruction that differs."""
    rows = []
    for k in sorted(a.keys() | b.keys()):
        row = {"kernel": k}
        for side, sass in (("a", a.get(k)), ("b", b.get(k))):
            row[f"instructions_{side}"] = None if sass is None else len(sass)
            digest = None if sass is None else hashlib.sha256("\n".join(sass).encode()).hexdigest()
            row[f"sha256_{side}"] = digest
        row["same"] = a.get(k) == b.get(k)
        if not row["same"] and k in a and k in b:
            common = min(len(a[k]), len(b[k]))  # past it the longer one's next instruction differs
            i = next((i for i in range(common) if a[k][i] != b[k][i]), common)
            row["first_difference"] = {"index": i, "a": a[k][i] if i < len(a[k]) else None,
                                       "b": b[k][i] if i < len(b[k]) else None}
        rows.append(row)
    return rows


def measure(rev_a: str, rev_b: str) -> dict:
    lib = loader.libnvrtc()
    sets = option_sets()
    with tempfile.TemporaryDirectory() as work:
        (sha_a, ka), (sha_b, kb) = ns.export(rev_a, Path(work) / "a"), ns.export(rev_b, Path(work) / "b")
        builds = []
        for opts in tqdm(sets, desc="nvrtc", unit="option set"):
            kernels = compare(build(lib, ka, opts), build(lib, kb, opts))
            same = all(r["same"] for r in kernels)
            builds.append({"options": list(opts), "same": same, "kernels": kernels})
    return {
        "parameters": {"a": sha_a, "b": sha_b, "stem": STEM, "nvrtc": ns.nvrtc_version(lib),
                       "nvdisasm": ns.nvdisasm_version(), "arch": "sm_90a"},
        "same": all(b["same"] for b in builds),
        "builds": builds,
        "notes": ["a build: the module of the stem at each commit, NVRTC with tools/ncu_source.py's options "
                  "(no -lineinfo) and the row's",
                  "a kernel is the same where its SASS instructions are, one by one (nvdisasm -c, branch "
                  "targets as offsets from the kernel's start, addresses and encodings left out)",
                  "sha256_*: of the kernel's instruction texts joined by newlines"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("rev_a", help="a commit (any name git takes)")
    ap.add_argument("rev_b", help="the commit to compare with it")
    ap.add_argument("--out", required=True, type=output_folder, help="folder for same_build.<a>.<b>.cpu.json")
    a = ap.parse_args(argv)
    lacking = ns.missing_tools()
    if lacking:
        ap.error(f"cannot build here: no {', '.join(lacking)}")
    try:
        with sigterm_as_interrupt():  # SIGTERM as Ctrl-C: the temp folder of exported trees removed
            doc = measure(a.rev_a, a.rev_b)
            name = f"same_build.{doc['parameters']['a'][:7]}.{doc['parameters']['b'][:7]}.cpu"
            path = results.write("same_build", doc, out_dir=a.out, name=name)  # host-only
    except ns.SourceError as e:
        ap.error(str(e))
    except KeyboardInterrupt as e:
        how = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(f"{ap.prog}: {how}; nothing written", file=sys.stderr)
        return interrupted_code(e)
    for b in doc["builds"]:
        differ = [r["kernel"] for r in b["kernels"] if not r["same"]]
        print(" ".join(b["options"]), "->", "same" if b["same"] else f"differ: {', '.join(differ)}")
    print(path)
    return 0 if doc["same"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
