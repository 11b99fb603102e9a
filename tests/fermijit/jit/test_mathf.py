"""fermijit.jit.mathf: the vectorisable exp, sigmoid and silu against float64 numpy; the IR exp
against exp."""

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from fermijit.jit import mathf, simd
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


@intrinsic
def _exp_ir(typingctx, x, out):
    """out[:16] = emit_exp of x[:16] as one vector; out[16] = emit_exp of x[16] as a scalar."""
    sig = types.none(x, out)

    def codegen(context, builder, sig, args):
        xa, oa = (context.make_array(sig.args[i])(context, builder, args[i]) for i in range(2))
        v16 = simd.vec(simd.F32, 16)
        builder.store(mathf.emit_exp(builder, simd.load(builder, xa.data, 0, v16)),
                      builder.bitcast(oa.data, v16.as_pointer()), align=4)
        builder.store(mathf.emit_exp(builder, simd.load_scalar(builder, xa.data, 64, simd.F32)),
                      builder.bitcast(simd.byte_ptr(builder, oa.data, 64), simd.F32.as_pointer()))
        return context.get_dummy_value()

    return sig, codegen


@numba.njit
def _apply_ir(x, out):
    for i in range(0, x.size - 16, 17):
        _exp_ir(x[i:i + 17], out[i:i + 17])


def test_emit_exp_has_the_bits_of_exp():
    """The IR exp (attention's softmax, 16 at a time) is `exp` bit for bit, vector and scalar,
    edges included."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-100, 100, 17 * 3000), rng.uniform(-10, 2, 17 * 3000),
                        [np.nan, -np.inf, np.inf, -1000, -87.4, -87.3, 0, -0.0, 88.3, 88.4, 1000,
                         -87.2, 88.2, 1e-30, -1e-30, 0.5, -0.5]]).astype(np.float32)
    out = np.full_like(x, 7.0)
    _apply_ir(x, out)
    np.testing.assert_array_equal(out, run(0, x))
