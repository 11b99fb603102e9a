"""The one comparison every numeric test uses (STYLE.md, Tests)."""

from __future__ import annotations

import numpy as np


def assert_close(name: str, expected, actual, atol: float, rtol: float) -> None:
    """Fail unless |e - a| <= atol + rtol*|e| for every element (NaN in `actual` always fails).

    The message names the quantity, the max abs error, the relative RMS error and the first bad
    indices, so a failure says where to look.
    """
    e = np.asarray(expected, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    assert e.shape == a.shape, f"{name}: shape {a.shape}, expected {e.shape}"
    err = np.abs(e - a)
    bad = ~(err <= atol + rtol * np.abs(e))  # NaN compares False, so it is bad
    if bad.any():
        finite = np.where(np.isfinite(err), err, np.inf)
        rel_rms = np.sqrt(np.mean(np.where(np.isfinite(err), err, 0) ** 2)
                          / max(np.mean(e ** 2), 1e-300))
        first = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)[:5]]
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.size} elements off (atol={atol:g}, rtol={rtol:g}); "
            f"max abs err {finite.max():.3g}, rel RMS err {rel_rms:.3g}; first bad {first}: "
            f"expected {[e[i] for i in first]}, got {[a[i] for i in first]}")


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    """An output buffer full of NaN, so an element a kernel forgets to write fails the test."""
    return np.full(shape, np.nan, dtype=dtype)
