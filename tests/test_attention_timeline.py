"""The attention_timeline suite's parts: its reading of a trace (steady pairs, stretches, period) on synthetic
stamps, its event names against the kernel's marks, and on the GPU the traced build itself: the shipped
build's bits, every pair's stamps in program order."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kdlib import ROOT
from kdlib.perf.suites import attention_timeline as tl

# cycles from a pair's top to each of its stamps, per consumer; the pair's period
OFFSETS = {0: [0, 300, 1500, 1900, 2600, 2700, 2800, 3500, 3500], 1: [10, 320, 1550, 1950, 2300, 2400, 2650,
                                                                        3400, 3410]}
PERIOD = 3600


def synthetic(ctas: int = 3, pairs: int = 11, job_pairs: int = 4, first_gap: int = 9000) -> np.ndarray:
    """A trace of `ctas` CTAs whose consumers stamp OFFSETS every PERIOD cycles; jobs of `job_pairs` pairs
    whose first pair takes first_gap cycles instead (so that counting it would move the medians)."""
    t = np.zeros((tl.CTAS, 2, tl.PAIRS, tl.SLOTS), dtype=np.uint64)  # [CTAS, 2, PAIRS, SLOTS]
    for b in range(ctas):
        top = 1000 + 77 * b
        for n in range(pairs):
            first, last = n % job_pairs == 0, n % job_pairs == job_pairs - 1
            for c in (0, 1):
                t[b, c, n, :tl.NEVENTS] = [top + o for o in OFFSETS[c]]
                t[b, c, n, tl.NEVENTS] = n // job_pairs
                t[b, c, n, tl.NEVENTS + 1] = (tl.D_FIRST if first else 0) | (tl.D_LAST if last else 0)
            top += first_gap if first else PERIOD
    return t


def test_steady_pairs_skip_each_ctas_first_two_job_edges_and_the_last_stamped_pair():
    t = synthetic()
    keep = tl.steady(t)
    # pairs 0..10, jobs of 4: the middle ones 1, 2, 5, 6, 9, 10; 1 is among the first two; 10 has no next top
    assert [int(n) for n in np.flatnonzero(keep[0, 0])] == [2, 5, 6, 9]
    assert not keep[3:].any(), "CTAs that stamped nothing"


def test_summarize_recovers_the_stretches_and_the_period():
    got = tl.summarize(synthetic())
    assert got["period"]["median"] == got["period"]["p10"] == got["period"]["p90"] == PERIOD
    assert got["steady_pairs"] == 3 * 4
    for c in (0, 1):
        seg = got["segments"][f"consumer {c}"]
        want = np.diff(OFFSETS[c] + [PERIOD + OFFSETS[c][0]]).tolist()
        assert list(seg.values()) == want
        assert sum(seg.values()) == PERIOD, "the stretches tile the loop, top to top"
    assert got["floor_cycles"] == tl.pair_flops() / tl.TENSOR_FLOPS_PER_CLOCK == 4352
    assert got["floor_fraction"] == pytest.approx(4352 / PERIOD)


def test_pair_smem_model_counts_each_operand_once():
    """The shared-memory model of a pair, by hand: S 2 consumers x 36 wgmmas x (Q 64 x 16 + K 64 x 16) bf16;
    P V 2 tiles x 2 halves x 4 wgmmas x (P 64 x 16 + V 16 x 256) bf16; two 64-key tiles of 576 dims gathered;
    two 64 x 64 P tiles stored."""
    got = tl.pair_smem_bytes()
    assert got == {"S operands": 2 * 36 * 4096, "P V operands": 2 * 2 * 4 * 10_240, "gathers": 2 * 64 * 1152,
                   "P stores": 2 * 8192}
    assert sum(got.values()) == 622_592 and tl.smem_cycles() == 622_592 / 128 == 4864


def test_summarize_refuses_a_trace_without_steady_pairs():
    with pytest.raises(ValueError, match="no steady pair"):
        tl.summarize(synthetic(job_pairs=2))  # every pair a job's first or last


def test_sample_counts_cycles_from_the_ctas_first_stamp():
    s = tl.sample(synthetic())
    assert s["consumer 0"][0] == OFFSETS[0] and s["consumer 1"][0] == OFFSETS[1]
    assert s["consumer 0"][1][0] == 9000, "the first pair of a job is the long one"
    assert len(s["consumer 0"]) == tl.SAMPLE_PAIRS


def test_warp_spread_is_first_to_last_warp_at_each_event():
    """Warp w stamps the top 3 w and S issued 5 w cycles after warp 0, every other event with it: the spread
    is the last warp's lag at those two events and 0 elsewhere, in both consumers."""
    lead = synthetic()  # [CTAS, 2, PAIRS, SLOTS]
    t = np.repeat(lead[:, :, None], tl.WARPS, axis=2)  # [CTAS, 2, WARPS, PAIRS, SLOTS]
    stamped = t[..., 0] > 0
    for w in range(tl.WARPS):
        t[:, :, w, :, 0] += np.where(stamped[:, :, w], 3 * w, 0).astype(np.uint64)
        t[:, :, w, :, 1] += np.where(stamped[:, :, w], 5 * w, 0).astype(np.uint64)
    got = tl.warp_spread(t)
    last = tl.WARPS - 1
    for c in (0, 1):
        spread = {name: v["median"] for name, v in got[f"consumer {c}"].items()}
        assert list(spread) == list(tl.EVENTS[c])
        assert spread == {name: 3 * last if e == 0 else 5 * last if e == 1 else 0
                          for e, name in enumerate(tl.EVENTS[c])}
        assert all(v["p90"] == v["median"] for v in got[f"consumer {c}"].values())
    t[:, 1, last] = 0  # consumer 1's last warp stamped nothing
    with pytest.raises(ValueError, match="consumer 1: no steady pair that all"):
        tl.warp_spread(t)


def test_segments_tile_each_consumers_loop_and_name_its_events():
    for c in (0, 1):
        edges = list(tl.SEGMENTS[c].values())
        assert edges[0][0] == 0 and edges[-1][1] is None
        assert all(a[1] == b[0] for a, b in zip(edges, edges[1:], strict=False))
        assert [a for a, _ in edges] == list(range(tl.NEVENTS)) == list(range(len(tl.EVENTS[c])))
        assert set(tl.SEGMENTS[c]) <= set(tl.KIND)


def test_the_kernel_marks_every_event_once_per_consumer_path():
    """wgmma_v7.cu's consumers: events 0-2 and 8 once, in the loop's shared path; 3-7 once in each consumer's
    branch (the nvcc test of the traced builds in test_kernels_compile.py counts what each build compiles)."""
    src = (ROOT / "kernels" / "tree_verify" / "wgmma_v7.cu").read_text()
    # trace_mark's calls, and pv_own_tile's (its stamp between the wait and the releases)
    marks = [int(e) for e in re.findall(r"(?:trace_mark|pv_own_tile)\([^;]*?\bc, n, (\d+), wt\)", src)]
    assert sorted(set(marks)) == list(range(tl.NEVENTS))
    assert all(marks.count(e) == 1 for e in (0, 1, 2, 8)) and all(marks.count(e) == 2 for e in range(3, 8))


@pytest.mark.gpu
def test_traced_build_keeps_the_bits_and_stamps_in_program_order():
    import torch

    from kdlib.perf.suites import attention

    p = {"heads": 8, "queries": 65, "prefix": 16_384, "batch": 1}
    pool = torch.randn(attention.pool_rows([p]), attention.D_QK, device="cuda",
                       dtype=torch.bfloat16)  # [N, 576]
    row = tl.run_point(p, pool, iters=3)
    assert row["bitwise_equal"]
    assert row["steady_pairs"] > 0 and row["period"]["median"] > row["floor_cycles"] * 0.5
    assert all(v >= 0 for c in row["segments"].values() for v in c.values())
    for c in (0, 1):
        for stamps in row["sample"][f"consumer {c}"]:
            assert stamps == sorted(stamps), "a consumer's stamps follow its program order"
        spread = row["warp_spread"][f"consumer {c}"]
        assert list(spread) == list(tl.EVENTS[c])
        assert all(0 <= v["median"] <= v["p90"] for v in spread.values())
