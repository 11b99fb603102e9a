"""Q4_0/Q8_0 against gguf's own numpy quantisers (the GGML byte format) and round-trip bounds."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import quant

gguf = pytest.importorskip("gguf")

SHAPES = {"R1-K32": (1, 32), "R7-K96": (7, 96), "R33-K512": (33, 512)}


def _inputs(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 10)
    x[0, :32] = 0.0                     # an all-zero block: d = 0, every nibble 8
    if shape[1] > 32:
        x[-1, 32:64] = 3.0              # ties in |x|: the first one sets the sign of d
        x[-1, 40] = -3.0
    return x


def _ggml_bytes(qs, d, half_block_bytes):
    """Our structure-of-arrays tensors interleaved into GGML's [d | qs] blocks."""
    nb = d.shape[-1]
    blocks = np.concatenate([d.reshape(-1, nb, 1).view(np.uint8).reshape(-1, nb, 2),
                             qs.reshape(-1, nb, half_block_bytes).view(np.uint8)], axis=-1)
    return blocks.reshape(d.shape[0], -1)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_q4_0_matches_ggml_bytes(rng, shape):
    x = _inputs(rng, shape)
    qs, d = quant.quantize_q4_0(x)
    assert qs.shape == (shape[0], shape[1] // 2) and qs.dtype == np.uint8
    assert d.shape == (shape[0], shape[1] // 32) and d.dtype == np.float16
    expected = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(_ggml_bytes(qs, d, 16), expected)
    np.testing.assert_array_equal(
        quant.dequantize_q4_0(qs, d),
        gguf.quants.dequantize(expected, gguf.GGMLQuantizationType.Q4_0))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_q4_0_cpu_matches_reference_bytes(rng, shape):
    x = _inputs(rng, shape)
    qs, d = quant.quantize_q4_0(x)
    out = (np.full_like(qs, 0xAA), np.full_like(d, np.nan))
    qs_cpu, d_cpu = quant.quantize_q4_0_cpu(x, out=out)
    np.testing.assert_array_equal(qs_cpu, qs)
    np.testing.assert_array_equal(d_cpu.view(np.uint16), d.view(np.uint16))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_q8_0_matches_ggml_bytes(rng, shape):
    x = _inputs(rng, shape)
    x.flat[5] = 0.5 * np.abs(x).max()   # exercise rounding at exactly one half step
    qs, d = quant.quantize_q8_0(x)
    expected = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(_ggml_bytes(qs, d, 32), expected)


def test_round_trip_error_is_within_half_a_step(rng):
    x = rng.standard_normal((16, 256)).astype(np.float32)
    # Half a step of rounding, plus the fp16 rounding of d (2^-11 relative) times the largest |q|.
    for quantize, dequantize, step, q_max in ((quant.quantize_q4_0, quant.dequantize_q4_0, 1.0, 8),
                                              (quant.quantize_q8_0, quant.dequantize_q8_0, 0.5, 127)):
        qs, d = quantize(x)
        err = np.abs(dequantize(qs, d) - x).reshape(16, -1, 32)
        bound = (step + q_max * 2.0 ** -11) * np.abs(d.astype(np.float32))[..., None] + 1e-7
        assert (err <= bound).all(), quantize.__name__


def test_bad_block_size():
    with pytest.raises(FermijitError, match="multiple of 32"):
        quant.quantize_q4_0(np.zeros((2, 33), np.float32))
    with pytest.raises(FermijitError, match="32-blocks"):
        quant.quantize_q4_0_cpu(np.zeros((2, 40), np.float32))
    with pytest.raises(FermijitError, match="dtype"):
        quant.quantize_q4_0_cpu(np.zeros((2, 32), np.float32),
                                out=(np.zeros((2, 16), np.int8), np.zeros((2, 1), np.float16)))
