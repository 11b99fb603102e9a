"""widen.cpu: float16 -> float32 exactly, every bit pattern."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import widen
from tests.numerics import poisoned


@pytest.mark.parametrize("shape", [(65536,), (3, 7), (2, 1 << 16)], ids=["all-bits", "ragged",
                                                                         "parallel"])
def test_widen_is_exact(rng, shape):
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    if shape == (65536,):
        bits = np.arange(1 << 16, dtype=np.uint16)  # normals, subnormals, inf and NaNs
    x = bits.view(np.float16)
    out = poisoned(shape)
    widen.cpu(x, out=out)
    want = widen.reference(x)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_widen_passes_fp32_through_and_checks():
    a = np.ones(4, np.float32)
    assert widen.cpu(a) is a
    with pytest.raises(FermijitError, match="dtype"):
        widen.cpu(np.ones(4, np.float64))
