"""Cached loader of the CUDA sources in `kernels/*.cu`, through `cupy.RawModule` (NVRTC).

Every kernel lives in `kernels/<stem>.cu` (raw pointers, `extern "C"`, versioned names such as
`tree_build_v1`). A wrapper gets a launchable function with

    from kdlib.cuda import loader
    fn = loader.get_function("tree_build_v1", "tree_build_v1")   # (file stem, kernel name)
    fn((grid,), (threads,), (arg0, arg1, ...), shared_mem=nbytes)   # cupy.RawKernel call

Arguments are CuPy arrays (passed as device pointers) or numpy scalars of the exact C type
(`numpy.int32(n)`, `numpy.float32(x)`); a Python int is passed as a 64-bit integer, which does
not match an `int` parameter.

Caching: one `RawModule` per (stem, options, device) per process; the source is read once, so
edits to a `.cu` file need `clear_cache()` (or a fresh process). CuPy also keeps compiled cubins
on disk (`~/.cupy/kernel_cache`), keyed by source, options, arch and NVRTC version, so a fresh
process recompiles only what changed.

Options: NVRTC gets `-I kernels/` (so sources may include shared headers there) and
`--std=c++17`; CuPy itself appends `-arch=sm_<cc>` for the current device and always adds
`-ftz=true` (fp32 denormals flush to zero; see design/reference/kernels-perf.md §6). Pass extra
flags with `options=(...)`, e.g. `("-arch=sm_90a",)` to get `__CUDA_ARCH_FEAT_SM90_ALL` (wgmma);
name templated kernels with `name_expressions=("k<float, 64>",)` and look them up by the same
string.

More than 48 KB of dynamic shared memory needs `set_max_dynamic_shared(fn, nbytes)` once
before the launch.

Torch CUDA tensors enter through DLPack without a copy: `as_cupy(t)`.

cupy is imported inside the functions, so importing this module works on machines without it.
"""

from __future__ import annotations

import threading
from pathlib import Path

from kdlib import KERNELS

_LOCK = threading.Lock()
_MODULES: dict[tuple, object] = {}
_FUNCTIONS: dict[tuple, object] = {}
_SOURCES: dict[str, str] = {}
_BASE_OPTIONS = ("--std=c++17", f"-I{KERNELS}")


def sources() -> list[str]:
    """The file stems of every `kernels/*.cu`, sorted (e.g. ['kv_compact_v1', 'tree_build_v1'])."""
    return sorted(p.stem for p in KERNELS.glob("*.cu"))


def source_path(stem: str) -> Path:
    """Path of `kernels/<stem>.cu`; ValueError naming the known stems when it does not exist."""
    if "/" in stem or stem.endswith(".cu"):
        raise ValueError(f"give the file stem (e.g. 'tree_build_v1'), not a path: {stem!r}")
    path = KERNELS / f"{stem}.cu"
    if not path.is_file():
        raise ValueError(f"no kernel source kernels/{stem}.cu; known: {sources()}")
    return path


def _source(stem: str) -> str:
    if stem not in _SOURCES:
        _SOURCES[stem] = source_path(stem).read_text()
    return _SOURCES[stem]


def get_module(stem: str, *, options: tuple[str, ...] = (), name_expressions: tuple[str, ...] = ()):
    """The compiled `cupy.RawModule` of `kernels/<stem>.cu` for the current device (cached)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    key = (stem, tuple(options), tuple(name_expressions), device)
    mod = _MODULES.get(key)
    if mod is None:
        with _LOCK:
            mod = _MODULES.get(key)
            if mod is None:
                mod = cupy.RawModule(
                    code=_source(stem),
                    options=_BASE_OPTIONS + tuple(options),
                    name_expressions=tuple(name_expressions) or None,
                )
                mod.compile()  # compile now, so a source error surfaces here and not at first launch
                _MODULES[key] = mod
    return mod


def get_function(stem: str, name: str, *, options: tuple[str, ...] = (), name_expressions: tuple[str, ...] = ()):
    """The kernel `name` of `kernels/<stem>.cu` as a `cupy.RawKernel` (cached per device)."""
    import cupy

    key = (stem, name, tuple(options), tuple(name_expressions), cupy.cuda.runtime.getDevice())
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = get_module(stem, options=options, name_expressions=name_expressions).get_function(name)
        _FUNCTIONS[key] = fn
    return fn


def set_max_dynamic_shared(fn, nbytes: int) -> None:
    """Allow `fn` to launch with `nbytes` of dynamic shared memory (needed above 48 KB)."""
    if nbytes > 48 * 1024 and fn.max_dynamic_shared_size_bytes < nbytes:
        fn.max_dynamic_shared_size_bytes = nbytes


def clear_cache() -> None:
    """Forget every loaded module and source (after editing a `.cu` file in a live session)."""
    with _LOCK:
        _MODULES.clear()
        _FUNCTIONS.clear()
        _SOURCES.clear()


def is_torch(x) -> bool:
    """True when `x` is a torch tensor (checked without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch"


def as_cupy(x):
    """A CuPy view of `x`: CuPy arrays pass through, torch CUDA tensors cross by DLPack (no copy).

    Anything else (numpy arrays, CPU tensors, lists) is a ValueError: the CUDA wrappers never
    copy host data implicitly.
    """
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if is_torch(x):
        if not x.is_cuda:
            raise ValueError(f"expected a CUDA tensor, got a torch tensor on {x.device}")
        return cupy.from_dlpack(x)
    raise ValueError(f"expected a cupy.ndarray or a torch CUDA tensor, got {type(x).__name__}")


def like_input(y, x):
    """Return the CuPy array `y` as the kind of array `x` was: a torch tensor (DLPack) or CuPy."""
    if is_torch(x):
        import torch

        return torch.from_dlpack(y)
    return y
