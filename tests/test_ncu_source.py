"""tools/ncu_source.py: the committed source pages parse, their totals are the CSV's column sums, the records
add up, and the mapping refuses a listing that is not the device's; where NVRTC and nvdisasm are here, the
kernel built from the CSV's commit is the device's, instruction for instruction."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kdlib import ROOT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ncu_source as ns  # noqa: E402

COMMIT = "a470e0b"
POINTS = ("8x65x200k", "8x9x200k")
NCU = ROOT / "data" / "results" / "ncu"


def _csv(point: str) -> Path:
    return NCU / f"tree_verify_v10_attend_own.src.{point}.{COMMIT}.csv.gz"


def _record(point: str) -> dict:
    return json.loads((NCU / f"tree_verify_v10_attend_own.src.{point}.{COMMIT}.json").read_text())


def _rows(path: Path) -> list[list[str]]:
    with gzip.open(path, "rt", newline="") as f:
        return list(csv.reader(f))


def _write(rows: list[list[str]], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    return path


def _column_sums(rows: list[list[str]]) -> dict[str, int]:
    head = rows[1]
    cols = [c for c in head if c.startswith("stall_") or c.startswith("Warp Stall Sampling")]
    return {c: sum(int(r[head.index(c)]) for r in rows[2:]) for c in cols}


def _altered(rows: list[list[str]], i: int) -> list[list[str]]:
    """rows with instruction i's opcode replaced (FADD <-> FMUL, else IADD3 <-> LOP3.LUT)."""
    out = [list(r) for r in rows]
    text = out[2 + i][1]
    swap = ("FADD", "FMUL") if "FADD" in text or "FMUL" in text else ("IADD3", "LOP3.LUT")
    new = text.replace(swap[0], swap[1]) if swap[0] in text else text.replace(swap[1], swap[0])
    assert new != text, text
    out[2 + i][1] = new
    return out


def _opcode_row(rows: list[list[str]]) -> int:
    """The first instruction whose opcode `_altered` can swap."""
    return next(i for i, r in enumerate(rows[2:]) if any(o in r[1] for o in ("FADD", "FMUL", "IADD3 ")))


@pytest.mark.parametrize("point", POINTS)
def test_the_totals_are_the_csvs_column_sums(point):
    rows = _rows(_csv(point))
    page = ns.read_csv(_csv(point))
    assert page.kernel == "tree_verify_v10_attend_own" and len(page.instrs) == len(rows) - 2
    sums = _column_sums(rows)
    t = ns.totals(page)
    assert t["samples"] == sums[ns.ALL] and t["not_issued"] == sums[ns.NOT_ISSUED]
    assert t["reasons"] == {k: v for k, v in sums.items() if k in page.reasons and v}
    assert t["reasons_not_issued"] == {k.removesuffix(" (Not Issued)"): v for k, v in sums.items()
                                       if k.endswith("(Not Issued)") and v}
    assert t[ns.OTHER] == sums[ns.ALL] - sum(t["reasons"].values())
    assert _record(point)["totals"] == t


@pytest.mark.parametrize("point", POINTS)
def test_the_record_adds_up(point):
    rec = _record(point)
    total = rec["totals"]["samples"]
    for part in ("lines", "functions"):
        assert sum(r["samples"] for r in rec[part]) == total, part
        assert all(sum(r["roles"].values()) == r["samples"] for r in rec[part]), part
    assert sum(r["samples"] for r in rec["roles"].values()) == total
    assert {"producer", "consumers"} <= set(rec["roles"])
    assert rec["source"]["commit"].startswith(COMMIT)
    assert rec["source"]["csv"] == str(_csv(point).relative_to(ROOT))
    n = rec["totals"]["instructions"]
    assert rec["build"]["matched"] == f"all {n} instructions: predicate, opcode and operands"


def test_bad_csvs_are_refused(tmp_path):
    rows = _rows(_csv(POINTS[1]))
    with pytest.raises(ns.SourceError, match="no such file"):
        ns.read_csv(tmp_path / "none.csv")
    with pytest.raises(ns.SourceError, match="row 1"):
        ns.read_csv(_write(rows[1:], tmp_path / "no_kernel.csv"))
    with pytest.raises(ns.SourceError, match="lacks"):
        ns.read_csv(_write([rows[0], ["Address", "Source"], ["0x10", "NOP"]], tmp_path / "header.csv"))
    gap = rows[:5] + rows[6:]  # instruction 3 (row 6) left out
    with pytest.raises(ns.SourceError, match=r"row 6: address .* not the next instruction's \(offset 0x40"):
        ns.read_csv(_write(gap, tmp_path / "gap.csv"))
    bad = [list(r) for r in rows]
    bad[3][bad[1].index(ns.ALL)] = "many"
    with pytest.raises(ns.SourceError, match="row 4: not a count"):
        ns.read_csv(_write(bad, tmp_path / "count.csv"))
    with pytest.raises(SystemExit) as e:  # the CLI: argparse's error, exit status 2
        ns.main([str(tmp_path / "none.csv"), "--commit", COMMIT, "--point", "x"])
    assert e.value.code == 2
    # a --commit git does not know is bad input (exit 2), not a failed build (it was exit 1)
    good = _write(rows, tmp_path / "good.csv")
    with pytest.raises(SystemExit) as e:
        ns.main([str(good), "--commit", "no-such-revision", "--point", "x"])
    assert e.value.code == 2


def test_an_altered_opcode_or_count_is_refused(tmp_path):
    """check_same against the committed page itself: one opcode changed, or one instruction fewer."""
    rows = _rows(_csv(POINTS[0]))
    ref = ns.device_canon(ns.read_csv(_csv(POINTS[0])))
    i = _opcode_row(rows)
    altered = ns.read_csv(_write(_altered(rows, i), tmp_path / "altered.csv"))
    with pytest.raises(ns.SourceError, match=rf"instruction {i} \(offset {16 * i:#x}\) differs"):
        ns.check_same(ns.device_canon(altered), ref)
    with pytest.raises(ns.SourceError, match=f"the device ran {len(ref) - 1} instructions"):
        ns.check_same(ref[:-1], ref)


def test_canon_compares_operands_not_addresses_or_their_order():
    assert ns.canon("@P0   BRA 0x7fcbd97e2c20", 0x7fcbd97df000, 0x20000) == ns.canon("@P0 BRA 0x3c20")
    assert ns.canon("LDGSTS.E.BYPASS.128 desc[UR12][R4.64], !P0, [R0+-0x34000]") == \
        ns.canon("LDGSTS.E.BYPASS.128 [R0+-0x34000], desc[UR12][R4.64], !P0 ;")
    assert ns.canon("LEA R4, P3, R8.reuse, UR4, 0x2") == ns.canon("LEA R4, P3, R8, UR4, 0x2")
    assert ns.canon("IADD3 R1, R2, R3") != ns.canon("IADD3 R1, R2, R4")
    assert ns.canon("@P0 BRA 0x10") != ns.canon("@!P0 BRA 0x10")


def test_roles_follow_the_innermost_frame_that_names_one(tmp_path):
    """attend_v7's branch, or a function named produce* / consume*; a helper of the role file outside the
    branch decides nothing (its caller's frame does)."""
    (tmp_path / "kernels" / "tree_verify").mkdir(parents=True)
    (tmp_path / ns.ROLE_FILE).write_text(
        "__device__ void helper() {\n    x();\n}\n"                    # lines 1-3
        "__device__ void attend_v7() {\n    if (wg == 0) {\n        a();\n"  # 4-6
        "    } else {\n        b();\n    }\n}\n")                          # 7-10
    (tmp_path / "kernels" / "k.cu").write_text(
        "__device__ void produce_k() {\n    p();\n}\n__device__ void consume_k() {\n    c();\n}\n"
        "__device__ void other() {\n    o();\n}\n")
    src = ns.Sources(tmp_path / "kernels")
    v7, k = ns.ROLE_FILE, "kernels/k.cu"
    assert src.role(((v7, 6),)) == "producer" and src.role(((v7, 8),)) == "consumers"
    assert src.role(((v7, 2), (v7, 8))) == "consumers"  # the helper, inlined in the else
    assert src.role(((k, 2), (k, 8))) == "producer" and src.role(((k, 8), (k, 5))) == "consumers"
    assert src.role(((k, 8), (v7, 2))) == "setup" and src.role(((k, 8),)) == "unattributed"
    assert src.role(()) == "no_line"


def test_the_cluster_kernels_record_splits_its_samples_by_role():
    """Version 11's kernel (produce_v11, consume_v11): the roles hold nearly all samples and instructions,
    the consumers' code is the larger part (13u reads both)."""
    rec = json.loads((NCU / "tree_verify_v11_attend.src.8x9x200k.42d5651.json").read_text())
    roles = rec["roles"]
    assert sum(r["samples"] for r in roles.values()) == rec["totals"]["samples"]
    assert roles["producer"]["samples"] + roles["consumers"]["samples"] > 0.95 * rec["totals"]["samples"]
    assert roles["consumers"]["instructions"] > 4 * roles["producer"]["instructions"]
    bar = next(f for f in rec["functions"] if f["function"] == "bar_wait")
    assert bar["roles"]["producer"] > 0.9 * bar["samples"]


def _at_commit(path: str) -> str:
    git = ["git", "-C", str(ROOT), "show", f"{COMMIT}:{path}"]
    return subprocess.run(git, capture_output=True, text=True, check=True).stdout


def _has_commit() -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{COMMIT}^{{commit}}"],
                          capture_output=True).returncode == 0


needs_commit = pytest.mark.skipif(not _has_commit(), reason=f"commit {COMMIT} is not in this checkout")


@needs_commit
def test_the_roles_and_functions_of_the_commits_source():
    v7 = _at_commit(ns.ROLE_FILE)
    lines = v7.split("\n")
    roles = ns.role_ranges(v7)
    produce = next(n for n, ln in enumerate(lines, 1) if "produce_v10(" in ln)
    setmaxnreg = next(n for n, ln in enumerate(lines, 1) if "setmaxnreg.inc" in ln)
    assert roles["producer"][0] <= produce <= roles["producer"][1]
    assert roles["consumers"][0] <= setmaxnreg <= roles["consumers"][1]
    funcs = {name: (a, b) for name, a, b in ns.functions(_at_commit("kernels/tree_verify/wgmma_common.cuh"))}
    a, b = funcs["bar_wait"]
    assert "bar_wait(" in _at_commit("kernels/tree_verify/wgmma_common.cuh").split("\n")[a - 1] and b - a == 7


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The kernel built from the commit's kernels/ (about 7 s), checked against the 8x65x200k page."""
    lacking = ns.missing_tools()
    if lacking:
        pytest.skip(f"cannot build here: no {', '.join(lacking)}")
    if not _has_commit():
        pytest.skip(f"commit {COMMIT} is not in this checkout")
    page = ns.read_csv(_csv(POINTS[0]))
    from kdlib.cuda import attention as cu

    return page, ns.build(page, COMMIT, cu.LAUNCHES[10].stem, cu.LAUNCHES[10].options,
                          tmp_path_factory.mktemp("ncu_source"))


def test_the_local_build_is_the_devices_and_the_record_is_what_it_maps(built):
    page, b = built
    assert len(b["local"]) == len(page.instrs)
    for point in POINTS:  # both points ran the same build
        other = ns.read_csv(_csv(point))
        ns.check_same(ns.device_canon(other), [ns.canon(x.sass) for x in b["local"]])
        rec = _record(point)
        if rec["build"]["compiler"] != f"NVRTC {b['nvrtc']}":
            continue
        got = ns.summarize(other, b["local"], b["sources"], len(rec["top_instructions"]))
        assert json.loads(json.dumps(got)) == {k: rec[k] for k in got}, point


def test_the_local_build_refuses_an_altered_page(built, tmp_path):
    _, b = built
    rows = _rows(_csv(POINTS[0]))
    i = _opcode_row(rows)
    altered = ns.read_csv(_write(_altered(rows, i), tmp_path / "altered.csv"))
    with pytest.raises(ns.SourceError, match=rf"instruction {i} \(offset {16 * i:#x}\) differs: .*refusing"):
        ns.check_same(ns.device_canon(altered), [ns.canon(x.sass) for x in b["local"]],
                      [x.sass for x in altered.instrs], [x.sass for x in b["local"]])
