"""kdlib.hw: the shipped GPU table is complete, sourced and consistent."""

import json

import pytest

import kdlib.hw as hw
from kdlib.perf import results

EXPECTED = {"rtx-pro-6000", "h200", "b200", "b300"}


def test_all_gpus_shipped_with_full_schema():
    table = hw.all()
    assert EXPECTED <= set(table)
    for slug, spec in table.items():
        for key in hw.REQUIRED:
            assert key in spec, (slug, key)
        assert spec["slug"] == slug
        assert spec["interconnect"]["kind"] in ("nvlink", "pcie")
        for key in ("memory_bytes", "hbm_bandwidth_Bps", "bf16_dense_flops", "fp8_dense_flops", "sm_count"):
            assert key in spec["sources"] and spec["sources"][key].strip(), (slug, key)


def test_known_figures_match_reference_notes():
    # models-hardware.md §4: driver-reported MiB, bandwidth, scale-up kind.
    assert hw.load("rtx-pro-6000")["memory_bytes"] == 97_887 * 2**20
    assert hw.load("h200")["memory_bytes"] == 143_771 * 2**20
    assert hw.load("b300")["memory_bytes"] == 275_040 * 2**20
    assert hw.load("rtx-pro-6000")["hbm_bandwidth_Bps"] == 1.792e12
    assert hw.load("h200")["hbm_bandwidth_Bps"] == 4.8e12
    assert hw.load("rtx-pro-6000")["interconnect"]["kind"] == "pcie"
    assert hw.load("h200")["fp4_dense_flops"] is None
    assert hw.load("b300")["int8_dense_ops"] < hw.load("b200")["int8_dense_ops"]  # Blackwell Ultra cut INT8


def test_load_returns_a_copy():
    a = hw.load("h200")
    a["memory_bytes"] = 1
    assert hw.load("h200")["memory_bytes"] != 1


def test_unknown_slug_lists_known():
    with pytest.raises(ValueError, match="h200"):
        hw.load("h100-typo")
    with pytest.raises(ValueError):
        hw.measured("nope")


def test_measured_reads_ceilings(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(results, "ROOT", tmp_path)
    assert hw.measured("h200") is None
    doc = {"suite": "ceilings", "provenance": {"gpu": "NVIDIA H200"}, "copy_bandwidth_Bps": 4.1e12}
    (tmp_path / "ceilings.rtx-pro-6000-blackwell-server-edition.json").write_text(json.dumps(doc))
    got = hw.measured("rtx-pro-6000")
    assert got is not None and got["copy_bandwidth_Bps"] == 4.1e12
    assert hw.measured("h200") is None


def test_bad_file_is_rejected(tmp_path, monkeypatch):
    spec = hw.load("h200")
    del spec["sm_count"]
    (tmp_path / "h200.json").write_text(json.dumps(spec))
    monkeypatch.setattr(hw, "HW_DIR", tmp_path)
    hw._table.cache_clear()
    try:
        with pytest.raises(ValueError, match="sm_count"):
            hw.all()
    finally:
        hw._table.cache_clear()


@pytest.mark.parametrize("field,value,message", [
    ("sm_count", -1, "sm_count must be a positive int"),
    ("sm_count", 132.5, "sm_count must be a positive int"),
    ("fp4_dense_flops", "lots", "fp4_dense_flops must be None or a positive number"),
    ("hbm_bandwidth_Bps", float("inf"), "hbm_bandwidth_Bps must be a positive number"),
    ("interconnect", {"kind": "nvlink", "bandwidth_Bps_per_direction": 0, "latency_s": None},
     "bandwidth_Bps_per_direction must be a positive number"),
    ("interconnect", {"kind": "nvlink", "bandwidth_Bps_per_direction": 1e11, "latency_s": -1e-6},
     "latency_s must be None or a positive number"),
])
def test_a_field_of_the_wrong_kind_is_rejected_at_load(tmp_path, monkeypatch, field, value, message):
    """Fields the schema names but did not check loaded as given (-1 SMs, 'lots' of FP4 FLOP/s, a link of
    no bandwidth, caught only where the estimator used it)."""
    spec = hw.load("h200") | {field: value}
    (tmp_path / "h200.json").write_text(json.dumps(spec))
    monkeypatch.setattr(hw, "HW_DIR", tmp_path)
    hw._table.cache_clear()
    try:
        with pytest.raises(ValueError, match=message):
            hw.all()
    finally:
        hw._table.cache_clear()
