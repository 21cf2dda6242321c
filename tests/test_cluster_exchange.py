"""kernels/cluster_exchange/v1.cu and its suite: the expected sums against a plain loop here; on the GPU every
mode's accumulators equal them (the exchange really moves each tile's partial between the two CTAs)."""

from __future__ import annotations

import numpy as np
import pytest

from kdlib.cuda import loader
from kdlib.perf.suites import cluster_exchange as ce


def test_expected_is_the_sum_of_the_parts_over_the_tiles():
    tiles = 5
    for mode in ce.MODES:
        for rank in (0, 1):
            want = np.zeros(4 * ce.VEC)
            for t in range(tiles):
                for e in range(4 * ce.VEC):
                    own, other = (e + 7 * t + 3 * rank) % 13, (e + 7 * t + 3 * (1 - rank)) % 13
                    want[e] += own + {"peer": other, "async": other, "local": own, "none": 0}[mode]
            np.testing.assert_array_equal(ce.expected(mode, tiles, rank), want)
    with pytest.raises(ValueError, match="mode"):
        ce.expected("remote", 1, 0)


def test_constants_size_one_tile_of_72_rows_and_two_buffers():
    c = loader.source_constants(ce.SOURCE)
    assert c["EX_KEYS"] * c["EX_ROWS"] * 4 == ce.VEC * 16 == 18_432
    assert ce.BUF_BYTES == 2 * ce.VEC * 16 + 4 * 8 <= ce.SMEM  # two buffers, four mbarriers
    assert c["EX_PER_THREAD"] * ce.THREADS >= ce.VEC


def test_launch_refuses_bad_arguments_before_compiling():
    for kw in ({"mode": "remote"}, {"grid": 3}, {"grid": 0}):
        args = {"mode": "peer", "tiles": 4, "grid": 2} | kw
        with pytest.raises(ValueError):
            ce.launch(**args, out=np.zeros((args["grid"], 4 * ce.VEC)), cycles=np.zeros(args["grid"]))
    with pytest.raises(ValueError, match="out"):
        ce.launch("peer", 4, 2, np.zeros((2, 3)), np.zeros(2))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ce.MODES)
def test_each_mode_accumulates_the_expected_sums(mode):
    """Two clusters, an odd number of tiles (both buffers, the last one once more): every CTA's accumulators
    are its rank's expected sums, and its cycle count is positive."""
    import cupy

    grid, tiles = 4, 37
    out = cupy.full((grid, 4 * ce.VEC), -1, dtype=cupy.float32)
    cycles = cupy.zeros(grid, dtype=cupy.int64)
    ce.launch(mode, tiles, grid, out, cycles)
    got = cupy.asnumpy(out)
    for b in range(grid):
        np.testing.assert_array_equal(got[b], ce.expected(mode, tiles, b % 2), err_msg=f"CTA {b}")
    assert (cupy.asnumpy(cycles) > 0).all()


@pytest.mark.gpu
def test_the_quick_suite_is_exact_in_every_mode():
    doc = ce.run(quick=True)
    assert [r["mode"] for r in doc["rows"]] == list(ce.MODES)
    assert all(r["exact"] and r["us_per_tile"] > 0 and r["cycles_per_tile"]["min"] > 0 for r in doc["rows"])


@pytest.mark.gpu
def test_max_active_clusters_counts_pairs_the_device_holds():
    """loader.max_active_clusters of the probe's kernel: at most one pair per two SMs where a CTA fills an
    SM's shared memory (SMEM), at least one; with a quarter of that memory a CTA, more pairs than SMs / 2
    are resident (several CTAs an SM): the count follows the launch's shared memory."""
    import cupy

    fn = loader.get_function(ce.SOURCE, "cluster_exchange_v1_peer")
    loader.set_max_dynamic_shared(fn, ce.SMEM)
    sms = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["multiProcessorCount"]
    full = loader.max_active_clusters(fn, 2, ce.THREADS, ce.SMEM)
    assert 1 <= full <= sms // 2
    assert loader.max_active_clusters(fn, 2, ce.THREADS, ce.SMEM // 4) > full
