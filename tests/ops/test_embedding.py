"""Embedding gather on the CPU vs the reference; argument checks (shared with the GPU path)."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import embedding
from tests.numerics import assert_close, poisoned

# A gather copies values: fp16 -> fp32 widening is exact, so the result must be bit-equal.
EXACT = 0.0

# (T, V, H): one token (decode), ragged sizes, more tokens than the parallel threshold.
SHAPES = {"T1-V7-H64": (1, 7, 64), "T37-V50-H100": (37, 50, 100),
          "T300-V1000-H130": (300, 1000, 130)}
DTYPES = {"f32": np.float32, "f16": np.float16}


def make_inputs(rng, n_tokens, vocab, hidden, dtype):
    ids = rng.integers(0, vocab, n_tokens).astype(np.int32)
    table = rng.standard_normal((vocab, hidden)).astype(dtype)
    return ids, table


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_cpu_matches_reference(rng, shape, dtype):
    ids, table = make_inputs(rng, *shape, dtype)
    out = poisoned((ids.size, table.shape[1]))
    actual = embedding.cpu(ids, table, out=out)
    assert actual is out
    assert_close("y", embedding.reference(ids, table), actual, atol=EXACT, rtol=EXACT)


def test_f16_subnormals_and_signs_are_exact():
    table = np.array([[0.0, -0.0, 6e-8, -6e-8, 65504.0, -1.5, 1e-5, 0.1]], np.float16)
    actual = embedding.cpu(np.zeros(2, np.int32), table)
    assert np.array_equal(actual.view(np.uint32), table.astype(np.float32)[[0, 0]].view(np.uint32))


BAD = {
    "id-out-of-range": lambda ids, t: (ids + t.shape[0], t),
    "negative-id": lambda ids, t: (ids - t.shape[0], t),
    "ids-int64": lambda ids, t: (ids.astype(np.int64), t),
    "table-float64": lambda ids, t: (ids, t.astype(np.float64)),
    "table-1d": lambda ids, t: (ids, t[0].copy()),
    "table-not-contiguous": lambda ids, t: (ids, np.asfortranarray(t)),
}


@pytest.mark.parametrize("op", ["cpu", "gpu"])
@pytest.mark.parametrize("corrupt", BAD.values(), ids=BAD.keys())
def test_bad_arguments_raise(rng, corrupt, op):
    ids, table = corrupt(*make_inputs(rng, 5, 9, 64, np.float32))
    with pytest.raises(FermijitError):
        getattr(embedding, op)(ids, table)


def test_wrong_out_raises(rng):
    ids, table = make_inputs(rng, 5, 9, 64, np.float32)
    with pytest.raises(FermijitError):
        embedding.cpu(ids, table, out=np.empty((5, 63), np.float32))
