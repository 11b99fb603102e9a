"""The K-quant and Q5 references (ops/kquant.py) against the `gguf` package's dequantisers (a
port of llama.cpp's), llama.cpp's quantize_row_q8_K_ref read line by line, and each other."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from fermijit.ops import kquant, matvec
from tests.numerics import assert_close

FORMATS = list(kquant.FORMATS.values())
IDS = [f.name for f in FORMATS]
# The dequantised product against the integer one: fp32 rounding of each dequantised weight
# (one multiply and one subtract, ~1e-7 relative) summed over K terms of either sign.
PRODUCT_RTOL, PRODUCT_ATOL = 1e-5, 1e-5


def random_blocks(rng, fmt, rows, k, scale=0.01):
    """Random bytes (every bit pattern of the quants and packed scales), with finite fp16
    scales of about `scale`."""
    blocks = rng.integers(0, 256, (rows, fmt.n_bytes(k)), dtype=np.uint8)
    view = kquant.block_view(fmt, blocks)
    for o in fmt.scale_offsets:
        d = (rng.uniform(0.5, 1.5, view.shape[:-1]) * scale).astype(np.float16)
        view[..., o:o + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    return blocks


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_dequantize_is_gguf_bit_for_bit(rng, fmt):
    blocks = random_blocks(rng, fmt, 5, 2 * kquant.QK_K)
    ours = kquant.dequantize(fmt, blocks)
    theirs = quants.dequantize(blocks, GGMLQuantizationType(kquant.GGML_TYPE[fmt.name]))
    assert ours.dtype == np.float32 and ours.shape == (5, 2 * kquant.QK_K)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


def _q8_k_row(x):
    """quantize_row_q8_K_ref (ggml-quants.c) for one 256-block, scalar, as written there."""
    mx = amax = np.float32(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if not amax:
        return np.zeros(256, np.int8), np.float32(0)
    iscale = np.float32(-127) / mx
    q = []
    for v in x:
        f = np.float32(iscale * v) + np.float32(12582912)  # nearest_int's magic-number rounding
        i = int(np.array(f, np.float32).view(np.int32))
        q.append(min(127, (i & 0x007FFFFF) - 0x00400000))
    return np.array(q, np.int8), np.float32(1) / iscale


def test_q8_k_is_llama_cpps(rng):
    x = rng.standard_normal((3, 2 * kquant.QK_K)).astype(np.float32)
    x[1, :256] = 0                                       # an all-zero block
    x[2, 256:] = np.arange(256, dtype=np.float32) - 127  # a negative max; exact ties at .5
    x[2, 256 + 255] = -127.0
    x[2, 256:300] *= np.float32(0.5)
    q, d, bsums = kquant.quantize_q8_k(x)
    for t in range(3):
        for b in range(2):
            eq, ed = _q8_k_row(x[t, 256 * b:256 * (b + 1)])
            np.testing.assert_array_equal(q[t, 256 * b:256 * (b + 1)], eq)
            assert d[t, b].view(np.uint32) == ed.view(np.uint32)
    np.testing.assert_array_equal(bsums, q.reshape(3, -1, 16).astype(np.int32).sum(-1))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_reference_is_the_dequantised_product(rng, fmt):
    """The integer-sum reference equals the dequantised weights times the dequantised
    activations (so its groups, offsets and mins are placed right)."""
    rows, k = 7, 3 * kquant.QK_K
    blocks = random_blocks(rng, fmt, rows, k)
    x = rng.standard_normal((4, k)).astype(np.float32)
    if fmt.block_values == kquant.QK_K:
        xq, dx, _ = kquant.quantize_q8_k(x)
        xd = xq.astype(np.float64) * np.repeat(dx, kquant.QK_K, axis=1)
    else:
        xq, dx = matvec.quantize_act_reference(x)
        xd = (xq.astype(np.float64) * dx[..., None]).reshape(4, k)
    expected = xd @ kquant.dequantize(fmt, blocks).astype(np.float64).T
    assert_close(f"{fmt.name} reference", expected, kquant.reference(fmt, blocks, x),
                 PRODUCT_ATOL, PRODUCT_RTOL)
    np.testing.assert_array_equal(kquant.reference(fmt, blocks, x[1]),
                                  kquant.reference(fmt, blocks, x[1:2])[0])


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_scales_f16_are_the_blocks_scales(rng, fmt):
    blocks = random_blocks(rng, fmt, 2, kquant.QK_K, scale=3.0)
    s = kquant.scales_f16(fmt, blocks)
    assert s.shape == (2, kquant.QK_K // fmt.block_values, len(fmt.scale_offsets))
    assert np.all((s > 1) & (s < 5))
