"""The static code of the verify's attend kernels, by role (issue 19), from the compiler alone (no GPU).

Nsight Compute put a fifth and more of version 11's warp samples on instruction fetch (`stall_no_inst`,
notebook 02b, 13u), where version 10's had few. This tool counts what the warps fetch: each kernel's SASS
instructions, split by role as `tools/ncu_source.py` splits samples (the producer's code, the consumers', the
rest), for the builds whose attend kernels the records time: version 9's transposed products at each row count
of its dev run beside version 7's consumers (commit 4d83aab), version 11 before and after its mask branch
beside version 10 (42d5651, 6b8ab3c), this tree's version 12 (version 7's consumers, the 8 rows past 64 in
its producer), and this tree's version 10 with version 9's consumers at every NR.

Each build is NVRTC's, as the loader builds it on the GPU (`tools/ncu_source.py`: the commit's kernels/ by
`git archive`, -lineinfo for the roles; nvdisasm -gi). A role's count is its instructions wherever they
lie: a kernel that instantiates its consumers twice (version 11: one per cluster rank) holds both, and an
SM runs one.

    python3 tools/code_size.py --out DIR        -> DIR/code_size.cpu.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ncu_source as ns  # noqa: E402

from kdlib import ROOT  # noqa: E402
from kdlib.cli import Terminated, interrupted_code, output_folder, sigterm_as_interrupt  # noqa: E402
from kdlib.cuda import loader  # noqa: E402
from kdlib.perf import results  # noqa: E402

ROLES = ("producer", "consumers", "setup", "unattributed", "no_line")
JOB_END = ("job_end", "write_out")  # the consumers' functions run once a job (its partials' write)


@dataclass(frozen=True)
class Build:
    """One kernel of one build: its name in the record, the commit whose kernels/ are built, the file's stem,
    the kernel, NVRTC's options beyond the loader's, the rows each consumer thread holds (wgmma's layout:
    version 7's S = Q K^T two, the transposed products' S^T N / 4), and the role that holds the consumers'
    code (at 4d83aab version 9's consumers were the kernel's own body, past the producer's `return`:
    setup)."""

    name: str
    rev: str
    stem: str
    kernel: str
    options: tuple[str, ...]
    rows_a_thread: int
    consumers_in: str = "consumers"


def builds(head: str) -> list[Build]:
    """The builds the tool counts; `head` stands for this tree's commit."""
    out = [Build("v7 (4d83aab)", "4d83aab", "tree_verify/wgmma_v9", "tree_verify_v7_attend", (), 2)]
    out += [Build(f"v9 NR={nr} (4d83aab)", "4d83aab", "tree_verify/wgmma_v9", "tree_verify_v9_attend",
                  (f"-DTV9_NR={nr}", "-DTV9_FULL=0"), nr // 4, "setup") for nr in (8, 16, 32, 48)]
    for rev, what in (("42d5651", "v11"), ("6b8ab3c", "v11 prefix branch")):
        out += [Build(f"v10 ({rev})", rev, "tree_verify/wgmma_v10", "tree_verify_v10_attend_own", (), 2),
                Build(f"{what} ({rev})", rev, "tree_verify/wgmma_v11", "tree_verify_v11_attend", (), 18)]
    out += [Build("v10 (head)", head, "tree_verify/wgmma_v10", "tree_verify_v10_attend_own", (), 2),
            Build("v12 (head)", head, "tree_verify/wgmma_v12", "tree_verify_v12_attend", (), 2)]
    out += [Build(f"v10 v9 consumers NR={nr} (head)", head, "tree_verify/wgmma_v10",
                  "tree_verify_v10_attend_t_own", (f"-DTV9_NR={nr}",), nr // 4) for nr in range(8, 57, 8)]
    return out


def count(b: Build, kernels: Path, lib) -> dict:
    """The kernel's instructions, in all and by role; the consumers' by the function each lies in (the
    innermost), and those of the job's end apart from the loop's."""
    opts = ns.nvrtc_options(kernels, ("-arch=sm_90a", *b.options))
    local = ns.disassemble(ns.compile_cubin(lib, kernels / f"{b.stem}.cu", opts), b.kernel, kernels)
    src = ns.Sources(kernels)
    roles, funcs = dict.fromkeys(ROLES, 0), {}
    for x in local:
        role = src.role(x.chain)
        roles[role] += 1
        if role == b.consumers_in and x.chain:
            fn = str(src.function(*x.chain[0]))
            funcs[fn] = funcs.get(fn, 0) + 1
    end = sum(v for fn, v in funcs.items() if fn.startswith(JOB_END))
    return {"name": b.name, "commit": b.rev, "stem": b.stem, "kernel": b.kernel, "options": list(b.options),
            "rows_a_thread": b.rows_a_thread, "instructions": len(local), "roles": roles,
            "consumers_in": b.consumers_in, "consumer_code": roles[b.consumers_in], "job_end": end,
            "consumer_loop": roles[b.consumers_in] - end,
            "consumer_functions": dict(sorted(funcs.items(), key=lambda kv: (-kv[1], kv[0])))}


def measure(head: str) -> dict:
    """The record's payload: a row per build."""
    lib = loader.libnvrtc()
    todo = builds(head)
    rows, trees = [], {}
    with tempfile.TemporaryDirectory() as work:
        for b in tqdm(todo, desc="nvrtc", unit="build"):
            if b.rev not in trees:
                trees[b.rev] = ns.export(b.rev, Path(work) / b.rev)
            rows.append(count(b, trees[b.rev][1], lib) | {"commit": trees[b.rev][0][:7]})
    return {
        "parameters": {"nvrtc": ns.nvrtc_version(lib), "nvdisasm": ns.nvdisasm_version(),
                       "roles": list(ROLES)},
        "rows": rows,
        "notes": ["instructions: the kernel's SASS (NVRTC, -arch=sm_90a -lineinfo, the loader's options and "
                  "the row's), counted by nvdisasm -gi",
                  "roles: tools/ncu_source.py's (Sources.role) on each instruction's inline chain",
                  "consumer_code: the instructions of the role consumers_in names (setup for version 9 at "
                  "4d83aab, whose consumers were the kernel's own body); both ranks' for version 11",
                  "consumer_functions: consumer_code by the innermost function of each instruction's line; "
                  "job_end: those of functions named job_end* or write_out* (once a job); consumer_loop: the "
                  "rest, the code the job's tiles run through",
                  "rows_a_thread: the query rows one consumer thread holds products of (its wgmma layout)"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--out", required=True, type=output_folder, help="folder for code_size.cpu.json")
    a = ap.parse_args(argv)
    lacking = ns.missing_tools()
    if lacking:
        ap.error(f"cannot build here: no {', '.join(lacking)}")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    try:
        with sigterm_as_interrupt():  # SIGTERM as Ctrl-C: the temp folder of exported trees removed
            path = results.write("code_size", measure(head), out_dir=a.out, name="code_size.cpu")  # host-only
    except KeyboardInterrupt as e:
        how = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(f"{ap.prog}: {how}; nothing written", file=sys.stderr)
        return interrupted_code(e)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
