"""llama.cpp's reference quantisers (ops/kquant_quantize.py): the Numba searches against the numpy
ones bit for bit, Q5_0/Q5_1 against the `gguf` package's quantisers (a port of llama.cpp's), and
the error each format's blocks dequantise with against llama.cpp's own on the same rows. That the
bytes are llama.cpp's: tests/model/test_quant_mix.py (a whole Q4_K_M file), and by hand against
libggml: `python -m tests.model.llama_quants LIBGGML_BASE_SO`."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from fermijit import FermijitError
from fermijit.ops import kquant, kquant_quantize

FORMATS = list(kquant.FORMATS.values())
IDS = [f.name for f in FORMATS]
# Relative RMS error of llama.cpp's quantize_row_<fmt>_ref blocks, dequantised, on the 64 x 1024
# N(0, 1) rows of default_rng(0) (libggml-base of llama-cpp-python 0.3.36's llama.cpp, measured
# with tests/model/llama_quants.py; fermijit's blocks were those bytes).
LLAMA_REL_RMS = {"q4_k": 0.07146580763477915, "q5_k": 0.03628793808873678,
                 "q6_k": 0.017776552091403365, "q5_0": 0.04278220387976158,
                 "q5_1": 0.03803682833491309}


def rows(rng, n_rows, k):
    """Gaussian rows of varied scale with the cases the searches branch on: an all-zero
    super-block, constant sub-blocks of either sign (max == min), all-positive sub-blocks (the
    min clamped to 0), one outlier, values near the fp16 scale's underflow."""
    x = (rng.standard_normal((n_rows, k)) * rng.uniform(1e-3, 1, (n_rows, 1))).astype(np.float32)
    x[0, :256] = 0
    x[1, :32], x[1, 32:64] = 0.5, -0.25
    x[2, 64:96] = np.abs(x[2, 64:96])
    x[3, 7] = 40.0
    x[4] *= np.float32(1e-6)
    return x


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("shape", [(7, 512), (3, 2, 256)], ids=["R7-K512", "E3-R2-K256"])
def test_numba_is_the_reference_bit_for_bit(rng, fmt, shape):
    x = rows(rng, int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
    expected = kquant_quantize.quantize(fmt, x)
    got = kquant_quantize.quantize_cpu(fmt, x)
    assert got.dtype == np.uint8 and got.shape == shape[:-1] + (fmt.n_bytes(shape[-1]),)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("fmt", [kquant.Q5_0, kquant.Q5_1], ids=["q5_0", "q5_1"])
def test_q5_is_gguf_bit_for_bit(rng, fmt):
    x = rows(rng, 6, 256)
    theirs = quants.quantize(x, GGMLQuantizationType(kquant.GGML_TYPE[fmt.name]))
    np.testing.assert_array_equal(kquant_quantize.quantize(fmt, x), theirs)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_error_is_llama_cpps(fmt):
    x = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)
    y = kquant.dequantize(fmt, kquant_quantize.quantize_cpu(fmt, x)).astype(np.float64)
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x.astype(np.float64) ** 2))
    assert rel == pytest.approx(LLAMA_REL_RMS[fmt.name], rel=1e-9)


def test_zero_and_constant_blocks(rng):
    x = np.zeros((2, 256), np.float32)
    x[1] = -0.3                                    # every sub-block flat: scale 0, its min only
    for fmt in FORMATS:
        y = kquant.dequantize(fmt, kquant_quantize.quantize_cpu(fmt, x))
        np.testing.assert_array_equal(y[0], 0)
        assert np.abs(y[1] + 0.3).max() < 2e-3, fmt.name   # fp16 scale's rounding


def test_ragged_rows_are_refused():
    with pytest.raises(FermijitError, match="not whole 256-blocks"):
        kquant_quantize.quantize_cpu(kquant.Q4_K, np.zeros((2, 288), np.float32))
