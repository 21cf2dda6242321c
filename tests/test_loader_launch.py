"""kdlib.cuda.loader.launch on the CPU: the ctypes mirrors of the driver's launch structures against cuda.h
(a host program compiled by nvcc prints their layout), the kernel-argument conversion, and the plain path;
the module and function caches' keys (against a stand-in for CuPy that records what it compiles)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import types

import numpy as np
import pytest

from kdlib.cuda import loader

LAYOUT_PROGRAM = r"""
#include <cstddef>
#include <cstdio>
#include <cuda.h>
int main() {
    std::printf("%zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchAttribute),
                offsetof(CUlaunchAttribute, value), sizeof(CUlaunchConfig),
                offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),
                offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
                (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    return 0;
}
"""


@pytest.mark.skipif(loader.nvcc_path() is None, reason="nvcc not found on PATH")
def test_launch_structures_match_cuda_h(tmp_path):
    src, exe = tmp_path / "layout.cpp", tmp_path / "layout"
    src.write_text(LAYOUT_PROGRAM)
    subprocess.run([loader.nvcc_path(), "-o", str(exe), str(src)], check=True, capture_output=True)
    printed = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    got = [int(v) for v in printed.split()]
    attr, cfg = loader._LaunchAttribute, loader._LaunchConfig
    assert got == [ctypes.sizeof(attr), attr.value.offset, ctypes.sizeof(cfg), cfg.shared_mem.offset,
                   cfg.stream.offset, cfg.attrs.offset, cfg.num_attrs.offset,
                   loader._PROGRAMMATIC_STREAM_SERIALIZATION]


class _DeviceArray:
    """Stands for a CuPy array: what loader.kernel_arg reads of one."""

    __cuda_array_interface__ = {"data": (0x7F00_0000_1000, False), "shape": (4,), "typestr": "<f4",
                                "version": 3}


def test_kernel_arg_passes_pointers_and_exact_c_scalars():
    cases = [(_DeviceArray(), ctypes.c_uint64, 0x7F00_0000_1000), (np.int32(-7), ctypes.c_int32, -7),
             (np.uint32(7), ctypes.c_uint32, 7), (np.int64(1 << 40), ctypes.c_int64, 1 << 40),
             (np.uintp(0), ctypes.c_uint64, 0), (np.float32(0.5), ctypes.c_float, 0.5)]
    for value, ctype, want in cases:
        arg = loader.kernel_arg(value)
        assert type(arg) is ctype and arg.value == want


@pytest.mark.parametrize("value", [3, 2.5, np.float64(1.0), np.int16(1), "x"])
def test_kernel_arg_refuses_what_matches_no_c_parameter(value):
    with pytest.raises(TypeError, match="a kernel argument must be"):
        loader.kernel_arg(value)


def test_launch_without_pdl_is_the_cupy_call():
    calls = []

    def fn(grid, block, args, shared_mem=0):
        calls.append((grid, block, args, shared_mem))

    loader.launch(fn, (3, 2), (128,), (np.int32(1),), shared_mem=4096)
    assert calls == [((3, 2), (128,), (np.int32(1),), 4096)]


class _Module:
    """What the caches need of `cupy.RawModule`: its options, compile(), get_function()."""

    def __init__(self, code, options, name_expressions):
        self.options = options

    def compile(self):
        pass

    def get_function(self, name):
        return (name, self.options)


def test_function_cache_follows_the_environment_options(monkeypatch):
    """KDLIB_NVRTC_OPTIONS set after a kernel has loaded: the next lookup is the build with them (the function
    cache keyed on them as the module cache is), and unsetting them gives the first build back."""
    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=_Module, cuda=cuda))
    monkeypatch.delenv("KDLIB_NVRTC_OPTIONS", raising=False)
    loader.clear_cache()
    try:
        plain = loader.get_function("tree_build/v1", "tree_build_v1")
        monkeypatch.setenv("KDLIB_NVRTC_OPTIONS", "-lineinfo")
        lined = loader.get_function("tree_build/v1", "tree_build_v1")
        assert "-lineinfo" not in plain[1] and lined[1][-1] == "-lineinfo"
        assert loader.get_function("tree_build/v1", "tree_build_v1") is lined
        monkeypatch.delenv("KDLIB_NVRTC_OPTIONS")
        assert loader.get_function("tree_build/v1", "tree_build_v1") is plain
    finally:
        loader.clear_cache()
