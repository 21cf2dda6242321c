"""Comparisons that print a verdict and raise on failure: the last step of every check.

    err = assert_close(out, ref, rtol=1e-5, name="tree_verify fp32")   # prints 'PASS tree_verify fp32: ...'
    assert_equal(gpu_tree.parents, ref_tree.parents, name="parents")     # bit-exact, dtype and shape too

Errors are relative to the reference's norm (‖a − b‖ / ‖b‖; the absolute norm ‖a − b‖ where the
reference is all zero) and element-wise (max |a − b|); NaN anywhere fails. Real values only (torch
bfloat16 / float8 are widened to float32 first); complex input is a ValueError.
"""

from __future__ import annotations

import numpy as np


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch; numpy has no bfloat16 / float8, so those widen to float32 first
        x = x.detach().cpu()
        numpy_float = str(x.dtype) in ("torch.float16", "torch.float32", "torch.float64")
        x = (x.float() if x.is_floating_point() and not numpy_float else x).numpy()
    elif hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        x = x.get()
    return np.asarray(x)


def errors(actual, expected) -> dict:
    """max abs error, max relative element error, and norm-relative error, computed in float64."""
    a, b = _to_numpy(actual), _to_numpy(expected)
    if np.iscomplexobj(a) or np.iscomplexobj(b):  # astype(float64) would drop the imaginary part
        raise ValueError("errors compares real arrays; compare the real and imaginary parts apart")
    a, b = a.astype(np.float64), b.astype(np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {a.shape} vs {b.shape}")
    diff = np.abs(a - b)
    norm_b = np.linalg.norm(b.ravel())
    return {
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "max_rel": float((diff / np.maximum(np.abs(b), 1e-300)).max()) if diff.size else 0.0,
        "norm_rel": float(np.linalg.norm(diff.ravel()) / norm_b)
        if norm_b > 0
        else float(np.linalg.norm(diff.ravel())),
        "nan": bool(np.isnan(a).any() or np.isnan(b).any()),
    }


def assert_close(
    actual, expected, *, rtol: float, atol: float = 0.0, name: str = "", quiet: bool = False
) -> dict:
    """Pass when ‖a − b‖ / ‖b‖ <= rtol, or max |a − b| <= atol when atol is given; NaN never passes."""
    e = errors(actual, expected)
    ok = not e["nan"] and (e["norm_rel"] <= rtol or (atol > 0 and e["max_abs"] <= atol))
    line = (
        f"{'PASS' if ok else 'FAIL'} {name}: norm-rel err {e['norm_rel']:.3e} (rtol {rtol:g}), "
        f"max abs err {e['max_abs']:.3e}"
        + (f" (atol {atol:g})" if atol else "")
        + (" NaN!" if e["nan"] else "")
    )
    if not quiet:
        print(line)
    if not ok:
        raise AssertionError(line)
    return e


def _dtype_name(x) -> str:
    """The dtype of torch, CuPy or numpy `x` as named before any widening (bfloat16 stays bfloat16)."""
    if hasattr(x, "detach"):
        return str(x.dtype).removeprefix("torch.")
    return np.dtype(x.dtype).name if hasattr(x, "dtype") else np.asarray(x).dtype.name


def assert_equal(actual, expected, *, name: str = "", quiet: bool = False) -> None:
    """Bit-exact: same shape, same dtype (torch bfloat16 / float8 compared as their own types, not as the
    float32 they are widened to), same bytes."""
    a, b = _to_numpy(actual), _to_numpy(expected)
    da, db = _dtype_name(actual), _dtype_name(expected)
    problems = []
    if a.shape != b.shape:
        problems.append(f"shape {a.shape} vs {b.shape}")
    elif da != db:
        problems.append(f"dtype {da} vs {db}")
    else:
        if a.dtype != b.dtype:  # one type, widened on one side only (torch against ml_dtypes bfloat16)
            a, b = a.astype(np.float32), b.astype(np.float32)
        if a.tobytes() != b.tobytes():
            bytes_a, bytes_b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
            bad = np.flatnonzero(bytes_a != bytes_b) if a.size else []
            problems.append(f"{len(bad)} differing bytes, first at byte {bad[0] if len(bad) else '?'}")
    line = f"{'PASS' if not problems else 'FAIL'} {name}: " + (
        "bit-exact" if not problems else "; ".join(problems)
    )
    if not quiet:
        print(line)
    if problems:
        raise AssertionError(line)
