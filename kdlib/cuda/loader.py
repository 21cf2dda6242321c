"""Cached loader of the CUDA sources in `kernels/<family>/*.cu`, through `cupy.RawModule` (NVRTC).

Every kernel lives in `kernels/<family>/<stage>_v<N>.cu` (or `<family>/v<N>.cu` where a version is
the whole op), named by the stem `"<family>/<file stem>"`: `"tree_build/v4"`,
`"tree_verify/prefix_v4"`, `"tree_accept/sample_v3"`; kernels inside keep their versioned
`extern "C"` names (`tree_build_v4_r1`), which recorded results and ncu reports name. A wrapper
gets a launchable function with

    from kdlib.cuda import loader
    fn = loader.get_function("tree_build/v1", "tree_build_v1")   # (stem, kernel name)
    fn((grid,), (threads,), (arg0, arg1, ...), shared_mem=nbytes)   # cupy.RawKernel call

Arguments are CuPy arrays (passed as device pointers) or numpy scalars of the exact C type
(`numpy.int32(n)`, `numpy.float32(x)`); a Python int is passed as a 64-bit integer, which does
not match an `int` parameter.

Shared device code lives in headers under `kernels/common/*.cuh`, included as
`#include "common/<name>.cuh"`. NVRTC compiles `expanded_source(stem)`: the `.cu` text with every
such include inlined (each header once), so every cache below is keyed on the headers too.

Caching: one `RawModule` per (stem, options, device) per process; the source is read once, so
edits to a `.cu` or `.cuh` file need `clear_cache()` (or a fresh process). CuPy also keeps
compiled cubins on disk (`~/.cupy/kernel_cache`), keyed by source (headers expanded), options,
arch and NVRTC version, so a fresh process recompiles only what changed.

Options: NVRTC gets `-I kernels/` and
`--std=c++17`; CuPy itself appends `-arch=sm_<cc>` for the current device and always adds
`-ftz=true` (fp32 denormals flush to zero; see design/reference/kernels-perf.md §6). Pass extra
flags with `options=(...)`, e.g. `("-arch=sm_90a",)` to get `__CUDA_ARCH_FEAT_SM90_ALL` (wgmma); the
environment's `KDLIB_NVRTC_OPTIONS` (space-separated) is appended to every compile, e.g. `-lineinfo` so
that compute-sanitizer and ncu name source lines (of `expanded_source(stem)`), and `with
extra_options("-DX=1"):` adds options to every compile inside the block;
name templated kernels with `name_expressions=("k<float, 64>",)` and look them up by the same
string.

More than 48 KB of dynamic shared memory needs `set_max_dynamic_shared(fn, nbytes)` once
before the launch.

`launch(fn, grid, block, args, shared_mem=..., pdl=True)` launches through the driver's `cuLaunchKernelEx`
with programmatic stream serialization (programmatic dependent launch, sm_90 on), which a CuPy call cannot
ask for: the kernel may start while the one ahead of it in the stream runs, and must `griddepcontrol.wait`
(`pdl_wait`, tree_verify/wgmma_common.cuh) before it reads that kernel's writes. Stream capture records it as
a programmatic edge of the graph.

Torch CUDA tensors enter through DLPack without a copy: `as_cupy(t)`.

Without a GPU, `libnvrtc()`, `cuda_include()`, `CUPY_NVRTC_OPTIONS` and `wheel_tool("cuobjdump")` (or
`"nvdisasm"`) compile and read a kernel as NVRTC builds it on the GPU (tests/test_kernels_compile.py,
tools/ncu_source.py).

cupy is imported inside the functions, so importing this module works on machines without it.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import functools
import glob
import hashlib
import operator
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from kdlib import KERNELS

_LOCK = threading.Lock()
_MODULES: dict[tuple, object] = {}
_FUNCTIONS: dict[tuple, object] = {}
_DEVICE_LIMITS: dict[int, dict] = {}  # device index -> device_limits()
_SOURCES: dict[str, str] = {}
_ROOT: Path | None = None  # the kernels tree compiles read (`use_kernels`); None: KERNELS
_BASE_OPTIONS = ("--std=c++17", f"-I{KERNELS}")
SM90A_OPTIONS = ("-arch=sm_90a",)  # NVRTC options of the wgmma kernels: __CUDA_ARCH_FEAT_SM90_ALL defined


_STEM = re.compile(r"[a-z0-9_]+/[a-z0-9_]+")


def sources() -> list[str]:
    """The stems of every `kernels/<family>/*.cu`, sorted (e.g. ['kv_compact/v1', 'tree_build/v1'])."""
    return sorted(p.relative_to(KERNELS).with_suffix("").as_posix() for p in KERNELS.glob("*/*.cu"))


def source_path(stem: str) -> Path:
    """Path of `kernels/<stem>.cu` for a stem "<family>/<file stem>"; ValueError naming the known
    stems when it does not exist.
    """
    if not _STEM.fullmatch(stem):
        raise ValueError(f"give the stem '<family>/<file stem>' (e.g. 'tree_build/v1'), got {stem!r}")
    path = KERNELS / f"{stem}.cu"
    if not path.is_file():
        raise ValueError(f"no kernel source kernels/{stem}.cu; known: {sources()}")
    return path


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*\n", re.MULTILINE)


def expand_includes(path: Path, include_dir: Path) -> str:
    """The text of `path` with every `#include "name"` inlined, recursively: `name` is looked up
    beside the including file, then under `include_dir` (the compiler's order with
    `-I include_dir`); each file is inlined once (`#pragma once`), `#include <...>` stays.
    ValueError naming the file when an include is not found.
    """
    seen: set[Path] = set()

    def expand(file: Path) -> str:
        def inline(m: re.Match) -> str:
            name = m.group(1)
            found = [c for c in (file.parent / name, include_dir / name) if c.is_file()]
            if not found:
                raise ValueError(f"{file.name}: #include \"{name}\" not found beside it or under "
                                 f"{include_dir}")
            header = found[0].resolve()
            if header in seen:
                return ""
            seen.add(header)
            return _PRAGMA_ONCE.sub("", expand(header)).rstrip("\n")

        return _INCLUDE.sub(inline, file.read_text())

    return expand(path)


def expanded_source(stem: str) -> str:
    """The source of `kernels/<stem>.cu` with its `#include "..."` headers inlined (what NVRTC
    compiles and what the compile caches key on)."""
    return expand_includes(source_path(stem), KERNELS)


def _source(stem: str) -> str:
    if stem not in _SOURCES:
        root = _ROOT
        _SOURCES[stem] = expanded_source(stem) if root is None else expand_includes(root / f"{stem}.cu", root)
    return _SOURCES[stem]


def use_kernels(root: Path | None = None) -> None:
    """Compile from the kernels tree at `root` from now on (another revision's, as tools/kernel_ab.py
    exports it; its includes resolved there); None: this package's kernels/. Forgets every loaded module."""
    global _ROOT
    clear_cache()
    _ROOT = None if root is None else Path(root)


def export_kernels(rev: str, dest: Path) -> Path:
    """`git archive` of revision rev's kernels/ unpacked under dest -> dest/kernels (for `use_kernels`, or to
    build that revision's kernels here), with the commit's full hash in dest/COMMIT (`exported_commit`: rev
    may be a name such as HEAD~1); ValueError where rev names no commit of this repository or one without
    kernels/, before anything is made."""
    git = ["git", "-C", str(KERNELS.parent)]
    found = subprocess.run([*git, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"no commit {rev!r} in {KERNELS.parent}")
    if subprocess.run([*git, "cat-file", "-e", f"{rev}:kernels"], capture_output=True).returncode != 0:
        raise ValueError(f"commit {rev!r} has no kernels/ folder (it predates the CUDA kernels)")
    Path(dest).mkdir(parents=True, exist_ok=True)
    tar = subprocess.run([*git, "archive", rev, "kernels"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    (Path(dest) / "COMMIT").write_text(found.stdout.strip() + "\n")
    return Path(dest) / "kernels"


def exported_commit(kernels: Path) -> str | None:
    """The full hash `export_kernels` wrote beside an exported kernels/ folder, None for any other folder."""
    f = Path(kernels).parent / "COMMIT"
    return f.read_text().strip() if f.is_file() else None


_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+([^\n]*?)[ \t]*(?://[^\n]*)?$",
                     re.MULTILINE)
_CONSTEXPR = re.compile(
    r"^[ \t]*constexpr[ \t]+(?:int|unsigned|u32|long long)[ \t]+([^;]*);", re.MULTILINE
)
_INT_LITERAL = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)([uUlL]*)\b")
_U32 = 1 << 32


def _c_div(a: int, b: int) -> int:
    """C's integer division: the quotient truncated toward zero (Python's // floors)."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: _c_div,
        ast.Mod: lambda a, b: a - b * _c_div(a, b), ast.LShift: operator.lshift, ast.RShift: operator.rshift,
        ast.BitOr: operator.or_, ast.BitAnd: operator.and_}


def _literal(m: re.Match) -> str:
    """A C literal as Python: `(v).unsigned` where it is unsigned (a u suffix, or a hex beyond int's range;
    `unsigned` is a C keyword, so no C expression has that attribute)."""
    v = int(m.group(1), 0)
    unsigned = "u" in m.group(2).lower() or (m.group(1)[:2] in ("0x", "0X") and 2**31 <= v < _U32)
    return f"({v}).unsigned" if unsigned else str(v)


def int_expression(text: str, names: dict[str, int]) -> int | None:
    """The value of a C integer constant expression (literals with u/l suffixes, + - * / % << >> | &,
    parentheses, `names` for identifiers, taken as signed); None when it is anything else (a float, a
    cast, a call) or when C's value is not the exact one: an unsigned value outside [0, 2**32) (it wraps,
    or is a 64-bit unsigned), a shift of or by a negative value. Division and % truncate toward zero as C's.
    """
    py = _INT_LITERAL.sub(_literal, text.strip()).replace("/", "//")
    try:
        tree = ast.parse(py, mode="eval")
    except SyntaxError:
        return None

    def value(node) -> tuple[int, bool]:  # (value, unsigned)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value, False
        if isinstance(node, ast.Attribute) and node.attr == "unsigned":
            return value(node.value)[0], True
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id], False
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            v, u = value(node.operand)
            return checked(-v, u)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            (a, ua), (b, ub) = value(node.left), value(node.right)
            shift = type(node.op) in (ast.LShift, ast.RShift)
            if shift and (a < 0 or b < 0):
                raise ValueError("a shift of or by a negative value")
            u = ua if shift else ua or ub  # a shift has its left operand's type
            if u and (a < 0 or b < 0):
                raise ValueError("a negative operand converted to unsigned")
            return checked(_OPS[type(node.op)](a, b), u)
        raise ValueError(ast.dump(node))

    def checked(v: int, unsigned: bool) -> tuple[int, bool]:
        if unsigned and not 0 <= v < _U32:
            raise ValueError(f"unsigned {v} wraps")
        return v, unsigned

    try:
        return value(tree.body)[0]
    except (ValueError, ZeroDivisionError):
        return None


def source_constants(stem: str) -> dict[str, int]:
    """The integer `#define NAME expr` and `constexpr int name = expr` of `kernels/<stem>.cu`, headers
    included, in source order, evaluated (e.g. {"TB4_THREADS": 256, "LPS_ROWS": 18, ...}). Names defined
    twice with different values, and expressions that are not integer constants, are left out. A
    default under `#ifndef` is its offline value: options such as `-DTA3_THREADS=...` override it.
    """
    text = _source(stem)
    found: dict[str, int] = {}
    clashes: set[str] = set()
    items = [(m.start(), 0, m.group(1), m.group(2)) for m in _DEFINE.finditer(text)]
    for m in _CONSTEXPR.finditer(text):
        for i, part in enumerate(m.group(1).split(",")):
            name, eq, expr = part.partition("=")
            if eq:
                items.append((m.start(), i, name.strip(), expr))
    for *_, name, expr in sorted(items, key=lambda t: t[:2]):
        v = int_expression(expr, found)
        if v is None:
            continue
        if name in found and found[name] != v:
            clashes.add(name)
        found[name] = v
    return {k: v for k, v in found.items() if k not in clashes}


_CLUSTER = r"(?:__cluster_dims__\s*\([^)]*\)\s*)?"  # a compile-time cluster, before or after the bounds
_BOUNDS = re.compile(rf'extern\s+"C"\s+__global__\s+void\s+{_CLUSTER}__launch_bounds__\s*\(([^)]*)\)\s*'
                     rf"{_CLUSTER}(\w+)\s*\(")


def launch_bounds(stem: str) -> dict[str, tuple[int, int]]:
    """Kernel name -> (max threads per block, min blocks per SM, 0 when not given) from the
    `__launch_bounds__` of every `extern "C"` kernel of `kernels/<stem>.cu`, constants evaluated."""
    names = source_constants(stem)
    out = {}
    for m in _BOUNDS.finditer(_source(stem)):
        args = [int_expression(a, names) for a in m.group(1).split(",")]
        out[m.group(2)] = (args[0], args[1] if len(args) > 1 else 0)
    return out


def check_version(version, versions: tuple[int, ...], default: int | None) -> int | None:
    """`version` when it is one of `versions`, `default` when it is None; ValueError otherwise. Every
    wrapper takes `version: int | None` this way (None: the op's DEFAULT_VERSION or default pick)."""
    if version is None:
        return default
    if isinstance(version, bool) or version not in versions:
        raise ValueError(f"version must be None or one of {versions}, got {version!r}")
    return int(version)


def _with_env(options) -> tuple[str, ...]:
    """`options` and the environment's `KDLIB_NVRTC_OPTIONS` after them: what a compile gets, and so what
    the caches key on."""
    return tuple(options) + tuple(os.environ.get("KDLIB_NVRTC_OPTIONS", "").split())


def get_module(stem: str, *, options: tuple[str, ...] = (), name_expressions: tuple[str, ...] = ()):
    """The compiled `cupy.RawModule` of `kernels/<stem>.cu` for the current device (cached)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    options = _with_env(options)
    key = (stem, options, tuple(name_expressions), device)
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


def get_function(
    stem: str, name: str, *, options: tuple[str, ...] = (), name_expressions: tuple[str, ...] = ()
):
    """The kernel `name` of `kernels/<stem>.cu` as a `cupy.RawKernel` (cached per device)."""
    import cupy

    key = (stem, name, _with_env(options), tuple(name_expressions), cupy.cuda.runtime.getDevice())
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = get_module(stem, options=options, name_expressions=name_expressions).get_function(name)
        _FUNCTIONS[key] = fn
    return fn


def device_limits() -> dict:
    """SM count and shared-memory limits of the current device (cached): the persistent grids' sizes,
    which block shapes fit, and how much dynamic shared memory a kernel may ask for."""
    import cupy as cp

    dev = cp.cuda.runtime.getDevice()
    if dev not in _DEVICE_LIMITS:
        props = cp.cuda.runtime.getDeviceProperties(dev)
        _DEVICE_LIMITS[dev] = {
            "sms": int(props["multiProcessorCount"]),
            "smem_block": int(props.get("sharedMemPerBlockOptin", props.get("sharedMemPerBlock", 48 * 1024))),
            "smem_sm": int(props.get("sharedMemPerMultiprocessor", 0)),
            "smem_reserved": int(props.get("reservedSharedMemPerBlock", 1024)),
        }
    return _DEVICE_LIMITS[dev]


def set_max_dynamic_shared(fn, nbytes: int) -> None:
    """Allow `fn` to launch with `nbytes` of dynamic shared memory (needed above 48 KB). A ValueError where
    the device cannot give it that much: its opt-in limit a block, less the kernel's static shared memory."""
    if nbytes > 48 * 1024 and fn.max_dynamic_shared_size_bytes < nbytes:
        limit = device_limits()["smem_block"] - fn.shared_size_bytes
        if nbytes > limit:
            name = getattr(fn, "name", "the kernel")
            raise ValueError(f"{name} needs {nbytes:,} B of dynamic shared memory; this device gives it "
                             f"{limit:,} B at most")
        fn.max_dynamic_shared_size_bytes = nbytes


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 B, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_SCALARS = {"int32": ctypes.c_int32, "uint32": ctypes.c_uint32, "int64": ctypes.c_int64,
            "uint64": ctypes.c_uint64, "float32": ctypes.c_float}


def kernel_arg(a):
    """ctypes storage of one argument of `launch` (pdl): a device array's address (anything with
    `__cuda_array_interface__`), or a numpy scalar of the parameter's C type (int32, uint32, int64, uint64,
    float32; numpy.uintp for a null pointer). A Python number is refused: its C type is unknown."""
    if hasattr(a, "__cuda_array_interface__"):
        return ctypes.c_uint64(a.__cuda_array_interface__["data"][0])
    ctype = _SCALARS.get(getattr(getattr(a, "dtype", None), "name", None))
    if ctype is None:
        raise TypeError(f"a kernel argument must be a device array or a numpy scalar of "
                        f"{sorted(_SCALARS)}, got {type(a).__name__}")
    return ctype(a.item())


def _dim3(d) -> tuple[int, int, int]:
    d = tuple(d) if isinstance(d, tuple | list) else (d,)
    return (tuple(int(x) for x in d) + (1, 1))[:3]


def launch(fn, grid, block, args, *, shared_mem: int = 0, pdl: bool = False) -> None:
    """`fn(grid, block, args, shared_mem=shared_mem)` on CuPy's current stream; pdl: through
    `cuLaunchKernelEx` with programmatic stream serialization (see the module's docstring), the same
    arguments as the CuPy call (device arrays and numpy scalars)."""
    if not pdl:
        fn(grid, block, args, shared_mem=shared_mem)
        return
    import cupy

    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*_dim3(grid)), (ctypes.c_uint * 3)(*_dim3(block)), shared_mem,
                        cupy.cuda.get_current_stream().ptr, ctypes.pointer(attr), 1)
    store = [kernel_arg(a) for a in args]
    params = (ctypes.c_void_p * len(store))(*(ctypes.addressof(v) for v in store))
    _checked(_driver().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(fn.kernel.ptr), params, None),
             f"cuLaunchKernelEx of {fn.name}")


def max_active_clusters(fn, cluster: int, block, shared_mem: int) -> int:
    """The clusters of `fn` (a kernel of compile-time cluster dims, `cluster` CTAs each) the device holds at
    once with `block` threads and `shared_mem` bytes of dynamic shared memory a CTA
    (cuOccupancyMaxActiveClusters): a persistent grid past cluster times that many waits for a second wave.
    Set `set_max_dynamic_shared` first."""
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*_dim3(cluster)), (ctypes.c_uint * 3)(*_dim3(block)), shared_mem,
                        None, None, 0)
    n = ctypes.c_int()
    rc = _driver().cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(fn.kernel.ptr),
                                                ctypes.byref(cfg))
    _checked(rc, f"cuOccupancyMaxActiveClusters of {fn.name}")
    return n.value


# CUtensorMapDataType of the element types tensor_map_2d takes; CUtensorMapSwizzle by the swizzle's bytes
_TMAP_DTYPES = {"uint8": 0, "uint16": 1, "uint32": 2, "float16": 6, "float32": 7, "bfloat16": 9}
_TMAP_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}
_TMAP_L2_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B


def tensor_map_2d(ptr: int, dtype: str, rows: int, cols: int, row_bytes: int, box_rows: int, box_cols: int,
                  swizzle: int = 0):
    """The CUtensorMap (cuTensorMapEncodeTiled) of a 2D global tensor at device address ptr, [rows, cols]
    of `dtype`, rows row_bytes apart, read in boxes of [box_rows, box_cols] with `swizzle` bytes' swizzle
    (0, 32, 64, 128): numpy uint8 [128], the bytes a kernel's TMA instructions take (as a __grid_constant__
    parameter or copied into global memory). Boxes past the tensor's edge land as zeros. The driver's checks
    (ptr and row_bytes a multiple of 16; box_cols times the element size at most `swizzle`) raise
    RuntimeError."""
    if dtype not in _TMAP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_TMAP_DTYPES)}, got {dtype!r}")
    if swizzle not in _TMAP_SWIZZLE:
        raise ValueError(f"swizzle must be one of {sorted(_TMAP_SWIZZLE)} bytes, got {swizzle}")
    for name, v in (("rows", rows), ("cols", cols), ("box_rows", box_rows), ("box_cols", box_cols)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    out = np.zeros(128 + 64, np.uint8)  # CUtensorMap: 128 bytes, 64-byte aligned
    at = (-out.ctypes.data) % 64
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    _checked(_driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(out.ctypes.data + at), _TMAP_DTYPES[dtype], u32(2), ctypes.c_void_p(ptr),
        (u64 * 2)(cols, rows), (u64 * 1)(row_bytes), (u32 * 2)(box_cols, box_rows), (u32 * 2)(1, 1),
        0, _TMAP_SWIZZLE[swizzle], _TMAP_L2_256B, 0), "cuTensorMapEncodeTiled")
    return out[at:at + 128].copy()


def _checked(rc: int, what: str) -> None:
    """RuntimeError naming the driver's error where a driver call returned rc != 0."""
    if rc != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")


@functools.cache
def _driver():
    """libcuda, the driver API."""
    return ctypes.CDLL("libcuda.so.1")


def clear_cache() -> None:
    """Forget every loaded module and source (after editing a `.cu` or `.cuh` file in a live session)."""
    with _LOCK:
        _MODULES.clear()
        _FUNCTIONS.clear()
        _SOURCES.clear()


@contextlib.contextmanager
def extra_options(options: str):
    """Within the block every compile also gets `options` (space-separated NVRTC options, after the
    environment's `KDLIB_NVRTC_OPTIONS`): a build with a -D switch, loaded by code that knows nothing of it.
    The caches are cleared on entry and on exit, so what loads inside is that build and none of it outlives
    the block; the environment is restored."""
    saved = os.environ.get("KDLIB_NVRTC_OPTIONS")
    os.environ["KDLIB_NVRTC_OPTIONS"] = " ".join(filter(None, [saved, options]))
    clear_cache()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("KDLIB_NVRTC_OPTIONS", None)
        else:
            os.environ["KDLIB_NVRTC_OPTIONS"] = saved
        clear_cache()


def is_torch(x) -> bool:
    """True when `x` is a torch tensor (checked without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch"


def aligned16(a, name: str):
    """a (CuPy), where it starts on a 16-byte boundary; else a ValueError naming it (the kernels that read
    16-byte pieces: a view at an odd offset faults their launch)."""
    if a.data.ptr % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary (the kernels copy 16-byte pieces); "
                         f"it starts {a.data.ptr % 16} bytes past one (a view at an offset: copy it)")
    return a


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
        import torch

        if x.dtype == torch.bool:  # bool crosses DLPack as bytes (kdlib.ops does the same the other way)
            return cupy.from_dlpack(x.view(torch.uint8)).view(cupy.bool_)
        return cupy.from_dlpack(x)
    raise ValueError(f"expected a cupy.ndarray or a torch CUDA tensor, got {type(x).__name__}")


def int_array(x, name: str, dtype: str, *, shape: tuple[int, ...] | None = None, ndim: int | None = None,
              check_range: bool = False):
    """`x` (CuPy, or a torch CUDA tensor by DLPack) as a C-contiguous CuPy array of the integer
    `dtype` ("int32" or "int64") the kernels read, after checking that it holds integers and has
    `shape` (or `ndim` dimensions). check_range=True also rejects values the cast would wrap (one
    device sync, and only when x is wider than dtype): int64 2**32 + 5 is an error, not index 5.
    ValueError naming `name` otherwise.
    """
    import cupy

    a = as_cupy(x)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer array, got {a.dtype}")
    if shape is not None and a.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {a.shape}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {a.shape}")
    if check_range and a.size and not cupy.can_cast(a.dtype, dtype):
        info = cupy.iinfo(dtype)
        if bool(((a < info.min) | (a > info.max)).any()):
            raise ValueError(f"{name} holds values outside the {dtype} range")
    return cupy.ascontiguousarray(a, dtype=dtype)


def like_input(y, x):
    """Return the CuPy array `y` as the kind of array `x` was: a torch tensor (DLPack) or CuPy."""
    if is_torch(x):
        import torch

        return torch.from_dlpack(y)
    return y


# ----------------------------------------------------------------------------- offline compile report
# nvcc -cubin + ptxas -v, no GPU needed: used by tests/test_kernels_compile.py and notebook 02.

NVCC_FLAGS = ("-cubin", "-std=c++17", "-Xptxas", "-v")
ARCHS = ("sm_90", "sm_120")  # H200; RTX PRO 6000 Blackwell
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
# an extern "C" kernel's name, past its attributes (__launch_bounds__, __cluster_dims__) in either order
KERNEL_DECL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:(?:__launch_bounds__|__cluster_dims__)\s*\([^)]*\)\s*)*'
    r"(\w+)\s*\("
)
ALLOW_STACK = re.compile(r"//\s*kdlib-allow-stack:\s*(\S+)\s+(\d+)\s+\S")


def nvcc_path() -> str | None:
    """The nvcc on PATH (or $NVCC), or None."""
    return os.environ.get("NVCC") or shutil.which("nvcc")


def nvcc_version() -> str:
    """`nvcc --version`'s output (the compile cache's key and the CPU records' provenance)."""
    return subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True, check=True).stdout


# what CuPy's RawModule adds to a compile's options (NVRTC, on the GPU), beside -arch for the device
CUPY_NVRTC_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


def _wheel_dirs(sub: str) -> list[str]:
    """The nvidia wheels' cu13/<sub> folders (requirements.lock pins nvidia-cuda-nvrtc, -cuobjdump and
    -nvdisasm)."""
    try:
        import nvidia
    except ImportError:
        return []
    return [os.path.join(root, "cu13", sub) for root in nvidia.__path__]


def wheel_tool(name: str) -> str | None:
    """A CUDA binary tool (cuobjdump, nvdisasm) on PATH, else the nvidia wheels', else None."""
    found = shutil.which(name)
    if found:
        return found
    exes = (os.path.join(b, name) for b in _wheel_dirs("bin"))
    return next((e for e in exes if os.access(e, os.X_OK)), None)


@functools.cache
def libnvrtc():
    """NVRTC of the nvidia-cuda-nvrtc wheel (the compiler CuPy runs on the GPU), a ctypes library, or None."""
    for lib in _wheel_dirs("lib"):
        main = sorted(glob.glob(os.path.join(lib, "libnvrtc.so.*")))
        if main:
            # NVRTC dlopens its builtins by soname; load them first so the lookup finds them
            for builtins in sorted(glob.glob(os.path.join(lib, "libnvrtc-builtins.so.*"))):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(main[0])
    return None


def cuda_include() -> str | None:
    """The CUDA toolkit's include folder (cuda_bf16.h and friends) as CuPy finds it, or None."""
    nvcc = os.path.realpath(nvcc_path() or "")
    roots = [os.environ.get("CUDA_HOME", ""), os.path.dirname(os.path.dirname(nvcc)), "/usr/local/cuda"]
    roots += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    return next((os.path.join(r, "include") for r in roots
                 if r and os.path.isfile(os.path.join(r, "include", "cuda_bf16.h"))), None)


def parse_ptxas(text: str) -> dict[str, dict]:
    """ptxas -v output -> {entry: {registers, stack, spill_stores, spill_loads, static_smem}}."""
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
            entries[current].update(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
        m = _REGS.search(line)
        if m:
            entries[current]["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            entries[current]["static_smem"] = int(s.group(1)) if s else 0
    return entries


def compile_report(stem: str, arch: str, *, cache_dir: Path | None = None,
                   defines: tuple[str, ...] = ()) -> tuple[int, str]:
    """(nvcc return code, nvcc + ptxas -v output) for `kernels/<stem>.cu` compiled to a cubin
    (stem "<family>/<file stem>"), with a -D option per `defines` entry ("NAME=VALUE").

    Cached by content (source with its headers expanded, arch, flags, defines, nvcc version) under
    cache_dir (default build/ptxas-cache/), so an unchanged file costs nothing the second time
    and editing a header recompiles every file that includes it.
    """
    nvcc = nvcc_path()
    if nvcc is None:
        raise ValueError("nvcc not found (PATH or $NVCC)")
    source = source_path(stem)
    version = nvcc_version()
    text = expanded_source(stem)
    dflags = [f"-D{d}" for d in defines]
    key = hashlib.sha256("\0".join([text, arch, *NVCC_FLAGS, *dflags, version]).encode()).hexdigest()[:24]
    cache_dir = cache_dir or (KERNELS.parent / "build" / "ptxas-cache")
    cached = cache_dir / f"{stem.replace('/', '+')}.{arch}.{key}.log"
    if cached.exists():
        return 0, cached.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [
                nvcc,
                *NVCC_FLAGS,
                *dflags,
                f"-I{KERNELS}",
                f"-arch={arch}",
                "-o",
                os.path.join(tmp, "k.cubin"),
                str(source),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmpfile = cached.with_suffix(f".{os.getpid()}.tmp")
        tmpfile.write_text(out)
        os.replace(tmpfile, cached)
    return proc.returncode, out


def resource_report(stems=None, archs=ARCHS) -> list[dict]:
    """One row per (file, arch, kernel): registers, stack frame, spills, static shared memory.

    Compiles in parallel threads (nvcc runs as subprocesses). Rows of a failed compile carry
    `error` with the compiler output.
    """
    import concurrent.futures as cf

    stems = sources() if stems is None else list(stems)
    jobs = [(s, a) for s in stems for a in archs]
    with cf.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = dict(zip(jobs, pool.map(lambda j: compile_report(*j), jobs), strict=True))
    rows = []
    for (stem, arch), (rc, text) in results.items():
        if rc != 0:
            rows.append({"file": f"{stem}.cu", "arch": arch, "kernel": None, "error": text})
            continue
        for name, info in parse_ptxas(text).items():
            rows.append({"file": f"{stem}.cu", "arch": arch, "kernel": name, **info})
    return rows
