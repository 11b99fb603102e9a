"""GPU tests: `pytestmark = gpu.MARKS` marks a module `gpu` and skips it, with the reason, when
pycuda or a CUDA device is missing (DESIGN.md, Testing 3). The reason is found once per run."""

import pytest

from fermijit.jit import gpu

REASON = gpu.unavailable_reason()
MARKS = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no GPU: {REASON}")]


def needs_gpu(test):
    """Decorator form of MARKS, for modules that mix GPU tests with argument-check tests."""
    for mark in MARKS:
        test = mark(test)
    return test


def report_error(name: str, expected, actual) -> None:
    """Print max|e - a| / max|e| for the GPU pass's log (pytest -rP shows it); the assertion is
    assert_close's, this only records how close the kernel came."""
    import numpy as np

    e = np.asarray(expected, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    scale = float(np.abs(e).max()) if e.size else 0.0
    err = float(np.abs(e - a).max()) / scale if scale else float(np.abs(e - a).max(initial=0))
    print(f"rel err {name}: {err:.3g}")
