"""layer_norm.cpu against the float64 reference (the vision tower's LayerNorm)."""

import numpy as np
import pytest

from fermijit.ops import layer_norm
from tests.numerics import assert_close

# fp64 statistics, the scaling in fp32: a few ulps of |y| (~5 for unit rows, with offset means).
ATOL, RTOL = 1e-5, 1e-5
SHAPES = {"one-row": (1, 1152), "ragged": (37, 33), "batch": (2, 5, 64)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_layer_norm(rng, shape):
    x = (3 + 2 * rng.standard_normal(shape)).astype(np.float32)  # an offset mean: centring shows
    w = (1 + 0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    b = (0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    assert_close("layer_norm", layer_norm.reference(x, w, b, 1e-6),
                 layer_norm.cpu(x, w, b, 1e-6), ATOL, RTOL)


def test_layer_norm_of_a_constant_row_is_the_bias():
    x = np.full((2, 8), 5.0, np.float32)
    b = np.arange(8, dtype=np.float32)
    assert_close("constant row", np.tile(b, (2, 1)), layer_norm.cpu(x, np.ones(8, np.float32), b,
                                                                     1e-6), 0, 0)
