"""act_quant.gpu (kernels_ptx/act_quant.ptx): the codes and scales equal the CPU's quantize_act
bit for bit (issue 10 item 3), on random rows of ragged widths and on the blocks where rounding
is delicate: exact halves and their neighbours, zeros, huge and tiny blocks, subnormals."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.jit import cpu
from fermijit.ops import act_quant, gemm, matvec
from tests.gpu import needs_gpu
from tests.numerics import poisoned

ISAS = list(cpu.variants_up_to(cpu.selected_isa()))
# [rows, K]: one block, 3 blocks, 29 (every layout of the AVX-512 Q8Act: wide steps, half steps,
# natural tail), the model's hidden width, and more rows than one launch's 256 threads.
SHAPES = {"T1-K32": (1, 32), "T7-K96": (7, 96), "T5-K928": (5, 928), "T3-K2048": (3, 2048),
          "T300-K64": (300, 64)}


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def delicate_blocks(rng):
    """[n, 32] blocks whose codes a wrong rounding step would change."""
    f = np.float32
    halves = np.arange(-126.5, 127, 1, dtype=f)         # led by +-127: d = 1, so x·inv = x
    runs = [halves, np.nextafter(halves, f(-np.inf)), np.nextafter(halves, f(np.inf)),
            np.array([0.5 - 2 ** -25, -(0.5 - 2 ** -25)], f)]  # v + 0.5 rounds up to 1 in fp32
    blocks = []
    for lead, run in zip((127, -127, 127, -127), runs):
        for i in range(0, run.size, 31):
            blocks.append(np.concatenate([[f(lead)], run[i:i + 31], np.zeros(31, f)])[:32])
    blocks += [np.zeros(32, f), np.full(32, f(-0.0)), np.full(32, f(3.0e38)),
               np.linspace(-3.4e38, 3.4e38, 32, dtype=f), np.full(32, f(-1e-30)),
               np.linspace(-1e-36, 6e-37, 32, dtype=f),          # d subnormal, 1/d finite
               np.concatenate([[f(1)], np.full(31, f(1e-40))]),  # subnormal elements
               np.eye(32, dtype=f)[5] * f(-7)]                   # one value
    # x · inv inexact near a half: odd multiples of half a step, at random scales.
    scale = rng.uniform(0.01, 10, (16, 1)).astype(f)
    blocks += list((rng.integers(-127, 127, (16, 32)) + f(0.5)).astype(f) * scale / f(127))
    return np.stack(blocks).astype(f)


def check_codes(x, out, q, d):
    eq, ed, eout = act_quant.reference(x)
    np.testing.assert_array_equal(q, eq)
    np.testing.assert_array_equal(bits(d), bits(ed))
    np.testing.assert_array_equal(bits(out), bits(eout))


@needs_gpu
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_codes_and_scales_equal_the_reference(rng, shape):
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100, (shape[0], 1))).astype(np.float32)
    out = poisoned(shape)
    got, q, d = act_quant.gpu(x, out=out, codes=True)
    assert got is out
    check_codes(x, out, q, d)


@needs_gpu
def test_delicate_blocks_equal_the_reference(rng):
    x = delicate_blocks(rng)
    out, q, d = act_quant.gpu(x.reshape(1, -1), codes=True)
    check_codes(x.reshape(1, -1), out, q, d)
    assert (q[0, :32] == 127).any() and (np.abs(q) <= 127).all()


@needs_gpu
@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_codes_equal_the_cpu_kernel(rng, isa):
    """The codes and scales quantize_act (the CPU prefill's kernel) lays out for `isa`."""
    rows = np.resize(delicate_blocks(rng), (2 * 29, 32)).reshape(2, 29 * 32)  # 29 blocks a row
    x = np.concatenate([rows, rng.standard_normal((3, 29 * 32)).astype(np.float32)])
    act = matvec.quantize_act(x, isa)
    offs = gemm.x_offsets(isa, x.shape[1] // 32)
    cpu_q = np.stack([np.concatenate([act.xq[:, lo:lo + 16], act.xq[:, hi:hi + 16]], axis=1)
                      for lo, hi in offs], axis=1).reshape(x.shape)
    _, q, d = act_quant.gpu(x, codes=True)
    np.testing.assert_array_equal(q, cpu_q)
    np.testing.assert_array_equal(bits(d), bits(act.dx))


@needs_gpu
def test_in_place_on_the_device(rng):
    from fermijit.jit import gpu

    x = rng.standard_normal((70, 160)).astype(np.float32)
    on_device = gpu.to_device("test", "x", x, np.float32)
    assert act_quant.gpu(on_device, out=on_device) is on_device
    np.testing.assert_array_equal(bits(on_device.get()), bits(act_quant.reference(x)[2]))


@needs_gpu
@pytest.mark.parametrize("x", [np.zeros((3, 40), np.float32), np.zeros((3, 64)),
                               np.zeros((4, 64), np.float32)[:, ::2]],
                         ids=["ragged-block", "float64", "not-contiguous"])
def test_bad_arguments_raise(x):
    with pytest.raises(FermijitError):
        act_quant.gpu(x)


@needs_gpu
def test_misaligned_device_array_raises():
    from fermijit.jit import gpu

    base = gpu.empty((65 * 32,))
    view = base[4:4 + 64 * 32].reshape(64, 32)                         # 16 bytes in: aligned
    act_quant.gpu(view, out=view)
    with pytest.raises(FermijitError, match="boundary"):
        act_quant.gpu(base[1:1 + 64 * 32].reshape(64, 32))


def test_reference_rejects_ragged_blocks():
    with pytest.raises(FermijitError, match="32-blocks"):
        act_quant.reference(np.zeros((2, 33), np.float32))


# --- Q8_K (issue 34): the K-quant products' rounding, per 256-block ----------------------------

# [rows, K]: one block, ragged rows, the model's hidden width, more blocks than a launch's 256
# threads.
K_SHAPES = {"T1-K256": (1, 256), "T7-K768": (7, 768), "T3-K2048": (3, 2048),
            "T300-K512": (300, 512)}


def delicate_k_blocks(rng):
    """[n, 256] blocks whose Q8_K codes a wrong step would change: led by -127 (iscale = 1, so
    iscale·x = x: exact halves tie to even), a largest |x| met first with either sign (the sign
    of d), zeros, and random odd multiples of half a step."""
    f = np.float32
    halves = np.arange(-126.5, 127, 1, dtype=f)                      # 254 values
    blocks = [np.concatenate([[f(-127)], halves, [f(0)]]),
              np.concatenate([[f(-127)], np.nextafter(halves, f(np.inf)), [f(0)]]),
              np.concatenate([[f(-127)], np.nextafter(halves, f(-np.inf)), [f(0)]])]
    tie = np.zeros(256, f)
    tie[[3, 9]] = f(2.5), f(-2.5)              # |max| twice: the first (+2.5) sets the sign
    blocks += [tie, -tie, np.zeros(256, f), np.full(256, f(-0.0)),
               np.linspace(-3.4e38, 3.4e38, 256, dtype=f), np.full(256, f(-1e-30))]
    scale = rng.uniform(0.01, 10, (8, 1)).astype(f)
    blocks += list((rng.integers(-127, 127, (8, 256)) + f(0.5)).astype(f) * scale / f(127))
    return np.stack(blocks).astype(f)


def check_k_codes(x, out, q, d):
    eq, ed, eout = act_quant.q8_k_reference(x)
    np.testing.assert_array_equal(q, eq)
    np.testing.assert_array_equal(bits(d), bits(ed))
    np.testing.assert_array_equal(bits(out), bits(eout))


def test_q8_k_reference_is_the_cpu_kernels_rounding(rng):
    """q8_k_reference's codes and scales are ops/kquant_matvec.py's (the CPU's K-quant
    products' input), bit for bit, and out = q · d."""
    from fermijit.ops import kquant_matvec

    delicate = delicate_k_blocks(rng).reshape(1, -1)
    x = np.concatenate([delicate, rng.standard_normal((3, delicate.shape[1])).astype(np.float32)])
    q, d, out = act_quant.q8_k_reference(x)
    act = kquant_matvec.quantize_act(x)
    np.testing.assert_array_equal(q, act.xq)
    np.testing.assert_array_equal(bits(d), bits(act.d))
    expected = (q.reshape(len(x), -1, 256).astype(np.float32) * d[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(bits(out), bits(expected))


@needs_gpu
@pytest.mark.parametrize("shape", K_SHAPES.values(), ids=K_SHAPES.keys())
def test_q8_k_codes_and_scales_equal_the_reference(rng, shape):
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100, (shape[0], 1))).astype(np.float32)
    out = poisoned(shape)
    got, q, d = act_quant.q8_k_gpu(x, out=out, codes=True)
    assert got is out
    check_k_codes(x, out, q, d)


@needs_gpu
def test_q8_k_delicate_blocks_equal_the_reference(rng):
    x = delicate_k_blocks(rng).reshape(1, -1)
    out, q, d = act_quant.q8_k_gpu(x, out=poisoned(x.shape), codes=True)
    check_k_codes(x, out, q, d)
    assert (np.abs(q[0, :256]) == 127).any() and (np.abs(q) <= 127).all()


@needs_gpu
def test_q8_k_in_place_on_the_device(rng):
    from fermijit.jit import gpu

    x = rng.standard_normal((70, 512)).astype(np.float32)
    on_device = gpu.to_device("test", "x", x, np.float32)
    assert act_quant.q8_k_gpu(on_device, out=on_device) is on_device
    np.testing.assert_array_equal(bits(on_device.get()), bits(act_quant.q8_k_reference(x)[2]))


def test_q8_k_rejects_ragged_blocks():
    with pytest.raises(FermijitError, match="256-blocks"):
        act_quant.q8_k_reference(np.zeros((2, 288), np.float32))
