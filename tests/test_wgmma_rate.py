"""kernels/wgmma_rate/v1.cu and its suite: the expected accumulators against plain loops, the wgmma layout's
unscrambling (every element of D once), the launch's checks; on the GPU every shape's accumulators equal
them (the probe multiplies what it says)."""

from __future__ import annotations

import numpy as np
import pytest

from kdlib.cuda import loader
from kdlib.perf.suites import wgmma_rate as wr


def test_expected_is_the_products_summed_over_the_rounds():
    a, b = wr.operands(8, seed=1)
    st = wr.expected("st", 8, 3, a, b)
    assert st.shape == (1, 64, 8)
    assert st[0, 5, 7] == 3 * sum(int(a[5, k]) * int(b[7, k]) for k in range(wr.D))
    pv = wr.expected("pv", 8, 2, a, b)
    assert pv.shape == (wr.MB, 64, 8)
    for mb in range(wr.MB):
        assert pv[mb, 9, 3] == 2 * sum(int(a[key, 64 * mb + 9]) * int(b[3, key]) for key in range(64))
    assert np.abs(wr.expected("st", 72, wr.REPS, *wr.operands(72))).max() < 2 ** 24  # exact in fp32


@pytest.mark.parametrize("kind", wr.KINDS)
def test_unscramble_places_every_element_once(kind):
    for n in wr.SHAPES[kind]:
        vals = np.arange(128 * wr.ACC).reshape(128, wr.ACC)
        d = wr.unscramble(kind, n, vals)
        blocks = 1 if kind == "st" else wr.MB
        used = np.sort(d.ravel())
        assert d.shape == (blocks, 64, n) and len(np.unique(used)) == used.size == blocks * 64 * n
        assert np.array_equal(used, np.sort(vals[:, :blocks * n // 2].ravel()))  # a thread's first values


def test_bf16_bits_are_the_values():
    x = np.array([-1, 0, 1], dtype=np.int8)
    bits = wr.bf16_bits(x).astype(np.uint32) << 16
    assert np.array_equal(bits.view(np.float32), x.astype(np.float32))


def test_constants_fit_one_cta_an_sm():
    c = loader.source_constants(wr.SOURCE)
    assert wr.SMEM <= 227 * 1024 and wr.ACC == wr.MB * wr.NMAX // 2 and wr.D == 576
    assert c["RATE_B_OFF"] == c["RATE_A_BYTES"] == wr.CB * 64 * 128 and max(wr.SHAPES["st"]) == wr.NMAX
    assert wr.STEPS == {"st": 36, "pv": 8}


def test_launch_refuses_bad_arguments_before_compiling():
    a, b = np.zeros((64, wr.D)), np.zeros((8, wr.D))
    ok = {"kind": "st", "n": 8, "warpgroups": 1, "reps": 1, "grid": 1, "a": a, "b": b,
          "out": np.zeros((1, 1, 128, wr.ACC)), "cycles": np.zeros((1, 1))}
    for bad, match in (({"kind": "qk"}, "kind"), ({"n": 12}, "n must"), ({"kind": "pv", "n": 64}, "n must"),
                       ({"warpgroups": 3}, "warpgroups"), ({"reps": 0}, "positive"),
                       ({"b": np.zeros((16, wr.D))}, "a \\[64"), ({"cycles": np.zeros(1)}, "out")):
        with pytest.raises(ValueError, match=match):
            wr.launch(**(ok | bad))


@pytest.mark.gpu
@pytest.mark.parametrize("kind,n", [("st", 8), ("st", 64), ("st", 72), ("pv", 8), ("pv", 72)])
def test_each_shape_accumulates_the_expected_products(kind, n):
    """Two CTAs of two warpgroups, 5 rounds: each warpgroup's accumulators are the expected D, cycles > 0."""
    import cupy

    a, b = wr.operands(n, seed=n)
    grid, wgs, reps = 2, 2, 5
    out = cupy.full((grid, wgs, 128, wr.ACC), -7, dtype=cupy.float32)
    cycles = cupy.zeros((grid, wgs), dtype=cupy.int64)
    da, db = cupy.asarray(wr.bf16_bits(a)), cupy.asarray(wr.bf16_bits(b))
    wr.launch(kind, n, wgs, reps, grid, da, db, out, cycles)
    got, want = cupy.asnumpy(out), wr.expected(kind, n, reps, a, b)
    for c in range(grid):
        for w in range(wgs):
            np.testing.assert_array_equal(wr.unscramble(kind, n, got[c, w]), want, err_msg=f"CTA {c}, WG {w}")
    assert (cupy.asnumpy(cycles) > 0).all()


@pytest.mark.gpu
def test_the_quick_suite_is_exact_at_every_shape():
    doc = wr.run(quick=True)
    assert len(doc["rows"]) == sum(len(v) for v in wr.SHAPES.values()) * wr.MAX_WG
    assert all(r["exact"] and r["cycles_per_wgmma"]["min"] > 0 for r in doc["rows"])


def test_launch_builds_for_sm_90a(monkeypatch):
    """The kernels' bodies exist only where __CUDA_ARCH_FEAT_SM90_ALL is defined (else they trap): the launch
    asks the loader for the sm_90a build, with the shared memory it needs."""
    seen = {}

    def kernel(grid, block, args, shared_mem):
        seen.update(grid=grid, block=block, smem=shared_mem)

    def get_function(stem, name, options=()):
        seen.update(stem=stem, name=name, options=options)
        return kernel

    monkeypatch.setattr(loader, "get_function", get_function)
    monkeypatch.setattr(loader, "set_max_dynamic_shared", lambda fn, n: seen.update(max_smem=n))
    a, b = np.zeros((64, wr.D)), np.zeros((72, wr.D))
    wr.launch("pv", 72, 2, 3, 5, a, b, np.zeros((5, 2, 128, wr.ACC)), np.zeros((5, 2)))
    assert seen == {"stem": wr.SOURCE, "name": "wgmma_rate_v1_pv", "options": loader.SM90A_OPTIONS,
                    "max_smem": wr.SMEM, "grid": (5,), "block": (256,), "smem": wr.SMEM}
