"""Argument checks run before a kernel touches raw memory: a wrong shape, dtype or layout is a
one-line FermijitError naming the op and the shapes, never a segfault or a silent wrong answer."""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError


def check_array(op: str, name: str, a, dtype, shape: tuple | None = None,
                ndim: int | None = None, rows: bool = False) -> np.ndarray:
    """Return `a` if it is a C-contiguous, aligned ndarray of `dtype` matching `shape`; with
    `rows`, a 2-D array whose rows only need to be contiguous and apart (a row view, such as one
    half of the columns of a wider array).

    `shape` entries may be None (any size). Returns the array so calls can be chained. This runs
    on every decode call of every op, so the passing path is a handful of attribute reads.
    """
    if type(a) is not np.ndarray and not isinstance(a, np.ndarray):
        raise FermijitError(f"{op}: {name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise FermijitError(f"{op}: {name} has dtype {a.dtype}, expected {np.dtype(dtype)}")
    if shape is not None and a.shape != shape:
        ok = a.ndim == len(shape) and all(s is None or s == n for s, n in zip(shape, a.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise FermijitError(f"{op}: {name} has shape {list(a.shape)}, expected {want}")
    if ndim is not None and a.ndim != ndim:
        raise FermijitError(f"{op}: {name} must be {ndim}-D, got shape {list(a.shape)}")
    flags = a.flags
    if rows:
        if a.ndim != 2:
            raise FermijitError(f"{op}: {name} must be 2-D, got shape {list(a.shape)}")
        step, item = a.strides
        if not flags.aligned or item != a.itemsize or step < a.shape[1] * a.itemsize:
            raise FermijitError(f"{op}: {name}'s rows must be contiguous and apart (shape "
                                f"{list(a.shape)}, strides {list(a.strides)})")
    elif not (flags.c_contiguous and flags.aligned):
        raise FermijitError(f"{op}: {name} must be C-contiguous and aligned "
                            f"(shape {list(a.shape)}, strides {list(a.strides)})")
    return a


def output(op: str, out, shape: tuple, dtype=np.float32) -> np.ndarray:
    """`out` checked against `shape`/`dtype`, or a new array when `out` is None."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    check_array(op, "out", out, dtype, shape)
    if not out.flags.writeable:
        raise FermijitError(f"{op}: out is read-only")
    return out
