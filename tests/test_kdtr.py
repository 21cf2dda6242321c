"""KDTR container: round trips, every malformed-file class, atomicity, mmap cost, converters, CLI."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kdlib
from kdlib import cli as kdcli
from kdlib import kdtr
from kdlib.files import atomic_write
from kdlib.kdtr import KdtrError
from kdlib.perf import results
from kdlib.perf.suites import kdtr_io

VENV_BIN = Path(sys.executable).parent


def sample(dtype, shape, seed=0) -> np.ndarray:
    """Random values of `dtype` that exercise sign, range and (for floats) NaN/inf."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    a = (rng.standard_normal(shape) * 100).astype(dtype)
    if a.size >= 3:
        a.reshape(-1)[:3] = [np.nan, np.inf, -0.0]
    return a


def every_dtype() -> dict[str, np.ndarray]:
    """Each supported dtype as a matrix, a 0-d scalar and an empty tensor."""
    out = {}
    for i, dt in enumerate(kdtr.DTYPES.values()):
        out[f"{dt.name}/matrix"] = sample(dt, (3, 5), seed=i)  # [3, 5]
        out[f"{dt.name}/scalar"] = sample(dt, (), seed=i)  # []
        out[f"{dt.name}/empty"] = sample(dt, (0, 4), seed=i)  # [0, 4]
    return out


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        g, w = got[k], np.asarray(want[k])
        assert g.dtype == w.dtype, k
        assert g.shape == w.shape, k
        assert g.tobytes() == w.tobytes(), k


def image(path) -> bytearray:
    return bytearray(Path(path).read_bytes())


def entry_pos(buf: bytes, index: int) -> int:
    """Offset in the file of tensor entry `index` (walks the table)."""
    pos = kdtr.PREAMBLE.size
    for _ in range(index):
        name_len, _, ndim, *_ = kdtr.ENTRY.unpack_from(buf, pos)
        pos += kdtr.ENTRY.size + 8 * ndim + name_len
    return pos


@pytest.fixture
def small(tmp_path) -> Path:
    """A valid file: two float32 matrices, an int8 vector, metadata."""
    p = tmp_path / "small.kdtr"
    kdtr.save(
        p,
        {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones((2, 2), np.float32),
         "c": np.arange(5, dtype=np.int8)},
        metadata={"generator": "test", "seed": "0"},
    )
    return p


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_every_dtype(tmp_path, mmap):
    want = every_dtype()
    p = tmp_path / "all.kdtr"
    kdtr.save(p, want, metadata={"k": "v", "unicode": "π ≈ 3.14"})
    got = kdtr.load(p, mmap=mmap, verify=True)
    assert_same(got, want)
    assert kdtr.read_metadata(p) == {"k": "v", "unicode": "π ≈ 3.14"}
    assert got["bfloat16/matrix"].dtype == kdtr.BFLOAT16 and kdtr.BFLOAT16 is not None
    assert got["float64/scalar"].ndim == 0


def test_layout_is_aligned_and_deterministic(tmp_path):
    want = every_dtype()
    a, b = tmp_path / "a.kdtr", tmp_path / "b.kdtr"
    kdtr.save(a, want, {"x": "1"})
    kdtr.save(b, want, {"x": "1"})
    assert a.read_bytes() == b.read_bytes()
    h = kdtr.read_header(a)
    assert h.data_offset % kdtr.ALIGN == 0
    assert all(e.offset % kdtr.ALIGN == 0 for e in h.tensors)
    for arr in kdtr.load(a, mmap=True).values():
        if arr.nbytes:
            assert arr.ctypes.data % kdtr.ALIGN == 0


def test_non_native_inputs_are_normalised(tmp_path):
    p = tmp_path / "n.kdtr"
    big = np.arange(6, dtype=">i4").reshape(2, 3)
    fortran = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    strided = np.arange(20, dtype=np.int16)[::3]
    kdtr.save(p, {"big": big, "fortran": fortran, "strided": strided, "list": [1.5, 2.5]})
    got = kdtr.load(p)
    assert got["big"].dtype == np.dtype("<i4") and (got["big"] == big).all()
    assert (got["fortran"] == fortran).all() and got["fortran"].flags.c_contiguous
    assert (got["strided"] == strided).all()
    assert got["list"].dtype == np.float64


def test_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    t = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(2, 8, dtype=torch.bfloat16),
        "grad": torch.randn(3, requires_grad=True),
        "transposed": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
        "mask": torch.tensor([True, False, True]),
        "u8": torch.arange(4, dtype=torch.uint8),
        "scalar": torch.tensor(7, dtype=torch.int32),
    }
    p = tmp_path / "t.kdtr"
    kdtr.save(p, t)
    got = kdtr.load(p, mmap=False)
    assert got["bf16"].dtype == kdtr.BFLOAT16
    assert torch.equal(torch.from_numpy(got["bf16"].view(np.int16)).view(torch.bfloat16), t["bf16"])
    assert torch.equal(torch.from_numpy(got["transposed"]), t["transposed"])
    assert np.array_equal(got["grad"], t["grad"].detach().numpy())
    assert got["mask"].dtype == np.bool_ and got["scalar"].shape == ()


@pytest.mark.gpu
def test_cuda_inputs_and_device_load(tmp_path):
    import cupy
    import torch

    t = {"torch_cuda": torch.randn(64, 3, device="cuda"), "cupy": cupy.arange(10, dtype=cupy.float16),
         "bf16": torch.randn(5, dtype=torch.bfloat16, device="cuda")}
    p = tmp_path / "g.kdtr"
    kdtr.save(p, t)
    host = kdtr.load(p)
    assert np.array_equal(host["torch_cuda"], t["torch_cuda"].cpu().numpy())
    dev = kdtr.load(p, device="cuda")
    assert isinstance(dev["cupy"], cupy.ndarray)
    assert bool((dev["cupy"] == t["cupy"]).all())
    assert dev["bf16"].view(cupy.uint16).get().tobytes() == host["bf16"].tobytes()


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=12),
        st.tuples(st.sampled_from(list(kdtr.DTYPES.values())),
                  st.lists(st.integers(0, 4), max_size=3), st.integers(0, 2**32 - 1)),
        max_size=6,
    ),
    st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=20), max_size=3),
    st.booleans(),
)
def test_property_round_trip(tmp_path_factory, specs, metadata, mmap):
    want = {name: sample(dt, tuple(shape), seed) for name, (dt, shape, seed) in specs.items()}
    p = tmp_path_factory.mktemp("prop") / "p.kdtr"
    kdtr.save(p, want, metadata)
    assert_same(kdtr.load(p, mmap=mmap, verify=True), want)
    assert kdtr.read_metadata(p) == metadata


def test_empty_container(tmp_path):
    p = tmp_path / "e.kdtr"
    kdtr.save(p, {})
    assert kdtr.load(p) == {} and kdtr.read_metadata(p) == {}
    assert p.stat().st_size == kdtr.PREAMBLE.size


# ---------------------------------------------------------------------------------------------
# mmap: O(header)


def test_mmap_returns_read_only_views_of_one_map(small):
    got = kdtr.load(small, mmap=True)
    for arr in got.values():
        base = arr
        while base is not None and not isinstance(base, np.memmap):
            base = base.base
        assert isinstance(base, np.memmap), "mmap=True must hand out views into a memory map"
        assert not arr.flags.writeable
    owned = kdtr.load(small, mmap=False)
    assert all(a.flags.writeable and not isinstance(a.base, np.memmap) for a in owned.values())


def test_mmap_of_1gib_file_reads_only_the_header(tmp_path):
    """A sparse 1 GiB file: mapping it allocates nothing near 1 GiB and reads no data page."""
    p = tmp_path / "big.kdtr"
    n = 1 << 30  # 1 GiB of float32 zeros (a sparse file: no disk blocks)
    zeros_crc = 0
    chunk = bytes(1 << 26)
    for _ in range(n // len(chunk)):
        zeros_crc = zlib.crc32(chunk, zeros_crc)
    spec = [[b"w", kdtr.CODES["float32"], (n // 4,), kdtr.ALIGN * 2, n, zeros_crc]]
    head = kdtr._encode_header(spec, [], kdtr.ALIGN * 2, kdtr.ALIGN * 2 + n)
    with open(p, "wb") as f:
        f.write(head)
        f.truncate(kdtr.ALIGN * 2 + n)
    tracemalloc.start()
    got = kdtr.load(p, mmap=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got["w"].shape == (n // 4,) and got["w"].nbytes == n
    assert peak < 1 << 20, f"mmap load allocated {peak} bytes"
    assert os.stat(p).st_blocks * 512 < 1 << 20, "the file stayed sparse: no data was written"


def test_mmap_skips_data_checksums_unless_asked(small):
    buf = image(small)
    e = kdtr.read_header(small).tensors[0]
    buf[e.offset] ^= 0x01
    small.write_bytes(bytes(buf))
    kdtr.load(small, mmap=True)  # O(header): data untouched, so the damage is not seen
    for call in (lambda: kdtr.load(small, mmap=True, verify=True), lambda: kdtr.load(small, mmap=False),
                 lambda: kdtr.verify(small)):
        with pytest.raises(KdtrError, match="checksum mismatch in tensor 'a'"):
            call()


# ---------------------------------------------------------------------------------------------
# Malformed files: each class of damage -> KdtrError naming it


def write_image(path, buf, reseal=True):
    Path(path).write_bytes(kdtr.reseal(bytes(buf)) if reseal else bytes(buf))


@pytest.mark.parametrize("cut", [0, 5, 8, 40, 63, 64, 100, -1, -7])
def test_truncated(small, cut):
    buf = image(small)
    write_image(small, buf[:cut] if cut >= 0 else buf[:cut], reseal=False)
    with pytest.raises(KdtrError, match="truncated|not a KDTR file"):
        kdtr.load(small)


def test_trailing_bytes(small):
    write_image(small, image(small) + b"\0", reseal=False)
    with pytest.raises(KdtrError, match="trailing bytes"):
        kdtr.load(small)


def test_empty_and_missing_file(tmp_path):
    (tmp_path / "zero.kdtr").write_bytes(b"")
    with pytest.raises(KdtrError, match="not a KDTR file"):
        kdtr.load(tmp_path / "zero.kdtr")
    with pytest.raises(FileNotFoundError):
        kdtr.load(tmp_path / "absent.kdtr")


def test_wrong_magic(small, tmp_path):
    buf = image(small)
    buf[1:5] = b"KDTX"
    write_image(small, buf)
    with pytest.raises(KdtrError, match="not a KDTR file"):
        kdtr.load(small)
    npz = tmp_path / "x.kdtr"
    with open(npz, "wb") as f:
        np.save(f, np.ones(3))  # a .npy under a .kdtr name
    with pytest.raises(KdtrError, match="not a KDTR file"):
        kdtr.load(npz)


@pytest.mark.parametrize("reseal", [True, False])
def test_unknown_version(small, reseal):
    buf = image(small)
    struct.pack_into("<I", buf, 8, 2)
    write_image(small, buf, reseal)
    with pytest.raises(KdtrError, match="unknown KDTR version 2"):
        kdtr.load(small)


def test_reserved_fields(small):
    buf = image(small)
    struct.pack_into("<I", buf, 12, 1)
    write_image(small, buf)
    with pytest.raises(KdtrError, match="reserved"):
        kdtr.load(small)


def test_header_checksum(small):
    buf = image(small)
    buf[entry_pos(buf, 1) + kdtr.ENTRY.size + 20] ^= 0x10  # a byte of b's name, header not resealed
    write_image(small, buf, reseal=False)
    with pytest.raises(KdtrError, match="header checksum mismatch"):
        kdtr.read_metadata(small)


@pytest.mark.parametrize("code", [0, 16, 255])
def test_unknown_dtype(small, code):
    buf = image(small)
    buf[entry_pos(buf, 0) + 2] = code
    write_image(small, buf)
    with pytest.raises(KdtrError, match=f"unknown dtype code {code}"):
        kdtr.load(small)


def test_shape_disagrees_with_nbytes(small):
    buf = image(small)
    struct.pack_into("<Q", buf, entry_pos(buf, 0) + kdtr.ENTRY.size, 4)  # dims[0]: 3 -> 4
    write_image(small, buf)
    with pytest.raises(KdtrError, match=r"shape \(4, 4\) of float32 is 64 bytes, but the table says 48"):
        kdtr.load(small)


def test_offset_past_end(small):
    buf = image(small)
    size = len(buf)
    struct.pack_into("<Q", buf, entry_pos(buf, 2) + 8, kdtr._align(size))
    write_image(small, buf)
    with pytest.raises(KdtrError, match="outside the data section"):
        kdtr.load(small)


def test_offset_before_data_section_and_unaligned(small):
    original, offset = image(small), kdtr.read_header(small).tensors[0].offset
    buf = bytearray(original)
    struct.pack_into("<Q", buf, entry_pos(buf, 0) + 8, 0)
    write_image(small, buf)
    with pytest.raises(KdtrError, match="outside the data section"):
        kdtr.load(small)
    buf = bytearray(original)
    struct.pack_into("<Q", buf, entry_pos(buf, 0) + 8, offset + 4)
    write_image(small, buf)
    with pytest.raises(KdtrError, match="not a multiple of 64"):
        kdtr.load(small)


def test_overlapping_tensors(small):
    buf = image(small)
    a = kdtr.read_header(small).tensors[0]
    struct.pack_into("<Q", buf, entry_pos(buf, 1) + 8, a.offset)
    write_image(small, buf)
    with pytest.raises(KdtrError, match="tensors '[ab]' and '[ab]' overlap"):
        kdtr.load(small)


def test_duplicate_names(small):
    buf = image(small)
    name_at = entry_pos(buf, 2) - 1  # the one-byte name of tensor 1 ('b') ends the entry
    buf[name_at] = ord("a")
    write_image(small, buf)
    with pytest.raises(KdtrError, match="duplicate tensor name 'a'"):
        kdtr.load(small)


def test_non_utf8_name(small):
    buf = image(small)
    buf[entry_pos(buf, 2) - 1] = 0xFF
    write_image(small, buf)
    with pytest.raises(KdtrError, match="not UTF-8"):
        kdtr.load(small)


def test_non_utf8_metadata_and_duplicate_key(tmp_path):
    p = tmp_path / "m.kdtr"
    kdtr.save(p, {"x": np.zeros(2)}, {"ka": "v", "kb": "w"})
    buf = image(p)
    at = bytes(buf).index(b"kb")
    buf[at + 1] = ord("a")
    write_image(p, buf)
    with pytest.raises(KdtrError, match="duplicate metadata key 'ka'"):
        kdtr.read_metadata(p)
    buf[at] = 0xC3  # a lone UTF-8 lead byte
    write_image(p, buf)
    with pytest.raises(KdtrError, match="metadata entry 1 is not UTF-8"):
        kdtr.read_metadata(p)


@pytest.mark.parametrize(
    "field_offset, value, message",
    [
        (16, 2**40, "header size 1099511627776 bytes runs past the end"),  # header_size: 1 TiB
        (24, 2**40, "cannot fit"),  # n_tensors
        (32, 2**62, "cannot fit"),  # n_metadata
        (40, 2**40, "data offset"),
        (48, 2**40, "truncated: the header says 1099511627776 bytes"),  # file_size
    ],
)
def test_header_claiming_terabytes(small, field_offset, value, message):
    buf = image(small)
    struct.pack_into("<Q", buf, field_offset, value)
    write_image(small, buf)
    tracemalloc.start()
    with pytest.raises(KdtrError, match=message):
        kdtr.load(small, mmap=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < len(buf) + (64 << 10), f"refusing a bad header allocated {peak} bytes"


def test_tensor_claiming_terabytes(small):
    buf = image(small)
    pos = entry_pos(buf, 0)
    struct.pack_into("<QQQ", buf, pos + 16, 2**40 * 12, 2**40, 3)  # nbytes, dims = [2**40, 3] float32
    write_image(small, buf)
    with pytest.raises(KdtrError, match="outside the data section"):
        kdtr.load(small, mmap=False)
    struct.pack_into("<QQQ", buf, pos + 16, 0, 0, 2**62)  # empty, but numpy cannot describe [0, 2**62]
    write_image(small, buf)
    with pytest.raises(KdtrError, match="too large for numpy"):
        kdtr.load(small)


def test_too_many_dims_and_unexplained_header_bytes(small):
    original = image(small)
    buf = bytearray(original)
    buf[entry_pos(buf, 0) + 3] = 65
    write_image(small, buf)
    with pytest.raises(KdtrError, match="65 dimensions"):
        kdtr.load(small)
    buf = bytearray(original)
    header_size = struct.unpack_from("<Q", buf, 16)[0]
    struct.pack_into("<Q", buf, 16, header_size + 1)  # the padding byte now counts as header
    write_image(small, buf)
    with pytest.raises(KdtrError, match="1 unexplained bytes"):
        kdtr.load(small)


def test_bool_bytes_other_than_0_1(tmp_path):
    p = tmp_path / "b.kdtr"
    kdtr.save(p, {"m": np.array([True, False])})
    buf = image(p)
    e = kdtr.read_header(p).tensors[0]
    buf[e.offset] = 2
    pos = entry_pos(buf, 0)
    struct.pack_into("<I", buf, pos + 4, zlib.crc32(bytes(buf[e.offset : e.offset + 2])))
    write_image(p, buf)
    with pytest.raises(KdtrError, match="bytes other than 0 and 1"):
        kdtr.load(p, mmap=False)


# ---------------------------------------------------------------------------------------------
# save: argument checks and atomicity


@pytest.mark.parametrize(
    "tensors, metadata, message",
    [
        ({"x": np.zeros(2, np.complex64)}, None, "complex64 is not supported"),
        ({"x": np.array(["a"])}, None, "not supported"),
        ({"x": "float8_e4m3fnuz"}, None, "float8_e4m3fnuz is not supported"),  # the fnuz variant, not OCP
        ({"": np.zeros(2)}, None, "non-empty strings"),
        ({3: np.zeros(2)}, None, "non-empty strings"),
        ({"x": np.zeros(2)}, {"k": 3}, "metadata must map"),
        ({"x": np.zeros(2)}, {"": "v"}, "metadata must map"),
        ({"\ud800": np.zeros(2)}, None, "surrogate"),
        ([np.zeros(2)], None, "must be a mapping"),
        ({"x": np.zeros(2)}, [("k", "v")], "metadata must be a mapping"),
    ],
)
def test_save_rejects_bad_arguments_before_any_work(tmp_path, tensors, metadata, message):
    if isinstance(tensors, dict) and isinstance(tensors.get("x"), str):
        tensors = {"x": np.zeros(2, getattr(pytest.importorskip("ml_dtypes"), tensors["x"]))}
    with pytest.raises(ValueError, match=message):
        kdtr.save(tmp_path / "x.kdtr", tensors, metadata)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_save_keeps_old_file_and_leaves_no_litter(small, monkeypatch):
    before = small.read_bytes()
    calls = []
    real = kdtr._write_array

    def failing(f, a):
        calls.append(a.shape)
        if len(calls) == 2:  # the first tensor's bytes are already in the temp file
            raise OSError("disk full (simulated)")
        return real(f, a)

    monkeypatch.setattr(kdtr, "_write_array", failing)
    with pytest.raises(OSError, match="simulated"):
        kdtr.save(small, {"new": np.ones(1000), "second": np.ones(10)})
    assert small.read_bytes() == before
    assert sorted(p.name for p in small.parent.iterdir()) == [small.name]
    assert len(calls) == 2


# A child's kdtr writer that writes the first tensor, says "half" and pauses in the middle of the file
_SLOW_WRITER = textwrap.dedent(
    """
    import time
    real = kdtr._write_array
    def slow(f, a):
        crc = real(f, a)
        f.flush()
        print("half", flush=True)
        time.sleep(120)
        return crc
    kdtr._write_array = slow
    """
)


def test_killed_save_never_leaves_a_partial_target(small):
    """SIGKILL in the middle of the data: the target is the old file; only a marked temp remains."""
    before = small.read_bytes()
    child = textwrap.dedent(
        """
        import numpy as np
        from kdlib import kdtr
        """
    ) + _SLOW_WRITER + f"kdtr.save({str(small)!r}, {{'x': np.ones(1 << 20), 'y': np.ones(10)}})\n"
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "half"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert small.read_bytes() == before
    kdtr.verify(small)
    litter = [p.name for p in small.parent.iterdir() if p.name != small.name]
    assert len(litter) == 1 and litter[0].startswith(".small.kdtr.") and litter[0].endswith(".kdtr-tmp")


@pytest.mark.parametrize("sig, code, how", [(signal.SIGTERM, 143, "terminated"),
                                            (signal.SIGINT, 130, "interrupted")])
def test_a_signalled_convert_leaves_no_temp_file_and_no_traceback(small, tmp_path, sig, code, how):
    """`kdlib kdtr convert` stopped mid-write: SIGTERM (kill, timeout) left the hidden temp file behind,
    Ctrl-C printed a traceback. Now both remove it, keep the old target, and end in one line with the
    shell's code."""
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "big.kdtr"
    dst.write_bytes(small.read_bytes())  # an old target, which must survive whole
    child = textwrap.dedent(
        """
        import signal, sys
        from kdlib import cli, kdtr
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the test runner ignores it
        """
    ) + _SLOW_WRITER + f"sys.exit(cli.main(['kdtr', 'convert', {str(small)!r}, {str(dst)!r}]))\n"
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "half"
        assert len(list(out.iterdir())) == 2  # the target and the temp file being written
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, err
    assert err == f"kdlib kdtr convert: {how}\n"
    assert [p.name for p in out.iterdir()] == [dst.name] and dst.read_bytes() == small.read_bytes()


def test_save_keeps_permissions_of_replaced_file(small):
    os.chmod(small, 0o640)
    kdtr.save(small, {"x": np.zeros(1)})
    assert small.stat().st_mode & 0o777 == 0o640


def test_new_file_takes_the_umask_as_open_does(tmp_path):
    old = os.umask(0o077)
    try:
        kdtr.save(tmp_path / "private.kdtr", {"x": np.zeros(1)})
        (tmp_path / "plain").write_bytes(b"")
    finally:
        os.umask(old)
    assert (tmp_path / "private.kdtr").stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777
    assert (tmp_path / "private.kdtr").stat().st_mode & 0o777 == 0o600


def test_long_target_names_and_symlinks(tmp_path):
    """A 245-byte name (under the 255 a name may have) saves; a link is written through, not replaced."""
    long = tmp_path / ("g" * 240 + ".kdtr")
    kdtr.save(long, {"x": np.arange(3)})
    assert np.array_equal(kdtr.load(long)["x"], np.arange(3))
    target, link = tmp_path / "real.kdtr", tmp_path / "link.kdtr"
    kdtr.save(target, {"x": np.zeros(1)})
    link.symlink_to(target.name)
    kdtr.save(link, {"x": np.ones(1)})
    assert link.is_symlink() and kdtr.load(target)["x"][0] == 1.0


def test_bool_views_are_written_as_0_and_1(tmp_path):
    """numpy takes any nonzero byte of a bool as True; a bool made by a view is saved as 0 / 1 bytes."""
    m = np.array([0, 1, 2, 255], np.uint8).view(np.bool_)
    p = tmp_path / "b.kdtr"
    kdtr.save(p, {"m": m, "scalar": np.array(7, np.uint8).view(np.bool_)})
    kdtr.verify(p)
    got = kdtr.load(p, mmap=False)
    assert got["m"].view(np.uint8).tolist() == [0, 1, 1, 1] and got["scalar"].view(np.uint8) == 1
    kdtr.save(tmp_path / "b2.kdtr", {"m": m.copy()})  # the caller's array is left as it was
    assert m.view(np.uint8).tolist() == [0, 1, 2, 255]


# ---------------------------------------------------------------------------------------------
# Inspection, converters, CLI


def test_header_fields_cover_the_header(small):
    rows = kdtr.header_fields(small)
    pos = 0
    for off, size, _, _ in rows:
        assert off == pos
        pos += size
    assert pos == kdtr.PREAMBLE.size + kdtr.read_header(small).header_size
    fields = {name: value for _, _, name, value in rows}
    assert fields["magic"] == kdtr.MAGIC and fields["n_tensors"] == 3
    assert fields["tensor[a].dims[1]"] == 4 and fields["meta[seed].value"] == "0"
    assert "tensor[a].dtype = 2 (float32)" in kdtr.hexdump(small)


@pytest.mark.parametrize("ext", ["safetensors", "npz"])
def test_converters_round_trip(tmp_path, ext):
    want = every_dtype()
    src = tmp_path / "src.kdtr"
    kdtr.save(src, want, {"generator": "test"})
    mid, back = tmp_path / f"mid.{ext}", tmp_path / "back.kdtr"
    getattr(kdtr, f"to_{ext}")(src, mid)
    getattr(kdtr, f"from_{ext}")(mid, back)
    got = kdtr.load(back)
    assert set(got) == set(want)  # safetensors orders names its own way
    assert_same({k: got[k] for k in want}, want)
    assert kdtr.read_metadata(back) == {"generator": "test"}


def test_convert_is_byte_identical_across_processes(tmp_path):
    """safetensors hands out (and its writer emits) metadata in a per-process order: converted files
    must not depend on it. Two processes with different hash seeds, every target format."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src = tmp_path / "m.safetensors"
    meta = {k: f"value {k}" for k in ("format", "zeta", "alpha", "model", "b")}
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3, dtype=np.int8)}, str(src),
              metadata=meta)
    for ext in ("kdtr", "safetensors", "npz"):
        outs = []
        for seed in ("1", "2"):
            dst = tmp_path / f"out{seed}.{ext}"
            code = (
                f"from kdlib import kdtr; raise SystemExit(kdtr.cli(['convert', {str(src)!r}, {str(dst)!r}]))"
            )
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": seed})
            outs.append(dst.read_bytes())
        assert outs[0] == outs[1], ext
    with safe_open(str(tmp_path / "out1.safetensors"), framework="numpy") as f:
        assert f.metadata() == meta and sorted(f.keys()) == ["b", "w"]
    assert list(kdtr.read_metadata(tmp_path / "out1.kdtr")) == sorted(meta)


@pytest.mark.parametrize("ext", ["npz", "safetensors"])
def test_names_that_collide_with_savez_arguments(tmp_path, ext):
    """np.savez(file, *args, allow_pickle=..., **kwds) would drop `allow_pickle` and fail on `file`."""
    want = {
        "file": np.arange(4, dtype=np.int32),
        "allow_pickle": np.ones((2, 2)),
        "args": np.zeros(0, np.uint8),
        "x.npy": np.array(1.5, np.float32),
        "dir/name": np.arange(3, dtype=np.int16),
    }
    src, mid, back = tmp_path / "n.kdtr", tmp_path / f"n.{ext}", tmp_path / "back.kdtr"
    kdtr.save(src, want)
    kdtr.convert(src, mid)
    kdtr.convert(mid, back)
    assert_same({k: kdtr.load(back)[k] for k in want}, want)
    if ext == "npz":
        with np.load(mid, allow_pickle=False) as z:
            assert sorted(z.files) == sorted([*want, kdtr.NPZ_SIDECAR])
            assert np.array_equal(z["file"], want["file"]) and np.array_equal(
                z["allow_pickle"], want["allow_pickle"]
            )


def fp8_every_bit_pattern() -> dict[str, np.ndarray]:
    """All 256 bytes as each OCP FP8 type (NaNs, infinities, -0 and subnormals included)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bits = np.arange(256, dtype=np.uint8).reshape(16, 16)  # [16, 16]
    return {"e4m3": bits.view(ml_dtypes.float8_e4m3fn), "e5m2": bits.view(ml_dtypes.float8_e5m2),
            "scale": np.linspace(0.5, 2.0, 16, dtype=np.float32)}


def test_fp8_against_safetensors(tmp_path):
    """FP8 written by the safetensors library converts to KDTR and back bit for bit; the library's torch
    loader reads the file KDTR writes as the same float8 tensors."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    want = fp8_every_bit_pattern()
    src, k, back = tmp_path / "f8.safetensors", tmp_path / "f8.kdtr", tmp_path / "back.safetensors"
    save_file(want, str(src), metadata={"quant": "fp8"})
    kdtr.convert(src, k)
    got = kdtr.load(k)
    assert [kdtr.NAMES[e.code] for e in kdtr.read_header(k).tensors] == [
        "float8_e4m3fn",
        "float8_e5m2",
        "float32",
    ]
    assert_same(got, want)
    kdtr.convert(k, back)
    t = load_file(str(back))
    assert t["e4m3"].dtype == torch.float8_e4m3fn and t["e5m2"].dtype == torch.float8_e5m2
    for name in ("e4m3", "e5m2"):
        assert t[name].view(torch.uint8).numpy().tobytes() == want[name].tobytes()
    for ext in ("npz", "kdtr"):  # and through the other formats
        kdtr.convert(back, tmp_path / f"again.{ext}")
        kdtr.convert(tmp_path / f"again.{ext}", tmp_path / "again2.kdtr")
        assert_same(kdtr.load(tmp_path / "again2.kdtr"), want)
    torch_in = {"e4m3": t["e4m3"], "e5m2": t["e5m2"]}  # torch float8 tensors saved directly
    kdtr.save(tmp_path / "t.kdtr", torch_in)
    assert_same(kdtr.load(tmp_path / "t.kdtr"), {n: want[n] for n in torch_in})


def test_unsupported_safetensors_dtype_is_named(tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "c.safetensors"
    save_file({"ok": np.zeros(2, np.float32), "z": np.zeros(2, np.complex64)}, str(src))
    with pytest.raises(KdtrError, match="tensor 'z' has safetensors dtype C64, which KDTR cannot hold"):
        kdtr.convert(src, tmp_path / "c.kdtr")
    assert not (tmp_path / "c.kdtr").exists()


def test_convert_reads_foreign_files(tmp_path):
    from safetensors.numpy import save_file

    st = tmp_path / "w.safetensors"
    save_file({"w": np.arange(6, dtype=np.float16).reshape(2, 3)}, str(st), metadata={"format": "np"})
    kdtr.convert(st, tmp_path / "w.kdtr")
    assert kdtr.load(tmp_path / "w.kdtr")["w"].shape == (2, 3)
    npz = tmp_path / "plain.npz"
    np.savez(npz, a=np.arange(3), b=np.eye(2))
    kdtr.convert(npz, tmp_path / "plain.kdtr")
    assert_same(kdtr.load(tmp_path / "plain.kdtr"), {"a": np.arange(3), "b": np.eye(2)})
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(KdtrError, match="cannot read safetensors"):
        kdtr.convert(tmp_path / "bad.safetensors", tmp_path / "x.kdtr")
    with pytest.raises(ValueError, match="unknown file type '.bin'"):
        kdtr.convert(tmp_path / "w.kdtr", tmp_path / "w.bin")


def test_cli_in_process(small, tmp_path, capsys):
    assert kdcli.main(["kdtr", "info", str(small)]) == 0
    out = capsys.readouterr().out
    assert "3 tensors" in out and "float32" in out and "generator = test" in out
    st = tmp_path / "s.safetensors"
    assert kdcli.main(["kdtr", "convert", str(small), str(st)]) == 0
    assert kdcli.main(["kdtr", "convert", str(st), str(tmp_path / "back.kdtr")]) == 0
    assert kdcli.main(["kdtr", "verify", str(tmp_path / "back.kdtr")]) == 0
    capsys.readouterr()
    assert kdcli.main(["kdtr", "info", str(tmp_path / "absent.kdtr")]) == 2
    assert "No such file" in capsys.readouterr().err
    assert kdcli.main(["kdtr", "convert", str(small), str(tmp_path / "x.bin")]) == 2
    assert "unknown file type" in capsys.readouterr().err
    assert kdcli.main(["kdtr"]) == 2
    assert kdcli.main(["kdtr", "frobnicate"]) == 2


def test_differences_names_a_tolerance_tensor_the_actual_file_lacks(tmp_path):
    x = np.linspace(0, 1, 8)
    kdtr.save(tmp_path / "exp.kdtr", {"q": x, "out": 2 * x})
    kdtr.save(tmp_path / "act.kdtr", {"q": x, "ouu": 2 * x})  # renamed, the same layout
    problems = kdtr.differences(tmp_path / "act.kdtr", tmp_path / "exp.kdtr", close={"out": 1e-12})
    assert problems == [f"{tmp_path / 'act.kdtr'}: no tensors named ['out'] (asked to compare them at a "
                        "tolerance)"]


@pytest.mark.parametrize(
    "sidecar, message",
    [
        ({"metadata": {"n": 3}}, "metadata 'n' is int, not a string"),
        ({"dtypes": {"x": "float32"}}, "gives 'x' the dtype 'float32'"),
        ({"dtypes": {"y": "float8_e4m3fn"}}, "stored as int32, not as the uint8 bits"),
        ({"dtypes": {"z": "bfloat16"}}, "names a tensor 'z' the archive lacks"),
    ],
)
def test_npz_sidecar_is_checked_not_applied_blindly(tmp_path, sidecar, message):
    """The sidecar may only name the types npz cannot (stored as unsigned bits of their width) and
    string metadata; anything else would reinterpret data or write an unreadable .safetensors."""
    src = tmp_path / "m.npz"
    np.savez(src, x=np.zeros(2, np.float32), y=np.arange(3, dtype=np.int32),
             __kdtr__=np.array(json.dumps(sidecar)))
    with pytest.raises(KdtrError, match=re.escape(message)):
        kdtr.convert(src, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_a_file_that_is_no_npz_is_named_so(tmp_path):
    """np.load would call a non-zip .npz pickled data and suggest allow_pickle; it is not an archive."""
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"this is not an archive\n")
    with pytest.raises(KdtrError, match=r"junk.npz: not an npz file \(an npz is a zip archive"):
        kdtr.convert(junk, tmp_path / "j.kdtr")
    assert not (tmp_path / "j.kdtr").exists()


def test_npz_refuses_names_zip_would_cut(tmp_path):
    src = tmp_path / "n.kdtr"
    kdtr.save(src, {"x\0a": np.zeros(2), "x\0b": np.ones(2)})  # KDTR holds such names
    with pytest.raises(ValueError, match="NUL character"):
        kdtr.convert(src, tmp_path / "n.npz")
    assert not (tmp_path / "n.npz").exists()


def test_npz_names_differing_by_a_npy_suffix_keep_their_own_data(tmp_path):
    """Tensors `x` and `x.npy` are members x.npy and x.npy.npy; np.load's lookup of "x.npy" finds the
    first, so reading back gave `x.npy` the data of `x`, silently."""
    want = {"x": np.array([1, 2, 3]), "x.npy": np.array([9.5]), "__kdtr__.npy": np.zeros(2, np.int8)}
    kdtr.save(tmp_path / "a.kdtr", want)
    kdtr.convert(tmp_path / "a.kdtr", tmp_path / "a.npz")
    kdtr.convert(tmp_path / "a.npz", tmp_path / "b.kdtr")
    got = kdtr.load(tmp_path / "b.kdtr")
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    assert "x.npy      int64" not in kdtr.table(tmp_path / "a.npz")
    assert re.search(r"^x\.npy +float64 +\[1\] +8 ", kdtr.table(tmp_path / "a.npz"), re.M)


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_info_of_a_safetensors_or_npz_reads_the_headers_alone(tmp_path, monkeypatch, fmt):
    """`kdlib kdtr info` on a checkpoint shard loaded every tensor (twice the file in memory for
    safetensors); it lists the table from the headers, the ml dtypes the npz sidecar names included."""
    src = tmp_path / "s.kdtr"
    kdtr.save(src, {"w": np.zeros((3, 4), np.float32), "bf": sample(kdtr.DTYPES[4], (5,)),
                    "f8": sample(kdtr.DTYPES[14], (2, 2))}, {"k": "v"})
    dst = tmp_path / f"s.{fmt}"
    kdtr.convert(src, dst)
    loaded = []
    monkeypatch.setattr(kdtr, "_read_any", lambda *a: loaded.append(a))
    real = np.lib.format.read_array
    monkeypatch.setattr(np.lib.format, "read_array",
                        lambda f, **kw: loaded.append(f.name) if f.name != "__kdtr__.npy" else real(f, **kw))
    text = kdtr.table(dst)
    assert loaded == []
    assert re.search(r"^w +float32 +\[3, 4\] +48 ", text, re.M)
    assert re.search(r"^bf +bfloat16 +\[5\] +10 ", text, re.M)
    assert re.search(r"^f8 +float8_e4m3fn +\[2, 2\] +4 ", text, re.M)
    assert text.endswith("metadata:\n  k = v")


def test_info_of_a_safetensors_whose_data_are_cut_says_so(tmp_path):
    st = tmp_path / "s.safetensors"
    kdtr.save(tmp_path / "s.kdtr", {"w": np.zeros(64, np.float32)})
    kdtr.convert(tmp_path / "s.kdtr", st)
    st.write_bytes(st.read_bytes()[:-8])
    with pytest.raises(KdtrError, match=r"'w' has data offsets 0\.\.256, past the file's 248 data bytes"):
        kdtr.table(st)
    st.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(KdtrError, match="header size 1000000000000 past the file's 10 bytes"):
        kdtr.table(st)
    # what the library refuses, the header-only reader refuses too (it printed a traceback, or a -2 size)
    negative = {"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}}
    short = {"w": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 8]}}  # listed as 8 bytes
    for header, message in (({"__metadata__": {"a": 1}}, "metadata 'a' is not a string"),
                            (negative, "not sizes >= 0"),
                            (short, r"'w' \(F32 \[1000, 1000\]\) needs 4000000 bytes, its data offsets "
                                    "span 8")):
        text = json.dumps(header).encode()
        st.write_bytes(struct.pack("<Q", len(text)) + text + bytes(8))
        with pytest.raises(KdtrError, match=message):
            kdtr.table(st)


@pytest.mark.parametrize("shape, message", [
    ((-5, 3), r"array 'x' has shape \[-5, 3\], not sizes >= 0"),
    ((2**32, 2**32), r"array 'x' \(float32 \[4294967296, 4294967296\]\) needs 73786976294838206464 bytes, "
                     r"its member holds 24"),
])
def test_info_of_an_npz_whose_header_lies_says_so(tmp_path, shape, message):
    """A forged .npy header over 24 bytes of data: info listed a negative size, or an int64 product
    wrapped to 0 bytes, where convert refuses the file."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(tmp_path / "x.npz", "w") as z:
        z.writestr("x.npy", buf.getvalue() + bytes(24))
    with pytest.raises(KdtrError, match=message):
        kdtr.table(tmp_path / "x.npz")


def test_info_rows_stay_one_line_a_tensor(tmp_path):
    """A name with a newline (KDTR allows it) split its row; dtype names past 8 characters shifted the
    columns after them."""
    p = tmp_path / "n.kdtr"
    kdtr.save(p, {"b\nc": np.zeros(2, np.float32), "e4m3": sample(kdtr.DTYPES[14], (2,))}, {"note": "1\n2"})
    lines = kdtr.table(p).splitlines()
    assert len(lines) == 2 + 2 + 2
    assert lines[2].startswith("b\\nc  float32        [2]")
    assert lines[3].startswith("e4m3  float8_e4m3fn  [2]")
    assert lines[1].index("shape") == lines[2].index("[2]") == lines[3].index("[2]")
    assert lines[-1] == "  note = 1\\n2"


def test_overlap_names_the_overlapping_bytes_where_one_tensor_holds_another(tmp_path):
    p = tmp_path / "o.kdtr"
    kdtr.save(p, {"a": np.zeros(64, np.float32), "b": np.zeros(2, np.float32)})  # 256 and 8 bytes
    buf = image(p)
    a = kdtr.read_header(p).tensors[0]
    struct.pack_into("<Q", buf, entry_pos(buf, 1) + 8, a.offset + 64)
    write_image(p, buf)
    with pytest.raises(KdtrError, match=rf"overlap \(bytes {a.offset + 64}\.\.{a.offset + 72}\)"):
        kdtr.load(p)


def test_load_checks_the_device_first(small, tmp_path):
    """A bad device was checked a tensor at a time after the whole file was read (an empty file: never),
    and after importing CuPy (without it: ModuleNotFoundError)."""
    kdtr.save(tmp_path / "e.kdtr", {})
    for path in (small, tmp_path / "e.kdtr"):
        for device in ("cpu", "bogus", "cuda:x", 0):
            with pytest.raises(ValueError, match="device must be None, 'cuda' or 'cuda:N', got"):
                kdtr.load(path, device=device)


def test_convert_errors_name_the_file_they_are_about(tmp_path, capsys):
    src = tmp_path / "c.npz"
    np.savez(src, a=np.zeros(2, np.complex128))
    assert kdtr.cli(["convert", str(src), str(tmp_path / "o.kdtr")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kdlib kdtr convert: error: {src}: tensor 'a': dtype complex128")
    good = tmp_path / "g.kdtr"
    kdtr.save(good, {"a": np.zeros(2)})
    (tmp_path / "ff").write_text("a file")
    assert kdtr.cli(["convert", str(good), str(tmp_path / "ff" / "x.kdtr")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'ff' / 'x.kdtr'}: its folder {tmp_path / 'ff'} is not a folder" in err


def test_a_failed_write_names_the_target_not_the_temp_file(tmp_path, monkeypatch):
    """A full disk or a read-only folder was reported of `.x.kdtr.<random>.kdtr-tmp`, a name the user
    never gave; the error now names the target. An error about another file keeps its own name."""
    target = tmp_path / "x.kdtr"

    def full(f):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match=re.escape(f"No space left on device: '{target}'")):
        atomic_write(target, full)
    with pytest.raises(FileNotFoundError, match="'/elsewhere/y'"):
        atomic_write(target, lambda f: open("/elsewhere/y"))
    assert os.listdir(tmp_path) == []

    def denied(**kw):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), f"{tmp_path}/.x.kdtr.abc.tmp")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(PermissionError, match=re.escape(f"Permission denied: '{target}'")):
        atomic_write(target, lambda f: None)


def test_cli_usage_errors_and_a_missing_safetensors_are_one_line(small, tmp_path, capsys):
    assert kdtr.cli(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kdlib kdtr: error: ") and err.endswith("(see kdlib kdtr --help)")
    assert "\n" not in err
    st = tmp_path / "s.safetensors"
    kdtr.convert(small, st)
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["safetensors"] = None  # import safetensors now raises ImportError
        from kdlib import kdtr
        print(kdtr.cli(["info", {str(st)!r}]))  # the header alone: no package needed
        sys.exit(kdtr.cli(["convert", {str(st)!r}, {str(tmp_path / "c.kdtr")!r}]))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "safetensors, 3 tensors" in r.stdout and r.stdout.endswith("\n0\n")
    assert r.stderr.strip().splitlines() == [f"kdlib kdtr convert: error: {st}: reading .safetensors needs "
                                             "the safetensors package (pip install safetensors)"]
    assert not (tmp_path / "c.kdtr").exists()


def test_cli_without_a_subcommand_names_the_choices(capsys):
    """`kdlib kdtr` alone said "the following arguments are required: cmd"."""
    assert kdtr.cli([]) == 2
    assert capsys.readouterr().err == ("kdlib kdtr: error: the following arguments are required: "
                                       "{info,convert,verify} (see kdlib kdtr --help)\n")


def test_cli_subprocess(small, tmp_path):
    exe = str(VENV_BIN / "kdlib")
    if not os.path.exists(exe):
        pytest.skip("the kdlib console script is not installed next to this python")
    r = subprocess.run([exe, "kdtr", "info", str(small)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "KDTR v1, 3 tensors" in r.stdout and "seed = 0" in r.stdout
    bad = tmp_path / "bad.kdtr"
    bad.write_bytes(small.read_bytes()[:100])
    r = subprocess.run([exe, "kdtr", "info", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "truncated" in r.stderr
    npz = tmp_path / "s.npz"
    r = subprocess.run(
        [exe, "kdtr", "convert", str(small), str(npz)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    with np.load(npz, allow_pickle=False) as z:
        assert np.array_equal(z["a"], kdtr.load(small)["a"])


def test_module_is_importable_without_optional_packages():
    code = "import sys; import kdlib.kdtr; assert not {'torch', 'cupy', 'safetensors'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=kdlib.ROOT)


def test_benchmark_runs_small(tmp_path):
    result = kdtr_io.measure(total_bytes=1 << 16, repeats=1, n_tensors=2, folder=tmp_path)
    assert result["data_bytes"] == 1 << 16
    assert {"kdtr", "npy", "npz", "safetensors", "raw_overwrite", "raw_atomic"} <= set(result["formats"])
    assert result["formats"]["kdtr"]["file_bytes"] - result["data_bytes"] < 4096
    assert list(tmp_path.iterdir()) == []  # the scratch folder is removed
    assert {r.op for r in results.kdtr_io_rows(result)} == set(result["formats"])


def test_without_ml_dtypes_bfloat16_travels_as_bits(tmp_path):
    """A machine without ml_dtypes still reads every file; bfloat16 comes back as uint16 bits."""
    p = tmp_path / "bf.kdtr"
    want = np.array([1.0, -2.5, 3.0e38], dtype=kdtr.BFLOAT16)
    kdtr.save(p, {"w": want})
    code = textwrap.dedent(
        f"""
        import sys, warnings
        sys.modules["ml_dtypes"] = None  # import ml_dtypes now raises ImportError
        import numpy as np
        from kdlib import kdtr
        assert kdtr.BFLOAT16 is None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            w = kdtr.load({str(p)!r})["w"]
        assert w.dtype == np.uint16 and any("ml_dtypes" in str(c.message) for c in caught)
        sys.stdout.write(w.tobytes().hex())
        kdtr.save({str(tmp_path / "again.kdtr")!r}, {{"f": np.ones(2, np.float32)}})
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want.tobytes().hex()
