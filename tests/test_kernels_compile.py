"""Every `kernels/<family>/*.cu` compiles with nvcc to a cubin for sm_90 (H200) and sm_120 (RTX PRO 6000
Blackwell), and ptxas's resource report (-Xptxas -v) shows no spills and no stack frame.

A kernel that needs a stack frame documents it in its source with a line
`// kdlib-allow-stack: <kernel name> <max bytes> <why>`; its frame may then be up to that size
(spills are never allowed). Files are found by glob, so new kernels are checked automatically; shared
device code in `kernels/common/*.cuh` (and a family's own `.cuh`) is checked through the files including it.

Speed: all (file, arch) compiles run in parallel (`kdlib.cuda.loader.resource_report`'s thread
pool) and each report is cached under build/ptxas-cache/ keyed by source (headers expanded), flags and nvcc
version, so an unchanged file costs nothing on the next run.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re

import pytest

from kdlib import KERNELS
from kdlib.cuda import loader

SOURCES = sorted(KERNELS.glob("*/*.cu"))
IDS = [s.relative_to(KERNELS).as_posix() for s in SOURCES]


def _stem(source) -> str:
    return source.relative_to(KERNELS).with_suffix("").as_posix()

pytestmark = pytest.mark.skipif(loader.nvcc_path() is None, reason="nvcc not found on PATH")


@pytest.fixture(scope="module")
def reports() -> dict[tuple[str, str], tuple[int, str]]:
    jobs = [(_stem(src), arch) for src in SOURCES for arch in loader.ARCHS]
    with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(jobs, pool.map(lambda j: loader.compile_report(*j), jobs), strict=True))


def test_there_are_kernels():
    assert SOURCES, f"no kernels/<family>/*.cu found under {KERNELS}"
    assert [_stem(s) for s in SOURCES] == loader.sources()


def test_parse_ptxas_reads_the_report_lines():
    text = (
        "ptxas info    : Compiling entry function 'k_v1' for 'sm_90'\n"
        "ptxas info    : Function properties for k_v1\n"
        "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 16 bytes smem\n"
    )
    assert loader.parse_ptxas(text) == {
        "k_v1": {"stack": 16, "spill_stores": 8, "spill_loads": 4, "registers": 40, "static_smem": 16}
    }


@pytest.mark.parametrize("arch", loader.ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_compiles_without_spills(reports, source, arch):
    rc, text = reports[(_stem(source), arch)]
    assert rc == 0, f"nvcc failed for {_stem(source)}.cu ({arch}):\n{text}"
    entries = loader.parse_ptxas(text)
    src = source.read_text()
    declared = set(loader.KERNEL_DECL.findall(src))
    assert declared, f'{_stem(source)}.cu declares no extern "C" __global__ kernel'
    assert declared <= set(entries), f"ptxas reported {sorted(entries)}, source declares {sorted(declared)}"
    allowed = {m.group(1): int(m.group(2)) for m in loader.ALLOW_STACK.finditer(src)}
    for name, info in entries.items():
        assert {"stack", "spill_stores", "spill_loads", "registers"} <= set(info), \
            f"{name}: incomplete report\n{text}"
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, f"{name} ({arch}) spills: {info}"
        assert info["stack"] <= allowed.get(name, 0), (
            f"{name} ({arch}) uses a {info['stack']} B stack frame (local memory); document it with "
            f"'// kdlib-allow-stack: {name} <bytes> <why>' if intended"
        )
        assert 0 < info["registers"] <= 255, f"{name} ({arch}): {info['registers']} registers"


def test_stems_name_family_and_file():
    assert loader.source_path("tree_verify/prefix_v4") == KERNELS / "tree_verify" / "prefix_v4.cu"
    for bad in ("tree_build/v9", "tree_build_v9", "tree_build/v1.cu", "../kernels/tree_build/v1",
                "common/w4a16"):
        with pytest.raises(ValueError):
            loader.source_path(bad)


def _tiny_tree(root, value: int):
    """kernels-like folder: fam/v1.cu includes common/h.cuh (which includes common/g.cuh twice over)."""
    (root / "common").mkdir(parents=True, exist_ok=True)
    (root / "fam").mkdir(exist_ok=True)
    (root / "common" / "g.cuh").write_text("#pragma once\n__device__ __forceinline__ int g() { return 3; }\n")
    (root / "common" / "h.cuh").write_text(
        f'#pragma once\n#include "common/g.cuh"\n'
        f'__device__ __forceinline__ int h() {{ return g() + {value}; }}\n'
    )
    (root / "fam" / "v1.cu").write_text(
        '#include "common/h.cuh"\n#include "common/g.cuh"\n'
        'extern "C" __global__ void fam_v1(int* out) { out[threadIdx.x] = h(); }\n'
    )


def test_expand_includes_inlines_each_header_once(tmp_path):
    _tiny_tree(tmp_path, 5)
    text = loader.expand_includes(tmp_path / "fam" / "v1.cu", tmp_path)
    assert "#include" not in text and "pragma once" not in text
    assert text.count("int g()") == 1 and "return g() + 5;" in text
    (tmp_path / "fam" / "v1.cu").write_text('#include "common/missing.cuh"\n')
    with pytest.raises(ValueError, match="missing.cuh"):
        loader.expand_includes(tmp_path / "fam" / "v1.cu", tmp_path)


def test_editing_a_header_changes_the_compile_cache_key(tmp_path, monkeypatch):
    """compile_report keys its cache on the source with headers expanded: a header edit recompiles."""
    kernels, cache = tmp_path / "kernels", tmp_path / "cache"
    _tiny_tree(kernels, 5)
    monkeypatch.setattr(loader, "KERNELS", kernels)
    rc, text = loader.compile_report("fam/v1", "sm_90", cache_dir=cache)
    assert rc == 0, text
    assert "fam_v1" in loader.parse_ptxas(text)
    assert loader.compile_report("fam/v1", "sm_90", cache_dir=cache) == (0, text)  # served from the cache
    assert len(list(cache.iterdir())) == 1
    _tiny_tree(kernels, 6)
    rc, _ = loader.compile_report("fam/v1", "sm_90", cache_dir=cache)
    assert rc == 0
    assert len(list(cache.iterdir())) == 2, "a header edit must give a new cache entry"


def test_use_kernels_compiles_from_another_tree_until_reset(tmp_path):
    """tools/kernel_ab.py's arms: use_kernels(root) makes every later compile read root's sources (its
    headers too); use_kernels(None) goes back to kernels/."""
    _tiny_tree(tmp_path, 5)
    stem = loader.sources()[0]
    mine = loader._source(stem)
    try:
        loader.use_kernels(tmp_path)
        assert "return g() + 5;" in loader._source("fam/v1")
        _tiny_tree(tmp_path, 7)
        assert "return g() + 5;" in loader._source("fam/v1"), "a loaded source is kept until the next reset"
        loader.use_kernels(tmp_path)
        assert "return g() + 7;" in loader._source("fam/v1")
    finally:
        loader.use_kernels(None)
    assert loader._source(stem) == mine
    with pytest.raises(ValueError, match="no kernel source"):
        loader._source("fam/v1")


@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_kernel_names_are_versioned(source):
    names = loader.KERNEL_DECL.findall(source.read_text())
    bad = [n for n in names if not re.search(r"_v\d+(_|$)", n)]
    assert not bad, f"{_stem(source)}.cu: kernel names must carry a version (<op>_v<N>[_variant]): {bad}"


_NVRTC = loader.libnvrtc()


def _cuda_include() -> str:
    """The CUDA toolkit's include folder (cuda_bf16.h and friends), as CuPy finds it at run time."""
    found = loader.cuda_include()
    if found is None:
        pytest.fail("no CUDA include folder with cuda_bf16.h (CUDA_HOME, nvcc's, /usr/local/cuda*)")
    return found


@pytest.mark.skipif(_NVRTC is None, reason="nvidia-cuda-nvrtc is not installed (requirements.lock pins it)")
@pytest.mark.parametrize("source", SOURCES, ids=IDS)
def test_compiles_with_nvrtc_as_cupy_does(source):
    """nvcc accepts things NVRTC rejects (host headers such as <stdint.h> or <math.h>, INFINITY); CuPy's
    RawModule compiles with NVRTC, so compile each file the way it does: C++17, flush-to-zero, device as
    the default execution space, sm_90."""
    rc, log = _nvrtc_compile(source, [b"-arch=sm_90"])
    assert rc == 0, f"NVRTC rejected {_stem(source)}.cu:\n{log}"


def _nvrtc_compile(source, extra: list[bytes]) -> tuple[int, str]:
    """(NVRTC result code, program log) of `source` with CuPy's options (C++17, flush-to-zero, device as
    the default execution space, the kernel and CUDA include folders) plus `extra`."""
    import ctypes

    options = [b"--std=c++17", *extra, *(o.encode() for o in loader.CUPY_NVRTC_OPTIONS),
               f"-I{KERNELS}".encode(), f"-I{_cuda_include()}".encode()]
    prog = ctypes.c_void_p()
    text = loader.expand_includes(source, KERNELS).encode()  # what kdlib.cuda.loader hands NVRTC
    assert _NVRTC.nvrtcCreateProgram(ctypes.byref(prog), text, source.name.encode(), 0, None, None) == 0
    try:
        rc = _NVRTC.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        _NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        _NVRTC.nvrtcGetProgramLog(prog, log)
    finally:
        _NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


ARCH_A = re.compile(r"//\s*kdlib-arch:\s*sm_90a\s+wgmma=([\w,]+)")
SOURCES_90A = [s for s in SOURCES if ARCH_A.search(s.read_text())]


def _cuobjdump() -> str | None:
    """cuobjdump (on PATH, else the nvidia-cuda-cuobjdump wheel's) where nvdisasm, which it runs, is found
    too (requirements.lock pins both; the wheels' bin folder is put on PATH for it), else None."""
    return loader.wheel_tool("cuobjdump") if loader.wheel_tool("nvdisasm") else None


def _sass(cubin) -> dict[str, str]:
    """cuobjdump -sass of a cubin -> {kernel: its SASS}."""
    import subprocess

    exe = _cuobjdump()
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(exe), os.environ.get("PATH", "")])}
    sass = subprocess.run([exe, "-sass", str(cubin)], capture_output=True, text=True, timeout=120, env=env,
                          check=True).stdout
    return {f.split()[0]: f for f in sass.split("Function : ")[1:]}


@pytest.mark.parametrize("source", SOURCES_90A, ids=[s.relative_to(KERNELS).as_posix() for s in SOURCES_90A])
def test_sm90a_kernels_compile_without_spills_and_use_wgmma(source, tmp_path):
    """Files marked '// kdlib-arch: sm_90a wgmma=<kernels>' also build for sm_90a with nvcc: no warning, no
    spill, no stack frame, and (where cuobjdump is on PATH) HGMMA in the SASS of each kernel named. Where a
    kernel moves registers between its warpgroups (setmaxnreg: one producer warpgroup releases, the others
    take), what they take fits the CTA's pool, the registers it launched with: setmaxnreg.inc waits until the
    pool has them, so a split past it hangs the kernel (version 12's first build did)."""
    import subprocess

    cubin = tmp_path / "k.cubin"
    proc = subprocess.run([loader.nvcc_path(), *loader.NVCC_FLAGS, f"-I{KERNELS}",
                           "-gencode=arch=compute_90a,code=sm_90a", "-o", str(cubin), str(source)],
                          capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "warning" not in text.lower(), text  # e.g. wgmma serialised by ptxas (C7510)
    entries = loader.parse_ptxas(text)
    assert set(loader.KERNEL_DECL.findall(source.read_text())) <= set(entries)
    for name, info in entries.items():
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, \
            f"{name}: {info}"
    if _cuobjdump() is None:
        pytest.skip("no cuobjdump (PATH or the nvidia-cuda-cuobjdump wheel): the SASS check did not run")
    by_name = _sass(cubin)
    for name in ARCH_A.search(source.read_text()).group(1).split(","):  # the kernels the marker names
        hgmma = [ln for ln in by_name[name].splitlines() if "HGMMA" in ln]
        assert hgmma, f"{name}: no HGMMA in its SASS"
        # each wgmma group ends with the one HGMMA that carries gsb0 and is waited for once; where ptxas
        # serialises the wgmmas (its notes C7510-C7520), every HGMMA carries it and a WARPGROUP.DEPBAR follows
        assert sum("gsb0" in ln for ln in hgmma) < len(hgmma), f"{name}: every wgmma serialised"
        dec, inc = ({int(v, 16) for v in re.findall(rf"USETMAXREG\.{op}\.CTAPOOL (?:\w+, )?(0x[0-9a-f]+)",
                                                       by_name[name])} for op in ("DEALLOC", "TRY_ALLOC"))
        if dec or inc:
            threads = loader.launch_bounds(source.relative_to(KERNELS).with_suffix("").as_posix())[name][0]
            assert len(dec) == len(inc) == 1, f"{name}: setmaxnreg counts {dec}, {inc}"
            pool = entries[name]["registers"] * threads
            assert 128 * dec.pop() + (threads - 128) * inc.pop() <= pool, f"{name}: past the CTA's {pool}"


@pytest.mark.skipif(_NVRTC is None, reason="nvidia-cuda-nvrtc is not installed (requirements.lock pins it)")
@pytest.mark.parametrize("source", SOURCES_90A, ids=[s.relative_to(KERNELS).as_posix() for s in SOURCES_90A])
def test_sm90a_kernels_compile_with_nvrtc_as_the_wrappers_load_them(source):
    """What the CuPy wrappers load: NVRTC with '-arch=sm_90a' beside CuPy's own '-arch=sm_90' and
    '-ftz=true' (NVRTC builds for sm_90a then); ptxas -v shows no spill and no stack frame."""
    rc, text = _nvrtc_compile(source, [b"-arch=sm_90a", b"-arch=sm_90", b"--ptxas-options=-v"])
    assert rc == 0, f"NVRTC rejected {_stem(source)}.cu:\n{text}"
    entries = loader.parse_ptxas(text.replace("ptxas         .", "ptxas info    :"))
    assert set(loader.KERNEL_DECL.findall(source.read_text())) <= set(entries), text
    assert "for 'sm_90a'" in text, text
    for name, info in entries.items():
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, \
            f"{name}: {info}"



@pytest.mark.skipif(_NVRTC is None, reason="nvidia-cuda-nvrtc is not installed (requirements.lock pins it)")
def test_v7_racecheck_build_compiles_and_only_syncs(tmp_path):
    """tree_verify v7's checking build (-DTV7_RACECHECK=1, what the sanitizer run loads through
    KDLIB_NVRTC_OPTIONS) builds with NVRTC as the wrappers load it, without spills; in its PTX (nvcc) the
    consumers' handoffs are bar.sync only, where the default build has bar.arrive."""
    source = KERNELS / "tree_verify" / "wgmma_v7.cu"
    rc, text = _nvrtc_compile(source, [b"-arch=sm_90a", b"-arch=sm_90", b"--ptxas-options=-v",
                                       b"-DTV7_RACECHECK=1"])
    assert rc == 0, text
    info = loader.parse_ptxas(text.replace("ptxas         .", "ptxas info    :"))["tree_verify_v7_attend"]
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, info
    ptx = {name: _ptx(source, extra, tmp_path / f"{name}.ptx")
           for name, extra in (("default", []), ("racecheck", ["-DTV7_RACECHECK=1"]))}
    assert "bar.arrive" in ptx["default"] and "bar.arrive" not in ptx["racecheck"]


def _ptx(source, extra: list[str], out) -> str:
    """The PTX nvcc makes of `source` for sm_90a with the -D options `extra`, written to `out`."""
    import subprocess

    cmd = [loader.nvcc_path(), "-std=c++17", "-ptx", "-arch=sm_90a", f"-I{KERNELS}", *extra, "-o", str(out),
           str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out.read_text()


SWITCH_BUILDS = [*(f"-DTV7_PROBE={p}" for p in range(1, 10)), "-DTV_TRACE=1"]


@pytest.mark.skipif(_NVRTC is None, reason="nvidia-cuda-nvrtc is not installed (requirements.lock pins it)")
@pytest.mark.parametrize("option", SWITCH_BUILDS)
def test_v10_switch_builds_compile_without_spills(option):
    """Version 10's file as the suites load it builds with NVRTC without spills or stack frames, every kernel
    of the file, in each build a -D switch of wgmma_ws.cuh makes: the timing probes 1 .. 9 and the
    attention_timeline build."""
    source = KERNELS / "tree_verify" / "wgmma_v10.cu"
    rc, text = _nvrtc_compile(source, [b"-arch=sm_90a", b"-arch=sm_90", b"--ptxas-options=-v",
                                       option.encode()])
    assert rc == 0, text
    for name, info in loader.parse_ptxas(text.replace("ptxas         .", "ptxas info    :")).items():
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, (name, info)


@pytest.mark.skipif(loader.nvcc_path() is None, reason="nvcc not found on PATH")
def test_v10_trace_stamps_only_the_traced_build_of_v7s_consumers(tmp_path):
    """In the PTX (nvcc) of -DTV_TRACE=1 the kernels of v7's consumers read the clock once per event on each
    consumer's path: events 0-2 and the last once (the loop's shared path), the others once in each
    consumer's branch; they hold the tv_trace buffer. The shipped build reads no clock, nor does v9's kernel
    traced."""
    source = KERNELS / "tree_verify" / "wgmma_v10.cu"
    nevents = loader.source_constants("tree_verify/wgmma_v10")["TRACE_EVENTS"]
    marks = 4 + 2 * (nevents - 4)  # 0-2 and the last: the shared path; the rest: each consumer's branch

    def clocks(extra):
        ptx = _ptx(source, extra, tmp_path / f"trace{len(extra)}.ptx")  # each build its own file
        bodies = {b.split("(")[0]: b for b in ptx.split(".entry ")[1:]}
        return ".global .align 8 .b8 tv_trace[" in ptx, {k: b.count("%clock64") for k, b in bodies.items()}

    with cf.ThreadPoolExecutor(max_workers=2) as pool:
        (held0, shipped), (held1, traced) = pool.map(clocks, ([], ["-DTV_TRACE=1"]))
    assert not held0 and held1 and not any(shipped.values())
    assert traced["tree_verify_v10_attend"] == traced["tree_verify_v7_attend"] == marks > 0
    assert traced["tree_verify_v10_attend_t"] == 0


@pytest.mark.skipif(loader.nvcc_path() is None, reason="nvcc not found on PATH")
def test_v10_probes_drop_the_mmas_they_name_from_v7s_consumers_only(tmp_path):
    """In the probes' PTX (nvcc) the kernel of v7's consumers keeps the default's wgmma where the consumers'
    work is timed (2; 5: its S over the other stage's keys; 6: consumer 1's S skipped at run time, the code
    kept), none where only the gathers are (1), and part of them without P V (3) or S (4), the two parts
    adding up to the whole; 7 has S's wgmmas once more (consumer 0's second S); 8 (half the gathers) and 9
    (the gathers twice) all of them. The kernel of v9's consumers keeps its own in every probe."""
    source = KERNELS / "tree_verify" / "wgmma_v10.cu"

    def mmas(probe):
        ptx = _ptx(source, [f"-DTV7_PROBE={probe}"], tmp_path / f"probe{probe}.ptx")
        bodies = {b.split("(")[0]: b for b in ptx.split(".entry ")[1:]}  # each kernel to the next
        return {k: bodies[k].count("wgmma.mma_async")
                for k in ("tree_verify_v10_attend", "tree_verify_v10_attend_t")}

    with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        default, *probes = pool.map(mmas, range(10))
    v7 = [p["tree_verify_v10_attend"] for p in probes]
    whole = default["tree_verify_v10_attend"]
    assert whole > 0 and v7[0] == 0 and v7[1] == v7[4] == v7[5] == v7[7] == v7[8] == whole
    assert 0 < v7[2] < v7[1] and 0 < v7[3] < v7[1] and v7[2] + v7[3] == v7[1]
    assert v7[6] == whole + v7[2]  # S's code once more (probe 3: the S MMAs alone)
    assert all(p["tree_verify_v10_attend_t"] == default["tree_verify_v10_attend_t"] > 0 for p in probes)


@pytest.mark.skipif(_NVRTC is None, reason="nvidia-cuda-nvrtc is not installed (requirements.lock pins it)")
def test_v9_every_row_count_compiles_without_spills_or_serialised_wgmma():
    """tree_verify v9's attend kernel is built per call shape (-DTV9_NR): each row count it takes (8 .. its
    V9_MAX_NR, the host's among them) builds with NVRTC as the wrappers load it, with no spill, no stack
    frame and no wgmma serialised by ptxas (its 'Potential Performance Loss' notes)."""
    from kdlib.cuda import attention

    source = KERNELS / "tree_verify" / "wgmma_v9.cu"
    sets = [(f"-DTV9_NR={nr}",) for nr in range(8, attention._V9_MAX_NR + 1, 8)]
    assert {attention.v9_options(rows) for rows in range(1, 129)} - {None} <= set(sets)

    def build(opts):
        return _nvrtc_compile(source, [b"-arch=sm_90a", b"-arch=sm_90", b"--ptxas-options=-v",
                                       *(o.encode() for o in opts)])

    with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        for opts, (rc, text) in zip(sets, pool.map(build, sets), strict=True):
            assert rc == 0, f"{opts}: {text}"
            assert "Potential Performance Loss" not in text, f"{opts}: {text}"
            info = loader.parse_ptxas(text.replace("ptxas         .", "ptxas info    :"))
            v9 = info["tree_verify_v9_attend"]
            assert v9["spill_stores"] == 0 and v9["spill_loads"] == 0 and v9["stack"] == 0, (opts, v9)


@pytest.mark.skipif(_NVRTC is None, reason="nvidia-cuda-nvrtc is not installed (requirements.lock pins it)")
def test_v10_builds_of_the_host_compile_without_spills_or_serialised_wgmma():
    """tree_verify v10's file as the host builds it with each -DTV9_NR v9_options gives (its kernel with v9's
    consumers; with no option, for v7's, the build is -DTV9_NR=8's, the source's default: built in
    test_sm90a_kernels_compile_with_nvrtc_as_the_wrappers_load_them), and the FP8 build (FP8_OPTIONS) of each
    and of the bare one, builds with NVRTC without spills, stack frames or serialised wgmma, every kernel of
    the file (the FP8 producer's 64 registers: at 56 it spilled). One build of each: on the H200 (e157e38)
    NVRTC gave the bare build's twin, -DTV9_NR=8 after it in one process, rc 0 and an empty log."""
    from kdlib.cuda import attention

    source = KERNELS / "tree_verify" / "wgmma_v10.cu"
    v9 = sorted({attention.v9_options(rows) for rows in range(1, 129)} - {None})
    for opts in v9 + [o + attention.FP8_OPTIONS for o in [(), *v9]]:  # and the FP8 builds of each
        rc, text = _nvrtc_compile(source, [b"-arch=sm_90a", b"-arch=sm_90", b"--ptxas-options=-v",
                                           *(o.encode() for o in opts)])
        assert rc == 0, f"{opts}: {text}"
        assert "Potential Performance Loss" not in text, f"{opts}: {text}"
        info = loader.parse_ptxas(text.replace("ptxas         .", "ptxas info    :"))
        assert set(loader.KERNEL_DECL.findall(source.read_text())) <= set(info), f"{opts}: {text}"
        for name, k in info.items():
            assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["stack"] == 0, (opts, name, k)
