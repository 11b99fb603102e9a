"""fermijit.jit.mathf: the vectorisable exp, sigmoid and silu against float64 numpy."""

import numba
import numpy as np

from fermijit.jit import mathf
from fermijit.jit.cpu import FASTMATH

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
