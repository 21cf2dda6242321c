"""kdlib.cuda.seesaw: the numpy mirror of v7's consumers, in both orders, against float64 attention."""

import numpy as np
import pytest

from kdlib.cuda import seesaw
from kdlib.ref.fp8 import round_to_bf16

SCALE = 576**-0.5


def _inputs(rows: int, n: int, seed: int, rising: bool):
    """q [rows, 576] and keys [n, 576], bf16 values; rising: each tile's keys scaled up from the last, so that
    every tile moves the rows' running maxima and every factor of the online softmax counts."""
    rng = np.random.default_rng(seed)
    q = round_to_bf16(rng.standard_normal((rows, 576)))
    keys = rng.standard_normal((n, 576))
    if rising:
        keys *= (1 + 0.15 * (np.arange(n) // seesaw.BN))[:, None]
    return q, round_to_bf16(keys)


def _exact(q, keys):
    """float64 softmax attention -> out [rows, 512], lse [rows]."""
    s = q.astype(np.float64) @ keys.T.astype(np.float64) * SCALE  # [rows, n]
    mx = s.max(axis=1, keepdims=True)
    p = np.exp(s - mx)
    total = p.sum(axis=1)
    return p @ keys[:, :seesaw.D_V].astype(np.float64) / total[:, None], mx[:, 0] + np.log(total)


@pytest.mark.parametrize("order", seesaw.ORDERS)
@pytest.mark.parametrize("rows,n", [(64, 1000), (8, 64), (16, 200), (64, 129), (64, 5)])
def test_both_orders_are_the_softmax_with_p_in_fp32(order, rows, n):
    """Without P's bf16 rounding each order's factors give the exact softmax to fp32's precision, over odd
    tile counts (a last pair without tile B), partial tiles and maxima that rise every tile."""
    q, keys = _inputs(rows, n, seed=rows + n, rising=True)
    out, lse = seesaw.seesaw(q, keys, SCALE, order, bf16_p=False)
    want, want_lse = _exact(q, keys)
    assert out.shape == (rows, 512) and out.dtype == np.float32
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-5 * np.abs(want).max())
    np.testing.assert_allclose(lse, want_lse, rtol=2e-6)


@pytest.mark.parametrize("rows,n", [(64, 4096), (72, 333)])
def test_both_orders_with_bf16_p_stay_within_bf16s_error(rows, n):
    """With P rounded to bf16 before P V (the kernels' rule) both orders err alike against float64: about
    bf16's half ulp relative to the output's largest value, neither order more than 1.25 times the other's."""
    q, keys = _inputs(rows, n, seed=rows, rising=False)
    want, _ = _exact(q, keys)
    err = {}
    for order in seesaw.ORDERS:
        out, _ = seesaw.seesaw(q, keys, SCALE, order)
        err[order] = np.abs(out - want).max() / np.abs(want).max()
    assert all(1e-4 < e < 4e-3 for e in err.values()), err
    assert max(err.values()) < 1.25 * min(err.values()), err


def test_bad_order_and_shapes_are_refused():
    q, keys = _inputs(8, 64, seed=0, rising=False)
    with pytest.raises(ValueError, match="order must be one of"):
        seesaw.seesaw(q, keys, SCALE, "v9")
    with pytest.raises(ValueError, match=r"q \[rows, d\] and keys \[n, d\]"):
        seesaw.seesaw(q, keys[:, :500], SCALE)
    with pytest.raises(ValueError, match=r"q \[rows, d\] and keys \[n, d\]"):
        seesaw.seesaw(q[0], keys, SCALE)
