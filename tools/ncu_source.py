"""Warp-stall samples of one kernel per source line, from an Nsight Compute source page in SASS only.

ncu could not import the source, so the page has no lines: they come from the same kernel built here with
line info.

The CSV (`ncu --import R.ncu-rep --page source --csv --print-source sass`, plain or gzipped): row 1 the
kernel's name, row 2 the header, then one row per SASS instruction: its address, its text, the warp-stall
samples (all, not issued) and one column per stall reason. The kernel is built as the loader builds it on the
GPU: NVRTC with `kdlib.cuda.loader`'s options, the wrapper's (`kdlib.cuda.attention.LAUNCHES`), CuPy's own
and -lineinfo, from the kernels/ of the commit the CSV was made at (`git archive`, so edits since do not
count; nvcc -cubin makes other SASS of the same file and options: 5744 instructions, not the device's 5776,
at a470e0b). `nvdisasm -gi` gives each instruction's source line and the lines it was inlined at. The two
listings must agree instruction for instruction (the same count; the same predicate, opcode and operands,
branch targets as offsets from the kernel's start) or the tool stops at the first difference: samples are
never mapped onto a build that is not the device's.

    python3 tools/ncu_source.py CSV --commit REV --point 8x65x200k [--ncu-command ...] [--device ...]
        -> data/results/ncu/<kernel>.src.<point>.<rev>.json

Roles: an instruction's inline chain, innermost frame first, is searched for the first frame that names one:
a line of attend_v7's `if (wg == 0)` branch (kernels/tree_verify/wgmma_v7.cu) is the producer's, of its
`else` the consumers'; a line of a function named produce* (produce_v10, produce_v11) the producer's, of one
named consume* (consume_v9, consume_v11) the consumers'. An instruction no frame names is `setup` where its
chain has more than one frame (inlined code outside the roles: own_plan, barriers), `unattributed` where it
has one, a line of the kernel's own body outside the roles, and `no_line` where it has no line info (compiler
runtime subroutines such as __cuda_sm20_div_s64).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gzip
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdlib import ROOT  # noqa: E402
from kdlib.cli import positive_int  # noqa: E402
from kdlib.cuda import attention as cu  # noqa: E402
from kdlib.cuda import loader  # noqa: E402
from kdlib.perf import results  # noqa: E402

SUITE = "ncu_source"
OUT = results.RESULTS / "ncu"
ALL = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"
OTHER = "other"  # samples the CSV's reason columns leave out (its HGMMA rows: a reason it has no column for)
ROLE_FILE = "kernels/tree_verify/wgmma_v7.cu"  # attend_v7: the producer's branch and the consumers'
ROLE_BRANCH = re.compile(r"\bif\s*\(\s*wg\s*==\s*0\s*\)\s*\{")
ROLE_FUNCS = {"produce": "producer", "consume": "consumers"}  # a function's name prefix -> its role


class SourceError(ValueError):
    """A CSV that is missing or not a source page, or a local build that is not the device's."""


@dataclass(frozen=True)
class Instr:
    """One SASS instruction of the CSV: offset from the kernel's first, text, samples (all, not issued),
    samples per reason (the CSV's columns, nonzero only)."""

    offset: int
    sass: str
    samples: int
    not_issued: int
    reasons: dict[str, int]
    reasons_not_issued: dict[str, int]


@dataclass(frozen=True)
class SourcePage:
    kernel: str
    reasons: tuple[str, ...]  # the reason columns (all samples), in the CSV's order
    instrs: tuple[Instr, ...]
    base: int  # the first instruction's address on the device


@dataclass(frozen=True)
class Local:
    """One instruction of the local build: its text (branch targets resolved to offsets) and its inline
    chain [(file, line)], innermost first, files relative to the repository (empty: no line info)."""

    sass: str
    chain: tuple[tuple[str, int], ...]


# ----------------------------------------------------------------------------- the CSV
def _int(row: list[str], i: int, where: str) -> int:
    try:
        return int(row[i].replace(",", ""))
    except ValueError as e:
        raise SourceError(f"{where}: not a count: {row[i]!r}") from e


def read_csv(path: Path) -> SourcePage:
    """The source page at `path` (.csv or .csv.gz); SourceError naming the file and row when it is missing or
    not a SASS source page with warp-stall samples."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise SourceError(f"{path}: unreadable as CSV: {e}") from e
    if len(rows) < 3 or rows[0][:1] != ["Kernel Name"] or len(rows[0]) < 2 or not rows[0][1]:
        raise SourceError(f"{path}: row 1 must be '\"Kernel Name\",\"<kernel>\"' and instructions must "
                          f"follow the header (ncu --page source --csv --print-source sass)")
    head = rows[1]
    need = ["Address", "Source", ALL, NOT_ISSUED]
    missing = [c for c in need if c not in head]
    if missing:
        raise SourceError(f"{path}: row 2 (the header) lacks {missing}")
    reasons = tuple(c for c in head if c.startswith("stall_") and not c.endswith("(Not Issued)"))
    reasons_ni = tuple(c for c in head if c.startswith("stall_") and c.endswith("(Not Issued)"))
    col = {c: i for i, c in enumerate(head)}
    instrs, base = [], None
    for n, row in enumerate(rows[2:], start=3):
        where = f"{path}: row {n}"
        if len(row) != len(head):
            raise SourceError(f"{where}: {len(row)} fields, the header has {len(head)}")
        try:
            addr = int(row[col["Address"]], 16)
        except ValueError as e:
            raise SourceError(f"{where}: address {row[col['Address']]!r} is not hexadecimal") from e
        base = addr if base is None else base
        offset = addr - base
        if offset != 16 * len(instrs):
            raise SourceError(f"{where}: address {row[col['Address']]} is not the next instruction's "
                              f"(offset {offset:#x}, expected {16 * len(instrs):#x})")
        by = {r: _int(row, col[r], where) for r in reasons}
        by_ni = {r.removesuffix(" (Not Issued)"): _int(row, col[r], where) for r in reasons_ni}
        instrs.append(Instr(offset, row[col["Source"]].strip(), _int(row, col[ALL], where),
                            _int(row, col[NOT_ISSUED], where), {k: v for k, v in by.items() if v},
                            {k: v for k, v in by_ni.items() if v}))
    return SourcePage(rows[0][1], reasons, tuple(instrs), base)


# ----------------------------------------------------------------------------- the local build
def export(rev: str, dest: Path) -> tuple[str, Path]:
    """(full commit, dest/kernels): rev's kernels/ (`kdlib.cuda.loader.export_kernels`)."""
    try:
        kernels = loader.export_kernels(rev, dest)
    except ValueError as e:
        raise SourceError(str(e)) from e
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", f"{rev}^{{commit}}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    return sha, kernels


def missing_tools() -> list[str]:
    """What the local build needs and this machine lacks (empty: it can build)."""
    need = {"libnvrtc (nvidia-cuda-nvrtc)": loader.libnvrtc(), "nvdisasm": loader.wheel_tool("nvdisasm"),
            "the CUDA include folder (cuda_bf16.h)": loader.cuda_include()}
    return [k for k, v in need.items() if v is None]


def nvrtc_options(kernels: Path, options: tuple[str, ...], lineinfo: bool = True) -> list[str]:
    """What NVRTC got on the GPU: the loader's base options (`loader._BASE_OPTIONS`, its -I on `kernels`),
    `options` (the wrapper's and KDLIB_NVRTC_OPTIONS'), -lineinfo (lineinfo False: the build as it ships),
    then CuPy's own."""
    return ["--std=c++17", f"-I{kernels}", *options, *(["-lineinfo"] if lineinfo else []), "-arch=sm_90",
            *loader.CUPY_NVRTC_OPTIONS, f"-I{loader.cuda_include()}"]


def nvrtc_version(lib) -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def nvdisasm_version() -> str:
    text = subprocess.run([loader.wheel_tool("nvdisasm"), "--version"], capture_output=True, text=True).stdout
    return text.strip().splitlines()[-1]


def compile_cubin(lib, source: Path, opts: list[str]) -> bytes:
    """NVRTC's cubin of `source` (its own path as the program's name, its includes found on disk, so the
    line info names the real files); SourceError with the log when it fails."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), str(source).encode(), 0, None, None):
        raise SourceError(f"nvrtcCreateProgram failed on {source}")
    try:
        args = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        rc = lib.nvrtcCompileProgram(prog, len(opts), args)
        size = ctypes.c_size_t()
        if rc:
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise SourceError(f"NVRTC failed on {source} ({rc}):\n{log.value.decode(errors='replace')}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


_INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s*(.*?)\s*;?\s*$")
_FILE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^([^\s/.][^\s]*|\.L_x_\d+):\s*$")  # a function's label or a branch target's
_TARGET = re.compile(r"`\(([^)]+)\)")


def disassemble(cubin: bytes, kernel: str, kernels: Path) -> tuple[Local, ...]:
    """The kernel's instructions in `cubin` (nvdisasm -gi -c), branch and call targets as offsets, each with
    its inline chain; files relative to the repository (`kernels`' parent stands for it)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([loader.wheel_tool("nvdisasm"), "-gi", "-c", str(path)], capture_output=True,
                              text=True, check=True, timeout=120).stdout
    head = f"//--------------------- .text.{kernel} "
    start = next((i for i, ln in enumerate(text.splitlines()) if ln.startswith(head)), None)
    if start is None:
        raise SourceError(f"the local build has no kernel {kernel}")
    lines = []
    for ln in text.splitlines()[start + 1:]:
        if ln.startswith("//---------------------"):
            break
        lines.append(ln)
    top = kernels.parent
    raw, labels, chain, pending = [], {}, (), []
    for ln in lines:
        if m := _FILE.match(ln):
            f = Path(m.group(1))
            name = f.relative_to(top).as_posix() if f.is_relative_to(top) else str(f)
            pending.append((name, int(m.group(2))))
        elif m := _INSTR.match(ln):
            if pending:
                chain, pending = tuple(pending), []
            raw.append((m.group(1), chain))
        elif m := _LABEL.match(ln):
            labels[m.group(1)] = 16 * len(raw)
            if not m.group(1).startswith(".L_x_"):
                chain, pending = (), []  # a function's first instruction: line info starts afresh
    def target(m: re.Match) -> str:
        return f"{labels[m.group(1)]:#x}" if m.group(1) in labels else m.group(0)

    return tuple(Local(_TARGET.sub(target, s), c) for s, c in raw)


# ----------------------------------------------------------------------------- the match
def canon(sass: str, base: int = 0, size: int = 0) -> str:
    """An instruction's text to compare: predicate, opcode, operands (sorted: the two disassemblers print
    LDGSTS's in different orders), without .reuse; an absolute address inside the kernel [base, base + size)
    becomes its offset."""
    def offset(m: re.Match) -> str:
        a = int(m.group(0), 16)
        return f"{a - base:#x}" if base and base <= a < base + size else m.group(0)

    text = re.sub(r"0x[0-9a-fA-F]+", offset, sass.replace(".reuse", "").rstrip(" ;"))
    tokens = [t for t in re.split(r"[\s,]+", text) if t]
    pred = tokens.pop(0) if tokens and tokens[0].startswith("@") else ""
    op = tokens.pop(0) if tokens else ""
    return " ".join(filter(None, [pred, op, *sorted(tokens)]))


def device_canon(page: SourcePage) -> list[str]:
    return [canon(i.sass, page.base, 16 * len(page.instrs)) for i in page.instrs]


def check_same(device: list[str], local: list[str], device_text=None, local_text=None) -> None:
    """SourceError unless the two canonical listings are equal: the count, else the first instruction that
    differs (its index, offset and both texts; *_text: the texts to show, default the canonical ones)."""
    device_text, local_text = device_text or device, local_text or local
    if len(device) != len(local):
        raise SourceError(f"the device ran {len(device)} instructions, the local build has {len(local)}: "
                          f"not the same build (commit, options, compiler)")
    for i, (d, c) in enumerate(zip(device, local, strict=True)):
        if d != c:
            raise SourceError(f"instruction {i} (offset {16 * i:#x}) differs: the device's "
                              f"{device_text[i]!r}, the local build's {local_text[i]!r}; refusing to map")


# ----------------------------------------------------------------------------- the source
def _code(text: str) -> list[str]:
    """The lines of C++ `text`, comments and string/char literals blanked (braces in them do not count)."""
    pat = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.DOTALL)
    return pat.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text).split("\n")


def _close(code: list[str], i: int, j: int) -> int:
    """The line of the brace that closes the first `{` at or after (line i, column j)."""
    depth = 0
    for n in range(i, len(code)):
        for ch in code[n][j if n == i else 0:]:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return n
    raise SourceError(f"unbalanced braces from line {i + 1}")


_DEF = re.compile(r'^(?:extern "C"\s+)?(?:__device__|__global__|__host__)\b')


def functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line), 1-based, of every function defined at the top level of `text`, a
    definition starting at column 0 with __device__ / __global__ / extern "C" (the kernels' style)."""
    code = _code(text)
    out = []
    for i, ln in enumerate(code):
        if not _DEF.match(ln):
            continue
        m = re.search(r"(\w+)\s*\(", re.sub(r"__launch_bounds__\s*\([^)]*\)", "", ln))
        body = next((n for n in range(i, len(code)) if "{" in code[n] or ";" in code[n]), None)
        if m is None or body is None or "{" not in code[body]:
            continue  # a declaration
        first = i - 1 if i and code[i - 1].startswith("template") else i
        out.append((m.group(1), first + 1, _close(code, body, 0) + 1))
    return out


def role_ranges(text: str) -> dict[str, tuple[int, int]]:
    """{'producer': (first, last), 'consumers': (first, last)}, 1-based lines, of attend_v7's
    `if (wg == 0) { ... } else { ... }` in `text`."""
    code = _code(text)
    at = next(((i, m.end() - 1) for i, ln in enumerate(code) if (m := ROLE_BRANCH.search(ln))), None)
    if at is None:
        raise SourceError(f"{ROLE_FILE}: no `if (wg == 0) {{` (the producer's branch)")
    mid = _close(code, *at)
    if "else" not in code[mid]:
        raise SourceError(f"{ROLE_FILE}:{mid + 1}: the producer's branch has no else (the consumers')")
    end = _close(code, mid, code[mid].index("else"))
    return {"producer": (at[0] + 2, mid), "consumers": (mid + 2, end)}


class Sources:
    """Lines, functions and roles of the exported tree's files."""

    def __init__(self, kernels: Path):
        self.top = kernels.parent
        self._lines: dict[str, tuple[list[str], list[str]]] = {}
        self._funcs: dict[str, list[tuple[str, int, int]]] = {}
        self.roles = role_ranges(self.text(ROLE_FILE))

    def text(self, f: str) -> str:
        return (self.top / f).read_text()

    def line(self, f: str, n: int) -> str:
        return self._file(f)[0][n - 1].strip()

    def statement(self, f: str, n: int) -> str:
        """Line n of f with the lines of its statement before it, joined by spaces: a line continues onto
        the next where it ends with none of ; { } and is no preprocessor line, or holds only a string."""
        text, code = self._file(f)
        first = n - 1
        while first > 0:
            c, t = code[first - 1].strip(), text[first - 1].strip()
            if (c[-1] in ";{}" or c.startswith("#")) if c else not t.startswith('"'):
                break
            first -= 1
        return " ".join(t.strip() for t in text[first:n])

    def _file(self, f: str) -> tuple[list[str], list[str]]:
        """f's lines, and the same with comments and literals blanked."""
        if f not in self._lines:
            text = self.text(f)
            self._lines[f] = (text.split("\n"), _code(text))
        return self._lines[f]

    def function(self, f: str, n: int) -> str | None:
        """The innermost function defined around line n of f."""
        if f not in self._funcs:
            self._funcs[f] = functions(self.text(f))
        inside = [(b - a, name) for name, a, b in self._funcs[f] if a <= n <= b]
        return min(inside)[1] if inside else None

    def role(self, chain: tuple[tuple[str, int], ...]) -> str:
        """The role of an instruction inlined along `chain` (the module's docstring, Roles)."""
        if not chain:
            return "no_line"
        for f, n in chain:
            if f == ROLE_FILE and (r := next((r for r, (a, b) in self.roles.items() if a <= n <= b), None)):
                return r
            fn = self.function(f, n) or ""
            if r := next((r for prefix, r in ROLE_FUNCS.items() if fn.startswith(prefix)), None):
                return r
        return "setup" if len(chain) > 1 else "unattributed"


# ----------------------------------------------------------------------------- the summary
def _add(into: dict, reasons: dict[str, int]) -> None:
    for k, v in reasons.items():
        into[k] = into.get(k, 0) + v


def _sorted(d: dict[str, int]) -> dict[str, int]:
    return dict(sorted(((k, v) for k, v in d.items() if v), key=lambda kv: (-kv[1], kv[0])))


def _reasons(i: Instr) -> dict[str, int]:
    """The instruction's samples per reason, OTHER the part no reason column holds."""
    rest = i.samples - sum(i.reasons.values())
    return {**i.reasons, **({OTHER: rest} if rest else {})}


def totals(page: SourcePage) -> dict:
    """Samples (all, not issued) and per reason, the CSV's column sums."""
    by, by_ni = {r: 0 for r in page.reasons}, {}
    for i in page.instrs:
        _add(by, i.reasons)
        _add(by_ni, i.reasons_not_issued)
    return {"instructions": len(page.instrs), "samples": sum(i.samples for i in page.instrs),
            "not_issued": sum(i.not_issued for i in page.instrs), "reasons": _sorted(by),
            "reasons_not_issued": _sorted(by_ni),
            OTHER: sum(i.samples for i in page.instrs) - sum(by.values())}


def summarize(page: SourcePage, local: tuple[Local, ...], src: Sources, top: int) -> dict:
    """Samples per source line, function and role, and the `top` instructions (the listings matched)."""
    total = sum(i.samples for i in page.instrs) or 1
    lines, funcs, roles = {}, {}, {}

    def bucket(into: dict, key, **fields) -> dict:
        zero = {"samples": 0, "not_issued": 0, "instructions": 0, "reasons": {}}
        return into.setdefault(key, {**fields, **zero})

    for i, loc in zip(page.instrs, local, strict=True):
        f, n = loc.chain[0] if loc.chain else (None, None)
        fn = src.function(f, n) if f else None
        role = src.role(loc.chain)
        text = {"text": src.line(f, n) if f else None}
        if f and src.statement(f, n) != text["text"]:
            text["statement"] = src.statement(f, n)
        line = bucket(lines, (f, n), file=f, line=n, **text, function=fn, roles={}, via={})
        func = bucket(funcs, (fn, f), function=fn, file=f, roles={})
        for b in (line, func, bucket(roles, role, role=role)):
            b["samples"] += i.samples
            b["not_issued"] += i.not_issued
            b["instructions"] += 1
            _add(b["reasons"], _reasons(i))
        for b in (line, func):
            _add(b["roles"], {role: i.samples})
        _add(line["via"], {" < ".join(f"{Path(g).name}:{m}" for g, m in loc.chain[1:]) or "-": i.samples})

    def ranked(rows) -> list[dict]:
        out = [{**r, "share": round(r["samples"] / total, 5),
                **{k: _sorted(r[k]) for k in ("reasons", "roles", "via") if k in r}}
               for r in rows if r["samples"]]
        return sorted(out, key=lambda r: -r["samples"])

    ins = sorted(zip(page.instrs, local, strict=True), key=lambda p: -p[0].samples)[:top]
    return {
        "totals": totals(page),
        "roles": {r["role"]: {k: v for k, v in r.items() if k != "role"} for r in ranked(roles.values())},
        "functions": ranked(funcs.values()),
        "lines": ranked(lines.values()),
        "top_instructions": [{"offset": f"{i.offset:#x}", "sass": i.sass,
                              "file": loc.chain[0][0] if loc.chain else None,
                              "line": loc.chain[0][1] if loc.chain else None,
                              "inlined_at": [f"{f}:{n}" for f, n in loc.chain[1:]],
                              "role": src.role(loc.chain),
                              "samples": i.samples, "share": round(i.samples / total, 5),
                              "not_issued": i.not_issued, "reasons": _sorted(_reasons(i))}
                             for i, loc in ins if i.samples],
    }


def build(page: SourcePage, rev: str, stem: str, options: tuple[str, ...], work: Path) -> dict:
    """Build `stem` at `rev` into `work`, check it is the device's and return the build's facts with its
    listing and sources: {commit, nvrtc, nvdisasm, options, local, sources}."""
    sha, kernels = export(rev, work)
    lib = loader.libnvrtc()
    opts = nvrtc_options(kernels, options)
    local = disassemble(compile_cubin(lib, kernels / f"{stem}.cu", opts), page.kernel, kernels)
    check_same(device_canon(page), [canon(x.sass) for x in local], [i.sass for i in page.instrs],
               [x.sass for x in local])
    return {"commit": sha, "nvrtc": nvrtc_version(lib), "nvdisasm": nvdisasm_version(),
            "options": [o.replace(str(kernels), "kernels").replace(loader.cuda_include(), "<cuda>/include")
                        for o in opts],
            "local": local, "sources": Sources(kernels)}


def record(page: SourcePage, csv_path: Path, point: str, built: dict, stem: str, top: int,
           ncu_command: str | None, device: str | None) -> dict:
    """The record's payload (results.write writes it under its own name: <kernel>.src.<point>.<commit7>)."""
    return {
        "kernel": page.kernel,
        "point": point,
        "source": {"csv": os.path.relpath(csv_path, ROOT), "commit": built["commit"],
                   "ncu_command": ncu_command, "device": device},
        "build": {"stem": stem, "compiler": f"NVRTC {built['nvrtc']}", "options": built["options"],
                  "disassembler": f"nvdisasm -gi ({built['nvdisasm']})",
                  "matched": f"all {len(page.instrs)} instructions: predicate, opcode and operands"},
        **summarize(page, built["local"], built["sources"], top),
        "notes": [
            "samples: ncu's warp-stall sampling of one launch; share: of all the kernel's samples",
            f"reasons: the CSV's stall_* columns; '{OTHER}': samples none of them holds (HGMMA rows only)",
            f"roles: the innermost inline frame in {ROLE_FILE}'s `if (wg == 0)` branch (producer) or its "
            "else (consumers), or in a function named produce* (producer) or consume* (consumers); setup: "
            "the rest of the kernel with inline info; unattributed: line info of the kernel's own lines "
            "only; no_line: compiler runtime subroutines",
            "lines: the innermost source line nvdisasm -gi gives; statement: with the lines of its statement "
            "before it, where it spans several; function: the one defined around it; roles, via: its samples "
            "by role and by the lines it was inlined at (innermost first)",
            "the build: the commit's kernels/ (git archive), NVRTC on the .cu itself (headers found on disk, "
            "so the lines are the files'), where the loader hands NVRTC the same text with its headers "
            "inlined; the match of the two listings shows it is the same code",
        ],
    }


def show(doc: dict, n: int = 15) -> str:
    """A text summary: reasons, roles, the n lines with most samples."""
    t = doc["totals"]
    out = [f"{doc['kernel']} {doc['point']}: {t['samples']} samples ({t['not_issued']} not issued) over "
           f"{t['instructions']} instructions",
           "reasons: " + ", ".join(f"{k} {v / t['samples']:.1%}" for k, v in list(t["reasons"].items())[:8])
           + (f", {OTHER} {t[OTHER] / t['samples']:.1%}" if t[OTHER] else ""),
           "roles: " + ", ".join(f"{k} {v['share']:.1%}" for k, v in doc["roles"].items())]
    for r in doc["lines"][:n]:
        top3 = ", ".join(f"{k} {v / r['samples']:.0%}" for k, v in list(r["reasons"].items())[:3])
        by = ", ".join(f"{k} {v / r['samples']:.0%}" for k, v in r["roles"].items())
        out.append(f"{r['share']:6.1%}  {r['file']}:{r['line']}  [{r['function']}: {by}]  {r['text']}"
                   f"  ({top3})")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("csv", type=Path,
                    help="the source page: ncu --page source --csv --print-source sass (.gz read too)")
    ap.add_argument("--commit", required=True, help="the commit the CSV was made at: its kernels/ are built")
    ap.add_argument("--point", required=True,
                    help="the profiled call, named in the record's file (e.g. 8x65x200k)")
    ap.add_argument("--stem", default=cu.LAUNCHES[10].stem,
                    help="the kernel file's stem (default %(default)s)")
    ap.add_argument("--options", default=" ".join(cu.LAUNCHES[10].options),
                    help="the wrapper's and KDLIB_NVRTC_OPTIONS' NVRTC options, -lineinfo aside "
                         "(default %(default)r)")
    ap.add_argument("--ncu-command", help="the ncu command that made the report (recorded as given)")
    ap.add_argument("--device", help="GPU, driver, CUDA, CuPy of the profiled run (recorded as given)")
    ap.add_argument("--top", type=positive_int, default=30,
                    help="instructions kept in the record (default 30)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the record (default data/results/ncu)")
    a = ap.parse_args(argv)
    try:
        page = read_csv(a.csv)
    except SourceError as e:
        ap.error(str(e))
    git = ["git", "-C", str(ROOT)]
    if subprocess.run([*git, "rev-parse", "--verify", "--quiet", f"{a.commit}^{{commit}}"],
                      capture_output=True).returncode != 0:  # bad input, not a failed build: exit 2
        ap.error(f"--commit {a.commit!r} names no commit of {ROOT}")
    lacking = missing_tools()
    if lacking:
        ap.error(f"cannot build here: no {', '.join(lacking)}")
    command = shlex.join(["python3", "tools/ncu_source.py", *(argv if argv is not None else sys.argv[1:])])
    with tempfile.TemporaryDirectory() as work:
        try:
            built = build(page, a.commit, a.stem, tuple(a.options.split()), Path(work))
            doc = record(page, a.csv.resolve(), a.point, built, a.stem, a.top, a.ncu_command, a.device)
        except SourceError as e:
            print(f"ncu_source: {e}", file=sys.stderr)
            return 1
    path = results.write(SUITE, doc, out_dir=a.out, command=command,
                         name=f"{doc['kernel']}.src.{doc['point']}.{doc['source']['commit'][:7]}")
    print(show(doc))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
