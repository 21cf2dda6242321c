"""kdlib.check: the verdict printers every comparison ends in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdlib import check


def test_torch_bfloat16_compares_and_complex_is_refused():
    """bfloat16 tensors (numpy has no such dtype: a TypeError before) compare as float32; complex input is
    refused (the imaginary part was dropped, so 1+5j passed as 1)."""
    e = check.assert_close(torch.tensor([1.0, 2.0], dtype=torch.bfloat16), np.array([1.0, 2.0]), rtol=0,
                           quiet=True)
    assert e["max_abs"] == 0
    with pytest.raises(AssertionError, match="FAIL"):
        check.assert_close(torch.tensor([1.0, 3.0], dtype=torch.bfloat16), [1.0, 2.0], rtol=1e-3, quiet=True)
    with pytest.raises(ValueError, match="real arrays"):
        check.assert_close(np.array([1 + 5j]), np.array([1 + 0j]), rtol=1e-9, quiet=True)


def test_nan_never_passes_and_a_zero_reference_is_absolute():
    with pytest.raises(AssertionError, match="NaN"):
        check.assert_close([np.nan], [np.nan], rtol=1.0, quiet=True)
    e = check.errors([1e-6, 0.0], [0.0, 0.0])
    assert e["norm_rel"] == e["max_abs"] == pytest.approx(1e-6)



def test_assert_equal_tells_types_apart_that_widen_alike():
    """bfloat16 and float8 are widened to float32 to reach numpy; the dtype check came after, so a bfloat16
    tensor passed as bit-exact against the float32 one with its values, and e4m3fn against e5m2."""
    bf = torch.tensor([1.0, 2.5], dtype=torch.bfloat16)
    check.assert_equal(bf, bf.clone(), quiet=True)
    with pytest.raises(AssertionError, match="dtype bfloat16 vs float32"):
        check.assert_equal(bf, torch.tensor([1.0, 2.5]), quiet=True)
    with pytest.raises(AssertionError, match="dtype float8_e4m3fn vs float8_e5m2"):
        check.assert_equal(bf.to(torch.float8_e4m3fn), bf.to(torch.float8_e5m2), quiet=True)
    with pytest.raises(AssertionError, match="dtype float32 vs bfloat16"):
        check.assert_equal(np.array([1.0, 2.5], np.float32), bf, quiet=True)
    check.assert_equal(torch.arange(3), np.arange(3, dtype=np.int64), quiet=True)
    # one type on both sides, widened on one only (torch bf16 vs ml_dtypes bf16): compared, not a crash
    ml_dtypes = pytest.importorskip("ml_dtypes")
    check.assert_equal(bf, np.array([1.0, 2.5], ml_dtypes.bfloat16), quiet=True)
    with pytest.raises(AssertionError, match="differing bytes"):
        check.assert_equal(bf, np.array([1.0, 3.0], ml_dtypes.bfloat16), quiet=True)
