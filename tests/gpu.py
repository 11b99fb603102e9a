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
