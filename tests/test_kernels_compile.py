"""Every `kernels/*.cu` compiles with nvcc to a cubin for sm_90 (H200) and sm_120 (RTX PRO 6000
Blackwell), and ptxas's resource report (-Xptxas -v) shows no spills and no stack frame.

A kernel that needs a stack frame documents it in its source with a line
`// kdlib-allow-stack: <kernel name> <max bytes> <why>`; its frame may then be up to that size
(spills are never allowed). Files are found by glob, so new kernels are checked automatically.

Speed: all (file, arch) compiles run in parallel (`kdlib.cuda.loader.resource_report`'s thread
pool) and each report is cached under build/ptxas-cache/ keyed by source, flags and nvcc
version, so an unchanged file costs nothing on the next run.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re

import pytest

from kdlib import KERNELS
from kdlib.cuda import loader

SOURCES = sorted(KERNELS.glob("*.cu"))

pytestmark = pytest.mark.skipif(loader.nvcc_path() is None, reason="nvcc not found on PATH")


@pytest.fixture(scope="module")
def reports() -> dict[tuple[str, str], tuple[int, str]]:
    jobs = [(src.stem, arch) for src in SOURCES for arch in loader.ARCHS]
    with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(jobs, pool.map(lambda j: loader.compile_report(*j), jobs), strict=True))


def test_there_are_kernels():
    assert SOURCES, f"no kernels/*.cu found under {KERNELS}"


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
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_compiles_without_spills(reports, source, arch):
    rc, text = reports[(source.stem, arch)]
    assert rc == 0, f"nvcc failed for {source.name} ({arch}):\n{text}"
    entries = loader.parse_ptxas(text)
    src = source.read_text()
    declared = set(loader.KERNEL_DECL.findall(src))
    assert declared, f'{source.name} declares no extern "C" __global__ kernel'
    assert declared <= set(entries), f"ptxas reported {sorted(entries)}, source declares {sorted(declared)}"
    allowed = {m.group(1): int(m.group(2)) for m in loader.ALLOW_STACK.finditer(src)}
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
    names = loader.KERNEL_DECL.findall(source.read_text())
    bad = [n for n in names if not re.search(r"_v\d+(_|$)", n)]
    assert not bad, f"{source.name}: kernel names must carry a version (<op>_v<N>[_variant]): {bad}"


def _libnvrtc():
    """libnvrtc from the nvidia-cuda-nvrtc wheel (the compiler CuPy uses at run time), or None."""
    import ctypes
    import glob

    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        lib = os.path.join(root, "cu13", "lib")
        main = sorted(glob.glob(os.path.join(lib, "libnvrtc.so.*")))
        if main:
            # NVRTC dlopens its builtins by soname; load them first so the lookup finds them.
            for builtins in sorted(glob.glob(os.path.join(lib, "libnvrtc-builtins.so.*"))):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(main[0])
    return None


_NVRTC = _libnvrtc()


def _cuda_include() -> str:
    """The CUDA toolkit's include folder (cuda_bf16.h and friends), as CuPy finds it at run time."""
    import glob

    nvcc = os.path.realpath(loader.nvcc_path() or "")
    candidates = [os.environ.get("CUDA_HOME", ""), os.path.dirname(os.path.dirname(nvcc)), "/usr/local/cuda"]
    candidates += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in candidates:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_bf16.h")):
            return os.path.join(root, "include")
    pytest.fail(f"no CUDA include folder with cuda_bf16.h among {candidates}")


@pytest.mark.skipif(_NVRTC is None, reason="nvidia-cuda-nvrtc is not installed (requirements.lock pins it)")
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_compiles_with_nvrtc_as_cupy_does(source):
    """nvcc accepts things NVRTC rejects (host headers such as <stdint.h> or <math.h>, INFINITY); CuPy's
    RawModule compiles with NVRTC, so compile each file the way it does: C++17, flush-to-zero, device as
    the default execution space, sm_90."""
    import ctypes

    include = _cuda_include()
    options = [b"--std=c++17", b"-arch=sm_90", b"-ftz=true", b"--device-as-default-execution-space",
               f"-I{KERNELS}".encode(), f"-I{include}".encode()]
    prog = ctypes.c_void_p()
    assert _NVRTC.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0, None, None) == 0
    try:
        rc = _NVRTC.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        _NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        _NVRTC.nvrtcGetProgramLog(prog, log)
    finally:
        _NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, f"NVRTC rejected {source.name}:\n{log.value.decode(errors='replace')}"
