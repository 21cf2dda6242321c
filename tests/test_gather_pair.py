"""kernels/gather_read/pair_v1.cu and tools/gather_pair.py: the expected XOR against a plain loop here; on the
GPU both arms deliver every row to both CTAs of each pair (each rank's XOR is the host's), the multicast arm
too, at any row count and on the grid the device holds."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kdlib import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import gather_pair as gp  # noqa: E402


def test_expected_xor_is_the_xor_of_every_row_read():
    rng = np.random.default_rng(1)
    pool = rng.integers(0, 2**32, size=(9, gp.ROW_WORDS), dtype=np.uint32)  # [slots, 288]
    for rows in ([3, 3, 5, 0, 5, 5, 8], [2, 2], list(range(9))):
        rows = np.array(rows, np.int32)
        want = np.zeros(4, np.uint32)
        for r in rows:
            for c in range(gp.ROW_WORDS // 4):
                want ^= pool[r, 4 * c:4 * c + 4]
        np.testing.assert_array_equal(gp.expected_xor(pool, rows), want)


def test_launch_refuses_bad_arguments_before_compiling():
    for arm, grid in (("tma", 2), ("dup", 3), ("mcast", 0)):
        with pytest.raises(ValueError):
            gp.launch(arm, None, np.zeros(4, np.int32), None, grid)


@pytest.mark.gpu
@pytest.mark.parametrize("arm", gp.ARMS)
@pytest.mark.parametrize("n", [1, 7, 4 * 4 * 2 * 4 + 3, 50_001])
def test_each_rank_receives_every_row(arm, n):
    """Row counts short of one group, of a warp's ring, past a pair's rings and many rounds of them, on two
    pairs and on the pairs the device holds: both ranks' XORs are the host's."""
    import cupy

    rng = np.random.default_rng(n)
    pool_h = rng.integers(0, 2**32, size=(997, gp.ROW_WORDS), dtype=np.uint32)
    rows_h = rng.integers(0, 997, size=n, dtype=np.int32)
    want = gp.expected_xor(pool_h, rows_h)
    pool, rows = cupy.asarray(pool_h), cupy.asarray(rows_h)
    for grid in (4, gp.pairs_held(arm)):
        out = cupy.zeros((2, 4), dtype=cupy.uint32)
        gp.launch(arm, pool, rows, out, grid)
        got = cupy.asnumpy(out)
        np.testing.assert_array_equal(got[0], want, err_msg=f"rank 0, grid {grid}")
        np.testing.assert_array_equal(got[1], want, err_msg=f"rank 1, grid {grid}")
