"""Embedding gather on the GPU (kernels_ptx/embedding.ptx) vs ops.embedding's reference."""

import numpy as np
import pytest

from fermijit.ops import embedding
from tests.gpu import MARKS
from tests.numerics import assert_close, poisoned
from tests.ops.test_embedding import DTYPES, EXACT, SHAPES, make_inputs

pytestmark = MARKS


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_gpu_matches_reference(rng, shape, dtype):
    ids, table = make_inputs(rng, *shape, dtype)
    out = poisoned((ids.size, table.shape[1]))
    actual = embedding.gpu(ids, table, out=out)
    assert actual is out
    assert_close("y", embedding.reference(ids, table), actual, atol=EXACT, rtol=EXACT)


def test_device_table_gives_device_result(rng):
    from fermijit.jit import gpu

    ids, table = make_inputs(rng, 37, 50, 100, np.float16)
    actual = embedding.gpu(ids, gpu.to_device("test", "table", table, table.dtype))
    assert gpu.is_device(actual)
    assert_close("y", embedding.reference(ids, table), actual.get(), atol=EXACT, rtol=EXACT)
