"""Q8_0 rows of the KV cache: the reference is matvec's rounding of activations; `store` writes
a pass's rows into a cache, bit for bit the reference's, leaving the other rows alone."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import kv_quant, matvec


def test_reference_is_the_activation_rounding(rng):
    x = (rng.standard_normal((3, 2, 64)) * 5).astype(np.float32)
    x[0, 0, :32] = 0                                           # an all-zero block: d 0, codes 0
    rows = kv_quant.reference(x)
    q, d = matvec.quantize_act_reference(x.reshape(-1, 64))
    np.testing.assert_array_equal(rows.qs, q.reshape(3, 2, 64))
    np.testing.assert_array_equal(rows.d, d.reshape(3, 2, 2))
    assert rows.qs.dtype == np.int8 and rows.d.dtype == np.float32
    assert np.abs(rows.dequantize() - x).max() <= rows.d.max() / 2 * 1.0001


@pytest.mark.parametrize("shape", [(5, 2, 256), (1, 1, 32), (7, 3, 96), (67, 2, 256)],
                         ids=["T5-Hkv2-D256", "T1-Hkv1-D32", "T7-Hkv3-D96", "T67-Hkv2-D256"])
def test_store_matches_reference(rng, shape):
    T, Hkv, D = shape
    x = rng.standard_normal(shape).astype(np.float32)
    cache = kv_quant.empty((Hkv, T + 13, D), np.zeros)
    cache.d[...] = np.nan
    kv_quant.store(x, cache, 9)
    expected = kv_quant.reference(x.transpose(1, 0, 2))
    np.testing.assert_array_equal(cache.qs[:, 9:9 + T], expected.qs)
    np.testing.assert_array_equal(cache.d[:, 9:9 + T], expected.d)
    assert np.isnan(cache.d[:, :9]).all() and np.isnan(cache.d[:, 9 + T:]).all()


def test_rows_index_like_the_fp32_cache(rng):
    rows = kv_quant.reference(rng.standard_normal((2, 10, 64)).astype(np.float32))
    part = rows[:, 3:7]
    assert part.shape == (2, 4, 64) and part.d.shape == (2, 4, 2)
    assert part.nbytes == 2 * 4 * 64 + 2 * 4 * 2 * 4
    copy = part.copy()
    copy.qs[...] = 0
    assert rows.qs[:, 3:7].any()


def test_bad_inputs(rng):
    x = rng.standard_normal((2, 2, 32)).astype(np.float32)
    cache = kv_quant.empty((2, 4, 32))
    with pytest.raises(FermijitError, match="rows 3..4"):
        kv_quant.store(x, cache, 3)
    with pytest.raises(FermijitError, match="qs has shape"):
        kv_quant.store(x, kv_quant.empty((3, 4, 32)), 0)
    with pytest.raises(FermijitError, match="whole 32-blocks"):
        kv_quant.empty((2, 4, 48))
    with pytest.raises(FermijitError, match="whole 32-blocks"):
        kv_quant.reference(np.zeros((2, 40), np.float32))
