"""KDTR: the workbook's container for named, typed tensors (golden vectors, small weights).

One flat binary file: a fixed 64-byte preamble, a header section (tensor table, then metadata),
zero padding, then the data section. Every integer is little-endian; every tensor is stored
little-endian in C order, starting at a multiple of 64 bytes, so a memory map of the file hands
out aligned, zero-copy views that can be passed to a GPU copy or a kernel as they are.

Layout, version 1
-----------------
Preamble (64 bytes)::

    offset size  field        meaning
    0      8     magic        b"\\x89KDTR\\r\\n\\x1a" (PNG-style: the high bit catches 7-bit transports,
                              CR LF catches newline translation, 0x1A stops `type` on DOS; see
                              the PNG specification, RFC 2083 section 12.11)
    8      4     version      u32, 1
    12     4     flags        u32, 0 (reserved: readers reject any other value)
    16     8     header_size  u64, bytes of the header section that starts at offset 64
    24     8     n_tensors    u64
    32     8     n_metadata   u64
    40     8     data_offset  u64, start of the data section: a multiple of 64, >= 64 + header_size
    48     8     file_size    u64, the length of the whole file in bytes
    56     4     header_crc   u32, CRC-32 of preamble bytes [0, 56) followed by the header section
    60     4     reserved     u32, 0

Header section, at offset 64: `n_tensors` tensor entries, then `n_metadata` metadata entries,
packed with no padding between them; their sizes add up to exactly `header_size`.

Tensor entry (24 + 8*ndim + name_len bytes)::

    u16 name_len   bytes of the UTF-8 name, 1..65535
    u8  dtype      dtype code, listed below
    u8  ndim       0..64 (numpy's limit); 0 is a scalar
    u32 crc32      CRC-32 of the tensor's data bytes
    u64 offset     absolute file offset of the data, a multiple of 64
    u64 nbytes     bytes of data: prod(shape) * itemsize
    u64 dims[ndim] the shape, C order
    u8  name[name_len]

Metadata entry (8 + key_len + value_len bytes): `u32 key_len, u32 value_len`, then the UTF-8 key
(non-empty) and value. Metadata holds strings only: generator, seed, commit, tolerances, ...

dtype codes: 1 float64, 2 float32, 3 float16, 4 bfloat16 (ml_dtypes), 5 int64, 6 int32, 7 int16,
8 int8, 9 uint64, 10 uint32, 11 uint16, 12 uint8, 13 bool (one byte, 0 or 1), 14 float8_e4m3fn,
15 float8_e5m2 (both ml_dtypes; OCP FP8 as in safetensors' F8_E4M3 / F8_E5M2). Code 0 is invalid.
Where ml_dtypes is not installed, bfloat16 and float8 tensors load as uint16 / uint8 arrays of the
same bits.

Rules a reader enforces (each failure is a `KdtrError` naming the problem): magic, version and
flags as above; the file is exactly `file_size` bytes; the header section lies inside the file
and its CRC matches; the entries fill the header section exactly; names and metadata keys are
valid UTF-8, non-empty and unique; each shape's byte size equals `nbytes` and fits numpy's index
type; every tensor lies in the data section, at an aligned offset; no two non-empty tensors
overlap. All sizes are checked against the file's length before anything is allocated, so a
header that claims terabytes is refused, not attempted. Empty tensors (`nbytes == 0`) may share
an offset with anything. Bytes between tensors are written as zeros and ignored by readers.

Checksums: CRC-32 (zlib.crc32, the polynomial of zip and PNG), one per tensor and one over the
header. It detects accidental damage (bit rot, truncated copies, bad transfers), not deliberate
tampering; it runs at several GB/s, where blake2b runs at about 1.
Verification trade: `load(mmap=True)` costs O(header): the header CRC is checked, tensor data is
not touched, so the per-tensor CRCs are not checked unless `verify=True` (which reads every byte).
`load(mmap=False)` reads every byte anyway and checks them by default. `verify(path)` checks a
file in full without keeping it.

Writing is deterministic (same tensors and metadata, in the same order -> the same bytes; no
timestamps) and atomic: `save` writes a temporary file `.<name>.<random>.kdtr-tmp` in the same
folder (<name> cut to its first 100 bytes), fsyncs it, renames it over the target with `os.replace`
and fsyncs the folder, so the target is either the old file or the complete new one. An exception
removes the temporary file; a killed process can leave one behind (recognisable by that suffix),
never a broken target. A target that is a symbolic link is written through; a new file gets the
permissions open() would give it (0o666 less the umask), a replaced one keeps its own.

    kdtr.save("golden.kdtr", {"q": q, "lse": lse}, metadata={"generator": "ref.tree_verify", "seed": "0"})
    t = kdtr.load("golden.kdtr")              # dict name -> read-only numpy view into a memory map
    t = kdtr.load("golden.kdtr", device="cuda")   # CuPy arrays
    kdtr.differences("new.kdtr", "golden.kdtr", close={"out": 1e-12})   # [] when they agree
    kdlib kdtr info golden.kdtr | kdlib kdtr convert golden.kdtr golden.safetensors
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kdlib.check import errors
from kdlib.cli import Parser, Terminated, fail, interrupted_code, sigterm_as_interrupt
from kdlib.files import atomic_write, check_folder

try:
    import ml_dtypes
except ImportError:  # a bare GPU machine may lack it: see ML_DTYPES
    ml_dtypes = None

MAGIC = b"\x89KDTR\r\n\x1a"
VERSION = 1
ALIGN = 64  # bytes: a cache line and an AVX-512 vector; a multiple of every dtype's size
PREAMBLE = struct.Struct("<8sIIQQQQQII")  # 64 bytes, fields as in the module docstring
ENTRY = struct.Struct("<HBBIQQ")  # 24 bytes: name_len, dtype, ndim, crc32, offset, nbytes
META = struct.Struct("<II")  # key_len, value_len
MAX_NDIM = 64  # numpy 2's NPY_MAXDIMS
MAX_NAME = 0xFFFF  # u16 name_len
INDEX_MAX = 2**63 - 1  # numpy's npy_intp: the largest byte size of an array it will describe
SUFFIXES = {".kdtr": "kdtr", ".safetensors": "safetensors", ".npz": "npz"}

NAMES: dict[int, str] = {
    1: "float64", 2: "float32", 3: "float16", 4: "bfloat16", 5: "int64", 6: "int32", 7: "int16",
    8: "int8", 9: "uint64", 10: "uint32", 11: "uint16", 12: "uint8", 13: "bool", 14: "float8_e4m3fn",
    15: "float8_e5m2",
}
CODES: dict[str, int] = {name: code for code, name in NAMES.items()}
BF16_CODE = CODES["bfloat16"]
# The codes numpy has no dtype for: ml_dtypes provides them. Without ml_dtypes they are handed out
# as unsigned integers holding the same bits (with a warning on load).
ML_DTYPES: dict[int, np.dtype | None] = {
    code: np.dtype(getattr(ml_dtypes, NAMES[code])) if ml_dtypes is not None else None
    for code in (BF16_CODE, CODES["float8_e4m3fn"], CODES["float8_e5m2"])
}
BFLOAT16 = ML_DTYPES[BF16_CODE]
FLOAT_CODES = frozenset(
    CODES[n] for n in ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
)
# The numpy dtype each code is stored and returned as: little-endian (native order on a
# little-endian host, so arrays print as plain float32 etc.).
_LE = "=" if sys.byteorder == "little" else "<"
_BITS = {BF16_CODE: "u2", CODES["float8_e4m3fn"]: "u1", CODES["float8_e5m2"]: "u1"}
DTYPES: dict[int, np.dtype] = {
    code: (ML_DTYPES[code] or np.dtype(_LE + _BITS[code])) if code in ML_DTYPES
    else np.dtype(name).newbyteorder(_LE)
    for code, name in NAMES.items()
}


def _code_of(dtype: np.dtype) -> int | None:
    """The KDTR code of a numpy dtype, or None when KDTR has no such dtype."""
    for code, dt in ML_DTYPES.items():
        if dt is not None and dtype == dt:
            return code
    if dtype.kind not in "biuf":
        return None
    code = CODES.get(dtype.name)
    return None if code in ML_DTYPES else code  # a same-named dtype that is not ml_dtypes' own


class KdtrError(ValueError):
    """A file that is not a valid KDTR file (or a converter input that cannot be read); says why."""


@dataclass(frozen=True)
class Entry:
    """One row of the tensor table, as stored."""

    name: str
    code: int
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class Header:
    """The parsed preamble and header section of a KDTR file."""

    version: int
    header_size: int
    data_offset: int
    file_size: int
    header_crc: int
    tensors: tuple[Entry, ...]
    metadata: dict[str, str]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------------------------------------
# Reading


def _parse(buf: bytes, actual_size: int, path) -> Header:
    """Validate and decode the preamble + header section in `buf` (the first bytes of the file)."""
    where = str(path)
    if actual_size < len(MAGIC) or buf[: len(MAGIC)] != MAGIC:
        head = buf[: len(MAGIC)]
        raise KdtrError(f"{where}: not a KDTR file (magic {head!r}, expected {MAGIC!r})")
    if actual_size < PREAMBLE.size:
        raise KdtrError(f"{where}: truncated: {actual_size} bytes, the preamble alone needs {PREAMBLE.size}")
    (_, version, flags, header_size, n_tensors, n_meta, data_offset, file_size, header_crc, reserved) = (
        PREAMBLE.unpack_from(buf)
    )
    if version != VERSION:
        raise KdtrError(f"{where}: unknown KDTR version {version} (this reader knows version {VERSION})")
    if flags or reserved:
        raise KdtrError(
            f"{where}: reserved preamble fields are not zero (flags {flags}, reserved {reserved})"
        )
    if file_size != actual_size:
        what = "truncated" if actual_size < file_size else "has trailing bytes"
        raise KdtrError(f"{where}: {what}: the header says {file_size} bytes, the file has {actual_size}")
    if header_size > file_size - PREAMBLE.size:
        raise KdtrError(
            f"{where}: header size {header_size} bytes runs past the end of the {file_size}-byte file"
        )
    if data_offset % ALIGN or data_offset < PREAMBLE.size + header_size or data_offset > file_size:
        raise KdtrError(
            f"{where}: data offset {data_offset} must be a multiple of {ALIGN} between the end of the "
            f"header ({PREAMBLE.size + header_size}) and the end of the file ({file_size})"
        )
    if len(buf) < PREAMBLE.size + header_size:
        raise KdtrError(f"{where}: truncated while reading the {header_size}-byte header")
    section = buf[PREAMBLE.size : PREAMBLE.size + header_size]
    crc = zlib.crc32(section, zlib.crc32(buf[:56]))
    if crc != header_crc:
        raise KdtrError(
            f"{where}: header checksum mismatch (stored {header_crc:#010x}, computed {crc:#010x})"
        )
    # Each entry takes at least its fixed part plus one name/key byte: bounds the counts by the size.
    if n_tensors * (ENTRY.size + 1) + n_meta * (META.size + 1) > header_size:
        raise KdtrError(
            f"{where}: {n_tensors} tensors and {n_meta} metadata entries cannot fit a {header_size}-byte "
            "header"
        )

    pos = 0
    entries: list[Entry] = []
    names: set[str] = set()
    for i in range(n_tensors):
        if pos + ENTRY.size > header_size:
            raise KdtrError(f"{where}: tensor entry {i} runs past the end of the header")
        name_len, code, ndim, crc32, offset, nbytes = ENTRY.unpack_from(section, pos)
        pos += ENTRY.size
        if code not in NAMES:
            raise KdtrError(f"{where}: tensor entry {i} has unknown dtype code {code}")
        if ndim > MAX_NDIM:
            raise KdtrError(f"{where}: tensor entry {i} has {ndim} dimensions (at most {MAX_NDIM})")
        if name_len == 0:
            raise KdtrError(f"{where}: tensor entry {i} has an empty name")
        if pos + 8 * ndim + name_len > header_size:
            raise KdtrError(f"{where}: tensor entry {i} runs past the end of the header")
        shape = struct.unpack_from(f"<{ndim}Q", section, pos)
        pos += 8 * ndim
        raw = section[pos : pos + name_len]
        pos += name_len
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise KdtrError(f"{where}: tensor entry {i} has a name that is not UTF-8 ({raw[:40]!r})") from e
        if name in names:
            raise KdtrError(f"{where}: duplicate tensor name {name!r}")
        names.add(name)
        dtype = DTYPES[code]
        # numpy must be able to describe the shape: the product of the non-zero dims, in bytes,
        # must fit npy_intp even when another dim is 0.
        described = dtype.itemsize
        for d in shape:
            described *= max(d, 1)
        if described > INDEX_MAX:
            raise KdtrError(f"{where}: tensor {name!r} has shape {shape}, too large for numpy")
        size = dtype.itemsize
        for d in shape:
            size *= d
        if size != nbytes:
            raise KdtrError(
                f"{where}: tensor {name!r}: shape {shape} of {NAMES[code]} is {size} bytes, "
                f"but the table says {nbytes}"
            )
        if offset % ALIGN:
            raise KdtrError(f"{where}: tensor {name!r} starts at offset {offset}, not a multiple of {ALIGN}")
        if offset < data_offset or offset + nbytes > file_size:
            raise KdtrError(
                f"{where}: tensor {name!r} spans bytes [{offset}, {offset + nbytes}), outside the data "
                f"section [{data_offset}, {file_size})"
            )
        entries.append(Entry(name, code, dtype, tuple(shape), offset, nbytes, crc32))

    metadata: dict[str, str] = {}
    for i in range(n_meta):
        if pos + META.size > header_size:
            raise KdtrError(f"{where}: metadata entry {i} runs past the end of the header")
        key_len, value_len = META.unpack_from(section, pos)
        pos += META.size
        if key_len == 0:
            raise KdtrError(f"{where}: metadata entry {i} has an empty key")
        if pos + key_len + value_len > header_size:
            raise KdtrError(f"{where}: metadata entry {i} runs past the end of the header")
        try:
            key = section[pos : pos + key_len].decode("utf-8")
            value = section[pos + key_len : pos + key_len + value_len].decode("utf-8")
        except UnicodeDecodeError as e:
            raise KdtrError(f"{where}: metadata entry {i} is not UTF-8") from e
        pos += key_len + value_len
        if key in metadata:
            raise KdtrError(f"{where}: duplicate metadata key {key!r}")
        metadata[key] = value
    if pos != header_size:
        raise KdtrError(f"{where}: {header_size - pos} unexplained bytes at the end of the header")

    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries if e.nbytes)
    for (_, end_a, a), (start_b, end_b, b) in zip(spans, spans[1:], strict=False):
        if start_b < end_a:
            raise KdtrError(f"{where}: tensors {a!r} and {b!r} overlap "
                            f"(bytes {start_b}..{min(end_a, end_b)})")
    return Header(version, header_size, data_offset, file_size, header_crc, tuple(entries), metadata)


def _read_header(f, path) -> Header:
    actual = os.fstat(f.fileno()).st_size
    pre = f.read(PREAMBLE.size)
    if len(pre) < PREAMBLE.size or pre[: len(MAGIC)] != MAGIC:
        return _parse(pre, actual, path)  # raises: truncated or wrong magic
    header_size = PREAMBLE.unpack_from(pre)[3]
    # Never read more than the file holds, whatever the header claims.
    need = min(header_size, max(actual - PREAMBLE.size, 0))
    return _parse(pre + f.read(need), actual, path)


def read_header(path) -> Header:
    """The parsed, validated header of a KDTR file; O(header), data untouched."""
    with open(path, "rb") as f:
        return _read_header(f, path)


def read_metadata(path) -> dict[str, str]:
    """The metadata key/values of a KDTR file (header only)."""
    return dict(read_header(path).metadata)


def _check_data(e: Entry, flat: np.ndarray, path) -> None:
    crc = zlib.crc32(flat)
    if crc != e.crc32:
        raise KdtrError(f"{path}: checksum mismatch in tensor {e.name!r} (stored {e.crc32:#010x}, computed "
                        f"{crc:#010x})")
    if e.dtype == np.bool_ and flat.size and flat.max() > 1:
        raise KdtrError(f"{path}: bool tensor {e.name!r} holds bytes other than 0 and 1")


def load(path, mmap: bool = True, verify: bool | None = None, device: str | None = None) -> dict:
    """Read a KDTR file: name -> array, in table order.

    mmap=True: read-only numpy views into one memory map of the file; costs O(header).
    mmap=False: one writable numpy array per tensor, read with readinto (no extra copy).
    verify: check each tensor's CRC-32 (and that bools are 0/1). None means "when the bytes are
    read anyway", i.e. True for mmap=False and False for mmap=True, keeping the map O(header).
    device: None for numpy; "cuda" or "cuda:N" returns CuPy arrays on that device (one
    host-to-device copy per tensor). CuPy has no bfloat16 dtype (cupy/cupy issue #7527): where
    it refuses one, a bfloat16 (float8) tensor arrives as uint16 (uint8) holding the same bits (as it does on
    the host when ml_dtypes is not installed).
    Raises KdtrError for any malformed file, before returning anything.
    """
    if device is not None and device != "cuda" and not re.fullmatch(r"cuda:\d+", str(device)):
        raise ValueError(f"device must be None, 'cuda' or 'cuda:N', got {device!r}")
    if verify is None:
        verify = not mmap
    out: dict[str, np.ndarray] = {}
    with open(path, "rb") as f:
        h = _read_header(f, path)
        if ml_dtypes is None and any(e.code in ML_DTYPES for e in h.tensors):
            warnings.warn("ml_dtypes is not installed: bfloat16 / float8 tensors are returned as their "
                          "unsigned-integer bits", stacklevel=2)
        if mmap:
            mm = np.memmap(f, dtype=np.uint8, mode="r")  # a parsed header: the file is >= 64 bytes
            for e in h.tensors:
                flat = mm[e.offset : e.offset + e.nbytes].view(np.ndarray)
                if verify:
                    _check_data(e, flat, path)
                out[e.name] = flat.view(e.dtype).reshape(e.shape)
        else:
            for e in h.tensors:
                flat = np.empty(e.nbytes, np.uint8)
                f.seek(e.offset)
                got = f.readinto(flat)
                if got != e.nbytes:
                    raise KdtrError(f"{path}: truncated while reading tensor {e.name!r} ({got} of {e.nbytes} "
                                    "bytes)")
                if verify:
                    _check_data(e, flat, path)
                out[e.name] = flat.view(e.dtype).reshape(e.shape)
    if device is not None:
        out = {k: _to_device(v, device) for k, v in out.items()}
    return out


def verify(path) -> Header:
    """Check a whole file (header and every tensor's CRC); returns its header, raises KdtrError."""
    with open(path, "rb") as f:
        h = _read_header(f, path)
        for e in h.tensors:
            flat = np.empty(e.nbytes, np.uint8)
            f.seek(e.offset)
            if f.readinto(flat) != e.nbytes:
                raise KdtrError(f"{path}: truncated while reading tensor {e.name!r}")
            _check_data(e, flat, path)
    return h


def _to_device(a: np.ndarray, device: str):
    import cupy

    index = int(device.split(":")[1]) if ":" in device else 0
    with cupy.cuda.Device(index):
        try:
            return cupy.asarray(a)
        except (TypeError, ValueError):
            if _code_of(a.dtype) not in ML_DTYPES:
                raise
            return cupy.asarray(a.view(f"u{a.dtype.itemsize}"))


# ---------------------------------------------------------------------------------------------
# Writing


def _kind(x) -> str:
    mod = type(x).__module__
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    return "numpy"


def _describe(name, x) -> tuple[int, tuple[int, ...], object]:
    """(code, shape, source) without moving device data; source is what `_host` converts later."""
    kind = _kind(x)
    if kind == "torch":
        code = CODES.get(str(x.dtype).removeprefix("torch."))
        shape = tuple(int(d) for d in x.shape)
        what = x.dtype
    elif kind == "cupy":
        what = np.dtype(x.dtype)
        code, shape = _code_of(what), tuple(int(d) for d in x.shape)
    else:
        x = np.asarray(x)
        what, code, shape = x.dtype, _code_of(x.dtype), x.shape
    if code is None:
        raise ValueError(f"tensor {name!r}: dtype {what} is not supported by KDTR ({sorted(CODES)})")
    return code, shape, x


def _host(x) -> np.ndarray:
    """A C-contiguous little-endian host numpy array holding x's values (bfloat16: see DTYPES; bool as
    bytes 0 and 1)."""
    kind = _kind(x)
    if kind == "torch":
        import torch

        t = x.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
        code = CODES.get(str(t.dtype).removeprefix("torch."))
        if code in ML_DTYPES:  # torch hands these to numpy only as their bits
            return t.view(torch.int16 if t.element_size() == 2 else torch.uint8).numpy().view(DTYPES[code])
        a = t.numpy()
    elif kind == "cupy":
        a = x.get()
    else:
        a = np.asarray(x)
    big = a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big")
    if big and a.dtype.itemsize > 1:
        a = a.astype(a.dtype.newbyteorder("<"))
    if a.dtype == np.bool_:  # a bool made by a view may hold any nonzero byte for True: written as 1
        a = a.view(np.uint8) != 0
    return a if a.flags.c_contiguous else a.copy(order="C")  # ascontiguousarray would make 0-d 1-d


def _encode_header(specs, metadata_items, data_offset: int, file_size: int) -> bytes:
    parts = []
    for name_b, code, shape, offset, nbytes, crc in specs:
        parts.append(ENTRY.pack(len(name_b), code, len(shape), crc, offset, nbytes))
        parts.append(struct.pack(f"<{len(shape)}Q", *shape))
        parts.append(name_b)
    for k, v in metadata_items:
        parts += [META.pack(len(k), len(v)), k, v]
    section = b"".join(parts)
    fields = (MAGIC, VERSION, 0, len(section), len(specs), len(metadata_items), data_offset, file_size)
    first = PREAMBLE.pack(*fields, 0, 0)[:56]
    crc = zlib.crc32(section, zlib.crc32(first))
    return PREAMBLE.pack(*fields, crc, 0) + section


def _write_array(f, a: np.ndarray) -> int:
    """Write the bytes of a C-contiguous array; returns their CRC-32."""
    if a.nbytes == 0:
        return zlib.crc32(b"")
    flat = a.reshape(-1).view(np.uint8)
    f.write(memoryview(flat))
    return zlib.crc32(flat)


def save(path, tensors: Mapping, metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (name -> numpy / torch (CPU or CUDA) / CuPy array) and string metadata.

    Atomic and deterministic (see the module docstring). Every argument is checked before the
    file is touched: ValueError for a non-string or empty name, an unsupported dtype, or
    metadata that is not str -> str. Device tensors are copied to the host one at a time.
    """
    if not isinstance(tensors, Mapping):
        raise ValueError(f"tensors must be a mapping name -> array, got {type(tensors).__name__}")
    specs, sources = [], []
    cursor = 0  # relative to data_offset; fixed up below
    for name, x in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        name_b = name.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError, a ValueError
        if len(name_b) > MAX_NAME:
            raise ValueError(f"tensor name {name[:40]!r}... is {len(name_b)} bytes (at most {MAX_NAME})")
        code, shape, source = _describe(name, x)
        if len(shape) > MAX_NDIM:
            raise ValueError(f"tensor {name!r} has {len(shape)} dimensions (at most {MAX_NDIM})")
        nbytes = DTYPES[code].itemsize * math.prod(shape)
        # An empty tensor points at the start of the data section, which every file has.
        specs.append([name_b, code, shape, cursor if nbytes else 0, nbytes, 0])
        sources.append(source)
        cursor = _align(cursor + nbytes)
    if metadata is not None and not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a mapping str -> str, got {type(metadata).__name__}")
    metadata_items = []
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not k or not isinstance(v, str):
            raise ValueError(f"metadata must map non-empty str keys to str values, got {k!r}: "
                             f"{type(v).__name__}")
        metadata_items.append((k.encode("utf-8"), v.encode("utf-8")))

    header_len = len(_encode_header(specs, metadata_items, 0, 0))
    data_offset = _align(header_len)
    for s in specs:
        s[3] += data_offset
    file_size = max([data_offset] + [s[3] + s[4] for s in specs])

    def write(f):
        f.write(b"\0" * data_offset)  # header placeholder: rewritten once the CRCs are known
        for s, source in zip(specs, sources, strict=True):
            if s[4]:
                f.write(b"\0" * (s[3] - f.tell()))
            a = _host(source)
            if a.dtype != DTYPES[s[1]] or a.shape != s[2]:
                raise ValueError(f"tensor {s[0].decode()!r} changed while being saved")
            s[5] = _write_array(f, a)
        f.seek(0)
        f.write(_encode_header(specs, metadata_items, data_offset, file_size))

    atomic_write(path, write, suffix=".kdtr-tmp")


# ---------------------------------------------------------------------------------------------
# Inspection


def reseal(image: bytes) -> bytes:
    """`image` (a whole file's bytes) with the header CRC recomputed from its current fields.

    For tests and demonstrations that craft bad files: a resealed image reaches the field
    checks behind the CRC. Uses the header_size stored in the image, clamped to its length.
    """
    image = bytearray(image)
    if len(image) < PREAMBLE.size:
        return bytes(image)
    header_size = min(PREAMBLE.unpack_from(image)[3], len(image) - PREAMBLE.size)
    crc = zlib.crc32(image[PREAMBLE.size : PREAMBLE.size + header_size], zlib.crc32(image[:56]))
    struct.pack_into("<I", image, 56, crc)
    return bytes(image)


def header_fields(path) -> list[tuple[int, int, str, object]]:
    """(offset, size, field, value) for every field of the preamble and header section, in order.

    For annotated hex dumps (notebook 00) and debugging; the file is validated first.
    """
    h = read_header(path)
    with open(path, "rb") as f:
        raw = f.read(PREAMBLE.size + h.header_size)
    rows = []
    names = ["magic", "version", "flags", "header_size", "n_tensors", "n_metadata", "data_offset",
             "file_size", "header_crc", "reserved"]
    sizes = [8, 4, 4, 8, 8, 8, 8, 8, 4, 4]
    pos = 0
    for name, size, value in zip(names, sizes, PREAMBLE.unpack_from(raw), strict=True):
        rows.append((pos, size, name, value))
        pos += size
    for e in h.tensors:
        tag = f"tensor[{e.name}]"
        for field, size, value in [("name_len", 2, len(e.name.encode())), ("dtype", 1, e.code),
                                   ("ndim", 1, len(e.shape)), ("crc32", 4, e.crc32),
                                   ("offset", 8, e.offset), ("nbytes", 8, e.nbytes)]:
            rows.append((pos, size, f"{tag}.{field}", value))
            pos += size
        for i, d in enumerate(e.shape):
            rows.append((pos, 8, f"{tag}.dims[{i}]", d))
            pos += 8
        n = len(e.name.encode())
        rows.append((pos, n, f"{tag}.name", e.name))
        pos += n
    for k, v in h.metadata.items():
        kb, vb = len(k.encode()), len(v.encode())
        rows += [(pos, 4, f"meta[{k}].key_len", kb), (pos + 4, 4, f"meta[{k}].value_len", vb),
                 (pos + 8, kb, f"meta[{k}].key", k), (pos + 8 + kb, vb, f"meta[{k}].value", v)]
        pos += 8 + kb + vb
    return rows


def hexdump(path, max_rows: int = 64) -> str:
    """An annotated hex dump of the preamble and header: one line per field (long fields cut)."""
    rows = header_fields(path)
    with open(path, "rb") as f:
        raw = f.read(rows[-1][0] + rows[-1][1])
    lines = []
    for off, size, field, value in rows[:max_rows]:
        shown = raw[off : off + min(size, 16)].hex(" ")
        more = " .." if size > 16 else ""
        v = f"{value:#010x}" if field.endswith(("crc", "crc32")) else repr(value)
        if field.endswith(".dtype"):
            v += f" ({NAMES[value]})"
        lines.append(f"{off:08x}  {shown + more:<51}  {field} = {v}")
    if len(rows) > max_rows:
        lines.append(f"... {len(rows) - max_rows} more fields")
    return "\n".join(lines)


def table(path) -> str:
    """The tensor table and metadata as text (what `kdlib kdtr info` prints)."""
    fmt = _format_of(path)
    if fmt == "kdtr":
        h = read_header(path)
        rows = [
            (e.name, NAMES[e.code], e.shape, e.nbytes, str(e.offset), f"{e.crc32:08x}") for e in h.tensors
        ]
        meta = h.metadata
        title = (
            f"{path}: KDTR v{h.version}, {len(rows)} tensors, {h.file_size} bytes, data at {h.data_offset}"
        )
    else:
        index, meta = _index_any(path)
        rows = [(name, dt, shape, nbytes, "-", "-") for name, dt, shape, nbytes in index]
        title = f"{path}: {fmt}, {len(rows)} tensors"
    rows = [(_printable(r[0]), *r[1:]) for r in rows]
    width = max([4] + [len(r[0]) for r in rows])
    dwidth = max([5] + [len(r[1]) for r in rows])

    def row(name, dt, shape, nbytes, off, crc) -> str:
        return f"{name:<{width}}  {dt:<{dwidth}}  {shape:<20}  {nbytes:>12}  {off:>10}  {crc}"

    lines = [title, row("name", "dtype", "shape", "bytes", "offset", "crc32")]
    lines += [row(name, dt, str(list(shape)), nbytes, off, crc) for name, dt, shape, nbytes, off, crc in rows]
    lines.append("metadata:" if meta else "metadata: (none)")
    lines += [f"  {_printable(k)} = {_printable(v)}" for k, v in meta.items()]
    return "\n".join(lines)


def _printable(text: str) -> str:
    """`text` with its unprintable characters (a newline in a tensor name) escaped, one table row a line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _locate(offset: int, rows, entries) -> str:
    """The header field or tensor whose bytes hold file offset `offset`."""
    for off, size, field, _ in rows:
        if off <= offset < off + size:
            return field
    for e in entries:
        if e.offset <= offset < e.offset + e.nbytes:
            return f"tensor[{e.name}] data"
    return "padding"


def differences(actual, expected, close: Mapping[str, float] | None = None) -> list[str]:
    """What differs between two KDTR files, one line per problem; an empty list when they agree.

    Every byte must be equal except, for each float tensor named in `close` (name -> rtol), its
    data and its CRC-32 field, and the header CRC. Those tensors must hold NaN and infinities at
    the same places, with the same values, and finite values within rtol norm-relative
    (kdlib.check.errors). Both files are verified in full first. For golden files whose computed
    floats come from BLAS or SIMD math, whose rounding differs from one CPU to the next.
    """
    close = dict(close or {})
    ha, hb = verify(actual), verify(expected)
    entries = {e.name: e for e in hb.tensors}
    problems = [f"{path}: no tensors named {missing} (asked to compare them at a tolerance)"
                for path, names in ((expected, entries), (actual, {e.name for e in ha.tensors}))
                if (missing := sorted(set(close) - set(names)))]
    if problems:
        return problems
    ra, rb = Path(actual).read_bytes(), Path(expected).read_bytes()
    if len(ra) != len(rb):
        return [f"sizes differ: {len(ra)} vs {len(rb)} bytes"]
    rows = header_fields(expected)
    crc_at = {field: off for off, _, field, _ in rows if field.endswith(".crc32")}
    masked = [(56, 60)]  # header_crc
    for name in close:
        e, at = entries[name], crc_at[f"tensor[{name}].crc32"]
        masked += [(at, at + 4), (e.offset, e.offset + e.nbytes)]
    a, b = np.frombuffer(ra, np.uint8).copy(), np.frombuffer(rb, np.uint8).copy()
    for lo, hi in masked:
        a[lo:hi] = b[lo:hi] = 0
    problems = []
    bad = np.flatnonzero(a != b)
    if bad.size:
        where = sorted({_locate(int(i), rows, hb.tensors) for i in bad[:10_000]})
        problems.append(f"{bad.size} bytes differ outside the tolerance-compared tensors, in "
                        f"{', '.join(where[:8])}")
        if len(ha.tensors) != len(hb.tensors) or ha.data_offset != hb.data_offset:
            return problems  # different layouts: the tensors below cannot be paired
    ta, tb = load(actual), load(expected)
    for name, rtol in close.items():
        x, y = ta[name], tb[name]
        if x.dtype != y.dtype or x.shape != y.shape or _code_of(y.dtype) not in FLOAT_CODES:
            problems.append(f"{name}: {x.dtype} {x.shape} vs {y.dtype} {y.shape} (need equal float tensors)")
            continue
        x, y = x.astype(np.float64), y.astype(np.float64)
        fin = np.isfinite(y)
        if not np.array_equal(np.isfinite(x), fin) or not np.array_equal(x[~fin], y[~fin], equal_nan=True):
            problems.append(f"{name}: NaN / infinity pattern differs")
            continue
        rel = errors(x[fin], y[fin])["norm_rel"]
        if not rel <= rtol:
            problems.append(f"{name}: norm-relative difference {rel:.3e} > rtol {rtol:g}")
    return problems


# ---------------------------------------------------------------------------------------------
# Converters: KDTR <-> safetensors <-> npz, picked by file suffix

NPZ_SIDECAR = "__kdtr__"  # npz member holding JSON {dtypes, metadata}: npz cannot name bfloat16 or float8
ST_METADATA = "__metadata__"  # the safetensors header key of the metadata
# safetensors dtype -> KDTR dtype name (the safetensors format's own spelling, from its documentation)
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
             "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
ST_CODES = {CODES[name]: st for st, name in ST_DTYPES.items()}
NPZ_DATE = (1980, 1, 1, 0, 0, 0)  # zip member timestamps: the format's earliest, so output is run-independent


def _format_of(path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{path}: unknown file type {suffix!r}; expected one of {sorted(SUFFIXES)}")
    return SUFFIXES[suffix]


def _read_any(path) -> tuple[dict, dict]:
    fmt = _format_of(path)
    if fmt == "kdtr":
        for e in read_header(path).tensors:
            _ml_dtype(path, e.name, e.code)
        return load(path, mmap=False), read_metadata(path)
    if fmt == "safetensors":
        return _read_safetensors(path)
    with _open_npz(path) as z:
        try:
            arrays = {}
            for name, member in _npz_members(z, path):
                with z.open(member) as f:
                    arrays[name] = np.lib.format.read_array(f, allow_pickle=False)
        except Exception as e:  # zipfile.BadZipFile, ValueError, OSError from a damaged archive
            raise KdtrError(f"{path}: cannot read npz: {e}") from e
    dtypes, metadata = _npz_sidecar(path, arrays.pop(NPZ_SIDECAR, None), arrays)
    for k, code in dtypes.items():  # the types npz cannot name, each stored as unsigned bits of its width
        bits = np.dtype(f"<u{DTYPES[code].itemsize}")
        if arrays[k].dtype != bits:
            raise KdtrError(f"{path}: tensor {k!r} is stored as {arrays[k].dtype}, not as the {bits} bits of "
                            f"{NAMES[code]}")
        arrays[k] = arrays[k].view(_ml_dtype(path, k, code))
    return arrays, metadata


def _open_npz(path) -> zipfile.ZipFile:
    if Path(path).is_file() and not zipfile.is_zipfile(path):  # np.load would speak of pickles
        raise KdtrError(f"{path}: not an npz file (an npz is a zip archive of .npy members)")
    try:
        return zipfile.ZipFile(path)
    except FileNotFoundError:
        raise
    except Exception as e:
        raise KdtrError(f"{path}: cannot read npz: {e}") from e


def _npz_members(z: zipfile.ZipFile, path) -> list[tuple[str, str]]:
    """(tensor name, member name) of each member: member `<name>.npy` holds tensor `name`, the raw names
    kept (np.load's lookup would give tensor `x` for a name `x.npy` when both exist)."""
    out, seen = [], set()
    for member in z.namelist():
        if not member.endswith(".npy"):
            raise KdtrError(f"{path}: member {member!r} is not a .npy array")
        name = member.removesuffix(".npy")
        if name in seen:
            raise KdtrError(f"{path}: two members named {member!r}")
        seen.add(name)
        out.append((name, member))
    return out


def _npz_sidecar(path, side, names) -> tuple[dict[str, int], dict[str, str]]:
    """The dtype codes (tensor name -> code, the types npz cannot name) and metadata of the sidecar
    member `side` (None: none), checked against the archive's tensor names."""
    if side is None:
        return {}, {}
    try:
        info = json.loads(str(side))
        dtypes, metadata = dict(info.get("dtypes", {})), dict(info.get("metadata", {}))
    except (ValueError, TypeError, AttributeError) as e:
        raise KdtrError(f"{path}: malformed {NPZ_SIDECAR} member: {e}") from e
    for k, v in metadata.items():
        if not isinstance(v, str):
            raise KdtrError(f"{path}: {NPZ_SIDECAR} metadata {k!r} is {type(v).__name__}, not a string")
    codes = {}
    for k, dt in dtypes.items():
        code = CODES.get(dt) if isinstance(dt, str) else None
        if code not in ML_DTYPES:
            raise KdtrError(f"{path}: {NPZ_SIDECAR} gives {k!r} the dtype {dt!r}; it names only "
                            f"{sorted(NAMES[c] for c in ML_DTYPES)}")
        if k not in names:
            raise KdtrError(f"{path}: {NPZ_SIDECAR} names a tensor {k!r} the archive lacks")
        codes[k] = code
    return codes, metadata


def _index_any(path) -> tuple[list[tuple[str, str, tuple, int]], dict]:
    """(name, dtype, shape, bytes) of each tensor of a .safetensors or .npz file and its metadata, from
    the headers alone: no tensor data is read (`kdlib kdtr info` on a checkpoint shard)."""
    if _format_of(path) == "safetensors":
        return _index_safetensors(path)
    rows, side = [], None
    with _open_npz(path) as z:
        try:
            for name, member in _npz_members(z, path):
                with z.open(member) as f:
                    if name == NPZ_SIDECAR:
                        side = np.lib.format.read_array(f, allow_pickle=False)
                        continue
                    version = np.lib.format.read_magic(f)
                    read = {(1, 0): np.lib.format.read_array_header_1_0,
                            (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                    if read is None:  # format 3.0 (UTF-8 field names): only read_array parses it
                        f.seek(0)
                        a = np.lib.format.read_array(f, allow_pickle=False)
                        shape, dtype = a.shape, a.dtype
                    else:
                        shape, _, dtype = read(f)
                        if any(d < 0 for d in shape):
                            raise KdtrError(f"{path}: array {name!r} has shape {list(shape)}, not sizes >= 0")
                        need, held = math.prod(shape) * dtype.itemsize, z.getinfo(member).file_size - f.tell()
                        if need != held and not dtype.hasobject:  # as read_array (and so convert) refuses it
                            raise KdtrError(f"{path}: array {name!r} ({dtype} {list(shape)}) needs {need} "
                                            f"bytes, its member holds {held}")
                    rows.append((name, dtype, shape))
        except KdtrError:
            raise
        except Exception as e:
            raise KdtrError(f"{path}: cannot read npz: {e}") from e
    codes, metadata = _npz_sidecar(path, side, {r[0] for r in rows})
    out = []
    for name, dtype, shape in rows:
        size = math.prod(shape) * dtype.itemsize  # Python ints: a forged header's shape cannot overflow
        out.append((name, NAMES[codes[name]] if name in codes else dtype.name, shape, size))
    return out, metadata


def _ml_dtype(path, name: str, code: int) -> np.dtype:
    """The numpy dtype of code `code` for tensor `name` of a file being converted; bits alone would
    lose the type."""
    if code in ML_DTYPES and ML_DTYPES[code] is None:
        raise KdtrError(f"{path}: tensor {name!r} is {NAMES[code]}, which needs the ml_dtypes package to "
                        "convert")
    return DTYPES[code]


def _read_safetensors(path) -> tuple[dict, dict]:
    """Tensors (by name) and metadata (by key) of a safetensors file, parsed and checked by the library.

    The library's own numpy loader cannot make float8 arrays (numpy has no such dtype), so the raw
    bytes it hands out are viewed here through ST_DTYPES.
    """
    try:
        from safetensors import deserialize, safe_open
    except ImportError:
        raise ValueError(f"{path}: reading .safetensors needs the safetensors package "
                         "(pip install safetensors)") from None

    raw = Path(path).read_bytes()
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        views = deserialize(raw)
    except Exception as e:  # the library raises its own SafetensorError and others
        raise KdtrError(f"{path}: cannot read safetensors: {e}") from e
    tensors = {}
    for name, v in sorted(views):  # the library hands them out in no fixed order
        if v["dtype"] not in ST_DTYPES:
            raise KdtrError(f"{path}: tensor {name!r} has safetensors dtype {v['dtype']}, which KDTR cannot "
                            "hold "
                            f"(it holds {', '.join(ST_DTYPES)})")
        a = np.frombuffer(v["data"], _ml_dtype(path, name, CODES[ST_DTYPES[v["dtype"]]])).reshape(v["shape"])
        if a.dtype == np.bool_ and a.size and a.view(np.uint8).max() > 1:
            raise KdtrError(f"{path}: bool tensor {name!r} holds bytes other than 0 and 1")
        tensors[name] = a
    return tensors, dict(sorted(meta.items()))


ST_HEADER_MAX = 100_000_000  # bytes of a safetensors JSON header past which it is refused (as the library)


def _index_safetensors(path) -> tuple[list[tuple[str, str, tuple, int]], dict]:
    """`_index_any` of a .safetensors file: its u64 header size and JSON header, nothing else."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n > min(size - 8, ST_HEADER_MAX):
            raise KdtrError(f"{path}: cannot read safetensors: "
                            + ("shorter than its 8-byte header size" if n is None else
                               f"header size {n} past the file's {size} bytes or the {ST_HEADER_MAX:,} "
                               "allowed"))
        text = f.read(n)
    try:
        header = json.loads(text)
        metadata = dict(header.pop(ST_METADATA, None) or {})
        bad = [k for k, v in metadata.items() if not isinstance(v, str)]
        if bad:  # as the library refuses them
            raise KdtrError(f"{path}: safetensors metadata {bad[0]!r} is not a string")
        rows = []
        for name, e in sorted(header.items()):
            begin, end = e["data_offsets"]
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in e["shape"]):
                raise KdtrError(f"{path}: tensor {name!r} has shape {e['shape']}, not sizes >= 0")
            shape = tuple(e["shape"])
            rows.append((name, ST_DTYPES.get(e["dtype"], str(e["dtype"])), shape, int(end) - int(begin)))
            if not 0 <= int(begin) <= int(end) <= size - 8 - n:
                raise KdtrError(f"{path}: tensor {name!r} has data offsets {begin}..{end}, past the file's "
                                f"{size - 8 - n} data bytes")
            if e["dtype"] in ST_DTYPES:  # an unknown dtype is listed by name; convert refuses it
                need = math.prod(shape) * DTYPES[CODES[ST_DTYPES[e["dtype"]]]].itemsize
                if int(end) - int(begin) != need:
                    raise KdtrError(f"{path}: tensor {name!r} ({e['dtype']} {list(shape)}) needs {need} "
                                    f"bytes, its data offsets span {int(end) - int(begin)}")
    except KdtrError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise KdtrError(f"{path}: cannot read safetensors header: {e!r}") from e
    return rows, dict(sorted(metadata.items()))


def _write_safetensors(f, arrays: dict, metadata: dict) -> None:
    """The safetensors format (u64 header size, JSON header padded with spaces to 8 bytes, data),
    written here because the library orders the metadata differently in every process. Tensors in
    decreasing item size, then by name, as the library lays them out (each one aligned)."""
    if ST_METADATA in arrays:
        raise ValueError(f"tensor name {ST_METADATA!r} is reserved in .safetensors files")
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))
    header: dict = {ST_METADATA: metadata} if metadata else {}
    pos = 0
    for k in order:
        a = arrays[k]
        header[k] = {
            "dtype": ST_CODES[_code_of(a.dtype)],
            "shape": list(a.shape),
            "data_offsets": [pos, pos + a.nbytes],
        }
        pos += a.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    f.write(struct.pack("<Q", len(text)) + text)
    for k in order:
        _write_array(f, arrays[k])


def _write_npz(f, arrays: dict) -> None:
    """An uncompressed .npz, one `<name>.npy` member per array, as np.load reads it. Written member by
    member (np.savez's keyword arguments would take tensors named `file` or `allow_pickle`), with
    fixed timestamps."""
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:
        for k, a in arrays.items():
            info = zipfile.ZipInfo(f"{k}.npy", date_time=NPZ_DATE)
            with z.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, a, allow_pickle=False)


def _write_any(path, tensors: dict, metadata: dict) -> None:
    """Write `tensors` and `metadata` (sorted by key, so the bytes never depend on the order read)."""
    fmt = _format_of(path)
    metadata = dict(sorted(metadata.items()))
    if fmt == "kdtr":
        save(path, tensors, metadata)
        return
    arrays = {}
    for k, v in tensors.items():
        arrays[k] = _host(_describe(k, v)[2])
    if fmt == "safetensors":
        atomic_write(path, lambda f: _write_safetensors(f, arrays, metadata), suffix=".kdtr-tmp")
        return
    if NPZ_SIDECAR in arrays:
        raise ValueError(f"tensor name {NPZ_SIDECAR!r} is reserved in .npz files")
    for k in arrays:
        if "\0" in k:  # zip cuts a member name at its first NUL
            raise ValueError(f"tensor name {k!r} holds a NUL character, which an .npz member name cannot")
    ml = {k: _code_of(a.dtype) for k, a in arrays.items() if _code_of(a.dtype) in ML_DTYPES}
    side = {"dtypes": {k: NAMES[ml[k]] for k in sorted(ml)}, "metadata": metadata}
    arrays = {k: (a.view(f"u{a.dtype.itemsize}") if k in ml else a) for k, a in arrays.items()}
    arrays[NPZ_SIDECAR] = np.array(json.dumps(side, sort_keys=True))
    atomic_write(path, lambda f: _write_npz(f, arrays), suffix=".kdtr-tmp")


def convert(src, dst) -> None:
    """Copy tensors and metadata between .kdtr, .safetensors and .npz files (types by suffix).

    Deterministic: the same source gives the same bytes in every run (metadata sorted by key)."""
    _format_of(dst)
    check_folder(dst)
    tensors, metadata = _read_any(src)
    try:
        _write_any(dst, tensors, metadata)
    except KdtrError:
        raise
    except ValueError as e:  # what the source holds and the target's format cannot: name the source
        raise ValueError(f"{src}: {e}") from e


def to_safetensors(src, dst) -> None:
    """KDTR -> safetensors (metadata goes to `__metadata__`)."""
    if _format_of(src) != "kdtr" or _format_of(dst) != "safetensors":
        raise ValueError(f"to_safetensors wants a .kdtr source and a .safetensors target, got {src}, {dst}")
    convert(src, dst)


def from_safetensors(src, dst) -> None:
    """safetensors -> KDTR."""
    if _format_of(src) != "safetensors" or _format_of(dst) != "kdtr":
        raise ValueError(f"from_safetensors wants a .safetensors source and a .kdtr target, got {src}, {dst}")
    convert(src, dst)


def to_npz(src, dst) -> None:
    """KDTR -> .npz (bfloat16 / float8 stored as uint16 / uint8 bits, dtypes and metadata in the
    `__kdtr__` member)."""
    if _format_of(src) != "kdtr" or _format_of(dst) != "npz":
        raise ValueError(f"to_npz wants a .kdtr source and a .npz target, got {src}, {dst}")
    convert(src, dst)


def from_npz(src, dst) -> None:
    """.npz -> KDTR."""
    if _format_of(src) != "npz" or _format_of(dst) != "kdtr":
        raise ValueError(f"from_npz wants a .npz source and a .kdtr target, got {src}, {dst}")
    convert(src, dst)


# ---------------------------------------------------------------------------------------------
# Command line: `kdlib kdtr info FILE`, `kdlib kdtr convert A B`, `kdlib kdtr verify FILE`


def cli(argv: list[str]) -> int:
    """Exit codes: 0 success, 2 bad input (usage, missing or malformed file, unsupported type), 130 / 143
    interrupted (Ctrl-C / SIGTERM: a target being written is left whole or untouched, with no temp file)."""
    ap = Parser(prog="kdlib kdtr", description="Inspect, check and convert KDTR tensor files.")
    sub = ap.add_subparsers(dest="cmd", metavar="{info,convert,verify}", required=True)
    p = sub.add_parser("info", help="print the tensor table and metadata (.kdtr, .safetensors, .npz)")
    p.add_argument("file")
    p = sub.add_parser("convert", help="convert between .kdtr, .safetensors and .npz (by suffix)")
    p.add_argument("src")
    p.add_argument("dst")
    p = sub.add_parser("verify", help="check every checksum of a KDTR file")
    p.add_argument("file")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        with sigterm_as_interrupt():  # SIGTERM as Ctrl-C: the writer's temp file removed, not left behind
            if args.cmd == "info":
                print(table(args.file))
            elif args.cmd == "convert":
                convert(args.src, args.dst)
                print(f"{args.src} -> {args.dst}")
            else:
                h = verify(args.file)
                print(f"{args.file}: OK ({len(h.tensors)} tensors, {h.file_size} bytes, all checksums match)")
    except BrokenPipeError:
        raise  # the reader went away: `kdlib` ends quietly (kdlib.cli)
    except (OSError, ValueError) as e:
        return fail(f"kdlib kdtr {args.cmd}", e)
    except KeyboardInterrupt as e:
        how = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(f"kdlib kdtr {args.cmd}: {how}", file=sys.stderr)
        return interrupted_code(e)
    return 0
