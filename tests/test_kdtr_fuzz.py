"""KDTR fuzzing: damaged files either load with the right data or raise KdtrError, nothing else.

Two kinds of damage:
- plain: random byte damage to a valid file. The header CRC and the per-tensor CRCs must catch
  it, so a load succeeds only when the damage missed every meaningful byte (padding), and
  then it returns exactly the original tensors and metadata.
- resealed: damage to the preamble or header followed by a recomputed header CRC (what a buggy
  writer or a crafted file produces). Now the field checks behind the CRC are on their own: a
  load must raise KdtrError or return a self-consistent result, and it must never allocate more
  than the file holds.
"""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlib import kdtr
from kdlib.kdtr import KdtrError

INTERESTING = [0x00, 0x01, 0x02, 0x0D, 0x3F, 0x40, 0x7F, 0x80, 0xFE, 0xFF]


def base_files(tmp_path) -> list[tuple[bytes, dict, dict]]:
    """A few small valid files (image, tensors, metadata) covering every dtype, 0-d and empty."""
    rng = np.random.default_rng(1)
    out = []
    sets = [
        {"w": rng.standard_normal((4, 3)).astype(np.float32), "idx": np.arange(7, dtype=np.int64),
         "s": np.array(2.5), "e": np.zeros((0, 3), np.int16), "m": np.array([True, False, True])},
        {dt.name: (rng.integers(0, 2, 5) if dt == np.bool_ else rng.integers(0, 100, 5)).astype(dt)
         for dt in kdtr.DTYPES.values()},
        {"only": np.arange(3, dtype=np.uint8)},
    ]
    metas = [{"generator": "fuzz", "seed": "1"}, {}, {"k": "v" * 30}]
    for i, (tensors, meta) in enumerate(zip(sets, metas, strict=True)):
        p = tmp_path / f"base{i}.kdtr"
        kdtr.save(p, tensors, meta)
        out.append((p.read_bytes(), kdtr.load(p, mmap=False), meta))
    return out


def damage(rng: np.random.Generator, buf: bytes, header_end: int, header_only: bool) -> bytes:
    """One random damage: overwrite/flip bytes, write a huge u64, truncate, insert or delete."""
    b = bytearray(buf)
    hi = header_end if header_only else len(b)
    kind = rng.integers(0, 6)
    if kind == 0:  # flip one to three bits
        for _ in range(rng.integers(1, 4)):
            b[rng.integers(0, hi)] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:  # overwrite bytes with boundary values
        for _ in range(rng.integers(1, 5)):
            b[rng.integers(0, hi)] = INTERESTING[rng.integers(0, len(INTERESTING))]
    elif kind == 2:  # a huge or boundary little-endian u64 at a random aligned-ish place
        at = int(rng.integers(0, max(hi - 8, 1)))
        value = [2**64 - 1, 2**63, 2**40, 2**32, len(b), len(b) + 64, 0][rng.integers(0, 7)]
        b[at : at + 8] = struct.pack("<Q", value)[: len(b) - at]
    elif kind == 3:  # truncate
        del b[rng.integers(0, len(b)) :]
    elif kind == 4:  # insert a byte
        b.insert(int(rng.integers(0, hi)), int(rng.integers(0, 256)))
    else:  # delete a byte
        del b[rng.integers(0, hi)]
    return bytes(b)


def check_consistent(got: dict, size: int) -> None:
    """A successful load of a resealed file: well-typed arrays that fit inside the file."""
    total = 0
    for name, a in got.items():
        assert isinstance(name, str) and name
        assert isinstance(a, np.ndarray) and a.dtype in kdtr.DTYPES.values()
        assert a.nbytes == a.dtype.itemsize * int(np.prod(a.shape, dtype=object))
        total += a.nbytes
    assert total <= size


def put(path, img: bytes) -> None:
    """Overwrite `path` with `img` in place: an O_TRUNC open per file makes ext4 flush (auto_da_alloc)."""
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.write(img)
        f.truncate(len(img))


def run_one(path, img: bytes, want: dict, meta: dict, resealed: bool, mmap: bool, trace: bool) -> str:
    put(path, img)
    if trace:
        tracemalloc.start()
    try:
        got = kdtr.load(path, mmap=mmap, verify=True)
        got_meta = kdtr.read_metadata(path)
    except KdtrError:
        return "rejected"
    finally:
        if trace:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak <= len(img) + (64 << 10), f"a {len(img)}-byte file made load allocate {peak} bytes"
    if resealed:
        check_consistent(got, len(img))
        return "accepted"
    assert list(got) == list(want) and got_meta == meta
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape and got[k].tobytes() == w.tobytes(), k
    return "accepted"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return base_files(tmp_path_factory.mktemp("bases"))


@pytest.mark.slow
def test_fuzz_damaged_files(tmp_path, bases):
    """>= 10,000 damaged files; every load is exact or a KdtrError."""
    rng = np.random.default_rng(20261129)
    path = tmp_path / "damaged.kdtr"
    counts = {"rejected": 0, "accepted": 0}
    n = 12_000
    for i in range(n):
        img, want, meta = bases[i % len(bases)]
        header_end = kdtr.PREAMBLE.size + struct.unpack_from("<Q", img, 16)[0]
        resealed = i % 2 == 1
        bad = damage(rng, img, header_end, header_only=resealed)
        if resealed:
            bad = kdtr.reseal(bad)
        if bad == img:
            continue
        outcome = run_one(path, bad, want, meta, resealed, mmap=bool(i % 4 < 2), trace=i % 10 == 0)
        counts[outcome] += 1
    assert sum(counts.values()) >= 10_000, counts
    assert counts["rejected"] > 0.5 * sum(counts.values()), counts  # most damage must be caught


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_property_damaged_header_never_crashes(tmp_path_factory, bases, data):
    tmp = tmp_path_factory.mktemp("fz")
    img, want, meta = bases[0]
    b = bytearray(img)
    header_end = kdtr.PREAMBLE.size + struct.unpack_from("<Q", img, 16)[0]
    for _ in range(data.draw(st.integers(1, 4))):
        b[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    resealed = data.draw(st.booleans())
    bad = kdtr.reseal(bytes(b)) if resealed else bytes(b)
    run_one(tmp / "d.kdtr", bad, want, meta, resealed, mmap=data.draw(st.booleans()), trace=False)
