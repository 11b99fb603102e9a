"""fermijit.jit.mathf: the vectorisable exp, sigmoid and silu against float64 numpy."""

import numba
import numpy as np

from fermijit.jit import mathf
from fermijit.jit.cpu import FASTMATH
from fermijit.ops import attention_simd

# Cephes' expf: about one ulp; measured 8.0e-8 max over [-87.3, 88.3] (2e6 points).
EXP_RTOL = 2.5e-7


@numba.njit(fastmath=FASTMATH)  # as the kernels that call them are compiled
def _apply(kind, x, out):
    for i in range(x.size):
        if kind == 0:
            out[i] = mathf.exp(x[i])
        elif kind == 1:
            out[i] = mathf.sigmoid(x[i])
        else:
            out[i] = mathf.silu(x[i])


def run(kind, x):
    x = np.asarray(x, np.float32)
    out = np.full_like(x, np.nan)
    _apply(kind, x, out)
    return out


def test_exp_is_accurate_over_the_normal_range():
    x = np.concatenate([np.linspace(-87.3, 88.3, 200_001, dtype=np.float32),
                        np.random.default_rng(0).standard_normal(10_000).astype(np.float32)])
    expected = np.exp(x.astype(np.float64))
    assert np.max(np.abs(run(0, x) - expected) / expected) < EXP_RTOL


def test_exp_edges():
    x = [np.nan, -np.inf, -1000, -87.4, 0, 88.4, 1000, np.inf]
    y = run(0, x)
    assert np.isnan(y[0])
    assert list(y[1:]) == [0, 0, 0, 1, np.inf, np.inf, np.inf]


def test_sigmoid_and_silu():
    x = np.concatenate([np.linspace(-100, 100, 20_001, dtype=np.float32), [-np.inf, np.inf]])
    x64 = x.astype(np.float64)
    sig = 1 / (1 + np.exp(-x64))
    assert np.allclose(run(1, x), sig, rtol=EXP_RTOL, atol=1e-30)
    assert np.allclose(run(2, x[:-2]), x64[:-2] * sig[:-2], rtol=EXP_RTOL, atol=1e-30)
    assert not np.isnan(run(2, [-1000.0, 1000.0])).any()


@numba.njit
def _exp_rows(p, n):
    totals = np.empty(p.shape[0], np.float32)
    for g in range(p.shape[0]):
        totals[g] = attention_simd.exp_row(p, g, n, np.float32(0))
    return totals


def test_the_emitted_exp_has_exps_bits():
    """mathf.emit_exp (the vector exp of attention's softmax, ops/attention_simd.exp_row) against
    `exp` bit for bit, edges included; exp_row zeroes the rest of its last vector and sums."""
    x = np.concatenate([np.linspace(-90, 90, 4000, dtype=np.float32),
                        [np.nan, -np.inf, np.inf, -87.4, -87.3, 88.3, 88.4, 0, -0.0]])
    x = np.concatenate([x, np.zeros(-x.size % 64, np.float32)]).astype(np.float32)
    p = x.reshape(-1, 64).copy()
    _exp_rows(p, 64)
    assert np.array_equal(p.ravel(), run(0, x), equal_nan=True)
    p = np.full((2, 64), 7.0, np.float32)
    totals = _exp_rows(p, 37)
    assert np.array_equal(p[:, :37], np.full((2, 37), run(0, [7.0])[0]))
    assert not p[:, 37:48].any()                       # the rest of the third vector
    assert np.allclose(totals, 37 * np.exp(7.0), rtol=1e-6)
