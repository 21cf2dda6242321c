"""numpy mirror of the arithmetic of version 7's consumers (`kernels/tree_verify/wgmma_v7.cu`): the online
softmax over pairs of 64-key tiles, in the default order and in the order of the `-DTV7_MAXFIRST=1` build
(after FlashMLA's: tile A's maxima handed off before its exponentials, P_A c_B for the other half of O), which
measured slower than the default and was taken out after a470e0b (data/results/kernel_ab_maxfirst.h200.json).

Consumer 0 holds O's dims 0..255 (O_L) and consumer 1 dims 256..511 (O_R); consumer 0 takes tile A of a pair,
consumer 1 tile B; each keeps its own l. The mirror follows the kernels' factors and roundings where they are
chosen (P rounded to bf16 before P V, maxima in the log2 domain, a row with no key yet shifted by 0), not the
order in which the tensor cores add a product's terms: it shows what each order computes, not the kernels'
bits.

    out, lse = seesaw(q, keys, scale, order="maxfirst")  # q [rows, 576], keys [n, 576] -> [rows, 512], [rows]
"""

from __future__ import annotations

import numpy as np

from kdlib.ref.fp8 import round_to_bf16

BN = 64  # keys a tile
D_V = 512  # O's dims (the latent), split in halves between the consumers
ORDERS = ("v7", "maxfirst")
_LOG2E = np.float32(1.4426950408889634)
_LN2 = np.float32(0.6931471805599453)


def _shift(m: np.ndarray) -> np.ndarray:
    """The shift a row's exponentials take from its running maximum: 0 for a row with no key yet (-inf)."""
    return np.where(np.isneginf(m), np.float32(0), m).astype(np.float32)


def _tile(q: np.ndarray, keys: np.ndarray, sl2: np.float32):
    """S of one tile and its rows' maxima (log2 domain, as mask_tile's) -> s [rows, BN], mx [rows]."""
    s = (q @ keys.T).astype(np.float32)  # [rows, keys]
    if s.shape[1] < BN:  # keys past the end: masked
        s = np.concatenate([s, np.full((s.shape[0], BN - s.shape[1]), -np.inf, np.float32)], axis=1)
    return s, (s.max(axis=1) * sl2).astype(np.float32)


def _values(keys: np.ndarray) -> np.ndarray:
    """V of one tile: the keys' first 512 dims, rows past the end zero -> [BN, 512]."""
    return np.concatenate([keys[:, :D_V], np.zeros((BN - len(keys), D_V), np.float32)])


def _p(s: np.ndarray, sl2: np.float32, ms: np.ndarray) -> np.ndarray:
    """P = 2^(s sl2 - ms) row-wise, fp32 [rows, BN]."""
    return np.exp2((s * sl2 - ms[:, None]).astype(np.float32)).astype(np.float32)


def seesaw(q, keys, scale: float, order: str = "v7", bf16_p: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One job's attention as v7's two consumers compute it over tile pairs, in `order` ('v7', the default
    build's, or 'maxfirst', TV7_MAXFIRST's) -> out [rows, 512] float32, lse [rows] float32 (natural log).

    q [rows, 576] and keys [n, 576] (V: keys [:, :512]), float32; bf16_p False keeps P in fp32 before P V (the
    factors' algebra alone, without the rounding)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    q = np.asarray(q, dtype=np.float32)
    keys = np.asarray(keys, dtype=np.float32)
    if q.ndim != 2 or keys.ndim != 2 or q.shape[1] != keys.shape[1] or keys.shape[1] < D_V:
        raise ValueError(f"q [rows, d] and keys [n, d] with d >= {D_V}, got {q.shape} and {keys.shape}")
    rnd = round_to_bf16 if bf16_p else np.asarray
    rows, half = q.shape[0], D_V // 2
    sl2 = np.float32(scale) * _LOG2E
    m = np.full(rows, -np.inf, np.float32)  # the running maxima both consumers hold after a pair
    l0, l1 = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    o_l, o_r = np.zeros((rows, half), np.float32), np.zeros((rows, half), np.float32)
    zero = np.zeros((0, keys.shape[1]), np.float32)
    for k in range(0, keys.shape[0], 2 * BN):
        ka, kb = keys[k:k + BN], keys[k + BN:k + 2 * BN]
        kb = kb if len(kb) else zero
        va, vb = _values(ka), _values(kb)  # [BN, 512]
        s_a, mx_a = _tile(q, ka, sl2)
        s_b, mx_b = _tile(q, kb, sl2)
        m_a = np.maximum(m, mx_a)
        c_a = np.exp2(m - _shift(m_a)).astype(np.float32)
        p_a = _p(s_a, sl2, _shift(m_a))
        m_b = np.maximum(m_a, mx_b)
        c_b = np.exp2(m_a - _shift(m_b)).astype(np.float32)
        p_b = _p(s_b, sl2, _shift(m_b))
        # consumer 0 (both orders): O_L = (O_L c_A + P_A V_AL) c_B + P_B V_BL; l_0 = (l_0 c_A + sum P_A) c_B
        l0 = (l0 * c_a + p_a.sum(axis=1)) * c_b
        o_l = (o_l * c_a[:, None] + rnd(p_a) @ va[:, :half]) * c_b[:, None] + rnd(p_b) @ vb[:, :half]
        if order == "v7":  # consumer 1: O_R = (O_R c_A + P_A V_AR) c_B + P_B V_BR
            l1 = l1 * c_a * c_b + p_b.sum(axis=1)
            o_r = (o_r * c_a[:, None] + rnd(p_a) @ va[:, half:]) * c_b[:, None] + rnd(p_b) @ vb[:, half:]
        else:  # consumer 1: O_R = O_R 2^(m - m_B) + (P_A c_B) V_AR + P_B V_BR
            c_ab = np.exp2(m - _shift(m_b)).astype(np.float32)
            l1 = l1 * c_ab + p_b.sum(axis=1)
            o_r = o_r * c_ab[:, None] + rnd(p_a * c_b[:, None]) @ va[:, half:] + rnd(p_b) @ vb[:, half:]
        m = m_b
    lt = l0 + l1
    inv = np.where(lt > 0, 1 / np.where(lt > 0, lt, 1), 0).astype(np.float32)
    out = np.concatenate([o_l, o_r], axis=1) * inv[:, None]
    lse = np.where(lt > 0, (m + np.log2(np.where(lt > 0, lt, 1))) * _LN2, -np.inf).astype(np.float32)
    return out.astype(np.float32), lse
