"""Every `kernels/*.cu` compiles with nvcc to a cubin for sm_90 (H200) and sm_120 (RTX PRO 6000
Blackwell), and ptxas's resource report (-Xptxas -v) shows no spills and no stack frame.

A kernel that needs a stack frame documents it in its source with a line
`// kdlib-allow-stack: <kernel name> <max bytes> <why>`; its frame may then be up to that size
(spills are never allowed). Files are found by glob, so new kernels are checked automatically.

Speed: all (file, arch) compiles run in parallel threads, and each report is cached under
build/ptxas-cache/ keyed by the source, the flags and the nvcc version, so an unchanged file costs
nothing on the next run.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from kdlib import KERNELS, ROOT

ARCHS = ("sm_90", "sm_120")
NVCC = shutil.which("nvcc")
FLAGS = ("-cubin", "-std=c++17", "-Xptxas", "-v", f"-I{KERNELS}")
CACHE = ROOT / "build" / "ptxas-cache"
SOURCES = sorted(KERNELS.glob("*.cu"))

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_ALLOW = re.compile(r"//\s*kdlib-allow-stack:\s*(\S+)\s+(\d+)\s+\S")
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')


def parse_report(text: str) -> dict[str, dict]:
    """ptxas -v output -> {entry: {registers, stack, spill_stores, spill_loads}} (entry functions only)."""
    entries: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = m.group(1)
            entries[current] = {}
            continue
        m = _PROPS.search(line)
        if m:
            current = m.group(1) if m.group(1) in entries else None
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            entries[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _REGS.search(line)
        if m:
            entries[current]["registers"] = int(m.group(1))
    return entries


def _nvcc_version() -> str:
    return subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True).stdout


def compile_report(source: Path, arch: str, version: str) -> tuple[int, str]:
    """(return code, ptxas/nvcc output) for one compile; cached by content."""
    key = hashlib.sha256("\0".join([source.read_text(), arch, *FLAGS[:-1], version]).encode()).hexdigest()[:24]
    cached = CACHE / f"{source.stem}.{arch}.{key}.log"
    if cached.exists():
        return 0, cached.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [NVCC, *FLAGS, f"-arch={arch}", "-o", os.path.join(tmp, "k.cubin"), str(source)],
            capture_output=True, text=True, timeout=300,
        )
    text = proc.stdout + proc.stderr
    if proc.returncode == 0:
        CACHE.mkdir(parents=True, exist_ok=True)
        tmpfile = cached.with_suffix(".tmp")
        tmpfile.write_text(text)
        os.replace(tmpfile, cached)
    return proc.returncode, text


@pytest.fixture(scope="module")
def reports() -> dict[tuple[str, str], tuple[int, str]]:
    version = _nvcc_version()
    jobs = [(src, arch) for src in SOURCES for arch in ARCHS]
    with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {job: pool.submit(compile_report, job[0], job[1], version) for job in jobs}
        return {(src.name, arch): fut.result() for (src, arch), fut in futures.items()}


def test_there_are_kernels():
    assert SOURCES, f"no kernels/*.cu found under {KERNELS}"


def test_parse_report_reads_ptxas_lines():
    text = (
        "ptxas info    : Compiling entry function 'k_v1' for 'sm_90'\n"
        "ptxas info    : Function properties for k_v1\n"
        "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers\n"
    )
    assert parse_report(text) == {"k_v1": {"stack": 16, "spill_stores": 8, "spill_loads": 4, "registers": 40}}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_compiles_without_spills(reports, source, arch):
    rc, text = reports[(source.name, arch)]
    assert rc == 0, f"nvcc failed for {source.name} ({arch}):\n{text}"
    entries = parse_report(text)
    declared = set(_KERNEL.findall(source.read_text()))
    assert declared, f"{source.name} declares no extern \"C\" __global__ kernel"
    assert declared <= set(entries), f"ptxas reported {sorted(entries)}, source declares {sorted(declared)}"
    allowed = {m.group(1): int(m.group(2)) for m in _ALLOW.finditer(source.read_text())}
    for name, info in entries.items():
        assert {"stack", "spill_stores", "spill_loads", "registers"} <= set(info), f"{name}: incomplete report\n{text}"
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, f"{name} ({arch}) spills: {info}"
        assert info["stack"] <= allowed.get(name, 0), (
            f"{name} ({arch}) uses a {info['stack']} B stack frame (local memory); document it with "
            f"'// kdlib-allow-stack: {name} <bytes> <why>' if intended"
        )
        assert 0 < info["registers"] <= 255, f"{name} ({arch}): {info['registers']} registers"


@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_kernel_names_are_versioned(source):
    names = _KERNEL.findall(source.read_text())
    bad = [n for n in names if not re.search(r"_v\d+(_|$)", n)]
    assert not bad, f"{source.name}: kernel names must carry a version (<op>_v<N>[_variant]): {bad}"
