"""The attention_bounds suite's parts: sequential tables, the probe's host XOR, the padded FLOPs, the staged
bytes, the blocks an SM holds and the loader's extra options on the CPU; the gather probe against that XOR on
the GPU (every arm, row counts from one to one no warp multiple divides) and the attend kernel's probe builds
(loaded inside the block, the default after it)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kdlib.cuda import loader
from kdlib.perf.suites import attention as suite
from kdlib.perf.suites import attention_bounds as bounds


def _point(pool):
    p = {"heads": 4, "queries": 9, "batch": 3, "lens": [5, 70, 33], "trees": [9, 4, 1]}
    return suite.point_inputs(p, pool)


def test_sequential_tables_keep_each_requests_slots_in_key_order():
    pool = torch.randn(108, suite.D_QK, generator=torch.Generator().manual_seed(1)).bfloat16()  # [N, 576]
    x = _point(pool)
    seq = bounds.sequential_tables(x["tables"], x["lens"])
    assert len(seq) == len(x["tables"])
    for pt, sq in zip(x["tables"], seq, strict=True):
        assert sq.shape == pt.shape and sq.dtype == torch.int32
        for b, n in enumerate(x["lens"]):
            assert sorted(pt[b, :n].tolist()) == sq[b, :n].tolist(), "same slots, key order"
            assert (sq[b, n:] == 0).all()


def test_gather_rows_flattens_the_prefix_rows_request_by_request():
    pool = torch.randn(108, suite.D_QK, generator=torch.Generator().manual_seed(2)).bfloat16()  # [N, 576]
    x = _point(pool)
    flat = bounds.gather_rows(x["tables"], x["lens"])[0]
    pt = x["tables"][0]
    assert flat.tolist() == pt[0, :5].tolist() + pt[1, :70].tolist() + pt[2, :33].tolist()


def test_verify_call_passes_the_point_inputs_and_the_version(monkeypatch):
    """attention.verify_call (the suites' and tools/kernel_ab.py's verify of one point): every input of the
    point, the page table given, validation off unless asked, the workspace and the version pick."""
    from kdlib.cuda import attention as cu

    seen = []
    monkeypatch.setattr(cu, "tree_verify_attention", lambda *a, **kw: seen.append((a, kw)) or ("out", "lse"))
    pool = torch.randn(108, suite.D_QK, generator=torch.Generator().manual_seed(4)).bfloat16()  # [N, 576]
    x = _point(pool)
    call = suite.verify_call(x, pool, "ws", version=8)
    assert call(x["tables"][0]) == ("out", "lse")
    call("pt", validate=True)
    suite.verify_call(x, pool, None, impl="wgmma_v7")("pt")
    (a, kw), (a2, kw2), (_, kw3) = seen
    assert a[0] is x["q"] and a[1] is pool and a[2] is x["tables"][0]
    assert a[3:] == (x["lens_t"], x["tkv"], x["vis"], x["sizes_t"], x["scale"]) and a2[2] == "pt"
    assert kw == {"validate": False, "workspace": "ws", "version": 8} and kw2["validate"] is True
    assert kw3 == {"validate": False, "workspace": None, "impl": "wgmma_v7"}


def test_xor_rows_is_the_xor_of_every_word_by_lane():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=(10, 288), dtype=np.uint32)  # [slots, 288]
    rows = np.array([3, 3, 7, 0])
    want = np.zeros(4, dtype=np.uint32)
    for r in rows:
        for i in range(288):
            want[i % 4] ^= words[r, i]
    np.testing.assert_array_equal(bounds.xor_rows(words, rows), want)
    assert not bounds.xor_rows(words, np.array([5, 5])).any(), "a row read twice cancels"


def test_padded_flops_round_rows_up_to_jobs_of_64():
    per_key = 2.0 * (suite.D_QK + suite.D_V)
    assert bounds.padded_flops(8, 1, [100]) == 64 * 100 * per_key
    assert bounds.padded_flops(8, 9, [100, 10]) == 128 * 110 * per_key
    assert bounds.padded_flops(64, 65, [1]) == 4160 * per_key  # 4160 rows are 65 jobs exactly


def test_staged_bytes_read_each_row_once_per_row_block_and_attend_us_sums_the_attend_kernels():
    assert bounds.staged_bytes(8, 1, [100]) == 100 * bounds.ROW_BYTES
    assert bounds.staged_bytes(8, 65, [100, 7]) == 9 * 107 * bounds.ROW_BYTES  # 520 rows: 9 row blocks
    assert bounds.staged_bytes(64, 65, [5]) == 65 * 5 * bounds.ROW_BYTES
    kernels = [{"name": "tree_verify_v10_plan", "us": 5.0}, {"name": "tree_verify_v10_attend", "us": 40.0},
               {"name": "tree_verify_v10_attend_t", "us": 2.5},
               {"name": "tree_verify_v8_combine_w8", "us": 3.0}]
    assert bounds.attend_us(kernels) == 42.5


@pytest.mark.parametrize("before", [None, "-lineinfo"])
def test_extra_options_reach_every_compile_inside_the_block_and_leave_nothing_behind(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("KDLIB_NVRTC_OPTIONS", raising=False)
    else:
        monkeypatch.setenv("KDLIB_NVRTC_OPTIONS", before)
    loader._MODULES["stale"] = loader._FUNCTIONS["stale"] = object()
    with pytest.raises(RuntimeError, match="inside"):
        with loader.extra_options("-DTV7_PROBE=1"):
            assert os.environ["KDLIB_NVRTC_OPTIONS"] == " ".join(filter(None, [before, "-DTV7_PROBE=1"]))
            assert "stale" not in loader._MODULES and "stale" not in loader._FUNCTIONS
            loader._MODULES["probe"] = object()
            raise RuntimeError("inside")
    assert os.environ.get("KDLIB_NVRTC_OPTIONS") == before
    assert "probe" not in loader._MODULES, "a probe build outlived its block"


def test_blocks_per_sm_by_registers_threads_and_shared_memory():
    assert bounds.blocks_per_sm(32, 256, 0) == 8  # threads bind
    assert bounds.blocks_per_sm(120, 256, 0) == 2  # 120 -> 128 registers a thread: 32k a block
    assert bounds.blocks_per_sm(56, 128, bounds.BULK_SMEM) == 3  # shared memory binds
    assert bounds.blocks_per_sm(255, 1024, 0) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("arm", bounds.ARMS)
def test_gather_probe_reads_every_row_exactly(arm):
    g = torch.Generator(device="cuda").manual_seed(bounds.ARMS.index(arm))
    pool = torch.randn(5000, suite.D_QK, device="cuda", generator=g).bfloat16()  # [N, 576]
    for n in (1, 31, 4099):
        rows = torch.randint(0, 5000, (n,), device="cuda", generator=g, dtype=torch.int32)  # [n]
        got = bounds.gather(pool, rows, arm).get()
        want = bounds.xor_rows(pool.view(torch.int32).cpu().numpy().view(np.uint32), rows.cpu().numpy())
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_attend_probe_builds_load_inside_the_block_and_the_default_after():
    """The probes the suite times are the builds it asks for: probe 2's consumers read stale stage rows (the
    output moves), probe 1's write no partials (the combine reads the NaN left in them), and after the blocks
    the default build gives the first output bit for bit. Long prefixes: every CTA runs several pairs."""
    import cupy

    from kdlib.cuda import attention as cu

    p = {"heads": 8, "queries": 9, "batch": 2, "lens": [40_000, 60_000], "trees": [9, 9]}  # no padding row
    pool = torch.randn(suite.pool_rows([p]), suite.D_QK, device="cuda",
                       generator=torch.Generator(device="cuda").manual_seed(11)).bfloat16()  # [N, 576]
    x = suite.point_inputs(p, pool)
    assert cu.v9_options(p["heads"] * p["queries"]) is None, "v7's consumers, the ones the probes build"
    ws = cu.make_workspace(p["batch"], p["queries"], p["heads"])
    call, pt = suite.verify_call(x, pool, ws), x["tables"][0]
    want = call(pt)[0].copy()
    with loader.extra_options(bounds.PROBES["consumers"]):
        stale = call(pt)[0].copy()
    ws.parts.fill(float("nan"))
    with loader.extra_options(bounds.PROBES["gathers"]):
        unwritten = call(pt)[0].copy()
    again = call(pt)[0]
    assert bool(cupy.isfinite(want).all()) and not bool(cupy.array_equal(stale, want))
    assert bool(cupy.isnan(unwritten).all())
    assert bool(cupy.array_equal(again, want))
