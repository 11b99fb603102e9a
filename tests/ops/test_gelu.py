"""gelu.cpu against the numpy reference, both forms (MODEL.md §7)."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import gelu
from tests.numerics import assert_close, poisoned

# Both evaluate the same fp64 formula per element; cpu's erf/tanh are libm's, the reference's
# math.erf / np.tanh: a rounding of the fp32 result at most (measured 0.0).
ATOL, RTOL = 1e-7, 1e-6
SHAPES = {"scalar-ish": (1,), "ragged": (7, 33), "rows": (3, 5, 129)}


@pytest.mark.parametrize("form", gelu.FORMS)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_gelu(rng, form, shape):
    x = (4 * rng.standard_normal(shape)).astype(np.float32)
    out = poisoned(shape)
    gelu.cpu(x, form, out=out)
    assert_close(f"gelu {form}", gelu.reference(x, form), out, ATOL, RTOL)


def test_gelu_known_values():
    x = np.array([-3.0, 0.0, 1.0, 3.0], np.float32)
    # torch.nn.functional.gelu(x) and gelu(x, approximate="tanh")
    assert_close("exact", [-0.00404951, 0.0, 0.8413447, 2.9959507], gelu.cpu(x, "exact"), 1e-6, 0)
    assert_close("tanh", [-0.00363752, 0.0, 0.8411920, 2.9963627], gelu.cpu(x, "tanh"), 1e-6, 0)


def test_gelu_in_place_and_errors(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    want = gelu.reference(x, "tanh")
    assert gelu.cpu(x, "tanh", out=x) is x
    assert_close("in place", want, x, ATOL, RTOL)
    with pytest.raises(FermijitError, match="form must be"):
        gelu.cpu(x, "relu")
    with pytest.raises(FermijitError, match="dtype"):
        gelu.cpu(x.astype(np.float64), "exact")
