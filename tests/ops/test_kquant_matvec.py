"""K-quant products (ops/kquant_matvec.py): every ISA variant this CPU runs against the
exact-integer reference (ops/kquant.py), and the Q8_K activations bit for bit."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.jit import cpu
from fermijit.ops import kquant, kquant_matvec
from tests.numerics import assert_close, poisoned
from tests.ops.test_kquant import random_blocks

ISAS = cpu.variants_up_to(cpu.selected_isa())
# Each super-block's integer sum is exact (i32); what remains is fp32 rounding of two
# multiply-adds per super-block and register and the final horizontal sum, a few ulps of the
# row's scale. Measured here: at most 1.8e-7 of the largest |y|.
RTOL, ATOL_OF_MAX = 1e-5, 2e-6
# (rows, K, tokens): rows past the GEMM tile's 2 (and odd), tokens past its 4, K of 1 to 8
# super-blocks; 2-3 tokens (FEW_TOKENS: the GEMV's row streams) with rows past the streams'
# share and left over.
SHAPES = {"R1-K256-T1": (1, 256, 1), "R5-K768-T1": (5, 768, 1), "R33-K2048-T1": (33, 2048, 1),
          "R7-K512-T5": (7, 512, 5), "R12-K1024-T9": (12, 1024, 9), "R3-K256-T4": (3, 256, 4),
          "R1-K256-T2": (1, 256, 2), "R13-K768-T2": (13, 768, 2), "R29-K512-T3": (29, 512, 3)}
FORMATS = list(kquant.FORMATS.values())


def _check(name, expected, actual):
    assert_close(name, expected, actual, ATOL_OF_MAX * np.abs(expected).max(), RTOL)


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_reference(rng, fmt, isa, shape):
    rows, k, n_tok = shape
    blocks = random_blocks(rng, fmt, rows, k)
    x = rng.standard_normal((n_tok, k) if n_tok > 1 else k).astype(np.float32)
    out = poisoned((n_tok, rows) if n_tok > 1 else rows)
    y = kquant_matvec.cpu(fmt, blocks, x, out=out, isa=isa)
    assert y is out
    _check(f"{fmt.name} {isa.label}", kquant.reference(fmt, blocks, x), y)


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_subnormal_and_negative_scales(rng, fmt, isa):
    """Super-block scales below fp16's normal range (2^-14), of both signs, zeros among them, as
    the quantiser gives real weights (Q6_K's d ~1.5e-5): code without F16C converts them its own
    way for Q5_K/Q6_K (simd.fp16_to_f32 subnormal_safe), the rest as before; all as the
    reference."""
    rows, k = 9, 768
    blocks = random_blocks(rng, fmt, rows, k)
    view = kquant.block_view(fmt, blocks)
    for o in fmt.scale_offsets:
        d = (rng.uniform(0, 6e-5, view.shape[:-1]) * rng.choice([-1, 1], view.shape[:-1]))
        d = d.astype(np.float16)
        d.flat[::7] = 0
        view[..., o:o + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    for n_tok in (1, 2, 5):
        x = rng.standard_normal((n_tok, k)).astype(np.float32)
        y = kquant_matvec.cpu(fmt, blocks, x, out=poisoned((n_tok, rows)), isa=isa)
        _check(f"{fmt.name} {isa.label} T={n_tok}", kquant.reference(fmt, blocks, x), y)


def test_q8_k_kernel_is_the_reference(rng):
    x = rng.standard_normal((4, 768)).astype(np.float32)
    x[1, 256:512] = 0
    x[2, :256] = np.round(x[2, :256] * 4) / 4  # many values at the same magnitudes
    act = kquant_matvec.quantize_act(x)
    q, d, bsums = kquant.quantize_q8_k(x)
    np.testing.assert_array_equal(act.xq, q)
    np.testing.assert_array_equal(act.d.view(np.uint32), d.view(np.uint32))
    np.testing.assert_array_equal(act.bsums, bsums)


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
@pytest.mark.parametrize("n_tok", [2, 3, 5])
def test_gemv_row_is_the_gemm_row_for_one_token(rng, fmt, n_tok):
    """A token's products in a batch (a verify step's 2-3 rows, the GEMM tile's more) are its own:
    each tile sums the same terms in one order."""
    blocks = random_blocks(rng, fmt, 23, 1024)
    x = rng.standard_normal((n_tok, 1024)).astype(np.float32)
    y = kquant_matvec.cpu(fmt, blocks, x)
    for t in range(n_tok):
        np.testing.assert_array_equal(kquant_matvec.cpu(fmt, blocks, x[t]), y[t])


def test_bad_shapes_are_one_line(rng):
    fmt = kquant.Q4_K
    blocks = random_blocks(rng, fmt, 4, 512)
    with pytest.raises(FermijitError, match="300 inputs are not whole 256-blocks"):
        kquant_matvec.cpu(fmt, blocks, np.zeros(300, np.float32))
    with pytest.raises(FermijitError, match="rows of 288 bytes for x of 256"):
        kquant_matvec.cpu(fmt, blocks, np.zeros(256, np.float32))
    with pytest.raises(FermijitError, match="out has shape"):
        kquant_matvec.cpu(fmt, blocks, np.zeros(512, np.float32), out=np.empty(5, np.float32))


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_gathered_is_each_experts_product(rng, fmt, isa):
    n_experts, rows, k = 5, 7, 512
    blocks = np.stack([random_blocks(rng, fmt, rows, k) for _ in range(n_experts)])
    idx = np.array([3, 0, 4], np.int32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    for act_rows in (x[:1], x):  # one token for every expert, or one row each
        act = kquant_matvec.quantize_for(fmt, act_rows)
        out = poisoned((3, rows))
        kquant_matvec.gathered(fmt, blocks, idx, act, out, isa=isa)
        for i, e in enumerate(idx):
            _check(f"{fmt.name} {isa.label} expert {e}",
                   kquant.reference(fmt, blocks[e], act_rows[min(i, len(act_rows) - 1)]), out[i])
    with pytest.raises(FermijitError, match="expert index out of range"):
        kquant_matvec.gathered(fmt, blocks, np.array([5], np.int32),
                               kquant_matvec.quantize_for(fmt, x[:1]))


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_gathered_with_the_shared_expert(rng, fmt):
    """The always-on matrices ride after the routed ones, on x or on rows of their own."""
    n_experts, rows, k = 4, 5, 256
    blocks = np.stack([random_blocks(rng, fmt, rows, k) for _ in range(n_experts)])
    shared = random_blocks(rng, fmt, rows, k)[None]
    idx = np.array([2, 1], np.int32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    mats = [blocks[2], blocks[1], shared[0]]
    for act_rows in (x[:1], x):
        act = kquant_matvec.quantize_for(fmt, act_rows)
        out = poisoned((3, rows))
        kquant_matvec.gathered(fmt, blocks, idx, act, out, shared=shared)
        for i, w in enumerate(mats):
            _check(f"{fmt.name} matrix {i}",
                   kquant.reference(fmt, w, act_rows[min(i, len(act_rows) - 1)]), out[i])


def test_launch_is_the_product(rng):
    fmt = kquant.Q6_K
    blocks = random_blocks(rng, fmt, 6, 512)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    act = kquant_matvec.quantize_for(fmt, x)
    out = poisoned((1, 6))
    fn, args = kquant_matvec.launch(fmt, blocks, act, out)
    fn(*args)
    np.testing.assert_array_equal(out, kquant_matvec.cpu(fmt, blocks, x))
    x2 = rng.standard_normal((1, 512)).astype(np.float32)  # the quantise launch refills `act`
    fn, args = kquant_matvec.quantize_launch(fmt, x2, act)
    fn(*args)
    np.testing.assert_array_equal(act.xq, kquant_matvec.quantize_act(x2).xq)
