"""kernels/gather_read/stage_v1.cu and tools/gather_stage.py: the expected rotated XOR against a plain loop
here, and that it sees a chunk out of place; what each arm folds into each CTA rank's out; --arms and the
launch's argument checks; loader.tensor_map_2d's argument checks; on the GPU every arm (each CTA alone, and
the pair arms, two CTAs of a cluster that both read every tile, one of them pushing its half into the other)
lands every row of every tile in the verify's swizzled stage layout (each rank's XOR is the host's) at row
counts short of a tile, of the CTAs' first round and past many rounds, on one CTA pair and on the grid the
tool runs."""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest

from kdlib import ROOT
from kdlib.cuda import loader

sys.path.insert(0, str(ROOT / "tools"))
import gather_stage as gs  # noqa: E402


def _rotl(w: int, r: int) -> int:
    return ((w << r) | (w >> (32 - r))) & 0xFFFFFFFF if r else w


def test_expected_xor_rotates_each_chunk_by_its_place_in_the_row():
    rng = np.random.default_rng(1)
    pool = rng.integers(0, 2**32, size=(9, gs.ROW_WORDS), dtype=np.uint32)  # [slots, 288]
    for rows in ([3, 3, 5, 0, 5, 5, 8], [2, 2], list(range(9))):
        rows = np.array(rows, np.int32)
        want = [0, 0, 0, 0]
        for r in rows:
            for q in range(gs.CHUNKS):
                for k in range(4):
                    want[k] ^= _rotl(int(pool[r, 4 * q + k]), q % 32)
        np.testing.assert_array_equal(gs.expected_xor(pool, rows), np.array(want, np.uint32))


def test_expected_xor_changes_where_two_chunks_of_a_row_swap():
    """A stage whose swizzle put chunk 1 of a row where chunk 0 belongs, and back, reads to another XOR."""
    rng = np.random.default_rng(2)
    pool = rng.integers(0, 2**32, size=(4, gs.ROW_WORDS), dtype=np.uint32)
    swapped = pool.copy()
    swapped[2, 0:4], swapped[2, 4:8] = pool[2, 4:8], pool[2, 0:4]
    rows = np.array([0, 2, 3], np.int32)
    assert (gs.expected_xor(pool, rows) != gs.expected_xor(swapped, rows)).any()


def test_each_rank_expects_the_rows_xor_and_rank_1_only_in_the_pair_arms():
    rng = np.random.default_rng(3)
    pool = rng.integers(0, 2**32, size=(5, gs.ROW_WORDS), dtype=np.uint32)
    rows = np.array([4, 1, 1, 0], np.int32)
    want = gs.expected_xor(pool, rows)
    assert want.any()
    for arm in gs.ARMS:
        got = gs.expected_out(pool, rows, arm)
        np.testing.assert_array_equal(got[0], want)
        np.testing.assert_array_equal(got[1], want if arm in gs.PAIR_ARMS else 0)


def test_arms_option_keeps_the_tools_order_and_refuses_unknown_arms():
    assert gs.arm_list("push, cp16,dup") == ("cp16", "dup", "push")
    for text in ("", "cp16,bulk", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="subset of cp16, tma, dup, push"):
            gs.arm_list(text)


def test_launch_and_tensor_map_refuse_bad_arguments_before_the_driver():
    for arm, grid in (("bulk", 2), ("tma", 0), ("cp16", -1), ("push", 3), ("dup", 0)):
        with pytest.raises(ValueError):
            gs.launch(arm, None, None, np.zeros(4, np.int32), None, grid)
    for kw, says in (({"dtype": "int8"}, "dtype must be one of"), ({"swizzle": 16}, "swizzle must be one of"),
                     ({"rows": 0}, "rows must be positive"), ({"box_cols": 0}, "box_cols must be positive")):
        args = {"ptr": 0, "dtype": "bfloat16", "rows": 8, "cols": 576, "row_bytes": 1152, "box_rows": 1,
                "box_cols": 64, "swizzle": 128, **kw}
        with pytest.raises(ValueError, match=says):
            loader.tensor_map_2d(**args)


@pytest.mark.gpu
def test_tensor_map_names_the_driver_call_it_failed():
    """A row stride that is not a multiple of 16 bytes: the driver refuses it; the error names the call."""
    import cupy

    pool = cupy.zeros((8, gs.ROW_WORDS), cupy.uint32)
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled failed"):
        loader.tensor_map_2d(pool.data.ptr, "bfloat16", 8, 576, 1150, 1, 64, swizzle=128)


@pytest.mark.gpu
@pytest.mark.parametrize("arm", gs.ARMS)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 2 * 64 * 3 + 17, 50_001])
def test_every_row_lands_in_the_swizzled_stage(arm, n):
    import cupy

    rng = np.random.default_rng(n)
    pool_h = rng.integers(0, 2**32, size=(997, gs.ROW_WORDS), dtype=np.uint32)
    rows_h = rng.integers(0, 997, size=n, dtype=np.int32)
    want = gs.expected_out(pool_h, rows_h, arm)
    pool, rows = cupy.asarray(pool_h), cupy.asarray(rows_h)
    tmap = gs.pool_map(pool)
    held = (2 * loader.max_active_clusters(gs.kernel(arm), 2, gs.THREADS, gs.SMEM) if arm in gs.PAIR_ARMS
            else cupy.cuda.Device().attributes["MultiProcessorCount"])
    for grid in (2, held):
        out = cupy.zeros((2, 4), dtype=cupy.uint32)
        gs.launch(arm, pool, tmap, rows, out, grid)
        np.testing.assert_array_equal(cupy.asnumpy(out), want, err_msg=f"grid {grid}")
